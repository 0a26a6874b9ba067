/*
 * attn_avx2.c - grouped paged attention with AVX2, FMA and F16C.
 *
 * For each query head: scores q.k * scale, softmax with the sum in double,
 * then out += p * v in position order. The scores come four positions at a
 * time for up to three heads, all twelve sums in registers. Over a float K
 * (its loop unrolled for head dims 32 and 64): each row converted from f16
 * once for the heads, each (head, position) one chain of multiply-adds, the
 * four positions' lanes summed together by vhaddps; over an f16 cache q and
 * p are rounded to f16 first, as in the C reference. Over a q8_0 or q4_0 K:
 * the query is quantized to q8_0, each block's integer dot product comes
 * from vpmaddubsw + vpmaddwd, the four positions' sums from vphaddd, then the
 * scaled block sums are added with the C reference's float operations, four
 * positions wide, so the scores are its bits. A q8_0 or q4_0 V row is
 * dequantized in registers (d * code).
 *
 * K and V rows are read once per group of query heads (groups larger than
 * three: once per pass of up to three). Entering a block, the kernel asks
 * for the next block's rows: a context's blocks are scattered through the
 * pool, and a decode step reads a layer's weights between two layers'
 * attention, so the rows are rarely in cache. The exponentials' sum runs
 * four double lanes wide beside them. The weighted sum of V runs in passes
 * of up to three heads and 32 dimensions whose sums stay in registers over
 * all positions, a block's rows at a time. Every head gets the same
 * operations whichever pass, group or lane it lands in, so grouping changes
 * no bit.
 *
 * `bench-attn -n 576 -w 3` (3 heads of 64, 576 positions, rows out of
 * cache as in a decode step), against the form before these tiles and the
 * prefetch: f16 1.88x, q8_0 1.9x; see docs/performance.md, "Attention out
 * of cache".
 */
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "attn.h"
#include "exp256.h"
#include "f16.h"
#include "ops.h"
#include "quant.h"
#include "types.h"

static inline bool quantized(uint32_t t) { return t == KERN_Q8_0 || t == KERN_Q4_0; }

/* The f16 scale at the start of a q8_0 / q4_0 block, as a float. */
static inline float block_scale(const uint8_t *blk)
{
    uint16_t h;
    memcpy(&h, blk, 2);
    return _cvtsh_ss(h);
}

/* A K block made ready once for every head of the group: the unsigned operand
 * of vpmaddubsw (|k| for q8_0, the codes 0..15 for q4_0), k itself (q8_0:
 * its signs go onto the query), and the scale. */
struct kblock {
    __m256i u, k;
    float d;
};

static inline void kblock_load(struct kblock *kb, const uint8_t *blk, uint32_t type)
{
    kb->d = block_scale(blk);
    if (type == KERN_Q8_0) {
        kb->k = _mm256_loadu_si256((const __m256i *)(blk + 2));
        kb->u = _mm256_sign_epi8(kb->k, kb->k);
        return;
    }
    const __m128i x = _mm_loadu_si128((const __m128i *)(blk + 2)), lo4 = _mm_set1_epi8(0x0F);
    kb->u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), lo4), _mm_and_si128(x, lo4));
    kb->k = kb->u;
}

/* Eight elements of an f16, bf16 or f32 K/V row as floats (a bf16 exactly:
 * the upper half of its f32). */
static inline __m256 load8(const uint8_t *row, int d, uint32_t type)
{
    if (type == KERN_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * (size_t)d)));
    if (type == KERN_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * (size_t)d))), 16));
    return _mm256_loadu_ps((const float *)row + d);
}

static inline float round_half(float x) { return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)); }

