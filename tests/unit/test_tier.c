/*
 * test_tier.c - the host tier (shm/tier.h) and the pool's use of it
 * (prefix_set_tier in shm/prefix.h).
 *
 *   store     random puts and gets of incompressible blocks against a
 *             reference LRU of the same capacity: the same entries after every
 *             operation, every get's bytes those put; compressible blocks kept
 *             compressed and given back exact; an entry of the same identity
 *             replaced; a lookup differing in key, parent, namespace or one
 *             token misses; a damaged entry is a miss, dropped and counted
 *   pool      a pool of 24 blocks under a stream of prompts that need several
 *             times that (shared system prompts, two namespaces, sequences
 *             kept alive across others, a collision-only key function in a
 *             second run): every block a sequence begins with, whether it stayed
 *             in the pool or came back from the tier, holds the signature of
 *             exactly its namespace and tokens; prefix_check after every
 *             operation; blocks do come back, and damaged entries are misses
 *             and the same again with a disk tier behind the host tier (every
 *             findable block written behind): what the host tier dropped comes
 *             back from disk
 *   disk      the disk tier alone: blocks written and read back exact; an
 *             identity that differs misses; damaged data (on read) and a
 *             damaged header (on open) removed and counted; a temporary left
 *             by a crash removed; another layout's files ignored; a smaller
 *             budget keeps the most recently used
 *             and again over a pool in three parts (one full, windows of 5
 *             and 11 positions): every part's blocks a sequence holds carry
 *             its own signature, a restored prefix included
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "disktier.h"
#include "err.h"
#include "kvparts.h"
#include "pool.h"
#include "prefix.h"
#include "tier.h"
#include "types.h"

#define BT 4u                   /* positions per block */
#define NB 24u                  /* blocks in the pool */
#define BLOCK_BYTES 64u         /* 2 x 1 layer x 1 head x 4 dims x 4 positions x 2 bytes */

#include "pooltest.h"

static uint64_t rng = UINT64_C(0x7469657274657374);

static uint64_t rnd(void)
{
    rng = mix64(rng);
    return rng;
}

static uint32_t below(uint32_t n) { return (uint32_t)(rnd() % n); }

/* ---- the store alone ------------------------------------------------------------ */

#define SB 256u                 /* bytes of a block in the store tests */
#define NID 40                  /* identities */

struct ident {
    struct prefix_tier_block b;
    int32_t tok[BT];
};

static void ident_make(struct ident *id, int i)
{
    for (uint32_t j = 0; j < BT; j++)
        id->tok[j] = (int32_t)(i * 7 + (int)j);
    id->b = (struct prefix_tier_block){ .key = { mix64((uint64_t)i), (uint64_t)i },
                                        .parent = { mix64((uint64_t)i + 1000), 0 },
                                        .ns = { 1, 2 }, .tokens = id->tok };
}

/* Incompressible bytes for identity i, version v. */
static void block_bytes(uint8_t *d, int i, uint32_t v)
{
    uint64_t x = mix64(((uint64_t)i << 32) | v);
    for (uint32_t k = 0; k < SB; k += 8) {
        x = mix64(x);
        memcpy(d + k, &x, 8);
    }
}

