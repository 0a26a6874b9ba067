/*
 * requests.c - kvd's client requests: their records, lists and tenants, the
 * replies to clients, the client messages other than generate, and time.
 *
 * A request goes through the files of this module in order (req_internal.h):
 * admit.c checks a Generate and queues it, dispatch.c starts it on a worker
 * with the longest cached prefix and leases it blocks, output.c turns the
 * worker's reports into streamed text and the final reply, window.c moves a
 * sequence's window at the context, stats.c answers Stats.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvd.h"
#include "pins.h"
#include "req_internal.h"
#include "workers.h"

/* ---- replies ---------------------------------------------------------------------------- */

int req_reply(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, Kvd__ServerReply *m)
{
    m->has_version = true;
    m->version = WIRE_VERSION;
    m->has_request_id = true;
    m->request_id = id;
    if (rid_len < 2)
        return -1;
    return kvd_send(k, rid[0] == RID_CURVE ? k->clients_curve : k->clients, rid + 1, rid_len - 1, &m->base);
}

void req_reply_error_after(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, int code,
                           const char *msg, uint32_t retry_after)
{
    Kvd__ServerReply m = KVD__SERVER_REPLY__INIT;
    Kvd__Error e = KVD__ERROR__INIT;
    e.has_code = true;
    e.code = code;
    e.message = (char *)msg;
    e.has_retry_after_ms = retry_after > 0;
    e.retry_after_ms = retry_after;
    m.body_case = KVD__SERVER_REPLY__BODY_ERROR;
    m.error = &e;
    req_reply(k, rid, rid_len, id, &m);
}

void req_reply_error(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, int code, const char *msg)
{
    if (code == KVD__ERROR_CODE__ERR_BAD_REQUEST)
        k->st.bad_messages++;
    req_reply_error_after(k, rid, rid_len, id, code, msg, 0);
}

void req_list_remove(struct request **head, struct request *r)
{
    for (struct request **p = head; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            r->next = NULL;
            return;
        }
}

void req_list_append(struct request **head, struct request *r)
{
    struct request **p = head;
    while (*p)
        p = &(*p)->next;
    r->next = NULL;
    *p = r;
}

/* ---- request records ---------------------------------------------------------------------- */

struct kvd_tenant *req_tenant_of(struct kvd *k, const struct request *r)
{
    return r->tenant >= 0 ? &k->tenants[r->tenant] : NULL;
}

void req_dequeue(struct kvd *k, struct request *r)
{
    req_list_remove(&k->queue, r);
    k->n_queued--;
    struct kvd_tenant *t = req_tenant_of(k, r);
    if (t != NULL && t->queued > 0)
        t->queued--;
}

struct request *req_find_active(struct kvd *k, uint64_t seq_id)
{
    for (struct request *r = k->active; r; r = r->next)
        if (r->seq_id == seq_id)
            return r;
    return NULL;
}

struct request *req_find_client(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id)
{
    struct request *lists[2] = { k->queue, k->active };
    for (int l = 0; l < 2; l++)
        for (struct request *r = lists[l]; r; r = r->next)
            if (r->client_id == id && r->rid_len == rid_len && memcmp(r->rid, rid, rid_len) == 0)
                return r;
    return NULL;
}

prefix_t *req_px(const struct kvd *k, const struct request *r)
{
    return k->hosts[r->host].px;
}

void req_free(struct request *r)
{
    for (size_t i = 0; i < r->n_stops; i++)
        free(r->stops[i]);
    free(r->stops);
    free(r->tok);
    free(r->wtok);
    free(r->lp);
    free(r->text);
    free(r->bias_ids);
    free(r->bias);
    free(r->plp);
    free(r->json_schema);
    for (size_t i = 0; i < r->n_tools; i++)
        free(r->tools[i]);
    free(r->tools);
    free(r->tool_choice);
    free(r->pin_ns);
    prefix_seq_fini(&r->ps);
    free(r);
}

const int32_t *req_seq_tok(const struct request *r)
{
    return r->wtok != NULL ? r->wtok : r->tok;
}

uint32_t req_seq_n(const struct request *r)
{
    return r->wtok != NULL ? r->n_wtok : r->n_tok;
}

/* ---- tenants ---------------------------------------------------------------------------------- */

