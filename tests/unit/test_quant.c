/*
 * test_quant.c - the reference quantization kernels (kernels/quant.c).
 *
 * Dequantizers against values decoded by an independent implementation
 * (gguf.quants, see scripts/make_quant_vectors.py); quantizer round trips;
 * every dot product against a double dot of the dequantized rows; matmul
 * batch invariance; argument errors.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cpu.h"
#include "err.h"
#include "f16.h"
#include "quant.h"
#include "types.h"

/* ---- deterministic random numbers ----------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static float rng_unit(void) { return (float)((double)(rng_next() >> 11) / 9007199254740992.0 * 2.0 - 1.0); }

static void fill_random(float *x, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = rng_unit() * scale;
    /* an outlier now and then, as real activations have */
    for (int64_t i = 37; i < n; i += 301)
        x[i] *= 8.0f;
}

static const uint32_t weight_types[] = {
    KERN_F32, KERN_F16, KERN_BF16, KERN_Q4_0, KERN_Q4_1, KERN_Q5_0,
    KERN_Q5_1, KERN_Q8_0, KERN_Q4_K, KERN_Q5_K, KERN_Q6_K,
};
#define N_WEIGHT_TYPES (sizeof(weight_types) / sizeof(weight_types[0]))

static const char *tname(uint32_t t) { return kern_type_info(t)->name; }

/* ---- block sizes agree with the type table ---------------------------------- */

static void test_block_sizes(void)
{
    CHECK_INT(kern_type_info(KERN_Q4_0)->block_bytes, sizeof(struct kern_block_q4_0));
    CHECK_INT(kern_type_info(KERN_Q4_1)->block_bytes, sizeof(struct kern_block_q4_1));
    CHECK_INT(kern_type_info(KERN_Q5_0)->block_bytes, sizeof(struct kern_block_q5_0));
    CHECK_INT(kern_type_info(KERN_Q5_1)->block_bytes, sizeof(struct kern_block_q5_1));
    CHECK_INT(kern_type_info(KERN_Q8_0)->block_bytes, sizeof(struct kern_block_q8_0));
    CHECK_INT(kern_type_info(KERN_Q8_1)->block_bytes, sizeof(struct kern_block_q8_1));
    CHECK_INT(kern_type_info(KERN_Q4_K)->block_bytes, sizeof(struct kern_block_q4_k));
    CHECK_INT(kern_type_info(KERN_Q5_K)->block_bytes, sizeof(struct kern_block_q5_k));
    CHECK_INT(kern_type_info(KERN_Q6_K)->block_bytes, sizeof(struct kern_block_q6_k));
    CHECK_INT(kern_type_info(KERN_Q8_K)->block_bytes, sizeof(struct kern_block_q8_k));
}

/* ---- dequantizers against tests/data/quant_vectors.bin ------------------------ */

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static void test_vectors(void)
{
    const char *path = KVD_TEST_DATA "/quant_vectors.bin";
    FILE *f = fopen(path, "rb");
    REQUIRE(f != NULL);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    REQUIRE(len > 16);
    uint8_t *buf = malloc((size_t)len);
    REQUIRE(buf != NULL);
    REQUIRE(fread(buf, 1, (size_t)len, f) == (size_t)len);
    fclose(f);

    REQUIRE(memcmp(buf, "KVDQVEC1", 8) == 0);
    CHECK_INT(rd32(buf + 8), 1);
    const uint32_t n_rec = rd32(buf + 12);
    CHECK(n_rec >= 10);
    size_t off = 16;
    int seen_types = 0;
    for (uint32_t r = 0; r < n_rec; r++) {
        REQUIRE(off + 12 <= (size_t)len);
        const uint32_t type = rd32(buf + off), n = rd32(buf + off + 4), nbytes = rd32(buf + off + 8);
        off += 12;
        REQUIRE(off + nbytes + (size_t)n * 4 <= (size_t)len);
        CHECK_INT(kern_row_bytes(type, n), nbytes);
        /* copy into aligned buffers, as rows in a GGUF mapping are */
        void *row = malloc(nbytes);
        float *want = malloc((size_t)n * sizeof(float));
        float *got = malloc((size_t)n * sizeof(float));
        REQUIRE(row && want && got);
        memcpy(row, buf + off, nbytes);
        memcpy(want, buf + off + nbytes, (size_t)n * 4);
        off += nbytes + (size_t)n * 4;

        CHECK_INT(kern_dequantize_row(type, row, got, n), 0);
        int mismatches = 0;
        for (uint32_t i = 0; i < n; i++)
            if (kvd_f32_bits(got[i]) != kvd_f32_bits(want[i]) && !(got[i] == 0.0f && want[i] == 0.0f)) {
                if (mismatches++ < 3)
                    fprintf(stderr, "%s element %u: got %.9g want %.9g\n", tname(type), i,
                            (double)got[i], (double)want[i]);
            }
        CHECK_INT(mismatches, 0);
        seen_types++;
        free(row);
        free(want);
        free(got);
    }
    CHECK_INT(off, len);
    CHECK_INT(seen_types, n_rec);
    free(buf);
}

