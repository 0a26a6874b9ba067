/*
 * ops_avx512.c - element-wise kernels of the forward pass with AVX-512:
 * SwiGLU (silu through a sixteen-lane exponential, within a few ulp of the
 * scalar expf) and the f32 -> f16 conversion of K/V rows written into the
 * cache (the hardware's round-to-nearest-even: the same bits as
 * kvd_f32_to_f16 for every number).
 */
#if defined(__x86_64__)
#include <immintrin.h>

#include "ops.h"

/* e^x, sixteen at a time, for x in [-87, 88] (clamped there): x = k ln2 + r,
 * e^r by a degree-6 polynomial, 2^k into the exponent; below -87 gives 0. */
static inline __m512 exp16_full(__m512 x)
{
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    /* 2^k as two factors, so that k = 128 (x near 88.7) does not overflow the exponent field */
    const __m512i ki = _mm512_cvtps_epi32(k);
    const __m512i k1 = _mm512_srai_epi32(ki, 1), k2 = _mm512_sub_epi32(ki, k1);
    const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k1, _mm512_set1_epi32(127)), 23));
    const __m512 e2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k2, _mm512_set1_epi32(127)), 23));
    return _mm512_maskz_mul_ps((__mmask16)~under, _mm512_mul_ps(p, e1), e2);
}

void kern_swiglu_avx512(float *gate, const float *up, int n)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16_full(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(gate + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16_full(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_mask_storeu_ps(gate + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + i)));
    }
}

void kern_f32_to_f16_avx512(uint16_t *dst, const float *src, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++)
        dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif
