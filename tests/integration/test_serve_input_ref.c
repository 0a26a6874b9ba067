/*
 * test_serve_input_ref.c - kvd and malformed input: hand-made frames over a
 * raw ZeroMQ DEALER to a real kvd (default model) over ipc://.
 *
 * Every malformed message is answered with an Error reply carrying the
 * expected code (and the request's id when kvd could read it, else 0), or is
 * dropped; those answered with ERR_BAD_REQUEST or dropped are counted in
 * stats.bad_messages. After each case kvd still answers (a health round trip
 * on the same socket, so that no stray reply is left either), and at the end
 * a normal request gives the same output as before the abuse, the worker
 * never restarted, and kvd exits 0 on SIGTERM. Garbage on the worker
 * endpoint is dropped and counted as well.
 */
#include <string.h>

#include "check.h"
#include "serve.h"

#define VOCAB 49152

static struct sv_kvd *kvd;
static void *sock;
static wire_arena_t *arena;
static uint64_t health_id = 1000000;
static int n_cases;

/* The health round trip: the next reply must be the answer to it. */
static void still_serving(const char *name)
{
    Kvd__ClientRequest m;
    Kvd__HealthRequest h = KVD__HEALTH_REQUEST__INIT;
    sv_req_init(&m, ++health_id);
    m.body_case = KVD__CLIENT_REQUEST__BODY_HEALTH;
    m.health = &h;
    sv_send_msg(sock, &m);
    Kvd__ServerReply *r = sv_recv(sock, arena, SV_WAIT_MS);
    if (r == NULL || r->body_case != KVD__SERVER_REPLY__BODY_HEALTH || r->request_id != health_id)
        fprintf(stderr, "%s: kvd did not answer the health request after it (%s)\n", name,
                r == NULL ? "no reply" : "another reply first");
    REQUIRE(r != NULL);
    CHECK_INT(r->body_case, KVD__SERVER_REPLY__BODY_HEALTH);
    CHECK_INT(r->request_id, health_id);
    CHECK(r->body_case != KVD__SERVER_REPLY__BODY_HEALTH || r->health->ok);
}

static uint64_t bad_messages(void)
{
    struct kvd_stats s;
    sv_stats(kvd, &s);
    uint64_t n = s.bad_messages;
    kvd_stats_free(&s);
    return n;
}

/*
 * After a case was sent: expects an Error with `code` for request `id` (code
 * < 0: no reply at all, the message dropped), then kvd still serving, and
 * bad_messages grown by one when the case was answered with ERR_BAD_REQUEST
 * or dropped.
 */
static void expect(const char *name, int code, uint64_t id, uint64_t bad_before)
{
    n_cases++;
    if (code >= 0) {
        Kvd__ServerReply *r = sv_recv(sock, arena, SV_WAIT_MS);
        if (r == NULL)
            fprintf(stderr, "%s: no reply\n", name);
        REQUIRE(r != NULL);
        if (r->body_case != KVD__SERVER_REPLY__BODY_ERROR) {
            fprintf(stderr, "%s: reply %d instead of an error\n", name, (int)r->body_case);
            CHECK_INT(r->body_case, KVD__SERVER_REPLY__BODY_ERROR);
            return;
        }
        fprintf(stderr, "%-34s -> error %d for id %llu: %s\n", name, r->error->code,
                (unsigned long long)r->request_id, r->error->message);
        CHECK_INT(r->error->code, code);
        CHECK_INT(r->request_id, id);
        CHECK(r->error->message != NULL && r->error->message[0] != '\0');
    } else {
        fprintf(stderr, "%-34s -> dropped\n", name);
    }
    still_serving(name);
    uint64_t grew = bad_messages() - bad_before;
    if (code < 0 || code == KVD__ERROR_CODE__ERR_BAD_REQUEST) {
        if (grew != 1)
            fprintf(stderr, "%s: bad_messages grew by %llu\n", name, (unsigned long long)grew);
        CHECK_INT(grew, 1);
    }
}

/* Sends m and expects the error, for request `id` or, when id is 0, for the
 * id the message carries (kvd echoes it even when the message fails its
 * checks, so the client knows which request failed). */
static void send_expect(const char *name, const Kvd__ClientRequest *m, int code, uint64_t id)
{
    uint64_t before = bad_messages();
    sv_send_msg(sock, m);
    expect(name, code, id ? id : m->has_request_id ? m->request_id : 0, before);
}

