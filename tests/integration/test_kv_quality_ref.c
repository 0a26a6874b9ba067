/*
 * test_kv_quality_ref.c - what quantized KV blocks cost the default model, in
 * the short form CI can afford (the full tables come from
 * bench/bench_kv_quality.sh):
 *
 * 1. KL divergence over two windows of 512 tokens of tests/data/ppl_text.txt
 *    (kvd-run --kl-divergence-base with the f16 cache, then --kl-divergence
 *    with each other type, rotated as by default): q8_0 within KLD_Q8, its
 *    most likely token the same at SAME_Q8 of the positions; q4_0 within
 *    KLD_Q4; and the rotation at least halves q4_0's divergence. For scale,
 *    measured on an AVX-512 machine: an f32 cache differs from the f16 one by
 *    0.0036, q8_0 by 0.0040 (0.0050 not rotated), q4_0 by 0.039 (0.137 not
 *    rotated).
 * 2. The greedy continuations of the ten committed chat prompts
 *    (tests/data/greedy_ref.tsv) over a q8_0 cache against the f16 cache's,
 *    first 16 tokens: where one parts, the f16 run's logit gap between its
 *    token and the q8_0 run's is printed and must be a near-tie (NEAR_TIE),
 *    and at least MIN_EQUAL of 10 must not part. This small model is full of
 *    near-ties: an f32 cache parts from the f16 one on 2 of the 10 (gaps
 *    0.025 and 0.099), q8_0 on 5 (gaps 0.06 to 0.29), and llama.cpp parts
 *    from itself on 6 when its flash attention is switched on
 *    (test_greedy_ref.c); the 9 of 10 one would like is out of reach here.
 */
#include <math.h>
#include <string.h>

#include "check.h"
#include "testutil.h"

#define KLD_Q8 0.012    /* mean KL divergence of q8_0/q8_0 */
#define SAME_Q8 92.0    /* % of positions with the f16 cache's top token, q8_0 */
#define KLD_Q4 0.09     /* mean KL divergence of q4_0/q4_0, rotated */
#define COMPARE 16      /* greedy tokens compared */
#define MIN_EQUAL 4     /* continuations of 10 that must not part at all */
#define NEAR_TIE 0.6    /* where one parts, the f16 run's logit gap must be below this */

static char dir[] = "/tmp/kvd-test-kvq-XXXXXX";

/* A number after "key": in a JSON object; NAN when absent. */
static double json_num(const char *json, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = strstr(json, pat);
    return p ? strtod(p + strlen(pat), NULL) : NAN;
}

/* kvd-run --perplexity over two windows of 512, with extra arguments. */
static char *perplexity(const char *kld_flag, const char *file, const char *const *extra)
{
    char *argv[24];
    int a = 0;
    argv[a++] = KVD_BIN_DIR "/kvd-run";
    argv[a++] = "-m";
    argv[a++] = KVD_TEST_MODEL;
    argv[a++] = "--perplexity";
    argv[a++] = KVD_TEST_DATA "/ppl_text.txt";
    argv[a++] = "--ctx";
    argv[a++] = "512";
    argv[a++] = "--chunks";
    argv[a++] = "2";
    argv[a++] = "--json";
    argv[a++] = (char *)kld_flag;
    argv[a++] = (char *)file;
    for (; extra != NULL && *extra != NULL; extra++)
        argv[a++] = (char *)*extra;
    argv[a] = NULL;
    char *out;
    int rc = tu_run(argv, &out, NULL);
    if (rc != 0)
        fprintf(stderr, "kvd-run failed (%d): %s\n", rc, out);
    REQUIRE(rc == 0);
    return out;
}

static double kld_of(const char *base, const char *name, const char *const *extra, double *same)
{
    char *out = perplexity("--kl-divergence", base, extra);
    const double kld = json_num(out, "kld_mean");
    *same = json_num(out, "same_top1_pct");
    fprintf(stderr, "%-22s mean KLD %.5f, p99 %.5f, same top token %.2f%%, perplexity %+.3f%%\n", name,
            kld, json_num(out, "kld_p99"), *same, json_num(out, "perplexity_delta_pct"));
    free(out);
    CHECK(isfinite(kld) && kld >= 0);
    return kld;
}

static void kl_divergence(void)
{
    char base[96];
    snprintf(base, sizeof(base), "%s/f16.kld", dir);
    char *out = perplexity("--kl-divergence-base", base, (const char *[]){ "--kv-type", "f16", NULL });
    fprintf(stderr, "f16 base: perplexity %.4f over %.0f positions\n", json_num(out, "perplexity"),
            json_num(out, "tokens_scored"));
    free(out);
    double same, same_q4, same_plain;
    const double q8 = kld_of(base, "q8_0 (rotated)", (const char *[]){ "--kv-type", "q8_0", NULL }, &same);
    const double q4 = kld_of(base, "q4_0 (rotated)", (const char *[]){ "--kv-type", "q4_0", NULL }, &same_q4);
    const double plain = kld_of(base, "q4_0 (not rotated)",
                                (const char *[]){ "--kv-type", "q4_0", "--kv-rotate", "off", NULL }, &same_plain);
    CHECK(q8 <= KLD_Q8);
    CHECK(same >= SAME_Q8);
    CHECK(q4 <= KLD_Q4);
    CHECK(q4 * 2 <= plain);
    CHECK(q8 < q4);
}

