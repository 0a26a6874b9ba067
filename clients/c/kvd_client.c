/*
 * kvd_client.c - the C client of kvd: one ZeroMQ DEALER socket, one request
 * at a time, every wait bounded by the client's timeout.
 *
 * Each client owns its ZeroMQ context (one I/O thread), so clients share no
 * state and kvd_client_destroy() tears everything down; a program that opens
 * many clients pays one context each, which is cheap next to a generation,
 * or gives them one of its own (kvd_client_new_in: kvd's HTTP front end).
 * Every wait also watches the caller's abort descriptor, when it set one.
 *
 * Requests carry ids that start at a random 64-bit value and count up (never
 * 0, which kvd uses for replies to requests it could not read). A reply whose
 * id is not the one being waited for belongs to a request given up earlier (a
 * timeout, a cancel) and is dropped without restarting the wait; a reply for
 * the request restarts it, so a stream may run for as long as messages keep
 * coming. A signal does not end a wait.
 *
 * The socket sets ZMQ_IMMEDIATE: a request is only queued on a completed
 * connection, so while no daemon listens a send waits (and times out) instead
 * of piling up requests that a daemon started later would run for nobody.
 *
 * Replies are unpacked by wire.h over an arena whose budget is 4 bytes per
 * frame byte plus 1 MiB (what wire.c documents a legitimate message needs):
 * the client keeps one for frames up to 768 KiB and makes one per larger
 * frame, so an idle client holds little memory and a hostile frame cannot
 * make it allocate much more than its size.
 *
 * The client checks the order kvd promises for a generate (Accepted, Chunks
 * numbered from 0 when asked for, one Final or Error; the Final's chunk count
 * and text agree with the chunks) and fails the call with KVD_EPROTOCOL
 * otherwise; a request given up that way, or by a timeout, is cancelled at
 * the daemon on the way out.
 */
#include "kvd_client.h"
#include "curve.h"
#include "endpoint.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "wire.h"

#define DEFAULT_TIMEOUT_MS 30000
#define LZ4_MIN_PROMPT (64u << 10)      /* prompts longer than this travel LZ4-compressed */
#define ARENA_SLACK (1u << 20)          /* arena budget beyond 4 bytes per frame byte (wire.c) */
#define SMALL_ARENA (4u << 20)          /* budget of the client's reusable arena */
#define SMALL_FRAME ((SMALL_ARENA - ARENA_SLACK) / 4) /* frames it takes; larger get their own */
#define MAX_OUTPUT_BYTES (256u << 20)   /* text one generate may collect */
#define SOCKET_HWM 100000               /* messages queued per direction */

struct kvd_client {
    void *ctx;                  /* its ZeroMQ context: its own, or the caller's (kvd_client_new_in) */
    bool own_ctx;               /* destroyed with the client */
    int abort_fd;               /* watched while a call waits (-1: none) */
    bool aborted;               /* the last wait ended because abort_fd fired */
    void *sock;                 /* DEALER connected to endpoint */
    void *mon;                  /* with CURVE keys: PAIR receiving sock's handshake failures */
    char auth_why[160];         /* the last handshake failure seen, "" while none */
    bool curve;                 /* it has CURVE keys */
    wire_arena_t *arena;        /* unpacks replies of up to SMALL_FRAME bytes */
    int timeout_ms;             /* longest wait for one message */
    uint64_t next_id;           /* id of the next request */
    char endpoint[256];         /* for messages */
};

/* One received reply: the frame, and the arena its unpacked message lives in. */
struct inbox {
    zmq_msg_t msg;              /* the frame (kept while the message is used) */
    wire_arena_t *arena;        /* c->arena or a per-frame one */
    bool open;                  /* msg needs closing */
};

/* Growing output of a generate. */
struct output {
    char *text;                 /* text_len bytes + NUL, or NULL */
    size_t text_len, text_cap;
    int32_t *tokens;            /* n_tokens ids, or NULL */
    size_t n_tokens, tokens_cap;
    struct kvd_logprob *lp;     /* n_lp logprobs, or NULL */
    size_t n_lp, lp_cap;
    struct kvd_logprob *plp;    /* n_plp prompt logprobs, or NULL */
    size_t n_plp, plp_cap;
    int32_t *ptok;              /* n_plp prompt token ids, or NULL */
    struct lp_block *lp_bytes;  /* their token texts: blocks that never move */
};

/* A block of token texts; the newest block first. */
struct lp_block {
    struct lp_block *next;
    size_t used, cap;
    char data[];
};

#define LP_BLOCK_BYTES 16384

static void lp_blocks_free(struct lp_block *b)
{
    while (b != NULL) {
        struct lp_block *next = b->next;
        free(b);
        b = next;
    }
}

/* A copy of n bytes that stays where it is until the blocks are freed. */
static const char *lp_keep(struct lp_block **head, const void *bytes, size_t n)
{
    struct lp_block *b = *head;
    if (b == NULL || b->cap - b->used < n) {
        size_t cap = n > LP_BLOCK_BYTES ? n : LP_BLOCK_BYTES;
        b = malloc(sizeof(*b) + cap);
        if (b == NULL)
            return NULL;
        b->next = *head;
        b->used = 0;
        b->cap = cap;
        *head = b;
    }
    char *p = b->data + b->used;
    if (n > 0)
        memcpy(p, bytes, n);
    b->used += n;
    return p;
}

/* ---- small helpers ----------------------------------------------------------------- */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int norm_timeout(int timeout_ms)
{
    return timeout_ms > 0 ? timeout_ms : DEFAULT_TIMEOUT_MS;
}

/* A random 64-bit value (the first request id); falls back to time and pid. */
static uint64_t random_u64(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof(v), GRND_NONBLOCK) != (ssize_t)sizeof(v)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        v = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16) ^
            (uint64_t)(uintptr_t)&v;
        v ^= v >> 33;
        v *= 0xff51afd7ed558ccdull;
        v ^= v >> 33;
    }
    return v;
}

static uint64_t take_id(kvd_client_t *c)
{
    if (c->next_id == 0)
        c->next_id++;
    return c->next_id++;
}

/* The err.h code for a daemon error code; KVD_EPROTOCOL for one we do not know. */
static int from_server_code(Kvd__ErrorCode code)
{
    switch (code) {
    case KVD__ERROR_CODE__ERR_BAD_REQUEST: return KVD_EBADREQUEST;
    case KVD__ERROR_CODE__ERR_OVERLOADED: return KVD_EOVERLOADED;
    case KVD__ERROR_CODE__ERR_TOO_LONG: return KVD_ETOOLONG;
    case KVD__ERROR_CODE__ERR_DEADLINE: return KVD_EDEADLINE;
    case KVD__ERROR_CODE__ERR_CANCELLED: return KVD_ECANCELLED;
    case KVD__ERROR_CODE__ERR_UNAVAILABLE: return KVD_EUNAVAILABLE;
    case KVD__ERROR_CODE__ERR_INTERNAL: return KVD_EINTERNAL;
    case KVD__ERROR_CODE__ERR_NOT_FOUND: return KVD_ENOTFOUND;
    case KVD__ERROR_CODE__ERR_SHUTTING_DOWN: return KVD_ESHUTDOWN;
    default: return KVD_EPROTOCOL;
    }
}

static const char *body_name(Kvd__ServerReply__BodyCase b)
{
    switch (b) {
    case KVD__SERVER_REPLY__BODY_ACCEPTED: return "accepted";
    case KVD__SERVER_REPLY__BODY_CHUNK: return "chunk";
    case KVD__SERVER_REPLY__BODY_FINAL: return "final";
    case KVD__SERVER_REPLY__BODY_ERROR: return "error";
    case KVD__SERVER_REPLY__BODY_STATS: return "stats";
    case KVD__SERVER_REPLY__BODY_HEALTH: return "health";
    case KVD__SERVER_REPLY__BODY_TOKENS: return "tokens";
    case KVD__SERVER_REPLY__BODY_CACHE: return "cache";
    default: return "empty";
    }
}

/* Fills err from a daemon Error and returns its err.h code. */
static int take_server_error(const Kvd__Error *e, char *err, size_t errlen)
{
    int code = from_server_code(e->has_code ? e->code : KVD__ERROR_CODE__ERR_NONE);
    if (code == KVD_EPROTOCOL)
        return kvd_seterr(err, errlen, code, "kvd sent error code %d: %s", (int)e->code,
                          e->message ? e->message : "");
    return kvd_seterr(err, errlen, code, "%s", e->message ? e->message : "");
}

/* ---- lifecycle ---------------------------------------------------------------------- */

static int set_int(void *sock, int opt, int v)
{
    return zmq_setsockopt(sock, opt, &v, sizeof(v));
}

/* CURVE on c->sock (before it connects): the client's key pair from cert_path,
 * the server's key from server_arg. */
static int use_keys(kvd_client_t *c, const char *server_arg, const char *cert_path, char *err, size_t errlen)
{
    struct curve_cert me;
    char server[CURVE_KEY_Z85 + 1];
    int rc = curve_public_key_arg(server_arg, server, err, errlen);
    if (rc == 0)
        rc = curve_cert_read(cert_path, true, &me, err, errlen);
    if (rc != 0)
        return rc;
    if (zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, server, CURVE_KEY_Z85) != 0 ||
        zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, me.public_key, CURVE_KEY_Z85) != 0 ||
        zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, me.secret_key, CURVE_KEY_Z85) != 0)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "CURVE: %s", zmq_strerror(errno));
    return 0;
}

