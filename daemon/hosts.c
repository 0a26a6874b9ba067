/*
 * hosts.c - the pools of other hosts (kvd.h: struct kvd_host).
 *
 * A worker started on another machine with `kvd-worker --host NAME --pool P
 * --connect tcp://...` computes into pool P of its own host (pool_join: the
 * first worker there creates it, the others map it). Its Ready names the host,
 * the pool's instance and its block count. kvd keeps that pool's metadata and
 * index as it does its own: an anonymous POOL_KV_REMOTE pool of as many
 * blocks, under the same hash secret, with a prefix cache of its own. So kvd
 * alone allocates every host's blocks, and a worker reads and writes only the
 * blocks kvd names, exactly as on kvd's host.
 *
 * One record per pool instance: workers that name the same host and instance
 * share it; a new instance (the host's pool was made again) is a new record.
 * When the last worker of a record is lost, the record goes, with its index:
 * its requests have resumed elsewhere, and nothing says the data is still
 * there. Tiers and block events stay with kvd's own pool.
 *
 * Fencing. kvd cannot kill a process on another host, and a worker kvd
 * declared lost (a partition, a stall) may still be computing into the
 * blocks of its sequences. So kvd pings the workers of other hosts at least
 * every second and four times per fence time; a worker that hears nothing
 * for its --fence-ms (its steps kept under a quarter of that) drops its sequences and says Ready
 * with a new epoch, and drops whatever kvd sent for an earlier one; and the
 * blocks of a lost worker's sequences stay taken for twice its fence time,
 * after which it has surely stopped writing them. A worker that says Ready
 * again while kvd still counts it alive is lost, then taken back. Its sequences resume elsewhere at once. A dropped
 * record's pool is refused for as long, so that it cannot come back empty
 * while a worker cut off from kvd still writes into it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd.h"
#include "hosts.h"
#include "requests.h"
#include "workers.h"

#define DEFAULT_FENCE_MS 10000u
#define MIN_FENCE_MS 1000u      /* kvd-worker's own lower bound */
#define PING_MS_MAX 1000.0

uint64_t hosts_seq_tokens(const struct pool_layout *lay, uint32_t n_blocks)
{
    uint64_t n = (uint64_t)n_blocks * lay->block_tokens;
    while (n > 0 && kv_parts_blocks_held(&lay->parts, n, lay->block_tokens) > n_blocks)
        n -= lay->block_tokens;
    return n;
}

void hosts_init(struct kvd *k)
{
    struct kvd_host *h = &k->hosts[0];
    memset(h, 0, sizeof(*h));
    h->used = true;
    h->pool = k->pool;
    h->px = k->px;
    h->seq_tokens = k->pool_seq_tokens;
}

/* The longest sequence any pool holds. */
static void update_seq_tokens(struct kvd *k)
{
    k->pool_seq_tokens = 0;
    for (int i = 0; i < KVD_MAX_HOSTS; i++)
        if (k->hosts[i].used && k->hosts[i].seq_tokens > k->pool_seq_tokens)
            k->pool_seq_tokens = k->hosts[i].seq_tokens;
}

uint32_t hosts_workers(const struct kvd *k, int h)
{
    uint32_t n = 0;
    for (int i = 0; i < KVD_MAX_WORKERS; i++)
        n += k->workers[i].used && k->workers[i].alive && k->workers[i].host == h;
    return n;
}

uint32_t hosts_fenced_blocks(const struct kvd_host *h)
{
    uint32_t n = 0;
    for (const struct kvd_fenced *f = h->fenced; f; f = f->next)
        n += f->ps.n_blocks * (f->ps.n_parts ? f->ps.n_parts : 1);
    return n;
}

