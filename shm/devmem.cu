/* devmem.cu - shared device memory: cuMemCreate, POSIX descriptor export and import. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <new>

#include <cuda.h>          /* driver types only: libcuda is never linked */
#include <cudaTypedefs.h>  /* the PFN_ types, each named for the ABI version it has */
#include <cuda_runtime.h>

extern "C" {
#include "err.h"  /* kvd_seterr is C */
}
#include "devmem.h"
#include "kcuda.h"     /* the devices the runtime sees */

/* The driver ABI asked for: every function below has kept its signature since
 * CUDA 10.2, and every driver that runs this build's runtime is newer. */
#define DRIVER_ABI 12000

#define NO_DEVICE "no usable CUDA device: "

/* The driver's entry points, looked up once per process. */
static struct {
    bool ok;                                        /* all found */
    char why[200];                                  /* else: which one is missing */
    PFN_cuGetErrorString_v6000 error_string;
    PFN_cuGetErrorName_v6000 error_name;
    PFN_cuDeviceGet_v2000 device_get;
    PFN_cuDeviceGetAttribute_v2000 device_attribute;
    PFN_cuMemCreate_v10020 create;
    PFN_cuMemRelease_v10020 release;
    PFN_cuMemExportToShareableHandle_v10020 export_handle;
    PFN_cuMemImportFromShareableHandle_v10020 import_handle;
    PFN_cuMemGetAllocationPropertiesFromHandle_v10020 handle_props;
    PFN_cuMemGetAllocationGranularity_v10020 granularity;
    PFN_cuMemAddressReserve_v10020 reserve;
    PFN_cuMemAddressFree_v10020 address_free;
    PFN_cuMemMap_v10020 map;
    PFN_cuMemUnmap_v10020 unmap;
    PFN_cuMemSetAccess_v10020 set_access;
} drv;

static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

struct devmem {
    int dev;                            /* device index */
    CUmemGenericAllocationHandle h;     /* this process's handle on the memory */
    CUdeviceptr ptr;                    /* where it is mapped */
    uint64_t bytes;                     /* bytes mapped (the whole allocation) */
    int fd;                             /* exported descriptor (creator), else -1 */
};

/* Looks one entry point up; false (with why set) when the driver lacks it. */
static bool resolve(const char *name, void **fn)
{
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, fn, DRIVER_ABI, cudaEnableDefault, &q);
#else
    /* toolkits before 12.5: the entry point of this runtime's version, whose
     * ABI for these functions is the one DRIVER_ABI names */
    cudaError_t e = cudaGetDriverEntryPoint(name, fn, cudaEnableDefault, &q);
#endif
    if (e == cudaSuccess && q == cudaDriverEntryPointSuccess && *fn != NULL)
        return true;
    *fn = NULL;
    snprintf(drv.why, sizeof(drv.why), "the NVIDIA driver has no %s for CUDA %d.%d (%s)", name,
             DRIVER_ABI / 1000, DRIVER_ABI % 1000 / 10,
             e != cudaSuccess ? cudaGetErrorString(e)
             : q == cudaDriverEntryPointVersionNotSufficent ? "the driver is too old"
                                                            : "symbol not found");
    (void)cudaGetLastError();
    return false;
}

static void resolve_all(void)
{
#define R(field, name) (resolve(name, (void **)&drv.field))
    drv.ok = R(error_string, "cuGetErrorString") && R(error_name, "cuGetErrorName") &&
             R(device_get, "cuDeviceGet") && R(device_attribute, "cuDeviceGetAttribute") &&
             R(create, "cuMemCreate") && R(release, "cuMemRelease") &&
             R(export_handle, "cuMemExportToShareableHandle") &&
             R(import_handle, "cuMemImportFromShareableHandle") &&
             R(handle_props, "cuMemGetAllocationPropertiesFromHandle") &&
             R(granularity, "cuMemGetAllocationGranularity") &&
             R(reserve, "cuMemAddressReserve") && R(address_free, "cuMemAddressFree") &&
             R(map, "cuMemMap") && R(unmap, "cuMemUnmap") && R(set_access, "cuMemSetAccess");
#undef R
}

/* "CUDA_ERROR_OUT_OF_MEMORY: out of memory" for a driver result. */
static const char *drv_error(CUresult r, char *buf, size_t len)
{
    const char *name = NULL, *text = NULL;
    if (drv.error_name == NULL || drv.error_name(r, &name) != CUDA_SUCCESS)
        name = NULL;
    if (drv.error_string == NULL || drv.error_string(r, &text) != CUDA_SUCCESS)
        text = NULL;
    snprintf(buf, len, "%s: %s", name ? name : "CUDA driver error", text ? text : "no description");
    if (name == NULL)
        snprintf(buf, len, "CUDA driver error %d", (int)r);
    return buf;
}

