/*
 * http.c - kvd's HTTP front end (see http.h): libmicrohttpd serves the
 * connections, jansson reads and writes the JSON, and the C client carries
 * each request to kvd over its ipc:// endpoint.
 *
 * One thread per connection: a request's thread blocks in the client while
 * kvd computes. A streamed request runs the client in a thread of its own,
 * which writes server-sent events into a pipe that libmicrohttpd sends as the
 * response; when the HTTP client goes away the pipe breaks, the next write
 * fails, and the chunk callback cancels the request in kvd.
 */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "err.h"
#include "kvd_client.h"

#define MAX_CHOICES 16          /* n, and prompts of one completion request, together */
#define MAX_STOP 8
#define CLIENT_TIMEOUT_MS 600000    /* the longest wait for kvd's next message */

/* HTTP statuses counted for /metrics (kvd_http_requests_total{code}). */
static const unsigned counted[] = { 200, 400, 401, 404, 405, 413, 415, 429, 500, 503, 504 };
#define N_COUNTED (sizeof(counted) / sizeof(counted[0]))

struct api_key {
    char *key, *tenant;
};

struct http_server {
    struct MHD_Daemon *d;
    struct http_params p;
    char *bind, *endpoint, *model_id;
    time_t created;
    struct api_key *keys;   /* --api-keys; NULL: the API is open */
    size_t n_keys;
    _Atomic uint64_t by_status[N_COUNTED + 1];  /* the last: any other status */
};

/* The server whose request this thread is answering (one thread per
 * connection, so per connection), for the status counters. */
static __thread struct http_server *tl_server;

static void count_status(unsigned status)
{
    if (tl_server == NULL)
        return;
    size_t i = 0;
    while (i < N_COUNTED && counted[i] != status)
        i++;
    atomic_fetch_add(&tl_server->by_status[i], 1);
}

/* One HTTP request as libmicrohttpd delivers it: the body gathered. */
struct conn {
    char *body;
    size_t len, cap;
    bool too_large;
};

/* ---- kvd's client ------------------------------------------------------------------------- */

/* Each thread (a connection's, or a stream's) keeps one client of kvd for
 * all its requests, destroyed when the thread ends: a ZeroMQ context and
 * connection per request would cost more than the rest of the HTTP layer. */
static pthread_key_t client_key;
static pthread_once_t client_once = PTHREAD_ONCE_INIT;

static void client_free(void *p)
{
    kvd_client_t *c = p;
    kvd_client_destroy(&c);
}

static void client_key_make(void)
{
    pthread_key_create(&client_key, client_free);
}

/* This thread's client, with timeout_ms for its calls; NULL with err. */
static kvd_client_t *client_get(const struct http_server *s, int timeout_ms, char *err, size_t errlen)
{
    pthread_once(&client_once, client_key_make);
    kvd_client_t *c = pthread_getspecific(client_key);
    if (c == NULL) {
        /* kvd's own plain socket: no CURVE keys from the environment */
        c = kvd_client_new_keys(s->endpoint, timeout_ms, NULL, err, errlen);
        if (c == NULL)
            return NULL;
        pthread_setspecific(client_key, c);
    }
    kvd_client_set_timeout(c, timeout_ms);
    return c;
}

/* Done with the client for this request (the thread keeps it). */
static void client_put(kvd_client_t **c)
{
    *c = NULL;
}

/* ---- responses ---------------------------------------------------------------------------- */

static enum MHD_Result send_text(struct MHD_Connection *c, unsigned status, const char *type, const char *text,
                                 size_t len, unsigned retry_after_s)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, (void *)text, MHD_RESPMEM_MUST_COPY);
    if (r == NULL)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    if (retry_after_s > 0) {
        char ra[16];
        snprintf(ra, sizeof(ra), "%u", retry_after_s);
        MHD_add_response_header(r, "Retry-After", ra);
    }
    enum MHD_Result ok = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    count_status(status);
    return ok;
}

/* Sends j (and frees it). */
static enum MHD_Result send_json(struct MHD_Connection *c, unsigned status, json_t *j, unsigned retry_after_s)
{
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (s == NULL)
        return MHD_NO;
    enum MHD_Result ok = send_text(c, status, "application/json", s, strlen(s), retry_after_s);
    free(s);
    return ok;
}

/* OpenAI's error object. */
static json_t *error_json(const char *message, const char *type, const char *param, const char *code)
{
    return json_pack("{s:{s:s, s:s, s:s?, s:s?}}", "error", "message", message, "type", type, "param", param,
                     "code", code);
}

static enum MHD_Result send_error(struct MHD_Connection *c, unsigned status, const char *message,
                                  const char *param, const char *code, unsigned retry_after_s)
{
    const char *type = status == 400 || status == 413 || status == 415 ? "invalid_request_error"
                     : status == 401 ? "authentication_error"
                     : status == 404 ? "not_found_error"
                     : status == 429 ? "rate_limit_exceeded"
                     : status == 503 ? "service_unavailable"
                     : status == 504 ? "timeout"
                                     : "server_error";
    return send_json(c, status, error_json(message, type, param, code), retry_after_s);
}

/* The HTTP status of a client error code, and OpenAI's error code for it. */
static unsigned status_of(int rc, const char **code)
{
    *code = NULL;
    switch (rc) {
    case KVD_EBADREQUEST: case KVD_EINVAL: case KVD_ERANGE: return 400;
    case KVD_ETOOLONG: *code = "context_length_exceeded"; return 400;
    case KVD_EOVERLOADED: return 429;
    case KVD_EUNAVAILABLE: case KVD_ESHUTDOWN: case KVD_ETIMEOUT: return 503;
    case KVD_EDEADLINE: return 504;
    default: return 500;
    }
}

static enum MHD_Result send_kvd_error(struct MHD_Connection *c, int rc, const struct kvd_result *res)
{
    const char *code;
    const unsigned status = status_of(rc, &code);
    /* Retry-After in whole seconds, at least 1 */
    const unsigned retry = status == 429 ? (res->retry_after_ms + 999) / 1000 + (res->retry_after_ms == 0) : 0;
    return send_error(c, status, res->error[0] ? res->error : kvd_strerror(rc), NULL, code, retry);
}

/* ---- the request --------------------------------------------------------------------------- */

/* One prompt of a completions request: text, or token ids. */
struct prompt {
    const char *text;
    int32_t *ids;
    size_t n_ids;
};

