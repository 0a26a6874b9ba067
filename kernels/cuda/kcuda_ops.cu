/*
 * kcuda_ops.cu - the element-wise and per-row kernels of the forward step:
 * RMSNorm, RoPE fused with the K/V write into the paged cache (with the
 * Walsh-Hadamard rotation and Q8_0 / Q4_0 quantization of a quantized cache),
 * the keys of whole blocks turned to other positions (context windowing),
 * SwiGLU, GEGLU, Gemma's post-norms and greedy token choice (twins:
 * kern_rmsnorm, kern_rope_angles + kern_rope / kern_rope_neox + the K/V store of
 * engine/forward.c, engine_kv_shift, kern_hadamard, kern_swiglu, kern_geglu,
 * sampler_argmax).
 *
 * Each follows its twin's float operations with explicit rounding
 * intrinsics; what may differ is the order of the sum of squares (double
 * here, as in the twin) and the last bit of the CUDA libm's sin, cos and exp.
 */
#include <limits.h>
#include <math.h>

#include "kcuda_impl.cuh"
#include "types.h"

namespace {

constexpr int ROW_THREADS = 256;

/* Sum of a double over the block (ROW_THREADS threads) in a fixed order;
 * every thread gets the result. */
__device__ __forceinline__ double block_sum(double v)
{
    __shared__ double part[ROW_THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(KCUDA_FULL, v, o);
    if (threadIdx.x % 32 == 0)
        part[threadIdx.x / 32] = v;
    __syncthreads();
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < ROW_THREADS / 32; i++)
        s += part[i];
    return s;
}

/* 1 / sqrt(mean of squares + eps) of a row of n (sum in double, as the twin). */
__device__ __forceinline__ float rms_scale(const float *xr, int n, float eps)
{
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += ROW_THREADS)
        ss += (double)xr[i] * (double)xr[i];
    ss = block_sum(ss);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn((float)(ss / n), eps)));
}

__global__ void __launch_bounds__(ROW_THREADS) rmsnorm_kernel(float *out, const float *x, const float *w,
                                                              const int32_t *rows, int n, float eps)
{
    const int t = blockIdx.x;
    const float *xr = x + (size_t)(rows ? rows[t] : t) * n;
    const float scale = rms_scale(xr, n, eps);
    float *o = out + (size_t)t * n;
    for (int i = threadIdx.x; i < n; i += ROW_THREADS)
        o[i] = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
}

/* rmsnorm_kernel, then each 32-element block of the output quantized to
 * act (kc_quantize_block32): warp w holds elements w*32 + k*ROW_THREADS, one
 * whole block per round (n % 32 == 0). */
__global__ void __launch_bounds__(ROW_THREADS) rmsnorm_quant_kernel(float *out, const float *x, const float *w,
                                                                    int n, float eps, uint8_t *act,
                                                                    size_t act_stride, int with_sum)
{
    const int t = blockIdx.x;
    const float *xr = x + (size_t)t * n;
    const float scale = rms_scale(xr, n, eps);
    float *o = out + (size_t)t * n;
    uint8_t *a = act + (size_t)t * act_stride;
    const int bb = kc_act_block_bytes(with_sum);
    for (int i = threadIdx.x; i < n; i += ROW_THREADS) {   /* the same rounds for a whole warp */
        const float y = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
        o[i] = y;
        kc_quantize_block32(y, i % 32, a + (size_t)(i / 32) * bb, with_sum);
    }
}

struct RopeParams {
    uint8_t *k_cache, *v_cache;
    uint64_t block_stride, k_head_stride, v_head_stride;
    uint32_t k_type, v_type, rotate;
    int k_row, v_row;
    int block_tokens, head_dim, n_head, n_head_kv;
    float *q;
    const float *k, *v;
    const int32_t *pos;
    const uint32_t *block;
    float step;
    int neox;                   /* pairs (i, i + D/2) instead of (2i, 2i+1) */
};

/* cos and sin of each RoPE pair of position pos into cs (the block's
 * threads share the work; a barrier follows): the angle of pair i is
 * pos * step^i, multiplied out one step at a time in f32 as kern_rope_angles
 * does. */
__device__ __forceinline__ void rope_angles(float *cs, int32_t pos, int half, float step)
{
    for (int i = threadIdx.x; i < half; i += ROW_THREADS) {
        float theta = (float)pos;
        for (int j = 0; j < i; j++)
            theta = __fmul_rn(theta, step);
        float s, c;
        sincosf(theta, &s, &c);
        cs[2 * i] = c;
        cs[2 * i + 1] = s;
    }
    __syncthreads();
}

/* One block per token: the RoPE angles of its position once in shared memory,
 * then every pair of q (rotated in place), k (rotated, stored as f16) and v
 * (stored as f16). The cache of rope_kvq_kernel's kinds goes there instead. */
