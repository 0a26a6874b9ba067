/*
 * kvd.c - kvd, the coordinator: options, sockets, signals, the event loop.
 *
 *   kvd --model M [--workers N] [--listen ENDPOINT]... [--kv-memory SIZE] ...
 *   kvd --model M --gpu N [--workers-per-gpu K] ...
 *
 * kvd loads the model's tokenizer and chat template, creates the KV pool in
 * shared memory and its prefix cache, binds a ROUTER for clients (by default
 * ipc:// in a private 0700 runtime directory; tcp:// only on the addresses
 * given, never all interfaces unless --allow-remote) and a ROUTER for workers,
 * starts N kvd-worker processes (restarting those that die) and accepts
 * workers started by hand on the worker endpoint. With --gpu the pool's KV
 * data lives in that GPU's memory instead of shared memory (gpu.c), and the
 * workers it starts compute there. SIGTERM drains: new
 * requests are refused, running ones get --grace milliseconds to finish,
 * the rest are cancelled, workers are stopped, every block is released, and
 * kvd exits 0.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <libgen.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>
#include <zmq.h>

#include "cli.h"
#include "http.h"
#include "kvd.h"
#include "gpu.h"
#include "hosts.h"
#include "requests.h"
#include "tiers.h"
#include "view.h"
#include "workers.h"
#include "pins.h"
#include "devmem.h"
#include "endpoint.h"
#include "kvcache.h"
#include "types.h"
#include "units.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

void kvd_log(const struct kvd *k, const char *fmt, ...)
{
    if (k->o.quiet)
        return;
    va_list ap;
    fputs("kvd: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

int kvd_send(struct kvd *k, void *sock, const uint8_t *rid, size_t rid_len,
             const ProtobufCMessage *m)
{
    (void)k;
    uint8_t *buf;
    size_t len;
    if (wire_pack(m, &buf, &len) != 0)
        return -1;
    int rc = 0;
    if (zmq_send(sock, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(sock, buf, len, ZMQ_DONTWAIT) < 0)
        rc = -1; /* EHOSTUNREACH (ROUTER_MANDATORY): the peer is gone; EAGAIN: it stopped reading */
    free(buf);
    return rc;
}

