/*
 * tiers.c - the tiers below kvd's pool (--host-cache, --cache-dir) as its
 * prefix index sees them (shm/prefix.h's struct prefix_tier).
 *
 * A block evicted from the pool goes down to the host tier; a block that
 * becomes findable is written behind to the disk tier. A prompt whose cached
 * prefix goes on below the pool gets it back, as long as a copy still
 * measures faster than computing its tokens: on the restore thread
 * (restore.c), or with KVD_TIER_SYNC=1 on kvd's loop. A GPU pool's blocks
 * pass through a page-locked staging buffer.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "cli.h"
#include "devmem.h"
#include "kvd.h"
#include "tiers.h"

/* What a prefix_seq_begin through tiers_seq_begin hands the callbacks. */
struct kvd_tiers {
    struct kvd *k;
    struct request *begin_for;      /* the request whose begin runs (its copies are its) */
    uint32_t got_host, got_disk;    /* blocks that begin took from each tier synchronously */
};

/* Whether restoring a block that has measured ns_block is still worth it
 * against computing its tokens (before either is measured, it is: a copy or
 * a read of a block takes well under a prefill of its tokens). */
static bool restore_pays(const struct kvd *k, double ns_block)
{
    return ns_block <= 0 || k->prefill_ns_token <= 0 || ns_block < k->prefill_ns_token * k->o.block_tokens;
}

/* A pool block's bytes where a tier can read them: the block itself in a
 * host pool; in a GPU pool a copy in the staging buffer (NULL when the copy
 * failed: the block does not go down). */
static const void *host_view(struct kvd *k, const void *data)
{
    if (k->tier_stage == NULL)
        return data;
    char err[256];
    if (devmem_read(k->tier_stage, data, pool_header(k->pool)->block_bytes, err, sizeof(err)) != 0) {
        kvd_log(k, "tiers: %s", err);
        return NULL;
    }
    return k->tier_stage;
}

/* A block became findable: the disk tier writes it behind. */
static void tier_committed(void *user, const struct prefix_tier_block *b, const void *data)
{
    struct kvd *k = ((struct kvd_tiers *)user)->k;
    const void *v = host_view(k, data);
    if (v != NULL)
        disk_tier_put(k->disk, b, v);   /* a full queue drops it, counted */
}

/* A block leaves the pool: the host tier keeps a copy (the disk has it already,
 * unless its write was dropped). */
static void tier_evicted(void *user, const struct prefix_tier_block *b, const void *data)
{
    struct kvd *k = ((struct kvd_tiers *)user)->k;
    const void *v = k->tier != NULL ? host_view(k, data) : NULL;
    if (v != NULL && tier_put(k->tier, b, v) != 0)
        kvd_log(k, "host tier: out of memory; a block evicted from the pool is lost");
}

/* Gets b from one tier into dst: a pool block (host), or through the staging
 * buffer to the device (GPU pool). */
static bool tier_read(struct kvd *k, const struct prefix_tier_block *b, void *dst, bool disk)
{
    void *to = k->tier_stage != NULL ? k->tier_stage : dst;
    if (!(disk ? disk_tier_get(k->disk, b, to) : tier_get(k->tier, b, to)))
        return false;
    char err[256];
    if (k->tier_stage != NULL &&
        devmem_write(dst, k->tier_stage, pool_header(k->pool)->block_bytes, err, sizeof(err)) != 0) {
        kvd_log(k, "tiers: %s", err);
        return false;
    }
    return true;
}

/* Whether tier_fetch would give block b: it is in a tier whose restores still
 * pay (else counted as declined). */
static bool tier_has_block(void *user, const struct prefix_tier_block *b)
{
    struct kvd *k = ((struct kvd_tiers *)user)->k;
    if (k->tier != NULL && tier_has(k->tier, b)) {
        if (restore_pays(k, k->restore_ns_block))
            return true;
        k->st.host_declined++;
        return false;
    }
    if (k->disk != NULL && disk_tier_has(k->disk, b)) {
        if (restore_pays(k, k->disk_ns_block))
            return true;
        k->st.disk_declined++;
    }
    return false;
}

