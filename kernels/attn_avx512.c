/*
 * attn_avx512.c - grouped paged attention with AVX-512, for head sizes of
 * 64 and 128 (the llama family's) and 256 (Gemma 3's); a sliding window's
 * first block is read whole, its positions before the window masked out.
 *
 * Positions go sixteen at a time. Their K rows are converted once for the
 * whole group of query heads (to floats, or from q8_0 / q4_0 to int16 codes);
 * each head's sixteen dot products are sixteen-lane partial sums reduced
 * together by one transpose-and-add tree, so a score costs a few
 * instructions instead of a horizontal sum. Softmax runs sixteen lanes wide
 * (its sum in double), then out += p v position by position with one V row
 * conversion for all heads. A partial group at the end of the context goes
 * through the same instructions with its missing rows zeroed and its lanes
 * masked, and every head's result is computed the same way whatever heads
 * share the call.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "attn.h"
#include "attn512.h"
#include "cpu.h"
#include "exp512.h"
#include "f16.h"
#include "ops.h"
#include "quant.h"
#include "types.h"

static inline bool kv_simd_type(uint32_t t)
{
    return t == KERN_F16 || t == KERN_F32 || t == KERN_BF16 || t == KERN_Q8_0 || t == KERN_Q4_0;
}

/* Whether this path reads a's V: a bf16 V takes the bf16 dot product over
 * pairs of positions, which needs the instruction and blocks of an even
 * number of positions (a pair never spans two). */
static inline bool v_simd_type(const struct kern_attn_args *a)
{
    return kv_simd_type(a->v_type) &&
           (a->v_type != KERN_BF16 || (kern_avx512bf16() && a->block_tokens % 2 == 0));
}

/* Whether this path reads a K of type t: a bf16 K takes the bf16 dot
 * product (vdpbf16ps), which not every AVX-512 CPU has. */
static inline bool k_simd_type(uint32_t t)
{
    return kv_simd_type(t) && (t != KERN_BF16 || kern_avx512bf16());
}

/* The score tree. Sixteen positions' partial sums p0 .. p15 (sixteen-lane
 * vectors) become their scores, lane i the sum of p_i's lanes, as
 * tree8(tree8(tree4(tree2(p0, p1), tree2(p2, p3)), tree4(tree2(p4, p5),
 * tree2(p6, p7))), tree8(... p8 .. p15)); every score of this file, on every
 * path, is added up in this order. tree2 adds the lanes of two vectors
 * pairwise within each 128-bit lane (a0+a2, b0+b2, a1+a3, b1+b3, ...), tree4
 * two tree2 results to per-128-bit-lane sums of four vectors, tree8 two tree4
 * (or tree8) results across the 128-bit lanes. */
static inline __m512 tree2(__m512 a, __m512 b)
{
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

static inline __m512 tree4(__m512 a, __m512 b)
{
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

static inline __m512 tree8(__m512 a, __m512 b)
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __m512 load16(const uint8_t *row, int h, bool half)
{
    if (half)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 32 * (size_t)h)));
    return _mm512_loadu_ps((const float *)row + 16 * h);
}

/* Sixteen bf16 values from value 16h of a row, as floats (exact: the upper
 * halves of their f32s). */
static inline __m512 load16_bf(const uint8_t *row, int h)
{
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 32 * (size_t)h)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Sixteen values of an f16, bf16 or f32 V row (a constant type). */
static inline __attribute__((always_inline)) __m512 vload16(const uint8_t *row, int h, uint32_t type)
{
    return type == KERN_BF16 ? load16_bf(row, h) : load16(row, h, type == KERN_F16);
}

/* x rounded to bf16 (to nearest, ties to even) in the low half of each
 * lane, for the finite non-negative probabilities it is given (a denormal
 * stays one: vdpbf16ps takes it as zero, as it takes every denormal). */
static inline __m512i bf16_bits(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
}

/* Entering block b of the context: ask for block b + 1's K rows into L1 and
 * block b + 4's into L2 (16 rows of one head are 2 KB at head size 64
 * and take about 0.2 us to score, less than a trip to memory; four
 * ahead: a cold decode call over 1,024 positions 31.6 -> 28.2 us, one and two
 * ahead 31.6 and 29.5), and block b's V rows (read after the softmax) into
 * L2. Each block's rows of one head are contiguous, and a context's blocks
 * are scattered, so the hardware prefetcher would restart at every block.
 * Always inlined: GCC judged a call whose only effects are prefetches to do
 * nothing and dropped it, so until this was inlined no prefetch was issued. */
static inline __attribute__((always_inline)) void prefetch_block(const struct kern_attn_args *a, int b, int n, uint64_t k_off,
                                  uint64_t v_off, size_t k_row_bytes, size_t v_row_bytes)
{
    const size_t k_bytes = (size_t)a->block_tokens * k_row_bytes;
    const size_t v_bytes = (size_t)a->block_tokens * v_row_bytes;
    const uint8_t *v = a->v_base + a->blocks[b] * a->block_stride + v_off;
    for (size_t o = 0; o < v_bytes; o += 64)
        _mm_prefetch((const char *)v + o, _MM_HINT_T1);
    if ((b + 1) * a->block_tokens < n) {
        const uint8_t *k = a->k_base + a->blocks[b + 1] * a->block_stride + k_off;
        for (size_t o = 0; o < k_bytes; o += 64)
            _mm_prefetch((const char *)k + o, _MM_HINT_T0);
    }
    if ((b + 4) * a->block_tokens < n) {
        const uint8_t *k = a->k_base + a->blocks[b + 4] * a->block_stride + k_off;
        for (size_t o = 0; o < k_bytes; o += 64)
            _mm_prefetch((const char *)k + o, _MM_HINT_T1);
    }
}

#define MAX_Q 4  /* query heads per pass */

/* The f16 scale at the start of a q8_0 / q4_0 block, as a float. */
static inline float block_scale(const uint8_t *blk)
{
    uint16_t h;
    memcpy(&h, blk, 2);
    return _cvtsh_ss(h);
}

/* Dword e of every lane of four vectors, gathered: z[i] holds in its 128-bit
 * lane L the dwords of some row r(i, L); afterwards t[e] lane 4L + i holds
 * dword e of row r(i, L) (a 4x4 dword transpose in each 128-bit lane). */
static inline void transpose4(const __m512i z[4], __m512i t[4])
{
    const __m512i a0 = _mm512_unpacklo_epi32(z[0], z[1]), a1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i a2 = _mm512_unpacklo_epi32(z[2], z[3]), a3 = _mm512_unpackhi_epi32(z[2], z[3]);
    t[0] = _mm512_unpacklo_epi64(a0, a2);
    t[1] = _mm512_unpackhi_epi64(a0, a2);
    t[2] = _mm512_unpacklo_epi64(a1, a3);
    t[3] = _mm512_unpackhi_epi64(a1, a3);
}

/* 16 bytes at offset `at` of the rows of positions i, i+4, i+8, i+12 (rows[]), one per 128-bit lane. */
static inline __m512i rows4(const uint8_t *const rows[16], int i, size_t at)
{
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rows[i] + at)));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(rows[i + 4] + at)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(rows[i + 8] + at)), 2);
    return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(rows[i + 12] + at)), 3);
}

/*
 * The codes of block `blk_at` (byte offset in the row) of sixteen K rows,
 * transposed for vpdpbusd: t[e] lane p holds, as four unsigned bytes, the
 * codes of elements 4e .. 4e+3 of position p's block (q8_0 codes + 128, q4_0
 * codes as stored, 0..15). Its scales go to d[p].
 */
