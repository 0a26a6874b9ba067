/* cpu.c - instruction-set probing and the KVD_ISA override. */
#include "cpu.h"

#include <stdlib.h>
#include <string.h>

static int active = -1;     /* enum kern_isa once chosen */

enum kern_isa kern_isa_best(void)
{
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return KERN_ISA_AVX512VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return KERN_ISA_AVX2;
#endif
    return KERN_ISA_C;
}

enum kern_isa kern_isa_set(enum kern_isa isa)
{
    enum kern_isa best = kern_isa_best();
    int a = (int)(isa < best ? isa : best);
    __atomic_store_n(&active, a, __ATOMIC_RELEASE);
    return (enum kern_isa)a;
}

enum kern_isa kern_isa(void)
{
    int a = __atomic_load_n(&active, __ATOMIC_ACQUIRE);
    if (a >= 0)
        return (enum kern_isa)a;
    enum kern_isa want = KERN_ISA_AVX512VNNI;
    const char *env = getenv("KVD_ISA");
    if (env != NULL) {
        if (strcmp(env, "c") == 0)
            want = KERN_ISA_C;
        else if (strcmp(env, "avx2") == 0)
            want = KERN_ISA_AVX2;
    }
    enum kern_isa best = kern_isa_best();
    a = (int)(want < best ? want : best);
    __atomic_store_n(&active, a, __ATOMIC_RELEASE);
    return (enum kern_isa)a;
}

const char *kern_isa_name(enum kern_isa isa)
{
    switch (isa) {
    case KERN_ISA_AVX2: return "avx2";
    case KERN_ISA_AVX512VNNI: return "avx512vnni";
    default: return "c";
    }
}
