/*
 * test_forward.c - the forward step against a naive reference, and the
 * numerics contract: paged equals contiguous, a sequence alone equals the same
 * sequence inside a batch, and chunked prefill equals one prefill, bit for bit.
 *
 * Models are small random llama GGUFs written by mkmodel into a temp dir.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attn.h"
#include "check.h"
#include "cpu.h"
#include "err.h"
#include "f16.h"
#include "forward.h"
#include "gemm.h"
#include "kvcache.h"
#include "mkmodel.h"
#include "model.h"
#include "pool.h"
#include "quant.h"
#include "types.h"

static char tmpdir[] = "/tmp/kvd-test-forward-XXXXXX";

/* ---- a naive reference: dense f32 weights, contiguous f32 KV, plain loops ---- */

/* Over an f16 cache, attention multiplies halves: K and V are stored as f16,
 * and the query and the probabilities are rounded to f16 (the engine's
 * specified precision, which is llama.cpp's). */
static bool kv_half;
static float half(float x) { return kv_half ? kvd_f16_to_f32(kvd_f32_to_f16(x)) : x; }

static float *dense(const struct model_mat *m)
{
    float *w = malloc((size_t)m->rows * m->cols * sizeof(float));
    REQUIRE(w != NULL);
    for (int64_t r = 0; r < m->rows; r++)
        REQUIRE(kern_dequantize_row(m->type, (const uint8_t *)m->data + r * m->row_bytes,
                                    w + r * m->cols, m->cols) == 0);
    return w;
}

/* y[rows] = W[rows][cols] x[cols], accumulated in double */
static void ref_matvec(float *y, const float *w, const float *x, int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++) {
        double s = 0;
        for (int64_t c = 0; c < cols; c++)
            s += (double)w[r * cols + c] * x[c];
        y[r] = (float)s;
    }
}

static void ref_norm(float *o, const float *x, const float *w, int n, float eps)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    double sc = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++)
        o[i] = (float)(x[i] * sc * w[i]);
}

/* RoPE on pairs (2i, 2i+1), or (i, i + hd/2) with neox. */
static void ref_rope(float *v, int n_heads, int hd, int pos, float base, bool neox)
{
    for (int h = 0; h < n_heads; h++)
        for (int i = 0; i < hd / 2; i++) {
            double th = pos * pow(base, -2.0 * i / hd);
            const int ia = h * hd + (neox ? i : 2 * i), ib = neox ? ia + hd / 2 : ia + 1;
            double a = v[ia], b = v[ib];
            v[ia] = (float)(a * cos(th) - b * sin(th));
            v[ib] = (float)(a * sin(th) + b * cos(th));
        }
}

/* Logits (n, n_vocab) of every position of toks, from scratch. Gemma 3 as
 * llama.cpp computes it: embeddings times sqrt(n_embd), per-head Q/K norms
 * before RoPE (rotating halves), windowed layers that see the last
 * swa_window positions with their own RoPE base, attention and FFN outputs
 * RMS-normed before the residual add, GELU (tanh form, on and to halves, as
 * llama.cpp's table of halves has it) gating. */
static float *ref_forward(const model_t *m, const int32_t *toks, int n)
{
    const struct model_config *c = &m->cfg;
    const int E = (int)c->n_embd, H = (int)c->n_head, KH = (int)c->n_head_kv, D = (int)c->head_dim;
    const int F = (int)c->n_ff, V = (int)c->n_vocab, L = (int)c->n_layer;
    float *emb = dense(&m->tok_embd), *outw = dense(&m->output);
    float *x = calloc((size_t)n * E, 4), *xb = malloc((size_t)E * 4), *q = malloc((size_t)H * D * 4);
    float *kc = malloc((size_t)L * n * KH * D * 4), *vc = malloc((size_t)L * n * KH * D * 4);
    float *att = malloc((size_t)H * D * 4), *tmp = malloc((size_t)(E > F ? E : F) * 4);
    float *g = malloc((size_t)F * 4), *u = malloc((size_t)F * 4), *sc = malloc((size_t)n * 4);
    float *logits = malloc((size_t)n * V * 4);
    REQUIRE(x && xb && q && kc && vc && att && tmp && g && u && sc && logits);
    const bool gemma = c->arch == MODEL_ARCH_GEMMA3;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < E; i++)
            x[(size_t)t * E + i] = emb[(size_t)toks[t] * E + i] * (gemma ? sqrtf((float)E) : 1.0f);
    for (int l = 0; l < L; l++) {
        const struct model_layer *ly = &m->layers[l];
        const bool win = gemma && l % 6 != 5;
        const float base = win ? 10000.0f : c->rope_base;
        float *wq = dense(&ly->wq), *wk = dense(&ly->wk), *wv = dense(&ly->wv), *wo = dense(&ly->wo);
        float *wg = dense(&ly->w_gate), *wu = dense(&ly->w_up), *wd = dense(&ly->w_down);
        for (int t = 0; t < n; t++) {
            float *xt = x + (size_t)t * E;
            float *kt = kc + ((size_t)l * n + t) * KH * D, *vt = vc + ((size_t)l * n + t) * KH * D;
            ref_norm(xb, xt, ly->attn_norm, E, c->rms_eps);
            ref_matvec(q, wq, xb, H * D, E);
            ref_matvec(kt, wk, xb, KH * D, E);
            ref_matvec(vt, wv, xb, KH * D, E);
            if (gemma) {
                for (int h = 0; h < H; h++)
                    ref_norm(q + h * D, q + h * D, ly->q_norm, D, c->rms_eps);
                for (int h = 0; h < KH; h++)
                    ref_norm(kt + h * D, kt + h * D, ly->k_norm, D, c->rms_eps);
            }
            ref_rope(q, H, D, t, base, gemma);
            ref_rope(kt, KH, D, t, base, gemma);
            const int j0 = win && t + 1 > (int)c->swa_window ? t + 1 - (int)c->swa_window : 0;
            for (int i = 0; i < KH * D; i++) {
                kt[i] = half(kt[i]);
                vt[i] = half(vt[i]);
            }
            for (int h = 0; h < H; h++) {
                int kh = h / (H / KH);
                double mx = -INFINITY, sum = 0;
                for (int j = j0; j <= t; j++) {
                    const float *kj = kc + ((size_t)l * n + j) * KH * D + kh * D;
                    double s = 0;
                    for (int d = 0; d < D; d++)
                        s += (double)half(q[h * D + d]) * kj[d];
                    sc[j] = (float)(s / sqrt((double)D));
                    mx = sc[j] > mx ? sc[j] : mx;
                }
                for (int j = j0; j <= t; j++)
                    sum += exp(sc[j] - mx);
                for (int d = 0; d < D; d++) {
                    double a = 0;
                    for (int j = j0; j <= t; j++)
                        a += (double)half((float)(exp(sc[j] - mx) / sum)) *
                             vc[((size_t)l * n + j) * KH * D + kh * D + d];
                    att[h * D + d] = (float)a;
                }
            }
            ref_matvec(tmp, wo, att, E, H * D);
            if (gemma)
                ref_norm(tmp, tmp, ly->post_attn_norm, E, c->rms_eps);
            for (int i = 0; i < E; i++)
                xt[i] += tmp[i];
            ref_norm(xb, xt, ly->ffn_norm, E, c->rms_eps);
            ref_matvec(g, wg, xb, F, E);
            ref_matvec(u, wu, xb, F, E);
            for (int i = 0; i < F; i++) {
                double z = g[i];
                if (gemma) {    /* GELU at llama.cpp's precision: halves in and out */
                    const double h = kvd_f16_to_f32(kvd_f32_to_f16(g[i]));
                    const float ge = (float)(0.5 * h * (1.0 + tanh(sqrt(2.0 / M_PI) * (h + 0.044715 * h * h * h))));
                    z = z <= -10 ? 0 : z >= 10 ? z : kvd_f16_to_f32(kvd_f32_to_f16(ge));
                    g[i] = (float)(z * u[i]);
                } else {
                    g[i] = (float)(z / (1.0 + exp(-z)) * u[i]);
                }
            }
            ref_matvec(tmp, wd, g, E, F);
            if (gemma)
                ref_norm(tmp, tmp, ly->post_ffn_norm, E, c->rms_eps);
            for (int i = 0; i < E; i++)
                xt[i] += tmp[i];
        }
        free(wq); free(wk); free(wv); free(wo); free(wg); free(wu); free(wd);
    }
    for (int t = 0; t < n; t++) {
        ref_norm(xb, x + (size_t)t * E, m->output_norm, E, c->rms_eps);
        ref_matvec(logits + (size_t)t * V, outw, xb, V, E);
    }
    free(emb); free(outw); free(x); free(xb); free(q); free(kc); free(vc);
    free(att); free(tmp); free(g); free(u); free(sc);
    return logits;
}

