/*
 * test_tokenizer_ref.c - the tokenizer of the default model against token ids
 * that llama.cpp produced (tests/data/tok_vectors.tsv, made by
 * scripts/make_reference.py): every string, with and without special-token
 * parsing, must give exactly the same ids; decoding gives the text back.
 */
#include <string.h>

#include "check.h"
#include "gguf.h"
#include "testutil.h"
#include "tok.h"

int main(void)
{
    char err[512];
    gguf_ctx_t *g = gguf_open(KVD_TEST_MODEL, err, sizeof(err));
    if (g == NULL) {
        fprintf(stderr, "%s (run scripts/fetch-model.sh)\n", err);
        return 1;
    }
    tok_t *t = tok_new_from_gguf(g, err, sizeof(err));
    if (t == NULL)
        fprintf(stderr, "%s\n", err);
    REQUIRE(t != NULL);
    FILE *f = fopen(KVD_TEST_DATA "/tok_vectors.tsv", "r");
    REQUIRE(f != NULL);
    char *line = NULL;
    size_t cap = 0;
    int cases = 0, mismatches = 0, roundtrips = 0;
    int32_t want[4096], got[4096];
    while (tu_getline(f, &line, &cap)) {
        if (line[0] == '#' || line[0] == '\0')
            continue;
        char *fl[3];
        REQUIRE(tu_fields(line, fl, 3) == 3);
        size_t len;
        char *text = tu_unescape(fl[0], strlen(fl[0]), &len);
        REQUIRE(text != NULL);
        bool special = fl[1][0] == '1';
        size_t nw = tu_ids(fl[2], want, 4096), ng = 0;
        int rc = tok_encode(t, text, len, special, got, 4096, &ng);
        CHECK_INT(rc, 0);
        cases++;
        if (ng != nw || memcmp(want, got, nw * sizeof(int32_t)) != 0) {
            mismatches++;
            fprintf(stderr, "MISMATCH special=%d text='%s'\n  want:", special, fl[0]);
            for (size_t i = 0; i < nw; i++)
                fprintf(stderr, " %d", want[i]);
            fprintf(stderr, "\n  got: ");
            for (size_t i = 0; i < ng; i++)
                fprintf(stderr, " %d", got[i]);
            fprintf(stderr, "\n");
        }
        /* decoding the ids gives the text back, unless llama.cpp itself
         * replaced invalid UTF-8 by U+FFFD */
        if (strstr(fl[0], "\\x") == NULL || memmem(text, len, "\xef\xbf\xbd", 3) != NULL) {
            char buf[16384];
            size_t n = 0;
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
    fprintf(stderr, "%d tokenizer cases, %d mismatches, %d round trips\n", cases, mismatches, roundtrips);
    CHECK(cases >= 200);
    CHECK_INT(mismatches, 0);
    tok_destroy(&t);
    gguf_close(&g);
    return CHECK_DONE();
}
