/*
 * quant.c - portable C reference of dequantization, quantization and the
 * quantized dot products (see quant.h for the contracts).
 *
 * Every block type has a small set of functions that work on one block;
 * the row-level entry points look them up in one table. The dot products
 * reproduce the float operations of llama.cpp's generic CPU code in the same
 * order, so that a kvd forward pass stays as close as possible to it.
 */
#include "quant.h"

#include "cpu.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "err.h"
#include "f16.h"

/* ---- small helpers ------------------------------------------------------ */

/* Round to nearest, ties to even, for |x| < 2^22 (adds 1.5 * 2^23 so that
 * the float unit does the rounding). Independent of libm. */
static inline int round_even(float x)
{
    float v = x + 12582912.0f;
    uint32_t u = kvd_f32_bits(v);
    return (int)(u & 0x007fffffu) - 0x00400000;
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* v truncated to an int, as (int)v, but defined for every float: NaN is 0 and
 * what lies beyond an int's range is its end (rows of NaN or infinities come
 * only from a broken model, and must not be undefined behaviour even then). */
static inline int f2i(float v)
{
    if (!(v == v))
        return 0;
    if (v >= 2147483520.0f)
        return INT32_MAX;
    if (v <= -2147483648.0f)
        return INT32_MIN;
    return (int)v;
}

static inline uint32_t load_le32(const uint8_t b[4])
{
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

static inline void store_le32(uint8_t b[4], uint32_t v)
{
    b[0] = (uint8_t)v;
    b[1] = (uint8_t)(v >> 8);
    b[2] = (uint8_t)(v >> 16);
    b[3] = (uint8_t)(v >> 24);
}

/* Float to bfloat16 with round-to-nearest-even; NaN stays a quiet NaN. */
static inline kvd_bf16 f32_to_bf16(float f)
{
    uint32_t u = kvd_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (kvd_bf16)((u >> 16) | 0x40u);
    return (kvd_bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Largest |x| of n values, and the signed value that has it (first wins). */
static float signed_absmax(const float *x, int n, float *amax_out)
{
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > amax) {
            amax = a;
            max = x[i];
        }
    }
    if (amax_out != NULL)
        *amax_out = amax;
    return max;
}

/* 1/d, or 0 when d is 0 or so small that 1/d overflows. */
static inline float inv_or_zero(float d)
{
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    return isfinite(id) ? id : 0.0f;
}

static void min_max(const float *x, int n, float *mn, float *mx)
{
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < lo)
            lo = x[i];
        if (x[i] > hi)
            hi = x[i];
    }
    *mn = lo;
    *mx = hi;
}

/* The 5-bit code of element j of a Q5_0/Q5_1 block. */
static inline int q5_code(const uint8_t *qs, uint32_t qh, int j)
{
    int lo = j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
    return lo | (int)((qh >> j) & 1u) << 4;
}

/* Unpacks sub-block k's 6-bit scale and minimum of a Q4_K/Q5_K block. */
static inline void k_scale_min(const uint8_t *s, int k, int *sc, int *mn)
{
    if (k < 4) {
        *sc = s[k] & 63;
        *mn = s[k + 4] & 63;
    } else {
        *sc = (s[k + 4] & 0x0F) | (s[k - 4] >> 6) << 4;
        *mn = (s[k + 4] >> 4) | (s[k] >> 6) << 4;
    }
}

/* Packs eight 6-bit scales and minimums the way k_scale_min reads them. */
static void k_pack_scale_min(uint8_t s[KERN_K_SCALE_BYTES], const int sc[8], const int mn[8])
{
    for (int k = 0; k < 4; k++) {
        s[k] = (uint8_t)((sc[k] & 63) | (sc[k + 4] >> 4) << 6);
        s[k + 4] = (uint8_t)((mn[k] & 63) | (mn[k + 4] >> 4) << 6);
        s[k + 8] = (uint8_t)((sc[k + 4] & 0x0F) | (mn[k + 4] & 0x0F) << 4);
    }
}

/* ---- dequantization of one block ---------------------------------------- */

static void deq_q4_0(const void *blk, float *y)
{
    const struct kern_block_q4_0 *b = blk;
    const float d = kvd_f16_to_f32(b->d);
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((b->qs[j] & 0x0F) - 8) * d;
        y[j + 16] = (float)((b->qs[j] >> 4) - 8) * d;
    }
}

static void deq_q4_1(const void *blk, float *y)
{
    const struct kern_block_q4_1 *b = blk;
    const float d = kvd_f16_to_f32(b->d), m = kvd_f16_to_f32(b->m);
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(b->qs[j] & 0x0F) * d + m;
        y[j + 16] = (float)(b->qs[j] >> 4) * d + m;
    }
}

static void deq_q5_0(const void *blk, float *y)
{
    const struct kern_block_q5_0 *b = blk;
    const float d = kvd_f16_to_f32(b->d);
    const uint32_t qh = load_le32(b->qh);
    for (int j = 0; j < 32; j++)
        y[j] = (float)(q5_code(b->qs, qh, j) - 16) * d;
}

static void deq_q5_1(const void *blk, float *y)
{
    const struct kern_block_q5_1 *b = blk;
    const float d = kvd_f16_to_f32(b->d), m = kvd_f16_to_f32(b->m);
    const uint32_t qh = load_le32(b->qh);
    for (int j = 0; j < 32; j++)
        y[j] = (float)q5_code(b->qs, qh, j) * d + m;
}

static void deq_q8_0(const void *blk, float *y)
{
    const struct kern_block_q8_0 *b = blk;
    const float d = kvd_f16_to_f32(b->d);
    for (int j = 0; j < 32; j++)
        y[j] = (float)b->qs[j] * d;
}

