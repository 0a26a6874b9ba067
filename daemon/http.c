/*
 * http.c - kvd's HTTP front end (see http.h): libmicrohttpd serves the
 * connections, jansson reads and writes the JSON, and the C client carries
 * each request to kvd over its ipc:// endpoint.
 *
 * libmicrohttpd runs in poll mode on one thread of its own: every
 * connection, idle, half-sent or answered, is a descriptor and a buffer on
 * it, never a thread. (Its epoll mode, edge-triggered, read a half request
 * and never saw the close behind it: such connections stayed until the
 * timeout, and counted against the limits.) A request that needs kvd is a job: once its head and
 * body are in, its connection is suspended and a thread of its own runs it
 * (parse the JSON, call kvd, build the answer), then resumes the connection,
 * whose handler queues the answer. A streamed answer is a callback response
 * that takes the server-sent events the job appends; it suspends the
 * connection while it has nothing to send and the job resumes it with more.
 *
 * Each job watches its client's socket (EPOLLRDHUP) and an eventfd of its own
 * through one epoll descriptor that the C client polls beside kvd
 * (kvd_client_set_abort_fd): a client that goes away, or kvd's shutdown,
 * cancels the request in kvd at once, queued, computing or streaming.
 *
 * Bounds: connections in all and per address (libmicrohttpd's), a deadline
 * for each request's head and body counted from its connection's start or
 * its previous answer (a thread of this file's shuts the socket down past
 * it: bytes trickled in do not extend it), libmicrohttpd's idle timeout, the
 * API key checked when the head is in (before any byte of the body is
 * kept), the body's size, one memory budget for every body and its parsed
 * JSON (jansson allocates through a counting allocator), and the jobs at
 * once.
 */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <malloc.h>
#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "err.h"
#include "kvd_client.h"
#include "toolcall.h"
#include "web.h"

#define MAX_CHOICES 16          /* n, and prompts of one completion request, together */
#define MAX_STOP 8
#define CLIENT_TIMEOUT_MS 600000    /* the longest wait for kvd's next message */
#define IDLE_CLIENTS 16         /* clients of kvd kept for the next jobs */
#define JOB_STACK (1u << 20)    /* a job's thread: jansson's parser recurses up to 2048 levels */
#define PARSE_FACTOR 4          /* a body's parsed JSON may take this many times the body limit */
#define SWEEP_MS 250            /* how often the deadlines are checked */
#define RESERVED_FDS 256        /* descriptors kvd keeps for everything but HTTP */
#define FDS_PER_JOB 8           /* a job: its epoll and eventfd, its client's sockets */
#define MAX_UNSENT (8u << 20)   /* a stream's events its client has not read: past it, given up */

/* HTTP statuses counted for /metrics (kvd_http_requests_total{code}). */
static const unsigned counted[] = { 200, 400, 401, 404, 405, 413, 415, 429, 500, 503, 504 };
#define N_COUNTED (sizeof(counted) / sizeof(counted[0]))

struct api_key {
    char *key, *tenant;
};

/* One TCP connection (libmicrohttpd's socket context), for the deadline of the
 * request it is receiving. */
struct conn {
    int fd;                     /* its socket: valid until the CLOSED notice removes the entry */
    uint64_t src;               /* its source's key (src_key) */
    double since;               /* ms: receiving a request since (opened, or the last answer's end) */
    bool busy;                  /* a request is in and being answered: no deadline */
    bool shut;                  /* its deadline passed and its socket was shut down */
    struct conn *prev, *next;
};

struct job;

struct http_server {
    struct MHD_Daemon *d;
    struct http_params p;
    char *bind, *endpoint, *model_id;
    bool loopback;              /* bound to a loopback address: Host must name loopback too */
    struct pool_cached {        /* /pool's last answers (under mu): one walk of kvd's blocks */
        char viewer[80];        /* serves every page of a viewer for POOL_FRESH_MS */
        double at;
        char *text;
        size_t len;
    } pool_cache[8];
    time_t created;
    struct api_key *keys;       /* --api-keys; NULL: the API is open */
    size_t n_keys;
    char *operator_key;         /* --operator-key; NULL: none */
    char *tokenizer_info;       /* GET /tokenizer_info's answer (JSON text), or NULL: a 404 */
    size_t tokenizer_info_len;
    int32_t bos;                /* the model's BOS id (-1: none) and whether a prompt starts */
    bool add_bos;               /* with it: /tokenize's add_special_tokens */
    void *zctx;                 /* the ZeroMQ context of every client of kvd here */
    pthread_mutex_t mu;         /* connections, jobs, idle clients, stopping */
    pthread_cond_t cv;          /* a job ended; the sweeper's tick */
    struct conn *conns;         /* open connections */
    struct job *jobs;           /* running jobs */
    uint32_t n_jobs;
    kvd_client_t *idle[IDLE_CLIENTS];
    uint32_t n_idle;
    bool stopping;
    pthread_t sweeper;
    bool sweeper_on;
    _Atomic uint64_t mem;       /* bytes of bodies and parsed JSON held now */
    _Atomic uint64_t by_status[N_COUNTED + 1];  /* the last: any other status */
    _Atomic uint64_t n_conns, timeouts, gone, mem_refused, busy_refused;
    _Atomic uint64_t log_suppressed;
    _Atomic int64_t log_second;
    struct src *srcs;           /* (SRC_SLOTS) the sources with connections or bodies, under mu */
};

/*
 * Sources: what one client address holds — connections (at most
 * --http-max-conns-per-ip) and request bodies (at most a quarter of
 * --http-max-memory, and at least one body of --max-body) — so that one
 * client cannot take what every client shares. A source is an IPv4 address,
 * an IPv6 /64, and the whole loopback range as one (127.0.0.0/8 and ::1:
 * any local user can bind every 127.x address).
 */
#define SRC_SLOTS 16384             /* more than connections can ever be open */
struct src {
    uint64_t key;                   /* 0: a free slot */
    uint32_t conns;
    uint64_t body;                  /* bytes of bodies charged to it */
};

static bool mem_take(struct http_server *s, uint64_t n);
static void mem_give(struct http_server *s, uint64_t n);

static uint64_t src_key(const struct sockaddr *sa)
{
    if (sa == NULL)
        return 1;
    if (sa->sa_family == AF_INET) {
        const uint32_t a = ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr);
        return (a >> 24) == 127 ? 2 : (1ull << 32) | a;
    }
    if (sa->sa_family == AF_INET6) {
        const uint8_t *b = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;
        static const uint8_t v4mapped[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff };
        static const uint8_t loop6[16] = { [15] = 1 };
        if (memcmp(b, loop6, 16) == 0)
            return 2;
        if (memcmp(b, v4mapped, 12) == 0) {
            const uint32_t a = (uint32_t)b[12] << 24 | (uint32_t)b[13] << 16 | (uint32_t)b[14] << 8 | b[15];
            return (a >> 24) == 127 ? 2 : (1ull << 32) | a;
        }
        uint64_t k = 0;
        memcpy(&k, b, 8);                           /* the /64 */
        return (k * 0x9e3779b97f4a7c15ull) | (1ull << 63);
    }
    return 1;
}

static uint32_t src_home(uint64_t key)
{
    return (uint32_t)((key * 0xff51afd7ed558ccdull) >> 40) & (SRC_SLOTS - 1);
}

/* The slot of key (its own, or the free one it would take); mu held. */
static struct src *src_slot_locked(struct http_server *s, uint64_t key)
{
    const uint32_t h = src_home(key);
    for (uint32_t i = 0; i < SRC_SLOTS; i++) {
        struct src *e = &s->srcs[(h + i) & (SRC_SLOTS - 1)];
        if (e->key == key || e->key == 0)
            return e;
    }
    return NULL;                                    /* full: more sources than connections can be */
}

/* Drops slot e when it holds nothing, moving the entries after it back so
 * that every probe sequence stays whole; mu held. */
static void src_release_locked(struct http_server *s, struct src *e)
{
    if (e->conns != 0 || e->body != 0)
        return;
    uint32_t hole = (uint32_t)(e - s->srcs);
    e->key = 0;
    for (uint32_t j = (hole + 1) & (SRC_SLOTS - 1); s->srcs[j].key != 0; j = (j + 1) & (SRC_SLOTS - 1)) {
        const uint32_t home = src_home(s->srcs[j].key);
        /* the entry at j may fill the hole unless its home lies in (hole, j] */
        const bool stays = hole < j ? home > hole && home <= j : home > hole || home <= j;
        if (!stays) {
            s->srcs[hole] = s->srcs[j];
            s->srcs[j] = (struct src){ 0 };
            hole = j;
        }
    }
}

