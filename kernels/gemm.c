/* gemm.c - dispatch of the matrix products, and the portable path. */
#include "gemm.h"

#include "cpu.h"
#include "quant.h"

size_t kern_gemm_scratch_bytes(int64_t n, int T)
{
    /* unpacked row: n bytes of codes, n floats (float types), n/16 + n/32
     * scales; activations: T * n/32 scales and sums, n/32 offsets, T * n
     * bytes of values, T * n/64 pair-scale vectors of 16 floats; rounded up
     * per part to 64 bytes */
    size_t nb = (size_t)(n + 31) / 32;
    return (size_t)n + 64 + (size_t)n * 4 + 64 + (2 * nb + nb) * 4 + 192 +
           (size_t)T * nb * 8 + 128 + nb * 4 + 64 + (size_t)T * (size_t)n + 64 +
           (size_t)T * nb * 32 + 64;
}

static void gemm_c(const struct kern_gemm_args *a)
{
    for (long r = a->r0; r < a->r1; r++) {
        const uint8_t *wr = a->w + (size_t)r * a->row_bytes;
        for (int t = 0; t < a->T; t++) {
            float d = kern_vec_dot(a->wtype, a->n, wr, a->act + (size_t)t * a->act_stride);
            float *o = a->out + (size_t)t * a->ldo + r;
            *o = a->add ? *o + d : d;
        }
    }
}

void kern_gemm_isa(const struct kern_gemm_args *a, int isa)
{
#if defined(__x86_64__)
    if (isa >= KERN_ISA_AVX512VNNI && kern_gemm_avx512vnni(a))
        return;
    if (isa >= KERN_ISA_AVX2 && kern_gemm_avx2(a))
        return;
#endif
    gemm_c(a);
}

void kern_gemm(const struct kern_gemm_args *a)
{
    kern_gemm_isa(a, kern_isa());
}
