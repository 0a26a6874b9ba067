/*
 * test_gpu_serve.c - kvd --gpu end to end: several workers on one GPU share
 * one device pool, and any of them continues a prefix another one computed.
 *
 * A SmolLM2-shaped synthetic model (30 layers, Q4_1; kvd-mkmodel's writer)
 * is served by `kvd --gpu 0 --workers-per-gpu 2`. Request A (a 600-token
 * prefix and a question) keeps one worker busy, decoding until B is done and
 * cancelled then; request B (the same prefix, another question) arrives
 * meanwhile and so goes to the other worker. B must find the prefix's 37
 * full blocks cached (592 tokens), and its tokens must equal the same
 * request run with the cache bypassed; so must two sampled requests (one
 * chosen on the device, one with top-k off, chosen on the host); both
 * workers must have produced tokens, and (GPU) kvd must have uploaded the
 * weights once for both.
 *
 *   test_gpu_serve            on GPU 0; exits 77 (skip) where none is usable
 *   test_gpu_serve --small    the same on a 2-layer model of head dimension 64,
 *                             with patient worker timeouts: for the CPU
 *                             emulation of CUDA (ctest emu.gpu_serve)
 *   test_gpu_serve --cpu      the same scenario over two CPU workers (checks
 *                             this program itself where there is no GPU)
 *   test_gpu_serve --gemma    the same on a small gemma3 model (6 layers, five
 *                             in a window of 64, head dimension 256, Q5_0): a
 *                             pool in 6 parts, whose windowed blocks slide
 *                             while A and B run; for the emulation
 *                             (ctest emu.gpu_serve_gemma)
 *   test_gpu_serve --tiers    kvd --gpu on the small model over a device pool
 *                             too small for its 6 prompts, with --host-cache
 *                             and --cache-dir: every prompt comes back from the
 *                             host tier (through host memory into device
 *                             blocks), and after a restart from disk, with its
 *                             first run's tokens (ctest emu.gpu_tiers, gpu.tiers)
 *   ... --kv-type T           the pool's KV type (default f16): ctest
 *                             gpu.serve_q4 and emu.gpu_serve_q4 run the
 *                             scenario over a q4_0 pool (rotated)
 *   test_gpu_serve --bench    aggregate output tokens/s of 32 concurrent
 *                             requests with 1, 2 and 4 workers on GPU 0
 *   test_gpu_serve --window   context windowing on GPU workers: kvd --gpu 0
 *                             with --ctx 128 on the small model; a greedy
 *                             request with context_overflow window generates
 *                             200 tokens past a 40-token prompt (three
 *                             windows: device block copies and the keys'
 *                             turn, worker/worker.c on_window), its tokens up
 *                             to the context equal the same request's with
 *                             context_overflow stop (which ends there), and
 *                             it gives the same 200 tokens again with its
 *                             prompt cached and with the cache bypassed
 *                             (ctest emu.gpu_window, gpu.window; with --cpu
 *                             the same over CPU workers)
 *   test_gpu_serve --fault    (the emulation only: it injects the fault) a
 *                             kernel of one worker faults mid-request, as an
 *                             illegal address does: that request fails with
 *                             the device's error, the worker exits and kvd
 *                             restarts it, no block is lost, and requests on
 *                             both workers then run as without the fault;
 *                             then a worker SIGKILLed mid-request: the
 *                             request resumes on the other one with the
 *                             tokens of the uncached run (ctest emu.gpu_fault)
 */
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "err.h"
#include "kcuda.h"
#include "kvd_client.h"
#include "mkmodel.h"
#include "types.h"

#define PREFIX 600
#define QUESTION 8
/* The longest wait for one thing (a reply, the workers, an exit): a bound on a
 * hang, never a measure of speed. */
#define WAIT_MS 300000
/* --worker-timeout: minutes, so that no step of a slow machine (the C kernels
 * of --cpu, the emulation of --small) makes a live worker look dead. */
#define WORKER_TIMEOUT "300000"