/* Charges n bytes of body to source key: false (nothing charged) past its share. */
static bool src_take(struct http_server *s, uint64_t key, uint64_t n)
{
    uint64_t share = s->p.max_memory / 4;
    if (share < (uint64_t)s->p.max_body + 1)
        share = (uint64_t)s->p.max_body + 1;
    pthread_mutex_lock(&s->mu);
    struct src *e = src_slot_locked(s, key);
    const bool ok = e != NULL && e->body + n <= share;
    if (ok) {
        e->key = key;
        e->body += n;
    }
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static void src_give(struct http_server *s, uint64_t key, uint64_t n)
{
    if (n == 0)
        return;
    pthread_mutex_lock(&s->mu);
    struct src *e = src_slot_locked(s, key);
    if (e != NULL && e->key == key) {
        e->body = e->body > n ? e->body - n : 0;
        src_release_locked(s, e);
    }
    pthread_mutex_unlock(&s->mu);
}

/* Bytes of a request's body: from the server's budget and its source's share. */
static bool body_take(struct http_server *s, uint64_t key, uint64_t n)
{
    if (!src_take(s, key, n))
        return false;
    if (!mem_take(s, n)) {
        src_give(s, key, n);
        return false;
    }
    return true;
}

static void body_give(struct http_server *s, uint64_t key, uint64_t n)
{
    mem_give(s, n);
    src_give(s, key, n);
}

static void count_status(struct http_server *s, unsigned status)
{
    size_t i = 0;
    while (i < N_COUNTED && counted[i] != status)
        i++;
    atomic_fetch_add(&s->by_status[i], 1);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ---- memory: bodies and their JSON ------------------------------------------------------------- */

/* Takes n bytes of the server's budget; false (nothing taken) past it. */
static bool mem_take(struct http_server *s, uint64_t n)
{
    const uint64_t was = atomic_fetch_add(&s->mem, n);
    if (was + n <= s->p.max_memory)
        return true;
    atomic_fetch_sub(&s->mem, n);
    atomic_fetch_add(&s->mem_refused, 1);
    return false;
}

static void mem_give(struct http_server *s, uint64_t n)
{
    atomic_fetch_sub(&s->mem, n);
}

/* What one request's JSON may allocate, and has. jansson allocates through
 * json_alloc/json_free below for the whole process (only this file uses it):
 * on a thread that parses a request (tl_acct set) every byte counts against
 * the request's cap and the server's budget, so that a body of 16 MiB of
 * small numbers (some 24 bytes of tree for each two bytes of text) fails as
 * too large instead of taking gigabytes. Each block carries its size and its
 * account, so that it is given back whenever and wherever it is freed. */
struct acct {
    struct http_server *s;
    uint64_t used, cap;
    bool over;                  /* an allocation was refused */
    bool server_full;           /* ... because the server's budget was spent */
};

static __thread struct acct *tl_acct;

#define JSON_HDR 16u

static void *json_alloc(size_t n)
{
    struct acct *a = tl_acct;
    const uint64_t want = (uint64_t)n + JSON_HDR;
    if (a != NULL) {
        if (a->used + want > a->cap) {
            a->over = true;
            return NULL;
        }
        if (!mem_take(a->s, want)) {
            a->over = a->server_full = true;
            return NULL;
        }
        a->used += want;
    }
    uint8_t *p = malloc(n + JSON_HDR);
    if (p == NULL) {
        if (a != NULL) {
            a->used -= want;
            mem_give(a->s, want);
        }
        return NULL;
    }
    memcpy(p, &n, sizeof(n));
    memcpy(p + 8, &a, sizeof(a));
    return p + JSON_HDR;
}

static void json_release(void *q)
{
    if (q == NULL)
        return;
    uint8_t *p = (uint8_t *)q - JSON_HDR;
    size_t n;
    struct acct *a;
    memcpy(&n, p, sizeof(n));
    memcpy(&a, p + 8, sizeof(a));
    if (a != NULL) {
        a->used -= (uint64_t)n + JSON_HDR;
        mem_give(a->s, (uint64_t)n + JSON_HDR);
    }
    free(p);
}

static pthread_once_t json_once = PTHREAD_ONCE_INIT;

static void json_funcs(void)
{
    json_set_alloc_funcs(json_alloc, json_release);
}

/* j as compact JSON in a plain malloc'd string (libmicrohttpd frees it); frees j. */
static char *json_text(json_t *j, size_t *len)
{
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (s == NULL)
        return NULL;
    *len = strlen(s);
    char *out = malloc(*len + 1);
    if (out != NULL)
        memcpy(out, s, *len + 1);
    json_release(s);
    return out;
}

/* ---- clients of kvd ------------------------------------------------------------------------------ */

/* A client of kvd for a job: an idle one, or a new one on the server's
 * context. NULL with err. */
static kvd_client_t *client_take(struct http_server *s, char *err, size_t errlen)
{
    pthread_mutex_lock(&s->mu);
    kvd_client_t *c = s->n_idle > 0 ? s->idle[--s->n_idle] : NULL;
    pthread_mutex_unlock(&s->mu);
    if (c == NULL)
        c = kvd_client_new_in(s->zctx, s->endpoint, CLIENT_TIMEOUT_MS, err, errlen);
    return c;
}

/* Done with *c: kept for the next job, or closed. */
static void client_give(struct http_server *s, kvd_client_t **c)
{
    if (*c == NULL)
        return;
    kvd_client_set_abort_fd(*c, -1);
    kvd_client_set_timeout(*c, CLIENT_TIMEOUT_MS);
    pthread_mutex_lock(&s->mu);
    if (s->n_idle < IDLE_CLIENTS && !s->stopping) {
        s->idle[s->n_idle++] = *c;
        *c = NULL;
    }
    pthread_mutex_unlock(&s->mu);
    kvd_client_destroy(c);
}

/* ---- jobs --------------------------------------------------------------------------------------- */

enum route { R_NONE, R_CHAT, R_COMPLETIONS, R_RESPONSES, R_TOKENIZE, R_DETOKENIZE, R_HEALTH, R_READY, R_MODELS, R_MODEL,
             R_METRICS, R_PAGE, R_POOL, R_TOKENIZER_INFO, R_CACHE_LIST, R_CACHE_PIN, R_CACHE_UNPIN,
             R_CACHE_EVICT };

#define PIN_ID_MAX 48               /* "pin_" and 32 hex digits, with room */

/* A request being answered on a thread of its own. Its references: the
 * thread's, the request's (until libmicrohttpd says it is complete) and a
 * streamed response's (until libmicrohttpd frees it). */
struct job {
    struct http_server *s;
    struct MHD_Connection *c;
    enum route route;
    char pin_id[PIN_ID_MAX];    /* /v1/cache/{id}: the pin */
    char *body;                 /* the request's body (NUL-terminated), until parsed */
    size_t len;
    uint64_t charged;           /* bytes of the budget the body holds */
    uint64_t src;               /* the source they are charged to */
    const char *tenant;         /* the API key's tenant (the server's string), or NULL */
    bool operator;              /* the request came with the operator's key */
    int efd;                    /* eventfd: written to give the job up (client gone, shutdown) */
    int epfd;                   /* epoll: efd, and the client's socket for hang-ups */
    struct acct acct;           /* what its JSON allocates */
    _Atomic int refs;
    pthread_mutex_t mu;         /* what follows */
    bool suspended;             /* its connection waits for it: only the job resumes it */
    bool done;                  /* the thread has finished (the answer, or the stream, is whole) */
    bool streaming;             /* the answer is a stream of events (status 200) */
    bool conn_gone;             /* libmicrohttpd freed the stream's response */
    bool gone;                  /* its client went away: its answer is not counted */
    unsigned status;            /* a whole answer: its status, */
    char *answer;               /* body (malloc'd), */
    size_t answer_len;
    const char *ctype;          /* type */
    unsigned retry_after_s;     /* and Retry-After (0: none) */
    char *out;                  /* a stream's events not yet sent */
    size_t out_len, out_cap, out_sent;
    struct job *prev, *next;    /* the server's running jobs */
};

static void job_put(struct job *j)
{
    if (atomic_fetch_sub(&j->refs, 1) != 1)
        return;
    if (j->body != NULL)
        free(j->body);
    if (j->charged > 0)
        body_give(j->s, j->src, j->charged);
    free(j->answer);
    free(j->out);
    if (j->efd >= 0)
        close(j->efd);
    if (j->epfd >= 0)
        close(j->epfd);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

/* Gives the job up: its next (or current) wait for kvd ends, cancelling. */
static void job_abort(struct job *j)
{
    const uint64_t one = 1;
    if (write(j->efd, &one, sizeof(one)) < 0 && errno != EAGAIN)
        return;
}

/* Whether the job was given up (its client left, or kvd stops). */
static bool job_aborted(const struct job *j)
{
    struct epoll_event ev;
    return epoll_wait(j->epfd, &ev, 1, 0) > 0;
}

/* Resumes the job's connection if it waits for the job (caller holds mu). */
static void job_wake_locked(struct job *j)
{
    if (j->suspended) {
        j->suspended = false;
        MHD_resume_connection(j->c);
    }
}

/* The whole answer: status, a malloc'd body (taken) and its type. */
static void job_answer(struct job *j, unsigned status, char *body, size_t len, const char *ctype,
                       unsigned retry_after_s)
{
    free(j->answer);
    j->status = status;
    j->answer = body;
    j->answer_len = len;
    j->ctype = ctype;
    j->retry_after_s = retry_after_s;
}

static void job_json(struct job *j, unsigned status, json_t *o, unsigned retry_after_s)
{
    size_t len = 0;
    char *text = json_text(o, &len);
    if (text == NULL)
        job_answer(j, 500, NULL, 0, "application/json", 0);
    else
        job_answer(j, status, text, len, "application/json", retry_after_s);
}

/* OpenAI's error object. */
static json_t *error_json(const char *message, const char *type, const char *param, const char *code)
{
    return json_pack("{s:{s:s, s:s, s:s?, s:s?}}", "error", "message", message, "type", type, "param", param,
                     "code", code);
}

static const char *error_type(unsigned status)
{
    return status == 400 || status == 413 || status == 415 ? "invalid_request_error"
         : status == 401                                   ? "authentication_error"
         : status == 404                                   ? "not_found_error"
         : status == 429                                   ? "rate_limit_exceeded"
         : status == 503                                   ? "service_unavailable"
         : status == 504                                   ? "timeout"
                                                           : "server_error";
}

static void job_error(struct job *j, unsigned status, const char *message, const char *param, const char *code,
                      unsigned retry_after_s)
{
    job_json(j, status, error_json(message, error_type(status), param, code), retry_after_s);
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

static void job_kvd_error(struct job *j, int rc, const struct kvd_result *res)
{
    const char *code;
    const unsigned status = status_of(rc, &code);
    /* Retry-After in whole seconds, at least 1 */
    const unsigned retry = status == 429 ? (res->retry_after_ms + 999) / 1000 + (res->retry_after_ms == 0) : 0;
    job_error(j, status, res->error[0] ? res->error : kvd_strerror(rc), NULL, code, retry);
}

/* The job was given up: its client went away (counted; the answer is for
 * nobody), or kvd stops (a 503 says so). */
static void job_gone(struct job *j)
{
    const bool stopping = j->s->stopping;
    if (!stopping)
        atomic_fetch_add(&j->s->gone, 1);
    job_error(j, 503, stopping ? "kvd is shutting down" : "the client went away", NULL, NULL, 0);
    j->gone = !stopping;
}

/* Appends one server-sent event "data: <o>\n\n" (o freed; NULL: [DONE]) and
 * wakes the connection; false once the client is gone. */
static bool emit(struct job *j, json_t *o)
{
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    const char *payload = s ? s : "[DONE]";
    const size_t len = strlen(payload) + 8;
    bool ok = true;
    pthread_mutex_lock(&j->mu);
    if (j->conn_gone) {
        ok = false;
    } else {
        if (j->out_sent > 0 && j->out_sent == j->out_len)
            j->out_len = j->out_sent = 0;
        if (j->out_len - j->out_sent + len > MAX_UNSENT) {
            /* its client does not read what it asked for: given up (cancelled),
             * not held in memory without bound */
            ok = false;
        } else if (j->out_len + len + 1 > j->out_cap) {
            const size_t cap = (j->out_len + len + 1) * 2;
            char *b = realloc(j->out, cap);
            if (b == NULL) {
                ok = false;
            } else {
                j->out = b;
                j->out_cap = cap;
            }
        }
        if (ok) {
            snprintf(j->out + j->out_len, len + 1, "data: %s\n\n", payload);
            j->out_len += len;
            j->streaming = true;
            job_wake_locked(j);
        }
    }
    pthread_mutex_unlock(&j->mu);
    json_release(s);
    if (!ok)
        job_abort(j);
    return ok && !job_aborted(j);
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
    bool has_seed;                  /* a seed was given: */
    uint64_t seed;                  /* the int64 given, as its two's complement (choice i: seed + i) */
    struct kvd_chat_msg *msgs;
    size_t n_msgs;
    struct prompt prompts[MAX_CHOICES];
    size_t n_prompts;
    const char *stops[MAX_STOP];
    char *schema;                   /* response_format's json_schema as text (owned), or NULL */
    json_t *keep;                   /* strings made from the request that it points at (owned) */
    const char **tool_defs;         /* tools: the functions as JSON text (in keep), n_tools of them */
    size_t n_tools;                 /* 0: no tools, or tool_choice "none" */
    bool tool_exact;                /* tool_choice "required" or a name: the grammar holds the calls */
    bool parallel;                  /* parallel_tool_calls */
    struct kvd_tool_calls *calls;   /* the messages' tool calls (in keep), one per message */
    int32_t *bias_ids;              /* logit_bias, as token ids and their addends (owned) */
    float *bias;
    int n;
    bool stream, include_usage;
    bool echo;                      /* completions: the prompt before the output (and its logprobs) */
    int32_t prompt_lp;              /* vLLM's prompt_logprobs: alternatives, or -1 */
    bool want_cache;                /* a pin or a warm-up: the answer says what is cached ("cache") */
    const char *tenant;             /* its API key's tenant, or NULL */
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
    free(r->bias_ids);
    free(r->bias);
    free(r->schema);
    free(r->tool_defs);
    for (size_t i = 0; r->calls != NULL && i < r->n_msgs; i++)
        free((void *)r->calls[i].json);
    free(r->calls);
    json_decref(r->keep);
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

static bool neutral_value(json_t *v, const char *const *strings);

/* Text parts ({"type": one of types, "text": ...}, no other field but empty
 * annotations) joined into one string, kept alive in the array c itself (the
 * request owns it); NULL with b when a part is of another kind. */
static const char *text_parts(json_t *c, const char *const *types, const char *param, struct bad *b)
{
    size_t total = 1, i;
    json_t *part;
    json_array_foreach(c, i, part) {
        const char *type = json_string_value(json_object_get(part, "type"));
        const char *const *t = types;
        while (type != NULL && *t != NULL && strcmp(*t, type) != 0)
            t++;
        if (type == NULL || *t == NULL || !json_is_string(json_object_get(part, "text"))) {
            bad(b, param, "only text parts ({\"type\": \"%s\", \"text\": ...}) are supported, not '%.40s'",
                types[0], type ? type : "?");
            return NULL;
        }
        const char *k;
        json_t *v;
        json_object_foreach(part, k, v)
            if (strcmp(k, "type") != 0 && strcmp(k, "text") != 0 && strcmp(k, "cache_control") != 0 &&
                !(strcmp(k, "annotations") == 0 && neutral_value(v, NULL))) {
                bad(b, param, "a text part's '%.40s' is not supported", k);
                return NULL;
            }
        total += json_string_length(json_object_get(part, "text"));
    }
    char *joined = malloc(total);
    if (joined == NULL) {
        bad(b, param, "out of memory");
        return NULL;
    }
    size_t at = 0;
    json_array_foreach(c, i, part) {
        json_t *t = json_object_get(part, "text");
        memcpy(joined + at, json_string_value(t), json_string_length(t));
        at += json_string_length(t);
    }
    joined[at] = '\0';
    json_array_append_new(c, json_string(joined));
    free(joined);
    return json_string_value(json_array_get(c, json_array_size(c) - 1));
}

/* The text of a chat message's content: a string, or text parts (joined). */
static const char *content_text(json_t *msg, struct bad *b)
{
    static const char *const chat_parts[] = { "text", NULL };
    json_t *c = json_object_get(msg, "content");
    if (json_is_string(c))
        return json_string_value(c);
    if (json_is_null(c) || c == NULL)
        return "";
    if (!json_is_array(c)) {
        bad(b, "messages", "a message's content must be a string or an array of text parts");
        return NULL;
    }
    return text_parts(c, chat_parts, "messages", b);
}

/*
 * Every field of a chat or completions request that kvd knows. A field kvd
 * implements has its effect; one it does not is accepted only with the value
 * that asks for nothing (absent, null, or the neutral value `neutral` checks),
 * so that a client's default is served but a request that asks for more is a
 * 400 naming the field: nothing is silently ignored. A field of no table is a
 * 400 too.
 */
enum { F_CHAT = 1, F_COMPL = 2, F_BOTH = 3 };

/* true when v asks for nothing: false, 0, "", an empty array or object, or
 * one of the strings listed (NULL-terminated) */
static bool neutral_value(json_t *v, const char *const *strings)
{
    if (v == NULL || json_is_null(v) || json_is_false(v))
        return true;
    if (json_is_number(v))
        return json_number_value(v) == 0;
    if (json_is_array(v))
        return json_array_size(v) == 0;
    if (json_is_object(v))
        return json_object_size(v) == 0;
    if (json_is_string(v)) {
        if (json_string_length(v) == 0)
            return true;
        for (; strings != NULL && *strings != NULL; strings++)
            if (strcmp(json_string_value(v), *strings) == 0)
                return true;
    }
    return false;
}

static const char *const none_choice[] = { "none", NULL };
static const char *const one_tier[] = { "auto", "default", NULL };

static const struct field {
    const char *name;
    unsigned where;                 /* F_CHAT, F_COMPL or both */
    bool implemented;               /* false: only a neutral value is accepted */
    const char *const *neutral;     /* strings that ask for nothing, beside the neutral_value ones */
    const char *what;               /* why a value that asks for something is refused */
} fields[] = {
    { "model", F_BOTH, true, NULL, NULL },
    { "messages", F_CHAT, true, NULL, NULL },
    { "prompt", F_COMPL, true, NULL, NULL },
    { "max_tokens", F_BOTH, true, NULL, NULL },
    { "max_completion_tokens", F_CHAT, true, NULL, NULL },
    { "temperature", F_BOTH, true, NULL, NULL },
    { "top_p", F_BOTH, true, NULL, NULL },
    { "top_k", F_BOTH, true, NULL, NULL },
    { "min_p", F_BOTH, true, NULL, NULL },
    { "repetition_penalty", F_BOTH, true, NULL, NULL },
    { "seed", F_BOTH, true, NULL, NULL },
    { "n", F_BOTH, true, NULL, NULL },
    { "stream", F_BOTH, true, NULL, NULL },
    { "stream_options", F_BOTH, true, NULL, NULL },
    { "logprobs", F_BOTH, true, NULL, NULL },
    { "top_logprobs", F_CHAT, true, NULL, NULL },
    { "stop", F_BOTH, true, NULL, NULL },
    { "ignore_eos", F_BOTH, true, NULL, NULL },
    { "context_overflow", F_BOTH, true, NULL, NULL },
    { "namespace", F_BOTH, true, NULL, NULL },
    { "user", F_BOTH, true, NULL, NULL },                        /* an end user's name: only checked */
    { "service_tier", F_BOTH, false, one_tier, "kvd has one service tier" },
    { "store", F_CHAT, false, NULL, "kvd stores no completions" },
    { "metadata", F_CHAT, false, NULL, "kvd stores no completions to tag" },
    { "presence_penalty", F_BOTH, true, NULL, NULL },
    { "frequency_penalty", F_BOTH, true, NULL, NULL },
    { "logit_bias", F_BOTH, true, NULL, NULL },
    { "echo", F_COMPL, true, NULL, NULL },
    { "best_of", F_COMPL, false, NULL, "not supported (use n)" },
    { "suffix", F_COMPL, false, NULL, "not supported" },
    { "response_format", F_BOTH, true, NULL, NULL },
    { "tools", F_CHAT, true, NULL, NULL },
    { "tool_choice", F_CHAT, true, NULL, NULL },
    { "parallel_tool_calls", F_CHAT, true, NULL, NULL },
    { "functions", F_CHAT, false, NULL, "not supported" },
    { "function_call", F_CHAT, false, none_choice, "not supported" },
    { "prompt_logprobs", F_BOTH, true, NULL, NULL },
    { "pin_ttl", F_BOTH, true, NULL, NULL },                     /* kvd's: pin the prompt ("5m", "1h", s) */
    { "prefill_only", F_BOTH, true, NULL, NULL },                /* kvd's: a warm-up, as max_tokens 0 */
};

/* 0 when every field of the body is one kvd serves as asked; -1 with b naming
 * the first that is not. */
static int check_fields(json_t *o, const struct field *table, size_t n, unsigned where, const char *kind,
                        struct bad *b)
{
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        const struct field *f = NULL;
        for (size_t i = 0; i < n && f == NULL; i++)
            if (strcmp(key, table[i].name) == 0 && (table[i].where & where))
                f = &table[i];
        if (f == NULL)
            return bad(b, key, "unsupported field '%.64s' in a %s request", key, kind);
        /* best_of 1: the one choice drawn is the best of one */
        const bool best_of_one = strcmp(key, "best_of") == 0 && json_is_integer(v) && json_integer_value(v) == 1;
        if (!f->implemented && !best_of_one && !neutral_value(v, f->neutral))
            return bad(b, key, "'%s': %s", f->name, f->what);
    }
    return 0;
}

/* A request's "model": absent, null or the served one; else -1 with b and a 404. */
static int check_model(json_t *o, const struct http_server *s, struct bad *b, unsigned *status)
{
    json_t *model = json_object_get(o, "model");
    if (model == NULL || json_is_null(model))
        return 0;
    if (!json_is_string(model))
        return bad(b, "model", "'model' must be a string");
    if (strcmp(json_string_value(model), s->model_id) == 0)
        return 0;
    *status = 404;
    return bad(b, "model", "the model '%s' does not exist; this server serves '%s'", json_string_value(model),
               s->model_id);
}

/* A request's cache namespace into ns (ns_len bytes): its API key's tenant's
 * ("tenant:NAME"), with the request's own "namespace" inside it; without a
 * key, the request's own, which may not be a tenant's or the public
 * prefix's. Empty: the default namespace. 0, or -1 with b. */
static int request_ns(json_t *o, const char *tenant, char *ns, size_t ns_len, struct bad *b)
{
    json_t *v = json_object_get(o, "namespace");
    if (v != NULL && !json_is_null(v) && (!json_is_string(v) || json_string_length(v) > 128))
        return bad(b, "namespace", "'namespace' must be a string of at most 128 bytes");
    const char *own = json_string_value(v);
    if (tenant == NULL && own != NULL && (strncmp(own, "tenant:", 7) == 0 || strncmp(own, "public:", 7) == 0))
        return bad(b, "namespace", "'namespace' may not start with 'tenant:' or 'public:': those are the "
                   "tenants' and the public prefix's");
    snprintf(ns, ns_len, "%s%s%s%s", tenant ? "tenant:" : "", tenant ? tenant : "", tenant && own ? "/" : "",
             own ? own : "");
    return 0;
}

/* The same for a chat message's fields (an assistant's tool_calls and a tool
 * result's tool_call_id are read by parse_messages). */
static int check_message_fields(json_t *msg, struct bad *b)
{
    const char *key;
    json_t *v;
    const char *role = json_string_value(json_object_get(msg, "role"));
    json_object_foreach(msg, key, v) {
        if (strcmp(key, "role") == 0 || strcmp(key, "content") == 0 || strcmp(key, "cache_control") == 0 ||
            (strcmp(key, "tool_calls") == 0 && strcmp(role, "assistant") == 0) ||
            (strcmp(key, "tool_call_id") == 0 && strcmp(role, "tool") == 0))
            continue;
        if ((strcmp(key, "name") == 0 || strcmp(key, "refusal") == 0 || strcmp(key, "tool_calls") == 0 ||
             strcmp(key, "tool_call_id") == 0 || strcmp(key, "function_call") == 0) && neutral_value(v, NULL))
            continue;
        return bad(b, "messages", "a message's '%.64s' is not supported", key);
    }
    return 0;
}

/*
 * Structured output's format: {"type": "text"} (nothing), {"type":
 * "json_object"}, or a schema — chat's {"type": "json_schema", "json_schema":
 * {"name", "schema", "strict", "description"}}, or the Responses API's flat
 * {"type": "json_schema", "name", "schema", ...} (flat). Sets gp's
 * json_object or *schema (the schema as text, malloc'd); 0 or -1 with b.
 */
static int parse_format(json_t *f, bool flat, const char *param, struct kvd_gen_params *gp, char **schema,
                        struct bad *b)
{
    const char *type = json_string_value(json_object_get(f, "type"));
    if (!json_is_object(f) || type == NULL)
        return bad(b, param, "'%s' must be an object with a 'type'", param);
    json_t *js = flat ? f : json_object_get(f, "json_schema");
    const char *key;
    json_t *v;
    json_object_foreach(f, key, v) {
        const bool ok = strcmp(key, "type") == 0 ||
                        (strcmp(type, "json_schema") == 0 &&
                         (flat ? strcmp(key, "name") == 0 || strcmp(key, "schema") == 0 ||
                                     strcmp(key, "strict") == 0 || strcmp(key, "description") == 0
                               : strcmp(key, "json_schema") == 0));
        if (!ok)
            return bad(b, param, "'%s': '%.40s' is not supported with type '%.20s'", param, key, type);
    }
    if (strcmp(type, "text") == 0)
        return 0;
    if (strcmp(type, "json_object") == 0) {
        gp->json_object = true;
        return 0;
    }
    if (strcmp(type, "json_schema") != 0)
        return bad(b, param, "'%s': type '%.40s' is not supported (text, json_object, json_schema)", param, type);
    if (!json_is_object(js))
        return bad(b, param, "'%s': json_schema must be an object", param);
    if (!flat)
        json_object_foreach(js, key, v)
            if (strcmp(key, "name") != 0 && strcmp(key, "schema") != 0 && strcmp(key, "strict") != 0 &&
                strcmp(key, "description") != 0)
                return bad(b, param, "'%s': json_schema's '%.40s' is not supported", param, key);
    json_t *sc = json_object_get(js, "schema");
    json_t *strict = json_object_get(js, "strict");
    json_t *name = json_object_get(js, "name");
    if (!json_is_object(sc))
        return bad(b, param, "'%s': the schema must be an object", param);
    if ((strict != NULL && !json_is_null(strict) && !json_is_boolean(strict)) ||
        (name != NULL && !json_is_string(name)))
        return bad(b, param, "'%s': 'strict' must be a boolean and 'name' a string", param);
    /* strict or not, kvd holds the output to the schema (an absent
     * additionalProperties means false, as strict mode has it) */
    char *t = json_dumps(sc, JSON_COMPACT);     /* jansson's memory: copied out, given back */
    *schema = t ? strdup(t) : NULL;
    json_release(t);
    if (*schema == NULL)
        return bad(b, param, "out of memory");
    if (strlen(*schema) > 64u << 10)
        return bad(b, param, "'%s': the schema is over 64 KiB", param);
    gp->json_schema = *schema;
    return 0;
}

/* ---- tools ----------------------------------------------------------------------------------- */

/* The JSON text of v (flags: jansson's) kept alive in r->keep; NULL on no
 * memory. */
static const char *keep_text(struct oai_req *r, const json_t *v, size_t flags)
{
    if (r->keep == NULL && (r->keep = json_array()) == NULL)
        return NULL;
    char *t = json_dumps(v, flags);
    json_t *str = t ? json_string(t) : NULL;
    json_release(t);
    if (str == NULL || json_array_append_new(r->keep, str) != 0)
        return NULL;
    return json_string_value(str);
}

/* The text of a call as the convention writes it (and the grammar makes the
 * model write it): {"name": "NAME", "arguments": {...}}. */
static const char *call_text(struct oai_req *r, const char *name, json_t *args)
{
    json_t *c = json_pack("{s:s, s:O}", "name", name, "arguments", args);
    const char *t = c ? keep_text(r, c, 0) : NULL;
    json_decref(c);
    return t;
}

/* An assistant message's tool_calls ([{"id", "type": "function", "function":
 * {"name", "arguments": JSON text of an object}}]) into r->calls[i]. The
 * calls' ids go into ids (a JSON array) for the tool results after them.
 * 0, or -1 with b. */
static int parse_calls(struct oai_req *r, size_t i, json_t *tc, json_t *ids, struct bad *b)
{
    if (!json_is_array(tc) || json_array_size(tc) > TOOLCALL_MAX_CALLS * 4)
        return bad(b, "messages", "an assistant's 'tool_calls' must be an array of at most %d calls",
                   TOOLCALL_MAX_CALLS * 4);
    const size_t n = json_array_size(tc);
    const char **texts = calloc(n ? n : 1, sizeof(*texts));
    if (texts == NULL)
        return bad(b, "messages", "out of memory");
    r->calls[i] = (struct kvd_tool_calls){ texts, n };   /* freed with r */
    size_t k;
    json_t *c;
    json_array_foreach(tc, k, c) {
        json_t *f = json_object_get(c, "function");
        const char *type = json_string_value(json_object_get(c, "type"));
        const char *name = json_string_value(json_object_get(f, "name"));
        const char *args = json_string_value(json_object_get(f, "arguments"));
        const char *key;
        json_t *v;
        json_object_foreach(c, key, v)
            if (strcmp(key, "id") != 0 && strcmp(key, "type") != 0 && strcmp(key, "function") != 0)
                return bad(b, "messages", "a tool call's '%.40s' is not supported", key);
        json_object_foreach(f, key, v)
            if (strcmp(key, "name") != 0 && strcmp(key, "arguments") != 0)
                return bad(b, "messages", "a tool call's function's '%.40s' is not supported", key);
        if (!json_is_string(json_object_get(c, "id")) || (type != NULL && strcmp(type, "function") != 0) ||
            name == NULL || args == NULL)
            return bad(b, "messages", "a tool call needs an 'id', type 'function' and a function's 'name' and "
                       "'arguments'");
        json_t *a = json_loads(args, JSON_REJECT_DUPLICATES, NULL);
        if (!json_is_object(a)) {
            json_decref(a);
            return bad(b, "messages", "a tool call's arguments must be the JSON text of an object");
        }
        texts[k] = call_text(r, name, a);
        json_decref(a);
        if (texts[k] == NULL)
            return bad(b, "messages", "out of memory");
        json_array_append(ids, json_object_get(c, "id"));
    }
    return 0;
}

/* A tool result's tool_call_id: one of the calls made before it. */
static int check_result(json_t *msg, json_t *ids, struct bad *b)
{
    json_t *id = json_object_get(msg, "tool_call_id");
    if (!json_is_string(id))
        return bad(b, "messages", "a tool message needs the 'tool_call_id' of the call it answers");
    size_t k;
    json_t *v;
    json_array_foreach(ids, k, v)
        if (json_equal(v, id))
            return 0;
    return bad(b, "messages", "a tool message's tool_call_id '%.64s' names no earlier tool call",
               json_string_value(id));
}

/* tools, tool_choice and parallel_tool_calls into r; 0, or -1 with b. */
static int parse_tools(struct oai_req *r, json_t *o, struct bad *b)
{
    json_t *tools = json_object_get(o, "tools"), *choice = json_object_get(o, "tool_choice");
    r->parallel = true;                                     /* OpenAI's default */
    if (get_bool(o, "parallel_tool_calls", &r->parallel, b) < 0)
        return -1;
    const size_t n = json_array_size(tools);
    if (tools != NULL && !json_is_null(tools) && !json_is_array(tools))
        return bad(b, "tools", "'tools' must be an array");
    if (n > TOOLCALL_MAX_TOOLS)
        return bad(b, "tools", "at most %d tools in one request", TOOLCALL_MAX_TOOLS);
    /* tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name"}} */
    const char *mode = n > 0 ? "auto" : "none", *named = NULL;
    if (json_is_string(choice)) {
        mode = json_string_value(choice);
        if (strcmp(mode, "none") != 0 && strcmp(mode, "auto") != 0 && strcmp(mode, "required") != 0)
            return bad(b, "tool_choice", "'tool_choice' must be none, auto, required or a function");
    } else if (json_is_object(choice)) {
        const char *key;
        json_t *v;
        json_object_foreach(choice, key, v)
            if (strcmp(key, "type") != 0 && strcmp(key, "function") != 0)
                return bad(b, "tool_choice", "'tool_choice': '%.40s' is not supported", key);
        json_t *f = json_object_get(choice, "function");
        json_object_foreach(f, key, v)
            if (strcmp(key, "name") != 0)
                return bad(b, "tool_choice", "'tool_choice': the function's '%.40s' is not supported", key);
        const char *type = json_string_value(json_object_get(choice, "type"));
        named = json_string_value(json_object_get(f, "name"));
        if (type == NULL || strcmp(type, "function") != 0 || named == NULL)
            return bad(b, "tool_choice", "'tool_choice' names a function as {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}");
        mode = "named";
    } else if (choice != NULL && !json_is_null(choice)) {
        return bad(b, "tool_choice", "'tool_choice' must be a string or an object");
    }
    if (n == 0 && (strcmp(mode, "required") == 0 || named != NULL))
        return bad(b, "tool_choice", "'tool_choice' %s needs tools", named ? "naming a function" : mode);
    if (n == 0 || strcmp(mode, "none") == 0)
        return 0;                                           /* the model is shown no tools */
    r->tool_exact = strcmp(mode, "auto") != 0;
    if ((r->tool_defs = calloc(n, sizeof(*r->tool_defs))) == NULL)
        return bad(b, "tools", "out of memory");
    bool found = named == NULL;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(tools, i), *f = json_object_get(t, "function");
        const char *type = json_string_value(json_object_get(t, "type"));
        const char *key;
        json_t *v;
        if (!json_is_object(t) || type == NULL || strcmp(type, "function") != 0 || !json_is_object(f))
            return bad(b, "tools", "tools[%zu] must be {\"type\": \"function\", \"function\": {...}}", i);
        json_object_foreach(t, key, v)
            if (strcmp(key, "type") != 0 && strcmp(key, "function") != 0)
                return bad(b, "tools", "tools[%zu]: '%.40s' is not supported", i, key);
        json_t *name = json_object_get(f, "name"), *desc = json_object_get(f, "description");
        json_t *params = json_object_get(f, "parameters"), *strict = json_object_get(f, "strict");
        json_object_foreach(f, key, v)
            if (strcmp(key, "name") != 0 && strcmp(key, "description") != 0 && strcmp(key, "parameters") != 0 &&
                strcmp(key, "strict") != 0)
                return bad(b, "tools", "tools[%zu]: the function's '%.40s' is not supported", i, key);
        if (!json_is_string(name) || !toolcall_name_ok(json_string_value(name), json_string_length(name)))
            return bad(b, "tools", "tools[%zu]: a function's name must be 1 to %d of [A-Za-z0-9_-]", i,
                       TOOLCALL_MAX_NAME);
        if ((desc != NULL && !json_is_null(desc) && !json_is_string(desc)) ||
            (params != NULL && !json_is_null(params) && !json_is_object(params)) ||
            (strict != NULL && !json_is_null(strict) && !json_is_boolean(strict)))
            return bad(b, "tools", "tools[%zu]: 'description' must be a string, 'parameters' an object and "
                       "'strict' a boolean", i);
        /* strict: the arguments always validate; kvd holds them to the schema
         * only where the grammar holds the whole answer */
        if (json_is_true(strict) && !r->tool_exact)
            return bad(b, "tools", "tools[%zu]: 'strict': true needs tool_choice required or a named function "
                       "(with auto, kvd does not hold the arguments to the schema)", i);
        for (size_t k = 0; k < i; k++) {
            /* the earlier tools' names, from the request itself (checked above) */
            json_t *other = json_object_get(json_object_get(json_array_get(tools, k), "function"), "name");
            if (json_equal(other, name))
                return bad(b, "tools", "tools[%zu]: the name '%s' is used twice", i, json_string_value(name));
        }
        found |= named != NULL && strcmp(named, json_string_value(name)) == 0;
        /* what the model is shown, and what kvd and its workers compile */
        json_t *def = json_pack("{s:O}", "name", name);
        if (def != NULL && desc != NULL && !json_is_null(desc))
            json_object_set(def, "description", desc);
        if (def != NULL && params != NULL && !json_is_null(params))
            json_object_set(def, "parameters", params);
        r->tool_defs[i] = def ? keep_text(r, def, JSON_COMPACT) : NULL;
        json_decref(def);
        if (r->tool_defs[i] == NULL)
            return bad(b, "tools", "out of memory");
        if (strlen(r->tool_defs[i]) > TOOLCALL_MAX_DEF_BYTES)
            return bad(b, "tools", "tools[%zu] is over %u bytes", i, TOOLCALL_MAX_DEF_BYTES);
    }
    if (!found)
        return bad(b, "tool_choice", "'tool_choice' names '%.64s', which is none of the tools", named);
    r->n_tools = n;
    r->gp.tools = r->tool_defs;
    r->gp.n_tools = n;
    r->gp.tool_choice = strcmp(mode, "required") == 0 ? "required" : named;
    r->gp.parallel_tool_calls = r->parallel;
    return 0;
}

/* ---- prompt-cache control: pins (cache_control, pin_ttl) and warm-ups ---------------------------- */

#define PIN_TTL_DEFAULT_S 300u      /* cache_control without a ttl: Anthropic's 5 minutes */
#define PIN_TTL_MAX_S 604800u       /* kvd's own --pin-max-ttl is lower or equal */

/* A pin's TTL: Anthropic's "5m" or "1h", or (secs_ok: kvd's pin_ttl and the
 * pin endpoint's ttl) whole seconds, 1 to a week (kvd holds it to its
 * --pin-max-ttl). 0, or -1 with b naming param. */
static int ttl_of(json_t *v, bool secs_ok, const char *param, uint32_t *out, struct bad *b)
{
    const char *t = json_string_value(v);
    if (t != NULL && strcmp(t, "5m") == 0)
        *out = 300;
    else if (t != NULL && strcmp(t, "1h") == 0)
        *out = 3600;
    else if (secs_ok && json_is_integer(v) && json_integer_value(v) >= 1 && json_integer_value(v) <= PIN_TTL_MAX_S)
        *out = (uint32_t)json_integer_value(v);
    else if (secs_ok)
        return bad(b, param, "'%s' must be \"5m\", \"1h\" or whole seconds (1 to %u)", param, PIN_TTL_MAX_S);
    else
        return bad(b, param, "'%s': a cache_control ttl must be \"5m\" or \"1h\"", param);
    return 0;
}

/* One cache_control mark ({"type": "ephemeral", "ttl": "5m" | "1h"}; null:
 * none): its TTL into *ttl, which must agree with the marks before it (kvd
 * takes one pin a request). 1 for a mark, 0 for none, -1 with b. */
static int cache_mark(json_t *cc, uint32_t *ttl, struct bad *b)
{
    if (cc == NULL || json_is_null(cc))
        return 0;
    const char *type = json_string_value(json_object_get(cc, "type"));
    if (!json_is_object(cc) || type == NULL || strcmp(type, "ephemeral") != 0)
        return bad(b, "messages", "cache_control must be {\"type\": \"ephemeral\"} with an optional \"ttl\"");
    const char *key;
    json_t *v;
    json_object_foreach(cc, key, v)
        if (strcmp(key, "type") != 0 && strcmp(key, "ttl") != 0)
            return bad(b, "messages", "cache_control's '%.40s' is not supported", key);
    uint32_t t = PIN_TTL_DEFAULT_S;
    json_t *tv = json_object_get(cc, "ttl");
    if (tv != NULL && !json_is_null(tv) && ttl_of(tv, false, "messages", &t, b) != 0)
        return -1;
    if (*ttl != 0 && *ttl != t)
        return bad(b, "messages", "kvd pins one prefix a request: cache_control marks with different TTLs");
    *ttl = t;
    return 1;
}

/* Anthropic's cache_control marks on chat messages or their content parts:
 * *upto is the number of messages up to and including the last marked one
 * (0: none), whose prefix is pinned for *ttl seconds; a mark on an earlier
 * message adds nothing, since a pin holds every shorter prefix of its own.
 * 0, or -1 with b. */
static int parse_cache_control(json_t *msgs, uint32_t *ttl, uint32_t *upto, struct bad *b)
{
    size_t i, k;
    json_t *msg, *part;
    *ttl = *upto = 0;
    json_array_foreach(msgs, i, msg) {
        int marked = cache_mark(json_object_get(msg, "cache_control"), ttl, b);
        json_t *c = json_object_get(msg, "content");
        if (json_is_array(c))
            json_array_foreach(c, k, part) {
                if (marked >= 0 && json_is_object(part)) {
                    const int m = cache_mark(json_object_get(part, "cache_control"), ttl, b);
                    marked = m < 0 ? m : marked | m;
                }
            }
        if (marked < 0)
            return -1;
        if (marked)
            *upto = (uint32_t)i + 1;
    }
    return 0;
}

/* kvd's fields of a chat or completions request: cache_control marks (chat),
 * pin_ttl (the whole prompt; not with marks) and prefill_only (as max_tokens
 * 0: the prompt is computed into the cache, nothing generated). 0 or -1. */
static int parse_cache_fields(struct oai_req *r, struct bad *b)
{
    json_t *o = r->root;
    uint32_t ttl = 0, upto = 0;
    if (r->chat && parse_cache_control(json_object_get(o, "messages"), &ttl, &upto, b) != 0)
        return -1;
    json_t *pt = json_object_get(o, "pin_ttl");
    if (pt != NULL && !json_is_null(pt)) {
        if (upto > 0)
            return bad(b, "pin_ttl", "give 'pin_ttl' or cache_control marks, not both");
        if (ttl_of(pt, true, "pin_ttl", &ttl, b) != 0)
            return -1;
    }
    bool prefill = false;
    if (get_bool(o, "prefill_only", &prefill, b) < 0)
        return -1;
    if (prefill)
        r->gp.prefill_only = true;
    r->gp.pin_ttl_s = ttl;
    r->gp.pin_messages = upto;
    r->want_cache = ttl > 0 || r->gp.prefill_only;
    return 0;
}

/* A pin as the HTTP API shows it: its namespace inside the tenant's. */
static json_t *pin_json(const struct kvd_pin *p, const char *tenant)
{
    const char *ns = p->ns;
    const size_t tl = tenant ? strlen(tenant) : 0;
    if (tenant != NULL && strncmp(ns, "tenant:", 7) == 0 && strncmp(ns + 7, tenant, tl) == 0 &&
        (ns[7 + tl] == '\0' || ns[7 + tl] == '/'))
        ns += 7 + tl + (ns[7 + tl] == '/');
    return json_pack("{s:s, s:s, s:s, s:I, s:I, s:I, s:I, s:I, s:I}", "id", p->id, "object", "cache.pin",
                     "namespace", ns, "tokens", (json_int_t)p->tokens, "blocks", (json_int_t)p->blocks, "hits",
                     (json_int_t)p->hits, "ttl_s", (json_int_t)p->ttl_s, "created_at",
                     (json_int_t)(p->created_unix_ms / 1000), "expires_at", (json_int_t)(p->expires_unix_ms / 1000));
}

/* What one prompt of a pin or warm-up request left in the cache: its blocks
 * and tokens there, the pin (or why none was made). */
static json_t *cache_entry_json(const struct kvd_result *res, int index, const char *tenant)
{
    json_t *e = json_pack("{s:i, s:I, s:I, s:o}", "index", index, "blocks", (json_int_t)res->cached_blocks,
                          "tokens", (json_int_t)(res->cached_prompt_tokens + res->cache_creation_tokens), "pin",
                          res->has_pin ? pin_json(&res->pin, tenant) : json_null());
    if (!res->has_pin && res->pin_error[0])
        json_object_set_new(e, "pin_error", json_string(res->pin_error));
    return e;
}

/* Parses and checks a chat or completions body into r (r->tenant is the
 * key's tenant, or NULL); 0, or -1 with b and the status. */
static int parse_request(struct oai_req *r, const struct http_server *s, struct bad *b, unsigned *status)
{
    json_t *o = r->root;
    *status = 400;
    if (!json_is_object(o))
        return bad(b, NULL, "the body must be a JSON object");
    if (check_fields(o, fields, sizeof(fields) / sizeof(fields[0]), r->chat ? F_CHAT : F_COMPL,
                     r->chat ? "chat completions" : "completions", b) != 0)
        return -1;
    kvd_gen_params_init(&r->gp);
    r->n = 1;
    if (check_model(o, s, b, status) != 0)
        return -1;
    r->model = s->model_id;
    if (r->chat) {
        json_t *m = json_object_get(o, "messages");
        if (!json_is_array(m) || json_array_size(m) == 0)
            return bad(b, "messages", "'messages' must be a non-empty array");
        r->n_msgs = json_array_size(m);
        r->msgs = calloc(r->n_msgs, sizeof(*r->msgs));
        r->calls = calloc(r->n_msgs, sizeof(*r->calls));
        json_t *ids = json_array();     /* the tool calls' ids so far */
        if (r->msgs == NULL || r->calls == NULL || ids == NULL) {
            json_decref(ids);
            return bad(b, "messages", "out of memory");
        }
        bool any_calls = false;
        for (size_t i = 0; i < r->n_msgs; i++) {
            json_t *msg = json_array_get(m, i);
            const char *role = json_string_value(json_object_get(msg, "role"));
            json_t *tc = json_object_get(msg, "tool_calls");
            int rc = 0;
            if (!json_is_object(msg) || role == NULL)
                rc = bad(b, "messages", "every message needs a 'role' string");
            else if (check_message_fields(msg, b) != 0)
                rc = -1;
            else if (strcmp(role, "developer") == 0)
                role = "system";
            if (rc == 0 && strcmp(role, "system") != 0 && strcmp(role, "user") != 0 &&
                strcmp(role, "assistant") != 0 && strcmp(role, "tool") != 0)
                rc = bad(b, "messages", "unknown role '%s' (system, developer, user, assistant, tool)", role);
            if (rc == 0 && strcmp(role, "tool") == 0)
                rc = check_result(msg, ids, b);
            if (rc == 0 && strcmp(role, "assistant") == 0 && tc != NULL && !json_is_null(tc)) {
                rc = parse_calls(r, i, tc, ids, b);
                any_calls = true;
            }
            const char *text = rc == 0 ? content_text(msg, b) : NULL;
            if (text == NULL) {
                json_decref(ids);
                return -1;
            }
            r->msgs[i] = (struct kvd_chat_msg){ role, text };
        }
        json_decref(ids);
        r->gp.messages = r->msgs;
        r->gp.n_messages = r->n_msgs;
        if (any_calls)
            r->gp.tool_calls = r->calls;
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
    /* 0: the prompt alone is computed (it fills the cache; with echo, it is scored) */
    if ((rc = get_int(o, "max_tokens", 0, 1 << 20, &v, b)) < 0)
        return -1;
    if (rc) {
        r->gp.max_tokens = (uint32_t)v;
        r->gp.prefill_only = v == 0;
    }
    if ((rc = get_int(o, "max_completion_tokens", 0, 1 << 20, &v, b)) < 0)
        return -1;
    if (rc) {
        r->gp.max_tokens = (uint32_t)v;
        r->gp.prefill_only = v == 0;
    }
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
    if ((rc = get_num(o, "repetition_penalty", 0.01, 10, &x, b)) < 0)       /* the sampler's range */
        return -1;
    if (rc)
        r->gp.repeat_penalty = (float)x;
    if ((rc = get_num(o, "presence_penalty", -2, 2, &x, b)) < 0)
        return -1;
    if (rc)
        r->gp.presence_penalty = (float)x;
    if ((rc = get_num(o, "frequency_penalty", -2, 2, &x, b)) < 0)
        return -1;
    if (rc)
        r->gp.frequency_penalty = (float)x;
    json_t *lb = json_object_get(o, "logit_bias");
    if (lb != NULL && !json_is_null(lb)) {
        /* {"token id": bias in [-100, 100]} (ids checked against the vocabulary by kvd) */
        if (!json_is_object(lb) || json_object_size(lb) > KVD_MAX_LOGIT_BIAS)
            return bad(b, "logit_bias", "'logit_bias' must be an object of at most %d token ids",
                       KVD_MAX_LOGIT_BIAS);
        const size_t n = json_object_size(lb);
        r->bias_ids = malloc((n ? n : 1) * sizeof(int32_t));
        r->bias = malloc((n ? n : 1) * sizeof(float));
        if (r->bias_ids == NULL || r->bias == NULL)
            return bad(b, "logit_bias", "out of memory");
        const char *key;
        json_t *val;
        size_t i = 0;
        json_object_foreach(lb, key, val) {
            char *end = NULL;
            errno = 0;
            const long id = strtol(key, &end, 10);
            if (end == key || *end != '\0' || errno != 0 || id < 0 || id > INT32_MAX)
                return bad(b, "logit_bias", "'logit_bias' keys must be token ids, got '%.40s'", key);
            if (!json_is_number(val) || !(json_number_value(val) >= -100 && json_number_value(val) <= 100))
                return bad(b, "logit_bias", "'logit_bias' values must be numbers in [-100, 100]");
            for (size_t j = 0; j < i; j++)
                if (r->bias_ids[j] == (int32_t)id)     /* "7" and "07" */
                    return bad(b, "logit_bias", "'logit_bias' names token %ld twice", id);
            r->bias_ids[i] = (int32_t)id;
            r->bias[i++] = (float)json_number_value(val);
        }
        r->gp.logit_bias_ids = r->bias_ids;
        r->gp.logit_bias = r->bias;
        r->gp.n_logit_bias = n;
    }
    if ((rc = get_int(o, "seed", INT64_MIN, INT64_MAX, &v, b)) < 0)
        return -1;
    if (rc) {
        /* every int64 is a seed of its own; choice i takes seed + i, wrapping */
        r->has_seed = true;
        r->seed = (uint64_t)v;
    }
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
        const char *key;
        json_t *sv;
        json_object_foreach(so, key, sv)
            if (strcmp(key, "include_usage") != 0 && !neutral_value(sv, NULL))
                return bad(b, "stream_options", "'stream_options': '%.40s' is not supported", key);
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
    /* completions' echo, and vLLM's prompt_logprobs: the prompt's tokens scored */
    r->prompt_lp = -1;
    if (!r->chat && get_bool(o, "echo", &r->echo, b) < 0)
        return -1;
    if ((rc = get_int(o, "prompt_logprobs", 0, KVD_MAX_TOP_LOGPROBS, &v, b)) < 0)
        return -1;
    if (rc)
        r->prompt_lp = (int32_t)v;
    r->gp.prompt_logprobs = r->prompt_lp;
    if (r->echo && r->gp.logprobs > r->gp.prompt_logprobs)
        r->gp.prompt_logprobs = r->gp.logprobs;
    if (r->stream && r->gp.prompt_logprobs >= 0)
        return bad(b, r->prompt_lp >= 0 ? "prompt_logprobs" : "echo", "%s", r->prompt_lp >= 0
                   ? "'prompt_logprobs' is not available while streaming"
                   : "'echo' with 'logprobs' is not available while streaming (the prompt's scores come "
                     "with the end of its output)");
    json_t *rf = json_object_get(o, "response_format");
    if (rf != NULL && !json_is_null(rf) && parse_format(rf, false, "response_format", &r->gp, &r->schema, b) != 0)
        return -1;
    if (r->chat && parse_tools(r, o, b) != 0)
        return -1;
    if (r->tool_exact && (r->gp.json_schema != NULL || r->gp.json_object))
        return bad(b, "tool_choice", "'tool_choice' required or a named function cannot go with "
                   "'response_format' (the answer is the calls)");
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
    json_t *co = json_object_get(o, "context_overflow");           /* kvd's: windowing */
    if (co != NULL && !json_is_null(co)) {
        const char *mode = json_is_string(co) ? json_string_value(co) : "";
        if (strcmp(mode, "stop") == 0)
            r->gp.context_overflow = KVD_OVERFLOW_STOP;
        else if (strcmp(mode, "window") == 0)
            r->gp.context_overflow = KVD_OVERFLOW_WINDOW;
        else
            return bad(b, "context_overflow", "'context_overflow' must be \"stop\" or \"window\"");
    }
    if (request_ns(o, r->tenant, r->ns, sizeof(r->ns), b) != 0)     /* kvd's: a cache namespace */
        return -1;
    if (r->ns[0])
        r->gp.ns = r->ns;
    json_t *user = json_object_get(o, "user");
    if (user != NULL && !json_is_null(user) && !json_is_string(user))
        return bad(b, "user", "'user' must be a string");
    return parse_cache_fields(r, b);
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
    gp.seed = -1;
    gp.has_seed_u64 = r->has_seed;
    gp.seed_u64 = r->seed + (uint64_t)index;
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

/* vLLM's prompt_logprobs: null for the first token, then for each a map of
 * token ids (the prompt's token and the likeliest alternatives) to
 * {"logprob", "rank", "decoded_token"}. */
static json_t *prompt_logprobs_json(const struct kvd_logprob *lp, const int32_t *ids, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) {
        if (i == 0 || !isfinite(lp[i].logprob)) {
            json_array_append_new(a, json_null());
            continue;
        }
        json_t *m = json_object();
        char key[16];
        for (uint32_t j = 0; j < lp[i].n_top; j++) {
            snprintf(key, sizeof(key), "%d", (int)lp[i].top_ids[j]);
            json_object_set_new(m, key, json_pack("{s:o, s:i, s:o}", "logprob", lp_num(lp[i].top_logprobs[j]),
                                                  "rank", (int)j + 1, "decoded_token",
                                                  text_json(lp[i].top_tokens[j], lp[i].top_token_lens[j])));
        }
        snprintf(key, sizeof(key), "%d", (int)ids[i]);
        json_object_set_new(m, key, json_pack("{s:o, s:i, s:o}", "logprob", lp_num(lp[i].logprob), "rank",
                                              (int)lp[i].rank, "decoded_token",
                                              text_json(lp[i].token, lp[i].token_len)));
        json_array_append_new(a, m);
    }
    return a;
}

/* Completions' echo: the prompt as given (its text, or its tokens' text)
 * before the output, and with logprobs the prompt's tokens before the
 * output's, the first without a score (null, as OpenAI answers). Sets
 * choice's "text" and "logprobs"; 0 or a kvd error code. */
static int echo_choice(json_t *ch, const struct oai_req *r, int i, const struct kvd_result *res, kvd_client_t *kc)
{
    const struct prompt *p = &r->prompts[i / r->n];
    char *detok = NULL, err[128];
    const char *ptext = p->text;
    if (ptext == NULL) {
        const int rc = kvd_detokenize(kc, p->ids, p->n_ids, &detok, err, sizeof(err));
        if (rc != 0)
            return rc;
        ptext = detok;
    }
    const size_t pl = strlen(ptext);
    char *both = malloc(pl + res->text_len + 1);
    if (both == NULL) {
        free(detok);
        return KVD_ENOMEM;
    }
    memcpy(both, ptext, pl);
    memcpy(both + pl, res->text, res->text_len);
    both[pl + res->text_len] = '\0';
    json_object_set_new(ch, "text", text_json(both, pl + res->text_len));
    free(both);
    free(detok);
    if (r->gp.logprobs < 0)
        return 0;
    const size_t n = res->n_prompt_logprobs + res->n_logprobs;
    struct kvd_logprob *all = malloc((n ? n : 1) * sizeof(*all));
    if (all == NULL)
        return KVD_ENOMEM;
    if (res->n_prompt_logprobs)
        memcpy(all, res->prompt_logprobs, res->n_prompt_logprobs * sizeof(*all));
    if (res->n_logprobs)
        memcpy(all + res->n_prompt_logprobs, res->logprobs, res->n_logprobs * sizeof(*all));
    size_t offset = 0;
    json_t *lp = completion_logprobs_json(all, n, &offset);
    free(all);
    if (res->n_prompt_logprobs > 0) {
        json_array_set_new(json_object_get(lp, "token_logprobs"), 0, json_null());
        json_array_set_new(json_object_get(lp, "top_logprobs"), 0, json_null());
    }
    json_object_set_new(ch, "logprobs", lp);
    return 0;
}

static const char *finish_name(int f)
{
    return f == KVD_FINISH_LENGTH ? "length" : "stop";
}

/* OpenAI's usage, with the prompt tokens read from the cache (cached_tokens,
 * and Anthropic's cache_read_input_tokens) and those written to it
 * (cache_creation_input_tokens); the rest of the prompt was computed without
 * caching (a partial last block, or a block another request computed at the
 * same time). */
static json_t *usage_json(uint64_t prompt, uint64_t completion, uint64_t cached, uint64_t written)
{
    return json_pack("{s:I, s:I, s:I, s:{s:I}, s:I, s:I}", "prompt_tokens", (json_int_t)prompt,
                     "completion_tokens", (json_int_t)completion, "total_tokens", (json_int_t)(prompt + completion),
                     "prompt_tokens_details", "cached_tokens", (json_int_t)cached, "cache_creation_input_tokens",
                     (json_int_t)written, "cache_read_input_tokens", (json_int_t)cached);
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

/* ---- tool calls in the output ------------------------------------------------------------------ */

/*
 * Splits generated text, as it comes, into content and tool calls (the
 * convention of engine/toolcall.h). Under the grammar (tool_choice required
 * or a name) every call is exactly `<tool_call>\n{"name": "NAME", "arguments":
 * ARGS}\n</tool_call>`, so a call's name is given out once it is read and its
 * arguments byte by byte as they are generated. With auto, a block is read
 * whole and becomes a call only when it is a JSON object naming one of the
 * tools with an object of arguments (then given out compact), else it stays
 * content; so does an unclosed block, and every call past the first when
 * parallel_tool_calls is false. Content that is only whitespace next to calls
 * is dropped. A whole answer goes through the same splitter as a streamed
 * one, so the two agree.
 */
#define CALL_HEAD "\n{\"name\": \""
#define CALL_ARGS "\", \"arguments\": "

struct tsplit {
    const struct oai_req *r;
    char *buf;                      /* text not yet given out */
    size_t len, cap;
    char *ws;                       /* whitespace-only content held back */
    size_t ws_len, ws_cap;
    bool in_call;                   /* after a <tool_call> */
    bool head_done;                 /* exact: the call's name was given out */
    bool args_started, args_done;   /* exact: the arguments' first '{', and their end */
    int depth;                      /* exact: the arguments' nesting */
    bool in_str, esc;               /* exact: inside a JSON string, after a backslash */
    int n_calls;                    /* calls given out */
    bool failed;                    /* out of memory */
    /* what comes out: content, a call's start (name set, its index), an argument fragment */
    void (*content)(void *u, const char *s, size_t n);
    void (*call)(void *u, int index, const char *name, const char *args, size_t n);
    void *u;
};

static bool grow(char **p, size_t *cap, size_t need)
{
    if (need <= *cap)
        return true;
    size_t c = *cap ? *cap : 256;
    while (c < need)
        c *= 2;
    char *q = realloc(*p, c);
    if (q == NULL)
        return false;
    *p = q;
    *cap = c;
    return true;
}

static void ts_content(struct tsplit *t, const char *s, size_t n)
{
    bool blank = true;
    for (size_t i = 0; i < n && blank; i++)
        blank = s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t';
    if (n == 0)
        return;
    if (blank) {
        if (!grow(&t->ws, &t->ws_cap, t->ws_len + n)) {
            t->failed = true;
            return;
        }
        memcpy(t->ws + t->ws_len, s, n);
        t->ws_len += n;
        return;
    }
    if (t->ws_len > 0)
        t->content(t->u, t->ws, t->ws_len);
    t->ws_len = 0;
    t->content(t->u, s, n);
}

/* Drops buf[0..n). */
static void ts_consume(struct tsplit *t, size_t n)
{
    memmove(t->buf, t->buf + n, t->len - n);
    t->len -= n;
}

static const char *ts_find(const char *s, size_t n, const char *needle)
{
    return memmem(s, n, needle, strlen(needle));
}

/* auto: the block buf[0..n) as a call, when it is one. */
static bool ts_block(struct tsplit *t, const char *s, size_t n)
{
    if (!t->r->parallel && t->n_calls > 0)
        return false;
    json_t *o = json_loadb(s, n, JSON_REJECT_DUPLICATES, NULL);
    const char *name = json_string_value(json_object_get(o, "name"));
    json_t *args = json_object_get(o, "arguments");
    bool known = false;
    for (size_t i = 0; name != NULL && i < t->r->n_tools && !known; i++) {
        json_t *d = json_loads(t->r->tool_defs[i], 0, NULL);
        known = strcmp(json_string_value(json_object_get(d, "name")), name) == 0;
        json_decref(d);
    }
    char *a = known && json_is_object(args) && json_object_size(o) == 2 ? json_dumps(args, JSON_COMPACT) : NULL;
    if (a != NULL) {
        t->call(t->u, t->n_calls, name, "", 0);
        t->call(t->u, t->n_calls, NULL, a, strlen(a));
        t->n_calls++;
    }
    json_release(a);
    json_decref(o);
    return a != NULL;
}

/* exact: gives out what the buffer holds of the current call; false when
 * more text is needed. */
static bool ts_exact(struct tsplit *t)
{
    if (!t->head_done) {
        const char *end = ts_find(t->buf, t->len, CALL_ARGS);
        if (end == NULL)
            return false;
        const size_t head = strlen(CALL_HEAD), at = (size_t)(end - t->buf);
        char name[TOOLCALL_MAX_NAME + 1];
        if (at < head || at - head > TOOLCALL_MAX_NAME || memcmp(t->buf, CALL_HEAD, head) != 0) {
            t->in_call = false;             /* not the grammar's shape: content (cannot happen) */
            ts_content(t, TOOLCALL_OPEN, strlen(TOOLCALL_OPEN));
            return true;
        }
        memcpy(name, t->buf + head, at - head);
        name[at - head] = '\0';
        t->call(t->u, t->n_calls, name, "", 0);
        ts_consume(t, at + strlen(CALL_ARGS));
        t->head_done = true;
    }
    size_t i = 0;
    for (; i < t->len && !t->args_done; i++) {
        const char c = t->buf[i];
        if (t->in_str) {
            t->in_str = t->esc || c != '"';
            t->esc = !t->esc && c == '\\';
        } else if (c == '"')
            t->in_str = true;
        else if (c == '{' || c == '[')
            t->depth++, t->args_started = true;
        else if (c == '}' || c == ']')
            t->args_done = --t->depth == 0;
    }
    if (i > 0 && (t->args_started || t->args_done)) {
        t->call(t->u, t->n_calls, NULL, t->buf, i);
        ts_consume(t, i);
    }
    if (!t->args_done)
        return false;
    const char *close = ts_find(t->buf, t->len, TOOLCALL_CLOSE);
    if (close == NULL)
        return false;
    ts_consume(t, (size_t)(close - t->buf) + strlen(TOOLCALL_CLOSE));
    t->n_calls++;
    t->in_call = t->head_done = t->args_started = t->args_done = false;
    t->depth = 0;
    return true;
}

/* Adds text[0..n) (final: the output ended) and gives out what it can. */
static void ts_feed(struct tsplit *t, const char *text, size_t n, bool final)
{
    if (!grow(&t->buf, &t->cap, t->len + n + 1)) {
        t->failed = true;
        return;
    }
    memcpy(t->buf + t->len, text, n);
    t->len += n;
    const size_t open = strlen(TOOLCALL_OPEN), close = strlen(TOOLCALL_CLOSE);
    for (;;) {
        if (!t->in_call) {
            const char *at = ts_find(t->buf, t->len, TOOLCALL_OPEN);
            if (at != NULL) {
                ts_content(t, t->buf, (size_t)(at - t->buf));
                ts_consume(t, (size_t)(at - t->buf) + open);
                t->in_call = true;
                continue;
            }
            /* hold back what may be the start of a <tool_call> */
            size_t hold = 0;
            for (size_t k = open - 1; k > 0 && hold == 0 && !final; k--)
                if (t->len >= k && memcmp(t->buf + t->len - k, TOOLCALL_OPEN, k) == 0)
                    hold = k;
            ts_content(t, t->buf, t->len - hold);
            ts_consume(t, t->len - hold);
            break;
        }
        if (t->r->tool_exact) {
            if (ts_exact(t))
                continue;
        } else {
            const char *end = ts_find(t->buf, t->len, TOOLCALL_CLOSE);
            if (end != NULL) {
                const size_t k = (size_t)(end - t->buf);
                if (!ts_block(t, t->buf, k)) {
                    ts_content(t, TOOLCALL_OPEN, open);
                    ts_content(t, t->buf, k + close);
                }
                ts_consume(t, k + close);
                t->in_call = false;
                continue;
            }
        }
        if (final) {
            /* an unclosed block: content (with auto; under the grammar only a
             * cut output leaves one, and what was given out stays out) */
            if (!t->head_done) {
                ts_content(t, TOOLCALL_OPEN, open);
                ts_content(t, t->buf, t->len);
            }
            t->len = 0;
            t->in_call = false;
        }
        break;
    }
}

/* The output ended: the rest goes out (whitespace held back too when no
 * call was made). */
static void ts_end(struct tsplit *t)
{
    ts_feed(t, "", 0, true);
    if (t->n_calls == 0 && t->ws_len > 0)
        t->content(t->u, t->ws, t->ws_len);
    t->ws_len = 0;
}

static void ts_fini(struct tsplit *t)
{
    free(t->buf);
    free(t->ws);
}

/* A whole answer's content and calls, as the splitter gives them out. */
struct whole_calls {
    char *text;                     /* the content */
    size_t len, cap;
    json_t *calls;                  /* OpenAI's tool_calls */
    bool failed;
};

static void whole_content(void *u, const char *s, size_t n)
{
    struct whole_calls *w = u;
    if (!grow(&w->text, &w->cap, w->len + n + 1)) {
        w->failed = true;
        return;
    }
    memcpy(w->text + w->len, s, n);
    w->len += n;
}

static void whole_call(void *u, int index, const char *name, const char *args, size_t n)
{
    struct whole_calls *w = u;
    char id[40];
    if (name != NULL) {
        new_id(id, sizeof(id), "call_");
        if (json_array_append_new(w->calls, json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", id, "type", "function",
                                                      "function", "name", name, "arguments", "")) != 0)
            w->failed = true;
        return;
    }
    json_t *f = json_object_get(json_array_get(w->calls, (size_t)index), "function");
    json_t *a = json_object_get(f, "arguments");
    char *joined = malloc(json_string_length(a) + n + 1);
    if (joined == NULL) {
        w->failed = true;
        return;
    }
    memcpy(joined, json_string_value(a), json_string_length(a));
    memcpy(joined + json_string_length(a), args, n);
    joined[json_string_length(a) + n] = '\0';
    if (json_object_set_new(f, "arguments", json_string(joined)) != 0)
        w->failed = true;
    free(joined);
}

/* The message of a chat choice whose tools were on: its content (null when
 * there is none and it made calls) and tool_calls; *calls_made says whether
 * it made any. */
static json_t *tool_message(const struct oai_req *r, const char *text, size_t len, bool *calls_made)
{
    struct whole_calls w = { .calls = json_array() };
    struct tsplit t = { .r = r, .content = whole_content, .call = whole_call, .u = &w };
    ts_feed(&t, text, len, false);
    ts_end(&t);
    const bool failed = t.failed || w.failed || w.calls == NULL;
    *calls_made = t.n_calls > 0;
    ts_fini(&t);
    json_t *m = failed ? NULL
                : json_pack("{s:s, s:o}", "role", "assistant", "content",
                            w.len == 0 && *calls_made ? json_null() : text_json(w.text ? w.text : "", w.len));
    if (m != NULL && *calls_made)
        json_object_set(m, "tool_calls", w.calls);
    json_decref(w.calls);
    free(w.text);
    return m;
}

/* ---- work done on a job's thread ---------------------------------------------------------------- */

/* Parses the job's body into *root under its JSON budget (the body is freed
 * after); false with the answer set (400, 413, 503). */
static bool job_parse(struct job *j, json_t **root)
{
    struct http_server *s = j->s;
    j->acct = (struct acct){ .s = s, .cap = (uint64_t)s->p.max_body * PARSE_FACTOR + (1u << 20) };
    json_error_t je;
    tl_acct = &j->acct;
    *root = json_loadb(j->body ? j->body : "", j->len, JSON_REJECT_DUPLICATES, &je);
    tl_acct = NULL;
    free(j->body);
    j->body = NULL;
    body_give(s, j->src, j->charged);
    j->charged = 0;
    if (*root != NULL)
        return true;
    char msg[320];
    if (j->acct.server_full) {
        job_error(j, 503, "the HTTP layer holds as many request bodies as it may (--http-max-memory): retry later",
                  NULL, NULL, 1);
    } else if (j->acct.over) {
        snprintf(msg, sizeof(msg), "the body's JSON would take more than %llu bytes to hold",
                 (unsigned long long)j->acct.cap);
        job_error(j, 413, msg, NULL, NULL, 0);
    } else {
        snprintf(msg, sizeof(msg), "the body is not valid JSON: %s (line %d, column %d)", je.text, je.line,
                 je.column);
        job_error(j, 400, msg, NULL, NULL, 0);
    }
    return false;
}

static void run_whole(struct job *j, kvd_client_t *kc, struct oai_req *r)
{
    json_t *choices = json_array(), *prompt_lp_chat = NULL, *cache = r->want_cache ? json_array() : NULL;
    uint64_t prompt = 0, completion = 0, cached = 0, written = 0;
    const int total = r->n * (int)(r->chat ? 1 : r->n_prompts);
    for (int i = 0; i < total; i++) {
        struct kvd_gen_params gp = choice_params(r, i);
        struct kvd_result res;
        memset(&res, 0, sizeof(res));
        const int rc = job_aborted(j) ? KVD_ECANCELLED : kvd_generate(kc, &gp, &res);
        if (rc != 0 && job_aborted(j)) {
            job_gone(j);
            kvd_result_free(&res);
            json_decref(choices);
            json_decref(prompt_lp_chat);
            json_decref(cache);
            return;
        }
        if (rc != 0) {
            json_decref(choices);
            json_decref(prompt_lp_chat);
            json_decref(cache);
            job_kvd_error(j, rc, &res);
            kvd_result_free(&res);
            return;
        }
        if (i % r->n == 0) {        /* a prompt counts once, whatever n */
            prompt += res.prompt_tokens;
            cached += res.cached_prompt_tokens;
            written += res.cache_creation_tokens;
            if (cache != NULL)
                json_array_append_new(cache, cache_entry_json(&res, i / r->n, r->tenant));
        }
        completion += res.completion_tokens;
        size_t offset = 0;
        json_t *lp = r->gp.logprobs < 0 ? json_null()
                     : r->chat           ? chat_logprobs_json(res.logprobs, res.n_logprobs)
                                         : completion_logprobs_json(res.logprobs, res.n_logprobs, &offset);
        bool calls_made = false;
        json_t *msg = r->n_tools == 0 ? NULL : tool_message(r, res.text ? res.text : "", res.text_len, &calls_made);
        if (r->n_tools > 0 && msg == NULL) {
            json_decref(lp);
            json_decref(choices);
            json_decref(prompt_lp_chat);
            job_error(j, 500, "out of memory", NULL, NULL, 0);
            kvd_result_free(&res);
            return;
        }
        const char *finish = calls_made && res.finish_reason == KVD_FINISH_STOP ? "tool_calls"
                                                                                : finish_name(res.finish_reason);
        json_t *ch = r->chat ? json_pack("{s:i, s:o, s:o, s:s}", "index", i, "message",
                                         msg ? msg : json_pack("{s:s, s:o}", "role", "assistant", "content",
                                                               text_json(res.text, res.text_len)),
                                         "logprobs", lp, "finish_reason", finish)
                             : json_pack("{s:i, s:o, s:o, s:s}", "index", i, "text",
                                         text_json(res.text, res.text_len), "logprobs", lp, "finish_reason",
                                         finish_name(res.finish_reason));
        int erc = r->echo ? echo_choice(ch, r, i, &res, kc) : 0;
        if (erc != 0) {
            json_decref(ch);
            json_decref(choices);
            json_decref(prompt_lp_chat);
            json_decref(cache);
            job_kvd_error(j, erc, &res);
            kvd_result_free(&res);
            return;
        }
        if (r->prompt_lp >= 0) {
            json_t *plp = prompt_logprobs_json(res.prompt_logprobs, res.prompt_ids, res.n_prompt_logprobs);
            if (r->chat && i == 0)
                prompt_lp_chat = plp;           /* vLLM's chat: one list, for the request */
            else if (r->chat)
                json_decref(plp);
            else
                json_object_set_new(ch, "prompt_logprobs", plp);
        }
        json_array_append_new(choices, ch);
        kvd_result_free(&res);
    }
    json_t *out = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", r->id, "object",
                            r->chat ? "chat.completion" : "text_completion", "created", (json_int_t)r->created,
                            "model", r->model, "choices", choices, "usage",
                            usage_json(prompt, completion, cached, written));
    if (prompt_lp_chat != NULL)
        json_object_set_new(out, "prompt_logprobs", prompt_lp_chat);
    if (cache != NULL)
        json_object_set_new(out, "cache", cache);
    job_json(j, 200, out, 0);
}

/* A stream's state on its job's thread. */
struct stream {
    struct job *j;
    struct oai_req *r;
    int index;                  /* the choice being generated */
    bool role_sent;
    size_t text_offset;         /* completions' logprobs: characters of the choice so far */
    struct tsplit ts;           /* with tools: the choice's text split into content and calls */
    bool gone;                  /* an event could not be sent: cancel */
};

/* A chunk event: chat's delta (role, content, or nothing) or completions'
 * text, with finish_reason when given. */
static json_t *chunk_json(struct stream *st, const char *role, const char *text, size_t len,
                          const struct kvd_logprob *lp, size_t n_lp, const char *finish)
{
    const struct oai_req *r = st->r;
    json_t *choice;
    json_t *lpj = lp == NULL ? json_null()
                  : r->chat  ? chat_logprobs_json(lp, n_lp)
                             : completion_logprobs_json(lp, n_lp, &st->text_offset);
    if (r->chat) {
        json_t *delta = json_object();
        if (role)
            json_object_set_new(delta, "role", json_string(role));
        if (text)
            json_object_set_new(delta, "content", text_json(text, len));
        choice = json_pack("{s:i, s:o, s:o, s:s?}", "index", st->index, "delta", delta, "logprobs", lpj,
                           "finish_reason", finish);
    } else {
        choice = json_pack("{s:i, s:o, s:o, s:s?}", "index", st->index, "text", text_json(text, text ? len : 0),
                           "logprobs", lpj, "finish_reason", finish);
    }
    if (finish == NULL)
        json_object_set_new(choice, "finish_reason", json_null());
    json_t *out = json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", r->id, "object",
                            r->chat ? "chat.completion.chunk" : "text_completion", "created",
                            (json_int_t)r->created, "model", r->model, "choices", choice);
    if (r->include_usage)
        json_object_set_new(out, "usage", json_null());
    return out;
}

static void stream_content(void *u, const char *s, size_t n)
{
    struct stream *st = u;
    if (!st->gone && !emit(st->j, chunk_json(st, NULL, s, n, NULL, 0, NULL)))
        st->gone = true;
}

/* A tool call's delta: its start (index, id, type, name, empty arguments),
 * then fragments of its arguments. */
static void stream_call(void *u, int index, const char *name, const char *args, size_t n)
{
    struct stream *st = u;
    char id[40];
    json_t *c = json_pack("{s:i}", "index", index);
    if (name != NULL) {
        new_id(id, sizeof(id), "call_");
        json_object_set_new(c, "id", json_string(id));
        json_object_set_new(c, "type", json_string("function"));
        json_object_set_new(c, "function", json_pack("{s:s, s:s}", "name", name, "arguments", ""));
    } else {
        json_object_set_new(c, "function", json_pack("{s:o}", "arguments", text_json(args, n)));
    }
    json_t *out = chunk_json(st, NULL, NULL, 0, NULL, 0, NULL);
    json_t *delta = json_object_get(json_array_get(json_object_get(out, "choices"), 0), "delta");
    json_object_set_new(delta, "tool_calls", json_pack("[o]", c));
    if (!st->gone && !emit(st->j, out))
        st->gone = true;
}

static int on_chunk(void *user, const struct kvd_chunk *k)
{
    struct stream *st = user;
    if (st->r->chat && !st->role_sent) {
        st->role_sent = true;
        if (!emit(st->j, chunk_json(st, "assistant", "", 0, NULL, 0, NULL)))
            return 1;
    }
    if (st->r->n_tools > 0) {
        /* the text through the splitter; logprobs on their own */
        ts_feed(&st->ts, k->text ? k->text : "", k->len, false);
        if (k->logprobs != NULL && !st->gone)
            st->gone = !emit(st->j, chunk_json(st, NULL, NULL, 0, k->logprobs, k->n_tokens, NULL));
        return st->gone || st->ts.failed;
    }
    if (k->len == 0 && k->logprobs == NULL)
        return 0;
    /* with logprobs, a chunk whose text is held back (a possible stop string)
     * still goes out: its tokens' logprobs come now, their text later */
    return emit(st->j, chunk_json(st, NULL, k->text, k->len, k->logprobs, k->logprobs ? k->n_tokens : 0, NULL))
               ? 0 : 1;  /* non-zero: cancel */
}

/* A streamed answer: events appended as chunks come; an error before the
 * first event is a whole answer with its status instead. */
static void run_stream(struct job *j, kvd_client_t *kc, struct oai_req *r)
{
    struct stream st = { .j = j, .r = r };
    uint64_t prompt = 0, completion = 0, cached = 0, written = 0;
    json_t *cache = r->want_cache ? json_array() : NULL;
    const int total = r->n * (int)(r->chat ? 1 : r->n_prompts);
    int rc = 0;
    for (int i = 0; i < total && rc == 0; i++) {
        struct kvd_gen_params gp = choice_params(r, i);
        st.index = i;
        st.role_sent = false;
        st.text_offset = 0;
        ts_fini(&st.ts);
        st.ts = (struct tsplit){ .r = r, .content = stream_content, .call = stream_call, .u = &st };
        struct kvd_result res;
        memset(&res, 0, sizeof(res));
        if (r->echo && !job_aborted(j)) {
            /* the prompt first, as given (or its tokens' text) */
            const struct prompt *p = &r->prompts[i / r->n];
            char *detok = NULL;
            if (p->text == NULL)
                rc = kvd_detokenize(kc, p->ids, p->n_ids, &detok, res.error, sizeof(res.error));
            if (rc == 0) {
                const char *t = p->text ? p->text : detok;
                emit(j, chunk_json(&st, NULL, t, strlen(t), NULL, 0, NULL));
            }
            free(detok);
        }
        if (rc == 0)
            rc = job_aborted(j) ? KVD_ECANCELLED : kvd_generate_chunks(kc, &gp, on_chunk, &st, &res);
        if (rc == 0) {
            if (i % r->n == 0) {
                prompt += res.prompt_tokens;
                cached += res.cached_prompt_tokens;
                written += res.cache_creation_tokens;
                if (cache != NULL)
                    json_array_append_new(cache, cache_entry_json(&res, i / r->n, r->tenant));
            }
            completion += res.completion_tokens;
            if (r->chat && !st.role_sent)
                emit(j, chunk_json(&st, "assistant", "", 0, NULL, 0, NULL));
            if (r->n_tools > 0)
                ts_end(&st.ts);
            emit(j, chunk_json(&st, NULL, NULL, 0, NULL, 0,
                               st.ts.n_calls > 0 && res.finish_reason == KVD_FINISH_STOP
                                   ? "tool_calls" : finish_name(res.finish_reason)));
            kvd_result_free(&res);
        } else if (job_aborted(j)) {
            job_gone(j);
            kvd_result_free(&res);
            ts_fini(&st.ts);
            json_decref(cache);
            return;
        } else if (!j->streaming) {
            job_kvd_error(j, rc, &res);     /* nothing sent yet: the status says it */
            kvd_result_free(&res);
            ts_fini(&st.ts);
            json_decref(cache);
            return;
        } else {
            const char *code;
            status_of(rc, &code);           /* after the first event: the error as an event */
            emit(j, error_json(res.error[0] ? res.error : kvd_strerror(rc), "server_error", NULL, code));
            kvd_result_free(&res);
        }
    }
    if (rc == 0 && r->include_usage) {
        json_t *u = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", r->id, "object",
                              r->chat ? "chat.completion.chunk" : "text_completion", "created",
                              (json_int_t)r->created, "model", r->model, "choices", "usage",
                              usage_json(prompt, completion, cached, written));
        if (cache != NULL)
            json_object_set(u, "cache", cache);
        emit(j, u);
    }
    json_decref(cache);
    emit(j, NULL);     /* data: [DONE] */
    ts_fini(&st.ts);
}

/* POST /v1/chat/completions and /v1/completions. */
static void work_completion(struct job *j, kvd_client_t *kc)
{
    struct oai_req *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        job_error(j, 500, "out of memory", NULL, NULL, 0);
        return;
    }
    if (!job_parse(j, &r->root)) {
        free(r);
        return;
    }
    r->chat = j->route == R_CHAT;
    r->tenant = j->tenant;
    struct bad b = { "", NULL };
    unsigned status;
    tl_acct = &j->acct;     /* what the checks add to the tree (joined message parts) counts too */
    const int prc = parse_request(r, j->s, &b, &status);
    tl_acct = NULL;
    if (prc != 0) {
        job_error(j, status, b.msg, b.param, status == 404 ? "model_not_found" : NULL, 0);
        oai_free(r);
        return;
    }
    new_id(r->id, sizeof(r->id), r->chat ? "chatcmpl-" : "cmpl-");
    r->created = time(NULL);
    if (r->stream)
        run_stream(j, kc, r);
    else
        run_whole(j, kc, r);
    oai_free(r);
}

