/*
 * test_gpu_ops.c - the CUDA matrix products and per-row kernels against their
 * C twins.
 *
 *   activation quantization (Q8_0, Q8_1,   bit for bit (kern_quantize_act)
 *   Q8_K)
 *   row lookup (F32, F16, Q4_0, Q4_1, Q8_0) bit for bit (kern_dequantize_row)
 *   products Q4_1, Q8_0, F16, Q5_0,        normwise relative error within 1e-3
 *   Q4_K, Q6_K (Gemma 3's)
 *                                          per token (kern_matmul), residual
 *                                          add, and batch invariance bit for bit;
 *                                          three in one launch (kcuda_gemm_n) bit
 *                                          for bit as three launches
 *   RMSNorm, SwiGLU, post-norm + add       relative error within 1e-5; fused
 *                                          with the next quantization: the
 *                                          bits of the two kernels
 *   GEGLU, scale                           bit for bit (kern_geglu, x * s)
 *   RoPE + K/V write (F16, Q8_0, Q4_0,     q within 1e-5; cache: V rows exact, K
 *   with and without rotation; NEOX        rows within one quantization step,
 *   pairs; head dim 64, 128, 256)
 *                                          nothing else touched
 *   Walsh-Hadamard rotation                bit for bit (kern_hadamard)
 *   keys of whole blocks turned by delta   bit for bit on the emulation (the
 *   positions (F32, F16, Q8_0, Q4_0,       twin's libm), within one step of
 *   rotated or not, both pair layouts)     the type elsewhere (engine_kv_shift's
 *                                          arithmetic); every row changed, V
 *                                          and other blocks untouched
 *   argmax                                 identical ids (ties, NaN, -inf rows)
 *   sampled choice                         identical ids to sampler_pick (greedy and
 *                                          sampled, penalties, top-k/p, min-p, ties)
 *
 * Shapes are SmolLM2-135M's (576 wide, 1536 feed-forward, 192 KV rows, a
 * 49152-row output head) and a few odd ones; batches of 1 to 35 tokens.
 * `--quick`: every kernel once on small shapes (for compute-sanitizer).
 * Exits 77 (skip) where no CUDA device is usable.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "err.h"
#include "f16.h"
#include "kcuda.h"
#include "ops.h"
#include "quant.h"
#include "sampler.h"
#include "types.h"

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint32_t rng_u32(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

static float frand(void) { return (float)((double)rng_u32() / 2147483648.0 - 1.0); }

/* Device copy of a host buffer (REQUIREs success). */
static void *to_dev(const void *h, size_t bytes)
{
    void *d = kcuda_malloc(bytes);
    REQUIRE(d != NULL);
    REQUIRE(kcuda_upload(d, h, bytes) == 0);
    return d;
}

static void from_dev(void *h, const void *d, size_t bytes)
{
    int rc = kcuda_sync();
    if (rc)
        fprintf(stderr, "kernel failed: %s\n", kcuda_last_error());
    REQUIRE(rc == 0);
    REQUIRE(kcuda_download(h, d, bytes) == 0);
}

/* Largest |a - b| over max |b| for n values (NaN in a counts as infinite). */
static double normwise(const float *a, const float *b, size_t n)
{
    double e = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) != isnan(b[i]))
            return INFINITY;
        e = fmax(e, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return e / fmax(m, 1e-30);
}

/* ---- activation quantization ------------------------------------------------- */

static void test_quantize(void)
{
    const int T = 5, ldx = 800;
    float *x = malloc((size_t)T * ldx * sizeof(float));
    for (int i = 0; i < T * ldx; i++)
        x[i] = frand() * (i % 7 == 0 ? 20.0f : 1.0f);
    for (int i = 0; i < 64; i++)    /* a zero block and a tiny one */
        x[ldx + i] = i < 32 ? 0.0f : frand() * 1e-30f;
    for (int i = 0; i < 256; i++)   /* a zero super-block (Q8_K) */
        x[2 * ldx + 256 + i] = 0.0f;
    x[3 * ldx + 5] = 30.0f;         /* two elements of the same largest magnitude: the first wins */
    x[3 * ldx + 77] = -30.0f;
    x[3 * ldx + 300] = -30.0f;
    x[3 * ldx + 400] = 30.0f;
    const uint32_t types[] = { KERN_Q8_0, KERN_Q8_1, KERN_Q8_K };
    float *dx = to_dev(x, (size_t)T * ldx * sizeof(float));
    for (int ti = 0; ti < 3; ti++) {
        const int n = types[ti] == KERN_Q8_K ? 768 : 576;
        const size_t rb = kern_act_row_bytes(types[ti], n), stride = rb + 8;
        uint8_t *ref = calloc((size_t)T, stride), *got = calloc((size_t)T, stride);
        for (int t = 0; t < T; t++)
            kern_quantize_act(types[ti], x + (size_t)t * ldx, ref + t * stride, n);
        void *dd = to_dev(got, (size_t)T * stride);
        REQUIRE(kcuda_quantize_act(types[ti], dx, ldx, dd, stride, n, T, NULL) == 0);
        from_dev(got, dd, (size_t)T * stride);
        CHECK(memcmp(ref, got, (size_t)T * stride) == 0);
        printf("quantize %s: %s\n", kern_type_info(types[ti])->name,
               memcmp(ref, got, (size_t)T * stride) == 0 ? "bit-exact" : "DIFFERS");
        kcuda_free(dd);
        free(ref);
        free(got);
    }
    kcuda_free(dx);
    free(x);
}

/* ---- row lookup --------------------------------------------------------------- */

static void test_get_rows(void)
{
    const int n = 576, rows = 50, T = 4;
    const int32_t ids[] = { 0, 49, 7, 7 };
    const uint32_t types[] = { KERN_F32, KERN_F16, KERN_Q4_0, KERN_Q4_1, KERN_Q8_0 };
    float *src = malloc((size_t)n * sizeof(float));
    void *dids = to_dev(ids, sizeof(ids));
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
        const size_t rb = kern_row_bytes(types[ti], n);
        uint8_t *w = malloc(rb * rows);
        for (int r = 0; r < rows; r++) {
            for (int i = 0; i < n; i++)
                src[i] = frand() * 0.1f;
            REQUIRE(kern_quantize_row(types[ti], src, w + r * rb, n) == 0);
        }
        float *ref = malloc((size_t)T * n * sizeof(float)), *got = malloc((size_t)T * n * sizeof(float));
        for (int t = 0; t < T; t++)
            REQUIRE(kern_dequantize_row(types[ti], w + ids[t] * rb, ref + (size_t)t * n, n) == 0);
        void *dw = to_dev(w, rb * rows), *dout = kcuda_malloc((size_t)T * n * sizeof(float));
        REQUIRE(kcuda_get_rows(types[ti], dw, rb, n, dids, T, dout, NULL) == 0);
        from_dev(got, dout, (size_t)T * n * sizeof(float));
        CHECK(memcmp(ref, got, (size_t)T * n * sizeof(float)) == 0);
        printf("get_rows %s: %s\n", kern_type_info(types[ti])->name,
               memcmp(ref, got, (size_t)T * n * sizeof(float)) == 0 ? "bit-exact" : "DIFFERS");
        kcuda_free(dw);
        kcuda_free(dout);
        free(w);
        free(ref);
        free(got);
    }
    kcuda_free(dids);
    free(src);
}

/* ---- matrix products ----------------------------------------------------------- */