/* Sends raw bytes; the error must carry `id`: the request_id the bytes hold
 * before whatever is wrong with them (kvd reads it even from a frame that
 * fails to unpack), 0 when they hold none. */
static void raw_expect(const char *name, const void *buf, size_t len, int code, uint64_t id)
{
    uint64_t before = bad_messages();
    sv_send_raw(sock, buf, len, 0);
    expect(name, code, id, before);
}

/* A generate request with id and a prompt; the caller sets what is wrong. */
struct gen {
    Kvd__ClientRequest m;
    Kvd__GenerateRequest g;
    Kvd__SamplingParams s;
};

static void gen_init(struct gen *x, uint64_t id, const char *prompt)
{
    sv_req_init(&x->m, id);
    kvd__generate_request__init(&x->g);
    kvd__sampling_params__init(&x->s);
    x->m.body_case = KVD__CLIENT_REQUEST__BODY_GENERATE;
    x->m.generate = &x->g;
    x->g.prompt = (char *)prompt;
    x->g.has_max_tokens = true;
    x->g.max_tokens = 4;
}

/* A greedy request through the client library; returns its tokens (malloc'd). */
static int32_t *normal_request(size_t *n)
{
    kvd_client_t *c = sv_client(kvd, SV_WAIT_MS);
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.prompt = "The capital of France is";
    p.max_tokens = 8;
    p.temperature = 0;
    p.ignore_eos = true;
    struct kvd_result r;
    int rc = kvd_generate(c, &p, &r);
    if (rc != 0)
        fprintf(stderr, "normal request: %s: %s\n", kvd_strerror(rc), r.error);
    REQUIRE(rc == 0);
    CHECK_INT(r.n_tokens, 8);
    int32_t *t = malloc(r.n_tokens * sizeof(int32_t));
    memcpy(t, r.tokens, r.n_tokens * sizeof(int32_t));
    *n = r.n_tokens;
    kvd_result_free(&r);
    kvd_client_destroy(&c);
    return t;
}

