/*
 * test_wire.c - the wire layer: every message type round-trips through
 * wire_pack and its unpack function (and packs back to the same bytes), and
 * bad frames - garbage, empty, forged lengths, out-of-range fields, lying LZ4
 * sizes, frames too big for the arena's budget - are refused with the
 * expected code and a reason naming the problem.
 *
 * `test_wire --write-corpus DIR` also writes the frames it names (valid
 * messages of every type and a few malformed ones) into DIR: the seed corpus
 * of tests/fuzz/fuzz_wire.c (tests/fuzz/corpus/wire/).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "err.h"
#include "wire.h"

#define BIG_BUDGET ((size_t)64 << 20)

enum kind { CLIENT, REPLY, FROM_WORKER, TO_WORKER };

static wire_arena_t *arena;         /* BIG_BUDGET, reset before every unpack */
static const char *corpus_dir;      /* set by --write-corpus */

static void save(const char *name, const void *buf, size_t len)
{
    if (corpus_dir == NULL || name == NULL)
        return;
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", corpus_dir, name);
    FILE *f = fopen(path, "wb");
    REQUIRE(f != NULL);
    REQUIRE(len == 0 || fwrite(buf, 1, len, f) == len);
    REQUIRE(fclose(f) == 0);
}

static void *unpack_kind(enum kind k, wire_arena_t *a, const void *buf, size_t len, int *code,
                         char *err, size_t errlen)
{
    switch (k) {
    case CLIENT: return wire_client_request_unpack(a, buf, len, code, err, errlen);
    case REPLY: return wire_server_reply_unpack(a, buf, len, code, err, errlen);
    case FROM_WORKER: return wire_from_worker_unpack(a, buf, len, code, err, errlen);
    case TO_WORKER: return wire_to_worker_unpack(a, buf, len, code, err, errlen);
    }
    return NULL;
}

static uint8_t *pack(const void *m, size_t *len)
{
    uint8_t *buf = NULL;
    REQUIRE(wire_pack(m, &buf, len) == 0);
    return buf;
}

/* Packs m, unpacks it as k into the arena and checks that it passes and packs
 * back to the same bytes. Returns the unpacked message (valid until the next
 * reset) or NULL. */
static void *roundtrip_at(enum kind k, const void *m, const char *name, int line)
{
    size_t len;
    uint8_t *buf = pack(m, &len);
    save(name, buf, len);
    wire_arena_reset(arena);
    int code = 1;
    char err[256] = "";
    void *u = unpack_kind(k, arena, buf, len, &code, err, sizeof(err));
    check_count++;
    if (u == NULL || code != 0) {
        check_failures++;
        fprintf(stderr, "%s:%d: %s did not round-trip: %s (%s)\n", __FILE__, line,
                name ? name : "message", kvd_strerror(code), err);
    }
    if (u != NULL) {
        size_t len2;
        uint8_t *buf2 = pack(u, &len2);
        CHECK_INT(len2, len);
        CHECK(len2 == len && memcmp(buf, buf2, len) == 0);
        free(buf2);
    }
    free(buf);
    return u;
}
#define ROUNDTRIP(k, m, name) roundtrip_at((k), (m), (name), __LINE__)

/* Unpacks bytes as k and checks they are refused with `want` and a reason
 * containing `sub` (and on one line). */
static void reject_bytes_at(enum kind k, wire_arena_t *a, const void *buf, size_t len, int want,
                            const char *sub, const char *name, int line)
{
    save(name, buf, len);
    wire_arena_reset(a);
    int code = 0;
    char err[256] = "";
    void *u = unpack_kind(k, a, buf, len, &code, err, sizeof(err));
    check_count++;
    if (u != NULL || code != want || strstr(err, sub) == NULL || strchr(err, '\n') != NULL) {
        check_failures++;
        fprintf(stderr, "%s:%d: expected %s with \"%s\", got %s%s: \"%s\"\n", __FILE__, line,
                kvd_strerror(want), sub, u != NULL ? "success, " : "", kvd_strerror(code), err);
    }
}
#define REJECT_BYTES(k, buf, len, want, sub, name) \
    reject_bytes_at((k), arena, (buf), (len), (want), (sub), (name), __LINE__)

static void reject_at(enum kind k, wire_arena_t *a, const void *m, int want, const char *sub,
                      const char *name, int line)
{
    size_t len;
    uint8_t *buf = pack(m, &len);
    reject_bytes_at(k, a, buf, len, want, sub, name, line);
    free(buf);
}
#define REJECT(k, m, want, sub, name) reject_at((k), arena, (m), (want), (sub), (name), __LINE__)

/* ---- message shells ----------------------------------------------------------------- */

static Kvd__ClientRequest client_generate(Kvd__GenerateRequest *g)
{
    Kvd__ClientRequest r = KVD__CLIENT_REQUEST__INIT;
    r.has_version = 1;
    r.version = WIRE_VERSION;
    r.has_request_id = 1;
    r.request_id = 42;
    r.body_case = KVD__CLIENT_REQUEST__BODY_GENERATE;
    r.generate = g;
    return r;
}

static Kvd__ServerReply reply(Kvd__ServerReply__BodyCase body, void *p)
{
    Kvd__ServerReply r = KVD__SERVER_REPLY__INIT;
    r.has_version = 1;
    r.version = WIRE_VERSION;
    r.has_request_id = 1;
    r.request_id = 42;
    r.body_case = body;
    r.chunk = p;    /* every member of the union is a pointer */
    return r;
}

static Kvdw__FromWorker from_worker(Kvdw__FromWorker__BodyCase body, void *p)
{
    Kvdw__FromWorker r = KVDW__FROM_WORKER__INIT;
    r.has_version = 1;
    r.version = WIRE_VERSION;
    r.has_worker_id = 1;
    r.worker_id = 3;
    r.body_case = body;
    r.ready = p;
    return r;
}

static Kvdw__ToWorker to_worker(Kvdw__ToWorker__BodyCase body, void *p)
{
    Kvdw__ToWorker r = KVDW__TO_WORKER__INIT;
    r.has_version = 1;
    r.version = WIRE_VERSION;
    r.body_case = body;
    r.assign = p;
    return r;
}

static Kvd__SamplingParams full_sampling(void)
{
    Kvd__SamplingParams s = KVD__SAMPLING_PARAMS__INIT;
    s.has_temperature = 1;
    s.temperature = 0.7f;
    s.has_top_k = 1;
    s.top_k = 40;
    s.has_top_p = 1;
    s.top_p = 0.95f;
    s.has_min_p = 1;
    s.min_p = 0.05f;
    s.has_repeat_penalty = 1;
    s.repeat_penalty = 1.1f;
    s.has_seed = 1;
    s.seed = 1234567890123ull;
    return s;
}

static char *repeated_text(size_t n, char c)
{
    char *s = malloc(n + 1);
    REQUIRE(s != NULL);
    memset(s, c, n);
    s[n] = '\0';
    return s;
}

/* ---- round trips ------------------------------------------------------------------- */

