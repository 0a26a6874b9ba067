/*
 * kvd_client.h - the C client of kvd.
 *
 * A client holds one ZeroMQ DEALER connection to a kvd endpoint (ipc:// or
 * tcp://) and runs one request at a time, blocking: generate (whole result),
 * generate with a callback per streamed chunk, stats, health, cancel. It is
 * not thread-safe; use one client per thread. Every call that waits gives up
 * after the client's timeout without a message from the daemon (KVD_ETIMEOUT;
 * a daemon that is not running is a timeout, never a hang). Errors are the
 * negative KVD_E* codes of err.h, named by kvd_strerror(); errors from the
 * daemon also leave its message (and retry-after for KVD_EOVERLOADED) in the
 * result.
 *
 * Link with pkg-config --cflags --libs kvd-client.
 */
#ifndef KVD_CLIENT_H
#define KVD_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "kvd_stats_fields.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvd_client kvd_client_t;

/* Writes the endpoint kvd listens on by default ("ipc://" + a socket in a
 * private runtime directory: $XDG_RUNTIME_DIR/kvd, else /tmp/kvd-<uid>) or
 * $KVD_ENDPOINT when set. Returns buf. (Defined in common/endpoint.c, which
 * kvd shares.) */
char *kvd_default_endpoint(char *buf, size_t len);

/* CURVE keys for a kvd that authenticates its clients (kvd --curve-secret):
 * the server's public key (a certificate file, or its 40 Z85 characters)
 * and this client's own certificate with its secret key (kvd-keygen). kvd
 * names the client's tenant after its public key. */
struct kvd_client_keys {
    const char *server_key;
    const char *client_cert;
};

/* Connects to endpoint (NULL: kvd_default_endpoint()); timeout_ms <= 0 means
 * 30,000. Returns NULL with a reason in err for a malformed endpoint or no
 * memory (connecting itself is lazy: a missing daemon shows as timeouts). */
kvd_client_t *kvd_client_new(const char *endpoint, int timeout_ms, char *err, size_t errlen);

/* The same with CURVE keys (NULL: none). kvd_client_new takes them from
 * $KVD_CURVE_SERVER_KEY and $KVD_CURVE_CERT when both are set. A call of a
 * client whose keys kvd refuses (or whose handshake fails) ends with
 * KVD_EAUTH, not a timeout. A bad key file: NULL with the reason. */
kvd_client_t *kvd_client_new_keys(const char *endpoint, int timeout_ms, const struct kvd_client_keys *keys,
                                  char *err, size_t errlen);

/* kvd_client_new_keys without keys, on the caller's ZeroMQ context zctx
 * (what zmq_ctx_new returned) instead of one of its own, so that the many
 * clients of one process share its I/O thread. zctx must outlive the
 * client, which leaves it as it is when destroyed. */
kvd_client_t *kvd_client_new_in(void *zctx, const char *endpoint, int timeout_ms, char *err, size_t errlen);

/* Closes the connection; accepts NULL and sets *c to NULL. */
void kvd_client_destroy(kvd_client_t **c);

void kvd_client_set_timeout(kvd_client_t *c, int timeout_ms);

/* A descriptor the client watches besides kvd while a call waits (-1, the
 * default: none). Once it is readable, or reports an error or a hang-up, a
 * waiting call gives up at once with KVD_ECANCELLED: a generate in progress
 * is cancelled at kvd first, without waiting for kvd to confirm. The caller
 * owns fd (kvd's HTTP front end makes one readable when its HTTP client goes
 * away, or at shutdown). */
void kvd_client_set_abort_fd(kvd_client_t *c, int fd);

struct kvd_chat_msg {
    const char *role;       /* "system", "user", "assistant", "tool" (a tool's result) */
    const char *content;
};

/* An assistant message's tool calls, each the JSON text {"name": ...,
 * "arguments": {...}}. */
