/* prefix.c - block allocator and prefix index over a pool's shared records. */
#include "prefix.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "err.h"

struct prefix {
    pool_t *pool;               /* borrowed; this process owns it */
    struct pool_header *h;      /* the segment's header */
    struct pool_cache_state *cs;/* shared counters and list heads */
    struct pool_block *b;       /* n records */
    int32_t *tok;               /* n x bt token ids */
    uint32_t *bucket;           /* mask + 1 chain heads */
    uint32_t n;                 /* blocks */
    uint32_t bt;                /* tokens per block */
    uint32_t mask;              /* buckets - 1 */
    uint32_t np;                /* parts: block tables per sequence */
    const struct kv_parts *parts; /* in the header */
    prefix_hash_fn hash;        /* key function */
    struct prefix_observer obs; /* stored / removed NULL: nobody listens */
    struct prefix_tier tier;    /* evicted / fetch NULL: no tier below the pool */
    uint64_t restored;          /* blocks copied back from the tier */
    prefix_key_t *path;         /* n: each indexed block's path digest (struct prefix_tier_block),
                                 * private to this process: recomputed from the records on adoption */
    uint16_t *owner;            /* n: the owner (prefix_seq.owner) each block was taken for; 0: none.
                                 * Private too: an adopted pool's blocks have none */
    uint32_t *owned;            /* PREFIX_OWNERS: blocks (pending, used or cached) per owner */
    uint32_t owner_limit;       /* blocks an owner may hold (prefix_set_owner_limit); 0: no limit */
    uint32_t *hits;             /* n: times prefix_seq_begin took each block from the cache since it
                                 * was last freed (private, for the pool's picture) */
};

static const prefix_key_t KEY_ZERO = { 0, 0 };

/* The namespaces of a chain: its first n_pub blocks in pub (a prefix that
 * every namespace shares, prefix_seq.n_public), the rest in ns. */
struct chain_ns {
    prefix_ns_t ns, pub;
    uint32_t n_pub;
};

static prefix_ns_t ns_at(const struct chain_ns *c, uint64_t i)
{
    return i < c->n_pub ? c->pub : c->ns;
}

static struct chain_ns seq_chain(const struct prefix_seq *s)
{
    return (struct chain_ns){ s->ns, s->public_ns, s->n_public };
}

/* ---- keys ----------------------------------------------------------------------------- */

static prefix_key_t xxh_key(const uint8_t secret[POOL_SECRET_BYTES], prefix_key_t parent,
                            prefix_ns_t ns, const uint8_t fingerprint[16],
                            const int32_t *tokens, uint32_t n)
{
    XXH128_hash_t r;
    uint8_t buf[48 + 256 * 4];
    if (n <= 256) {
        memcpy(buf, &parent, 16);
        memcpy(buf + 16, &ns, 16);
        memcpy(buf + 32, fingerprint, 16);
        memcpy(buf + 48, tokens, (size_t)n * 4);
        r = XXH3_128bits_withSecret(buf, 48 + (size_t)n * 4, secret, POOL_SECRET_BYTES);
    } else {
        XXH3_state_t st;
        XXH3_128bits_reset_withSecret(&st, secret, POOL_SECRET_BYTES);
        XXH3_128bits_update(&st, &parent, 16);
        XXH3_128bits_update(&st, &ns, 16);
        XXH3_128bits_update(&st, fingerprint, 16);
        XXH3_128bits_update(&st, tokens, (size_t)n * 4);
        r = XXH3_128bits_digest(&st);
    }
    prefix_key_t k = { r.low64, r.high64 };
    return k;
}

static prefix_key_t key_of(const prefix_t *px, prefix_key_t parent, prefix_ns_t ns,
                           const int32_t *tokens)
{
    return px->hash(px->h->secret, parent, ns, px->h->layout.fingerprint, tokens, px->bt);
}

static bool key_eq(const uint64_t a[2], prefix_key_t k)
{
    return a[0] == k.lo && a[1] == k.hi;
}

static prefix_key_t key_get(const struct pool_block *r)
{
    prefix_key_t k = { r->key[0], r->key[1] };
    return k;
}

/* The namespace that part `part`'s blocks are keyed and indexed in: distinct
 * from every other part's for the same sequence namespace (part 0's is ns). */
static prefix_ns_t part_ns(prefix_ns_t ns, uint32_t part)
{
    ns.lo ^= part;
    return ns;
}

prefix_ns_t prefix_namespace(const prefix_t *px, const char *name, size_t len)
{
    XXH128_hash_t r = XXH3_128bits_withSecret(name, len, px->h->secret, POOL_SECRET_BYTES);
    prefix_ns_t ns = { r.low64, r.high64 };
    return ns;
}

/* ---- lists ------------------------------------------------------------------------------ */

static void free_push(prefix_t *px, uint32_t id)
{
    if (px->owner != NULL && px->owner[id] != 0) {
        px->owned[px->owner[id]]--;
        px->owner[id] = 0;
    }
    if (px->hits != NULL)
        px->hits[id] = 0;
    struct pool_block *r = &px->b[id];
    r->state = POOL_BLOCK_FREE;
    r->flags = 0;
    r->refs = 0;
    r->parent = POOL_NONE;
    r->n_children = 0;
    r->prev = POOL_NONE;
    r->hnext = POOL_NONE;
    r->next = px->cs->free_head;
    px->cs->free_head = id;
    px->cs->n_free++;
}

static uint32_t free_pop(prefix_t *px)
{
    uint32_t id = px->cs->free_head;
    px->cs->free_head = px->b[id].next;
    px->b[id].next = POOL_NONE;
    px->cs->n_free--;
    return id;
}

static void lru_push_head(prefix_t *px, uint32_t id)
{
    struct pool_block *r = &px->b[id];
    r->prev = POOL_NONE;
    r->next = px->cs->lru_head;
    if (r->next != POOL_NONE)
        px->b[r->next].prev = id;
    else
        px->cs->lru_tail = id;
    px->cs->lru_head = id;
    r->last_use = ++px->cs->clock;
    px->cs->n_cached++;
}

static void lru_remove(prefix_t *px, uint32_t id)
{
    struct pool_block *r = &px->b[id];
    if (r->prev != POOL_NONE)
        px->b[r->prev].next = r->next;
    else
        px->cs->lru_head = r->next;
    if (r->next != POOL_NONE)
        px->b[r->next].prev = r->prev;
    else
        px->cs->lru_tail = r->prev;
    r->prev = r->next = POOL_NONE;
    px->cs->n_cached--;
}

/* ---- the index ----------------------------------------------------------------------------- */

/* The path digest of a block: its parent's (zero for a chain's first), its
 * namespace and its tokens, under a fixed seed (independent of the pool's
 * secret and of the key function). */
static prefix_key_t path_of(const prefix_t *px, prefix_key_t parent, prefix_ns_t ns, const int32_t *tokens)
{
    uint8_t buf[32 + 4096 * 4];
    const size_t n = 32 + (size_t)px->bt * 4;
    memcpy(buf, &parent, 16);
    memcpy(buf + 16, &ns, 16);
    memcpy(buf + 32, tokens, (size_t)px->bt * 4);
    const XXH128_hash_t h = XXH3_128bits_withSeed(buf, n, UINT64_C(0x6b76642d70617468));
    return (prefix_key_t){ h.low64, h.high64 };
}

static void index_insert(prefix_t *px, uint32_t id, prefix_key_t k, prefix_ns_t ns, uint32_t parent,
                         const int32_t *tokens)
{
    px->path[id] = path_of(px, parent != POOL_NONE ? px->path[parent] : KEY_ZERO, ns, tokens);
    struct pool_block *r = &px->b[id];
    r->key[0] = k.lo;
    r->key[1] = k.hi;
    r->ns[0] = ns.lo;
    r->ns[1] = ns.hi;
    r->parent = parent;
    memcpy(px->tok + (size_t)id * px->bt, tokens, (size_t)px->bt * 4);
    uint32_t *head = &px->bucket[k.lo & px->mask];
    r->hnext = *head;
    *head = id;
    r->flags |= POOL_BLOCK_INDEXED;
    if (parent != POOL_NONE)
        px->b[parent].n_children++;
    px->cs->n_indexed++;
}

static void index_remove(prefix_t *px, uint32_t id)
{
    struct pool_block *r = &px->b[id];
    uint32_t *link = &px->bucket[r->key[0] & px->mask];
    while (*link != POOL_NONE && *link != id)
        link = &px->b[*link].hnext;
    if (*link == id)
        *link = r->hnext;
    r->hnext = POOL_NONE;
    r->flags &= ~(POOL_BLOCK_INDEXED | POOL_BLOCK_PART);
    if (r->parent != POOL_NONE && px->b[r->parent].n_children > 0)
        px->b[r->parent].n_children--;
    r->parent = POOL_NONE;
    px->cs->n_indexed--;
}

/* The indexed block with key k whose namespace, parent and tokens all match,
 * or POOL_NONE. Key matches with other contents count as collisions. */