/* ---- activation quantizers --------------------------------------------------- */

static void test_act_q8(void)
{
    enum { N = 1024 };
    float x[N], y[N];
    fill_random(x, N, 3.0f);
    for (int i = 64; i < 96; i++)   /* one all-zero block */
        x[i] = 0.0f;

    /* Q8_0 */
    struct kern_block_q8_0 q0[N / 32];
    CHECK_INT(kern_act_row_bytes(KERN_Q8_0, N), sizeof(q0));
    kern_quantize_act(KERN_Q8_0, x, q0, N);
    CHECK_INT(kern_dequantize_row(KERN_Q8_0, q0, y, N), 0);
    for (int b = 0; b < N / 32; b++) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++)
            amax = fmaxf(amax, fabsf(x[32 * b + j]));
        const float d = amax / 127.0f, d16 = kvd_f16_to_f32(q0[b].d);
        CHECK(fabsf(d16 - d) <= d * (1.0f / 1024.0f));
        const float bound = 0.5f * d + 127.0f * fabsf(d16 - d) + 1e-7f;
        for (int j = 0; j < 32; j++) {
            CHECK(q0[b].qs[j] >= -127 && q0[b].qs[j] <= 127);
            CHECK(fabsf(y[32 * b + j] - x[32 * b + j]) <= bound);
        }
    }
    CHECK(q0[2].d == 0 && q0[2].qs[5] == 0);

    /* Q8_1: the same codes and scale, and s = d * sum(q) */
    struct kern_block_q8_1 q1[N / 32];
    CHECK_INT(kern_act_row_bytes(KERN_Q8_1, N), sizeof(q1));
    kern_quantize_act(KERN_Q8_1, x, q1, N);
    for (int b = 0; b < N / 32; b++) {
        CHECK_INT(q1[b].d, q0[b].d);
        CHECK(memcmp(q1[b].qs, q0[b].qs, 32) == 0);
        int sum = 0;
        for (int j = 0; j < 32; j++)
            sum += q1[b].qs[j];
        float amax = 0.0f;
        for (int j = 0; j < 32; j++)
            amax = fmaxf(amax, fabsf(x[32 * b + j]));
        CHECK_INT(q1[b].s, kvd_f32_to_f16((float)sum * (amax / 127.0f)));
    }

    /* Q8_K: d = max/-127 with max the largest-magnitude element; bsums */
    struct kern_block_q8_k *qk = malloc(kern_act_row_bytes(KERN_Q8_K, N));
    REQUIRE(qk != NULL);
    CHECK_INT(kern_act_row_bytes(KERN_Q8_K, N), 4 * sizeof(struct kern_block_q8_k));
    kern_quantize_act(KERN_Q8_K, x, qk, N);
    CHECK_INT(kern_dequantize_row(KERN_Q8_K, qk, y, N), 0);
    for (int b = 0; b < N / 256; b++) {
        const float d = fabsf(qk[b].d);
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int l = 0; l < 16; l++)
                s += qk[b].qs[16 * g + l];
            CHECK_INT(qk[b].bsums[g], s);
        }
        for (int j = 0; j < 256; j++)
            CHECK(fabsf(y[256 * b + j] - x[256 * b + j]) <= 0.5f * d * 1.0001f);
    }
    free(qk);

    /* F32 is a copy */
    float c[N];
    CHECK_INT(kern_act_row_bytes(KERN_F32, N), sizeof(c));
    kern_quantize_act(KERN_F32, x, c, N);
    CHECK(memcmp(c, x, sizeof(c)) == 0);
}