static void frames(void)
{
    const int BAD = KVD__ERROR_CODE__ERR_BAD_REQUEST;
    const int TOO_LONG = KVD__ERROR_CODE__ERR_TOO_LONG;
    const char *hi = "Hello";

    /* bytes that are no protobuf at all */
    uint8_t junk[64];
    uint32_t x = 12345;
    for (size_t i = 0; i < sizeof(junk); i++) {
        x = x * 1103515245u + 12345u;
        junk[i] = (uint8_t)(x >> 24) | 0x80; /* every byte a varint continuation: never ends */
    }
    raw_expect("garbage bytes", junk, sizeof(junk), BAD, 0);
    raw_expect("empty frame", "", 0, BAD, 0);
    /* version 1, request_id 5, then field 3 (generate) claiming 2^31 bytes */
    static const uint8_t huge_len[] = { 0x08, 0x01, 0x10, 0x05, 0x1a, 0x80, 0x80, 0x80, 0x80, 0x08,
                                        0x0a, 0x01, 0x41 };
    raw_expect("length prefix of 2^31 bytes", huge_len, sizeof(huge_len), BAD, 5);
    /* version 1, request_id 7, then a field numbered 0 */
    static const uint8_t field0[] = { 0x08, 0x01, 0x10, 0x07, 0x00, 0x00 };
    raw_expect("field number 0", field0, sizeof(field0), BAD, 7);

    /* a valid request cut in half */
    struct gen v;
    gen_init(&v, 9, "A perfectly good request that arrives only in part.");
    uint8_t *buf;
    size_t len;
    REQUIRE(wire_pack(&v.m.base, &buf, &len) == 0);
    raw_expect("truncated message", buf, len / 2, BAD, 9);
    free(buf);

    /* the envelope */
    Kvd__ClientRequest m;
    Kvd__HealthRequest h = KVD__HEALTH_REQUEST__INIT;
    sv_req_init(&m, 10);
    m.version = 2;
    m.body_case = KVD__CLIENT_REQUEST__BODY_HEALTH;
    m.health = &h;
    send_expect("wrong version", &m, BAD, 0);
    m.has_version = false;
    send_expect("no version", &m, BAD, 0);
    sv_req_init(&m, 11);
    m.has_request_id = false;
    m.body_case = KVD__CLIENT_REQUEST__BODY_HEALTH;
    m.health = &h;
    send_expect("no request id", &m, BAD, 0);
    sv_req_init(&m, 12);
    send_expect("no body", &m, BAD, 0);

    /* prompts */
    gen_init(&v, 20, NULL);
    send_expect("generate without a prompt", &v.m, BAD, 0);
    int32_t ids[3] = { 1, 2, 3 };
    gen_init(&v, 21, hi);
    v.g.n_token_ids = 3;
    v.g.token_ids = ids;
    send_expect("two prompt forms", &v.m, BAD, 0);
    int32_t big[3] = { 1, 2, VOCAB };
    gen_init(&v, 22, NULL);
    v.g.n_token_ids = 3;
    v.g.token_ids = big;
    send_expect("token id = vocabulary size", &v.m, BAD, 22);
    int32_t huge_id[1] = { INT32_MAX };
    v.g.n_token_ids = 1;
    v.g.token_ids = huge_id;
    send_expect("token id 2^31 - 1", &v.m, BAD, 22);
    int32_t neg[2] = { 5, -1 };
    gen_init(&v, 23, NULL);
    v.g.n_token_ids = 2;
    v.g.token_ids = neg;
    send_expect("negative token id", &v.m, BAD, 0);
    size_t n_many = WIRE_MAX_TOKENS + 1;
    int32_t *many = calloc(n_many, sizeof(int32_t));
    gen_init(&v, 24, NULL);
    v.g.n_token_ids = n_many;
    v.g.token_ids = many;
    send_expect("2^20 + 1 token ids", &v.m, TOO_LONG, 0);
    free(many);

    /* sampling */
#define SAMPLING(name, field, value) do { gen_init(&v, 30, hi); v.g.sampling = &v.s; \
        v.s.has_##field = true; v.s.field = (value); send_expect(name, &v.m, BAD, 0); } while (0)
    SAMPLING("top_p 7", top_p, 7.0f);
    SAMPLING("min_p -0.5", min_p, -0.5f);
    SAMPLING("temperature -1", temperature, -1.0f);
    SAMPLING("temperature NaN", temperature, NAN);
    SAMPLING("temperature infinite", temperature, INFINITY);
    SAMPLING("temperature 1e9", temperature, 1e9f);
    SAMPLING("repeat_penalty 0", repeat_penalty, 0.0f);
    SAMPLING("top_k -5", top_k, -5);
#undef SAMPLING

    /* limits */
    gen_init(&v, 40, hi);
    v.g.max_tokens = UINT32_MAX;
    send_expect("max_tokens 2^32 - 1", &v.m, BAD, 0);
    gen_init(&v, 41, hi);
    v.g.has_deadline_ms = true;
    v.g.deadline_ms = UINT32_MAX;
    send_expect("deadline_ms 2^32 - 1", &v.m, BAD, 0);
    char *stops[WIRE_MAX_STOPS + 1];
    for (size_t i = 0; i <= WIRE_MAX_STOPS; i++)
        stops[i] = "x";
    gen_init(&v, 42, hi);
    v.g.n_stop = WIRE_MAX_STOPS + 1;
    v.g.stop = stops;
    send_expect("17 stop strings", &v.m, BAD, 0);
    char *empty_stop[1] = { "" };
    gen_init(&v, 43, hi);
    v.g.n_stop = 1;
    v.g.stop = empty_stop;
    send_expect("an empty stop string", &v.m, BAD, 0);
    char long_str[WIRE_MAX_NAMESPACE + 50];
    memset(long_str, 'n', sizeof(long_str) - 1);
    long_str[sizeof(long_str) - 1] = '\0';
    char *long_stop[1] = { long_str };
    gen_init(&v, 44, hi);
    v.g.n_stop = 1;
    v.g.stop = long_stop;
    send_expect("a 305-byte stop string", &v.m, BAD, 0);
    gen_init(&v, 45, hi);
    v.g.namespace_ = long_str;
    send_expect("a 305-byte namespace", &v.m, BAD, 0);

    /* chat */
    Kvd__ChatMessage cm = KVD__CHAT_MESSAGE__INIT, *cmp[1] = { &cm };
    cm.role = "root";
    cm.content = "hello";
    gen_init(&v, 50, NULL);
    v.g.n_messages = 1;
    v.g.messages = cmp;
    send_expect("chat role \"root\"", &v.m, BAD, 0);
    cm.role = "user";
    cm.content = NULL;
    send_expect("chat message without content", &v.m, BAD, 0);

    /* compressed prompts */
    static const uint8_t not_lz4[] = { 0xff, 0xff, 0xff, 0xff, 0x00, 0x01, 0x02, 0x03 };
    gen_init(&v, 60, NULL);
    v.g.has_prompt_lz4 = v.g.has_prompt_lz4_size = true;
    v.g.prompt_lz4.data = (uint8_t *)not_lz4;
    v.g.prompt_lz4.len = sizeof(not_lz4);
    v.g.prompt_lz4_size = 100;
    send_expect("prompt_lz4 that is not LZ4", &v.m, BAD, 60);
    const char *text = "a short text that compresses into a few bytes, a short text";
    uint8_t *z;
    size_t zl;
    REQUIRE(wire_lz4_compress(text, strlen(text), &z, &zl) == 0);
    v.g.prompt_lz4.data = z;
    v.g.prompt_lz4.len = zl;
    v.g.prompt_lz4_size = 4u << 20;
    send_expect("prompt_lz4_size that lies", &v.m, BAD, 60);
    v.g.prompt_lz4_size = WIRE_MAX_PROMPT_BYTES + 1;
    send_expect("prompt_lz4_size over 8 MiB", &v.m, TOO_LONG, 0);
    free(z);

    /* a 10 MB prompt */
    size_t big_len = 10u << 20;
    char *big_prompt = malloc(big_len + 1);
    for (size_t i = 0; i < big_len; i++)
        big_prompt[i] = "abcdefgh "[i % 9];
    big_prompt[big_len] = '\0';
    gen_init(&v, 70, big_prompt);
    send_expect("a 10 MB prompt", &v.m, TOO_LONG, 0);
    free(big_prompt);
    /* a prompt of more tokens than the context */
    char *ctx_prompt = sv_slice(0, 16000);
    gen_init(&v, 71, ctx_prompt);
    send_expect("a prompt longer than the context", &v.m, TOO_LONG, 71);
    free(ctx_prompt);

    /* a prompt that starts with a NUL byte: protobuf-c's string ends there (empty: no prompt) */
    static const uint8_t nul_prompt[] = { 0x08, 0x01, 0x10, 0x5f, 0x1a, 0x06,
                                          0x0a, 0x04, 0x00, 0x61, 0x62, 0x63 };
    raw_expect("a prompt that starts with NUL", nul_prompt, sizeof(nul_prompt), BAD, 0x5f);

    /* a message of two frames: dropped, no reply */
    uint64_t before = bad_messages();
    sv_req_init(&m, 80);
    m.body_case = KVD__CLIENT_REQUEST__BODY_HEALTH;
    m.health = &h;
    REQUIRE(wire_pack(&m.base, &buf, &len) == 0);
    sv_send_raw(sock, buf, len, ZMQ_SNDMORE);
    sv_send_raw(sock, buf, len, 0);
    free(buf);
    expect("a message of two frames", -1, 0, before);

    /* cancel of a request that does not exist */
    Kvd__CancelRequest cr = KVD__CANCEL_REQUEST__INIT;
    sv_req_init(&m, 90);
    m.body_case = KVD__CLIENT_REQUEST__BODY_CANCEL;
    m.cancel = &cr;
    send_expect("cancel without a target", &m, BAD, 0);
    cr.has_target = true;
    cr.target = 424242;
    send_expect("cancel of an unknown id", &m, KVD__ERROR_CODE__ERR_NOT_FOUND, 90);
}

