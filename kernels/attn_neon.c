/*
 * attn_neon.c - grouped paged attention on aarch64: Advanced SIMD with the
 * dot-product extension (built with +dotprod, called where kern_isa() found
 * it).
 *
 * The x86 AVX2 path's design in 128-bit registers. For each group of query
 * heads: scores q.k * scale, each K row read once for the group (f16 rows
 * converted in registers, products in two four-lane accumulators); softmax
 * with the exponentials four at a time and their sum in double; then
 * out += p * v in position order, in passes of up to three heads x 32
 * dimensions whose sums stay in registers over all positions, each V row
 * read once for the group (rows addressed a block at a time: no division per
 * position). Over an
 * f16 cache q and p are rounded to f16 first, as in the C reference. Over a
 * q8_0 or q4_0 K the query is quantized to q8_0 and each block's integer dot
 * product comes from sdot, exact, then the scaled block sums are added with
 * the C reference's float operations in its order, so the scores are its
 * bits; a q8_0 or q4_0 V row is dequantized in registers (d * code).
 */
#if defined(__aarch64__)
#include <arm_neon.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "attn.h"
#include "f16.h"
#include "ops.h"
#include "quant.h"
#include "types.h"

static inline bool quantized(uint32_t t) { return t == KERN_Q8_0 || t == KERN_Q4_0; }

/* The f16 scale at the start of a q8_0 / q4_0 block, as a float. */
static inline float block_scale(const uint8_t *blk)
{
    uint16_t h;
    memcpy(&h, blk, 2);
    return kvd_f16_to_f32(h);
}

/* A K block's 32 codes as signed bytes (q4_0: nibble - 8), made once for
 * every head of the group, and its scale. */
struct kblock {
    int8x16_t lo, hi;
    float d;
};

static inline void kblock_load(struct kblock *kb, const uint8_t *blk, uint32_t type)
{
    kb->d = block_scale(blk);
    if (type == KERN_Q8_0) {
        kb->lo = vld1q_s8((const int8_t *)blk + 2);
        kb->hi = vld1q_s8((const int8_t *)blk + 18);
        return;
    }
    /* q4_0: values 0..15 in the low nibbles, 16..31 in the high ones */
    const uint8x16_t x = vld1q_u8(blk + 2);
    const int8x16_t eight = vdupq_n_s8(8);
    kb->lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(x, vdupq_n_u8(0x0F))), eight);
    kb->hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(x, 4)), eight);
}

/* The exact integer dot product of a K block with the query's 32 codes. */
static inline int block_dot(const struct kblock *kb, const int8_t *q)
{
    int32x4_t acc = vdotq_s32(vdupq_n_s32(0), kb->lo, vld1q_s8(q));
    acc = vdotq_s32(acc, kb->hi, vld1q_s8(q + 16));
    return vaddvq_s32(acc);
}

/* Four elements of a K/V row as floats. */
static inline float32x4_t load4(const uint8_t *row, int d, bool half)
{
    if (half)
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)row + d)));
    return vld1q_f32((const float *)row + d);
}

/* e^x for x <= 0 (softmax arguments), four at a time: x = k ln2 + r with
 * |r| <= ln2/2, e^r by a degree-6 polynomial, 2^k into the exponent. Below
 * -87 the result is 0. Within 2 ulp of expf. */
static inline float32x4_t exp4(float32x4_t x)
{
    const float32x4_t lo = vdupq_n_f32(-87.0f);
    const uint32x4_t under = vcltq_f32(x, lo);
    x = vmaxq_f32(x, lo);
    const float32x4_t k = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
    float32x4_t r = vfmsq_f32(x, k, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, k, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(k), vdupq_n_s32(127)), 23);
    return vreinterpretq_f32_u32(
        vbicq_u32(vreinterpretq_u32_f32(vmulq_f32(p, vreinterpretq_f32_s32(e))), under));
}

static inline float32x4_t round_half4(float32x4_t x) { return vcvt_f32_f16(vcvt_f16_f32(x)); }

static inline float round_half(float x) { return kvd_f16_to_f32(kvd_f32_to_f16(x)); }

/* The V rows of a call, as the weighted sum reads them. */
struct vrows {
    const struct kern_attn_args *a;
    size_t row_bytes, blk;  /* blk: bytes per q8_0 / q4_0 block */
    uint32_t type;
    bool half;
};

/* Eight elements [d, d + 8) of a V row as floats; a q8_0 / q4_0 row
 * dequantized as kern_dequantize_row does (d * code). */