static uint32_t index_find(prefix_t *px, prefix_key_t k, prefix_ns_t ns, uint32_t parent,
                           const int32_t *tokens)
{
    for (uint32_t id = px->bucket[k.lo & px->mask]; id != POOL_NONE; id = px->b[id].hnext) {
        const struct pool_block *r = &px->b[id];
        if (!key_eq(r->key, k))
            continue;
        if (r->ns[0] == ns.lo && r->ns[1] == ns.hi && r->parent == parent &&
            memcmp(px->tok + (size_t)id * px->bt, tokens, (size_t)px->bt * 4) == 0)
            return id;
        px->cs->collisions++;
    }
    return POOL_NONE;
}

/* Walks the index along tokens: up to max_blocks leading committed blocks
 * (ids written when ids != NULL). *pending: the pending block that continues
 * them, if any. *last: key of the last block matched. */
static uint32_t walk(prefix_t *px, const struct chain_ns *cn, const int32_t *tokens, uint64_t n,
                     uint32_t max_blocks, uint32_t *ids, uint32_t *pending, prefix_key_t *last)
{
    uint64_t full = n / px->bt;
    if (max_blocks > full)
        max_blocks = (uint32_t)full;
    prefix_key_t key = KEY_ZERO;
    uint32_t parent = POOL_NONE, i;
    *pending = POOL_NONE;
    for (i = 0; i < max_blocks; i++) {
        const int32_t *t = tokens + (size_t)i * px->bt;
        const prefix_ns_t ns = ns_at(cn, i);
        prefix_key_t k = key_of(px, key, ns, t);
        uint32_t id = index_find(px, k, ns, parent, t);
        if (id == POOL_NONE)
            break;
        if (px->b[id].state != POOL_BLOCK_COMMITTED) {
            *pending = id;
            break;
        }
        if (ids)
            ids[i] = id;
        key = k;
        parent = id;
    }
    *last = key;
    px->cs->lookups++;
    px->cs->hit_blocks += i;
    return i;
}

/* ---- allocation and release ----------------------------------------------------------- */

/* The LRU block to evict: the tail, which the release order makes a leaf;
 * should a block with indexed children ever be there, the next leaf toward
 * the head is taken instead. */
static uint32_t evict_pick(const prefix_t *px)
{
    for (uint32_t id = px->cs->lru_tail; id != POOL_NONE; id = px->b[id].prev)
        if (px->b[id].n_children == 0)
            return id;
    return POOL_NONE;
}

static void evict_one(prefix_t *px, uint32_t id)
{
    const struct pool_block *r = &px->b[id];
    if (px->tier.evicted && (r->flags & POOL_BLOCK_INDEXED) && r->state == POOL_BLOCK_COMMITTED) {
        /* its bytes go down a tier before the block is reused */
        const struct prefix_tier_block tb = {
            .key = key_get(r), .parent = r->parent != POOL_NONE ? key_get(&px->b[r->parent]) : KEY_ZERO,
            .ns = { r->ns[0], r->ns[1] }, .tokens = px->tok + (size_t)id * px->bt, .path = px->path[id],
            .part = (r->flags & POOL_BLOCK_PART) ? 1u : 0u,
        };
        px->tier.evicted(px->tier.user, &tb, pool_block_addr(px->pool, id));
    }
    lru_remove(px, id);
    if (px->obs.removed && !(px->b[id].flags & POOL_BLOCK_PART))
        px->obs.removed(px->obs.user, key_get(&px->b[id]));
    index_remove(px, id);
    px->cs->evictions++;
    free_push(px, id);
}

/* The least recently used cached block of owner o that can go (no children). */
static uint32_t evict_pick_owned(const prefix_t *px, uint16_t o)
{
    for (uint32_t id = px->cs->lru_tail; id != POOL_NONE; id = px->b[id].prev)
        if (px->owner[id] == o && px->b[id].n_children == 0)
            return id;
    return POOL_NONE;
}

/* Cached blocks of owner o (all of them can go, children first: a child of
 * an owner's block is in its namespace, so its own). */
static uint32_t owned_cached(const prefix_t *px, uint16_t o)
{
    uint32_t n = 0;
    for (uint32_t id = px->cs->lru_tail; id != POOL_NONE; id = px->b[id].prev)
        n += px->owner[id] == o;
    return n;
}

/* Takes one block for owner o (0: none): free first, then evicted. An owner
 * at its limit gives up one of its own cached blocks first (POOL_NONE when it
 * has none); the caller checked there is one otherwise. */
static uint32_t alloc_one(prefix_t *px, uint16_t o)
{
    if (o != 0 && px->owner_limit != 0 && px->owned[o] >= px->owner_limit) {
        const uint32_t v = evict_pick_owned(px, o);
        if (v == POOL_NONE)
            return POOL_NONE;
        evict_one(px, v);
    }
    if (px->cs->free_head == POOL_NONE) {
        uint32_t v = evict_pick(px);
        if (v == POOL_NONE)
            return POOL_NONE;
        evict_one(px, v);
    }
    uint32_t id = free_pop(px);
    if (o != 0) {
        px->owner[id] = o;
        px->owned[o]++;
    }
    struct pool_block *r = &px->b[id];
    r->state = POOL_BLOCK_PENDING;
    r->refs = 1;
    r->flags = 0;
    r->parent = POOL_NONE;
    r->n_children = 0;
    px->cs->n_pending++;
    return id;
}

/* Takes a reference on a committed block (a cache hit). */
static void ref_committed(prefix_t *px, uint32_t id)
{
    struct pool_block *r = &px->b[id];
    if (r->refs == 0) {
        lru_remove(px, id);
        px->cs->n_used++;
    }
    r->refs++;
}

static void unref(prefix_t *px, uint32_t id)
{
    struct pool_block *r = &px->b[id];
    if (r->refs == 0)
        return; /* never negative; prefix_check reports the broken caller's state */
    if (--r->refs > 0)
        return;
    if (r->state == POOL_BLOCK_COMMITTED) {
        px->cs->n_used--;
        if (r->flags & POOL_BLOCK_INDEXED) {
            lru_push_head(px, id);
            return;
        }
    } else {
        px->cs->n_pending--;
        if (r->flags & POOL_BLOCK_INDEXED)
            index_remove(px, id);
    }
    free_push(px, id);
}

static int seq_reserve(struct prefix_seq *s, uint64_t need)
{
    if (need <= s->cap)
        return 0;
    if (need > UINT32_MAX)
        return KVD_ERANGE;
    uint64_t cap = s->cap ? s->cap : 16;
    while (cap < need)
        cap *= 2;
    if (cap > UINT32_MAX)
        cap = UINT32_MAX;
    for (uint32_t p = 0; p < s->n_parts; p++) {
        uint32_t *nb = realloc(s->tables[p], cap * sizeof(uint32_t));
        if (nb == NULL)
            return KVD_ENOMEM;   /* the tables grown so far keep their contents */
        s->tables[p] = nb;
    }
    s->blocks = s->tables[0];
    s->cap = (uint32_t)cap;
    return 0;
}

/* Gives s (zeroed, or empty) one table per part of px's pool; KVD_ESTATE for
 * a sequence that holds blocks of a pool with other parts. */
static int seq_parts_init(const prefix_t *px, struct prefix_seq *s)
{
    if (s->n_parts == px->np)
        return 0;
    if (s->n_blocks != 0)
        return KVD_ESTATE;
    for (uint32_t p = 0; p < KV_MAX_PARTS; p++) {
        free(s->tables[p]);
        s->tables[p] = NULL;
    }
    s->blocks = NULL;
    s->cap = 0;
    s->n_parts = px->np;
    return 0;
}

/* Indexes block i of part p >= 1 of s (tokens t) under part 0's block i,
 * which s indexed: unless a block of that content already hangs there. */
static void part_try_index(prefix_t *px, struct prefix_seq *s, uint32_t p, uint32_t i,
                           const int32_t *t)
{
    const uint32_t id = s->tables[p][i], spine = s->tables[0][i];
    if (id == POOL_NONE || (px->b[id].flags & POOL_BLOCK_INDEXED))
        return;
    const struct chain_ns cn = seq_chain(s);
    const prefix_ns_t ns = part_ns(ns_at(&cn, i), p);
    const prefix_key_t k = key_of(px, key_get(&px->b[spine]), ns, t);
    if (index_find(px, k, ns, spine, t) != POOL_NONE)
        return;
    index_insert(px, id, k, ns, spine, t);
    px->b[id].flags |= POOL_BLOCK_PART;
}

/* Indexes the other parts' blocks i of s, whose part-0 block s indexed. */
static void parts_try_index(prefix_t *px, struct prefix_seq *s, uint32_t i, const int32_t *t)
{
    if (i >= s->n_indexed)
        return;
    for (uint32_t p = 1; p < s->n_parts; p++)
        part_try_index(px, s, p, i, t);
}

/* Indexes block i of s (full, tokens t) when its chain allows and no block of
 * the same content is indexed; otherwise closes the chain. */
