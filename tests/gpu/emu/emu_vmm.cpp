/*
 * emu_vmm.cpp - shm/devmem.h for the CPU emulation: a shared
 * allocation is a memfd mapped into each process that holds it, so that kvd
 * --gpu and its workers run the GPU path end to end on the CPU (the device
 * address is the mapping's address; each process has its own). Granularity
 * 2 MiB, as the real driver's minimum on the devices we target.
 */
#include <errno.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "emu_cuda.h"
extern "C" {
#include "err.h"
}
#include "devmem.h"

void emu_register(void *p, size_t n, bool add);

struct devmem {
    void *ptr;          /* the mapping */
    uint64_t bytes;     /* its size */
    int fd;             /* the creator's memfd, else -1 */
    int dev;
};

static const uint64_t GRANULE = 2u << 20;

extern "C" int devmem_probe(int dev, struct devmem_dev *info, char *why, size_t whylen)
{
    if (getenv("EMU_NODEV") != nullptr || dev != 0)
        return kvd_seterr(why, whylen, KVD_EUNAVAILABLE, "no usable CUDA device: no device %d (emulation)", dev);
    if (info != nullptr) {
        memset(info, 0, sizeof(*info));
        snprintf(info->name, sizeof(info->name), "CPU emulation");
        info->total_bytes = 16ull << 30;
        info->free_bytes = 8ull << 30;
        info->granularity = GRANULE;
    }
    return 0;
}

static devmem_t *map_fd(int dev, int fd, uint64_t bytes, bool own, char *err, size_t errlen)
{
    void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        kvd_seterr(err, errlen, KVD_EINTERNAL, "mmap of %llu bytes: %s", (unsigned long long)bytes, strerror(errno));
        return nullptr;
    }
    devmem_t *m = new (std::nothrow) devmem{ p, bytes, own ? fd : -1, dev };
    if (m == nullptr) {
        munmap(p, bytes);
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        return nullptr;
    }
    emu_register(p, bytes, true);
    return m;
}

extern "C" devmem_t *devmem_create(int dev, uint64_t bytes, char *err, size_t errlen)
{
    if (devmem_probe(dev, nullptr, err, errlen) != 0)
        return nullptr;
    bytes = (bytes + GRANULE - 1) / GRANULE * GRANULE;
    const int fd = memfd_create("kvd-emu-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
        kvd_seterr(err, errlen, KVD_EINTERNAL, "memfd of %llu bytes: %s", (unsigned long long)bytes, strerror(errno));
        if (fd >= 0)
            close(fd);
        return nullptr;
    }
    devmem_t *m = map_fd(dev, fd, bytes, true, err, errlen);
    if (m == nullptr)
        close(fd);
    return m;
}

extern "C" devmem_t *devmem_import(int dev, int fd, uint64_t bytes, char *err, size_t errlen)
{
    if (devmem_probe(dev, nullptr, err, errlen) != 0)
        return nullptr;
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "import: descriptor %d is not open", fd);
        return nullptr;
    }
    if (bytes == 0 || bytes % GRANULE != 0 || (uint64_t)st.st_size < bytes) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "import: %llu bytes do not fit the allocation", (unsigned long long)bytes);
        return nullptr;
    }
    return map_fd(dev, fd, bytes, false, err, errlen);
}

extern "C" void devmem_destroy(devmem_t **mp)
{
    if (mp == nullptr || *mp == nullptr)
        return;
    devmem_t *m = *mp;
    emu_register(m->ptr, m->bytes, false);
    munmap(m->ptr, m->bytes);
    if (m->fd >= 0)
        close(m->fd);
    delete m;
    *mp = nullptr;
}

extern "C" void *devmem_ptr(const devmem_t *m) { return m->ptr; }
extern "C" uint64_t devmem_bytes(const devmem_t *m) { return m->bytes; }
extern "C" int devmem_device(const devmem_t *m) { return m->dev; }
extern "C" int devmem_fd(const devmem_t *m) { return m->fd; }

extern "C" int devmem_read(void *dst_host, const void *src_dev, size_t bytes, char *err, size_t errlen)
{
    if (cudaMemcpy(dst_host, src_dev, bytes, cudaMemcpyDeviceToHost) == cudaSuccess)
        return 0;
    return kvd_seterr(err, errlen, KVD_EINTERNAL, "copy from the device failed");
}

extern "C" int devmem_write(void *dst_dev, const void *src_host, size_t bytes, char *err, size_t errlen)
{
    if (cudaMemcpy(dst_dev, src_host, bytes, cudaMemcpyHostToDevice) == cudaSuccess)
        return 0;
    return kvd_seterr(err, errlen, KVD_EINTERNAL, "copy to the device failed");
}

extern "C" int devmem_attach(int dev, char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    return cudaSetDevice(dev) == cudaSuccess ? 0 : KVD_EUNAVAILABLE;
}

extern "C" void *devmem_host_alloc(size_t bytes)
{
    void *p = NULL;
    return cudaMallocHost(&p, bytes) == cudaSuccess ? p : NULL;
}

extern "C" void devmem_host_free(void *p)
{
    if (p != NULL)
        cudaFreeHost(p);
}

extern "C" int devmem_fence(void *stream, char *err, size_t errlen)
{
    /* the emulation's kernels have finished when their launch returns; what
     * is left to report is a fault (emu_rt.cpp), as devmem.cu does */
    cudaError_t e = stream ? cudaStreamSynchronize((cudaStream_t)stream) : cudaDeviceSynchronize();
    if (e == cudaSuccess)
        return 0;
    return kvd_seterr(err, errlen, KVD_EINTERNAL, "GPU work failed before its writes could be reported: %s",
                      cudaGetErrorString(e));
}