/* out (T, rows) on the device for activations act (host bytes, T rows). */
static float *gpu_gemm(uint32_t wtype, const void *dw, size_t row_bytes, int64_t rows, int64_t n,
                       const uint8_t *act, size_t act_stride, int T, const float *init, bool add)
{
    const size_t ob = (size_t)T * rows * sizeof(float);
    float *out = malloc(ob);
    void *da = to_dev(act, act_stride * T), *dout = to_dev(init, ob);
    struct kcuda_gemm_args g = {
        .wtype = wtype, .w = dw, .row_bytes = row_bytes, .rows = rows, .n = n, .act = da, .act_stride = act_stride,
        .T = T, .out = dout, .ldo = (size_t)rows, .add = add,
    };
    int rc = kcuda_gemm(&g, NULL);
    if (rc)
        fprintf(stderr, "gemm launch: %d %s\n", rc, kcuda_last_error());
    REQUIRE(rc == 0);
    from_dev(out, dout, ob);
    kcuda_free(da);
    kcuda_free(dout);
    return out;
}

static void test_gemm_shape(uint32_t wtype, int64_t rows, int64_t n, const int *Ts, int nT)
{
    const size_t rb = kern_row_bytes(wtype, n);
    const uint32_t at = kern_vec_dot_type(wtype);
    const size_t ab = kern_act_row_bytes(at, n);
    const size_t astride = (ab + 15) / 16 * 16;
    uint8_t *w = malloc(rb * rows);
    float *src = malloc((size_t)n * sizeof(float));
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++)
            src[i] = frand() * 0.05f;
        REQUIRE(kern_quantize_row(wtype, src, w + r * rb, n) == 0);
    }
    void *dw = to_dev(w, rb * rows);
    int maxT = 0;
    for (int i = 0; i < nT; i++)
        maxT = Ts[i] > maxT ? Ts[i] : maxT;
    uint8_t *act = calloc((size_t)maxT, astride);
    for (int t = 0; t < maxT; t++) {
        for (int64_t i = 0; i < n; i++)
            src[i] = frand() * (t % 3 == 0 ? 4.0f : 1.0f);
        kern_quantize_act(at, src, act + t * astride, n);
    }
    float *ref = malloc((size_t)maxT * rows * sizeof(float)), *init = malloc((size_t)maxT * rows * sizeof(float));
    kern_matmul(wtype, w, rows, n, act, maxT, astride, ref);
    for (size_t i = 0; i < (size_t)maxT * rows; i++)
        init[i] = frand();
    /* every token alone, for batch invariance */
    float *one = malloc((size_t)maxT * rows * sizeof(float));
    REQUIRE(one != NULL);
    for (int t = 0; t < maxT; t++) {
        float *alone = gpu_gemm(wtype, dw, rb, rows, n, act + (size_t)t * astride, astride, 1, init, false);
        memcpy(one + (size_t)t * rows, alone, (size_t)rows * sizeof(float));
        free(alone);
    }
    double worst = 0;
    for (int i = 0; i < nT; i++) {
        const int T = Ts[i];
        for (int add = 0; add < 2; add++) {
            float *got = gpu_gemm(wtype, dw, rb, rows, n, act, astride, T, init, add);
            for (int t = 0; t < T; t++) {
                const float *g = got + (size_t)t * rows;
                const float *c = ref + (size_t)t * rows;
                double e;
                if (add) {
                    /* the residual: init + product, against init + twin */
                    double em = 0, m = 0;
                    for (int64_t r = 0; r < rows; r++) {
                        const double want = (double)init[t * rows + r] + c[r];
                        em = fmax(em, fabs(g[r] - want));
                        m = fmax(m, fabs(want));
                    }
                    e = em / fmax(m, 1e-30);
                } else {
                    e = normwise(g, c, (size_t)rows);
                }
                if (e > 1e-3)
                    fprintf(stderr, "  %s %lldx%lld T %d token %d add %d: %.3g\n", kern_type_info(wtype)->name,
                            (long long)rows, (long long)n, T, t, add, e);
                CHECK(e <= 1e-3);
                worst = fmax(worst, e);
            }
            if (!add)   /* batch invariance: every token as when alone */
                CHECK(memcmp(got, one, (size_t)T * rows * sizeof(float)) == 0);
            free(got);
        }
    }
    printf("gemm %-4s %6lld x %-5lld T up to %2d: worst normwise %.2e\n", kern_type_info(wtype)->name,
           (long long)rows, (long long)n, maxT, worst);
    free(one);
    kcuda_free(dw);
    free(w);
    free(src);
    free(act);
    free(ref);
    free(init);
}

/* Three products of one input in one launch (Q, K, V of SmolLM2's shape;
 * an empty one among them) give the bits of three launches; mixed types are
 * refused. */
static void test_gemm_multi(uint32_t wtype, int T)
{
    const int64_t n = 576, rows[3] = { 576, 37, 192 };   /* 37: a matrix ending mid-block */
    const size_t rb = kern_row_bytes(wtype, n);
    const uint32_t at = kern_vec_dot_type(wtype);
    const size_t astride = (kern_act_row_bytes(at, n) + 15) / 16 * 16;
    float *src = malloc((size_t)n * sizeof(float));
    uint8_t *act = calloc((size_t)T, astride);
    REQUIRE(src && act);
    for (int t = 0; t < T; t++) {
        for (int64_t i = 0; i < n; i++)
            src[i] = frand();
        kern_quantize_act(at, src, act + t * astride, n);
    }
    void *da = to_dev(act, astride * T);
    struct kcuda_gemm_args g[3];
    void *dw[3];
    float *sep[3], *dsep[3], *dall[3];
    for (int m = 0; m < 3; m++) {
        uint8_t *w = malloc(rb * rows[m]);
        REQUIRE(w != NULL);
        for (int64_t r = 0; r < rows[m]; r++) {
            for (int64_t i = 0; i < n; i++)
                src[i] = frand() * 0.05f;
            REQUIRE(kern_quantize_row(wtype, src, w + r * rb, n) == 0);
        }
        dw[m] = to_dev(w, rb * rows[m]);
        free(w);
        const size_t ob = (size_t)T * rows[m] * sizeof(float);
        sep[m] = malloc(ob);
        dsep[m] = kcuda_malloc(ob);
        dall[m] = kcuda_malloc(ob);
        REQUIRE(sep[m] && dsep[m] && dall[m]);
        g[m] = (struct kcuda_gemm_args){
            .wtype = wtype, .w = dw[m], .row_bytes = rb, .rows = rows[m], .n = n, .act = da, .act_stride = astride,
            .T = T, .out = dsep[m], .ldo = (size_t)rows[m], .add = false,
        };
        REQUIRE(kcuda_gemm(&g[m], NULL) == 0);
        g[m].out = dall[m];
    }
    REQUIRE(kcuda_gemm_n(g, 3, NULL) == 0);
    int same = 1;
    for (int m = 0; m < 3; m++) {
        const size_t ob = (size_t)T * rows[m] * sizeof(float);
        float *all = malloc(ob);
        from_dev(sep[m], dsep[m], ob);
        from_dev(all, dall[m], ob);
        same &= memcmp(all, sep[m], ob) == 0;
        free(all);
    }
    CHECK(same);
    /* an empty product in the middle takes no blocks */
    struct kcuda_gemm_args g2[3] = { g[0], g[1], g[2] };
    g2[1].rows = 0;
    REQUIRE(kcuda_gemm_n(g2, 3, NULL) == 0);
    float *last = malloc((size_t)T * rows[2] * sizeof(float));
    from_dev(last, dall[2], (size_t)T * rows[2] * sizeof(float));
    CHECK(memcmp(last, sep[2], (size_t)T * rows[2] * sizeof(float)) == 0);
    free(last);
    /* products that cannot share a launch */
    g2[1] = g[1];
    g2[1].wtype = wtype == KERN_Q4_1 ? KERN_Q8_0 : KERN_Q4_1;
    CHECK_INT(kcuda_gemm_n(g2, 3, NULL), KVD_EINVAL);
    g2[1] = g[1];
    g2[1].T = T + 1;
    CHECK_INT(kcuda_gemm_n(g2, 3, NULL), KVD_EINVAL);
    CHECK_INT(kcuda_gemm_n(g, 4, NULL), KVD_EINVAL);
    /* activations are staged with 16-byte copies: rows 16-byte aligned */
    struct kcuda_gemm_args odd = g[0];
    odd.act_stride = astride + 4;
    CHECK_INT(kcuda_gemm(&odd, NULL), KVD_EINVAL);
    odd = g[0];
    odd.act = (const uint8_t *)da + 4;
    CHECK_INT(kcuda_gemm(&odd, NULL), KVD_EINVAL);
    printf("gemm %-4s x3 in one launch, T %d: %s\n", kern_type_info(wtype)->name, T,
           same ? "the bits of three launches" : "DIFFERS");
    for (int m = 0; m < 3; m++) {
        kcuda_free(dw[m]);
        kcuda_free(dsep[m]);
        kcuda_free(dall[m]);
        free(sep[m]);
    }
    kcuda_free(da);
    free(src);
    free(act);
}