static void seq_try_index(prefix_t *px, struct prefix_seq *s, uint32_t i, const int32_t *t)
{
    if (!s->chain_open || s->n_indexed != i)
        return;
    uint32_t parent = i ? s->blocks[i - 1] : POOL_NONE;
    const struct chain_ns cn = seq_chain(s);
    const prefix_ns_t ns = ns_at(&cn, i);
    prefix_key_t k = key_of(px, i ? s->key : KEY_ZERO, ns, t);
    if (index_find(px, k, ns, parent, t) != POOL_NONE) {
        s->chain_open = false; /* a duplicate: it and its successors stay private */
        return;
    }
    index_insert(px, s->blocks[i], k, ns, parent, t);
    s->n_indexed = i + 1;
    s->key = k;
    parts_try_index(px, s, i, t);
}

/* ---- public API ----------------------------------------------------------------------- */

static void reset_empty(prefix_t *px)
{
    struct pool_cache_state *cs = px->cs;
    uint64_t clock = cs->clock, ev = cs->evictions;
    memset(cs, 0, sizeof(*cs));
    cs->clock = clock;
    cs->evictions = ev;
    cs->free_head = cs->lru_head = cs->lru_tail = POOL_NONE;
    for (uint32_t i = 0; i <= px->mask; i++)
        px->bucket[i] = POOL_NONE;
    memset(px->b, 0, (size_t)px->n * sizeof(*px->b));
    for (uint32_t i = px->n; i-- > 0;)
        free_push(px, i); /* block 0 ends on top */
}

/* The path digests of an adopted pool's indexed blocks, parents first (a
 * parent's chain is walked up to a block already done). */
static void paths_rebuild(prefix_t *px)
{
    uint8_t *done = calloc(px->n ? px->n : 1, 1);
    uint32_t *stack = malloc((size_t)(px->n ? px->n : 1) * sizeof(*stack));
    if (done == NULL || stack == NULL) {
        free(done);
        free(stack);
        reset_empty(px);    /* no memory to verify tier hits with: start empty */
        return;
    }
    for (uint32_t id = 0; id < px->n; id++) {
        uint32_t depth = 0, at = id;
        while (at != POOL_NONE && !done[at] && (px->b[at].flags & POOL_BLOCK_INDEXED) && depth < px->n) {
            stack[depth++] = at;
            at = px->b[at].parent;
        }
        while (depth > 0) {
            const uint32_t b = stack[--depth];
            const struct pool_block *r = &px->b[b];
            const prefix_key_t pp = r->parent != POOL_NONE ? px->path[r->parent] : KEY_ZERO;
            px->path[b] = path_of(px, pp, (prefix_ns_t){ r->ns[0], r->ns[1] }, px->tok + (size_t)b * px->bt);
            done[b] = 1;
        }
    }
    free(done);
    free(stack);
}

prefix_t *prefix_new(pool_t *p, char *note, size_t note_len, char *err, size_t errlen)
{
    if (note && note_len)
        note[0] = 0;
    if (!pool_is_owner(p)) {
        kvd_seterr(err, errlen, KVD_ESTATE, "prefix: only the pool's owner may run its allocator");
        return NULL;
    }
    prefix_t *px = calloc(1, sizeof(*px));
    if (px == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "prefix: out of memory");
        return NULL;
    }
    px->pool = p;
    px->h = pool_header(p);
    px->cs = &px->h->cache;
    px->b = pool_records(p);
    px->tok = pool_tokens(p);
    px->bucket = pool_buckets(p);
    px->n = px->h->n_blocks;
    px->bt = px->h->layout.block_tokens;
    px->mask = px->h->n_buckets - 1;
    px->parts = &px->h->layout.parts;
    px->np = px->parts->n_parts;
    px->hash = xxh_key;
    px->path = calloc(px->n ? px->n : 1, sizeof(*px->path));
    px->owner = calloc(px->n ? px->n : 1, sizeof(*px->owner));
    px->owned = calloc(PREFIX_OWNERS, sizeof(*px->owned));
    px->hits = calloc(px->n ? px->n : 1, sizeof(*px->hits));
    if (px->path == NULL || px->owner == NULL || px->owned == NULL || px->hits == NULL) {
        free(px->path);
        free(px->owner);
        free(px->owned);
        free(px->hits);
        free(px);
        kvd_seterr(err, errlen, KVD_ENOMEM, "prefix: out of memory");
        return NULL;
    }
    if (pool_is_fresh(p)) {
        reset_empty(px);
        return px;
    }
    /* adopted: the records come from shared memory and are checked first */
    char why[256];
    if (prefix_check(px, why, sizeof(why)) != 0) {
        if (note && note_len)
            snprintf(note, note_len, "cache records were inconsistent (%s); cache reset", why);
        reset_empty(px);
    } else if (px->cs->n_used || px->cs->n_pending) {
        if (note && note_len)
            snprintf(note, note_len,
                     "the previous owner left %u blocks in use and %u pending; cache reset",
                     px->cs->n_used, px->cs->n_pending);
        reset_empty(px);
    }
    paths_rebuild(px);
    return px;
}

void prefix_destroy(prefix_t **pxp)
{
    if (pxp == NULL || *pxp == NULL)
        return;
    free((*pxp)->path);
    free((*pxp)->owner);
    free((*pxp)->owned);
    free((*pxp)->hits);
    free(*pxp);
    *pxp = NULL;
}

void prefix_set_owner_limit(prefix_t *px, uint32_t max_blocks)
{
    px->owner_limit = max_blocks;
}

uint32_t prefix_owned(const prefix_t *px, uint16_t owner)
{
    return owner != 0 ? px->owned[owner] : 0;
}

void prefix_set_observer(prefix_t *px, const struct prefix_observer *o)
{
    if (o != NULL)
        px->obs = *o;
    else
        memset(&px->obs, 0, sizeof(px->obs));
}

int prefix_set_tier(prefix_t *px, const struct prefix_tier *t)
{
    if (t == NULL) {
        memset(&px->tier, 0, sizeof(px->tier));
        return 0;
    }
    if ((t->fetch == NULL) == (t->start == NULL) || ((px->np > 1 || t->start) && t->has == NULL))
        return KVD_EINVAL;      /* a pool of parts plans a restore from has(); a copy starts only
                                 * for a block the tier has */
    px->tier = *t;
    return 0;
}

/* An asynchronous tier's copy of b into pool block id starts. */
static void restore_start(prefix_t *px, struct prefix_seq *s, uint32_t logical,
                          const struct prefix_tier_block *b, uint32_t id)
{
    s->n_restoring++;
    px->tier.start(px->tier.user, b, logical, pool_block_addr(px->pool, id));
}

/* Takes block b of a tier into a newly allocated pool block, indexed under
 * parent (a part block: flagged), as logical block `logical` of s: fetched and
 * committed at once, or, with an asynchronous tier, left pending while its
 * copy runs (s->n_restoring counts it; prefix_seq_restored commits it),
 * started here when start_now is set. POOL_NONE when no block can be had or the tier does not give it after all. */
static uint32_t restore_block(prefix_t *px, struct prefix_seq *s, uint32_t logical,
                              const struct prefix_tier_block *b, uint32_t parent, bool start_now)
{
    if (px->cs->n_free + px->cs->n_cached == 0)
        return POOL_NONE;
    const uint32_t id = alloc_one(px, s->owner);   /* what it evicts goes down to the tier */
    if (id == POOL_NONE)
        return POOL_NONE;
    if (px->tier.start == NULL) {
        if (!px->tier.fetch(px->tier.user, b, pool_block_addr(px->pool, id))) {
            unref(px, id);      /* pending, not indexed: back to the free list */
            return POOL_NONE;
        }
        px->b[id].state = POOL_BLOCK_COMMITTED;
        px->cs->n_pending--;
        px->cs->n_used++;
        px->restored++;
    }
    /* a pending one is indexed too: a lookup that meets it waits for it, as
     * for a block a prefill computes */
    index_insert(px, id, b->key, b->ns, parent, b->tokens);
    if (b->part)
        px->b[id].flags |= POOL_BLOCK_PART;
    if (px->tier.start != NULL && start_now)
        restore_start(px, s, logical, b, id);
    return id;
}

/* Where a block that would continue a prefix is: in the pool (id), in the
 * tier (its identity), or nowhere. */
struct found {
    uint32_t id;                /* pool block, or POOL_NONE */
    bool tier;                  /* the tier has it */
    struct prefix_tier_block tb;
};

/* Looks up the block of key k after the parent block (a pool block, or
 * POOL_NONE when the parent is not in the pool: then the block cannot be
 * either, and only the tier is asked): in the pool first, then the tier.
 * *pending (when given) gets a pending pool block, which ends the search. */
