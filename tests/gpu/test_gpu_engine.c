/*
 * test_gpu_engine.c - the GPU forward step (engine/gpu_engine.h) against the
 * CPU engine (engine/forward.h) and against itself.
 *
 * Random models written by mkmodel: "q4_1" (2 layers, 256 wide, 4 heads over
 * 2 KV heads of 64, Q4_1 layers, Q8_0 tied embeddings), "f16" (2 layers, 256
 * wide, 2 heads over 1 KV head of 128, F16 layers and embeddings, a separate
 * output matrix, attention splits of 64 positions), three "gemma3" ones (6
 * layers, 256 wide, 4 heads over 1 KV head of 256, layers 0-4 in a window of
 * 40 positions, so a cache in 6 parts of one layer, each with its own block
 * table; Q4_K, Q5_0 over a K q8_0 / V q4_0 cache, and Q6_K layers; measured
 * logits 2.1e-2..2.5e-2 from the CPU's) and "smollm2" (SmolLM2-135M's
 * shape: 30 layers, 576 wide, 9 heads over 3 of 64, feed-forward 1536, vocab
 * 49152, Q4_1 layers, Q8_0 tied embeddings). Both engines run the same steps
 * over the same block tables (scattered block ids, lengths that are no
 * multiple of the block size): a prefill step mixing whole prompts, first
 * chunks and a one-token prompt; a step mixing the remaining chunks with decode
 * tokens; then decode steps of every sequence, each fed the CPU's greedy
 * token. Checked:
 *
 *   - logits: per returned row, max |gpu - cpu| / max |cpu| <= TOL_LOGITS.
 *     Why that bound: the backends differ by rounding only (f32 sums in other
 *     orders; the CPU's attention rounds its probabilities to f16 and is
 *     ~4e-4 from exact where the GPU's is ~1e-6; __expf and sincosf against
 *     libm). But every layer re-quantizes its inputs to 8 bits per block of
 *     32, and a rounding difference that moves a value across a quantization
 *     boundary becomes one whole quantum (1/127 of the block's largest value):
 *     the attention's rounding differences come out of a Q8 model as ~2e-2 of
 *     the logits. The CPU engine shows the same against itself: cutting its
 *     attention into ranges of 16 positions instead of 1024 (nothing but
 *     rounding) moves its logits by 1e-2..2.5e-2 on these Q4_1 models and by
 *     ~5e-4 on the F16 one; the test measures and prints that yardstick on
 *     the same batches. Measured GPU against CPU (emulation): 2.4e-2 (q4_1),
 *     5e-4 (f16), 2.6e-2 (smollm2), with the yardstick at 2.3e-2 (q4_1) and
 *     4.9e-4 (f16). The bound leaves a factor of two over the worst;
 *   - greedy agreement wherever the CPU's margin between its best two logits
 *     exceeds twice the bound (elsewhere a flip is legitimate; counted);
 *   - the device argmax equals sampler_argmax over the GPU's own logits, and
 *     the device's sampled choice (gpu_engine_step_sample) equals
 *     sampler_pick's over them (greedy, sampled, a draw left to the host, a
 *     row without one); draws out of range are refused;
 *   - the K/V cache: the GPU's blocks against the CPU's, position by position
 *     for the positions written, normwise per layer (largest difference over
 *     the largest value): layer 0 within two f16 steps (its inputs differ
 *     only by the rounding of one norm and one product; an element may differ
 *     by more relative to itself where its dot product cancels), every layer
 *     within TOL_KV (measured: 1.3e-4..2.5e-4 in layer 0, up to 3.2e-2 over
 *     SmolLM2's 30 layers; the CPU's yardstick cache is printed alongside);
 *     Over quantized caches (K q8_0 / V q4_0 rotated on a q4_1 model, K/V
 *     q4_0 rotated on an f16 one) the logits keep TOL_LOGITS (measured
 *     1.4e-2 and 8e-7) and the cache TOL_KV_Q4: a rounding difference that
 *     moves a value across a 4-bit boundary is one whole code step, up to
 *     1/7 of its block's largest value (measured: 0 in layer 0 of both, 8.9e-2
 *     over the layers of the q4_1 model, the CPU against itself 6.9e-2);
 *   - invariance, bit for bit (the GPU against itself): each sequence run
 *     alone in fresh blocks, in one chunk and in chunks of 13 (logits of every
 *     position), gives the logits the batched run gave at those positions and
 *     the same cache bytes (a gemma3 model's windowed tables hold POOL_NONE
 *     where no window of the chunk reads any more, as the pool hands them out:
 *     a read there would fault or change the bits); decode steps replayed as CUDA graphs and run kernel
 *     by kernel agree; a second engine borrowing the first one's cache, and
 *     weights uploaded apart (gpu_weights_upload, as kvd shares them),
 *     continues a sequence the first one computed, to the same bits;
 *   - bad input (token id >= vocab, block id >= blocks, past the context, too
 *     many tokens, an empty batch, a short block table): the CPU engine's
 *     code and message, and the engine works afterwards.
 *   - context windowing (check_window): block copies and the keys' turn on
 *     the device against kvcache_copy_block and engine_kv_shift from the same
 *     bytes, bit for bit on the emulation; the next step on the windowed
 *     table within the logits bound; refused for a cache in parts.
 *
 * `--small` skips the SmolLM2-shaped model. Exits 77 (skip) where no CUDA
 * device is usable.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "err.h"
#include "f16.h"
#include "forward.h"
#include "gpu_engine.h"
#include "kcuda.h"
#include "kcuda_engine.h"
#include "kvcache.h"
#include "mkmodel.h"
#include "ops.h"
#include "quant.h"
#include "model.h"
#include "sampler.h"
#include "types.h"

#define TOL_LOGITS 6e-2     /* normwise, GPU against CPU logits (see above) */
#define TOL_KV0 0x1p-9      /* layer 0: two f16 steps at the layer's largest value */
#define TOL_KV 8e-2         /* normwise per layer, GPU against CPU cache */
#define TOL_KV_Q4 0.2       /* the same over a cache with q4_0 halves (see above) */
#define MAX_SEQ 5
#define SETS 3              /* block sets: the batched run, alone in one chunk, alone in chunks */
#define BPS 24              /* blocks per sequence and set */
#define MAX_POS (BPS * 16)
#define CHUNK 13
#define MAX_PARTS 6         /* block tables per sequence (the gemma3 models' parts) */
#define POOL_NONE_ID 0xffffffffu    /* a table entry a window no longer reads */

static char tmpdir[] = "/tmp/kvd-test-gpu-engine-XXXXXX";
static uint64_t rng_state = 0x1f83d9abfb41bd6bull;