static void test_gemm(void)
{
    static const int Ts[] = { 1, 2, 3, 5, 8, 13, 16, 35 };    /* every tokens-per-pass, and part passes */
    const int nT = sizeof(Ts) / sizeof(Ts[0]);
    test_gemm_shape(KERN_Q4_1, 576, 576, Ts, nT);
    test_gemm_shape(KERN_Q4_1, 192, 576, Ts, nT);
    test_gemm_shape(KERN_Q4_1, 1536, 576, Ts, nT);
    test_gemm_shape(KERN_Q4_1, 576, 1536, Ts, nT);
    test_gemm_shape(KERN_Q4_1, 37, 4096, Ts, nT);
    test_gemm_shape(KERN_Q8_0, 576, 576, Ts, nT);
    test_gemm_shape(KERN_Q8_0, 33, 1056, Ts, nT);
    test_gemm_shape(KERN_F16, 576, 576, Ts, nT);
    test_gemm_shape(KERN_F16, 35, 1544, Ts, nT);
    static const int Th[] = { 1, 3 };
    test_gemm_shape(KERN_Q8_0, 49152, 576, Th, 2);  /* SmolLM2's output head */
    test_gemm_multi(KERN_Q4_1, 1);
    test_gemm_multi(KERN_Q4_1, 11);
    test_gemm_multi(KERN_Q4_1, 21);
    test_gemm_multi(KERN_Q8_0, 3);
    test_gemm_multi(KERN_F16, 9);
    /* Gemma 3 270M's: Q5_0 (Q/K/V, gate/up), Q4_K and Q6_K (output, down) */
    test_gemm_shape(KERN_Q5_0, 1024, 640, Ts, nT);
    test_gemm_shape(KERN_Q5_0, 37, 640, Ts, nT);
    test_gemm_shape(KERN_Q4_K, 640, 1024, Ts, nT);
    test_gemm_shape(KERN_Q4_K, 33, 2048, Ts, nT);
    test_gemm_shape(KERN_Q6_K, 640, 2048, Ts, nT);
    test_gemm_shape(KERN_Q6_K, 35, 768, Ts, nT);     /* rows of 630 bytes: every other 2 bytes off a word */
    test_gemm_shape(KERN_Q4_K, 19, 9 * 256, Ts, nT); /* a chunk of 32 sub-blocks and a partial one */
    test_gemm_multi(KERN_Q5_0, 5);
}

/* ---- RMSNorm, SwiGLU -------------------------------------------------------------- */

static void test_rows(void)
{
    const int n = 576, T = 6, ff = 1536;
    const int32_t pick[] = { 5, 0, 3 };
    float *x = malloc((size_t)T * n * sizeof(float)), *w = malloc((size_t)n * sizeof(float));
    for (int i = 0; i < T * n; i++)
        x[i] = frand() * (float)(1 + i / n);
    for (int i = 0; i < n; i++)
        w[i] = 1.0f + frand() * 0.5f;
    float *ref = malloc((size_t)T * n * sizeof(float)), *got = malloc((size_t)T * n * sizeof(float));
    void *dx = to_dev(x, (size_t)T * n * sizeof(float)), *dw = to_dev(w, (size_t)n * sizeof(float));
    void *dout = kcuda_malloc((size_t)T * n * sizeof(float)), *dpick = to_dev(pick, sizeof(pick));
    /* all rows, then a picked subset (the final norm of the rows that need logits) */
    for (int t = 0; t < T; t++)
        kern_rmsnorm(ref + (size_t)t * n, x + (size_t)t * n, w, n, 1e-5f);
    REQUIRE(kcuda_rmsnorm(dout, dx, dw, NULL, n, T, 1e-5f, NULL) == 0);
    from_dev(got, dout, (size_t)T * n * sizeof(float));
    double e = 0;
    for (int i = 0; i < T * n; i++)
        e = fmax(e, fabs(got[i] - ref[i]) / (fabs(ref[i]) + 1e-30));
    for (int i = 0; i < 3; i++)
        kern_rmsnorm(ref + (size_t)i * n, x + (size_t)pick[i] * n, w, n, 1e-5f);
    REQUIRE(kcuda_rmsnorm(dout, dx, dw, dpick, n, 3, 1e-5f, NULL) == 0);
    from_dev(got, dout, (size_t)3 * n * sizeof(float));
    for (int i = 0; i < 3 * n; i++)
        e = fmax(e, fabs(got[i] - ref[i]) / (fabs(ref[i]) + 1e-30));
    printf("rmsnorm: worst relative %.2e\n", e);
    CHECK(e <= 1e-5);

    float *g = malloc((size_t)T * ff * sizeof(float)), *u = malloc((size_t)T * ff * sizeof(float));
    float *gref = malloc((size_t)T * ff * sizeof(float));
    for (int i = 0; i < T * ff; i++) {
        g[i] = frand() * 12.0f;
        u[i] = frand() * 3.0f;
    }
    memcpy(gref, g, (size_t)T * ff * sizeof(float));
    for (int t = 0; t < T; t++)
        kern_swiglu(gref + (size_t)t * ff, u + (size_t)t * ff, ff);
    void *dg = to_dev(g, (size_t)T * ff * sizeof(float)), *du = to_dev(u, (size_t)T * ff * sizeof(float));
    REQUIRE(kcuda_swiglu(dg, du, ff, T, NULL) == 0);
    from_dev(g, dg, (size_t)T * ff * sizeof(float));
    e = 0;
    for (int i = 0; i < T * ff; i++)
        e = fmax(e, fabs(g[i] - gref[i]) / (fabs(gref[i]) + 1e-30));
    printf("swiglu: worst relative %.2e\n", e);
    CHECK(e <= 1e-5);

    /* GEGLU through the device copy of the twin's table: its bits */
    for (int i = 0; i < T * ff; i++)
        g[i] = frand() * (i % 5 == 0 ? 14.0f : 3.0f);   /* beyond +-10 too */
    g[3] = 10.0f;
    g[4] = -10.0f;
    memcpy(gref, g, (size_t)T * ff * sizeof(float));
    for (int t = 0; t < T; t++)
        kern_geglu(gref + (size_t)t * ff, u + (size_t)t * ff, ff);
    void *dtab = to_dev(kern_gelu_table(), 65536 * sizeof(float));
    REQUIRE(kcuda_upload(dg, g, (size_t)T * ff * sizeof(float)) == 0);
    REQUIRE(kcuda_geglu(dg, du, ff, T, dtab, NULL) == 0);
    from_dev(g, dg, (size_t)T * ff * sizeof(float));
    const int geglu_same = memcmp(g, gref, (size_t)T * ff * sizeof(float)) == 0;
    printf("geglu: %s\n", geglu_same ? "the twin's bits" : "DIFFERS");
    CHECK(geglu_same);
    kcuda_free(dtab);

    /* the post-norm: y = rmsnorm(y) * w, x += y (forward.c's post_norm_run) */
    float *y = malloc((size_t)T * n * sizeof(float)), *xs = malloc((size_t)T * n * sizeof(float));
    float *yg = malloc((size_t)T * n * sizeof(float)), *xg = malloc((size_t)T * n * sizeof(float));
    REQUIRE(y && xs && yg && xg);
    for (int i = 0; i < T * n; i++)
        y[i] = frand() * 30.0f;
    void *dy = to_dev(y, (size_t)T * n * sizeof(float)), *dxs = to_dev(x, (size_t)T * n * sizeof(float));
    memcpy(xs, x, (size_t)T * n * sizeof(float));
    for (int t = 0; t < T; t++) {
        float *yr = y + (size_t)t * n, *xr = xs + (size_t)t * n;
        kern_rmsnorm(yr, yr, w, n, 1e-6f);
        for (int i = 0; i < n; i++)
            xr[i] += yr[i];
    }
    REQUIRE(kcuda_rmsnorm_add(dxs, dy, dw, n, T, 1e-6f, NULL) == 0);
    from_dev(yg, dy, (size_t)T * n * sizeof(float));
    from_dev(xg, dxs, (size_t)T * n * sizeof(float));
    e = fmax(normwise(yg, y, (size_t)T * n), normwise(xg, xs, (size_t)T * n));
    printf("rmsnorm + add: worst normwise %.2e\n", e);
    CHECK(e <= 1e-5);
    /* the embedding scale: one multiply, the same bits */
    for (int i = 0; i < T * n; i++)
        xs[i] = x[i] * 25.298221f;
    REQUIRE(kcuda_upload(dxs, x, (size_t)T * n * sizeof(float)) == 0);
    REQUIRE(kcuda_scale(dxs, 25.298221f, (int64_t)T * n, NULL) == 0);
    from_dev(xg, dxs, (size_t)T * n * sizeof(float));
    CHECK(memcmp(xg, xs, (size_t)T * n * sizeof(float)) == 0);
    kcuda_free(dy);
    kcuda_free(dxs);
    free(y);
    free(xs);
    free(yg);
    free(xg);
    kcuda_free(dx);
    kcuda_free(dw);
    kcuda_free(dout);
    kcuda_free(dpick);
    kcuda_free(dg);
    kcuda_free(du);
    free(x);
    free(w);
    free(ref);
    free(got);
    free(g);
    free(u);
    free(gref);
}

