/*
 * kvd.h - the coordinator's state, shared by its parts; each part's functions
 * are in its own header:
 *
 *   kvd.c        options, sockets, signals, the event loop, shutdown
 *   requests.h   client requests (requests.c and the files its private
 *                header req_internal.h lists: admission, dispatch, output,
 *                windowing, statistics)
 *   workers.h    worker processes: spawn, register, heartbeats, death, messages
 *   hosts.h      other hosts' pools
 *   tiers.h      the host and disk tiers below the pool (restore.h: their
 *                copies back, off the loop)
 *   pins.h       pinned prefixes and the cache requests
 *   view.h       the pools as a picture
 *   gpu.h        --gpu: the pool's KV data in device memory, handed to workers
 *   http.h, events.h, auth.h: the HTTP API, block events, CURVE clients
 *
 * kvd is single-threaded: one zmq_poll loop owns every structure here, so
 * nothing locks. It is the only writer of the pool's metadata (shm/prefix.h);
 * workers only compute into the blocks it hands them.
 */
#ifndef KVD_DAEMON_H
#define KVD_DAEMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "chat.h"
#include "cli.h"
#include "events.h"
#include "kvcache.h"
#include "model.h"
#include "pool.h"
#include "prefix.h"
#include "sampler.h"
#include "disktier.h"
#include "auth.h"
#include "restore.h"
#include "tier.h"
#include "tok.h"
#include "wire.h"

#define KVD_MAX_WORKERS 64
#define KVD_MAX_HOSTS 32         /* kvd's own pool and 31 other hosts' */
#define KVD_HOST_NAME_MAX 63
#define KVD_MAX_LISTEN 8
#define KVD_MAX_HTTP 4
#define KVD_RID_MAX 256          /* bytes of a ZeroMQ routing id (a client's: one more, first,
                                  * naming the socket it came on: RID_PLAIN or RID_CURVE) */
enum { RID_PLAIN = 0, RID_CURVE = 1 };

