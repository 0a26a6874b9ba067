/*
 * test_serve_faults_ref.c - kvd under faults and pressure: real kvd and
 * kvd-worker processes, the default model, over ipc://.
 *
 * - A worker SIGKILLed mid-stream: the restarted worker resumes the request;
 *   the stream completes with contiguous chunks and the tokens of an
 *   uninterrupted run (sampled with a seed, so the draws must resume too).
 *   The same for a worker SIGSTOPped mid-stream (declared dead once
 *   --worker-timeout has passed without a heartbeat, never before, and
 *   SIGKILLed by kvd, so no stopped process lingers). With one worker and
 *   --max-restarts 0 the request fails with KVD_EUNAVAILABLE instead of
 *   hanging, and so do later requests. A request whose worker is killed
 *   every time it resumes fails at the third death (ERR_INTERNAL, with the
 *   reason) instead of taking down worker after worker; a request batched
 *   with it at the first two deaths then runs alone and completes with its
 *   uninterrupted tokens; the restarted worker serves the next request.
 * - A client that disappears mid-stream: kvd cancels its request and holds no
 *   block for it.
 * - Past the queue (--max-queue 2 --max-batch 1): ERR_OVERLOADED with a retry
 *   time for the excess, the others complete. Behind a running request, a
 *   queued request's deadline (ERR_DEADLINE) and a Cancel end it at once.
 * - A pool too small for the load: requests are preempted and recomputed,
 *   every one completes with its solo output, and no block is leaked.
 * - Deadlines (before any output: ERR_DEADLINE; during output: a Final with
 *   finish DEADLINE), cancel from the stream callback and with a Cancel
 *   message: no block in use afterwards.
 * - SIGTERM: new requests are refused, a short request finishes, a long one
 *   is cancelled when the grace period ends, kvd exits 0 and removes its pool.
 *
 * No check depends on this machine's speed: where a test needs a time (a
 * deadline, a grace period) it measures first how fast kvd runs here and now,
 * and sizes the time as a wide multiple of that, far from both outcomes.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "check.h"
#include "serve.h"

#define MAX_OUT 2048
/* --worker-timeout of the kvd whose worker is SIGSTOPped: the time without a
 * heartbeat (a beat every 250 ms, steps or not) that makes a worker dead */
#define STOP_TIMEOUT_MS 5000

static bool same(const int32_t *a, size_t na, const int32_t *b, size_t nb)
{
    return na == nb && (na == 0 || memcmp(a, b, na * sizeof(int32_t)) == 0);
}

static void print_ids(const char *what, const int32_t *t, size_t n)
{
    fprintf(stderr, "%s (%zu):", what, n);
    for (size_t i = 0; i < n; i++)
        fprintf(stderr, " %d", t[i]);
    fputc('\n', stderr);
}

/* Greedy parameters for a plain prompt. */
static struct kvd_gen_params greedy(const char *prompt, uint32_t max_tokens, bool ignore_eos)
{
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.prompt = prompt;
    p.max_tokens = max_tokens;
    p.temperature = 0;
    p.ignore_eos = ignore_eos;
    return p;
}

/* What a stream callback saw, and what it does once `at` tokens came. */
struct watch {
    uint32_t next_seq;          /* the seq expected next */
    bool contiguous;            /* every seq was the expected one */
    int32_t tokens[MAX_OUT];    /* the streamed tokens, n_tokens of them */
    size_t n_tokens;
    size_t at;                  /* act at the chunk that brings the count to `at` tokens */
    pid_t victim;               /* then send it signal sig (0: none) */
    int sig;
    int cancel;                 /* and return this from then on (non-zero: cancel) */
    atomic_int started;         /* a chunk came (read by another thread) */
    atomic_int acted;           /* it acted (read by another thread) */
    atomic_int stop;            /* set by another thread: cancel at the next chunk */
    double t_first;             /* when the first chunk came (ms) */
    double t_act;               /* when it acted (ms), 0: not yet */
};

static void watch_init(struct watch *w, size_t at, pid_t victim, int sig, int cancel)
{
    memset(w, 0, sizeof(*w));
    w->contiguous = true;
    w->at = at;
    w->victim = victim;
    w->sig = sig;
    w->cancel = cancel;
}

static int on_chunk(void *user, const char *text, size_t len, const int32_t *t, size_t n,
                    uint32_t seq)
{
    struct watch *w = user;
    (void)text;
    (void)len;
    if (seq != w->next_seq)
        w->contiguous = false;
    w->next_seq = seq + 1;
    for (size_t i = 0; i < n && w->n_tokens < MAX_OUT; i++)
        w->tokens[w->n_tokens++] = t[i];
    if (!atomic_load(&w->started))
        w->t_first = sv_now_ms();
    atomic_store(&w->started, 1);
    if (w->n_tokens >= w->at && !atomic_load(&w->acted)) {
        w->t_act = sv_now_ms();
        if (w->victim > 0)
            kill(w->victim, w->sig);
        atomic_store(&w->acted, 1);
    }
    if (atomic_load(&w->stop))
        return 1;
    return atomic_load(&w->acted) ? w->cancel : 0;
}

static pid_t worker_pid(struct sv_kvd *k, uint32_t *restarts)
{
    struct kvd_stats s;
    sv_stats(k, &s);
    REQUIRE(s.n_workers == 1);
    if (restarts)
        *restarts = s.workers[0].restarts;
    pid_t pid = s.workers[0].alive ? s.workers[0].pid : 0;
    kvd_stats_free(&s);
    return pid;
}

/* Waits up to timeout_ms for kvd to have an alive worker (after a restart). */
static pid_t wait_worker(struct sv_kvd *k, int timeout_ms)
{
    double until = sv_now_ms() + timeout_ms;
    pid_t pid;
    while ((pid = worker_pid(k, NULL)) == 0 && sv_now_ms() < until)
        sv_sleep_ms(50);
    return pid;
}

/* How fast kvd runs here and now: the time from sending a request to its
 * first chunk, and then per token. */