/* A request id that a running request of the same client holds. */
static void duplicate_id(void)
{
    struct gen v;
    gen_init(&v, 500, "Count slowly from one to one thousand:");
    v.g.max_tokens = 900;
    v.g.has_ignore_eos = v.g.ignore_eos = true;
    sv_send_msg(sock, &v.m);
    Kvd__ServerReply *r = sv_recv(sock, arena, SV_WAIT_MS);
    REQUIRE(r != NULL);
    CHECK_INT(r->request_id, 500);
    CHECK_INT(r->body_case, KVD__SERVER_REPLY__BODY_ACCEPTED);
    gen_init(&v, 500, "The same id again");
    send_expect("a request id already running", &v.m, KVD__ERROR_CODE__ERR_BAD_REQUEST, 500);
    /* cancel it: Accepted for the cancel, then a Final that says CANCELLED */
    Kvd__ClientRequest m;
    Kvd__CancelRequest cr = KVD__CANCEL_REQUEST__INIT;
    sv_req_init(&m, 501);
    m.body_case = KVD__CLIENT_REQUEST__BODY_CANCEL;
    m.cancel = &cr;
    cr.has_target = true;
    cr.target = 500;
    sv_send_msg(sock, &m);
    bool acc = false, fin = false;
    while (!(acc && fin)) {
        r = sv_recv(sock, arena, SV_WAIT_MS);
        REQUIRE(r != NULL);
        if (r->request_id == 501) {
            CHECK_INT(r->body_case, KVD__SERVER_REPLY__BODY_ACCEPTED);
            acc = true;
        } else {
            CHECK_INT(r->request_id, 500);
            CHECK_INT(r->body_case, KVD__SERVER_REPLY__BODY_FINAL);
            if (r->body_case == KVD__SERVER_REPLY__BODY_FINAL)
                CHECK_INT(r->final->finish_reason, KVD__FINISH_REASON__FINISH_CANCELLED);
            fin = true;
        }
    }
}

