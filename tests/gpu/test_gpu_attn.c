/*
 * test_gpu_attn.c - the CUDA paged attention kernels against their C twin
 * (kern_attn_paged) and an exact reference.
 *
 * Random F16 caches in the engine's block layout (layer 1 of 2, block tables
 * that scatter and reuse physical blocks), four head shapes (GQA groups of
 * 3, 4, 1 and 7; head dims 64 and 128; blocks of 16 and 32 positions), decode
 * batches of 1 to 200 sequences with contexts from 1 to 32768 positions, and
 * prefill chunks after cached prefixes; then caches with quantized halves
 * (K/V q8_0/q8_0, f16/q4_0, q4_0/q4_0, q8_0/q4_0) on the head dims 64 and 128.
 * Each (token, head) is checked:
 *   - against an exact attention (double, the cache's values as stored, the
 *     query as the twin meets K with it: rounded to f16 over F16 K, quantized
 *     to Q8_0 over Q8_0 / Q4_0 K): normwise relative error within 1e-4, which
 *     is what fp32 accumulation must give;
 *   - against the C twin: error relative to the scale of the values the
 *     output averages (max over dims of sum_j p_j |v_j|) within 1e-3. The twin
 *     rounds probabilities to f16 (as llama.cpp's CPU path does), which alone
 *     costs up to ~7e-4 of the output's own norm when long contexts average
 *     out to small outputs, so the output's norm is no fair yardstick there;
 *     the worst normwise difference is printed as well;
 * and for invariance, bit for bit: a sequence decoded alone equals the same
 * sequence in a batch, and prefill equals decoding each token of the chunk,
 * also when a value in the chunk has overflowed f16 (+inf).
 * `--quick`: a few small cases of each kernel (for compute-sanitizer).
 * Exits 77 (skip) where no CUDA device is usable.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "f16.h"
#include "attn.h"
#include "kcuda.h"
#include "ops.h"
#include "quant.h"
#include "types.h"

#define TOL_EXACT 1e-4  /* normwise, against the exact attention */
#define TOL_TWIN 1e-3   /* against the C twin, relative to the averaged values' scale */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rng_u32(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

/* Uniform in [-1, 1). */
static float frand(void) { return (float)((double)rng_u32() / 2147483648.0 - 1.0); }

/* The window every attention call of a case runs with (kcuda_attn_args.window;
 * the twin's skip): 0, or a sliding window's length. */
static int g_window;

/* The first position a query at qp sees. */
static int window_lo(int qp)
{
    return g_window > 0 && qp + 1 > g_window ? qp + 1 - g_window : 0;
}

struct shape {
    const char *name;
    int n_head, n_kv, head_dim, block_tokens, n_blocks;
};

/* A two-layer cache on host and device; tests use layer 1. */
struct cache {
    struct shape s;
    uint32_t k_type, v_type;
    size_t k_row, v_row, k_head, v_head, block_bytes, bytes;
    uint8_t *host, *dev;
    uint8_t *hk, *hv;       /* layer 1 K and V in block 0, host */
    struct kcuda_kv kv;     /* the same on the device */
};

/* Fills n rows of `type` at dst with values uniform in [-2, 2), a few of
 * them 8x larger (quantized rows: each stored as the engine stores it). */
static void fill_rows(uint8_t *dst, size_t n, int D, uint32_t type)
{
    const size_t row = kern_row_bytes(type, D);
    float x[KERN_MAX_HEAD_DIM];
    for (size_t r = 0; r < n; r++, dst += row) {
        for (int d = 0; d < D; d++)
            x[d] = frand() * (rng_u32() % 29 == 0 ? 16.0f : 2.0f);
        if (type == KERN_F16)
            kern_f32_to_f16_row((kvd_f16 *)dst, x, D);
        else if (type == KERN_Q8_0)
            kern_quantize_act(KERN_Q8_0, x, dst, D);
        else
            kern_quantize_q4_0_lsq(x, dst, D);
    }
}