bool req_tenant_name(const char *tenant, const char *ns, const char **name, size_t *len)
{
    if (tenant != NULL) {
        *name = tenant;
        *len = strlen(tenant);
    } else if (ns != NULL && strncmp(ns, "tenant:", 7) == 0) {
        *name = ns + 7;
        const char *slash = strchr(*name, '/');
        *len = slash ? (size_t)(slash - *name) : strlen(*name);
    } else {
        return false;
    }
    return *len > 0 && *len <= KVD_TENANT_NAME_MAX;
}

int32_t req_tenant_find(const struct kvd *k, const char *name, size_t n)
{
    for (uint32_t i = 0; i < k->n_tenants; i++)
        if (strlen(k->tenants[i].name) == n && memcmp(k->tenants[i].name, name, n) == 0)
            return (int32_t)i;
    return -1;
}

/* Whether entry i may be given to another tenant: nothing of its tenant is
 * queued, running or held in any pool (its counters go with it). */
static bool tenant_idle(const struct kvd *k, uint32_t i)
{
    const struct kvd_tenant *t = &k->tenants[i];
    if (t->queued > 0 || t->running > 0)
        return false;
    for (int h = 0; h < KVD_MAX_HOSTS; h++)
        if (k->hosts[h].used && prefix_owned(k->hosts[h].px, (uint16_t)(i + 1)) > 0)
            return false;
    for (const struct request *r = k->queue; r; r = r->next)
        if (r->tenant == (int32_t)i)
            return false;
    for (const struct request *r = k->active; r; r = r->next)
        if (r->tenant == (int32_t)i)
            return false;
    return true;
}

int32_t req_tenant_add(struct kvd *k, const char *name, size_t n)
{
    uint32_t at = k->n_tenants;
    if (at >= k->o.max_tenants) {
        for (at = 0; at < k->n_tenants && !tenant_idle(k, at); at++)
            ;
        if (at == k->n_tenants)
            return -1;
    } else if (k->n_tenants == k->tenants_cap) {
        const uint32_t cap = k->tenants_cap ? 2 * k->tenants_cap : 16;
        struct kvd_tenant *t = realloc(k->tenants, cap * sizeof(*t));
        if (t == NULL)
            return -1;
        k->tenants = t;
        k->tenants_cap = cap;
    }
    struct kvd_tenant *t = &k->tenants[at];
    memset(t, 0, sizeof(*t));
    memcpy(t->name, name, n);
    if (at == k->n_tenants)
        k->n_tenants++;
    return (int32_t)at;
}

int32_t req_tenant_entry(struct kvd *k, const char *name, size_t n)
{
    if (n == 0 || n > KVD_TENANT_NAME_MAX)
        return -1;
    const int32_t i = req_tenant_find(k, name, n);
    return i >= 0 ? i : req_tenant_add(k, name, n);
}

uint32_t req_public_blocks(const struct kvd *k, const int32_t *tok, uint32_t n)
{
    const uint32_t bt = k->o.block_tokens;
    uint32_t b = 0;
    while (k->n_public_tok > 0 && (b + 1) * bt <= k->n_public_tok && (b + 1) * bt < n &&
           memcmp(tok + b * bt, k->public_tok + b * bt, bt * sizeof(int32_t)) == 0)
        b++;
    return b;
}

/* ---- client messages -------------------------------------------------------------------------- */

/* Appends the UTF-8 in s[0..n) to out, each byte that starts no valid
 * character (utf8_seq; a cut-short one included) as U+FFFD. */
static void append_utf8(char *out, size_t *len, const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        size_t want = 0;
        const bool ok = kvd_utf8_seq((const unsigned char *)s + i, n - i, &want) == 1;
        if (ok) {
            memcpy(out + *len, s + i, want);
            *len += want;
            i += want;
        } else {
            memcpy(out + *len, "\xef\xbf\xbd", 3);
            *len += 3;
            i++;
        }
    }
}

/* Tokenize (text or chat, as a generate request's prompt would be) or
 * detokenize (ids). */
