/*
 * gemm_avx512.c - the x86 matrix products with AVX-512 VNNI.
 *
 * Rows whose length is a whole number of 64-value pairs of blocks go through
 * 512-bit dpbusd, two blocks per instruction: per (row, token)
 *   acc16 = 0; for each pair p: acc16 = fma(float(lanes_p), dw_p * da_p, acc16)
 *   out   = hsum8(low half + high half of acc16) + min_term
 * where dw_p and da_p hold block 2p's scale in lanes 0-7 and 2p+1's in 8-15.
 * Everything else takes the 256-bit code of gemm_x86.inc, built here with
 * VNNI. Either way a token's result depends only on its own row.
 */
#if defined(__x86_64__)
#define GEMM_FN gemm_vnni256
#define GEMM_VNNI 1
#include "gemm_x86.inc"

static inline __m512 pair_scale(float lo, float hi)
{
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(lo)), _mm256_set1_ps(hi), 1);
}

static inline float hsum16(__m512 v)
{
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* One pair step of one token: the same instructions in every tile. */
#define PAIR_STEP(kind, acc, av_row, dav_row)                                                  \
    do {                                                                                       \
        const __m512i a_ = _mm512_load_si512((const void *)((av_row) + 64 * p));               \
        const __m512i s_ = (kind) == KERN_UNPACK_U32M ? a_ : _mm512_mask_sub_epi8(a_, neg, zero, a_); \
        const __m512 l_ = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs, s_)); \
        acc = _mm512_fmadd_ps(l_, _mm512_mul_ps(ws, _mm512_load_ps((dav_row) + 16 * p)), acc); \
    } while (0)

#define PAIR_LOAD(kind)                                                                        \
    const __m512i wq = _mm512_inserti64x4(                                                     \
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 2 * p * qs))),         \
        _mm256_loadu_si256((const __m256i *)(q + (2 * p + 1) * qs)), 1);                       \
    const __m512i wabs = (kind) == KERN_UNPACK_U32M ? wq : _mm512_abs_epi8(wq);                \
    const __mmask64 neg = _mm512_movepi8_mask(wq);                                             \
    const __m512 ws = pair_scale(d[2 * p], d[2 * p + 1])

static inline __attribute__((always_inline)) void
tile4(int kind, const int8_t *q, size_t qs, const float *d, const float *m, int64_t np, int64_t n, int64_t nb,
      const int8_t *av, const float *dav, const float *sa, float *out, size_t ldo, bool add)
{
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    const int8_t *a0 = av, *a1 = av + n, *a2 = av + 2 * n, *a3 = av + 3 * n;
    const float *v0 = dav, *v1 = dav + 16 * np, *v2 = dav + 32 * np, *v3 = dav + 48 * np;
    for (int64_t p = 0; p < np; p++) {
        PAIR_LOAD(kind);
        PAIR_STEP(kind, acc0, a0, v0);
        PAIR_STEP(kind, acc1, a1, v1);
        PAIR_STEP(kind, acc2, a2, v2);
        PAIR_STEP(kind, acc3, a3, v3);
    }
    const bool mins = kind == KERN_UNPACK_U32M;
    store_out(out, hsum16(acc0) + (mins ? min_term(m, sa, nb) : 0.0f), add);
    store_out(out + ldo, hsum16(acc1) + (mins ? min_term(m, sa + nb, nb) : 0.0f), add);
    store_out(out + 2 * ldo, hsum16(acc2) + (mins ? min_term(m, sa + 2 * nb, nb) : 0.0f), add);
    store_out(out + 3 * ldo, hsum16(acc3) + (mins ? min_term(m, sa + 3 * nb, nb) : 0.0f), add);
}

static inline __attribute__((always_inline)) void
tile1(int kind, const int8_t *q, size_t qs, const float *d, const float *m, int64_t np, int64_t nb,
      const int8_t *av, const float *dav, const float *sa, float *out, bool add)
{
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc0 = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        PAIR_LOAD(kind);
        PAIR_STEP(kind, acc0, av, dav);
    }
    store_out(out, hsum16(acc0) + (kind == KERN_UNPACK_U32M ? min_term(m, sa, nb) : 0.0f), add);
}

