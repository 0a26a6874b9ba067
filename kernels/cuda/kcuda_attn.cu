/*
 * kcuda_attn.cu - paged attention over an F16, Q8_0 or Q4_0 cache (K and V
 * each their own type): decode, prefill and the log-sum-exp merge (twins:
 * kern_attn_paged, kern_attn, kern_attn_merge).
 *
 * The unit of work is one warp holding R query rows (the heads of one KV head's
 * group, for one or more tokens) over one split of positions [s*C, s*C + C).
 * It walks the split in tiles of 32 keys staged in shared memory:
 *   - scores: lane i owns key i of the tile and computes its dot product with
 *     every row (queries broadcast from shared memory, d in order);
 *   - softmax: per row the tile's max (a butterfly, exact), a running max m,
 *     each lane's running share of the sum, rescaled when m grows;
 *   - values: lane i owns head_dim/32 output dimensions and adds p * v over
 *     the tile's keys in key order.
 * Over quantized K the rows' queries are held as Q8_0 (int8 codes, the f16
 * scale of each 32-value block and the codes' sum) and lane i's score is a sum
 * over blocks of dp4a integer dot products times both scales, in block order
 * as kern_vec_dot sums them; Q4_0 codes c are used as c - 8 by subtracting
 * 8 * (the query block's code sum). Quantized rows are staged in shared memory
 * as they are stored (no f32 or f16 copy) and V values are dequantized in
 * registers (d * code), as the twin's kern_dequantize_row gives them.
 * At the end of a split the lanes' sums are added by a butterfly, and the
 * split's (m, l, acc) is folded into the row's merged state in split order:
 *     M' = max(M, m);  L = L e^(M-M') + l e^(m-M');  O = O e^(M-M') + acc e^(m-M')
 * and the output is O / L. Every operation of a row is written with explicit
 * rounding intrinsics, so a row's bits depend only on its query, its keys and
 * the split size, never on which other rows share its warp: decode (one token
 * per warp, one split per warp, partials folded by merge_kernel) and prefill
 * (several tokens per warp, all splits folded in registers) agree exactly.
 *
 * Differences from the C twin, within the tested tolerance: fp32 exp
 * (__expf), the order of sums, and probabilities kept in fp32 where the twin
 * rounds them to f16 (the queries are rounded to f16 as the twin does).
 */
#include <math.h>

#include "kcuda_impl.cuh"

namespace {

constexpr int TILE = 32;        /* keys per tile, one per lane */

/* Warps per decode block, and a prefill warp's most rows and a block's warps:
 * they keep the static shared memory under 48 KiB (at head dim 256 a K and a
 * V tile take 32 KiB). */
template <int D> struct DecodeWarps { static constexpr int value = D == 64 ? 4 : D == 128 ? 2 : 1; };
template <int D> struct PfRows { static constexpr int value = D == 256 ? 4 : 8; };
template <int D> struct PfWarps { static constexpr int value = D == 256 ? 2 : 4; };

/* What every kernel of this file reads. */
struct Params {
    const uint8_t *k, *v;       /* layer's K and V in block 0 */
    uint64_t block_stride, k_head_stride, v_head_stride;
    uint32_t k_type, v_type;
    int k_row, v_row;           /* bytes of one token's row of one head */
    int block_tokens, n_head, n_head_kv;
    const kcuda_seq *seqs;
    int n_seq;
    const uint32_t *tables;
    const float *q;
    float *out;
    float scale;
    int window;                 /* a query at p sees [p + 1 - window, p]; 0: [0, p] */
    int split;                  /* positions per split (multiple of TILE) */
    int max_split;              /* decode: splits of the longest sequence */
    float *part_acc;            /* decode: (n_seq, n_head, max_split, D) */
    float *part_ml;             /* decode: (n_seq, n_head, max_split, 2) max and sum */
};

/* One split's running state of R rows, held by a warp. */
template <int D, int R> struct SplitState {
    float m[R];                 /* running max score (uniform over lanes) */
    float l[R];                 /* this lane's share of sum exp(score - m) */
    float acc[R][D / 32];       /* unnormalized output, this lane's dimensions */
};

template <int D, int R> __device__ __forceinline__ void split_init(SplitState<D, R> &st)
{
#pragma unroll
    for (int r = 0; r < R; r++) {
        st.m[r] = -INFINITY;
        st.l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < D / 32; i++)
            st.acc[r][i] = 0.0f;
    }
}

/* Folds a finished split (max m, total l, acc) into a row's merged state.
 * The first fold of a row (M = -inf, L = O = 0) leaves exactly (m, l, acc). */
