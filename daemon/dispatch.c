/*
 * dispatch.c - queued requests onto workers, and their blocks.
 *
 * Dispatch takes queued requests in order: the longest committed cached
 * prefix is referenced (or, when the block after it is still being computed
 * by another request, the request waits for that commit instead of computing
 * it twice; when it goes on in the tiers below the pool, the request waits
 * for the copies back), blocks for the rest are allocated, and the request is
 * assigned to the least loaded worker of the host that caches most of it
 * (unless that host is much busier than another). A
 * running sequence's worker asks for blocks as it goes (leases); when the
 * pool is full the youngest running sequence is preempted, requeued and later
 * recomputed from its cached prefix.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvd.h"
#include "pins.h"
#include "req_internal.h"
#include "tiers.h"
#include "workers.h"

static bool suspect(const struct request *r)
{
    return r->workers_lost >= SUSPECT_AFTER;
}

static bool can_take(const struct worker *w, const struct request *r)
{
    if (!w->used || !w->alive || w->unreachable || w->draining || w->running >= w->max_batch || w->isolating)
        return false;
    return !(suspect(r) && w->running > 0);
}

/* The least loaded worker of host h that can take r, or -1. */
static int pick_worker(struct kvd *k, const struct request *r, int h)
{
    int best = -1;
    for (int i = 0; i < KVD_MAX_WORKERS; i++) {
        const struct worker *w = &k->workers[i];
        if (w->host != h || !can_take(w, r))
            continue;
        if (best < 0 || w->running < k->workers[best].running)
            best = i;
    }
    return best;
}

/* Where r runs: a worker (or -1), its host in r->host. r's blocks, once it
 * holds some (a prefix back from the tiers), tie it to their pool. Else the
 * host whose pool holds the longest cached prefix of r, among those with a
 * worker free, then the least loaded worker there (--dispatch round-robin:
 * the next free worker, wherever), unless that worker is far busier than
 * another's. A pool too small for r is passed over. */
static int pick(struct kvd *k, struct request *r)
{
    if (r->ps.n_blocks > 0)
        return pick_worker(k, r, r->host);
    if (k->o.dispatch_rr) {
        for (int n = 0; n < KVD_MAX_WORKERS; n++) {
            const int i = (int)((k->rr_next + (uint32_t)n) % KVD_MAX_WORKERS);
            const struct worker *w = &k->workers[i];
            if (!can_take(w, r) || k->hosts[w->host].seq_tokens < req_seq_n(r) + 1ull)
                continue;
            k->rr_next = (uint32_t)i + 1;
            r->host = w->host;
            return i;
        }
        return -1;
    }
    int best = -1, n_cand = 0;
    uint32_t best_hit = 0;
    int cand[KVD_MAX_HOSTS];
    for (int h = 0; h < KVD_MAX_HOSTS; h++) {
        cand[h] = -1;
        if (!k->hosts[h].used || k->hosts[h].seq_tokens < req_seq_n(r) + 1ull)
            continue;
        if ((cand[h] = pick_worker(k, r, h)) >= 0)
            n_cand++;
    }
    for (int h = 0; h < KVD_MAX_HOSTS; h++) {
        if (cand[h] < 0)
            continue;
        /* one candidate: no need to look */
        const uint32_t hit = n_cand > 1 && !r->no_cache
                                 ? prefix_seq_probe(k->hosts[h].px, &r->ps, r->ns, req_seq_tok(r), req_seq_n(r))
                                 : 0;
        const struct worker *w = &k->workers[cand[h]], *b = best >= 0 ? &k->workers[cand[best]] : NULL;
        if (b == NULL || hit > best_hit ||
            (hit == best_hit && (uint64_t)w->running * b->max_batch < (uint64_t)b->running * w->max_batch)) {
            best = h;
            best_hit = hit;
        }
    }
    if (best < 0)
        return -1;
    /* a cached prefix is worth a queue, not any queue: past an imbalance of
     * twice the least loaded candidate's sequences and 4 more, load wins */
    int idle = best;
    for (int h = 0; h < KVD_MAX_HOSTS; h++)
        if (cand[h] >= 0 && k->workers[cand[h]].running < k->workers[cand[idle]].running)
            idle = h;
    if (k->workers[cand[best]].running > 2 * k->workers[cand[idle]].running + 4)
        best = idle;
    r->host = best;
    return cand[best];
}

