/*
 * pooltest.h - what the allocator tests (test_prefix.c, test_parts.c) share:
 * signatures that stand in for K/V (a block's data filled with one 64-bit
 * value computed from what its K/V would be computed from, so a test can tell
 * whether the cache handed out the right block), opening the allocator and
 * checking its invariants. Needs check.h, pool.h and prefix.h first, and
 * BT and BLOCK_BYTES defined.
 */
#ifndef KVD_TEST_POOLTEST_H
#define KVD_TEST_POOLTEST_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "types.h"

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

/* A private pool of n_blocks blocks of BT positions (f16 K/V, one KV head of
 * 4 dims a layer) over n_layer layers, in the given parts (NULL: one part);
 * fails the test if it cannot be made. */
static inline pool_t *pool_make(const char fingerprint[16], uint32_t n_layer, const struct kv_parts *parts,
                                uint32_t n_blocks)
{
    struct pool_layout lay;
    memset(&lay, 0, sizeof(lay));
    memcpy(lay.fingerprint, fingerprint, 16);
    lay.n_layer = n_layer;
    lay.n_head_kv = 1;
    lay.head_dim = 4;
    lay.block_tokens = BT;
    lay.k_type = KERN_F16;
    lay.v_type = KERN_F16;
    if (parts != NULL)
        lay.parts = *parts;
    struct pool_params p = pool_default_params();
    p.name = NULL;
    p.n_blocks = n_blocks;
    char err[256] = "";
    pool_t *pool = pool_create(&lay, &p, NULL, 0, err, sizeof(err));
    if (pool == NULL)
        fprintf(stderr, "pool_create: %s\n", err);
    REQUIRE(pool != NULL);
    REQUIRE(pool_header(pool)->block_bytes == BLOCK_BYTES);
    return pool;
}

/* The allocator of a pool this process owns; fails the test if it cannot start. */
static inline prefix_t *prefix_open(pool_t *pool)
{
    char err[256] = "", note[256] = "";
    prefix_t *px = prefix_new(pool, note, sizeof(note), err, sizeof(err));
    if (px == NULL)
        fprintf(stderr, "prefix_new: %s\n", err);
    REQUIRE(px != NULL);
    return px;
}

/* prefix_check(), printing the first broken invariant. */
static inline int check_ok(const prefix_t *px)
{
    char err[256] = "";
    int rc = prefix_check(px, err, sizeof(err));
    if (rc != 0)
        fprintf(stderr, "prefix_check: %s\n", err);
    return rc;
}

#endif