/* The fused kernels give the bits of the two they replace: RMSNorm then
 * quantization (Q8_0, Q8_1), SwiGLU then quantization. */
static void test_fused(void)
{
    const int n = 576, T = 5, ff = 1536;
    float *x = malloc((size_t)T * ff * sizeof(float)), *w = malloc((size_t)n * sizeof(float));
    float *u = malloc((size_t)T * ff * sizeof(float));
    REQUIRE(x && w && u);
    for (int i = 0; i < T * ff; i++) {
        x[i] = frand() * (float)(1 + i % 7);
        u[i] = frand() * 3.0f;
    }
    x[7] = 0.0f;                                    /* a row block with a zero, one all zero */
    for (int i = 64; i < 96; i++)
        x[i] = 0.0f;
    for (int i = 0; i < n; i++)
        w[i] = 1.0f + frand() * 0.5f;
    const uint32_t types[2] = { KERN_Q8_0, KERN_Q8_1 };
    int same = 1;
    for (int k = 0; k < 2; k++) {
        const size_t stride = (kern_act_row_bytes(types[k], ff) + 15) / 16 * 16;
        const size_t ob = (size_t)T * ff * sizeof(float), ab = (size_t)T * stride;
        uint8_t *a1 = calloc(1, ab), *a2 = calloc(1, ab);
        float *o1 = malloc(ob), *o2 = malloc(ob);
        REQUIRE(a1 && a2 && o1 && o2);
        void *dx = to_dev(x, (size_t)T * n * sizeof(float)), *dw = to_dev(w, (size_t)n * sizeof(float));
        void *do1 = kcuda_malloc(ob), *do2 = kcuda_malloc(ob), *da1 = to_dev(a1, ab), *da2 = to_dev(a2, ab);
        REQUIRE(do1 && do2);
        /* RMSNorm: two kernels, then one */
        REQUIRE(kcuda_rmsnorm(do1, dx, dw, NULL, n, T, 1e-5f, NULL) == 0);
        REQUIRE(kcuda_quantize_act(types[k], do1, (size_t)n, da1, stride, n, T, NULL) == 0);
        REQUIRE(kcuda_rmsnorm_quant(do2, dx, dw, n, T, 1e-5f, types[k], da2, stride, NULL) == 0);
        from_dev(o1, do1, (size_t)T * n * sizeof(float));
        from_dev(o2, do2, (size_t)T * n * sizeof(float));
        from_dev(a1, da1, ab);
        from_dev(a2, da2, ab);
        same &= memcmp(o1, o2, (size_t)T * n * sizeof(float)) == 0 && memcmp(a1, a2, ab) == 0;
        /* SwiGLU */
        void *dg1 = to_dev(x, ob), *dg2 = to_dev(x, ob), *du = to_dev(u, ob);
        REQUIRE(kcuda_swiglu(dg1, du, ff, T, NULL) == 0);
        REQUIRE(kcuda_quantize_act(types[k], dg1, (size_t)ff, da1, stride, ff, T, NULL) == 0);
        REQUIRE(kcuda_swiglu_quant(dg2, du, ff, T, types[k], da2, stride, NULL) == 0);
        from_dev(o1, dg1, ob);
        from_dev(o2, dg2, ob);
        from_dev(a1, da1, ab);
        from_dev(a2, da2, ab);
        same &= memcmp(o1, o2, ob) == 0 && memcmp(a1, a2, ab) == 0;
        CHECK_INT(kcuda_rmsnorm_quant(do2, dx, dw, n, T, 1e-5f, KERN_F32, da2, stride, NULL), KVD_EUNSUPPORTED);
        CHECK_INT(kcuda_swiglu_quant(dg2, du, ff - 16, T, types[k], da2, stride, NULL), KVD_EINVAL);
        kcuda_free(dx);
        kcuda_free(dw);
        kcuda_free(do1);
        kcuda_free(do2);
        kcuda_free(da1);
        kcuda_free(da2);
        kcuda_free(dg1);
        kcuda_free(dg2);
        kcuda_free(du);
        free(a1);
        free(a2);
        free(o1);
        free(o2);
    }
    CHECK(same);
    printf("fused rmsnorm+quantize, swiglu+quantize (Q8_0, Q8_1): %s\n",
           same ? "the bits of the two kernels each" : "DIFFER");
    free(x);
    free(w);
    free(u);
}

/* ---- RoPE and the K/V write ------------------------------------------------------- */

#define ROPE_T 9

/* One head's row of `type` from src, as engine/forward.c stores it. */
static void store_row(uint8_t *dst, const float *src, int D, uint32_t type)
{
    if (type == KERN_F32)
        memcpy(dst, src, (size_t)D * sizeof(float));
    else if (type == KERN_F16)
        kern_f32_to_f16_row((kvd_f16 *)dst, src, D);
    else if (type == KERN_Q8_0)
        kern_quantize_act(KERN_Q8_0, src, dst, D);
    else
        kern_quantize_q4_0_lsq(src, dst, D);
}

/* Largest |a - b| over a row's dequantized values, in units of the row's
 * quantization step (its largest block scale; an f16 row: its largest value
 * times 2^-10; an f32 row: times 2^-20, a few of its last bits). */
