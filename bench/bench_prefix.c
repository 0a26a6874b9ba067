/*
 * bench_prefix.c - bench-prefix: the prefix cache's own costs, printed.
 *
 * 1. Hashing and lookup of a 32,000-token prompt (2,000 blocks of 16): a full
 *    hit (keys chained block by block, each hit verified against the stored
 *    token ids), the hashing alone, and begin +
 *    release (taking and dropping references). Median of many rounds.
 *    Target: under 1 ms for the hit.
 * 2. KV waste for 1,000 sequences of random lengths 10..4,000: the fraction
 *    of the pool's bytes that hold no token, paged (blocks of 16) against a
 *    contiguous reservation of the maximum length per sequence. Then churn:
 *    sequences finish and new ones arrive at random in a pool of fixed size;
 *    when an arrival does not fit, how full the pool is. Target: under 2%.
 *
 * 3. With -m MODEL: time to the first token of a 2,000-token prompt computed
 *    from scratch against the same prompt whose first 1,984 tokens are cached
 *    (a long system prompt reused), same process, alternating, median of 3.
 *
 * Parts 1 and 2 use a pool of SmolLM2-135M's KV shape whose KV bytes are never
 * touched, so no model is needed. Usage: bench-prefix [-m MODEL] [-t N] [--json] [--seed N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "err.h"
#include "forward.h"
#include "kvcache.h"
#include "model.h"
#include "pool.h"
#include "prefix.h"
#include "types.h"

#define PROMPT 32000
#define BT 16
#define ROUNDS 301
#define N_SEQ 1000
#define MIN_LEN 10
#define MAX_LEN 4000

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return v[n / 2];
}

static struct pool_layout smollm_layout(void)
{
    struct pool_layout lay = { .n_layer = 30, .n_head_kv = 3, .head_dim = 64, .block_tokens = BT,
                               .k_type = KERN_F16, .v_type = KERN_F16 };
    memset(lay.fingerprint, 0x42, sizeof(lay.fingerprint));
    return lay;
}

static void open_pool(const struct pool_layout *lay, uint32_t n_blocks, pool_t **p, prefix_t **px)
{
    char err[256];
    struct pool_params pp = pool_default_params();
    pp.n_blocks = n_blocks;
    *p = pool_create(lay, &pp, NULL, 0, err, sizeof(err));
    if (*p == NULL || (*px = prefix_new(*p, NULL, 0, err, sizeof(err))) == NULL) {
        fprintf(stderr, "bench-prefix: %s\n", err);
        exit(1);
    }
}

struct lookup_result {
    double hit_us, hash_us, begin_us;
    uint32_t hit_blocks;
};

static void bench_lookup(struct lookup_result *r)
{
    pool_t *p;
    prefix_t *px;
    struct pool_layout lay = smollm_layout();
    open_pool(&lay, PROMPT / BT + 64, &p, &px);
    int32_t *t = malloc(PROMPT * sizeof(int32_t));
    uint32_t *ids = malloc((PROMPT / BT) * sizeof(uint32_t));
    prefix_key_t *keys = malloc((PROMPT / BT) * sizeof(prefix_key_t));
    for (int i = 0; i < PROMPT; i++)
        t[i] = (int32_t)(rng() % 49152);
    prefix_ns_t ns = prefix_namespace(px, "", 0), other = prefix_namespace(px, "other", 5);
    struct prefix_seq s = { 0 };
    /* cache the whole prompt */
    if (prefix_seq_begin(px, &s, ns, t, PROMPT, NULL) != 0 ||
        prefix_seq_grow(px, &s, PROMPT, t, PROMPT) != 0 || prefix_seq_commit(px, &s, t, PROMPT) != 0) {
        fprintf(stderr, "bench-prefix: could not fill the cache\n");
        exit(1);
    }
    prefix_seq_release(px, &s);
    static double hit[ROUNDS], hashonly[ROUNDS], begin[ROUNDS];
    struct prefix_match m;
    for (int k = 0; k < ROUNDS; k++) {
        double t0 = now_us();
        prefix_lookup(px, ns, t, PROMPT, PROMPT / BT, ids, &m);
        double t1 = now_us();
        r->hit_blocks = m.n_blocks;
        prefix_hash_chain(px, other, t, PROMPT / BT, keys);
        double t2 = now_us();
        prefix_seq_begin(px, &s, ns, t, PROMPT, NULL);
        prefix_seq_release(px, &s);
        double t3 = now_us();
        hit[k] = t1 - t0;
        hashonly[k] = t2 - t1;
        begin[k] = t3 - t2;
    }
    r->hit_us = median(hit, ROUNDS);
    r->hash_us = median(hashonly, ROUNDS);
    r->begin_us = median(begin, ROUNDS);
    prefix_lookup(px, other, t, PROMPT, PROMPT / BT, ids, &m);
    if (m.n_blocks != 0) {
        fprintf(stderr, "bench-prefix: another namespace found blocks\n");
        exit(1);
    }
    prefix_seq_fini(&s);
    free(t);
    free(ids);
    free(keys);
    prefix_destroy(&px);
    pool_close(&p);
}