template <int DPL>
__device__ __forceinline__ void fold(float &M, float &L, float (&O)[DPL], float m, float l, const float (&acc)[DPL])
{
    const float Mn = fmaxf(M, m);
    const float a = __expf(M - Mn), b = __expf(m - Mn);
    L = __fadd_rn(__fmul_rn(L, a), __fmul_rn(l, b));
#pragma unroll
    for (int i = 0; i < DPL; i++)
        O[i] = __fadd_rn(__fmul_rn(O[i], a), __fmul_rn(acc[i], b));
    M = Mn;
}

/*
 * Stages keys [t0, t0 + 32) of one KV head's K or V (its rows at base +
 * head_off in each block) into a shared tile. Keys at or past `end`, and
 * keys before `beg` (before every window of the tile's queries: their
 * blocks may have left the table), are zero-filled without being read. NTHR threads (tid < NTHR, whole warps)
 * share the copy.
 *   F16: 32 rows of D halves, 16-byte chunks swizzled by (chunk ^ (key & 7))
 *   so that lanes reading their own row, or all lanes reading one row, hit
 *   distinct banks. Lane i of every warp finds key t0+i in the block table
 *   once, and the warp's copies take its offset from that lane.
 *   Q8_0 / Q4_0: the 32 rows as stored, row_bytes apart (a multiple of 4),
 *   one warp per key copying 4-byte words.
 */
template <int D, int NTHR>
__device__ __forceinline__ void half_load(uint4 *dst, const uint8_t *base, uint32_t type, int row_bytes,
                                          uint64_t head_off, const uint32_t *table, int bt,
                                          uint64_t block_stride, int t0, int beg, int end, int tid)
{
    static_assert(NTHR % 32 == 0, "whole warps");
    if (type == KERN_F16) {
        constexpr int CH = D / 8;
        static_assert(TILE * CH % NTHR == 0, "the copy splits evenly over whole warps");
        const int kp = t0 + tid % 32;
        uint64_t off = 0;
        if (kp >= beg && kp < end) {
            const int b = kp / bt;
            off = (uint64_t)__ldg(table + b) * block_stride + head_off + (uint64_t)(kp - b * bt) * (D * 2);
        }
        const uint32_t off_lo = (uint32_t)off, off_hi = (uint32_t)(off >> 32);
#pragma unroll
        for (int j = 0; j < TILE * CH / NTHR; j++) {
            const int i = tid + j * NTHR;
            const int key = i / CH, c = i % CH;
            const uint64_t o = (uint64_t)__shfl_sync(KCUDA_FULL, off_lo, key) |
                               (uint64_t)__shfl_sync(KCUDA_FULL, off_hi, key) << 32;
            const bool in = t0 + key >= beg && t0 + key < end;
            kc_cp_async16(dst + key * CH + (c ^ (key & 7)), in ? base + o + c * 16 : base, in ? 16 : 0);
        }
        return;
    }
    uint32_t *d32 = reinterpret_cast<uint32_t *>(dst);
    const int words = row_bytes / 4;
    for (int key = tid / 32; key < TILE; key += NTHR / 32) {
        const int kp = t0 + key;
        uint32_t *row = d32 + key * words;
        if (kp >= beg && kp < end) {
            const int b = kp / bt;
            const uint32_t *src = reinterpret_cast<const uint32_t *>(
                base + (uint64_t)__ldg(table + b) * block_stride + head_off + (uint64_t)(kp - b * bt) * row_bytes);
            for (int w = tid % 32; w < words; w += 32)
                row[w] = __ldg(src + w);
        } else {
            for (int w = tid % 32; w < words; w += 32)
                row[w] = 0;
        }
    }
}

/* K and V of keys [t0, t0 + 32) of KV head kvh, those in [beg, end) read (see half_load). */
template <int D, int NTHR>
__device__ __forceinline__ void tile_load(uint4 *dk, uint4 *dv, const Params &p, int kvh, const uint32_t *table,
                                          int t0, int beg, int end, int tid)
{
    half_load<D, NTHR>(dk, p.k, p.k_type, p.k_row, (uint64_t)kvh * p.k_head_stride, table, p.block_tokens,
                       p.block_stride, t0, beg, end, tid);
    half_load<D, NTHR>(dv, p.v, p.v_type, p.v_row, (uint64_t)kvh * p.v_head_stride, table, p.block_tokens,
                       p.block_stride, t0, beg, end, tid);
}

