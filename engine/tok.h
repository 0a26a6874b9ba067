/*
 * tok.h - the tokenizers of kvd: GPT-2 byte-level BPE and SentencePiece BPE.
 *
 * Text becomes token ids the way llama.cpp makes them, so that the same prompt
 * hits the same cached KV blocks whichever front end tokenized it. Two models,
 * as tokenizer.ggml.model names them:
 *
 * "gpt2" (byte-level BPE, llama.cpp's BPE tokenizer):
 *   1. special tokens: control and unknown tokens (when parse_special) and
 *      user-defined tokens (always) are cut out of the text, longest first;
 *   2. each stretch of text between them is split into words by the model's
 *      pre-tokenizer (a hand-written matcher per pre-tokenizer regex);
 *   3. each word's bytes are mapped through GPT-2's bytes_to_unicode table and
 *      merged pairwise by rank (lowest rank first, leftmost on ties);
 *   4. each final symbol is looked up; one that is not a token falls back to
 *      one token per byte.
 *
 * "llama" (SentencePiece BPE, llama.cpp's SPM tokenizer; Llama 2, Gemma):
 *   1. special tokens are cut out as above;
 *   2. each stretch of text gets a leading space when add_space_prefix is on
 *      and it starts the text or follows a special token; every ' ' becomes
 *      U+2581; the text splits into UTF-8 characters (by lead byte: bytes that
 *      are not UTF-8 stay apart, they are not replaced);
 *   3. adjacent symbols merge while their concatenation is a token, the pair
 *      whose token has the highest score first (leftmost on ties);
 *   4. each final symbol is its token, or else one <0xXX> byte token per byte
 *      (the unknown token where a byte has none).
 *
 * The vocabulary comes from GGUF metadata (tokenizer.ggml.*) or from plain
 * arrays (struct tok_vocab). A tok_t is immutable once built: every function
 * taking a const tok_t * may run in several threads at once.
 */
#ifndef KVD_TOK_H
#define KVD_TOK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

/* Token types, as tokenizer.ggml.token_type stores them. */
enum tok_type {
    TOK_TYPE_UNDEFINED = 0,
    TOK_TYPE_NORMAL = 1,
    TOK_TYPE_UNKNOWN = 2,
    TOK_TYPE_CONTROL = 3,
    TOK_TYPE_USER_DEFINED = 4,
    TOK_TYPE_UNUSED = 5,
    TOK_TYPE_BYTE = 6,
};

/* Tokenizer models, as tokenizer.ggml.model names them. */
enum tok_model {
    TOK_MODEL_GPT2 = 0,         /* "gpt2": byte-level BPE with merge rules */
    TOK_MODEL_SPM = 1,          /* "llama": SentencePiece BPE with token scores */
};

/* A vocabulary as plain arrays. Everything is borrowed for the duration of
 * tok_new() only: the tokenizer copies what it keeps. */
struct tok_vocab {
    enum tok_model model;       /* how text becomes tokens; TOK_MODEL_GPT2 after tok_vocab_init */
    size_t n_tokens;            /* entries in texts (and types, scores) */
    const char *const *texts;   /* token texts as the vocabulary spells them ("Ġthe", "▁the") */
    const size_t *text_lens;    /* n_tokens byte lengths, or NULL: texts are NUL-terminated */
    const int32_t *types;       /* n_tokens TOK_TYPE_* values, or NULL: all NORMAL */
    const float *scores;        /* SPM: n_tokens scores, higher merges first; NULL: all 0 */
    size_t n_merges;            /* GPT2: entries in merges (SPM: must be 0) */
    const char *const *merges;  /* GPT2: merge rules "A B", rank = index (0 merges first) */
    const size_t *merge_lens;   /* n_merges byte lengths, or NULL: NUL-terminated */
    const char *pre;            /* GPT2: pre-tokenizer (tokenizer.ggml.pre), NULL = "default";
                                   SPM: ignored, as llama.cpp ignores it */
    int32_t bos;                /* begin-of-sequence id, or -1 */
    int32_t eos;                /* end-of-sequence id, or -1 */
    int32_t eot;                /* end-of-turn id, or -1 */
    int32_t eom;                /* end-of-message id, or -1 */
    int32_t unk;                /* unknown-token id, or -1 */
    int32_t pad;                /* padding id, or -1 */
    int add_bos;                /* 1 or 0; -1 = the default (SPM: 1; GPT2: the pre-tokenizer's) */
    int add_space_prefix;       /* SPM: 1 or 0, -1 = the default (1); GPT2: ignored */
};

typedef struct tok tok_t;

/* Sets every field of v to "absent": model GPT2, no arrays, ids -1, add_bos
 * and add_space_prefix -1. */
void tok_vocab_init(struct tok_vocab *v);

/* Builds a tokenizer from plain arrays. Checks everything: the model known, ids
 * in range, token types known, every merge of the form "A B" with A and B
 * tokens (GPT2), no merges (SPM), the pre-tokenizer supported (GPT2). Returns
 * NULL with a one-line reason in err (which may be NULL) on failure. */
tok_t *tok_new(const struct tok_vocab *v, char *err, size_t errlen);

/* Builds a tokenizer from the tokenizer.ggml.* metadata of a GGUF file:
 * model ("gpt2" or "llama"), tokens, token_type, the bos / eos / eot / eom /
 * unknown / padding ids and add_bos_token; for "gpt2" also pre and merges; for
 * "llama" also scores (float32 or int32) and add_space_prefix, with llama.cpp's
 * defaults bos 1, eos 2, unknown 0 for ids the file does not give. The
 * tokenizer keeps no pointer into g. Returns NULL with a reason in err on
 * failure. */