static void on_tokenize(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id,
                        const Kvd__TokenizeRequest *t)
{
    Kvd__ServerReply m = KVD__SERVER_REPLY__INIT;
    Kvd__Tokens out = KVD__TOKENS__INIT;
    out.has_max_context = true;
    out.max_context = k->n_ctx;
    struct request tmp;
    memset(&tmp, 0, sizeof(tmp));
    char msg[256] = "";
    char *text = NULL;
    if (t->n_token_ids > 0) {
        for (size_t i = 0; i < t->n_token_ids && !msg[0]; i++)
            if ((uint32_t)t->token_ids[i] >= k->model->cfg.n_vocab)
                snprintf(msg, sizeof(msg), "token id %d is out of range (the vocabulary has %u tokens)",
                         t->token_ids[i], k->model->cfg.n_vocab);
        size_t need = 0;
        char *raw = NULL;
        if (!msg[0] && tok_decode(k->tok, t->token_ids, t->n_token_ids, NULL, 0, &need) == KVD_ERANGE) {
            raw = malloc(need + 1);
            text = malloc(need * 3 + 1);
            size_t rl = 0, tl = 0;
            if (raw == NULL || text == NULL ||
                tok_decode(k->tok, t->token_ids, t->n_token_ids, raw, need + 1, &rl) != 0) {
                snprintf(msg, sizeof(msg), "cannot detokenize (out of memory)");
            } else {
                append_utf8(text, &tl, raw, rl);
                text[tl] = '\0';
                out.text = text;
            }
        } else if (!msg[0]) {
            out.text = "";
        }
        free(raw);
    } else {
        Kvd__GenerateRequest g = KVD__GENERATE_REQUEST__INIT;
        g.prompt = t->text;
        g.messages = t->messages;
        g.n_messages = t->n_messages;
        const int code = req_build_prompt(k, &tmp, &g, msg, sizeof(msg));
        if (code != 0 && !msg[0])
            snprintf(msg, sizeof(msg), "cannot tokenize: error %d", code);
        if (code == 0) {
            out.token_ids = tmp.tok;
            out.n_token_ids = tmp.n_tok;
        }
    }
    if (msg[0]) {
        k->st.bad_messages++;
        req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_BAD_REQUEST, msg, 0);
    } else {
        m.body_case = KVD__SERVER_REPLY__BODY_TOKENS;
        m.tokens = &out;
        req_reply(k, rid, rid_len, id, &m);
    }
    free(tmp.tok);
    free(text);
}

static void on_health(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id)
{
    Kvd__ServerReply m = KVD__SERVER_REPLY__INIT;
    Kvd__Health h = KVD__HEALTH__INIT;
    h.has_ok = h.has_workers_alive = true;
    h.workers_alive = (uint32_t)workers_alive(k);
    h.ok = h.workers_alive > 0 && !k->draining;
    h.model = (char *)k->o.model;
    m.body_case = KVD__SERVER_REPLY__BODY_HEALTH;
    m.health = &h;
    req_reply(k, rid, rid_len, id, &m);
}

void req_on_client(struct kvd *k, const uint8_t *rid, size_t rid_len, const char *tenant, const void *buf,
                   size_t len)
{
    char err[256];
    int code;
    wire_arena_reset(k->arena);
    Kvd__ClientRequest *m = wire_client_request_unpack(k->arena, buf, len, &code, err, sizeof(err));
    if (m == NULL) {
        k->st.bad_messages++;
        req_reply_error_after(k, rid, rid_len, wire_client_request_id(buf, len),
                    code == KVD_ETOOLONG ? KVD__ERROR_CODE__ERR_TOO_LONG
                                         : KVD__ERROR_CODE__ERR_BAD_REQUEST, err, 0);
        return;
    }
    uint64_t id = m->request_id;
    switch (m->body_case) {
    case KVD__CLIENT_REQUEST__BODY_GENERATE:
        req_on_generate(k, rid, rid_len, tenant, id, m->generate);
        break;
    case KVD__CLIENT_REQUEST__BODY_CANCEL: {
        struct request *r = req_find_client(k, rid, rid_len, m->cancel->target);
        if (r == NULL) {
            req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_NOT_FOUND,
                        "no such request of this client", 0);
            break;
        }
        Kvd__ServerReply a = KVD__SERVER_REPLY__INIT;
        Kvd__Accepted acc = KVD__ACCEPTED__INIT;
        a.body_case = KVD__SERVER_REPLY__BODY_ACCEPTED;
        a.accepted = &acc;
        req_reply(k, rid, rid_len, id, &a);
        req_stop(k, r, KVD__FINISH_REASON__FINISH_CANCELLED, 0, NULL);
        req_dispatch(k);
        break;
    }
    case KVD__CLIENT_REQUEST__BODY_STATS:
        /* the index's hashes are the operator's to see, not a tenant's */
        req_on_stats(k, rid, rid_len, tenant, id, tenant == NULL && m->stats->has_block_hashes && m->stats->block_hashes,
                 m->stats);
        break;
    case KVD__CLIENT_REQUEST__BODY_HEALTH:
        on_health(k, rid, rid_len, id);
        break;
    case KVD__CLIENT_REQUEST__BODY_TOKENIZE:
        on_tokenize(k, rid, rid_len, id, m->tokenize);
        break;
    case KVD__CLIENT_REQUEST__BODY_CACHE:
        pins_on_request(k, rid, rid_len, tenant, id, m->cache);
        break;
    default:
        k->st.bad_messages++;
        req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_BAD_REQUEST, "empty request", 0);
        break;
    }
}