static double row_steps(const uint8_t *a, const uint8_t *b, int D, uint32_t type)
{
    float fa[KERN_MAX_HEAD_DIM], fb[KERN_MAX_HEAD_DIM];
    kern_dequantize_row(type, a, fa, D);
    kern_dequantize_row(type, b, fb, D);
    double diff = 0, step = 0;
    for (int d = 0; d < D; d++) {
        diff = fmax(diff, fabs((double)fa[d] - fb[d]));
        step = fmax(step, fabs((double)fb[d]));
    }
    step *= type == KERN_F32 ? 0x1p-20 : type == KERN_F16 ? 1.0 / 1024 : type == KERN_Q8_0 ? 1.0 / 127 : 1.0 / 7;
    return diff / fmax(step, 1e-30);
}

/* RoPE and the K/V write into a cache of types k_type / v_type with rotation
 * flags rot, against the C path (kern_rope_angles, kern_rope, kern_hadamard,
 * the store of engine/forward.c): q within 1e-5 normwise, V rows the same
 * bytes (no RoPE before them: rotation and quantization are exact twins), K
 * rows within one quantization step (RoPE's sin and cos may differ in the
 * last bit), and every other byte of the cache untouched. */
static void test_rope(int n_head, int n_kv, int D, int bt, uint32_t k_type, uint32_t v_type, uint32_t rot, bool neox)
{
    const int T = ROPE_T, n_blocks = 40, n_layer = 2, layer = 1;
    const int32_t pos[ROPE_T] = { 0, 1, 15, 16, 17, 300, 4097, 32767, 100000 };
    const float base = 10000.0f;
    const size_t k_row = kern_row_bytes(k_type, D), v_row = kern_row_bytes(v_type, D);
    const size_t k_head = (size_t)bt * k_row, v_head = (size_t)bt * v_row;
    const size_t layer_bytes = (size_t)n_kv * (k_head + v_head), block_bytes = (size_t)n_layer * layer_bytes;
    const size_t cache_bytes = block_bytes * n_blocks;
    uint8_t *cref = malloc(cache_bytes), *cgot = malloc(cache_bytes);
    for (size_t i = 0; i < cache_bytes; i++)
        cref[i] = (uint8_t)rng_u32();
    uint32_t block[ROPE_T];
    for (int t = 0; t < T; t++)
        block[t] = (uint32_t)((t * 7 + 3) % n_blocks);     /* distinct blocks */
    const size_t qn = (size_t)T * n_head * D, kn = (size_t)T * n_kv * D;
    float *q = malloc(qn * sizeof(float)), *k = malloc(kn * sizeof(float)), *v = malloc(kn * sizeof(float));
    for (size_t i = 0; i < qn; i++)
        q[i] = frand() * 4.0f;
    for (size_t i = 0; i < kn; i++) {
        k[i] = frand() * 4.0f;
        v[i] = frand() * 4.0f;
    }
    for (int d = 0; d < D; d += 7)
        v[d] *= 40.0f;                  /* outliers in token 0's first head */
    void *dcache = to_dev(cref, cache_bytes), *dq = to_dev(q, qn * sizeof(float));
    void *dk = to_dev(k, kn * sizeof(float)), *dv = to_dev(v, kn * sizeof(float));
    void *dpos = to_dev(pos, sizeof(pos)), *dblock = to_dev(block, sizeof(block));

    /* the C path, as engine/forward.c's rope_run */
    float cs[KERN_MAX_HEAD_DIM];
    const size_t lk = (size_t)layer * layer_bytes, lv = lk + (size_t)n_kv * k_head;
    for (int t = 0; t < T; t++) {
        float *qt = q + (size_t)t * n_head * D, *kt = k + (size_t)t * n_kv * D, *vt = v + (size_t)t * n_kv * D;
        kern_rope_angles(cs, D, pos[t], base);
        if (neox) {
            kern_rope_neox(qt, n_head, D, cs);
            kern_rope_neox(kt, n_kv, D, cs);
        } else {
            kern_rope(qt, n_head, D, cs);
            kern_rope(kt, n_kv, D, cs);
        }
        for (int h = 0; h < n_head && (rot & KCUDA_ROT_K); h++)
            kern_hadamard(qt + (size_t)h * D, D);
        for (int h = 0; h < n_kv; h++) {
            if (rot & KCUDA_ROT_K)
                kern_hadamard(kt + (size_t)h * D, D);
            if (rot & KCUDA_ROT_V)
                kern_hadamard(vt + (size_t)h * D, D);
            const size_t b0 = (size_t)block[t] * block_bytes, in = (size_t)(pos[t] % bt);
            store_row(cref + b0 + lk + h * k_head + in * k_row, kt + (size_t)h * D, D, k_type);
            store_row(cref + b0 + lv + h * v_head + in * v_row, vt + (size_t)h * D, D, v_type);
        }
    }
    uint8_t *dl = (uint8_t *)dcache + lk;
    struct kcuda_rope_args a = {
        .kv = { .k = dl, .v = dl + (size_t)n_kv * k_head, .block_stride = block_bytes, .k_head_stride = k_head,
                .v_head_stride = v_head, .k_type = k_type, .v_type = v_type, .rotate = rot, .block_tokens = bt,
                .head_dim = D, .n_head = n_head, .n_head_kv = n_kv },
        .q = dq, .k = dk, .v = dv, .pos = dpos, .block = dblock, .T = T,
        .step = powf(base, -2.0f / (float)D), .neox = neox,
    };
    REQUIRE(kcuda_rope_kv(&a, NULL) == 0);
    float *qg = malloc(qn * sizeof(float));
    from_dev(qg, dq, qn * sizeof(float));
    REQUIRE(kcuda_download(cgot, dcache, cache_bytes) == 0);
    double eq = 0;
    for (int t = 0; t < T; t++)
        eq = fmax(eq, normwise(qg + (size_t)t * n_head * D, q + (size_t)t * n_head * D, (size_t)n_head * D));
    CHECK(eq <= 1e-5);
    /* the rows written, then everything else */
    size_t v_differ = 0;
    double k_steps = 0;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < n_kv; h++) {
            const size_t b0 = (size_t)block[t] * block_bytes, in = (size_t)(pos[t] % bt);
            const size_t ko = b0 + lk + h * k_head + in * k_row, vo = b0 + lv + h * v_head + in * v_row;
            v_differ += memcmp(cgot + vo, cref + vo, v_row) != 0;
            k_steps = fmax(k_steps, row_steps(cgot + ko, cref + ko, D, k_type));
            memcpy(cgot + ko, cref + ko, k_row);
            memcpy(cgot + vo, cref + vo, v_row);
        }
    const int untouched = memcmp(cgot, cref, cache_bytes) == 0;
    printf("rope%s %d/%d/%d K %s V %s rotation %u: q worst normwise %.2e; V rows differing %zu; K rows within "
           "%.2f steps; rest %s\n", neox ? " neox" : "", n_head, n_kv, D, kern_type_info(k_type)->name, kern_type_info(v_type)->name, rot, eq,
           v_differ, k_steps, untouched ? "untouched" : "CHANGED");
    CHECK(v_differ == 0);
    CHECK(k_steps <= 1.0);
    CHECK(untouched);
    kcuda_free(dcache);
    kcuda_free(dq);
    kcuda_free(dk);
    kcuda_free(dv);
    kcuda_free(dpos);
    kcuda_free(dblock);
    free(cref);
    free(cgot);
    free(q);
    free(k);
    free(v);
    free(qg);
}

/* ---- the keys of whole blocks turned (context windowing) -------------------------- */

/* Set where the kernels run on the CPU emulation, whose sincosf is the C
 * twin's libm: there every result must be the twin's bits. */
static bool emulated;

