/*
 * tier.c - the host tier (tier.h): a hash table of entries on an LRU list
 * inside a byte budget.
 */
#include "tier.h"

#include <lz4.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "err.h"

struct entry {
    struct prefix_tier_block id;    /* tokens point into the entry's own copy */
    struct entry *hnext;            /* hash chain */
    struct entry *prev, *next;      /* LRU: prev toward the head (most recent) */
    uint32_t stored;                /* bytes of data as stored */
    bool lz4;                       /* data is LZ4-compressed */
    uint64_t sum;                   /* XXH3-64 of the data as stored */
    uint8_t *data;
};

struct tier {
    uint64_t max_bytes, bytes;
    uint32_t bt;
    uint64_t block_bytes;
    struct entry **bucket;
    uint64_t mask;                  /* buckets - 1 */
    struct entry *head, *tail;      /* LRU */
    uint8_t *scratch;               /* LZ4's output bound */
    int scratch_len;
    struct tier_stats st;
    pthread_mutex_t mu;             /* kvd's loop stores, its restore thread gets */
};

/* What an entry costs the budget besides its data. */
static uint64_t overhead(const tier_t *t)
{
    return sizeof(struct entry) + (uint64_t)t->bt * sizeof(int32_t);
}

tier_t *tier_new(uint64_t max_bytes, uint32_t block_tokens, uint64_t block_bytes, char *err, size_t errlen)
{
    if (block_tokens == 0 || block_bytes == 0 || block_bytes > (uint64_t)LZ4_MAX_INPUT_SIZE) {
        kvd_seterr(err, errlen, KVD_EINVAL, "host tier: blocks of %llu bytes cannot be stored",
                   (unsigned long long)block_bytes);
        return NULL;
    }
    tier_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "host tier: out of memory");
        return NULL;
    }
    pthread_mutex_init(&t->mu, NULL);
    t->max_bytes = max_bytes;
    t->bt = block_tokens;
    t->block_bytes = block_bytes;
    if (max_bytes < block_bytes + overhead(t)) {
        kvd_seterr(err, errlen, KVD_EINVAL, "host tier: %llu bytes cannot hold one block of %llu",
                   (unsigned long long)max_bytes, (unsigned long long)block_bytes);
        tier_destroy(&t);
        return NULL;
    }
    /* about two buckets per block the budget holds uncompressed */
    uint64_t n = 64;
    while (n < 2 * (max_bytes / block_bytes) && n < (1ull << 30))
        n *= 2;
    t->mask = n - 1;
    t->scratch_len = LZ4_compressBound((int)block_bytes);
    t->bucket = calloc(n, sizeof(*t->bucket));
    t->scratch = malloc((size_t)t->scratch_len);
    if (t->bucket == NULL || t->scratch == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "host tier: out of memory");
        tier_destroy(&t);
        return NULL;
    }
    t->st.max_bytes = max_bytes;
    return t;
}

static void entry_free(struct entry *e)
{
    free(e->data);
    free((void *)e->id.tokens);
    free(e);
}

void tier_destroy(tier_t **tp)
{
    if (tp == NULL || *tp == NULL)
        return;
    tier_t *t = *tp;
    for (struct entry *e = t->head, *next; e != NULL; e = next) {
        next = e->next;
        entry_free(e);
    }
    free(t->bucket);
    free(t->scratch);
    pthread_mutex_destroy(&t->mu);
    free(t);
    *tp = NULL;
}

static bool same(const tier_t *t, const struct prefix_tier_block *a, const struct prefix_tier_block *b)
{
    return a->key.lo == b->key.lo && a->key.hi == b->key.hi && a->parent.lo == b->parent.lo &&
           a->parent.hi == b->parent.hi && a->ns.lo == b->ns.lo && a->ns.hi == b->ns.hi &&
           a->path.lo == b->path.lo && a->path.hi == b->path.hi &&
           memcmp(a->tokens, b->tokens, (size_t)t->bt * sizeof(int32_t)) == 0;
}

static struct entry **slot_of(const tier_t *t, const struct prefix_tier_block *b)
{
    return &t->bucket[(b->key.lo ^ b->key.hi) & t->mask];
}

static struct entry *find(const tier_t *t, const struct prefix_tier_block *b)
{
    for (struct entry *e = *slot_of(t, b); e != NULL; e = e->hnext)
        if (same(t, &e->id, b))
            return e;
    return NULL;
}