static void test_client_roundtrips(void)
{
    /* generate with a plain prompt and every option */
    Kvd__SamplingParams s = full_sampling();
    char *stops[] = { "\n\n", "END" };
    Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
    g.prompt = "Hello, kvd";
    g.sampling = &s;
    g.has_max_tokens = 1;
    g.max_tokens = 64;
    g.n_stop = 2;
    g.stop = stops;
    g.has_stream = 1;
    g.stream = 1;
    g.has_deadline_ms = 1;
    g.deadline_ms = 5000;
    g.namespace_ = "tenant-a";
    g.has_ignore_eos = 1;
    g.ignore_eos = 1;
    g.has_no_cache = 1;
    g.no_cache = 1;
    Kvd__ClientRequest r = client_generate(&g);
    Kvd__ClientRequest *u = ROUNDTRIP(CLIENT, &r, "client_generate_prompt");
    if (u != NULL) {
        CHECK_INT(u->request_id, 42);
        CHECK_INT(u->body_case, KVD__CLIENT_REQUEST__BODY_GENERATE);
        const Kvd__GenerateRequest *ug = u->generate;
        CHECK(strcmp(ug->prompt, "Hello, kvd") == 0);
        CHECK(ug->sampling != NULL && ug->sampling->top_k == 40 && ug->sampling->seed == s.seed);
        CHECK_NEAR(ug->sampling->temperature, 0.7, 1e-7);
        CHECK_INT(ug->n_stop, 2);
        CHECK(strcmp(ug->stop[0], "\n\n") == 0 && strcmp(ug->stop[1], "END") == 0);
        CHECK(ug->stream && ug->ignore_eos && ug->no_cache);
        CHECK_INT(ug->deadline_ms, 5000);
        CHECK(strcmp(ug->namespace_, "tenant-a") == 0);
        CHECK_INT((uintptr_t)u % 16, 0);
        CHECK_INT((uintptr_t)ug->prompt % 16, 0);
        const char *text = NULL;
        size_t len = 0;
        CHECK_INT(wire_prompt_text(arena, ug, &text, &len, NULL, 0), 0);
        CHECK(text == ug->prompt && len == 10);
    }

    /* generate with an LZ4 prompt */
    size_t tlen = 3000;
    char *t = malloc(tlen + 1);
    REQUIRE(t != NULL);
    for (size_t i = 0; i < tlen; i++)
        t[i] = "The quick brown fox jumps over the lazy dog. "[i % 45] + (char)(i % 7 == 0);
    t[tlen] = '\0';
    uint8_t *z = NULL;
    size_t zlen = 0;
    REQUIRE(wire_lz4_compress(t, tlen, &z, &zlen) == 0);
    CHECK(zlen > 0 && zlen < tlen);
    Kvd__GenerateRequest gz = KVD__GENERATE_REQUEST__INIT;
    gz.has_prompt_lz4 = 1;
    gz.prompt_lz4.data = z;
    gz.prompt_lz4.len = zlen;
    gz.has_prompt_lz4_size = 1;
    gz.prompt_lz4_size = (uint32_t)tlen;
    r = client_generate(&gz);
    u = ROUNDTRIP(CLIENT, &r, "client_generate_lz4");
    if (u != NULL) {
        const char *text = NULL;
        size_t len = 0;
        char err[256] = "";
        CHECK_INT(wire_prompt_text(arena, u->generate, &text, &len, err, sizeof(err)), 0);
        CHECK(len == tlen && text != NULL && memcmp(text, t, tlen) == 0 && text[tlen] == '\0');
    }
    free(z);
    free(t);

    /* generate with chat messages */
    Kvd__ChatMessage m0 = KVD__CHAT_MESSAGE__INIT, m1 = KVD__CHAT_MESSAGE__INIT,
                     m2 = KVD__CHAT_MESSAGE__INIT;
    m0.role = "system";
    m0.content = "You are terse.";
    m1.role = "user";
    m1.content = "Hi?";
    m2.role = "assistant";
    m2.content = "";
    Kvd__ChatMessage *msgs[] = { &m0, &m1, &m2 };
    Kvd__GenerateRequest gm = KVD__GENERATE_REQUEST__INIT;
    gm.n_messages = 3;
    gm.messages = msgs;
    r = client_generate(&gm);
    u = ROUNDTRIP(CLIENT, &r, "client_generate_messages");
    if (u != NULL) {
        CHECK_INT(u->generate->n_messages, 3);
        CHECK(strcmp(u->generate->messages[1]->content, "Hi?") == 0);
        CHECK(strcmp(u->generate->messages[2]->content, "") == 0);
        const char *text;
        size_t len;
        CHECK_INT(wire_prompt_text(arena, u->generate, &text, &len, NULL, 0), KVD_ENOTFOUND);
    }

    /* generate with token ids */
    int32_t ids[] = { 0, 1, 300, 70000, INT32_MAX };
    Kvd__GenerateRequest gt = KVD__GENERATE_REQUEST__INIT;
    gt.n_token_ids = 5;
    gt.token_ids = ids;
    r = client_generate(&gt);
    u = ROUNDTRIP(CLIENT, &r, "client_generate_tokens");
    if (u != NULL) {
        CHECK_INT(u->generate->n_token_ids, 5);
        CHECK_INT(u->generate->token_ids[4], INT32_MAX);
        const char *text;
        size_t len;
        CHECK_INT(wire_prompt_text(arena, u->generate, &text, &len, NULL, 0), KVD_ENOTFOUND);
    }

    Kvd__CancelRequest c = KVD__CANCEL_REQUEST__INIT;
    c.has_target = 1;
    c.target = 41;
    r = client_generate(NULL);
    r.body_case = KVD__CLIENT_REQUEST__BODY_CANCEL;
    r.cancel = &c;
    u = ROUNDTRIP(CLIENT, &r, "client_cancel");
    CHECK(u != NULL && u->cancel->target == 41);

    Kvd__StatsRequest st = KVD__STATS_REQUEST__INIT;
    r.body_case = KVD__CLIENT_REQUEST__BODY_STATS;
    r.stats = &st;
    u = ROUNDTRIP(CLIENT, &r, "client_stats");
    CHECK(u != NULL && u->body_case == KVD__CLIENT_REQUEST__BODY_STATS);

    Kvd__HealthRequest h = KVD__HEALTH_REQUEST__INIT;
    r.body_case = KVD__CLIENT_REQUEST__BODY_HEALTH;
    r.health = &h;
    u = ROUNDTRIP(CLIENT, &r, "client_health");
    CHECK(u != NULL && u->body_case == KVD__CLIENT_REQUEST__BODY_HEALTH);
}

static void test_reply_roundtrips(void)
{
    Kvd__Accepted acc = KVD__ACCEPTED__INIT;
    acc.has_prompt_tokens = 1;
    acc.prompt_tokens = 17;
    acc.has_queue_position = 1;
    acc.queue_position = 2;
    Kvd__ServerReply r = reply(KVD__SERVER_REPLY__BODY_ACCEPTED, &acc);
    Kvd__ServerReply *u = ROUNDTRIP(REPLY, &r, "reply_accepted");
    CHECK(u != NULL && u->accepted->prompt_tokens == 17 && u->accepted->queue_position == 2);

    int32_t toks[] = { 9, 8, 7 };
    Kvd__Chunk ch = KVD__CHUNK__INIT;
    ch.has_seq = 1;
    ch.seq = 5;
    ch.n_token_ids = 3;
    ch.token_ids = toks;
    ch.text = "abc";
    r = reply(KVD__SERVER_REPLY__BODY_CHUNK, &ch);
    u = ROUNDTRIP(REPLY, &r, "reply_chunk");
    CHECK(u != NULL && u->chunk->seq == 5 && u->chunk->n_token_ids == 3 &&
          strcmp(u->chunk->text, "abc") == 0);

    Kvd__Usage us = KVD__USAGE__INIT;
    us.has_prompt_tokens = 1;
    us.prompt_tokens = 17;
    us.has_cached_prompt_tokens = 1;
    us.cached_prompt_tokens = 16;
    us.has_completion_tokens = 1;
    us.completion_tokens = 3;
    Kvd__Timings tm = KVD__TIMINGS__INIT;
    tm.has_queued_ms = 1;
    tm.queued_ms = 0.5;
    tm.has_ttft_ms = 1;
    tm.ttft_ms = 12.25;
    tm.has_decode_ms = 1;
    tm.decode_ms = 30;
    tm.has_total_ms = 1;
    tm.total_ms = 42.75;
    Kvd__Final fin = KVD__FINAL__INIT;
    fin.has_finish_reason = 1;
    fin.finish_reason = KVD__FINISH_REASON__FINISH_LENGTH;
    fin.usage = &us;
    fin.timings = &tm;
    fin.text = "abc";
    fin.n_token_ids = 3;
    fin.token_ids = toks;
    fin.has_chunks = 1;
    fin.chunks = 6;
    r = reply(KVD__SERVER_REPLY__BODY_FINAL, &fin);
    u = ROUNDTRIP(REPLY, &r, "reply_final");
    if (u != NULL) {
        CHECK_INT(u->final->finish_reason, KVD__FINISH_REASON__FINISH_LENGTH);
        CHECK(u->final->usage != NULL && u->final->usage->cached_prompt_tokens == 16);
        CHECK(u->final->timings != NULL && u->final->timings->total_ms == 42.75);
        CHECK_INT(u->final->chunks, 6);
    }

    Kvd__Error e = KVD__ERROR__INIT;
    e.has_code = 1;
    e.code = KVD__ERROR_CODE__ERR_OVERLOADED;
    e.message = "queue full";
    e.has_retry_after_ms = 1;
    e.retry_after_ms = 250;
    r = reply(KVD__SERVER_REPLY__BODY_ERROR, &e);
    u = ROUNDTRIP(REPLY, &r, "reply_error");
    CHECK(u != NULL && u->error->code == KVD__ERROR_CODE__ERR_OVERLOADED &&
          u->error->retry_after_ms == 250 && strcmp(u->error->message, "queue full") == 0);

    Kvd__WorkerStats w0 = KVD__WORKER_STATS__INIT, w1 = KVD__WORKER_STATS__INIT;
    w0.has_id = 1;
    w0.id = 0;
    w0.has_pid = 1;
    w0.pid = 1234;
    w0.has_alive = 1;
    w0.alive = 1;
    w1.has_id = 1;
    w1.id = 1;
    w1.has_restarts = 1;
    w1.restarts = 2;
    Kvd__WorkerStats *ws[] = { &w0, &w1 };
    Kvd__Stats sts = KVD__STATS__INIT;
    sts.has_requests_done = 1;
    sts.requests_done = 1000;
    sts.has_blocks_total = 1;
    sts.blocks_total = 4096;
    sts.n_workers = 2;
    sts.workers = ws;
    sts.has_block_bytes = 1;
    sts.block_bytes = 1ull << 21;
    r = reply(KVD__SERVER_REPLY__BODY_STATS, &sts);
    u = ROUNDTRIP(REPLY, &r, "reply_stats");
    CHECK(u != NULL && u->stats->n_workers == 2 && u->stats->workers[0]->pid == 1234 &&
          u->stats->workers[1]->restarts == 2 && u->stats->block_bytes == 1ull << 21);

    Kvd__Health he = KVD__HEALTH__INIT;
    he.has_ok = 1;
    he.ok = 1;
    he.has_workers_alive = 1;
    he.workers_alive = 2;
    he.model = "qwen2.5-0.5b-instruct-q8_0";
    r = reply(KVD__SERVER_REPLY__BODY_HEALTH, &he);
    u = ROUNDTRIP(REPLY, &r, "reply_health");
    CHECK(u != NULL && u->health->ok && strcmp(u->health->model, he.model) == 0);
}

