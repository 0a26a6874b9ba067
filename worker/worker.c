/*
 * worker.c - kvd-worker: a compute engine that serves one kvd.
 *
 * It maps the model and attaches to kvd's KV pool, connects a DEALER socket
 * to kvd's worker endpoint and says Ready. Then it runs continuous batching:
 * between steps it takes in new sequences (Assign), more blocks (Grant) and
 * cancels; each step mixes the decode tokens of running sequences with prefill
 * chunks of new ones under a token budget, in one engine_step(). After a step
 * it reports what it wrote (Commit), the tokens it sampled (TokenChunk) and
 * the sequences it let go (Done). It writes K/V only into blocks kvd gave it,
 * asks for more (LeaseRequest) before a sequence runs out, and heartbeats
 * with a progress counter (work completed) so that kvd can tell a hung
 * worker from a busy one.
 *
 * Usage: kvd-worker --model M --pool NAME --connect ENDPOINT --id N
 *                   [--threads T] [--block-tokens B] [--kv-type T] [--k-type T] [--v-type T] [--kv-rotate R]
 *                   [--step-tokens S] [--max-batch N] [--ctx N] [--step-ms MS]
 *                   [--gpu N --gpu-socket PATH]
 *
 * With --gpu the pool's KV data is in the memory of GPU N: the worker gets it
 * from kvd over the Unix socket PATH and computes with the GPU engine
 * (worker_gpu.h). A worker that cannot run that way (no usable device, no GPU
 * engine in this build) exits with CLI_EXIT_UNUSABLE, which kvd reports and
 * does not restart. A GPU step's kernels complete before the worker reports
 * any block they wrote (wgpu_fence).
 *
 * With $KVD_WORKER_TRACE set, every step's size and time go to stderr (kvd's
 * log), for benchmarks that split a request's time into compute and the rest.
 * With $KVD_WORKER_STALL_FILE set, a step does not start while that file
 * exists, heartbeats going on: how tests make a worker that is alive but
 * stuck, which kvd must declare hung.
 *
 * Heartbeats do not wait for steps: while a step computes, the socket is lent
 * to a heartbeat thread that keeps the 250 ms beat and reports the engine's
 * progress, which grows a few times per layer. So a step may take as long as
 * a slow or busy CPU makes it and the worker still looks alive, and busy,
 * to kvd; a stopped or hung one does not (no beat, or no progress). Prefill
 * chunks are still cut to what the measured cost per token fits into
 * --step-ms (kvd passes an eighth of its hang timeout), never below 16
 * tokens, so that the decode tokens of running sequences do not wait long.
 */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "cli.h"
#include "err.h"
#include "forward.h"
#include "grammar.h"
#include "jschema.h"
#include "toolcall.h"
#include "curve.h"
#include "kvcache.h"
#include "model.h"
#include "pool.h"
#include "sampler.h"
#include "tok.h"
#include "units.h"
#include "wire.h"
#include "worker_gpu.h"

#define HEARTBEAT_MS 250
#define LEASE_AHEAD 4    /* a decoding sequence asks for its next block this many tokens early */

struct options {
    const char *model, *pool, *endpoint;
    const char *curve_server_key, *curve_cert;   /* a CURVE worker endpoint: kvd's key, ours */
    uint32_t id;
    int threads;
    uint32_t block_tokens, step_tokens, max_batch, ctx;
    struct kv_params kv;    /* --kv-type, --k-type, --v-type, --kv-rotate (the types and rotation) */
    uint32_t step_ms;       /* aim: no step longer than this (heartbeats wait for steps) */
    int gpu;                /* --gpu: CUDA device holding the pool's KV data; -1: CPU */
    const char *gpu_socket; /* --gpu-socket: where kvd hands out the device memory */
    const char *host;       /* --host: a worker on another host than kvd: --pool is this host's
                             * own pool (created by the first worker of the host) */
    uint64_t kv_bytes;      /* --kv-memory: that pool's size when this worker creates it */
    uint32_t fence_ms;      /* --fence-ms: kvd silent this long: stop computing, say Ready again */
};

/* One sequence kvd assigned. */
struct wseq {
    uint64_t id;            /* kvd's sequence id */
    int32_t *tok;           /* history: prompt, then generated tokens */
    uint32_t n_tok, tok_cap;
    uint32_t pos;           /* positions whose K/V are written */
    uint32_t *tables[KV_MAX_PARTS]; /* a block table per part of the pool (kvparts.h) */
    uint32_t n_blocks, blk_cap;     /* logical blocks (entries of each table), allocated */
    sampler_t *smp;
    uint64_t seed;          /* the request's seed: each draw reseeds from (seed, position) */
    uint32_t max_new;       /* tokens still to generate */
    uint32_t n_new;         /* generated in this assignment */
    bool ignore_eos;
    int32_t logprobs;       /* alternatives to send with each token's logprob; -1: no logprobs */
    int32_t prompt_logprobs;/* the same for prompt tokens; -1: none */
    uint32_t n_prompt;      /* the prompt's tokens (tok's first); scored up to it */
    struct gram *gram;      /* structured output: its grammar (a reference), or NULL */
    gstate_t *gst;          /* and where the output is in it */
    bool leasing;           /* asked kvd for blocks; waits for a Grant */
    bool window;            /* at the context it asks for a Window instead of ending */
    bool windowing;         /* asked (WindowRequest): it computes nothing until the Window */
    uint32_t sinks;         /* tokens a window keeps from the start */
    uint32_t output_from;   /* tok[] index where the output starts (the sampler's penalties) */
    uint32_t chunk;         /* tokens it runs in the current step */
};

/* The heartbeat thread. The socket belongs to the loop, except while a step
 * runs: then it is lent to this thread (lent = true), which beats on its own
 * clock. The mutex hands it over with the full memory barrier that ZeroMQ
 * asks of a socket that changes threads. */
struct beat {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* wakes the thread: lent, or quit */
    bool lent;              /* the thread owns the socket (a step is running) */
    bool quit;
    bool started;
};

/* A compiled structured-output grammar, shared by the sequences that follow
 * it and kept for the next ones (GRAM_CACHE of them). */
struct gram {
    char *key;              /* "o" (any JSON object), "s" + the schema's text, or "t" + tool calls' */
    grammar_t *g;
    uint32_t refs;          /* sequences, and the cache's */
    uint64_t used;          /* the last assignment that took it */
};
#define GRAM_CACHE 8

static void gram_put(struct gram *gm)
{
    if (gm != NULL && --gm->refs == 0) {
        grammar_destroy(&gm->g);
        free(gm->key);
        free(gm);
    }
}

struct worker {
    struct options o;
    model_t *model;
    tok_t *tok;
    pool_t *pool;
    kvcache_t *kv;
    engine_t *engine;       /* the CPU engine; NULL with --gpu */
    wgpu_t *gpu;            /* --gpu: the device pool and the GPU engine; NULL on the CPU */
    void *zctx, *sock;
    struct wseq **seqs;     /* running sequences, in arrival order */
    uint32_t n_seqs;
    uint64_t progress;      /* steps completed (heartbeats add the engine's jobs) */
    double last_hb;
    double last_heard;      /* ms: the last message from kvd (--host: its pings) */
    uint64_t epoch;         /* the last Ready's: kvd's messages for an earlier one are dropped */
    bool draining;
    wire_arena_t *arena;
    struct fwd_seq *batch;
    struct wseq **in_batch;
    struct wseq **pending;  /* plan_step's scratch: the prompts of seqs (as many entries) */
    struct sampler_draw *draws;     /* --gpu: each batch slot's draw, chosen on the device */
    const struct sampler_draw **draw_of; /* --gpu: &draws[k], or NULL where no token is due */
    double ms_per_token;    /* measured on prefill-sized steps; 0: not yet */
    bool trace;             /* $KVD_WORKER_TRACE: one stderr line per step */
    const char *stall_file; /* $KVD_WORKER_STALL_FILE: no step while it exists */
    struct beat beat;       /* heartbeats while a step runs */
    gtrie_t *trie;          /* the vocabulary as a trie, made at the first structured output */
    struct gram *grams[GRAM_CACHE]; /* grammars kept for later assignments */
    uint64_t gram_clock;
    uint32_t *mask;         /* a draw's allowed tokens ((n_vocab + 31) / 32 words) */
    float *masked;          /* (n_vocab) the row with the others at -inf */
};

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

