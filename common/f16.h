/*
 * f16.h - IEEE half and bfloat16 conversions, shared by every module.
 *
 * Portable bit manipulation (no F16C dependency) so that results are the same
 * on every x86 and ARM build; the SIMD kernels may use hardware conversion,
 * which rounds identically (round to nearest even).
 */
#ifndef KVD_F16_H
#define KVD_F16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t kvd_f16;  /* IEEE 754 binary16 bits */
typedef uint16_t kvd_bf16; /* bfloat16 bits (upper half of an f32) */

static inline float kvd_f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t kvd_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Half to float, exact for every input (subnormals, inf, NaN included). */
static inline float kvd_f16_to_f32(kvd_f16 h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {
        /* subnormal: value = man * 2^-24 */
        float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    return kvd_f32_from_bits(u);
}

/* Float to half with round-to-nearest-even; overflow gives inf, NaN stays NaN. */
static inline kvd_f16 kvd_f32_to_f16(float f)
{
    uint32_t u = kvd_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u)                     /* inf or NaN */
        return (kvd_f16)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));
    if (a >= 0x477ff000u)                     /* rounds to >= 65536: inf */
        return (kvd_f16)(sign | 0x7c00u);
    if (a < 0x38800000u) {                    /* below 2^-14: subnormal or zero */
        uint32_t shift = 126u - (a >> 23);    /* 14..126 */
        if (shift > 24)
            return (kvd_f16)sign;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u)))
            r++;
        return (kvd_f16)(sign | r);
    }
    uint32_t r = a - 0x38000000u;             /* rebias exponent 127 -> 15 */
    uint32_t h = r >> 13;
    uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++;
    return (kvd_f16)(sign | h);
}

static inline float kvd_bf16_to_f32(kvd_bf16 b) { return kvd_f32_from_bits((uint32_t)b << 16); }

#endif