static void test_store(void)
{
    char err[256];
    CHECK(tier_new(100, BT, SB, err, sizeof(err)) == NULL);     /* less than one block */
    tier_t *t = tier_new(64 * 1024, BT, SB, err, sizeof(err));
    REQUIRE(t != NULL);
    struct ident ids[NID];
    for (int i = 0; i < NID; i++)
        ident_make(&ids[i], i);
    uint8_t buf[SB], want[SB];
    /* learn an entry's cost, then size the budget to 10 entries exactly */
    block_bytes(buf, 0, 0);
    REQUIRE(tier_put(t, &ids[0].b, buf) == 0);
    struct tier_stats st;
    tier_stats(t, &st);
    const uint64_t per = st.bytes;
    CHECK(st.entries == 1 && st.compressed == 0 && per >= SB);
    tier_destroy(&t);
    enum { CAP = 10 };
    t = tier_new(CAP * per + per / 2, BT, SB, err, sizeof(err));
    REQUIRE(t != NULL);

    /* the reference: identities from most to least recent, each with its version */
    int order[NID], n = 0;
    uint32_t version[NID] = { 0 };
    int gets = 0, hits = 0, bad = 0;
    for (int op = 0; op < 20000; op++) {
        const int i = (int)below(NID);
        int at = -1;
        for (int k = 0; k < n; k++)
            if (order[k] == i)
                at = k;
        if (below(3) == 0) {
            version[i]++;
            block_bytes(buf, i, version[i]);
            REQUIRE(tier_put(t, &ids[i].b, buf) == 0);
            if (at >= 0) {
                memmove(order + at, order + at + 1, (size_t)(n - at - 1) * sizeof(int));
                n--;
            }
            if (n == CAP)
                n--;            /* the least recent goes */
            memmove(order + 1, order, (size_t)n * sizeof(int));
            order[0] = i;
            n++;
        } else {
            memset(buf, 0, sizeof(buf));
            const bool got = tier_get(t, &ids[i].b, buf);
            gets++;
            if (got != (at >= 0)) {
                bad++;
                continue;
            }
            if (!got)
                continue;
            hits++;
            block_bytes(want, i, version[i]);
            bad += memcmp(buf, want, SB) != 0;
            memmove(order + 1, order, (size_t)at * sizeof(int));
            order[0] = i;
        }
        for (int k = 0; k < NID; k++) {
            bool in = false;
            for (int j = 0; j < n; j++)
                in = in || order[j] == k;
            bad += tier_has(t, &ids[k].b) != in;
        }
    }
    tier_stats(t, &st);
    printf("store: %d gets, %d hits, entries %llu of %d, %llu dropped, %d disagreements with the reference\n", gets,
           hits, (unsigned long long)st.entries, CAP, (unsigned long long)st.dropped, bad);
    CHECK_INT(bad, 0);
    CHECK(hits > 1000 && st.dropped > 1000);
    CHECK_INT(st.entries, n);
    CHECK(st.bytes <= st.max_bytes);

    /* an identity that differs anywhere misses */
    const int i = order[0];
    struct ident other = ids[i];
    other.b.tokens = other.tok;
    other.tok[BT - 1]++;
    CHECK(!tier_get(t, &other.b, buf));
    other = ids[i];
    other.b.tokens = other.tok;
    other.b.parent.hi ^= 1;
    CHECK(!tier_get(t, &other.b, buf));
    other = ids[i];
    other.b.tokens = other.tok;
    other.b.ns.lo ^= 1;
    CHECK(!tier_get(t, &other.b, buf));
    other = ids[i];
    other.b.tokens = other.tok;
    other.b.key.hi ^= 1;
    CHECK(!tier_get(t, &other.b, buf));
    other = ids[i];
    other.b.tokens = other.tok;
    other.b.path.lo ^= 1;       /* the same block after another chain */
    CHECK(!tier_get(t, &other.b, buf));
    CHECK(tier_get(t, &ids[i].b, buf));

    /* a damaged entry: a miss, dropped, counted */
    CHECK(tier_corrupt_for_test(t, &ids[i].b));
    CHECK(!tier_get(t, &ids[i].b, buf));
    CHECK(!tier_has(t, &ids[i].b));
    tier_stats(t, &st);
    CHECK_INT(st.corrupt, 1);

    /* compressible blocks: kept compressed, given back exact, damage found */
    uint8_t z[SB];
    for (uint32_t k = 0; k < SB; k++)
        z[k] = (uint8_t)(k / 64);
    REQUIRE(tier_put(t, &ids[1].b, z) == 0);
    tier_stats(t, &st);
    CHECK(st.compressed >= 1);
    CHECK(tier_get(t, &ids[1].b, buf) && memcmp(buf, z, SB) == 0);
    CHECK(tier_corrupt_for_test(t, &ids[1].b));
    CHECK(!tier_get(t, &ids[1].b, buf));
    tier_stats(t, &st);
    CHECK_INT(st.corrupt, 2);
    printf("store: compressible blocks kept compressed and exact; damaged entries are misses\n");
    tier_destroy(&t);
}

/* ---- the pool over a tier ------------------------------------------------------- */

static const char *const ns_names[2] = { "", "tenant-b" };

/* What part `part`'s K/V of a block ending at position n hold. */
static uint64_t kv_sig(int ns, uint32_t part, const int32_t *tok, uint32_t n)
{
    uint64_t h = mix64(UINT64_C(0x7469) + (uint64_t)ns * 131 + part);
    for (uint32_t i = 0; i < n; i++)
        h = mix64(h ^ (uint32_t)tok[i]);
    return mix64(h ^ n);
}

#define NCOPY 256

/* A copy an asynchronous tier was asked to make (start()), run later. */
struct copy {
    int slot;                   /* the live sequence it is for */
    uint32_t logical;
    void *dst;
    struct prefix_tier_block b;
    int32_t tok[BT];
};