/* ---- the Responses API (POST /v1/responses) ------------------------------------------------------ */

/*
 * A response is a chat turn: `instructions` become the system message, `input`
 * (a string, or message items with text parts) the turns after it, and
 * `previous_response_id` puts the earlier turns of a stored response before
 * them (its instructions are not carried over, as OpenAI's are not). Stored
 * responses (store, default true) live in a bounded in-memory store, oldest
 * dropped first (RESP_STORE_MAX of them, RESP_STORE_BYTES in all), each
 * visible only to the tenant that made it; their prompts hit the prefix cache
 * like any chat's.
 */
#define RESP_STORE_MAX 4096
#define RESP_STORE_BYTES (64u << 20)

struct resp_entry {
    struct resp_entry *next;        /* the next newer one */
    char id[48];
    char tenant[80];                /* its API key's tenant; "" without keys */
    size_t n_msgs, bytes;
    struct kvd_chat_msg *msgs;      /* the conversation, its strings in this allocation */
    const char **calls;             /* per message: its tool calls as the JSON text of
                                     * [{"call_id", "call"}] (call: the convention's text), or "" */
};

struct resp_store {
    pthread_mutex_t mu;
    struct resp_entry *oldest, *newest;
    size_t n, bytes;
};

static struct resp_store resp_store = { .mu = PTHREAD_MUTEX_INITIALIZER };