struct kvd_options {
    const char *model;              /* --model */
    const char *listen[KVD_MAX_LISTEN]; /* --listen (default: kvd_default_endpoint()) */
    int n_listen;
    bool allow_remote;              /* --allow-remote: permit binding all interfaces */
    const char *worker_endpoint;    /* --worker-endpoint (default: ipc in the runtime dir) */
    const char *pool;               /* --pool NAME (default kvd-<pid>, removed at exit) */
    uint64_t kv_bytes;              /* --kv-memory */
    int n_workers;                  /* --workers (0: accept external workers only) */
    int threads;                    /* --threads per worker (0: CPUs / workers) */
    uint32_t ctx;                   /* --ctx: longest sequence */
    bool window;                    /* --context-overflow window: sequences window at --ctx */
    uint32_t sinks;                 /* --sinks: first tokens a window keeps (default 4) */
    uint32_t block_tokens;          /* --block-tokens */
    struct kv_params kv;            /* --kv-type, --k-type, --v-type, --kv-rotate: its types
                                     * and rotation (block_tokens, n_blocks unused) */
    uint32_t step_tokens;           /* --step-tokens: a worker's token budget per step */
    uint32_t max_batch;             /* --max-batch: sequences per worker */
    uint32_t max_queue;             /* --max-queue: queued requests before OVERLOADED */
    uint32_t worker_timeout_ms;     /* --worker-timeout: no heartbeat or progress -> dead */
    uint32_t grace_ms;              /* --grace: how long SIGTERM lets requests finish */
    int max_restarts;               /* --max-restarts per worker slot */
    int gpu;                        /* --gpu: CUDA device holding the KV pool; -1: host memory */
    int workers_per_gpu;            /* --workers-per-gpu (-1: not given) */
    bool verbose;                   /* -v */
    const char *http[KVD_MAX_HTTP]; /* --http HOST:PORT: the OpenAI-compatible API (daemon/http.h) */
    int n_http;
    uint32_t max_body;              /* --max-body: largest HTTP request body, bytes */
    const char *model_name;         /* --served-model-name (default: the file's name, no .gguf) */
    const char *api_keys;           /* --api-keys FILE: "KEY TENANT" lines; the HTTP API needs a key */
    const char *operator_key;       /* --operator-key FILE: the key whose /metrics show every tenant */
    uint64_t http_max_memory;       /* --http-max-memory: request bodies and their JSON, together */
    uint32_t http_max_conns;        /* --http-max-conns: connections at once */
    uint32_t http_max_conns_per_ip; /* --http-max-conns-per-ip */
    uint32_t http_timeout_s;        /* --http-timeout: a request's head and body must be in by then */
    uint32_t http_max_requests;     /* --http-max-requests: requests answered at once */
    const char *kv_events;          /* --kv-events ENDPOINT: publish block events (daemon/events.h) */
    const char *kv_events_topic;    /* --kv-events-topic (default kv@HOST@MODEL, as llm-d expects) */
    bool kv_events_all_tokens;      /* --kv-events-token-ids all: a tenant's blocks' token ids too */
    const char *events_allow;       /* --events-allow: the keys that may subscribe over tcp:// */
    uint64_t host_cache_bytes;      /* --host-cache: the host tier's budget; 0: none */
    const char *cache_dir;          /* --cache-dir: the disk tier's directory; NULL: none */
    uint64_t disk_cache_bytes;      /* --disk-cache: its budget */
    const char *curve_secret;       /* --curve-secret: kvd's CURVE key pair; tcp:// needs it */
    const char *clients_allow;      /* --clients-allow: clients' public keys (tenants) */
    const char *workers_allow;      /* --workers-allow: remote workers' public keys */
    bool insecure;                  /* --insecure: tcp:// without CURVE allowed */
    bool curve_ipc;                 /* --curve-ipc: the ipc:// endpoints want CURVE too */
    uint32_t tenant_max_queue;      /* --tenant-max-queue: one tenant's queued requests; 0: no limit */
    uint32_t max_tenants;           /* --max-tenants: tenants kvd keeps an entry for at once */
    uint32_t tenant_max_blocks;     /* --tenant-max-blocks: blocks, or percent of the pool; 0: none */
    bool tenant_max_blocks_pct;     /* ... given as a percentage */
    const char *public_prefix;      /* --public-prefix: a system prompt every tenant shares */
    bool dispatch_rr;               /* --dispatch round-robin: workers in turn, not by cached prefix */
    uint32_t max_fence_ms;          /* --max-fence-ms: the longest fence time a worker of another
                                     * host may name (kvd holds a lost one's blocks twice that) */
    uint32_t host_max_blocks;       /* --host-max-blocks: the largest pool another host may name
                                     * (kvd keeps its metadata) */
    bool quiet;                     /* no log lines (the fuzz harness of tests/fuzz/fuzz_workers.c) */
    uint32_t pin_max_ttl_s;         /* --pin-max-ttl: the longest TTL a pin may ask for, seconds */
    uint32_t pin_max_per_tenant;    /* --pin-max-per-tenant: pins a tenant (or no tenant) may hold */
};

/* A lost worker's sequence on another host: its blocks stay taken until the
 * worker has surely stopped writing them (it fences itself after fence_ms
 * without word from kvd, and kvd stops talking to it when it is lost). */
struct kvd_fenced {
    struct prefix_seq ps;
    double until;                   /* ms */
    struct kvd_fenced *next;
};

/* A pool kvd dispatches to. hosts[0] is kvd's own (pool, px: also k->pool and
 * k->px, with the tiers and the block events); the others are other hosts'
 * (workers started there with kvd-worker --host NAME): kvd keeps the metadata
 * and index of each (an anonymous POOL_KV_REMOTE pool of as many blocks), the
 * host its K/V data. A host's record is one instance of its pool; it is
 * dropped, with its index, when its last worker is lost. */