/* This lane's D/32 dimensions of key k of a swizzled tile, as floats. */
template <int D>
__device__ __forceinline__ void tile_dims(const uint4 *tile, int k, int lane, float (&vf)[D / 32])
{
    constexpr int CH = D / 8, DPL = D / 32;
    const int byte = lane * DPL * 2;
    const uint8_t *p = reinterpret_cast<const uint8_t *>(tile + k * CH + ((byte / 16) ^ (k & 7))) + byte % 16;
    if constexpr (DPL == 2) {
        const uint32_t w = *reinterpret_cast<const uint32_t *>(p);
        vf[0] = kc_half(w);
        vf[1] = kc_half(w >> 16);
    } else if constexpr (DPL == 8) {
        kc_unpack8(*reinterpret_cast<const uint4 *>(p), vf);
    } else {
        const uint2 w = *reinterpret_cast<const uint2 *>(p);
        vf[0] = kc_half(w.x);
        vf[1] = kc_half(w.x >> 16);
        vf[2] = kc_half(w.y);
        vf[3] = kc_half(w.y >> 16);
    }
}

/* This lane's D/32 dimensions of key k of a tile of Q8_0 / Q4_0 rows (row_bytes
 * apart), dequantized as d * code (Q4_0: code - 8), the twin's values. */
template <int D>
__device__ __forceinline__ void tile_dims_q(const uint4 *tile, int k, int lane, uint32_t type, int row_bytes,
                                            float (&vf)[D / 32])
{
    constexpr int DPL = D / 32;
    const int j0 = lane * DPL, o = j0 % 32;
    const int bb = type == KERN_Q8_0 ? (int)sizeof(kern_block_q8_0) : (int)sizeof(kern_block_q4_0);
    const uint8_t *blk = reinterpret_cast<const uint8_t *>(tile) + k * row_bytes + (j0 / 32) * bb;
    const float d = kc_half(*reinterpret_cast<const uint16_t *>(blk));
    const uint8_t *qs = blk + 2;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        const int j = o + i;
        const int c = type == KERN_Q8_0 ? (int)(int8_t)qs[j] : (j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4) - 8;
        vf[i] = __fmul_rn(d, (float)c);
    }
}

/* The query rows of a quantized-K warp, inside the float area sq of R*D
 * floats: int8 codes (row r at byte r*D), then each block's scale as a float
 * (the f16 value) and the sum of its codes. */
template <int D, int R> struct QQuery {
    static constexpr int NB = D / 32;
    int8_t *qs;
    float *d;
    int *sum;
    __device__ __forceinline__ explicit QQuery(float *sq)
        : qs(reinterpret_cast<int8_t *>(sq)), d(sq + R * D / 4), sum(reinterpret_cast<int *>(sq + R * D / 4 + R * NB))
    {
    }
};

/* Lane `lane`'s score of the tile's key `lane` against R quantized query rows:
 * per 32-value block the integer dot product by dp4a, then scaled and summed
 * in block order as kern_vec_dot sums it (Q8_0: (dk * dq) * si; Q4_0:
 * (si * dk) * dq, codes c - 8). */
template <int D, int R>
__device__ __forceinline__ void scores_q(float (&s)[R], const QQuery<D, R> &qq, const uint4 *sk, uint32_t type,
                                         int row_bytes, int lane)
{
    const uint8_t *row = reinterpret_cast<const uint8_t *>(sk) + lane * row_bytes;
#pragma unroll
    for (int b = 0; b < D / 32; b++) {
        if (type == KERN_Q8_0) {
            const uint16_t *h = reinterpret_cast<const uint16_t *>(row + b * (int)sizeof(kern_block_q8_0));
            const float dk = kc_half(h[0]);
            int w[8];
#pragma unroll
            for (int i = 0; i < 8; i++)
                w[i] = (int)((uint32_t)h[1 + 2 * i] | (uint32_t)h[2 + 2 * i] << 16);
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int *qw = reinterpret_cast<const int *>(qq.qs + r * D + b * 32);
                int si = 0;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    si = __dp4a(w[i], qw[i], si);
                s[r] = __fadd_rn(s[r], __fmul_rn(__fmul_rn(dk, qq.d[r * (D / 32) + b]), (float)si));
            }
        } else {
            const uint16_t *h = reinterpret_cast<const uint16_t *>(row + b * (int)sizeof(kern_block_q4_0));
            const float dk = kc_half(h[0]);
            int lo[4], hi[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint32_t u = (uint32_t)h[1 + 2 * i] | (uint32_t)h[2 + 2 * i] << 16;
                lo[i] = (int)(u & 0x0F0F0F0Fu);         /* values 4i .. 4i+3 */
                hi[i] = (int)((u >> 4) & 0x0F0F0F0Fu);  /* values 16+4i .. 16+4i+3 */
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int *qw = reinterpret_cast<const int *>(qq.qs + r * D + b * 32);
                int si = 0;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    si = __dp4a(lo[i], qw[i], si);
                    si = __dp4a(hi[i], qw[4 + i], si);
                }
                si -= 8 * qq.sum[r * (D / 32) + b];
                s[r] = __fadd_rn(s[r], __fmul_rn(__fmul_rn((float)si, dk), qq.d[r * (D / 32) + b]));
            }
        }
    }
}