/* Keeps a conversation (calls: per message, as resp_entry's, or NULL). */
static void resp_store_put(const char *id, const char *tenant, const struct kvd_chat_msg *m, const char *const *calls,
                           size_t n)
{
    size_t bytes = sizeof(struct resp_entry) + n * (sizeof(*m) + sizeof(char *));
    for (size_t i = 0; i < n; i++)
        bytes += strlen(m[i].role) + strlen(m[i].content) + strlen(calls && calls[i] ? calls[i] : "") + 3;
    if (bytes > RESP_STORE_BYTES / 4)
        return;                     /* too large to keep: a later reference is a 404 */
    struct resp_entry *e = malloc(bytes);
    if (e == NULL)
        return;
    memset(e, 0, sizeof(*e));
    snprintf(e->id, sizeof(e->id), "%s", id);
    snprintf(e->tenant, sizeof(e->tenant), "%s", tenant ? tenant : "");
    e->n_msgs = n;
    e->bytes = bytes;
    e->msgs = (struct kvd_chat_msg *)(e + 1);
    e->calls = (const char **)(e->msgs + n);
    char *at = (char *)(e->calls + n);
    for (size_t i = 0; i < n; i++) {
        const char *c = calls && calls[i] ? calls[i] : "";
        const size_t rl = strlen(m[i].role) + 1, cl = strlen(m[i].content) + 1, kl = strlen(c) + 1;
        e->msgs[i].role = memcpy(at, m[i].role, rl);
        e->msgs[i].content = memcpy(at + rl, m[i].content, cl);
        e->calls[i] = memcpy(at + rl + cl, c, kl);
        at += rl + cl + kl;
    }
    pthread_mutex_lock(&resp_store.mu);
    if (resp_store.newest)
        resp_store.newest->next = e;
    else
        resp_store.oldest = e;
    resp_store.newest = e;
    resp_store.n++;
    resp_store.bytes += bytes;
    while (resp_store.n > RESP_STORE_MAX || resp_store.bytes > RESP_STORE_BYTES) {
        struct resp_entry *o = resp_store.oldest;
        resp_store.oldest = o->next;
        if (resp_store.oldest == NULL)
            resp_store.newest = NULL;
        resp_store.n--;
        resp_store.bytes -= o->bytes;
        free(o);
    }
    pthread_mutex_unlock(&resp_store.mu);
}

/* A copy of stored response id's conversation when this tenant made it
 * (malloc'd: free it; the strings live in it), else NULL. */
static struct resp_entry *resp_store_get(const char *id, const char *tenant)
{
    struct resp_entry *copy = NULL;
    pthread_mutex_lock(&resp_store.mu);
    for (struct resp_entry *e = resp_store.oldest; e != NULL; e = e->next) {
        if (strcmp(e->id, id) != 0 || strcmp(e->tenant, tenant ? tenant : "") != 0)
            continue;
        if ((copy = malloc(e->bytes)) != NULL) {
            memcpy(copy, e, e->bytes);
            /* the same layout, moved: point into the copy */
            copy->msgs = (struct kvd_chat_msg *)(copy + 1);
            copy->calls = (const char **)(copy->msgs + copy->n_msgs);
            const ptrdiff_t d = (char *)copy - (char *)e;
            for (size_t i = 0; i < copy->n_msgs; i++) {
                copy->msgs[i].role = e->msgs[i].role + d;
                copy->msgs[i].content = e->msgs[i].content + d;
                copy->calls[i] = e->calls[i] + d;
            }
            copy->next = NULL;
        }
        break;
    }
    pthread_mutex_unlock(&resp_store.mu);
    return copy;
}

/* A response being made. */
struct resp_req {
    json_t *root;
    struct kvd_gen_params gp;
    struct kvd_chat_msg *msgs;      /* previous turns, instructions, input (strings in root, prev or tr.keep) */
    struct kvd_tool_calls *calls;   /* per message: an assistant's calls (texts in tr.keep) */
    json_t *call_ids;               /* per message: [call_id, ...] of its calls, or null */
    size_t n_msgs;
    struct resp_entry *prev;        /* the previous response's copy, or NULL */
    bool stream, store;
    char id[48];
    char ns[256];
    time_t created;
    json_t *metadata;               /* borrowed from root */
    char *schema;                   /* text.format's schema as text (owned), or NULL */
    struct oai_req tr;              /* the tools as chat's (tr.root: them in chat's shape), for parse_tools
                                     * and the splitter */
    struct tsplit ts;               /* with tools: the output split into text and calls */
    /* the output */
    struct job *j;
    unsigned seq;                   /* sequence_number of the next event */
    json_t *items;                  /* output items so far, the one being written last */
    bool open, open_msg;            /* the last item is being written; it is a message */
    char *text;                     /* the open item's text (a message's, or a call's arguments) */
    size_t text_len, text_cap;
    char *content;                  /* every message's text, for the store */
    size_t content_len, content_cap;
    bool failed;                    /* out of memory */
};

