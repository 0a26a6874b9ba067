/* cpu.c - instruction-set probing and the KVD_ISA override. */
#include "cpu.h"

#if defined(__x86_64__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int active = -1;     /* enum kern_isa once chosen */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The register state the OS saves on context switches (XCR0) covers mask. */
static bool os_saves(uint64_t mask)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((((uint64_t)hi << 32) | lo) & mask) == mask;
}
#endif

/* What the CPU offers (cpuid or HWCAP), probed once: cpuid traps to the
 * hypervisor in a virtual machine, and kern_pack asks for every matrix. */
static enum kern_isa probe_best(void)
{
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    /* cpuid rather than __builtin_cpu_supports: every compiler version knows
     * the bits, and the OS must also save the wider registers */
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return KERN_ISA_C;
    bool fma = c & (1u << 12), avx = c & (1u << 28), f16c = c & (1u << 29);
    bool osxsave = c & (1u << 27);
    if (!osxsave || !avx || !fma || !f16c || !os_saves(0x6)) /* XMM and YMM state */
        return KERN_ISA_C;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return KERN_ISA_C;
    bool avx2 = b & (1u << 5), f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30);
    bool vl = b & (1u << 31), vnni = c & (1u << 11);
    if (f && dq && bw && vl && vnni && os_saves(0xE6)) /* plus opmask and ZMM state */
        return KERN_ISA_AVX512VNNI;
    if (avx2)
        return KERN_ISA_AVX2;
#elif defined(__aarch64__) && defined(__linux__)
    /* the kernel's view of the CPU (HWCAP_ASIMDDP, HWCAP2_I8MM): the
     * instructions are usable in user space where these bits are set */
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    const bool dotprod = hw & (1ul << 20), i8mm = hw2 & (1ul << 13);
    if (dotprod && i8mm)
        return KERN_ISA_I8MM;
    if (dotprod)
        return KERN_ISA_NEON;
#endif
    return KERN_ISA_C;
}

static int best_seen = -1;  /* probe_best() once known */

enum kern_isa kern_isa_best(void)
{
    int b = __atomic_load_n(&best_seen, __ATOMIC_ACQUIRE);
    if (b < 0) {
        b = (int)probe_best();
        __atomic_store_n(&best_seen, b, __ATOMIC_RELEASE);
    }
    return (enum kern_isa)b;
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
    enum kern_isa want = KERN_ISA_TOP;
    const char *env = getenv("KVD_ISA");
    if (env != NULL) {
        if (strcmp(env, "c") == 0)
            want = KERN_ISA_C;
        else if (strcmp(env, "avx2") == 0 || strcmp(env, "neon") == 0)
            want = KERN_ISA_SIMD;
    }
    enum kern_isa best = kern_isa_best();
    a = (int)(want < best ? want : best);
    __atomic_store_n(&active, a, __ATOMIC_RELEASE);
    return (enum kern_isa)a;
}

static int avxvnni = -1;    /* kern_avxvnni() once chosen */

/* Bit `bit` of cpuid leaf 7, subleaf 1, EAX, on a CPU whose best path is at
 * least `need` (which also says the OS saves the registers it uses). */
static bool leaf7_1_eax(enum kern_isa need, unsigned bit)
{
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    unsigned a, b, c, d;
    if (kern_isa_best() < need || !__get_cpuid_count(7, 1, &a, &b, &c, &d))
        return false;
    return a & (1u << bit);
#else
    (void)need;
    (void)bit;
    return false;
#endif
}

/* AVX-VNNI (EAX bit 4), with AVX2 and the YMM state. */
static bool has_avxvnni(void) { return leaf7_1_eax(KERN_ISA_AVX2, 4); }

bool kern_avxvnni(void)
{
    int v = __atomic_load_n(&avxvnni, __ATOMIC_ACQUIRE);
    if (v >= 0)
        return v;
    const char *env = getenv("KVD_AVXVNNI");
    v = has_avxvnni() && !(env != NULL && strcmp(env, "0") == 0);
    __atomic_store_n(&avxvnni, v, __ATOMIC_RELEASE);
    return v;
}

bool kern_avxvnni_set(bool on)
{
    const int v = on && has_avxvnni();
    __atomic_store_n(&avxvnni, v, __ATOMIC_RELEASE);
    return v;
}

