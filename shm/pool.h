/*
 * pool.h - the KV pool: one segment of fixed-size KV blocks that every process
 * serving a model on one host maps, plus the metadata of the prefix cache.
 *
 * Segment layout (all positions are offsets from the segment's start, never
 * pointers, so a block id and every structure mean the same in every process):
 *
 *     header (4 KiB) | block records | block token ids | index buckets | KV data
 *
 * The header names the layout (model fingerprint, layers, KV heads, head dim,
 * block tokens, K and V types and rotation, block count) and the build (ABI version and struct
 * sizes). Opening a segment whose header does not match is an error, never a
 * silent misread.
 *
 * Roles: exactly one process owns a pool (the coordinator, or kvd-run). The
 * owner holds an exclusive flock() on the segment for its lifetime; the kernel
 * drops it when the owner dies, which is how a stale segment (state LIVE, lock
 * free) left by a crashed run is told from a live one. Only the owner writes
 * the records, tokens and index (shm/prefix.h). Workers attach, write K/V into
 * the blocks they are given, and map the metadata read-only.
 *
 * When the owner closes the pool cleanly the state becomes CLOSED and the
 * cache stays valid: a later owner may adopt it (params.reuse) and its cached
 * prefixes survive. A pool left LIVE by a dead owner is never trusted: the
 * next owner replaces it with an empty one.
 *
 * Where the KV data lives (pool_header.kv_where, chosen at creation):
 *
 *   POOL_KV_HOST    in this segment, after the metadata (POSIX shm_open +
 *                   mmap, transparent huge pages advised; an anonymous shared
 *                   mapping when the pool has no name).
 *   POOL_KV_DEVICE  in the memory of CUDA device kv_device. The segment holds
 *                   the header and metadata only, exactly as for a host pool.
 *                   This module never touches CUDA: the owner allocates the
 *                   device memory (shm/devmem.h), passes it to
 *                   the workers of that GPU as a file descriptor
 *                   (shm/fdpass.h), and each process that maps it tells its
 *                   pool where with pool_set_device_kv(). pool_block_addr()
 *                   and pool_data() then return device addresses, valid in
 *                   that process only, and NULL before.
 *
 *   POOL_KV_REMOTE  on another host. The coordinator keeps the metadata of
 *                   each remote host's pool in an anonymous segment of its
 *                   own, and the workers there compute into a host pool of
 *                   theirs with as many blocks (pool_join()). pool_data() and
 *                   pool_block_addr() return NULL: nothing here holds its K/V.
 *
 * Device memory does not outlive its owner, so a device pool's cache is never
 * adopted by a later owner: it always starts empty.
 *
 * Ordering across processes (device pools). A kernel launch returns before
 * the kernel runs, and a commit message travels faster than the GPU works. A
 * worker therefore reports a block as written (Commit, a token chunk, Done)
 * only after the kernels that wrote its K/V have completed: it synchronizes
 * the stream that ran them (or waits for an event recorded after them)
 * first. Completed kernel writes are visible to every later kernel on that
 * device, in any process, so a block kvd marks committed can be read by any
 * worker it is handed to next. A worker that kvd declares dead is killed and
 * reaped (kvd waits up to 10 s) before its pending blocks are handed out
 * again: the driver stops a process's kernels as the process goes, and until
 * then they could still be writing into those blocks.
 */
#ifndef KVD_POOL_H
#define KVD_POOL_H

#include <assert.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvparts.h"

#define POOL_MAGIC UINT64_C(0x314c4f4f5044564b) /* "KVDPOOL1" in little-endian bytes */
#define POOL_VERSION 4u                        /* 4: blocks of a part of the layers (kvparts.h) */
#define POOL_NONE UINT32_MAX                   /* "no block" in every block-id field */
#define POOL_SECRET_BYTES 192u                  /* keyed-hash secret (>= XXH3's 136) */
#define POOL_HEADER_BYTES 4096u
#define POOL_NAME_MAX 200u                      /* longest segment name */

/* Where a pool's KV data lives (pool_header.kv_where). */
enum pool_kv_where {
    POOL_KV_HOST = 1,       /* in the segment, at data_off */
    POOL_KV_DEVICE = 2,     /* in the memory of CUDA device kv_device */
    POOL_KV_REMOTE = 3,     /* on another host (an anonymous pool of the coordinator's):
                             * its workers keep the data in a pool of their own there */
};