__global__ void __launch_bounds__(ROW_THREADS) rope_kv_kernel(const RopeParams p)
{
    __shared__ float cs[512];   /* cos, sin of each pair: head_dim <= 512 */
    const int t = blockIdx.x, D = p.head_dim, half = D / 2;
    const int32_t pos = p.pos[t];
    rope_angles(cs, pos, half, p.step);
    const uint64_t row_off = (uint64_t)p.block[t] * p.block_stride + (uint64_t)(pos % p.block_tokens) * D * 2;
    const int pairs = (p.n_head + 2 * p.n_head_kv) * half;
    for (int idx = threadIdx.x; idx < pairs; idx += ROW_THREADS) {
        const int h = idx / half, i = idx % half;
        const float c = cs[2 * i], s = cs[2 * i + 1];
        /* the pair's two elements: adjacent, or half a head apart (NEOX) */
        const int e0 = p.neox ? i : 2 * i, e1 = p.neox ? i + half : 2 * i + 1;
        if (h < p.n_head) {
            float *x = p.q + ((size_t)t * p.n_head + h) * D;
            const float a = x[e0], b = x[e1];
            x[e0] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
            x[e1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
        } else if (h < p.n_head + p.n_head_kv) {
            const int kh = h - p.n_head;
            const float *x = p.k + ((size_t)t * p.n_head_kv + kh) * D;
            const float a = x[e0], b = x[e1];
            const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
            const float rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
            uint16_t *dst = reinterpret_cast<uint16_t *>(p.k_cache + row_off + kh * p.k_head_stride);
            dst[e0] = kc_half_bits(ra);
            dst[e1] = kc_half_bits(rb);
        } else {
            const int vh = h - p.n_head - p.n_head_kv;
            const float *x = p.v + ((size_t)t * p.n_head_kv + vh) * D + 2 * i;
            uint32_t *dst = reinterpret_cast<uint32_t *>(p.v_cache + row_off + vh * p.v_head_stride + 4 * i);
            *dst = (uint32_t)kc_half_bits(x[0]) | (uint32_t)kc_half_bits(x[1]) << 16;
        }
    }
}

/* The orthonormal Walsh-Hadamard transform of a vector of D values held by a
 * warp (lane holds element lane + 32*i in v[i]), as kern_hadamard computes
 * it: stages h = 1, 2, 4, ... in order, x[j] = a + b and x[j+h] = a - b for
 * the pair (j, j+h), then every value times 1/sqrt(D). Bit for bit the
 * twin's values. */
template <int D>
__device__ __forceinline__ void warp_hadamard(float (&v)[D / 32], int lane)
{
    constexpr int NV = D / 32;
#pragma unroll
    for (int h = 1; h < 32; h <<= 1)
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const float o = __shfl_xor_sync(KCUDA_FULL, v[i], h);
            v[i] = lane & h ? __fsub_rn(o, v[i]) : __fadd_rn(v[i], o);
        }
#pragma unroll
    for (int h = 1; h < NV; h <<= 1)
#pragma unroll
        for (int i = 0; i < NV; i++)
            if (!(i & h)) {
                const float a = v[i], b = v[i + h];
                v[i] = __fadd_rn(a, b);
                v[i + h] = __fsub_rn(a, b);
            }
    const float s = (float)(1.0 / sqrt((double)D));
#pragma unroll
    for (int i = 0; i < NV; i++)
        v[i] = __fmul_rn(v[i], s);
}

/* Lane `lane` of a warp holding element `lane` of a 32-value block: writes the
 * block as Q4_0 at blk as kern_quantize_q4_0_lsq does: for 19 inverse scales
 * -(8 + k/10) / max around the one that maps the signed largest value to -8,
 * the codes, and the least-squares scale for them (sums in double); the
 * candidate keeping the most of sum x^2 wins, the first on a tie. */
__device__ __forceinline__ void quantize_q4_0_lsq32(float x, int lane, uint8_t *blk)
{
    const float ax = fabsf(x);
    const float amax = kc_warp_max(ax);
    const unsigned at = __ballot_sync(KCUDA_FULL, ax == amax);
    const float max = amax > 0.0f ? __shfl_sync(KCUDA_FULL, x, __ffs((int)at) - 1) : 0.0f;
    int best = 0;
    double best_score = -1.0, best_d = 0.0;
    for (int k = -9; k <= 9 && max != 0.0f; k++) {
        const float is = -__fdiv_rn(__fadd_rn(8.0f, __fmul_rn(0.1f, (float)k)), max);
        int l = (int)__fadd_rn(__fmul_rn(is, x), 8.5f);
        l = (l < 0 ? 0 : l > 15 ? 15 : l) - 8;
        double sxl = (double)x * l;
        int sll = l * l;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            sxl += __shfl_xor_sync(KCUDA_FULL, sxl, o);
            sll += __shfl_xor_sync(KCUDA_FULL, sll, o);
        }
        if (sll > 0 && sxl * sxl / sll > best_score) {  /* the same on every lane */
            best_score = sxl * sxl / sll;
            best_d = sxl / sll;
            best = l;
        }
    }
    const int up = __shfl_sync(KCUDA_FULL, best, (lane + 16) % 32);
    if (lane < 16)
        blk[2 + lane] = (uint8_t)((best + 8) | (up + 8) << 4);
    if (lane == 0) {
        const uint16_t dh = kc_half_bits((float)best_d);
        blk[0] = (uint8_t)dh;
        blk[1] = (uint8_t)(dh >> 8);
    }
}

/* RoPE of a warp's vector v (see warp_hadamard) by the angles cs of one
 * position (cos, sin of each pair), as kern_rope computes it (adjacent pairs:
 * the pair's other value from the neighbouring lane) or kern_rope_neox (pairs
 * half a head apart: the lane's own register i ^ (D/64)). Every lane of the
 * warp calls it. */
template <int D>
__device__ __forceinline__ void warp_rope(float (&v)[D / 32], int lane, const float *cs, bool neox)
{
    constexpr int NV = D / 32;
    if (neox) {
        float r[NV];
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int e = lane + 32 * i, up = i & (NV / 2), pi = (e % (D / 2));
            const float x = v[i], o = v[i ^ (NV / 2)];
            const float c = cs[2 * pi], s = cs[2 * pi + 1];
            r[i] = up ? __fadd_rn(__fmul_rn(o, s), __fmul_rn(x, c))
                      : __fsub_rn(__fmul_rn(x, c), __fmul_rn(o, s));
        }
#pragma unroll
        for (int i = 0; i < NV; i++)
            v[i] = r[i];
    } else {
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int e = lane + 32 * i;
            const float x = v[i], o = __shfl_xor_sync(KCUDA_FULL, x, 1);
            const float c = cs[e & ~1], s = cs[e | 1];
            v[i] = e & 1 ? __fadd_rn(__fmul_rn(o, s), __fmul_rn(x, c))
                         : __fsub_rn(__fmul_rn(x, c), __fmul_rn(o, s));
        }
    }
}

