/*
 * kcuda_impl.cuh - what the CUDA kernel files share: error reporting, warp
 * reductions, f16 unpacking and asynchronous copies into shared memory.
 * Internal to kernels/cuda.
 */
#ifndef KVD_KCUDA_IMPL_CUH
#define KVD_KCUDA_IMPL_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "err.h"
#include "kcuda.h"
#include "quant_blocks.h"
#include "types.h"

/* Records the message of a failed CUDA call for kcuda_last_error(); returns code. */
int kcuda__fail(int code, cudaError_t e, const char *what);

/* KVD_EINTERNAL with the launch error of the last kernel, or 0. */
int kcuda__launched(const char *what);

#define KCUDA_FULL 0xffffffffu

/* Largest of v over the warp; every lane gets the same value. */
__device__ __forceinline__ float kc_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(KCUDA_FULL, v, o));
    return v;
}

/* Sum of v over the warp by a butterfly: every lane adds the same pairs (a + b
 * and b + a are the same float), so every lane gets the same bits, and the
 * order depends on nothing but the lane numbers. */
__device__ __forceinline__ float kc_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = __fadd_rn(v, __shfl_xor_sync(KCUDA_FULL, v, o));
    return v;
}

__device__ __forceinline__ int kc_warp_sum_int(int v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(KCUDA_FULL, v, o);
    return v;
}

/* IEEE half bits to float (exact). */
__device__ __forceinline__ float kc_half(uint32_t bits)
{
    return __half2float(__ushort_as_half((unsigned short)(bits & 0xffffu)));
}

/* Float to half bits, round to nearest even (as kvd_f32_to_f16). */
__device__ __forceinline__ uint16_t kc_half_bits(float f)
{
    return __half_as_ushort(__float2half_rn(f));
}

/* kern_quantize_act's arithmetic for one value v of a 32-value block held by
 * a warp (one value a lane): returns v's code q = roundf(v * (1/d)) and gives
 * every lane the block's scale d = amax/127 (unrounded) and the sum of its
 * codes. Every lane of the warp calls it. */
__device__ __forceinline__ int kc_quant32(float v, float *d_out, int *sum_out)
{
    const float amax = kc_warp_max(fabsf(v));
    const float d = __fdiv_rn(amax, 127.0f);
    float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    if (!isfinite(id))
        id = 0.0f;
    const int q = (int)roundf(__fmul_rn(v, id));
    *d_out = d;
    *sum_out = kc_warp_sum_int(q);
    return q;
}

/* Lane `lane` of a warp holding element `lane` of a 32-element block: writes
 * the block as kern_quantize_act does (Q8_0, or Q8_1 when with_sum): d =
 * amax/127, q = roundf(x * (1/d)), d as f16; Q8_1 adds s = f16(sum(q) * d)
 * with d unrounded. Every lane of the warp calls it. */
__device__ __forceinline__ void kc_quantize_block32(float v, int lane, uint8_t *blk, bool with_sum)
{
    float d;
    int sum;
    const int q = kc_quant32(v, &d, &sum);
    const int off = with_sum ? 4 : 2;
    blk[off + lane] = (uint8_t)(int8_t)q;
    if (lane == 0) {
        const uint16_t dh = kc_half_bits(d);
        blk[0] = (uint8_t)dh;
        blk[1] = (uint8_t)(dh >> 8);
        if (with_sum) {
            const uint16_t sh = kc_half_bits(__fmul_rn((float)sum, d));
            blk[2] = (uint8_t)sh;
            blk[3] = (uint8_t)(sh >> 8);
        }
    }
}

/* Bytes of one head's row of head_dim values in a KV cache of `type` (F16,
 * Q8_0, Q4_0), or 0 for a type or width the attention kernels cannot read. */
__host__ __device__ __forceinline__ int kcuda_kv_row_bytes(uint32_t type, int head_dim)
{
    if (type == KERN_F16)
        return head_dim * 2;
    if (head_dim % 32 != 0)
        return 0;
    if (type == KERN_Q8_0)
        return head_dim / 32 * (int)sizeof(struct kern_block_q8_0);
    if (type == KERN_Q4_0)
        return head_dim / 32 * (int)sizeof(struct kern_block_q4_0);
    return 0;
}

/* Bytes of one 32-element activation block of Q8_0 or (with_sum) Q8_1. */
__host__ __device__ __forceinline__ int kc_act_block_bytes(bool with_sum)
{
    return with_sum ? (int)sizeof(struct kern_block_q8_1) : (int)sizeof(struct kern_block_q8_0);
}

/* The 8 halves of a 16-byte chunk as floats, in memory order. */
__device__ __forceinline__ void kc_unpack8(uint4 u, float f[8])
{
    const uint32_t w[4] = { u.x, u.y, u.z, u.w };
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = kc_half(w[i]);
        f[2 * i + 1] = kc_half(w[i] >> 16);
    }
}

#ifndef KVD_CUDA_EMU
/* Copies 16 bytes from global to shared memory without passing through
 * registers (sm_80+). Only the first src_bytes (0..16) are read; the rest of
 * the 16 destination bytes are filled with zeros. Both addresses 16-byte
 * aligned. */
__device__ __forceinline__ void kc_cp_async16(void *smem, const void *gmem, int src_bytes)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
                 : "memory");
}

/* The same through L1, for data that other blocks on the SM read too. */
__device__ __forceinline__ void kc_cp_async16_ca(void *smem, const void *gmem, int src_bytes)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
                 : "memory");
}

/* Waits for every cp.async this thread issued. Other threads' copies are
 * visible after a barrier (__syncwarp or __syncthreads) that follows. */
__device__ __forceinline__ void kc_cp_async_wait_all()
{
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}
#else
/* The CPU emulation of tests/gpu/emu: the copy is queued per thread and done
 * at the wait, so a read before the wait sees stale data there too. */
__device__ __forceinline__ void kc_cp_async16(void *smem, const void *gmem, int src_bytes)
{
    emu_cp_async(smem, gmem, src_bytes);
}
__device__ __forceinline__ void kc_cp_async16_ca(void *smem, const void *gmem, int src_bytes)
{
    emu_cp_async(smem, gmem, src_bytes);
}
__device__ __forceinline__ void kc_cp_async_wait_all() { emu_cp_wait(); }
#endif

#endif
