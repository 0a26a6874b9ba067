/*
 * bench_ceiling.c - the two ceilings of the CPU engine on this machine, and
 * what they allow the default model.
 *
 *   read bandwidth         N threads each read a private buffer with wide
 *                          loads, bytes read / time (best of 5 passes): over
 *                          256 MiB each (memory), and over a working set the
 *                          size of the model's weights split among them (what
 *                          a decode step reads; it stays in the last-level
 *                          cache where that is large enough)
 *   int8 dot product peak  one thread, twelve independent chains of the
 *                          widest integer dot-product instruction the engine
 *                          uses (512-bit VNNI dpbusd, else AVX2 maddubs+madd);
 *                          multiply-adds / time, times N threads
 *
 * With -m MODEL it loads the model as the engine does (packed weights) and
 * prints the floors of a decode step: batch 1 cannot beat
 * (weight bytes read) / bandwidth, and batch B cannot beat
 * B x (multiply-adds per token) / peak, whatever the code around them does.
 *
 *   build/bench-ceiling [-m MODEL] [-t N]
 */
#include <getopt.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "gemm.h"
#include "model.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define BIG_BYTES ((size_t)256 << 20)

struct bw_job {
    pthread_barrier_t *bar;
    uint8_t *buf;
    size_t bytes;
    double seconds;
    uint64_t sink;
};

#if defined(__x86_64__)
__attribute__((target("avx2"))) static uint64_t read_all(const uint8_t *p, size_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    return (uint64_t)_mm256_extract_epi64(a0, 0);
}
#else
static uint64_t read_all(const uint8_t *p, size_t n)
{
    uint64_t s = 0;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s ^= v;
    }
    return s;
}
#endif

static void *bw_thread(void *arg)
{
    struct bw_job *j = arg;
    double best = 1e30;
    for (int round = 0; round < 5; round++) {
        pthread_barrier_wait(j->bar);
        double t0 = now_s();
        j->sink ^= read_all(j->buf, j->bytes);
        double t = now_s() - t0;
        best = t < best ? t : best;
    }
    j->seconds = best;
    return NULL;
}

/* GB/s read by n threads at once, each over its own `each` bytes. */
static double bandwidth(int n, size_t each)
{
    each = (each + 127) / 128 * 128;
    pthread_t th[64];
    struct bw_job jobs[64];
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)n);
    for (int i = 0; i < n; i++) {
        jobs[i] = (struct bw_job){ .bar = &bar, .buf = aligned_alloc(64, each), .bytes = each };
        if (jobs[i].buf == NULL) {
            fprintf(stderr, "out of memory\n");
            exit(1);
        }
        memset(jobs[i].buf, i + 1, each);
    }
    for (int i = 0; i < n; i++)
        pthread_create(&th[i], NULL, bw_thread, &jobs[i]);
    double worst = 0;
    uint64_t sink = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        worst = jobs[i].seconds > worst ? jobs[i].seconds : worst;
        sink ^= jobs[i].sink;
        free(jobs[i].buf);
    }
    pthread_barrier_destroy(&bar);
    if (sink == 42)
        fprintf(stderr, " ");
    return (double)n * (double)each / worst / 1e9;
}

#if defined(__x86_64__)
#define CHAINS 12
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double peak_vnni512(long iters)
{
    __m512i a[CHAINS];
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    for (int i = 0; i < CHAINS; i++)
        a[i] = _mm512_set1_epi32(i);
    double t0 = now_s();
    for (long k = 0; k < iters; k++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++)
            a[i] = _mm512_dpbusd_epi32(a[i], w, x);
        __asm__ volatile("" : "+v"(w));
    }
    double t = now_s() - t0;
    __m512i s = a[0];
    for (int i = 1; i < CHAINS; i++)
        s = _mm512_add_epi32(s, a[i]);
    volatile int sink = _mm512_reduce_add_epi32(s);
    (void)sink;
    return (double)iters * CHAINS * 64 / t / 1e9;
}