/* The allocation properties of a shareable pinned allocation on dev. */
static CUmemAllocationProp alloc_prop(int dev)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof(p));
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    return p;
}

/* Granularity of dev's shareable allocations: the recommended one (rounding
 * of new allocations), or the minimum (what an import must respect). */
static int granularity(int dev, bool recommended, uint64_t *g, char *why, size_t whylen)
{
    CUmemAllocationProp p = alloc_prop(dev);
    size_t v = 0;
    CUresult r = drv.granularity(&v, &p, recommended ? CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
                                                     : CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    char eb[160];
    if (r != CUDA_SUCCESS || v == 0)
        return kvd_seterr(why, whylen, KVD_EUNSUPPORTED,
                          NO_DEVICE "device %d: cuMemGetAllocationGranularity: %s", dev,
                          drv_error(r, eb, sizeof(eb)));
    *g = v;
    return 0;
}

extern "C" int devmem_probe(int dev, struct devmem_dev *info, char *why, size_t whylen)
{
    char reason[256] = "";
    int n = kcuda_device_count(reason, sizeof(reason));
    if (n <= 0) {
        const char *r = strncmp(reason, NO_DEVICE, strlen(NO_DEVICE)) == 0 ? reason + strlen(NO_DEVICE)
                                                                          : reason;
        return kvd_seterr(why, whylen, KVD_EUNAVAILABLE, NO_DEVICE "%s",
                          r[0] ? r : "no CUDA device found");
    }
    if (dev < 0 || dev >= n)
        return kvd_seterr(why, whylen, KVD_EUNAVAILABLE,
                          NO_DEVICE "device %d does not exist (this machine shows %d, numbered from 0)",
                          dev, n);
    /* the runtime makes dev's primary context current: the driver calls below use it */
    cudaError_t e = cudaSetDevice(dev);
    if (e == cudaSuccess)
        e = cudaFree(0);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kvd_seterr(why, whylen, KVD_EUNAVAILABLE, NO_DEVICE "device %d: %s", dev,
                          cudaGetErrorString(e));
    }
    pthread_once(&drv_once, resolve_all);
    if (!drv.ok)
        return kvd_seterr(why, whylen, KVD_EUNSUPPORTED, NO_DEVICE "%s", drv.why);
    CUdevice cu;
    char eb[160];
    CUresult r = drv.device_get(&cu, dev);
    if (r != CUDA_SUCCESS)
        return kvd_seterr(why, whylen, KVD_EUNAVAILABLE, NO_DEVICE "cuDeviceGet(%d): %s", dev,
                          drv_error(r, eb, sizeof(eb)));
    int vmm = 0, posix_fd = 0;
    r = drv.device_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu);
    if (r == CUDA_SUCCESS)
        r = drv.device_attribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                 cu);
    if (r != CUDA_SUCCESS)
        return kvd_seterr(why, whylen, KVD_EUNAVAILABLE, NO_DEVICE "cuDeviceGetAttribute: %s",
                          drv_error(r, eb, sizeof(eb)));
    if (!vmm)
        return kvd_seterr(why, whylen, KVD_EUNSUPPORTED,
                          NO_DEVICE "device %d does not support virtual memory management "
                          "(cuMemCreate), which sharing its memory between processes needs", dev);
    if (!posix_fd)
        return kvd_seterr(why, whylen, KVD_EUNSUPPORTED,
                          NO_DEVICE "device %d cannot export memory as a POSIX file descriptor "
                          "(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)", dev);
    uint64_t g = 0;
    int rc = granularity(dev, true, &g, why, whylen);
    if (rc)
        return rc;
    if (info != NULL) {
        memset(info, 0, sizeof(*info));
        info->granularity = g;
        cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, dev) == cudaSuccess)
            snprintf(info->name, sizeof(info->name), "%.95s", p.name);
        size_t fr = 0, tot = 0;
        if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) {
            info->free_bytes = fr;
            info->total_bytes = tot;
        }
        (void)cudaGetLastError();
    }
    return 0;
}

/* Reserves an address range for m->bytes, maps m->h there and makes it
 * read-write for m->dev. 0 or KVD_EINTERNAL / KVD_ENOMEM with a reason; on
 * failure nothing stays mapped or reserved. */