struct pace {
    double first_ms;
    double token_ms;
};

/* Measures the pace of a greedy request of n tokens of prompt, alone (its
 * prompt cached as much as it is for the next request of that prompt). */
static struct pace measure_pace(struct sv_kvd *k, const char *prompt, uint32_t n)
{
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);
    struct kvd_gen_params p = greedy(prompt, n, true);
    static struct watch w;
    watch_init(&w, SIZE_MAX, 0, 0, 0);
    struct kvd_result r;
    double t0 = sv_now_ms();
    int rc = kvd_generate_stream(c, &p, on_chunk, &w, &r);
    double t1 = sv_now_ms();
    REQUIRE(rc == 0 && r.n_tokens == n && n > 1);
    struct pace pc = { w.t_first - t0, (t1 - w.t_first) / (n - 1) };
    fprintf(stderr, "pace: first chunk after %.0f ms, then %.1f ms per token\n", pc.first_ms,
            pc.token_ms);
    kvd_result_free(&r);
    kvd_client_destroy(&c);
    return pc;
}

/* ---- a worker killed or stopped mid-stream ------------------------------------------- */

static void worker_faults(struct sv_kvd *k, const char *prompt)
{
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);
    struct kvd_gen_params p = greedy(prompt, 96, true);
    /* sampled, seeded: a worker reseeds every draw from (seed, position), so a
     * sequence resumed on another worker draws exactly what it would have */
    p.temperature = 0.8f;
    p.seed = 1234;

    /* the reference: the same request, uninterrupted */
    struct watch w;
    struct kvd_result ref;
    watch_init(&w, UINT32_MAX, 0, 0, 0);
    int rc = kvd_generate_stream(c, &p, on_chunk, &w, &ref);
    REQUIRE(rc == 0);
    REQUIRE(ref.n_tokens == 96);
    CHECK(w.contiguous);
    CHECK(same(w.tokens, w.n_tokens, ref.tokens, ref.n_tokens));

    /* SIGKILL after 10 tokens: resumed by the restarted worker */
    uint32_t restarts;
    pid_t victim = worker_pid(k, &restarts);
    REQUIRE(victim > 0);
    CHECK_INT(restarts, 0);
    struct kvd_result r;
    watch_init(&w, 10, victim, SIGKILL, 0);
    double t0 = sv_now_ms();
    rc = kvd_generate_stream(c, &p, on_chunk, &w, &r);
    fprintf(stderr, "SIGKILL: %s, %zu tokens, %u chunks, %.0f ms after the kill\n",
            kvd_strerror(rc), r.n_tokens, r.chunks, sv_now_ms() - (w.t_act ? w.t_act : t0));
    CHECK_INT(rc, 0);
    CHECK(w.t_act > 0);
    CHECK(w.contiguous);
    CHECK_INT(w.next_seq, r.chunks);
    CHECK(same(w.tokens, w.n_tokens, r.tokens, r.n_tokens));
    CHECK(same(r.tokens, r.n_tokens, ref.tokens, ref.n_tokens));
    if (!same(r.tokens, r.n_tokens, ref.tokens, ref.n_tokens)) {
        print_ids("uninterrupted", ref.tokens, ref.n_tokens);
        print_ids("killed", r.tokens, r.n_tokens);
    }
    CHECK_INT(r.finish_reason, KVD_FINISH_LENGTH);
    CHECK(strcmp(r.text, ref.text) == 0);
    kvd_result_free(&r);
    pid_t second = worker_pid(k, &restarts);
    CHECK(second > 0 && second != victim);
    CHECK_INT(restarts, 1);
    CHECK(!sv_alive(victim));

    /* SIGSTOP after 10 tokens: no heartbeat, declared dead, SIGKILLed by kvd */
    victim = second;
    watch_init(&w, 10, victim, SIGSTOP, 0);
    t0 = sv_now_ms();
    rc = kvd_generate_stream(c, &p, on_chunk, &w, &r);
    double after_stop = sv_now_ms() - (w.t_act ? w.t_act : t0);
    fprintf(stderr, "SIGSTOP: %s, %zu tokens, %u chunks, %.0f ms after the stop\n",
            kvd_strerror(rc), r.n_tokens, r.chunks, after_stop);
    CHECK_INT(rc, 0);
    CHECK(w.t_act > 0);
    /* not declared dead before its timeout (the last beat may be up to 250 ms
     * older than the last token: half the timeout is a safe lower bound) */
    CHECK(after_stop >= STOP_TIMEOUT_MS / 2);
    CHECK(w.contiguous);
    CHECK_INT(w.next_seq, r.chunks);
    CHECK(same(w.tokens, w.n_tokens, r.tokens, r.n_tokens));
    CHECK(same(r.tokens, r.n_tokens, ref.tokens, ref.n_tokens));
    if (!same(r.tokens, r.n_tokens, ref.tokens, ref.n_tokens)) {
        print_ids("uninterrupted", ref.tokens, ref.n_tokens);
        print_ids("stopped", r.tokens, r.n_tokens);
    }
    kvd_result_free(&r);
    /* kvd killed and reaped the stopped worker itself */
    double until = sv_now_ms() + SV_WAIT_MS;
    while (sv_alive(victim) && sv_now_ms() < until)
        sv_sleep_ms(20);
    CHECK(!sv_alive(victim));
    if (sv_is_worker(victim)) {
        kill(victim, SIGKILL);
        kill(victim, SIGCONT);
    }
    CHECK(sv_log_has(k, "no heartbeat"));
    pid_t third = wait_worker(k, SV_WAIT_MS);
    CHECK(third > 0 && third != victim);
    worker_pid(k, &restarts);
    CHECK_INT(restarts, 2);

    struct kvd_stats s;
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    CHECK_INT(s.requests_failed, 0);
    kvd_stats_free(&s);
    kvd_result_free(&ref);
    kvd_client_destroy(&c);
}

