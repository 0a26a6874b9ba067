/* gemm_avx2.c - the x86 matrix products with AVX2, FMA and F16C. */
#if defined(__x86_64__)
#define GEMM_FN kern_gemm_avx2
#include "gemm_x86.inc"
#endif
