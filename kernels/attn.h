/*
 * attn.h - paged attention of the query heads that share one KV head.
 *
 * Reads each K and V row of the KV head once for all n_q query heads of its
 * group (grouped-query attention), on the instruction-set path kern_isa()
 * chose. Each head's result is computed by the same operations in the same
 * order whatever n_q is, so grouping heads differently never changes bits.
 */
#ifndef KVD_KERN_ATTN_H
#define KVD_KERN_ATTN_H

#include <stddef.h>
#include <stdint.h>

struct kern_attn_args {
    float *out;             /* n_q heads of head_dim results, head i at out + i * head_dim */
    const float *q;         /* n_q rotated queries, head i at q + i * head_dim */
    int n_q;                /* query heads */
    const uint8_t *k_base;  /* K of this layer in block 0 (see kern_attn_paged) */
    const uint8_t *v_base;  /* V of this layer in block 0 */
    const uint32_t *blocks; /* block table */
    int n_ctx;              /* positions [0, n_ctx) */
    int block_tokens;
    int head_dim;
    int kv_head;
    uint64_t block_stride;  /* bytes between blocks */
    uint64_t head_stride;   /* bytes between KV heads of a block */
    uint32_t kv_dtype;      /* KERN_F16 or KERN_F32 */
    float scale;            /* 1 / sqrt(head_dim) */
    float *scores;          /* scratch: n_q * n_ctx floats */
    float *stats;           /* NULL, or n_q pairs: largest score, sum of exp(score - largest) */
};

/* Merges the results of n ranges of positions of one head (range i's output
 * at outs + i * stride, its stats at stats + i * sstride) into the attention
 * over their union, in range order: out = sum_i w_i out_i, with w_i the share
 * of range i in the whole softmax sum. */
void kern_attn_merge(float *out, const float *outs, size_t stride, const float *stats, size_t sstride,
                     int n, int head_dim);

void kern_attn(const struct kern_attn_args *a);
void kern_attn_isa(const struct kern_attn_args *a, int isa);

/* x86 path; false when it does not handle the shape (head_dim % 8 != 0). */
int kern_attn_avx2(const struct kern_attn_args *a);

/* AVX-512 path for head_dim 64 and 128; 0 for other shapes. */
int kern_attn_avx512(const struct kern_attn_args *a);

#endif
