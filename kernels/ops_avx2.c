/* ops_avx2.c - the AVX2 bodies of element-wise kernels of ops.h (x86 only;
 * built with -mavx2 -mfma -mf16c and called after kern_isa() checked the CPU):
 * GeGLU by the f16 table, SwiGLU through an eight-lane exponential (within a
 * few ulp of the scalar expf), and the f32 -> f16 conversion of K/V rows (the
 * hardware's round-to-nearest-even: kvd_f32_to_f16's bits). */
#if defined(__x86_64__)
#include <immintrin.h>

#include "exp256.h"
#include "ops.h"

void kern_swiglu_avx2(float *gate, const float *up, int n)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, kern_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    if (i < n) {
        float g8[8] = { 0 }, u8[8] = { 0 };
        for (int k = 0; k < n - i; k++) {
            g8[k] = gate[i + k];
            u8[k] = up[i + k];
        }
        const __m256 g = _mm256_loadu_ps(g8);
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, kern_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(g8, _mm256_mul_ps(s, _mm256_loadu_ps(u8)));
        for (int k = 0; k < n - i; k++)
            gate[i + k] = g8[k];
    }
}

void kern_f32_to_f16_avx2(uint16_t *dst, const float *src, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++)
        dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

void kern_geglu_avx2(float *gate, const float *up, int n, const float *table)
{
    const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(gate + i);
        const __m256i idx = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256 g = _mm256_i32gather_ps(table, idx, 4);
        g = _mm256_blendv_ps(g, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LE_OQ));
        g = _mm256_blendv_ps(g, x, _mm256_cmp_ps(x, hi, _CMP_GE_OQ));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(g, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) {
        const float x = gate[i];
        const float g = x <= -10.0f ? 0.0f : x >= 10.0f ? x : table[_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)];
        gate[i] = g * up[i];
    }
}
#endif
