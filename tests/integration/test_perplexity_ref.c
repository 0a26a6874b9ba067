/*
 * test_perplexity_ref.c - `kvd-run --perplexity` on the committed text with
 * the default model lands within 1% of llama.cpp's perplexity on the same
 * text and window (tests/data/ppl_ref.txt, made by scripts/make_reference.py).
 */
#include <math.h>
#include <string.h>

#include "check.h"
#include "testutil.h"

/* The reference value for a window, flash attention off (llama.cpp's default here). */
static double reference(int ctx)
{
    FILE *f = fopen(KVD_TEST_DATA "/ppl_ref.txt", "r");
    REQUIRE(f != NULL);
    char line[512];
    double v = -1;
    while (fgets(line, sizeof(line), f)) {
        int c;
        double p;
        if (sscanf(line, "ctx %d windows %*d tokens_scored %*d ppl %lf", &c, &p) == 2 && c == ctx &&
            strstr(line, " fa ") == NULL)
            v = p;
    }
    fclose(f);
    return v;
}

int main(void)
{
    const double want = reference(512);
    REQUIRE(want > 1.0);
    char *argv[] = { KVD_BIN_DIR "/kvd-run", "-m", KVD_TEST_MODEL, "--perplexity",
                     KVD_TEST_DATA "/ppl_text.txt", "--ctx", "512", "--json", NULL };
    char *out;
    int rc = tu_run(argv, &out, NULL);
    CHECK_INT(rc, 0);
    const char *p = strstr(out, "\"perplexity\":");
    REQUIRE(p != NULL);
    double got = strtod(p + strlen("\"perplexity\":"), NULL);
    const char *w = strstr(out, "\"windows\":");
    REQUIRE(w != NULL);
    fprintf(stderr, "perplexity: kvd %.4f, llama.cpp %.4f, ratio %.5f\n", got, want, got / want);
    CHECK_INT(atoi(w + strlen("\"windows\":")), 6);
    CHECK(fabs(got / want - 1.0) < 0.01);
    free(out);
    return CHECK_DONE();
}
