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

#include "types.h"      /* KERN_MAX_HEAD_DIM */

/* out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i]; out may alias x. */
void kern_rmsnorm(float *out, const float *x, const float *w, int n, float eps);

/* kern_rmsnorm of `rows` consecutive rows of n (out row r from x row r; out
 * may alias x), with its bits, several rows at once. */
void kern_rmsnorm_rows(float *out, const float *x, const float *w, int n, float eps, int rows);

/* Fills cs[2*i], cs[2*i+1] with cos and sin of pos * base^(-2i/dim) for
 * i < dim/2, the angles of RoPE at one position. */
void kern_rope_angles(float *cs, int dim, int32_t pos, float base);

/* Rotates adjacent pairs (x[2i], x[2i+1]) of each of n_heads heads of size
 * dim by the angles in cs (GGUF llama models use this "normal" RoPE). */
void kern_rope(float *x, int n_heads, int dim, const float *cs);

/* The same angles applied to the pairs (x[i], x[i + dim/2]) of each head
 * ("NEOX" RoPE: Gemma, and models converted from Hugging Face's rotate_half). */
void kern_rope_neox(float *x, int n_heads, int dim, const float *cs);

/* gate[i] = gelu(gate[i]) * up[i], GELU in its tanh form
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Gemma's gated FFN), at
 * llama.cpp's precision: of x rounded to half, the result rounded to half
 * (its CPU GELU is a table of halves, and so is kvd's: the same bits on every
 * path); x from 10 up, 0 from -10 down. */
void kern_geglu(float *gate, const float *up, int n);

/* That table: the GELU of each of the 65,536 halves, rounded to a half, as
 * floats (filled on first use, thread-safe). */
const float *kern_gelu_table(void);

/* gate[i] = silu(gate[i]) * up[i] (with AVX-512 where the active path has it:
 * a vector exponential, within a few ulp of expf). */
void kern_swiglu(float *gate, const float *up, int n);

/* dst[i] = src[i] as IEEE half, rounded to nearest even (kvd_f32_to_f16's bits). */
void kern_f32_to_f16_row(uint16_t *dst, const float *src, int n);

/* The AVX-512 and AVX2 bodies of the two above (x86 only), and of kern_geglu
 * (table lookups by gather). */
void kern_swiglu_avx512(float *gate, const float *up, int n);
/* kern_rmsnorm_rows of the first rows, eight or sixteen at a time: returns how many it did. */
int kern_rmsnorm_rows_avx512(float *out, const float *x, const float *w, int n, float eps, int rows);
void kern_geglu_avx512(float *gate, const float *up, int n, const float *table);
void kern_geglu_avx2(float *gate, const float *up, int n, const float *table);
void kern_f32_to_f16_avx512(uint16_t *dst, const float *src, int n);
void kern_swiglu_avx2(float *gate, const float *up, int n);
void kern_f32_to_f16_avx2(uint16_t *dst, const float *src, int n);

/* In-place orthonormal Walsh-Hadamard transform of x[n], n a power of two
 * up to KERN_MAX_HEAD_DIM: x = H x / sqrt(n) with H the Sylvester Hadamard
 * matrix. Symmetric and its own inverse; a fixed order of operations, so the
 * same input gives the same bits everywhere. */
void kern_hadamard(float *x, int n);

#endif
