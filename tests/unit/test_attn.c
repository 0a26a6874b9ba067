/*
 * test_attn.c - grouped paged attention: the SIMD path against the C
 * reference (within a tolerance) over f16, bf16 and f32 caches, several group sizes
 * and context lengths not multiple of the block; and grouping invariance:
 * heads run together give the same bits as heads run one by one. Over q8_0
 * and q4_0 caches (K and V of either type): every path against an exact
 * attention in double over the same quantized values (the query quantized to
 * q8_0 as the kernels do), and the SIMD paths' scores against the C
 * reference's bit for bit (integer dot products).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "check.h"
#include "cpu.h"
#include "f16.h"
#include "quant.h"
#include "types.h"

#define HD 64
#define BT 16
#define NB 80          /* blocks in the cache */
#define KVH 2          /* KV heads per block */

static float frand(void) { return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f; }

/* The attention of q over rows [from, n) of a quantized cache in double: the
 * reference every path is held to. */
static void attn_exact_q(double *out, const float *q, const uint8_t *kmem, const uint8_t *vmem,
                         const uint32_t *blocks, int from, int n, size_t k_row, size_t v_row, size_t k_head,
                         size_t v_head, size_t block_stride, uint32_t kt, uint32_t vt, double scale)
{
    uint8_t qq[HD / 32 * sizeof(struct kern_block_q8_0)];
    float qf[HD], kf[HD], vf[HD];
    kern_quantize_row(KERN_Q8_0, q, qq, HD);
    kern_dequantize_row(KERN_Q8_0, qq, qf, HD);
    double *s = malloc((size_t)n * sizeof(double)), mx = -INFINITY, sum = 0;
    for (int j = from; j < n; j++) {
        const size_t at = blocks[j / BT] * block_stride + k_head + (size_t)(j % BT) * k_row;
        kern_dequantize_row(kt, kmem + at, kf, HD);
        double d = 0;
        for (int i = 0; i < HD; i++)
            d += (double)qf[i] * kf[i];
        s[j] = d * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    for (int j = from; j < n; j++)
        sum += (s[j] = exp(s[j] - mx));
    for (int i = 0; i < HD; i++)
        out[i] = 0;
    for (int j = from; j < n; j++) {
        const size_t at = blocks[j / BT] * block_stride + v_head + (size_t)(j % BT) * v_row;
        kern_dequantize_row(vt, vmem + at, vf, HD);
        for (int i = 0; i < HD; i++)
            out[i] += s[j] / sum * vf[i];
    }
    free(s);
}

/* Caches of K and V of quantized types (q8_0, q4_0, and f16 beside them). */
static void test_quantized(void)
{
    const uint32_t types[][2] = { { KERN_Q8_0, KERN_Q8_0 }, { KERN_Q4_0, KERN_Q4_0 },
                                  { KERN_Q8_0, KERN_Q4_0 }, { KERN_Q4_0, KERN_Q8_0 } };
    const int ctxs[] = { 1, 15, 16, 33, 300, 1200 };
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
        const uint32_t kt = types[ti][0], vt = types[ti][1];
        const size_t k_row = kern_row_bytes(kt, HD), v_row = kern_row_bytes(vt, HD);
        const size_t k_head = BT * k_row, v_head = BT * v_row;
        const size_t block_stride = KVH * (k_head + v_head);
        uint8_t *mem = malloc(NB * block_stride);
        float row[HD];
        for (int b = 0; b < NB; b++)
            for (int h = 0; h < KVH; h++)
                for (int t = 0; t < BT; t++) {
                    for (int i = 0; i < HD; i++)    /* channel 5 an outlier, as real keys have */
                        row[i] = frand() * (i == 5 ? 8.0f : 1.0f);
                    kern_quantize_row(kt, row, mem + b * block_stride + h * k_head + t * k_row, HD);
                    for (int i = 0; i < HD; i++)
                        row[i] = frand();
                    kern_quantize_row(vt, row, mem + b * block_stride + KVH * k_head + h * v_head + t * v_row, HD);
                }
        uint32_t blocks[NB];
        for (int i = 0; i < NB; i++)
            blocks[i] = (uint32_t)((i * 37 + 11) % NB);
        for (size_t ci = 0; ci < 2 * sizeof(ctxs) / sizeof(ctxs[0]) * 3; ci++) {
            /* each context twice: whole, and as a sliding window that starts
             * inside its first block (skip); each with groups of 3, 1 and 5
             * heads (AVX2's score passes: 3, 1, then 2 + 3) */
            static const int groups[3] = { 3, 1, 5 };
            const int n_ctx = ctxs[ci / 6], G = groups[ci % 3];
            const int skip = ci / 3 % 2 && n_ctx > 11 ? 11 : 0;
            if (ci / 3 % 2 && skip == 0)
                continue;
            float q[5 * HD], ref[5 * HD], got[5 * HD], one[HD];
            double ex[5][HD];
            float stats[2 * 5], ref_stats[2 * 5];
            float *scores = malloc((size_t)5 * n_ctx * sizeof(float));
            for (int i = 0; i < G * HD; i++)
                q[i] = frand() * 3.0f;
            struct kern_attn_args a = {
                .out = ref, .q = q, .n_q = G, .k_base = mem, .v_base = mem + KVH * k_head,
                .blocks = blocks, .n_ctx = n_ctx, .block_tokens = BT, .head_dim = HD, .kv_head = 1,
                .block_stride = block_stride, .k_head_stride = k_head, .v_head_stride = v_head,
                .k_type = kt, .v_type = vt, .scale = 0.125f, .scores = scores, .skip = skip,
            };
            for (int g = 0; g < G; g++)
                attn_exact_q(ex[g], q + g * HD, mem, mem + KVH * k_head, blocks, skip, n_ctx, k_row, v_row,
                             k_head, v_head, block_stride, kt, vt, 0.125);
            for (int isa = KERN_ISA_C; isa <= (int)kern_isa_best(); isa++) {
                a.out = isa == KERN_ISA_C ? ref : got;
                a.stats = isa == KERN_ISA_C ? ref_stats : stats;
                kern_attn_isa(&a, isa);
#if defined(__aarch64__)
                /* the NEON path takes every shape here (no silent fall back to C) */
                if (isa != KERN_ISA_C)
                    CHECK(kern_attn_neon(&a));
#endif
                /* the largest score of each head: integer dot products, the same bits */
                if (isa != KERN_ISA_C)
                    for (int g = 0; g < G; g++)
                        CHECK(memcmp(&stats[2 * g], &ref_stats[2 * g], sizeof(float)) == 0);
                double worst = 0, norm = 0;
                for (int g = 0; g < G; g++)
                    for (int i = 0; i < HD; i++) {
                        worst = fmax(worst, fabs(a.out[g * HD + i] - ex[g][i]));
                        norm = fmax(norm, fabs(ex[g][i]));
                    }
                if (worst > 1e-4 * fmax(norm, 0.05))
                    fprintf(stderr, "K %s V %s ctx %d skip %d on %s: worst difference %.2e (output %.2e)\n",
                            kern_type_info(kt)->name, kern_type_info(vt)->name, n_ctx, skip,
                            kern_isa_name((enum kern_isa)isa), worst, norm);
                CHECK(worst <= 1e-4 * fmax(norm, 0.05));
                for (int g = 0; g < G; g++) {
                    struct kern_attn_args b = a;
                    b.out = one;
                    b.q = q + g * HD;
                    b.n_q = 1;
                    b.stats = NULL;
                    kern_attn_isa(&b, isa);
                    CHECK(memcmp(one, a.out + g * HD, sizeof(one)) == 0);
                }
            }
            free(scores);
        }
        free(mem);
    }
}

