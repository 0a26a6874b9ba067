/* forward.c - the llama forward step: embeddings, blocks, final norm, logits. */
#include "forward.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "attn.h"
#include "cpu.h"
#include "f16.h"
#include "gemm.h"
#include "ops.h"
#include "pool.h"      /* POOL_NONE */
#include "quant.h"
#include "tpool.h"
#include "types.h"

#define ACT_SLOTS 3  /* distinct activation formats one input may be quantized to */
/* A prefill tile: tokens [t0, t0 + n_tok) of one sequence in the step, the
 * heads of KV head kv_head, their positions of attention range `range`: one
 * kern_attn_multi call (engine_step lays them out, attn_run runs them). */
struct attn_unit {
    uint32_t t0;
    uint16_t n_tok;
    uint16_t range;
    uint32_t kv_head;
};

#define ATTN_ITEM_COST 32  /* an attention item's fixed cost (setup, softmax, output), in positions */

/* An input row set quantized to the format one weight type consumes. */
struct act_slot {
    uint32_t type;          /* activation type; UINT32_MAX when unused */
    size_t stride;          /* bytes per token row */
    uint8_t *buf;           /* max_tokens rows */
};

/* A thread's share of a product's row groups: [next, end), taken a chunk at a
 * time from the front, by its owner first and then by threads done with
 * their own; one cache line each, so that owners do not contend. */
struct mm_share {
    _Alignas(64) long next;     /* atomic */
    long end;
};

/* A thread's share of a layer's attention: prefill tiles [unit_next,
 * unit_end) and per-token items [item_next, item_end), taken from the front
 * as mm_share's row groups are, by the owner first and then by threads done
 * with their own. */
struct attn_share {
    _Alignas(64) long unit_next;    /* atomic */
    long unit_end;
    long item_next;                 /* atomic */
    long item_end;
};

struct engine {
    const model_t *m;       /* borrowed */
    kvcache_t *kv;          /* borrowed */
    struct engine_params p;
    tpool_t *pool;
    uint32_t step_T;        /* tokens in the step being run */
    int n_threads;

    /* per-step token layout (T = tokens in the step) */
    int32_t *tok_id;        /* (T) */
    int32_t *tok_pos;       /* (T) position within its sequence */
    uint32_t *tok_seq;      /* (T) index of its sequence in the step */
    int32_t *out_tok;       /* (rows) tokens whose logits are returned */

    /* activations, rows of T tokens */
    float *x;               /* (T, n_embd) residual stream */
    float *xb;              /* (T, max(n_embd, q_dim)) normed input / attention output */
    float *q;               /* (T, n_head*head_dim) */
    float *k;               /* (T, n_head_kv*head_dim) */
    float *v;               /* (T, n_head_kv*head_dim) */
    float *gate;            /* (T, n_ff) */
    float *up;              /* (T, n_ff) */
    float *rope;            /* (T, head_dim) cos/sin pairs per token */
    float *rope_swa;        /* the same at the windowed layers' base; NULL when it is rope's */
    uint64_t *item0_win;    /* (T + 1) first (token, head) item of each token at windowed layers */
    float *scores;          /* (n_threads, group, max_ctx) attention scratch */
    uint32_t chunk;         /* positions per attention range (a multiple of block_tokens) */
    uint32_t *n_range;      /* (T) attention ranges of each token: ceil(n_ctx / chunk) */
    uint32_t *r_first;      /* (T) a decode token's first range run as items: the ranges before
                             * go in tiles with the tokens beside it that share their blocks */
    uint64_t *item0;        /* (T + 1) first (token, range, head) item of each token */
    uint64_t *cost0;        /* (T + 1) the attention work before each token: positions read
                             * per head, plus ATTN_ITEM_COST per item (threads share it out) */
    uint32_t *slot0;        /* (T) first partial-result slot of each split token */
    float *part;            /* (T * max ranges, n_head, head_dim) partial outputs of split tokens */
    float *part_stats;      /* (T * max ranges, n_head, 2) their max and sum */
    struct attn_unit *units;/* this step's prefill tiles (attn_units), at full-attention layers */
    struct attn_unit *dgroups;  /* (T) decode tokens side by side that share ranges: t0, n_tok,
                             * and in `range` how many leading ranges they share */
    uint32_t n_dgroups;
    uint64_t *unit_cost0;   /* (n_units + 1) the work before each unit, as cost0 counts it */
    uint32_t n_units;
    void **tile_scratch;    /* (n_threads) kern_attn_multi's scratch, for tile_ctx positions */
    int tile_ctx;           /* e->chunk, or a window's tile span where that is longer */
    bool win_tiles;         /* this step runs a windowed layer's prefill tokens in tiles */
    struct act_slot act[ACT_SLOTS];
    void **gemm_scratch;    /* (n_threads) per-thread scratch of the matrix products */
    struct mm_share *share; /* (n_threads) each thread's share of the product being run */
    struct attn_share *ashare;  /* (n_threads) each thread's share of the attention being run */
    float *logits;          /* (logits_cap, n_vocab) */
    uint32_t logits_cap;    /* rows logits can hold */
    uint64_t progress;      /* atomic: parallel jobs completed (engine_progress) */
};

struct engine_params engine_default_params(void)
{
    struct engine_params p = { .max_tokens = 512, .max_ctx = 0, .n_threads = 0 };
    return p;
}

const model_t *engine_model(const engine_t *e) { return e->m; }
int engine_threads(const engine_t *e) { return e->n_threads; }

uint32_t engine_decode_tiled(const engine_t *e)
{
    uint32_t n = 0;
    for (uint32_t d = 0; d < e->n_dgroups; d++)
        n += e->dgroups[d].n_tok;
    return n;
}

uint64_t engine_progress(const engine_t *e)
{
    return __atomic_load_n(&e->progress, __ATOMIC_RELAXED);
}

static void *xmalloc_arr(size_t n, size_t size)
{
    if (n != 0 && size > SIZE_MAX / n)
        return NULL;
    return malloc(n != 0 && size != 0 ? n * size : 1);
}

void engine_destroy(engine_t **ep)
{
    if (ep == NULL || *ep == NULL)
        return;
    engine_t *e = *ep;
    tpool_destroy(&e->pool);
    free(e->tok_id);
    free(e->tok_pos);
    free(e->tok_seq);
    free(e->out_tok);
    free(e->x);
    free(e->xb);
    free(e->q);
    free(e->k);
    free(e->v);
    free(e->gate);
    free(e->up);
    free(e->rope);
    free(e->rope_swa);
    free(e->item0_win);
    free(e->scores);
    free(e->n_range);
    free(e->r_first);
    free(e->dgroups);
    free(e->item0);
    free(e->cost0);
    free(e->slot0);
    free(e->part);
    free(e->part_stats);
    free(e->units);
    free(e->unit_cost0);
    if (e->tile_scratch != NULL)
        for (int i = 0; i < e->n_threads; i++)
            free(e->tile_scratch[i]);
    free(e->tile_scratch);
    for (int i = 0; i < ACT_SLOTS; i++)
        free(e->act[i].buf);
    free(e->logits);
    if (e->gemm_scratch != NULL)
        for (int i = 0; i < e->n_threads; i++)
            free(e->gemm_scratch[i]);
    free(e->gemm_scratch);
    free(e->share);
    free(e->ashare);
    free(e);
    *ep = NULL;
}