enum pool_state {
    POOL_STATE_INIT = 1,    /* being written by its creator */
    POOL_STATE_LIVE = 2,    /* owned by a running process (which holds the flock) */
    POOL_STATE_CLOSED = 3,  /* closed cleanly; the cache in it is valid */
};

/* What a block means. Two pools with equal layouts are interchangeable. */
struct pool_layout {
    uint8_t fingerprint[16];/* the model's identity (model_fingerprint) */
    uint32_t n_layer;       /* transformer layers */
    uint32_t n_head_kv;     /* KV heads */
    uint32_t head_dim;      /* per-head size */
    uint32_t block_tokens;  /* positions per block */
    uint16_t k_type;        /* K's element type: KERN_F16, KERN_F32, KERN_Q8_0 or KERN_Q4_0 */
    uint16_t v_type;        /* V's, the same choices */
    uint32_t rotate;        /* KV_ROT_K | KV_ROT_V (kvcache.h): halves stored rotated */
    struct kv_parts parts;  /* which layers a block holds; a sequence has a table per part */
};
static_assert(sizeof(struct pool_layout) == 816, "pool_layout is part of the ABI");

/* The prefix cache's shared state (written by shm/prefix.c only). */
struct pool_cache_state {
    uint32_t free_head;     /* free list through pool_block.next */
    uint32_t lru_head;      /* most recently released cached block */
    uint32_t lru_tail;      /* least recently used: evicted first */
    uint32_t n_free;        /* blocks on the free list */
    uint32_t n_cached;      /* unreferenced committed blocks on the LRU list */
    uint32_t n_used;        /* referenced committed blocks */
    uint32_t n_pending;     /* allocated blocks whose K/V are not yet all written */
    uint32_t n_indexed;     /* blocks reachable through the index */
    uint64_t clock;         /* ticks on every release; pool_block.last_use */
    uint64_t evictions;     /* cached blocks reclaimed for allocation */
    uint64_t lookups;       /* prefix lookups */
    uint64_t hit_blocks;    /* blocks found by lookups */
    uint64_t collisions;    /* index entries with a matching key but other contents */
    uint64_t reserved[4];
};
static_assert(sizeof(struct pool_cache_state) == 104, "pool_cache_state is part of the ABI");

struct pool_header {
    uint64_t magic;         /* POOL_MAGIC */
    uint32_t version;       /* POOL_VERSION */
    uint32_t abi;           /* pool_abi(): version, struct sizes, byte order */
    uint32_t state;         /* enum pool_state */
    int32_t owner_pid;      /* last owner (informational; the flock decides) */
    uint64_t generation;    /* bumped each time an owner opens the pool */
    struct pool_layout layout;
    uint32_t n_blocks;      /* KV blocks */
    uint32_t n_buckets;     /* index buckets (a power of two) */
    uint64_t block_bytes;   /* bytes of one KV block: its part's layers, K and V */
    uint64_t records_off;   /* struct pool_block[n_blocks] */
    uint64_t tokens_off;    /* int32_t[n_blocks][block_tokens] */
    uint64_t buckets_off;   /* uint32_t[n_buckets]: first block of each chain */
    uint64_t data_off;      /* KV blocks of a host pool (2 MiB aligned when large); a
                             * device pool: the end of the metadata */
    uint64_t total_bytes;   /* size of the segment */
    uint8_t secret[POOL_SECRET_BYTES]; /* random per pool, keys the prefix hash */
    struct pool_cache_state cache;
    uint32_t kv_where;      /* enum pool_kv_where */
    int32_t kv_device;      /* POOL_KV_DEVICE: CUDA device index; -1 for a host pool */
    uint64_t kv_bytes;      /* KV data: n_blocks x block_bytes, wherever it lives */
    uint64_t instance;      /* random, new at every owner open: ties memory passed to the
                             * workers (fdpass_msg.instance) to this pool and this owner */
};
static_assert(sizeof(struct pool_header) <= POOL_HEADER_BYTES, "header fits its page");
static_assert(offsetof(struct pool_header, layout) == 32, "pool_header is part of the ABI");
static_assert(offsetof(struct pool_header, secret) == 904, "pool_header is part of the ABI");
static_assert(offsetof(struct pool_header, kv_where) == 1200, "pool_header is part of the ABI");
static_assert(sizeof(struct pool_header) == 1224, "pool_header is part of the ABI");