static bool find_block(prefix_t *px, prefix_key_t k, prefix_key_t parent_key, prefix_key_t parent_path,
                       prefix_ns_t ns, uint32_t parent, bool parent_in_pool, const int32_t *t, uint32_t part,
                       struct found *f, uint32_t *pending)
{
    f->id = POOL_NONE;
    f->tier = false;
    f->tb = (struct prefix_tier_block){ .key = k, .parent = parent_key, .ns = ns, .tokens = t,
                                        .path = path_of(px, parent_path, ns, t), .part = part };
    if (parent_in_pool) {
        const uint32_t id = index_find(px, k, ns, parent, t);
        if (id != POOL_NONE) {
            if (px->b[id].state != POOL_BLOCK_COMMITTED) {
                if (pending != NULL)
                    *pending = id;
                return false;
            }
            f->id = id;
            return true;
        }
    }
    f->tier = !px->tier.has || px->tier.has(px->tier.user, &f->tb);
    return f->tier;
}

/*
 * restore_from_tier for a pool of parts: the prefix of s (n_blocks logical
 * blocks, all parts held) goes on to the longest m <= max such that part 0's
 * blocks [n_blocks, m) are in the pool or the tier, and every other part's
 * blocks that a continuation from m reads (a full part all of them, a
 * windowed one its last window) are too. They are taken (pool) or restored
 * (tier), the windowed parts' tables slide to m, and s grows to m. All or
 * nothing: should a restore fail on the way, everything taken is let go again
 * and s stays as it was. Returns the part-0 blocks restored.
 */
static uint32_t restore_parts(prefix_t *px, struct prefix_seq *s, const int32_t *tokens, uint32_t max,
                              uint32_t *pending)
{
    const uint32_t j = s->n_blocks, np = px->np, span = max - j;
    const struct chain_ns cn = seq_chain(s);
    struct found *f = calloc((size_t)np * span, sizeof(*f));
    uint8_t *st = calloc((size_t)np * span, 1);        /* 0 unknown, 1 there, 2 missing */
    if (f == NULL || st == NULL) {
        free(f);
        free(st);
        return 0;       /* out of memory: the prefix as the pool has it */
    }
    /* part 0's run: in the pool while its parents are, then only in the tier */
    prefix_key_t key = s->key, path = j ? px->path[s->blocks[j - 1]] : KEY_ZERO;
    uint32_t parent = j ? s->blocks[j - 1] : POOL_NONE, m = j;
    bool in_pool = true;
    for (uint32_t i = j; i < max; i++) {
        const int32_t *t = tokens + (size_t)i * px->bt;
        struct found *x = &f[i - j];
        const prefix_ns_t ins = ns_at(&cn, i);
        if (!find_block(px, key_of(px, key, ins, t), key, path, ins, parent, in_pool, t, 0, x, pending))
            break;
        key = x->tb.key;
        path = x->tb.path;
        parent = x->id;
        in_pool = x->id != POOL_NONE;
        m = i + 1;
    }
    /* the longest m whose last windows every other part has (each block looked
     * up once, from the end down), and whose restores the pool has room for
     * (free and cached blocks, less the cached ones it takes as they are) */
    for (; m > j; m--) {
        bool ok = true;
        uint64_t need = 0;
        for (uint32_t p = 1; p < np && ok; p++) {
            const uint64_t lo = kv_window_first_block(px->parts->window[p], (uint64_t)m * px->bt, px->bt);
            for (uint64_t i = m; ok && i-- > (lo > j ? lo : j);) {
                uint8_t *x = &st[(size_t)p * span + (i - j)];
                const prefix_ns_t pns = part_ns(ns_at(&cn, i), p);
                if (*x == 0) {
                    const struct found *p0 = &f[i - j];
                    const int32_t *t = tokens + i * px->bt;
                    *x = find_block(px, key_of(px, p0->tb.key, pns, t), p0->tb.key, p0->tb.path, pns, p0->id,
                                    p0->id != POOL_NONE, t, 1, &f[(size_t)p * span + (i - j)], NULL) ? 1 : 2;
                }
                ok = *x == 1;
            }
        }
        for (uint32_t p = 0; p < np && ok; p++) {
            const uint64_t lo = kv_window_first_block(px->parts->window[p], (uint64_t)m * px->bt, px->bt);
            for (uint64_t i = lo > j ? lo : j; i < m; i++) {
                const uint32_t id = f[(size_t)p * span + (i - j)].id;
                need += id == POOL_NONE || px->b[id].refs == 0;     /* a restore, or a cached block taken */
            }
        }
        if (ok && need <= (uint64_t)px->cs->n_free + px->cs->n_cached)
            break;
    }
    uint32_t restored = 0;
    if (m > j && seq_reserve(s, m) != 0)
        m = j;
    if (m > j) {
        /* what is in the pool first, so that restoring evicts none of it */
        for (uint32_t i = j; i < m; i++)
            for (uint32_t p = 0; p < np; p++) {
                const uint64_t lo = kv_window_first_block(px->parts->window[p], (uint64_t)m * px->bt, px->bt);
                const uint32_t id = f[(size_t)p * span + (i - j)].id;
                s->tables[p][i] = POOL_NONE;
                if (i >= lo && id != POOL_NONE) {
                    ref_committed(px, id);
                    s->tables[p][i] = id;
                }
            }
        bool ok = true;
        for (uint32_t i = j; i < m && ok; i++)
            for (uint32_t p = 0; p < np && ok; p++) {
                const uint64_t lo = kv_window_first_block(px->parts->window[p], (uint64_t)m * px->bt, px->bt);
                const struct found *x = &f[(size_t)p * span + (i - j)];
                if (i < lo || x->id != POOL_NONE)
                    continue;
                const uint32_t par = p == 0 ? (i ? s->tables[0][i - 1] : POOL_NONE) : s->tables[0][i];
                const uint32_t id = restore_block(px, s, i, &x->tb, par, false);
                s->tables[p][i] = id;
                ok = id != POOL_NONE;
                restored += ok && p == 0;
            }
        if (!ok) {
            /* let go of what was taken, last first, the other parts before part 0 */
            for (uint32_t i = m; i-- > j;)
                for (uint32_t p = np; p-- > 0;)
                    if (s->tables[p][i] != POOL_NONE) {
                        unref(px, s->tables[p][i]);
                        s->tables[p][i] = POOL_NONE;
                    }
            restored = 0;
            m = j;
        } else if (px->tier.start != NULL) {
            /* every block had, the copies start (none may be let go once begun) */
            for (uint32_t i = j; i < m; i++)
                for (uint32_t p = 0; p < np; p++) {
                    const uint64_t lo = kv_window_first_block(px->parts->window[p], (uint64_t)m * px->bt, px->bt);
                    const struct found *x = &f[(size_t)p * span + (i - j)];
                    if (i >= lo && x->id == POOL_NONE)
                        restore_start(px, s, i, &x->tb, s->tables[p][i]);
                }
        }
    }
    if (m > j) {
        /* the windowed parts slide from j's window to m's */
        for (uint32_t p = 1; p < np; p++) {
            const uint64_t lo = kv_window_first_block(px->parts->window[p], (uint64_t)m * px->bt, px->bt);
            while (s->first[p] < lo && s->first[p] < j) {
                const uint32_t i = s->first[p]++;
                unref(px, s->tables[p][i]);
                s->tables[p][i] = POOL_NONE;
            }
            if (s->first[p] < lo)
                s->first[p] = (uint32_t)lo;
        }
        s->key = f[m - 1 - j].tb.key;
        s->n_blocks = s->n_cached = s->n_committed = s->n_indexed = m;
        s->n_restored += restored;
        if (px->obs.stored && px->tier.start == NULL)  /* part 0's restored blocks are findable again */
            for (uint32_t i = j; i < m; i++)
                if (f[i - j].id == POOL_NONE)
                    px->obs.stored(px->obs.user, &f[i - j].tb.key, 1, i ? &f[i - j].tb.parent : NULL,
                                   f[i - j].tb.tokens, f[i - j].tb.ns);
    }
    free(f);
    free(st);
    return restored;
}


/* Continues s's cached prefix of s->n_blocks blocks (all referenced) with
 * blocks the tier gives back, up to max blocks of tokens: each into a newly
 * allocated block, then committed and indexed as if computed (a block still in
 * the pool after them is taken as it is). Stops at the first block the tier
 * does not give, at a pending one (someone computes it: *pending gets it), or
 * when no block can be had. Returns how many it restored. */
static uint32_t restore_from_tier(prefix_t *px, struct prefix_seq *s, const int32_t *tokens, uint32_t max,
                                  uint32_t *pending)
{
    uint32_t i = s->n_blocks, parent = i ? s->blocks[i - 1] : POOL_NONE;
    const struct chain_ns cn = seq_chain(s);
    prefix_key_t key = s->key;
    prefix_key_t path = parent != POOL_NONE ? px->path[parent] : KEY_ZERO;
    for (; i < max; i++) {
        const int32_t *t = tokens + (size_t)i * px->bt;
        const prefix_ns_t ns = ns_at(&cn, i);
        const prefix_key_t k = key_of(px, key, ns, t);
        const uint32_t there = index_find(px, k, ns, parent, t);
        if (there != POOL_NONE) {
            if (px->b[there].state != POOL_BLOCK_COMMITTED) {
                *pending = there;   /* someone computes it */
                break;
            }
            ref_committed(px, there);  /* still in the pool past a restored stretch */
            s->blocks[i] = there;
            key = k;
            parent = there;
            path = px->path[there];
            continue;
        }
        const struct prefix_tier_block tb = { .key = k, .parent = key, .ns = ns, .tokens = t,
                                              .path = path_of(px, path, ns, t) };
        if (px->cs->n_free + px->cs->n_cached == 0 || (px->tier.has && !px->tier.has(px->tier.user, &tb)))
            break;
        const uint32_t id = restore_block(px, s, i, &tb, parent, true);
        if (id == POOL_NONE)
            break;
        s->blocks[i] = id;
        key = k;
        parent = id;
        path = px->path[id];
        s->n_restored++;
        if (px->obs.stored && px->tier.start == NULL)   /* findable again */
            px->obs.stored(px->obs.user, &k, 1, i ? &tb.parent : NULL, t, ns);
    }
    s->key = key;
    s->n_blocks = s->n_cached = s->n_committed = s->n_indexed = i;
    return s->n_restored;
}

