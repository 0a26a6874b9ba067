/* gemm_avx512.c - the x86 matrix products with AVX-512 VNNI (256-bit dpbusd). */
#if defined(__x86_64__)
#define GEMM_FN kern_gemm_avx512vnni
#define GEMM_VNNI 1
#include "gemm_x86.inc"
#endif
