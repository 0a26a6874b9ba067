/*
 * cpu.h - which instruction-set path the kernels take, chosen at run time.
 *
 * kern_isa() probes the CPU once: AVX-512 with VNNI (and VL, BW), else AVX2
 * with FMA and F16C, else the portable C reference. KVD_ISA=c|avx2|avx512vnni
 * in the environment selects a lower path (tests and benchmarks compare them);
 * asking for one the CPU lacks falls back to the best it has. All paths of a
 * build give each output from its own inputs in a fixed order, so the choice
 * changes rounding, never batch invariance.
 */
#ifndef KVD_KERN_CPU_H
#define KVD_KERN_CPU_H

#include <stdbool.h>

enum kern_isa {
    KERN_ISA_C = 0,         /* portable C reference */
    KERN_ISA_AVX2 = 1,      /* AVX2 + FMA + F16C */
    KERN_ISA_AVX512VNNI = 2,/* AVX-512 F/BW/DQ/VL + VNNI */
};

/* The path in use (probed on first call; thread-safe after that). */
enum kern_isa kern_isa(void);

/* The best path this CPU supports, whatever KVD_ISA says. */
enum kern_isa kern_isa_best(void);

/* Forces a path for the rest of the process (clamped to what the CPU supports);
 * for tests. Returns the path now in use. */
enum kern_isa kern_isa_set(enum kern_isa isa);

const char *kern_isa_name(enum kern_isa isa);

/* Whether the AVX2 path's packed products use AVX-VNNI (vpdpbusd on 256-bit
 * registers): where the CPU has it, unless KVD_AVXVNNI=0. Both give the same
 * bits; this is a matter of speed. */
bool kern_avxvnni(void);

/* Forces that choice (clamped to what the CPU has); for tests. Returns it. */
bool kern_avxvnni_set(bool on);

#endif