/* ---- weight quantizers: round trip error ---------------------------------------- */

static double rel_rms_error(uint32_t type, const float *x, int64_t n)
{
    void *q = malloc(kern_row_bytes(type, n));
    float *y = malloc((size_t)n * sizeof(float));
    REQUIRE(q && y);
    CHECK_INT(kern_quantize_row(type, x, q, n), 0);
    CHECK_INT(kern_dequantize_row(type, q, y, n), 0);
    double e2 = 0, x2 = 0;
    for (int64_t i = 0; i < n; i++) {
        e2 += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
        x2 += (double)x[i] * x[i];
    }
    free(q);
    free(y);
    return sqrt(e2 / x2);
}

static void test_weight_quantizers(void)
{
    enum { N = 4096 };
    static float x[N];
    fill_random(x, N, 0.05f);
    static const struct { uint32_t type; double max_err; } lim[] = {
        { KERN_F32, 0.0 }, { KERN_F16, 5e-4 }, { KERN_BF16, 3e-3 },
        { KERN_Q4_0, 0.12 }, { KERN_Q4_1, 0.10 }, { KERN_Q5_0, 0.06 }, { KERN_Q5_1, 0.05 },
        { KERN_Q8_0, 0.008 }, { KERN_Q8_1, 0.008 }, { KERN_Q4_K, 0.10 }, { KERN_Q5_K, 0.05 },
        { KERN_Q6_K, 0.03 }, { KERN_Q8_K, 0.02 },
    };
    for (size_t i = 0; i < sizeof(lim) / sizeof(lim[0]); i++) {
        double e = rel_rms_error(lim[i].type, x, N);
        if (!(e <= lim[i].max_err))
            fprintf(stderr, "%s: relative rms error %g > %g\n", tname(lim[i].type), e, lim[i].max_err);
        CHECK(e <= lim[i].max_err);
    }
    /* a constant and an all-zero block survive */
    float z[256] = { 0 }, y[256], q[256]; /* q: room for any row of 256, aligned */
    for (size_t i = 0; i < sizeof(lim) / sizeof(lim[0]); i++) {
        CHECK_INT(kern_quantize_row(lim[i].type, z, q, 256), 0);
        CHECK_INT(kern_dequantize_row(lim[i].type, q, y, 256), 0);
        for (int j = 0; j < 256; j++)
            CHECK(y[j] == 0.0f);
    }
}

/* ---- dot products ------------------------------------------------------------------ */

/* Quantizes `rows` random weight rows of n elements of type wt. */
static void *make_weights(uint32_t wt, int64_t rows, int64_t n, float *wf_out)
{
    const size_t rb = kern_row_bytes(wt, n);
    uint8_t *w = malloc(rb * (size_t)rows);
    REQUIRE(w != NULL);
    float *tmp = malloc((size_t)n * sizeof(float));
    REQUIRE(tmp != NULL);
    for (int64_t r = 0; r < rows; r++) {
        fill_random(tmp, n, 1.0f / sqrtf((float)n));
        /* an offset, so that the minimum terms of Q4_1/Q5_1/Q4_K/Q5_K matter */
        for (int64_t i = 0; i < n; i++)
            tmp[i] += 0.3f / sqrtf((float)n);
        CHECK_INT(kern_quantize_row(wt, tmp, w + rb * (size_t)r, n), 0);
        if (wf_out != NULL)
            CHECK_INT(kern_dequantize_row(wt, w + rb * (size_t)r, wf_out + r * n, n), 0);
    }
    free(tmp);
    return w;
}