static void deq_q8_1(const void *blk, float *y)
{
    const struct kern_block_q8_1 *b = blk;
    const float d = kvd_f16_to_f32(b->d);
    for (int j = 0; j < 32; j++)
        y[j] = (float)b->qs[j] * d;
}

static void deq_q4_k(const void *blk, float *y)
{
    const struct kern_block_q4_k *b = blk;
    const float d = kvd_f16_to_f32(b->d), dmin = kvd_f16_to_f32(b->dmin);
    for (int c = 0; c < 4; c++) {
        int sc0, mn0, sc1, mn1;
        k_scale_min(b->scales, 2 * c, &sc0, &mn0);
        k_scale_min(b->scales, 2 * c + 1, &sc1, &mn1);
        const float d0 = d * (float)sc0, m0 = dmin * (float)mn0;
        const float d1 = d * (float)sc1, m1 = dmin * (float)mn1;
        const uint8_t *q = b->qs + 32 * c;
        for (int l = 0; l < 32; l++) {
            y[64 * c + l] = d0 * (float)(q[l] & 0x0F) - m0;
            y[64 * c + 32 + l] = d1 * (float)(q[l] >> 4) - m1;
        }
    }
}

static void deq_q5_k(const void *blk, float *y)
{
    const struct kern_block_q5_k *b = blk;
    const float d = kvd_f16_to_f32(b->d), dmin = kvd_f16_to_f32(b->dmin);
    for (int c = 0; c < 4; c++) {
        const int k0 = 2 * c, k1 = 2 * c + 1;
        int sc0, mn0, sc1, mn1;
        k_scale_min(b->scales, k0, &sc0, &mn0);
        k_scale_min(b->scales, k1, &sc1, &mn1);
        const float d0 = d * (float)sc0, m0 = dmin * (float)mn0;
        const float d1 = d * (float)sc1, m1 = dmin * (float)mn1;
        const uint8_t *q = b->qs + 32 * c;
        for (int l = 0; l < 32; l++) {
            int c0 = (q[l] & 0x0F) | ((b->qh[l] >> k0) & 1) << 4;
            int c1 = (q[l] >> 4) | ((b->qh[l] >> k1) & 1) << 4;
            y[64 * c + l] = d0 * (float)c0 - m0;
            y[64 * c + 32 + l] = d1 * (float)c1 - m1;
        }
    }
}

/* The signed 6-bit values (code - 32) of the 256 elements of a Q6_K block. */
static void q6_values(const struct kern_block_q6_k *b, int8_t v[KERN_QK_K])
{
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        int8_t *o = v + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (int8_t)(((ql[l] & 0x0F) | (qh[l] & 3) << 4) - 32);
            o[l + 32] = (int8_t)(((ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4) - 32);
            o[l + 64] = (int8_t)(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
            o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
        }
    }
}

static void deq_q6_k(const void *blk, float *y)
{
    const struct kern_block_q6_k *b = blk;
    const float d = kvd_f16_to_f32(b->d);
    int8_t v[KERN_QK_K];
    q6_values(b, v);
    for (int e = 0; e < KERN_QK_K; e++)
        y[e] = d * (float)b->scales[e / 16] * (float)v[e];
}

static void deq_q8_k(const void *blk, float *y)
{
    const struct kern_block_q8_k *b = blk;
    for (int j = 0; j < KERN_QK_K; j++)
        y[j] = b->d * (float)b->qs[j];
}

/* ---- quantization of one block ------------------------------------------ */

/* Q8_0 as llama.cpp's reference: d = amax/127, q = roundf(x / d) computed
 * as x * (1/d). Returns the unrounded d and the code sum (for Q8_1). */
static float quant_q8_32(const float *x, kvd_f16 *d_out, int8_t *qs, int *sum_out)
{
    float amax;
    signed_absmax(x, 32, &amax);
    const float d = amax / 127.0f;
    const float id = inv_or_zero(d);
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        /* a NaN codes as 0 (the block's scale ignores it) */
        const int q = f2i(roundf(x[j] * id));
        qs[j] = (int8_t)q;
        sum += q;
    }
    *d_out = kvd_f32_to_f16(d);
    *sum_out = sum;
    return d;
}

static void quant_q8_0(const float *x, void *blk)
{
    struct kern_block_q8_0 *b = blk;
    int sum;
    quant_q8_32(x, &b->d, b->qs, &sum);
}

static void quant_q8_1(const float *x, void *blk)
{
    struct kern_block_q8_1 *b = blk;
    int sum;
    float d = quant_q8_32(x, &b->d, b->qs, &sum);
    b->s = kvd_f32_to_f16((float)sum * d);
}

/* Q4_0/Q5_0: a scale that maps the element of largest magnitude to the most
 * negative code, codes rounded and clamped to 0..qmax. */
static void quant_sym(const float *x, int half, int qmax, kvd_f16 *d_out, uint8_t *codes)
{
    const float max = signed_absmax(x, 32, NULL);
    const float d = max / (float)-half;
    const float id = inv_or_zero(d);
    for (int j = 0; j < 32; j++)
        codes[j] = (uint8_t)clampi(f2i(x[j] * id + ((float)half + 0.5f)), 0, qmax);
    *d_out = kvd_f32_to_f16(d);
}

