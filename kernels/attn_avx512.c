/*
 * attn_avx512.c - grouped paged attention with AVX-512, for head sizes of
 * 64 and 128 (the llama family's).
 *
 * Positions go sixteen at a time. Their K rows are converted to floats once
 * for the whole group of query heads; each head's sixteen dot products are
 * sixteen-lane partial sums reduced together by one transpose-and-add tree,
 * so a score costs a few instructions instead of a horizontal sum. Softmax
 * runs sixteen lanes wide (its sum in double), then out += p v position by
 * position with one V row load for all heads. A partial group at the end of
 * the context goes through the same instructions with its missing rows
 * zeroed and its lanes masked, and every head's result is computed the same
 * way whatever heads share the call.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "attn.h"
#include "exp512.h"
#include "ops.h"
#include "types.h"

/* Sixteen vectors in, one out: lane i = the sum of the lanes of v[i]. */
static inline __m512 reduce16(const __m512 v[16])
{
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)   /* per 128-bit lane: v2i0+v2i2, v2i+1..., v2i1+v2i3, ... */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: sums of v4i, v4i+1, v4i+2, v4i+3 */
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __m512 load16(const uint8_t *row, int h, bool half)
{
    if (half)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 32 * (size_t)h)));
    return _mm512_loadu_ps((const float *)row + 16 * h);
}

/* Entering block b of the context: ask for block b + 1's K rows (the next
 * ones read) and block b's V rows (read after the softmax); each block's
 * rows of one head are contiguous, and a context's blocks are scattered, so
 * the hardware prefetcher would restart at every block. */
static inline void prefetch_block(const struct kern_attn_args *a, int b, int n, uint64_t k_off,
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
}

#define MAX_Q 4  /* query heads per pass */