/* Eight finite values rounded to bf16 (to nearest even), as floats: round_bf16's bits. */
static inline __m256 round_bf16_8(__m256 x)
{
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

/* x rounded to bf16 (to nearest even), as a float: what the C reference does. */
static inline float round_bf16(float x)
{
    kvd_bf16 b;
    kern_quantize_row(KERN_BF16, &x, &b, 1);
    return kvd_bf16_to_f32(b);
}

#define MAX_Q 16  /* query heads handled per pass; larger groups loop */

/* Asks for block b's K rows (into L1) and V rows (into L2; read after the
 * softmax) of this head, when b holds positions of this call. A context's
 * blocks are scattered, so the hardware prefetcher stops at every block's
 * end. Always inlined: GCC drops a call whose only effects are prefetches. */
static inline __attribute__((always_inline)) void prefetch_block(const struct kern_attn_args *a, int b,
                                                                 size_t k_row_bytes, size_t v_row_bytes)
{
    if (b * a->block_tokens >= a->n_ctx)
        return;
    const size_t off = (size_t)a->blocks[b] * a->block_stride;
    const uint8_t *k = a->k_base + off + (uint64_t)a->kv_head * a->k_head_stride;
    const uint8_t *v = a->v_base + off + (uint64_t)a->kv_head * a->v_head_stride;
    for (size_t o = 0; o < (size_t)a->block_tokens * k_row_bytes; o += 64)
        _mm_prefetch((const char *)k + o, _MM_HINT_T0);
    for (size_t o = 0; o < (size_t)a->block_tokens * v_row_bytes; o += 64)
        _mm_prefetch((const char *)v + o, _MM_HINT_T1);
}

/* Entering the block of position j (the call's first, j0, or a later one):
 * asks for the next block, and at the first for this one too; and for the K
 * rows four blocks ahead into L2 (a cold call over 1,024 positions on AMD
 * EPYC, `bench-attn -n 1024 -w 3`: 43.1-45.7 -> 40.7-41.7 us). */
static inline __attribute__((always_inline)) void prefetch_next(const struct kern_attn_args *a, int j, int j0,
                                                                size_t k_row_bytes, size_t v_row_bytes)
{
    const int b = j / a->block_tokens;
    if (j == j0)
        prefetch_block(a, b, k_row_bytes, v_row_bytes);
    prefetch_block(a, b + 1, k_row_bytes, v_row_bytes);
    if ((b + 4) * a->block_tokens < a->n_ctx) {
        const uint8_t *k = a->k_base + (size_t)a->blocks[b + 4] * a->block_stride + (uint64_t)a->kv_head * a->k_head_stride;
        for (size_t o = 0; o < (size_t)a->block_tokens * k_row_bytes; o += 64)
            _mm_prefetch((const char *)k + o, _MM_HINT_T1);
    }
}

/* Scores of four positions (rows) for NQ <= 3 heads over a float K of
 * 8 HD8 dimensions, all in registers: each (head, position) a chain of
 * multiply-adds over the row's eight-value chunks, then the lanes summed by
 * hadd as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). Each row is
 * converted once for the heads; out[g] holds the four positions' scores. */
static inline __attribute__((always_inline)) void kscore4(const uint8_t *const *rows, const float (*qh)[KERN_MAX_HEAD_DIM],
                                                          const int NQ, const int HD8, const uint32_t KT, __m128 *out)
{
    __m256 s[3][4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        const __m256 k = load8(rows[p], 0, KT);
#pragma GCC unroll 3
        for (int g = 0; g < NQ; g++)
            s[g][p] = _mm256_mul_ps(_mm256_loadu_ps(&qh[g][0]), k);
    }
#pragma GCC unroll 8
    for (int d = 1; d < HD8; d++)
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            const __m256 k = load8(rows[p], 8 * d, KT);
#pragma GCC unroll 3
            for (int g = 0; g < NQ; g++)
                s[g][p] = _mm256_fmadd_ps(_mm256_loadu_ps(&qh[g][8 * d]), k, s[g][p]);
        }
#pragma GCC unroll 3
    for (int g = 0; g < NQ; g++) {
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(s[g][0], s[g][1]), _mm256_hadd_ps(s[g][2], s[g][3]));
        out[g] = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    }
}

