/*
 * ops_avx512.c - element-wise kernels of the forward pass with AVX-512:
 * SwiGLU (silu through a sixteen-lane exponential, within a few ulp of the
 * scalar expf) and the f32 -> f16 conversion of K/V rows written into the
 * cache (the hardware's round-to-nearest-even: the same bits as
 * kvd_f32_to_f16 for every number), and RMS norm of many rows at once with
 * kern_rmsnorm's bits.
 */
#if defined(__x86_64__)
#include <immintrin.h>

#include <math.h>

#include "exp512.h"
#include "ops.h"

/* Columns i .. i + 7 of eight rows (row k at x + k * n), turned so that
 * c[j] holds column i + j, lane k from row k. */
static inline void columns8(const float *x, int n, int i, __m256 c[8])
{
    __m256 r[8], t[8], u[8];
    for (int k = 0; k < 8; k++)
        r[k] = _mm256_loadu_ps(x + (size_t)k * n + i);
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
        t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {
        u[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; k++) {
        c[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20);
        c[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
    }
}

/* Sixteen rows (two sets of eight, each row's sum of squares one chain in
 * column order, a lane of a double vector) or eight: kern_rmsnorm's sums,
 * scales and products exactly. x * x is exact in double, so the fused
 * multiply-add rounds as the reference's product-then-add does. */
static void rmsnorm_rows_simd(float *out, const float *x, const float *w, int n, float eps, int R)
{
    __m512d ss[2] = { _mm512_setzero_pd(), _mm512_setzero_pd() };
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int s = 0; s < R / 8; s++) {
            __m256 c[8];
            columns8(x + (size_t)8 * s * n, n, i, c);
            for (int j = 0; j < 8; j++) {
                const __m512d d = _mm512_cvtps_pd(c[j]);
                ss[s] = _mm512_fmadd_pd(d, d, ss[s]);
            }
        }
    double sums[16];
    for (int s = 0; s < R / 8; s++)
        _mm512_storeu_pd(sums + 8 * s, ss[s]);
    for (int k = 0; k < R; k++) {
        const float *xk = x + (size_t)k * n;
        for (int t = i; t < n; t++)   /* the columns past the last eight, in order */
            sums[k] += (double)xk[t] * xk[t];
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf((float)(sums[k] / n) + eps));
        float *ok = out + (size_t)k * n;
        int t = 0;
        for (; t + 16 <= n; t += 16)
            _mm512_storeu_ps(ok + t, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xk + t), scale),
                                                   _mm512_loadu_ps(w + t)));
        if (t < n) {
            const __mmask16 m = (__mmask16)((1u << (n - t)) - 1u);
            _mm512_mask_storeu_ps(ok + t, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xk + t), scale),
                                                           _mm512_maskz_loadu_ps(m, w + t)));
        }
    }
}

int kern_rmsnorm_rows_avx512(float *out, const float *x, const float *w, int n, float eps, int rows)
{
    int r = 0;
    for (; r + 16 <= rows; r += 16)
        rmsnorm_rows_simd(out + (size_t)r * n, x + (size_t)r * n, w, n, eps, 16);
    for (; r + 8 <= rows; r += 8)
        rmsnorm_rows_simd(out + (size_t)r * n, x + (size_t)r * n, w, n, eps, 8);
    return r;
}

void kern_swiglu_avx512(float *gate, const float *up, int n)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, kern_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(gate + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, kern_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_mask_storeu_ps(gate + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + i)));
    }
}

void kern_geglu_avx512(float *gate, const float *up, int n, const float *table)
{
    const __m512 lo = _mm512_set1_ps(-10.0f), hi = _mm512_set1_ps(10.0f);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = (__mmask16)(n - i >= 16 ? 0xFFFFu : (1u << (n - i)) - 1u);
        const __m512 x = _mm512_maskz_loadu_ps(m, gate + i);
        const __m512i idx =
            _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m512 g = _mm512_i32gather_ps(idx, table, 4);
        g = _mm512_mask_mov_ps(g, _mm512_cmp_ps_mask(x, lo, _CMP_LE_OQ), _mm512_setzero_ps());
        g = _mm512_mask_mov_ps(g, _mm512_cmp_ps_mask(x, hi, _CMP_GE_OQ), x);
        _mm512_mask_storeu_ps(gate + i, m, _mm512_mul_ps(g, _mm512_maskz_loadu_ps(m, up + i)));
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
