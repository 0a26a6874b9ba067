/*
 * test_serve_cache_ref.c - kvd serves prompts from its prefix cache, and the
 * cache changes no output: real kvd and kvd-worker processes, the default
 * model, the C client over ipc://.
 *
 * 1. Two sessions with the same ~1,000-token system prompt and different
 *    questions: the second reports exactly the full blocks of the prefix the
 *    two prompts share as cached (at least the system prompt's full blocks),
 *    and its greedy output equals that of the same request with the cache
 *    bypassed (no_cache), which reports nothing cached. The next turn of the
 *    first session finds its history cached, generated tokens included.
 *    The same once more over a pool of quantized, rotated blocks (K q8_0, V
 *    q4_0), and over bf16 blocks: the cached and the uncached request still
 *    return the same tokens, and the stats name the types and their bytes
 *    per token.
 * 2. 32 concurrent clients (4 system prompts x 8 questions, two workers):
 *    every request completes, and its tokens equal those of the same request
 *    run alone; requests that share a system prompt compute it once (the
 *    others wait for its blocks, then find them cached), and a namespace
 *    shares nothing with another.
 *
 * The expected prompt tokens are computed here with the model's tokenizer and
 * chat template, as kvd computes them.
 */
#include <pthread.h>
#include <string.h>

#include "chat.h"
#include "check.h"
#include "model.h"
#include "serve.h"
#include "tok.h"

#define BLOCK 16
#define MAX_PROMPT 4096

static model_t *model;
static tok_t *tok;
static chat_template_t *chat;

static void load_tokenizer(void)
{
    char err[256];
    model = model_load(KVD_TEST_MODEL, err, sizeof(err));
    if (model == NULL)
        fprintf(stderr, "%s\n", err);
    REQUIRE(model != NULL);
    tok = tok_new_from_gguf(model->gguf, err, sizeof(err));
    REQUIRE(tok != NULL);
    struct gguf_str tmpl;
    REQUIRE(gguf_get_str(model->gguf, "tokenizer.chat_template", &tmpl) == 0);
    chat = chat_template_new(tmpl.ptr, (size_t)tmpl.len, err, sizeof(err));
    REQUIRE(chat != NULL);
}

/* The prompt tokens kvd makes of a chat (template, BOS when the model wants
 * one, special tokens parsed); returns the count. */
static size_t chat_tokens(const struct kvd_chat_msg *m, size_t n, bool gen_prompt, int32_t *out)
{
    struct chat_msg cm[8];
    REQUIRE(n <= 8);
    for (size_t i = 0; i < n; i++)
        cm[i] = (struct chat_msg){ m[i].role, m[i].content };
    char *text;
    size_t len, n_ids;
    REQUIRE(chat_apply(chat, cm, n, gen_prompt, &text, &len) == 0);
    bool bos = tok_add_bos(tok);
    REQUIRE(tok_encode(tok, text, len, true, out + bos, MAX_PROMPT - bos, &n_ids) == 0);
    if (bos)
        out[0] = tok_bos(tok);
    free(text);
    return n_ids + bos;
}

static size_t common_prefix(const int32_t *a, size_t na, const int32_t *b, size_t nb)
{
    size_t i = 0;
    while (i < na && i < nb && a[i] == b[i])
        i++;
    return i;
}

static bool same_tokens(const struct kvd_result *a, const struct kvd_result *b)
{
    return a->n_tokens == b->n_tokens &&
           (a->n_tokens == 0 || memcmp(a->tokens, b->tokens, a->n_tokens * sizeof(int32_t)) == 0);
}

static void print_tokens(const char *what, const struct kvd_result *r)
{
    fprintf(stderr, "%s (%zu):", what, r->n_tokens);
    for (size_t i = 0; i < r->n_tokens; i++)
        fprintf(stderr, " %d", r->tokens[i]);
    fprintf(stderr, "  \"%s\"\n", r->text ? r->text : "");
}