/* Reads one row of `type` at row (F32, F16, Q8_0 or Q4_0) into a warp's
 * vector v (see warp_hadamard) as kern_dequantize_row gives it: F16 exactly,
 * Q8_0 / Q4_0 as the block's scale times the code (Q4_0: code - 8), as the
 * attention kernels dequantize. The scale's bytes are read one by one (a
 * Q8_0 block is 34 bytes: its scale is only 2-byte aligned). */
template <int D>
__device__ __forceinline__ void load_kv_row(const uint8_t *row, uint32_t type, float (&v)[D / 32], int lane)
{
#pragma unroll
    for (int i = 0; i < D / 32; i++) {
        if (type == KERN_F32) {
            v[i] = reinterpret_cast<const float *>(row)[lane + 32 * i];
        } else if (type == KERN_F16) {
            v[i] = kc_half(reinterpret_cast<const uint16_t *>(row)[lane + 32 * i]);
        } else {
            const bool q8 = type == KERN_Q8_0;
            const uint8_t *blk = row + i * (q8 ? sizeof(kern_block_q8_0) : sizeof(kern_block_q4_0));
            const float d = kc_half((uint32_t)blk[0] | (uint32_t)blk[1] << 8);
            const int c = q8 ? (int)(int8_t)blk[2 + lane]
                             : (lane < 16 ? blk[2 + lane] & 0x0F : blk[2 + lane - 16] >> 4) - 8;
            v[i] = __fmul_rn((float)c, d);
        }
    }
}

/* Stores a warp's vector v (see warp_hadamard) as one row of `type` at row
 * (F32 as it is: kv_shift_kernel's; the attention kernels read no F32). */
template <int D>
__device__ __forceinline__ void store_kv_row(uint8_t *row, uint32_t type, const float (&v)[D / 32], int lane)
{
#pragma unroll
    for (int i = 0; i < D / 32; i++) {
        if (type == KERN_F16)
            reinterpret_cast<uint16_t *>(row)[lane + 32 * i] = kc_half_bits(v[i]);
        else if (type == KERN_F32)
            reinterpret_cast<float *>(row)[lane + 32 * i] = v[i];
        else if (type == KERN_Q8_0)
            kc_quantize_block32(v[i], lane, row + i * sizeof(kern_block_q8_0), false);
        else
            quantize_q4_0_lsq32(v[i], lane, row + i * sizeof(kern_block_q4_0));
    }
}

/* rope_kv_kernel for a cache with a quantized or rotated half: one block per
 * token, one warp per vector (each query head, K head and V head): RoPE of q
 * and k as rope_kv_kernel computes it (the pair's other value from the
 * neighbouring lane, or with NEOX pairs from the lane's own register half a
 * head away), the Hadamard rotation where kv.rotate asks (q and K
 * with KV_ROT_K, V with KV_ROT_V), then q back in place and K/V into the
 * cache as their types. */
template <int D>
__global__ void __launch_bounds__(ROW_THREADS) rope_kvq_kernel(const RopeParams p)
{
    constexpr int NV = D / 32;
    __shared__ float cs[D];
    const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t pos = p.pos[t];
    rope_angles(cs, pos, D / 2, p.step);
    const uint64_t in_block = (uint64_t)(pos % p.block_tokens), block_off = (uint64_t)p.block[t] * p.block_stride;
    const int n_vec = p.n_head + 2 * p.n_head_kv;
    for (int vec = warp; vec < n_vec; vec += ROW_THREADS / 32) {
        const bool is_v = vec >= p.n_head + p.n_head_kv, is_q = vec < p.n_head;
        const int kh = vec - p.n_head, vh = kh - p.n_head_kv;
        const float *src = is_q ? p.q + ((size_t)t * p.n_head + vec) * D
                         : is_v ? p.v + ((size_t)t * p.n_head_kv + vh) * D
                                : p.k + ((size_t)t * p.n_head_kv + kh) * D;
        float v[NV];
#pragma unroll
        for (int i = 0; i < NV; i++)
            v[i] = src[lane + 32 * i];
        if (!is_v)
            warp_rope<D>(v, lane, cs, p.neox);
        if (p.rotate & (is_v ? KCUDA_ROT_V : KCUDA_ROT_K))
            warp_hadamard<D>(v, lane);
        if (is_q) {
            float *dst = p.q + ((size_t)t * p.n_head + vec) * D;
#pragma unroll
            for (int i = 0; i < NV; i++)
                dst[lane + 32 * i] = v[i];
        } else if (is_v) {
            store_kv_row<D>(p.v_cache + block_off + vh * p.v_head_stride + in_block * p.v_row, p.v_type, v, lane);
        } else {
            store_kv_row<D>(p.k_cache + block_off + kh * p.k_head_stride + in_block * p.k_row, p.k_type, v, lane);
        }
    }
}

/* What kv_shift_kernel reads. */
struct ShiftParams {
    uint8_t *k_cache;           /* K of the layer in block 0 */
    uint64_t block_stride, k_head_stride;
    uint32_t k_type, rotate;
    int k_row, block_tokens, n_head_kv;
    const uint32_t *blocks;     /* the blocks turned */
    int32_t delta;              /* positions: the angles of delta */
    float step;
    int neox;
};

