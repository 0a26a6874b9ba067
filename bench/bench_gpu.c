/*
 * bench_gpu.c - what the CUDA kernels achieve against the GPU's measured ceiling.
 *
 *   1. device-to-device copy bandwidth: (bytes read + bytes written) / time of
 *      cudaMemcpy over 1 GiB buffers, the best of several runs;
 *   2. decode attention (SmolLM2-135M's heads: 9 query, 3 KV, dim 64; F16
 *      cache in blocks of 16 scattered over the pool): bytes of K/V read / time,
 *      as a fraction of the copy bandwidth, for batch {1, 8, 64, 256} x context
 *      {512, 4K, 32K} (the target is >= 70% where batch x context >= 64 x 1024),
 *      with the default split of the context (256 positions) and with 512;
 *   3. matrix-vector products of SmolLM2's shapes (Q4_1 layers, Q8_0 output
 *      head) against the lower bound weight bytes / copy bandwidth, for 1 and 8
 *      tokens.
 * Every timed run starts with the L2 cache flushed (a 256 MiB read), so small
 * cases are measured from memory, as a real step meets them; times are medians.
 * Prints a table; exits 77 where no CUDA device is usable. Benchmarks never
 * fail on speed.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kcuda.h"
#include "quant.h"
#include "types.h"

#define FLUSH_BYTES (256u << 20)
#define RUNS 9

static uint64_t rng_state = 0x853c49e6748fea9bull;

static uint32_t rng_u32(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

static float frand(void) { return (float)((double)rng_u32() / 2147483648.0 - 1.0); }

static void *flush_buf;     /* FLUSH_BYTES of floats, read before each timed run */
static void *flush_ids;     /* where that read leaves its (unused) results */

static void die(const char *what)
{
    fprintf(stderr, "bench-gpu: %s failed: %s\n", what, kcuda_last_error());
    exit(1);
}

