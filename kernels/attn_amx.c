/*
 * attn_amx.c - attention over a bf16 K and V on AMX tiles (AMX-BF16).
 *
 * One kernel serves a decode step's heads and a prefill's (token, head)
 * queries alike, up to sixteen queries of one KV head at a time, so a query
 * gets the same bits whichever call it is in and whatever queries share it:
 *
 *   scores  Sixteen positions at a time, the K rows as stored are the A
 *           operand (16 rows of 32 values per step, head_dim / 32 steps) and
 *           the queries, rounded to bf16 and laid out in pairs, the B
 *           operand: one TDPBF16PS a step leaves a 16 x 16 tile of
 *           (position, query) sums, which is stored, turned to (query,
 *           position) and scaled into each query's row of scores.
 *   softmax Per query, over its row: the largest score (kept as the scores
 *           come), exp_neg (2^k 2^f), the exponentials' sum in double, then
 *           the probabilities (e / sum, the C reference's rounding point)
 *           rounded to bf16 by vcvtne2ps2bf16, which flushes denormals to 0.
 *   p v     Sixteen positions at a time, each query's eight pairs of
 *           probabilities are the A operand (one row a query) and the V rows
 *           interleaved in pairs of positions the B operand, one tile of
 *           sixteen values per 16 of head_dim; four such sums stay in tiles
 *           over the whole context (a larger head goes in passes of 64
 *           values).
 *
 * Every step covers sixteen positions counted from the query's first, which
 * is a multiple of sixteen, and a tile row's sums depend on that row's
 * operands alone; a position a query does not attend has probability 0 and
 * positions past the context meet V rows of zeros, so neither adds anything.
 * The tiles' own order of additions is not vdpbf16ps's, so these bits are
 * not the AVX-512 path's: the path is chosen once per process
 * (kern_amx_bf16()) for every call alike. Sixteen K rows that lie in one
 * block are read in place, others (and all V rows) staged, so the block size
 * changes no bit. Tile operations are asm statements
 * with a memory clobber: they read and write staging that C code fills.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "amx_cfg.h"
#include "attn.h"
#include "attn512.h"
#include "cpu.h"
#include "types.h"

#define TLOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"((long)(stride)) : "memory")
#define TSTORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"((long)(stride)) : "memory")
#define TZERO(t) __asm__ volatile("tilezero %%tmm" #t ::: "memory")
#define TDP(dst, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #dst ::: "memory")

static inline void tile_set(struct amx_cfg *c, int t, int rows, int colsb)
{
    c->rows[t] = (uint8_t)rows;
    c->colsb[t] = (uint16_t)colsb;
}

/* Scores: tiles 0 and 1 the sums of two groups of sixteen positions, 2 and 3
 * their K rows, 4 the queries. */
static void cfg_scores(void)
{
    struct amx_cfg c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 5; t++)
        tile_set(&c, t, 16, 64);
    amx_cfg_load(&c);
}

/* p v for nq queries: tiles 0-3 the sums (16 values each), 4 the
 * probabilities (eight pairs a query), 5 and 6 V's pairs. */
static void cfg_pv(int nq)
{
    struct amx_cfg c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 4; t++)
        tile_set(&c, t, nq, 64);
    tile_set(&c, 4, nq, 32);
    tile_set(&c, 5, 8, 64);
    tile_set(&c, 6, 8, 64);
    amx_cfg_load(&c);
}

/* e^x for x <= 0 (a score less the largest): 2^(x log2 e) as 2^k 2^f, k
 * the nearest integer, 2^f by its Taylor series to degree 6 (|f| <= 1/2,
 * relative error under 2e-7), 2^k applied by vscalefps, which also takes
 * the far negative side to 0. */