/* A monitor of c->sock's failed handshakes (a key kvd refused, a kvd that
 * wants CURVE from a client without keys), so that a call ends with
 * KVD_EAUTH instead of a timeout. */
static int watch_handshakes(kvd_client_t *c, char *err, size_t errlen)
{
    char ep[64];
    snprintf(ep, sizeof(ep), "inproc://kvd-client-monitor-%p", (void *)c);
    if (zmq_socket_monitor(c->sock, ep, ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                        ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) != 0 ||
        (c->mon = zmq_socket(c->ctx, ZMQ_PAIR)) == NULL || zmq_connect(c->mon, ep) != 0)
        return kvd_seterr(err, errlen, KVD_EIO, "zmq_socket_monitor: %s", zmq_strerror(errno));
    return 0;
}

/* Reads the monitor's events: KVD_EAUTH (reason in err) once a handshake failed. */
static int auth_failed(kvd_client_t *c, char *err, size_t errlen)
{
    while (c->mon != NULL) {
        zmq_msg_t ev, where;
        zmq_msg_init(&ev);
        zmq_msg_init(&where);
        const bool got = zmq_msg_recv(&ev, c->mon, ZMQ_DONTWAIT) >= 0 && zmq_msg_recv(&where, c->mon, 0) >= 0;
        if (got && zmq_msg_size(&ev) >= 6) {
            uint16_t id;
            uint32_t value;
            memcpy(&id, zmq_msg_data(&ev), 2);
            memcpy(&value, (const uint8_t *)zmq_msg_data(&ev) + 2, 4);
            snprintf(c->auth_why, sizeof(c->auth_why), "%s",
                     !c->curve ? "kvd wants CURVE keys here (KVD_CURVE_SERVER_KEY, KVD_CURVE_CERT)"
                     : id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? "kvd refused this client's key"
                     : id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ? "the CURVE handshake failed (does kvd use CURVE here?)"
                                                                : "the CURVE handshake failed (a wrong server key?)");
        }
        zmq_msg_close(&ev);
        zmq_msg_close(&where);
        if (!got)
            break;
    }
    if (c->auth_why[0] == '\0')
        return 0;
    return kvd_seterr(err, errlen, KVD_EAUTH, "%s at %s", c->auth_why, c->endpoint);
}

kvd_client_t *kvd_client_new(const char *endpoint, int timeout_ms, char *err, size_t errlen)
{
    const char *server = getenv("KVD_CURVE_SERVER_KEY"), *cert = getenv("KVD_CURVE_CERT");
    if (server == NULL || server[0] == '\0' || cert == NULL || cert[0] == '\0')
        return kvd_client_new_keys(endpoint, timeout_ms, NULL, err, errlen);
    const struct kvd_client_keys keys = { .server_key = server, .client_cert = cert };
    return kvd_client_new_keys(endpoint, timeout_ms, &keys, err, errlen);
}

static kvd_client_t *client_new(void *zctx, const char *endpoint, int timeout_ms,
                                const struct kvd_client_keys *keys, char *err, size_t errlen);

kvd_client_t *kvd_client_new_keys(const char *endpoint, int timeout_ms, const struct kvd_client_keys *keys,
                                  char *err, size_t errlen)
{
    return client_new(NULL, endpoint, timeout_ms, keys, err, errlen);
}

kvd_client_t *kvd_client_new_in(void *zctx, const char *endpoint, int timeout_ms, char *err, size_t errlen)
{
    if (zctx == NULL) {
        kvd_seterr(err, errlen, KVD_EINVAL, "no ZeroMQ context");
        return NULL;
    }
    return client_new(zctx, endpoint, timeout_ms, NULL, err, errlen);
}

/* A client on zctx, or on a context of its own when zctx is NULL. */
static kvd_client_t *client_new(void *zctx, const char *endpoint, int timeout_ms,
                                const struct kvd_client_keys *keys, char *err, size_t errlen)
{
    char def[256];
    if (endpoint == NULL)
        endpoint = kvd_default_endpoint(def, sizeof(def));
    kvd_client_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        return NULL;
    }
    if (strlen(endpoint) >= sizeof(c->endpoint) || strstr(endpoint, "://") == NULL) {
        kvd_seterr(err, errlen, KVD_EINVAL,
                   "malformed endpoint '%.200s' (want ipc://PATH or tcp://HOST:PORT)", endpoint);
        goto fail;
    }
    snprintf(c->endpoint, sizeof(c->endpoint), "%s", endpoint);
    c->timeout_ms = norm_timeout(timeout_ms);
    c->next_id = random_u64();
    c->abort_fd = -1;
    c->arena = wire_arena_new(SMALL_ARENA);
    c->own_ctx = zctx == NULL;
    c->ctx = zctx != NULL ? zctx : zmq_ctx_new();
    if (c->arena == NULL || c->ctx == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory (zmq context or arena)");
        goto fail;
    }
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    if (c->sock == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "zmq_socket: %s", zmq_strerror(errno));
        goto fail;
    }
    int64_t maxmsg = WIRE_MAX_FRAME;
    if (set_int(c->sock, ZMQ_LINGER, 0) != 0 || set_int(c->sock, ZMQ_IMMEDIATE, 1) != 0 ||
        set_int(c->sock, ZMQ_RCVHWM, SOCKET_HWM) != 0 ||
        set_int(c->sock, ZMQ_SNDHWM, SOCKET_HWM) != 0 ||
        zmq_setsockopt(c->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg)) != 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "zmq_setsockopt: %s", zmq_strerror(errno));
        goto fail;
    }
    c->curve = keys != NULL && keys->server_key != NULL;
    if (c->curve && use_keys(c, keys->server_key, keys->client_cert, err, errlen) != 0)
        goto fail;
    if (watch_handshakes(c, err, errlen) != 0)     /* wherever kvd may want keys */
        goto fail;
    if (zmq_connect(c->sock, endpoint) != 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "malformed endpoint '%s': %s", endpoint,
                   zmq_strerror(errno));
        goto fail;
    }
    return c;
fail:
    kvd_client_destroy(&c);
    return NULL;
}

void kvd_client_destroy(kvd_client_t **cp)
{
    if (cp == NULL || *cp == NULL)
        return;
    kvd_client_t *c = *cp;
    if (c->mon != NULL)
        zmq_close(c->mon);
    if (c->sock != NULL)
        zmq_close(c->sock);
    if (c->ctx != NULL && c->own_ctx)
        zmq_ctx_term(c->ctx);
    wire_arena_destroy(&c->arena);
    free(c);
    *cp = NULL;
}

void kvd_client_set_timeout(kvd_client_t *c, int timeout_ms)
{
    if (c != NULL)
        c->timeout_ms = norm_timeout(timeout_ms);
}

void kvd_client_set_abort_fd(kvd_client_t *c, int fd)
{
    if (c != NULL)
        c->abort_fd = fd;
}

/* ---- sending and receiving ----------------------------------------------------------- */

/* Waits up to left ms for the socket (events: ZMQ_POLLIN or ZMQ_POLLOUT), the
 * handshake monitor or the abort descriptor. 0 (something may be ready),
 * KVD_ECANCELLED once the abort descriptor fired (c->aborted), or KVD_EIO. */
static int wait_for(kvd_client_t *c, short events, int64_t left, char *err, size_t errlen)
{
    zmq_pollitem_t it[3] = { { c->sock, 0, events, 0 } };
    int n = 1, at_abort = -1;
    if (c->mon != NULL)
        it[n++] = (zmq_pollitem_t){ c->mon, 0, ZMQ_POLLIN, 0 };
    if (c->abort_fd >= 0) {
        at_abort = n;
        it[n++] = (zmq_pollitem_t){ NULL, c->abort_fd, ZMQ_POLLIN, 0 };
    }
    if (zmq_poll(it, n, (long)left) < 0 && errno != EINTR)
        return kvd_seterr(err, errlen, KVD_EIO, "zmq_poll: %s", zmq_strerror(errno));
    if (at_abort >= 0 && it[at_abort].revents != 0) {
        c->aborted = true;
        return kvd_seterr(err, errlen, KVD_ECANCELLED, "given up: the caller's abort descriptor fired");
    }
    return 0;
}

/* Packs and sends req, waiting until deadline (monotonic ms) for the socket to
 * take it. 0, KVD_ETIMEOUT (no connection to a daemon), KVD_EINVAL (too
 * large), KVD_ENOMEM or KVD_EIO; a reason in err. */
static int send_request(kvd_client_t *c, const Kvd__ClientRequest *req, int64_t deadline,
                        char *err, size_t errlen)
{
    uint8_t *buf;
    size_t len;
    int rc = wire_pack(&req->base, &buf, &len);
    if (rc == KVD_ERANGE)
        return kvd_seterr(err, errlen, KVD_EINVAL, "request over the %u-byte frame limit",
                          WIRE_MAX_FRAME);
    if (rc != 0)
        return kvd_seterr(err, errlen, rc, "cannot pack the request: %s", kvd_strerror(rc));
    for (;;) {
        if (zmq_send(c->sock, buf, len, ZMQ_DONTWAIT) >= 0)
            break;
        if (errno != EAGAIN && errno != EINTR) {
            rc = kvd_seterr(err, errlen, KVD_EIO, "zmq_send: %s", zmq_strerror(errno));
            break;
        }
        if ((rc = auth_failed(c, err, errlen)) != 0)
            break;
        int64_t left = deadline - now_ms();
        if (left <= 0) {
            rc = kvd_seterr(err, errlen, KVD_ETIMEOUT,
                            "no connection to kvd at %s in %d ms (is it running?)", c->endpoint,
                            c->timeout_ms);
            break;
        }
        if ((rc = wait_for(c, ZMQ_POLLOUT, left, err, errlen)) != 0)
            break;
    }
    free(buf);
    return rc;
}