/* ---- messages ------------------------------------------------------------------------ */

static void send_msg(struct worker *w, Kvdw__FromWorker *m)
{
    m->has_version = true;
    m->version = WIRE_VERSION;
    m->has_worker_id = true;
    m->worker_id = w->o.id;
    uint8_t *buf;
    size_t len;
    if (wire_pack(&m->base, &buf, &len) != 0)
        cli_die("cannot pack a message");
    if (zmq_send(w->sock, buf, len, 0) < 0 && errno != EINTR)
        fprintf(stderr, "kvd-worker %u: send: %s\n", w->o.id, zmq_strerror(errno));
    free(buf);
}

/* Sends a heartbeat; the caller owns the socket (the loop, or the heartbeat
 * thread during a step). Progress counts steps and, within them, the
 * engine's jobs: it grows while a step computes. */
static void send_heartbeat(struct worker *w)
{
    Kvdw__FromWorker m = KVDW__FROM_WORKER__INIT;
    Kvdw__Heartbeat hb = KVDW__HEARTBEAT__INIT;
    hb.has_progress = hb.has_running = true;
    hb.progress = w->progress + (w->engine ? engine_progress(w->engine) : 0);
    hb.running = w->n_seqs;
    m.body_case = KVDW__FROM_WORKER__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    send_msg(w, &m);
    w->last_hb = cli_now_ms();
}

static void send_done(struct worker *w, const struct wseq *s, Kvdw__DoneReason why, const char *error)
{
    Kvdw__FromWorker m = KVDW__FROM_WORKER__INIT;
    Kvdw__Done d = KVDW__DONE__INIT;
    d.has_seq_id = d.has_reason = d.has_n_written = true;
    d.seq_id = s->id;
    d.reason = why;
    d.n_written = s->pos;
    d.error = (char *)(error ? error : "");
    m.body_case = KVDW__FROM_WORKER__BODY_DONE;
    m.done = &d;
    send_msg(w, &m);
}

/* Asks kvd for blocks up to n_positions; `ahead`: before the sequence must
 * have them (LeaseRequest.ahead). */
static void send_lease(struct worker *w, struct wseq *s, uint32_t n_positions, bool ahead)
{
    Kvdw__FromWorker m = KVDW__FROM_WORKER__INIT;
    Kvdw__LeaseRequest l = KVDW__LEASE_REQUEST__INIT;
    l.has_seq_id = l.has_n_positions = true;
    l.seq_id = s->id;
    l.n_positions = n_positions;
    l.has_ahead = ahead;
    l.ahead = ahead;
    m.body_case = KVDW__FROM_WORKER__BODY_LEASE;
    m.lease = &l;
    send_msg(w, &m);
    s->leasing = true;
}

/* ---- heartbeats during a step ------------------------------------------------------------ */

static void *beat_main(void *arg)
{
    struct worker *w = arg;
    struct beat *b = &w->beat;
    pthread_mutex_lock(&b->mu);
    while (!b->quit) {
        if (!b->lent) {
            pthread_cond_wait(&b->cv, &b->mu);
            continue;
        }
        double due = w->last_hb + HEARTBEAT_MS;
        if (cli_now_ms() >= due) {
            send_heartbeat(w);
            due = w->last_hb + HEARTBEAT_MS;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        long ns = (long)((due - cli_now_ms()) * 1e6);
        if (ns < 1000000)
            ns = 1000000;
        ts.tv_sec += ns / 1000000000L;
        ts.tv_nsec += ns % 1000000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&b->cv, &b->mu, &ts);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* Starts the heartbeat thread, with every signal blocked in it so that
 * SIGTERM still interrupts the loop's poll. */
static void beat_start(struct worker *w)
{
    struct beat *b = &w->beat;
    pthread_mutex_init(&b->mu, NULL);
    pthread_condattr_t ca;  /* timed waits on the monotonic clock: a clock step moves no beat */
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&b->cv, &ca);
    pthread_condattr_destroy(&ca);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&b->thread, NULL, beat_main, w);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0)
        cli_die("cannot start the heartbeat thread: %s", strerror(rc));
    b->started = true;
}

/* Lends the socket to the heartbeat thread for the step about to run. */
static void beat_lend(struct worker *w)
{
    pthread_mutex_lock(&w->beat.mu);
    w->beat.lent = true;
    pthread_cond_signal(&w->beat.cv);
    pthread_mutex_unlock(&w->beat.mu);
}

/* Takes the socket back once the step is done (waits for a beat being sent). */
static void beat_reclaim(struct worker *w)
{
    pthread_mutex_lock(&w->beat.mu);
    w->beat.lent = false;
    pthread_mutex_unlock(&w->beat.mu);
}

static void beat_stop(struct worker *w)
{
    struct beat *b = &w->beat;
    if (!b->started)
        return;
    pthread_mutex_lock(&b->mu);
    b->quit = true;
    pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
    pthread_join(b->thread, NULL);
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    b->started = false;
}

/* ---- sequences --------------------------------------------------------------------------- */

static void seq_free(struct wseq *s)
{
    if (s == NULL)
        return;
    sampler_destroy(&s->smp);
    grammar_state_destroy(&s->gst);
    gram_put(s->gram);
    free(s->tok);
    for (uint32_t p = 0; p < KV_MAX_PARTS; p++)
        free(s->tables[p]);
    free(s);
}

/* Structured output: s follows the grammar of a's schema (or of any JSON
 * object), or of its tool calls, from the start of its output (a resumed
 * sequence's earlier output is fed to it first). 0, or an error with err. */
static int seq_follow(struct worker *w, struct wseq *s, const Kvdw__Assign *a, char *err, size_t errlen)
{
    const uint32_t V = w->model->cfg.n_vocab;
    if (w->trie == NULL) {
        if ((w->trie = grammar_trie_new(w->tok, err, errlen)) == NULL)
            return KVD_EINTERNAL;
        w->mask = malloc((V + 31) / 32 * sizeof(uint32_t));
        w->masked = malloc((size_t)V * sizeof(float));
        if (w->mask == NULL || w->masked == NULL)
            cli_die("out of memory");
    }
    /* the grammar's key: "o", "s" + the schema, or "t" + the choice and the tools */
    const char *schema = a->json_schema;
    const bool tools = a->tool_choice != NULL;
    const bool parallel = a->has_parallel_tool_calls && a->parallel_tool_calls;
    size_t kl = tools ? strlen(a->tool_choice) + 4 : schema ? strlen(schema) + 2 : 2;
    for (size_t i = 0; tools && i < a->n_tools; i++)
        kl += strlen(a->tools[i]) + 1;
    char *key = malloc(kl);
    if (key == NULL)
        cli_die("out of memory");
    if (tools) {
        size_t at = (size_t)snprintf(key, kl, "t%c%s", parallel ? 'p' : '1', a->tool_choice);
        for (size_t i = 0; i < a->n_tools; i++)
            at += (size_t)snprintf(key + at, kl - at, "\x01%s", a->tools[i]);
    } else {
        snprintf(key, kl, "%s%s", schema ? "s" : "o", schema ? schema : "");
    }
    struct gram *gm = NULL;
    int slot = 0;
    for (int i = 0; i < GRAM_CACHE && gm == NULL; i++) {
        if (w->grams[i] != NULL && strcmp(w->grams[i]->key, key) == 0)
            gm = w->grams[i];
        else if (w->grams[i] == NULL || (w->grams[slot] != NULL && w->grams[i]->used < w->grams[slot]->used))
            slot = i;       /* a free slot, or the least recently used */
    }
    if (gm == NULL) {
        grammar_t *g = tools ? toolcall_compile((const char *const *)a->tools, a->n_tools,
                                                strcmp(a->tool_choice, "required") == 0 ? NULL : a->tool_choice,
                                                parallel, err, errlen)
                       : schema ? jschema_compile(schema, strlen(schema), NULL, err, errlen)
                                : jschema_compile_object(NULL, err, errlen);
        if (g == NULL) {
            free(key);
            return KVD_EINVAL;
        }
        gm = calloc(1, sizeof(*gm));
        if (gm == NULL)
            cli_die("out of memory");
        gm->key = key;
        key = NULL;
        gm->g = g;
        gm->refs = 1;       /* the cache's */
        gram_put(w->grams[slot]);
        w->grams[slot] = gm;
    }
    free(key);
    gm->used = ++w->gram_clock;
    gm->refs++;
    s->gram = gm;
    if ((s->gst = grammar_state_new(gm->g)) == NULL)
        cli_die("out of memory");
    for (uint32_t i = s->n_prompt; i < s->n_tok; i++)
        if (grammar_advance_token(s->gst, w->trie, s->tok[i]) != 0) {
            snprintf(err, errlen, "structured output: the output so far does not follow the %s",
                     tools ? "tool calls' grammar" : "schema");
            return KVD_EINVAL;
        }
    return 0;
}