static void *dev_alloc(size_t bytes)
{
    void *p = kcuda_malloc(bytes);
    if (p == NULL)
        die("device allocation");
    return p;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The work a timed run does. */
typedef int (*bench_fn)(void *ctx);

/* Median milliseconds of RUNS runs of fn, each after an L2 flush; fn is run
 * twice first to warm up. */
static double time_median(bench_fn fn, void *ctx, kcuda_timer_t *t)
{
    double ms[RUNS];
    for (int i = 0; i < 2; i++)
        if (fn(ctx))
            die("warm-up run");
    for (int i = 0; i < RUNS; i++) {
        /* a read-only pass over 256 MiB: the L2 then holds clean lines of
         * another buffer, so the run reads from memory and writes nothing back */
        if (kcuda_argmax(flush_ids, flush_buf, FLUSH_BYTES / 4 / 64, FLUSH_BYTES / 4 / 64, 64, NULL))
            die("flush");
        kcuda_timer_start(t, NULL);
        if (fn(ctx))
            die("timed run");
        ms[i] = kcuda_timer_stop(t, NULL);
        if (ms[i] < 0)
            die("timer");
    }
    if (kcuda_sync())
        die("kernel");
    qsort(ms, RUNS, sizeof(double), cmp_double);
    return ms[RUNS / 2];
}

/* ---- copy bandwidth ------------------------------------------------------------ */

static double copy_bandwidth(kcuda_timer_t *t, uint64_t mem_bytes)
{
    size_t bytes = (size_t)1 << 30;
    while (bytes > ((size_t)64 << 20) && bytes * 8 > mem_bytes)
        bytes /= 2;
    void *a = dev_alloc(bytes), *b = dev_alloc(bytes);
    kcuda_memset(a, 1, bytes, NULL);
    kcuda_memset(b, 2, bytes, NULL);
    double best = 0;
    for (int trial = 0; trial < 5; trial++) {
        const int reps = 10;
        kcuda_timer_start(t, NULL);
        for (int i = 0; i < reps; i++)
            if (kcuda_copy(i % 2 ? a : b, i % 2 ? b : a, bytes, NULL))
                die("copy");
        const double ms = kcuda_timer_stop(t, NULL);
        const double gbs = 2.0 * bytes * reps / (ms * 1e-3) / 1e9;
        if (trial > 0 && gbs > best)    /* the first trial warms up */
            best = gbs;
    }
    kcuda_free(a);
    kcuda_free(b);
    return best;
}

/* ---- decode attention ------------------------------------------------------------ */

#define A_HEADS 9
#define A_KV 3
#define A_DIM 64
#define A_BT 16

struct attn_case {
    struct kcuda_attn_args a;
};

static int run_attn(void *ctx)
{
    return kcuda_attn_decode(&((struct attn_case *)ctx)->a, NULL);
}

struct attn_row {
    int batch, ctx;
    double kv_mb, us, gbs, frac;
    double frac512;         /* the same with splits of 512 positions */
};

static int bench_attn(kcuda_timer_t *t, double copy_gbs, struct attn_row *rows)
{
    static const int batches[] = { 1, 8, 64, 256 }, ctxs[] = { 512, 4096, 32768 };
    const size_t head_bytes = (size_t)A_BT * A_DIM * 2, block_bytes = 2 * (size_t)A_KV * head_bytes;
    const int max_b = 256, max_ctx = 32768;
    const size_t n_blocks = (size_t)max_b * max_ctx / A_BT;
    /* one layer per block: the blocks a step reads for one layer are laid out
     * as in the full pool (2 KiB of one head's keys, then its values, per block) */
    uint8_t *pool = dev_alloc(n_blocks * block_bytes);
    if (kcuda_memset(pool, 0x3c, n_blocks * block_bytes, NULL))     /* halves of ~1.06 */
        die("pool fill");
    uint32_t *perm = malloc(n_blocks * sizeof(uint32_t));
    for (size_t i = 0; i < n_blocks; i++)
        perm[i] = (uint32_t)i;
    for (size_t i = n_blocks - 1; i > 0; i--) {    /* scattered, as a busy pool hands them out */
        const size_t j = ((uint64_t)rng_u32() << 32 | rng_u32()) % (i + 1);
        const uint32_t x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
    const size_t qbytes = (size_t)max_b * A_HEADS * A_DIM * sizeof(float);
    float *hq = malloc(qbytes);
    for (size_t i = 0; i < qbytes / sizeof(float); i++)
        hq[i] = frand();
    void *dq = dev_alloc(qbytes), *dout = dev_alloc(qbytes);
    if (kcuda_upload(dq, hq, qbytes))
        die("upload");
    void *dtab = dev_alloc(n_blocks * sizeof(uint32_t));
    if (kcuda_upload(dtab, perm, n_blocks * sizeof(uint32_t)))
        die("upload");
    void *dseqs = dev_alloc((size_t)max_b * sizeof(struct kcuda_seq));
    const size_t scratch = kcuda_attn_scratch_bytes(max_b, A_HEADS, A_DIM, max_ctx, 0);
    void *dscr = dev_alloc(scratch);
    struct kcuda_seq seqs[256];
    int n = 0;
    for (size_t bi = 0; bi < sizeof(batches) / sizeof(batches[0]); bi++)
        for (size_t ci = 0; ci < sizeof(ctxs) / sizeof(ctxs[0]); ci++) {
            const int B = batches[bi], ctx = ctxs[ci];
            for (int s = 0; s < B; s++)
                seqs[s] = (struct kcuda_seq){ .row = s, .n_tok = 1, .pos = ctx - 1,
                                              .table = (uint32_t)((size_t)s * (ctx / A_BT)) };
            if (kcuda_upload(dseqs, seqs, (size_t)B * sizeof(struct kcuda_seq)))
                die("upload");
            struct attn_case c = { .a = {
                .kv = { .k = pool, .v = pool + (size_t)A_KV * head_bytes, .block_stride = block_bytes,
                        .head_stride = head_bytes, .block_tokens = A_BT, .head_dim = A_DIM, .n_head = A_HEADS,
                        .n_head_kv = A_KV },
                .out = dout, .q = dq, .seqs = dseqs, .n_seq = B, .tables = dtab, .max_tok = 1, .max_ctx = ctx,
                .scale = 0.125f, .split = 0, .scratch = dscr,
            } };
            const double ms = time_median(run_attn, &c, t);
            c.a.split = 512;
            const double ms512 = time_median(run_attn, &c, t);
            const double bytes = (double)B * ctx * A_KV * A_DIM * 2 * 2;
            struct attn_row *r = &rows[n++];
            r->batch = B;
            r->ctx = ctx;
            r->kv_mb = bytes / 1e6;
            r->us = ms * 1e3;
            r->gbs = bytes / (ms * 1e-3) / 1e9;
            r->frac = r->gbs / copy_gbs;
            r->frac512 = bytes / (ms512 * 1e-3) / 1e9 / copy_gbs;
            printf("  attention batch %3d ctx %5d: %8.1f us  %7.1f GB/s  %5.1f%% of copy (split 512: %5.1f%%)\n",
                   B, ctx, r->us, r->gbs, 100 * r->frac, 100 * r->frac512);
            fflush(stdout);
        }
    kcuda_free(pool);
    kcuda_free(dq);
    kcuda_free(dout);
    kcuda_free(dtab);
    kcuda_free(dseqs);
    kcuda_free(dscr);
    free(perm);
    free(hq);
    return n;
}

/* ---- matrix-vector products --------------------------------------------------------- */

struct mv_case {
    struct kcuda_gemm_args g;
};

static int run_mv(void *ctx)
{
    return kcuda_gemm(&((struct mv_case *)ctx)->g, NULL);
}

struct mv_row {
    const char *name;
    uint32_t type;
    int64_t rows, n;
    int T;
    double kb, us, bound_us;
};

static int bench_mv(kcuda_timer_t *t, double copy_gbs, struct mv_row *out)
{
    static const struct { const char *name; uint32_t type; int64_t rows, n; } shapes[] = {
        { "q/o proj", KERN_Q4_1, 576, 576 },
        { "k/v proj", KERN_Q4_1, 192, 576 },
        { "gate/up", KERN_Q4_1, 1536, 576 },
        { "down", KERN_Q4_1, 576, 1536 },
        { "output head", KERN_Q8_0, 49152, 576 },
    };
    static const int Ts[] = { 1, 8 };
    int n_rows = 0;
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const uint32_t wt = shapes[si].type, at = kern_vec_dot_type(wt);
        const int64_t rows = shapes[si].rows, n = shapes[si].n;
        const size_t rb = kern_row_bytes(wt, n), wbytes = rb * (size_t)rows;
        uint8_t *w = malloc(wbytes);
        float *x = malloc((size_t)n * 8 * sizeof(float));
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t i = 0; i < n; i++)
                x[i] = frand() * 0.05f;
            kern_quantize_row(wt, x, w + (size_t)r * rb, n);
        }
        for (int64_t i = 0; i < n * 8; i++)
            x[i] = frand();
        void *dw = dev_alloc(wbytes), *dx = dev_alloc((size_t)n * 8 * sizeof(float));
        const size_t astride = (kern_act_row_bytes(at, n) + 15) / 16 * 16;
        void *dact = dev_alloc(astride * 8), *dout = dev_alloc((size_t)rows * 8 * sizeof(float));
        if (kcuda_upload(dw, w, wbytes) || kcuda_upload(dx, x, (size_t)n * 8 * sizeof(float)))
            die("upload");
        if (kcuda_quantize_act(at, dx, (size_t)n, dact, astride, n, 8, NULL))
            die("activation quantization");
        for (size_t ti = 0; ti < sizeof(Ts) / sizeof(Ts[0]); ti++) {
            struct mv_case c = { .g = {
                .wtype = wt, .w = dw, .row_bytes = rb, .rows = rows, .n = n, .act = dact, .act_stride = astride,
                .T = Ts[ti], .out = dout, .ldo = (size_t)rows, .add = false,
            } };
            const double ms = time_median(run_mv, &c, t);
            struct mv_row *r = &out[n_rows++];
            r->name = shapes[si].name;
            r->type = wt;
            r->rows = rows;
            r->n = n;
            r->T = Ts[ti];
            r->kb = wbytes / 1024.0;
            r->us = ms * 1e3;
            /* reading the weights once at the copy rate (bytes read + written / s) */
            r->bound_us = wbytes / (copy_gbs * 1e9) * 1e6;
            printf("  %-11s %5lld x %-5lld %s T %d: %7.2f us (bound %6.2f us)\n", r->name, (long long)rows,
                   (long long)n, kern_type_info(wt)->name, r->T, r->us, r->bound_us);
            fflush(stdout);
        }
        kcuda_free(dw);
        kcuda_free(dx);
        kcuda_free(dact);
        kcuda_free(dout);
        free(w);
        free(x);
    }
    return n_rows;
}