/*
 * One tile for R rows: sq holds the rows' queries (f16-rounded floats, row r
 * at sq + r*D, over F16 K; a QQuery over quantized K), sk/sv the tile. Row r
 * sees keys [lo[r], qp[r]]; a row whose range misses the tile is left exactly
 * as it was. n_keys (uniform) bounds the keys whose values are read; keys
 * outside a row's range get probability 0 and leave its sums unchanged.
 */
template <int D, int R>
__device__ __forceinline__ void tile_step(SplitState<D, R> &st, float *sq, const uint4 *sk, const uint4 *sv,
                                          const int (&qp)[R], const int (&lo)[R], int t0, int n_keys,
                                          const Params &pr, int lane)
{
    constexpr int CH = D / 8, DPL = D / 32;
    const int key = t0 + lane;
    const float scale = pr.scale;

    /* scores of this lane's key against every row, dimensions in order */
    float s[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        s[r] = 0.0f;
    if (pr.k_type != KERN_F16) {
        scores_q<D, R>(s, QQuery<D, R>(sq), sk, pr.k_type, pr.k_row, lane);
    } else {
#pragma unroll
        for (int c = 0; c < CH; c++) {
            float kf[8];
            kc_unpack8(sk[lane * CH + (c ^ (lane & 7))], kf);
    #pragma unroll
            for (int r = 0; r < R; r++) {
                const float4 a = *reinterpret_cast<const float4 *>(sq + r * D + c * 8);
                const float4 b = *reinterpret_cast<const float4 *>(sq + r * D + c * 8 + 4);
                float x = s[r];
                x = __fmaf_rn(a.x, kf[0], x);
                x = __fmaf_rn(a.y, kf[1], x);
                x = __fmaf_rn(a.z, kf[2], x);
                x = __fmaf_rn(a.w, kf[3], x);
                x = __fmaf_rn(b.x, kf[4], x);
                x = __fmaf_rn(b.y, kf[5], x);
                x = __fmaf_rn(b.z, kf[6], x);
                x = __fmaf_rn(b.w, kf[7], x);
                s[r] = x;
            }
        }
    }

    /* online softmax: new max, rescale of the running sums, probabilities */
    float p[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        float alpha = 1.0f;
        p[r] = 0.0f;
        if (t0 <= qp[r] && t0 + TILE > lo[r]) {     /* uniform over the warp */
            const float sr = key <= qp[r] && key >= lo[r] ? __fmul_rn(s[r], scale) : -INFINITY;
            const float mn = fmaxf(st.m[r], kc_warp_max(sr));
            alpha = __expf(st.m[r] - mn);
            p[r] = __expf(sr - mn);
            st.m[r] = mn;
        }
        st.l[r] = __fadd_rn(__fmul_rn(st.l[r], alpha), p[r]);
#pragma unroll
        for (int i = 0; i < DPL; i++)
            st.acc[r][i] = __fmul_rn(st.acc[r][i], alpha);
    }

    /* values: this lane's dimensions, keys in order */
#pragma unroll 2
    for (int k = 0; k < n_keys; k++) {
        float vf[DPL];
        if (pr.v_type == KERN_F16)
            tile_dims<D>(sv, k, lane, vf);
        else
            tile_dims_q<D>(sv, k, lane, pr.v_type, pr.v_row, vf);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float pk = __shfl_sync(KCUDA_FULL, p[r], k);
#pragma unroll
            for (int i = 0; i < DPL; i++)   /* a key of weight 0 adds nothing, even an
                                             * infinite value (a masked key of prefill
                                             * must leave the same bits as no key) */
                st.acc[r][i] = pk != 0.0f ? __fmaf_rn(pk, vf[i], st.acc[r][i]) : st.acc[r][i];
        }
    }
}

/* Loads R rows' queries (row r = token r / G, head g = r % G of KV head kvh)
 * as the C twin meets K with them: rounded to f16 over F16 K; over quantized K
 * quantized to Q8_0 as kern_quantize_act does (a QQuery). Rows of invalid
 * tokens get zeros. */
