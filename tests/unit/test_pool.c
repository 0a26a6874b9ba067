/*
 * test_pool.c - the KV pool's segment across real processes: sizing and its
 * errors, create / attach / close / adopt, a worker's view (KV read-write,
 * metadata read-only), a second owner refused, stale pools of crashed owners,
 * corrupt, truncated and mismatched headers, and a cache that survives a
 * clean close but not corrupt records.
 */
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "err.h"
#include "kvcache.h"
#include "pool.h"
#include "prefix.h"
#include "types.h"
#include "units.h"

static char name[64];
static struct pool_layout lay;

static void check_has(const char *s, const char *needle)
{
    if (strstr(s, needle) == NULL)
        fprintf(stderr, "expected '%s' in: '%s'\n", needle, s);
    CHECK(strstr(s, needle) != NULL);
}

/* Runs fn in a child process; returns its exit status, or 128 + signal. */
static int in_child(int (*fn)(void *), void *arg)
{
    fflush(NULL);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0)
        _exit(fn(arg));
    int st;
    REQUIRE(waitpid(pid, &st, 0) == pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static struct pool_params params(uint32_t n_blocks)
{
    struct pool_params p = pool_default_params();
    p.name = name;
    p.n_blocks = n_blocks;
    return p;
}

static void test_sizes(void)
{
    uint64_t v;
    CHECK(kvd_parse_size("2GiB", &v) == 0 && v == 2ull << 30);
    CHECK(kvd_parse_size("512M", &v) == 0 && v == 512ull << 20);
    CHECK(kvd_parse_size("1.5k", &v) == 0 && v == 1536);
    CHECK(kvd_parse_size("3MB", &v) == 0 && v == 3000000);
    CHECK(kvd_parse_size("100", &v) == 0 && v == 100);
    CHECK(kvd_parse_size("-1G", &v) == KVD_EINVAL);
    CHECK(kvd_parse_size("12 parsecs", &v) == KVD_EINVAL);
    CHECK(kvd_parse_size("", &v) == KVD_EINVAL);
    CHECK(kvd_parse_size("1e30", &v) == KVD_EINVAL);

    /* the seed's example: 32 layers, 8 KV heads, dim 128, f16 -> 128 KiB a token */
    struct pool_layout big = { .n_layer = 32, .n_head_kv = 8, .head_dim = 128,
                               .block_tokens = 16, .k_type = KERN_F16, .v_type = KERN_F16 };
    struct pool_params p = pool_default_params();
    p.kv_bytes = 537ull * 1000 * 1000;
    struct pool_capacity cap;
    char err[256];
    REQUIRE(pool_plan(&big, &p, &cap, err, sizeof(err)) == 0);
    CHECK_INT(cap.bytes_per_token, 131072);
    CHECK_INT(cap.block_bytes, 131072 * 16);
    CHECK(cap.total_bytes <= p.kv_bytes);
    CHECK(cap.n_tokens >= 4000 && cap.n_tokens < 4096); /* metadata costs a little */
    CHECK_INT(cap.n_tokens, (uint64_t)cap.n_blocks * 16);

    p.kv_bytes = 0;
    p.n_blocks = 0;
    CHECK_INT(pool_plan(&big, &p, &cap, err, sizeof(err)), KVD_EINVAL);
    check_has(err, "zero");
    p.kv_bytes = 1 << 20;
    CHECK_INT(pool_plan(&big, &p, &cap, err, sizeof(err)), KVD_EINVAL);
    check_has(err, "smaller than one block");
    struct pool_layout bad = big;
    bad.block_tokens = 0;
    p.n_blocks = 4;
    CHECK_INT(pool_plan(&bad, &p, &cap, err, sizeof(err)), KVD_EINVAL);
    bad = big;
    bad.k_type = KERN_Q4_1;                         /* not a KV type */
    CHECK_INT(pool_plan(&bad, &p, &cap, err, sizeof(err)), KVD_EINVAL);
    check_has(err, "K type must be");
    bad = big;
    bad.v_type = KERN_Q4_0;                         /* a KV type: sizes follow it */
    const uint64_t budget = p.kv_bytes;
    p.kv_bytes = 0;
    REQUIRE(pool_plan(&bad, &p, &cap, err, sizeof(err)) == 0);
    CHECK_INT(cap.n_blocks, 4);
    CHECK_INT(cap.block_bytes, cap.bytes_per_token * 16);
    CHECK_INT(cap.bytes_per_token, (uint64_t)big.n_layer * big.n_head_kv * (big.head_dim * 2 + big.head_dim / 32 * 18));
    bad.rotate = 8;                                 /* unknown rotation flag */
    CHECK_INT(pool_plan(&bad, &p, &cap, err, sizeof(err)), KVD_EINVAL);
    p.kv_bytes = budget;
    /* a fixed budget never yields a segment larger than itself */
    for (uint64_t b = 3u << 20; b < (64u << 20); b = b * 5 / 3) {
        p.kv_bytes = b;
        REQUIRE(pool_plan(&big, &p, &cap, err, sizeof(err)) == 0);
        CHECK(cap.total_bytes <= b);
    }
}

/* Worker side: attaches, checks the owner's pattern in block 3, writes its own
 * into block 4. */
static int worker_touch(void *arg)
{
    (void)arg;
    char err[256];
    pool_t *p = pool_attach(name, &lay, err, sizeof(err));
    if (p == NULL) {
        fprintf(stderr, "attach: %s\n", err);
        return 2;
    }
    if (pool_is_owner(p))
        return 3;
    uint8_t *b3 = pool_block_addr(p, 3), *b4 = pool_block_addr(p, 4);
    if (b3 == NULL || b4 == NULL || b3[0] != 0x5a || b3[pool_header(p)->block_bytes - 1] != 0xa5)
        return 4;
    memset(b4, 0x77, pool_header(p)->block_bytes);
    if (pool_block_addr(p, pool_header(p)->n_blocks) != NULL)
        return 5;
    pool_close(&p);
    return 0;
}

/* Worker side: writing the metadata must fault. */
static int worker_write_header(void *arg)
{
    (void)arg;
    pool_t *p = pool_attach(name, &lay, NULL, 0);
    if (p == NULL)
        return 2;
    signal(SIGSEGV, SIG_DFL); /* a sanitizer's handler would turn the fault into exit 1 */
    pool_header(p)->cache.n_free = 12345; /* SIGSEGV expected */
    return 0;
}

/* A second owner while the first lives. */
static int second_owner(void *arg)
{
    (void)arg;
    char err[256];
    struct pool_params pp = params(8);
    pp.reuse = true;
    pool_t *p = pool_create(&lay, &pp, NULL, 0, err, sizeof(err));
    if (p != NULL)
        return 2;
    return strstr(err, "in use") ? 0 : 3;
}

/* An owner that dies without closing. */
static int crashing_owner(void *arg)
{
    (void)arg;
    struct pool_params pp = params(8);
    pool_t *p = pool_create(&lay, &pp, NULL, 0, NULL, 0);
    if (p == NULL)
        return 2;
    raise(SIGKILL);
    return 0;
}

static void test_lifecycle(void)
{
    char err[256], note[256];
    struct pool_params pp = params(8);
    pool_unlink(name);

    /* attaching to nothing */
    CHECK(pool_attach(name, &lay, err, sizeof(err)) == NULL);
    check_has(err, "no such pool");

    pool_t *p = pool_create(&lay, &pp, note, sizeof(note), err, sizeof(err));
    REQUIRE(p != NULL);
    CHECK(pool_is_owner(p));
    CHECK(pool_is_fresh(p));
    CHECK_INT(note[0], 0);
    CHECK_INT(pool_header(p)->n_blocks, 8);
    CHECK_INT(pool_header(p)->state, POOL_STATE_LIVE);
    uint64_t bb = pool_header(p)->block_bytes;
    CHECK_INT(bb, 2ull * lay.n_layer * lay.n_head_kv * lay.head_dim * lay.block_tokens * 2);
    uint8_t *b3 = pool_block_addr(p, 3);
    memset(b3, 0, bb);
    b3[0] = 0x5a;
    b3[bb - 1] = 0xa5;

    /* a worker sees the owner's K/V and the owner sees the worker's */
    CHECK_INT(in_child(worker_touch, NULL), 0);
    uint8_t *b4 = pool_block_addr(p, 4);
    CHECK(b4[0] == 0x77 && b4[bb - 1] == 0x77);
    CHECK_INT(in_child(worker_write_header, NULL), 128 + SIGSEGV);
    CHECK_INT(in_child(second_owner, NULL), 0);

    /* mismatched layouts are refused, each with its reason */
    struct pool_layout other = lay;
    other.fingerprint[5] ^= 1;
    CHECK(pool_attach(name, &other, err, sizeof(err)) == NULL);
    check_has(err, "another model");
    other = lay;
    other.block_tokens = 8;
    CHECK(pool_attach(name, &other, err, sizeof(err)) == NULL);
    check_has(err, "blocks of 4 tokens, not 8");
    other = lay;
    other.v_type = KERN_F32;
    CHECK(pool_attach(name, &other, err, sizeof(err)) == NULL);
    check_has(err, "KV types K f16 / V f16, not K f16 / V f32");
    other = lay;
    other.k_type = KERN_Q8_0;
    other.rotate = KV_ROT_K;
    CHECK(pool_attach(name, &other, err, sizeof(err)) == NULL);
    check_has(err, "not K q8_0 / V f16");
    other.k_type = lay.k_type;
    CHECK(pool_attach(name, &other, err, sizeof(err)) == NULL);
    check_has(err, "made with rotation off, not K");

    /* a prefix cache only runs in the owner */
    pool_t *w = pool_attach(name, &lay, err, sizeof(err));
    REQUIRE(w != NULL);
    CHECK(prefix_new(w, NULL, 0, err, sizeof(err)) == NULL);
    pool_close(&w);
    CHECK(w == NULL);

    pool_close(&p);
    CHECK(p == NULL);
    CHECK(pool_attach(name, &lay, err, sizeof(err)) == NULL);
    check_has(err, "not live");

    /* adopted after a clean close: the data is still there */
    pp.reuse = true;
    p = pool_create(&lay, &pp, note, sizeof(note), err, sizeof(err));
    REQUIRE(p != NULL);
    CHECK(!pool_is_fresh(p));
    CHECK_INT(note[0], 0);
    CHECK(((uint8_t *)pool_block_addr(p, 3))[0] == 0x5a);
    pool_close(&p);
    /* a different size is a new pool */
    pp.n_blocks = 9;
    p = pool_create(&lay, &pp, note, sizeof(note), err, sizeof(err));
    REQUIRE(p != NULL);
    CHECK(pool_is_fresh(p));
    check_has(note, "holds 8 blocks, not 9");
    pool_close(&p);
    /* without reuse, a fresh one */
    pp.reuse = false;
    p = pool_create(&lay, &pp, note, sizeof(note), err, sizeof(err));
    REQUIRE(p != NULL);
    check_has(note, "fresh pool was asked for");
    pool_close(&p);

    /* a crashed owner leaves a stale pool: never attached, replaced by the next owner */
    CHECK_INT(in_child(crashing_owner, NULL), 128 + SIGKILL);
    CHECK(pool_attach(name, &lay, err, sizeof(err)) == NULL);
    check_has(err, "stale");
    pp = params(8);
    pp.reuse = true;
    p = pool_create(&lay, &pp, note, sizeof(note), err, sizeof(err));
    REQUIRE(p != NULL);
    CHECK(pool_is_fresh(p));
    check_has(note, "stale");
    pool_close(&p);

    /* corrupt and truncated segments */
    int fd = shm_open(name, O_RDWR, 0);
    REQUIRE(fd >= 0);
    uint8_t junk[4096];
    memset(junk, 0xab, sizeof(junk));
    CHECK(pwrite(fd, junk, sizeof(junk), 0) == (ssize_t)sizeof(junk));
    CHECK(pool_attach(name, &lay, err, sizeof(err)) == NULL);
    check_has(err, "bad magic");
    p = pool_create(&lay, &pp, note, sizeof(note), err, sizeof(err));
    REQUIRE(p != NULL);
    check_has(note, "not a kvd pool");
    uint64_t total = pool_header(p)->total_bytes;
    CHECK(ftruncate(fd, 100) == 0); /* fd still names the replaced object: no effect */
    close(fd);
    fd = shm_open(name, O_RDWR, 0);
    REQUIRE(fd >= 0);
    CHECK(ftruncate(fd, (off_t)(total - 4096)) == 0);
    CHECK(pool_attach(name, &lay, err, sizeof(err)) == NULL);
    check_has(err, "truncated");
    CHECK(ftruncate(fd, 100) == 0);
    CHECK(pool_attach(name, &lay, err, sizeof(err)) == NULL);
    check_has(err, "too small");
    close(fd);
    pool_close(&p);

    /* bad names */
    pp.name = "a/b";
    CHECK(pool_create(&lay, &pp, NULL, 0, err, sizeof(err)) == NULL);
    check_has(err, "may hold only");
    pp.name = "";
    CHECK(pool_create(&lay, &pp, NULL, 0, err, sizeof(err)) == NULL);
    CHECK_INT(pool_unlink(name), 0);
    CHECK_INT(pool_unlink(name), KVD_ENOTFOUND);
}

/* Prompt of n tokens starting at v. */
static void fill(int32_t *t, int n, int v)
{
    for (int i = 0; i < n; i++)
        t[i] = v + i;
}

static void test_persisted_cache(void)
{
    char err[256], note[256];
    struct pool_params pp = params(16);
    pp.reuse = true;
    pool_unlink(name);
    pool_t *p = pool_create(&lay, &pp, NULL, 0, err, sizeof(err));
    REQUIRE(p != NULL);
    prefix_t *px = prefix_new(p, note, sizeof(note), err, sizeof(err));
    REQUIRE(px != NULL);
    int32_t t[13];
    fill(t, 13, 100);
    prefix_ns_t ns = prefix_namespace(px, "", 0);
    struct prefix_seq s = { 0 };
    CHECK_INT(prefix_seq_begin(px, &s, ns, t, 13, NULL), 0);
    CHECK_INT(prefix_seq_grow(px, &s, 13, t, 13), 0);
    CHECK_INT(prefix_seq_commit(px, &s, t, 13), 0);
    prefix_seq_release(px, &s);
    CHECK_INT(prefix_check(px, err, sizeof(err)), 0);
    prefix_destroy(&px);
    pool_close(&p);

    /* the next owner finds the three full blocks */
    p = pool_create(&lay, &pp, NULL, 0, err, sizeof(err));
    REQUIRE(p != NULL);
    px = prefix_new(p, note, sizeof(note), err, sizeof(err));
    REQUIRE(px != NULL);
    CHECK_INT(note[0], 0);
    ns = prefix_namespace(px, "", 0);
    CHECK_INT(prefix_seq_begin(px, &s, ns, t, 13, NULL), 12);
    prefix_seq_release(px, &s);
    /* a record that shared memory could have garbled: the cache is reset, not trusted */
    pool_records(p)[pool_header(p)->cache.lru_head].refs = 0;
    pool_records(p)[pool_header(p)->cache.free_head].refs = 3;
    prefix_destroy(&px);
    pool_close(&p);
    p = pool_create(&lay, &pp, NULL, 0, err, sizeof(err));
    REQUIRE(p != NULL);
    px = prefix_new(p, note, sizeof(note), err, sizeof(err));
    REQUIRE(px != NULL);
    check_has(note, "cache reset");
    CHECK_INT(prefix_check(px, err, sizeof(err)), 0);
    CHECK_INT(prefix_seq_begin(px, &s, prefix_namespace(px, "", 0), t, 13, NULL), 0);
    prefix_seq_release(px, &s);
    prefix_seq_fini(&s);
    prefix_destroy(&px);
    pool_close(&p);
    pool_unlink(name);
}

/* Worker side of a device pool: attaches, sees where the KV data lives, has
 * no block addresses until it says where it mapped the device memory. */
static int worker_device(void *arg)
{
    uint8_t *fake = arg; /* stands in for a device mapping: only addresses are computed */
    char err[256];
    pool_t *p = pool_attach(name, &lay, err, sizeof(err));
    if (p == NULL) {
        fprintf(stderr, "attach: %s\n", err);
        return 2;
    }
    const struct pool_header *h = pool_header(p);
    if (pool_kv_device(p) != 3 || h->kv_where != POOL_KV_DEVICE || h->total_bytes != h->data_off)
        return 3;
    if (pool_block_addr(p, 0) != NULL || pool_data(p) != NULL)
        return 4;
    if (pool_set_device_kv(p, fake, pool_data_bytes(p) - 1) != KVD_EINVAL)
        return 5;
    if (pool_set_device_kv(p, fake, pool_data_bytes(p)) != 0)
        return 6;
    if (pool_block_addr(p, 5) != fake + 5 * h->block_bytes || pool_data(p) != fake ||
        pool_block_addr(p, h->n_blocks) != NULL)
        return 7;
    pool_close(&p);
    return 0;
}

static void test_device_pool(void)
{
    char err[256], note[256];
    pool_unlink(name);
    /* planning: a device budget buys blocks alone; the metadata is host memory */
    struct pool_params pp = params(0);
    pp.kv_where = POOL_KV_DEVICE;
    pp.kv_device = 3;
    struct pool_capacity cap;
    uint64_t bb = 2ull * lay.n_layer * lay.n_head_kv * lay.head_dim * lay.block_tokens * 2;
    pp.kv_bytes = 100 * bb + 7;
    REQUIRE(pool_plan(&lay, &pp, &cap, err, sizeof(err)) == 0);
    CHECK_INT(cap.n_blocks, 100);
    CHECK_INT(cap.data_bytes, 100 * bb);
    CHECK_INT(cap.kv_device, 3);
    CHECK(cap.total_bytes < 100 * bb); /* the segment holds no KV data */
    char line[512];
    pool_describe(&lay, &cap, 0, line, sizeof(line));
    check_has(line, "on GPU 3");
    pp.kv_bytes = bb - 1;
    CHECK_INT(pool_plan(&lay, &pp, &cap, err, sizeof(err)), KVD_EINVAL);
    check_has(err, "smaller than one block");
    pp.kv_bytes = 0;
    pp.n_blocks = 16;
    pp.kv_device = -1;
    CHECK_INT(pool_plan(&lay, &pp, &cap, err, sizeof(err)), KVD_EINVAL);
    check_has(err, "device -1");
    pp.kv_device = 3;
    pp.kv_where = 9;
    CHECK_INT(pool_plan(&lay, &pp, &cap, err, sizeof(err)), KVD_EINVAL);
    pp.kv_where = POOL_KV_DEVICE;
    /* a host pool says so */
    struct pool_params hp = params(16);
    pool_t *p = pool_create(&lay, &hp, NULL, 0, err, sizeof(err));
    REQUIRE(p != NULL);
    CHECK_INT(pool_kv_device(p), -1);
    CHECK_INT(pool_header(p)->kv_where, POOL_KV_HOST);
    CHECK_INT(pool_header(p)->kv_bytes, pool_data_bytes(p));
    CHECK_INT(pool_set_device_kv(p, (void *)p, 1 << 20), KVD_ESTATE);
    uint64_t host_instance = pool_header(p)->instance;
    pool_close(&p);

    /* a device pool replaces a closed host pool of that name even with reuse */
    pp.reuse = true;
    p = pool_create(&lay, &pp, note, sizeof(note), err, sizeof(err));
    REQUIRE(p != NULL);
    check_has(note, "host memory");
    CHECK(pool_is_fresh(p));
    const struct pool_header *h = pool_header(p);
    CHECK_INT(h->kv_where, POOL_KV_DEVICE);
    CHECK_INT(h->kv_device, 3);
    CHECK_INT(h->kv_bytes, 16 * bb);
    CHECK_INT(h->total_bytes, h->data_off);
    CHECK(h->instance != host_instance);
    CHECK(pool_block_addr(p, 0) == NULL);
    CHECK(!pool_huge_pages(p));
    uint8_t *fake = malloc(pool_data_bytes(p));
    REQUIRE(fake != NULL);
    CHECK_INT(pool_set_device_kv(p, NULL, pool_data_bytes(p)), KVD_EINVAL);
    CHECK_INT(in_child(worker_device, fake), 0);
    CHECK_INT(pool_set_device_kv(p, fake, pool_data_bytes(p)), 0);
    CHECK(pool_block_addr(p, 2) == fake + 2 * bb);
    /* the metadata works as for any pool */
    prefix_t *px = prefix_new(p, note, sizeof(note), err, sizeof(err));
    REQUIRE(px != NULL);
    CHECK_INT(prefix_check(px, err, sizeof(err)), 0);
    prefix_destroy(&px);
    pool_close(&p);

    /* its cache is never adopted: the device memory died with its owner */
    p = pool_create(&lay, &pp, note, sizeof(note), err, sizeof(err));
    REQUIRE(p != NULL);
    CHECK(pool_is_fresh(p));
    check_has(note, "did not outlive its owner");
    pool_close(&p);
    /* nor does a host owner adopt it */
    hp.reuse = true;
    p = pool_create(&lay, &hp, note, sizeof(note), err, sizeof(err));
    REQUIRE(p != NULL);
    CHECK(pool_is_fresh(p));
    CHECK_INT(pool_kv_device(p), -1);
    pool_close(&p);

    /* a corrupt KV location is refused */
    pp.reuse = false;
    p = pool_create(&lay, &pp, NULL, 0, err, sizeof(err));
    REQUIRE(p != NULL);
    pool_header(p)->kv_device = -5;
    CHECK(pool_attach(name, &lay, err, sizeof(err)) == NULL);
    check_has(err, "KV location");
    pool_header(p)->kv_device = 3;
    pool_header(p)->kv_bytes++;
    CHECK(pool_attach(name, &lay, err, sizeof(err)) == NULL);
    check_has(err, "offsets");
    pool_header(p)->kv_bytes--;
    pool_t *w = pool_attach(name, &lay, err, sizeof(err));
    CHECK(w != NULL);
    pool_close(&w);
    pool_close(&p);
    free(fake);
    pool_unlink(name);
}

/* A child joins the host pool `name` and reports its instance through a pipe. */
static int join_child(void *arg)
{
    int fd = *(int *)arg;
    char err[256];
    bool created;
    struct pool_params pp = params(0);
    pp.n_blocks = 16;
    pool_t *p = pool_join(name, &lay, &pp, &created, err, sizeof(err));
    if (p == NULL)
        return 2;
    uint64_t inst = pool_header(p)->instance;
    bool ok = write(fd, &inst, sizeof(inst)) == sizeof(inst) && write(fd, &created, 1) == 1;
    pool_close(&p);
    return ok ? 0 : 3;
}

/* Another host's pool: kvd keeps the metadata (POOL_KV_REMOTE, anonymous),
 * the host's workers the data (pool_join: the first creates it, the others
 * map it; a pool closed or left stale is made again, a new instance). */
static void test_remote_pool(void)
{
    char err[256], note[256];
    pool_unlink(name);
    struct pool_params rp = pool_default_params();
    rp.kv_where = POOL_KV_REMOTE;
    rp.n_blocks = 24;
    pool_t *m = pool_create(&lay, &rp, NULL, 0, err, sizeof(err));
    REQUIRE(m != NULL);
    CHECK_INT(pool_header(m)->kv_where, POOL_KV_REMOTE);
    CHECK_INT(pool_header(m)->n_blocks, 24);
    CHECK_INT(pool_kv_device(m), -1);
    CHECK(pool_data(m) == NULL);
    CHECK(pool_block_addr(m, 0) == NULL);
    CHECK_INT(pool_header(m)->total_bytes, pool_header(m)->data_off);   /* metadata alone */
    prefix_t *px = prefix_new(m, note, sizeof(note), err, sizeof(err));
    REQUIRE(px != NULL);
    CHECK_INT(prefix_check(px, err, sizeof(err)), 0);
    prefix_destroy(&px);
    pool_close(&m);
    rp.name = name;     /* it has no name here: the data is elsewhere */
    CHECK(pool_create(&lay, &rp, NULL, 0, err, sizeof(err)) == NULL);
    check_has(err, "no name");

    /* the first worker of a host creates its pool, the next joins it */
    bool created = false;
    struct pool_params jp = params(0);
    jp.n_blocks = 16;
    pool_t *a = pool_join(name, &lay, &jp, &created, err, sizeof(err));
    REQUIRE(a != NULL);
    CHECK(created);
    CHECK(pool_block_addr(a, 3) != NULL);
    const uint64_t inst = pool_header(a)->instance;
    int pfd[2];
    REQUIRE(pipe(pfd) == 0);
    CHECK_INT(in_child(join_child, &pfd[1]), 0);
    uint64_t got = 0;
    bool child_created = true;
    REQUIRE(read(pfd[0], &got, sizeof(got)) == sizeof(got) && read(pfd[0], &child_created, 1) == 1);
    CHECK(got == inst);
    CHECK(!child_created);
    /* its creator closes it (the name goes); a worker still mapping it keeps
     * its memory, and the next worker makes a new pool */
    pool_t *b = pool_join(name, &lay, &jp, &created, err, sizeof(err));
    REQUIRE(b != NULL);
    CHECK(!created);
    uint64_t *d = pool_block_addr(b, 5);
    d[0] = 0x1234;
    pool_close(&a);
    CHECK(d[0] == 0x1234);
    CHECK_INT(in_child(join_child, &pfd[1]), 0);
    REQUIRE(read(pfd[0], &got, sizeof(got)) == sizeof(got) && read(pfd[0], &child_created, 1) == 1);
    CHECK(child_created);
    CHECK(got != inst);
    pool_close(&b);
    close(pfd[0]);
    close(pfd[1]);
    /* a host pool joined for another layout is refused, not misread */
    a = pool_join(name, &lay, &jp, &created, err, sizeof(err));
    REQUIRE(a != NULL);
    struct pool_layout other = lay;
    other.block_tokens = 8;
    CHECK(pool_join(name, &other, &jp, &created, err, sizeof(err)) == NULL);
    pool_close(&a);
    pool_unlink(name);
}

int main(void)
{
    snprintf(name, sizeof(name), "kvd-test-pool-%d", (int)getpid());
    lay = (struct pool_layout){ .n_layer = 2, .n_head_kv = 2, .head_dim = 8, .block_tokens = 4,
                                .k_type = KERN_F16, .v_type = KERN_F16 };
    for (int i = 0; i < 16; i++)
        lay.fingerprint[i] = (uint8_t)(i * 7 + 1);
    test_sizes();
    test_lifecycle();
    test_persisted_cache();
    test_device_pool();
    test_remote_pool();
    return CHECK_DONE();
}