int prefix_set_hash(prefix_t *px, prefix_hash_fn fn)
{
    if (px->cs->n_indexed != 0)
        return KVD_ESTATE;
    px->hash = fn ? fn : xxh_key;
    return 0;
}

uint32_t prefix_block_tokens(const prefix_t *px)
{
    return px->bt;
}

void prefix_hash_chain(const prefix_t *px, prefix_ns_t ns, const int32_t *tokens, uint32_t n_blocks,
                       prefix_key_t *keys)
{
    prefix_key_t k = KEY_ZERO;
    for (uint32_t i = 0; i < n_blocks; i++)
        keys[i] = k = key_of(px, k, ns, tokens + (size_t)i * px->bt);
}

/*
 * Of the m leading part-0 blocks `table` found for tokens, the longest prefix
 * j <= m that every other part can continue: a full part holds its blocks
 * [0, j), a windowed one those its window reads from position j x bt on. With
 * ids, the blocks of the other parts found: part p's block i at ids[p x
 * stride + i].
 * Each block is looked up once, from the end down, so a hit costs about a
 * window's lookups per part. 0 when out of memory (a miss, never a wrong hit).
 */
static uint32_t parts_match(prefix_t *px, const struct chain_ns *cn, const int32_t *tokens, uint32_t m,
                            const uint32_t *table, uint32_t *ids, size_t stride)
{
    if (px->np == 1 || m == 0)
        return m;
    uint8_t *st = calloc((size_t)px->np * m, 1);  /* 0 unknown, 1 present, 2 missing */
    if (st == NULL)
        return 0;
    uint32_t j = m;
    for (; j > 0; j--) {
        bool ok = true;
        for (uint32_t p = 1; p < px->np && ok; p++) {
            const uint64_t lo = kv_window_first_block(px->parts->window[p], (uint64_t)j * px->bt, px->bt);
            for (uint64_t i = j; ok && i-- > lo;) {
                uint8_t *x = &st[(size_t)p * m + i];
                if (*x == 0) {
                    const prefix_ns_t pns = part_ns(ns_at(cn, i), p);
                    const int32_t *t = tokens + i * px->bt;
                    const prefix_key_t k = key_of(px, key_get(&px->b[table[i]]), pns, t);
                    const uint32_t id = index_find(px, k, pns, table[i], t);
                    *x = id != POOL_NONE && px->b[id].state == POOL_BLOCK_COMMITTED ? 1 : 2;
                    if (*x == 1 && ids != NULL)
                        ids[(size_t)p * stride + i] = id;
                }
                ok = *x == 1;
            }
        }
        if (ok)
            break;
    }
    free(st);
    return j;
}

/*
 * Part 0's blocks [j, m) of table were found for tokens, but the other parts
 * cannot continue them: they are recomputed, and a copy of an indexed block
 * would stay private and close the new sequence's chain. Evicts them, from
 * the end back, with the other parts' blocks that hang from them, while
 * nothing else needs them: not held, and no other chain continuing (such a
 * block could only serve hits that just failed).
 */
static void drop_unusable(prefix_t *px, const struct chain_ns *cn, const int32_t *tokens, const uint32_t *table,
                          uint32_t j, uint32_t m)
{
    for (uint32_t i = m; i-- > j;) {
        const uint32_t id = table[i];
        const struct pool_block *r = &px->b[id];
        if (r->refs != 0 || r->state != POOL_BLOCK_COMMITTED)
            return;
        uint32_t hanging[KV_MAX_PARTS], n = 0;
        const int32_t *t = tokens + (size_t)i * px->bt;
        for (uint32_t p = 1; p < px->np; p++) {
            const prefix_ns_t pns = part_ns(ns_at(cn, i), p);
            const uint32_t c = index_find(px, key_of(px, key_get(r), pns, t), pns, id, t);
            if (c == POOL_NONE)
                continue;
            if (px->b[c].refs != 0 || px->b[c].state != POOL_BLOCK_COMMITTED)
                return;
            hanging[n++] = c;
        }
        if (r->n_children != n)
            return;     /* another chain goes on from it */
        for (uint32_t c = 0; c < n; c++)
            evict_one(px, hanging[c]);
        evict_one(px, id);
    }
}

/*
 * The longest cached prefix of tokens[0..n) that every part can continue, at
 * most max_blocks blocks: part 0's blocks into table (room for max_blocks),
 * with ids the other parts' (part-major, room for n_parts x max_blocks). A
 * pending block continues it only when part 0's whole walk stands. *last: the
 * key of the last block taken. With drop, part 0's blocks found past the
 * prefix are evicted where nothing else needs them (drop_unusable).
 */
static uint32_t match(prefix_t *px, const struct chain_ns *cn, const int32_t *tokens, uint64_t n,
                      uint32_t max_blocks, uint32_t *table, uint32_t *ids, uint32_t *pending,
                      prefix_key_t *last, bool drop)
{
    const uint32_t m = walk(px, cn, tokens, n, max_blocks, table, pending, last);
    if (px->np == 1 || m == 0)
        return m;
    const uint32_t j = parts_match(px, cn, tokens, m, table, ids, max_blocks);
    if (j < m) {
        *pending = POOL_NONE;   /* what is pending continues part 0 alone */
        px->cs->hit_blocks -= m - j;
        *last = j ? key_get(&px->b[table[j - 1]]) : KEY_ZERO;
        if (drop)
            drop_unusable(px, cn, tokens, table, j, m);
    }
    return j;
}

static void lookup(prefix_t *px, const struct chain_ns *cn, const int32_t *tokens, uint64_t n,
                   uint32_t max_blocks, uint32_t *ids, struct prefix_match *m)
{
    prefix_key_t last;
    uint64_t full = n / px->bt;
    if (max_blocks > full)
        max_blocks = (uint32_t)full;
    uint32_t *table = ids;    /* part 0's blocks: parts_match reads them */
    if (table == NULL && px->np > 1 &&
        (table = malloc(((size_t)max_blocks + 1) * sizeof(*table))) == NULL) {
        m->n_blocks = 0;    /* out of memory: a miss, never a wrong hit */
        m->pending = POOL_NONE;
        return;
    }
    m->n_blocks = match(px, cn, tokens, n, max_blocks, table, NULL, &m->pending, &last, false);
    if (table != ids)
        free(table);
}

void prefix_lookup(prefix_t *px, prefix_ns_t ns, const int32_t *tokens, uint64_t n,
                   uint32_t max_blocks, uint32_t *ids, struct prefix_match *m)
{
    const struct chain_ns cn = { ns, ns, 0 };
    lookup(px, &cn, tokens, n, max_blocks, ids, m);
}

uint32_t prefix_seq_probe(prefix_t *px, const struct prefix_seq *s, prefix_ns_t ns,
                          const int32_t *tokens, uint64_t n)
{
    if (n == 0)
        return 0;
    const struct chain_ns cn = { ns, s->public_ns, s->n_public };
    struct prefix_match m;
    lookup(px, &cn, tokens, n, (uint32_t)((n - 1) / px->bt), NULL, &m);
    return m.n_blocks;
}