int hosts_join(struct kvd *k, const Kvdw__Ready *r)
{
    int free_slot = -1;
    const double now = cli_now_ms();
    /* what a worker says decides what kvd allocates and how long it holds
     * blocks: within the operator's bounds */
    if (r->has_fence_ms && (r->fence_ms < MIN_FENCE_MS || r->fence_ms > k->o.max_fence_ms)) {
        kvd_log(k, "host %s: refused: its --fence-ms %u is outside %u..%u (--max-fence-ms)", r->host, r->fence_ms,
                MIN_FENCE_MS, k->o.max_fence_ms);
        return -1;
    }
    if (r->pool_blocks > k->o.host_max_blocks) {
        kvd_log(k, "host %s: refused: its pool of %u blocks is over --host-max-blocks %u", r->host, r->pool_blocks,
                k->o.host_max_blocks);
        return -1;
    }
    for (int i = 1; i < KVD_MAX_HOSTS; i++) {
        struct kvd_host *h = &k->hosts[i];
        if (!h->used && now < h->tomb_until && h->instance == r->pool_instance &&
            strcmp(h->name, r->host) == 0) {
            kvd_log(k, "host %s: refused for %.0f ms more: its pool was dropped, and a worker of "
                    "it may still be fencing itself", r->host, h->tomb_until - now);
            return -1;
        }
        if (!h->used) {
            if (free_slot < 0 && now >= h->tomb_until)
                free_slot = i;
            continue;
        }
        if (h->instance == r->pool_instance && strcmp(h->name, r->host) == 0) {
            if (pool_header(h->pool)->n_blocks != r->pool_blocks) {
                kvd_log(k, "host %s: a worker's pool has %u blocks where its others' has %u",
                        r->host, r->pool_blocks, pool_header(h->pool)->n_blocks);
                return -1;
            }
            if (r->has_fence_ms && r->fence_ms > h->fence_ms)
                h->fence_ms = r->fence_ms;
            return i;
        }
    }
    if (free_slot < 0) {
        kvd_log(k, "host %s: refused: %d hosts already", r->host, KVD_MAX_HOSTS - 1);
        return -1;
    }
    /* the metadata of its pool, keyed as kvd's own: a namespace and a block
     * mean the same on every host */
    const struct pool_header *own = pool_header(k->pool);
    struct pool_params pp = pool_default_params();
    pp.name = NULL;
    pp.kv_where = POOL_KV_REMOTE;
    pp.n_blocks = r->pool_blocks;
    pp.secret = own->secret;
    char err[512], note[256];
    struct kvd_host *h = &k->hosts[free_slot];
    memset(h, 0, sizeof(*h));
    h->pool = pool_create(&own->layout, &pp, note, sizeof(note), err, sizeof(err));
    if (h->pool == NULL) {
        kvd_log(k, "host %s: refused: %s", r->host, err);
        return -1;
    }
    h->px = prefix_new(h->pool, note, sizeof(note), err, sizeof(err));
    if (h->px == NULL) {
        kvd_log(k, "host %s: refused: %s", r->host, err);
        pool_close(&h->pool);
        return -1;
    }
    if (k->o.tenant_max_blocks > 0) {
        uint32_t lim = k->o.tenant_max_blocks_pct
                           ? (uint32_t)((uint64_t)r->pool_blocks * k->o.tenant_max_blocks / 100)
                           : k->o.tenant_max_blocks;
        prefix_set_owner_limit(h->px, lim ? lim : 1);
    }
    h->used = true;
    h->seq_tokens = hosts_seq_tokens(&own->layout, r->pool_blocks);
    update_seq_tokens(k);
    snprintf(h->name, sizeof(h->name), "%s", r->host);
    h->instance = r->pool_instance;
    h->fence_ms = r->has_fence_ms && r->fence_ms ? r->fence_ms : DEFAULT_FENCE_MS;
    kvd_log(k, "host %s: pool of %u blocks (instance %016llx)", h->name, r->pool_blocks,
            (unsigned long long)h->instance);
    return free_slot;
}

