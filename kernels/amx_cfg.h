/*
 * amx_cfg.h - the AMX tile configuration (palette 1: rows and bytes per row
 * of each of the eight tiles) and its load, for the files built for AMX.
 * ldtilecfg is our own asm statement whose memory operand is the whole 64
 * bytes: GCC 12's _tile_loadconfig names only the first 8, so the compiler
 * may drop the stores that fill the rest.
 */
#ifndef KVD_KERN_AMX_CFG_H
#define KVD_KERN_AMX_CFG_H

#include <stdint.h>

struct amx_cfg {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64)));

_Static_assert(sizeof(struct amx_cfg) == 64, "the tile configuration is 64 bytes");

static inline void amx_cfg_load(const struct amx_cfg *c) { __asm__ volatile("ldtilecfg %0" ::"m"(*c)); }

#endif
