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
#include <limits.h>
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
    case KERN_Q5_0: return n % 32 ? 0 : (size_t)(n / 32) * sizeof(struct kern_block_q5_0);
    case KERN_Q4_K: return n % 256 ? 0 : (size_t)(n / 256) * sizeof(struct kern_block_q4_k);
    case KERN_Q6_K: return n % 256 ? 0 : (size_t)(n / 256) * sizeof(struct kern_block_q6_k);
    case KERN_Q8_K: return n % 256 ? 0 : (size_t)(n / 256) * sizeof(struct kern_block_q8_k);
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
    static constexpr bool SUPER = false;    /* activation blocks of 32, ABYTES each */
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
    static constexpr bool SUPER = false;
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
    static constexpr bool SUPER = false;
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
 * A Q5_0 block (22 bytes, 2-byte aligned) meets Q8_0 activations staged as
 * Q8_0's are. Its codes are 5 bits, 0..31, for values code - 16: the dot
 * products take the codes as they are and subtract 16 times the sum of the
 * activation codes, the same integer as the twin's sum.
 */
template <> struct Weights<KERN_Q5_0> {
    static constexpr int ABYTES = sizeof(struct kern_block_q8_0);
    static constexpr bool SUPER = false;
    static __device__ __forceinline__ int pad(int u) { return Weights<KERN_Q8_0>::pad(u); }
    static __device__ __forceinline__ int act_at(int lane) { return Weights<KERN_Q8_0>::act_at(lane); }
    using Act = Weights<KERN_Q8_0>::Act;

    struct Block {
        float dw;
        int q[8];               /* codes 0..31 of elements 4j..4j+3 */

        __device__ __forceinline__ void load(const uint8_t *row, int b)
        {
            const uint8_t *wb = row + (size_t)b * sizeof(struct kern_block_q5_0);
            const uint32_t sh = (uint32_t)((uintptr_t)wb & 3) * 8;     /* 0 or 16 */
            const uint8_t *a4 = wb - ((uintptr_t)wb & 3);
            uint32_t w[6];
#pragma unroll
            for (int k = 0; k < 5; k++)
                w[k] = ld32(a4 + 4 * k);
            w[5] = sh ? ld32(a4 + 20) : ld16(a4 + 20);     /* never a byte past the block */
            dw = kc_half(w[0] >> sh);
            const uint32_t qh = __funnelshift_rc(w[0], w[1], sh + 16);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const uint32_t qs = __funnelshift_rc(w[j + 1], w[j + 2], sh + 16);
                q[j] = (int)((qs & 0x0F0F0F0Fu) | spread4(qh >> (4 * j)));
                q[j + 4] = (int)(((qs >> 4) & 0x0F0F0F0Fu) | spread4(qh >> (16 + 4 * j)));
            }
        }

        /* bit i of b (i < 4) to bit 4 of byte i */
        static __device__ __forceinline__ uint32_t spread4(uint32_t b)
        {
            return (b & 1u) << 4 | (b & 2u) << 11 | (b & 4u) << 18 | (b & 8u) << 25;
        }

        /* sum + d_w*d_a*isum */
        __device__ __forceinline__ float add_to(const Act &a, float sum) const
        {
            int si = 0, sa = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                si = __dp4a(q[j], a.q[j], si);
                sa = __dp4a(0x01010101, a.q[j], sa);
            }
            si -= 16 * sa;
            return __fadd_rn(sum, __fmul_rn(__fmul_rn(dw, a.da), (float)si));
        }
    };
};

/*
 * The K-quants (Q4_K, Q6_K) meet Q8_K activations: super-blocks of 256 with
 * one float scale, 256 codes and the sums of each 16 (292 bytes). A lane
 * takes a sub-block of 32 elements, so "block" c of a row is sub-block c % 8
 * of super-block c / 8, and a chunk of 32 is 4 whole super-blocks, staged as
 * they lie (1168 bytes, a multiple of 16). The sums of the integer products
 * are exact in any order; the float terms of each sub-block are formed once,
 * as the twin forms them per super-block, so results differ from the twin's
 * by float rounding only.
 */
