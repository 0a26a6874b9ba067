/*
 * stats.c - kvd's figures: the latency histograms and the Stats reply, every
 * field from the tables of kvd_stats_fields.h.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvd.h"
#include "pins.h"
#include "req_internal.h"
#include "hosts.h"
#include "view.h"
#include "kvd_stats_fields.h"

/* Upper bounds of the latency histograms, seconds (vLLM's TTFT buckets, cut). */
static const double hist_bounds[KVD_HIST_N] = { 0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                                0.5, 1.0, 2.5, 5.0, 10.0, 20.0 };

/* Adds n observations of v seconds. */
static void hist_add(struct kvd_hist *h, double v, uint64_t n)
{
    int b = 0;
    while (b < KVD_HIST_N && v > hist_bounds[b])
        b++;
    h->counts[b] += n;
    h->sum += v * (double)n;
}

void req_observe(struct kvd *k, const struct request *r, double now, uint32_t n_gen)
{
    if (r->failed || r->finish == KVD__FINISH_REASON__FINISH_CANCELLED ||
        r->finish == KVD__FINISH_REASON__FINISH_DEADLINE)
        k->st.finished_abort++;
    else if (r->finish == KVD__FINISH_REASON__FINISH_STOP)
        k->st.finished_stop++;
    else
        k->st.finished_length++;
    if (r->failed)
        return;
    hist_add(&k->st.e2e, (now - r->t_arrival) / 1e3, 1);
    hist_add(&k->st.queue, ((r->t_dispatch > 0 ? r->t_dispatch : now) - r->t_arrival) / 1e3, 1);
    if (r->t_first > 0)
        hist_add(&k->st.ttft, (r->t_first - r->t_arrival) / 1e3, 1);
    if (r->t_first > 0 && n_gen > 1)    /* the mean gap, once per gap */
        hist_add(&k->st.itl, (r->t_last - r->t_first) / 1e3 / (n_gen - 1), n_gen - 1);
}

/* Collects the published hashes of findable blocks (Stats.block_hashes). */
struct hash_list {
    uint64_t *v;
    size_t n, cap;
};

static void add_hash(void *user, prefix_key_t key, const prefix_key_t *parent, const int32_t *tokens,
                     prefix_ns_t ns)
{
    struct hash_list *l = user;
    (void)parent;
    (void)tokens;
    (void)ns;
    if (l->n < l->cap)
        l->v[l->n++] = key.lo;
}

/* Every figure of the tables in kvd_stats_fields.h is sent, 0 included: the
 * has_ flag of each number (strings have none) of s, *ts, x and *x. */
#define SET_HAS_U64(m, name) (m).has_##name = true;
#define SET_HAS_U32 SET_HAS_U64
#define SET_HAS_I32 SET_HAS_U64
#define SET_HAS_BOOL SET_HAS_U64
#define SET_HAS_STR48(m, name)
#define SET_HAS_STR64 SET_HAS_STR48
#define SET_HAS_STR128 SET_HAS_STR48
#define HAS_S(name, type, prom_type, prom_name, help) SET_HAS_##type(s, name)
#define HAS_TS(name, type, prom_type, prom_name, help) SET_HAS_##type(*ts, name)
#define HAS_X(name, type, prom_type, prom_name, help) SET_HAS_##type(x, name)
#define HAS_XP(name, type, prom_type, prom_name, help) SET_HAS_##type(*x, name)