/* The tiers of a pool run: a host tier, and a disk tier behind it or not. */
struct tiers {
    tier_t *host;
    disk_tier_t *disk;
    uint64_t from_host, from_disk;
    struct copy q[NCOPY];       /* asynchronous: copies not run yet */
    uint32_t n_q;
    int slot;                   /* the sequence whose begin runs */
};

static void tier_committed(void *user, const struct prefix_tier_block *b, const void *data)
{
    struct tiers *ts = user;
    if (ts->disk)
        disk_tier_put(ts->disk, b, data);
}

static void tier_evicted(void *user, const struct prefix_tier_block *b, const void *data)
{
    struct tiers *ts = user;
    REQUIRE(tier_put(ts->host, b, data) == 0);
}

static bool tier_has_cb(void *user, const struct prefix_tier_block *b)
{
    const struct tiers *ts = user;
    return tier_has(ts->host, b) || (ts->disk != NULL && disk_tier_has(ts->disk, b));
}

static bool tier_fetch(void *user, const struct prefix_tier_block *b, void *dst)
{
    struct tiers *ts = user;
    if (tier_get(ts->host, b, dst)) {
        ts->from_host++;
        return true;
    }
    if (ts->disk != NULL && disk_tier_get(ts->disk, b, dst)) {
        ts->from_disk++;
        return true;
    }
    return false;
}

static void tier_start(void *user, const struct prefix_tier_block *b, uint32_t logical, void *dst)
{
    struct tiers *ts = user;
    REQUIRE(ts->n_q < NCOPY);
    struct copy *c = &ts->q[ts->n_q++];
    c->slot = ts->slot;
    c->logical = logical;
    c->dst = dst;
    c->b = *b;
    memcpy(c->tok, b->tokens, sizeof(c->tok));
    c->b.tokens = c->tok;
}

/* Runs the queued copies of sequence `slot` (in a random order) and reports
 * them: true when its prefix came back whole. The blocks whose copies went
 * well but come after one that failed are not counted as restored. */
static bool copies_run(struct tiers *ts, prefix_t *px, struct prefix_seq *s, int slot, const int32_t *tok)
{
    uint32_t bad = UINT32_MAX, n = 0, from[NCOPY];
    struct copy mine[NCOPY];
    for (uint32_t i = 0; i < ts->n_q;) {
        if (ts->q[i].slot == slot) {
            mine[n] = ts->q[i];
            mine[n].b.tokens = mine[n].tok;
            n++;
            ts->q[i] = ts->q[--ts->n_q];
            ts->q[i].b.tokens = ts->q[i].tok;
        } else {
            i++;
        }
    }
    for (uint32_t i = n; i > 1; i--) {
        const uint32_t j = below(i);
        const struct copy c = mine[i - 1];
        mine[i - 1] = mine[j];
        mine[j] = c;
        mine[i - 1].b.tokens = mine[i - 1].tok;
        mine[j].b.tokens = mine[j].tok;
    }
    for (uint32_t i = 0; i < n; i++) {
        from[i] = tier_get(ts->host, &mine[i].b, mine[i].dst) ? 1
                  : ts->disk != NULL && disk_tier_get(ts->disk, &mine[i].b, mine[i].dst) ? 2 : 0;
        if (from[i] == 0 && mine[i].logical < bad)
            bad = mine[i].logical;
    }
    for (uint32_t i = 0; i < n; i++)
        if (mine[i].logical < bad) {
            ts->from_host += from[i] == 1;
            ts->from_disk += from[i] == 2;
        }
    REQUIRE(s->n_restoring == n);
    return prefix_seq_restored(px, s, tok, bad);
}

static prefix_key_t hash_const(const uint8_t secret[POOL_SECRET_BYTES], prefix_key_t parent, prefix_ns_t ns,
                               const uint8_t fingerprint[16], const int32_t *tokens, uint32_t n)
{
    return (prefix_key_t){ 0x5eed, 0 };
}

static pool_t *pool_small(const struct kv_parts *parts)
{
    /* a pool of parts gets more blocks: a logical block takes up to three */
    return pool_make("test_tier/fp0001", parts ? parts->n_parts * parts->part_layers : 1, parts,
                     parts ? 3 * NB : NB);
}

/* Three parts of one layer: layer 1 full, layer 0 a window of 5 positions,
 * layer 2 one of 11 (test_parts.c's). */
static void three_parts(struct kv_parts *parts)
{
    kv_parts_plan(3, (uint32_t[3]){ 5, 0, 11 }, parts);
    REQUIRE(parts->n_parts == 3 && parts->part_layers == 1);
}

#define NPROMPT 14
#define MAXP 40u                /* longest prompt */
#define LIVE 3                  /* sequences kept alive */

