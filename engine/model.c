/* model.c - loading and checking llama-family weights from GGUF. */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cpu.h"
#include "err.h"
#include "gemm.h"
#include "ops.h"
#include "quant.h"
#include "types.h"

#include <xxhash.h>

/* "<arch>.<name>", the key of a hyperparameter of the file's architecture. */
static const char *arch_key(char *key, size_t len, const char *arch, const char *name)
{
    snprintf(key, len, "%s.%s", arch, name);
    return key;
}

/* Reads a required u32 hyperparameter "<arch>.<name>". */
static int need_u32(const gguf_ctx_t *g, const char *arch, const char *name, uint32_t *out, char *err,
                    size_t errlen)
{
    char key[128];
    int rc = gguf_get_u32(g, arch_key(key, sizeof(key), arch, name), out);
    if (rc == KVD_ENOTFOUND)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "model: missing metadata %s", key);
    if (rc != 0 || *out == 0 || *out > (1u << 24))
        return kvd_seterr(err, errlen, KVD_EFORMAT, "model: metadata %s is invalid", key);
    return 0;
}

/* An optional f32 hyperparameter in (lo, hi): 0 (found or absent: *out kept), or an error. */
static int opt_f32(const gguf_ctx_t *g, const char *arch, const char *name, float lo, float hi, float *out,
                   char *err, size_t errlen)
{
    char key[128];
    arch_key(key, sizeof(key), arch, name);
    if (gguf_find(g, key) == NULL)
        return 0;
    if (gguf_get_f32(g, key, out) != 0 || !(*out > lo && *out < hi))
        return kvd_seterr(err, errlen, KVD_EFORMAT, "model: metadata %s is invalid", key);
    return 0;
}

static int read_config(const gguf_ctx_t *g, struct model_config *c, char *err, size_t errlen)
{
    struct gguf_str as;
    if (gguf_get_str(g, "general.architecture", &as) != 0)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "model: missing general.architecture");
    const char *arch;
    if (gguf_str_eq(as, "llama")) {
        c->arch = MODEL_ARCH_LLAMA;
        arch = "llama";
    } else if (gguf_str_eq(as, "gemma3")) {
        c->arch = MODEL_ARCH_GEMMA3;
        arch = "gemma3";
    } else {
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "model: architecture '%.*s' is not supported (llama, gemma3)",
                          (int)(as.len > 64 ? 64 : as.len), as.ptr);
    }
    int rc;
    char key[128];
    if ((rc = need_u32(g, arch, "block_count", &c->n_layer, err, errlen)) ||
        (rc = need_u32(g, arch, "embedding_length", &c->n_embd, err, errlen)) ||
        (rc = need_u32(g, arch, "attention.head_count", &c->n_head, err, errlen)) ||
        (rc = need_u32(g, arch, "feed_forward_length", &c->n_ff, err, errlen)) ||
        (rc = need_u32(g, arch, "context_length", &c->n_ctx_train, err, errlen)))
        return rc;
    c->n_head_kv = c->n_head;
    if (gguf_find(g, arch_key(key, sizeof(key), arch, "attention.head_count_kv")) != NULL &&
        (rc = need_u32(g, arch, "attention.head_count_kv", &c->n_head_kv, err, errlen)))
        return rc;
    if (c->n_head % c->n_head_kv != 0)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "model: %u query heads are not a multiple of %u KV heads",
                          c->n_head, c->n_head_kv);
    uint32_t v;
    if (c->arch == MODEL_ARCH_GEMMA3) {
        /* Gemma's heads are as wide as the file says (256 with 640 wide
         * hidden states), and K and V alike */
        uint32_t vl;
        if ((rc = need_u32(g, arch, "attention.key_length", &c->head_dim, err, errlen)) ||
            (rc = need_u32(g, arch, "attention.value_length", &vl, err, errlen)))
            return rc;
        if (vl != c->head_dim)
            return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "model: key length %u differs from value length %u",
                              c->head_dim, vl);
    } else {
        if (c->n_embd % c->n_head != 0)
            return kvd_seterr(err, errlen, KVD_EFORMAT,
                              "model: hidden size %u is not a multiple of %u heads", c->n_embd, c->n_head);
        c->head_dim = c->n_embd / c->n_head;
        if (gguf_get_u32(g, arch_key(key, sizeof(key), arch, "attention.key_length"), &v) == 0 &&
            v != c->head_dim)
            return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                              "model: key length %u differs from hidden/heads (%u)", v, c->head_dim);
    }
    if (gguf_get_u32(g, arch_key(key, sizeof(key), arch, "rope.dimension_count"), &v) == 0 && v != c->head_dim)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "model: partial RoPE (%u of %u dims) is not supported", v, c->head_dim);
    if (c->head_dim % 2 != 0)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "model: head size %u is odd", c->head_dim);
    if (c->head_dim > KERN_MAX_HEAD_DIM)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "model: head size %u is larger than %d",
                          c->head_dim, KERN_MAX_HEAD_DIM);
    c->rope_base = 10000.0f;
    if ((rc = opt_f32(g, arch, "rope.freq_base", 1.0f, 1e12f, &c->rope_base, err, errlen)))
        return rc;
    c->rope_base_swa = c->rope_base;
    c->rms_eps = 1e-5f;
    if ((rc = opt_f32(g, arch, "attention.layer_norm_rms_epsilon", 0.0f, 1.0f, &c->rms_eps, err, errlen)))
        return rc;
    struct gguf_str st;
    if (gguf_get_str(g, arch_key(key, sizeof(key), arch, "rope.scaling.type"), &st) == 0 &&
        !gguf_str_eq(st, "none"))
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "model: RoPE scaling '%.*s' is not supported",
                          (int)(st.len > 32 ? 32 : st.len), st.ptr);
    c->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    c->emb_scale = 1.0f;
    if (c->arch == MODEL_ARCH_GEMMA3) {
        /* As llama.cpp's loader has it (the file names only the window):
         * every sixth layer attends to everything, the five before it to a
         * window of `sliding_window` positions with RoPE base 10,000; RoPE
         * rotates the halves (NEOX); embeddings are scaled by sqrt(n_embd);
         * queries by 1/sqrt(head_dim) (Gemma 3 27B, which scales by
         * 1/sqrt(n_embd / n_head), has 62 layers: refused below). */
        if ((rc = need_u32(g, arch, "attention.sliding_window", &c->swa_window, err, errlen)))
            return rc;
        if (gguf_find(g, arch_key(key, sizeof(key), arch, "final_logit_softcapping")) != NULL)
            return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "model: final logit soft-capping is not supported");
        if (c->n_layer == 62)
            return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "model: Gemma 3 27B's attention scale is not supported");
        c->swa_pattern = 6;
        c->rope_base_swa = 10000.0f;
        c->rope_neox = true;
        c->emb_scale = sqrtf((float)c->n_embd);
    }
    return 0;
}