static void test_vec_dot(void)
{
    enum { N = 1024 };
    static float x[N], xa[N], wf[N];
    for (size_t ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        const uint32_t wt = weight_types[ti], at = kern_vec_dot_type(wt);
        for (int rep = 0; rep < 4; rep++) {
            void *w = make_weights(wt, 1, N, wf);
            fill_random(x, N, 2.0f);
            const size_t ab = kern_act_row_bytes(at, N);
            REQUIRE(ab > 0);
            void *a = malloc(ab);
            REQUIRE(a != NULL);
            kern_quantize_act(at, x, a, N);
            CHECK_INT(kern_dequantize_row(at, a, xa, N), 0);

            double ref = 0, mag = 0, s_dev = 0;
            for (int i = 0; i < N; i++) {
                ref += (double)wf[i] * xa[i];
                mag += fabs((double)wf[i] * xa[i]);
            }
            if (at == KERN_Q8_1) {
                /* the weight minimum meets the activation sum through the f16
                 * s = d*sum(q), not through d16*sum(q): allow that difference */
                const struct kern_block_q8_1 *q1 = a;
                for (int b = 0; b < N / 32; b++) {
                    int sum = 0;
                    for (int j = 0; j < 32; j++)
                        sum += q1[b].qs[j];
                    const kvd_f16 m16 = wt == KERN_Q4_1 ? ((const struct kern_block_q4_1 *)w)[b].m
                                                        : ((const struct kern_block_q5_1 *)w)[b].m;
                    s_dev += fabs((double)kvd_f16_to_f32(m16)) *
                             fabs((double)kvd_f16_to_f32(q1[b].s) - (double)kvd_f16_to_f32(q1[b].d) * sum);
                }
            }
            const float got = kern_vec_dot(wt, N, w, a);
            const double tol = 2e-6 * mag + s_dev + 1e-9;
            if (!(fabs(got - ref) <= tol))
                fprintf(stderr, "%s: dot %.9g vs reference %.9g (tol %g)\n", tname(wt), (double)got, ref, tol);
            CHECK(fabs(got - ref) <= tol);
            /* the same bits on every call */
            const float again = kern_vec_dot(wt, N, w, a);
            CHECK(kvd_f32_bits(again) == kvd_f32_bits(got));
            free(a);
            free(w);
        }
    }
}

/* ---- matmul: batch invariance ---------------------------------------------------------- */

static void test_matmul(void)
{
    enum { ROWS = 7, N = 512, TOK = 8 };
    static float x[TOK][N], out8[TOK * ROWS], out1[ROWS];
    for (size_t ti = 0; ti < N_WEIGHT_TYPES; ti++) {
        const uint32_t wt = weight_types[ti], at = kern_vec_dot_type(wt);
        void *w = make_weights(wt, ROWS, N, NULL);
        /* padded stride: rows need not be packed */
        const size_t stride = (kern_act_row_bytes(at, N) + 63) / 64 * 64;
        uint8_t *a = malloc(stride * TOK);
        REQUIRE(a != NULL);
        for (int t = 0; t < TOK; t++) {
            fill_random(x[t], N, 1.0f + (float)t);
            kern_quantize_act(at, x[t], a + stride * t, N);
        }
        kern_matmul(wt, w, ROWS, N, a, TOK, stride, out8);
        int diffs = 0;
        for (int t = 0; t < TOK; t++) {
            kern_matmul(wt, w, ROWS, N, a + stride * t, 1, stride, out1);
            for (int r = 0; r < ROWS; r++) {
                const float v = kern_vec_dot(wt, N, (const uint8_t *)w + kern_row_bytes(wt, N) * r,
                                             a + stride * t);
                diffs += kvd_f32_bits(out1[r]) != kvd_f32_bits(out8[t * ROWS + r]);
                diffs += kvd_f32_bits(v) != kvd_f32_bits(out1[r]);
                CHECK(isfinite(out1[r]));
            }
        }
        if (diffs)
            fprintf(stderr, "%s: %d batch-dependent results\n", tname(wt), diffs);
        CHECK_INT(diffs, 0);
        free(a);
        free(w);
    }
}