int64_t prefix_seq_begin(prefix_t *px, struct prefix_seq *s, prefix_ns_t ns,
                         const int32_t *tokens, uint64_t n, uint32_t *wait_block)
{
    int rc;
    if (wait_block)
        *wait_block = POOL_NONE;
    if (s->n_blocks != 0)
        return KVD_ESTATE;
    if ((rc = seq_parts_init(px, s)) != 0)
        return rc;
    s->ns = ns;
    s->n_cached = s->n_committed = s->n_indexed = s->n_restored = s->n_restoring = 0;
    s->chain_open = true;
    s->key = KEY_ZERO;
    memset(s->first, 0, sizeof(s->first));
    uint64_t max = n ? (n - 1) / px->bt : 0;
    if (max > px->n)
        max = px->n;
    rc = seq_reserve(s, max ? max : 1);
    if (rc)
        return rc;
    uint32_t pending, *ids = NULL;
    if (px->np > 1 && max > 0 && (ids = malloc((size_t)px->np * max * sizeof(*ids))) == NULL)
        return KVD_ENOMEM;
    const struct chain_ns cn = seq_chain(s);
    const uint32_t m = match(px, &cn, tokens, n, (uint32_t)max, s->blocks, ids, &pending, &s->key, true);
    for (uint32_t p = 1; p < px->np; p++) {
        const uint64_t lo = kv_window_first_block(px->parts->window[p], (uint64_t)m * px->bt, px->bt);
        s->first[p] = (uint32_t)lo;
        for (uint32_t i = 0; i < m; i++) {
            s->tables[p][i] = i < lo ? POOL_NONE : ids[(size_t)p * max + i];
            if (i >= lo)
                ref_committed(px, s->tables[p][i]);
        }
    }
    free(ids);
    for (uint32_t i = 0; i < m; i++) {
        ref_committed(px, s->blocks[i]);
        px->hits[s->blocks[i]]++;
    }
    s->n_blocks = s->n_cached = s->n_committed = s->n_indexed = m;
    if ((px->tier.fetch != NULL || px->tier.start != NULL) && !s->pool_only && pending == POOL_NONE && m < max) {
        if (px->np > 1)
            restore_parts(px, s, tokens, (uint32_t)max, &pending);
        else
            restore_from_tier(px, s, tokens, (uint32_t)max, &pending);
    }
    if (wait_block)
        *wait_block = pending;
    return (int64_t)s->n_blocks * px->bt;
}

int prefix_seq_grow(prefix_t *px, struct prefix_seq *s, uint64_t n_pos, const int32_t *tokens,
                    uint64_t n_known)
{
    uint64_t need = (n_pos + px->bt - 1) / px->bt;
    if (need <= s->n_blocks)
        return 0;
    int rc = seq_parts_init(px, s);
    if (rc)
        return rc;
    uint64_t k = (need - s->n_blocks) * s->n_parts;
    if (k > (uint64_t)px->cs->n_free + px->cs->n_cached)
        return KVD_ENOSPACE;
    if (s->owner != 0 && px->owner_limit != 0 && px->owned[s->owner] + k > px->owner_limit &&
        px->owned[s->owner] + k - px->owner_limit > owned_cached(px, s->owner))
        return KVD_ENOSPACE;    /* over its owner's limit even with all its cached blocks gone */
    rc = seq_reserve(s, need);
    if (rc)
        return rc;
    /* allocate (and so evict) everything first: a block of the same content
     * that the duplicate check finds must not be evicted right after */
    uint32_t first = s->n_blocks;
    while (s->n_blocks < need) {
        for (uint32_t p = 0; p < s->n_parts; p++) {
            uint32_t id = alloc_one(px, s->owner);
            if (id == POOL_NONE)
                return KVD_ENOSPACE; /* unreachable: counted above */
            s->tables[p][s->n_blocks] = id;
        }
        s->n_blocks++;
    }
    for (uint32_t i = first; i < need && (uint64_t)(i + 1) * px->bt <= n_known; i++)
        seq_try_index(px, s, i, tokens + (size_t)i * px->bt);
    return 0;
}

/* Releases the blocks that the windowed parts of s no longer read once its
 * positions [0, n_written) are written (committed ones only), oldest first. */
static void seq_slide(prefix_t *px, struct prefix_seq *s, uint64_t n_written)
{
    for (uint32_t p = 1; p < s->n_parts; p++) {
        uint64_t lo = kv_window_first_block(px->parts->window[p], n_written, px->bt);
        if (lo > s->n_committed)
            lo = s->n_committed;
        while (s->first[p] < lo) {
            const uint32_t i = s->first[p]++;
            unref(px, s->tables[p][i]);
            s->tables[p][i] = POOL_NONE;
        }
    }
}

/* Tells the observer that blocks [from, to) of s became findable, in runs of
 * one namespace each (a prompt's public blocks, then its own). */
static void notify_stored(prefix_t *px, const struct prefix_seq *s, uint32_t from, uint32_t to,
                          const int32_t *tokens)
{
    enum { RUN = 64 };
    prefix_key_t keys[RUN];
    while (from < to) {
        const struct pool_block *first = &px->b[s->blocks[from]];
        const prefix_ns_t ns = { first->ns[0], first->ns[1] };
        uint32_t n = 0;
        for (; n < RUN && from + n < to; n++) {
            const struct pool_block *b = &px->b[s->blocks[from + n]];
            if (b->ns[0] != ns.lo || b->ns[1] != ns.hi)
                break;
            keys[n] = key_get(b);
        }
        const prefix_key_t parent = from ? key_get(&px->b[s->blocks[from - 1]]) : KEY_ZERO;
        px->obs.stored(px->obs.user, keys, n, from ? &parent : NULL, tokens + (size_t)from * px->bt, ns);
        from += n;
    }
}

int prefix_seq_commit(prefix_t *px, struct prefix_seq *s, const int32_t *tokens,
                      uint64_t n_written)
{
    if (n_written > (uint64_t)s->n_blocks * px->bt)
        return KVD_ERANGE;
    uint32_t full = (uint32_t)(n_written / px->bt);
    int rc = 0;
    uint32_t run = UINT32_MAX;      /* first block of the run that became findable */
    for (uint32_t i = s->n_committed; i < full; i++) {
        uint32_t id = s->blocks[i];
        struct pool_block *r = &px->b[id];
        const int32_t *t = tokens + (size_t)i * px->bt;
        if (r->flags & POOL_BLOCK_INDEXED) {
            if (memcmp(px->tok + (size_t)id * px->bt, t, (size_t)px->bt * 4) != 0) {
                /* the tokens promised at grow time were not the ones written:
                 * unindex this block and the pending ones after it, last first */
                for (uint32_t j = s->n_indexed; j-- > i;) {
                    for (uint32_t p = s->n_parts; p-- > 1;)
                        if (s->tables[p][j] != POOL_NONE &&
                            (px->b[s->tables[p][j]].flags & POOL_BLOCK_INDEXED))
                            index_remove(px, s->tables[p][j]);
                    index_remove(px, s->blocks[j]);
                }
                s->n_indexed = i;
                s->chain_open = false;
                rc = KVD_EINVAL;
            }
        } else {
            seq_try_index(px, s, i, t);
        }
        const bool findable = r->state == POOL_BLOCK_PENDING && (r->flags & POOL_BLOCK_INDEXED);
        for (uint32_t p = 0; p < s->n_parts; p++) {
            const uint32_t pid = s->tables[p][i];
            if (pid == POOL_NONE || px->b[pid].state != POOL_BLOCK_PENDING)
                continue;
            px->b[pid].state = POOL_BLOCK_COMMITTED;
            px->cs->n_pending--;
            px->cs->n_used++;
        }
        s->n_committed = i + 1;
        if (findable && px->tier.committed) {
            /* written through: part 0's block and the other parts' of the same positions */
            for (uint32_t p = 0; p < s->n_parts; p++) {
                const uint32_t pid = s->tables[p][i];
                const struct pool_block *pr = pid != POOL_NONE ? &px->b[pid] : NULL;
                if (pr == NULL || !(pr->flags & POOL_BLOCK_INDEXED))
                    continue;
                const struct prefix_tier_block tb = {
                    .key = key_get(pr),
                    .parent = pr->parent != POOL_NONE ? key_get(&px->b[pr->parent]) : KEY_ZERO,
                    .ns = { pr->ns[0], pr->ns[1] }, .tokens = t, .path = px->path[pid], .part = p > 0,
                };
                px->tier.committed(px->tier.user, &tb, pool_block_addr(px->pool, pid));
            }
        }
        if (findable && run == UINT32_MAX)
            run = i;
        if (!findable && run != UINT32_MAX) {
            if (px->obs.stored)
                notify_stored(px, s, run, i, tokens);
            run = UINT32_MAX;
        }
    }
    if (run != UINT32_MAX && px->obs.stored)
        notify_stored(px, s, run, full, tokens);
    seq_slide(px, s, n_written);
    return rc;
}

void prefix_seq_release(prefix_t *px, struct prefix_seq *s)
{
    prefix_window_done(px, s);      /* what a window kept off the tables: later in every chain */
    /* last first, and a logical block's other parts before its part-0 block:
     * along every chain a parent is then more recent than its children */
    while (s->n_blocks > 0) {
        const uint32_t i = --s->n_blocks;
        for (uint32_t p = s->n_parts; p-- > 1;)
            if (s->tables[p][i] != POOL_NONE)
                unref(px, s->tables[p][i]);
        unref(px, s->blocks[i]);
    }
    memset(s->first, 0, sizeof(s->first));
    s->n_cached = s->n_committed = s->n_indexed = s->n_restored = s->n_restoring = 0;
    s->chain_open = true;
    s->key = KEY_ZERO;
}