struct prompt {
    int32_t tok[MAXP];
    uint32_t n;
    int ns;
};

/* s has begun prompt q and holds its cached prefix whole: every block it
 * holds must carry its own K/V signature (else counted in *wrong); then it
 * goes on as a request would: grows to the prompt, "computes" the rest and
 * commits. false when the pool had no room (s released). */
static bool seq_go_on(pool_t *pool, prefix_t *px, struct prefix_seq *s, const struct prompt *q, uint64_t *wrong)
{
    for (uint32_t part = 0; part < s->n_parts; part++)
        for (uint32_t i = s->first[part]; i < s->n_blocks; i++)
            *wrong += !kv_holds(pool, s->tables[part][i], kv_sig(q->ns, part, q->tok, (i + 1) * BT));
    const int rc = prefix_seq_grow(px, s, q->n, q->tok, q->n);
    if (rc == KVD_ENOSPACE) {
        prefix_seq_release(px, s);      /* the other live sequences hold the pool */
        return false;
    }
    REQUIRE(rc == 0);
    for (uint32_t part = 0; part < s->n_parts; part++)
        for (uint32_t i = s->n_committed; i < q->n / BT; i++)
            if (s->tables[part][i] != POOL_NONE)
                kv_fill(pool, s->tables[part][i], kv_sig(q->ns, part, q->tok, (i + 1) * BT));
    REQUIRE(prefix_seq_commit(px, s, q->tok, q->n) == 0);
    return true;
}

static char disk_dir[] = "/tmp/kvd-test-tier-XXXXXX";