tok_t *tok_new_from_gguf(const gguf_ctx_t *g, char *err, size_t errlen);

/* Frees the tokenizer; accepts NULL and sets *t to NULL. */
void tok_destroy(tok_t **t);

/* Tokenizes text[0..len) into out[0..cap). Any bytes are accepted. GPT2: as
 * in llama.cpp, each byte that does not decode as UTF-8 is tokenized as U+FFFD
 * and an overlong form as its shortest form, so only valid UTF-8 decodes back
 * to itself (and only where the vocabulary has a token for every byte the
 * text uses: SmolLM2 has none for 0xF5..0xFF and some control bytes, which
 * are dropped, as in llama.cpp). SPM: bytes are kept as they are and fall back
 * to byte tokens (to the unknown token where the byte has none, to nothing
 * where there is no unknown token either). With parse_special, control and
 * unknown tokens written in the text become their ids; without it they are
 * tokenized as plain text (user-defined tokens are matched either way, as in
 * llama.cpp). No BOS is
 * added: see tok_add_bos(). Returns 0 with *n_out ids written, KVD_ERANGE
 * when cap is too small (out holds the first cap ids, *n_out the count
 * needed), KVD_EINVAL for bad arguments, KVD_ENOMEM. */
int tok_encode(const tok_t *t, const char *text, size_t len, bool parse_special,
               int32_t *out, size_t cap, size_t *n_out);

/* Splits text[0..len) into the pre-tokenizer's words, with no special-token
 * handling: ends[i] is the byte offset where word i ends (words are
 * contiguous and cover the text). SPM has no pre-tokenizer: a non-empty text
 * is one word. Returns 0, or KVD_ERANGE with *n_out the count needed when cap
 * is too small, KVD_EINVAL, KVD_ENOMEM. */
int tok_pretokenize(const tok_t *t, const char *text, size_t len,
                    size_t *ends, size_t cap, size_t *n_out);

/* Writes the bytes that token id stands for into buf[0..cap): for normal
 * tokens the byte-level mapping reversed (GPT2) or the text with U+2581 as ' '
 * (SPM); the text itself for control, unknown and user-defined tokens; for
 * byte tokens their byte (SPM) or nothing (GPT2); nothing for unused and
 * undefined tokens. The bytes need not be valid UTF-8 alone (a token may hold
 * part of a character). Not NUL-terminated. Returns 0 with *n bytes written,
 * KVD_ERANGE with *n the size needed when cap is too small, KVD_EINVAL when
 * id is not a token. */
int tok_decode_piece(const tok_t *t, int32_t id, char *buf, size_t cap, size_t *n);

/* Concatenates the pieces of ids[0..n_ids) into buf[0..cap), same contract
 * as tok_decode_piece (on KVD_ERANGE *n is the total size needed). As in
 * llama.cpp's detokenizer, an SPM vocabulary with add_space_prefix drops one
 * leading space of the first piece (the one tokenizing added). */
int tok_decode(const tok_t *t, const int32_t *ids, size_t n_ids, char *buf, size_t cap,
               size_t *n);

size_t tok_n_vocab(const tok_t *t);
int32_t tok_bos(const tok_t *t);            /* -1 when the model has none */
int32_t tok_eos(const tok_t *t);            /* -1 when the model has none */
int32_t tok_eot(const tok_t *t);            /* end of turn (key, or found by text); -1 if none */
int32_t tok_unk(const tok_t *t);            /* -1 when the model has none */
int32_t tok_pad(const tok_t *t);            /* -1 when the model has none */

/* True when the caller should put tok_bos() before a prompt. */
bool tok_add_bos(const tok_t *t);

/* The canonical name of the pre-tokenizer in use ("smollm", "default", ...;
 * always "default" for SPM). */
const char *tok_pre_name(const tok_t *t);

/* The tokenizer model: TOK_MODEL_GPT2 or TOK_MODEL_SPM. */
enum tok_model tok_model_kind(const tok_t *t);

/* SPM: true when a space is put before text that starts the input or follows
 * a special token. Always false for GPT2. */
bool tok_add_space_prefix(const tok_t *t);

/* True when id ends generation: the eos, eot and eom ids, and tokens whose
 * text is one of llama.cpp's end-of-generation texts (<|endoftext|>,
 * <|im_end|>, <|eot_id|>, <|end_of_text|>, <end_of_turn>, <|end|>, ...).
 * False for ids out of range. */
bool tok_is_eog(const tok_t *t, int32_t id);

/* The token's type (enum tok_type), or -1 for ids out of range. Tokens whose
 * text marks end of generation count as CONTROL whatever the file says, as in
 * llama.cpp. */
int tok_type(const tok_t *t, int32_t id);

/* Returns the id of the token whose text is exactly text (NUL-terminated, as
 * the vocabulary spells it: "Ġthe" for GPT2, "▁the" for SPM), or -1. When
 * several tokens share a text the last one wins, as in llama.cpp. */
int32_t tok_find(const tok_t *t, const char *text);

/* Returns the stored text of token id (as the vocabulary spells it, not
 * NUL-terminated) and its length in *len; NULL for ids out of range. Lives as
 * long as t. */
const char *tok_text(const tok_t *t, int32_t id, size_t *len);

#endif
