/*
 * test_client.c - the C client library without a daemon: the default
 * endpoint, malformed endpoints, timeouts against nothing, and every reply
 * path against fake_kvd.h (a scripted stand-in for kvd's socket, not kvd):
 * accepted/chunks/final, the daemon's errors, replies for other request ids,
 * unreadable and out-of-order replies, cancelling from the callback, large
 * prompts (LZ4) and large replies, stats, health and cancel.
 */
#include <math.h>
#include <string.h>

#include "check.h"
#include "fake_kvd.h"
#include "kvd_client.h"

#define CHECK_STR(a, b) do { const char *sa_ = (a), *sb_ = (b); check_count++; \
    if (sa_ == NULL || strcmp(sa_, sb_) != 0) { check_failures++; \
        fprintf(stderr, "%s:%d: %s == %s failed:\n  '%s'\n  '%s'\n", __FILE__, __LINE__, #a, #b, \
                sa_ ? sa_ : "(null)", sb_); } } while (0)

#define CHECK_HAS(hay, needle) do { const char *h_ = (hay), *n_ = (needle); check_count++; \
    if (h_ == NULL || strstr(h_, n_) == NULL) { check_failures++; \
        fprintf(stderr, "%s:%d: '%s' not in '%s'\n", __FILE__, __LINE__, n_, \
                h_ ? h_ : "(null)"); } } while (0)

/* Upper bounds that fail a hung test, never speeds: PATIENCE_MS for what the
 * fake answers at once; TIMEOUT_BOUND_MS for a 300 ms timeout to fire, far
 * above it yet under the client's 30 s default, so that a timeout ignored
 * still fails. */
#define PATIENCE_MS 60000
#define TIMEOUT_BOUND_MS 15000

static const char UNSET[] = " temp=- top_k=- top_p=- min_p=- rep=- seed=- max=-";

/* ---- no daemon ------------------------------------------------------------------------ */

static void test_default_endpoint(void)
{
    char buf[256], want[256];
    unsetenv("KVD_ENDPOINT");
    setenv("XDG_RUNTIME_DIR", "/run/user/1000", 1);
    CHECK_STR(kvd_default_endpoint(buf, sizeof(buf)), "ipc:///run/user/1000/kvd/kvd.sock");
    setenv("XDG_RUNTIME_DIR", "/run/user/1000//", 1);
    CHECK_STR(kvd_default_endpoint(buf, sizeof(buf)), "ipc:///run/user/1000/kvd/kvd.sock");

    snprintf(want, sizeof(want), "ipc:///tmp/kvd-%u/kvd.sock", (unsigned)getuid());
    setenv("XDG_RUNTIME_DIR", "relative/dir", 1);   /* ignored, as XDG says */
    CHECK_STR(kvd_default_endpoint(buf, sizeof(buf)), want);
    unsetenv("XDG_RUNTIME_DIR");
    CHECK_STR(kvd_default_endpoint(buf, sizeof(buf)), want);

    setenv("KVD_ENDPOINT", "tcp://127.0.0.1:5555", 1);
    CHECK_STR(kvd_default_endpoint(buf, sizeof(buf)), "tcp://127.0.0.1:5555");
    setenv("XDG_RUNTIME_DIR", "/run/user/1000", 1);
    CHECK_STR(kvd_default_endpoint(buf, sizeof(buf)), "tcp://127.0.0.1:5555");
    setenv("KVD_ENDPOINT", "", 1);                  /* empty: as if unset */
    CHECK_STR(kvd_default_endpoint(buf, sizeof(buf)), "ipc:///run/user/1000/kvd/kvd.sock");

    char small[8];
    CHECK(kvd_default_endpoint(small, sizeof(small)) == small);
    CHECK_STR(small, "ipc:///");                    /* cut, still terminated */
    unsetenv("KVD_ENDPOINT");
    unsetenv("XDG_RUNTIME_DIR");
}