/* Twin of engine_kv_shift for one layer: one block per (block, K head), one
 * warp per row of it (its position in the block), in place: the row read as
 * floats, un-rotated where the cache rotates K (the transform is its own
 * inverse), turned by the angles of delta, rotated again and stored as its
 * type. The RoPE angles of delta once in shared memory. */
template <int D>
__global__ void __launch_bounds__(ROW_THREADS) kv_shift_kernel(const ShiftParams p)
{
    __shared__ float cs[D];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    rope_angles(cs, p.delta, D / 2, p.step);
    const int b = blockIdx.x / p.n_head_kv, h = blockIdx.x % p.n_head_kv;
    uint8_t *head = p.k_cache + (uint64_t)p.blocks[b] * p.block_stride + (uint64_t)h * p.k_head_stride;
    const bool rot = (p.rotate & KCUDA_ROT_K) != 0;
    for (int t = warp; t < p.block_tokens; t += ROW_THREADS / 32) {
        uint8_t *row = head + (uint64_t)t * p.k_row;
        float v[D / 32];
        load_kv_row<D>(row, p.k_type, v, lane);
        if (rot)
            warp_hadamard<D>(v, lane);
        warp_rope<D>(v, lane, cs, p.neox);
        if (rot)
            warp_hadamard<D>(v, lane);
        __syncwarp();   /* every lane has read the row (a block's scale too) before any writes */
        store_kv_row<D>(row, p.k_type, v, lane);
    }
}

/* One warp per vector of D floats: kern_hadamard in place (warp_hadamard). */
template <int D>
__global__ void __launch_bounds__(128) hadamard_kernel(float *x, long n)
{
    const long vec = (long)blockIdx.x * 4 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (vec >= n)
        return;
    float *row = x + vec * D;
    float v[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; i++)
        v[i] = row[lane + 32 * i];
    warp_hadamard<D>(v, lane);
#pragma unroll
    for (int i = 0; i < D / 32; i++)
        row[lane + 32 * i] = v[i];
}

__global__ void swiglu_kernel(float *gate, const float *up, size_t count)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        const float g = gate[i];
        gate[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), up[i]);
    }
}

/* swiglu_kernel, then the result quantized to act: one warp per 32-element
 * block of one token (n % 32 == 0). */
__global__ void __launch_bounds__(128) swiglu_quant_kernel(float *gate, const float *up, int n, int T,
                                                           uint8_t *act, size_t act_stride, int with_sum)
{
    const int lane = threadIdx.x % 32, nb = n / 32;
    const long idx = (long)blockIdx.x * 4 + threadIdx.x / 32;
    if (idx >= (long)nb * T)
        return;                 /* a whole warp */
    const long t = idx / nb;
    const int b = (int)(idx % nb);
    const size_t i = (size_t)t * n + (size_t)b * 32 + lane;
    const float g = gate[i];
    const float y = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), up[i]);
    gate[i] = y;
    kc_quantize_block32(y, lane, act + (size_t)t * act_stride + (size_t)b * kc_act_block_bytes(with_sum),
                        with_sum);
}

/* GELU through the twin's table of halves, times up (kern_geglu). */
__global__ void geglu_kernel(float *gate, const float *up, size_t count, const float *table)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        const float x = gate[i];
        const float g = x <= -10.0f ? 0.0f : x >= 10.0f ? x : __ldg(table + kc_half_bits(x));
        gate[i] = __fmul_rn(g, up[i]);
    }
}

/* One block per row: y = RMSNorm(y) * w, x += y. */
__global__ void __launch_bounds__(ROW_THREADS) rmsnorm_add_kernel(float *x, float *y, const float *w, int n,
                                                                  float eps)
{
    const int t = blockIdx.x;
    float *yr = y + (size_t)t * n, *xr = x + (size_t)t * n;
    const float scale = rms_scale(yr, n, eps);
    for (int i = threadIdx.x; i < n; i += ROW_THREADS) {
        const float v = __fmul_rn(__fmul_rn(yr[i], scale), w[i]);
        yr[i] = v;
        xr[i] = __fadd_rn(xr[i], v);
    }
}

__global__ void scale_kernel(float *x, float s, size_t count)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __fmul_rn(x[i], s);
}

/* (v, i) beats (bv, bi): larger value, or the same value at a lower index.
 * NaN never beats anything. */
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi)
{
    return v > bv || (v == bv && i < bi);
}

/* Index of the largest of n values at row, lowest index on a tie, as
 * sampler_argmax: valid in thread 0 only. NT threads, all of them calling. */