/* ---- options ----------------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fputs("usage: kvd [--model M] [--workers N] [--listen ENDPOINT]... [--kv-memory SIZE] [options]\n"
          "\n"
          "  -m, --model FILE         GGUF model (default " DEFAULT_MODEL ")\n"
          "  -w, --workers N          worker processes to start (default 1; 0: external only)\n"
          "  -l, --listen ENDPOINT    client endpoint, repeatable (default: ipc:// in a private\n"
          "                           runtime directory; tcp://127.0.0.1:PORT for TCP)\n"
          "      --allow-remote       allow binding all interfaces (tcp://*:PORT)\n"
          "      --worker-endpoint EP where workers connect (default: ipc:// next to the socket)\n"
          "      --pool NAME          KV pool name in /dev/shm (kept after exit; default: private)\n"
          "      --kv-memory SIZE     KV pool size (default: 1GiB or half of /dev/shm's free space)\n"
          "  -c, --ctx N              longest sequence (default: 4096, at most the model's)\n"
          "      --context-overflow stop|window  what a sequence that reaches --ctx does by\n"
          "                           default (a request may say): stop (the default), or\n"
          "                           window: keep its first --sinks tokens and the newer half\n"
          "                           of the rest, and go on (docs/models.md)\n"
          "      --sinks N            tokens a window keeps from the start (default 4; whole\n"
          "                           blocks)\n"
          "  -t, --threads N          threads per worker (default: CPUs / workers)\n"
          "      --block-tokens N     KV block size (default 16)\n"
          "      --kv-type T          K and V element type: auto (the default: bf16 where the\n"
          "                           CPU attends over it faster, else f16; f16 with --gpu),\n"
          "                           f16, bf16, f32, q8_0, q4_0\n"
          "      --k-type T, --v-type T  the type of K or of V alone\n"
          "      --kv-rotate on|off|auto  Walsh-Hadamard rotation of K and V before\n"
          "                           quantization (default auto: the quantized halves)\n"
          "      --step-tokens N      a worker's token budget per step (default 256)\n"
          "      --max-batch N        sequences per worker (default 64)\n"
          "      --max-queue N        queued requests before OVERLOADED (default 256)\n"
          "      --worker-timeout MS  no heartbeat or progress for this long: dead (default 5000)\n"
          "      --grace MS           SIGTERM: time running requests get to finish (default 10000)\n"
          "      --max-restarts N     restarts per worker (default 10; -1: unlimited)\n"
          "      --gpu N              keep the KV pool in the memory of CUDA device N and start\n"
          "                           GPU workers (default --kv-memory: 1GiB or half the free memory)\n"
          "      --workers-per-gpu K  GPU workers to start with --gpu (default 1; 0: external only)\n"
          "      --http HOST:PORT     serve the OpenAI-compatible HTTP API there too, repeatable\n"
          "                           (loopback addresses unless --allow-remote)\n"
          "      --max-body SIZE      largest HTTP request body (default 16MiB)\n"
          "      --http-max-memory SIZE  what every HTTP request body and its parsed JSON may\n"
          "                           hold together; past it: 503 (default 256MiB)\n"
          "      --http-max-conns N   HTTP connections at once (default 4096, fewer when the\n"
          "                           descriptor limit is lower)\n"
          "      --http-max-conns-per-ip N  from one client address (default 256)\n"
          "      --http-timeout S     a request's head and body must arrive within S seconds of\n"
          "                           its connection's start or the previous answer (trickled bytes\n"
          "                           do not extend it); idle connections close after it (default 30)\n"
          "      --http-max-requests N  HTTP requests answered at once; more: 503 (default 512)\n"
          "      --operator-key FILE  a key (its first line) whose /metrics carry every tenant's rows\n"
          "                           (a tenant's API key: its own; no key: none)\n"
          "      --served-model-name NAME  the model's name over HTTP (default: the file's name)\n"
          "      --api-keys FILE      HTTP API keys, \"KEY TENANT\" a line: a key is then needed, and\n"
          "                           each tenant's cache namespace is its own\n"
          "      --kv-events ENDPOINT publish block events there (ZeroMQ PUB, vLLM's msgpack format)\n"
          "                           for prefix-aware routers (loopback unless --allow-remote)\n"
          "      --kv-events-topic T  their topic (default kv@HOST@MODEL)\n"
          "      --kv-events-token-ids shared|all  whose blocks' token ids the events carry: the\n"
          "                           shared namespaces' only (default: the default namespace and\n"
          "                           --public-prefix; a tenant's blocks go with token_ids []), or all\n"
          "      --events-allow DIR   with --curve-secret: the public keys that may subscribe to\n"
          "                           tcp:// --kv-events (none: no one)\n"
          "      --host-cache SIZE    keep blocks the pool evicts in host memory, up to SIZE, and\n"
          "                           copy them back for a later prompt (default 0: none)\n"
          "      --cache-dir DIR      write every cached block behind to files in DIR, and read\n"
          "                           them back for a later prompt, after restarts too\n"
          "      --disk-cache SIZE    the most those files take (default 4GiB)\n"
          "      --curve-secret FILE  kvd's CURVE key pair (kvd-keygen): tcp:// endpoints then\n"
          "                           admit only the keys of the allow directories\n"
          "      --clients-allow DIR  clients' public keys, NAME.key each; NAME is the client's\n"
          "                           tenant (its own cache). Read again on SIGHUP\n"
          "      --workers-allow DIR  the public keys of workers that may connect over tcp://\n"
          "      --curve-ipc          the ipc:// endpoints want CURVE keys too (the HTTP API then\n"
          "                           reaches kvd on a plain socket of its own)\n"
          "      --insecure           allow tcp:// endpoints without CURVE (anyone who reaches\n"
          "                           them is served)\n"
          "      --tenant-max-queue N requests one tenant may have waiting (default 0: only\n"
          "                           --max-queue); more are OVERLOADED\n"
          "      --max-tenants N      tenants with requests or blocks at once; a new one past it is\n"
          "                           OVERLOADED (default 4096)\n"
          "      --public-prefix FILE a system prompt every tenant shares: the cache blocks of a\n"
          "                           prompt that starts with it are cached once for all\n"
          "      --tenant-max-blocks N|P%  KV blocks one tenant may hold, cached ones included\n"
          "                           (a count, or a share of the pool); past it a tenant's new\n"
          "                           blocks evict its own (default 0: no limit)\n"
          "      --pin-max-ttl SECONDS  the longest TTL a pin (cache_control) may ask for\n"
          "                           (default 3600; at most 604800)\n"
          "      --pin-max-per-tenant N  pinned prefixes one tenant may hold (default 64)\n"
          "      --max-fence-ms MS    the longest --fence-ms a worker of another host may name; kvd\n"
          "                           holds a lost one's blocks for twice it (default 60000)\n"
          "      --host-max-blocks N  the most blocks another host's pool may have: kvd keeps its\n"
          "                           metadata (default 262144)\n"
          "      --dispatch prefix|round-robin  where a request runs when workers of other\n"
          "                           hosts (kvd-worker --host) have joined: the host whose pool\n"
          "                           holds most of its prompt, then the least loaded worker\n"
          "                           there (default), or each free worker in turn\n"
          "  -v, --verbose\n",
          f);
}

static void parse_args(int argc, char **argv, struct kvd_options *o)
{
    enum { OPT_REMOTE = 256, OPT_WEP, OPT_POOL, OPT_KVMEM, OPT_BT, OPT_STEP, OPT_BATCH, OPT_QUEUE,
           OPT_WTIMEOUT, OPT_GRACE, OPT_RESTARTS, OPT_GPU, OPT_WPG, OPT_KVTYPE, OPT_KTYPE, OPT_VTYPE,
           OPT_ROTATE, OPT_HTTP, OPT_MAXBODY, OPT_MODELNAME, OPT_APIKEYS, OPT_EVENTS, OPT_TOPIC,
           OPT_HOSTCACHE, OPT_CACHEDIR, OPT_DISKCACHE, OPT_CURVE, OPT_CALLOW, OPT_WALLOW, OPT_INSECURE, OPT_TQUEUE, OPT_TBLOCKS, OPT_PINTTL, OPT_PINMAX, OPT_PUBLIC, OPT_CURVE_IPC, OPT_DISPATCH,
           OPT_MAXFENCE, OPT_HOSTBLOCKS, OPT_MAXTENANTS, OPT_EVTOKENS, OPT_EALLOW, OPT_HTTPMEM, OPT_HTTPCONNS,
           OPT_HTTPIP, OPT_HTTPTIMEOUT, OPT_HTTPREQS, OPT_OPKEY, OPT_OVERFLOW, OPT_SINKS };
    static const struct option longs[] = {
        { "model", required_argument, NULL, 'm' },
        { "workers", required_argument, NULL, 'w' },
        { "listen", required_argument, NULL, 'l' },
        { "ctx", required_argument, NULL, 'c' },
        { "context-overflow", required_argument, NULL, OPT_OVERFLOW },
        { "sinks", required_argument, NULL, OPT_SINKS },
        { "threads", required_argument, NULL, 't' },
        { "verbose", no_argument, NULL, 'v' },
        { "help", no_argument, NULL, 'h' },
        { "allow-remote", no_argument, NULL, OPT_REMOTE },
        { "worker-endpoint", required_argument, NULL, OPT_WEP },
        { "pool", required_argument, NULL, OPT_POOL },
        { "kv-memory", required_argument, NULL, OPT_KVMEM },
        { "block-tokens", required_argument, NULL, OPT_BT },
        { "kv-type", required_argument, NULL, OPT_KVTYPE },
        { "k-type", required_argument, NULL, OPT_KTYPE },
        { "v-type", required_argument, NULL, OPT_VTYPE },
        { "kv-rotate", required_argument, NULL, OPT_ROTATE },
        { "http", required_argument, NULL, OPT_HTTP },
        { "max-body", required_argument, NULL, OPT_MAXBODY },
        { "served-model-name", required_argument, NULL, OPT_MODELNAME },
        { "api-keys", required_argument, NULL, OPT_APIKEYS },
        { "kv-events", required_argument, NULL, OPT_EVENTS },
        { "kv-events-topic", required_argument, NULL, OPT_TOPIC },
        { "host-cache", required_argument, NULL, OPT_HOSTCACHE },
        { "cache-dir", required_argument, NULL, OPT_CACHEDIR },
        { "disk-cache", required_argument, NULL, OPT_DISKCACHE },
        { "curve-secret", required_argument, NULL, OPT_CURVE },
        { "clients-allow", required_argument, NULL, OPT_CALLOW },
        { "workers-allow", required_argument, NULL, OPT_WALLOW },
        { "insecure", no_argument, NULL, OPT_INSECURE },
        { "tenant-max-queue", required_argument, NULL, OPT_TQUEUE },
        { "tenant-max-blocks", required_argument, NULL, OPT_TBLOCKS },
        { "pin-max-ttl", required_argument, NULL, OPT_PINTTL },
        { "pin-max-per-tenant", required_argument, NULL, OPT_PINMAX },
        { "public-prefix", required_argument, NULL, OPT_PUBLIC },
        { "dispatch", required_argument, NULL, OPT_DISPATCH },
        { "max-fence-ms", required_argument, NULL, OPT_MAXFENCE },
        { "http-max-memory", required_argument, NULL, OPT_HTTPMEM },
        { "http-max-conns", required_argument, NULL, OPT_HTTPCONNS },
        { "http-max-conns-per-ip", required_argument, NULL, OPT_HTTPIP },
        { "http-timeout", required_argument, NULL, OPT_HTTPTIMEOUT },
        { "http-max-requests", required_argument, NULL, OPT_HTTPREQS },
        { "operator-key", required_argument, NULL, OPT_OPKEY },
        { "kv-events-token-ids", required_argument, NULL, OPT_EVTOKENS },
        { "events-allow", required_argument, NULL, OPT_EALLOW },
        { "max-tenants", required_argument, NULL, OPT_MAXTENANTS },
        { "host-max-blocks", required_argument, NULL, OPT_HOSTBLOCKS },
        { "curve-ipc", no_argument, NULL, OPT_CURVE_IPC },
        { "step-tokens", required_argument, NULL, OPT_STEP },
        { "max-batch", required_argument, NULL, OPT_BATCH },
        { "max-queue", required_argument, NULL, OPT_QUEUE },
        { "worker-timeout", required_argument, NULL, OPT_WTIMEOUT },
        { "grace", required_argument, NULL, OPT_GRACE },
        { "max-restarts", required_argument, NULL, OPT_RESTARTS },
        { "gpu", required_argument, NULL, OPT_GPU },
        { "workers-per-gpu", required_argument, NULL, OPT_WPG },
        { NULL, 0, NULL, 0 },
    };
    memset(o, 0, sizeof(*o));
    o->model = getenv("KVD_MODEL") ? getenv("KVD_MODEL") : DEFAULT_MODEL;
    o->n_workers = 1;
    o->block_tokens = 16;
    o->step_tokens = 256;
    o->max_batch = 64;
    o->max_queue = 256;
    o->worker_timeout_ms = 5000;
    o->grace_ms = 10000;
    o->max_restarts = 10;
    o->gpu = -1;
    o->sinks = 4;
    o->workers_per_gpu = -1;
    o->max_body = 16u << 20;
    o->max_fence_ms = 60000;
    o->host_max_blocks = 1u << 18;
    o->max_tenants = KVD_MAX_TENANTS;
    o->pin_max_ttl_s = PINS_DEFAULT_MAX_TTL_S;
    o->pin_max_per_tenant = PINS_DEFAULT_MAX_PER_TENANT;
    o->http_max_memory = 256ull << 20;
    o->http_max_conns = 4096;
    o->http_max_conns_per_ip = 256;
    o->http_timeout_s = 30;
    o->http_max_requests = 512;
    bool workers_given = false;
    const char *kv_type = NULL, *k_type = NULL, *v_type = NULL, *rotate = NULL;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, ":m:w:l:c:t:vh", longs, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'w':
            o->n_workers = (int)cli_long(optarg, "--workers", 0, KVD_MAX_WORKERS);
            workers_given = true;
            break;
        case 'l':
            if (o->n_listen == KVD_MAX_LISTEN)
                cli_die("at most %d --listen endpoints", KVD_MAX_LISTEN);
            o->listen[o->n_listen++] = optarg;
            break;
        case 'c': o->ctx = (uint32_t)cli_long(optarg, "--ctx", 16, 1 << 22); break;
        case OPT_OVERFLOW:
            if (strcmp(optarg, "stop") != 0 && strcmp(optarg, "window") != 0)
                cli_die("--context-overflow takes stop or window, got '%s'", optarg);
            o->window = strcmp(optarg, "window") == 0;
            break;
        case OPT_SINKS: o->sinks = (uint32_t)cli_long(optarg, "--sinks", 0, 1 << 20); break;
        case 't': o->threads = (int)cli_long(optarg, "--threads", 1, 256); break;
        case 'v': o->verbose = true; break;
        case 'h': usage(stdout); exit(0);
        case OPT_REMOTE: o->allow_remote = true; break;
        case OPT_WEP: o->worker_endpoint = optarg; break;
        case OPT_POOL: o->pool = optarg; break;
        case OPT_KVMEM:
            if (kvd_parse_size(optarg, &o->kv_bytes) != 0 || o->kv_bytes == 0)
                cli_die("--kv-memory must be a size such as 512MiB or 2G, got '%s'", optarg);
            break;
        case OPT_BT: o->block_tokens = (uint32_t)cli_long(optarg, "--block-tokens", 1, 4096); break;
        case OPT_KVTYPE: kv_type = optarg; break;
        case OPT_KTYPE: k_type = optarg; break;
        case OPT_VTYPE: v_type = optarg; break;
        case OPT_ROTATE: rotate = optarg; break;
        case OPT_HTTP:
            if (o->n_http == KVD_MAX_HTTP)
                cli_die("at most %d --http addresses", KVD_MAX_HTTP);
            o->http[o->n_http++] = optarg;
            break;
        case OPT_MAXBODY: {
            uint64_t v;
            if (kvd_parse_size(optarg, &v) != 0 || v < 1024 || v > (1u << 30))
                cli_die("--max-body must be a size from 1KiB to 1GiB, got '%s'", optarg);
            o->max_body = (uint32_t)v;
            break;
        }
        case OPT_MODELNAME: o->model_name = optarg; break;
        case OPT_APIKEYS: o->api_keys = optarg; break;
        case OPT_EVENTS: o->kv_events = optarg; break;
        case OPT_TOPIC: o->kv_events_topic = optarg; break;
        case OPT_HOSTCACHE:
            if (kvd_parse_size(optarg, &o->host_cache_bytes) != 0)
                cli_die("--host-cache must be a size such as 4GiB or 0, got '%s'", optarg);
            break;
        case OPT_CACHEDIR: o->cache_dir = optarg; break;
        case OPT_DISKCACHE:
            if (kvd_parse_size(optarg, &o->disk_cache_bytes) != 0 || o->disk_cache_bytes == 0)
                cli_die("--disk-cache must be a size such as 20GiB, got '%s'", optarg);
            break;
        case OPT_STEP: o->step_tokens = (uint32_t)cli_long(optarg, "--step-tokens", 1, 4096); break;
        case OPT_BATCH: o->max_batch = (uint32_t)cli_long(optarg, "--max-batch", 1, 4096); break;
        case OPT_QUEUE: o->max_queue = (uint32_t)cli_long(optarg, "--max-queue", 0, 1 << 20); break;
        case OPT_WTIMEOUT:
            o->worker_timeout_ms = (uint32_t)cli_long(optarg, "--worker-timeout", 100, 3600000);
            break;
        case OPT_GRACE: o->grace_ms = (uint32_t)cli_long(optarg, "--grace", 0, 3600000); break;
        case OPT_RESTARTS: o->max_restarts = (int)cli_long(optarg, "--max-restarts", -1, 1000000); break;
        case OPT_GPU: o->gpu = (int)cli_long(optarg, "--gpu", 0, 1023); break;
        case OPT_CURVE: o->curve_secret = optarg; break;
        case OPT_CALLOW: o->clients_allow = optarg; break;
        case OPT_WALLOW: o->workers_allow = optarg; break;
        case OPT_INSECURE: o->insecure = true; break;
        case OPT_TQUEUE: o->tenant_max_queue = (uint32_t)cli_long(optarg, "--tenant-max-queue", 0, 1 << 20); break;
        case OPT_PUBLIC: o->public_prefix = optarg; break;
        case OPT_DISPATCH:
            if (strcmp(optarg, "prefix") == 0)
                o->dispatch_rr = false;
            else if (strcmp(optarg, "round-robin") == 0)
                o->dispatch_rr = true;
            else
                cli_die("--dispatch: prefix or round-robin, not %s", optarg);
            break;
        case OPT_CURVE_IPC: o->curve_ipc = true; break;
        case OPT_EVTOKENS:
            if (strcmp(optarg, "all") != 0 && strcmp(optarg, "shared") != 0)
                cli_die("--kv-events-token-ids: shared or all, not %s", optarg);
            o->kv_events_all_tokens = strcmp(optarg, "all") == 0;
            break;
        case OPT_EALLOW: o->events_allow = optarg; break;
        case OPT_HTTPMEM:
            if (kvd_parse_size(optarg, &o->http_max_memory) != 0 || o->http_max_memory < (1u << 20))
                cli_die("--http-max-memory must be a size of at least 1MiB, got '%s'", optarg);
            break;
        case OPT_HTTPCONNS: o->http_max_conns = (uint32_t)cli_long(optarg, "--http-max-conns", 1, 1 << 20); break;
        case OPT_HTTPIP:
            o->http_max_conns_per_ip = (uint32_t)cli_long(optarg, "--http-max-conns-per-ip", 1, 1 << 20);
            break;
        case OPT_HTTPTIMEOUT: o->http_timeout_s = (uint32_t)cli_long(optarg, "--http-timeout", 1, 3600); break;
        case OPT_HTTPREQS:
            o->http_max_requests = (uint32_t)cli_long(optarg, "--http-max-requests", 1, 1 << 16);
            break;
        case OPT_OPKEY: o->operator_key = optarg; break;
        case OPT_MAXTENANTS:
            o->max_tenants = (uint32_t)cli_long(optarg, "--max-tenants", 1, PREFIX_OWNERS - 1);
            break;
        case OPT_PINTTL:
            o->pin_max_ttl_s = (uint32_t)cli_long(optarg, "--pin-max-ttl", 1, WIRE_MAX_PIN_TTL_S);
            break;
        case OPT_PINMAX:
            o->pin_max_per_tenant = (uint32_t)cli_long(optarg, "--pin-max-per-tenant", 0, 1 << 20);
            break;
        case OPT_MAXFENCE: o->max_fence_ms = (uint32_t)cli_long(optarg, "--max-fence-ms", 1000, 3600000); break;
        case OPT_HOSTBLOCKS:
            o->host_max_blocks = (uint32_t)cli_long(optarg, "--host-max-blocks", 1, 1 << 22);
            break;
        case OPT_TBLOCKS: {
            const size_t n = strlen(optarg);
            o->tenant_max_blocks_pct = n > 1 && optarg[n - 1] == '%';
            char num[32];
            snprintf(num, sizeof(num), "%.*s", (int)(o->tenant_max_blocks_pct ? n - 1 : n), optarg);
            o->tenant_max_blocks = (uint32_t)cli_long(num, "--tenant-max-blocks", 0,
                                                      o->tenant_max_blocks_pct ? 100 : 1 << 30);
            break;
        }
        case OPT_WPG:
            o->workers_per_gpu = (int)cli_long(optarg, "--workers-per-gpu", 0, KVD_MAX_WORKERS);
            break;
        case ':': cli_die("option %s needs a value", argv[optind - 1]);
        default: cli_die("unknown option %s (see --help)", argv[optind - 1]);
        }
    }
    if (optind < argc)
        cli_die("unexpected argument '%s' (see --help)", argv[optind]);
    if ((o->api_keys != NULL || o->operator_key != NULL) && o->n_http == 0)
        cli_die("--api-keys and --operator-key go with --http");
    if ((o->clients_allow != NULL || o->workers_allow != NULL || o->events_allow != NULL || o->curve_ipc) &&
        o->curve_secret == NULL)
        cli_die("--clients-allow, --workers-allow, --events-allow and --curve-ipc go with --curve-secret");
    if (o->curve_secret != NULL && o->insecure)
        cli_die("--insecure and --curve-secret exclude each other");
    if (o->kv_events_topic != NULL && o->kv_events == NULL)
        cli_die("--kv-events-topic goes with --kv-events");
    if (o->workers_per_gpu >= 0 && o->gpu < 0)
        cli_die("--workers-per-gpu needs --gpu N");
    if (o->gpu >= 0 && workers_given)
        cli_die("with --gpu, give the number of workers as --workers-per-gpu");
    if (o->gpu >= 0)
        o->n_workers = o->workers_per_gpu >= 0 ? o->workers_per_gpu : 1;
    char err[256];
    kv_gpu_auto(o->gpu >= 0, &kv_type, &k_type, &v_type);
    if (kv_params_from_flags(&o->kv, kv_type, k_type, v_type, rotate, err, sizeof(err)) != 0)
        cli_die("%s", err);
    if (o->gpu >= 0 && (o->kv.k_type == KERN_F32 || o->kv.v_type == KERN_F32 || o->kv.k_type == KERN_BF16 ||
                        o->kv.v_type == KERN_BF16))
        cli_die("--gpu: the GPU engine reads f16, q8_0 and q4_0 KV blocks, not %s",
                o->kv.k_type == KERN_F32 || o->kv.v_type == KERN_F32 ? "f32" : "bf16");
}

/* ---- set-up -------------------------------------------------------------------------------- */

