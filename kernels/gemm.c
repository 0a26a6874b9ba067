/* gemm.c - dispatch of the matrix products, and the portable path. */
#include "gemm.h"

#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "quant.h"
#include "quant_blocks.h"
#include "types.h"

size_t kern_gemm_scratch_bytes(int64_t n, int T)
{
    /* unpacked row: n bytes of codes, n floats (float types), n/16 + n/32
     * scales; activations: T * n/32 scales and sums, n/32 offsets, T * n
     * bytes of values, T * n/64 pair-scale vectors of 16 floats; rounded up
     * per part to 64 bytes */
    size_t nb = (size_t)(n + 31) / 32;
    return (size_t)n + 64 + (size_t)n * 4 + 64 + (2 * nb + nb) * 4 + 192 +
           (size_t)T * nb * 8 + 128 + nb * 4 + 64 + (size_t)T * (size_t)n + 64 +
           (size_t)T * nb * 32 + 64;
}

static void gemm_c(const struct kern_gemm_args *a)
{
    for (long r = a->r0; r < a->r1; r++) {
        const uint8_t *wr = a->w + (size_t)r * a->row_bytes;
        for (int t = 0; t < a->T; t++) {
            float d = kern_vec_dot(a->wtype, a->n, wr, a->act + (size_t)t * a->act_stride);
            float *o = a->out + (size_t)t * a->ldo + r;
            *o = a->add ? *o + d : d;
        }
    }
}

/* ---- packed weights ---------------------------------------------------------- */

static size_t group_bytes(uint32_t wtype, int64_t nb)
{
    size_t per_block = wtype == KERN_Q4_1 ? 256 + 32 + 32 : 512 + 32;
    return ((size_t)nb * per_block + 63) / 64 * 64;
}

struct kern_packed *kern_pack(uint32_t wtype, const void *w, size_t row_bytes, int64_t rows, int64_t n)
{
    /* Q4_0 and Q5_0 rows are signed codes and one scale per 32 values, like
     * Q8_0's: they are packed as Q8_0 (their products with Q8_0 activations
     * are the same integer sums and scales) */
    const bool as_q8 = wtype == KERN_Q4_0 || wtype == KERN_Q5_0;
    if (kern_isa_best() < KERN_ISA_SIMD || (wtype != KERN_Q4_1 && wtype != KERN_Q8_0 && !as_q8) ||
        n <= 0 || n % 32 != 0 || rows <= 0 || row_bytes != kern_row_bytes(wtype, n))
        return NULL;
    const int64_t nb = n / 32, groups = (rows + KERN_PACK_ROWS - 1) / KERN_PACK_ROWS;
    struct kern_packed *p = calloc(1, sizeof(*p));
    int8_t *codes = as_q8 ? malloc((size_t)n) : NULL;
    float *scales = as_q8 ? malloc((size_t)nb * sizeof(float)) : NULL;
    if (p == NULL || (as_q8 && (codes == NULL || scales == NULL))) {
        free(p);
        free(codes);
        free(scales);
        return NULL;
    }
    const uint32_t src = wtype;
    if (as_q8)
        wtype = KERN_Q8_0;  /* the layout */
    p->wtype = wtype;
    p->rows = rows;
    p->n = n;
    p->group_bytes = group_bytes(wtype, nb);
    const size_t total = p->group_bytes * (size_t)groups;
    p->data = aligned_alloc(64, total);
    if (p->data == NULL) {
        free(p);
        free(codes);
        free(scales);
        return NULL;
    }
    memset(p->data, 0, total);  /* padding rows: zero codes, zero scales */
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *g = p->data + (size_t)(r / KERN_PACK_ROWS) * p->group_bytes;
        const int i = (int)(r % KERN_PACK_ROWS);
        const uint8_t *row = (const uint8_t *)w + (size_t)r * row_bytes;
        if (as_q8) {
            /* scales came from halves: back to the same halves */
            kern_unpack_row(src, row, n, codes, scales, NULL);
            for (int64_t b = 0; b < nb; b++) {
                for (int k = 0; k < 8; k++)
                    for (int x = 0; x < 4; x++)
                        g[(size_t)b * 512 + 64 * k + 4 * i + x] = (uint8_t)(codes[32 * b + 4 * k + x] ^ 0x80);
                ((kvd_f16 *)(g + (size_t)nb * 512) + b * 16)[i] = kvd_f32_to_f16(scales[b]);
            }
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            if (wtype == KERN_Q4_1) {
                const struct kern_block_q4_1 *blk = (const struct kern_block_q4_1 *)row + b;
                for (int j = 0; j < 4; j++)
                    memcpy(g + (size_t)b * 256 + 64 * j + 4 * i, blk->qs + 4 * j, 4);
                kvd_f16 *d = (kvd_f16 *)(g + (size_t)nb * 256) + b * 16;
                kvd_f16 *m = (kvd_f16 *)(g + (size_t)nb * 288) + b * 16;
                d[i] = blk->d;
                m[i] = blk->m;
            } else {
                const struct kern_block_q8_0 *blk = (const struct kern_block_q8_0 *)row + b;
                for (int k = 0; k < 8; k++)
                    for (int x = 0; x < 4; x++)
                        g[(size_t)b * 512 + 64 * k + 4 * i + x] = (uint8_t)(blk->qs[4 * k + x] ^ 0x80);
                kvd_f16 *d = (kvd_f16 *)(g + (size_t)nb * 512) + b * 16;
                d[i] = blk->d;
            }
        }
    }
    free(codes);
    free(scales);
    return p;
}