struct oai_req {
    bool chat;
    json_t *root;
    struct kvd_gen_params gp;       /* everything but the prompt and the seed */
    int64_t seed;                   /* < 0: none given */
    struct kvd_chat_msg *msgs;
    size_t n_msgs;
    struct prompt prompts[MAX_CHOICES];
    size_t n_prompts;
    const char *stops[MAX_STOP];
    int n;
    bool stream, include_usage;
    char ns[256];                   /* the cache namespace: the key's tenant, and the request's own */
    char id[40];
    time_t created;
    const char *model;
};

static void oai_free(struct oai_req *r)
{
    for (size_t i = 0; i < r->n_prompts; i++)
        free(r->prompts[i].ids);
    free(r->msgs);
    json_decref(r->root);
    free(r);
}

/* A field check that failed: its message and the field. */
struct bad {
    char msg[256];
    const char *param;
};

static int bad(struct bad *b, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int bad(struct bad *b, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->msg, sizeof(b->msg), fmt, ap);
    va_end(ap);
    b->param = param;
    return -1;
}

/* A number field in [lo, hi]: 1 and *out when present, 0 when absent or
 * null, -1 (with b) when of the wrong type or out of range. */
static int get_num(json_t *o, const char *name, double lo, double hi, double *out, struct bad *b)
{
    json_t *v = json_object_get(o, name);
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_number(v))
        return bad(b, name, "'%s' must be a number", name);
    const double x = json_number_value(v);
    if (!(x >= lo && x <= hi))
        return bad(b, name, "'%s' must be between %g and %g, got %g", name, lo, hi, x);
    *out = x;
    return 1;
}

static int get_int(json_t *o, const char *name, long long lo, long long hi, long long *out, struct bad *b)
{
    json_t *v = json_object_get(o, name);
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_integer(v))
        return bad(b, name, "'%s' must be an integer", name);
    const long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return bad(b, name, "'%s' must be between %lld and %lld, got %lld", name, lo, hi, x);
    *out = x;
    return 1;
}

static int get_bool(json_t *o, const char *name, bool *out, struct bad *b)
{
    json_t *v = json_object_get(o, name);
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_boolean(v))
        return bad(b, name, "'%s' must be a boolean", name);
    *out = json_is_true(v);
    return 1;
}

/* Token ids of a JSON array of integers (ids checked by kvd); 0 or -1. */
static int get_ids(json_t *a, const char *param, struct prompt *p, struct bad *b)
{
    const size_t n = json_array_size(a);
    p->ids = malloc((n ? n : 1) * sizeof(int32_t));
    if (p->ids == NULL)
        return bad(b, param, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
            return bad(b, param, "'%s' must hold token ids (non-negative integers)", param);
        p->ids[i] = (int32_t)json_integer_value(v);
    }
    p->n_ids = n;
    return 0;
}

/* The text of a message's content: a string, or an array of text parts
 * (joined); NULL with b otherwise. The returned string lives in r->root or is
 * kept there (a joined copy is stored into the message object). */