static bool cpu_mode, small_model, gemma_model, tiers_mode;
static const char *ctx_arg = "2048";   /* kvd's --ctx (--window: 128) */
static const char *max_restarts = "0";
static const char *kv_type = "f16";    /* --kv-type T: kvd's pool type */
static const char *tier_args[8];       /* --tiers: kvd's pool size and tiers */
static char dir[64] = "/tmp/kvd-gpu-serve-XXXXXX";
static char model_path[128], ep[160];

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void write_model(void)
{
    struct mkmodel_params p = mkmodel_default_params();
    p.n_layer = small_model ? 2 : 30;
    p.n_embd = small_model ? 128 : 576;
    p.n_head = small_model ? 2 : 9;
    p.n_head_kv = small_model ? 1 : 3;
    p.n_ff = small_model ? 256 : 1536;
    p.n_vocab = 8192;
    p.n_ctx = 2048;
    p.wtype = KERN_Q4_1;
    p.embd_type = KERN_Q8_0;
    p.tied = true;
    p.seed = 7;
    if (gemma_model) {
        p.gemma3 = true;
        p.n_layer = 6;          /* layers 0-4 windowed, 5 full: 6 parts of one layer */
        p.n_embd = 128;
        p.n_head = 2;
        p.n_head_kv = 1;
        p.head_dim = 256;
        p.n_ff = 256;
        p.swa_window = 64;
        p.wtype = KERN_Q5_0;
    }
    snprintf(model_path, sizeof(model_path), "%s/%s.gguf", dir, gemma_model ? "gemma3-shape" : "smollm2-shape");
    char err[256];
    int rc = mkmodel_write(&p, model_path, err, sizeof(err));
    if (rc != 0)
        fprintf(stderr, "mkmodel: %s\n", err);
    REQUIRE(rc == 0);
}

/* Starts kvd with `workers` workers; returns its pid once they are all up. */
static pid_t start_kvd(int workers, const char *log)
{
    char n[16];
    snprintf(n, sizeof(n), "%d", workers);
    snprintf(ep, sizeof(ep), "ipc://%s/kvd.sock", dir);
    char bin[512];
    snprintf(bin, sizeof(bin), "%s/kvd", KVD_BIN_DIR);
    fflush(NULL);
    pid_t parent = getpid();
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test (its alarm, a failure) */
        if (getppid() != parent)
            _exit(1);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0)
            _exit(126);
        dup2(fd, 1);
        dup2(fd, 2);
        if (cpu_mode)
            execl(bin, bin, "--model", model_path, "--listen", ep, "--workers", n, "--kv-memory", "48MiB",
                  "--ctx", ctx_arg, "--max-restarts", "0", "--worker-timeout", WORKER_TIMEOUT, "--kv-type", kv_type,
                  (char *)NULL);
        else if (small_model) { /* the emulation: steps take seconds */
            const char *args[40] = { bin, "--model", model_path, "--listen", ep, "--gpu", "0", "--workers-per-gpu", n,
                                     "--ctx", ctx_arg, "--max-restarts", max_restarts, "--worker-timeout",
                                     WORKER_TIMEOUT, "--kv-type", kv_type, "--kv-memory", "64MiB" };
            int a = 19;
            for (int i = 0; i < 8 && tier_args[i] != NULL; i++)
                args[a++] = tier_args[i];   /* a second --kv-memory wins */
            args[a] = NULL;
            execv(bin, (char *const *)args);
        }
        else
            execl(bin, bin, "--model", model_path, "--listen", ep, "--gpu", "0", "--workers-per-gpu", n,
                  "--kv-memory", "1GiB", "--ctx", ctx_arg, "--max-restarts", "0", "--worker-timeout",
                  WORKER_TIMEOUT, "--kv-type", kv_type, (char *)NULL);
        _exit(127);
    }
    char err[256];
    kvd_client_t *c = kvd_client_new(ep, 500, err, sizeof(err));
    REQUIRE(c != NULL);
    bool ok = false;
    uint32_t alive = 0;
    for (double until = now_ms() + WAIT_MS; now_ms() < until;) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            fprintf(stderr, "kvd exited during start-up (status %d); its log: %s\n", st, log);
            REQUIRE(0);
        }
        if (kvd_health(c, &ok, &alive) == 0 && ok && alive >= (uint32_t)workers)
            break;
        ok = false;
        usleep(50000);
    }
    kvd_client_destroy(&c);
    if (!ok)
        fprintf(stderr, "kvd's workers did not come up; its log: %s\n", log);
    REQUIRE(ok);
    return pid;
}

