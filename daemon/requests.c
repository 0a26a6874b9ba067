/*
 * requests.c - kvd's client requests, from arrival to the final reply.
 *
 * A generate request is checked, turned into token ids (chat template,
 * tokenizer, or ids as given), admitted into a bounded queue (OVERLOADED past
 * it) and answered with Accepted. Dispatch takes queued requests in order:
 * the longest committed cached prefix is referenced (or, when the block after
 * it is still being computed by another request, the request waits for that
 * commit instead of computing it twice), blocks for the rest are allocated,
 * and the request is assigned to the least loaded worker. Worker reports
 * commit blocks (which makes them reusable), append tokens (detokenized,
 * checked for stop strings, streamed as whole UTF-8 characters) and finally
 * let go of the sequence (Done), after which its blocks are released and the
 * client gets its Final. A sequence that needs a block when the pool is full
 * preempts the youngest running one, which is requeued and later recomputed
 * from its cached prefix; a dead worker's sequences resume elsewhere from the
 * tokens already streamed, so the client sees one uninterrupted stream.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "err.h"
#include "jschema.h"
#include "toolcall.h"
#include "kvd.h"
#include "pins.h"
#include "kvd_stats_fields.h"

#define RETRY_AFTER_MS 1000u

/* ---- replies ---------------------------------------------------------------------------- */

/* Sends a reply to a client: rid's first byte names the socket it came on
 * (RID_*), the rest is its routing id there. A client that is gone cancels
 * its request. */
static int reply(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, Kvd__ServerReply *m)
{
    m->has_version = true;
    m->version = WIRE_VERSION;
    m->has_request_id = true;
    m->request_id = id;
    if (rid_len < 2)
        return -1;
    return kvd_send(k, rid[0] == RID_CURVE ? k->clients_curve : k->clients, rid + 1, rid_len - 1, &m->base);
}

static void reply_error(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, int code,
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
    reply(k, rid, rid_len, id, &m);
}

int req_reply(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, Kvd__ServerReply *m)
{
    return reply(k, rid, rid_len, id, m);
}

void req_reply_error(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, int code, const char *msg)
{
    if (code == KVD__ERROR_CODE__ERR_BAD_REQUEST)
        k->st.bad_messages++;
    reply_error(k, rid, rid_len, id, code, msg, 0);
}

/* ---- request lists ------------------------------------------------------------------------ */

static void list_remove(struct request **head, struct request *r)
{
    for (struct request **p = head; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            r->next = NULL;
            return;
        }
}

static void list_append(struct request **head, struct request *r)
{
    struct request **p = head;
    while (*p)
        p = &(*p)->next;
    r->next = NULL;
    *p = r;
}

/* ---- tenants ---------------------------------------------------------------------------------- */

/* The tenant of a request: a CURVE client's key name, else the NAME of an
 * ipc:// client's namespace "tenant:NAME/..." (what the HTTP API sends for
 * its keys): into *name (not NUL-terminated) and *len; false when it has none. */
static bool tenant_name(const char *tenant, const char *ns, const char **name, size_t *len)
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

/* The index of tenant name[0..n) in k->tenants, or -1 when it has no entry. */
static int32_t tenant_find(const struct kvd *k, const char *name, size_t n)
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

/* An entry for tenant name[0..n) (a request of it was admitted): a new one,
 * or, once --max-tenants are in the table, the first whose tenant has
 * nothing queued, running or held. -1 when every entry's tenant has (or
 * without memory): the request is refused, never served unaccounted. */
static int32_t tenant_add(struct kvd *k, const char *name, size_t n)
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

bool req_tenant_name(const char *tenant, const char *ns, const char **name, size_t *len)
{
    return tenant_name(tenant, ns, name, len);
}

