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
 *   3. matrix products of SmolLM2's shapes (Q4_1 layers, Q8_0 output head)
 *      and Gemma 3 270M's (Q5_0, Q4_K, Q6_K, a 262144-row Q8_0 head)
 *      for 1, 8, 64 and 256 tokens: time against the lower bound weight bytes /
 *      copy bandwidth (the bound of small batches), and multiply-adds per
 *      second (what bounds large ones);
 *   4. the whole decode step of the GPU engine (engine/gpu_engine.h) on a
 *      random model of SmolLM2-135M's shape (Q4_1 layers, Q8_0 tied
 *      embeddings) at batch {1, 16, 64, 256}, every sequence at context 512,
 *      greedy tokens computed on the device (gpu_engine_step_argmax): host
 *      wall time of the step (layout, uploads, kernels, the ids back), with
 *      CUDA graphs and kernel by kernel, against the lower bound (weight bytes
 *      + batch x context x KV bytes per token) / copy bandwidth; and the same
 *      step with tokens sampled (the server's defaults) on the device
 *      (gpu_engine_step_sample) against logits copied to the host and sampled
 *      there.
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

#include <time.h>
#include <unistd.h>

#include "gpu_engine.h"
#include "kcuda.h"
#include "kvcache.h"
#include "mkmodel.h"
#include "model.h"
#include "quant.h"
#include "sampler.h"
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
    uint32_t type;          /* K and V type */
    int batch, ctx;
    double kv_mb, us, gbs, frac;
    double frac512;         /* the same with splits of 512 positions */
};

/* Decode attention over a cache of `type` (K and V alike): every (batch,
 * context) pair, or with `few` batches 8 and 64 at 4,096 positions. */