/* Makes sure kvd may put sockets in dir, which must be private: a directory
 * kvd makes is 0700; one that exists must be a real directory (lstat: not a
 * symbolic link, which another user may have planted or may swap later) of
 * this user's. kvd's own runtime directory (`runtime`: the default endpoint's)
 * is made private when it is not; any other directory is never chmod'ed (an
 * ipc:// path in /tmp or $HOME is not kvd's to lock down) and is refused when
 * other users may enter it, since they could connect to what binds there. */
static void private_dir(const char *dir, bool runtime)
{
    if (mkdir(dir, 0700) == 0)
        return;
    if (errno != EEXIST)
        cli_die("cannot create %s: %s", dir, strerror(errno));
    struct stat st;
    if (lstat(dir, &st) != 0)
        cli_die("cannot examine %s: %s", dir, strerror(errno));
    if (S_ISLNK(st.st_mode))
        cli_die("%s is a symbolic link; refusing to put sockets there", dir);
    if (!S_ISDIR(st.st_mode))
        cli_die("%s is not a directory", dir);
    if (st.st_uid != getuid())
        cli_die("%s belongs to another user; refusing to put sockets there (set KVD_ENDPOINT or "
                "XDG_RUNTIME_DIR, or give --listen a directory of yours)", dir);
    if ((st.st_mode & 077) == 0)
        return;
    if (!runtime)
        cli_die("%s is open to other users (mode %03o), who could connect to the sockets there; give a "
                "private directory (kvd makes one 0700 when it is missing)", dir, (unsigned)(st.st_mode & 0777));
    /* kvd's runtime directory: made private through a descriptor of this
     * very directory (no link followed, the one examined above) */
    const int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat fst;
    if (fd < 0 || fstat(fd, &fst) != 0 || fst.st_dev != st.st_dev || fst.st_ino != st.st_ino ||
        fchmod(fd, 0700) != 0)
        cli_die("cannot make %s private: %s", dir, strerror(errno));
    close(fd);
}