/* ---- helpers ------------------------------------------------------------------ */

static model_t *make_model(const struct mkmodel_params *p, const char *name)
{
    char path[256], err[256];
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

struct rig {
    kvcache_t *kv;
    engine_t *e;
};

static uint32_t rig_chunk;  /* the engines' attention range (0: the default) */
static uint32_t rig_shift;  /* their share_shift: each share of a job on another thread */

/* The KV format the contract tests run over (their caches are f16 otherwise). */
static struct kv_format {
    const char *name;
    uint32_t k_type, v_type, rotate;
} rig_fmt = { "f16", KERN_F16, KERN_F16, 0 };

static struct rig rig_new(const model_t *m, uint32_t block_tokens, uint32_t n_blocks, uint32_t dtype,
                          int threads)
{
    char err[256];
    struct kv_params kp = { .block_tokens = block_tokens, .n_blocks = n_blocks, .k_type = dtype, .v_type = dtype };
    if (dtype == KERN_F16) {
        kp.k_type = rig_fmt.k_type;
        kp.v_type = rig_fmt.v_type;
        kp.rotate = rig_fmt.rotate;
    }
    struct rig r;
    r.kv = kvcache_new(&m->cfg, &kp, err, sizeof(err));
    REQUIRE(r.kv != NULL);
    struct engine_params ep = engine_default_params();
    ep.max_tokens = 256;
    ep.n_threads = threads;
    ep.attn_chunk = rig_chunk;
    ep.share_shift = rig_shift;
    r.e = engine_new(m, r.kv, &ep, err, sizeof(err));
    REQUIRE(r.e != NULL);
    return r;
}

static void rig_free(struct rig *r)
{
    engine_destroy(&r->e);
    kvcache_destroy(&r->kv);
}

/* Runs toks through one sequence in chunks of `chunk`, collecting all logits. */
static float *run_chunks(struct rig *r, const int32_t *toks, int n, int chunk, const uint32_t *blocks,
                         uint32_t n_blocks)
{
    const uint32_t V = engine_model(r->e)->cfg.n_vocab;
    float *all = malloc((size_t)n * V * 4);
    REQUIRE(all != NULL);
    char err[256];
    for (int i = 0; i < n; i += chunk) {
        int m = n - i < chunk ? n - i : chunk;
        struct fwd_seq s = { toks + i, (uint32_t)m, (uint32_t)i, blocks, n_blocks, true, NULL };
        const float *lg;
        uint32_t rows;
        int rc = engine_step(r->e, &s, 1, &lg, &rows, err, sizeof(err));
        if (rc)
            fprintf(stderr, "engine_step: %s\n", err);
        REQUIRE(rc == 0 && rows == (uint32_t)m);
        memcpy(all + (size_t)i * V, lg, (size_t)m * V * 4);
    }
    return all;
}

static double max_abs(const float *a, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        m = fabs(a[i]) > m ? fabs(a[i]) : m;
    return m;
}

static double max_diff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        m = fabs((double)a[i] - b[i]) > m ? fabs((double)a[i] - b[i]) : m;
    return m;
}

static void random_tokens(int32_t *t, int n, uint32_t vocab, unsigned seed)
{
    srand(seed);
    for (int i = 0; i < n; i++)
        t[i] = 3 + rand() % (int)(vocab - 3);
}

/* ---- tests -------------------------------------------------------------------- */

/* The engine against the naive reference, for one model shape and weight type
 * (and, when kv_type is f16, the KV format of rig_fmt). */
static void test_against_reference(const char *name, uint32_t wtype, uint32_t etype, uint32_t heads,
                                   uint32_t kv_heads, bool tied, uint32_t kv_type, double rel_tol)
{
    kv_half = kv_type == KERN_F16 && rig_fmt.k_type == KERN_F16;
    struct mkmodel_params p = mkmodel_default_params();
    p.n_layer = 2;
    p.n_embd = kern_type_info(wtype)->block_elems == 256 ? 256 : 128;  /* the K-quants' rows are 256 */
    p.n_head = heads;
    p.n_head_kv = kv_heads;
    p.n_ff = 2 * p.n_embd;
    p.n_vocab = 400;
    p.wtype = wtype;
    p.embd_type = etype;
    p.tied = tied;
    p.seed = 7 + heads * 31 + kv_heads;
    model_t *m = make_model(&p, name);
    const int n = 40;
    int32_t toks[40];
    random_tokens(toks, n, p.n_vocab, 11);
    float *ref = ref_forward(m, toks, n);
    struct rig r = rig_new(m, 16, 8, kv_type, 2);
    uint32_t blocks[8] = { 5, 2, 7, 0, 1, 3, 4, 6 };
    float *got = run_chunks(&r, toks, n, n, blocks, 8);
    size_t total = (size_t)n * m->cfg.n_vocab;
    double scale = max_abs(ref, total), d = max_diff(ref, got, total);
    fprintf(stderr, "%s: max |logit| %.4f, max diff %.6f (%.2e relative)\n", name, scale, d, d / scale);
    CHECK(scale > 0.1);
    CHECK(d / scale <= rel_tol);
    /* the argmax agrees wherever the reference is not a near-tie */
    int agree = 0;
    for (int t = 0; t < n; t++) {
        const float *a = ref + (size_t)t * m->cfg.n_vocab, *b = got + (size_t)t * m->cfg.n_vocab;
        int ia = 0, ib = 0;
        for (uint32_t v = 1; v < m->cfg.n_vocab; v++) {
            ia = a[v] > a[ia] ? (int)v : ia;
            ib = b[v] > b[ib] ? (int)v : ib;
        }
        agree += ia == ib || fabs(a[ia] - a[ib]) < 2 * d;
    }
    CHECK_INT(agree, n);
    free(ref);
    free(got);
    rig_free(&r);
    model_destroy(&m);
}

/* Q4_0, Q5_0, Q5_K and Q6_K matrices packed in their own widths, Q4_K and
 * Q5_K with their file's scales (kern_pack_narrow, where this path reads
 * them), give the logits of the same model packed wide (Q8_0's bytes, the
 * K-quants' with f32 scales), bit for bit: the products' integer sums and
 * scales are the same. */