/* One Q4_1 row against one token, unpacking the codes in registers: the
 * same float operations as tile1 over an unpacked row, without the trip
 * through memory (decode, where a row meets one or a few tokens). */
static void q4_1_direct(const struct kern_block_q4_1 *b, int64_t np, int64_t nb, const int8_t *av,
                        const float *dav, const float *sa, float *m, float *out, bool add)
{
    const __m128i low = _mm_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        const struct kern_block_q4_1 *b0 = &b[2 * p], *b1 = &b[2 * p + 1];
        const __m128i x0 = _mm_loadu_si128((const __m128i *)b0->qs);
        const __m128i x1 = _mm_loadu_si128((const __m128i *)b1->qs);
        const __m256i w0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x0, 4), low), _mm_and_si128(x0, low));
        const __m256i w1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x1, 4), low), _mm_and_si128(x1, low));
        const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
        const __m512 ws = pair_scale(h2f(b0->d), h2f(b1->d));
        m[2 * p] = h2f(b0->m);
        m[2 * p + 1] = h2f(b1->m);
        const __m512i a_ = _mm512_load_si512((const void *)(av + 64 * p));
        const __m512 l_ = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, a_));
        acc = _mm512_fmadd_ps(l_, _mm512_mul_ps(ws, _mm512_load_ps(dav + 16 * p)), acc);
    }
    store_out(out, hsum16(acc) + min_term(m, sa, nb), add);
}

static void rows512(int kind, const struct kern_gemm_args *a, const int8_t *av, const float *dav,
                    const float *sa, int8_t *q, float *d, float *m)
{
    const int64_t n = a->n, nb = n / 32, np = nb / 2;
    struct wrow w;
    if (a->wtype == KERN_Q4_1 && a->T < 4) {
        for (long r = a->r0; r < a->r1; r++) {
            const uint8_t *row = a->w + (size_t)r * a->row_bytes;
            for (size_t off = 0; off < a->row_bytes; off += 64)
                _mm_prefetch((const char *)row + a->row_bytes + off, _MM_HINT_T0);
            for (int t = 0; t < a->T; t++)
                q4_1_direct((const void *)row, np, nb, av + (size_t)t * n, dav + (size_t)t * 16 * np,
                            sa + (size_t)t * nb, m, a->out + (size_t)t * a->ldo + r, a->add);
        }
        return;
    }
    for (long r = a->r0; r < a->r1; r++) {
        unpack(a->wtype, a->w + (size_t)r * a->row_bytes, a->n, q, d, m, &w);
        const int8_t *wq = w.q;  /* the unpacked codes, or Q8_0's in place */
        const size_t qs = w.qstride;
        const float *wd = w.d, *wm = w.m;
        int t = 0;
        for (; t + 4 <= a->T; t += 4) {
            float *o = a->out + (size_t)t * a->ldo + r;
            const int8_t *at = av + (size_t)t * n;
            const float *vt = dav + (size_t)t * 16 * np, *st = sa + (size_t)t * nb;
            if (kind == KERN_UNPACK_S32)
                tile4(KERN_UNPACK_S32, wq, qs, wd, wm, np, n, nb, at, vt, st, o, a->ldo, a->add);
            else
                tile4(KERN_UNPACK_U32M, wq, qs, wd, wm, np, n, nb, at, vt, st, o, a->ldo, a->add);
        }
        for (; t < a->T; t++) {
            float *o = a->out + (size_t)t * a->ldo + r;
            const int8_t *at = av + (size_t)t * n;
            const float *vt = dav + (size_t)t * 16 * np, *st = sa + (size_t)t * nb;
            if (kind == KERN_UNPACK_S32)
                tile1(KERN_UNPACK_S32, wq, qs, wd, wm, np, nb, at, vt, st, o, a->add);
            else
                tile1(KERN_UNPACK_U32M, wq, qs, wd, wm, np, nb, at, vt, st, o, a->add);
        }
    }
}

