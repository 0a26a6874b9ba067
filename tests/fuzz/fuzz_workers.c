/*
 * fuzz_workers.c - kvd's handling of what workers send it, workers of other
 * hosts (kvd-worker --host) among them: the daemon's own code (workers.c,
 * hosts.c, requests.c) in a kvd set up in this process over a small random
 * model, with real ZeroMQ sockets that nobody reads (what kvd sends its
 * workers and clients goes nowhere).
 *
 * The input is a program: each step a byte (worker 0-3 in bits 4-5, the
 * operation in the low four, modulo 10), then the operation's operands.
 *   0  raw bytes from a worker: a length byte and a frame, as if received
 *   1  a Ready: kvd's own host, or a remote one (name, instance, blocks)
 *   2  a Commit, 3 a token chunk, 4 a lease, 5 a Done: for a request kvd
 *      runs (chosen by index among the running ones, or any id) and
 *      positions chosen from the input
 *   6  a client's generate request (token ids from the input)
 *   7  a worker goes quiet: kvd declares it lost at its next tick
 *   8  the fence times of lost remote workers have passed
 *   9  a client cancels or asks for stats
 * After every step the invariants of every host's allocator hold
 * (prefix_check); at the end every request is ended, every worker lost, and
 * every pool must be back to no block in use or pending. A crash, a sanitizer
 * report or a broken invariant is a bug.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "hosts.h"
#include "kvd.h"
#include "requests.h"
#include "workers.h"
#include "mkmodel.h"
#include "types.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static model_t *model;
static tok_t *tok;
static void *zctx;
static char model_path[64];

/* What the program reads its operands from. */
struct input {
    const uint8_t *p;
    size_t n;
};

static uint32_t take(struct input *in, int bytes)
{
    uint32_t v = 0;
    for (int i = 0; i < bytes; i++) {
        v = v << 8 | (in->n ? *in->p : 0);
        if (in->n) {
            in->p++;
            in->n--;
        }
    }
    return v;
}

static void setup(void)
{
    char err[256];
    snprintf(model_path, sizeof(model_path), "/tmp/kvd-fuzz-workers-%d.gguf", (int)getpid());
    struct mkmodel_params mp = mkmodel_default_params();
    if (mkmodel_write(&mp, model_path, err, sizeof(err)) != 0 ||
        (model = model_load(model_path, err, sizeof(err))) == NULL ||
        (tok = tok_new_from_gguf(model->gguf, err, sizeof(err))) == NULL) {
        fprintf(stderr, "fuzz_workers: %s\n", err);
        abort();
    }
    unlink(model_path);
    zctx = zmq_ctx_new();
}

/* A ROUTER nobody connects to; with mandatory routing (as kvd's worker
 * socket) every send fails, so kvd finds each worker unreachable and loses
 * it at its next tick. */
static void *quiet_router(const char *ep, int mandatory)
{
    void *s = zmq_socket(zctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof(mandatory));
    if (zmq_bind(s, ep) != 0)
        abort();
    return s;
}

static struct kvd *kvd_new(void)
{
    static unsigned n_made;
    struct kvd *k = calloc(1, sizeof(*k));
    if (k == NULL)
        abort();
    k->o.block_tokens = 4;
    k->o.max_batch = 3;
    k->o.max_queue = 8;
    k->o.step_tokens = 16;
    k->o.worker_timeout_ms = 5000;
    k->o.max_restarts = 0;
    k->o.kv = (struct kv_params){ 0 };
    k->o.kv.k_type = k->o.kv.v_type = KERN_F16;
    k->o.gpu = -1;
    k->o.max_fence_ms = 60000;      /* kvd's defaults */
    k->o.host_max_blocks = 1u << 18;
    k->o.max_tenants = KVD_MAX_TENANTS;
    k->o.quiet = getenv("KVD_FUZZ_LOG") == NULL;
    k->n_ctx = 64;
    k->model = model;
    k->tok = tok;
    char err[256], note[256];
    struct pool_layout lay;
    kv_pool_layout(model, k->o.block_tokens, KERN_F16, KERN_F16, 0, true, &lay);
    struct pool_params pp = pool_default_params();
    pp.n_blocks = 24;
    k->pool = pool_create(&lay, &pp, NULL, 0, err, sizeof(err));
    if (k->pool == NULL || (k->px = prefix_new(k->pool, note, sizeof(note), err, sizeof(err))) == NULL) {
        fprintf(stderr, "fuzz_workers: %s\n", err);
        abort();
    }
    k->pool_seq_tokens = hosts_seq_tokens(&lay, 24);
    hosts_init(k);
    k->zctx = zctx;
    char ep[64];
    snprintf(ep, sizeof(ep), "inproc://fw-c%u", n_made);
    k->clients = quiet_router(ep, 0);
    snprintf(ep, sizeof(ep), "inproc://fw-w%u", n_made++);
    k->wsock = quiet_router(ep, 1);
    k->arena = wire_arena_new(4 * (size_t)WIRE_MAX_FRAME + (1u << 20));
    if (k->arena == NULL)
        abort();
    return k;
}