/* AVX512_BF16 (EAX bit 5), on a CPU with the AVX-512 path. */
static bool has_avx512bf16(void) { return leaf7_1_eax(KERN_ISA_AVX512VNNI, 5); }

static int bf16_on = -1;     /* kern_avx512bf16()'s choice, once made */

bool kern_avx512bf16(void)
{
    int v = __atomic_load_n(&bf16_on, __ATOMIC_ACQUIRE);
    if (v < 0) {
        const char *env = getenv("KVD_BF16");
        v = has_avx512bf16() && !(env != NULL && strcmp(env, "0") == 0);
        __atomic_store_n(&bf16_on, v, __ATOMIC_RELEASE);
    }
    return v && kern_isa() >= KERN_ISA_AVX512VNNI;
}

bool kern_avx512bf16_set(bool on)
{
    __atomic_store_n(&bf16_on, on && has_avx512bf16(), __ATOMIC_RELEASE);
    return kern_avx512bf16();
}

static int amx = -1;        /* kern_amx() once chosen */
static int amx_seen = -1;   /* has_amx() once probed */

/* AMX-TILE and AMX-INT8 (cpuid leaf 7 EDX bits 24 and 25), the tile
 * configuration and data in XCR0 (bits 17 and 18), and Linux's permission
 * for this process to use the tile data (XFEATURE_XTILEDATA = 18): without
 * it the first tile load faults. A refusal leaves the AVX-512 products. */
static bool probe_amx(void)
{
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
    unsigned a, b, c, d;
    if (kern_isa_best() < KERN_ISA_AVX512VNNI || !__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return false;
    if (!(d & (1u << 24)) || !(d & (1u << 25)) || !os_saves(0x60000))
        return false;
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
}

bool kern_amx_available(void)
{
    int v = __atomic_load_n(&amx_seen, __ATOMIC_ACQUIRE);
    if (v < 0) {
        v = probe_amx();
        __atomic_store_n(&amx_seen, v, __ATOMIC_RELEASE);
    }
    return v;
}

bool kern_amx(void)
{
    int v = __atomic_load_n(&amx, __ATOMIC_ACQUIRE);
    if (v >= 0)
        return v;
    const char *env = getenv("KVD_AMX");
    v = !(env != NULL && strcmp(env, "0") == 0) && kern_amx_available();
    __atomic_store_n(&amx, v, __ATOMIC_RELEASE);
    return v;
}

bool kern_amx_set(bool on)
{
    const int v = on && kern_amx_available();
    __atomic_store_n(&amx, v, __ATOMIC_RELEASE);
    return v;
}

/* AMX-BF16 (cpuid leaf 7 EDX bit 22) beside the tiles kern_amx() uses, and
 * the bf16 instructions kern_avx512bf16() allows. */
static int amx_bf16_seen = -1;

bool kern_amx_bf16(void)
{
    int v = __atomic_load_n(&amx_bf16_seen, __ATOMIC_ACQUIRE);
    if (v < 0) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        unsigned a, b, c, d;
        v = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) != 0;
#else
        v = 0;
#endif
        __atomic_store_n(&amx_bf16_seen, v, __ATOMIC_RELEASE);
    }
    return v && kern_amx() && kern_avx512bf16();
}

bool kern_cpu_amd(void)
{
    static int amd = -1;
    int v = __atomic_load_n(&amd, __ATOMIC_ACQUIRE);
    if (v < 0) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        unsigned a, b, c, d;
        /* "AuthenticAMD" in EBX, EDX, ECX */
        v = __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;
#else
        v = 0;
#endif
        __atomic_store_n(&amd, v, __ATOMIC_RELEASE);
    }
    return v;
}

const char *kern_isa_name(enum kern_isa isa)
{
    switch ((int)isa) {
#if defined(__aarch64__)
    case KERN_ISA_NEON: return "neon";
    case KERN_ISA_I8MM: return "i8mm";
#else
    case KERN_ISA_AVX2: return "avx2";
    case KERN_ISA_AVX512VNNI: return "avx512vnni";
#endif
    default: return "c";
    }
}

const char *kern_path_name(void)
{
#if defined(__x86_64__)
    if (kern_isa() == KERN_ISA_AVX2 && kern_avxvnni())
        return "avx2+avxvnni";
    if (kern_isa() >= KERN_ISA_AVX512VNNI && kern_amx())
        return "avx512vnni+amx";
#endif
    return kern_isa_name(kern_isa());
}