static void test_worker_roundtrips(void)
{
    uint8_t fp[16];
    for (int i = 0; i < 16; i++)
        fp[i] = (uint8_t)(i * 17);
    Kvdw__Ready rd = KVDW__READY__INIT;
    rd.has_pid = 1;
    rd.pid = 4321;
    rd.has_max_batch = 1;
    rd.max_batch = 8;
    rd.has_fingerprint = 1;
    rd.fingerprint.data = fp;
    rd.fingerprint.len = 16;
    rd.has_block_tokens = 1;
    rd.block_tokens = 16;
    Kvdw__FromWorker f = from_worker(KVDW__FROM_WORKER__BODY_READY, &rd);
    Kvdw__FromWorker *u = ROUNDTRIP(FROM_WORKER, &f, "worker_ready");
    CHECK(u != NULL && u->worker_id == 3 && u->ready->fingerprint.len == 16 &&
          memcmp(u->ready->fingerprint.data, fp, 16) == 0 && u->ready->block_tokens == 16);

    Kvdw__Heartbeat hb = KVDW__HEARTBEAT__INIT;
    hb.has_progress = 1;
    hb.progress = 99;
    hb.has_running = 1;
    hb.running = 2;
    f = from_worker(KVDW__FROM_WORKER__BODY_HEARTBEAT, &hb);
    u = ROUNDTRIP(FROM_WORKER, &f, "worker_heartbeat");
    CHECK(u != NULL && u->heartbeat->progress == 99);

    Kvdw__Commit cm = KVDW__COMMIT__INIT;
    cm.has_seq_id = 1;
    cm.seq_id = 7;
    cm.has_n_written = 1;
    cm.n_written = 100;
    f = from_worker(KVDW__FROM_WORKER__BODY_COMMIT, &cm);
    u = ROUNDTRIP(FROM_WORKER, &f, "worker_commit");
    CHECK(u != NULL && u->commit->seq_id == 7 && u->commit->n_written == 100);

    int32_t toks[] = { 5, 6 };
    Kvdw__TokenChunk tc = KVDW__TOKEN_CHUNK__INIT;
    tc.has_seq_id = 1;
    tc.seq_id = 7;
    tc.n_tokens = 2;
    tc.tokens = toks;
    tc.has_n_written = 1;
    tc.n_written = 101;
    f = from_worker(KVDW__FROM_WORKER__BODY_CHUNK, &tc);
    u = ROUNDTRIP(FROM_WORKER, &f, "worker_chunk");
    CHECK(u != NULL && u->chunk->n_tokens == 2 && u->chunk->tokens[1] == 6);

    Kvdw__LeaseRequest ls = KVDW__LEASE_REQUEST__INIT;
    ls.has_seq_id = 1;
    ls.seq_id = 7;
    ls.has_n_positions = 1;
    ls.n_positions = 128;
    f = from_worker(KVDW__FROM_WORKER__BODY_LEASE, &ls);
    u = ROUNDTRIP(FROM_WORKER, &f, "worker_lease");
    CHECK(u != NULL && u->lease->n_positions == 128);

    Kvdw__Done dn = KVDW__DONE__INIT;
    dn.has_seq_id = 1;
    dn.seq_id = 7;
    dn.has_reason = 1;
    dn.reason = KVDW__DONE_REASON__DONE_ERROR;
    dn.has_n_written = 1;
    dn.n_written = 101;
    dn.error = "CUDA error: out of memory";
    f = from_worker(KVDW__FROM_WORKER__BODY_DONE, &dn);
    u = ROUNDTRIP(FROM_WORKER, &f, "worker_done");
    CHECK(u != NULL && u->done->reason == KVDW__DONE_REASON__DONE_ERROR &&
          strcmp(u->done->error, dn.error) == 0);

    Kvd__SamplingParams s = full_sampling();
    int32_t hist[] = { 1, 2, 3, 4, 5 };
    uint32_t blocks[] = { 10, 11 };
    Kvdw__Assign as = KVDW__ASSIGN__INIT;
    as.has_seq_id = 1;
    as.seq_id = 7;
    as.n_tokens = 5;
    as.tokens = hist;
    as.has_n_cached = 1;
    as.n_cached = 4;
    as.n_blocks = 2;
    as.blocks = blocks;
    as.sampling = &s;
    as.has_max_new = 1;
    as.max_new = 32;
    as.has_ignore_eos = 1;
    as.ignore_eos = 0;
    as.has_n_generated = 1;
    as.n_generated = 2;
    Kvdw__ToWorker t = to_worker(KVDW__TO_WORKER__BODY_ASSIGN, &as);
    Kvdw__ToWorker *v = ROUNDTRIP(TO_WORKER, &t, "to_worker_assign");
    CHECK(v != NULL && v->assign->n_tokens == 5 && v->assign->n_blocks == 2 &&
          v->assign->blocks[1] == 11 && v->assign->n_cached == 4 && v->assign->n_generated == 2 &&
          v->assign->sampling != NULL && v->assign->sampling->top_k == 40);

    uint32_t more[] = { 12 };
    Kvdw__Grant gr = KVDW__GRANT__INIT;
    gr.has_seq_id = 1;
    gr.seq_id = 7;
    gr.n_blocks = 1;
    gr.blocks = more;
    t = to_worker(KVDW__TO_WORKER__BODY_GRANT, &gr);
    v = ROUNDTRIP(TO_WORKER, &t, "to_worker_grant");
    CHECK(v != NULL && v->grant->n_blocks == 1 && v->grant->blocks[0] == 12);

    Kvdw__Cancel cn = KVDW__CANCEL__INIT;
    cn.has_seq_id = 1;
    cn.seq_id = 7;
    t = to_worker(KVDW__TO_WORKER__BODY_CANCEL, &cn);
    v = ROUNDTRIP(TO_WORKER, &t, "to_worker_cancel");
    CHECK(v != NULL && v->cancel->seq_id == 7);

    Kvdw__Drain dr = KVDW__DRAIN__INIT;
    t = to_worker(KVDW__TO_WORKER__BODY_DRAIN, &dr);
    v = ROUNDTRIP(TO_WORKER, &t, "to_worker_drain");
    CHECK(v != NULL && v->body_case == KVDW__TO_WORKER__BODY_DRAIN);

    Kvdw__Ping pg = KVDW__PING__INIT;
    t = to_worker(KVDW__TO_WORKER__BODY_PING, &pg);
    v = ROUNDTRIP(TO_WORKER, &t, NULL);
    CHECK(v != NULL && v->body_case == KVDW__TO_WORKER__BODY_PING);
}

/* ---- bad frames ------------------------------------------------------------------------ */

