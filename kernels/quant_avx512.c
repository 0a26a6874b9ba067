/*
 * quant_avx512.c - the activation quantizers (Q8_0, Q8_1) with AVX-512,
 * sixteen blocks of 32 at a time.
 *
 * The AVX2 quantizer spends much of its time on what is one scalar per block:
 * the horizontal maximum, the scale and its reciprocal (two divisions) and
 * the f16 conversion. Here the sixteen blocks' maxima come out of one
 * transpose-and-max tree, one per lane, and the scales, reciprocals and f16
 * conversions are done sixteen lanes at once. The bytes are the reference's
 * exactly, as the AVX2 path's: the maximum skips NaN elements and is the same
 * whatever the order; a vector division is the correctly rounded scalar one;
 * the codes are roundf's (half away from zero) rebuilt from truncation; the
 * hardware f16 conversion rounds to nearest even like kvd_f32_to_f16 (a NaN
 * scale cannot occur: the maximum skips NaN). A row's last blocks (fewer
 * than sixteen) go through the AVX2 quantizer. Q8_K (the K-quants'
 * activations, 256 values a block) is one block at a time.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"
#include "quant_blocks.h"
#include "types.h"

/* roundf(v) (half away from zero) as cvtt(v + copysign(0.49999997, v)):
 * the sum rounds to nearest, so a fraction of exactly one half reaches the
 * next integer and any smaller one stays below it; checked against roundf
 * for every float of magnitude up to 300 (the codes are at most 127.00002).
 * NaN lanes are the caller's to mask. */
static inline __m512i round_away16(__m512 v)
{
    const __m512i h = _mm512_ternarylogic_epi32(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u),
                                                _mm512_set1_epi32(0x3EFFFFFF), 0xEA); /* (v & sign) | 0.49999997 */
    return _mm512_cvttps_epi32(_mm512_add_ps(v, _mm512_castsi512_ps(h)));
}

