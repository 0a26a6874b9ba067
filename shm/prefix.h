/*
 * prefix.h - the block allocator and the prefix index of a KV pool.
 *
 * Driven by the pool's owner only (the coordinator; kvd-run in one process):
 * nothing here locks, and nothing else writes the records it keeps in the
 * shared segment (shm/pool.h).
 *
 * Blocks. A block is FREE, PENDING (allocated; its K/V not yet all written) or
 * COMMITTED (full and written). Blocks carry reference counts: one per
 * sequence holding them. An unreferenced committed block that is in the index
 * stays cached on an LRU list; allocation takes free blocks first, then evicts
 * from the LRU tail. Releases push a sequence's blocks last-first, so along
 * every chain a parent is more recent than its children and eviction takes
 * leaves before their parents; the allocator also refuses to evict a block
 * with indexed children (n_children), which the LRU order makes never happen.
 *
 * Keys. Block i of a sequence has key(i) = H(secret, key(i-1), namespace,
 * model fingerprint, tokens of block i), a keyed 128-bit XXH3 over the pool's
 * random secret. A key only finds candidates: a hit also needs the same
 * namespace, the same parent block (itself verified) and the same token ids,
 * so a hash collision costs a miss or a longer chain walk, never wrong K/V.
 *
 * Index. A block enters the index when its tokens are known and it is full:
 * prompt blocks when they are allocated (PENDING: lookups report them so that a
 * second request for the same prefix can wait instead of computing it twice),
 * generated blocks when they are committed. Only the first block of a given
 * content is indexed; a duplicate (computed concurrently, or recomputed because
 * a whole prompt was cached) stays private and so do its successors. A pending
 * block that is released before it is written leaves the index and is freed.
 * Partial last blocks are never indexed or shared.
 *
 * Parts (common/kvparts.h). In a pool of several parts a sequence has a block
 * table per part and logical block i is one block in each. Part 0's blocks
 * (full attention) form the chain above. Block i of another part hangs from
 * part 0's block i: that is its parent, its key is chained from that block's
 * key in a namespace of its part, and it is indexed with it. A windowed part
 * keeps only the blocks its window still reads: once positions [0, n) are
 * written, blocks wholly before n + 1 - W are released (to the cache: a later
 * prompt that ends where the window then was can use them) and the table
 * holds POOL_NONE there. A cached prefix of j blocks is a hit when part 0
 * holds all j and every other part holds the ones a continuation reads (a
 * full part all j, a windowed one its last window); lookups take the longest
 * such j. Releases put a logical block's other parts before its part-0 block,
 * so they are evicted first, and a part-0 block is never evicted while a
 * block hangs from it. Block events (the observer) and the findable set
 * describe part 0 alone.
 *
 * Sequences. The coordinator keeps one struct prefix_seq per running sequence
 * (its own memory) with the block tables it hands to a worker:
 *
 *     prefix_seq_begin   take the longest committed cached prefix
 *     prefix_seq_grow    allocate blocks for more positions (all or nothing)
 *     prefix_seq_commit  K/V of the first n positions are written
 *     prefix_seq_release drop every block (cancel, finish, preemption)
 */
#ifndef KVD_PREFIX_H
#define KVD_PREFIX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pool.h"

typedef struct { uint64_t lo, hi; } prefix_key_t;   /* a 128-bit chained key */
typedef struct { uint64_t lo, hi; } prefix_ns_t;    /* a namespace digest */

/* The key function: key of a block from its parent's key (zero for the first
 * block), namespace, fingerprint and tokens, keyed by the pool's secret. */
typedef prefix_key_t (*prefix_hash_fn)(const uint8_t secret[POOL_SECRET_BYTES],
                                       prefix_key_t parent, prefix_ns_t ns,
                                       const uint8_t fingerprint[16],
                                       const int32_t *tokens, uint32_t n);