static const char *content_text(json_t *msg, struct bad *b)
{
    json_t *c = json_object_get(msg, "content");
    if (json_is_string(c))
        return json_string_value(c);
    if (json_is_null(c) || c == NULL)
        return "";
    if (!json_is_array(c)) {
        bad(b, "messages", "a message's content must be a string or an array of text parts");
        return NULL;
    }
    size_t total = 1, i;
    json_t *part;
    json_array_foreach(c, i, part) {
        json_t *t = json_object_get(part, "text");
        const char *type = json_string_value(json_object_get(part, "type"));
        if (type == NULL || strcmp(type, "text") != 0 || !json_is_string(t)) {
            bad(b, "messages", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported");
            return NULL;
        }
        total += json_string_length(t);
    }
    char *joined = malloc(total);
    if (joined == NULL) {
        bad(b, "messages", "out of memory");
        return NULL;
    }
    size_t at = 0;
    json_array_foreach(c, i, part) {
        json_t *t = json_object_get(part, "text");
        memcpy(joined + at, json_string_value(t), json_string_length(t));
        at += json_string_length(t);
    }
    joined[at] = '\0';
    json_object_set_new(msg, "content_joined", json_string(joined));   /* kept alive by the message */
    free(joined);
    return json_string_value(json_object_get(msg, "content_joined"));
}

/* Parses and checks a chat or completions body into r; 0, or -1 with b. */
static int parse_request(struct oai_req *r, const struct http_server *s, struct bad *b, unsigned *status)
{
    json_t *o = r->root;
    *status = 400;
    if (!json_is_object(o))
        return bad(b, NULL, "the body must be a JSON object");
    kvd_gen_params_init(&r->gp);
    r->seed = -1;
    r->n = 1;
    json_t *model = json_object_get(o, "model");
    if (model != NULL && !json_is_null(model)) {
        if (!json_is_string(model))
            return bad(b, "model", "'model' must be a string");
        if (strcmp(json_string_value(model), s->model_id) != 0) {
            *status = 404;
            return bad(b, "model", "the model '%s' does not exist; this server serves '%s'",
                       json_string_value(model), s->model_id);
        }
    }
    r->model = s->model_id;
    if (r->chat) {
        json_t *m = json_object_get(o, "messages");
        if (!json_is_array(m) || json_array_size(m) == 0)
            return bad(b, "messages", "'messages' must be a non-empty array");
        r->n_msgs = json_array_size(m);
        r->msgs = calloc(r->n_msgs, sizeof(*r->msgs));
        if (r->msgs == NULL)
            return bad(b, "messages", "out of memory");
        for (size_t i = 0; i < r->n_msgs; i++) {
            json_t *msg = json_array_get(m, i);
            const char *role = json_string_value(json_object_get(msg, "role"));
            if (!json_is_object(msg) || role == NULL)
                return bad(b, "messages", "every message needs a 'role' string");
            if (strcmp(role, "developer") == 0)
                role = "system";
            if (strcmp(role, "system") != 0 && strcmp(role, "user") != 0 && strcmp(role, "assistant") != 0)
                return bad(b, "messages", "unknown role '%s' (system, developer, user, assistant)", role);
            const char *text = content_text(msg, b);
            if (text == NULL)
                return -1;
            r->msgs[i] = (struct kvd_chat_msg){ role, text };
        }
        r->gp.messages = r->msgs;
        r->gp.n_messages = r->n_msgs;
    } else {
        json_t *p = json_object_get(o, "prompt");
        if (json_is_string(p)) {
            r->prompts[r->n_prompts++].text = json_string_value(p);
        } else if (json_is_array(p) && json_array_size(p) > 0) {
            json_t *first = json_array_get(p, 0);
            if (json_is_integer(first)) {
                if (get_ids(p, "prompt", &r->prompts[r->n_prompts++], b) != 0)
                    return -1;
            } else {
                if (json_array_size(p) > MAX_CHOICES)
                    return bad(b, "prompt", "at most %d prompts in one request", MAX_CHOICES);
                size_t i;
                json_t *e;
                json_array_foreach(p, i, e) {
                    struct prompt *q = &r->prompts[r->n_prompts++];
                    if (json_is_string(e))
                        q->text = json_string_value(e);
                    else if (!json_is_array(e) || get_ids(e, "prompt", q, b) != 0)
                        return bad(b, "prompt", "'prompt' must be a string, a list of strings, token ids "
                                   "or a list of token-id lists");
                }
            }
        } else {
            return bad(b, "prompt", "'prompt' must be a string, a list of strings, token ids or a list of "
                       "token-id lists");
        }
    }
    double x = 0;  /* set when rc > 0; -O3 cannot tell */
    long long v = 0;
    int rc;
    if ((rc = get_int(o, "max_tokens", 1, 1 << 20, &v, b)) < 0)
        return -1;
    if (rc)
        r->gp.max_tokens = (uint32_t)v;
    if ((rc = get_int(o, "max_completion_tokens", 1, 1 << 20, &v, b)) < 0)
        return -1;
    if (rc)
        r->gp.max_tokens = (uint32_t)v;
    if ((rc = get_num(o, "temperature", 0, 2, &x, b)) < 0)
        return -1;
    if (rc)
        r->gp.temperature = (float)x;
    if ((rc = get_num(o, "top_p", 0, 1, &x, b)) < 0)
        return -1;
    if (rc)
        r->gp.top_p = (float)x;
    if ((rc = get_int(o, "top_k", -1, 1 << 20, &v, b)) < 0)
        return -1;
    if (rc)
        r->gp.top_k = v < 0 ? 0 : (int32_t)v;    /* -1 (vLLM) and 0: off */
    if ((rc = get_num(o, "min_p", 0, 1, &x, b)) < 0)
        return -1;
    if (rc)
        r->gp.min_p = (float)x;
    if ((rc = get_num(o, "repetition_penalty", 0.01, 100, &x, b)) < 0)
        return -1;
    if (rc)
        r->gp.repeat_penalty = (float)x;
    if ((rc = get_int(o, "seed", INT64_MIN, INT64_MAX, &v, b)) < 0)
        return -1;
    if (rc)
        r->seed = v < 0 ? -v : v;
    if ((rc = get_int(o, "n", 1, MAX_CHOICES, &v, b)) < 0)
        return -1;
    if (rc)
        r->n = (int)v;
    if ((size_t)r->n * (r->chat ? 1 : r->n_prompts) > MAX_CHOICES)
        return bad(b, "n", "at most %d choices in one request (n times the prompts)", MAX_CHOICES);
    if (get_bool(o, "stream", &r->stream, b) < 0)
        return -1;
    json_t *so = json_object_get(o, "stream_options");
    if (so != NULL && !json_is_null(so)) {
        if (!json_is_object(so))
            return bad(b, "stream_options", "'stream_options' must be an object");
        if (get_bool(so, "include_usage", &r->include_usage, b) < 0)
            return -1;
    }
    /* chat: logprobs (bool) and top_logprobs (0..20); completions: logprobs (0..20) */
    if (r->chat) {
        bool lp = false;
        if (get_bool(o, "logprobs", &lp, b) < 0)
            return -1;
        if ((rc = get_int(o, "top_logprobs", 0, KVD_MAX_TOP_LOGPROBS, &v, b)) < 0)
            return -1;
        if (rc && !lp)
            return bad(b, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
        if (lp)
            r->gp.logprobs = rc ? (int32_t)v : 0;
    } else {
        if ((rc = get_int(o, "logprobs", 0, KVD_MAX_TOP_LOGPROBS, &v, b)) < 0)
            return -1;
        if (rc)
            r->gp.logprobs = (int32_t)v;
    }
    json_t *stop = json_object_get(o, "stop");
    if (json_is_string(stop)) {
        r->stops[r->gp.n_stop++] = json_string_value(stop);
    } else if (json_is_array(stop)) {
        if (json_array_size(stop) > MAX_STOP)
            return bad(b, "stop", "at most %d stop strings", MAX_STOP);
        size_t i;
        json_t *e;
        json_array_foreach(stop, i, e) {
            if (!json_is_string(e) || json_string_length(e) == 0)
                return bad(b, "stop", "'stop' must be a string or a list of non-empty strings");
            r->stops[r->gp.n_stop++] = json_string_value(e);
        }
    } else if (stop != NULL && !json_is_null(stop)) {
        return bad(b, "stop", "'stop' must be a string or a list of strings");
    }
    r->gp.stop = r->stops;
    if (get_bool(o, "ignore_eos", &r->gp.ignore_eos, b) < 0)     /* vLLM's extension */
        return -1;
    json_t *ns = json_object_get(o, "namespace");                   /* kvd's: a cache namespace */
    if (ns != NULL && !json_is_null(ns) && (!json_is_string(ns) || json_string_length(ns) > 128))
        return bad(b, "namespace", "'namespace' must be a string of at most 128 bytes");
    if (r->ns[0] || json_is_string(ns)) {
        /* the tenant's, then the request's inside it: "tenant/namespace" */
        const size_t at = strlen(r->ns);
        snprintf(r->ns + at, sizeof(r->ns) - at, "%s%s", at ? "/" : "", json_is_string(ns) ? json_string_value(ns) : "");
        r->gp.ns = r->ns;
    }
    json_t *user = json_object_get(o, "user");
    if (user != NULL && !json_is_null(user) && !json_is_string(user))
        return bad(b, "user", "'user' must be a string");
    return 0;
}

/* The parameters of choice `index` (prompt index / n, sample index % n). */
static struct kvd_gen_params choice_params(const struct oai_req *r, int index)
{
    struct kvd_gen_params gp = r->gp;
    if (!r->chat) {
        const struct prompt *p = &r->prompts[index / r->n];
        gp.prompt = p->text;
        gp.token_ids = p->ids;
        gp.n_token_ids = p->n_ids;
    }
    gp.seed = r->seed >= 0 ? r->seed + index : -1;
    return gp;
}

/* A JSON string of generated text: as is when it is UTF-8 (kvd sends whole
 * characters), else with each byte of an invalid sequence as U+FFFD. */
static json_t *text_json(const char *s, size_t len)
{
    if (s == NULL)
        return json_string("");
    json_t *j = json_stringn(s, len);
    if (j != NULL)
        return j;
    char *out = malloc(len * 3 + 1);
    if (out == NULL)
        return json_string("");
    size_t o = 0, i = 0;
    while (i < len) {
        const unsigned char c = (unsigned char)s[i];
        const size_t want = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        json_t *probe = want > 0 && i + want <= len ? json_stringn(s + i, want) : NULL;
        if (probe != NULL) {
            memcpy(out + o, s + i, want);
            o += want;
            i += want;
            json_decref(probe);
        } else {
            memcpy(out + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        }
    }
    j = json_stringn(out, o);
    free(out);
    return j ? j : json_string("");
}

/* A logprob as JSON: a number, with -9999 for what JSON cannot hold (as
 * OpenAI writes the logprob of a token with no chance). */
static json_t *lp_num(float x)
{
    return json_real(isfinite(x) ? (double)x : -9999.0);
}

/* chat's {"token", "logprob", "bytes"}. */
static json_t *lp_token_json(const char *tok, size_t len, float lp)
{
    json_t *bytes = json_array();
    for (size_t i = 0; i < len; i++)
        json_array_append_new(bytes, json_integer((unsigned char)tok[i]));
    return json_pack("{s:o, s:o, s:o}", "token", text_json(tok, len), "logprob", lp_num(lp), "bytes", bytes);
}

/* chat's logprobs of n tokens: {"content": [...], "refusal": null}. */
static json_t *chat_logprobs_json(const struct kvd_logprob *lp, size_t n)
{
    json_t *content = json_array();
    for (size_t i = 0; i < n; i++) {
        json_t *e = lp_token_json(lp[i].token, lp[i].token_len, lp[i].logprob);
        json_t *top = json_array();
        for (uint32_t j = 0; j < lp[i].n_top; j++)
            json_array_append_new(top, lp_token_json(lp[i].top_tokens[j], lp[i].top_token_lens[j],
                                                     lp[i].top_logprobs[j]));
        json_object_set_new(e, "top_logprobs", top);
        json_array_append_new(content, e);
    }
    return json_pack("{s:o, s:n}", "content", content, "refusal");
}

/* completions' logprobs of n tokens: {"tokens", "token_logprobs",
 * "top_logprobs" (one {token: logprob} object per token), "text_offset"
 * (characters from the start of the choice's text; *offset carries it on
 * from chunk to chunk)}. */
static json_t *completion_logprobs_json(const struct kvd_logprob *lp, size_t n, size_t *offset)
{
    json_t *tokens = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    for (size_t i = 0; i < n; i++) {
        json_t *t = text_json(lp[i].token, lp[i].token_len);
        json_array_append_new(offs, json_integer((json_int_t)*offset));
        const char *u = json_string_value(t);
        for (size_t k = 0; u[k]; k++)       /* characters: bytes that start one */
            *offset += ((unsigned char)u[k] & 0xC0) != 0x80;
        json_array_append_new(tokens, t);
        json_array_append_new(lps, lp_num(lp[i].logprob));
        json_t *top = json_object();
        for (uint32_t j = 0; j < lp[i].n_top; j++) {
            json_t *key = text_json(lp[i].top_tokens[j], lp[i].top_token_lens[j]);
            if (json_object_get(top, json_string_value(key)) == NULL)   /* the likelier of equal texts */
                json_object_set_new(top, json_string_value(key), lp_num(lp[i].top_logprobs[j]));
            json_decref(key);
        }
        json_array_append_new(tops, top);
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", tokens, "token_logprobs", lps, "top_logprobs", tops,
                     "text_offset", offs);
}

static const char *finish_name(int f)
{
    return f == KVD_FINISH_LENGTH ? "length" : "stop";
}

static json_t *usage_json(uint64_t prompt, uint64_t completion, uint64_t cached)
{
    return json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", (json_int_t)prompt, "completion_tokens",
                     (json_int_t)completion, "total_tokens", (json_int_t)(prompt + completion),
                     "prompt_tokens_details", "cached_tokens", (json_int_t)cached);
}

static void new_id(char *buf, size_t len, const char *prefix)
{
    uint8_t b[12];
    if (getrandom(b, sizeof(b), 0) != (ssize_t)sizeof(b))
        memset(b, 0, sizeof(b));
    int at = snprintf(buf, len, "%s", prefix);
    for (size_t i = 0; i < sizeof(b) && at + 2 < (int)len; i++)
        at += snprintf(buf + at, len - (size_t)at, "%02x", b[i]);
}

/* ---- not streamed ------------------------------------------------------------------------- */

static enum MHD_Result run_whole(struct MHD_Connection *c, const struct http_server *s, struct oai_req *r)
{
    char err[256];
    kvd_client_t *kc = client_get(s, CLIENT_TIMEOUT_MS, err, sizeof(err));
    if (kc == NULL)
        return send_error(c, 503, err, NULL, NULL, 0);
    json_t *choices = json_array();
    uint64_t prompt = 0, completion = 0, cached = 0;
    const int total = r->n * (int)(r->chat ? 1 : r->n_prompts);
    for (int i = 0; i < total; i++) {
        struct kvd_gen_params gp = choice_params(r, i);
        struct kvd_result res;
        const int rc = kvd_generate(kc, &gp, &res);
        if (rc != 0) {
            json_decref(choices);
            client_put(&kc);
            enum MHD_Result ok = send_kvd_error(c, rc, &res);
            kvd_result_free(&res);
            return ok;
        }
        if (i % r->n == 0) {        /* a prompt counts once, whatever n */
            prompt += res.prompt_tokens;
            cached += res.cached_prompt_tokens;
        }
        completion += res.completion_tokens;
        size_t offset = 0;
        json_t *lp = r->gp.logprobs < 0 ? json_null()
                     : r->chat           ? chat_logprobs_json(res.logprobs, res.n_logprobs)
                                         : completion_logprobs_json(res.logprobs, res.n_logprobs, &offset);
        json_t *ch = r->chat ? json_pack("{s:i, s:{s:s, s:o}, s:o, s:s}", "index", i, "message", "role",
                                         "assistant", "content", text_json(res.text, res.text_len), "logprobs",
                                         lp, "finish_reason", finish_name(res.finish_reason))
                             : json_pack("{s:i, s:o, s:o, s:s}", "index", i, "text",
                                         text_json(res.text, res.text_len), "logprobs", lp, "finish_reason",
                                         finish_name(res.finish_reason));
        json_array_append_new(choices, ch);
        kvd_result_free(&res);
    }
    client_put(&kc);
    json_t *out = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", r->id, "object",
                            r->chat ? "chat.completion" : "text_completion", "created", (json_int_t)r->created,
                            "model", r->model, "choices", choices, "usage", usage_json(prompt, completion, cached));
    return send_json(c, 200, out, 0);
}

/* ---- streamed ---------------------------------------------------------------------------- */

struct stream_job {
    const struct http_server *s;
    struct oai_req *r;
    int wfd;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool started;           /* the first event is written: the response is 200 */
    bool finished;
    bool broken;            /* a write failed: the HTTP client is gone */
    int rc;                 /* the failing call's code, before anything was sent */
    struct kvd_result res;  /* its result (the message) */
    int index;              /* the choice being generated */
    bool role_sent;
    size_t text_offset;     /* completions' logprobs: characters of the choice so far */
};

static void job_signal_start(struct stream_job *j)
{
    pthread_mutex_lock(&j->mu);
    j->started = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* Writes one event "data: <j>\n\n" (frees j); false once the client is gone. */
static bool emit(struct stream_job *jb, json_t *j)
{
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (jb->broken)
        goto out;
    if (!jb->started)
        job_signal_start(jb);
    /* one write per event: the pipe hands it on whole (up to PIPE_BUF), one HTTP chunk */
    const char *payload = s ? s : "[DONE]";
    const size_t len = strlen(payload) + 8;
    char *ev = malloc(len + 1);
    if (ev == NULL) {
        jb->broken = true;
        goto out;
    }
    snprintf(ev, len + 1, "data: %s\n\n", payload);
    size_t off = 0;
    while (off < len) {
        ssize_t w = write(jb->wfd, ev + off, len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            jb->broken = true;
            break;
        }
        off += (size_t)w;
    }
    free(ev);
out:
    free(s);
    return !jb->broken;
}

/* A chunk event: chat's delta (role, content, or nothing) or completions'
 * text, with finish_reason when given. */
static json_t *chunk_json(struct stream_job *jb, const char *role, const char *text, size_t len,
                          const struct kvd_logprob *lp, size_t n_lp, const char *finish)
{
    const struct oai_req *r = jb->r;
    json_t *choice;
    json_t *lpj = lp == NULL ? json_null()
                  : r->chat  ? chat_logprobs_json(lp, n_lp)
                             : completion_logprobs_json(lp, n_lp, &jb->text_offset);
    if (r->chat) {
        json_t *delta = json_object();
        if (role)
            json_object_set_new(delta, "role", json_string(role));
        if (text)
            json_object_set_new(delta, "content", text_json(text, len));
        choice = json_pack("{s:i, s:o, s:o, s:s?}", "index", jb->index, "delta", delta, "logprobs", lpj,
                           "finish_reason", finish);
        if (finish == NULL)
            json_object_set_new(choice, "finish_reason", json_null());
    } else {
        choice = json_pack("{s:i, s:o, s:o, s:s?}", "index", jb->index, "text", text_json(text, text ? len : 0),
                           "logprobs", lpj, "finish_reason", finish);
        if (finish == NULL)
            json_object_set_new(choice, "finish_reason", json_null());
    }
    json_t *out = json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", r->id, "object",
                            r->chat ? "chat.completion.chunk" : "text_completion", "created",
                            (json_int_t)r->created, "model", r->model, "choices", choice);
    if (r->include_usage)
        json_object_set_new(out, "usage", json_null());
    return out;
}

static int on_chunk(void *user, const struct kvd_chunk *k)
{
    struct stream_job *jb = user;
    if (jb->r->chat && !jb->role_sent) {
        jb->role_sent = true;
        if (!emit(jb, chunk_json(jb, "assistant", "", 0, NULL, 0, NULL)))
            return 1;
    }
    if (k->len == 0 && k->logprobs == NULL)
        return 0;
    /* with logprobs, a chunk whose text is held back (a possible stop string)
     * still goes out: its tokens' logprobs come now, their text later */
    return emit(jb, chunk_json(jb, NULL, k->text, k->len, k->logprobs, k->logprobs ? k->n_tokens : 0, NULL))
               ? 0 : 1;  /* non-zero: cancel */
}

static void *stream_main(void *arg)
{
    struct stream_job *jb = arg;
    struct oai_req *r = jb->r;
    char err[256];
    kvd_client_t *kc = client_get(jb->s, CLIENT_TIMEOUT_MS, err, sizeof(err));
    uint64_t prompt = 0, completion = 0, cached = 0;
    const int total = r->n * (int)(r->chat ? 1 : r->n_prompts);
    int rc = kc ? 0 : KVD_EUNAVAILABLE;
    if (kc == NULL)
        snprintf(jb->res.error, sizeof(jb->res.error), "%s", err);
    for (int i = 0; i < total && rc == 0 && !jb->broken; i++) {
        struct kvd_gen_params gp = choice_params(r, i);
        jb->index = i;
        jb->role_sent = false;
        jb->text_offset = 0;
        struct kvd_result res;
        rc = kvd_generate_chunks(kc, &gp, on_chunk, jb, &res);
        if (rc == 0) {
            if (i % r->n == 0) {
                prompt += res.prompt_tokens;
                cached += res.cached_prompt_tokens;
            }
            completion += res.completion_tokens;
            if (r->chat && !jb->role_sent)
                emit(jb, chunk_json(jb, "assistant", "", 0, NULL, 0, NULL));
            emit(jb, chunk_json(jb, NULL, NULL, 0, NULL, 0, finish_name(res.finish_reason)));
            kvd_result_free(&res);
        } else if (!jb->started) {
            jb->rc = rc;
            jb->res = res;      /* the handler answers with the error */
        } else {
            if (!jb->broken) {  /* after the first event: the error as an event */
                const char *code;
                status_of(rc, &code);
                emit(jb, error_json(res.error[0] ? res.error : kvd_strerror(rc), "server_error", NULL, code));
            }
            kvd_result_free(&res);
        }
    }
    client_put(&kc);
    if (jb->started && !jb->broken) {
        if (rc == 0 && r->include_usage) {
            json_t *u = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", r->id, "object",
                                  r->chat ? "chat.completion.chunk" : "text_completion", "created",
                                  (json_int_t)r->created, "model", r->model, "choices", "usage",
                                  usage_json(prompt, completion, cached));
            emit(jb, u);
        }
        emit(jb, NULL);     /* data: [DONE] */
    }
    pthread_mutex_lock(&jb->mu);
    jb->finished = true;
    const bool handed_off = jb->started;
    pthread_cond_broadcast(&jb->cv);
    pthread_mutex_unlock(&jb->mu);
    if (handed_off) {       /* the handler has gone on: this thread owns the job */
        close(jb->wfd);
        oai_free(jb->r);
        pthread_mutex_destroy(&jb->mu);
        pthread_cond_destroy(&jb->cv);
        free(jb);
    }
    return NULL;
}