/* Other head dims: 40, not a multiple of 32 (a 32-wide V pass, then one of
 * 8), 32 (AVX2's score tiles at half width), 256 (Gemma 3's; AVX2's tiles
 * not unrolled), over groups of 4 (two passes of two heads) and 7 (3 + 2 +
 * 2): every path against the C reference, and grouping invariance. */
static void test_head_dim(int D, int G, uint32_t type)
{
    enum { NBLK = 8, DMAX = 256, GMAX = 7 };
    const size_t head_stride = (size_t)BT * D * 2, block_stride = 2 * KVH * head_stride;
    uint8_t *mem = malloc(NBLK * block_stride);
    for (size_t i = 0; i < NBLK * block_stride / 2; i++) {
        const float v = frand() * 2.0f;
        kern_quantize_row(type, &v, mem + i * 2, 1);
    }
    uint32_t blocks[NBLK];
    for (int i = 0; i < NBLK; i++)
        blocks[i] = (uint32_t)((i * 5 + 3) % NBLK);
    const int ctxs[] = { 1, 9, 33, NBLK * BT };
    for (size_t ci = 0; ci < sizeof(ctxs) / sizeof(ctxs[0]); ci++) {
        const int n_ctx = ctxs[ci];
        float q[GMAX * DMAX], ref[GMAX * DMAX], got[GMAX * DMAX], one[DMAX];
        float *scores = malloc((size_t)G * n_ctx * sizeof(float));
        for (int i = 0; i < G * D; i++)
            q[i] = frand() * 3.0f;
        struct kern_attn_args a = {
            .out = ref, .q = q, .n_q = G, .k_base = mem, .v_base = mem + KVH * head_stride, .blocks = blocks,
            .n_ctx = n_ctx, .block_tokens = BT, .head_dim = D, .kv_head = 1, .block_stride = block_stride,
            .k_head_stride = head_stride, .v_head_stride = head_stride, .k_type = type, .v_type = type,
            .scale = 0.15f, .scores = scores,
        };
        kern_attn_isa(&a, KERN_ISA_C);
        for (int isa = KERN_ISA_SIMD; isa <= (int)kern_isa_best(); isa++) {
            a.out = got;
            kern_attn_isa(&a, isa);
            double worst = 0;
            for (int i = 0; i < G * D; i++)
                worst = fmax(worst, fabs(got[i] - ref[i]) / (fabs(ref[i]) + 0.05));
            if (worst > 2e-3)
                fprintf(stderr, "head_dim %d (%s) ctx %d on %s: worst relative difference %.2e\n", D,
                        kern_type_info(type)->name, n_ctx, kern_isa_name((enum kern_isa)isa), worst);
            CHECK(worst <= 2e-3);
            for (int g = 0; g < G; g++) {
                struct kern_attn_args b = a;
                b.out = one;
                b.q = q + g * D;
                b.n_q = 1;
                kern_attn_isa(&b, isa);
                CHECK(memcmp(one, got + g * D, (size_t)D * sizeof(float)) == 0);
            }
        }
        free(scores);
    }
    free(mem);
}

