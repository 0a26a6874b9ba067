/*
 * output.c - a running request's worker reports turned into the client's
 * answer.
 *
 * Commits make blocks reusable; token chunks are detokenized, checked for
 * stop strings and streamed as whole UTF-8 characters; Done lets go of the
 * sequence, after which its blocks are released and the client gets its
 * Final. A dead worker's sequences resume elsewhere from the tokens already
 * streamed, so the client sees one uninterrupted stream.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvd.h"
#include "pins.h"
#include "req_internal.h"
#include "hosts.h"
#include "workers.h"

/* ---- output ---------------------------------------------------------------------------------- */

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
    if (req_reply(k, r->rid, r->rid_len, r->client_id, &m) != 0)
        r->rid_len = 0; /* the client is gone: nothing more is sent */
    free(txt);
    free(c.logprobs);
    r->sent = upto > r->sent ? upto : r->sent;
    r->sent_tokens = n_gen;
}

void req_finish(struct kvd *k, struct request *r)
{
    static char empty_str[1];
    double now = cli_now_ms();
    uint32_t n_gen = r->n_tok - r->n_prompt;
    req_observe(k, r, now, n_gen);
    if (r->failed) {
        k->st.failed++;
        if (r->rid_len)
            req_reply_error_after(k, r->rid, r->rid_len, r->client_id, r->fail_code, r->fail_msg, 0);
    } else {
        k->st.done++;
        if (r->text != NULL && req_text_validate(r, false) == 0) {
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
        if (req_tenant_of(k, r) != NULL)
            req_tenant_of(k, r)->cache_creation_tokens += created;
        Kvd__Pin pin = KVD__PIN__INIT;
        if (r->pin_id[0]) {
            pin.id = r->pin_id;
            pin.tenant = req_tenant_of(k, r) != NULL ? req_tenant_of(k, r)->name : empty_str;
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
            req_reply(k, r->rid, r->rid_len, r->client_id, &m);
        free(f.logprobs);
        free(f.prompt_logprobs);
    }
    k->st.completion_tokens += n_gen;
    req_free(r);
}

int kvd_utf8_seq(const unsigned char *s, size_t n, size_t *len)
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

int req_text_validate(struct request *r, bool all)
{
    size_t bad = 0, i = r->valid, len;
    const unsigned char *t = (const unsigned char *)r->text;
    for (; i < r->text_len; i++) {      /* count first: each bad byte grows by 2 */
        const int v = t[i] ? kvd_utf8_seq(t + i, r->text_len - i, &len) : -1;
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
        const int v = *u ? kvd_utf8_seq(u, tail - s, &len) : -1;
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

int req_append_text(struct request *r, const char *s, size_t n)
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
    return req_text_validate(r, false);
}

/* ---- stopping requests ----------------------------------------------------------------------- */

void req_send_cancel(struct kvd *k, struct request *r)
{
    Kvdw__ToWorker m = KVDW__TO_WORKER__INIT;
    Kvdw__Cancel c = KVDW__CANCEL__INIT;
    c.has_seq_id = true;
    c.seq_id = r->seq_id;
    m.body_case = KVDW__TO_WORKER__BODY_CANCEL;
    m.cancel = &c;
    workers_send(k, r->worker, &m);
}

void req_stop(struct kvd *k, struct request *r, int why, int fail_code, const char *msg)
{
    if (fail_code) {
        r->failed = true;
        r->fail_code = fail_code;
        snprintf(r->fail_msg, sizeof(r->fail_msg), "%s", msg ? msg : "");
    }
    if (!r->finish)
        r->finish = why;
    if (r->state == REQ_QUEUED || r->state == REQ_WAITING) {
        prefix_seq_release(req_px(k, r), &r->ps);     /* a prefix back from the tiers */
        req_dequeue(k, r);
        req_finish(k, r);
    } else if (r->state == REQ_RESTORING) {
        /* finishes when its copies are done (its blocks are theirs until then) */
    } else if (r->state == REQ_RUNNING) {
        r->state = REQ_STOPPING;
        req_send_cancel(k, r);  /* finishes on Done (or when the worker is lost) */
    }
}

/* ---- worker reports ------------------------------------------------------------------------------ */

struct request *req_from_worker(struct kvd *k, int w, uint64_t seq_id)
{
    struct request *r = req_find_active(k, seq_id);
    if (r == NULL || r->worker != w) {
        k->st.bad_messages++;
        return NULL;
    }
    return r;
}

void req_commit(struct kvd *k, struct request *r, uint32_t n_written)
{
    if (n_written <= r->n_written || n_written > req_seq_n(r))
        return;
    if (r->worker >= 0)
        k->workers[r->worker].tokens += n_written - r->n_written; /* positions it computed */
    if (prefix_seq_commit(req_px(k, r), &r->ps, req_seq_tok(r), n_written) != 0)
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
    req_wake_waiters(k);
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
    struct request *r = req_from_worker(k, w, c->seq_id);
    if (r == NULL)
        return;
    req_window_settled(k, r);
    keep_prompt_logprobs(k, r, c);
    req_commit(k, r, c->n_written);
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
    struct request *r = req_from_worker(k, w, c->seq_id);
    if (r == NULL || r->state != REQ_RUNNING)
        return;
    req_window_settled(k, r);
    double now = cli_now_ms();
    for (size_t i = 0; i < n && r->state == REQ_RUNNING; i++) {
        const uint32_t V = k->model->cfg.n_vocab;
        if ((uint32_t)t[i] >= V || req_reserve_tokens(r, r->n_tok + 2) != 0 ||
            (r->logprobs >= 0 && keep_logprob(r, r->n_tok - r->n_prompt, c->logprobs, c->n_logprobs, i, V))) {
            req_stop(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "the worker sent a bad token");
            return;
        }
        r->tok[r->n_tok++] = t[i];
        if (r->wtok != NULL && req_wtok_push(r, t[i]) != 0) {
            req_stop(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory");
            return;
        }
        if (r->t_first == 0) {
            r->t_first = now;
            req_note_prefill_rate(k, r);
        }
        r->t_last = now;
        if (!r->ignore_eos && tok_is_eog(k->tok, t[i]))
            continue; /* the worker ends the sequence; no text */
        char piece[512];
        size_t pn = 0;
        if (tok_decode_piece(k->tok, t[i], piece, sizeof(piece), &pn) != 0)
            pn = 0;
        size_t before = r->text_len;
        req_append_text(r, piece, pn);
        for (size_t s = 0; s < r->n_stops; s++) {
            size_t sl = strlen(r->stops[s]);
            size_t from = before >= sl ? before - sl + 1 : 0;
            const char *hit = r->text_len ? strstr(r->text + from, r->stops[s]) : NULL;
            if (hit != NULL) {
                r->text_len = (size_t)(hit - r->text);
                r->text[r->text_len] = '\0';
                if (r->valid > r->text_len)
                    r->valid = r->text_len;
                req_stop(k, r, KVD__FINISH_REASON__FINISH_STOP, 0, NULL);
                break;
            }
        }
    }
    req_commit(k, r, c->n_written);
    if (r->state == REQ_RUNNING)
        stream_out(k, r, false);
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

void req_let_go(struct kvd *k, struct request *r, int reason, const char *error)
{
    req_list_remove(&k->active, r);
    k->n_active--;
    struct kvd_tenant *t = req_tenant_of(k, r);
    if (t != NULL && t->running > 0)
        t->running--;
    if (r->worker >= 0 && k->workers[r->worker].running > 0 && --k->workers[r->worker].running == 0)
        k->workers[r->worker].isolating = false;
    req_unstarve(k, r);
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
    prefix_seq_release(req_px(k, r), &r->ps);    /* (nothing when fenced: hosts_fence) */
    req_wake_waiters(k);
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
    req_finish(k, r);
}

void req_on_done(struct kvd *k, int w, uint64_t seq_id, int reason, uint32_t n_written,
                 const char *error)
{
    struct request *r = req_from_worker(k, w, seq_id);
    if (r == NULL)
        return;
    if (reason != KVDW__DONE_REASON__DONE_ERROR)
        req_commit(k, r, n_written);
    req_let_go(k, r, reason, error);
    req_retry_leases(k);
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
            req_let_go(k, r, -1, NULL); /* resumes elsewhere unless it was stopping or failed */
        }
        r = next;
    }
    req_retry_leases(k);
    req_dispatch(k);
}