/* With one worker that may not restart, a killed worker fails its request. */
static void worker_gone(const char *prompt)
{
    struct sv_kvd *k = sv_start((const char *[]){ "--workers", "1", "--max-restarts", "0",
                                                  "--worker-timeout", SV_WORKER_TIMEOUT,
                                                  "--kv-memory", "32MiB", "--ctx", "1024",
                                                  "--step-tokens", "32", NULL });
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);
    pid_t victim = worker_pid(k, NULL);
    REQUIRE(victim > 0);
    struct kvd_gen_params p = greedy(prompt, 200, true);
    struct watch w;
    struct kvd_result r;
    watch_init(&w, 5, victim, SIGKILL, 0);
    int rc = kvd_generate_stream(c, &p, on_chunk, &w, &r);
    fprintf(stderr, "no worker left: %s (%s) %.0f ms after the kill\n", kvd_strerror(rc), r.error,
            sv_now_ms() - w.t_act);
    CHECK_INT(rc, KVD_EUNAVAILABLE);
    CHECK(w.contiguous);
    kvd_result_free(&r);

    bool ok = true;
    uint32_t alive = 1;
    CHECK_INT(kvd_health(c, &ok, &alive), 0);
    CHECK(!ok);
    CHECK_INT(alive, 0);
    rc = kvd_generate(c, &p, &r);
    CHECK_INT(rc, KVD_EUNAVAILABLE);
    kvd_result_free(&r);
    struct kvd_stats s;
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    CHECK_INT(s.requests_failed, 1);
    kvd_stats_free(&s);
    kvd_client_destroy(&c);
    CHECK_INT(sv_stop(k, SV_WAIT_MS), 0);
}

/* ---- a request that takes its worker down every time ---------------------------------- */

/* tokens of the request batched with the poisoned one: far more than come
 * by its second death (about 20), fewer than would make the test long */
#define BY_TOKENS 200

struct bystander {
    struct sv_kvd *k;
    const char *prompt;
    atomic_int started;
    atomic_size_t n_tokens;     /* streamed so far */
    int rc;
    struct kvd_result r;
};

struct poison {
    struct sv_kvd *k;
    struct bystander *by;
    uint32_t next_kill;         /* the chunk at which to kill the serving worker */
    pid_t killed[4];            /* the workers killed so far */
    size_t by_tokens[4];        /* the bystander's tokens at each kill */
    int kills;
};

static int on_chunk_poison(void *user, const char *text, size_t len, const int32_t *t, size_t n, uint32_t seq)
{
    struct poison *pz = user;
    (void)text;
    (void)len;
    (void)t;
    (void)n;
    if (seq < pz->next_kill || pz->kills >= 4)
        return 0;
    /* the worker that serves it now: alive, and not one already killed (chunks
     * of a killed worker may still be on their way) */
    pid_t pid = worker_pid(pz->k, NULL);
    if (pid <= 0 || (pz->kills > 0 && pid == pz->killed[pz->kills - 1]))
        return 0;
    kill(pid, SIGKILL);
    pz->by_tokens[pz->kills] = atomic_load(&pz->by->n_tokens);
    pz->killed[pz->kills++] = pid;
    pz->next_kill = seq + 4;
    return 0;
}

static int on_chunk_bystander(void *user, const char *text, size_t len, const int32_t *t, size_t n,
                              uint32_t seq)
{
    (void)text; (void)len; (void)t; (void)seq;
    struct bystander *b = user;
    atomic_fetch_add(&b->n_tokens, n);
    atomic_store(&b->started, 1);
    return 0;
}

static void *run_bystander(void *arg)
{
    struct bystander *b = arg;
    kvd_client_t *c = sv_client(b->k, SV_WAIT_MS);
    struct kvd_gen_params p = greedy(b->prompt, BY_TOKENS, true);
    b->rc = kvd_generate_stream(c, &p, on_chunk_bystander, b, &b->r);
    kvd_client_destroy(&c);
    return NULL;
}

/* Resumed after each worker death, but not forever: the third death fails
 * it with a clear error, and the service goes on. A request batched with it
 * when the first two deaths came runs alone from then on, so it is not
 * taken down with it a third time, and completes. */
static void poison_request(const char *prompt, const char *other)
{
    struct sv_kvd *k = sv_start((const char *[]){ "--workers", "1", "--max-restarts", "5",
                                                  "--worker-timeout", SV_WORKER_TIMEOUT,
                                                  "--kv-memory", "32MiB", "--ctx", "1024",
                                                  "--step-tokens", "32", NULL });
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);
    static struct bystander by;
    by = (struct bystander){ .k = k, .prompt = other };
    pthread_t th;
    REQUIRE(pthread_create(&th, NULL, run_bystander, &by) == 0);
    for (double until = sv_now_ms() + SV_WAIT_MS; !atomic_load(&by.started) && sv_now_ms() < until;)
        sv_sleep_ms(5);
    CHECK(atomic_load(&by.started));
    struct kvd_gen_params p = greedy(prompt, 400, true);
    struct poison pz = { .k = k, .by = &by, .next_kill = 4 };
    struct kvd_result r;
    int rc = kvd_generate_stream(c, &p, on_chunk_poison, &pz, &r);
    fprintf(stderr, "a request whose worker dies every time: %s (%s) after %d kills\n", kvd_strerror(rc),
            r.error, pz.kills);
    CHECK_INT(pz.kills, 3);
    CHECK_INT(rc, KVD_EINTERNAL);
    CHECK(strstr(r.error, "3 workers died while serving this request") != NULL);
    kvd_result_free(&r);
    pthread_join(th, NULL);
    fprintf(stderr, "  the request batched with it: %s, %zu tokens (%zu at the second death)\n",
            kvd_strerror(by.rc), by.r.n_tokens, pz.by_tokens[1]);
    CHECK_INT(by.rc, 0);
    CHECK_INT(by.r.n_tokens, BY_TOKENS);
    CHECK(pz.by_tokens[1] < BY_TOKENS); /* it was running at the second death: the premise */
    struct kvd_gen_params bp = greedy(other, BY_TOKENS, true);
    bp.no_cache = true;
    struct kvd_result alone;
    CHECK_INT(kvd_generate(c, &bp, &alone), 0);
    CHECK(same(by.r.tokens, by.r.n_tokens, alone.tokens, alone.n_tokens));
    kvd_result_free(&alone);
    kvd_result_free(&by.r);
    /* a restarted worker serves the next request */
    CHECK(wait_worker(k, SV_WAIT_MS) > 0);
    struct kvd_gen_params q = greedy(prompt, 8, true);
    CHECK_INT(kvd_generate(c, &q, &r), 0);
    CHECK_INT(r.n_tokens, 8);
    kvd_result_free(&r);
    struct kvd_stats s;
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    CHECK_INT(s.requests_failed, 1);
    CHECK_INT(s.blocks_in_use, 0);
    kvd_stats_free(&s);
    kvd_client_destroy(&c);
    CHECK_INT(sv_stop(k, SV_WAIT_MS), 0);
}