void kern_quantize_q4_0_lsq(const float *src, void *dst, int64_t n)
{
    struct kern_block_q4_0 *b = dst;
    for (int64_t i = 0; i < n / 32; i++, src += 32) {
        const float max = signed_absmax(src, 32, NULL);
        int8_t best[32] = { 0 };
        double best_score = -1.0, best_d = 0.0;
        /* candidate inverse scales around the one that maps max to -8 */
        for (int k = -9; k <= 9 && max != 0.0f; k++) {
            const float is = -(8.0f + 0.1f * (float)k) / max;
            int8_t l[32];
            double sxl = 0.0, sll = 0.0;
            for (int j = 0; j < 32; j++) {
                l[j] = (int8_t)(clampi(f2i(is * src[j] + 8.5f), 0, 15) - 8);
                sxl += (double)src[j] * l[j];
                sll += (double)l[j] * l[j];
            }
            /* the least-squares scale for these codes leaves sum x^2 - sxl^2 / sll */
            if (sll > 0 && sxl * sxl / sll > best_score) {
                best_score = sxl * sxl / sll;
                best_d = sxl / sll;
                memcpy(best, l, sizeof(best));
            }
        }
        b[i].d = kvd_f32_to_f16((float)best_d);
        for (int j = 0; j < 16; j++)
            b[i].qs[j] = (uint8_t)((best[j] + 8) | (best[j + 16] + 8) << 4);
    }
}

/* Q4_1/Q5_1: min and max map to codes 0 and qmax. */
static void quant_asym(const float *x, int qmax, kvd_f16 *d_out, kvd_f16 *m_out, uint8_t *codes)
{
    float mn, mx;
    min_max(x, 32, &mn, &mx);
    const float d = (mx - mn) / (float)qmax;
    const float id = inv_or_zero(d);
    for (int j = 0; j < 32; j++)
        codes[j] = (uint8_t)clampi(f2i((x[j] - mn) * id + 0.5f), 0, qmax);
    *d_out = kvd_f32_to_f16(d);
    *m_out = kvd_f32_to_f16(mn);
}

static void pack_nibbles16(uint8_t qs[16], const uint8_t codes[32])
{
    for (int j = 0; j < 16; j++)
        qs[j] = (uint8_t)((codes[j] & 0x0F) | (codes[j + 16] & 0x0F) << 4);
}

static uint32_t high_bits32(const uint8_t codes[32])
{
    uint32_t qh = 0;
    for (int j = 0; j < 32; j++)
        qh |= (uint32_t)((codes[j] >> 4) & 1) << j;
    return qh;
}

static void quant_q4_0(const float *x, void *blk)
{
    struct kern_block_q4_0 *b = blk;
    uint8_t codes[32];
    quant_sym(x, 8, 15, &b->d, codes);
    pack_nibbles16(b->qs, codes);
}

static void quant_q4_1(const float *x, void *blk)
{
    struct kern_block_q4_1 *b = blk;
    uint8_t codes[32];
    quant_asym(x, 15, &b->d, &b->m, codes);
    pack_nibbles16(b->qs, codes);
}

static void quant_q5_0(const float *x, void *blk)
{
    struct kern_block_q5_0 *b = blk;
    uint8_t codes[32];
    quant_sym(x, 16, 31, &b->d, codes);
    pack_nibbles16(b->qs, codes);
    store_le32(b->qh, high_bits32(codes));
}

static void quant_q5_1(const float *x, void *blk)
{
    struct kern_block_q5_1 *b = blk;
    uint8_t codes[32];
    quant_asym(x, 31, &b->d, &b->m, codes);
    pack_nibbles16(b->qs, codes);
    store_le32(b->qh, high_bits32(codes));
}

/* Q4_K/Q5_K: per sub-block of 32 a min/max affine map (minimum clamped to
 * <= 0 as the format stores it negated), sub-block scales and minimums
 * quantized to 6 bits against the super-block's d and dmin, then codes
 * rounded against the scales as the decoder will see them. */
static void quant_kx(const float *x, int qmax, kvd_f16 *d_out, kvd_f16 *dmin_out,
                     uint8_t scales[KERN_K_SCALE_BYTES], uint8_t codes[KERN_QK_K])
{
    float scale[8], negmin[8], max_scale = 0.0f, max_min = 0.0f;
    for (int k = 0; k < 8; k++) {
        float mn, mx;
        min_max(x + 32 * k, 32, &mn, &mx);
        if (mn > 0.0f)
            mn = 0.0f;
        scale[k] = (mx - mn) / (float)qmax;
        negmin[k] = -mn;
        if (scale[k] > max_scale)
            max_scale = scale[k];
        if (negmin[k] > max_min)
            max_min = negmin[k];
    }
    const float d = max_scale / 63.0f, dmin = max_min / 63.0f;
    int sc[8], mnq[8];
    for (int k = 0; k < 8; k++) {
        sc[k] = d > 0.0f ? clampi(round_even(scale[k] / d), 0, 63) : 0;
        mnq[k] = dmin > 0.0f ? clampi(round_even(negmin[k] / dmin), 0, 63) : 0;
    }
    *d_out = kvd_f32_to_f16(d);
    *dmin_out = kvd_f32_to_f16(dmin);
    k_pack_scale_min(scales, sc, mnq);
    const float dq = kvd_f16_to_f32(*d_out), dmq = kvd_f16_to_f32(*dmin_out);
    for (int k = 0; k < 8; k++) {
        const float ds = dq * (float)sc[k], dm = dmq * (float)mnq[k];
        for (int l = 0; l < 32; l++) {
            int q = ds > 0.0f ? round_even((x[32 * k + l] + dm) / ds) : 0;
            codes[32 * k + l] = (uint8_t)clampi(q, 0, qmax);
        }
    }
}