static void test_bad_endpoints(void)
{
    const char *bad[] = { "", "not-an-endpoint", "bogus://x", "tcp://localhost",
                          "tcp://127.0.0.1:notaport" };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char err[256] = "";
        kvd_client_t *c = kvd_client_new(bad[i], 300, err, sizeof(err));
        CHECK(c == NULL);
        CHECK(err[0] != '\0');
        if (c != NULL)
            fprintf(stderr, "  accepted '%s'\n", bad[i]);
        kvd_client_destroy(&c);
    }
    kvd_client_destroy(NULL);   /* accepted */
}

static void test_no_daemon(void)
{
    char err[256];
    kvd_client_t *c = kvd_client_new("ipc:///tmp/kvd-test-nobody-here/kvd.sock", 300, err,
                                     sizeof(err));
    REQUIRE(c != NULL);
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.prompt = "hello";
    struct kvd_result r;
    double t0 = fake_kvd_now_ms();
    int rc = kvd_generate(c, &p, &r);
    double dt = fake_kvd_now_ms() - t0;
    CHECK_INT(rc, KVD_ETIMEOUT);
    CHECK_HAS(r.error, "kvd-test-nobody-here");
    /* not before the timeout; the upper bound only catches a hang */
    CHECK(dt >= 250 && dt < TIMEOUT_BOUND_MS);
    kvd_result_free(&r);

    struct kvd_stats s;
    CHECK_INT(kvd_stats(c, &s), KVD_ETIMEOUT);
    bool ok = true;
    CHECK_INT(kvd_health(c, &ok, NULL), KVD_ETIMEOUT);
    CHECK_INT(kvd_cancel(c, 12345), KVD_ETIMEOUT);
    kvd_client_destroy(&c);
    CHECK(c == NULL);
}

/* ---- against the fake ------------------------------------------------------------------- */

static struct fake_kvd *fake;

static kvd_client_t *connect_fake(int timeout_ms)
{
    char err[256];
    kvd_client_t *c = kvd_client_new(fake->endpoint, timeout_ms, err, sizeof(err));
    REQUIRE(c != NULL);
    return c;
}

/* Runs a plain-text generate; streaming when stream. */
static int gen_text(kvd_client_t *c, const char *prompt, bool stream, struct kvd_result *r)
{
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.prompt = prompt;
    return stream ? kvd_generate_stream(c, &p, NULL, NULL, r) : kvd_generate(c, &p, r);
}