/* Whether query q of a kern_attn_multi call over m has the bits kern_attn
 * gives it alone (over m's blocks from its first, its skip): output, and
 * stats where it asked for them. one: head_dim floats; scores: n_ctx. */
static bool same_as_alone(const struct kern_attn_args *m, const struct kern_attn_query *q, float *one,
                          float *scores)
{
    float one_st[2];
    struct kern_attn_args b = *m;
    b.blocks = m->blocks + q->first / BT;
    b.q = q->q;
    b.out = one;
    b.n_q = 1;
    b.n_ctx = q->n_ctx - q->first;
    b.skip = q->skip > q->first ? q->skip - q->first : 0;
    b.scores = scores;
    b.stats = one_st;
    kern_attn_isa(&b, KERN_ISA_AVX512VNNI);
    return memcmp(one, q->out, (size_t)m->head_dim * sizeof(float)) == 0 &&
           (q->stats == NULL || memcmp(one_st, q->stats, sizeof(one_st)) == 0);
}

/* Sliding-window tiles: tokens at consecutive positions, each attending its
 * last W positions (kern_attn_query's first and skip), against kern_attn
 * over the token's own first block with its skip, as the engine calls it
 * for a windowed layer. Returns the queries checked. */
static int check_windows(const struct kern_attn_args *a, int G, int nctx_max)
{
    const int D = a->head_dim, T = 16 / G, nq = T * G;
    const int wins[] = { 5, 20, 100, 257 };
    float *q = malloc((size_t)nq * D * sizeof(float)), *got = malloc((size_t)nq * D * sizeof(float));
    float *one = malloc((size_t)D * sizeof(float)), st[2 * 16];
    float *scores = malloc((size_t)nctx_max * sizeof(float));
    void *scratch = malloc(kern_attn_multi_scratch(nctx_max, D));
    int cases = 0;
    for (size_t wi = 0; wi < sizeof(wins) / sizeof(wins[0]); wi++)
        for (int rep = 0; rep < 3; rep++) {
            const int W = wins[wi], pos0 = rep == 0 ? W / 2 : rep == 1 ? W + 7 : nctx_max - T;
            struct kern_attn_query qs[16];
            for (int i = 0; i < nq * D; i++)
                q[i] = frand() * 3.0f;
            int base = 1 << 30;
            for (int t = 0; t < T; t++) {
                const int n = pos0 + t + 1, lo = n > W ? n - W : 0;
                base = lo / BT * BT < base ? lo / BT * BT : base;
            }
            for (int t = 0; t < T; t++)
                for (int g = 0; g < G; g++) {
                    const int L = t * G + g, n = pos0 + t + 1, lo = n > W ? n - W : 0;
                    qs[L] = (struct kern_attn_query){ q + (size_t)L * D, got + (size_t)L * D,
                                                      g % 2 ? NULL : st + 2 * L, n - base,
                                                      lo / BT * BT - base, lo - base };
                }
            struct kern_attn_args m = *a;
            m.blocks = a->blocks + base / BT;
            CHECK(kern_attn_multi(&m, qs, nq, scratch) == 1);
            for (int L = 0; L < nq; L++) {
                const bool same = same_as_alone(&m, &qs[L], one, scores);
                if (!same)
                    fprintf(stderr, "multi window %d: D %d V %s group %d query %d (first %d skip %d n_ctx %d) differs\n",
                            W, D, kern_type_info(a->v_type)->name, G, L, qs[L].first, qs[L].skip, qs[L].n_ctx);
                CHECK(same);
                cases++;
            }
        }
    free(q);
    free(got);
    free(one);
    free(scores);
    free(scratch);
    return cases;
}

/* Queries whose first positions lie several V blocks of the kernel apart
 * (it converts 4,096 values of V at a time: 16 positions of 256, 64 of 64),
 * in one group: each still the bits of kern_attn from its own first block. */