static const struct field resp_fields[] = {
    { "model", F_BOTH, true, NULL, NULL },
    { "input", F_BOTH, true, NULL, NULL },
    { "instructions", F_BOTH, true, NULL, NULL },
    { "max_output_tokens", F_BOTH, true, NULL, NULL },
    { "temperature", F_BOTH, true, NULL, NULL },
    { "top_p", F_BOTH, true, NULL, NULL },
    { "stream", F_BOTH, true, NULL, NULL },
    { "store", F_BOTH, true, NULL, NULL },
    { "previous_response_id", F_BOTH, true, NULL, NULL },
    { "metadata", F_BOTH, true, NULL, NULL },                 /* returned with the response */
    { "user", F_BOTH, true, NULL, NULL },
    { "text", F_BOTH, true, NULL, NULL },
    { "seed", F_BOTH, true, NULL, NULL },                     /* kvd's: as chat's */
    { "namespace", F_BOTH, true, NULL, NULL },                /* kvd's: as chat's */
    { "service_tier", F_BOTH, false, one_tier, "kvd has one service tier" },
    { "tools", F_BOTH, true, NULL, NULL },
    { "tool_choice", F_BOTH, true, NULL, NULL },
    { "parallel_tool_calls", F_BOTH, true, NULL, NULL },
    { "truncation", F_BOTH, false, (const char *const[]){ "disabled", NULL }, "not supported" },
    { "include", F_BOTH, false, NULL, "not supported" },
    { "reasoning", F_BOTH, false, NULL, "not supported" },
    { "background", F_BOTH, false, NULL, "not supported" },
    { "top_logprobs", F_BOTH, false, NULL, "not supported" },
    { "max_tool_calls", F_BOTH, false, NULL, "not supported" },
    { "prompt_cache_key", F_BOTH, false, NULL, "not supported (kvd's cache needs no routing key; see "
                                                 "'namespace')" },
    { "stream_options", F_BOTH, false, NULL, "not supported" },
};

static void resp_free(struct resp_req *q)
{
    free(q->schema);
    for (size_t i = 0; q->calls != NULL && i < q->n_msgs; i++)
        free((void *)q->calls[i].json);
    free(q->calls);
    json_decref(q->call_ids);
    free(q->msgs);
    free(q->prev);
    free(q->text);
    free(q->content);
    json_decref(q->items);
    free(q->tr.tool_defs);
    json_decref(q->tr.keep);
    json_decref(q->tr.root);
    ts_fini(&q->ts);
    json_decref(q->root);
    free(q);
}

/* An input item's or instructions' text: a string, or text parts joined
 * (input_text, output_text, text); NULL with b otherwise. */
static const char *resp_text(json_t *c, const char *param, struct bad *b)
{
    static const char *const resp_parts[] = { "input_text", "output_text", "text", NULL };
    if (json_is_string(c))
        return json_string_value(c);
    if (!json_is_array(c)) {
        bad(b, param, "'%s' must be a string or a list of text parts", param);
        return NULL;
    }
    return text_parts(c, resp_parts, param, b);
}

/*
 * The Responses API's tools ({"type": "function", "name", "description",
 * "parameters", "strict"}), tool_choice ("none", "auto", "required" or
 * {"type": "function", "name"}) and parallel_tool_calls, put in chat's shape
 * and read by chat's parse_tools into q->tr; 0, or -1 with b.
 */
static int resp_parse_tools(struct resp_req *q, json_t *o, struct bad *b)
{
    json_t *tools = json_object_get(o, "tools"), *choice = json_object_get(o, "tool_choice");
    json_t *conv = json_object(), *list = json_array();
    q->tr.root = conv;
    if (conv == NULL || list == NULL || json_object_set_new(conv, "tools", list) != 0)
        return bad(b, "tools", "out of memory");
    if (tools != NULL && !json_is_null(tools) && !json_is_array(tools))
        return bad(b, "tools", "'tools' must be an array");
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        const char *type = json_string_value(json_object_get(t, "type"));
        if (!json_is_object(t) || type == NULL)
            return bad(b, "tools", "tools[%zu] must be an object with a 'type'", i);
        if (strcmp(type, "function") != 0)
            return bad(b, "tools", "tools[%zu]: tools of type '%.40s' are not supported (functions only)", i, type);
        json_t *f = json_object();
        const char *key;
        json_t *v;
        json_object_foreach(t, key, v) {
            if (strcmp(key, "type") == 0)
                continue;
            if (strcmp(key, "name") != 0 && strcmp(key, "description") != 0 && strcmp(key, "parameters") != 0 &&
                strcmp(key, "strict") != 0) {
                json_decref(f);
                return bad(b, "tools", "tools[%zu]: '%.40s' is not supported", i, key);
            }
            json_object_set(f, key, v);
        }
        if (json_array_append_new(list, json_pack("{s:s, s:o}", "type", "function", "function", f)) != 0)
            return bad(b, "tools", "out of memory");
    }
    if (json_is_object(choice)) {
        const char *type = json_string_value(json_object_get(choice, "type"));
        const char *key;
        json_t *v;
        json_object_foreach(choice, key, v)
            if (strcmp(key, "type") != 0 && strcmp(key, "name") != 0)
                return bad(b, "tool_choice", "'tool_choice': '%.40s' is not supported", key);
        json_t *name = json_object_get(choice, "name");
        if (type == NULL || strcmp(type, "function") != 0 || !json_is_string(name))
            return bad(b, "tool_choice", "'tool_choice' names a function as {\"type\": \"function\", \"name\": ...}");
        json_object_set_new(conv, "tool_choice", json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name",
                                                           name));
    } else if (choice != NULL) {
        json_object_set(conv, "tool_choice", choice);
    }
    json_t *par = json_object_get(o, "parallel_tool_calls");
    if (par != NULL)
        json_object_set(conv, "parallel_tool_calls", par);
    if (parse_tools(&q->tr, conv, b) != 0)
        return -1;
    q->gp.tools = q->tr.gp.tools;
    q->gp.n_tools = q->tr.gp.n_tools;
    q->gp.tool_choice = q->tr.gp.tool_choice;
    q->gp.parallel_tool_calls = q->tr.gp.parallel_tool_calls;
    if (q->tr.tool_exact && (q->gp.json_schema != NULL || q->gp.json_object))
        return bad(b, "tool_choice", "'tool_choice' required or a named function cannot go with 'text.format' json "
                   "(the answer is the calls)");
    return 0;
}

/* A string kept alive as long as q (in q->tr.keep); NULL without memory. */
static const char *resp_keep_str(struct resp_req *q, const char *text)
{
    json_t *str = json_string(text);
    if (q->tr.keep == NULL && (q->tr.keep = json_array()) == NULL) {
        json_decref(str);
        return NULL;
    }
    if (str == NULL || json_array_append_new(q->tr.keep, str) != 0)
        return NULL;
    return json_string_value(str);
}

/* Adds a call (its id and the convention's text) to message i, an
 * assistant's; 0 or -1 with b. */
static int resp_add_call(struct resp_req *q, size_t i, size_t cap, const char *call_id, const char *text,
                         struct bad *b)
{
    struct kvd_tool_calls *c = &q->calls[i];
    if (c->json == NULL && (c->json = calloc(cap, sizeof(char *))) == NULL)
        return bad(b, "input", "out of memory");
    if (c->n == cap)
        return bad(b, "input", "too many calls in one turn");
    ((const char **)c->json)[c->n++] = text;
    json_t *ids = json_array_get(q->call_ids, i);
    if (!json_is_array(ids)) {
        ids = json_array();
        json_array_set_new(q->call_ids, i, ids);
    }
    return json_array_append_new(ids, json_string(call_id)) == 0 ? 0 : bad(b, "input", "out of memory");
}

/* True when some message before the n-th made the call call_id. */
static bool resp_call_made(const struct resp_req *q, const char *call_id)
{
    for (size_t i = 0; i < q->n_msgs; i++) {
        size_t k;
        json_t *v;
        json_array_foreach(json_array_get(q->call_ids, i), k, v)
            if (strcmp(json_string_value(v), call_id) == 0)
                return true;
    }
    return false;
}

/* An input item: a message, a function_call (an assistant's call: joins the
 * assistant turn before it, or opens one) or a function_call_output (a tool
 * message answering an earlier call); 0 or -1 with b. */
static int resp_input_item(struct resp_req *q, json_t *it, size_t cap, struct bad *b)
{
    const char *type = json_string_value(json_object_get(it, "type"));
    const char *k;
    json_t *val;
    if (json_is_object(it) && type != NULL && (strcmp(type, "function_call") == 0 ||
                                               strcmp(type, "function_call_output") == 0)) {
        const bool call = strcmp(type, "function_call") == 0;
        json_object_foreach(it, k, val)
            if (strcmp(k, "type") != 0 && strcmp(k, "call_id") != 0 &&
                strcmp(k, call ? "name" : "output") != 0 && !(call && strcmp(k, "arguments") == 0) &&
                !((strcmp(k, "id") == 0 || strcmp(k, "status") == 0) && json_is_string(val)))
                return bad(b, "input", "a %s item's '%.40s' is not supported", type, k);
        const char *call_id = json_string_value(json_object_get(it, "call_id"));
        if (call_id == NULL || call_id[0] == '\0')
            return bad(b, "input", "a %s item needs a 'call_id'", type);
        if (!call) {
            if (!resp_call_made(q, call_id))
                return bad(b, "input", "a function_call_output's call_id '%.64s' names no earlier function_call",
                           call_id);
            const char *t = resp_text(json_object_get(it, "output"), "input", b);
            if (t == NULL)
                return -1;
            q->msgs[q->n_msgs++] = (struct kvd_chat_msg){ "tool", t };
            return 0;
        }
        const char *name = json_string_value(json_object_get(it, "name"));
        const char *args = json_string_value(json_object_get(it, "arguments"));
        if (name == NULL || args == NULL)
            return bad(b, "input", "a function_call item needs a 'name' and 'arguments' (JSON text of an object)");
        json_t *a = json_loads(args, JSON_REJECT_DUPLICATES, NULL);
        const char *text = json_is_object(a) ? call_text(&q->tr, name, a) : NULL;
        json_decref(a);
        if (text == NULL)
            return bad(b, "input", "a function_call's arguments must be the JSON text of an object");
        if (q->n_msgs == 0 || strcmp(q->msgs[q->n_msgs - 1].role, "assistant") != 0)
            q->msgs[q->n_msgs++] = (struct kvd_chat_msg){ "assistant", "" };
        return resp_add_call(q, q->n_msgs - 1, cap, call_id, text, b);
    }
    const char *role = json_string_value(json_object_get(it, "role"));
    if (!json_is_object(it) || (type != NULL && strcmp(type, "message") != 0))
        return bad(b, "input", "input items of type '%.40s' are not supported (messages, function_call and "
                   "function_call_output)", type ? type : "?");
    if (role == NULL)
        return bad(b, "input", "every input message needs a 'role'");
    if (strcmp(role, "developer") == 0)
        role = "system";
    if (strcmp(role, "system") != 0 && strcmp(role, "user") != 0 && strcmp(role, "assistant") != 0)
        return bad(b, "input", "unknown role '%.40s' (system, developer, user, assistant)", role);
    json_object_foreach(it, k, val)
        if (strcmp(k, "type") != 0 && strcmp(k, "role") != 0 && strcmp(k, "content") != 0 &&
            !((strcmp(k, "id") == 0 || strcmp(k, "status") == 0) && json_is_string(val)))
            return bad(b, "input", "an input message's '%.40s' is not supported", k);
    const char *t = resp_text(json_object_get(it, "content"), "input", b);
    if (t == NULL)
        return -1;
    q->msgs[q->n_msgs++] = (struct kvd_chat_msg){ role, t };
    return 0;
}

/* The previous response's turns, their calls with them; 0 or -1 with b. */
static int resp_prev_turns(struct resp_req *q, size_t cap, struct bad *b)
{
    for (size_t i = 0; i < q->prev->n_msgs; i++) {
        q->msgs[q->n_msgs++] = q->prev->msgs[i];
        if (q->prev->calls[i][0] == '\0')
            continue;
        json_t *calls = json_loads(q->prev->calls[i], 0, NULL);
        size_t k;
        json_t *c;
        int rc = json_is_array(calls) ? 0 : bad(b, "previous_response_id", "out of memory");
        json_array_foreach(calls, k, c) {
            const char *text = rc == 0 ? resp_keep_str(q, json_string_value(json_object_get(c, "call"))) : NULL;
            if (rc == 0)
                rc = text ? resp_add_call(q, q->n_msgs - 1, cap, json_string_value(json_object_get(c, "call_id")),
                                          text, b)
                          : bad(b, "previous_response_id", "out of memory");
        }
        json_decref(calls);
        if (rc != 0)
            return -1;
    }
    return 0;
}

/* Parses a Responses request into q; 0, or -1 with b and *status. */
static int resp_parse(struct resp_req *q, const struct job *j, struct bad *b, unsigned *status)
{
    json_t *o = q->root;
    *status = 400;
    if (!json_is_object(o))
        return bad(b, NULL, "the body must be a JSON object");
    if (check_fields(o, resp_fields, sizeof(resp_fields) / sizeof(resp_fields[0]), F_BOTH, "responses", b) != 0 ||
        check_model(o, j->s, b, status) != 0)
        return -1;
    kvd_gen_params_init(&q->gp);
    double x = 0;
    long long n = 0;
    int rc;
    if ((rc = get_int(o, "max_output_tokens", 1, 1 << 20, &n, b)) < 0)
        return -1;
    if (rc)
        q->gp.max_tokens = (uint32_t)n;
    if ((rc = get_num(o, "temperature", 0, 2, &x, b)) < 0)
        return -1;
    if (rc)
        q->gp.temperature = (float)x;
    if ((rc = get_num(o, "top_p", 0, 1, &x, b)) < 0)
        return -1;
    if (rc)
        q->gp.top_p = (float)x;
    if ((rc = get_int(o, "seed", INT64_MIN, INT64_MAX, &n, b)) < 0)
        return -1;
    if (rc) {
        q->gp.has_seed_u64 = true;
        q->gp.seed_u64 = (uint64_t)n;
    }
    q->store = true;
    if (get_bool(o, "stream", &q->stream, b) < 0 || get_bool(o, "store", &q->store, b) < 0)
        return -1;
    q->metadata = json_object_get(o, "metadata");
    if (q->metadata != NULL && !json_is_null(q->metadata) &&
        (!json_is_object(q->metadata) || json_object_size(q->metadata) > 16))
        return bad(b, "metadata", "'metadata' must be an object of at most 16 entries");
    json_t *user = json_object_get(o, "user");
    if (user != NULL && !json_is_null(user) && !json_is_string(user))
        return bad(b, "user", "'user' must be a string");
    json_t *text = json_object_get(o, "text");
    if (text != NULL && !json_is_null(text)) {
        json_t *fmt = json_object_get(text, "format");
        if (!json_is_object(text) || json_object_size(text) != (fmt != NULL))
            return bad(b, "text", "'text' must be an object with at most a 'format'");
        if (fmt != NULL && parse_format(fmt, true, "text", &q->gp, &q->schema, b) != 0)
            return -1;
    }
    if (resp_parse_tools(q, o, b) != 0)
        return -1;
    if (request_ns(o, j->tenant, q->ns, sizeof(q->ns), b) != 0)
        return -1;
    if (q->ns[0])
        q->gp.ns = q->ns;
    /* the conversation: instructions, the previous response's turns, input */
    json_t *prev = json_object_get(o, "previous_response_id");
    if (prev != NULL && !json_is_null(prev)) {
        if (!json_is_string(prev))
            return bad(b, "previous_response_id", "'previous_response_id' must be a string");
        if ((q->prev = resp_store_get(json_string_value(prev), j->tenant)) == NULL) {
            *status = 404;
            return bad(b, "previous_response_id", "no stored response '%.60s'", json_string_value(prev));
        }
    }
    json_t *input = json_object_get(o, "input");
    const size_t n_items = json_is_array(input) ? json_array_size(input) : 1;
    if (input == NULL || (!json_is_string(input) && !json_is_array(input)) || n_items == 0)
        return bad(b, "input", "'input' must be a string or a non-empty list of messages");
    const size_t n_prev = q->prev ? q->prev->n_msgs : 0, cap = n_prev + 1 + n_items;
    q->msgs = calloc(cap, sizeof(*q->msgs));
    q->calls = calloc(cap, sizeof(*q->calls));
    q->call_ids = json_array();
    for (size_t i = 0; q->call_ids != NULL && i < cap; i++)
        json_array_append_new(q->call_ids, json_null());
    if (q->msgs == NULL || q->calls == NULL || json_array_size(q->call_ids) != cap)
        return bad(b, "input", "out of memory");
    json_t *ins = json_object_get(o, "instructions");
    if (ins != NULL && !json_is_null(ins)) {
        const char *t = resp_text(ins, "instructions", b);
        if (t == NULL)
            return -1;
        q->msgs[q->n_msgs++] = (struct kvd_chat_msg){ "system", t };
    }
    if (q->prev != NULL && resp_prev_turns(q, cap, b) != 0)
        return -1;
    if (json_is_string(input)) {
        q->msgs[q->n_msgs++] = (struct kvd_chat_msg){ "user", json_string_value(input) };
    } else {
        size_t i;
        json_t *it;
        json_array_foreach(input, i, it)
            if (resp_input_item(q, it, cap, b) != 0)
                return -1;
    }
    q->gp.messages = q->msgs;
    q->gp.n_messages = q->n_msgs;
    for (size_t i = 0; i < q->n_msgs; i++)
        if (q->calls[i].n > 0)
            q->gp.tool_calls = q->calls;
    return 0;
}

static json_t *resp_usage_json(const struct kvd_result *res)
{
    return json_pack("{s:I, s:{s:I}, s:I, s:{s:i}, s:I, s:I, s:I}", "input_tokens", (json_int_t)res->prompt_tokens,
                     "input_tokens_details", "cached_tokens", (json_int_t)res->cached_prompt_tokens,
                     "output_tokens", (json_int_t)res->completion_tokens, "output_tokens_details",
                     "reasoning_tokens", 0, "total_tokens",
                     (json_int_t)(res->prompt_tokens + res->completion_tokens), "cache_creation_input_tokens",
                     (json_int_t)res->cache_creation_tokens, "cache_read_input_tokens",
                     (json_int_t)res->cached_prompt_tokens);
}

/* The response object: status "in_progress" (res NULL: no output yet),
 * "completed" or "incomplete" (the output hit max_output_tokens). */
static json_t *resp_json(const struct resp_req *q, const struct job *j, const struct kvd_result *res)
{
    json_t *ins = json_object_get(q->root, "instructions");
    json_t *prev = json_object_get(q->root, "previous_response_id");
    json_t *tools = json_object_get(q->root, "tools"), *choice = json_object_get(q->root, "tool_choice");
    const bool incomplete = res != NULL && res->finish_reason == KVD_FINISH_LENGTH;
    json_t *r = json_pack("{s:s, s:s, s:I, s:s, s:o, s:s, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:b, s:{s:{s:s}},"
                          " s:o, s:o, s:b, s:o}",
                          "id", q->id, "object", "response", "created_at", (json_int_t)q->created, "status",
                          res == NULL ? "in_progress" : incomplete ? "incomplete" : "completed", "incomplete_details",
                          incomplete ? json_pack("{s:s}", "reason", "max_output_tokens") : json_null(), "model",
                          j->s->model_id, "output", res != NULL ? json_copy(q->items) : json_array(), "instructions",
                          ins ? json_incref(ins) : json_null(), "previous_response_id",
                          prev ? json_incref(prev) : json_null(), "max_output_tokens",
                          q->gp.max_tokens ? json_integer(q->gp.max_tokens) : json_null(), "temperature",
                          q->gp.temperature >= 0 ? json_real(q->gp.temperature) : json_null(), "top_p",
                          q->gp.top_p >= 0 ? json_real(q->gp.top_p) : json_null(), "tool_choice",
                          choice && !json_is_null(choice) ? json_incref(choice) : json_string("auto"), "tools",
                          json_is_array(tools) ? json_incref(tools) : json_array(), "parallel_tool_calls",
                          q->tr.parallel, "text",
                          "format", "type", q->schema ? "json_schema" : q->gp.json_object ? "json_object" : "text",
                          "usage", res ? resp_usage_json(res) : json_null(), "error", json_null(), "store", q->store,
                          "metadata", q->metadata && json_is_object(q->metadata) ? json_incref(q->metadata)
                                                                                 : json_object());
    return r;
}

/* Stores a finished response's conversation: its turns (but the
 * instructions, which are the request's own) and its answer, calls too. */
static void resp_keep(const struct resp_req *q, const struct job *j)
{
    if (!q->store)
        return;
    const bool ins = q->n_msgs > 0 && json_object_get(q->root, "instructions") != NULL &&
                     !json_is_null(json_object_get(q->root, "instructions"));
    const size_t from = ins ? 1 : 0, n = q->n_msgs - from;
    struct kvd_chat_msg *m = malloc((n + 1) * sizeof(*m));
    char **calls = calloc(n + 1, sizeof(*calls));
    json_t *answer = json_array();
    bool ok = m != NULL && calls != NULL && answer != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        m[i] = q->msgs[from + i];
        json_t *arr = json_array();
        for (size_t k = 0; arr != NULL && k < q->calls[from + i].n; k++)
            json_array_append_new(arr, json_pack("{s:O, s:s}", "call_id",
                                                 json_array_get(json_array_get(q->call_ids, from + i), k), "call",
                                                 q->calls[from + i].json[k]));
        calls[i] = json_array_size(arr) > 0 ? json_dumps(arr, JSON_COMPACT) : NULL;
        json_decref(arr);
    }
    size_t k;
    json_t *it;
    json_array_foreach(q->items, k, it) {
        if (!ok || strcmp(json_string_value(json_object_get(it, "type")), "function_call") != 0)
            continue;
        json_t *args = json_loads(json_string_value(json_object_get(it, "arguments")), 0, NULL);
        json_t *c = json_pack("{s:s, s:O}", "name", json_string_value(json_object_get(it, "name")), "arguments",
                              args ? args : json_object());
        char *t = c ? json_dumps(c, 0) : NULL;
        json_array_append_new(answer, json_pack("{s:O, s:s}", "call_id", json_object_get(it, "call_id"), "call",
                                                t ? t : "{}"));
        json_release(t);
        json_decref(c);
        json_decref(args);
    }
    if (ok) {
        m[n] = (struct kvd_chat_msg){ "assistant", q->content ? q->content : "" };
        calls[n] = json_array_size(answer) > 0 ? json_dumps(answer, JSON_COMPACT) : NULL;
        resp_store_put(q->id, j->tenant, m, (const char *const *)calls, n + 1);
    }
    for (size_t i = 0; calls != NULL && i <= n; i++)
        json_release(calls[i]);
    free(calls);
    free(m);
    json_decref(answer);
}

/* A Responses streaming event: its type, a sequence number, the fields of o. */
static bool resp_event(struct resp_req *q, const char *type, json_t *o)
{
    json_object_set_new(o, "type", json_string(type));
    json_object_set_new(o, "sequence_number", json_integer(q->seq++));
    return emit(q->j, o);
}

/* ---- the output, item by item (the same for a whole answer and a streamed one) ---- */

/* Appends s[0..n) to a growing text; false without memory. */
static bool resp_append(char **p, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (!grow(p, cap, *len + n + 1))
        return false;
    memcpy(*p + *len, s, n);
    *len += n;
    (*p)[*len] = '\0';
    return true;
}

/* The item being written: done, with its status (its events when streamed). */
static void out_close(struct resp_req *q, const char *status)
{
    if (!q->open)
        return;
    q->open = false;
    const int index = (int)json_array_size(q->items) - 1;
    json_t *it = json_array_get(q->items, (size_t)index);
    const char *id = json_string_value(json_object_get(it, "id"));
    const char *t = q->text ? q->text : "";
    json_object_set_new(it, "status", json_string(status));
    if (q->open_msg) {
        json_object_set_new(it, "content", json_pack("[{s:s, s:o, s:[]}]", "type", "output_text", "text",
                                                     text_json(t, q->text_len), "annotations"));
        if (q->stream) {
            resp_event(q, "response.output_text.done",
                       json_pack("{s:s, s:i, s:i, s:o, s:[]}", "item_id", id, "output_index", index, "content_index",
                                 0, "text", text_json(t, q->text_len), "logprobs"));
            resp_event(q, "response.content_part.done",
                       json_pack("{s:s, s:i, s:i, s:{s:s, s:o, s:[]}}", "item_id", id, "output_index", index,
                                 "content_index", 0, "part", "type", "output_text", "text", text_json(t, q->text_len),
                                 "annotations"));
        }
    } else {
        json_object_set_new(it, "arguments", json_stringn(t, q->text_len));
        if (q->stream)
            resp_event(q, "response.function_call_arguments.done",
                       json_pack("{s:s, s:i, s:s, s:o}", "item_id", id, "output_index", index, "name",
                                 json_string_value(json_object_get(it, "name")), "arguments",
                                 json_stringn(t, q->text_len)));
    }
    if (q->stream)
        resp_event(q, "response.output_item.done", json_pack("{s:i, s:O}", "output_index", index, "item", it));
    q->text_len = 0;
}