bool model_layer_windowed(const struct model_config *c, uint32_t layer)
{
    return c->swa_window > 0 && c->swa_pattern > 0 && layer % c->swa_pattern < c->swa_pattern - 1;
}

/* Finds tensor `name` and checks it is a (rows x cols) matrix of a usable type. */
static int get_mat(const gguf_ctx_t *g, const char *name, int64_t rows, int64_t cols,
                   struct model_mat *m, char *err, size_t errlen)
{
    const struct gguf_tensor *t = gguf_find_tensor(g, name);
    if (t == NULL)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "model: missing tensor %s", name);
    if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != 1 || t->ne[3] != 1)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "model: tensor %s is %lldx%lld, expected %lldx%lld", name,
                          (long long)t->ne[0], (long long)t->ne[1], (long long)cols, (long long)rows);
    const struct kern_type_info *ti = kern_type_info(t->type);
    if (ti == NULL || !ti->weight_ok)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "model: tensor %s has type %s, which kvd does not support",
                          name, ti ? ti->name : "unknown");
    m->type = t->type;
    m->rows = rows;
    m->cols = cols;
    m->row_bytes = kern_row_bytes(t->type, cols);
    m->data = t->data;
    return 0;
}

/* Reads a 1-D weight of n elements into a new f32 array. */
static int get_vec(const gguf_ctx_t *g, const char *name, int64_t n, float **out,
                   char *err, size_t errlen)
{
    struct model_mat m = { 0 };
    int rc = get_mat(g, name, 1, n, &m, err, errlen);
    if (rc)
        return rc;
    *out = malloc((size_t)n * sizeof(float));
    if (*out == NULL)
        return kvd_seterr(err, errlen, KVD_ENOMEM, "model: out of memory");
    if (kern_dequantize_row(m.type, m.data, *out, n) != 0)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "model: cannot read tensor %s", name);
    return 0;
}

