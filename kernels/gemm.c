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
     * per part to 64 bytes; for the AMX products the values of up to 15
     * more tokens, two groups' codes as bytes (32 n), two tiles of
     * sums (2 KiB) and the activations' scales and mins by tile; for five-bit
     * Q5_0 and Q5_K and six-bit Q6_K, a group widened to the byte layout (17
     * n, 20 n: widening runs from 5 tokens on, one group a tile) */
    size_t nb = (size_t)(n + 31) / 32;
    return (size_t)n + 64 + (size_t)n * 4 + 64 + (2 * nb + nb) * 4 + 192 +
           (size_t)T * nb * 8 + 128 + nb * 4 + 64 + (size_t)T * (size_t)n + 64 +
           (size_t)T * nb * 32 + 64 + 15 * (size_t)n + 32 * (size_t)n + 2048 + 128 +
           ((size_t)T + 15) * nb * 8 + 128 + 20 * (size_t)n + 128;
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
    const size_t per_block = kern_pk_code_bytes(wtype) + kern_pk_scale_bytes(wtype) + kern_pk_min_bytes(wtype);
    const size_t super = (size_t)nb / 8 * kern_pk_super_bytes(wtype);  /* d (dmin) per 8 blocks */
    return ((size_t)nb * per_block + super + 63) / 64 * 64;
}

/* Whether a matrix of wtype with rows of n values has a packed layout. */
static bool packs(uint32_t wtype, int64_t n)
{
    switch (wtype) {
    case KERN_Q4_1: case KERN_Q8_0: case KERN_Q4_0: case KERN_Q5_0:
        return n % 32 == 0;
    case KERN_Q4_K: case KERN_Q5_K: case KERN_Q6_K:
        return n % 256 == 0;
    default:
        return false;
    }
}

static int narrow_choice = -1;  /* kern_pack_narrow_set's; -1: not set */

bool kern_pack_narrow(uint32_t wtype)
{
    if (wtype != KERN_Q4_0 && wtype != KERN_Q5_0 && wtype != KERN_Q4_K && wtype != KERN_Q5_K && wtype != KERN_Q6_K)
        return false;
    if (narrow_choice >= 0)
        return narrow_choice;
#if defined(__x86_64__)
    if (kern_isa() >= KERN_ISA_AVX512VNNI && kern_amx())
        return false;  /* the tiles read bytes */
    return kern_isa() >= (wtype == KERN_Q4_0 ? KERN_ISA_AVX2 : KERN_ISA_AVX512VNNI);
#else
    return false;
#endif
}

int kern_pack_narrow_set(int choice)
{
    const int was = narrow_choice;
#if defined(__x86_64__)
    narrow_choice = choice < 0 ? -1 : choice > 0;
#else
    narrow_choice = choice < 0 ? -1 : 0;
#endif
    return was;
}

/* A K-quant row's scales as its file holds them (kern_unpack_k_scales): the
 * narrow K-quant layouts store these rather than their float products. */
struct file_scales {
    uint8_t *sc, *mn;       /* per 32 values (Q6_K: sc per 16, its int8 as bytes) */
    kvd_f16 *d, *dmin;      /* per 256 values */
};

/* Stores row i of a group from its unpacked form: codes, scales d (per part)
 * and mins m of each block, in the layout of p->wtype (the narrow K-quants'
 * from fs instead of d and m). */
