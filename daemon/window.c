/*
 * window.c - context windowing (--context-overflow window, docs/models.md):
 * a sequence that reaches the context keeps its sinks and the newer half of
 * its blocks, and its worker re-rotates the kept keys (WindowRequest/Window).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvd.h"
#include "req_internal.h"
#include "workers.h"

void req_window_settled(struct kvd *k, struct request *r)
{
    if (r->ps.n_held > 0)
        prefix_window_done(req_px(k, r), &r->ps);
}

int req_wtok_push(struct request *r, int32_t t)
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

int req_admit_window(struct kvd *k, struct request *r, const Kvd__GenerateRequest *g, char *msg, size_t len)
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
    struct request *r = req_find_active(k, seq_id);
    if (r == NULL || r->worker != w || r->state != REQ_RUNNING)
        return;
    const uint32_t bt = k->o.block_tokens;
    uint32_t keep, drop;
    if (!r->window || n_written != r->n_written ||
        !kv_window_plan(n_written, k->o.sinks, bt, k->model->cfg.swa_window, &keep, &drop)) {
        k->st.bad_messages++;
        req_stop(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "the worker asked for a window out of turn");
        return;
    }
    const uint32_t d = drop * bt, kb = keep * bt;
    if (r->wtok == NULL) {
        /* the first window: the positions held the whole history so far */
        for (uint32_t i = 0; i < r->n_tok; i++)
            if (req_wtok_push(r, r->tok[i]) != 0) {
                req_stop(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory");
                return;
            }
        r->w_prompt = r->n_prompt;
    }
    req_window_settled(k, r);   /* (the worker spoke since the last one) */
    uint32_t (*copy)[2] = malloc((size_t)r->ps.n_blocks * (r->ps.n_parts ? r->ps.n_parts : 1) * sizeof(*copy));
    const int64_t nc = copy != NULL ? prefix_seq_window(req_px(k, r), &r->ps, keep, drop, copy) : KVD_ENOMEM;
    if (nc < 0) {
        free(copy);
        kvd_log(k, "request %llu: cannot window its context (%s): it ends there",
                (unsigned long long)r->seq_id, kvd_strerror((int)nc));
        req_stop(k, r, KVD__FINISH_REASON__FINISH_LENGTH, 0, NULL);
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
    if (from == NULL || to == NULL || (win.blocks = req_wire_blocks(&r->ps, 0, &win.n_blocks, &flat)) == NULL) {
        free(copy);
        free(from);
        free(to);
        req_stop(k, r, 0, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory");
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