/* Sends a CancelRequest for target without waiting for anything (the daemon's
 * answer to it is dropped later as a reply to another request). */
static void send_cancel_nowait(kvd_client_t *c, uint64_t target)
{
    Kvd__CancelRequest cr = KVD__CANCEL_REQUEST__INIT;
    cr.has_target = 1;
    cr.target = target;
    Kvd__ClientRequest req = KVD__CLIENT_REQUEST__INIT;
    req.has_version = 1;
    req.version = WIRE_VERSION;
    req.has_request_id = 1;
    req.request_id = take_id(c);
    req.body_case = KVD__CLIENT_REQUEST__BODY_CANCEL;
    req.cancel = &cr;
    send_request(c, &req, now_ms(), NULL, 0);
}

static void inbox_release(kvd_client_t *c, struct inbox *in)
{
    if (in->arena == c->arena)
        wire_arena_reset(c->arena);
    else if (in->arena != NULL)
        wire_arena_destroy(&in->arena);
    in->arena = NULL;
    if (in->open)
        zmq_msg_close(&in->msg);
    in->open = false;
}

/* Waits until deadline for the next reply and unpacks it into *reply (valid
 * until inbox_release, which the caller owes after a 0). KVD_ETIMEOUT,
 * KVD_EPROTOCOL (an unreadable frame), KVD_ENOMEM or KVD_EIO otherwise, with
 * a reason in err. A signal does not end the wait. */
static int recv_reply(kvd_client_t *c, int64_t deadline, struct inbox *in,
                      Kvd__ServerReply **reply, char *err, size_t errlen)
{
    memset(in, 0, sizeof(*in));
    zmq_msg_init(&in->msg);
    in->open = true;
    for (;;) {
        if (zmq_msg_recv(&in->msg, c->sock, ZMQ_DONTWAIT) >= 0)
            break;
        if (errno != EAGAIN && errno != EINTR) {
            int rc = kvd_seterr(err, errlen, KVD_EIO, "zmq_msg_recv: %s", zmq_strerror(errno));
            inbox_release(c, in);
            return rc;
        }
        int rc = auth_failed(c, err, errlen);
        if (rc != 0) {
            inbox_release(c, in);
            return rc;
        }
        int64_t left = deadline - now_ms();
        if (left <= 0) {
            inbox_release(c, in);
            return kvd_seterr(err, errlen, KVD_ETIMEOUT,
                              "no reply from kvd at %s in %d ms (is it running?)", c->endpoint,
                              c->timeout_ms);
        }
        if ((rc = wait_for(c, ZMQ_POLLIN, left, err, errlen)) != 0) {
            inbox_release(c, in);
            return rc;
        }
    }
    if (zmq_msg_more(&in->msg)) {
        /* one protobuf per message: drop the rest of a multi-part one */
        int more = 1;
        size_t ml = sizeof(more);
        while (more && zmq_msg_recv(&in->msg, c->sock, ZMQ_DONTWAIT) >= 0 &&
               zmq_getsockopt(c->sock, ZMQ_RCVMORE, &more, &ml) == 0)
            ;
        inbox_release(c, in);
        return kvd_seterr(err, errlen, KVD_EPROTOCOL, "kvd sent a multi-part message");
    }
    size_t len = zmq_msg_size(&in->msg);
    if (len <= SMALL_FRAME) {
        in->arena = c->arena;
    } else {
        in->arena = wire_arena_new(4 * len + ARENA_SLACK);
        if (in->arena == NULL) {
            inbox_release(c, in);
            return kvd_seterr(err, errlen, KVD_ENOMEM, "no memory for a %zu-byte reply", len);
        }
    }
    int code = 0;
    char why[200] = "";
    *reply = wire_server_reply_unpack(in->arena, zmq_msg_data(&in->msg), len, &code, why,
                                      sizeof(why));
    if (*reply == NULL) {
        inbox_release(c, in);
        return kvd_seterr(err, errlen, KVD_EPROTOCOL, "unreadable reply from kvd: %s", why);
    }
    return 0;
}

/* Whether reply r answers request id: its own id, or 0 on an error (kvd's
 * answer to a frame it could not read, which can only be the one in flight). */
static bool is_for(const Kvd__ServerReply *r, uint64_t id)
{
    if (r->request_id == id)
        return true;
    return r->request_id == 0 && r->body_case == KVD__SERVER_REPLY__BODY_ERROR;
}

static void init_request(Kvd__ClientRequest *req, uint64_t id)
{
    kvd__client_request__init(req);
    req->has_version = 1;
    req->version = WIRE_VERSION;
    req->has_request_id = 1;
    req->request_id = id;
}

/* Sends req and waits for the first reply to it (others are dropped). 0 with
 * *reply (release in), or a transport error with a reason in err. */
static int call(kvd_client_t *c, const Kvd__ClientRequest *req, struct inbox *in,
                Kvd__ServerReply **reply, char *err, size_t errlen)
{
    int64_t deadline = now_ms() + c->timeout_ms;
    int rc = send_request(c, req, deadline, err, errlen);
    if (rc != 0)
        return rc;
    deadline = now_ms() + c->timeout_ms;
    for (;;) {
        rc = recv_reply(c, deadline, in, reply, err, errlen);
        if (rc != 0)
            return rc;
        if (is_for(*reply, req->request_id))
            return 0;
        inbox_release(c, in);
    }
}

/* ---- generate ---------------------------------------------------------------------- */

void kvd_gen_params_init(struct kvd_gen_params *p)
{
    memset(p, 0, sizeof(*p));
    p->temperature = -1.0f;
    p->top_k = -1;
    p->top_p = -1.0f;
    p->min_p = -1.0f;
    p->repeat_penalty = -1.0f;
    p->seed = -1;
    p->logprobs = -1;
    p->prompt_logprobs = -1;
}

void kvd_result_free(struct kvd_result *r)
{
    if (r == NULL)
        return;
    free(r->text);
    free(r->tokens);
    free(r->logprobs);
    free(r->prompt_logprobs);
    free(r->prompt_ids);
    lp_blocks_free(r->lp_bytes);
    memset(r, 0, sizeof(*r));
}

static int output_add(struct output *o, const char *text, size_t len, const int32_t *tokens,
                      size_t n)
{
    if (o->text_len + len > MAX_OUTPUT_BYTES || o->n_tokens + n > WIRE_MAX_NEW_TOKENS)
        return KVD_EPROTOCOL;
    if (o->text == NULL || o->text_len + len + 1 > o->text_cap) {
        size_t cap = o->text_cap ? o->text_cap : 256;
        while (cap < o->text_len + len + 1)
            cap *= 2;
        char *t = realloc(o->text, cap);
        if (t == NULL)
            return KVD_ENOMEM;
        o->text = t;
        o->text_cap = cap;
    }
    memcpy(o->text + o->text_len, text, len);
    o->text_len += len;
    o->text[o->text_len] = '\0';
    if (n > 0 && o->n_tokens + n > o->tokens_cap) {
        size_t cap = o->tokens_cap ? o->tokens_cap : 64;
        while (cap < o->n_tokens + n)
            cap *= 2;
        int32_t *t = realloc(o->tokens, cap * sizeof(*t));
        if (t == NULL)
            return KVD_ENOMEM;
        o->tokens = t;
        o->tokens_cap = cap;
    }
    if (n > 0)
        memcpy(o->tokens + o->n_tokens, tokens, n * sizeof(*tokens));
    o->n_tokens += n;
    return 0;
}

/* Appends n logprobs (checked by the wire layer: at most
 * KVD_MAX_TOP_LOGPROBS alternatives each) to the output's (or, prompt, to
 * its prompt's). */
static int output_add_lp(struct output *o, Kvd__TokenLogprob *const *m, size_t n, bool prompt)
{
    struct kvd_logprob **arr = prompt ? &o->plp : &o->lp;
    size_t *count = prompt ? &o->n_plp : &o->n_lp, *have = prompt ? &o->plp_cap : &o->lp_cap;
    if (*count + n > (prompt ? WIRE_MAX_TOKENS : WIRE_MAX_NEW_TOKENS))
        return KVD_EPROTOCOL;
    if (n > 0 && *count + n > *have) {
        size_t cap = *have ? *have : 64;
        while (cap < *count + n)
            cap *= 2;
        struct kvd_logprob *v = realloc(*arr, cap * sizeof(*v));
        if (v == NULL)
            return KVD_ENOMEM;
        *arr = v;
        *have = cap;
    }
    for (size_t i = 0; i < n; i++) {
        struct kvd_logprob *l = &(*arr)[(*count)++];
        memset(l, 0, sizeof(*l));
        l->logprob = m[i]->has_logprob ? m[i]->logprob : NAN;
        l->rank = m[i]->has_rank ? m[i]->rank : 0;
        l->n_top = (uint32_t)m[i]->n_top_ids;
        memcpy(l->top_ids, m[i]->top_ids, l->n_top * sizeof(int32_t));
        memcpy(l->top_logprobs, m[i]->top_logprobs, l->n_top * sizeof(float));
        l->token_len = m[i]->has_token ? m[i]->token.len : 0;
        l->token = lp_keep(&o->lp_bytes, m[i]->token.data, l->token_len);
        for (uint32_t j = 0; l->token != NULL && j < l->n_top; j++) {
            l->top_token_lens[j] = j < m[i]->n_top_tokens ? m[i]->top_tokens[j].len : 0;
            l->top_tokens[j] = lp_keep(&o->lp_bytes, j < m[i]->n_top_tokens ? m[i]->top_tokens[j].data : NULL,
                                       l->top_token_lens[j]);
            if (l->top_tokens[j] == NULL)
                return KVD_ENOMEM;
        }
        if (l->token == NULL)
            return KVD_ENOMEM;
    }
    return 0;
}

