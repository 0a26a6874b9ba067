/*
 * kcuda_gemm.cu - quantized matrix products, activation quantization and row
 * lookup (twins: kern_vec_dot / kern_gemm, kern_quantize_act,
 * kern_dequantize_row).
 *
 * Products: a block of GEMM_WARPS warps takes R weight rows per warp (the rows
 * of up to three matrices that share their activations in one launch) and NT
 * tokens. It walks the rows in chunks of 32 quantization blocks (F16: of 32
 * 8-element chunks): lane i takes block c0 + i of each of its rows, the block
 * copies the chunk's activations of its NT tokens into shared memory once
 * (16-byte cp.async, coalesced), and every lane multiplies its unpacked weight
 * blocks with them there (integer dot products with __dp4a, then the block's
 * float terms exactly as the C twin forms them). A lane sums its blocks in
 * order (i, i + 32, ...) and a butterfly adds the lanes, so the order of every
 * sum depends only on n: a token's result is the same in any batch, and the
 * same whatever NT and R a launch picks.
 *
 * Why shared memory: a lane's activation block is 36 bytes (Q8_1), so the same
 * reads straight from global memory touch nine 128-byte lines per warp and
 * instruction, nine times per block and token, from every warp of the block.
 * Staged, they are conflict-free shared loads; and a warp with R = 2 rows
 * reads each once for both.
 */
#include <math.h>

#include "kcuda_impl.cuh"
#include "quant_blocks.h"
#include "types.h"

namespace {

constexpr int GEMM_WARPS = 4;   /* warps per block */
constexpr int GEMM_TOK = 16;    /* most tokens per pass over a row */
constexpr int GEMM_MATS = KCUDA_GEMM_MAX_MATS;

/* Bytes of one staged token row of a chunk: 32 blocks of up to 36 bytes and
 * the layouts' padding (see act_at), a multiple of 16. */
constexpr int STAGE_ROW = 1168;

/* One matrix of a launch: its rows take grid blocks blk0, blk0 + 1, ... */
struct GemmMat {
    const uint8_t *w;           /* rows x row_bytes */
    size_t row_bytes;           /* bytes per weight row */
    long rows;                  /* output features */
    float *out;                 /* token t's outputs at out + t * ldo */
    size_t ldo;                 /* floats between tokens' output rows */
    unsigned blk0;              /* the grid block of its first rows */
};

struct GemmParams {
    GemmMat m[GEMM_MATS];       /* matrices of the same type and width, one after another */
    int n_mat;
    int nb;                     /* blocks per row (Q types) or 8-element chunks (F16) */
    const uint8_t *act;         /* 16-byte aligned */
    size_t act_stride;          /* a multiple of 16 */
    int T;
    int add;
};

/* Bytes of a row of n elements of the types handled here; 0 for others or a
 * length that is not a whole number of blocks. */
static size_t row_bytes_of(uint32_t type, int64_t n)
{
    switch (type) {
    case KERN_F32: return (size_t)n * 4;
    case KERN_F16: return (size_t)n * 2;
    case KERN_Q4_0: return n % 32 ? 0 : (size_t)(n / 32) * sizeof(struct kern_block_q4_0);
    case KERN_Q4_1: return n % 32 ? 0 : (size_t)(n / 32) * sizeof(struct kern_block_q4_1);
    case KERN_Q8_0: return n % 32 ? 0 : (size_t)(n / 32) * sizeof(struct kern_block_q8_0);
    case KERN_Q8_1: return n % 32 ? 0 : (size_t)(n / 32) * sizeof(struct kern_block_q8_1);
    default: return 0;
    }
}

__device__ __forceinline__ uint32_t ld32(const uint8_t *p)
{
    return __ldg(reinterpret_cast<const unsigned int *>(p));
}

__device__ __forceinline__ uint32_t ld16(const uint8_t *p)
{
    return __ldg(reinterpret_cast<const unsigned short *>(p));
}

__device__ __forceinline__ uint32_t lds32(const uint8_t *p)
{
    return *reinterpret_cast<const uint32_t *>(p);
}

/*
 * What each weight type needs: its activation block's size (ABYTES), where a
 * lane's activation block lies in a staged token row (act_at), an Act that
 * holds one token's activation block in registers (read once from shared
 * memory for all rows of the warp), and a Block that holds one weight block
 * unpacked in registers and folds its product with an Act into a row's sum.
 *
 * The staged layouts keep a warp's 32 reads of one word on 32 distinct banks:
 * Q8_1 blocks are 9 words apart (9 is odd); Q8_0 blocks are 8.5 words apart,
 * which puts lanes 0-15 on the even banks below 16 and the odd ones above, so
 * lanes 16-31 are moved 8 words on to land on the other 16; F32 chunks are 8
 * words apart, and 4 more words after every 4 chunks spread the 16-byte reads
 * of 8 lanes (one shared-memory wavefront) over all banks.
 */
template <uint32_t WT> struct Weights;

template <> struct Weights<KERN_Q4_1> {
    static constexpr int ABYTES = sizeof(struct kern_block_q8_1);
    /* shift of the staged bytes of 16-byte unit u of a token's chunk */
    static __device__ __forceinline__ int pad(int) { return 0; }
    static __device__ __forceinline__ int act_at(int lane) { return lane * ABYTES; }

    struct Act {
        float da, sa;           /* the block's scale and scale * sum of its codes */
        int lo[4], hi[4];       /* codes of elements 4j..4j+3 and 16+4j.. */

        __device__ __forceinline__ void load(const uint8_t *ab)
        {
            const uint32_t ds = lds32(ab);
            da = kc_half(ds);
            sa = kc_half(ds >> 16);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                lo[j] = (int)lds32(ab + 4 + 4 * j);
                hi[j] = (int)lds32(ab + 20 + 4 * j);
            }
        }
    };