static int find_seq(const struct worker *w, uint64_t id)
{
    for (uint32_t i = 0; i < w->n_seqs; i++)
        if (w->seqs[i]->id == id)
            return (int)i;
    return -1;
}

static void remove_seq(struct worker *w, uint32_t i)
{
    seq_free(w->seqs[i]);
    memmove(w->seqs + i, w->seqs + i + 1, (w->n_seqs - i - 1) * sizeof(*w->seqs));
    w->n_seqs--;
}

/* Appends logical blocks to s's tables: ids holds, for each, one id per part
 * of the pool; a windowed part's may be POOL_NONE (a block its window no
 * longer reads; the engine checks that a step reads none of those). Blocks
 * that kvd takes back from a windowed part later (their positions slid out
 * of every window this sequence will compute) keep their ids here: no later
 * step reads them. */
static int push_blocks(struct wseq *s, const uint32_t *ids, size_t n, const pool_t *pool)
{
    const struct pool_header *h = pool_header(pool);
    const struct kv_parts *parts = &h->layout.parts;
    const uint32_t np = parts->n_parts;
    if (n % np != 0)
        return KVD_ERANGE;
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= h->n_blocks && !(ids[i] == POOL_NONE && parts->window[i % np] != 0))
            return KVD_ERANGE;
    const size_t add = n / np;
    if (s->n_blocks + add > s->blk_cap) {
        uint32_t cap = (uint32_t)(s->n_blocks + add) * 2;
        for (uint32_t p = 0; p < np; p++) {
            uint32_t *nb = realloc(s->tables[p], cap * sizeof(uint32_t));
            if (nb == NULL)
                return KVD_ENOMEM;
            s->tables[p] = nb;
        }
        s->blk_cap = cap;
    }
    for (size_t i = 0; i < add; i++)
        for (uint32_t p = 0; p < np; p++)
            s->tables[p][s->n_blocks + i] = ids[i * np + p];
    s->n_blocks += (uint32_t)add;
    return 0;
}

static void on_assign(struct worker *w, const Kvdw__Assign *a)
{
    char err[256];
    struct wseq *s = calloc(1, sizeof(*s));
    if (s == NULL)
        cli_die("out of memory");
    s->id = a->seq_id;
    const struct model_config *c = &w->model->cfg;
    int rc = 0;
    if (find_seq(w, a->seq_id) >= 0 || w->draining) {
        snprintf(err, sizeof(err), w->draining ? "the worker is draining" : "sequence id in use");
        rc = KVD_ESTATE;
    }
    for (size_t i = 0; rc == 0 && i < a->n_tokens; i++)
        if ((uint32_t)a->tokens[i] >= c->n_vocab) {
            snprintf(err, sizeof(err), "token id %d is out of range", a->tokens[i]);
            rc = KVD_ERANGE;
        }
    if (rc == 0 && (a->n_tokens + 1 > w->o.ctx || a->n_cached >= a->n_tokens)) {
        snprintf(err, sizeof(err), "%zu tokens (%u cached) do not fit a context of %u",
                 a->n_tokens, a->n_cached, w->o.ctx);
        rc = KVD_ETOOLONG;
    }
    if (rc == 0) {
        s->tok_cap = (uint32_t)a->n_tokens + a->max_new + 1;
        s->tok = malloc(s->tok_cap * sizeof(int32_t));
        if (s->tok == NULL)
            cli_die("out of memory");
        memcpy(s->tok, a->tokens, a->n_tokens * sizeof(int32_t));
        s->n_tok = (uint32_t)a->n_tokens;
        s->pos = a->n_cached;
        s->max_new = a->max_new;
        s->ignore_eos = a->ignore_eos;
        s->logprobs = a->has_logprobs ? (int32_t)a->logprobs : -1;
        s->prompt_logprobs = a->has_prompt_logprobs ? (int32_t)a->prompt_logprobs : -1;
        s->n_prompt = a->has_n_generated && a->n_generated <= a->n_tokens ? (uint32_t)a->n_tokens - a->n_generated
                                                                          : (uint32_t)a->n_tokens;
        s->window = a->has_window_sinks;
        s->sinks = a->window_sinks;
        if (s->window && w->gpu != NULL && pool_header(w->pool)->layout.parts.n_parts > 1) {
            snprintf(err, sizeof(err), "context windowing a model with sliding-window layers is not supported "
                     "on a GPU worker");
            rc = KVD_EUNSUPPORTED;
        }
        if (rc == 0 && (rc = push_blocks(s, a->blocks, a->n_blocks, w->pool)) != 0)
            snprintf(err, sizeof(err), "a block id is out of range");
    }
    if (rc == 0) {
        struct sampler_params sp = sampler_default_params();
        const Kvd__SamplingParams *p = a->sampling;
        if (p) {
            if (p->has_temperature) sp.temperature = p->temperature;
            if (p->has_top_k) sp.top_k = p->top_k;
            if (p->has_top_p) sp.top_p = p->top_p;
            if (p->has_min_p) sp.min_p = p->min_p;
            if (p->has_repeat_penalty) sp.repeat_penalty = p->repeat_penalty;
            if (p->has_seed) sp.seed = p->seed;
            if (p->has_presence_penalty) sp.presence_penalty = p->presence_penalty;
            if (p->has_frequency_penalty) sp.frequency_penalty = p->frequency_penalty;
            if (p->n_logit_bias_ids == p->n_logit_bias) {   /* wire_check'd: equal, distinct */
                sp.n_logit_bias = (uint32_t)p->n_logit_bias;
                sp.logit_bias_ids = p->logit_bias_ids;
                sp.logit_bias = p->logit_bias;
            }
        }
        /* the output the penalties count: what was generated, a resumed
         * sequence's earlier tokens included */
        const uint32_t n_gen = a->has_n_generated ? a->n_generated : 0;
        sp.output_from = n_gen <= a->n_tokens ? (uint32_t)a->n_tokens - n_gen : 0;
        s->output_from = sp.output_from;
        s->seed = sp.seed;
        s->smp = sampler_new(&sp, c->n_vocab, err, sizeof(err));
        if (s->smp == NULL)
            rc = KVD_ERANGE;
    }
    if (rc == 0 && (a->json_schema != NULL || (a->has_json_object && a->json_object) || a->tool_choice != NULL))
        rc = seq_follow(w, s, a, err, sizeof(err));
    if (rc != 0) {
        send_done(w, s, KVDW__DONE_REASON__DONE_ERROR, err);
        seq_free(s);
        return;
    }
    struct wseq **ns = realloc(w->seqs, (w->n_seqs + 1) * sizeof(*ns));
    if (ns == NULL)
        cli_die("out of memory");
    w->seqs = ns;
    if ((ns = realloc(w->pending, (w->n_seqs + 1) * sizeof(*ns))) == NULL)
        cli_die("out of memory");
    w->pending = ns;
    w->seqs[w->n_seqs++] = s;
}

/* kvd's answer to s's WindowRequest: copies the blocks it names, takes the
 * new table, turns the moved blocks' keys to their positions and drops the
 * same tokens from the history (kvd does the same on its side). With --gpu
 * the copies and the turn run on the device (wgpu_kv_copy, wgpu_kv_shift),
 * done before this returns. */