static void quant_q4_k(const float *x, void *blk)
{
    struct kern_block_q4_k *b = blk;
    uint8_t codes[KERN_QK_K];
    quant_kx(x, 15, &b->d, &b->dmin, b->scales, codes);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            b->qs[32 * c + l] = (uint8_t)(codes[64 * c + l] | codes[64 * c + 32 + l] << 4);
}

static void quant_q5_k(const float *x, void *blk)
{
    struct kern_block_q5_k *b = blk;
    uint8_t codes[KERN_QK_K];
    quant_kx(x, 31, &b->d, &b->dmin, b->scales, codes);
    memset(b->qh, 0, sizeof(b->qh));
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            const int c0 = codes[64 * c + l], c1 = codes[64 * c + 32 + l];
            b->qs[32 * c + l] = (uint8_t)((c0 & 0x0F) | (c1 & 0x0F) << 4);
            b->qh[l] |= (uint8_t)(((c0 >> 4) & 1) << (2 * c) | ((c1 >> 4) & 1) << (2 * c + 1));
        }
}

/* Q6_K: per sub-block of 16 a symmetric scale (largest magnitude -> -32),
 * the 16 scales quantized to int8 against d, codes rounded against the
 * stored scales. */
static void quant_q6_k(const float *x, void *blk)
{
    struct kern_block_q6_k *b = blk;
    float scale[16], smax = 0.0f, samax = 0.0f;
    for (int s = 0; s < 16; s++) {
        scale[s] = signed_absmax(x + 16 * s, 16, NULL) / -32.0f;
        if (fabsf(scale[s]) > samax) {
            samax = fabsf(scale[s]);
            smax = scale[s];
        }
    }
    const float d = smax / 127.0f;
    b->d = kvd_f32_to_f16(d);
    const float dq = kvd_f16_to_f32(b->d);
    memset(b->ql, 0, sizeof(b->ql));
    memset(b->qh, 0, sizeof(b->qh));
    for (int s = 0; s < 16; s++)
        b->scales[s] = (int8_t)(d != 0.0f ? clampi(round_even(scale[s] / d), -128, 127) : 0);
    for (int e = 0; e < KERN_QK_K; e++) {
        const float ds = dq * (float)b->scales[e / 16];
        const int code = ds != 0.0f ? clampi(round_even(x[e] / ds) + 32, 0, 63) : 32;
        const int h = e / 128, r = e % 128, l = r % 32, quarter = r / 32;
        uint8_t *ql = b->ql + 64 * h + l + ((quarter & 1) ? 32 : 0);
        *ql |= (uint8_t)((quarter & 2) ? (code & 0x0F) << 4 : (code & 0x0F));
        b->qh[32 * h + l] |= (uint8_t)((code >> 4) << (2 * quarter));
    }
}

/* Q8_K as llama.cpp's reference quantize_row_q8_K. */
static void quant_q8_k(const float *x, void *blk)
{
    struct kern_block_q8_k *b = blk;
    float amax;
    const float max = signed_absmax(x, KERN_QK_K, &amax);
    if (amax == 0.0f) {
        memset(b, 0, sizeof(*b));
        return;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < KERN_QK_K; j++)
        b->qs[j] = (int8_t)clampi(round_even(iscale * x[j]), -128, 127);
    for (int g = 0; g < KERN_QK_K / 16; g++) {
        int sum = 0;
        for (int l = 0; l < 16; l++)
            sum += b->qs[16 * g + l];
        b->bsums[g] = (int16_t)sum;
    }
    b->d = 1.0f / iscale;
}

/* ---- dot products of one row pair, nb blocks ------------------------------ */

static float dot_q4_0(int64_t nb, const void *wv, const void *av)
{
    const struct kern_block_q4_0 *w = wv;
    const struct kern_block_q8_0 *a = av;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int si = 0;
        for (int j = 0; j < 16; j++)
            si += ((w[i].qs[j] & 0x0F) - 8) * a[i].qs[j] + ((w[i].qs[j] >> 4) - 8) * a[i].qs[j + 16];
        sum += (float)si * kvd_f16_to_f32(w[i].d) * kvd_f16_to_f32(a[i].d);
    }
    return sum;
}

static float dot_q4_1(int64_t nb, const void *wv, const void *av)
{
    const struct kern_block_q4_1 *w = wv;
    const struct kern_block_q8_1 *a = av;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int si = 0;
        for (int j = 0; j < 16; j++)
            si += (w[i].qs[j] & 0x0F) * a[i].qs[j] + (w[i].qs[j] >> 4) * a[i].qs[j + 16];
        sum += kvd_f16_to_f32(w[i].d) * kvd_f16_to_f32(a[i].d) * (float)si
             + kvd_f16_to_f32(w[i].m) * kvd_f16_to_f32(a[i].s);
    }
    return sum;
}

static float dot_q5_0(int64_t nb, const void *wv, const void *av)
{
    const struct kern_block_q5_0 *w = wv;
    const struct kern_block_q8_0 *a = av;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint32_t qh = load_le32(w[i].qh);
        int si = 0;
        for (int j = 0; j < 32; j++)
            si += (q5_code(w[i].qs, qh, j) - 16) * a[i].qs[j];
        sum += kvd_f16_to_f32(w[i].d) * kvd_f16_to_f32(a[i].d) * (float)si;
    }
    return sum;
}