/* A running sequence, owned by the caller; zero it, then prefix_seq_begin. */
struct prefix_seq {
    prefix_ns_t ns;         /* cache namespace (tenant) */
    uint32_t *blocks;       /* part 0's block table: logical -> physical id (tables[0]) */
    uint32_t *tables[KV_MAX_PARTS]; /* each part's table (heap, grows); a windowed part's
                             * entries before first[part] are POOL_NONE */
    uint32_t first[KV_MAX_PARTS]; /* the first entry each part still holds */
    uint32_t n_parts;       /* tables in use (the pool's parts) */
    uint32_t n_blocks;      /* logical blocks: entries of every table */
    uint32_t cap;           /* allocated entries of each table */
    uint32_t n_cached;      /* leading blocks taken from the cache by begin */
    uint32_t n_committed;   /* leading blocks committed (cached ones included) */
    uint32_t n_indexed;     /* leading blocks of this sequence that are in the index */
    bool chain_open;        /* later blocks may still be indexed (no duplicate met) */
    prefix_key_t key;       /* key of block n_indexed - 1 */
    uint32_t n_restored;    /* of the n_cached blocks, those begin copied back from a tier */
    uint32_t n_restoring;   /* of those, copies an asynchronous tier still runs (start()):
                             * until prefix_seq_restored, s is not to be used */
    uint16_t owner;         /* who its blocks are taken for (a tenant), 0: no one; set by
                             * the caller, kept across release (prefix_set_owner_limit) */
    uint32_t n_public;      /* its first n_public blocks are keyed in public_ns instead of ns:
                             * a prefix every namespace shares (an operator's public system
                             * prompt), the rest of the chain hanging from it in ns. Set by the
                             * caller before begin (0: none), kept across release */
    prefix_ns_t public_ns;
    uint32_t *held;         /* blocks s still holds off its tables: a window's dropped blocks and
                             * copy sources, until prefix_window_done (or release) */
    uint32_t n_held, held_cap;
    bool pool_only;         /* begin takes only what the pool holds, nothing from a tier (set
                             * by the caller, kept across release) */
};

/* What a lookup found. */
struct prefix_match {
    uint32_t n_blocks;      /* leading committed blocks that match */
    uint32_t pending;       /* the pending block that would continue them, or POOL_NONE */
};

struct prefix_stats {
    uint32_t n_blocks;      /* blocks in the pool */
    uint32_t n_free;        /* never used or reclaimed */
    uint32_t n_cached;      /* committed, unreferenced, kept for reuse */
    uint32_t n_used;        /* committed and referenced */
    uint32_t n_pending;     /* allocated, K/V not all written */
    uint32_t n_indexed;     /* findable by lookups */
    uint64_t block_bytes;   /* KV bytes per block */
    uint64_t evictions;     /* cached blocks reclaimed */
    uint64_t lookups;       /* prefix lookups (prefix_lookup and prefix_seq_begin) */
    uint64_t hit_blocks;    /* committed blocks they found */
    uint64_t collisions;    /* key matches whose contents differed */
    uint64_t restored;      /* blocks copied back from the tier */
};

/* One block as the allocator sees it (for tests and tools). */
struct prefix_block_info {
    prefix_key_t key;       /* its key (meaningful when indexed) */
    uint32_t state;         /* enum pool_block_state */
    uint32_t refs;          /* holders */
    bool indexed;           /* in the index */
    bool on_lru;            /* cached on the LRU list */
    uint32_t parent;        /* parent block when indexed, else POOL_NONE */
    uint32_t n_children;    /* indexed children */
    const int32_t *tokens;  /* block_tokens ids (meaningful when indexed) */
    uint32_t part;          /* indexed: the part whose layers it holds (its parent is part
                             * 0's block of the same positions when part > 0) */
    prefix_ns_t ns;         /* its namespace (meaningful when indexed) */
    uint16_t owner;         /* the owner it was taken for (prefix_seq.owner); 0: none */
    uint32_t hits;          /* times prefix_seq_begin took it from the cache since it was
                             * last free (part 0's blocks; a restored block's copy is no hit) */
};

typedef struct prefix prefix_t;

/* A block's identity below the pool (shm/tier.h): what a tier stores with its
 * bytes, and what a lookup must present to get them back. */
struct prefix_tier_block {
    prefix_key_t key;       /* its chained key */
    prefix_key_t parent;    /* its parent's key; zero for a chain's first block */
    prefix_ns_t ns;         /* its namespace */
    const int32_t *tokens;  /* its block_tokens ids */
    prefix_key_t path;      /* a digest of its namespace and of every token of its chain up to
                             * it (chained XXH3-128, not keyed): the pool verifies a hit by
                             * the parent block itself, a tier by this, so that a collision of
                             * keys alone still misses */
    uint32_t part;          /* 0: a block of part 0 (the chain); else one of another part, whose
                             * parent is part 0's block of the same positions (not identity) */
};