/* Runs a greedy chat request; REQUIREs success. */
static void chat_greedy(kvd_client_t *c, const struct kvd_chat_msg *m, size_t n, uint32_t max_tokens,
                        const char *ns, bool no_cache, struct kvd_result *out)
{
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.messages = m;
    p.n_messages = n;
    p.max_tokens = max_tokens;
    p.temperature = 0;
    p.ns = ns;
    p.no_cache = no_cache;
    int rc = kvd_generate(c, &p, out);
    if (rc != 0)
        fprintf(stderr, "generate: %s: %s\n", kvd_strerror(rc), out->error);
    REQUIRE(rc == 0);
}

/* ---- 1. a shared system prompt ----------------------------------------------------- */

static void shared_system_prompt(const char *k_type, const char *v_type)
{
    struct sv_kvd *k = sv_start((const char *[]){ "--workers", "1", "--kv-memory", "48MiB",
                                                  "--ctx", "2048", "--worker-timeout",
                                                  SV_WORKER_TIMEOUT, "--k-type", k_type,
                                                  "--v-type", v_type, NULL });
    fprintf(stderr, "== K %s, V %s\n", k_type, v_type);
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);

    /* a system prompt of about 1,000 tokens */
    char *sys = sv_slice(0, 4900);
    static int32_t ta[MAX_PROMPT], tb[MAX_PROMPT], ts[MAX_PROMPT];
    size_t n_sys_text;
    REQUIRE(tok_encode(tok, sys, strlen(sys), false, ts, MAX_PROMPT, &n_sys_text) == 0);
    fprintf(stderr, "system prompt: %zu bytes, %zu tokens\n", strlen(sys), n_sys_text);
    REQUIRE(n_sys_text >= 900 && n_sys_text <= 1150);

    struct kvd_chat_msg a[2] = { { "system", sys }, { "user", "Summarize the text above in one sentence." } };
    struct kvd_chat_msg b[2] = { { "system", sys }, { "user", "Which people does the text name?" } };
    size_t na = chat_tokens(a, 2, true, ta), nb = chat_tokens(b, 2, true, tb);
    size_t shared = common_prefix(ta, na, tb, nb);
    size_t n_sys = chat_tokens(a, 1, false, ts); /* the template's system turn alone */
    CHECK_INT(common_prefix(ts, n_sys, ta, na), n_sys);
    fprintf(stderr, "prompts: %zu and %zu tokens, %zu shared; the system turn is %zu tokens\n",
            na, nb, shared, n_sys);
    REQUIRE(shared >= n_sys && shared < na && shared < nb);

    /* the first session computes everything */
    struct kvd_result ra, rb, rc_, rd;
    chat_greedy(c, a, 2, 16, NULL, false, &ra);
    print_tokens("session 1", &ra);
    CHECK_INT(ra.prompt_tokens, na);
    CHECK_INT(ra.cached_prompt_tokens, 0);
    CHECK_INT(ra.n_tokens, ra.completion_tokens);
    CHECK(ra.n_tokens > 0);

    /* the second finds the shared full blocks cached */
    chat_greedy(c, b, 2, 16, NULL, false, &rb);
    print_tokens("session 2", &rb);
    fprintf(stderr, "session 2: %u prompt tokens, %u cached, ttft %.0f ms (session 1: %.0f ms)\n",
            rb.prompt_tokens, rb.cached_prompt_tokens, rb.ttft_ms, ra.ttft_ms);
    CHECK_INT(rb.prompt_tokens, nb);
    CHECK_INT(rb.cached_prompt_tokens, shared / BLOCK * BLOCK);
    CHECK(rb.cached_prompt_tokens >= n_sys / BLOCK * BLOCK);

    /* the same request with the cache bypassed: nothing cached, the same output */
    chat_greedy(c, b, 2, 16, NULL, true, &rc_);
    print_tokens("session 2, no cache", &rc_);
    CHECK_INT(rc_.prompt_tokens, nb);
    CHECK_INT(rc_.cached_prompt_tokens, 0);
    CHECK(same_tokens(&rb, &rc_));
    CHECK(strcmp(rb.text, rc_.text) == 0);
    CHECK_INT(rb.finish_reason, rc_.finish_reason);

    /* and once more from the cache: all of its full blocks now, the same output */
    chat_greedy(c, b, 2, 16, NULL, false, &rd);
    fprintf(stderr, "session 2 again: %u cached\n", rd.cached_prompt_tokens);
    CHECK(rd.cached_prompt_tokens >= (nb - 1) / BLOCK * BLOCK);
    CHECK(rd.cached_prompt_tokens < nb);
    CHECK(same_tokens(&rb, &rd));

    /* the next turn of session 1 reuses its history, generated tokens included:
     * every full block of what session 1 wrote (its prompt and all but the
     * last generated token) that the new prompt starts with */
    struct kvd_chat_msg turn[4] = { a[0], a[1], { "assistant", ra.text },
                                    { "user", "And in one word?" } };
    static int32_t tt[MAX_PROMPT], hist[MAX_PROMPT];
    size_t nt = chat_tokens(turn, 4, true, tt);
    memcpy(hist, ta, na * sizeof(int32_t));
    memcpy(hist + na, ra.tokens, ra.n_tokens * sizeof(int32_t));
    size_t reuse = common_prefix(hist, na + ra.n_tokens - 1, tt, nt);
    struct kvd_result re;
    chat_greedy(c, turn, 4, 8, NULL, false, &re);
    fprintf(stderr, "next turn: %u prompt tokens, %u cached (%zu of session 1's history reusable)\n",
            re.prompt_tokens, re.cached_prompt_tokens, reuse);
    CHECK_INT(re.prompt_tokens, nt);
    CHECK_INT(re.cached_prompt_tokens, reuse / BLOCK * BLOCK);
    CHECK(re.cached_prompt_tokens > na / BLOCK * BLOCK); /* beyond session 1's prompt */
    struct kvd_result rf;
    chat_greedy(c, turn, 4, 8, NULL, true, &rf);
    CHECK(same_tokens(&re, &rf));

    struct kvd_stats s;
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    sv_print_stats("after the sessions", &s);
    /* the pool's types, and their bytes: 30 layers x 3 KV heads x (K row + V row) */
    char want[48];
    const bool quant = strstr(k_type, "q") == k_type || strstr(v_type, "q") == v_type;   /* q8_0, q4_0: rotated */
    snprintf(want, sizeof(want), "K %s, V %s%s", k_type, v_type, quant ? ", rotated K+V" : "");
    fprintf(stderr, "kv: %s, %llu bytes per token\n", s.kv_type, (unsigned long long)s.kv_bytes_per_token);
    CHECK(strcmp(s.kv_type, want) == 0);
    const uint64_t row[2] = { strcmp(k_type, "q8_0") == 0 ? 68u : strcmp(k_type, "q4_0") == 0 ? 36u : 128u,
                              strcmp(v_type, "q8_0") == 0 ? 68u : strcmp(v_type, "q4_0") == 0 ? 36u : 128u };
    CHECK_INT(s.kv_bytes_per_token, 30 * 3 * (row[0] + row[1]));
    CHECK_INT(s.block_bytes, 16 * s.kv_bytes_per_token);
    CHECK_INT(s.requests_done, 6);
    CHECK_INT(s.requests_failed, 0);
    CHECK_INT(s.prompt_tokens, na + 3 * nb + 2 * nt);
    CHECK_INT(s.cached_prompt_tokens,
              rb.cached_prompt_tokens + rd.cached_prompt_tokens + re.cached_prompt_tokens);
    CHECK_INT(s.completion_tokens, ra.n_tokens + rb.n_tokens + rc_.n_tokens + rd.n_tokens +
                                   re.n_tokens + rf.n_tokens);

    kvd_stats_free(&s);
    kvd_result_free(&re);
    kvd_result_free(&rf);
    kvd_result_free(&ra);
    kvd_result_free(&rb);
    kvd_result_free(&rc_);
    kvd_result_free(&rd);
    kvd_client_destroy(&c);
    free(sys);
    CHECK_INT(sv_stop(k, SV_WAIT_MS), 0);
}