static void test_narrow_layouts(uint32_t wtype)
{
    kv_half = rig_fmt.k_type == KERN_F16;
    const bool q6 = wtype == KERN_Q6_K || wtype == KERN_Q4_K || wtype == KERN_Q5_K;  /* K-quants: rows of 256 */
    struct mkmodel_params p = mkmodel_default_params();
    p.n_layer = 2;
    p.n_embd = q6 ? 256 : 192;  /* 192: three 64-value pairs, an odd number of blocks of 32 */
    p.n_head = q6 ? 4 : 6;
    p.n_head_kv = 2;
    p.n_ff = q6 ? 512 : 320;
    p.n_vocab = 400;
    p.wtype = wtype;
    p.embd_type = KERN_Q8_0;
    p.seed = 23;
    const bool narrow = kern_pack_narrow(wtype);
    const uint32_t bytes = q6 ? wtype : KERN_Q8_0;
    char name[32];
    snprintf(name, sizeof(name), "narrow-%s", kern_type_info(wtype)->name);
    model_t *mn = make_model(&p, name);
    const int was = kern_pack_narrow_set(0);
    snprintf(name, sizeof(name), "bytes-%s", kern_type_info(wtype)->name);
    model_t *mb = make_model(&p, name);
    kern_pack_narrow_set(was);
    if (kern_isa() >= KERN_ISA_SIMD) {  /* the models are packed where the active path has products for it */
        REQUIRE(mn->layers[0].w_up.packed != NULL && mb->layers[0].w_up.packed != NULL);
        CHECK(mn->layers[0].w_up.packed->wtype ==
              (narrow ? (q6 ? (0x100u | wtype) : wtype) : bytes));
        CHECK(mb->layers[0].w_up.packed->wtype == bytes);
    }
    const int n = 40;
    int32_t toks[40];
    random_tokens(toks, n, p.n_vocab, 5);
    uint32_t blocks[8] = { 5, 2, 7, 0, 1, 3, 4, 6 };
    struct rig rn = rig_new(mn, 16, 8, KERN_F16, 2), rb = rig_new(mb, 16, 8, KERN_F16, 2);
    float *gn = run_chunks(&rn, toks, n, 9, blocks, 8), *gb = run_chunks(&rb, toks, n, 9, blocks, 8);
    fprintf(stderr, "%s in %s: logits %s the byte layout's\n", kern_type_info(wtype)->name,
            narrow ? "its own width" : "bytes", memcmp(gn, gb, (size_t)n * p.n_vocab * sizeof(float)) ? "differ from" : "equal");
    CHECK(memcmp(gn, gb, (size_t)n * p.n_vocab * sizeof(float)) == 0);
    free(gn);
    free(gb);
    rig_free(&rn);
    rig_free(&rb);
    model_destroy(&mn);
    model_destroy(&mb);
}

/* A random gemma3 model: 6 layers (5 windowed, 1 global), heads wider than
 * n_embd / n_head, a window of `window` positions. */
static model_t *make_gemma_heads(const char *name, uint32_t wtype, uint32_t window, uint32_t head_dim,
                                 uint32_t n_head)
{
    struct mkmodel_params p = mkmodel_default_params();
    p.gemma3 = true;
    p.n_layer = 6;
    p.n_embd = 128;
    p.n_head = n_head;
    p.n_head_kv = 1;
    p.head_dim = head_dim;
    p.swa_window = window;
    p.n_ff = 256;
    p.n_vocab = 400;
    p.wtype = wtype;
    p.embd_type = wtype == KERN_F32 ? KERN_F32 : KERN_Q8_0;
    p.tied = true;
    p.rope_freq_base = 1e6f;
    p.seed = 99;
    return make_model(&p, name);
}

static model_t *make_gemma(const char *name, uint32_t wtype, uint32_t window, uint32_t head_dim)
{
    return make_gemma_heads(name, wtype, window, head_dim, 4);
}

/* Gemma 3 against the reference: the window seen, and not more. */
static void test_gemma_against_reference(const char *name, uint32_t wtype, uint32_t kv_type, uint32_t head_dim,
                                         double rel_tol)
{
    kv_half = kv_type == KERN_F16;
    model_t *m = make_gemma(name, wtype, 7, head_dim);
    CHECK(m->cfg.arch == MODEL_ARCH_GEMMA3 && m->cfg.head_dim == head_dim && m->cfg.swa_window == 7);
    CHECK(model_layer_windowed(&m->cfg, 0) && model_layer_windowed(&m->cfg, 4) &&
          !model_layer_windowed(&m->cfg, 5));
    const int n = 40;
    int32_t toks[40];
    random_tokens(toks, n, m->cfg.n_vocab, 17);
    float *ref = ref_forward(m, toks, n);
    struct rig r = rig_new(m, 4, 12, kv_type, 2);
    uint32_t blocks[10] = { 9, 2, 7, 0, 11, 3, 4, 6, 1, 5 };
    float *got = run_chunks(&r, toks, n, n, blocks, 10);
    size_t total = (size_t)n * m->cfg.n_vocab;
    double scale = max_abs(ref, total), d = max_diff(ref, got, total);
    fprintf(stderr, "%s: max |logit| %.4f, max diff %.6f (%.2e relative)\n", name, scale, d, d / scale);
    CHECK(scale > 0.1);
    CHECK(d / scale <= rel_tol);
    /* a window of the whole context is another model: the window matters */
    struct model_config wide = m->cfg;
    ((model_t *)m)->cfg.swa_window = 1000;
    float *all = ref_forward(m, toks, n);
    ((model_t *)m)->cfg = wide;
    const double seen = max_diff(all + (size_t)8 * m->cfg.n_vocab, ref + (size_t)8 * m->cfg.n_vocab,
                                 (size_t)(n - 8) * m->cfg.n_vocab);
    fprintf(stderr, "%s: without the window the logits move by %.4f\n", name, seen);
    CHECK(seen > 20 * d);
    CHECK(max_diff(all, ref, (size_t)7 * m->cfg.n_vocab) == 0);    /* not before the window is full */
    free(all);
    free(ref);
    free(got);
    rig_free(&r);
    model_destroy(&m);
}


/* ---- a cache of parts (kvparts.h) --------------------------------------------- */

#define PT_BT 4u            /* positions per block */
#define PT_LOGICAL 50u      /* logical blocks per sequence: 200 positions */

/* One sequence's tables in a cache of parts, and what it has run. */
struct pt_seq {
    uint32_t *tab[KV_MAX_PARTS];
    const int32_t *toks;
    int n, done, chunk;
    float *logits;          /* n x V */
};

static void pt_poison(const kvcache_t *kv, uint32_t id)
{
    memset(kv->mem + (size_t)id * kv->block_bytes, 0xff, kv->block_bytes);  /* f16 NaN */
}

/* Releases (poisons, forgets) the blocks q's windowed parts no longer read. */
static void pt_slide(const kvcache_t *kv, struct pt_seq *q)
{
    for (uint32_t p = 1; p < kv->parts.n_parts; p++) {
        const uint64_t lo = kv_window_first_block(kv->parts.window[p], (uint64_t)q->done, PT_BT);
        for (uint64_t b = 0; b < lo; b++)
            if (q->tab[p][b] != POOL_NONE) {
                pt_poison(kv, q->tab[p][b]);
                q->tab[p][b] = POOL_NONE;
            }
    }
}

