/*
 * gemm.h - the matrix products of the forward pass.
 *
 * kern_gemm() multiplies a range of weight rows with a batch of activation
 * rows on the instruction-set path kern_isa() chose. Each weight row is read
 * (and unpacked) once for all tokens; tokens go through in tiles that share
 * the unpacked row, but every (row, token) result is made by the same
 * instructions in the same order whatever the tile, the batch or the row
 * range: a token's output depends only on its own activation row.
 */
#ifndef KVD_KERN_GEMM_H
#define KVD_KERN_GEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "types.h"

/*
 * A weight matrix repacked for the packed products (AVX-512 VNNI, and in
 * 256-bit registers AVX-VNNI and AVX2; on aarch64 sdot and smmla in 128-bit
 * ones; Q4_1 and Q8_0 weights;
 * Q4_0 and Q5_0 ones as Q8_0: their signed codes and scales fit it exactly;
 * on x86-64 without AMX tiles, Q4_0 and Q5_0 in four and five bits, and on
 * AVX-512 VNNI the K-quants in their files' widths, below: kern_pack_narrow).
 * Rows go in groups of KERN_PACK_ROWS = 16 (the last group padded with zero
 * rows). Within a group, block b (32 values) of all 16 rows is stored as
 * 64-byte slices: slice s holds, for row i, four bytes at 4i, so one load
 * gives 16 rows' worth of one four-value group and one dpbusd against a
 * broadcast four activation bytes yields 16 rows' partial dot products (a
 * 256-bit load takes half a slice: 8 rows).
 *   Q4_1: codes nb x 4 slices (slice j, row i = bytes qs[4j..4j+3] of row i's
 *         block: values 4j.. in the low nibbles, 16+4j.. in the high ones),
 *         then the 16 scales d of every block (f16), then the 16 mins m;
 *   Q8_0: codes nb x 8 slices (slice k, row i = qs[4k..4k+3] + 128, so the
 *         codes are unsigned), then the 16 scales d of every block (f16).
 *   Q4_0: Q4_1's code layout with the codes value + 8 (0..15), then the 16
 *         scales d of every block (f16); no mins: a block's integer sum
 *         starts at -8 x the sum of its activations (as Q8_0's at -128 x it).
 *         0.56 bytes a value against Q8_0's 1.06.
 *   Q5_0: per block Q4_1's nibble layout of the codes' low four bits (code =
 *         value + 16, 0..31), then their fifth bits as eight 64-bit masks
 *         (mask k, bit 4i + x = bit 4 of row i's value 4k + x: Q8_0's slice
 *         k), 320 bytes; then the 16 scales d of every block (f16). 0.69
 *         bytes a value against Q8_0's 1.06: decode reads that much less.
 *         The products read the codes in place where a group meets a few
 *         tokens, and widen it to Q8_0's layout for more; either way they
 *         run Q8_0's steps: the same integer sums, so the same bits.
 * The K-quants are packed from their unpacked form (kern_unpack_row: codes,
 * and float scales per 32 values, per 16 for Q6_K), with float scales
 * (d * sc is not exact in f16):
 *   Q4_K: Q4_1's code layout, then the 16 scales of every block (f32), then
 *         the 16 mins (f32: -dmin * m);
 *   Q5_K: Q8_0's code layout with the codes 0..31 as they are, then scales
 *         and mins as Q4_K's;
 *   Q6_K: Q8_0's code layout with codes q + 32 (0..63), then per block the
 *         16 scales of its first 16 values and the 16 of its last (f32).
 *   Q4_K with the file's scales (layout KERN_PK_Q4_KS, where kern_pack_narrow
 *         says so): Q4_1's code layout, then per block the 16 rows' 6-bit
 *         scales sc (a byte each), then their minimums m (16 bytes); then per
 *         256 values (8 blocks) the 16 rows' d and then their dmin (f16, 64
 *         bytes). 0.58 bytes a value against 0.75; the scale is d * sc and the
 *         min -dmin * m in f32, both exact, so the float steps are Q4_K's.
 *   Q5_K in five bits with the file's scales (layout KERN_PK_Q5_KS, where
 *         kern_pack_narrow says so): five-bit Q5_0's code layout with the
 *         codes as they are (0..31), 320 bytes; then scales, mins, d and
 *         dmin as KERN_PK_Q4_KS's. 0.70 bytes a value against 1.25.
 *   Q6_K in six bits (layout KERN_PK_Q6_K6, where kern_pack_narrow says so):
 *         per block Q4_1's nibble layout of the codes' low four bits, then
 *         their high two bits as two 64-byte vectors (the first for the
 *         block's values 0-15, the second for 16-31; in each, byte 4i + x
 *         holds at bits 2j, 2j + 1 those of row i's value 4j + x of its
 *         half), 384 bytes; then per block the file's int8 scales of its two
 *         halves (16 rows each, 32 bytes); then per 256 values (8 blocks)
 *         the 16 rows' super-block scales d (f16, 32 bytes). 0.82 bytes a
 *         value, the file's, against 1.25. A half's scale is d * sc in f32,
 *         exact (11 by 8 bits), so the float steps are the byte layout's.
 *         The products read it in place for a few tokens, and widen a group
 *         to the byte layout for more.
 * Per (row, token) the packed product is
 *   f = 0; for each block b, for each part p (Q6_K: its two halves, else the block):
 *            f = fma(float(isum_bp), d_w[b][p] * d_a[b], f)
 *          then with mins (Q4_1, Q4_K, Q5_K): f = fma(m_w[b], s_a[b], f)
 * with isum_bp exact in int32, whatever rows or tokens share the instructions.
 */