/* kcuda_kv_shift against engine_kv_shift's arithmetic (engine/forward.c),
 * row by row: kern_dequantize_row, kern_hadamard where K is rotated,
 * kern_rope_angles(delta) and kern_rope or kern_rope_neox, kern_hadamard
 * again, the store of its type. A cache of 2 layers x 12 blocks whose K rows
 * are valid rows of k_type (random values, a few outliers) and whose other
 * bytes are random; layer 1 of 5 of its blocks is turned. The rows turned
 * must be the twin's bits on the emulation (elsewhere within one step of the
 * type: CUDA's sin and cos may differ in their last bit), every row turned
 * must have changed, and every other byte (V, layer 0, the other blocks) is
 * untouched. */
static void test_kv_shift(int n_kv, int D, int bt, uint32_t k_type, uint32_t rot, bool neox, int32_t delta)
{
    const int n_blocks = 12, n_layer = 2, layer = 1, n_turn = 5;
    const uint32_t turn[5] = { 7, 2, 11, 5, 0 };
    const uint32_t v_type = KERN_Q8_0;
    const float base = neox ? 1000000.0f : 10000.0f;
    const size_t k_row = kern_row_bytes(k_type, D), v_row = kern_row_bytes(v_type, D);
    const size_t k_head = (size_t)bt * k_row, v_head = (size_t)bt * v_row;
    const size_t layer_bytes = (size_t)n_kv * (k_head + v_head), block_bytes = (size_t)n_layer * layer_bytes;
    const size_t cache_bytes = block_bytes * n_blocks;
    uint8_t *cref = malloc(cache_bytes), *corig = malloc(cache_bytes), *cgot = malloc(cache_bytes);
    REQUIRE(cref != NULL && corig != NULL && cgot != NULL);
    for (size_t i = 0; i < cache_bytes; i++)
        cref[i] = (uint8_t)rng_u32();
    float row[KERN_MAX_HEAD_DIM];
    for (int b = 0; b < n_blocks; b++)
        for (int l = 0; l < n_layer; l++)
            for (int h = 0; h < n_kv; h++)
                for (int t = 0; t < bt; t++) {
                    for (int d = 0; d < D; d++)
                        row[d] = frand() * ((d + t) % 29 == 0 ? 30.0f : 3.0f);
                    store_row(cref + (size_t)b * block_bytes + (size_t)l * layer_bytes + (size_t)h * k_head +
                                  (size_t)t * k_row, row, D, k_type);
                }
    memcpy(corig, cref, cache_bytes);
    void *dcache = to_dev(cref, cache_bytes), *dturn = to_dev(turn, sizeof(turn));

    /* the C path, as engine/forward.c's engine_kv_shift */
    float cs[KERN_MAX_HEAD_DIM];
    kern_rope_angles(cs, D, delta, base);
    const size_t lk = (size_t)layer * layer_bytes;
    for (int b = 0; b < n_turn; b++)
        for (int h = 0; h < n_kv; h++)
            for (int t = 0; t < bt; t++) {
                uint8_t *r = cref + (size_t)turn[b] * block_bytes + lk + (size_t)h * k_head + (size_t)t * k_row;
                REQUIRE(kern_dequantize_row(k_type, r, row, D) == 0);
                if (rot & KCUDA_ROT_K)
                    kern_hadamard(row, D);
                if (neox)
                    kern_rope_neox(row, 1, D, cs);
                else
                    kern_rope(row, 1, D, cs);
                if (rot & KCUDA_ROT_K)
                    kern_hadamard(row, D);
                store_row(r, row, D, k_type);
            }
    uint8_t *dl = (uint8_t *)dcache + lk;
    const struct kcuda_kv_shift_args a = {
        .kv = { .k = dl, .v = dl + (size_t)n_kv * k_head, .block_stride = block_bytes, .k_head_stride = k_head,
                .v_head_stride = v_head, .k_type = k_type, .v_type = v_type, .rotate = rot, .block_tokens = bt,
                .head_dim = D, .n_head = n_kv, .n_head_kv = n_kv },
        .blocks = dturn, .n_blocks = n_turn, .delta = delta, .step = powf(base, -2.0f / (float)D), .neox = neox,
    };
    REQUIRE(kcuda_kv_shift(&a, NULL) == 0);
    from_dev(cgot, dcache, cache_bytes);
    size_t rows = 0, differ = 0, unchanged = 0;
    double steps = 0;
    for (int b = 0; b < n_turn; b++)
        for (int h = 0; h < n_kv; h++)
            for (int t = 0; t < bt; t++) {
                const size_t o = (size_t)turn[b] * block_bytes + lk + (size_t)h * k_head + (size_t)t * k_row;
                rows++;
                differ += memcmp(cgot + o, cref + o, k_row) != 0;
                unchanged += memcmp(cgot + o, corig + o, k_row) == 0;
                steps = fmax(steps, row_steps(cgot + o, cref + o, D, k_type));
                memcpy(cgot + o, cref + o, k_row);
            }
    const int untouched = memcmp(cgot, cref, cache_bytes) == 0;
    printf("kv shift%s %d KV heads of %d, %d positions a block, K %s rotation %u, by %d: %zu rows, %zu differ "
           "from the twin's bits (within %.2f steps), %zu unchanged; rest %s\n",
           neox ? " neox" : "", n_kv, D, bt, kern_type_info(k_type)->name, rot, (int)delta, rows, differ, steps,
           unchanged, untouched ? "untouched" : "CHANGED");
    if (emulated)
        CHECK(differ == 0);
    CHECK(steps <= 1.0);
    CHECK(unchanged == 0);
    CHECK(untouched);
    kcuda_free(dcache);
    kcuda_free(dturn);
    free(cref);
    free(corig);
    free(cgot);
}

/* kcuda_kv_shift's refusals: a head dim it has no kernel for, a type it
 * cannot read, no blocks (nothing to do). */
static void test_kv_shift_args(void)
{
    uint32_t *blocks = kcuda_malloc(sizeof(uint32_t));
    uint8_t *k = kcuda_malloc(4096);
    REQUIRE(blocks != NULL && k != NULL);
    struct kcuda_kv_shift_args a = {
        .kv = { .k = k, .v = k, .block_stride = 4096, .k_head_stride = 2048, .v_head_stride = 2048,
                .k_type = KERN_F16, .v_type = KERN_F16, .block_tokens = 16, .head_dim = 96, .n_head = 1,
                .n_head_kv = 1 },
        .blocks = blocks, .n_blocks = 1, .delta = -16, .step = 0.5f,
    };
    CHECK_INT(kcuda_kv_shift(&a, NULL), KVD_EUNSUPPORTED);
    a.kv.head_dim = 64;
    a.kv.k_type = KERN_Q4_1;
    CHECK_INT(kcuda_kv_shift(&a, NULL), KVD_EUNSUPPORTED);
    a.kv.k_type = KERN_F16;
    a.kv.k_head_stride = 1024;      /* 16 rows of 128 bytes do not fit */
    CHECK_INT(kcuda_kv_shift(&a, NULL), KVD_EINVAL);
    a.n_blocks = 0;
    CHECK_INT(kcuda_kv_shift(&a, NULL), 0);
    CHECK_INT(kcuda_sync(), 0);
    kcuda_free(blocks);
    kcuda_free(k);
}

/* kcuda_hadamard against kern_hadamard: the same bits. */
static void test_hadamard(int D)
{
    const int n = 37;
    float *x = malloc((size_t)n * D * sizeof(float)), *got = malloc((size_t)n * D * sizeof(float));
    for (int i = 0; i < n * D; i++)
        x[i] = frand() * (i % 13 == 0 ? 50.0f : 1.0f);
    void *dx = to_dev(x, (size_t)n * D * sizeof(float));
    REQUIRE(kcuda_hadamard(dx, n, D, NULL) == 0);
    from_dev(got, dx, (size_t)n * D * sizeof(float));
    for (int r = 0; r < n; r++)
        kern_hadamard(x + (size_t)r * D, D);
    const int same = memcmp(got, x, (size_t)n * D * sizeof(float)) == 0;
    printf("hadamard of %d vectors of %d: %s\n", n, D, same ? "the twin's bits" : "DIFFER");
    CHECK(same);
    kcuda_free(dx);
    free(x);
    free(got);
}