static float dot_q5_1(int64_t nb, const void *wv, const void *av)
{
    const struct kern_block_q5_1 *w = wv;
    const struct kern_block_q8_1 *a = av;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint32_t qh = load_le32(w[i].qh);
        int si = 0;
        for (int j = 0; j < 32; j++)
            si += q5_code(w[i].qs, qh, j) * a[i].qs[j];
        sum += kvd_f16_to_f32(w[i].d) * kvd_f16_to_f32(a[i].d) * (float)si
             + kvd_f16_to_f32(w[i].m) * kvd_f16_to_f32(a[i].s);
    }
    return sum;
}

static float dot_q8_0(int64_t nb, const void *wv, const void *av)
{
    const struct kern_block_q8_0 *w = wv;
    const struct kern_block_q8_0 *a = av;
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int si = 0;
        for (int j = 0; j < 32; j++)
            si += w[i].qs[j] * a[i].qs[j];
        sum += kvd_f16_to_f32(w[i].d) * kvd_f16_to_f32(a[i].d) * (float)si;
    }
    return sum;
}

/*
 * The K-quant dot products keep llama.cpp's accumulation: per super-block,
 * eight integer lanes (lane l sums scale * code * q8 over the elements whose
 * index is l mod 8), scaled by d_w * d_a and added into eight float lanes
 * that live across the row; the minimum terms (Q4_K/Q5_K) go into one
 * float; at the end the float lanes are added to it in lane order.
 */
static float k_finish(float mins, const float lanes[8])
{
    float sum = mins;
    for (int l = 0; l < 8; l++)
        sum += lanes[l];
    return sum;
}

/* The part of a Q4_K or Q5_K block's dot product after its codes[256]
 * (unsigned, sub-blocks of 32) are unpacked: integer sums in 8 lanes and the
 * min term, then their float accumulation into lanes_f and *mins in
 * llama.cpp's order. */
static void k_accum_kx(const uint8_t *codes, const uint8_t *scales, kvd_f16 wd, kvd_f16 wdmin,
                       const struct kern_block_q8_k *a, float lanes_f[8], float *mins)
{
    int sc[8], mn[8];
    for (int k = 0; k < 8; k++)
        k_scale_min(scales, k, &sc[k], &mn[k]);
    int mins_i = 0;
    for (int g = 0; g < 16; g++)
        mins_i += a->bsums[g] * mn[g / 2];
    int32_t lanes[8] = { 0 };
    for (int e = 0; e < KERN_QK_K; e++)
        lanes[e & 7] += sc[e / 32] * (codes[e] * a->qs[e]);
    const float d = kvd_f16_to_f32(wd) * a->d;
    for (int l = 0; l < 8; l++)
        lanes_f[l] += d * (float)lanes[l];
    const float dmin = kvd_f16_to_f32(wdmin) * a->d;
    *mins -= dmin * (float)mins_i;
}

static float dot_q4_k(int64_t nb, const void *wv, const void *av)
{
    const struct kern_block_q4_k *w = wv;
    const struct kern_block_q8_k *a = av;
    float lanes_f[8] = { 0 }, mins = 0.0f;
    uint8_t codes[KERN_QK_K];
    for (int64_t i = 0; i < nb; i++) {
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                codes[64 * c + l] = w[i].qs[32 * c + l] & 0x0F;
                codes[64 * c + 32 + l] = w[i].qs[32 * c + l] >> 4;
            }
        k_accum_kx(codes, w[i].scales, w[i].d, w[i].dmin, &a[i], lanes_f, &mins);
    }
    return k_finish(mins, lanes_f);
}

static float dot_q5_k(int64_t nb, const void *wv, const void *av)
{
    const struct kern_block_q5_k *w = wv;
    const struct kern_block_q8_k *a = av;
    float lanes_f[8] = { 0 }, mins = 0.0f;
    uint8_t codes[KERN_QK_K];
    for (int64_t i = 0; i < nb; i++) {
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                const uint8_t q = w[i].qs[32 * c + l], h = w[i].qh[l];
                codes[64 * c + l] = (uint8_t)((q & 0x0F) | ((h >> (2 * c)) & 1) << 4);
                codes[64 * c + 32 + l] = (uint8_t)((q >> 4) | ((h >> (2 * c + 1)) & 1) << 4);
            }
        k_accum_kx(codes, w[i].scales, w[i].d, w[i].dmin, &a[i], lanes_f, &mins);
    }
    return k_finish(mins, lanes_f);
}

static float dot_q6_k(int64_t nb, const void *wv, const void *av)
{
    const struct kern_block_q6_k *w = wv;
    const struct kern_block_q8_k *a = av;
    float lanes_f[8] = { 0 };
    for (int64_t i = 0; i < nb; i++) {
        int32_t lanes[8] = { 0 };
        int8_t v[KERN_QK_K];
        q6_values(&w[i], v);
        for (int e = 0; e < KERN_QK_K; e++)
            lanes[e & 7] += w[i].scales[e / 16] * (v[e] * a[i].qs[e]);
        const float d = kvd_f16_to_f32(w[i].d) * a[i].d;
        for (int l = 0; l < 8; l++)
            lanes_f[l] += d * (float)lanes[l];
    }
    return k_finish(0.0f, lanes_f);
}

/* ---- the float types ------------------------------------------------------ */

static void deq_float(uint32_t type, const void *src, float *dst, int64_t n)
{
    if (type == KERN_F32) {
        memmove(dst, src, (size_t)n * sizeof(float));
    } else if (type == KERN_F16) {
        const kvd_f16 *h = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = kvd_f16_to_f32(h[i]);
    } else {
        const kvd_bf16 *h = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = kvd_bf16_to_f32(h[i]);
    }
}

/* Float weight row with an F32 activation row: converted 32 at a time,
 * products rounded to float and summed in double, in element order (as
 * ggml's generic f16/f32 dot). */
