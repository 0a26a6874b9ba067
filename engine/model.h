/*
 * model.h - a llama-family model: hyperparameters and weights from a GGUF file.
 *
 * Weights stay in the read-only mapping of the file (zero copy); only the small
 * norm vectors are converted to f32 copies. Every tensor's presence, shape and
 * type is checked at load time, so the forward pass can trust them.
 */
#ifndef KVD_MODEL_H
#define KVD_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

enum model_arch {
    MODEL_ARCH_LLAMA = 0,   /* llama: pre-norm blocks, SwiGLU, normal RoPE */
    MODEL_ARCH_GEMMA3 = 1,  /* gemma3: also post-norms, Q/K norms, GELU, NEOX RoPE, sliding windows */
};

struct model_config {
    uint32_t arch;          /* enum model_arch */
    uint32_t n_layer;       /* transformer blocks */
    uint32_t n_embd;        /* hidden size */
    uint32_t n_head;        /* query heads */
    uint32_t n_head_kv;     /* key/value heads (GQA: divides n_head) */
    uint32_t head_dim;      /* per-head size; rotated whole by RoPE */
    uint32_t n_ff;          /* feed-forward hidden size */
    uint32_t n_vocab;       /* output classes = token embedding rows */
    uint32_t n_ctx_train;   /* context length the model was trained for */
    float rope_base;        /* RoPE frequency base */
    float rms_eps;          /* RMSNorm epsilon */
    float rope_base_swa;    /* RoPE base of the windowed layers */
    bool rope_neox;         /* RoPE rotates (x[i], x[i + head_dim/2]) instead of adjacent pairs */
    float attn_scale;       /* scores are q.k * attn_scale */
    float emb_scale;        /* embeddings are multiplied by it (Gemma: sqrt(n_embd)) */
    uint32_t swa_window;    /* windowed layers see the last swa_window positions; 0: none */
    uint32_t swa_pattern;   /* of each swa_pattern layers, all but the last are windowed */
};

/* Whether layer `layer` attends to a sliding window (else to everything). */
bool model_layer_windowed(const struct model_config *c, uint32_t layer);

/* A weight matrix: rows of `cols` elements of `type`, row r at data + r * row_bytes.
 * GGUF ne[0] = cols (the input dimension), ne[1] = rows (the output dimension). */
struct kern_packed;

struct model_mat {
    uint32_t type;          /* enum kern_type */
    int64_t rows;           /* output features */
    int64_t cols;           /* input features */
    size_t row_bytes;       /* bytes per row */
    const void *data;       /* rows * row_bytes, in the file mapping */
    struct kern_packed *packed; /* the same repacked for the fastest path, or NULL (gemm.h) */
};

struct model_layer {
    float *attn_norm;       /* (n_embd) */
    float *q_norm, *k_norm; /* Gemma: per-head RMSNorm of queries and keys (head_dim), else NULL */
    float *post_attn_norm;  /* Gemma: RMSNorm of the attention output (n_embd), else NULL */
    float *post_ffn_norm;   /* Gemma: RMSNorm of the FFN output (n_embd), else NULL */
    struct model_mat wq;    /* (n_head*head_dim, n_embd) */
    struct model_mat wk;    /* (n_head_kv*head_dim, n_embd) */
    struct model_mat wv;    /* (n_head_kv*head_dim, n_embd) */
    struct model_mat wo;    /* (n_embd, n_head*head_dim) */
    float *ffn_norm;        /* (n_embd) */
    struct model_mat w_gate;/* (n_ff, n_embd) */
    struct model_mat w_up;  /* (n_ff, n_embd) */
    struct model_mat w_down;/* (n_embd, n_ff) */
};

typedef struct model {
    struct model_config cfg;
    gguf_ctx_t *gguf;           /* owned; holds the mapping the weights live in */
    struct model_mat tok_embd;  /* (n_vocab, n_embd) */
    struct model_mat output;    /* (n_vocab, n_embd); tok_embd when tied */
    float *output_norm;         /* (n_embd) */
    struct model_layer *layers; /* n_layer entries */
    uint64_t weight_bytes;      /* bytes of all weight matrices */
    uint64_t packed_bytes;      /* bytes of their repacked copies (owned) */
} model_t;

/* Loads a llama-family GGUF. Returns NULL with a one-line reason in err on an
 * unreadable or corrupt file, an unknown architecture, a missing or misshapen
 * tensor, or a tensor type kvd cannot compute with. */
model_t *model_load(const char *path, char *err, size_t errlen);

/* The same without the packed copies of the weights (gemm.h): for processes
 * that read the model's metadata, tokenizer and fingerprint but never run
 * its products (the coordinator). Products on such a model take the slower
 * in-place path. */
model_t *model_load_unpacked(const char *path, char *err, size_t errlen);

/* Same, taking ownership of an already parsed GGUF (closed on failure too). */
model_t *model_from_gguf(gguf_ctx_t **g, char *err, size_t errlen);

/* The model's identity: XXH3-128 over every tensor's name, type, shape and
 * data, so two files with different weights never share a KV pool. Reads all
 * weights once (tens of milliseconds for the default model). */
void model_fingerprint(const model_t *m, uint8_t out[16]);

/* Frees the model and unmaps its file; accepts NULL and sets *m to NULL. */
void model_destroy(model_t **m);

#endif
