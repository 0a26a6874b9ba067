/*
 * test_prefix.c - the block allocator and prefix index of a KV pool
 * (shm/prefix.h), held against a reference model kept by the test.
 *
 * Deterministic cases first: the same tokens under two namespaces never share
 * a block; a second request for a prefix that is being computed waits on its
 * pending block and then takes it; a commit that breaks the tokens promised
 * at grow time takes the block out of the index; prompts under a constant
 * hash (every key collides) each find their own blocks and nothing else.
 *
 * Then a randomized run (200,000 operations by default) on a 48-block pool
 * with eight sequences: begin, grow, write and commit, generate, release,
 * lookup, evict, three namespaces, and phases under weak hash functions that
 * force key collisions. After every step the pool is compared with the model:
 * block states, reference counts (one per holding sequence), the index with
 * its parents, tokens and children counts, the exact LRU order, leaf-first
 * eviction from the LRU tail, the statistics, every sequence's block table,
 * and prefix_check(). Before committing a block the test writes a signature
 * of (namespace, every token up to the end of the block) into its K/V, which
 * stands for K/V computed from those tokens: every block the cache hands out
 * must carry the signature of the request that received it.
 *
 * Under a weak hash the contract allows a collision to cost a miss, so there
 * the model accepts a shorter hit or an unindexed block (counted and printed)
 * but nothing unsafe.
 *
 * Usage: test_prefix [seed [ops]].
 */
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "err.h"
#include "pool.h"
#include "prefix.h"
#include "tier.h"

#define BT 4u                   /* positions per block */
#define NB 48u                  /* blocks in the pool */
#define BLOCK_BYTES 64u         /* 2 x 1 layer x 1 head x 4 dims x 4 positions x 2 bytes */
#define NSLOT 8                 /* sequences alive at once */
#define MAXLEN 48u              /* longest sequence */
#define MAXBLK (MAXLEN / BT)    /* most blocks one sequence holds */
#define NNS 3                   /* namespaces */
#define NSYS 4                  /* shared "system prompts" */
#define NHIST 16                /* remembered token strings */
#define LOGN 24                 /* operations kept for a failure report */
#define PHASE_OPS 4000u         /* operations between hash switches */
#define DEFAULT_OPS 200000u
#define DEFAULT_SEED UINT64_C(0x6b76642d70726678)

static const char *const ns_names[NNS] = { "", "tenant-a", "tenant-b" };

#include "pooltest.h"

/* ---- signatures: the stand-in for K/V ---------------------------------- */

/* What the K/V of a block ending at position n hold: a function of the
 * namespace and of tokens[0..n). */
static uint64_t kv_sig(int ns, const int32_t *tok, uint32_t n)
{
    uint64_t h = mix64(UINT64_C(0x4b56) + (uint64_t)ns);
    for (uint32_t i = 0; i < n; i++)
        h = mix64(h ^ (uint32_t)tok[i]);
    return mix64(h ^ n);
}

/* ---- weak key functions (forced collisions) ----------------------------- */

static prefix_key_t hash_const(const uint8_t secret[POOL_SECRET_BYTES], prefix_key_t parent,
                               prefix_ns_t ns, const uint8_t fingerprint[16],
                               const int32_t *tokens, uint32_t n)
{
    return (prefix_key_t){ 0x5eed, 0 };
}

static prefix_key_t hash_first_bit(const uint8_t secret[POOL_SECRET_BYTES], prefix_key_t parent,
                                   prefix_ns_t ns, const uint8_t fingerprint[16],
                                   const int32_t *tokens, uint32_t n)
{
    return (prefix_key_t){ (uint64_t)(tokens[0] & 1), 0 };
}

/* Depends on the depth only: every namespace and content collides per depth. */
static prefix_key_t hash_depth(const uint8_t secret[POOL_SECRET_BYTES], prefix_key_t parent,
                               prefix_ns_t ns, const uint8_t fingerprint[16],
                               const int32_t *tokens, uint32_t n)
{
    return (prefix_key_t){ parent.lo + 1, 0 };
}

static const prefix_hash_fn weak_hashes[] = { hash_const, hash_first_bit, hash_depth };
static const char *const weak_names[] = { "const", "first-bit", "depth" };

/* ---- the pool under test ------------------------------------------------ */

static pool_t *pool_open_small(void)
{
    return pool_make("test_prefix/fp01", 1, NULL, NB);
}

static prefix_ns_t ns_of(const prefix_t *px, int i)
{
    return prefix_namespace(px, ns_names[i], strlen(ns_names[i]));
}

/* Computes prompt tokens[0..n) for s (begun in namespace ns with cached
 * tokens already taken): grows, writes the signatures of the full blocks and
 * commits everything. Returns the commit's result. */
static int seq_compute(pool_t *pool, prefix_t *px, struct prefix_seq *s, int ns,
                       const int32_t *tok, uint32_t n)
{
    int rc = prefix_seq_grow(px, s, n, tok, n);
    if (rc != 0)
        return rc;
    for (uint32_t i = s->n_committed; i < n / BT; i++)
        kv_fill(pool, s->blocks[i], kv_sig(ns, tok, (i + 1) * BT));
    return prefix_seq_commit(px, s, tok, n);
}

/* True when the first k blocks of s carry the signatures of (ns, tok). */
static bool seq_sigs_ok(pool_t *pool, const struct prefix_seq *s, int ns, const int32_t *tok,
                        uint32_t k)
{
    for (uint32_t i = 0; i < k && i < s->n_blocks; i++)
        if (!kv_holds(pool, s->blocks[i], kv_sig(ns, tok, (i + 1) * BT)))
            return false;
    return true;
}

/* ---- deterministic cases ------------------------------------------------ */

/* The same tokens under two namespaces are cached apart and never shared. */
static void test_namespaces(void)
{
    pool_t *pool = pool_open_small();
    prefix_t *px = prefix_open(pool);
    prefix_ns_t a = ns_of(px, 1), b = ns_of(px, 2), d = ns_of(px, 0);
    prefix_ns_t a2 = prefix_namespace(px, "tenant-a", 8);
    CHECK(memcmp(&a, &a2, sizeof(a)) == 0);
    CHECK(memcmp(&a, &b, sizeof(a)) != 0);
    CHECK(memcmp(&a, &d, sizeof(a)) != 0);

    const int32_t P[13] = { 5, 1, 4, 1, 9, 2, 6, 5, 3, 5, 8, 9, 7 };
    struct prefix_seq s, t;
    memset(&s, 0, sizeof(s));
    memset(&t, 0, sizeof(t));
    uint32_t wait = 0;
    CHECK_INT(prefix_seq_begin(px, &s, a, P, 13, &wait), 0);
    CHECK_INT(wait, POOL_NONE);
    CHECK_INT(seq_compute(pool, px, &s, 1, P, 13), 0);
    uint32_t a_ids[3];
    memcpy(a_ids, s.blocks, sizeof(a_ids));
    prefix_seq_release(px, &s);

    uint32_t ids[4];
    struct prefix_match m;
    prefix_lookup(px, a, P, 13, 4, ids, &m);
    CHECK_INT(m.n_blocks, 3);
    prefix_lookup(px, b, P, 13, 4, ids, &m);
    CHECK_INT(m.n_blocks, 0);
    CHECK_INT(m.pending, POOL_NONE);
    prefix_lookup(px, d, P, 13, 4, ids, &m);
    CHECK_INT(m.n_blocks, 0);

    /* namespace B computes the same tokens into blocks of its own */
    CHECK_INT(prefix_seq_begin(px, &t, b, P, 13, &wait), 0);
    CHECK_INT(wait, POOL_NONE);
    CHECK_INT(seq_compute(pool, px, &t, 2, P, 13), 0);
    CHECK_INT(t.n_indexed, 3);
    for (uint32_t i = 0; i < 3; i++)
        for (uint32_t j = 0; j < 3; j++)
            CHECK(t.blocks[i] != a_ids[j]);
    prefix_seq_release(px, &t);

    /* each finds its own */
    CHECK_INT(prefix_seq_begin(px, &s, a, P, 13, NULL), 12);
    CHECK(memcmp(s.blocks, a_ids, sizeof(a_ids)) == 0);
    CHECK(seq_sigs_ok(pool, &s, 1, P, 3));
    CHECK_INT(prefix_seq_begin(px, &t, b, P, 13, NULL), 12);
    CHECK(seq_sigs_ok(pool, &t, 2, P, 3));
    CHECK_INT(check_ok(px), 0);
    prefix_seq_release(px, &s);
    prefix_seq_release(px, &t);
    CHECK_INT(check_ok(px), 0);
    prefix_seq_fini(&s);
    prefix_seq_fini(&t);
    prefix_destroy(&px);
    CHECK(px == NULL);
    pool_close(&pool);
    CHECK(pool == NULL);
}

/* Owners (tenants) under a limit: a flood by one evicts its own cached
 * blocks, never another's; a sequence that cannot stay within the limit is
 * refused while the pool still has room; freed blocks count for no one. */