/* Reports a failed output_add in out->error; returns rc. */
static int output_error(int rc, struct kvd_result *out)
{
    return kvd_seterr(out->error, sizeof(out->error), rc, "%s",
                      rc == KVD_ENOMEM ? "out of memory" :
                                         "kvd sent more output than any request may have");
}

/* Everything a packed GenerateRequest points to that is not the caller's. */
struct gen_msg {
    Kvd__ClientRequest req;
    Kvd__GenerateRequest gen;
    Kvd__SamplingParams sampling;
    Kvd__ChatMessage *msgs;     /* n_messages */
    Kvd__ChatMessage **msg_ptrs;
    uint8_t *lz4;               /* the compressed prompt, or NULL */
};

static void gen_msg_fini(struct gen_msg *m)
{
    free(m->msgs);
    free(m->msg_ptrs);
    free(m->lz4);
}

/* Builds the request for p (pointing into p; casts drop const because
 * protobuf-c's structs are not const, and packing only reads them). 0, or
 * KVD_EINVAL / KVD_ENOMEM with a reason. */
static int gen_msg_build(struct gen_msg *m, const struct kvd_gen_params *p, uint64_t id,
                         bool stream, char *err, size_t errlen)
{
    memset(m, 0, sizeof(*m));
    init_request(&m->req, id);
    kvd__generate_request__init(&m->gen);
    m->req.body_case = KVD__CLIENT_REQUEST__BODY_GENERATE;
    m->req.generate = &m->gen;
    Kvd__GenerateRequest *g = &m->gen;

    int forms = (p->prompt != NULL) + (p->n_messages > 0) + (p->n_token_ids > 0);
    if (forms != 1)
        return kvd_seterr(err, errlen, KVD_EINVAL,
                          "give exactly one of prompt, messages and token_ids (got %d)", forms);
    if ((p->n_messages > 0 && p->messages == NULL) || (p->n_token_ids > 0 && p->token_ids == NULL) ||
        (p->n_stop > 0 && p->stop == NULL))
        return kvd_seterr(err, errlen, KVD_EINVAL, "a count without its array");
    for (size_t i = 0; i < p->n_stop; i++)
        if (p->stop[i] == NULL)
            return kvd_seterr(err, errlen, KVD_EINVAL, "stop string %zu is NULL", i);
    if (p->prompt != NULL) {
        size_t len = strlen(p->prompt);
        if (len > LZ4_MIN_PROMPT) {
            size_t zlen;
            int rc = wire_lz4_compress(p->prompt, len, &m->lz4, &zlen);
            if (rc == KVD_ERANGE)
                return kvd_seterr(err, errlen, KVD_EINVAL,
                                  "prompt of %zu bytes is over the %u-byte limit", len,
                                  WIRE_MAX_PROMPT_BYTES);
            if (rc != 0)
                return kvd_seterr(err, errlen, rc, "cannot compress the prompt: %s",
                                  kvd_strerror(rc));
            g->has_prompt_lz4 = 1;
            g->prompt_lz4.data = m->lz4;
            g->prompt_lz4.len = zlen;
            g->has_prompt_lz4_size = 1;
            g->prompt_lz4_size = (uint32_t)len;
        } else {
            g->prompt = (char *)p->prompt;
        }
    }
    if (p->n_messages > 0) {
        m->msgs = calloc(p->n_messages, sizeof(*m->msgs));
        m->msg_ptrs = calloc(p->n_messages, sizeof(*m->msg_ptrs));
        if (m->msgs == NULL || m->msg_ptrs == NULL)
            return kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        for (size_t i = 0; i < p->n_messages; i++) {
            kvd__chat_message__init(&m->msgs[i]);
            m->msgs[i].role = (char *)p->messages[i].role;
            m->msgs[i].content = (char *)p->messages[i].content;
            if (p->tool_calls != NULL) {
                m->msgs[i].n_tool_calls = p->tool_calls[i].n;
                m->msgs[i].tool_calls = (char **)p->tool_calls[i].json;
            }
            m->msg_ptrs[i] = &m->msgs[i];
        }
        g->n_messages = p->n_messages;
        g->messages = m->msg_ptrs;
    }
    if (p->n_token_ids > 0) {
        g->n_token_ids = p->n_token_ids;
        g->token_ids = (int32_t *)p->token_ids;
    }

    Kvd__SamplingParams *s = &m->sampling;
    kvd__sampling_params__init(s);
    /* negative means "the daemon's default"; NaN is sent, and refused below */
    s->has_temperature = !(p->temperature < 0);
    s->temperature = p->temperature;
    s->has_top_k = p->top_k >= 0;
    s->top_k = p->top_k;
    s->has_top_p = !(p->top_p < 0);
    s->top_p = p->top_p;
    s->has_min_p = !(p->min_p < 0);
    s->min_p = p->min_p;
    s->has_repeat_penalty = !(p->repeat_penalty < 0);
    s->repeat_penalty = p->repeat_penalty;
    s->has_seed = p->has_seed_u64 || p->seed >= 0;
    s->seed = p->has_seed_u64 ? p->seed_u64 : (uint64_t)p->seed;
    s->has_presence_penalty = p->presence_penalty != 0.0f;
    s->presence_penalty = p->presence_penalty;
    s->has_frequency_penalty = p->frequency_penalty != 0.0f;
    s->frequency_penalty = p->frequency_penalty;
    s->n_logit_bias_ids = s->n_logit_bias = p->n_logit_bias;
    s->logit_bias_ids = (int32_t *)p->logit_bias_ids;
    s->logit_bias = (float *)p->logit_bias;
    if (s->has_temperature || s->has_top_k || s->has_top_p || s->has_min_p || s->has_repeat_penalty ||
        s->has_seed || s->has_presence_penalty || s->has_frequency_penalty || s->n_logit_bias > 0)
        g->sampling = s;

    g->has_max_tokens = p->max_tokens > 0;
    g->max_tokens = p->max_tokens;
    g->n_stop = p->n_stop;
    g->stop = (char **)p->stop;
    g->has_stream = 1;
    g->stream = stream;
    g->has_deadline_ms = p->deadline_ms > 0;
    g->deadline_ms = p->deadline_ms;
    g->namespace_ = (char *)p->ns;
    g->has_ignore_eos = p->ignore_eos;
    g->ignore_eos = p->ignore_eos;
    g->has_no_cache = p->no_cache;
    g->no_cache = p->no_cache;
    g->has_logprobs = p->logprobs >= 0;
    g->logprobs = p->logprobs >= 0 ? (uint32_t)p->logprobs : 0;
    g->has_prompt_logprobs = p->prompt_logprobs >= 0;
    g->prompt_logprobs = p->prompt_logprobs >= 0 ? (uint32_t)p->prompt_logprobs : 0;
    g->has_prefill_only = p->prefill_only;
    g->prefill_only = p->prefill_only;
    g->json_schema = (char *)p->json_schema;
    g->has_json_object = p->json_object;
    g->json_object = p->json_object;
    g->n_tools = p->n_tools;
    g->tools = (char **)p->tools;
    g->tool_choice = (char *)p->tool_choice;
    g->has_parallel_tool_calls = p->parallel_tool_calls;
    g->parallel_tool_calls = p->parallel_tool_calls;
    g->has_context_overflow = p->context_overflow != KVD_OVERFLOW_DEFAULT;
    g->context_overflow = (Kvd__ContextOverflow)p->context_overflow;
    g->has_pin_ttl_s = p->pin_ttl_s > 0;
    g->pin_ttl_s = p->pin_ttl_s;
    g->has_pin_messages = p->pin_messages > 0;
    g->pin_messages = p->pin_messages;

    /* the daemon's own checks, here, so that a bad argument costs no round trip */
    char why[200];
    if (wire_check_client_request(&m->req, why, sizeof(why)) != 0)
        return kvd_seterr(err, errlen, KVD_EINVAL, "%s", why);
    return 0;
}

static void take_pin(const Kvd__Pin *m, struct kvd_pin *p)
{
    memset(p, 0, sizeof(*p));
    snprintf(p->id, sizeof(p->id), "%s", m->id ? m->id : "");
    snprintf(p->tenant, sizeof(p->tenant), "%s", m->tenant ? m->tenant : "");
    snprintf(p->ns, sizeof(p->ns), "%s", m->namespace_ ? m->namespace_ : "");
    p->tokens = m->tokens;
    p->blocks = m->blocks;
    p->ttl_s = m->ttl_s;
    p->hits = m->hits;
    p->created_unix_ms = m->created_unix_ms;
    p->expires_unix_ms = m->expires_unix_ms;
}

/* Takes what a Final says into out (text and tokens from the Final when it
 * has them, else from the chunks). 0, or KVD_EPROTOCOL / KVD_ENOMEM with a
 * reason in out->error. */
