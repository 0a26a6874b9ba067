/* kvcache.c - storage and addressing of paged K/V blocks. */
#include "kvcache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "err.h"
#include "ops.h"
#include "pool.h"
#include "types.h"

struct kv_params kv_default_params(void)
{
    struct kv_params p = { .block_tokens = 16, .n_blocks = 1024, .k_type = KERN_F16,
                           .v_type = KERN_F16, .rotate = 0 };
    return p;
}

void kv_describe(const struct kv_params *p, char *buf, size_t len)
{
    snprintf(buf, len, "K %s, V %s%s%s", kv_type_name(p->k_type), kv_type_name(p->v_type),
             p->rotate ? ", rotated " : "", p->rotate ? kv_rotate_name(p->rotate) : "");
}

int kv_params_from_flags(struct kv_params *p, const char *kv_type, const char *k_type,
                         const char *v_type, const char *rotate, char *err, size_t errlen)
{
    const char *flag[3] = { "--kv-type", "--k-type", "--v-type" };
    const char *val[3] = { kv_type, k_type, v_type };
    uint32_t t[3] = { kern_attn_kv_auto(), 0, 0 };
    for (int i = 0; i < 3; i++) {
        if (val[i] != NULL && strcmp(val[i], "auto") == 0)
            t[i] = kern_attn_kv_auto();
        else if (val[i] != NULL && kv_type_parse(val[i], &t[i]) != 0)
            return kvd_seterr(err, errlen, KVD_EINVAL,
                              "%s must be auto, f16, bf16, f32, q8_0 or q4_0, got '%s'", flag[i], val[i]);
    }
    p->k_type = k_type != NULL ? t[1] : t[0];
    p->v_type = v_type != NULL ? t[2] : t[0];
    if (kv_rotate_parse(rotate != NULL ? rotate : "auto", p->k_type, p->v_type, &p->rotate) != 0)
        return kvd_seterr(err, errlen, KVD_EINVAL, "--kv-rotate must be on, off or auto, got '%s'", rotate);
    return 0;
}

void kv_gpu_auto(bool gpu, const char **kv_type, const char **k_type, const char **v_type)
{
    if (!gpu)
        return;
    if (*kv_type == NULL || strcmp(*kv_type, "auto") == 0)
        *kv_type = "f16";
    if (*k_type != NULL && strcmp(*k_type, "auto") == 0)
        *k_type = "f16";
    if (*v_type != NULL && strcmp(*v_type, "auto") == 0)
        *v_type = "f16";
}

uint64_t kv_bytes_per_token(const struct model_config *c, uint32_t k_type, uint32_t v_type)
{
    return kv_token_bytes(c->n_layer, c->n_head_kv, c->head_dim, k_type, v_type);
}

void kv_parts_for_model(const struct model_config *c, struct kv_parts *p)
{
    if (c->n_layer > KV_MAX_PART_LAYERS) {
        kv_parts_single(c->n_layer, p);
        return;
    }
    uint32_t window[KV_MAX_PART_LAYERS];
    for (uint32_t l = 0; l < c->n_layer; l++)
        window[l] = model_layer_windowed(c, l) ? c->swa_window : 0;
    kv_parts_plan(c->n_layer, window, p);
}

static kvcache_t *kv_make(const struct model_config *c, const struct kv_params *p,
                          char *err, size_t errlen)
{
    if (kv_format_check(c->head_dim, p->k_type, p->v_type, p->rotate, err, errlen))
        return NULL;
    if (p->block_tokens == 0 || p->block_tokens > 4096) {
        kvd_seterr(err, errlen, KVD_EINVAL, "kvcache: block size %u is out of range (1..4096)",
                   p->block_tokens);
        return NULL;
    }
    if (p->n_blocks == 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "kvcache: a cache needs at least one block");
        return NULL;
    }
    char why[160];
    if (p->parts != NULL && kv_parts_check(c->n_layer, p->parts, why, sizeof(why)) != 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "kvcache: %s", why);
        return NULL;
    }
    kvcache_t *kv = calloc(1, sizeof(*kv));
    if (kv == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "kvcache: out of memory");
        return NULL;
    }
    if (p->parts != NULL)
        kv->parts = *p->parts;
    else
        kv_parts_single(c->n_layer, &kv->parts);
    kv->n_layer = c->n_layer;
    kv->n_head_kv = c->n_head_kv;
    kv->head_dim = c->head_dim;
    kv->block_tokens = p->block_tokens;
    kv->n_blocks = p->n_blocks;
    kv->k_type = p->k_type;
    kv->v_type = p->v_type;
    kv->rotate = p->rotate;
    kv->k_row_bytes = kv_row_bytes(p->k_type, c->head_dim);
    kv->v_row_bytes = kv_row_bytes(p->v_type, c->head_dim);
    kv->k_head_bytes = (size_t)p->block_tokens * kv->k_row_bytes;
    kv->v_head_bytes = (size_t)p->block_tokens * kv->v_row_bytes;
    kv->layer_bytes = (size_t)c->n_head_kv * (kv->k_head_bytes + kv->v_head_bytes);
    kv->block_bytes = (size_t)kv->parts.part_layers * kv->layer_bytes;
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

void kv_pool_layout(const model_t *m, uint32_t block_tokens, uint32_t k_type, uint32_t v_type,
                    uint32_t rotate, bool identify, struct pool_layout *lay)
{
    memset(lay, 0, sizeof(*lay));
    if (identify)
        model_fingerprint(m, lay->fingerprint);
    lay->n_layer = m->cfg.n_layer;
    lay->n_head_kv = m->cfg.n_head_kv;
    lay->head_dim = m->cfg.head_dim;
    lay->block_tokens = block_tokens;
    lay->k_type = (uint16_t)k_type;
    lay->v_type = (uint16_t)v_type;
    lay->rotate = rotate;
    kv_parts_for_model(&m->cfg, &lay->parts);
}

void kvcache_copy_block(kvcache_t *kv, uint32_t from, uint32_t to)
{
    if (from != to)
        memcpy(kv->mem + (size_t)to * kv->block_bytes, kv->mem + (size_t)from * kv->block_bytes,
               kv->block_bytes);
}
