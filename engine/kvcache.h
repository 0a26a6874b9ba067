/*
 * kvcache.h - the paged KV cache: fixed-size blocks of keys and values.
 *
 * A block holds block_tokens consecutive positions of one sequence for the
 * layers of one part (common/kvparts.h): all layers for a model without
 * sliding windows, a part of equal size per attention kind otherwise, and a
 * sequence has one block table per part. A block id means the same thing in
 * every process that maps the pool. Inside a block the layout is
 *
 *     [layer of the part][K=0,V=1][kv_head][token in block][one head's row]
 *
 * so that attention streams one head's keys contiguously. A row is head_dim
 * values of the K (or V) type: f32, f16, or the quantized q8_0 / q4_0, whose
 * rows are head_dim / 32 blocks of quant_blocks.h (34 and 18 bytes: one f16
 * scale per 32 values of one head of one token). K and V may have different
 * types, so their halves of a layer may differ in size. With rotation (below)
 * a row holds the head's values times the orthonormal Walsh-Hadamard matrix.
 * A sequence reaches its blocks through a block table: logical block i ->
 * physical block id.
 *
 * This module only addresses and stores; who may use which block is decided by
 * the caller (kvd-run's simple free list here, the coordinator's allocator in
 * the daemon). The memory may be owned or borrowed (a shared segment).
 */
#ifndef KVD_KVCACHE_H
#define KVD_KVCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvformat.h"
#include "kvparts.h"
#include "model.h"

struct kv_params {
    uint32_t block_tokens;  /* positions per block (default 16) */
    uint32_t n_blocks;      /* blocks in the cache */
    uint32_t k_type;        /* KERN_F16 (kv_default_params; the tools' default is
                             * kern_attn_kv_auto()), KERN_BF16, KERN_F32, KERN_Q8_0 or KERN_Q4_0 */
    uint32_t v_type;        /* the same choices, for V */
    uint32_t rotate;        /* KV_ROT_K | KV_ROT_V (kv_rotate_default) */
    const struct kv_parts *parts; /* which layers a block holds (copied); NULL: all of them */
};

struct kv_params kv_default_params(void);

/* The parts of model c's layers: kv_parts_plan over its windows. */
void kv_parts_for_model(const struct model_config *c, struct kv_parts *p);

struct pool_layout;

/* The layout of a shared pool (shm/pool.h) for model m: its KV shape, its
 * parts (kv_parts_for_model) and, when identify is set, its fingerprint (a
 * hash of all weights, tens of milliseconds); a private pool that no other
 * process opens may leave the fingerprint zero. */
void kv_pool_layout(const model_t *m, uint32_t block_tokens, uint32_t k_type, uint32_t v_type,
                    uint32_t rotate, bool identify, struct pool_layout *lay);

/* "K q8_0, V q4_0, rotated V" (or "K f16, V f16") into buf. */
void kv_describe(const struct kv_params *p, char *buf, size_t len);

/* The KV types from the command-line flags every tool takes (NULL where a flag
 * was not given): --kv-type T sets both, --k-type / --v-type one each (over
 * --kv-type), each auto by default (kern_attn_kv_auto(): bf16 or f16 by the
 * CPU), --kv-rotate on|off|auto (default auto). Fills p->k_type,
 * p->v_type and p->rotate; KVD_EINVAL with the flag named in err. */
int kv_params_from_flags(struct kv_params *p, const char *kv_type, const char *k_type,
                         const char *v_type, const char *rotate, char *err, size_t errlen);

/* For a GPU pool (gpu true): auto, given or by default, as f16, the GPU
 * engine's type, whatever the host's CPU would pick. */
void kv_gpu_auto(bool gpu, const char **kv_type, const char **k_type, const char **v_type);

/* The flags' help text, one option a line, for a tool's --help. */
#define KV_FLAGS_HELP                                                                          \
    "      --kv-type T        K and V element type: auto (the default: bf16 where the\n"           \
    "                         CPU attends over it faster, else f16), f16, bf16, f32,\n"           \
    "                         q8_0, q4_0\n"                                                       \
    "      --k-type T, --v-type T  the type of K or of V alone\n"                               \
    "      --kv-rotate on|off|auto  Walsh-Hadamard rotation before quantization\n"              \
    "                         (auto, the default: the quantized halves)\n"

typedef struct kvcache {
    uint32_t n_layer, n_head_kv, head_dim; /* shape, copied from the model */
    uint32_t block_tokens;  /* positions per block */
    uint32_t n_blocks;      /* blocks in mem */
    uint32_t k_type, v_type;/* element types of K and V (kv_type_ok) */
    uint32_t rotate;        /* KV_ROT_K | KV_ROT_V */
    size_t k_row_bytes;     /* one head of one token of K */
    size_t v_row_bytes;     /* the same of V */
    size_t k_head_bytes;    /* one K head of one layer of a block: block_tokens rows */
    size_t v_head_bytes;    /* the same of V */
    size_t layer_bytes;     /* one layer of a block: n_head_kv * (k_head_bytes + v_head_bytes) */
    size_t block_bytes;     /* a part's layers (parts.part_layers), K and V */
    struct kv_parts parts;  /* which layers a block holds; one table per part */
    uint8_t *mem;           /* n_blocks * block_bytes */
    bool owned;             /* mem is ours to free */
    uint32_t *free_ids;     /* simple free stack (single-process users) */
    uint32_t n_free;        /* entries in free_ids */
} kvcache_t;

/* Bytes of KV per token for a model with these types (kv_token_bytes). */
uint64_t kv_bytes_per_token(const struct model_config *c, uint32_t k_type, uint32_t v_type);

/* Allocates a cache of p->n_blocks blocks for model config c; NULL + err on bad
 * parameters or no memory. */
kvcache_t *kvcache_new(const struct model_config *c, const struct kv_params *p,
                       char *err, size_t errlen);

/* Wraps memory the caller owns (at least n_blocks * block bytes). */
kvcache_t *kvcache_wrap(const struct model_config *c, const struct kv_params *p,
                        void *mem, size_t size, char *err, size_t errlen);

void kvcache_destroy(kvcache_t **kv);

/* Start of the K (which = 0) or V (which = 1) heads of one layer of a block
 * of that layer's part. */
static inline uint8_t *kv_block_ptr(const kvcache_t *kv, uint32_t block, uint32_t layer, int which)
{
    return kv->mem + (size_t)block * kv->block_bytes +
           (size_t)kv_slot_of(&kv->parts, layer) * kv->layer_bytes +
           (which ? kv->n_head_kv * kv->k_head_bytes : 0);
}

/* Bytes between the KV heads of K (which = 0) or V (which = 1) in a block. */
static inline size_t kv_head_bytes(const kvcache_t *kv, int which)
{
    return which ? kv->v_head_bytes : kv->k_head_bytes;
}

/* Copies block `from`'s K and V (all the layers of its part) into block `to`. */
void kvcache_copy_block(kvcache_t *kv, uint32_t from, uint32_t to);

/* The simple free list for single-process use: takes one block id into *id
 * (KVD_ENOSPACE when none is free) or gives one back. */
int kvcache_alloc(kvcache_t *kv, uint32_t *id);
void kvcache_release(kvcache_t *kv, uint32_t id);

#endif
