/*
 * events.h - kvd's block events (--kv-events ENDPOINT): what the prefix index
 * can find, published for prefix-aware routers in the format vLLM's
 * ZmqEventPublisher uses and llm-d's precise prefix-cache scorer reads.
 *
 * A ZeroMQ PUB socket bound at ENDPOINT sends one message of three frames per
 * batch: the topic, an 8-byte big-endian sequence number (0, 1, 2, ... for
 * the daemon's life) and a msgpack EventBatch, the array [ts, events] (ts in
 * seconds since the epoch, a float). Each event is an array whose first
 * element names it:
 *
 *   ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]
 *       blocks that lookups can now find: consecutive blocks of one chain,
 *       parent the hash of the block before the first (nil for a chain's
 *       first block), token_ids their block_size tokens each; lora_id and
 *       lora_name nil; medium "CPU" or "GPU" (where the pool's K/V are)
 *   ["BlockRemoved", hashes, medium]
 *       blocks that lookups no longer find (evicted)
 *   ["AllBlocksCleared"]
 *       forget everything (sent when kvd starts, before the blocks an
 *       adopted pool already holds are announced as stored)
 *
 * A hash is the low 64 bits of kvd's 128-bit chained block key (shm/prefix.h),
 * as an unsigned integer: it already covers the namespace (tenant), the model
 * and every token before the block, and it is keyed with the pool's secret, so
 * it tells a subscriber nothing of the tokens. token_ids are sent only for
 * blocks of the shared namespaces (the default one, where requests without a
 * namespace go, and --public-prefix's), unless params.all_tokens: a tenant's
 * blocks, and those of any namespace a client named, go out with token_ids []
 * (their hashes, parents and block_size as always), so that a subscriber
 * cannot read another tenant's prompts off the events. kvd owns the allocator, so an event says
 * what the index holds at the end of the loop iteration that sent it: a
 * subscriber that has every batch since AllBlocksCleared holds exactly the
 * hashes of the findable blocks (kvcli-side check: Stats.block_hashes).
 */
#ifndef KVD_EVENTS_H
#define KVD_EVENTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "curve.h"
#include "prefix.h"

typedef struct kv_events kv_events_t;

struct kv_events_params {
    const char *endpoint;           /* where to bind (checked and claimed by the caller) */
    const char *topic;
    const char *medium;             /* "CPU" or "GPU" */
    const struct curve_cert *curve; /* a tcp:// endpoint's CURVE key pair: subscribers then need a key
                                     * the ZAP handler admits in its "events" domain; NULL: plain */
    bool all_tokens;                /* every block's token ids (--kv-events-token-ids all) */
    prefix_ns_t shared[2];          /* the namespaces whose blocks' token ids are sent */
    uint32_t n_shared;
};

/* Binds a PUB socket of context zctx as p says and starts observing px. NULL
 * with a reason. */
kv_events_t *kv_events_open(void *zctx, const struct kv_events_params *p, prefix_t *px, char *err, size_t errlen);

/* Queues AllBlocksCleared followed by every block px can find now. */
void kv_events_announce(kv_events_t *ev);

/* Sends what is queued as one batch (nothing when nothing is). */
void kv_events_flush(kv_events_t *ev);

/* Batches sent so far. */
uint64_t kv_events_batches(const kv_events_t *ev);

/* Flushes, stops observing and closes the socket; accepts NULL. */
void kv_events_close(kv_events_t **ev);

#endif