static inline void codes_t(const uint8_t *const rows[16], size_t blk_at, uint32_t type, __m512i t[8],
                           float d[16])
{
    for (int p = 0; p < 16; p++)
        d[p] = block_scale(rows[p] + blk_at);
    __m512i z[4];
    if (type == KERN_Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int half = 0; half < 2; half++) {
            for (int i = 0; i < 4; i++)
                z[i] = rows4(rows, i, blk_at + 2 + 16 * (size_t)half);
            transpose4(z, t + 4 * half);
            for (int e = 0; e < 4; e++)
                t[4 * half + e] = _mm512_xor_si512(t[4 * half + e], flip);
        }
        return;
    }
    for (int i = 0; i < 4; i++)
        z[i] = rows4(rows, i, blk_at + 2);
    __m512i u[4];
    transpose4(z, u);
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int e = 0; e < 4; e++) {
        t[e] = _mm512_and_si512(u[e], lo4);                           /* elements 4e .. 4e+3 */
        t[4 + e] = _mm512_and_si512(_mm512_srli_epi16(u[e], 4), lo4); /* elements 16+4e .. */
    }
}

/* One position's score for one head: its HV sixteen-lane partial sums, a
 * chain of multiply-adds over the slices (the score tree then adds the lanes). */
static inline __attribute__((always_inline)) __m512 dot16(const int HV, const __m512 *q, const __m512 *k)
{
    __m512 s = _mm512_mul_ps(q[0], k[0]);
#pragma GCC unroll 16
    for (int h = 1; h < HV; h++)
        s = _mm512_fmadd_ps(q[h], k[h], s);
    return s;
}

/* Thirty-two values of a query from value 32w on, rounded to bf16 (to
 * nearest even) in their order. */
static inline __m512bh q_bf16(const float *q, int w)
{
    return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * w + 16), _mm512_loadu_ps(q + 32 * w));
}

/* One position's score for one head over a bf16 K row: its sixteen lanes'
 * partial sums, lane i a chain of bf16 dot products over the row's HW
 * vectors of 32 values (vdpbf16ps adds, in lane i of vector w, the product
 * of values 32w + 2i + 1 first and then that of 32w + 2i, each product exact
 * and each add rounded as an f32 add). The score tree then adds the lanes. */
static inline __attribute__((always_inline)) __m512 dot_bf(const int HW, const __m512bh *q, const __m512bh *k)
{
    __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], k[0]);
#pragma GCC unroll 8
    for (int w = 1; w < HW; w++)
        s = _mm512_dpbf16_ps(s, q[w], k[w]);
    return s;
}

/* A row of zeros for the positions past the context in a last group of
 * sixteen, of any K type (f32 at head size 256 is the largest row). */
static const uint8_t zero_row[256 * 4] __attribute__((aligned(64)));

/* Scores of NQ heads over an f16, bf16 or f32 K (KT): q (rounded to f16 or
 * bf16 over those) times each K row, an f16 row converted once into
 * registers for all heads, a bf16 row read as it is stored by the bf16 dot
 * product (dot_bf: half the multiply-add instructions). The sixteen
 * positions' partial sums go through the score tree as they come, two
 * positions at a time (tree2, tree4, tree8: the same additions in the same
 * order), so no row and no partial sum passes through memory. */
static inline __attribute__((always_inline)) void
scores_float(const int HV, const int NQ, const uint32_t KT, const struct kern_attn_args *a, int q0,
             __m512 vmax[MAX_Q])
{
    const bool HALF = KT == KERN_F16, BF = KT == KERN_BF16;
    const int hd = 16 * HV, HW = HV / 2, n = a->n_ctx;
    const size_t row_bytes = (size_t)hd * (KT == KERN_F32 ? 4 : 2);
    const size_t v_row_bytes = kern_row_bytes(a->v_type, hd);
    __m512 qv[MAX_Q][16];
    __m512bh qb[MAX_Q][8];
    for (int g = 0; g < NQ; g++) {
        for (int h = 0; h < HV && !BF; h++) {
            __m512 x = _mm512_loadu_ps(a->q + (size_t)(q0 + g) * hd + 16 * h);
            if (HALF)  /* q meets an f16 cache as f16, as in the C reference */
                x = _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            qv[g][h] = x;
        }
        for (int w = 0; w < HW && BF; w++)
            qb[g][w] = q_bf16(a->q + (size_t)(q0 + g) * hd, w);
    }
    const __m512 scale = _mm512_set1_ps(a->scale);
    const uint64_t k_off = (uint64_t)a->kv_head * a->k_head_stride;
    const uint64_t v_off = (uint64_t)a->kv_head * a->v_head_stride;
    const uint32_t *blocks = a->blocks;
    const uint8_t *k_base = a->k_base + k_off;
    const size_t block_stride = a->block_stride;
    const int bt = a->block_tokens;
    int blk = 0, off = 0;  /* the next position's block and row, without a division per row */
    const uint8_t *k = NULL;   /* set on entering each block */
    const uint8_t *rows[16];
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int cnt = n - j0 < 16 ? n - j0 : 16;
        const __mmask16 m = live16(j0, n, a->skip);   /* the rows are read either way */
        for (int p = 0; p < cnt; p++) {
            if (off == 0) {
                prefetch_block(a, blk, n, k_off, v_off, row_bytes, v_row_bytes);
                k = k_base + (size_t)blocks[blk] * block_stride;
            }
            rows[p] = k;
            k += row_bytes;
            if (++off == bt) {
                off = 0;
                blk++;
            }
        }
        for (int p = cnt; p < 16; p++)
            rows[p] = zero_row;
        __m512 x[2][MAX_Q];
#pragma GCC unroll 2
        for (int o = 0; o < 2; o++) {
            __m512 u[2][MAX_Q];
#pragma GCC unroll 2
            for (int r = 0; r < 2; r++) {
                __m512 t[2][MAX_Q];
                if (BF) {
#pragma GCC unroll 2
                    for (int i = 0; i < 2; i++) {
                        const int p = 8 * o + 4 * r + 2 * i;
                        __m512bh k0[8], k1[8];
#pragma GCC unroll 8
                        for (int w = 0; w < HW; w++) {
                            k0[w] = (__m512bh)_mm512_loadu_si512((const void *)(rows[p] + 64 * w));
                            k1[w] = (__m512bh)_mm512_loadu_si512((const void *)(rows[p + 1] + 64 * w));
                        }
#pragma GCC unroll 4
                        for (int g = 0; g < NQ; g++)
                            t[i][g] = tree2(dot_bf(HW, qb[g], k0), dot_bf(HW, qb[g], k1));
                    }
                } else if (HV >= 16 && NQ >= 2) {
                    /* long rows: four positions' chains side by side, slice
                     * by slice, so that a query slice loaded once serves four
                     * multiply-adds (by rows, every one of them took a load) */
                    const int p = 8 * o + 4 * r;
                    __m512 s[MAX_Q][4];
#pragma GCC unroll 16
                    for (int h = 0; h < HV; h++) {
                        __m512 k4[4];
#pragma GCC unroll 4
                        for (int i = 0; i < 4; i++)
                            k4[i] = load16(rows[p + i], h, HALF);
#pragma GCC unroll 4
                        for (int g = 0; g < NQ; g++)
#pragma GCC unroll 4
                            for (int i = 0; i < 4; i++)
                                s[g][i] = h == 0 ? _mm512_mul_ps(qv[g][0], k4[i])
                                                 : _mm512_fmadd_ps(qv[g][h], k4[i], s[g][i]);
                    }
#pragma GCC unroll 4
                    for (int g = 0; g < NQ; g++) {
                        t[0][g] = tree2(s[g][0], s[g][1]);
                        t[1][g] = tree2(s[g][2], s[g][3]);
                    }
                } else
#pragma GCC unroll 2
                for (int i = 0; i < 2; i++) {
                    const int p = 8 * o + 4 * r + 2 * i;
                    __m512 kr[16], s0[MAX_Q];
#pragma GCC unroll 16
                    for (int h = 0; h < HV; h++)
                        kr[h] = load16(rows[p], h, HALF);
#pragma GCC unroll 4
                    for (int g = 0; g < NQ; g++)
                        s0[g] = dot16(HV, qv[g], kr);
#pragma GCC unroll 16
                    for (int h = 0; h < HV; h++)
                        kr[h] = load16(rows[p + 1], h, HALF);
#pragma GCC unroll 4
                    for (int g = 0; g < NQ; g++)
                        t[i][g] = tree2(s0[g], dot16(HV, qv[g], kr));
                }
#pragma GCC unroll 4
                for (int g = 0; g < NQ; g++)
                    u[r][g] = tree4(t[0][g], t[1][g]);
            }
#pragma GCC unroll 4
            for (int g = 0; g < NQ; g++)
                x[o][g] = tree8(u[0][g], u[1][g]);
        }
#pragma GCC unroll 4
        for (int g = 0; g < NQ; g++) {
            const __m512 sc = _mm512_mul_ps(tree8(x[0][g], x[1][g]), scale);
            _mm512_mask_storeu_ps(a->scores + (size_t)g * n + j0, m, sc);
            vmax[g] = _mm512_mask_max_ps(vmax[g], m, vmax[g], sc);
        }
    }
}