/* Whether ipc:// endpoint ep is in the default endpoint's directory. */
static bool in_runtime_dir(const char *ep)
{
    char def[4096], a[4096], b[4096];
    kvd_default_endpoint(def, sizeof(def));
    if (strncmp(def, "ipc://", 6) != 0 || strncmp(ep, "ipc://", 6) != 0)
        return false;
    snprintf(a, sizeof(a), "%s", def + 6);
    snprintf(b, sizeof(b), "%s", ep + 6);
    return strcmp(dirname(a), dirname(b)) == 0;
}

/* An endpoint kvd is about to bind, as `what` names it (--listen, ...): an
 * ipc:// one in a private directory (made when missing); a tcp:// one on
 * loopback addresses only unless --allow-remote, its host resolved as
 * ZeroMQ's bind resolves it ("*", "0", an interface name, a host name). */
static void check_endpoint(const struct kvd *k, const char *what, const char *ep)
{
    if (strncmp(ep, "ipc://", 6) == 0) {
        char path[4096];
        snprintf(path, sizeof(path), "%s", ep + 6);
        private_dir(dirname(path), in_runtime_dir(ep));
        return;
    }
    if (strncmp(ep, "tcp://", 6) != 0)
        cli_die("%s %s: only ipc:// and tcp:// are supported", what, ep);
    char why[512];
    const int lb = endpoint_loopback(ep, why, sizeof(why));
    if (lb < 0)
        cli_die("%s %s", what, why);
    if (lb == 0 && !k->o.allow_remote)
        cli_die("%s %s: other machines could reach it; give a loopback address (tcp://127.0.0.1:PORT) or "
                "--allow-remote", what, why);
}

/* Claims ipc:// endpoint ep for this kvd before anything binds it (ZeroMQ's
 * bind removes a socket file another process listens on): an exclusive flock
 * on PATH.lock, which names its holder's pid. A live holder stops kvd with
 * that pid; a lock left by a kvd that died is taken over. Kept until exit. */
static void claim_endpoint(struct kvd *k, const char *what, const char *ep)
{
    if (strncmp(ep, "ipc://", 6) != 0)
        return;
    if (k->n_claims == KVD_MAX_CLAIMS)
        cli_die("too many ipc:// endpoints");
    char path[4200];
    snprintf(path, sizeof(path), "%s.lock", ep + 6);
    for (int attempt = 0; attempt < 8; attempt++) {
        const int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
        struct stat st, now;
        if (fd < 0 || fstat(fd, &st) != 0)
            cli_die("%s %s: cannot open %s: %s", what, ep, path, strerror(errno));
        if (!S_ISREG(st.st_mode) || st.st_uid != geteuid())
            cli_die("%s %s: %s is not a lock file of this user's", what, ep, path);
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            char pid[32] = "";
            const ssize_t n = pread(fd, pid, sizeof(pid) - 1, 0);
            pid[n > 0 ? n : 0] = '\0';
            pid[strcspn(pid, "\n")] = '\0';
            cli_die("%s %s is in use by a running kvd (pid %s, holding %s): stop it first, or give this one "
                    "another endpoint", what, ep, pid[0] ? pid : "?", path);
        }
        /* the file may have been removed by its last holder between our open and
         * our lock: then the lock is on a file nobody else will find */
        if (stat(path, &now) != 0 || now.st_ino != st.st_ino || now.st_dev != st.st_dev) {
            close(fd);
            continue;
        }
        char pid[32];
        const int n = snprintf(pid, sizeof(pid), "%d\n", (int)getpid());
        if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)n, 0) != n)
            cli_die("%s %s: cannot write %s: %s", what, ep, path, strerror(errno));
        k->claims[k->n_claims].fd = fd;
        snprintf(k->claims[k->n_claims].path, sizeof(k->claims[k->n_claims].path), "%s", path);
        k->n_claims++;
        return;
    }
    cli_die("%s %s: %s keeps disappearing while being locked", what, ep, path);
}

/* At exit: the lock files go (each while still locked, so that no kvd waits
 * on a file that is gone), then their locks. */
static void release_endpoints(struct kvd *k)
{
    for (int i = 0; i < k->n_claims; i++) {
        unlink(k->claims[i].path);
        close(k->claims[i].fd);
    }
    k->n_claims = 0;
}

static void *router(struct kvd *k)
{
    void *s = zmq_socket(k->zctx, ZMQ_ROUTER);
    int one = 1, zero = 0, hwm = 100000;
    int64_t maxmsg = WIRE_MAX_FRAME;
    zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    return s;
}

/* The private pool's name (kvd-<pid>), for unlink_private_pool. */
static char private_pool[128];

static void unlink_private_pool(void)
{
    if (private_pool[0])
        pool_unlink(private_pool);
}

static void reclaimed(void *user, const char *name)
{
    kvd_log(user, "removed pool %s from /dev/shm: left by a kvd that is gone", name);
}

static uint64_t default_kv_bytes(void)
{
    uint64_t want = 1ull << 30;
    struct statvfs vfs;
    if (statvfs("/dev/shm", &vfs) == 0) {
        uint64_t avail = (uint64_t)vfs.f_bavail * vfs.f_frsize;
        if (avail / 2 < want)
            want = avail / 2;
    }
    return want;
}

/* ---- authentication (--curve-secret) ------------------------------------------------------ */

static void auth_log(void *user, const char *line)
{
    kvd_log(user, "%s", line);
}

/* SIGHUP: the allow directories again. */
static void auth_reread(struct kvd *k)
{
    if (k->auth == NULL)
        return;
    char err[512];
    struct auth_stats st;
    if (auth_reload(k->auth, err, sizeof(err)) != 0) {
        kvd_log(k, "SIGHUP: the keys stay as they were: %s", err);
        return;
    }
    auth_stats(k->auth, &st);
    kvd_log(k, "SIGHUP: %u client keys, %u event subscriber keys, %u worker keys allowed", st.keys[AUTH_CLIENTS],
            st.keys[AUTH_EVENTS], st.keys[AUTH_WORKERS]);
}