/* Runs the sequences together, each in its own chunks, sliding after each step. */
static void pt_run(struct rig *r, struct pt_seq *q, int nq)
{
    const uint32_t V = engine_model(r->e)->cfg.n_vocab;
    char err[256];
    for (;;) {
        struct fwd_seq fs[4];
        int idx[4], k = 0;
        for (int i = 0; i < nq; i++) {
            if (q[i].done >= q[i].n)
                continue;
            const int m = q[i].n - q[i].done < q[i].chunk ? q[i].n - q[i].done : q[i].chunk;
            fs[k] = (struct fwd_seq){ q[i].toks + q[i].done, (uint32_t)m, (uint32_t)q[i].done, q[i].tab[0],
                                      PT_LOGICAL, true, (const uint32_t *const *)q[i].tab };
            idx[k++] = i;
        }
        if (k == 0)
            return;
        const float *lg;
        uint32_t rows;
        int rc = engine_step(r->e, fs, (uint32_t)k, &lg, &rows, err, sizeof(err));
        if (rc)
            fprintf(stderr, "engine_step: %s\n", err);
        REQUIRE(rc == 0);
        for (int j = 0; j < k; j++) {
            struct pt_seq *s = &q[idx[j]];
            memcpy(s->logits + (size_t)s->done * V, lg, (size_t)fs[j].n_tokens * V * 4);
            lg += (size_t)fs[j].n_tokens * V;
            s->done += (int)fs[j].n_tokens;
            pt_slide(r->kv, s);
        }
    }
}

/*
 * The contract over a cache of parts: one table per part, and between steps
 * the windowed parts' blocks that slid out of the window are poisoned (NaN)
 * and dropped from their tables. The logits stay the one-part cache's, bit
 * for bit: for sequences 28 times the window, whole, chunked and token by
 * token, alone and two in a batch. A chunk that starts past the window is a
 * continuation of a cached prefix whose windowed parts keep only the window.
 */
static void test_parts_contract(const model_t *m)
{
    const uint32_t V = m->cfg.n_vocab;
    struct kv_parts parts;
    kv_parts_for_model(&m->cfg, &parts);
    CHECK(parts.n_parts == 6 && parts.part_layers == 1 && parts.window[1] == m->cfg.swa_window);
    const int n = 200, n2 = 150;
    int32_t toks[200], toks2[150];
    random_tokens(toks, n, V, 23);
    random_tokens(toks2, n2, V, 29);
    /* the one-part reference */
    struct rig one = rig_new(m, PT_BT, PT_LOGICAL, KERN_F16, 2);
    uint32_t ident[PT_LOGICAL];
    for (uint32_t i = 0; i < PT_LOGICAL; i++)
        ident[i] = (i * 7 + 3) % PT_LOGICAL;
    float *want = run_chunks(&one, toks, n, n, ident, PT_LOGICAL);
    float *want2 = run_chunks(&one, toks2, n2, n2, ident, PT_LOGICAL);
    rig_free(&one);

    char err[256];
    struct kv_params kp = { .block_tokens = PT_BT, .n_blocks = 2 * parts.n_parts * PT_LOGICAL,
                            .k_type = rig_fmt.k_type, .v_type = rig_fmt.v_type, .rotate = rig_fmt.rotate,
                            .parts = &parts };
    struct rig r;
    r.kv = kvcache_new(&m->cfg, &kp, err, sizeof(err));
    REQUIRE(r.kv != NULL);
    CHECK(r.kv->block_bytes * parts.n_parts == (size_t)m->cfg.n_layer * r.kv->layer_bytes);
    struct engine_params ep = engine_default_params();
    ep.max_tokens = 400;    /* both whole sequences in one step */
    ep.n_threads = 2;
    ep.attn_chunk = rig_chunk;
    ep.share_shift = rig_shift;
    r.e = engine_new(m, r.kv, &ep, err, sizeof(err));
    REQUIRE(r.e != NULL);
    uint32_t store[2][KV_MAX_PARTS][PT_LOGICAL];
    const int chunks[][2] = { { 200, 150 }, { 23, 9 }, { 1, 64 }, { 61, 1 } };
    for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
        memset(r.kv->mem, 0xff, (size_t)r.kv->n_blocks * r.kv->block_bytes);
        struct pt_seq q[2] = { { .toks = toks, .n = n, .chunk = chunks[c][0] },
                               { .toks = toks2, .n = n2, .chunk = chunks[c][1] } };
        for (int i = 0; i < 2; i++) {
            q[i].logits = malloc((size_t)q[i].n * V * 4);
            REQUIRE(q[i].logits != NULL);
            for (uint32_t p = 0; p < parts.n_parts; p++) {
                q[i].tab[p] = store[i][p];
                for (uint32_t b = 0; b < PT_LOGICAL; b++)   /* scattered over the cache */
                    store[i][p][b] = ((uint32_t)i * parts.n_parts + p) * PT_LOGICAL +
                                     (b * 13 + p) % PT_LOGICAL;
            }
        }
        /* alone, then both in one batch */
        pt_run(&r, q, 1);
        CHECK(memcmp(q[0].logits, want, (size_t)n * V * 4) == 0);
        CHECK(q[0].tab[1][0] == POOL_NONE && q[0].tab[1][PT_LOGICAL - 2] != POOL_NONE);
        memset(r.kv->mem, 0xff, (size_t)r.kv->n_blocks * r.kv->block_bytes);
        q[0].done = 0;
        for (uint32_t p = 0; p < parts.n_parts; p++)
            for (uint32_t b = 0; b < PT_LOGICAL; b++)
                store[0][p][b] = p * PT_LOGICAL + (b * 13 + p) % PT_LOGICAL;
        pt_run(&r, q, 2);
        CHECK(memcmp(q[0].logits, want, (size_t)n * V * 4) == 0);
        CHECK(memcmp(q[1].logits, want2, (size_t)n2 * V * 4) == 0);
        free(q[0].logits);
        free(q[1].logits);
    }
    /* a step that would read a block its windowed part let go is refused
     * (over zeroed K/V: NaN rows would only feed NaN to the products) */
    memset(r.kv->mem, 0, (size_t)r.kv->n_blocks * r.kv->block_bytes);
    uint32_t *tab[KV_MAX_PARTS];
    for (uint32_t p = 0; p < parts.n_parts; p++) {
        tab[p] = store[0][p];
        for (uint32_t b = 0; b < PT_LOGICAL; b++)
            store[0][p][b] = p * PT_LOGICAL + b;
    }
    store[0][2][40] = POOL_NONE;   /* position 164 reads 158..164: blocks 39..41 */
    struct fwd_seq fs = { toks + 164, 1, 164, tab[0], PT_LOGICAL, false, (const uint32_t *const *)tab };
    const float *lg;
    uint32_t rows;
    CHECK(engine_step(r.e, &fs, 1, &lg, &rows, err, sizeof(err)) == KVD_ERANGE);
    store[0][2][40] = 2 * PT_LOGICAL + 40;
    store[0][2][30] = POOL_NONE;    /* before the window: fine */
    CHECK(engine_step(r.e, &fs, 1, &lg, &rows, err, sizeof(err)) == 0);
    fs.tables = NULL;               /* one table for a cache of parts */
    CHECK(engine_step(r.e, &fs, 1, &lg, &rows, err, sizeof(err)) == KVD_EINVAL);
    rig_free(&r);
    free(want);
    free(want2);
}

