/* attn.c - grouped paged attention: the C reference (kern_attn_paged, one
 * head at a time), the dispatch to the SIMD paths, and the merge of split
 * position ranges. */
#include "attn.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#include "cpu.h"
#include "f16.h"
#include "ops.h"
#include "quant.h"
#include "types.h"

void kern_attn_paged(const struct kern_attn_args *a, int i)
{
    const int hd = a->head_dim, n_ctx = a->n_ctx;
    const size_t k_row = kern_row_bytes(a->k_type, hd), v_row = kern_row_bytes(a->v_type, hd);
    const float *q = a->q + (size_t)i * hd;
    float *out = a->out + (size_t)i * hd, *scores = a->scores;
    float qh[KERN_MAX_HEAD_DIM], row[KERN_MAX_HEAD_DIM];
    uint8_t qq[KERN_MAX_HEAD_DIM / KERN_QK32 * sizeof(struct kern_block_q8_0)];
    const bool k_quant = a->k_type == KERN_Q8_0 || a->k_type == KERN_Q4_0;
    if (a->k_type == KERN_F16) {
        for (int d = 0; d < hd; d++)
            qh[d] = kvd_f16_to_f32(kvd_f32_to_f16(q[d]));
        q = qh;
    } else if (a->k_type == KERN_BF16) {
        kvd_bf16 qb[KERN_MAX_HEAD_DIM];
        kern_quantize_row(KERN_BF16, q, qb, hd);
        for (int d = 0; d < hd; d++)
            qh[d] = kvd_bf16_to_f32(qb[d]);
        q = qh;
    } else if (k_quant) {
        kern_quantize_act(KERN_Q8_0, q, qq, hd);
    }
    float max = -INFINITY;
    const int j0 = a->skip > 0 ? a->skip : 0;
    for (int j = j0; j < n_ctx; j++) {
        const uint8_t *k = kern_attn_row(a, a->k_base, a->k_head_stride, k_row, j);
        float s = 0.0f;
        if (k_quant) {
            s = kern_vec_dot(a->k_type, hd, k, qq);
        } else {
            kern_dequantize_row(a->k_type, k, row, hd);
            for (int d = 0; d < hd; d++)
                s += q[d] * row[d];
        }
        s *= a->scale;
        scores[j] = s;
        if (s > max)
            max = s;
    }
    double sum = 0.0;
    for (int j = j0; j < n_ctx; j++) {
        float e = expf(scores[j] - max);
        scores[j] = e;
        sum += e;
    }
    const float inv = (float)(1.0 / sum);
    if (a->stats != NULL) {
        a->stats[2 * i] = max;
        a->stats[2 * i + 1] = (float)sum;
    }
    const bool half = a->v_type == KERN_F16, bhalf = a->v_type == KERN_BF16;
    for (int d = 0; d < hd; d++)
        out[d] = 0.0f;
    for (int j = j0; j < n_ctx; j++) {
        kern_dequantize_row(a->v_type, kern_attn_row(a, a->v_base, a->v_head_stride, v_row, j), row, hd);
        float p = half ? kvd_f16_to_f32(kvd_f32_to_f16(scores[j] * inv)) : scores[j] * inv;
        if (bhalf) {
            kvd_bf16 pb;
            kern_quantize_row(KERN_BF16, &p, &pb, 1);
            p = kvd_bf16_to_f32(pb);
        }
        for (int d = 0; d < hd; d++)
            out[d] += p * row[d];
    }
}

/* Each position's sixteen scores, a block of V rows as floats, and room to align them. */
size_t kern_attn_multi_scratch(int n_ctx, int head_dim)
{
    (void)head_dim;
    return ((size_t)n_ctx * KERN_ATTN_LANES + KERN_ATTN_V_BLOCK) * sizeof(float) + 64;
}

bool kern_attn_multi_ok(uint32_t k_type, uint32_t v_type, int head_dim)
{
#if defined(__x86_64__)
    return kern_isa() >= KERN_ISA_AVX512VNNI && (head_dim == 64 || head_dim == 128 || head_dim == 256) &&
           (k_type == KERN_F16 || k_type == KERN_F32 || (k_type == KERN_BF16 && kern_avx512bf16())) &&
           (v_type == KERN_F16 || v_type == KERN_F32 || (v_type == KERN_BF16 && kern_avx512bf16()) ||
            v_type == KERN_Q8_0 || v_type == KERN_Q4_0);
#else
    (void)k_type;
    (void)v_type;
    (void)head_dim;
    return false;
#endif
}

uint32_t kern_attn_kv_auto(void)
{
    if (kern_amx_bf16() || (kern_avx512bf16() && kern_cpu_amd()))
        return KERN_BF16;
    return KERN_F16;
}

int kern_attn_multi_min(uint32_t k_type, uint32_t v_type, int head_dim)
{
    if (!kern_attn_multi_ok(k_type, v_type, head_dim))
        return 0;
#if defined(__x86_64__)
    /* the tiles: one pass costs about what one call's does (bench-attn: two
     * tokens of three heads in one call, 1.8x each alone) */
    if (kern_amx_bf16() && k_type == KERN_BF16 && v_type == KERN_BF16)
        return 2;
#endif
    return 4;   /* AVX-512: four tokens of three heads 1.1x, three 0.9x */
}

int kern_attn_multi(const struct kern_attn_args *a, const struct kern_attn_query *qs, int nq, void *scratch)
{
#if defined(__x86_64__)
    if (kern_isa() >= KERN_ISA_AVX512VNNI)
        return kern_attn_amx_multi(a, qs, nq, scratch) || kern_attn_avx512_multi(a, qs, nq, scratch);
#else
    (void)a;
    (void)qs;
    (void)nq;
    (void)scratch;
#endif
    return 0;
}

void kern_attn_isa(const struct kern_attn_args *a, int isa)
{
#if defined(__x86_64__)
    if (isa >= KERN_ISA_AVX512VNNI && (kern_attn_amx(a) || kern_attn_avx512(a)))
        return;
    if (isa >= KERN_ISA_AVX2 && kern_attn_avx2(a))
        return;
#elif defined(__aarch64__)
    if (isa >= KERN_ISA_NEON && kern_attn_neon(a))
        return;
#endif
    for (int i = 0; i < a->n_q; i++)
        kern_attn_paged(a, i);
}

void kern_attn(const struct kern_attn_args *a)
{
    kern_attn_isa(a, kern_isa());
}

void kern_attn_merge(float *out, const float *outs, size_t stride, const float *stats, size_t sstride,
                     int n, int head_dim)
{
    float M = stats[0];
    for (int i = 1; i < n; i++)
        M = stats[i * sstride] > M ? stats[i * sstride] : M;
    double total = 0.0;
    for (int i = 0; i < n; i++)
        total += (double)stats[i * sstride + 1] * exp((double)stats[i * sstride] - M);
    for (int d = 0; d < head_dim; d++)
        out[d] = 0.0f;
    for (int i = 0; i < n; i++) {
        const float w = (float)((double)stats[i * sstride + 1] * exp((double)stats[i * sstride] - M) / total);
        for (int d = 0; d < head_dim; d++)
            out[d] += w * outs[i * stride + d];
    }
}