/* The monitor of a CURVE socket (the clients', or a tcp:// worker
 * endpoint's): handshakes that failed before the ZAP handler saw a key (those
 * it refused it counts itself). */
static void curve_events(struct kvd *k, void *mon)
{
    for (;;) {
        zmq_msg_t ev, where;
        zmq_msg_init(&ev);
        zmq_msg_init(&where);
        const bool got = zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT) >= 0 && zmq_msg_recv(&where, mon, 0) >= 0;
        if (got && zmq_msg_size(&ev) >= 6) {
            uint16_t id;
            memcpy(&id, zmq_msg_data(&ev), 2);
            if (id != ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
                k->st.handshakes_failed++;
        }
        zmq_msg_close(&ev);
        zmq_msg_close(&where);
        if (!got)
            return;
    }
}

/* A monitor of sock's failed handshakes, read from the PAIR it returns. */
static void *curve_monitor(struct kvd *k, void *sock, const char *ep)
{
    void *mon;
    if (zmq_socket_monitor(sock, ep, ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                         ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) != 0 ||
        (mon = zmq_socket(k->zctx, ZMQ_PAIR)) == NULL || zmq_connect(mon, ep) != 0)
        cli_die("--curve-secret: socket monitor: %s", zmq_strerror(errno));
    return mon;
}

/* --curve-secret: the key pair, the ZAP handler, the CURVE clients' socket
 * and its monitor (and the worker socket's, on a tcp:// worker endpoint);
 * before anything binds. */
static void auth_setup(struct kvd *k)
{
    const struct kvd_options *o = &k->o;
    char err[512];
    if (curve_cert_read(o->curve_secret, true, &k->cert, err, sizeof(err)) != 0)
        cli_die("--curve-secret: %s", err);
    const bool tcp_workers = o->worker_endpoint != NULL && strncmp(o->worker_endpoint, "tcp://", 6) == 0;
    k->auth = auth_new(k->zctx, o->clients_allow, o->workers_allow, o->events_allow,
                       tcp_workers ? k->cert.public_key : NULL, auth_log, k, err, sizeof(err));
    if (k->auth == NULL)
        cli_die("--curve-secret: %s", err);
    k->clients_curve = router(k);
    if (auth_curve_server(k->clients_curve, &k->cert, AUTH_CLIENTS, err, sizeof(err)) != 0 ||
        (tcp_workers && auth_curve_server(k->wsock, &k->cert, AUTH_WORKERS, err, sizeof(err)) != 0))
        cli_die("--curve-secret: %s", err);
    k->curve_mon = curve_monitor(k, k->clients_curve, "inproc://kvd-curve-monitor");
    if (tcp_workers)
        k->wcurve_mon = curve_monitor(k, k->wsock, "inproc://kvd-worker-curve-monitor");
    struct auth_stats st;
    auth_stats(k->auth, &st);
    kvd_log(k, "CURVE: kvd's public key %s; %u client keys%s, %u event subscriber keys, %u worker keys allowed",
            k->cert.public_key, st.keys[AUTH_CLIENTS],
            o->clients_allow ? "" : " (no --clients-allow: no client gets in over tcp://)", st.keys[AUTH_EVENTS],
            st.keys[AUTH_WORKERS]);
}

/* Where a --listen endpoint binds: a tcp:// one to the CURVE socket, or with
 * --insecure to the plain one (said once), never unauthenticated by default. */
static void *listen_socket(struct kvd *k, const char *ep)
{
    if (strncmp(ep, "tcp://", 6) != 0)
        return k->o.curve_ipc ? k->clients_curve : k->clients;
    if (k->clients_curve != NULL)
        return k->clients_curve;
    if (!k->o.insecure)
        cli_die("%s: a tcp:// endpoint needs --curve-secret FILE (kvd-keygen makes one) and "
                "--clients-allow DIR, or --insecure to serve whoever reaches it", ep);
    kvd_log(k, "INSECURE: %s takes requests from anyone who can reach it (--insecure, no CURVE)", ep);
    return k->clients;
}

/* --public-prefix FILE: its text as a chat's system message (through the
 * model's template, without a turn after it) or, for a model without one, as
 * a plain prompt; its tokens are what a prompt must start with for its first
 * blocks to be the shared ones. */
static void public_prefix_setup(struct kvd *k)
{
    FILE *f = fopen(k->o.public_prefix, "rb");
    if (f == NULL)
        cli_die("--public-prefix %s: %s", k->o.public_prefix, strerror(errno));
    char *text = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 > cap && (text = realloc(text, cap = 2 * cap + 4096)) == NULL)
            cli_die("out of memory");
        const size_t got = fread(text + len, 1, cap - len, f);
        len += got;
        if (got == 0)
            break;
    }
    fclose(f);
    char *rendered = NULL;
    size_t rlen = 0;
    bool special = false;
    if (k->chat != NULL) {
        const struct chat_msg m = { "system", text };
        text[len] = '\0';      /* room kept by the loop above */
        if (memchr(text, '\0', len) != NULL)
            cli_die("--public-prefix %s: not text", k->o.public_prefix);
        if (chat_apply(k->chat, &m, 1, false, &rendered, &rlen) != 0)
            cli_die("--public-prefix: the chat template cannot render it");
        special = true;
    }
    const char *src = rendered ? rendered : text;
    const size_t n = rendered ? rlen : len;
    const bool bos = tok_add_bos(k->tok);
    k->public_tok = malloc((n + 2) * sizeof(*k->public_tok));
    size_t got = 0;
    if (k->public_tok == NULL ||
        tok_encode(k->tok, src, n, special, k->public_tok + bos, n + 2 - bos, &got) != 0)
        cli_die("--public-prefix: cannot tokenize it");
    if (bos)
        k->public_tok[0] = tok_bos(k->tok);
    k->n_public_tok = (uint32_t)(got + bos);
    k->public_ns = prefix_namespace(k->px, "public:", 7);
    kvd_log(k, "public prefix %s: %u tokens, its first %u blocks shared by every tenant", k->o.public_prefix,
            k->n_public_tok, k->n_public_tok / k->o.block_tokens);
    free(rendered);
    free(text);
}

/* Every endpoint kvd will bind, decided and checked before anything else
 * (the model, the pool): the client endpoints (the default one kept in k for
 * the whole run: shutdown removes its socket), the worker endpoint, the HTTP
 * layer's own ipc:// endpoint when it needs one, the block events', and the
 * --http addresses; each ipc:// one claimed (claim_endpoint), so that a
 * second kvd on the same endpoint stops here, naming the first. */
static void endpoints_plan(struct kvd *k)
{
    struct kvd_options *o = &k->o;
    if (o->n_listen == 0)
        o->listen[o->n_listen++] = kvd_default_endpoint(k->default_ep, sizeof(k->default_ep));
    for (int i = 0; i < o->n_listen; i++) {
        check_endpoint(k, "--listen", o->listen[i]);
        claim_endpoint(k, "--listen", o->listen[i]);
    }
    /* the first ipc:// client endpoint, if any */
    const char *first_ipc = NULL;
    for (int i = 0; i < o->n_listen && !first_ipc; i++)
        if (strncmp(o->listen[i], "ipc://", 6) == 0)
            first_ipc = o->listen[i];
    char def[4096], path[4096];
    kvd_default_endpoint(def, sizeof(def));
    if (strncmp(def, "ipc://", 6) != 0)
        snprintf(def, sizeof(def), "ipc:///tmp/kvd-%u/kvd.sock", (unsigned)getuid());
    if (o->worker_endpoint) {
        snprintf(k->worker_ep, sizeof(k->worker_ep), "%s", o->worker_endpoint);
    } else {
        /* next to the first ipc endpoint, else in the default runtime directory */
        snprintf(path, sizeof(path), "%s", (first_ipc != NULL ? first_ipc : def) + 6);
        snprintf(k->run_dir, sizeof(k->run_dir), "%s", dirname(path));
        snprintf(k->worker_ep, sizeof(k->worker_ep), "ipc://%s/workers-%d.sock", k->run_dir,
                 (int)getpid());
    }
    check_endpoint(k, "--worker-endpoint", k->worker_ep);
    claim_endpoint(k, "--worker-endpoint", k->worker_ep);
    /* the HTTP layer reaches kvd as a client over ipc://: the first such endpoint,
     * else (none, or they want CURVE) one of its own in the runtime directory */
    if (first_ipc != NULL && !o->curve_ipc) {
        snprintf(k->http_ep, sizeof(k->http_ep), "%s", first_ipc);
    } else if (o->n_http > 0) {
        snprintf(path, sizeof(path), "%s", def + 6);
        snprintf(k->http_ep, sizeof(k->http_ep), "ipc://%s/http-%d.sock", dirname(path), (int)getpid());
        check_endpoint(k, "the HTTP layer's endpoint", k->http_ep);
        claim_endpoint(k, "the HTTP layer's endpoint", k->http_ep);
    }
    if (o->kv_events != NULL) {
        check_endpoint(k, "--kv-events", o->kv_events);
        claim_endpoint(k, "--kv-events", o->kv_events);
    }
    for (int i = 0; i < o->n_http; i++) {
        char why[512];
        const int lb = endpoint_loopback(o->http[i], why, sizeof(why));
        if (lb < 0)
            cli_die("--http %s", why);
        if (lb == 0 && !o->allow_remote)
            cli_die("--http %s: other machines could reach it; give a loopback address (127.0.0.1:PORT) or "
                    "--allow-remote", why);
    }
}

