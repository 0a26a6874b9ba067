/* worker_gpu.c - kvd-worker's device KV pool and the GPU engine seam. */
#include "worker_gpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "err.h"
#include "fdpass.h"
#include "devmem.h"
#include "kvcache.h"

struct wgpu {
    pool_t *pool;           /* borrowed: the pool whose KV data this maps */
    int dev;                /* CUDA device index */
    devmem_t *mem;       /* this process's mapping of kvd's KV allocation */
    devmem_t *weights;   /* and of its copy of the model's weights */
    wgpu_engine_t *engine;  /* the GPU engine once started; NULL before */
};

/* Checks kvd's message (of the kind expected) against the pool this worker
 * attached. The weights need no check of their model: the pool attached only
 * because this worker's model has the pool's fingerprint, and kvd uploaded
 * the model it made the pool for; the engine checks their size. */
static int check_msg(const struct fdpass_msg *m, uint32_t kind, const pool_t *pool, int dev, char *err,
                     size_t errlen)
{
    const struct pool_header *h = pool_header(pool);
    if (m->kind != kind)
        return kvd_seterr(err, errlen, KVD_EPROTOCOL, "kvd sent a descriptor of kind %u, not %s", m->kind,
                          kind == FDPASS_KIND_CUDA_VMM ? "the KV device memory" : "the weights' device memory");
    if (m->device != dev)
        return kvd_seterr(err, errlen, KVD_EPROTOCOL, "kvd sent memory of GPU %d, not GPU %d",
                          m->device, dev);
    if (m->generation != h->generation || m->instance != h->instance)
        return kvd_seterr(err, errlen, KVD_ESTATE,
                          "kvd's device memory belongs to another pool than %s (generation %llu, "
                          "not %llu): is the socket another kvd's?",
                          pool_name(pool) ? pool_name(pool) : "(anonymous)",
                          (unsigned long long)m->generation, (unsigned long long)h->generation);
    if (kind == FDPASS_KIND_CUDA_VMM && m->bytes < pool_data_bytes(pool))
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "kvd's device memory holds %llu bytes; the pool's blocks need %llu",
                          (unsigned long long)m->bytes, (unsigned long long)pool_data_bytes(pool));
    return 0;
}

wgpu_t *wgpu_open(pool_t *pool, int dev, const char *socket_path, char *err, size_t errlen)
{
    int where = pool_kv_device(pool);
    if (where != dev) {
        if (where < 0)
            kvd_seterr(err, errlen, KVD_ESTATE,
                       "pool %s keeps its KV data in host memory: start the worker without --gpu",
                       pool_name(pool) ? pool_name(pool) : "(anonymous)");
        else
            kvd_seterr(err, errlen, KVD_ESTATE, "pool %s keeps its KV data on GPU %d, not GPU %d",
                       pool_name(pool) ? pool_name(pool) : "(anonymous)", where, dev);
        return NULL;
    }
    char why[384];
    if (devmem_probe(dev, NULL, why, sizeof(why)) != 0) {
        kvd_seterr(err, errlen, KVD_EUNAVAILABLE, "--gpu %d: %s", dev, why);
        return NULL;
    }
    wgpu_t *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        return NULL;
    }
    g->pool = pool;
    g->dev = dev;
    int s = fdpass_connect(socket_path, WGPU_CONNECT_MS, why, sizeof(why));
    if (s < 0) {
        kvd_seterr(err, errlen, s, "cannot reach kvd for the pool's device memory: %s", why);
        goto fail;
    }
    /* two messages: the KV data, then the weights */
    devmem_t **into[2] = { &g->mem, &g->weights };
    static const uint32_t kinds[2] = { FDPASS_KIND_CUDA_VMM, FDPASS_KIND_CUDA_WEIGHTS };
    int rc = 0;
    for (int i = 0; i < 2 && rc == 0; i++) {
        struct fdpass_msg m;
        int fd;
        rc = fdpass_recv(s, &m, &fd, WGPU_CONNECT_MS, why, sizeof(why));
        if (rc != 0) {
            kvd_seterr(err, errlen, rc, "no %s from kvd: %s", i ? "weights" : "device memory", why);
            break;
        }
        rc = check_msg(&m, kinds[i], pool, dev, err, errlen);
        if (rc == 0) {
            *into[i] = devmem_import(dev, fd, m.bytes, why, sizeof(why));
            if (*into[i] == NULL)
                rc = kvd_seterr(err, errlen, KVD_EINTERNAL, "cannot map kvd's device memory: %s", why);
        }
        close(fd); /* the import holds its own reference */
    }
    close(s);
    if (rc != 0)
        goto fail;
    rc = pool_set_device_kv(pool, devmem_ptr(g->mem), devmem_bytes(g->mem));
    if (rc != 0) {
        kvd_seterr(err, errlen, rc, "the mapped device memory does not fit the pool");
        goto fail;
    }
    return g;
