/*
 * blocksig.h - signatures that stand in for K/V in the allocator tests: a
 * block's data is filled with one 64-bit value computed from what its K/V
 * would be computed from, so a test can tell whether the cache handed out
 * the right block. Needs check.h and pool.h first, and BLOCK_BYTES defined.
 */
#ifndef KVD_TEST_BLOCKSIG_H
#define KVD_TEST_BLOCKSIG_H

#include <stdbool.h>
#include <stdint.h>

/* splitmix64's finalizer */
static inline uint64_t mix64(uint64_t x)
{
    x += UINT64_C(0x9e3779b97f4a7c15);
    x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
    return x ^ (x >> 31);
}

/* Fills block id's data with v. */
static inline void kv_fill(pool_t *pool, uint32_t id, uint64_t v)
{
    uint64_t *d = pool_block_addr(pool, id);
    REQUIRE(d != NULL);
    for (uint32_t i = 0; i < BLOCK_BYTES / 8; i++)
        d[i] = v;
}

/* True when block id's data is all v. */
static inline bool kv_holds(pool_t *pool, uint32_t id, uint64_t v)
{
    const uint64_t *d = pool_block_addr(pool, id);
    if (d == NULL)
        return false;
    for (uint32_t i = 0; i < BLOCK_BYTES / 8; i++)
        if (d[i] != v)
            return false;
    return true;
}

#endif