/* Requests running on host h now. */
static uint32_t host_active(const struct kvd *k, int h)
{
    uint32_t n = 0;
    for (const struct request *q = k->active; q; q = q->next)
        n += q->host == h;
    return n;
}

/* Positions to hold blocks for: the history, the next token, and a block of
 * room so that decoding rarely has to ask. */
static uint64_t want_positions(const struct kvd *k, uint64_t n)
{
    uint64_t want = n + k->o.block_tokens;
    return want > k->n_ctx ? (n > k->n_ctx ? n : k->n_ctx) : want;
}

/* What r may hold blocks for when it asks for n positions with `from`
 * written. In a pool of parts a long prompt takes its blocks a few steps
 * ahead at a time: the windowed parts release what the prefill leaves
 * behind, so a prompt of any length holds about its window there, not a
 * block per part per position (the worker asks again ahead of need). */
static uint64_t lease_cap(const struct kvd *k, const struct request *r, uint64_t from, uint64_t n)
{
    if (r->ps.n_parts <= 1)
        return n;
    uint64_t ahead = from + 2ull * k->o.step_tokens + k->o.block_tokens;
    const uint64_t held = (uint64_t)r->ps.n_blocks * k->o.block_tokens;
    if (ahead < held + k->o.block_tokens)
        ahead = held + k->o.block_tokens;   /* an asking worker always gets a block more */
    return n < ahead ? n : ahead;
}

uint32_t *req_wire_blocks(struct prefix_seq *ps, uint32_t from, size_t *n, uint32_t **copy)
{
    *copy = NULL;
    if (ps->n_parts == 1) {
        *n = ps->n_blocks - from;
        return ps->blocks + from;
    }
    if ((*copy = malloc(((size_t)ps->n_blocks - from) * ps->n_parts * sizeof(**copy) + 1)) == NULL)
        return NULL;
    *n = prefix_seq_flat(ps, from, *copy);
    return *copy;
}

void req_note_prefill_rate(struct kvd *k, const struct request *r)
{
    const uint32_t computed = r->n_prompt > r->n_cached ? r->n_prompt - r->n_cached : 0;
    if (computed < 64 || r->t_dispatch <= 0 || r->t_first <= r->t_dispatch)
        return;
    kvd_ewma(&k->prefill_ns_token, (r->t_first - r->t_dispatch) * 1e6 / computed);
}

void req_wake_waiters(struct kvd *k)
{
    for (struct request *r = k->queue; r; r = r->next)
        if (r->state == REQ_WAITING)
            r->state = REQ_QUEUED;
}

/* r's blocks are all back from the tiers (or some failed): they become
 * findable, and r goes back to the queue, holding its prefix when it is whole
 * and nothing pending was met after it, else to begin again. */
static void restore_finish(struct kvd *k, struct request *r)
{
    const bool whole = prefix_seq_restored(req_px(k, r), &r->ps, r->tok, r->restore_bad);
    r->state = REQ_QUEUED;
    if (!whole || r->restore_wait || r->finish || r->failed) {
        prefix_seq_release(req_px(k, r), &r->ps);
        r->rest_host = r->rest_disk = 0;    /* what comes back next is found in the pool */
    }
    r->restore_bad = UINT32_MAX;
    r->restore_wait = false;
    req_wake_waiters(k);
    if (r->finish || r->failed) {
        /* stopped while its copies ran */
        if (k->o.verbose)
            kvd_log(k, "request %llu: stopped while its prefix came back from the tiers",
                    (unsigned long long)r->seq_id);
        req_dequeue(k, r);
        req_finish(k, r);
    }
}