static int on_window(struct worker *w, struct wseq *s, const Kvdw__Window *m, char *err, size_t errlen)
{
    const uint32_t bt = w->o.block_tokens, nb = pool_header(w->pool)->n_blocks;
    const uint32_t kb = m->keep * bt, d = m->drop * bt;
    const uint32_t np = pool_header(w->pool)->layout.parts.n_parts;
    if (!s->windowing || (uint64_t)kb + d > s->pos || m->n_blocks % np != 0 ||
        m->n_blocks / np + m->drop != s->n_blocks)
        return kvd_seterr(err, errlen, KVD_EINVAL, "a window that does not fit the sequence");
    for (size_t i = 0; i < m->n_copy_from; i++)
        if (m->copy_from[i] >= nb || m->copy_to[i] >= nb)
            return kvd_seterr(err, errlen, KVD_ERANGE, "a window's block is out of range");
    int rc = 0;
    if (w->gpu != NULL)
        rc = wgpu_kv_copy(w->gpu, m->copy_from, m->copy_to, (uint32_t)m->n_copy_from, err, errlen);
    else
        for (size_t i = 0; i < m->n_copy_from; i++)
            kvcache_copy_block(w->kv, m->copy_from[i], m->copy_to[i]);
    if (rc != 0)
        return rc;
    s->n_blocks = 0;
    rc = push_blocks(s, m->blocks, m->n_blocks, w->pool);
    if (rc != 0)
        return kvd_seterr(err, errlen, rc, "a window's block is out of range");
    if (w->gpu != NULL) {
        const uint32_t *moved = s->tables[0] + m->keep, n_moved = s->n_blocks - m->keep;
        rc = wgpu_kv_shift(w->gpu, moved, n_moved, -(int32_t)d, err, errlen);
    } else {
        rc = engine_kv_shift(w->engine, (const uint32_t *const *)s->tables, m->keep, s->n_blocks - m->keep,
                             -(int32_t)d, err, errlen);
    }
    if (rc != 0)
        return rc;
    memmove(s->tok + kb, s->tok + kb + d, (size_t)(s->n_tok - kb - d) * sizeof(int32_t));
    s->n_tok -= d;
    s->pos -= d;
    s->n_prompt = s->n_prompt > kb + d ? s->n_prompt - d : (s->n_prompt < kb ? s->n_prompt : kb);
    s->output_from = s->output_from > kb + d ? s->output_from - d : (s->output_from < kb ? s->output_from : kb);
    sampler_set_output_from(s->smp, s->output_from);
    s->windowing = false;
    return 0;
}

static void on_message(struct worker *w, const void *buf, size_t len)
{
    char err[256];
    int code;
    wire_arena_reset(w->arena);
    Kvdw__ToWorker *m = wire_to_worker_unpack(w->arena, buf, len, &code, err, sizeof(err));
    if (m == NULL) {
        fprintf(stderr, "kvd-worker %u: dropped a message: %s\n", w->o.id, err);
        return;
    }
    if (m->has_epoch && m->epoch != w->epoch)
        return;     /* meant for this worker before it last said Ready: stale */
    w->last_heard = cli_now_ms();
    int i;
    switch (m->body_case) {
    case KVDW__TO_WORKER__BODY_ASSIGN:
        on_assign(w, m->assign);
        break;
    case KVDW__TO_WORKER__BODY_GRANT:
        i = find_seq(w, m->grant->seq_id);
        if (i >= 0) {
            struct wseq *s = w->seqs[i];
            if (push_blocks(s, m->grant->blocks, m->grant->n_blocks, w->pool) != 0) {
                send_done(w, s, KVDW__DONE_REASON__DONE_ERROR, "a granted block is out of range");
                remove_seq(w, (uint32_t)i);
            } else {
                s->leasing = false;
            }
        }
        break;
    case KVDW__TO_WORKER__BODY_WINDOW:
        i = find_seq(w, m->window->seq_id);
        if (i >= 0 && on_window(w, w->seqs[i], m->window, err, sizeof(err)) != 0) {
            send_done(w, w->seqs[i], KVDW__DONE_REASON__DONE_ERROR, err);
            remove_seq(w, (uint32_t)i);
        }
        break;
    case KVDW__TO_WORKER__BODY_CANCEL:
        i = find_seq(w, m->cancel->seq_id);
        if (i >= 0) {
            send_done(w, w->seqs[i], KVDW__DONE_REASON__DONE_CANCELLED, NULL);
            remove_seq(w, (uint32_t)i);
        }
        break;
    case KVDW__TO_WORKER__BODY_DRAIN:
        w->draining = true;
        break;
    case KVDW__TO_WORKER__BODY_PING:
        break;  /* kvd is there (last_heard) */
    default:
        break;
    }
}

/* ---- one step ------------------------------------------------------------------------------ */

/* Positions the sequence's blocks cover. */
static uint32_t seq_capacity(const struct worker *w, const struct wseq *s)
{
    return s->n_blocks * w->o.block_tokens;
}

#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* Puts up to m of s's next positions into the step (fewer where its blocks
 * end: then it asks kvd for more, once). Returns the positions taken. */
static uint32_t plan_take(struct worker *w, struct wseq *s, uint32_t m, uint32_t *n)
{
    const uint32_t cap = seq_capacity(w, s);
    if (s->pos + m > cap)
        m = cap > s->pos ? cap - s->pos : 0;
    if (m == 0) {
        /* ask for blocks up to the end of the history plus the next token
         * (a sequence that asked already runs on what it holds meanwhile) */
        if (!s->leasing)
            send_lease(w, s, s->n_tok + 1, false);
        return 0;
    }
    s->chunk = m;
    w->in_batch[*n] = s;
    /* a scored prompt's chunk brings every row back: row j scores token pos + j + 1 */
    const bool all = s->prompt_logprobs >= 0 && s->pos + 1 < s->n_prompt;
    w->batch[*n] = (struct fwd_seq){ s->tok + s->pos, m, s->pos, s->tables[0], s->n_blocks, all, NULL };
    if (pool_header(w->pool)->layout.parts.n_parts > 1)
        w->batch[*n].tables = (const uint32_t *const *)s->tables;
    (*n)++;
    return m;
}

/* Adds up to budget tokens to the chunk of s, batch entry k (blocks
 * permitting); returns how many. */
static uint32_t plan_grow(struct worker *w, struct wseq *s, uint32_t k, uint32_t budget)
{
    const uint32_t more = MIN(budget, s->n_tok - s->pos - s->chunk);
    const uint32_t cap = seq_capacity(w, s) - s->pos;
    const uint32_t add = MIN(more, cap > s->chunk ? cap - s->chunk : 0);
    s->chunk += add;
    w->batch[k].n_tokens = s->chunk;
    return add;
}

/* Whether a's block table sorts before b's (block by block, a prefix first). */
static bool table_before(const struct fwd_seq *a, const struct fwd_seq *b)
{
    const uint32_t n = MIN(a->n_blocks, b->n_blocks);
    for (uint32_t i = 0; i < n; i++)
        if (a->blocks[i] != b->blocks[i])
            return a->blocks[i] < b->blocks[i];
    return a->n_blocks < b->n_blocks;
}

/*
 * Picks the step's chunks under its token budget: every running sequence's
 * next token first (decode steps stay one token each), then prompt tokens.
 * The oldest prompt is sure of a quarter of the budget, so no prompt waits
 * for ever; the rest goes to the prompts with the fewest tokens left first
 * (ties in arrival order, the oldest among them in its place), so that a
 * prompt served mostly from the cache has its first token after the next
 * step even while cold prompts compute their thousands of tokens, and cold
 * prompts of one length finish one after another; what they leave goes back
 * to the oldest.
 */