struct kvd_tool_calls {
    const char *const *json;
    size_t n;
};

/* What to generate. Exactly one of prompt, messages, token_ids. Unset
 * sampling fields (negative) take the daemon's defaults. */
struct kvd_gen_params {
    const char *prompt;                     /* text, used as is */
    const struct kvd_chat_msg *messages;    /* chat, through the model's template */
    size_t n_messages;
    const int32_t *token_ids;               /* ids, used as given */
    size_t n_token_ids;
    uint32_t max_tokens;                    /* 0: daemon default (256) */
    float temperature;                      /* 0: greedy; < 0: default */
    int32_t top_k;                          /* < 0: default */
    float top_p;                            /* < 0: default */
    float min_p;                            /* < 0: default */
    float repeat_penalty;                   /* < 0: default */
    int64_t seed;                           /* < 0: random (unless has_seed_u64) */
    const char *const *stop;                /* stop strings */
    size_t n_stop;
    uint32_t deadline_ms;                   /* 0: none */
    const char *ns;                         /* cache namespace; NULL: default */
    bool ignore_eos;
    bool no_cache;                          /* bypass the prefix cache */
    int32_t logprobs;                       /* < 0: none (default); 0..20: each output token's
                                             * logprob and this many most likely alternatives */
    bool has_seed_u64;                      /* the seed is seed_u64, any of the 2^64 (seed ignored) */
    uint64_t seed_u64;
    float presence_penalty;                 /* [-2, 2], OpenAI's: off the logit of each token the
                                             * output holds; 0: off (default) */
    float frequency_penalty;                /* [-2, 2]: off the logit per time the output holds it */
    const int32_t *logit_bias_ids;          /* distinct token ids, at most 1,024, with: */
    const float *logit_bias;                /* [-100, 100] added to each one's logit */
    size_t n_logit_bias;
    int32_t prompt_logprobs;                /* < 0: none (default); 0..20: each prompt token's logprob
                                             * given those before it, and this many alternatives (the
                                             * positions scored are computed, not read from the cache) */
    bool prefill_only;                      /* compute the prompt (fill the cache, score it) and
                                             * generate nothing */
    const char *json_schema;                /* structured output: the output validates against this
                                             * JSON Schema (text; NULL: none) */
    bool json_object;                       /* structured output: the output is a JSON object */
    const struct kvd_tool_calls *tool_calls;    /* NULL, or one per message: an assistant's calls */
    const char *const *tools;               /* function definitions (JSON text of OpenAI's function
                                             * objects), shown to the model (messages only) */
    size_t n_tools;
    const char *tool_choice;                /* NULL or "auto": nothing enforced; "required": the
                                             * output is calls of the tools; a name: it calls that one */
    bool parallel_tool_calls;               /* required or a name: up to 16 calls (else one) */
    int context_overflow;                   /* at the daemon's context: KVD_OVERFLOW_DEFAULT (its
                                             * --context-overflow), _STOP or _WINDOW (keep the first
                                             * --sinks tokens and the newer half, and go on) */
    uint32_t pin_ttl_s;                     /* > 0: once the prompt is cached, pin its full blocks for
                                             * this many seconds (1 to kvd's --pin-max-ttl): never
                                             * evicted before then; with prefill_only, a warm-up that
                                             * pins (the result's pin, or pin_error) */
    uint32_t pin_messages;                  /* with pin_ttl_s and messages: pin only the prefix the
                                             * first N messages render to (0: the whole prompt) */
};

enum { KVD_OVERFLOW_DEFAULT = 0, KVD_OVERFLOW_STOP = 1, KVD_OVERFLOW_WINDOW = 2 };

/* Fills p with "nothing set" (NULL prompt, negative sampling fields). */
void kvd_gen_params_init(struct kvd_gen_params *p);