/* ---- a client that disappears ------------------------------------------------------------ */

static void client_disappears(struct sv_kvd *k, const char *prompt)
{
    struct kvd_stats before, s;
    sv_stats(k, &before);
    wire_arena_t *arena = wire_arena_new(1 << 20);
    void *d = sv_dealer(k);
    Kvd__ClientRequest m;
    Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
    sv_req_init(&m, 1);
    m.body_case = KVD__CLIENT_REQUEST__BODY_GENERATE;
    m.generate = &g;
    g.prompt = (char *)prompt;
    g.has_max_tokens = g.has_stream = g.has_ignore_eos = true;
    g.max_tokens = 900; /* never reached: the first chunk kvd sends after the close cancels it */
    g.stream = g.ignore_eos = true;
    sv_send_msg(d, &m);
    int chunks = 0;
    bool accepted = false;
    while (chunks < 2) {
        Kvd__ServerReply *r = sv_recv(d, arena, SV_WAIT_MS);
        REQUIRE(r != NULL);
        CHECK_INT(r->request_id, 1);
        if (r->body_case == KVD__SERVER_REPLY__BODY_ACCEPTED)
            accepted = true;
        else if (r->body_case == KVD__SERVER_REPLY__BODY_CHUNK)
            chunks++;
        else
            REQUIRE(!"a reply other than Accepted or Chunk");
    }
    CHECK(accepted);
    zmq_close(d);
    double t0 = sv_now_ms();
    bool idle = sv_wait_idle(k, &s, SV_WAIT_MS);
    fprintf(stderr, "client gone: idle %.0f ms after it closed its socket\n", sv_now_ms() - t0);
    CHECK(idle);
    CHECK_INT(s.requests_done, before.requests_done + 1); /* ended as cancelled */
    CHECK(s.completion_tokens - before.completion_tokens < 900);
    kvd_stats_free(&before);
    kvd_stats_free(&s);
    wire_arena_destroy(&arena);
}

/* ---- deadlines and cancels ----------------------------------------------------------------- */

static void deadlines_and_cancels(struct sv_kvd *k, const char *short_prompt, const char *long_prompt)
{
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);
    struct kvd_stats s;

    /* a deadline that passes before any output */
    struct kvd_gen_params p = greedy(long_prompt, 16, false);
    p.deadline_ms = 1;
    struct kvd_result r;
    int rc = kvd_generate(c, &p, &r);
    fprintf(stderr, "deadline 1 ms: %s (%s), %u prompt tokens\n", kvd_strerror(rc), r.error,
            r.prompt_tokens);
    CHECK(r.prompt_tokens > 500);
    CHECK(rc == KVD_EDEADLINE || (rc == 0 && r.finish_reason == KVD_FINISH_DEADLINE));
    kvd_result_free(&r);
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    kvd_stats_free(&s);

    /* a deadline that passes during the output: what came so far, finish
     * DEADLINE. The deadline is the geometric mean of the measured times to
     * the first chunk and to the 960th token, as far as possible from both
     * (about ten times here, on the C kernels too) whatever the speed. */
    struct pace pc = measure_pace(k, short_prompt, 32);
    uint32_t deadline = (uint32_t)sqrt(pc.first_ms * (pc.first_ms + 960 * pc.token_ms)) + 1;
    p = greedy(short_prompt, 960, true);
    p.deadline_ms = deadline;
    double t0 = sv_now_ms();
    rc = kvd_generate(c, &p, &r);
    double took = sv_now_ms() - t0;
    fprintf(stderr, "deadline %u ms: %s, finish %d, %zu tokens, %.0f ms\n", deadline,
            kvd_strerror(rc), r.finish_reason, r.n_tokens, took);
    CHECK_INT(rc, 0);
    CHECK_INT(r.finish_reason, KVD_FINISH_DEADLINE);
    CHECK(r.n_tokens > 0 && r.n_tokens < 960);
    CHECK_INT(r.n_tokens, r.completion_tokens);
    CHECK(took >= deadline); /* not cut before it */
    kvd_result_free(&r);
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    kvd_stats_free(&s);

    /* cancel from the stream callback */
    struct watch w;
    watch_init(&w, 3, 0, 0, 1);
    p = greedy(short_prompt, 900, true);
    rc = kvd_generate_stream(c, &p, on_chunk, &w, &r);
    fprintf(stderr, "cancel from the callback: %s, %zu tokens\n", kvd_strerror(rc), r.n_tokens);
    CHECK_INT(rc, KVD_ECANCELLED);
    CHECK(r.n_tokens >= 3 && r.n_tokens < 900);
    CHECK(w.contiguous);
    kvd_result_free(&r);
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    CHECK(s.blocks_in_use == 0 && s.blocks_pending == 0);
    kvd_stats_free(&s);

    /* the client still works after a cancel */
    p = greedy(short_prompt, 4, true);
    CHECK_INT(kvd_generate(c, &p, &r), 0);
    CHECK_INT(r.n_tokens, 4);
    kvd_result_free(&r);

    /* a Cancel message for a running request: Accepted, then its Final says CANCELLED */
    wire_arena_t *arena = wire_arena_new(1 << 20);
    void *d = sv_dealer(k);
    Kvd__ClientRequest m;
    Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
    sv_req_init(&m, 5);
    m.body_case = KVD__CLIENT_REQUEST__BODY_GENERATE;
    m.generate = &g;
    g.prompt = (char *)short_prompt;
    g.has_max_tokens = g.has_stream = g.has_ignore_eos = true;
    g.max_tokens = 900;
    g.stream = g.ignore_eos = true;
    sv_send_msg(d, &m);
    bool cancel_sent = false, cancel_ok = false, final = false;
    while (!final) {
        Kvd__ServerReply *rep = sv_recv(d, arena, SV_WAIT_MS);
        REQUIRE(rep != NULL);
        if (rep->request_id == 6) {
            CHECK_INT(rep->body_case, KVD__SERVER_REPLY__BODY_ACCEPTED);
            cancel_ok = true;
            continue;
        }
        CHECK_INT(rep->request_id, 5);
        if (rep->body_case == KVD__SERVER_REPLY__BODY_CHUNK && !cancel_sent) {
            Kvd__ClientRequest cm;
            Kvd__CancelRequest cr = KVD__CANCEL_REQUEST__INIT;
            sv_req_init(&cm, 6);
            cm.body_case = KVD__CLIENT_REQUEST__BODY_CANCEL;
            cm.cancel = &cr;
            cr.has_target = true;
            cr.target = 5;
            sv_send_msg(d, &cm);
            cancel_sent = true;
        } else if (rep->body_case == KVD__SERVER_REPLY__BODY_FINAL) {
            CHECK_INT(rep->final->finish_reason, KVD__FINISH_REASON__FINISH_CANCELLED);
            CHECK(rep->final->n_token_ids < 900);
            final = true;
        } else {
            CHECK(rep->body_case == KVD__SERVER_REPLY__BODY_ACCEPTED ||
                  rep->body_case == KVD__SERVER_REPLY__BODY_CHUNK);
        }
    }
    CHECK(cancel_sent);
    if (!cancel_ok) { /* the Accepted of the cancel may come after the Final */
        Kvd__ServerReply *rep = sv_recv(d, arena, SV_WAIT_MS);
        CHECK(rep != NULL && rep->request_id == 6 &&
              rep->body_case == KVD__SERVER_REPLY__BODY_ACCEPTED);
    }
    zmq_close(d);
    wire_arena_destroy(&arena);
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    kvd_stats_free(&s);
    kvd_client_destroy(&c);
}