int32_t req_tenant_entry(struct kvd *k, const char *name, size_t n)
{
    if (n == 0 || n > KVD_TENANT_NAME_MAX)
        return -1;
    const int32_t i = tenant_find(k, name, n);
    return i >= 0 ? i : tenant_add(k, name, n);
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

static struct kvd_tenant *tenant_of(struct kvd *k, const struct request *r)
{
    return r->tenant >= 0 ? &k->tenants[r->tenant] : NULL;
}

/* r leaves the queue (dispatched, finished, or let go from it). */
static void dequeue(struct kvd *k, struct request *r)
{
    list_remove(&k->queue, r);
    k->n_queued--;
    struct kvd_tenant *t = tenant_of(k, r);
    if (t != NULL && t->queued > 0)
        t->queued--;
}

static struct request *find_active(struct kvd *k, uint64_t seq_id)
{
    for (struct request *r = k->active; r; r = r->next)
        if (r->seq_id == seq_id)
            return r;
    return NULL;
}

static struct request *find_client(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id)
{
    struct request *lists[2] = { k->queue, k->active };
    for (int l = 0; l < 2; l++)
        for (struct request *r = lists[l]; r; r = r->next)
            if (r->client_id == id && r->rid_len == rid_len && memcmp(r->rid, rid, rid_len) == 0)
                return r;
    return NULL;
}

/* The prefix cache of the pool that r's blocks are in (kvd.h: struct kvd_host). */
static prefix_t *px_of(const struct kvd *k, const struct request *r)
{
    return k->hosts[r->host].px;
}

static void req_free(struct request *r)
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

/* ---- context windowing ------------------------------------------------------------------------- */

static void stop_request(struct kvd *k, struct request *r, int why, int fail_code, const char *msg);
static uint32_t *wire_blocks(struct prefix_seq *ps, uint32_t from, size_t *n, uint32_t **copy);

/* The tokens r's positions hold: its history, or once windowed the windowed
 * history (the first sinks, then the newer tokens). Everything about blocks
 * and positions (the prefix index, leases, commits, assignments) reads these;
 * r->tok stays the whole record the output comes from. */
static const int32_t *seq_tok(const struct request *r)
{
    return r->wtok != NULL ? r->wtok : r->tok;
}

static uint32_t seq_n(const struct request *r)
{
    return r->wtok != NULL ? r->n_wtok : r->n_tok;
}

/* The worker has made the copies of r's last window (it speaks of the
 * sequence again): what the window kept held goes (prefix_window_done). A
 * request let go releases it with its blocks; a lost host's fence keeps it
 * with them. */
static void window_settled(struct kvd *k, struct request *r)
{
    if (r->ps.n_held > 0)
        prefix_window_done(px_of(k, r), &r->ps);
}

static int wtok_push(struct request *r, int32_t t)
{
    if (r->n_wtok == r->wtok_cap) {
        const uint32_t cap = r->wtok_cap ? r->wtok_cap * 2 : 64;
        int32_t *v = realloc(r->wtok, (size_t)cap * sizeof(int32_t));
        if (v == NULL)
            return KVD_ENOMEM;
        r->wtok = v;
        r->wtok_cap = cap;
    }
    r->wtok[r->n_wtok++] = t;
    return 0;
}

/* Whether r windows at the context (the request's context_overflow, else
 * kvd's --context-overflow), and the cases that cannot. */
static int admit_window(struct kvd *k, struct request *r, const Kvd__GenerateRequest *g, char *msg, size_t len)
{
    const bool asked = g->has_context_overflow && g->context_overflow != KVD__CONTEXT_OVERFLOW__OVERFLOW_DEFAULT;
    r->window = asked ? g->context_overflow == KVD__CONTEXT_OVERFLOW__OVERFLOW_WINDOW : k->o.window;
    if (!r->window)
        return 0;
    const char *why = NULL;
    uint32_t keep, drop;
    if (k->o.gpu >= 0 && pool_header(k->pool)->layout.parts.n_parts > 1)
        why = "is not supported on GPU workers for a model with sliding-window layers";
    else if (!kv_window_plan(k->n_ctx - 1, k->o.sinks, k->o.block_tokens, k->model->cfg.swa_window, &keep, &drop))
        why = k->model->cfg.swa_window ? "needs a context longer than --sinks and the model's sliding window keep"
                                       : "needs a context of more blocks than --sinks keeps";
    else if (g->has_prefill_only && g->prefill_only)
        why = "means nothing with prefill_only";
    if (why == NULL)
        return 0;
    if (!asked) {
        r->window = false;  /* kvd's default does not apply here: the request stops at the context */
        return 0;
    }
    snprintf(msg, len, "context_overflow window %s", why);
    return KVD__ERROR_CODE__ERR_BAD_REQUEST;
}

/* The worker running r's sequence has reached the context: its positions
 * [0, n_written) are written. Keeps the first sinks (whole blocks) and the
 * newer half of the full blocks after them (prefix_seq_window) and tells
 * the worker what moved. A pool too full for the private copies ends the
 * request as a full context would. */
void req_on_window(struct kvd *k, int w, uint64_t seq_id, uint32_t n_written)
{
    struct request *r = find_active(k, seq_id);
    if (r == NULL || r->worker != w || r->state != REQ_RUNNING)
        return;
    const uint32_t bt = k->o.block_tokens;
    uint32_t keep, drop;
    if (!r->window || n_written != r->n_written ||
        !kv_window_plan(n_written, k->o.sinks, bt, k->model->cfg.swa_window, &keep, &drop)) {
        k->st.bad_messages++;
        stop_request(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "the worker asked for a window out of turn");
        return;
    }
    const uint32_t d = drop * bt, kb = keep * bt;
    if (r->wtok == NULL) {
        /* the first window: the positions held the whole history so far */
        for (uint32_t i = 0; i < r->n_tok; i++)
            if (wtok_push(r, r->tok[i]) != 0) {
                stop_request(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory");
                return;
            }
        r->w_prompt = r->n_prompt;
    }
    window_settled(k, r);   /* (the worker spoke since the last one) */
    uint32_t (*copy)[2] = malloc((size_t)r->ps.n_blocks * (r->ps.n_parts ? r->ps.n_parts : 1) * sizeof(*copy));
    const int64_t nc = copy != NULL ? prefix_seq_window(px_of(k, r), &r->ps, keep, drop, copy) : KVD_ENOMEM;
    if (nc < 0) {
        free(copy);
        kvd_log(k, "request %llu: cannot window its context (%s): it ends there",
                (unsigned long long)r->seq_id, kvd_strerror((int)nc));
        stop_request(k, r, KVD__FINISH_REASON__FINISH_LENGTH, 0, NULL);
        return;
    }
    memmove(r->wtok + kb, r->wtok + kb + d, (size_t)(r->n_wtok - kb - d) * sizeof(int32_t));
    r->n_wtok -= d;
    r->w_prompt = r->w_prompt > kb + d ? r->w_prompt - d : (r->w_prompt < kb ? r->w_prompt : kb);
    r->n_written -= d;
    r->windows++;
    Kvdw__ToWorker m = KVDW__TO_WORKER__INIT;
    Kvdw__Window win = KVDW__WINDOW__INIT;
    uint32_t *from = malloc(((size_t)nc + 1) * sizeof(uint32_t)), *to = malloc(((size_t)nc + 1) * sizeof(uint32_t));
    uint32_t *flat = NULL;
    win.has_seq_id = win.has_keep = win.has_drop = true;
    win.seq_id = r->seq_id;
    win.keep = keep;
    win.drop = drop;
    if (from == NULL || to == NULL || (win.blocks = wire_blocks(&r->ps, 0, &win.n_blocks, &flat)) == NULL) {
        free(copy);
        free(from);
        free(to);
        stop_request(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory");
        return;
    }
    for (int64_t i = 0; i < nc; i++) {
        from[i] = copy[i][0];
        to[i] = copy[i][1];
    }
    win.copy_from = from;
    win.copy_to = to;
    win.n_copy_from = win.n_copy_to = (size_t)nc;
    m.body_case = KVDW__TO_WORKER__BODY_WINDOW;
    m.window = &win;
    workers_send(k, r->worker, &m);
    free(flat);
    free(copy);
    free(from);
    free(to);
}

/* ---- structured output's schemas ----------------------------------------------------------------- */

#define SCHEMAS_KEPT 16
static char *schemas_kept[SCHEMAS_KEPT];    /* schemas that compiled, newest first */

static bool schema_seen(const char *text)
{
    for (int i = 0; i < SCHEMAS_KEPT && schemas_kept[i] != NULL; i++)
        if (strcmp(schemas_kept[i], text) == 0)
            return true;
    return false;
}

static void schema_keep(const char *text)
{
    char *copy = strdup(text);
    if (copy == NULL)
        return;
    free(schemas_kept[SCHEMAS_KEPT - 1]);
    memmove(schemas_kept + 1, schemas_kept, (SCHEMAS_KEPT - 1) * sizeof(*schemas_kept));
    schemas_kept[0] = copy;
}

/* Tool calls held to a grammar (tool_choice "required" or a name): compiled
 * here, as a schema is, to refuse what the workers could not follow, and
 * kept with the request for its Assign. 0 or an error code with msg. */
static int admit_tool_calls(struct request *r, const Kvd__GenerateRequest *g, char *msg, size_t msg_len)
{
    const bool parallel = g->has_parallel_tool_calls && g->parallel_tool_calls;
    const char *only = strcmp(g->tool_choice, "required") == 0 ? NULL : g->tool_choice;
    if (g->has_ignore_eos && g->ignore_eos) {
        snprintf(msg, msg_len, "ignore_eos cannot go with tool_choice (the calls end it)");
        return KVD__ERROR_CODE__ERR_BAD_REQUEST;
    }
    /* the key of the last grammars that compiled: the choice and the tools */
    size_t klen = strlen(g->tool_choice) + 4;
    for (size_t i = 0; i < g->n_tools; i++)
        klen += strlen(g->tools[i]) + 1;
    char *key = malloc(klen);
    if (key == NULL)
        return KVD__ERROR_CODE__ERR_INTERNAL;
    size_t at = (size_t)snprintf(key, klen, "\x01%c%s", parallel ? 'p' : '1', g->tool_choice);
    for (size_t i = 0; i < g->n_tools; i++)
        at += (size_t)snprintf(key + at, klen - at, "\x01%s", g->tools[i]);
    if (!schema_seen(key)) {
        char gerr[200] = "";
        grammar_t *gr = toolcall_compile((const char *const *)g->tools, g->n_tools, only, parallel, gerr,
                                         sizeof(gerr));
        if (gr == NULL) {
            free(key);
            snprintf(msg, msg_len, "tools: %s", gerr);
            return KVD__ERROR_CODE__ERR_BAD_REQUEST;
        }
        grammar_destroy(&gr);
        schema_keep(key);
    }
    free(key);
    r->tools = calloc(g->n_tools, sizeof(*r->tools));
    if (r->tools == NULL)
        return KVD__ERROR_CODE__ERR_INTERNAL;
    for (; r->n_tools < g->n_tools; r->n_tools++)
        if ((r->tools[r->n_tools] = strdup(g->tools[r->n_tools])) == NULL)
            return KVD__ERROR_CODE__ERR_INTERNAL;
    if ((r->tool_choice = strdup(g->tool_choice)) == NULL)
        return KVD__ERROR_CODE__ERR_INTERNAL;
    r->parallel_tool_calls = parallel;
    return 0;
}

/* ---- output ---------------------------------------------------------------------------------- */

static int text_validate(struct request *r, bool all);

/* Bytes of text that may be sent: whole UTF-8 characters, and not a tail that
 * could still grow into a stop string. */
static size_t safe_len(const struct request *r)
{
    size_t n = r->text_len;
    /* an incomplete UTF-8 sequence at the end waits for its remaining bytes */
    for (size_t back = 1; back <= 4 && back <= n; back++) {
        unsigned char c = (unsigned char)r->text[n - back];
        if ((c & 0xC0) == 0x80)
            continue;               /* continuation byte */
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        if (need > back)
            n -= back;
        break;
    }
    size_t hold = 0;
    for (size_t i = 0; i < r->n_stops; i++) {
        size_t sl = strlen(r->stops[i]);
        for (size_t m = sl - 1; m > hold; m--)
            if (m <= r->text_len && memcmp(r->text + r->text_len - m, r->stops[i], m) == 0) {
                hold = m;
                break;
            }
    }
    size_t limit = r->text_len - hold;
    return n < limit ? n : limit;
}

/* The logprobs lp[from, to) of tokens gen[from, to) as messages, with each
 * token's bytes, all in one allocation (free it); NULL when there are none or
 * on no memory. */
static Kvd__TokenLogprob **logprob_msgs(const struct kvd *k, const struct sampler_logprobs *lp, const int32_t *gen,
                                        uint32_t from, uint32_t to)
{
    if (to <= from)
        return NULL;
    const size_t n = to - from;
    /* first the bytes the pieces need */
    size_t bytes = 0, n_pieces = 0, pn;
    char scratch[1];
    for (size_t i = 0; i < n; i++) {
        const struct sampler_logprobs *l = &lp[from + i];
        for (uint32_t j = 0; j <= l->n_top; j++) {
            int32_t id = j == 0 ? gen[from + i] : l->top_id[j - 1];
            pn = 0;
            tok_decode_piece(k->tok, id, scratch, 0, &pn);
            bytes += pn;
        }
        n_pieces += 1 + l->n_top;
    }
    Kvd__TokenLogprob **v = malloc(n * (sizeof(*v) + sizeof(**v)) + n_pieces * sizeof(ProtobufCBinaryData) + bytes);
    if (v == NULL)
        return NULL;
    Kvd__TokenLogprob *m = (Kvd__TokenLogprob *)(v + n);
    ProtobufCBinaryData *bins = (ProtobufCBinaryData *)(m + n);
    uint8_t *at = (uint8_t *)(bins + n_pieces), *end = at + bytes;
    for (size_t i = 0; i < n; i++) {
        const struct sampler_logprobs *l = &lp[from + i];
        kvd__token_logprob__init(&m[i]);
        m[i].has_logprob = true;
        m[i].logprob = l->logprob;
        m[i].has_rank = l->rank > 0;
        m[i].rank = l->rank;
        m[i].top_ids = (int32_t *)l->top_id;
        m[i].n_top_ids = l->n_top;
        m[i].top_logprobs = (float *)l->top_logprob;
        m[i].n_top_logprobs = l->n_top;
        for (uint32_t j = 0; j <= l->n_top; j++) {
            int32_t id = j == 0 ? gen[from + i] : l->top_id[j - 1];
            pn = 0;
            if (tok_decode_piece(k->tok, id, (char *)at, (size_t)(end - at), &pn) != 0)
                pn = 0;
            *bins = (ProtobufCBinaryData){ .len = pn, .data = at };
            at += pn;
            if (j == 0) {
                m[i].has_token = true;
                m[i].token = *bins++;
            } else {
                bins++;
            }
        }
        m[i].top_tokens = bins - l->n_top;
        m[i].n_top_tokens = l->n_top;
        v[i] = &m[i];
    }
    return v;
}

/* The logprobs of generated tokens [from, to) (lp_msgs) or of the prompt
 * (prompt_lp_msgs, the first with its token alone). */
static Kvd__TokenLogprob **lp_msgs(const struct kvd *k, const struct request *r, uint32_t from, uint32_t to)
{
    return r->logprobs < 0 ? NULL : logprob_msgs(k, r->lp, r->tok + r->n_prompt, from, to);
}

static Kvd__TokenLogprob **prompt_lp_msgs(const struct kvd *k, struct request *r)
{
    if (r->plp == NULL || r->n_prompt == 0)
        return NULL;
    /* tokens never scored (none should be) say NaN */
    r->plp[0] = (struct sampler_logprobs){ .logprob = NAN };
    for (uint32_t i = r->n_scored + 1; i < r->n_prompt; i++)
        r->plp[i] = (struct sampler_logprobs){ .logprob = NAN };
    Kvd__TokenLogprob **v = logprob_msgs(k, r->plp, r->tok, 0, r->n_prompt);
    if (v != NULL)
        v[0]->has_logprob = false;
    return v;
}

/* Streams what is new since the last chunk (all of it when final). */
static void stream_out(struct kvd *k, struct request *r, bool final)
{
    if (!r->stream || r->rid_len == 0)
        return;
    size_t upto = final ? r->text_len : safe_len(r);
    uint32_t n_gen = r->n_tok - r->n_prompt;
    if (upto <= r->sent && n_gen <= r->sent_tokens)
        return;
    Kvd__ServerReply m = KVD__SERVER_REPLY__INIT;
    Kvd__Chunk c = KVD__CHUNK__INIT;
    c.has_seq = true;
    c.seq = r->chunk_seq++;
    c.token_ids = r->tok + r->n_prompt + r->sent_tokens;
    c.n_token_ids = n_gen - r->sent_tokens;
    c.logprobs = lp_msgs(k, r, r->sent_tokens, n_gen);
    c.n_logprobs = c.logprobs ? c.n_token_ids : 0;
    char *txt = malloc(upto > r->sent ? upto - r->sent + 1 : 1);
    if (txt == NULL) {
        free(c.logprobs);
        return;
    }
    size_t tl = upto > r->sent ? upto - r->sent : 0;
    memcpy(txt, r->text + r->sent, tl);
    txt[tl] = '\0';
    c.text = txt;
    m.body_case = KVD__SERVER_REPLY__BODY_CHUNK;
    m.chunk = &c;
    if (reply(k, r->rid, r->rid_len, r->client_id, &m) != 0)
        r->rid_len = 0; /* the client is gone: nothing more is sent */
    free(txt);
    free(c.logprobs);
    r->sent = upto > r->sent ? upto : r->sent;
    r->sent_tokens = n_gen;
}

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

/* The latencies and finish reason of a request that ends now. */
static void observe(struct kvd *k, const struct request *r, double now, uint32_t n_gen)
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

/* Ends r: the final reply (or error), statistics, and its memory. r must be
 * in no list and hold no blocks. */
static void finish(struct kvd *k, struct request *r)
{
    static char empty_str[1];
    double now = cli_now_ms();
    uint32_t n_gen = r->n_tok - r->n_prompt;
    observe(k, r, now, n_gen);
    if (r->failed) {
        k->st.failed++;
        if (r->rid_len)
            reply_error(k, r->rid, r->rid_len, r->client_id, r->fail_code, r->fail_msg, 0);
    } else {
        k->st.done++;
        if (r->text != NULL && text_validate(r, false) == 0) {
            /* a character the end cut short (max_tokens, a deadline) is left
             * out whole: the text ends with the last whole character (the
             * token ids still carry every byte) */
            r->text_len = r->valid;
            r->text[r->text_len] = '\0';
        }
        stream_out(k, r, true);
        Kvd__ServerReply m = KVD__SERVER_REPLY__INIT;
        Kvd__Final f = KVD__FINAL__INIT;
        Kvd__Usage u = KVD__USAGE__INIT;
        Kvd__Timings t = KVD__TIMINGS__INIT;
        u.has_prompt_tokens = u.has_cached_prompt_tokens = u.has_completion_tokens = true;
        u.has_host_cached_prompt_tokens = u.has_disk_cached_prompt_tokens = true;
        u.prompt_tokens = r->n_prompt;
        u.cached_prompt_tokens = r->n_cached;
        u.host_cached_prompt_tokens = r->n_host;
        u.disk_cached_prompt_tokens = r->n_disk;
        u.completion_tokens = n_gen;
        const uint32_t created = r->cache_hw > r->n_cached ? r->cache_hw - r->n_cached : 0;
        u.has_cache_creation_tokens = u.has_cached_blocks = true;
        u.cache_creation_tokens = created;
        u.cached_blocks = (r->n_cached + created) / k->o.block_tokens;
        k->st.cache_creation_tokens += created;
        if (tenant_of(k, r) != NULL)
            tenant_of(k, r)->cache_creation_tokens += created;
        Kvd__Pin pin = KVD__PIN__INIT;
        if (r->pin_id[0]) {
            pin.id = r->pin_id;
            pin.tenant = tenant_of(k, r) != NULL ? tenant_of(k, r)->name : empty_str;
            pin.namespace_ = r->pin_ns;
            pin.has_tokens = pin.has_blocks = pin.has_hits = pin.has_created_unix_ms = true;
            pin.has_expires_unix_ms = pin.has_ttl_s = true;
            pin.tokens = r->pin_tokens;
            pin.blocks = r->pin_blocks;
            pin.hits = r->pin_hits;
            pin.created_unix_ms = r->pin_created;
            pin.expires_unix_ms = r->pin_expires;
            pin.ttl_s = r->pin_ttl_s;
            f.pin = &pin;
        } else if (r->pin_ttl_s > 0) {
            f.pin_error = r->pin_error[0] ? r->pin_error : (char *)"not pinned";
        }
        t.has_queued_ms = t.has_ttft_ms = t.has_decode_ms = t.has_total_ms = true;
        t.queued_ms = r->t_dispatch > 0 ? r->t_dispatch - r->t_arrival : now - r->t_arrival;
        t.ttft_ms = r->t_first > 0 ? r->t_first - r->t_arrival : 0;
        t.decode_ms = r->t_first > 0 ? r->t_last - r->t_first : 0;
        t.total_ms = now - r->t_arrival;
        f.has_finish_reason = f.has_chunks = true;
        f.finish_reason = r->finish ? r->finish : KVD__FINISH_REASON__FINISH_LENGTH;
        f.usage = &u;
        f.timings = &t;
        char empty = '\0';
        f.text = r->text ? r->text : &empty;
        f.token_ids = r->tok + r->n_prompt;
        f.n_token_ids = n_gen;
        f.chunks = r->chunk_seq;
        f.logprobs = lp_msgs(k, r, 0, n_gen);
        f.n_logprobs = f.logprobs ? n_gen : 0;
        f.prompt_logprobs = prompt_lp_msgs(k, r);
        f.n_prompt_logprobs = f.prompt_logprobs ? r->n_prompt : 0;
        f.prompt_token_ids = f.prompt_logprobs ? r->tok : NULL;
        f.n_prompt_token_ids = f.n_prompt_logprobs;
        m.body_case = KVD__SERVER_REPLY__BODY_FINAL;
        m.final = &f;
        if (r->rid_len)
            reply(k, r->rid, r->rid_len, r->client_id, &m);
        free(f.logprobs);
        free(f.prompt_logprobs);
    }
    k->st.completion_tokens += n_gen;
    req_free(r);
}

/* ---- stopping requests ----------------------------------------------------------------------- */

static void send_cancel(struct kvd *k, struct request *r)
{
    Kvdw__ToWorker m = KVDW__TO_WORKER__INIT;
    Kvdw__Cancel c = KVDW__CANCEL__INIT;
    c.has_seq_id = true;
    c.seq_id = r->seq_id;
    m.body_case = KVDW__TO_WORKER__BODY_CANCEL;
    m.cancel = &c;
    workers_send(k, r->worker, &m);
}

/* Ends r with finish reason `why` (or, with fail_code != 0, an error): at once
 * when it is queued, else after its worker lets go of it. */
static void stop_request(struct kvd *k, struct request *r, int why, int fail_code, const char *msg)
{
    if (fail_code) {
        r->failed = true;
        r->fail_code = fail_code;
        snprintf(r->fail_msg, sizeof(r->fail_msg), "%s", msg ? msg : "");
    }
    if (!r->finish)
        r->finish = why;
    if (r->state == REQ_QUEUED || r->state == REQ_WAITING) {
        prefix_seq_release(px_of(k, r), &r->ps);     /* a prefix back from the tiers */
        dequeue(k, r);
        finish(k, r);
    } else if (r->state == REQ_RESTORING) {
        /* finishes when its copies are done (its blocks are theirs until then) */
    } else if (r->state == REQ_RUNNING) {
        r->state = REQ_STOPPING;
        send_cancel(k, r);  /* finishes on Done (or when the worker is lost) */
    }
}

/* ---- admission ---------------------------------------------------------------------------------- */

/* The UTF-8 sequence at s[0..n): 1 and its length in *len when it is one
 * character (RFC 3629: no overlong forms, surrogates or values past
 * U+10FFFF), 0 when s is a valid start of one that n cuts short, -1 when its
 * first byte starts no valid character. */
static int utf8_seq(const unsigned char *s, size_t n, size_t *len)
{
    const unsigned char c = s[0];
    size_t want;
    unsigned char lo = 0x80, hi = 0xBF;     /* the second byte's range */
    if (c < 0x80) {
        *len = 1;
        return 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
        want = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        want = 3;
        lo = c == 0xE0 ? 0xA0 : 0x80;
        hi = c == 0xED ? 0x9F : 0xBF;
    } else if (c >= 0xF0 && c <= 0xF4) {
        want = 4;
        lo = c == 0xF0 ? 0x90 : 0x80;
        hi = c == 0xF4 ? 0x8F : 0xBF;
    } else {
        return -1;
    }
    for (size_t j = 1; j < want; j++) {
        if (j >= n)
            return 0;
        const unsigned char b = s[j];
        if (j == 1 ? (b < lo || b > hi) : (b >> 6) != 2)
            return -1;
    }
    *len = want;
    return 1;
}

int kvd_utf8_seq(const unsigned char *s, size_t n, size_t *len)
{
    return utf8_seq(s, n, len);
}

/* Makes r's text valid UTF-8 from r->valid on: every byte that starts no
 * valid character (a NUL byte too: text travels as C strings, and a NUL would
 * cut the chunks and the final text at different places) becomes U+FFFD; a
 * character cut short at the end waits for its bytes, unless `all` (the
 * text is complete). The token ids carry the exact output. */
static int text_validate(struct request *r, bool all)
{
    size_t bad = 0, i = r->valid, len;
    const unsigned char *t = (const unsigned char *)r->text;
    for (; i < r->text_len; i++) {      /* count first: each bad byte grows by 2 */
        const int v = t[i] ? utf8_seq(t + i, r->text_len - i, &len) : -1;
        if (v == 0 && !all)
            break;
        if (v == 1)
            i += len - 1;
        else
            bad++;
    }
    if (bad == 0) {
        r->valid = i;
        return 0;
    }
    const size_t add = 2 * bad;
    if (r->text_len + add + 1 > r->text_cap) {
        const size_t cap = (r->text_len + add + 1) * 2;
        char *nt = realloc(r->text, cap);
        if (nt == NULL)
            return KVD_ENOMEM;
        r->text = nt;
        r->text_cap = cap;
    }
    /* rewrite [valid, text_len) from a copy of it */
    const size_t tail = r->text_len - r->valid;
    char *src = malloc(tail ? tail : 1);
    if (src == NULL)
        return KVD_ENOMEM;
    memcpy(src, r->text + r->valid, tail);
    size_t o = r->valid, s = 0, done = r->valid;
    while (s < tail) {
        const unsigned char *u = (const unsigned char *)src + s;
        const int v = *u ? utf8_seq(u, tail - s, &len) : -1;
        if (v == 0 && !all) {
            memcpy(r->text + o, src + s, tail - s);     /* waits for its bytes */
            o += tail - s;
            break;
        }
        if (v == 1) {
            memcpy(r->text + o, src + s, len);
            o += len;
            s += len;
        } else {
            memcpy(r->text + o, "\xef\xbf\xbd", 3);
            o += 3;
            s++;
        }
        done = o;
    }
    free(src);
    r->text_len = o;
    r->text[o] = '\0';
    r->valid = done;
    return 0;
}

/* Appends a token's bytes to the request's text, as valid UTF-8 (text_validate). */
static int append_text(struct request *r, const char *s, size_t n)
{
    if (r->text_len + n + 1 > r->text_cap) {
        size_t cap = (r->text_len + n + 1) * 2;
        char *t = realloc(r->text, cap);
        if (t == NULL)
            return KVD_ENOMEM;
        r->text = t;
        r->text_cap = cap;
    }
    memcpy(r->text + r->text_len, s, n);
    r->text_len += n;
    r->text[r->text_len] = '\0';
    return text_validate(r, false);
}

static int reserve_tokens(struct request *r, uint32_t n)
{
    if (n <= r->tok_cap)
        return 0;
    uint32_t cap = n * 2 > 64 ? n * 2 : 64;
    int32_t *t = realloc(r->tok, (size_t)cap * sizeof(int32_t));
    if (t == NULL)
        return KVD_ENOMEM;
    r->tok = t;
    r->tok_cap = cap;
    return 0;
}

/* Tokenizes text into r->tok (after a BOS when the model wants one). */
static int tokenize(struct kvd *k, struct request *r, const char *text, size_t len, bool special)
{
    bool bos = tok_add_bos(k->tok);
    if (reserve_tokens(r, (uint32_t)len + 2) != 0)
        return KVD_ENOMEM;
    size_t n = 0;
    int rc = tok_encode(k->tok, text, len, special, r->tok + bos, r->tok_cap - bos, &n);
    if (rc != 0)
        return rc;
    if (bos)
        r->tok[0] = tok_bos(k->tok);
    r->n_tok = r->n_prompt = (uint32_t)(n + bos);
    return 0;
}

/* Fills r's prompt from the request; 0 or an error code and message. */
static int build_prompt(struct kvd *k, struct request *r, const Kvd__GenerateRequest *g,
                        char *msg, size_t msg_len)
{
    if (g->n_token_ids > 0) {
        if (reserve_tokens(r, (uint32_t)g->n_token_ids + 1) != 0)
            return KVD__ERROR_CODE__ERR_INTERNAL;
        for (size_t i = 0; i < g->n_token_ids; i++) {
            if ((uint32_t)g->token_ids[i] >= k->model->cfg.n_vocab) {
                snprintf(msg, msg_len, "token id %d is out of range (the vocabulary has %u tokens)",
                         g->token_ids[i], k->model->cfg.n_vocab);
                return KVD__ERROR_CODE__ERR_BAD_REQUEST;
            }
            r->tok[i] = g->token_ids[i];
        }
        r->n_tok = r->n_prompt = (uint32_t)g->n_token_ids;
        return 0;
    }
    if (g->n_messages > 0) {
        if (k->chat == NULL) {
            snprintf(msg, msg_len, "the model has no chat template; send a plain prompt");
            return KVD__ERROR_CODE__ERR_BAD_REQUEST;
        }
        struct chat_msg *cm = calloc(g->n_messages, sizeof(*cm));
        if (cm == NULL)
            return KVD__ERROR_CODE__ERR_INTERNAL;
        struct chat_calls *calls = calloc(g->n_messages, sizeof(*calls));
        if (calls == NULL) {
            free(cm);
            return KVD__ERROR_CODE__ERR_INTERNAL;
        }
        for (size_t i = 0; i < g->n_messages; i++) {
            cm[i] = (struct chat_msg){ g->messages[i]->role, g->messages[i]->content };
            calls[i] = (struct chat_calls){ (const char *const *)g->messages[i]->tool_calls,
                                            g->messages[i]->n_tool_calls };
        }
        char *text = NULL;
        size_t len = 0;
        int rc = chat_apply_tools(k->chat, cm, calls, g->n_messages, (const char *const *)g->tools, g->n_tools,
                                  true, &text, &len);
        free(calls);
        free(cm);
        if (rc == 0)
            rc = tokenize(k, r, text, len, true);
        free(text);
        if (rc != 0) {
            snprintf(msg, msg_len, "cannot apply the chat template: %s", kvd_strerror(rc));
            return KVD__ERROR_CODE__ERR_BAD_REQUEST;
        }
        return 0;
    }
    const char *text;
    size_t len;
    int rc = wire_prompt_text(k->arena, g, &text, &len, msg, msg_len);
    if (rc != 0)
        return rc == KVD_ETOOLONG ? KVD__ERROR_CODE__ERR_TOO_LONG : KVD__ERROR_CODE__ERR_BAD_REQUEST;
    rc = tokenize(k, r, text, len, false);
    if (rc != 0) {
        snprintf(msg, msg_len, "cannot tokenize the prompt: %s", kvd_strerror(rc));
        return KVD__ERROR_CODE__ERR_BAD_REQUEST;
    }
    return 0;
}

/* The whole blocks of r's prompt a pin takes (r->pin_tokens): of the whole
 * prompt, or of the prefix g's first pin_messages messages render to (the
 * template without the assistant's opening, tokenized alone, as far as it
 * agrees with the prompt's tokens). 0 or an error code with msg. */
static int pin_prefix(struct kvd *k, struct request *r, const Kvd__GenerateRequest *g, char *msg, size_t len)
{
    const uint32_t bt = k->o.block_tokens;
    uint32_t n = r->n_prompt;
    if (g->has_pin_messages && g->pin_messages > 0) {
        struct chat_msg *cm = calloc(g->pin_messages, sizeof(*cm));
        struct request tmp = { 0 };
        if (cm == NULL)
            return KVD__ERROR_CODE__ERR_INTERNAL;
        for (size_t i = 0; i < g->pin_messages; i++)
            cm[i] = (struct chat_msg){ g->messages[i]->role, g->messages[i]->content };
        char *text = NULL;
        size_t tlen = 0;
        int rc = chat_apply(k->chat, cm, g->pin_messages, false, &text, &tlen);
        free(cm);
        if (rc == 0)
            rc = tokenize(k, &tmp, text, tlen, true);
        free(text);
        if (rc != 0) {
            free(tmp.tok);
            snprintf(msg, len, "pin_messages: cannot apply the chat template: %s", kvd_strerror(rc));
            return KVD__ERROR_CODE__ERR_BAD_REQUEST;
        }
        uint32_t same = 0;
        while (same < tmp.n_prompt && same < r->n_prompt && tmp.tok[same] == r->tok[same])
            same++;
        free(tmp.tok);
        n = same;
    }
    /* begin leaves one token to compute: a pin of the whole prompt keeps the
     * blocks before its last token */
    if (n >= r->n_prompt)
        n = r->n_prompt - 1;
    r->pin_tokens = n / bt * bt;
    (void)msg;
    (void)len;
    return 0;
}

static void on_generate(struct kvd *k, const uint8_t *rid, size_t rid_len, const char *tenant, uint64_t id,
                        const Kvd__GenerateRequest *g)
{
    char msg[256];
    if (k->draining) {
        reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_SHUTTING_DOWN,
                    "kvd is shutting down", 0);
        return;
    }
    if (find_client(k, rid, rid_len, id) != NULL) {
        k->st.bad_messages++; /* answered with ERR_BAD_REQUEST: counted, as kvd.proto says */
        reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_BAD_REQUEST,
                    "request id already in use by a running request of this client", 0);
        return;
    }
    if (k->n_queued >= k->o.max_queue) {
        snprintf(msg, sizeof(msg), "the queue is full (%u requests waiting)", k->n_queued);
        reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_OVERLOADED, msg, RETRY_AFTER_MS);
        return;
    }
    if (workers_alive(k) == 0 && !workers_can_come_back(k)) {
        reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_UNAVAILABLE, "no worker is running", 0);
        return;
    }
    struct request *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory", 0);
        return;
    }
    r->t_arrival = cli_now_ms();
    r->client_id = id;
    memcpy(r->rid, rid, rid_len);
    r->rid_len = rid_len;
    r->worker = -1;
    r->restore_bad = UINT32_MAX;
    /* its tenant's entry is looked up now and made only once the request is
     * admitted: a refused request (malformed, too long) leaves no trace */
    const char *tname = NULL;
    size_t tlen = 0;
    const bool has_tenant = tenant_name(tenant, g->namespace_, &tname, &tlen);
    r->tenant = has_tenant ? tenant_find(k, tname, tlen) : -1;
    struct kvd_tenant *tn = tenant_of(k, r);
    if (tn != NULL && k->o.tenant_max_queue > 0 && tn->queued >= k->o.tenant_max_queue) {
        tn->refused++;
        snprintf(msg, sizeof(msg), "tenant %s has %u requests waiting (--tenant-max-queue)", tn->name, tn->queued);
        reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_OVERLOADED, msg, RETRY_AFTER_MS);
        req_free(r);
        return;
    }
    msg[0] = '\0';
    int code = build_prompt(k, r, g, msg, sizeof(msg));
    if (code == 0 && (g->json_schema != NULL || (g->has_json_object && g->json_object))) {
        /* structured output: the schema is compiled here to refuse what the
         * workers could not follow, with the reason; they compile it again.
         * A compile costs kvd's loop up to a few tenths of a second
         * (GRAMMAR_MAX_STATES), so the last schemas that passed are kept and
         * a request with one of them (the common case) costs nothing */
        char gerr[200] = "";
        const bool known = g->json_schema != NULL && schema_seen(g->json_schema);
        grammar_t *gr = g->json_schema != NULL && !known
                            ? jschema_compile(g->json_schema, strlen(g->json_schema), NULL, gerr, sizeof(gerr))
                            : NULL;
        if (gr != NULL)
            schema_keep(g->json_schema);
        if (g->json_schema != NULL && !known && gr == NULL) {
            snprintf(msg, sizeof(msg), "json_schema: %s", gerr);
            code = KVD__ERROR_CODE__ERR_BAD_REQUEST;
        } else if (g->has_ignore_eos && g->ignore_eos) {
            snprintf(msg, sizeof(msg), "ignore_eos cannot go with structured output (the document ends it)");
            code = KVD__ERROR_CODE__ERR_BAD_REQUEST;
        } else if (g->json_schema != NULL && (r->json_schema = strdup(g->json_schema)) == NULL) {
            code = KVD__ERROR_CODE__ERR_INTERNAL;
        }
        grammar_destroy(&gr);
        r->json_object = g->json_schema == NULL;
    }
    if (code == 0 && g->tool_choice != NULL && strcmp(g->tool_choice, "auto") != 0)
        code = admit_tool_calls(r, g, msg, sizeof(msg));
    if (code == 0)
        code = admit_window(k, r, g, msg, sizeof(msg));
    for (size_t i = 0; code == 0 && g->sampling != NULL && i < g->sampling->n_logit_bias; i++)
        if ((uint32_t)g->sampling->logit_bias_ids[i] >= k->model->cfg.n_vocab) {
            snprintf(msg, sizeof(msg), "logit_bias: token id %d is out of range (the vocabulary has %u tokens)",
                     g->sampling->logit_bias_ids[i], k->model->cfg.n_vocab);
            code = KVD__ERROR_CODE__ERR_BAD_REQUEST;
        }
    if (code == 0 && r->n_prompt == 0) {
        snprintf(msg, sizeof(msg), "the prompt is empty");
        code = KVD__ERROR_CODE__ERR_BAD_REQUEST;
    }
    const uint64_t pool_tokens = k->pool_seq_tokens;
    if (code == 0 && r->n_prompt + 1 > k->n_ctx) {
        snprintf(msg, sizeof(msg), "the prompt has %u tokens; the context holds %u", r->n_prompt,
                 k->n_ctx);
        code = KVD__ERROR_CODE__ERR_TOO_LONG;
    }
    if (code == 0 && has_tenant && k->tenant_blocks > 0 &&
        (uint64_t)(r->n_prompt + 1 + k->o.block_tokens - 1) / k->o.block_tokens > k->tenant_blocks) {
        snprintf(msg, sizeof(msg), "the prompt has %u tokens; tenant %.*s may hold %u blocks of %u "
                 "(--tenant-max-blocks)", r->n_prompt, (int)tlen, tname, k->tenant_blocks, k->o.block_tokens);
        code = KVD__ERROR_CODE__ERR_TOO_LONG;
    }
    if (code == 0 && r->n_prompt + 1 > pool_tokens) {
        snprintf(msg, sizeof(msg), "the prompt has %u tokens; the KV pool holds %llu", r->n_prompt,
                 (unsigned long long)pool_tokens);
        code = KVD__ERROR_CODE__ERR_TOO_LONG;
    }
    r->stops = g->n_stop ? calloc(g->n_stop, sizeof(char *)) : NULL;
    r->n_stops = r->stops != NULL ? g->n_stop : 0;      /* req_free frees what was made */
    if (code == 0 && g->n_stop > 0 && r->stops == NULL)
        code = KVD__ERROR_CODE__ERR_INTERNAL;
    for (size_t i = 0; code == 0 && i < g->n_stop; i++)
        if ((r->stops[i] = strdup(g->stop[i])) == NULL)
            code = KVD__ERROR_CODE__ERR_INTERNAL;
    if (code == 0 && has_tenant && r->tenant < 0 && (r->tenant = tenant_add(k, tname, tlen)) < 0) {
        snprintf(msg, sizeof(msg), "kvd serves %u tenants with requests or blocks now (--max-tenants)",
                 k->o.max_tenants);
        code = KVD__ERROR_CODE__ERR_OVERLOADED;
    }
    r->ps.owner = (uint16_t)(r->tenant + 1);    /* its blocks count for its tenant (0: none) */
    tn = tenant_of(k, r);
    if (code != 0) {
        k->st.bad_messages += code == KVD__ERROR_CODE__ERR_BAD_REQUEST;
        reply_error(k, rid, rid_len, id, code, msg[0] ? msg : "cannot take the request",
                    code == KVD__ERROR_CODE__ERR_OVERLOADED ? RETRY_AFTER_MS : 0);
        req_free(r);
        return;
    }
    Kvd__SamplingParams sp = KVD__SAMPLING_PARAMS__INIT;
    if (g->sampling) {
        const Kvd__SamplingParams *s = g->sampling;
        sp.has_temperature = s->has_temperature, sp.temperature = s->temperature;
        sp.has_top_k = s->has_top_k, sp.top_k = s->top_k;
        sp.has_top_p = s->has_top_p, sp.top_p = s->top_p;
        sp.has_min_p = s->has_min_p, sp.min_p = s->min_p;
        sp.has_repeat_penalty = s->has_repeat_penalty, sp.repeat_penalty = s->repeat_penalty;
        sp.has_seed = s->has_seed, sp.seed = s->seed;
        sp.has_presence_penalty = s->has_presence_penalty, sp.presence_penalty = s->presence_penalty;
        sp.has_frequency_penalty = s->has_frequency_penalty, sp.frequency_penalty = s->frequency_penalty;
        if (s->n_logit_bias > 0) {
            r->bias_ids = malloc(s->n_logit_bias * sizeof(int32_t));
            r->bias = malloc(s->n_logit_bias * sizeof(float));
            if (r->bias_ids == NULL || r->bias == NULL) {
                code = KVD__ERROR_CODE__ERR_INTERNAL;
                snprintf(msg, sizeof(msg), "out of memory");
            } else {
                memcpy(r->bias_ids, s->logit_bias_ids, s->n_logit_bias * sizeof(int32_t));
                memcpy(r->bias, s->logit_bias, s->n_logit_bias * sizeof(float));
                sp.n_logit_bias_ids = sp.n_logit_bias = s->n_logit_bias;
                sp.logit_bias_ids = r->bias_ids;
                sp.logit_bias = r->bias;
            }
        }
    }
    if (code != 0) {
        k->st.bad_messages += code == KVD__ERROR_CODE__ERR_BAD_REQUEST;
        reply_error(k, rid, rid_len, id, code, msg, 0);
        req_free(r);
        return;
    }
    if (!sp.has_seed) {
        sp.has_seed = true;
        sp.seed = (uint64_t)random() << 31 ^ (uint64_t)random();
    }
    r->sampling = sp;
    r->prefill_only = g->has_prefill_only && g->prefill_only;
    r->max_tokens = r->prefill_only ? 0 : g->has_max_tokens && g->max_tokens ? g->max_tokens : 256;
    r->prompt_logprobs = g->has_prompt_logprobs ? (int32_t)g->prompt_logprobs : -1;
    if (r->prompt_logprobs >= 0 && (r->plp = calloc(r->n_prompt ? r->n_prompt : 1, sizeof(*r->plp))) == NULL) {
        reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory", 0);
        req_free(r);
        return;
    }
    r->stream = g->has_stream && g->stream;
    r->ignore_eos = g->has_ignore_eos && g->ignore_eos;
    r->no_cache = g->has_no_cache && g->no_cache;
    r->logprobs = g->has_logprobs ? (int32_t)g->logprobs : -1;
    const char *ns = g->namespace_ ? g->namespace_ : "";
    if (tenant != NULL) {
        /* a CURVE client's cache is its tenant's, whatever namespace it names
         * inside it ("tenant:NAME/namespace", as the HTTP API's keys) */
        const size_t tl = strlen(tenant), nl = strlen(ns);
        char *full = malloc(tl + nl + 9);
        if (full == NULL) {
            reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory", 0);
            req_free(r);
            return;
        }
        memcpy(full, "tenant:", 7);
        memcpy(full + 7, tenant, tl);
        full[7 + tl] = '/';
        memcpy(full + 8 + tl, ns, nl);
        r->ns = prefix_namespace(k->px, full, tl + nl + 8);
        free(full);
    } else {
        r->ns = prefix_namespace(k->px, ns, strlen(ns));
    }
    if (k->n_public_tok > 0 && !r->no_cache) {
        /* the full blocks it shares with --public-prefix are keyed for everyone */
        r->ps.n_public = req_public_blocks(k, r->tok, r->n_prompt);
        r->ps.public_ns = k->public_ns;
    }
    if (g->has_pin_ttl_s) {
        r->pin_ttl_s = g->pin_ttl_s;
        code = pin_prefix(k, r, g, msg, sizeof(msg));
        if (code == 0)
            code = pins_admit(k, r, msg, sizeof(msg));
        if (code == 0 && (r->pin_ns = strdup(g->namespace_ ? g->namespace_ : "")) == NULL)
            code = KVD__ERROR_CODE__ERR_INTERNAL;
        if (code != 0) {
            k->st.bad_messages += code == KVD__ERROR_CODE__ERR_BAD_REQUEST;
            reply_error(k, rid, rid_len, id, code, msg, 0);
            req_free(r);
            return;
        }
    }
    r->deadline = g->has_deadline_ms && g->deadline_ms ? r->t_arrival + g->deadline_ms : 0;
    r->seq_id = ++k->next_seq;
    r->state = REQ_QUEUED;
    list_append(&k->queue, r);
    uint32_t position = k->n_queued++;
    k->st.prompt_tokens += r->n_prompt;
    if (tn != NULL) {
        tn->queued++;
        tn->requests++;
        tn->prompt_tokens += r->n_prompt;
    }

    Kvd__ServerReply m = KVD__SERVER_REPLY__INIT;
    Kvd__Accepted a = KVD__ACCEPTED__INIT;
    a.has_prompt_tokens = a.has_queue_position = true;
    a.prompt_tokens = r->n_prompt;
    a.queue_position = position;
    m.body_case = KVD__SERVER_REPLY__BODY_ACCEPTED;
    m.accepted = &a;
    reply(k, rid, rid_len, id, &m);
    req_dispatch(k);
}

