/*
 * worker_gpu_engine_none.c - the GPU engine seam of worker_gpu.h in a
 * kvd-worker built without a GPU engine: the worker maps the GPU pool, then
 * says it has nothing to compute with, and exits with CLI_EXIT_UNUSABLE.
 *
 * Where the CUDA backend is built, worker_gpu_engine.c (over
 * engine/gpu_engine.h) takes this file's place.
 */
#include "err.h"
#include "worker_gpu.h"

wgpu_engine_t *wgpu_engine_new(const model_t *m, int dev, const struct wgpu_mem *mem,
                               const struct engine_params *p, char *err, size_t errlen)
{
    (void)m;
    (void)dev;
    (void)mem;
    (void)p;
    kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
               "GPU engine not built: this kvd-worker can map the GPU pool but has no engine to "
               "compute with it");
    return NULL;
}

int wgpu_engine_step_sample(wgpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                            const struct sampler_draw *const *draws, const int32_t **ids, uint32_t *n_rows,
                            char *err, size_t errlen)
{
    (void)e;
    (void)seqs;
    (void)n_seqs;
    (void)draws;
    *ids = NULL;
    *n_rows = 0;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "GPU engine not built");
}

int wgpu_engine_step_logits(wgpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs, const float **logits,
                            uint32_t *n_rows, char *err, size_t errlen)
{
    (void)e;
    (void)seqs;
    (void)n_seqs;
    *logits = NULL;
    *n_rows = 0;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "GPU engine not built");
}

int wgpu_engine_kv_copy(wgpu_engine_t *e, const uint32_t *from, const uint32_t *to, uint32_t n, char *err,
                        size_t errlen)
{
    (void)e;
    (void)from;
    (void)to;
    (void)n;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "GPU engine not built");
}

int wgpu_engine_kv_shift(wgpu_engine_t *e, const uint32_t *blocks, uint32_t n, int32_t delta, char *err,
                         size_t errlen)
{
    (void)e;
    (void)blocks;
    (void)n;
    (void)delta;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "GPU engine not built");
}

void wgpu_engine_destroy(wgpu_engine_t **e)
{
    if (e != NULL)
        *e = NULL; /* none can have been made */
}