static void pool_run(bool weak_keys, bool disk, bool in_parts, bool async)
{
    char err[256];
    struct kv_parts parts;
    three_parts(&parts);
    pool_t *pool = pool_small(in_parts ? &parts : NULL);
    prefix_t *px = prefix_open(pool);
    if (weak_keys)
        REQUIRE(prefix_set_hash(px, hash_const) == 0);
    /* room for about 20 of the 40-odd blocks the prompts make: entries are dropped too */
    tier_t *t = tier_new(3000, BT, BLOCK_BYTES, err, sizeof(err));
    REQUIRE(t != NULL);
    struct tiers ts = { .host = t };
    if (disk) {
        /* everything findable is written behind; the disk holds what the host tier drops */
        struct disk_tier_layout dl = { .k_type = KERN_F16, .v_type = KERN_F16, .block_tokens = BT,
                                       .block_bytes = BLOCK_BYTES, .n_parts = in_parts ? 3 : 1,
                                       .part_layers = 1 };
        memcpy(dl.model, "test_tier/fp0001", 16);
        char sub[64];
        snprintf(sub, sizeof(sub), "%s/%s%s", disk_dir, weak_keys ? "weak" : "keyed", in_parts ? "-parts" : "");
        ts.disk = disk_tier_open(sub, 1 << 20, &dl, NULL, NULL, err, sizeof(err));
        if (ts.disk == NULL)
            fprintf(stderr, "disk_tier_open: %s\n", err);
        REQUIRE(ts.disk != NULL);
    }
    /* has() in a pool of parts, which plans its restores from it, and for
     * asynchronous copies, which start only for blocks the tier has (in a pool
     * of one part the synchronous run goes without, fetching blindly) */
    struct prefix_tier tr = { .committed = disk ? tier_committed : NULL, .evicted = tier_evicted,
                              .has = in_parts || async ? tier_has_cb : NULL, .user = &ts };
    if (async)
        tr.start = tier_start;      /* copies run when the test says, with other work between */
    else
        tr.fetch = tier_fetch;
    if (in_parts || async) {
        struct prefix_tier no_has = tr;
        no_has.has = NULL;
        CHECK_INT(prefix_set_tier(px, &no_has), KVD_EINVAL);
    }
    REQUIRE(prefix_set_tier(px, &tr) == 0);
    /* prompts: three system prompts of 4-6 blocks, each with its own tails,
     * in one of two namespaces */
    struct prompt pr[NPROMPT];
    for (int p = 0; p < NPROMPT; p++) {
        const int sys = p % 3;
        pr[p].ns = p % 4 == 3;
        pr[p].n = (4 + (uint32_t)sys) * BT + 1 + (uint32_t)(p * 5) % (MAXP - 6 * BT - 1);
        for (uint32_t i = 0; i < pr[p].n; i++)
            pr[p].tok[i] = i < (4 + (uint32_t)sys) * BT ? 100 * (sys + 1) + (int32_t)i : 1000 + p * 50 + (int32_t)i;
    }
    struct prefix_seq live[LIVE];
    int live_p[LIVE];
    bool restoring[LIVE] = { false };
    memset(live, 0, sizeof(live));
    for (int k = 0; k < LIVE; k++)
        live_p[k] = -1;
    uint64_t begun = 0, cached_blocks = 0, restored = 0, wrong = 0, broken = 0, full = 0, holes = 0, waited = 0;
    for (int op = 0; op < 6000; op++) {
        /* copies started earlier finish, with other sequences' work between */
        for (int k = 0; k < LIVE; k++) {
            if (!restoring[k] || below(3) == 0)
                continue;
            const struct prompt *q = &pr[live_p[k]];
            struct prefix_seq *s = &live[k];
            restoring[k] = false;
            if (!copies_run(&ts, px, s, k, q->tok)) {
                holes++;            /* a damaged entry, or one dropped since has() */
                prefix_seq_release(px, s);
                live_p[k] = -1;
                continue;
            }
            restored += s->n_restored;
            /* it goes on from its prefix as a request would (its blocks are committed) */
            if (!seq_go_on(pool, px, s, q, &wrong)) {
                full++;
                live_p[k] = -1;
                continue;
            }
            broken += check_ok(px) != 0;
        }
        const int k = (int)below(LIVE);
        if (restoring[k])
            continue;               /* its blocks are the copies' until they finish */
        if (live_p[k] >= 0) {
            prefix_seq_release(px, &live[k]);
            live_p[k] = -1;
        }
        if (op % 97 == 0) {
            /* damage an entry the stream may ask for: it must come back as a miss */
            const struct prompt *q = &pr[below(NPROMPT)];
            const prefix_ns_t ns = prefix_namespace(px, ns_names[q->ns], strlen(ns_names[q->ns]));
            prefix_key_t keys[MAXP / BT];
            prefix_hash_chain(px, ns, q->tok, q->n / BT, keys);
            const uint32_t j = below(q->n / BT);
            /* the path is not known here: damage whichever entry has this block's key */
            tier_corrupt_key_for_test(t, keys[j]);
        }
        const int p = (int)below(NPROMPT);
        const struct prompt *q = &pr[p];
        const prefix_ns_t ns = prefix_namespace(px, ns_names[q->ns], strlen(ns_names[q->ns]));
        struct prefix_seq *s = &live[k];
        uint32_t wait = POOL_NONE;
        ts.slot = k;
        const int64_t got = prefix_seq_begin(px, s, ns, q->tok, q->n, &wait);
        REQUIRE(got >= 0);
        begun++;
        cached_blocks += s->n_cached;
        if (s->n_restoring > 0) {
            REQUIRE(async);
            restoring[k] = true;    /* its blocks are pending until copies_run */
            live_p[k] = p;
            broken += check_ok(px) != 0;
            continue;
        }
        if (wait != POOL_NONE && async) {
            waited++;               /* another sequence's copy or prefill: a request would wait */
            prefix_seq_release(px, s);
            continue;
        }
        restored += s->n_restored;
        if (!seq_go_on(pool, px, s, q, &wrong)) {
            full++;
            continue;
        }
        live_p[k] = p;
        broken += check_ok(px) != 0;
        if (ts.disk != NULL && op % 50 == 0)
            disk_tier_flush(ts.disk);   /* else the writer may lag a whole run behind */
    }
    for (int k = 0; k < LIVE; k++) {
        if (restoring[k] && !copies_run(&ts, px, &live[k], k, pr[live_p[k]].tok))
            holes++;
        if (live_p[k] >= 0)
            prefix_seq_release(px, &live[k]);
        prefix_seq_fini(&live[k]);
    }
    REQUIRE(ts.n_q == 0);
    broken += check_ok(px) != 0;
    struct tier_stats st;
    tier_stats(t, &st);
    struct prefix_stats ps;
    prefix_stats(px, &ps);
    printf("pool (%s keys%s%s%s): %llu sequences, %llu blocks found cached, %llu of them from the tier (%llu restored by "
           "the pool's count); tier: %llu hits, %llu misses, %llu damaged, %llu dropped, %llu of %llu entries "
           "compressed; %llu blocks with another's K/V, %llu broken invariants, %llu refusals for room\n",
           weak_keys ? "colliding" : "keyed", disk ? ", host and disk tiers" : "", in_parts ? ", 3 parts" : "",
           async ? ", copies asynchronous" : "",
           (unsigned long long)begun, (unsigned long long)cached_blocks,
           (unsigned long long)restored, (unsigned long long)ps.restored, (unsigned long long)st.hits,
           (unsigned long long)st.misses, (unsigned long long)st.corrupt, (unsigned long long)st.dropped,
           (unsigned long long)st.compressed, (unsigned long long)st.entries, (unsigned long long)wrong,
           (unsigned long long)broken, (unsigned long long)full);
    if (async)
        printf("  asynchronous: %llu prefixes with a failed copy (released, begun again), %llu begins met a "
               "pending block\n", (unsigned long long)holes, (unsigned long long)waited);
    CHECK(wrong == 0);
    CHECK(broken == 0);
    CHECK(restored > (in_parts ? 300 : 1000));
    if (in_parts)
        CHECK(ps.restored > restored);  /* the other parts' blocks too */
    else if (!async)
        CHECK_INT(ps.restored, restored);
    else
        CHECK(ps.restored >= restored); /* and those of prefixes with a hole further on */
    if (async)
        CHECK(waited > 0);
    CHECK_INT(ts.from_host + ts.from_disk, ps.restored);
    CHECK(st.dropped > 0);
    if (!in_parts)
        CHECK(st.corrupt > 0);  /* a pool of parts asks has() first: fewer damaged entries are read */
    CHECK(st.bytes <= st.max_bytes);
    if (ts.disk != NULL) {
        struct disk_tier_stats ds;
        disk_tier_flush(ts.disk);
        disk_tier_stats(ts.disk, &ds);
        printf("  disk: %llu blocks restored from it, %llu files, %llu written, %llu writes dropped\n",
               (unsigned long long)ts.from_disk, (unsigned long long)ds.files, (unsigned long long)ds.written,
               (unsigned long long)ds.dropped_writes);
        CHECK(ts.from_disk > (in_parts ? 0u : 100u));  /* what the host tier dropped came back from disk */
        CHECK(ds.corrupt == 0 && ds.files > 0);
        disk_tier_close(&ts.disk);
    }
    prefix_destroy(&px);
    tier_destroy(&t);
    pool_close(&pool);
}



