/*
 * bench_attn.c - bench-attn: grouped paged attention per KV type and kernel
 * path, one decode call at a time.
 *
 * A cache of random rows (3 KV heads of 64 dimensions, blocks of 16
 * positions scattered through the pool), K and V of one type; a group of 3
 * query heads (SmolLM2's shape) attends over the first N positions. For
 * each type (f16, bf16, q8_0, q4_0) and each path this CPU has (c, avx2,
 * avx512vnni), the median of 9 timings of ~0.2 s, as microseconds per call
 * (one KV head's group), positions per second, and the ratio to f16 on the
 * same path.
 *
 * By default the cache is one layer, a few hundred KB that stays in L2: the
 * kernels' arithmetic. With -w MB it is 30 layers, as a decode step walks
 * them (every KV head of a layer, then the next layer), and between layers
 * the benchmark reads MB of other memory, as a decode step reads a layer's
 * weights (3 MB for the default model), so that each call finds its rows
 * out of cache, as in the engine; only the calls are timed. That measures
 * how well a kernel hides the misses (prefetch), which the warm form cannot.
 *
 * Warm, it then times a prefill's attention over the same positions: each
 * token alone against kern_attn_multi (bench_prefill).
 *
 * Usage: bench-attn [-n POSITIONS (default 4096)] [-w MB]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attn.h"
#include "cpu.h"
#include "quant.h"
#include "types.h"

#define HD 64
#define BT 16
#define KVH 3
#define GROUP 3
#define COLD_LAYERS 30

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Reads n bytes (a multiple of 64) a line at a time; the sum keeps the
 * loads. */
static uint64_t read_lines(const uint8_t *p, size_t n)
{
    uint64_t s = 0;
    for (size_t i = 0; i < n; i += 64) {
        uint64_t v;
        memcpy(&v, p + i, sizeof(v));
        s += v;
    }
    return s;
}

/* A prefill's attention: TOKENS tokens (5, so that 15 queries fill a
 * vector's lanes) of GROUP heads each over about n positions of an f16
 * cache, one KV head: each token alone on the active path (kern_attn, its
 * group at once, as decode runs it) against all of them in one
 * kern_attn_multi call. Median of 9 rounds of ~0.2 s, microseconds per
 * token, and the ratio. */
#define TOKENS 5
static void bench_prefill(int n, int nt, uint32_t type)
{
    const size_t row = kern_row_bytes(type, HD), head = BT * row, bs = 2 * KVH * head;
    const int nb = (n + TOKENS + BT - 1) / BT;
    uint8_t *mem = malloc((size_t)nb * bs);
    uint32_t *blocks = malloc((size_t)nb * sizeof(uint32_t));
    float *scores = malloc((size_t)GROUP * (n + TOKENS) * sizeof(float));
    void *scratch = malloc(kern_attn_multi_scratch(n + TOKENS, HD));
    if (mem == NULL || blocks == NULL || scores == NULL || scratch == NULL)
        exit(1);
    float r[HD], q[TOKENS * GROUP * HD], out[TOKENS * GROUP * HD];
    for (size_t i = 0; i < (size_t)nb * bs / row; i++) {
        for (int d = 0; d < HD; d++)
            r[d] = (float)rand() / (float)RAND_MAX - 0.5f;
        kern_quantize_row(type, r, mem + i * row, HD);
    }
    for (int i = 0; i < nb; i++)
        blocks[i] = (uint32_t)(((long)i * 37 + 11) % nb);
    for (int i = 0; i < TOKENS * GROUP * HD; i++)
        q[i] = (float)rand() / (float)RAND_MAX;
    struct kern_attn_args a = {
        .n_q = GROUP, .blocks = blocks, .block_tokens = BT, .head_dim = HD, .block_stride = bs,
        .k_head_stride = head, .v_head_stride = head, .k_type = type, .v_type = type,
        .scale = 0.125f, .scores = scores, .k_base = mem, .v_base = mem + KVH * head, .kv_head = 1,
    };
    struct kern_attn_query qs[TOKENS * GROUP];
    for (int t = 0; t < nt; t++)
        for (int g = 0; g < GROUP; g++)
            qs[t * GROUP + g] = (struct kern_attn_query){ q + (t * GROUP + g) * HD, out + (t * GROUP + g) * HD,
                                                          NULL, n + t + 1, 0, 0 };
    double med[2];
    for (int multi = 0; multi < 2; multi++) {
        double runs[9];
        for (int k = -1; k < 9; k++) {
            long calls = 0;
            const double t0 = now_s();
            while (now_s() - t0 < 0.2) {
                if (multi) {
                    if (!kern_attn_multi(&a, qs, nt * GROUP, scratch))
                        return;     /* no such kernel on this path */
                } else {
                    for (int t = 0; t < nt; t++) {
                        a.q = q + t * GROUP * HD;
                        a.out = out + t * GROUP * HD;
                        a.n_ctx = n + t + 1;
                        kern_attn(&a);
                    }
                }
                calls++;
            }
            if (k >= 0)
                runs[k] = (now_s() - t0) / (double)calls / nt * 1e6;
        }
        qsort(runs, 9, sizeof(double), cmp);
        med[multi] = runs[4];
    }
    if (nt == 2)
        printf("\ntokens x %d heads over %d positions in one kern_attn_multi call (%s, %s): us per token\n"
               "| tokens | each token alone | all in one kern_attn_multi | speed-up |\n|---|---|---|---|\n",
               GROUP, n, kern_type_info(type)->name,
               type == KERN_BF16 && kern_amx_bf16() ? "avx512vnni+amx" : kern_isa_name(kern_isa()));
    printf("| %d | %.1f | %.1f | %.2fx |\n", nt, med[0], med[1], med[0] / med[1]);
    free(mem);
    free(blocks);
    free(scores);
    free(scratch);
}

