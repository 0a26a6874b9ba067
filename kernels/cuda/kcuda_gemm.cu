/*
 * kcuda_gemm.cu - quantized matrix products, activation quantization and row
 * lookup (twins: kern_vec_dot / kern_gemm, kern_quantize_act,
 * kern_dequantize_row).
 *
 * Products: one warp per weight row (the rows of up to three matrices that
 * share their activations in one launch). Lane i takes blocks i, i+32, ... of the
 * row, unpacks each once into registers and multiplies it with the same block
 * of up to 8 tokens' activation rows (integer dot products with __dp4a, then
 * the block's float terms exactly as the C twin forms them), summing its
 * blocks in order; a butterfly adds the lanes. The order of every token's sum
 * depends only on n, so a token's result is the same in any batch.
 */
#include <math.h>

#include "kcuda_impl.cuh"
#include "quant_blocks.h"
#include "types.h"

namespace {

constexpr int GEMM_WARPS = 4;   /* rows per block */
constexpr int GEMM_TOK = 8;     /* most tokens per pass over a row */
constexpr int GEMM_MATS = KCUDA_GEMM_MAX_MATS;

/* One matrix of a launch: its rows take grid blocks blk0, blk0 + 1, ... */
struct GemmMat {
    const uint8_t *w;           /* rows x row_bytes */
    size_t row_bytes;           /* bytes per weight row */
    long rows;                  /* output features */
    float *out;                 /* token t's outputs at out + t * ldo */
    size_t ldo;                 /* floats between tokens' output rows */
    unsigned blk0;              /* the grid block of its first GEMM_WARPS rows */
};

struct GemmParams {
    GemmMat m[GEMM_MATS];       /* matrices of the same type and width, one after another */
    int n_mat;
    int nb;                     /* blocks per row (Q types) or 8-element chunks (F16) */
    const uint8_t *act;
    size_t act_stride;
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

/* A 32-bit word from 2-byte aligned memory (Q8_0 blocks are 34 bytes). */
__device__ __forceinline__ int ld32_2(const uint8_t *p)
{
    const unsigned short *h = reinterpret_cast<const unsigned short *>(p);
    return (int)((uint32_t)__ldg(h) | (uint32_t)__ldg(h + 1) << 16);
}

__device__ __forceinline__ uint32_t ld16(const uint8_t *p)
{
    return __ldg(reinterpret_cast<const unsigned short *>(p));
}

/* What every product kernel starts with: the matrix and row of this warp
 * (the grid's blocks run over the matrices' rows one after another), the
 * block's tokens, zeroed sums. False for a warp past the matrix's last row. */
template <int NT>
struct GemmRow {
    GemmMat m;                  /* this warp's matrix */
    long r;                     /* its row */
    int t0, nt;                 /* the block's first token, how many (<= NT) */
    int lane;                   /* this thread's lane */
    float acc[NT];              /* the lane's sums, one per token */

    __device__ __forceinline__ bool start(const GemmParams &p)
    {
        m = p.m[0];
        if (p.n_mat > 1 && blockIdx.x >= p.m[1].blk0)
            m = p.m[1];
        if (p.n_mat > 2 && blockIdx.x >= p.m[2].blk0)
            m = p.m[2];
        lane = threadIdx.x % 32;
        r = (long)(blockIdx.x - m.blk0) * GEMM_WARPS + threadIdx.x / 32;
        t0 = blockIdx.y * NT;
        nt = min(NT, p.T - t0);
#pragma unroll
        for (int t = 0; t < NT; t++)
            acc[t] = 0.0f;
        return r < m.rows;
    }

    /* Adds the lanes' sums and stores (or adds to) the row's outputs. */
    __device__ __forceinline__ void store(const GemmParams &p)
    {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float v = kc_warp_sum(acc[t]);
            if (lane == 0 && t < nt) {
                float *o = m.out + (size_t)(t0 + t) * m.ldo + r;
                *o = p.add ? __fadd_rn(*o, v) : v;
            }
        }
    }
};

/* Q4_1 weights x Q8_1 activations: sum += d_w*d_a*isum + m_w*s_a per block. */
template <int NT>
__global__ void __launch_bounds__(GEMM_WARPS * 32) gemm_q4_1(const GemmParams p)
{
    GemmRow<NT> g;
    if (!g.start(p))
        return;
    const int t0 = g.t0, nt = g.nt;
    const uint8_t *wr = g.m.w + (size_t)g.r * g.m.row_bytes;
    for (int b = g.lane; b < p.nb; b += 32) {
        const uint8_t *wb = wr + (size_t)b * sizeof(struct kern_block_q4_1);
        const uint32_t dm = ld32(wb);
        const float dw = kc_half(dm), mw = kc_half(dm >> 16);
        int lo[4], hi[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t q = ld32(wb + 4 + 4 * j);     /* codes of elements 4j..4j+3 and 16+4j.. */
            lo[j] = (int)(q & 0x0F0F0F0Fu);
            hi[j] = (int)((q >> 4) & 0x0F0F0F0Fu);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const uint8_t *ab = p.act + (size_t)(t0 + t) * p.act_stride + (size_t)b * sizeof(struct kern_block_q8_1);
                const uint32_t ds = ld32(ab);
                int si = 0;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    si = __dp4a(lo[j], (int)ld32(ab + 4 + 4 * j), si);
                    si = __dp4a(hi[j], (int)ld32(ab + 20 + 4 * j), si);
                }
                const float v = __fadd_rn(__fmul_rn(__fmul_rn(dw, kc_half(ds)), (float)si),
                                          __fmul_rn(mw, kc_half(ds >> 16)));
                g.acc[t] = __fadd_rn(g.acc[t], v);
            }
        }
    }
    g.store(p);
}