static int take_final(const Kvd__Final *f, struct output *o, struct kvd_result *out)
{
    if (f->has_finish_reason && f->finish_reason >= KVD__FINISH_REASON__FINISH_NONE &&
        f->finish_reason <= KVD__FINISH_REASON__FINISH_DEADLINE)
        out->finish_reason = (int)f->finish_reason;
    if (f->usage != NULL) {
        if (f->usage->has_prompt_tokens)
            out->prompt_tokens = f->usage->prompt_tokens;
        out->cached_prompt_tokens = f->usage->cached_prompt_tokens;
        out->host_cached_prompt_tokens = f->usage->host_cached_prompt_tokens;
        out->disk_cached_prompt_tokens = f->usage->disk_cached_prompt_tokens;
        out->completion_tokens = f->usage->completion_tokens;
        out->cache_creation_tokens = f->usage->cache_creation_tokens;
        out->cached_blocks = f->usage->cached_blocks;
    }
    if (f->pin != NULL) {
        out->has_pin = true;
        take_pin(f->pin, &out->pin);
    }
    if (f->pin_error != NULL)
        snprintf(out->pin_error, sizeof(out->pin_error), "%s", f->pin_error);
    if (f->timings != NULL) {
        out->queued_ms = f->timings->queued_ms;
        out->ttft_ms = f->timings->ttft_ms;
        out->decode_ms = f->timings->decode_ms;
        out->total_ms = f->timings->total_ms;
    }
    if (f->has_chunks && f->chunks != out->chunks)
        return kvd_seterr(out->error, sizeof(out->error), KVD_EPROTOCOL,
                          "kvd's final counts %u chunks, %u came", f->chunks, out->chunks);
    /* the chunks' text is the Final's, or its start (text held back for a
     * possible stop string may come only with the Final) */
    if (f->text != NULL && (strlen(f->text) < o->text_len ||
                            (o->text_len > 0 && memcmp(f->text, o->text, o->text_len) != 0)))
        return kvd_seterr(out->error, sizeof(out->error), KVD_EPROTOCOL,
                          "kvd's final text does not start with its chunks' text");
    int rc = 0;
    if (f->text != NULL) {
        o->text_len = 0;
        rc = output_add(o, f->text, strlen(f->text), NULL, 0);
    }
    if (rc == 0 && f->n_token_ids > 0) {
        o->n_tokens = 0;
        rc = output_add(o, "", 0, f->token_ids, f->n_token_ids);
    }
    if (rc == 0 && f->n_logprobs > 0) {
        o->n_lp = 0;
        rc = output_add_lp(o, f->logprobs, f->n_logprobs, false);
    }
    if (rc == 0 && f->n_prompt_logprobs > 0) {
        o->n_plp = 0;
        rc = output_add_lp(o, f->prompt_logprobs, f->n_prompt_logprobs, true);
        free(o->ptok);
        if (rc == 0 && (o->ptok = malloc(f->n_prompt_token_ids * sizeof(int32_t))) == NULL)
            rc = KVD_ENOMEM;
        if (rc == 0)
            memcpy(o->ptok, f->prompt_token_ids, f->n_prompt_token_ids * sizeof(int32_t));
    }
    if (rc != 0)
        return output_error(rc, out);
    if (f->usage == NULL || !f->usage->has_completion_tokens)
        out->completion_tokens = (uint32_t)o->n_tokens;
    return 0;
}

/* What a generate does with one reply to it: 1 to go on, 0 / negative to end
 * with that result. */
struct gen_state {
    kvd_chunk_fn fn;            /* NULL: no callback */
    kvd_chunk_cb cb;            /* the same as one struct; NULL: none */
    void *user;
    bool stream;                /* chunks were asked for */
    bool accepted;              /* the Accepted came */
    bool cancelled;             /* the callback asked to cancel */
    struct output o;
};

static int gen_step(kvd_client_t *c, struct gen_state *st, const Kvd__ServerReply *r,
                    struct kvd_result *out)
{
    char *err = out->error;
    size_t errlen = sizeof(out->error);
    switch (r->body_case) {
    case KVD__SERVER_REPLY__BODY_ACCEPTED:
        if (st->accepted)
            return kvd_seterr(err, errlen, KVD_EPROTOCOL, "kvd accepted the request twice");
        st->accepted = true;
        if (r->accepted->has_prompt_tokens)
            out->prompt_tokens = r->accepted->prompt_tokens;
        return 1;
    case KVD__SERVER_REPLY__BODY_CHUNK: {
        const Kvd__Chunk *k = r->chunk;
        if (!st->accepted || !st->stream)
            return kvd_seterr(err, errlen, KVD_EPROTOCOL, "kvd sent a chunk %s",
                              st->stream ? "before accepting the request" : "unasked");
        if (k->seq != out->chunks)
            return kvd_seterr(err, errlen, KVD_EPROTOCOL, "kvd sent chunk %u, expected %u",
                              k->seq, out->chunks);
        const char *text = k->text ? k->text : "";
        size_t len = strlen(text);
        int rc = output_add(&st->o, text, len, k->token_ids, k->n_token_ids);
        if (rc == 0)
            rc = output_add_lp(&st->o, k->logprobs, k->n_logprobs, false);
        if (rc != 0)
            return output_error(rc, out);
        out->chunks++;
        const struct kvd_chunk ck = {
            .text = text, .len = len, .tokens = k->token_ids, .n_tokens = k->n_token_ids,
            .logprobs = k->n_logprobs ? st->o.lp + st->o.n_lp - k->n_logprobs : NULL, .seq = k->seq,
        };
        if (!st->cancelled &&
            ((st->fn != NULL && st->fn(st->user, text, len, k->token_ids, k->n_token_ids, k->seq) != 0) ||
             (st->cb != NULL && st->cb(st->user, &ck) != 0))) {
            st->cancelled = true;
            send_cancel_nowait(c, out->request_id);
        }
        return 1;
    }
    case KVD__SERVER_REPLY__BODY_FINAL: {
        if (!st->accepted)
            return kvd_seterr(err, errlen, KVD_EPROTOCOL,
                              "kvd ended the request before accepting it");
        int rc = take_final(r->final, &st->o, out);
        if (rc != 0)
            return rc;
        if (st->cancelled || out->finish_reason == KVD_FINISH_CANCELLED)
            return KVD_ECANCELLED;
        return 0;
    }
    case KVD__SERVER_REPLY__BODY_ERROR:
        if (r->error->has_retry_after_ms)
            out->retry_after_ms = r->error->retry_after_ms;
        return take_server_error(r->error, err, errlen);
    default:
        return kvd_seterr(err, errlen, KVD_EPROTOCOL, "kvd answered a generate with %s",
                          body_name(r->body_case));
    }
}

static int generate(kvd_client_t *c, const struct kvd_gen_params *p, bool stream,
                    kvd_chunk_fn fn, kvd_chunk_cb cb, void *user, struct kvd_result *out)
{
    if (out == NULL)
        return KVD_EINVAL;
    memset(out, 0, sizeof(*out));
    if (c == NULL || p == NULL)
        return kvd_seterr(out->error, sizeof(out->error), KVD_EINVAL, "no client or no params");
    out->request_id = take_id(c);
    c->aborted = false;

    struct gen_msg m;
    int rc = gen_msg_build(&m, p, out->request_id, stream, out->error, sizeof(out->error));
    if (rc == 0)
        rc = send_request(c, &m.req, now_ms() + c->timeout_ms, out->error, sizeof(out->error));
    gen_msg_fini(&m);
    if (rc != 0)
        return rc;

    struct gen_state st = { .fn = fn, .cb = cb, .user = user, .stream = stream };
    int64_t deadline = now_ms() + c->timeout_ms;
    for (;;) {
        struct inbox in;
        Kvd__ServerReply *r;
        rc = recv_reply(c, deadline, &in, &r, out->error, sizeof(out->error));
        if (rc != 0)
            break;
        if (!is_for(r, out->request_id)) {
            inbox_release(c, &in);
            continue;
        }
        bool was_cancelled = st.cancelled;
        rc = gen_step(c, &st, r, out);
        inbox_release(c, &in);
        if (rc <= 0)
            break;
        /* each message restarts the wait; a cancelled request gets one more
         * wait, not restarted, to say how it ended: kvd confirms once the
         * worker's step in progress is over, seconds on a slow CPU */
        if (!st.cancelled || !was_cancelled)
            deadline = now_ms() + c->timeout_ms;
    }
    if (c->aborted) {
        /* the caller gave up: kvd stops working on it, and its answer to the
         * cancel is dropped later as a reply to another request */
        send_cancel_nowait(c, out->request_id);
    } else if (st.cancelled && (rc == KVD_ETIMEOUT || rc == KVD_EIO)) {
        rc = kvd_seterr(out->error, sizeof(out->error), KVD_ECANCELLED,
                        "cancelled (kvd did not confirm in time)");
    } else if (rc == KVD_ETIMEOUT || rc == KVD_EPROTOCOL || rc == KVD_ENOMEM) {
        /* the request is given up: tell the daemon to stop working on it */
        send_cancel_nowait(c, out->request_id);
    }
    if (st.o.text == NULL)
        output_add(&st.o, "", 0, NULL, 0);
    out->text = st.o.text;
    out->text_len = st.o.text_len;
    out->tokens = st.o.tokens;
    out->n_tokens = st.o.n_tokens;
    out->logprobs = st.o.lp;
    out->n_logprobs = st.o.n_lp;
    out->prompt_logprobs = st.o.plp;
    out->n_prompt_logprobs = st.o.n_plp;
    out->prompt_ids = st.o.ptok;
    out->lp_bytes = st.o.lp_bytes;
    return rc;
}