int main(int argc, char **argv)
{
    int n = 4096;
    long wipe_mb = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-n") == 0 && i + 1 < argc) {
            n = atoi(argv[++i]);
        } else if (strcmp(argv[i], "-w") == 0 && i + 1 < argc) {
            wipe_mb = atol(argv[++i]);
        } else {
            n = 0;
            break;
        }
    }
    if (n < 1 || n > (1 << 20) || wipe_mb < 0 || wipe_mb > 4096) {
        fprintf(stderr, "usage: bench-attn [-n POSITIONS] [-w MB]\n");
        return 1;
    }
    const int layers = wipe_mb > 0 ? COLD_LAYERS : 1;
    const size_t wipe = (size_t)wipe_mb << 20;
    uint8_t *other = wipe > 0 ? malloc(wipe * layers) : NULL;
    if (wipe > 0 && other == NULL)
        return 1;
    if (other != NULL)
        memset(other, 1, wipe * layers);
    const uint32_t types[] = { KERN_F16, KERN_BF16, KERN_Q8_0, KERN_Q4_0 };
    const int nb = (n + BT - 1) / BT;
    double f16_us[KERN_ISA_AVX512VNNI + 1] = { 0 };
    uint64_t sink = 0;
    const bool amx_on = kern_amx();    /* KVD_AMX=0 keeps the AMX rows out */
    printf("bench-attn: %d query heads over %d positions, head dim %d, blocks of %d", GROUP, n, HD, BT);
    if (wipe > 0)
        printf("; %d layers, %ld MB read between layers", layers, wipe_mb);
    printf("\n| type | path | us per call | M head-positions/s | against f16 |\n|---|---|---|---|---|\n");
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
        const uint32_t t = types[ti];
        /* a block: every layer's K heads then V heads, as the engine's pool */
        const size_t row = kern_row_bytes(t, HD), head = BT * row, layer = 2 * KVH * head;
        const size_t bs = layer * (size_t)layers;
        uint8_t *mem = malloc((size_t)nb * bs);
        uint32_t *blocks = malloc((size_t)nb * sizeof(uint32_t));
        float *scores = malloc((size_t)GROUP * n * sizeof(float));
        if (mem == NULL || blocks == NULL || scores == NULL)
            return 1;
        float r[HD], q[GROUP * HD], out[GROUP * HD];
        srand(7);
        for (size_t i = 0; i < (size_t)nb * bs / row; i++) {
            for (int d = 0; d < HD; d++)
                r[d] = (float)rand() / (float)RAND_MAX - 0.5f;
            kern_quantize_row(t, r, mem + i * row, HD);
        }
        for (int i = 0; i < nb; i++)
            blocks[i] = (uint32_t)(((long)i * 37 + 11) % nb);
        for (int i = 0; i < GROUP * HD; i++)
            q[i] = (float)rand() / (float)RAND_MAX;
        struct kern_attn_args a = {
            .out = out, .q = q, .n_q = GROUP, .blocks = blocks,
            .n_ctx = n, .block_tokens = BT, .head_dim = HD, .block_stride = bs,
            .k_head_stride = head, .v_head_stride = head, .k_type = t, .v_type = t, .scale = 0.125f,
            .scores = scores,
        };
        for (int isa = KERN_ISA_C; isa <= (int)kern_isa_best(); isa++)
            /* bf16 on AVX-512 runs on the AMX tiles where the CPU has them: both rows */
            for (int amx = t == KERN_BF16 && isa >= KERN_ISA_AVX512VNNI && kern_amx_bf16(); amx >= 0; amx--) {
                kern_amx_set(amx_on && (amx || t != KERN_BF16));
                double runs[9];
                for (int k = -1; k < 9; k++) {  /* a round not kept, to warm up */
                    double busy = 0.0;
                    long calls = 0;
                    const double t0 = now_s();
                    while (now_s() - t0 < 0.2) {
                        for (int l = 0; l < layers; l++) {
                            const double c0 = now_s();
                            a.k_base = mem + (size_t)l * layer;
                            a.v_base = a.k_base + KVH * head;
                            for (int h = 0; h < (layers > 1 ? KVH : 1); h++) {
                                a.kv_head = layers > 1 ? h : 1;
                                kern_attn_isa(&a, isa);
                                calls++;
                            }
                            busy += now_s() - c0;
                            if (other != NULL)
                                sink += read_lines(other + (size_t)l * wipe, wipe);
                        }
                    }
                    if (k >= 0)
                        runs[k] = busy / (double)calls * 1e6;
                }
                qsort(runs, 9, sizeof(double), cmp);
                const double us = runs[4];
                if (t == KERN_F16)
                    f16_us[isa] = us;
                printf("| %s | %s%s | %.1f | %.1f | %.2fx |\n", kern_type_info(t)->name,
                       kern_isa_name((enum kern_isa)isa), amx ? "+amx" : "", us, (double)n * GROUP / us,
                       f16_us[isa] / us);
                kern_amx_set(amx_on);
            }
        free(mem);
        free(blocks);
        free(scores);
    }
    free(other);
    if (wipe == 0)
        for (int bf = 0; bf < 3; bf++) {
            if (bf == 2 && !kern_amx_bf16())
                break;
            kern_amx_set(amx_on && bf != 2);  /* bf16 once more without the AMX tiles */
            for (int nt = 2; nt <= TOKENS; nt++)
                bench_prefill(n, nt, bf ? KERN_BF16 : KERN_F16);
            kern_amx_set(amx_on);
        }
    return sink == 42 ? 2 : 0;  /* the reads' sum, so they are not optimized out */
}