static int check_far_firsts(const struct kern_attn_args *a, int nctx_max)
{
    const int D = a->head_dim;
    enum { NQ = 7 };
    const int firsts[NQ] = { 0, 0, 32, 64, 128, 16, 192 };
    const int ends[NQ] = { 48, 300, 40, 65, 200, 17, 320 };
    float *q = malloc((size_t)NQ * D * sizeof(float)), *got = malloc((size_t)NQ * D * sizeof(float));
    float *one = malloc((size_t)D * sizeof(float)), st[2 * NQ];
    float *scores = malloc((size_t)nctx_max * sizeof(float));
    void *scratch = malloc(kern_attn_multi_scratch(nctx_max, D));
    struct kern_attn_query qs[NQ];
    int cases = 0;
    for (int i = 0; i < NQ * D; i++)
        q[i] = frand() * 3.0f;
    for (int L = 0; L < NQ; L++)
        qs[L] = (struct kern_attn_query){ q + (size_t)L * D, got + (size_t)L * D, st + 2 * L,
                                          ends[L] < nctx_max ? ends[L] : nctx_max, firsts[L],
                                          L % 3 == 1 ? firsts[L] + 5 : 0 };
    CHECK(kern_attn_multi(a, qs, NQ, scratch) == 1);
    for (int L = 0; L < NQ; L++) {
        const bool same = same_as_alone(a, &qs[L], one, scores);
        if (!same)
            fprintf(stderr, "multi far firsts: D %d V %s query %d (first %d n_ctx %d) differs\n", D,
                    kern_type_info(a->v_type)->name, L, qs[L].first, qs[L].n_ctx);
        CHECK(same);
        cases++;
    }
    free(q);
    free(got);
    free(one);
    free(scores);
    free(scratch);
    return cases;
}

/* kern_attn_multi: up to sixteen queries of one KV head, each over its own
 * positions, give exactly the bits kern_attn gives each alone on the same
 * path (outputs and stats), for head dims 64, 128 and 256, K f16 or f32 and
 * V of every type, queries laid out as a prefill's tokens x the heads of a
 * group (tokens one position apart, or several capped at a range's end). */