static void test_bad_frames(void)
{
    static const uint8_t garbage[] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x07, 0x13 };
    REJECT_BYTES(CLIENT, garbage, sizeof(garbage), KVD_EFORMAT, "not a valid ClientRequest",
                 "bad_garbage");
    REJECT_BYTES(TO_WORKER, garbage, sizeof(garbage), KVD_EFORMAT, "not a valid", NULL);

    /* an empty frame would be a valid empty message; it has no version */
    static const uint8_t one[1] = { 0 };
    REJECT_BYTES(CLIENT, one, 0, KVD_EFORMAT, "empty frame", "bad_empty");
    REJECT_BYTES(REPLY, one, 0, KVD_EFORMAT, "empty frame", NULL);
    REJECT_BYTES(FROM_WORKER, one, 0, KVD_EFORMAT, "empty frame", NULL);
    REJECT_BYTES(TO_WORKER, one, 0, KVD_EFORMAT, "empty frame", NULL);

    /* version 1, request_id 7, then field 3 (generate) claiming 2^31 bytes */
    static const uint8_t huge[] = { 0x08, 0x01, 0x10, 0x07, 0x1a, 0x80, 0x80, 0x80, 0x80, 0x08,
                                    'x', 'y' };
    REJECT_BYTES(CLIENT, huge, sizeof(huge), KVD_EFORMAT, "not a valid ClientRequest",
                 "bad_huge_length");
    /* the same claim as a string length inside generate.prompt */
    static const uint8_t huge2[] = { 0x08, 0x01, 0x10, 0x07, 0x1a, 0x07, 0x0a, 0xff, 0xff, 0xff,
                                     0xff, 0x0f, 'a' };
    REJECT_BYTES(CLIENT, huge2, sizeof(huge2), KVD_EFORMAT, "not a valid", "bad_huge_string");

    /* version sent as a length-delimited field: wrong wire type */
    static const uint8_t wiretype[] = { 0x0a, 0x01, 0x01, 0x10, 0x07 };
    REJECT_BYTES(CLIENT, wiretype, sizeof(wiretype), KVD_EFORMAT, "not a valid",
                 NULL);

    /* a frame over WIRE_MAX_FRAME is refused before a byte of it is read */
    REJECT_BYTES(CLIENT, one, (size_t)WIRE_MAX_FRAME + 1, KVD_EFORMAT, "exceeds the limit", NULL);
    REJECT_BYTES(FROM_WORKER, one, SIZE_MAX, KVD_EFORMAT, "exceeds the limit", NULL);

    /* a valid frame cut short */
    Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
    g.prompt = "Once upon a time";
    Kvd__ClientRequest r = client_generate(&g);
    size_t len;
    uint8_t *buf = pack(&r, &len);
    REJECT_BYTES(CLIENT, buf, len - 3, KVD_EFORMAT, "not a valid", "bad_truncated");
    /* and read as the wrong message type: field 3 of FromWorker is Ready,
     * whose field 1 (pid) is a varint, not a string */
    REJECT_BYTES(FROM_WORKER, buf, len, KVD_EFORMAT, "not a valid", NULL);
    free(buf);

    /* the last of a repeated scalar wins (protobuf semantics): version 2 then 1 */
    static const uint8_t twice[] = { 0x08, 0x02, 0x08, 0x01, 0x10, 0x07, 0x2a, 0x00 };
    wire_arena_reset(arena);
    int code = 1;
    CHECK(wire_client_request_unpack(arena, twice, sizeof(twice), &code, NULL, 0) != NULL);
    CHECK_INT(code, 0);

    /* unknown fields are accepted and ignored (a newer peer may add some) */
    static const uint8_t unknown[] = { 0x08, 0x01, 0x10, 0x07, 0x2a, 0x00,
                                       0xa0, 0x06, 0x05, 0xaa, 0x06, 0x02, 'h', 'i' };
    wire_arena_reset(arena);
    Kvd__ClientRequest *u = wire_client_request_unpack(arena, unknown, sizeof(unknown), &code,
                                                       NULL, 0);
    CHECK(u != NULL && u->body_case == KVD__CLIENT_REQUEST__BODY_STATS);
    save("client_unknown_fields", unknown, sizeof(unknown));

    /* ... but not one numbered 0 (found by the fuzzer: protobuf-c reads it
     * from a two-byte tag, then packs it as a one-byte tag it refuses), in a
     * nested message, nor one numbered above 2^29 - 1 */
    static const uint8_t field0[] = { 0x08, 0x01, 0x10, 0x2a, 0x3a, 0x0a,
                                      0x18, 0xe8, 0x07, 0x82, 0x00, 0x04, 0x08, 0x00, 0x10, 0x01 };
    REJECT_BYTES(REPLY, field0, sizeof(field0), KVD_EFORMAT,
                 "Stats has a field numbered 0, not valid protobuf", NULL);
    static const uint8_t field_big[] = { 0x08, 0x01, 0x10, 0x07, 0x2a, 0x00,
                                         0xf8, 0xff, 0xff, 0xff, 0x1f, 0x01 };
    REJECT_BYTES(CLIENT, field_big, sizeof(field_big), KVD_EFORMAT,
                 "ClientRequest has a field numbered 1073741823", NULL);
}