/* Scores of NQ heads over a q8_0 or q4_0 K: each query quantized to q8_0 as
 * the C reference does; per 32-value block, sixteen positions' codes are
 * transposed once for all heads (codes_t) so that eight vpdpbusd give the
 * sixteen integer dot products in the lanes, corrected for the codes' offset
 * (128 or 8 times the sum of the query's codes); then the scaled block sums
 * are added in block order with the C reference's float operations
 * (kern_vec_dot), so every score has its bits exactly. */
static inline __attribute__((always_inline)) void
scores_quant(const int HV, const int NQ, const struct kern_attn_args *a, int q0, __m512 vmax[MAX_Q])
{
    const int hd = 16 * HV, n = a->n_ctx, NB = HV / 2;
    const bool q8 = a->k_type == KERN_Q8_0;
    const size_t row_bytes = kern_row_bytes(a->k_type, hd), blk_bytes = row_bytes / (size_t)NB;
    const size_t v_row_bytes = kern_row_bytes(a->v_type, hd);
    int32_t qw[MAX_Q][8][8];   /* the query's codes, four a dword */
    __m512i qcorr[MAX_Q][8];   /* offset x sum of the query block's codes */
    __m512 qd[MAX_Q][8];       /* the query blocks' scales */
    for (int g = 0; g < NQ; g++) {
        struct kern_block_q8_0 qq[8];
        kern_quantize_act(KERN_Q8_0, a->q + (size_t)(q0 + g) * hd, qq, hd);
        for (int b = 0; b < NB; b++) {
            int sum = 0;
            for (int i = 0; i < 32; i++)
                sum += qq[b].qs[i];
            memcpy(qw[g][b], qq[b].qs, 32);
            qcorr[g][b] = _mm512_set1_epi32((q8 ? 128 : 8) * sum);
            qd[g][b] = _mm512_set1_ps(kvd_f16_to_f32(qq[b].d));
        }
    }
    const __m512 scale = _mm512_set1_ps(a->scale);
    const uint64_t k_off = (uint64_t)a->kv_head * a->k_head_stride;
    const uint64_t v_off = (uint64_t)a->kv_head * a->v_head_stride;
    int blk = 0, off = 0;
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int cnt = n - j0 < 16 ? n - j0 : 16;
        const __mmask16 m = live16(j0, n, a->skip);   /* the rows are read either way */
        const uint8_t *rows[16];
        for (int p = 0; p < 16; p++) {
            if (p >= cnt) {
                rows[p] = zero_row;     /* scale 0: a score of 0 in a masked lane */
                continue;
            }
            if (off == 0)
                prefetch_block(a, blk, n, k_off, v_off, row_bytes, v_row_bytes);
            rows[p] = a->k_base + a->blocks[blk] * a->block_stride + k_off + (size_t)off * row_bytes;
            if (++off == a->block_tokens) {
                off = 0;
                blk++;
            }
        }
        __m512 sum[MAX_Q];
        for (int g = 0; g < NQ; g++)
            sum[g] = _mm512_setzero_ps();
        for (int b = 0; b < NB; b++) {
            __m512i t[8];
            float kd[16] __attribute__((aligned(64)));
            codes_t(rows, (size_t)b * blk_bytes, a->k_type, t, kd);
            const __m512 dk = _mm512_load_ps(kd);
            for (int g = 0; g < NQ; g++) {
                __m512i acc = _mm512_setzero_si512();
                for (int e = 0; e < 8; e++)
                    acc = _mm512_dpbusd_epi32(acc, t[e], _mm512_set1_epi32(qw[g][b][e]));
                const __m512 si = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, qcorr[g][b]));
                /* kern_vec_dot's order: q8_0 (dk * dq) * si, q4_0 (si * dk) * dq */
                const __m512 tm = q8 ? _mm512_mul_ps(_mm512_mul_ps(dk, qd[g][b]), si)
                                     : _mm512_mul_ps(_mm512_mul_ps(si, dk), qd[g][b]);
                sum[g] = _mm512_add_ps(sum[g], tm);
            }
        }
        for (int g = 0; g < NQ; g++) {
            const __m512 sc = _mm512_mul_ps(sum[g], scale);
            _mm512_mask_storeu_ps(a->scores + (size_t)g * n + j0, m, sc);
            vmax[g] = _mm512_mask_max_ps(vmax[g], m, vmax[g], sc);
        }
    }
}

/* out += p v over a q8_0 or q4_0 V: each row's codes converted to floats and
 * scaled (d * code, kern_dequantize_row's values) once for all heads. */
static inline __attribute__((always_inline)) void
values_quant(const int HV, const int NQ, const struct kern_attn_args *a, __m512 acc[MAX_Q][16])
{
    const int hd = 16 * HV, n = a->n_ctx, NB = HV / 2;
    const bool q8 = a->v_type == KERN_Q8_0;
    const size_t row_bytes = kern_row_bytes(a->v_type, hd), blk_bytes = row_bytes / (size_t)NB;
    const uint64_t v_off = (uint64_t)a->kv_head * a->v_head_stride;
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    const __m512i eight = _mm512_set1_epi32(8);
    for (int j0 = 0, b = 0; j0 < n; j0 += a->block_tokens, b++) {
        const uint8_t *v = a->v_base + a->blocks[b] * a->block_stride + v_off;
        const int end = n - j0 < a->block_tokens ? n : j0 + a->block_tokens;
        for (int j = j0; j < end; j++, v += row_bytes)
#pragma GCC unroll 8
            for (int k = 0; k < NB; k++) {
                const uint8_t *blk = v + (size_t)k * blk_bytes;
                const __m512 d = _mm512_set1_ps(block_scale(blk));
                __m512i c0, c1;
                if (q8) {
                    c0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)));
                    c1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)));
                } else {
                    const __m128i x = _mm_loadu_si128((const __m128i *)(blk + 2));
                    c0 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(x, lo4)), eight);
                    c1 = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(x, 4), lo4)), eight);
                }
                const __m512 v0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(c0));
                const __m512 v1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(c1));
#pragma GCC unroll 4
                for (int g = 0; g < NQ; g++) {
                    const __m512 p = _mm512_set1_ps(a->scores[(size_t)g * n + j]);
                    acc[g][2 * k] = _mm512_fmadd_ps(p, v0, acc[g][2 * k]);
                    acc[g][2 * k + 1] = _mm512_fmadd_ps(p, v1, acc[g][2 * k + 1]);
                }
            }
    }
}

/* out = sum p v over an f16, bf16 or f32 V (VT) for slices [c, c + HC) of NQ heads,
 * position by position from zero, each V slice converted once for all
 * heads. All of a pass's sums stay in registers: with more than 32 of them
 * (head size 256, three or four heads) GCC kept them on the stack, a load and
 * a store around every multiply-add (37 of 84 ns a position at 4 x 256 over
 * warm rows; 74 in passes of four slices, AMD EPYC); the passes read the V
 * rows again from cache, and each sum's order is the same. */