engine_t *engine_new(const model_t *m, kvcache_t *kv, const struct engine_params *pp,
                     char *err, size_t errlen)
{
    const struct model_config *c = &m->cfg;
    struct engine_params p = pp ? *pp : engine_default_params();
    /* the kernel path once, here: where AMX is used, the process asks Linux
     * for the tile data before the step threads start, not from one of them */
    (void)kern_isa();
    (void)kern_amx();
    if (p.max_tokens == 0)
        p.max_tokens = 512;
    if (p.max_ctx == 0)
        p.max_ctx = c->n_ctx_train;
    if (p.max_tokens > 65536 || p.max_ctx > (1u << 22)) {
        kvd_seterr(err, errlen, KVD_EINVAL, "engine: step of %u tokens or context of %u is too large",
                   p.max_tokens, p.max_ctx);
        return NULL;
    }
    if (kv->n_layer != c->n_layer || kv->n_head_kv != c->n_head_kv || kv->head_dim != c->head_dim) {
        kvd_seterr(err, errlen, KVD_EINVAL, "engine: KV cache shape does not match the model");
        return NULL;
    }
    for (uint32_t l = 0; l < c->n_layer && kv->parts.n_parts > 1; l++) {
        const uint32_t w = model_layer_windowed(c, l) ? c->swa_window : 0;
        if (kv->parts.window[kv_part_of(&kv->parts, l)] != w) {
            kvd_seterr(err, errlen, KVD_EINVAL,
                       "engine: the KV cache keeps a window of %u for layer %u, which attends to %u",
                       kv->parts.window[kv_part_of(&kv->parts, l)], l, w);
            return NULL;
        }
    }
    engine_t *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "engine: out of memory");
        return NULL;
    }
    e->m = m;
    e->kv = kv;
    e->p = p;
    e->pool = tpool_new(p.n_threads);
    if (e->pool == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "engine: cannot start threads");
        engine_destroy(&e);
        return NULL;
    }
    e->n_threads = tpool_size(e->pool);
    size_t T = p.max_tokens;
    size_t qd = (size_t)c->n_head * c->head_dim, kvd = (size_t)c->n_head_kv * c->head_dim;
    size_t widest = c->n_embd > qd ? c->n_embd : qd;
    if (c->n_ff > widest)
        widest = c->n_ff;
    e->tok_id = xmalloc_arr(T, sizeof(int32_t));
    e->tok_pos = xmalloc_arr(T, sizeof(int32_t));
    e->tok_seq = xmalloc_arr(T, sizeof(uint32_t));
    e->out_tok = xmalloc_arr(T, sizeof(int32_t));
    e->x = xmalloc_arr(T * c->n_embd, sizeof(float));
    e->xb = xmalloc_arr(T * (c->n_embd > qd ? c->n_embd : qd), sizeof(float));
    e->q = xmalloc_arr(T * qd, sizeof(float));
    e->k = xmalloc_arr(T * kvd, sizeof(float));
    e->v = xmalloc_arr(T * kvd, sizeof(float));
    e->gate = xmalloc_arr(T * c->n_ff, sizeof(float));
    e->up = xmalloc_arr(T * c->n_ff, sizeof(float));
    e->rope = xmalloc_arr(T * c->head_dim, sizeof(float));
    const bool swa = c->swa_window > 0;
    e->rope_swa = swa && c->rope_base_swa != c->rope_base ? xmalloc_arr(T * c->head_dim, sizeof(float)) : NULL;
    e->item0_win = swa ? xmalloc_arr(T + 1, sizeof(uint64_t)) : NULL;
    e->scores = xmalloc_arr((size_t)e->n_threads * (c->n_head / c->n_head_kv) * p.max_ctx, sizeof(float));
    uint32_t chunk = p.attn_chunk ? p.attn_chunk : 1024;
    e->chunk = (chunk + kv->block_tokens - 1) / kv->block_tokens * kv->block_tokens;
    size_t max_ranges = (p.max_ctx + e->chunk - 1) / e->chunk;
    e->n_range = xmalloc_arr(T, sizeof(uint32_t));
    e->r_first = xmalloc_arr(T, sizeof(uint32_t));
    e->dgroups = xmalloc_arr(T, sizeof(*e->dgroups));
    e->item0 = xmalloc_arr(T + 1, sizeof(uint64_t));
    e->cost0 = xmalloc_arr(T + 1, sizeof(uint64_t));
    e->slot0 = xmalloc_arr(T, sizeof(uint32_t));
    e->part = max_ranges > 1 ? xmalloc_arr(T * max_ranges * c->n_head * c->head_dim, sizeof(float)) : NULL;
    e->part_stats = max_ranges > 1 ? xmalloc_arr(T * max_ranges * c->n_head * 2, sizeof(float)) : NULL;
    /* a tile per token at most, times its ranges and the KV heads */
    const size_t max_units = T * max_ranges * c->n_head_kv;
    e->units = xmalloc_arr(max_units, sizeof(*e->units));
    e->unit_cost0 = xmalloc_arr(max_units + 1, sizeof(uint64_t));
    e->tile_scratch = calloc((size_t)e->n_threads, sizeof(void *));
    /* a windowed tile reads its first token's window from that window's
     * first block to its last token: at most window + block + tile tokens */
    e->tile_ctx = (int)e->chunk;
    if (swa && (int)(c->swa_window + kv->block_tokens + KERN_ATTN_LANES) > e->tile_ctx)
        e->tile_ctx = (int)(c->swa_window + kv->block_tokens + KERN_ATTN_LANES);
    for (int i = 0; e->tile_scratch != NULL && i < e->n_threads; i++)
        if ((e->tile_scratch[i] = malloc(kern_attn_multi_scratch(e->tile_ctx, (int)c->head_dim))) == NULL)
            break;
    const bool tiles_ok = e->units && e->unit_cost0 && e->tile_scratch &&
                          e->tile_scratch[e->n_threads - 1] != NULL;
    bool ranges_ok = tiles_ok && e->n_range && e->r_first && e->dgroups && e->item0 && e->cost0 && e->slot0 && (max_ranges <= 1 || (e->part && e->part_stats));
    bool ok = e->tok_id && e->tok_pos && e->tok_seq && e->out_tok && e->x && e->xb && e->q &&
              e->k && e->v && e->gate && e->up && e->rope && e->scores && ranges_ok &&
              (!swa || (e->item0_win && (e->rope_swa || c->rope_base_swa == c->rope_base)));
    e->gemm_scratch = calloc((size_t)e->n_threads, sizeof(void *));
    e->share = aligned_alloc(64, (size_t)e->n_threads * sizeof(struct mm_share));
    e->ashare = aligned_alloc(64, (size_t)e->n_threads * sizeof(struct attn_share));
    ok = ok && e->gemm_scratch && e->share && e->ashare;
    for (int i = 0; ok && i < e->n_threads; i++) {
        size_t bytes = kern_gemm_scratch_bytes((int64_t)widest, (int)T);
        e->gemm_scratch[i] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        ok = e->gemm_scratch[i] != NULL;
    }
    for (int i = 0; i < ACT_SLOTS; i++) {
        e->act[i].type = UINT32_MAX;
        e->act[i].buf = xmalloc_arr(T * widest, sizeof(float)); /* f32 is the widest format */
        ok = ok && e->act[i].buf;
    }
    if (!ok) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "engine: out of memory for scratch buffers");
        engine_destroy(&e);
        return NULL;
    }
    return e;
}

/* ---- parallel jobs ---------------------------------------------------------- */

/* Runs one job of the step on every thread of the pool and counts it done. */
static void run_job(engine_t *e, tpool_fn fn, void *ctx)
{
    tpool_run(e->pool, fn, ctx);
    __atomic_fetch_add(&e->progress, 1, __ATOMIC_RELAXED);
}

/* Runs a per-token job (norm, quantization, RoPE) on the pool, or on this
 * thread alone when a handful of tokens would not repay waking the others.
 * Each token's result is the same either way. */
static void run_rows(engine_t *e, tpool_fn fn, void *ctx, uint32_t T)
{
    if (T <= 4)
        fn(ctx, 0, 1);
    else
        tpool_run(e->pool, fn, ctx);
    __atomic_fetch_add(&e->progress, 1, __ATOMIC_RELAXED);
}

