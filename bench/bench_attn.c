/*
 * bench_attn.c - bench-attn: grouped paged attention per KV type and kernel
 * path, one decode call at a time.
 *
 * A cache of random rows (one layer, 3 KV heads of 64 dimensions, blocks of
 * 16 positions scattered through the pool), K and V of one type; a group of
 * 3 query heads (SmolLM2's shape) attends over the first N positions. For
 * each type (f16, q8_0, q4_0) and each path this CPU has (c, avx2,
 * avx512vnni), the median of 9 timings of ~0.2 s, as microseconds per call,
 * positions per second, and the ratio to f16 on the same path. The whole
 * cache is a few MB, so this is the kernels' arithmetic, not memory
 * bandwidth (see kvd-run --bench --bench-ctx for a whole model).
 *
 * Usage: bench-attn [-n POSITIONS (default 4096)]
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

int main(int argc, char **argv)
{
    int n = 4096;
    if (argc == 3 && strcmp(argv[1], "-n") == 0)
        n = atoi(argv[2]);
    if (n < 1 || n > (1 << 20) || (argc != 1 && argc != 3)) {
        fprintf(stderr, "usage: bench-attn [-n POSITIONS]\n");
        return 1;
    }
    const uint32_t types[] = { KERN_F16, KERN_Q8_0, KERN_Q4_0 };
    const int nb = (n + BT - 1) / BT;
    double f16_us[KERN_ISA_AVX512VNNI + 1] = { 0 };
    printf("bench-attn: %d query heads over %d positions, head dim %d, blocks of %d\n", GROUP, n, HD, BT);
    printf("| type | path | us per call | M head-positions/s | against f16 |\n|---|---|---|---|---|\n");
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
        const uint32_t t = types[ti];
        const size_t row = kern_row_bytes(t, HD), head = BT * row, bs = 2 * KVH * head;
        uint8_t *mem = malloc((size_t)nb * bs);
        uint32_t *blocks = malloc((size_t)nb * sizeof(uint32_t));
        float *scores = malloc((size_t)GROUP * n * sizeof(float));
        if (mem == NULL || blocks == NULL || scores == NULL)
            return 1;
        float r[HD], q[GROUP * HD], out[GROUP * HD];
        srand(7);
        for (size_t i = 0; i < (size_t)nb * 2 * KVH * BT; i++) {
            for (int d = 0; d < HD; d++)
                r[d] = (float)rand() / (float)RAND_MAX - 0.5f;
            kern_quantize_row(t, r, mem + i * row, HD);
        }
        for (int i = 0; i < nb; i++)
            blocks[i] = (uint32_t)(((long)i * 37 + 11) % nb);
        for (int i = 0; i < GROUP * HD; i++)
            q[i] = (float)rand() / (float)RAND_MAX;
        struct kern_attn_args a = {
            .out = out, .q = q, .n_q = GROUP, .k_base = mem, .v_base = mem + KVH * head, .blocks = blocks,
            .n_ctx = n, .block_tokens = BT, .head_dim = HD, .kv_head = 1, .block_stride = bs,
            .k_head_stride = head, .v_head_stride = head, .k_type = t, .v_type = t, .scale = 0.125f,
            .scores = scores,
        };
        for (int isa = KERN_ISA_C; isa <= (int)kern_isa_best(); isa++) {
            double runs[9];
            kern_attn_isa(&a, isa);
            for (int k = 0; k < 9; k++) {
                const double t0 = now_s();
                long it = 0;
                while (now_s() - t0 < 0.2) {
                    kern_attn_isa(&a, isa);
                    it++;
                }
                runs[k] = (now_s() - t0) / (double)it * 1e6;
            }
            qsort(runs, 9, sizeof(double), cmp);
            const double us = runs[4];
            if (t == KERN_F16)
                f16_us[isa] = us;
            printf("| %s | %s | %.1f | %.1f | %.2fx |\n", kern_type_info(t)->name,
                   kern_isa_name((enum kern_isa)isa), us, (double)n * GROUP / us, f16_us[isa] / us);
        }
        free(mem);
        free(blocks);
        free(scores);
    }
    return 0;
}