static uint32_t plan_step(struct worker *w)
{
    /* a step must end well within kvd's hang timeout: cap its tokens by time */
    uint32_t budget = w->o.step_tokens, n = 0;
    if (w->ms_per_token > 0) {
        double cap = w->o.step_ms / w->ms_per_token;
        if (cap < budget)
            budget = cap < 16 ? 16 : (uint32_t)cap;
    }
    struct wseq *oldest = NULL;
    uint32_t n_pre = 0;
    for (uint32_t i = 0; i < w->n_seqs; i++) {
        struct wseq *s = w->seqs[i];
        s->chunk = 0;
        if (s->windowing)
            continue;                   /* waits for its Window */
        if (s->n_tok - s->pos != 1) {
            w->pending[n_pre++] = s;    /* a prompt, in arrival order */
            if (oldest == NULL)
                oldest = s;
        } else if (n < w->o.max_batch && budget > 0) {
            budget -= plan_take(w, s, 1, &n);
        }
    }
    /* decode tokens that share a prefix side by side (their block tables in
     * order): attention reads the shared blocks' K/V for the first and finds
     * them in cache for the next, and the engine runs whole shared ranges of
     * four or more together. A token's bits do not depend on its batch. */
    for (uint32_t i = 1; i < n; i++) {
        const struct fwd_seq b = w->batch[i];
        struct wseq *s = w->in_batch[i];
        uint32_t j = i;
        for (; j > 0 && table_before(&b, &w->batch[j - 1]); j--) {
            w->batch[j] = w->batch[j - 1];
            w->in_batch[j] = w->in_batch[j - 1];
        }
        w->batch[j] = b;
        w->in_batch[j] = s;
    }
    if (oldest == NULL || n >= w->o.max_batch || budget == 0)
        return n;
    /* the oldest prompt's share first, then the shortest prompts */
    uint32_t share = budget / 4 < 16 ? 16 : budget / 4, k0 = n;
    budget -= plan_take(w, oldest, MIN(share, MIN(budget, oldest->n_tok - oldest->pos)), &n);
    for (uint32_t i = 1; i < n_pre; i++) {
        /* insertion sort by tokens left, stable (the oldest, first in arrival
         * order, first among its equals): n_pre is at most max_batch */
        struct wseq *s = w->pending[i];
        uint32_t j = i;
        for (; j > 0 && w->pending[j - 1]->n_tok - w->pending[j - 1]->pos > s->n_tok - s->pos; j--)
            w->pending[j] = w->pending[j - 1];
        w->pending[j] = s;
    }
    const bool oldest_in = k0 < n && w->in_batch[k0] == oldest;
    for (uint32_t i = 0; i < n_pre && budget > 0; i++) {
        struct wseq *s = w->pending[i];
        if (s == oldest) {
            /* the oldest in its place among the shortest: past its share
             * (cold prompts of one length finish one after another, not
             * all together at the end) */
            if (oldest_in)
                budget -= plan_grow(w, oldest, k0, budget);
        } else if (n < w->o.max_batch) {
            budget -= plan_take(w, s, MIN(budget, s->n_tok - s->pos), &n);
        }
    }
    if (budget > 0 && oldest_in)
        plan_grow(w, oldest, k0, budget);   /* what the others left */
    return n;
}

/* Exits once what is queued for kvd has gone (2 s at most): a failed batch's
 * Done messages must reach kvd, which would otherwise take the requests for
 * those of a worker that died and resume them elsewhere. */