int kvd_generate(kvd_client_t *c, const struct kvd_gen_params *p, struct kvd_result *out)
{
    /* chunks are asked for even here: each one restarts the timeout, so a long
     * generation is not mistaken for a daemon that went away */
    return generate(c, p, true, NULL, NULL, NULL, out);
}

int kvd_generate_stream(kvd_client_t *c, const struct kvd_gen_params *p, kvd_chunk_fn fn,
                        void *user, struct kvd_result *out)
{
    return generate(c, p, true, fn, NULL, user, out);
}

int kvd_generate_chunks(kvd_client_t *c, const struct kvd_gen_params *p, kvd_chunk_cb fn,
                        void *user, struct kvd_result *out)
{
    return generate(c, p, true, NULL, fn, user, out);
}

/* ---- cancel, stats, health ------------------------------------------------------------ */

int kvd_cancel(kvd_client_t *c, uint64_t request_id)
{
    if (c == NULL)
        return KVD_EINVAL;
    Kvd__CancelRequest cr = KVD__CANCEL_REQUEST__INIT;
    cr.has_target = 1;
    cr.target = request_id;
    Kvd__ClientRequest req;
    init_request(&req, take_id(c));
    req.body_case = KVD__CLIENT_REQUEST__BODY_CANCEL;
    req.cancel = &cr;
    struct inbox in;
    Kvd__ServerReply *r;
    int rc = call(c, &req, &in, &r, NULL, 0);
    if (rc != 0)
        return rc;
    if (r->body_case == KVD__SERVER_REPLY__BODY_ACCEPTED)
        rc = 0;
    else if (r->body_case == KVD__SERVER_REPLY__BODY_ERROR)
        rc = take_server_error(r->error, NULL, 0);
    else
        rc = KVD_EPROTOCOL;
    inbox_release(c, &in);
    return rc;
}

/* A histogram from the daemon, when it is well formed (bounds increasing,
 * one count more than bounds); else none. */
static void take_hist(const Kvd__Histogram *h, struct kvd_histogram *out)
{
    memset(out, 0, sizeof(*out));
    if (h == NULL || h->n_bounds == 0 || h->n_bounds > KVD_HIST_MAX || h->n_counts != h->n_bounds + 1)
        return;
    for (size_t i = 1; i < h->n_bounds; i++)
        if (!(h->bounds[i] > h->bounds[i - 1]))
            return;
    out->n_bounds = (uint32_t)h->n_bounds;
    memcpy(out->bounds, h->bounds, h->n_bounds * sizeof(double));
    memcpy(out->counts, h->counts, h->n_counts * sizeof(uint64_t));
    out->sum = h->sum;
}

/* One field of a table in kvd_stats_fields.h from the reply's: numbers as
 * they are, strings cut to the C field (a missing one is ""). */
#define TAKE_U64(dst, src) (dst) = (src);
#define TAKE_U32(dst, src) (dst) = (src);
#define TAKE_I32(dst, src) (dst) = (src);
#define TAKE_BOOL(dst, src) (dst) = (src);
#define TAKE_STR48(dst, src) snprintf((dst), sizeof(dst), "%s", (src) ? (src) : "");
#define TAKE_STR64 TAKE_STR48
#define TAKE_STR128 TAKE_STR48
#define TAKE_FIELD(name, type, prom_type, prom_name, help) TAKE_##type(o->name, m->name)

/* Copies a reply's rows (n of them, ptrs) into a malloc'd array of *out_n
 * structs (NULL when none or out of memory), each field by its table. */
#define TAKE_ROWS(ptrs, n, out, out_n, FIELDS)                          \
    do {                                                                \
        (out) = (n) ? calloc((n), sizeof(*(out))) : NULL;               \
        for (size_t i_ = 0; i_ < (n) && (out) != NULL; i_++) {          \
            const __typeof__(*(ptrs)[0]) *m = (ptrs)[i_];               \
            __typeof__(*(out)) *o = &(out)[(out_n)++];                  \
            FIELDS(TAKE_FIELD)                                          \
        }                                                               \
    } while (0)

/* Stats from the daemon's reply; out was zeroed. */
static void take_stats(const Kvd__Stats *s, struct kvd_stats *out)
{
    {
        const Kvd__Stats *m = s;
        struct kvd_stats *o = out;
        KVD_STATS_FIELDS(TAKE_FIELD)
    }
    if (!s->has_kv_parts)
        out->kv_parts = 1;  /* a kvd before windowed parts */
    /* a description from the server: letters, digits, '_', ',', '+' and spaces only */
    size_t n = 0;
    for (const char *p = out->kv_type; *p != '\0'; p++)
        if (isalnum((unsigned char)*p) || *p == '_' || *p == ',' || *p == '+' || *p == ' ')
            out->kv_type[n++] = *p;
    out->kv_type[n] = '\0';
    take_hist(s->ttft_seconds, &out->ttft);
    take_hist(s->e2e_seconds, &out->e2e);
    take_hist(s->queue_seconds, &out->queue);
    take_hist(s->itl_seconds, &out->itl);
    TAKE_ROWS(s->workers, s->n_workers, out->workers, out->n_workers, KVD_WORKER_STATS_FIELDS);
    TAKE_ROWS(s->hosts, s->n_hosts, out->hosts, out->n_hosts, KVD_HOST_STATS_FIELDS);
    TAKE_ROWS(s->tenants, s->n_tenants, out->tenants, out->n_tenants, KVD_TENANT_STATS_FIELDS);
}

int kvd_stats(kvd_client_t *c, struct kvd_stats *out)
{
    if (c == NULL || out == NULL)
        return KVD_EINVAL;
    memset(out, 0, sizeof(*out));
    Kvd__StatsRequest sr = KVD__STATS_REQUEST__INIT;
    Kvd__ClientRequest req;
    init_request(&req, take_id(c));
    req.body_case = KVD__CLIENT_REQUEST__BODY_STATS;
    req.stats = &sr;
    struct inbox in;
    Kvd__ServerReply *r;
    int rc = call(c, &req, &in, &r, NULL, 0);
    if (rc != 0)
        return rc;
    if (r->body_case == KVD__SERVER_REPLY__BODY_STATS)
        take_stats(r->stats, out);
    else if (r->body_case == KVD__SERVER_REPLY__BODY_ERROR)
        rc = take_server_error(r->error, NULL, 0);
    else
        rc = KVD_EPROTOCOL;
    inbox_release(c, &in);
    return rc;
}

void kvd_stats_free(struct kvd_stats *s)
{
    if (s == NULL)
        return;
    free(s->workers);
    free(s->tenants);
    free(s->hosts);
    s->workers = NULL;
    s->tenants = NULL;
    s->hosts = NULL;
    s->n_workers = s->n_tenants = s->n_hosts = 0;
}

void kvd_pool_view_free(struct kvd_pool_view *v)
{
    if (v == NULL)
        return;
    for (size_t i = 0; v->hosts != NULL && i < v->n_hosts; i++)
        free(v->hosts[i].runs);
    free(v->hosts);
    free(v->tenants);
    free(v->prefixes);
    free(v->samples);
    memset(v, 0, sizeof(*v));
}

static int take_view(const Kvd__PoolView *pv, struct kvd_pool_view *out)
{
    out->hidden_tenant = pv->hidden_tenant;
    out->tenants = calloc(pv->n_tenants ? pv->n_tenants : 1, sizeof(*out->tenants));
    out->hosts = calloc(pv->n_hosts ? pv->n_hosts : 1, sizeof(*out->hosts));
    out->prefixes = calloc(pv->n_prefixes ? pv->n_prefixes : 1, sizeof(*out->prefixes));
    out->samples = calloc(pv->n_samples ? pv->n_samples : 1, sizeof(*out->samples));
    if (out->tenants == NULL || out->hosts == NULL || out->prefixes == NULL || out->samples == NULL)
        return KVD_ENOMEM;
    for (size_t i = 0; i < pv->n_tenants; i++)
        snprintf(out->tenants[i], sizeof(out->tenants[i]), "%s", pv->tenants[i] ? pv->tenants[i] : "");
    out->n_tenants = pv->n_tenants;
    for (size_t i = 0; i < pv->n_hosts; i++) {
        const Kvd__HostBlocks *h = pv->hosts[i];
        struct kvd_pool_host *x = &out->hosts[i];
        out->n_hosts = i + 1;
        if (h == NULL)
            continue;
        snprintf(x->name, sizeof(x->name), "%s", h->name ? h->name : "");
        x->blocks = h->blocks;
        x->cell_blocks = h->cell_blocks;
        size_t n = h->n_run_state;
        if (h->n_run_tenant < n)
            n = h->n_run_tenant;
        if (h->n_run_cells < n)
            n = h->n_run_cells;
        if ((x->runs = calloc(n ? n : 1, sizeof(*x->runs))) == NULL)
            return KVD_ENOMEM;
        for (size_t r = 0; r < n; r++)
            x->runs[r] = (struct kvd_pool_run){ h->run_state[r], h->run_tenant[r], h->run_cells[r] };
        x->n_runs = n;
    }
    for (size_t i = 0; i < pv->n_prefixes; i++) {
        const Kvd__PrefixNode *p = pv->prefixes[i];
        if (p == NULL)
            continue;
        struct kvd_prefix_node *x = &out->prefixes[out->n_prefixes++];
        /* a parent must come first: anything else is made a root */
        x->parent = p->parent >= 0 && (size_t)p->parent < i ? p->parent : -1;
        x->host = p->host;
        x->blocks = p->blocks;
        x->subtree_blocks = p->subtree_blocks;
        x->tenant = p->tenant;
        x->is_public = p->is_public;
        x->sharers = p->sharers;
        x->hits = p->hits;
        x->state = p->state;
        snprintf(x->text, sizeof(x->text), "%s", p->text ? p->text : "");
    }
    for (size_t i = 0; i < pv->n_samples; i++) {
        const Kvd__Sample *p = pv->samples[i];
        if (p == NULL)
            continue;
        out->samples[out->n_samples++] = (struct kvd_pool_sample){
            .prompt_tokens = p->prompt_tokens, .cached_prompt_tokens = p->cached_prompt_tokens,
            .completion_tokens = p->completion_tokens, .computed_tokens = p->computed_tokens,
            .first_tokens = p->first_tokens, .ttft_seconds = p->ttft_seconds,
        };
    }
    return 0;
}

