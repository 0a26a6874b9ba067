/*
 * disktier.h - the disk tier of the prefix cache: blocks kept in files of a
 * directory, so that a cached prefix outlives the pool, the host tier and
 * kvd itself (a restart, a crash, a redeploy on the same disk).
 *
 * One file per block, named by a digest of its identity (tier.h: key, parent
 * key, namespace, tokens). A file holds a header and the block's bytes in the
 * pool's format:
 *
 *   magic "KVDTIER" 0x01, version, header size;
 *   the layout it was made for: model fingerprint, tokenizer and
 *   chat-template digest, K/V types and rotation, block size in tokens and
 *   bytes, parts and layers per part, and a digest of the pool's key secret
 *   (the keys of a pool with another secret never match: kvd keeps its
 *   secret in the directory, so that a new pool keys as the old one did);
 *   the block's identity (key, parent key, namespace, path digest, token ids);
 *   the data's size and MAC, then the MAC of everything before it.
 *
 * The MACs are keyed BLAKE2b-256 (libsodium's crypto_generichash) under a key
 * derived from the pool's key secret (disk_tier_mac_key), so whoever can write
 * the directory but not read the secret cannot make a file kvd accepts: a
 * block whose K/V were replaced, with any checksum, is a damaged file. (About
 * 1 GB/s on one core: 0.36 ms for a 360 KiB block.)
 *
 * The directory must be this user's and writable by no one else, and only
 * regular files of this user's are read, opened without following links and
 * without blocking (a FIFO or a link named like a block is refused, never
 * waited on or followed); files are made with O_EXCL, mode 0600. Files of
 * another layout take their room from the budget.
 *
 * Writes go behind: disk_tier_put copies the block into a bounded queue and
 * returns; a thread of the tier writes it to a temporary name, fsyncs it,
 * renames it into place and fsyncs the directory, so that a process killed at
 * any moment leaves complete files and temporaries (removed at the next open)
 * only. A full queue drops the write (counted), never waits.
 *
 * Opening indexes the directory from the headers alone: files of another
 * layout (another model, tokenizer, KV type or block size) are ignored (one
 * log line for all of them), files whose header fails its checksum, or of the
 * wrong size, are removed (a line each). A read
 * checks the identity and the data's checksum: a damaged file is a miss,
 * removed and counted, never wrong K/V. The directory stays within its byte
 * budget by dropping the least recently used files (a file's use is its
 * modification time, so the order survives restarts).
 *
 * Lookups and reads run on the caller's thread (kvd's loop), writes on the
 * tier's; the index between them is locked.
 */
#ifndef KVD_DISKTIER_H
#define KVD_DISKTIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "prefix.h"

typedef struct disk_tier disk_tier_t;

/* What a file must have been made for to be used. */
struct disk_tier_layout {
    uint8_t model[16];          /* the model's fingerprint (pool_layout.fingerprint) */
    uint8_t tokenizer[16];      /* digest of the tokenizer and chat template */
    uint32_t k_type, v_type, rotate;
    uint32_t block_tokens;
    uint64_t block_bytes;
    uint32_t n_parts, part_layers;
    uint8_t keys[16];           /* digest of the pool's key secret: keys made under another
                                 * cannot match */
    uint8_t mac_key[32];        /* the files' MAC key (disk_tier_mac_key); never written */
};

struct disk_tier_stats {
    uint64_t files;             /* blocks on disk */
    uint64_t bytes;             /* their files' bytes */
    uint64_t max_bytes;         /* the budget */
    uint64_t written;           /* files written since open */
    uint64_t pending;           /* writes queued now */
    uint64_t dropped_writes;    /* writes dropped: queue full, or a write failed */
    uint64_t removed;           /* files dropped to stay in the budget */
    uint64_t hits, misses;      /* reads */
    uint64_t corrupt;           /* files that failed a check on read (or their header on open): removed */
    uint64_t ignored;           /* files of another layout found at open */
    uint64_t foreign_bytes;     /* their bytes: counted against the budget (within bytes) */
    uint64_t refused;           /* names of block files that are no regular file of this user's
                                 * (links, FIFOs, others'): never opened, left alone */
    uint64_t indexed;           /* usable files found at open */
};

/* Logs one line (the tier's notes at open: files ignored, removed). */
typedef void (*disk_tier_log_fn)(void *user, const char *line);

/* The MAC key of a pool's files, from its key secret (n bytes). */
void disk_tier_mac_key(const uint8_t *secret, size_t n, uint8_t out[32]);

/*
 * The key secret kept in dir/secret (n bytes) into out: read when it is
 * there, else made (random, written with O_EXCL and mode 0600, synced, then
 * linked into place; *made says so). dir is made (0700) when missing. 0, or
 * KVD_EPERM when dir is not this user's or others may write it, or the secret
 * is not a regular file of this user's that only it may read (a link, a
 * FIFO, mode 0644: refused, not followed or fixed), or KVD_EIO; the reason in
 * err. A secret of the wrong size is replaced (the files made under it then
 * no longer match).
 */
int disk_tier_secret(const char *dir, uint8_t *out, size_t n, bool *made, char *err, size_t errlen);

/*
 * Opens (creating, mode 0700) directory dir as a tier of at most max_bytes for
 * blocks of layout lay, indexes what it holds and starts the writer. NULL with
 * a reason (the directory cannot be made or read, is not this user's or is
 * writable by others, a budget smaller than one block, no memory).
 */
disk_tier_t *disk_tier_open(const char *dir, uint64_t max_bytes, const struct disk_tier_layout *lay,
                            disk_tier_log_fn log, void *log_user, char *err, size_t errlen);

/* Writes what is queued, stops the writer, frees the index; accepts NULL and
 * sets *d to NULL. */
void disk_tier_close(disk_tier_t **d);

/* Queues block b (identity and block_bytes of data, copied) to be written,
 * unless it is on disk or queued already. 0 (queued, or there already) or
 * KVD_ENOSPACE (queue full: dropped) / KVD_ENOMEM. */
int disk_tier_put(disk_tier_t *d, const struct prefix_tier_block *b, const void *data);

/* Whether b is on disk (written, not just queued). */
bool disk_tier_has(disk_tier_t *d, const struct prefix_tier_block *b);

/* Reads b's data into dst (block_bytes) after checking the file's identity and
 * checksum, and marks it used; false when it is not there or fails a check
 * (then the file is removed, and dst may have been written). */
bool disk_tier_get(disk_tier_t *d, const struct prefix_tier_block *b, void *dst);

/* Waits until every queued write is done (tests, shutdown). */
void disk_tier_flush(disk_tier_t *d);

void disk_tier_stats(disk_tier_t *d, struct disk_tier_stats *st);

/* The file that holds (or would hold) b, for tests that damage one: written
 * into path; false when it is not on disk. */
bool disk_tier_path_for_test(disk_tier_t *d, const struct prefix_tier_block *b, char *path, size_t len);

#endif