static void test_client_rejects(void)
{
    Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
    g.prompt = "Hi";
    Kvd__ClientRequest r = client_generate(&g);

    r.version = 2;
    REJECT(CLIENT, &r, KVD_EUNSUPPORTED, "protocol version 2, expected 1", "bad_version");
    r.has_version = 0;
    REJECT(CLIENT, &r, KVD_EFORMAT, "ClientRequest has no version", NULL);
    r = client_generate(&g);
    r.has_request_id = 0;
    REJECT(CLIENT, &r, KVD_EFORMAT, "ClientRequest has no request_id", NULL);
    r = client_generate(NULL);
    r.body_case = KVD__CLIENT_REQUEST__BODY__NOT_SET;
    REJECT(CLIENT, &r, KVD_EFORMAT, "ClientRequest has no body", NULL);
    /* a hand-built message whose body pointer is NULL */
    r.body_case = KVD__CLIENT_REQUEST__BODY_GENERATE;
    CHECK_INT(wire_check_client_request(&r, NULL, 0), KVD_EFORMAT);

    Kvd__CancelRequest c = KVD__CANCEL_REQUEST__INIT;
    r.body_case = KVD__CLIENT_REQUEST__BODY_CANCEL;
    r.cancel = &c;
    REJECT(CLIENT, &r, KVD_EFORMAT, "cancel has no target", NULL);

    /* prompt forms: none, an empty prompt (counts as none), two */
    Kvd__GenerateRequest g0 = KVD__GENERATE_REQUEST__INIT;
    r = client_generate(&g0);
    REJECT(CLIENT, &r, KVD_EFORMAT, "generate has no prompt", NULL);
    g0.prompt = "";
    REJECT(CLIENT, &r, KVD_EFORMAT, "generate has no prompt", NULL);
    int32_t ids[] = { 1, -5, 3 };
    g0.prompt = "text";
    g0.n_token_ids = 1;
    g0.token_ids = ids;
    REJECT(CLIENT, &r, KVD_EFORMAT, "generate has 2 prompt forms (prompt, token_ids), exactly one",
           "bad_two_prompts");

    /* token ids */
    Kvd__GenerateRequest gt = KVD__GENERATE_REQUEST__INIT;
    gt.n_token_ids = 3;
    gt.token_ids = ids;
    r = client_generate(&gt);
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.token_ids[1] = -5 is negative", "bad_negative_token");
    size_t nmany = (size_t)WIRE_MAX_TOKENS + 1;
    int32_t *many = calloc(nmany, sizeof(*many));
    REQUIRE(many != NULL);
    gt.n_token_ids = nmany;
    gt.token_ids = many;
    REJECT(CLIENT, &r, KVD_ETOOLONG, "generate.token_ids has 1048577 ids, over the limit", NULL);
    gt.n_token_ids = WIRE_MAX_TOKENS;
    size_t len;
    uint8_t *buf = pack(&r, &len);
    wire_arena_reset(arena);
    int code = 1;
    CHECK(wire_client_request_unpack(arena, buf, len, &code, NULL, 0) != NULL);
    free(buf);
    free(many);

    /* sampling parameters */
    Kvd__SamplingParams s = KVD__SAMPLING_PARAMS__INIT;
    Kvd__GenerateRequest gs = KVD__GENERATE_REQUEST__INIT;
    gs.prompt = "Hi";
    gs.sampling = &s;
    r = client_generate(&gs);
    s.has_temperature = 1;
    s.temperature = NAN;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.temperature = nan is outside [0, 100]",
           "bad_nan_temperature");
    s.temperature = INFINITY;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.temperature = inf", NULL);
    s.temperature = -0.5f;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.temperature = -0.5", NULL);
    s.temperature = 1e30f;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.temperature = 1e+30", NULL);
    s.temperature = 0;    /* greedy */
    s.has_top_p = 1;
    s.top_p = 1.5f;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.top_p = 1.5 is outside [0, 1]", NULL);
    s.top_p = 1;
    s.has_min_p = 1;
    s.min_p = -0.25f;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.min_p = -0.25 is outside [0, 1]", NULL);
    s.min_p = 0;
    s.has_top_k = 1;
    s.top_k = -1;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.top_k = -1 is outside [0, 1048576]", NULL);
    s.top_k = 1 << 21;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.top_k = 2097152", NULL);
    s.top_k = 0;
    s.has_repeat_penalty = 1;
    s.repeat_penalty = 0;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.repeat_penalty = 0 is outside (0, 10]",
           NULL);
    s.repeat_penalty = 10.5f;       /* past the sampler's range: refused here, not failed by a worker */
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.repeat_penalty = 10.5 is outside (0, 10]", NULL);
    s.repeat_penalty = 10;
    s.has_presence_penalty = 1;
    s.presence_penalty = -2.5f;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.presence_penalty = -2.5 is outside [-2, 2]", NULL);
    s.presence_penalty = -2;
    s.has_frequency_penalty = 1;
    s.frequency_penalty = NAN;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.frequency_penalty = nan is outside [-2, 2]", NULL);
    s.frequency_penalty = 2;
    int32_t lb_ids[3] = { 5, 9, 5 };
    float lb[3] = { 1, -100, 100 };
    s.logit_bias_ids = lb_ids;
    s.logit_bias = lb;
    s.n_logit_bias_ids = 3;
    s.n_logit_bias = 2;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.logit_bias: 3 ids and 2 values", NULL);
    s.n_logit_bias = 3;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.logit_bias_ids: 5 appears twice", NULL);
    lb_ids[2] = -1;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.logit_bias_ids[2] = -1 is negative", NULL);
    lb_ids[2] = 7;
    lb[1] = -100.5f;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.sampling.logit_bias = -100.5 is outside [-100, 100]", NULL);
    lb[1] = -100;
    ROUNDTRIP(CLIENT, &r, NULL);     /* every bound is inclusive where it should be */

    /* limits of the other options */
    Kvd__GenerateRequest go = KVD__GENERATE_REQUEST__INIT;
    go.prompt = "Hi";
    r = client_generate(&go);
    go.has_max_tokens = 1;
    go.max_tokens = WIRE_MAX_NEW_TOKENS + 1;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.max_tokens = 1048577 is over the limit", NULL);
    go.max_tokens = WIRE_MAX_NEW_TOKENS;
    go.has_deadline_ms = 1;
    go.deadline_ms = WIRE_MAX_DEADLINE_MS + 1;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.deadline_ms = 86400001 is over the limit", NULL);
    go.deadline_ms = WIRE_MAX_DEADLINE_MS;
    go.has_logprobs = 1;
    go.logprobs = WIRE_MAX_TOP_LOGPROBS + 1;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.logprobs = 21 is over the limit of 20", NULL);
    go.logprobs = WIRE_MAX_TOP_LOGPROBS;
    ROUNDTRIP(CLIENT, &r, NULL);
    char *ns = repeated_text(WIRE_MAX_NAMESPACE + 1, 'n');
    go.namespace_ = ns;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.namespace is 257 bytes, over the limit of 256", NULL);
    ns[WIRE_MAX_NAMESPACE] = '\0';
    ROUNDTRIP(CLIENT, &r, NULL);
    go.namespace_ = NULL;
    free(ns);

    /* stop strings */
    char *stops[WIRE_MAX_STOPS + 1];
    for (size_t i = 0; i <= WIRE_MAX_STOPS; i++)
        stops[i] = "stop";
    go.n_stop = WIRE_MAX_STOPS + 1;
    go.stop = stops;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.stop has 17 strings, over the limit of 16",
           "bad_too_many_stops");
    go.n_stop = WIRE_MAX_STOPS;
    ROUNDTRIP(CLIENT, &r, NULL);
    stops[3] = "";
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.stop[3] is 0 bytes, outside [1, 256]", NULL);
    char *long_stop = repeated_text(WIRE_MAX_STOP_BYTES + 1, 's');
    stops[3] = long_stop;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.stop[3] is 257 bytes", NULL);
    stops[3] = "stop";
    free(long_stop);

    /* chat messages */
    Kvd__ChatMessage m0 = KVD__CHAT_MESSAGE__INIT;
    m0.role = "robot\n\x01\"";
    m0.content = "beep";
    Kvd__ChatMessage *msgs[1] = { &m0 };
    Kvd__GenerateRequest gm = KVD__GENERATE_REQUEST__INIT;
    gm.n_messages = 1;
    gm.messages = msgs;
    r = client_generate(&gm);
    REJECT(CLIENT, &r, KVD_ERANGE,
           "generate.messages[0].role = \"robot\\x0a\\x01\\x22\" is not system, user, assistant or tool",
           "bad_role");
    char *long_role = repeated_text(1000, 'r');
    m0.role = long_role;
    REJECT(CLIENT, &r, KVD_ERANGE, "rrr...\" is not system", NULL);
    free(long_role);
    m0.role = NULL;
    REJECT(CLIENT, &r, KVD_EFORMAT, "generate.messages[0] has no role", NULL);
    m0.role = "user";
    m0.content = NULL;
    REJECT(CLIENT, &r, KVD_EFORMAT, "generate.messages[0] has no content", NULL);
    m0.content = "";
    /* tools: an assistant's calls only, bounded; tool_choice needs tools */
    char *call = "{\"name\": \"f\", \"arguments\": {}}";
    m0.n_tool_calls = 1;
    m0.tool_calls = &call;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.messages[0] has 1 tool calls (at most 64, an assistant's)", NULL);
    m0.role = "assistant";
    CHECK_INT(wire_check_client_request(&r, NULL, 0), 0);
    m0.role = "tool";
    m0.n_tool_calls = 0;
    CHECK_INT(wire_check_client_request(&r, NULL, 0), 0);
    m0.role = "user";
    char *defs[WIRE_MAX_TOOLS + 1];
    for (unsigned i = 0; i <= WIRE_MAX_TOOLS; i++)
        defs[i] = "{\"name\":\"f\"}";
    gm.tools = defs;
    gm.n_tools = WIRE_MAX_TOOLS + 1;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.tools has 65 functions, over the limit of 64", NULL);
    gm.n_tools = 1;
    CHECK_INT(wire_check_client_request(&r, NULL, 0), 0);
    gm.tool_choice = "required";
    gm.has_json_object = gm.json_object = 1;
    REJECT(CLIENT, &r, KVD_EINVAL, "tool_choice and structured output are exclusive", NULL);
    gm.has_json_object = gm.json_object = 0;
    CHECK_INT(wire_check_client_request(&r, NULL, 0), 0);
    gm.n_tools = 0;
    REJECT(CLIENT, &r, KVD_EINVAL, "generate.tool_choice needs tools", NULL);
    gm.tool_choice = NULL;
    gm.tools = NULL;
    msgs[0] = NULL;     /* hand-built only: protobuf-c never produces this */
    CHECK_INT(wire_check_client_request(&r, NULL, 0), KVD_EFORMAT);
    msgs[0] = &m0;
    /* too many messages, and too much content */
    Kvd__ChatMessage **lots = malloc(50000 * sizeof(*lots));
    REQUIRE(lots != NULL);
    for (int i = 0; i < 50000; i++)
        lots[i] = &m0;
    gm.n_messages = WIRE_MAX_MESSAGES + 1;
    gm.messages = lots;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.messages has 1025 entries, over the limit of 1024",
           NULL);
    gm.n_messages = 2;
    char *half = repeated_text(WIRE_MAX_PROMPT_BYTES / 2 + 1, 'h');
    m0.content = half;
    REJECT(CLIENT, &r, KVD_ETOOLONG, "generate.messages hold 8388610 bytes of content", NULL);
    free(half);
    m0.content = "";

    /* a frame of many tiny repeated entries: fine for a large budget (and then
     * refused by the count check), too large for a small one */
    gm.n_messages = 50000;
    wire_arena_t *small = wire_arena_new(1u << 20);
    REQUIRE(small != NULL);
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.messages has 50000 entries", NULL);
    reject_at(CLIENT, small, &r, KVD_EFORMAT, "too large for its budget (1048576 bytes", NULL,
              __LINE__);
    free(lots);

    /* the same with unknown fields: 20,000 of them in a 40 KB frame */
    size_t n_unknown = 20000;
    uint8_t *flood = malloc(4 + 2 * n_unknown + 2);
    REQUIRE(flood != NULL);
    memcpy(flood, "\x08\x01\x10\x07", 4);
    for (size_t i = 0; i < n_unknown; i++) {
        flood[4 + 2 * i] = 0x78;    /* field 15, varint */
        flood[5 + 2 * i] = 0x01;
    }
    memcpy(flood + 4 + 2 * n_unknown, "\x2a\x00", 2);
    reject_bytes_at(CLIENT, small, flood, 4 + 2 * n_unknown + 2, KVD_EFORMAT,
                    "too large for its budget", NULL, __LINE__);
    wire_arena_reset(arena);
    CHECK(wire_client_request_unpack(arena, flood, 4 + 2 * n_unknown + 2, &code, NULL, 0) != NULL);
    free(flood);

    /* a small arena and a long list of token ids */
    wire_arena_t *tiny = wire_arena_new(4096);
    REQUIRE(tiny != NULL);
    int32_t *ids2 = calloc(4000, sizeof(*ids2));
    REQUIRE(ids2 != NULL);
    gt.n_token_ids = 4000;
    gt.token_ids = ids2;
    r = client_generate(&gt);
    reject_at(CLIENT, tiny, &r, KVD_EFORMAT, "too large for its budget (4096 bytes", NULL,
              __LINE__);
    free(ids2);
    wire_arena_destroy(&tiny);
    CHECK(tiny == NULL);
    wire_arena_destroy(&tiny);
    wire_arena_destroy(&small);
}