    struct Block {
        float dw, mw;
        int lo[4], hi[4];

        __device__ __forceinline__ void load(const uint8_t *row, int b)
        {
            const uint8_t *wb = row + (size_t)b * sizeof(struct kern_block_q4_1);
            const uint32_t dm = ld32(wb);
            dw = kc_half(dm);
            mw = kc_half(dm >> 16);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const uint32_t q = ld32(wb + 4 + 4 * j);
                lo[j] = (int)(q & 0x0F0F0F0Fu);
                hi[j] = (int)((q >> 4) & 0x0F0F0F0Fu);
            }
        }

        /* sum + d_w*d_a*isum + m_w*s_a */
        __device__ __forceinline__ float add_to(const Act &a, float sum) const
        {
            int si = 0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                si = __dp4a(lo[j], a.lo[j], si);
                si = __dp4a(hi[j], a.hi[j], si);
            }
            return __fadd_rn(sum, __fadd_rn(__fmul_rn(__fmul_rn(dw, a.da), (float)si), __fmul_rn(mw, a.sa)));
        }
    };
};

/*
 * A Q8_0 block (34 bytes, so only 2-byte aligned) as its 8 words of codes and
 * its scale, from the 9 aligned words around it realigned with funnel shifts:
 * w0..w7 the words at a4, a4 + 4, ...; w8 the half at a4 + 32 (the word there
 * when the block starts 2 bytes past a4: never a byte past the block).
 */
__device__ __forceinline__ void q8_0_words(const uint32_t (&w)[9], uint32_t sh, float &d, int (&q)[8])
{
    d = kc_half(w[0] >> sh);
#pragma unroll
    for (int j = 0; j < 8; j++)
        q[j] = (int)__funnelshift_rc(w[j], w[j + 1], sh + 16);
}

