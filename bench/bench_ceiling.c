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
 *   AMX tile peak          where the products use AMX: one thread, tdpbssd
 *                          into four independent tiles of sums, with K = 64
 *                          (the instruction's whole depth) and K = 32 (one
 *                          32-value block a product, as the engine's steps)
 *
 * With -m MODEL it loads the model as the engine does (packed weights),
 * times the engine's own product on each of the model's matrix shapes (one
 * thread, 1, 8, 32 and 128 tokens; its share of the peak is taken in short rounds
 * that alternate with bursts of the peak loop, the median of seven), and prints the floors of a decode step: batch 1 cannot beat
 * (weight bytes read) / bandwidth, and batch B cannot beat
 * B x (multiply-adds per token) / peak, whatever the code around them does.
 *
 * It also walks a decode step's products alone (one token, the matrices in
 * the engine's order, a barrier after each) on N threads, against a plain
 * read of the same bytes walked the same way.
 *
 * With -b it measures the bandwidth alone and prints the batch-1 floor it
 * sets (bench/bench_cpu.py runs it beside each kvd-run, so that decode is
 * compared with the bandwidth of the same minute).
 *
 *   build/bench-ceiling [-m MODEL] [-t N] [-b]
 */
#include <getopt.h>
#include <pthread.h>
#include <stdbool.h>
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
#include "quant.h"
#include "types.h"

#define KVD_STR_(x) #x
#define KVD_STR(x) KVD_STR_(x)

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
    /* eight independent streams of 32-byte loads per 256 bytes, and the
     * next lines asked for ahead, as the engine's own loops do */
    __m256i a[8];
    for (int k = 0; k < 8; k++)
        a[k] = _mm256_setzero_si256();
    for (size_t i = 0; i < n; i += 256) {
        _mm_prefetch((const char *)p + i + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)p + i + 2048 + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)p + i + 2048 + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)p + i + 2048 + 192, _MM_HINT_T0);
        for (int k = 0; k < 8; k++)
            a[k] = _mm256_xor_si256(a[k], _mm256_load_si256((const __m256i *)(p + i + 32 * k)));
    }
    for (int k = 1; k < 8; k++)
        a[0] = _mm256_xor_si256(a[0], a[k]);
    return (uint64_t)_mm256_extract_epi64(a[0], 0);
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
    each = (each + 255) / 256 * 256;
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
        for (int i = 0; i < CHAINS; i++) {
            /* the product does not depend on the chain: without this the
             * compiler makes it once per pass and times twelve vpaddd */
            __asm__("" : "+x"(w));
            a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), one));
        }
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

__attribute__((target("avx2,avxvnni"))) static double peak_avxvnni(long iters)
{
    __m256i a[CHAINS];
    __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
    for (int i = 0; i < CHAINS; i++)
        a[i] = _mm256_set1_epi32(i);
    double t0 = now_s();
    for (long k = 0; k < iters; k++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++)
            a[i] = _mm256_dpbusd_avx_epi32(a[i], w, x);
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

#if defined(__x86_64__)
/* tdpbssd into tiles 0-3 from tiles 4 (16 x kbytes) and 5 (kbytes/4 x 64):
 * 16 x 16 x kbytes multiply-adds an instruction, four chains. */
static double peak_amx_k(long iters, int kbytes)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg;
    static int8_t src[2][1024] __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    cfg.rows[4] = 16;
    cfg.colsb[4] = (uint16_t)kbytes;
    cfg.rows[5] = (uint8_t)(kbytes / 4);
    cfg.colsb[5] = 64;
    memset(src, 1, sizeof(src));
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3" ::);
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm4" ::"r"(src[0]), "r"(64L) : "memory");
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm5" ::"r"(src[1]), "r"(64L) : "memory");
    const double t0 = now_s();
    for (long k = 0; k < iters; k++)
        __asm__ volatile("tdpbssd %%tmm5, %%tmm4, %%tmm0\n\t"
                         "tdpbssd %%tmm5, %%tmm4, %%tmm1\n\t"
                         "tdpbssd %%tmm5, %%tmm4, %%tmm2\n\t"
                         "tdpbssd %%tmm5, %%tmm4, %%tmm3" ::);
    const double t = now_s() - t0;
    __asm__ volatile("tilerelease" ::: "memory");
    return (double)iters * 4 * 16 * 16 * kbytes / t / 1e9;
}

static double peak_amx(long iters) { return peak_amx_k(iters, 64); }
#endif

