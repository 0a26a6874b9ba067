/*
 * gpu_engine.c - the forward step on one CUDA device: the kernels of
 * kernels/cuda/kcuda.h in the order engine/forward.c runs their C twins.
 *
 * A step is laid out on the host (token ids, positions, the physical block of
 * each position, the rows that give logits, the sequences and their block
 * tables), uploaded in two copies, then computed with no further host work:
 * embeddings, per layer RMSNorm, Q/K/V products, RoPE with the K/V write,
 * attention (decode kernel for one-token sequences, prefill kernel for
 * chunks), output product, RMSNorm, gate/up, SwiGLU, down product (RMSNorm
 * and SwiGLU quantize the next products' input in the same kernel; Q/K/V and
 * gate/up are one launch each); final norm
 * of the rows that give logits and the output head. All of it on the engine's
 * own stream; the host waits once, for the results.
 *
 * Gemma 3 adds, as engine/forward.c does: embeddings times sqrt(n_embd), the
 * per-head RMSNorm of queries and keys before RoPE (NEOX pairs; the windowed
 * layers' own base), each layer's window in the attention, the outputs of
 * attention and feed-forward RMS-normed before they join the stream, and GEGLU
 * through the CPU's table of halves. A layer reads the cache through its
 * part's block table (common/kvparts.h).
 */
#include "gpu_engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kcuda.h"
#include "kcuda_engine.h"
#include "kvcache.h"
#include "ops.h"
#include "quant.h"
#include "types.h"

_Static_assert(KV_ROT_K == KCUDA_ROT_K && KV_ROT_V == KCUDA_ROT_V, "one meaning of the rotation flags");

#define ACT_SLOTS 3     /* distinct activation formats one input may be quantized to */
#define GRAPH_SLOTS 32  /* recorded decode graphs kept (least recently used goes) */

/* A weight matrix on the device. */
struct gmat {
    uint32_t type;          /* enum kern_type */
    int64_t rows;           /* output features */
    int64_t cols;           /* input features */
    size_t row_bytes;       /* bytes per row */
    const void *w;          /* device: rows * row_bytes */
};

struct glayer {
    const float *attn_norm; /* device (n_embd) */
    const float *ffn_norm;  /* device (n_embd) */
    const float *q_norm, *k_norm;   /* Gemma: device (head_dim), per-head norms; else NULL */
    const float *post_attn_norm;    /* Gemma: device (n_embd), norms of the sublayers' */
    const float *post_ffn_norm;     /* outputs before they join the stream; else NULL */
    struct gmat wq, wk, wv, wo, w_gate, w_up, w_down;
    float rope_step;        /* powf(its RoPE base, -2 / head_dim), as kern_rope_angles */
    int window;             /* attends to the last `window` positions; 0: to all */
    uint32_t part, slot;    /* its part of the cache and place in the part's blocks */
};

/* Activation rows quantized for one weight type (device, max_tokens rows). */
struct act_slot {
    uint32_t type;          /* activation type; UINT32_MAX when unused this input */
    size_t stride;          /* bytes per row */
    uint8_t *buf;           /* device */
};

/* Activation rows as a product reads them. */
struct act_ref {
    const void *buf;        /* device */
    size_t stride;          /* bytes per row */
};

/* Offsets of the per-step arrays inside the meta buffers (host and device). */
struct meta_layout {
    size_t tok_id;          /* int32 (max_tokens) */
    size_t tok_pos;         /* int32 (max_tokens) */
    size_t tok_block;       /* uint32 (n_parts x max_tokens): each part's block of each token's position */
    size_t out_row;         /* int32 (max_tokens): token rows that give logits */
    size_t dec;             /* struct kcuda_seq (max_tokens): one-token sequences */
    size_t pf;              /* struct kcuda_seq (max_tokens): chunks of several tokens */
    size_t bytes;           /* the whole buffer */
};

/* What a step enqueues depends on these alone (a graph's key is the decode part). */
struct step_shape {
    uint32_t T;             /* tokens */
    uint32_t rows;          /* rows of logits */
    uint32_t n_dec;         /* sequences decoding one token */
    uint32_t n_pf;          /* sequences adding a chunk of several tokens */
    uint32_t dec_ctx;       /* decode grid context: a power of two >= every decode context */
    uint32_t pf_tok;        /* longest chunk */
};

struct graph_slot {
    kcuda_graph_t *g;       /* NULL: free */
    uint32_t n_dec;         /* key: sequences (= tokens = rows), padded to a bucket */
    uint32_t dec_ctx;       /* key: context bucket */
    uint64_t used;          /* step counter at last use */
};

struct gpu_engine {
    struct model_config cfg;
    struct gpu_engine_params p;     /* resolved: no zeros left */
    int device;
    kcuda_stream_t stream;

    /* weights */
    uint8_t *weights;               /* device: every matrix and norm; NULL when borrowed */
    uint64_t weight_bytes;          /* bytes used in it */
    struct gmat tok_embd;           /* (n_vocab, n_embd) */
    struct gmat output;             /* (n_vocab, n_embd); shares tok_embd's memory when tied */
    const float *output_norm;       /* device (n_embd) */
    const float *gelu;              /* device: kern_gelu_table() (Gemma); NULL for SwiGLU models */
    struct glayer *layers;          /* host array of n_layer */
    struct kv_parts parts;          /* which layers a block holds (one table per part) */

    /* the cache */
    uint8_t *kv;                    /* device: kv_blocks * block_bytes */
    bool kv_owned;
    uint64_t block_bytes, k_head_bytes, v_head_bytes;

    /* activations, device, max_tokens rows */
    float *x;                       /* (T, n_embd) residual stream */
    float *xb;                      /* (T, max(n_embd, q_dim)) normed input / attention output */
    float *q, *k, *v;               /* (T, q_dim), (T, kv_dim), (T, kv_dim) */
    float *gate, *up;               /* (T, n_ff) */
    float *logits;                  /* (T, n_vocab) */
    int32_t *ids;                   /* (T) greedy tokens */
    float *attn_scratch;            /* decode partials, or NULL when one split covers max_ctx */
    struct act_slot act[ACT_SLOTS];

    /* per-step layout */
    struct meta_layout ml;
    uint8_t *meta_dev, *meta_host;  /* ml.bytes each (host page-locked) */
    uint32_t *tables_dev, *tables_host; /* block tables: part p's at p * tables_cap, n_parts parts */
    size_t tables_cap;              /* entries per part */

    /* results on the host (page-locked) */
    float *logits_host;             /* (logits_cap, n_vocab) */
    uint32_t logits_cap;
    int32_t *ids_host;              /* (max_tokens) */

    float attn_scale;               /* 1 / sqrt(head_dim) */
    int split;                      /* attention split */

    /* token choice on the device */
    struct kcuda_draw *draws_host, *draws_dev; /* (max_tokens) each; host page-locked */
    int32_t *pen_host, *pen_dev;    /* penalized and biased ids of a step's draws, pen_cap each */
    float *add_host, *add_dev;      /* the biased ids' addends, at their places in pen_*; pen_cap each */
    size_t pen_cap;                 /* ids the two buffers hold */
    uint8_t *pen_seen;              /* host bitmap (n_vocab bits): a row's ids so far */
    sampler_t *host_smp;            /* scratch for the draws the device does not take */
    uint32_t *host_rows;            /* (max_tokens) rows whose draw runs on the host */

    /* graphs */
    bool graphs;                    /* record decode steps */
    struct graph_slot slots[GRAPH_SLOTS];
    uint64_t step_no;
    struct gpu_engine_graph_stats stats;
};

struct gpu_engine_params gpu_engine_default_params(void)
{
    struct gpu_engine_params p = {
        .max_tokens = 512, .max_ctx = 0, .block_tokens = 16, .kv_blocks = 1024,
        .k_type = KERN_F16, .v_type = KERN_F16, .rotate = 0,
        .kv_base = NULL, .kv_bytes = 0, .attn_split = 0, .graphs = -1, .weights_base = NULL,
        .weights_bytes = 0, .parts = NULL,
    };
    return p;
}

const struct model_config *gpu_engine_config(const gpu_engine_t *e) { return &e->cfg; }
uint64_t gpu_engine_weight_bytes(const gpu_engine_t *e) { return e->weight_bytes; }
bool gpu_engine_weights_borrowed(const gpu_engine_t *e) { return e->weights == NULL; }

