/*
 * test_gemm.c - the SIMD matrix products against the portable C reference:
 * every weight type, several token counts and row ranges. Each path must
 * agree with C within a tolerance scaled by sum |w * a|, the AVX2 and VNNI
 * paths must agree bit for bit, and a token's result must not depend on the
 * batch it came in or the row range it was computed in.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cpu.h"
#include "gemm.h"
#include "quant.h"
#include "types.h"

#define ROWS 7
#define MAXT 9

static float frand(void) { return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f; }

static void run(const struct kern_gemm_args *base, int isa, int T, long r0, long r1, float *out)
{
    struct kern_gemm_args a = *base;
    a.T = T;
    a.r0 = r0;
    a.r1 = r1;
    a.out = out;
    kern_gemm_isa(&a, isa);
}

static void check_type(uint32_t wtype, int64_t n, void *scratch)
{
    const uint32_t at = kern_vec_dot_type(wtype);
    const size_t wrow = kern_row_bytes(wtype, n), arow = kern_act_row_bytes(at, n) + 8;
    float *wf = malloc((size_t)ROWS * n * 4), *af = malloc((size_t)MAXT * n * 4);
    uint8_t *w = malloc(ROWS * wrow), *act = calloc(MAXT, arow);
    for (int64_t i = 0; i < ROWS * n; i++)
        wf[i] = frand() * (i % 7 == 0 ? 3.0f : 1.0f);
    for (int64_t i = 0; i < MAXT * n; i++)
        af[i] = frand();
    for (int r = 0; r < ROWS; r++)
        REQUIRE(kern_quantize_row(wtype, wf + r * n, w + r * wrow, n) == 0);
    for (int t = 0; t < MAXT; t++)
        kern_quantize_act(at, af + t * n, act + t * arow, n);
    /* the scale of each result, for the tolerance */
    float *deq = malloc((size_t)n * 4), *adeq = malloc((size_t)n * 4);
    double mag[ROWS][MAXT];
    for (int r = 0; r < ROWS; r++) {
        REQUIRE(kern_dequantize_row(wtype, w + r * wrow, deq, n) == 0);
        for (int t = 0; t < MAXT; t++) {
            if (at == KERN_F32)
                memcpy(adeq, act + t * arow, (size_t)n * 4);
            else
                REQUIRE(kern_dequantize_row(at, act + t * arow, adeq, n) == 0);
            double s = 0;
            for (int64_t i = 0; i < n; i++)
                s += fabs((double)deq[i] * adeq[i]);
            mag[r][t] = s;
        }
    }
    struct kern_gemm_args g = { .wtype = wtype, .w = w, .row_bytes = wrow, .n = n, .act = act,
                                .act_stride = arow, .ldo = ROWS, .scratch = scratch };
    float ref[MAXT * ROWS], got[MAXT * ROWS], one[ROWS];
    run(&g, KERN_ISA_C, MAXT, 0, ROWS, ref);
    int worst_bad = 0;
#if defined(__x86_64__)
    if (kern_isa_best() >= KERN_ISA_AVX2)
        CHECK(kern_gemm_avx2(&(struct kern_gemm_args){ .wtype = wtype, .w = w, .row_bytes = wrow, .n = n,
                                                       .r0 = 0, .r1 = 1, .act = act, .act_stride = arow,
                                                       .T = 1, .out = got, .ldo = ROWS,
                                                       .scratch = scratch }));  /* a SIMD path exists */
#endif
    for (int isa = KERN_ISA_AVX2; isa <= (int)kern_isa_best(); isa++) {
        run(&g, isa, MAXT, 0, ROWS, got);
        for (int t = 0; t < MAXT; t++)
            for (int r = 0; r < ROWS; r++) {
                double tol = 1e-5 * mag[r][t] + 1e-6;
                if (!(fabs(got[t * ROWS + r] - ref[t * ROWS + r]) <= tol))
                    worst_bad++;
            }
        /* batch invariance: each token alone, and rows in two ranges */
        for (int t = 0; t < MAXT; t++) {
            struct kern_gemm_args single = g;
            single.act = act + t * arow;
            run(&single, isa, 1, 0, 3, one);
            run(&single, isa, 1, 3, ROWS, one);
            CHECK(memcmp(one, got + t * ROWS, sizeof(one)) == 0);
        }
        float part[5 * ROWS];
        struct kern_gemm_args mid = g;
        mid.act = act + 2 * arow;
        run(&mid, isa, 5, 0, ROWS, part);
        CHECK(memcmp(part, got + 2 * ROWS, sizeof(part)) == 0);
        /* accumulate mode adds onto what is there */
        float acc[MAXT * ROWS];
        for (int i = 0; i < MAXT * ROWS; i++)
            acc[i] = 1.0f;
        struct kern_gemm_args add = g;
        add.add = true;
        run(&add, isa, MAXT, 0, ROWS, acc);
        for (int i = 0; i < MAXT * ROWS; i++)
            CHECK(acc[i] == 1.0f + got[i]);
    }
    if (worst_bad)
        fprintf(stderr, "%s: %d results off the C reference\n", kern_type_info(wtype)->name, worst_bad);
    CHECK_INT(worst_bad, 0);
    free(wf); free(af); free(w); free(act); free(deq); free(adeq);
}