/* ---- dispatch ------------------------------------------------------------------------------------ */

/* A request whose workers die this many times is failed rather than resumed
 * again: one that brings its worker down every time would otherwise take
 * every worker down, one after another. From SUSPECT_AFTER deaths on it runs
 * alone on an idle worker, so that requests that merely shared a batch with
 * it are not taken down with it again. */
#define MAX_WORKERS_LOST 3
#define SUSPECT_AFTER 2

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
            if (!can_take(w, r) || k->hosts[w->host].seq_tokens < seq_n(r) + 1ull)
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
        if (!k->hosts[h].used || k->hosts[h].seq_tokens < seq_n(r) + 1ull)
            continue;
        if ((cand[h] = pick_worker(k, r, h)) >= 0)
            n_cand++;
    }
    for (int h = 0; h < KVD_MAX_HOSTS; h++) {
        if (cand[h] < 0)
            continue;
        /* one candidate: no need to look */
        const uint32_t hit = n_cand > 1 && !r->no_cache
                                 ? prefix_seq_probe(k->hosts[h].px, &r->ps, r->ns, seq_tok(r), seq_n(r))
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

/* Logical blocks [from, n_blocks) of ps as Assign and Grant carry them: part
 * 0's table itself for a pool of one part, else a copy (*copy, for the caller
 * to free) with one id per part for each. NULL when out of memory. */
static uint32_t *wire_blocks(struct prefix_seq *ps, uint32_t from, size_t *n, uint32_t **copy)
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

/* The measured cost of computing a prompt token (what the host tier's restores
 * are weighed against): dispatch to first token over the tokens computed, for
 * prompts that computed enough to say, averaged over recent requests. */
static void note_prefill_rate(struct kvd *k, const struct request *r)
{
    const uint32_t computed = r->n_prompt > r->n_cached ? r->n_prompt - r->n_cached : 0;
    if (computed < 64 || r->t_dispatch <= 0 || r->t_first <= r->t_dispatch)
        return;
    kvd_ewma(&k->prefill_ns_token, (r->t_first - r->t_dispatch) * 1e6 / computed);
}

/* Requests waiting for a pending prefix try again (after a commit or release). */
static void wake_waiters(struct kvd *k)
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
    const bool whole = prefix_seq_restored(px_of(k, r), &r->ps, r->tok, r->restore_bad);
    r->state = REQ_QUEUED;
    if (!whole || r->restore_wait || r->finish || r->failed) {
        prefix_seq_release(px_of(k, r), &r->ps);
        r->rest_host = r->rest_disk = 0;    /* what comes back next is found in the pool */
    }
    r->restore_bad = UINT32_MAX;
    r->restore_wait = false;
    wake_waiters(k);
    if (r->finish || r->failed) {
        /* stopped while its copies ran */
        if (k->o.verbose)
            kvd_log(k, "request %llu: stopped while its prefix came back from the tiers",
                    (unsigned long long)r->seq_id);
        dequeue(k, r);
        finish(k, r);
    }
}