static void check_all(struct kvd *k)
{
    char err[256];
    for (int h = 0; h < KVD_MAX_HOSTS; h++)
        if (k->hosts[h].used && prefix_check(k->hosts[h].px, err, sizeof(err)) != 0) {
            fprintf(stderr, "fuzz_workers: host %d: %s\n", h, err);
            abort();
        }
}

static void kvd_free(struct kvd *k)
{
    req_release_all(k);
    for (int i = 0; i < KVD_MAX_WORKERS; i++)
        if (k->workers[i].used && k->workers[i].alive) {
            k->workers[i].last_heartbeat = -1e12;   /* quiet for ever: lost at the tick */
            k->workers[i].spawned = false;
            k->workers[i].pid = 0;                  /* kvd signals no process of ours */
        }
    workers_tick(k);
    for (int h = 0; h < KVD_MAX_HOSTS; h++)
        if (k->hosts[h].used)
            for (struct kvd_fenced *f = k->hosts[h].fenced; f; f = f->next)
                f->until = 0;
    workers_tick(k);
    check_all(k);
    for (int h = 0; h < KVD_MAX_HOSTS; h++) {
        if (!k->hosts[h].used)
            continue;
        struct prefix_stats st;
        prefix_stats(k->hosts[h].px, &st);
        if (st.n_used != 0 || st.n_pending != 0 || k->hosts[h].fenced != NULL) {
            fprintf(stderr, "fuzz_workers: host %d leaks blocks: %u in use, %u pending\n", h, st.n_used,
                    st.n_pending);
            abort();
        }
    }
    if (k->queue != NULL || k->active != NULL)
        abort();
    hosts_fini(k);
    prefix_destroy(&k->px);
    pool_close(&k->pool);
    zmq_close(k->clients);
    zmq_close(k->wsock);
    wire_arena_destroy(&k->arena);
    free(k->tenants);
    free(k);
}

static void from_worker(struct kvd *k, int w, Kvdw__FromWorker *m)
{
    uint8_t rid[2] = { 'w', (uint8_t)w };
    m->has_version = true;
    m->version = WIRE_VERSION;
    m->has_worker_id = true;
    m->worker_id = (uint32_t)w;
    uint8_t *buf;
    size_t len;
    if (wire_pack(&m->base, &buf, &len) != 0)
        abort();
    workers_on_message(k, rid, sizeof(rid), buf, len);
    free(buf);
}

/* A running request's id by index, or any id. */
static uint64_t seq_of(struct kvd *k, uint32_t pick)
{
    uint32_t i = 0;
    for (struct request *r = k->active; r; r = r->next)
        if (i++ == (pick & 7))
            return r->seq_id;
    return pick;
}

