/* attn.c - dispatch of grouped attention; the C path is kern_attn_paged per head. */
#include "attn.h"

#include <stddef.h>

#include "cpu.h"
#include "ops.h"

void kern_attn_isa(const struct kern_attn_args *a, int isa)
{
#if defined(__x86_64__)
    if (isa >= KERN_ISA_AVX2 && kern_attn_avx2(a))
        return;
#endif
    for (int i = 0; i < a->n_q; i++)
        kern_attn_paged(a->out + (size_t)i * a->head_dim, a->q + (size_t)i * a->head_dim, a->k_base,
                        a->v_base, a->blocks, a->n_ctx, a->block_tokens, a->head_dim, a->kv_head,
                        a->block_stride, a->head_stride, a->kv_dtype, a->scale, a->scores);
}

void kern_attn(const struct kern_attn_args *a)
{
    kern_attn_isa(a, kern_isa());
}