struct kvd_host {
    bool used;
    char name[KVD_HOST_NAME_MAX + 1];   /* "" for kvd's own */
    uint64_t instance;              /* its pool's instance (another host's) */
    pool_t *pool;
    prefix_t *px;
    uint32_t fence_ms;              /* its workers' --fence-ms (the longest seen) */
    uint64_t seq_tokens;            /* the longest sequence its pool holds */
    double tomb_until;              /* dropped (used false): its pool is refused until then */
    struct kvd_fenced *fenced;
    uint64_t requests, prompt_tokens, cached_prompt_tokens;
};

/* A tenant: a CURVE client's key name, or the NAME of a namespace
 * "tenant:NAME/..." that a client of the ipc:// socket (the HTTP API) sends.
 * An entry is made when a request of the tenant is admitted; past
 * --max-tenants entries, one whose tenant has nothing queued, running or held
 * is given to the new one (requests.c). */
#define KVD_MAX_TENANTS 4096        /* --max-tenants' default */
#define KVD_TENANT_NAME_MAX 127     /* a key file's name (64) or an --api-keys tenant (100) */
struct kvd_tenant {
    char name[KVD_TENANT_NAME_MAX + 1];
    uint64_t requests, prompt_tokens, cached_prompt_tokens, refused;
    uint64_t cache_creation_tokens; /* prompt tokens its requests wrote to the cache */
    uint32_t queued, running;
};

enum req_state {
    REQ_QUEUED,     /* waiting for a worker or for blocks */
    REQ_WAITING,    /* waiting for another request's pending prefix blocks */
    REQ_RESTORING,  /* its cached prefix is being copied back from the tiers (in the queue) */
    REQ_RUNNING,    /* assigned to a worker */
    REQ_STOPPING,   /* cancel sent to its worker; finishes on the worker's Done */
};