/* A new message item (its events when streamed). */
static void out_msg_open(struct resp_req *q)
{
    char id[48];
    new_id(id, sizeof(id), "msg_");
    json_t *it = json_pack("{s:s, s:s, s:s, s:s, s:[]}", "type", "message", "id", id, "status", "in_progress", "role",
                           "assistant", "content");
    if (it == NULL || json_array_append_new(q->items, it) != 0) {
        q->failed = true;
        return;
    }
    q->open = q->open_msg = true;
    q->text_len = 0;
    const int index = (int)json_array_size(q->items) - 1;
    if (q->stream) {
        resp_event(q, "response.output_item.added", json_pack("{s:i, s:O}", "output_index", index, "item", it));
        resp_event(q, "response.content_part.added",
                   json_pack("{s:s, s:i, s:i, s:{s:s, s:s, s:[]}}", "item_id", id, "output_index", index,
                             "content_index", 0, "part", "type", "output_text", "text", "", "annotations"));
    }
}

/* Text of the answer: into the open message, or a new one. */
static void out_text(void *u, const char *s, size_t n)
{
    struct resp_req *q = u;
    if (n == 0)
        return;
    if (!q->open || !q->open_msg) {
        out_close(q, "completed");
        out_msg_open(q);
    }
    if (!resp_append(&q->text, &q->text_len, &q->text_cap, s, n) ||
        !resp_append(&q->content, &q->content_len, &q->content_cap, s, n)) {
        q->failed = true;
        return;
    }
    const int index = (int)json_array_size(q->items) - 1;
    const char *id = json_string_value(json_object_get(json_array_get(q->items, (size_t)index), "id"));
    if (q->stream)
        resp_event(q, "response.output_text.delta",
                   json_pack("{s:s, s:i, s:i, s:o, s:[]}", "item_id", id, "output_index", index, "content_index", 0,
                             "delta", text_json(s, n), "logprobs"));
}

/* The splitter's calls: a new function_call item (name set), or a fragment of
 * its arguments. */
static void out_call(void *u, int index_unused, const char *name, const char *args, size_t n)
{
    struct resp_req *q = u;
    (void)index_unused;
    if (name != NULL) {
        out_close(q, "completed");
        char id[48], call_id[48];
        new_id(id, sizeof(id), "fc_");
        new_id(call_id, sizeof(call_id), "call_");
        json_t *it = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s}", "type", "function_call", "id", id, "call_id",
                               call_id, "name", name, "arguments", "", "status", "in_progress");
        if (it == NULL || json_array_append_new(q->items, it) != 0) {
            q->failed = true;
            return;
        }
        q->open = true;
        q->open_msg = false;
        q->text_len = 0;
        if (q->stream)
            resp_event(q, "response.output_item.added",
                       json_pack("{s:i, s:O}", "output_index", (int)json_array_size(q->items) - 1, "item", it));
        return;
    }
    if (n == 0 || !q->open || q->open_msg)
        return;
    if (!resp_append(&q->text, &q->text_len, &q->text_cap, args, n)) {
        q->failed = true;
        return;
    }
    const int index = (int)json_array_size(q->items) - 1;
    if (q->stream)
        resp_event(q, "response.function_call_arguments.delta",
                   json_pack("{s:s, s:i, s:o}", "item_id",
                             json_string_value(json_object_get(json_array_get(q->items, (size_t)index), "id")),
                             "output_index", index, "delta", text_json(args, n)));
}

/* Text of the output as it comes: through the splitter with tools, else the
 * message's. */
static void out_feed(struct resp_req *q, const char *s, size_t n)
{
    if (q->tr.n_tools > 0)
        ts_feed(&q->ts, s, n, false);
    else
        out_text(q, s, n);
}

/* The output ended: the last item closed with its status; an answer with no
 * item at all gets an empty message. */
static void out_end(struct resp_req *q, bool incomplete)
{
    if (q->tr.n_tools > 0)
        ts_end(&q->ts);
    if (json_array_size(q->items) == 0)
        out_msg_open(q);
    out_close(q, incomplete ? "incomplete" : "completed");
}

static int resp_on_chunk(void *user, const struct kvd_chunk *k)
{
    struct resp_req *q = user;
    if (k->len > 0)
        out_feed(q, k->text, k->len);
    return q->failed || q->ts.failed || job_aborted(q->j);
}

/* POST /v1/responses. */
static void work_responses(struct job *j, kvd_client_t *kc)
{
    struct resp_req *q = calloc(1, sizeof(*q));
    if (q == NULL) {
        job_error(j, 500, "out of memory", NULL, NULL, 0);
        return;
    }
    if (!job_parse(j, &q->root)) {
        free(q);
        return;
    }
    struct bad b = { "", NULL };
    unsigned status;
    tl_acct = &j->acct;
    const int prc = resp_parse(q, j, &b, &status);
    tl_acct = NULL;
    if (prc != 0) {
        job_error(j, status, b.msg, b.param, status == 404 && b.param && strcmp(b.param, "model") == 0
                                                  ? "model_not_found" : NULL, 0);
        resp_free(q);
        return;
    }
    new_id(q->id, sizeof(q->id), "resp_");
    q->created = time(NULL);
    q->j = j;
    q->ts = (struct tsplit){ .r = &q->tr, .content = out_text, .call = out_call, .u = q };
    if ((q->items = json_array()) == NULL) {
        job_error(j, 500, "out of memory", NULL, NULL, 0);
        resp_free(q);
        return;
    }
    struct kvd_result res;
    memset(&res, 0, sizeof(res));
    int rc;
    if (!q->stream) {
        rc = job_aborted(j) ? KVD_ECANCELLED : kvd_generate(kc, &q->gp, &res);
        if (rc == 0) {
            out_feed(q, res.text ? res.text : "", res.text_len);
            out_end(q, res.finish_reason == KVD_FINISH_LENGTH);
        }
        if (rc != 0 && job_aborted(j))
            job_gone(j);
        else if (rc != 0)
            job_kvd_error(j, rc, &res);
        else if (q->failed || q->ts.failed)
            job_error(j, 500, "out of memory", NULL, NULL, 0);
        else {
            resp_keep(q, j);
            job_json(j, 200, resp_json(q, j, &res), 0);
        }
        kvd_result_free(&res);
        resp_free(q);
        return;
    }
    resp_event(q, "response.created", json_pack("{s:o}", "response", resp_json(q, j, NULL)));
    resp_event(q, "response.in_progress", json_pack("{s:o}", "response", resp_json(q, j, NULL)));
    if (q->tr.n_tools == 0)
        out_msg_open(q);        /* without tools the one message opens at once */
    rc = job_aborted(j) ? KVD_ECANCELLED : kvd_generate_chunks(kc, &q->gp, resp_on_chunk, q, &res);
    if (rc != 0 && job_aborted(j)) {
        job_gone(j);
    } else if (rc != 0) {
        const char *code;
        status_of(rc, &code);
        resp_event(q, "error", json_pack("{s:s?, s:s}", "code", code, "message",
                                         res.error[0] ? res.error : kvd_strerror(rc)));
        emit(j, NULL);
    } else {
        out_end(q, res.finish_reason == KVD_FINISH_LENGTH);
        resp_keep(q, j);
        /* "completed" whatever the status in it says (clients wait for that event) */
        resp_event(q, "response.completed", json_pack("{s:o}", "response", resp_json(q, j, &res)));
        emit(j, NULL);
    }
    kvd_result_free(&res);
    resp_free(q);
}

/* GET /health and /ready. */
static void work_health(struct job *j, kvd_client_t *kc, bool ready)
{
    kvd_client_set_timeout(kc, 2000);
    bool ok = false;
    uint32_t alive = 0;
    const int rc = kvd_health(kc, &ok, &alive);
    if (rc != 0)
        job_error(j, 503, "kvd does not answer", NULL, NULL, 0);
    else if (ready && (!ok || alive == 0))
        job_error(j, 503, "no worker is ready", NULL, NULL, 0);
    else
        job_json(j, 200, json_pack("{s:s, s:i}", "status", ok ? "ok" : "no worker", "workers", (int)alive), 0);
}

/* GET /tokenizer_info's answer, after vLLM's (a Hugging Face tokenizer's
 * config with its class and chat template): the class of the GGUF's kind of
 * tokenizer, the special tokens by text and id, whether a prompt gets a BOS
 * or an EOS, kvd's context as model_max_length, the vocabulary's size, the
 * GGUF's chat template, and the control and user-defined tokens as
 * added_tokens_decoder. Malloc'd JSON text, or NULL without memory. */
static char *tokenizer_info_text(const struct http_tokenizer *t, size_t *len)
{
    const char *kind = t->model ? t->model : "";
    const char *cls = strcmp(kind, "gpt2") == 0 ? "GPT2TokenizerFast"
                      : strcmp(kind, "llama") == 0 ? "LlamaTokenizerFast" : "PreTrainedTokenizerFast";
    json_t *added = json_object();
    const char *named[4] = { NULL, NULL, NULL, NULL };
    const int32_t ids[4] = { t->bos, t->eos, t->pad, t->unk };
    for (size_t i = 0; added != NULL && i < t->n_special; i++) {
        char key[16];
        snprintf(key, sizeof(key), "%d", t->special[i].id);
        json_object_set_new(added, key, json_pack("{s:s, s:b, s:b, s:b, s:b, s:b}", "content", t->special[i].text,
                                                  "lstrip", 0, "normalized", 0, "rstrip", 0, "single_word", 0,
                                                  "special", 1));
        for (int k = 0; k < 4; k++)
            if (ids[k] == t->special[i].id)
                named[k] = t->special[i].text;
    }
    json_t *o = json_pack("{s:s, s:s, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:b, s:b, s:I, s:I, s:o, s:o}",
                          "tokenizer_class", cls, "tokenizer_model", kind,
                          "bos_token", named[0] ? json_string(named[0]) : json_null(),
                          "eos_token", named[1] ? json_string(named[1]) : json_null(),
                          "pad_token", named[2] ? json_string(named[2]) : json_null(),
                          "unk_token", named[3] ? json_string(named[3]) : json_null(),
                          "bos_token_id", ids[0] >= 0 ? json_integer(ids[0]) : json_null(),
                          "eos_token_id", ids[1] >= 0 ? json_integer(ids[1]) : json_null(),
                          "pad_token_id", ids[2] >= 0 ? json_integer(ids[2]) : json_null(),
                          "unk_token_id", ids[3] >= 0 ? json_integer(ids[3]) : json_null(),
                          "add_bos_token", t->add_bos, "add_eos_token", t->add_eos,
                          "model_max_length", (json_int_t)t->max_model_len, "vocab_size", (json_int_t)t->n_vocab,
                          "chat_template", t->chat_template ? json_string(t->chat_template) : json_null(),
                          "added_tokens_decoder", added ? added : json_object());
    char *text = o ? json_text(o, len) : NULL;
    return text;
}

/* The fields of /tokenize and /detokenize (vLLM's), with the values that ask
 * for what kvd does not do. */
static const struct field tok_fields[] = {
    { "model", F_BOTH, true, NULL, NULL },
    { "prompt", F_COMPL, true, NULL, NULL },
    { "messages", F_CHAT, true, NULL, NULL },
    { "add_special_tokens", F_BOTH, true, NULL, NULL },
    { "add_generation_prompt", F_CHAT, true, NULL, NULL },
    { "continue_final_message", F_CHAT, false, NULL, "kvd renders a chat as it generates from it (with the "
                                                      "assistant's turn opened)" },
    { "return_token_strs", F_BOTH, false, NULL, "not supported (POST /detokenize gives a token's text)" },
    { "chat_template", F_CHAT, false, NULL, "kvd renders the model's own template" },
    { "chat_template_kwargs", F_CHAT, false, NULL, "kvd renders the model's own template" },
    { "tools", F_CHAT, false, NULL, "not supported here" },
    { "mm_processor_kwargs", F_BOTH, false, NULL, "kvd serves text models" },
};
#define F_DETOK 4u                  /* tok_fields' where: /detokenize */
static const struct field detok_fields[] = {
    { "model", F_DETOK, true, NULL, NULL },
    { "tokens", F_DETOK, true, NULL, NULL },
};

/* POST /detokenize {"tokens": [...]}: {"prompt"}. */
static void work_detokenize(struct job *j, kvd_client_t *kc, json_t *o)
{
    struct bad b = { "", NULL };
    json_t *a = json_object_get(o, "tokens");
    struct prompt p = { 0 };
    char err[256] = "";
    if (check_fields(o, detok_fields, sizeof(detok_fields) / sizeof(detok_fields[0]), F_DETOK, "detokenize",
                     &b) != 0) {
        job_error(j, 400, b.msg, b.param, NULL, 0);
    } else if (!json_is_array(a) || get_ids(a, "tokens", &p, &b) != 0) {
        job_error(j, 400, b.msg[0] ? b.msg : "'tokens' must be a list of token ids", "tokens", NULL, 0);
    } else {
        char *text = NULL;
        const int rc = kvd_detokenize(kc, p.ids, p.n_ids, &text, err, sizeof(err));
        if (rc == 0)
            job_json(j, 200, json_pack("{s:s}", "prompt", text), 0);
        else
            job_error(j, status_of(rc, &(const char *){ NULL }), err[0] ? err : kvd_strerror(rc), "tokens", NULL, 0);
        free(text);
    }
    free(p.ids);
}

/* POST /tokenize {"prompt": text} or {"messages": [...]} (vLLM's shapes):
 * {"tokens", "count", "max_model_len", "token_strs": null}. A prompt is
 * tokenized as a completion's prompt (a BOS first when the model wants one;
 * add_special_tokens false leaves it out), a chat as chat completions render
 * it (the template puts in what it needs, and opens the assistant's turn). */
static void work_tokenize(struct job *j, kvd_client_t *kc, json_t *o)
{
    const struct http_server *s = j->s;
    struct oai_req r = { 0 };
    struct bad b = { "", NULL };
    json_t *m = json_object_get(o, "messages"), *prompt = json_object_get(o, "prompt");
    const unsigned where = m != NULL ? F_CHAT : F_COMPL;
    bool special = m == NULL, gen = true;     /* vLLM's defaults: true for a prompt, false for a chat */
    char err[256] = "";
    bool ok = check_fields(o, tok_fields, sizeof(tok_fields) / sizeof(tok_fields[0]), where,
                           m != NULL ? "chat tokenize" : "tokenize", &b) == 0 &&
              get_bool(o, "add_special_tokens", &special, &b) >= 0 && get_bool(o, "add_generation_prompt", &gen, &b) >= 0;
    if (ok && m != NULL && special)
        ok = bad(&b, "add_special_tokens", "'add_special_tokens': kvd tokenizes a chat as it generates from it "
                 "(the template puts in the special tokens it needs)") == 0;
    if (ok && !gen)
        ok = bad(&b, "add_generation_prompt", "'add_generation_prompt': kvd renders a chat with the assistant's "
                 "turn opened, as it generates from it") == 0;
    if (ok && m != NULL) {
        r.chat = true;
        unsigned st;
        r.root = json_pack("{s:O}", "messages", m);   /* parse_request's checks, messages only */
        tl_acct = &j->acct;
        ok = parse_request(&r, s, &b, &st) == 0;
        tl_acct = NULL;
    } else if (ok && !json_is_string(prompt)) {
        ok = bad(&b, "prompt", "give 'prompt' (a string) or 'messages'") == 0;
    }
    if (!ok) {
        job_error(j, 400, b.msg, b.param, NULL, 0);
    } else {
        int32_t *ids = NULL;
        size_t n = 0;
        uint32_t max_ctx = 0;
        const int rc = kvd_tokenize(kc, m ? NULL : json_string_value(prompt), r.msgs, r.n_msgs, &ids, &n, &max_ctx,
                                    err, sizeof(err));
        if (rc == 0) {
            /* a prompt without special tokens: without the BOS kvd puts first */
            const size_t from = m == NULL && !special && s->add_bos && n > 0 && ids[0] == s->bos;
            json_t *arr = json_array();
            for (size_t i = from; i < n; i++)
                json_array_append_new(arr, json_integer(ids[i]));
            job_json(j, 200, json_pack("{s:o, s:I, s:I, s:n}", "tokens", arr, "count", (json_int_t)(n - from),
                                       "max_model_len", (json_int_t)max_ctx, "token_strs"), 0);
        } else {
            job_error(j, status_of(rc, &(const char *){ NULL }), err[0] ? err : kvd_strerror(rc), NULL, NULL, 0);
        }
        free(ids);
    }
    free(r.msgs);
    json_decref(r.root);
}

/* POST /tokenize and /detokenize: the body, its model, then the work. */
static void work_tokens(struct job *j, kvd_client_t *kc)
{
    json_t *o;
    if (!job_parse(j, &o))
        return;
    json_t *model = json_object_get(o, "model");
    if (!json_is_object(o))
        job_error(j, 400, "the body must be a JSON object", NULL, NULL, 0);
    else if (model != NULL && !json_is_null(model) && !json_is_string(model))
        job_error(j, 400, "'model' must be a string", "model", NULL, 0);
    else if (json_is_string(model) && strcmp(json_string_value(model), j->s->model_id) != 0)
        job_error(j, 404, "no such model", "model", "model_not_found", 0);
    else if (j->route == R_DETOKENIZE)
        work_detokenize(j, kc, o);
    else
        work_tokenize(j, kc, o);
    json_decref(o);
}

/* Appends printf output to a growing text; false without memory. */
struct text {
    char *s;
    size_t len, cap;
};

static bool tappend(struct text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool tappend(struct text *t, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        const int n = vsnprintf(t->s ? t->s + t->len : NULL, t->s ? t->cap - t->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0)
            return false;
        if (t->s != NULL && t->len + (size_t)n < t->cap) {
            t->len += (size_t)n;
            return true;
        }
        const size_t cap = (t->len + (size_t)n + 1) * 2;
        char *b = realloc(t->s, cap);
        if (b == NULL)
            return false;
        t->s = b;
        t->cap = cap;
    }
}

/* GET /metrics: kvd's statistics in Prometheus' text format, every tenant's
 * rows for the operator's key, a tenant's own for its key, none without one;
 * then this front end's own. */
static void work_metrics(struct job *j, kvd_client_t *kc)
{
    struct http_server *s = j->s;
    kvd_client_set_timeout(kc, 5000);
    struct kvd_stats st;
    if (kvd_stats(kc, &st) != 0) {
        job_error(j, 503, "kvd does not answer", NULL, NULL, 0);
        return;
    }
    if (!j->operator) {
        uint32_t kept = 0;
        for (uint32_t i = 0; i < st.n_tenants; i++)
            if (j->tenant != NULL && strcmp(st.tenants[i].name, j->tenant) == 0)
                st.tenants[kept++] = st.tenants[i];
        st.n_tenants = kept;
    }
    char *kvd_text = kvd_stats_prometheus(&st);
    kvd_stats_free(&st);
    struct text t = { 0 };
    bool ok = kvd_text != NULL && tappend(&t, "%s", kvd_text);
    free(kvd_text);
    ok = ok && tappend(&t, "# HELP kvd_http_requests_total HTTP responses by status.\n"
                           "# TYPE kvd_http_requests_total counter\n");
    for (size_t i = 0; ok && i <= N_COUNTED; i++) {
        char code[8];
        snprintf(code, sizeof(code), "%u", i < N_COUNTED ? counted[i] : 0u);
        ok = tappend(&t, "kvd_http_requests_total{code=\"%s\"} %llu\n", i < N_COUNTED ? code : "other",
                     (unsigned long long)atomic_load(&s->by_status[i]));
    }
    pthread_mutex_lock(&s->mu);
    const uint32_t n_jobs = s->n_jobs;
    pthread_mutex_unlock(&s->mu);
    ok = ok && tappend(&t,
                       "# HELP kvd_http_connections HTTP connections open now.\n# TYPE kvd_http_connections gauge\n"
                       "kvd_http_connections %llu\n"
                       "# HELP kvd_http_requests_active HTTP requests being answered now.\n"
                       "# TYPE kvd_http_requests_active gauge\nkvd_http_requests_active %u\n"
                       "# HELP kvd_http_memory_bytes Request bodies and their parsed JSON held now.\n"
                       "# TYPE kvd_http_memory_bytes gauge\nkvd_http_memory_bytes %llu\n"
                       "# HELP kvd_http_timeouts_total Connections closed: a request's head and body did not "
                       "arrive in time.\n# TYPE kvd_http_timeouts_total counter\nkvd_http_timeouts_total %llu\n"
                       "# HELP kvd_http_clients_gone_total Requests cancelled because their client went away.\n"
                       "# TYPE kvd_http_clients_gone_total counter\nkvd_http_clients_gone_total %llu\n"
                       "# HELP kvd_http_memory_refused_total Requests refused: bodies held too much memory.\n"
                       "# TYPE kvd_http_memory_refused_total counter\nkvd_http_memory_refused_total %llu\n"
                       "# HELP kvd_http_busy_refused_total Requests refused: as many were being answered as "
                       "--http-max-requests allows.\n# TYPE kvd_http_busy_refused_total counter\n"
                       "kvd_http_busy_refused_total %llu\n",
                       (unsigned long long)atomic_load(&s->n_conns), n_jobs,
                       (unsigned long long)atomic_load(&s->mem), (unsigned long long)atomic_load(&s->timeouts),
                       (unsigned long long)atomic_load(&s->gone), (unsigned long long)atomic_load(&s->mem_refused),
                       (unsigned long long)atomic_load(&s->busy_refused));
    if (!ok) {
        free(t.s);
        job_error(j, 500, "out of memory", NULL, NULL, 0);
        return;
    }
    job_answer(j, 200, t.s, t.len, "text/plain; version=0.0.4", 0);
}

/* ---- the page (web/) and its data ----------------------------------------------------------------- */

static const char *const block_states[] = { "free", "cached", "in_use", "pending", "fenced" };

static json_t *pool_hosts_json(const struct kvd_pool_view *v)
{
    json_t *a = json_array();
    for (size_t i = 0; a != NULL && i < v->n_hosts; i++) {
        const struct kvd_pool_host *h = &v->hosts[i];
        json_t *runs = json_array();
        for (size_t r = 0; runs != NULL && r < h->n_runs; r++)
            json_array_append_new(runs, json_pack("[I, I, I]", (json_int_t)h->runs[r].state,
                                                  (json_int_t)h->runs[r].tenant, (json_int_t)h->runs[r].cells));
        json_array_append_new(a, json_pack("{s:s, s:I, s:I, s:o*}", "name", h->name, "blocks", (json_int_t)h->blocks,
                                           "cell_blocks", (json_int_t)h->cell_blocks, "runs", runs));
    }
    return a;
}

static json_t *pool_prefixes_json(const struct kvd_pool_view *v)
{
    json_t *a = json_array();
    for (size_t i = 0; a != NULL && i < v->n_prefixes; i++) {
        const struct kvd_prefix_node *p = &v->prefixes[i];
        json_array_append_new(a, json_pack("{s:I, s:I, s:I, s:I, s:I, s:b, s:I, s:I, s:s, s:s?}", "parent",
                                           (json_int_t)p->parent, "host", (json_int_t)p->host, "blocks",
                                           (json_int_t)p->blocks, "subtree_blocks", (json_int_t)p->subtree_blocks,
                                           "tenant", (json_int_t)p->tenant, "public", p->is_public, "sharers",
                                           (json_int_t)p->sharers, "hits", (json_int_t)p->hits, "state",
                                           block_states[p->state < 5 ? p->state : 0], "text", p->text));
    }
    return a;
}

static json_t *pool_samples_json(const struct kvd_pool_view *v)
{
    json_t *a = json_array();
    for (size_t i = 0; a != NULL && i < v->n_samples; i++) {
        const struct kvd_pool_sample *x = &v->samples[i];
        json_array_append_new(a, json_pack("{s:I, s:I, s:I, s:I, s:I, s:f}", "prompt_tokens",
                                           (json_int_t)x->prompt_tokens, "cached_prompt_tokens",
                                           (json_int_t)x->cached_prompt_tokens, "completion_tokens",
                                           (json_int_t)x->completion_tokens, "computed_tokens",
                                           (json_int_t)x->computed_tokens, "first_tokens", (json_int_t)x->first_tokens,
                                           "ttft_seconds", x->ttft_seconds));
    }
    return a;
}

/* GET /pool: the pools' picture for the page, as the caller may see it (the
 * operator's key: all of it; a tenant's key: its own blocks and prefixes, the
 * others' blocks by state alone; no key: those of no tenant), with the
 * statistics the page shows. */
#define POOL_FRESH_MS 500.0         /* /pool answers of one viewer are reused this long */

