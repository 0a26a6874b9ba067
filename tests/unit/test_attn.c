/*
 * test_attn.c - grouped paged attention: the SIMD path against the C
 * reference (within a tolerance) over f16 and f32 caches, several group sizes
 * and context lengths not multiple of the block; and grouping invariance:
 * heads run together give the same bits as heads run one by one.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "check.h"
#include "cpu.h"
#include "f16.h"
#include "types.h"

#define HD 64
#define BT 16
#define NB 80          /* blocks in the cache */
#define KVH 2          /* KV heads per block */

static float frand(void) { return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f; }

int main(void)
{
    srand(5);
    const int ctxs[] = { 1, 7, 16, 33, 300, 1200 };
    const int groups[] = { 1, 3, 4 };
    for (int dt = 0; dt < 2; dt++) {
        const uint32_t dtype = dt ? KERN_F32 : KERN_F16;
        const size_t elem = dt ? 4 : 2;
        const size_t head_stride = (size_t)BT * HD * elem, block_stride = 2 * KVH * head_stride;
        uint8_t *mem = malloc(NB * block_stride);
        for (size_t i = 0; i < NB * block_stride / elem; i++) {
            float v = frand() * 2.0f;
            if (dt) {
                memcpy(mem + i * 4, &v, 4);
            } else {
                kvd_f16 h = kvd_f32_to_f16(v);
                memcpy(mem + i * 2, &h, 2);
            }
        }
        uint32_t blocks[NB];
        for (int i = 0; i < NB; i++)
            blocks[i] = (uint32_t)((i * 37 + 11) % NB);
        for (size_t ci = 0; ci < sizeof(ctxs) / sizeof(ctxs[0]); ci++)
            for (size_t gi = 0; gi < sizeof(groups) / sizeof(groups[0]); gi++) {
                const int n_ctx = ctxs[ci], G = groups[gi];
                float q[4 * HD], ref[4 * HD], got[4 * HD], one[HD];
                float *scores = malloc((size_t)4 * n_ctx * sizeof(float));
                for (int i = 0; i < G * HD; i++)
                    q[i] = frand() * 3.0f;
                struct kern_attn_args a = {
                    .out = ref, .q = q, .n_q = G, .k_base = mem, .v_base = mem + KVH * head_stride,
                    .blocks = blocks, .n_ctx = n_ctx, .block_tokens = BT, .head_dim = HD,
                    .kv_head = 1, .block_stride = block_stride, .head_stride = head_stride,
                    .kv_dtype = dtype, .scale = 0.125f, .scores = scores,
                };
                kern_attn_isa(&a, KERN_ISA_C);
                double worst = 0;
                for (int isa = KERN_ISA_AVX2; isa <= (int)kern_isa_best(); isa++) {
                    a.out = got;
                    kern_attn_isa(&a, isa);
                    for (int i = 0; i < G * HD; i++)
                        worst = fmax(worst, fabs(got[i] - ref[i]) / (fabs(ref[i]) + 0.05));
                    /* grouping invariance */
                    for (int g = 0; g < G; g++) {
                        struct kern_attn_args b = a;
                        b.out = one;
                        b.q = q + g * HD;
                        b.n_q = 1;
                        kern_attn_isa(&b, isa);
                        CHECK(memcmp(one, got + g * HD, sizeof(one)) == 0);
                    }
                }
                if (worst > 2e-3)
                    fprintf(stderr, "%s ctx %d group %d: worst relative difference %.2e\n",
                            dt ? "f32" : "f16", n_ctx, G, worst);
                CHECK(worst <= 2e-3);
                free(scores);
            }
        free(mem);
    }
    return CHECK_DONE();
}