static void lru_unlink(tier_t *t, struct entry *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        t->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        t->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push_head(tier_t *t, struct entry *e)
{
    e->prev = NULL;
    e->next = t->head;
    if (t->head)
        t->head->prev = e;
    t->head = e;
    if (t->tail == NULL)
        t->tail = e;
}

/* Takes e out of the table and the list and frees it. */
static void drop(tier_t *t, struct entry *e)
{
    struct entry **link = slot_of(t, &e->id);
    while (*link != e)
        link = &(*link)->hnext;
    *link = e->hnext;
    lru_unlink(t, e);
    t->bytes -= e->stored + overhead(t);
    t->st.entries--;
    t->st.raw_bytes -= t->block_bytes;
    if (e->lz4)
        t->st.compressed--;
    entry_free(e);
}

static int put_locked(tier_t *t, const struct prefix_tier_block *b, const void *data)
{
    struct entry *old = find(t, b);
    if (old != NULL)
        drop(t, old);
    /* compressed only where that saves a sixteenth */
    const int c = LZ4_compress_default(data, (char *)t->scratch, (int)t->block_bytes, t->scratch_len);
    const bool lz4 = c > 0 && (uint64_t)c <= t->block_bytes - t->block_bytes / 16;
    const uint32_t stored = lz4 ? (uint32_t)c : (uint32_t)t->block_bytes;
    while (t->bytes + stored + overhead(t) > t->max_bytes && t->tail != NULL) {
        drop(t, t->tail);
        t->st.dropped++;
    }
    struct entry *e = calloc(1, sizeof(*e));
    int32_t *tok = malloc((size_t)t->bt * sizeof(int32_t));
    uint8_t *d = malloc(stored);
    if (e == NULL || tok == NULL || d == NULL) {
        free(e);
        free(tok);
        free(d);
        return KVD_ENOMEM;
    }
    memcpy(tok, b->tokens, (size_t)t->bt * sizeof(int32_t));
    memcpy(d, lz4 ? t->scratch : data, stored);
    e->id = *b;
    e->id.tokens = tok;
    e->data = d;
    e->stored = stored;
    e->lz4 = lz4;
    e->sum = XXH3_64bits(d, stored);
    struct entry **slot = slot_of(t, b);
    e->hnext = *slot;
    *slot = e;
    lru_push_head(t, e);
    t->bytes += stored + overhead(t);
    t->st.entries++;
    t->st.stored++;
    t->st.raw_bytes += t->block_bytes;
    if (lz4)
        t->st.compressed++;
    return 0;
}

static bool get_locked(tier_t *t, const struct prefix_tier_block *b, void *dst)
{
    struct entry *e = find(t, b);
    if (e == NULL) {
        t->st.misses++;
        return false;
    }
    bool ok = XXH3_64bits(e->data, e->stored) == e->sum;
    if (ok && e->lz4)
        ok = LZ4_decompress_safe((const char *)e->data, dst, (int)e->stored, (int)t->block_bytes) ==
             (int)t->block_bytes;
    else if (ok)
        memcpy(dst, e->data, t->block_bytes);
    if (!ok) {
        drop(t, e);
        t->st.corrupt++;
        t->st.misses++;
        return false;
    }
    lru_unlink(t, e);
    lru_push_head(t, e);
    t->st.hits++;
    return true;
}

int tier_put(tier_t *t, const struct prefix_tier_block *b, const void *data)
{
    pthread_mutex_lock(&t->mu);
    const int rc = put_locked(t, b, data);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

bool tier_get(tier_t *t, const struct prefix_tier_block *b, void *dst)
{
    pthread_mutex_lock(&t->mu);
    const bool ok = get_locked(t, b, dst);
    pthread_mutex_unlock(&t->mu);
    return ok;
}

bool tier_has(tier_t *t, const struct prefix_tier_block *b)
{
    pthread_mutex_lock(&t->mu);
    const bool there = find(t, b) != NULL;
    pthread_mutex_unlock(&t->mu);
    return there;
}

void tier_stats(tier_t *t, struct tier_stats *st)
{
    pthread_mutex_lock(&t->mu);
    *st = t->st;
    st->bytes = t->bytes;
    pthread_mutex_unlock(&t->mu);
}

bool tier_corrupt_key_for_test(tier_t *t, prefix_key_t k)
{
    /* tests call these while nothing else runs */
    for (struct entry *e = t->bucket[(k.lo ^ k.hi) & t->mask]; e != NULL; e = e->hnext)
        if (e->id.key.lo == k.lo && e->id.key.hi == k.hi) {
            e->data[e->stored / 2] ^= 0x5a;
            return true;
        }
    return false;
}

bool tier_corrupt_for_test(tier_t *t, const struct prefix_tier_block *b)
{
    struct entry *e = find(t, b);
    if (e == NULL)
        return false;
    e->data[e->stored / 2] ^= 0x5a;
    return true;
}