template <int NT> __device__ int block_argmax(const float *row, long n)
{
    __shared__ float sv[NT / 32];
    __shared__ int si[NT / 32];
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (long i = threadIdx.x; i < n; i += NT) {
        const float v = row[i];
        if (beats(v, (int)i, bv, bi)) {
            bv = v;
            bi = (int)i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(KCUDA_FULL, bv, o);
        const int oi = __shfl_xor_sync(KCUDA_FULL, bi, o);
        if (beats(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if (threadIdx.x % 32 == 0) {
        sv[threadIdx.x / 32] = bv;
        si[threadIdx.x / 32] = bi;
    }
    __syncthreads();
    if (threadIdx.x != 0)
        return 0;
    for (int w = 1; w < NT / 32; w++)
        if (beats(sv[w], si[w], bv, bi)) {
            bv = sv[w];
            bi = si[w];
        }
    /* the twin scans from index 0 and nothing beats a NaN there: index 0;
     * so do rows with no number at all */
    return isnan(row[0]) || bi == INT_MAX ? 0 : bi;
}

__global__ void __launch_bounds__(ROW_THREADS) argmax_kernel(int32_t *ids, const float *logits, long n, size_t ld)
{
    const int best = block_argmax<ROW_THREADS>(logits + (size_t)blockIdx.x * ld, n);
    if (threadIdx.x == 0)
        ids[blockIdx.x] = best;
}

/* ---- sampling: the twin of sampler_pick -------------------------------------- */

constexpr int SAMPLE_THREADS = KCUDA_SAMPLE_MAX_K;  /* one candidate per thread */

/* An unsigned key in the order the twin's comparison gives floats: larger
 * value, larger key; -0 and +0 equal; NaN below everything (the twin's qsort
 * has no order for NaN; this one picks a fixed one). */
__device__ __forceinline__ uint32_t order_key(float v)
{
    if (isnan(v))
        return 0;
    if (v == 0.0f)
        v = 0.0f;
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* Exclusive prefix sum of v over the block's SAMPLE_THREADS threads, in
 * thread order; *total gets the sum. Every thread calls. */
__device__ int block_excl_scan(int v, int *total)
{
    __shared__ int warp_sum[SAMPLE_THREADS / 32];
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_sync(KCUDA_FULL, x, lane >= o ? lane - o : 0);
        if (lane >= o)
            x += y;
    }
    __syncthreads();                    /* warp_sum may still be read by a previous call */
    if (lane == 31)
        warp_sum[w] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int i = 0; i < SAMPLE_THREADS / 32; i++) {
        before += i < w ? warp_sum[i] : 0;
        all += warp_sum[i];
    }
    *total = all;
    return before + x - v;
}

/* Candidate a comes before b: larger key, or the same key at a lower id (the
 * twin's cand_cmp). */
__device__ __forceinline__ bool cand_before(uint32_t ka, int32_t ia, uint32_t kb, int32_t ib)
{
    return ka > kb || (ka == kb && ia < ib);
}

/* One block per draw: the penalty and then the addends on the row (in place), then greedy or the
 * k best candidates in the twin's order (radix select of the k-th key, ties
 * taken by lowest id, a bitonic sort), the exponentials in parallel and the
 * twin's sums in its order by one thread. */
__global__ void __launch_bounds__(SAMPLE_THREADS, 1) sample_kernel(int32_t *ids, float *logits, long n, size_t ld,
                                                                 const struct kcuda_draw *draws,
                                                                 const int32_t *pen, const float *pen_add)
{
    __shared__ unsigned hist[256];
    __shared__ uint32_t s_prefix;
    __shared__ int s_remaining;
    __shared__ uint32_t ckey[SAMPLE_THREADS];
    __shared__ int32_t cid[SAMPLE_THREADS];
    __shared__ double e1[SAMPLE_THREADS];
    __shared__ double e2[SAMPLE_THREADS];
    __shared__ int s_k;
    const struct kcuda_draw d = draws[blockIdx.x];
    const int tid = threadIdx.x;
    if (d.row < 0) {
        if (tid == 0)
            ids[blockIdx.x] = -1;
        return;
    }
    float *row = logits + (size_t)d.row * ld;
    if (d.n_pen > 0 && pen == nullptr)
        __trap();                                   /* a draw the host did not lay out */
    for (uint32_t i = tid; i < d.n_pen; i += SAMPLE_THREADS) {
        const int32_t id = pen[d.pen_off + i];     /* distinct: no two threads share one */
        const float w = row[id];
        row[id] = w > 0.0f ? __fdiv_rn(w, d.repeat_penalty) : __fmul_rn(w, d.repeat_penalty);
    }
    __syncthreads();
    if (d.n_bias > 0 && (pen == nullptr || pen_add == nullptr))
        __trap();
    for (uint32_t i = tid; i < d.n_bias; i += SAMPLE_THREADS) {
        const int32_t id = pen[d.bias_off + i];    /* distinct, as above */
        row[id] = __fadd_rn(row[id], pen_add[d.bias_off + i]);
    }
    __syncthreads();
    if (!(d.temperature > 0.0f)) {
        const int best = block_argmax<SAMPLE_THREADS>(row, n);
        if (tid == 0)
            ids[blockIdx.x] = best;
        return;
    }
    /* 1 .. min(n, SAMPLE_THREADS) as the host lays draws out; held there
     * whatever the draw says, so that no write leaves the candidate arrays */
    const int k = max(1, min(d.top_k, (int)min(n, (long)SAMPLE_THREADS)));

    /* the k-th largest key, 8 bits at a time from the top */
    uint32_t prefix = 0, mask = 0;
    int remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += SAMPLE_THREADS)
            hist[i] = 0;
        __syncthreads();
        /* a row's keys share few top bytes: lanes with the same bucket add
         * once, through their lowest lane (every lane takes part in every
         * round: the loop's bound is the block's) */
        for (long base = 0; base < n; base += SAMPLE_THREADS) {
            const long i = base + tid;
            const uint32_t key = i < n ? order_key(row[i]) : 0;
            const bool match = i < n && (key & mask) == prefix;
            const unsigned bucket = match ? (key >> shift) & 255u : 256u;
            const unsigned peers = __match_any_sync(KCUDA_FULL, bucket);
            if (match && tid % 32 == __ffs((int)peers) - 1)
                atomicAdd(&hist[bucket], (unsigned)__popc(peers));
        }
        __syncthreads();
        if (tid == 0) {
            int rem = remaining, b = 255;
            for (; b > 0; b--) {
                if ((int)hist[b] >= rem)
                    break;
                rem -= (int)hist[b];
            }
            s_prefix = prefix | ((uint32_t)b << shift);
            s_remaining = rem;
        }
        __syncthreads();
        prefix = s_prefix;
        remaining = s_remaining;
        mask |= 255u << shift;
    }
    /* gather: every key above the k-th, and the lowest ids of those equal to
     * it, in id order. Warp w scans its contiguous range 32 consecutive
     * elements at a time (coalesced); a lane's place is the count of matches
     * before it: in the warps before, in the rounds before, in the lanes
     * before (ballots) */
    constexpr int NW = SAMPLE_THREADS / 32;
    const int lane = tid % 32, wid = tid / 32;
    const unsigned lanes_below = (1u << lane) - 1u;
    const long span = ((n + NW - 1) / NW + 31) / 32 * 32;
    const long lo = (long)wid * span, hi = lo + span < n ? lo + span : n;
    int n_gt = 0, n_eq = 0;                         /* this warp's (every lane has them) */
    for (long base = lo; base < hi; base += 32) {   /* the same rounds for the whole warp */
        const long i = base + lane;
        const uint32_t key = i < hi ? order_key(row[i]) : 0;
        n_gt += __popc(__ballot_sync(KCUDA_FULL, i < hi && key > prefix));
        n_eq += __popc(__ballot_sync(KCUDA_FULL, i < hi && key == prefix));
    }
    int all_gt, all_eq;
    const int gt_before = block_excl_scan(lane == 0 ? n_gt : 0, &all_gt);   /* lane 0: the warps before */
    const int eq_before = block_excl_scan(lane == 0 ? n_eq : 0, &all_eq);
    int at_gt = __shfl_sync(KCUDA_FULL, gt_before, 0);
    int at_eq = all_gt + __shfl_sync(KCUDA_FULL, eq_before, 0);
    ckey[tid] = 0;                                  /* padding sorts last: key 0, largest id */
    cid[tid] = INT_MAX;
    __syncthreads();
    for (long base = lo; base < hi; base += 32) {
        const long i = base + lane;
        const uint32_t key = i < hi ? order_key(row[i]) : 0;
        const bool gt = i < hi && key > prefix, eq = i < hi && key == prefix;
        const unsigned mg = __ballot_sync(KCUDA_FULL, gt), me = __ballot_sync(KCUDA_FULL, eq);
        if (gt) {
            const int at = at_gt + __popc(mg & lanes_below);
            ckey[at] = key;
            cid[at] = (int32_t)i;
        } else if (eq) {
            const int at = at_eq + __popc(me & lanes_below);
            if (at < k) {
                ckey[at] = key;
                cid[at] = (int32_t)i;
            }
        }
        at_gt += __popc(mg);
        at_eq += __popc(me);
    }
    /* bitonic sort of the padded power of two into the twin's order */
    int P = 1;
    while (P < k)
        P *= 2;
    for (int size = 2; size <= P; size <<= 1) {
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            __syncthreads();
            const int j = tid ^ stride;
            if (tid < P && j > tid) {
                const bool up = (tid & size) == 0;  /* this pair ends in the twin's order */
                const bool swap = up ? cand_before(ckey[j], cid[j], ckey[tid], cid[tid])
                                     : cand_before(ckey[tid], cid[tid], ckey[j], cid[j]);
                if (swap) {
                    const uint32_t tk = ckey[tid];
                    const int32_t ti = cid[tid];
                    ckey[tid] = ckey[j];
                    cid[tid] = cid[j];
                    ckey[j] = tk;
                    cid[j] = ti;
                }
            }
        }
    }
    __syncthreads();

    /* the twin's arithmetic: exponentials in parallel, each sum in its order */
    const double top = (double)row[cid[0]];
    const float mine = tid < k ? row[cid[tid]] : 0.0f;
    if (tid < k)
        e1[tid] = exp((double)mine - top);
    __syncthreads();
    if (tid == 0) {
        double sum = 0.0;
        for (int i = 0; i < k; i++)
            sum += e1[i];
        e2[0] = sum;
    }
    __syncthreads();
    if (d.top_p < 1.0f && tid < k)
        e1[tid] = e1[tid] / e2[0];
    __syncthreads();
    if (tid == 0) {
        int kk = k;
        if (d.top_p < 1.0f) {
            double cum = 0.0;
            for (int i = 0; i < kk; i++) {
                cum += e1[i];
                if (cum >= (double)d.top_p) {
                    kk = i + 1;
                    break;
                }
            }
        }
        if (d.min_p > 0.0f) {
            const double floor_logit = top + d.log_min_p;
            int keep = 1;
            while (keep < kk && (double)row[cid[keep]] >= floor_logit)
                keep++;
            kk = keep;
        }
        s_k = kk;
    }
    __syncthreads();
    const int kk = s_k;
    if (tid < kk)
        e2[tid] = exp(((double)mine - top) / (double)d.temperature);
    __syncthreads();
    if (tid == 0) {
        double total = 0.0;
        for (int i = 0; i < kk; i++)
            total += e2[i];
        const double u = d.u * total;
        double acc = 0.0;
        int32_t pick = cid[kk - 1];
        for (int i = 0; i < kk; i++) {
            acc += (double)(float)e2[i];
            if (u < acc) {
                pick = cid[i];
                break;
            }
        }
        ids[blockIdx.x] = pick;
    }
}

} /* namespace */