static void test_multi(void)
{
    /* the lanes kernel is AVX-512's; on aarch64 KERN_ISA_I8MM has the same
     * level number, so ask the kernel, not the level */
    if (!kern_attn_multi_ok(KERN_F16, KERN_F16, 64)) {
        fprintf(stderr, "test_multi: no lanes kernel here: kern_attn_multi declines (checked)\n");
        struct kern_attn_args a = { .head_dim = 64, .k_type = KERN_F16, .v_type = KERN_F16 };
        struct kern_attn_query q0 = { 0 };
        CHECK(kern_attn_multi(&a, &q0, 1, NULL) == 0);
        return;
    }
    enum { NBLK = 24, DMAX = 256 };
    const int dims[] = { 64, 128, 256 };
    const uint32_t ktypes[] = { KERN_F16, KERN_F32, KERN_BF16 };
    const uint32_t vtypes[] = { KERN_F16, KERN_F32, KERN_BF16, KERN_Q8_0, KERN_Q4_0 };
    const int groups[] = { 1, 3, 4, 5, 8, 16 };
    const int starts[] = { 1, 5, 16, 17, 200, NBLK * BT - 15 };
    int cases = 0, wcases = 0, declined = 0;
    for (size_t di = 0; di < 3; di++)
        for (size_t kt = 0; kt < 3; kt++)
            for (size_t vi = 0; vi < 5; vi++) {
                const int D = dims[di];
                const uint32_t ktype = ktypes[kt], vtype = vtypes[vi];
                if (!kern_attn_multi_ok(ktype, vtype, D)) {
                    /* bf16 without the bf16 dot product: declined, nothing done */
                    CHECK((ktype == KERN_BF16 || vtype == KERN_BF16) && !kern_avx512bf16());
                    struct kern_attn_args a = { .head_dim = D, .k_type = ktype, .v_type = vtype };
                    struct kern_attn_query q0 = { 0 };
                    CHECK(kern_attn_multi(&a, &q0, 1, NULL) == 0);
                    declined++;
                    continue;
                }
                const size_t k_row = kern_row_bytes(ktype, D), v_row = kern_row_bytes(vtype, D);
                const size_t k_head = BT * k_row, v_head = BT * v_row;
                const size_t block_stride = KVH * (k_head + v_head);
                uint8_t *mem = malloc(NBLK * block_stride);
                float row[DMAX];
                for (int b = 0; b < NBLK; b++)
                    for (int h = 0; h < KVH; h++)
                        for (int t = 0; t < BT; t++) {
                            for (int i = 0; i < D; i++)
                                row[i] = frand() * (i == 5 ? 6.0f : 1.5f);
                            kern_quantize_row(ktype, row, mem + b * block_stride + h * k_head + t * k_row, D);
                            for (int i = 0; i < D; i++)
                                row[i] = frand();
                            kern_quantize_row(vtype, row, mem + b * block_stride + KVH * k_head + h * v_head + t * v_row, D);
                        }
                uint32_t blocks[NBLK];
                for (int i = 0; i < NBLK; i++)
                    blocks[i] = (uint32_t)((i * 7 + 5) % NBLK);
                for (size_t gi = 0; gi < sizeof(groups) / sizeof(groups[0]); gi++)
                    for (size_t si = 0; si < sizeof(starts) / sizeof(starts[0]); si++) {
                        const int G = groups[gi], T = 16 / G, n0 = starts[si];
                        /* the last case caps every token at the range's end (NBLK * BT) */
                        const int cap = si + 1 == sizeof(starts) / sizeof(starts[0]) ? n0 + T / 2 : 1 << 30;
                        const int nq = T * G;
                        float *q = malloc((size_t)nq * D * sizeof(float));
                        float *got = malloc((size_t)nq * D * sizeof(float)), one[DMAX];
                        float st[2 * 16], one_st[2];
                        float *scores = malloc((size_t)(NBLK * BT) * sizeof(float));
                        void *scratch = malloc(kern_attn_multi_scratch(NBLK * BT, D));
                        struct kern_attn_query qs[16];
                        for (int i = 0; i < nq * D; i++)
                            q[i] = frand() * 3.0f;
                        for (int t = 0; t < T; t++)
                            for (int g = 0; g < G; g++) {
                                const int L = t * G + g, n = n0 + t < cap ? n0 + t : cap;
                                qs[L] = (struct kern_attn_query){ q + (size_t)L * D, got + (size_t)L * D,
                                                                  g % 2 ? NULL : st + 2 * L, n, 0, 0 };
                            }
                        struct kern_attn_args a = {
                            .k_base = mem, .v_base = mem + KVH * k_head, .blocks = blocks,
                            .block_tokens = BT, .head_dim = D, .kv_head = 1, .block_stride = block_stride,
                            .k_head_stride = k_head, .v_head_stride = v_head, .k_type = ktype,
                            .v_type = vtype, .scale = 0.125f,
                        };
                        CHECK(kern_attn_multi(&a, qs, nq, scratch) == 1);
                        for (int L = 0; L < nq; L++) {
                            struct kern_attn_args b = a;
                            b.q = qs[L].q;
                            b.out = one;
                            b.n_q = 1;
                            b.n_ctx = qs[L].n_ctx;
                            b.scores = scores;
                            b.stats = one_st;
                            kern_attn_isa(&b, KERN_ISA_AVX512VNNI);
                            const bool same = memcmp(one, qs[L].out, (size_t)D * sizeof(float)) == 0 &&
                                              (qs[L].stats == NULL ||
                                               memcmp(one_st, qs[L].stats, sizeof(one_st)) == 0);
                            if (!same)
                                fprintf(stderr, "multi: D %d K %s V %s group %d query %d (n_ctx %d) differs\n",
                                        D, kern_type_info(ktype)->name, kern_type_info(vtype)->name, G, L, qs[L].n_ctx);
                            CHECK(same);
                            cases++;
                        }
                        free(q);
                        free(got);
                        free(scores);
                        free(scratch);
                    }
                {
                    struct kern_attn_args a = {
                        .k_base = mem, .v_base = mem + KVH * k_head, .blocks = blocks,
                        .block_tokens = BT, .head_dim = D, .kv_head = 1, .block_stride = block_stride,
                        .k_head_stride = k_head, .v_head_stride = v_head, .k_type = ktype,
                        .v_type = vtype, .scale = 0.125f,
                    };
                    for (int G = 1; G <= 4; G *= 2)
                        wcases += check_windows(&a, G == 2 ? 3 : G, NBLK * BT);
                    wcases += check_far_firsts(&a, NBLK * BT);
                }
                free(mem);
            }
    /* a query's first not a multiple of 16, or a skip outside its positions: declined */
    {
        enum { D = 64 };
        const size_t row = kern_row_bytes(KERN_F16, D), block_stride = 2 * BT * row;
        uint8_t *mem = calloc(4, block_stride);
        uint32_t blocks[4] = { 0, 1, 2, 3 };
        float q[D] = { 0 }, out[D];
        void *scratch = malloc(kern_attn_multi_scratch(4 * BT, D));
        struct kern_attn_args a = {
            .k_base = mem, .v_base = mem + BT * row, .blocks = blocks, .block_tokens = BT, .head_dim = D,
            .block_stride = block_stride, .k_head_stride = BT * row, .v_head_stride = BT * row,
            .k_type = KERN_F16, .v_type = KERN_F16, .scale = 0.125f,
        };
        struct kern_attn_query bad[3] = {
            { q, out, NULL, 40, 8, 0 },      /* first not a multiple of 16 */
            { q, out, NULL, 40, 16, 10 },    /* skip before first */
            { q, out, NULL, 40, 16, 40 },    /* skip at n_ctx: nothing attended */
        };
        for (int i = 0; i < 3; i++)
            CHECK(kern_attn_multi(&a, &bad[i], 1, scratch) == 0);
        struct kern_attn_query ok = { q, out, NULL, 40, 16, 39 };
        CHECK(kern_attn_multi(&a, &ok, 1, scratch) == 1);
        free(mem);
        free(scratch);
    }
    /* a bf16 V in blocks of an odd number of positions (a pair would span two): declined */
    {
        struct kern_attn_args a = { .head_dim = 64, .k_type = KERN_F16, .v_type = KERN_BF16, .block_tokens = 15 };
        struct kern_attn_query q0 = { 0 };
        CHECK(kern_attn_multi(&a, &q0, 1, NULL) == 0);
#if defined(__x86_64__)
        CHECK(kern_attn_avx512(&a) == 0);
#endif
    }
    /* shapes and types it has no kernel for: declined, nothing written */
    struct kern_attn_args a = { .head_dim = 64, .k_type = KERN_Q8_0, .v_type = KERN_F16 };
    struct kern_attn_query q0 = { 0 };
    CHECK(kern_attn_multi(&a, &q0, 1, NULL) == 0);
    a.k_type = KERN_F16;
    a.head_dim = 96;
    CHECK(kern_attn_multi(&a, &q0, 1, NULL) == 0);
    fprintf(stderr, "test_multi: %d queries (%d of them in sliding windows), each the bits of kern_attn alone\n",
            cases + wcases, wcases);
    if (declined > 0)
        fprintf(stderr, "test_multi: %d shapes over a bf16 K or V not run: no bf16 dot product (AVX512_BF16 absent or off; declined, "
                "checked)\n", declined);
}