void req_restore_done(void *user, const struct restore_done *d)
{
    struct kvd *k = user;
    struct request *r = d->owner;
    if (d->from == RESTORE_HOST) {
        kvd_ewma(&k->restore_ns_block, d->ns);
        r->rest_host += d->part == 0;   /* tokens are counted once, by part 0's blocks */
    } else if (d->from == RESTORE_DISK) {
        kvd_ewma(&k->disk_ns_block, d->ns);
        r->rest_disk += d->part == 0;
    } else if (d->logical < r->restore_bad) {
        r->restore_bad = d->logical;
    }
    if (--r->restoring == 0)
        restore_finish(k, r);
}

void req_on_restored(struct kvd *k)
{
    if (k->restorer != NULL && restorer_collect(k->restorer, false, req_restore_done, k) > 0)
        req_dispatch(k);
}

int req_start(struct kvd *k, struct request *r)
{
    int w = pick(k, r);
    if (w < 0)
        return 0;
    prefix_t *px = req_px(k, r);
    uint32_t wait = POOL_NONE;
    int64_t cached;
    uint32_t got_host = 0, got_disk = 0;   /* blocks the tiers gave back on kvd's loop */
    if (r->ps.n_blocks > 0) {
        cached = (int64_t)r->ps.n_cached * k->o.block_tokens;   /* back from the tiers */
    } else if (r->no_cache) {
        cached = prefix_seq_begin(px, &r->ps, r->ns, req_seq_tok(r), 0, NULL);
        r->ps.chain_open = false; /* nothing it computes is indexed either */
    } else {
        /* a scored prompt takes from the cache only positions whose tokens it
         * has scores past: token i's score needs position i - 1 computed */
        const uint64_t n_look = r->plp != NULL && r->n_scored + 1ull < req_seq_n(r) ? r->n_scored + 1ull : req_seq_n(r);
        cached = tiers_seq_begin(k, px, r, req_seq_tok(r), n_look, n_look == req_seq_n(r) ? &wait : NULL,
                                 &got_host, &got_disk);
        if (cached >= 0 && r->ps.n_restoring > 0) {
            /* copies run on the restore thread: it goes on when they are done */
            r->restore_wait = wait != POOL_NONE;
            r->state = REQ_RESTORING;
            if (r->restoring == 0)
                restore_finish(k, r);   /* none could be queued */
            return 0;
        }
    }
    if (cached < 0)
        return 0;
    if (wait != POOL_NONE && !r->no_cache) {
        /* another request is computing the next block of this prefix: wait for it */
        prefix_seq_release(px, &r->ps);
        r->state = REQ_WAITING;
        return 0;
    }
    int rc = prefix_seq_grow(px, &r->ps,
                             lease_cap(k, r, (uint64_t)cached, want_positions(k, req_seq_n(r) + 1ull)),
                             req_seq_tok(r), r->no_cache ? 0 : req_seq_n(r));
    if (rc == KVD_ENOSPACE)
        rc = prefix_seq_grow(px, &r->ps, lease_cap(k, r, (uint64_t)cached, req_seq_n(r) + 1ull), req_seq_tok(r),
                             r->no_cache ? 0 : req_seq_n(r));
    if (rc != 0) {
        prefix_seq_release(px, &r->ps);
        if (host_active(k, r->host) == 0 && k->hosts[r->host].fenced == NULL) {
            /* nothing will free blocks there: it can never run */
            req_stop(k, r, 0, KVD__ERROR_CODE__ERR_TOO_LONG,
                         "the KV pool cannot hold this sequence");
            return -1;
        }
        return 0;
    }
    Kvdw__ToWorker m = KVDW__TO_WORKER__INIT;
    Kvdw__Assign a = KVDW__ASSIGN__INIT;
    a.has_seq_id = a.has_n_cached = a.has_max_new = a.has_ignore_eos = a.has_n_generated = true;
    a.seq_id = r->seq_id;
    a.tokens = (int32_t *)req_seq_tok(r);
    a.n_tokens = req_seq_n(r);
    a.n_cached = (uint32_t)cached;
    uint32_t *flat = NULL;
    if ((a.blocks = req_wire_blocks(&r->ps, 0, &a.n_blocks, &flat)) == NULL) {
        prefix_seq_release(px, &r->ps);
        return 0;   /* out of memory: try again later */
    }
    a.sampling = &r->sampling;
    uint32_t n_gen = r->n_tok - r->n_prompt;
    a.max_new = r->max_tokens > n_gen ? r->max_tokens - n_gen : 0;
    a.ignore_eos = r->ignore_eos;
    a.n_generated = r->wtok != NULL ? r->n_wtok - r->w_prompt : n_gen;
    a.has_window_sinks = r->window;
    a.window_sinks = k->o.sinks;
    a.has_logprobs = r->logprobs >= 0;
    a.logprobs = r->logprobs >= 0 ? (uint32_t)r->logprobs : 0;
    a.json_schema = r->json_schema;
    a.has_json_object = r->json_object;
    a.json_object = r->json_object;
    a.n_tools = r->tool_choice != NULL ? r->n_tools : 0;
    a.tools = r->tools;
    a.tool_choice = r->tool_choice;
    a.has_parallel_tool_calls = r->parallel_tool_calls;
    a.parallel_tool_calls = r->parallel_tool_calls;
    a.has_prompt_logprobs = r->plp != NULL && r->n_scored + 1 < r->n_prompt;
    a.prompt_logprobs = (uint32_t)(r->prompt_logprobs > 0 ? r->prompt_logprobs : 0);
    m.body_case = KVDW__TO_WORKER__BODY_ASSIGN;
    m.assign = &a;
    req_dequeue(k, r);
    req_list_append(&k->active, r);
    k->n_active++;
    if (req_tenant_of(k, r) != NULL)
        req_tenant_of(k, r)->running++;
    r->state = REQ_RUNNING;
    r->worker = w;
    r->n_written = (uint32_t)cached;
    if (r->t_dispatch == 0) {
        r->t_dispatch = cli_now_ms();
        r->n_cached = (uint32_t)cached;
        r->n_host = (got_host + r->rest_host) * k->o.block_tokens;
        r->n_disk = (got_disk + r->rest_disk) * k->o.block_tokens;
        k->st.cached_prompt_tokens += (uint64_t)cached;
        if (req_tenant_of(k, r) != NULL)
            req_tenant_of(k, r)->cached_prompt_tokens += (uint64_t)cached;
        k->st.host_cached_prompt_tokens += r->n_host;
        k->st.disk_cached_prompt_tokens += r->n_disk;
        pins_note_hits(k, r);
    }
    struct kvd_host *host = &k->hosts[r->host];
    host->requests++;
    host->prompt_tokens += r->n_prompt;
    host->cached_prompt_tokens += (uint64_t)cached;
    struct worker *wk = &k->workers[w];
    if (wk->running++ == 0)
        wk->last_progress = cli_now_ms();
    wk->isolating = suspect(r);
    workers_send(k, w, &m);
    free(flat);
    return 1;
}