static float dot_float(uint32_t type, int64_t n, const void *w, const float *a)
{
    const size_t esz = type == KERN_F32 ? 4 : 2;
    float buf[32];
    double sum = 0.0;
    for (int64_t i = 0; i < n; i += 32) {
        const int64_t m = n - i < 32 ? n - i : 32;
        deq_float(type, (const uint8_t *)w + (size_t)i * esz, buf, m);
        for (int64_t j = 0; j < m; j++)
            sum += (double)(buf[j] * a[i + j]);
    }
    return (float)sum;
}

/* ---- the type table -------------------------------------------------------- */

struct qtraits {
    uint32_t type;                  /* enum kern_type */
    uint32_t block;                 /* elements per block */
    size_t bytes;                   /* bytes per block */
    void (*deq)(const void *blk, float *y);     /* one block to floats */
    void (*quant)(const float *x, void *blk);   /* floats to one block */
    uint32_t act;                   /* vec dot type, or KERN_TYPE_LIMIT */
    float (*dot)(int64_t nb, const void *w, const void *a); /* nb blocks */
};

static const struct qtraits qtable[] = {
    { KERN_Q4_0, 32, sizeof(struct kern_block_q4_0), deq_q4_0, quant_q4_0, KERN_Q8_0, dot_q4_0 },
    { KERN_Q4_1, 32, sizeof(struct kern_block_q4_1), deq_q4_1, quant_q4_1, KERN_Q8_1, dot_q4_1 },
    { KERN_Q5_0, 32, sizeof(struct kern_block_q5_0), deq_q5_0, quant_q5_0, KERN_Q8_0, dot_q5_0 },
    { KERN_Q5_1, 32, sizeof(struct kern_block_q5_1), deq_q5_1, quant_q5_1, KERN_Q8_1, dot_q5_1 },
    { KERN_Q8_0, 32, sizeof(struct kern_block_q8_0), deq_q8_0, quant_q8_0, KERN_Q8_0, dot_q8_0 },
    { KERN_Q8_1, 32, sizeof(struct kern_block_q8_1), deq_q8_1, quant_q8_1, KERN_TYPE_LIMIT, NULL },
    { KERN_Q4_K, 256, sizeof(struct kern_block_q4_k), deq_q4_k, quant_q4_k, KERN_Q8_K, dot_q4_k },
    { KERN_Q5_K, 256, sizeof(struct kern_block_q5_k), deq_q5_k, quant_q5_k, KERN_Q8_K, dot_q5_k },
    { KERN_Q6_K, 256, sizeof(struct kern_block_q6_k), deq_q6_k, quant_q6_k, KERN_Q8_K, dot_q6_k },
    { KERN_Q8_K, 256, sizeof(struct kern_block_q8_k), deq_q8_k, quant_q8_k, KERN_TYPE_LIMIT, NULL },
};

static const struct qtraits *qtraits_of(uint32_t type)
{
    for (size_t i = 0; i < sizeof(qtable) / sizeof(qtable[0]); i++)
        if (qtable[i].type == type)
            return &qtable[i];
    return NULL;
}

static bool is_float_type(uint32_t type)
{
    return type == KERN_F32 || type == KERN_F16 || type == KERN_BF16;
}

/* ---- public entry points --------------------------------------------------- */

int kern_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n)
{
    if (is_float_type(type)) {
        if (n < 0)
            return KVD_EINVAL;
        deq_float(type, src, dst, n);
        return 0;
    }
    const struct qtraits *qt = qtraits_of(type);
    if (qt == NULL)
        return KVD_EUNSUPPORTED;
    if (n < 0 || n % qt->block != 0)
        return KVD_EINVAL;
    const uint8_t *p = src;
    for (int64_t i = 0; i < n / qt->block; i++)
        qt->deq(p + (size_t)i * qt->bytes, dst + i * qt->block);
    return 0;
}

int kern_quantize_row(uint32_t type, const float *src, void *dst, int64_t n)
{
    if (is_float_type(type)) {
        if (n < 0)
            return KVD_EINVAL;
        if (type == KERN_F32) {
            memmove(dst, src, (size_t)n * sizeof(float));
        } else if (type == KERN_F16) {
            kvd_f16 *h = dst;
            for (int64_t i = 0; i < n; i++)
                h[i] = kvd_f32_to_f16(src[i]);
        } else {
            kvd_bf16 *h = dst;
            for (int64_t i = 0; i < n; i++)
                h[i] = f32_to_bf16(src[i]);
        }
        return 0;
    }
    const struct qtraits *qt = qtraits_of(type);
    if (qt == NULL)
        return KVD_EUNSUPPORTED;
    if (n < 0 || n % qt->block != 0)
        return KVD_EINVAL;
    uint8_t *p = dst;
    for (int64_t i = 0; i < n / qt->block; i++)
        qt->quant(src + i * qt->block, p + (size_t)i * qt->bytes);
    return 0;
}

uint32_t kern_vec_dot_type(uint32_t wtype)
{
    if (is_float_type(wtype))
        return KERN_F32;
    const struct qtraits *qt = qtraits_of(wtype);
    return qt != NULL ? qt->act : KERN_TYPE_LIMIT;
}

size_t kern_act_row_bytes(uint32_t act_type, int64_t n)
{
    switch (act_type) {
    case KERN_F32: case KERN_Q8_0: case KERN_Q8_1: case KERN_Q8_K:
        return kern_row_bytes(act_type, n);
    default:
        return 0;
    }
}