template <> struct Weights<KERN_Q8_0> {
    static constexpr int ABYTES = sizeof(struct kern_block_q8_0);
    static __device__ __forceinline__ int pad(int u) { return u >= 16 * ABYTES / 16 ? 32 : 0; }
    static __device__ __forceinline__ int act_at(int lane) { return lane * ABYTES + (lane >= 16 ? 32 : 0); }

    struct Act {
        float da;
        int q[8];

        __device__ __forceinline__ void load(const uint8_t *ab)
        {
            const uint32_t sh = (uint32_t)((uintptr_t)ab & 3) * 8;     /* 0 or 16 */
            const uint8_t *a4 = ab - ((uintptr_t)ab & 3);
            uint32_t w[9];
#pragma unroll
            for (int k = 0; k < 9; k++)
                w[k] = lds32(a4 + 4 * k);   /* the staged row has room past its last block */
            q8_0_words(w, sh, da, q);
        }
    };

    struct Block {
        float dw;
        int q[8];

        __device__ __forceinline__ void load(const uint8_t *row, int b)
        {
            const uint8_t *wb = row + (size_t)b * sizeof(struct kern_block_q8_0);
            const uint32_t sh = (uint32_t)((uintptr_t)wb & 3) * 8;
            const uint8_t *a4 = wb - ((uintptr_t)wb & 3);
            uint32_t w[9];
#pragma unroll
            for (int k = 0; k < 8; k++)
                w[k] = ld32(a4 + 4 * k);
            w[8] = sh ? ld32(a4 + 32) : ld16(a4 + 32);
            q8_0_words(w, sh, dw, q);
        }

        /* sum + d_w*d_a*isum */
        __device__ __forceinline__ float add_to(const Act &a, float sum) const
        {
            int si = 0;
#pragma unroll
            for (int j = 0; j < 8; j++)
                si = __dp4a(q[j], a.q[j], si);
            return __fadd_rn(sum, __fmul_rn(__fmul_rn(dw, a.da), (float)si));
        }
    };
};

template <> struct Weights<KERN_F16> {
    static constexpr int ABYTES = 32;   /* 8 floats */
    static __device__ __forceinline__ int pad(int u) { return 16 * (u / 8); }
    static __device__ __forceinline__ int act_at(int lane) { return lane * ABYTES + 16 * (lane / 4); }

    struct Act {
        float4 a0, a1;

        __device__ __forceinline__ void load(const uint8_t *ab)
        {
            a0 = *reinterpret_cast<const float4 *>(ab);
            a1 = *reinterpret_cast<const float4 *>(ab + 16);
        }
    };

    struct Block {
        float wf[8];

        __device__ __forceinline__ void load(const uint8_t *row, int c)
        {
            kc_unpack8(__ldg(reinterpret_cast<const uint4 *>(row) + c), wf);
        }

        /* the chunk folded into the running sum with fmas, as its twin does */
        __device__ __forceinline__ float add_to(const Act &a, float x) const
        {
            x = __fmaf_rn(wf[0], a.a0.x, x);
            x = __fmaf_rn(wf[1], a.a0.y, x);
            x = __fmaf_rn(wf[2], a.a0.z, x);
            x = __fmaf_rn(wf[3], a.a0.w, x);
            x = __fmaf_rn(wf[4], a.a1.x, x);
            x = __fmaf_rn(wf[5], a.a1.y, x);
            x = __fmaf_rn(wf[6], a.a1.z, x);
            x = __fmaf_rn(wf[7], a.a1.w, x);
            return x;
        }
    };
};

/*
 * Copies activation blocks [c0, c0 + nblk) of tokens t0 .. t0 + nt - 1 into
 * tile (token t's at tile + t * STAGE_ROW, 16-byte unit u at 16u + pad(u)):
 * all threads of the block, consecutive threads on consecutive units. A
 * partial last unit reads only the row's bytes.
 */
template <uint32_t WT>
__device__ __forceinline__ void stage(uint8_t *tile, const GemmParams &p, int t0, int nt, int c0, int nblk)
{
    constexpr int AB = Weights<WT>::ABYTES;
    constexpr int UNITS = (32 * AB + 15) / 16;     /* per token, a whole chunk */
    const int bytes = nblk * AB;
    const uint8_t *src0 = p.act + (size_t)t0 * p.act_stride + (size_t)c0 * AB;
    for (int i = threadIdx.x; i < nt * UNITS; i += GEMM_WARPS * 32) {
        const int t = i / UNITS, u = i % UNITS;
        const int left = bytes - 16 * u;
        if (left <= 0)
            continue;           /* past a partial chunk: never read */
        kc_cp_async16_ca(tile + t * STAGE_ROW + 16 * u + Weights<WT>::pad(u),
                         src0 + (size_t)t * p.act_stride + 16 * u, left < 16 ? left : 16);
    }
}

/*
 * The product kernel for weight type WT: NT tokens, R rows per warp. Warps
 * past their matrix's last row still take part in every copy and barrier.
 */
