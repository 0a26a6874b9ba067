/* attn.c - dispatch of grouped attention; the C path is kern_attn_paged per head. */
#include "attn.h"

#include <math.h>
#include <stddef.h>

#include "cpu.h"
#include "ops.h"

void kern_attn_isa(const struct kern_attn_args *a, int isa)
{
#if defined(__x86_64__)
    if (isa >= KERN_ISA_AVX512VNNI && kern_attn_avx512(a))
        return;
    if (isa >= KERN_ISA_AVX2 && kern_attn_avx2(a))
        return;
#endif
    for (int i = 0; i < a->n_q; i++)
        kern_attn_paged(a->out + (size_t)i * a->head_dim, a->q + (size_t)i * a->head_dim, a->k_base,
                        a->v_base, a->blocks, a->n_ctx, a->block_tokens, a->head_dim, a->kv_head,
                        a->block_stride, a->head_stride, a->kv_dtype, a->scale, a->scores,
                        a->stats ? a->stats + 2 * i : NULL);
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
