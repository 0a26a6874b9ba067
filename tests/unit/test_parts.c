/*
 * test_parts.c - a pool whose blocks hold parts of the layers
 * (common/kvparts.h, shm/prefix.h): one block table per part, windowed parts
 * that keep only their window, and prefix hits that every part can continue.
 *
 * First the planning of parts for real layer patterns (Gemma 3 270M and 1B,
 * SmolLM2), then deterministic cases on a pool of three one-layer parts (part
 * 0 full, part 1 a window of 5 positions, part 2 a window of 11) with blocks
 * of 4 positions: what a sequence holds as it slides, a hit after the prompt
 * was released, the eviction order (windowed blocks that no window reads go
 * first), a hit cut short where a window's block is gone, and a constant key
 * function under which every key collides.
 *
 * Then a randomized run: six sequences begin (prompts sharing system
 * prompts, three namespaces), grow, write and commit (appending generated
 * tokens), release, and the cache evicts. Before a block is committed the
 * test writes a signature of (namespace, part, every token up to the block's
 * end) into it, the stand-in for K/V computed from those tokens. After every
 * step: prefix_check(), every block's reference count equals the number of
 * sequence tables holding it, every windowed table holds exactly the blocks
 * its window reads, and every held block carries its sequence's signature.
 * Every begin's hit is compared with a brute-force search over the block
 * records (prefix_block_info) for the longest prefix that part 0 holds whole
 * and every other part can continue: a hit that is too long would hand out
 * K/V of other tokens, one that is too short is a lost hit.
 *
 * Usage: test_parts [seed [ops]].
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "err.h"
#include "kvparts.h"
#include "pool.h"
#include "prefix.h"

#define BT 4u                   /* positions per block */
#define NB 96u                  /* blocks in the pool */
#define BLOCK_BYTES 64u         /* 2 x 1 layer x 1 head x 4 dims x 4 positions x 2 bytes */
#define NPART 3u
#define NSLOT 6
#define MAXLEN 64u
#define MAXBLK (MAXLEN / BT)
#define NNS 3
#define NSYS 3
#define DEFAULT_OPS 100000u
#define DEFAULT_SEED UINT64_C(0x7061727473303031)

static const uint32_t windows[NPART] = { 0, 5, 11 };
static const char *const ns_names[NNS] = { "", "tenant-a", "tenant-b" };

#include "pooltest.h"

/* ---- signatures ----------------------------------------------------------- */

/* What part `part`'s K/V of a block ending at position n hold. */
static uint64_t kv_sig(int ns, uint32_t part, const int32_t *tok, uint32_t n)
{
    uint64_t h = mix64(UINT64_C(0x5041) + (uint64_t)ns * 131 + part);
    for (uint32_t i = 0; i < n; i++)
        h = mix64(h ^ (uint32_t)tok[i]);
    return mix64(h ^ n);
}

static prefix_key_t hash_const(const uint8_t secret[POOL_SECRET_BYTES], prefix_key_t parent,
                               prefix_ns_t ns, const uint8_t fingerprint[16],
                               const int32_t *tokens, uint32_t n)
{
    return (prefix_key_t){ 7, 7 };
}

/* ---- planning ------------------------------------------------------------------ */