static void setup(struct kvd *k)
{
    char err[512], note[512];
    struct kvd_options *o = &k->o;
    endpoints_plan(k);
    k->model = model_load_unpacked(o->model, err, sizeof(err));  /* kvd runs no products */
    if (k->model == NULL)
        cli_die("%s", err);
    k->tok = tok_new_from_gguf(k->model->gguf, err, sizeof(err));
    if (k->tok == NULL)
        cli_die("%s", err);
    k->chat = chat_template_for_model(k->model->gguf, err, sizeof(err));
    if (k->chat == NULL)
        kvd_log(k, "chat requests disabled: %s", err);
    uint32_t train = k->model->cfg.n_ctx_train;
    k->n_ctx = o->ctx ? o->ctx : 4096;
    if (k->n_ctx > train) {
        if (o->ctx)
            cli_die("--ctx %u is longer than the model's context of %u", o->ctx, train);
        k->n_ctx = train;
    }

    /* the pool */
    struct pool_layout lay;
    kv_pool_layout(k->model, o->block_tokens, o->kv.k_type, o->kv.v_type, o->kv.rotate, true, &lay);
    struct pool_params pp = pool_default_params();
    snprintf(k->pool_name, sizeof(k->pool_name), "%s", o->pool ? o->pool : "");
    if (o->pool == NULL)
        snprintf(k->pool_name, sizeof(k->pool_name), "kvd-%d", (int)getpid());
    pp.name = k->pool_name;
    pp.reuse = o->pool != NULL;
    pp.unlink_on_close = o->pool == NULL;
    pp.exclusive = o->pool == NULL;     /* never another's segment, whoever made it first */
    /* the private pools of kvds that crashed (SIGKILL, an abort) go first */
    pool_reclaim_stale("kvd-", reclaimed, k);
    uint8_t secret[POOL_SECRET_BYTES];
    if (o->cache_dir != NULL) {
        /* the pools that use a directory as their disk tier share its key
         * secret, so that the blocks one wrote keep their keys in the next */
        bool made;
        if (disk_tier_secret(o->cache_dir, secret, sizeof(secret), &made, err, sizeof(err)) != 0)
            cli_die("--cache-dir: %s", err);
        if (made)
            kvd_log(k, "--cache-dir: a new key secret in %s/secret", o->cache_dir);
        pp.secret = secret;     /* keys as the disk tier's files were made (a new pool) */
    }
    pp.kv_bytes = o->kv_bytes ? o->kv_bytes : o->gpu >= 0 ? gpu_default_kv_bytes(k)
                                                          : default_kv_bytes();
    if (o->gpu >= 0) {
        pp.kv_where = POOL_KV_DEVICE;
        pp.kv_device = o->gpu;
    }
    struct pool_capacity cap;
    if (pool_plan(&lay, &pp, &cap, err, sizeof(err)) != 0)
        cli_die("%s", err);
    k->pool = pool_create(&lay, &pp, note, sizeof(note), err, sizeof(err));
    if (k->pool == NULL)
        cli_die("%s", err);
    snprintf(k->pool_name, sizeof(k->pool_name), "%s", pool_name(k->pool) + 1);  /* "/name" */
    if (pp.unlink_on_close)
        snprintf(private_pool, sizeof(private_pool), "%s", k->pool_name);
    if (pp.unlink_on_close)
        atexit(unlink_private_pool);    /* a setup error (cli_die) after this leaves no segment */
    if (note[0])
        kvd_log(k, "%s", note);
    k->px = prefix_new(k->pool, note, sizeof(note), err, sizeof(err));
    if (k->px == NULL)
        cli_die("%s", err);
    if (note[0])
        kvd_log(k, "pool %s: %s", k->pool_name, note);
    if (o->public_prefix != NULL)
        public_prefix_setup(k);
    if (o->tenant_max_blocks > 0) {
        k->tenant_blocks = o->tenant_max_blocks_pct
                               ? (uint32_t)((uint64_t)pool_header(k->pool)->n_blocks * o->tenant_max_blocks / 100)
                               : o->tenant_max_blocks;
        if (k->tenant_blocks == 0)
            k->tenant_blocks = 1;
        prefix_set_owner_limit(k->px, k->tenant_blocks);
        kvd_log(k, "a tenant holds at most %u of the pool's %u blocks", k->tenant_blocks,
                pool_header(k->pool)->n_blocks);
    }
    pool_describe(&lay, &cap, k->n_ctx, err, sizeof(err));
    kvd_log(k, "KV pool %s: %s", k->pool_name, err);
    k->pool_seq_tokens = hosts_seq_tokens(&lay, cap.n_blocks);
    hosts_init(k);
    /* the budget wire.c recommends: 4 x the largest frame, slack, and room for an
     * LZ4 prompt decompressed into the arena */
    k->arena = wire_arena_new(4 * (size_t)WIRE_MAX_FRAME + (1u << 20) + WIRE_MAX_PROMPT_BYTES + 16);
    if (k->arena == NULL)
        cli_die("out of memory");

    /* sockets */
    k->zctx = zmq_ctx_new();
    k->clients = router(k);
    k->wsock = router(k);
    if (o->curve_secret != NULL)
        auth_setup(k);
    if (o->worker_endpoint != NULL && strncmp(o->worker_endpoint, "tcp://", 6) == 0 && o->curve_secret == NULL) {
        if (!o->insecure)
            cli_die("--worker-endpoint %s: tcp:// needs --curve-secret (workers then need their keys in "
                    "--workers-allow), or --insecure", o->worker_endpoint);
        kvd_log(k, "INSECURE: any process that reaches %s may join as a worker (--insecure)", o->worker_endpoint);
    }
    for (int i = 0; i < o->n_listen; i++) {
        if (zmq_bind(listen_socket(k, o->listen[i]), o->listen[i]) != 0)
            cli_die("cannot listen on %s: %s", o->listen[i], zmq_strerror(errno));
        kvd_log(k, "listening on %s", o->listen[i]);
    }
    if (strstr(k->http_ep, "/http-") != NULL && zmq_bind(k->clients, k->http_ep) != 0)
        cli_die("cannot listen on %s: %s", k->http_ep, zmq_strerror(errno));
    if (zmq_bind(k->wsock, k->worker_ep) != 0)
        cli_die("cannot listen for workers on %s: %s", k->worker_ep, zmq_strerror(errno));
    if (o->gpu >= 0) {
        /* the device memory's socket: in the runtime directory, private either way */
        char dir[4096];
        if (k->run_dir[0]) {
            snprintf(dir, sizeof(dir), "%s", k->run_dir);
        } else {
            char path[4096], def[4096];
            snprintf(path, sizeof(path), "%s", kvd_default_endpoint(def, sizeof(def)));
            if (strncmp(path, "ipc://", 6) != 0)
                snprintf(path, sizeof(path), "ipc:///tmp/kvd-%u/kvd.sock", (unsigned)getuid());
            snprintf(dir, sizeof(dir), "%s", dirname(path + 6));
            private_dir(dir, true);
        }
        gpu_setup(k, dir);
        kvd_log(k, "workers connect to %s (kvd-worker --pool %s --connect %s --model %s --id N "
                "--gpu %d --gpu-socket %s)", k->worker_ep, k->pool_name, k->worker_ep, o->model,
                o->gpu, k->gpu_sock);
    } else {
        kvd_log(k, "workers connect to %s (kvd-worker --pool %s --connect %s --model %s --id N "
                "--block-tokens %u --k-type %s --v-type %s --kv-rotate %s)",
                k->worker_ep, k->pool_name, k->worker_ep, o->model, o->block_tokens,
                kv_type_name(o->kv.k_type), kv_type_name(o->kv.v_type), kv_rotate_arg(o->kv.rotate));
    }
    /* the tiers below the pool: after a GPU pool's device memory is mapped */
    if (o->host_cache_bytes > 0 || o->cache_dir != NULL)
        tiers_setup(k, &lay);
}