struct kern_unpacked *kern_unpack_matrix(uint32_t wtype, const void *w, size_t row_bytes, int64_t rows, int64_t n)
{
    const bool kq = wtype == KERN_Q4_K || wtype == KERN_Q5_K || wtype == KERN_Q6_K;
#if defined(__x86_64__)
    const bool rowwise = kern_isa_best() >= KERN_ISA_AVX2;
#else
    const bool rowwise = false;  /* only the x86 paths read unpacked rows */
#endif
    if (!rowwise || (!kq && wtype != KERN_Q4_0 && wtype != KERN_Q5_0) || n <= 0 ||
        n % (kq ? 256 : 32) != 0 || rows <= 0 || row_bytes != kern_row_bytes(wtype, n))
        return NULL;
    struct kern_unpacked *u = calloc(1, sizeof(*u));
    if (u == NULL)
        return NULL;
    const int64_t nb = n / 32;
    u->wtype = wtype;
    u->rows = rows;
    u->n = n;
    u->d_stride = (size_t)(2 * nb);
    u->m_stride = (size_t)nb;
    u->q = aligned_alloc(64, ((size_t)rows * (size_t)n + 63) / 64 * 64);
    u->d = malloc((size_t)rows * u->d_stride * sizeof(float));
    u->m = malloc((size_t)rows * u->m_stride * sizeof(float));
    if (u->q == NULL || u->d == NULL || u->m == NULL) {
        kern_unpacked_free(&u);
        return NULL;
    }
    for (int64_t r = 0; r < rows; r++)
        kern_unpack_row(wtype, (const uint8_t *)w + (size_t)r * row_bytes, n, u->q + (size_t)r * (size_t)n,
                        u->d + (size_t)r * u->d_stride, u->m + (size_t)r * u->m_stride);
    return u;
}

void kern_unpacked_free(struct kern_unpacked **up)
{
    if (up == NULL || *up == NULL)
        return;
    free((*up)->q);
    free((*up)->d);
    free((*up)->m);
    free(*up);
    *up = NULL;
}

size_t kern_unpacked_bytes(const struct kern_unpacked *u)
{
    return u ? (size_t)u->rows * ((size_t)u->n + (u->d_stride + u->m_stride) * sizeof(float)) : 0;
}

void kern_pack_free(struct kern_packed **pp)
{
    if (pp == NULL || *pp == NULL)
        return;
    free((*pp)->data);
    free(*pp);
    *pp = NULL;
}

size_t kern_pack_bytes(const struct kern_packed *p)
{
    return p ? p->group_bytes * (size_t)((p->rows + KERN_PACK_ROWS - 1) / KERN_PACK_ROWS) : 0;
}

void kern_gemm_isa(const struct kern_gemm_args *a, int isa)
{
#if defined(__x86_64__)
    if (isa >= KERN_ISA_AVX512VNNI && a->packed != NULL && kern_gemm_packed_vnni(a))
        return;
    if (isa >= KERN_ISA_AVX512VNNI && kern_gemm_avx512vnni(a))
        return;
    if (isa == KERN_ISA_AVX2 && a->packed != NULL &&
        (kern_avxvnni() ? kern_gemm_packed_avxvnni(a) : kern_gemm_packed_avx2(a)))
        return;
    if (isa >= KERN_ISA_AVX2 && kern_gemm_avx2(a))
        return;
#elif defined(__aarch64__)
    if (isa >= KERN_ISA_I8MM && a->packed != NULL && kern_gemm_packed_i8mm(a))
        return;
    if (isa >= KERN_ISA_NEON && a->packed != NULL && kern_gemm_packed_neon(a))
        return;
#endif
    gemm_c(a);
}

void kern_gemm(const struct kern_gemm_args *a)
{
    kern_gemm_isa(a, kern_isa());
}