static void test_plan(void)
{
    struct kv_parts p;
    char err[160];
    /* Gemma 3 270M: 18 layers, every sixth full */
    uint32_t w[64];
    for (uint32_t l = 0; l < 18; l++)
        w[l] = (l + 1) % 6 == 0 ? 0 : 512;
    kv_parts_plan(18, w, &p);
    CHECK(p.n_parts == 6 && p.part_layers == 3);
    CHECK(p.window[0] == 0 && p.window[1] == 512 && p.window[5] == 512);
    CHECK(p.layer_part[5] == 0 && p.layer_part[11] == 0 && p.layer_part[17] == 0);
    CHECK(p.layer_slot[5] == 0 && p.layer_slot[11] == 1 && p.layer_slot[17] == 2);
    CHECK(p.layer_part[0] == 1 && p.layer_slot[0] == 0 && p.layer_part[2] == 1 && p.layer_slot[2] == 2);
    CHECK(p.layer_part[3] == 2 && p.layer_slot[3] == 0);
    CHECK(p.layer_part[4] == 2 && p.layer_slot[4] == 1 && p.layer_part[16] == 5);
    CHECK(kv_parts_check(18, &p, err, sizeof(err)) == 0);
    CHECK(kv_parts_blocks_held(&p, 32768, 16) == 2048 + 5 * (2048 - (32769 - 512) / 16));
    /* Gemma 3 1B: 26 layers, 4 full: parts of 2 */
    for (uint32_t l = 0; l < 26; l++)
        w[l] = (l + 1) % 6 == 0 ? 0 : 512;
    kv_parts_plan(26, w, &p);
    CHECK(p.n_parts == 13 && p.part_layers == 2 && p.window[1] == 0 && p.window[2] == 512);
    CHECK(kv_parts_check(26, &p, err, sizeof(err)) == 0);
    /* no window, or no full layer: one part */
    for (uint32_t l = 0; l < 30; l++)
        w[l] = 0;
    kv_parts_plan(30, w, &p);
    CHECK(p.n_parts == 1 && p.part_layers == 30);
    for (uint32_t l = 0; l < 30; l++)
        w[l] = 4096;
    kv_parts_plan(30, w, &p);
    CHECK(p.n_parts == 1);
    /* a broken description is refused */
    kv_parts_plan(18, (uint32_t[18]){ 0, 9, 9, 9, 9, 9, 0, 9, 9, 9, 9, 9, 0, 9, 9, 9, 9, 9 }, &p);
    CHECK(p.n_parts == 6);
    p.layer_slot[1] = p.layer_slot[2];
    CHECK(kv_parts_check(18, &p, err, sizeof(err)) != 0);
    kv_parts_plan(18, (uint32_t[18]){ 0, 9, 9, 9, 9, 9, 0, 9, 9, 9, 9, 9, 0, 9, 9, 9, 9, 9 }, &p);
    p.window[0] = 9;
    CHECK(kv_parts_check(18, &p, err, sizeof(err)) != 0);
    CHECK(kv_window_first_block(0, 1000, 16) == 0);
    CHECK(kv_window_first_block(512, 511, 16) == 0);
    CHECK(kv_window_first_block(512, 512, 16) == 0);    /* position 512 reads 1.. */
    CHECK(kv_window_first_block(512, 527, 16) == 1);    /* position 527 reads 16.. */
    CHECK(kv_window_first_block(512, 526, 16) == 0);
}

/* ---- the pool under test ----------------------------------------------------------- */

static pool_t *pool_open_parts(uint32_t n_blocks)
{
    /* layer 1 full, layer 0 a window of 5, layer 2 one of 11 */
    struct kv_parts parts;
    kv_parts_plan(NPART, (uint32_t[NPART]){ windows[1], 0, windows[2] }, &parts);
    REQUIRE(parts.n_parts == NPART && parts.part_layers == 1);
    REQUIRE(parts.window[1] == windows[1] && parts.window[2] == windows[2]);
    return pool_make("test_parts/fp001", NPART, &parts, n_blocks);
}

/* Writes positions [s->n_committed x BT, n) of s (signatures into every full
 * block of every part) and commits them. */
static int seq_write(pool_t *pool, prefix_t *px, struct prefix_seq *s, int ns, const int32_t *tok,
                     uint32_t n)
{
    for (uint32_t i = s->n_committed; i < n / BT; i++)
        for (uint32_t p = 0; p < NPART; p++)
            if (s->tables[p][i] != POOL_NONE)
                kv_fill(pool, s->tables[p][i], kv_sig(ns, p, tok, (i + 1) * BT));
    return prefix_seq_commit(px, s, tok, n);
}

/* Blocks that part p's table holds: [first, n_blocks), POOL_NONE before. */
static bool table_shape_ok(const struct prefix_seq *s, uint32_t p, uint32_t n_written)
{
    uint64_t lo = kv_window_first_block(windows[p], n_written, BT);
    if (lo > s->n_committed)
        lo = s->n_committed;
    if (s->first[p] != lo)
        return false;
    for (uint32_t i = 0; i < s->n_blocks; i++)
        if ((s->tables[p][i] == POOL_NONE) != (i < lo))
            return false;
    return true;
}

static bool seq_sigs_ok(pool_t *pool, const struct prefix_seq *s, int ns, const int32_t *tok,
                        uint32_t n_full)
{
    for (uint32_t p = 0; p < NPART; p++)
        for (uint32_t i = s->first[p]; i < n_full && i < s->n_blocks; i++)
            if (!kv_holds(pool, s->tables[p][i], kv_sig(ns, p, tok, (i + 1) * BT)))
                return false;
    return true;
}

/* ---- deterministic cases ----------------------------------------------------------- */