static inline __attribute__((always_inline)) void
values_float(const int HV, const int NQ, const int HC, int c, const uint32_t VT, const struct kern_attn_args *a,
             int q0)
{
    const int hd = 16 * HV, n = a->n_ctx;
    const size_t v_row_bytes = kern_row_bytes(a->v_type, hd);
    const uint64_t v_off = (uint64_t)a->kv_head * a->v_head_stride;
    __m512 acc[MAX_Q][16];
    for (int g = 0; g < NQ; g++)
        for (int h = 0; h < HC; h++)
            acc[g][h] = _mm512_setzero_ps();
    for (int j0 = 0, b = 0; j0 < n; j0 += a->block_tokens, b++) {
        const uint8_t *v = a->v_base + a->blocks[b] * a->block_stride + v_off;
        const int end = n - j0 < a->block_tokens ? n : j0 + a->block_tokens;
        for (int j = j0; j < end; j++, v += v_row_bytes)
#pragma GCC unroll 16
            for (int h = 0; h < HC; h++) {
                const __m512 vv = vload16(v, c + h, VT);
#pragma GCC unroll 4
                for (int g = 0; g < NQ; g++)
                    acc[g][h] = _mm512_fmadd_ps(_mm512_set1_ps(a->scores[(size_t)g * n + j]), vv, acc[g][h]);
            }
    }
    for (int g = 0; g < NQ; g++)
        for (int h = 0; h < HC; h++)
            _mm512_storeu_ps(a->out + (size_t)(q0 + g) * hd + 16 * (c + h), acc[g][h]);
}

/* out = sum p v over a bf16 V: the positions in pairs (2m, 2m + 1), each
 * pair one bf16 dot-product step per value (vdpbf16ps: the odd position's
 * term added first, each add rounded as an f32 add), the probabilities
 * rounded to bf16 and stored as pairs (pr: dword m of head g's scores holds
 * positions 2m and 2m + 1). The rows of a pair are interleaved in
 * registers, which puts values 8l .. 8l + 3 of each 32 in the low half
 * (acc[2w]) and 8l + 4 .. 8l + 7 in the high (acc[2w + 1]); the stores put
 * them back in order. Vectors [w0, w0 + WC) of 32 values, a pass. Block
 * sizes are even (the caller checks), so a pair never spans two blocks; past
 * an odd context's end the pair's second row is zero_row, its p 0. */
static inline __attribute__((always_inline)) void
values_bf16(const int HV, const int NQ, const int WC, int w0, const struct kern_attn_args *a, int q0)
{
    const int hd = 16 * HV, n = a->n_ctx;
    const size_t row_bytes = (size_t)hd * 2;
    const uint64_t v_off = (uint64_t)a->kv_head * a->v_head_stride;
    const uint32_t *pr = (const uint32_t *)a->scores;
    __m512 acc[MAX_Q][16];
    for (int g = 0; g < NQ; g++)
        for (int k = 0; k < 2 * WC; k++)
            acc[g][k] = _mm512_setzero_ps();
    for (int j0 = 0, b = 0; j0 < n; j0 += a->block_tokens, b++) {
        const uint8_t *v = a->v_base + a->blocks[b] * a->block_stride + v_off;
        const int end = n - j0 < a->block_tokens ? n : j0 + a->block_tokens;
        for (int j = j0; j < end; j += 2, v += 2 * row_bytes) {
            const uint8_t *v1 = j + 1 < n ? v + row_bytes : zero_row;
#pragma GCC unroll 8
            for (int w = 0; w < WC; w++) {
                const __m512i A = _mm512_loadu_si512((const void *)(v + 64 * (w0 + w)));
                const __m512i B = _mm512_loadu_si512((const void *)(v1 + 64 * (w0 + w)));
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(A, B), hi = (__m512bh)_mm512_unpackhi_epi16(A, B);
#pragma GCC unroll 4
                for (int g = 0; g < NQ; g++) {
                    const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pr[(size_t)g * n + j / 2]);
                    acc[g][2 * w] = _mm512_dpbf16_ps(acc[g][2 * w], lo, pp);
                    acc[g][2 * w + 1] = _mm512_dpbf16_ps(acc[g][2 * w + 1], hi, pp);
                }
            }
        }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < NQ; g++)
        for (int w = 0; w < WC; w++) {
            float *o = a->out + (size_t)(q0 + g) * hd + 32 * (w0 + w);
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(acc[g][2 * w], first, acc[g][2 * w + 1]));
            _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(acc[g][2 * w], second, acc[g][2 * w + 1]));
        }
}

/* The probabilities p[0 .. n) (scaled by inv as they are read) as bf16
 * pairs over themselves: dword m = p[2m] | p[2m + 1] << 16, p[n] = 0. */
static inline void pairs_bf16(float *p, int n, __m512 inv)
{
    const __m512i evens = _mm512_setr_epi32(0x00020000, 0x00060004, 0x000a0008, 0x000e000c, 0x00120010,
                                            0x00160014, 0x001a0018, 0x001e001c, 0x00220020, 0x00260024,
                                            0x002a0028, 0x002e002c, 0x00320030, 0x00360034, 0x003a0038,
                                            0x003e003c);
    for (int j = 0; j < n; j += 32) {
        const __mmask16 m0 = live16(j, n, 0), m1 = j + 16 < n ? live16(j + 16, n, 0) : 0;
        const __m512i r0 = bf16_bits(_mm512_mul_ps(_mm512_maskz_loadu_ps(m0, p + j), inv));
        const __m512i r1 = bf16_bits(_mm512_mul_ps(_mm512_maskz_loadu_ps(m1, p + j + 16), inv));
        /* words 2k of r0:r1, the low halves: position j + k's bf16 */
        const __m512i w = _mm512_permutex2var_epi16(r0, evens, r1);
        const int pairs = (n - j + 1) / 2 < 16 ? (n - j + 1) / 2 : 16;
        _mm512_mask_storeu_epi32(p + j / 2, (__mmask16)((1u << pairs) - 1u), w);
    }
}

/* HV = head_dim / 16 (4, 8 or 16), NQ query heads (1..MAX_Q). */
static inline __attribute__((always_inline)) void
attn_pass(const int HV, const int NQ, const struct kern_attn_args *a, int q0)
{
    const int hd = 16 * HV, n = a->n_ctx;
    /* scores */
    __m512 vmax[MAX_Q];
    for (int g = 0; g < NQ; g++)
        vmax[g] = _mm512_set1_ps(-INFINITY);
    if (a->k_type == KERN_F16)
        scores_float(HV, NQ, KERN_F16, a, q0, vmax);
    else if (a->k_type == KERN_BF16)
        scores_float(HV, NQ, KERN_BF16, a, q0, vmax);
    else if (a->k_type == KERN_F32)
        scores_float(HV, NQ, KERN_F32, a, q0, vmax);
    else
        scores_quant(HV, NQ, a, q0, vmax);
    /* softmax per head; over an f16 V the probabilities are rounded to f16 */
    const bool half = a->v_type == KERN_F16;
    for (int g = 0; g < NQ; g++) {
        float *sc = a->scores + (size_t)g * n;
        const float mx = _mm512_reduce_max_ps(vmax[g]);
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
        for (int j = 0; j < n; j += 16) {
            const __mmask16 m = live16(j, n, a->skip), in = live16(j, n, 0);
            const __m512 e = _mm512_maskz_mov_ps(m, kern_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + j), vmx)));
            _mm512_mask_storeu_ps(sc + j, in, e);    /* 0 before a window: no weight on those rows */
            s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
        }
        const double sum = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
        if (a->stats != NULL) {
            a->stats[2 * (q0 + g)] = mx;
            a->stats[2 * (q0 + g) + 1] = (float)sum;
        }
        const __m512 inv = _mm512_set1_ps((float)(1.0 / sum));
        if (a->v_type == KERN_BF16) {
            pairs_bf16(sc, n, inv);
            continue;
        }
        for (int j = 0; j < n; j += 16) {
            const __mmask16 m = live16(j, n, 0);
            __m512 pv = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sc + j), inv);
            if (half)
                pv = _mm512_cvtph_ps(_mm512_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm512_mask_storeu_ps(sc + j, m, pv);
        }
    }
    /* out = sum p v, each V row converted once for all heads */
    if (a->v_type == KERN_Q8_0 || a->v_type == KERN_Q4_0) {
        __m512 acc[MAX_Q][16];
        for (int g = 0; g < NQ; g++)
            for (int h = 0; h < HV; h++)
                acc[g][h] = _mm512_setzero_ps();
        values_quant(HV, NQ, a, acc);
        for (int g = 0; g < NQ; g++)
            for (int h = 0; h < HV; h++)
                _mm512_storeu_ps(a->out + (size_t)(q0 + g) * hd + 16 * h, acc[g][h]);
    } else if (a->v_type == KERN_BF16) {
        const int WC = NQ * HV <= 24 ? HV / 2 : 2;
        for (int w0 = 0; w0 < HV / 2; w0 += WC)
            values_bf16(HV, NQ, WC, w0, a, q0);
    } else {
        /* the passes of slices: all at once where their sums fit in registers */
        const int HC = NQ * HV <= 32 ? HV : 4;
        for (int c = 0; c < HV; c += HC) {
            if (a->v_type == KERN_F16)
                values_float(HV, NQ, HC, c, KERN_F16, a, q0);
            else if (a->v_type == KERN_BF16)
                values_float(HV, NQ, HC, c, KERN_BF16, a, q0);
            else
                values_float(HV, NQ, HC, c, KERN_F32, a, q0);
        }
    }
}

