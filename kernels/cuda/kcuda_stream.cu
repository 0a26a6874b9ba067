/* kcuda_stream.cu - streams, page-locked memory, ordered copies and graphs (kcuda_engine.h). */
#include <new>

#include "kcuda_engine.h"
#include "kcuda_impl.cuh"

struct kcuda_graph {
    cudaGraphExec_t exec;       /* the instantiated graph */
};

extern "C" int kcuda_set_device(int dev)
{
    cudaError_t e = cudaSetDevice(dev);
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "cudaSetDevice");
}

extern "C" int kcuda_stream_new(kcuda_stream_t *s)
{
    cudaStream_t st = NULL;
    *s = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (e != cudaSuccess)
        return kcuda__fail(KVD_EINTERNAL, e, "cudaStreamCreate");
    *s = st;
    return 0;
}

extern "C" void kcuda_stream_destroy(kcuda_stream_t *s)
{
    if (s == NULL || *s == NULL)
        return;
    cudaStreamSynchronize(*s);
    cudaStreamDestroy(*s);
    (void)cudaGetLastError();
    *s = NULL;
}

extern "C" int kcuda_stream_sync(kcuda_stream_t s)
{
    cudaError_t e = cudaStreamSynchronize(s);
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "kernel execution");
}

extern "C" void *kcuda_host_alloc(size_t bytes)
{
    void *p = NULL;
    cudaError_t e = cudaMallocHost(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        kcuda__fail(KVD_ENOMEM, e, "cudaMallocHost");
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

extern "C" void kcuda_host_free(void *p)
{
    if (p != NULL && cudaFreeHost(p) != cudaSuccess)
        (void)cudaGetLastError();   /* not to be blamed on the next launch */
}

extern "C" int kcuda_upload_async(void *dst, const void *src, size_t bytes, kcuda_stream_t s)
{
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s);
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "upload");
}

extern "C" int kcuda_download_async(void *dst, const void *src, size_t bytes, kcuda_stream_t s)
{
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s);
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "download");
}

extern "C" bool kcuda_graphs_supported(void)
{
    return true;
}

extern "C" int kcuda_capture_begin(kcuda_stream_t s)
{
    if (s == NULL)
        return KVD_EINVAL;      /* the legacy default stream cannot be captured */
    cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "graph capture");
}

extern "C" int kcuda_capture_end(kcuda_stream_t s, bool keep, kcuda_graph_t **g)
{
    *g = NULL;
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(s, &graph);
    if (e != cudaSuccess || !keep) {
        if (graph != NULL)
            cudaGraphDestroy(graph);
        (void)cudaGetLastError();   /* an invalidated capture is not a sticky error */
        return e != cudaSuccess ? kcuda__fail(KVD_EINTERNAL, e, "graph capture") : KVD_EINTERNAL;
    }
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kcuda__fail(KVD_EINTERNAL, e, "graph instantiation");
    }
    kcuda_graph_t *r = new (std::nothrow) kcuda_graph_t;
    if (r == NULL) {
        cudaGraphExecDestroy(exec);
        return KVD_ENOMEM;
    }
    r->exec = exec;
    *g = r;
    return 0;
}

extern "C" int kcuda_graph_launch(kcuda_graph_t *g, kcuda_stream_t s)
{
    cudaError_t e = cudaGraphLaunch(g->exec, s);
    return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "graph launch");
}

extern "C" void kcuda_graph_destroy(kcuda_graph_t **g)
{
    if (g == NULL || *g == NULL)
        return;
    if (cudaGraphExecDestroy((*g)->exec) != cudaSuccess)
        (void)cudaGetLastError();
    delete *g;
    *g = NULL;
}