void req_dispatch(struct kvd *k)
{
    struct request *r = k->queue;
    while (r) {
        struct request *next = r->next;
        if (r->state == REQ_QUEUED) {
            int rc = req_start(k, r);
            if (rc == 0 && r->state == REQ_QUEUED)
                break; /* no worker or no blocks: keep the order */
        }
        r = next;
    }
}

void req_unstarve(struct kvd *k, struct request *r)
{
    if (r->lease_want == 0)
        return;
    r->lease_want = 0;
    if (r->worker >= 0) {
        struct worker *w = &k->workers[r->worker];
        if (w->starved > 0)
            w->starved--;
        w->last_progress = cli_now_ms(); /* its clock restarts with the blocks */
    }
}

/* r needs blocks the pool does not have: preempts the youngest running
 * request (r itself when it is the youngest), which is requeued and later
 * recomputed from its cached prefix. False when r runs alone: it can never
 * fit, and the caller ends it. */
static bool preempt_for(struct kvd *k, struct request *r)
{
    struct request *young = NULL;
    int running = 0;
    for (struct request *q = k->active; q; q = q->next) {
        if (q->state != REQ_RUNNING || q->preempted || q->host != r->host)
            continue;
        running++;
        if (young == NULL || q->t_arrival > young->t_arrival)
            young = q;
    }
    if (young == NULL || (young == r && running == 1))
        return false;
    young->preempted = true;
    young->state = REQ_STOPPING;
    req_send_cancel(k, young);
    kvd_log(k, "request %llu: preempted to free blocks", (unsigned long long)young->seq_id);
    return true;
}