/* ---- several tokens at once: the queries in the lanes ------------------------------------- */

/*
 * A prefill's tokens of one sequence share their positions, so up to sixteen
 * (token, head) queries of one KV head run together, one query in each lane
 * of a vector ("lanes over queries"): each K and V value is converted once
 * and broadcast to all of them, and a score costs its head_dim multiply-adds
 * and no horizontal sum. For out += p v the lanes turn to V's values: a
 * block of V rows converted once serves every query, a probability broadcast
 * and a V slice loaded serve six queries' multiply-adds and four slices. Every query's arithmetic is still attn_pass's, operation for
 * operation:
 *   - its score at a position is the same chain per 16-wide slice l of the
 *     head (q[l] k[l], then + q[16h + l] k[16h + l] for each further slice h)
 *     and the same tree over the slices as the score tree's:
 *     ((G0 + G1) + (G2 + G3)), G_g = (x_4g + x_4g+2) + (x_4g+1 + x_4g+3);
 *   - its largest score and its softmax sum come from the same partials
 *     (one per position mod 16), reduced by the same intrinsics;
 *   - out += p v runs in position order from zero;
 * so each query gets the bits kern_attn gives it alone. A query's positions
 * end at its own n_ctx: past it its lanes are masked (no score, no weight).
 */

#define MULTI_P(HV) ((HV) == 4 ? 4 : 8)  /* positions per score tile */

/* The score tree over a position's sixteen slice sums x[0 .. 16), in its
 * order: ((G0 + G1) + (G2 + G3)), G_g = (x_4g + x_4g+2) + (x_4g+1 + x_4g+3). */
static inline __m512 tree16(const __m512 *x)
{
    __m512 G[4];
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++)
        G[g] = _mm512_add_ps(_mm512_add_ps(x[4 * g], x[4 * g + 2]), _mm512_add_ps(x[4 * g + 1], x[4 * g + 3]));
    return _mm512_add_ps(_mm512_add_ps(G[0], G[1]), _mm512_add_ps(G[2], G[3]));
}

/* The scores of P positions (K rows of floats kf[0 .. P)) for every lane,
 * unscaled, with the score tree's sums in its order. Slice l's chain for lane L is
 * q_L[l] k[l] + q_L[16 + l] k[16 + l] + ...: its HV query rows (Qt row d holds
 * dimension d of every lane's query) are loaded once for the P positions,
 * and each K value is broadcast from memory.
 *
 * Head size 64 (four positions): the slices of group g are taken as 4g,
 * 4g + 2, 4g + 1, 4g + 3 and added up as G_g as they come, in registers.
 * Head sizes 128 and 256 have chains of 8 and 16 multiply-adds, so eight
 * positions' chains run side by side (fewer would wait on the adds'
 * latency: 1.45x / 1.64x faster than two and one on AMD EPYC), their sums
 * go to memory and the tree adds them afterwards. */
static inline __attribute__((always_inline)) void scores_deep(const int HV, const int P, const float *Qt,
                                                              const float (*kf)[256], __m512 *tot)
{
    __m512 X[8][16];   /* [position][slice] */
#pragma GCC unroll 1
    for (int l = 0; l < 16; l++) {
        const float *Qs = Qt;
        __asm__("" : "+r"(Qs));   /* loaded here, not hoisted out of the position loop */
        __m512 qr[16];
#pragma GCC unroll 16
        for (int h = 0; h < HV; h++)
            qr[h] = _mm512_load_ps(Qs + (size_t)(16 * h + l) * 16);
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) {
            __m512 x = _mm512_mul_ps(qr[0], _mm512_set1_ps(kf[p][l]));
#pragma GCC unroll 16
            for (int h = 1; h < HV; h++)
                x = _mm512_fmadd_ps(qr[h], _mm512_set1_ps(kf[p][16 * h + l]), x);
            X[p][l] = x;
        }
    }
#pragma GCC unroll 1
    for (int p = 0; p < P; p++)
        tot[p] = tree16(X[p]);
}

/* acc + the bf16 dot product of q's pairs with the pair at p broadcast to
 * every lane, the pair read by the instruction itself (GCC loads it with a
 * separate broadcast when written with intrinsics: 1.3x slower scores). */
static inline __m512 dp_bf_bcast(__m512 acc, __m512bh q, const uint8_t *p)
{
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*(const int32_t *)p));
    return acc;
}

/* The scores of P positions of a bf16 K (rows[0 .. P), as stored) for every
 * lane, unscaled: dot_bf's chains with the queries in the lanes. Qt holds
 * the queries' bf16 pairs, row 16w + i the pair of values 32w + 2i and
 * 32w + 2i + 1 of every lane's query, and each K pair is broadcast from its
 * row, so lane L's chain for slice i is dot_bf's lane i for query L. The
 * slices are taken as 4g, 4g + 2, 4g + 1, 4g + 3 and their sums added up in
 * registers as they come, in tree16's order (a pass through memory, as
 * scores_deep's, cost 1.2-1.55x: P = 5 positions at head size 64, 4 above,
 * fill the registers). */
static inline __attribute__((always_inline)) void scores_bf_lanes(const int HW, const int P, const float *Qt,
                                                                  const uint8_t *const *rows, __m512 *tot)
{
    static const int order[4] = { 0, 2, 1, 3 };
    __m512 g01[5], g23[5], pair[5], first[5];
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const int i = 4 * g + order[k];
            __m512bh qr[8];
#pragma GCC unroll 8
            for (int w = 0; w < HW; w++)
                qr[w] = (__m512bh)_mm512_load_si512((const void *)(Qt + (size_t)(16 * w + i) * 16));
#pragma GCC unroll 5
            for (int p = 0; p < P; p++) {
                __m512 x = dp_bf_bcast(_mm512_setzero_ps(), qr[0], rows[p] + 4 * i);
#pragma GCC unroll 8
                for (int w = 1; w < HW; w++)
                    x = dp_bf_bcast(x, qr[w], rows[p] + 4 * (16 * w + i));
                if (k == 0 || k == 2) {
                    first[p] = x;                                   /* x_4g, then x_4g+1 */
                } else if (k == 1) {
                    pair[p] = _mm512_add_ps(first[p], x);           /* x_4g + x_4g+2 */
                } else {
                    const __m512 G = _mm512_add_ps(pair[p], _mm512_add_ps(first[p], x));
                    if (g % 2 == 0)
                        (g == 0 ? g01 : g23)[p] = G;
                    else
                        (g == 1 ? g01 : g23)[p] = _mm512_add_ps((g == 1 ? g01 : g23)[p], G);
                }
            }
        }
    }
#pragma GCC unroll 5
    for (int p = 0; p < P; p++)
        tot[p] = _mm512_add_ps(g01[p], g23[p]);
}

