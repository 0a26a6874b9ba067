/*
 * kvparts.h - how a KV block covers a model's layers.
 *
 * A model whose layers all attend to the whole context keeps every layer of a
 * position range in one block: one block table per sequence (one part). A
 * model with sliding-window layers (Gemma 3: five layers in six see the last
 * 512 positions) would pay there for K/V that its windowed layers never read
 * again. Its layers are therefore split into parts of equal size: a part
 * holds part_layers layers of one attention kind (full, or a window of W
 * positions), every block holds one part's layers for block_tokens positions,
 * and a sequence has one block table per part. All blocks have one size, so
 * one free list and one LRU serve every part, and the balance between full
 * and windowed blocks follows the load. A windowed part's table keeps only the
 * blocks its live window reads.
 *
 * Part 0 always holds full-attention layers: its blocks carry the prefix
 * chain that the other parts' blocks hang from (shm/prefix.h).
 *
 * Gemma 3 270M (18 layers, 3 full): parts of 3 layers, part 0 full and parts
 * 1..5 windowed. SmolLM2 (30 full layers): one part of 30 layers, the layout
 * every model without windows keeps.
 */
#ifndef KVD_KVPARTS_H
#define KVD_KVPARTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KV_MAX_PARTS 64         /* block tables per sequence */
#define KV_MAX_PART_LAYERS 256  /* layers a layout of several parts can map */

struct kv_parts {
    uint32_t n_parts;                       /* block tables per sequence (1..KV_MAX_PARTS) */
    uint32_t part_layers;                   /* layers one block holds */
    uint32_t window[KV_MAX_PARTS];          /* part p's layers see the last window[p]
                                             * positions; 0: all of them. window[0] == 0 */
    uint8_t layer_part[KV_MAX_PART_LAYERS]; /* n_parts > 1: the part of layer l */
    uint8_t layer_slot[KV_MAX_PART_LAYERS]; /* n_parts > 1: its place among the part's layers */
};

/* One part of all n_layer layers (a model without windows). */
void kv_parts_single(uint32_t n_layer, struct kv_parts *p);

/*
 * The parts for layers whose windows are window[0..n_layer) (0: full
 * attention): layers of equal window fall into parts of g layers, g the
 * greatest common divisor of the groups' sizes, taken in layer order, the
 * full-attention ones first. One part (kv_parts_single) when every layer is
 * full, when none is (nothing could anchor the prefix chain), when there are
 * more than KV_MAX_PART_LAYERS layers, or when it would take more than
 * KV_MAX_PARTS parts.
 */
void kv_parts_plan(uint32_t n_layer, const uint32_t *window, struct kv_parts *p);

/* Checks parts read from elsewhere (shared memory) against n_layer layers: 0,
 * or -1 with the reason in err. */
int kv_parts_check(uint32_t n_layer, const struct kv_parts *p, char *err, size_t errlen);

/* Layer l's part and its place in the part's blocks. */
static inline uint32_t kv_part_of(const struct kv_parts *p, uint32_t layer)
{
    return p->n_parts > 1 ? p->layer_part[layer] : 0;
}

static inline uint32_t kv_slot_of(const struct kv_parts *p, uint32_t layer)
{
    return p->n_parts > 1 ? p->layer_slot[layer] : layer;
}

/* The first logical block that a window of w positions still reads once
 * positions [0, n) are written (the next position is n): blocks before it
 * hold only positions below n + 1 - w. 0 for full attention (w == 0). */
static inline uint64_t kv_window_first_block(uint32_t w, uint64_t n, uint32_t block_tokens)
{
    if (w == 0 || n + 1 <= w)
        return 0;
    return (n + 1 - w) / block_tokens;
}

/* Context windowing (docs/models.md): what a sequence whose positions
 * [0, n) are written keeps when it windows. *keep: the blocks of its first
 * `sinks` positions (rounded up to whole blocks); *drop: the blocks after
 * them that go, the older half of its full blocks past the sinks, fewer where
 * a sliding window of swa positions (0: none) must still find its positions
 * in the blocks that stay. False when nothing can go. */
static inline bool kv_window_plan(uint64_t n, uint32_t sinks, uint32_t block_tokens, uint32_t swa,
                                  uint32_t *keep, uint32_t *drop)
{
    const uint64_t full = n / block_tokens, k = (sinks + block_tokens - 1) / block_tokens;
    if (full < k + 2)
        return false;
    uint64_t d = (full - k) / 2;
    if (swa > 0) {
        /* after the drop the window's first position, n - d * bt + 1 - swa,
         * must lie past the sinks, in the blocks that moved */
        const uint64_t room = n + 1 >= swa ? (n + 1 - swa) / block_tokens : 0;
        const uint64_t most = room > k ? room - k : 0;
        d = d < most ? d : most;
    }
    *keep = (uint32_t)k;
    *drop = (uint32_t)d;
    return d > 0;
}

/* Blocks that a sequence whose positions [0, n) are written holds in all its
 * tables together: every block of a full part, the live window's of a
 * windowed one. */
uint64_t kv_parts_blocks_held(const struct kv_parts *p, uint64_t n, uint32_t block_tokens);

#endif