static int load_layer(const gguf_ctx_t *g, const struct model_config *c, uint32_t i,
                      struct model_layer *L, char *err, size_t errlen)
{
    char nm[96];
    int64_t e = c->n_embd, q = (int64_t)c->n_head * c->head_dim;
    int64_t kv = (int64_t)c->n_head_kv * c->head_dim, ff = c->n_ff;
    int rc;
#define NAME(s) (snprintf(nm, sizeof(nm), "blk.%u." s, i), nm)
    if (c->arch == MODEL_ARCH_GEMMA3 &&
        ((rc = get_vec(g, NAME("attn_q_norm.weight"), c->head_dim, &L->q_norm, err, errlen)) ||
         (rc = get_vec(g, NAME("attn_k_norm.weight"), c->head_dim, &L->k_norm, err, errlen)) ||
         (rc = get_vec(g, NAME("post_attention_norm.weight"), e, &L->post_attn_norm, err, errlen)) ||
         (rc = get_vec(g, NAME("post_ffw_norm.weight"), e, &L->post_ffn_norm, err, errlen))))
        return rc;
    if ((rc = get_vec(g, NAME("attn_norm.weight"), e, &L->attn_norm, err, errlen)) ||
        (rc = get_mat(g, NAME("attn_q.weight"), q, e, &L->wq, err, errlen)) ||
        (rc = get_mat(g, NAME("attn_k.weight"), kv, e, &L->wk, err, errlen)) ||
        (rc = get_mat(g, NAME("attn_v.weight"), kv, e, &L->wv, err, errlen)) ||
        (rc = get_mat(g, NAME("attn_output.weight"), e, q, &L->wo, err, errlen)) ||
        (rc = get_vec(g, NAME("ffn_norm.weight"), e, &L->ffn_norm, err, errlen)) ||
        (rc = get_mat(g, NAME("ffn_gate.weight"), ff, e, &L->w_gate, err, errlen)) ||
        (rc = get_mat(g, NAME("ffn_up.weight"), ff, e, &L->w_up, err, errlen)) ||
        (rc = get_mat(g, NAME("ffn_down.weight"), e, ff, &L->w_down, err, errlen)))
        return rc;
#undef NAME
    return 0;
}

static uint64_t mat_bytes(const struct model_mat *m) { return (uint64_t)m->rows * m->row_bytes; }

/* Repacks one matrix for the products' fastest path, when there is one, and
 * lets the kernel drop the file pages it no longer reads (they come back
 * from the page cache if a slower path is asked for later). */
static void pack_mat(model_t *m, struct model_mat *w)
{
    if (kern_isa() >= KERN_ISA_SIMD)
        w->packed = kern_pack(w->type, w->data, w->row_bytes, w->rows, w->cols);
    if (w->packed == NULL)
        return;
    m->packed_bytes += kern_pack_bytes(w->packed);
    const long page = sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)w->data + (uintptr_t)page - 1) & ~(uintptr_t)(page - 1);
    uintptr_t hi = ((uintptr_t)w->data + (uintptr_t)mat_bytes(w)) & ~(uintptr_t)(page - 1);
    const bool lookups = w->data == m->tok_embd.data;  /* embedding rows are still read */
    if (gguf_is_mapped(m->gguf) && !lookups && hi > lo)
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

/* Every matrix the products read (not the embedding table: its rows are
 * looked up, not multiplied, unless it doubles as the output matrix): packed
 * for the packed products (Q4_0, Q4_1, Q5_0, Q8_0 and the K-quants; x86-64
 * with AVX2 and up, aarch64 with sdot). */
static void pack_weights(model_t *m)
{
    if (kern_isa() < KERN_ISA_SIMD)
        return;
    pack_mat(m, &m->output);
    for (uint32_t i = 0; i < m->cfg.n_layer; i++) {
        struct model_layer *L = &m->layers[i];
        struct model_mat *mats[] = { &L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down };
        for (size_t k = 0; k < sizeof(mats) / sizeof(mats[0]); k++)
            pack_mat(m, mats[k]);
    }
}

