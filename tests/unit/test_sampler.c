/* test_sampler.c - greedy, truncations, temperature, penalty and seeding. */
#include <math.h>
#include <string.h>

#include "check.h"
#include "sampler.h"

static sampler_t *make(float temp, int top_k, float top_p, float min_p, float rep, uint64_t seed,
                       uint32_t n)
{
    struct sampler_params p = sampler_default_params();
    p.temperature = temp;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repeat_penalty = rep;
    p.seed = seed;
    char err[128];
    sampler_t *s = sampler_new(&p, n, err, sizeof(err));
    REQUIRE(s != NULL);
    return s;
}

/* The scalar definition: the first index whose value nothing later exceeds. */
static int32_t argmax_ref(const float *x, uint32_t n)
{
    int32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = (int32_t)i;
    return best;
}

/* sampler_argmax (a SIMD path where the CPU has one) against the scalar
 * definition: ties, NaNs, infinities, every length 1..70, a vocabulary. */
static void check_argmax(void)
{
    static float x[49152 + 7];
    unsigned seed = 7;
    int bad = 0;
    for (int round = 0; round < 3000; round++) {
        const uint32_t n = round < 2000 ? 1 + (uint32_t)(round % 70) : 49152 + (uint32_t)(round % 7);
        for (uint32_t i = 0; i < n; i++) {
            seed = seed * 1103515245u + 12345u;
            x[i] = (float)((seed >> 16) % 64) - 32.0f;  /* many ties */
        }
        seed = seed * 1103515245u + 12345u;
        switch (round % 5) {
        case 1: x[(seed >> 8) % n] = NAN; break;
        case 2: x[0] = NAN; break;
        case 3: for (uint32_t i = 0; i < n; i++) x[i] = -INFINITY; break;
        case 4: x[(seed >> 8) % n] = INFINITY; x[n - 1] = INFINITY; break;
        default: break;
        }
        bad += sampler_argmax(x, n) != argmax_ref(x, n);
    }
    CHECK_INT(bad, 0);
}

/* xorshift for the rows below */
static uint64_t rs = 0x243f6a8885a308d3ull;
static uint32_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs >> 32);
}

/*
 * sampler_pick (heap selection of the top-k, or a radix sort of the row)
 * against sampler_pick_sorted (the whole row through qsort): the same ids for
 * the same draws, over rows that are spread, coarse (many exact ties), mixed
 * -0/+0, with infinities, with a NaN, and top-k on both sides of the heap's
 * limit, at the vocabulary's size and off.
 */
static void pick_against_sort(void)
{
    static const uint32_t vocab[] = { 1, 2, 7, 100, 3000, 49152 };
    static const int32_t ks[] = { 0, 1, 2, 40, 1023, 2048, 2049, 2999, 3000, 49151, 49152, 60000 };
    static float row[49152];
    int n_cases = 0, differ = 0;
    for (size_t vi = 0; vi < sizeof(vocab) / sizeof(vocab[0]); vi++) {
        const uint32_t n = vocab[vi];
        sampler_t *a = make(0.0f, 0, 1.0f, 0.0f, 1.0f, 0, n), *b = make(0.0f, 0, 1.0f, 0.0f, 1.0f, 0, n);
        for (int kind = 0; kind < 5; kind++) {
            for (uint32_t i = 0; i < n; i++) {
                const uint32_t r = rnd();
                switch (kind) {
                case 0: row[i] = (float)(r % 2000001) / 1e5f - 10.0f; break;       /* spread */
                case 1: row[i] = (float)(r % 7) - 3.0f; break;                     /* coarse: ties */
                case 2: row[i] = (r & 1) ? -0.0f : 0.0f; break;                    /* only zeros */
                case 3: row[i] = r % 50 == 0 ? INFINITY : r % 50 == 1 ? -INFINITY
                                                                     : (float)(r % 1000) / 100.0f; break;
                default: row[i] = (float)(r % 3000) / 300.0f; break;               /* NaN below */
                }
            }
            if (kind == 4)
                row[rnd() % n] = NAN;
            for (size_t ki = 0; ki < sizeof(ks) / sizeof(ks[0]); ki++) {
                if (ks[ki] > (int32_t)n + 1 && ks[ki] != 60000)
                    continue;
                for (int v = 0; v < 4; v++) {
                    const int32_t pen[3] = { 0, (int32_t)(n / 2), (int32_t)(n - 1) };
                    struct sampler_draw d = {
                        .temperature = v == 3 ? 1.5f : 0.7f, .top_k = ks[ki], .top_p = v == 1 ? 0.5f : v == 2 ? 0.9f : 1.0f,
                        .min_p = v == 2 ? 0.05f : 0.0f, .log_min_p = v == 2 ? log(0.05) : 0.0,
                        .repeat_penalty = v == 3 ? 1.3f : 1.0f, .u = (double)(rnd() >> 8) * 0x1.0p-24,
                        .n_penalized = v == 3 && n >= 3 ? 3 : 0, .penalized = pen,
                    };
                    const int32_t x = sampler_pick(a, &d, row), y = sampler_pick_sorted(b, &d, row);
                    n_cases++;
                    if (x != y) {
                        if (differ++ < 5)
                            fprintf(stderr, "  vocab %u kind %d top-k %d variant %d: pick %d, sorted %d\n", n, kind,
                                    ks[ki], v, x, y);
                    }
                }
            }
        }
        sampler_destroy(&a);
        sampler_destroy(&b);
    }
    printf("sampler_pick against the full sort: %d draws, %d differ\n", n_cases, differ);
    CHECK_INT(differ, 0);
    CHECK(n_cases > 500);
}

