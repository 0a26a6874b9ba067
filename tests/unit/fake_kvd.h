/*
 * fake_kvd.h - TEST FIXTURE, not kvd: a scripted stand-in for the daemon's
 * client socket, so that the client library and kvcli can be tested without
 * a daemon (tests/unit/test_client.c, tests/integration/test_client_kvcli.c).
 *
 * A thread serves a ROUTER bound to an ipc:// socket in a fresh temporary
 * directory and answers each request from a script chosen by the request's
 * text (the prompt, or the last chat message): the first word names the
 * scenario.
 *
 *   echo ...      Accepted, then a Final whose text describes the request as
 *                 the fake received it (see describe()), tokens 1 2 3
 *   stream ...    Accepted, Chunk "Hel" [10], Chunk "lo" [11], Final LENGTH
 *                 "Hello" [10 11] with usage 7/4/2 and timings 1/2/3/4 ms
 *   overloaded    Error OVERLOADED "queue full", retry after 250 ms
 *   toolong       Error TOO_LONG before any output
 *   midfail       Accepted, Chunk "par", Error INTERNAL "worker died"
 *   deadline      Accepted, Chunk "par", Final DEADLINE "par"
 *                 (stream, midfail and deadline send chunks only when asked)
 *   cancelled     Accepted, Final CANCELLED "" (cancelled at the daemon)
 *   errcancel     Error CANCELLED
 *   stale ...     replies for other ids around the real stream script
 *   id0           Error BAD_REQUEST with request id 0
 *   garbage       bytes that are no ServerReply
 *   badversion    a reply of protocol version 2
 *   multipart     a reply in two frames
 *   seqgap        Accepted, Chunk seq 0, Chunk seq 2
 *   chunkcount    Accepted, Chunk seq 0, a Final that counts 3 chunks
 *   textdiff      Accepted, Chunk "abc", Final "abd"
 *   early         a Chunk before the Accepted
 *   big           Accepted, a Final with 3 MiB of text
 *   slow          Accepted, then a Chunk "wN " every 20 ms until a cancel for
 *                 it comes (then Final CANCELLED with what was sent), or 400
 *   silent        nothing at all
 *
 * Stats gets a fixed Stats (two workers); health gets ok with 2 workers, or
 * not ok when fake->unhealthy; a cancel gets Accepted when it names the slow
 * request in progress, else Error NOT_FOUND. Every cancel's target is
 * recorded, so tests can check that a client gave up on a request properly.
 */
#ifndef KVD_FAKE_KVD_H
#define KVD_FAKE_KVD_H

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "wire.h"

#define FAKE_KVD_MAX_CANCELS 64

struct fake_kvd {
    char dir[64];               /* temporary directory holding the socket */
    char endpoint[128];         /* ipc://dir/kvd.sock */
    void *ctx, *sock;           /* the ROUTER */
    wire_arena_t *arena;        /* unpacks requests */
    pthread_t thread;
    atomic_bool stop;           /* ends the thread */
    atomic_bool unhealthy;      /* health says not ok */
    pthread_mutex_t mu;         /* guards what follows */
    int n_requests;             /* requests received (all kinds) */
    uint64_t cancels[FAKE_KVD_MAX_CANCELS]; /* targets of the cancels received */
    int n_cancels;
    uint64_t last_generate;     /* id of the last generate received */
    /* the slow stream in progress (thread only) */
    bool slow_on;
    uint64_t slow_id;
    unsigned char slow_peer[256];
    size_t slow_peer_len;
    uint32_t slow_seq;
    char slow_text[8192];
    double slow_next_ms;
};