/* The query heads of a pass in the forms K takes: floats (f16 / f32 K), or
 * q8_0 blocks with each block's scale and code sum (q8_0 / q4_0 K). */
struct qheads {
    const float (*qh)[KERN_MAX_HEAD_DIM];
    const struct kern_block_q8_0 (*qq)[KERN_MAX_HEAD_DIM / 32];
    const int (*qsum)[KERN_MAX_HEAD_DIM / 32];
    const float (*qd)[KERN_MAX_HEAD_DIM / 32];
};

/* Scores of four positions (rows) for NQ <= 3 heads over a q8_0 or q4_0 K of
 * nb blocks (k_blk bytes each): per block, each (head, position) integer dot
 * product from vpmaddubsw + vpmaddwd, the four positions' lanes summed by
 * vphaddd (exact), then the C reference's float operations four positions
 * wide: s += (d_k * d_q) * si for q8_0, s += (si * d_k) * d_q for q4_0, in
 * block order, so each score is its bits. */
static inline __attribute__((always_inline)) void qscore4(const uint8_t *const *rows, size_t k_blk, int nb,
                                                          const struct qheads *qs, const int NQ, const uint32_t KT,
                                                          __m128 *out)
{
    const bool q8 = KT == KERN_Q8_0;
    const __m256i ones = _mm256_set1_epi16(1);
    __m128 s[3];
#pragma GCC unroll 3
    for (int g = 0; g < NQ; g++)
        s[g] = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        struct kblock kb[4];
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++)
            kblock_load(&kb[p], rows[p] + (size_t)b * k_blk, KT);
        const __m128 dk = _mm_setr_ps(kb[0].d, kb[1].d, kb[2].d, kb[3].d);
#pragma GCC unroll 3
        for (int g = 0; g < NQ; g++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)qs->qq[g][b].qs);
            __m256i d[4];
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++)
                d[p] = _mm256_madd_epi16(_mm256_maddubs_epi16(kb[p].u, q8 ? _mm256_sign_epi8(qv, kb[p].k) : qv), ones);
            const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
            __m128i si = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            if (!q8)
                si = _mm_sub_epi32(si, _mm_set1_epi32(8 * qs->qsum[g][b]));
            const __m128 sf = _mm_cvtepi32_ps(si), dq = _mm_set1_ps(qs->qd[g][b]);
            s[g] = _mm_add_ps(s[g], q8 ? _mm_mul_ps(_mm_mul_ps(dk, dq), sf) : _mm_mul_ps(_mm_mul_ps(sf, dk), dq));
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < NQ; g++)
        out[g] = s[g];
}

/* The scores of positions [j0, n_ctx) for NQ <= 3 heads, four positions at
 * a time: over a float K (KT f16 or f32) of 8 HD8 dimensions by kscore4 (HD8
 * 0: head_dim / 8, a loop not unrolled), over a q8_0 or q4_0 K by qscore4;
 * raises max[g] to each head's largest. */
