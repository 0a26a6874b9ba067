/* gemm_neon_i8mm.c - the packed products with smmla for token pairs, sdot for
 * the rest (gemm_neon.inc); built with +dotprod+i8mm. */
#if defined(__aarch64__)
#define NEON_FN kern_gemm_packed_i8mm
#define NEON_I8MM 1
#include "gemm_neon.inc"
#endif