enum kvd_finish {
    KVD_FINISH_NONE = 0,
    KVD_FINISH_STOP = 1,      /* end-of-generation token or stop string */
    KVD_FINISH_LENGTH = 2,    /* max_tokens or the context */
    KVD_FINISH_CANCELLED = 3,
    KVD_FINISH_DEADLINE = 4,
};

#define KVD_MAX_TOP_LOGPROBS 20
#define KVD_MAX_LOGIT_BIAS 1024     /* entries of kvd_gen_params.logit_bias */

/* An output token's log-probability under the model (the log-softmax of the
 * raw logits, before penalties, truncation and temperature), with the most
 * likely tokens at its position, most likely first. The token texts are the
 * tokens' bytes, not NUL-terminated; a token may hold part of a UTF-8
 * character. They belong to the result (or, in a chunk callback, to the
 * call's result) and live as long as it does. */
struct kvd_logprob {
    float logprob;                          /* NaN: none (a prompt's first token) */
    uint32_t rank;                          /* the token's place by logit, 1: the most likely; 0: not known */
    const char *token;
    size_t token_len;
    uint32_t n_top;
    int32_t top_ids[KVD_MAX_TOP_LOGPROBS];
    float top_logprobs[KVD_MAX_TOP_LOGPROBS];
    const char *top_tokens[KVD_MAX_TOP_LOGPROBS];
    size_t top_token_lens[KVD_MAX_TOP_LOGPROBS];
};

/* A pinned prefix (kvd's explicit prompt-cache control): blocks kept in the
 * pool until expires_unix_ms. */
struct kvd_pin {
    char id[40];                    /* "pin_" and 32 hex digits */
    char tenant[128];               /* "" for none */
    char ns[257];                   /* the namespace its request named */
    uint32_t tokens;                /* prompt tokens pinned (whole blocks) */
    uint32_t blocks;                /* blocks it holds */
    uint32_t ttl_s;
    uint64_t hits;                  /* requests whose cached prefix covered it */
    uint64_t created_unix_ms, expires_unix_ms;
};

struct kvd_result {
    char *text;                     /* NUL-terminated output (malloc'd) */
    size_t text_len;
    int32_t *tokens;                /* output token ids (malloc'd) */
    size_t n_tokens;
    struct kvd_logprob *logprobs;   /* one per output token when asked (malloc'd), else NULL */
    size_t n_logprobs;
    struct kvd_logprob *prompt_logprobs; /* with prompt_logprobs: one per prompt token, the first
                                     * without a logprob (malloc'd), else NULL */
    size_t n_prompt_logprobs;
    int32_t *prompt_ids;            /* with prompt_logprobs: the prompt's token ids (malloc'd) */
    void *lp_bytes;                 /* internal: where the logprobs' token texts are */
    int finish_reason;              /* enum kvd_finish */
    uint32_t prompt_tokens;
    uint32_t cached_prompt_tokens;  /* prompt tokens whose K/V came from the cache */
    uint32_t host_cached_prompt_tokens; /* of those, copied back from the host tier */
    uint32_t disk_cached_prompt_tokens; /* and read back from the disk tier */
    uint32_t completion_tokens;
    double queued_ms, ttft_ms, decode_ms, total_ms; /* the daemon's timings */
    uint32_t chunks;                /* streamed chunks received */
    uint64_t request_id;            /* the id this client gave the request */
    char error[256];                /* the daemon's message when a call failed */
    uint32_t retry_after_ms;        /* with KVD_EOVERLOADED */
    /* appended in 0.1 (issue 40): cached_prompt_tokens were read from the
     * cache, cache_creation_tokens computed and written to it (full blocks it
     * indexed); prompt_tokens - both = computed without caching (a partial last
     * block, no_cache, a block another request computed at the same time) */
    uint32_t cache_creation_tokens;
    uint32_t cached_blocks;         /* the prompt's blocks in the cache when it ended */
    bool has_pin;                   /* with pin_ttl_s: the pin was made or renewed: */
    struct kvd_pin pin;
    char pin_error[224];            /* with pin_ttl_s and no pin: why (the output is whole) */
};

