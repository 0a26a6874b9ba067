/* kvparts.c - splitting a model's layers into the parts of a KV block. */
#include "kvparts.h"

#include <stdio.h>
#include <string.h>

void kv_parts_single(uint32_t n_layer, struct kv_parts *p)
{
    memset(p, 0, sizeof(*p));
    p->n_parts = 1;
    p->part_layers = n_layer;
}

static uint32_t gcd(uint32_t a, uint32_t b)
{
    while (b) {
        uint32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

void kv_parts_plan(uint32_t n_layer, const uint32_t *window, struct kv_parts *p)
{
    kv_parts_single(n_layer, p);
    if (n_layer == 0 || n_layer > KV_MAX_PART_LAYERS)
        return;
    /* the distinct windows, full attention (0) first, then in order of appearance */
    uint32_t wins[KV_MAX_PART_LAYERS], count[KV_MAX_PART_LAYERS], n_win = 1;
    wins[0] = 0;
    count[0] = 0;
    for (uint32_t l = 0; l < n_layer; l++) {
        uint32_t g = 0;
        while (g < n_win && wins[g] != window[l])
            g++;
        if (g == n_win) {
            wins[n_win] = window[l];
            count[n_win++] = 0;
        }
        count[g]++;
    }
    if (n_win == 1 || count[0] == 0)
        return; /* no window, or nothing to anchor the chain */
    uint32_t size = 0;
    for (uint32_t g = 0; g < n_win; g++)
        size = gcd(size, count[g]);
    if (n_layer / size > KV_MAX_PARTS)
        return;
    struct kv_parts q;
    memset(&q, 0, sizeof(q));
    q.part_layers = size;
    for (uint32_t g = 0; g < n_win; g++) {
        uint32_t taken = 0;
        for (uint32_t l = 0; l < n_layer; l++) {
            if (window[l] != wins[g])
                continue;
            if (taken % size == 0)
                q.window[q.n_parts++] = wins[g];
            q.layer_part[l] = (uint8_t)(q.n_parts - 1);
            q.layer_slot[l] = (uint8_t)(taken % size);
            taken++;
        }
    }
    *p = q;
}

int kv_parts_check(uint32_t n_layer, const struct kv_parts *p, char *err, size_t errlen)
{
    if (p->n_parts == 1) {
        if (p->part_layers != n_layer) {
            snprintf(err, errlen, "one part of %u layers for a model of %u", p->part_layers, n_layer);
            return -1;
        }
        return 0;
    }
    if (p->n_parts < 1 || p->n_parts > KV_MAX_PARTS || n_layer > KV_MAX_PART_LAYERS ||
        p->part_layers == 0 || (uint64_t)p->n_parts * p->part_layers != n_layer) {
        snprintf(err, errlen, "%u parts of %u layers do not cover %u layers", p->n_parts,
                 p->part_layers, n_layer);
        return -1;
    }
    if (p->window[0] != 0) {
        snprintf(err, errlen, "part 0 is windowed");
        return -1;
    }
    uint8_t seen[KV_MAX_PARTS][KV_MAX_PART_LAYERS];
    memset(seen, 0, sizeof(seen));
    for (uint32_t l = 0; l < n_layer; l++) {
        uint32_t part = p->layer_part[l], slot = p->layer_slot[l];
        if (part >= p->n_parts || slot >= p->part_layers || seen[part][slot]) {
            snprintf(err, errlen, "layer %u maps to part %u slot %u, out of range or taken", l, part,
                     slot);
            return -1;
        }
        seen[part][slot] = 1;
    }
    return 0;
}

uint64_t kv_parts_blocks_held(const struct kv_parts *p, uint64_t n, uint32_t block_tokens)
{
    const uint64_t all = (n + block_tokens - 1) / block_tokens;
    uint64_t sum = 0;
    for (uint32_t i = 0; i < p->n_parts; i++)
        sum += all - kv_window_first_block(p->window[i], n, block_tokens);
    return sum;
}