void gpu_engine_kv_info(const gpu_engine_t *e, struct gpu_engine_kv *out)
{
    out->base = e->kv;
    out->n_blocks = e->p.kv_blocks;
    out->block_tokens = e->p.block_tokens;
    out->block_bytes = e->block_bytes;
    out->k_head_bytes = e->k_head_bytes;
    out->v_head_bytes = e->v_head_bytes;
    out->owned = e->kv_owned;
}

void gpu_engine_graph_stats(const gpu_engine_t *e, struct gpu_engine_graph_stats *out)
{
    *out = e->stats;
    out->enabled = e->graphs;
}

void gpu_engine_set_graphs(gpu_engine_t *e, bool on)
{
    if (on && !kcuda_graphs_supported()) {
        snprintf(e->stats.why_disabled, sizeof(e->stats.why_disabled),
                 "this build cannot record CUDA graphs");
        on = false;
    }
    e->graphs = on;
    if (on)
        e->stats.why_disabled[0] = '\0';
}

static void graphs_drop(gpu_engine_t *e)
{
    for (int i = 0; i < GRAPH_SLOTS; i++)
        kcuda_graph_destroy(&e->slots[i].g);
}

void gpu_engine_destroy(gpu_engine_t **ep)
{
    if (ep == NULL || *ep == NULL)
        return;
    gpu_engine_t *e = *ep;
    kcuda_set_device(e->device);
    kcuda_stream_destroy(&e->stream);   /* waits for anything in flight */
    graphs_drop(e);
    kcuda_free(e->weights);
    free(e->layers);
    if (e->kv_owned)
        kcuda_free(e->kv);
    kcuda_free(e->x);
    kcuda_free(e->xb);
    kcuda_free(e->q);
    kcuda_free(e->k);
    kcuda_free(e->v);
    kcuda_free(e->gate);
    kcuda_free(e->up);
    kcuda_free(e->logits);
    kcuda_free(e->ids);
    kcuda_free(e->attn_scratch);
    for (int i = 0; i < ACT_SLOTS; i++)
        kcuda_free(e->act[i].buf);
    kcuda_free(e->meta_dev);
    kcuda_host_free(e->meta_host);
    kcuda_free(e->tables_dev);
    kcuda_host_free(e->tables_host);
    kcuda_host_free(e->logits_host);
    kcuda_host_free(e->ids_host);
    kcuda_free(e->draws_dev);
    kcuda_host_free(e->draws_host);
    kcuda_free(e->pen_dev);
    kcuda_host_free(e->pen_host);
    kcuda_free(e->add_dev);
    kcuda_host_free(e->add_host);
    free(e->pen_seen);
    free(e->host_rows);
    sampler_destroy(&e->host_smp);
    free(e);
    *ep = NULL;
}

/* ---- set-up -------------------------------------------------------------------- */

static bool gemm_type_ok(const struct model_mat *w)
{
    switch (w->type) {
    case KERN_Q4_1:
    case KERN_Q8_0:
    case KERN_Q5_0:
        return w->cols % 32 == 0;
    case KERN_Q4_K:
    case KERN_Q6_K:
        return w->cols % 256 == 0;
    case KERN_F16:
        return w->cols % 8 == 0;
    default:
        return false;
    }
}

/* Checks that the kernels can run this model; 0 or KVD_EUNSUPPORTED with err. */
static int check_model(const model_t *m, char *err, size_t errlen)
{
    if (m->cfg.arch != MODEL_ARCH_LLAMA && m->cfg.arch != MODEL_ARCH_GEMMA3)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "gpu engine: only llama and gemma3 models run on the GPU so far (this one runs on "
                          "the CPU)");
    const struct model_config *c = &m->cfg;
    if (c->head_dim != 64 && c->head_dim != 128 && c->head_dim != 256)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "gpu engine: head dimension %u is not supported (64, 128 or 256)", c->head_dim);
    /* the prefill kernel keeps up to 4 query heads per KV head at 256 */
    const uint32_t max_group = c->head_dim == 256 ? 4 : KCUDA_MAX_GROUP;
    if (c->n_head_kv == 0 || c->n_head % c->n_head_kv != 0 || c->n_head / c->n_head_kv > max_group)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "gpu engine: %u query heads over %u KV heads is not supported (at most %u per KV head "
                          "at head dimension %u)", c->n_head, c->n_head_kv, max_group, c->head_dim);
    switch (m->tok_embd.type) {
    case KERN_F32: case KERN_F16: case KERN_Q4_0: case KERN_Q4_1: case KERN_Q8_0:
        break;
    default:
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "gpu engine: token_embd.weight of type %s is not supported (F32, F16, Q4_0, Q4_1, Q8_0)",
                          kern_type_info(m->tok_embd.type)->name);
    }
    if (!gemm_type_ok(&m->output))
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "gpu engine: the output matrix of type %s is not supported (Q4_1, Q8_0, Q5_0, Q4_K, "
                          "Q6_K, F16)", kern_type_info(m->output.type)->name);
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const struct model_layer *L = &m->layers[l];
        const struct model_mat *mats[7] = { &L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down };
        for (int i = 0; i < 7; i++)
            if (!gemm_type_ok(mats[i]))
                return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                                  "gpu engine: layer %u has a matrix of type %s (%lld wide); the GPU "
                                  "products take Q4_1, Q8_0, Q5_0, F16 (widths of 32) and Q4_K, Q6_K (of 256)",
                                  l, kern_type_info(mats[i]->type)->name,
                                  (long long)mats[i]->cols);
    }
    return 0;
}

/* Places host arrays in the device weight buffer: a first pass (base NULL)
 * only sums the sizes; the second uploads. */
struct placer {
    uint8_t *base;          /* device buffer, NULL while sizing */
    bool upload;            /* copy the data (else only point into base: borrowed weights) */
    size_t off;             /* bytes placed so far */
    int rc;                 /* first upload failure */
};

static const void *place(struct placer *pl, const void *host, size_t bytes)
{
    const size_t at = (pl->off + 255) / 256 * 256;
    pl->off = at + bytes;
    if (pl->base == NULL || pl->rc)
        return NULL;
    if (pl->upload && kcuda_upload(pl->base + at, host, bytes))
        pl->rc = KVD_EINTERNAL;
    return pl->base + at;
}

static void place_mat(struct placer *pl, const struct model_mat *src, struct gmat *dst)
{
    dst->type = src->type;
    dst->rows = src->rows;
    dst->cols = src->cols;
    dst->row_bytes = src->row_bytes;
    dst->w = place(pl, src->data, (size_t)src->rows * src->row_bytes);
}

static void place_model(struct placer *pl, gpu_engine_t *e, const model_t *m)
{
    const size_t norm = (size_t)m->cfg.n_embd * sizeof(float);
    place_mat(pl, &m->tok_embd, &e->tok_embd);
    if (m->output.data == m->tok_embd.data)
        e->output = e->tok_embd;
    else
        place_mat(pl, &m->output, &e->output);
    e->output_norm = place(pl, m->output_norm, norm);
    /* GEGLU's table goes with the weights, so that borrowers find it there */
    e->gelu = m->cfg.arch == MODEL_ARCH_GEMMA3 ? place(pl, kern_gelu_table(), 65536 * sizeof(float)) : NULL;
    const size_t head_norm = (size_t)m->cfg.head_dim * sizeof(float);
    for (uint32_t l = 0; l < m->cfg.n_layer; l++) {
        const struct model_layer *L = &m->layers[l];
        struct glayer *G = &e->layers[l];
        G->attn_norm = place(pl, L->attn_norm, norm);
        G->ffn_norm = place(pl, L->ffn_norm, norm);
        G->q_norm = L->q_norm != NULL ? place(pl, L->q_norm, head_norm) : NULL;
        G->k_norm = L->k_norm != NULL ? place(pl, L->k_norm, head_norm) : NULL;
        G->post_attn_norm = L->post_attn_norm != NULL ? place(pl, L->post_attn_norm, norm) : NULL;
        G->post_ffn_norm = L->post_ffn_norm != NULL ? place(pl, L->post_ffn_norm, norm) : NULL;
        place_mat(pl, &L->wq, &G->wq);
        place_mat(pl, &L->wk, &G->wk);
        place_mat(pl, &L->wv, &G->wv);
        place_mat(pl, &L->wo, &G->wo);
        place_mat(pl, &L->w_gate, &G->w_gate);
        place_mat(pl, &L->w_up, &G->w_up);
        place_mat(pl, &L->w_down, &G->w_down);
    }
}

/* Lays m out (and uploads it when base is set and upload) with a scratch
 * engine; returns the bytes the layout takes. */