extern "C" int kcuda_rmsnorm(float *out, const float *x, const float *w, const int32_t *rows, int n, int T,
                             float eps, kcuda_stream_t stream)
{
    if (n <= 0 || T < 0 || out == NULL || x == NULL || w == NULL)
        return KVD_EINVAL;
    if (T == 0)
        return 0;
    rmsnorm_kernel<<<(unsigned)T, ROW_THREADS, 0, stream>>>(out, x, w, rows, n, eps);
    return kcuda__launched("rmsnorm");
}

/* Checks where a fused kernel puts its quantized rows: 0, KVD_EUNSUPPORTED
 * for a type other than Q8_0/Q8_1, KVD_EINVAL for rows too short. */
static int act_check(uint32_t act_type, int64_t n, const void *act, size_t act_stride)
{
    if (act_type != KERN_Q8_0 && act_type != KERN_Q8_1)
        return KVD_EUNSUPPORTED;
    const size_t rb = (size_t)(n / 32) * (size_t)kc_act_block_bytes(act_type == KERN_Q8_1);
    return act == NULL || act_stride < rb ? KVD_EINVAL : 0;
}

extern "C" int kcuda_rmsnorm_quant(float *out, const float *x, const float *w, int n, int T, float eps,
                                   uint32_t act_type, void *act, size_t act_stride, kcuda_stream_t stream)
{
    if (n <= 0 || n % 32 || T < 0 || out == NULL || x == NULL || w == NULL)
        return KVD_EINVAL;
    const int rc = act_check(act_type, n, act, act_stride);
    if (rc)
        return rc;
    if (T == 0)
        return 0;
    rmsnorm_quant_kernel<<<(unsigned)T, ROW_THREADS, 0, stream>>>(out, x, w, n, eps, static_cast<uint8_t *>(act),
                                                                  act_stride, act_type == KERN_Q8_1);
    return kcuda__launched("rmsnorm and quantization");
}