static void test_paged_equals_contiguous(const model_t *m);
static void test_chunking(const model_t *m);
static void test_batch_invariance(const model_t *m);

/* The numerics contract on every kernel path this CPU has, for model m (what
 * says which model and cache it is). */
static void contract_on_every_path(const model_t *m, const char *what)
{
    for (int isa = (int)kern_isa_best(); isa >= KERN_ISA_C; isa--) {
        kern_isa_set((enum kern_isa)isa);
        /* where AMX is, the AVX-512 path runs with its tile products (prefill
         * chunks of 16 tokens and more) and without them */
        for (int amx = kern_amx_available() && isa >= KERN_ISA_AVX512VNNI; amx >= 0; amx--) {
            kern_amx_set(amx);
            fprintf(stderr, "numerics contract (%s, %s cache) on the %s path\n", what, rig_fmt.name,
                    kern_path_name());
            test_paged_equals_contiguous(m);
            test_chunking(m);
            test_batch_invariance(m);
        }
        kern_amx_set(true);
    }
    kern_isa_set(kern_isa_best());
}

/* Paged with a shuffled table equals one big contiguous block, bit for bit. */
static void test_paged_equals_contiguous(const model_t *m)
{
    const int n = 100;
    int32_t toks[100];
    random_tokens(toks, n, m->cfg.n_vocab, 3);
    struct rig a = rig_new(m, 4, 40, KERN_F16, 2);
    uint32_t shuffled[25];
    for (int i = 0; i < 25; i++)
        shuffled[i] = (uint32_t)((i * 17 + 5) % 40);
    float *la = run_chunks(&a, toks, n, n, shuffled, 25);
    struct rig b = rig_new(m, 128, 1, KERN_F16, 2);
    uint32_t one[1] = { 0 };
    float *lb = run_chunks(&b, toks, n, n, one, 1);
    CHECK(memcmp(la, lb, (size_t)n * m->cfg.n_vocab * 4) == 0);
    free(la);
    free(lb);
    rig_free(&a);
    rig_free(&b);
}

/* toks (n of them) in one prefill and in chunks of `chunk` on an engine of
 * `threads` whose thread i runs share (i + shift) % threads of each job: the
 * logits equal `want`, bit for bit. */
static void check_shifted(const model_t *m, const int32_t *toks, int n, uint32_t block_tokens,
                          const uint32_t *blocks, uint32_t n_blocks, int threads, uint32_t shift, int chunk,
                          const float *want)
{
    const size_t bytes = (size_t)n * m->cfg.n_vocab * 4;
    rig_shift = shift;
    struct rig r = rig_new(m, block_tokens, n_blocks, KERN_F16, threads);
    rig_shift = 0;
    const int chunks[2] = { n, chunk };
    for (int i = 0; i < 2; i++) {
        float *got = run_chunks(&r, toks, n, chunks[i], blocks, n_blocks);
        CHECK(memcmp(want, got, bytes) == 0);
        free(got);
    }
    rig_free(&r);
}

/* Chunked prefill (and token-by-token decode) equals one prefill, bit for bit;
 * thread count changes nothing either. */
static void test_chunking(const model_t *m)
{
    const int n = 77;
    int32_t toks[77];
    random_tokens(toks, n, m->cfg.n_vocab, 5);
    uint32_t blocks[10] = { 9, 8, 7, 6, 5, 4, 3, 2, 1, 0 };
    size_t bytes = (size_t)n * m->cfg.n_vocab * 4;
    struct rig r = rig_new(m, 8, 10, KERN_F16, 2);
    float *whole = run_chunks(&r, toks, n, n, blocks, 10);
    float *halves = run_chunks(&r, toks, n, 40, blocks, 10);
    float *odd = run_chunks(&r, toks, n, 13, blocks, 10);
    float *ones = run_chunks(&r, toks, n, 1, blocks, 10);
    CHECK(memcmp(whole, halves, bytes) == 0);
    CHECK(memcmp(whole, odd, bytes) == 0);
    CHECK(memcmp(whole, ones, bytes) == 0);
    rig_free(&r);
    struct rig r1 = rig_new(m, 8, 10, KERN_F16, 1);
    float *single = run_chunks(&r1, toks, n, 25, blocks, 10);
    CHECK(memcmp(whole, single, bytes) == 0);
    rig_free(&r1);
    /* every share of a job (product rows, attention tiles and items) run by
     * another thread than the one the split lays it out for: the bits of
     * each output do not depend on the thread that computes it */
    check_shifted(m, toks, n, 8, blocks, 10, 2, 1, 13, whole);
    /* blocks of 16: a windowed layer's prefill tokens go in tiles (each query
     * from its own window's block) where the path has them; one at a time
     * they do not */
    struct rig r16 = rig_new(m, 16, 5, KERN_F16, 2);
    const uint32_t blocks16[5] = { 3, 0, 4, 2, 1 };
    float *whole16 = run_chunks(&r16, toks, n, n, blocks16, 5);
    float *ones16 = run_chunks(&r16, toks, n, 1, blocks16, 5);
    float *odd16 = run_chunks(&r16, toks, n, 11, blocks16, 5);
    CHECK(memcmp(whole, whole16, bytes) == 0);
    CHECK(memcmp(whole, ones16, bytes) == 0);
    CHECK(memcmp(whole, odd16, bytes) == 0);
    rig_free(&r16);
    /* the windowed tiles and items on other threads than their own, of three */
    check_shifted(m, toks, n, 16, blocks16, 5, 3, 2, 11, whole);
    /* blocks of 32: a tile's queries may start two blocks of the kernel's V
     * rows apart (16 positions at head size 256); where the attention range
     * is 16 positions, blocks of 32 round it up to 32 (other cuts, other
     * bits than the rigs above), so against them only with the default range */
    {
        struct rig r32 = rig_new(m, 32, 3, KERN_F16, 2);
        const uint32_t blocks32[3] = { 2, 0, 1 };
        float *whole32 = run_chunks(&r32, toks, n, n, blocks32, 3);
        float *ones32 = run_chunks(&r32, toks, n, 1, blocks32, 3);
        CHECK(memcmp(whole32, ones32, bytes) == 0);
        if (rig_chunk == 0)
            CHECK(memcmp(whole, whole32, bytes) == 0);
        rig_free(&r32);
        free(whole32);
        free(ones32);
    }
    free(whole16);
    free(ones16);
    free(odd16);
    free(whole);
    free(halves);
    free(odd);
    free(ones);
    free(single);
}

/* Sequence 0 of toks inside a batch of 8 on engine r: everyone prefills a
 * different amount, then its last 10 tokens beside decode tokens and other
 * chunks; checks their logits against `alone`. */
