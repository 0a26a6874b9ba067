/*
 * quant_avx2.c - the activation quantizers (Q8_0, Q8_1) with AVX2.
 *
 * Every matrix product quantizes its input rows first, so these run once
 * per product per token; the scalar reference spends most of its time in
 * roundf. The results are the reference's bytes exactly: the same absolute
 * maximum, the same scale and reciprocal (computed as scalars), the same
 * products x * id, and roundf's rounding (half away from zero) rebuilt from
 * truncation: r = trunc(v), then one step away from zero when |v - r| >= 0.5
 * (v - trunc(v) is exact in float).
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "f16.h"
#include "quant.h"
#include "quant_blocks.h"
#include "types.h"

static inline __m256 round_away(__m256 v)
{
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 frac = _mm256_sub_ps(v, t);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 half = _mm256_cmp_ps(_mm256_and_ps(frac, absmask), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_andnot_ps(absmask, v)); /* copysign(1, v) */
    return _mm256_add_ps(t, _mm256_and_ps(half, one));
}

/* One block of 32: codes into qs, returns the scale d; *sum gets the codes' sum. */
static inline float q8_block(const float *x, kvd_f16 *d_out, int8_t *qs, int *sum)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        mx = _mm256_max_ps(_mm256_and_ps(v[i], absmask), mx);  /* a NaN element is skipped */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    if (!isfinite(id))
        id = 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        const __m256 y = _mm256_mul_ps(v[i], vid);
        /* a NaN codes as 0, as in the reference (cvtt would give INT_MIN) */
        q[i] = _mm256_cvttps_epi32(round_away(_mm256_and_ps(y, _mm256_cmp_ps(y, y, _CMP_ORD_Q))));
    }
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    *sum = _mm_cvtsi128_si32(h);
    /* 32 int32 -> 32 int8 in order: packs work per 128-bit lane, so fix the order after */
    const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);   /* 0-3 8-11 | 4-7 12-15 */
    const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i b = _mm256_packs_epi16(p01, p23);             /* per lane: 0-3 8-11 16-19 24-27 | 4-7 ... */
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)qs, b);
    *d_out = kvd_f32_to_f16(d);
    return d;
}

bool kern_quantize_act_avx2(uint32_t act_type, const float *src, void *dst, int64_t n)
{
    if (n % 32 != 0 || (act_type != KERN_Q8_0 && act_type != KERN_Q8_1))
        return false;
    int sum;
    if (act_type == KERN_Q8_0) {
        struct kern_block_q8_0 *b = dst;
        for (int64_t i = 0; i < n / 32; i++)
            q8_block(src + 32 * i, &b[i].d, b[i].qs, &sum);
    } else {
        struct kern_block_q8_1 *b = dst;
        for (int64_t i = 0; i < n / 32; i++) {
            const float d = q8_block(src + 32 * i, &b[i].d, b[i].qs, &sum);
            b[i].s = kvd_f32_to_f16((float)sum * d);
        }
    }
    return true;
}
#endif
