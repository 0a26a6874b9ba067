/*
 * types.h - tensor element types, numbered as GGUF numbers them.
 *
 * Every weight, activation and KV buffer in kvd names its type with one of
 * these. kern_type_info() gives the block geometry that GGUF sizes follow:
 * a row of n elements of type t takes n / block_elems * block_bytes bytes.
 *
 * It lives in common/ (the ground floor) rather than beside the kernels that
 * compute on these types, so that the pool, the KV formats and the
 * coordinator can name a type without reaching into kernels/.
 */
#ifndef KVD_TYPES_H
#define KVD_TYPES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum kern_type {
    KERN_F32 = 0,
    KERN_F16 = 1,
    KERN_Q4_0 = 2,
    KERN_Q4_1 = 3,
    KERN_Q5_0 = 6,
    KERN_Q5_1 = 7,
    KERN_Q8_0 = 8,
    KERN_Q8_1 = 9,
    KERN_Q2_K = 10,
    KERN_Q3_K = 11,
    KERN_Q4_K = 12,
    KERN_Q5_K = 13,
    KERN_Q6_K = 14,
    KERN_Q8_K = 15,
    KERN_I8 = 24,
    KERN_I16 = 25,
    KERN_I32 = 26,
    KERN_I64 = 27,
    KERN_F64 = 28,
    KERN_BF16 = 30,
    KERN_TYPE_LIMIT = 64, /* ids at or above this are never valid */
};

/* The largest attention head kvd takes: the kernels' scratch and the KV
 * formats' rotation are sized by it. */
#define KERN_MAX_HEAD_DIM 512

struct kern_type_info {
    const char *name;       /* "Q4_1" */
    uint32_t block_elems;   /* elements per block (1 for plain types) */
    uint32_t block_bytes;   /* bytes per block */
    bool weight_ok;         /* kvd can use it as a weight matrix */
};

/* Returns the geometry of a type GGUF may name, or NULL for an id that no
 * GGUF writer uses (the caller reports it as a format error). */
const struct kern_type_info *kern_type_info(uint32_t type);

/* Bytes of a row of n elements; 0 when n is not a multiple of the block. */
size_t kern_row_bytes(uint32_t type, int64_t n);

#endif
