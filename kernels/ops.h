/*
 * ops.h - the element-wise and attention kernels of the forward pass
 * (portable C reference; faster paths are checked against these).
 *
 * Every kernel here computes each output from its inputs alone, in a fixed
 * order, so results never depend on batch composition or threading.
 */
#ifndef KVD_KERN_OPS_H
#define KVD_KERN_OPS_H

#include <stdint.h>

#define KERN_MAX_HEAD_DIM 512  /* the largest head the attention kernels take */

/* out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i]; out may alias x. */
void kern_rmsnorm(float *out, const float *x, const float *w, int n, float eps);

/* Fills cs[2*i], cs[2*i+1] with cos and sin of pos * base^(-2i/dim) for
 * i < dim/2, the angles of RoPE at one position. */
void kern_rope_angles(float *cs, int dim, int32_t pos, float base);

/* Rotates adjacent pairs (x[2i], x[2i+1]) of each of n_heads heads of size
 * dim by the angles in cs (GGUF llama models use this "normal" RoPE). */
void kern_rope(float *x, int n_heads, int dim, const float *cs);

/* gate[i] = silu(gate[i]) * up[i] (with AVX-512 where the active path has it:
 * a vector exponential, within a few ulp of expf). */
void kern_swiglu(float *gate, const float *up, int n);

/* dst[i] = src[i] as IEEE half, rounded to nearest even (kvd_f32_to_f16's bits). */
void kern_f32_to_f16_row(uint16_t *dst, const float *src, int n);

/* The AVX-512 bodies of the two above (x86 only). */
void kern_swiglu_avx512(float *gate, const float *up, int n);
void kern_f32_to_f16_avx512(uint16_t *dst, const float *src, int n);

/*
 * Causal attention of one query head over a paged cache, positions [0, n_ctx).
 *   q:           (head_dim) query, already rotated
 *   k_base, v_base: K and V of this layer in block 0; block b of head h starts at
 *                base + b * block_stride + h * head_stride (bytes)
 *   blocks:      block table, ceil(n_ctx / block_tokens) entries
 *   kv_dtype:    KERN_F16 or KERN_F32
 *   scores:      scratch of n_ctx floats
 *   out:         (head_dim) result
 * Scores are q.k * scale, softmax in f32 with the sum in double, then the
 * probability-weighted sum of V in position order. Over an f16 cache the
 * query and the probabilities are rounded to f16 as well (products of halves,
 * sums in f32), which is what llama.cpp's CPU attention does.
 * head_dim <= KERN_MAX_HEAD_DIM. When stats is not NULL it receives the
 * largest score and the sum of exp(score - largest), for merging the results
 * of several position ranges (see kern_attn_merge).
 */
void kern_attn_paged(float *out, const float *q, const uint8_t *k_base, const uint8_t *v_base,
                     const uint32_t *blocks, int n_ctx, int block_tokens, int head_dim,
                     int kv_head, uint64_t block_stride, uint64_t head_stride,
                     uint32_t kv_dtype, float scale, float *scores, float *stats);

#endif