bool kern_gemm_avx512vnni(const struct kern_gemm_args *a)
{
    const int kind = kern_unpack_kind(a->wtype);
    if (a->scratch == NULL || a->n <= 0 || a->n % 64 != 0 ||
        (kind != KERN_UNPACK_S32 && kind != KERN_UNPACK_U32M))
        return gemm_vnni256(a);
    const int64_t n = a->n, nb = n / 32, np = nb / 2;
    const uint32_t at = kern_vec_dot_type(a->wtype);
    uint8_t *p = align64(a->scratch);
    int8_t *q = (int8_t *)p;
    p = align64(p + n);
    float *d = (float *)p;
    p = align64(p + (size_t)(2 * nb) * sizeof(float));
    float *m = (float *)p;
    p = align64(p + (size_t)nb * sizeof(float));
    uint32_t *offs = (uint32_t *)p;
    p = align64(p + (size_t)nb * sizeof(uint32_t));
    float *da = (float *)p;  /* per token: nb scales, then 16 * np pair vectors reuse sa's room */
    p = align64(p + (size_t)a->T * nb * sizeof(float));
    float *sa = (float *)p;
    p = align64(p + (size_t)a->T * nb * sizeof(float));
    int8_t *av = (int8_t *)p;
    p = align64(p + (size_t)a->T * n);
    float *dav = (float *)p;  /* 16 floats per pair per token */
    for (int t = 0; t < a->T; t++) {
        const uint8_t *row = a->act + (size_t)t * a->act_stride;
        float *dat = da + (size_t)t * nb;
        kern_act_blocks(at, row, n, offs, dat, sa + (size_t)t * nb);
        for (int64_t b = 0; b < nb; b++)
            _mm256_store_si256((__m256i *)(av + (size_t)t * n + 32 * b),
                               _mm256_loadu_si256((const __m256i *)(row + offs[b])));
        for (int64_t pp = 0; pp < np; pp++)
            _mm512_store_ps(dav + ((size_t)t * np + pp) * 16, pair_scale(dat[2 * pp], dat[2 * pp + 1]));
    }
    if (kind == KERN_UNPACK_S32)
        rows512(KERN_UNPACK_S32, a, av, dav, sa, q, d, m);
    else
        rows512(KERN_UNPACK_U32M, a, av, dav, sa, q, d, m);
    return true;
}
/* ---- packed weights (gemm.h): 16 rows per instruction --------------------- */

static inline __m512i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

#define PK_READS_Q4 1
#define PK_READS_Q5 1
#define PK_READS_KS 1
#include "gemm_pk.inc"

/* Nibble vector j of a five-bit Q5_0 block (its 320 bytes at c, gemm.h) as
 * Q8_0's codes, value + 128: slice j from the low nibbles, slice j + 4 from
 * the high ones, each (nibble | 0x70) + 0x10 where its fifth bit is set. */
static inline __attribute__((always_inline)) void q5_slices(const uint8_t *c, int j, __m512i *lo, __m512i *hi)
{
    const __m512i low = _mm512_set1_epi8(0x0F), c70 = _mm512_set1_epi8(0x70), c10 = _mm512_set1_epi8(0x10);
    const __m512i v = _mm512_load_si512((const void *)(c + 64 * j));
    uint64_t blo, bhi;
    memcpy(&blo, c + 256 + 8 * j, 8);
    memcpy(&bhi, c + 256 + 8 * (j + 4), 8);
    const __m512i l = _mm512_ternarylogic_epi32(v, low, c70, 0xEA);  /* (a & b) | c */
    const __m512i h = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low, c70, 0xEA);
    *lo = _mm512_mask_add_epi8(l, (__mmask64)blo, l, c10);
    *hi = _mm512_mask_add_epi8(h, (__mmask64)bhi, h, c10);
}

/* Slice j of half `part` of a six-bit Q6_K block (its 384 bytes at c,
 * gemm.h) as the byte layout's codes, value + 32: the nibble (low for the
 * first half, high for the second) with bits 4-5 from the half's high-bit
 * vector, shifted so that slice j's pair lands there. */