static uint64_t place_alone(const model_t *m, void *base, bool upload, int *rc)
{
    gpu_engine_t *e = calloc(1, sizeof(*e));
    struct glayer *layers = calloc(m->cfg.n_layer ? m->cfg.n_layer : 1, sizeof(*layers));
    if (e == NULL || layers == NULL) {
        free(e);
        free(layers);
        *rc = KVD_ENOMEM;
        return 0;
    }
    e->layers = layers;
    struct placer pl = { .base = base, .upload = upload };
    place_model(&pl, e, m);
    *rc = pl.rc;
    free(layers);
    free(e);
    return pl.off;
}

uint64_t gpu_weights_bytes(const model_t *m)
{
    int rc;
    return place_alone(m, NULL, false, &rc);
}

int gpu_weights_upload(const model_t *m, int device, void *base, uint64_t bytes, char *err, size_t errlen)
{
    int rc = check_model(m, err, errlen);
    if (rc)
        return rc;
    const uint64_t need = gpu_weights_bytes(m);
    if (base == NULL || bytes < need)
        return kvd_seterr(err, errlen, KVD_ERANGE, "gpu weights: %llu bytes cannot hold the model's %llu",
                          (unsigned long long)bytes, (unsigned long long)need);
    if (kcuda_set_device(device))
        return kvd_seterr(err, errlen, KVD_EUNAVAILABLE, "gpu weights: device %d: %s", device, kcuda_last_error());
    place_alone(m, base, true, &rc);
    /* a copy from pageable memory may return before its last bytes land */
    if (rc == 0 && kcuda_sync())
        rc = KVD_EINTERNAL;
    if (rc)
        return kvd_seterr(err, errlen, rc, "gpu weights: upload failed: %s",
                          rc == KVD_ENOMEM ? "out of memory" : kcuda_last_error());
    return 0;
}

static void *dev_alloc(size_t bytes, bool *ok)
{
    void *p = kcuda_malloc(bytes);
    if (p == NULL)
        *ok = false;
    return p;
}

/* Resolves defaults and checks the parameters against the model; 0 or KVD_EINVAL. */
static int resolve_params(struct gpu_engine_params *p, const struct model_config *c, char *err, size_t errlen)
{
    if (p->max_tokens == 0)
        p->max_tokens = 512;
    if (p->max_ctx == 0)
        p->max_ctx = c->n_ctx_train;
    if (p->block_tokens == 0)
        p->block_tokens = 16;
    if (p->kv_blocks == 0 && p->kv_base == NULL)
        p->kv_blocks = 1024;
    if (p->attn_split == 0)
        p->attn_split = KCUDA_ATTN_SPLIT;
    if (p->max_tokens > 65536 || p->max_ctx > (1u << 22))
        return kvd_seterr(err, errlen, KVD_EINVAL, "gpu engine: step of %u tokens or context of %u is too large",
                          p->max_tokens, p->max_ctx);
    if (p->max_ctx == 0)
        return kvd_seterr(err, errlen, KVD_EINVAL, "gpu engine: the model names no context length");
    if (p->block_tokens > 4096)
        return kvd_seterr(err, errlen, KVD_EINVAL, "gpu engine: block size %u is out of range (1..4096)",
                          p->block_tokens);
    if (p->kv_blocks == 0)
        return kvd_seterr(err, errlen, KVD_EINVAL, "gpu engine: a cache needs at least one block");
    if (p->attn_split % 32 != 0 || p->attn_split > (1u << 20))
        return kvd_seterr(err, errlen, KVD_EINVAL,
                          "gpu engine: attention split %u is not a multiple of 32", p->attn_split);
    if (((uintptr_t)p->kv_base) % 16 != 0)
        return kvd_seterr(err, errlen, KVD_EINVAL, "gpu engine: the KV base is not 16-byte aligned");
    if (!kv_type_ok(p->k_type) || !kv_type_ok(p->v_type) || p->k_type == KERN_F32 || p->v_type == KERN_F32 ||
        p->k_type == KERN_BF16 || p->v_type == KERN_BF16 ||
        (p->rotate & ~(uint32_t)(KV_ROT_K | KV_ROT_V)) != 0)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "gpu engine: KV types K %s / V %s (rotation %s): the kernels read f16, q8_0 and q4_0",
                          kv_type_name(p->k_type), kv_type_name(p->v_type), kv_rotate_name(p->rotate));
    char why[160];
    if (kv_format_check(c->head_dim, p->k_type, p->v_type, p->rotate, why, sizeof(why)) != 0)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "gpu engine: %s", why);
    return 0;
}

gpu_engine_t *gpu_engine_new(const model_t *m, int device, const struct gpu_engine_params *pp,
                             char *err, size_t errlen)
{
    const struct model_config *c = &m->cfg;
    struct gpu_engine_params p = pp ? *pp : gpu_engine_default_params();
    if (resolve_params(&p, c, err, errlen) || check_model(m, err, errlen))
        return NULL;
    char why[256];
    int n_dev = kcuda_device_count(why, sizeof(why));
    if (device < 0 || device >= n_dev) {
        if (n_dev == 0)
            kvd_seterr(err, errlen, KVD_EUNAVAILABLE, "gpu engine: %s", why);
        else
            kvd_seterr(err, errlen, KVD_EUNAVAILABLE, "gpu engine: no CUDA device %d (%d found)", device, n_dev);
        return NULL;
    }
    if (kcuda_device_open(device, NULL)) {
        kvd_seterr(err, errlen, KVD_EINTERNAL, "gpu engine: cannot open device %d: %s", device, kcuda_last_error());
        return NULL;
    }
    gpu_engine_t *e = calloc(1, sizeof(*e));
    struct glayer *layers = calloc(c->n_layer ? c->n_layer : 1, sizeof(*layers));
    if (e == NULL || layers == NULL) {
        free(e);
        free(layers);
        kvd_seterr(err, errlen, KVD_ENOMEM, "gpu engine: out of memory");
        return NULL;
    }
    e->cfg = *c;
    e->p = p;
    e->device = device;
    e->layers = layers;
    e->split = (int)p.attn_split;
    e->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    /* the parts of the cache, each layer's place in them, its window and RoPE */
    if (p.parts != NULL)
        e->parts = *p.parts;
    else
        kv_parts_single(c->n_layer, &e->parts);
    e->p.parts = NULL;      /* copied: the caller's may go */
    char perr[160];
    if (kv_parts_check(c->n_layer, &e->parts, perr, sizeof(perr)) != 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "gpu engine: %s", perr);
        goto fail;
    }
    for (uint32_t l = 0; l < c->n_layer; l++) {
        struct glayer *G = &e->layers[l];
        const bool windowed = model_layer_windowed(c, l);
        const uint32_t w = windowed ? c->swa_window : 0;
        G->part = kv_part_of(&e->parts, l);
        G->slot = kv_slot_of(&e->parts, l);
        if (e->parts.n_parts > 1 && e->parts.window[G->part] != w) {
            kvd_seterr(err, errlen, KVD_EINVAL,
                       "gpu engine: the KV cache keeps a window of %u for layer %u, which attends to %u",
                       e->parts.window[G->part], l, w);
            goto fail;
        }
        G->window = (int)w;
        const float base = windowed && c->rope_base_swa > 0.0f ? c->rope_base_swa : c->rope_base;
        G->rope_step = powf(base, -2.0f / (float)c->head_dim);
    }
    if (kcuda_stream_new(&e->stream)) {
        kvd_seterr(err, errlen, KVD_EINTERNAL, "gpu engine: %s", kcuda_last_error());
        goto fail;
    }

    /* weights: size, allocate, upload */
    struct placer pl = { 0 };
    place_model(&pl, e, m);
    e->weight_bytes = pl.off;
    if (p.weights_base != NULL) {
        /* borrowed: laid out by gpu_weights_upload, from the same model */
        if (p.weights_bytes < e->weight_bytes) {
            kvd_seterr(err, errlen, KVD_ERANGE,
                       "gpu engine: the shared weights hold %llu bytes; this model takes %llu",
                       (unsigned long long)p.weights_bytes, (unsigned long long)e->weight_bytes);
            goto fail;
        }
        pl = (struct placer){ .base = p.weights_base, .upload = false };
    } else {
        pl = (struct placer){ .base = kcuda_malloc(e->weight_bytes), .upload = true };
        e->weights = pl.base;
        if (e->weights == NULL) {
            kvd_seterr(err, errlen, KVD_ENOMEM, "gpu engine: no device memory for %llu bytes of weights",
                       (unsigned long long)e->weight_bytes);
            goto fail;
        }
    }
    place_model(&pl, e, m);
    if (pl.rc) {
        kvd_seterr(err, errlen, KVD_EINTERNAL, "gpu engine: weight upload failed: %s", kcuda_last_error());
        goto fail;
    }

    /* the cache */
    e->k_head_bytes = (uint64_t)p.block_tokens * kv_row_bytes(p.k_type, c->head_dim);
    e->v_head_bytes = (uint64_t)p.block_tokens * kv_row_bytes(p.v_type, c->head_dim);
    e->block_bytes = (uint64_t)e->parts.part_layers * c->n_head_kv * (e->k_head_bytes + e->v_head_bytes);
    const uint64_t kv_bytes = (uint64_t)p.kv_blocks * e->block_bytes;
    if (p.kv_base != NULL) {
        if (p.kv_bytes != 0 && p.kv_bytes / e->block_bytes < p.kv_blocks) {
            kvd_seterr(err, errlen, KVD_ERANGE, "gpu engine: %llu bytes at the KV base cannot hold %u blocks of %llu",
                       (unsigned long long)p.kv_bytes, p.kv_blocks, (unsigned long long)e->block_bytes);
            goto fail;
        }
        e->kv = p.kv_base;
    } else {
        e->kv = kcuda_malloc(kv_bytes);
        e->kv_owned = true;
        if (e->kv == NULL || kcuda_memset(e->kv, 0, kv_bytes, e->stream)) {
            kvd_seterr(err, errlen, KVD_ENOMEM, "gpu engine: no device memory for %u KV blocks (%llu bytes)",
                       p.kv_blocks, (unsigned long long)kv_bytes);
            goto fail;
        }
    }

    /* activations and per-step buffers */
    const size_t T = p.max_tokens;
    const size_t qd = (size_t)c->n_head * c->head_dim, kvd = (size_t)c->n_head_kv * c->head_dim;
    size_t widest = c->n_embd > qd ? c->n_embd : qd;
    if (c->n_ff > widest)
        widest = c->n_ff;
    bool ok = true;
    e->x = dev_alloc(T * c->n_embd * sizeof(float), &ok);
    e->xb = dev_alloc(T * (c->n_embd > qd ? c->n_embd : qd) * sizeof(float), &ok);
    e->q = dev_alloc(T * qd * sizeof(float), &ok);
    e->k = dev_alloc(T * kvd * sizeof(float), &ok);
    e->v = dev_alloc(T * kvd * sizeof(float), &ok);
    e->gate = dev_alloc(T * c->n_ff * sizeof(float), &ok);
    e->up = dev_alloc(T * c->n_ff * sizeof(float), &ok);
    e->logits = dev_alloc(T * c->n_vocab * sizeof(float), &ok);
    e->ids = dev_alloc(T * sizeof(int32_t), &ok);
    const size_t scratch = kcuda_attn_scratch_bytes((int)T, (int)c->n_head, (int)c->head_dim, (int)p.max_ctx,
                                                    e->split);
    if (scratch > 0)
        e->attn_scratch = dev_alloc(scratch, &ok);
    /* an activation row is at most as wide as its floats; rows 16-byte aligned */
    const size_t act_stride = (widest * sizeof(float) + 15) / 16 * 16;
    for (int i = 0; i < ACT_SLOTS; i++) {
        e->act[i].type = UINT32_MAX;
        e->act[i].buf = dev_alloc(T * act_stride, &ok);
    }
    struct meta_layout *ml = &e->ml;
    size_t off = 0;