static void test_prompt_limits(void)
{
    /* a 10 MB prompt */
    size_t big = 10u << 20;
    char *text = repeated_text(big, 'a');
    Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
    g.prompt = text;
    Kvd__ClientRequest r = client_generate(&g);
    REJECT(CLIENT, &r, KVD_ETOOLONG, "generate.prompt is 10485760 bytes, over the limit of 8388608",
           NULL);
    text[WIRE_MAX_PROMPT_BYTES] = '\0';
    Kvd__ClientRequest *u = ROUNDTRIP(CLIENT, &r, NULL);
    CHECK(u != NULL && strlen(u->generate->prompt) == WIRE_MAX_PROMPT_BYTES);

    /* the compressor refuses what the checks would */
    uint8_t *z = NULL;
    size_t zlen = 0;
    CHECK_INT(wire_lz4_compress(text, WIRE_MAX_PROMPT_BYTES + 1, &z, &zlen), KVD_ERANGE);
    CHECK(z == NULL);
    REQUIRE(wire_lz4_compress(text, WIRE_MAX_PROMPT_BYTES, &z, &zlen) == 0);
    CHECK(zlen < 40000);    /* 8 MiB of one letter */

    /* prompt_lz4: size limits */
    Kvd__GenerateRequest gz = KVD__GENERATE_REQUEST__INIT;
    gz.has_prompt_lz4 = 1;
    gz.prompt_lz4.data = z;
    gz.prompt_lz4.len = zlen;
    gz.has_prompt_lz4_size = 1;
    gz.prompt_lz4_size = big;
    r = client_generate(&gz);
    REJECT(CLIENT, &r, KVD_ETOOLONG, "generate.prompt_lz4_size = 10485760 is over the limit", NULL);
    gz.prompt_lz4_size = 0;
    REJECT(CLIENT, &r, KVD_ERANGE, "generate.prompt_lz4_size = 0 is outside [1, 8388608]", NULL);
    gz.has_prompt_lz4_size = 0;
    REJECT(CLIENT, &r, KVD_EFORMAT, "generate.prompt_lz4 has no prompt_lz4_size", NULL);
    gz.has_prompt_lz4_size = 1;
    gz.prompt_lz4_size = 100;   /* 33 KB of LZ4 cannot hold only 100 bytes */
    REJECT(CLIENT, &r, KVD_EFORMAT, "more than LZ4 needs for prompt_lz4_size = 100", NULL);
    gz.prompt_lz4.len = 0;
    gz.prompt_lz4.data = NULL;
    REJECT(CLIENT, &r, KVD_EFORMAT, "generate.prompt_lz4 is empty", NULL);

    /* the whole 8 MiB, decompressed in an arena of the recommended budget */
    gz.prompt_lz4.data = z;
    gz.prompt_lz4.len = zlen;
    gz.prompt_lz4_size = WIRE_MAX_PROMPT_BYTES;
    size_t len;
    uint8_t *buf = pack(&r, &len);
    wire_arena_t *rec = wire_arena_new(4 * len + (1u << 20) + WIRE_MAX_PROMPT_BYTES + 16);
    REQUIRE(rec != NULL);
    int code = 1;
    u = wire_client_request_unpack(rec, buf, len, &code, NULL, 0);
    CHECK(u != NULL);
    if (u != NULL) {
        const char *t = NULL;
        size_t tl = 0;
        CHECK_INT(wire_prompt_text(rec, u->generate, &t, &tl, NULL, 0), 0);
        CHECK(tl == WIRE_MAX_PROMPT_BYTES && t != NULL && memcmp(t, text, tl) == 0);
    }
    free(buf);
    wire_arena_destroy(&rec);

    /* an LZ4 prompt whose size lies, both ways, and corrupt LZ4 data */
    const char *msg = "Tell me a story about a dragon, a dragon, a dragon and a knight.";
    uint8_t *sz = NULL;
    size_t szlen = 0;
    REQUIRE(wire_lz4_compress(msg, strlen(msg), &sz, &szlen) == 0);
    gz.prompt_lz4.data = sz;
    gz.prompt_lz4.len = szlen;
    const uint32_t lies[] = { (uint32_t)strlen(msg) + 10, (uint32_t)strlen(msg) - 10 };
    const char *names[] = { "bad_lz4_size_high", NULL };
    for (int i = 0; i < 2; i++) {
        gz.prompt_lz4_size = lies[i];
        buf = pack(&r, &len);
        save(names[i], buf, len);
        wire_arena_reset(arena);
        u = wire_client_request_unpack(arena, buf, len, &code, NULL, 0);
        CHECK(u != NULL);   /* the size is only known to lie once decompressed */
        if (u != NULL) {
            const char *t = NULL;
            size_t tl = 0;
            char err[256] = "";
            CHECK_INT(wire_prompt_text(arena, u->generate, &t, &tl, err, sizeof(err)), KVD_EFORMAT);
            CHECK(strstr(err, "generate.prompt_lz4") != NULL);
            CHECK(strstr(err, i == 0 ? "decompresses to 64 bytes, but prompt_lz4_size = 74"
                                     : "is not LZ4 data of prompt_lz4_size = 54") != NULL);
        }
        free(buf);
    }
    gz.prompt_lz4_size = (uint32_t)strlen(msg);
    sz[0] ^= 0xf0;  /* the first token's literal length */
    sz[szlen - 1] ^= 0x55;
    buf = pack(&r, &len);
    save("bad_lz4_corrupt", buf, len);
    wire_arena_reset(arena);
    u = wire_client_request_unpack(arena, buf, len, &code, NULL, 0);
    if (u != NULL) {
        const char *t = NULL;
        size_t tl = 0;
        CHECK_INT(wire_prompt_text(arena, u->generate, &t, &tl, NULL, 0), KVD_EFORMAT);
    }
    free(buf);
    free(sz);

    /* a decompressed prompt larger than what is left of the budget */
    wire_arena_t *small = wire_arena_new(64u << 10);
    REQUIRE(small != NULL);
    gz.prompt_lz4.data = z;
    gz.prompt_lz4.len = zlen;
    gz.prompt_lz4_size = WIRE_MAX_PROMPT_BYTES;
    buf = pack(&r, &len);
    u = wire_client_request_unpack(small, buf, len, &code, NULL, 0);
    CHECK(u != NULL);
    if (u != NULL) {
        const char *t = NULL;
        size_t tl = 0;
        char err[256] = "";
        CHECK_INT(wire_prompt_text(small, u->generate, &t, &tl, err, sizeof(err)), KVD_ENOMEM);
        CHECK(strstr(err, "no room for 8388608 bytes") != NULL);
    }
    free(buf);
    wire_arena_destroy(&small);

    free(z);
    free(text);
}

