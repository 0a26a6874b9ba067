/*
 * test_serve_sched_ref.c - how a worker shares its steps between prompts:
 * real kvd and kvd-worker processes, the default model, over ipc://.
 *
 * A prompt served mostly from the prefix cache is not held behind a cold
 * prompt that computes: with a step budget of 64 tokens, a cold prompt of
 * 1,024 tokens needs 16 steps, and a prompt whose 320-token prefix is
 * cached, sent just after it, must have its first token before the cold one
 * has its own (it needs one step). Two cold prompts of one length sent
 * together finish one after the other, the older first. The worker's steps are held
 * ($KVD_WORKER_STALL_FILE) until both requests are on it, so the order is
 * the scheduler's, not the machine's speed. The cold prompt still completes
 * (no prompt starves), and both give the tokens they give alone.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "check.h"
#include "serve.h"

#define CACHED 320      /* the warm prompt's cached prefix: 20 full blocks */
#define COLD 1024       /* the cold prompt */
#define EQUAL 512       /* two cold prompts of one length */

/* A prompt of n ordinary text token ids (no specials), different per salt. */
static int32_t *prompt_ids(uint32_t n, uint32_t salt)
{
    int32_t *t = malloc(n * sizeof(int32_t));
    REQUIRE(t != NULL);
    for (uint32_t i = 0; i < n; i++)
        t[i] = (int32_t)(1000 + (i * 7919u + salt * 104729u) % 20000u);
    return t;
}

static atomic_int first_tokens;     /* first tokens seen so far, by any request */

/* One streamed request on a thread of its own; `order` is the rank of its
 * first token among the requests' (1 = the first to have one). */
struct req {
    struct sv_kvd *k;
    const int32_t *ids;
    uint32_t n;
    int order;
    struct kvd_result r;
    int rc;
    bool no_cache;      /* neither use nor fill the prefix cache */
};

static int on_chunk(void *user, const struct kvd_chunk *c)
{
    struct req *q = user;
    if (q->order == 0 && c->n_tokens > 0)
        q->order = atomic_fetch_add(&first_tokens, 1) + 1;
    return 0;
}

static void run(struct req *q)
{
    kvd_client_t *c = sv_client(q->k, SV_WAIT_MS);
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.token_ids = q->ids;
    p.n_token_ids = q->n;
    p.max_tokens = 4;
    p.temperature = 0;
    p.ignore_eos = true;
    p.no_cache = q->no_cache;
    q->rc = kvd_generate_chunks(c, &p, on_chunk, q, &q->r);
    if (q->rc != 0)
        fprintf(stderr, "generate: %s (%s)\n", kvd_strerror(q->rc), q->r.error);
    kvd_client_destroy(&c);
}

static void *run_thread(void *arg)
{
    run(arg);
    return NULL;
}

/* Waits until kvd has n requests on its workers. */
static bool wait_running(struct sv_kvd *k, uint64_t n)
{
    struct kvd_stats s;
    double until = sv_now_ms() + SV_WAIT_MS;
    do {
        sv_stats(k, &s);
        bool there = s.requests_running >= n;
        kvd_stats_free(&s);
        if (there)
            return true;
        sv_sleep_ms(20);
    } while (sv_now_ms() < until);
    return false;
}

static bool same_tokens(const struct kvd_result *a, const struct kvd_result *b)
{
    return a->n_tokens == b->n_tokens && memcmp(a->tokens, b->tokens, a->n_tokens * sizeof(int32_t)) == 0;
}