/* Starts the stream; answers with its first events as a 200, or with the
 * error kvd gave before any. Takes r. */
static enum MHD_Result run_stream(struct MHD_Connection *c, const struct http_server *s, struct oai_req *r)
{
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
        oai_free(r);
        return send_error(c, 500, "no pipe for the stream", NULL, NULL, 0);
    }
    struct stream_job *jb = calloc(1, sizeof(*jb));
    if (jb == NULL) {
        close(fds[0]);
        close(fds[1]);
        oai_free(r);
        return send_error(c, 500, "out of memory", NULL, NULL, 0);
    }
    jb->s = s;
    jb->r = r;
    jb->wfd = fds[1];
    pthread_mutex_init(&jb->mu, NULL);
    pthread_cond_init(&jb->cv, NULL);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, stream_main, jb) != 0) {
        pthread_attr_destroy(&at);
        close(fds[0]);
        close(fds[1]);
        oai_free(r);
        free(jb);
        return send_error(c, 500, "no thread for the stream", NULL, NULL, 0);
    }
    pthread_attr_destroy(&at);
    pthread_mutex_lock(&jb->mu);
    while (!jb->started && !jb->finished)
        pthread_cond_wait(&jb->cv, &jb->mu);
    const bool started = jb->started;
    pthread_mutex_unlock(&jb->mu);
    if (!started) {         /* failed before its first event; the thread is done with jb */
        close(fds[0]);
        close(fds[1]);
        enum MHD_Result ok = send_kvd_error(c, jb->rc, &jb->res);
        kvd_result_free(&jb->res);
        oai_free(jb->r);
        pthread_mutex_destroy(&jb->mu);
        pthread_cond_destroy(&jb->cv);
        free(jb);
        return ok;
    }
    struct MHD_Response *resp = MHD_create_response_from_pipe(fds[0]);  /* closes fds[0] */
    if (resp == NULL) {
        close(fds[0]);      /* the writer sees the pipe break and cancels */
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    enum MHD_Result ok = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);
    count_status(200);
    return ok;
}