static void on_restored(void *user, const struct restore_done *d)
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
    if (k->restorer != NULL && restorer_collect(k->restorer, false, on_restored, k) > 0)
        req_dispatch(k);
}

/* Tries to start r on a worker. 1 started, 0 not now (no worker or blocks, or
 * its prefix is being copied back from the tiers), -1 r finished (it can
 * never fit). */
static int start(struct kvd *k, struct request *r)
{
    int w = pick(k, r);
    if (w < 0)
        return 0;
    prefix_t *px = px_of(k, r);
    uint32_t wait = POOL_NONE;
    int64_t cached;
    k->got_host = k->got_disk = 0;     /* counted by the tiers' synchronous fetch */
    if (r->ps.n_blocks > 0) {
        cached = (int64_t)r->ps.n_cached * k->o.block_tokens;   /* back from the tiers */
    } else if (r->no_cache) {
        cached = prefix_seq_begin(px, &r->ps, r->ns, seq_tok(r), 0, NULL);
        r->ps.chain_open = false; /* nothing it computes is indexed either */
    } else {
        /* a scored prompt takes from the cache only positions whose tokens it
         * has scores past: token i's score needs position i - 1 computed */
        const uint64_t n_look = r->plp != NULL && r->n_scored + 1ull < seq_n(r) ? r->n_scored + 1ull : seq_n(r);
        k->restore_for = r;
        cached = prefix_seq_begin(px, &r->ps, r->ns, seq_tok(r), n_look, n_look == seq_n(r) ? &wait : NULL);
        k->restore_for = NULL;
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
                             lease_cap(k, r, (uint64_t)cached, want_positions(k, seq_n(r) + 1ull)),
                             seq_tok(r), r->no_cache ? 0 : seq_n(r));
    if (rc == KVD_ENOSPACE)
        rc = prefix_seq_grow(px, &r->ps, lease_cap(k, r, (uint64_t)cached, seq_n(r) + 1ull), seq_tok(r),
                             r->no_cache ? 0 : seq_n(r));
    if (rc != 0) {
        prefix_seq_release(px, &r->ps);
        if (host_active(k, r->host) == 0 && k->hosts[r->host].fenced == NULL) {
            /* nothing will free blocks there: it can never run */
            stop_request(k, r, 0, KVD__ERROR_CODE__ERR_TOO_LONG,
                         "the KV pool cannot hold this sequence");
            return -1;
        }
        return 0;
    }
    Kvdw__ToWorker m = KVDW__TO_WORKER__INIT;
    Kvdw__Assign a = KVDW__ASSIGN__INIT;
    a.has_seq_id = a.has_n_cached = a.has_max_new = a.has_ignore_eos = a.has_n_generated = true;
    a.seq_id = r->seq_id;
    a.tokens = (int32_t *)seq_tok(r);
    a.n_tokens = seq_n(r);
    a.n_cached = (uint32_t)cached;
    uint32_t *flat = NULL;
    if ((a.blocks = wire_blocks(&r->ps, 0, &a.n_blocks, &flat)) == NULL) {
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
    dequeue(k, r);
    list_append(&k->active, r);
    k->n_active++;
    if (tenant_of(k, r) != NULL)
        tenant_of(k, r)->running++;
    r->state = REQ_RUNNING;
    r->worker = w;
    r->n_written = (uint32_t)cached;
    if (r->t_dispatch == 0) {
        r->t_dispatch = cli_now_ms();
        r->n_cached = (uint32_t)cached;
        r->n_host = (k->got_host + r->rest_host) * k->o.block_tokens;
        r->n_disk = (k->got_disk + r->rest_disk) * k->o.block_tokens;
        k->st.cached_prompt_tokens += (uint64_t)cached;
        if (tenant_of(k, r) != NULL)
            tenant_of(k, r)->cached_prompt_tokens += (uint64_t)cached;
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
            int rc = start(k, r);
            if (rc == 0 && r->state == REQ_QUEUED)
                break; /* no worker or no blocks: keep the order */
        }
        r = next;
    }
}

