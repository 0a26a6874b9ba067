/*
 * test_ops.c - the element-wise kernels' fast paths against their scalar
 * definitions: SwiGLU within a few ulp over the whole useful range (and its
 * limits), and the f32 -> f16 row conversion bit for bit on random bit
 * patterns, halfway cases, subnormals, overflow and infinities.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cpu.h"
#include "f16.h"
#include "ops.h"

static uint32_t rng = 12345;
static uint32_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}

static void test_swiglu(void)
{
    enum { N = 4099 };  /* not a multiple of 16: the masked tail too */
    static float gate[N], up[N], got[N];
    int bad = 0;
    for (int round = 0; round < 40; round++) {
        for (int i = 0; i < N; i++) {
            const float scale = round < 20 ? 8.0f : 120.0f;  /* past exp's range too */
            gate[i] = ((float)(next() % 200001) / 100000.0f - 1.0f) * scale;
            up[i] = (float)(next() % 2001) / 1000.0f - 1.0f;
        }
        memcpy(got, gate, sizeof(got));
        kern_swiglu(got, up, N);
        for (int i = 0; i < N; i++) {
            const double g = gate[i];
            const double want = g / (1.0 + exp(-g)) * up[i];
            if (!(fabs(got[i] - want) <= 4e-6 * fabs(want) + 1e-30))
                bad++;
        }
    }
    CHECK_INT(bad, 0);
    float lim[4] = { -1000.0f, 1000.0f, 0.0f, -0.0f }, one[4] = { 1, 1, 1, 1 };
    kern_swiglu(lim, one, 4);
    CHECK(fabsf(lim[0]) < 1e-30f && lim[1] == 1000.0f && lim[2] == 0.0f && lim[3] == 0.0f);
}

/* GELU at llama.cpp's precision, by its definition: the same bits on every
 * path, whatever the table or the gathers. */
static void test_geglu(void)
{
    enum { N = 4099 };
    static float gate[N], up[N], got[N];
    int bad = 0;
    const float k = 0.79788456080286535588f;
    for (int round = 0; round < 20; round++) {
        for (int i = 0; i < N; i++) {
            const float scale = round < 10 ? 4.0f : 30.0f;     /* both sides of +-10 too */
            gate[i] = ((float)(next() % 200001) / 100000.0f - 1.0f) * scale;
            up[i] = (float)(next() % 2001) / 1000.0f - 1.0f;
        }
        gate[0] = -10.0f, gate[1] = 10.0f, gate[2] = 9.999f, gate[3] = -0.0f;
        memcpy(got, gate, sizeof(got));
        kern_geglu(got, up, N);
        for (int i = 0; i < N; i++) {
            const float x = gate[i], h = kvd_f16_to_f32(kvd_f32_to_f16(x));
            const float g = x <= -10.0f ? 0.0f
                            : x >= 10.0f ? x
                                         : kvd_f16_to_f32(kvd_f32_to_f16(
                                               0.5f * h * (1.0f + tanhf(k * h * (1.0f + 0.044715f * h * h)))));
            bad += memcmp(&got[i], &(float){ g * up[i] }, sizeof(float)) != 0;
        }
    }
    CHECK_INT(bad, 0);
}

static void test_f16_row(void)
{
    enum { N = 1000 };
    static float src[N];
    static uint16_t got[N];
    int bad = 0;
    for (int round = 0; round < 2000; round++) {
        for (int i = 0; i < N; i++) {
            uint32_t u = next();
            switch (round % 4) {
            case 1: u = (u & 0x80000000u) | (0x33000000u + (u & 0x0fffffffu)); break; /* f16 subnormals */
            case 2: u = (u & 0x80000000u) | (0x47000000u + (u & 0x01ffffffu)); break; /* near 65504 */
            case 3: u = (u & 0xffffe000u) | 0x1000u; break;                       /* exact halfway */
            default: break;
            }
            if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu) != 0)
                u &= 0xff800000u;  /* NaN payloads are not specified: make it an infinity */
            memcpy(&src[i], &u, 4);
        }
        kern_f32_to_f16_row(got, src, N);
        for (int i = 0; i < N; i++)
            bad += got[i] != kvd_f32_to_f16(src[i]);
    }
    CHECK_INT(bad, 0);
}

/* RMS norm of many rows at once: kern_rmsnorm's bits row by row, in place
 * or not, for row counts around the eight it takes together, at the widths
 * of real models (and odd ones), over values of very different sizes. */
static void test_rmsnorm_rows(void)
{
    enum { RMAX = 21, NMAX = 1536 };
    static float x[RMAX * NMAX], w[NMAX], got[RMAX * NMAX], want[RMAX * NMAX];
    const int widths[] = { 64, 256, 576, 640, 1536, 37 };
    int bad = 0, cases = 0;
    for (size_t wi = 0; wi < sizeof(widths) / sizeof(widths[0]); wi++)
        for (int rows = 1; rows <= RMAX; rows += 2) {
            const int n = widths[wi];
            for (int i = 0; i < rows * n; i++)
                x[i] = ((float)(next() % 200001) / 100000.0f - 1.0f) * (float)(1u << (next() % 24)) * 1e-3f;
            for (int i = 0; i < n; i++)
                w[i] = (float)(next() % 2001) / 1000.0f;
            for (int r = 0; r < rows; r++)
                kern_rmsnorm(want + (size_t)r * n, x + (size_t)r * n, w, n, 1e-6f);
            kern_rmsnorm_rows(got, x, w, n, 1e-6f, rows);
            bad += memcmp(got, want, (size_t)rows * n * sizeof(float)) != 0;
            kern_rmsnorm_rows(x, x, w, n, 1e-6f, rows);   /* in place */
            bad += memcmp(x, want, (size_t)rows * n * sizeof(float)) != 0;
            cases++;
        }
    CHECK_INT(bad, 0);
    CHECK(cases == 66);
}

int main(void)
{
    for (int isa = KERN_ISA_C; isa <= (int)kern_isa_best(); isa++) {
        kern_isa_set((enum kern_isa)isa);
        fprintf(stderr, "path %s\n", kern_isa_name(kern_isa()));
        test_rmsnorm_rows();
        test_swiglu();
        test_geglu();
        test_f16_row();
    }
    return CHECK_DONE();
}