static int bench_attn(kcuda_timer_t *t, double copy_gbs, struct attn_row *rows, uint32_t type, bool few)
{
    static const int all_b[] = { 1, 8, 64, 256 }, all_c[] = { 512, 4096, 32768 }, few_b[] = { 8, 64 },
                     few_c[] = { 4096 };
    const int *batches = few ? few_b : all_b, *ctxs = few ? few_c : all_c;
    const int n_b = few ? 2 : 4, n_c = few ? 1 : 3;
    const size_t row = kern_row_bytes(type, A_DIM);
    const size_t head_bytes = (size_t)A_BT * row, block_bytes = 2 * (size_t)A_KV * head_bytes;
    const int max_b = 256, max_ctx = 32768;
    const size_t n_blocks = (size_t)max_b * max_ctx / A_BT;
    /* one layer per block: the blocks a step reads for one layer are laid out
     * as in the full pool (2 KiB of one head's keys, then its values, per block) */
    uint8_t *pool = dev_alloc(n_blocks * block_bytes);
    if (kcuda_memset(pool, 0x3c, n_blocks * block_bytes, NULL))     /* halves (and scales) of ~1.06 */
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
    for (int bi = 0; bi < n_b; bi++)
        for (int ci = 0; ci < n_c; ci++) {
            const int B = batches[bi], ctx = ctxs[ci];
            for (int s = 0; s < B; s++)
                seqs[s] = (struct kcuda_seq){ .row = s, .n_tok = 1, .pos = ctx - 1,
                                              .table = (uint32_t)((size_t)s * (ctx / A_BT)) };
            if (kcuda_upload(dseqs, seqs, (size_t)B * sizeof(struct kcuda_seq)))
                die("upload");
            struct attn_case c = { .a = {
                .kv = { .k = pool, .v = pool + (size_t)A_KV * head_bytes, .block_stride = block_bytes,
                        .k_head_stride = head_bytes, .v_head_stride = head_bytes, .k_type = type,
                        .v_type = type, .block_tokens = A_BT, .head_dim = A_DIM, .n_head = A_HEADS,
                        .n_head_kv = A_KV },
                .out = dout, .q = dq, .seqs = dseqs, .n_seq = B, .tables = dtab, .max_tok = 1, .max_ctx = ctx,
                .scale = 0.125f, .split = 0, .scratch = dscr,
            } };
            const double ms = time_median(run_attn, &c, t);
            c.a.split = 512;
            const double ms512 = time_median(run_attn, &c, t);
            const double bytes = (double)B * ctx * A_KV * row * 2;
            struct attn_row *r = &rows[n++];
            r->type = type;
            r->batch = B;
            r->ctx = ctx;
            r->kv_mb = bytes / 1e6;
            r->us = ms * 1e3;
            r->gbs = bytes / (ms * 1e-3) / 1e9;
            r->frac = r->gbs / copy_gbs;
            r->frac512 = bytes / (ms512 * 1e-3) / 1e9 / copy_gbs;
            printf("  attention %s batch %3d ctx %5d: %8.1f us  %7.1f GB/s  %5.1f%% of copy (split 512: %5.1f%%)\n",
                   kern_type_info(type)->name, B, ctx, r->us, r->gbs, 100 * r->frac, 100 * r->frac512);
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

/* ---- matrix products ---------------------------------------------------------------- */

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
        /* Gemma 3 270M's (Q4_K_M: Q5_0 / Q8_0 where a width is no multiple of 256) */
        { "g3 q proj", KERN_Q5_0, 1024, 640 },
        { "g3 gate/up", KERN_Q5_0, 2048, 640 },
        { "g3 o proj", KERN_Q4_K, 640, 1024 },
        { "g3 down", KERN_Q4_K, 640, 2048 },
        { "g3 down", KERN_Q6_K, 640, 2048 },
        { "g3 head", KERN_Q8_0, 262144, 640 },
    };
    static const int Ts[] = { 1, 8, 64, 256 };
    enum { MAX_T = 256 };
    int n_rows = 0;
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const uint32_t wt = shapes[si].type, at = kern_vec_dot_type(wt);
        const int64_t rows = shapes[si].rows, n = shapes[si].n;
        const size_t rb = kern_row_bytes(wt, n), wbytes = rb * (size_t)rows;
        uint8_t *w = malloc(wbytes);
        float *x = malloc((size_t)n * MAX_T * sizeof(float));
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t i = 0; i < n; i++)
                x[i] = frand() * 0.05f;
            kern_quantize_row(wt, x, w + (size_t)r * rb, n);
        }
        for (int64_t i = 0; i < n * MAX_T; i++)
            x[i] = frand();
        void *dw = dev_alloc(wbytes), *dx = dev_alloc((size_t)n * MAX_T * sizeof(float));
        const size_t astride = (kern_act_row_bytes(at, n) + 15) / 16 * 16;
        void *dact = dev_alloc(astride * MAX_T), *dout = dev_alloc((size_t)rows * MAX_T * sizeof(float));
        if (kcuda_upload(dw, w, wbytes) || kcuda_upload(dx, x, (size_t)n * MAX_T * sizeof(float)))
            die("upload");
        if (kcuda_quantize_act(at, dx, (size_t)n, dact, astride, n, MAX_T, NULL))
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
            printf("  %-11s %5lld x %-5lld %s T %3d: %8.2f us (bound %6.2f us), %6.2f T multiply-adds/s\n", r->name,
                   (long long)rows, (long long)n, kern_type_info(wt)->name, r->T, r->us, r->bound_us,
                   (double)rows * n * r->T / (r->us * 1e-6) / 1e12);
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

/* ---- the whole decode step ------------------------------------------------------------ */

#define STEP_CTX 512
#define STEP_RUNS 15

struct step_row {
    int batch;
    double weight_mb, kv_mb, bound_us;
    double graph_us, eager_us;  /* medians */
    double first_us;            /* the first step with graphs on: records the graph */
    double sample_us;           /* graphs, tokens sampled on the device (median) */
    double host_us;             /* graphs, logits to the host and sampled there (median) */
};