/* Quantizes rows [0, T) of src (stride n floats) into slot. */
struct quant_job {
    const float *src;
    int n, T;
    struct act_slot *slot;
};

static void quant_run(void *ctx, int ith, int nth)
{
    struct quant_job *j = ctx;
    long t0, t1;
    tpool_split(j->T, ith, nth, &t0, &t1);
    for (long t = t0; t < t1; t++)
        kern_quantize_act(j->slot->type, j->src + (size_t)t * j->n, j->slot->buf + t * j->slot->stride, j->n);
}

/* Returns the activation rows of src (T x n) in the format weight type wtype
 * consumes, quantizing them on first use. `fresh` clears the slots first. */
static const struct act_slot *acts_for(engine_t *e, uint32_t wtype, const float *src, int n,
                                       int T, bool fresh)
{
    if (fresh)
        for (int i = 0; i < ACT_SLOTS; i++)
            e->act[i].type = UINT32_MAX;
    uint32_t at = kern_vec_dot_type(wtype);
    int i;
    for (i = 0; i < ACT_SLOTS; i++) {
        if (e->act[i].type == at)
            return &e->act[i];
        if (e->act[i].type == UINT32_MAX)
            break;
    }
    /* three distinct activation formats per input is the most any model uses */
    struct act_slot *s = &e->act[i < ACT_SLOTS ? i : ACT_SLOTS - 1];
    s->type = at;
    s->stride = kern_act_row_bytes(at, n);
    struct quant_job j = { src, n, T, s };
    run_rows(e, quant_run, &j, (uint32_t)T);
    return s;
}

/* Up to three matrix products that share one input, split by output rows. */
struct mm_part {
    const struct model_mat *w;
    const struct act_slot *act;
    float *out;             /* (T, w->rows) */
    bool add;               /* out += instead of out = */
};

struct mm_job {
    engine_t *e;
    struct mm_part part[3];
    int n_parts;
    int T;
    long chunk;             /* row groups taken at a time */
};

/* Computes row groups [u0, u1), counted over the parts one after another;
 * *staged is the part whose activations the scratch holds (-1: none). */
static void mm_units(const struct mm_job *j, long u0, long u1, void *scratch, int *staged)
{
    const long G = KERN_PACK_ROWS;
    long base = 0;
    for (int i = 0; i < j->n_parts && base < u1; i++) {
        const struct mm_part *p = &j->part[i];
        const struct model_mat *w = p->w;
        const long units = (w->rows + G - 1) / G;
        long lo = u0 > base ? u0 - base : 0, hi = u1 - base < units ? u1 - base : units;
        if (lo < hi) {
            struct kern_gemm_args g = {
                .wtype = w->type, .packed = w->packed, .w = w->data,
                .row_bytes = w->row_bytes,
                .n = w->cols, .r0 = lo * G, .r1 = hi * G < w->rows ? hi * G : (long)w->rows,
                .act = p->act->buf, .act_stride = p->act->stride, .T = j->T,
                .out = p->out, .ldo = (size_t)w->rows, .add = p->add,
                .scratch = scratch, .staged = *staged == i,
            };
            kern_gemm(&g);
            *staged = i;
        }
        base += units;
    }
}

/* Each thread runs its own share a chunk at a time, then takes chunks from
 * the shares of the others, so that a thread that starts late, runs slow or
 * is preempted holds up the step by one chunk at most. Every output row is
 * computed whole by one call, with the same bits whichever thread runs it
 * (a product's rows do not depend on how the range is cut). */
static void mm_run(void *ctx, int ith, int nth)
{
    struct mm_job *j = ctx;
    struct mm_share *sh = j->e->share;
    void *scratch = j->e->gemm_scratch[ith];
    int staged = -1;
    for (int k = 0; k < nth; k++) {
        struct mm_share *s = &sh[(ith + k + (int)(j->e->p.share_shift % (uint32_t)nth)) % nth];
        for (;;) {
            const long u0 = __atomic_fetch_add(&s->next, j->chunk, __ATOMIC_RELAXED);
            if (u0 >= s->end)
                break;
            mm_units(j, u0, u0 + j->chunk < s->end ? u0 + j->chunk : s->end, scratch, &staged);
        }
    }
}

/* Row groups per chunk: about MM_CHUNK_WEIGHTS weights, a few microseconds of
 * a decode step, in a multiple of four groups (the widest tile at one token:
 * AVX-512's four groups, two for 256-bit and NEON tiles). The activations are
 * staged once per part and thread, not per chunk, so a batch's chunks cost
 * no more. */
#define MM_CHUNK_WEIGHTS 65536

static void matmul(engine_t *e, struct mm_part *parts, int n, int T)
{
    const long G = KERN_PACK_ROWS;
    struct mm_job j = { .e = e, .n_parts = n, .T = T };
    long total = 0, widest = 1;
    for (int i = 0; i < n; i++) {
        j.part[i] = parts[i];
        total += (parts[i].w->rows + G - 1) / G;
        widest = parts[i].w->cols > widest ? parts[i].w->cols : widest;
    }
    const long chunk = MM_CHUNK_WEIGHTS / (G * widest);
    j.chunk = chunk > 4 ? (chunk + 3) / 4 * 4 : 4;
    /* each thread's share: whole groups of KERN_PACK_ROWS rows (what one
     * packed instruction computes), split evenly */
    for (int i = 0; i < e->n_threads; i++)
        tpool_split(total, i, e->n_threads, &e->share[i].next, &e->share[i].end);
    run_job(e, mm_run, &j);
}

/* RMSNorm of T rows. */
struct norm_job {
    float *out;
    const float *x;
    const float *w;
    int n, T;
    float eps;
    const int32_t *rows;    /* when set: out row i is x row rows[i] */
};

static void norm_run(void *ctx, int ith, int nth)
{
    struct norm_job *j = ctx;
    long t0, t1;
    tpool_split(j->T, ith, nth, &t0, &t1);
    if (j->rows == NULL) {
        kern_rmsnorm_rows(j->out + (size_t)t0 * j->n, j->x + (size_t)t0 * j->n, j->w, j->n, j->eps, (int)(t1 - t0));
        return;
    }
    for (long t = t0; t < t1; t++)
        kern_rmsnorm(j->out + (size_t)t * j->n, j->x + (size_t)j->rows[t] * j->n, j->w, j->n, j->eps);
}

/* gate = act(gate) * up for the step's e->step_T tokens: SiLU (llama) or
 * GELU (Gemma). */
static void glu_run(void *ctx, int ith, int nth)
{
    engine_t *e = ctx;
    const int ff = (int)e->m->cfg.n_ff;
    const bool gelu = e->m->cfg.arch == MODEL_ARCH_GEMMA3;
    long t0, t1;
    tpool_split((long)e->step_T, ith, nth, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        if (gelu)
            kern_geglu(e->gate + (size_t)t * ff, e->up + (size_t)t * ff, ff);
        else
            kern_swiglu(e->gate + (size_t)t * ff, e->up + (size_t)t * ff, ff);
    }
}

/* Gemma's post-norms: x += rmsnorm(y) * w, row by row (y normed in place). */
struct post_norm_job {
    float *x, *y;
    const float *w;
    int n, T;
    float eps;
};

static void post_norm_run(void *ctx, int ith, int nth)
{
    struct post_norm_job *j = ctx;
    long t0, t1;
    tpool_split(j->T, ith, nth, &t0, &t1);
    kern_rmsnorm_rows(j->y + (size_t)t0 * j->n, j->y + (size_t)t0 * j->n, j->w, j->n, j->eps, (int)(t1 - t0));
    for (long t = t0; t < t1; t++) {
        const float *y = j->y + (size_t)t * j->n;
        float *x = j->x + (size_t)t * j->n;
        for (int i = 0; i < j->n; i++)
            x[i] += y[i];
    }
}