#define KERN_PACK_ROWS 16

/* The narrow K-quant layouts' ids in struct kern_packed's wtype (not GGUF
 * types), and the type each packs. */
#define KERN_PK_Q4_KS (0x100u | KERN_Q4_K)
#define KERN_PK_Q5_KS (0x100u | KERN_Q5_K)
#define KERN_PK_Q6_K6 (0x100u | KERN_Q6_K)
static inline uint32_t kern_pk_source(uint32_t layout) { return layout & 0xFFu; }
/* The narrow layout of a type (its own id for Q4_0 and Q5_0). */
static inline uint32_t kern_pk_narrow_layout(uint32_t wtype)
{
    return wtype == KERN_Q4_K || wtype == KERN_Q5_K || wtype == KERN_Q6_K ? 0x100u | wtype : wtype;
}

/* The packed layouts, per block of 32 values of a group of 16 rows: whether
 * its codes are nibbles, its integer sums (parts), and its bytes of codes,
 * scales (all parts) and mins. */
static inline bool kern_pk_nibbles(uint32_t wtype)
{
    return wtype == KERN_Q4_1 || wtype == KERN_Q4_K || wtype == KERN_Q4_0 || wtype == KERN_PK_Q4_KS;
}
static inline bool kern_pk_f32(uint32_t wtype) { return wtype == KERN_Q4_K || wtype == KERN_Q5_K || wtype == KERN_Q6_K; }
static inline bool kern_pk_mins(uint32_t wtype)
{
    return wtype == KERN_Q4_1 || wtype == KERN_Q4_K || wtype == KERN_Q5_K || wtype == KERN_PK_Q4_KS ||
           wtype == KERN_PK_Q5_KS;
}
/* the layouts with a byte of scale and of min per block and f16 d, dmin per 8 */
static inline bool kern_pk_ks(uint32_t wtype) { return wtype == KERN_PK_Q4_KS || wtype == KERN_PK_Q5_KS; }
/* Q6_K's two layouts: byte codes + 32 and halves of 16 values */
static inline bool kern_pk_q6(uint32_t wtype) { return wtype == KERN_Q6_K || wtype == KERN_PK_Q6_K6; }
static inline int kern_pk_parts(uint32_t wtype) { return kern_pk_q6(wtype) ? 2 : 1; }
static inline size_t kern_pk_code_bytes(uint32_t wtype)
{
    return kern_pk_nibbles(wtype)                           ? 256
           : wtype == KERN_Q5_0 || wtype == KERN_PK_Q5_KS ? 320
           : wtype == KERN_PK_Q6_K6                        ? 384
                                                           : 512;
}
/* (the narrow K-quants: their bytes of sc and m; their f16 d (and dmin) per
 * 8 blocks come after all blocks' scales and mins: kern_pk_super_bytes) */
static inline size_t kern_pk_scale_bytes(uint32_t wtype)
{
    if (wtype == KERN_PK_Q6_K6 || kern_pk_ks(wtype))
        return wtype == KERN_PK_Q6_K6 ? 32 : 16;
    return (kern_pk_f32(wtype) ? 64 : 32) * (size_t)kern_pk_parts(wtype);
}
static inline size_t kern_pk_min_bytes(uint32_t wtype)
{
    return kern_pk_ks(wtype) ? 16 : kern_pk_mins(wtype) ? (kern_pk_f32(wtype) ? 64 : 32) : 0;
}
static inline size_t kern_pk_super_bytes(uint32_t wtype)
{
    return wtype == KERN_PK_Q6_K6 ? 32 : kern_pk_ks(wtype) ? 64 : 0;
}

struct kern_packed {
    uint32_t wtype;         /* the layout: KERN_Q4_1, KERN_Q8_0, KERN_Q4_0, KERN_Q5_0, KERN_Q4_K, KERN_Q5_K,
                             * KERN_Q6_K, KERN_PK_Q4_KS, KERN_PK_Q5_KS or KERN_PK_Q6_K6 */
    int64_t rows, n;        /* the matrix: rows x n */
    size_t group_bytes;     /* bytes per group of 16 rows (a multiple of 64) */
    uint8_t *data;          /* ceil(rows / 16) groups, 64-byte aligned */
};