/* kvd-run --chat -n COMPARE --temp 0 --json for one prompt; the output. */
static char *greedy(const char *sys, const char *user, const char *kv_type)
{
    char *argv[20];
    int a = 0;
    argv[a++] = KVD_BIN_DIR "/kvd-run";
    argv[a++] = "-m";
    argv[a++] = KVD_TEST_MODEL;
    argv[a++] = "--chat";
    if (sys[0]) {
        argv[a++] = "--system";
        argv[a++] = (char *)sys;
    }
    argv[a++] = "-p";
    argv[a++] = (char *)user;
    argv[a++] = "-n";
    argv[a++] = "16";
    argv[a++] = "--temp";
    argv[a++] = "0";
    argv[a++] = "--kv-type";
    argv[a++] = (char *)kv_type;
    argv[a++] = "--json";
    argv[a] = NULL;
    char *out;
    int rc = tu_run(argv, &out, NULL);
    CHECK_INT(rc, 0);
    return out;
}

/* The f16 cache's logits after prompt ids p[n] (kvd-run --logits-out): the
 * gap between token a's logit and token b's. */
static double logit_gap(const int32_t *p, size_t n, int32_t a, int32_t b)
{
    size_t cap = n * 12 + 16;
    char *ids = malloc(cap), logits[96];
    size_t o = 0;
    for (size_t i = 0; i < n; i++)
        o += (size_t)snprintf(ids + o, cap - o, "%s%d", i ? "," : "", p[i]);
    snprintf(logits, sizeof(logits), "%s/logits.f32", dir);
    char *argv[] = { KVD_BIN_DIR "/kvd-run", "-m", KVD_TEST_MODEL, "--prompt-ids", ids, "-n", "0",
                     "--logits-out", logits, "--kv-type", "f16", NULL };
    char *out;
    CHECK_INT(tu_run(argv, &out, NULL), 0);
    free(out);
    free(ids);
    FILE *f = fopen(logits, "rb");
    REQUIRE(f != NULL);
    static float l[1 << 17];
    size_t nv = fread(l, sizeof(float), sizeof(l) / sizeof(l[0]), f);
    fclose(f);
    REQUIRE((size_t)a < nv && (size_t)b < nv);
    return (double)l[a] - l[b];
}

static void greedy_continuations(void)
{
    FILE *f = fopen(KVD_TEST_DATA "/greedy_ref.tsv", "r");
    REQUIRE(f != NULL);
    char *line = NULL;
    size_t cap = 0;
    int prompts = 0, equal = 0;
    while (tu_getline(f, &line, &cap)) {
        if (line[0] == '#' || line[0] == '\0')
            continue;
        char *fl[5];
        REQUIRE(tu_fields(line, fl, 5) == 5);
        size_t slen, ulen;
        char *sys = tu_unescape(fl[0], strlen(fl[0]), &slen);
        char *user = tu_unescape(fl[1], strlen(fl[1]), &ulen);
        REQUIRE(sys != NULL && user != NULL);
        char *a = greedy(sys, user, "f16"), *b = greedy(sys, user, "q8_0");
        static int32_t pa[2048], ga[64], gb[64], hist[2048 + 64];
        const size_t np = tu_json_ids(a, "prompt_tokens", pa, 2048);
        const size_t na = tu_json_ids(a, "tokens", ga, 64), nb = tu_json_ids(b, "tokens", gb, 64);
        size_t i = 0;
        while (i < COMPARE && i < na && i < nb && ga[i] == gb[i])
            i++;
        prompts++;
        if (i == COMPARE || (i == na && i == nb)) {
            equal++;
            fprintf(stderr, "prompt %d: the same %zu tokens\n", prompts, i);
        } else if (i < na && i < nb) {
            memcpy(hist, pa, np * sizeof(int32_t));
            memcpy(hist + np, ga, i * sizeof(int32_t));
            const double gap = logit_gap(hist, np + i, ga[i], gb[i]);
            fprintf(stderr, "prompt %d: parts at token %zu (f16 %d, q8_0 %d); the f16 logit gap "
                    "between them: %.4f\n", prompts, i, ga[i], gb[i], gap);
            CHECK(gap >= 0 && gap < NEAR_TIE);
        } else {
            fprintf(stderr, "prompt %d: one run ended at token %zu\n", prompts, i);
        }
        free(a);
        free(b);
        free(sys);
        free(user);
    }
    free(line);
    fclose(f);
    fprintf(stderr, "q8_0 against f16: %d of %d continuations equal for %d tokens\n", equal, prompts,
            COMPARE);
    CHECK_INT(prompts, 10);
    CHECK(equal >= MIN_EQUAL);
}

int main(void)
{
    REQUIRE(access(KVD_TEST_MODEL, R_OK) == 0);
    REQUIRE(mkdtemp(dir) != NULL);
    kl_divergence();
    greedy_continuations();
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    return CHECK_DONE();
}