int kvd_pool_view(kvd_client_t *c, const char *tenant, struct kvd_stats *st, struct kvd_pool_view *out)
{
    if (c == NULL || st == NULL || out == NULL)
        return KVD_EINVAL;
    memset(st, 0, sizeof(*st));
    memset(out, 0, sizeof(*out));
    Kvd__StatsRequest sr = KVD__STATS_REQUEST__INIT;
    sr.has_pool_view = true;
    sr.pool_view = true;
    sr.view_tenant = (char *)tenant;
    Kvd__ClientRequest req;
    init_request(&req, take_id(c));
    req.body_case = KVD__CLIENT_REQUEST__BODY_STATS;
    req.stats = &sr;
    struct inbox in;
    Kvd__ServerReply *r;
    int rc = call(c, &req, &in, &r, NULL, 0);
    if (rc != 0)
        return rc;
    if (r->body_case == KVD__SERVER_REPLY__BODY_STATS) {
        take_stats(r->stats, st);
        rc = r->stats->pool_view != NULL ? take_view(r->stats->pool_view, out) : KVD_EPROTOCOL;
    } else if (r->body_case == KVD__SERVER_REPLY__BODY_ERROR) {
        rc = take_server_error(r->error, NULL, 0);
    } else {
        rc = KVD_EPROTOCOL;
    }
    inbox_release(c, &in);
    return rc;
}

int kvd_health(kvd_client_t *c, bool *ok, uint32_t *workers_alive)
{
    if (c == NULL)
        return KVD_EINVAL;
    Kvd__HealthRequest hr = KVD__HEALTH_REQUEST__INIT;
    Kvd__ClientRequest req;
    init_request(&req, take_id(c));
    req.body_case = KVD__CLIENT_REQUEST__BODY_HEALTH;
    req.health = &hr;
    struct inbox in;
    Kvd__ServerReply *r;
    int rc = call(c, &req, &in, &r, NULL, 0);
    if (rc != 0)
        return rc;
    if (r->body_case == KVD__SERVER_REPLY__BODY_HEALTH) {
        if (ok != NULL)
            *ok = r->health->ok;
        if (workers_alive != NULL)
            *workers_alive = r->health->workers_alive;
    } else if (r->body_case == KVD__SERVER_REPLY__BODY_ERROR) {
        rc = take_server_error(r->error, NULL, 0);
    } else {
        rc = KVD_EPROTOCOL;
    }
    inbox_release(c, &in);
    return rc;
}

/* ---- pinned prefixes ---------------------------------------------------------------------- */

/* One cache request; on success *out is the reply (release `in` after). */
static int cache_call(kvd_client_t *c, Kvd__CacheRequest *cr, struct inbox *in, const Kvd__CacheReply **out,
                      char *err, size_t errlen)
{
    if (err != NULL && errlen > 0)
        err[0] = '\0';
    Kvd__ClientRequest req;
    init_request(&req, take_id(c));
    req.body_case = KVD__CLIENT_REQUEST__BODY_CACHE;
    req.cache = cr;
    char why[200];
    if (wire_check_client_request(&req, why, sizeof(why)) != 0)
        return kvd_seterr(err, errlen, KVD_EINVAL, "%s", why);
    Kvd__ServerReply *r;
    int rc = call(c, &req, in, &r, err, errlen);
    if (rc != 0)
        return rc;
    if (r->body_case == KVD__SERVER_REPLY__BODY_CACHE) {
        *out = r->cache;
        return 0;
    }
    rc = r->body_case == KVD__SERVER_REPLY__BODY_ERROR ? take_server_error(r->error, err, errlen)
                                                       : kvd_seterr(err, errlen, KVD_EPROTOCOL,
                                                                    "kvd answered a cache request with %s",
                                                                    body_name(r->body_case));
    inbox_release(c, in);
    return rc;
}

int kvd_cache_list(kvd_client_t *c, const char *ns, struct kvd_pin **pins, size_t *n, char *err, size_t errlen)
{
    if (c == NULL || pins == NULL || n == NULL)
        return KVD_EINVAL;
    *pins = NULL;
    *n = 0;
    Kvd__CacheRequest cr = KVD__CACHE_REQUEST__INIT;
    cr.has_op = true;
    cr.op = KVD__CACHE_REQUEST__OP__OP_LIST;
    cr.namespace_ = (char *)ns;
    struct inbox in;
    const Kvd__CacheReply *out;
    int rc = cache_call(c, &cr, &in, &out, err, errlen);
    if (rc != 0)
        return rc;
    if (out->n_pins > 0 && (*pins = calloc(out->n_pins, sizeof(**pins))) == NULL)
        rc = KVD_ENOMEM;
    for (size_t i = 0; rc == 0 && i < out->n_pins; i++)
        take_pin(out->pins[i], &(*pins)[i]);
    if (rc == 0)
        *n = out->n_pins;
    inbox_release(c, &in);
    return rc;
}

static int cache_drop(kvd_client_t *c, const char *ns, const char *pin_id, bool evict, struct kvd_pin *pin,
                      uint32_t *blocks_evicted, char *err, size_t errlen)
{
    if (c == NULL || pin_id == NULL)
        return KVD_EINVAL;
    Kvd__CacheRequest cr = KVD__CACHE_REQUEST__INIT;
    cr.has_op = true;
    cr.op = evict ? KVD__CACHE_REQUEST__OP__OP_EVICT : KVD__CACHE_REQUEST__OP__OP_UNPIN;
    cr.pin_id = (char *)pin_id;
    cr.namespace_ = (char *)ns;
    struct inbox in;
    const Kvd__CacheReply *out;
    int rc = cache_call(c, &cr, &in, &out, err, errlen);
    if (rc != 0)
        return rc;
    if (out->n_pins != 1)
        rc = kvd_seterr(err, errlen, KVD_EPROTOCOL, "kvd's answer names %zu pins, not the one that went",
                        out->n_pins);
    if (rc == 0 && pin != NULL)
        take_pin(out->pins[0], pin);
    if (rc == 0 && blocks_evicted != NULL)
        *blocks_evicted = out->blocks_evicted;
    inbox_release(c, &in);
    return rc;
}

int kvd_cache_unpin(kvd_client_t *c, const char *ns, const char *pin_id, struct kvd_pin *out, char *err,
                    size_t errlen)
{
    return cache_drop(c, ns, pin_id, false, out, NULL, err, errlen);
}

int kvd_cache_evict(kvd_client_t *c, const char *ns, const char *pin_id, struct kvd_pin *out,
                    uint32_t *blocks_evicted, char *err, size_t errlen)
{
    return cache_drop(c, ns, pin_id, true, out, blocks_evicted, err, errlen);
}

/* ---- tokens ------------------------------------------------------------------------------ */

/* One tokenize call; on success *out is the reply (release `in` after). */
static int tokenize_call(kvd_client_t *c, Kvd__TokenizeRequest *t, struct inbox *in, const Kvd__Tokens **out,
                         char *err, size_t errlen)
{
    Kvd__ClientRequest req;
    init_request(&req, take_id(c));
    req.body_case = KVD__CLIENT_REQUEST__BODY_TOKENIZE;
    req.tokenize = t;
    Kvd__ServerReply *r;
    int rc = call(c, &req, in, &r, NULL, 0);
    if (rc != 0)
        return rc;
    if (r->body_case == KVD__SERVER_REPLY__BODY_TOKENS) {
        *out = r->tokens;
        return 0;
    }
    rc = r->body_case == KVD__SERVER_REPLY__BODY_ERROR ? take_server_error(r->error, err, errlen) : KVD_EPROTOCOL;
    inbox_release(c, in);
    return rc;
}