/* ---- the other routes --------------------------------------------------------------------- */

static enum MHD_Result route_health(struct MHD_Connection *c, const struct http_server *s, bool ready)
{
    kvd_client_t *kc = client_get(s, 2000, NULL, 0);
    bool ok = false;
    uint32_t alive = 0;
    const int rc = kc ? kvd_health(kc, &ok, &alive) : KVD_EUNAVAILABLE;
    client_put(&kc);
    if (rc != 0)
        return send_error(c, 503, "kvd does not answer", NULL, NULL, 0);
    if (ready && (!ok || alive == 0))
        return send_error(c, 503, "no worker is ready", NULL, NULL, 0);
    return send_json(c, 200, json_pack("{s:s, s:i}", "status", ok ? "ok" : "no worker", "workers", (int)alive), 0);
}

static enum MHD_Result route_models(struct MHD_Connection *c, const struct http_server *s)
{
    return send_json(c, 200,
                     json_pack("{s:s, s:[{s:s, s:s, s:I, s:s}]}", "object", "list", "data", "id", s->model_id,
                               "object", "model", "created", (json_int_t)s->created, "owned_by", "kvd"),
                     0);
}

/* POST /tokenize {"prompt": text} or {"messages": [...]}: {"tokens", "count",
 * "max_model_len"}; POST /detokenize {"tokens": [...]}: {"prompt"} (vLLM's shapes). */