struct request {
    uint64_t seq_id;                /* kvd's id, unique for the daemon's life */
    uint64_t client_id;             /* the client's request id */
    uint8_t rid[KVD_RID_MAX];       /* the client's routing id */
    size_t rid_len;
    enum req_state state;
    int worker;                     /* index into kvd.workers while RUNNING/STOPPING, else -1 */
    int host;                       /* index into kvd.hosts of the pool that ps is in */
    /* what to run */
    Kvd__SamplingParams sampling;   /* copied; its logit bias arrays point at the two below */
    int32_t *bias_ids;              /* (sampling.n_logit_bias) owned */
    float *bias;                    /* (sampling.n_logit_bias) owned */
    uint32_t max_tokens;
    char **stops;                   /* stop strings */
    size_t n_stops;
    bool stream, ignore_eos, no_cache;
    int32_t logprobs;               /* alternatives per token's logprob; -1: no logprobs */
    prefix_ns_t ns;
    double deadline;                /* absolute ms, 0: none */
    /* tokens: prompt, then generated */
    int32_t *tok;
    uint32_t n_prompt, n_tok, tok_cap;
    /* context windowing (docs/models.md): the sequence windows at the context
     * instead of ending; once it has, its positions hold wtok (the first
     * sinks, then the newer tokens), of which the first w_prompt are prompt */
    bool window;
    int32_t *wtok;
    uint32_t n_wtok, wtok_cap, w_prompt, windows;
    uint32_t n_cached;              /* prompt tokens found in the cache (first dispatch) */
    uint32_t n_host;                /* of those, restored from the host tier */
    uint32_t n_disk;                /* and read back from the disk tier */
    uint32_t restoring;             /* REQ_RESTORING: its block copies still running */
    uint32_t restore_bad;           /* the first logical block whose copy failed (UINT32_MAX: none) */
    uint32_t rest_host, rest_disk;  /* blocks of its prefix copied back from each tier */
    bool restore_wait;              /* its begin also met a pending block to wait for */
    int32_t tenant;                 /* index into kvd.tenants, or -1 */
    bool counted_cached;            /* n_cached was added to the stats */
    uint32_t cache_hw;              /* leading prompt tokens (whole blocks) its sequence has held
                                     * committed and indexed, at most */
    uint32_t pin_ttl_s;             /* pin_ttl_s: pin its prompt's first pin_tokens once cached; 0: no */
    uint32_t pin_tokens;            /* whole blocks of its prompt to pin */
    char *pin_ns;                   /* the namespace it named ("" none), for the pin's listing */
    char pin_id[40];                /* the pin made or renewed ("" none) */
    char pin_error[224];            /* why no pin was made, for its Final ("" none yet) */
    uint32_t pin_blocks;            /* its blocks */
    uint64_t pin_hits, pin_created, pin_expires; /* its hits, unix ms */
    struct prefix_seq ps;           /* its blocks */
    uint32_t n_written;             /* positions whose K/V the worker reported written */
    /* output */
    struct sampler_logprobs *lp;    /* with logprobs: one per generated token */
    uint32_t lp_cap;
    int32_t prompt_logprobs;        /* alternatives per prompt token's logprob; -1: none */
    struct sampler_logprobs *plp;   /* with prompt_logprobs: one per prompt token ([0] unused) */
    uint32_t n_scored;              /* prompt tokens 1 .. n_scored have theirs */
    bool prefill_only;              /* compute the prompt, generate nothing */
    char *json_schema;              /* structured output's schema (checked at admission), or NULL */
    bool json_object;               /* structured output: any JSON object */
    char **tools;                   /* tool calls held to a grammar: the functions, */
    size_t n_tools;
    char *tool_choice;              /* "required" or a name (NULL: no grammar), */
    bool parallel_tool_calls;       /* and whether several calls may follow each other */
    char *text;                     /* everything generated (stop string cut off) */
    size_t text_len, text_cap;
    size_t valid;                   /* leading bytes of text checked as UTF-8 (the rest: an
                                     * incomplete character that may still be completed) */
    size_t sent;                    /* bytes of text already streamed */
    uint32_t sent_tokens;           /* generated tokens already streamed */
    uint32_t chunk_seq;             /* next Chunk.seq */
    int finish;                     /* Kvd__FinishReason once decided, else 0 */
    bool preempted;                 /* released to make room; requeued on Done */
    uint32_t workers_lost;          /* workers that died (or were killed) while serving it */
    uint32_t lease_want;            /* positions its worker asked for and is waiting for */
    bool failed;                    /* ends with an error reply instead of a Final */
    int fail_code;                  /* Kvd__ErrorCode */
    char fail_msg[256];
    /* timings (ms, monotonic) */
    double t_arrival, t_dispatch, t_first, t_last;
    struct request *next;           /* the queue, or the list of all requests */
};

struct worker {
    bool used;                      /* slot in use */
    uint32_t id;                    /* worker id (its --id) */
    int host;                       /* index into kvd.hosts: the pool it computes into */
    uint64_t epoch;                 /* its Ready's: on everything kvd sends it */
    bool unreachable;               /* a send to it failed: lost at the next tick (not in the
                                     * middle of a dispatch that may hold requests it would free) */
    pid_t pid;                      /* process (from Ready) */
    bool spawned;                   /* kvd started it (and restarts it) */
    bool alive;                     /* registered and not declared dead */
    bool draining;
    uint8_t rid[KVD_RID_MAX];       /* its routing id on the worker socket */
    size_t rid_len;
    uint32_t max_batch;             /* from Ready */
    uint32_t running;               /* sequences assigned */
    bool isolating;                 /* runs a suspect request alone (see MAX_WORKERS_LOST) */
    uint32_t starved;               /* of them, waiting for blocks kvd owes them */
    uint64_t progress;              /* last heartbeat's counter */
    double last_heartbeat;          /* ms */
    double last_progress;           /* ms when progress last grew (or work began) */
    uint64_t tokens;                /* tokens it computed */
    uint32_t restarts;
    double restart_at;              /* ms: when a dead spawned worker may be started again */
    bool unusable;                  /* exited with CLI_EXIT_UNUSABLE: never restarted */
};