static int cache_init(struct cache *c, const struct shape *s, uint32_t k_type, uint32_t v_type)
{
    memset(c, 0, sizeof(*c));
    c->s = *s;
    c->k_type = k_type;
    c->v_type = v_type;
    c->k_row = kern_row_bytes(k_type, s->head_dim);
    c->v_row = kern_row_bytes(v_type, s->head_dim);
    c->k_head = (size_t)s->block_tokens * c->k_row;
    c->v_head = (size_t)s->block_tokens * c->v_row;
    const size_t layer = (size_t)s->n_kv * (c->k_head + c->v_head);
    c->block_bytes = 2 * layer;
    c->bytes = c->block_bytes * s->n_blocks;
    c->host = malloc(c->bytes);
    c->dev = kcuda_malloc(c->bytes);
    if (c->host == NULL || c->dev == NULL)
        return -1;
    const size_t rows = (size_t)s->n_kv * s->block_tokens;
    for (size_t b = 0; b < 2 * (size_t)s->n_blocks; b++) {     /* each layer of each block */
        fill_rows(c->host + b * layer, rows, s->head_dim, k_type);
        fill_rows(c->host + b * layer + s->n_kv * c->k_head, rows, s->head_dim, v_type);
    }
    if (kcuda_upload(c->dev, c->host, c->bytes))
        return -1;
    const size_t lk = layer, lv = layer + (size_t)s->n_kv * c->k_head;
    c->hk = c->host + lk;
    c->hv = c->host + lv;
    c->kv = (struct kcuda_kv){
        .k = c->dev + lk, .v = c->dev + lv, .block_stride = c->block_bytes, .k_head_stride = c->k_head,
        .v_head_stride = c->v_head, .k_type = k_type, .v_type = v_type, .block_tokens = s->block_tokens,
        .head_dim = s->head_dim, .n_head = s->n_head, .n_head_kv = s->n_kv,
    };
    return 0;
}

/* The name of a cache's types, for reports. */
static const char *types_name(const struct cache *c)
{
    static char buf[32];
    snprintf(buf, sizeof(buf), "%s/%s", kern_type_info(c->k_type)->name, kern_type_info(c->v_type)->name);
    return buf;
}

static void cache_fini(struct cache *c)
{
    free(c->host);
    kcuda_free(c->dev);
}

/* A batch: sequences with their block tables and query rows. */
struct batch {
    int n_seq, rows;
    struct kcuda_seq *seqs;
    uint32_t *tables;
    int n_tables;
    float *q;               /* (rows, n_head * head_dim) */
};

/* Builds a batch of n sequences; seq i has n_tok[i] new tokens at pos[i].
 * qscale sets how peaked attention is (small: nearly uniform). */
static void batch_make(struct batch *b, const struct cache *c, int n, const int *pos, const int *n_tok,
                       float qscale)
{
    memset(b, 0, sizeof(*b));
    b->n_seq = n;
    b->seqs = calloc((size_t)n, sizeof(*b->seqs));
    for (int i = 0; i < n; i++) {
        const int blocks = (pos[i] + n_tok[i] + c->s.block_tokens - 1) / c->s.block_tokens;
        b->seqs[i] = (struct kcuda_seq){ .row = b->rows, .n_tok = n_tok[i], .pos = pos[i],
                                          .table = (uint32_t)b->n_tables };
        b->rows += n_tok[i];
        b->n_tables += blocks;
    }
    b->tables = malloc((size_t)b->n_tables * sizeof(uint32_t));
    for (int j = 0; j < b->n_tables; j++)
        b->tables[j] = rng_u32() % (uint32_t)c->s.n_blocks;
    const size_t qn = (size_t)b->rows * c->s.n_head * c->s.head_dim;
    b->q = malloc(qn * sizeof(float));
    for (size_t i = 0; i < qn; i++)
        b->q[i] = frand() * qscale;
}

static void batch_free(struct batch *b)
{
    free(b->seqs);
    free(b->tables);
    free(b->q);
}