/* ---- 2. 32 concurrent clients ------------------------------------------------------ */

#define N_SYS 4
#define N_Q 8
#define N_REQ (N_SYS * N_Q)
#define GEN 10

static const char *questions[N_Q] = {
    "What is this about?",
    "Summarize it in five words.",
    "Who wrote it, do you think?",
    "Give it a title.",
    "Is the tone formal or casual?",
    "Name one fact it states.",
    "Translate the first sentence into French.",
    "List three keywords.",
};

struct job {
    const struct sv_kvd *k;
    pthread_barrier_t *start;
    struct kvd_chat_msg m[2];
    const char *ns;
    int rc;
    struct kvd_result r;
};

static void *burst_client(void *arg)
{
    struct job *j = arg;
    char err[256];
    kvd_client_t *c = kvd_client_new(j->k->ep, SV_WAIT_MS, err, sizeof(err));
    pthread_barrier_wait(j->start);
    if (c == NULL) {
        j->rc = KVD_ENOMEM;
        return NULL;
    }
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.messages = j->m;
    p.n_messages = 2;
    p.max_tokens = GEN;
    p.temperature = 0;
    p.ns = j->ns;
    j->rc = kvd_generate(c, &p, &j->r);
    kvd_client_destroy(&c);
    return NULL;
}

