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

#include <stdbool.h>
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
    int skip;               /* positions [0, skip) are not attended (a sliding window's start
                             * inside blocks[0]); 0 for plain causal attention */
    int block_tokens;
    int head_dim;
    int kv_head;
    uint64_t block_stride;  /* bytes between blocks */
    uint64_t k_head_stride; /* bytes between the K heads of a block */
    uint64_t v_head_stride; /* bytes between the V heads of a block */
    uint32_t k_type;        /* KERN_F16, KERN_F32, KERN_Q8_0 or KERN_Q4_0 */
    uint32_t v_type;        /* the same choices, for V */
    float scale;            /* 1 / sqrt(head_dim) */
    float *scores;          /* scratch: n_q * n_ctx floats */
    float *stats;           /* NULL, or n_q pairs: largest score, sum of exp(score - largest) */
};

/* Row j of the context for a's KV head: its block, then its place in the
 * block (base: a->k_base or a->v_base, with its head stride and row size).
 * The SIMD paths call it at a block's first row and step by row_bytes. */
static inline const uint8_t *kern_attn_row(const struct kern_attn_args *a, const uint8_t *base,
                                           uint64_t head_stride, size_t row_bytes, int j)
{
    return base + a->blocks[j / a->block_tokens] * a->block_stride + (uint64_t)a->kv_head * head_stride +
           (size_t)(j % a->block_tokens) * row_bytes;
}

/* Merges the results of n ranges of positions of one head (range i's output
 * at outs + i * stride, its stats at stats + i * sstride) into the attention
 * over their union, in range order: out = sum_i w_i out_i, with w_i the share
 * of range i in the whole softmax sum. */
void kern_attn_merge(float *out, const float *outs, size_t stride, const float *stats, size_t sstride,
                     int n, int head_dim);

void kern_attn(const struct kern_attn_args *a);
void kern_attn_isa(const struct kern_attn_args *a, int isa);

/*
 * The C reference: causal attention of query head i of a (q + i * head_dim,
 * out + i * head_dim, stats + 2 * i) over positions [skip, n_ctx) of the paged
 * cache (the SIMD paths take it too). Block b of KV head h starts at k_base + b * block_stride + h *
 * k_head_stride (V likewise); a row is head_dim values of the K (V) type.
 *   scores:  scratch of n_ctx floats
 * Scores are q.k * scale, softmax in f32 with the sum in double, then the
 * probability-weighted sum of V in position order. The query meets K in K's
 * precision, as llama.cpp's CPU attention does:
 *   f16 K:   q rounded to f16, products of halves summed in f32;
 *   bf16 K:  q rounded to bf16, products (exact in f32) summed in f32;
 *   f32 K:   f32 products;
 *   q8_0/q4_0 K: q quantized to q8_0 (kern_quantize_act), and q.k is
 *            kern_vec_dot of the K row with it: integer sums per 32-value
 *            block, scaled and summed in block order, exact in the integers.
 * Over f16 (bf16) V the probabilities are rounded to f16 (bf16) too; over
 * quantized V each row is dequantized (d * code); the terms are accumulated
 * in f32.
 * head_dim <= KERN_MAX_HEAD_DIM. When stats is not NULL it receives the
 * largest score and the sum of exp(score - largest), for merging the results
 * of several position ranges (see kern_attn_merge).
 */
void kern_attn_paged(const struct kern_attn_args *a, int i);

/* x86 path; false when it does not handle the shape (head_dim % 8 != 0) or
 * the types (f16, bf16, f32; q8_0 and q4_0 where head_dim % 32 == 0). A bf16
 * value is converted exactly and multiplied in f32, the probabilities over a
 * bf16 V rounded to bf16 as in the C reference. */
int kern_attn_avx2(const struct kern_attn_args *a);

/* AVX-512 path for head_dim 64, 128 and 256; 0 for other shapes and types. */
int kern_attn_avx512(const struct kern_attn_args *a);

