/* kcuda_device.cu - device discovery, memory, copies and timers of the CUDA backend. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include <new>

#include "kcuda_impl.cuh"

static thread_local char last_error[256];

int kcuda__fail(int code, cudaError_t e, const char *what)
{
    snprintf(last_error, sizeof(last_error), "%s: %s (%s)", what, cudaGetErrorString(e),
             cudaGetErrorName(e));
    return code;
}

int kcuda__launched(const char *what)
{
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, what);
}

extern "C" const char *kcuda_last_error(void)
{
    return last_error;
}

extern "C" int kcuda_device_count(char *why, size_t whylen)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        /* no driver (libcuda absent), a driver older than this runtime, or no
         * device: all mean "no GPU here" to the caller */
        if (why != NULL && whylen > 0) {
            /* the runtime reports a missing driver as an old one; say which */
            void *drv = e == cudaErrorInsufficientDriver ? dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD) : NULL;
            if (e == cudaErrorInsufficientDriver && drv == NULL)
                snprintf(why, whylen, "no usable CUDA device: no NVIDIA driver (libcuda.so.1 not found)");
            else
                snprintf(why, whylen, "no usable CUDA device: %s", cudaGetErrorString(e));
            if (drv != NULL)
                dlclose(drv);
        }
        (void)cudaGetLastError();
        return 0;
    }
    if (n == 0 && why != NULL && whylen > 0)
        snprintf(why, whylen, "no CUDA device found");
    return n;
}

extern "C" int kcuda_device_open(int dev, struct kcuda_info *info)
{
    int n = kcuda_device_count(NULL, 0);
    if (dev < 0 || dev >= n)
        return KVD_EUNAVAILABLE;
    cudaError_t e = cudaSetDevice(dev);
    if (e != cudaSuccess)
        return kcuda__fail(KVD_EINTERNAL, e, "cudaSetDevice");
    /* the kernels use cp.async and are built for sm_80 and later: an older
     * device would fail every launch with "no kernel image" */
    int major = 0, minor = 0;
    e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (e != cudaSuccess)
        return kcuda__fail(KVD_EINTERNAL, e, "cudaDeviceGetAttribute");
    if (major < 8) {
        snprintf(last_error, sizeof(last_error),
                 "device %d has compute capability %d.%d; kvd's kernels need 8.0 or later", dev, major, minor);
        return KVD_EUNSUPPORTED;
    }
    if (info == NULL)
        return 0;
    cudaDeviceProp p;
    e = cudaGetDeviceProperties(&p, dev);
    if (e != cudaSuccess)
        return kcuda__fail(KVD_EINTERNAL, e, "cudaGetDeviceProperties");
    memset(info, 0, sizeof(*info));
    snprintf(info->name, sizeof(info->name), "%.95s", p.name);
    info->major = p.major;
    info->minor = p.minor;
    info->sm_count = p.multiProcessorCount;
    info->mem_bytes = p.totalGlobalMem;
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMemoryClockRate, dev) == cudaSuccess)
        info->mem_clock_khz = v;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrGlobalMemoryBusWidth, dev) == cudaSuccess)
        info->bus_bits = v;
    (void)cudaGetLastError();
    return 0;
}

extern "C" void *kcuda_malloc(size_t bytes)
{
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        kcuda__fail(KVD_ENOMEM, e, "cudaMalloc");
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

/* Frees and teardown calls report nothing; their failure must not stay
 * pending and be blamed on the next launch (kcuda__launched). */
extern "C" void kcuda_free(void *p)
{
    if (p != NULL && cudaFree(p) != cudaSuccess)
        (void)cudaGetLastError();
}

extern "C" int kcuda_upload(void *dst, const void *src, size_t bytes)
{
    cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "upload");
}

extern "C" int kcuda_download(void *dst, const void *src, size_t bytes)
{
    cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "download");
}

extern "C" int kcuda_copy(void *dst, const void *src, size_t bytes, kcuda_stream_t stream)
{
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "device copy");
}

extern "C" int kcuda_memset(void *dst, int byte, size_t bytes, kcuda_stream_t stream)
{
    cudaError_t e = cudaMemsetAsync(dst, byte, bytes, stream);
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "memset");
}

extern "C" int kcuda_sync(void)
{
    cudaError_t e = cudaDeviceSynchronize();
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "kernel execution");
}

struct kcuda_timer {
    cudaEvent_t start, stop;    /* recorded around the timed work */
};

extern "C" kcuda_timer_t *kcuda_timer_new(void)
{
    kcuda_timer_t *t = new (std::nothrow) kcuda_timer_t;
    if (t == NULL)
        return NULL;
    if (cudaEventCreate(&t->start) != cudaSuccess) {
        delete t;
        return NULL;
    }
    if (cudaEventCreate(&t->stop) != cudaSuccess) {
        cudaEventDestroy(t->start);
        delete t;
        return NULL;
    }
    return t;
}

extern "C" void kcuda_timer_destroy(kcuda_timer_t **tp)
{
    if (tp == NULL || *tp == NULL)
        return;
    cudaEventDestroy((*tp)->start);
    cudaEventDestroy((*tp)->stop);
    delete *tp;
    *tp = NULL;
}

extern "C" void kcuda_timer_start(kcuda_timer_t *t, kcuda_stream_t stream)
{
    if (cudaEventRecord(t->start, stream) != cudaSuccess)
        (void)cudaGetLastError();   /* kcuda_timer_stop then reports the failure */
}

extern "C" double kcuda_timer_stop(kcuda_timer_t *t, kcuda_stream_t stream)
{
    float ms = -1.0f;
    if (cudaEventRecord(t->stop, stream) != cudaSuccess || cudaEventSynchronize(t->stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, t->start, t->stop) != cudaSuccess) {
        kcuda__fail(KVD_EINTERNAL, cudaGetLastError(), "timer");
        return -1.0;
    }
    return ms;
}