static inline __attribute__((always_inline)) void kscores_run(const struct kern_attn_args *a, const struct qheads *qs,
                                                              const int NQ, const uint32_t KT, const int HD8,
                                                              size_t row_bytes, size_t v_row_bytes, int j0,
                                                              float *scores, float *max)
{
    static const float zero[KERN_MAX_HEAD_DIM];  /* a row past the end: zeros (a quantized block of scale 0) */
    const int bt = a->block_tokens, n = a->n_ctx;
    const __m128 vs = _mm_set1_ps(a->scale);
    __m128 vmax[3];
    for (int g = 0; g < NQ; g++)
        vmax[g] = _mm_set1_ps(-INFINITY);
    const uint8_t *k = NULL;
    for (int j = j0, left = 0; j < n; j += 4) {
        const int np = n - j < 4 ? n - j : 4;
        const uint8_t *rows[4];
        for (int p = 0; p < 4; p++, k += row_bytes, left--) {
            if (p >= np) {
                rows[p] = (const uint8_t *)zero;
                continue;
            }
            if (left == 0) {
                k = kern_attn_row(a, a->k_base, a->k_head_stride, row_bytes, j + p);
                left = bt - (j + p) % bt;
                prefetch_next(a, j + p, j0, row_bytes, v_row_bytes);
            }
            rows[p] = k;
        }
        __m128 r[3];
        if (KT == KERN_Q8_0 || KT == KERN_Q4_0)
            qscore4(rows, row_bytes / (size_t)(a->head_dim / 32), a->head_dim / 32, qs, NQ, KT, r);
        else
            kscore4(rows, qs->qh, NQ, HD8 ? HD8 : a->head_dim / 8, KT, r);
        for (int g = 0; g < NQ; g++) {
            const __m128 sc = _mm_mul_ps(r[g], vs);
            if (np == 4) {
                _mm_storeu_ps(scores + (size_t)g * n + j, sc);
                vmax[g] = _mm_max_ps(vmax[g], sc);
            } else {
                float t[4];
                _mm_storeu_ps(t, sc);
                for (int p = 0; p < np; p++) {
                    scores[(size_t)g * n + j + p] = t[p];
                    vmax[g] = _mm_max_ps(vmax[g], _mm_set1_ps(t[p]));
                }
            }
        }
    }
    for (int g = 0; g < NQ; g++) {
        float t[4];
        _mm_storeu_ps(t, vmax[g]);
        for (int i = 0; i < 4; i++)
            if (t[i] > max[g])
                max[g] = t[i];
    }
}

#define KSCORES(KT, HD8)                                                                                               \
    do {                                                                                                               \
        if (ng == 3)                                                                                                   \
            kscores_run(a, &pq, 3, KT, HD8, row_bytes, v_row_bytes, j0, a->scores + (size_t)g0 * a->n_ctx, max + g0);  \
        else if (ng == 2)                                                                                              \
            kscores_run(a, &pq, 2, KT, HD8, row_bytes, v_row_bytes, j0, a->scores + (size_t)g0 * a->n_ctx, max + g0);  \
        else                                                                                                           \
            kscores_run(a, &pq, 1, KT, HD8, row_bytes, v_row_bytes, j0, a->scores + (size_t)g0 * a->n_ctx, max + g0);  \
    } while (0)

/* A float K: head dims 32 and 64 unrolled, others a loop. */
#define KSCORES_FLOAT(KT)                                                                                              \
    do {                                                                                                               \
        if (HD8 == 8)                                                                                                  \
            KSCORES(KT, 8);                                                                                            \
        else if (HD8 == 4)                                                                                             \
            KSCORES(KT, 4);                                                                                            \
        else                                                                                                           \
            KSCORES(KT, 0);                                                                                            \
    } while (0)

/* The scores of positions [j0, n_ctx) for nq heads, up to three heads at a
 * time in registers, over a float K or a q8_0 / q4_0 K; raises max[g] to
 * each head's largest. */
static void kscores_tiled(const struct kern_attn_args *a, const struct qheads *qs, int nq, size_t row_bytes,
                          size_t v_row_bytes, int j0, float *max)
{
    const int hd = a->head_dim, HD8 = hd / 8;
    const int passes = (nq + 2) / 3;
    for (int i = 0, g0 = 0; i < passes; i++) {
        const int ng = (nq - g0) / (passes - i);    /* heads shared evenly over the passes */
        const struct qheads pq = { qs->qh + g0, qs->qq + g0, qs->qsum + g0, qs->qd + g0 };
        switch (a->k_type) {
        case KERN_Q8_0: KSCORES(KERN_Q8_0, 0); break;
        case KERN_Q4_0: KSCORES(KERN_Q4_0, 0); break;
        case KERN_F16: KSCORES_FLOAT(KERN_F16); break;
        case KERN_BF16: KSCORES_FLOAT(KERN_BF16); break;
        default: KSCORES_FLOAT(KERN_F32); break;
        }
        g0 += ng;
    }
}