/* RoPE on q and k, then the chunk's K/V written into the cache: rotated
 * (kern_hadamard) where the cache stores them rotated, with the queries
 * rotated alike, and converted to the cache's types once, here. */
struct rope_job {
    engine_t *e;
    const struct fwd_seq *seqs;
    uint32_t layer;
    int T;
};

/* Stores one head's row src[hd] as `type` at dst (f32 copied, f16 and bf16 rounded,
 * q8_0 / q4_0 quantized per 32 values; q4_0 with its scale searched for the
 * least squared error, 12% less KL divergence than max/-8 on the default
 * model). */
static void kv_store_row(uint8_t *dst, const float *src, int hd, uint32_t type)
{
    switch (type) {
    case KERN_F16: kern_f32_to_f16_row((kvd_f16 *)dst, src, hd); break;
    case KERN_F32: memcpy(dst, src, (size_t)hd * sizeof(float)); break;
    case KERN_BF16: kern_quantize_row(KERN_BF16, src, dst, hd); break;
    case KERN_Q8_0: kern_quantize_act(KERN_Q8_0, src, dst, hd); break;
    default: kern_quantize_q4_0_lsq(src, dst, hd); break;     /* KERN_Q4_0 */
    }
}

int engine_kv_shift(engine_t *e, const uint32_t *const *tables, uint32_t first, uint32_t n, int32_t delta,
                    char *err, size_t errlen)
{
    const struct model_config *c = &e->m->cfg;
    const kvcache_t *kv = e->kv;
    const int hd = (int)c->head_dim;
    float row[KERN_MAX_HEAD_DIM], cs[KERN_MAX_HEAD_DIM], cs_swa[KERN_MAX_HEAD_DIM];
    kern_rope_angles(cs, hd, delta, c->rope_base);
    kern_rope_angles(cs_swa, hd, delta, c->rope_base_swa > 0 ? c->rope_base_swa : c->rope_base);
    for (uint32_t b = first; b < first + n; b++) {
        for (uint32_t l = 0; l < c->n_layer; l++) {
            const uint32_t id = tables[kv_part_of(&kv->parts, l)][b];
            if (id == POOL_NONE)
                continue;
            if (id >= kv->n_blocks)
                return kvd_seterr(err, errlen, KVD_ERANGE, "block %u is outside the cache", id);
            const float *angles = model_layer_windowed(c, l) ? cs_swa : cs;
            uint8_t *base = kv_block_ptr(kv, id, l, 0);
            for (uint32_t h = 0; h < c->n_head_kv; h++)
                for (uint32_t t = 0; t < kv->block_tokens; t++) {
                    uint8_t *r = base + (size_t)h * kv->k_head_bytes + (size_t)t * kv->k_row_bytes;
                    kern_dequantize_row(kv->k_type, r, row, hd);
                    if (kv->rotate & KV_ROT_K)
                        kern_hadamard(row, hd);
                    if (c->rope_neox)
                        kern_rope_neox(row, 1, hd, angles);
                    else
                        kern_rope(row, 1, hd, angles);
                    if (kv->rotate & KV_ROT_K)
                        kern_hadamard(row, hd);
                    kv_store_row(r, row, hd, kv->k_type);
                }
        }
    }
    return 0;
}

/* The block table that layer `layer` of sequence s reads. */
static inline const uint32_t *seq_table(const kvcache_t *kv, const struct fwd_seq *s, uint32_t layer)
{
    return s->tables != NULL ? s->tables[kv_part_of(&kv->parts, layer)] : s->blocks;
}

static void rope_run(void *ctx, int ith, int nth)
{
    struct rope_job *j = ctx;
    engine_t *e = j->e;
    const struct model_config *c = &e->m->cfg;
    const kvcache_t *kv = e->kv;
    const int hd = (int)c->head_dim, nkv = (int)c->n_head_kv;
    long t0, t1;
    tpool_split(j->T, ith, nth, &t0, &t1);
    const struct model_layer *L = &e->m->layers[j->layer];
    const bool windowed = model_layer_windowed(c, j->layer);
    const float *angles = windowed && e->rope_swa ? e->rope_swa : e->rope;
    if (L->q_norm != NULL && t1 > t0) {   /* Gemma: each head's query and key RMS-normed first */
        float *q = e->q + (size_t)t0 * c->n_head * hd, *k = e->k + (size_t)t0 * nkv * hd;
        kern_rmsnorm_rows(q, q, L->q_norm, hd, c->rms_eps, (int)((t1 - t0) * c->n_head));
        kern_rmsnorm_rows(k, k, L->k_norm, hd, c->rms_eps, (int)((t1 - t0) * nkv));
    }
    for (long t = t0; t < t1; t++) {
        const float *cs = angles + (size_t)t * hd;
        float *q = e->q + (size_t)t * c->n_head * hd;
        float *k = e->k + (size_t)t * nkv * hd, *v = e->v + (size_t)t * nkv * hd;
        if (c->rope_neox) {
            kern_rope_neox(q, (int)c->n_head, hd, cs);
            kern_rope_neox(k, nkv, hd, cs);
        } else {
            kern_rope(q, (int)c->n_head, hd, cs);
            kern_rope(k, nkv, hd, cs);
        }
        if (kv->rotate & KV_ROT_K) {
            for (uint32_t h = 0; h < c->n_head; h++)
                kern_hadamard(q + (size_t)h * hd, hd);
            for (int h = 0; h < nkv; h++)
                kern_hadamard(k + (size_t)h * hd, hd);
        }
        if (kv->rotate & KV_ROT_V)
            for (int h = 0; h < nkv; h++)
                kern_hadamard(v + (size_t)h * hd, hd);
        const struct fwd_seq *s = &j->seqs[e->tok_seq[t]];
        uint32_t pos = (uint32_t)e->tok_pos[t];
        uint32_t block = seq_table(kv, s, j->layer)[pos / kv->block_tokens];
        const uint32_t in_block = pos % kv->block_tokens;
        for (int which = 0; which < 2; which++) {
            uint8_t *base = kv_block_ptr(kv, block, j->layer, which);
            const float *src = which ? v : k;
            const size_t row = which ? kv->v_row_bytes : kv->k_row_bytes;
            const uint32_t type = which ? kv->v_type : kv->k_type;
            for (int h = 0; h < nkv; h++)
                kv_store_row(base + (size_t)h * kv_head_bytes(kv, which) + in_block * row,
                             src + (size_t)h * hd, hd, type);
        }
    }
}

/* Attention outputs over a rotated V cache rotated back, head by head. */
static void unrotate_run(void *ctx, int ith, int nth)
{
    engine_t *e = ctx;
    const int hd = (int)e->m->cfg.head_dim, nh = (int)e->m->cfg.n_head;
    long t0, t1;
    tpool_split((long)e->step_T, ith, nth, &t0, &t1);
    for (long t = t0; t < t1; t++)
        for (int h = 0; h < nh; h++)
            kern_hadamard(e->xb + ((size_t)t * nh + (size_t)h) * hd, hd);
}

/* Attention of every (token, query head) pair. */
struct attn_job {
    engine_t *e;
    const struct fwd_seq *seqs;
    uint32_t layer;
    int T;
};

/* The first attention item of thread k's share of the work (k = nth: the
 * end): the items whose cumulative cost (cost0) falls in the k-th of nth equal
 * parts; within a token, proportionally (its ranges are equal but for the
 * last). Monotonic in k, so the shares tile the items. */