/* A bf16 cache of n positions laid out in blocks of bt: the same rows of K
 * and V (row i a function of i alone) whatever bt, the rows past n (the
 * rest of the last block and one more block) NaN, which nothing may read
 * into a result. a: the KV head's arguments (n_ctx n, no queries yet). */
struct bf16_cache {
    uint8_t *mem;
    uint32_t *blocks;
    struct kern_attn_args a;
};

static void bf16_cache_new(struct bf16_cache *c, int D, int bt, int n)
{
    const int nblk = (n + bt - 1) / bt + 1;
    const size_t row = (size_t)D * 2, head = (size_t)bt * row, block_stride = 2 * KVH * head;
    c->mem = malloc((size_t)nblk * block_stride);
    const uint16_t nan = 0x7fc0;
    for (size_t i = 0; i < (size_t)nblk * block_stride / 2; i++)
        memcpy(c->mem + 2 * i, &nan, 2);
    c->blocks = malloc((size_t)nblk * sizeof(uint32_t));
    for (int b = 0; b < nblk; b++)
        c->blocks[b] = (uint32_t)(b % 2 ? b / 2 : nblk - 1 - b / 2);   /* a permutation, out of order */
    float r[256];
    for (int i = 0; i < n; i++)
        for (int kv = 0; kv < 2; kv++) {
            for (int d = 0; d < D; d++)
                r[d] = sinf((float)(i * 31 + d * 7 + kv * 13)) * (kv == 0 && d == 3 ? 4.0f : 1.0f);
            uint8_t *at = c->mem + c->blocks[i / bt] * block_stride + (size_t)kv * KVH * head + head +
                          (size_t)(i % bt) * row;
            kern_quantize_row(KERN_BF16, r, at, D);
        }
    c->a = (struct kern_attn_args){
        .k_base = c->mem, .v_base = c->mem + KVH * head, .blocks = c->blocks, .n_ctx = n,
        .block_tokens = bt, .head_dim = D, .kv_head = 1, .block_stride = block_stride, .k_head_stride = head,
        .v_head_stride = head, .k_type = KERN_BF16, .v_type = KERN_BF16, .scale = 0.1f,
    };
}

static void bf16_cache_free(struct bf16_cache *c)
{
    free(c->mem);
    free(c->blocks);
}

/* kern_attn of G heads (q) over such a cache, from a window's start skip:
 * out, and stats (2 G floats). */
static void bf16_paged(int D, int G, int bt, int n, int skip, const float *q, float *out, float *stats)
{
    struct bf16_cache c;
    bf16_cache_new(&c, D, bt, n);
    float *scores = malloc((size_t)G * n * sizeof(float));
    c.a.q = q;
    c.a.out = out;
    c.a.n_q = G;
    c.a.skip = skip;
    c.a.scores = scores;
    c.a.stats = stats;
    kern_attn(&c.a);
    free(scores);
    bf16_cache_free(&c);
}

/* kern_attn_multi over a cache of blocks of bt: queries with their own first
 * (0 or a multiple of both 16 and bt), n_ctx and skip, each the bits (out
 * and stats) of kern_attn over the blocks from its first. */