uint32_t prefix_seq_release_evict(prefix_t *px, struct prefix_seq *s)
{
    const uint32_t n = s->n_blocks, np = s->n_parts ? s->n_parts : 1;
    uint32_t *ids = n ? malloc((size_t)n * np * sizeof(*ids)) : NULL;
    size_t k = 0;
    /* the same order as release: later blocks first, other parts before part 0,
     * so that each block met is a leaf by the time it is met */
    for (uint32_t i = n; ids != NULL && i-- > 0;)
        for (uint32_t p = np; p-- > 0;) {
            const uint32_t id = p == 0 ? s->blocks[i] : s->tables[p][i];
            if (id != POOL_NONE)
                ids[k++] = id;
        }
    prefix_seq_release(px, s);
    uint32_t done = 0;
    for (size_t j = 0; j < k; j++) {
        const struct pool_block *r = &px->b[ids[j]];
        if (r->refs == 0 && r->state == POOL_BLOCK_COMMITTED && (r->flags & POOL_BLOCK_INDEXED) &&
            r->n_children == 0) {
            evict_one(px, ids[j]);
            done++;
        }
    }
    free(ids);
    return done;
}

/* Takes the pending blocks of s's logical blocks [from, to) out of the index,
 * last first and other parts before part 0 (children before parents; a
 * pending block's indexed children are pending blocks after it). Returns the
 * first logical block that had a pending one, or `to`. */
static uint32_t unindex_pending(prefix_t *px, struct prefix_seq *s, uint32_t from, uint32_t to)
{
    uint32_t first = to;
    for (uint32_t i = to; i-- > from;)
        for (uint32_t p = s->n_parts; p-- > 0;) {
            const uint32_t id = s->tables[p][i];
            if (id == POOL_NONE || px->b[id].state != POOL_BLOCK_PENDING)
                continue;
            if (px->b[id].flags & POOL_BLOCK_INDEXED)
                index_remove(px, id);
            first = i;
        }
    return first;
}

void prefix_seq_hide_pending(prefix_t *px, struct prefix_seq *s)
{
    const uint32_t first = unindex_pending(px, s, 0, s->n_blocks);
    if (s->n_indexed > first) {
        s->n_indexed = first;
        s->key = first > 0 ? key_get(&px->b[s->blocks[first - 1]]) : KEY_ZERO;
    }
    s->chain_open = false;
}

bool prefix_seq_restored(prefix_t *px, struct prefix_seq *s, const int32_t *tokens, uint32_t n_good)
{
    /* the blocks begin left pending for a tier's copies are the pending ones
     * of the cached prefix (nothing else there is pending) */
    uint32_t run = UINT32_MAX;      /* first of a run of part 0's blocks that became findable */
    for (uint32_t i = 0; i < s->n_cached && i < n_good; i++) {
        bool p0 = false;
        for (uint32_t p = 0; p < s->n_parts; p++) {
            const uint32_t id = s->tables[p][i];
            if (id == POOL_NONE || px->b[id].state != POOL_BLOCK_PENDING)
                continue;
            px->b[id].state = POOL_BLOCK_COMMITTED;
            px->cs->n_pending--;
            px->cs->n_used++;
            px->restored++;
            p0 |= p == 0;
        }
        if (p0 && run == UINT32_MAX)
            run = i;
        if (!p0 && run != UINT32_MAX) {
            if (px->obs.stored)
                notify_stored(px, s, run, i, tokens);
            run = UINT32_MAX;
        }
    }
    if (run != UINT32_MAX && px->obs.stored)
        notify_stored(px, s, run, n_good < s->n_cached ? n_good : s->n_cached, tokens);
    /* those whose copies failed leave the index */
    const bool whole = n_good >= s->n_cached || unindex_pending(px, s, n_good, s->n_cached) == s->n_cached;
    s->n_restoring = 0;
    return whole;
}

int64_t prefix_seq_window(prefix_t *px, struct prefix_seq *s, uint32_t keep, uint32_t drop,
                          uint32_t (*copy)[2])
{
    if (drop == 0 || (uint64_t)keep + drop >= s->n_blocks)
        return KVD_EINVAL;
    const uint32_t np = s->n_parts ? s->n_parts : 1;
    for (uint32_t i = keep; i < keep + drop; i++)
        for (uint32_t p = 0; p < np; p++) {
            const uint32_t id = s->tables[p][i];
            if (id != POOL_NONE && px->b[id].state != POOL_BLOCK_COMMITTED)
                return KVD_EINVAL;  /* (a windowed part may have let it go already) */
        }
    /* private copies of the shared or findable moved blocks first, while s
     * still holds everything: nothing it holds can be evicted for them, and
     * when they cannot all be had, those taken are given back and s is as it
     * was (all or nothing) */
    uint32_t k = 0;
    for (uint32_t i = keep + drop; i < s->n_blocks; i++)
        for (uint32_t p = 0; p < np; p++) {
            const uint32_t id = s->tables[p][i];
            if (id == POOL_NONE || !(px->b[id].refs > 1 || (px->b[id].flags & POOL_BLOCK_INDEXED)))
                continue;
            const uint32_t to = alloc_one(px, s->owner);
            if (to == POOL_NONE) {
                for (uint32_t j = k; j-- > 0;)
                    unref(px, copy[j][1]);      /* pending, unindexed: freed */
                return KVD_ENOSPACE;
            }
            copy[k][0] = id;
            copy[k][1] = to;
            k++;
        }
    /* now the table: the copies replace their sources; s keeps holding the
     * sources and the dropped blocks (s->held, in chain order: released last
     * first) until the caller has made the copies */
    const uint64_t need = (uint64_t)drop * np + k;
    if (need > s->held_cap - s->n_held) {
        uint32_t *h = realloc(s->held, (size_t)(s->n_held + need) * sizeof(uint32_t));
        if (h == NULL) {
            for (uint32_t j = k; j-- > 0;)
                unref(px, copy[j][1]);
            return KVD_ENOMEM;
        }
        s->held = h;
        s->held_cap = s->n_held + (uint32_t)need;
    }
    for (uint32_t i = keep; i < keep + drop; i++)
        for (uint32_t p = 0; p < np; p++)     /* part 0 first: it goes last */
            if (s->tables[p][i] != POOL_NONE)
                s->held[s->n_held++] = s->tables[p][i];
    for (uint32_t j = 0, i = keep + drop; i < s->n_blocks && j < k; i++)
        for (uint32_t p = 0; p < np && j < k; p++)
            if (s->tables[p][i] == copy[j][0]) {
                if (px->b[copy[j][0]].state == POOL_BLOCK_COMMITTED) {
                    px->b[copy[j][1]].state = POOL_BLOCK_COMMITTED;
                    px->cs->n_pending--;
                    px->cs->n_used++;
                }
                s->held[s->n_held++] = copy[j][0];
                s->tables[p][i] = copy[j][1];
                j++;
            }
    for (uint32_t p = 0; p < np; p++) {
        memmove(s->tables[p] + keep, s->tables[p] + keep + drop,
                (size_t)(s->n_blocks - keep - drop) * sizeof(uint32_t));
        /* a windowed part's first held entry moves with the rest; one that
         * fell among the dropped now is the first moved one */
        if (s->first[p] >= keep + drop)
            s->first[p] -= drop;
        else if (s->first[p] > keep)
            s->first[p] = keep;
    }
    s->n_blocks -= drop;
    s->n_committed = s->n_committed > keep + drop ? s->n_committed - drop : keep;
    if (s->n_indexed > keep)
        s->n_indexed = keep;
    if (s->n_cached > keep)
        s->n_cached = keep;
    s->key = s->n_indexed > 0 ? key_get(&px->b[s->blocks[s->n_indexed - 1]]) : KEY_ZERO;
    s->chain_open = false;
    return k;
}

void prefix_window_done(prefix_t *px, struct prefix_seq *s)
{
    while (s->n_held > 0)
        unref(px, s->held[--s->n_held]);
}

void prefix_seq_fini(struct prefix_seq *s)
{
    for (uint32_t p = 0; p < KV_MAX_PARTS; p++)
        free(s->tables[p]);
    free(s->held);
    memset(s, 0, sizeof(*s));
}

size_t prefix_seq_flat(const struct prefix_seq *s, uint32_t from, uint32_t *out)
{
    size_t k = 0;
    for (uint32_t i = from; i < s->n_blocks; i++)
        for (uint32_t p = 0; p < s->n_parts; p++)
            out[k++] = s->tables[p][i];
    return k;
}

uint32_t prefix_evict(prefix_t *px, uint32_t n)
{
    uint32_t done = 0;
    while (done < n) {
        uint32_t v = evict_pick(px);
        if (v == POOL_NONE)
            break;
        evict_one(px, v);
        done++;
    }
    return done;
}

void prefix_stats(const prefix_t *px, struct prefix_stats *st)
{
    const struct pool_cache_state *cs = px->cs;
    st->n_blocks = px->n;
    st->n_free = cs->n_free;
    st->n_cached = cs->n_cached;
    st->n_used = cs->n_used;
    st->n_pending = cs->n_pending;
    st->n_indexed = cs->n_indexed;
    st->block_bytes = px->h->block_bytes;
    st->evictions = cs->evictions;
    st->lookups = cs->lookups;
    st->hit_blocks = cs->hit_blocks;
    st->collisions = cs->collisions;
    st->restored = px->restored;
}

