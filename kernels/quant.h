/*
 * quant.h - the portable C reference of kvd's quantized math.
 *
 * Dequantization of every weight type kvd reads, quantization of float rows
 * (weights for the model writer, activations for the dot products), and the
 * dot product and matrix multiply the forward pass is built on. SIMD and
 * CUDA paths are tested against these functions.
 *
 * The dot products follow llama.cpp's CPU backend: a weight row is
 * multiplied with an activation row quantized to the weight's "vec dot
 * type" (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants,
 * F32 for the float types), with integer sums per block and the same float
 * operations, in the same order, as its generic reference code.
 *
 * Numerics contract: kern_vec_dot's result depends only on the bytes of the
 * two rows, bit for bit: a fixed accumulation order, no threads, no
 * dependence on the batch. kern_matmul is built from it and inherits it.
 *
 * Rows are arrays of the blocks of quant_blocks.h. Weight rows need 2-byte
 * alignment, Q8_K activation rows 4-byte, F32 rows 4-byte.
 */
#ifndef KVD_KERN_QUANT_H
#define KVD_KERN_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "quant_blocks.h"
#include "types.h"

/* Converts a row of n elements of type `type` to floats in dst[n]. Types:
 * F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q4_K, Q5_K, Q6_K, Q8_K.
 * Returns 0, KVD_EINVAL when n is negative or not a multiple of the block
 * size, KVD_EUNSUPPORTED for any other type. */
int kern_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n);

/* Quantizes src[n] into a row of type `type` at dst (kern_row_bytes(type, n)
 * bytes). Types: everything kern_dequantize_row takes. The quantizers are
 * simple round-to-nearest ones (no error search as llama-quantize does);
 * Q8_0, Q8_1 and Q8_K are exactly the activation quantizers below. Inputs
 * must be finite. Returns 0, KVD_EINVAL, KVD_EUNSUPPORTED as above. */
int kern_quantize_row(uint32_t type, const float *src, void *dst, int64_t n);

/* Q4_0 for KV blocks, written once per token: per block of 32, the codes of
 * 19 scales around max/-8 (max the element of largest magnitude) are tried
 * and the one whose least-squares scale leaves the smallest squared error is
 * kept, with that scale. n a multiple of 32; deterministic. */
void kern_quantize_q4_0_lsq(const float *src, void *dst, int64_t n);

/* The activation type a weight type's dot product consumes: Q8_0 for Q4_0,
 * Q5_0, Q8_0; Q8_1 for Q4_1, Q5_1; Q8_K for Q4_K, Q5_K, Q6_K; F32 for F32,
 * F16, BF16. KERN_TYPE_LIMIT for a type kvd has no dot product for. */
uint32_t kern_vec_dot_type(uint32_t wtype);

/* Bytes of an activation row of n elements of act_type (Q8_0, Q8_1, Q8_K or
 * F32); 0 when the type is not an activation type or n is not a multiple
 * of its block. */
size_t kern_act_row_bytes(uint32_t act_type, int64_t n);

/* Quantizes the activation row src[n] into dst (kern_act_row_bytes bytes):
 *   Q8_0: per block d = amax/127, q = roundf(x * (1/d)), d stored as f16;
 *   Q8_1: the same plus s = d * sum(q) stored as f16 (llama.cpp's reference
 *         quantize_row_q8_1, d unrounded in s);
 *   Q8_K: per 256 d = max/-127 with max the element of largest magnitude,
 *         q = nearest-even(x * (-127/max)) capped at 127, and the 16-sums;
 *   F32:  a copy.
 * Does nothing when kern_act_row_bytes(act_type, n) is 0 (callers check it
 * once when they size their buffers). */
void kern_quantize_act(uint32_t act_type, const float *src, void *dst, int64_t n);

/* The same with AVX2, or AVX-512 sixteen blocks at a time, for Q8_0 and Q8_1
 * (the same bytes); false for other types or lengths. Called by
 * kern_quantize_act when the CPU has the instructions. */
bool kern_quantize_act_avx2(uint32_t act_type, const float *src, void *dst, int64_t n);
bool kern_quantize_act_avx512(uint32_t act_type, const float *src, void *dst, int64_t n);

/* Dot product of one weight row (n elements of wtype) with one activation
 * row of type kern_vec_dot_type(wtype) and the same n. Integer dot per
 * block, then float accumulation of the scaled block sums in block order
 * (the K-quants keep llama.cpp's 8 float lanes); float weight types are
 * dequantized 32 at a time and accumulated in double. Returns NAN when
 * wtype has no dot product or n is not a multiple of its block. */
float kern_vec_dot(uint32_t wtype, int64_t n, const void *w_row, const void *act_row);

/* out[t*rows + r] = kern_vec_dot(wtype, n, row r of w, row t of act) for
 * r < rows, t < n_tok. w holds `rows` consecutive weight rows of n
 * elements; act holds n_tok activation rows of type kern_vec_dot_type(wtype),
 * row t starting at byte t*act_stride. The weight row is the outer loop, so
 * each weight row is read once for all tokens, and a token's results do not
 * depend on the other tokens. Bad types or sizes fill out with NAN. */
void kern_matmul(uint32_t wtype, const void *w, int64_t rows, int64_t n,
                 const void *act, int64_t n_tok, size_t act_stride, float *out);

/* ---- unpacked rows, for the SIMD kernels -------------------------------------
 *
 * The integer kernels see every quantized weight row as one byte per element
 * plus float scales per block of 32 (or 16): element e is
 *   S32:  d[e/32] * q[e]                  (Q4_0, Q5_0, Q8_0; q signed)
 *   U32M: d[e/32] * q[e] + m[e/32]        (Q4_1, Q5_1, Q4_K, Q5_K; q unsigned)
 *   S16:  d[e/16] * q[e]                  (Q6_K; q signed)
 * and every activation row as 32-byte blocks of int8 with a scale da and, for
 * the min term, sa = da * (sum of the block's values) (Q8_1's s, Q8_K's bsums).
 */
enum { KERN_UNPACK_NONE, KERN_UNPACK_S32, KERN_UNPACK_U32M, KERN_UNPACK_S16 };

/* The unpacked form of a weight type (KERN_UNPACK_NONE: float types and others). */
int kern_unpack_kind(uint32_t wtype);

/* Unpacks a row of n elements: q[n] bytes, d[n/32] (n/16 for S16), m[n/32] (U32M). */
void kern_unpack_row(uint32_t wtype, const void *row, int64_t n, int8_t *q, float *d, float *m);

/* The scales of a K-quant row of n elements as the file holds them: Q4_K
 * and Q5_K per 32 values the 6-bit scale sc and minimum mn, per 256 the f16
 * d and dmin (kern_unpack_row's d is d * sc, its m -dmin * mn); Q6_K per 16
 * values its int8 scale (as a byte in sc) and per 256 its d, mn and dmin
 * untouched. */
void kern_unpack_k_scales(uint32_t wtype, const void *row, int64_t n, uint8_t *sc, uint8_t *mn, kvd_f16 *d,
                          kvd_f16 *dmin);

/* For an activation row of act_type (Q8_0, Q8_1, Q8_K): byte offsets of each
 * 32-value block's int8 values (offs may be NULL), its scale da and sa as above.
 * Returns 0 or KVD_EUNSUPPORTED. */
int kern_act_blocks(uint32_t act_type, const void *row, int64_t n, uint32_t *offs, float *da, float *sa);

#endif