/* The packed products (Q4_1, Q8_0, Q4_0 / Q5_0 as Q8_0, and the K-quants; on AVX-512 VNNI, AVX-VNNI and AVX2, or
 * sdot and smmla): against
 * the C reference
 * within the same tolerance, on a matrix whose last group of 16 rows is
 * partial; every tile shape (1..19 tokens: 8-token tiles, tails, the
 * multi-group tiles of 1-4 tokens); each token alone, any row range (also
 * cut in chunks that reuse the staged activations) and accumulate mode
 * giving the same bits as the whole batch. */
#define PROWS 101
#define PMAXT 19
static void check_packed(uint32_t wtype, int64_t n, int isa, bool vnni256)
{
    kern_avxvnni_set(vnni256);
    const uint32_t at = kern_vec_dot_type(wtype);
    const size_t wrow = kern_row_bytes(wtype, n), arow = kern_act_row_bytes(at, n);
    float *wf = malloc((size_t)n * 4), *af = malloc((size_t)n * 4);
    uint8_t *w = malloc(PROWS * wrow), *act = malloc(PMAXT * arow);
    for (int r = 0; r < PROWS; r++) {
        for (int64_t i = 0; i < n; i++)
            wf[i] = frand() * (r % 5 == 0 ? 4.0f : 1.0f);
        REQUIRE(kern_quantize_row(wtype, wf, w + r * wrow, n) == 0);
    }
    for (int t = 0; t < PMAXT; t++) {
        for (int64_t i = 0; i < n; i++)
            af[i] = frand() * (t % 3 == 0 ? 10.0f : 1.0f);
        kern_quantize_act(at, af, act + t * arow, n);
    }
    const bool kq = wtype == KERN_Q4_K || wtype == KERN_Q5_K || wtype == KERN_Q6_K;
    (void)kq;  /* x86-64 only */
    /* packed for the path under test: Q4_0 and Q5_0 in four and five bits
     * on AVX-512 VNNI without AMX tiles, as Q8_0 elsewhere (kern_pack_narrow) */
    const enum kern_isa was = kern_isa();
    kern_isa_set((enum kern_isa)isa);
    struct kern_packed *pk = kern_pack(wtype, w, wrow, PROWS, n);
    const bool small = wtype == KERN_Q4_0 || wtype == KERN_Q5_0, q6 = wtype == KERN_Q6_K, q4k = wtype == KERN_Q4_K;
    const bool q5k = wtype == KERN_Q5_K;
    const bool narrow = kern_pack_narrow(wtype);
    kern_isa_set(was);
    REQUIRE(pk != NULL);
#if defined(__x86_64__)
    const int forced = kern_pack_narrow_set(-1);
    kern_pack_narrow_set(forced);
    const bool amx_on = isa == KERN_ISA_AVX512VNNI && kern_amx();
    CHECK(narrow == ((small || kq) && (forced >= 0 ? forced == 1
                                                   : !amx_on && (wtype == KERN_Q4_0 || isa == KERN_ISA_AVX512VNNI))));
#else
    CHECK(!narrow);
#endif
    CHECK(pk->wtype == (narrow ? (q6 ? KERN_PK_Q6_K6 : q4k ? KERN_PK_Q4_KS : q5k ? KERN_PK_Q5_KS : wtype)
                        : small ? KERN_Q8_0 : wtype));
    CHECK_INT(kern_pack_bytes(pk), (PROWS + 15) / 16 * pk->group_bytes);
    void *scratch = aligned_alloc(64, (kern_gemm_scratch_bytes(n, PMAXT) + 63) / 64 * 64);
    static float ref[PMAXT * PROWS], got[PMAXT * PROWS], part[PMAXT * PROWS];
    struct kern_gemm_args g = { .wtype = wtype, .packed = pk, .w = w, .row_bytes = wrow, .n = n,
                                .act = act, .act_stride = arow, .ldo = PROWS, .scratch = scratch };
    run(&g, KERN_ISA_C, PMAXT, 0, PROWS, ref);
    /* the path's own product takes the matrix (no silent fall back to C) */
    struct kern_gemm_args direct = g;
    direct.T = 2;
    direct.r1 = PROWS;
    direct.out = got;
#if defined(__x86_64__)
    CHECK(isa == KERN_ISA_AVX512VNNI ? kern_gemm_packed_vnni(&direct)
          : vnni256                  ? kern_gemm_packed_avxvnni(&direct)
                                     : kern_gemm_packed_avx2(&direct));
#elif defined(__aarch64__)
    CHECK(isa == KERN_ISA_I8MM ? kern_gemm_packed_i8mm(&direct) : kern_gemm_packed_neon(&direct));
#endif
    int bad = 0, variant = 0;
    for (int T = 1; T <= PMAXT; T++) {
        run(&g, isa, T, 0, PROWS, got);
        for (int t = 0; t < T; t++)
            for (int r = 0; r < PROWS; r++) {
                float want = ref[t * PROWS + r];
                double mag = 0;
                float deq[4096], adeq[4096];
                if (T == PMAXT) {  /* tolerance from sum |w a|, once */
                    REQUIRE(kern_dequantize_row(wtype, w + r * wrow, deq, n) == 0);
                    REQUIRE(kern_dequantize_row(at, act + t * arow, adeq, n) == 0);
                    for (int64_t i = 0; i < n; i++)
                        mag += fabs((double)deq[i] * adeq[i]);
                    if (!(fabs(got[t * PROWS + r] - want) <= 1e-5 * mag + 1e-6))
                        bad++;
                }
            }
        /* the same bits for every token whatever the batch */
        for (int t = 0; t < T; t++) {
            struct kern_gemm_args one = g;
            one.act = act + t * arow;
            float row1[PROWS];
            run(&one, isa, 1, 0, PROWS, row1);
            if (memcmp(row1, got + t * PROWS, sizeof(row1)) != 0)
                variant++;
        }
    }
    /* row ranges that cut groups, then accumulate mode */
    run(&g, isa, PMAXT, 0, PROWS, got);
    for (int i = 0; i < PMAXT * PROWS; i++)
        part[i] = -1.0f;
    const long cuts[] = { 0, 5, 16, 37, 38, 80, PROWS };
    for (int c = 0; c + 1 < (int)(sizeof(cuts) / sizeof(cuts[0])); c++)
        run(&g, isa, PMAXT, cuts[c], cuts[c + 1], part);
    CHECK(memcmp(part, got, sizeof(got)) == 0);
    /* the same cuts, each after the first told that the scratch holds the
     * activations staged (the engine's chunks of one product) */
    struct kern_gemm_args chunk = g;
    for (int i = 0; i < PMAXT * PROWS; i++)
        part[i] = -1.0f;
    for (int c = 0; c + 1 < (int)(sizeof(cuts) / sizeof(cuts[0])); c++) {
        chunk.staged = c > 0;
        run(&chunk, isa, PMAXT, cuts[c], cuts[c + 1], part);
    }
    CHECK(memcmp(part, got, sizeof(got)) == 0);
    struct kern_gemm_args add = g;
    add.add = true;
    for (int i = 0; i < PMAXT * PROWS; i++)
        part[i] = 1.0f;
    run(&add, isa, PMAXT, 0, PROWS, part);
    int add_bad = 0;
    for (int i = 0; i < PMAXT * PROWS; i++)
        add_bad += part[i] != 1.0f + got[i];
    CHECK_INT(add_bad, 0);
    /* a range that ends inside the matrix leaves the rows after it alone */
    for (int i = 0; i < PMAXT * PROWS; i++)
        part[i] = 7.0f;
    run(&g, isa, 3, 20, 21, part);
    CHECK(part[19] == 7.0f && part[21] == 7.0f && part[20] == got[20]);
    /* every width gives the top path's bits (AVX-512 VNNI; on aarch64 smmla);
     * the K-quants' two 256-bit forms give each other's (on the wide
     * layouts, the ones they read) */
    int other = 0;
#if defined(__x86_64__)
    if (kq && !narrow && kern_avxvnni_set(true)) {
        struct kern_gemm_args both = g;
        both.T = PMAXT;
        both.r0 = 0;
        both.r1 = PROWS;
        both.out = part;
        CHECK(kern_gemm_packed_avxvnni(&both));
        both.out = got;
        CHECK(kern_gemm_packed_avx2(&both));
        other = memcmp(part, got, sizeof(got)) != 0;
    }
    kern_avxvnni_set(vnni256);
#endif
    if (isa != KERN_ISA_TOP && kern_isa_best() >= KERN_ISA_TOP) {
        run(&g, KERN_ISA_TOP, PMAXT, 0, PROWS, part);
        run(&g, isa, PMAXT, 0, PROWS, got);
        other = memcmp(part, got, sizeof(got)) != 0;
    }
    CHECK_INT(other, 0);
    if (narrow) {
        /* four, five and six bits, and Q4_K's file scales, give the wide layout's bits */
        const int was_narrow = kern_pack_narrow_set(0);
        struct kern_packed *p8 = kern_pack(wtype, w, wrow, PROWS, n);
        kern_pack_narrow_set(was_narrow);
        REQUIRE(p8 != NULL);
        CHECK(p8->wtype == (small ? KERN_Q8_0 : wtype));
        CHECK_INT(pk->group_bytes,
                  ((size_t)n / 32 * (wtype == KERN_Q4_0 ? 288 : q6 ? 420 : q4k ? 296 : q5k ? 360 : 352) + 63) / 64 * 64);
        CHECK(pk->group_bytes < p8->group_bytes);
        struct kern_gemm_args g8 = g;
        g8.packed = p8;
        for (int T = 1; T <= PMAXT; T++) {
            run(&g8, isa, T, 0, PROWS, part);
            run(&g, isa, T, 0, PROWS, got);
            CHECK(memcmp(part, got, (size_t)T * PROWS * sizeof(float)) == 0);
        }
        kern_pack_free(&p8);
#if defined(__x86_64__)
        /* the 256-bit products do not take five bits, six, nor the K-quants'
         * file scales (kern_gemm falls back to the rows) */
        direct.T = 3;
        if (wtype == KERN_Q5_0 || kq)
            CHECK(!kern_gemm_packed_avx2(&direct) && !kern_gemm_packed_avxvnni(&direct));
#endif
    }
    if (bad || variant)
        fprintf(stderr, "%s packed (%s%s), n=%lld: %d off the reference, %d batch-variant\n",
                kern_type_info(wtype)->name, kern_isa_name((enum kern_isa)isa), vnni256 ? " AVX-VNNI" : "",
                (long long)n, bad, variant);
    CHECK_INT(bad, 0);
    CHECK_INT(variant, 0);
    kern_pack_free(&pk);
    CHECK(pk == NULL);
    free(scratch); free(wf); free(af); free(w); free(act);
}