/* ---- the disk tier alone --------------------------------------------------------- */

static struct disk_tier_layout disk_layout(void)
{
    struct disk_tier_layout dl = { .k_type = KERN_F16, .v_type = KERN_F16, .block_tokens = BT,
                                   .block_bytes = SB, .n_parts = 1, .part_layers = 1 };
    memcpy(dl.model, "test_tier/disk01", 16);
    return dl;
}

static void test_disk(void)
{
    char err[256], dir[128], path[512];
    snprintf(dir, sizeof(dir), "%s/alone", disk_dir);
    const struct disk_tier_layout dl = disk_layout();
    CHECK(disk_tier_open(dir, 100, &dl, NULL, NULL, err, sizeof(err)) == NULL);     /* no room for a block */
    disk_tier_t *d = disk_tier_open(dir, 1 << 20, &dl, NULL, NULL, err, sizeof(err));
    REQUIRE(d != NULL);
    struct ident ids[NID];
    uint8_t buf[SB], want[SB];
    for (int i = 0; i < 12; i++) {
        ident_make(&ids[i], i);
        block_bytes(buf, i, 0);
        CHECK_INT(disk_tier_put(d, &ids[i].b, buf), 0);
    }
    CHECK_INT(disk_tier_put(d, &ids[0].b, buf), 0);    /* queued or written already: nothing more */
    disk_tier_flush(d);
    struct disk_tier_stats st;
    disk_tier_stats(d, &st);
    CHECK(st.files == 12 && st.written == 12 && st.pending == 0);
    int same = 0;
    for (int i = 0; i < 12; i++) {
        block_bytes(want, i, 0);
        same += disk_tier_get(d, &ids[i].b, buf) && memcmp(buf, want, SB) == 0;
    }
    CHECK_INT(same, 12);
    struct ident other = ids[3];
    other.b.tokens = other.tok;
    other.tok[0]++;
    CHECK(!disk_tier_get(d, &other.b, buf));
    /* damage two files: one's data (found on read), one's header (found on open) */
    REQUIRE(disk_tier_path_for_test(d, &ids[4].b, path, sizeof(path)));
    FILE *f = fopen(path, "r+b");
    REQUIRE(f != NULL);
    fseek(f, -7, SEEK_END);
    fputc(0x55, f);
    fclose(f);
    CHECK(!disk_tier_get(d, &ids[4].b, buf));
    CHECK(!disk_tier_has(d, &ids[4].b) && access(path, F_OK) != 0);
    REQUIRE(disk_tier_path_for_test(d, &ids[5].b, path, sizeof(path)));
    disk_tier_close(&d);
    f = fopen(path, "r+b");
    REQUIRE(f != NULL);
    fseek(f, 20, SEEK_SET);
    fputc(0x55, f);
    fclose(f);
    /* a write cut short by a crash */
    char tmp[600];
    snprintf(tmp, sizeof(tmp), "%s/.tmp-0123456789abcdef0123456789abcdef.kvb", dir);
    f = fopen(tmp, "wb");
    REQUIRE(f != NULL);
    fputs("half a block", f);
    fclose(f);
    /* reopened: the rest is there, the damaged header and the temporary gone */
    d = disk_tier_open(dir, 1 << 20, &dl, NULL, NULL, err, sizeof(err));
    REQUIRE(d != NULL);
    disk_tier_stats(d, &st);
    CHECK(st.indexed == 10 && st.corrupt == 1 && access(tmp, F_OK) != 0);
    CHECK(disk_tier_get(d, &ids[7].b, buf));
    disk_tier_close(&d);
    /* another layout: every file ignored, none removed */
    struct disk_tier_layout other_lay = dl;
    other_lay.v_type = KERN_Q8_0;
    d = disk_tier_open(dir, 1 << 20, &other_lay, NULL, NULL, err, sizeof(err));
    REQUIRE(d != NULL);
    disk_tier_stats(d, &st);
    CHECK(st.files == 0 && st.ignored == 10);
    disk_tier_close(&d);
    /* a budget of 4 files: the least recently used go (block 7 was read last) */
    const uint64_t per = 200 + BT * 4 + 32 + SB;   /* a file: header (fields, ids, MAC) and data */
    d = disk_tier_open(dir, 4 * per, &dl, NULL, NULL, err, sizeof(err));
    REQUIRE(d != NULL);
    disk_tier_stats(d, &st);
    CHECK(st.files == 4 && st.removed == 6);
    CHECK(disk_tier_has(d, &ids[7].b));
    disk_tier_close(&d);
    printf("disk: written and read back exact; damaged data and header, a torn temporary, another layout "
           "and a smaller budget each handled\n");
}