/* ---- argmax ------------------------------------------------------------------------ */

static void test_argmax(void)
{
    const int n = 49152, T = 8;
    const size_t ld = n + 16;
    float *l = malloc((size_t)T * ld * sizeof(float));
    for (size_t i = 0; i < (size_t)T * ld; i++)
        l[i] = frand() * 10.0f;
    l[1 * ld + 100] = l[1 * ld + 40000] = 50.0f;            /* a tie: lowest index */
    for (int i = 0; i < n; i++)
        l[2 * ld + i] = 1.5f;                               /* all equal: 0 */
    l[3 * ld + 0] = NAN;                                    /* NaN first: 0, as the twin */
    l[4 * ld + 5] = NAN;                                    /* NaN inside: never chosen */
    l[4 * ld + 6] = 99.0f;
    for (int i = 0; i < n; i++)
        l[5 * ld + i] = -INFINITY;                          /* nothing finite */
    l[6 * ld + n - 1] = 1e30f;                              /* the last */
    int32_t got[8], *dids = kcuda_malloc(sizeof(got));
    void *dl = to_dev(l, (size_t)T * ld * sizeof(float));
    REQUIRE(dids != NULL);
    REQUIRE(kcuda_argmax(dids, dl, n, ld, T, NULL) == 0);
    from_dev(got, dids, sizeof(got));
    int same = 0;
    for (int t = 0; t < T; t++) {
        const int32_t want = sampler_argmax(l + (size_t)t * ld, (uint32_t)n);
        CHECK_INT(got[t], want);
        same += got[t] == want;
    }
    printf("argmax: %d of %d rows agree\n", same, T);
    kcuda_free(dids);
    kcuda_free(dl);
    free(l);
}

/* ---- sampled choice -------------------------------------------------------------- */

struct sample_case {
    float temperature;
    int32_t top_k;
    float top_p, min_p, penalty;
};

/* Draws of every case over rows of n logits (each draw its own copy of a
 * row: the kernel penalizes in place) against sampler_pick on the host. */
static void sample_cases(uint32_t n, int kind)
{
    static const struct sample_case cases[] = {
        { 0.0f, 40, 0.95f, 0.05f, 1.3f },       /* greedy after a penalty */
        { 0.8f, 40, 0.95f, 0.05f, 1.0f },       /* the defaults */
        { 0.8f, 40, 0.95f, 0.05f, 1.3f },
        { 1.0f, 1, 1.0f, 0.0f, 1.0f },
        { 1.5f, 1024, 1.0f, 0.0f, 1.0f },       /* the most the device keeps */
        { 0.7f, 200, 0.5f, 0.0f, 0.8f },        /* a penalty below 1 */
        { 1.0f, 0, 0.9f, 0.1f, 1.1f },          /* top-k off: the whole row (small n only) */
        { 2.0f, 37, 1.0f, 0.3f, 1.0f },
    };
    const int n_cases = (int)(sizeof(cases) / sizeof(cases[0]));
    const int seeds = 6, R = n_cases * seeds;
    const size_t ld = n + 8;
    float *base = malloc(ld * sizeof(float)), *l = malloc((size_t)R * ld * sizeof(float));
    struct kcuda_draw *kd = calloc((size_t)R + 1, sizeof(*kd));
    struct sampler_draw *hd = calloc((size_t)R, sizeof(*hd));
    int32_t *pen = malloc((size_t)R * 128 * sizeof(int32_t)), *want = malloc((size_t)R * sizeof(int32_t));
    float *add = calloc((size_t)R * 128, sizeof(float));
    int32_t *got = malloc(((size_t)R + 1) * sizeof(int32_t));
    REQUIRE(base && l && kd && hd && pen && add && want && got);
    for (uint32_t i = 0; i < n; i++) {
        switch (kind) {
        case 0: base[i] = frand() * 8.0f; break;                        /* spread */
        case 1: base[i] = roundf(frand() * 6.0f) * 0.5f; break;          /* many exact ties */
        default: base[i] = (i % 3 == 0 ? -0.0f : 0.0f) + (i % 97 == 0 ? 3.0f : 0.0f); break; /* -0 vs +0 */
        }
    }
    char err[128];
    sampler_t *scratch = NULL;
    struct sampler_params sp = sampler_default_params();
    scratch = sampler_new(&sp, n, err, sizeof(err));
    REQUIRE(scratch != NULL);
    uint32_t np = 0;
    int r = 0, on_device = 0, biased = 0;
    for (int c = 0; c < n_cases; c++) {
        const struct sample_case *sc = &cases[c];
        const uint32_t kk = sc->top_k > 0 && (uint32_t)sc->top_k < n ? (uint32_t)sc->top_k : n;
        for (int sd = 0; sd < seeds; sd++, r++) {
            memcpy(l + (size_t)r * ld, base, n * sizeof(float));
            sp = sampler_default_params();
            sp.temperature = sc->temperature;
            sp.top_k = sc->top_k;
            sp.top_p = sc->top_p;
            sp.min_p = sc->min_p;
            sp.repeat_penalty = sc->penalty;
            sp.seed = 1000u * (uint64_t)c + (uint64_t)sd;
            /* every third seed: OpenAI's additive terms too (the output: the
             * history's last 24), one bias on the row's best id */
            const int32_t best = sampler_argmax(base, n);
            const int32_t bias_ids[3] = { best, (int32_t)((best + n / 2) % n), (int32_t)((best + 1) % n) };
            const float bias[3] = { -100.0f, 5.5f, 0.25f };
            if (sd % 3 == 1) {
                sp.presence_penalty = 0.7f;
                sp.frequency_penalty = -0.4f;
                sp.output_from = 24;
                sp.n_logit_bias = n > 3 ? 3 : 0;
                sp.logit_bias_ids = bias_ids;
                sp.logit_bias = bias;
            }
            sampler_t *smp = sampler_new(&sp, n, err, sizeof(err));
            REQUIRE(smp != NULL);
            int32_t hist[48];
            for (int i = 0; i < 48; i++)
                hist[i] = (int32_t)(rng_u32() % (i % 4 == 0 ? 8u : n));   /* repeats, and ids near the top */
            sampler_plan(smp, hist, 48, &hd[r]);
            want[r] = sampler_pick(scratch, &hd[r], base);
            if (sc->temperature > 0.0f && kk > KCUDA_SAMPLE_MAX_K) {
                kd[r] = (struct kcuda_draw){ .row = -1 };   /* the engine keeps these on the host */
                want[r] = -1;
            } else {
                kd[r] = (struct kcuda_draw){
                    .row = r, .top_k = (int32_t)kk, .temperature = hd[r].temperature, .top_p = hd[r].top_p,
                    .min_p = hd[r].min_p, .repeat_penalty = hd[r].repeat_penalty, .log_min_p = hd[r].log_min_p,
                    .u = hd[r].u, .pen_off = np, .n_pen = hd[r].n_penalized,
                    .bias_off = np + hd[r].n_penalized, .n_bias = hd[r].n_biased,
                };
                memcpy(pen + np, hd[r].penalized, hd[r].n_penalized * sizeof(int32_t));
                np += hd[r].n_penalized;
                memcpy(pen + np, hd[r].biased, hd[r].n_biased * sizeof(int32_t));
                memcpy(add + np, hd[r].bias, hd[r].n_biased * sizeof(float));
                np += hd[r].n_biased;
                biased += hd[r].n_biased > 0;
                on_device++;
            }
            sampler_destroy(&smp);
        }
    }
    kd[R] = (struct kcuda_draw){ .row = -1 };   /* no draw: -1 */
    void *dl = to_dev(l, (size_t)R * ld * sizeof(float));
    void *dd = to_dev(kd, ((size_t)R + 1) * sizeof(*kd));
    void *dp = to_dev(pen, (np ? np : 1) * sizeof(int32_t));
    void *da = to_dev(add, (np ? np : 1) * sizeof(float));
    int32_t *dids = kcuda_malloc(((size_t)R + 1) * sizeof(int32_t));
    REQUIRE(dids != NULL);
    REQUIRE(kcuda_sample(dids, dl, n, ld, dd, R + 1, dp, da, NULL) == 0);
    from_dev(got, dids, ((size_t)R + 1) * sizeof(int32_t));
    int same = 0;
    for (int i = 0; i < R; i++) {
        if (got[i] != want[i] && same + 5 > i)
            fprintf(stderr, "sample n=%u kind %d draw %d (case %d): got %d, want %d\n", n, kind, i, i / seeds,
                    got[i], want[i]);
        CHECK_INT(got[i], want[i]);
        same += got[i] == want[i];
    }
    CHECK_INT(got[R], -1);
    CHECK(n <= 3 || biased > 0);
    printf("sample n=%u rows %d: %d of %d draws agree (%d on the device, %d with addends)\n", n, kind, same, R,
           on_device, biased);
    sampler_destroy(&scratch);
    kcuda_free(dl);
    kcuda_free(dd);
    kcuda_free(dp);
    kcuda_free(da);
    kcuda_free(dids);
    free(add);
    free(base);
    free(l);
    free(kd);
    free(hd);
    free(pen);
    free(want);
    free(got);
}