static void check_batched(struct rig *r, int32_t toks[8][60], uint32_t tables[8][8], const float *alone)
{
    const uint32_t V = engine_model(r->e)->cfg.n_vocab;
    char err[256];
    struct fwd_seq seqs[8];
    const float *lg;
    uint32_t rows;
    for (int s = 0; s < 8; s++)
        seqs[s] = (struct fwd_seq){ toks[s], (uint32_t)(s == 0 ? 50 : 5 + 5 * s), 0, tables[s], 8, false, NULL };
    REQUIRE(engine_step(r->e, seqs, 8, &lg, &rows, err, sizeof(err)) == 0);
    for (int s = 1; s < 8; s++) {
        uint32_t done = (uint32_t)(5 + 5 * s);
        seqs[s] = (struct fwd_seq){ toks[s] + done, s % 2 ? 3u : 1u, done, tables[s], 8, s == 3, NULL };
    }
    seqs[0] = (struct fwd_seq){ toks[0] + 50, 10, 50, tables[0], 8, true, NULL };
    /* sequence 0 in the middle of the batch */
    struct fwd_seq mixed[8] = { seqs[1], seqs[2], seqs[3], seqs[0], seqs[4], seqs[5], seqs[6], seqs[7] };
    REQUIRE(engine_step(r->e, mixed, 8, &lg, &rows, err, sizeof(err)) == 0);
    /* rows: s1 (1), s2 (1), s3 (3, all), then s0's 10 */
    CHECK_INT(rows, 1 + 1 + 3 + 10 + 4);
    CHECK(memcmp(lg + (size_t)5 * V, alone + (size_t)50 * V, (size_t)10 * V * 4) == 0);
}

/* A sequence alone equals the same sequence inside a batch of 8 others at
 * other positions, with prefill chunks and decode tokens mixed; also where
 * each share of the batch's jobs runs on another thread than its own. */
static void test_batch_invariance(const model_t *m)
{
    const uint32_t V = m->cfg.n_vocab;
    struct rig r = rig_new(m, 16, 64, KERN_F16, 2);
    int32_t toks[8][60];
    uint32_t tables[8][8];
    for (int s = 0; s < 8; s++) {
        random_tokens(toks[s], 60, V, 100 + (unsigned)s);
        for (int b = 0; b < 8; b++)
            tables[s][b] = (uint32_t)(s * 8 + b);
    }
    /* sequence 0 alone: 50 tokens, then logits of a 10-token chunk */
    float *alone = run_chunks(&r, toks[0], 60, 50, tables[0], 8);
    check_batched(&r, toks, tables, alone);
    rig_free(&r);
    rig_shift = 1;
    r = rig_new(m, 16, 64, KERN_F16, 2);
    rig_shift = 0;
    check_batched(&r, toks, tables, alone);
    rig_free(&r);
    free(alone);
}

/* Decode tokens side by side that share whole attention ranges (the same
 * blocks) run those ranges together (kern_attn_multi where the path has it):
 * each token's logits equal its logits alone, bit for bit. Five sequences
 * share a 40-position prefix, one more shares only its first 16 positions,
 * and one shares nothing and sits between them; with ranges of 16 positions
 * the first two tokens (a group of two: too small but on the AMX tiles),
 * then a group of four sharing one range. */
static void test_shared_decode(const model_t *m, int threads, uint32_t dtype)
{
    enum { NS = 7, PRE = 40, END = 48 };
    const uint32_t V = m->cfg.n_vocab;
    char err[256];
    struct rig r = rig_new(m, 4, 64, dtype, threads);
    int32_t pre[PRE], own[NS][END];
    uint32_t tables[NS][12];
    random_tokens(pre, PRE, V, 41);
    for (int q = 0; q < NS; q++) {
        random_tokens(own[q], END, V, 50 + (unsigned)q);
        for (int b = 0; b < 12; b++)
            tables[q][b] = q < 5 ? (b < 10 ? (uint32_t)b : (uint32_t)(10 + 2 * q + (b - 10)))
                         : q == 5 ? (b < 4 ? (uint32_t)b : (uint32_t)(16 + b))
                                  : (uint32_t)(30 + b);
    }
    struct fwd_seq seqs[NS];
    const float *lg;
    uint32_t rows;
    /* the shared prefix once; sequence 5's own positions 16..39; sequence 6 whole */
    seqs[0] = (struct fwd_seq){ pre, PRE, 0, tables[0], 12, false, NULL };
    seqs[1] = (struct fwd_seq){ own[5] + 16, PRE - 16, 16, tables[5], 12, false, NULL };
    seqs[2] = (struct fwd_seq){ own[6], PRE, 0, tables[6], 12, false, NULL };
    REQUIRE(engine_step(r.e, seqs, 3, &lg, &rows, err, sizeof(err)) == 0);
    /* each its own two tokens at 40 and 41 */
    for (int q = 0; q < NS; q++)
        seqs[q] = (struct fwd_seq){ own[q] + PRE, 2, PRE, tables[q], 12, false, NULL };
    REQUIRE(engine_step(r.e, seqs, NS, &lg, &rows, err, sizeof(err)) == 0);
    /* decode steps at positions 42..47 (the last one's context exactly three
     * ranges): 0, 1, then 6 (sharing nothing), then 2, 3, 4, 5 */
    static const int order[NS] = { 0, 1, 6, 2, 3, 4, 5 };
    float *together = malloc((size_t)NS * V * 4);
    REQUIRE(together != NULL);
    int same = 0, tiled = 0;
    for (uint32_t pos = PRE + 2; pos < END; pos++) {
        for (int i = 0; i < NS; i++)
            seqs[i] = (struct fwd_seq){ own[order[i]] + pos, 1, pos, tables[order[i]], 12, false, NULL };
        REQUIRE(engine_step(r.e, seqs, NS, &lg, &rows, err, sizeof(err)) == 0);
        REQUIRE(rows == NS);
        tiled += (int)engine_decode_tiled(r.e);
        memcpy(together, lg, (size_t)NS * V * 4);
        for (int i = 0; i < NS; i++) {
            REQUIRE(engine_step(r.e, &seqs[i], 1, &lg, &rows, err, sizeof(err)) == 0);
            same += memcmp(lg, together + (size_t)i * V, (size_t)V * 4) == 0;
            CHECK_INT(engine_decode_tiled(r.e), 0);
        }
    }
    CHECK_INT(same, NS * (END - PRE - 2));
    /* where the path has the multi kernel, 2..5 went together at every step
     * (where a call takes four tokens' heads; two and two where it takes two),
     * and 0 and 1 too where two calls are worth one (the AMX tiles) */
    const struct model_config *c = &m->cfg;
    const int least = kern_attn_multi_min(dtype, dtype, (int)c->head_dim);
    const int per = KERN_ATTN_LANES / (int)(c->n_head / c->n_head_kv);
    REQUIRE(per >= 4 || per == 2);
    CHECK_INT(tiled, (least == 2 ? 6 : least >= 2 && per >= least ? 4 : 0) * (END - PRE - 2));
    free(together);
    rig_free(&r);
}