static int stop_kvd(pid_t pid)
{
    kill(pid, SIGTERM);
    int st = 0;
    for (double until = now_ms() + WAIT_MS; now_ms() < until;) {
        if (waitpid(pid, &st, WNOHANG) == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        usleep(100000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    return -1;
}

static void prompt_ids(int32_t *ids, int question)
{
    for (int i = 0; i < PREFIX; i++)
        ids[i] = 3 + (int32_t)(((uint32_t)i * 7919u + 13u) % 8000u);
    for (int i = 0; i < QUESTION; i++)
        ids[PREFIX + i] = 3 + (int32_t)(((uint32_t)(question * 101 + i) * 104729u) % 8000u);
}

static struct kvd_gen_params greedy(const int32_t *ids, size_t n, uint32_t max_tokens)
{
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.token_ids = ids;
    p.n_token_ids = n;
    p.max_tokens = max_tokens;
    p.temperature = 0;
    p.ignore_eos = true;
    return p;
}

/* ---- context windowing ------------------------------------------------------------------ */

#define WIN_PROMPT 40
#define WIN_TOKENS 200

/* A windowed greedy request (or, stop, one that ends at the context) of the
 * window prompt; its result in *r. */
static int window_request(kvd_client_t *c, bool stop, bool no_cache, struct kvd_result *r)
{
    static int32_t ids[WIN_PROMPT];
    for (int i = 0; i < WIN_PROMPT; i++)
        ids[i] = 3 + (int32_t)(((uint32_t)i * 6007u + 29u) % 8000u);
    struct kvd_gen_params p = greedy(ids, WIN_PROMPT, WIN_TOKENS);
    p.context_overflow = stop ? KVD_OVERFLOW_STOP : KVD_OVERFLOW_WINDOW;
    p.no_cache = no_cache;
    const int rc = kvd_generate(c, &p, r);
    if (rc != 0)
        fprintf(stderr, "window request: %s (%s)\n", kvd_strerror(rc), r->error);
    return rc;
}

static void test_window(void)
{
    char log[128], err[256];
    snprintf(log, sizeof(log), "%s/kvd.log", dir);
    pid_t pid = start_kvd(1, log);
    kvd_client_t *c = kvd_client_new(ep, WAIT_MS, err, sizeof(err));
    REQUIRE(c != NULL);
    struct kvd_result w1, st, w2, w3;
    CHECK_INT(window_request(c, false, false, &w1), 0);
    CHECK_INT(window_request(c, true, false, &st), 0);
    CHECK_INT(window_request(c, false, false, &w2), 0);
    CHECK_INT(window_request(c, false, true, &w3), 0);
    /* past the context of 128 only by windows; stop ends at it */
    CHECK_INT(w1.n_tokens, WIN_TOKENS);
    CHECK_INT(w1.finish_reason, KVD_FINISH_LENGTH);
    CHECK(st.n_tokens > 0 && st.n_tokens < 128 - WIN_PROMPT + 1);
    CHECK_INT(st.finish_reason, KVD_FINISH_LENGTH);
    const bool head = st.n_tokens <= w1.n_tokens &&
                      memcmp(st.tokens, w1.tokens, st.n_tokens * sizeof(int32_t)) == 0;
    CHECK(head);
    const bool again = w2.n_tokens == w1.n_tokens && memcmp(w2.tokens, w1.tokens, w1.n_tokens * sizeof(int32_t)) == 0;
    const bool fresh = w3.n_tokens == w1.n_tokens && memcmp(w3.tokens, w1.tokens, w1.n_tokens * sizeof(int32_t)) == 0;
    CHECK(again);
    CHECK(fresh);
    printf("serve window: %s workers, --ctx %s, prompt %d: windowed %zu tokens (finish %d); stop %zu tokens, "
           "%s the windowed run's first ones; again with %u prompt tokens cached: %s; without the cache: %s\n",
           cpu_mode ? "CPU" : "GPU", ctx_arg, WIN_PROMPT, w1.n_tokens, w1.finish_reason, st.n_tokens,
           head ? "equal to" : "DIFFERENT from", w2.cached_prompt_tokens, again ? "the same tokens" : "DIFFERENT",
           fresh ? "the same tokens" : "DIFFERENT");
    kvd_result_free(&w1);
    kvd_result_free(&st);
    kvd_result_free(&w2);
    kvd_result_free(&w3);
    kvd_client_destroy(&c);
    CHECK_INT(stop_kvd(pid), 0);
}

/* ---- request A, streamed in a thread ---------------------------------------------------- */

/* A's max_tokens: never reached, A is cancelled once B is done */
#define A_MAX 1024

struct job_a {
    atomic_bool started;        /* a chunk came */
    atomic_bool stop;           /* set when B is done: cancel at the next chunk */
    int rc;
    struct kvd_result r;
};

static int on_chunk_a(void *user, const char *text, size_t len, const int32_t *tokens, size_t n, uint32_t seq)
{
    (void)text; (void)len; (void)tokens; (void)n; (void)seq;
    struct job_a *j = user;
    atomic_store(&j->started, true);
    return atomic_load(&j->stop) ? 1 : 0;
}

static void *run_a(void *arg)
{
    struct job_a *j = arg;
    static int32_t ids[PREFIX + QUESTION];
    prompt_ids(ids, 1);
    char err[256];
    kvd_client_t *c = kvd_client_new(ep, WAIT_MS, err, sizeof(err));
    if (c == NULL) {
        j->rc = KVD_ENOMEM;
        return NULL;
    }
    struct kvd_gen_params p = greedy(ids, PREFIX + QUESTION, A_MAX);
    j->rc = kvd_generate_stream(c, &p, on_chunk_a, j, &j->r);
    kvd_client_destroy(&c);
    return NULL;
}

static void test_shared_prefix(void)
{
    char log[128];
    snprintf(log, sizeof(log), "%s/kvd.log", dir);
    pid_t pid = start_kvd(2, log);
    static struct job_a a;
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, run_a, &a) == 0);
    for (double until = now_ms() + WAIT_MS; !atomic_load(&a.started) && now_ms() < until;)
        usleep(2000);
    CHECK(atomic_load(&a.started));

    /* B while A decodes: the less loaded worker takes it */
    char err[256];
    kvd_client_t *c = kvd_client_new(ep, WAIT_MS, err, sizeof(err));
    REQUIRE(c != NULL);
    static int32_t ids[PREFIX + QUESTION];
    prompt_ids(ids, 2);
    struct kvd_gen_params p = greedy(ids, PREFIX + QUESTION, 24);
    struct kvd_result b, fresh;
    int rc = kvd_generate(c, &p, &b);
    CHECK_INT(rc, 0);
    atomic_store(&a.stop, true);
    pthread_join(t, NULL);
    if (a.rc != KVD_ECANCELLED)
        fprintf(stderr, "request A: %s (%s)\n", kvd_strerror(a.rc), a.r.error);
    /* A was still decoding when B was done: B ran beside it, whatever the speed */
    CHECK_INT(a.rc, KVD_ECANCELLED);
    CHECK(a.r.n_tokens > 0 && a.r.n_tokens < A_MAX);
    p.no_cache = true;
    int rc2 = kvd_generate(c, &p, &fresh);
    CHECK_INT(rc2, 0);
    printf("serve: A %zu tokens; B %zu tokens, %u of %u prompt tokens cached; B without the cache %zu tokens, %u cached\n",
           a.r.n_tokens, b.n_tokens, b.cached_prompt_tokens, b.prompt_tokens, fresh.n_tokens,
           fresh.cached_prompt_tokens);
    CHECK(b.cached_prompt_tokens >= PREFIX / 16 * 16);
    CHECK_INT(fresh.cached_prompt_tokens, 0);
    CHECK_INT(b.n_tokens, 24);
    CHECK(rc == 0 && rc2 == 0 && b.n_tokens == fresh.n_tokens &&
          memcmp(b.tokens, fresh.tokens, b.n_tokens * sizeof(int32_t)) == 0);
    /* sampled requests (tokens chosen on the device: top-k 40; and on the
     * host: top-k off over this 8192-token vocabulary) continue the cached
     * prefix exactly as they run without it: each draw depends only on the
     * request's seed, its position and the logits' bits */
    for (int v = 0; v < 2; v++) {
        struct kvd_gen_params sp = greedy(ids, PREFIX + QUESTION, 24);
        sp.temperature = 0.9f;
        sp.top_k = v == 0 ? 40 : 0;
        sp.top_p = 0.95f;
        sp.min_p = 0.02f;
        sp.repeat_penalty = 1.15f;
        sp.seed = 4242 + v;
        struct kvd_result cached, bypass;
        CHECK_INT(kvd_generate(c, &sp, &cached), 0);
        sp.no_cache = true;
        CHECK_INT(kvd_generate(c, &sp, &bypass), 0);
        printf("serve: sampled (top-k %d): %zu tokens, %u cached; without the cache %zu tokens; %s\n", sp.top_k,
               cached.n_tokens, cached.cached_prompt_tokens, bypass.n_tokens,
               cached.n_tokens == bypass.n_tokens &&
                       memcmp(cached.tokens, bypass.tokens, cached.n_tokens * sizeof(int32_t)) == 0
                   ? "equal"
                   : "DIFFERENT");
        CHECK(cached.cached_prompt_tokens >= PREFIX / 16 * 16);
        CHECK(cached.n_tokens == 24 && bypass.n_tokens == 24 &&
              memcmp(cached.tokens, bypass.tokens, 24 * sizeof(int32_t)) == 0);
        /* and a sampled run is not the greedy one */
        CHECK(memcmp(cached.tokens, b.tokens, 24 * sizeof(int32_t)) != 0);
        kvd_result_free(&cached);
        kvd_result_free(&bypass);
    }
    /* logprobs: the step's logits come to the host, where the tokens are then
     * chosen: the same greedy tokens as B, each the likeliest of its row */
    {
        struct kvd_gen_params lp = greedy(ids, PREFIX + QUESTION, 24);
        lp.logprobs = 5;
        struct kvd_result with;
        CHECK_INT(kvd_generate(c, &lp, &with), 0);
        CHECK(with.n_tokens == b.n_tokens && memcmp(with.tokens, b.tokens, b.n_tokens * sizeof(int32_t)) == 0);
        CHECK_INT(with.n_logprobs, with.n_tokens);
        int off = 0;
        for (size_t i = 0; i < with.n_logprobs && i < with.n_tokens; i++) {
            const struct kvd_logprob *l = &with.logprobs[i];
            double mass = 0;
            for (uint32_t j = 0; j < l->n_top; j++)
                mass += exp(l->top_logprobs[j]);
            off += !(l->n_top == 5 && l->top_ids[0] == with.tokens[i] && l->top_logprobs[0] == l->logprob &&
                     l->logprob <= 0 && mass <= 1.0 + 1e-5);
        }
        printf("serve: logprobs of %zu tokens, %d not the likeliest or not a distribution\n", with.n_logprobs, off);
        CHECK_INT(off, 0);
        kvd_result_free(&with);
    }
    /* idle: A's cancel may be confirmed after the client gave up waiting */
    struct kvd_stats s = { 0 };
    for (double until = now_ms() + WAIT_MS; now_ms() < until; usleep(50000)) {
        kvd_stats_free(&s);
        CHECK_INT(kvd_stats(c, &s), 0);
        if (s.requests_running == 0 && s.blocks_in_use == 0)
            break;
    }
    CHECK_INT(s.n_workers, 2);
    printf("serve: pool of %s, %llu bytes per token, %u part(s)\n", s.kv_type,
           (unsigned long long)s.kv_bytes_per_token, s.kv_parts);
    CHECK_INT(s.kv_parts, gemma_model ? 6 : 1);
    char want[32];
    snprintf(want, sizeof(want), "K %s, V %s", kv_type, kv_type);
    CHECK(strncmp(s.kv_type, want, strlen(want)) == 0);
    for (uint32_t i = 0; i < s.n_workers; i++)
        printf("serve: worker %u: %llu tokens\n", s.workers[i].id, (unsigned long long)s.workers[i].tokens);
    CHECK(s.n_workers == 2 && s.workers[0].tokens > 0 && s.workers[1].tokens > 0);
    CHECK_INT(s.blocks_in_use, 0);
    kvd_stats_free(&s);
    kvd_result_free(&b);
    kvd_result_free(&fresh);
    kvd_result_free(&a.r);
    kvd_client_destroy(&c);
    CHECK_INT(stop_kvd(pid), 0);
    if (!cpu_mode) {
        /* the weights went up once, into memory both workers mapped */
        char text[16384] = "";
        FILE *f = fopen(log, "r");
        if (f != NULL) {
            text[fread(text, 1, sizeof(text) - 1, f)] = '\0';
            fclose(f);
        }
        CHECK(strstr(text, "of weights (one copy for all its workers)") != NULL);
    }
    if (check_failures)
        fprintf(stderr, "kvd's log: %s\n", log);
    else
        unlink(log);
}

/* ---- --fault: a device fault in one worker -------------------------------------------- */

struct job_g {
    int32_t ids[48];
    int rc;
    struct kvd_result r;
};

static void *run_g(void *arg)
{
    struct job_g *j = arg;
    char err[256];
    kvd_client_t *c = kvd_client_new(ep, WAIT_MS, err, sizeof(err));
    if (c == NULL) {
        j->rc = KVD_ENOMEM;
        return NULL;
    }
    struct kvd_gen_params p = greedy(j->ids, 48, 16);
    j->rc = kvd_generate(c, &p, &j->r);
    kvd_client_destroy(&c);
    return NULL;
}

static void short_prompt(int32_t *ids, int which)
{
    for (int i = 0; i < 48; i++)
        ids[i] = 3 + (int32_t)(((uint32_t)(which * 977 + i) * 7919u + 5u) % 8000u);
}

/* Kills the worker serving the request when chunk `at` arrives. */
struct kill_at {
    int32_t ids[48];
    uint32_t at;
    pid_t victim;
};

static int on_chunk_kill(void *user, const char *text, size_t len, const int32_t *tokens, size_t n, uint32_t seq)
{
    struct kill_at *k = user;
    (void)text; (void)len; (void)tokens; (void)n;
    if (seq != k->at)
        return 0;
    char err[256];
    kvd_client_t *c = kvd_client_new(ep, WAIT_MS, err, sizeof(err));
    struct kvd_stats s;
    if (c != NULL && kvd_stats(c, &s) == 0) {
        for (uint32_t i = 0; i < s.n_workers; i++)
            if (s.workers[i].alive && s.workers[i].running > 0)
                k->victim = s.workers[i].pid;
        kvd_stats_free(&s);
    }
    kvd_client_destroy(&c);
    if (k->victim > 0)
        kill(k->victim, SIGKILL);
    return 0;
}

/* --tiers: kvd --gpu over a device pool too small for the prompts it serves,
 * with the host tier and the disk tier below it: every prompt the pool evicted
 * comes back from the host tier (copied through host memory into device
 * blocks), and after a restart from disk, with the tokens of its first run. */
#define TIER_PROMPTS 6
static void tier_prompt(int32_t *ids, int i)
{
    for (int j = 0; j < 170; j++)
        ids[j] = 3 + (int32_t)(((uint32_t)(i * 1000 + j) * 2654435761u) % 8000u);
}

static int tier_round(const char *what, struct kvd_result *out, const struct kvd_result *ref)
{
    char err[256];
    kvd_client_t *c = kvd_client_new(ep, WAIT_MS, err, sizeof(err));
    REQUIRE(c != NULL);
    uint32_t host = 0, disk = 0;
    int same = 0;
    for (int i = 0; i < TIER_PROMPTS; i++) {
        int32_t ids[170];
        tier_prompt(ids, i);
        struct kvd_gen_params p = greedy(ids, 170, 12);
        struct kvd_result r;
        CHECK_INT(kvd_generate(c, &p, &r), 0);
        host += r.host_cached_prompt_tokens;
        disk += r.disk_cached_prompt_tokens;
        if (ref == NULL) {
            CHECK_INT(r.cached_prompt_tokens, 0);
            out[i] = r;
            continue;
        }
        CHECK_INT(r.cached_prompt_tokens, 160);
        same += r.n_tokens == ref[i].n_tokens && memcmp(r.tokens, ref[i].tokens, r.n_tokens * sizeof(int32_t)) == 0;
        kvd_result_free(&r);
    }
    struct kvd_stats s;
    CHECK_INT(kvd_stats(c, &s), 0);
    for (double until = now_ms() + WAIT_MS; s.disk_cache_pending > 0 && now_ms() < until; usleep(20000)) {
        kvd_stats_free(&s);
        CHECK_INT(kvd_stats(c, &s), 0);
    }
    printf("tiers (%s): %u prompt tokens from the host tier, %u from disk; %d of %d outputs as the first run's; "
           "%llu evictions, %llu blocks on disk\n", what, host, disk, ref ? same : 0, ref ? TIER_PROMPTS : 0,
           (unsigned long long)s.evictions, (unsigned long long)s.disk_cache_blocks);
    kvd_stats_free(&s);
    kvd_client_destroy(&c);
    if (ref != NULL)
        CHECK_INT(same, TIER_PROMPTS);
    return (int)(strcmp(what, "restarted") == 0 ? disk : host);
}

static void test_tiers(void)
{
    char log[128], cache[128];
    snprintf(log, sizeof(log), "%s/kvd.log", dir);
    snprintf(cache, sizeof(cache), "%s/cache", dir);
    /* 2-layer blocks of 8 KiB: a 320 KiB pool holds about 3 of the 11-block prompts */
    const char *args[] = { "--kv-memory", "320KiB", "--host-cache", "64MiB", "--cache-dir", cache, NULL };
    memcpy(tier_args, args, sizeof(args));
    static struct kvd_result first[TIER_PROMPTS];
    pid_t pid = start_kvd(1, log);
    tier_round("first", first, NULL);
    CHECK(tier_round("again", NULL, first) > 0);
    CHECK_INT(stop_kvd(pid), 0);
    pid = start_kvd(1, log);
    CHECK(tier_round("restarted", NULL, first) > 0);
    CHECK_INT(stop_kvd(pid), 0);
    for (int i = 0; i < TIER_PROMPTS; i++)
        kvd_result_free(&first[i]);
    memset(tier_args, 0, sizeof(tier_args));
}

static void test_fault(void)
{
    char log[128], fault[128];
    snprintf(log, sizeof(log), "%s/kvd.log", dir);
    snprintf(fault, sizeof(fault), "%s/fault", dir);
    int fd = open(fault, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    REQUIRE(fd >= 0);
    close(fd);
    /* the worker that runs its 120th kernel first faults there: a 2-layer step
     * is ~25 kernels, so that is a few decode steps into the first request */
    setenv("EMU_FAULT_FILE", fault, 1);
    setenv("EMU_FAULT_LAUNCH", "120", 1);
    max_restarts = "1";
    pid_t pid = start_kvd(2, log);
    char err[256];
    kvd_client_t *c = kvd_client_new(ep, WAIT_MS, err, sizeof(err));
    REQUIRE(c != NULL);

    struct job_g f = { .rc = 0 };
    short_prompt(f.ids, 0);
    struct kvd_gen_params p = greedy(f.ids, 48, 32);
    f.rc = kvd_generate(c, &p, &f.r);
    printf("fault: the request on the faulting worker: %s (%s)\n", kvd_strerror(f.rc), f.r.error);
    CHECK(f.rc != 0);
    CHECK(strstr(f.r.error, "illegal memory access") != NULL);
    CHECK(access(fault, F_OK) != 0);    /* the fault did happen */

    /* kvd restarts the worker that exited */
    struct kvd_stats s;
    uint32_t restarts = 0, alive = 0;
    for (double until = now_ms() + WAIT_MS; now_ms() < until; usleep(100000)) {
        if (kvd_stats(c, &s) != 0)
            continue;
        restarts = alive = 0;
        for (uint32_t i = 0; i < s.n_workers; i++) {
            restarts += s.workers[i].restarts;
            alive += s.workers[i].alive;
        }
        kvd_stats_free(&s);
        if (restarts >= 1 && alive == 2)
            break;
    }
    printf("fault: workers alive %u, restarts %u\n", alive, restarts);
    CHECK_INT(restarts, 1);
    CHECK_INT(alive, 2);

    /* two requests at once (one on each worker), then each again without the
     * cache: all succeed, and equal */
    static struct job_g g[2];
    pthread_t t[2];
    for (int i = 0; i < 2; i++) {
        short_prompt(g[i].ids, 1 + i);
        REQUIRE(pthread_create(&t[i], NULL, run_g, &g[i]) == 0);
    }
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    for (int i = 0; i < 2; i++) {
        if (g[i].rc != 0)
            fprintf(stderr, "request %d after the fault: %s (%s)\n", i, kvd_strerror(g[i].rc), g[i].r.error);
        CHECK_INT(g[i].rc, 0);
        struct kvd_gen_params q = greedy(g[i].ids, 48, 16);
        q.no_cache = true;
        struct kvd_result fresh;
        CHECK_INT(kvd_generate(c, &q, &fresh), 0);
        CHECK(g[i].rc == 0 && g[i].r.n_tokens == 16 && fresh.n_tokens == 16 &&
              memcmp(g[i].r.tokens, fresh.tokens, 16 * sizeof(int32_t)) == 0);
        kvd_result_free(&fresh);
        kvd_result_free(&g[i].r);
    }
    /* the first request again: its prefix blocks were committed before the
     * fault, or freed with the dead worker; either way the answer is right */
    struct kvd_result again, fresh;
    CHECK_INT(kvd_generate(c, &p, &again), 0);
    p.no_cache = true;
    CHECK_INT(kvd_generate(c, &p, &fresh), 0);
    CHECK(again.n_tokens == 32 && fresh.n_tokens == 32 &&
          memcmp(again.tokens, fresh.tokens, 32 * sizeof(int32_t)) == 0);
    CHECK_INT(kvd_stats(c, &s), 0);
    printf("fault: afterwards %llu requests done, %llu failed; blocks in use %u, pending %u\n",
           (unsigned long long)s.requests_done, (unsigned long long)s.requests_failed, s.blocks_in_use,
           s.blocks_pending);
    CHECK_INT(s.requests_failed, 1);
    CHECK_INT(s.blocks_in_use, 0);
    CHECK_INT(s.blocks_pending, 0);
    CHECK(s.workers[0].tokens > 0 && s.workers[1].tokens > 0);
    kvd_stats_free(&s);
    kvd_result_free(&again);
    kvd_result_free(&fresh);

    /* a GPU worker SIGKILLed mid-request: the request resumes on the other
     * one from the shared device pool and returns what the uncached run does */
    struct kill_at k = { .at = 3 };
    short_prompt(k.ids, 9);
    struct kvd_gen_params kp = greedy(k.ids, 48, 32);
    kp.no_cache = true;
    struct kvd_result ref, killed;
    CHECK_INT(kvd_generate(c, &kp, &ref), 0);
    kp.no_cache = false;
    CHECK_INT(kvd_generate_stream(c, &kp, on_chunk_kill, &k, &killed), 0);
    printf("fault: a worker killed at chunk %u (pid %d): %zu tokens, %s the uncached run\n", k.at, (int)k.victim,
           killed.n_tokens,
           killed.n_tokens == ref.n_tokens && memcmp(killed.tokens, ref.tokens, ref.n_tokens * sizeof(int32_t)) == 0
               ? "equal to"
               : "DIFFERENT from");
    CHECK(k.victim > 0);
    CHECK(killed.n_tokens == 32 && ref.n_tokens == 32 &&
          memcmp(killed.tokens, ref.tokens, 32 * sizeof(int32_t)) == 0);
    CHECK_INT(kvd_stats(c, &s), 0);
    CHECK_INT(s.blocks_in_use, 0);
    kvd_stats_free(&s);
    kvd_result_free(&ref);
    kvd_result_free(&killed);

    kvd_result_free(&f.r);
    kvd_client_destroy(&c);
    CHECK_INT(stop_kvd(pid), 0);
    unsetenv("EMU_FAULT_FILE");
    if (check_failures)
        fprintf(stderr, "kvd's log: %s\n", log);
    else
        unlink(log);
}

/* ---- --bench: tokens/s with 1, 2 and 4 workers ------------------------------------------- */

#define BENCH_CLIENTS 32
#define BENCH_PROMPT 128
#define BENCH_OUT 64

struct bench_job {
    int i;
    int rc;
    size_t tokens;
};

static void *bench_client(void *arg)
{
    struct bench_job *j = arg;
    int32_t ids[BENCH_PROMPT];
    for (int k = 0; k < BENCH_PROMPT; k++)  /* distinct prompts: no shared prefix */
        ids[k] = 3 + (int32_t)(((uint32_t)(j->i * 7 + 1) * 2654435761u + (uint32_t)k * 40503u) % 8000u);
    char err[256];
    kvd_client_t *c = kvd_client_new(ep, WAIT_MS, err, sizeof(err));
    if (c == NULL) {
        j->rc = KVD_ENOMEM;
        return NULL;
    }
    struct kvd_gen_params p = greedy(ids, BENCH_PROMPT, BENCH_OUT);
    struct kvd_result r;
    j->rc = kvd_generate(c, &p, &r);
    j->tokens = j->rc == 0 ? r.n_tokens : 0;
    if (j->rc == 0)
        kvd_result_free(&r);
    kvd_client_destroy(&c);
    return NULL;
}

static void bench(void)
{
    const int counts[3] = { 1, 2, 4 };
    double rate[3];
    for (int w = 0; w < 3; w++) {
        char log[128];
        snprintf(log, sizeof(log), "%s/kvd-bench-%d.log", dir, counts[w]);
        pid_t pid = start_kvd(counts[w], log);
        pthread_t th[BENCH_CLIENTS];
        struct bench_job jobs[BENCH_CLIENTS];
        const double t0 = now_ms();
        for (int i = 0; i < BENCH_CLIENTS; i++) {
            jobs[i] = (struct bench_job){ .i = i };
            REQUIRE(pthread_create(&th[i], NULL, bench_client, &jobs[i]) == 0);
        }
        size_t total = 0;
        for (int i = 0; i < BENCH_CLIENTS; i++) {
            pthread_join(th[i], NULL);
            CHECK_INT(jobs[i].rc, 0);
            total += jobs[i].tokens;
        }
        const double ms = now_ms() - t0;
        rate[w] = (double)total / (ms / 1e3);
        printf("serve bench: %d worker%s on one GPU: %zu output tokens of %d requests in %.0f ms: %.0f tok/s\n",
               counts[w], counts[w] > 1 ? "s" : "", total, BENCH_CLIENTS, ms, rate[w]);
        CHECK_INT(stop_kvd(pid), 0);
    }
    printf("serve bench: 2 workers / 1: %.2fx, 4 workers / 1: %.2fx\n", rate[1] / rate[0], rate[2] / rate[0]);
}

int main(int argc, char **argv)
{
    bool fault_mode = false, bench_mode = false, window_mode = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--kv-type") == 0 && i + 1 < argc)
            kv_type = argv[++i];    /* e.g. q4_0: the pool's blocks quantized (and rotated) */
        else if (strcmp(argv[i], "--cpu") == 0)
            cpu_mode = true;
        else if (strcmp(argv[i], "--fault") == 0)
            fault_mode = small_model = true;
        else if (strcmp(argv[i], "--small") == 0)
            small_model = true;
        else if (strcmp(argv[i], "--gemma") == 0)
            gemma_model = small_model = true;
        else if (strcmp(argv[i], "--tiers") == 0)
            tiers_mode = small_model = true;
        else if (strcmp(argv[i], "--window") == 0)
            window_mode = small_model = true;
        else if (strcmp(argv[i], "--bench") == 0)
            bench_mode = true;
        else {
            fprintf(stderr, "usage: test_gpu_serve [--cpu | --small | --gemma | --tiers | --window | --bench | --fault] "
                    "[--kv-type T]\n");
            return 2;
        }
    }
#ifndef KVD_CUDA_EMU_BUILD
    if (fault_mode) {
        printf("skip: --fault needs the emulation, which injects the fault\n");
        return KVD_TEST_SKIP;
    }
#endif
    if (!cpu_mode) {
        char why[256];
        if (kcuda_device_count(why, sizeof(why)) == 0) {
            printf("skip: %s\n", why);
            return KVD_TEST_SKIP;
        }
    }
    /* a bound on a hang, just under ctest's TIMEOUT (the emulation and the C
     * kernels of --cpu on a busy machine take many minutes) */
    alarm(small_model || cpu_mode ? 3500 : 1700);
    REQUIRE(mkdtemp(dir) != NULL);
    write_model();
    if (bench_mode)
        bench();
    else if (fault_mode)
        test_fault();
    else if (tiers_mode)
        test_tiers();
    else if (window_mode) {
        ctx_arg = "128";
        test_window();
    }
    else
        test_shared_prefix();
    unlink(model_path);
    rmdir(dir);
    return CHECK_DONE();
}
