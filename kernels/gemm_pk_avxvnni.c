/* gemm_pk_avxvnni.c - the packed products with AVX-VNNI's vpdpbusd ymm (gemm_pk256.inc). */
#if defined(__x86_64__)
#define PK256_FN kern_gemm_packed_avxvnni
#define PK256_VNNI 1
#include "gemm_pk256.inc"
#endif