template <int D, int G, int R>
__device__ __forceinline__ void load_queries(float *sq, const float *q, int n_head, int kvh, int row0,
                                             const bool (&valid)[R / G], uint32_t k_type, int lane)
{
    if (k_type == KERN_F16) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int j = r / G, g = r % G;
            const float *src = q + ((size_t)(row0 + j) * n_head + (size_t)kvh * G + g) * D;
#pragma unroll
            for (int d = lane; d < D; d += 32)
                sq[r * D + d] = valid[j] ? __half2float(__float2half_rn(src[d])) : 0.0f;
        }
        return;
    }
    const QQuery<D, R> qq(sq);
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int j = r / G, g = r % G;
        const float *src = q + ((size_t)(row0 + j) * n_head + (size_t)kvh * G + g) * D;
#pragma unroll
        for (int b = 0; b < D / 32; b++) {
            float d;
            int sum;
            const int c = kc_quant32(valid[j] ? src[b * 32 + lane] : 0.0f, &d, &sum);
            qq.qs[r * D + b * 32 + lane] = (int8_t)c;
            if (lane == 0) {
                qq.d[r * (D / 32) + b] = __half2float(__float2half_rn(d));
                qq.sum[r * (D / 32) + b] = sum;
            }
        }
    }
}

/* One warp per (sequence, KV head, split) of one decode token. */
template <int D, int G>
__global__ void __launch_bounds__(DecodeWarps<D>::value * 32) decode_kernel(const Params p)
{
    constexpr int W = DecodeWarps<D>::value, CH = D / 8, DPL = D / 32;
    __shared__ __align__(16) uint4 sk[W][TILE * CH];
    __shared__ __align__(16) uint4 sv[W][TILE * CH];
    __shared__ __align__(16) float sq[W][G * D];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long gw = (long)blockIdx.x * W + warp;
    const int split = (int)(gw % p.max_split);
    const long rest = gw / p.max_split;
    const int kvh = (int)(rest % p.n_head_kv);
    const long s = rest / p.n_head_kv;
    if (s >= p.n_seq)
        return;
    const kcuda_seq seq = p.seqs[s];
    const int n_ctx = seq.pos + 1;
    const int n_split = (n_ctx + p.split - 1) / p.split;
    if (n_split > p.max_split)
        __trap();               /* a context past the grid's max_ctx: a caller bug, not a result */
    const int lo0 = p.window > 0 && n_ctx > p.window ? n_ctx - p.window : 0;
    const int s_first = lo0 / p.split;  /* splits before the window's are not run */
    if (split >= n_split || split < s_first)
        return;                 /* past this sequence's context, or before its window */

    const bool valid[1] = { true };
    load_queries<D, G, G>(sq[warp], p.q, p.n_head, kvh, seq.row, valid, p.k_type, lane);
    int qp[G], lo[G];
#pragma unroll
    for (int r = 0; r < G; r++) {
        qp[r] = seq.pos;
        lo[r] = lo0;
    }

    SplitState<D, G> st;
    split_init(st);
    const uint32_t *table = p.tables + seq.table;
    const int k0 = split * p.split, k1 = min(k0 + p.split, n_ctx);
    __syncwarp();               /* the queries are in shared memory */
    for (int t0 = max(k0, lo0 / TILE * TILE); t0 < k1; t0 += TILE) {
        tile_load<D, 32>(sk[warp], sv[warp], p, kvh, table, t0, lo0, k1, lane);
        kc_cp_async_wait_all();
        __syncwarp();
        tile_step<D, G>(st, sq[warp], sk[warp], sv[warp], qp, lo, t0, min(TILE, k1 - t0), p, lane);
        __syncwarp();
    }

#pragma unroll
    for (int r = 0; r < G; r++) {
        const float l = kc_warp_sum(st.l[r]);
        const int h = kvh * G + r;
        if (n_split - s_first == 1) {
            float M = -INFINITY, L = 0.0f, O[DPL];
#pragma unroll
            for (int i = 0; i < DPL; i++)
                O[i] = 0.0f;
            fold<DPL>(M, L, O, st.m[r], l, st.acc[r]);
            float *o = p.out + ((size_t)seq.row * p.n_head + h) * D + lane * DPL;
#pragma unroll
            for (int i = 0; i < DPL; i++)
                o[i] = __fdiv_rn(O[i], L);
        } else {
            const size_t idx = ((size_t)s * p.n_head + h) * p.max_split + split;
            if (lane == 0) {
                p.part_ml[2 * idx] = st.m[r];
                p.part_ml[2 * idx + 1] = l;
            }
#pragma unroll
            for (int i = 0; i < DPL; i++)
                p.part_acc[idx * D + lane * DPL + i] = st.acc[r][i];
        }
    }
}

