/*
 * pins.h - pinned prefixes: explicit prompt-cache control (kvd's part of
 * Anthropic's cache_control).
 *
 * A pin is made by a generate request with pin_ttl_s: once its prompt is
 * cached, the pin takes a reference on the full blocks of the prompt (or of
 * the prefix its first pin_messages messages render to), as a running
 * sequence would, so the allocator never evicts them; when the TTL passes the
 * reference goes and they are cached blocks like any other. A pin lives in its
 * request's namespace, so it is found, listed, unpinned and evicted only by its
 * own tenant (or by the trusted ipc:// socket naming no tenant). Its blocks
 * count for that tenant (--tenant-max-blocks), and a pin that would take the
 * tenant's pinned blocks past that limit (or all pins past half the pool), a
 * TTL past --pin-max-ttl or a pin past --pin-max-per-tenant is refused.
 *
 * With a disk tier (--cache-dir) the pins are written to DIR/pins at every
 * change (temporary file, fsync, rename) and taken again at start, their
 * blocks read back from disk (synchronously, before kvd serves): a pin
 * survives a restart until its TTL.
 *
 * Pins are kept for kvd's own pool only; a request dispatched to another
 * host's pool pins nothing (its Final says so).
 */
#ifndef KVD_PINS_H
#define KVD_PINS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd.h"

#define PINS_DEFAULT_MAX_TTL_S 3600u        /* --pin-max-ttl */
#define PINS_DEFAULT_MAX_PER_TENANT 64u     /* --pin-max-per-tenant */

/* Sets up k->pins (empty). 0 or KVD_ENOMEM. */
int pins_init(struct kvd *k);

/* Releases every pin's blocks and frees the table (before the pool goes). */
void pins_fini(struct kvd *k);

/* With --cache-dir: takes again the pins DIR/pins names whose TTL has not
 * passed, their blocks from the pool or the tiers (copied on kvd's loop).
 * A pin whose blocks are gone is dropped with a log line. */
void pins_load(struct kvd *k);

/*
 * Whether request r may pin its first r->pin_tokens prompt tokens (whole
 * blocks) for r->pin_ttl_s: 0, or a Kvd__ErrorCode with the reason in msg
 * (a TTL past --pin-max-ttl, a pin past --pin-max-per-tenant, the tenant's
 * pinned blocks past --tenant-max-blocks, all pins past half the pool).
 * Renewing an existing pin is always allowed.
 */
int pins_admit(struct kvd *k, const struct request *r, char *msg, size_t len);

/*
 * r's prompt is written and its blocks are still held (r->ps): the pin is
 * made or renewed. The pin (borrowed, good until the next pins_ call), or
 * NULL with the reason in msg (the blocks are not all cached: no_cache, a
 * duplicate computed at the same time; the limits of pins_admit).
 */
const struct kvd_pin *pins_take(struct kvd *k, const struct request *r, char *msg, size_t len);

/* r was dispatched with its cached prefix in r->ps: every pin that prefix
 * covers counts a hit. */
void pins_note_hits(struct kvd *k, const struct request *r);

/* Pins whose TTL has passed let go of their blocks. */
void pins_tick(struct kvd *k);

/* A CacheRequest (list, unpin, evict) of a client whose tenant is tenant
 * (NULL: the ipc:// socket), answered here. */
void pins_on_request(struct kvd *k, const uint8_t *rid, size_t rid_len, const char *tenant, uint64_t id,
                     const Kvd__CacheRequest *c);

/* Fills m (initialised here) from pin p; the strings are p's. */
void pins_describe(const struct kvd_pin *p, Kvd__Pin *m);

/* The pins of tenant name (NULL: every pin) and the blocks they hold. */
void pins_count(const struct kvd *k, const char *name, uint32_t *n, uint32_t *blocks);

/* Pins that reached their TTL, and pins refused, since start. */
void pins_counters(const struct kvd *k, uint64_t *expired, uint64_t *refused);

#endif