/* Packs a weight matrix (rows of row_bytes) when this CPU's best path has a
 * packed product for its type and n is a whole number of blocks; else NULL
 * (also on out of memory: the caller keeps using the rows in place). */
struct kern_packed *kern_pack(uint32_t wtype, const void *w, size_t row_bytes, int64_t rows, int64_t n);

void kern_pack_free(struct kern_packed **p);

/* Whether kern_pack stores wtype in its own width rather than in bytes
 * (Q4_0 and Q5_0 as Q8_0's): Q4_0 in four bits where the active path is
 * AVX-512 VNNI or the 256-bit one (they read nibbles as they read Q4_1's),
 * Q5_0 in five bits, Q6_K in six, Q5_K in five and Q4_K with their file's
 * scales on AVX-512 VNNI; none where the AVX-512
 * path runs AMX tiles (they read bytes) nor on aarch64. The layouts give the
 * same bits; this is a matter of bytes read. Five bits on the 256-bit paths cost about as much as the
 * fewer bytes saved (AMD EPYC, forced AVX2 path, bench-ceiling -m: the
 * decode step's products 1.05x at one token, 0.98x at eight; warm, half the
 * rate at one token: no mask registers to spread the fifth bits). */
bool kern_pack_narrow(uint32_t wtype);

/* Forces that choice: 1 narrow (x86-64 only), 0 bytes, -1 back to the
 * default; for tests and benchmarks that compare the layouts. Returns the
 * setting it replaces. */
int kern_pack_narrow_set(int choice);

/* Bytes a packed matrix holds. */
size_t kern_pack_bytes(const struct kern_packed *p);

struct kern_gemm_args {
    uint32_t wtype;         /* weight type */
    const struct kern_packed *packed; /* the same matrix packed, or NULL */
    const uint8_t *w;       /* row 0 of the weight matrix */
    size_t row_bytes;       /* bytes per weight row */
    int64_t n;              /* elements per row (input features) */
    long r0, r1;            /* the rows [r0, r1) to compute */
    const uint8_t *act;     /* T rows of type kern_vec_dot_type(wtype) */
    size_t act_stride;      /* bytes between activation rows */
    int T;                  /* tokens */
    float *out;             /* out[t * ldo + r] */
    size_t ldo;             /* floats between output rows */
    bool add;               /* accumulate into out instead of storing */
    void *scratch;          /* kern_gemm_scratch_bytes(n, T) bytes, 32-aligned, one per thread */
    bool staged;            /* the scratch holds what the previous call on it staged, for the
                             * same matrix, activations and T (a range cut in chunks): the
                             * packed products skip staging the activations again */
};

/* Bytes of per-thread scratch a product over rows of n elements and T tokens needs. */
size_t kern_gemm_scratch_bytes(int64_t n, int T);

/* Computes the product on the active path: the packed matrix where one is
 * given (AVX-512 VNNI, AVX-VNNI or AVX2), else the rows in place. */
void kern_gemm(const struct kern_gemm_args *a);

/* The same on a given path (tests compare paths). */
void kern_gemm_isa(const struct kern_gemm_args *a, int isa);

/* The per-path implementations (each on its architecture only; they return false for a weight
 * type or size they do not handle, and the caller falls back to C). */
bool kern_gemm_avx2(const struct kern_gemm_args *a);
bool kern_gemm_avx512vnni(const struct kern_gemm_args *a);
bool kern_gemm_packed_vnni(const struct kern_gemm_args *a);
/* The packed products on AMX tiles (gemm_amx.c), from KERN_AMX_MIN_T tokens
 * on where kern_amx() says so: the same bits as kern_gemm_packed_vnni's (they
 * take any T; below the threshold the vector products are faster). */
#define KERN_AMX_MIN_T 16
bool kern_gemm_packed_amx(const struct kern_gemm_args *a);
/* Loads the tile configurations the AMX products use, reads each back and
 * says whether it holds what was loaded; releases the tiles. */
bool kern_amx_config_check(void);
/* The packed products in 256-bit registers (gemm_pk256.inc): the same bits as
 * kern_gemm_packed_vnni's. */
bool kern_gemm_packed_avx2(const struct kern_gemm_args *a);
bool kern_gemm_packed_avxvnni(const struct kern_gemm_args *a);
/* The packed products on aarch64 (gemm_neon.inc), the same bits again: sdot,
 * and smmla for token pairs. */
bool kern_gemm_packed_neon(const struct kern_gemm_args *a);
bool kern_gemm_packed_i8mm(const struct kern_gemm_args *a);

#endif