/* The block that continues a prefix (tier_has_block said it is there and worth
 * it): from the host tier, else from disk, each copy timed, on kvd's loop
 * (KVD_TIER_SYNC=1, what the restore thread is measured against). */
static bool tier_fetch(void *user, const struct prefix_tier_block *b, void *dst)
{
    struct kvd_tiers *t = user;
    struct kvd *k = t->k;
    const double t0 = cli_now_ms();
    if (k->tier != NULL && tier_read(k, b, dst, false)) {
        kvd_ewma(&k->restore_ns_block, (cli_now_ms() - t0) * 1e6);
        t->got_host += b->part == 0;    /* tokens are counted once, by part 0's blocks */
        return true;
    }
    const double t1 = cli_now_ms();
    if (k->disk != NULL && tier_read(k, b, dst, true)) {
        kvd_ewma(&k->disk_ns_block, (cli_now_ms() - t1) * 1e6);
        t->got_disk += b->part == 0;
        return true;
    }
    return false;
}

/* The same, started on the restore thread for the request whose begin runs
 * (it waits for its copies in REQ_RESTORING). */
static void tier_start(void *user, const struct prefix_tier_block *b, uint32_t logical, void *dst)
{
    struct kvd_tiers *t = user;
    struct request *r = t->begin_for;
    if (restorer_submit(t->k->restorer, r, b, logical, dst))
        r->restoring++;
    else if (logical < r->restore_bad)
        r->restore_bad = logical;   /* out of memory: that block is a miss */
}

static void disk_log(void *user, const char *line)
{
    kvd_log(user, "%s", line);
}

/* The digest of the model's tokenizer and chat template (every tokenizer.*
 * key of its GGUF): disk files of another tokenizer are not used. */
static void tokenizer_digest(const model_t *m, uint8_t out[16])
{
    XXH3_state_t *st = XXH3_createState();
    XXH3_128bits_reset(st);
    const gguf_ctx_t *g = m->gguf;
    for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
        const struct gguf_kv *kv = gguf_kv_at(g, i);
        if (kv->key.len < 10 || memcmp(kv->key.ptr, "tokenizer.", 10) != 0)
            continue;
        XXH3_128bits_update(st, kv->key.ptr, kv->key.len);
        XXH3_128bits_update(st, &kv->type, sizeof(kv->type));
        if (kv->type == GGUF_VT_STRING) {
            uint64_t len;       /* stored as its length, then its bytes */
            memcpy(&len, kv->data, 8);
            XXH3_128bits_update(st, kv->data, 8 + len);
        } else if (kv->type == GGUF_VT_ARRAY && kv->strs != NULL) {
            for (uint64_t a = 0; a < kv->arr_len; a++)
                XXH3_128bits_update(st, kv->strs[a].ptr, kv->strs[a].len);
        } else if (kv->type == GGUF_VT_ARRAY) {
            XXH3_128bits_update(st, kv->data, kv->arr_len * gguf_vtype_size(kv->arr_type));
        } else {
            XXH3_128bits_update(st, kv->data, gguf_vtype_size(kv->type));
        }
    }
    const XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    memcpy(out, &h.low64, 8);
    memcpy(out + 8, &h.high64, 8);
}

void tiers_sync(struct kvd *k, bool sync)
{
    if (k->restorer == NULL)
        return;     /* no tiers, or copies on the loop already (KVD_TIER_SYNC=1) */
    struct prefix_tier t = { .committed = k->disk ? tier_committed : NULL, .evicted = tier_evicted,
                             .has = tier_has_block, .user = k->tiers };
    if (sync)
        t.fetch = tier_fetch;
    else
        t.start = tier_start;
    prefix_set_tier(k->px, &t);
}