int kvd_tokenize(kvd_client_t *c, const char *text, const struct kvd_chat_msg *messages, size_t n_messages,
                 int32_t **ids, size_t *n_ids, uint32_t *max_context, char *err, size_t errlen)
{
    if (err != NULL && errlen > 0)
        err[0] = '\0';
    if (c == NULL || ids == NULL || n_ids == NULL || (text == NULL && (messages == NULL || n_messages == 0)))
        return KVD_EINVAL;
    *ids = NULL;
    *n_ids = 0;
    Kvd__TokenizeRequest t = KVD__TOKENIZE_REQUEST__INIT;
    Kvd__ChatMessage *msgs = NULL, **ptrs = NULL;
    if (text != NULL) {
        t.text = (char *)text;
    } else {
        msgs = calloc(n_messages, sizeof(*msgs));
        ptrs = calloc(n_messages, sizeof(*ptrs));
        if (msgs == NULL || ptrs == NULL) {
            free(msgs);
            free(ptrs);
            return KVD_ENOMEM;
        }
        for (size_t i = 0; i < n_messages; i++) {
            kvd__chat_message__init(&msgs[i]);
            msgs[i].role = (char *)messages[i].role;
            msgs[i].content = (char *)messages[i].content;
            ptrs[i] = &msgs[i];
        }
        t.messages = ptrs;
        t.n_messages = n_messages;
    }
    struct inbox in;
    const Kvd__Tokens *out;
    int rc = tokenize_call(c, &t, &in, &out, err, errlen);
    free(msgs);
    free(ptrs);
    if (rc != 0)
        return rc;
    *ids = malloc((out->n_token_ids ? out->n_token_ids : 1) * sizeof(int32_t));
    if (*ids == NULL) {
        rc = KVD_ENOMEM;
    } else {
        memcpy(*ids, out->token_ids, out->n_token_ids * sizeof(int32_t));
        *n_ids = out->n_token_ids;
        if (max_context != NULL)
            *max_context = out->max_context;
    }
    inbox_release(c, &in);
    return rc;
}

int kvd_detokenize(kvd_client_t *c, const int32_t *ids, size_t n_ids, char **text, char *err, size_t errlen)
{
    if (err != NULL && errlen > 0)
        err[0] = '\0';
    if (c == NULL || text == NULL || (ids == NULL && n_ids > 0))
        return KVD_EINVAL;
    *text = NULL;
    if (n_ids == 0) {
        *text = strdup("");
        return *text ? 0 : KVD_ENOMEM;
    }
    Kvd__TokenizeRequest t = KVD__TOKENIZE_REQUEST__INIT;
    t.token_ids = (int32_t *)ids;
    t.n_token_ids = n_ids;
    struct inbox in;
    const Kvd__Tokens *out;
    int rc = tokenize_call(c, &t, &in, &out, err, errlen);
    if (rc != 0)
        return rc;
    *text = strdup(out->text ? out->text : "");
    inbox_release(c, &in);
    return *text ? 0 : KVD_ENOMEM;
}

/* ---- Prometheus text ------------------------------------------------------------------------ */

/* A growing text buffer; out of memory leaves it NULL. */
struct text {
    char *s;
    size_t len, cap;
    bool failed;
};

static void tprintf(struct text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tprintf(struct text *t, const char *fmt, ...)
{
    while (!t->failed) {
        va_list ap;
        va_start(ap, fmt);
        const size_t room = t->cap - t->len;
        const int n = vsnprintf(t->s ? t->s + t->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->failed = true;
            break;
        }
        if ((size_t)n < room) {
            t->len += (size_t)n;
            return;
        }
        const size_t cap = (t->cap + (size_t)n + 1) * 2;
        char *p = realloc(t->s, cap);
        if (p == NULL) {
            t->failed = true;
            break;
        }
        t->s = p;
        t->cap = cap;
    }
}

static void metric(struct text *t, const char *name, const char *type, const char *help, double v)
{
    tprintf(t, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

static void histogram(struct text *t, const char *name, const char *help, const struct kvd_histogram *h)
{
    tprintf(t, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (uint32_t i = 0; i < h->n_bounds; i++) {
        cum += h->counts[i];
        tprintf(t, "%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i], (unsigned long long)cum);
    }
    if (h->n_bounds > 0)
        cum += h->counts[h->n_bounds];
    tprintf(t, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.17g\n%s_count %llu\n", name, (unsigned long long)cum, name,
            h->sum, name, (unsigned long long)cum);
}

/* A label's value as the text format wants it (\\, \", \n escaped). */
static void prom_label(char *out, size_t cap, const char *key, const char *v)
{
    size_t o = (size_t)snprintf(out, cap, "%s=\"", key);
    for (const char *c = v; *c && o + 4 < cap; c++) {
        if (*c == '\\' || *c == '"' || *c == '\n')
            out[o++] = '\\';
        out[o++] = *c == '\n' ? 'n' : *c;
    }
    out[o++] = '"';
    out[o] = '\0';
}

/* Row labels: worker="id", host="name", tenant="name". */
typedef char prom_label_t[2 * 128 + 16];

/* A figure of a table with a Prometheus name: a metric of its own. */
#define PROM_NONE(name, help, v)
#define PROM_GAUGE(name, help, v) metric(&t, name, "gauge", help, (double)(v));
#define PROM_COUNTER(name, help, v) metric(&t, name, "counter", help, (double)(v));
#define PROM_FIELD(name, type, prom_type, prom_name, help) PROM_##prom_type(prom_name, help, st->name)

/* A figure of a row table with a Prometheus name: a family with one sample
 * per row (rows: the array, n of them, labels: theirs). */
#define PROM_ROWS(ptype, pname, help, rows, n, labels, field)                                    \
    do {                                                                                       \
        tprintf(&t, "# HELP %s %s\n# TYPE %s %s\n", pname, help, pname, ptype);                 \
        for (uint32_t i_ = 0; i_ < (n) && (labels) != NULL; i_++)                              \
            tprintf(&t, "%s{%s} %llu\n", pname, (labels)[i_], (unsigned long long)(rows)[i_].field); \
    } while (0);
#define PROM_ROWS_NONE(pname, help, rows, n, labels, field)
#define PROM_ROWS_GAUGE(...) PROM_ROWS("gauge", __VA_ARGS__)
#define PROM_ROWS_COUNTER(...) PROM_ROWS("counter", __VA_ARGS__)
#define PROM_WORKER(name, type, prom_type, prom_name, help) \
    PROM_ROWS_##prom_type(prom_name, help, st->workers, st->n_workers, wl, name)
#define PROM_HOST(name, type, prom_type, prom_name, help) \
    PROM_ROWS_##prom_type(prom_name, help, st->hosts, st->n_hosts, hl, name)
#define PROM_TENANT(name, type, prom_type, prom_name, help) \
    PROM_ROWS_##prom_type(prom_name, help, st->tenants, st->n_tenants, tl, name)

char *kvd_stats_prometheus(const struct kvd_stats *st)
{
    struct text t = { 0 };
    KVD_STATS_FIELDS(PROM_FIELD)
    /* what vLLM's names make of the figures */
    const double used = st->blocks_total ? (double)(st->blocks_in_use + st->blocks_pending) / st->blocks_total : 0;
    metric(&t, "vllm:kv_cache_usage_perc", "gauge", "Share of KV blocks held by requests (0..1).", used);
    metric(&t, "vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           (double)st->prompt_tokens);
    tprintf(&t, "# HELP vllm:cache_config_info The KV cache's configuration.\n"
                "# TYPE vllm:cache_config_info gauge\n"
                "vllm:cache_config_info{block_size=\"%u\",num_gpu_blocks=\"%u\",cache_dtype=\"%s\"} 1\n",
            st->block_tokens, st->blocks_total, st->kv_type);
    tprintf(&t, "# HELP vllm:request_success_total Finished requests by finish reason.\n"
                "# TYPE vllm:request_success_total counter\n"
                "vllm:request_success_total{finished_reason=\"stop\"} %llu\n"
                "vllm:request_success_total{finished_reason=\"length\"} %llu\n"
                "vllm:request_success_total{finished_reason=\"abort\"} %llu\n",
            (unsigned long long)st->finished_stop, (unsigned long long)st->finished_length,
            (unsigned long long)st->finished_abort);
    histogram(&t, "vllm:time_to_first_token_seconds", "Arrival to first token.", &st->ttft);
    histogram(&t, "vllm:e2e_request_latency_seconds", "Arrival to the final reply.", &st->e2e);
    histogram(&t, "vllm:request_queue_time_seconds", "Arrival to dispatch.", &st->queue);
    histogram(&t, "vllm:inter_token_latency_seconds", "Between tokens (a request's mean gap, per gap).",
              &st->itl);
    /* the rows: per worker, per host when there are other hosts' pools, per tenant */
    prom_label_t *wl = calloc(st->n_workers ? st->n_workers : 1, sizeof(*wl));
    prom_label_t *hl = calloc(st->n_hosts ? st->n_hosts : 1, sizeof(*hl));
    prom_label_t *tl = calloc(st->n_tenants ? st->n_tenants : 1, sizeof(*tl));
    if (wl == NULL || hl == NULL || tl == NULL)
        t.failed = true;
    for (uint32_t i = 0; wl != NULL && i < st->n_workers; i++)
        snprintf(wl[i], sizeof(wl[i]), "worker=\"%u\"", st->workers[i].id);
    for (uint32_t i = 0; hl != NULL && i < st->n_hosts; i++)
        prom_label(hl[i], sizeof(hl[i]), "host", st->hosts[i].name);
    for (uint32_t i = 0; tl != NULL && i < st->n_tenants; i++)
        prom_label(tl[i], sizeof(tl[i]), "tenant", st->tenants[i].name);
    KVD_WORKER_STATS_FIELDS(PROM_WORKER)
    if (st->n_hosts > 1) {
        KVD_HOST_STATS_FIELDS(PROM_HOST)
    }
    if (st->n_tenants > 0) {
        KVD_TENANT_STATS_FIELDS(PROM_TENANT)
    }
    free(wl);
    free(hl);
    free(tl);
    if (t.failed) {
        free(t.s);
        return NULL;
    }
    return t.s ? t.s : strdup("");
}