/* ---- SIGTERM ----------------------------------------------------------------------------- */

#define DRAIN_SHORT 24  /* tokens of the short request */
#define DRAIN_LEFT 1    /* of them still to come when kvd gets SIGTERM */
#define DRAIN_LONG 1900 /* tokens of the long request (--ctx 2048) */

struct drain_job {
    const struct sv_kvd *k;
    const char *prompt;
    uint32_t max_tokens;
    struct watch w;
    int rc;
    struct kvd_result r;
    double t_end;               /* when the request ended (ms) */
};

static void *drain_client(void *arg)
{
    struct drain_job *j = arg;
    char err[256];
    kvd_client_t *c = kvd_client_new(j->k->ep, SV_WAIT_MS, err, sizeof(err));
    if (c == NULL) {
        j->rc = KVD_ENOMEM;
        return NULL;
    }
    struct kvd_gen_params p = greedy(j->prompt, j->max_tokens, true);
    j->rc = kvd_generate_stream(c, &p, on_chunk, &j->w, &j->r);
    j->t_end = sv_now_ms();
    kvd_client_destroy(&c);
    return NULL;
}

/* Starts the long request, and the short one once the long one streams, so
 * that the short one runs batched with it from its start to its end. */
static void drain_pair(struct drain_job *shortj, struct drain_job *longj, pthread_t *ts,
                       pthread_t *tl)
{
    REQUIRE(pthread_create(tl, NULL, drain_client, longj) == 0);
    double until = sv_now_ms() + SV_WAIT_MS;
    while (!atomic_load(&longj->w.started) && sv_now_ms() < until)
        sv_sleep_ms(5);
    REQUIRE(atomic_load(&longj->w.started));
    REQUIRE(pthread_create(ts, NULL, drain_client, shortj) == 0);
}

/* The time per token (ms) of the short request of the drain while the long
 * one runs with it, on k (no SIGTERM: the long one is cancelled after). */
static double drain_token_ms(struct sv_kvd *k, const char *prompt)
{
    static struct drain_job shortj, longj;
    shortj = (struct drain_job){ .k = k, .prompt = prompt, .max_tokens = DRAIN_SHORT };
    longj = (struct drain_job){ .k = k, .prompt = prompt, .max_tokens = DRAIN_LONG };
    watch_init(&shortj.w, SIZE_MAX, 0, 0, 0);
    watch_init(&longj.w, SIZE_MAX, 0, 0, 0);
    pthread_t ts, tl;
    drain_pair(&shortj, &longj, &ts, &tl);
    pthread_join(ts, NULL);
    atomic_store(&longj.w.stop, 1);
    pthread_join(tl, NULL);
    REQUIRE(shortj.rc == 0 && shortj.r.n_tokens == DRAIN_SHORT);
    CHECK_INT(longj.rc, KVD_ECANCELLED); /* it ran all along */
    double ms = (shortj.t_end - shortj.w.t_first) / (DRAIN_SHORT - 1);
    fprintf(stderr, "drain pace: %.1f ms per token of two requests\n", ms);
    kvd_result_free(&shortj.r);
    kvd_result_free(&longj.r);
    return ms;
}

/* SIGTERM when the short request has DRAIN_LEFT tokens to go and the long one
 * nearly DRAIN_LONG: the short one finishes, the long one is cancelled when
 * the grace period ends. The grace is 60 times the measured time per token of
 * the pair (plus 200 ms for round trips, which do not scale with speed): the
 * short one needs a few of those times, the long one over 1,800, so that each
 * is about ten times away or more. */