/* ---- worker reports ------------------------------------------------------------------------------ */

static struct request *from_worker(struct kvd *k, int w, uint64_t seq_id)
{
    struct request *r = find_active(k, seq_id);
    if (r == NULL || r->worker != w) {
        k->st.bad_messages++;
        return NULL;
    }
    return r;
}

static void commit(struct kvd *k, struct request *r, uint32_t n_written)
{
    if (n_written <= r->n_written || n_written > seq_n(r))
        return;
    if (r->worker >= 0)
        k->workers[r->worker].tokens += n_written - r->n_written; /* positions it computed */
    if (prefix_seq_commit(px_of(k, r), &r->ps, seq_tok(r), n_written) != 0)
        kvd_log(k, "request %llu: committed blocks differ from the tokens promised",
                (unsigned long long)r->seq_id);
    r->n_written = n_written;
    /* the prompt's leading blocks it holds written and findable: what it read
     * and what it wrote to the cache (usage's cache_creation_tokens) */
    uint32_t held = r->ps.n_indexed < r->ps.n_committed ? r->ps.n_indexed : r->ps.n_committed;
    if (held > r->n_prompt / k->o.block_tokens)
        held = r->n_prompt / k->o.block_tokens;
    if (held * k->o.block_tokens > r->cache_hw)
        r->cache_hw = held * k->o.block_tokens;
    wake_waiters(k);
}