static inline void v_load8(const struct vrows *vr, const uint8_t *v, int d, float32x4_t *v0, float32x4_t *v1)
{
    if (!quantized(vr->type)) {
        *v0 = load4(v, d, vr->half);
        *v1 = load4(v, d + 4, vr->half);
        return;
    }
    const uint8_t *vb = v + (size_t)(d / 32) * vr->blk;
    const int e = d % 32;
    int8x8_t c;
    if (vr->type == KERN_Q8_0) {
        c = vld1_s8((const int8_t *)vb + 2 + e);
    } else {
        uint8x8_t x = vld1_u8(vb + 2 + e % 16);
        if (e >= 16)
            x = vshr_n_u8(x, 4);
        c = vsub_s8(vreinterpret_s8_u8(vand_u8(x, vdup_n_u8(0x0F))), vdup_n_s8(8));
    }
    const int16x8_t w = vmovl_s8(c);
    const float ds = block_scale(vb);
    *v0 = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), ds);
    *v1 = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(w))), ds);
}

/*
 * One pass of out = sum p v: NG heads (their probabilities p, rows n_ctx
 * apart) and the DN dimensions from d0, over positions [j0, n_ctx), the NG x
 * DN sums in registers throughout (at most 24 of the 32, with two for V and
 * three for p). Each lane takes one fma per position in position order, as
 * the C reference does.
 */