template <uint32_t WT, int NT, int R>
__global__ void __launch_bounds__(GEMM_WARPS * 32) gemm_kernel(const GemmParams p)
{
    using W = Weights<WT>;
    __shared__ __align__(16) uint8_t tile[NT * STAGE_ROW];

    GemmMat m = p.m[0];
    if (p.n_mat > 1 && blockIdx.x >= p.m[1].blk0)
        m = p.m[1];
    if (p.n_mat > 2 && blockIdx.x >= p.m[2].blk0)
        m = p.m[2];
    const int lane = threadIdx.x % 32;
    const long r0 = ((long)(blockIdx.x - m.blk0) * GEMM_WARPS + threadIdx.x / 32) * R;
    const int t0 = blockIdx.y * NT, nt = min(NT, p.T - t0);
    bool live[R];
    const uint8_t *wrow[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        live[r] = r0 + r < m.rows;
        wrow[r] = m.w + (size_t)(r0 + r) * m.row_bytes;
    }
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++)
            acc[r][t] = 0.0f;

    for (int c0 = 0; c0 < p.nb; c0 += 32) {
        const int nblk = min(32, p.nb - c0);
        const bool mine = lane < nblk;
        typename W::Block w[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            if (mine && live[r])
                w[r].load(wrow[r], c0 + lane);      /* in flight across the copy below */
        __syncthreads();        /* every warp is done with the previous chunk */
        stage<WT>(tile, p, t0, nt, c0, nblk);
        kc_cp_async_wait_all();
        __syncthreads();
        if (!mine)
            continue;
        const uint8_t *ab = tile + W::act_at(lane);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                typename W::Act a;
                a.load(ab + t * STAGE_ROW);     /* once for the warp's rows */
#pragma unroll
                for (int r = 0; r < R; r++)
                    if (live[r])
                        acc[r][t] = w[r].add_to(a, acc[r][t]);
            }
        }
    }

    /* the lanes' sums added by a butterfly; stored (or added to) */
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (!live[r])
            continue;           /* uniform over the warp */
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float v = kc_warp_sum(acc[r][t]);
            if (lane == 0 && t < nt) {
                float *o = m.out + (size_t)(t0 + t) * m.ldo + r0 + r;
                *o = p.add ? __fadd_rn(*o, v) : v;
            }
        }
    }
}

/* Tokens per pass and rows per warp for T tokens: two rows per warp once the
 * shared-memory reads, not the weights, bound the product. */
struct Shape { int nt, r; };
static Shape shape_for(int T)
{
    if (T >= 16) return { 16, 2 };
    if (T >= 8) return { 8, 2 };
    if (T >= 4) return { 4, 1 };
    if (T >= 2) return { 2, 1 };
    return { 1, 1 };
}

template <uint32_t WT>
static void launch_type(Shape s, const GemmParams &p, dim3 grid, cudaStream_t st)
{
    const int thr = GEMM_WARPS * 32;
    if (s.nt == 16) gemm_kernel<WT, 16, 2><<<grid, thr, 0, st>>>(p);
    else if (s.nt == 8) gemm_kernel<WT, 8, 2><<<grid, thr, 0, st>>>(p);
    else if (s.nt == 4) gemm_kernel<WT, 4, 1><<<grid, thr, 0, st>>>(p);
    else if (s.nt == 2) gemm_kernel<WT, 2, 1><<<grid, thr, 0, st>>>(p);
    else gemm_kernel<WT, 1, 1><<<grid, thr, 0, st>>>(p);
}

/* ---- activation quantization: one warp per 32-element block ------------------- */

/* Q8_0 / Q8_1 as kern_quantize_act (kc_quantize_block32). */
__global__ void __launch_bounds__(128) quantize_q8(const float *x, size_t ldx, uint8_t *dst, size_t dst_stride,
                                                   int nb, int T, int with_sum)
{
    const int lane = threadIdx.x % 32;
    const long idx = (long)blockIdx.x * 4 + threadIdx.x / 32;
    if (idx >= (long)nb * T)
        return;
    const long t = idx / nb;
    const int b = (int)(idx % nb);
    const float v = x[(size_t)t * ldx + (size_t)b * 32 + lane];
    kc_quantize_block32(v, lane, dst + (size_t)t * dst_stride + (size_t)b * kc_act_block_bytes(with_sum), with_sum);
}

/* ---- row lookup: one block per token --------------------------------------------- */