#define META(field, bytes) (ml->field = off, off += ((bytes) + 255) / 256 * 256)
    META(tok_id, T * sizeof(int32_t));
    META(tok_pos, T * sizeof(int32_t));
    META(tok_block, T * e->parts.n_parts * sizeof(uint32_t));
    META(out_row, T * sizeof(int32_t));
    META(dec, T * sizeof(struct kcuda_seq));
    META(pf, T * sizeof(struct kcuda_seq));
#undef META
    ml->bytes = off;
    e->meta_dev = dev_alloc(ml->bytes, &ok);
    e->meta_host = kcuda_host_alloc(ml->bytes);
    e->ids_host = kcuda_host_alloc(T * sizeof(int32_t));
    e->draws_dev = dev_alloc(T * sizeof(struct kcuda_draw), &ok);
    e->draws_host = kcuda_host_alloc(T * sizeof(struct kcuda_draw));
    e->host_rows = malloc(T * sizeof(uint32_t));
    e->pen_seen = calloc((c->n_vocab + 7) / 8, 1);
    struct sampler_params sp = sampler_default_params();
    e->host_smp = sampler_new(&sp, c->n_vocab, NULL, 0);
    /* block tables: room for max_tokens sequences of up to 4096 positions
     * at first; grown on demand */
    const uint32_t ctx0 = p.max_ctx < 4096 ? p.max_ctx : 4096;
    e->tables_cap = T * ((ctx0 + p.block_tokens - 1) / p.block_tokens);
    e->tables_dev = dev_alloc(e->tables_cap * e->parts.n_parts * sizeof(uint32_t), &ok);
    e->tables_host = kcuda_host_alloc(e->tables_cap * e->parts.n_parts * sizeof(uint32_t));
    if (!ok || e->meta_host == NULL || e->ids_host == NULL || e->tables_host == NULL || e->draws_host == NULL ||
        e->host_rows == NULL || e->pen_seen == NULL || e->host_smp == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "gpu engine: out of memory for step buffers (%zu tokens)", T);
        goto fail;
    }
    memset(e->meta_host, 0, ml->bytes);
    /* the weights went up on the legacy stream, which this engine's stream
     * does not wait for (and a copy from pageable memory may return before
     * its last bytes land): wait for the whole device once */
    if (kcuda_sync() || kcuda_stream_sync(e->stream)) {
        kvd_seterr(err, errlen, KVD_EINTERNAL, "gpu engine: %s", kcuda_last_error());
        goto fail;
    }

    bool graphs = p.graphs != 0;
    if (p.graphs < 0) {
        const char *env = getenv("KVD_CUDA_GRAPHS");
        graphs = !(env != NULL && strcmp(env, "0") == 0);
    }
    if (!graphs)
        snprintf(e->stats.why_disabled, sizeof(e->stats.why_disabled), "turned off (%s)",
                 p.graphs == 0 ? "parameter" : "KVD_CUDA_GRAPHS=0");
    else
        gpu_engine_set_graphs(e, true);
    return e;

fail:
    gpu_engine_destroy(&e);
    return NULL;
}

/* ---- the step ------------------------------------------------------------------- */

/* Grows the block-table buffers to hold n entries per part (dropping recorded
 * graphs, which hold the old addresses). 0 or KVD_ENOMEM. */
static int tables_reserve(gpu_engine_t *e, uint64_t n)
{
    if (n <= e->tables_cap)
        return 0;
    size_t cap = e->tables_cap * 2 > n ? e->tables_cap * 2 : (size_t)n;
    uint32_t *d = kcuda_malloc(cap * e->parts.n_parts * sizeof(uint32_t));
    uint32_t *h = kcuda_host_alloc(cap * e->parts.n_parts * sizeof(uint32_t));
    if (d == NULL || h == NULL) {
        kcuda_free(d);
        kcuda_host_free(h);
        return KVD_ENOMEM;
    }
    graphs_drop(e);
    kcuda_free(e->tables_dev);
    kcuda_host_free(e->tables_host);
    e->tables_dev = d;
    e->tables_host = h;
    e->tables_cap = cap;
    return 0;
}

/* The batch size a decode graph is recorded for: n rounded up to a power of
 * two up to 8, a multiple of 8 up to 64, of 32 beyond (at most max_tokens),
 * so that batches that change by a few sequences reuse a recording; the extra
 * rows cost little in a step that reads every weight anyway. */
static uint32_t decode_bucket(uint32_t n, uint32_t max_tokens)
{
    uint32_t b;
    if (n <= 8) {
        b = 1;
        while (b < n)
            b *= 2;
    } else if (n <= 64) {
        b = (n + 7) / 8 * 8;
    } else {
        b = (n + 31) / 32 * 32;
    }
    return b < max_tokens ? b : max_tokens;
}

/* The block table of sequence q's part `part`. */
static inline const uint32_t *seq_part_table(const struct fwd_seq *q, uint32_t part)
{
    return q->tables != NULL ? q->tables[part] : q->blocks;
}