/* sampler_logprobs against the definition: the log-softmax in long double
 * and the top-n by a full sort (descending, ids ascending on ties), on rows
 * with ties, a vocabulary-sized row, n_top 0, 1, 5, 20 and more than the
 * vocabulary; NaN everywhere for a row with a NaN. */
static const float *lp_row;
static int lp_cmp(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (lp_row[x] != lp_row[y])
        return lp_row[x] > lp_row[y] ? -1 : 1;
    return x < y ? -1 : 1;
}

static void check_logprobs(void)
{
    static float x[49152];
    static int32_t ids[49152];
    const uint32_t sizes[] = { 1, 3, 8, 25, 49152 };
    const uint32_t tops[] = { 0, 1, 5, 20, 30 };
    unsigned seed = 11;
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
        const uint32_t n = sizes[si];
        for (uint32_t i = 0; i < n; i++) {
            seed = seed * 1103515245u + 12345u;
            x[i] = (float)((seed >> 8) % 64) / 4.0f - 8.0f;  /* coarse: many ties */
            ids[i] = (int32_t)i;
        }
        long double m = -INFINITY, sum = 0;
        for (uint32_t i = 0; i < n; i++)
            m = x[i] > m ? x[i] : m;
        for (uint32_t i = 0; i < n; i++)
            sum += expl((long double)x[i] - m);
        const long double lse = m + logl(sum);
        lp_row = x;
        qsort(ids, n, sizeof(int32_t), lp_cmp);
        for (size_t ti = 0; ti < sizeof(tops) / sizeof(tops[0]); ti++) {
            struct sampler_logprobs lp;
            const int32_t chosen = (int32_t)(n / 2);
            sampler_logprobs(x, n, chosen, tops[ti], &lp);
            uint32_t want = tops[ti] < n ? tops[ti] : n;
            want = want < SAMPLER_MAX_TOP_LOGPROBS ? want : SAMPLER_MAX_TOP_LOGPROBS;
            CHECK_INT(lp.n_top, want);
            CHECK_NEAR(lp.logprob, (double)((long double)x[chosen] - lse), 1e-6);
            for (uint32_t j = 0; j < lp.n_top; j++) {
                CHECK_INT(lp.top_id[j], ids[j]);
                CHECK_NEAR(lp.top_logprob[j], (double)((long double)x[ids[j]] - lse), 1e-6);
            }
        }
    }
    /* a NaN row: no number is made up */
    float bad[4] = { 0.0f, NAN, 1.0f, 2.0f };
    struct sampler_logprobs lp;
    sampler_logprobs(bad, 4, 3, 2, &lp);
    CHECK(isnan(lp.logprob));
    CHECK_INT(lp.n_top, 2);
    CHECK(isnan(lp.top_logprob[0]));
    /* a chosen id outside the row */
    sampler_logprobs(x, 8, 8, 0, &lp);
    CHECK(isnan(lp.logprob));
}