static void sigterm_drain(const char *prompt, double token_ms)
{
    uint32_t grace = (uint32_t)(60 * token_ms) + 200;
    char gs[16];
    snprintf(gs, sizeof(gs), "%u", grace);
    struct sv_kvd *k = sv_start((const char *[]){ "--workers", "1", "--worker-timeout",
                                                  SV_WORKER_TIMEOUT, "--step-tokens", "32",
                                                  "--kv-memory", "48MiB", "--ctx", "2048",
                                                  "--grace", gs, NULL });
    static struct drain_job shortj, longj;
    shortj = (struct drain_job){ .k = k, .prompt = prompt, .max_tokens = DRAIN_SHORT };
    longj = (struct drain_job){ .k = k, .prompt = prompt, .max_tokens = DRAIN_LONG };
    watch_init(&shortj.w, DRAIN_SHORT - DRAIN_LEFT, k->pid, SIGTERM, 0);
    watch_init(&longj.w, SIZE_MAX, 0, 0, 0);
    pthread_t ts, tl;
    drain_pair(&shortj, &longj, &ts, &tl);
    double until = sv_now_ms() + SV_WAIT_MS;
    while (!atomic_load(&shortj.w.acted) && sv_now_ms() < until)
        sv_sleep_ms(2);
    REQUIRE(atomic_load(&shortj.w.acted));
    double t_term = shortj.w.t_act;

    /* draining: health says not ok, and new requests are refused */
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);
    bool ok = true;
    until = sv_now_ms() + SV_WAIT_MS;
    while (ok && sv_now_ms() < until)
        if (kvd_health(c, &ok, NULL) != 0)
            break;
    CHECK(!ok);
    struct kvd_gen_params p = greedy(prompt, 4, true);
    struct kvd_result r;
    CHECK_INT(kvd_generate(c, &p, &r), KVD_ESHUTDOWN);
    kvd_result_free(&r);
    kvd_client_destroy(&c);

    pthread_join(ts, NULL);
    pthread_join(tl, NULL);
    int status = sv_wait_exit(k, (int)grace + SV_WAIT_MS);
    double t_exit = sv_now_ms() - t_term;
    fprintf(stderr, "SIGTERM with --grace %u: short request %s (%zu tokens) %.0f ms after it, "
            "long request %s (%zu tokens); kvd exited %d after %.0f ms\n", grace,
            kvd_strerror(shortj.rc), shortj.r.n_tokens, shortj.t_end - t_term,
            kvd_strerror(longj.rc), longj.r.n_tokens, status, t_exit);
    CHECK_INT(shortj.rc, 0);
    CHECK_INT(shortj.r.n_tokens, DRAIN_SHORT);
    CHECK_INT(shortj.r.finish_reason, KVD_FINISH_LENGTH);
    CHECK_INT(longj.rc, KVD_ESHUTDOWN);
    CHECK(longj.w.n_tokens > DRAIN_SHORT - DRAIN_LEFT && longj.w.n_tokens < DRAIN_LONG);
    CHECK(longj.w.contiguous);
    CHECK(longj.t_end - t_term >= grace); /* cancelled when the grace ended, not before */
    CHECK_INT(status, 0);
    CHECK(sv_log_has(k, "blocks in use 0, pending 0"));
    kvd_result_free(&shortj.r);
    kvd_result_free(&longj.r);
}

/* ---- overload ------------------------------------------------------------------------------- */

#define N_FLOOD 8

