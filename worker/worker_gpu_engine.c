/*
 * worker_gpu_engine.c - the GPU engine seam of worker_gpu.h over
 * engine/gpu_engine.h: the worker's steps run on the device, over the KV
 * blocks of the shared pool and the weights that kvd allocated and this
 * worker imported; tokens are chosen on the device.
 * Built where the CUDA backend is (target kvd_gpu); elsewhere
 * worker_gpu_engine_none.c stands in.
 */
#include "gpu_engine.h"
#include "worker_gpu.h"

wgpu_engine_t *wgpu_engine_new(const model_t *m, int dev, const struct wgpu_mem *mem,
                               const struct engine_params *p, char *err, size_t errlen)
{
    struct gpu_engine_params gp = gpu_engine_default_params();
    gp.kv_base = mem->kv_base;          /* borrowed: kvd holds the allocations */
    gp.kv_bytes = mem->kv_bytes;        /* checked against kv_blocks x block bytes */
    gp.kv_blocks = mem->kv_blocks;
    gp.block_tokens = mem->block_tokens;
    gp.k_type = mem->k_type;
    gp.v_type = mem->v_type;
    gp.rotate = mem->rotate;
    gp.weights_base = mem->weights_base;
    gp.weights_bytes = mem->weights_bytes; /* checked against the model's layout */
    gp.parts = mem->parts;              /* a table per part, as the pool's blocks hold them */
    if (p != NULL) {
        if (p->max_tokens != 0)
            gp.max_tokens = p->max_tokens;
        if (p->max_ctx != 0)
            gp.max_ctx = p->max_ctx;
    }
    return (wgpu_engine_t *)gpu_engine_new(m, dev, &gp, err, errlen);
}

int wgpu_engine_step_sample(wgpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                            const struct sampler_draw *const *draws, const int32_t **ids, uint32_t *n_rows,
                            char *err, size_t errlen)
{
    return gpu_engine_step_sample((gpu_engine_t *)e, seqs, n_seqs, draws, ids, n_rows, err, errlen);
}

int wgpu_engine_step_logits(wgpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs, const float **logits,
                            uint32_t *n_rows, char *err, size_t errlen)
{
    return gpu_engine_step((gpu_engine_t *)e, seqs, n_seqs, logits, n_rows, err, errlen);
}

int wgpu_engine_kv_copy(wgpu_engine_t *e, const uint32_t *from, const uint32_t *to, uint32_t n, char *err,
                        size_t errlen)
{
    return gpu_engine_kv_copy((gpu_engine_t *)e, from, to, n, err, errlen);
}

int wgpu_engine_kv_shift(wgpu_engine_t *e, const uint32_t *blocks, uint32_t n, int32_t delta, char *err,
                         size_t errlen)
{
    return gpu_engine_kv_shift((gpu_engine_t *)e, blocks, n, delta, err, errlen);
}

void wgpu_engine_destroy(wgpu_engine_t **e)
{
    gpu_engine_t *g = (gpu_engine_t *)*e;
    gpu_engine_destroy(&g);
    *e = NULL;
}
