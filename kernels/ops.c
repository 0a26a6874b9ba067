/* ops.c - reference C kernels: RMSNorm, RoPE, SwiGLU, the f16 row conversion, the Hadamard rotation. */
#include "ops.h"

#include "cpu.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#include "f16.h"
#include "types.h"

void kern_rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    double ss = 0.0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++)
        out[i] = x[i] * scale * w[i];
}

void kern_rmsnorm_rows(float *out, const float *x, const float *w, int n, float eps, int rows)
{
    /* a row's sum of squares is one chain of dependent double additions;
     * eight rows' chains side by side, each in its own order, give
     * kern_rmsnorm's bits at a fraction of the latency */
    int r = 0;
#if defined(__x86_64__)
    if (kern_isa() >= KERN_ISA_AVX512VNNI)
        r = kern_rmsnorm_rows_avx512(out, x, w, n, eps, rows);
#endif
    for (; r + 8 <= rows; r += 8) {
        const float *xr = x + (size_t)r * n;
        double ss[8] = { 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0 };
        for (int i = 0; i < n; i++)
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                ss[k] += (double)xr[(size_t)k * n + i] * xr[(size_t)k * n + i];
        for (int k = 0; k < 8; k++) {
            const float scale = 1.0f / sqrtf((float)(ss[k] / n) + eps);
            const float *xk = xr + (size_t)k * n;
            float *ok = out + (size_t)(r + k) * n;
#pragma GCC ivdep
            for (int i = 0; i < n; i++)
                ok[i] = xk[i] * scale * w[i];
        }
    }
    for (; r < rows; r++)
        kern_rmsnorm(out + (size_t)r * n, x + (size_t)r * n, w, n, eps);
}

void kern_rope_angles(float *cs, int dim, int32_t pos, float base)
{
    /* the angle advances geometrically per pair; computed by repeated
     * multiplication in f32, as llama.cpp does, to stay close to it */
    const float step = powf(base, -2.0f / (float)dim);
    float theta = (float)pos;
    for (int i = 0; i < dim / 2; i++) {
        cs[2 * i] = cosf(theta);
        cs[2 * i + 1] = sinf(theta);
        theta *= step;
    }
}

void kern_rope(float *x, int n_heads, int dim, const float *cs)
{
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * dim;
        for (int i = 0; i < dim / 2; i++) {
            float c = cs[2 * i], s = cs[2 * i + 1];
            float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * c - b * s;
            v[2 * i + 1] = a * s + b * c;
        }
    }
}

void kern_rope_neox(float *x, int n_heads, int dim, const float *cs)
{
    const int half = dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * dim;
        for (int i = 0; i < half; i++) {
            float c = cs[2 * i], s = cs[2 * i + 1];
            float a = v[i], b = v[i + half];
            v[i] = a * c - b * s;
            v[i + half] = a * s + b * c;
        }
    }
}

/* GELU of every half, rounded to a half (kept as f32): llama.cpp's table */
static float gelu_half[65536];
static pthread_once_t gelu_once = PTHREAD_ONCE_INIT;

static void gelu_fill(void)
{
    const float k = 0.79788456080286535588f;    /* sqrt(2 / pi) */
    for (uint32_t u = 0; u < 65536; u++) {
        const float h = kvd_f16_to_f32((uint16_t)u);
        const float g = 0.5f * h * (1.0f + tanhf(k * h * (1.0f + 0.044715f * h * h)));
        gelu_half[u] = kvd_f16_to_f32(kvd_f32_to_f16(g));
    }
}

const float *kern_gelu_table(void)
{
    pthread_once(&gelu_once, gelu_fill);
    return gelu_half;
}

void kern_geglu(float *gate, const float *up, int n)
{
    const float *t = kern_gelu_table();
#if defined(__x86_64__)
    if (kern_isa() >= KERN_ISA_AVX512VNNI) {
        kern_geglu_avx512(gate, up, n, t);
        return;
    }
    if (kern_isa() >= KERN_ISA_AVX2) {
        kern_geglu_avx2(gate, up, n, t);
        return;
    }
#endif
    for (int i = 0; i < n; i++) {
        const float x = gate[i];
        const float g = x <= -10.0f ? 0.0f : x >= 10.0f ? x : t[kvd_f32_to_f16(x)];
        gate[i] = g * up[i];
    }
}

void kern_swiglu(float *gate, const float *up, int n)
{
#if defined(__x86_64__)
    if (kern_isa() >= KERN_ISA_AVX512VNNI) {
        kern_swiglu_avx512(gate, up, n);
        return;
    }
    if (kern_isa() >= KERN_ISA_AVX2) {
        kern_swiglu_avx2(gate, up, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

void kern_f32_to_f16_row(uint16_t *dst, const float *src, int n)
{
#if defined(__x86_64__)
    if (kern_isa() >= KERN_ISA_AVX512VNNI) {
        kern_f32_to_f16_avx512(dst, src, n);
        return;
    }
    if (kern_isa() >= KERN_ISA_AVX2) {
        kern_f32_to_f16_avx2(dst, src, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++)
        dst[i] = kvd_f32_to_f16(src[i]);
}

void kern_hadamard(float *x, int n)
{
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float s = (float)(1.0 / sqrt((double)n));
    for (int i = 0; i < n; i++)
        x[i] *= s;
}