static void test_reply_rejects(void)
{
    Kvd__Chunk ch = KVD__CHUNK__INIT;
    Kvd__ServerReply r = reply(KVD__SERVER_REPLY__BODY_CHUNK, &ch);
    REJECT(REPLY, &r, KVD_EFORMAT, "chunk has no text", NULL);
    ch.text = "";
    ROUNDTRIP(REPLY, &r, NULL);
    int32_t bad[] = { 3, -2 };
    ch.n_token_ids = 2;
    ch.token_ids = bad;
    REJECT(REPLY, &r, KVD_ERANGE, "chunk.token_ids[1] = -2 is negative", NULL);

    Kvd__Final fin = KVD__FINAL__INIT;
    fin.text = "done";
    fin.has_finish_reason = 1;
    fin.finish_reason = 99;
    r = reply(KVD__SERVER_REPLY__BODY_FINAL, &fin);
    REJECT(REPLY, &r, KVD_ERANGE, "final.finish_reason = 99 is not a known FinishReason",
           NULL);
    fin.finish_reason = -1;
    REJECT(REPLY, &r, KVD_ERANGE, "final.finish_reason = -1 is not a known FinishReason", NULL);
    fin.finish_reason = KVD__FINISH_REASON__FINISH_DEADLINE;
    fin.text = NULL;
    REJECT(REPLY, &r, KVD_EFORMAT, "final has no text", NULL);

    Kvd__Error e = KVD__ERROR__INIT;
    e.message = "x";
    e.has_code = 1;
    e.code = 42;
    r = reply(KVD__SERVER_REPLY__BODY_ERROR, &e);
    REJECT(REPLY, &r, KVD_ERANGE, "error.code = 42 is not a known ErrorCode", NULL);
    e.code = KVD__ERROR_CODE__ERR_SHUTTING_DOWN;
    e.message = NULL;
    REJECT(REPLY, &r, KVD_EFORMAT, "error has no message", NULL);

    Kvd__Health he = KVD__HEALTH__INIT;
    r = reply(KVD__SERVER_REPLY__BODY_HEALTH, &he);
    REJECT(REPLY, &r, KVD_EFORMAT, "health has no model", NULL);

    r.version = 3;
    REJECT(REPLY, &r, KVD_EUNSUPPORTED, "ServerReply has protocol version 3, expected 1", NULL);
    r = reply(KVD__SERVER_REPLY__BODY__NOT_SET, NULL);
    REJECT(REPLY, &r, KVD_EFORMAT, "ServerReply has no body", NULL);
}

static void test_worker_rejects(void)
{
    uint8_t fp[16] = { 0 };
    Kvdw__Ready rd = KVDW__READY__INIT;
    rd.has_fingerprint = 1;
    rd.fingerprint.data = fp;
    rd.fingerprint.len = 8;
    rd.has_block_tokens = 1;
    rd.block_tokens = 16;
    rd.has_max_batch = 1;
    rd.max_batch = 4;
    Kvdw__FromWorker f = from_worker(KVDW__FROM_WORKER__BODY_READY, &rd);
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "ready.fingerprint is 8 bytes, expected 16",
           "bad_fingerprint");
    rd.has_fingerprint = 0;
    REJECT(FROM_WORKER, &f, KVD_EFORMAT, "ready has no fingerprint", NULL);
    rd.has_fingerprint = 1;
    rd.fingerprint.len = 16;
    rd.block_tokens = 0;
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "ready.block_tokens = 0 is outside [1, 4096]", NULL);
    rd.block_tokens = 4097;
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "ready.block_tokens = 4097 is outside [1, 4096]", NULL);
    rd.block_tokens = 4096;
    rd.max_batch = 0;
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "ready.max_batch = 0", NULL);
    rd.max_batch = 1;
    ROUNDTRIP(FROM_WORKER, &f, NULL);
    /* a worker on another host names it, its pool's instance and size */
    char host[80] = "rack2-node7";
    rd.host = host;
    REJECT(FROM_WORKER, &f, KVD_EFORMAT, "ready has no pool_instance", NULL);
    rd.has_pool_instance = 1;
    rd.pool_instance = 0x1234;
    REJECT(FROM_WORKER, &f, KVD_EFORMAT, "ready has no pool_blocks", NULL);
    rd.has_pool_blocks = 1;
    rd.pool_blocks = 0;
    REJECT(FROM_WORKER, &f, KVD_EFORMAT, "ready has no pool_blocks", NULL);
    rd.pool_blocks = WIRE_MAX_POOL_BLOCKS + 1;
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "ready.pool_blocks = 4194305 is over the limit", NULL);
    rd.pool_blocks = 512;
    Kvdw__FromWorker *hu = ROUNDTRIP(FROM_WORKER, &f, NULL);
    CHECK(hu != NULL && strcmp(hu->ready->host, "rack2-node7") == 0 && hu->ready->pool_instance == 0x1234 &&
          hu->ready->pool_blocks == 512);
    snprintf(host, sizeof(host), "bad \"host\"");
    REJECT(FROM_WORKER, &f, KVD_EFORMAT, "ready.host may hold printable ASCII", NULL);
    memset(host, 'h', 64);
    host[64] = 0;
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "ready.host is 64 bytes, over 63", NULL);
    rd.host = NULL;

    Kvdw__Commit cm = KVDW__COMMIT__INIT;
    cm.has_n_written = 1;
    f = from_worker(KVDW__FROM_WORKER__BODY_COMMIT, &cm);
    REJECT(FROM_WORKER, &f, KVD_EFORMAT, "commit has no seq_id", NULL);

    int32_t bad[] = { 1, 2, INT32_MIN };
    Kvdw__TokenChunk tc = KVDW__TOKEN_CHUNK__INIT;
    tc.has_seq_id = 1;
    tc.n_tokens = 3;
    tc.tokens = bad;
    f = from_worker(KVDW__FROM_WORKER__BODY_CHUNK, &tc);
    REJECT(FROM_WORKER, &f, KVD_EFORMAT, "chunk has no n_written", NULL);
    tc.has_n_written = 1;
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "chunk.tokens[2] = -2147483648 is negative", NULL);
    /* logprobs: none or one per token, as many alternatives as their logprobs, at most 20 */
    bad[2] = 3;
    int32_t top_ids[21] = { 0 };
    float top_lp[21] = { 0 };
    Kvd__TokenLogprob lp = KVD__TOKEN_LOGPROB__INIT, *lps[3] = { &lp, &lp, &lp };
    lp.top_ids = top_ids;
    lp.top_logprobs = top_lp;
    tc.logprobs = lps;
    tc.n_logprobs = 2;
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "chunk.logprobs has 2 entries for 3 tokens", NULL);
    tc.n_logprobs = 3;
    lp.n_top_ids = 2;
    lp.n_top_logprobs = 1;
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "chunk.logprobs[0] has 2 alternatives, 1 logprobs", NULL);
    lp.n_top_ids = lp.n_top_logprobs = 21;
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "chunk.logprobs[0] has 21 alternatives", NULL);
    lp.n_top_ids = lp.n_top_logprobs = 20;
    top_ids[4] = -1;
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "chunk.logprobs[4] = -1 is negative", NULL);
    top_ids[4] = 0;
    ROUNDTRIP(FROM_WORKER, &f, NULL);
    tc.n_logprobs = 0;

    Kvdw__Done dn = KVDW__DONE__INIT;
    dn.has_seq_id = 1;
    dn.has_reason = 1;
    dn.reason = 7;
    f = from_worker(KVDW__FROM_WORKER__BODY_DONE, &dn);
    REJECT(FROM_WORKER, &f, KVD_ERANGE, "done.reason = 7 is not a known DoneReason",
           "bad_done_reason");
    dn.has_reason = 0;
    REJECT(FROM_WORKER, &f, KVD_EFORMAT, "done has no reason", NULL);

    Kvdw__LeaseRequest ls = KVDW__LEASE_REQUEST__INIT;
    ls.has_seq_id = 1;
    f = from_worker(KVDW__FROM_WORKER__BODY_LEASE, &ls);
    REJECT(FROM_WORKER, &f, KVD_EFORMAT, "lease has no n_positions", NULL);

    f.version = 0;
    REJECT(FROM_WORKER, &f, KVD_EUNSUPPORTED, "FromWorker has protocol version 0", NULL);
    f = from_worker(KVDW__FROM_WORKER__BODY__NOT_SET, NULL);
    REJECT(FROM_WORKER, &f, KVD_EFORMAT, "FromWorker has no body", NULL);

    /* kvd -> worker */
    int32_t hist[] = { 1, 2, 3 };
    uint32_t blocks[] = { 1 };
    Kvdw__Assign as = KVDW__ASSIGN__INIT;
    as.has_seq_id = 1;
    as.n_tokens = 3;
    as.tokens = hist;
    as.n_blocks = 1;
    as.blocks = blocks;
    as.has_n_cached = 1;
    as.n_cached = 5;
    Kvdw__ToWorker t = to_worker(KVDW__TO_WORKER__BODY_ASSIGN, &as);
    REJECT(TO_WORKER, &t, KVD_ERANGE, "assign.n_cached = 5 is more than its 3 tokens",
           "bad_assign_cached");
    as.n_cached = 3;
    as.has_n_generated = 1;
    as.n_generated = 4;
    REJECT(TO_WORKER, &t, KVD_ERANGE, "assign.n_generated = 4 is more than its 3 tokens", NULL);
    as.n_generated = 3;
    as.has_max_new = 1;
    as.max_new = WIRE_MAX_NEW_TOKENS + 1;
    REJECT(TO_WORKER, &t, KVD_ERANGE, "assign.max_new = 1048577 is over the limit", NULL);
    as.max_new = 0;
    as.n_blocks = 0;
    REJECT(TO_WORKER, &t, KVD_ERANGE, "assign.blocks has 0 block ids, outside [1, 1048576]", NULL);
    as.n_blocks = 1;
    as.n_tokens = 0;
    REJECT(TO_WORKER, &t, KVD_ERANGE, "assign.tokens has 0 token ids, outside [1, 1048576]", NULL);
    as.n_tokens = 3;
    hist[0] = -1;
    REJECT(TO_WORKER, &t, KVD_ERANGE, "assign.tokens[0] = -1 is negative", NULL);
    hist[0] = 1;
    Kvd__SamplingParams s = KVD__SAMPLING_PARAMS__INIT;
    s.has_top_p = 1;
    s.top_p = NAN;
    as.sampling = &s;
    REJECT(TO_WORKER, &t, KVD_ERANGE, "assign.sampling.top_p = nan", NULL);
    s.top_p = 0.5f;
    as.has_logprobs = 1;
    as.logprobs = 21;
    REJECT(TO_WORKER, &t, KVD_ERANGE, "assign.logprobs = 21 is over the limit of 20", NULL);
    as.logprobs = 20;
    as.has_seq_id = 0;
    REJECT(TO_WORKER, &t, KVD_EFORMAT, "assign has no seq_id", NULL);
    as.has_seq_id = 1;
    ROUNDTRIP(TO_WORKER, &t, NULL);

    /* a grant of no blocks answers an ahead lease the pool has no room for */
    Kvdw__Grant gr = KVDW__GRANT__INIT;
    gr.has_seq_id = 1;
    t = to_worker(KVDW__TO_WORKER__BODY_GRANT, &gr);
    Kvdw__ToWorker *v = ROUNDTRIP(TO_WORKER, &t, "to_worker_grant_empty");
    CHECK(v != NULL && v->grant->n_blocks == 0);
    gr.has_seq_id = 0;
    REJECT(TO_WORKER, &t, KVD_EFORMAT, "grant has no seq_id", NULL);

    Kvdw__Cancel cn = KVDW__CANCEL__INIT;
    t = to_worker(KVDW__TO_WORKER__BODY_CANCEL, &cn);
    REJECT(TO_WORKER, &t, KVD_EFORMAT, "cancel has no seq_id", NULL);
    t = to_worker(KVDW__TO_WORKER__BODY__NOT_SET, NULL);
    REJECT(TO_WORKER, &t, KVD_EFORMAT, "ToWorker has no body", NULL);
}