void kern_quantize_act(uint32_t act_type, const float *src, void *dst, int64_t n)
{
    if (kern_act_row_bytes(act_type, n) == 0)
        return;
#if defined(__x86_64__)
    if (kern_isa() >= KERN_ISA_AVX512VNNI && kern_quantize_act_avx512(act_type, src, dst, n))
        return;
    if (kern_isa() >= KERN_ISA_AVX2 && kern_quantize_act_avx2(act_type, src, dst, n))
        return;
#endif
    (void)kern_quantize_row(act_type, src, dst, n);
}

/* A resolved dot product: the function plus the row geometry. */
struct dotplan {
    uint32_t wtype;                 /* weight type */
    const struct qtraits *qt;       /* NULL for float weight types */
    int64_t nb;                     /* blocks per row (quantized types) */
};

/* Fills *p for rows of n elements of wtype; false when there is no dot
 * product for that type and length. */
static bool dot_plan(uint32_t wtype, int64_t n, struct dotplan *p)
{
    p->wtype = wtype;
    p->qt = NULL;
    p->nb = 0;
    if (n < 0)
        return false;
    if (is_float_type(wtype))
        return true;
    p->qt = qtraits_of(wtype);
    if (p->qt == NULL || p->qt->dot == NULL || n % p->qt->block != 0)
        return false;
    p->nb = n / p->qt->block;
    return true;
}

static inline float dot_run(const struct dotplan *p, int64_t n, const void *w, const void *a)
{
    if (p->qt == NULL)
        return dot_float(p->wtype, n, w, a);
    return p->qt->dot(p->nb, w, a);
}

float kern_vec_dot(uint32_t wtype, int64_t n, const void *w_row, const void *act_row)
{
    struct dotplan p;
    if (!dot_plan(wtype, n, &p))
        return NAN;
    return dot_run(&p, n, w_row, act_row);
}

void kern_matmul(uint32_t wtype, const void *w, int64_t rows, int64_t n,
                 const void *act, int64_t n_tok, size_t act_stride, float *out)
{
    if (rows <= 0 || n_tok <= 0)
        return;
    struct dotplan p;
    const uint32_t at = kern_vec_dot_type(wtype);
    const size_t wrow = kern_row_bytes(wtype, n);
    if (!dot_plan(wtype, n, &p) || (n > 0 && act_stride < kern_act_row_bytes(at, n))) {
        for (int64_t i = 0; i < rows * n_tok; i++)
            out[i] = NAN;
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = (const uint8_t *)w + (size_t)r * wrow;
        for (int64_t t = 0; t < n_tok; t++)
            out[t * rows + r] = dot_run(&p, n, wr, (const uint8_t *)act + (size_t)t * act_stride);
    }
}

/* ---- unpacked rows for the SIMD kernels ------------------------------------- */

int kern_unpack_kind(uint32_t wtype)
{
    switch (wtype) {
    case KERN_Q4_0: case KERN_Q5_0: case KERN_Q8_0: return KERN_UNPACK_S32;
    case KERN_Q4_1: case KERN_Q5_1: case KERN_Q4_K: case KERN_Q5_K: return KERN_UNPACK_U32M;
    case KERN_Q6_K: return KERN_UNPACK_S16;
    default: return KERN_UNPACK_NONE;
    }
}

/* Q4_K and Q5_K blocks begin alike: d, dmin, then the packed scales */
static_assert(offsetof(struct kern_block_q5_k, scales) == offsetof(struct kern_block_q4_k, scales) &&
                  offsetof(struct kern_block_q5_k, dmin) == offsetof(struct kern_block_q4_k, dmin),
              "Q4_K and Q5_K share their scales' layout");

void kern_unpack_k_scales(uint32_t wtype, const void *row, int64_t n, uint8_t *sc, uint8_t *mn, kvd_f16 *d,
                          kvd_f16 *dmin)
{
    const size_t bytes = kern_row_bytes(wtype, KERN_QK_K);
    for (int64_t s = 0; s < n / KERN_QK_K; s++) {
        const uint8_t *blk = (const uint8_t *)row + (size_t)s * bytes;
        if (wtype == KERN_Q6_K) {
            const struct kern_block_q6_k *b6 = (const void *)blk;
            memcpy(sc + 16 * s, b6->scales, 16);
            d[s] = b6->d;
            continue;
        }
        const struct kern_block_q4_k *b4 = (const void *)blk;
        d[s] = b4->d;
        dmin[s] = b4->dmin;
        for (int k = 0; k < 8; k++) {
            int a, b;
            k_scale_min(b4->scales, k, &a, &b);
            sc[8 * s + k] = (uint8_t)a;
            mn[8 * s + k] = (uint8_t)b;
        }
    }
}