static void concurrent_clients(void)
{
    struct sv_kvd *k = sv_start((const char *[]){ "--workers", "2", "--kv-memory", "48MiB",
                                                  "--ctx", "1024", "--worker-timeout",
                                                  SV_WORKER_TIMEOUT, NULL });
    char *sys[N_SYS];
    for (int g = 0; g < N_SYS; g++)
        sys[g] = sv_slice(6000 + (size_t)g * 1700, 450);

    static struct job jobs[N_REQ];
    static struct kvd_result solo[N_REQ];
    static int32_t toks[N_REQ][MAX_PROMPT];
    size_t n_toks[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        jobs[i].k = k;
        jobs[i].m[0] = (struct kvd_chat_msg){ "system", sys[i / N_Q] };
        jobs[i].m[1] = (struct kvd_chat_msg){ "user", questions[i % N_Q] };
        n_toks[i] = chat_tokens(jobs[i].m, 2, true, toks[i]);
    }
    /* the prefix each request shares with the others of its system prompt */
    size_t shared[N_SYS];
    for (int g = 0; g < N_SYS; g++) {
        shared[g] = n_toks[g * N_Q];
        for (int q = 1; q < N_Q; q++) {
            size_t s = common_prefix(toks[g * N_Q], n_toks[g * N_Q], toks[g * N_Q + q],
                                     n_toks[g * N_Q + q]);
            if (s < shared[g])
                shared[g] = s;
        }
        fprintf(stderr, "system prompt %d: %zu tokens shared by its requests\n", g, shared[g]);
        REQUIRE(shared[g] >= 4 * BLOCK);
    }

    /* each request alone, one after another */
    double t0 = sv_now_ms();
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);
    for (int i = 0; i < N_REQ; i++) {
        chat_greedy(c, jobs[i].m, 2, GEN, "solo", false, &solo[i]);
        CHECK_INT(solo[i].prompt_tokens, n_toks[i]);
        CHECK(solo[i].n_tokens > 0);
    }
    kvd_client_destroy(&c);
    double t_solo = sv_now_ms() - t0;

    /* all at once, in a namespace of their own (so that nothing is cached yet) */
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, N_REQ + 1);
    pthread_t th[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        jobs[i].start = &start;
        jobs[i].ns = "burst";
        REQUIRE(pthread_create(&th[i], NULL, burst_client, &jobs[i]) == 0);
    }
    pthread_barrier_wait(&start);
    t0 = sv_now_ms();
    for (int i = 0; i < N_REQ; i++)
        pthread_join(th[i], NULL);
    double t_burst = sv_now_ms() - t0;
    pthread_barrier_destroy(&start);
    fprintf(stderr, "32 requests: %.0f ms one at a time, %.0f ms at once\n", t_solo, t_burst);

    int n_done = 0, n_equal = 0;
    int hits[N_SYS] = { 0 }, misses[N_SYS] = { 0 };
    for (int i = 0; i < N_REQ; i++) {
        struct job *j = &jobs[i];
        if (j->rc != 0) {
            fprintf(stderr, "request %d: %s: %s\n", i, kvd_strerror(j->rc), j->r.error);
            continue;
        }
        n_done++;
        if (same_tokens(&j->r, &solo[i])) {
            n_equal++;
        } else {
            fprintf(stderr, "request %d differs from its solo run:\n", i);
            print_tokens("  solo", &solo[i]);
            print_tokens("  concurrent", &j->r);
        }
        CHECK_INT(j->r.prompt_tokens, n_toks[i]);
        if (j->r.cached_prompt_tokens >= shared[i / N_Q] / BLOCK * BLOCK)
            hits[i / N_Q]++;
        if (j->r.cached_prompt_tokens == 0)
            misses[i / N_Q]++;
    }
    CHECK_INT(n_done, N_REQ);
    CHECK_INT(n_equal, N_REQ);
    /* a system prompt is computed once (by one request: the "solo" namespace
     * that has it cached is not this one), and the other 7 requests of it
     * wait for its blocks and find them cached */
    for (int g = 0; g < N_SYS; g++) {
        fprintf(stderr, "system prompt %d: %d of %d requests found it cached, %d nothing\n", g,
                hits[g], N_Q, misses[g]);
        CHECK_INT(hits[g], N_Q - 1);
        CHECK_INT(misses[g], 1);
    }

    struct kvd_stats s;
    CHECK(sv_wait_idle(k, &s, SV_WAIT_MS));
    sv_print_stats("after the burst", &s);
    CHECK_INT(s.requests_done, 2 * N_REQ);
    CHECK_INT(s.requests_failed, 0);
    CHECK_INT(s.n_workers, 2);
    for (uint32_t w = 0; w < s.n_workers; w++) {
        CHECK(s.workers[w].alive);
        CHECK_INT(s.workers[w].restarts, 0);
        CHECK(s.workers[w].tokens > 0); /* both workers took part */
    }
    kvd_stats_free(&s);

    for (int i = 0; i < N_REQ; i++) {
        kvd_result_free(&jobs[i].r);
        kvd_result_free(&solo[i]);
    }
    for (int g = 0; g < N_SYS; g++)
        free(sys[g]);
    CHECK_INT(sv_stop(k, SV_WAIT_MS), 0);
}

int main(void)
{
    REQUIRE(access(KVD_TEST_MODEL, R_OK) == 0);
    load_tokenizer();
    double t0 = sv_now_ms();
    shared_system_prompt("f16", "f16");
    fprintf(stderr, "shared system prompt: %.1f s\n", (sv_now_ms() - t0) / 1e3);
    t0 = sv_now_ms();
    shared_system_prompt("q8_0", "q4_0");
    fprintf(stderr, "shared system prompt over q8_0 / q4_0 blocks: %.1f s\n", (sv_now_ms() - t0) / 1e3);
    t0 = sv_now_ms();
    shared_system_prompt("bf16", "bf16");
    fprintf(stderr, "shared system prompt over bf16 blocks: %.1f s\n", (sv_now_ms() - t0) / 1e3);
    t0 = sv_now_ms();
    concurrent_clients();
    fprintf(stderr, "concurrent clients: %.1f s\n", (sv_now_ms() - t0) / 1e3);
    chat_template_destroy(&chat);
    tok_destroy(&tok);
    model_destroy(&model);
    sv_pass();
    return CHECK_DONE();
}