__global__ void __launch_bounds__(256) get_rows_kernel(uint32_t type, const uint8_t *w, size_t row_bytes, long n,
                                                       const int32_t *ids, float *out)
{
    const int t = blockIdx.x;
    const uint8_t *row = w + (size_t)ids[t] * row_bytes;
    float *o = out + (size_t)t * n;
    for (long e = threadIdx.x; e < n; e += blockDim.x) {
        float y;
        switch (type) {
        case KERN_F32:
            y = __ldg(reinterpret_cast<const float *>(row) + e);
            break;
        case KERN_F16:
            y = kc_half(ld16(row + 2 * e));
            break;
        case KERN_Q4_0: {
            const uint8_t *b = row + (e / 32) * sizeof(struct kern_block_q4_0);
            const int j = (int)(e % 32);
            const int code = j < 16 ? (b[2 + j] & 0x0F) : (b[2 + j - 16] >> 4);
            y = __fmul_rn((float)(code - 8), kc_half(ld16(b)));
            break;
        }
        case KERN_Q4_1: {
            const uint8_t *b = row + (e / 32) * sizeof(struct kern_block_q4_1);
            const int j = (int)(e % 32);
            const int code = j < 16 ? (b[4 + j] & 0x0F) : (b[4 + j - 16] >> 4);
            y = __fadd_rn(__fmul_rn((float)code, kc_half(ld16(b))), kc_half(ld16(b + 2)));
            break;
        }
        default: { /* KERN_Q8_0 */
            const uint8_t *b = row + (e / 32) * sizeof(struct kern_block_q8_0);
            y = __fmul_rn((float)(int8_t)b[2 + e % 32], kc_half(ld16(b)));
            break;
        }
        }
        o[e] = y;
    }
}

} /* namespace */

/* Checks one product's arguments against the launch's shared ones; 0 or a KVD_E* code. */
static int gemm_check(const struct kcuda_gemm_args *a, const struct kcuda_gemm_args *first)
{
    if (a->T < 0 || a->rows < 0 || a->n <= 0)
        return KVD_EINVAL;
    if (a->wtype != first->wtype || a->n != first->n || a->act != first->act ||
        a->act_stride != first->act_stride || a->T != first->T || a->add != first->add)
        return KVD_EINVAL;      /* one launch: the same activations, type, width and mode */
    if (a->T == 0 || a->rows == 0)
        return 0;               /* nothing to compute, nothing to check */
    if (a->w == NULL || a->act == NULL || a->out == NULL)
        return KVD_EINVAL;
    if (a->T > 1 && a->ldo < (size_t)a->rows)
        return KVD_EINVAL;      /* tokens' output rows would overlap */
    if (a->rows > 0x7fffffffL * GEMM_WARPS || a->T > 65535L * GEMM_TOK)
        return KVD_ERANGE;
    const uintptr_t wa = (uintptr_t)a->w, aa = (uintptr_t)a->act;
    if ((aa | a->act_stride) % 16)
        return KVD_EINVAL;      /* activations are staged with 16-byte copies */
    switch (a->wtype) {
    case KERN_Q4_1:
        if (a->n % 32 || a->row_bytes < row_bytes_of(KERN_Q4_1, a->n) ||
            a->act_stride < row_bytes_of(KERN_Q8_1, a->n) || (wa | a->row_bytes) % 4)
            return KVD_EINVAL;
        return 0;
    case KERN_Q8_0:
        if (a->n % 32 || a->row_bytes < row_bytes_of(KERN_Q8_0, a->n) ||
            a->act_stride < row_bytes_of(KERN_Q8_0, a->n) || (wa | a->row_bytes) % 2)
            return KVD_EINVAL;
        return 0;
    case KERN_F16:
        if (a->n % 8 || a->row_bytes < (size_t)a->n * 2 || a->act_stride < (size_t)a->n * 4 ||
            (wa | a->row_bytes) % 16)
            return KVD_EINVAL;
        return 0;
    default:
        return KVD_EUNSUPPORTED;
    }
}