struct Q8KAct {
    float da;                   /* the super-block's scale */
    int q[8];                   /* codes of elements 4j..4j+3 of the sub-block */
    int s0, s1;                 /* sums of its first and last 16 codes */

    /* sb: the lane's staged super-block (act_at); the lane takes its sub-block
     * lane % 8 (block c0 + lane, c0 a multiple of 32) */
    __device__ __forceinline__ void load(const uint8_t *sb)
    {
        const int sub = (int)(threadIdx.x % 8);
        da = __uint_as_float(lds32(sb));
#pragma unroll
        for (int j = 0; j < 8; j++)
            q[j] = (int)lds32(sb + 4 + 32 * sub + 4 * j);
        const uint32_t bs = lds32(sb + 4 + 256 + 4 * sub);
        s0 = (int)(int16_t)(bs & 0xffffu);
        s1 = (int)(int16_t)(bs >> 16);
    }
};

/* Eight words of codes at p (2-byte aligned), read as aligned words and
 * realigned; from a 2-byte offset the last word read ends 2 bytes past the
 * 32 (callers keep p + 34 inside their block). */
__device__ __forceinline__ void ld_words8(const uint8_t *p, uint32_t (&q)[8])
{
    const uint32_t sh = (uint32_t)((uintptr_t)p & 3) * 8;
    const uint8_t *a4 = p - ((uintptr_t)p & 3);
    if (sh == 0) {
#pragma unroll
        for (int k = 0; k < 8; k++)
            q[k] = ld32(a4 + 4 * k);
        return;
    }
    uint32_t w[9];
#pragma unroll
    for (int k = 0; k < 9; k++)
        w[k] = ld32(a4 + 4 * k);
#pragma unroll
    for (int k = 0; k < 8; k++)
        q[k] = __funnelshift_rc(w[k], w[k + 1], sh);
}

struct KStage {
    static constexpr int ABYTES = sizeof(struct kern_block_q8_k);   /* per super-block */
    static constexpr bool SUPER = true;     /* blocks are sub-blocks of 32 of super-blocks */
    static __device__ __forceinline__ int pad(int) { return 0; }
    static __device__ __forceinline__ int act_at(int lane) { return (lane / 8) * ABYTES; }
    using Act = Q8KAct;
};

/* Q4_K: element = d * sc * code - dmin * mn per sub-block (codes 0..15, 6-bit
 * sc and mn): sum + d*da*(sc * isum) - dmin*da*(mn * sum of the activation codes). */
template <> struct Weights<KERN_Q4_K> : KStage {
    struct Block {
        float dw, dmin;
        int sc, mn;
        int q[8];

        __device__ __forceinline__ void load(const uint8_t *row, int c)
        {
            const uint8_t *wb = row + (size_t)(c / 8) * sizeof(struct kern_block_q4_k);   /* 4-byte aligned */
            const int sub = c % 8;
            const uint32_t dm = ld32(wb);
            dw = kc_half(dm);
            dmin = kc_half(dm >> 16);
            /* the 12 scale bytes as k_scale_min reads them */
            const uint32_t s0 = ld32(wb + 4), s1 = ld32(wb + 8), s2 = ld32(wb + 12);
            const uint32_t sb[12] = { s0 & 255, s0 >> 8 & 255, s0 >> 16 & 255, s0 >> 24,
                                      s1 & 255, s1 >> 8 & 255, s1 >> 16 & 255, s1 >> 24,
                                      s2 & 255, s2 >> 8 & 255, s2 >> 16 & 255, s2 >> 24 };
            if (sub < 4) {
                sc = (int)(sb[sub] & 63);
                mn = (int)(sb[sub + 4] & 63);
            } else {
                sc = (int)((sb[sub + 4] & 0x0F) | (sb[sub - 4] >> 6) << 4);
                mn = (int)((sb[sub + 4] >> 4) | (sb[sub] >> 6) << 4);
            }
            const uint8_t *qs = wb + 16 + 32 * (sub / 2);
            const int shift = 4 * (sub & 1);
#pragma unroll
            for (int j = 0; j < 8; j++)
                q[j] = (int)((ld32(qs + 4 * j) >> shift) & 0x0F0F0F0Fu);
        }

        __device__ __forceinline__ float add_to(const Q8KAct &a, float sum) const
        {
            int si = 0;
#pragma unroll
            for (int j = 0; j < 8; j++)
                si = __dp4a(q[j], a.q[j], si);
            const float t = __fmul_rn(__fmul_rn(dw, a.da), (float)(sc * si));
            const float m = __fmul_rn(__fmul_rn(dmin, a.da), (float)(mn * (a.s0 + a.s1)));
            return __fsub_rn(__fadd_rn(sum, t), m);
        }
    };
};