/* One warp per (sequence, query head) whose context spans several splits:
 * folds the splits' partials in split order. */
template <int D>
__global__ void __launch_bounds__(128) merge_kernel(const Params p)
{
    constexpr int DPL = D / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long gw = (long)blockIdx.x * 4 + warp;
    const long s = gw / p.n_head;
    const int h = (int)(gw % p.n_head);
    if (s >= p.n_seq)
        return;
    const kcuda_seq seq = p.seqs[s];
    const int n_ctx = seq.pos + 1;
    const int n_split = (n_ctx + p.split - 1) / p.split;
    if (n_split > p.max_split)
        __trap();               /* as in decode_kernel */
    const int s_first = (p.window > 0 && n_ctx > p.window ? n_ctx - p.window : 0) / p.split;
    if (n_split - s_first <= 1)
        return;
    float M = -INFINITY, L = 0.0f, O[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++)
        O[i] = 0.0f;
    for (int sp = s_first; sp < n_split; sp++) {
        const size_t idx = ((size_t)s * p.n_head + h) * p.max_split + sp;
        float acc[DPL];
#pragma unroll
        for (int i = 0; i < DPL; i++)
            acc[i] = p.part_acc[idx * D + lane * DPL + i];
        fold<DPL>(M, L, O, p.part_ml[2 * idx], p.part_ml[2 * idx + 1], acc);
    }
    float *o = p.out + ((size_t)seq.row * p.n_head + h) * D + lane * DPL;
#pragma unroll
    for (int i = 0; i < DPL; i++)
        o[i] = __fdiv_rn(O[i], L);
}

/* One block per (query tile, KV head, sequence): PF_WARPS warps of QTW tokens
 * each share the K/V tiles; every split of the context is folded in registers. */
template <int D, int G>
__global__ void __launch_bounds__(PfWarps<D>::value * 32) prefill_kernel(const Params p)
{
    constexpr int PF_WARPS = PfWarps<D>::value;
    constexpr int QTW = PfRows<D>::value / G, R = QTW * G, QT = PF_WARPS * QTW;
    static_assert(QTW >= 1, "a warp holds a whole group");
    constexpr int CH = D / 8, DPL = D / 32;
    __shared__ __align__(16) uint4 sk[TILE * CH];
    __shared__ __align__(16) uint4 sv[TILE * CH];
    __shared__ __align__(16) float sq[PF_WARPS][R * D];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const kcuda_seq seq = p.seqs[blockIdx.z];
    const int kvh = blockIdx.y;
    const int tile0 = blockIdx.x * QT;
    if (seq.n_tok > (int)gridDim.x * QT)
        __trap();               /* a chunk longer than max_tok: tokens nobody would compute */
    if (tile0 >= seq.n_tok)
        return;                 /* the whole block */
    const int tok_end = min(seq.n_tok, tile0 + QT);
    const int kv_end = seq.pos + tok_end;
    const int first = tile0 + warp * QTW;   /* this warp's first token */

    bool valid[QTW];
#pragma unroll
    for (int j = 0; j < QTW; j++)
        valid[j] = first + j < tok_end;
    load_queries<D, G, R>(sq[warp], p.q, p.n_head, kvh, seq.row + first, valid, p.k_type, lane);
    int qp[R], lo[R];
    int qp_max = -1;
#pragma unroll
    for (int r = 0; r < R; r++) {
        qp[r] = valid[r / G] ? seq.pos + first + r / G : -1;
        lo[r] = p.window > 0 && qp[r] + 1 > p.window ? qp[r] + 1 - p.window : 0;
        qp_max = max(qp_max, qp[r]);
    }
    /* the block's first token sees the earliest position any of its rows sees */
    const int q0 = seq.pos + tile0;
    const int lo_blk = p.window > 0 && q0 + 1 > p.window ? q0 + 1 - p.window : 0;

    float M[R], L[R], O[R][DPL];
#pragma unroll
    for (int r = 0; r < R; r++) {
        M[r] = -INFINITY;
        L[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++)
            O[r][i] = 0.0f;
    }
    const uint32_t *table = p.tables + seq.table;
    for (int s0 = lo_blk / p.split * p.split; s0 < kv_end; s0 += p.split) {
        SplitState<D, R> st;
        split_init(st);
        const int k1 = min(s0 + p.split, kv_end);
        for (int t0 = max(s0, lo_blk / TILE * TILE); t0 < k1; t0 += TILE) {
            __syncthreads();    /* the previous tile is consumed (and sq written) */
            tile_load<D, PF_WARPS * 32>(sk, sv, p, kvh, table, t0, lo_blk, k1, threadIdx.x);
            kc_cp_async_wait_all();
            __syncthreads();
            if (t0 <= qp_max)
                tile_step<D, R>(st, sq[warp], sk, sv, qp, lo, t0, min(TILE, k1 - t0), p, lane);
        }
        /* a split outside a row's range leaves it as it was, as in decode */
#pragma unroll
        for (int r = 0; r < R; r++)
            if (s0 <= qp[r] && s0 + p.split > lo[r])
                fold<DPL>(M[r], L[r], O[r], st.m[r], kc_warp_sum(st.l[r]), st.acc[r]);
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (qp[r] < 0)
            continue;
        const int h = kvh * G + r % G;
        float *o = p.out + ((size_t)(seq.row + first + r / G) * p.n_head + h) * D + lane * DPL;
#pragma unroll
        for (int i = 0; i < DPL; i++)
            o[i] = __fdiv_rn(O[r][i], L[r]);
    }
}