/* Sixteen vectors in, one out: lane i = the sum of s[i]'s lanes. */
static inline __m512i sum16(__m512i s[16])
{
    __m512i t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * i], s[2 * i + 1]),
                                _mm512_unpackhi_epi32(s[2 * i], s[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    const __m512i x01 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i x23 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Sixteen vectors in, one out: lane i = the largest lane of m[i] (no NaN in). */
static inline __m512 max16(__m512 m[16])
{
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_max_ps(_mm512_unpacklo_ps(m[2 * i], m[2 * i + 1]),
                             _mm512_unpackhi_ps(m[2 * i], m[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_max_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 x01 = _mm512_max_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 x23 = _mm512_max_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_max_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Blocks [0, 16) of x: codes, scales (f16) and, with q81, the f16 of
 * sum(codes) * d, written at dst with a block stride of `stride` bytes. */
static inline __attribute__((always_inline)) void quant16(const float *x, uint8_t *dst, size_t stride, int q81)
{
    __m512 m[16];
    for (int b = 0; b < 16; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
        /* max(|v|, acc): a NaN element gives acc, as the reference skips it */
        m[b] = _mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps()));
    }
    const __m512 amax = max16(m);
    const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
    __m512 id = _mm512_div_ps(_mm512_set1_ps(1.0f), d);
    /* 0 where d is 0 or 1/d is not finite (inf; d = inf gives 0 already) */
    const __mmask16 ok = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ) &
                         _mm512_cmp_ps_mask(_mm512_abs_ps(id), _mm512_set1_ps(__builtin_inff()), _CMP_LT_OQ);
    id = _mm512_maskz_mov_ps(ok, id);
    float ids[16] __attribute__((aligned(64)));
    __m512i sums[16];
    _mm512_store_ps(ids, id);
    for (int b = 0; b < 16; b++) {
        const __m512 vid = _mm512_set1_ps(ids[b]);
        const __m512 y0 = _mm512_mul_ps(_mm512_loadu_ps(x + 32 * b), vid);
        const __m512 y1 = _mm512_mul_ps(_mm512_loadu_ps(x + 32 * b + 16), vid);
        /* a NaN codes as 0, as in the reference (cvtt would give INT_MIN) */
        const __m512i q0 = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y0, y0, _CMP_ORD_Q), round_away16(y0));
        const __m512i q1 = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y1, y1, _CMP_ORD_Q), round_away16(y1));
        sums[b] = _mm512_add_epi32(q0, q1);
        uint8_t *qs = dst + (size_t)b * stride + (q81 ? 4 : 2);
        _mm_storeu_si128((__m128i *)qs, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qs + 16), _mm512_cvtsepi32_epi8(q1));
    }
    uint16_t dh[16], sh[16];
    _mm256_storeu_si256((__m256i *)dh, _mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (q81) {
        /* the block sums stay in registers: sixteen scalar stores read back as
         * one vector cannot be forwarded, and that stall was most of the time */
        const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(sum16(sums)), d);
        _mm256_storeu_si256((__m256i *)sh, _mm512_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (int b = 0; b < 16; b++) {
        memcpy(dst + (size_t)b * stride, &dh[b], 2);
        if (q81)
            memcpy(dst + (size_t)b * stride + 2, &sh[b], 2);
    }
}

/* One Q8_K block (256 values), the reference's bytes (quant_q8_k): the
 * scale from the first element of the largest magnitude (NaN skipped), codes
 * rounded half to even by the same 1.5 * 2^23 addition (so a NaN codes as
 * the reference's does), clamped to [-128, 127]; the sixteen sums of sixteen
 * codes from one transpose-and-add tree. */
static void quant_q8_k16(const float *x, struct kern_block_q8_k *b)
{
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < 16; i++)
        m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + 16 * i)), m);  /* a NaN element gives m */
    const float amax = _mm512_reduce_max_ps(m);
    if (amax == 0.0f) {
        memset(b, 0, sizeof(*b));
        return;
    }
    float max = 0.0f;
    const __m512 va = _mm512_set1_ps(amax);
    for (int i = 0; i < 16; i++) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + 16 * i)), va, _CMP_EQ_OQ);
        if (k != 0) {
            max = x[16 * i + __builtin_ctz(k)];
            break;
        }
    }
    const float iscale = -127.0f / max;
    const __m512 vs = _mm512_set1_ps(iscale), magic = _mm512_set1_ps(12582912.0f);
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
    __m512i q[16];
    for (int i = 0; i < 16; i++) {
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(vs, _mm512_loadu_ps(x + 16 * i)), magic);
        const __m512i r = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x007fffff)),
                                           _mm512_set1_epi32(0x00400000));
        q[i] = _mm512_min_epi32(_mm512_max_epi32(r, lo), hi);
        _mm_storeu_si128((__m128i *)(b->qs + 16 * i), _mm512_cvtepi32_epi8(q[i]));
    }
    _mm256_storeu_si256((__m256i *)b->bsums, _mm512_cvtepi32_epi16(sum16(q)));
    b->d = 1.0f / iscale;
}

bool kern_quantize_act_avx512(uint32_t act_type, const float *src, void *dst, int64_t n)
{
    if (act_type == KERN_Q8_K && n % KERN_QK_K == 0) {
        struct kern_block_q8_k *b = dst;
        for (int64_t i = 0; i < n / KERN_QK_K; i++)
            quant_q8_k16(src + KERN_QK_K * i, b + i);
        return true;
    }
    if (n % 32 != 0 || (act_type != KERN_Q8_0 && act_type != KERN_Q8_1))
        return false;
    const int q81 = act_type == KERN_Q8_1;
    const size_t stride = q81 ? sizeof(struct kern_block_q8_1) : sizeof(struct kern_block_q8_0);
    const int64_t nb = n / 32, whole = nb / 16 * 16;
    /* q81 a constant in each loop: Q8_0 skips the block sums */
    if (q81)
        for (int64_t i = 0; i < whole; i += 16)
            quant16(src + 32 * i, (uint8_t *)dst + (size_t)i * stride, stride, 1);
    else
        for (int64_t i = 0; i < whole; i += 16)
            quant16(src + 32 * i, (uint8_t *)dst + (size_t)i * stride, stride, 0);
    if (whole < nb)
        return kern_quantize_act_avx2(act_type, src + 32 * whole, (uint8_t *)dst + (size_t)whole * stride,
                                      32 * (nb - whole));
    return true;
}
#endif