static enum MHD_Result route_tokens(struct MHD_Connection *c, const struct http_server *s, json_t *o, bool detok)
{
    if (!json_is_object(o))
        return send_error(c, 400, "the body must be a JSON object", NULL, NULL, 0);
    json_t *model = json_object_get(o, "model");
    if (json_is_string(model) && strcmp(json_string_value(model), s->model_id) != 0)
        return send_error(c, 404, "no such model", "model", "model_not_found", 0);
    char err[256];
    kvd_client_t *kc = client_get(s, CLIENT_TIMEOUT_MS, err, sizeof(err));
    if (kc == NULL)
        return send_error(c, 503, err, NULL, NULL, 0);
    enum MHD_Result ok;
    int rc;
    if (detok) {
        json_t *a = json_object_get(o, "tokens");
        struct prompt p = { 0 };
        struct bad b = { "", NULL };
        if (!json_is_array(a) || get_ids(a, "tokens", &p, &b) != 0) {
            free(p.ids);
            client_put(&kc);
            return send_error(c, 400, b.msg[0] ? b.msg : "'tokens' must be a list of token ids", "tokens", NULL, 0);
        }
        char *text = NULL;
        rc = kvd_detokenize(kc, p.ids, p.n_ids, &text, err, sizeof(err));
        free(p.ids);
        ok = rc == 0 ? send_json(c, 200, json_pack("{s:s}", "prompt", text), 0)
                     : send_error(c, status_of(rc, &(const char *){ NULL }), err[0] ? err : kvd_strerror(rc),
                                  "tokens", NULL, 0);
        free(text);
    } else {
        struct oai_req r = { 0 };
        struct bad b = { "", NULL };
        json_t *m = json_object_get(o, "messages");
        const char *text = json_string_value(json_object_get(o, "prompt"));
        if (m != NULL) {
            r.chat = true;
            unsigned st;
            r.root = json_pack("{s:O}", "messages", m);   /* parse_request's checks, messages only */
            if (parse_request(&r, s, &b, &st) != 0) {
                free(r.msgs);
                json_decref(r.root);
                client_put(&kc);
                return send_error(c, 400, b.msg, b.param, NULL, 0);
            }
        } else if (text == NULL) {
            client_put(&kc);
            return send_error(c, 400, "give 'prompt' (a string) or 'messages'", "prompt", NULL, 0);
        }
        int32_t *ids = NULL;
        size_t n = 0;
        uint32_t max_ctx = 0;
        rc = kvd_tokenize(kc, m ? NULL : text, r.msgs, r.n_msgs, &ids, &n, &max_ctx, err, sizeof(err));
        free(r.msgs);
        if (m != NULL)
            json_decref(r.root);
        if (rc == 0) {
            json_t *arr = json_array();
            for (size_t i = 0; i < n; i++)
                json_array_append_new(arr, json_integer(ids[i]));
            ok = send_json(c, 200, json_pack("{s:o, s:I, s:I}", "tokens", arr, "count", (json_int_t)n,
                                             "max_model_len", (json_int_t)max_ctx), 0);
        } else {
            ok = send_error(c, status_of(rc, &(const char *){ NULL }), err[0] ? err : kvd_strerror(rc), NULL, NULL, 0);
        }
        free(ids);
    }
    client_put(&kc);
    return ok;
}