/* ---- time, and the daemon's own events ------------------------------------------------------- */

void req_tick(struct kvd *k)
{
    pins_tick(k);
    double now = cli_now_ms();
    struct request *lists[2] = { k->queue, k->active };
    for (int l = 0; l < 2; l++) {
        struct request *r = lists[l];
        while (r) {
            struct request *next = r->next;
            bool gone = r->rid_len == 0 && r->state != REQ_STOPPING;
            if (gone) {
                req_stop(k, r, KVD__FINISH_REASON__FINISH_CANCELLED, 0, NULL);
            } else if (r->deadline > 0 && now > r->deadline && r->state != REQ_STOPPING) {
                if (r->n_tok == r->n_prompt)
                    req_stop(k, r, KVD__FINISH_REASON__FINISH_DEADLINE,
                                 KVD__ERROR_CODE__ERR_DEADLINE,
                                 "the deadline passed before any output");
                else
                    req_stop(k, r, KVD__FINISH_REASON__FINISH_DEADLINE, 0, NULL);
            }
            r = next;
        }
    }
    if (k->n_queued > 0 && workers_alive(k) == 0 && !workers_can_come_back(k))
        req_fail_queued(k, KVD__ERROR_CODE__ERR_UNAVAILABLE, "no worker is left to run it");
    req_dispatch(k);
}

void req_cancel_all(struct kvd *k, const char *why)
{
    struct request *lists[2] = { k->queue, k->active };
    for (int l = 0; l < 2; l++) {
        struct request *r = lists[l];
        while (r) {
            struct request *next = r->next;
            if (r->state != REQ_STOPPING)
                req_stop(k, r, KVD__FINISH_REASON__FINISH_CANCELLED,
                             KVD__ERROR_CODE__ERR_SHUTTING_DOWN, why);
            r = next;
        }
    }
}

void req_fail_queued(struct kvd *k, int code, const char *why)
{
    struct request *r = k->queue;
    while (r) {
        struct request *next = r->next;
        req_stop(k, r, 0, code, why);
        r = next;
    }
}

void req_blocks_freed(struct kvd *k)
{
    req_retry_leases(k);
    req_dispatch(k);
}

void req_fail_unfit(struct kvd *k)
{
    struct request *r = k->queue;
    while (r) {
        struct request *next = r->next;
        if (r->state == REQ_QUEUED && r->ps.n_blocks == 0 && req_seq_n(r) + 1ull > k->pool_seq_tokens)
            req_stop(k, r, 0, KVD__ERROR_CODE__ERR_TOO_LONG,
                         "no pool left can hold this sequence (a host was lost)");
        r = next;
    }
}

void req_release_all(struct kvd *k)
{
    if (k->restorer != NULL)
        restorer_collect(k->restorer, true, req_restore_done, k);   /* no copy may outlive its blocks */
    while (k->active)
        req_let_go(k, k->active, KVDW__DONE_REASON__DONE_CANCELLED, NULL);
    req_fail_queued(k, KVD__ERROR_CODE__ERR_SHUTTING_DOWN, "kvd is shutting down");
}
