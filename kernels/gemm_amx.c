/*
 * gemm_amx.c - the packed products on AMX tiles (AMX-TILE + AMX-INT8).
 *
 * The packed layout (gemm.h) stores a block of 32 values of 16 rows as 64-byte
 * slices holding four codes of each row: exactly the B operand of a tile dot
 * product (K/4 rows of 16 four-byte groups). One TDPBSUD multiplies 16 tokens'
 * signed activation bytes (A: 16 rows of 32 bytes, from the staged
 * activations) with a block of 16 weight rows' unsigned codes, and leaves the
 * 16 x 16 exact int32 sums of the block in a tile: the same integers the
 * vpdpbusd path makes, lane for lane. The float epilogue is the AVX-512 VNNI
 * path's, in the same order (pk_tile in gemm_avx512.c): per block and part
 *   f = fma(float(isum + bias), d_w * d_a, f), then with mins f = fma(m_w, s_a, f)
 * so this path gives that path's bits, whatever the batch or the row range.
 *
 * Nibble layouts (Q4_1, Q4_K) are widened to bytes once per group of 16 rows
 * and call, into the scratch, and then meet every token of the call. Q6_K's
 * two 16-value parts each take a product of K = 16.
 *
 * The tile configuration is loaded with our own ldtilecfg statement, whose
 * memory operand is the whole 64-byte configuration: GCC 12's
 * _tile_loadconfig names only its first 8 bytes, so the compiler may drop the
 * stores that fill the rest. kern_amx_config_check() reads the configuration
 * back (tests). The tile operations are written out as statements too: a
 * tile store names the memory it writes (the epilogue reads it), and
 * compiler barriers around each batch order the tile loads after the stores
 * that staged their operands and before the next batch overwrites them. A
 * call ends with tilerelease, so that an idle thread carries no tile state. Only called after kern_amx() has checked
 * the CPU and obtained the kernel's permission for the tile data.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "amx_cfg.h"
#include "cpu.h"
#include "gemm.h"
#include "gemm_pk.inc"

/* Tiles: 0 and 1 the sums (two steps in flight), 2 and 3 activations, 4 and 5 codes. */

/* Loads name no memory (a memory clobber would keep the accumulators out of
 * registers): the product calls mem_barrier() between writing what they read
 * and reading it, and before writing it again; a store names the 1 KiB it
 * writes, which the epilogue reads. */