/* ---- bad arguments ------------------------------------------------------------------------- */

static void test_errors(void)
{
    uint8_t blk[512] = { 0 };
    float y[512];
    CHECK_INT(kern_dequantize_row(KERN_Q4_0, blk, y, 33), KVD_EINVAL);
    CHECK_INT(kern_dequantize_row(KERN_Q4_K, blk, y, 32), KVD_EINVAL);
    CHECK_INT(kern_dequantize_row(KERN_Q4_0, blk, y, -32), KVD_EINVAL);
    CHECK_INT(kern_dequantize_row(KERN_F16, blk, y, -1), KVD_EINVAL);
    CHECK_INT(kern_dequantize_row(KERN_Q2_K, blk, y, 256), KVD_EUNSUPPORTED);
    CHECK_INT(kern_dequantize_row(KERN_I32, blk, y, 4), KVD_EUNSUPPORTED);
    CHECK_INT(kern_dequantize_row(999, blk, y, 32), KVD_EUNSUPPORTED);
    CHECK_INT(kern_dequantize_row(KERN_Q4_0, blk, y, 0), 0);
    CHECK_INT(kern_quantize_row(KERN_Q5_1, y, blk, 48), KVD_EINVAL);
    CHECK_INT(kern_quantize_row(KERN_Q3_K, y, blk, 256), KVD_EUNSUPPORTED);

    CHECK_INT(kern_vec_dot_type(KERN_Q4_0), KERN_Q8_0);
    CHECK_INT(kern_vec_dot_type(KERN_Q5_0), KERN_Q8_0);
    CHECK_INT(kern_vec_dot_type(KERN_Q8_0), KERN_Q8_0);
    CHECK_INT(kern_vec_dot_type(KERN_Q4_1), KERN_Q8_1);
    CHECK_INT(kern_vec_dot_type(KERN_Q5_1), KERN_Q8_1);
    CHECK_INT(kern_vec_dot_type(KERN_Q4_K), KERN_Q8_K);
    CHECK_INT(kern_vec_dot_type(KERN_Q6_K), KERN_Q8_K);
    CHECK_INT(kern_vec_dot_type(KERN_F16), KERN_F32);
    CHECK_INT(kern_vec_dot_type(KERN_BF16), KERN_F32);
    CHECK_INT(kern_vec_dot_type(KERN_Q2_K), KERN_TYPE_LIMIT);
    CHECK_INT(kern_vec_dot_type(KERN_Q8_1), KERN_TYPE_LIMIT);
    CHECK_INT(kern_vec_dot_type(12345), KERN_TYPE_LIMIT);

    CHECK_INT(kern_act_row_bytes(KERN_Q4_0, 32), 0);
    CHECK_INT(kern_act_row_bytes(KERN_Q8_0, 33), 0);
    CHECK_INT(kern_act_row_bytes(KERN_Q8_K, 32), 0);
    CHECK_INT(kern_act_row_bytes(KERN_Q8_0, 64), 68);
    CHECK_INT(kern_act_row_bytes(KERN_Q8_1, 64), 72);

    CHECK(isnan(kern_vec_dot(KERN_Q2_K, 256, blk, blk)));
    CHECK(isnan(kern_vec_dot(KERN_Q4_0, 40, blk, blk)));
    CHECK(isnan(kern_vec_dot(KERN_Q4_0, -32, blk, blk)));
    CHECK(kern_vec_dot(KERN_Q4_0, 0, blk, blk) == 0.0f);

    float out[6];
    kern_matmul(KERN_Q4_0, blk, 2, 40, blk, 3, 64, out);
    for (int i = 0; i < 6; i++)
        CHECK(isnan(out[i]));
    kern_matmul(KERN_Q4_0, blk, 2, 32, blk, 3, 8, out);   /* stride too small */
    for (int i = 0; i < 6; i++)
        CHECK(isnan(out[i]));
    kern_matmul(KERN_Q4_0, blk, 2, 32, blk, 3, 34, out);  /* zeros: fine */
    for (int i = 0; i < 6; i++)
        CHECK(out[i] == 0.0f);
}