static int map_handle(devmem_t *m, char *err, size_t errlen)
{
    char eb[160];
    CUresult r = drv.reserve(&m->ptr, m->bytes, 0, 0, 0);
    if (r != CUDA_SUCCESS) {
        m->ptr = 0;
        return kvd_seterr(err, errlen, KVD_ENOMEM, "cuMemAddressReserve of %llu bytes: %s",
                          (unsigned long long)m->bytes, drv_error(r, eb, sizeof(eb)));
    }
    r = drv.map(m->ptr, m->bytes, 0, m->h, 0);
    if (r != CUDA_SUCCESS) {
        drv.address_free(m->ptr, m->bytes);
        m->ptr = 0;
        return kvd_seterr(err, errlen, KVD_EINTERNAL,
                          "cuMemMap of %llu bytes: %s (is the allocation smaller?)",
                          (unsigned long long)m->bytes, drv_error(r, eb, sizeof(eb)));
    }
    CUmemAccessDesc a;
    memset(&a, 0, sizeof(a));
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = m->dev;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = drv.set_access(m->ptr, m->bytes, &a, 1);
    if (r != CUDA_SUCCESS) {
        drv.unmap(m->ptr, m->bytes);
        drv.address_free(m->ptr, m->bytes);
        m->ptr = 0;
        return kvd_seterr(err, errlen, KVD_EINTERNAL, "cuMemSetAccess for device %d: %s", m->dev,
                          drv_error(r, eb, sizeof(eb)));
    }
    return 0;
}

static devmem_t *vmm_alloc(int dev, char *err, size_t errlen)
{
    devmem_t *m = new (std::nothrow) devmem_t;
    if (m == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        return NULL;
    }
    memset(m, 0, sizeof(*m));
    m->dev = dev;
    m->fd = -1;
    return m;
}

extern "C" devmem_t *devmem_create(int dev, uint64_t bytes, char *err, size_t errlen)
{
    struct devmem_dev info;
    if (devmem_probe(dev, &info, err, errlen) != 0)
        return NULL;
    if (bytes == 0 || bytes > UINT64_MAX - info.granularity) {
        kvd_seterr(err, errlen, KVD_EINVAL, "device memory: %llu bytes is not a size",
                   (unsigned long long)bytes);
        return NULL;
    }
    devmem_t *m = vmm_alloc(dev, err, errlen);
    if (m == NULL)
        return NULL;
    m->bytes = (bytes + info.granularity - 1) / info.granularity * info.granularity;
    char eb[160];
    CUmemAllocationProp p = alloc_prop(dev);
    CUresult r = drv.create(&m->h, m->bytes, &p, 0);
    if (r != CUDA_SUCCESS) {
        char fb[32], tb[32];
        snprintf(fb, sizeof(fb), "%.1f", info.free_bytes / 1073741824.0);
        snprintf(tb, sizeof(tb), "%.1f", info.total_bytes / 1073741824.0);
        kvd_seterr(err, errlen, r == CUDA_ERROR_OUT_OF_MEMORY ? KVD_ENOMEM : KVD_EINTERNAL,
                   "cannot allocate %llu bytes on GPU %d (%s GiB free of %s): cuMemCreate: %s",
                   (unsigned long long)m->bytes, dev, fb, tb, drv_error(r, eb, sizeof(eb)));
        delete m;
        return NULL;
    }
    int fd = -1;
    r = drv.export_handle(&fd, m->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS || fd < 0) {
        kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                   "cannot export GPU %d's memory as a file descriptor: cuMemExportToShareableHandle: %s",
                   dev, drv_error(r, eb, sizeof(eb)));
        drv.release(m->h);
        delete m;
        return NULL;
    }
    m->fd = fd;
    /* the workers get it over a socket, never by inheritance */
    int fl = fcntl(fd, F_GETFD);
    if (fl >= 0)
        fcntl(fd, F_SETFD, fl | FD_CLOEXEC);
    if (map_handle(m, err, errlen) != 0) {
        close(m->fd);
        drv.release(m->h);
        delete m;
        return NULL;
    }
    return m;
}