static inline double fake_kvd_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* 32-bit FNV-1a, so that tests can check a long prompt arrived intact. */
static inline uint32_t fake_kvd_hash(const char *s, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

/* ---- replies -------------------------------------------------------------------- */

static inline void fake_kvd_send_raw(struct fake_kvd *f, const void *peer, size_t peer_len,
                                     const void *buf, size_t len)
{
    zmq_send(f->sock, peer, peer_len, ZMQ_SNDMORE);
    zmq_send(f->sock, buf, len, 0);
}

static inline void fake_kvd_send(struct fake_kvd *f, const void *peer, size_t peer_len,
                                 Kvd__ServerReply *r, uint64_t id)
{
    r->has_version = 1;
    r->version = WIRE_VERSION;
    r->has_request_id = 1;
    r->request_id = id;
    uint8_t *buf;
    size_t len;
    if (wire_pack(&r->base, &buf, &len) != 0)
        abort();
    fake_kvd_send_raw(f, peer, peer_len, buf, len);
    free(buf);
}

static inline void fake_kvd_accepted(struct fake_kvd *f, const void *peer, size_t pl, uint64_t id)
{
    Kvd__Accepted a = KVD__ACCEPTED__INIT;
    a.has_prompt_tokens = 1;
    a.prompt_tokens = 7;
    Kvd__ServerReply r = KVD__SERVER_REPLY__INIT;
    r.body_case = KVD__SERVER_REPLY__BODY_ACCEPTED;
    r.accepted = &a;
    fake_kvd_send(f, peer, pl, &r, id);
}

static inline void fake_kvd_chunk(struct fake_kvd *f, const void *peer, size_t pl, uint64_t id,
                                  uint32_t seq, const char *text, int32_t *tokens, size_t n)
{
    Kvd__Chunk c = KVD__CHUNK__INIT;
    c.has_seq = 1;
    c.seq = seq;
    c.text = (char *)text;
    c.token_ids = tokens;
    c.n_token_ids = n;
    Kvd__ServerReply r = KVD__SERVER_REPLY__INIT;
    r.body_case = KVD__SERVER_REPLY__BODY_CHUNK;
    r.chunk = &c;
    fake_kvd_send(f, peer, pl, &r, id);
}

/* chunks < 0: the field is left out. */
static inline void fake_kvd_final(struct fake_kvd *f, const void *peer, size_t pl, uint64_t id,
                                  Kvd__FinishReason why, const char *text, int32_t *tokens,
                                  size_t n, int chunks)
{
    Kvd__Usage u = KVD__USAGE__INIT;
    u.has_prompt_tokens = u.has_cached_prompt_tokens = u.has_completion_tokens = 1;
    u.prompt_tokens = 7;
    u.cached_prompt_tokens = 4;
    u.completion_tokens = (uint32_t)n;
    Kvd__Timings t = KVD__TIMINGS__INIT;
    t.has_queued_ms = t.has_ttft_ms = t.has_decode_ms = t.has_total_ms = 1;
    t.queued_ms = 1;
    t.ttft_ms = 2;
    t.decode_ms = 3;
    t.total_ms = 4;
    Kvd__Final fi = KVD__FINAL__INIT;
    fi.has_finish_reason = 1;
    fi.finish_reason = why;
    fi.usage = &u;
    fi.timings = &t;
    fi.text = (char *)text;
    fi.token_ids = tokens;
    fi.n_token_ids = n;
    fi.has_chunks = chunks >= 0;
    fi.chunks = chunks >= 0 ? (uint32_t)chunks : 0;
    Kvd__ServerReply r = KVD__SERVER_REPLY__INIT;
    r.body_case = KVD__SERVER_REPLY__BODY_FINAL;
    r.final = &fi;
    fake_kvd_send(f, peer, pl, &r, id);
}

static inline void fake_kvd_error(struct fake_kvd *f, const void *peer, size_t pl, uint64_t id,
                                  Kvd__ErrorCode code, const char *msg, uint32_t retry_ms)
{
    Kvd__Error e = KVD__ERROR__INIT;
    e.has_code = 1;
    e.code = code;
    e.message = (char *)msg;
    e.has_retry_after_ms = retry_ms > 0;
    e.retry_after_ms = retry_ms;
    Kvd__ServerReply r = KVD__SERVER_REPLY__INIT;
    r.body_case = KVD__SERVER_REPLY__BODY_ERROR;
    r.error = &e;
    fake_kvd_send(f, peer, pl, &r, id);
}

/* ---- requests ------------------------------------------------------------------- */

/* Appends printf output to buf (cap bytes). */
static inline void fake_kvd_cat(char *buf, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline void fake_kvd_cat(char *buf, size_t cap, const char *fmt, ...)
{
    size_t n = strlen(buf);
    if (n + 1 >= cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, cap - n, fmt, ap);
    va_end(ap);
}

/* Describes a generate request as one line: its prompt form (text: length
 * and hash; messages: role:content|...; ids: the list), then every option,
 * "-" where unset. */
static inline void fake_kvd_describe(struct fake_kvd *f, const Kvd__GenerateRequest *g,
                                     char *out, size_t cap)
{
    out[0] = '\0';
    const char *text;
    size_t len;
    char why[128];
    if (wire_prompt_text(f->arena, g, &text, &len, why, sizeof(why)) == 0) {
        fake_kvd_cat(out, cap, "%s len=%zu hash=%08x", g->has_prompt_lz4 ? "lz4" : "prompt", len,
                     fake_kvd_hash(text, len));
    } else if (g->n_messages > 0) {
        fake_kvd_cat(out, cap, "msgs=");
        for (size_t i = 0; i < g->n_messages; i++)
            fake_kvd_cat(out, cap, "%s%s:%s", i ? "|" : "", g->messages[i]->role,
                         g->messages[i]->content);
    } else {
        fake_kvd_cat(out, cap, "ids=");
        for (size_t i = 0; i < g->n_token_ids; i++)
            fake_kvd_cat(out, cap, "%s%d", i ? "," : "", g->token_ids[i]);
    }
    const Kvd__SamplingParams *s = g->sampling;
    Kvd__SamplingParams none = KVD__SAMPLING_PARAMS__INIT;
    if (s == NULL)
        s = &none;
#define FK_OPT(name, has, fmt, v) \
    do { if (has) fake_kvd_cat(out, cap, " " name "=" fmt, v); \
         else fake_kvd_cat(out, cap, " " name "=-"); } while (0)
    FK_OPT("temp", s->has_temperature, "%.2f", (double)s->temperature);
    FK_OPT("top_k", s->has_top_k, "%d", s->top_k);
    FK_OPT("top_p", s->has_top_p, "%.2f", (double)s->top_p);
    FK_OPT("min_p", s->has_min_p, "%.2f", (double)s->min_p);
    FK_OPT("rep", s->has_repeat_penalty, "%.2f", (double)s->repeat_penalty);
    FK_OPT("seed", s->has_seed, "%llu", (unsigned long long)s->seed);
    FK_OPT("max", g->has_max_tokens, "%u", g->max_tokens);
    FK_OPT("stream", g->has_stream, "%d", (int)g->stream);
    FK_OPT("deadline", g->has_deadline_ms, "%u", g->deadline_ms);
    FK_OPT("ns", g->namespace_ != NULL, "%s", g->namespace_);
    FK_OPT("eos", g->has_ignore_eos, "%d", (int)g->ignore_eos);
    FK_OPT("nocache", g->has_no_cache, "%d", (int)g->no_cache);
#undef FK_OPT
    fake_kvd_cat(out, cap, " stops=");
    for (size_t i = 0; i < g->n_stop; i++)
        fake_kvd_cat(out, cap, "%s%s", i ? "," : "", g->stop[i]);
}

static inline bool fake_kvd_is(const char *text, const char *word)
{
    size_t n = strlen(word);
    return strncmp(text, word, n) == 0 && (text[n] == '\0' || text[n] == ' ');
}

/* Plays the script of a generate request. */
static inline void fake_kvd_generate(struct fake_kvd *f, const unsigned char *peer, size_t pl,
                                     uint64_t id, const Kvd__GenerateRequest *g)
{
    const char *key = "echo";
    size_t len;
    char why[128];
    if (g->n_messages > 0)
        key = g->messages[g->n_messages - 1]->content;
    else if (wire_prompt_text(f->arena, g, &key, &len, why, sizeof(why)) != 0)
        key = "echo";
    int32_t t10 = 10, t11 = 11, t123[] = { 1, 2, 3 };
    bool stream = g->has_stream && g->stream;

    if (fake_kvd_is(key, "echo")) {
        char desc[2048];
        fake_kvd_describe(f, g, desc, sizeof(desc));
        fake_kvd_accepted(f, peer, pl, id);
        fake_kvd_final(f, peer, pl, id, KVD__FINISH_REASON__FINISH_STOP, desc, t123, 3, -1);
    } else if (fake_kvd_is(key, "stream") || fake_kvd_is(key, "stale")) {
        bool stale = fake_kvd_is(key, "stale");
        if (stale) {
            fake_kvd_final(f, peer, pl, id - 1, KVD__FINISH_REASON__FINISH_STOP, "old", NULL, 0, 0);
            fake_kvd_chunk(f, peer, pl, id + 1000, 0, "nope", &t10, 1);
        }
        fake_kvd_accepted(f, peer, pl, id);
        if (stale)
            fake_kvd_error(f, peer, pl, id - 1, KVD__ERROR_CODE__ERR_INTERNAL, "old failure", 0);
        if (stream) {
            fake_kvd_chunk(f, peer, pl, id, 0, "Hel", &t10, 1);
            if (stale)
                fake_kvd_accepted(f, peer, pl, id + 1);
            fake_kvd_chunk(f, peer, pl, id, 1, "lo", &t11, 1);
        }
        int32_t both[] = { 10, 11 };
        fake_kvd_final(f, peer, pl, id, KVD__FINISH_REASON__FINISH_LENGTH, "Hello", both, 2,
                       stream ? 2 : 0);
    } else if (fake_kvd_is(key, "overloaded")) {
        fake_kvd_error(f, peer, pl, id, KVD__ERROR_CODE__ERR_OVERLOADED, "queue full", 250);
    } else if (fake_kvd_is(key, "toolong")) {
        fake_kvd_error(f, peer, pl, id, KVD__ERROR_CODE__ERR_TOO_LONG,
                       "prompt of 9000 tokens does not fit the context of 2048", 0);
    } else if (fake_kvd_is(key, "midfail")) {
        fake_kvd_accepted(f, peer, pl, id);
        if (stream)
            fake_kvd_chunk(f, peer, pl, id, 0, "par", &t10, 1);
        fake_kvd_error(f, peer, pl, id, KVD__ERROR_CODE__ERR_INTERNAL, "worker died", 0);
    } else if (fake_kvd_is(key, "deadline")) {
        fake_kvd_accepted(f, peer, pl, id);
        if (stream)
            fake_kvd_chunk(f, peer, pl, id, 0, "par", &t10, 1);
        fake_kvd_final(f, peer, pl, id, KVD__FINISH_REASON__FINISH_DEADLINE, "par", &t10, 1,
                       stream ? 1 : 0);
    } else if (fake_kvd_is(key, "cancelled")) {
        fake_kvd_accepted(f, peer, pl, id);
        fake_kvd_final(f, peer, pl, id, KVD__FINISH_REASON__FINISH_CANCELLED, "", NULL, 0, -1);
    } else if (fake_kvd_is(key, "errcancel")) {
        fake_kvd_error(f, peer, pl, id, KVD__ERROR_CODE__ERR_CANCELLED, "cancelled by admin", 0);
    } else if (fake_kvd_is(key, "id0")) {
        fake_kvd_error(f, peer, pl, 0, KVD__ERROR_CODE__ERR_BAD_REQUEST, "unreadable request", 0);
    } else if (fake_kvd_is(key, "garbage")) {
        fake_kvd_send_raw(f, peer, pl, "\xff\xff\xff\xff garbage", 12);
    } else if (fake_kvd_is(key, "badversion")) {
        Kvd__Accepted a = KVD__ACCEPTED__INIT;
        Kvd__ServerReply r = KVD__SERVER_REPLY__INIT;
        r.body_case = KVD__SERVER_REPLY__BODY_ACCEPTED;
        r.accepted = &a;
        r.has_version = r.has_request_id = 1;
        r.version = 2;
        r.request_id = id;
        uint8_t *buf;
        size_t n;
        if (wire_pack(&r.base, &buf, &n) != 0)
            abort();
        fake_kvd_send_raw(f, peer, pl, buf, n);
        free(buf);
    } else if (fake_kvd_is(key, "multipart")) {
        zmq_send(f->sock, peer, pl, ZMQ_SNDMORE);
        zmq_send(f->sock, "", 0, ZMQ_SNDMORE);
        zmq_send(f->sock, "x", 1, 0);
    } else if (fake_kvd_is(key, "seqgap")) {
        fake_kvd_accepted(f, peer, pl, id);
        fake_kvd_chunk(f, peer, pl, id, 0, "a", &t10, 1);
        fake_kvd_chunk(f, peer, pl, id, 2, "b", &t11, 1);
    } else if (fake_kvd_is(key, "chunkcount")) {
        fake_kvd_accepted(f, peer, pl, id);
        fake_kvd_chunk(f, peer, pl, id, 0, "a", &t10, 1);
        fake_kvd_final(f, peer, pl, id, KVD__FINISH_REASON__FINISH_STOP, "a", &t10, 1, 3);
    } else if (fake_kvd_is(key, "textdiff")) {
        fake_kvd_accepted(f, peer, pl, id);
        fake_kvd_chunk(f, peer, pl, id, 0, "abc", &t10, 1);
        fake_kvd_final(f, peer, pl, id, KVD__FINISH_REASON__FINISH_STOP, "abd", &t10, 1, 1);
    } else if (fake_kvd_is(key, "early")) {
        fake_kvd_chunk(f, peer, pl, id, 0, "a", &t10, 1);
    } else if (fake_kvd_is(key, "big")) {
        size_t n = 3u << 20;
        char *text = malloc(n + 1);
        if (text == NULL)
            abort();
        for (size_t i = 0; i < n; i++)
            text[i] = (char)('a' + i % 26);
        text[n] = '\0';
        fake_kvd_accepted(f, peer, pl, id);
        fake_kvd_final(f, peer, pl, id, KVD__FINISH_REASON__FINISH_LENGTH, text, NULL, 0, -1);
        free(text);
    } else if (fake_kvd_is(key, "slow")) {
        fake_kvd_accepted(f, peer, pl, id);
        f->slow_on = true;
        f->slow_id = id;
        memcpy(f->slow_peer, peer, pl);
        f->slow_peer_len = pl;
        f->slow_seq = 0;
        f->slow_text[0] = '\0';
        f->slow_next_ms = fake_kvd_now_ms();
    } else if (fake_kvd_is(key, "silent")) {
        /* nothing */
    } else {
        fake_kvd_error(f, peer, pl, id, KVD__ERROR_CODE__ERR_BAD_REQUEST, "unknown scenario", 0);
    }
}

/* Sends the slow stream's next chunk when it is due, or its end. */
static inline void fake_kvd_tick(struct fake_kvd *f)
{
    if (!f->slow_on || fake_kvd_now_ms() < f->slow_next_ms)
        return;
    int32_t tok = (int32_t)f->slow_seq;
    if (f->slow_seq == 400) {
        fake_kvd_final(f, f->slow_peer, f->slow_peer_len, f->slow_id,
                       KVD__FINISH_REASON__FINISH_LENGTH, f->slow_text, NULL, 0, 400);
        f->slow_on = false;
        return;
    }
    char piece[16];
    snprintf(piece, sizeof(piece), "w%u ", f->slow_seq);
    fake_kvd_cat(f->slow_text, sizeof(f->slow_text), "%s", piece);
    fake_kvd_chunk(f, f->slow_peer, f->slow_peer_len, f->slow_id, f->slow_seq++, piece, &tok, 1);
    f->slow_next_ms += 20;
}

static inline void fake_kvd_handle(struct fake_kvd *f, const unsigned char *peer, size_t pl,
                                   const void *buf, size_t len)
{
    int code;
    char why[200];
    wire_arena_reset(f->arena);
    Kvd__ClientRequest *req = wire_client_request_unpack(f->arena, buf, len, &code, why,
                                                         sizeof(why));
    pthread_mutex_lock(&f->mu);
    f->n_requests++;
    if (req != NULL && req->body_case == KVD__CLIENT_REQUEST__BODY_GENERATE)
        f->last_generate = req->request_id;
    if (req != NULL && req->body_case == KVD__CLIENT_REQUEST__BODY_CANCEL &&
        f->n_cancels < FAKE_KVD_MAX_CANCELS)
        f->cancels[f->n_cancels++] = req->cancel->target;
    pthread_mutex_unlock(&f->mu);
    if (req == NULL) {
        fake_kvd_error(f, peer, pl, 0, KVD__ERROR_CODE__ERR_BAD_REQUEST, why, 0);
        return;
    }
    uint64_t id = req->request_id;
    switch (req->body_case) {
    case KVD__CLIENT_REQUEST__BODY_GENERATE:
        fake_kvd_generate(f, peer, pl, id, req->generate);
        break;
    case KVD__CLIENT_REQUEST__BODY_CANCEL:
        if (f->slow_on && req->cancel->target == f->slow_id) {
            fake_kvd_accepted(f, peer, pl, id);
            fake_kvd_final(f, f->slow_peer, f->slow_peer_len, f->slow_id,
                           KVD__FINISH_REASON__FINISH_CANCELLED, f->slow_text, NULL, 0,
                           (int)f->slow_seq);
            f->slow_on = false;
        } else {
            fake_kvd_error(f, peer, pl, id, KVD__ERROR_CODE__ERR_NOT_FOUND, "no such request", 0);
        }
        break;
    case KVD__CLIENT_REQUEST__BODY_STATS: {
        Kvd__WorkerStats w[2] = { KVD__WORKER_STATS__INIT, KVD__WORKER_STATS__INIT };
        Kvd__WorkerStats *wp[2] = { &w[0], &w[1] };
        for (int i = 0; i < 2; i++) {
            w[i].has_id = w[i].has_pid = w[i].has_alive = w[i].has_running = 1;
            w[i].has_tokens = w[i].has_restarts = 1;
            w[i].id = (uint32_t)i;
            w[i].pid = 1000 + i;
            w[i].alive = i == 0;
            w[i].running = 3 - (uint32_t)i;
            w[i].tokens = 5000 + (uint64_t)i;
            w[i].restarts = (uint32_t)i;
        }
        Kvd__Stats s = KVD__STATS__INIT;
        s.has_requests_running = s.has_requests_queued = s.has_requests_done = 1;
        s.has_requests_failed = s.has_prompt_tokens = s.has_cached_prompt_tokens = 1;
        s.has_completion_tokens = s.has_blocks_total = s.has_blocks_free = 1;
        s.has_blocks_cached = s.has_blocks_in_use = s.has_blocks_pending = 1;
        s.has_evictions = s.has_preemptions = s.has_bad_messages = 1;
        s.has_block_tokens = s.has_block_bytes = 1;
        s.requests_running = 2;
        s.requests_queued = 1;
        s.requests_done = 40;
        s.requests_failed = 3;
        s.prompt_tokens = 1000;
        s.cached_prompt_tokens = 250;
        s.completion_tokens = 500;
        s.blocks_total = 128;
        s.blocks_free = 60;
        s.blocks_cached = 30;
        s.blocks_in_use = 36;
        s.blocks_pending = 2;
        s.block_tokens = 16;
        s.block_bytes = 16 * 2 * 30 * 3 * 64 * 2;
        s.evictions = 5;
        s.preemptions = 1;
        s.bad_messages = 4;
        s.n_workers = 2;
        s.workers = wp;
        Kvd__ServerReply r = KVD__SERVER_REPLY__INIT;
        r.body_case = KVD__SERVER_REPLY__BODY_STATS;
        r.stats = &s;
        fake_kvd_send(f, peer, pl, &r, id);
        break;
    }
    case KVD__CLIENT_REQUEST__BODY_HEALTH: {
        bool bad = atomic_load(&f->unhealthy);
        Kvd__Health h = KVD__HEALTH__INIT;
        h.has_ok = h.has_workers_alive = 1;
        h.ok = !bad;
        h.workers_alive = bad ? 0 : 2;
        h.model = "fake";
        Kvd__ServerReply r = KVD__SERVER_REPLY__INIT;
        r.body_case = KVD__SERVER_REPLY__BODY_HEALTH;
        r.health = &h;
        fake_kvd_send(f, peer, pl, &r, id);
        break;
    }
    default:
        break;
    }
}

static inline void *fake_kvd_main(void *arg)
{
    struct fake_kvd *f = arg;
    while (!atomic_load(&f->stop)) {
        zmq_pollitem_t it = { f->sock, 0, ZMQ_POLLIN, 0 };
        zmq_poll(&it, 1, 5);
        fake_kvd_tick(f);
        if (!(it.revents & ZMQ_POLLIN))
            continue;
        zmq_msg_t peer, body;
        zmq_msg_init(&peer);
        zmq_msg_init(&body);
        if (zmq_msg_recv(&peer, f->sock, ZMQ_DONTWAIT) >= 0 && zmq_msg_more(&peer) &&
            zmq_msg_recv(&body, f->sock, ZMQ_DONTWAIT) >= 0 && zmq_msg_size(&peer) <= 256)
            fake_kvd_handle(f, zmq_msg_data(&peer), zmq_msg_size(&peer), zmq_msg_data(&body),
                            zmq_msg_size(&body));
        zmq_msg_close(&peer);
        zmq_msg_close(&body);
    }
    return NULL;
}

/* Binds the fake in a new temporary directory and starts its thread; NULL
 * when that fails. */
static inline struct fake_kvd *fake_kvd_start(void)
{
    struct fake_kvd *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return NULL;
    snprintf(f->dir, sizeof(f->dir), "/tmp/kvd-fake-XXXXXX");
    if (mkdtemp(f->dir) == NULL) {
        free(f);
        return NULL;
    }
    snprintf(f->endpoint, sizeof(f->endpoint), "ipc://%s/kvd.sock", f->dir);
    pthread_mutex_init(&f->mu, NULL);
    f->arena = wire_arena_new(4 * (size_t)WIRE_MAX_FRAME + WIRE_MAX_PROMPT_BYTES + (1u << 20));
    f->ctx = zmq_ctx_new();
    f->sock = zmq_socket(f->ctx, ZMQ_ROUTER);
    int one = 1, zero = 0;
    int64_t maxmsg = WIRE_MAX_FRAME;
    zmq_setsockopt(f->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    zmq_setsockopt(f->sock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(f->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    if (zmq_bind(f->sock, f->endpoint) != 0 ||
        pthread_create(&f->thread, NULL, fake_kvd_main, f) != 0) {
        fprintf(stderr, "fake_kvd: cannot bind %s: %s\n", f->endpoint, zmq_strerror(errno));
        abort();
    }
    return f;
}

static inline void fake_kvd_stop(struct fake_kvd **fp)
{
    struct fake_kvd *f = *fp;
    if (f == NULL)
        return;
    atomic_store(&f->stop, true);
    pthread_join(f->thread, NULL);
    zmq_close(f->sock);
    zmq_ctx_term(f->ctx);
    wire_arena_destroy(&f->arena);
    char path[128];
    snprintf(path, sizeof(path), "%s/kvd.sock", f->dir);
    unlink(path);
    rmdir(f->dir);
    pthread_mutex_destroy(&f->mu);
    free(f);
    *fp = NULL;
}

/* Whether a cancel for target arrived within wait_ms. */
static inline bool fake_kvd_saw_cancel(struct fake_kvd *f, uint64_t target, int wait_ms)
{
    double end = fake_kvd_now_ms() + wait_ms;
    do {
        pthread_mutex_lock(&f->mu);
        bool seen = false;
        for (int i = 0; i < f->n_cancels; i++)
            seen |= f->cancels[i] == target;
        pthread_mutex_unlock(&f->mu);
        if (seen)
            return true;
        usleep(5000);
    } while (fake_kvd_now_ms() < end);
    return false;
}

static inline uint64_t fake_kvd_last_generate(struct fake_kvd *f)
{
    pthread_mutex_lock(&f->mu);
    uint64_t id = f->last_generate;
    pthread_mutex_unlock(&f->mu);
    return id;
}

#endif