static long attn_cut(const engine_t *e, int T, int k, int nth)
{
    if (k <= 0)
        return 0;
    if (k >= nth)
        return (long)e->item0[T];
    const uint64_t c = e->cost0[T] * (uint64_t)k / (uint64_t)nth;
    int lo = 0, hi = T;  /* the token t with cost0[t] <= c < cost0[t + 1] */
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (e->cost0[mid] <= c)
            lo = mid;
        else
            hi = mid;
    }
    const uint64_t span = e->cost0[lo + 1] - e->cost0[lo], items = e->item0[lo + 1] - e->item0[lo];
    return (long)(e->item0[lo] + (span ? (c - e->cost0[lo]) * items / span : 0));
}

/* Prefill tile u (attn_units): its (token, head) queries of one range in one
 * kern_attn_multi call, which gives each the bits attn_run's per-token path
 * would. */
static void attn_tile(engine_t *e, const struct attn_job *j, struct kern_attn_args *a, uint32_t u, int ith)
{
    const struct model_config *c = &e->m->cfg;
    const int hd = (int)c->head_dim, nh = (int)c->n_head, group = (int)(c->n_head / c->n_head_kv);
    const struct attn_unit *un = &e->units[u];
    const int from = (int)un->range * (int)e->chunk;
    struct kern_attn_query qs[KERN_ATTN_LANES];
    int nq = 0;
    for (uint32_t t = un->t0; t < un->t0 + un->n_tok; t++) {
        if (e->n_range[t] <= un->range)
            continue;
        const int n = e->tok_pos[t] + 1 - from;
        for (int h = (int)un->kv_head * group; h < ((int)un->kv_head + 1) * group; h++) {
            struct kern_attn_query *q = &qs[nq++];
            q->q = e->q + (size_t)t * nh * hd + (size_t)h * hd;
            q->n_ctx = n < (int)e->chunk ? n : (int)e->chunk;
            q->first = q->skip = 0;
            if (e->n_range[t] == 1) {
                q->out = e->xb + (size_t)t * nh * hd + (size_t)h * hd;
                q->stats = NULL;
            } else {
                const size_t slot = (size_t)e->slot0[t] + un->range;
                q->out = e->part + (slot * nh + (size_t)h) * hd;
                q->stats = e->part_stats + (slot * nh + (size_t)h) * 2;
            }
        }
    }
    a->blocks = seq_table(e->kv, &j->seqs[e->tok_seq[un->t0]], j->layer) + from / (int)e->kv->block_tokens;
    a->kv_head = (int)un->kv_head;
    a->skip = 0;
    if (kern_attn_multi(a, qs, nq, e->tile_scratch[ith]))
        return;
    for (int i = 0; i < nq; i++) {   /* the path changed under us: one query at a time */
        a->q = qs[i].q;
        a->out = qs[i].out;
        a->stats = qs[i].stats;
        a->n_ctx = qs[i].n_ctx;
        a->n_q = 1;
        kern_attn(a);
    }
}


/* The prefill tokens from t on that one windowed tile takes: of t's
 * sequence, at consecutive positions, whole tokens of the share (items up
 * to i1), KERN_ATTN_LANES / group at most, and within the tile scratch. */
static uint32_t win_run(const engine_t *e, const struct attn_job *j, uint32_t t, long i1)
{
    const struct model_config *c = &e->m->cfg;
    const uint32_t nh = c->n_head, per = KERN_ATTN_LANES / (c->n_head / c->n_head_kv);
    const uint32_t bt = e->kv->block_tokens;
    if (j->seqs[e->tok_seq[t]].n_tokens < 2)
        return 0;
    const int lo = e->tok_pos[t] + 1 > (int)c->swa_window ? e->tok_pos[t] + 1 - (int)c->swa_window : 0;
    const int base = lo / (int)bt * (int)bt;
    uint32_t u = t;
    while (u < (uint32_t)j->T && u - t < per && (long)(u + 1) * nh <= i1 && e->tok_seq[u] == e->tok_seq[t] &&
           e->tok_pos[u] == e->tok_pos[t] + (int)(u - t) && e->tok_pos[u] + 1 - base <= e->tile_ctx)
        u++;
    return u - t;
}

/* Tokens [t, t + nt) of a windowed layer in one kern_attn_multi call per KV
 * head: each (token, head) query over its own window, from its window's
 * first block with the positions before the window skipped, so with the
 * bits of the per-token call below. */
static void win_tile(engine_t *e, const struct attn_job *j, struct kern_attn_args *a, uint32_t t, uint32_t nt,
                     int ith)
{
    const struct model_config *c = &e->m->cfg;
    const int hd = (int)c->head_dim, nh = (int)c->n_head, group = (int)(c->n_head / c->n_head_kv);
    const int bt = (int)e->kv->block_tokens, W = (int)c->swa_window;
    const uint32_t *blocks = seq_table(e->kv, &j->seqs[e->tok_seq[t]], j->layer);
    const int lo0 = e->tok_pos[t] + 1 > W ? e->tok_pos[t] + 1 - W : 0, base = lo0 / bt * bt;
    struct kern_attn_query qs[KERN_ATTN_LANES];
    for (int kvh = 0; kvh < (int)c->n_head_kv; kvh++) {
        int nq = 0;
        for (uint32_t u = t; u < t + nt; u++) {
            const int n_ctx = e->tok_pos[u] + 1, lo = n_ctx > W ? n_ctx - W : 0;
            for (int h = kvh * group; h < (kvh + 1) * group; h++)
                qs[nq++] = (struct kern_attn_query){
                    .q = e->q + (size_t)u * nh * hd + (size_t)h * hd,
                    .out = e->xb + (size_t)u * nh * hd + (size_t)h * hd,
                    .n_ctx = n_ctx - base, .first = lo / bt * bt - base, .skip = lo - base,
                };
        }
        a->blocks = blocks + base / bt;
        a->kv_head = kvh;
        a->skip = 0;
        if (kern_attn_multi(a, qs, nq, e->tile_scratch[ith]))
            continue;
        for (int i = 0; i < nq; i++) {   /* the path changed under us: one query at a time */
            a->q = qs[i].q;
            a->out = qs[i].out;
            a->stats = NULL;
            a->n_q = 1;
            a->blocks = blocks + (base + qs[i].first) / bt;
            a->n_ctx = qs[i].n_ctx - qs[i].first;
            a->skip = qs[i].skip - qs[i].first;
            kern_attn(a);
        }
    }
}

/* The items [i0, i1) of a layer: each (token, range, query head) over its
 * positions, the heads of a token that share a KV head in one call, reading
 * each K/V row once for them (a head's result is the same bits however heads
 * are grouped). A context longer than one range is cut into ranges of
 * e->chunk positions (the same cuts whatever the thread count), whose partial
 * results merge_run combines in range order. */