static inline __attribute__((always_inline)) __m512i q6_slice(const uint8_t *c, int part, int j)
{
    const __m512i low = _mm512_set1_epi8(0x0F), c30 = _mm512_set1_epi8(0x30);
    __m512i v = _mm512_load_si512((const void *)(c + 64 * j));
    if (part)
        v = _mm512_srli_epi16(v, 4);
    __m512i h = _mm512_load_si512((const void *)(c + 256 + 64 * part));
    h = j == 0 ? _mm512_slli_epi16(h, 4) : j == 1 ? _mm512_slli_epi16(h, 2) : j == 2 ? h : _mm512_srli_epi16(h, 2);
    return _mm512_ternarylogic_epi32(v, low, _mm512_and_si512(h, c30), 0xEA);  /* (a & b) | c */
}

/* The scales of half `part` of block b of a six-bit Q6_K group (nb blocks at
 * g): the int8 sc times the super-block's d, in f32 (exact, so the byte
 * layout's stored floats bit for bit). */
static inline __attribute__((always_inline)) __m512 q6_scales(const uint8_t *g, int64_t nb, int64_t b, int part)
{
    const __m128i sc = _mm_load_si128((const __m128i *)(g + (size_t)nb * 384 + (size_t)b * 32 + 16 * part));
    const __m512 d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(g + (size_t)nb * 416 + (size_t)(b / 8) * 32)));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
}

/* Nibble vector j of a five-bit Q5_K block (320 bytes at c: five-bit Q5_0's
 * layout, the codes 0..31 as they are) as the byte layout's codes: slice j
 * from the low nibbles, slice j + 4 from the high ones, each with 0x10 or'ed
 * in where its fifth bit is set. */
static inline __attribute__((always_inline)) void q5k_slices(const uint8_t *c, int j, __m512i *lo, __m512i *hi)
{
    const __m512i low = _mm512_set1_epi8(0x0F), c10 = _mm512_set1_epi8(0x10);
    const __m512i v = _mm512_load_si512((const void *)(c + 64 * j));
    uint64_t blo, bhi;
    memcpy(&blo, c + 256 + 8 * j, 8);
    memcpy(&bhi, c + 256 + 8 * (j + 4), 8);
    const __m512i l = _mm512_and_si512(v, low), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    *lo = _mm512_mask_add_epi8(l, (__mmask64)blo, l, c10);
    *hi = _mm512_mask_add_epi8(h, (__mmask64)bhi, h, c10);
}

/* The scale (mins: false) or min (true) of block b of a Q4_K or Q5_K group
 * packed with its file's scales (nb blocks of cb code bytes at g): d * sc,
 * or -dmin * m with dmin's sign flipped in its half, in f32: exact,
 * kern_unpack_row's floats. */
static inline __attribute__((always_inline)) __m512 ks_scales(const uint8_t *g, size_t cb, int64_t nb, int64_t b,
                                                              bool mins)
{
    const __m128i v = _mm_load_si128((const __m128i *)(g + (size_t)nb * (cb + 16 * mins) + (size_t)b * 16));
    __m256i h = _mm256_load_si256((const __m256i *)(g + (size_t)nb * (cb + 32) + (size_t)(b / 8) * 64 + 32 * mins));
    if (mins)
        h = _mm256_xor_si256(h, _mm256_set1_epi16((short)0x8000));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)));
}

/*
 * R groups of 16 rows (g, g + gs, ...) against NT tokens (from token t0), for
 * the layout K (gemm.h). Every (row, token) lane sees the same operations in
 * the same order whatever R and NT are: the integer sums are exact, and the
 * float steps are one fma per part and one per min, in block order.
 */
