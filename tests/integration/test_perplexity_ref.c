/*
 * test_perplexity_ref.c - `kvd-run --perplexity` on the committed text with
 * the default model lands within 1% of llama.cpp's perplexity on the same
 * text and window (tests/data/ppl_ref.txt, made by scripts/make_reference.py).
 *
 * A second model family: --model, --model-env, --fetch, --data DIR (its
 * ppl_ref.txt), --ctx N (the window), --windows N, --extra FILE (a text that
 * follows ppl_text.txt after a newline, as make_reference.py joined them).
 */
#include <math.h>
#include <string.h>

#include "check.h"
#include "testutil.h"

/* The reference value for a window, flash attention off (llama.cpp's default here). */
static double reference(const char *data, int ctx)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/ppl_ref.txt", data);
    FILE *f = fopen(path, "r");
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

/* ppl_text.txt, a newline and extra, in a temporary file (the caller unlinks it). */
static void joined_text(const char *extra, char *path, size_t len)
{
    snprintf(path, len, "/tmp/kvd-ppl-XXXXXX");
    int fd = mkstemp(path);
    REQUIRE(fd >= 0);
    FILE *out = fdopen(fd, "w");
    const char *parts[2] = { KVD_TEST_DATA "/ppl_text.txt", extra };
    for (int i = 0; i < 2; i++) {
        FILE *in = fopen(parts[i], "r");
        REQUIRE(in != NULL);
        char buf[8192];
        size_t n;
        while ((n = fread(buf, 1, sizeof(buf), in)) > 0)
            REQUIRE(fwrite(buf, 1, n, out) == n);
        fclose(in);
        if (i == 0)
            fputc('\n', out);
    }
    REQUIRE(fclose(out) == 0);
}

int main(int argc, char **argv)
{
    struct tu_ref ref = { KVD_TEST_MODEL, NULL, NULL, KVD_TEST_DATA };
    const char *ctx = "512", *extra = NULL;
    int windows = 6;
    for (int i = 1; i < argc; i++) {
        if (tu_ref_arg(&ref, argc, argv, &i))
            continue;
        if (i + 1 < argc && strcmp(argv[i], "--ctx") == 0)
            ctx = argv[++i];
        else if (i + 1 < argc && strcmp(argv[i], "--windows") == 0)
            windows = atoi(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "--extra") == 0)
            extra = argv[++i];
        else {
            fprintf(stderr, "%s: unknown argument %s\n", argv[0], argv[i]);
            return 2;
        }
    }
    if (!tu_ref_ready(&ref))
        return 1;
    const double want = reference(ref.data, atoi(ctx));
    REQUIRE(want > 1.0);
    char text[4096] = KVD_TEST_DATA "/ppl_text.txt";
    char joined[64];
    if (extra != NULL) {
        joined_text(extra, joined, sizeof(joined));
        snprintf(text, sizeof(text), "%s", joined);
    }
    char *args[] = { KVD_BIN_DIR "/kvd-run", "-m", (char *)ref.model, "--perplexity", text, "--ctx", (char *)ctx,
                     "--json", "--kv-type", "f16", NULL };   /* llama.cpp's cache, not this CPU's auto */
    char *out;
    int rc = tu_run(args, &out, NULL);
    if (extra != NULL)
        unlink(joined);
    CHECK_INT(rc, 0);
    const char *p = strstr(out, "\"perplexity\":");
    REQUIRE(p != NULL);
    double got = strtod(p + strlen("\"perplexity\":"), NULL);
    const char *w = strstr(out, "\"windows\":");
    REQUIRE(w != NULL);
    fprintf(stderr, "perplexity: kvd %.4f, llama.cpp %.4f, ratio %.5f\n", got, want, got / want);
    CHECK_INT(atoi(w + strlen("\"windows\":")), windows);
    CHECK(fabs(got / want - 1.0) < 0.01);
    free(out);
    return CHECK_DONE();
}