struct waste_result {
    uint64_t tokens;            /* tokens of the 1,000 sequences */
    uint32_t blocks;            /* blocks the paged pool needed */
    double paged_waste;         /* KV bytes holding no token / KV bytes */
    double paged_waste_meta;    /* the same over the whole segment (metadata included) */
    double contiguous_waste;    /* with a max-length reservation per sequence */
    double churn_fill_min;      /* churn: least pool fill at a refused arrival */
    double churn_fill_avg;      /* churn: mean fill at refused arrivals */
    uint32_t churn_refusals;
};

static uint32_t rand_len(void)
{
    return MIN_LEN + (uint32_t)(rng() % (MAX_LEN - MIN_LEN + 1));
}

static void bench_waste(struct waste_result *r)
{
    static uint32_t len[N_SEQ];
    uint64_t tokens = 0, blocks = 0;
    for (int i = 0; i < N_SEQ; i++) {
        len[i] = rand_len();
        tokens += len[i];
        blocks += (len[i] + BT - 1) / BT;
    }
    /* a pool exactly as large as the paged workload needs; the allocator runs
     * over a pool of the same block count with a one-byte-per-token KV shape
     * (SmolLM2's would take 46 GB), and SmolLM2's segment size is planned */
    pool_t *p;
    prefix_t *px;
    struct pool_layout tiny = { .n_layer = 1, .n_head_kv = 1, .head_dim = 1, .block_tokens = BT,
                                .k_type = KERN_F16, .v_type = KERN_F16 };
    open_pool(&tiny, (uint32_t)blocks, &p, &px);
    struct pool_layout lay = smollm_layout();
    struct pool_params pp = pool_default_params();
    pp.n_blocks = (uint32_t)blocks;
    struct pool_capacity cap;
    if (pool_plan(&lay, &pp, &cap, NULL, 0) != 0)
        exit(1);
    int32_t *t = calloc(MAX_LEN, sizeof(int32_t));
    struct prefix_seq *s = calloc(N_SEQ, sizeof(*s));
    for (int i = 0; i < N_SEQ; i++) {
        if (prefix_seq_grow(px, &s[i], len[i], t, 0) != 0) {
            fprintf(stderr, "bench-prefix: sequence %d did not fit\n", i);
            exit(1);
        }
    }
    struct prefix_stats st;
    prefix_stats(px, &st);
    uint64_t slots = (uint64_t)st.n_blocks * BT;
    r->tokens = tokens;
    r->blocks = st.n_blocks;
    r->paged_waste = (double)(slots - tokens) / (double)slots;
    r->paged_waste_meta = 1.0 - (double)tokens * (double)cap.bytes_per_token / (double)cap.total_bytes;
    r->contiguous_waste = 1.0 - (double)tokens / ((double)N_SEQ * MAX_LEN);

    /* churn: replace random sequences by new ones of random lengths; record
     * how full the pool is whenever a newcomer does not fit */
    double fill_sum = 0, fill_min = 1.0;
    uint32_t refusals = 0;
    uint64_t live_tokens = tokens;
    for (int step = 0; step < 20000; step++) {
        int i = (int)(rng() % N_SEQ);
        if (s[i].n_blocks) {
            live_tokens -= len[i];
            prefix_seq_release(px, &s[i]);
        }
        len[i] = rand_len();
        if (prefix_seq_grow(px, &s[i], len[i], t, 0) == 0) {
            live_tokens += len[i];
        } else {
            double fill = (double)live_tokens / (double)slots;
            fill_sum += fill;
            fill_min = fill < fill_min ? fill : fill_min;
            refusals++;
            len[i] = 0;
        }
    }
    r->churn_refusals = refusals;
    r->churn_fill_min = refusals ? fill_min : 0;
    r->churn_fill_avg = refusals ? fill_sum / refusals : 0;
    for (int i = 0; i < N_SEQ; i++)
        prefix_seq_fini(&s[i]);
    free(s);
    free(t);
    prefix_destroy(&px);
    pool_close(&p);
}