static void exit_flushed(struct worker *w, int status)
{
    int linger = 2000;
    zmq_setsockopt(w->sock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_close(w->sock);
    zmq_ctx_term(w->zctx);
    exit(status);
}

static void run_step(struct worker *w, uint32_t n)
{
    char err[256];
    const float *logits = NULL;
    const int32_t *ids = NULL;
    uint32_t rows;
    uint32_t n_tokens = 0;
    bool want_logits = false;       /* a sequence wants logprobs: its rows come to the host */
    for (uint32_t k = 0; k < n; k++) {
        n_tokens += w->batch[k].n_tokens;
        want_logits |= w->in_batch[k]->logprobs >= 0 || w->batch[k].all_logits || w->in_batch[k]->gst != NULL;
    }
    if (w->gpu && !want_logits) {
        /* the device chooses the tokens: plan each due draw first, exactly as
         * the host would just before sampling (below) */
        for (uint32_t k = 0; k < n; k++) {
            struct wseq *s = w->in_batch[k];
            w->draw_of[k] = NULL;
            if (s->pos + s->chunk < s->n_tok)
                continue;               /* a prefill chunk: no token yet */
            sampler_reseed(s->smp, s->seed ^ (0x9e3779b97f4a7c15ull * (s->n_tok + 1ull)));
            sampler_plan(s->smp, s->tok, s->n_tok, &w->draws[k]);
            w->draw_of[k] = &w->draws[k];
        }
    }
    double t0 = cli_now_ms();
    beat_lend(w);
    while (w->stall_file && access(w->stall_file, F_OK) == 0 && !stop_flag)
        usleep(10000);
    int rc = !w->gpu ? engine_step(w->engine, w->batch, n, &logits, &rows, err, sizeof(err))
             : want_logits ? wgpu_step_logits(w->gpu, w->batch, n, &logits, &rows, err, sizeof(err))
             : wgpu_step_sample(w->gpu, w->batch, n, w->draw_of, &ids, &rows, err, sizeof(err));
    /* nothing below may tell kvd a block is written before the kernels that
     * wrote it have completed */
    bool gpu_broken = false;
    if (w->gpu) {
        /* a failed kernel poisons this process's CUDA context: every later
         * call fails too, the fence included. A step refused for its input,
         * or a failure that left the context usable, passes the fence. */
        char ferr[256];
        int frc = wgpu_fence(w->gpu, ferr, sizeof(ferr));
        gpu_broken = frc != 0;
        if (rc == 0 && frc != 0) {
            rc = frc;
            snprintf(err, sizeof(err), "%s", ferr);
        }
    }
    beat_reclaim(w);
    w->progress++;
    if (w->trace)
        fprintf(stderr, "kvd-worker %u: step %u: %u sequences, %u tokens, %.3f ms\n", w->o.id,
                (unsigned)w->progress, n, n_tokens, cli_now_ms() - t0);
    if (rc == 0 && n_tokens >= 16) {
        double per = (cli_now_ms() - t0) / n_tokens;
        w->ms_per_token = w->ms_per_token > 0 ? 0.7 * w->ms_per_token + 0.3 * per : per;
    }
    if (rc != 0) {
        /* checked before touching the cache: fail the sequences of this batch */
        for (uint32_t k = 0; k < n; k++) {
            int i = find_seq(w, w->in_batch[k]->id);
            send_done(w, w->in_batch[k], KVDW__DONE_REASON__DONE_ERROR, err);
            if (i >= 0)
                remove_seq(w, (uint32_t)i);
        }
        if (gpu_broken) {
            fprintf(stderr, "kvd-worker: GPU %d: %s (exiting: kvd restarts this worker with a fresh context)\n",
                    w->o.gpu, err);
            exit_flushed(w, 1);
        }
        return;
    }
    const uint32_t V = w->model->cfg.n_vocab;
    uint32_t row = 0;               /* the first logits row of sequence k */
    for (uint32_t k = 0; k < n; k++) {
        struct wseq *s = w->in_batch[k];
        const uint32_t p0 = s->pos, n_rows = w->batch[k].all_logits ? w->batch[k].n_tokens : 1;
        const float *last_row = logits != NULL ? logits + (size_t)(row + n_rows - 1) * V : NULL;
        row += n_rows;
        s->pos += s->chunk;
        Kvdw__FromWorker m = KVDW__FROM_WORKER__INIT;
        if (s->pos < s->n_tok || w->batch[k].all_logits || s->max_new == 0) {
            /* its K/V are written, and a scored prompt's tokens have their logprobs */
            Kvdw__Commit c = KVDW__COMMIT__INIT;
            c.has_seq_id = c.has_n_written = true;
            c.seq_id = s->id;
            c.n_written = s->pos;
            Kvd__TokenLogprob *pl = NULL, **plp = NULL;
            struct sampler_logprobs *pv = NULL;
            if (w->batch[k].all_logits && logits != NULL) {
                /* row j: the distribution of token p0 + j + 1 (in the prompt) */
                const uint32_t end = MIN(s->pos, s->n_prompt - 1);
                const uint32_t ns = end > p0 ? end - p0 : 0;
                pl = calloc(ns ? ns : 1, sizeof(*pl));
                plp = calloc(ns ? ns : 1, sizeof(*plp));
                pv = calloc(ns ? ns : 1, sizeof(*pv));
                if (pl == NULL || plp == NULL || pv == NULL)
                    cli_die("out of memory");
                for (uint32_t j = 0; j < ns; j++) {
                    sampler_logprobs(logits + (size_t)(row - n_rows + j) * V, V, s->tok[p0 + j + 1],
                                     (uint32_t)s->prompt_logprobs, &pv[j]);
                    kvd__token_logprob__init(&pl[j]);
                    pl[j].has_logprob = pl[j].has_rank = true;
                    pl[j].logprob = pv[j].logprob;
                    pl[j].rank = pv[j].rank;
                    pl[j].top_ids = pv[j].top_id;
                    pl[j].n_top_ids = pv[j].n_top;
                    pl[j].top_logprobs = pv[j].top_logprob;
                    pl[j].n_top_logprobs = pv[j].n_top;
                    plp[j] = &pl[j];
                }
                c.has_first_scored = true;
                c.first_scored = p0 + 1;
                c.prompt_logprobs = plp;
                c.n_prompt_logprobs = ns;
            }
            m.body_case = KVDW__FROM_WORKER__BODY_COMMIT;
            m.commit = &c;
            send_msg(w, &m);
            free(pl);
            free(plp);
            free(pv);
        }
        if (s->pos >= s->n_tok && s->max_new == 0) {
            /* the prompt alone was asked for */
            send_done(w, s, KVDW__DONE_REASON__DONE_LENGTH, NULL);
            remove_seq(w, (uint32_t)find_seq(w, s->id));
            continue;
        }
        if (s->pos < s->n_tok) {
            /* kvd may hand a long prompt's blocks out a few steps at a time (a
             * pool of parts): ask for the next ones before they run out */
            const uint32_t cap = seq_capacity(w, s);
            if (!s->leasing && cap < s->n_tok + 1 && cap - s->pos < w->o.step_tokens)
                send_lease(w, s, s->n_tok + 1, false);
            continue;
        }
        /* the draw depends on the request and the position only, so a sequence
         * resumed on another worker continues exactly as it would have */
        int32_t t;
        if (ids != NULL) {
            t = ids[k];
        } else {
            sampler_reseed(s->smp, s->seed ^ (0x9e3779b97f4a7c15ull * (s->n_tok + 1ull)));
            const float *draw_row = last_row;
            if (s->gst != NULL) {
                /* structured output: only tokens that keep the document valid */
                uint32_t n_ok = 0;
                if (grammar_mask(s->gst, w->trie, w->mask, &n_ok) != 0)
                    cli_die("out of memory");
                if (n_ok == 0) {
                    send_done(w, s, KVDW__DONE_REASON__DONE_ERROR,
                              "structured output: no token can continue the document");
                    remove_seq(w, (uint32_t)find_seq(w, s->id));
                    continue;
                }
                memcpy(w->masked, last_row, (size_t)V * sizeof(float));
                grammar_mask_apply(w->mask, w->masked, V);
                draw_row = w->masked;
            }
            t = sampler_sample(s->smp, draw_row, s->tok, s->n_tok);
            if (s->gst != NULL && grammar_advance_token(s->gst, w->trie, t) != 0) {
                send_done(w, s, KVDW__DONE_REASON__DONE_ERROR, "structured output: a token outside the schema");
                remove_seq(w, (uint32_t)find_seq(w, s->id));
                continue;
            }
        }
        Kvdw__TokenChunk tc = KVDW__TOKEN_CHUNK__INIT;
        Kvd__TokenLogprob tl = KVD__TOKEN_LOGPROB__INIT;
        Kvd__TokenLogprob *tlp = &tl;
        struct sampler_logprobs lp;
        if (s->logprobs >= 0 && logits != NULL) {
            sampler_logprobs(last_row, V, t, (uint32_t)s->logprobs, &lp);
            tl.has_logprob = true;
            tl.logprob = lp.logprob;
            tl.top_ids = lp.top_id;
            tl.n_top_ids = lp.n_top;
            tl.top_logprobs = lp.top_logprob;
            tl.n_top_logprobs = lp.n_top;
            tc.logprobs = &tlp;
            tc.n_logprobs = 1;
        }
        s->tok[s->n_tok++] = t;
        s->n_new++;
        tc.has_seq_id = tc.has_n_written = true;
        tc.seq_id = s->id;
        tc.tokens = &t;
        tc.n_tokens = 1;
        tc.n_written = s->pos;
        m.body_case = KVDW__FROM_WORKER__BODY_CHUNK;
        m.chunk = &tc;
        send_msg(w, &m);
        Kvdw__DoneReason why = KVDW__DONE_REASON__DONE_NONE;
        if (!s->ignore_eos && tok_is_eog(w->tok, t))
            why = KVDW__DONE_REASON__DONE_EOG;
        else if (s->n_new >= s->max_new || (s->n_tok + 1 > w->o.ctx && !s->window))
            why = KVDW__DONE_REASON__DONE_LENGTH;
        if (why != KVDW__DONE_REASON__DONE_NONE) {
            send_done(w, s, why, NULL);
            remove_seq(w, (uint32_t)find_seq(w, s->id));
        } else if (s->n_tok + 1 > w->o.ctx) {
            /* the context is full: kvd windows it (on_window) */
            Kvdw__FromWorker wm = KVDW__FROM_WORKER__INIT;
            Kvdw__WindowRequest wr = KVDW__WINDOW_REQUEST__INIT;
            wr.has_seq_id = wr.has_n_written = true;
            wr.seq_id = s->id;
            wr.n_written = s->pos;
            wm.body_case = KVDW__FROM_WORKER__BODY_WINDOW;
            wm.window = &wr;
            send_msg(w, &wm);
            s->windowing = true;
        } else if (!s->leasing && s->n_tok > seq_capacity(w, s)) {
            /* the next decode needs a new block: ask now */
            send_lease(w, s, s->n_tok + 1, false);
        } else if (!s->leasing) {
            /* a block needed within LEASE_AHEAD tokens: asked now, it comes
             * while the next steps run (asked when it must, the sequence sat
             * out a step at every block: one in sixteen of its decode steps) */
            const uint32_t left = s->max_new - s->n_new;   /* tokens still to draw, >= 1 */
            const uint32_t want = s->n_tok + MIN(LEASE_AHEAD, left - 1);
            if (want > seq_capacity(w, s) && want <= w->o.ctx)
                send_lease(w, s, want, true);
        }
    }
}

/* ---- setup and the loop ----------------------------------------------------------------- */

static void parse_args(int argc, char **argv, struct options *o)
{
    enum { OPT_POOL = 256, OPT_CONNECT, OPT_ID, OPT_BLOCK, OPT_KVTYPE, OPT_KTYPE, OPT_VTYPE, OPT_ROTATE,
           OPT_STEP, OPT_BATCH, OPT_STEP_MS, OPT_GPU, OPT_GPU_SOCKET, OPT_CURVE_KEY, OPT_CURVE_CERT,
           OPT_HOST, OPT_KV_MEMORY, OPT_FENCE };
    static const struct option longs[] = {
        { "model", required_argument, NULL, 'm' },
        { "threads", required_argument, NULL, 't' },
        { "ctx", required_argument, NULL, 'c' },
        { "pool", required_argument, NULL, OPT_POOL },
        { "connect", required_argument, NULL, OPT_CONNECT },
        { "id", required_argument, NULL, OPT_ID },
        { "block-tokens", required_argument, NULL, OPT_BLOCK },
        { "kv-type", required_argument, NULL, OPT_KVTYPE },
        { "k-type", required_argument, NULL, OPT_KTYPE },
        { "v-type", required_argument, NULL, OPT_VTYPE },
        { "kv-rotate", required_argument, NULL, OPT_ROTATE },
        { "step-tokens", required_argument, NULL, OPT_STEP },
        { "max-batch", required_argument, NULL, OPT_BATCH },
        { "step-ms", required_argument, NULL, OPT_STEP_MS },
        { "gpu", required_argument, NULL, OPT_GPU },
        { "gpu-socket", required_argument, NULL, OPT_GPU_SOCKET },
        { "curve-server-key", required_argument, NULL, OPT_CURVE_KEY },
        { "curve-cert", required_argument, NULL, OPT_CURVE_CERT },
        { "host", required_argument, NULL, OPT_HOST },
        { "kv-memory", required_argument, NULL, OPT_KV_MEMORY },
        { "fence-ms", required_argument, NULL, OPT_FENCE },
        { NULL, 0, NULL, 0 },
    };
    memset(o, 0, sizeof(*o));
    o->block_tokens = 16;
    const char *kv_type = NULL, *k_type = NULL, *v_type = NULL, *rotate = NULL;
    o->step_tokens = 256;
    o->max_batch = 64;
    o->step_ms = 500;
    o->gpu = -1;
    o->fence_ms = 10000;
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":m:t:c:", longs, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 't': o->threads = atoi(optarg); break;
        case 'c': o->ctx = (uint32_t)strtoul(optarg, NULL, 10); break;
        case OPT_POOL: o->pool = optarg; break;
        case OPT_CONNECT: o->endpoint = optarg; break;
        case OPT_ID: o->id = (uint32_t)strtoul(optarg, NULL, 10); break;
        case OPT_BLOCK: o->block_tokens = (uint32_t)strtoul(optarg, NULL, 10); break;
        case OPT_KVTYPE: kv_type = optarg; break;
        case OPT_KTYPE: k_type = optarg; break;
        case OPT_VTYPE: v_type = optarg; break;
        case OPT_ROTATE: rotate = optarg; break;
        case OPT_STEP: o->step_tokens = (uint32_t)strtoul(optarg, NULL, 10); break;
        case OPT_BATCH: o->max_batch = (uint32_t)strtoul(optarg, NULL, 10); break;
        case OPT_STEP_MS: o->step_ms = (uint32_t)strtoul(optarg, NULL, 10); break;
        case OPT_GPU: o->gpu = (int)cli_long(optarg, "--gpu", 0, 1023); break;
        case OPT_GPU_SOCKET: o->gpu_socket = optarg; break;
        case OPT_CURVE_KEY: o->curve_server_key = optarg; break;
        case OPT_CURVE_CERT: o->curve_cert = optarg; break;
        case OPT_HOST: o->host = optarg; break;
        case OPT_KV_MEMORY:
            if (kvd_parse_size(optarg, &o->kv_bytes) != 0 || o->kv_bytes == 0)
                cli_die("--kv-memory: bad size %s", optarg);
            break;
        case OPT_FENCE: o->fence_ms = (uint32_t)cli_long(optarg, "--fence-ms", 1000, 3600000); break;
        default: cli_die("bad argument %s (usage: kvd-worker --model M --pool NAME --connect ENDPOINT "
                     "--id N [--threads T] [--ctx N] [--block-tokens B] [--kv-type T] [--k-type T] "
                     "[--v-type T] [--kv-rotate on|off|auto] "
                     "[--step-tokens S] [--max-batch N] [--gpu N --gpu-socket PATH] "
                     "[--curve-server-key KEY --curve-cert FILE] "
                     "[--host NAME [--kv-memory SIZE] [--fence-ms MS]])",
                     argv[optind - 1]);
        }
    }
    if (!o->model || !o->pool || !o->endpoint)
        cli_die("--model, --pool and --connect are required");
    char err[256];
    kv_gpu_auto(o->gpu >= 0, &kv_type, &k_type, &v_type);
    if (kv_params_from_flags(&o->kv, kv_type, k_type, v_type, rotate, err, sizeof(err)) != 0)
        cli_die("%s", err);
    if ((o->gpu >= 0) != (o->gpu_socket != NULL))
        cli_die("--gpu and --gpu-socket go together (kvd passes both)");
    if ((o->curve_server_key != NULL) != (o->curve_cert != NULL))
        cli_die("--curve-server-key and --curve-cert go together");
    if (o->host != NULL) {
        size_t n = strlen(o->host);
        if (n == 0 || n > 63)
            cli_die("--host: a name of 1 to 63 bytes");
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)o->host[i] <= ' ' || (unsigned char)o->host[i] >= 0x7f ||
                o->host[i] == '"' || o->host[i] == '\\')
                cli_die("--host: printable ASCII without spaces, quotes or backslashes");
        if (o->gpu >= 0)
            cli_die("--host: a worker on another host runs on its CPU (GPU pools are kvd's own)");
        if (o->kv_bytes == 0)
            o->kv_bytes = 1ull << 30;
        /* a step must end well inside the fence time, or the check comes late */
        if (o->step_ms > o->fence_ms / 4)
            o->step_ms = o->fence_ms / 4;
    } else if (o->kv_bytes != 0) {
        cli_die("--kv-memory sizes a pool of this host's own (--host); kvd sizes its own");
    }
    if (o->step_tokens < 1 || o->step_tokens > 4096 || o->max_batch < 1 || o->max_batch > 4096 ||
        o->threads < 0 || o->threads > 256 || o->step_ms < 10 || o->step_ms > 600000)
        cli_die("--step-tokens, --max-batch, --threads or --step-ms out of range");
}