fail:
    wgpu_close(&g);
    return NULL;
}

void *wgpu_kv_base(const wgpu_t *g)
{
    return devmem_ptr(g->mem);
}

uint64_t wgpu_kv_bytes(const wgpu_t *g)
{
    return devmem_bytes(g->mem);
}

int wgpu_fence(wgpu_t *g, char *err, size_t errlen)
{
    (void)g;
    /* the whole device: whatever streams the engine uses, every kernel this
     * process queued so far has completed when this returns */
    return devmem_fence(NULL, err, errlen);
}

/* The GPU engine is behind the seam of worker_gpu.h (wgpu_engine_new and
 * friends), implemented in worker_gpu_engine_none.c until one is built in. */

int wgpu_engine_start(wgpu_t *g, const model_t *m, const struct engine_params *p, char *err,
                      size_t errlen)
{
    if (g->engine != NULL)
        return kvd_seterr(err, errlen, KVD_ESTATE, "the GPU engine is already started");
    const struct pool_header *h = pool_header(g->pool);
    /* the engine reads the pool's KV types and rotation from its header, and
     * refuses what its kernels cannot read (an f32 cache) */
    const struct wgpu_mem mem = {
        .kv_base = wgpu_kv_base(g), .kv_bytes = wgpu_kv_bytes(g), .kv_blocks = h->n_blocks,
        .block_tokens = h->layout.block_tokens, .k_type = h->layout.k_type, .v_type = h->layout.v_type,
        .rotate = h->layout.rotate, .weights_base = devmem_ptr(g->weights),
        .weights_bytes = devmem_bytes(g->weights), .parts = &h->layout.parts,
    };
    g->engine = wgpu_engine_new(m, g->dev, &mem, p, err, errlen);
    return g->engine ? 0 : KVD_EUNSUPPORTED;
}

int wgpu_step_sample(wgpu_t *g, const struct fwd_seq *seqs, uint32_t n_seqs,
                     const struct sampler_draw *const *draws, const int32_t **ids, uint32_t *n_rows, char *err,
                     size_t errlen)
{
    if (g->engine == NULL) {
        *ids = NULL;
        *n_rows = 0;
        return kvd_seterr(err, errlen, KVD_ESTATE, "the GPU engine is not started");
    }
    return wgpu_engine_step_sample(g->engine, seqs, n_seqs, draws, ids, n_rows, err, errlen);
}

int wgpu_step_logits(wgpu_t *g, const struct fwd_seq *seqs, uint32_t n_seqs, const float **logits,
                     uint32_t *n_rows, char *err, size_t errlen)
{
    if (g->engine == NULL) {
        *logits = NULL;
        *n_rows = 0;
        return kvd_seterr(err, errlen, KVD_ESTATE, "the GPU engine is not started");
    }
    return wgpu_engine_step_logits(g->engine, seqs, n_seqs, logits, n_rows, err, errlen);
}

int wgpu_kv_copy(wgpu_t *g, const uint32_t *from, const uint32_t *to, uint32_t n, char *err, size_t errlen)
{
    if (g->engine == NULL)
        return kvd_seterr(err, errlen, KVD_ESTATE, "the GPU engine is not started");
    return wgpu_engine_kv_copy(g->engine, from, to, n, err, errlen);
}

int wgpu_kv_shift(wgpu_t *g, const uint32_t *blocks, uint32_t n, int32_t delta, char *err, size_t errlen)
{
    if (g->engine == NULL)
        return kvd_seterr(err, errlen, KVD_ESTATE, "the GPU engine is not started");
    return wgpu_engine_kv_shift(g->engine, blocks, n, delta, err, errlen);
}

void wgpu_close(wgpu_t **gp)
{
    if (gp == NULL || *gp == NULL)
        return;
    wgpu_t *g = *gp;
    wgpu_engine_destroy(&g->engine); /* before the memory it computes in goes */
    devmem_destroy(&g->mem);
    devmem_destroy(&g->weights);
    free(g);
    *gp = NULL;
}