int prefix_block_info(const prefix_t *px, uint32_t id, struct prefix_block_info *bi)
{
    if (id >= px->n)
        return KVD_ERANGE;
    const struct pool_block *r = &px->b[id];
    bi->key = key_get(r);
    bi->state = r->state;
    bi->refs = r->refs;
    bi->indexed = (r->flags & POOL_BLOCK_INDEXED) != 0;
    bi->on_lru = r->state == POOL_BLOCK_COMMITTED && r->refs == 0 && bi->indexed;
    bi->parent = bi->indexed ? r->parent : POOL_NONE;
    bi->n_children = r->n_children;
    bi->tokens = px->tok + (size_t)id * px->bt;
    bi->ns = (prefix_ns_t){ r->ns[0], r->ns[1] };
    bi->part = bi->indexed && (r->flags & POOL_BLOCK_PART) && r->parent < px->n
                   ? (uint32_t)(r->ns[0] ^ px->b[r->parent].ns[0])
                   : 0;
    bi->owner = px->owner[id];
    bi->hits = px->hits[id];
    return 0;
}

void prefix_for_each_findable(const prefix_t *px,
                              void (*fn)(void *user, prefix_key_t key, const prefix_key_t *parent,
                                         const int32_t *tokens, prefix_ns_t ns),
                              void *user)
{
    for (uint32_t id = 0; id < px->n; id++) {
        const struct pool_block *r = &px->b[id];
        if (r->state != POOL_BLOCK_COMMITTED || !(r->flags & POOL_BLOCK_INDEXED) ||
            (r->flags & POOL_BLOCK_PART))
            continue;
        const prefix_key_t parent = r->parent != POOL_NONE ? key_get(&px->b[r->parent]) : KEY_ZERO;
        fn(user, key_get(r), r->parent != POOL_NONE ? &parent : NULL, px->tok + (size_t)id * px->bt,
           (prefix_ns_t){ r->ns[0], r->ns[1] });
    }
}

uint32_t prefix_lru(const prefix_t *px, uint32_t *ids, uint32_t cap)
{
    uint32_t len = 0;
    for (uint32_t id = px->cs->lru_head; id != POOL_NONE && len <= px->n; id = px->b[id].next) {
        if (len < cap)
            ids[len] = id;
        len++;
    }
    return len;
}

/* ---- the invariant checker -------------------------------------------------------------- */

#define FAIL(...) do { kvd_seterr(err, errlen, KVD_EFORMAT, __VA_ARGS__); goto out; } while (0)

int prefix_check(const prefix_t *px, char *err, size_t errlen)
{
    const struct pool_cache_state *cs = px->cs;
    const struct pool_block *b = px->b;
    const uint32_t n = px->n;
    int rc = KVD_EFORMAT;
    /* per-block scratch: 0 = unseen; list marks and LRU positions */
    uint32_t *mark = calloc(n, sizeof(uint32_t));
    uint32_t *kids = calloc(n, sizeof(uint32_t));
    if (mark == NULL || kids == NULL) {
        rc = kvd_seterr(err, errlen, KVD_ENOMEM, "prefix_check: out of memory");
        goto out;
    }
    uint32_t c_free = 0, c_used = 0, c_pend = 0, c_cached = 0, c_idx = 0;
    for (uint32_t i = 0; i < n; i++) {
        const struct pool_block *r = &b[i];
        bool idx = r->flags & POOL_BLOCK_INDEXED;
        if (r->flags & ~(POOL_BLOCK_INDEXED | POOL_BLOCK_PART) ||
            (r->flags & POOL_BLOCK_PART && !idx))
            FAIL("block %u: unknown flags %#x", i, r->flags);
        if ((r->flags & POOL_BLOCK_PART) &&
            (r->parent >= n || (b[r->parent].flags & POOL_BLOCK_PART) ||
             r->ns[1] != b[r->parent].ns[1] || (r->ns[0] ^ b[r->parent].ns[0]) == 0 ||
             (r->ns[0] ^ b[r->parent].ns[0]) >= px->np))
            FAIL("block %u is indexed as another part's but does not hang from a part-0 block", i);
        switch (r->state) {
        case POOL_BLOCK_FREE:
            if (r->refs || idx)
                FAIL("block %u is free but has %u refs%s", i, r->refs, idx ? " and is indexed" : "");
            if (px->owner != NULL && px->owner[i] != 0)
                FAIL("block %u is free but still counts for owner %u", i, px->owner[i]);
            c_free++;
            break;
        case POOL_BLOCK_PENDING:
            if (r->refs == 0)
                FAIL("block %u is pending with no holder", i);
            c_pend++;
            break;
        case POOL_BLOCK_COMMITTED:
            if (r->refs == 0 && !idx)
                FAIL("block %u is committed, unreferenced and not indexed (lost)", i);
            if (r->refs)
                c_used++;
            else
                c_cached++;
            break;
        default:
            FAIL("block %u: bad state %u", i, r->state);
        }
        if (idx) {
            c_idx++;
            if (r->parent != POOL_NONE) {
                if (r->parent >= n || !(b[r->parent].flags & POOL_BLOCK_INDEXED))
                    FAIL("indexed block %u has a parent %u that is not indexed", i, r->parent);
                if (r->parent == i)
                    FAIL("block %u is its own parent", i);
                kids[r->parent]++;
                if (r->refs && b[r->parent].refs == 0)
                    FAIL("block %u is held but its parent %u is not", i, r->parent);
            }
            prefix_key_t pk = r->parent == POOL_NONE ? KEY_ZERO : key_get(&b[r->parent]);
            prefix_ns_t ns = { r->ns[0], r->ns[1] };
            if (!key_eq(r->key, key_of(px, pk, ns, px->tok + (size_t)i * px->bt)))
                FAIL("block %u: its key does not match its parent, namespace and tokens", i);
        }
    }
    for (uint32_t i = 0; i < n; i++)
        if (kids[i] != b[i].n_children)
            FAIL("block %u counts %u children; %u indexed blocks name it", i, b[i].n_children, kids[i]);
    if (c_free != cs->n_free || c_used != cs->n_used || c_pend != cs->n_pending ||
        c_cached != cs->n_cached || c_idx != cs->n_indexed)
        FAIL("counters (free %u, used %u, pending %u, cached %u, indexed %u) disagree with the "
             "records (%u, %u, %u, %u, %u)", cs->n_free, cs->n_used, cs->n_pending, cs->n_cached,
             cs->n_indexed, c_free, c_used, c_pend, c_cached, c_idx);
    /* free list */
    uint32_t len = 0;
    for (uint32_t id = cs->free_head; id != POOL_NONE; id = b[id].next) {
        if (id >= n || b[id].state != POOL_BLOCK_FREE || mark[id])
            FAIL("free list reaches block %u, which is not free or is listed twice", id);
        mark[id] = 1;
        len++;
    }
    if (len != c_free)
        FAIL("free list holds %u blocks; %u are free", len, c_free);
    /* LRU list: positions from 1 at the head */
    len = 0;
    uint32_t prev = POOL_NONE;
    uint64_t last_use = UINT64_MAX;
    for (uint32_t id = cs->lru_head; id != POOL_NONE; id = b[id].next) {
        if (id >= n || mark[id])
            FAIL("LRU list reaches block %u twice or out of range", id);
        const struct pool_block *r = &b[id];
        if (r->state != POOL_BLOCK_COMMITTED || r->refs || !(r->flags & POOL_BLOCK_INDEXED))
            FAIL("LRU list holds block %u, which is not cached", id);
        if (r->prev != prev)
            FAIL("LRU block %u links back to %u, not %u", id, r->prev, prev);
        if (r->last_use > last_use)
            FAIL("LRU block %u is more recent than the block before it", id);
        last_use = r->last_use;
        mark[id] = 2 + len++;
        prev = id;
    }
    if (prev != cs->lru_tail)
        FAIL("LRU tail is %u; the list ends at %u", cs->lru_tail, prev);
    if (len != c_cached)
        FAIL("LRU list holds %u blocks; %u are cached", len, c_cached);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t pa = b[i].parent;
        if (mark[i] >= 2 && (b[i].flags & POOL_BLOCK_INDEXED) && pa != POOL_NONE && mark[pa] >= 2 &&
            mark[pa] > mark[i])
            FAIL("cached block %u is more recent than its cached parent %u", i, pa);
    }
    /* index chains */
    len = 0;
    for (uint32_t k = 0; k <= px->mask; k++) {
        for (uint32_t id = px->bucket[k]; id != POOL_NONE; id = b[id].hnext) {
            if (id >= n || !(b[id].flags & POOL_BLOCK_INDEXED) || (b[id].key[0] & px->mask) != k)
                FAIL("bucket %u reaches block %u, which does not belong there", k, id);
            if (++len > c_idx)
                FAIL("index chains hold more blocks than are indexed (a cycle?)");
        }
    }
    if (len != c_idx)
        FAIL("index chains hold %u blocks; %u are indexed", len, c_idx);
    rc = 0;
out:
    free(mark);
    free(kids);
    return rc;
}
