/* kvcache.c - storage and addressing of paged K/V blocks. */
#include "kvcache.h"

#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "types.h"

struct kv_params kv_default_params(void)
{
    struct kv_params p = { .block_tokens = 16, .n_blocks = 1024, .dtype = KERN_F16 };
    return p;
}

uint64_t kv_bytes_per_token(const struct model_config *c, uint32_t dtype)
{
    uint64_t elem = dtype == KERN_F32 ? 4 : 2;
    return 2ull * c->n_layer * c->n_head_kv * c->head_dim * elem;
}

static kvcache_t *kv_make(const struct model_config *c, const struct kv_params *p,
                          char *err, size_t errlen)
{
    if (p->dtype != KERN_F16 && p->dtype != KERN_F32) {
        kvd_seterr(err, errlen, KVD_EINVAL, "kvcache: KV type must be f16 or f32");
        return NULL;
    }
    if (p->block_tokens == 0 || p->block_tokens > 4096) {
        kvd_seterr(err, errlen, KVD_EINVAL, "kvcache: block size %u is out of range (1..4096)",
                   p->block_tokens);
        return NULL;
    }
    if (p->n_blocks == 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "kvcache: a cache needs at least one block");
        return NULL;
    }
    kvcache_t *kv = calloc(1, sizeof(*kv));
    if (kv == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "kvcache: out of memory");
        return NULL;
    }
    kv->n_layer = c->n_layer;
    kv->n_head_kv = c->n_head_kv;
    kv->head_dim = c->head_dim;
    kv->block_tokens = p->block_tokens;
    kv->n_blocks = p->n_blocks;
    kv->dtype = p->dtype;
    kv->elem_bytes = p->dtype == KERN_F32 ? 4 : 2;
    kv->head_bytes = (size_t)p->block_tokens * c->head_dim * kv->elem_bytes;
    kv->block_bytes = 2 * (size_t)c->n_layer * c->n_head_kv * kv->head_bytes;
    kv->free_ids = malloc((size_t)p->n_blocks * sizeof(uint32_t));
    if (kv->free_ids == NULL) {
        free(kv);
        kvd_seterr(err, errlen, KVD_ENOMEM, "kvcache: out of memory");
        return NULL;
    }
    /* hand out low ids first */
    for (uint32_t i = 0; i < p->n_blocks; i++)
        kv->free_ids[i] = p->n_blocks - 1 - i;
    kv->n_free = p->n_blocks;
    return kv;
}

kvcache_t *kvcache_new(const struct model_config *c, const struct kv_params *p,
                       char *err, size_t errlen)
{
    kvcache_t *kv = kv_make(c, p, err, errlen);
    if (kv == NULL)
        return NULL;
    if ((uint64_t)kv->n_blocks * kv->block_bytes > (1ull << 40)) {
        kvd_seterr(err, errlen, KVD_ERANGE, "kvcache: %u blocks of %zu bytes is too large",
                   kv->n_blocks, kv->block_bytes);
        kvcache_destroy(&kv);
        return NULL;
    }
    size_t size = (size_t)kv->n_blocks * kv->block_bytes;
    kv->mem = aligned_alloc(64, (size + 63) / 64 * 64);
    if (kv->mem == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "kvcache: cannot allocate %zu bytes", size);
        kvcache_destroy(&kv);
        return NULL;
    }
    memset(kv->mem, 0, size);
    kv->owned = true;
    return kv;
}

kvcache_t *kvcache_wrap(const struct model_config *c, const struct kv_params *p,
                        void *mem, size_t size, char *err, size_t errlen)
{
    kvcache_t *kv = kv_make(c, p, err, errlen);
    if (kv == NULL)
        return NULL;
    if (mem == NULL || size / kv->block_bytes < kv->n_blocks) {
        kvd_seterr(err, errlen, KVD_ERANGE, "kvcache: %zu bytes cannot hold %u blocks", size,
                   kv->n_blocks);
        kvcache_destroy(&kv);
        return NULL;
    }
    kv->mem = mem;
    return kv;
}

void kvcache_destroy(kvcache_t **kvp)
{
    if (kvp == NULL || *kvp == NULL)
        return;
    kvcache_t *kv = *kvp;
    if (kv->owned)
        free(kv->mem);
    free(kv->free_ids);
    free(kv);
    *kvp = NULL;
}

int kvcache_alloc(kvcache_t *kv, uint32_t *id)
{
    if (kv->n_free == 0)
        return KVD_ENOSPACE;
    *id = kv->free_ids[--kv->n_free];
    return 0;
}

void kvcache_release(kvcache_t *kv, uint32_t id)
{
    if (id < kv->n_blocks && kv->n_free < kv->n_blocks)
        kv->free_ids[kv->n_free++] = id;
}