/* A V row's 32 elements from d0 (a block of a q8_0 or q4_0 row, or 32
 * values of a float one) as four vectors of floats: d * code for a quantized
 * block, as kern_dequantize_row; the block's scale is read once. */
static inline __attribute__((always_inline)) void load_v32(const uint8_t *v, int d0, uint32_t type, size_t v_blk,
                                                           __m256 vv[4])
{
    if (type == KERN_F16 || type == KERN_F32 || type == KERN_BF16) {
        for (int k = 0; k < 4; k++)
            vv[k] = load8(v, d0 + 8 * k, type);
        return;
    }
    const uint8_t *vb = v + (size_t)(d0 / 32) * v_blk;
    const __m256 d = _mm256_set1_ps(block_scale(vb));
    if (type == KERN_Q8_0) {
        for (int k = 0; k < 4; k++)
            vv[k] = _mm256_mul_ps(
                d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(vb + 2 + 8 * k)))));
        return;
    }
    const __m128i x = _mm_loadu_si128((const __m128i *)(vb + 2)), lo4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(x, lo4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), lo4);
    const __m128i c[4] = { lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8) };
    for (int k = 0; k < 4; k++)
        vv[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(c[k]),
                                                                     _mm256_set1_epi32(8))));
}

/* One pass of out += p v over the positions: heads g0.. (NG of them),
 * dimensions d0 .. d0 + 8 nv. */
struct vpass {
    const struct kern_attn_args *a;
    size_t v_row_bytes, v_blk;
    int j0, g0, d0, nv;
    float *out;             /* head g0's output at d0 */
};

static inline __attribute__((always_inline)) void vpass_run(const struct vpass *p, const int NG, const uint32_t VT,
                                                            const int NV)
{
    const struct kern_attn_args *a = p->a;
    __m256 acc[3][4];
#pragma GCC unroll 3
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
        for (int k = 0; k < NV; k++)
            acc[g][k] = _mm256_setzero_ps();
    const float *sc = a->scores + (size_t)p->g0 * a->n_ctx;
    const size_t ld = (size_t)a->n_ctx;
    const int bt = a->block_tokens;
    /* a block at a time: its rows in one straight loop */
    for (int j = p->j0; j < a->n_ctx;) {
        const uint8_t *v = kern_attn_row(a, a->v_base, a->v_head_stride, p->v_row_bytes, j);
        const int end = j - j % bt + bt < a->n_ctx ? j - j % bt + bt : a->n_ctx;
        for (; j < end; j++, v += p->v_row_bytes) {
            __m256 pr[3];
#pragma GCC unroll 3
            for (int g = 0; g < NG; g++)
                pr[g] = _mm256_broadcast_ss(sc + (size_t)g * ld + j);
            if (NV == 4) {  /* 32 dimensions: a quantized block, or 32 floats */
                __m256 vv[4];
                load_v32(v, p->d0, VT, p->v_blk, vv);
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
#pragma GCC unroll 3
                    for (int g = 0; g < NG; g++)
                        acc[g][k] = _mm256_fmadd_ps(pr[g], vv[k], acc[g][k]);
            } else {  /* fewer, at the end of a float row */
                for (int k = 0; k < NV; k++) {
                    const __m256 vv = load8(v, p->d0 + 8 * k, VT);
                    for (int g = 0; g < NG; g++)
                        acc[g][k] = _mm256_fmadd_ps(pr[g], vv, acc[g][k]);
                }
            }
        }
    }
    const int hd = a->head_dim;
#pragma GCC unroll 3
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
        for (int k = 0; k < NV; k++)
            _mm256_storeu_ps(p->out + (size_t)g * hd + 8 * k, acc[g][k]);
}