static void test_owner_limit(void)
{
    pool_t *pool = pool_open_small();
    prefix_t *px = prefix_open(pool);
    prefix_set_owner_limit(px, 10);
    const prefix_ns_t na = ns_of(px, 1), nb = ns_of(px, 2);
    int32_t P[25], F[25];
    for (int i = 0; i < 25; i++)
        P[i] = 700 + i;
    struct prefix_seq s, t;
    memset(&s, 0, sizeof(s));
    memset(&t, 0, sizeof(t));
    s.owner = 1;
    t.owner = 2;
    /* owner 1: a 25-token prompt, 7 blocks; its 6 full ones stay cached */
    CHECK_INT(prefix_seq_begin(px, &s, na, P, 25, NULL), 0);
    CHECK_INT(seq_compute(pool, px, &s, 1, P, 25), 0);
    prefix_seq_release(px, &s);
    CHECK_INT(prefix_owned(px, 1), 6);
    /* owner 2 floods with twelve prompts of 7 blocks: 84 blocks, the pool 48 */
    for (int k = 0; k < 12; k++) {
        for (int i = 0; i < 25; i++)
            F[i] = 10000 + 100 * k + i;
        CHECK_INT(prefix_seq_begin(px, &t, nb, F, 25, NULL), 0);
        CHECK_INT(seq_compute(pool, px, &t, 2, F, 25), 0);
        CHECK(prefix_owned(px, 2) <= 10);
        prefix_seq_release(px, &t);
        CHECK_INT(check_ok(px), 0);
    }
    CHECK_INT(prefix_owned(px, 1), 6);
    /* owner 1's prompt is all there still */
    CHECK_INT(prefix_seq_begin(px, &s, na, P, 25, NULL), 24);
    CHECK(seq_sigs_ok(pool, &s, 1, P, 6));
    prefix_seq_release(px, &s);
    /* 11 blocks at once cannot stay within 10: refused, though the pool has room */
    int32_t L[44];
    for (int i = 0; i < 44; i++)
        L[i] = 50000 + i;
    CHECK_INT(prefix_seq_begin(px, &t, nb, L, 44, NULL), 0);
    CHECK_INT(prefix_seq_grow(px, &t, 44, L, 44), KVD_ENOSPACE);
    prefix_seq_release(px, &t);
    /* without a limit the same flood takes owner 1's blocks too */
    prefix_set_owner_limit(px, 0);
    for (int k = 0; k < 12; k++) {
        for (int i = 0; i < 25; i++)
            F[i] = 20000 + 100 * k + i;
        CHECK_INT(prefix_seq_begin(px, &t, nb, F, 25, NULL), 0);
        CHECK_INT(seq_compute(pool, px, &t, 2, F, 25), 0);
        prefix_seq_release(px, &t);
    }
    CHECK(prefix_owned(px, 1) < 6);
    CHECK_INT(check_ok(px), 0);
    prefix_seq_fini(&s);
    prefix_seq_fini(&t);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* What the page's picture reads from each block (prefix_block_info): the
 * owner it was taken for, and the cache hits it had since it was last free. */
static void test_block_hits(void)
{
    pool_t *pool = pool_open_small();
    prefix_t *px = prefix_open(pool);
    const prefix_ns_t ns = ns_of(px, 1);
    int32_t P[25];
    for (int i = 0; i < 25; i++)
        P[i] = 900 + i;
    struct prefix_seq s;
    memset(&s, 0, sizeof(s));
    s.owner = 3;
    CHECK_INT(prefix_seq_begin(px, &s, ns, P, 25, NULL), 0);
    CHECK_INT(seq_compute(pool, px, &s, 1, P, 25), 0);
    const uint32_t first = s.blocks[0], last = s.blocks[5];
    struct prefix_block_info bi;
    CHECK_INT(prefix_block_info(px, first, &bi), 0);
    CHECK_INT(bi.owner, 3);
    CHECK_INT(bi.hits, 0);
    prefix_seq_release(px, &s);
    /* twice from the cache: six blocks (one token left to compute), each hit twice */
    for (int k = 1; k <= 2; k++) {
        CHECK_INT(prefix_seq_begin(px, &s, ns, P, 25, NULL), 24);
        CHECK_INT(prefix_block_info(px, first, &bi), 0);
        CHECK_INT(bi.hits, (uint32_t)k);
        CHECK_INT(bi.refs, 1);
        CHECK_INT(prefix_block_info(px, last, &bi), 0);
        CHECK_INT(bi.hits, (uint32_t)k);
        prefix_seq_release(px, &s);
    }
    /* evicted and taken again: no owner, no hits */
    CHECK_INT(prefix_evict(px, 1000), 6);
    CHECK_INT(prefix_block_info(px, first, &bi), 0);
    CHECK_INT(bi.state, POOL_BLOCK_FREE);
    CHECK_INT(bi.owner, 0);
    CHECK_INT(bi.hits, 0);
    CHECK_INT(check_ok(px), 0);
    prefix_seq_fini(&s);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* A public prefix: the first blocks of a chain keyed in a namespace every
 * other shares, the rest in each sequence's own. Two namespaces share the
 * public blocks and nothing after them; without n_public nothing is shared. */
static void test_public_prefix(void)
{
    pool_t *pool = pool_open_small();
    prefix_t *px = prefix_open(pool);
    const prefix_ns_t a = ns_of(px, 1), b = ns_of(px, 2), pub = prefix_namespace(px, "public", 6);
    int32_t P[21];
    for (int i = 0; i < 21; i++)
        P[i] = 300 + i;
    struct prefix_seq s, t;
    memset(&s, 0, sizeof(s));
    memset(&t, 0, sizeof(t));
    s.n_public = t.n_public = 2;
    s.public_ns = t.public_ns = pub;
    CHECK_INT(prefix_seq_begin(px, &s, a, P, 21, NULL), 0);
    CHECK_INT(seq_compute(pool, px, &s, 1, P, 21), 0);
    prefix_seq_release(px, &s);
    /* a probe says what begin would find, referencing nothing */
    const uint32_t free_before = pool_header(pool)->cache.n_free + pool_header(pool)->cache.n_cached;
    CHECK_INT(prefix_seq_probe(px, &t, b, P, 21), 2);
    CHECK_INT(prefix_seq_probe(px, &s, a, P, 21), 5);
    CHECK_INT(prefix_seq_probe(px, &s, a, P, 2 * BT + 1), 2);    /* one token left to compute */
    CHECK_INT(prefix_seq_probe(px, &s, a, P, 2 * BT), 1);
    CHECK_INT(prefix_seq_probe(px, &s, a, P, 0), 0);
    CHECK_INT(pool_header(pool)->cache.n_free + pool_header(pool)->cache.n_cached, free_before);
    /* b: the two public blocks, then its own */
    CHECK_INT(prefix_seq_begin(px, &t, b, P, 21, NULL), 2 * BT);
    CHECK_INT(seq_compute(pool, px, &t, 2, P, 21), 0);
    prefix_seq_release(px, &t);
    /* each finds all of its own again, the public blocks shared */
    CHECK_INT(prefix_seq_begin(px, &s, a, P, 21, NULL), 5 * BT);
    CHECK_INT(prefix_seq_begin(px, &t, b, P, 21, NULL), 5 * BT);
    CHECK(s.blocks[0] == t.blocks[0] && s.blocks[1] == t.blocks[1]);
    CHECK(s.blocks[2] != t.blocks[2]);
    prefix_seq_release(px, &s);
    prefix_seq_release(px, &t);
    /* without the public prefix, b's chain is its own from the first block */
    t.n_public = 0;
    CHECK_INT(prefix_seq_begin(px, &t, b, P, 21, NULL), 0);
    prefix_seq_release(px, &t);
    CHECK_INT(check_ok(px), 0);
    prefix_seq_fini(&s);
    prefix_seq_fini(&t);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* A sequence whose pending blocks are hidden (its writer was lost on another
 * host) keeps them taken, but nobody waits for them: another sequence with
 * the same prompt computes its own. */
static void test_hide_pending(void)
{
    pool_t *pool = pool_open_small();
    prefix_t *px = prefix_open(pool);
    prefix_ns_t ns = ns_of(px, 0);
    const int32_t P[13] = { 5, 4, 3, 2, 1, 9, 8, 7, 6, 0, 1, 2, 3 };
    struct prefix_seq a, b;
    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    uint32_t wait = 0;
    CHECK_INT(prefix_seq_begin(px, &a, ns, P, 13, &wait), 0);
    CHECK_INT(prefix_seq_grow(px, &a, 13, P, 13), 0);
    CHECK_INT(prefix_seq_commit(px, &a, P, BT), 0);     /* its first block is written */
    CHECK_INT(prefix_seq_begin(px, &b, ns, P, 13, &wait), BT);
    CHECK(wait != POOL_NONE);                           /* b would wait for a's second */
    prefix_seq_release(px, &b);
    const uint32_t pending = pool_header(pool)->cache.n_pending;
    prefix_seq_hide_pending(px, &a);
    CHECK_INT(check_ok(px), 0);
    CHECK_INT(pool_header(pool)->cache.n_pending, pending);     /* still taken */
    CHECK_INT(prefix_seq_begin(px, &b, ns, P, 13, &wait), BT);  /* the written block is found */
    CHECK_INT(wait, POOL_NONE);                                 /* nothing to wait for */
    CHECK_INT(prefix_seq_grow(px, &b, 13, P, 13), 0);
    CHECK(b.blocks[1] != a.blocks[1]);
    CHECK_INT(prefix_seq_commit(px, &a, P, 13), 0);     /* a goes on: nothing more of it is indexed */
    CHECK_INT(check_ok(px), 0);
    prefix_seq_release(px, &a);
    prefix_seq_release(px, &b);
    CHECK_INT(check_ok(px), 0);
    CHECK_INT(pool_header(pool)->cache.n_pending, 0);
    prefix_seq_fini(&a);
    prefix_seq_fini(&b);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* A second request for a prefix being computed waits on its pending block
 * instead of computing it again, and takes it once committed. */
static void test_wait(void)
{
    pool_t *pool = pool_open_small();
    prefix_t *px = prefix_open(pool);
    prefix_ns_t ns = ns_of(px, 0);
    const int32_t P[9] = { 7, 7, 1, 2, 3, 8, 8, 0, 4 };
    struct prefix_seq a, b;
    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    uint32_t wait = 0;

    CHECK_INT(prefix_seq_begin(px, &a, ns, P, 9, &wait), 0);
    CHECK_INT(wait, POOL_NONE);
    CHECK_INT(prefix_seq_grow(px, &a, 9, P, 9), 0);
    CHECK_INT(a.n_blocks, 3);
    CHECK_INT(a.n_indexed, 2);      /* two full prompt blocks; the partial one never */
    struct prefix_block_info bi;
    for (uint32_t i = 0; i < 3; i++) {
        CHECK_INT(prefix_block_info(px, a.blocks[i], &bi), 0);
        CHECK_INT(bi.state, POOL_BLOCK_PENDING);
        CHECK_INT(bi.refs, 1);
        CHECK(bi.indexed == (i < 2));
        CHECK(!bi.on_lru);
        if (i < 2)
            CHECK_INT(bi.parent, i == 0 ? POOL_NONE : a.blocks[0]);
    }
    struct prefix_stats st;
    prefix_stats(px, &st);
    CHECK_INT(st.n_pending, 3);
    CHECK_INT(st.n_indexed, 2);

    /* b finds the pending first block: nothing cached, wait on it */
    CHECK_INT(prefix_seq_begin(px, &b, ns, P, 9, &wait), 0);
    CHECK_INT(wait, a.blocks[0]);
    uint32_t ids[3];
    struct prefix_match m;
    prefix_lookup(px, ns, P, 9, 3, ids, &m);
    CHECK_INT(m.n_blocks, 0);
    CHECK_INT(m.pending, a.blocks[0]);
    prefix_seq_release(px, &b);

    /* a commits its first block: b takes it and waits on the second */
    kv_fill(pool, a.blocks[0], kv_sig(0, P, 4));
    CHECK_INT(prefix_seq_commit(px, &a, P, 4), 0);
    CHECK_INT(a.n_committed, 1);
    CHECK_INT(prefix_seq_begin(px, &b, ns, P, 9, &wait), 4);
    CHECK_INT(b.blocks[0], a.blocks[0]);
    CHECK_INT(wait, a.blocks[1]);
    CHECK(seq_sigs_ok(pool, &b, 0, P, 1));
    CHECK_INT(prefix_block_info(px, a.blocks[0], &bi), 0);
    CHECK_INT(bi.refs, 2);
    prefix_seq_release(px, &b);

    /* a commits the rest: b takes both blocks and computes only the last token */
    kv_fill(pool, a.blocks[1], kv_sig(0, P, 8));
    CHECK_INT(prefix_seq_commit(px, &a, P, 9), 0);
    CHECK_INT(a.n_committed, 2);
    CHECK_INT(prefix_seq_begin(px, &b, ns, P, 9, &wait), 8);
    CHECK_INT(wait, POOL_NONE);
    CHECK_INT(b.n_cached, 2);
    CHECK(memcmp(b.blocks, a.blocks, 2 * sizeof(uint32_t)) == 0);
    CHECK(seq_sigs_ok(pool, &b, 0, P, 2));
    CHECK_INT(prefix_seq_grow(px, &b, 10, P, 9), 0);
    CHECK_INT(b.n_blocks, 3);
    CHECK(b.blocks[2] != a.blocks[2]);
    CHECK_INT(check_ok(px), 0);

    /* released last-first: a's blocks stay held by b, then go to the LRU
     * with the first block at the head */
    uint32_t shared[2] = { b.blocks[0], b.blocks[1] };
    prefix_seq_release(px, &a);
    CHECK_INT(prefix_lru(px, ids, 3), 0);
    prefix_seq_release(px, &b);
    CHECK_INT(prefix_lru(px, ids, 3), 2);
    CHECK_INT(ids[0], shared[0]);
    CHECK_INT(ids[1], shared[1]);
    prefix_stats(px, &st);
    CHECK_INT(st.n_cached, 2);
    CHECK_INT(st.n_free, NB - 2);
    CHECK_INT(st.n_pending, 0);

    /* pending prompt blocks released before being written leave the index */
    const int32_t Q[9] = { 1, 1, 1, 1, 2, 2, 2, 2, 3 };
    CHECK_INT(prefix_seq_begin(px, &a, ns, Q, 9, NULL), 0);
    CHECK_INT(prefix_seq_grow(px, &a, 9, Q, 9), 0);
    prefix_stats(px, &st);
    CHECK_INT(st.n_indexed, 4);
    prefix_seq_release(px, &a);
    prefix_stats(px, &st);
    CHECK_INT(st.n_indexed, 2);
    CHECK_INT(st.n_free, NB - 2);
    prefix_lookup(px, ns, Q, 9, 2, ids, &m);
    CHECK_INT(m.n_blocks, 0);
    CHECK_INT(m.pending, POOL_NONE);
    CHECK_INT(check_ok(px), 0);

    prefix_seq_fini(&a);
    prefix_seq_fini(&b);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* A commit whose tokens differ from those promised at grow time is refused
 * and the block leaves the index: nobody finds it or waits on it. */
static void test_broken_promise(void)
{
    pool_t *pool = pool_open_small();
    prefix_t *px = prefix_open(pool);
    prefix_ns_t ns = ns_of(px, 0);
    const int32_t P[9] = { 3, 1, 4, 1, 5, 9, 2, 6, 5 };
    const int32_t Q[9] = { 3, 1, 4, 1, 5, 9, 0, 6, 5 };  /* block 1 differs */
    struct prefix_seq s;
    memset(&s, 0, sizeof(s));
    CHECK_INT(prefix_seq_begin(px, &s, ns, P, 9, NULL), 0);
    CHECK_INT(prefix_seq_grow(px, &s, 9, P, 9), 0);
    CHECK_INT(s.n_indexed, 2);
    kv_fill(pool, s.blocks[0], kv_sig(0, P, 4));
    CHECK_INT(prefix_seq_commit(px, &s, P, 4), 0);
    kv_fill(pool, s.blocks[1], kv_sig(0, Q, 8));
    CHECK_INT(prefix_seq_commit(px, &s, Q, 8), KVD_EINVAL);
    struct prefix_block_info bi;
    CHECK_INT(prefix_block_info(px, s.blocks[1], &bi), 0);
    CHECK(!bi.indexed);
    CHECK_INT(prefix_block_info(px, s.blocks[0], &bi), 0);
    CHECK(bi.indexed);
    CHECK_INT(bi.n_children, 0);
    CHECK(s.n_indexed <= 1);
    uint32_t ids[2];
    struct prefix_match m;
    prefix_lookup(px, ns, P, 9, 2, ids, &m);
    CHECK_INT(m.n_blocks, 1);
    CHECK_INT(m.pending, POOL_NONE);
    CHECK_INT(check_ok(px), 0);
    prefix_seq_release(px, &s);
    struct prefix_stats st;
    prefix_stats(px, &st);
    CHECK_INT(st.n_indexed, 1);
    CHECK_INT(st.n_pending, 0);
    CHECK_INT(check_ok(px), 0);
    prefix_seq_fini(&s);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* Under a constant key every entry collides; each prompt still finds exactly
 * its own blocks, and the key function can only change while nothing is indexed. */
static void test_collisions(void)
{
    pool_t *pool = pool_open_small();
    prefix_t *px = prefix_open(pool);
    prefix_ns_t ns = ns_of(px, 0);
    CHECK_INT(prefix_set_hash(px, hash_const), 0);

    enum { NP = 4 };
    const int32_t P[NP][9] = {
        { 1, 2, 3, 4, 5, 6, 7, 8, 9 },
        { 2, 2, 3, 4, 5, 6, 7, 8, 9 },   /* other first block */
        { 1, 2, 3, 4, 5, 6, 7, 0, 9 },   /* P0's first block, other second */
        { 1, 2, 3, 4, 5, 6, 7, 8, 1 },   /* P0's two blocks, other tail */
    };
    struct prefix_seq s;
    memset(&s, 0, sizeof(s));
    for (int p = 0; p < NP; p++) {
        int64_t got = prefix_seq_begin(px, &s, ns, P[p], 9, NULL);
        int64_t want = p == 2 ? 4 : p == 3 ? 8 : 0;
        CHECK_INT(got, want);
        CHECK(seq_sigs_ok(pool, &s, 0, P[p], s.n_cached));
        CHECK_INT(seq_compute(pool, px, &s, 0, P[p], 9), 0);
        prefix_seq_release(px, &s);
        CHECK_INT(check_ok(px), 0);
    }
    struct prefix_stats st;
    prefix_stats(px, &st);
    CHECK_INT(st.n_indexed, 5);     /* P0: 2, P1: 2, P2: 1 more; P3 adds none */
    CHECK_INT(st.n_cached, 5);
    for (int p = 0; p < NP; p++) {
        CHECK_INT(prefix_seq_begin(px, &s, ns, P[p], 9, NULL), 8);
        CHECK(seq_sigs_ok(pool, &s, 0, P[p], 2));
        prefix_seq_release(px, &s);
    }
    const int32_t U[9] = { 9, 9, 9, 9, 9, 9, 9, 9, 9 };
    uint32_t ids[2];
    struct prefix_match m;
    prefix_lookup(px, ns, U, 9, 2, ids, &m);
    CHECK_INT(m.n_blocks, 0);
    prefix_lookup(px, ns_of(px, 1), P[0], 9, 2, ids, &m);
    CHECK_INT(m.n_blocks, 0);
    prefix_stats(px, &st);
    CHECK(st.collisions > 0);

    CHECK_INT(prefix_set_hash(px, NULL), KVD_ESTATE);
    CHECK_INT(prefix_evict(px, NB), 5);
    CHECK_INT(prefix_set_hash(px, NULL), 0);
    CHECK_INT(check_ok(px), 0);
    prefix_seq_fini(&s);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* ---- the reference model ------------------------------------------------ */

struct mblock {
    uint32_t state;         /* POOL_BLOCK_* */
    bool indexed;           /* in the index */
    uint32_t parent;        /* indexed parent, POOL_NONE for a first block */
    int ns;                 /* namespace index (indexed blocks) */
    uint32_t len;           /* tokens from position 0 through this block (indexed blocks) */
    int32_t tok[MAXLEN];    /* those tokens */
};

struct slot {
    bool live;              /* begun and not released */
    int ns;                 /* namespace index */
    struct prefix_seq s;    /* the sequence under test */
    int32_t tok[MAXLEN];    /* known tokens: prompt, then generated */
    uint32_t len;           /* known tokens */
    uint32_t written;       /* positions committed */
    uint32_t ids[MAXBLK];   /* expected block table */
    uint32_t n_blocks;      /* expected table length */
    uint32_t n_cached;      /* expected prefix_seq fields */
    uint32_t n_committed;
    uint32_t n_indexed;
    bool chain_open;
};

struct hist {
    int ns;                 /* namespace index */
    uint32_t len;           /* tokens */
    int32_t tok[MAXLEN];    /* a released sequence's tokens */
};

/* What an observer (kvd's block events) learns: a multiset of keys (weak
 * hashes give equal keys to different blocks), rebuilt from stored / removed
 * calls only, and checked against the blocks lookups can find. */
struct seen {
    prefix_key_t key[4 * NB];
    uint32_t count[4 * NB];
    uint32_t n;
    uint64_t stored, removed, bad;      /* calls, and those that contradict the pool */
    prefix_t *px;
};

static uint32_t seen_find(const struct seen *v, prefix_key_t k)
{
    for (uint32_t i = 0; i < v->n; i++)
        if (v->count[i] > 0 && v->key[i].lo == k.lo && v->key[i].hi == k.hi)
            return i;
    return UINT32_MAX;
}

/* k's slot, made (in a slot no key holds) when k has none. */
static uint32_t seen_slot(struct seen *v, prefix_key_t k)
{
    uint32_t at = seen_find(v, k);
    if (at != UINT32_MAX)
        return at;
    for (at = 0; at < v->n && v->count[at] > 0; at++)
        ;
    if (at == 4 * NB)
        return UINT32_MAX;
    if (at == v->n)
        v->n++;
    v->key[at] = k;
    v->count[at] = 0;
    return at;
}

/* A findable block (indexed, committed) with key k, these tokens and
 * namespace ns; with parent != NULL its parent's key is *parent, else it has
 * no parent. */
static bool seen_matches(prefix_t *px, prefix_key_t k, const prefix_key_t *parent, const int32_t *tok,
                         prefix_ns_t ns)
{
    for (uint32_t id = 0; id < NB; id++) {
        struct prefix_block_info bi, pi;
        if (prefix_block_info(px, id, &bi) != 0 || !bi.indexed || bi.state != POOL_BLOCK_COMMITTED ||
            bi.key.lo != k.lo || bi.key.hi != k.hi || memcmp(bi.tokens, tok, BT * sizeof(int32_t)) != 0 ||
            bi.ns.lo != ns.lo || bi.ns.hi != ns.hi)
            continue;
        if (parent == NULL ? bi.parent == POOL_NONE
                           : bi.parent != POOL_NONE && prefix_block_info(px, bi.parent, &pi) == 0 &&
                                 pi.key.lo == parent->lo && pi.key.hi == parent->hi)
            return true;
    }
    return false;
}

static void seen_stored(void *user, const prefix_key_t *keys, uint32_t n, const prefix_key_t *parent,
                        const int32_t *tokens, prefix_ns_t ns)
{
    struct seen *v = user;
    v->stored++;
    for (uint32_t i = 0; i < n; i++) {
        if (!seen_matches(v->px, keys[i], i ? &keys[i - 1] : parent, tokens + (size_t)i * BT, ns))
            v->bad++;
        uint32_t at = seen_slot(v, keys[i]);
        if (at == UINT32_MAX)
            v->bad++;
        else
            v->count[at]++;
    }
}

static void seen_removed(void *user, prefix_key_t key)
{
    struct seen *v = user;
    v->removed++;
    uint32_t at = seen_find(v, key);
    if (at == UINT32_MAX)
        v->bad++;
    else
        v->count[at]--;
}

/* The model's tier: the contents (namespace and tokens from position 0 through
 * the block) of every findable block evicted while the tier was attached. The
 * tier under test is tier.c with a budget it never reaches, so the two must
 * hold the same set. */
#define MTIER_CAP 65536u
struct mtier_entry {
    bool used;
    int ns;
    uint32_t len;
    int32_t tok[MAXLEN];
};

struct world {
    pool_t *pool;
    prefix_t *px;
    tier_t *tier;           /* the tier under test (NULL: no tiers in this run) */
    bool tier_on;           /* attached now (keyed phases) */
    struct mtier_entry *mt; /* the model's tier, open addressing by content */
    uint32_t mt_n;
    uint64_t restores;      /* blocks begin took back from the tier */
    struct seen seen;       /* the observer's view */
    prefix_ns_t ns[NNS];
    struct mblock b[NB];    /* the model's blocks */
    uint32_t lru[NB];       /* the model's LRU list, head (most recent) first */
    uint32_t n_lru;
    uint64_t evictions;     /* expected stats.evictions */
    uint64_t collisions0;   /* stats.collisions when the phase began */
    bool weak;              /* a weak key function is installed */
    struct slot sl[NSLOT];
    int32_t sys[NSYS][16];  /* shared prompt prefixes */
    uint32_t sys_len[NSYS];
    struct hist hist[NHIST];
    uint32_t n_hist;
    uint64_t rng;
    char log[LOGN][256];    /* the last operations, for a failure report */
    uint64_t n_log;
    /* what the run exercised */
    uint64_t begins, begin_hits, cached_tokens, prompt_tokens, waits;
    uint64_t grows, enospace, commits, dups, releases, lookups, lookup_hits;
    uint64_t evict_calls, weak_collisions, collision_misses, phases;
};

static uint64_t rnd(struct world *w)
{
    w->rng += UINT64_C(0x9e3779b97f4a7c15);
    uint64_t z = w->rng;
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static uint32_t below(struct world *w, uint32_t n)
{
    return n ? (uint32_t)(rnd(w) % n) : 0;
}

static void note(struct world *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(struct world *w, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->log[w->n_log++ % LOGN], sizeof(w->log[0]), fmt, ap);
    va_end(ap);
}

static const char *tokstr(const int32_t *tok, uint32_t n, char *buf)
{
    uint32_t i;
    for (i = 0; i < n && i < MAXLEN; i++)
        buf[i] = (char)('0' + (tok[i] >= 0 && tok[i] < 10 ? tok[i] : 9));
    buf[i] = '\0';
    return buf;
}

/* The indexed block holding tokens[0..(i+1)*BT) in namespace ns, or POOL_NONE. */
static uint32_t m_find(const struct world *w, int ns, const int32_t *tok, uint32_t i)
{
    uint32_t len = (i + 1) * BT;
    for (uint32_t id = 0; id < NB; id++) {
        const struct mblock *b = &w->b[id];
        if (b->indexed && b->ns == ns && b->len == len &&
            memcmp(b->tok, tok, len * sizeof(int32_t)) == 0)
            return id;
    }
    return POOL_NONE;
}

static uint32_t m_children(const struct world *w, uint32_t id)
{
    uint32_t n = 0;
    for (uint32_t j = 0; j < NB; j++)
        if (w->b[j].indexed && w->b[j].parent == id)
            n++;
    return n;
}

static uint32_t m_holders(const struct world *w, uint32_t id)
{
    uint32_t n = 0;
    for (int si = 0; si < NSLOT; si++)
        for (uint32_t i = 0; i < w->sl[si].n_blocks; i++)
            n += w->sl[si].ids[i] == id;
    return n;
}

static uint32_t m_free_count(const struct world *w)
{
    uint32_t n = 0;
    for (uint32_t id = 0; id < NB; id++)
        n += w->b[id].state == POOL_BLOCK_FREE;
    return n;
}

static void m_free(struct world *w, uint32_t id)
{
    w->b[id].state = POOL_BLOCK_FREE;
    w->b[id].indexed = false;
    w->b[id].parent = POOL_NONE;
}

static void m_lru_remove(struct world *w, uint32_t id)
{
    for (uint32_t j = 0; j < w->n_lru; j++)
        if (w->lru[j] == id) {
            memmove(w->lru + j, w->lru + j + 1, (w->n_lru - j - 1) * sizeof(uint32_t));
            w->n_lru--;
            return;
        }
}

static void m_lru_push(struct world *w, uint32_t id)
{
    memmove(w->lru + 1, w->lru, w->n_lru * sizeof(uint32_t));
    w->lru[0] = id;
    w->n_lru++;
}

static uint64_t mt_hash(int ns, const int32_t *tok, uint32_t len)
{
    uint64_t h = mix64(UINT64_C(0x74696572) + (uint64_t)ns);
    for (uint32_t i = 0; i < len; i++)
        h = mix64(h ^ (uint32_t)tok[i]);
    return mix64(h ^ len);
}

/* The model tier's slot of content (ns, tok[0..len)): where it is, or the
 * empty slot where it would go. */
static struct mtier_entry *mt_slot(struct world *w, int ns, const int32_t *tok, uint32_t len)
{
    for (uint64_t i = mt_hash(ns, tok, len);; i++) {
        struct mtier_entry *e = &w->mt[i % MTIER_CAP];
        if (!e->used || (e->ns == ns && e->len == len && memcmp(e->tok, tok, len * sizeof(int32_t)) == 0))
            return e;
    }
}

static bool mt_has(struct world *w, int ns, const int32_t *tok, uint32_t len)
{
    return w->mt != NULL && mt_slot(w, ns, tok, len)->used;
}

/* Evicts the LRU tail, which must be a leaf of the index; with the tier
 * attached its content goes there. */
static void m_evict_tail(struct world *w)
{
    REQUIRE(w->n_lru > 0);
    uint32_t id = w->lru[--w->n_lru];
    if (m_children(w, id) != 0)
        fprintf(stderr, "model: LRU tail %u has indexed children\n", id);
    CHECK_INT(m_children(w, id), 0);
    const struct mblock *b = &w->b[id];
    if (w->tier_on && b->indexed && b->state == POOL_BLOCK_COMMITTED) {
        struct mtier_entry *e = mt_slot(w, b->ns, b->tok, b->len);
        if (!e->used) {
            REQUIRE(w->mt_n < MTIER_CAP / 2);
            e->used = true;
            e->ns = b->ns;
            e->len = b->len;
            memcpy(e->tok, b->tok, b->len * sizeof(int32_t));
            w->mt_n++;
        }
    }
    m_free(w, id);
    w->evictions++;
}

/* Indexes block i of sl if the contract says so: the chain before it is
 * indexed and no block of the same content is (else sl's chain closes).
 * Under a weak key function the implementation may decline (a collision costs
 * a miss): the model then follows it. */
static void m_try_index(struct world *w, struct slot *sl, uint32_t i)
{
    if (!sl->chain_open || sl->n_indexed != i)
        return;
    if (m_find(w, sl->ns, sl->tok, i) != POOL_NONE) {
        sl->chain_open = false;
        w->dups++;
        return;
    }
    uint32_t id = sl->ids[i];
    if (w->weak) {
        struct prefix_block_info bi;
        if (prefix_block_info(w->px, id, &bi) == 0 && !bi.indexed) {
            sl->chain_open = sl->s.chain_open;
            w->collision_misses++;
            return;
        }
    }
    struct mblock *b = &w->b[id];
    b->indexed = true;
    b->parent = i ? sl->ids[i - 1] : POOL_NONE;
    b->ns = sl->ns;
    b->len = (i + 1) * BT;
    memcpy(b->tok, sl->tok, b->len * sizeof(int32_t));
    sl->n_indexed++;
}

/* ---- comparing the pool with the model ---------------------------------- */

#define EXPECT(got, want, ...) do { long long g_ = (long long)(got), w_ = (long long)(want); \
    if (g_ != w_) { fprintf(stderr, "  mismatch: "); fprintf(stderr, __VA_ARGS__); \
        fprintf(stderr, ": got %lld, model says %lld\n", g_, w_); } CHECK_INT(g_, w_); } while (0)

static void verify(struct world *w)
{
    CHECK_INT(check_ok(w->px), 0);

    uint32_t pos[NB];           /* actual LRU position of each block, or POOL_NONE */
    uint32_t lru[NB + 1];
    for (uint32_t id = 0; id < NB; id++)
        pos[id] = POOL_NONE;
    uint32_t n_lru = prefix_lru(w->px, lru, NB + 1);
    EXPECT(n_lru, w->n_lru, "LRU length");
    for (uint32_t j = 0; j < n_lru && j < NB; j++)
        if (lru[j] < NB)
            pos[lru[j]] = j;
    for (uint32_t j = 0; j < n_lru && j < w->n_lru; j++)
        EXPECT(lru[j], w->lru[j], "LRU entry %u (0 = head)", j);

    uint32_t n_free = 0, n_used = 0, n_pending = 0, n_indexed = 0;
    for (uint32_t id = 0; id < NB; id++) {
        const struct mblock *b = &w->b[id];
        struct prefix_block_info bi;
        memset(&bi, 0, sizeof(bi));
        CHECK_INT(prefix_block_info(w->px, id, &bi), 0);
        uint32_t refs = m_holders(w, id);
        bool on_lru = false;
        for (uint32_t j = 0; j < w->n_lru; j++)
            on_lru |= w->lru[j] == id;
        EXPECT(bi.state, b->state, "block %u state", id);
        EXPECT(bi.refs, refs, "block %u refs", id);
        EXPECT(bi.indexed, b->indexed, "block %u indexed", id);
        EXPECT(bi.on_lru, on_lru, "block %u on the LRU", id);
        EXPECT(bi.parent, b->indexed ? b->parent : POOL_NONE, "block %u parent", id);
        EXPECT(bi.n_children, m_children(w, id), "block %u children", id);
        if (b->indexed) {
            CHECK(bi.tokens != NULL);
            if (bi.tokens != NULL)
                CHECK(memcmp(bi.tokens, b->tok + b->len - BT, BT * sizeof(int32_t)) == 0);
        }
        /* the invariants themselves, on what the pool says */
        CHECK(bi.refs <= NSLOT);
        if (bi.state == POOL_BLOCK_FREE)
            CHECK(bi.refs == 0 && !bi.indexed && !bi.on_lru);
        if (bi.refs == 0)
            CHECK(bi.state == POOL_BLOCK_FREE ||
                  (bi.state == POOL_BLOCK_COMMITTED && bi.indexed && bi.on_lru));
        if (bi.on_lru) {
            CHECK(bi.refs == 0 && pos[id] != POOL_NONE);
            /* a cached parent is more recent (closer to the head) than its child */
            if (bi.parent < NB && pos[bi.parent] != POOL_NONE)
                CHECK(pos[bi.parent] < pos[id]);
        }
        n_free += b->state == POOL_BLOCK_FREE;
        n_used += b->state == POOL_BLOCK_COMMITTED && refs > 0;
        n_pending += b->state == POOL_BLOCK_PENDING;
        n_indexed += b->indexed;
    }

    struct prefix_stats st;
    memset(&st, 0, sizeof(st));
    prefix_stats(w->px, &st);
    CHECK_INT(st.n_blocks, NB);
    CHECK_INT((uint64_t)st.n_free + st.n_cached + st.n_used + st.n_pending, st.n_blocks);
    EXPECT(st.n_free, n_free, "stats.n_free");
    EXPECT(st.n_cached, w->n_lru, "stats.n_cached");
    EXPECT(st.n_used, n_used, "stats.n_used");
    EXPECT(st.n_pending, n_pending, "stats.n_pending");
    EXPECT(st.n_indexed, n_indexed, "stats.n_indexed");
    EXPECT(st.evictions, w->evictions, "stats.evictions");
    /* the observer's multiset of keys is exactly the findable blocks' */
    EXPECT(w->seen.bad, 0, "observer calls that contradict the pool");
    uint32_t want[4 * NB] = { 0 }, unseen = 0;
    for (uint32_t id = 0; id < NB; id++) {
        struct prefix_block_info bi;
        if (prefix_block_info(w->px, id, &bi) == 0 && bi.indexed && bi.state == POOL_BLOCK_COMMITTED) {
            uint32_t at = seen_find(&w->seen, bi.key);
            if (at == UINT32_MAX)
                unseen++;
            else
                want[at]++;
        }
    }
    EXPECT(unseen, 0, "findable blocks the observer never heard of");
    for (uint32_t i = 0; i < w->seen.n; i++)
        EXPECT(w->seen.count[i], want[i], "observer's count of key %u", i);
    if (!w->weak)
        EXPECT(st.collisions, w->collisions0, "stats.collisions under XXH3");
    if (w->tier != NULL) {
        struct tier_stats ts;
        tier_stats(w->tier, &ts);
        EXPECT(ts.entries, w->mt_n, "tier entries");
        EXPECT(ts.dropped + ts.corrupt, 0, "tier entries dropped");
        EXPECT(st.restored, w->restores, "stats.restored");
    }

    for (int si = 0; si < NSLOT; si++) {
        const struct slot *sl = &w->sl[si];
        const struct prefix_seq *s = &sl->s;
        if (!sl->live) {
            EXPECT(s->n_blocks, 0, "slot %d released: n_blocks", si);
            continue;
        }
        EXPECT(s->n_blocks, sl->n_blocks, "slot %d n_blocks", si);
        for (uint32_t i = 0; i < s->n_blocks && i < sl->n_blocks; i++)
            EXPECT(s->blocks[i], sl->ids[i], "slot %d block %u", si, i);
        EXPECT(s->n_cached, sl->n_cached, "slot %d n_cached", si);
        EXPECT(s->n_committed, sl->n_committed, "slot %d n_committed", si);
        EXPECT(s->n_indexed, sl->n_indexed, "slot %d n_indexed", si);
        EXPECT(s->chain_open, sl->chain_open, "slot %d chain_open", si);
        CHECK(memcmp(&s->ns, &w->ns[sl->ns], sizeof(s->ns)) == 0);
        for (uint32_t i = 0; i < sl->n_blocks; i++) {
            uint32_t id = sl->ids[i];
            EXPECT(w->b[id].indexed, i < sl->n_indexed, "slot %d block %u indexed", si, i);
            /* committed blocks keep their K/V while held */
            if (i < sl->n_committed && !kv_holds(w->pool, id, kv_sig(sl->ns, sl->tok, (i + 1) * BT))) {
                fprintf(stderr, "  slot %d block %u (id %u): K/V overwritten while held\n", si, i, id);
                CHECK(0);
            }
        }
    }
}

/* ---- the random workload ------------------------------------------------ */

static int pick_ns(struct world *w)
{
    uint32_t r = below(w, 10);
    return r < 6 ? 0 : r < 8 ? 1 : 2;
}

/* A prompt drawn so that prefixes are shared often: a system prompt plus a
 * short question, a remembered conversation (cut, or continued), another live
 * sequence's tokens, or noise. Tokens are 0..2. */
static uint32_t make_prompt(struct world *w, int32_t *tok, int *ns)
{
    uint32_t n = 0, r = below(w, 100);
    *ns = pick_ns(w);
    if (r < 35) {
        uint32_t j = below(w, NSYS);
        memcpy(tok, w->sys[j], w->sys_len[j] * sizeof(int32_t));
        n = w->sys_len[j];
        for (uint32_t k = below(w, 9); k > 0; k--)
            tok[n++] = (int32_t)below(w, 3);
    } else if (r < 65 && w->n_hist > 0) {
        const struct hist *h = &w->hist[below(w, w->n_hist < NHIST ? (uint32_t)w->n_hist : NHIST)];
        if (below(w, 5))
            *ns = h->ns;
        n = below(w, 2) ? h->len : 1 + below(w, h->len);
        memcpy(tok, h->tok, n * sizeof(int32_t));
        for (uint32_t k = below(w, 7); k > 0 && n < MAXLEN; k--)
            tok[n++] = (int32_t)below(w, 3);
    } else if (r < 78) {
        const struct slot *sl = &w->sl[below(w, NSLOT)];
        if (sl->live && sl->len > 0) {
            *ns = sl->ns;
            n = sl->len;
            memcpy(tok, sl->tok, n * sizeof(int32_t));
        }
    }
    if (n == 0) {
        n = 1 + below(w, 16);
        for (uint32_t k = 0; k < n; k++)
            tok[k] = (int32_t)below(w, 3);
    }
    return n;
}

static void op_begin(struct world *w, int si)
{
    struct slot *sl = &w->sl[si];
    int32_t tok[MAXLEN];
    char buf[MAXLEN + 1];
    int ns;
    uint32_t n = make_prompt(w, tok, &ns);

    /* the model: the longest committed indexed prefix, leaving a token */
    uint32_t max = (n - 1) / BT, k = 0, want[MAXBLK], id;
    while (k < max && (id = m_find(w, ns, tok, k)) != POOL_NONE &&
           w->b[id].state == POOL_BLOCK_COMMITTED)
        want[k++] = id;
    const uint32_t k_pool = k;
    bool give_wait = below(w, 8) != 0;
    uint32_t wait = 0xdeadbeef;
    int64_t got = prefix_seq_begin(w->px, &sl->s, w->ns[ns], tok, n, give_wait ? &wait : NULL);
    note(w, "slot %d begin ns=%d n=%u [%s] -> %lld wait=%d", si, ns, n, tokstr(tok, n, buf),
         (long long)got, give_wait ? (int)wait : -2);
    CHECK(got >= 0 && got % BT == 0);
    if (got < 0)
        return;
    uint32_t kg = (uint32_t)got / BT;
    /* every hit carries the K/V of this request's own tokens (whatever the model says) */
    for (uint32_t i = 0; i < kg && i < sl->s.n_blocks; i++)
        if (!kv_holds(w->pool, sl->s.blocks[i], kv_sig(ns, tok, (i + 1) * BT))) {
            fprintf(stderr, "  begin served block %u (id %u) with other K/V\n", i, sl->s.blocks[i]);
            CHECK(0);
        }
    if (w->weak && kg < k) {
        w->collision_misses++;
        k = kg;
    }
    for (uint32_t i = 0; i < k && i < kg; i++)
        m_lru_remove(w, want[i]);
    /* with the tier attached (and nothing pending after the pool's prefix) the
     * prefix goes on: blocks in the tier are copied into blocks the pool hands
     * out (free ones, else the LRU tail evicted), blocks still in the pool are
     * taken, a pending one stops it */
    uint32_t restored = 0;
    const uint32_t after = k < max ? m_find(w, ns, tok, k) : POOL_NONE;
    if (w->tier_on && k == k_pool && (after == POOL_NONE || w->b[after].state == POOL_BLOCK_COMMITTED)) {
        while (k < max) {
            id = m_find(w, ns, tok, k);
            if (id != POOL_NONE) {
                if (w->b[id].state != POOL_BLOCK_COMMITTED)
                    break;
                m_lru_remove(w, id);
                want[k++] = id;
                continue;
            }
            if (!mt_has(w, ns, tok, (k + 1) * BT) || m_free_count(w) + w->n_lru == 0)
                break;
            if (k >= kg) {
                k++;            /* the model restores a block the pool did not: reported below */
                break;
            }
            if (m_free_count(w) == 0)
                m_evict_tail(w);
            const uint32_t got_id = sl->s.blocks[k];
            REQUIRE(got_id < NB);
            CHECK_INT(w->b[got_id].state, POOL_BLOCK_FREE);
            struct mblock *b = &w->b[got_id];
            b->state = POOL_BLOCK_COMMITTED;
            b->indexed = true;
            b->parent = k ? want[k - 1] : POOL_NONE;
            b->ns = ns;
            b->len = (k + 1) * BT;
            memcpy(b->tok, tok, b->len * sizeof(int32_t));
            want[k++] = got_id;
            restored++;
        }
    }
    EXPECT(kg, k, "begin: cached blocks (%u restored)", restored);
    EXPECT(sl->s.n_restored, restored, "begin: restored blocks");
    w->restores += restored;
    if (kg > k || sl->s.n_blocks != kg)
        return;
    for (uint32_t i = 0; i < k; i++)
        EXPECT(sl->s.blocks[i], want[i], "begin: block %u", i);
    if (give_wait) {
        uint32_t pend = POOL_NONE;
        if ((k + 1) * BT <= n && (id = m_find(w, ns, tok, k)) != POOL_NONE &&
            w->b[id].state == POOL_BLOCK_PENDING)
            pend = id;
        /* at the cap (a whole-block prompt) reporting the pending block is optional */
        if (!(wait == POOL_NONE && (k == max || w->weak)))
            EXPECT(wait, pend, "begin: wait_block");
        w->waits += wait != POOL_NONE;
    }

    sl->live = true;
    sl->ns = ns;
    memcpy(sl->tok, tok, n * sizeof(int32_t));
    sl->len = n;
    sl->written = k * BT;
    memcpy(sl->ids, want, k * sizeof(uint32_t));
    sl->n_blocks = sl->n_cached = sl->n_committed = sl->n_indexed = k;
    sl->chain_open = true;
    w->begins++;
    w->begin_hits += k > 0;
    w->cached_tokens += k * BT;
    w->prompt_tokens += n;
}

static void op_grow(struct world *w, int si)
{
    struct slot *sl = &w->sl[si];
    uint32_t cap = sl->n_blocks * BT, n_pos, r = below(w, 10);
    if (r < 5 && sl->len > cap)
        n_pos = sl->len;
    else if (r < 8)
        n_pos = sl->len + 1 + below(w, 6);
    else
        n_pos = 1 + below(w, MAXLEN);
    if (n_pos > MAXLEN)
        n_pos = MAXLEN;
    uint32_t need = (n_pos + BT - 1) / BT;
    uint32_t add = need > sl->n_blocks ? need - sl->n_blocks : 0;
    uint32_t n_free = m_free_count(w);
    int want = add > n_free + w->n_lru ? KVD_ENOSPACE : 0;

    int rc = prefix_seq_grow(w->px, &sl->s, n_pos, sl->tok, sl->len);
    note(w, "slot %d grow n_pos=%u known=%u (held %u, free %u, cached %u) -> %d", si, n_pos,
         sl->len, sl->n_blocks, n_free, w->n_lru, rc);
    EXPECT(rc, want, "grow: result");
    w->grows++;
    if (rc == KVD_ENOSPACE)
        w->enospace++;
    if (rc != 0 || want != 0 || add == 0)
        return;

    /* all blocks first (a free block, else the LRU tail evicted); then each new
     * block is indexed as pending if the known tokens fill it, so a copy that
     * this grow evicted does not count as a duplicate */
    EXPECT(sl->s.n_blocks, need, "grow: n_blocks");
    if (sl->s.n_blocks != need)
        return;
    uint32_t old = sl->n_blocks;
    for (uint32_t i = old; i < need; i++) {
        if (i - old >= n_free)
            m_evict_tail(w);
        uint32_t id = sl->s.blocks[i];
        REQUIRE(id < NB);
        if (w->b[id].state != POOL_BLOCK_FREE)
            fprintf(stderr, "  grow handed out block %u, which the model has in state %u%s\n", id,
                    w->b[id].state, w->b[id].indexed ? " (indexed)" : "");
        CHECK_INT(w->b[id].state, POOL_BLOCK_FREE);
        w->b[id].state = POOL_BLOCK_PENDING;
        w->b[id].indexed = false;
        w->b[id].parent = POOL_NONE;
        sl->ids[i] = id;
        kv_fill(w->pool, id, rnd(w));   /* whatever a worker leaves half-written */
        sl->n_blocks = i + 1;
    }
    for (uint32_t i = old; i < need && (i + 1) * BT <= sl->len; i++)
        m_try_index(w, sl, i);
}

static void op_commit(struct world *w, int si)
{
    struct slot *sl = &w->sl[si];
    uint32_t cap = sl->n_blocks * BT;
    if (sl->len > cap && below(w, 8) == 0) {
        int rc = prefix_seq_commit(w->px, &sl->s, sl->tok, sl->len);
        note(w, "slot %d commit n=%u past the %u positions held -> %d", si, sl->len, cap, rc);
        EXPECT(rc, KVD_ERANGE, "commit past the blocks held");
        return;
    }
    uint32_t hi = sl->len < cap ? sl->len : cap;
    if (hi <= sl->written) {
        note(w, "slot %d commit: nothing to write", si);
        return;
    }
    uint32_t n = below(w, 2) ? hi : sl->written + 1 + below(w, hi - sl->written);
    uint32_t full = n / BT;
    for (uint32_t i = sl->n_committed; i < full; i++)
        kv_fill(w->pool, sl->ids[i], kv_sig(sl->ns, sl->tok, (i + 1) * BT));
    int rc = prefix_seq_commit(w->px, &sl->s, sl->tok, n);
    note(w, "slot %d commit n=%u (was %u, held %u) -> %d", si, n, sl->written, sl->n_blocks, rc);
    EXPECT(rc, 0, "commit: result");
    w->commits++;
    for (uint32_t i = sl->n_committed; i < full; i++) {
        w->b[sl->ids[i]].state = POOL_BLOCK_COMMITTED;
        m_try_index(w, sl, i);
    }
    if (full > sl->n_committed)
        sl->n_committed = full;
    sl->written = n;
}

static void op_generate(struct world *w, int si)
{
    struct slot *sl = &w->sl[si];
    uint32_t k = 1 + below(w, 3);
    for (; k > 0 && sl->len < MAXLEN; k--)
        sl->tok[sl->len++] = (int32_t)below(w, 3);
    note(w, "slot %d generate -> len %u", si, sl->len);
}

static void op_release(struct world *w, int si)
{
    struct slot *sl = &w->sl[si];
    struct hist *h = &w->hist[w->n_hist++ % NHIST];
    h->ns = sl->ns;
    h->len = sl->len;
    memcpy(h->tok, sl->tok, sl->len * sizeof(int32_t));

    prefix_seq_release(w->px, &sl->s);
    note(w, "slot %d release (%u blocks, %u committed)", si, sl->n_blocks, sl->n_committed);
    /* last first: committed indexed blocks nobody else holds go to the LRU
     * head; the rest are freed */
    while (sl->n_blocks > 0) {
        uint32_t id = sl->ids[--sl->n_blocks];
        if (m_holders(w, id) > 0)
            continue;
        if (w->b[id].state == POOL_BLOCK_COMMITTED && w->b[id].indexed)
            m_lru_push(w, id);
        else
            m_free(w, id);
    }
    sl->live = false;
    sl->len = sl->written = 0;
    sl->n_cached = sl->n_committed = sl->n_indexed = 0;
    w->releases++;
}

static void op_lookup(struct world *w)
{
    int32_t tok[MAXLEN];
    char buf[MAXLEN + 1];
    int ns;
    uint32_t n = make_prompt(w, tok, &ns);
    uint32_t max = below(w, MAXBLK + 1), k = 0, want[MAXBLK], id;
    while (k < max && (k + 1) * BT <= n && (id = m_find(w, ns, tok, k)) != POOL_NONE &&
           w->b[id].state == POOL_BLOCK_COMMITTED)
        want[k++] = id;

    struct prefix_stats before, after;
    prefix_stats(w->px, &before);
    uint32_t ids[MAXBLK + 1];
    for (uint32_t i = 0; i <= MAXBLK; i++)
        ids[i] = 0xabababab;
    struct prefix_match m = { 0xabababab, 0xabababab };
    prefix_lookup(w->px, w->ns[ns], tok, n, max, ids, &m);
    prefix_stats(w->px, &after);
    note(w, "lookup ns=%d n=%u max=%u [%s] -> %u pending=%d", ns, n, max, tokstr(tok, n, buf),
         m.n_blocks, (int)m.pending);
    w->lookups++;
    w->lookup_hits += m.n_blocks > 0;
    EXPECT(after.lookups, before.lookups + 1, "lookup: stats.lookups");
    EXPECT(after.hit_blocks, before.hit_blocks + m.n_blocks, "lookup: stats.hit_blocks");
    CHECK_INT(ids[max], 0xabababab);    /* room for max_blocks ids only */
    CHECK(m.n_blocks <= max);
    for (uint32_t i = 0; i < m.n_blocks && i < max; i++)
        if (!kv_holds(w->pool, ids[i], kv_sig(ns, tok, (i + 1) * BT))) {
            fprintf(stderr, "  lookup found block %u (id %u) with other K/V\n", i, ids[i]);
            CHECK(0);
        }
    if (w->weak && m.n_blocks < k) {
        w->collision_misses++;
        k = m.n_blocks;
    }
    EXPECT(m.n_blocks, k, "lookup: blocks");
    if (m.n_blocks > k)
        return;
    for (uint32_t i = 0; i < k; i++)
        EXPECT(ids[i], want[i], "lookup: block %u", i);
    uint32_t pend = POOL_NONE;
    if ((k + 1) * BT <= n && (id = m_find(w, ns, tok, k)) != POOL_NONE &&
        w->b[id].state == POOL_BLOCK_PENDING)
        pend = id;
    /* past max_blocks reporting the pending block is optional */
    if (!(m.pending == POOL_NONE && (k == max || w->weak)))
        EXPECT(m.pending, pend, "lookup: pending");
}

static void op_evict(struct world *w)
{
    uint32_t r = below(w, 10);
    uint32_t n = r < 7 ? 1 : r < 9 ? 1 + below(w, 4) : NB;
    uint32_t want = n < w->n_lru ? n : w->n_lru;
    uint32_t tail = w->n_lru ? w->lru[w->n_lru - 1] : POOL_NONE;
    uint32_t got = prefix_evict(w->px, n);
    note(w, "evict %u (cached %u, tail %d) -> %u", n, w->n_lru, (int)tail, got);
    w->evict_calls++;
    EXPECT(got, want, "evict: freed");
    for (uint32_t e = 0; e < want; e++)
        m_evict_tail(w);
}

static void tier_evicted(void *user, const struct prefix_tier_block *b, const void *data)
{
    REQUIRE(tier_put(user, b, data) == 0);
}

static bool tier_has_cb(void *user, const struct prefix_tier_block *b)
{
    return tier_has(user, b);
}

static bool tier_fetch(void *user, const struct prefix_tier_block *b, void *dst)
{
    return tier_get(user, b, dst);
}

/* Attaches the tier under test (keyed phases) or detaches it (phases of a
 * weak key function, whose collisions the model does not follow through a tier). */
static void tier_attach(struct world *w, bool on)
{
    if (w->tier == NULL)
        return;
    const struct prefix_tier t = { .evicted = tier_evicted, .has = tier_has_cb, .fetch = tier_fetch,
                                   .user = w->tier };
    EXPECT(prefix_set_tier(w->px, on ? &t : NULL), 0, "set_tier");
    w->tier_on = on;
}

/* Empties the index (everything released and evicted) and installs fn. */
static void switch_hash(struct world *w, prefix_hash_fn fn, const char *name)
{
    struct prefix_stats st;
    prefix_stats(w->px, &st);
    if (st.n_indexed > 0)
        EXPECT(prefix_set_hash(w->px, fn), KVD_ESTATE, "set_hash with a non-empty index");
    for (int si = 0; si < NSLOT; si++)
        if (w->sl[si].live)
            op_release(w, si);
    uint32_t n = w->n_lru;
    EXPECT(prefix_evict(w->px, NB), n, "evict everything");
    while (w->n_lru > 0)
        m_evict_tail(w);
    prefix_stats(w->px, &st);
    EXPECT(st.n_indexed, 0, "index after evicting everything");
    if (w->weak)
        w->weak_collisions += st.collisions - w->collisions0;
    EXPECT(prefix_set_hash(w->px, fn), 0, "set_hash on an empty index");
    w->weak = fn != NULL;
    tier_attach(w, !w->weak);
    w->collisions0 = st.collisions;
    w->phases++;
    note(w, "hash -> %s", name);
}

static void world_open(struct world *w, uint64_t seed, bool tiers)
{
    memset(w, 0, sizeof(*w));
    w->rng = seed;
    w->pool = pool_open_small();
    w->px = prefix_open(w->pool);
    if (tiers) {
        char err[256];
        w->tier = tier_new(1ull << 40, BT, BLOCK_BYTES, err, sizeof(err));   /* never full */
        w->mt = calloc(MTIER_CAP, sizeof(*w->mt));
        REQUIRE(w->tier != NULL && w->mt != NULL);
        tier_attach(w, true);
    }
    REQUIRE(prefix_block_tokens(w->px) == BT);
    w->seen.px = w->px;
    const struct prefix_observer obs = { .stored = seen_stored, .removed = seen_removed, .user = &w->seen };
    prefix_set_observer(w->px, &obs);
    for (int i = 0; i < NNS; i++)
        w->ns[i] = ns_of(w->px, i);
    for (uint32_t id = 0; id < NB; id++) {
        m_free(w, id);
        CHECK(pool_block_addr(w->pool, id) != NULL);
    }
    CHECK(pool_block_addr(w->pool, NB) == NULL);
    struct prefix_block_info bi;
    CHECK_INT(prefix_block_info(w->px, NB, &bi), KVD_ERANGE);
    struct prefix_stats st;
    prefix_stats(w->px, &st);
    CHECK_INT(st.block_bytes, BLOCK_BYTES);
    CHECK_INT(st.n_free, NB);
    w->collisions0 = st.collisions;
    static const uint32_t lens[NSYS] = { 4, 8, 9, 13 };
    for (int j = 0; j < NSYS; j++) {
        w->sys_len[j] = lens[j];
        for (uint32_t k = 0; k < lens[j]; k++)
            w->sys[j][k] = (int32_t)below(w, 3);
    }
}

static void world_close(struct world *w)
{
    for (int si = 0; si < NSLOT; si++) {
        if (w->sl[si].live)
            op_release(w, si);
        prefix_seq_fini(&w->sl[si].s);
    }
    verify(w);
    prefix_destroy(&w->px);
    pool_close(&w->pool);
    tier_destroy(&w->tier);
    free(w->mt);
}

static void dump(const struct world *w, uint64_t seed, uint64_t op)
{
    fprintf(stderr, "\nfirst failure at operation %llu (seed %llu: test_prefix %llu %llu "
            "reproduces it); the last operations:\n", (unsigned long long)op,
            (unsigned long long)seed, (unsigned long long)seed, (unsigned long long)op + 1);
    uint64_t from = w->n_log > LOGN ? w->n_log - LOGN : 0;
    for (uint64_t i = from; i < w->n_log; i++)
        fprintf(stderr, "  %s\n", w->log[i % LOGN]);
}

static void test_random(uint64_t seed, uint64_t n_ops, bool tiers)
{
    struct world *w = calloc(1, sizeof(*w));
    REQUIRE(w != NULL);
    world_open(w, seed, tiers);
    verify(w);
    uint32_t n_weak = 0;
    uint64_t op;
    for (op = 0; op < n_ops; op++) {
        int failed = check_failures;
        if (op > 0 && op % PHASE_OPS == 0) {
            if (w->weak) {
                switch_hash(w, NULL, "xxh3");
            } else {
                uint32_t h = n_weak++ % (sizeof(weak_hashes) / sizeof(weak_hashes[0]));
                switch_hash(w, weak_hashes[h], weak_names[h]);
            }
        }
        int si = (int)below(w, NSLOT);
        uint32_t r = below(w, 100);
        if (!w->sl[si].live) {
            if (r < 80)
                op_begin(w, si);
            else if (r < 92)
                op_lookup(w);
            else
                op_evict(w);
        } else if (r < 26) {
            op_grow(w, si);
        } else if (r < 54) {
            op_commit(w, si);
        } else if (r < 66) {
            op_generate(w, si);
        } else if (r < 78) {
            op_release(w, si);
        } else if (r < 90) {
            op_lookup(w);
        } else if (r < 96) {
            op_evict(w);
        } else if (r < 98) {
            /* a key function cannot change under a non-empty index */
            struct prefix_stats st;
            prefix_stats(w->px, &st);
            if (st.n_indexed > 0)
                EXPECT(prefix_set_hash(w->px, hash_const), KVD_ESTATE, "set_hash while indexed");
            note(w, "set_hash probe (indexed %u)", st.n_indexed);
        } else {
            op_commit(w, si);
        }
        verify(w);
        if (check_failures != failed) {
            dump(w, seed, op);
            break;
        }
    }
    if (check_failures == 0)
        world_close(w);

    fprintf(stderr, "random run%s: seed %llu, %llu operations, %llu phases\n", tiers ? " over a tier" : "",
            (unsigned long long)seed, (unsigned long long)op, (unsigned long long)w->phases);
    if (tiers)
        fprintf(stderr, "  tier: %u contents, %llu blocks taken back from it\n", w->mt_n,
                (unsigned long long)w->restores);
    fprintf(stderr, "  begins %llu (hit %llu), cached tokens %llu of %llu prompt tokens, waits %llu\n",
            (unsigned long long)w->begins, (unsigned long long)w->begin_hits,
            (unsigned long long)w->cached_tokens, (unsigned long long)w->prompt_tokens,
            (unsigned long long)w->waits);
    fprintf(stderr, "  grows %llu (no space %llu), commits %llu, duplicates %llu, releases %llu\n",
            (unsigned long long)w->grows, (unsigned long long)w->enospace,
            (unsigned long long)w->commits, (unsigned long long)w->dups,
            (unsigned long long)w->releases);
    fprintf(stderr, "  lookups %llu (hit %llu), evict calls %llu, evictions %llu\n",
            (unsigned long long)w->lookups, (unsigned long long)w->lookup_hits,
            (unsigned long long)w->evict_calls, (unsigned long long)w->evictions);
    fprintf(stderr, "  weak-hash collisions %llu, misses a collision cost %llu\n",
            (unsigned long long)w->weak_collisions, (unsigned long long)w->collision_misses);
    fprintf(stderr, "  observer: %llu stored runs, %llu removed blocks\n", (unsigned long long)w->seen.stored,
            (unsigned long long)w->seen.removed);

    /* the workload must exercise what it claims to */
    if (check_failures == 0 && n_ops >= 50000) {
        CHECK(w->cached_tokens * 10 >= w->prompt_tokens);
        CHECK(w->begin_hits * 8 >= w->begins);
        CHECK(w->waits > 0);
        CHECK(w->seen.stored > 0 && w->seen.removed > 0);
        CHECK(w->enospace > 0);
        CHECK(w->evictions > 0);
        CHECK(w->dups > 0);
        CHECK(w->lookup_hits > 0);
        CHECK(w->weak_collisions > 0);
        if (tiers)
            CHECK(w->restores > 1000);
    }
    free(w);
}

/* Windowing a sequence: the dropped blocks go to the cache, the moved ones
 * that another sequence holds or the index finds come out as private copies
 * (the cached prefix keeps its contents), the private ones move as they are,
 * and nothing after the kept blocks is indexed again. */
static void test_window(void)
{
    pool_t *pool = pool_open_small();
    prefix_t *px = prefix_open(pool);
    prefix_ns_t ns = ns_of(px, 0);
    int32_t P[10 * BT];
    for (uint32_t i = 0; i < 10 * BT; i++)
        P[i] = (int32_t)(100 + i);
    struct prefix_seq a, b;
    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    /* a: a prompt of 6 blocks (indexed), then 3 generated blocks and a partial one */
    CHECK_INT(prefix_seq_begin(px, &a, ns, P, 6 * BT, NULL), 0);
    CHECK_INT(seq_compute(pool, px, &a, 0, P, 9 * BT + 1), 0);
    CHECK_INT(a.n_blocks, 10);
    /* b shares a's first 4 blocks */
    CHECK_INT(prefix_seq_begin(px, &b, ns, P, 4 * BT + 1, NULL), 4 * BT);
    uint32_t before[10], copy[10][2];
    memcpy(before, a.blocks, sizeof(before));
    /* a sink block, drop 3: blocks 4..9 move down to 1..6 */
    const int64_t nc = prefix_seq_window(px, &a, 1, 3, copy);
    CHECK_INT(check_ok(px), 0);
    CHECK_INT(a.n_blocks, 7);
    CHECK_INT(a.blocks[0], before[0]);
    /* the moved blocks 4 and 5 were indexed (prompt) or 6..8 (generated,
     * indexed at commit): each gets a copy; the partial last one moves as is */
    CHECK_INT(nc, 5);
    for (int64_t k = 0; k < nc; k++) {
        CHECK_INT(copy[k][0], before[4 + k]);
        CHECK_INT(a.blocks[1 + k], copy[k][1]);
        for (uint32_t j = 0; j < 10; j++)
            CHECK(copy[k][1] != before[j] || copy[k][0] == copy[k][1]);
    }
    CHECK_INT(a.blocks[6], before[9]);
    CHECK_INT(a.n_indexed, 1);
    CHECK(!a.chain_open);
    /* the dropped blocks and the sources stay held until the copies are made */
    CHECK_INT(a.n_held, 3 + 5);
    struct prefix_block_info bi;
    CHECK_INT(prefix_block_info(px, before[4], &bi), 0);
    CHECK_INT(bi.refs, 1);
    prefix_window_done(px, &a);
    CHECK_INT(a.n_held, 0);
    CHECK_INT(prefix_block_info(px, before[4], &bi), 0);
    CHECK_INT(bi.refs, 0);          /* cached, findable */
    CHECK(bi.indexed && bi.on_lru);
    CHECK_INT(check_ok(px), 0);
    /* the cached prefix is intact: a new sequence finds all 9 full blocks of P */
    struct prefix_seq c;
    memset(&c, 0, sizeof(c));
    CHECK_INT(prefix_seq_begin(px, &c, ns, P, 9 * BT + 1, NULL), 9 * BT);
    CHECK(seq_sigs_ok(pool, &c, 0, P, 9));
    prefix_seq_release(px, &c);
    /* a goes on with its windowed history: nothing past the sink is indexed */
    int32_t W[8 * BT];
    memcpy(W, P, BT * sizeof(int32_t));
    memcpy(W + BT, P + 4 * BT, 6 * BT * sizeof(int32_t));
    for (uint32_t i = 7 * BT; i < 8 * BT; i++)
        W[i] = (int32_t)(900 + i);
    const uint32_t indexed = pool_header(pool)->cache.n_indexed;
    CHECK_INT(prefix_seq_grow(px, &a, 8 * BT, W, 8 * BT), 0);
    CHECK_INT(prefix_seq_commit(px, &a, W, 8 * BT), 0);
    CHECK_INT(pool_header(pool)->cache.n_indexed, indexed);
    CHECK_INT(check_ok(px), 0);
    /* refusals */
    CHECK_INT(prefix_seq_window(px, &a, 1, 7, copy), KVD_EINVAL);  /* nothing would move */
    CHECK_INT(prefix_seq_window(px, &a, 1, 0, copy), KVD_EINVAL);
    prefix_seq_release(px, &a);
    prefix_seq_release(px, &b);
    CHECK_INT(check_ok(px), 0);
    CHECK_INT(pool_header(pool)->cache.n_pending, 0);
    prefix_seq_fini(&a);
    prefix_seq_fini(&b);
    prefix_seq_fini(&c);
    prefix_destroy(&px);
    pool_close(&pool);
}

int main(int argc, char **argv)
{
    uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : DEFAULT_SEED;
    uint64_t n_ops = argc > 2 ? strtoull(argv[2], NULL, 0) : DEFAULT_OPS;

    test_namespaces();
    test_hide_pending();
    test_wait();
    test_broken_promise();
    test_collisions();
    test_owner_limit();
    test_public_prefix();
    test_window();
    test_block_hits();

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    test_random(seed, n_ops, false);
    test_random(seed + 1, n_ops / 2, true);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    fprintf(stderr, "  %.2f s\n", (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    return CHECK_DONE();
}