void kern_unpack_row(uint32_t wtype, const void *row, int64_t n, int8_t *q, float *d, float *m)
{
    const int64_t nb = n / KERN_QK32;
    switch (wtype) {
    case KERN_Q4_0: {
        const struct kern_block_q4_0 *b = row;
        for (int64_t i = 0; i < nb; i++) {
            for (int j = 0; j < 16; j++) {
                q[32 * i + j] = (int8_t)((b[i].qs[j] & 0x0F) - 8);
                q[32 * i + j + 16] = (int8_t)((b[i].qs[j] >> 4) - 8);
            }
            d[i] = kvd_f16_to_f32(b[i].d);
        }
        break;
    }
    case KERN_Q5_0: {
        const struct kern_block_q5_0 *b = row;
        for (int64_t i = 0; i < nb; i++) {
            const uint32_t qh = load_le32(b[i].qh);
            for (int j = 0; j < 32; j++)
                q[32 * i + j] = (int8_t)(q5_code(b[i].qs, qh, j) - 16);
            d[i] = kvd_f16_to_f32(b[i].d);
        }
        break;
    }
    case KERN_Q8_0: {
        const struct kern_block_q8_0 *b = row;
        for (int64_t i = 0; i < nb; i++) {
            memcpy(q + 32 * i, b[i].qs, 32);
            d[i] = kvd_f16_to_f32(b[i].d);
        }
        break;
    }
    case KERN_Q4_1: {
        const struct kern_block_q4_1 *b = row;
        for (int64_t i = 0; i < nb; i++) {
            for (int j = 0; j < 16; j++) {
                q[32 * i + j] = (int8_t)(b[i].qs[j] & 0x0F);
                q[32 * i + j + 16] = (int8_t)(b[i].qs[j] >> 4);
            }
            d[i] = kvd_f16_to_f32(b[i].d);
            m[i] = kvd_f16_to_f32(b[i].m);
        }
        break;
    }
    case KERN_Q5_1: {
        const struct kern_block_q5_1 *b = row;
        for (int64_t i = 0; i < nb; i++) {
            const uint32_t qh = load_le32(b[i].qh);
            for (int j = 0; j < 32; j++)
                q[32 * i + j] = (int8_t)q5_code(b[i].qs, qh, j);
            d[i] = kvd_f16_to_f32(b[i].d);
            m[i] = kvd_f16_to_f32(b[i].m);
        }
        break;
    }
    case KERN_Q4_K: case KERN_Q5_K: {
        const size_t bytes = wtype == KERN_Q4_K ? sizeof(struct kern_block_q4_k)
                                                : sizeof(struct kern_block_q5_k);
        for (int64_t s = 0; s < n / KERN_QK_K; s++) {
            const uint8_t *blk = (const uint8_t *)row + s * bytes;
            uint8_t *codes = (uint8_t *)q + s * KERN_QK_K;
            kvd_f16 bd, bdmin;
            const uint8_t *scales;
            if (wtype == KERN_Q4_K) {
                const struct kern_block_q4_k *b = (const void *)blk;
                for (int c = 0; c < 4; c++)
                    for (int l = 0; l < 32; l++) {
                        codes[64 * c + l] = b->qs[32 * c + l] & 0x0F;
                        codes[64 * c + 32 + l] = b->qs[32 * c + l] >> 4;
                    }
                bd = b->d, bdmin = b->dmin, scales = b->scales;
            } else {
                const struct kern_block_q5_k *b = (const void *)blk;
                for (int c = 0; c < 4; c++)
                    for (int l = 0; l < 32; l++) {
                        const uint8_t v = b->qs[32 * c + l], h = b->qh[l];
                        codes[64 * c + l] = (uint8_t)((v & 0x0F) | ((h >> (2 * c)) & 1) << 4);
                        codes[64 * c + 32 + l] = (uint8_t)((v >> 4) | ((h >> (2 * c + 1)) & 1) << 4);
                    }
                bd = b->d, bdmin = b->dmin, scales = b->scales;
            }
            const float fd = kvd_f16_to_f32(bd), fmin = kvd_f16_to_f32(bdmin);
            for (int k = 0; k < 8; k++) {
                int sc, mn;
                k_scale_min(scales, k, &sc, &mn);
                d[8 * s + k] = fd * (float)sc;
                m[8 * s + k] = -fmin * (float)mn;
            }
        }
        break;
    }
    case KERN_Q6_K: {
        const struct kern_block_q6_k *b = row;
        for (int64_t s = 0; s < n / KERN_QK_K; s++) {
            q6_values(&b[s], q + s * KERN_QK_K);
            const float fd = kvd_f16_to_f32(b[s].d);
            for (int k = 0; k < 16; k++)
                d[16 * s + k] = fd * (float)b[s].scales[k];
        }
        break;
    }
    default:
        break;
    }
}

int kern_act_blocks(uint32_t act_type, const void *row, int64_t n, uint32_t *offs, float *da, float *sa)
{
    const int64_t nb = n / KERN_QK32;
    switch (act_type) {
    case KERN_Q8_0: {
        const struct kern_block_q8_0 *b = row;
        for (int64_t i = 0; i < nb; i++) {
            if (offs)
                offs[i] = (uint32_t)(i * sizeof(*b) + offsetof(struct kern_block_q8_0, qs));
            da[i] = kvd_f16_to_f32(b[i].d);
            sa[i] = 0.0f;
        }
        return 0;
    }
    case KERN_Q8_1: {
        const struct kern_block_q8_1 *b = row;
        for (int64_t i = 0; i < nb; i++) {
            if (offs)
                offs[i] = (uint32_t)(i * sizeof(*b) + offsetof(struct kern_block_q8_1, qs));
            da[i] = kvd_f16_to_f32(b[i].d);
            sa[i] = kvd_f16_to_f32(b[i].s);
        }
        return 0;
    }
    case KERN_Q8_K: {
        const struct kern_block_q8_k *b = row;
        for (int64_t i = 0; i < nb; i++) {
            const struct kern_block_q8_k *s = &b[i / 8];
            const int k = (int)(i % 8);
            if (offs)
                offs[i] = (uint32_t)((i / 8) * sizeof(*b) + offsetof(struct kern_block_q8_k, qs) +
                                     (size_t)k * 32);
            da[i] = s->d;
            sa[i] = s->d * (float)(s->bsums[2 * k] + s->bsums[2 * k + 1]);
        }
        return 0;
    }
    default:
        return KVD_EUNSUPPORTED;
    }
}
