/*
 * test_serve_liveness_ref.c - a slow or busy CPU never makes kvd kill a
 * healthy worker; a stopped or stuck one is still found. Real kvd and
 * kvd-worker processes, the default model, over ipc://, on the portable C
 * kernels (KVD_ISA=c: the slowest path) with --worker-timeout 2000.
 *
 * - A worker SIGSTOPped while idle is declared dead (no heartbeat) and
 *   restarted.
 * - A prefill whose one step runs several times longer than the timeout,
 *   while two busy processes compete for the cores, completes; no worker is
 *   declared dead or hung (heartbeats and progress go on during the step).
 *   The step's length is chosen from a speed the test measures first, so
 *   the step outlasts the timeout on any machine.
 * - A worker that heartbeats but makes no progress with work (its steps held
 *   by $KVD_WORKER_STALL_FILE) is declared hung and restarted; its request
 *   resumes on the new worker and completes.
 */
#include <pthread.h>
#include <string.h>

#include "check.h"
#include "serve.h"

#define TIMEOUT_MS 2000.0   /* kvd's --worker-timeout here */

/* The longest step the worker trace reports in kvd's log, and its tokens
 * (steps of at least min_tokens tokens only). */
static double longest_step(const struct sv_kvd *k, uint32_t min_tokens, uint32_t *tokens)
{
    FILE *f = fopen(k->log, "r");
    REQUIRE(f != NULL);
    char line[1024];
    double best = 0;
    *tokens = 0;
    while (fgets(line, sizeof(line), f)) {
        const char *p = strstr(line, ": step ");
        unsigned id, step, seqs, toks;
        double ms;
        if (p && sscanf(line, "kvd-worker %u: step %u: %u sequences, %u tokens, %lf ms", &id, &step,
                        &seqs, &toks, &ms) == 5 && toks >= min_tokens && ms > best) {
            best = ms;
            *tokens = toks;
        }
    }
    fclose(f);
    return best;
}

/* How many lines of kvd's log contain s. */
static int log_count(const struct sv_kvd *k, const char *s)
{
    FILE *f = fopen(k->log, "r");
    REQUIRE(f != NULL);
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof(line), f))
        n += strstr(line, s) != NULL;
    fclose(f);
    return n;
}

/* Waits (up to limit_ms: a bound for a hung test, not a speed) for the log
 * to hold at least n lines containing s. */
static bool wait_log(const struct sv_kvd *k, const char *s, int n, double limit_ms)
{
    double until = sv_now_ms() + limit_ms;
    while (log_count(k, s) < n) {
        if (sv_now_ms() > until)
            return false;
        sv_sleep_ms(50);
    }
    return true;
}

/* The alive worker's pid and its restarts; 0 while none is alive. */
static pid_t the_worker(struct sv_kvd *k, uint32_t *restarts)
{
    struct kvd_stats s;
    sv_stats(k, &s);
    REQUIRE(s.n_workers == 1);
    *restarts = s.workers[0].restarts;
    pid_t pid = s.workers[0].alive ? s.workers[0].pid : 0;
    kvd_stats_free(&s);
    return pid;
}

static pid_t wait_new_worker(struct sv_kvd *k, pid_t old, uint32_t *restarts)
{
    double until = sv_now_ms() + SV_WAIT_MS;
    pid_t pid;
    while (((pid = the_worker(k, restarts)) == 0 || pid == old) && sv_now_ms() < until)
        sv_sleep_ms(50);
    return pid;
}

/* A prompt of n token ids (ordinary text tokens, no specials). */
static int32_t *prompt_ids(uint32_t n, uint32_t salt)
{
    int32_t *t = malloc(n * sizeof(int32_t));
    REQUIRE(t != NULL);
    for (uint32_t i = 0; i < n; i++)
        t[i] = (int32_t)(1000 + (i * 7919u + salt * 104729u) % 20000u);
    return t;
}

static int generate_ids(struct sv_kvd *k, const int32_t *ids, uint32_t n, uint32_t max_tokens,
                        struct kvd_result *r)
{
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.token_ids = ids;
    p.n_token_ids = n;
    p.max_tokens = max_tokens;
    p.temperature = 0;
    p.ignore_eos = true;
    int rc = kvd_generate(c, &p, r);
    if (rc != 0)
        fprintf(stderr, "generate: %s (%s)\n", kvd_strerror(rc), r->error);
    kvd_client_destroy(&c);
    return rc;
}

/* A request run on its own thread (the one that meets a stuck worker). */
struct bg_req {
    struct sv_kvd *k;
    const int32_t *ids;
    uint32_t n;
    struct kvd_result r;
    int rc;
};

static void *bg_run(void *arg)
{
    struct bg_req *b = arg;
    b->rc = generate_ids(b->k, b->ids, b->n, 4, &b->r);
    return NULL;
}

/* Two processes that keep both cores busy until busy_stop(). */
static pid_t busy[2];

static void busy_start(void)
{
    for (int i = 0; i < 2; i++) {
        busy[i] = fork();
        REQUIRE(busy[i] >= 0);
        if (busy[i] == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            volatile unsigned long x = 0;
            for (;;)
                x++;
        }
    }
}