#if defined(__x86_64__)
/* The AMX tile products: the AVX-512 VNNI products' bits for every token
 * count (whole tiles of 16 tokens and tails), any row range, accumulate mode
 * and chunks that reuse the staged activations; and the dispatch takes them
 * from KERN_AMX_MIN_T tokens on. */
#define AMAXT 37
static void check_amx(uint32_t wtype, int64_t n)
{
    const uint32_t at = kern_vec_dot_type(wtype);
    const size_t wrow = kern_row_bytes(wtype, n), arow = kern_act_row_bytes(at, n);
    float *wf = malloc((size_t)n * 4), *af = malloc((size_t)n * 4);
    uint8_t *w = malloc(PROWS * wrow), *act = malloc(AMAXT * arow);
    for (int r = 0; r < PROWS; r++) {
        for (int64_t i = 0; i < n; i++)
            wf[i] = frand() * (r % 5 == 0 ? 4.0f : 1.0f);
        REQUIRE(kern_quantize_row(wtype, wf, w + r * wrow, n) == 0);
    }
    for (int t = 0; t < AMAXT; t++) {
        for (int64_t i = 0; i < n; i++)
            af[i] = frand() * (t % 3 == 0 ? 10.0f : 1.0f);
        kern_quantize_act(at, af, act + t * arow, n);
    }
    struct kern_packed *pk = kern_pack(wtype, w, wrow, PROWS, n);
    REQUIRE(pk != NULL);
    void *scratch = aligned_alloc(64, (kern_gemm_scratch_bytes(n, AMAXT) + 63) / 64 * 64);
    static float want[AMAXT * PROWS], got[AMAXT * PROWS];
    struct kern_gemm_args g = { .wtype = wtype, .packed = pk, .w = w, .row_bytes = wrow, .n = n, .r0 = 0,
                                .r1 = PROWS, .act = act, .act_stride = arow, .ldo = PROWS, .scratch = scratch };
    int differ = 0;
    const long cuts[] = { 0, 5, 16, 37, 38, 80, PROWS };
    for (int T = 1; T <= AMAXT; T++) {
        struct kern_gemm_args v = g, x = g;
        v.T = x.T = T;
        v.out = want;
        x.out = got;
        memset(got, 0, sizeof(got));
        CHECK(kern_gemm_packed_vnni(&v));
        CHECK(kern_gemm_packed_amx(&x));
        differ += memcmp(want, got, (size_t)T * PROWS * sizeof(float)) != 0;
        /* cut in row ranges, each after the first on the staged activations */
        for (int i = 0; i < T * PROWS; i++)
            got[i] = -1.0f;
        for (int c = 0; c + 1 < (int)(sizeof(cuts) / sizeof(cuts[0])); c++) {
            x.r0 = cuts[c];
            x.r1 = cuts[c + 1];
            x.staged = c > 0;
            CHECK(kern_gemm_packed_amx(&x));
        }
        differ += memcmp(want, got, (size_t)T * PROWS * sizeof(float)) != 0;
        /* accumulate mode on both */
        for (int i = 0; i < T * PROWS; i++)
            want[i] = got[i] = 0.5f;
        v.add = x.add = true;
        x.r0 = 0;
        x.r1 = PROWS;
        x.staged = false;
        CHECK(kern_gemm_packed_vnni(&v));
        CHECK(kern_gemm_packed_amx(&x));
        differ += memcmp(want, got, (size_t)T * PROWS * sizeof(float)) != 0;
    }
    /* the dispatch: tile products from KERN_AMX_MIN_T tokens, the same bits either way */
    struct kern_gemm_args d = g;
    d.T = KERN_AMX_MIN_T + 3;
    d.out = got;
    kern_amx_set(false);
    run(&d, KERN_ISA_AVX512VNNI, d.T, 0, PROWS, want);
    kern_amx_set(true);
    run(&d, KERN_ISA_AVX512VNNI, d.T, 0, PROWS, got);
    differ += memcmp(want, got, (size_t)d.T * PROWS * sizeof(float)) != 0;
    if (differ)
        fprintf(stderr, "%s AMX, n=%lld: %d comparisons differ from AVX-512 VNNI\n", kern_type_info(wtype)->name,
                (long long)n, differ);
    CHECK_INT(differ, 0);
    kern_pack_free(&pk);
    free(scratch); free(wf); free(af); free(w); free(act);
}
#endif