static void amx_multi_blocks(int D, int bt)
{
    enum { NQ = 7, N = 300 };
    const int step = bt % 16 == 0 ? bt : bt * 16 / (bt % 2 == 0 ? (bt % 4 == 0 ? (bt % 8 == 0 ? 8 : 4) : 2) : 1);
    struct bf16_cache c;
    bf16_cache_new(&c, D, bt, N);
    float q[NQ * 256], out[NQ * 256], st[NQ * 2], one[256], one_st[2];
    for (int i = 0; i < NQ * D; i++)
        q[i] = frand() * 2.0f;
    struct kern_attn_query qs[NQ];
    for (int L = 0; L < NQ; L++) {
        const int first = L % 2 ? step : 0, n = N - 23 * L, skip = L % 3 == 1 ? first + 21 : 0;
        qs[L] = (struct kern_attn_query){ q + L * D, out + L * D, st + 2 * L, n, first, skip };
    }
    void *scratch = malloc(kern_attn_multi_scratch(N, D));
    float *scores = malloc(N * sizeof(float));
    CHECK(kern_attn_multi(&c.a, qs, NQ, scratch) == 1);
    for (int L = 0; L < NQ; L++) {
        struct kern_attn_args b = c.a;
        b.blocks = c.blocks + qs[L].first / bt;
        b.q = qs[L].q;
        b.out = one;
        b.n_q = 1;
        b.n_ctx = qs[L].n_ctx - qs[L].first;
        b.skip = qs[L].skip > 0 ? qs[L].skip - qs[L].first : 0;
        b.scores = scores;
        b.stats = one_st;
        kern_attn(&b);
        CHECK(memcmp(one, qs[L].out, (size_t)D * sizeof(float)) == 0);
        CHECK(memcmp(one_st, qs[L].stats, sizeof(one_st)) == 0);
    }
    free(scratch);
    free(scores);
    bf16_cache_free(&c);
}

/* The AMX path over bf16 (where the CPU has it): the block size changes no
 * bit, for decode (stats too) and kern_attn_multi (sixteen K rows are read
 * in place inside a block and staged across two; rows past the context, NaN
 * here, never reach a result); more than sixteen heads run as sixteen and
 * the rest, each head's bits as alone; and the result is the C reference's
 * within the tolerance. */
static void test_amx_blocks(void)
{
    if (!kern_amx_bf16()) {
#if defined(__x86_64__)
        struct kern_attn_args a = { .head_dim = 64, .k_type = KERN_BF16, .v_type = KERN_BF16, .block_tokens = 16 };
        CHECK(kern_attn_amx(&a) == 0);
#endif
        fprintf(stderr, "test_amx_blocks: no AMX-BF16 here (or off): the AMX kernel declines (checked)\n");
        return;
    }
    enum { G = 20 };
    const int dims[] = { 64, 256 }, bts[] = { 16, 5, 24, 1, 128 }, ns[] = { 9, 77, 300 }, skips[] = { 0, 6, 20 };
    static float q[G * 256], want[G * 256], got[G * 256], one[256];
    float st_want[2 * G], st_got[2 * G], st_one[2];
    for (int i = 0; i < G * 256; i++)
        q[i] = frand() * 2.0f;
    for (int di = 0; di < 2; di++)
        for (int ni = 0; ni < 3; ni++)
            for (int si = 0; si < 3; si++) {
                const int D = dims[di], n = ns[ni], skip = skips[si] < n ? skips[si] : 0;
                bf16_paged(D, G, 16, n, skip, q, want, st_want);
                for (int bi = 1; bi < 5; bi++) {
                    bf16_paged(D, G, bts[bi], n, skip, q, got, st_got);
                    CHECK(memcmp(want, got, (size_t)G * D * sizeof(float)) == 0);
                    CHECK(memcmp(st_want, st_got, sizeof(st_want)) == 0);
                }
                for (int g = 0; g < G; g += 7) {   /* heads 0, 7, 14 (the second call of 16 has 17 .. 19) */
                    bf16_paged(D, 1, 24, n, skip, q + g * D, one, st_one);
                    CHECK(memcmp(one, want + g * D, (size_t)D * sizeof(float)) == 0);
                }
                bf16_paged(D, 1, 24, n, skip, q + 19 * D, one, st_one);
                CHECK(memcmp(one, want + 19 * D, (size_t)D * sizeof(float)) == 0);
                /* the C reference, over the same rows */
                kern_amx_set(false);
                kern_avx512bf16_set(false);
                kern_isa_set(KERN_ISA_C);
                bf16_paged(D, G, 16, n, skip, q, got, st_got);
                kern_isa_set(kern_isa_best());
                kern_avx512bf16_set(true);
                kern_amx_set(true);
                double worst = 0;
                for (int i = 0; i < G * D; i++)
                    worst = fmax(worst, fabs(got[i] - want[i]) / (fabs(got[i]) + 0.05));
                if (worst > 2e-3)
                    fprintf(stderr, "AMX bf16 head_dim %d ctx %d skip %d: worst relative difference %.2e\n", D, n,
                            skip, worst);
                CHECK(worst <= 2e-3);
            }
    for (int di = 0; di < 2; di++)
        for (int bi = 0; bi < 5; bi++)
            amx_multi_blocks(dims[di], bts[bi]);
    fprintf(stderr, "test_amx_blocks: bf16 on AMX tiles: blocks of 1 .. 128 the same bits (decode and multi), "
                    "within 2e-3 of the C reference\n");
}