/* Thousands of garbage frames at once: each answered, each counted. */
static void flood(void)
{
    enum { N = 5000 };
    uint64_t before = bad_messages();
    static const uint8_t junk[] = { 0xff, 0xff, 0xff, 0xff };
    for (int i = 0; i < N; i++)
        sv_send_raw(sock, junk, sizeof(junk), 0);
    Kvd__ClientRequest m;
    Kvd__HealthRequest h = KVD__HEALTH_REQUEST__INIT;
    sv_req_init(&m, ++health_id);
    m.body_case = KVD__CLIENT_REQUEST__BODY_HEALTH;
    m.health = &h;
    sv_send_msg(sock, &m);
    int errors = 0;
    for (;;) {
        Kvd__ServerReply *r = sv_recv(sock, arena, SV_WAIT_MS);
        REQUIRE(r != NULL);
        if (r->body_case == KVD__SERVER_REPLY__BODY_HEALTH) {
            CHECK_INT(r->request_id, health_id);
            break;
        }
        CHECK_INT(r->body_case, KVD__SERVER_REPLY__BODY_ERROR);
        CHECK_INT(r->request_id, 0);
        errors++;
    }
    uint64_t grew = bad_messages() - before;
    fprintf(stderr, "%-34s -> %d errors, bad_messages +%llu\n", "5,000 garbage frames at once",
            errors, (unsigned long long)grew);
    CHECK_INT(errors, N);
    CHECK_INT(grew, N);
    n_cases++;
}

/* The worker endpoint: garbage, a Ready for another model, and a heartbeat
 * from a worker that never registered are dropped and counted; the real
 * worker goes on serving. */