/* Lays the step out in the host meta buffers; fills *s. Rows past the
 * batch's own (padding) may follow; the caller returns only its own. */
static void layout_step(gpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs, struct step_shape *s)
{
    const struct meta_layout *ml = &e->ml;
    int32_t *tok_id = (int32_t *)(e->meta_host + ml->tok_id);
    int32_t *tok_pos = (int32_t *)(e->meta_host + ml->tok_pos);
    uint32_t *tok_block = (uint32_t *)(e->meta_host + ml->tok_block);
    int32_t *out_row = (int32_t *)(e->meta_host + ml->out_row);
    struct kcuda_seq *dec = (struct kcuda_seq *)(e->meta_host + ml->dec);
    struct kcuda_seq *pf = (struct kcuda_seq *)(e->meta_host + ml->pf);
    const uint32_t bt = e->p.block_tokens, n_parts = e->parts.n_parts, T_cap = e->p.max_tokens;
    uint32_t t = 0, r = 0, nd = 0, np = 0, max_dec_ctx = 0, max_pf = 0;
    size_t ntab = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        const struct fwd_seq *q = &seqs[i];
        const uint32_t need = (q->pos + q->n_tokens + bt - 1) / bt;
        const struct kcuda_seq ks = { .row = (int32_t)t, .n_tok = (int32_t)q->n_tokens, .pos = (int32_t)q->pos,
                                      .table = (uint32_t)ntab };
        /* each part's table at the same offset in that part's array (entries
         * a window no longer reads go as they are: the kernels skip them) */
        for (uint32_t part = 0; part < n_parts; part++)
            memcpy(e->tables_host + part * e->tables_cap + ntab, seq_part_table(q, part),
                   (size_t)need * sizeof(uint32_t));
        ntab += need;
        if (q->n_tokens == 1) {
            dec[nd++] = ks;
            if (q->pos + 1 > max_dec_ctx)
                max_dec_ctx = q->pos + 1;
        } else {
            pf[np++] = ks;
            if (q->n_tokens > max_pf)
                max_pf = q->n_tokens;
        }
        for (uint32_t j = 0; j < q->n_tokens; j++, t++) {
            const uint32_t pos = q->pos + j;
            tok_id[t] = q->tokens[j];
            tok_pos[t] = (int32_t)pos;
            for (uint32_t part = 0; part < n_parts; part++)
                tok_block[part * T_cap + t] = seq_part_table(q, part)[pos / bt];
            if (q->all_logits || j + 1 == q->n_tokens)
                out_row[r++] = (int32_t)t;
        }
    }
    /* the decode grid is sized by a power of two (at least one split, at most
     * max_ctx), so that recorded graphs serve every context up to it */
    uint32_t ctx = 0;
    if (nd > 0) {
        ctx = (uint32_t)e->split;
        while (ctx < max_dec_ctx)
            ctx *= 2;
        if (ctx > e->p.max_ctx)
            ctx = e->p.max_ctx;
    }
    /* A decode step that will run as a graph is padded to a bucket of batch
     * sizes with copies of its first token: same id, position, block and
     * table, so a copy computes the same bits and writes the same K/V bytes
     * to the same place as the original (a benign duplicate write, and only
     * into a block the caller gave). Their rows are computed, never returned. */
    if (e->graphs && np == 0) {
        const uint32_t want = decode_bucket(nd, e->p.max_tokens);
        for (; t < want; t++, r++, nd++) {
            tok_id[t] = tok_id[0];
            tok_pos[t] = tok_pos[0];
            for (uint32_t part = 0; part < n_parts; part++)
                tok_block[part * T_cap + t] = tok_block[part * T_cap];
            out_row[r] = (int32_t)t;
            dec[nd] = dec[0];
            dec[nd].row = (int32_t)t;
        }
    }
    *s = (struct step_shape){ .T = t, .rows = r, .n_dec = nd, .n_pf = np, .dec_ctx = ctx, .pf_tok = max_pf };
}

/* The per-layer view of the cache the kernels take. */
static struct kcuda_kv layer_kv(const gpu_engine_t *e, uint32_t l)
{
    const struct model_config *c = &e->cfg;
    const uint64_t layer_bytes = (uint64_t)c->n_head_kv * (e->k_head_bytes + e->v_head_bytes);
    const uint64_t at = (uint64_t)e->layers[l].slot * layer_bytes;
    struct kcuda_kv kv = {
        .k = e->kv + at,
        .v = e->kv + at + (uint64_t)c->n_head_kv * e->k_head_bytes,
        .block_stride = e->block_bytes,
        .k_head_stride = e->k_head_bytes,
        .v_head_stride = e->v_head_bytes,
        .k_type = e->p.k_type,
        .v_type = e->p.v_type,
        .rotate = e->p.rotate,
        .block_tokens = (int)e->p.block_tokens,
        .head_dim = (int)c->head_dim,
        .n_head = (int)c->n_head,
        .n_head_kv = (int)c->n_head_kv,
    };
    return kv;
}

/* The rows of src (T x n floats) in the format weight type wtype consumes,
 * quantizing them on first use; `fresh` forgets the formats of the previous
 * input. F32 activations are src itself. Slots are known by type alone: every
 * new input (even in the same buffer) must start fresh, or come after
 * norm_for / act_claim, which clear them. */
static int acts_for(gpu_engine_t *e, uint32_t wtype, const float *src, int n, int T, bool fresh,
                    struct act_ref *out)
{
    if (fresh)
        for (int i = 0; i < ACT_SLOTS; i++)
            e->act[i].type = UINT32_MAX;
    const uint32_t at = kern_vec_dot_type(wtype);
    if (at == KERN_F32) {
        *out = (struct act_ref){ src, (size_t)n * sizeof(float) };
        return 0;
    }
    int i;
    for (i = 0; i < ACT_SLOTS; i++) {
        if (e->act[i].type == at) {
            *out = (struct act_ref){ e->act[i].buf, e->act[i].stride };
            return 0;
        }
        if (e->act[i].type == UINT32_MAX)
            break;
    }
    struct act_slot *s = &e->act[i < ACT_SLOTS ? i : ACT_SLOTS - 1];
    s->type = at;
    s->stride = (kern_act_row_bytes(at, n) + 15) / 16 * 16;
    *out = (struct act_ref){ s->buf, s->stride };
    return kcuda_quantize_act(at, src, (size_t)n, s->buf, s->stride, n, T, e->stream);
}

/* Claims a fresh activation slot for type-`wtype` products of n-wide rows
 * that a fused kernel is about to fill; NULL when that type takes f32 rows
 * (nothing to fuse). */
static struct act_slot *act_claim(gpu_engine_t *e, uint32_t wtype, int n)
{
    const uint32_t at = kern_vec_dot_type(wtype);
    if (at != KERN_Q8_0 && at != KERN_Q8_1)
        return NULL;
    for (int i = 0; i < ACT_SLOTS; i++)
        e->act[i].type = UINT32_MAX;
    struct act_slot *s = &e->act[0];
    s->type = at;
    s->stride = (kern_act_row_bytes(at, n) + 15) / 16 * 16;
    return s;
}

/* xb = RMSNorm(x) * w, quantized in the same kernel for the products of type
 * wtype that follow (one launch less). */
static int norm_for(gpu_engine_t *e, const float *w, uint32_t wtype, int T)
{
    const int ne = (int)e->cfg.n_embd;
    for (int i = 0; i < ACT_SLOTS; i++)     /* a new input: no format of the last one is valid */
        e->act[i].type = UINT32_MAX;
    const struct act_slot *s = ne % 32 == 0 ? act_claim(e, wtype, ne) : NULL;
    if (s == NULL)
        return kcuda_rmsnorm(e->xb, e->x, w, NULL, ne, T, e->cfg.rms_eps, e->stream);
    return kcuda_rmsnorm_quant(e->xb, e->x, w, ne, T, e->cfg.rms_eps, s->type, s->buf, s->stride, e->stream);
}

static struct kcuda_gemm_args gemm_args(const struct gmat *w, struct act_ref a, int T, float *out, bool add)
{
    return (struct kcuda_gemm_args){
        .wtype = w->type, .w = w->w, .row_bytes = w->row_bytes, .rows = w->rows, .n = w->cols,
        .act = a.buf, .act_stride = a.stride, .T = T, .out = out, .ldo = (size_t)w->rows, .add = add,
    };
}