/* --kv-type auto's choice: bf16 on the AMX tiles and on an AMD CPU's bf16
 * dot product, f16 on the C path, without the bf16 instructions, and on
 * Intel without the tiles (turned off here: vdpbf16ps is slower than f16). */
static void test_kv_auto(void)
{
    const uint32_t best = kern_attn_kv_auto();
    if (kern_amx_bf16())
        CHECK_INT(best, KERN_BF16);
    if (!kern_avx512bf16())
        CHECK_INT(best, KERN_F16);
    if (kern_avx512bf16() && kern_cpu_amd())
        CHECK_INT(best, KERN_BF16);
    if (kern_avx512bf16() && !kern_cpu_amd() && !kern_amx_bf16())
        CHECK_INT(best, KERN_F16);
    if (kern_amx_available()) {
        kern_amx_set(false);
        CHECK_INT(kern_attn_kv_auto(), KERN_F16);
        kern_amx_set(true);
    }
    kern_isa_set(KERN_ISA_C);
    CHECK_INT(kern_attn_kv_auto(), KERN_F16);
    kern_isa_set(kern_isa_best());
    CHECK_INT(kern_attn_kv_auto(), best);
    fprintf(stderr, "kv auto: %s here\n", best == KERN_BF16 ? "bf16" : "f16");
}

int main(void)
{
    srand(5);
    test_kv_auto();
    test_multi();
    if (kern_amx_bf16()) {
        /* bf16 goes to the AMX tiles; once more on the vdpbf16ps kernels */
        kern_amx_set(false);
        test_multi();
        test_head_dim(64, 3, KERN_BF16);
        test_head_dim(128, 3, KERN_BF16);
        test_head_dim(256, 4, KERN_BF16);
        kern_amx_set(true);
    }
    test_amx_blocks();
    if (kern_avx512bf16()) {
        /* as on an AVX-512 CPU without the bf16 dot product: bf16 declined */
        kern_avx512bf16_set(false);
        test_multi();
        kern_avx512bf16_set(true);
    }
    const int ctxs[] = { 1, 7, 16, 33, 300, 1200 };
    const int groups[] = { 1, 2, 3, 4, 5 };  /* NEON's V passes take three heads: 3+1, 3+2 */
    const uint32_t dtypes[] = { KERN_F16, KERN_F32, KERN_BF16 };
    for (int dt = 0; dt < 3; dt++) {
        const uint32_t dtype = dtypes[dt];
        const size_t elem = kern_row_bytes(dtype, 1);
        const size_t head_stride = (size_t)BT * HD * elem, block_stride = 2 * KVH * head_stride;
        uint8_t *mem = malloc(NB * block_stride);
        for (size_t i = 0; i < NB * block_stride / elem; i++) {
            float v = frand() * 2.0f;
            kern_quantize_row(dtype, &v, mem + i * elem, 1);
        }
        uint32_t blocks[NB];
        for (int i = 0; i < NB; i++)
            blocks[i] = (uint32_t)((i * 37 + 11) % NB);
        for (size_t ci = 0; ci < 2 * sizeof(ctxs) / sizeof(ctxs[0]); ci++)
            for (size_t gi = 0; gi < sizeof(groups) / sizeof(groups[0]); gi++) {
                /* each context whole, then as a window starting inside its first block */
                const int n_ctx = ctxs[ci / 2], G = groups[gi], skip = ci % 2 && n_ctx > 5 ? 5 : 0;
                if (ci % 2 && skip == 0)
                    continue;
                float q[5 * HD], ref[5 * HD], got[5 * HD], one[HD];
                float *scores = malloc((size_t)5 * n_ctx * sizeof(float));
                for (int i = 0; i < G * HD; i++)
                    q[i] = frand() * 3.0f;
                struct kern_attn_args a = {
                    .out = ref, .q = q, .n_q = G, .k_base = mem, .v_base = mem + KVH * head_stride,
                    .blocks = blocks, .n_ctx = n_ctx, .block_tokens = BT, .head_dim = HD,
                    .kv_head = 1, .block_stride = block_stride, .k_head_stride = head_stride,
                    .v_head_stride = head_stride, .k_type = dtype, .v_type = dtype, .scale = 0.125f,
                    .scores = scores, .skip = skip,
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
                    fprintf(stderr, "%s ctx %d skip %d group %d: worst relative difference %.2e\n",
                            kern_type_info(dtype)->name, n_ctx, skip, G, worst);
                CHECK(worst <= 2e-3);
                free(scores);
            }
        free(mem);
    }
    test_quantized();
    test_head_dim(40, 4, KERN_F16);
    test_head_dim(32, 4, KERN_F16);
    test_head_dim(32, 7, KERN_F16);
    test_head_dim(256, 4, KERN_F16);
    test_head_dim(128, 3, KERN_BF16);
    test_head_dim(256, 4, KERN_BF16);
    return CHECK_DONE();
}