static void test_sample(void)
{
    for (int kind = 0; kind < 3; kind++) {
        sample_cases(49152, kind);
        sample_cases(1000, kind);
    }
    sample_cases(37, 0);
    /* a NaN in the row: some valid id, no fault */
    const uint32_t n = 4096;
    float *l = malloc(n * sizeof(float));
    REQUIRE(l != NULL);
    for (uint32_t i = 0; i < n; i++)
        l[i] = i % 5 == 0 ? NAN : frand();
    const struct kcuda_draw d = { .row = 0, .top_k = 100, .temperature = 1.0f, .top_p = 0.9f, .min_p = 0.0f,
                                  .repeat_penalty = 1.0f, .u = 0.5 };
    void *dl = to_dev(l, n * sizeof(float)), *dd = to_dev(&d, sizeof(d));
    int32_t *dids = kcuda_malloc(sizeof(int32_t)), id = -2;
    REQUIRE(dids != NULL);
    REQUIRE(kcuda_sample(dids, dl, n, n, dd, 1, NULL, NULL, NULL) == 0);
    from_dev(&id, dids, sizeof(id));
    CHECK(id >= 0 && (uint32_t)id < n);
    kcuda_free(dl);
    kcuda_free(dd);
    kcuda_free(dids);
    free(l);
}

int main(int argc, char **argv)
{
    char why[256];
    if (kcuda_device_count(why, sizeof(why)) == 0) {
        printf("skip: %s\n", why);
        return KVD_TEST_SKIP;
    }
    struct kcuda_info info;
    REQUIRE(kcuda_device_open(0, &info) == 0);
    printf("device: %s (sm_%d%d, %d SMs)\n", info.name, info.major, info.minor, info.sm_count);
    emulated = strstr(info.name, "emulation") != NULL;
    if (argc > 1 && strcmp(argv[1], "--quick") == 0) {
        /* every kernel once on small shapes: for compute-sanitizer (run.sh) */
        static const int Ts[] = { 1, 3, 9 };
        test_quantize();
        test_get_rows();
        test_gemm_shape(KERN_Q4_1, 192, 576, Ts, 3);
        test_gemm_shape(KERN_Q8_0, 33, 1056, Ts, 3);
        test_gemm_shape(KERN_F16, 35, 1544, Ts, 3);
        test_gemm_multi(KERN_Q4_1, 9);
        test_rows();
        test_fused();
        test_rope(9, 3, 64, 16, KERN_F16, KERN_F16, 0, false);
        test_rope(9, 3, 64, 16, KERN_Q4_0, KERN_Q8_0, KCUDA_ROT_K | KCUDA_ROT_V, false);
        test_rope(4, 1, 256, 16, KERN_Q8_0, KERN_F16, 0, true);
        test_hadamard(64);
        test_kv_shift(3, 64, 16, KERN_Q8_0, KCUDA_ROT_K, false, -48);
        test_kv_shift(1, 256, 16, KERN_Q4_0, KCUDA_ROT_K | KCUDA_ROT_V, true, -96);
        test_gemm_shape(KERN_Q5_0, 37, 640, Ts, 3);
        test_gemm_shape(KERN_Q4_K, 19, 9 * 256, Ts, 3);
        test_gemm_shape(KERN_Q6_K, 35, 768, Ts, 3);
        test_argmax();
        sample_cases(1000, 1);
        return CHECK_DONE();
    }
    test_quantize();
    test_get_rows();
    test_gemm();
    test_rows();
    test_fused();
    test_rope(9, 3, 64, 16, KERN_F16, KERN_F16, 0, false);
    test_rope(32, 8, 128, 32, KERN_F16, KERN_F16, 0, false);
    test_rope(9, 3, 64, 16, KERN_Q8_0, KERN_Q8_0, 0, false);
    test_rope(9, 3, 64, 16, KERN_Q8_0, KERN_Q8_0, KCUDA_ROT_K | KCUDA_ROT_V, false);
    test_rope(9, 3, 64, 16, KERN_F16, KERN_Q4_0, KCUDA_ROT_V, false);
    test_rope(32, 8, 128, 32, KERN_Q4_0, KERN_Q4_0, KCUDA_ROT_K | KCUDA_ROT_V, false);
    test_rope(32, 8, 128, 16, KERN_F16, KERN_F16, KCUDA_ROT_K, false);
    /* Gemma 3: NEOX pairs, head dim 256, one KV head */
    test_rope(4, 1, 256, 16, KERN_F16, KERN_F16, 0, true);
    test_rope(4, 1, 256, 16, KERN_Q8_0, KERN_Q4_0, 0, true);
    test_rope(4, 1, 256, 16, KERN_Q8_0, KERN_Q8_0, KCUDA_ROT_K | KCUDA_ROT_V, true);
    test_rope(9, 3, 64, 16, KERN_Q4_0, KERN_F16, KCUDA_ROT_K, true);
    test_rope(8, 2, 128, 16, KERN_F16, KERN_F16, 0, true);
    test_hadamard(64);
    test_hadamard(128);
    test_hadamard(256);
    /* context windowing: every K type, rotated or not, both pair layouts */
    test_kv_shift(3, 64, 16, KERN_F16, 0, false, -48);
    test_kv_shift(2, 128, 16, KERN_F32, 0, false, -1000);
    test_kv_shift(3, 64, 16, KERN_Q8_0, 0, false, -32);
    test_kv_shift(3, 64, 16, KERN_Q8_0, KCUDA_ROT_V, false, -32);   /* V's rotation: K turned plainly */
    test_kv_shift(2, 128, 16, KERN_Q8_0, KCUDA_ROT_K | KCUDA_ROT_V, false, -4096);
    test_kv_shift(2, 128, 32, KERN_Q4_0, KCUDA_ROT_K | KCUDA_ROT_V, false, -256);
    test_kv_shift(1, 256, 16, KERN_F16, 0, true, -96);
    test_kv_shift(1, 256, 16, KERN_Q8_0, KCUDA_ROT_K, true, -2000);
    test_kv_shift(3, 64, 16, KERN_Q4_0, KCUDA_ROT_K, true, -16);
    test_kv_shift(2, 128, 16, KERN_F16, 0, false, 64);                /* later: the other way */
    test_kv_shift_args();
    test_argmax();
    test_sample();
    return CHECK_DONE();
}