static uint32_t rng_u32(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

/* One sequence of a scenario, as both engines see it. */
struct seqst {
    int32_t hist[MAX_POS];  /* its tokens: the prompt, then the greedy tokens fed */
    uint32_t prompt;        /* prompt length */
    uint32_t len;           /* tokens computed so far */
    uint32_t blocks[SETS][MAX_PARTS][BPS];  /* per set, each part's table */
    const uint32_t *tabs[SETS][MAX_PARTS];  /* a model of several parts: the tables; else NULL */
    float *gpu[MAX_POS];    /* GPU logits of the batched run at each position (NULL: none) */
};

struct rig {
    const char *name;
    model_t *m;
    kvcache_t *kv;          /* the CPU engine's cache */
    engine_t *ce;
    kvcache_t *kv2;         /* the yardstick's cache */
    engine_t *ce2;          /* the CPU engine again, attention in ranges of 16 positions */
    gpu_engine_t *ge;
    uint32_t n_vocab, n_blocks;
    uint32_t split;         /* the GPU engine's attention split (0: default) */
    struct kv_params kvp;   /* both engines' KV types and rotation */
    struct kv_parts parts;  /* both engines' parts (one for a model without windows) */
    double tol_logits, tol_kv0, tol_kv;
    struct seqst seq[MAX_SEQ];
    int n_seq;
    /* what the comparisons found */
    double worst_logits, worst_kv0, worst_kv;
    double worst_cpu;       /* the CPU engine against itself with other attention ranges */
    double worst_cpu_kv;    /* the same for the cache, every layer */
    int rows, agree, must_agree, agree_ok;
};

/* What a step does to one sequence: n tokens from its current length (the
 * caller appends decode tokens to hist first). */
struct item {
    int s;
    uint32_t n;
};

static model_t *make_model(const struct mkmodel_params *p, const char *name)
{
    char path[512], err[256];
    snprintf(path, sizeof(path), "%s/%s.gguf", tmpdir, name);
    int rc = mkmodel_write(p, path, err, sizeof(err));
    if (rc != 0)
        fprintf(stderr, "mkmodel: %s\n", err);
    REQUIRE(rc == 0);
    model_t *m = model_load(path, err, sizeof(err));
    if (m == NULL)
        fprintf(stderr, "model_load: %s\n", err);
    REQUIRE(m != NULL);
    return m;
}

/* Largest |a - b| / max |b| over n values (NaN anywhere: infinite). */
static double normwise(const float *a, const float *b, size_t n, double *maxdiff)
{
    double e = 0, mx = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i]))
            return INFINITY;
        e = fmax(e, fabs((double)a[i] - b[i]));
        mx = fmax(mx, fabs((double)b[i]));
    }
    if (maxdiff)
        *maxdiff = e;
    return e / fmax(mx, 1e-30);
}

/* The CPU's best two logits' margin over its largest magnitude. */
static double margin(const float *l, uint32_t n)
{
    double a = -INFINITY, b = -INFINITY, mx = 0;
    for (uint32_t i = 0; i < n; i++) {
        mx = fmax(mx, fabs(l[i]));
        if (l[i] > a) {
            b = a;
            a = l[i];
        } else if (l[i] > b) {
            b = l[i];
        }
    }
    return (a - b) / fmax(mx, 1e-30);
}