static void test_request_fields(kvd_client_t *c)
{
    struct kvd_result r;
    char want[1024];

    /* a plain prompt with nothing set */
    CHECK_INT(gen_text(c, "echo hi", false, &r), 0);
    snprintf(want, sizeof(want), "prompt len=7 hash=%08x%s stream=1 deadline=- ns=- eos=- "
             "nocache=- stops=", fake_kvd_hash("echo hi", 7), UNSET);
    CHECK_STR(r.text, want);
    CHECK_INT(r.text_len, strlen(want));
    CHECK_INT(r.n_tokens, 3);
    CHECK(r.n_tokens == 3 && r.tokens[0] == 1 && r.tokens[2] == 3);
    CHECK_INT(r.finish_reason, KVD_FINISH_STOP);
    CHECK_INT(r.prompt_tokens, 7);
    CHECK_INT(r.completion_tokens, 3);
    CHECK_INT(r.chunks, 0);
    CHECK(r.request_id != 0 && r.request_id == fake_kvd_last_generate(fake));
    uint64_t first = r.request_id;
    kvd_result_free(&r);
    CHECK(r.text == NULL && r.tokens == NULL && r.request_id == 0);

    /* every option set, streaming */
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    const char *stops[] = { "a", "bc" };
    p.prompt = "echo all";
    p.temperature = 0.5f;
    p.top_k = 20;
    p.top_p = 0.9f;
    p.min_p = 0.05f;
    p.repeat_penalty = 1.1f;
    p.seed = 42;
    p.max_tokens = 16;
    p.stop = stops;
    p.n_stop = 2;
    p.deadline_ms = 5000;
    p.ns = "tenant";
    p.ignore_eos = true;
    p.no_cache = true;
    CHECK_INT(kvd_generate_stream(c, &p, NULL, NULL, &r), 0);
    snprintf(want, sizeof(want), "prompt len=8 hash=%08x temp=0.50 top_k=20 top_p=0.90 "
             "min_p=0.05 rep=1.10 seed=42 max=16 stream=1 deadline=5000 ns=tenant eos=1 "
             "nocache=1 stops=a,bc", fake_kvd_hash("echo all", 8));
    CHECK_STR(r.text, want);
    CHECK(r.request_id == first + 1);   /* ids count up */
    kvd_result_free(&r);

    /* greedy (0) and top_k 0 are values, not "unset" */
    kvd_gen_params_init(&p);
    p.prompt = "echo zero";
    p.temperature = 0;
    p.top_k = 0;
    p.seed = 0;
    CHECK_INT(kvd_generate(c, &p, &r), 0);
    CHECK_HAS(r.text, " temp=0.00 top_k=0 top_p=- min_p=- rep=- seed=0 ");
    kvd_result_free(&r);

    /* chat messages and token ids */
    struct kvd_chat_msg msgs[] = { { "system", "Be brief." }, { "user", "echo hi" } };
    kvd_gen_params_init(&p);
    p.messages = msgs;
    p.n_messages = 2;
    CHECK_INT(kvd_generate(c, &p, &r), 0);
    CHECK_HAS(r.text, "msgs=system:Be brief.|user:echo hi temp=-");
    kvd_result_free(&r);
    const int32_t ids[] = { 1, 2, 3 };
    kvd_gen_params_init(&p);
    p.token_ids = ids;
    p.n_token_ids = 3;
    CHECK_INT(kvd_generate(c, &p, &r), 0);
    CHECK_HAS(r.text, "ids=1,2,3 temp=-");
    kvd_result_free(&r);

    /* up to 64 KiB travels as text, beyond as LZ4 */
    size_t n = 200000;
    char *big = malloc(n + 1);
    REQUIRE(big != NULL);
    memcpy(big, "echo ", 5);
    for (size_t i = 5; i < n; i++)
        big[i] = (char)('a' + (i * 7 + i / 13) % 26);
    big[n] = '\0';
    big[65536] = '\0';
    CHECK_INT(gen_text(c, big, false, &r), 0);
    snprintf(want, sizeof(want), "prompt len=65536 hash=%08x ", fake_kvd_hash(big, 65536));
    CHECK(strncmp(r.text, want, strlen(want)) == 0);
    kvd_result_free(&r);
    big[65536] = 'x';
    CHECK_INT(gen_text(c, big, false, &r), 0);
    snprintf(want, sizeof(want), "lz4 len=%zu hash=%08x ", n, fake_kvd_hash(big, n));
    CHECK(strncmp(r.text, want, strlen(want)) == 0);
    if (strncmp(r.text, want, strlen(want)) != 0)
        fprintf(stderr, "  got '%.80s'\n", r.text);
    kvd_result_free(&r);
    free(big);
}