/* One query of kern_attn_multi: a (token, head) pair. */
struct kern_attn_query {
    const float *q;         /* head_dim rotated values */
    float *out;             /* head_dim results */
    float *stats;           /* NULL, or its largest score and sum (kern_attn's stats) */
    int n_ctx;              /* positions [first, n_ctx) of a's blocks */
    int first;              /* where its positions start (0, or a multiple of 16; where it is
                             * also one of a->block_tokens, the bits are kern_attn's over
                             * a->blocks + first / block_tokens) */
    int skip;               /* 0, or first <= skip < n_ctx: positions [first, skip) are read
                             * but not attended, as kern_attn's skip (a sliding window's start) */
};

#define KERN_ATTN_LANES 16    /* queries one kern_attn_multi call takes at most */
#define KERN_ATTN_V_BLOCK 4096 /* floats of V rows kern_attn_multi converts at a time */

/*
 * Up to KERN_ATTN_LANES queries of KV head a->kv_head at once, each over its
 * own positions [first, n_ctx) (a prefill's tokens of one sequence, with the
 * heads of their group; in a sliding window each with its own start): what
 * kern_attn does for each alone (over a->blocks + first / block_tokens,
 * n_ctx - first positions, skip - first skipped), with the same bits, reading
 * each K and V row once for all of them. a gives the cache (bases, blocks,
 * strides, types, scale, head_dim; a->skip must be 0); its q,
 * out, n_q, n_ctx, scores and stats are not read. Each query's out holds its
 * running sums as the call goes, so it must not overlap another's q or out. scratch: at least
 * kern_attn_multi_scratch(the largest n_ctx, head_dim) bytes. Returns 0, having done
 * nothing, where the active path has no such kernel for the shape or types
 * (the caller then runs kern_attn per query); 1 done.
 */
int kern_attn_multi(const struct kern_attn_args *a, const struct kern_attn_query *qs, int nq, void *scratch);
size_t kern_attn_multi_scratch(int n_ctx, int head_dim);

/* Whether kern_attn_multi takes these types and head size on the active path. */
bool kern_attn_multi_ok(uint32_t k_type, uint32_t v_type, int head_dim);

/* The KV element type `--kv-type auto` (the default) picks for this CPU:
 * KERN_BF16 where attention over bf16 was measured faster than over f16, at
 * f16's quality (kv-types.md): on the AMX-BF16 tiles (kern_amx_bf16()), or
 * with the bf16 dot product on an AMD CPU (Zen 4 and later); else KERN_F16,
 * also on an Intel CPU whose tiles are off or unusable (KVD_AMX=0, a kernel
 * or hypervisor without the tile state) and on one with avx512_bf16 but no
 * AMX (Cooper Lake, unmeasured): on Intel the vdpbf16ps kernels were slower
 * than f16's. */
uint32_t kern_attn_kv_auto(void);

/* The fewest kern_attn calls (each a token's heads of one KV head, over the
 * same positions) that one kern_attn_multi call of all their queries beats on
 * the active path, reading the rows once against the multi kernel's own
 * cost; 0 where kern_attn_multi does not take these types and head size. */
int kern_attn_multi_min(uint32_t k_type, uint32_t v_type, int head_dim);

/* The AVX-512 path of it: head_dim 64, 128 and 256, K f16 or f32. */
int kern_attn_avx512_multi(const struct kern_attn_args *a, const struct kern_attn_query *qs, int nq,
                           void *scratch);

/* AMX path (attn_amx.c) for a bf16 K and V, head_dim 64, 128 or 256, any
 * block size, where kern_amx_bf16(): a decode's
 * heads (kern_attn_amx) and kern_attn_multi's queries (kern_attn_amx_multi,
 * the same scratch) by one kernel, so a query's bits do not depend on the
 * call. 0 where it does not take a. */
int kern_attn_amx(const struct kern_attn_args *a);
int kern_attn_amx_multi(const struct kern_attn_args *a, const struct kern_attn_query *qs, int nq, void *scratch);

/* aarch64 path (NEON + sdot), the AVX2 path's design in 128-bit registers;
 * the same shapes and types. */
int kern_attn_neon(const struct kern_attn_args *a);

#endif