static inline __m512 exp_neg(__m512 x)
{
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

/* The 16 x 16 floats t (row r at t + 16 r) transposed in place. */
static inline void transpose16(float *t)
{
    __m512 r[16], u[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_load_ps(t + 16 * i);
    /* 32-bit interleaves of row pairs, then 64-bit, then the 128-bit lanes */
    for (int i = 0; i < 16; i += 2) {
        u[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        u[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(u[i], u[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(u[i], u[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(u[i + 1], u[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(u[i + 1], u[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        /* rows i, 4 + i, 8 + i, 12 + i hold columns i, 4 + i, ... in their 128-bit lanes */
        const __m512 a = r[i], b = r[4 + i], c = r[8 + i], d = r[12 + i];
        const __m512 ab0 = _mm512_shuffle_f32x4(a, b, 0x44), ab1 = _mm512_shuffle_f32x4(a, b, 0xEE);
        const __m512 cd0 = _mm512_shuffle_f32x4(c, d, 0x44), cd1 = _mm512_shuffle_f32x4(c, d, 0xEE);
        u[i] = _mm512_shuffle_f32x4(ab0, cd0, 0x88);
        u[4 + i] = _mm512_shuffle_f32x4(ab0, cd0, 0xDD);
        u[8 + i] = _mm512_shuffle_f32x4(ab1, cd1, 0x88);
        u[12 + i] = _mm512_shuffle_f32x4(ab1, cd1, 0xDD);
    }
    for (int i = 0; i < 16; i++)
        _mm512_store_ps(t + 16 * i, u[i]);
}

/* Row j of a's context for the head at head_off of base. */
static inline const uint8_t *row_at(const struct kern_attn_args *a, const uint8_t *base, uint64_t head_off,
                                    size_t row_bytes, int j)
{
    return base + a->blocks[j / a->block_tokens] * a->block_stride + head_off +
           (size_t)(j % a->block_tokens) * row_bytes;
}

/* Where positions j .. j + 15 lie in one block: their first row (the rest
 * follow at row_bytes); else NULL. */
static inline const uint8_t *chunk_at(const struct kern_attn_args *a, const uint8_t *base, uint64_t head_off,
                                      size_t row_bytes, int j)
{
    const int b = j / a->block_tokens, r = j - b * a->block_tokens;
    if (r + 16 > a->block_tokens)
        return NULL;
    return base + a->blocks[b] * a->block_stride + head_off + (size_t)r * row_bytes;
}

/* The sixteen rows of positions j .. j + 15 (where they lie in one block
 * and are inside the context) asked for into the cache level of hint: the
 * blocks of a context are scattered, so the hardware prefetcher would
 * restart at each, and a decode step's rows mostly come from memory. */
static inline void prefetch16(const struct kern_attn_args *a, const uint8_t *base, uint64_t head_off, size_t row_bytes,
                              int j, int n, int hint)
{
    if (j + 16 > n)
        return;
    const uint8_t *r = chunk_at(a, base, head_off, row_bytes, j);
    if (r == NULL)
        return;
    for (size_t o = 0; o < 16 * row_bytes; o += 64) {
        if (hint == 0)
            _mm_prefetch((const char *)r + o, _MM_HINT_T0);
        else
            _mm_prefetch((const char *)r + o, _MM_HINT_T1);
    }
}

/* The K rows of positions j .. j + 15 as a tile's A operand (row stride
 * row_bytes): in place where they lie in one block, else copied to KS (the
 * rows from n on as zeros: they may lie past the block table). */
static inline const uint8_t *k_rows(const struct kern_attn_args *a, uint64_t k_off, size_t row_bytes, int j, int n,
                                    uint8_t *KS)
{
    const uint8_t *in_place = chunk_at(a, a->k_base, k_off, row_bytes, j);
    if (in_place != NULL)
        return in_place;
    for (int i = 0; i < 16; i++) {
        if (j + i < n)
            memcpy(KS + (size_t)i * row_bytes, row_at(a, a->k_base, k_off, row_bytes, j + i), row_bytes);
        else
            memset(KS + (size_t)i * row_bytes, 0, row_bytes);
    }
    return KS;
}

/* V's rows of positions j .. j + 15 (those from n on as zeros) as the B
 * operands of values [64 c0, 64 c0 + 64): VB + 256 g holds, for values
 * 64 c0 + 16 g .. + 15, eight rows of sixteen pairs (position j + 2m's value
 * and j + 2m + 1's). */
static inline void stage_v(const struct kern_attn_args *a, uint64_t v_off, size_t v_row, int j, int n, int c0,
                           uint16_t *VB)
{
    static const uint8_t zeros[128] __attribute__((aligned(64)));
    const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004,
                                         0x00250005, 0x00260006, 0x00270007, 0x00280008, 0x00290009,
                                         0x002a000a, 0x002b000b, 0x002c000c, 0x002d000d, 0x002e000e,
                                         0x002f000f);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const uint8_t *rows = chunk_at(a, a->v_base, v_off, v_row, j);
    for (int m = 0; m < 8; m++) {
        const int p = j + 2 * m;
        const uint8_t *r0 = p >= n ? zeros
                            : (rows != NULL ? rows + (size_t)(2 * m) * v_row : row_at(a, a->v_base, v_off, v_row, p)) +
                                  128 * c0;
        const uint8_t *r1 = p + 1 >= n ? zeros
                            : (rows != NULL ? rows + (size_t)(2 * m + 1) * v_row
                                            : row_at(a, a->v_base, v_off, v_row, p + 1)) +
                                  128 * c0;
        for (int h = 0; h < 2; h++) {
            const __m512i x = _mm512_loadu_si512(r0 + 64 * h), y = _mm512_loadu_si512(r1 + 64 * h);
            _mm512_store_si512(VB + 256 * (2 * h) + 32 * m, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_store_si512(VB + 256 * (2 * h + 1) + 32 * m, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

/*
 * Up to sixteen queries of a's KV head. Query L: q[L], out[L], st[L] (its
 * stats, or NULL), positions [first[L], n[L]) read and [skip[L], n[L])
 * attended; S: its scores at S + L * rs (rs >= n[L] - first[L]).
 */
static void amx_queries(const struct kern_attn_args *a, int nq, const float *const *q, float *const *out,
                        float *const *st, const int *first, const int *n, const int *skip, float *S, size_t rs)
{
    const int hd = a->head_dim, steps = hd / 32;
    const size_t row = (size_t)hd * 2;
    const uint64_t k_off = (uint64_t)a->kv_head * a->k_head_stride;
    const uint64_t v_off = (uint64_t)a->kv_head * a->v_head_stride;
    int j_lo = n[0], j_hi = 0;
    for (int L = 0; L < nq; L++) {
        j_lo = first[L] < j_lo ? first[L] : j_lo;
        j_hi = n[L] > j_hi ? n[L] : j_hi;
    }
    /* the queries in bf16 pairs, the B operand of each step: QB + 256 s + 16 k + L
     * = query L's values 32 s + 2 k and + 1 */
    uint32_t QB[128 * 16] __attribute__((aligned(64)));
    memset(QB, 0, (size_t)steps * 256 * sizeof(uint32_t));
    for (int L = 0; L < nq; L++)
        for (int s = 0; s < steps; s++) {
            uint32_t v[16] __attribute__((aligned(64)));
            _mm512_store_si512(v, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q[L] + 32 * s + 16),
                                                                _mm512_loadu_ps(q[L] + 32 * s)));
            for (int k = 0; k < 16; k++)
                QB[256 * s + 16 * k + L] = v[k];
        }

    /* scores, two groups of sixteen positions a pass; each query's largest
     * (over the positions it attends) as they come */
    cfg_scores();
    const __m512 scale = _mm512_set1_ps(a->scale);
    float T[2][256] __attribute__((aligned(64)));
    uint8_t KS[2][16 * 512] __attribute__((aligned(64)));
    __m512 vmax[16];
    for (int L = 0; L < 16; L++)
        vmax[L] = _mm512_set1_ps(-INFINITY);
    for (int j0 = j_lo; j0 < j_hi; j0 += 32) {
        const bool two = j0 + 16 < j_hi;
        /* K two passes ahead into L1; this pass's V (read after the softmax) into L2 */
        prefetch16(a, a->k_base, k_off, row, j0 + 64, j_hi, 0);
        prefetch16(a, a->k_base, k_off, row, j0 + 80, j_hi, 0);
        prefetch16(a, a->v_base, v_off, row, j0, j_hi, 1);
        prefetch16(a, a->v_base, v_off, row, j0 + 16, j_hi, 1);
        const uint8_t *k0 = k_rows(a, k_off, row, j0, j_hi, KS[0]);
        const uint8_t *k1 = two ? k_rows(a, k_off, row, j0 + 16, j_hi, KS[1]) : k0;
        TZERO(0);
        TZERO(1);
        for (int s = 0; s < steps; s++) {
            TLOAD(4, QB + 256 * s, 64);
            TLOAD(2, k0 + 64 * s, row);
            TDP(0, 2, 4);
            if (two) {
                TLOAD(3, k1 + 64 * s, row);
                TDP(1, 3, 4);
            }
        }
        TSTORE(0, T[0], 64);
        if (two)
            TSTORE(1, T[1], 64);
        for (int g = 0; g < 1 + two; g++) {
            const int j = j0 + 16 * g;
            transpose16(T[g]);
            for (int L = 0; L < nq; L++) {
                if (j < first[L] || j >= n[L])
                    continue;
                const int r = j - first[L], len = n[L] - first[L];
                const __m512 x = _mm512_mul_ps(_mm512_load_ps(T[g] + 16 * L), scale);
                const __mmask16 att = live16(r, len, skip[L] - first[L]);
                _mm512_mask_storeu_ps(S + (size_t)L * rs + r, live16(r, len, 0), x);
                vmax[L] = _mm512_mask_max_ps(vmax[L], att, vmax[L], x);
            }
        }
    }

    /* softmax per query: exponentials and their sum (in double), then the
     * probabilities rounded to bf16 in pairs of positions over the query's
     * scores (as the C reference rounds them) */
    for (int L = 0; L < nq; L++) {
        float *sc = S + (size_t)L * rs;
        const int len = n[L] - first[L], sk = skip[L] - first[L];
        const float mx = _mm512_reduce_max_ps(vmax[L]);
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
        for (int j = 0; j < len; j += 32) {
            const __mmask16 m0 = live16(j, len, sk), m1 = j + 16 < len ? live16(j + 16, len, sk) : 0;
            const __m512 e0 = _mm512_maskz_mov_ps(m0, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(m0, sc + j), vmx)));
            const __m512 e1 =
                _mm512_maskz_mov_ps(m1, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(m1, sc + j + 16), vmx)));
            s0 = _mm512_add_pd(s0, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(e0)),
                                                 _mm512_cvtps_pd(_mm512_castps512_ps256(e1))));
            s1 = _mm512_add_pd(s1, _mm512_add_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(e0, 1)),
                                                 _mm512_cvtps_pd(_mm512_extractf32x8_ps(e1, 1))));
            _mm512_mask_storeu_ps(sc + j, live16(j, len, 0), e0);
            if (j + 16 < len)
                _mm512_mask_storeu_ps(sc + j + 16, live16(j + 16, len, 0), e1);
        }
        const double sum = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
        if (st[L] != NULL) {
            st[L][0] = mx;
            st[L][1] = (float)sum;
        }
        const __m512 inv = _mm512_set1_ps((float)(1.0 / sum));
        for (int j = 0; j < len; j += 32) {
            const __m512 p0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(live16(j, len, 0), sc + j), inv);
            const __m512 p1 = j + 16 < len ? _mm512_mul_ps(_mm512_maskz_loadu_ps(live16(j + 16, len, 0), sc + j + 16), inv)
                                           : _mm512_setzero_ps();
            const int pairs = (len - j + 1) / 2 < 16 ? (len - j + 1) / 2 : 16;
            _mm512_mask_storeu_epi32((uint32_t *)sc + j / 2, (__mmask16)((1u << pairs) - 1u),
                                     (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
    }

    /* out = sum p v: sixteen positions a step, 64 values a pass. Where the
     * queries start together (a decode step's heads, a prefill's tokens
     * without a window) and their rows have room, the A operand is read in
     * place, each row's pairs past its end zeroed up to the last step's;
     * else each step's rows are staged in PA. */
    uint32_t PA[16 * 8] __attribute__((aligned(64)));
    uint16_t VB[4 * 256] __attribute__((aligned(64)));
    float O[16 * 16] __attribute__((aligned(64)));
    bool direct = (size_t)(j_hi - j_lo + 15) / 16 * 8 <= rs;
    for (int L = 0; L < nq; L++)
        direct = direct && first[L] == j_lo;
    for (int L = 0; L < nq && direct; L++) {
        uint32_t *pr = (uint32_t *)(S + (size_t)L * rs);
        for (int m = (n[L] - j_lo + 1) / 2; m < (j_hi - j_lo + 15) / 16 * 8; m++)
            pr[m] = 0;
    }
    cfg_pv(nq);
    for (int c0 = 0; c0 < hd / 64; c0++) {
        TZERO(0);
        TZERO(1);
        TZERO(2);
        TZERO(3);
        for (int j = j_lo; j < j_hi; j += 16) {
            for (int L = 0; L < nq && !direct; L++) {
                __m256i p = _mm256_setzero_si256();
                if (j >= first[L] && j < n[L]) {
                    const int r = j - first[L], pairs = (n[L] - j + 1) / 2 < 8 ? (n[L] - j + 1) / 2 : 8;
                    p = _mm256_maskz_loadu_epi32((__mmask8)((1u << pairs) - 1u),
                                                 (const uint32_t *)(S + (size_t)L * rs) + r / 2);
                }
                _mm256_store_si256((__m256i *)(PA + 8 * L), p);
            }
            if (c0 == 0)
                prefetch16(a, a->v_base, v_off, row, j + 32, j_hi, 0);
            stage_v(a, v_off, row, j, j_hi, c0, VB);
            if (direct)
                TLOAD(4, (const uint8_t *)S + (size_t)(j - j_lo) * 2, rs * 4);
            else
                TLOAD(4, PA, 32);
            TLOAD(5, VB, 64);
            TDP(0, 4, 5);
            TLOAD(6, VB + 256, 64);
            TDP(1, 4, 6);
            TLOAD(5, VB + 512, 64);
            TDP(2, 4, 5);
            TLOAD(6, VB + 768, 64);
            TDP(3, 4, 6);
        }
        for (int t = 0; t < 4; t++) {
            switch (t) {
            case 0: TSTORE(0, O, 64); break;
            case 1: TSTORE(1, O, 64); break;
            case 2: TSTORE(2, O, 64); break;
            default: TSTORE(3, O, 64); break;
            }
            for (int L = 0; L < nq; L++)
                _mm512_storeu_ps(out[L] + 64 * c0 + 16 * t, _mm512_load_ps(O + 16 * L));
        }
    }
    __asm__ volatile("tilerelease" ::: "memory");
}

static bool amx_takes(const struct kern_attn_args *a)
{
    return kern_amx_bf16() && a->k_type == KERN_BF16 && a->v_type == KERN_BF16 &&
           (a->head_dim == 64 || a->head_dim == 128 || a->head_dim == 256);
}

int kern_attn_amx(const struct kern_attn_args *a)
{
    if (!amx_takes(a))
        return 0;
    for (int q0 = 0; q0 < a->n_q; q0 += 16) {
        const int nq = a->n_q - q0 < 16 ? a->n_q - q0 : 16;
        const float *q[16];
        float *out[16], *st[16];
        int first[16], n[16], skip[16];
        for (int L = 0; L < nq; L++) {
            q[L] = a->q + (size_t)(q0 + L) * a->head_dim;
            out[L] = a->out + (size_t)(q0 + L) * a->head_dim;
            st[L] = a->stats != NULL ? a->stats + 2 * (q0 + L) : NULL;
            first[L] = 0;
            n[L] = a->n_ctx;
            skip[L] = a->skip;
        }
        amx_queries(a, nq, q, out, st, first, n, skip, a->scores + (size_t)q0 * a->n_ctx, (size_t)a->n_ctx);
    }
    return 1;
}

int kern_attn_amx_multi(const struct kern_attn_args *a, const struct kern_attn_query *qs, int nq, void *scratch)
{
    if (!amx_takes(a) || a->skip != 0 || nq < 1 || nq > KERN_ATTN_LANES)
        return 0;
    const float *q[16];
    float *out[16], *st[16];
    int first[16], n[16], skip[16], N = 0;
    for (int L = 0; L < nq; L++) {
        const struct kern_attn_query *x = &qs[L];
        if (x->first < 0 || x->first % 16 != 0 || x->first >= x->n_ctx ||
            (x->skip != 0 && (x->skip < x->first || x->skip >= x->n_ctx)))
            return 0;
        q[L] = x->q;
        out[L] = x->out;
        st[L] = x->stats;
        first[L] = x->first;
        n[L] = x->n_ctx;
        skip[L] = x->skip;
        N = x->n_ctx > N ? x->n_ctx : N;
    }
    float *S = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    amx_queries(a, nq, q, out, st, first, n, skip, S, (size_t)N);
    return 1;
}
#endif
