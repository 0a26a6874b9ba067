/*
 * bench_sampler.c - bench-sampler: the cost of one sampled token, against the
 * definition it must agree with.
 *
 * For a row of V logits (default 49,152, SmolLM2's vocabulary; a fixed
 * pseudo-random spread, the same every run) and the server's default draw
 * (temperature 0.8, top-p 0.95, min-p 0.05) at top-k 40 (kvd's default),
 * 1,000 and off: the time of one sampler_pick (top-k by a heap, or a radix
 * sort of the row) against sampler_pick_sorted (the whole row through qsort,
 * as every draw did before), alternating, medians of the runs, and whether
 * every draw chose the same token.
 *
 * Usage: bench-sampler [--vocab V] [--runs N]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sampler.h"

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int cmp_d(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    uint32_t V = 49152;
    int runs = 201;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--vocab") && i + 1 < argc)
            V = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc)
            runs = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench-sampler [--vocab V] [--runs N]\n");
            return 2;
        }
    }
    if (V < 2 || runs < 1) {
        fprintf(stderr, "bench-sampler: --vocab >= 2, --runs >= 1\n");
        return 2;
    }
    float *row = malloc((size_t)V * sizeof(float));
    double *fast = malloc((size_t)runs * sizeof(double)), *sorted = malloc((size_t)runs * sizeof(double));
    if (row == NULL || fast == NULL || sorted == NULL)
        return 1;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (uint32_t i = 0; i < V; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        row[i] = (float)((x >> 40) % 20000) / 1000.0f - 10.0f;   /* logits in [-10, 10) */
    }
    struct sampler_params sp = sampler_default_params();
    char err[256];
    sampler_t *plan = sampler_new(&sp, V, err, sizeof(err)), *scratch = sampler_new(&sp, V, err, sizeof(err));
    if (plan == NULL || scratch == NULL) {
        fprintf(stderr, "bench-sampler: %s\n", err);
        return 1;
    }
    printf("bench-sampler: one draw over %u logits, temperature %.1f, top-p %.2f, min-p %.2f; medians of %d\n", V,
           sp.temperature, sp.top_p, sp.min_p, runs);
    printf("| top-k | sampler_pick (ms) | full sort (ms) | full sort / pick | same token |\n");
    printf("|---|---|---|---|---|\n");
    static const int32_t ks[] = { 40, 1000, 0 };
    for (size_t ki = 0; ki < sizeof(ks) / sizeof(ks[0]); ki++) {
        int same = 0;
        for (int r = 0; r < runs; r++) {
            struct sampler_draw d;
            sampler_plan(plan, NULL, 0, &d);
            d.top_k = ks[ki];
            double t0 = now_ms();
            const int32_t a = sampler_pick(scratch, &d, row);
            double t1 = now_ms();
            const int32_t b = sampler_pick_sorted(scratch, &d, row);
            double t2 = now_ms();
            fast[r] = t1 - t0;
            sorted[r] = t2 - t1;
            same += a == b;
        }
        qsort(fast, (size_t)runs, sizeof(double), cmp_d);
        qsort(sorted, (size_t)runs, sizeof(double), cmp_d);
        const double f = fast[runs / 2], s = sorted[runs / 2];
        char k[16];
        if (ks[ki])
            snprintf(k, sizeof(k), "%d", ks[ki]);
        else
            snprintf(k, sizeof(k), "off");
        printf("| %s | %.3f | %.3f | %.1fx | %d/%d |\n", k, f, s, s / f, same, runs);
    }
    sampler_destroy(&plan);
    sampler_destroy(&scratch);
    free(row);
    free(fast);
    free(sorted);
    return 0;
}