/* /metrics: kvd's statistics in Prometheus' text format (kvd_stats_prometheus). */
static enum MHD_Result route_metrics(struct MHD_Connection *c, const struct http_server *s)
{
    kvd_client_t *kc = client_get(s, 5000, NULL, 0);
    struct kvd_stats st;
    const int rc = kc ? kvd_stats(kc, &st) : KVD_EUNAVAILABLE;
    client_put(&kc);
    if (rc != 0)
        return send_error(c, 503, "kvd does not answer", NULL, NULL, 0);
    char *text = kvd_stats_prometheus(&st);
    kvd_stats_free(&st);
    if (text == NULL)
        return MHD_NO;
    /* and this front end's own: responses by status */
    size_t len = strlen(text), cap = len + 128 + 64 * (N_COUNTED + 1);
    char *all = realloc(text, cap);
    if (all == NULL) {
        free(text);
        return MHD_NO;
    }
    len += (size_t)snprintf(all + len, cap - len, "# HELP kvd_http_requests_total HTTP responses by status.\n"
                                                  "# TYPE kvd_http_requests_total counter\n");
    for (size_t i = 0; i <= N_COUNTED; i++) {
        char code[8];
        snprintf(code, sizeof(code), "%u", i < N_COUNTED ? counted[i] : 0u);
        len += (size_t)snprintf(all + len, cap - len, "kvd_http_requests_total{code=\"%s\"} %llu\n",
                                i < N_COUNTED ? code : "other", (unsigned long long)atomic_load(&s->by_status[i]));
    }
    enum MHD_Result ok = send_text(c, 200, "text/plain; version=0.0.4", all, len, 0);
    free(all);
    return ok;
}

/* ---- API keys ----------------------------------------------------------------------------- */

/* The tenant of "Bearer KEY", or NULL. Every key is compared in full, in time
 * that depends on the lengths only. */
static const char *authorize(const struct http_server *s, const char *auth)
{
    if (auth == NULL || strncasecmp(auth, "Bearer ", 7) != 0)
        return NULL;
    const char *key = auth + 7;
    const size_t kl = strlen(key);
    const char *found = NULL;
    for (size_t i = 0; i < s->n_keys; i++) {
        const size_t l = strlen(s->keys[i].key);
        unsigned diff = (unsigned)(l != kl);
        for (size_t j = 0; j < l; j++)
            diff |= (unsigned char)s->keys[i].key[j] ^ (unsigned char)(j < kl ? key[j] : 0);
        if (diff == 0 && found == NULL)
            found = s->keys[i].tenant;
    }
    return found;
}

/* Reads a file of "KEY TENANT" lines ('#' comments and blank lines skipped);
 * 0, or -1 with err. */
static int load_keys(http_server_t *s, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        snprintf(err, errlen, "--api-keys %s: %s", path, strerror(errno));
        return -1;
    }
    char line[1024];
    int lineno = 0, rc = 0;
    while (rc == 0 && fgets(line, sizeof(line), f) != NULL) {
        lineno++;
        char key[512], tenant[512], extra[8];
        const char *p = line + strspn(line, " \t");
        if (*p == '#' || *p == '\n' || *p == '\0')
            continue;
        if (sscanf(p, "%511s %511s %7s", key, tenant, extra) != 2 || strlen(key) < 8 || strlen(tenant) > 100) {
            snprintf(err, errlen, "--api-keys %s:%d: want KEY TENANT (a key of 8 or more characters, a tenant "
                     "of at most 100)", path, lineno);
            rc = -1;
            break;
        }
        struct api_key *k = realloc(s->keys, (s->n_keys + 1) * sizeof(*k));
        if (k == NULL) {
            snprintf(err, errlen, "out of memory");
            rc = -1;
            break;
        }
        s->keys = k;
        s->keys[s->n_keys].key = strdup(key);
        s->keys[s->n_keys].tenant = strdup(tenant);
        s->n_keys++;
    }
    fclose(f);
    if (rc == 0 && s->n_keys == 0) {
        snprintf(err, errlen, "--api-keys %s: no keys in the file", path);
        rc = -1;
    }
    return rc;
}