/* A viewer's fresh /pool answer (a copy), or NULL. */
static char *pool_cached(struct http_server *s, const char *viewer, size_t *len)
{
    char *out = NULL;
    const double now = now_ms();
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < sizeof(s->pool_cache) / sizeof(s->pool_cache[0]); i++) {
        const struct pool_cached *c = &s->pool_cache[i];
        if (c->text != NULL && now - c->at < POOL_FRESH_MS && strcmp(c->viewer, viewer) == 0) {
            if ((out = malloc(c->len + 1)) != NULL) {
                memcpy(out, c->text, c->len + 1);
                *len = c->len;
            }
            break;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return out;
}

/* Keeps a copy of a viewer's answer in place of the oldest one kept. */
static void pool_keep(struct http_server *s, const char *viewer, const char *text, size_t len)
{
    char *copy = malloc(len + 1);
    if (copy == NULL)
        return;
    memcpy(copy, text, len + 1);
    pthread_mutex_lock(&s->mu);
    struct pool_cached *old = &s->pool_cache[0];
    for (size_t i = 0; i < sizeof(s->pool_cache) / sizeof(s->pool_cache[0]); i++) {
        struct pool_cached *c = &s->pool_cache[i];
        if (strcmp(c->viewer, viewer) == 0 || c->text == NULL) {
            old = c;
            break;
        }
        if (c->at < old->at)
            old = c;
    }
    free(old->text);
    snprintf(old->viewer, sizeof(old->viewer), "%s", viewer);
    old->at = now_ms();
    old->text = copy;
    old->len = len;
    pthread_mutex_unlock(&s->mu);
}

static void work_pool(struct job *j, kvd_client_t *kc)
{
    /* each answer walks every block on kvd's loop: pages polling at once
     * share one walk a viewer every POOL_FRESH_MS */
    char viewer[80];
    snprintf(viewer, sizeof(viewer), "%s%.70s", j->operator ? "o" : j->tenant != NULL ? "t:" : "a",
             !j->operator && j->tenant != NULL ? j->tenant : "");
    size_t clen = 0;
    char *cached = pool_cached(j->s, viewer, &clen);
    if (cached != NULL) {
        job_answer(j, 200, cached, clen, "application/json", 0);
        return;
    }
    kvd_client_set_timeout(kc, 5000);
    struct kvd_stats st;
    struct kvd_pool_view v;
    const char *as = j->operator ? NULL : j->tenant != NULL ? j->tenant : "";
    if (kvd_pool_view(kc, as, &st, &v) != 0) {
        kvd_stats_free(&st);
        kvd_pool_view_free(&v);
        job_error(j, 503, "kvd does not answer", NULL, NULL, 0);
        return;
    }
    json_t *tenants = json_array(), *rows = json_array(), *workers = json_array(), *states = json_array();
    for (size_t i = 0; tenants != NULL && i < v.n_tenants; i++)
        json_array_append_new(tenants, json_string(v.tenants[i]));
    for (uint32_t i = 0; rows != NULL && i < st.n_tenants; i++) {
        const struct kvd_tenant_stats *t = &st.tenants[i];
        if (!j->operator && (j->tenant == NULL || strcmp(t->name, j->tenant) != 0))
            continue;
        json_array_append_new(rows, json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I}", "name", t->name, "requests",
                                              (json_int_t)t->requests, "prompt_tokens", (json_int_t)t->prompt_tokens,
                                              "cached_prompt_tokens", (json_int_t)t->cached_prompt_tokens,
                                              "blocks_held", (json_int_t)t->blocks_held, "queued",
                                              (json_int_t)t->queued, "running", (json_int_t)t->running));
    }
    for (uint32_t i = 0; workers != NULL && i < st.n_workers; i++)
        json_array_append_new(workers, json_pack("{s:I, s:b, s:I, s:I, s:s}", "id", (json_int_t)st.workers[i].id,
                                                 "alive", st.workers[i].alive, "running",
                                                 (json_int_t)st.workers[i].running, "tokens",
                                                 (json_int_t)st.workers[i].tokens, "host", st.workers[i].host));
    for (size_t i = 0; states != NULL && i < sizeof(block_states) / sizeof(block_states[0]); i++)
        json_array_append_new(states, json_string(block_states[i]));
    json_t *totals = json_pack(
        "{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "requests_running",
        (json_int_t)st.requests_running, "requests_queued", (json_int_t)st.requests_queued, "requests_done",
        (json_int_t)st.requests_done, "prompt_tokens", (json_int_t)st.prompt_tokens, "cached_prompt_tokens",
        (json_int_t)st.cached_prompt_tokens, "completion_tokens", (json_int_t)st.completion_tokens, "blocks_total",
        (json_int_t)st.blocks_total, "blocks_free", (json_int_t)st.blocks_free, "blocks_cached",
        (json_int_t)st.blocks_cached, "blocks_in_use", (json_int_t)st.blocks_in_use, "blocks_pending",
        (json_int_t)st.blocks_pending, "evictions", (json_int_t)st.evictions, "preemptions",
        (json_int_t)st.preemptions, "requests_failed", (json_int_t)st.requests_failed);
    json_t *tiers = json_pack(
        "{s:{s:I, s:I, s:I, s:I, s:I, s:I}, s:{s:I, s:I, s:I, s:I, s:I, s:I}}", "host", "max_bytes",
        (json_int_t)st.host_cache_max_bytes, "bytes", (json_int_t)st.host_cache_bytes, "blocks",
        (json_int_t)st.host_cache_blocks, "stored", (json_int_t)st.host_cache_stored, "dropped",
        (json_int_t)st.host_cache_dropped, "cached_prompt_tokens", (json_int_t)st.host_cached_prompt_tokens, "disk",
        "max_bytes", (json_int_t)st.disk_cache_max_bytes, "bytes", (json_int_t)st.disk_cache_bytes, "blocks",
        (json_int_t)st.disk_cache_blocks, "written", (json_int_t)st.disk_cache_written, "pending",
        (json_int_t)st.disk_cache_pending, "cached_prompt_tokens", (json_int_t)st.disk_cached_prompt_tokens);
    json_t *o = json_pack("{s:s, s:s, s:s?, s:I, s:I, s:s, s:o*, s:o*, s:I, s:o*, s:o*, s:o*, s:o*, s:o*, s:o*, s:o*}",
                          "model", j->s->model_id, "viewer",
                          j->operator ? "operator" : j->tenant != NULL ? "tenant" : "anonymous", "tenant", j->tenant,
                          "block_tokens", (json_int_t)st.block_tokens, "block_bytes", (json_int_t)st.block_bytes,
                          "kv_type", st.kv_type, "states", states, "tenants", tenants, "hidden_tenant",
                          (json_int_t)v.hidden_tenant, "hosts", pool_hosts_json(&v), "prefixes",
                          pool_prefixes_json(&v), "samples", pool_samples_json(&v), "totals", totals, "tiers", tiers,
                          "tenant_rows", rows, "workers", workers);
    kvd_stats_free(&st);
    kvd_pool_view_free(&v);
    size_t len = 0;
    char *text = o != NULL ? json_text(o, &len) : NULL;
    if (text == NULL) {
        job_error(j, 500, "out of memory", NULL, NULL, 0);
        return;
    }
    pool_keep(j->s, viewer, text, len);
    job_answer(j, 200, text, len, "application/json", 0);
}

/* The page's file at url, or NULL. */
static const struct web_asset *page_asset(const char *url)
{
    for (const struct web_asset *a = web_assets; a->path != NULL; a++)
        if (strcmp(a->path, url) == 0)
            return a;
    return NULL;
}

/* Serves one of the page's files: public, whatever the keys (the data it
 * shows comes from /pool and the API, which need them), under a policy that
 * lets it load nothing but this server's own scripts, styles and data. */
static enum MHD_Result queue_page(struct http_server *s, struct MHD_Connection *c, const struct web_asset *a)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(a->len, (void *)a->data, MHD_RESPMEM_PERSISTENT);
    if (r == NULL)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", a->type);
    MHD_add_response_header(r, "Content-Security-Policy",
                            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                            "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'");
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    const enum MHD_Result ok = MHD_queue_response(c, 200, r);
    MHD_destroy_response(r);
    count_status(s, 200);
    return ok;
}

/* ---- the cache management API (/v1/cache) ------------------------------------------------------- */

/* An error of a cache call: a pin the caller does not have is a 404. */
static void cache_error(struct job *j, int rc, const char *err)
{
    if (rc == KVD_ENOTFOUND) {
        job_error(j, 404, "no such pin", NULL, "pin_not_found", 0);
        return;
    }
    const char *code;
    const unsigned status = status_of(rc, &code);
    job_error(j, status, err[0] ? err : kvd_strerror(rc), NULL, code, 0);
}

/* POST /v1/cache: {"messages" | "prompt", "ttl", "namespace", "model"}: the
 * prompt is computed into the cache (a warm-up, nothing generated) and its
 * prefix pinned: up to the last message with a cache_control mark, else the
 * whole prompt. The pin, the prompt's cached blocks and the usage; a pin that
 * could not be taken is a 503 (its prefix was being computed by another
 * request: retry). */
static void cache_pin(struct job *j, kvd_client_t *kc)
{
    static const char *const keys[] = { "model", "messages", "prompt", "ttl", "namespace", NULL };
    json_t *o = NULL;
    if (!job_parse(j, &o))
        return;
    struct bad b = { "", NULL };
    struct kvd_gen_params gp;
    kvd_gen_params_init(&gp);
    struct kvd_chat_msg *msgs = NULL;
    char ns[256];
    uint32_t ttl = 0, upto = 0;
    unsigned status = 400;
    int bad_rc = 0;
    tl_acct = &j->acct;
    if (!json_is_object(o)) {
        bad_rc = bad(&b, NULL, "the body must be a JSON object");
        goto out;
    }
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        const char *const *k = keys;
        while (*k != NULL && strcmp(*k, key) != 0)
            k++;
        if (*k == NULL) {
            bad_rc = bad(&b, key, "unsupported field '%.64s' in a pin request", key);
            goto out;
        }
    }
    if ((bad_rc = check_model(o, j->s, &b, &status)) != 0)
        goto out;
    json_t *m = json_object_get(o, "messages"), *p = json_object_get(o, "prompt");
    if ((m != NULL) == (p != NULL)) {
        bad_rc = bad(&b, "messages", "give 'messages' or 'prompt'");
        goto out;
    }
    if (p != NULL) {
        if (!json_is_string(p) || json_string_length(p) == 0) {
            bad_rc = bad(&b, "prompt", "'prompt' must be a non-empty string");
            goto out;
        }
        gp.prompt = json_string_value(p);
    } else {
        if (!json_is_array(m) || json_array_size(m) == 0 || json_array_size(m) > 1024 ||
            (msgs = calloc(json_array_size(m), sizeof(*msgs))) == NULL) {
            bad_rc = bad(&b, "messages", "'messages' must be a non-empty array (at most 1,024)");
            goto out;
        }
        size_t i;
        json_t *msg;
        json_array_foreach(m, i, msg) {
            const char *role = json_string_value(json_object_get(msg, "role"));
            if (!json_is_object(msg) || role == NULL) {
                bad_rc = bad(&b, "messages", "every message needs a 'role' string");
                goto out;
            }
            if ((bad_rc = check_message_fields(msg, &b)) != 0)
                goto out;
            const char *text = content_text(msg, &b);
            if (text == NULL) {
                bad_rc = -1;
                goto out;
            }
            msgs[i] = (struct kvd_chat_msg){ strcmp(role, "developer") == 0 ? "system" : role, text };
        }
        gp.messages = msgs;
        gp.n_messages = json_array_size(m);
        if ((bad_rc = parse_cache_control(m, &ttl, &upto, &b)) != 0)
            goto out;
    }
    json_t *tv = json_object_get(o, "ttl");
    uint32_t t = ttl ? ttl : PIN_TTL_DEFAULT_S;
    if (tv != NULL && !json_is_null(tv) && (bad_rc = ttl_of(tv, true, "ttl", &t, &b)) != 0)
        goto out;
    if (ttl != 0 && t != ttl) {
        bad_rc = bad(&b, "ttl", "'ttl' differs from the messages' cache_control ttl");
        goto out;
    }
    if ((bad_rc = request_ns(o, j->tenant, ns, sizeof(ns), &b)) != 0)
        goto out;
    gp.ns = ns[0] ? ns : NULL;
    gp.prefill_only = true;
    gp.pin_ttl_s = t;
    gp.pin_messages = upto;
out:
    tl_acct = NULL;
    if (bad_rc != 0) {
        job_error(j, status, b.msg, b.param, status == 404 ? "model_not_found" : NULL, 0);
    } else {
        struct kvd_result res;
        memset(&res, 0, sizeof(res));
        const int rc = kvd_generate(kc, &gp, &res);
        if (rc != 0 && job_aborted(j))
            job_gone(j);
        else if (rc != 0)
            job_kvd_error(j, rc, &res);
        else if (!res.has_pin)
            job_error(j, 503, res.pin_error[0] ? res.pin_error : "not pinned", NULL, "pin_not_taken", 1);
        else
            job_json(j, 200, json_pack("{s:o, s:I, s:o}", "pin", pin_json(&res.pin, j->tenant), "blocks",
                                       (json_int_t)res.cached_blocks, "usage",
                                       usage_json(res.prompt_tokens, 0, res.cached_prompt_tokens,
                                                  res.cache_creation_tokens)), 0);
        kvd_result_free(&res);
    }
    free(msgs);
    json_decref(o);
}

/* Whether pin id belongs to no tenant (what a client without an API key may
 * touch: pins of its namespaces, never a tenant's). */
static int anonymous_pin(kvd_client_t *kc, const char *id, bool *ok, char *err, size_t errlen)
{
    struct kvd_pin *pins = NULL;
    size_t n = 0;
    *ok = false;
    const int rc = kvd_cache_list(kc, NULL, &pins, &n, err, errlen);
    for (size_t i = 0; rc == 0 && i < n; i++)
        if (strcmp(pins[i].id, id) == 0 && pins[i].tenant[0] == '\0')
            *ok = true;
    free(pins);
    return rc;
}

/* /v1/cache: the pins of the API key's tenant (without keys, the pins of no
 * tenant), listed, made, unpinned or evicted. kvd scopes the calls to the
 * tenant's namespace, so another tenant's pin is a 404 like one that never
 * was. */
static void work_cache(struct job *j, kvd_client_t *kc)
{
    char scope[160], err[256] = "";
    if (j->tenant != NULL)
        snprintf(scope, sizeof(scope), "tenant:%s", j->tenant);
    const char *ns = j->tenant != NULL ? scope : NULL;
    int rc = 0;
    if (j->route == R_CACHE_PIN) {
        cache_pin(j, kc);
        return;
    }
    if (j->route == R_CACHE_LIST) {
        struct kvd_pin *pins = NULL;
        size_t n = 0;
        if ((rc = kvd_cache_list(kc, ns, &pins, &n, err, sizeof(err))) != 0) {
            cache_error(j, rc, err);
            return;
        }
        json_t *data = json_array();
        for (size_t i = 0; i < n; i++)
            if (ns != NULL || pins[i].tenant[0] == '\0')
                json_array_append_new(data, pin_json(&pins[i], j->tenant));
        free(pins);
        job_json(j, 200, json_pack("{s:s, s:o}", "object", "list", "data", data), 0);
        return;
    }
    bool ok = true;
    if (ns == NULL && (rc = anonymous_pin(kc, j->pin_id, &ok, err, sizeof(err))) != 0) {
        cache_error(j, rc, err);
        return;
    }
    if (!ok || j->pin_id[0] == '\0') {
        cache_error(j, KVD_ENOTFOUND, err);
        return;
    }
    struct kvd_pin gone;
    uint32_t blocks = 0;
    const bool evict = j->route == R_CACHE_EVICT;
    rc = evict ? kvd_cache_evict(kc, ns, j->pin_id, &gone, &blocks, err, sizeof(err))
               : kvd_cache_unpin(kc, ns, j->pin_id, &gone, err, sizeof(err));
    if (rc != 0) {
        cache_error(j, rc, err);
        return;
    }
    json_t *o = json_pack("{s:s, s:s, s:b}", "id", gone.id, "object", "cache.pin", "deleted", 1);
    if (evict)
        json_object_set_new(o, "evicted_blocks", json_integer(blocks));
    job_json(j, 200, o, 0);
}

/* A job's thread: the work, then the connection woken for the answer. */
static void *job_main(void *arg)
{
    struct job *j = arg;
    struct http_server *s = j->s;
    char err[256];
    kvd_client_t *kc = client_take(s, err, sizeof(err));
    if (kc == NULL) {
        job_error(j, 503, err, NULL, NULL, 0);
    } else {
        kvd_client_set_abort_fd(kc, j->epfd);
        switch (j->route) {
        case R_CHAT: case R_COMPLETIONS: work_completion(j, kc); break;
        case R_RESPONSES: work_responses(j, kc); break;
        case R_TOKENIZE: case R_DETOKENIZE: work_tokens(j, kc); break;
        case R_HEALTH: case R_READY: work_health(j, kc, j->route == R_READY); break;
        case R_METRICS: work_metrics(j, kc); break;
        case R_POOL: work_pool(j, kc); break;
        case R_CACHE_LIST: case R_CACHE_PIN: case R_CACHE_UNPIN: case R_CACHE_EVICT: work_cache(j, kc); break;
        default: job_error(j, 500, "no such work", NULL, NULL, 0); break;
        }
    }
    client_give(s, &kc);
    const bool big = j->acct.cap > 0 && j->acct.used == 0 && j->len > (1u << 20);
    pthread_mutex_lock(&j->mu);
    j->done = true;
    job_wake_locked(j);
    pthread_mutex_unlock(&j->mu);
#ifdef __GLIBC__
    if (big)
        malloc_trim(0);     /* a large body's JSON: its pages go back */
#endif
    pthread_mutex_lock(&s->mu);
    if (j->prev)
        j->prev->next = j->next;
    else
        s->jobs = j->next;
    if (j->next)
        j->next->prev = j->prev;
    s->n_jobs--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    job_put(j);
    return NULL;
}

/* ---- API keys ----------------------------------------------------------------------------------- */

/* Whether "Bearer KEY" carries key want: compared in full, in time that
 * depends on the lengths only. */
static bool key_matches(const char *auth, const char *want)
{
    if (auth == NULL || strncasecmp(auth, "Bearer ", 7) != 0)
        return false;
    const char *key = auth + 7;
    const size_t kl = strlen(key), l = strlen(want);
    unsigned diff = (unsigned)(l != kl);
    for (size_t i = 0; i < l; i++)
        diff |= (unsigned char)want[i] ^ (unsigned char)(i < kl ? key[i] : 0);
    return diff == 0;
}

/* The tenant of "Bearer KEY", or NULL. Every key is compared. */
static const char *authorize(const struct http_server *s, const char *auth)
{
    const char *found = NULL;
    for (size_t i = 0; i < s->n_keys; i++)
        if (key_matches(auth, s->keys[i].key) && found == NULL)
            found = s->keys[i].tenant;
    return found;
}

/* A tenant's name as kvd keys it: 1-64 of [A-Za-z0-9._-] (a '/' would put it
 * inside another tenant's namespace). */
static bool tenant_ok(const char *t)
{
    const size_t n = strlen(t);
    if (n == 0 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((t[i] >= 'a' && t[i] <= 'z') || (t[i] >= 'A' && t[i] <= 'Z') || (t[i] >= '0' && t[i] <= '9') ||
              t[i] == '.' || t[i] == '_' || t[i] == '-'))
            return false;
    return true;
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
        if (sscanf(p, "%511s %511s %7s", key, tenant, extra) != 2 || strlen(key) < 8 || !tenant_ok(tenant)) {
            snprintf(err, errlen, "--api-keys %s:%d: want KEY TENANT (a key of 8 or more characters, a tenant "
                     "of 1-64 letters, digits, '.', '_' or '-')", path, lineno);
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

/* --operator-key FILE: its first line, at least 16 characters. */
static int load_operator_key(http_server_t *s, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "r");
    char line[1024];
    if (f == NULL) {
        snprintf(err, errlen, "--operator-key %s: %s", path, strerror(errno));
        return -1;
    }
    const bool got = fgets(line, sizeof(line), f) != NULL;
    fclose(f);
    line[got ? strcspn(line, "\r\n") : 0] = '\0';
    if (strlen(line) < 16 || strchr(line, ' ') != NULL) {
        snprintf(err, errlen, "--operator-key %s: want the key on the first line (16 or more characters, no "
                 "spaces)", path);
        return -1;
    }
    s->operator_key = strdup(line);
    return s->operator_key ? 0 : -1;
}

/* ---- libmicrohttpd's callbacks ------------------------------------------------------------------ */

/* One request, from its head to its end (libmicrohttpd's con_cls). */
struct req {
    enum route route;
    const struct web_asset *asset;  /* R_PAGE: the file */
    char pin_id[PIN_ID_MAX];    /* /v1/cache/{id}: the pin */
    const char *tenant;         /* its API key's tenant */
    bool operator;              /* it came with the operator's key */
    char *body;                 /* what came of its body, NUL-terminated */
    size_t len, cap;
    uint64_t charged;           /* bytes of the memory budget it holds */
    uint64_t src;               /* its connection's source, charged the same */
    unsigned refuse;            /* decided from the head or while the body came: answered at its end */
    const char *refuse_code;    /* OpenAI's error code for it */
    unsigned refuse_retry;      /* Retry-After */
    char refuse_msg[300];
    struct job *job;            /* once its job runs */
};

/* Queues text (malloc'd, taken) as the answer; counted by status unless its
 * client is known to be gone. */
static enum MHD_Result queue_text(struct http_server *s, struct MHD_Connection *c, unsigned status, const char *type,
                                  char *text, size_t len, unsigned retry_after_s, bool counted_status)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (r == NULL) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");   /* answers are the caller's alone */
    if (retry_after_s > 0) {
        char ra[16];
        snprintf(ra, sizeof(ra), "%u", retry_after_s);
        MHD_add_response_header(r, "Retry-After", ra);
    }
    const enum MHD_Result ok = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    if (counted_status)
        count_status(s, status);
    return ok;
}

static enum MHD_Result queue_error(struct http_server *s, struct MHD_Connection *c, unsigned status,
                                   const char *message, const char *code, unsigned retry_after_s)
{
    size_t len = 0;
    char *text = json_text(error_json(message, error_type(status), NULL, code), &len);
    return text ? queue_text(s, c, status, "application/json", text, len, retry_after_s, true) : MHD_NO;
}

static struct conn *conn_of(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci != NULL ? ci->socket_context : NULL;
}

/* Marks a connection's request as in (busy: no deadline) or answered. */
static void conn_busy(struct http_server *s, struct MHD_Connection *c, bool busy)
{
    struct conn *cn = conn_of(c);
    if (cn == NULL)
        return;
    pthread_mutex_lock(&s->mu);
    cn->busy = busy;
    if (!busy)
        cn->since = now_ms();
    pthread_mutex_unlock(&s->mu);
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    struct http_server *s = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        struct conn *cn = calloc(1, sizeof(*cn));
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (cn == NULL || ci == NULL) {
            free(cn);
            return;
        }
        cn->fd = ci->connect_fd;
        cn->since = now_ms();
        const union MHD_ConnectionInfo *ai = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        cn->src = src_key(ai != NULL ? ai->client_addr : NULL);
        pthread_mutex_lock(&s->mu);
        struct src *e = src_slot_locked(s, cn->src);
        if (e != NULL) {
            e->key = cn->src;
            e->conns++;
        }
        cn->next = s->conns;
        if (s->conns)
            s->conns->prev = cn;
        s->conns = cn;
        pthread_mutex_unlock(&s->mu);
        atomic_fetch_add(&s->n_conns, 1);
        *socket_context = cn;
    } else if (*socket_context != NULL) {
        /* before libmicrohttpd closes the socket: the sweeper never touches a
         * descriptor that is closed (or another's) */
        struct conn *cn = *socket_context;
        pthread_mutex_lock(&s->mu);
        struct src *e = src_slot_locked(s, cn->src);
        if (e != NULL && e->key == cn->src) {
            e->conns--;
            src_release_locked(s, e);
        }
        if (cn->prev)
            cn->prev->next = cn->next;
        else
            s->conns = cn->next;
        if (cn->next)
            cn->next->prev = cn->prev;
        pthread_mutex_unlock(&s->mu);
        atomic_fetch_sub(&s->n_conns, 1);
        free(cn);
        *socket_context = NULL;
    }
}