/* The AVX2 and AVX-512 activation quantizers write the reference's bytes
 * (Q8_0 and Q8_1; Q8_K on AVX-512):
 * random rows at several scales, rows of ties (values that land exactly on
 * k + 0.5 after scaling), zero rows, tiny and huge values, NaN and infinite
 * elements. N = 26 blocks: a whole group of sixteen for AVX-512 and a tail. */
static void test_act_simd(int which)
{
#if defined(__x86_64__)
    if (kern_isa_best() < (which == 0 ? KERN_ISA_AVX2 : KERN_ISA_AVX512VNNI))
        return;
    bool (*const quant)(uint32_t, const float *, void *, int64_t) =
        which == 0 ? kern_quantize_act_avx2 : kern_quantize_act_avx512;
    /* rows of 26 blocks (a group of sixteen and a tail), 48 (three groups; six Q8_K blocks),
     * 42 (two and a tail) and 5 (a tail alone) */
    static const int blocks[4] = { 26, 48, 42, 5 };
    enum { NMAX = 48 * 32 };
    static float x[NMAX];
    static uint8_t ref[NMAX * 2], got[NMAX * 2];
    const uint32_t types[3] = { KERN_Q8_0, KERN_Q8_1, KERN_Q8_K };
    int mismatches = 0, overruns = 0;
    for (int round = 0; round < 480; round++) {
        const int kind = round % 12, N = 32 * blocks[(round / 12) % 4];
        for (int i = 0; i < N; i++) {
            float r = (float)rand() / (float)RAND_MAX * 2.0f - 1.0f;
            switch (kind) {
            case 0: x[i] = r; break;
            case 1: x[i] = r * 1e-30f; break;                     /* tiny: id overflows to 0 or huge */
            case 2: x[i] = r * 6e4f; break;
            case 3: x[i] = 0.0f; break;
            case 4: x[i] = (float)(rand() % 255 - 127) * 0.5f; break;  /* ties after scaling */
            case 5: x[i] = i % 32 == 0 ? 127.0f : (float)(rand() % 254 - 127) + 0.5f; break;
            case 6: x[i] = r * 1e-40f; break;                     /* subnormal */
            case 7: x[i] = r * 1e-4f; break;                      /* d an f16 subnormal */
            case 8: x[i] = r * 1e-6f; break;                      /* d below f16's range */
            case 9: x[i] = r * 1e10f; break;                      /* d past f16's range */
            case 10: x[i] = r * 3.4e38f; break;                   /* near FLT_MAX */
            default: x[i] = r * (float)(1 << (rand() % 20)); break;
            }
        }
        if (round % 16 == 7) {   /* a NaN, an infinity, and a block with both */
            x[rand() % N] = __builtin_nanf("");
            x[rand() % N] = -__builtin_inff();
            x[N / 2] = __builtin_inff();
            x[N / 2 + 1] = __builtin_nanf("");
        }
        for (int k = 0; k < 3; k++) {
            /* Q8_K: the AVX-512 quantizer's, rows of whole 256-value blocks */
            if (k == 2 && (which == 0 || N % 256 != 0))
                continue;
            const size_t bytes = kern_act_row_bytes(types[k], N);
            REQUIRE(kern_quantize_row(types[k], x, ref, N) == 0);
            memset(got, 0xAA, sizeof(got));
            CHECK(quant(types[k], x, got, N));
            if (memcmp(ref, got, bytes) != 0)
                mismatches++;
            for (size_t i = bytes; i < sizeof(got); i++)
                overruns += got[i] != 0xAA;
        }
    }
    CHECK_INT(mismatches, 0);
    CHECK_INT(overruns, 0);
    CHECK(!quant(KERN_Q8_K, x, got, 832));
    if (which == 0)
        CHECK(!quant(KERN_Q8_K, x, got, 1536));   /* the AVX2 quantizer has no Q8_K */
    CHECK(!quant(KERN_Q8_0, x, got, 48));
#else
    (void)which;
#endif
}