struct reuse_result {
    double scratch_ms;      /* prefill of the whole prompt */
    double cached_ms;       /* prefill of what the cache lacks */
    int64_t cached_tokens;  /* tokens found in the cache */
};

#define REUSE_PROMPT 2000
#define REUSE_ROUNDS 3

/* Prefills tokens[pos..n) of s in steps of 512, committing as it goes. */
static void prefill(engine_t *e, prefix_t *px, struct prefix_seq *s, const int32_t *t, uint32_t pos,
                    uint32_t n)
{
    char err[256];
    const float *lg;
    uint32_t rows;
    for (uint32_t i = pos; i < n; i += 512) {
        uint32_t m = n - i < 512 ? n - i : 512;
        if (prefix_seq_grow(px, s, i + m, t, n) != 0) {
            fprintf(stderr, "bench-prefix: the pool is full\n");
            exit(1);
        }
        struct fwd_seq fs = { t + i, m, i, s->blocks, s->n_blocks, false,
                               prefix_seq_tables(s) };
        if (engine_step(e, &fs, 1, &lg, &rows, err, sizeof(err)) != 0) {
            fprintf(stderr, "bench-prefix: prefill failed: %s\n", err);
            exit(1);
        }
        prefix_seq_commit(px, s, t, i + m);
    }
}

static void bench_reuse(const char *path, int threads, struct reuse_result *r)
{
    char err[512];
    model_t *m = model_load(path, err, sizeof(err));
    if (m == NULL) {
        fprintf(stderr, "bench-prefix: %s\n", err);
        exit(1);
    }
    struct pool_layout lay;
    kv_pool_layout(m, BT, KERN_F16, KERN_F16, 0, false, &lay);
    pool_t *p;
    prefix_t *px;
    open_pool(&lay, (2 * REUSE_PROMPT / BT + 8) * lay.parts.n_parts, &p, &px);
    struct kv_params kp = kv_default_params();
    kp.block_tokens = BT;
    kp.n_blocks = pool_header(p)->n_blocks;
    kp.parts = &lay.parts;
    kvcache_t *kv = kvcache_wrap(&m->cfg, &kp, pool_data(p), pool_data_bytes(p), err, sizeof(err));
    struct engine_params ep = engine_default_params();
    ep.max_ctx = REUSE_PROMPT;
    ep.n_threads = threads;
    engine_t *e = kv ? engine_new(m, kv, &ep, err, sizeof(err)) : NULL;
    if (e == NULL) {
        fprintf(stderr, "bench-prefix: %s\n", err);
        exit(1);
    }
    int32_t *t = malloc(REUSE_PROMPT * sizeof(int32_t));
    for (int i = 0; i < REUSE_PROMPT; i++)
        t[i] = (int32_t)(rng() % m->cfg.n_vocab);
    prefix_ns_t ns = prefix_namespace(px, "", 0), cold = prefix_namespace(px, "cold", 4);
    struct prefix_seq s = { 0 };
    double scratch[REUSE_ROUNDS], cached[REUSE_ROUNDS];
    for (int k = -1; k < REUSE_ROUNDS; k++) {  /* round -1 warms up and fills the cache */
        double t0 = now_us();
        prefix_seq_begin(px, &s, cold, t, 0, NULL); /* nothing looked up */
        prefill(e, px, &s, t, 0, REUSE_PROMPT);
        prefix_seq_release(px, &s);
        double t1 = now_us();
        int64_t c = prefix_seq_begin(px, &s, ns, t, REUSE_PROMPT, NULL);
        prefill(e, px, &s, t, (uint32_t)c, REUSE_PROMPT);
        prefix_seq_release(px, &s);
        double t2 = now_us();
        if (k >= 0) {
            scratch[k] = (t1 - t0) / 1e3;
            cached[k] = (t2 - t1) / 1e3;
            r->cached_tokens = c;
        }
    }
    r->scratch_ms = median(scratch, REUSE_ROUNDS);
    r->cached_ms = median(cached, REUSE_ROUNDS);
    prefix_seq_fini(&s);
    free(t);
    engine_destroy(&e);
    kvcache_destroy(&kv);
    prefix_destroy(&px);
    pool_close(&p);
    model_destroy(&m);
}