extern "C" int kcuda_gemm_n(const struct kcuda_gemm_args *a, int n_mat, kcuda_stream_t stream)
{
    if (a == NULL || n_mat < 1 || n_mat > GEMM_MATS)
        return KVD_EINVAL;
    const Shape shape = shape_for(a[0].T);
    const long rows_per_block = (long)GEMM_WARPS * shape.r;
    GemmParams p = {};
    uint64_t blocks = 0;
    for (int i = 0; i < n_mat; i++) {
        const int rc = gemm_check(&a[i], &a[0]);
        if (rc)
            return rc;
        p.m[p.n_mat] = GemmMat{ static_cast<const uint8_t *>(a[i].w), a[i].row_bytes, (long)a[i].rows,
                                a[i].out, a[i].ldo, (unsigned)blocks };
        if (a[i].rows > 0)
            p.n_mat++;          /* an empty product takes no blocks */
        blocks += (uint64_t)(a[i].rows + rows_per_block - 1) / rows_per_block;
    }
    if (a[0].T == 0 || p.n_mat == 0)
        return 0;
    if (blocks > 0x7fffffffu)
        return KVD_ERANGE;
    p.act = static_cast<const uint8_t *>(a[0].act);
    p.act_stride = a[0].act_stride;
    p.T = a[0].T;
    p.add = a[0].add;
    p.nb = (int)(a[0].wtype == KERN_F16 ? a[0].n / 8 : a[0].n / 32);
    const dim3 grid((unsigned)blocks, (unsigned)((p.T + shape.nt - 1) / shape.nt));
    switch (a[0].wtype) {
    case KERN_Q4_1: launch_type<KERN_Q4_1>(shape, p, grid, stream); break;
    case KERN_Q8_0: launch_type<KERN_Q8_0>(shape, p, grid, stream); break;
    default: launch_type<KERN_F16>(shape, p, grid, stream); break;
    }
    return kcuda__launched("matrix product");
}

extern "C" int kcuda_gemm(const struct kcuda_gemm_args *a, kcuda_stream_t stream)
{
    return kcuda_gemm_n(a, 1, stream);
}

extern "C" int kcuda_quantize_act(uint32_t act_type, const float *x, size_t ldx, void *dst, size_t dst_stride,
                                  int64_t n, int T, kcuda_stream_t stream)
{
    if (T < 0 || n <= 0 || x == NULL || dst == NULL)
        return KVD_EINVAL;
    if (T == 0)
        return 0;
    if (act_type == KERN_F32) {
        if (dst_stride < (size_t)n * 4 || ldx < (size_t)n)
            return KVD_EINVAL;
        cudaError_t e = cudaMemcpy2DAsync(dst, dst_stride, x, ldx * sizeof(float), (size_t)n * sizeof(float),
                                          (size_t)T, cudaMemcpyDeviceToDevice, stream);
        return e == cudaSuccess ? 0 : kcuda__fail(KVD_EINTERNAL, e, "activation copy");
    }
    if (act_type != KERN_Q8_0 && act_type != KERN_Q8_1)
        return KVD_EUNSUPPORTED;
    if (n % 32 || ldx < (size_t)n || dst_stride < row_bytes_of(act_type, n))
        return KVD_EINVAL;
    const long blocks = (long)(n / 32) * T;
    quantize_q8<<<(unsigned)((blocks + 3) / 4), 128, 0, stream>>>(x, ldx, static_cast<uint8_t *>(dst), dst_stride,
                                                                 (int)(n / 32), T, act_type == KERN_Q8_1);
    return kcuda__launched("activation quantization");
}

extern "C" int kcuda_get_rows(uint32_t type, const void *w, size_t row_bytes, int64_t n, const int32_t *ids,
                              int T, float *out, kcuda_stream_t stream)
{
    if (T < 0 || n <= 0 || w == NULL || ids == NULL || out == NULL)
        return KVD_EINVAL;
    if (T == 0)
        return 0;
    switch (type) {
    case KERN_F32: case KERN_F16: case KERN_Q4_0: case KERN_Q4_1: case KERN_Q8_0:
        break;
    default:
        return KVD_EUNSUPPORTED;
    }
    const size_t need = row_bytes_of(type, n);
    if (need == 0 || row_bytes < need || ((uintptr_t)w | row_bytes) % 2)
        return KVD_EINVAL;
    if (type == KERN_F32 && ((uintptr_t)w | row_bytes) % 4)
        return KVD_EINVAL;
    get_rows_kernel<<<(unsigned)T, 256, 0, stream>>>(type, static_cast<const uint8_t *>(w), row_bytes, (long)n, ids,
                                                     out);
    return kcuda__launched("row lookup");
}