/* A latency histogram in seconds over KVD_HIST_BOUNDS (requests.c). */
#define KVD_HIST_N 15
struct kvd_hist {
    uint64_t counts[KVD_HIST_N + 1];    /* the last: above the last bound */
    double sum;
};

struct kvd_stats_counters {
    uint64_t done, failed;
    uint64_t prompt_tokens, cached_prompt_tokens, completion_tokens;
    uint64_t host_cached_prompt_tokens;     /* of cached_prompt_tokens, restored from the host tier */
    uint64_t host_declined;         /* tier blocks left to compute: restoring measured slower */
    uint64_t disk_cached_prompt_tokens;     /* ... and read back from the disk tier */
    uint64_t disk_declined;
    uint64_t preemptions;
    uint64_t cache_creation_tokens; /* prompt tokens written to the cache (usage's, summed) */
    uint64_t bad_messages;
    uint64_t blocks_fenced;         /* held back after other hosts' workers were lost (hosts.c) */
    uint64_t handshakes_failed;     /* --curve-secret: handshakes that failed before the key was
                                     * checked (plain text, a wrong server key, garbage) */
    struct kvd_hist ttft, e2e, queue, itl;
    uint64_t finished_stop, finished_length, finished_abort;
};

/* One second of kvd's work (view.c's samples; Stats.pool_view.samples). */
#define KVD_SAMPLES 300             /* the last five minutes */
struct kvd_sample {
    uint64_t prompt_tokens, cached_prompt_tokens, completion_tokens, computed_tokens;
    uint32_t first_tokens;          /* requests finished with a first token, */
    double ttft_seconds;            /* and the sum of their times to it */
};
struct kvd_samples {
    struct kvd_sample ring[KVD_SAMPLES];
    uint32_t head, n;               /* the next slot; samples held */
    double next_ms;                 /* when the sample being gathered ends; 0: not started */
    uint64_t last[6];               /* the counters at its start (view.c) */
    double last_ttft;
};

/* A picture of the pools being sent (view_build): the message and what it
 * points into. */
struct kvd_view {
    Kvd__PoolView pv;
    char **tenants;
    Kvd__HostBlocks *hosts, **host_ptrs;
    Kvd__PrefixNode *nodes, **node_ptrs;
    char (*texts)[65];
    Kvd__Sample *samples, **sample_ptrs;
};

struct devmem;
struct kvd_tiers;

/* An ipc:// endpoint this kvd holds (kvd.c's claim_endpoint). */
#define KVD_MAX_CLAIMS (KVD_MAX_LISTEN + 4)
struct kvd_claim {
    int fd;                         /* PATH.lock, flocked for kvd's life */
    char path[4200];                /* PATH.lock */
};