static void test_bad_params(kvd_client_t *c)
{
    pthread_mutex_lock(&fake->mu);
    int before = fake->n_requests;
    pthread_mutex_unlock(&fake->mu);

    struct kvd_gen_params p;
    struct kvd_result r;
    struct kvd_chat_msg msgs[] = { { "user", "echo" } };
    const char *stops17[17], *empty_stop[] = { "" };
    for (int i = 0; i < 17; i++)
        stops17[i] = "s";

    for (int k = 0; k < 8; k++) {
        kvd_gen_params_init(&p);
        p.prompt = "echo";
        switch (k) {
        case 0: p.prompt = NULL; break;                             /* no prompt */
        case 1: p.messages = msgs; p.n_messages = 1; break;         /* two prompts */
        case 2: p.temperature = NAN; break;
        case 3: p.top_p = 2.0f; break;
        case 4: p.stop = stops17; p.n_stop = 17; break;
        case 5: p.stop = empty_stop; p.n_stop = 1; break;
        case 6: msgs[0].role = "wizard"; p.prompt = NULL; p.messages = msgs; p.n_messages = 1;
            break;
        case 7: p.max_tokens = WIRE_MAX_NEW_TOKENS + 1; break;
        }
        CHECK_INT(kvd_generate(c, &p, &r), KVD_EINVAL);
        CHECK(r.error[0] != '\0');
        kvd_result_free(&r);
    }
    CHECK_INT(kvd_generate(NULL, &p, &r), KVD_EINVAL);
    kvd_result_free(&r);

    pthread_mutex_lock(&fake->mu);
    CHECK_INT(fake->n_requests, before);    /* refused before sending */
    pthread_mutex_unlock(&fake->mu);
}

/* What the chunk callback saw. */
struct seen {
    char text[256];
    uint32_t calls;
    uint32_t seqs[8];
    int32_t tokens[8];
    uint32_t cancel_after;  /* return non-zero after this many calls (0: never) */
    double cancel_at_ms;    /* return non-zero at this fake_kvd_now_ms() or later (0: never) */
};

static int on_chunk(void *user, const char *text, size_t len, const int32_t *tokens,
                    size_t n_tokens, uint32_t seq)
{
    struct seen *s = user;
    size_t room = sizeof(s->text) - strlen(s->text) - 1;
    strncat(s->text, text, len < room ? len : room);
    if (s->calls < 8) {
        s->seqs[s->calls] = seq;
        s->tokens[s->calls] = n_tokens > 0 ? tokens[0] : -1;
    }
    s->calls++;
    return (s->cancel_after > 0 && s->calls >= s->cancel_after) ||
           (s->cancel_at_ms > 0 && fake_kvd_now_ms() >= s->cancel_at_ms);
}

static int gen_seen(kvd_client_t *c, const char *prompt, struct seen *s, struct kvd_result *r)
{
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.prompt = prompt;
    return kvd_generate_stream(c, &p, on_chunk, s, r);
}

static void test_stream(kvd_client_t *c)
{
    struct kvd_result r;
    struct seen s = { 0 };
    CHECK_INT(gen_seen(c, "stream", &s, &r), 0);
    CHECK_STR(s.text, "Hello");
    CHECK_INT(s.calls, 2);
    CHECK(s.seqs[0] == 0 && s.seqs[1] == 1 && s.tokens[0] == 10 && s.tokens[1] == 11);
    CHECK_STR(r.text, "Hello");
    CHECK_INT(r.text_len, 5);
    CHECK(r.n_tokens == 2 && r.tokens[0] == 10 && r.tokens[1] == 11);
    CHECK_INT(r.chunks, 2);
    CHECK_INT(r.finish_reason, KVD_FINISH_LENGTH);
    CHECK_INT(r.prompt_tokens, 7);
    CHECK_INT(r.cached_prompt_tokens, 4);
    CHECK_INT(r.completion_tokens, 2);
    CHECK(r.queued_ms == 1 && r.ttft_ms == 2 && r.decode_ms == 3 && r.total_ms == 4);
    CHECK_STR(r.error, "");
    kvd_result_free(&r);

    /* the same script through kvd_generate: chunks are asked for (they keep the
     * wait alive) but not handed out; the text is the Final's */
    CHECK_INT(gen_text(c, "stream", false, &r), 0);
    CHECK_STR(r.text, "Hello");
    CHECK_INT(r.chunks, 2);
    kvd_result_free(&r);

    /* replies for other ids, before, between and after, are skipped */
    memset(&s, 0, sizeof(s));
    CHECK_INT(gen_seen(c, "stale", &s, &r), 0);
    CHECK_STR(s.text, "Hello");
    CHECK_INT(s.calls, 2);
    CHECK_STR(r.text, "Hello");
    CHECK_INT(r.chunks, 2);
    kvd_result_free(&r);

    /* a deadline with partial output is a result */
    memset(&s, 0, sizeof(s));
    CHECK_INT(gen_seen(c, "deadline", &s, &r), 0);
    CHECK_INT(r.finish_reason, KVD_FINISH_DEADLINE);
    CHECK_STR(r.text, "par");
    kvd_result_free(&r);

    /* a 3 MiB reply (its own arena) */
    CHECK_INT(gen_text(c, "big", false, &r), 0);
    CHECK_INT(r.text_len, 3u << 20);
    CHECK(r.text != NULL && strlen(r.text) == (3u << 20) && r.text[27] == 'b');
    kvd_result_free(&r);
}