void req_on_stats(struct kvd *k, const uint8_t *rid, size_t rid_len, const char *tenant, uint64_t id,
                  bool block_hashes, const Kvd__StatsRequest *sr)
{
    /* what the index holds now is in the batches counted below: none waits for the loop's flush */
    if (k->events != NULL)
        kv_events_flush(k->events);
    /* the totals are over every host's pool; the rows below say which holds what */
    struct prefix_stats ps, hs[KVD_MAX_HOSTS];
    prefix_stats(k->px, &ps);
    hs[0] = ps;
    for (int h = 1; h < KVD_MAX_HOSTS; h++) {
        if (!k->hosts[h].used)
            continue;
        prefix_stats(k->hosts[h].px, &hs[h]);
        ps.n_blocks += hs[h].n_blocks;
        ps.n_free += hs[h].n_free;
        ps.n_cached += hs[h].n_cached;
        ps.n_used += hs[h].n_used;
        ps.n_pending += hs[h].n_pending;
        ps.evictions += hs[h].evictions;
    }
    Kvd__ServerReply m = KVD__SERVER_REPLY__INIT;
    Kvd__Stats s = KVD__STATS__INIT;
    KVD_STATS_FIELDS(HAS_S)
    Kvd__WorkerStats ws[KVD_MAX_WORKERS], *wp[KVD_MAX_WORKERS];
    s.requests_running = k->n_active;
    s.requests_queued = k->n_queued;
    s.requests_done = k->st.done;
    s.requests_failed = k->st.failed;
    s.prompt_tokens = k->st.prompt_tokens;
    s.cached_prompt_tokens = k->st.cached_prompt_tokens;
    s.completion_tokens = k->st.completion_tokens;
    s.blocks_total = ps.n_blocks;
    s.blocks_free = ps.n_free;
    s.blocks_cached = ps.n_cached;
    s.blocks_in_use = ps.n_used;
    s.blocks_pending = ps.n_pending;
    s.evictions = ps.evictions;
    s.preemptions = k->st.preemptions;
    s.bad_messages = k->st.bad_messages;
    s.block_tokens = k->o.block_tokens;
    s.block_bytes = ps.block_bytes;
    const struct kv_parts *parts = &pool_header(k->pool)->layout.parts;
    s.kv_bytes_per_token = ps.block_bytes * parts->n_parts / k->o.block_tokens;
    s.kv_parts = parts->n_parts;
    s.kv_part_layers = parts->part_layers;
    s.kv_window = parts->window[parts->n_parts - 1];
    s.host_cached_prompt_tokens = k->st.host_cached_prompt_tokens;
    s.host_cache_declined = k->st.host_declined;
    if (k->tier != NULL) {
        struct tier_stats ts;
        tier_stats(k->tier, &ts);
        s.host_cache_max_bytes = ts.max_bytes;
        s.host_cache_bytes = ts.bytes;
        s.host_cache_blocks = ts.entries;
        s.host_cache_stored = ts.stored;
        s.host_cache_dropped = ts.dropped;
        s.host_cache_corrupt = ts.corrupt;
    }
    s.auth_handshakes_failed = k->st.handshakes_failed;
    if (k->auth != NULL) {
        struct auth_stats as;
        auth_stats(k->auth, &as);
        s.auth_clients_admitted = as.admitted[AUTH_CLIENTS];
        s.auth_clients_refused = as.refused[AUTH_CLIENTS];
        s.auth_workers_refused = as.refused[AUTH_WORKERS];
        s.auth_client_keys = as.keys[AUTH_CLIENTS];
    }
    s.disk_cached_prompt_tokens = k->st.disk_cached_prompt_tokens;
    /* tenants: every one for the operator's socket, a tenant its own row */
    Kvd__TenantStats *trows = calloc(k->n_tenants ? k->n_tenants : 1, sizeof(*trows));
    Kvd__TenantStats **tptrs = calloc(k->n_tenants ? k->n_tenants : 1, sizeof(*tptrs));
    if (trows != NULL && tptrs != NULL) {
        const int32_t only = tenant != NULL ? req_tenant_find(k, tenant, strlen(tenant)) : -1;
        for (uint32_t i = 0; i < k->n_tenants; i++) {
            if (tenant != NULL && (int32_t)i != only)
                continue;
            const struct kvd_tenant *t = &k->tenants[i];
            Kvd__TenantStats *ts = &trows[s.n_tenants];
            kvd__tenant_stats__init(ts);
            KVD_TENANT_STATS_FIELDS(HAS_TS)
            ts->name = (char *)t->name;
            ts->requests = t->requests;
            ts->prompt_tokens = t->prompt_tokens;
            ts->cached_prompt_tokens = t->cached_prompt_tokens;
            ts->queued = t->queued;
            ts->running = t->running;
            ts->blocks_held = 0;
            for (int h = 0; h < KVD_MAX_HOSTS; h++)
                if (k->hosts[h].used)
                    ts->blocks_held += prefix_owned(k->hosts[h].px, (uint16_t)(i + 1));
            ts->refused = t->refused;
            ts->cache_creation_tokens = t->cache_creation_tokens;
            pins_count(k, t->name, &ts->pins, &ts->pinned_blocks);
            tptrs[s.n_tenants++] = ts;
        }
        s.tenants = tptrs;
    }
    s.disk_cache_declined = k->st.disk_declined;
    if (k->disk != NULL) {
        struct disk_tier_stats ds;
        disk_tier_stats(k->disk, &ds);
        s.disk_cache_max_bytes = ds.max_bytes;
        s.disk_cache_bytes = ds.bytes;
        s.disk_cache_blocks = ds.files;
        s.disk_cache_written = ds.written;
        s.disk_cache_pending = ds.pending;
        s.disk_cache_dropped_writes = ds.dropped_writes;
        s.disk_cache_corrupt = ds.corrupt;
        s.disk_cache_ignored = ds.ignored;
    }
    for (const struct request *r = k->active; r; r = r->next)
        for (uint32_t p = 1; p < r->ps.n_parts; p++)
            if (parts->window[p] != 0)
                s.blocks_in_use_windowed += r->ps.n_blocks - r->ps.first[p];
    char kv_type[64];
    kv_describe(&k->o.kv, kv_type, sizeof(kv_type));
    s.kv_type = kv_type;
    Kvd__Histogram h[4] = { KVD__HISTOGRAM__INIT, KVD__HISTOGRAM__INIT, KVD__HISTOGRAM__INIT,
                            KVD__HISTOGRAM__INIT };
    struct kvd_hist *src[4] = { &k->st.ttft, &k->st.e2e, &k->st.queue, &k->st.itl };
    for (int i = 0; i < 4; i++) {
        h[i].bounds = (double *)hist_bounds;
        h[i].n_bounds = KVD_HIST_N;
        h[i].counts = src[i]->counts;
        h[i].n_counts = KVD_HIST_N + 1;
        h[i].has_sum = true;
        h[i].sum = src[i]->sum;
    }
    s.ttft_seconds = &h[0];
    s.e2e_seconds = &h[1];
    s.queue_seconds = &h[2];
    s.itl_seconds = &h[3];
    s.finished_stop = k->st.finished_stop;
    s.finished_length = k->st.finished_length;
    s.finished_abort = k->st.finished_abort;
    size_t n = 0;
    for (int i = 0; i < KVD_MAX_WORKERS; i++) {
        const struct worker *w = &k->workers[i];
        if (!w->used)
            continue;
        Kvd__WorkerStats x = KVD__WORKER_STATS__INIT;
        KVD_WORKER_STATS_FIELDS(HAS_X)
        x.id = w->id;
        x.pid = w->pid;
        x.alive = w->alive;
        x.running = w->running;
        x.tokens = w->tokens;
        x.restarts = w->restarts;
        x.host = k->hosts[w->host].name;
        ws[n] = x;
        wp[n] = &ws[n];
        n++;
    }
    s.workers = wp;
    s.n_workers = n;
    Kvd__HostStats hrow[KVD_MAX_HOSTS], *hptr[KVD_MAX_HOSTS];
    s.hosts_lost = k->hosts_lost;
    s.blocks_fenced_total = k->st.blocks_fenced;
    s.cache_creation_tokens = k->st.cache_creation_tokens;
    pins_count(k, tenant, &s.pins, &s.pinned_blocks);
    pins_counters(k, &s.pins_expired, &s.pins_refused);
    for (int hi = 0; hi < KVD_MAX_HOSTS && tenant == NULL; hi++) {
        const struct kvd_host *ho = &k->hosts[hi];
        if (!ho->used)
            continue;
        Kvd__HostStats *x = &hrow[s.n_hosts];
        kvd__host_stats__init(x);
        KVD_HOST_STATS_FIELDS(HAS_XP)
        x->name = (char *)ho->name;
        x->workers = hosts_workers(k, hi);
        x->blocks_total = hs[hi].n_blocks;
        x->blocks_free = hs[hi].n_free;
        x->blocks_cached = hs[hi].n_cached;
        x->blocks_in_use = hs[hi].n_used;
        x->requests = ho->requests;
        x->prompt_tokens = ho->prompt_tokens;
        x->cached_prompt_tokens = ho->cached_prompt_tokens;
        x->blocks_fenced = hosts_fenced_blocks(ho);
        hptr[s.n_hosts++] = x;
    }
    s.hosts = hptr;
    s.kv_event_batches = k->events ? kv_events_batches(k->events) : 0;
    struct hash_list hl = { 0 };
    if (block_hashes) {
        hl.cap = ps.n_cached + ps.n_used;     /* findable blocks are committed */
        hl.v = malloc((hl.cap ? hl.cap : 1) * sizeof(uint64_t));
        if (hl.v != NULL)
            prefix_for_each_findable(k->px, add_hash, &hl);
        s.block_hashes = hl.v;
        s.n_block_hashes = hl.n;
    }
    /* the picture: a tenant's client sees its own; the ipc:// socket's may
     * ask for any tenant's view, an anonymous one, or all of it */
    struct kvd_view view;
    const bool want_view = sr->has_pool_view && sr->pool_view;
    if (want_view) {
        const char *as = tenant != NULL ? tenant : sr->view_tenant;
        if (view_build(k, as, tenant == NULL && sr->view_tenant == NULL, &view) == 0)
            s.pool_view = &view.pv;
    }
    m.body_case = KVD__SERVER_REPLY__BODY_STATS;
    m.stats = &s;
    req_reply(k, rid, rid_len, id, &m);
    if (want_view)
        view_free(&view);
    free(hl.v);
    free(trows);
    free(tptrs);
}