static void pack_row(const struct kern_packed *p, uint8_t *g, int i, const int8_t *codes, const float *d,
                     const float *m, const struct file_scales *fs)
{
    const uint32_t wt = p->wtype;
    const int64_t nb = p->n / 32;
    const int parts = kern_pk_parts(wt);
    const size_t cb = kern_pk_code_bytes(wt), sb = kern_pk_scale_bytes(wt);
    /* Q8_0's signed codes as unsigned (q + 128); Q6_K's as q + 32; others as they are */
    const int bias = wt == KERN_Q8_0 ? 128 : wt == KERN_Q6_K ? 32 : 0;
    const int nbias = wt == KERN_Q4_0 ? 8 : 0;  /* nibbles: Q4_0's value + 8, the others as they are */
    if (wt == KERN_PK_Q6_K6) {
        /* codes q + 32: low nibbles as Q4_1's, the high two bits in two
         * vectors; the file's int8 scales and f16 d as they are */
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *q = codes + 32 * b;
            uint8_t *c = g + (size_t)b * cb + 4 * i;
            for (int j = 0; j < 4; j++)
                for (int x = 0; x < 4; x++) {
                    const int lo = q[4 * j + x] + 32, hi = q[16 + 4 * j + x] + 32;
                    c[64 * j + x] = (uint8_t)((lo & 15) | (hi & 15) << 4);
                    c[256 + 64 * 0 + x] |= (uint8_t)((lo >> 4) << (2 * j));
                    c[256 + 64 * 1 + x] |= (uint8_t)((hi >> 4) << (2 * j));
                }
            uint8_t *sc = g + (size_t)nb * cb + (size_t)b * sb;
            sc[i] = fs->sc[2 * b];
            sc[16 + i] = fs->sc[2 * b + 1];
            if (b % 8 == 0)
                memcpy(g + (size_t)nb * (cb + sb) + (size_t)(b / 8) * 32 + 2 * i, &fs->d[b / 8], 2);
        }
        return;
    }
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *q = codes + 32 * b;
        uint8_t *c = g + (size_t)b * cb + 4 * i;
        if (wt == KERN_Q5_0 || wt == KERN_PK_Q5_KS) {
            /* Q5_0's value + 16, Q5_K's codes as they are: the low nibbles
             * as Q4_1's, the fifth bits in masks */
            const int off = wt == KERN_Q5_0 ? 16 : 0;
            uint8_t *bits = g + (size_t)b * cb + 256;
            for (int k = 0; k < 8; k++)
                for (int x = 0; x < 4; x++) {
                    const int v = q[4 * k + x] + off;
                    if (k < 4)
                        c[64 * k + x] = (uint8_t)((v & 15) | ((q[16 + 4 * k + x] + off) & 15) << 4);
                    bits[8 * k + (4 * i + x) / 8] |= (uint8_t)((v >> 4) << ((4 * i + x) % 8));
                }
        } else
            for (int k = 0; k < (kern_pk_nibbles(wt) ? 4 : 8); k++)
                for (int x = 0; x < 4; x++)
                    c[64 * k + x] = kern_pk_nibbles(wt)
                                        ? (uint8_t)((q[4 * k + x] + nbias) | (q[16 + 4 * k + x] + nbias) << 4)
                                        : (uint8_t)(q[4 * k + x] + bias);
        if (wt == KERN_PK_Q4_KS || wt == KERN_PK_Q5_KS) {
            /* the file's 6-bit scale and minimum, a byte each; d and dmin per 8 blocks */
            g[(size_t)nb * cb + (size_t)b * sb + i] = fs->sc[b];
            g[(size_t)nb * (cb + sb) + (size_t)b * 16 + i] = fs->mn[b];
            if (b % 8 == 0) {
                uint8_t *sup = g + (size_t)nb * (cb + sb + 16) + (size_t)(b / 8) * 64;
                memcpy(sup + 2 * i, &fs->d[b / 8], 2);
                memcpy(sup + 32 + 2 * i, &fs->dmin[b / 8], 2);
            }
            continue;
        }
        for (int part = 0; part < parts; part++) {
            uint8_t *s = g + (size_t)nb * cb + (size_t)b * sb;
            if (kern_pk_f32(wt))
                ((float *)s + 16 * part)[i] = d[parts * b + part];
            else
                ((kvd_f16 *)s)[i] = kvd_f32_to_f16(d[b]);  /* the file's half, back exactly */
        }
        if (kern_pk_mins(wt)) {
            uint8_t *s = g + (size_t)nb * (cb + sb) + (size_t)b * kern_pk_min_bytes(wt);
            if (kern_pk_f32(wt))
                ((float *)s)[i] = m[b];
            else
                ((kvd_f16 *)s)[i] = kvd_f32_to_f16(m[b]);
        }
    }
}