static inline __attribute__((always_inline)) void
pk_tile(const uint32_t K, const int R, const int NT, const uint8_t *g, size_t gs, const struct pk_acts *A,
        int t0, float *out, size_t ldo, const __mmask16 *mask, bool add, int n_ahead)
{
    const int64_t n = A->n, nb = A->nb;
    /* five-bit Q5_0 read in place: Q4_1's nibbles or'ed with 0x70 or 0x80
     * by its fifth bits, Q8_0's codes (value + 128) */
    const bool q5 = K == KERN_Q5_0, q6 = K == KERN_PK_Q6_K6, ks = kern_pk_ks(K), q5k = K == KERN_PK_Q5_KS;
    /* the sum starts at -128 x (Q8_0, Q5_0) or -8 x (four-bit Q4_0) the activations' */
    const bool Q8 = K == KERN_Q8_0 || q5 || K == KERN_Q4_0, nib = kern_pk_nibbles(K) || q5 || q5k;
    const bool f32 = kern_pk_f32(K);
    const int parts = kern_pk_parts(K), slices = 8 / parts;  /* byte slices a part */
    const size_t cb = kern_pk_code_bytes(K), sb = kern_pk_scale_bytes(K), mb = kern_pk_min_bytes(K);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 f[4][8];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++)
            f[r][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        /* decode tiles (four groups: one or two tokens) ask for the next
         * tile's groups, a block at a time, into L2: whole decode steps at
         * one token 1.07-1.16x faster (alternate steps of one process with
         * and without); the 256-bit products do the same (PK8_AHEAD);
         * n_ahead: the groups the matrix has after this tile's, up to R */
        if (R == 4)
            for (int q = R; q < R + n_ahead; q++) {
                const char *ga = (const char *)g + (size_t)q * gs;
                for (size_t o = 0; o < cb; o += 64)
                    _mm_prefetch(ga + (size_t)b * cb + o, _MM_HINT_T1);
                _mm_prefetch(ga + (size_t)nb * cb + (size_t)b * sb, _MM_HINT_T1);
                if ((q6 || ks) && b % 8 == 0)
                    _mm_prefetch(ga + (size_t)nb * (cb + sb + mb) + (size_t)b / 8 * kern_pk_super_bytes(K),
                                 _MM_HINT_T1);
                if (kern_pk_mins(K))
                    _mm_prefetch(ga + (size_t)nb * (cb + sb) + (size_t)b * mb, _MM_HINT_T1);
            }
#pragma GCC unroll 2
        for (int part = 0; part < parts; part++) {
            __m512i acc[4][8];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
#pragma GCC unroll 8
                for (int t = 0; t < NT; t++)
                    acc[r][t] = Q8 ? _mm512_set1_epi32(((const int32_t *)A->sa)[(size_t)(t0 + t) * nb + b])
                                : kern_pk_q6(K) ? _mm512_set1_epi32(A->b16[(size_t)(t0 + t) * 2 * nb + 2 * b + part])
                                                : _mm512_setzero_si512();
            if (q6) {
                /* six bits: the half's four slices, each widened in registers */
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const __m512i w = q6_slice(g + r * gs + (size_t)b * cb, part, j);
#pragma GCC unroll 8
                        for (int t = 0; t < NT; t++)
                            acc[r][t] = _mm512_dpbusd_epi32(
                                acc[r][t], w, bcast4(A->av + (size_t)(t0 + t) * n + 32 * b + 16 * part + 4 * j));
                    }
            } else if (!nib) {
                /* bytes: Q8_0's stored +128 (undone by its -128 * sum(a) start),
                 * the K-quants' unsigned as they are */
#pragma GCC unroll 8
                for (int k = slices * part; k < slices * (part + 1); k++)
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const __m512i w = _mm512_load_si512((const void *)(g + r * gs + (size_t)b * 512 + 64 * k));
#pragma GCC unroll 8
                        for (int t = 0; t < NT; t++)
                            acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], w,
                                                            bcast4(A->av + (size_t)(t0 + t) * n + 32 * b + 4 * k));
                    }
            } else {
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const uint8_t *c = g + r * gs + (size_t)b * cb;
                        __m512i lo, hi;
                        if (q5) {
                            q5_slices(c, j, &lo, &hi);
                        } else if (q5k) {
                            q5k_slices(c, j, &lo, &hi);
                        } else {
                            const __m512i v = _mm512_load_si512((const void *)(c + 64 * j));
                            lo = _mm512_and_si512(v, low);
                            hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                        }
#pragma GCC unroll 8
                        for (int t = 0; t < NT; t++) {
                            const int8_t *a = A->av + (size_t)(t0 + t) * n + 32 * b + 4 * j;
                            acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], lo, bcast4(a));
                            acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], hi, bcast4(a + 16));
                        }
                    }
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const uint8_t *sc = g + r * gs + (size_t)nb * cb + (size_t)b * sb;
                const __m512 dw = q6    ? q6_scales(g + r * gs, nb, b, part)
                                  : ks  ? ks_scales(g + r * gs, cb, nb, b, false)
                                  : f32 ? _mm512_load_ps((const void *)(sc + 64 * part))
                                        : _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)sc));