/* Runs decode (every n_tok 1) or prefill on the device; returns the output rows. */
static float *gpu_attn(const struct cache *c, const struct batch *b, int prefill, int split)
{
    const size_t row_floats = (size_t)c->s.n_head * c->s.head_dim;
    const size_t qbytes = (size_t)b->rows * row_floats * sizeof(float);
    int max_tok = 1, max_ctx = 1;
    for (int i = 0; i < b->n_seq; i++) {
        max_tok = b->seqs[i].n_tok > max_tok ? b->seqs[i].n_tok : max_tok;
        const int end = b->seqs[i].pos + b->seqs[i].n_tok;
        max_ctx = end > max_ctx ? end : max_ctx;
    }
    const size_t scratch = kcuda_attn_scratch_bytes(b->n_seq, c->s.n_head, c->s.head_dim, max_ctx, split);
    float *out = malloc(qbytes);
    void *dq = kcuda_malloc(qbytes), *dout = kcuda_malloc(qbytes);
    void *dseqs = kcuda_malloc((size_t)b->n_seq * sizeof(struct kcuda_seq));
    void *dtab = kcuda_malloc((size_t)b->n_tables * sizeof(uint32_t));
    void *dscr = scratch ? kcuda_malloc(scratch) : NULL;
    REQUIRE(out && dq && dout && dseqs && dtab && (scratch == 0 || dscr));
    REQUIRE(kcuda_upload(dq, b->q, qbytes) == 0);
    REQUIRE(kcuda_upload(dseqs, b->seqs, (size_t)b->n_seq * sizeof(struct kcuda_seq)) == 0);
    REQUIRE(kcuda_upload(dtab, b->tables, (size_t)b->n_tables * sizeof(uint32_t)) == 0);
    REQUIRE(kcuda_memset(dout, 0xff, qbytes, NULL) == 0);  /* NaN: rows left unwritten show */
    struct kcuda_attn_args a = {
        .kv = c->kv, .out = dout, .q = dq, .seqs = dseqs, .n_seq = b->n_seq, .tables = dtab,
        .max_tok = max_tok, .max_ctx = max_ctx, .scale = 1.0f / sqrtf((float)c->s.head_dim), .split = split,
        .scratch = dscr, .window = g_window,
    };
    int rc = prefill ? kcuda_attn_prefill(&a, NULL) : kcuda_attn_decode(&a, NULL);
    if (rc != 0)
        fprintf(stderr, "attention launch failed: %d %s\n", rc, kcuda_last_error());
    REQUIRE(rc == 0);
    rc = kcuda_sync();
    if (rc != 0)
        fprintf(stderr, "attention kernel failed: %s\n", kcuda_last_error());
    REQUIRE(rc == 0);
    REQUIRE(kcuda_download(out, dout, qbytes) == 0);
    kcuda_free(dq);
    kcuda_free(dout);
    kcuda_free(dseqs);
    kcuda_free(dtab);
    kcuda_free(dscr);
    return out;
}

/* Exact attention of one head in double over the cache's f16 data; scale_out[d]
 * gets sum_j p_j |v_j[d]|. */
static void attn_exact(double *out, double *vscale, const float *q, const struct cache *c, int kvh,
                       const uint32_t *table, int lo, int n_ctx)
{
    const int D = c->s.head_dim, bt = c->s.block_tokens;
    double qh[KERN_MAX_HEAD_DIM];
    float row[KERN_MAX_HEAD_DIM];
    if (c->k_type == KERN_F16) {
        for (int d = 0; d < D; d++)
            qh[d] = kvd_f16_to_f32(kvd_f32_to_f16(q[d]));
    } else {
        uint8_t qq[KERN_MAX_HEAD_DIM / 32 * sizeof(struct kern_block_q8_0)];
        kern_quantize_act(KERN_Q8_0, q, qq, D);
        kern_dequantize_row(KERN_Q8_0, qq, row, D);
        for (int d = 0; d < D; d++)
            qh[d] = row[d];
    }
    double *s = malloc((size_t)n_ctx * sizeof(double));
    double mx = -INFINITY;
    for (int j = lo; j < n_ctx; j++) {
        const size_t off = (size_t)table[j / bt] * c->block_bytes + (size_t)kvh * c->k_head +
                           (size_t)(j % bt) * c->k_row;
        kern_dequantize_row(c->k_type, c->hk + off, row, D);
        double a = 0.0;
        for (int d = 0; d < D; d++)
            a += qh[d] * row[d];
        s[j] = a / sqrt((double)D);
        mx = s[j] > mx ? s[j] : mx;
    }
    double sum = 0.0;
    for (int j = lo; j < n_ctx; j++) {
        s[j] = exp(s[j] - mx);
        sum += s[j];
    }
    for (int d = 0; d < D; d++)
        out[d] = vscale[d] = 0.0;
    for (int j = lo; j < n_ctx; j++) {
        const size_t off = (size_t)table[j / bt] * c->block_bytes + (size_t)kvh * c->v_head +
                           (size_t)(j % bt) * c->v_row;
        kern_dequantize_row(c->v_type, c->hv + off, row, D);
        const double p = s[j] / sum;
        for (int d = 0; d < D; d++) {
            const double x = row[d];
            out[d] += p * x;
            vscale[d] += p * fabs(x);
        }
    }
    free(s);
}