/* Bad input is refused before the cache is touched. */
static void test_errors(const model_t *m)
{
    char err[256];
    struct rig r = rig_new(m, 16, 4, KERN_F16, 1);
    uint32_t blocks[4] = { 0, 1, 2, 3 };
    int32_t toks[4] = { 5, 6, 7, (int32_t)m->cfg.n_vocab };
    const float *lg;
    uint32_t rows;
    struct fwd_seq s = { toks, 4, 0, blocks, 4, false, NULL };
    CHECK_INT(engine_step(r.e, &s, 1, &lg, &rows, err, sizeof(err)), KVD_ERANGE);
    CHECK(strstr(err, "vocabulary") != NULL);
    toks[3] = -1;
    CHECK_INT(engine_step(r.e, &s, 1, &lg, &rows, err, sizeof(err)), KVD_ERANGE);
    toks[3] = 8;
    uint32_t bad[1] = { 4 };
    s = (struct fwd_seq){ toks, 4, 0, bad, 1, false, NULL };
    CHECK_INT(engine_step(r.e, &s, 1, &lg, &rows, err, sizeof(err)), KVD_ERANGE);
    s = (struct fwd_seq){ toks, 4, 62, blocks, 4, false, NULL };  /* 66 positions in 64 */
    CHECK_INT(engine_step(r.e, &s, 1, &lg, &rows, err, sizeof(err)), KVD_ERANGE);
    s = (struct fwd_seq){ toks, 4, m->cfg.n_ctx_train - 2, blocks, 4, false, NULL };
    CHECK_INT(engine_step(r.e, &s, 1, &lg, &rows, err, sizeof(err)), KVD_ETOOLONG);
    s = (struct fwd_seq){ toks, 0, 0, blocks, 4, false, NULL };
    CHECK_INT(engine_step(r.e, &s, 1, &lg, &rows, err, sizeof(err)), KVD_EINVAL);
    CHECK_INT(engine_step(r.e, &s, 0, &lg, &rows, err, sizeof(err)), KVD_EINVAL);
    s = (struct fwd_seq){ toks, 4, 0, blocks, 4, false, NULL };
    CHECK_INT(engine_step(r.e, &s, 1, &lg, &rows, err, sizeof(err)), 0);
    rig_free(&r);
}

/* engine_kv_shift: layer 0's keys depend on a token and its position alone,
 * so blocks moved 20 positions down must hold what a sequence that had those
 * tokens at the new positions writes there, up to the cache type's rounding
 * (rel: of the largest key). A cache of several parts is refused. */
static void test_kv_shift(const model_t *m, uint32_t k_type, uint32_t rotate, double rel)
{
    const struct kv_format saved = rig_fmt;
    rig_fmt = (struct kv_format){ "shift", k_type, KERN_F16, rotate };
    struct rig r = rig_new(m, 4, 40, KERN_F16, 2);
    const struct model_config *c = &m->cfg;
    int32_t toks[48], w[28];
    random_tokens(toks, 48, c->n_vocab, 77);
    uint32_t ta[12], tb[7];
    for (uint32_t i = 0; i < 12; i++)
        ta[i] = 39 - 3 * i;     /* scattered */
    for (uint32_t i = 0; i < 7; i++)
        tb[i] = 3 * i + 1;      /* none of a's */
    free(run_chunks(&r, toks, 48, 48, ta, 12));
    char err[256];
    /* keep block 0, drop blocks 1..5: blocks 6..11 (positions 24..47) move to 4..27 */
    const uint32_t *tab[1] = { ta };
    CHECK_INT(engine_kv_shift(r.e, tab, 6, 6, -20, err, sizeof(err)), 0);
    memcpy(w, toks, 4 * sizeof(int32_t));
    memcpy(w + 4, toks + 24, 24 * sizeof(int32_t));
    free(run_chunks(&r, w, 28, 28, tb, 7));
    const int hd = (int)c->head_dim;
    double diff = 0, big = 0;
    float x[KERN_MAX_HEAD_DIM], y[KERN_MAX_HEAD_DIM];
    for (uint32_t i = 0; i < 6; i++)
        for (uint32_t h = 0; h < c->n_head_kv; h++)
            for (uint32_t t = 0; t < 4; t++) {
                const size_t off = (size_t)h * r.kv->k_head_bytes + (size_t)t * r.kv->k_row_bytes;
                kern_dequantize_row(k_type, kv_block_ptr(r.kv, ta[6 + i], 0, 0) + off, x, hd);
                kern_dequantize_row(k_type, kv_block_ptr(r.kv, tb[1 + i], 0, 0) + off, y, hd);
                const double d = max_diff(x, y, (size_t)hd), b = max_abs(y, (size_t)hd);
                diff = d > diff ? d : diff;
                big = b > big ? b : big;
            }
    if (!(diff <= rel * big))
        fprintf(stderr, "kv shift (%s%s): keys off by %g of %g\n", kern_type_info(k_type)->name,
                rotate ? ", rotated" : "", diff, big);
    CHECK(big > 0 && diff <= rel * big);
    /* and the untouched sink block is the same in both */
    CHECK(memcmp(kv_block_ptr(r.kv, ta[0], 0, 0), kv_block_ptr(r.kv, tb[0], 0, 0), r.kv->k_head_bytes) == 0);
    rig_free(&r);
    rig_fmt = saved;
}