#pragma GCC unroll 8
                for (int t = 0; t < NT; t++)
                    f[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]),
                                              _mm512_mul_ps(dw, _mm512_set1_ps(A->da[(size_t)(t0 + t) * nb + b])),
                                              f[r][t]);
            }
        }
        if (kern_pk_mins(K)) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const uint8_t *mn = g + r * gs + (size_t)nb * (cb + sb) + (size_t)b * mb;
                const __m512 mw = ks    ? ks_scales(g + r * gs, cb, nb, b, true)
                                  : f32 ? _mm512_load_ps((const void *)mn)
                                        : _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)mn));
#pragma GCC unroll 8
                for (int t = 0; t < NT; t++)
                    f[r][t] = _mm512_fmadd_ps(
                        mw, _mm512_set1_ps(((const float *)A->sa)[(size_t)(t0 + t) * nb + b]), f[r][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            float *o = out + (size_t)(t0 + t) * ldo + (size_t)r * KERN_PACK_ROWS;
            __m512 v = f[r][t];
            if (add)
                v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask[r], o), v);
            _mm512_mask_storeu_ps(o, mask[r], v);
        }
}

/* The tiles a call is cut into: R row groups x NT tokens, R * NT <= 8 so that
 * accumulators stay in registers; small batches take more row groups at once
 * (independent dependency chains), large ones more tokens (fewer weight loads). */
#define PK_CASE(K, R, NT)                                                                      \
    case (R) * 16 + (NT):                                                                      \
        pk_tile(K, R, NT, g, gs, A, t0, out, ldo, mask, add, n_ahead);                         \
        break
#define PK_CASES(K)                                                                            \
    switch (R * 16 + NT) {                                                                     \
    PK_CASE(K, 1, 1); PK_CASE(K, 1, 2); PK_CASE(K, 1, 3); PK_CASE(K, 1, 4);                    \
    PK_CASE(K, 1, 5); PK_CASE(K, 1, 6); PK_CASE(K, 1, 7); PK_CASE(K, 1, 8);                    \
    PK_CASE(K, 2, 3); PK_CASE(K, 2, 4); PK_CASE(K, 4, 1); PK_CASE(K, 4, 2);                    \
    default: break;                                                                            \
    }                                                                                          \
    break

static void pk_dispatch(uint32_t K, int R, int NT, const uint8_t *g, size_t gs, const struct pk_acts *A, int t0,
                        float *out, size_t ldo, const __mmask16 *mask, bool add, int n_ahead)
{
    switch (K) {
    case KERN_Q4_1: PK_CASES(KERN_Q4_1);
    case KERN_Q8_0: PK_CASES(KERN_Q8_0);
    case KERN_Q4_0: PK_CASES(KERN_Q4_0);
    case KERN_Q5_0: PK_CASES(KERN_Q5_0);
    case KERN_Q4_K: PK_CASES(KERN_Q4_K);
    case KERN_Q5_K: PK_CASES(KERN_Q5_K);
    case KERN_Q6_K: PK_CASES(KERN_Q6_K);
    case KERN_PK_Q6_K6: PK_CASES(KERN_PK_Q6_K6);
    case KERN_PK_Q4_KS: PK_CASES(KERN_PK_Q4_KS);
    case KERN_PK_Q5_KS: PK_CASES(KERN_PK_Q5_KS);
    default: break;
    }
}