static void test_slide_and_hit(void)
{
    pool_t *pool = pool_open_parts(NB);
    prefix_t *px = prefix_open(pool);
    prefix_ns_t ns = prefix_namespace(px, "", 0);
    int32_t P[41];
    for (uint32_t i = 0; i < 41; i++)
        P[i] = (int32_t)(100 + i);
    struct prefix_seq s;
    memset(&s, 0, sizeof(s));
    CHECK(prefix_seq_begin(px, &s, ns, P, 41, NULL) == 0);
    CHECK(s.n_parts == NPART);
    CHECK(prefix_seq_grow(px, &s, 41, P, 41) == 0);
    CHECK(s.n_blocks == 11);
    struct prefix_stats st;
    prefix_stats(px, &st);
    CHECK(st.n_pending == 33);
    /* write in chunks of 8: the windows slide behind */
    for (uint32_t n = 8; n <= 40; n += 8) {
        CHECK(seq_write(pool, px, &s, 0, P, n) == 0);
        for (uint32_t p = 0; p < NPART; p++)
            CHECK(table_shape_ok(&s, p, n));
        CHECK(check_ok(px) == 0);
    }
    /* after 40 positions: part 1 (window 5) reads 36.., part 2 (11) 30.. */
    CHECK(s.first[0] == 0 && s.first[1] == 9 && s.first[2] == 7);
    prefix_stats(px, &st);
    CHECK(st.n_used == 10 + 1 + 3 && st.n_pending == 3);
    CHECK(st.n_cached == 9 + 7);    /* slid out, still findable */
    CHECK(seq_sigs_ok(pool, &s, 0, P, 10));
    prefix_seq_release(px, &s);
    CHECK(check_ok(px) == 0);

    /* the same prompt again: every part continues at 40 */
    CHECK(prefix_seq_begin(px, &s, ns, P, 41, NULL) == 40);
    CHECK(s.first[1] == 9 && s.first[2] == 7);
    CHECK(seq_sigs_ok(pool, &s, 0, P, 10));
    for (uint32_t p = 0; p < NPART; p++)
        CHECK(table_shape_ok(&s, p, 40));
    prefix_seq_release(px, &s);
    /* a prompt of 21 tokens ends at 20, where part 2 needs blocks 2..4: slid
     * out long ago but cached, so it hits */
    CHECK(prefix_seq_begin(px, &s, ns, P, 21, NULL) == 20);
    CHECK(s.first[1] == 4 && s.first[2] == 2);
    CHECK(seq_sigs_ok(pool, &s, 0, P, 5));
    prefix_seq_release(px, &s);
    CHECK(check_ok(px) == 0);

    /* eviction takes what no window reads first: the windowed blocks of the
     * early positions, never the ones the 41-token prompt's hit needs */
    uint32_t lru[NB];
    uint32_t n_lru = prefix_lru(px, lru, NB);
    CHECK(n_lru == 30);
    struct prefix_block_info bi;
    REQUIRE(prefix_block_info(px, lru[n_lru - 1], &bi) == 0);
    CHECK(bi.part != 0);
    CHECK(prefix_evict(px, 12) == 12);
    CHECK(check_ok(px) == 0);
    CHECK(prefix_seq_begin(px, &s, ns, P, 41, NULL) == 40);
    CHECK(seq_sigs_ok(pool, &s, 0, P, 10));
    prefix_seq_release(px, &s);
    CHECK(check_ok(px) == 0);
    prefix_seq_fini(&s);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* Writes P[0..32) as one sequence and releases it, then evicts from the LRU
 * tail until a block the windows at position 32 read is gone (a lookup of
 * P[0..33) finds fewer than its 8 blocks); returns that lookup. */
static struct prefix_match write_then_lose_window(pool_t *pool, prefix_t *px, prefix_ns_t ns,
                                                  const int32_t *P)
{
    struct prefix_seq s;
    memset(&s, 0, sizeof(s));
    CHECK(prefix_seq_begin(px, &s, ns, P, 33, NULL) == 0);
    CHECK(prefix_seq_grow(px, &s, 33, P, 33) == 0);
    CHECK(seq_write(pool, px, &s, 0, P, 32) == 0);
    prefix_seq_release(px, &s);
    prefix_seq_fini(&s);
    uint32_t ids[16];
    struct prefix_match m;
    prefix_lookup(px, ns, P, 33, 8, ids, &m);
    CHECK(m.n_blocks == 8 && m.pending == POOL_NONE);
    for (int guard = 0; guard < 64; guard++) {
        prefix_lookup(px, ns, P, 33, 8, ids, &m);
        if (m.n_blocks < 8)
            break;
        CHECK(prefix_evict(px, 1) == 1);
    }
    CHECK(m.n_blocks < 8);
    return m;
}

/* A windowed block that is gone cuts the hit where that block is needed, and
 * lookups agree with begin. */
static void test_missing_part_block(void)
{
    pool_t *pool = pool_open_parts(NB);
    prefix_t *px = prefix_open(pool);
    prefix_ns_t ns = prefix_namespace(px, "x", 1);
    int32_t P[33];
    for (uint32_t i = 0; i < 33; i++)
        P[i] = (int32_t)(7 * i + 3);
    const struct prefix_match m = write_then_lose_window(pool, px, ns, P);
    struct prefix_seq s;
    memset(&s, 0, sizeof(s));
    int64_t got = prefix_seq_begin(px, &s, ns, P, 33, NULL);
    CHECK(got == (int64_t)m.n_blocks * BT);
    CHECK(seq_sigs_ok(pool, &s, 0, P, m.n_blocks));
    prefix_seq_release(px, &s);
    CHECK(check_ok(px) == 0);
    prefix_seq_fini(&s);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* A prompt whose part-0 chain outlived its windows' blocks computes that
 * stretch again, and what it computes is cached for the next request: the
 * stale part-0 blocks make way instead of turning the new ones into private
 * copies. */
static void test_recompute_stays_cached(void)
{
    pool_t *pool = pool_open_parts(NB);
    prefix_t *px = prefix_open(pool);
    prefix_ns_t ns = prefix_namespace(px, "", 0);
    int32_t P[41];
    for (uint32_t i = 0; i < 41; i++)
        P[i] = (int32_t)(11 * i + 5);
    /* part 0's chain is whole, the windows at 32 are not */
    const struct prefix_match m = write_then_lose_window(pool, px, ns, P);
    struct prefix_seq s;
    memset(&s, 0, sizeof(s));
    /* the longer prompt: hits what every part continues, computes the rest */
    const int64_t first = prefix_seq_begin(px, &s, ns, P, 41, NULL);
    CHECK(first == (int64_t)m.n_blocks * BT);
    CHECK(check_ok(px) == 0);
    CHECK(prefix_seq_grow(px, &s, 41, P, 41) == 0);
    CHECK(seq_write(pool, px, &s, 0, P, 40) == 0);
    CHECK(s.chain_open && s.n_indexed == 10);
    prefix_seq_release(px, &s);
    CHECK(check_ok(px) == 0);
    /* and the next request finds all of it */
    CHECK(prefix_seq_begin(px, &s, ns, P, 41, NULL) == 40);
    CHECK(seq_sigs_ok(pool, &s, 0, P, 10));
    prefix_seq_release(px, &s);
    prefix_seq_fini(&s);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* Under a constant key every entry collides; parts still find only their own. */
static void test_collisions(void)
{
    pool_t *pool = pool_open_parts(NB);
    prefix_t *px = prefix_open(pool);
    CHECK(prefix_set_hash(px, hash_const) == 0);
    prefix_ns_t ns = prefix_namespace(px, "", 0);
    int32_t A[25], B[25];
    for (uint32_t i = 0; i < 25; i++) {
        A[i] = (int32_t)i;
        B[i] = i < 12 ? (int32_t)i : (int32_t)(1000 + i);
    }
    struct prefix_seq s;
    memset(&s, 0, sizeof(s));
    CHECK(prefix_seq_begin(px, &s, ns, A, 25, NULL) == 0);
    CHECK(prefix_seq_grow(px, &s, 25, A, 25) == 0);
    CHECK(seq_write(pool, px, &s, 0, A, 24) == 0);
    prefix_seq_release(px, &s);
    CHECK(check_ok(px) == 0);
    CHECK(prefix_seq_begin(px, &s, ns, A, 25, NULL) == 24);
    CHECK(seq_sigs_ok(pool, &s, 0, A, 6));
    prefix_seq_release(px, &s);
    /* B shares 3 blocks with A; the windows at 12 are there */
    CHECK(prefix_seq_begin(px, &s, ns, B, 25, NULL) == 12);
    CHECK(seq_sigs_ok(pool, &s, 0, B, 3));
    prefix_seq_release(px, &s);
    CHECK(check_ok(px) == 0);
    prefix_seq_fini(&s);
    prefix_destroy(&px);
    pool_close(&pool);
}

/* ---- the randomized run ---------------------------------------------------------- */

struct slot {
    bool live;
    int ns;
    int32_t tok[MAXLEN];
    uint32_t n_tok;         /* known tokens */
    uint32_t n_written;     /* positions committed */
    struct prefix_seq ps;
};

struct world {
    pool_t *pool;
    prefix_t *px;
    prefix_ns_t ns[NNS];
    int32_t sys[NSYS][MAXLEN];
    struct slot s[NSLOT];
    uint64_t rng;
    uint64_t hits, hit_tokens, begins, windowed_cuts;
};

static uint64_t rnd(struct world *w)
{
    w->rng = w->rng * UINT64_C(6364136223846793005) + UINT64_C(1442695040888963407);
    return mix64(w->rng);
}

static uint32_t below(struct world *w, uint32_t n)
{
    return (uint32_t)(rnd(w) % n);
}

/* The indexed, committed block of part p hanging from `parent` (part 0: the
 * chain's previous block) with these tokens, searched over every record;
 * POOL_NONE if none. The spine is matched by key as well (namespace). */
static uint32_t oracle_find(const prefix_t *px, uint32_t p, uint32_t parent, const int32_t *tok,
                            const prefix_key_t *key)
{
    for (uint32_t id = 0; id < NB; id++) {
        struct prefix_block_info bi;
        REQUIRE(prefix_block_info(px, id, &bi) == 0);
        if (!bi.indexed || bi.state != POOL_BLOCK_COMMITTED || bi.part != p || bi.parent != parent ||
            memcmp(bi.tokens, tok, BT * 4) != 0)
            continue;
        if (key != NULL && (bi.key.lo != key->lo || bi.key.hi != key->hi))
            continue;
        return id;
    }
    return POOL_NONE;
}

/* The longest hit the contract allows for tokens[0..n) in namespace ns. */
static uint32_t oracle_hit(const struct world *w, int ns, const int32_t *tok, uint32_t n)
{
    const uint32_t max = n ? (n - 1) / BT : 0;
    prefix_key_t keys[MAXBLK];
    uint32_t spine[MAXBLK];
    prefix_hash_chain(w->px, w->ns[ns], tok, max, keys);
    uint32_t m = 0, parent = POOL_NONE;
    while (m < max) {
        uint32_t id = oracle_find(w->px, 0, parent, tok + m * BT, &keys[m]);
        if (id == POOL_NONE)
            break;
        spine[m++] = parent = id;
    }
    for (uint32_t j = m; j > 0; j--) {
        bool ok = true;
        for (uint32_t p = 1; p < NPART && ok; p++)
            for (uint64_t i = kv_window_first_block(windows[p], (uint64_t)j * BT, BT); i < j && ok; i++)
                ok = oracle_find(w->px, p, spine[i], tok + i * BT, NULL) != POOL_NONE;
        if (ok)
            return j;
    }
    return 0;
}

static void verify(struct world *w)
{
    REQUIRE(check_ok(w->px) == 0);
    uint32_t holders[NB];
    memset(holders, 0, sizeof(holders));
    for (int k = 0; k < NSLOT; k++) {
        const struct slot *sl = &w->s[k];
        if (!sl->live)
            continue;
        for (uint32_t p = 0; p < NPART; p++) {
            REQUIRE(table_shape_ok(&sl->ps, p, sl->n_written));
            for (uint32_t i = sl->ps.first[p]; i < sl->ps.n_blocks; i++) {
                REQUIRE(sl->ps.tables[p][i] < NB);
                holders[sl->ps.tables[p][i]]++;
            }
        }
        REQUIRE(seq_sigs_ok(w->pool, &sl->ps, sl->ns, sl->tok, sl->n_written / BT));
    }
    for (uint32_t id = 0; id < NB; id++) {
        struct prefix_block_info bi;
        REQUIRE(prefix_block_info(w->px, id, &bi) == 0);
        REQUIRE(bi.refs == holders[id]);
    }
}

static void op_begin(struct world *w, struct slot *sl)
{
    sl->ns = (int)below(w, NNS);
    uint32_t sys = below(w, NSYS + 1), n = 0;
    if (sys < NSYS) {
        n = 4 + below(w, 40);
        memcpy(sl->tok, w->sys[sys], n * 4);
    }
    uint32_t tail = 1 + below(w, 10);
    for (uint32_t i = 0; i < tail && n < MAXLEN - 8; i++)
        sl->tok[n++] = (int32_t)below(w, 6);
    sl->n_tok = n;
    const uint32_t want = oracle_hit(w, sl->ns, sl->tok, n);
    memset(&sl->ps, 0, sizeof(sl->ps));
    int64_t got = prefix_seq_begin(w->px, &sl->ps, w->ns[sl->ns], sl->tok, n, NULL);
    REQUIRE(got >= 0);
    if ((uint64_t)got != (uint64_t)want * BT)
        fprintf(stderr, "begin: hit %lld tokens, the records allow %u\n", (long long)got, want * BT);
    REQUIRE((uint64_t)got == (uint64_t)want * BT);
    sl->live = true;
    sl->n_written = (uint32_t)got;
    w->begins++;
    if (got > 0) {
        w->hits++;
        w->hit_tokens += (uint64_t)got;
    }
}

static void op_grow(struct world *w, struct slot *sl)
{
    uint32_t to = sl->n_written + 1 + below(w, 16);
    if (to > MAXLEN)
        to = MAXLEN;
    struct prefix_stats before, after;
    prefix_stats(w->px, &before);
    uint32_t nb = sl->ps.n_blocks;
    int rc = prefix_seq_grow(w->px, &sl->ps, to, sl->tok, sl->n_tok);
    REQUIRE(rc == 0 || rc == KVD_ENOSPACE);
    if (rc == KVD_ENOSPACE) {
        prefix_stats(w->px, &after);
        REQUIRE(sl->ps.n_blocks == nb && after.n_free == before.n_free &&
                after.n_cached == before.n_cached);
    }
}

static void op_write(struct world *w, struct slot *sl)
{
    const uint32_t held = sl->ps.n_blocks * BT;
    if (held <= sl->n_written)
        return;
    uint32_t to = sl->n_written + 1 + below(w, held - sl->n_written);
    while (sl->n_tok < to)  /* generated tokens */
        sl->tok[sl->n_tok++] = (int32_t)below(w, 6);
    REQUIRE(seq_write(w->pool, w->px, &sl->ps, sl->ns, sl->tok, to) == 0);
    sl->n_written = to;
}

static void op_release(struct world *w, struct slot *sl)
{
    prefix_seq_release(w->px, &sl->ps);
    prefix_seq_fini(&sl->ps);
    sl->live = false;
}

static void test_random(uint64_t seed, uint64_t n_ops)
{
    struct world *w = calloc(1, sizeof(*w));
    REQUIRE(w != NULL);
    w->rng = seed;
    w->pool = pool_open_parts(NB);
    w->px = prefix_open(w->pool);
    for (int i = 0; i < NNS; i++)
        w->ns[i] = prefix_namespace(w->px, ns_names[i], strlen(ns_names[i]));
    for (int i = 0; i < NSYS; i++)
        for (uint32_t t = 0; t < MAXLEN; t++)
            w->sys[i][t] = (int32_t)(i == 0 ? t % 5 : below(w, 6));
    for (uint64_t op = 0; op < n_ops; op++) {
        struct slot *sl = &w->s[below(w, NSLOT)];
        const uint32_t r = below(w, 100);
        if (!sl->live)
            op_begin(w, sl);
        else if (r < 35)
            op_grow(w, sl);
        else if (r < 80)
            op_write(w, sl);
        else if (r < 95)
            op_release(w, sl);
        else
            prefix_evict(w->px, 1 + below(w, 4));
        verify(w);
    }
    fprintf(stderr, "test_parts: %llu begins, %llu hits (%llu tokens)\n",
            (unsigned long long)w->begins, (unsigned long long)w->hits,
            (unsigned long long)w->hit_tokens);
    CHECK(w->hits > w->begins / 10);
    for (int k = 0; k < NSLOT; k++)
        if (w->s[k].live)
            op_release(w, &w->s[k]);
    verify(w);
    struct prefix_stats st;
    prefix_stats(w->px, &st);
    CHECK(st.n_used == 0 && st.n_pending == 0 && st.n_free + st.n_cached == NB);
    prefix_destroy(&w->px);
    pool_close(&w->pool);
    free(w);
}

int main(int argc, char **argv)
{
    uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : DEFAULT_SEED;
    uint64_t n_ops = argc > 2 ? strtoull(argv[2], NULL, 0) : DEFAULT_OPS;
    test_plan();
    test_slide_and_hit();
    test_missing_part_block();
    test_recompute_stays_cached();
    test_collisions();
    test_random(seed, n_ops);
    return CHECK_DONE();
}