static inline __attribute__((always_inline)) void scores_lanes(const int HV, const int P, const float *Qt,
                                                               const float (*kf)[256], __m512 *tot)
{
    if (HV != 4) {
        scores_deep(HV, P, Qt, kf, tot);
        return;
    }
    static const int order[4] = { 0, 2, 1, 3 };
    __m512 g01[4], g23[4], grp[4], pair[4], first[4];
    const float *Qs = Qt;
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const int l = 4 * g + order[k];
            __m512 qr[16];
#pragma GCC unroll 16
            for (int h = 0; h < HV; h++)
                qr[h] = _mm512_load_ps(Qs + (size_t)(16 * h + l) * 16);
            __m512 xs[4];
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) {
                __m512 x = _mm512_mul_ps(qr[0], _mm512_set1_ps(kf[p][l]));
#pragma GCC unroll 16
                for (int h = 1; h < HV; h++)
                    x = _mm512_fmadd_ps(qr[h], _mm512_set1_ps(kf[p][16 * h + l]), x);
                if (k == 0)
                    first[p] = x;
                else if (k == 1)
                    pair[p] = _mm512_add_ps(first[p], x);       /* x_4g + x_4g+2 */
                else if (k == 2)
                    first[p] = x;
                else
                    grp[p] = _mm512_add_ps(pair[p], _mm512_add_ps(first[p], x));
                xs[p] = k == 0 || k == 2 ? first[p] : k == 1 ? pair[p] : grp[p];
            }
            /* the next slice's loads wait for this slice's results: GCC
             * otherwise runs all sixteen slices' chains before their adds and
             * spills the partial sums */
#pragma GCC unroll 4
            for (int p = P; p < 4; p++)
                xs[p] = xs[0];
            __asm__ volatile("" : "+r"(Qs), "+v"(xs[0]), "+v"(xs[1]), "+v"(xs[2]), "+v"(xs[3]));
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) {
                if (k == 0 || k == 2)
                    first[p] = xs[p];
                else if (k == 1)
                    pair[p] = xs[p];
                else
                    grp[p] = xs[p];
            }
        }
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            if (g == 0 || g == 2)
                (g == 0 ? g01 : g23)[p] = grp[p];
            else
                (g == 1 ? g01 : g23)[p] = _mm512_add_ps((g == 1 ? g01 : g23)[p], grp[p]);
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; p++)
        tot[p] = _mm512_add_ps(g01[p], g23[p]);
}

/* Sixteen values of a V row from value 16c on, as attn_pass reads them:
 * converted from f16 / f32, or d * code from q8_0 / q4_0 (values_quant).
 * Called with a constant type, so each type gets its own loop. */
static inline __attribute__((always_inline)) __m512 v_values16(const uint8_t *row, int c, uint32_t type)
{
    if (type == KERN_F16 || type == KERN_F32 || type == KERN_BF16)
        return vload16(row, c, type);
    const size_t blk_bytes = type == KERN_Q8_0 ? sizeof(struct kern_block_q8_0) : sizeof(struct kern_block_q4_0);
    const uint8_t *blk = row + (size_t)(c / 2) * blk_bytes;
    const __m512 d = _mm512_set1_ps(block_scale(blk));
    __m512i codes;
    if (type == KERN_Q8_0) {
        codes = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * (c % 2))));
    } else {
        const __m128i x = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i nib = c % 2 ? _mm_srli_epi16(x, 4) : x;
        codes = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(nib, _mm_set1_epi8(0x0F))),
                                 _mm512_set1_epi32(8));
    }
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(codes));
}

/* V rows of positions j .. end (all in one KV block, the first at row) as
 * floats into VF, a row of HV * 16 each. */
static inline __attribute__((always_inline)) void v_rows_typed(const int HV, uint32_t type, const uint8_t *row,
                                                               size_t v_row, int n, float *VF)
{
    for (int i = 0; i < n; i++, row += v_row, VF += 16 * HV)
#pragma GCC unroll 16
        for (int c = 0; c < HV; c++)
            _mm512_store_ps(VF + 16 * c, v_values16(row, c, type));
}

/* V rows of positions j0 .. j1 of the context as floats (VF row i = position j0 + i). */
static inline __attribute__((always_inline)) void v_rows(const int HV, const struct kern_attn_args *a,
                                                         uint64_t v_off, size_t v_row, int j0, int j1, float *VF)
{
    const int bt = (int)a->block_tokens;
    for (int j = j0; j < j1;) {
        const int off = j % bt, n = j1 - j < bt - off ? j1 - j : bt - off;
        const uint8_t *row = a->v_base + a->blocks[j / bt] * a->block_stride + v_off + (size_t)off * v_row;
        float *dst = VF + (size_t)(j - j0) * 16 * HV;
        switch (a->v_type) {
        case KERN_F16: v_rows_typed(HV, KERN_F16, row, v_row, n, dst); break;
        case KERN_F32: v_rows_typed(HV, KERN_F32, row, v_row, n, dst); break;
        case KERN_BF16: v_rows_typed(HV, KERN_BF16, row, v_row, n, dst); break;
        case KERN_Q8_0: v_rows_typed(HV, KERN_Q8_0, row, v_row, n, dst); break;
        default: v_rows_typed(HV, KERN_Q4_0, row, v_row, n, dst); break;
        }
        j += n;
    }
}

/* out += p v over n units for GQ queries (lanes lane[0 .. GQ)) and the four
 * 16-value slices of V from value 16c on: the accumulators live in the
 * queries' outputs, each value's sum runs in unit order, the query's
 * probability broadcast and the V slice loaded once for all of them. A unit
 * is a position (V rows as floats in V, probabilities in S: row j, lane L),
 * or for a bf16 V (BF) a pair of positions: V holds the pairs' rows
 * interleaved (dword d of a pair's row: value d of its first and its second
 * position), S their probability pairs, one bf16 dot-product step a pair,
 * so that every value's sum is values_bf16's. */
static inline __attribute__((always_inline)) void pv_tile(const int GQ, const bool BF,
                                                          const struct kern_attn_query *qs, const int *lane, int c,
                                                          int hd, const float *V, const float *S, int n)
{
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int g = 0; g < GQ; g++)
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            acc[g][k] = _mm512_loadu_ps(qs[lane[g]].out + 16 * (c + k));
    for (int j = 0; j < n; j++) {
        const float *vj = V + (size_t)j * hd + 16 * c;
        __m512 v[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            v[k] = _mm512_load_ps(vj + 16 * k);
#pragma GCC unroll 6
        for (int g = 0; g < GQ; g++) {
            const float *pj = S + (size_t)j * 16 + lane[g];
            if (BF) {
                int32_t pp;
                memcpy(&pp, pj, 4);
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    acc[g][k] = _mm512_dpbf16_ps(acc[g][k], (__m512bh)_mm512_castps_si512(v[k]),
                                                 (__m512bh)_mm512_set1_epi32(pp));
            } else {
                const __m512 pv = _mm512_set1_ps(*pj);
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    acc[g][k] = _mm512_fmadd_ps(pv, v[k], acc[g][k]);
            }
        }
    }
#pragma GCC unroll 6
    for (int g = 0; g < GQ; g++)
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            _mm512_storeu_ps(qs[lane[g]].out + 16 * (c + k), acc[g][k]);
}

#define PV_GQ 6                  /* queries one pv_tile runs */

static void pv_tiles(const struct kern_attn_query *qs, const int *lane, int nl, bool bf, int c, int hd,
                     const float *V, const float *S, int n)
{
#define PV_TILE(G)                                                                             \
    case G:                                                                                    \
        if (bf)                                                                                \
            pv_tile(G, true, qs, lane, c, hd, V, S, n);                                        \
        else                                                                                   \
            pv_tile(G, false, qs, lane, c, hd, V, S, n);                                       \
        break
    switch (nl) {
    PV_TILE(1); PV_TILE(2); PV_TILE(3); PV_TILE(4); PV_TILE(5);
    default: PV_TILE(6);
    }
#undef PV_TILE
}

/* out += p v over the units [u0, u1) of a staged block (V's row 0 is unit
 * u0; S row u is unit u) for the nq queries, query L covering units
 * [uf[L], un[L]): in groups of up to PV_GQ queries, the units the group
 * shares at once and the rest query by query, each query's units in order. */