/* OpenAI's additive terms: logit_bias moves greedy choices, presence and
 * frequency penalties count the output only (not the prompt), each distinct
 * id gets one addend of the right size, and bad parameters are refused. */
static void additive_terms(void)
{
    char err[160];
    float row[8] = { 1.0f, 4.0f, 3.5f, 0.5f, 2.0f, -1.0f, 3.9f, 0.0f };
    struct sampler_params p = sampler_default_params();
    p.temperature = 0.0f;
    /* -100 on the best id: the next best wins; +3 on a poor one: it wins */
    {
        const int32_t ids[1] = { 1 };
        const float b[1] = { -100.0f };
        p.n_logit_bias = 1, p.logit_bias_ids = ids, p.logit_bias = b;
        sampler_t *s = sampler_new(&p, 8, err, sizeof(err));
        REQUIRE(s != NULL);
        CHECK_INT(sampler_sample(s, row, NULL, 0), 6);
        sampler_destroy(&s);
        const int32_t ids2[2] = { 7, 1 };
        const float b2[2] = { 4.5f, -0.5f };
        p.n_logit_bias = 2, p.logit_bias_ids = ids2, p.logit_bias = b2;
        s = sampler_new(&p, 8, err, sizeof(err));
        REQUIRE(s != NULL);
        CHECK_INT(sampler_sample(s, row, NULL, 0), 7);   /* 0 + 4.5 > 3.9 */
        sampler_destroy(&s);
    }
    /* presence and frequency: the prompt (before output_from) is not counted */
    {
        p = sampler_default_params();
        p.temperature = 0.0f;
        p.presence_penalty = 0.5f;
        p.frequency_penalty = 0.25f;
        p.output_from = 3;
        sampler_t *s = sampler_new(&p, 8, err, sizeof(err));
        REQUIRE(s != NULL);
        const int32_t hist[7] = { 6, 6, 6, /* output: */ 1, 1, 2, 9 /* out of range: skipped */ };
        struct sampler_draw d;
        sampler_plan(s, hist, 7, &d);
        CHECK_INT(d.n_biased, 2);
        float add1 = 0, add2 = 0, add6 = 0;
        for (uint32_t i = 0; i < d.n_biased; i++) {
            if (d.biased[i] == 1) add1 = d.bias[i];
            if (d.biased[i] == 2) add2 = d.bias[i];
            if (d.biased[i] == 6) add6 = d.bias[i];
        }
        CHECK(add1 == -(0.5f + 0.25f * 2.0f) && add2 == -(0.5f + 0.25f) && add6 == 0.0f);
        /* 4 - 1 = 3 and 3.5 - 0.75 = 2.75 fall below id 6's 3.9 */
        CHECK_INT(sampler_pick(s, &d, row), 6);
        /* with the prompt counted as output, id 6 is penalized too */
        sampler_destroy(&s);
        p.output_from = 0;
        s = sampler_new(&p, 8, err, sizeof(err));
        REQUIRE(s != NULL);
        sampler_plan(s, hist, 7, &d);
        CHECK_INT(d.n_biased, 3);
        CHECK_INT(sampler_pick(s, &d, row), 1);          /* 6: 3.9 - 1.25 = 2.65, 1: 3.0, 2: 2.75 */
        sampler_destroy(&s);
    }
    /* refused: out of range, twice the same id, an id past the vocabulary */
    {
        p = sampler_default_params();
        p.presence_penalty = 2.5f;
        CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL && strstr(err, "presence") != NULL);
        p = sampler_default_params();
        p.frequency_penalty = NAN;
        CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL);
        p = sampler_default_params();
        const int32_t twice[2] = { 3, 3 };
        const float b[2] = { 1.0f, 2.0f };
        p.n_logit_bias = 2, p.logit_bias_ids = twice, p.logit_bias = b;
        CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL && strstr(err, "two") != NULL);
        const int32_t past[1] = { 8 };
        p.n_logit_bias = 1, p.logit_bias_ids = past;
        CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL && strstr(err, "vocabulary") != NULL);
        const int32_t ok[1] = { 2 };
        const float big[1] = { 100.5f };
        p.logit_bias_ids = ok, p.logit_bias = big;
        CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL);
    }
    /* a long output: one addend per distinct id, the sum of counts right */
    {
        p = sampler_default_params();
        p.frequency_penalty = 1.0f;
        sampler_t *s = sampler_new(&p, 1000, err, sizeof(err));
        REQUIRE(s != NULL);
        static int32_t hist[5000];
        for (int i = 0; i < 5000; i++)
            hist[i] = (i * 37) % 701;
        struct sampler_draw d;
        sampler_plan(s, hist, 5000, &d);
        CHECK_INT(d.n_biased, 701);
        double total = 0;
        for (uint32_t i = 0; i < d.n_biased; i++)
            total += d.bias[i];
        CHECK(total == -5000.0);
        sampler_destroy(&s);
    }
}

