/*
 * attn_avx2.c - grouped paged attention with AVX2, FMA and F16C.
 *
 * For each query head: scores q.k * scale (eight-lane products of the K row,
 * converted from f16 in registers, summed as hsum8), softmax with the sum in
 * double, then out += p * v row by row in position order. Over an f16 cache
 * q and p are rounded to f16 first, as in the C reference.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "attn.h"
#include "ops.h"
#include "types.h"

static inline float hsum8(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

/* Eight elements of a K/V row as floats. */
static inline __m256 load8(const uint8_t *row, int d, bool half)
{
    if (half)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * (size_t)d)));
    return _mm256_loadu_ps((const float *)row + d);
}

/* e^x for x <= 0 (softmax arguments), eight at a time: x = k ln2 + r with
 * |r| <= ln2/2, e^r by a degree-6 polynomial, 2^k into the exponent. Below
 * -87 the result is 0. Within 2 ulp of expf. */
static inline __m256 exp8(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float round_half(float x) { return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)); }

#define MAX_Q 16  /* query heads handled per pass; larger groups loop */

int kern_attn_avx2(const struct kern_attn_args *a)
{
    const int hd = a->head_dim;
    if (hd % 8 != 0 || hd > KERN_MAX_HEAD_DIM || a->k_type != a->v_type ||
        (a->k_type != KERN_F16 && a->k_type != KERN_F32))
        return 0;
    const bool half = a->k_type == KERN_F16;
    const size_t row_bytes = (size_t)hd * (half ? 2 : 4);
    for (int q0 = 0; q0 < a->n_q; q0 += MAX_Q) {
        const int nq = a->n_q - q0 < MAX_Q ? a->n_q - q0 : MAX_Q;
        float qh[MAX_Q][KERN_MAX_HEAD_DIM];
        float max[MAX_Q];
        for (int g = 0; g < nq; g++) {
            const float *q = a->q + (size_t)(q0 + g) * hd;
            for (int d = 0; d < hd; d++)
                qh[g][d] = half ? round_half(q[d]) : q[d];
            max[g] = -INFINITY;
        }
        /* scores, reading each K row once for the group */
        for (int j = 0; j < a->n_ctx; j++) {
            const uint8_t *k = a->k_base + a->blocks[j / a->block_tokens] * a->block_stride +
                               (uint64_t)a->kv_head * a->k_head_stride +
                               (size_t)(j % a->block_tokens) * row_bytes;
            for (int g = 0; g < nq; g++) {
                __m256 acc = _mm256_setzero_ps();
                for (int d = 0; d < hd; d += 8)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(&qh[g][d]), load8(k, d, half), acc);
                const float s = hsum8(acc) * a->scale;
                a->scores[(size_t)g * a->n_ctx + j] = s;
                if (s > max[g])
                    max[g] = s;
            }
        }
        /* softmax per head: exponentials eight at a time, their sum in double */
        for (int g = 0; g < nq; g++) {
            float *sc = a->scores + (size_t)g * a->n_ctx;
            const __m256 mx = _mm256_set1_ps(max[g]);
            int j = 0;
            for (; j + 8 <= a->n_ctx; j += 8)
                _mm256_storeu_ps(sc + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mx)));
            for (; j < a->n_ctx; j++) {
                float tail[8] = { sc[j] - max[g] };
                _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
                sc[j] = tail[0];
            }
            double sum = 0.0;
            for (j = 0; j < a->n_ctx; j++)
                sum += sc[j];
            const float inv = (float)(1.0 / sum);
            if (a->stats != NULL) {
                a->stats[2 * (q0 + g)] = max[g];
                a->stats[2 * (q0 + g) + 1] = (float)sum;
            }
            const __m256 vinv = _mm256_set1_ps(inv);
            for (j = 0; j + 8 <= a->n_ctx; j += 8) {
                __m256 pv = _mm256_mul_ps(_mm256_loadu_ps(sc + j), vinv);
                if (half)
                    pv = _mm256_cvtph_ps(_mm256_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT));
                _mm256_storeu_ps(sc + j, pv);
            }
            for (; j < a->n_ctx; j++)
                sc[j] = half ? round_half(sc[j] * inv) : sc[j] * inv;
        }
        /* out = sum p v, reading each V row once for the group */
        __m256 acc[MAX_Q][KERN_MAX_HEAD_DIM / 8];
        for (int g = 0; g < nq; g++)
            for (int d = 0; d < hd / 8; d++)
                acc[g][d] = _mm256_setzero_ps();
        for (int j = 0; j < a->n_ctx; j++) {
            const uint8_t *v = a->v_base + a->blocks[j / a->block_tokens] * a->block_stride +
                               (uint64_t)a->kv_head * a->v_head_stride +
                               (size_t)(j % a->block_tokens) * row_bytes;
            for (int d = 0; d < hd; d += 8) {
                const __m256 vv = load8(v, d, half);
                for (int g = 0; g < nq; g++)
                    acc[g][d / 8] = _mm256_fmadd_ps(_mm256_set1_ps(a->scores[(size_t)g * a->n_ctx + j]),
                                                    vv, acc[g][d / 8]);
            }
        }
        for (int g = 0; g < nq; g++)
            for (int d = 0; d < hd; d += 8)
                _mm256_storeu_ps(a->out + (size_t)(q0 + g) * hd + d, acc[g][d / 8]);
    }
    return 1;
}
#endif