static void pv_groups(const struct kern_attn_query *qs, int nq, const int32_t *uf, const int32_t *un, int u0,
                      int u1, bool bf, int hd, const float *V, const float *S)
{
    for (int q0 = 0; q0 < nq; q0 += PV_GQ) {
        const int gq = nq - q0 < PV_GQ ? nq - q0 : PV_GQ;
        int lane[PV_GQ], cs = u0, ce = u1;   /* the group's common units [cs, ce) */
        for (int g = 0; g < gq; g++) {
            lane[g] = q0 + g;
            cs = uf[q0 + g] > cs ? uf[q0 + g] : cs;
            ce = un[q0 + g] < ce ? un[q0 + g] : ce;
        }
        if (cs > u1)
            cs = u1;    /* a query starts past this block: no common units in it */
        if (ce < cs)
            ce = cs;
        for (int c = 0; c < hd / 16; c += 4)
            for (int part = 0; part < 3; part++) {
                /* before the common units, query by query; the common ones as
                 * a group; after them, query by query */
                if (part == 1) {
                    if (ce > cs)
                        pv_tiles(qs, lane, gq, bf, c, hd, V + (size_t)(cs - u0) * hd, S + (size_t)cs * 16, ce - cs);
                    continue;
                }
                for (int g = 0; g < gq; g++) {
                    const int f = uf[q0 + g], e = un[q0 + g];
                    const int from = part == 0 ? (f > u0 ? f : u0) : ce;
                    const int to = part == 0 ? (cs < e ? cs : e) : (e < u1 ? e : u1);
                    if (to > from)
                        pv_tiles(qs, &lane[g], 1, bf, c, hd, V + (size_t)(from - u0) * hd, S + (size_t)from * 16,
                                 to - from);
                }
            }
    }
}

/* The pairs [m0, m1) of positions of a bf16 V (a's context; a second
 * position at or past N reads as zeros) as VP rows: dword d of row m - m0
 * holds value d of positions 2m (low half) and 2m + 1 (high half). */
static void v_pairs(int hd, const struct kern_attn_args *a, uint64_t v_off, int m0, int m1, int N, uint32_t *VP)
{
    const size_t v_row = (size_t)hd * 2;
    const int bt = a->block_tokens;
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int m = m0; m < m1; m++) {
        const int j = 2 * m;
        const uint8_t *r0 = a->v_base + a->blocks[j / bt] * a->block_stride + v_off + (size_t)(j % bt) * v_row;
        const uint8_t *r1 = j + 1 < N ? r0 + v_row : zero_row;
        uint32_t *dst = VP + (size_t)(m - m0) * hd;
        for (int w = 0; w < hd / 32; w++) {
            const __m512i A = _mm512_loadu_si512((const void *)(r0 + 64 * w));
            const __m512i B = _mm512_loadu_si512((const void *)(r1 + 64 * w));
            const __m512i lo = _mm512_unpacklo_epi16(A, B), hi = _mm512_unpackhi_epi16(A, B);
            _mm512_store_si512((void *)(dst + 32 * w), _mm512_permutex2var_epi32(lo, first, hi));
            _mm512_store_si512((void *)(dst + 32 * w + 16), _mm512_permutex2var_epi32(lo, second, hi));
        }
    }
}

/* out = sum p v over a bf16 V for the nq queries of multi_pass (lanes L:
 * positions [fl[L], nl[L])), S holding their probabilities per position:
 * turned into bf16 pairs in place (S2 row m: positions 2m and 2m + 1), then
 * the pairs of a block of positions interleaved once (VP) and added up by
 * pv_groups. */
static void pv_pairs(int hd, const struct kern_attn_args *a, uint64_t v_off, const struct kern_attn_query *qs,
                     int nq, const int32_t *fl, const int32_t *nl, int N, float *S, float *VF)
{
    uint32_t *S2 = (uint32_t *)S, *VP = (uint32_t *)VF;
    for (int m = 0; 2 * m < N; m++) {
        const __m512i r0 = bf16_bits(_mm512_load_ps(S + (size_t)2 * m * 16));
        const __m512i r1 = 2 * m + 1 < N ? bf16_bits(_mm512_load_ps(S + (size_t)(2 * m + 1) * 16))
                                         : _mm512_setzero_si512();
        _mm512_store_si512((void *)(S2 + (size_t)m * 16), _mm512_or_si512(r0, _mm512_slli_epi32(r1, 16)));
    }
    for (int L = 0; L < nq; L++)
        memset(qs[L].out, 0, (size_t)hd * sizeof(float));
    int32_t pf[16], pn[16];   /* each query's pairs */
    for (int L = 0; L < nq; L++) {
        pf[L] = fl[L] / 2;
        pn[L] = (nl[L] + 1) / 2;
    }
    const int B = KERN_ATTN_V_BLOCK / hd;   /* positions a block: even */
    for (int j0 = 0; j0 < N; j0 += B) {
        const int j1 = N - j0 < B ? N : j0 + B;
        const int b0 = j0 / 2, b1 = (j1 + 1) / 2;   /* the block's pairs */
        v_pairs(hd, a, v_off, b0, b1, N, VP);
        pv_groups(qs, nq, pf, pn, b0, b1, true, hd, VF, S);
    }
}

/* The lanes that attend position j: sl <= j < nl. */
static inline __mmask16 live_lanes(__m512i nvec, __m512i svec, int j)
{
    const __m512i vj = _mm512_set1_epi32(j);
    return _mm512_cmpgt_epi32_mask(nvec, vj) & _mm512_cmple_epi32_mask(svec, vj);
}