/* How a timed step chooses its tokens. */
enum choice { CHOOSE_ARGMAX, CHOOSE_DEVICE, CHOOSE_HOST };
static enum choice choice = CHOOSE_ARGMAX;
static const struct sampler_draw *const *draw_of;   /* CHOOSE_DEVICE: one per row */
static sampler_t *host_smp;                          /* CHOOSE_HOST */

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* One step of the batch, timed from the host, after an L2 flush. */
static double step_us(gpu_engine_t *e, const struct fwd_seq *f, int B)
{
    char err[256];
    const int32_t *ids;
    uint32_t rows;
    if (kcuda_argmax(flush_ids, flush_buf, FLUSH_BYTES / 4 / 64, FLUSH_BYTES / 4 / 64, 64, NULL) || kcuda_sync())
        die("flush");
    const double t0 = now_us();
    int rc;
    if (choice == CHOOSE_DEVICE) {
        rc = gpu_engine_step_sample(e, f, (uint32_t)B, draw_of, &ids, &rows, err, sizeof(err));
    } else if (choice == CHOOSE_HOST) {
        const float *logits;
        rc = gpu_engine_step(e, f, (uint32_t)B, &logits, &rows, err, sizeof(err));
        const uint32_t V = gpu_engine_config(e)->n_vocab;
        for (uint32_t r = 0; rc == 0 && r < rows; r++) {
            sampler_reseed(host_smp, r);
            sampler_sample(host_smp, logits + (size_t)r * V, NULL, 0);
        }
    } else {
        rc = gpu_engine_step_argmax(e, f, (uint32_t)B, &ids, &rows, err, sizeof(err));
    }
    if (rc) {
        fprintf(stderr, "bench-gpu: step: %s\n", err);
        exit(1);
    }
    return now_us() - t0;
}

static double step_median(gpu_engine_t *e, const struct fwd_seq *f, int B)
{
    double us[STEP_RUNS];
    for (int i = 0; i < 2; i++)
        step_us(e, f, B);
    for (int i = 0; i < STEP_RUNS; i++)
        us[i] = step_us(e, f, B);
    qsort(us, STEP_RUNS, sizeof(double), cmp_double);
    return us[STEP_RUNS / 2];
}