/* Prints why this worker cannot run here and exits so that kvd does not
 * restart it. */
static void __attribute__((noreturn)) unusable(const struct worker *w, const char *why)
{
    fprintf(stderr, "kvd-worker %u: %s\n", w->o.id, why);
    exit(CLI_EXIT_UNUSABLE);
}

/* --gpu: maps the pool's device memory from kvd and starts the GPU engine. */
static void setup_gpu(struct worker *w)
{
    char err[512];
    w->gpu = wgpu_open(w->pool, w->o.gpu, w->o.gpu_socket, err, sizeof(err));
    if (w->gpu == NULL)
        unusable(w, err);
    struct engine_params ep = engine_default_params();
    ep.max_tokens = w->o.step_tokens;
    ep.max_ctx = w->o.ctx;
    ep.n_threads = w->o.threads;
    if (wgpu_engine_start(w->gpu, w->model, &ep, err, sizeof(err)) != 0)
        unusable(w, err);
}

static void say_ready(struct worker *w);

static void setup(struct worker *w)
{
    char err[512];
    const struct options *o = &w->o;
    /* a GPU engine uploads the weights as the file has them: no CPU packing */
    w->model = o->gpu >= 0 ? model_load_unpacked(o->model, err, sizeof(err))
                           : model_load(o->model, err, sizeof(err));
    if (w->model == NULL)
        cli_die("%s", err);
    w->tok = tok_new_from_gguf(w->model->gguf, err, sizeof(err));
    if (w->tok == NULL)
        cli_die("%s", err);
    if (w->o.ctx == 0 || w->o.ctx > w->model->cfg.n_ctx_train)
        w->o.ctx = w->model->cfg.n_ctx_train;
    struct pool_layout lay;
    kv_pool_layout(w->model, o->block_tokens, o->kv.k_type, o->kv.v_type, o->kv.rotate, true, &lay);
    if (o->host != NULL) {
        /* another host than kvd's: compute into this host's own pool, whose
         * index kvd keeps (pool_join) */
        struct pool_params pp = pool_default_params();
        pp.kv_bytes = o->kv_bytes;
        bool created;
        w->pool = pool_join(o->pool, &lay, &pp, &created, err, sizeof(err));
        if (w->pool == NULL)
            cli_die("%s", err);
        if (pool_header(w->pool)->n_blocks > WIRE_MAX_POOL_BLOCKS)
            cli_die("pool %s has %u blocks; kvd indexes at most %u of another host's (a smaller "
                    "--kv-memory, or larger --block-tokens)", o->pool, pool_header(w->pool)->n_blocks,
                    WIRE_MAX_POOL_BLOCKS);
        fprintf(stderr, "kvd-worker %u: host %s: %s pool %s, %u blocks\n", o->id, o->host,
                created ? "created" : "joined", o->pool, pool_header(w->pool)->n_blocks);
    } else {
        w->pool = pool_attach(o->pool, &lay, err, sizeof(err));
    }
    if (w->pool == NULL)
        cli_die("%s", err);
    if (o->gpu >= 0) {
        setup_gpu(w);
    } else {
        if (pool_kv_device(w->pool) >= 0) {
            snprintf(err, sizeof(err), "pool %s keeps its KV data on GPU %d: start the worker with "
                     "--gpu %d", o->pool, pool_kv_device(w->pool), pool_kv_device(w->pool));
            unusable(w, err);
        }
        struct kv_params kp = kv_default_params();
        kp.block_tokens = o->block_tokens;
        kp.k_type = o->kv.k_type;
        kp.v_type = o->kv.v_type;
        kp.rotate = o->kv.rotate;
        kp.n_blocks = pool_header(w->pool)->n_blocks;
        kp.parts = &pool_header(w->pool)->layout.parts;
        w->kv = kvcache_wrap(&w->model->cfg, &kp, pool_data(w->pool), pool_data_bytes(w->pool), err,
                             sizeof(err));
        if (w->kv == NULL)
            cli_die("%s", err);
        struct engine_params ep = engine_default_params();
        ep.max_tokens = o->step_tokens;
        ep.max_ctx = w->o.ctx;
        ep.n_threads = o->threads;
        w->engine = engine_new(w->model, w->kv, &ep, err, sizeof(err));
        if (w->engine == NULL)
            cli_die("%s", err);
    }
    w->batch = calloc(o->max_batch, sizeof(*w->batch));
    w->in_batch = calloc(o->max_batch, sizeof(*w->in_batch));
    w->draws = calloc(o->max_batch, sizeof(*w->draws));
    w->draw_of = calloc(o->max_batch, sizeof(*w->draw_of));
    w->arena = wire_arena_new(4 * (size_t)WIRE_MAX_FRAME + (1u << 20)); /* grows as needed */
    if (w->batch == NULL || w->in_batch == NULL || w->draws == NULL || w->draw_of == NULL || w->arena == NULL)
        cli_die("out of memory");

    w->zctx = zmq_ctx_new();
    w->sock = zmq_socket(w->zctx, ZMQ_DEALER);
    int zero = 0, hwm = 100000;
    int64_t maxmsg = WIRE_MAX_FRAME;
    zmq_setsockopt(w->sock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(w->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(w->sock, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(w->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    if (o->curve_server_key != NULL) {
        /* kvd's worker endpoint is a CURVE server: its key, and our key pair */
        char server[CURVE_KEY_Z85 + 1], why[512];
        struct curve_cert me;
        if (curve_public_key_arg(o->curve_server_key, server, why, sizeof(why)) != 0 ||
            curve_cert_read(o->curve_cert, true, &me, why, sizeof(why)) != 0)
            cli_die("%s", why);
        if (zmq_setsockopt(w->sock, ZMQ_CURVE_SERVERKEY, server, CURVE_KEY_Z85) != 0 ||
            zmq_setsockopt(w->sock, ZMQ_CURVE_PUBLICKEY, me.public_key, CURVE_KEY_Z85) != 0 ||
            zmq_setsockopt(w->sock, ZMQ_CURVE_SECRETKEY, me.secret_key, CURVE_KEY_Z85) != 0)
            cli_die("CURVE: %s", zmq_strerror(errno));
    }
    if (zmq_connect(w->sock, o->endpoint) != 0)
        cli_die("cannot connect to %s: %s", o->endpoint, zmq_strerror(errno));
    say_ready(w);
}

/* Registers with kvd. */
static void say_ready(struct worker *w)
{
    const struct options *o = &w->o;
    const struct pool_layout *lay = &pool_header(w->pool)->layout;
    Kvdw__FromWorker m = KVDW__FROM_WORKER__INIT;
    Kvdw__Ready r = KVDW__READY__INIT;
    r.has_pid = r.has_max_batch = r.has_fingerprint = r.has_block_tokens = true;
    r.pid = (int32_t)getpid();
    r.max_batch = o->max_batch;
    r.fingerprint.data = (uint8_t *)lay->fingerprint;
    r.fingerprint.len = 16;
    r.block_tokens = o->block_tokens;
    r.has_pool_instance = true;     /* kvd's pool's, or (--host) this host's */
    r.pool_instance = pool_header(w->pool)->instance;
    /* a new epoch: whatever kvd sent for an earlier Ready is dropped */
    do {
        w->epoch = (w->epoch ^ (uint64_t)cli_now_ms() * 0x9e3779b97f4a7c15ull) + (uint64_t)getpid() + 1;
    } while (w->epoch == 0);
    r.has_epoch = true;
    r.epoch = w->epoch;
    if (o->host != NULL) {
        r.host = (char *)o->host;
        r.has_pool_blocks = r.has_fence_ms = true;
        r.pool_blocks = pool_header(w->pool)->n_blocks;
        r.fence_ms = o->fence_ms;
    }
    m.body_case = KVDW__FROM_WORKER__BODY_READY;
    m.ready = &r;
    send_msg(w, &m);
    w->last_heard = cli_now_ms();
}

/* --host: kvd has been silent for --fence-ms (the link is down, or kvd
 * declared this worker lost and forgot it). kvd may have handed this
 * worker's blocks to others by now, so it must not write them again: it drops
 * every sequence (kvd resumes them elsewhere) and says Ready again, in case
 * kvd is there and lost only us. */
static void fence(struct worker *w)
{
    fprintf(stderr, "kvd-worker %u: nothing from kvd for %u ms: dropping %u sequences, saying Ready again\n",
            w->o.id, w->o.fence_ms, w->n_seqs);
    while (w->n_seqs > 0)
        remove_seq(w, w->n_seqs - 1);
    say_ready(w);
}

int main(int argc, char **argv)
{
    struct worker w = { 0 };
    cli_init("kvd-worker");
    parse_args(argc, argv, &w.o);
    w.trace = getenv("KVD_WORKER_TRACE") != NULL;
    w.stall_file = getenv("KVD_WORKER_STALL_FILE");
    struct sigaction sa = { 0 };
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    setup(&w);
    send_heartbeat(&w);
    beat_start(&w);
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    while (!stop_flag && !(w.draining && w.n_seqs == 0)) {
        /* wait for messages only when there is nothing to compute: a
         * sequence that asked for blocks still runs on those it holds */
        bool runnable = false;
        for (uint32_t i = 0; i < w.n_seqs && !runnable; i++)
            runnable = !w.seqs[i]->windowing && (!w.seqs[i]->leasing || seq_capacity(&w, w.seqs[i]) > w.seqs[i]->pos);
        zmq_pollitem_t it = { w.sock, 0, ZMQ_POLLIN, 0 };
        long wait = runnable ? 0 : HEARTBEAT_MS;
        if (zmq_poll(&it, 1, wait) < 0 && errno != EINTR)
            cli_die("poll: %s", zmq_strerror(errno));
        /* what waited in the socket first: a step longer than the fence time (a
         * slow, busy CPU) is not kvd's silence. (A process stopped for longer
         * than twice the fence time still reads kvd's last pings as new: the
         * heartbeat thread, which holds the socket during steps, should note
         * them as they come instead.) */
        while (zmq_msg_recv(&msg, w.sock, ZMQ_DONTWAIT) >= 0)
            on_message(&w, zmq_msg_data(&msg), zmq_msg_size(&msg));
        if (w.o.host != NULL && cli_now_ms() - w.last_heard >= w.o.fence_ms)
            fence(&w);
        if (cli_now_ms() - w.last_hb >= HEARTBEAT_MS)
            send_heartbeat(&w);
        uint32_t n = plan_step(&w);
        if (n > 0)
            run_step(&w, n);
    }
    zmq_msg_close(&msg);
    beat_stop(&w);
    /* let go of everything still held, so that kvd can release it */
    while (w.n_seqs > 0) {
        send_done(&w, w.seqs[0], KVDW__DONE_REASON__DONE_CANCELLED, NULL);
        remove_seq(&w, 0);
    }
    free(w.seqs);
    free(w.pending);
    free(w.batch);
    free(w.in_batch);
    free(w.draws);
    free(w.draw_of);
    for (int i = 0; i < GRAM_CACHE; i++)
        gram_put(w.grams[i]);
    grammar_trie_destroy(&w.trie);
    free(w.mask);
    free(w.masked);
    wire_arena_destroy(&w.arena);
    zmq_close(w.sock);
    zmq_ctx_term(w.zctx);
    engine_destroy(&w.engine);
    kvcache_destroy(&w.kv);
    wgpu_close(&w.gpu);
    pool_close(&w.pool);
    tok_destroy(&w.tok);
    model_destroy(&w.model);
    return 0;
}