static void test_server_errors(kvd_client_t *c)
{
    struct kvd_result r;
    struct seen s = { 0 };

    CHECK_INT(gen_text(c, "overloaded", true, &r), KVD_EOVERLOADED);
    CHECK_STR(r.error, "queue full");
    CHECK_INT(r.retry_after_ms, 250);
    CHECK_STR(r.text, "");
    kvd_result_free(&r);

    CHECK_INT(gen_text(c, "toolong", false, &r), KVD_ETOOLONG);
    CHECK_HAS(r.error, "does not fit the context");
    kvd_result_free(&r);

    CHECK_INT(gen_seen(c, "midfail", &s, &r), KVD_EINTERNAL);
    CHECK_STR(r.error, "worker died");
    CHECK_STR(r.text, "par");           /* what came before */
    CHECK_INT(r.chunks, 1);
    CHECK_INT(s.calls, 1);
    kvd_result_free(&r);

    CHECK_INT(gen_text(c, "cancelled", false, &r), KVD_ECANCELLED);
    CHECK_INT(r.finish_reason, KVD_FINISH_CANCELLED);
    kvd_result_free(&r);

    CHECK_INT(gen_text(c, "errcancel", false, &r), KVD_ECANCELLED);
    CHECK_STR(r.error, "cancelled by admin");
    kvd_result_free(&r);

    CHECK_INT(gen_text(c, "id0", false, &r), KVD_EBADREQUEST);
    CHECK_STR(r.error, "unreadable request");
    kvd_result_free(&r);
}

/* Each bad reply fails the call with KVD_EPROTOCOL, sends a cancel for the
 * request, and leaves the client usable. */
static void test_protocol_errors(kvd_client_t *c)
{
    static const struct { const char *prompt; bool stream; const char *why; } cases[] = {
        { "garbage", false, "unreadable reply" },
        { "badversion", false, "unreadable reply" },
        { "multipart", false, "multi-part" },
        { "seqgap", true, "chunk 2, expected 1" },
        { "chunkcount", true, "counts 3 chunks, 1 came" },
        { "textdiff", true, "does not start with" },
        { "early", true, "before accepting" },
        { "early", false, "before accepting" },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct kvd_result r;
        CHECK_INT(gen_text(c, cases[i].prompt, cases[i].stream, &r), KVD_EPROTOCOL);
        CHECK_HAS(r.error, cases[i].why);
        CHECK(fake_kvd_saw_cancel(fake, r.request_id, PATIENCE_MS));
        kvd_result_free(&r);
        CHECK_INT(gen_text(c, "stream", true, &r), 0);
        CHECK_STR(r.text, "Hello");
        kvd_result_free(&r);
    }
}