/* Keeps the prompt logprobs a worker sent: tokens [first, first + n) of the
 * prompt, taken when they go on from the ones kvd has (a worker resumes
 * where its assignment began). */
static void keep_prompt_logprobs(struct kvd *k, struct request *r, const Kvdw__Commit *c)
{
    if (r->plp == NULL || c->n_prompt_logprobs == 0 || !c->has_first_scored || c->first_scored == 0 ||
        c->first_scored > r->n_scored + 1 || c->first_scored + c->n_prompt_logprobs > r->n_prompt)
        return;
    for (size_t i = 0; i < c->n_prompt_logprobs; i++) {
        const Kvd__TokenLogprob *m = c->prompt_logprobs[i];
        struct sampler_logprobs *l = &r->plp[c->first_scored + i];
        l->logprob = m->has_logprob ? m->logprob : NAN;
        l->rank = m->has_rank ? m->rank : 0;
        l->n_top = 0;
        for (size_t j = 0; j < m->n_top_ids && j < SAMPLER_MAX_TOP_LOGPROBS; j++) {
            if ((uint32_t)m->top_ids[j] >= k->model->cfg.n_vocab)
                break;
            l->top_id[j] = m->top_ids[j];
            l->top_logprob[j] = m->top_logprobs[j];
            l->n_top++;
        }
    }
    const uint32_t upto = c->first_scored + (uint32_t)c->n_prompt_logprobs - 1;
    if (upto > r->n_scored)
        r->n_scored = upto;
}