/* A new connection: refused when its source has --http-max-conns-per-ip. */
static enum MHD_Result accept_policy(void *cls, const struct sockaddr *addr, socklen_t addrlen)
{
    struct http_server *s = cls;
    (void)addrlen;
    const uint64_t key = src_key(addr);
    pthread_mutex_lock(&s->mu);
    const struct src *e = src_slot_locked(s, key);
    const bool ok = e != NULL && (e->key != key || e->conns < s->p.max_conns_per_ip);
    pthread_mutex_unlock(&s->mu);
    return ok ? MHD_YES : MHD_NO;
}

/* The route of a method and path: R_NONE with *status 404 or 405. */
/* The routes of the cache management API: GET /v1/cache (list), POST
 * /v1/cache (pin), DELETE /v1/cache/{id} (unpin), POST /v1/cache/{id}/evict. */
static enum route cache_route(const char *method, const char *url, unsigned *status)
{
    const char *id = url[9] == '/' ? url + 10 : NULL;
    const char *slash = id ? strchr(id, '/') : NULL;
    enum route r = R_NONE;
    const char *want = NULL;
    if (id == NULL || *id == '\0') {
        r = strcmp(method, "GET") == 0 ? R_CACHE_LIST : strcmp(method, "POST") == 0 ? R_CACHE_PIN : R_NONE;
        want = "GET or POST";
    } else if (slash == NULL) {
        r = strcmp(method, "DELETE") == 0 ? R_CACHE_UNPIN : R_NONE;
        want = "DELETE";
    } else if (strcmp(slash, "/evict") == 0) {
        r = strcmp(method, "POST") == 0 ? R_CACHE_EVICT : R_NONE;
        want = "POST";
    }
    if (r == R_NONE)
        *status = want ? 405 : 404;
    return r;
}

/* The pin id of /v1/cache/{id}[/evict] into id (PIN_ID_MAX bytes); "" when
 * none or too long (no pin has such an id: a 404 from kvd). */
static void cache_pin_id(const char *url, char *id)
{
    id[0] = '\0';
    if (strncmp(url, "/v1/cache/", 10) != 0)
        return;
    const size_t n = strcspn(url + 10, "/");
    if (n < PIN_ID_MAX)
        snprintf(id, PIN_ID_MAX, "%.*s", (int)n, url + 10);
}

static enum route route_of(const char *method, const char *url, unsigned *status)
{
    static const struct {
        const char *path;
        bool post;
        enum route r;
    } routes[] = {
        { "/v1/chat/completions", true, R_CHAT }, { "/v1/completions", true, R_COMPLETIONS },
        { "/v1/responses", true, R_RESPONSES },
        { "/tokenize", true, R_TOKENIZE }, { "/detokenize", true, R_DETOKENIZE },
        { "/health", false, R_HEALTH }, { "/ready", false, R_READY }, { "/v1/models", false, R_MODELS },
        { "/metrics", false, R_METRICS }, { "/pool", false, R_POOL },
        { "/tokenizer_info", false, R_TOKENIZER_INFO },
    };
    if (page_asset(url) != NULL) {
        if (strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0)
            return R_PAGE;
        *status = 405;
        return R_NONE;
    }
    if (strncmp(url, "/v1/cache", 9) == 0 && (url[9] == '\0' || url[9] == '/'))
        return cache_route(method, url, status);
    const bool model = strncmp(url, "/v1/models/", 11) == 0 && url[11] != '\0';     /* GET /v1/models/{id} */
    if (model && strcmp(method, "GET") == 0)
        return R_MODEL;
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++)
        if (model || strcmp(url, routes[i].path) == 0) {
            if (strcmp(method, routes[i].post ? "POST" : "GET") == 0)
                return routes[i].r;
            *status = 405;
            return R_NONE;
        }
    *status = 404;
    return R_NONE;
}

/* A request refused from its head: answered now when its client waits for a
 * 100 Continue (it sends no body), else once the body it sends anyway has
 * been read and dropped (a response queued earlier closes the connection on
 * a client still sending, which often loses the answer). Nothing of the body
 * is kept either way. */
static enum MHD_Result refuse(struct http_server *s, struct MHD_Connection *c, void **con_cls, unsigned status,
                              const char *msg, const char *code, unsigned retry_after_s)
{
    const char *expect = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Expect");
    struct req *q = expect == NULL ? calloc(1, sizeof(*q)) : NULL;
    if (q == NULL)
        return queue_error(s, c, status, msg, code, retry_after_s);
    q->refuse = status;
    q->refuse_code = code;
    q->refuse_retry = retry_after_s;
    snprintf(q->refuse_msg, sizeof(q->refuse_msg), "%s", msg);
    *con_cls = q;
    return MHD_YES;
}

/* Whether a Host header names this machine's loopback: "localhost",
 * 127.x.y.z or [::1], with or without a port. A page on another site that
 * got its name to resolve to 127.0.0.1 (DNS rebinding) sends its own name. */
static bool host_is_loopback(const char *h)
{
    char name[64];
    size_t n = strlen(h);
    if (n == 0 || n >= sizeof(name))
        return false;
    memcpy(name, h, n + 1);
    char *colon = name[0] == '[' ? strstr(name, "]:") : strrchr(name, ':');
    if (colon != NULL) {
        const char *port = colon + (name[0] == '[' ? 2 : 1);
        if (*port == '\0' || strspn(port, "0123456789") != strlen(port))
            return false;
        colon[name[0] == '[' ? 1 : 0] = '\0';
    }
    if (strcasecmp(name, "localhost") == 0 || strcmp(name, "[::1]") == 0)
        return true;
    struct in_addr a;
    return inet_pton(AF_INET, name, &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

/* The first call for a request, its head in: the route, the key, the body's
 * declared size, all decided before a byte of the body is kept. */
static enum MHD_Result begin(struct http_server *s, struct MHD_Connection *c, const char *url, const char *method,
                             void **con_cls)
{
    unsigned status = 0;
    const enum route route = route_of(method, url, &status);
    char msg[300];
    if (route == R_NONE) {
        snprintf(msg, sizeof(msg), status == 405 ? "use %s for %.200s" : "no route %s %.200s",
                 status == 405 ? (strcmp(method, "GET") == 0 ? "POST" : "GET") : method, url);
        return refuse(s, c, con_cls, status, msg, NULL, 0);
    }
    /* a server on loopback answers only requests addressed to loopback (a web
     * page elsewhere that rebinds its name to 127.0.0.1 cannot use it) */
    const char *host = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host");
    if (s->loopback && host != NULL && !host_is_loopback(host))
        return refuse(s, c, con_cls, 403, "this server answers requests for localhost only (Host)", NULL, 0);
    const char *auth = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    const char *tenant = s->keys != NULL && auth != NULL ? authorize(s, auth) : NULL;
    const bool operator = s->operator_key != NULL && key_matches(auth, s->operator_key);
    /* with API keys, the API needs one; the probes and /metrics stay open */
    if (s->keys != NULL && tenant == NULL && route != R_HEALTH && route != R_READY && route != R_METRICS &&
        route != R_PAGE && !(route == R_POOL && operator))
        return refuse(s, c, con_cls, 401, "a valid API key is needed (Authorization: Bearer KEY)", "invalid_api_key",
                      0);
    if (route == R_MODEL && strcmp(url + 11, s->model_id) != 0) {
        snprintf(msg, sizeof(msg), "the model '%.120s' does not exist; this server serves '%.60s'", url + 11,
                 s->model_id);
        return refuse(s, c, con_cls, 404, msg, "model_not_found", 0);
    }
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
    const unsigned long long declared = cl != NULL ? strtoull(cl, NULL, 10) : 0;
    if (declared > s->p.max_body) {
        snprintf(msg, sizeof(msg), "the body is over the limit of %u bytes", s->p.max_body);
        return refuse(s, c, con_cls, 413, msg, NULL, 0);
    }
    if (route == R_CHAT || route == R_COMPLETIONS || route == R_RESPONSES || route == R_TOKENIZE ||
        route == R_DETOKENIZE || route == R_CACHE_PIN) {
        /* required: a cross-site page can post a body without one (a Blob)
         * and without asking first, but cannot post this type so */
        const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Type");
        if (ct == NULL || strncasecmp(ct, "application/json", 16) != 0)
            return refuse(s, c, con_cls, 415, "the body must be JSON (Content-Type: application/json)", NULL, 0);
    }
    /* a declared body takes its memory now, so that bodies that would not fit
     * are refused before they are sent */
    const struct conn *cn = conn_of(c);
    const uint64_t src = cn != NULL ? cn->src : 1;
    if (declared > 0 && !body_take(s, src, declared + 1))
        return refuse(s, c, con_cls, 503, "the HTTP layer holds as many request bodies as it may, in all or "
                      "from this client (--http-max-memory): retry later", NULL, 1);
    struct req *q = calloc(1, sizeof(*q));
    if (q == NULL || (declared > 0 && (q->body = malloc(declared + 1)) == NULL)) {
        if (declared > 0)
            body_give(s, src, declared + 1);
        free(q);
        return MHD_NO;
    }
    q->src = src;
    q->route = route;
    q->asset = route == R_PAGE ? page_asset(url) : NULL;
    cache_pin_id(url, q->pin_id);
    q->tenant = tenant;
    q->operator = operator;
    q->charged = q->cap = declared > 0 ? declared + 1 : 0;
    *con_cls = q;
    return MHD_YES;
}

/* A piece of the body: kept within the limits (past one, the rest is read and
 * dropped, and the request answered with its status at the end). */
static void gather(struct http_server *s, struct req *q, const char *data, size_t n)
{
    if (q->refuse != 0)
        return;
    if (q->len + n > s->p.max_body) {
        q->refuse = 413;
        snprintf(q->refuse_msg, sizeof(q->refuse_msg), "the body is over the limit of %u bytes", s->p.max_body);
    } else if (q->len + n + 1 > q->cap) {
        const size_t cap = q->len + n + 1 > 2 * q->cap ? q->len + n + 1 : 2 * q->cap;
        char *b = NULL;
        if (body_take(s, q->src, cap - q->cap) && (b = realloc(q->body, cap)) == NULL)
            body_give(s, q->src, cap - q->cap);
        if (b == NULL) {
            q->refuse = 503;
            q->refuse_retry = 1;
            snprintf(q->refuse_msg, sizeof(q->refuse_msg), "the HTTP layer holds as many request bodies as it "
                     "may (--http-max-memory): retry later");
        } else {
            q->charged += cap - q->cap;
            q->body = b;
            q->cap = cap;
        }
    }
    if (q->refuse != 0) {
        free(q->body);
        q->body = NULL;
        body_give(s, q->src, q->charged);
        q->charged = 0;
        q->len = q->cap = 0;
        return;
    }
    memcpy(q->body + q->len, data, n);
    q->len += n;
    q->body[q->len] = '\0';
}

/* The request is in: answered now, or handed to a job while its connection
 * waits. */
static enum MHD_Result complete(struct http_server *s, struct MHD_Connection *c, struct req *q)
{
    conn_busy(s, c, true);
    if (q->refuse != 0)
        return queue_error(s, c, q->refuse, q->refuse_msg, q->refuse_code, q->refuse_retry);
    if (q->route == R_PAGE)
        return queue_page(s, c, q->asset);
    if (q->route == R_MODELS || q->route == R_MODEL) {
        json_t *m = json_pack("{s:s, s:s, s:I, s:s, s:s}", "id", s->model_id, "object", "model", "created",
                              (json_int_t)s->created, "owned_by", "kvd", "root", s->model_id);
        size_t len = 0;
        char *text = json_text(q->route == R_MODEL ? m : json_pack("{s:s, s:[o]}", "object", "list", "data", m),
                               &len);
        return text ? queue_text(s, c, 200, "application/json", text, len, 0, true) : MHD_NO;
    }
    if (q->route == R_TOKENIZER_INFO) {
        if (s->tokenizer_info == NULL)
            return queue_error(s, c, 404, "kvd was started without the tokenizer's facts", NULL, 0);
        char *text = malloc(s->tokenizer_info_len + 1);
        if (text == NULL)
            return MHD_NO;
        memcpy(text, s->tokenizer_info, s->tokenizer_info_len + 1);
        return queue_text(s, c, 200, "application/json", text, s->tokenizer_info_len, 0, true);
    }
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    struct job *j = calloc(1, sizeof(*j));
    if (j == NULL || ci == NULL) {
        free(j);
        return MHD_NO;
    }
    j->s = s;
    j->c = c;
    j->route = q->route;
    memcpy(j->pin_id, q->pin_id, sizeof(j->pin_id));
    j->tenant = q->tenant;
    j->operator = q->operator;
    j->body = q->body;
    j->len = q->len;
    j->charged = q->charged;
    j->src = q->src;
    q->body = NULL;
    q->charged = 0;
    pthread_mutex_init(&j->mu, NULL);
    atomic_store(&j->refs, 2);      /* the thread's and the request's */
    j->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    j->epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = { .events = EPOLLIN, .data.fd = j->efd };
    struct epoll_event hup = { .events = EPOLLRDHUP, .data.fd = ci->connect_fd };
    bool ok = j->efd >= 0 && j->epfd >= 0 && epoll_ctl(j->epfd, EPOLL_CTL_ADD, j->efd, &ev) == 0 &&
              epoll_ctl(j->epfd, EPOLL_CTL_ADD, ci->connect_fd, &hup) == 0;
    pthread_mutex_lock(&s->mu);
    const bool busy = s->n_jobs >= s->p.max_requests, stopping = s->stopping;
    if (ok && !busy && !stopping) {
        j->next = s->jobs;
        if (s->jobs)
            s->jobs->prev = j;
        s->jobs = j;
        s->n_jobs++;
    }
    pthread_mutex_unlock(&s->mu);
    if (!ok || busy || stopping) {
        atomic_store(&j->refs, 1);
        job_put(j);
        if (busy)
            atomic_fetch_add(&s->busy_refused, 1);
        return queue_error(s, c, 503, stopping ? "kvd is shutting down"
                                     : busy   ? "as many requests are being answered as --http-max-requests allows: "
                                                "retry later"
                                              : "no descriptors for the request", NULL, stopping ? 0 : 1);
    }
    q->job = j;
    pthread_mutex_lock(&j->mu);
    j->suspended = true;
    MHD_suspend_connection(c);
    pthread_mutex_unlock(&j->mu);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, JOB_STACK);
    pthread_t t;
    if (pthread_create(&t, &at, job_main, j) != 0) {
        /* as if it ran and failed: unlisted, the connection woken for the 503 */
        job_error(j, 503, "no thread for the request", NULL, NULL, 1);
        pthread_mutex_lock(&s->mu);
        if (j->prev)
            j->prev->next = j->next;
        else
            s->jobs = j->next;
        if (j->next)
            j->next->prev = j->prev;
        s->n_jobs--;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_mutex_lock(&j->mu);
        j->done = true;
        job_wake_locked(j);
        pthread_mutex_unlock(&j->mu);
        job_put(j);
    }
    pthread_attr_destroy(&at);
    return MHD_YES;
}

/* A stream's response reads the events its job appended; with none, it waits
 * (the connection suspended until the job has more). */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    struct job *j = cls;
    ssize_t n;
    pthread_mutex_lock(&j->mu);
    if (j->out_sent < j->out_len) {
        const size_t have = j->out_len - j->out_sent;
        n = (ssize_t)(have < max ? have : max);
        memcpy(buf, j->out + j->out_sent, (size_t)n);
        j->out_sent += (size_t)n;
    } else if (j->done) {
        n = MHD_CONTENT_READER_END_OF_STREAM;
    } else {
        j->suspended = true;
        MHD_suspend_connection(j->c);
        n = 0;
    }
    pthread_mutex_unlock(&j->mu);
    return n;
}

/* The stream's response is freed: sent whole, or its client is gone (then
 * the job, if it still runs, is given up). */
static void stream_free(void *cls)
{
    struct job *j = cls;
    pthread_mutex_lock(&j->mu);
    j->conn_gone = true;
    const bool cut = !j->done;
    pthread_mutex_unlock(&j->mu);
    if (cut) {
        if (!j->s->stopping)
            atomic_fetch_add(&j->s->gone, 1);
        job_abort(j);
    }
    job_put(j);
}

/* The job woke the connection: its answer is queued (a whole one, or the
 * stream of its events). */
static enum MHD_Result resumed(struct http_server *s, struct MHD_Connection *c, struct req *q)
{
    struct job *j = q->job;
    pthread_mutex_lock(&j->mu);
    const bool streaming = j->streaming, done = j->done;
    if (!streaming && !done) {      /* woken for nothing: wait on */
        j->suspended = true;
        MHD_suspend_connection(c);
        pthread_mutex_unlock(&j->mu);
        return MHD_YES;
    }
    pthread_mutex_unlock(&j->mu);
    if (streaming) {
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, j,
                                                                   stream_free);
        if (r == NULL)
            return MHD_NO;
        atomic_fetch_add(&j->refs, 1);      /* the response's, dropped by stream_free */
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        const enum MHD_Result ok = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        count_status(s, 200);
        return ok;
    }
    if (j->answer == NULL)
        return MHD_NO;
    char *text = j->answer;
    j->answer = NULL;
    /* a client that left gets its answer queued all the same (the write fails), not counted */
    return queue_text(s, c, j->status, j->ctype, text, j->answer_len, j->retry_after_s, !j->gone);
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    struct http_server *s = cls;
    (void)version;
    struct req *q = *con_cls;
    if (q == NULL)
        return begin(s, c, url, method, con_cls);
    if (q->job != NULL)
        return resumed(s, c, q);
    if (*upload_size > 0) {
        gather(s, q, upload, *upload_size);
        *upload_size = 0;
        return MHD_YES;
    }
    return complete(s, c, q);
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    struct http_server *s = cls;
    (void)toe;
    struct req *q = *con_cls;
    if (q != NULL) {
        if (q->job != NULL)
            job_put(q->job);
        free(q->body);
        if (q->charged > 0)
            body_give(s, q->src, q->charged);
        free(q);
        *con_cls = NULL;
    }
    conn_busy(s, c, false);     /* the next request's deadline starts now */
}

/* libmicrohttpd's messages: a line each, but at most one a second (a flood of
 * refused connections is one line and a count). */
static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    struct http_server *s = cls;
    const int64_t sec = (int64_t)(now_ms() / 1000);
    if (atomic_exchange(&s->log_second, sec) == sec) {
        atomic_fetch_add(&s->log_suppressed, 1);
        return;
    }
    char line[512];
    vsnprintf(line, sizeof(line), fmt, ap);
    line[strcspn(line, "\n")] = '\0';
    const uint64_t more = atomic_exchange(&s->log_suppressed, 0);
    if (more > 0)
        fprintf(stderr, "kvd: http %s: %s (and %llu more messages)\n", s->bind, line, (unsigned long long)more);
    else
        fprintf(stderr, "kvd: http %s: %s\n", s->bind, line);
}

/* ---- the deadline of each request's head and body -------------------------------------------- */

/* Every SWEEP_MS: a connection whose request has not come whole within the
 * timeout of its start (the connection's, or the previous answer's end) is
 * shut down; libmicrohttpd then closes it. The CLOSED notice takes a
 * connection out of the list under the same lock before its descriptor is
 * closed, so the one shut down here is always that connection's. */
static void *sweeper_main(void *arg)
{
    struct http_server *s = arg;
    const double limit = s->p.timeout_s * 1e3;
    pthread_mutex_lock(&s->mu);
    while (!s->stopping) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += SWEEP_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        const double now = now_ms();
        for (struct conn *cn = s->conns; cn != NULL; cn = cn->next)
            if (!cn->busy && !cn->shut && now - cn->since > limit) {
                shutdown(cn->fd, SHUT_RDWR);
                cn->shut = true;
                atomic_fetch_add(&s->timeouts, 1);
            }
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- start and stop ---------------------------------------------------------------------------- */

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
    pthread_once(&json_once, json_funcs);
    http_server_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    s->p = *p;
    s->loopback = (ntohl(sa.sin_addr.s_addr) >> 24) == 127;
    s->bind = strdup(p->bind);
    s->endpoint = strdup(p->kvd_endpoint);
    s->model_id = strdup(p->model_id);
    s->created = time(NULL);
    s->p.bind = s->bind;
    s->p.kvd_endpoint = s->endpoint;
    s->p.model_id = s->model_id;
    s->p.tokenizer = NULL;      /* the caller's: what is needed is copied */
    s->bos = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (p->tokenizer != NULL) {
        s->bos = p->tokenizer->bos;
        s->add_bos = p->tokenizer->add_bos;
        s->tokenizer_info = tokenizer_info_text(p->tokenizer, &s->tokenizer_info_len);
        if (s->tokenizer_info == NULL) {
            snprintf(err, errlen, "out of memory");
            http_stop(&s);
            return NULL;
        }
    }
    if ((p->api_keys != NULL && load_keys(s, p->api_keys, err, errlen) != 0) ||
        (p->operator_key != NULL && load_operator_key(s, p->operator_key, err, errlen) != 0)) {
        http_stop(&s);
        return NULL;
    }
    /* connections and requests within the descriptors there are */
    struct rlimit nofile;
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY) {
        const uint64_t room = nofile.rlim_cur > RESERVED_FDS ? nofile.rlim_cur - RESERVED_FDS : 64;
        if ((uint64_t)s->p.max_requests * FDS_PER_JOB > room / 2)
            s->p.max_requests = (uint32_t)(room / 2 / FDS_PER_JOB) > 0 ? (uint32_t)(room / 2 / FDS_PER_JOB) : 1;
        const uint64_t conns = room - (uint64_t)s->p.max_requests * FDS_PER_JOB;
        if (s->p.max_conns > conns) {
            fprintf(stderr, "kvd: http %s: %u connections at most: the descriptor limit is %llu\n", p->bind,
                    (unsigned)conns, (unsigned long long)nofile.rlim_cur);
            s->p.max_conns = (uint32_t)conns;
        }
    }
    s->zctx = zmq_ctx_new();
    if (s->zctx == NULL) {
        snprintf(err, errlen, "out of memory (ZeroMQ context)");
        http_stop(&s);
        return NULL;
    }
    s->srcs = calloc(SRC_SLOTS, sizeof(*s->srcs));
    if (s->srcs == NULL) {
        snprintf(err, errlen, "out of memory");
        http_stop(&s);
        return NULL;
    }
    s->d = MHD_start_daemon(MHD_USE_POLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG, 0,
                            accept_policy, s, handle, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)s->p.timeout_s,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned int)s->p.max_conns,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
                            MHD_OPTION_NOTIFY_COMPLETED, completed, s,
                            MHD_OPTION_END);
    if (s->d == NULL) {
        snprintf(err, errlen, "--http %s: cannot listen there (in use, or not an address of this machine)",
                 p->bind);
        http_stop(&s);
        return NULL;
    }
    if (pthread_create(&s->sweeper, NULL, sweeper_main, s) != 0) {
        snprintf(err, errlen, "--http %s: cannot start a thread", p->bind);
        http_stop(&s);
        return NULL;
    }
    s->sweeper_on = true;
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
    /* every job is given up (each cancels its request in kvd at once) and ends,
     * resuming its connection: libmicrohttpd stops only without suspended ones */
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    for (struct job *j = s->jobs; j != NULL; j = j->next)
        job_abort(j);
    pthread_cond_broadcast(&s->cv);
    const double until = now_ms() + 30000;
    while (s->n_jobs > 0 && now_ms() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    const bool stuck = s->n_jobs > 0;
    pthread_mutex_unlock(&s->mu);
    if (s->sweeper_on)
        pthread_join(s->sweeper, NULL);
    if (stuck) {
        /* a job that does not end holds the server: left as it is, to go with the process */
        fprintf(stderr, "kvd: http %s: requests still running at exit\n", s->bind);
        *sp = NULL;
        return;
    }
    if (s->d != NULL)
        MHD_stop_daemon(s->d);
    for (uint32_t i = 0; i < s->n_idle; i++)
        kvd_client_destroy(&s->idle[i]);
    if (s->zctx != NULL)
        zmq_ctx_term(s->zctx);
    free(s->bind);
    free(s->endpoint);
    free(s->model_id);
    for (size_t i = 0; i < sizeof(s->pool_cache) / sizeof(s->pool_cache[0]); i++)
        free(s->pool_cache[i].text);
    for (size_t i = 0; i < s->n_keys; i++) {
        free(s->keys[i].key);
        free(s->keys[i].tenant);
    }
    free(s->keys);
    free(s->operator_key);
    free(s->tokenizer_info);
    free(s->srcs);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    *sp = NULL;
}