/* ---- dispatch ------------------------------------------------------------------------------ */

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    struct http_server *s = cls;
    (void)version;
    tl_server = s;
    struct conn *cn = *con_cls;
    if (cn == NULL) {
        cn = calloc(1, sizeof(*cn));
        if (cn == NULL)
            return MHD_NO;
        *con_cls = cn;
        return MHD_YES;
    }
    if (*upload_size > 0) {     /* gather the body, up to the limit */
        if (!cn->too_large && cn->len + *upload_size > s->p.max_body) {
            cn->too_large = true;
            free(cn->body);
            cn->body = NULL;
            cn->len = cn->cap = 0;
        }
        if (!cn->too_large) {
            if (cn->len + *upload_size + 1 > cn->cap) {
                size_t cap = (cn->len + *upload_size + 1) * 2;
                char *b = realloc(cn->body, cap);
                if (b == NULL)
                    return MHD_NO;
                cn->body = b;
                cn->cap = cap;
            }
            memcpy(cn->body + cn->len, upload, *upload_size);
            cn->len += *upload_size;
            cn->body[cn->len] = '\0';
        }
        *upload_size = 0;
        return MHD_YES;
    }
    const bool get = strcmp(method, "GET") == 0, post = strcmp(method, "POST") == 0;
    /* with API keys, the API needs one; the probes and /metrics stay open */
    const char *tenant = NULL;
    if (s->keys != NULL && (strncmp(url, "/v1/", 4) == 0 || strcmp(url, "/tokenize") == 0 ||
                            strcmp(url, "/detokenize") == 0)) {
        tenant = authorize(s, MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization"));
        if (tenant == NULL)
            return send_error(c, 401, "a valid API key is needed (Authorization: Bearer KEY)", NULL,
                              "invalid_api_key", 0);
    }
    if (get && strcmp(url, "/health") == 0)
        return route_health(c, s, false);
    if (get && strcmp(url, "/ready") == 0)
        return route_health(c, s, true);
    if (get && strcmp(url, "/v1/models") == 0)
        return route_models(c, s);
    if (get && strcmp(url, "/metrics") == 0)
        return route_metrics(c, s);
    const bool chat = strcmp(url, "/v1/chat/completions") == 0, compl = strcmp(url, "/v1/completions") == 0;
    const bool tokz = strcmp(url, "/tokenize") == 0, detok = strcmp(url, "/detokenize") == 0;
    if (!chat && !compl && !tokz && !detok) {
        char msg[300];
        snprintf(msg, sizeof(msg), "no route %s %.200s", method, url);
        return send_error(c, 404, msg, NULL, NULL, 0);
    }
    if (!post)
        return send_error(c, 405, "use POST", NULL, NULL, 0);
    if (cn->too_large) {
        char msg[128];
        snprintf(msg, sizeof(msg), "the body is over the limit of %u bytes", s->p.max_body);
        return send_error(c, 413, msg, NULL, NULL, 0);
    }
    const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Type");
    if (ct != NULL && strncasecmp(ct, "application/json", 16) != 0)
        return send_error(c, 415, "the body must be JSON (Content-Type: application/json)", NULL, NULL, 0);
    struct oai_req *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return MHD_NO;
    if (tenant != NULL)
        snprintf(r->ns, sizeof(r->ns), "tenant:%s", tenant);
    r->chat = chat || tokz;
    json_error_t je;
    r->root = json_loadb(cn->body ? cn->body : "", cn->len, JSON_REJECT_DUPLICATES, &je);
    if (r->root == NULL) {
        oai_free(r);
        char msg[300];
        snprintf(msg, sizeof(msg), "the body is not valid JSON: %s (line %d, column %d)", je.text, je.line,
                 je.column);
        return send_error(c, 400, msg, NULL, NULL, 0);
    }
    if (tokz || detok) {
        enum MHD_Result ok = route_tokens(c, s, r->root, detok);
        oai_free(r);
        return ok;
    }
    struct bad b = { "", NULL };
    unsigned status;
    if (parse_request(r, s, &b, &status) != 0) {
        enum MHD_Result ok = send_error(c, status, b.msg, b.param, status == 404 ? "model_not_found" : NULL, 0);
        oai_free(r);
        return ok;
    }
    new_id(r->id, sizeof(r->id), chat ? "chatcmpl-" : "cmpl-");
    r->created = time(NULL);
    if (r->stream)
        return run_stream(c, s, r);     /* takes r */
    enum MHD_Result ok = run_whole(c, s, r);
    oai_free(r);
    return ok;
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    (void)cls;
    (void)c;
    (void)toe;
    struct conn *cn = *con_cls;
    if (cn != NULL) {
        free(cn->body);
        free(cn);
        *con_cls = NULL;
    }
}

/* ---- start and stop ------------------------------------------------------------------------ */

/* HOST:PORT into an IPv4 address; 0 or -1. */
static int parse_bind(const char *bind, struct sockaddr_in *sa)
{
    const char *colon = strrchr(bind, ':');
    if (colon == NULL || colon == bind || colon[1] == '\0')
        return -1;
    char host[256];
    const size_t hl = (size_t)(colon - bind);
    if (hl >= sizeof(host))
        return -1;
    memcpy(host, bind, hl);
    host[hl] = '\0';
    char *end;
    const long port = strtol(colon + 1, &end, 10);
    if (*end != '\0' || port < 0 || port > 65535)
        return -1;
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)port);
    if (strcmp(host, "localhost") == 0)
        strcpy(host, "127.0.0.1");
    if (strcmp(host, "*") == 0 || strcmp(host, "0.0.0.0") == 0) {
        sa->sin_addr.s_addr = htonl(INADDR_ANY);
        return 0;
    }
    return inet_pton(AF_INET, host, &sa->sin_addr) == 1 ? 0 : -1;
}

http_server_t *http_start(const struct http_params *p, char *err, size_t errlen)
{
    struct sockaddr_in sa;
    if (parse_bind(p->bind, &sa) != 0) {
        snprintf(err, errlen, "--http %s: give HOST:PORT with an IPv4 address (or localhost)", p->bind);
        return NULL;
    }
    signal(SIGPIPE, SIG_IGN);   /* a stream's client gone: the write fails, no signal */
    http_server_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    s->p = *p;
    s->bind = strdup(p->bind);
    s->endpoint = strdup(p->kvd_endpoint);
    s->model_id = strdup(p->model_id);
    s->created = time(NULL);
    s->p.bind = s->bind;
    s->p.kvd_endpoint = s->endpoint;
    s->p.model_id = s->model_id;
    if (p->api_keys != NULL && load_keys(s, p->api_keys, err, errlen) != 0) {
        http_stop(&s);
        return NULL;
    }
    s->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG,
                            0, NULL, NULL, handle, s, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)120, MHD_OPTION_CONNECTION_LIMIT,
                            (unsigned int)1024, MHD_OPTION_NOTIFY_COMPLETED, completed, NULL, MHD_OPTION_END);
    if (s->d == NULL) {
        snprintf(err, errlen, "--http %s: cannot listen there (in use, or not an address of this machine)",
                 p->bind);
        http_stop(&s);
        return NULL;
    }
    return s;
}

void http_quiesce(http_server_t *s)
{
    if (s != NULL && s->d != NULL) {
        const MHD_socket fd = MHD_quiesce_daemon(s->d);
        if (fd != MHD_INVALID_SOCKET)
            close(fd);
    }
}

void http_stop(http_server_t **sp)
{
    if (sp == NULL || *sp == NULL)
        return;
    http_server_t *s = *sp;
    if (s->d != NULL)
        MHD_stop_daemon(s->d);
    free(s->bind);
    free(s->endpoint);
    free(s->model_id);
    for (size_t i = 0; i < s->n_keys; i++) {
        free(s->keys[i].key);
        free(s->keys[i].tenant);
    }
    free(s->keys);
    free(s);
    *sp = NULL;
}