/* ---- the arena and packing ----------------------------------------------------------------- */

static void test_arena(void)
{
    /* a reset gives the whole budget back */
    Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
    char *text = repeated_text(2000, 'q');
    g.prompt = text;
    Kvd__ClientRequest r = client_generate(&g);
    size_t len;
    uint8_t *buf = pack(&r, &len);
    wire_arena_t *a = wire_arena_new(16u << 10);
    REQUIRE(a != NULL);
    int ok = 0, code = 0;
    for (int i = 0; i < 1000; i++) {
        wire_arena_reset(a);
        ok += wire_client_request_unpack(a, buf, len, &code, NULL, 0) != NULL;
    }
    CHECK_INT(ok, 1000);
    /* without resets it runs out, with a clear reason */
    int failed_at = -1;
    char err[256] = "";
    for (int i = 0; i < 100 && failed_at < 0; i++)
        if (wire_client_request_unpack(a, buf, len, &code, err, sizeof(err)) == NULL)
            failed_at = i;
    CHECK(failed_at > 0 && failed_at < 20);
    CHECK_INT(code, KVD_EFORMAT);
    CHECK(strstr(err, "too large for its budget (16384 bytes") != NULL);
    /* a NULL code and err are allowed */
    CHECK(wire_client_request_unpack(a, buf, len, NULL, NULL, 0) == NULL);
    wire_arena_destroy(&a);

    /* a budget of nothing refuses everything */
    a = wire_arena_new(0);
    REQUIRE(a != NULL);
    CHECK(wire_client_request_unpack(a, buf, len, &code, NULL, 0) == NULL);
    CHECK_INT(code, KVD_EFORMAT);
    wire_arena_destroy(&a);
    free(buf);
    free(text);

    /* the recommended budget (4 x frame + 1 MiB) holds the densest legitimate
     * messages: a million one-byte token ids, and blocks */
    size_t n = WIRE_MAX_TOKENS;
    int32_t *ids = calloc(n, sizeof(*ids));
    uint32_t *blocks = calloc(n, sizeof(*blocks));
    REQUIRE(ids != NULL && blocks != NULL);
    Kvdw__Assign as = KVDW__ASSIGN__INIT;
    as.has_seq_id = 1;
    as.n_tokens = n;
    as.tokens = ids;
    as.n_blocks = n;
    as.blocks = blocks;
    Kvdw__ToWorker t = to_worker(KVDW__TO_WORKER__BODY_ASSIGN, &as);
    buf = pack(&t, &len);
    a = wire_arena_new(4 * len + (1u << 20));
    REQUIRE(a != NULL);
    CHECK(wire_to_worker_unpack(a, buf, len, &code, NULL, 0) != NULL);
    wire_arena_destroy(&a);
    free(buf);
    free(ids);
    free(blocks);

    /* packing refuses frames over WIRE_MAX_FRAME */
    char *huge = repeated_text(WIRE_MAX_FRAME, 'z');
    g.prompt = huge;
    uint8_t *out = (uint8_t *)1;
    size_t out_len = 1;
    CHECK_INT(wire_pack(&r.base, &out, &out_len), KVD_ERANGE);
    CHECK(out == NULL && out_len == 0);
    free(huge);

    /* an empty message packs to zero bytes */
    Kvdw__Drain dr = KVDW__DRAIN__INIT;
    CHECK_INT(wire_pack(&dr.base, &out, &out_len), 0);
    CHECK(out != NULL && out_len == 0);
    free(out);
}

/* The request id of frames that fail to unpack: read from the top-level
 * fields that come before the damage, never past the end. */
static void test_request_id_scan(void)
{
    Kvd__ClientRequest m = KVD__CLIENT_REQUEST__INIT;
    Kvd__HealthRequest h = KVD__HEALTH_REQUEST__INIT;
    m.has_version = m.has_request_id = 1;
    m.version = 7; /* a wrong version still carries the id */
    m.request_id = 0x123456789abcdefull;
    m.body_case = KVD__CLIENT_REQUEST__BODY_HEALTH;
    m.health = &h;
    uint8_t *buf;
    size_t len;
    REQUIRE(wire_pack(&m.base, &buf, &len) == 0);
    CHECK(wire_client_request_id(buf, len) == 0x123456789abcdefull);
    for (size_t cut = 0; cut < len; cut++) {
        uint64_t id = wire_client_request_id(buf, cut); /* whatever it finds, it stays inside */
        CHECK(id == 0 || id == 0x123456789abcdefull);
    }
    free(buf);
    m.has_request_id = 0;
    REQUIRE(wire_pack(&m.base, &buf, &len) == 0);
    CHECK(wire_client_request_id(buf, len) == 0);
    free(buf);
    static const uint8_t junk[] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
    CHECK(wire_client_request_id(junk, sizeof(junk)) == 0);
    static const uint8_t group[] = { 0x0b, 0x10, 0x05 }; /* wire type 3: not ours */
    CHECK(wire_client_request_id(group, sizeof(group)) == 0);
    static const uint8_t after_bytes[] = { 0x1a, 0x01, 0x41, 0x10, 0x2a }; /* field 3, then id 42 */
    CHECK(wire_client_request_id(after_bytes, sizeof(after_bytes)) == 42);
    static const uint8_t long_len[] = { 0x1a, 0x7f, 0x41, 0x10, 0x2a }; /* length past the end */
    CHECK(wire_client_request_id(long_len, sizeof(long_len)) == 0);
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0)
        corpus_dir = argv[2];
    arena = wire_arena_new(BIG_BUDGET);
    REQUIRE(arena != NULL);
    test_client_roundtrips();
    test_reply_roundtrips();
    test_worker_roundtrips();
    test_bad_frames();
    test_client_rejects();
    test_prompt_limits();
    test_reply_rejects();
    test_worker_rejects();
    test_arena();
    test_request_id_scan();
    wire_arena_destroy(&arena);
    return CHECK_DONE();
}