void req_on_commit(struct kvd *k, int w, const Kvdw__Commit *c)
{
    struct request *r = from_worker(k, w, c->seq_id);
    if (r == NULL)
        return;
    window_settled(k, r);
    keep_prompt_logprobs(k, r, c);
    commit(k, r, c->n_written);
    req_dispatch(k);
}

/* Keeps the logprob the worker sent for generated token i (NaN when it
 * sent none). */
static int keep_logprob(struct request *r, uint32_t i, Kvd__TokenLogprob *const *lp, size_t n_lp, size_t at,
                        uint32_t n_vocab)
{
    if (i >= r->lp_cap) {
        uint32_t cap = i * 2 > 16 ? i * 2 : 16;
        struct sampler_logprobs *v = realloc(r->lp, (size_t)cap * sizeof(*v));
        if (v == NULL)
            return KVD_ENOMEM;
        r->lp = v;
        r->lp_cap = cap;
    }
    struct sampler_logprobs *l = &r->lp[i];
    l->logprob = NAN;
    l->n_top = 0;
    if (at >= n_lp)
        return 0;
    const Kvd__TokenLogprob *m = lp[at];
    if (m->has_logprob)
        l->logprob = m->logprob;
    for (size_t j = 0; j < m->n_top_ids && j < SAMPLER_MAX_TOP_LOGPROBS; j++) {
        if ((uint32_t)m->top_ids[j] >= n_vocab)
            return KVD_ERANGE;
        l->top_id[j] = m->top_ids[j];
        l->top_logprob[j] = m->top_logprobs[j];
        l->n_top++;
    }
    return 0;
}