static int bench_step(double copy_gbs, struct step_row *rows, char *graph_note, size_t note_len)
{
    static const int batches[] = { 1, 16, 64, 256 };
    const int max_b = 256, bps = STEP_CTX / 16 + 1;
    char dir[] = "/tmp/kvd-bench-gpu-XXXXXX", path[64], err[256];
    if (mkdtemp(dir) == NULL)
        die("temporary directory");
    snprintf(path, sizeof(path), "%s/smollm2.gguf", dir);
    struct mkmodel_params mp = mkmodel_default_params();
    mp.n_layer = 30;
    mp.n_embd = 576;
    mp.n_head = 9;
    mp.n_head_kv = 3;
    mp.n_ff = 1536;
    mp.n_vocab = 49152;
    mp.n_ctx = 2048;
    mp.rope_freq_base = 100000.0f;
    mp.wtype = KERN_Q4_1;
    mp.embd_type = KERN_Q8_0;
    mp.tied = true;
    if (mkmodel_write(&mp, path, err, sizeof(err))) {
        fprintf(stderr, "bench-gpu: mkmodel: %s\n", err);
        exit(1);
    }
    model_t *m = model_load(path, err, sizeof(err));
    unlink(path);
    rmdir(dir);
    if (m == NULL) {
        fprintf(stderr, "bench-gpu: model: %s\n", err);
        exit(1);
    }
    struct gpu_engine_params gp = gpu_engine_default_params();
    gp.max_tokens = max_b;
    gp.max_ctx = 2048;
    gp.kv_blocks = (uint32_t)(max_b * bps);
    gp.graphs = 1;
    gpu_engine_t *e = gpu_engine_new(m, 0, &gp, err, sizeof(err));
    if (e == NULL) {
        fprintf(stderr, "bench-gpu: gpu engine: %s\n", err);
        exit(1);
    }
    struct gpu_engine_kv kvi;
    gpu_engine_kv_info(e, &kvi);
    /* the cache as if prefilled: halves of ~1.06 everywhere (the step's time
     * does not depend on the values) */
    if (kcuda_memset(kvi.base, 0x3c, (size_t)kvi.n_blocks * kvi.block_bytes, NULL) || kcuda_sync())
        die("cache fill");
    uint32_t *tables = malloc((size_t)max_b * bps * sizeof(uint32_t));
    int32_t *tok = malloc((size_t)max_b * sizeof(int32_t));
    struct fwd_seq *f = malloc((size_t)max_b * sizeof(struct fwd_seq));
    if (tables == NULL || tok == NULL || f == NULL)
        die("host allocation");
    for (int i = 0; i < max_b * bps; i++)   /* sequence s owns every max_b-th block: scattered */
        tables[i] = (uint32_t)((i % bps) * max_b + i / bps);
    for (int s = 0; s < max_b; s++) {
        tok[s] = (int32_t)(3 + rng_u32() % 49000);
        f[s] = (struct fwd_seq){ .tokens = &tok[s], .n_tokens = 1, .pos = STEP_CTX - 1,
                                 .blocks = tables + (size_t)s * bps, .n_blocks = (uint32_t)bps };
    }
    /* sampled choice with the server's defaults (temperature 0.8, top-k 40,
     * top-p 0.95, min-p 0.05): on the device, or the logits to the host */
    struct sampler_params sp = sampler_default_params();
    host_smp = sampler_new(&sp, m->cfg.n_vocab, err, sizeof(err));
    struct sampler_draw *draws = malloc((size_t)max_b * sizeof(*draws));
    const struct sampler_draw **dp = malloc((size_t)max_b * sizeof(*dp));
    if (host_smp == NULL || draws == NULL || dp == NULL)
        die("sampler");
    for (int s = 0; s < max_b; s++) {
        sampler_reseed(host_smp, (uint64_t)s);
        sampler_plan(host_smp, NULL, 0, &draws[s]);
        dp[s] = &draws[s];
    }
    draw_of = dp;
    const double weight_bytes = (double)gpu_engine_weight_bytes(e);
    const double kv_tok = (double)kv_bytes_per_token(&m->cfg, KERN_F16, KERN_F16);
    int n = 0;
    for (size_t bi = 0; bi < sizeof(batches) / sizeof(batches[0]); bi++) {
        const int B = batches[bi];
        struct step_row *r = &rows[n++];
        r->batch = B;
        r->weight_mb = weight_bytes / 1e6;
        r->kv_mb = (double)B * STEP_CTX * kv_tok / 1e6;
        r->bound_us = (weight_bytes + (double)B * STEP_CTX * kv_tok) / (copy_gbs * 1e9) * 1e6;
        gpu_engine_set_graphs(e, true);
        r->first_us = step_us(e, f, B);
        r->graph_us = step_median(e, f, B);
        choice = CHOOSE_DEVICE;
        r->sample_us = step_median(e, f, B);
        choice = CHOOSE_HOST;
        r->host_us = step_median(e, f, B);
        choice = CHOOSE_ARGMAX;
        gpu_engine_set_graphs(e, false);
        r->eager_us = step_median(e, f, B);
        printf("  decode step batch %3d ctx %d: graphs %8.1f us, kernel by kernel %8.1f us, bound %7.1f us "
               "(first step with graphs %.1f us); sampled on the device %.1f us, logits to the host %.1f us\n", B,
               STEP_CTX, r->graph_us, r->eager_us, r->bound_us, r->first_us, r->sample_us, r->host_us);
        fflush(stdout);
    }
    struct gpu_engine_graph_stats st;
    gpu_engine_graph_stats(e, &st);
    snprintf(graph_note, note_len, "%llu graphs recorded, %llu replays%s%s", (unsigned long long)st.captures,
             (unsigned long long)st.replays, st.why_disabled[0] ? "; " : "", st.why_disabled);
    gpu_engine_destroy(&e);
    model_destroy(&m);
    sampler_destroy(&host_smp);
    free(draws);
    free(dp);
    free(tables);
    free(tok);
    free(f);
    return n;
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
    struct attn_row arows[12], qrows[4];
    const int na = bench_attn(t, copy_gbs, arows, KERN_F16, false);
    int nq = bench_attn(t, copy_gbs, qrows, KERN_Q8_0, true);
    nq += bench_attn(t, copy_gbs, qrows + nq, KERN_Q4_0, true);
    struct mv_row mrows[48];
    const int nm = bench_mv(t, copy_gbs, mrows);
    struct step_row srows[4];
    char graph_note[256];
    const int ns = bench_step(copy_gbs, srows, graph_note, sizeof(graph_note));

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
    printf("the same over quantized KV blocks (K and V alike), against F16 at the same batch and context:\n");
    printf("  type  batch   ctx   KV MB   time us    GB/s  of copy  time against F16\n");
    for (int i = 0; i < nq; i++) {
        const struct attn_row *r = &qrows[i];
        double f16_us = 0;
        for (int j = 0; j < na; j++)
            if (arows[j].batch == r->batch && arows[j].ctx == r->ctx)
                f16_us = arows[j].us;
        printf("  %-4s %6d %5d %7.1f %9.1f %7.0f  %6.1f%%  %.2fx faster\n", kern_type_info(r->type)->name, r->batch,
               r->ctx, r->kv_mb, r->us, r->gbs, 100 * r->frac, f16_us / r->us);
    }
    printf("matrix products (bound: the weights read once), L2 flushed; tera multiply-adds per second:\n");
    printf("  %-11s %-12s type    T  weight KB   time us  bound us  of bound   TMAC/s\n", "matrix", "shape");
    for (int i = 0; i < nm; i++) {
        const struct mv_row *r = &mrows[i];
        char shape[32];
        snprintf(shape, sizeof(shape), "%lldx%lld", (long long)r->rows, (long long)r->n);
        printf("  %-11s %-12s %-4s %4d %9.1f %9.2f %9.2f  %6.1f%%  %7.2f\n", r->name, shape,
               kern_type_info(r->type)->name, r->T, r->kb, r->us, r->bound_us, 100 * r->bound_us / r->us,
               (double)r->rows * r->n * r->T / (r->us * 1e-6) / 1e12);
    }
    printf("decode step, SmolLM2-shaped random model (Q4_1), context %d, greedy ids on the device, host wall time, "
           "L2 flushed:\n", STEP_CTX);
    printf("  batch  weights MB   KV MB  bound us  graphs us  of bound  kernels us  of bound  graph gain  tok/s\n");
    for (int i = 0; i < ns; i++) {
        const struct step_row *r = &srows[i];
        printf("  %5d %11.1f %7.1f %9.1f %10.1f  %6.1f%% %11.1f  %6.1f%%  %9.2fx %7.0f\n", r->batch, r->weight_mb,
               r->kv_mb, r->bound_us, r->graph_us, 100 * r->bound_us / r->graph_us, r->eager_us,
               100 * r->bound_us / r->eager_us, r->eager_us / r->graph_us, r->batch / (r->graph_us * 1e-6));
    }
    printf("  (%s)\n", graph_note);
    printf("token choice in that step (graphs), sampled with temperature 0.8, top-k 40, top-p 0.95, min-p 0.05:\n");
    printf("  batch  greedy us  sampled on device us  logits to host + host sampler us  device gain\n");
    for (int i = 0; i < ns; i++) {
        const struct step_row *r = &srows[i];
        printf("  %5d %10.1f %21.1f %33.1f %11.2fx\n", r->batch, r->graph_us, r->sample_us, r->host_us,
               r->host_us / r->sample_us);
    }
    kcuda_free(flush_buf);
    kcuda_free(flush_ids);
    kcuda_timer_destroy(&t);
    return 0;
}