/*
 * A tier below the pool (prefix_set_tier). committed(), when set, gets every
 * block that becomes findable by a commit (a tier that writes blocks through,
 * as the disk tier does), with its K/V (block_bytes, the pool's format);
 * evicted() gets every findable block that eviction takes out of the pool,
 * with its K/V, before the block is reused; has() and fetch() are asked, by
 * prefix_seq_begin, for the blocks that would continue a cached prefix past
 * the pool's, one after another: has() whether fetch() would give the block
 * (before a pool block is taken for it, perhaps by an eviction), fetch() to
 * copy its bytes into dst (true), or not after all (false). Restored blocks are
 * indexed and committed as if they had been computed. These are called from
 * inside the allocator's calls and must not call back into it.
 *
 * An asynchronous tier sets start() instead of fetch(): begin allocates and
 * indexes the block as pending (a lookup that meets it waits, as for a block
 * a prefill computes) and hands start() its identity, its logical index in
 * the sequence and the pool block's address; the copy runs elsewhere, and
 * the caller reports the outcome with prefix_seq_restored before it uses the
 * sequence or lets it go (the block must not be freed under a running copy).
 */
struct prefix_tier {
    void (*committed)(void *user, const struct prefix_tier_block *b, const void *data);
    void (*evicted)(void *user, const struct prefix_tier_block *b, const void *data);
    bool (*has)(void *user, const struct prefix_tier_block *b);
    bool (*fetch)(void *user, const struct prefix_tier_block *b, void *dst);
    void (*start)(void *user, const struct prefix_tier_block *b, uint32_t logical, void *dst);
    void *user;
};

/*
 * Who wants to know what lookups can find (kvd's block events): a block is
 * findable from the moment it is both indexed and committed until it leaves
 * the index. stored() gets n consecutive blocks of one chain as they become
 * findable (by one prefix_seq_commit; part 0's blocks only), all of one
 * namespace ns: their keys, the key of the block before the first (NULL for
 * a chain's first block) and their n x block_tokens token ids. removed()
 * gets one block that stopped being findable (evicted). Both are called from
 * inside the allocator's calls and must not call back into it.
 */
struct prefix_observer {
    void (*stored)(void *user, const prefix_key_t *keys, uint32_t n, const prefix_key_t *parent,
                   const int32_t *tokens, prefix_ns_t ns);
    void (*removed)(void *user, prefix_key_t key);
    void *user;
};

/*
 * Takes charge of the owner's pool p (borrowed; it must outlive the cache).
 * A freshly created pool is set up empty. An adopted pool's records are
 * checked first (they came from shared memory): if anything is inconsistent
 * the cache is reset to empty and *note says why. Blocks still referenced or
 * pending from a previous owner are released (pending ones freed). NULL with a
 * reason when p is not owned by this process.
 */
prefix_t *prefix_new(pool_t *p, char *note, size_t note_len, char *err, size_t errlen);

/* Frees the private state; the shared records stay as they are (callers
 * release their sequences first). Accepts NULL and sets *px to NULL. */
void prefix_destroy(prefix_t **px);

/* Sets (or, with NULL, clears) the observer; o is copied. */
void prefix_set_observer(prefix_t *px, const struct prefix_observer *o);

/* Sets (or, with NULL, clears) the tier below the pool; t is copied.
 * KVD_EINVAL without one of fetch() and start(), with both, or without has()
 * where it is needed: in a pool of parts (a restore is planned from it) and
 * with start() (a copy starts only for a block the tier has); in a pool of
 * one part with fetch() it saves an eviction for a block the tier lacks. In a
 * device pool the data and dst the callbacks get are device addresses
 * (pool_block_addr): they copy through host memory. In a pool of parts every
 * part's blocks go down and come back: a prefix continues from the tier when
 * part 0's blocks and every other part's last window are there. */
int prefix_set_tier(prefix_t *px, const struct prefix_tier *t);

/*
 * Owners (a tenant each: struct prefix_seq.owner, 1..PREFIX_OWNERS-1): every
 * block a sequence takes (grown or restored) counts for its owner until it
 * is freed, cached blocks included. With a limit, an owner at it gives up its
 * own least recently used cached block for each new one, and a sequence that
 * cannot stay within it (its owner's blocks are all in use) gets
 * KVD_ENOSPACE: one owner's flood evicts its own cache, not everyone's.
 * 0: no limit. The counts are this process's: an adopted pool's blocks
 * count for no one.
 */
#define PREFIX_OWNERS 65536
void prefix_set_owner_limit(prefix_t *px, uint32_t max_blocks);

/* Blocks owner holds now (pending, in use or cached). */
uint32_t prefix_owned(const prefix_t *px, uint16_t owner);

/* Replaces the key function (tests force collisions with a weak one); NULL
 * restores XXH3. Only valid while the index is empty: KVD_ESTATE otherwise. */