/* Group g of a five-bit Q5_0 matrix (nb blocks) in Q8_0's layout at q
 * (q5_slices' codes, then the scales as they are); ahead, the group a tile
 * later, is asked into L2 a block at a time. */
static void q5_widen(const uint8_t *g, int64_t nb, uint8_t *q, const uint8_t *ahead)
{
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *c = g + (size_t)b * 320;
        uint8_t *o = q + (size_t)b * 512;
        if (ahead != NULL)
            for (int l = 0; l < 320; l += 64)
                _mm_prefetch((const char *)ahead + (size_t)b * 320 + l, _MM_HINT_T1);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m512i lo, hi;
            q5_slices(c, j, &lo, &hi);
            _mm512_store_si512((void *)(o + 64 * j), lo);
            _mm512_store_si512((void *)(o + 64 * (j + 4)), hi);
        }
    }
    if (ahead != NULL)
        for (size_t l = 0; l < (size_t)nb * 32; l += 64)
            _mm_prefetch((const char *)ahead + (size_t)nb * 320 + l, _MM_HINT_T1);
    memcpy(q + (size_t)nb * 512, g + (size_t)nb * 320, (size_t)nb * 32);
}

/* Group g of a six-bit Q6_K matrix (nb blocks) in the byte layout at q
 * (q6_slice's codes, then q6_scales' floats); ahead as q5_widen's. */
static void q6_widen(const uint8_t *g, int64_t nb, uint8_t *q, const uint8_t *ahead)
{
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *c = g + (size_t)b * 384;
        uint8_t *o = q + (size_t)b * 512;
        if (ahead != NULL) {
            for (int l = 0; l < 384; l += 64)
                _mm_prefetch((const char *)ahead + (size_t)b * 384 + l, _MM_HINT_T1);
            if (b % 2 == 0)
                _mm_prefetch((const char *)ahead + (size_t)nb * 384 + (size_t)b * 32, _MM_HINT_T1);
            if (b % 8 == 0)
                _mm_prefetch((const char *)ahead + (size_t)nb * 416 + (size_t)b / 8 * 32, _MM_HINT_T1);
        }
#pragma GCC unroll 2
        for (int part = 0; part < 2; part++) {
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
                _mm512_store_si512((void *)(o + 64 * (4 * part + j)), q6_slice(c, part, j));
            _mm512_store_ps((void *)(q + (size_t)nb * 512 + (size_t)b * 128 + 64 * part), q6_scales(g, nb, b, part));
        }
    }
}

/* Group g of a five-bit Q5_K matrix (nb blocks) in Q5_K's byte layout at q
 * (q5k_slices' codes, then ks_scales' scales and mins); ahead as q5_widen's. */
static void q5k_widen(const uint8_t *g, int64_t nb, uint8_t *q, const uint8_t *ahead)
{
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *c = g + (size_t)b * 320;
        uint8_t *o = q + (size_t)b * 512;
        if (ahead != NULL) {
            for (int l = 0; l < 320; l += 64)
                _mm_prefetch((const char *)ahead + (size_t)b * 320 + l, _MM_HINT_T1);
            if (b % 4 == 0) {
                _mm_prefetch((const char *)ahead + (size_t)nb * 320 + (size_t)b * 16, _MM_HINT_T1);
                _mm_prefetch((const char *)ahead + (size_t)nb * 336 + (size_t)b * 16, _MM_HINT_T1);
            }
            if (b % 8 == 0)
                _mm_prefetch((const char *)ahead + (size_t)nb * 352 + (size_t)b / 8 * 64, _MM_HINT_T1);
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m512i lo, hi;
            q5k_slices(c, j, &lo, &hi);
            _mm512_store_si512((void *)(o + 64 * j), lo);
            _mm512_store_si512((void *)(o + 64 * (j + 4)), hi);
        }
        _mm512_store_ps((void *)(q + (size_t)nb * 512 + (size_t)b * 64), ks_scales(g, 320, nb, b, false));
        _mm512_store_ps((void *)(q + (size_t)nb * 576 + (size_t)b * 64), ks_scales(g, 320, nb, b, true));
    }
}