/* vpass_run for a V type: NG heads, four vectors (or, at the end of a
 * head_dim that is not a multiple of 32, fewer: a rare shape, not unrolled). */
#define VPASS_TYPE(VT)                                                                                                 \
    static __attribute__((noinline)) void vpass_##VT(const struct vpass *p, int ng)                                   \
    {                                                                                                                  \
        if (p->nv == 4 && ng == 3)                                                                                     \
            vpass_run(p, 3, KERN_##VT, 4);                                                                             \
        else if (p->nv == 4 && ng == 2)                                                                                \
            vpass_run(p, 2, KERN_##VT, 4);                                                                             \
        else if (p->nv == 4)                                                                                           \
            vpass_run(p, 1, KERN_##VT, 4);                                                                             \
        else                                                                                                           \
            for (int g = 0; g < ng; g++)                                                                               \
                for (int k = 0; k < p->nv; k++) {                                                                      \
                    struct vpass one = *p;                                                                             \
                    one.g0 = p->g0 + g;                                                                                \
                    one.d0 = p->d0 + 8 * k;                                                                            \
                    one.out = p->out + (size_t)g * p->a->head_dim + 8 * k;                                             \
                    vpass_run(&one, 1, KERN_##VT, 1);                                                                  \
                }                                                                                                      \
    }
VPASS_TYPE(F16)
VPASS_TYPE(F32)
VPASS_TYPE(BF16)
VPASS_TYPE(Q8_0)
VPASS_TYPE(Q4_0)

int kern_attn_avx2(const struct kern_attn_args *a)
{
    const int hd = a->head_dim;
    if (hd % 8 != 0 || hd > KERN_MAX_HEAD_DIM)
        return 0;
    for (int w = 0; w < 2; w++) {
        const uint32_t t = w ? a->v_type : a->k_type;
        if (t != KERN_F16 && t != KERN_F32 && t != KERN_BF16 && !(quantized(t) && hd % 32 == 0))
            return 0;
    }
    const bool half = a->k_type == KERN_F16, v_half = a->v_type == KERN_F16;
    const bool bhalf = a->k_type == KERN_BF16, v_bhalf = a->v_type == KERN_BF16;
    const bool k_quant = quantized(a->k_type), v_quant = quantized(a->v_type);
    const size_t row_bytes = kern_row_bytes(a->k_type, hd), v_row_bytes = kern_row_bytes(a->v_type, hd);
    const int nb = hd / 32;
    const size_t v_blk = v_quant ? v_row_bytes / (size_t)nb : 0;
    for (int q0 = 0; q0 < a->n_q; q0 += MAX_Q) {
        const int nq = a->n_q - q0 < MAX_Q ? a->n_q - q0 : MAX_Q;
        float qh[MAX_Q][KERN_MAX_HEAD_DIM];
        struct kern_block_q8_0 qq[MAX_Q][KERN_MAX_HEAD_DIM / 32];
        int qsum[MAX_Q][KERN_MAX_HEAD_DIM / 32];
        float qd[MAX_Q][KERN_MAX_HEAD_DIM / 32];
        float max[MAX_Q];
        for (int g = 0; g < nq; g++) {
            const float *q = a->q + (size_t)(q0 + g) * hd;
            if (k_quant) {
                kern_quantize_act(KERN_Q8_0, q, qq[g], hd);
                for (int b = 0; b < nb; b++) {
                    qsum[g][b] = 0;
                    for (int i = 0; i < 32; i++)
                        qsum[g][b] += qq[g][b].qs[i];
                    qd[g][b] = kvd_f16_to_f32(qq[g][b].d);
                }
            } else {
                for (int d = 0; d < hd; d++)
                    qh[g][d] = half ? round_half(q[d]) : bhalf ? round_bf16(q[d]) : q[d];
            }
            max[g] = -INFINITY;
        }
        /* scores, four positions at a time, each K row read once per pass
         * of up to three heads; positions [0, skip) are outside a sliding
         * window */
        const int j0 = a->skip > 0 ? a->skip : 0;
        const struct qheads qs = { (const float(*)[KERN_MAX_HEAD_DIM])qh,
                                   (const struct kern_block_q8_0(*)[KERN_MAX_HEAD_DIM / 32])qq,
                                   (const int(*)[KERN_MAX_HEAD_DIM / 32])qsum,
                                   (const float(*)[KERN_MAX_HEAD_DIM / 32])qd };
        kscores_tiled(a, &qs, nq, row_bytes, v_row_bytes, j0, max);
        /* softmax per head: exponentials eight at a time, their sum in double */
        for (int g = 0; g < nq; g++) {
            float *sc = a->scores + (size_t)g * a->n_ctx;
            const __m256 mx = _mm256_set1_ps(max[g]);
            int j = j0;
            __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
            for (; j + 8 <= a->n_ctx; j += 8) {
                const __m256 ev = kern_exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mx));
                _mm256_storeu_ps(sc + j, ev);
                s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(ev)));
                s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(ev, 1)));
            }
            if (j < a->n_ctx) {
                float tail[8];
                for (int i = 0; i < 8; i++)
                    tail[i] = j + i < a->n_ctx ? sc[j + i] - max[g] : -INFINITY;
                const __m256 ev = kern_exp8(_mm256_loadu_ps(tail));
                _mm256_storeu_ps(tail, ev);
                for (int i = 0; j < a->n_ctx; i++, j++)
                    sc[j] = tail[i];
                s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(ev)));
                s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(ev, 1)));
            }
            s0 = _mm256_add_pd(s0, s1);
            const __m128d h2 = _mm_add_pd(_mm256_castpd256_pd128(s0), _mm256_extractf128_pd(s0, 1));
            const double sum = _mm_cvtsd_f64(_mm_add_sd(h2, _mm_unpackhi_pd(h2, h2)));
            const float inv = (float)(1.0 / sum);
            if (a->stats != NULL) {
                a->stats[2 * (q0 + g)] = max[g];
                a->stats[2 * (q0 + g) + 1] = (float)sum;
            }
            const __m256 vinv = _mm256_set1_ps(inv);
            for (j = j0; j + 8 <= a->n_ctx; j += 8) {
                __m256 pv = _mm256_mul_ps(_mm256_loadu_ps(sc + j), vinv);
                if (v_half)
                    pv = _mm256_cvtph_ps(_mm256_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT));
                if (v_bhalf)
                    pv = round_bf16_8(pv);
                _mm256_storeu_ps(sc + j, pv);
            }
            for (; j < a->n_ctx; j++)
                sc[j] = v_half ? round_half(sc[j] * inv) : v_bhalf ? round_bf16(sc[j] * inv) : sc[j] * inv;
        }
        /* out = sum p v: for up to three heads and 32 dimensions at a time
         * the sums stay in registers over all positions, in position order */
        for (int g0 = 0; g0 < nq; g0 += 3) {
            const int ng = nq - g0 < 3 ? nq - g0 : 3;
            for (int d0 = 0; d0 < hd; d0 += 32) {
                const struct vpass p = { a, v_row_bytes, v_blk, j0, g0, d0, hd - d0 < 32 ? (hd - d0) / 8 : 4,
                                         a->out + (size_t)(q0 + g0) * hd + d0 };
                switch (a->v_type) {
                case KERN_F16: vpass_F16(&p, ng); break;
                case KERN_F32: vpass_F32(&p, ng); break;
                case KERN_BF16: vpass_BF16(&p, ng); break;
                case KERN_Q8_0: vpass_Q8_0(&p, ng); break;
                default: vpass_Q4_0(&p, ng); break;
                }
            }
        }
    }
    return 1;
}
#endif