struct kvd {
    struct kvd_options o;
    char exe_dir[4096];             /* where kvd-worker lives */
    char run_dir[4096];             /* private 0700 runtime directory */
    char default_ep[4096];          /* the default client endpoint, when no --listen was given */
    struct kvd_claim claims[KVD_MAX_CLAIMS];   /* the ipc:// endpoints it holds */
    int n_claims;
    char worker_ep[4400];           /* the worker endpoint */
    char pool_name[128];
    model_t *model;
    tok_t *tok;
    chat_template_t *chat;          /* NULL when the model has none */
    pool_t *pool;
    struct devmem *vmm;          /* --gpu: the pool's KV data on the device; NULL otherwise */
    struct devmem *wvmm;         /* --gpu: the model's weights on the device, shared by its
                                     * workers; NULL otherwise */
    int gpu_fd;                     /* --gpu: listening socket that hands workers the memory, else -1 */
    struct http_server *http[KVD_MAX_HTTP];
    char http_ep[4400];             /* the ipc:// endpoint the HTTP layer reaches kvd on */
    char gpu_sock[108];             /* its path (a sockaddr_un's sun_path) */
    char gpu_name[96];              /* --gpu: the device's name */
    uint64_t gpu_free;              /* --gpu: its free memory when kvd started */
    prefix_t *px;                   /* hosts[0].px */
    struct kvd_host hosts[KVD_MAX_HOSTS];
    uint64_t hosts_lost;            /* other hosts' records dropped with their last worker */
    uint32_t rr_next;               /* --dispatch round-robin: the next worker to try */
    double last_ping;               /* ms: the last Ping to other hosts' workers */
    tier_t *tier;                   /* --host-cache: the host tier below the pool, else NULL */
    disk_tier_t *disk;              /* --cache-dir: the disk tier below it, else NULL */
    double restore_ns_block;        /* measured: restoring one block from the host tier (0: not yet) */
    double disk_ns_block;           /* measured: reading one block from the disk tier (0: not yet) */
    restorer_t *restorer;           /* the tiers' copies back into the pool, off the loop;
                                     * NULL without tiers or with KVD_TIER_SYNC=1 */
    struct kvd_tiers *tiers;        /* what the tiers' callbacks are given (tiers.c), else NULL */
    uint8_t *tier_stage;            /* --gpu: a block's bytes on their way between the device
                                     * pool and the tiers (page-locked) */
    double prefill_ns_token;        /* measured: computing one prompt token (0: not yet) */
    kv_events_t *events;            /* --kv-events, else NULL */
    uint32_t n_ctx;                 /* context in effect */
    uint64_t pool_seq_tokens;       /* the longest sequence a pool can hold (the largest of the
                                     * hosts'): every block of a full part, about a window of a
                                     * windowed one */
    void *zctx;
    void *clients;                  /* ROUTER bound to the ipc:// --listen endpoints (and tcp://
                                     * ones with --insecure) */
    void *clients_curve;            /* --curve-secret: ROUTER, a CURVE server, bound to the tcp://
                                     * ones; its clients' tenants come from their keys */
    void *curve_mon;                /* PAIR: clients_curve's failed handshakes */
    void *wcurve_mon;               /* PAIR: a tcp:// worker endpoint's (counted with them) */
    kvd_auth_t *auth;               /* --curve-secret: the ZAP handler */
    struct curve_cert cert;         /* --curve-secret: kvd's key pair */
    void *wsock;                    /* ROUTER for workers */
    wire_arena_t *arena;
    struct worker workers[KVD_MAX_WORKERS];
    struct request *queue;          /* QUEUED and WAITING requests, FIFO */
    struct request *active;         /* RUNNING and STOPPING requests */
    uint32_t n_queued, n_active;
    uint64_t next_seq;
    struct kvd_stats_counters st;
    struct kvd_samples samples;     /* the last minutes, a second each (view.c) */
    struct kvd_tenant *tenants;     /* n_tenants (at most --max-tenants) */
    uint32_t n_tenants, tenants_cap;
    uint32_t tenant_blocks;         /* --tenant-max-blocks in blocks; 0: no limit */
    int32_t *public_tok;            /* --public-prefix's tokens (n_public_tok), else NULL */
    uint32_t n_public_tok;
    prefix_ns_t public_ns;          /* the namespace its blocks are keyed in */
    struct kvd_pins *pins;          /* pinned prefixes (pins.c) */
    bool draining;                  /* SIGTERM: no new work */
    double drain_deadline;
    bool stop;                      /* leave the loop */
    int exit_status;                /* main's: 1 when kvd stops because no worker can run */
};

void kvd_log(const struct kvd *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* kvd.c */
/* The model's name for the outside world (HTTP, block events): --served-model-name, else the file's name
 * without .gguf. */
void kvd_served_name(const struct kvd_options *o, char *name, size_t len);
int kvd_send(struct kvd *k, void *sock, const uint8_t *rid, size_t rid_len,
             const ProtobufCMessage *m);

/* A measured cost's running average (0: none yet): recent samples weigh a fifth. */
static inline void kvd_ewma(double *avg, double v)
{
    *avg = *avg > 0 ? 0.8 * *avg + 0.2 * v : v;
}

#endif