#define TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TILE_LOAD(t, base, stride) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"((long)(stride)))
#define TILE_STORE(t, c) \
    __asm__ volatile("tilestored %%tmm" #t ", (%1,%2,1)" : "=m"(*(int32_t(*)[256])(c)) : "r"(c), "r"(64L))
/* dst += src1 (signed bytes) . src2 (unsigned bytes, or signed with TILE_DPBSSD) */
#define TILE_DPBSUD(dst, src1, src2) \
    __asm__ volatile("tdpbsud %%tmm" #src2 ", %%tmm" #src1 ", %%tmm" #dst ::)
#define TILE_DPBSSD(dst, src1, src2) \
    __asm__ volatile("tdpbssd %%tmm" #src2 ", %%tmm" #src1 ", %%tmm" #dst ::)
static inline void mem_barrier(void) { __asm__ volatile("" ::: "memory"); }
/* Q8_0's and Q6_K's codes meet the activations signed (their stored bias
 * taken off once per group): the sums are the vector path's after its bias
 * term, with nothing to add per token */
#define TILE_DP(K, dst, src1, src2)                                                            \
    do {                                                                                       \
        if ((K) == KERN_Q8_0 || (K) == KERN_Q6_K)                                              \
            TILE_DPBSSD(dst, src1, src2);                                                      \
        else                                                                                   \
            TILE_DPBSUD(dst, src1, src2);                                                      \
    } while (0)

/* The configuration for products of kbytes codes per step (32, or 16 for Q6_K's parts). */
static void cfg_make(struct amx_cfg *c, int kbytes)
{
    memset(c, 0, sizeof(*c));
    c->palette = 1;
    for (int t = 0; t < 2; t++) {
        c->rows[t] = 16;
        c->colsb[t] = 64;
    }
    for (int t = 2; t < 4; t++) {
        c->rows[t] = 16;
        c->colsb[t] = (uint16_t)kbytes;
    }
    for (int t = 4; t < 6; t++) {
        c->rows[t] = (uint8_t)(kbytes / 4);
        c->colsb[t] = 64;
    }
}

static inline void cfg_store(struct amx_cfg *c)
{
    __asm__ volatile("sttilecfg %0" : "=m"(*c));
}

/* Loaded on every call: a cached "already loaded" would be wrong after any
 * other code on the thread (a benchmark's peak loop, a library) released or
 * reconfigured the tiles, and the load costs little beside a product. */
static void cfg_set(int kbytes)
{
    struct amx_cfg c;
    cfg_make(&c, kbytes);
    amx_cfg_load(&c);
}

bool kern_amx_config_check(void)
{
    struct amx_cfg want, got;
    bool ok = true;
    for (int kbytes = 16; kbytes <= 32; kbytes += 16) {
        cfg_make(&want, kbytes);
        amx_cfg_load(&want);
        memset(&got, 0xA5, sizeof(got));
        cfg_store(&got);
        ok = ok && memcmp(&want, &got, sizeof(got)) == 0;
    }
    __asm__ volatile("tilerelease" ::: "memory");
    return ok;
}

/* The activations' scales d_a and min terms s_a per tile of 16 tokens, block
 * by block: dt[(tile * nb + b) * 16 + m], one line per block. */
struct amx_scales {
    const float *dt, *st;
};

static void amx_transpose(const struct pk_acts *A, int T, bool mins, float *dt, float *st)
{
    const int64_t nb = A->nb;
    for (int t = 0; t < T; t++)
        for (int64_t b = 0; b < nb; b++) {
            const size_t at = ((size_t)(t / 16) * nb + b) * 16 + t % 16;
            dt[at] = A->da[(size_t)t * nb + b];
            if (mins)
                st[at] = ((const float *)A->sa)[(size_t)t * nb + b];
        }
}

/* Step s of a group (block s / parts, part s % parts) for tokens [t0, t0 + M):
 * the int32 sums in c (16 tokens x 16 rows) folded into f. */
static inline __attribute__((always_inline)) void
epilogue(const uint32_t K, const int M, const uint8_t *g, const struct pk_acts *A, const struct amx_scales *S,
         int t0, int64_t s, const int32_t *c, __m512 *f)
{
    const int parts = kern_pk_parts(K);
    const int64_t nb = A->nb, b = s / parts;
    const float *dt = S->dt + ((size_t)(t0 / 16) * nb + b) * 16, *st = S->st + ((size_t)(t0 / 16) * nb + b) * 16;
    const int part = (int)(s % parts);
    const bool f32 = kern_pk_f32(K);
    const size_t cb = kern_pk_code_bytes(K), sb = kern_pk_scale_bytes(K), mb = kern_pk_min_bytes(K);
    const uint8_t *sc = g + (size_t)nb * cb + (size_t)b * sb;
    const __m512 dw = f32 ? _mm512_load_ps((const void *)(sc + 64 * part))
                          : _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)sc));
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) {
        const __m512i acc = _mm512_load_si512((const void *)(c + 16 * m));
        f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(dw, _mm512_set1_ps(dt[m])), f[m]);
    }
    if (kern_pk_mins(K) && part == parts - 1) {
        const uint8_t *mn = g + (size_t)nb * (cb + sb) + (size_t)b * mb;
        const __m512 mw = f32 ? _mm512_load_ps((const void *)mn)
                              : _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)mn));
#pragma GCC unroll 16
        for (int m = 0; m < M; m++)
            f[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(st[m]), f[m]);
    }
}

/* One group of 16 rows (packed data g, codes as bytes at q: 512 per block)
 * against tokens [t0, t0 + M), a step (a block, or a part of Q6_K's) at a
 * time. */