static int gemm(gpu_engine_t *e, const struct gmat *w, struct act_ref a, int T, float *out, bool add)
{
    const struct kcuda_gemm_args g = gemm_args(w, a, T, out, add);
    return kcuda_gemm(&g, e->stream);
}

/* Products of n_mat matrices with the input that norm_for just made (src,
 * rows of n floats): one launch when they share their type and width (the
 * same bits as one by one: fewer kernels per step), else one each. */
static int gemm_same_input(gpu_engine_t *e, const struct gmat *const *w, float *const *out, int n_mat,
                           const float *src, int n, int T)
{
    bool one = true;
    for (int i = 1; i < n_mat; i++)
        one = one && w[i]->type == w[0]->type && w[i]->cols == w[0]->cols;
    struct kcuda_gemm_args g[KCUDA_GEMM_MAX_MATS];
    struct act_ref a;
    int rc = 0;
    for (int i = 0; i < n_mat && rc == 0; i++) {
        rc = acts_for(e, w[i]->type, src, n, T, false, &a);     /* norm_for cleared the slots */
        g[i] = gemm_args(w[i], a, T, out[i], false);
        if (rc == 0 && !one)
            rc = kcuda_gemm(&g[i], e->stream);
    }
    return rc == 0 && one ? kcuda_gemm_n(g, n_mat, e->stream) : rc;
}

/* Enqueues the whole forward step of shape s (its meta already laid out,
 * or about to be uploaded before this runs). 0 or the first launch error. */
static int run_forward(gpu_engine_t *e, const struct step_shape *s)
{
    const struct model_config *c = &e->cfg;
    const int T = (int)s->T, ne = (int)c->n_embd, qd = (int)(c->n_head * c->head_dim), ff = (int)c->n_ff;
    const struct meta_layout *ml = &e->ml;
    const int32_t *tok_id = (const int32_t *)(e->meta_dev + ml->tok_id);
    const int32_t *tok_pos = (const int32_t *)(e->meta_dev + ml->tok_pos);
    const uint32_t *tok_block = (const uint32_t *)(e->meta_dev + ml->tok_block);
    const int32_t *out_row = (const int32_t *)(e->meta_dev + ml->out_row);
    kcuda_stream_t st = e->stream;
    struct act_ref a;
    int rc;
#define TRY(call) do { if ((rc = (call)) != 0) return rc; } while (0)
    const int hd = (int)c->head_dim;
    TRY(kcuda_get_rows(e->tok_embd.type, e->tok_embd.w, e->tok_embd.row_bytes, ne, tok_id, T, e->x, st));
    if (c->emb_scale != 1.0f)
        TRY(kcuda_scale(e->x, c->emb_scale, (int64_t)T * ne, st));
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const struct glayer *L = &e->layers[l];
        const struct kcuda_kv kv = layer_kv(e, l);
        /* attention */
        TRY(norm_for(e, L->attn_norm, L->wq.type, T));
        const struct gmat *qkv[3] = { &L->wq, &L->wk, &L->wv };
        float *const qkv_out[3] = { e->q, e->k, e->v };
        TRY(gemm_same_input(e, qkv, qkv_out, 3, e->xb, ne, T));
        if (L->q_norm != NULL) {    /* Gemma: every head's query and key RMS-normed */
            TRY(kcuda_rmsnorm(e->q, e->q, L->q_norm, NULL, hd, T * (int)c->n_head, c->rms_eps, st));
            TRY(kcuda_rmsnorm(e->k, e->k, L->k_norm, NULL, hd, T * (int)c->n_head_kv, c->rms_eps, st));
        }
        const struct kcuda_rope_args ra = {
            .kv = kv, .q = e->q, .k = e->k, .v = e->v, .pos = tok_pos,
            .block = tok_block + (size_t)L->part * e->p.max_tokens, .T = T, .step = L->rope_step,
            .neox = c->rope_neox,
        };
        TRY(kcuda_rope_kv(&ra, st));
        struct kcuda_attn_args aa = {
            .kv = kv, .out = e->xb, .q = e->q, .tables = e->tables_dev + (size_t)L->part * e->tables_cap,
            .scale = e->attn_scale, .split = e->split, .scratch = e->attn_scratch, .max_ctx = (int)e->p.max_ctx,
            .window = L->window,
        };
        if (s->n_dec > 0) {
            aa.seqs = (const struct kcuda_seq *)(e->meta_dev + ml->dec);
            aa.n_seq = (int)s->n_dec;
            aa.max_tok = 1;
            aa.max_ctx = (int)s->dec_ctx;
            TRY(kcuda_attn_decode(&aa, st));
        }
        if (s->n_pf > 0) {
            aa.seqs = (const struct kcuda_seq *)(e->meta_dev + ml->pf);
            aa.n_seq = (int)s->n_pf;
            aa.max_tok = (int)s->pf_tok;
            aa.max_ctx = (int)e->p.max_ctx;
            TRY(kcuda_attn_prefill(&aa, st));
        }
        if (kv.rotate & KV_ROT_V)     /* the outputs meet wo unrotated */
            TRY(kcuda_hadamard(e->xb, (int64_t)T * c->n_head, (int)c->head_dim, st));
        /* the output product: added to the stream, or (Gemma) normed first */
        TRY(acts_for(e, L->wo.type, e->xb, qd, T, true, &a));
        if (L->post_attn_norm != NULL) {
            TRY(gemm(e, &L->wo, a, T, e->up, false));
            TRY(kcuda_rmsnorm_add(e->x, e->up, L->post_attn_norm, ne, T, c->rms_eps, st));
        } else {
            TRY(gemm(e, &L->wo, a, T, e->x, true));
        }
        /* feed-forward */
        TRY(norm_for(e, L->ffn_norm, L->w_gate.type, T));
        const struct gmat *gu[2] = { &L->w_gate, &L->w_up };
        float *const gu_out[2] = { e->gate, e->up };
        TRY(gemm_same_input(e, gu, gu_out, 2, e->xb, ne, T));
        const struct act_slot *ds = ff % 32 == 0 && e->gelu == NULL ? act_claim(e, L->w_down.type, ff) : NULL;
        if (ds != NULL) {       /* SwiGLU and the down product's input in one kernel */
            TRY(kcuda_swiglu_quant(e->gate, e->up, ff, T, ds->type, ds->buf, ds->stride, st));
            a = (struct act_ref){ ds->buf, ds->stride };
        } else {
            if (e->gelu != NULL)
                TRY(kcuda_geglu(e->gate, e->up, ff, T, e->gelu, st));
            else
                TRY(kcuda_swiglu(e->gate, e->up, ff, T, st));
            TRY(acts_for(e, L->w_down.type, e->gate, ff, T, true, &a));
        }
        if (L->post_ffn_norm != NULL) {
            TRY(gemm(e, &L->w_down, a, T, e->up, false));
            TRY(kcuda_rmsnorm_add(e->x, e->up, L->post_ffn_norm, ne, T, c->rms_eps, st));
        } else {
            TRY(gemm(e, &L->w_down, a, T, e->x, true));
        }
    }
    /* final norm of the rows that give logits, then the output head */
    const int R = (int)s->rows;
    TRY(kcuda_rmsnorm(e->xb, e->x, e->output_norm, out_row, ne, R, c->rms_eps, st));
    TRY(acts_for(e, e->output.type, e->xb, ne, R, true, &a));
    TRY(gemm(e, &e->output, a, R, e->logits, false));
#undef TRY
    return 0;
}

/* The recorded graph for a decode shape, recording it on a miss; NULL when
 * graphs are off or recording failed (then off for good, with the reason). */
static kcuda_graph_t *graph_for(gpu_engine_t *e, const struct step_shape *s, int *rc)
{
    *rc = 0;
    struct graph_slot *hit = NULL, *victim = &e->slots[0];
    for (int i = 0; i < GRAPH_SLOTS; i++) {
        struct graph_slot *g = &e->slots[i];
        if (g->g != NULL && g->n_dec == s->n_dec && g->dec_ctx == s->dec_ctx) {
            hit = g;
            break;
        }
        if (victim->g != NULL && (g->g == NULL || g->used < victim->used))
            victim = g;
    }
    if (hit != NULL) {
        hit->used = e->step_no;
        return hit->g;
    }
    if (kcuda_capture_begin(e->stream)) {
        snprintf(e->stats.why_disabled, sizeof(e->stats.why_disabled), "capture failed: %s", kcuda_last_error());
        e->graphs = false;
        return NULL;
    }
    const int frc = run_forward(e, s);
    kcuda_graph_t *g = NULL;
    const int crc = kcuda_capture_end(e->stream, frc == 0, &g);
    if (frc != 0) {
        *rc = frc;              /* a launch was refused: the step fails as it would eagerly */
        return NULL;
    }
    if (crc != 0) {
        snprintf(e->stats.why_disabled, sizeof(e->stats.why_disabled), "capture failed: %s", kcuda_last_error());
        e->graphs = false;
        return NULL;
    }
    kcuda_graph_destroy(&victim->g);
    *victim = (struct graph_slot){ .g = g, .n_dec = s->n_dec, .dec_ctx = s->dec_ctx, .used = e->step_no };
    e->stats.captures++;
    return g;
}