/* Frees what a result holds (not the struct) and zeroes it. */
void kvd_result_free(struct kvd_result *r);

/* Called for each streamed chunk: new text (whole UTF-8 characters) and
 * token ids, seq counting from 0. Returning non-zero cancels the request (the
 * call then returns KVD_ECANCELLED with what came so far in the result). */
typedef int (*kvd_chunk_fn)(void *user, const char *text, size_t len, const int32_t *tokens,
                            size_t n_tokens, uint32_t seq);

/* One streamed chunk, as kvd_generate_chunks hands it over. */
struct kvd_chunk {
    const char *text;                       /* new text: whole UTF-8 characters */
    size_t len;
    const int32_t *tokens;                  /* new token ids */
    size_t n_tokens;
    const struct kvd_logprob *logprobs;     /* n_tokens of them when asked, else NULL */
    uint32_t seq;                           /* from 0 */
};
typedef int (*kvd_chunk_cb)(void *user, const struct kvd_chunk *c);

/* Runs a request to its end. 0 and *out filled (free with kvd_result_free),
 * or a negative code: the daemon's error (KVD_EBADREQUEST, KVD_EOVERLOADED,
 * KVD_ETOOLONG, KVD_EDEADLINE, KVD_EUNAVAILABLE, KVD_ESHUTDOWN, ...) with its
 * message in out->error, or KVD_ETIMEOUT / KVD_EPROTOCOL / KVD_EINVAL. */
int kvd_generate(kvd_client_t *c, const struct kvd_gen_params *p, struct kvd_result *out);

/* The same, streaming: fn is called per chunk as it arrives. */
int kvd_generate_stream(kvd_client_t *c, const struct kvd_gen_params *p, kvd_chunk_fn fn,
                        void *user, struct kvd_result *out);

/* The same, with each chunk in one struct (its logprobs included). */
int kvd_generate_chunks(kvd_client_t *c, const struct kvd_gen_params *p, kvd_chunk_cb fn,
                        void *user, struct kvd_result *out);

/* Asks the daemon to cancel request_id (one of this client's); 0, or
 * KVD_ENOTFOUND when the daemon does not know it, or a transport error. */
int kvd_cancel(kvd_client_t *c, uint64_t request_id);

/* The statistics' fields are declared once, in kvd_stats_fields.h: each
 * struct below holds one field per line of its table, in the table's order,
 * named as in kvd.proto. */

/* A worker process (KVD_WORKER_STATS_FIELDS). */
struct kvd_worker_stats {
#define KVD_X(name, type, prom_type, prom_name, help) KVD_STATS_DECL(type, name)
    KVD_WORKER_STATS_FIELDS(KVD_X)
#undef KVD_X
};

/* A pool kvd dispatches to: its own (name ""), or another host's (kvd-worker
 * --host NAME) (KVD_HOST_STATS_FIELDS). */
struct kvd_host_stats {
#define KVD_X(name, type, prom_type, prom_name, help) KVD_STATS_DECL(type, name)
    KVD_HOST_STATS_FIELDS(KVD_X)
#undef KVD_X
};

/* One tenant (kvd's per-tenant statistics): a CURVE client's key name or an
 * HTTP API key's tenant (KVD_TENANT_STATS_FIELDS). */
struct kvd_tenant_stats {
#define KVD_X(name, type, prom_type, prom_name, help) KVD_STATS_DECL(type, name)
    KVD_TENANT_STATS_FIELDS(KVD_X)
#undef KVD_X
};

#define KVD_HIST_MAX 32
struct kvd_histogram {
    uint32_t n_bounds;              /* 0: the daemon sent none */
    double bounds[KVD_HIST_MAX];    /* upper bounds, increasing */
    uint64_t counts[KVD_HIST_MAX + 1];  /* per bucket (not cumulative); the last above every bound */
    double sum;
};

