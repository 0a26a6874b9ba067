/*
 * tiers.h - the tiers below kvd's pool (tiers.c): set up, handed to the
 * prefix index, and asked for a prompt's prefix.
 */
#ifndef KVD_TIERS_H
#define KVD_TIERS_H

#include <stdbool.h>
#include <stdint.h>

#include "kvd.h"

/* --host-cache, --cache-dir: opens the tiers (shm/tier.h, shm/disktier.h)
 * and sets them below hosts[0]'s index; exits with the reason on failure. */
void tiers_setup(struct kvd *k, const struct pool_layout *lay);

/* Whether the tiers copy blocks back on kvd's loop (sync: a begin returns
 * with them in the pool) or on the restore thread; no-op without a restore
 * thread (no tiers, or KVD_TIER_SYNC=1). */
void tiers_sync(struct kvd *k, bool sync);

/* prefix_seq_begin of r's sequence (tok[0..n_look), wait as there) in px:
 * the copies it starts on the restore thread are r's (r->restoring counts
 * them, r->restore_bad the first that could not be queued); *from_host and
 * *from_disk get the blocks it copied back itself from each tier (the
 * prefix's own part only). Returns what prefix_seq_begin does. */
int64_t tiers_seq_begin(struct kvd *k, prefix_t *px, struct request *r, const int32_t *tok, uint64_t n_look,
                        uint32_t *wait, uint32_t *from_host, uint32_t *from_disk);

/* Stops the restore thread (its copies collected before) and closes the
 * tiers; accepts a kvd without them. */
void tiers_fini(struct kvd *k);

#endif