/* A rig over an f16 cache (kvp NULL) or the types and rotation of kvp. */
static void rig_open(struct rig *r, const char *name, const struct mkmodel_params *mp, uint32_t split,
                     const struct kv_params *kvp)
{
    char err[256];
    memset(r, 0, sizeof(*r));
    r->name = name;
    r->split = split;
    r->m = make_model(mp, name);
    r->n_vocab = r->m->cfg.n_vocab;
    kv_parts_for_model(&r->m->cfg, &r->parts);
    const uint32_t n_parts = r->parts.n_parts;
    REQUIRE(n_parts <= MAX_PARTS);
    r->n_blocks = MAX_SEQ * SETS * BPS * n_parts + 8;
    struct kv_params kp = kvp ? *kvp : kv_default_params();
    kp.n_blocks = r->n_blocks;
    kp.block_tokens = 16;
    kp.parts = &r->parts;
    r->kvp = kp;
    r->tol_logits = TOL_LOGITS;
    r->tol_kv0 = TOL_KV0;
    r->tol_kv = TOL_KV;
    r->kv = kvcache_new(&r->m->cfg, &kp, err, sizeof(err));
    REQUIRE(r->kv != NULL);
    struct engine_params ep = engine_default_params();
    ep.max_ctx = MAX_POS;
    r->ce = engine_new(r->m, r->kv, &ep, err, sizeof(err));
    REQUIRE(r->ce != NULL);
    r->kv2 = kvcache_new(&r->m->cfg, &kp, err, sizeof(err));
    REQUIRE(r->kv2 != NULL);
    ep.attn_chunk = 16;
    r->ce2 = engine_new(r->m, r->kv2, &ep, err, sizeof(err));
    REQUIRE(r->ce2 != NULL);
    struct gpu_engine_params gp = gpu_engine_default_params();
    gp.max_ctx = MAX_POS;
    gp.kv_blocks = r->n_blocks;
    gp.attn_split = split;
    gp.k_type = kp.k_type;
    gp.v_type = kp.v_type;
    gp.rotate = kp.rotate;
    gp.parts = &r->parts;
    r->ge = gpu_engine_new(r->m, 0, &gp, err, sizeof(err));
    if (r->ge == NULL)
        fprintf(stderr, "gpu_engine_new: %s\n", err);
    REQUIRE(r->ge != NULL);
    /* scattered block tables, disjoint over sequences, sets and parts */
    static uint32_t perm[MAX_SEQ * SETS * BPS * MAX_PARTS + 8];
    for (uint32_t i = 0; i < r->n_blocks; i++)
        perm[i] = i;
    for (uint32_t i = r->n_blocks - 1; i > 0; i--) {
        uint32_t j = rng_u32() % (i + 1), x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
    for (int s = 0; s < MAX_SEQ; s++)
        for (int k = 0; k < SETS; k++)
            for (uint32_t part = 0; part < n_parts; part++) {
                memcpy(r->seq[s].blocks[k][part], perm + ((size_t)(s * SETS + k) * n_parts + part) * BPS,
                       sizeof(r->seq[s].blocks[k][part]));
                if (n_parts > 1)
                    r->seq[s].tabs[k][part] = r->seq[s].blocks[k][part];
            }
}

static void rig_close(struct rig *r)
{
    for (int s = 0; s < MAX_SEQ; s++)
        for (int p = 0; p < MAX_POS; p++)
            free(r->seq[s].gpu[p]);
    gpu_engine_destroy(&r->ge);
    engine_destroy(&r->ce);
    kvcache_destroy(&r->kv);
    engine_destroy(&r->ce2);
    kvcache_destroy(&r->kv2);
    model_destroy(&r->m);
}

static void fill_seq(struct fwd_seq *f, const struct seqst *q, uint32_t from, uint32_t n, int set, bool all)
{
    *f = (struct fwd_seq){ .tokens = q->hist + from, .n_tokens = n, .pos = from, .blocks = q->blocks[set][0],
                           .n_blocks = BPS, .all_logits = all,
                           .tables = q->tabs[set][0] != NULL ? q->tabs[set] : NULL };
}

/* One step of the batched run on both engines: compares the logits, keeps the
 * GPU's rows, advances the sequences. */
static void both_step(struct rig *r, const struct item *it, int n)
{
    struct fwd_seq f[MAX_SEQ];
    char err[256];
    for (int i = 0; i < n; i++) {
        struct seqst *q = &r->seq[it[i].s];
        REQUIRE(q->len + it[i].n <= MAX_POS);
        fill_seq(&f[i], q, q->len, it[i].n, 0, false);
    }
    const float *cl = NULL, *gl = NULL;
    uint32_t crows = 0, grows = 0;
    int rc = engine_step(r->ce, f, (uint32_t)n, &cl, &crows, err, sizeof(err));
    if (rc)
        fprintf(stderr, "engine_step: %s\n", err);
    REQUIRE(rc == 0);
    rc = gpu_engine_step(r->ge, f, (uint32_t)n, &gl, &grows, err, sizeof(err));
    if (rc)
        fprintf(stderr, "gpu_engine_step: %s\n", err);
    REQUIRE(rc == 0);
    REQUIRE(crows == (uint32_t)n && grows == (uint32_t)n);
    const uint32_t V = r->n_vocab;
    /* the yardstick: how far the CPU engine moves when only the rounding of
     * its attention changes (cl stays valid: another engine's buffer) */
    const float *yl = NULL;
    uint32_t yrows = 0;
    REQUIRE(engine_step(r->ce2, f, (uint32_t)n, &yl, &yrows, err, sizeof(err)) == 0 && yrows == (uint32_t)n);
    for (int i = 0; i < n; i++)
        r->worst_cpu = fmax(r->worst_cpu, normwise(yl + (size_t)i * V, cl + (size_t)i * V, V, NULL));
    for (int i = 0; i < n; i++) {
        struct seqst *q = &r->seq[it[i].s];
        const float *c = cl + (size_t)i * V, *g = gl + (size_t)i * V;
        const double e = normwise(g, c, V, NULL);
        r->worst_logits = fmax(r->worst_logits, e);
        CHECK(e <= r->tol_logits);
        if (!(e <= r->tol_logits))
            fprintf(stderr, "  %s: seq %d position %u: logits differ by %.3g\n", r->name, it[i].s,
                    q->len + it[i].n - 1, e);
        const int32_t ca = sampler_argmax(c, V), ga = sampler_argmax(g, V);
        r->rows++;
        r->agree += ca == ga;
        if (margin(c, V) > 2 * r->tol_logits) {
            r->must_agree++;
            r->agree_ok += ca == ga;
            CHECK_INT(ga, ca);
        }
        const uint32_t pos = q->len + it[i].n - 1;
        float *keep = malloc((size_t)V * sizeof(float));
        REQUIRE(keep != NULL);
        memcpy(keep, g, (size_t)V * sizeof(float));
        free(q->gpu[pos]);
        q->gpu[pos] = keep;
        q->len += it[i].n;
        /* the next token, should this sequence decode: the CPU's greedy choice */
        if (q->len >= q->prompt && q->len < MAX_POS)
            q->hist[q->len] = ca;
    }
}

/* n decode steps of every sequence. */
static void decode_steps(struct rig *r, int n)
{
    struct item it[MAX_SEQ] = { { 0, 0 } };
    for (int k = 0; k < n; k++) {
        for (int s = 0; s < r->n_seq; s++)
            it[s] = (struct item){ s, 1 };
        both_step(r, it, r->n_seq);
    }
}

/* Runs sequence s alone on the GPU in block set `set`, in chunks of `chunk`
 * tokens with every position's logits, and checks each against the batched
 * run's row at that position, bit for bit. */
static void alone(struct rig *r, int s, int set, uint32_t chunk)
{
    struct seqst *q = &r->seq[s];
    const uint32_t V = r->n_vocab;
    char err[256];
    int checked = 0, same = 0;
    /* a windowed part's entries that no window of the step reads any more are
     * POOL_NONE, as the pool hands them out: the engine must not touch them */
    uint32_t win[MAX_PARTS][BPS];
    const uint32_t *wt[MAX_PARTS];
    memcpy(win, q->blocks[set], sizeof(win));
    for (int part = 0; part < MAX_PARTS; part++)
        wt[part] = win[part];
    for (uint32_t from = 0; from < q->len; from += chunk) {
        const uint32_t n = q->len - from < chunk ? q->len - from : chunk;
        struct fwd_seq f;
        fill_seq(&f, q, from, n, set, true);
        if (f.tables != NULL) {
            for (uint32_t part = 1; part < r->parts.n_parts; part++)
                for (uint64_t b = 0; b < kv_window_first_block(r->parts.window[part], from, 16); b++)
                    win[part][b] = POOL_NONE_ID;
            f.tables = wt;
        }
        const float *gl = NULL;
        uint32_t rows = 0;
        int rc = gpu_engine_step(r->ge, &f, 1, &gl, &rows, err, sizeof(err));
        if (rc)
            fprintf(stderr, "gpu_engine_step: %s\n", err);
        REQUIRE(rc == 0 && rows == n);
        for (uint32_t i = 0; i < n; i++)
            if (q->gpu[from + i] != NULL) {
                checked++;
                same += memcmp(gl + (size_t)i * V, q->gpu[from + i], (size_t)V * sizeof(float)) == 0;
            }
    }
    CHECK_INT(same, checked);
    if (same != checked)
        fprintf(stderr, "  %s: seq %d alone in chunks of %u: %d of %d rows differ from the batched run\n",
                r->name, s, chunk, checked - same, checked);
}

/* The GPU's cache of sequence s (set 0) against the CPU's, and against the
 * GPU's own sets 1 and 2 (bit for bit). */
static void compare_kv(struct rig *r, int s)
{
    const struct seqst *q = &r->seq[s];
    const kvcache_t *kv = r->kv;
    const uint32_t bt = kv->block_tokens, hd = kv->head_dim, nkv = kv->n_head_kv;
    float cf[KERN_MAX_HEAD_DIM], gf[KERN_MAX_HEAD_DIM], yf[KERN_MAX_HEAD_DIM];
    uint8_t *g = malloc(kv->block_bytes), *g2 = malloc(kv->block_bytes);
    REQUIRE(g != NULL && g2 != NULL);
    char err[256];
    /* per layer: largest difference and magnitude over the sequence */
    double *diff = calloc(kv->n_layer, sizeof(double)), *mag = calloc(kv->n_layer, sizeof(double));
    double *ydiff = calloc(kv->n_layer, sizeof(double));
    REQUIRE(diff != NULL && mag != NULL && ydiff != NULL);
    long same_sets = 0, cmp_sets = 0;
    for (uint32_t b = 0; b * bt < q->len; b++) {
        for (uint32_t part = 0; part < kv->parts.n_parts; part++) {
            const uint32_t blk = q->blocks[0][part][b];
            REQUIRE(gpu_engine_kv_read(r->ge, blk, g, err, sizeof(err)) == 0);
            const uint32_t n_pos = q->len - b * bt < bt ? q->len - b * bt : bt;
            for (uint32_t l = 0; l < kv->n_layer; l++) {
                if (kv_part_of(&kv->parts, l) != part)
                    continue;       /* in another part's block */
                for (int which = 0; which < 2; which++)
                    for (uint32_t h = 0; h < nkv; h++) {
                        const size_t off = (size_t)(kv_block_ptr(kv, 0, l, which) - kv->mem) + h * kv_head_bytes(kv, which);
                        const uint8_t *cp = kv_block_ptr(kv, blk, l, which) + h * kv_head_bytes(kv, which);
                        const uint8_t *gp = g + off;
                        const uint8_t *yp = kv_block_ptr(r->kv2, blk, l, which) + h * kv_head_bytes(kv, which);
                        const uint32_t type = which ? kv->v_type : kv->k_type;
                        const size_t row = which ? kv->v_row_bytes : kv->k_row_bytes;
                        for (uint32_t t = 0; t < n_pos; t++) {
                            kern_dequantize_row(type, cp + t * row, cf, (int64_t)hd);
                            kern_dequantize_row(type, gp + t * row, gf, (int64_t)hd);
                            kern_dequantize_row(type, yp + t * row, yf, (int64_t)hd);
                            for (uint32_t i = 0; i < hd; i++) {
                                diff[l] = fmax(diff[l], fabs((double)gf[i] - cf[i]));
                                mag[l] = fmax(mag[l], fabs((double)cf[i]));
                                ydiff[l] = fmax(ydiff[l], fabs((double)yf[i] - cf[i]));
                            }
                        }
                    }
            }
            for (int set = 1; set < SETS; set++) {
                REQUIRE(gpu_engine_kv_read(r->ge, q->blocks[set][part][b], g2, err, sizeof(err)) == 0);
                for (uint32_t l = 0; l < kv->n_layer; l++) {
                    if (kv_part_of(&kv->parts, l) != part)
                        continue;
                    for (int which = 0; which < 2; which++)
                        for (uint32_t h = 0; h < nkv; h++) {
                            const size_t off = (size_t)(kv_block_ptr(kv, 0, l, which) - kv->mem) + h * kv_head_bytes(kv, which);
                            cmp_sets++;
                            same_sets += memcmp(g + off, g2 + off,
                                                (size_t)n_pos * (which ? kv->v_row_bytes : kv->k_row_bytes)) == 0;
                        }
                }
            }
        }
    }
    CHECK_INT(same_sets, cmp_sets);
    for (uint32_t l = 0; l < kv->n_layer; l++) {
        const double e = diff[l] / fmax(mag[l], 1e-30);
        if (l == 0) {
            r->worst_kv0 = fmax(r->worst_kv0, e);
            CHECK(e <= r->tol_kv0);
        }
        r->worst_kv = fmax(r->worst_kv, e);
        r->worst_cpu_kv = fmax(r->worst_cpu_kv, ydiff[l] / fmax(mag[l], 1e-30));
        CHECK(e <= r->tol_kv);
    }
    free(ydiff);
    free(diff);
    free(mag);
    free(g);
    free(g2);
}

/* Decode step of every sequence at its last computed position (rewriting the
 * same K/V), as logits into out (n_seq rows). */
static void redo_last(struct rig *r, gpu_engine_t *ge, float *out)
{
    struct fwd_seq f[MAX_SEQ];
    char err[256];
    for (int s = 0; s < r->n_seq; s++)
        fill_seq(&f[s], &r->seq[s], r->seq[s].len - 1, 1, 0, false);
    const float *gl = NULL;
    uint32_t rows = 0;
    int rc = gpu_engine_step(ge, f, (uint32_t)r->n_seq, &gl, &rows, err, sizeof(err));
    if (rc)
        fprintf(stderr, "gpu_engine_step: %s\n", err);
    REQUIRE(rc == 0 && rows == (uint32_t)r->n_seq);
    memcpy(out, gl, (size_t)rows * r->n_vocab * sizeof(float));
}

/* Graphs against kernel-by-kernel, the device argmax, and a second engine on
 * the first one's cache. */
static void check_replays(struct rig *r)
{
    const uint32_t V = r->n_vocab;
    const size_t bytes = (size_t)r->n_seq * V * sizeof(float);
    float *eager = malloc(bytes), *rec = malloc(bytes), *replay = malloc(bytes);
    REQUIRE(eager && rec && replay);
    struct gpu_engine_graph_stats st;
    gpu_engine_graph_stats(r->ge, &st);
    const bool graphs = st.enabled;
    gpu_engine_set_graphs(r->ge, false);
    redo_last(r, r->ge, eager);
    gpu_engine_set_graphs(r->ge, graphs);
    redo_last(r, r->ge, rec);
    redo_last(r, r->ge, replay);
    CHECK(memcmp(eager, rec, bytes) == 0);
    CHECK(memcmp(eager, replay, bytes) == 0);
    for (int s = 0; s < r->n_seq; s++) {
        const struct seqst *q = &r->seq[s];
        REQUIRE(q->gpu[q->len - 1] != NULL);
        CHECK(memcmp(eager + (size_t)s * V, q->gpu[q->len - 1], (size_t)V * sizeof(float)) == 0);
    }
    gpu_engine_graph_stats(r->ge, &st);
    if (kcuda_graphs_supported() && getenv("KVD_CUDA_GRAPHS") == NULL) {
        CHECK(st.enabled);
        CHECK(st.replays > 0);
    }

    /* the device's greedy tokens */
    struct fwd_seq f[MAX_SEQ];
    char err[256];
    for (int s = 0; s < r->n_seq; s++)
        fill_seq(&f[s], &r->seq[s], r->seq[s].len - 1, 1, 0, false);
    const int32_t *ids = NULL;
    uint32_t rows = 0;
    REQUIRE(gpu_engine_step_argmax(r->ge, f, (uint32_t)r->n_seq, &ids, &rows, err, sizeof(err)) == 0);
    REQUIRE(rows == (uint32_t)r->n_seq);
    for (int s = 0; s < r->n_seq; s++)
        CHECK_INT(ids[s], sampler_argmax(eager + (size_t)s * V, V));

    /* the device's sampled tokens: sampler_pick's over the same logits, for
     * greedy and sampled draws, one left to the host (top-k off), one row
     * without a draw */
    {
        static const struct sampler_params kinds[4] = {
            /* temperature, top-k, top-p, min-p, repetition penalty and its window, seed,
             * presence and frequency penalties (the whole history as output), no logit bias */
            { 0.0f, 40, 0.95f, 0.05f, 1.5f, 64, 1, 0.6f, 0.3f, 0, 0, NULL, NULL },
            { 0.8f, 40, 0.95f, 0.05f, 1.1f, 64, 2, -0.5f, 0.2f, 0, 0, NULL, NULL },
            { 1.0f, 0, 0.9f, 0.0f, 1.0f, 64, 3, 0.0f, 0.0f, 0, 0, NULL, NULL },
            { 1.2f, 1024, 1.0f, 0.02f, 1.0f, 64, 4, 0.0f, 0.0f, 0, 0, NULL, NULL },
        };
        sampler_t *smp[MAX_SEQ] = { NULL }, *scratch = NULL;
        struct sampler_draw dr[MAX_SEQ];
        const struct sampler_draw *dp[MAX_SEQ];
        for (int s = 0; s < r->n_seq; s++) {
            dp[s] = NULL;
            if (s == 4)
                continue;           /* no draw: -1 */
            smp[s] = sampler_new(&kinds[s % 4], V, err, sizeof(err));
            REQUIRE(smp[s] != NULL);
            const struct seqst *q = &r->seq[s];
            sampler_plan(smp[s], q->hist, q->len, &dr[s]);
            dp[s] = &dr[s];
        }
        scratch = sampler_new(&kinds[0], V, err, sizeof(err));
        REQUIRE(scratch != NULL);
        int rc = gpu_engine_step_sample(r->ge, f, (uint32_t)r->n_seq, dp, &ids, &rows, err, sizeof(err));
        if (rc)
            fprintf(stderr, "gpu_engine_step_sample: %s\n", err);
        REQUIRE(rc == 0 && rows == (uint32_t)r->n_seq);
        for (int s = 0; s < r->n_seq; s++)
            CHECK_INT(ids[s], dp[s] ? sampler_pick(scratch, dp[s], eager + (size_t)s * V) : -1);
        /* a draw that penalizes an id twice, or outside the vocabulary, or
         * whose u is not in [0, 1): refused before anything runs */
        if (r->n_seq >= 2) {
            struct sampler_draw bad = dr[1];
            const int32_t twice[2] = { 3, 3 }, outside[1] = { (int32_t)V };
            bad.penalized = twice;
            bad.n_penalized = 2;
            dp[1] = &bad;
            CHECK_INT(gpu_engine_step_sample(r->ge, f, (uint32_t)r->n_seq, dp, &ids, &rows, err, sizeof(err)),
                      KVD_EINVAL);
            CHECK(strstr(err, "twice or outside") != NULL);
            bad.penalized = outside;
            bad.n_penalized = 1;
            CHECK_INT(gpu_engine_step_sample(r->ge, f, (uint32_t)r->n_seq, dp, &ids, &rows, err, sizeof(err)),
                      KVD_EINVAL);
            bad = dr[1];
            bad.u = 1.0;
            CHECK_INT(gpu_engine_step_sample(r->ge, f, (uint32_t)r->n_seq, dp, &ids, &rows, err, sizeof(err)),
                      KVD_EINVAL);
            dp[1] = &dr[1];
            /* and the engine goes on */
            REQUIRE(gpu_engine_step_sample(r->ge, f, (uint32_t)r->n_seq, dp, &ids, &rows, err, sizeof(err)) == 0);
            CHECK_INT(ids[1], sampler_pick(scratch, dp[1], eager + V));
        }
        for (int s = 0; s < MAX_SEQ; s++)
            sampler_destroy(&smp[s]);
        sampler_destroy(&scratch);
    }

    /* a second engine borrowing this one's cache continues every sequence */
    struct gpu_engine_kv kvi;
    gpu_engine_kv_info(r->ge, &kvi);
    struct gpu_engine_params gp = gpu_engine_default_params();
    gp.max_ctx = MAX_POS;
    gp.kv_base = kvi.base;
    gp.kv_blocks = kvi.n_blocks;
    gp.attn_split = r->split;
    gp.k_type = r->kvp.k_type;
    gp.v_type = r->kvp.v_type;
    gp.rotate = r->kvp.rotate;
    gp.parts = &r->parts;
    gp.kv_bytes = (uint64_t)kvi.n_blocks * kvi.block_bytes - 1;    /* one byte short: refused */
    CHECK(gpu_engine_new(r->m, 0, &gp, err, sizeof(err)) == NULL);
    CHECK(strstr(err, "cannot hold") != NULL);
    gp.kv_bytes = (uint64_t)kvi.n_blocks * kvi.block_bytes;
    /* ... and weights uploaded apart, as kvd shares them between workers */
    const uint64_t wb = gpu_weights_bytes(r->m);
    CHECK(wb == gpu_engine_weight_bytes(r->ge));
    void *wdev = kcuda_malloc(wb);
    REQUIRE(wdev != NULL);
    CHECK_INT(gpu_weights_upload(r->m, 0, wdev, wb - 1, err, sizeof(err)), KVD_ERANGE);
    CHECK_INT(gpu_weights_upload(r->m, 0, wdev, wb, err, sizeof(err)), 0);
    gp.weights_base = wdev;
    gp.weights_bytes = wb - 256;                                    /* short: refused */
    CHECK(gpu_engine_new(r->m, 0, &gp, err, sizeof(err)) == NULL);
    CHECK(strstr(err, "shared weights hold") != NULL);
    gp.weights_bytes = wb;
    gpu_engine_t *g2 = gpu_engine_new(r->m, 0, &gp, err, sizeof(err));
    if (g2 == NULL)
        fprintf(stderr, "gpu_engine_new (borrowed cache and weights): %s\n", err);
    REQUIRE(g2 != NULL);
    CHECK(gpu_engine_weights_borrowed(g2) && !gpu_engine_weights_borrowed(r->ge));
    struct gpu_engine_kv k2;
    gpu_engine_kv_info(g2, &k2);
    CHECK(!k2.owned && k2.base == kvi.base && k2.block_bytes == kvi.block_bytes);
    redo_last(r, g2, rec);
    CHECK(memcmp(eager, rec, bytes) == 0);
    CHECK_INT(gpu_engine_fence(g2, err, sizeof(err)), 0);
    gpu_engine_destroy(&g2);
    kcuda_free(wdev);                                               /* never freed by g2 */
    free(eager);
    free(rec);
    free(replay);
}

/* Bad input gets the CPU engine's code and message; the engine still works. */
static void check_bad_input(struct rig *r)
{
    struct seqst *q = &r->seq[0];
    int32_t tok[2] = { 5, 7 };
    uint32_t blocks[BPS];
    memcpy(blocks, q->blocks[2][0], sizeof(blocks));
    struct fwd_seq good;
    fill_seq(&good, q, 0, 2, 2, false);
    good.tokens = tok;
    struct fwd_seq cases[6];
    int n_cases = 0;
    struct fwd_seq b = good;
    int32_t badtok[2] = { 5, (int32_t)r->n_vocab };
    b.tokens = badtok;
    cases[n_cases++] = b;                      /* token id = vocab */
    int32_t negtok[2] = { -1, 5 };
    b = good;
    b.tokens = negtok;
    cases[n_cases++] = b;                      /* negative token id */
    uint32_t badblocks[BPS];
    memcpy(badblocks, blocks, sizeof(badblocks));
    badblocks[0] = r->n_blocks;
    b = good;
    b.blocks = badblocks;
    const uint32_t *badtabs[MAX_PARTS];
    if (good.tables != NULL) {                 /* part 0's table is the one named */
        memcpy(badtabs, good.tables, sizeof(badtabs));
        badtabs[0] = badblocks;
        b.tables = badtabs;
    }
    cases[n_cases++] = b;                      /* block id = blocks */
    b = good;
    b.pos = MAX_POS - 1;
    cases[n_cases++] = b;                      /* past the context */
    b = good;
    b.n_blocks = 0;
    cases[n_cases++] = b;                      /* short block table */
    b = good;
    b.n_tokens = 0;
    cases[n_cases++] = b;                      /* no tokens */
    for (int i = 0; i < n_cases; i++) {
        char ce[256] = "", ge[256] = "";
        const float *l = NULL;
        uint32_t rows = 0;
        int crc = engine_step(r->ce, &cases[i], 1, &l, &rows, ce, sizeof(ce));
        int grc = gpu_engine_step(r->ge, &cases[i], 1, &l, &rows, ge, sizeof(ge));
        CHECK(crc != 0);
        CHECK_INT(grc, crc);
        CHECK(strcmp(ce, ge) == 0);
        if (strcmp(ce, ge) != 0)
            fprintf(stderr, "  cpu: %s\n  gpu: %s\n", ce, ge);
        const int32_t *ids = NULL;
        CHECK_INT(gpu_engine_step_argmax(r->ge, &cases[i], 1, &ids, &rows, ge, sizeof(ge)), crc);
    }
    char ce[256] = "", ge[256] = "";
    const float *l = NULL;
    uint32_t rows = 0;
    CHECK_INT(gpu_engine_step(r->ge, &good, 0, &l, &rows, ge, sizeof(ge)), KVD_EINVAL);
    CHECK_INT(engine_step(r->ce, &good, 0, &l, &rows, ce, sizeof(ce)), KVD_EINVAL);
    CHECK(strcmp(ce, ge) == 0);
    /* too many tokens for one step (512): two sequences of 300 */
    int32_t *many = calloc(300, sizeof(int32_t));
    REQUIRE(many != NULL);
    struct fwd_seq two[2];
    fill_seq(&two[0], q, 0, 300, 1, false);
    fill_seq(&two[1], &r->seq[1], 0, 300, 1, false);
    two[0].tokens = two[1].tokens = many;
    CHECK_INT(gpu_engine_step(r->ge, two, 2, &l, &rows, ge, sizeof(ge)), KVD_ERANGE);
    CHECK_INT(engine_step(r->ce, two, 2, &l, &rows, ce, sizeof(ce)), KVD_ERANGE);
    CHECK(strcmp(ce, ge) == 0);
    CHECK(strstr(ge, "exceeds 512") != NULL);
    free(many);
    uint8_t *blk = malloc(r->kv->block_bytes);
    REQUIRE(blk != NULL);
    CHECK_INT(gpu_engine_kv_read(r->ge, r->n_blocks, blk, ge, sizeof(ge)), KVD_ERANGE);
    /* a spare block round-trips through the host */
    for (size_t i = 0; i < r->kv->block_bytes; i++)
        blk[i] = (uint8_t)rng_u32();
    uint8_t *back = malloc(r->kv->block_bytes);
    REQUIRE(back != NULL);
    CHECK_INT(gpu_engine_kv_write(r->ge, r->n_blocks - 1, blk, ge, sizeof(ge)), 0);
    CHECK_INT(gpu_engine_kv_read(r->ge, r->n_blocks - 1, back, ge, sizeof(ge)), 0);
    CHECK(memcmp(blk, back, r->kv->block_bytes) == 0);
    free(blk);
    free(back);
    /* still usable: the last decode step again, same bits */
    float *again = malloc((size_t)r->n_seq * r->n_vocab * sizeof(float));
    REQUIRE(again != NULL);
    redo_last(r, r->ge, again);
    for (int s = 0; s < r->n_seq; s++) {
        const struct seqst *qs = &r->seq[s];
        CHECK(memcmp(again + (size_t)s * r->n_vocab, qs->gpu[qs->len - 1], (size_t)r->n_vocab * sizeof(float)) == 0);
    }
    free(again);
}

/* Set where the kernels run on the CPU emulation (the C twin's libm). */
static bool emulated;

/* Whether blocks a (GPU) and b (CPU) hold the same K/V: the same bytes on
 * the emulation; elsewhere every layer's values within tol of its largest
 * (CUDA's sin and cos may differ from libm's in the last bit, and the
 * re-rounding carries that into K). Returns the worst normwise difference
 * in *worst. */
static bool kv_block_same(const struct rig *r, const uint8_t *a, const uint8_t *b, double tol, double *worst)
{
    const kvcache_t *kv = r->kv;
    *worst = 0;
    if (memcmp(a, b, kv->block_bytes) == 0)
        return true;
    if (emulated)
        return false;
    float fa[KERN_MAX_HEAD_DIM], fb[KERN_MAX_HEAD_DIM];
    for (uint32_t l = 0; l < kv->n_layer; l++) {
        double diff = 0, mag = 0;
        for (int which = 0; which < 2; which++)
            for (uint32_t h = 0; h < kv->n_head_kv; h++)
                for (uint32_t t = 0; t < kv->block_tokens; t++) {
                    const size_t row = which ? kv->v_row_bytes : kv->k_row_bytes;
                    const size_t off = (size_t)(kv_block_ptr(kv, 0, l, which) - kv->mem) +
                                       h * kv_head_bytes(kv, which) + t * row;
                    const uint32_t type = which ? kv->v_type : kv->k_type;
                    kern_dequantize_row(type, a + off, fa, kv->head_dim);
                    kern_dequantize_row(type, b + off, fb, kv->head_dim);
                    for (uint32_t i = 0; i < kv->head_dim; i++) {
                        diff = fmax(diff, fabs((double)fa[i] - fb[i]));
                        mag = fmax(mag, fabs((double)fb[i]));
                    }
                }
        *worst = fmax(*worst, diff / fmax(mag, 1e-30));
    }
    return *worst <= tol;
}

/* Context windowing on both engines: gpu_engine_kv_copy and
 * gpu_engine_kv_shift against kvcache_copy_block and engine_kv_shift. The
 * longest sequence's blocks as the GPU computed them go into the CPU's cache
 * too, so that both start from the same bytes; then, as a Window from kvd
 * does, both keep its first block, drop the older half of the full blocks
 * after it, take the first block after the drop through a private copy into
 * a spare block and move the kept blocks' keys back by the dropped
 * positions. The copy must be the block's bytes; every block of the new
 * table the CPU's (bit for bit on the emulation, else within the rig's layer
 * 0 bound), the moved ones changed; and a decode step on the windowed table
 * gives logits within the rig's bound of the CPU's. A cache of several
 * parts is refused on the GPU (the CPU engine windows one: unit.forward,
 * kvd-run), as is a block outside the cache. */
static void check_window(struct rig *r)
{
    char err[256];
    const kvcache_t *kv = r->kv;
    const uint32_t bt = kv->block_tokens, NB = kv->n_blocks;
    uint32_t blk0 = r->seq[0].blocks[0][0][0];
    if (r->parts.n_parts > 1) {
        CHECK_INT(gpu_engine_kv_shift(r->ge, &blk0, 1, -16, err, sizeof(err)), KVD_EUNSUPPORTED);
        printf("engine %-8s window: refused on the GPU for a cache of %u parts\n", r->name, r->parts.n_parts);
        return;
    }
    const uint32_t out = NB;
    CHECK_INT(gpu_engine_kv_shift(r->ge, &out, 1, -16, err, sizeof(err)), KVD_ERANGE);
    CHECK_INT(gpu_engine_kv_copy(r->ge, &blk0, &out, 1, err, sizeof(err)), KVD_ERANGE);
    int s = 0;
    for (int i = 1; i < r->n_seq; i++)
        if (r->seq[i].len > r->seq[s].len)
            s = i;
    const struct seqst *q = &r->seq[s];
    const uint32_t *tab = q->blocks[0][0], used = (q->len + bt - 1) / bt, keep = 1;
    const uint32_t drop = (q->len / bt - keep) / 2;
    REQUIRE(drop >= 1);
    /* a block in no table: the private copy's */
    bool *taken = calloc(NB, sizeof(bool));
    REQUIRE(taken != NULL);
    for (int i = 0; i < MAX_SEQ; i++)
        for (int k = 0; k < SETS; k++)
            for (uint32_t b = 0; b < BPS; b++)
                taken[r->seq[i].blocks[k][0][b]] = true;
    uint32_t spare = 0;
    while (spare < NB && taken[spare])
        spare++;
    free(taken);
    REQUIRE(spare < NB);
    uint8_t *g = malloc(kv->block_bytes), *before = malloc(kv->block_bytes);
    REQUIRE(g != NULL && before != NULL);
    for (uint32_t b = 0; b < used; b++) {
        REQUIRE(gpu_engine_kv_read(r->ge, tab[b], g, err, sizeof(err)) == 0);
        memcpy(kv->mem + (size_t)tab[b] * kv->block_bytes, g, kv->block_bytes);
    }
    /* the new table: the kept block, the copy, the rest after the drop */
    uint32_t nt[BPS];
    const uint32_t n_new = BPS - drop, from = tab[keep + drop];
    for (uint32_t b = 0; b < n_new; b++)
        nt[b] = b < keep ? tab[b] : b == keep ? spare : tab[b + drop];
    kvcache_copy_block(r->kv, from, spare);
    CHECK_INT(gpu_engine_kv_copy(r->ge, &from, &spare, 1, err, sizeof(err)), 0);
    REQUIRE(gpu_engine_kv_read(r->ge, from, before, err, sizeof(err)) == 0);
    REQUIRE(gpu_engine_kv_read(r->ge, spare, g, err, sizeof(err)) == 0);
    CHECK(memcmp(g, before, kv->block_bytes) == 0);
    /* the blocks that hold positions after the window, moved back */
    const uint32_t n_moved = used - drop - keep;
    const int32_t delta = -(int32_t)(drop * bt);
    int rc = gpu_engine_kv_shift(r->ge, nt + keep, n_moved, delta, err, sizeof(err));
    if (rc)
        fprintf(stderr, "gpu_engine_kv_shift: %s\n", err);
    CHECK_INT(rc, 0);
    const uint32_t *tabs[1] = { nt };
    CHECK_INT(engine_kv_shift(r->ce, tabs, keep, n_moved, delta, err, sizeof(err)), 0);
    int same = 0, changed = 0;
    double worst = 0, w;
    for (uint32_t b = 0; b < keep + n_moved; b++) {
        REQUIRE(gpu_engine_kv_read(r->ge, nt[b], g, err, sizeof(err)) == 0);
        same += kv_block_same(r, g, kv->mem + (size_t)nt[b] * kv->block_bytes, r->tol_kv0, &w);
        worst = fmax(worst, w);
        if (nt[b] == spare)
            changed += memcmp(g, before, kv->block_bytes) != 0;
    }
    CHECK_INT(same, (int)(keep + n_moved));
    CHECK_INT(changed, 1);
    /* one decode step on the windowed table, at the position after the kept ones */
    const int32_t tok = 7;
    const struct fwd_seq f = { .tokens = &tok, .n_tokens = 1, .pos = q->len + (uint32_t)delta, .blocks = nt,
                               .n_blocks = n_new };
    const float *cl = NULL, *gl = NULL;
    uint32_t crows = 0, grows = 0;
    REQUIRE(engine_step(r->ce, &f, 1, &cl, &crows, err, sizeof(err)) == 0 && crows == 1);
    rc = gpu_engine_step(r->ge, &f, 1, &gl, &grows, err, sizeof(err));
    if (rc)
        fprintf(stderr, "gpu_engine_step: %s\n", err);
    REQUIRE(rc == 0 && grows == 1);
    const double e = normwise(gl, cl, r->n_vocab, NULL);
    CHECK(e <= r->tol_logits);
    printf("engine %-8s window: seq %d of %u positions, %u blocks dropped, %u moved by %d: %d/%u blocks as the "
           "CPU's (%s, worst %.2e), the next step's logits vs CPU %.2e\n",
           r->name, s, q->len, drop, n_moved, (int)delta, same, keep + n_moved,
           emulated ? "bit for bit" : "normwise", worst, e);
    free(g);
    free(before);
}

/* The whole scenario on one model. prompts: lengths of n sequences; the
 * first step takes first[i] tokens of each (the rest in the second step,
 * where sequences whose prompt is done decode one token). */
static void scenario(struct rig *r, const uint32_t *prompts, const uint32_t *first, int n, int n_decode,
                     bool bad_input)
{
    r->n_seq = n;
    for (int s = 0; s < n; s++) {
        struct seqst *q = &r->seq[s];
        q->prompt = prompts[s];
        for (uint32_t i = 0; i < q->prompt; i++)
            q->hist[i] = (int32_t)(3 + rng_u32() % (r->n_vocab - 3));
    }
    struct item it[MAX_SEQ] = { { 0, 0 } };
    for (int s = 0; s < n; s++)
        it[s] = (struct item){ s, first[s] };
    both_step(r, it, n);
    for (int s = 0; s < n; s++) {
        const struct seqst *q = &r->seq[s];
        it[s] = (struct item){ s, q->len < q->prompt ? q->prompt - q->len : 1 };
    }
    both_step(r, it, n);
    decode_steps(r, n_decode);
    for (int s = 0; s < n; s++) {
        alone(r, s, 1, r->seq[s].len);
        alone(r, s, 2, CHUNK);
        compare_kv(r, s);
    }
    check_replays(r);
    if (bad_input)
        check_bad_input(r);
    check_window(r);
    printf("engine %-8s %d seqs: logits vs CPU %.2e (bound %.0e; CPU vs itself, other attention ranges: "
           "%.2e), greedy %d/%d (%d/%d where the margin exceeds 2x the bound), KV vs CPU layer 0 %.2e, all %.2e (CPU vs itself %.2e)\n",
           r->name, n, r->worst_logits, r->tol_logits, r->worst_cpu, r->agree, r->rows, r->agree_ok, r->must_agree,
           r->worst_kv0, r->worst_kv, r->worst_cpu_kv);
    struct gpu_engine_graph_stats st;
    gpu_engine_graph_stats(r->ge, &st);
    printf("engine %-8s graphs: %s, %llu recorded, %llu replayed, %llu steps kernel by kernel%s%s\n", r->name,
           st.enabled ? "on" : "off", (unsigned long long)st.captures, (unsigned long long)st.replays,
           (unsigned long long)st.eager_steps, st.why_disabled[0] ? ": " : "", st.why_disabled);
    fflush(stdout);
}

/* The "q4_1" model: 2 layers, 256 wide, 4 heads over 2 KV heads of 64, Q4_1
 * layers, Q8_0 tied embeddings. */
static struct mkmodel_params small_q4_1(uint64_t seed)
{
    struct mkmodel_params p = mkmodel_default_params();
    p.n_embd = 256;
    p.n_head = 4;
    p.n_head_kv = 2;
    p.n_ff = 512;
    p.n_vocab = 1024;
    p.n_ctx = MAX_POS;
    p.wtype = KERN_Q4_1;
    p.embd_type = KERN_Q8_0;
    p.tied = true;
    p.seed = seed;
    return p;
}

/* The "f16" model: 2 layers, 256 wide, 2 heads over 1 KV head of 128, F16
 * layers and embeddings, a separate output matrix. */
static struct mkmodel_params small_f16(uint64_t seed)
{
    struct mkmodel_params p = mkmodel_default_params();
    p.n_embd = 256;
    p.n_head = 2;
    p.n_head_kv = 1;
    p.n_ff = 384;
    p.n_vocab = 700;
    p.n_ctx = MAX_POS;
    p.wtype = KERN_F16;
    p.embd_type = KERN_F16;
    p.tied = false;
    p.seed = seed;
    return p;
}

/* A "gemma3" model: 6 layers, 256 wide, 4 heads over 1 KV head of 256,
 * feed-forward 512, the first five layers in a window of 40 positions and
 * the sixth over everything (6 parts of one layer), wtype layers, Q8_0 tied
 * embeddings. */
static struct mkmodel_params small_gemma3(uint64_t seed, uint32_t wtype)
{
    struct mkmodel_params p = mkmodel_default_params();
    p.gemma3 = true;
    p.n_layer = 6;
    p.n_embd = 256;
    p.n_head = 4;
    p.n_head_kv = 1;
    p.head_dim = 256;
    p.n_ff = 512;
    p.n_vocab = 1024;
    p.n_ctx = MAX_POS;
    p.swa_window = 40;
    p.wtype = wtype;
    p.embd_type = KERN_Q8_0;
    p.tied = true;
    p.seed = seed;
    return p;
}

int main(int argc, char **argv)
{
    char why[256];
    if (kcuda_device_count(why, sizeof(why)) == 0) {
        printf("skip: %s\n", why);
        return KVD_TEST_SKIP;
    }
    const bool small = argc > 1 && strcmp(argv[1], "--small") == 0;
    struct kcuda_info info;
    REQUIRE(kcuda_device_open(0, &info) == 0);
    printf("device: %s, sm_%d%d\n", info.name, info.major, info.minor);
    emulated = strstr(info.name, "emulation") != NULL;
    REQUIRE(mkdtemp(tmpdir) != NULL);

    struct rig r;
    {
        struct mkmodel_params p = small_q4_1(11);
        rig_open(&r, "q4_1", &p, 0, NULL);
        /* seq 4 passes one attention split (256 positions) */
        const uint32_t prompts[] = { 45, 17, 1, 33, 300 }, first[] = { 45, 10, 1, 33, 150 };
        scenario(&r, prompts, first, 5, 6, true);
        rig_close(&r);
    }
    {
        struct mkmodel_params p = small_f16(12);
        rig_open(&r, "f16", &p, 64, NULL);
        const uint32_t prompts[] = { 70, 3, 130 }, first[] = { 33, 3, 130 };
        scenario(&r, prompts, first, 3, 4, false);
        rig_close(&r);
    }
    /* quantized caches: K q8_0 / V q4_0 with both halves rotated on the q4_1
     * model (head dim 64), K/V q4_0 rotated on the f16 one (head dim 128) */
    {
        struct mkmodel_params p = small_q4_1(14);
        struct kv_params kp = kv_default_params();
        kp.k_type = KERN_Q8_0;
        kp.v_type = KERN_Q4_0;
        kp.rotate = KV_ROT_K | KV_ROT_V;
        rig_open(&r, "q4_1-kq8_0-vq4_0", &p, 0, &kp);
        r.tol_kv0 = r.tol_kv = TOL_KV_Q4;
        const uint32_t prompts[] = { 45, 17, 1, 300 }, first[] = { 45, 10, 1, 150 };
        scenario(&r, prompts, first, 4, 4, false);
        rig_close(&r);
    }
    {
        struct mkmodel_params p = small_f16(15);
        struct kv_params kp = kv_default_params();
        kp.k_type = kp.v_type = KERN_Q4_0;
        kp.rotate = kv_rotate_default(kp.k_type, kp.v_type);
        rig_open(&r, "f16-kvq4_0", &p, 64, &kp);
        r.tol_kv0 = r.tol_kv = TOL_KV_Q4;
        const uint32_t prompts[] = { 70, 3, 130 }, first[] = { 33, 3, 130 };
        scenario(&r, prompts, first, 3, 4, false);
        rig_close(&r);
    }
    /* Gemma 3's layer, windows and weight types (Q5_0, Q4_K, Q6_K), its cache
     * in parts; sequences well past the window */
    {
        struct mkmodel_params p = small_gemma3(16, KERN_Q4_K);
        rig_open(&r, "gemma3-q4_k", &p, 64, NULL);
        const uint32_t prompts[] = { 60, 17, 1, 150 }, first[] = { 45, 10, 1, 70 };
        scenario(&r, prompts, first, 4, 5, true);
        rig_close(&r);
    }
    {
        struct mkmodel_params p = small_gemma3(17, KERN_Q5_0);
        struct kv_params kp = kv_default_params();
        kp.k_type = KERN_Q8_0;
        kp.v_type = KERN_Q4_0;
        kp.rotate = kv_rotate_default(kp.k_type, kp.v_type);
        rig_open(&r, "gemma3-q5_0-kq8_0-vq4_0", &p, 0, &kp);
        r.tol_kv0 = r.tol_kv = TOL_KV_Q4;
        const uint32_t prompts[] = { 90, 3, 44 }, first[] = { 50, 3, 44 };
        scenario(&r, prompts, first, 3, 4, false);
        rig_close(&r);
    }
    {
        struct mkmodel_params p = small_gemma3(18, KERN_Q6_K);
        rig_open(&r, "gemma3-q6_k", &p, 0, NULL);
        const uint32_t prompts[] = { 41, 100 }, first[] = { 30, 100 };
        scenario(&r, prompts, first, 2, 4, false);
        rig_close(&r);
    }
    if (!small) {
        struct mkmodel_params p = mkmodel_default_params();
        p.n_layer = 30;
        p.n_embd = 576;
        p.n_head = 9;
        p.n_head_kv = 3;
        p.n_ff = 1536;
        p.n_vocab = 49152;
        p.n_ctx = MAX_POS;
        p.rope_freq_base = 100000.0f;
        p.wtype = KERN_Q4_1;
        p.embd_type = KERN_Q8_0;
        p.tied = true;
        p.seed = 13;
        rig_open(&r, "smollm2", &p, 0, NULL);
        const uint32_t prompts[] = { 37, 20, 5 }, first[] = { 37, 12, 5 };
        scenario(&r, prompts, first, 3, 3, false);
        rig_close(&r);
    }

    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", tmpdir);
    return CHECK_DONE();
}