/* kvd's statistics: the scalar fields of KVD_STATS_FIELDS (requests_done,
 * blocks_free, host_cache_declined, ...), then the rows and the latencies.
 * The rows are malloc'd (kvd_stats_free), NULL when there are none. */
struct kvd_stats {
#define KVD_X(name, type, prom_type, prom_name, help) KVD_STATS_DECL(type, name)
    KVD_STATS_FIELDS(KVD_X)
#undef KVD_X
    struct kvd_worker_stats *workers;   /* n_workers, in kvd's order */
    uint32_t n_workers;
    struct kvd_tenant_stats *tenants;   /* n_tenants rows, every tenant kvd has an entry for (a
                                         * tenant's client: its own) */
    uint32_t n_tenants;
    struct kvd_host_stats *hosts;       /* n_hosts: kvd's own pool first, then other hosts' */
    uint32_t n_hosts;
    /* latencies of finished requests, seconds: time to first token, end to end,
     * queued, and between tokens (each request's mean gap, once per gap) */
    struct kvd_histogram ttft, e2e, queue, itl;
};

/* kvd's statistics into *out; free what it holds with kvd_stats_free. 0, or
 * a transport error or kvd's (out then holds nothing to free). */
int kvd_stats(kvd_client_t *c, struct kvd_stats *out);

/* Frees what a kvd_stats filled holds (the worker, tenant and host rows)
 * and sets them to none; accepts NULL. */
void kvd_stats_free(struct kvd_stats *s);

/* The pools as a picture (kvd --http's page): each host's blocks by state
 * and tenant in runs of cells, the largest cached prefix trees and the last
 * minutes' samples. Bounded whatever the pool's size (kvd.proto's PoolView). */
enum kvd_block_state { KVD_BLOCK_FREE, KVD_BLOCK_CACHED, KVD_BLOCK_IN_USE, KVD_BLOCK_PENDING, KVD_BLOCK_FENCED };

struct kvd_pool_run {
    uint32_t state;                 /* enum kvd_block_state */
    uint32_t tenant;                /* 0: none; i + 1: tenants[i]; hidden_tenant: not the viewer's */
    uint32_t cells;                 /* cells in the run */
};

struct kvd_pool_host {
    char name[64];                  /* "" for kvd's own pool */
    uint32_t blocks;
    uint32_t cell_blocks;           /* blocks a cell stands for (its state: most of theirs) */
    struct kvd_pool_run *runs;      /* n_runs, in block order */
    size_t n_runs;
};

struct kvd_prefix_node {
    int32_t parent;                 /* index in prefixes (before this one); -1: a root */
    uint32_t host;                  /* index in hosts */
    uint32_t blocks;                /* blocks of the chain it stands for */
    uint32_t subtree_blocks;        /* with every block below it */
    uint32_t tenant;                /* as in kvd_pool_run */
    bool is_public;                 /* in --public-prefix's namespace */
    uint32_t sharers;               /* sequences holding its first block now */
    uint64_t hits;                  /* requests that took its last block from the cache */
    uint32_t state;                 /* its last block's enum kvd_block_state */
    char text[72];                  /* its first tokens' text (at most 64 bytes, UTF-8) */
};

struct kvd_pool_sample {            /* one second */
    uint64_t prompt_tokens, cached_prompt_tokens, completion_tokens, computed_tokens;
    uint32_t first_tokens;          /* requests finished having had a first token, */
    double ttft_seconds;            /* and the sum of their times to it */
};

struct kvd_pool_view {
    char (*tenants)[128];           /* n_tenants names (a tenant's view: its own alone) */
    size_t n_tenants;
    uint32_t hidden_tenant;
    struct kvd_pool_host *hosts;
    size_t n_hosts;
    struct kvd_prefix_node *prefixes;   /* parents first */
    size_t n_prefixes;
    struct kvd_pool_sample *samples;    /* oldest first */
    size_t n_samples;
};

