/*
 * bench_grammar.c - bench-grammar: what structured output costs per token.
 *
 * A nested schema (an order: a customer object with an enum, an array of
 * line items that are objects with strings, numbers, an enum and an array of
 * strings, free text, a date or a short text, a total) compiled once; a document that fits it,
 * tokenized by the model's tokenizer; then, at every token of the document,
 * the vocabulary mask from the state before it (grammar_mask), timed, and the
 * token checked to be in it before the state advances. Each position is
 * measured --runs times, the median kept. Reported per vocabulary: mean,
 * median, p90 and max of a mask, split between positions inside a JSON string
 * (most of the vocabulary allowed) and elsewhere; and, at a sample of
 * positions, the same mask by the definition (every token's bytes fed to a
 * copy of the state, grammar_mask_bruteforce) with the ratio.
 *
 * The models: SmolLM2 (49,152 tokens) and, where it is, Gemma 3 (262,144);
 * -m MODEL (repeatable) for others.
 *
 * Usage: bench-grammar [-m MODEL]... [--runs N]
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gguf.h"
#include "grammar.h"
#include "jschema.h"
#include "tok.h"

static const char schema[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"order_id\":{\"type\":\"string\",\"maxLength\":32},"
    "\"customer\":{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\"},"
    "\"tier\":{\"enum\":[\"gold\",\"silver\",\"bronze\"]},"
    "\"email\":{\"type\":\"string\"}},\"required\":[\"name\",\"tier\"]},"
    "\"items\":{\"type\":\"array\",\"minItems\":1,\"maxItems\":16,\"items\":{\"type\":\"object\",\"properties\":{"
    "\"sku\":{\"type\":\"string\"},"
    "\"qty\":{\"type\":\"integer\"},"
    "\"price\":{\"type\":\"number\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":4},"
    "\"status\":{\"enum\":[\"pending\",\"shipped\",\"backordered\",\"cancelled\"]}},"
    "\"required\":[\"sku\",\"qty\",\"price\",\"status\"]}},"
    "\"notes\":{\"type\":\"string\"},"
    "\"deliver\":{\"anyOf\":[{\"type\":\"string\",\"format\":\"date\"},{\"type\":\"string\",\"maxLength\":64}]},"
    "\"total\":{\"type\":\"number\"}},"
    "\"required\":[\"order_id\",\"customer\",\"items\",\"total\"]}";

static const char document[] =
    "{\"order_id\": \"A-20240611-0042\", \"customer\": {\"name\": \"Jane M\xc3\xbcller\", \"tier\": \"gold\", "
    "\"email\": \"jane.mueller@example.com\"}, \"items\": [{\"sku\": \"KB-104\", \"qty\": 2, \"price\": 49.95, "
    "\"tags\": [\"keyboard\", \"wireless\"], \"status\": \"shipped\"}, {\"sku\": \"MS-221\", \"qty\": 1, "
    "\"price\": 19.5, \"tags\": [], \"status\": \"backordered\"}, {\"sku\": \"CB-003\", \"qty\": 12, "
    "\"price\": 3.25, \"tags\": [\"cable\", \"usb-c\", \"1m\"], \"status\": \"pending\"}], "
    "\"notes\": \"Leave the parcel at the back door if nobody answers; call ahead on weekends. "
    "The invoice goes to the billing address, not this one.\", \"deliver\": \"2024-06-14 or later\", "
    "\"total\": 168.9}";

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

struct stats {
    double mean, median, p90, max;
    int n;
};

static struct stats summarize(double *v, int n)
{
    struct stats s = { 0 };
    if (n == 0)
        return s;
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += v[i];
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    s.mean = sum / n;
    s.median = v[n / 2];
    s.p90 = v[(n * 9) / 10 < n ? (n * 9) / 10 : n - 1];
    s.max = v[n - 1];
    s.n = n;
    return s;
}

static int bench_model(const char *path, const grammar_t *g, int runs)
{
    char err[256] = "";
    double t0 = now_us();
    gguf_ctx_t *gg = gguf_open(path, err, sizeof err);
    tok_t *t = gg ? tok_new_from_gguf(gg, err, sizeof err) : NULL;
    if (t == NULL) {
        fprintf(stderr, "bench-grammar: %s: %s\n", path, err);
        gguf_close(&gg);
        return 1;
    }
    double t1 = now_us();
    gtrie_t *trie = grammar_trie_new(t, err, sizeof err);
    double t2 = now_us();
    if (trie == NULL) {
        fprintf(stderr, "bench-grammar: %s\n", err);
        return 1;
    }
    (void)t0;
    (void)t1;
    size_t n_ids = 0, cap = 4096;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (ids == NULL || tok_encode(t, document, sizeof document - 1, false, ids, cap, &n_ids) != 0) {
        fprintf(stderr, "bench-grammar: tokenizing the document failed\n");
        return 1;
    }
    uint32_t nv = grammar_trie_n_vocab(trie), words = (nv + 31) / 32;
    uint32_t *mask = malloc(words * sizeof *mask), *brute = malloc(words * sizeof *brute);
    double *per = malloc((size_t)runs * sizeof *per);
    double *all = malloc((n_ids + 1) * sizeof *all), *in_str = malloc((n_ids + 1) * sizeof *in_str);
    double *out_str = malloc((n_ids + 1) * sizeof *out_str), *bf = malloc((n_ids + 1) * sizeof *bf);
    double *fast_at_bf = malloc((n_ids + 1) * sizeof *fast_at_bf);
    gstate_t *s = grammar_state_new(g);
    if (!mask || !brute || !per || !all || !in_str || !out_str || !bf || !fast_at_bf || !s)
        return 1;
    int n_all = 0, n_in = 0, n_out = 0, n_bf = 0, bad = 0;
    uint64_t allowed_sum = 0;
    bool in_string = false, escaped = false;
    for (size_t pos = 0; pos <= n_ids; pos++) {
        uint32_t n_allowed = 0;
        for (int r = 0; r < runs; r++) {
            double a = now_us();
            grammar_mask(s, trie, mask, &n_allowed);
            per[r] = now_us() - a;
        }
        qsort(per, (size_t)runs, sizeof *per, cmp_d);
        double us = per[runs / 2];
        if (getenv("BENCH_GRAMMAR_SLOW") && us > atof(getenv("BENCH_GRAMMAR_SLOW")))
            fprintf(stderr, "  %.0f us at token %zu (%u allowed)\n", us, pos, n_allowed);
        all[n_all++] = us;
        allowed_sum += n_allowed;
        if (in_string)
            in_str[n_in++] = us;
        else
            out_str[n_out++] = us;
        if (pos % 8 == 0) {
            double a = now_us();
            grammar_mask_bruteforce(s, trie, brute, NULL);
            bf[n_bf] = now_us() - a;
            fast_at_bf[n_bf++] = us;
            bad += memcmp(mask, brute, words * sizeof *mask) != 0;
        }
        int32_t id = pos < n_ids ? ids[pos] : tok_eos(t);
        if (!grammar_mask_has(mask, id)) {
            fprintf(stderr, "bench-grammar: the document's token %zu (id %d) is not in the mask\n", pos, id);
            return 1;
        }
        if (grammar_advance_token(s, trie, id) != 0) {
            fprintf(stderr, "bench-grammar: token %zu refused\n", pos);
            return 1;
        }
        /* inside a JSON string after this token? */
        char piece[512];
        size_t pn = 0;
        if (pos < n_ids && tok_decode_piece(t, id, piece, sizeof piece, &pn) == 0)
            for (size_t i = 0; i < pn; i++) {
                if (escaped)
                    escaped = false;
                else if (in_string && piece[i] == '\\')
                    escaped = true;
                else if (piece[i] == '"')
                    in_string = !in_string;
            }
    }
    double bf_sum = 0, fast_sum = 0;
    for (int i = 0; i < n_bf; i++) {
        bf_sum += bf[i];
        fast_sum += fast_at_bf[i];
    }
    struct stats A = summarize(all, n_all), I = summarize(in_str, n_in), O = summarize(out_str, n_out);
    const char *name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    printf("| %s | %u | %u | %.0f | %zu | %.1f | %.1f | %.1f | %.1f | %.1f (%d) | %.1f (%d) | %.0f | %.0fx%s |\n",
           name, nv, grammar_trie_n_nodes(trie), (t2 - t1) / 1e3, n_ids + 1, A.mean, A.median, A.p90,
           A.max, I.mean, I.n, O.mean, O.n, (double)allowed_sum / (double)n_all,
           fast_sum > 0 ? bf_sum / fast_sum : 0.0, bad ? " MISMATCH" : "");
    fflush(stdout);
    grammar_state_destroy(&s);
    free(ids);
    free(mask);
    free(brute);
    free(per);
    free(all);
    free(in_str);
    free(out_str);
    free(bf);
    free(fast_at_bf);
    grammar_trie_destroy(&trie);
    tok_destroy(&t);
    gguf_close(&gg);
    return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
    const char *models[16];
    int n_models = 0, runs = 5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc && n_models < 16)
            models[n_models++] = argv[++i];
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc)
            runs = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench-grammar [-m MODEL]... [--runs N]\n");
            return 2;
        }
    }
    if (runs < 1)
        runs = 1;
    if (n_models == 0) {
        models[n_models++] = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
        if (access("models/gemma-3-270m-q4_k_m.gguf", R_OK) == 0)
            models[n_models++] = "models/gemma-3-270m-q4_k_m.gguf";
    }
    char err[512] = "";
    double a = now_us();
    grammar_t *g = jschema_compile(schema, sizeof schema - 1, NULL, err, sizeof err);
    double b = now_us();
    if (g == NULL) {
        fprintf(stderr, "bench-grammar: %s\n", err);
        return 1;
    }
    printf("bench-grammar: a nested schema (%u states, compiled in %.2f ms), the mask at each of a "
           "document's tokens, medians of %d runs; times in microseconds\n",
           grammar_n_states(g), (b - a) / 1e3, runs);
    printf("| model | vocabulary | trie nodes | trie build (ms) | masks | mean | median | p90 | max "
           "| in strings: mean (n) | elsewhere: mean (n) | tokens allowed (mean) | by definition / mask |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    int rc = 0;
    for (int i = 0; i < n_models; i++)
        rc |= bench_model(models[i], g, runs);
    grammar_destroy(&g);
    return rc;
}