/* Block states (pool_block.state). */
enum pool_block_state {
    POOL_BLOCK_FREE = 0,     /* on the free list */
    POOL_BLOCK_PENDING = 1,  /* allocated; K/V not yet all written */
    POOL_BLOCK_COMMITTED = 2,/* full and written; cacheable */
};

/* Block flags (pool_block.flags). */
#define POOL_BLOCK_INDEXED 1u /* reachable through the index (key, ns, parent, tokens valid) */
#define POOL_BLOCK_PART 2u    /* indexed as a block of a part other than 0 (prefix.h) */

/* One record per KV block. */
struct pool_block {
    uint64_t key[2];        /* chained prefix key (valid when INDEXED) */
    uint64_t ns[2];         /* namespace digest (valid when INDEXED) */
    uint32_t parent;        /* previous block of the prefix, POOL_NONE for the first */
    uint32_t refs;          /* sequences holding the block */
    uint32_t state;         /* enum pool_block_state */
    uint32_t flags;         /* POOL_BLOCK_* */
    uint32_t n_children;    /* INDEXED blocks whose parent this is */
    uint32_t prev;          /* LRU list: towards the head (more recent) */
    uint32_t next;          /* LRU list: towards the tail; free list: next free */
    uint32_t hnext;         /* next block in the same index bucket */
    uint64_t last_use;      /* cache clock at the last release */
};
static_assert(sizeof(struct pool_block) == 72, "pool_block is part of the ABI");

/* How to size and name a pool. */
struct pool_params {
    const char *name;       /* shm name ("/kvd-..." or "kvd-..."); NULL: anonymous, private */
    uint64_t kv_bytes;      /* memory budget for the whole segment, or 0 to use n_blocks */
    uint32_t n_blocks;      /* block count when kv_bytes is 0 */
    bool reuse;             /* owner: adopt a CLOSED pool with the same layout and keep its cache */
    bool unlink_on_close;   /* owner: remove the name when closing */
    bool exclusive;         /* owner: a segment of its own, never one that exists: when the
                             * name is taken (another user's object, a live pool), a random
                             * suffix is added to it (pool_name() says the name used) */
    uint32_t kv_where;      /* 0 or POOL_KV_HOST: KV in the segment; POOL_KV_DEVICE: on kv_device,
                             * and kv_bytes then budgets the device memory alone */
    int32_t kv_device;      /* POOL_KV_DEVICE: CUDA device index (0..1023) */
    const uint8_t *secret;  /* a new pool keys its prefix hash with these POOL_SECRET_BYTES
                             * instead of random ones (a disk tier's keys must outlive the
                             * pool); NULL: random. An adopted pool keeps its own. */
};

struct pool_params pool_default_params(void);

/* The capacity a budget buys. */
struct pool_capacity {
    uint64_t bytes_per_token;  /* layers x kv_heads x (K row + V row) (kv_token_bytes) */
    uint64_t block_bytes;      /* KV bytes of one block */
    uint64_t overhead_per_block; /* record + token ids + bucket share */
    uint32_t n_blocks;         /* blocks */
    uint64_t n_tokens;         /* n_blocks x block_tokens */
    uint64_t total_bytes;      /* segment size */
    uint64_t data_bytes;       /* KV data: n_blocks x block_bytes */
    int32_t kv_device;         /* -1: the KV data is in the segment; else the device holding it */
};

typedef struct pool pool_t;

/* The number written into pool_header.abi by this build. */
uint32_t pool_abi(void);

/*
 * Computes what a budget (p->kv_bytes, or p->n_blocks blocks when it is 0)
 * holds for a layout. A host pool's budget covers the whole segment; a device
 * pool's covers its KV data on the device (the metadata is host memory).
 * KVD_EINVAL with a reason for a zero budget, a budget smaller than one
 * block, a layout or device out of range; KVD_ERANGE past 2^32-1 blocks.
 */
int pool_plan(const struct pool_layout *lay, const struct pool_params *p,
              struct pool_capacity *cap, char *err, size_t errlen);

/* One line describing what a pool holds, by the formula
 * bytes/token = 2 x layers x KV heads x head dim x bytes per element, with how
 * many sequences of ctx tokens fit (ctx 0 leaves that out). */
