/*
 * quant_blocks.h - the quantized block formats, byte for byte as GGUF stores them.
 *
 * One header for the C kernels and the CUDA kernels (plain structs of fixed
 * width integers, nothing nvcc or a C++ compiler would reject). A tensor row
 * of a block type is an array of these structs with no padding between them;
 * the sizes are an on-disk ABI and are pinned by static_assert below.
 *
 * Conventions used in the layout notes:
 *   - "f16" fields hold IEEE binary16 bits (kvd_f16), converted with f16.h.
 *   - Element i of a block is its i-th value in row order.
 *   - A 4-bit "nibble" pair byte b holds two codes: b & 0x0F and b >> 4.
 *   - All multi-byte fields are little-endian (GGUF is little-endian only).
 */
#ifndef KVD_KERN_QUANT_BLOCKS_H
#define KVD_KERN_QUANT_BLOCKS_H

#include <assert.h>
#include <stdint.h>

#include "f16.h"

#define KERN_QK32 32   /* elements per block of the Q4/Q5/Q8 families */
#define KERN_QK_K 256  /* elements per super-block of the K family */
#define KERN_K_SCALE_BYTES 12 /* packed 6-bit scales+mins of Q4_K/Q5_K */

/*
 * Q4_0: 32 elements, 18 bytes. One scale d. Byte qs[j] (j < 16) holds the
 * code of element j in its low nibble and of element j+16 in its high
 * nibble; the codes are unsigned 0..15 with an implicit offset of 8:
 *     x = d * (code - 8)
 */
struct kern_block_q4_0 {
    kvd_f16 d;                      /* scale (f16) */
    uint8_t qs[KERN_QK32 / 2];      /* 32 4-bit codes, see above */
};

/*
 * Q4_1: 32 elements, 20 bytes. Like Q4_0 but with a minimum instead of the
 * fixed offset:  x = d * code + m   (code 0..15).
 */
struct kern_block_q4_1 {
    kvd_f16 d;                      /* scale (f16) */
    kvd_f16 m;                      /* minimum, added to every element (f16) */
    uint8_t qs[KERN_QK32 / 2];      /* 32 4-bit codes, same order as Q4_0 */
};

/*
 * Q5_0: 32 elements, 22 bytes. 5-bit codes: the low 4 bits are packed in qs
 * exactly as in Q4_0; the fifth bit of element i is bit i of the 32-bit
 * little-endian word qh. Codes 0..31 with an implicit offset of 16:
 *     x = d * (code - 16)
 */
struct kern_block_q5_0 {
    kvd_f16 d;                      /* scale (f16) */
    uint8_t qh[4];                  /* bit i = bit 4 of element i's code */
    uint8_t qs[KERN_QK32 / 2];      /* low 4 bits, Q4_0 order */
};

/*
 * Q5_1: 32 elements, 24 bytes. Q5_0's codes with a minimum:
 *     x = d * code + m   (code 0..31).
 */
struct kern_block_q5_1 {
    kvd_f16 d;                      /* scale (f16) */
    kvd_f16 m;                      /* minimum (f16) */
    uint8_t qh[4];                  /* bit i = bit 4 of element i's code */
    uint8_t qs[KERN_QK32 / 2];      /* low 4 bits, Q4_0 order */
};

/*
 * Q8_0: 32 elements, 34 bytes. x = d * qs[i] with qs signed 8-bit, in
 * element order. Used for weights and for the activations that Q4_0, Q5_0
 * and Q8_0 weights are multiplied with.
 */
struct kern_block_q8_0 {
    kvd_f16 d;                      /* scale (f16) */
    int8_t qs[KERN_QK32];           /* element i */
};

/*
 * Q8_1: 32 elements, 36 bytes. Q8_0 plus s = d * sum(qs), precomputed so
 * that a dot product with a Q4_1/Q5_1 row can add that row's minimum times
 * the activation sum without touching the elements. Activation format only.
 */
struct kern_block_q8_1 {
    kvd_f16 d;                      /* scale (f16) */
    kvd_f16 s;                      /* d * sum of qs, rounded to f16 */
    int8_t qs[KERN_QK32];           /* element i */
};

