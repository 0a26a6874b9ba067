/*
 * tier.h - the host tier of the prefix cache: blocks that the pool's LRU
 * evicts, kept in host memory so that a later prompt gets them back by a copy
 * instead of a prefill.
 *
 * An entry is one evicted block with its whole identity: its chained key, its
 * parent's key (zero for a chain's first block), its namespace, its token ids
 * and the digest of its whole chain's tokens (prefix.h's path), and the
 * block's bytes in the pool's own KV format. A lookup must present the same
 * five to get the bytes, so an entry can only continue the chain it was cut
 * from, in the namespace it was computed in (a collision of the keyed chain
 * keys alone costs a miss, never wrong K/V). Entries live on their own LRU list inside a
 * byte budget; storing past it drops the least recently used.
 *
 * Every entry carries an XXH3-64 checksum of its stored bytes, checked on
 * the way back: a damaged entry is dropped and counted, a miss, never wrong
 * K/V. Each block is offered to LZ4 (its fast mode) and kept compressed only where
 * that saves at least 1/16 of it: bench-tier found that real K/V does not
 * compress (LZ4 passes such data at 10+ GB/s, so trying costs little), but a
 * block of repeated or zeroed values does.
 *
 * The tier knows nothing of the pool: prefix.h hands it evicted blocks and
 * asks it for missing ones (struct prefix_tier); kvd wires the two together.
 * Its calls may come from several threads (kvd stores on its loop and
 * copies blocks back on a thread of its own); a lock serializes them.
 */
#ifndef KVD_TIER_H
#define KVD_TIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "prefix.h"

typedef struct tier tier_t;

struct tier_stats {
    uint64_t entries;       /* blocks held */
    uint64_t bytes;         /* bytes they take (data as stored, ids, bookkeeping) */
    uint64_t max_bytes;     /* the budget */
    uint64_t compressed;    /* entries kept LZ4-compressed */
    uint64_t raw_bytes;     /* their data before compression, all entries */
    uint64_t stored;        /* blocks stored so far */
    uint64_t hits;          /* lookups that found their block */
    uint64_t misses;        /* lookups that did not */
    uint64_t dropped;       /* entries dropped to make room */
    uint64_t corrupt;       /* entries whose data did not decompress to a block: dropped, a miss */
};

/* A tier of at most max_bytes for blocks of block_tokens ids and block_bytes
 * bytes. NULL with a reason (a budget smaller than one block, no memory). */
tier_t *tier_new(uint64_t max_bytes, uint32_t block_tokens, uint64_t block_bytes, char *err, size_t errlen);

/* Frees every entry; accepts NULL and sets *t to NULL. */
void tier_destroy(tier_t **t);

/* Stores a copy of block b (identity and data, block_bytes). An entry of the
 * same identity is replaced. Drops least recently used entries to stay in the
 * budget. 0, or KVD_ENOMEM (nothing stored). */
int tier_put(tier_t *t, const struct prefix_tier_block *b, const void *data);

/* Copies the data of the entry with b's identity into dst (block_bytes) and
 * makes it the most recently used; false when there is none (or its data
 * failed its checksum or did not decompress to a block: then it is dropped,
 * and dst may have been written). */
bool tier_get(tier_t *t, const struct prefix_tier_block *b, void *dst);

/* Whether an entry with b's identity is held (nothing moves). */
bool tier_has(tier_t *t, const struct prefix_tier_block *b);

void tier_stats(tier_t *t, struct tier_stats *st);

/* Flips a byte of the stored data of the entry with b's identity (tests:
 * what a corrupt entry does); false when there is none. */
bool tier_corrupt_for_test(tier_t *t, const struct prefix_tier_block *b);

/* The same for the most recently stored entry whose key is k. */
bool tier_corrupt_key_for_test(tier_t *t, prefix_key_t k);

#endif