static inline __attribute__((always_inline)) void
amx_tile(const uint32_t K, const int M, const uint8_t *g, const uint8_t *q, const struct pk_acts *A,
         const struct amx_scales *S, int t0,
         int32_t *cbuf, float *out, size_t ldo, __mmask16 mask, bool add)
{
    const int parts = kern_pk_parts(K);
    const int64_t n = A->n, steps = A->nb * parts;
    const int kb = 32 / parts;  /* code bytes a step */
    const int8_t *a = A->av + (size_t)t0 * n;
    __m512 f[16];
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++)
        f[m] = _mm512_setzero_ps();
    int32_t *c0 = cbuf, *c1 = cbuf + 256;
    /* Step s (tiles 0 or 1, by parity) goes through three stages a step
     * apart: its product; the store of its sums, once the product is done;
     * their fold into f, once the store has landed: neither the store nor
     * the loads wait on the stage before. */
    for (int64_t s = 0; s < steps + 2; s += 2) {
        if (s < steps) {
            TILE_ZERO(0);
            TILE_LOAD(2, a + kb * s, n);
            TILE_LOAD(4, q + 16 * kb * s, 64);
            TILE_DP(K, 0, 2, 4);
        }
        if (s >= 2 && s - 1 < steps)
            TILE_STORE(1, c1);
        if (s >= 2)
            epilogue(K, M, g, A, S, t0, s - 2, c0, f);
        if (s + 1 < steps) {
            TILE_ZERO(1);
            TILE_LOAD(3, a + kb * (s + 1), n);
            TILE_LOAD(5, q + 16 * kb * (s + 1), 64);
            TILE_DP(K, 1, 3, 5);
        }
        if (s < steps)
            TILE_STORE(0, c0);
        if (s >= 2 && s - 1 < steps)
            epilogue(K, M, g, A, S, t0, s - 1, c1, f);
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) {
        float *o = out + (size_t)(t0 + m) * ldo;
        __m512 v = f[m];
        if (add)
            v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), v);
        _mm512_mask_storeu_ps(o, mask, v);
    }
}

/* Group g's byte codes with their stored bias taken off (Q8_0's + 128, Q6_K's + 32). */
static void unbias(const uint8_t *g, int64_t nb, uint8_t bias, uint8_t *q)
{
    const __m512i v = _mm512_set1_epi8((char)bias);
    for (size_t o = 0; o < (size_t)nb * 512; o += 64)
        _mm512_store_si512((void *)(q + o), _mm512_sub_epi8(_mm512_load_si512((const void *)(g + o)), v));
}

/* Group g's nibble codes (Q4_1, Q4_K: slice j holds values 4j.. low, 16 + 4j.. high)
 * as bytes in the B layout: per block, slices 0-3 the low nibbles, 4-7 the high. */
static void widen(const uint8_t *g, int64_t nb, uint8_t *q)
{
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++)
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_load_si512((const void *)(g + (size_t)b * 256 + 64 * j));
            _mm512_store_si512((void *)(q + (size_t)b * 512 + 64 * j), _mm512_and_si512(v, low));
            _mm512_store_si512((void *)(q + (size_t)b * 512 + 64 * (4 + j)),
                               _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
}

/* Groups of 16 rows a batch: their codes (as bytes, 512 per block) are made
 * ready once, then each tile of 16 tokens meets them all, its activations
 * staying in L1 (the other order reads every token's activations from L2
 * for each group). */
#define AMX_BATCH 2

struct amx_batch {
    int n;
    const uint8_t *g[AMX_BATCH], *q[AMX_BATCH];  /* packed groups, their codes as bytes */
    float *out[AMX_BATCH];
    __mmask16 mask[AMX_BATCH];
};