extern "C" int kcuda_swiglu_quant(float *gate, const float *up, int64_t n, int T, uint32_t act_type, void *act,
                                  size_t act_stride, kcuda_stream_t stream)
{
    if (n <= 0 || n % 32 || n > INT_MAX || T < 0 || gate == NULL || up == NULL)
        return KVD_EINVAL;
    const int rc = act_check(act_type, n, act, act_stride);
    if (rc)
        return rc;
    const long blocks = (long)(n / 32) * T;
    if (blocks == 0)
        return 0;
    if ((blocks + 3) / 4 > 0x7fffffffL)
        return KVD_ERANGE;
    swiglu_quant_kernel<<<(unsigned)((blocks + 3) / 4), 128, 0, stream>>>(gate, up, (int)n, T,
                                                                         static_cast<uint8_t *>(act), act_stride,
                                                                         act_type == KERN_Q8_1);
    return kcuda__launched("swiglu and quantization");
}

extern "C" int kcuda_rope_kv(const struct kcuda_rope_args *a, kcuda_stream_t stream)
{
    const kcuda_kv *kv = &a->kv;
    if (a->T < 0 || kv->head_dim <= 0 || kv->head_dim % 2 || kv->head_dim > 512 || kv->n_head <= 0 ||
        kv->n_head_kv <= 0 || kv->block_tokens <= 0)
        return KVD_EINVAL;
    if (a->T == 0)
        return 0;
    if (a->q == NULL || a->k == NULL || a->v == NULL || a->pos == NULL || a->block == NULL || kv->k == NULL ||
        kv->v == NULL)
        return KVD_EINVAL;
    if (((uintptr_t)kv->k | (uintptr_t)kv->v | kv->block_stride | kv->k_head_stride | kv->v_head_stride) % 4)
        return KVD_EINVAL;
    const bool plain = kv->k_type == KERN_F16 && kv->v_type == KERN_F16 && kv->rotate == 0;
    const int k_row = kcuda_kv_row_bytes(kv->k_type, kv->head_dim), v_row = kcuda_kv_row_bytes(kv->v_type, kv->head_dim);
    if (k_row == 0 || v_row == 0 || (kv->rotate & ~(uint32_t)(KCUDA_ROT_K | KCUDA_ROT_V)) != 0 ||
        (!plain && kv->head_dim != 64 && kv->head_dim != 128 && kv->head_dim != 256))
        return KVD_EUNSUPPORTED;
    RopeParams p;
    p.k_cache = kv->k;
    p.v_cache = kv->v;
    p.block_stride = kv->block_stride;
    p.k_head_stride = kv->k_head_stride;
    p.v_head_stride = kv->v_head_stride;
    p.k_type = kv->k_type;
    p.v_type = kv->v_type;
    p.rotate = kv->rotate;
    p.k_row = k_row;
    p.v_row = v_row;
    p.block_tokens = kv->block_tokens;
    p.head_dim = kv->head_dim;
    p.n_head = kv->n_head;
    p.n_head_kv = kv->n_head_kv;
    p.q = a->q;
    p.k = a->k;
    p.v = a->v;
    p.pos = a->pos;
    p.block = a->block;
    p.step = a->step;
    p.neox = a->neox;
    if (plain)
        rope_kv_kernel<<<(unsigned)a->T, ROW_THREADS, 0, stream>>>(p);
    else if (kv->head_dim == 64)
        rope_kvq_kernel<64><<<(unsigned)a->T, ROW_THREADS, 0, stream>>>(p);
    else if (kv->head_dim == 128)
        rope_kvq_kernel<128><<<(unsigned)a->T, ROW_THREADS, 0, stream>>>(p);
    else
        rope_kvq_kernel<256><<<(unsigned)a->T, ROW_THREADS, 0, stream>>>(p);
    return kcuda__launched("rope and KV write");
}

