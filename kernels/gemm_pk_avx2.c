/* gemm_pk_avx2.c - the packed products with AVX2 (gemm_pk256.inc). */
#if defined(__x86_64__)
#define PK256_FN kern_gemm_packed_avx2
#define PK256_VNNI 0
#include "gemm_pk256.inc"
#endif
