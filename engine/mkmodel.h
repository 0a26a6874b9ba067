/*
 * mkmodel.h - writes small random llama models as GGUF files.
 *
 * Tests and benchmarks that need a model but not real weights use these:
 * a valid llama-architecture GGUF, as llama.cpp would read it, with random
 * weights of any weight type kvd supports (quantized from random floats with
 * kernels/quant.c) and a small GPT-2 byte-level BPE vocabulary:
 *
 *   id 0, 1, 2     <|endoftext|>, <|im_start|>, <|im_end|>  (control, type 3)
 *   id 3 .. 258    the 256 byte tokens, byte b at id 3 + b, spelled with
 *                  GPT-2's byte-to-unicode map (normal, type 1)
 *   id 259 ..      merged tokens, one per merge, in merge order: first the
 *                  merges BPE training finds on a built-in English text,
 *                  then random pairs of earlier tokens until n_vocab.
 *
 * bos = <|im_start|> (1), eos = <|im_end|> (2), unk = <|endoftext|> (0),
 * add_bos false, and SmolLM2's ChatML chat template, as the default model
 * has them. The output depends only on the parameters (seed included).
 * With gemma3 set, the same vocabulary in a gemma3 file: its keys (the head
 * width and the sliding window included) and its four extra norms a layer.
 */
#ifndef KVD_MKMODEL_H
#define KVD_MKMODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf_write.h"

#define MKMODEL_N_SPECIAL 3
#define MKMODEL_MIN_VOCAB (MKMODEL_N_SPECIAL + 256)

struct mkmodel_params {
    uint32_t n_layer;           /* transformer blocks, 1..512 */
    uint32_t n_embd;            /* hidden size; a multiple of wtype's and embd_type's block */
    uint32_t n_head;            /* query heads; divides n_embd, with an even head dim */
    uint32_t n_head_kv;         /* key/value heads; divides n_head */
    uint32_t n_ff;              /* feed-forward size; a multiple of wtype's block */
    uint32_t n_vocab;           /* vocabulary size, MKMODEL_MIN_VOCAB..1048576 */
    uint32_t n_ctx;             /* llama.context_length */
    float rope_freq_base;       /* llama.rope.freq_base */
    float rms_eps;              /* llama.attention.layer_norm_rms_epsilon */
    uint32_t wtype;             /* enum kern_type of the layer matrices */
    uint32_t embd_type;         /* type of token_embd.weight (and output.weight) */
    bool tied;                  /* true: no output.weight (output reuses token_embd) */
    uint64_t seed;              /* every random choice derives from it */
    const char *chat_template;  /* NULL: SmolLM2's ChatML template */
    bool gemma3;                /* a gemma3 file: Q/K and post norms, the gemma3.* keys (the
                                 * vocabulary stays this file's GPT-2 BPE) */
    uint32_t head_dim;          /* gemma3: the heads' width (any even size); 0: n_embd / n_head */
    uint32_t swa_window;        /* gemma3: gemma3.attention.sliding_window */
};

/* 2 layers, 64 wide, 4 heads (2 KV), ff 128, vocab 512, ctx 256, rope base
 * 10000, eps 1e-5, Q4_1 layers, Q8_0 embeddings, tied, seed 1. */
struct mkmodel_params mkmodel_default_params(void);

/* SmolLM2-Instruct's chat template, the default of the models written here. */
const char *mkmodel_default_chat_template(void);

/* Checks the parameters: 0, or KVD_EINVAL with the reason in err. */
int mkmodel_check(const struct mkmodel_params *p, char *err, size_t errlen);

/* Builds the model into a new writer (*out, which the caller destroys).
 * Returns 0, KVD_EINVAL (bad parameters) or KVD_ENOMEM, with the reason in
 * err. */
int mkmodel_build(const struct mkmodel_params *p, gguf_writer_t **out, char *err, size_t errlen);

/* Builds the model and writes it to path. Returns 0, KVD_EINVAL, KVD_ENOMEM
 * or KVD_EIO, with a one-line reason in err. */
int mkmodel_write(const struct mkmodel_params *p, const char *path, char *err, size_t errlen);

#endif