static inline __attribute__((always_inline)) void
multi_pass(const int HV, const struct kern_attn_args *a, const struct kern_attn_query *qs, int nq, float *S,
           float *VF)
{
    const bool half = a->k_type == KERN_F16, bf = a->k_type == KERN_BF16;
    const int hd = 16 * HV, P = bf ? (HV == 4 ? 5 : 4) : MULTI_P(HV);
    const size_t k_row = (size_t)hd * (half || bf ? 2 : 4), v_row = kern_row_bytes(a->v_type, hd);
    const uint64_t k_off = (uint64_t)a->kv_head * a->k_head_stride;
    const uint64_t v_off = (uint64_t)a->kv_head * a->v_head_stride;
    /* the queries transposed (rounded to f16 over an f16 K, as attn_pass does) */
    float Qt[256 * 16] __attribute__((aligned(64)));
    /* lane L: positions [fl, nl) read, [sl, nl) attended */
    int32_t nl[16] __attribute__((aligned(64))), sl[16] __attribute__((aligned(64))), fl[16] __attribute__((aligned(64)));
    int N = 0;
    memset(Qt, 0, (size_t)hd * 16 * sizeof(float));
    for (int L = 0; L < 16; L++) {
        nl[L] = L < nq ? qs[L].n_ctx : 0;
        fl[L] = L < nq ? qs[L].first : 0;
        sl[L] = L < nq && qs[L].skip > fl[L] ? qs[L].skip : fl[L];
        N = nl[L] > N ? nl[L] : N;
    }
    for (int L = 0; L < nq && bf; L++)
        for (int w = 0; w < HV / 2; w++) {
            /* bf16 pairs, as scores_float rounds them */
            uint32_t v[16] __attribute__((aligned(64)));
            _mm512_store_si512((void *)v, (__m512i)q_bf16(qs[L].q, w));
            for (int i = 0; i < 16; i++)
                memcpy(&Qt[(size_t)(16 * w + i) * 16 + L], &v[i], 4);
        }
    for (int L = 0; L < nq && !bf; L++)
        for (int h = 0; h < HV; h++) {
            __m512 x = _mm512_loadu_ps(qs[L].q + 16 * h);
            if (half)
                x = _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            float v[16] __attribute__((aligned(64)));
            _mm512_store_ps(v, x);
            for (int i = 0; i < 16; i++)
                Qt[(size_t)(16 * h + i) * 16 + L] = v[i];
        }
    const __m512i nvec = _mm512_load_si512(nl), svec = _mm512_load_si512(sl);
    const __m512 scale = _mm512_set1_ps(a->scale);

    /* scores, and each lane's running largest per position mod 16 (attn_pass's vmax lanes) */
    __m512 mx16[16];
    for (int i = 0; i < 16; i++)
        mx16[i] = _mm512_set1_ps(-INFINITY);
    float kf[8][256] __attribute__((aligned(64)));
    int blk = 0, off = 0;
    for (int j0 = 0; j0 < N; j0 += P) {
        const int cnt = N - j0 < P ? N - j0 : P;
        const uint8_t *rows[8];
        for (int p = 0; p < cnt; p++) {
            if (off == 0)
                prefetch_block(a, blk, N, k_off, v_off, k_row, v_row);
            const uint8_t *k = a->k_base + a->blocks[blk] * a->block_stride + k_off + (size_t)off * k_row;
            if (++off == a->block_tokens) {
                off = 0;
                blk++;
            }
            rows[p] = k;
            if (!bf)
                for (int h = 0; h < HV; h++)
                    _mm512_store_ps(&kf[p][16 * h], load16(k, h, half));
        }
        for (int p = cnt; p < P; p++) {
            rows[p] = zero_row;
            if (!bf)
                for (int h = 0; h < HV; h++)
                    _mm512_store_ps(&kf[p][16 * h], _mm512_setzero_ps());
        }
        __m512 tot[8];
        if (bf)
            scores_bf_lanes(HV / 2, HV == 4 ? 5 : 4, Qt, rows, tot);
        else
            scores_lanes(HV, P, Qt, (const float (*)[256])kf, tot);
        for (int p = 0; p < cnt; p++) {
            const int j = j0 + p;
            const __mmask16 live = live_lanes(nvec, svec, j);
            const __m512 sc = _mm512_mul_ps(tot[p], scale);
            _mm512_store_ps(S + (size_t)j * 16, sc);
            mx16[j % 16] = _mm512_mask_max_ps(mx16[j % 16], live, mx16[j % 16], sc);
        }
    }
    /* each lane's largest score, reduced as attn_pass reduces its vmax */
    float mxl[16][16] __attribute__((aligned(64)));
    for (int i = 0; i < 16; i++)
        _mm512_store_ps(mxl[i], mx16[i]);
    float mx[16] __attribute__((aligned(64)));
    for (int L = 0; L < 16; L++) {
        float col[16] __attribute__((aligned(64)));
        for (int i = 0; i < 16; i++)
            col[i] = mxl[i][L];
        mx[L] = _mm512_reduce_max_ps(_mm512_load_ps(col));
    }
    /* exponentials and their sums in double, per position mod 16 */
    const __m512 vmx = _mm512_load_ps(mx);
    __m512d lo[16], hi[16];
    for (int i = 0; i < 16; i++)
        lo[i] = hi[i] = _mm512_setzero_pd();
    for (int j = 0; j < N; j++) {
        const __mmask16 live = live_lanes(nvec, svec, j);
        float *sj = S + (size_t)j * 16;
        const __m512 e = _mm512_maskz_mov_ps(live, kern_exp16(_mm512_sub_ps(_mm512_maskz_load_ps(live, sj), vmx)));
        _mm512_store_ps(sj, e);
        lo[j % 16] = _mm512_add_pd(lo[j % 16], _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        hi[j % 16] = _mm512_add_pd(hi[j % 16], _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
    }
    double pl[16][16] __attribute__((aligned(64)));  /* [position mod 16][lane] */
    for (int i = 0; i < 16; i++) {
        _mm512_store_pd(pl[i], lo[i]);
        _mm512_store_pd(pl[i] + 8, hi[i]);
    }
    float inv[16] __attribute__((aligned(64)));
    for (int L = 0; L < 16; L++) {
        double s0[8] __attribute__((aligned(64))), s1[8] __attribute__((aligned(64)));
        for (int i = 0; i < 8; i++) {
            s0[i] = pl[i][L];
            s1[i] = pl[8 + i][L];
        }
        const double sum = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_load_pd(s0), _mm512_load_pd(s1)));
        inv[L] = L < nq ? (float)(1.0 / sum) : 0.0f;
        if (L < nq && qs[L].stats != NULL) {
            qs[L].stats[0] = mx[L];
            qs[L].stats[1] = (float)sum;
        }
    }
    /* probabilities; over an f16 V rounded to f16 */
    const bool vhalf = a->v_type == KERN_F16;
    const __m512 vinv = _mm512_load_ps(inv);
    for (int j = 0; j < N; j++) {
        __m512 pv = _mm512_mul_ps(_mm512_load_ps(S + (size_t)j * 16), vinv);
        if (vhalf)
            pv = _mm512_cvtph_ps(_mm512_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm512_store_ps(S + (size_t)j * 16, pv);
    }
    if (a->v_type == KERN_BF16) {
        pv_pairs(hd, a, v_off, qs, nq, fl, nl, N, S, VF);
        return;
    }
    /* out = sum p v, in position order for every value: a block of positions'
     * V rows is converted to floats once (VF, in L1), then each group of up
     * to PV_GQ queries adds the block's terms, four slices of V at a time.
     * A query's terms run from its first position to its n_ctx (a p of 0
     * before its skip, as kern_attn's): the positions of a block every query
     * of the group reads go through the group at once, the rest query by
     * query, each query's in position order. */
    for (int L = 0; L < nq; L++)
        memset(qs[L].out, 0, (size_t)hd * sizeof(float));
    const int B = KERN_ATTN_V_BLOCK / hd;   /* 16 KiB of floats: they stay in L1 */
    for (int j0 = 0; j0 < N; j0 += B) {
        const int j1 = N - j0 < B ? N : j0 + B;
        v_rows(HV, a, v_off, v_row, j0, j1, VF);
        pv_groups(qs, nq, fl, nl, j0, j1, false, hd, VF, S);
    }
}

int kern_attn_avx512_multi(const struct kern_attn_args *a, const struct kern_attn_query *qs, int nq,
                           void *scratch)
{
    const int hd = a->head_dim;
    if ((hd != 64 && hd != 128 && hd != 256) || (a->k_type != KERN_F16 && a->k_type != KERN_F32 &&
                                                   !(a->k_type == KERN_BF16 && kern_avx512bf16())) ||
        !v_simd_type(a) || a->skip != 0 || nq < 1 || nq > KERN_ATTN_LANES)
        return 0;
    int N = 0;
    for (int L = 0; L < nq; L++) {
        const struct kern_attn_query *q = &qs[L];
        if (q->first < 0 || q->first % 16 != 0 || q->first >= q->n_ctx ||
            (q->skip != 0 && (q->skip < q->first || q->skip >= q->n_ctx)))
            return 0;
        N = q->n_ctx > N ? q->n_ctx : N;
    }
    float *S = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *VF = S + (size_t)N * KERN_ATTN_LANES;
    switch (hd) {
    case 64: multi_pass(4, a, qs, nq, S, VF); break;
    case 128: multi_pass(8, a, qs, nq, S, VF); break;
    default: multi_pass(16, a, qs, nq, S, VF); break;
    }
    return 1;
}

#define PASS(HV, NQ)                                                                           \
    case (HV) * 8 + (NQ):                                                                      \
        attn_pass(HV, NQ, a, q0);                                                              \
        break

int kern_attn_avx512(const struct kern_attn_args *a)
{
    const int hd = a->head_dim;
    if ((hd != 64 && hd != 128 && hd != 256) || !k_simd_type(a->k_type) || !v_simd_type(a))
        return 0;
    const int HV = hd / 16;
    for (int q0 = 0; q0 < a->n_q; q0 += MAX_Q) {
        const int nq = a->n_q - q0 < MAX_Q ? a->n_q - q0 : MAX_Q;
        switch (HV * 8 + nq) {
        PASS(4, 1); PASS(4, 2); PASS(4, 3); PASS(4, 4);
        PASS(8, 1); PASS(8, 2); PASS(8, 3); PASS(8, 4);
        PASS(16, 1); PASS(16, 2); PASS(16, 3); PASS(16, 4);
        default: return 0;
        }
    }
    return 1;
}
#endif
