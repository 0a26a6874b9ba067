/*
 * restore.h - kvd's copies of blocks from the tiers below the pool back into
 * pool blocks, on a thread of their own.
 *
 * A prompt whose cached prefix goes on in the host tier or on disk gets new
 * pool blocks, pending and indexed (shm/prefix.h's asynchronous tier), and a
 * copy job for each. The thread reads each block from the host tier, else
 * from disk, into its pool block (into a GPU pool through a page-locked
 * staging buffer of its own) and hands the outcome back through a queue
 * whose file descriptor kvd's loop polls. kvd's loop never waits for a tier,
 * so no other request's step waits for one either.
 */
#ifndef KVD_RESTORE_H
#define KVD_RESTORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "disktier.h"
#include "prefix.h"
#include "tier.h"

typedef struct restorer restorer_t;

enum { RESTORE_FAILED = 0, RESTORE_HOST = 1, RESTORE_DISK = 2 };

/* One finished copy. */
struct restore_done {
    void *owner;            /* what restorer_submit was given */
    uint32_t logical;       /* the block's place in its sequence */
    uint32_t part;          /* the block's part (0: the prefix chain's own) */
    int from;               /* RESTORE_HOST, RESTORE_DISK, or RESTORE_FAILED */
    double ns;              /* what the copy took */
};

/*
 * A restore thread for blocks of block_bytes from host (or NULL) and disk (or
 * NULL). device >= 0: the pool is on that GPU and dst addresses given to
 * restorer_submit are device addresses. NULL with a reason.
 */
restorer_t *restorer_new(tier_t *host, disk_tier_t *disk, uint64_t block_bytes, uint32_t block_tokens,
                         int device, char *err, size_t errlen);

/* Finishes the queued copies, then stops the thread and frees everything
 * (results not collected are dropped). Accepts NULL; sets *r to NULL. */
void restorer_destroy(restorer_t **r);

/* Readable while results wait to be collected (an eventfd). */
int restorer_fd(const restorer_t *r);

/* Queues the copy of block b (identity copied) into the pool block at dst;
 * false when out of memory (nothing queued). */
bool restorer_submit(restorer_t *r, void *owner, const struct prefix_tier_block *b, uint32_t logical,
                     void *dst);

/* Calls fn for every finished copy, in the order they finished; returns how
 * many. With wait set, first waits until every queued copy has finished. */
size_t restorer_collect(restorer_t *r, bool wait, void (*fn)(void *user, const struct restore_done *d),
                        void *user);

#endif