static inline __attribute__((always_inline)) void
v_pass(const struct vrows *vr, const float *p, float *out, int j0, const int NG, const int DN, int d0)
{
    const struct kern_attn_args *a = vr->a;
    const int bt = a->block_tokens;
    float32x4_t acc[3][8];
#pragma GCC unroll 3
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 8
        for (int i = 0; i < DN / 4; i++)
            acc[g][i] = vdupq_n_f32(0.0f);
    const uint8_t *v = NULL;
    for (int j = j0, left = 0; j < a->n_ctx; j++, v += vr->row_bytes, left--) {
        if (left == 0) {  /* a block's first row: one division per block, not per position */
            v = kern_attn_row(a, a->v_base, a->v_head_stride, vr->row_bytes, j);
            left = bt - j % bt;
        }
#pragma GCC unroll 4
        for (int i = 0; i < DN / 8; i++) {
            float32x4_t v0, v1;
            v_load8(vr, v, d0 + 8 * i, &v0, &v1);
#pragma GCC unroll 3
            for (int g = 0; g < NG; g++) {
                const float pg = p[(size_t)g * a->n_ctx + j];
                acc[g][2 * i] = vfmaq_n_f32(acc[g][2 * i], v0, pg);
                acc[g][2 * i + 1] = vfmaq_n_f32(acc[g][2 * i + 1], v1, pg);
            }
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 8
        for (int i = 0; i < DN / 4; i++)
            vst1q_f32(out + (size_t)g * a->head_dim + d0 + 4 * i, acc[g][i]);
}

#define MAX_Q 16  /* query heads handled per pass; larger groups loop */

int kern_attn_neon(const struct kern_attn_args *a)
{
    const int hd = a->head_dim;
    if (hd % 8 != 0 || hd > KERN_MAX_HEAD_DIM)
        return 0;
    for (int w = 0; w < 2; w++) {
        const uint32_t t = w ? a->v_type : a->k_type;
        if (t != KERN_F16 && t != KERN_F32 && !(quantized(t) && hd % 32 == 0))
            return 0;
    }
    const bool half = a->k_type == KERN_F16, v_half = a->v_type == KERN_F16;
    const bool k_quant = quantized(a->k_type), v_quant = quantized(a->v_type);
    const size_t row_bytes = kern_row_bytes(a->k_type, hd), v_row_bytes = kern_row_bytes(a->v_type, hd);
    const int nb = hd / 32;
    const size_t k_blk = k_quant ? row_bytes / (size_t)nb : 0, v_blk = v_quant ? v_row_bytes / (size_t)nb : 0;
    const int j0 = a->skip > 0 ? a->skip : 0;  /* [0, skip) is outside a sliding window */
    for (int q0 = 0; q0 < a->n_q; q0 += MAX_Q) {
        const int nq = a->n_q - q0 < MAX_Q ? a->n_q - q0 : MAX_Q;
        float qh[MAX_Q][KERN_MAX_HEAD_DIM];
        struct kern_block_q8_0 qq[MAX_Q][KERN_MAX_HEAD_DIM / 32];
        float qd[MAX_Q][KERN_MAX_HEAD_DIM / 32];
        float max[MAX_Q];
        for (int g = 0; g < nq; g++) {
            const float *q = a->q + (size_t)(q0 + g) * hd;
            if (k_quant) {
                kern_quantize_act(KERN_Q8_0, q, qq[g], hd);
                for (int b = 0; b < nb; b++)
                    qd[g][b] = kvd_f16_to_f32(qq[g][b].d);
            } else {
                for (int d = 0; d < hd; d += 4)
                    vst1q_f32(&qh[g][d], half ? round_half4(vld1q_f32(q + d)) : vld1q_f32(q + d));
            }
            max[g] = -INFINITY;
        }
        /* scores, reading each K row once for the group */
        const bool q8 = a->k_type == KERN_Q8_0;
        const int bt = a->block_tokens;
        const uint8_t *k = NULL;
        for (int j = j0, left = 0; j < a->n_ctx; j++, k += row_bytes, left--) {
            if (left == 0) {  /* a block's first row: one division per block, not per position */
                k = kern_attn_row(a, a->k_base, a->k_head_stride, row_bytes, j);
                left = bt - j % bt;
            }
            struct kblock kb[KERN_MAX_HEAD_DIM / 32];
            if (k_quant)
                for (int b = 0; b < nb; b++)
                    kblock_load(&kb[b], k + (size_t)b * k_blk, a->k_type);
            for (int g = 0; g < nq; g++) {
                float s;
                if (k_quant) {  /* kern_vec_dot's float operations, in its order */
                    s = 0.0f;
                    for (int b = 0; b < nb; b++) {
                        const float si = (float)block_dot(&kb[b], qq[g][b].qs);
                        s += q8 ? kb[b].d * qd[g][b] * si : si * kb[b].d * qd[g][b];
                    }
                } else {
                    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
                    for (int d = 0; d < hd; d += 8) {
                        acc0 = vfmaq_f32(acc0, vld1q_f32(&qh[g][d]), load4(k, d, half));
                        acc1 = vfmaq_f32(acc1, vld1q_f32(&qh[g][d + 4]), load4(k, d + 4, half));
                    }
                    s = vaddvq_f32(vaddq_f32(acc0, acc1));
                }
                s *= a->scale;
                a->scores[(size_t)g * a->n_ctx + j] = s;
                if (s > max[g])
                    max[g] = s;
            }
        }
        /* softmax per head: exponentials four at a time, their sum in double */
        for (int g = 0; g < nq; g++) {
            float *sc = a->scores + (size_t)g * a->n_ctx;
            const float32x4_t mx = vdupq_n_f32(max[g]);
            int j = j0;
            for (; j + 4 <= a->n_ctx; j += 4)
                vst1q_f32(sc + j, exp4(vsubq_f32(vld1q_f32(sc + j), mx)));
            for (; j < a->n_ctx; j++)
                sc[j] = vgetq_lane_f32(exp4(vdupq_n_f32(sc[j] - max[g])), 0);
            double sum = 0.0;
            for (j = j0; j < a->n_ctx; j++)
                sum += sc[j];
            const float inv = (float)(1.0 / sum);
            if (a->stats != NULL) {
                a->stats[2 * (q0 + g)] = max[g];
                a->stats[2 * (q0 + g) + 1] = (float)sum;
            }
            for (j = j0; j + 4 <= a->n_ctx; j += 4) {
                const float32x4_t p = vmulq_n_f32(vld1q_f32(sc + j), inv);
                vst1q_f32(sc + j, v_half ? round_half4(p) : p);
            }
            for (; j < a->n_ctx; j++)
                sc[j] = v_half ? round_half(sc[j] * inv) : sc[j] * inv;
        }
        /* out = sum p v, reading each V row once for the group */
        const struct vrows vr = { a, v_row_bytes, v_blk, a->v_type, v_half };
        for (int d0 = 0; d0 < hd;) {
            const int dn = hd - d0 >= 32 ? 32 : 8;
            for (int g = 0; g < nq; g += 3) {
                const int ng = nq - g >= 3 ? 3 : nq - g;
                float *out = a->out + (size_t)(q0 + g) * hd;
                const float *p = a->scores + (size_t)g * a->n_ctx;
                switch (ng * 64 + dn) {
                case 1 * 64 + 32: v_pass(&vr, p, out, j0, 1, 32, d0); break;
                case 2 * 64 + 32: v_pass(&vr, p, out, j0, 2, 32, d0); break;
                case 3 * 64 + 32: v_pass(&vr, p, out, j0, 3, 32, d0); break;
                case 1 * 64 + 8: v_pass(&vr, p, out, j0, 1, 8, d0); break;
                case 2 * 64 + 8: v_pass(&vr, p, out, j0, 2, 8, d0); break;
                default: v_pass(&vr, p, out, j0, 3, 8, d0); break;
                }
            }
            d0 += dn;
        }
    }
    return 1;
}
#endif