int main(void)
{
    srand(3);
    if (kern_isa_best() == KERN_ISA_C)
        fprintf(stderr, "note: this CPU has no SIMD path; only the C path is checked\n");
    fprintf(stderr, "best path: %s, active: %s\n", kern_isa_name(kern_isa_best()), kern_isa_name(kern_isa()));
    const int64_t n = 512;
    void *scratch = aligned_alloc(64, (kern_gemm_scratch_bytes(n, MAXT) + 63) / 64 * 64);
    const uint32_t types[] = { KERN_F32, KERN_F16, KERN_BF16, KERN_Q4_0, KERN_Q4_1, KERN_Q5_0,
                               KERN_Q5_1, KERN_Q8_0, KERN_Q4_K, KERN_Q5_K, KERN_Q6_K };
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        check_type(types[i], n, scratch);
    /* an odd number of 32-blocks takes the 256-bit code on every path */
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (kern_type_info(types[i])->block_elems == 32 || kern_type_info(types[i])->block_elems == 1)
            check_type(types[i], 96, scratch);
    free(scratch);
    if (kern_isa_best() >= KERN_ISA_SIMD) {
        /* every packed path this CPU has: AVX-512 VNNI, AVX-VNNI, AVX2; or
         * on aarch64 smmla (with sdot for odd tokens) and sdot alone */
        struct packed_path { int isa; bool vnni256; } paths[3];
        int np = 0;
        if (kern_isa_best() >= KERN_ISA_TOP)
            paths[np++] = (struct packed_path){ KERN_ISA_TOP, false };
        if (kern_avxvnni_set(true))
            paths[np++] = (struct packed_path){ KERN_ISA_SIMD, true };
        paths[np++] = (struct packed_path){ KERN_ISA_SIMD, false };
        for (int i = 0; i < np; i++) {
            fprintf(stderr, "packed products: %s%s\n", kern_isa_name((enum kern_isa)paths[i].isa),
                    paths[i].vnni256 ? " with AVX-VNNI" : "");
            check_packed(KERN_Q4_1, 576, paths[i].isa, paths[i].vnni256);
            check_packed(KERN_Q8_0, 576, paths[i].isa, paths[i].vnni256);
            check_packed(KERN_Q4_1, 32, paths[i].isa, paths[i].vnni256);
            check_packed(KERN_Q8_0, 1536, paths[i].isa, paths[i].vnni256);
            /* Q4_0 and Q5_0, packed as Q8_0 (Gemma 3's Q4_K_M file is mostly Q5_0) */
            check_packed(KERN_Q5_0, 640, paths[i].isa, paths[i].vnni256);
            check_packed(KERN_Q4_0, 576, paths[i].isa, paths[i].vnni256);
            check_packed(KERN_Q5_0, 32, paths[i].isa, paths[i].vnni256);
            check_packed(KERN_Q4_K, 512, paths[i].isa, paths[i].vnni256);
            check_packed(KERN_Q5_K, 256, paths[i].isa, paths[i].vnni256);
            check_packed(KERN_Q5_K, 768, paths[i].isa, paths[i].vnni256);
            check_packed(KERN_Q6_K, 768, paths[i].isa, paths[i].vnni256);
        }
        kern_avxvnni_set(true);
#if defined(__x86_64__)
        if (kern_amx_available()) {
            fprintf(stderr, "packed products: AMX tiles\n");
            /* the configuration the products load is the one the tiles hold */
            CHECK(kern_amx_config_check());
            CHECK(kern_amx_set(true));
            check_amx(KERN_Q4_1, 576);
            check_amx(KERN_Q4_1, 32);
            check_amx(KERN_Q8_0, 1536);
            check_amx(KERN_Q8_0, 96);
            check_amx(KERN_Q5_0, 640);
            check_amx(KERN_Q4_0, 576);
            check_amx(KERN_Q4_K, 512);
            check_amx(KERN_Q5_K, 256);
            check_amx(KERN_Q6_K, 768);
            /* with AMX on, Q4_0, Q5_0 and the K-quants stay wide; their narrow layouts
             * (forced) go to the vector products, the tiles refusing them */
            kern_pack_narrow_set(1);
            check_packed(KERN_Q5_0, 640, KERN_ISA_AVX512VNNI, true);
            check_packed(KERN_Q4_0, 576, KERN_ISA_AVX512VNNI, true);
            check_packed(KERN_Q6_K, 768, KERN_ISA_AVX512VNNI, true);
            check_packed(KERN_Q4_K, 512, KERN_ISA_AVX512VNNI, true);
            check_packed(KERN_Q5_K, 256, KERN_ISA_AVX512VNNI, true);
            kern_pack_narrow_set(-1);
        } else {
            fprintf(stderr, "note: no AMX on this CPU (or the OS refused the tile data); the AVX-512 path serves\n");
            CHECK(!kern_amx_set(true) && !kern_amx());
        }
#endif
        /* types without a packed form, and odd lengths, are left in place */
        uint8_t w[256] = { 0 };
        struct kern_packed *kp = kern_pack(KERN_Q4_K, w, kern_row_bytes(KERN_Q4_K, 256), 1, 256);
        CHECK(kp != NULL);
        kern_pack_free(&kp);
        CHECK(kern_pack(KERN_Q8_0, w, 17, 2, 16) == NULL);
    } else {
        CHECK(kern_pack(KERN_Q4_1, (uint8_t[20]){ 0 }, 20, 1, 32) == NULL);
        fprintf(stderr, "note: no SIMD path (AVX2, or sdot on aarch64); the packed products are not checked here\n");
    }
    return CHECK_DONE();
}