struct worst {
    double exact, twin, twin_norm;
};

/* Checks row `row` (its token at position qp of sequence seq) of a GPU output
 * against the twin and the exact attention, every head. */
static void check_row(struct worst *w, const struct cache *c, const struct batch *b, int seq, int row, int qp,
                      const float *gpu)
{
    const int D = c->s.head_dim, G = c->s.n_head / c->s.n_kv, n_ctx = qp + 1;
    const uint32_t *table = b->tables + b->seqs[seq].table;
    float *scores = malloc((size_t)n_ctx * sizeof(float));
    for (int h = 0; h < c->s.n_head; h++) {
        const size_t off = ((size_t)row * c->s.n_head + h) * D;
        const float *q = b->q + off, *g = gpu + off;
        float twin[KERN_MAX_HEAD_DIM];
        double ex[KERN_MAX_HEAD_DIM], vs[KERN_MAX_HEAD_DIM];
        const struct kern_attn_args ta = {
            .out = twin, .q = q, .n_q = 1, .k_base = c->hk, .v_base = c->hv, .blocks = table, .n_ctx = n_ctx,
            .block_tokens = c->s.block_tokens, .head_dim = D, .kv_head = h / G, .block_stride = c->block_bytes,
            .k_head_stride = c->k_head, .v_head_stride = c->v_head, .k_type = c->k_type,
            .v_type = c->v_type, .scale = 1.0f / sqrtf((float)D), .scores = scores, .skip = window_lo(qp),
        };
        kern_attn_paged(&ta, 0);
        attn_exact(ex, vs, q, c, h / G, table, window_lo(qp), n_ctx);
        double ex_max = 0, vs_max = 0, tw_max = 0, e_ex = 0, e_tw = 0;
        for (int d = 0; d < D; d++) {
            ex_max = fmax(ex_max, fabs(ex[d]));
            vs_max = fmax(vs_max, vs[d]);
            tw_max = fmax(tw_max, fabs(twin[d]));
            e_ex = fmax(e_ex, fabs(g[d] - ex[d]));
            e_tw = fmax(e_tw, fabs(g[d] - twin[d]));
            if (isnan(g[d]))
                e_ex = e_tw = INFINITY;
        }
        const double r_ex = e_ex / fmax(ex_max, 1e-30), r_tw = e_tw / fmax(vs_max, 1e-30);
        if (r_ex > TOL_EXACT || r_tw > TOL_TWIN)
            fprintf(stderr, "  %s %s seq %d row %d head %d ctx %d: vs exact %.3g, vs twin %.3g\n", c->s.name,
                    types_name(c), seq, row, h, n_ctx, r_ex, r_tw);
        CHECK(r_ex <= TOL_EXACT);
        CHECK(r_tw <= TOL_TWIN);
        w->exact = fmax(w->exact, r_ex);
        w->twin = fmax(w->twin, r_tw);
        w->twin_norm = fmax(w->twin_norm, e_tw / fmax(tw_max, 1e-30));
    }
    free(scores);
}

static void report(const char *what, const struct cache *c, const struct worst *w)
{
    printf("%-34s %-5s %-9s vs exact %.2e  vs twin %.2e (normwise %.2e)\n", what, c->s.name, types_name(c),
           w->exact, w->twin, w->twin_norm);
}

/* Decode of n sequences with the given contexts; every row checked, and each
 * of the first few sequences run alone must give the same bits. */
static void test_decode(const struct cache *c, int n, const int *ctx, float qscale, int split, const char *what)
{
    int *pos = calloc((size_t)n, sizeof(int)), *one = calloc((size_t)n, sizeof(int));
    for (int i = 0; i < n; i++) {
        pos[i] = ctx[i] - 1;
        one[i] = 1;
    }
    struct batch b;
    batch_make(&b, c, n, pos, one, qscale);
    float *out = gpu_attn(c, &b, 0, split);
    struct worst w = { 0 };
    for (int i = 0; i < n; i++)
        check_row(&w, c, &b, i, i, pos[i], out);
    report(what, c, &w);

    /* batch invariance: the same sequence alone */
    const size_t row_floats = (size_t)c->s.n_head * c->s.head_dim;
    for (int i = 0; i < n && i < 3; i++) {
        struct batch s1 = { .n_seq = 1, .rows = 1, .n_tables = b.n_tables };
        struct kcuda_seq sq = { .row = 0, .n_tok = 1, .pos = pos[i], .table = b.seqs[i].table };
        s1.seqs = &sq;
        s1.tables = b.tables;
        s1.q = b.q + (size_t)i * row_floats;
        float *alone = gpu_attn(c, &s1, 0, split);
        CHECK(memcmp(alone, out + (size_t)i * row_floats, row_floats * sizeof(float)) == 0);
        free(alone);
    }
    free(out);
    batch_free(&b);
    free(pos);
    free(one);
}

