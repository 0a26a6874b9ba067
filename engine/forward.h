/*
 * forward.h - one forward step of a llama-family model over a paged KV cache.
 *
 * A step takes a batch of sequences; each contributes a chunk of new tokens
 * (a prefill chunk, or one decode token) at its own position, with its own
 * block table. Every weight matrix is read once per step for the whole batch
 * (rows outer, tokens inner). The chunk's keys and values are written into the
 * cache before attention reads them back, so a token's logits depend only on
 * its sequence's tokens: not on what else is in the batch, nor on how the
 * sequence was cut into chunks, bit for bit (the numerics contract the prefix
 * cache relies on).
 */
#ifndef KVD_FORWARD_H
#define KVD_FORWARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvcache.h"
#include "model.h"

struct fwd_seq {
    const int32_t *tokens;  /* n_tokens new token ids */
    uint32_t n_tokens;      /* >= 1 */
    uint32_t pos;           /* position of tokens[0]: tokens already cached */
    const uint32_t *blocks; /* block table: logical block -> physical id */
    uint32_t n_blocks;      /* entries; must cover pos + n_tokens positions */
    bool all_logits;        /* logits for every new token, else the last only */
    const uint32_t *const *tables; /* a cache of several parts (kvparts.h): each part's table of
                             * n_blocks entries (tables[0] == blocks); entries a windowed
                             * part no longer reads may be POOL_NONE. NULL: one part */
};

struct engine_params {
    uint32_t max_tokens;    /* most tokens in one step (scratch size), default 512 */
    uint32_t max_ctx;       /* longest sequence, default the model's training context */
    int n_threads;          /* 0: the CPU count */
    uint32_t attn_chunk;    /* longer contexts are cut into ranges of this many positions,
                             * spread over threads and merged; 0: 1024 (rounded up to whole
                             * KV blocks) */
    uint32_t share_shift;   /* tests: thread i starts with the share of the work that an even
                             * split gives thread (i + share_shift) % threads, so that every
                             * share runs on another thread than its owner; 0: its own */
};

struct engine_params engine_default_params(void);

typedef struct engine engine_t;

/* Creates scratch and threads for model m over cache kv (both borrowed; they
 * must outlive the engine). NULL + err on bad parameters or no memory. */
engine_t *engine_new(const model_t *m, kvcache_t *kv, const struct engine_params *p,
                     char *err, size_t errlen);

void engine_destroy(engine_t **e);

/* What a step's batch is checked against. */
struct fwd_limits {
    uint32_t max_ctx;       /* positions a sequence may reach */
    uint32_t max_tokens;    /* tokens in one step */
    uint32_t block_tokens;  /* positions per KV block */
    uint32_t n_blocks;      /* blocks in the cache */
    uint32_t n_vocab;       /* token ids are below this */
    const struct kv_parts *parts; /* the cache's parts; NULL: one */
};

/* The checks every engine (CPU and GPU) makes before a step, with the same
 * messages: 0 with the step's tokens, logits rows and block-table entries
 * (tables may be NULL); else KVD_EINVAL (empty batch or sequence),
 * KVD_ETOOLONG (past max_ctx) or KVD_ERANGE (short table, block or token
 * id out of range, too many tokens) and the reason in err. */
int fwd_check_batch(const struct fwd_limits *lim, const struct fwd_seq *seqs, uint32_t n_seqs,
                    uint32_t *T_out, uint32_t *rows_out, uint64_t *tables_out, char *err, size_t errlen);

/*
 * Runs one step. Returns 0 and points *logits at n_rows rows of n_vocab
 * floats (sequence order; all_logits sequences give n_tokens rows, others
 * one), valid until the next step. Checks every sequence first and returns
 * KVD_ERANGE (bad token id, block id, too many tokens) or KVD_ETOOLONG
 * (past max_ctx) without touching the cache.
 */
int engine_step(engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                const float **logits, uint32_t *n_rows, char *err, size_t errlen);

/*
 * Moves the keys of a sequence's logical blocks [first, first + n) by delta
 * positions (negative: earlier), for a sequence whose older blocks were
 * dropped (context windowing, prefix_seq_window): each K row of every layer
 * and KV head is read back as floats (un-rotated where the cache rotates K),
 * turned by RoPE's angles for delta at that layer's base, and stored again in
 * the cache's type. RoPE's turns compose, so the keys then carry the angles
 * of their new positions, up to the rounding of the cache's type. V does not
 * depend on position and is left alone. tables: the sequence's table of each
 * part of the cache (fwd_seq.tables; entries a windowed part let go,
 * POOL_NONE, are skipped); for a cache of one part, a pointer to its table.
 */
int engine_kv_shift(engine_t *e, const uint32_t *const *tables, uint32_t first, uint32_t n, int32_t delta,
                    char *err, size_t errlen);

const model_t *engine_model(const engine_t *e);
int engine_threads(const engine_t *e);
/* Decode tokens the last step ran together over ranges they share (tiles). */
uint32_t engine_decode_tiled(const engine_t *e);

/* Parallel jobs completed (a few per layer of every step): it grows while a
 * step runs and never goes back, so a watcher can tell a long step from a
 * stuck one. Safe to read from any thread. */
uint64_t engine_progress(const engine_t *e);

#endif
