/*
 * cpu.h - which instruction-set path the kernels take, chosen at run time.
 *
 * The paths are levels, the same numbers on each architecture: 0 is the
 * portable C reference (every CPU); on x86-64, 1 is AVX2 with FMA and F16C
 * and 2 AVX-512 with VNNI (and VL, BW, DQ); on aarch64, 1 is Advanced SIMD
 * with the dot-product extension (sdot) and 2 adds the int8 matrix multiply
 * (smmla). kern_isa() probes the CPU once and takes the highest level it has.
 * KVD_ISA=c|avx2|avx512vnni (x86-64) or c|neon|i8mm (aarch64) in the
 * environment selects a lower one (tests and benchmarks compare them); asking
 * for one the CPU lacks falls back to the best it has. All paths of a build
 * give each output from its own inputs in a fixed order, so the choice
 * changes rounding, never batch invariance.
 */
#ifndef KVD_KERN_CPU_H
#define KVD_KERN_CPU_H

#include <stdbool.h>

enum kern_isa {
    KERN_ISA_C = 0,         /* portable C reference */
    KERN_ISA_SIMD = 1,      /* the first level with SIMD kernels, on any architecture */
    /* x86-64 */
    KERN_ISA_AVX2 = 1,      /* AVX2 + FMA + F16C */
    KERN_ISA_AVX512VNNI = 2,/* AVX-512 F/BW/DQ/VL + VNNI */
    /* aarch64 */
    KERN_ISA_NEON = 1,      /* Advanced SIMD + the dot-product extension (FEAT_DotProd) */
    KERN_ISA_I8MM = 2,      /* plus the int8 matrix multiply (FEAT_I8MM) */
    KERN_ISA_TOP = 2,       /* the highest level */
};

/* The path in use (probed on first call; thread-safe after that). */
enum kern_isa kern_isa(void);

/* The best path this CPU supports, whatever KVD_ISA says. */
enum kern_isa kern_isa_best(void);

/* Forces a path for the rest of the process (clamped to what the CPU supports);
 * for tests. Returns the path now in use. */
enum kern_isa kern_isa_set(enum kern_isa isa);

const char *kern_isa_name(enum kern_isa isa);

/* The active path as the products run it: kern_isa_name(kern_isa()), with
 * "+avxvnni" where the AVX2 path's packed products use AVX-VNNI and "+amx"
 * where the AVX-512 path's use AMX tiles. */
const char *kern_path_name(void);

/* Whether the AVX2 path's packed products use AVX-VNNI (vpdpbusd on 256-bit
 * registers): where the CPU has it, unless KVD_AVXVNNI=0. Both give the same
 * bits; this is a matter of speed. */
bool kern_avxvnni(void);

/* Forces that choice (clamped to what the CPU has); for tests. Returns it. */
bool kern_avxvnni_set(bool on);

/* Whether the AVX-512 path has the bf16 dot product (AVX512_BF16: vdpbf16ps),
 * which its attention over a bf16 cache uses: the CPU has it, the path in use
 * is AVX-512 (KVD_ISA lower turns it off with the path), and KVD_BF16 is not
 * 0. Without it attention over bf16 runs the AVX2 kernel (f32 multiply-adds). */
bool kern_avx512bf16(void);

/* Forces that choice (clamped to what the CPU has); for tests. Returns it. */
bool kern_avx512bf16_set(bool on);

/* Whether the AVX-512 VNNI path's packed products of enough tokens
 * (KERN_AMX_MIN_T, gemm.h) run on AMX tiles: where the CPU has AMX-TILE and
 * AMX-INT8, the OS saves the tile state and grants this process the tile data
 * (arch_prctl ARCH_REQ_XCOMP_PERM), unless KVD_AMX=0. The products give
 * the same bits either way; attention over bf16 on the tiles
 * (kern_amx_bf16()) has bits of its own. */
bool kern_amx(void);

/* Whether attention over a bf16 K and V runs on AMX tiles (TDPBF16PS):
 * kern_amx(), AMX-BF16 and kern_avx512bf16(). Its bits are its own (the
 * tiles' sums are not vdpbf16ps chains), the same for a query whatever the
 * call (decode, kern_attn_multi, the heads beside it). */
bool kern_amx_bf16(void);

/* Whether the CPU is AMD's (cpuid vendor "AuthenticAMD"): where the bf16 dot
 * product, without AMX, was measured faster than f16 (kern_attn_kv_auto). */
bool kern_cpu_amd(void);

/* Whether the CPU and OS offer AMX at all, whatever KVD_AMX says. */
bool kern_amx_available(void);

/* Forces that choice (clamped to what the CPU has); for tests. Returns it. */
bool kern_amx_set(bool on);

#endif
