/*
 * http.h - kvd's HTTP front end: OpenAI's chat and completion API, model
 * list, health and readiness probes, and Prometheus metrics.
 *
 * The HTTP layer is a client of kvd's own protocol: every HTTP request becomes
 * a request of the C client (clients/c) to one of kvd's ipc:// endpoints, so
 * it meets the same validation (proto/) and the same scheduler as any ZeroMQ
 * client, and nothing in the daemon's loop knows HTTP. It runs in threads of
 * its own, never in kvd's loop: libmicrohttpd's poll thread serves every
 * connection (an idle or half-sent one costs a descriptor and its buffer,
 * no thread), and each request that needs kvd runs on a thread of its own
 * while its connection is suspended.
 *
 *   POST /v1/chat/completions, POST /v1/completions   (stream or not)
 *   POST /tokenize, POST /detokenize, GET /tokenizer_info
 *   GET  /v1/models, GET /health, GET /ready, GET /metrics
 *   GET  / and /web/... (the page, web/), GET /pool (its data: the pools' picture)
 *
 * Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
 * 400 for a bad field (named in param) or a prompt past the context
 * (code context_length_exceeded), 401 without a valid API key, 404 for an
 * unknown path or model, 405, 413 for a body over the limit (or one whose
 * JSON would take too much memory), 415, 429 with Retry-After when kvd is
 * overloaded, 503 while it drains, has no worker, or the HTTP layer is at its
 * memory or request limit (with Retry-After), 504 past a deadline.
 *
 * What bounds it: connections in all and per client address, a deadline for
 * each request's head and body that bytes trickled in do not extend, an idle
 * timeout, the API key checked before a byte of the body is kept, the body's
 * size, the memory of every body and its parsed JSON together, and the
 * requests answered at once. A client that goes away (a closed connection)
 * cancels its request in kvd at once, whether it streams, waits for a whole
 * answer, or is still queued.
 */
#ifndef KVD_HTTP_H
#define KVD_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A special token of the model's vocabulary (GET /tokenizer_info). */
struct http_token {
    int32_t id;
    const char *text;           /* as the vocabulary spells it, NUL-terminated */
};

/* The model's tokenizer as GET /tokenizer_info tells it (vLLM's endpoint):
 * facts that do not change while kvd runs. http_start copies what it needs. */
struct http_tokenizer {
    const char *model;          /* the GGUF's tokenizer.ggml.model ("gpt2", "llama") */
    const char *chat_template;  /* the GGUF's tokenizer.chat_template (Jinja), or NULL */
    uint32_t n_vocab;           /* tokens in the vocabulary */
    uint32_t max_model_len;     /* kvd's context (--ctx) */
    int32_t bos, eos, pad, unk; /* ids, -1: the model has none */
    bool add_bos, add_eos;      /* what the model puts around a prompt */
    const struct http_token *special;   /* control and user-defined tokens, by id */
    size_t n_special;
};

struct http_params {
    const char *bind;           /* "HOST:PORT" (IPv4 address or "localhost") */
    const char *kvd_endpoint;   /* where the HTTP layer reaches kvd (ipc://) */
    const char *model_id;       /* the model's name in responses and /v1/models */
    uint32_t max_body;          /* largest request body in bytes */
    uint32_t block_tokens;      /* for /metrics' cache_config_info */
    const struct http_tokenizer *tokenizer;  /* for /tokenizer_info and /tokenize (NULL: a 404) */
    const char *api_keys;       /* NULL, or a file of "KEY TENANT" lines: then the API needs
                                 * Authorization: Bearer KEY (401 otherwise), and a request's
                                 * cache namespace is its key's tenant (plus the request's own
                                 * "namespace" inside it) */
    const char *operator_key;   /* NULL, or a file holding the operator's key: /metrics with it
                                 * carries every tenant's rows (a tenant's key: its own row;
                                 * no key: none) */
    uint32_t max_conns;         /* connections at once, in all (fewer when descriptors are short) */
    uint32_t max_conns_per_ip;  /* connections at once from one client address */
    uint32_t timeout_s;         /* a request's head and body must arrive within this many seconds
                                 * of the connection's start or the previous response's end; a
                                 * connection where nothing moves for as long (while kvd computes
                                 * nothing for it) is closed */
    uint64_t max_memory;        /* bytes every request body and its parsed JSON may hold together */
    uint32_t max_requests;      /* requests being answered at once (a thread and a client of kvd
                                 * each); more get a 503 */
};

typedef struct http_server http_server_t;

/* Starts serving; NULL with a reason in err (an address that cannot be
 * parsed or bound, a key file that cannot be read). */
http_server_t *http_start(const struct http_params *p, char *err, size_t errlen);

/* Stops accepting new connections (kvd drains); those open are served on. */
void http_quiesce(http_server_t *s);

/* Stops accepting, gives up every request in flight (each cancelled in kvd),
 * ends every connection and frees; accepts NULL. */
void http_stop(http_server_t **s);

#endif