/* Q8_0 weights x Q8_0 activations: sum += d_w*d_a*isum per block. */
template <int NT>
__global__ void __launch_bounds__(GEMM_WARPS * 32) gemm_q8_0(const GemmParams p)
{
    GemmRow<NT> g;
    if (!g.start(p))
        return;
    const int t0 = g.t0, nt = g.nt;
    const uint8_t *wr = g.m.w + (size_t)g.r * g.m.row_bytes;
    for (int b = g.lane; b < p.nb; b += 32) {
        const uint8_t *wb = wr + (size_t)b * sizeof(struct kern_block_q8_0);
        const float dw = kc_half(ld16(wb));
        int q[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            q[j] = ld32_2(wb + 2 + 4 * j);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const uint8_t *ab = p.act + (size_t)(t0 + t) * p.act_stride + (size_t)b * sizeof(struct kern_block_q8_0);
                int si = 0;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    si = __dp4a(q[j], ld32_2(ab + 2 + 4 * j), si);
                const float v = __fmul_rn(__fmul_rn(dw, kc_half(ld16(ab))), (float)si);
                g.acc[t] = __fadd_rn(g.acc[t], v);
            }
        }
    }
    g.store(p);
}

/* F16 weights x F32 activations: lane i takes 8-element chunks i, i+32, ... */
template <int NT>
__global__ void __launch_bounds__(GEMM_WARPS * 32) gemm_f16(const GemmParams p)
{
    GemmRow<NT> g;
    if (!g.start(p))
        return;
    const int t0 = g.t0, nt = g.nt;
    const uint4 *wr = reinterpret_cast<const uint4 *>(g.m.w + (size_t)g.r * g.m.row_bytes);
    for (int c = g.lane; c < p.nb; c += 32) {
        float wf[8];
        kc_unpack8(__ldg(wr + c), wf);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float4 *a = reinterpret_cast<const float4 *>(p.act + (size_t)(t0 + t) * p.act_stride) + 2 * c;
                const float4 a0 = __ldg(a), a1 = __ldg(a + 1);
                float x = g.acc[t];
                x = __fmaf_rn(wf[0], a0.x, x);
                x = __fmaf_rn(wf[1], a0.y, x);
                x = __fmaf_rn(wf[2], a0.z, x);
                x = __fmaf_rn(wf[3], a0.w, x);
                x = __fmaf_rn(wf[4], a1.x, x);
                x = __fmaf_rn(wf[5], a1.y, x);
                x = __fmaf_rn(wf[6], a1.z, x);
                x = __fmaf_rn(wf[7], a1.w, x);
                g.acc[t] = x;
            }
        }
    }
    g.store(p);
}

template <int NT>
static void launch_gemm(uint32_t wtype, const GemmParams &p, unsigned blocks, cudaStream_t st)
{
    const dim3 grid(blocks, (unsigned)((p.T + NT - 1) / NT));
    switch (wtype) {
    case KERN_Q4_1: gemm_q4_1<NT><<<grid, GEMM_WARPS * 32, 0, st>>>(p); break;
    case KERN_Q8_0: gemm_q8_0<NT><<<grid, GEMM_WARPS * 32, 0, st>>>(p); break;
    default: gemm_f16<NT><<<grid, GEMM_WARPS * 32, 0, st>>>(p); break;
    }
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
    switch (a->wtype) {
    case KERN_Q4_1:
        if (a->n % 32 || a->row_bytes < row_bytes_of(KERN_Q4_1, a->n) ||
            a->act_stride < row_bytes_of(KERN_Q8_1, a->n) || (wa | aa | a->row_bytes | a->act_stride) % 4)
            return KVD_EINVAL;
        return 0;
    case KERN_Q8_0:
        if (a->n % 32 || a->row_bytes < row_bytes_of(KERN_Q8_0, a->n) ||
            a->act_stride < row_bytes_of(KERN_Q8_0, a->n) || (wa | aa | a->row_bytes | a->act_stride) % 2)
            return KVD_EINVAL;
        return 0;
    case KERN_F16:
        if (a->n % 8 || a->row_bytes < (size_t)a->n * 2 || a->act_stride < (size_t)a->n * 4 ||
            (wa | aa | a->row_bytes | a->act_stride) % 16)
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
        blocks += (uint64_t)(a[i].rows + GEMM_WARPS - 1) / GEMM_WARPS;
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
    const unsigned nb = (unsigned)blocks;
    if (p.T >= 8)
        launch_gemm<8>(a[0].wtype, p, nb, stream);
    else if (p.T >= 4)
        launch_gemm<4>(a[0].wtype, p, nb, stream);
    else if (p.T >= 2)
        launch_gemm<2>(a[0].wtype, p, nb, stream);
    else
        launch_gemm<1>(a[0].wtype, p, nb, stream);
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