static void client(struct kvd *k, struct input *in, uint32_t op)
{
    uint8_t rid[3] = { RID_PLAIN, 'c', (uint8_t)(op & 3) };
    Kvd__ClientRequest m = KVD__CLIENT_REQUEST__INIT;
    Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
    Kvd__StatsRequest sr = KVD__STATS_REQUEST__INIT;
    Kvd__CancelRequest cr = KVD__CANCEL_REQUEST__INIT;
    int32_t toks[48];
    m.has_version = m.has_request_id = true;
    m.version = WIRE_VERSION;
    m.request_id = take(in, 1);
    if (op == 6) {
        const uint32_t n = 1 + take(in, 1) % 40, shared = take(in, 1) % 3;
        for (uint32_t i = 0; i < n; i++)
            toks[i] = i < 24 ? (int32_t)(shared * 7 + i) % 200 : (int32_t)(take(in, 1) % 200);
        g.token_ids = toks;
        g.n_token_ids = n;
        g.has_max_tokens = true;
        g.max_tokens = take(in, 1) % 24;
        g.has_stream = true;
        g.stream = take(in, 1) & 1;
        m.body_case = KVD__CLIENT_REQUEST__BODY_GENERATE;
        m.generate = &g;
    } else if (take(in, 1) & 1) {
        m.body_case = KVD__CLIENT_REQUEST__BODY_STATS;
        m.stats = &sr;
    } else {
        cr.has_target = true;
        cr.target = take(in, 1);
        m.body_case = KVD__CLIENT_REQUEST__BODY_CANCEL;
        m.cancel = &cr;
    }
    uint8_t *buf;
    size_t len;
    if (wire_pack(&m.base, &buf, &len) != 0)
        abort();
    req_on_client(k, rid, sizeof(rid), NULL, buf, len);
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (model == NULL)
        setup();
    struct kvd *k = kvd_new();
    struct input in = { data, size };
    for (int steps = 0; in.n > 0 && steps < 64; steps++) {
        const uint32_t op = take(&in, 1);
        const int w = (int)(op >> 4) & 3;   /* four workers: ids 0..3 */
        const uint32_t kind = (op & 15) % 10;
        Kvdw__FromWorker m = KVDW__FROM_WORKER__INIT;
        switch (kind) {
        case 0: {
            uint8_t frame[256], rid[2] = { 'w', (uint8_t)w };
            const uint32_t n = take(&in, 1);
            for (uint32_t i = 0; i < n; i++)
                frame[i] = (uint8_t)take(&in, 1);
            workers_on_message(k, rid, sizeof(rid), frame, n);
            break;
        }
        case 1: {
            Kvdw__Ready r = KVDW__READY__INIT;
            char host[8];
            const uint32_t where = take(&in, 1);
            r.has_pid = r.has_max_batch = r.has_fingerprint = r.has_block_tokens = true;
            r.pid = 0;   /* never a process kvd could signal */
            r.max_batch = 1 + where % 3;
            r.fingerprint.data = pool_header(k->pool)->layout.fingerprint;
            r.fingerprint.len = 16;
            r.block_tokens = k->o.block_tokens;
            r.has_pool_instance = r.has_epoch = true;
            r.pool_instance = (where & 0x40) ? 99 : pool_header(k->pool)->instance;  /* 99: a stranger's */
            r.epoch = 1 + where;
            if (where & 0x80) {
                snprintf(host, sizeof(host), "h%u", (where >> 4) & 3);
                r.host = host;
                r.has_pool_instance = r.has_pool_blocks = r.has_fence_ms = true;
                r.pool_instance = 1 + (where >> 3 & 1);
                r.pool_blocks = 4 + take(&in, 1) % 40;
                r.fence_ms = 1000;
            }
            m.body_case = KVDW__FROM_WORKER__BODY_READY;
            m.ready = &r;
            from_worker(k, w, &m);
            break;
        }
        case 2: {
            Kvdw__Commit c = KVDW__COMMIT__INIT;
            c.has_seq_id = c.has_n_written = true;
            c.seq_id = seq_of(k, take(&in, 1));
            c.n_written = take(&in, 1) % 72;
            m.body_case = KVDW__FROM_WORKER__BODY_COMMIT;
            m.commit = &c;
            from_worker(k, w, &m);
            break;
        }
        case 3: {
            Kvdw__TokenChunk c = KVDW__TOKEN_CHUNK__INIT;
            int32_t t = (int32_t)(take(&in, 1) % 256);
            c.has_seq_id = c.has_n_written = true;
            c.seq_id = seq_of(k, take(&in, 1));
            c.n_written = take(&in, 1) % 72;
            c.tokens = &t;
            c.n_tokens = 1;
            m.body_case = KVDW__FROM_WORKER__BODY_CHUNK;
            m.chunk = &c;
            from_worker(k, w, &m);
            break;
        }
        case 4: {
            Kvdw__LeaseRequest l = KVDW__LEASE_REQUEST__INIT;
            l.has_seq_id = l.has_n_positions = true;
            l.seq_id = seq_of(k, take(&in, 1));
            l.n_positions = take(&in, 1) % 80;
            m.body_case = KVDW__FROM_WORKER__BODY_LEASE;
            m.lease = &l;
            from_worker(k, w, &m);
            break;
        }
        case 5: {
            Kvdw__Done d = KVDW__DONE__INIT;
            d.has_seq_id = d.has_reason = d.has_n_written = true;
            d.seq_id = seq_of(k, take(&in, 1));
            d.reason = (Kvdw__DoneReason)(take(&in, 1) % 5);
            d.n_written = take(&in, 1) % 72;
            m.body_case = KVDW__FROM_WORKER__BODY_DONE;
            m.done = &d;
            from_worker(k, w, &m);
            break;
        }
        case 6:
        case 9:
            client(k, &in, kind);
            break;
        case 7:
            for (int i = 0; i < KVD_MAX_WORKERS; i++) {
                k->workers[i].pid = 0;      /* a raw Ready may name any pid: kvd signals none here */
                if (k->workers[i].used && k->workers[i].id == (uint32_t)w)
                    k->workers[i].last_heartbeat = -1e12;
            }
            workers_tick(k);
            break;
        case 8:
            for (int h = 0; h < KVD_MAX_HOSTS; h++)
                if (k->hosts[h].used)
                    for (struct kvd_fenced *f = k->hosts[h].fenced; f; f = f->next)
                        f->until = 0;
            hosts_tick(k);
            break;
        }
        req_dispatch(k);
        check_all(k);
        if (!k->o.quiet)
            fprintf(stderr, "step %d: op %02x: %u queued, %u running, %llu done, %llu failed\n", steps, op,
                    k->n_queued, k->n_active, (unsigned long long)k->st.done, (unsigned long long)k->st.failed);
    }
    kvd_free(k);
    return 0;
}