static void grant(struct kvd *k, struct request *r, uint32_t from)
{
    Kvdw__ToWorker m = KVDW__TO_WORKER__INIT;
    Kvdw__Grant g = KVDW__GRANT__INIT;
    g.has_seq_id = true;
    g.seq_id = r->seq_id;
    uint32_t *flat = NULL;
    if ((g.blocks = req_wire_blocks(&r->ps, from, &g.n_blocks, &flat)) == NULL) {
        /* the worker waits for this grant: end the request rather than hang it */
        req_stop(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory");
        return;
    }
    m.body_case = KVDW__TO_WORKER__BODY_GRANT;
    m.grant = &g;
    workers_send(k, r->worker, &m);
    free(flat);
}

void req_on_lease(struct kvd *k, int w, uint64_t seq_id, uint32_t n_positions, bool ahead)
{
    struct request *r = req_from_worker(k, w, seq_id);
    if (r == NULL || r->state != REQ_RUNNING)
        return;
    if (n_positions > k->n_ctx + 1u) {
        k->st.bad_messages++;
        return;
    }
    uint32_t before = r->ps.n_blocks;
    const int32_t *known = r->no_cache ? NULL : req_seq_tok(r);
    uint64_t n_known = r->no_cache ? 0 : req_seq_n(r);
    n_positions = (uint32_t)lease_cap(k, r, r->n_written, n_positions);
    int rc = prefix_seq_grow(req_px(k, r), &r->ps, lease_cap(k, r, r->n_written, want_positions(k, n_positions)),
                             known, n_known);
    if (rc == KVD_ENOSPACE)
        rc = prefix_seq_grow(req_px(k, r), &r->ps, n_positions, known, n_known);
    if (rc == 0) {
        if (r->ps.n_blocks > before || ahead)
            grant(k, r, before);
        return;
    }
    if (ahead) {
        /* asked before it must: no room is no reason to preempt; the empty
         * Grant lets the worker ask again when it must */
        grant(k, r, r->ps.n_blocks);
        return;
    }
    /* the pool is full: preempt the youngest other sequence; the worker waits
     * for its Grant, which follows once the preempted one's Done frees blocks */
    if (r->lease_want == 0)
        k->workers[w].starved++;
    r->lease_want = n_positions;
    if (k->hosts[r->host].fenced != NULL) {
        /* blocks held for a lost worker come free within its fence time */
    } else if (!preempt_for(k, r)) {
        /* alone and still too big: it ends here, as when the context is full */
        req_unstarve(k, r);
        req_stop(k, r, KVD__FINISH_REASON__FINISH_LENGTH, 0, NULL);
    } else if (r->preempted) {
        req_unstarve(k, r); /* it was the youngest: it waits in the queue, not for blocks */
    }
}

void req_retry_leases(struct kvd *k)
{
    for (struct request *r = k->active; r; r = r->next) {
        if (r->lease_want == 0 || r->state != REQ_RUNNING)
            continue;
        uint32_t before = r->ps.n_blocks;
        int rc = prefix_seq_grow(req_px(k, r), &r->ps, r->lease_want, r->no_cache ? NULL : req_seq_tok(r),
                                 r->no_cache ? 0 : req_seq_n(r));
        if (rc == 0) {
            req_unstarve(k, r);
            if (r->ps.n_blocks > before)
                grant(k, r, before);
        } else if (k->hosts[r->host].fenced != NULL) {
            /* it waits for the fenced blocks (hosts_tick) */
        } else if (!preempt_for(k, r)) {
            req_unstarve(k, r);
            req_stop(k, r, KVD__FINISH_REASON__FINISH_LENGTH, 0, NULL);
        } else if (r->preempted) {
            req_unstarve(k, r);
        }
    }
}
