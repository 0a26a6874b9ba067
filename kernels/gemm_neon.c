/* gemm_neon.c - the packed products with sdot (gemm_neon.inc); built with +dotprod. */
#if defined(__aarch64__)
#define NEON_FN kern_gemm_packed_neon
#define NEON_I8MM 0
#include "gemm_neon.inc"
#endif
