/*
 * tok.h - the GPT-2 byte-level BPE tokenizer of kvd.
 *
 * Text becomes token ids the way llama.cpp's BPE tokenizer makes them, so
 * that the same prompt hits the same cached KV blocks whichever front end
 * tokenized it:
 *
 *   1. special tokens: control and unknown tokens (when parse_special) and
 *      user-defined tokens (always) are cut out of the text, longest first;
 *   2. each stretch of text between them is split into words by the model's
 *      pre-tokenizer (a hand-written matcher per pre-tokenizer regex);
 *   3. each word's bytes are mapped through GPT-2's bytes_to_unicode table and
 *      merged pairwise by rank (lowest rank first, leftmost on ties);
 *   4. each final symbol is looked up; one that is not a token falls back to
 *      one token per byte.
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

/* A vocabulary as plain arrays. Everything is borrowed for the duration of
 * tok_new() only: the tokenizer copies what it keeps. */
struct tok_vocab {
    size_t n_tokens;            /* entries in texts (and types) */
    const char *const *texts;   /* token texts in byte-level form ("Ġthe") */
    const size_t *text_lens;    /* n_tokens byte lengths, or NULL: texts are NUL-terminated */
    const int32_t *types;       /* n_tokens TOK_TYPE_* values, or NULL: all NORMAL */
    size_t n_merges;            /* entries in merges */
    const char *const *merges;  /* merge rules "A B", rank = index (0 merges first) */
    const size_t *merge_lens;   /* n_merges byte lengths, or NULL: NUL-terminated */
    const char *pre;            /* pre-tokenizer name (tokenizer.ggml.pre), NULL = "default" */
    int32_t bos;                /* begin-of-sequence id, or -1 */
    int32_t eos;                /* end-of-sequence id, or -1 */
    int32_t eot;                /* end-of-turn id, or -1 */
    int32_t eom;                /* end-of-message id, or -1 */
    int32_t unk;                /* unknown-token id, or -1 */
    int32_t pad;                /* padding id, or -1 */
    int add_bos;                /* 1 or 0; -1 = the pre-tokenizer's default */
};

typedef struct tok tok_t;

/* Sets every field of v to "absent": no arrays, ids -1, add_bos -1. */
void tok_vocab_init(struct tok_vocab *v);

/* Builds a tokenizer from plain arrays. Checks everything: ids in range, token
 * types known, every merge of the form "A B" with A and B tokens, the
 * pre-tokenizer supported. Returns NULL with a one-line reason in err (which
 * may be NULL) on failure. */
tok_t *tok_new(const struct tok_vocab *v, char *err, size_t errlen);

/* Builds a tokenizer from the tokenizer.ggml.* metadata of a GGUF file:
 * model (must be "gpt2"), pre, tokens, token_type, merges, the bos / eos /
 * eot / eom / unknown / padding ids and add_bos_token. The tokenizer keeps no
 * pointer into g. Returns NULL with a reason in err on failure. */
tok_t *tok_new_from_gguf(const gguf_ctx_t *g, char *err, size_t errlen);

/* Frees the tokenizer; accepts NULL and sets *t to NULL. */
void tok_destroy(tok_t **t);

/* Tokenizes text[0..len) into out[0..cap). Any bytes are accepted; as in
 * llama.cpp, each byte that does not decode as UTF-8 is tokenized as U+FFFD
 * and an overlong form as its shortest form, so only valid UTF-8 decodes back
 * to itself (and only where the vocabulary has a token for every byte the
 * text uses: SmolLM2 has none for 0xF5..0xFF and some control bytes, which
 * are dropped, as in llama.cpp). With parse_special, control and unknown tokens written in
 * the text become their ids; without it they are tokenized as plain text
 * (user-defined tokens are matched either way, as in llama.cpp). No BOS is
 * added: see tok_add_bos(). Returns 0 with *n_out ids written, KVD_ERANGE
 * when cap is too small (out holds the first cap ids, *n_out the count
 * needed), KVD_EINVAL for bad arguments, KVD_ENOMEM. */
int tok_encode(const tok_t *t, const char *text, size_t len, bool parse_special,
               int32_t *out, size_t cap, size_t *n_out);

/* Splits text[0..len) into the pre-tokenizer's words, with no special-token
 * handling: ends[i] is the byte offset where word i ends (words are
 * contiguous and cover the text). Returns 0, or KVD_ERANGE with *n_out the
 * count needed when cap is too small, KVD_EINVAL, KVD_ENOMEM. */
int tok_pretokenize(const tok_t *t, const char *text, size_t len,
                    size_t *ends, size_t cap, size_t *n_out);

/* Writes the bytes that token id stands for into buf[0..cap): the byte-level
 * mapping reversed for normal tokens, the text itself for control, unknown and
 * user-defined tokens, nothing for unused, byte and undefined tokens. The
 * bytes need not be valid UTF-8 alone (a token may hold part of a
 * character). Not NUL-terminated. Returns 0 with *n bytes written, KVD_ERANGE with *n the
 * size needed when cap is too small, KVD_EINVAL when id is not a token. */
int tok_decode_piece(const tok_t *t, int32_t id, char *buf, size_t cap, size_t *n);

/* Concatenates the pieces of ids[0..n_ids) into buf[0..cap), same contract
 * as tok_decode_piece (on KVD_ERANGE *n is the total size needed). */
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

/* The canonical name of the pre-tokenizer in use ("smollm", "default", ...). */
const char *tok_pre_name(const tok_t *t);

/* True when id ends generation: the eos, eot and eom ids, and tokens whose
 * text is one of llama.cpp's end-of-generation texts (<|endoftext|>,
 * <|im_end|>, <|eot_id|>, <|end_of_text|>, <end_of_turn>, <|end|>, ...).
 * False for ids out of range. */
bool tok_is_eog(const tok_t *t, int32_t id);

/* The token's type (enum tok_type), or -1 for ids out of range. Tokens whose
 * text marks end of generation count as CONTROL whatever the file says, as in
 * llama.cpp. */
int tok_type(const tok_t *t, int32_t id);

/* Returns the id of the token whose text is exactly text (NUL-terminated, in
 * the vocabulary's byte-level form), or -1. When several tokens share a text
 * the last one wins, as in llama.cpp. */
int32_t tok_find(const tok_t *t, const char *text);

/* Returns the stored text of token id (byte-level form, not NUL-terminated)
 * and its length in *len; NULL for ids out of range. Lives as long as t. */
const char *tok_text(const tok_t *t, int32_t id, size_t *len);

#endif