/* Prefill of chunks (pos[i], n_tok[i]): rows checked against the twin (all of
 * them, or a sample in chunks after long prefixes), and every row against
 * decoding its token alone, bit for bit. */
static void test_prefill(const struct cache *c, int n, const int *pos, const int *n_tok, int split,
                         const char *what)
{
    struct batch b;
    batch_make(&b, c, n, pos, n_tok, 2.0f);
    float *out = gpu_attn(c, &b, 1, split);
    struct worst w = { 0 };
    for (int i = 0; i < n; i++) {
        const int long_ctx = pos[i] + n_tok[i] > 8192;
        for (int t = 0; t < n_tok[i]; t++)
            if (!long_ctx || t == 0 || t == n_tok[i] / 2 || t == n_tok[i] - 1)
                check_row(&w, c, &b, i, b.seqs[i].row + t, pos[i] + t, out);
    }
    report(what, c, &w);

    /* the same tokens as decode steps, one sequence each */
    struct batch d = { .n_seq = b.rows, .rows = b.rows, .tables = b.tables, .n_tables = b.n_tables, .q = b.q };
    d.seqs = calloc((size_t)b.rows, sizeof(*d.seqs));
    for (int i = 0; i < n; i++)
        for (int t = 0; t < n_tok[i]; t++) {
            const int r = b.seqs[i].row + t;
            d.seqs[r] = (struct kcuda_seq){ .row = r, .n_tok = 1, .pos = pos[i] + t, .table = b.seqs[i].table };
        }
    float *dec = gpu_attn(c, &d, 0, split);
    const size_t floats = (size_t)b.rows * c->s.n_head * c->s.head_dim;
    size_t differ = 0;
    for (size_t i = 0; i < floats; i++)
        differ += memcmp(&dec[i], &out[i], sizeof(float)) != 0;
    if (differ)
        fprintf(stderr, "  %s %s %s: %zu of %zu prefill values differ from decode\n", c->s.name, types_name(c), what,
                differ, floats);
    CHECK(differ == 0);
    free(d.seqs);
    free(dec);
    free(out);
    batch_free(&b);
}

/* A value that overflowed f16 (+inf) at position 35 of a 40-token chunk:
 * the chunk's earlier tokens, for which that key is masked, stay finite and
 * equal to decoding them alone (a masked key adds nothing, not 0 * inf);
 * every token agrees with decode bit for bit. */
static void test_prefill_inf(struct cache *c)
{
    const int pos = 0, n_tok = 40, at = 35;
    struct batch b;
    batch_make(&b, c, 1, &pos, &n_tok, 2.0f);
    for (int j = 0; j < b.n_tables; j++)
        b.tables[j] = (uint32_t)j;                  /* distinct blocks: one position holds the inf */
    const int bt = c->s.block_tokens, D = c->s.head_dim;
    REQUIRE(c->v_type == KERN_F16);
    kvd_f16 *v0 = (kvd_f16 *)(c->hv + (size_t)b.tables[at / bt] * c->block_bytes) + (size_t)(at % bt) * D;
    kvd_f16 saved[KERN_MAX_HEAD_DIM];
    memcpy(saved, v0, (size_t)D * sizeof(kvd_f16));
    for (int i = 0; i < D; i++)
        v0[i] = 0x7c00;                             /* +inf in KV head 0 */
    REQUIRE(kcuda_upload(c->dev, c->host, c->bytes) == 0);
    float *out = gpu_attn(c, &b, 1, 0);
    struct batch d = { .n_seq = n_tok, .rows = n_tok, .tables = b.tables, .n_tables = b.n_tables, .q = b.q };
    d.seqs = calloc((size_t)n_tok, sizeof(*d.seqs));
    for (int t = 0; t < n_tok; t++)
        d.seqs[t] = (struct kcuda_seq){ .row = t, .n_tok = 1, .pos = pos + t, .table = 0 };
    float *dec = gpu_attn(c, &d, 0, 0);
    const size_t per_tok = (size_t)c->s.n_head * D;
    size_t differ = 0, nonfinite_before = 0;
    for (size_t i = 0; i < (size_t)n_tok * per_tok; i++) {
        differ += memcmp(&dec[i], &out[i], sizeof(float)) != 0;
        nonfinite_before += i < (size_t)at * per_tok && !isfinite(out[i]);
    }
    printf("prefill with an infinite value at position %d: %zu values differ from decode, %zu not finite "
           "before it\n", at, differ, nonfinite_before);
    CHECK(differ == 0);
    CHECK(nonfinite_before == 0);
    memcpy(v0, saved, (size_t)D * sizeof(kvd_f16));
    REQUIRE(kcuda_upload(c->dev, c->host, c->bytes) == 0);
    free(d.seqs);
    free(dec);
    free(out);
    batch_free(&b);
}