/* Runs a checked, laid-out step up to its logits on the device. */
static int enqueue_step(gpu_engine_t *e, const struct step_shape *s, size_t n_tables)
{
    kcuda_graph_t *g = NULL;
    int rc;
    if (e->graphs && s->n_pf == 0) {
        g = graph_for(e, s, &rc);
        if (rc)
            return rc;
    }
    rc = kcuda_upload_async(e->meta_dev, e->meta_host, e->ml.bytes, e->stream);
    for (uint32_t part = 0; rc == 0 && part < e->parts.n_parts; part++)
        rc = kcuda_upload_async(e->tables_dev + part * e->tables_cap, e->tables_host + part * e->tables_cap,
                                n_tables * sizeof(uint32_t), e->stream);
    if (rc)
        return rc;
    if (g != NULL) {
        e->stats.replays++;
        return kcuda_graph_launch(g, e->stream);
    }
    e->stats.eager_steps++;
    return run_forward(e, s);
}

/* The step's draws in the kernel's form (host buffers), and the rows left to
 * the host in e->host_rows; 0, KVD_EINVAL for a bad draw or KVD_ENOMEM. */
static int lay_out_draws(gpu_engine_t *e, const struct sampler_draw *const *draws, uint32_t rows,
                         uint32_t *n_pen, uint32_t *n_host, char *err, size_t errlen)
{
    const uint32_t V = e->cfg.n_vocab;
    size_t total = 0;
    for (uint32_t r = 0; r < rows; r++) {
        const struct sampler_draw *d = draws[r];
        if (d == NULL)
            continue;
        if (!(d->u >= 0.0 && d->u < 1.0) || d->top_k < 0 || isnan(d->temperature) ||
            (d->n_penalized > 0 && d->penalized == NULL) ||
            (d->n_biased > 0 && (d->biased == NULL || d->bias == NULL)))
            return kvd_seterr(err, errlen, KVD_EINVAL, "gpu engine: draw %u is out of range", r);
        total += d->n_penalized + d->n_biased;
    }
    if (total > e->pen_cap) {
        const size_t cap = total > 2 * e->pen_cap ? total : 2 * e->pen_cap;
        int32_t *h = kcuda_host_alloc(cap * sizeof(int32_t));
        int32_t *dv = kcuda_malloc(cap * sizeof(int32_t));
        float *ah = kcuda_host_alloc(cap * sizeof(float));
        float *ad = kcuda_malloc(cap * sizeof(float));
        if (h == NULL || dv == NULL || ah == NULL || ad == NULL) {
            kcuda_host_free(h);
            kcuda_free(dv);
            kcuda_host_free(ah);
            kcuda_free(ad);
            return kvd_seterr(err, errlen, KVD_ENOMEM, "gpu engine: out of memory for penalized ids");
        }
        kcuda_host_free(e->pen_host);
        kcuda_free(e->pen_dev);
        kcuda_host_free(e->add_host);
        kcuda_free(e->add_dev);
        e->pen_host = h;
        e->pen_dev = dv;
        e->add_host = ah;
        e->add_dev = ad;
        e->pen_cap = cap;
    }
    uint32_t np = 0, nh = 0;
    for (uint32_t r = 0; r < rows; r++) {
        const struct sampler_draw *d = draws[r];
        struct kcuda_draw *k = &e->draws_host[r];
        *k = (struct kcuda_draw){ .row = -1 };
        if (d == NULL)
            continue;
        /* each id once and in range, in each list: the kernel changes them in parallel */
        for (int list = 0; list < 2; list++) {
            const int32_t *ids = list ? d->biased : d->penalized;
            const uint32_t n_ids = list ? d->n_biased : d->n_penalized;
            uint32_t i;
            for (i = 0; i < n_ids; i++) {
                const int32_t id = ids[i];
                if (id < 0 || (uint32_t)id >= V || (e->pen_seen[id / 8] >> (id % 8) & 1))
                    break;
                e->pen_seen[id / 8] |= (uint8_t)(1u << (id % 8));
            }
            for (uint32_t j = 0; j < i; j++)
                e->pen_seen[ids[j] / 8] = 0;
            if (i < n_ids)
                return kvd_seterr(err, errlen, KVD_EINVAL,
                                  "gpu engine: draw %u %s token %d twice or outside the vocabulary", r,
                                  list ? "biases" : "penalizes", (int)ids[i]);
        }
        /* the twin's k; more than the kernel keeps goes to the host */
        const uint32_t kk = d->top_k > 0 && (uint32_t)d->top_k < V ? (uint32_t)d->top_k : V;
        if (d->temperature > 0.0f && kk > KCUDA_SAMPLE_MAX_K) {
            e->host_rows[nh++] = r;
            continue;
        }
        *k = (struct kcuda_draw){
            .row = (int32_t)r, .top_k = (int32_t)kk, .temperature = d->temperature, .top_p = d->top_p,
            .min_p = d->min_p, .repeat_penalty = d->repeat_penalty, .log_min_p = d->log_min_p, .u = d->u,
            .pen_off = np, .n_pen = d->n_penalized, .bias_off = np + d->n_penalized, .n_bias = d->n_biased,
        };
        if (d->n_penalized > 0) {
            memcpy(e->pen_host + np, d->penalized, d->n_penalized * sizeof(int32_t));
            memset(e->add_host + np, 0, d->n_penalized * sizeof(float));
        }
        np += d->n_penalized;
        if (d->n_biased > 0) {
            memcpy(e->pen_host + np, d->biased, d->n_biased * sizeof(int32_t));
            memcpy(e->add_host + np, d->bias, d->n_biased * sizeof(float));
        }
        np += d->n_biased;
    }
    *n_pen = np;
    *n_host = nh;
    return 0;
}

enum step_mode { STEP_LOGITS, STEP_ARGMAX, STEP_SAMPLE };