struct kern_packed *kern_pack(uint32_t wtype, const void *w, size_t row_bytes, int64_t rows, int64_t n)
{
    if (kern_isa_best() < KERN_ISA_SIMD || n <= 0 || rows <= 0 || !packs(wtype, n) ||
        row_bytes != kern_row_bytes(wtype, n))
        return NULL;
    const int64_t nb = n / 32, groups = (rows + KERN_PACK_ROWS - 1) / KERN_PACK_ROWS;
    struct kern_packed *p = calloc(1, sizeof(*p));
    int8_t *codes = malloc((size_t)n);
    float *d = malloc((size_t)(2 * nb) * sizeof(float)), *m = malloc((size_t)nb * sizeof(float));
    const size_t n_super = (size_t)(n + 255) / 256;
    struct file_scales fs = { malloc((size_t)(2 * nb)), malloc((size_t)nb), malloc(n_super * sizeof(kvd_f16)),
                              malloc(n_super * sizeof(kvd_f16)) };
    if (p == NULL || codes == NULL || d == NULL || m == NULL || !fs.sc || !fs.mn || !fs.d || !fs.dmin)
        goto fail;
    /* Q4_0 and Q5_0 rows are signed codes and one scale per 32 values, like
     * Q8_0's: they are packed as Q8_0 (their products with Q8_0 activations
     * are the same integer sums and scales); in four and five bits, and the
     * K-quants in their files' widths, where kern_pack_narrow says so */
    const bool narrow = kern_pack_narrow(wtype);
    p->wtype = narrow ? kern_pk_narrow_layout(wtype) : wtype == KERN_Q4_0 || wtype == KERN_Q5_0 ? KERN_Q8_0 : wtype;
    p->rows = rows;
    p->n = n;
    p->group_bytes = group_bytes(p->wtype, nb);
    const size_t total = p->group_bytes * (size_t)groups;
    p->data = aligned_alloc(64, total);
    if (p->data == NULL)
        goto fail;
    memset(p->data, 0, total);  /* padding rows: zero codes, zero scales */
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = (const uint8_t *)w + (size_t)r * row_bytes;
        kern_unpack_row(wtype, row, n, codes, d, m);
        if (p->wtype > 0xFF)  /* a narrow K-quant layout */
            kern_unpack_k_scales(wtype, row, n, fs.sc, fs.mn, fs.d, fs.dmin);
        pack_row(p, p->data + (size_t)(r / KERN_PACK_ROWS) * p->group_bytes, (int)(r % KERN_PACK_ROWS), codes,
                 d, m, &fs);
    }
    goto done;
fail:
    if (p != NULL)
        free(p->data);
    free(p);
    p = NULL;
done:
    free(codes);
    free(d);
    free(m);
    free(fs.sc);
    free(fs.mn);
    free(fs.d);
    free(fs.dmin);
    return p;
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
    if (isa >= KERN_ISA_AVX512VNNI && a->packed != NULL && a->T >= KERN_AMX_MIN_T && kern_amx() &&
        kern_gemm_packed_amx(a))
        return;
    if (isa >= KERN_ISA_AVX512VNNI && a->packed != NULL && kern_gemm_packed_vnni(a))
        return;
    if (isa == KERN_ISA_AVX2 && a->packed != NULL &&
        (kern_avxvnni() ? kern_gemm_packed_avxvnni(a) : kern_gemm_packed_avx2(a)))
        return;
    if (isa >= KERN_ISA_AVX512VNNI && kern_gemm_avx512vnni(a))
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