void kvd_served_name(const struct kvd_options *o, char *name, size_t len)
{
    if (o->model_name != NULL) {
        snprintf(name, len, "%s", o->model_name);
    } else {
        const char *base = strrchr(o->model, '/');
        snprintf(name, len, "%s", base ? base + 1 : o->model);
        const size_t n = strlen(name);
        if (n > 5 && strcmp(name + n - 5, ".gguf") == 0)
            name[n - 5] = '\0';
    }
}

/* --kv-events: the publisher, and what the index already holds (an adopted
 * pool's blocks) announced after an AllBlocksCleared. */
static void events_setup(struct kvd *k)
{
    const struct kvd_options *o = &k->o;
    if (o->kv_events == NULL)
        return;
    char topic[1024], name[256], host[256];
    kvd_served_name(o, name, sizeof(name));
    if (gethostname(host, sizeof(host)) != 0)
        snprintf(host, sizeof(host), "localhost");
    host[sizeof(host) - 1] = '\0';
    if (o->kv_events_topic != NULL)
        snprintf(topic, sizeof(topic), "%s", o->kv_events_topic);
    else
        snprintf(topic, sizeof(topic), "kv@%s@%s", host, name);
    /* over tcp:// only the keys of --events-allow subscribe, or with --insecure
     * whoever reaches the port; over ipc:// the private directory decides */
    const bool tcp = strncmp(o->kv_events, "tcp://", 6) == 0;
    if (tcp && o->curve_secret == NULL && !o->insecure)
        cli_die("--kv-events %s: tcp:// needs --curve-secret (subscribers' keys in --events-allow), or "
                "--insecure to publish to whoever reaches it", o->kv_events);
    if (tcp && o->curve_secret == NULL)
        kvd_log(k, "INSECURE: anyone who reaches %s may read the block events (--insecure, no CURVE)", o->kv_events);
    struct kv_events_params ep = {
        .endpoint = o->kv_events, .topic = topic, .medium = o->gpu >= 0 ? "GPU" : "CPU",
        .curve = tcp && o->curve_secret != NULL ? &k->cert : NULL, .all_tokens = o->kv_events_all_tokens,
    };
    ep.shared[ep.n_shared++] = prefix_namespace(k->px, "", 0);
    if (k->n_public_tok > 0)
        ep.shared[ep.n_shared++] = k->public_ns;
    char err[256];
    k->events = kv_events_open(k->zctx, &ep, k->px, err, sizeof(err));
    if (k->events == NULL)
        cli_die("%s", err);
    kv_events_announce(k->events);
    kv_events_flush(k->events);
    kvd_log(k, "block events on %s, topic '%s'", o->kv_events, topic);
}

/* A GGUF string key as a new NUL-terminated string, or NULL when absent. */
static char *gguf_strdup(const gguf_ctx_t *g, const char *key)
{
    struct gguf_str v;
    if (gguf_get_str(g, key, &v) != 0)
        return NULL;
    char *s = malloc((size_t)v.len + 1);
    if (s != NULL) {
        memcpy(s, v.ptr, (size_t)v.len);
        s[v.len] = '\0';
    }
    return s;
}

/* The tokenizer's facts for GET /tokenizer_info into *t; the strings and the
 * special tokens are malloc'd (tokenizer_facts_free). */
static void tokenizer_facts(const struct kvd *k, struct http_tokenizer *t)
{
    const gguf_ctx_t *g = k->model->gguf;
    bool add_eos = false;
    memset(t, 0, sizeof(*t));
    t->model = gguf_strdup(g, "tokenizer.ggml.model");
    t->chat_template = gguf_strdup(g, "tokenizer.chat_template");
    t->n_vocab = (uint32_t)tok_n_vocab(k->tok);
    t->max_model_len = k->n_ctx;
    t->bos = tok_bos(k->tok);
    t->eos = tok_eos(k->tok);
    t->pad = tok_pad(k->tok);
    t->unk = tok_unk(k->tok);
    t->add_bos = tok_add_bos(k->tok);
    t->add_eos = gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &add_eos) == 0 && add_eos;
    size_t n = 0;
    for (uint32_t id = 0; id < t->n_vocab; id++)
        n += tok_type(k->tok, (int32_t)id) == TOK_TYPE_CONTROL || tok_type(k->tok, (int32_t)id) == TOK_TYPE_USER_DEFINED;
    struct http_token *sp = calloc(n ? n : 1, sizeof(*sp));
    for (uint32_t id = 0; sp != NULL && id < t->n_vocab; id++) {
        const int type = tok_type(k->tok, (int32_t)id);
        size_t len = 0;
        const char *text = tok_text(k->tok, (int32_t)id, &len);
        char *copy = (type == TOK_TYPE_CONTROL || type == TOK_TYPE_USER_DEFINED) ? malloc(len + 1) : NULL;
        if (copy == NULL)
            continue;
        memcpy(copy, text, len);
        copy[len] = '\0';
        sp[t->n_special++] = (struct http_token){ (int32_t)id, copy };
    }
    t->special = sp;
}

static void tokenizer_facts_free(struct http_tokenizer *t)
{
    for (size_t i = 0; i < t->n_special; i++)
        free((char *)t->special[i].text);
    free((void *)t->special);
    free((char *)t->model);
    free((char *)t->chat_template);
    memset(t, 0, sizeof(*t));
}

/* The HTTP front ends of --http: loopback addresses unless --allow-remote. */
static void http_setup(struct kvd *k)
{
    const struct kvd_options *o = &k->o;
    char name[256];
    kvd_served_name(o, name, sizeof(name));
    struct http_tokenizer tf;
    tokenizer_facts(k, &tf);
    for (int i = 0; i < o->n_http; i++) {
        const char *h = o->http[i];     /* checked by endpoints_plan */
        const struct http_params hp = {
            .bind = h, .kvd_endpoint = k->http_ep, .model_id = name, .max_body = o->max_body,
            .block_tokens = o->block_tokens, .tokenizer = &tf, .api_keys = o->api_keys,
            .operator_key = o->operator_key,
            .max_conns = o->http_max_conns, .max_conns_per_ip = o->http_max_conns_per_ip,
            .timeout_s = o->http_timeout_s, .max_memory = o->http_max_memory, .max_requests = o->http_max_requests,
        };
        char err[256];
        k->http[i] = http_start(&hp, err, sizeof(err));
        if (k->http[i] == NULL)
            cli_die("%s", err);
        kvd_log(k, "HTTP on %s (OpenAI-compatible API, model '%s')", h, name);
    }
    tokenizer_facts_free(&tf);
}

/* ---- the loop -------------------------------------------------------------------------------- */

/* Receives every waiting (routing id, payload) pair from a ROUTER: the
 * workers' (origin -1) or a clients' one (RID_PLAIN, RID_CURVE). */
static void drain_socket(struct kvd *k, void *sock, int origin)
{
    const bool from_workers = origin < 0;
    uint8_t rid[KVD_RID_MAX];
    zmq_msg_t id, body;
    zmq_msg_init(&id);
    zmq_msg_init(&body);
    for (;;) {
        if (zmq_msg_recv(&id, sock, ZMQ_DONTWAIT) < 0)
            break;
        bool ok = zmq_msg_more(&id) && zmq_msg_recv(&body, sock, ZMQ_DONTWAIT) >= 0;
        bool extra = ok && zmq_msg_more(&body);
        while (extra) {  /* a message of more than one payload frame: drop the rest */
            zmq_msg_t junk;
            zmq_msg_init(&junk);
            extra = zmq_msg_recv(&junk, sock, ZMQ_DONTWAIT) >= 0 && zmq_msg_more(&junk);
            zmq_msg_close(&junk);
            ok = false;
        }
        if (!ok || zmq_msg_size(&id) > KVD_RID_MAX - 1) {
            k->st.bad_messages++;
            continue;
        }
        if (from_workers) {
            workers_on_message(k, zmq_msg_data(&id), zmq_msg_size(&id), zmq_msg_data(&body),
                               zmq_msg_size(&body));
        } else {
            /* the socket it came on goes first: replies go back there, and the
             * same routing id on the other socket is another client */
            rid[0] = (uint8_t)origin;
            memcpy(rid + 1, zmq_msg_data(&id), zmq_msg_size(&id));
            const char *tenant = origin == RID_CURVE ? auth_peer(&body) : NULL;
            if (origin == RID_CURVE && (tenant == NULL || tenant[0] == '\0')) {
                k->st.bad_messages++;   /* unreachable: the ZAP handler names every key it admits */
                continue;
            }
            req_on_client(k, rid, zmq_msg_size(&id) + 1, tenant, zmq_msg_data(&body), zmq_msg_size(&body));
        }
    }
    zmq_msg_close(&id);
    zmq_msg_close(&body);
}