/* One thread timing the engine's own product (kern_gemm, packed where the
 * model has packed copies) on matrix w at T tokens. */
struct product {
    struct kern_gemm_args g;
    void *act, *out;
    double macs;            /* per call */
};

static void product_init(struct product *p, const struct model_mat *w, int T)
{
    const uint32_t at = kern_vec_dot_type(w->type);
    const size_t stride = kern_act_row_bytes(at, w->cols);
    uint8_t *act = malloc(stride * (size_t)T);
    float *x = malloc((size_t)w->cols * sizeof(float));
    float *out = malloc((size_t)w->rows * (size_t)T * sizeof(float));
    void *scratch = aligned_alloc(64, (kern_gemm_scratch_bytes(w->cols, T) + 63) / 64 * 64);
    if (act == NULL || x == NULL || out == NULL || scratch == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (int t = 0; t < T; t++) {
        for (int64_t i = 0; i < w->cols; i++)
            x[i] = (float)((i * 7919 + t * 104729) % 2001) / 1000.0f - 1.0f;
        kern_quantize_act(at, x, act + (size_t)t * stride, w->cols);
    }
    free(x);
    p->g = (struct kern_gemm_args){ .wtype = w->type, .packed = w->packed, .w = w->data,
                                    .row_bytes = w->row_bytes, .n = w->cols, .r0 = 0, .r1 = (long)w->rows,
                                    .act = act, .act_stride = stride, .T = T, .out = out,
                                    .ldo = (size_t)w->rows, .scratch = scratch };
    p->act = act;
    p->out = out;
    p->macs = (double)w->rows * (double)w->cols * T;
    kern_gemm(&p->g);
}

/* GMAC/s over calls for about `seconds`. */
static double product_rate(struct product *p, double seconds)
{
    long reps = 0;
    const double t0 = now_s();
    double t;
    do {
        kern_gemm(&p->g);
        reps++;
    } while ((t = now_s() - t0) < seconds);
    return p->macs * reps / t / 1e9;
}

static void product_free(struct product *p)
{
    free(p->act);
    free(p->out);
    free(p->g.scratch);
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Rounds of (peak burst, product burst): the share of the peak is the median
 * of the rounds' ratios, each taken within a tenth of a second, so that a
 * machine whose speed drifts from one second to the next (a shared host)
 * moves both sides of a ratio alike. */
#define SHARE_ROUNDS 7

static void product_share(const struct model_mat *w, int T, double (*peak)(long), long burst,
                          double *rate, double *share)
{
    struct product p;
    product_init(&p, w, T);
    double r[SHARE_ROUNDS], s[SHARE_ROUNDS];
    for (int i = 0; i < SHARE_ROUNDS; i++) {
        const double pk = peak != NULL ? peak(burst) : 0;
        r[i] = product_rate(&p, 0.05);
        s[i] = pk > 0 ? r[i] / pk : 0;
    }
    product_free(&p);
    qsort(r, SHARE_ROUNDS, sizeof(double), cmp_double);
    qsort(s, SHARE_ROUNDS, sizeof(double), cmp_double);
    *rate = r[SHARE_ROUNDS / 2];
    *share = s[SHARE_ROUNDS / 2];
}

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

/*
 * A decode step's matrix products alone: n threads take the model's matrices
 * in the engine's order at one token, each an even share of every matrix's
 * row groups, with a barrier after each matrix (as the engine's jobs have),
 * and nothing else. Timed against the same walk with the products replaced
 * by a plain read of the same bytes in the same split, so the ratio says how
 * far the one-token kernels are from reading their weights, apart from the
 * rest of a step (attention, norms, the hand-offs between jobs).
 */
struct walk {
    const struct model_mat *mat[8 * 256 + 1];
    const struct model_mat *bytes[8 * 256 + 1]; /* narrow matrices packed wide, else mat's */
    uint8_t *act[8 * 256 + 1];
    int n_mats, threads, T;  /* T tokens, one activation row for all */
    bool read, as_bytes;
    int arrived, gen;       /* atomics: the spin barrier */
};

struct walker {
    struct walk *w;
    int ith;
    void *scratch;
    float *out;
    double seconds;
    uint64_t sink;
};

static void spin_barrier(struct walk *w)
{
    const int g = __atomic_load_n(&w->gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&w->arrived, 1, __ATOMIC_ACQ_REL) == w->threads) {
        __atomic_store_n(&w->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&w->gen, g + 1, __ATOMIC_RELEASE);
        return;
    }
    while (__atomic_load_n(&w->gen, __ATOMIC_ACQUIRE) == g) {
#if defined(__x86_64__)
        _mm_pause();
#endif
    }
}

static void *walker_main(void *arg)
{
    struct walker *k = arg;
    struct walk *w = k->w;
    spin_barrier(w);
    const double t0 = now_s();
    for (int i = 0; i < w->n_mats; i++) {
        const struct model_mat *m = w->as_bytes ? w->bytes[i] : w->mat[i];
        const long G = KERN_PACK_ROWS, units = m->packed ? (m->rows + G - 1) / G : (long)m->rows;
        const long u0 = units * k->ith / w->threads, u1 = units * (k->ith + 1) / w->threads;
        if (w->read) {
            const size_t unit_bytes = m->packed ? m->packed->group_bytes : m->row_bytes;
            const uint8_t *base = m->packed ? m->packed->data : m->data;
            k->sink ^= read_all(base + (size_t)u0 * unit_bytes, (size_t)(u1 - u0) * unit_bytes / 256 * 256);
        } else {
            const long r0 = m->packed ? u0 * G : u0, r1 = m->packed ? u1 * G : u1;
            struct kern_gemm_args g = {
                .wtype = m->type, .packed = m->packed, .w = m->data, .row_bytes = m->row_bytes, .n = m->cols,
                .r0 = r0, .r1 = r1 < m->rows ? r1 : (long)m->rows, .act = w->act[i],
                .act_stride = 0, .T = w->T,
                .out = k->out, .ldo = (size_t)m->rows, .scratch = k->scratch,
            };
            if (g.r0 < g.r1)
                kern_gemm(&g);
        }
        spin_barrier(w);
    }
    k->seconds = now_s() - t0;
    return NULL;
}

/* Seconds of the fastest of `rounds` walks of each kind, alternating; where
 * the model has matrices in narrow layouts (gemm.h: kern_pack_narrow),
 * t_bytes gets the products' walk with them packed as bytes instead, else 0. */
static void decode_walks(const model_t *m, int threads, int T, int rounds, double *t_prod, double *t_read,
                         double *t_bytes)
{
    struct walk *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    w->threads = threads;
    w->T = T;
    int n_narrow = 0;
    float x[8192];
    for (uint32_t l = 0; l <= m->cfg.n_layer && l < 256; l++) {
        const struct model_layer *L = &m->layers[l < m->cfg.n_layer ? l : 0];
        const struct model_mat *all[7] = { &L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down };
        const int n = l < m->cfg.n_layer ? 7 : 1;
        for (int i = 0; i < n; i++) {
            const struct model_mat *mt = l < m->cfg.n_layer ? all[i] : &m->output;
            const uint32_t at = kern_vec_dot_type(mt->type);
            uint8_t *a = malloc(kern_act_row_bytes(at, mt->cols));
            if (a == NULL || mt->cols > 8192) {
                fprintf(stderr, "bench-ceiling: no activations for a %lld-column matrix\n", (long long)mt->cols);
                exit(1);
            }
            for (int64_t c = 0; c < mt->cols; c++)
                x[c] = (float)((c * 7919) % 2001) / 1000.0f - 1.0f;
            kern_quantize_act(at, x, a, mt->cols);
            w->mat[w->n_mats] = mt;
            w->bytes[w->n_mats] = mt;
            const uint32_t pw = mt->packed != NULL ? mt->packed->wtype : 0;
            if (pw == KERN_Q4_0 || pw == KERN_Q5_0 || pw > 0xFF) {
                struct model_mat *b = malloc(sizeof(*b));
                const int was = kern_pack_narrow_set(0);
                if (b != NULL) {
                    *b = *mt;
                    b->packed = kern_pack(mt->type, mt->data, mt->row_bytes, mt->rows, mt->cols);
                }
                kern_pack_narrow_set(was);
                if (b == NULL || b->packed == NULL || b->packed->wtype != (pw > 0xFF ? kern_pk_source(pw) : KERN_Q8_0)) {
                    fprintf(stderr, "bench-ceiling: cannot pack a narrow matrix wide\n");
                    exit(1);
                }
                w->bytes[w->n_mats] = b;
                n_narrow++;
            }
            w->act[w->n_mats++] = a;
        }
    }
    int64_t widest = 1, most_rows = 1;
    for (int i = 0; i < w->n_mats; i++) {
        widest = w->mat[i]->cols > widest ? w->mat[i]->cols : widest;
        most_rows = w->mat[i]->rows > most_rows ? w->mat[i]->rows : most_rows;
    }
    struct walker k[64];
    for (int i = 0; i < threads; i++) {
        k[i] = (struct walker){ .w = w, .ith = i,
                                .scratch = aligned_alloc(64, (kern_gemm_scratch_bytes(widest, T) + 63) / 64 * 64),
                                .out = malloc((size_t)T * (size_t)most_rows * sizeof(float)) };
        if (k[i].scratch == NULL || k[i].out == NULL) {
            fprintf(stderr, "out of memory\n");
            exit(1);
        }
    }
    *t_prod = *t_read = *t_bytes = 1e30;
    const int kinds = n_narrow ? 3 : 2;
    for (int r = 0; r < kinds * rounds; r++) {
        w->read = r % kinds == 1;
        w->as_bytes = r % kinds == 2;
        pthread_t th[64];
        for (int i = 1; i < threads; i++)
            pthread_create(&th[i], NULL, walker_main, &k[i]);
        walker_main(&k[0]);
        double t = k[0].seconds;
        for (int i = 1; i < threads; i++) {
            pthread_join(th[i], NULL);
            t = k[i].seconds > t ? k[i].seconds : t;
        }
        double *best = w->read ? t_read : w->as_bytes ? t_bytes : t_prod;
        *best = t < *best ? t : *best;
    }
    if (!n_narrow)
        *t_bytes = 0;
    uint64_t sink = 0;
    for (int i = 0; i < threads; i++) {
        sink ^= k[i].sink;
        free(k[i].scratch);
        free(k[i].out);
    }
    if (sink == 42)
        fprintf(stderr, " ");
    for (int i = 0; i < w->n_mats; i++) {
        free(w->act[i]);
        if (w->bytes[i] != w->mat[i]) {
            struct model_mat *b = (struct model_mat *)w->bytes[i];
            kern_pack_free(&b->packed);
            free(b);
        }
    }
    free(w);
}

int main(int argc, char **argv)
{
    const char *model_path = NULL;
    int threads = 2, c;
    bool bandwidth_only = false;
    while ((c = getopt(argc, argv, "m:t:bh")) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 't': threads = atoi(optarg); break;
        case 'b': bandwidth_only = true; break;
        default:
            fprintf(stderr, "usage: bench-ceiling [-m MODEL] [-t THREADS] [-b]\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (threads < 1 || threads > 64) {
        fprintf(stderr, "bench-ceiling: -t takes 1..64\n");
        return 2;
    }
    double peak = 0;
    double (*peak_fn)(long) = NULL;
    const char *insn = "none";
#if defined(__x86_64__)
    /* the peak of the instruction the active path (KVD_ISA, KVD_AVXVNNI) multiplies with */
    if (bandwidth_only) {
        /* not measured */
    } else if (kern_isa() >= KERN_ISA_AVX512VNNI) {
        peak_fn = peak_vnni512;
        insn = "vpdpbusd zmm";
    } else if (kern_isa() >= KERN_ISA_AVX2 && kern_avxvnni()) {
        peak_fn = peak_avxvnni;
        insn = "vpdpbusd ymm";
    } else if (kern_isa() >= KERN_ISA_AVX2) {
        peak_fn = peak_avx2;
        insn = "vpmaddubsw+vpmaddwd ymm";
    }
    if (peak_fn != NULL)
        peak = peak_fn(20000000);
    /* the AMX tiles, where the products of KERN_AMX_MIN_T tokens and more use them */
    double amx_peak = 0, amx_block = 0;
    const bool amx = !bandwidth_only && kern_isa() >= KERN_ISA_AVX512VNNI && kern_amx();
    if (amx) {
        amx_peak = peak_amx_k(2000000, 64);
        amx_block = peak_amx_k(2000000, 32);
    }
#else
    const bool amx = false;
    const double amx_peak = 0, amx_block = 0;
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
    if (bandwidth_only) {
        if (m != NULL)
            printf("floor, decode batch 1:  %.0f tokens/s (weights / bandwidth)\n", bw_ws * 1e9 / bytes);
        model_destroy(&m);
        return 0;
    }
    printf("int8 dot product peak:  %.0f GMAC/s per thread (%s), %.0f GMAC/s for %d\n", peak, insn,
           peak * threads, threads);
    if (amx)
        printf("AMX tile peak:          %.0f GMAC/s per thread (tdpbssd, K = 64), %.0f at K = 32 (a block a "
               "product); the products use it from %d tokens\n",
               amx_peak, amx_block, KERN_AMX_MIN_T);
    else
        printf("AMX tile peak:          none (%s)\n",
               kern_amx_available() ? "KVD_AMX=0 or a lower KVD_ISA" : "no AMX-INT8 on this CPU, or the OS refused the tile data");
    if (m == NULL)
        return 0;
    const double t_mem = bytes / (bw_ws * 1e9), t_mac = macs / (peak * threads * 1e9);
    const struct model_mat *shapes[] = { &m->layers[0].wq, &m->layers[0].wk, &m->layers[0].w_gate,
                                         &m->layers[0].w_down, &m->output };
    printf("engine's product, 1 thread (GMAC/s, %% of the peak of the instruction it uses, timed beside it%s):\n",
           amx ? "; AMX tiles from " KVD_STR(KERN_AMX_MIN_T) " tokens" : "");
    printf("  %-10s %-12s %10s %10s %10s %10s\n", "weights", "shape", "T=1", "T=8", "T=32", "T=128");
    double sum32 = 0, macs32 = 0;
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        const struct model_mat *w = shapes[i];
        double r[4], f[4];
        const int Ts[4] = { 1, 8, 32, 128 };
        for (int k = 0; k < 4; k++) {
#if defined(__x86_64__)
            const bool tiles = amx && Ts[k] >= KERN_AMX_MIN_T && w->packed != NULL;
            product_share(w, Ts[k], tiles ? peak_amx : peak_fn, tiles ? 200000 : 4000000, &r[k], &f[k]);
#else
            product_share(w, Ts[k], peak_fn, 4000000, &r[k], &f[k]);
#endif
        }
        char shape[32];
        snprintf(shape, sizeof(shape), "%lldx%lld", (long long)w->rows, (long long)w->cols);
        printf("  %-10s %-12s %5.0f %3.0f%% %5.0f %3.0f%% %5.0f %3.0f%% %5.0f %3.0f%%\n",
               kern_type_info(w->type)->name, shape, r[0], 100 * f[0], r[1], 100 * f[1], r[2], 100 * f[2], r[3],
               100 * f[3]);
        const double wm = (double)w->rows * (double)w->cols;
        sum32 += wm / r[2];
        macs32 += wm;
    }
    const double rate32 = macs32 / sum32;  /* the shapes weighted by their multiply-adds */
    printf("model: %.1f M multiply-adds per token, %.1f MB of weights per step%s\n", macs / 1e6, bytes / 1e6,
           m->packed_bytes ? " (packed)" : "");
    double t_prod, t_read, t_bytes;
    decode_walks(m, threads, 1, 10, &t_prod, &t_read, &t_bytes);
    printf("decode batch 1, the step's products alone on %d threads: %.2f ms (%.0f tokens/s); a plain read of\n"
           "  their bytes in the same split and order: %.2f ms (%.0f tokens/s); products / read %.2f\n",
           threads, t_prod * 1e3, 1 / t_prod, t_read * 1e3, 1 / t_read, t_prod / t_read);
    if (t_bytes > 0) {
        printf("  with its narrow matrices packed wide (gemm.h: kern_pack_narrow): %.2f ms; narrow %.2fx faster\n",
               t_bytes * 1e3, t_bytes / t_prod);
        double t8, r8, b8;
        decode_walks(m, threads, 8, 10, &t8, &r8, &b8);
        printf("  the same at 8 tokens: narrow %.2f ms, bytes %.2f ms (%.2fx)\n", t8 * 1e3, b8 * 1e3, b8 / t8);
    }
    printf("floor, decode batch 1:  %.0f tokens/s (weights / bandwidth; products alone %.0f)\n",
           1.0 / (t_mem > t_mac ? t_mem : t_mac), 1.0 / t_mac);
    printf("products at the engine's rate (%.0f GMAC/s per thread at T=32): %.3f ms per token on %d threads\n",
           rate32, macs / (rate32 * 1e9 * threads) * 1e3, threads);
    for (int B = 8; B <= 32; B *= 4) {
        /* a batch that takes the tile products is bounded by their peak */
        const double tm = amx && B >= KERN_AMX_MIN_T ? macs / (amx_peak * threads * 1e9) : t_mac;
        const double t = B * tm > t_mem ? B * tm : t_mem;
        printf("floor, decode batch %-2d: %.0f tokens/s (%s)\n", B, B / t,
               B * tm > t_mem ? (amx && B >= KERN_AMX_MIN_T ? "products at the AMX peak" : "products at peak")
                              : "weights / bandwidth");
    }
    model_destroy(&m);
    return 0;
}