int prefix_set_hash(prefix_t *px, prefix_hash_fn fn);

/* The digest of a namespace name (any bytes; "" is the default namespace). */
prefix_ns_t prefix_namespace(const prefix_t *px, const char *name, size_t len);

uint32_t prefix_block_tokens(const prefix_t *px);

/* Computes the chained keys of the first n_blocks full blocks of tokens in
 * namespace ns into keys (hashing alone, no lookup). */
void prefix_hash_chain(const prefix_t *px, prefix_ns_t ns, const int32_t *tokens, uint32_t n_blocks,
                       prefix_key_t *keys);

/*
 * Looks up the longest cached prefix of tokens[0..n) in namespace ns, at most
 * max_blocks full blocks. Writes the matching committed block ids to ids (room
 * for max_blocks) and fills *m. References nothing: the ids are only good
 * until the next allocator call. Counts a lookup in the statistics.
 */
void prefix_lookup(prefix_t *px, prefix_ns_t ns, const int32_t *tokens, uint64_t n,
                   uint32_t max_blocks, uint32_t *ids, struct prefix_match *m);

/*
 * What prefix_seq_begin would find for s (its public prefix settings) in
 * namespace ns: the cached blocks of tokens[0..n), leaving one token to
 * compute. References nothing and counts a lookup. (The coordinator asks each
 * host's pool this to send a request where most of its prompt is cached.)
 */
uint32_t prefix_seq_probe(prefix_t *px, const struct prefix_seq *s, prefix_ns_t ns,
                          const int32_t *tokens, uint64_t n);

/*
 * Starts sequence s (zeroed, or released) in namespace ns with prompt
 * tokens[0..n): references the longest committed cached prefix, leaving at
 * least one token to compute (so at most (n - 1) / block_tokens blocks).
 * With a tier set, the prefix goes on with blocks the tier gives back, copied
 * into newly allocated blocks (s->n_restored counts them), and pool blocks
 * met after them, as long as it has them and blocks can be had; a pending
 * block met there is the one to wait for.
 * Returns the number of cached tokens (a multiple of block_tokens) or a
 * negative KVD_E* code (KVD_ENOMEM). When the block after the cached prefix is
 * pending in the index and wait_block is given, *wait_block receives its id
 * (else POOL_NONE): the caller may release s and begin again once that block
 * is committed or gone, instead of computing the same tokens twice.
 */
int64_t prefix_seq_begin(prefix_t *px, struct prefix_seq *s, prefix_ns_t ns,
                         const int32_t *tokens, uint64_t n, uint32_t *wait_block);

/*
 * Makes s hold blocks for n_pos positions, all or nothing: KVD_ENOSPACE (and
 * no change) when free plus evictable blocks are too few. tokens[0..n_known)
 * are the sequence's known token ids (at least its prompt); each new block
 * that they fill is indexed as PENDING when the chain before it is indexed and
 * no block of the same content is (checked after the evictions this call
 * makes, so a copy it evicts does not count). Growing to no more positions
 * than are held changes nothing.
 */
int prefix_seq_grow(prefix_t *px, struct prefix_seq *s, uint64_t n_pos,
                    const int32_t *tokens, uint64_t n_known);

/*
 * Records that the K/V of positions [0, n_written) of s are written, with
 * tokens[0..n_written) the sequence's ids there. Every full block inside that
 * range becomes COMMITTED; those not yet indexed are indexed (generated
 * tokens) under the same rules as grow. KVD_ERANGE when n_written exceeds the
 * blocks held; KVD_EINVAL when a block that was indexed while pending holds
 * other tokens than tokens[] says (the caller broke its promise; the block
 * leaves the index).
 */
int prefix_seq_commit(prefix_t *px, struct prefix_seq *s, const int32_t *tokens,
                      uint64_t n_written);

/* Drops every block of s, last first: committed indexed blocks that nobody
 * else holds go to the LRU head, others are freed (pending indexed ones leave
 * the index). s is left empty and may begin again; its table is kept. */
void prefix_seq_release(prefix_t *px, struct prefix_seq *s);

/*
 * Drops every block of s as prefix_seq_release does, then evicts at once those
 * of them that nobody holds and no indexed block continues (a tier's
 * evicted() gets them, as on any eviction). Returns the blocks evicted.
 * Without memory for the list it evicts nothing.
 */
uint32_t prefix_seq_release_evict(prefix_t *px, struct prefix_seq *s);