/*
 * Q4_K: 256 elements in 8 sub-blocks of 32, 144 bytes. Each sub-block k has
 * a 6-bit scale sc[k] and a 6-bit minimum mn[k], themselves scaled by the
 * super-block's d and dmin:
 *     x = (d * sc[k]) * code - (dmin * mn[k])     (code 0..15)
 * The 12 scale bytes pack the sixteen 6-bit values: for k < 4,
 * scales[k] = sc[k] (low 6 bits) and scales[k+4] = mn[k] (low 6 bits); for
 * k >= 4 the low 4 bits of sc[k] and mn[k] sit in the low and high nibble of
 * scales[k+4], and their top 2 bits in the top 2 bits of scales[k-4] (sc)
 * and scales[k] (mn).
 * The codes come in 4 chunks of 32 bytes: chunk c (qs[32c .. 32c+31]) holds
 * sub-block 2c in its low nibbles and sub-block 2c+1 in its high nibbles,
 * byte l of the chunk holding element l of each.
 */
struct kern_block_q4_k {
    kvd_f16 d;                      /* super-block scale of the sub-block scales (f16) */
    kvd_f16 dmin;                   /* super-block scale of the sub-block minimums (f16) */
    uint8_t scales[KERN_K_SCALE_BYTES]; /* 8 scales + 8 minimums, 6 bits each, see above */
    uint8_t qs[KERN_QK_K / 2];      /* 256 4-bit codes, see above */
};

/*
 * Q5_K: 256 elements, 176 bytes. Q4_K with a fifth code bit: the low 4 bits
 * are packed like Q4_K's qs, and the fifth bit of element l of sub-block k
 * is bit k of qh[l] (l < 32). Same scales and formula, code 0..31.
 */
struct kern_block_q5_k {
    kvd_f16 d;                      /* super-block scale of the sub-block scales (f16) */
    kvd_f16 dmin;                   /* super-block scale of the sub-block minimums (f16) */
    uint8_t scales[KERN_K_SCALE_BYTES]; /* as in Q4_K */
    uint8_t qh[KERN_QK_K / 8];      /* qh[l] bit k = bit 4 of element l of sub-block k */
    uint8_t qs[KERN_QK_K / 2];      /* low 4 bits, Q4_K order */
};

/*
 * Q6_K: 256 elements in 16 sub-blocks of 16, 210 bytes. 6-bit codes with an
 * implicit offset of 32 and a signed 8-bit scale per sub-block:
 *     x = (d * scales[i / 16]) * (code - 32)
 * The super-block is two halves of 128 elements; half h uses ql[64h ..
 * 64h+63] and qh[32h .. 32h+31]. Within a half, for l < 32:
 *     element l      : low  nibble of ql[l],    qh[l] bits 0-1 as bits 4-5
 *     element l + 32 : low  nibble of ql[l+32], qh[l] bits 2-3
 *     element l + 64 : high nibble of ql[l],    qh[l] bits 4-5
 *     element l + 96 : high nibble of ql[l+32], qh[l] bits 6-7
 * The scale d comes last in the block.
 */
struct kern_block_q6_k {
    uint8_t ql[KERN_QK_K / 2];      /* low 4 bits of the codes, see above */
    uint8_t qh[KERN_QK_K / 4];      /* high 2 bits of the codes, see above */
    int8_t scales[KERN_QK_K / 16];  /* per sub-block of 16 */
    kvd_f16 d;                      /* super-block scale (f16) */
};

/*
 * Q8_K: 256 elements, 292 bytes; the activation format of the K-quant dot
 * products. x = d * qs[i] with a full f32 scale, plus the sum of each group
 * of 16 codes (for the minimum terms of Q4_K/Q5_K). Needs 4-byte alignment.
 */
struct kern_block_q8_k {
    float d;                        /* scale (f32) */
    int8_t qs[KERN_QK_K];           /* element i */
    int16_t bsums[KERN_QK_K / 16];  /* bsums[g] = sum of qs[16g .. 16g+15] */
};

static_assert(sizeof(struct kern_block_q4_0) == 18, "Q4_0 block must be 18 bytes");
static_assert(sizeof(struct kern_block_q4_1) == 20, "Q4_1 block must be 20 bytes");
static_assert(sizeof(struct kern_block_q5_0) == 22, "Q5_0 block must be 22 bytes");
static_assert(sizeof(struct kern_block_q5_1) == 24, "Q5_1 block must be 24 bytes");
static_assert(sizeof(struct kern_block_q8_0) == 34, "Q8_0 block must be 34 bytes");
static_assert(sizeof(struct kern_block_q8_1) == 36, "Q8_1 block must be 36 bytes");
static_assert(sizeof(struct kern_block_q4_k) == 144, "Q4_K block must be 144 bytes");
static_assert(sizeof(struct kern_block_q5_k) == 176, "Q5_K block must be 176 bytes");
static_assert(sizeof(struct kern_block_q6_k) == 210, "Q6_K block must be 210 bytes");
static_assert(sizeof(struct kern_block_q8_k) == 292, "Q8_K block must be 292 bytes");

#endif