int main(void)
{
    char stall[] = "/tmp/kvd-test-stall-XXXXXX";
    int sfd = mkstemp(stall);
    REQUIRE(sfd >= 0);
    close(sfd);
    unlink(stall);
    setenv("KVD_WORKER_STALL_FILE", stall, 1);
    struct sv_kvd *k = sv_start((const char *[]){ "--workers", "1", "--step-tokens", "64",
                                                  "--worker-timeout", SV_WORKER_TIMEOUT,
                                                  "--kv-memory", "64MiB", NULL });

    /* alone first: the tokens each gives; the warm prompt's blocks are cached
     * from then on (its first 320 tokens: the full blocks), the cold one's
     * never (no_cache) */
    int32_t *warm = prompt_ids(CACHED + 8, 1), *cold = prompt_ids(COLD, 2);
    struct req alone_warm = { .k = k, .ids = warm, .n = CACHED + 8 };
    struct req alone_cold = { .k = k, .ids = cold, .n = COLD, .no_cache = true };
    run(&alone_warm);
    run(&alone_cold);
    REQUIRE(alone_warm.rc == 0 && alone_cold.rc == 0);

    /* the worker's steps held; the cold prompt first, then the warm one */
    FILE *f = fopen(stall, "w");
    REQUIRE(f != NULL);
    fclose(f);
    atomic_store(&first_tokens, 0);
    struct req c = { .k = k, .ids = cold, .n = COLD }, w = { .k = k, .ids = warm, .n = CACHED + 8 };
    pthread_t tc, tw;
    REQUIRE(pthread_create(&tc, NULL, run_thread, &c) == 0);
    CHECK(wait_running(k, 1));
    REQUIRE(pthread_create(&tw, NULL, run_thread, &w) == 0);
    CHECK(wait_running(k, 2));
    unlink(stall);
    pthread_join(tw, NULL);
    pthread_join(tc, NULL);
    CHECK_INT(c.rc, 0);
    CHECK_INT(w.rc, 0);
    fprintf(stderr, "first tokens: warm prompt %d, cold prompt %d; warm cached %u of %u\n", w.order,
            c.order, w.r.cached_prompt_tokens, w.r.prompt_tokens);
    CHECK_INT(w.r.cached_prompt_tokens, CACHED);
    CHECK_INT(c.r.cached_prompt_tokens, 0);
    CHECK_INT(w.order, 1);
    CHECK_INT(c.order, 2);
    CHECK(same_tokens(&w.r, &alone_warm.r));
    CHECK(same_tokens(&c.r, &alone_cold.r));

    /* two cold prompts of one length, held, the older sent first: the
     * older takes the step budget the warm prompts leave, so it finishes
     * first and the other after it, not both together at the end */
    int32_t *older = prompt_ids(EQUAL, 3), *newer = prompt_ids(EQUAL, 4);
    f = fopen(stall, "w");
    REQUIRE(f != NULL);
    fclose(f);
    atomic_store(&first_tokens, 0);
    struct req a = { .k = k, .ids = older, .n = EQUAL, .no_cache = true };
    struct req b = { .k = k, .ids = newer, .n = EQUAL, .no_cache = true };
    pthread_t ta, tb;
    REQUIRE(pthread_create(&ta, NULL, run_thread, &a) == 0);
    CHECK(wait_running(k, 1));
    REQUIRE(pthread_create(&tb, NULL, run_thread, &b) == 0);
    CHECK(wait_running(k, 2));
    unlink(stall);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    CHECK_INT(a.rc, 0);
    CHECK_INT(b.rc, 0);
    fprintf(stderr, "first tokens of two cold prompts of %d tokens: older %d, newer %d\n", EQUAL, a.order,
            b.order);
    CHECK_INT(a.order, 1);
    CHECK_INT(b.order, 2);
    kvd_result_free(&a.r);
    kvd_result_free(&b.r);
    free(older);
    free(newer);

    struct kvd_stats s;
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    kvd_stats_free(&s);
    CHECK_INT(sv_stop(k, SV_WAIT_MS), 0);
    kvd_result_free(&alone_warm.r);
    kvd_result_free(&alone_cold.r);
    kvd_result_free(&c.r);
    kvd_result_free(&w.r);
    free(warm);
    free(cold);
    sv_pass();
    return CHECK_DONE();
}