/* Q6_K: element = d * scale[e / 16] * (code - 32) (6-bit codes, int8 scales
 * per 16): sum + d*da*(sc0 * isum0 + sc1 * isum1) over the sub-block's halves. */
template <> struct Weights<KERN_Q6_K> : KStage {
    struct Block {
        float dw;
        int sc0, sc1;
        int q[8];               /* codes 0..63 */

        __device__ __forceinline__ void load(const uint8_t *row, int c)
        {
            const uint8_t *wb = row + (size_t)(c / 8) * sizeof(struct kern_block_q6_k);   /* 2-byte aligned */
            const int sub = c % 8, h = sub / 4, quarter = sub % 4;
            uint32_t lo[8], hi[8];
            ld_words8(wb + 64 * h + 32 * (quarter & 1), lo);    /* ql: qh follows */
            ld_words8(wb + 128 + 32 * h, hi);                   /* qh: the scales follow */
            const int lsh = 4 * (quarter >> 1), hsh = 2 * quarter;
#pragma unroll
            for (int j = 0; j < 8; j++)
                q[j] = (int)(((lo[j] >> lsh) & 0x0F0F0F0Fu) | (((hi[j] >> hsh) & 0x03030303u) << 4));
            const uint32_t s = ld16(wb + 192 + 2 * sub);
            sc0 = (int)(int8_t)(s & 255);
            sc1 = (int)(int8_t)(s >> 8);
            dw = kc_half(ld16(wb + 208));
        }

        __device__ __forceinline__ float add_to(const Q8KAct &a, float sum) const
        {
            int i0 = 0, i1 = 0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                i0 = __dp4a(q[j], a.q[j], i0);
                i1 = __dp4a(q[j + 4], a.q[j + 4], i1);
            }
            const int si = sc0 * (i0 - 32 * a.s0) + sc1 * (i1 - 32 * a.s1);
            return __fadd_rn(sum, __fmul_rn(__fmul_rn(dw, a.da), (float)si));
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
    constexpr bool SUPER = Weights<WT>::SUPER;     /* AB bytes per 8 blocks (super-block) */
    constexpr int UNITS = SUPER ? (4 * AB + 15) / 16 : (32 * AB + 15) / 16;    /* per token, a whole chunk */
    const int bytes = SUPER ? (nblk + 7) / 8 * AB : nblk * AB;
    const uint8_t *src0 = p.act + (size_t)t0 * p.act_stride + (size_t)(SUPER ? c0 / 8 : c0) * AB;
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

/* Q8_K as kern_quantize_act: one warp per super-block of 256, lane l holding
 * elements l + 32 i. The scale comes from the element of largest magnitude
 * (the first of equals): iscale = -127 / that element, codes rounded to
 * nearest even and capped at 127, d = 1 / iscale; an all-zero block is all
 * zeros. The sums of each 16 codes are summed in half-warps. */
__global__ void __launch_bounds__(128) quantize_q8_k(const float *x, size_t ldx, uint8_t *dst, size_t dst_stride,
                                                     int nb, int T)
{
    const int lane = threadIdx.x % 32;
    const long idx = (long)blockIdx.x * 4 + threadIdx.x / 32;
    if (idx >= (long)nb * T)
        return;                 /* a whole warp */
    const long t = idx / nb;
    const int b = (int)(idx % nb);
    const float *src = x + (size_t)t * ldx + (size_t)b * 256;
    uint8_t *blk = dst + (size_t)t * dst_stride + (size_t)b * sizeof(struct kern_block_q8_k);
    float v[8], amax = 0.0f, max = 0.0f;
    int at = INT_MAX;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        v[i] = src[lane + 32 * i];
        const float a = fabsf(v[i]);
        if (a > amax) {
            amax = a;
            max = v[i];
            at = lane + 32 * i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float oa = __shfl_xor_sync(KCUDA_FULL, amax, o), om = __shfl_xor_sync(KCUDA_FULL, max, o);
        const int oat = __shfl_xor_sync(KCUDA_FULL, at, o);
        if (oa > amax || (oa == amax && oat < at)) {
            amax = oa;
            max = om;
            at = oat;
        }
    }
    if (amax == 0.0f) {
        for (int i = lane; i < (int)sizeof(struct kern_block_q8_k); i += 32)
            blk[i] = 0;
        return;
    }
    const float iscale = __fdiv_rn(-127.0f, max);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        /* round half to even by the twin's magic number, then capped */
        const float r = __fadd_rn(__fmul_rn(iscale, v[i]), 12582912.0f);
        int q = (int)(__float_as_uint(r) & 0x007fffffu) - 0x00400000;
        q = q < -128 ? -128 : q > 127 ? 127 : q;
        blk[4 + lane + 32 * i] = (uint8_t)(int8_t)q;
        int s = q;              /* the 16-sum of group 2i + lane / 16 */
#pragma unroll
        for (int o = 8; o > 0; o >>= 1)
            s += __shfl_xor_sync(KCUDA_FULL, s, o);
        if (lane % 16 == 0) {
            const int g = 2 * i + lane / 16;
            const uint16_t u = (uint16_t)(int16_t)s;
            blk[260 + 2 * g] = (uint8_t)u;
            blk[261 + 2 * g] = (uint8_t)(u >> 8);
        }
    }
    if (lane == 0) {
        const uint32_t d = __float_as_uint(__fdiv_rn(1.0f, iscale));
        blk[0] = (uint8_t)d;
        blk[1] = (uint8_t)(d >> 8);
        blk[2] = (uint8_t)(d >> 16);
        blk[3] = (uint8_t)(d >> 24);
    }
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
    case KERN_Q5_0:
        if (a->n % 32 || a->row_bytes < row_bytes_of(KERN_Q5_0, a->n) ||
            a->act_stride < row_bytes_of(KERN_Q8_0, a->n) || (wa | a->row_bytes) % 2)
            return KVD_EINVAL;
        return 0;
    case KERN_Q4_K: case KERN_Q6_K:
        /* Q6_K rows may start 2 bytes into a word: the first row must not */
        if (a->n % 256 || a->row_bytes < row_bytes_of(a->wtype, a->n) ||
            a->act_stride < row_bytes_of(KERN_Q8_K, a->n) || wa % 4 ||
            a->row_bytes % (a->wtype == KERN_Q4_K ? 4 : 2))
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
    case KERN_Q5_0: launch_type<KERN_Q5_0>(shape, p, grid, stream); break;
    case KERN_Q4_K: launch_type<KERN_Q4_K>(shape, p, grid, stream); break;
    case KERN_Q6_K: launch_type<KERN_Q6_K>(shape, p, grid, stream); break;
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
    if (act_type == KERN_Q8_K) {
        if (n % 256 || ldx < (size_t)n || dst_stride < row_bytes_of(act_type, n))
            return KVD_EINVAL;
        const long blocks = (long)(n / 256) * T;
        quantize_q8_k<<<(unsigned)((blocks + 3) / 4), 128, 0, stream>>>(x, ldx, static_cast<uint8_t *>(dst),
                                                                       dst_stride, (int)(n / 256), T);
        return kcuda__launched("activation quantization");
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