static void test_cancel_and_timeout(kvd_client_t *c)
{
    /* the callback cancels after 3 chunks: a cancel goes out, the Final
     * CANCELLED comes back, the callback is not called again */
    struct kvd_result r;
    struct seen s = { .cancel_after = 3 };
    CHECK_INT(gen_seen(c, "slow", &s, &r), KVD_ECANCELLED);
    CHECK_INT(s.calls, 3);
    CHECK_STR(s.text, "w0 w1 w2 ");
    CHECK(fake_kvd_saw_cancel(fake, r.request_id, 0));
    CHECK_INT(r.finish_reason, KVD_FINISH_CANCELLED);
    CHECK(r.text != NULL && strncmp(r.text, "w0 w1 w2 ", 9) == 0);
    CHECK(r.chunks >= 3);
    kvd_result_free(&r);

    /* no answer: KVD_ETIMEOUT after the timeout, and a cancel for it */
    kvd_client_set_timeout(c, 300);
    double t0 = fake_kvd_now_ms();
    CHECK_INT(gen_text(c, "silent", true, &r), KVD_ETIMEOUT);
    double dt = fake_kvd_now_ms() - t0;
    CHECK(dt >= 250 && dt < TIMEOUT_BOUND_MS);
    CHECK(fake_kvd_saw_cancel(fake, r.request_id, PATIENCE_MS));
    kvd_result_free(&r);
    kvd_client_set_timeout(c, 0);   /* back to the default */

    /* a slow stream keeps a short timeout alive: it restarts per message.
     * Chunks 20 ms apart, a 1 s timeout, cancelled once the stream has lasted
     * 2.5 timeouts (by the clock, not by a count of chunks, which a busy
     * machine delays) */
    kvd_client_set_timeout(c, 1000);
    memset(&s, 0, sizeof(s));
    t0 = fake_kvd_now_ms();
    s.cancel_at_ms = t0 + 2500;
    CHECK_INT(gen_seen(c, "slow", &s, &r), KVD_ECANCELLED);
    dt = fake_kvd_now_ms() - t0;
    CHECK(dt >= 2500);
    CHECK(s.calls >= 2 && s.calls < 400);
    CHECK(r.chunks >= s.calls);     /* chunks may pass the cancel on the way */
    kvd_result_free(&r);
    kvd_client_set_timeout(c, 0);

    CHECK_INT(kvd_cancel(c, 424242), KVD_ENOTFOUND);
}

static void test_stats_health(kvd_client_t *c)
{
    struct kvd_stats s;
    CHECK_INT(kvd_stats(c, &s), 0);
    CHECK_INT(s.requests_running, 2);
    CHECK_INT(s.requests_queued, 1);
    CHECK_INT(s.requests_done, 40);
    CHECK_INT(s.requests_failed, 3);
    CHECK_INT(s.prompt_tokens, 1000);
    CHECK_INT(s.cached_prompt_tokens, 250);
    CHECK_INT(s.completion_tokens, 500);
    CHECK_INT(s.blocks_total, 128);
    CHECK_INT(s.blocks_free, 60);
    CHECK_INT(s.blocks_cached, 30);
    CHECK_INT(s.blocks_in_use, 36);
    CHECK_INT(s.blocks_pending, 2);
    CHECK_INT(s.block_tokens, 16);
    CHECK_INT(s.block_bytes, 16 * 2 * 30 * 3 * 64 * 2);
    CHECK_INT(s.evictions, 5);
    CHECK_INT(s.preemptions, 1);
    CHECK_INT(s.bad_messages, 4);
    CHECK_INT(s.n_workers, 2);
    CHECK(s.workers[0].id == 0 && s.workers[0].pid == 1000 && s.workers[0].alive &&
          s.workers[0].running == 3 && s.workers[0].tokens == 5000 && s.workers[0].restarts == 0);
    CHECK(s.workers[1].id == 1 && s.workers[1].pid == 1001 && !s.workers[1].alive &&
          s.workers[1].running == 2 && s.workers[1].tokens == 5001 && s.workers[1].restarts == 1);
    /* the Prometheus text: a figure of its own, the rows, vLLM's derived names */
    char *prom = kvd_stats_prometheus(&s);
    CHECK(prom != NULL);
    CHECK(prom != NULL && strstr(prom, "# HELP kvd_requests_done_total Requests finished.\n"
                                       "# TYPE kvd_requests_done_total counter\nkvd_requests_done_total 40\n"));
    CHECK(prom != NULL && strstr(prom, "\nkvd_worker_running{worker=\"1\"} 2\n"));
    CHECK(prom != NULL && strstr(prom, "\nkvd_worker_restarts_total{worker=\"1\"} 1\n"));
    CHECK(prom != NULL && strstr(prom, "\nvllm:prefix_cache_queries_total 1000\n"));
    CHECK(prom != NULL && strstr(prom, "\nvllm:kv_cache_usage_perc 0.296875\n"));
    free(prom);
    kvd_stats_free(&s);
    CHECK(s.workers == NULL && s.n_workers == 0 && s.tenants == NULL && s.hosts == NULL);

    bool ok = false;
    uint32_t alive = 0;
    CHECK_INT(kvd_health(c, &ok, &alive), 0);
    CHECK(ok);
    CHECK_INT(alive, 2);
    atomic_store(&fake->unhealthy, true);
    CHECK_INT(kvd_health(c, &ok, &alive), 0);
    CHECK(!ok);
    CHECK_INT(alive, 0);
    atomic_store(&fake->unhealthy, false);
    CHECK_INT(kvd_health(c, NULL, NULL), 0);
}

