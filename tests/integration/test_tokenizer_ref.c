/*
 * test_tokenizer_ref.c - a model's tokenizer against token ids that llama.cpp
 * produced (made by scripts/make_reference.py): every string, with and without
 * special-token parsing, must give exactly the same ids; decoding gives the
 * text back, or, where the vectors carry a fourth column, exactly what
 * llama.cpp's detokenizer made of the ids.
 *
 *   test_tokenizer_ref                  the default model, tests/data/tok_vectors.tsv
 *   test_tokenizer_ref --model PATH --model-env VAR --fetch NAME --vectors FILE --min-cases N
 *
 * $VAR, when set, overrides PATH. A missing model fails the test, naming the
 * scripts/fetch-model.sh command that fetches it: the test is never skipped.
 */
#include <string.h>
#include <time.h>

#include "check.h"
#include "gguf.h"
#include "testutil.h"
#include "tok.h"

#define MAX_IDS 4096

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void print_ids(const char *what, const int32_t *ids, size_t n)
{
    fprintf(stderr, "  %s", what);
    for (size_t i = 0; i < n; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, "\n");
}

int main(int argc, char **argv)
{
    struct tu_ref ref = { KVD_TEST_MODEL, NULL, NULL, KVD_TEST_DATA };
    const char *vectors = KVD_TEST_DATA "/tok_vectors.tsv";
    int min_cases = 200;
    for (int i = 1; i < argc; i++) {
        if (tu_ref_arg(&ref, argc, argv, &i))
            continue;
        if (i + 1 < argc && strcmp(argv[i], "--vectors") == 0) {
            vectors = argv[++i];
        } else if (i + 1 < argc && strcmp(argv[i], "--min-cases") == 0) {
            min_cases = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: %s [--model PATH] [--model-env VAR] [--fetch NAME] "
                    "[--vectors FILE] [--min-cases N]\n", argv[0]);
            return 2;
        }
    }
    if (!tu_ref_ready(&ref))
        return 1;
    const char *model = ref.model, *fetch = ref.fetch;

    char err[512];
    double t0 = now_ms();
    gguf_ctx_t *g = gguf_open(model, err, sizeof(err));
    if (g == NULL) {
        fprintf(stderr, "%s (run scripts/fetch-model.sh%s%s)\n", err,
                fetch ? " --model " : "", fetch ? fetch : "");
        return 1;
    }
    double t1 = now_ms();
    tok_t *t = tok_new_from_gguf(g, err, sizeof(err));
    double t2 = now_ms();
    if (t == NULL)
        fprintf(stderr, "%s\n", err);
    REQUIRE(t != NULL);
    fprintf(stderr, "%s: %zu tokens; gguf_open %.1f ms, tok_new_from_gguf %.1f ms\n", model,
            tok_n_vocab(t), t1 - t0, t2 - t1);

    FILE *f = fopen(vectors, "r");
    if (f == NULL)
        fprintf(stderr, "cannot open %s\n", vectors);
    REQUIRE(f != NULL);
    char *line = NULL;
    size_t cap = 0;
    int cases = 0, mismatches = 0, roundtrips = 0, detoks = 0, same_text = 0;
    static int32_t want[MAX_IDS], got[MAX_IDS];
    double enc_ms = 0;
    size_t enc_bytes = 0;
    while (tu_getline(f, &line, &cap)) {
        if (line[0] == '#' || line[0] == '\0')
            continue;
        char *fl[4];
        int nf = tu_fields(line, fl, 4);
        REQUIRE(nf == 3 || nf == 4);
        size_t len;
        char *text = tu_unescape(fl[0], strlen(fl[0]), &len);
        REQUIRE(text != NULL);
        bool special = fl[1][0] == '1';
        size_t nw = tu_ids(fl[2], want, MAX_IDS), ng = 0;
        double e0 = now_ms();
        int rc = tok_encode(t, text, len, special, got, MAX_IDS, &ng);
        enc_ms += now_ms() - e0;
        enc_bytes += len;
        CHECK_INT(rc, 0);
        cases++;
        if (ng != nw || memcmp(want, got, nw * sizeof(int32_t)) != 0) {
            mismatches++;
            fprintf(stderr, "MISMATCH special=%d text='%s'\n", special, fl[0]);
            print_ids("want:", want, nw);
            print_ids("got: ", got, ng);
        }
        char buf[16384];
        size_t n = 0;
        if (nf == 4) {
            /* exactly what llama.cpp's detokenizer made of its ids */
            size_t dl;
            char *detok = tu_unescape(fl[3], strlen(fl[3]), &dl);
            REQUIRE(detok != NULL);
            CHECK_INT(tok_decode(t, got, ng, buf, sizeof(buf), &n), 0);
            bool same = n == dl && memcmp(buf, detok, dl) == 0;
            if (!same)
                fprintf(stderr, "DECODE differs from llama.cpp's for '%s'\n", fl[0]);
            CHECK(same);
            detoks++;
            same_text += n == len && memcmp(buf, text, len) == 0;
            free(detok);
        } else if (strstr(fl[0], "\\x") == NULL || memmem(text, len, "\xef\xbf\xbd", 3) != NULL) {
            /* decoding the ids gives the text back, unless llama.cpp itself
             * replaced invalid UTF-8 by U+FFFD */
            CHECK_INT(tok_decode(t, got, ng, buf, sizeof(buf), &n), 0);
            bool same = n == len && memcmp(buf, text, len) == 0;
            if (!same)
                fprintf(stderr, "ROUND TRIP differs for '%s'\n", fl[0]);
            CHECK(same);
            roundtrips++;
        }
        free(text);
    }
    free(line);
    fclose(f);
    fprintf(stderr, "%d tokenizer cases, %d mismatches, %d round trips", cases, mismatches,
            roundtrips);
    if (detoks > 0)
        fprintf(stderr, ", %d decoded as llama.cpp decodes (%d of them back to the text)", detoks,
                same_text);
    fprintf(stderr, "; encoding %zu bytes took %.2f ms\n", enc_bytes, enc_ms);
    CHECK(cases >= min_cases);
    CHECK_INT(mismatches, 0);
    tok_destroy(&t);
    gguf_close(&g);
    return CHECK_DONE();
}