/* kvd's statistics and the picture of its pools, as tenant sees them (a
 * client of kvd's ipc:// socket may name any: "" an anonymous client, NULL
 * all of it; a tenant's own client always gets its own). Free both with
 * kvd_stats_free and kvd_pool_view_free, whatever this returns. 0, or a
 * transport error or kvd's. */
int kvd_pool_view(kvd_client_t *c, const char *tenant, struct kvd_stats *st, struct kvd_pool_view *out);

/* Frees what kvd_pool_view filled and sets it to none; accepts NULL. */
void kvd_pool_view_free(struct kvd_pool_view *v);

/* The statistics in Prometheus' text format (version 0.0.4), as kvd's HTTP
 * /metrics serves them: vLLM's names for what an inference gateway reads
 * (vllm:num_requests_running, vllm:num_requests_waiting,
 * vllm:kv_cache_usage_perc, vllm:prefix_cache_queries_total and _hits_total in
 * tokens, vllm:num_preemptions_total, vllm:prompt_tokens_total,
 * vllm:generation_tokens_total, vllm:cache_config_info), kvd's own under kvd_.
 * A malloc'd string, or NULL without memory. */
char *kvd_stats_prometheus(const struct kvd_stats *s);

/* The token ids kvd would compute for a prompt: text (tokenized as a
 * generate request's prompt is, a BOS first when the model wants one) or,
 * with text NULL, chat messages through the model's template. *ids is
 * malloc'd (free it); *max_context, when not NULL, gets the longest sequence
 * kvd serves. 0, KVD_EBADREQUEST with kvd's message in err, or a transport
 * error. */
int kvd_tokenize(kvd_client_t *c, const char *text, const struct kvd_chat_msg *messages, size_t n_messages,
                 int32_t **ids, size_t *n_ids, uint32_t *max_context, char *err, size_t errlen);

/* The text of token ids (bytes that are not valid UTF-8 come back as U+FFFD);
 * *text is malloc'd. Errors as kvd_tokenize (an id out of the vocabulary:
 * KVD_EBADREQUEST). */
int kvd_detokenize(kvd_client_t *c, const int32_t *ids, size_t n_ids, char **text, char *err, size_t errlen);

/*
 * The pinned prefixes (pins.h in kvd) of the client's tenant: its CURVE key's,
 * or the tenant a namespace "tenant:NAME/..." names (ns; NULL: none). A client
 * of the ipc:// socket naming none sees every pin. A pin is made by a generate
 * with pin_ttl_s (prefill_only: a warm-up that pins and generates nothing).
 *
 * kvd_cache_list: *pins (malloc'd, free it; NULL when none) and *n.
 * kvd_cache_unpin: the pin goes, its blocks stay cached (evictable).
 * kvd_cache_evict: the pin goes and its blocks leave the pool now
 * (*blocks_evicted, when not NULL, counts them).
 * out (when not NULL) gets the pin that went. 0, KVD_ENOTFOUND for a pin the
 * tenant does not have (another tenant's is as absent as one that never
 * was), KVD_EBADREQUEST / KVD_EINVAL with kvd's message in err, or a
 * transport error.
 */
int kvd_cache_list(kvd_client_t *c, const char *ns, struct kvd_pin **pins, size_t *n, char *err, size_t errlen);
int kvd_cache_unpin(kvd_client_t *c, const char *ns, const char *pin_id, struct kvd_pin *out, char *err,
                    size_t errlen);
int kvd_cache_evict(kvd_client_t *c, const char *ns, const char *pin_id, struct kvd_pin *out,
                    uint32_t *blocks_evicted, char *err, size_t errlen);

/* ok: at least one worker is alive. */
int kvd_health(kvd_client_t *c, bool *ok, uint32_t *workers_alive);

#ifdef __cplusplus
}
#endif

#endif
