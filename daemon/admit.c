/*
 * admit.c - a Generate request from a client, checked, turned into token ids
 * (chat template, tokenizer, or ids as given) and admitted into a bounded
 * queue (OVERLOADED past it, or past its tenant's share), then answered with
 * Accepted and dispatched (dispatch.c).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "jschema.h"
#include "toolcall.h"
#include "kvd.h"
#include "pins.h"
#include "req_internal.h"
#include "workers.h"

/* What an OVERLOADED reply tells the client to wait before it tries again. */
#define RETRY_AFTER_MS 1000u

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

/* ---- admission ---------------------------------------------------------------------------------- */

int req_reserve_tokens(struct request *r, uint32_t n)
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

int req_tokenize(struct kvd *k, struct request *r, const char *text, size_t len, bool special)
{
    bool bos = tok_add_bos(k->tok);
    if (req_reserve_tokens(r, (uint32_t)len + 2) != 0)
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

int req_build_prompt(struct kvd *k, struct request *r, const Kvd__GenerateRequest *g,
                     char *msg, size_t msg_len)
{
    if (g->n_token_ids > 0) {
        if (req_reserve_tokens(r, (uint32_t)g->n_token_ids + 1) != 0)
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
            rc = req_tokenize(k, r, text, len, true);
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
    rc = req_tokenize(k, r, text, len, false);
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
            rc = req_tokenize(k, &tmp, text, tlen, true);
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

void req_on_generate(struct kvd *k, const uint8_t *rid, size_t rid_len, const char *tenant, uint64_t id,
                     const Kvd__GenerateRequest *g)
{
    char msg[256];
    if (k->draining) {
        req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_SHUTTING_DOWN,
                    "kvd is shutting down", 0);
        return;
    }
    if (req_find_client(k, rid, rid_len, id) != NULL) {
        k->st.bad_messages++; /* answered with ERR_BAD_REQUEST: counted, as kvd.proto says */
        req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_BAD_REQUEST,
                    "request id already in use by a running request of this client", 0);
        return;
    }
    if (k->n_queued >= k->o.max_queue) {
        snprintf(msg, sizeof(msg), "the queue is full (%u requests waiting)", k->n_queued);
        req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_OVERLOADED, msg, RETRY_AFTER_MS);
        return;
    }
    if (workers_alive(k) == 0 && !workers_can_come_back(k)) {
        req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_UNAVAILABLE, "no worker is running", 0);
        return;
    }
    struct request *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory", 0);
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
    const bool has_tenant = req_tenant_name(tenant, g->namespace_, &tname, &tlen);
    r->tenant = has_tenant ? req_tenant_find(k, tname, tlen) : -1;
    struct kvd_tenant *tn = req_tenant_of(k, r);
    if (tn != NULL && k->o.tenant_max_queue > 0 && tn->queued >= k->o.tenant_max_queue) {
        tn->refused++;
        snprintf(msg, sizeof(msg), "tenant %s has %u requests waiting (--tenant-max-queue)", tn->name, tn->queued);
        req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_OVERLOADED, msg, RETRY_AFTER_MS);
        req_free(r);
        return;
    }
    msg[0] = '\0';
    int code = req_build_prompt(k, r, g, msg, sizeof(msg));
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
        code = req_admit_window(k, r, g, msg, sizeof(msg));
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
    if (code == 0 && has_tenant && r->tenant < 0 && (r->tenant = req_tenant_add(k, tname, tlen)) < 0) {
        snprintf(msg, sizeof(msg), "kvd serves %u tenants with requests or blocks now (--max-tenants)",
                 k->o.max_tenants);
        code = KVD__ERROR_CODE__ERR_OVERLOADED;
    }
    r->ps.owner = (uint16_t)(r->tenant + 1);    /* its blocks count for its tenant (0: none) */
    tn = req_tenant_of(k, r);
    if (code != 0) {
        k->st.bad_messages += code == KVD__ERROR_CODE__ERR_BAD_REQUEST;
        req_reply_error_after(k, rid, rid_len, id, code, msg[0] ? msg : "cannot take the request",
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
        req_reply_error_after(k, rid, rid_len, id, code, msg, 0);
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
        req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory", 0);
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
            req_reply_error_after(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory", 0);
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
            req_reply_error_after(k, rid, rid_len, id, code, msg, 0);
            req_free(r);
            return;
        }
    }
    r->deadline = g->has_deadline_ms && g->deadline_ms ? r->t_arrival + g->deadline_ms : 0;
    r->seq_id = ++k->next_seq;
    r->state = REQ_QUEUED;
    req_list_append(&k->queue, r);
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
    req_reply(k, rid, rid_len, id, &m);
    req_dispatch(k);
}