/* Every scalar field of a message of kvd.proto is a line of its table in
 * kvd_stats_fields.h, and every line names a field: a figure added to the
 * .proto alone fails here (the rows, latencies and hashes are not scalars). */
static void check_table(const ProtobufCMessageDescriptor *d, const char *const *names, size_t n)
{
    size_t scalars = 0;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type == PROTOBUF_C_TYPE_MESSAGE || f->label == PROTOBUF_C_LABEL_REPEATED)
            continue;
        scalars++;
        bool found = false;
        for (size_t j = 0; j < n && !found; j++)
            found = strcmp(names[j], f->name) == 0;
        if (!found)
            fprintf(stderr, "%s.%s has no line in kvd_stats_fields.h\n", d->name, f->name);
        CHECK(found);
    }
    for (size_t j = 0; j < n; j++)
        CHECK(protobuf_c_message_descriptor_get_field_by_name(d, names[j]) != NULL);
    CHECK_INT(n, scalars);
}

#define FIELD_NAME(name, type, prom_type, prom_name, help) #name,

static void test_stats_table(void)
{
    static const char *const stats[] = { KVD_STATS_FIELDS(FIELD_NAME) };
    static const char *const workers[] = { KVD_WORKER_STATS_FIELDS(FIELD_NAME) };
    static const char *const hosts[] = { KVD_HOST_STATS_FIELDS(FIELD_NAME) };
    static const char *const tenants[] = { KVD_TENANT_STATS_FIELDS(FIELD_NAME) };
    check_table(&kvd__stats__descriptor, stats, sizeof(stats) / sizeof(stats[0]));
    check_table(&kvd__worker_stats__descriptor, workers, sizeof(workers) / sizeof(workers[0]));
    check_table(&kvd__host_stats__descriptor, hosts, sizeof(hosts) / sizeof(hosts[0]));
    check_table(&kvd__tenant_stats__descriptor, tenants, sizeof(tenants) / sizeof(tenants[0]));
}

int main(void)
{
    test_stats_table();
    test_default_endpoint();
    test_bad_endpoints();
    test_no_daemon();

    fake = fake_kvd_start();
    REQUIRE(fake != NULL);
    kvd_client_t *c = connect_fake(PATIENCE_MS);
    test_request_fields(c);
    test_bad_params(c);
    test_stream(c);
    test_server_errors(c);
    test_protocol_errors(c);
    test_cancel_and_timeout(c);
    test_stats_health(c);
    kvd_client_destroy(&c);
    fake_kvd_stop(&fake);
    return CHECK_DONE();
}