/* --host-cache, --cache-dir: the tiers below the pool (shm/tier.h, shm/disktier.h). */
void tiers_setup(struct kvd *k, const struct pool_layout *lay)
{
    char err[512];
    const struct kvd_options *o = &k->o;
    const uint64_t bb = pool_header(k->pool)->block_bytes;
    const char *opt = o->host_cache_bytes > 0 ? "--host-cache" : "--cache-dir";
    if ((k->tiers = calloc(1, sizeof(*k->tiers))) == NULL)
        cli_die("%s: out of memory", opt);
    k->tiers->k = k;
    if (o->gpu >= 0 && (k->tier_stage = devmem_host_alloc(bb)) == NULL)
        cli_die("%s: no page-locked host memory for the GPU pool's copies", opt);
    if (o->host_cache_bytes > 0) {
        k->tier = tier_new(o->host_cache_bytes, lay->block_tokens, bb, err, sizeof(err));
        if (k->tier == NULL)
            cli_die("--host-cache: %s", err);
        kvd_log(k, "host tier: up to %.1f MiB (%llu blocks of %llu bytes uncompressed)",
                o->host_cache_bytes / 1048576.0, (unsigned long long)(o->host_cache_bytes / bb),
                (unsigned long long)bb);
    }
    if (o->cache_dir != NULL) {
        struct disk_tier_layout dl = {
            .k_type = lay->k_type, .v_type = lay->v_type, .rotate = lay->rotate,
            .block_tokens = lay->block_tokens, .block_bytes = bb, .n_parts = lay->parts.n_parts,
            .part_layers = lay->parts.part_layers,
        };
        memcpy(dl.model, lay->fingerprint, 16);
        tokenizer_digest(k->model, dl.tokenizer);
        const XXH128_hash_t kd = XXH3_128bits(pool_header(k->pool)->secret, POOL_SECRET_BYTES);
        memcpy(dl.keys, &kd.low64, 8);
        memcpy(dl.keys + 8, &kd.high64, 8);
        disk_tier_mac_key(pool_header(k->pool)->secret, POOL_SECRET_BYTES, dl.mac_key);
        const uint64_t budget = o->disk_cache_bytes ? o->disk_cache_bytes : 4ull << 30;
        k->disk = disk_tier_open(o->cache_dir, budget, &dl, disk_log, k, err, sizeof(err));
        if (k->disk == NULL)
            cli_die("--cache-dir: %s", err);
        struct disk_tier_stats ds;
        disk_tier_stats(k->disk, &ds);
        kvd_log(k, "disk tier %s: up to %.1f MiB; %llu blocks found (%llu of another model or layout ignored, "
                "%llu damaged removed, %llu refused)", o->cache_dir, budget / 1048576.0,
                (unsigned long long)(ds.files), (unsigned long long)ds.ignored, (unsigned long long)ds.corrupt,
                (unsigned long long)ds.refused);
    }
    struct prefix_tier t = { .committed = k->disk ? tier_committed : NULL, .evicted = tier_evicted,
                             .has = tier_has_block, .user = k->tiers };
    const char *sync = getenv("KVD_TIER_SYNC");
    if (sync != NULL && strcmp(sync, "1") == 0) {
        t.fetch = tier_fetch;
        kvd_log(k, "tiers: KVD_TIER_SYNC=1: blocks are copied back on kvd's loop");
    } else {
        k->restorer = restorer_new(k->tier, k->disk, bb, lay->block_tokens, o->gpu,
                                   err, sizeof(err));
        if (k->restorer == NULL)
            cli_die("%s: %s", opt, err);
        t.start = tier_start;
    }
    if (prefix_set_tier(k->px, &t) != 0)
        cli_die("%s: this pool cannot have tiers below it", opt);
}

int64_t tiers_seq_begin(struct kvd *k, prefix_t *px, struct request *r, const int32_t *tok, uint64_t n_look,
                        uint32_t *wait, uint32_t *from_host, uint32_t *from_disk)
{
    struct kvd_tiers *t = k->tiers;
    if (t != NULL) {
        t->begin_for = r;
        t->got_host = t->got_disk = 0;
    }
    const int64_t cached = prefix_seq_begin(px, &r->ps, r->ns, tok, n_look, wait);
    *from_host = t != NULL ? t->got_host : 0;
    *from_disk = t != NULL ? t->got_disk : 0;
    if (t != NULL)
        t->begin_for = NULL;
    return cached;
}

void tiers_fini(struct kvd *k)
{
    restorer_destroy(&k->restorer);    /* every copy collected by req_release_all */
    disk_tier_close(&k->disk);         /* what is queued is written first */
    tier_destroy(&k->tier);
    devmem_host_free(k->tier_stage);
    k->tier_stage = NULL;
    free(k->tiers);
    k->tiers = NULL;
}