static void overload(const char *prompt)
{
    struct sv_kvd *k = sv_start((const char *[]){ "--workers", "1", "--max-queue", "2",
                                                  "--max-batch", "1", "--kv-memory", "32MiB",
                                                  "--ctx", "512", "--worker-timeout",
                                                  SV_WORKER_TIMEOUT, NULL });
    wire_arena_t *arena = wire_arena_new(1 << 20);
    void *d = sv_dealer(k);
    for (uint64_t id = 1; id <= N_FLOOD; id++) {
        Kvd__ClientRequest m;
        Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
        Kvd__SamplingParams sp = KVD__SAMPLING_PARAMS__INIT;
        sv_req_init(&m, id);
        m.body_case = KVD__CLIENT_REQUEST__BODY_GENERATE;
        m.generate = &g;
        g.prompt = (char *)prompt;
        g.has_max_tokens = g.has_ignore_eos = true;
        g.max_tokens = 64;
        g.ignore_eos = true;
        sp.has_temperature = true;
        sp.temperature = 0;
        g.sampling = &sp;
        sv_send_msg(d, &m);
    }
    int accepted = 0, overloaded = 0, finals = 0, other = 0;
    bool ended[N_FLOOD + 1] = { false };
    int32_t first[64];
    size_t n_first = 0;
    while (finals + overloaded + other < N_FLOOD) {
        Kvd__ServerReply *r = sv_recv(d, arena, SV_WAIT_MS);
        REQUIRE(r != NULL);
        REQUIRE(r->request_id >= 1 && r->request_id <= N_FLOOD);
        CHECK(!ended[r->request_id]);
        switch (r->body_case) {
        case KVD__SERVER_REPLY__BODY_ACCEPTED:
            accepted++;
            break;
        case KVD__SERVER_REPLY__BODY_ERROR:
            ended[r->request_id] = true;
            if (r->error->code == KVD__ERROR_CODE__ERR_OVERLOADED) {
                overloaded++;
                CHECK(r->error->has_retry_after_ms && r->error->retry_after_ms > 0);
            } else {
                fprintf(stderr, "request %llu: error %d: %s\n",
                        (unsigned long long)r->request_id, r->error->code, r->error->message);
                other++;
            }
            break;
        case KVD__SERVER_REPLY__BODY_FINAL:
            ended[r->request_id] = true;
            finals++;
            CHECK_INT(r->final->n_token_ids, 64);
            if (n_first == 0) {
                n_first = r->final->n_token_ids;
                memcpy(first, r->final->token_ids, n_first * sizeof(int32_t));
            } else {
                CHECK(same(first, n_first, r->final->token_ids, r->final->n_token_ids));
            }
            break;
        default:
            CHECK(!"an unexpected reply");
            other++;
        }
    }
    fprintf(stderr, "flood of %d: %d accepted, %d completed, %d overloaded, %d other\n", N_FLOOD,
            accepted, finals, overloaded, other);
    /* one runs, two wait, the rest are refused */
    CHECK_INT(accepted, 3);
    CHECK_INT(finals, 3);
    CHECK_INT(overloaded, N_FLOOD - 3);
    CHECK_INT(other, 0);

    /* behind a running request (--max-batch 1): a queued request whose
     * deadline passes gets ERR_DEADLINE, and a queued one cancelled ends
     * CANCELLED, both while the running one goes on (it is cancelled after) */
    Kvd__ClientRequest m;
    Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
    sv_req_init(&m, 20);
    m.body_case = KVD__CLIENT_REQUEST__BODY_GENERATE;
    m.generate = &g;
    g.prompt = (char *)prompt;
    g.has_max_tokens = g.has_ignore_eos = true;
    g.max_tokens = 1000; /* until the context (512) is full */
    g.ignore_eos = true;
    sv_send_msg(d, &m);
    m.request_id = 21;
    g.max_tokens = 4;
    g.has_deadline_ms = true;
    g.deadline_ms = 200;
    sv_send_msg(d, &m);
    m.request_id = 22;
    g.has_deadline_ms = false;
    sv_send_msg(d, &m);
    Kvd__CancelRequest cr = KVD__CANCEL_REQUEST__INIT;
    Kvd__ClientRequest cm;
    sv_req_init(&cm, 23);
    cm.body_case = KVD__CLIENT_REQUEST__BODY_CANCEL;
    cm.cancel = &cr;
    cr.has_target = true;
    cr.target = 22;
    sv_send_msg(d, &cm);
    bool deadline_seen = false, cancel_seen = false, final_seen = false, cancel20_sent = false;
    while (!final_seen) {
        Kvd__ServerReply *r = sv_recv(d, arena, SV_WAIT_MS);
        REQUIRE(r != NULL);
        if (r->body_case == KVD__SERVER_REPLY__BODY_ACCEPTED)
            continue;
        if (r->request_id == 21) {
            CHECK_INT(r->body_case, KVD__SERVER_REPLY__BODY_ERROR);
            if (r->body_case == KVD__SERVER_REPLY__BODY_ERROR)
                CHECK_INT(r->error->code, KVD__ERROR_CODE__ERR_DEADLINE);
            deadline_seen = true;
        } else if (r->request_id == 22) {
            CHECK_INT(r->body_case, KVD__SERVER_REPLY__BODY_FINAL);
            if (r->body_case == KVD__SERVER_REPLY__BODY_FINAL) {
                CHECK_INT(r->final->finish_reason, KVD__FINISH_REASON__FINISH_CANCELLED);
                CHECK_INT(r->final->n_token_ids, 0);
            }
            cancel_seen = true;
        } else {
            CHECK_INT(r->request_id, 20);
            CHECK_INT(r->body_case, KVD__SERVER_REPLY__BODY_FINAL);
            if (r->body_case == KVD__SERVER_REPLY__BODY_FINAL)
                CHECK_INT(r->final->finish_reason, KVD__FINISH_REASON__FINISH_CANCELLED);
            CHECK(cancel20_sent);
            final_seen = true;
        }
        if (deadline_seen && cancel_seen && !cancel20_sent) {
            sv_req_init(&cm, 24);
            cm.body_case = KVD__CLIENT_REQUEST__BODY_CANCEL;
            cm.cancel = &cr;
            cr.target = 20;
            sv_send_msg(d, &cm);
            cancel20_sent = true;
        }
    }
    CHECK(deadline_seen && cancel_seen);

    zmq_close(d);
    wire_arena_destroy(&arena);
    struct kvd_stats s;
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    CHECK_INT(s.requests_done, 5);   /* 3 of the flood, 20 and 22 cancelled */
    CHECK_INT(s.requests_failed, 1); /* 21 */
    kvd_stats_free(&s);
    CHECK_INT(sv_stop(k, SV_WAIT_MS), 0);
}

/* ---- a pool too small for the load ----------------------------------------------------------- */

#define N_LOAD 6
#define LOAD_GEN 64

struct load_job {
    const struct sv_kvd *k;
    pthread_barrier_t *start;
    char *prompt;
    int rc;
    struct kvd_result r;
};

static void *load_client(void *arg)
{
    struct load_job *j = arg;
    char err[256];
    kvd_client_t *c = kvd_client_new(j->k->ep, SV_WAIT_MS, err, sizeof(err));
    pthread_barrier_wait(j->start);
    if (c == NULL) {
        j->rc = KVD_ENOMEM;
        return NULL;
    }
    struct kvd_gen_params p = greedy(j->prompt, LOAD_GEN, true);
    p.ns = "load";
    j->rc = kvd_generate(c, &p, &j->r);
    kvd_client_destroy(&c);
    return NULL;
}