int main(void)
{
    char why[256];
    if (kcuda_device_count(why, sizeof(why)) == 0) {
        printf("bench-gpu: skip: %s\n", why);
        return 77;
    }
    struct kcuda_info info;
    if (kcuda_device_open(0, &info))
        die("device open");
    printf("device: %s, sm_%d%d, %d SMs, %.1f GiB\n", info.name, info.major, info.minor, info.sm_count,
           info.mem_bytes / 1073741824.0);
    kcuda_timer_t *t = kcuda_timer_new();
    if (t == NULL)
        die("timer");
    flush_buf = dev_alloc(FLUSH_BYTES);
    flush_ids = dev_alloc(64 * sizeof(int32_t));
    if (kcuda_memset(flush_buf, 0, FLUSH_BYTES, NULL))
        die("memset");

    const double copy_gbs = copy_bandwidth(t, info.mem_bytes);
    printf("copy bandwidth: %.1f GB/s (bytes read + written, device to device)\n", copy_gbs);
    fflush(stdout);
    struct attn_row arows[12];
    const int na = bench_attn(t, copy_gbs, arows);
    struct mv_row mrows[16];
    const int nm = bench_mv(t, copy_gbs, mrows);

    printf("\n== GPU summary: %s ==\n", info.name);
    printf("copy bandwidth %.0f GB/s\n", copy_gbs);
    printf("decode attention, SmolLM2 heads (9 q / 3 kv, dim 64), F16 KV, L2 flushed:\n");
    printf("  batch   ctx   KV MB   time us    GB/s  of copy  target        split 512\n");
    for (int i = 0; i < na; i++) {
        const struct attn_row *r = &arows[i];
        const int target = (long)r->batch * r->ctx >= 64L * 1024;
        printf("  %5d %5d %7.1f %9.1f %7.0f  %6.1f%%  %-12s  %6.1f%%\n", r->batch, r->ctx, r->kv_mb, r->us,
               r->gbs, 100 * r->frac, target ? (r->frac >= 0.70 ? ">=70% ok" : ">=70% MISSED") : "-",
               100 * r->frac512);
    }
    printf("matrix-vector products (weights read once), L2 flushed:\n");
    printf("  %-11s %-12s type  T  weight KB   time us  bound us  of bound\n", "matrix", "shape");
    for (int i = 0; i < nm; i++) {
        const struct mv_row *r = &mrows[i];
        char shape[32];
        snprintf(shape, sizeof(shape), "%lldx%lld", (long long)r->rows, (long long)r->n);
        printf("  %-11s %-12s %-4s %2d %9.1f %9.2f %9.2f  %6.1f%%\n", r->name, shape, kern_type_info(r->type)->name,
               r->T, r->kb, r->us, r->bound_us, 100 * r->bound_us / r->us);
    }
    kcuda_free(flush_buf);
    kcuda_free(flush_ids);
    kcuda_timer_destroy(&t);
    return 0;
}