static int step(gpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs, enum step_mode mode,
                const struct sampler_draw *const *draws, uint32_t *n_rows, char *err, size_t errlen)
{
    const struct model_config *c = &e->cfg;
    uint32_t T = 0, rows = 0;
    uint64_t n_tables = 0;
    const struct fwd_limits lim = { e->p.max_ctx, e->p.max_tokens, e->p.block_tokens, e->p.kv_blocks,
                                    e->cfg.n_vocab, &e->parts };
    int rc = fwd_check_batch(&lim, seqs, n_seqs, &T, &rows, &n_tables, err, errlen);
    if (rc)
        return rc;
    /* this engine's device before anything is allocated or enqueued */
    if (kcuda_set_device(e->device))
        return kvd_seterr(err, errlen, KVD_EINTERNAL, "gpu engine: %s", kcuda_last_error());
    uint32_t n_pen = 0, n_host = 0;
    if (mode == STEP_SAMPLE && (rc = lay_out_draws(e, draws, rows, &n_pen, &n_host, err, errlen)) != 0)
        return rc;
    if (tables_reserve(e, n_tables))
        return kvd_seterr(err, errlen, KVD_ENOMEM, "engine: out of memory for block tables");
    /* logits come to the host: every row, or the rows sampled there */
    const uint32_t to_host = mode == STEP_LOGITS ? rows : mode == STEP_SAMPLE ? n_host : 0;
    if (to_host > e->logits_cap) {
        float *nl = kcuda_host_alloc((size_t)to_host * c->n_vocab * sizeof(float));
        if (nl == NULL)
            return kvd_seterr(err, errlen, KVD_ENOMEM, "engine: out of memory for logits");
        kcuda_host_free(e->logits_host);
        e->logits_host = nl;
        e->logits_cap = to_host;
    }
    e->step_no++;
    struct step_shape s;
    layout_step(e, seqs, n_seqs, &s);
    rc = enqueue_step(e, &s, (size_t)n_tables);
    const size_t V = c->n_vocab;
    if (rc == 0 && mode == STEP_ARGMAX) {
        rc = kcuda_argmax(e->ids, e->logits, c->n_vocab, V, (int)rows, e->stream);
        if (rc == 0)
            rc = kcuda_download_async(e->ids_host, e->ids, (size_t)rows * sizeof(int32_t), e->stream);
    } else if (rc == 0 && mode == STEP_SAMPLE) {
        rc = kcuda_upload_async(e->draws_dev, e->draws_host, (size_t)rows * sizeof(struct kcuda_draw), e->stream);
        if (rc == 0 && n_pen > 0)
            rc = kcuda_upload_async(e->pen_dev, e->pen_host, (size_t)n_pen * sizeof(int32_t), e->stream);
        if (rc == 0 && n_pen > 0)       /* the penalized ids' places in it are never read */
            rc = kcuda_upload_async(e->add_dev, e->add_host, (size_t)n_pen * sizeof(float), e->stream);
        if (rc == 0)
            rc = kcuda_sample(e->ids, e->logits, c->n_vocab, V, e->draws_dev, (int)rows, e->pen_dev, e->add_dev,
                              e->stream);
        if (rc == 0)
            rc = kcuda_download_async(e->ids_host, e->ids, (size_t)rows * sizeof(int32_t), e->stream);
        for (uint32_t j = 0; rc == 0 && j < n_host; j++)
            rc = kcuda_download_async(e->logits_host + j * V, e->logits + (size_t)e->host_rows[j] * V,
                                      V * sizeof(float), e->stream);
    } else if (rc == 0) {
        rc = kcuda_download_async(e->logits_host, e->logits, (size_t)rows * c->n_vocab * sizeof(float),
                                  e->stream);
    }
    /* wait even after a failed launch: earlier work may still use the buffers */
    const int src = kcuda_stream_sync(e->stream);
    if (rc == 0)
        rc = src;
    if (rc)
        return kvd_seterr(err, errlen, rc, "gpu engine: step failed: %s",
                          kcuda_last_error()[0] ? kcuda_last_error() : kvd_strerror(rc));
    for (uint32_t j = 0; j < n_host; j++) {
        const uint32_t r = e->host_rows[j];
        e->ids_host[r] = sampler_pick(e->host_smp, draws[r], e->logits_host + j * V);
    }
    *n_rows = rows;
    return 0;
}

int gpu_engine_step(gpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                    const float **logits, uint32_t *n_rows, char *err, size_t errlen)
{
    int rc = step(e, seqs, n_seqs, STEP_LOGITS, NULL, n_rows, err, errlen);
    if (rc == 0)
        *logits = e->logits_host;
    return rc;
}

int gpu_engine_step_argmax(gpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                           const int32_t **ids, uint32_t *n_rows, char *err, size_t errlen)
{
    int rc = step(e, seqs, n_seqs, STEP_ARGMAX, NULL, n_rows, err, errlen);
    if (rc == 0)
        *ids = e->ids_host;
    return rc;
}

int gpu_engine_step_sample(gpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                           const struct sampler_draw *const *draws, const int32_t **ids, uint32_t *n_rows,
                           char *err, size_t errlen)
{
    if (draws == NULL)
        return kvd_seterr(err, errlen, KVD_EINVAL, "gpu engine: no draws");
    int rc = step(e, seqs, n_seqs, STEP_SAMPLE, draws, n_rows, err, errlen);
    if (rc == 0)
        *ids = e->ids_host;
    return rc;
}

int gpu_engine_fence(gpu_engine_t *e, char *err, size_t errlen)
{
    if (kcuda_set_device(e->device) || kcuda_stream_sync(e->stream))
        return kvd_seterr(err, errlen, KVD_EINTERNAL, "gpu engine: %s", kcuda_last_error());
    return 0;
}

/* ---- the cache from the host ------------------------------------------------------ */

static int kv_copy(gpu_engine_t *e, uint32_t block, void *host, bool up, char *err, size_t errlen)
{
    if (block >= e->p.kv_blocks)
        return kvd_seterr(err, errlen, KVD_ERANGE, "gpu engine: block %u of %u", block, e->p.kv_blocks);
    if (kcuda_set_device(e->device))
        return kvd_seterr(err, errlen, KVD_EINTERNAL, "gpu engine: %s", kcuda_last_error());
    uint8_t *dev = e->kv + (size_t)block * e->block_bytes;
    int rc = up ? kcuda_upload_async(dev, host, e->block_bytes, e->stream)
                : kcuda_download_async(host, dev, e->block_bytes, e->stream);
    const int src = kcuda_stream_sync(e->stream);
    if (rc == 0)
        rc = src;
    if (rc)
        return kvd_seterr(err, errlen, KVD_EINTERNAL, "gpu engine: KV copy failed: %s", kcuda_last_error());
    return 0;
}

int gpu_engine_kv_read(gpu_engine_t *e, uint32_t block, void *dst, char *err, size_t errlen)
{
    return kv_copy(e, block, dst, false, err, errlen);
}

int gpu_engine_kv_write(gpu_engine_t *e, uint32_t block, const void *src, char *err, size_t errlen)
{
    return kv_copy(e, block, (void *)src, true, err, errlen);
}

/* ---- context windowing ------------------------------------------------------------ */

/* Waits for the stream after the work of a windowing call; rc is the
 * first launch's result. */
static int window_done(gpu_engine_t *e, int rc, const char *what, char *err, size_t errlen)
{
    const int src = kcuda_stream_sync(e->stream);   /* even after a failed launch */
    if (rc == 0)
        rc = src;
    if (rc)
        return kvd_seterr(err, errlen, rc, "gpu engine: %s failed: %s", what,
                          kcuda_last_error()[0] ? kcuda_last_error() : kvd_strerror(rc));
    return 0;
}

int gpu_engine_kv_copy(gpu_engine_t *e, const uint32_t *from, const uint32_t *to, uint32_t n, char *err,
                       size_t errlen)
{
    for (uint32_t i = 0; i < n; i++)
        if (from[i] >= e->p.kv_blocks || to[i] >= e->p.kv_blocks)
            return kvd_seterr(err, errlen, KVD_ERANGE, "block %u is outside the cache",
                              from[i] >= e->p.kv_blocks ? from[i] : to[i]);
    if (n == 0)
        return 0;
    if (kcuda_set_device(e->device))
        return kvd_seterr(err, errlen, KVD_EINTERNAL, "gpu engine: %s", kcuda_last_error());
    int rc = 0;
    for (uint32_t i = 0; rc == 0 && i < n; i++)
        if (from[i] != to[i])
            rc = kcuda_copy(e->kv + (size_t)to[i] * e->block_bytes, e->kv + (size_t)from[i] * e->block_bytes,
                            e->block_bytes, e->stream);
    return window_done(e, rc, "KV block copy", err, errlen);
}

int gpu_engine_kv_shift(gpu_engine_t *e, const uint32_t *blocks, uint32_t n, int32_t delta, char *err,
                        size_t errlen)
{
    const struct model_config *c = &e->cfg;
    if (e->parts.n_parts > 1)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "windowing a model with sliding-window layers is not supported");
    for (uint32_t b = 0; b < n; b++)
        if (blocks[b] >= e->p.kv_blocks)
            return kvd_seterr(err, errlen, KVD_ERANGE, "block %u is outside the cache", blocks[b]);
    if (n == 0)
        return 0;
    if (kcuda_set_device(e->device))
        return kvd_seterr(err, errlen, KVD_EINTERNAL, "gpu engine: %s", kcuda_last_error());
    /* the block ids go through the step's table buffers: every step uploads
     * its own tables before reading them */
    if (tables_reserve(e, n))
        return kvd_seterr(err, errlen, KVD_ENOMEM, "gpu engine: out of memory for block ids");
    memcpy(e->tables_host, blocks, (size_t)n * sizeof(uint32_t));
    int rc = kcuda_upload_async(e->tables_dev, e->tables_host, (size_t)n * sizeof(uint32_t), e->stream);
    for (uint32_t l = 0; rc == 0 && l < c->n_layer; l++) {
        const struct kcuda_kv_shift_args a = {
            .kv = layer_kv(e, l), .blocks = e->tables_dev, .n_blocks = (int)n, .delta = delta,
            .step = e->layers[l].rope_step, .neox = c->rope_neox,
        };
        rc = kcuda_kv_shift(&a, e->stream);
    }
    return window_done(e, rc, "KV shift", err, errlen);
}