extern "C" devmem_t *devmem_import(int dev, int fd, uint64_t bytes, char *err, size_t errlen)
{
    if (devmem_probe(dev, NULL, err, errlen) != 0)
        return NULL;
    if (fd < 0 || fcntl(fd, F_GETFD) < 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "import: descriptor %d is not open", fd);
        return NULL;
    }
    uint64_t g = 0;
    if (granularity(dev, false, &g, err, errlen) != 0)
        return NULL;
    if (bytes == 0 || bytes % g != 0) {
        kvd_seterr(err, errlen, KVD_EFORMAT,
                   "import: %llu bytes is not a whole number of allocation granules (%llu bytes)",
                   (unsigned long long)bytes, (unsigned long long)g);
        return NULL;
    }
    devmem_t *m = vmm_alloc(dev, err, errlen);
    if (m == NULL)
        return NULL;
    m->bytes = bytes;
    char eb[160];
    CUresult r = drv.import_handle(&m->h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
        kvd_seterr(err, errlen, KVD_EFORMAT,
                   "import: descriptor %d is not CUDA memory this process can use: %s", fd,
                   drv_error(r, eb, sizeof(eb)));
        delete m;
        return NULL;
    }
    CUmemAllocationProp p;
    memset(&p, 0, sizeof(p));
    r = drv.handle_props(&p, m->h);
    if (r != CUDA_SUCCESS || p.location.type != CU_MEM_LOCATION_TYPE_DEVICE || p.location.id != dev) {
        if (r != CUDA_SUCCESS)
            kvd_seterr(err, errlen, KVD_EINTERNAL, "import: cuMemGetAllocationPropertiesFromHandle: %s",
                       drv_error(r, eb, sizeof(eb)));
        else
            kvd_seterr(err, errlen, KVD_EINVAL,
                       "import: the memory lives on %s %d, not on GPU %d (do both processes see the "
                       "same CUDA_VISIBLE_DEVICES?)",
                       p.location.type == CU_MEM_LOCATION_TYPE_DEVICE ? "GPU" : "location type",
                       p.location.type == CU_MEM_LOCATION_TYPE_DEVICE ? p.location.id
                                                                      : (int)p.location.type,
                       dev);
        drv.release(m->h);
        delete m;
        return NULL;
    }
    if (map_handle(m, err, errlen) != 0) {
        drv.release(m->h);
        delete m;
        return NULL;
    }
    return m;
}

extern "C" void devmem_destroy(devmem_t **mp)
{
    if (mp == NULL || *mp == NULL)
        return;
    devmem_t *m = *mp;
    int cur = -1;
    (void)cudaGetDevice(&cur);
    if (cur != m->dev)
        (void)cudaSetDevice(m->dev);
    /* nothing of ours may still run on the memory that goes away */
    (void)cudaDeviceSynchronize();
    if (m->ptr) {
        drv.unmap(m->ptr, m->bytes);
        drv.address_free(m->ptr, m->bytes);
    }
    drv.release(m->h);
    if (m->fd >= 0)
        close(m->fd);
    if (cur >= 0 && cur != m->dev)
        (void)cudaSetDevice(cur);
    (void)cudaGetLastError();
    delete m;
    *mp = NULL;
}

extern "C" void *devmem_ptr(const devmem_t *m)
{
    return (void *)(uintptr_t)m->ptr;
}

extern "C" uint64_t devmem_bytes(const devmem_t *m)
{
    return m->bytes;
}

extern "C" int devmem_device(const devmem_t *m)
{
    return m->dev;
}

extern "C" int devmem_fd(const devmem_t *m)
{
    return m->fd;
}

static int vmm_copy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, char *err, size_t errlen)
{
    const cudaError_t e = cudaMemcpy(dst, src, bytes, kind);
    if (e == cudaSuccess)
        return 0;
    (void)cudaGetLastError();
    return kvd_seterr(err, errlen, KVD_EINTERNAL, "copy %s the device failed: %s (%s)",
                      kind == cudaMemcpyDeviceToHost ? "from" : "to", cudaGetErrorString(e), cudaGetErrorName(e));
}

extern "C" int devmem_read(void *dst_host, const void *src_dev, size_t bytes, char *err, size_t errlen)
{
    return vmm_copy(dst_host, src_dev, bytes, cudaMemcpyDeviceToHost, err, errlen);
}

extern "C" int devmem_write(void *dst_dev, const void *src_host, size_t bytes, char *err, size_t errlen)
{
    return vmm_copy(dst_dev, src_host, bytes, cudaMemcpyHostToDevice, err, errlen);
}

extern "C" int devmem_attach(int dev, char *err, size_t errlen)
{
    const cudaError_t e = cudaSetDevice(dev);
    if (e == cudaSuccess)
        return 0;
    (void)cudaGetLastError();
    return kvd_seterr(err, errlen, KVD_EUNAVAILABLE, "device %d: %s", dev, cudaGetErrorString(e));
}

extern "C" void *devmem_host_alloc(size_t bytes)
{
    void *p = NULL;
    if (cudaMallocHost(&p, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

extern "C" void devmem_host_free(void *p)
{
    if (p != NULL)
        cudaFreeHost(p);
}

extern "C" int devmem_fence(void *stream, char *err, size_t errlen)
{
    cudaError_t e = stream ? cudaStreamSynchronize((cudaStream_t)stream) : cudaDeviceSynchronize();
    if (e == cudaSuccess)
        return 0;
    (void)cudaGetLastError();
    return kvd_seterr(err, errlen, KVD_EINTERNAL, "GPU work failed before its writes could be "
                      "reported: %s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
}