int main(void)
{
    check_argmax();
    check_logprobs();
    float tie[4] = { 0.5f, 2.0f, -1.0f, 2.0f };
    float lg[8] = { 0.5f, 2.0f, -1.0f, 1.95f, 1.9f, 0.0f, -3.0f, 1.0f };

    /* greedy: argmax, lowest id on a tie */
    sampler_t *s = make(0.0f, 40, 0.95f, 0.05f, 1.0f, 1, 8);
    CHECK_INT(sampler_sample(s, lg, NULL, 0), 1);
    CHECK_INT(sampler_argmax(tie, 4), 1);
    /* the repetition penalty moves greedy off a recent token */
    int32_t hist[3] = { 1, 3, 1 };
    sampler_destroy(&s);
    s = make(0.0f, 0, 1.0f, 0.0f, 1.2f, 1, 8);
    CHECK_INT(sampler_sample(s, lg, hist, 3), 4);    /* 2.0/1.2 < 1.9 */
    CHECK_NEAR(lg[1], 2.0, 0);                       /* logits are not modified */
    sampler_destroy(&s);
    CHECK(s == NULL);

    /* top-k 1, tiny top-p, min-p 1: only the best token survives */
    s = make(1.5f, 1, 1.0f, 0.0f, 1.0f, 7, 8);
    for (int i = 0; i < 200; i++)
        CHECK_INT(sampler_sample(s, lg, NULL, 0), 1);
    sampler_destroy(&s);
    s = make(1.5f, 0, 1e-6f, 0.0f, 1.0f, 7, 8);
    for (int i = 0; i < 200; i++)
        CHECK_INT(sampler_sample(s, lg, NULL, 0), 1);
    sampler_destroy(&s);
    s = make(1.5f, 0, 1.0f, 1.0f, 1.0f, 7, 8);
    for (int i = 0; i < 200; i++)
        CHECK_INT(sampler_sample(s, lg, NULL, 0), 1);
    sampler_destroy(&s);

    /* top-k 3: only ids 1, 3, 4 ever come out */
    s = make(1.0f, 3, 1.0f, 0.0f, 1.0f, 9, 8);
    int bad = 0;
    for (int i = 0; i < 2000; i++) {
        int32_t t = sampler_sample(s, lg, NULL, 0);
        bad += t != 1 && t != 3 && t != 4;
    }
    CHECK_INT(bad, 0);
    sampler_destroy(&s);

    /* the draw follows softmax(logits / T): p(1) = 0.75 for logits {0, ln 3} */
    float two[2] = { 0.0f, logf(3.0f) };
    s = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 12345, 2);
    int ones = 0;
    const int draws = 40000;
    for (int i = 0; i < draws; i++)
        ones += sampler_sample(s, two, NULL, 0) == 1;
    CHECK_NEAR((double)ones / draws, 0.75, 0.01);
    sampler_destroy(&s);
    /* T = 2 flattens it: p(1) = sqrt(3) / (1 + sqrt(3)) = 0.634 */
    s = make(2.0f, 0, 1.0f, 0.0f, 1.0f, 12345, 2);
    ones = 0;
    for (int i = 0; i < draws; i++)
        ones += sampler_sample(s, two, NULL, 0) == 1;
    CHECK_NEAR((double)ones / draws, sqrt(3.0) / (1.0 + sqrt(3.0)), 0.01);
    sampler_destroy(&s);

    /* same seed, same tokens; another seed, other tokens */
    int32_t a[64], b[64], c[64];
    sampler_t *sa = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 42, 8), *sb = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 42, 8);
    sampler_t *sc = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 43, 8);
    for (int i = 0; i < 64; i++) {
        a[i] = sampler_sample(sa, lg, NULL, 0);
        b[i] = sampler_sample(sb, lg, NULL, 0);
        c[i] = sampler_sample(sc, lg, NULL, 0);
    }
    CHECK(memcmp(a, b, sizeof(a)) == 0);
    CHECK(memcmp(a, c, sizeof(a)) != 0);
    sampler_destroy(&sa);
    sampler_destroy(&sb);
    sampler_destroy(&sc);

    /* bad parameters are refused with a reason */
    struct sampler_params p = sampler_default_params();
    char err[128] = "";
    p.temperature = -1.0f;
    CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL && strstr(err, "temperature") != NULL);
    p = sampler_default_params();
    p.top_p = 0.0f;
    CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL && strstr(err, "top-p") != NULL);
    p = sampler_default_params();
    p.min_p = 2.0f;
    CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL && strstr(err, "min-p") != NULL);
    p = sampler_default_params();
    p.top_k = -2;
    CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL && strstr(err, "top-k") != NULL);
    p = sampler_default_params();
    p.repeat_penalty = 0.0f;
    CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL && strstr(err, "penalty") != NULL);
    p = sampler_default_params();
    p.temperature = NAN;
    CHECK(sampler_new(&p, 8, err, sizeof(err)) == NULL);
    /* reseeding restarts the stream: the same seed draws the same tokens again,
     * whatever was drawn before, and differs from another seed */
    {
        float flat[8] = { 1, 1, 1, 1, 1, 1, 1, 1 };
        sampler_t *r1 = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 7, 8);
        sampler_t *r2 = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 99, 8);
        int32_t first[32], again[32];
        int differ = 0;
        for (int i = 0; i < 32; i++)
            first[i] = sampler_sample(r1, flat, NULL, 0);
        for (int i = 0; i < 5; i++)
            sampler_sample(r2, flat, NULL, 0);  /* r2 has drawn before: no matter */
        sampler_reseed(r2, 7);
        for (int i = 0; i < 32; i++) {
            again[i] = sampler_sample(r2, flat, NULL, 0);
            CHECK_INT(again[i], first[i]);
        }
        sampler_reseed(r2, 8);
        for (int i = 0; i < 32; i++)
            differ += sampler_sample(r2, flat, NULL, 0) != first[i];
        CHECK(differ > 0);
        sampler_destroy(&r1);
        sampler_destroy(&r2);
    }
    /* a plan and a pick are a sample: the plan lists each penalized id once,
     * in range, and another sampler of the vocabulary picks the same token */
    {
        float row[16];
        for (int i = 0; i < 16; i++)
            row[i] = (float)((i * 7) % 5) - 1.5f;
        const int32_t window[10] = { 3, 3, -1, 9, 40, 3, 9, 12, 0, 12 };
        sampler_t *x = make(0.9f, 6, 0.9f, 0.02f, 1.4f, 5, 16), *y = make(0.9f, 6, 0.9f, 0.02f, 1.4f, 5, 16);
        sampler_t *scratch = make(0.0f, 0, 1.0f, 0.0f, 1.0f, 0, 16);
        for (int i = 0; i < 50; i++) {
            struct sampler_draw d;
            sampler_plan(y, window, 10, &d);
            CHECK_INT(d.n_penalized, 4);    /* 3, 9, 12, 0 (window 64) */
            CHECK(d.u >= 0.0 && d.u < 1.0);
            CHECK_INT(sampler_pick(scratch, &d, row), sampler_sample(x, row, window, 10));
        }
        sampler_destroy(&x);
        sampler_destroy(&y);
        sampler_destroy(&scratch);
    }
    pick_against_sort();
    additive_terms();
    return CHECK_DONE();
}