static void attn_items(engine_t *e, const struct attn_job *j, struct kern_attn_args *a, long i0, long i1, int ith)
{
    const struct model_config *c = &e->m->cfg;
    const int hd = (int)c->head_dim, nh = (int)c->n_head;
    const int group = (int)(c->n_head / c->n_head_kv);
    const uint32_t bt = e->kv->block_tokens;
    const bool windowed = model_layer_windowed(c, j->layer);
    const uint64_t *item0 = windowed ? e->item0_win : e->item0;
    /* the token of item i0: the last t with item0[t] <= i0 < item0[t + 1] */
    long lo = 0, hi = j->T - 1;
    while (lo < hi) {
        const long mid = (lo + hi) / 2;
        if ((long)item0[mid + 1] <= i0)
            lo = mid + 1;
        else
            hi = mid;
    }
    long t = lo;
    for (long i = i0; i < i1;) {
        while ((long)item0[t + 1] <= i)
            t++;
        if (windowed && e->win_tiles && i == (long)item0[t]) {
            const uint32_t nt = win_run(e, j, (uint32_t)t, i1);
            if (nt >= 2) {
                win_tile(e, j, a, (uint32_t)t, nt, ith);
                i += (long)nt * nh;
                t += nt - 1;
                continue;
            }
        }
        const long local = i - (long)item0[t];
        const int r = (int)(windowed ? 0 : e->r_first[t]) + (int)(local / nh), h0 = (int)(local % nh);
        const int kvh = h0 / group;
        int n_q = (kvh + 1) * group - h0;
        if (i + n_q > i1)
            n_q = (int)(i1 - i);
        const uint32_t *blocks = seq_table(e->kv, &j->seqs[e->tok_seq[t]], j->layer);
        const int n_ctx = e->tok_pos[t] + 1;
        a->n_q = n_q;
        a->q = e->q + (size_t)t * nh * hd + (size_t)h0 * hd;
        a->kv_head = kvh;
        a->skip = 0;
        if (windowed) {
            /* positions [lo, n_ctx): the last swa_window ones */
            const int first_pos = n_ctx > (int)c->swa_window ? n_ctx - (int)c->swa_window : 0;
            const int first = first_pos / (int)bt * (int)bt;
            a->out = e->xb + (size_t)t * nh * hd + (size_t)h0 * hd;
            a->blocks = blocks + first / (int)bt;
            a->n_ctx = n_ctx - first;
            a->skip = first_pos - first;
            a->stats = NULL;
        } else if (e->n_range[t] == 1) {
            a->out = e->xb + (size_t)t * nh * hd + (size_t)h0 * hd;
            a->blocks = blocks;
            a->n_ctx = n_ctx;
            a->stats = NULL;
        } else {
            const size_t slot = (size_t)e->slot0[t] + (size_t)r;
            const int from = r * (int)e->chunk;
            a->out = e->part + (slot * nh + (size_t)h0) * hd;
            a->stats = e->part_stats + (slot * nh + (size_t)h0) * 2;
            a->blocks = blocks + from / (int)bt;
            a->n_ctx = n_ctx - from < (int)e->chunk ? n_ctx - from : (int)e->chunk;
        }
        kern_attn(a);
        i += n_q;
    }
}

/* Lays out each thread's share of layer j->layer's attention before it runs:
 * the prefill tiles whose work starts in its nth part of their cost, and the
 * items of its nth part of theirs (at a windowed layer, equal work per item). */
static void attn_shares(engine_t *e, const struct attn_job *j)
{
    const struct model_config *c = &e->m->cfg;
    const int nth = e->n_threads;
    const bool windowed = model_layer_windowed(c, j->layer);
    const uint64_t total = e->unit_cost0[e->n_units];
    uint32_t u = 0;
    for (int k = 0; k < nth; k++) {
        struct attn_share *s = &e->ashare[k];
        s->unit_next = u;
        if (!windowed) {
            const uint64_t c1 = total * (uint64_t)(k + 1) / (uint64_t)nth;
            while (u < e->n_units && (k == nth - 1 || e->unit_cost0[u] < c1))
                u++;
        }
        s->unit_end = u;
        if (windowed) {
            tpool_split((long)e->item0_win[j->T], k, nth, &s->item_next, &s->item_end);
        } else {
            /* by cost: a causal prefill's later tokens read more positions */
            s->item_next = attn_cut(e, j->T, k, nth);
            s->item_end = attn_cut(e, j->T, k + 1, nth);
        }
    }
}

/* Takes the next items of share s: up to the end of the KV-head group of the
 * first (at a windowed layer, up to a tile's tokens further); -1 when none
 * are left, else the first, with *end set. */
