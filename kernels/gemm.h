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

struct kern_gemm_args {
    uint32_t wtype;         /* weight type */
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
};

/* Bytes of per-thread scratch a product over rows of n elements and T tokens needs. */
size_t kern_gemm_scratch_bytes(int64_t n, int T);

/* Computes the product on the active path. */
void kern_gemm(const struct kern_gemm_args *a);

/* The same on a given path (tests compare paths). */
void kern_gemm_isa(const struct kern_gemm_args *a, int isa);

/* The per-path implementations (x86 only; they return false for a weight
 * type or size they do not handle, and the caller falls back to C). */
bool kern_gemm_avx2(const struct kern_gemm_args *a);
bool kern_gemm_avx512vnni(const struct kern_gemm_args *a);

#endif