static void fake_worker(void)
{
    char ep[256];
    snprintf(ep, sizeof(ep), "ipc://%s/workers-%d.sock", kvd->dir, (int)kvd->first_pid);
    void *w = zmq_socket(sv_zctx, ZMQ_DEALER);
    REQUIRE(w != NULL);
    int zero = 0;
    zmq_setsockopt(w, ZMQ_LINGER, &zero, sizeof(zero));
    REQUIRE(zmq_connect(w, ep) == 0);
    uint64_t before = bad_messages();

    static const uint8_t junk[] = { 0x08, 0x01, 0xff, 0xff, 0xff };
    sv_send_raw(w, junk, sizeof(junk), 0);
    uint8_t fp[16] = { 0 };
    Kvdw__FromWorker m = KVDW__FROM_WORKER__INIT;
    Kvdw__Ready r = KVDW__READY__INIT;
    m.has_version = m.has_worker_id = true;
    m.version = WIRE_VERSION;
    m.worker_id = 7;
    m.body_case = KVDW__FROM_WORKER__BODY_READY;
    m.ready = &r;
    r.has_pid = r.has_max_batch = r.has_fingerprint = r.has_block_tokens = true;
    r.pid = 1;
    r.max_batch = 4;
    r.fingerprint.data = fp;
    r.fingerprint.len = 16;
    r.block_tokens = 16;
    uint8_t *buf;
    size_t len;
    REQUIRE(wire_pack(&m.base, &buf, &len) == 0);
    sv_send_raw(w, buf, len, 0);
    free(buf);
    Kvdw__Heartbeat hb = KVDW__HEARTBEAT__INIT;
    hb.has_progress = true;
    hb.progress = 1;
    m.body_case = KVDW__FROM_WORKER__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    REQUIRE(wire_pack(&m.base, &buf, &len) == 0);
    sv_send_raw(w, buf, len, 0);
    free(buf);

    /* kvd reads them in order; poll until all three are counted */
    double until = sv_now_ms() + SV_WAIT_MS;
    uint64_t grew = 0;
    while ((grew = bad_messages() - before) < 3 && sv_now_ms() < until)
        sv_sleep_ms(20);
    fprintf(stderr, "%-34s -> bad_messages +%llu\n", "worker endpoint: 3 bad messages",
            (unsigned long long)grew);
    CHECK_INT(grew, 3);
    CHECK(sv_log_has(kvd, "refused: another model"));
    struct kvd_stats s;
    sv_stats(kvd, &s);
    CHECK_INT(s.n_workers, 1);
    kvd_stats_free(&s);
    zmq_close(w);
    n_cases += 3;
    still_serving("worker endpoint");
}

/* A frame over ZMQ_MAXMSGSIZE: ZeroMQ drops that connection; kvd goes on. */
static void oversized_frame(void)
{
    void *d = sv_dealer(kvd);
    size_t len = (size_t)WIRE_MAX_FRAME + 1;
    char *buf = malloc(len);
    REQUIRE(buf != NULL);
    memset(buf, 'z', len);
    sv_send_raw(d, buf, len, 0);
    free(buf);
    /* nothing comes back on that connection */
    zmq_pollitem_t it = { d, 0, ZMQ_POLLIN, 0 };
    CHECK_INT(zmq_poll(&it, 1, 1000), 0);
    zmq_close(d);
    fprintf(stderr, "%-34s -> connection dropped\n", "a frame of 64 MiB + 1");
    n_cases++;
    still_serving("a frame of 64 MiB + 1");
}

int main(void)
{
    REQUIRE(access(KVD_TEST_MODEL, R_OK) == 0);
    kvd = sv_start((const char *[]){ "--workers", "1", "--kv-memory", "32MiB", "--ctx", "2048",
                                     "--worker-timeout", SV_WORKER_TIMEOUT, NULL });
    arena = wire_arena_new(16u << 20);
    REQUIRE(arena != NULL);
    size_t n_ref;
    int32_t *ref = normal_request(&n_ref);
    struct kvd_stats s0, s1;
    sv_stats(kvd, &s0);
    pid_t worker = s0.workers[0].pid;

    sock = sv_dealer(kvd);
    double t0 = sv_now_ms();
    frames();
    duplicate_id();
    flood();
    fake_worker();
    oversized_frame();
    fprintf(stderr, "%d malformed cases in %.1f s\n", n_cases, (sv_now_ms() - t0) / 1e3);
    CHECK(n_cases >= 10);
    zmq_close(sock);

    /* kvd is unharmed: the same output, the same worker, the counter grew */
    size_t n_after;
    int32_t *after = normal_request(&n_after);
    CHECK(n_after == n_ref && memcmp(after, ref, n_ref * sizeof(int32_t)) == 0);
    CHECK(sv_wait_idle(kvd, &s1, SV_WAIT_MS));
    sv_print_stats("after the malformed input", &s1);
    CHECK(s1.bad_messages > s0.bad_messages);
    CHECK(s1.bad_messages - s0.bad_messages >= 5033);
    CHECK_INT(s1.workers[0].pid, worker);
    CHECK_INT(s1.workers[0].restarts, 0);
    CHECK(s1.workers[0].alive);
    kvd_stats_free(&s0);
    kvd_stats_free(&s1);
    free(ref);
    free(after);
    wire_arena_destroy(&arena);
    zmq_ctx_term(sv_zctx);
    sv_zctx = NULL;
    CHECK_INT(sv_stop(kvd, SV_WAIT_MS), 0);
    sv_pass();
    return CHECK_DONE();
}