/* The KV q4_0 quantizer: a valid q4_0 row, deterministic, and per block never
 * further from the input (squared error, as dequantized) than the plain
 * max/-8 quantizer, and nearer on most blocks. */
static void test_q4_0_lsq(void)
{
    enum { N = 32 * 64 };
    static float x[N], a[N], b[N];
    static struct kern_block_q4_0 qa[N / 32], qb[N / 32], qc[N / 32];
    srand(9);
    for (int i = 0; i < N; i++)
        x[i] = ((float)rand() / (float)RAND_MAX - 0.5f) * (i % 97 == 5 ? 20.0f : 2.0f);
    for (int i = 0; i < 32; i++)
        x[i] = 0.0f;                    /* an all-zero block */
    kern_quantize_q4_0_lsq(x, qa, N);
    kern_quantize_q4_0_lsq(x, qc, N);
    CHECK(memcmp(qa, qc, sizeof(qa)) == 0);
    REQUIRE(kern_quantize_row(KERN_Q4_0, x, qb, N) == 0);
    REQUIRE(kern_dequantize_row(KERN_Q4_0, qa, a, N) == 0);
    REQUIRE(kern_dequantize_row(KERN_Q4_0, qb, b, N) == 0);
    int nearer = 0;
    for (int blk = 0; blk < N / 32; blk++) {
        double ea = 0, eb = 0;
        for (int j = blk * 32; j < blk * 32 + 32; j++) {
            ea += ((double)x[j] - a[j]) * ((double)x[j] - a[j]);
            eb += ((double)x[j] - b[j]) * ((double)x[j] - b[j]);
        }
        CHECK(ea <= eb * 1.001 + 1e-12);  /* f16 rounding of the scale aside */
        nearer += ea < eb * 0.999;
    }
    for (int j = 0; j < 32; j++)
        CHECK(a[j] == 0.0f);
    CHECK(nearer > N / 32 / 2);
}

/* Rows holding NaN or infinities (a broken model's) quantize without
 * undefined behaviour (UBSan watches this test); a NaN codes as 0 and the
 * finite values beside it keep their codes. */
static void test_non_finite(void)
{
    float x[64];
    for (int i = 0; i < 64; i++)
        x[i] = (float)(i % 7) - 3.0f;
    x[5] = NAN;
    x[40] = INFINITY;
    x[41] = -INFINITY;
    static const uint32_t types[] = { KERN_Q8_0, KERN_Q8_1, KERN_Q4_0, KERN_Q4_1, KERN_Q5_0 };
    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
        uint8_t buf[256];
        float y[64];
        CHECK(kern_quantize_row(types[t], x, buf, 64) == 0);
        kern_dequantize_row(types[t], buf, y, 64);
        for (int i = 0; i < 32; i++)
            if (i != 5)
                CHECK(fabsf(y[i] - x[i]) <= 0.5f);
    }
    uint8_t buf[256];
    kern_quantize_act(KERN_Q8_0, x, buf, 64);
    kern_quantize_act(KERN_Q8_1, x, buf, 64);
    kern_quantize_q4_0_lsq(x, buf, 64);
}

int main(void)
{
    test_non_finite();
    test_block_sizes();
    test_act_simd(0);
    test_act_simd(1);
    test_q4_0_lsq();
    test_vectors();
    test_act_q8();
    test_weight_quantizers();
    test_vec_dot();
    test_matmul();
    test_errors();
    return CHECK_DONE();
}