void req_on_tokens(struct kvd *k, int w, const Kvdw__TokenChunk *c)
{
    const int32_t *t = c->tokens;
    const size_t n = c->n_tokens;
    struct request *r = from_worker(k, w, c->seq_id);
    if (r == NULL || r->state != REQ_RUNNING)
        return;
    window_settled(k, r);
    double now = cli_now_ms();
    for (size_t i = 0; i < n && r->state == REQ_RUNNING; i++) {
        const uint32_t V = k->model->cfg.n_vocab;
        if ((uint32_t)t[i] >= V || reserve_tokens(r, r->n_tok + 2) != 0 ||
            (r->logprobs >= 0 && keep_logprob(r, r->n_tok - r->n_prompt, c->logprobs, c->n_logprobs, i, V))) {
            stop_request(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "the worker sent a bad token");
            return;
        }
        r->tok[r->n_tok++] = t[i];
        if (r->wtok != NULL && wtok_push(r, t[i]) != 0) {
            stop_request(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory");
            return;
        }
        if (r->t_first == 0) {
            r->t_first = now;
            note_prefill_rate(k, r);
        }
        r->t_last = now;
        if (!r->ignore_eos && tok_is_eog(k->tok, t[i]))
            continue; /* the worker ends the sequence; no text */
        char piece[512];
        size_t pn = 0;
        if (tok_decode_piece(k->tok, t[i], piece, sizeof(piece), &pn) != 0)
            pn = 0;
        size_t before = r->text_len;
        append_text(r, piece, pn);
        for (size_t s = 0; s < r->n_stops; s++) {
            size_t sl = strlen(r->stops[s]);
            size_t from = before >= sl ? before - sl + 1 : 0;
            const char *hit = r->text_len ? strstr(r->text + from, r->stops[s]) : NULL;
            if (hit != NULL) {
                r->text_len = (size_t)(hit - r->text);
                r->text[r->text_len] = '\0';
                if (r->valid > r->text_len)
                    r->valid = r->text_len;
                stop_request(k, r, KVD__FINISH_REASON__FINISH_STOP, 0, NULL);
                break;
            }
        }
    }
    commit(k, r, c->n_written);
    if (r->state == REQ_RUNNING)
        stream_out(k, r, false);
}

/* r's worker gets (or no longer waits for) the blocks it asked for. */
static void unstarve(struct kvd *k, struct request *r)
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
    send_cancel(k, young);
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
    if ((g.blocks = wire_blocks(&r->ps, from, &g.n_blocks, &flat)) == NULL) {
        /* the worker waits for this grant: end the request rather than hang it */
        stop_request(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory");
        return;
    }
    m.body_case = KVDW__TO_WORKER__BODY_GRANT;
    m.grant = &g;
    workers_send(k, r->worker, &m);
    free(flat);
}

void req_on_lease(struct kvd *k, int w, uint64_t seq_id, uint32_t n_positions)
{
    struct request *r = from_worker(k, w, seq_id);
    if (r == NULL || r->state != REQ_RUNNING)
        return;
    if (n_positions > k->n_ctx + 1u) {
        k->st.bad_messages++;
        return;
    }
    uint32_t before = r->ps.n_blocks;
    const int32_t *known = r->no_cache ? NULL : seq_tok(r);
    uint64_t n_known = r->no_cache ? 0 : seq_n(r);
    n_positions = (uint32_t)lease_cap(k, r, r->n_written, n_positions);
    int rc = prefix_seq_grow(px_of(k, r), &r->ps, lease_cap(k, r, r->n_written, want_positions(k, n_positions)),
                             known, n_known);
    if (rc == KVD_ENOSPACE)
        rc = prefix_seq_grow(px_of(k, r), &r->ps, n_positions, known, n_known);
    if (rc == 0) {
        if (r->ps.n_blocks > before)
            grant(k, r, before);
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
        unstarve(k, r);
        stop_request(k, r, KVD__FINISH_REASON__FINISH_LENGTH, 0, NULL);
    } else if (r->preempted) {
        unstarve(k, r); /* it was the youngest: it waits in the queue, not for blocks */
    }
}

/* Retries the leases that waited for blocks. */
static void retry_leases(struct kvd *k)
{
    for (struct request *r = k->active; r; r = r->next) {
        if (r->lease_want == 0 || r->state != REQ_RUNNING)
            continue;
        uint32_t before = r->ps.n_blocks;
        int rc = prefix_seq_grow(px_of(k, r), &r->ps, r->lease_want, r->no_cache ? NULL : seq_tok(r),
                                 r->no_cache ? 0 : seq_n(r));
        if (rc == 0) {
            unstarve(k, r);
            if (r->ps.n_blocks > before)
                grant(k, r, before);
        } else if (k->hosts[r->host].fenced != NULL) {
            /* it waits for the fenced blocks (hosts_tick) */
        } else if (!preempt_for(k, r)) {
            unstarve(k, r);
            stop_request(k, r, KVD__FINISH_REASON__FINISH_LENGTH, 0, NULL);
        } else if (r->preempted) {
            unstarve(k, r);
        }
    }
}

/* r's prompt is written and its blocks still held: its pin is made (or
 * renewed). A pin that cannot be taken now (its prefix is not all cached
 * because another request computed the same blocks at the same time, or
 * other pins took the room it was admitted with) does not fail a request
 * whose output is whole: its Final carries pin_error instead of a pin. */
static void take_pin(struct kvd *k, struct request *r)
{
    char msg[256];
    const struct kvd_pin *p = pins_take(k, r, msg, sizeof(msg));
    if (p == NULL) {
        snprintf(r->pin_error, sizeof(r->pin_error), "%.200s", msg);
        if (k->o.verbose)
            kvd_log(k, "request %llu: %s", (unsigned long long)r->seq_id, r->pin_error);
        return;
    }
    Kvd__Pin m;
    pins_describe(p, &m);
    snprintf(r->pin_id, sizeof(r->pin_id), "%s", m.id);
    r->pin_blocks = m.blocks;
    r->pin_hits = m.hits;
    r->pin_created = m.created_unix_ms;
    r->pin_expires = m.expires_unix_ms;
}

/* r's worker no longer touches its blocks: release them and move on. */
static void let_go(struct kvd *k, struct request *r, int reason, const char *error)
{
    list_remove(&k->active, r);
    k->n_active--;
    struct kvd_tenant *t = tenant_of(k, r);
    if (t != NULL && t->running > 0)
        t->running--;
    if (r->worker >= 0 && k->workers[r->worker].running > 0 && --k->workers[r->worker].running == 0)
        k->workers[r->worker].isolating = false;
    unstarve(k, r);
    r->worker = -1;
    bool resume = r->preempted || reason < 0;
    if (r->pin_ttl_s > 0 && !resume && !r->failed) {
        if (r->n_written >= r->pin_tokens &&
            (reason == KVDW__DONE_REASON__DONE_EOG || reason == KVDW__DONE_REASON__DONE_LENGTH ||
             r->finish == KVD__FINISH_REASON__FINISH_STOP))
            take_pin(k, r);
        else
            snprintf(r->pin_error, sizeof(r->pin_error), "the request ended (%s) before its prefix was "
                     "written; not pinned", r->finish == KVD__FINISH_REASON__FINISH_CANCELLED ? "cancelled"
                     : r->finish == KVD__FINISH_REASON__FINISH_DEADLINE ? "its deadline" : "early");
    }
    prefix_seq_release(px_of(k, r), &r->ps);    /* (nothing when fenced: hosts_fence) */
    wake_waiters(k);
    if (resume && !r->finish && !r->failed) {
        /* back to the head of the queue; recomputed from its cached prefix */
        r->preempted = false;
        r->state = REQ_QUEUED;
        r->next = k->queue;
        k->queue = r;
        k->n_queued++;
        if (t != NULL)
            t->queued++;
        if (reason >= 0)
            k->st.preemptions++;
        return;
    }
    if (r->state != REQ_STOPPING) {
        if (reason == KVDW__DONE_REASON__DONE_EOG)
            r->finish = KVD__FINISH_REASON__FINISH_STOP;
        else if (reason == KVDW__DONE_REASON__DONE_LENGTH)
            r->finish = KVD__FINISH_REASON__FINISH_LENGTH;
        else if (reason == KVDW__DONE_REASON__DONE_ERROR) {
            r->failed = true;
            r->fail_code = KVD__ERROR_CODE__ERR_INTERNAL;
            snprintf(r->fail_msg, sizeof(r->fail_msg), "worker: %s", error ? error : "failed");
        } else
            r->finish = KVD__FINISH_REASON__FINISH_CANCELLED;
    }
    if (r->finish == KVD__FINISH_REASON__FINISH_DEADLINE && r->n_tok == r->n_prompt && !r->failed) {
        r->failed = true;
        r->fail_code = KVD__ERROR_CODE__ERR_DEADLINE;
        snprintf(r->fail_msg, sizeof(r->fail_msg), "the deadline passed before any output");
    }
    finish(k, r);
}

void req_on_done(struct kvd *k, int w, uint64_t seq_id, int reason, uint32_t n_written,
                 const char *error)
{
    struct request *r = from_worker(k, w, seq_id);
    if (r == NULL)
        return;
    if (reason != KVDW__DONE_REASON__DONE_ERROR)
        commit(k, r, n_written);
    let_go(k, r, reason, error);
    retry_leases(k);
    req_dispatch(k);
}

void req_on_worker_lost(struct kvd *k, int w)
{
    struct request *r = k->active;
    while (r) {
        struct request *next = r->next;
        if (r->worker == w) {
            if (++r->workers_lost >= MAX_WORKERS_LOST && !r->failed && !r->finish) {
                r->failed = true;
                r->fail_code = KVD__ERROR_CODE__ERR_INTERNAL;
                snprintf(r->fail_msg, sizeof(r->fail_msg),
                         "%u workers died while serving this request; not retried again", r->workers_lost);
            }
            if (k->workers[w].host > 0)
                hosts_fence(k, r->host, &r->ps);   /* another host's worker may still write (or copy
                                                    * a window's sources: s->held goes with it) */
            let_go(k, r, -1, NULL); /* resumes elsewhere unless it was stopping or failed */
        }
        r = next;
    }
    retry_leases(k);
    req_dispatch(k);
}

/* ---- client messages ------------------------------------------------------------------------------ */

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

static void on_stats(struct kvd *k, const uint8_t *rid, size_t rid_len, const char *tenant, uint64_t id,
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
        const int32_t only = tenant != NULL ? tenant_find(k, tenant, strlen(tenant)) : -1;
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
    reply(k, rid, rid_len, id, &m);
    if (want_view)
        view_free(&view);
    free(hl.v);
    free(trows);
    free(tptrs);
}

/* Appends the UTF-8 in s[0..n) to out, each byte that starts no valid
 * character (utf8_seq; a cut-short one included) as U+FFFD. */
static void append_utf8(char *out, size_t *len, const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        size_t want = 0;
        const bool ok = utf8_seq((const unsigned char *)s + i, n - i, &want) == 1;
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
        const int code = build_prompt(k, &tmp, &g, msg, sizeof(msg));
        if (code != 0 && !msg[0])
            snprintf(msg, sizeof(msg), "cannot tokenize: error %d", code);
        if (code == 0) {
            out.token_ids = tmp.tok;
            out.n_token_ids = tmp.n_tok;
        }
    }
    if (msg[0]) {
        k->st.bad_messages++;
        reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_BAD_REQUEST, msg, 0);
    } else {
        m.body_case = KVD__SERVER_REPLY__BODY_TOKENS;
        m.tokens = &out;
        reply(k, rid, rid_len, id, &m);
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
    reply(k, rid, rid_len, id, &m);
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
        reply_error(k, rid, rid_len, wire_client_request_id(buf, len),
                    code == KVD_ETOOLONG ? KVD__ERROR_CODE__ERR_TOO_LONG
                                         : KVD__ERROR_CODE__ERR_BAD_REQUEST, err, 0);
        return;
    }
    uint64_t id = m->request_id;
    switch (m->body_case) {
    case KVD__CLIENT_REQUEST__BODY_GENERATE:
        on_generate(k, rid, rid_len, tenant, id, m->generate);
        break;
    case KVD__CLIENT_REQUEST__BODY_CANCEL: {
        struct request *r = find_client(k, rid, rid_len, m->cancel->target);
        if (r == NULL) {
            reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_NOT_FOUND,
                        "no such request of this client", 0);
            break;
        }
        Kvd__ServerReply a = KVD__SERVER_REPLY__INIT;
        Kvd__Accepted acc = KVD__ACCEPTED__INIT;
        a.body_case = KVD__SERVER_REPLY__BODY_ACCEPTED;
        a.accepted = &acc;
        reply(k, rid, rid_len, id, &a);
        stop_request(k, r, KVD__FINISH_REASON__FINISH_CANCELLED, 0, NULL);
        req_dispatch(k);
        break;
    }
    case KVD__CLIENT_REQUEST__BODY_STATS:
        /* the index's hashes are the operator's to see, not a tenant's */
        on_stats(k, rid, rid_len, tenant, id, tenant == NULL && m->stats->has_block_hashes && m->stats->block_hashes,
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
        reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_BAD_REQUEST, "empty request", 0);
        break;
    }
}

/* ---- time ---------------------------------------------------------------------------------------- */

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
                stop_request(k, r, KVD__FINISH_REASON__FINISH_CANCELLED, 0, NULL);
            } else if (r->deadline > 0 && now > r->deadline && r->state != REQ_STOPPING) {
                if (r->n_tok == r->n_prompt)
                    stop_request(k, r, KVD__FINISH_REASON__FINISH_DEADLINE,
                                 KVD__ERROR_CODE__ERR_DEADLINE,
                                 "the deadline passed before any output");
                else
                    stop_request(k, r, KVD__FINISH_REASON__FINISH_DEADLINE, 0, NULL);
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
                stop_request(k, r, KVD__FINISH_REASON__FINISH_CANCELLED,
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
        stop_request(k, r, 0, code, why);
        r = next;
    }
}

void req_blocks_freed(struct kvd *k)
{
    retry_leases(k);
    req_dispatch(k);
}

void req_fail_unfit(struct kvd *k)
{
    struct request *r = k->queue;
    while (r) {
        struct request *next = r->next;
        if (r->state == REQ_QUEUED && r->ps.n_blocks == 0 && seq_n(r) + 1ull > k->pool_seq_tokens)
            stop_request(k, r, 0, KVD__ERROR_CODE__ERR_TOO_LONG,
                         "no pool left can hold this sequence (a host was lost)");
        r = next;
    }
}

void req_release_all(struct kvd *k)
{
    if (k->restorer != NULL)
        restorer_collect(k->restorer, true, on_restored, k);   /* no copy may outlive its blocks */
    while (k->active)
        let_go(k, k->active, KVDW__DONE_REASON__DONE_CANCELLED, NULL);
    req_fail_queued(k, KVD__ERROR_CODE__ERR_SHUTTING_DOWN, "kvd is shutting down");
}