/*
 * Takes s's pending blocks out of the index, keeping them: nobody finds or
 * waits for them any more, and nothing else is indexed for s. For blocks
 * whose writer may or may not still be writing (a worker on another host that
 * was declared lost): they stay taken until s is released, and no request
 * waits for them meanwhile.
 */
void prefix_seq_hide_pending(prefix_t *px, struct prefix_seq *s);

/*
 * After a prefix_seq_begin that started copies (s->n_restoring > 0), once
 * every one has finished: the blocks of logical blocks [0, n_good) whose
 * copies finished well become committed and findable, as if computed; those
 * of later ones leave the index. True when that was all of them; else the
 * caller must release s (its cached prefix has holes) and may begin again.
 */
bool prefix_seq_restored(prefix_t *px, struct prefix_seq *s, const int32_t *tokens, uint32_t n_good);

/*
 * Windows s (a sequence that reached its context): drops its logical blocks
 * [keep, keep + drop) and moves the later ones down by drop, in every part's
 * table, so that the caller can re-rotate their keys to the positions they
 * now have (the blocks' contents move whole: drop is a count of blocks). Of
 * the moved blocks, those another sequence holds or the index can find must
 * not change in place: each gets a private block, and copy[k] = { from, to }
 * (at most (n_blocks - keep - drop) * parts pairs) tells the caller to copy
 * block from into block to before rotating; the others are s's alone and
 * rotate in place. The sources and the dropped blocks stay held by s (off its
 * tables, s->held) until the caller says the copies are made
 * (prefix_window_done) or releases s, so that nothing evicts and rewrites a
 * source first; then they go the way a release sends them (cached ones stay
 * findable). A windowed part's entries already let go stay
 * POOL_NONE; the caller makes sure its window, once moved, still lies in the
 * blocks kept (kv_window_plan). From here on s's blocks after the first keep
 * are never indexed (its positions no longer say which tokens came before),
 * and its tokens[] for commit and grow are the windowed history: the first
 * keep blocks' tokens, then those of the moved ones. All or nothing:
 * KVD_ENOSPACE (no change) when the private copies cannot be had; KVD_EINVAL
 * when keep + drop >= s->n_blocks or a block in [keep, keep + drop) is held
 * and not committed. Returns the number of copies.
 */
int64_t prefix_seq_window(prefix_t *px, struct prefix_seq *s, uint32_t keep, uint32_t drop,
                          uint32_t (*copy)[2]);

/* Lets go of what s's last window kept off its tables, once copied. */
void prefix_window_done(prefix_t *px, struct prefix_seq *s);

/* Frees s's block table (after release). */
void prefix_seq_fini(struct prefix_seq *s);

/* The tables an engine step takes for s (fwd_seq.tables): NULL for a pool of
 * one part, whose table is s->blocks alone. */
static inline const uint32_t *const *prefix_seq_tables(const struct prefix_seq *s)
{
    return s->n_parts > 1 ? (const uint32_t *const *)s->tables : NULL;
}

/* s's logical blocks [from, n_blocks) as a worker takes them: for each, one
 * id per part (POOL_NONE where a windowed part let it go), into out (room
 * for (n_blocks - from) x n_parts ids). Returns the ids written. */
size_t prefix_seq_flat(const struct prefix_seq *s, uint32_t from, uint32_t *out);

/* Evicts up to n cached blocks from the LRU tail (leaves first); returns how
 * many were freed. */
uint32_t prefix_evict(prefix_t *px, uint32_t n);

void prefix_stats(const prefix_t *px, struct prefix_stats *st);

/* One block's state; KVD_ERANGE for an id out of range. */
int prefix_block_info(const prefix_t *px, uint32_t id, struct prefix_block_info *bi);

/* Calls fn for every block that lookups can find (indexed and committed), in
 * id order: its key, its parent's key (NULL for a chain's first block), its
 * block_tokens token ids and its namespace. */
void prefix_for_each_findable(const prefix_t *px,
                              void (*fn)(void *user, prefix_key_t key, const prefix_key_t *parent,
                                         const int32_t *tokens, prefix_ns_t ns),
                              void *user);

/* Writes up to cap ids of the LRU list from head (most recent) to tail;
 * returns the list's length. */
uint32_t prefix_lru(const prefix_t *px, uint32_t *ids, uint32_t cap);

/*
 * Checks every invariant of the shared records: counts, list links, states,
 * reference counts, index chains and keys, children counts, and the LRU order
 * (no cached block older than one of its cached children). 0, or KVD_EFORMAT
 * with the first violation in err.
 */
int prefix_check(const prefix_t *px, char *err, size_t errlen);

#endif
