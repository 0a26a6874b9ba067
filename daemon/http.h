/*
 * http.h - kvd's HTTP front end: OpenAI's chat and completion API, model
 * list, health and readiness probes, and Prometheus metrics.
 *
 * The HTTP layer is a client of kvd's own protocol: every HTTP request becomes
 * a request of the C client (clients/c) to one of kvd's ipc:// endpoints, so
 * it meets the same validation (proto/) and the same scheduler as any ZeroMQ
 * client, and nothing in the daemon's loop knows HTTP. It runs in threads of
 * its own (libmicrohttpd, one thread per connection), never in kvd's loop.
 *
 *   POST /v1/chat/completions, POST /v1/completions   (stream or not)
 *   GET  /v1/models, GET /health, GET /ready, GET /metrics
 *
 * Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
 * 400 for a bad field (named in param) or a prompt past the context
 * (code context_length_exceeded), 404 for an unknown path or model, 413 for a
 * body over the limit, 429 with Retry-After when kvd is overloaded, 503 while
 * it drains or has no worker, 504 past a deadline. A client that goes away in
 * the middle of a stream cancels its request at once. With API keys, a
 * missing or unknown key is a 401 (the probes and /metrics stay open).
 */
#ifndef KVD_HTTP_H
#define KVD_HTTP_H

#include <stddef.h>
#include <stdint.h>

struct http_params {
    const char *bind;           /* "HOST:PORT" (IPv4 address or "localhost") */
    const char *kvd_endpoint;   /* where the HTTP layer reaches kvd (ipc://) */
    const char *model_id;       /* the model's name in responses and /v1/models */
    uint32_t max_body;          /* largest request body in bytes */
    uint32_t block_tokens;      /* for /metrics' cache_config_info */
    const char *api_keys;       /* NULL, or a file of "KEY TENANT" lines: then the API needs
                                 * Authorization: Bearer KEY (401 otherwise), and a request's
                                 * cache namespace is its key's tenant (plus the request's own
                                 * "namespace" inside it) */
};

typedef struct http_server http_server_t;

/* Starts serving; NULL with a reason in err (an address that cannot be
 * parsed or bound). */
http_server_t *http_start(const struct http_params *p, char *err, size_t errlen);

/* Stops accepting new connections (kvd drains); those open are served on. */
void http_quiesce(http_server_t *s);

/* Stops accepting, ends every connection and frees; accepts NULL. */
void http_stop(http_server_t **s);

#endif