/* What another writer of the directory may put there: a block whose K/V were
 * replaced with a checksum made to fit, a FIFO and a link named like block
 * files, a file of another layout; and the secret's file, links and modes. */
static void test_disk_hostile(void)
{
    char err[512], dir[128], path[512], path2[600];
    snprintf(dir, sizeof(dir), "%s/hostile", disk_dir);
    struct disk_tier_layout dl = disk_layout();
    for (int i = 0; i < 32; i++)
        dl.mac_key[i] = (uint8_t)(7 * i + 1);
    disk_tier_t *d = disk_tier_open(dir, 1 << 20, &dl, NULL, NULL, err, sizeof(err));
    REQUIRE(d != NULL);
    struct ident ids[4];
    uint8_t buf[SB], want[SB];
    for (int i = 0; i < 4; i++) {
        ident_make(&ids[i], 100 + i);
        block_bytes(buf, 100 + i, 0);
        CHECK_INT(disk_tier_put(d, &ids[i].b, buf), 0);
    }
    disk_tier_flush(d);
    /* forged: other K/V, and the header's data MAC recomputed without the key */
    REQUIRE(disk_tier_path_for_test(d, &ids[0].b, path, sizeof(path)));
    const size_t hb = 200 + BT * 4 + 32;
    FILE *f = fopen(path, "r+b");
    REQUIRE(f != NULL);
    block_bytes(buf, 999, 0);
    uint8_t forged_mac[32];
    crypto_generichash(forged_mac, 32, buf, SB, NULL, 0);
    fseek(f, (long)hb, SEEK_SET);
    fwrite(buf, 1, SB, f);
    fseek(f, 168, SEEK_SET);
    fwrite(forged_mac, 1, 32, f);
    fclose(f);
    CHECK(!disk_tier_get(d, &ids[0].b, buf));
    struct disk_tier_stats st;
    disk_tier_stats(d, &st);
    CHECK_INT(st.corrupt, 1);
    /* one file's header made under another key: damaged at the next open */
    REQUIRE(disk_tier_path_for_test(d, &ids[1].b, path, sizeof(path)));
    disk_tier_close(&d);
    struct disk_tier_layout other_key = dl;
    other_key.mac_key[0] ^= 1;
    d = disk_tier_open(dir, 1 << 20, &other_key, NULL, NULL, err, sizeof(err));
    REQUIRE(d != NULL);
    disk_tier_stats(d, &st);
    CHECK(st.files == 0 && st.corrupt == 3);    /* every header fails a MAC made with another key */
    disk_tier_close(&d);
    /* a FIFO and a link named like blocks: refused at once (no open waits), left alone */
    snprintf(path, sizeof(path), "%s/%032x.kvb", dir, 0xf1f0);
    REQUIRE(mkfifo(path, 0600) == 0);
    snprintf(path2, sizeof(path2), "%s/%032x.kvb", dir, 0x5111);
    REQUIRE(symlink("/etc/passwd", path2) == 0);
    d = disk_tier_open(dir, 1 << 20, &dl, NULL, NULL, err, sizeof(err));
    REQUIRE(d != NULL);
    disk_tier_stats(d, &st);
    CHECK(st.refused == 2 && access(path, F_OK) == 0);
    /* a file of another layout takes its room from the budget */
    block_bytes(buf, 5, 0);
    CHECK_INT(disk_tier_put(d, &ids[2].b, buf), 0);
    disk_tier_flush(d);
    disk_tier_close(&d);
    struct disk_tier_layout other_lay = dl;
    other_lay.k_type = KERN_Q8_0;
    d = disk_tier_open(dir, 1 << 20, &other_lay, NULL, NULL, err, sizeof(err));
    REQUIRE(d != NULL);
    disk_tier_stats(d, &st);
    CHECK(st.files == 0 && st.ignored == 1 && st.foreign_bytes == hb + SB && st.bytes == st.foreign_bytes);
    disk_tier_close(&d);
    d = disk_tier_open(dir, 1 << 20, &dl, NULL, NULL, err, sizeof(err));
    REQUIRE(d != NULL);
    block_bytes(want, 5, 0);
    CHECK(disk_tier_get(d, &ids[2].b, buf) && memcmp(buf, want, SB) == 0);
    disk_tier_close(&d);
    /* the secret: made 0600 by O_EXCL, never through a planted temporary's link */
    char sdir[160], target[200];
    snprintf(sdir, sizeof(sdir), "%s/secret-dir", disk_dir);
    REQUIRE(mkdir(sdir, 0700) == 0);
    snprintf(target, sizeof(target), "%s/target", disk_dir);
    f = fopen(target, "wb");
    REQUIRE(f != NULL);
    fputs("not to be overwritten", f);
    fclose(f);
    snprintf(path, sizeof(path), "%s/.tmp-secret", sdir);
    REQUIRE(symlink(target, path) == 0);
    uint8_t sec[POOL_SECRET_BYTES], again[POOL_SECRET_BYTES];
    bool made;
    CHECK_INT(disk_tier_secret(sdir, sec, sizeof(sec), &made, err, sizeof(err)), 0);
    CHECK(made);
    struct stat sb;
    snprintf(path, sizeof(path), "%s/secret", sdir);
    CHECK(lstat(path, &sb) == 0 && S_ISREG(sb.st_mode) && (sb.st_mode & 0777) == 0600);
    CHECK(stat(target, &sb) == 0 && sb.st_size == 21);
    CHECK_INT(disk_tier_secret(sdir, again, sizeof(again), &made, err, sizeof(err)), 0);
    CHECK(!made && memcmp(sec, again, sizeof(sec)) == 0);
    /* a secret others may read, a secret that is a link, a directory others may write: refused */
    REQUIRE(chmod(path, 0644) == 0);
    CHECK_INT(disk_tier_secret(sdir, again, sizeof(again), &made, err, sizeof(err)), KVD_EPERM);
    REQUIRE(unlink(path) == 0 && symlink(target, path) == 0);
    CHECK_INT(disk_tier_secret(sdir, again, sizeof(again), &made, err, sizeof(err)), KVD_EPERM);
    REQUIRE(chmod(sdir, 0777) == 0);
    CHECK_INT(disk_tier_secret(sdir, again, sizeof(again), &made, err, sizeof(err)), KVD_EPERM);
    CHECK(disk_tier_open(sdir, 1 << 20, &dl, NULL, NULL, err, sizeof(err)) == NULL);
    printf("disk, hostile: a forged block, another key's headers, a FIFO, a link and a planted temporary "
           "refused; another layout's file counted against the budget\n");
}

int main(void)
{
    REQUIRE(mkdtemp(disk_dir) != NULL);
    test_store();
    pool_run(false, false, false, false);
    pool_run(true, false, false, false);
    pool_run(false, true, false, false);
    pool_run(true, true, false, false);
    pool_run(false, false, true, false);
    pool_run(true, false, true, false);
    pool_run(false, true, true, false);
    pool_run(false, false, false, true);
    pool_run(true, true, false, true);
    pool_run(false, true, true, true);
    test_disk();
    test_disk_hostile();
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", disk_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", disk_dir);
    return CHECK_DONE();
}
