/*
 * attn512.h - what the AVX-512 attention kernels (attn_avx512.c,
 * attn_amx.c) share: which positions of a group of sixteen attention reads.
 * Include only from files built for AVX-512.
 */
#ifndef KVD_KERN_ATTN512_H
#define KVD_KERN_ATTN512_H

#include <immintrin.h>
#include <stdint.h>

/* The lanes of positions j0 .. j0 + 15 that attention reads: inside the
 * context and, in a sliding window, from skip on. */
static inline __mmask16 live16(int j0, int n, int skip)
{
    uint32_t m = n - j0 >= 16 ? 0xFFFFu : (1u << (n - j0)) - 1u;
    if (j0 < skip)
        m &= skip - j0 >= 16 ? 0u : 0xFFFFu << (skip - j0);
    return (__mmask16)m;
}

#endif