static void busy_stop(void)
{
    for (int i = 0; i < 2; i++)
        if (busy[i] > 0) {
            kill(busy[i], SIGKILL);
            waitpid(busy[i], NULL, 0);
            busy[i] = 0;
        }
}

int main(void)
{
    /* the slowest kernels; each step's time in the log; the stall switch */
    setenv("KVD_ISA", "c", 1);
    setenv("KVD_WORKER_TRACE", "1", 1);
    char stall[] = "/tmp/kvd-test-stall-XXXXXX";
    int sfd = mkstemp(stall);
    REQUIRE(sfd >= 0);
    close(sfd);
    unlink(stall);
    setenv("KVD_WORKER_STALL_FILE", stall, 1);

    struct sv_kvd *k = sv_start((const char *[]){ "--workers", "1", "--threads", "1",
                                                  "--worker-timeout", "2000", "--step-tokens", "2048",
                                                  "--ctx", "2048", "--kv-memory", "64MiB", NULL });
    uint32_t restarts;
    pid_t w0 = the_worker(k, &restarts);
    REQUIRE(w0 > 0);

    /* the speed of a 64-token prefill step on this machine, now */
    struct kvd_result r = { 0 };
    int32_t *cal = prompt_ids(64, 1);
    CHECK_INT(generate_ids(k, cal, 64, 1, &r), 0);
    kvd_result_free(&r);
    uint32_t cal_tok;
    double cal_ms = longest_step(k, 64, &cal_tok);
    REQUIRE(cal_ms > 0);
    double ms_per_token = cal_ms / cal_tok;
    fprintf(stderr, "calibration: %u tokens in one step, %.0f ms (%.2f ms/token)\n", cal_tok, cal_ms,
            ms_per_token);

    /* SIGSTOP: no heartbeats, declared dead within a bound, restarted */
    CHECK(kill(w0, SIGSTOP) == 0);
    double t_stop = sv_now_ms();
    CHECK(wait_log(k, "no heartbeat for", 1, SV_WAIT_MS));
    fprintf(stderr, "stopped worker declared dead after %.0f ms\n", sv_now_ms() - t_stop);
    /* the last beat came at most one heartbeat period (250 ms) before the stop */
    CHECK(sv_now_ms() - t_stop >= TIMEOUT_MS - 300);
    pid_t w1 = wait_new_worker(k, w0, &restarts);
    REQUIRE(w1 > 0 && w1 != w0);
    CHECK_INT(restarts, 1);

    /* one step several times the timeout (the fresh worker has no measured
     * speed yet, so its first step takes the whole prompt), under load */
    uint32_t n_long = (uint32_t)(4 * TIMEOUT_MS / ms_per_token);
    if (n_long < 64)
        n_long = 64;
    if (n_long > 1900)
        n_long = 1900;
    int32_t *lng = prompt_ids(n_long, 2);
    busy_start();
    double t0 = sv_now_ms();
    int rc = generate_ids(k, lng, n_long, 4, &r);
    busy_stop();
    CHECK_INT(rc, 0);
    CHECK_INT(r.n_tokens, 4);
    CHECK_INT(r.prompt_tokens, n_long);
    kvd_result_free(&r);
    uint32_t long_tok;
    double long_ms = longest_step(k, n_long, &long_tok);
    fprintf(stderr, "long prefill under load: %u tokens, one step of %.0f ms, request %.0f ms\n",
            long_tok, long_ms, sv_now_ms() - t0);
    CHECK_INT(long_tok, n_long);    /* the whole prompt was one step... */
    CHECK(long_ms > TIMEOUT_MS);    /* ...longer than the timeout */
    CHECK_INT(log_count(k, "declared"), 1); /* only the stopped worker's */
    CHECK(the_worker(k, &restarts) == w1);
    CHECK_INT(restarts, 1);

    /* heartbeats without progress: declared hung, the request resumes */
    FILE *sf = fopen(stall, "w");
    REQUIRE(sf != NULL);
    fclose(sf);
    int32_t *sh = prompt_ids(40, 3);
    struct bg_req hr = { .k = k, .ids = sh, .n = 40, .rc = -1 };
    pthread_t th;
    REQUIRE(pthread_create(&th, NULL, bg_run, &hr) == 0);
    CHECK(wait_log(k, "no progress for", 1, SV_WAIT_MS));
    CHECK_INT(log_count(k, "no heartbeat for"), 1); /* it was beating all along */
    unlink(stall);
    pthread_join(th, NULL);
    CHECK_INT(hr.rc, 0);
    CHECK_INT(hr.r.n_tokens, 4);
    kvd_result_free(&hr.r);
    pid_t w2 = wait_new_worker(k, w1, &restarts);
    CHECK(w2 > 0 && w2 != w1);
    CHECK_INT(restarts, 2);

    struct kvd_stats s;
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    sv_print_stats("end", &s);
    CHECK_INT(s.blocks_in_use, 0);
    kvd_stats_free(&s);
    CHECK_INT(sv_stop(k, SV_WAIT_MS), 0);
    free(cal);
    free(lng);
    free(sh);
    sv_pass();
    return CHECK_DONE();
}