void hosts_fence(struct kvd *k, int hi, struct prefix_seq *ps)
{
    struct kvd_host *h = &k->hosts[hi];
    if (ps->n_blocks == 0)
        return;
    struct kvd_fenced *f = calloc(1, sizeof(*f));
    if (f == NULL) {
        /* out of memory: hold nothing back rather than leak the blocks */
        prefix_seq_release(h->px, ps);
        return;
    }
    prefix_seq_hide_pending(h->px, ps);    /* no one waits for what it was computing */
    f->ps = *ps;
    k->st.blocks_fenced += (uint64_t)ps->n_blocks * (ps->n_parts ? ps->n_parts : 1);
    f->until = cli_now_ms() + 2.0 * h->fence_ms;
    f->next = h->fenced;
    h->fenced = f;
    /* ps keeps its settings and nothing else: the tables went with f */
    struct prefix_seq keep = { 0 };
    keep.ns = ps->ns;
    keep.owner = ps->owner;
    keep.n_public = ps->n_public;
    keep.public_ns = ps->public_ns;
    keep.chain_open = true;
    *ps = keep;
}

static void release_fenced(struct kvd_host *h, bool all)
{
    const double now = cli_now_ms();
    struct kvd_fenced **pf = &h->fenced;
    while (*pf) {
        struct kvd_fenced *f = *pf;
        if (all || now >= f->until) {
            *pf = f->next;
            prefix_seq_release(h->px, &f->ps);
            prefix_seq_fini(&f->ps);
            free(f);
        } else {
            pf = &f->next;
        }
    }
}

static void drop(struct kvd *k, int hi)
{
    struct kvd_host *h = &k->hosts[hi];
    /* nothing of it is referenced any more: its workers' requests were let go
     * (or fenced), and the queue holds no blocks outside kvd's own pool */
    release_fenced(h, true);
    prefix_destroy(&h->px);
    pool_close(&h->pool);
    h->used = false;
    update_seq_tokens(k);
    /* its workers may be alive and cut off: until they have fenced themselves,
     * the same pool does not come back as a new, empty record */
    h->tomb_until = cli_now_ms() + 2.0 * h->fence_ms;
}

void hosts_check(struct kvd *k, int hi)
{
    if (hi <= 0 || !k->hosts[hi].used || hosts_workers(k, hi) > 0)
        return;
    kvd_log(k, "host %s: no worker left; its pool's index is dropped (%u blocks were fenced)",
            k->hosts[hi].name, hosts_fenced_blocks(&k->hosts[hi]));
    k->hosts_lost++;
    drop(k, hi);
    req_fail_unfit(k);
    for (int i = 0; i < KVD_MAX_WORKERS; i++)
        if (k->workers[i].used && !k->workers[i].alive && k->workers[i].host == hi)
            k->workers[i].host = 0; /* a worker that comes back joins a record anew */
}

void hosts_tick(struct kvd *k)
{
    bool any = false;
    for (int i = 1; i < KVD_MAX_HOSTS; i++)
        if (k->hosts[i].used && k->hosts[i].fenced != NULL) {
            release_fenced(&k->hosts[i], false);
            any = true;
        }
    if (any)
        req_blocks_freed(k);
    const double now = cli_now_ms();
    if (now - k->last_ping < hosts_ping_ms(k))
        return;
    k->last_ping = now;
    Kvdw__ToWorker m = KVDW__TO_WORKER__INIT;
    Kvdw__Ping p = KVDW__PING__INIT;
    m.body_case = KVDW__TO_WORKER__BODY_PING;
    m.ping = &p;
    for (int i = 0; i < KVD_MAX_WORKERS; i++)
        if (k->workers[i].used && k->workers[i].alive && k->workers[i].host > 0)
            workers_send(k, i, &m);
}

double hosts_ping_ms(const struct kvd *k)
{
    double every = k->o.worker_timeout_ms / 4.0;
    if (every > PING_MS_MAX)
        every = PING_MS_MAX;
    for (int i = 1; i < KVD_MAX_HOSTS; i++)
        if (k->hosts[i].used && k->hosts[i].fence_ms / 4.0 < every)
            every = k->hosts[i].fence_ms / 4.0;
    return every;
}

void hosts_fini(struct kvd *k)
{
    for (int i = 1; i < KVD_MAX_HOSTS; i++)
        if (k->hosts[i].used)
            drop(k, i);
    memset(&k->hosts[0], 0, sizeof(k->hosts[0]));
}