/* ---- host side ----------------------------------------------------------------- */

static int split_of(const kcuda_attn_args *a)
{
    return a->split ? a->split : KCUDA_ATTN_SPLIT;
}

/* Checks what both kernels need; fills *p. */
static int prepare(const kcuda_attn_args *a, Params *p)
{
    const kcuda_kv *kv = &a->kv;
    if (a->n_seq < 0 || (a->n_seq > 0 && (a->seqs == NULL || a->tables == NULL || a->q == NULL ||
                                          a->out == NULL || kv->k == NULL || kv->v == NULL)))
        return KVD_EINVAL;
    if (kv->n_head_kv <= 0 || kv->n_head <= 0 || kv->n_head % kv->n_head_kv != 0 || kv->block_tokens <= 0)
        return KVD_EINVAL;
    if (kv->head_dim != 64 && kv->head_dim != 128 && kv->head_dim != 256)
        return KVD_EUNSUPPORTED;
    if (a->window < 0)
        return KVD_EINVAL;
    if (kv->n_head / kv->n_head_kv > KCUDA_MAX_GROUP)
        return KVD_EUNSUPPORTED;
    const int k_row = kcuda_kv_row_bytes(kv->k_type, kv->head_dim), v_row = kcuda_kv_row_bytes(kv->v_type, kv->head_dim);
    if (k_row == 0 || v_row == 0)
        return KVD_EUNSUPPORTED;
    const int split = split_of(a);
    if (split <= 0 || split % TILE != 0)
        return KVD_EINVAL;
    /* F16 rows go by 16-byte copies into shared memory, quantized rows by 4-byte words */
    const uint64_t k_align = kv->k_type == KERN_F16 ? 16 : 4, v_align = kv->v_type == KERN_F16 ? 16 : 4;
    if (((uintptr_t)kv->k | kv->block_stride | kv->k_head_stride) % k_align != 0 ||
        ((uintptr_t)kv->v | kv->block_stride | kv->v_head_stride) % v_align != 0)
        return KVD_EINVAL;
    *p = Params{};
    p->k = kv->k;
    p->v = kv->v;
    p->block_stride = kv->block_stride;
    p->k_head_stride = kv->k_head_stride;
    p->v_head_stride = kv->v_head_stride;
    p->k_type = kv->k_type;
    p->v_type = kv->v_type;
    p->k_row = k_row;
    p->v_row = v_row;
    p->block_tokens = kv->block_tokens;
    p->n_head = kv->n_head;
    p->n_head_kv = kv->n_head_kv;
    p->seqs = a->seqs;
    p->n_seq = a->n_seq;
    p->tables = a->tables;
    p->q = a->q;
    p->out = a->out;
    p->scale = a->scale;
    p->window = a->window;
    p->split = split;
    return 0;
}

template <int D, int G>
static void launch_decode(const Params &p, long blocks, cudaStream_t st)
{
    decode_kernel<D, G><<<(unsigned)blocks, DecodeWarps<D>::value * 32, 0, st>>>(p);
}