extern "C" int kcuda_kv_shift(const struct kcuda_kv_shift_args *a, kcuda_stream_t stream)
{
    const kcuda_kv *kv = &a->kv;
    if (a->n_blocks < 0 || kv->n_head_kv <= 0 || kv->block_tokens <= 0)
        return KVD_EINVAL;
    if (a->n_blocks == 0)
        return 0;
    if (a->blocks == NULL || kv->k == NULL ||
        ((uintptr_t)kv->k | kv->block_stride | kv->k_head_stride) % 4 != 0)
        return KVD_EINVAL;
    const int D = kv->head_dim;
    const int k_row = kv->k_type == KERN_F32 && D % 32 == 0 ? D * 4 : kcuda_kv_row_bytes(kv->k_type, D);
    if (k_row == 0 || (D != 64 && D != 128 && D != 256) ||
        (kv->rotate & ~(uint32_t)(KCUDA_ROT_K | KCUDA_ROT_V)) != 0)
        return KVD_EUNSUPPORTED;
    if ((uint64_t)kv->block_tokens * (uint64_t)k_row > kv->k_head_stride)
        return KVD_EINVAL;
    const long grid = (long)a->n_blocks * kv->n_head_kv;
    if (grid > 0x7fffffffL)
        return KVD_ERANGE;
    ShiftParams p;
    p.k_cache = kv->k;
    p.block_stride = kv->block_stride;
    p.k_head_stride = kv->k_head_stride;
    p.k_type = kv->k_type;
    p.rotate = kv->rotate;
    p.k_row = k_row;
    p.block_tokens = kv->block_tokens;
    p.n_head_kv = kv->n_head_kv;
    p.blocks = a->blocks;
    p.delta = a->delta;
    p.step = a->step;
    p.neox = a->neox;
    if (D == 64)
        kv_shift_kernel<64><<<(unsigned)grid, ROW_THREADS, 0, stream>>>(p);
    else if (D == 128)
        kv_shift_kernel<128><<<(unsigned)grid, ROW_THREADS, 0, stream>>>(p);
    else
        kv_shift_kernel<256><<<(unsigned)grid, ROW_THREADS, 0, stream>>>(p);
    return kcuda__launched("KV shift");
}

extern "C" int kcuda_hadamard(float *x, int64_t n, int head_dim, kcuda_stream_t stream)
{
    if (n < 0 || x == NULL || (head_dim != 64 && head_dim != 128 && head_dim != 256))
        return n == 0 ? 0 : KVD_EINVAL;
    if (n == 0)
        return 0;
    if ((n + 3) / 4 > 0x7fffffffL)
        return KVD_ERANGE;
    const unsigned blocks = (unsigned)((n + 3) / 4);
    if (head_dim == 64)
        hadamard_kernel<64><<<blocks, 128, 0, stream>>>(x, (long)n);
    else if (head_dim == 128)
        hadamard_kernel<128><<<blocks, 128, 0, stream>>>(x, (long)n);
    else
        hadamard_kernel<256><<<blocks, 128, 0, stream>>>(x, (long)n);
    return kcuda__launched("hadamard");
}

/* Blocks of 256 threads for an element-wise kernel over count values (its
 * threads stride over the rest past 65536 blocks). */
static unsigned elementwise_blocks(size_t count)
{
    const size_t blocks = (count + 255) / 256;
    return (unsigned)(blocks > 65536 ? 65536 : blocks);
}

extern "C" int kcuda_swiglu(float *gate, const float *up, int64_t n, int T, kcuda_stream_t stream)
{
    if (n <= 0 || T < 0 || gate == NULL || up == NULL)
        return KVD_EINVAL;
    const size_t count = (size_t)n * (size_t)T;
    if (count == 0)
        return 0;
    swiglu_kernel<<<elementwise_blocks(count), 256, 0, stream>>>(gate, up, count);
    return kcuda__launched("swiglu");
}

extern "C" int kcuda_geglu(float *gate, const float *up, int64_t n, int T, const float *table,
                           kcuda_stream_t stream)
{
    if (n <= 0 || T < 0 || gate == NULL || up == NULL || table == NULL)
        return KVD_EINVAL;
    const size_t count = (size_t)n * (size_t)T;
    if (count == 0)
        return 0;
    geglu_kernel<<<elementwise_blocks(count), 256, 0, stream>>>(gate, up, count, table);
    return kcuda__launched("geglu");
}

extern "C" int kcuda_rmsnorm_add(float *x, float *y, const float *w, int n, int T, float eps, kcuda_stream_t stream)
{
    if (n <= 0 || T < 0 || x == NULL || y == NULL || w == NULL)
        return KVD_EINVAL;
    if (T == 0)
        return 0;
    rmsnorm_add_kernel<<<(unsigned)T, ROW_THREADS, 0, stream>>>(x, y, w, n, eps);
    return kcuda__launched("rmsnorm and add");
}

extern "C" int kcuda_scale(float *x, float s, int64_t count, kcuda_stream_t stream)
{
    if (count < 0 || (x == NULL && count > 0))
        return KVD_EINVAL;
    if (count == 0)
        return 0;
    scale_kernel<<<elementwise_blocks((size_t)count), 256, 0, stream>>>(x, s, (size_t)count);
    return kcuda__launched("scale");
}

extern "C" int kcuda_sample(int32_t *ids, float *logits, int64_t n, size_t ld, const struct kcuda_draw *draws,
                            int R, const int32_t *pen, const float *pen_add, kcuda_stream_t stream)
{
    if (n <= 0 || n > INT_MAX || R < 0 || ld < (size_t)n || ids == NULL || logits == NULL || draws == NULL)
        return KVD_EINVAL;
    if (R == 0)
        return 0;
    sample_kernel<<<(unsigned)R, SAMPLE_THREADS, 0, stream>>>(ids, logits, (long)n, ld, draws, pen, pen_add);
    return kcuda__launched("sample");
}

extern "C" int kcuda_argmax(int32_t *ids, const float *logits, int64_t n, size_t ld, int T, kcuda_stream_t stream)
{
    if (n <= 0 || n > INT_MAX || T < 0 || ld < (size_t)n || ids == NULL || logits == NULL)
        return KVD_EINVAL;
    if (T == 0)
        return 0;
    argmax_kernel<<<(unsigned)T, ROW_THREADS, 0, stream>>>(ids, logits, (long)n, ld);
    return kcuda__launched("argmax");
}