__attribute__((target("avx2"))) static double peak_avx2(long iters)
{
    __m256i a[CHAINS];
    __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5), one = _mm256_set1_epi16(1);
    for (int i = 0; i < CHAINS; i++)
        a[i] = _mm256_set1_epi32(i);
    double t0 = now_s();
    for (long k = 0; k < iters; k++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++)
            a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), one));
        __asm__ volatile("" : "+x"(w));
    }
    double t = now_s() - t0;
    __m256i s = a[0];
    for (int i = 1; i < CHAINS; i++)
        s = _mm256_add_epi32(s, a[i]);
    volatile int sink = _mm256_extract_epi32(s, 0);
    (void)sink;
    return (double)iters * CHAINS * 32 / t / 1e9;
}
#endif

/* Multiply-adds per token of the model's matrix products, and bytes of the
 * weights a step reads (packed copies where the engine made them). */
static void model_costs(const model_t *m, double *macs, double *bytes)
{
    const struct model_mat *all[8];
    *macs = (double)m->output.rows * (double)m->output.cols;
    *bytes = m->output.packed ? (double)kern_pack_bytes(m->output.packed)
                              : (double)m->output.rows * (double)m->output.row_bytes;
    for (uint32_t l = 0; l < m->cfg.n_layer; l++) {
        const struct model_layer *L = &m->layers[l];
        all[0] = &L->wq; all[1] = &L->wk; all[2] = &L->wv; all[3] = &L->wo;
        all[4] = &L->w_gate; all[5] = &L->w_up; all[6] = &L->w_down;
        for (int i = 0; i < 7; i++) {
            *macs += (double)all[i]->rows * (double)all[i]->cols;
            *bytes += all[i]->packed ? (double)kern_pack_bytes(all[i]->packed)
                                     : (double)all[i]->rows * (double)all[i]->row_bytes;
        }
    }
}

int main(int argc, char **argv)
{
    const char *model_path = NULL;
    int threads = 2, c;
    while ((c = getopt(argc, argv, "m:t:h")) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 't': threads = atoi(optarg); break;
        default:
            fprintf(stderr, "usage: bench-ceiling [-m MODEL] [-t THREADS]\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (threads < 1 || threads > 64) {
        fprintf(stderr, "bench-ceiling: -t takes 1..64\n");
        return 2;
    }
    double peak = 0;
    const char *insn = "none";
#if defined(__x86_64__)
    if (kern_isa_best() >= KERN_ISA_AVX512VNNI) {
        peak = peak_vnni512(20000000);
        insn = "vpdpbusd zmm";
    } else if (kern_isa_best() >= KERN_ISA_AVX2) {
        peak = peak_avx2(20000000);
        insn = "vpmaddubsw+vpmaddwd ymm";
    }
#endif
    model_t *m = NULL;
    double macs = 0, bytes = 96e6;
    if (model_path != NULL) {
        char err[256];
        m = model_load(model_path, err, sizeof(err));
        if (m == NULL) {
            fprintf(stderr, "bench-ceiling: %s\n", err);
            return 1;
        }
        model_costs(m, &macs, &bytes);
    }
    const double bw_mem = bandwidth(threads, BIG_BYTES);
    const double bw_ws = bandwidth(threads, (size_t)(bytes / threads));
    printf("read bandwidth, %d threads: %.1f GB/s from memory (256 MiB each), %.1f GB/s over %.0f MB\n",
           threads, bw_mem, bw_ws, bytes / 1e6);
    printf("int8 dot product peak:  %.0f GMAC/s per thread (%s), %.0f GMAC/s for %d\n", peak, insn,
           peak * threads, threads);
    if (m == NULL)
        return 0;
    const double t_mem = bytes / (bw_ws * 1e9), t_mac = macs / (peak * threads * 1e9);
    printf("model: %.1f M multiply-adds per token, %.1f MB of weights per step%s\n", macs / 1e6, bytes / 1e6,
           m->packed_bytes ? " (packed)" : "");
    printf("floor, decode batch 1:  %.0f tokens/s (weights / bandwidth; products alone %.0f)\n",
           1.0 / (t_mem > t_mac ? t_mem : t_mac), 1.0 / t_mac);
    for (int B = 8; B <= 32; B *= 4) {
        const double t = B * t_mac > t_mem ? B * t_mac : t_mem;
        printf("floor, decode batch %-2d: %.0f tokens/s (%s)\n", B, B / t,
               B * t_mac > t_mem ? "products at peak" : "weights / bandwidth");
    }
    model_destroy(&m);
    return 0;
}
