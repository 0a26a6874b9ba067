/*
 * kvcache.h - the paged KV cache: fixed-size blocks of keys and values.
 *
 * A block holds block_tokens consecutive positions of one sequence for ALL
 * layers, so one block id means the same thing to every layer (and, once the
 * pool lives in shared memory, to every process). Inside a block the layout is
 *
 *     [layer][K=0,V=1][kv_head][token in block][head_dim]
 *
 * so that attention streams one head's keys contiguously. A sequence reaches
 * its blocks through a block table: logical block i -> physical block id.
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

#include "model.h"

struct kv_params {
    uint32_t block_tokens;  /* positions per block (default 16) */
    uint32_t n_blocks;      /* blocks in the cache */
    uint32_t dtype;         /* KERN_F16 (default) or KERN_F32 */
};

struct kv_params kv_default_params(void);

typedef struct kvcache {
    uint32_t n_layer, n_head_kv, head_dim; /* shape, copied from the model */
    uint32_t block_tokens;  /* positions per block */
    uint32_t n_blocks;      /* blocks in mem */
    uint32_t dtype;         /* KERN_F16 or KERN_F32 */
    size_t elem_bytes;      /* 2 or 4 */
    size_t head_bytes;      /* one head of one block: block_tokens * head_dim * elem */
    size_t block_bytes;     /* all layers, K and V */
    uint8_t *mem;           /* n_blocks * block_bytes */
    bool owned;             /* mem is ours to free */
    uint32_t *free_ids;     /* simple free stack (single-process users) */
    uint32_t n_free;        /* entries in free_ids */
} kvcache_t;

/* Bytes of KV per token for a model: 2 x layers x kv_heads x head_dim x elem. */
uint64_t kv_bytes_per_token(const struct model_config *c, uint32_t dtype);

/* Allocates a cache of p->n_blocks blocks for model config c; NULL + err on bad
 * parameters or no memory. */
kvcache_t *kvcache_new(const struct model_config *c, const struct kv_params *p,
                       char *err, size_t errlen);

/* Wraps memory the caller owns (at least n_blocks * block bytes). */
kvcache_t *kvcache_wrap(const struct model_config *c, const struct kv_params *p,
                        void *mem, size_t size, char *err, size_t errlen);

void kvcache_destroy(kvcache_t **kv);

/* Start of the K (which = 0) or V (which = 1) heads of one layer of a block. */
static inline uint8_t *kv_block_ptr(const kvcache_t *kv, uint32_t block, uint32_t layer, int which)
{
    return kv->mem + (size_t)block * kv->block_bytes +
           ((size_t)layer * 2 + (size_t)which) * kv->n_head_kv * kv->head_bytes;
}

/* The simple free list for single-process use: takes one block id into *id
 * (KVD_ENOSPACE when none is free) or gives one back. */
int kvcache_alloc(kvcache_t *kv, uint32_t *id);
void kvcache_release(kvcache_t *kv, uint32_t id);

#endif
