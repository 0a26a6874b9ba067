/*
 * exp512.h - e^x sixteen lanes at a time with AVX-512 (include only from
 * files built for AVX-512). x = k ln2 + r with |r| <= ln2/2, e^r by a
 * degree-6 polynomial, 2^k built in the exponent in two factors (so k = 128
 * does not overflow the field); x is clamped to [-87, 88] and below -87 the
 * result is 0. Within 2 ulp of expf over that range.
 */
#ifndef KVD_KERN_EXP512_H
#define KVD_KERN_EXP512_H

#include <immintrin.h>

static inline __m512 kern_exp16(__m512 x)
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
    const __m512i ki = _mm512_cvtps_epi32(k);
    const __m512i k1 = _mm512_srai_epi32(ki, 1), k2 = _mm512_sub_epi32(ki, k1);
    const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k1, _mm512_set1_epi32(127)), 23));
    const __m512 e2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k2, _mm512_set1_epi32(127)), 23));
    return _mm512_maskz_mul_ps((__mmask16)~under, _mm512_mul_ps(p, e1), e2);
}

#endif