void pool_describe(const struct pool_layout *lay, const struct pool_capacity *cap, uint32_t ctx,
                   char *buf, size_t len);

/*
 * Opens a pool as its owner: creates it, or with p->reuse adopts a CLOSED pool
 * of that name whose layout and size match (its cached blocks survive). A
 * pool that is LIVE under a running owner is an error (KVD_ESTATE); a stale,
 * corrupt or mismatched one is replaced (*replaced, when given, says so and
 * why). An existing segment is opened only when it belongs to this user and
 * no one else may read or write it (mode 0600): any other is refused
 * (KVD_EPERM), so another user cannot hand kvd memory it can read. Returns
 * NULL with a one-line reason on failure.
 */
pool_t *pool_create(const struct pool_layout *lay, const struct pool_params *p,
                    char *replaced, size_t replaced_len, char *err, size_t errlen);

/*
 * Attaches a worker to the LIVE pool `name` for layout lay. The KV data is
 * mapped read-write; header, records and index read-only. NULL with a reason
 * when the pool is missing, not live, corrupt, made for another model,
 * block size, dtype or build, or not this user's alone (as pool_create).
 */
pool_t *pool_attach(const char *name, const struct pool_layout *lay, char *err, size_t errlen);

/*
 * A worker on another host than its coordinator: attaches to the live pool
 * `name` of this host, or creates it (p: its size; *created says so) when
 * there is none, or only a stale or closed one. Whoever creates it owns it
 * and removes the name when it closes; workers still mapping it keep their
 * memory, and the next worker makes a new pool (a new instance, which the
 * coordinator indexes afresh). The metadata of such a pool is unused: the
 * coordinator keeps the index of this host's blocks (POOL_KV_REMOTE).
 */
pool_t *pool_join(const char *name, const struct pool_layout *lay, const struct pool_params *p,
                  bool *created, char *err, size_t errlen);

/* Owner: marks the pool CLOSED (its cache stays valid), drops the lock and
 * unmaps; unlinks the name when p->unlink_on_close. Worker: unmaps. Accepts
 * NULL and sets *p to NULL. */
void pool_close(pool_t **p);

/* Removes a pool's name (its memory lives on while mapped). 0 or KVD_ENOTFOUND. */
int pool_unlink(const char *name);

/* Removes the segments named PREFIX<pid> or PREFIX<pid>-<suffix> (a private
 * pool of a process that has gone: kvd's "kvd-") that this user owns, whose
 * process is not running, whose owner lock is free and that were not closed
 * cleanly: what a crashed owner left. log(user, name) hears each one removed.
 * Returns how many. */
int pool_reclaim_stale(const char *prefix, void (*log)(void *user, const char *name), void *user);

bool pool_is_owner(const pool_t *p);
bool pool_is_fresh(const pool_t *p);                /* this open made it: metadata empty */
struct pool_header *pool_header(const pool_t *p);   /* read-only mapping for workers */
struct pool_block *pool_records(const pool_t *p);   /* n_blocks records */
int32_t *pool_tokens(const pool_t *p);              /* n_blocks x block_tokens ids */
uint32_t *pool_buckets(const pool_t *p);            /* n_buckets chain heads */
void *pool_data(const pool_t *p);                   /* start of KV block 0 (see pool_block_addr) */
uint64_t pool_data_bytes(const pool_t *p);          /* n_blocks x block_bytes */
const char *pool_name(const pool_t *p);             /* NULL for an anonymous pool */
bool pool_huge_pages(const pool_t *p);              /* huge pages were advised and granted */

/* The CUDA device holding the KV data, or -1 when it is in the segment. */
int pool_kv_device(const pool_t *p);

/*
 * Device pools: records where this process mapped the KV data (base, a device
 * address, and the bytes mapped there, at least pool_data_bytes()). The
 * mapping belongs to the caller and must outlive every use of the addresses
 * this pool hands out. 0, KVD_ESTATE for a host pool, KVD_EINVAL for a NULL
 * base or too few bytes.
 */
int pool_set_device_kv(pool_t *p, void *base, uint64_t bytes);

/* Address of block id's KV data: in this process's mapping of the segment
 * (host pool) or of the device memory (device pool, after pool_set_device_kv;
 * a device address). NULL when id is out of range or the device memory is not
 * mapped yet. */
void *pool_block_addr(const pool_t *p, uint32_t id);

#endif
