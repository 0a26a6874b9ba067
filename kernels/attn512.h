/*
 * attn512.h - the pieces of attention the AVX-512 kernels share (include
 * only from files built for AVX-512 and AVX512_BF16): which positions a
 * group of sixteen attends, softmax's exponentials and sum over a row of
 * scores, and probabilities rounded into bf16 pairs.
 */
#ifndef KVD_KERN_ATTN512_H
#define KVD_KERN_ATTN512_H

#include <immintrin.h>
#include <stdint.h>

#include "exp512.h"

/* The lanes of positions j0 .. j0 + 15 that attention reads: inside the
 * context and, in a sliding window, from skip on. */
static inline __mmask16 live16(int j0, int n, int skip)
{
    uint32_t m = n - j0 >= 16 ? 0xFFFFu : (1u << (n - j0)) - 1u;
    if (j0 < skip)
        m &= skip - j0 >= 16 ? 0u : 0xFFFFu << (skip - j0);
    return (__mmask16)m;
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

/* A row of scores sc[0 .. n) becomes exp(sc - mx) from skip on and 0 before
 * (no weight on the rows before a window); returns their sum, added in
 * double per lane of the groups of sixteen (lanes 0-7 and 8-15 apart) and
 * then across the lanes. */
static inline double exp_row(float *sc, int n, int skip, float mx)
{
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (int j = 0; j < n; j += 16) {
        const __mmask16 m = live16(j, n, skip), in = live16(j, n, 0);
        const __m512 e = _mm512_maskz_mov_ps(m, kern_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + j), vmx)));
        _mm512_mask_storeu_ps(sc + j, in, e);
        s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
}

/* The probabilities p[0 .. n) (scaled by inv as they are read) as bf16
 * pairs at dst: dword m = p[2m] | p[2m + 1] << 16, p[n] = 0. dst may be p
 * itself (a pair is written after the values it is made of are read). */
static inline void pairs_bf16(const float *p, uint32_t *dst, int n, __m512 inv)
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
        _mm512_mask_storeu_epi32(dst + j / 2, (__mmask16)((1u << pairs) - 1u), w);
    }
}


#endif