static long attn_take(struct attn_share *s, long align, long span, long *end)
{
    long i = __atomic_load_n(&s->item_next, __ATOMIC_RELAXED);
    for (;;) {
        if (i >= s->item_end)
            return -1;
        const long next = (i / align + span) * align;
        const long stop = next < s->item_end ? next : s->item_end;
        if (__atomic_compare_exchange_n(&s->item_next, &i, stop, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *end = stop;
            return i;
        }
    }
}

/* Attention of every (token, query head) pair: each thread runs its share,
 * a tile or an item group at a time, then takes what is left of the others'
 * (a thread that starts late, runs slow or finds its K/V cold holds up the
 * layer by one tile at most). Every output is computed whole by one call. */
static void attn_run(void *ctx, int ith, int nth)
{
    struct attn_job *j = ctx;
    engine_t *e = j->e;
    const struct model_config *c = &e->m->cfg;
    const kvcache_t *kv = e->kv;
    const int group = (int)(c->n_head / c->n_head_kv);
    struct kern_attn_args a = {
        .k_base = kv_block_ptr(kv, 0, j->layer, 0),
        .v_base = kv_block_ptr(kv, 0, j->layer, 1),
        .block_tokens = (int)kv->block_tokens,
        .head_dim = (int)c->head_dim,
        .block_stride = kv->block_bytes,
        .k_head_stride = kv->k_head_bytes,
        .v_head_stride = kv->v_head_bytes,
        .k_type = kv->k_type,
        .v_type = kv->v_type,
        .scale = c->attn_scale,
        .scores = e->scores + (size_t)ith * group * e->p.max_ctx,
    };
    /* items taken at a time: one KV head's queries of a (token, range), or
     * at a windowed layer a tile's tokens */
    const bool windowed = model_layer_windowed(c, j->layer);
    const long align = windowed ? (long)c->n_head : group;
    const long span = windowed && group <= KERN_ATTN_LANES ? KERN_ATTN_LANES / group : 1;   /* >= 1 */
    for (int k = 0; k < nth; k++) {
        struct attn_share *s = &e->ashare[(ith + k + (int)(e->p.share_shift % (uint32_t)nth)) % nth];
        for (;;) {
            const long u = __atomic_fetch_add(&s->unit_next, 1, __ATOMIC_RELAXED);
            if (u >= s->unit_end)
                break;
            attn_tile(e, j, &a, (uint32_t)u, ith);
        }
        long i, end;
        while ((i = attn_take(s, align, span, &end)) >= 0)
            attn_items(e, j, &a, i, end, ith);
    }
}


/* Combines the ranges of every split (token, head), in range order. */
static void merge_run(void *ctx, int ith, int nth)
{
    struct attn_job *j = ctx;
    engine_t *e = j->e;
    const int hd = (int)e->m->cfg.head_dim, nh = (int)e->m->cfg.n_head;
    if (model_layer_windowed(&e->m->cfg, j->layer))
        return;     /* a window is one range */
    long i0, i1;
    tpool_split((long)j->T * nh, ith, nth, &i0, &i1);
    for (long i = i0; i < i1; i++) {
        const long t = i / nh;
        const int h = (int)(i % nh);
        if (e->n_range[t] == 1)
            continue;
        const size_t slot = e->slot0[t];
        kern_attn_merge(e->xb + (size_t)t * nh * hd + (size_t)h * hd,
                        e->part + (slot * nh + (size_t)h) * hd, (size_t)nh * hd,
                        e->part_stats + (slot * nh + (size_t)h) * 2, (size_t)nh * 2,
                        (int)e->n_range[t], hd);
    }
}

/* ---- the step ---------------------------------------------------------------- */

/* Lays out the step's prefill tiles: for each sequence with more than one
 * token, its tokens in tiles of as many as fill KERN_ATTN_LANES lanes with
 * their group's heads, each tile once per attention range its last token
 * has and per KV head. Returns their count; unit_cost0 gets the work before
 * each, counted as cost0 counts the per-token items'. */
static uint32_t attn_units(engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs)
{
    const struct model_config *c = &e->m->cfg;
    const uint32_t group = c->n_head / c->n_head_kv, per = KERN_ATTN_LANES / group;
    uint32_t n = 0, t = 0;
    e->unit_cost0[0] = 0;
    for (uint32_t s = 0; s < n_seqs; t += seqs[s].n_tokens, s++) {
        if (seqs[s].n_tokens < 2)
            continue;
        for (uint32_t t0 = t; t0 < t + seqs[s].n_tokens; t0 += per) {
            const uint32_t nt = t + seqs[s].n_tokens - t0 < per ? t + seqs[s].n_tokens - t0 : per;
            for (uint32_t r = 0; r < e->n_range[t0 + nt - 1]; r++) {
                uint64_t cost = 0;   /* positions read by the tile's tokens in range r, per head */
                for (uint32_t i = t0; i < t0 + nt; i++)
                    if (e->n_range[i] > r) {
                        const uint64_t len = (uint64_t)e->tok_pos[i] + 1 - (uint64_t)r * e->chunk;
                        cost += (len < e->chunk ? len : e->chunk) + ATTN_ITEM_COST;
                    }
                for (uint32_t h = 0; h < c->n_head_kv; h++, n++) {
                    e->units[n] = (struct attn_unit){ t0, (uint16_t)nt, (uint16_t)r, h };
                    e->unit_cost0[n + 1] = e->unit_cost0[n] + cost * group;
                }
            }
        }
    }
    /* decode tokens that share whole ranges: a tile per shared range */
    for (uint32_t d = 0; d < e->n_dgroups; d++) {
        const struct attn_unit *dg = &e->dgroups[d];
        const uint64_t cost = (uint64_t)dg->n_tok * (e->chunk + ATTN_ITEM_COST);
        for (uint32_t r = 0; r < dg->range; r++)
            for (uint32_t h = 0; h < c->n_head_kv; h++, n++) {
                e->units[n] = (struct attn_unit){ dg->t0, dg->n_tok, (uint16_t)r, h };
                e->unit_cost0[n + 1] = e->unit_cost0[n] + cost * group;
            }
    }
    return n;
}

/* How many leading whole ranges decode tokens t and u read from the same
 * blocks (a cache of one part). */
static uint32_t shared_ranges(const engine_t *e, const struct fwd_seq *seqs, uint32_t t, uint32_t u)
{
    const uint32_t per = e->chunk / e->kv->block_tokens;
    const struct fwd_seq *a = &seqs[e->tok_seq[t]], *b = &seqs[e->tok_seq[u]];
    const uint32_t full_a = ((uint32_t)e->tok_pos[t] + 1) / e->chunk, full_b = ((uint32_t)e->tok_pos[u] + 1) / e->chunk;
    uint32_t r = 0;
    while (r < full_a && r < full_b &&
           memcmp(a->blocks + (size_t)r * per, b->blocks + (size_t)r * per, per * sizeof(uint32_t)) == 0)
        r++;
    return r;
}

/* Groups decode tokens side by side (the worker orders them by their block
 * tables) that share whole ranges of positions, from the fewest for which
 * one call pays (kern_attn_multi_min: 2 on the AMX tiles, 4 on AVX-512) to
 * `per` a group: their queries over a shared range go in one
 * kern_attn_multi call, which reads its K and V once for all of them and
 * gives each query the bits kern_attn would. Sets r_first and dgroups. */
static void decode_groups(engine_t *e, const struct fwd_seq *seqs, uint32_t T, bool tiles)
{
    const struct model_config *c = &e->m->cfg;
    const uint32_t per = KERN_ATTN_LANES / (c->n_head / c->n_head_kv);
    const uint32_t min_tok = tiles ? (uint32_t)kern_attn_multi_min(e->kv->k_type, e->kv->v_type, (int)c->head_dim) : 0;
    e->n_dgroups = 0;
    for (uint32_t t = 0; t < T; t++)
        e->r_first[t] = 0;
    if (min_tok < 2 || per < min_tok)
        return;
    for (uint32_t t = 0; t < T;) {
        const struct fwd_seq *st = &seqs[e->tok_seq[t]];
        if (st->n_tokens != 1 || st->tables != NULL) {
            t++;
            continue;
        }
        uint32_t u = t + 1, k = UINT32_MAX;
        while (u < T && u - t < per) {
            const struct fwd_seq *su = &seqs[e->tok_seq[u]];
            if (su->n_tokens != 1 || su->tables != NULL)
                break;
            const uint32_t ku = shared_ranges(e, seqs, t, u);
            if (ku == 0)
                break;
            k = ku < k ? ku : k;
            u++;
        }
        if (u - t < min_tok) {
            t++;
            continue;
        }
        e->dgroups[e->n_dgroups++] = (struct attn_unit){ t, (uint16_t)(u - t), (uint16_t)k, 0 };
        for (uint32_t i = t; i < u; i++)
            e->r_first[i] = k;
        t = u;
    }
}

int fwd_check_batch(const struct fwd_limits *lim, const struct fwd_seq *seqs, uint32_t n_seqs,
                    uint32_t *T_out, uint32_t *rows_out, uint64_t *tables_out, char *err, size_t errlen)
{
    const uint32_t bt = lim->block_tokens;
    uint64_t T = 0, rows = 0, tables = 0;
    if (n_seqs == 0 || seqs == NULL)
        return kvd_seterr(err, errlen, KVD_EINVAL, "engine: empty batch");
    for (uint32_t s = 0; s < n_seqs; s++) {
        const struct fwd_seq *q = &seqs[s];
        if (q->n_tokens == 0 || q->tokens == NULL)
            return kvd_seterr(err, errlen, KVD_EINVAL, "engine: sequence %u has no tokens", s);
        uint64_t end = (uint64_t)q->pos + q->n_tokens;
        if (end > lim->max_ctx)
            return kvd_seterr(err, errlen, KVD_ETOOLONG,
                              "engine: sequence %u reaches position %llu, past the context of %u",
                              s, (unsigned long long)end, lim->max_ctx);
        uint64_t need = (end + bt - 1) / bt;
        if (q->blocks == NULL || q->n_blocks < need)
            return kvd_seterr(err, errlen, KVD_ERANGE,
                              "engine: sequence %u needs %llu blocks, its table has %u",
                              s, (unsigned long long)need, q->n_blocks);
        const uint32_t n_parts = lim->parts != NULL ? lim->parts->n_parts : 1;
        if (n_parts > 1 && q->tables == NULL)
            return kvd_seterr(err, errlen, KVD_EINVAL,
                              "engine: sequence %u has one block table; the cache has %u parts", s,
                              n_parts);
        for (uint32_t part = 0; part < n_parts; part++) {
            /* the blocks this step reads (a window from its first token's) and writes */
            const uint32_t *tab = n_parts > 1 ? q->tables[part] : q->blocks;
            const uint64_t first = n_parts > 1
                                       ? kv_window_first_block(lim->parts->window[part], q->pos, bt)
                                       : 0;
            if (tab == NULL)
                return kvd_seterr(err, errlen, KVD_EINVAL, "engine: sequence %u lacks part %u's table",
                                  s, part);
            for (uint64_t b = first; b < need; b++)
                if (tab[b] >= lim->n_blocks)
                    return kvd_seterr(err, errlen, KVD_ERANGE,
                                      "engine: sequence %u names block %u of %u", s, tab[b],
                                      lim->n_blocks);
        }
        for (uint32_t i = 0; i < q->n_tokens; i++)
            if (q->tokens[i] < 0 || (uint32_t)q->tokens[i] >= lim->n_vocab)
                return kvd_seterr(err, errlen, KVD_ERANGE,
                                  "engine: token id %d is outside the vocabulary (0..%u)",
                                  q->tokens[i], lim->n_vocab - 1);
        T += q->n_tokens;
        rows += q->all_logits ? q->n_tokens : 1;
        tables += need;
    }
    if (T > lim->max_tokens)
        return kvd_seterr(err, errlen, KVD_ERANGE, "engine: step of %llu tokens exceeds %u",
                          (unsigned long long)T, lim->max_tokens);
    *T_out = (uint32_t)T;
    *rows_out = (uint32_t)rows;
    if (tables_out != NULL)
        *tables_out = tables;
    return 0;
}

int engine_step(engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                const float **logits, uint32_t *n_rows, char *err, size_t errlen)
{
    const model_t *m = e->m;
    const struct model_config *c = &m->cfg;
    uint32_t T = 0, rows = 0;
    const struct fwd_limits lim = { e->p.max_ctx, e->p.max_tokens, e->kv->block_tokens, e->kv->n_blocks,
                                    c->n_vocab, &e->kv->parts };
    int rc = fwd_check_batch(&lim, seqs, n_seqs, &T, &rows, NULL, err, errlen);
    if (rc)
        return rc;
    if (rows > e->logits_cap) {
        float *nl = xmalloc_arr((size_t)rows * c->n_vocab, sizeof(float));
        if (nl == NULL)
            return kvd_seterr(err, errlen, KVD_ENOMEM, "engine: out of memory for logits");
        free(e->logits);
        e->logits = nl;
        e->logits_cap = rows;
    }

    /* lay the tokens out and embed them */
    const int ne = (int)c->n_embd, hd = (int)c->head_dim;
    const int qd = (int)(c->n_head * c->head_dim);
    uint32_t t = 0, r = 0;
    for (uint32_t s = 0; s < n_seqs; s++) {
        for (uint32_t i = 0; i < seqs[s].n_tokens; i++, t++) {
            e->tok_id[t] = seqs[s].tokens[i];
            e->tok_pos[t] = (int32_t)(seqs[s].pos + i);
            e->tok_seq[t] = s;
            if (seqs[s].all_logits || i + 1 == seqs[s].n_tokens)
                e->out_tok[r++] = (int32_t)t;
            float *xt = e->x + (size_t)t * ne;
            kern_dequantize_row(m->tok_embd.type,
                                (const uint8_t *)m->tok_embd.data +
                                    (size_t)e->tok_id[t] * m->tok_embd.row_bytes,
                                xt, ne);
            if (c->emb_scale != 1.0f)
                for (int d = 0; d < ne; d++)
                    xt[d] *= c->emb_scale;
            kern_rope_angles(e->rope + (size_t)t * hd, hd, e->tok_pos[t], c->rope_base);
            if (e->rope_swa != NULL)
                kern_rope_angles(e->rope_swa + (size_t)t * hd, hd, e->tok_pos[t], c->rope_base_swa);
        }
    }

    e->step_T = T;

    /* attention items: each token's context in ranges of e->chunk positions;
     * at full-attention layers a prefill's tokens go in tiles instead where
     * the kernels have them (attn_units) */
    const bool tiles = kern_attn_multi_ok(e->kv->k_type, e->kv->v_type, (int)c->head_dim) &&
                       c->n_head / c->n_head_kv <= KERN_ATTN_LANES;
    bool split = false;
    uint32_t slots = 0;
    e->item0[0] = 0;
    e->cost0[0] = 0;
    for (uint32_t i = 0; i < T; i++) {
        e->n_range[i] = ((uint32_t)e->tok_pos[i] + e->chunk) / e->chunk;  /* ceil((pos + 1) / chunk) */
        e->slot0[i] = slots;
        if (e->n_range[i] > 1) {
            split = true;
            slots += e->n_range[i];
        }
    }
    decode_groups(e, seqs, T, tiles);
    for (uint32_t i = 0; i < T; i++) {
        /* a decode token's ranges from r_first on; a prefill's tokens in tiles */
        const bool tiled = tiles && seqs[e->tok_seq[i]].n_tokens > 1;
        const uint32_t rf = e->r_first[i];
        e->item0[i + 1] = e->item0[i] + (tiled ? 0 : (uint64_t)(e->n_range[i] - rf) * c->n_head);
        e->cost0[i + 1] = e->cost0[i] +
                          (tiled ? 0 : ((uint64_t)e->tok_pos[i] + 1 - (uint64_t)rf * e->chunk +
                                        ATTN_ITEM_COST * (e->n_range[i] - rf)) * c->n_head);
    }
    e->n_units = tiles ? attn_units(e, seqs, n_seqs) : 0;
    /* a window's first block may start mid-vector unless blocks are whole vectors */
    e->win_tiles = tiles && c->swa_window > 0 && e->kv->block_tokens % 16 == 0;
    if (e->item0_win != NULL)
        for (uint32_t i = 0; i <= T; i++)
            e->item0_win[i] = (uint64_t)i * c->n_head;

    for (uint32_t l = 0; l < c->n_layer; l++) {
        const struct model_layer *L = &m->layers[l];
        /* attention */
        struct norm_job nj = { e->xb, e->x, L->attn_norm, ne, (int)T, c->rms_eps, NULL };
        run_rows(e, norm_run, &nj, T);
        struct mm_part qkv[3] = {
            { &L->wq, acts_for(e, L->wq.type, e->xb, ne, (int)T, true), e->q, false },
            { &L->wk, acts_for(e, L->wk.type, e->xb, ne, (int)T, false), e->k, false },
            { &L->wv, acts_for(e, L->wv.type, e->xb, ne, (int)T, false), e->v, false },
        };
        matmul(e, qkv, 3, (int)T);
        struct rope_job rj = { e, seqs, l, (int)T };
        run_rows(e, rope_run, &rj, T);
        struct attn_job aj = { e, seqs, l, (int)T };
        attn_shares(e, &aj);
        run_job(e, attn_run, &aj);
        if (split)
            run_job(e, merge_run, &aj);
        if (e->kv->rotate & KV_ROT_V)
            run_rows(e, unrotate_run, e, T);
        /* the output projection: added to the stream, or (Gemma) normed first */
        const bool post = L->post_attn_norm != NULL;
        struct mm_part o = { &L->wo, acts_for(e, L->wo.type, e->xb, qd, (int)T, true), post ? e->up : e->x, !post };
        matmul(e, &o, 1, (int)T);
        if (post) {
            struct post_norm_job pj = { e->x, e->up, L->post_attn_norm, ne, (int)T, c->rms_eps };
            run_rows(e, post_norm_run, &pj, T);
        }
        /* feed-forward */
        nj = (struct norm_job){ e->xb, e->x, L->ffn_norm, ne, (int)T, c->rms_eps, NULL };
        run_rows(e, norm_run, &nj, T);
        struct mm_part gu[2] = {
            { &L->w_gate, acts_for(e, L->w_gate.type, e->xb, ne, (int)T, true), e->gate, false },
            { &L->w_up, acts_for(e, L->w_up.type, e->xb, ne, (int)T, false), e->up, false },
        };
        matmul(e, gu, 2, (int)T);
        run_rows(e, glu_run, e, T);
        struct mm_part d = { &L->w_down, acts_for(e, L->w_down.type, e->gate, (int)c->n_ff, (int)T, true),
                             post ? e->up : e->x, !post };
        matmul(e, &d, 1, (int)T);
        if (post) {
            struct post_norm_job pj = { e->x, e->up, L->post_ffn_norm, ne, (int)T, c->rms_eps };
            run_rows(e, post_norm_run, &pj, T);
        }
    }

    /* final norm of the rows that need logits, then the output matrix */
    struct norm_job nj = { e->xb, e->x, m->output_norm, ne, (int)rows, c->rms_eps, e->out_tok };
    run_rows(e, norm_run, &nj, rows);
    struct mm_part out = { &m->output, acts_for(e, m->output.type, e->xb, ne, (int)rows, true),
                           e->logits, false };
    matmul(e, &out, 1, (int)rows);
    *logits = e->logits;
    *n_rows = rows;
    return 0;
}