bool kern_gemm_packed_vnni(const struct kern_gemm_args *a)
{
    if (!pk_usable(a))
        return false;
    const struct kern_packed *pk = a->packed;
    struct pk_acts A;
    pk_stage(a, true, &A);
    const struct pk_acts *Ap = &A;
    /* five-bit Q5_0: read in place by the tiles of up to four tokens (where
     * a group meets few tokens: decode); for more, each group is widened to
     * Q8_0's layout once and Q8_0's tiles run over it. Gemma 3's decode step
     * at 8 tokens (bench-ceiling -m, weights from memory): widened 1.08-1.15x
     * the byte layout, in place 1.04-1.05x; with the weights in cache (its
     * warm table) widening costs 10% more than reading in place at 8 tokens,
     * and from 32 on it is shared by four tiles and more. Four-bit Q4_0 is
     * read in place always, as Q4_1 is. */
    const bool q5 = pk->wtype == KERN_Q5_0 && a->T > 4;  /* so R is 1: the scratch holds one group */
    /* six-bit Q6_K likewise, to bytes, from 5 tokens on: in place at 8 its
     * slices cost more than the bytes they save (bench-ceiling -m on a
     * random Q6_K model: the decode step's products at 8 tokens 0.94x the
     * byte layout's read in place, 1.03-1.05x widened; at one token 1.2x) */
    const bool q6 = pk->wtype == KERN_PK_Q6_K6 && a->T > 4;
    const bool q5k = pk->wtype == KERN_PK_Q5_KS && a->T > 4;  /* five-bit Q5_K as six-bit Q6_K */
    const uint32_t K = q5 ? KERN_Q8_0 : q6 || q5k ? kern_pk_source(pk->wtype) : pk->wtype;
    const size_t gs = pk->group_bytes, gs8 = ((size_t)A.nb * (q6 || q5k ? 640 : 544) + 63) / 64 * 64;
    uint8_t *wide = pk_align64(A.rest);
    const long g_end = (a->r1 + KERN_PACK_ROWS - 1) / KERN_PACK_ROWS;
    const long g_all = (pk->rows + KERN_PACK_ROWS - 1) / KERN_PACK_ROWS;
    const int R_want = a->T <= 2 ? 4 : a->T <= 4 ? 2 : 1;
    for (long gi = a->r0 / KERN_PACK_ROWS; gi < g_end;) {
        const int R = g_end - gi >= R_want ? R_want : 1;
        __mmask16 mask[4];
        for (int r = 0; r < R; r++)
            mask[r] = pk_group_mask(gi + r, a->r0, a->r1);
        const long after = g_all - gi - R;  /* groups of the matrix after this tile's */
        int n_ahead = after < R ? (int)(after > 0 ? after : 0) : R;
        const uint8_t *g = pk->data + (size_t)gi * gs;
        size_t ts = gs;
        if (q5 || q6 || q5k) {  /* R is 1 */
            if (q5)
                q5_widen(g, A.nb, wide, n_ahead > 0 ? g + gs : NULL);
            else if (q6)
                q6_widen(g, A.nb, wide, n_ahead > 0 ? g + gs : NULL);
            else
                q5k_widen(g, A.nb, wide, n_ahead > 0 ? g + gs : NULL);
            g = wide;
            ts = gs8;
            n_ahead = 0;  /* asked for by the widening */
        }
        float *o = a->out + (size_t)gi * KERN_PACK_ROWS;
        for (int t0 = 0; t0 < a->T;) {
            int NT = a->T - t0;
            if (NT > 8 / R)
                NT = 8 / R;
            pk_dispatch(K, R, NT, g, ts, Ap, t0, o, a->ldo, mask, a->add, n_ahead);
            t0 += NT;
        }
        gi += R;
    }
    return true;
}
#endif