template <int D>
static int decode_d(const Params &p, int G, cudaStream_t st)
{
    constexpr int W = DecodeWarps<D>::value;
    const long warps = (long)p.n_seq * p.n_head_kv * p.max_split;
    const long blocks = (warps + W - 1) / W;
    if (blocks > 0x7fffffffL)
        return KVD_ERANGE;
    switch (G) {
    case 1: launch_decode<D, 1>(p, blocks, st); break;
    case 2: launch_decode<D, 2>(p, blocks, st); break;
    case 3: launch_decode<D, 3>(p, blocks, st); break;
    case 4: launch_decode<D, 4>(p, blocks, st); break;
    case 5: launch_decode<D, 5>(p, blocks, st); break;
    case 6: launch_decode<D, 6>(p, blocks, st); break;
    case 7: launch_decode<D, 7>(p, blocks, st); break;
    case 8: launch_decode<D, 8>(p, blocks, st); break;
    default: return KVD_EUNSUPPORTED;
    }
    int rc = kcuda__launched("attention decode");
    if (rc == 0 && p.max_split > 1) {
        const long mblocks = ((long)p.n_seq * p.n_head + 3) / 4;
        merge_kernel<D><<<(unsigned)mblocks, 128, 0, st>>>(p);
        rc = kcuda__launched("attention merge");
    }
    return rc;
}

template <int D, int G>
static int launch_prefill(const Params &p, int max_tok, cudaStream_t st)
{
    if constexpr (G > PfRows<D>::value) {
        return KVD_EUNSUPPORTED;    /* a warp's rows hold no whole group */
    } else {
        constexpr int QT = PfWarps<D>::value * (PfRows<D>::value / G);
        const dim3 grid((unsigned)((max_tok + QT - 1) / QT), (unsigned)p.n_head_kv, (unsigned)p.n_seq);
        prefill_kernel<D, G><<<grid, PfWarps<D>::value * 32, 0, st>>>(p);
        return 0;
    }
}

template <int D>
static int prefill_d(const Params &p, int G, int max_tok, cudaStream_t st)
{
    int rc;
    switch (G) {
    case 1: rc = launch_prefill<D, 1>(p, max_tok, st); break;
    case 2: rc = launch_prefill<D, 2>(p, max_tok, st); break;
    case 3: rc = launch_prefill<D, 3>(p, max_tok, st); break;
    case 4: rc = launch_prefill<D, 4>(p, max_tok, st); break;
    case 5: rc = launch_prefill<D, 5>(p, max_tok, st); break;
    case 6: rc = launch_prefill<D, 6>(p, max_tok, st); break;
    case 7: rc = launch_prefill<D, 7>(p, max_tok, st); break;
    case 8: rc = launch_prefill<D, 8>(p, max_tok, st); break;
    default: return KVD_EUNSUPPORTED;
    }
    return rc ? rc : kcuda__launched("attention prefill");
}

} /* namespace */

extern "C" size_t kcuda_attn_scratch_bytes(int n_seq, int n_head, int head_dim, int max_ctx, int split)
{
    if (split <= 0)
        split = KCUDA_ATTN_SPLIT;
    if (n_seq <= 0 || n_head <= 0 || head_dim <= 0 || max_ctx <= split)
        return 0;   /* one split: no partials */
    const size_t max_split = ((size_t)max_ctx + split - 1) / split;
    return (size_t)n_seq * n_head * max_split * ((size_t)head_dim + 2) * sizeof(float);
}

extern "C" int kcuda_attn_decode(const struct kcuda_attn_args *a, kcuda_stream_t stream)
{
    Params p;
    int rc = prepare(a, &p);
    if (rc)
        return rc;
    if (a->n_seq == 0)
        return 0;
    if (a->max_ctx <= 0)
        return KVD_EINVAL;
    p.max_split = (a->max_ctx + p.split - 1) / p.split;
    if (p.max_split > 1) {
        if (a->scratch == NULL)
            return KVD_EINVAL;
        const int D = a->kv.head_dim;
        p.part_acc = a->scratch;
        p.part_ml = a->scratch + (size_t)a->n_seq * p.n_head * p.max_split * D;
    }
    const int G = p.n_head / p.n_head_kv;
    switch (a->kv.head_dim) {
    case 64: return decode_d<64>(p, G, stream);
    case 128: return decode_d<128>(p, G, stream);
    default: return decode_d<256>(p, G, stream);
    }
}

extern "C" int kcuda_attn_prefill(const struct kcuda_attn_args *a, kcuda_stream_t stream)
{
    Params p;
    int rc = prepare(a, &p);
    if (rc)
        return rc;
    if (a->n_seq == 0)
        return 0;
    if (a->max_tok <= 0 || a->n_seq > 65535)
        return KVD_EINVAL;
    const int G = p.n_head / p.n_head_kv;
    switch (a->kv.head_dim) {
    case 64: return prefill_d<64>(p, G, a->max_tok, stream);
    case 128: return prefill_d<128>(p, G, a->max_tok, stream);
    default: return prefill_d<256>(p, G, a->max_tok, stream);
    }
}