int main(void)
{
    REQUIRE(mkdtemp(tmpdir) != NULL);
    /* float weights: only summation order differs from the reference */
    test_against_reference("f32-gqa", KERN_F32, KERN_F32, 4, 2, true, KERN_F32, 1e-4);
    test_against_reference("f32-mqa", KERN_F32, KERN_F32, 4, 1, false, KERN_F32, 1e-4);
    test_against_reference("f16-mha", KERN_F16, KERN_F16, 4, 4, false, KERN_F32, 1e-4);
    test_against_reference("f32-gqa-f16kv", KERN_F32, KERN_F32, 8, 2, false, KERN_F16, 5e-4);
    /* quantized weights: activations are quantized to 8 bits, as in llama.cpp */
    test_against_reference("q4_1-gqa", KERN_Q4_1, KERN_Q8_0, 8, 2, true, KERN_F16, 0.03);
    test_against_reference("q8_0-mqa", KERN_Q8_0, KERN_Q8_0, 4, 1, false, KERN_F32, 0.03);
    test_against_reference("q4_0-gqa", KERN_Q4_0, KERN_Q8_0, 8, 2, true, KERN_F16, 0.03);
    test_against_reference("q5_0-gqa", KERN_Q5_0, KERN_Q8_0, 8, 2, false, KERN_F16, 0.03);
    test_narrow_layouts(KERN_Q4_0);
    test_narrow_layouts(KERN_Q5_0);
    test_narrow_layouts(KERN_Q6_K);
    test_narrow_layouts(KERN_Q4_K);
    test_narrow_layouts(KERN_Q5_K);
    /* the K-quants (packed for the 256-bit products on x86-64); their
     * activations (Q8_K) have one scale per 256 values, not per 32: the C
     * path is 2.7-3.2% off too */
    test_against_reference("q4_k-gqa", KERN_Q4_K, KERN_Q8_0, 8, 2, true, KERN_F16, 0.05);
    test_against_reference("q5_k-mqa", KERN_Q5_K, KERN_Q8_0, 4, 1, false, KERN_F32, 0.05);
    test_against_reference("q6_k-gqa", KERN_Q6_K, KERN_Q6_K, 8, 2, false, KERN_F16, 0.05);

    struct mkmodel_params p = mkmodel_default_params();
    p.n_layer = 3;
    p.n_embd = 128;
    p.n_head = 4;
    p.n_head_kv = 2;
    p.n_ff = 256;
    p.n_vocab = 300;
    model_t *m = make_model(&p, "contract");
    /* the contract holds on every kernel path this CPU has */
    contract_on_every_path(m, "llama");
    /* head dim 64: a prefill's tokens run in tiles of queries where the path
     * has them (AVX-512, kern_attn_multi), decode tokens one by one; and with
     * attention ranges of 16 positions, the tiles split and merged */
    {
        struct mkmodel_params p64 = p;
        p64.n_embd = 256;
        p64.n_ff = 512;
        model_t *m64 = make_model(&p64, "contract-hd64");
        contract_on_every_path(m64, "llama, head dim 64");
        rig_chunk = 16;
        test_chunking(m64);
        test_batch_invariance(m64);
        /* a bf16 cache: the bf16 dot products where the CPU has them, the
         * same contract (paged against contiguous: the same ranges, so
         * without the 16-position ones) */
        rig_fmt = (struct kv_format){ "bf16", KERN_BF16, KERN_BF16, 0 };
        rig_chunk = 0;
        contract_on_every_path(m64, "llama, head dim 64");
        rig_chunk = 16;
        test_chunking(m64);
        test_batch_invariance(m64);
        rig_fmt = (struct kv_format){ "f16", KERN_F16, KERN_F16, 0 };
        for (int isa = (int)kern_isa_best(); isa >= KERN_ISA_C; isa--) {
            kern_isa_set((enum kern_isa)isa);
            for (int th = 1; th <= 3; th++) {
                test_shared_decode(m64, th, KERN_F16);
                test_shared_decode(m64, th, KERN_BF16);
            }
        }
        kern_isa_set(kern_isa_best());
        /* eight query heads to a KV head: a call takes two tokens' queries */
        {
            struct mkmodel_params p8 = p64;
            p8.n_embd = 512;
            p8.n_head = 8;
            p8.n_head_kv = 1;
            model_t *m8 = make_model(&p8, "contract-gqa8");
            test_shared_decode(m8, 2, KERN_F16);
            test_shared_decode(m8, 2, KERN_BF16);
            model_destroy(&m8);
        }
        rig_chunk = 0;
        model_destroy(&m64);
    }
    /* the K-quants' packed products */
    {
        struct mkmodel_params pk = p;
        pk.n_layer = 2;
        pk.n_embd = 256;
        pk.n_ff = 512;
        pk.wtype = KERN_Q4_K;
        pk.embd_type = KERN_Q6_K;
        model_t *mk = make_model(&pk, "contract-q4_k");
        contract_on_every_path(mk, "q4_k weights, q6_k output");
        model_destroy(&mk);
    }
    /* windowing moves keys to new positions */
    test_kv_shift(m, KERN_F32, 0, 1e-5);
    test_kv_shift(m, KERN_F16, 0, 2e-3);
    test_kv_shift(m, KERN_Q8_0, KV_ROT_K, 3e-2);
    /* contexts cut into ranges of 16 positions, shared over threads and merged:
     * still batch-, chunking- and thread-invariant */
    rig_chunk = 16;
    fprintf(stderr, "numerics contract with attention ranges of 16 positions\n");
    test_chunking(m);
    test_batch_invariance(m);
    test_against_reference("f32-gqa-ranges", KERN_F32, KERN_F32, 4, 2, true, KERN_F32, 1e-4);
    test_against_reference("q4_1-gqa-ranges", KERN_Q4_1, KERN_Q8_0, 8, 2, true, KERN_F16, 0.03);
    rig_chunk = 0;

    /* quantized and rotated KV: rotation alone changes nothing but rounding,
     * quantization stays close to the exact reference, and the contract
     * holds bit for bit on every path */
    rig_fmt = (struct kv_format){ "f32-rotated", KERN_F32, KERN_F32, KV_ROT_K | KV_ROT_V };
    test_against_reference("f32-rotated", KERN_F32, KERN_F32, 4, 2, true, KERN_F16, 1e-4);
    const struct kv_format quant[] = {
        { "q8_0", KERN_Q8_0, KERN_Q8_0, 0 },
        { "q4_0-rotated", KERN_Q4_0, KERN_Q4_0, KV_ROT_K | KV_ROT_V },
        { "q4_0", KERN_Q4_0, KERN_Q4_0, 0 },
        { "f16-k-q4_0-v-rotated", KERN_F16, KERN_Q4_0, KV_ROT_V },
        { "q8_0-k-f16-v", KERN_Q8_0, KERN_F16, 0 },
    };
    /* a random model has no outlier channels: 4 bits cost it about a sixth of the
     * largest logit, with or without rotation (what they cost a real model is
     * measured by kvd-run --kl-divergence) */
    const double quant_tol[] = { 0.02, 0.3, 0.3, 0.3, 0.02 };
    for (size_t f = 0; f < sizeof(quant) / sizeof(quant[0]); f++) {
        rig_fmt = quant[f];
        char name[64];
        snprintf(name, sizeof(name), "kv-%s", rig_fmt.name);
        test_against_reference(name, KERN_F32, KERN_F32, 4, 2, true, KERN_F16, quant_tol[f]);
        contract_on_every_path(m, rig_fmt.name);
        rig_chunk = 16;
        test_chunking(m);
        test_batch_invariance(m);
        rig_chunk = 0;
    }
    /* bf16 (its contract: the head-dim-64 model above, Gemma 3 below) */
    rig_fmt = (struct kv_format){ "bf16", KERN_BF16, KERN_BF16, 0 };
    test_against_reference("kv-bf16", KERN_F32, KERN_F32, 4, 2, true, KERN_F16, 0.02);
    rig_fmt = (struct kv_format){ "f16", KERN_F16, KERN_F16, 0 };
    test_errors(m);

    /* Gemma 3: against the reference (f32 and f16 caches, quantized weights),
     * and the contract on every path with a window of 7 positions that starts
     * anywhere in 4-position blocks, over contexts up to 100 positions */
    /* (GELU rounds to halves: a last-bit difference before it can become a half's step) */
    test_gemma_against_reference("gemma3-f32", KERN_F32, KERN_F32, 48, 5e-4);
    test_gemma_against_reference("gemma3-f16kv", KERN_F32, KERN_F16, 48, 1e-3);
    test_gemma_against_reference("gemma3-q8_0", KERN_Q8_0, KERN_F16, 48, 0.03);
    /* Gemma 3's own head width: the AVX-512 attention at 256 where the CPU has it */
    test_gemma_against_reference("gemma3-hd256", KERN_F32, KERN_F16, 256, 1e-3);
    {
        /* 32 query heads on one KV head, more than a tile's lanes: the
         * windowed layers' items are taken a token at a time */
        model_t *g32 = make_gemma_heads("gemma3-32-heads", KERN_Q8_0, 7, 64, 32);
        test_chunking(g32);
        model_destroy(&g32);
    }
    model_t *g = make_gemma("gemma3-contract", KERN_Q8_0, 7, 256);
    contract_on_every_path(g, "gemma3");
    for (int isa = (int)kern_isa_best(); isa >= KERN_ISA_C; isa--) {
        kern_isa_set((enum kern_isa)isa);
        fprintf(stderr, "numerics contract (gemma3, a cache of parts) on the %s path\n",
                kern_isa_name(kern_isa()));
        test_parts_contract(g);
    }
    kern_isa_set(kern_isa_best());
    /* the caches' kernels at head dim 256: q8_0, rotated q4_0 and bf16 (the
     * other formats add nothing new there, and this test runs under ASan too) */
    for (size_t f = 0; f < 3; f++) {
        rig_fmt = f < 2 ? quant[f] : (struct kv_format){ "bf16", KERN_BF16, KERN_BF16, 0 };
        contract_on_every_path(g, "gemma3");
    }
    rig_fmt = (struct kv_format){ "f16", KERN_F16, KERN_F16, 0 };
    rig_chunk = 16;
    test_chunking(g);
    test_batch_invariance(g);
    rig_chunk = 0;
    model_destroy(&g);
    model_destroy(&m);

    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
    CHECK(system(cmd) == 0);
    return CHECK_DONE();
}