static void small_pool(void)
{
    /* 12 MiB: about 33 blocks of 16 tokens (23,040 bytes per token) */
    struct sv_kvd *k = sv_start((const char *[]){ "--workers", "1", "--kv-memory", "12MiB",
                                                  "--ctx", "512", "--worker-timeout",
                                                  SV_WORKER_TIMEOUT, NULL });
    static struct load_job jobs[N_LOAD];
    static struct kvd_result solo[N_LOAD];
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);
    uint32_t max_prompt = 0;
    for (int i = 0; i < N_LOAD; i++) {
        jobs[i].k = k;
        jobs[i].prompt = sv_slice(2000 + (size_t)i * 900, 480);
        struct kvd_gen_params p = greedy(jobs[i].prompt, LOAD_GEN, true);
        p.ns = "solo";
        REQUIRE(kvd_generate(c, &p, &solo[i]) == 0);
        CHECK_INT(solo[i].n_tokens, LOAD_GEN);
        if (solo[i].prompt_tokens > max_prompt)
            max_prompt = solo[i].prompt_tokens;
    }
    kvd_client_destroy(&c);
    struct kvd_stats s;
    sv_stats(k, &s);
    /* a request starts with blocks for its prompt, the next token and a block
     * of room, and ends with blocks for prompt + LOAD_GEN positions */
    uint32_t bt = s.block_tokens;
    uint32_t at_start = (max_prompt + 1 + bt + bt - 1) / bt;
    uint32_t at_end = (max_prompt + LOAD_GEN + bt - 1) / bt;
    bool must_preempt = (s.blocks_total / at_start) * at_end > s.blocks_total;
    fprintf(stderr, "pool of %u blocks; a request takes %u at its start, %u at its end%s\n",
            s.blocks_total, at_start, at_end, must_preempt ? ": preemption needed" : "");
    REQUIRE(s.blocks_total >= at_end);              /* each fits alone */
    REQUIRE(s.blocks_total < N_LOAD * at_end);      /* not all at once */
    uint64_t preempted_before = s.preemptions;
    kvd_stats_free(&s);

    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, N_LOAD + 1);
    pthread_t th[N_LOAD];
    for (int i = 0; i < N_LOAD; i++) {
        jobs[i].start = &start;
        REQUIRE(pthread_create(&th[i], NULL, load_client, &jobs[i]) == 0);
    }
    pthread_barrier_wait(&start);
    double t0 = sv_now_ms();
    for (int i = 0; i < N_LOAD; i++)
        pthread_join(th[i], NULL);
    fprintf(stderr, "%d requests at once: %.0f ms\n", N_LOAD, sv_now_ms() - t0);
    int done = 0;
    for (int i = 0; i < N_LOAD; i++) {
        struct load_job *j = &jobs[i];
        if (j->rc != 0) {
            fprintf(stderr, "request %d: %s: %s\n", i, kvd_strerror(j->rc), j->r.error);
            /* a clear error from kvd, never a timeout or garbage */
            CHECK(j->rc != KVD_ETIMEOUT && j->rc != KVD_EPROTOCOL && j->rc != KVD_EIO);
            continue;
        }
        done++;
        CHECK(same(j->r.tokens, j->r.n_tokens, solo[i].tokens, solo[i].n_tokens));
        if (!same(j->r.tokens, j->r.n_tokens, solo[i].tokens, solo[i].n_tokens)) {
            fprintf(stderr, "request %d differs from its solo run\n", i);
            print_ids("  solo", solo[i].tokens, solo[i].n_tokens);
            print_ids("  under load", j->r.tokens, j->r.n_tokens);
        }
    }
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    sv_print_stats("after the load", &s);
    /* every request fits the pool alone: preemption, never failure */
    CHECK_INT(done, N_LOAD);
    if (must_preempt)
        CHECK(s.preemptions > preempted_before);
    CHECK_INT(s.blocks_in_use, 0);
    CHECK_INT(s.blocks_pending, 0);
    CHECK_INT(s.blocks_free + s.blocks_cached, s.blocks_total);
    kvd_stats_free(&s);
    for (int i = 0; i < N_LOAD; i++) {
        kvd_result_free(&jobs[i].r);
        kvd_result_free(&solo[i]);
        free(jobs[i].prompt);
    }
    CHECK_INT(sv_stop(k, SV_WAIT_MS), 0);
}

int main(void)
{
    REQUIRE(access(KVD_TEST_MODEL, R_OK) == 0);
    char *short_prompt = sv_slice(300, 200), *other_prompt = sv_slice(900, 150);
    char *long_prompt = sv_slice(0, 3500);
    double t0 = sv_now_ms(), t1;

    char stop_timeout[16];
    snprintf(stop_timeout, sizeof(stop_timeout), "%d", STOP_TIMEOUT_MS);
    struct sv_kvd *k = sv_start((const char *[]){ "--workers", "1", "--max-restarts", "5",
                                                  "--worker-timeout", stop_timeout,
                                                  "--step-tokens", "32", "--kv-memory", "48MiB",
                                                  "--ctx", "1024", NULL });
    worker_faults(k, short_prompt);
    fprintf(stderr, "worker faults: %.1f s\n", ((t1 = sv_now_ms()) - t0) / 1e3);
    client_disappears(k, short_prompt);
    fprintf(stderr, "client disappears: %.1f s\n", ((t0 = sv_now_ms()) - t1) / 1e3);
    deadlines_and_cancels(k, short_prompt, long_prompt);
    fprintf(stderr, "deadlines and cancels: %.1f s\n", ((t1 = sv_now_ms()) - t0) / 1e3);
    double drain_ms = drain_token_ms(k, short_prompt);
    CHECK_INT(sv_stop(k, SV_WAIT_MS), 0);
    sigterm_drain(short_prompt, drain_ms);
    fprintf(stderr, "SIGTERM: %.1f s\n", ((t0 = sv_now_ms()) - t1) / 1e3);

    worker_gone(short_prompt);
    fprintf(stderr, "no worker left: %.1f s\n", ((t1 = sv_now_ms()) - t0) / 1e3);
    poison_request(short_prompt, other_prompt);
    fprintf(stderr, "a request whose worker dies every time: %.1f s\n", ((t0 = sv_now_ms()) - t1) / 1e3);
    t1 = t0;
    overload(short_prompt);
    fprintf(stderr, "overload: %.1f s\n", ((t0 = sv_now_ms()) - t1) / 1e3);
    small_pool();
    fprintf(stderr, "small pool: %.1f s\n", (sv_now_ms() - t0) / 1e3);

    free(short_prompt);
    free(other_prompt);
    free(long_prompt);
    sv_pass();
    return CHECK_DONE();
}