static model_t *from_gguf(gguf_ctx_t **gp, bool pack, char *err, size_t errlen)
{
    model_t *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "model: out of memory");
        gguf_close(gp);
        return NULL;
    }
    m->gguf = *gp;
    *gp = NULL;
    const gguf_ctx_t *g = m->gguf;
    struct model_config *c = &m->cfg;
    if (read_config(g, c, err, errlen) != 0)
        goto fail;
    const struct gguf_tensor *te = gguf_find_tensor(g, "token_embd.weight");
    if (te == NULL) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "model: missing tensor token_embd.weight");
        goto fail;
    }
    if (te->ne[1] < 1 || te->ne[1] > (1 << 24)) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "model: token_embd.weight has %lld rows", (long long)te->ne[1]);
        goto fail;
    }
    c->n_vocab = (uint32_t)te->ne[1];
    uint32_t vs;
    if ((gguf_get_u32(g, "llama.vocab_size", &vs) == 0 || gguf_get_u32(g, "gemma3.vocab_size", &vs) == 0) &&
        vs != c->n_vocab) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "model: the vocabulary size %u differs from %u embedding rows",
                   vs, c->n_vocab);
        goto fail;
    }
    if (get_mat(g, "token_embd.weight", c->n_vocab, c->n_embd, &m->tok_embd, err, errlen) ||
        get_vec(g, "output_norm.weight", c->n_embd, &m->output_norm, err, errlen))
        goto fail;
    if (gguf_find_tensor(g, "output.weight") != NULL) {
        if (get_mat(g, "output.weight", c->n_vocab, c->n_embd, &m->output, err, errlen))
            goto fail;
    } else {
        m->output = m->tok_embd;  /* tied embeddings */
    }
    /* each layer has nine tensors: a forged layer count must not make us
     * allocate for millions of them */
    if (c->n_layer > gguf_n_tensors(g) / 9) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "model: %u layers claimed, but only %llu tensors present",
                   c->n_layer, (unsigned long long)gguf_n_tensors(g));
        goto fail;
    }
    m->layers = calloc(c->n_layer, sizeof(*m->layers));
    if (m->layers == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "model: out of memory");
        goto fail;
    }
    m->weight_bytes = mat_bytes(&m->tok_embd);
    if (m->output.data != m->tok_embd.data)
        m->weight_bytes += mat_bytes(&m->output);
    for (uint32_t i = 0; i < c->n_layer; i++) {
        struct model_layer *L = &m->layers[i];
        if (load_layer(g, c, i, L, err, errlen) != 0)
            goto fail;
        m->weight_bytes += mat_bytes(&L->wq) + mat_bytes(&L->wk) + mat_bytes(&L->wv) +
                           mat_bytes(&L->wo) + mat_bytes(&L->w_gate) + mat_bytes(&L->w_up) +
                           mat_bytes(&L->w_down);
    }
    if (pack)
        pack_weights(m);
    return m;
fail:
    model_destroy(&m);
    return NULL;
}

model_t *model_from_gguf(gguf_ctx_t **gp, char *err, size_t errlen)
{
    return from_gguf(gp, true, err, errlen);
}

static model_t *load(const char *path, bool pack, char *err, size_t errlen)
{
    gguf_ctx_t *g = gguf_open(path, err, errlen);
    if (g == NULL)
        return NULL;
    return from_gguf(&g, pack, err, errlen);
}

model_t *model_load(const char *path, char *err, size_t errlen) { return load(path, true, err, errlen); }

model_t *model_load_unpacked(const char *path, char *err, size_t errlen)
{
    return load(path, false, err, errlen);
}

void model_destroy(model_t **mp)
{
    if (mp == NULL || *mp == NULL)
        return;
    model_t *m = *mp;
    kern_pack_free(&m->output.packed);
    if (m->layers != NULL) {
        for (uint32_t i = 0; i < m->cfg.n_layer; i++) {
            struct model_layer *L = &m->layers[i];
            free(L->attn_norm);
            free(L->ffn_norm);
            free(L->q_norm);
            free(L->k_norm);
            free(L->post_attn_norm);
            free(L->post_ffn_norm);
            struct model_mat *mats[] = { &L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down };
            for (size_t k = 0; k < sizeof(mats) / sizeof(mats[0]); k++)
                kern_pack_free(&mats[k]->packed);
        }
        free(m->layers);
    }
    free(m->output_norm);
    gguf_close(&m->gguf);
    free(m);
    *mp = NULL;
}

void model_fingerprint(const model_t *m, uint8_t out[16])
{
    XXH3_state_t *st = XXH3_createState();
    const gguf_ctx_t *g = m->gguf;
    uint64_t n = gguf_n_tensors(g);
    if (st == NULL || XXH3_128bits_reset(st) != XXH_OK) {
        /* no memory for 600 bytes of state: fall back to the shapes alone */
        uint64_t h = XXH3_64bits(&m->cfg, sizeof(m->cfg));
        memcpy(out, &h, 8);
        memcpy(out + 8, &n, 8);
        XXH3_freeState(st);
        return;
    }
    XXH3_128bits_update(st, &n, sizeof(n));
    for (uint64_t i = 0; i < n; i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        XXH3_128bits_update(st, t->name.ptr, t->name.len);
        XXH3_128bits_update(st, &t->type, sizeof(t->type));
        XXH3_128bits_update(st, &t->n_dims, sizeof(t->n_dims));
        XXH3_128bits_update(st, t->ne, sizeof(t->ne));
        XXH3_128bits_update(st, t->data, t->nbytes);
    }
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(st));
    memcpy(out, c.digest, 16);
    XXH3_freeState(st);
}