static inline __attribute__((always_inline)) void
amx_run(const uint32_t K, const struct amx_batch *B, const struct pk_acts *A, const struct amx_scales *S, int T,
        int32_t *cbuf, size_t ldo, bool add)
{
    int t0 = 0;
    for (; t0 + 16 <= T; t0 += 16)
        for (int j = 0; j < B->n; j++)
            amx_tile(K, 16, B->g[j], B->q[j], A, S, t0, cbuf, B->out[j], ldo, B->mask[j], add);
    if (t0 < T)  /* the staged activations have rows up to a multiple of 16 */
        for (int j = 0; j < B->n; j++)
            amx_tile(K, T - t0, B->g[j], B->q[j], A, S, t0, cbuf, B->out[j], ldo, B->mask[j], add);
}

bool kern_gemm_packed_amx(const struct kern_gemm_args *a)
{
    if (!pk_usable(a))
        return false;
    const struct kern_packed *pk = a->packed;
    const uint32_t K = pk->wtype;
    if (K != KERN_Q4_1 && K != KERN_Q8_0 && K != KERN_Q4_K && K != KERN_Q5_K && K != KERN_Q6_K)
        return false;
    struct pk_acts A;
    /* Q8_0's bias terms staged too, though the tiles do not use them: a later
     * chunk of the same product (staged) may run on the vector path */
    pk_stage(a, true, &A);
    const size_t qbytes = (size_t)A.nb * 512;
    uint8_t *q = pk_align64(A.rest);  /* a batch's codes as bytes */
    int32_t *cbuf = (int32_t *)pk_align64(q + AMX_BATCH * qbytes);
    float *dt = (float *)pk_align64((uint8_t *)(cbuf + 512));
    float *st = (float *)pk_align64((uint8_t *)(dt + (size_t)(a->T + 15) / 16 * 16 * A.nb));
    amx_transpose(&A, a->T, kern_pk_mins(K), dt, st);
    const struct amx_scales S = { dt, st };
    cfg_set(32 / kern_pk_parts(K));
    const size_t gs = pk->group_bytes;
    const long g_end = (a->r1 + KERN_PACK_ROWS - 1) / KERN_PACK_ROWS;
    for (long g0 = a->r0 / KERN_PACK_ROWS; g0 < g_end; g0 += AMX_BATCH) {
        struct amx_batch B = { .n = g_end - g0 < AMX_BATCH ? (int)(g_end - g0) : AMX_BATCH };
        mem_barrier();  /* the previous batch's tile loads have read its codes */
        for (int j = 0; j < B.n; j++) {
            const long gi = g0 + j;
            const uint8_t *g = pk->data + (size_t)gi * gs;
            uint8_t *qj = q + (size_t)j * qbytes;
            B.g[j] = g;
            B.q[j] = qj;
            if (kern_pk_nibbles(K))
                widen(g, A.nb, qj);
            else if (K == KERN_Q8_0 || K == KERN_Q6_K)
                unbias(g, A.nb, K == KERN_Q8_0 ? 128 : 32, qj);
            else
                B.q[j] = g;  /* Q5_K: unsigned bytes as they are */
            B.mask[j] = pk_group_mask(gi, a->r0, a->r1);
            B.out[j] = a->out + (size_t)gi * KERN_PACK_ROWS;
        }
        mem_barrier();  /* the tile loads read what staging and widening wrote */
        switch (K) {
        case KERN_Q4_1: amx_run(KERN_Q4_1, &B, &A, &S, a->T, cbuf, a->ldo, a->add); break;
        case KERN_Q8_0: amx_run(KERN_Q8_0, &B, &A, &S, a->T, cbuf, a->ldo, a->add); break;
        case KERN_Q4_K: amx_run(KERN_Q4_K, &B, &A, &S, a->T, cbuf, a->ldo, a->add); break;
        case KERN_Q5_K: amx_run(KERN_Q5_K, &B, &A, &S, a->T, cbuf, a->ldo, a->add); break;
        default: amx_run(KERN_Q6_K, &B, &A, &S, a->T, cbuf, a->ldo, a->add); break;
        }
    }
    __asm__ volatile("tilerelease" ::: "memory");
    return true;
}
#endif