/* A worker that exited on its own may have sent its last messages just before
 * (the Done of a batch whose step broke its GPU context: it flushes them
 * before exiting): they are read before the exit is handled, or its requests
 * would be taken for those of a crashed worker and resumed. Waits at most
 * 500 ms, and stops at the first 50 ms with nothing more. */
static void drain_before_reap(struct kvd *k)
{
    siginfo_t si;
    memset(&si, 0, sizeof(si));
    if (waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) != 0 || si.si_pid == 0 || si.si_code != CLD_EXITED)
        return;     /* none exited, or one was killed: it flushed nothing */
    for (double until = cli_now_ms() + 500; cli_now_ms() < until;) {
        zmq_pollitem_t it = { k->wsock, 0, ZMQ_POLLIN, 0 };
        if (zmq_poll(&it, 1, 50) <= 0)
            break;
        drain_socket(k, k->wsock, -1);
    }
}

static void start_drain(struct kvd *k)
{
    if (k->draining)
        return;
    k->draining = true;
    for (int i = 0; i < k->o.n_http; i++)
        http_quiesce(k->http[i]);
    k->drain_deadline = cli_now_ms() + k->o.grace_ms;
    kvd_log(k, "draining: %u running, %u queued; %u ms to finish", k->n_active, k->n_queued,
            k->o.grace_ms);
}

static void loop(struct kvd *k, int sfd)
{
    bool cancelled = false;
    double cancel_deadline = 0;
    while (!k->stop) {
        /* an entry that is not in use polls a closed descriptor (-1): never ready */
        zmq_pollitem_t items[8] = {
            { k->clients, 0, ZMQ_POLLIN, 0 },
            { k->wsock, 0, ZMQ_POLLIN, 0 },
            { NULL, sfd, ZMQ_POLLIN, 0 },
            { NULL, k->restorer != NULL ? restorer_fd(k->restorer) : -1, ZMQ_POLLIN, 0 },
            { NULL, k->gpu_fd, ZMQ_POLLIN, 0 },
            { k->clients_curve, -1, ZMQ_POLLIN, 0 },
            { k->curve_mon, -1, ZMQ_POLLIN, 0 },
            { k->wcurve_mon, -1, ZMQ_POLLIN, 0 },
        };
        if (zmq_poll(items, 8, 50) < 0 && errno != EINTR)
            cli_die("poll: %s", zmq_strerror(errno));
        if (k->gpu_fd >= 0 && (items[4].revents & ZMQ_POLLIN))
            gpu_serve(k);
        if (items[3].revents & ZMQ_POLLIN)
            req_on_restored(k);
        if (items[2].revents & ZMQ_POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
                if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT)
                    start_drain(k);
                if (si.ssi_signo == SIGHUP)
                    auth_reread(k);
            }
        }
        if (items[1].revents & ZMQ_POLLIN)
            drain_socket(k, k->wsock, -1);
        if (items[0].revents & ZMQ_POLLIN)
            drain_socket(k, k->clients, RID_PLAIN);
        if (items[5].revents & ZMQ_POLLIN)
            drain_socket(k, k->clients_curve, RID_CURVE);
        if (items[6].revents & ZMQ_POLLIN)
            curve_events(k, k->curve_mon);
        if (items[7].revents & ZMQ_POLLIN)
            curve_events(k, k->wcurve_mon);
        drain_before_reap(k);
        workers_reap(k);
        workers_tick(k);
        req_tick(k);
        view_tick(k);
        if (k->events != NULL)
            kv_events_flush(k->events);
        if (k->draining) {
            double now = cli_now_ms();
            if (k->n_active == 0 && k->n_queued == 0)
                k->stop = true;
            else if (!cancelled && now > k->drain_deadline) {
                req_cancel_all(k, "kvd is shutting down");
                cancelled = true;
                /* workers confirm when their step in progress ends: wait
                 * --worker-timeout for that (at least 2 s), then stop them */
                cancel_deadline = now + (k->o.worker_timeout_ms > 2000 ? k->o.worker_timeout_ms : 2000);
            } else if (cancelled && now > cancel_deadline) {
                k->stop = true; /* workers that do not answer are stopped below */
            }
        }
    }
}

/* (declared: tests/fuzz builds this file with main renamed, as a library of kvd) */
int main(int argc, char **argv);

int main(int argc, char **argv)
{
    cli_init("kvd");
    struct kvd *k = calloc(1, sizeof(*k));
    if (k == NULL)
        cli_die("out of memory");
    parse_args(argc, argv, &k->o);
    /* signals arrive through a descriptor the loop polls. Blocked before
     * anything starts a thread (CUDA's driver does, in gpu_probe): a thread
     * that did not inherit the mask would take SIGTERM's default action and
     * kill kvd without its shutdown */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);
    int sfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd < 0)
        cli_die("signalfd: %s", strerror(errno));
    signal(SIGPIPE, SIG_IGN);
    /* every HTTP connection, client and worker costs descriptors: take all the
     * hard limit allows */
    struct rlimit nofile;
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
        nofile.rlim_cur = nofile.rlim_max;
        setrlimit(RLIMIT_NOFILE, &nofile);
    }
    gpu_probe(k); /* a GPU that is not there fails now, not after the model loads */
    srandom((unsigned)time(NULL) ^ (unsigned)getpid());
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0)
        cli_die("cannot find my own executable");
    exe[n] = '\0';
    snprintf(k->exe_dir, sizeof(k->exe_dir), "%s", dirname(exe));

    setup(k);
    if (workers_start(k) != 0)
        cli_die("cannot start workers: %s", strerror(errno));
    http_setup(k);
    events_setup(k);
    if (pins_init(k) != 0)
        cli_die("out of memory");
    pins_load(k);   /* the pins of the disk tier's directory, their blocks read back */
    kvd_log(k, "ready: model %s, %d workers, context %u", k->o.model, k->o.n_workers, k->n_ctx);
    loop(k, sfd);
    for (int i = 0; i < k->o.n_http; i++)
        http_stop(&k->http[i]);

    workers_stop(k);
    req_release_all(k);
    pins_fini(k);   /* the pins file stays for the next kvd */
    kv_events_close(&k->events);
    struct prefix_stats ps;
    prefix_stats(k->px, &ps);
    kvd_log(k, "stopped: %llu requests done, %llu failed; blocks in use %u, pending %u",
            (unsigned long long)k->st.done, (unsigned long long)k->st.failed, ps.n_used,
            ps.n_pending);
    wire_arena_destroy(&k->arena);
    zmq_close(k->clients);
    if (k->clients_curve != NULL)
        zmq_close(k->clients_curve);
    if (k->curve_mon != NULL)
        zmq_close(k->curve_mon);
    if (k->wcurve_mon != NULL)
        zmq_close(k->wcurve_mon);
    zmq_close(k->wsock);
    auth_destroy(&k->auth);
    free(k->tenants);
    free(k->public_tok);
    zmq_ctx_term(k->zctx);
    if (strncmp(k->worker_ep, "ipc://", 6) == 0)
        unlink(k->worker_ep + 6);
    for (int i = 0; i < k->o.n_listen; i++)
        if (strncmp(k->o.listen[i], "ipc://", 6) == 0)
            unlink(k->o.listen[i] + 6);
    if (strstr(k->http_ep, "/http-") != NULL)
        unlink(k->http_ep + 6);
    if (k->o.kv_events != NULL && strncmp(k->o.kv_events, "ipc://", 6) == 0)
        unlink(k->o.kv_events + 6);
    release_endpoints(k);
    hosts_fini(k);
    prefix_destroy(&k->px);
    tiers_fini(k);
    pool_close(&k->pool);
    gpu_fini(k);
    chat_template_destroy(&k->chat);
    tok_destroy(&k->tok);
    model_destroy(&k->model);
    close(sfd);
    int status = k->exit_status;
    free(k);
    return status;
}