/* HV = head_dim / 16 (4 or 8), NQ query heads (1..MAX_Q). */
static inline __attribute__((always_inline)) void
attn_pass(const int HV, const int NQ, const struct kern_attn_args *a, int q0)
{
    const bool half = a->k_type == KERN_F16;
    const int hd = 16 * HV, n = a->n_ctx;
    const size_t row_bytes = (size_t)hd * (half ? 2 : 4);
    __m512 qv[MAX_Q][8];
    for (int g = 0; g < NQ; g++)
        for (int h = 0; h < HV; h++) {
            __m512 x = _mm512_loadu_ps(a->q + (size_t)(q0 + g) * hd + 16 * h);
            if (half)  /* q meets an f16 cache as f16, as in the C reference */
                x = _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            qv[g][h] = x;
        }
    /* scores */
    __m512 vmax[MAX_Q];
    for (int g = 0; g < NQ; g++)
        vmax[g] = _mm512_set1_ps(-INFINITY);
    const __m512 scale = _mm512_set1_ps(a->scale);
    float kf[16][128] __attribute__((aligned(64)));
    const uint64_t k_off = (uint64_t)a->kv_head * a->k_head_stride;
    const uint64_t v_off = (uint64_t)a->kv_head * a->v_head_stride;
    int blk = 0, off = 0;  /* the next position's block and row, without a division per row */
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int cnt = n - j0 < 16 ? n - j0 : 16;
        const __mmask16 m = (__mmask16)((1u << cnt) - 1u);
        for (int p = 0; p < 16; p++) {
            const uint8_t *k = NULL;
            if (p < cnt) {
                if (off == 0)
                    prefetch_block(a, blk, n, k_off, v_off, row_bytes, row_bytes);
                k = a->k_base + a->blocks[blk] * a->block_stride + k_off + (size_t)off * row_bytes;
                if (++off == a->block_tokens) {
                    off = 0;
                    blk++;
                }
            }
            for (int h = 0; h < HV; h++)
                _mm512_store_ps(&kf[p][16 * h], k != NULL ? load16(k, h, half) : _mm512_setzero_ps());
        }
        for (int g = 0; g < NQ; g++) {
            __m512 acc[16];
            for (int p = 0; p < 16; p++) {
                __m512 s = _mm512_mul_ps(qv[g][0], _mm512_load_ps(&kf[p][0]));
                for (int h = 1; h < HV; h++)
                    s = _mm512_fmadd_ps(qv[g][h], _mm512_load_ps(&kf[p][16 * h]), s);
                acc[p] = s;
            }
            const __m512 sc = _mm512_mul_ps(reduce16(acc), scale);
            _mm512_mask_storeu_ps(a->scores + (size_t)g * n + j0, m, sc);
            vmax[g] = _mm512_mask_max_ps(vmax[g], m, vmax[g], sc);
        }
    }
    /* softmax per head */
    for (int g = 0; g < NQ; g++) {
        float *sc = a->scores + (size_t)g * n;
        const float mx = _mm512_reduce_max_ps(vmax[g]);
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
        for (int j = 0; j < n; j += 16) {
            const __mmask16 m = (__mmask16)(n - j >= 16 ? 0xFFFFu : (1u << (n - j)) - 1u);
            const __m512 e = _mm512_maskz_mov_ps(m, kern_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + j), vmx)));
            _mm512_mask_storeu_ps(sc + j, m, e);
            s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
        }
        const double sum = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
        if (a->stats != NULL) {
            a->stats[2 * (q0 + g)] = mx;
            a->stats[2 * (q0 + g) + 1] = (float)sum;
        }
        const __m512 inv = _mm512_set1_ps((float)(1.0 / sum));
        for (int j = 0; j < n; j += 16) {
            const __mmask16 m = (__mmask16)(n - j >= 16 ? 0xFFFFu : (1u << (n - j)) - 1u);
            __m512 pv = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sc + j), inv);
            if (half)
                pv = _mm512_cvtph_ps(_mm512_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm512_mask_storeu_ps(sc + j, m, pv);
        }
    }
    /* out = sum p v */
    __m512 acc[MAX_Q][8];
    for (int g = 0; g < NQ; g++)
        for (int h = 0; h < HV; h++)
            acc[g][h] = _mm512_setzero_ps();
    for (int j0 = 0, b = 0; j0 < n; j0 += a->block_tokens, b++) {
        const uint8_t *v = a->v_base + a->blocks[b] * a->block_stride + v_off;
        const int end = n - j0 < a->block_tokens ? n : j0 + a->block_tokens;
        for (int j = j0; j < end; j++, v += row_bytes)
            for (int h = 0; h < HV; h++) {
                const __m512 vv = load16(v, h, half);
                for (int g = 0; g < NQ; g++)
                    acc[g][h] = _mm512_fmadd_ps(_mm512_set1_ps(a->scores[(size_t)g * n + j]), vv, acc[g][h]);
            }
    }
    for (int g = 0; g < NQ; g++)
        for (int h = 0; h < HV; h++)
            _mm512_storeu_ps(a->out + (size_t)(q0 + g) * hd + 16 * h, acc[g][h]);
}

#define PASS(HV, NQ)                                                                           \
    case (HV) * 8 + (NQ):                                                                      \
        attn_pass(HV, NQ, a, q0);                                                              \
        break

int kern_attn_avx512(const struct kern_attn_args *a)
{
    const int hd = a->head_dim;
    if ((hd != 64 && hd != 128) || a->k_type != a->v_type ||
        (a->k_type != KERN_F16 && a->k_type != KERN_F32))
        return 0;
    const int HV = hd / 16;
    for (int q0 = 0; q0 < a->n_q; q0 += MAX_Q) {
        const int nq = a->n_q - q0 < MAX_Q ? a->n_q - q0 : MAX_Q;
        switch (HV * 8 + nq) {
        PASS(4, 1); PASS(4, 2); PASS(4, 3); PASS(4, 4);
        PASS(8, 1); PASS(8, 2); PASS(8, 3); PASS(8, 4);
        default: return 0;
        }
    }
    return 1;
}
#endif