int main(int argc, char **argv)
{
    int json = 0, threads = 0;
    const char *model = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = 1;
        else if (strcmp(argv[i], "-m") == 0 && i + 1 < argc)
            model = argv[++i];
        else if (strcmp(argv[i], "-t") == 0 && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc)
            rng_state = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: bench-prefix [-m MODEL] [-t N] [--json] [--seed N]\n");
            return 1;
        }
    }
    struct lookup_result lr;
    struct waste_result wr;
    bench_lookup(&lr);
    bench_waste(&wr);
    struct reuse_result rr = { 0 };
    if (model)
        bench_reuse(model, threads, &rr);
    if (json) {
        printf("{\"lookup\":{\"tokens\":%d,\"hit_blocks\":%u,\"hit_us\":%.1f,\"hash_us\":%.1f,"
               "\"begin_release_us\":%.1f,\"hit_tokens_per_s\":%.0f},"
               "\"waste\":{\"sequences\":%d,\"tokens\":%llu,\"blocks\":%u,\"paged\":%.5f,"
               "\"paged_with_metadata\":%.5f,\"contiguous\":%.5f,\"churn_refusals\":%u,"
               "\"churn_fill_min\":%.5f,\"churn_fill_avg\":%.5f}",
               PROMPT, lr.hit_blocks, lr.hit_us, lr.hash_us, lr.begin_us, PROMPT / (lr.hit_us / 1e6),
               N_SEQ, (unsigned long long)wr.tokens, wr.blocks, wr.paged_waste, wr.paged_waste_meta,
               wr.contiguous_waste, wr.churn_refusals, wr.churn_fill_min, wr.churn_fill_avg);
        if (model)
            printf(",\"reuse\":{\"prompt\":%d,\"cached_tokens\":%lld,\"scratch_ms\":%.1f,"
                   "\"cached_ms\":%.1f,\"speedup\":%.2f}", REUSE_PROMPT, (long long)rr.cached_tokens,
                   rr.scratch_ms, rr.cached_ms, rr.scratch_ms / rr.cached_ms);
        printf("}\n");
        return 0;
    }
    printf("prefix lookup, %d-token prompt (%d blocks of %d), median of %d:\n", PROMPT, PROMPT / BT,
           BT, ROUNDS);
    printf("  hit (hash + verify %u blocks): %8.1f us  %6.1f M tokens/s   target < 1000 us\n",
           lr.hit_blocks, lr.hit_us, PROMPT / lr.hit_us);
    printf("  hashing alone:                 %8.1f us  %6.1f M tokens/s\n", lr.hash_us,
           PROMPT / lr.hash_us);
    printf("  begin + release (refs):        %8.1f us\n", lr.begin_us);
    printf("KV waste, %d sequences of %d..%d tokens (%llu tokens):\n", N_SEQ, MIN_LEN, MAX_LEN,
           (unsigned long long)wr.tokens);
    printf("  paged, blocks of %d:           %7.3f %% of KV bytes hold no token (%u blocks)"
           "   target < 2 %%\n", BT, 100 * wr.paged_waste, wr.blocks);
    printf("  paged, counting metadata:      %7.3f %% of the segment\n", 100 * wr.paged_waste_meta);
    printf("  contiguous max-length:         %7.3f %%  (%.1fx the paged waste)\n",
           100 * wr.contiguous_waste, wr.contiguous_waste / wr.paged_waste);
    printf("  churn (20,000 replacements):   pool %.2f %% full on average, %.2f %% at least, "
           "when an arrival did not fit (%u times)\n",
           100 * wr.churn_fill_avg, 100 * wr.churn_fill_min, wr.churn_refusals);
    if (model) {
        printf("time to first token, %d-token prompt, median of %d (%s):\n", REUSE_PROMPT,
               REUSE_ROUNDS, model);
        printf("  from scratch:                  %8.1f ms\n", rr.scratch_ms);
        printf("  %4lld tokens cached:             %8.1f ms  (%.1fx faster)\n",
               (long long)rr.cached_tokens, rr.cached_ms, rr.scratch_ms / rr.cached_ms);
    }
    return 0;
}