static void rand_ctx(int *ctx, int n, int lo, int hi)
{
    for (int i = 0; i < n; i++)
        ctx[i] = lo + (int)(rng_u32() % (uint32_t)(hi - lo + 1));
}

int main(int argc, char **argv)
{
    const bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    char why[256];
    if (kcuda_device_count(why, sizeof(why)) == 0) {
        printf("skip: %s\n", why);
        return KVD_TEST_SKIP;
    }
    struct kcuda_info info;
    REQUIRE(kcuda_device_open(0, &info) == 0);
    printf("device: %s (sm_%d%d, %d SMs)\n", info.name, info.major, info.minor, info.sm_count);

    static const struct shape shapes[] = {
        { "9/3", 9, 3, 64, 16, 2100 },      /* SmolLM2-135M */
        { "32/8", 32, 8, 128, 16, 420 },    /* Llama-3-8B */
        { "4/4", 4, 4, 64, 32, 300 },       /* multi-head, 32-position blocks */
        { "14/2", 14, 2, 64, 16, 600 },     /* groups of 7 */
        { "4/1", 4, 1, 256, 16, 300 },      /* Gemma 3 270M: head dim 256, MQA */
    };
    const struct shape *gemma = &shapes[4];
    int ctx[256];
    if (quick) {
        /* both kernels, the merge and the masked-key case, small: for compute-sanitizer (run.sh) */
        struct cache c;
        REQUIRE(cache_init(&c, &shapes[0], KERN_F16, KERN_F16) == 0);
        static const int mixed[] = { 1, 31, 32, 33, 257, 700 };
        test_decode(&c, 6, mixed, 3.0f, 0, "decode batch 6 mixed");
        static const int qp[] = { 0, 300 }, qn[] = { 50, 20 };
        test_prefill(&c, 2, qp, qn, 64, "prefill 2 chunks, split 64");
        test_prefill_inf(&c);
        cache_fini(&c);
        REQUIRE(cache_init(&c, &shapes[0], KERN_Q4_0, KERN_Q8_0) == 0);
        test_decode(&c, 6, mixed, 3.0f, 0, "decode batch 6 mixed");
        test_prefill(&c, 2, qp, qn, 64, "prefill 2 chunks, split 64");
        cache_fini(&c);
        /* head dim 256 under a sliding window of 40 over splits of 64 */
        REQUIRE(cache_init(&c, gemma, KERN_F16, KERN_F16) == 0);
        g_window = 40;
        test_decode(&c, 6, mixed, 3.0f, 64, "decode batch 6 mixed, window 40");
        test_prefill(&c, 2, qp, qn, 64, "prefill 2 chunks, window 40");
        g_window = 0;
        cache_fini(&c);
        return CHECK_DONE();
    }
    /* head dim 256 (Gemma 3), whole and under sliding windows: one that starts
     * inside a block and a split (40 over splits of 64: whole splits skipped,
     * the merge from the window's first), and Gemma's own (512, split default) */
    static const uint32_t gemma_types[][2] = { { KERN_F16, KERN_F16 }, { KERN_Q8_0, KERN_Q4_0 } };
    for (size_t ti = 0; ti < 2; ti++) {
        struct cache c;
        REQUIRE(cache_init(&c, gemma, gemma_types[ti][0], gemma_types[ti][1]) == 0);
        static const int windows[] = { 0, 40, 512 };
        for (size_t wi = 0; wi < 3; wi++) {
            g_window = windows[wi];
            const int split = g_window == 40 ? 64 : 0;
            char what[64];
            static const int mixed[] = { 1, 39, 40, 41, 300, 1000, 3000 };
            snprintf(what, sizeof(what), "decode batch 7, window %d", g_window);
            test_decode(&c, 7, mixed, 3.0f, split, what);
            static const int pp[] = { 0, 20, 900 }, pn[] = { 70, 45, 33 };
            snprintf(what, sizeof(what), "prefill 3 chunks, window %d", g_window);
            test_prefill(&c, 3, pp, pn, split, what);
        }
        g_window = 0;
        cache_fini(&c);
    }
    for (size_t si = 0; si < 4; si++) {
        struct cache c;
        REQUIRE(cache_init(&c, &shapes[si], KERN_F16, KERN_F16) == 0);
        const int max_ctx = c.s.n_blocks * c.s.block_tokens;
        if (si == 0) {
            static const int single[] = { 1, 7, 16, 33, 300, 4097, 32768 };
            for (size_t i = 0; i < sizeof(single) / sizeof(single[0]); i++) {
                char what[64];
                snprintf(what, sizeof(what), "decode batch 1 ctx %d", single[i]);
                test_decode(&c, 1, &single[i], 3.0f, 0, what);
            }
            static const int mixed[] = { 1, 31, 32, 33, 257, 1000, 5000, 32768 };
            test_decode(&c, 8, mixed, 3.0f, 0, "decode batch 8 mixed");
            test_decode(&c, 8, mixed, 0.3f, 0, "decode batch 8 mixed, flat");
            rand_ctx(ctx, 64, 1, 3000);
            test_decode(&c, 64, ctx, 2.0f, 0, "decode batch 64 ctx 1..3000");
            rand_ctx(ctx, 200, 1, 600);
            test_decode(&c, 200, ctx, 2.0f, 0, "decode batch 200 ctx 1..600");
            rand_ctx(ctx, 16, 1, 2000);
            test_decode(&c, 16, ctx, 2.0f, 64, "decode batch 16, split 64");
            static const int pp[] = { 0, 0, 5, 1000, 32700 }, pn[] = { 1, 37, 100, 77, 68 };
            test_prefill(&c, 5, pp, pn, 0, "prefill 5 chunks");
            static const int qp[] = { 0, 300 }, qn[] = { 150, 90 };
            test_prefill(&c, 2, qp, qn, 64, "prefill 2 chunks, split 64");
            test_prefill_inf(&c);
        } else {
            static const int few[] = { 1, 100, 1000, 3000, 6000 };
            int n5 = 0;
            for (int i = 0; i < 5; i++)
                if (few[i] <= max_ctx)
                    ctx[n5++] = few[i];
            test_decode(&c, n5, ctx, 3.0f, 0, "decode batch 5");
            rand_ctx(ctx, 33, 1, max_ctx < 2000 ? max_ctx : 2000);
            test_decode(&c, 33, ctx, 2.0f, 0, "decode batch 33 ctx 1..2000");
            const int pp[] = { 0, 3000 }, pn[] = { 130, 45 };
            test_prefill(&c, 2, pp, pn, 0, "prefill 2 chunks");
        }
        cache_fini(&c);
    }
    /* quantized halves: each pair on the 64- and 128-wide shapes */
    static const uint32_t pairs[][2] = {
        { KERN_Q8_0, KERN_Q8_0 }, { KERN_F16, KERN_Q4_0 }, { KERN_Q4_0, KERN_Q4_0 }, { KERN_Q8_0, KERN_Q4_0 },
    };
    for (size_t pi = 0; pi < sizeof(pairs) / sizeof(pairs[0]); pi++)
        for (size_t si = 0; si < 2; si++) {
            struct cache c;
            REQUIRE(cache_init(&c, &shapes[si], pairs[pi][0], pairs[pi][1]) == 0);
            static const int mixed[] = { 1, 31, 33, 257, 1000, 4100 };
            test_decode(&c, 6, mixed, 3.0f, 0, "decode batch 6 mixed");
            rand_ctx(ctx, 24, 1, 1200);
            test_decode(&c, 24, ctx, 2.0f, 64, "decode batch 24, split 64");
            static const int pp[] = { 0, 5, 700 }, pn[] = { 37, 70, 45 };
            test_prefill(&c, 3, pp, pn, 0, "prefill 3 chunks");
            cache_fini(&c);
        }
    return CHECK_DONE();
}
