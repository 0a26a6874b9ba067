/* ops.c - reference C kernels: RMSNorm, RoPE, SwiGLU, paged attention. */
#include "ops.h"

#include "cpu.h"

#include <math.h>
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

void kern_swiglu(float *gate, const float *up, int n)
{
#if defined(__x86_64__)
    if (kern_isa() >= KERN_ISA_AVX512VNNI) {
        kern_swiglu_avx512(gate, up, n);
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
#endif
    for (int i = 0; i < n; i++)
        dst[i] = kvd_f32_to_f16(src[i]);
}

/* Loads element j of a head row of dtype. */
static inline float kv_at(const uint8_t *row, int j, uint32_t dtype)
{
    if (dtype == KERN_F16) {
        kvd_f16 h;
        memcpy(&h, row + 2 * (size_t)j, 2);
        return kvd_f16_to_f32(h);
    }
    float f;
    memcpy(&f, row + 4 * (size_t)j, 4);
    return f;
}

void kern_attn_paged(float *out, const float *q, const uint8_t *k_base, const uint8_t *v_base,
                     const uint32_t *blocks, int n_ctx, int block_tokens, int head_dim,
                     int kv_head, uint64_t block_stride, uint64_t head_stride,
                     uint32_t kv_dtype, float scale, float *scores, float *stats)
{
    const size_t elem = kv_dtype == KERN_F16 ? 2 : 4;
    const size_t row_bytes = (size_t)head_dim * elem;
    /* q.k and p.v are computed in the cache's precision: over an f16 cache
     * the query and the probabilities are rounded to f16 too (products of
     * halves, f32 sums), as llama.cpp's CPU attention does */
    const bool half = kv_dtype == KERN_F16;
    float qh[KERN_MAX_HEAD_DIM];
    if (half) {
        for (int d = 0; d < head_dim; d++)
            qh[d] = kvd_f16_to_f32(kvd_f32_to_f16(q[d]));
        q = qh;
    }
    float max = -INFINITY;
    for (int j = 0; j < n_ctx; j++) {
        const uint8_t *k = k_base + blocks[j / block_tokens] * block_stride +
                           (uint64_t)kv_head * head_stride + (size_t)(j % block_tokens) * row_bytes;
        float s = 0.0f;
        for (int d = 0; d < head_dim; d++)
            s += q[d] * kv_at(k, d, kv_dtype);
        s *= scale;
        scores[j] = s;
        if (s > max)
            max = s;
    }
    double sum = 0.0;
    for (int j = 0; j < n_ctx; j++) {
        float e = expf(scores[j] - max);
        scores[j] = e;
        sum += e;
    }
    const float inv = (float)(1.0 / sum);
    if (stats != NULL) {
        stats[0] = max;
        stats[1] = (float)sum;
    }
    for (int d = 0; d < head_dim; d++)
        out[d] = 0.0f;
    for (int j = 0; j < n_ctx; j++) {
        const uint8_t *v = v_base + blocks[j / block_tokens] * block_stride +
                           (uint64_t)kv_head * head_stride + (size_t)(j % block_tokens) * row_bytes;
        const float p = half ? kvd_f16_to_f32(kvd_f32_to_f16(scores[j] * inv)) : scores[j] * inv;
        for (int d = 0; d < head_dim; d++)
            out[d] += p * kv_at(v, d, kv_dtype);
    }
}
