/* pool.c - the KV pool's segment: sizing, creation, adoption, attachment. */
#include "pool.h"

#include "kvformat.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "units.h"

#define HUGE_ALIGN (2u << 20)  /* data of large pools starts on a 2 MiB boundary */
#define PAGE_ALIGN 4096u

struct pool {
    uint8_t *base;          /* the whole segment */
    size_t size;            /* bytes mapped */
    int fd;                 /* shm descriptor (holds the owner's flock); -1 if anonymous */
    bool owner;             /* this process owns the metadata */
    bool unlink_on_close;   /* owner: remove the name on close */
    bool huge;              /* huge pages advised and enabled for shmem */
    bool fresh;             /* this open made the segment: its metadata is empty */
    char name[POOL_NAME_MAX + 2]; /* "/name", or "" when anonymous */
    uint8_t *dev_base;      /* device pool: where this process mapped the KV data; NULL before */
    uint64_t dev_bytes;     /* bytes mapped at dev_base */
};

struct pool_params pool_default_params(void)
{
    struct pool_params p = { .name = NULL, .kv_bytes = 0, .n_blocks = 1024 };
    return p;
}

uint32_t pool_abi(void)
{
    return (POOL_VERSION << 24) ^ ((uint32_t)sizeof(struct pool_header) << 12) ^
           ((uint32_t)sizeof(struct pool_block) << 4) ^ (uint32_t)sizeof(struct pool_cache_state);
}

static uint64_t align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) / a * a;
}

static uint32_t pow2_at_least(uint32_t n)
{
    uint32_t b = 16;
    while (b < n && b < (1u << 31))
        b <<= 1;
    return b;
}

static int layout_check(const struct pool_layout *lay, char *err, size_t errlen)
{
    if (lay->n_layer == 0 || lay->n_layer > 1024 || lay->n_head_kv == 0 || lay->n_head_kv > 1024 ||
        lay->head_dim == 0 || lay->head_dim > 4096)
        return kvd_seterr(err, errlen, KVD_EINVAL,
                          "pool: model shape out of range (%u layers, %u KV heads, head dim %u)",
                          lay->n_layer, lay->n_head_kv, lay->head_dim);
    if (lay->block_tokens == 0 || lay->block_tokens > 4096)
        return kvd_seterr(err, errlen, KVD_EINVAL, "pool: block size %u is out of range (1..4096)",
                          lay->block_tokens);
    char why[160];
    if (kv_format_check(lay->head_dim, lay->k_type, lay->v_type, lay->rotate, why, sizeof(why)))
        return kvd_seterr(err, errlen, KVD_EINVAL, "pool: %s", why);
    if (kv_parts_check(lay->n_layer, &lay->parts, why, sizeof(why)))
        return kvd_seterr(err, errlen, KVD_EINVAL, "pool: %s", why);
    return 0;
}

/* KV bytes of one token over all layers (the seed's formula). */
static uint64_t layout_token_bytes(const struct pool_layout *lay)
{
    return kv_token_bytes(lay->n_layer, lay->n_head_kv, lay->head_dim, lay->k_type, lay->v_type);
}

/* A block holds one part's layers. */
static uint64_t layout_block_bytes(const struct pool_layout *lay)
{
    return kv_token_bytes(lay->parts.part_layers, lay->n_head_kv, lay->head_dim, lay->k_type,
                          lay->v_type) * lay->block_tokens;
}

#define MAX_DEVICE 1023  /* largest CUDA device index a header may name */

/* Offsets of a segment of n blocks; a device pool's segment ends with its metadata. */
static void layout_offsets(const struct pool_layout *lay, uint32_t n, bool on_device,
                           struct pool_header *h)
{
    uint64_t bb = layout_block_bytes(lay);
    h->n_blocks = n;
    h->n_buckets = pow2_at_least(n);
    h->block_bytes = bb;
    h->records_off = POOL_HEADER_BYTES;
    h->tokens_off = align_up(h->records_off + (uint64_t)n * sizeof(struct pool_block), 64);
    h->buckets_off = align_up(h->tokens_off + (uint64_t)n * lay->block_tokens * 4, 64);
    uint64_t meta_end = h->buckets_off + (uint64_t)h->n_buckets * 4;
    uint64_t data_bytes = (uint64_t)n * bb;
    h->kv_bytes = data_bytes;
    if (on_device) {
        h->data_off = align_up(meta_end, PAGE_ALIGN);
        h->total_bytes = h->data_off;
        return;
    }
    h->data_off = align_up(meta_end, data_bytes >= 64ull * HUGE_ALIGN ? HUGE_ALIGN : PAGE_ALIGN);
    h->total_bytes = h->data_off + data_bytes;
}

static bool params_on_device(const struct pool_params *p)
{
    return p->kv_where == POOL_KV_DEVICE;
}

/* The segment holds the metadata alone: the KV data is on a device or on another host. */
static bool params_meta_only(const struct pool_params *p)
{
    return p->kv_where == POOL_KV_DEVICE || p->kv_where == POOL_KV_REMOTE;
}

/* A layout whose parts were left zero (made by hand, for a model without
 * windows) means one part of all layers: *buf with that, else lay itself. */
static const struct pool_layout *layout_norm(const struct pool_layout *lay, struct pool_layout *buf)
{
    if (lay->parts.n_parts != 0)
        return lay;
    *buf = *lay;
    kv_parts_single(lay->n_layer, &buf->parts);
    return buf;
}

int pool_plan(const struct pool_layout *lay, const struct pool_params *p,
              struct pool_capacity *cap, char *err, size_t errlen)
{
    struct pool_layout lbuf;
    lay = layout_norm(lay, &lbuf);
    int rc = layout_check(lay, err, errlen);
    if (rc)
        return rc;
    if (p->kv_where != 0 && p->kv_where != POOL_KV_HOST && p->kv_where != POOL_KV_DEVICE &&
        p->kv_where != POOL_KV_REMOTE)
        return kvd_seterr(err, errlen, KVD_EINVAL, "pool: unknown KV location %u", p->kv_where);
    if (p->kv_where == POOL_KV_REMOTE && p->name != NULL)
        return kvd_seterr(err, errlen, KVD_EINVAL, "pool: a remote host's pool has no name here");
    bool dev = params_meta_only(p);
    if (params_on_device(p) && (p->kv_device < 0 || p->kv_device > MAX_DEVICE))
        return kvd_seterr(err, errlen, KVD_EINVAL, "pool: device %d is out of range (0..%d)",
                          p->kv_device, MAX_DEVICE);
    uint64_t bb = layout_block_bytes(lay);
    uint64_t over = sizeof(struct pool_block) + (uint64_t)lay->block_tokens * 4 + 8;
    uint64_t n;
    struct pool_header h;
    if (p->kv_bytes == 0) {
        if (p->n_blocks == 0)
            return kvd_seterr(err, errlen, KVD_EINVAL,
                              "pool: the KV budget is zero (give a size or a block count)");
        n = p->n_blocks;
    } else {
        /* a device budget buys blocks alone: the metadata is host memory */
        n = p->kv_bytes / (dev ? bb : bb + over);
        if (n > UINT32_MAX - 1)
            n = UINT32_MAX - 1;
        while (n > 0 && !dev) {
            layout_offsets(lay, (uint32_t)n, false, &h);
            if (h.total_bytes <= p->kv_bytes)
                break;
            /* step down by the excess in whole blocks, at least one */
            uint64_t over_by = (h.total_bytes - p->kv_bytes + bb - 1) / bb;
            n = over_by < n ? n - over_by : 0;
        }
        if (n == 0) {
            layout_offsets(lay, 1, dev, &h);
            return kvd_seterr(err, errlen, KVD_EINVAL,
                              "pool: a budget of %llu bytes is smaller than one block "
                              "(%llu bytes%s)",
                              (unsigned long long)p->kv_bytes,
                              (unsigned long long)(dev ? bb : h.total_bytes),
                              dev ? "" : " with its metadata");
        }
    }
    if (n > UINT32_MAX - 1)
        return kvd_seterr(err, errlen, KVD_ERANGE, "pool: %llu blocks is too many",
                          (unsigned long long)n);
    layout_offsets(lay, (uint32_t)n, dev, &h);
    cap->bytes_per_token = layout_token_bytes(lay);
    cap->block_bytes = bb;
    cap->overhead_per_block = over;
    cap->n_blocks = (uint32_t)n;
    cap->n_tokens = n * lay->block_tokens;
    cap->total_bytes = h.total_bytes;
    cap->data_bytes = h.kv_bytes;
    cap->kv_device = params_on_device(p) ? p->kv_device : -1;
    return 0;
}

void pool_describe(const struct pool_layout *lay, const struct pool_capacity *cap, uint32_t ctx,
                   char *buf, size_t len)
{
    struct pool_layout lbuf;
    lay = layout_norm(lay, &lbuf);
    char total[32], blk[32], meta[32], where[64] = "";
    if (cap->kv_device >= 0)
        snprintf(where, sizeof(where), " on GPU %d (+ %s of metadata in host memory)",
                 cap->kv_device, kvd_format_bytes(cap->total_bytes, meta, sizeof(meta)));
    /* a pool of parts holds a token in a block per part: its count of whole tokens depends
     * on the windows, so it gives the blocks and the bytes a token takes in all layers */
    char tokens[48] = "";
    if (lay->parts.n_parts == 1)
        snprintf(tokens, sizeof(tokens), " = %llu tokens", (unsigned long long)cap->n_tokens);
    int n = snprintf(buf, len,
                     "%s%s: %u blocks of %u tokens (%s each)%s at %llu bytes/token "
                     "(%u layers x %u KV heads x %u dims, K %s + V %s%s%s)",
                     kvd_format_bytes(cap->kv_device >= 0 ? cap->data_bytes : cap->total_bytes,
                                      total, sizeof(total)),
                     where, cap->n_blocks,
                     lay->block_tokens, kvd_format_bytes(cap->block_bytes, blk, sizeof(blk)),
                     tokens, (unsigned long long)cap->bytes_per_token,
                     lay->n_layer, lay->n_head_kv, lay->head_dim, kv_type_name(lay->k_type),
                     kv_type_name(lay->v_type), lay->rotate ? ", rotated " : "",
                     lay->rotate ? kv_rotate_name(lay->rotate) : "");
    if (lay->parts.n_parts > 1 && n > 0 && (size_t)n < len) {
        uint32_t windowed = 0;
        for (uint32_t i = 0; i < lay->parts.n_parts; i++)
            windowed += lay->parts.window[i] != 0;
        n += snprintf(buf + n, len - (size_t)n,
                      "; a block holds %u layers: %u full part%s, %u windowed (window %u)",
                      lay->parts.part_layers, lay->parts.n_parts - windowed,
                      lay->parts.n_parts - windowed == 1 ? "" : "s", windowed,
                      lay->parts.window[lay->parts.n_parts - 1]);
    }
    if (ctx && n > 0 && (size_t)n < len) {
        uint64_t per_seq = kv_parts_blocks_held(&lay->parts, ctx, lay->block_tokens);
        uint64_t fit = cap->n_blocks / per_seq;
        snprintf(buf + n, len - (size_t)n, "; %llu sequence%s of %u tokens fit%s",
                 (unsigned long long)fit, fit == 1 ? "" : "s", ctx,
                 fit ? "" : " (shorter ones share it)");
    }
}

/* ---- header checks ------------------------------------------------------------------ */

/* Checks a header against a layout and the segment's size; 0 or KVD_EFORMAT /
 * KVD_EUNSUPPORTED with the first difference in err. */
static int header_check(const struct pool_header *h, uint64_t size, const struct pool_layout *lay,
                        char *err, size_t errlen)
{
    if (h->magic != POOL_MAGIC)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "not a kvd pool (bad magic)");
    if (h->version != POOL_VERSION || h->abi != pool_abi())
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "made by another build of kvd (version %u, abi %08x; this build: %u, %08x)",
                          h->version, h->abi, POOL_VERSION, pool_abi());
    const struct pool_layout *l = &h->layout;
    if (memcmp(l->fingerprint, lay->fingerprint, 16) != 0)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "made for another model (fingerprint differs)");
    if (l->n_layer != lay->n_layer || l->n_head_kv != lay->n_head_kv || l->head_dim != lay->head_dim)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "made for another model shape (%u layers, %u KV heads, head dim %u)",
                          l->n_layer, l->n_head_kv, l->head_dim);
    if (l->block_tokens != lay->block_tokens)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "made with blocks of %u tokens, not %u",
                          l->block_tokens, lay->block_tokens);
    if (l->k_type != lay->k_type || l->v_type != lay->v_type)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "made with KV types K %s / V %s, not K %s / V %s",
                          kv_type_name(l->k_type), kv_type_name(l->v_type), kv_type_name(lay->k_type),
                          kv_type_name(lay->v_type));
    if (l->rotate != lay->rotate)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "made with rotation %s, not %s",
                          kv_rotate_name(l->rotate), kv_rotate_name(lay->rotate));
    if (memcmp(&l->parts, &lay->parts, sizeof(l->parts)) != 0)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "made with blocks of %u parts of %u layers, not %u of %u",
                          l->parts.n_parts, l->parts.part_layers, lay->parts.n_parts,
                          lay->parts.part_layers);
    if (h->n_blocks == 0 || h->n_blocks == UINT32_MAX)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "corrupt header (block count %u)", h->n_blocks);
    bool dev = h->kv_where == POOL_KV_DEVICE || h->kv_where == POOL_KV_REMOTE;
    if (!(h->kv_where == POOL_KV_HOST && h->kv_device == -1) &&
        !(h->kv_where == POOL_KV_REMOTE && h->kv_device == -1) &&
        !(h->kv_where == POOL_KV_DEVICE && h->kv_device >= 0 && h->kv_device <= MAX_DEVICE))
        return kvd_seterr(err, errlen, KVD_EFORMAT, "corrupt header (KV location %u, device %d)",
                          h->kv_where, h->kv_device);
    struct pool_header want;
    layout_offsets(lay, h->n_blocks, dev, &want);
    if (h->n_buckets != want.n_buckets || h->block_bytes != want.block_bytes ||
        h->records_off != want.records_off || h->tokens_off != want.tokens_off ||
        h->buckets_off != want.buckets_off || h->data_off != want.data_off ||
        h->total_bytes != want.total_bytes || h->kv_bytes != want.kv_bytes)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "corrupt header (offsets do not match its layout)");
    if (h->total_bytes > size)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "truncated (%llu bytes; its header says %llu)", (unsigned long long)size,
                          (unsigned long long)h->total_bytes);
    return 0;
}

/* ---- names and mappings --------------------------------------------------------------- */

static int name_norm(const char *name, char out[POOL_NAME_MAX + 2], char *err, size_t errlen)
{
    const char *s = name[0] == '/' ? name + 1 : name;
    size_t n = strlen(s);
    if (n == 0 || n > POOL_NAME_MAX)
        return kvd_seterr(err, errlen, KVD_EINVAL, "pool: name '%s' must have 1..%u characters",
                          name, POOL_NAME_MAX);
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.'))
            return kvd_seterr(err, errlen, KVD_EINVAL,
                              "pool: name '%s' may hold only letters, digits, '-', '_' and '.'", name);
    }
    out[0] = '/';
    memcpy(out + 1, s, n + 1);
    return 0;
}

static bool shmem_thp_enabled(void)
{
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
    if (f == NULL)
        return false;
    char buf[256] = { 0 };
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    return strstr(buf, "[always]") || strstr(buf, "[within_size]") || strstr(buf, "[advise]") ||
           strstr(buf, "[force]");
}

/* Maps size bytes of fd (or anonymous shared memory when fd < 0). */
static uint8_t *map_segment(int fd, size_t size, int prot)
{
    int flags = MAP_SHARED | (fd < 0 ? MAP_ANONYMOUS : 0);
    void *m = mmap(NULL, size, prot, flags, fd, 0);
    return m == MAP_FAILED ? NULL : m;
}

static void advise_huge(pool_t *p, const struct pool_header *h)
{
    if (h->kv_where != POOL_KV_HOST || h->data_off % HUGE_ALIGN != 0)
        return;
    if (madvise(p->base + h->data_off, h->total_bytes - h->data_off, MADV_HUGEPAGE) == 0)
        p->huge = shmem_thp_enabled();
}

/* Fills buf with random bytes; 0 or KVD_EIO. */
static int random_bytes(void *buf, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = getrandom((uint8_t *)buf + got, len - got, 0);
        if (r < 0 && errno != EINTR)
            return KVD_EIO;
        if (r > 0)
            got += (size_t)r;
    }
    return 0;
}

/* Writes a fresh, empty header (state INIT) for n blocks. */
static int header_init(struct pool_header *h, const struct pool_layout *lay, uint32_t n,
                       const struct pool_params *pp)
{
    memset(h, 0, sizeof(*h));
    h->magic = POOL_MAGIC;
    h->version = POOL_VERSION;
    h->abi = pool_abi();
    h->state = POOL_STATE_INIT;
    h->owner_pid = (int32_t)getpid();
    h->generation = 1;
    h->layout = *lay;
    bool dev = params_on_device(pp);
    layout_offsets(lay, n, params_meta_only(pp), h);
    h->kv_where = dev ? POOL_KV_DEVICE : pp->kv_where == POOL_KV_REMOTE ? POOL_KV_REMOTE : POOL_KV_HOST;
    h->kv_device = dev ? pp->kv_device : -1;
    if (pp->secret != NULL)
        memcpy(h->secret, pp->secret, POOL_SECRET_BYTES);
    else if (random_bytes(h->secret, POOL_SECRET_BYTES) != 0)
        return KVD_EIO;
    if (random_bytes(&h->instance, sizeof(h->instance)) != 0)
        return KVD_EIO;
    /* records stay all-zero; prefix_new builds the free list of a fresh pool */
    h->cache.free_head = POOL_NONE;
    h->cache.lru_head = POOL_NONE;
    h->cache.lru_tail = POOL_NONE;
    return 0;
}

static pool_t *pool_alloc_struct(const char *norm_name, char *err, size_t errlen)
{
    pool_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "pool: out of memory");
        return NULL;
    }
    p->fd = -1;
    if (norm_name)
        snprintf(p->name, sizeof(p->name), "%s", norm_name);
    return p;
}

static void pool_free_struct(pool_t *p)
{
    if (p->base)
        munmap(p->base, p->size);
    if (p->fd >= 0)
        close(p->fd);
    free(p);
}

/* Whether the segment behind fd may be mapped: this user's, and no one
 * else's to read or write. 0, or KVD_EPERM with the reason. */
static int segment_check(int fd, const char *name, char *err, size_t errlen)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return kvd_seterr(err, errlen, KVD_EIO, "pool %s: fstat: %s", name, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return kvd_seterr(err, errlen, KVD_EPERM, "pool %s is not a shared memory segment", name);
    if (st.st_uid != geteuid())
        return kvd_seterr(err, errlen, KVD_EPERM, "pool %s belongs to uid %u, not to this user (uid %u): "
                          "refusing to map it", name, (unsigned)st.st_uid, (unsigned)geteuid());
    if ((st.st_mode & 077) != 0)
        return kvd_seterr(err, errlen, KVD_EPERM, "pool %s has mode 0%o: other users can map it; refusing it "
                          "(remove it, or make it 0600)", name, (unsigned)(st.st_mode & 0777));
    return 0;
}

/* Opens (creating when absent) the shm object and takes the owner's lock.
 * *created says whether this call made it. With exclusive, an existing
 * object is not opened: KVD_EPERM (the name is taken). */
static int open_locked(const char *name, bool exclusive, int *fd_out, bool *created, char *err, size_t errlen)
{
    for (int attempt = 0; attempt < 4; attempt++) {
        int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
        *created = fd >= 0;
        if (fd < 0 && errno == EEXIST && exclusive)
            return kvd_seterr(err, errlen, KVD_EPERM, "pool %s: the name is taken", name);
        if (fd < 0 && errno == EEXIST)
            fd = shm_open(name, O_RDWR, 0);
        if (fd < 0 && errno == ENOENT)
            continue; /* removed between the two opens */
        if (fd < 0)
            return kvd_seterr(err, errlen, errno == EACCES ? KVD_EPERM : KVD_EIO, "pool %s: cannot open: %s",
                              name, strerror(errno));
        int rc;
        if (!*created && (rc = segment_check(fd, name, err, errlen)) != 0) {
            close(fd);
            return rc;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            int pid = 0;
            struct stat st;
            if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct pool_header)) {
                struct pool_header *h = (struct pool_header *)map_segment(fd, sizeof(*h), PROT_READ);
                if (h) {
                    pid = h->owner_pid;
                    munmap(h, sizeof(*h));
                }
            }
            close(fd);
            return kvd_seterr(err, errlen, KVD_ESTATE, "pool %s is in use by a running owner (pid %d)",
                              name, pid);
        }
        *fd_out = fd;
        return 0;
    }
    return kvd_seterr(err, errlen, KVD_EIO, "pool %s: keeps disappearing while being opened", name);
}

/* Decides whether the existing segment behind fd can be adopted; 1 yes, 0 no
 * (why in reason). */
static int can_adopt(int fd, const struct pool_layout *lay, uint32_t n_blocks, bool reuse,
                     bool on_device, char *reason, size_t rlen)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < POOL_HEADER_BYTES) {
        snprintf(reason, rlen, "too small to hold a header");
        return 0;
    }
    struct pool_header *h = (struct pool_header *)map_segment(fd, POOL_HEADER_BYTES, PROT_READ);
    if (h == NULL) {
        snprintf(reason, rlen, "cannot be mapped");
        return 0;
    }
    int ok = 0;
    char why[256];
    if (h->magic != POOL_MAGIC)
        snprintf(reason, rlen, "not a kvd pool (bad magic)");
    else if (h->state == POOL_STATE_INIT)
        snprintf(reason, rlen, "left half-written by a creator that died");
    else if (h->state == POOL_STATE_LIVE)
        snprintf(reason, rlen, "stale: its owner (pid %d) died without closing it", h->owner_pid);
    else if (h->state != POOL_STATE_CLOSED)
        snprintf(reason, rlen, "corrupt header (state %u)", h->state);
    else if (header_check(h, (uint64_t)st.st_size, lay, why, sizeof(why)) != 0)
        snprintf(reason, rlen, "%s", why);
    else if (!reuse)
        snprintf(reason, rlen, "a fresh pool was asked for");
    else if (h->kv_where == POOL_KV_DEVICE)
        snprintf(reason, rlen, "its KV data was in GPU %d's memory, which did not outlive its owner",
                 h->kv_device);
    else if (on_device)
        snprintf(reason, rlen, "its KV data is in host memory; this owner keeps it on a GPU");
    else if (h->n_blocks != n_blocks)
        snprintf(reason, rlen, "it holds %u blocks, not %u", h->n_blocks, n_blocks);
    else
        ok = 1;
    munmap(h, POOL_HEADER_BYTES);
    return ok;
}

/* pool_create; *locked says that it failed because a live owner holds the pool. */
static pool_t *create(const struct pool_layout *lay, const struct pool_params *pp, char *replaced,
                      size_t replaced_len, char *err, size_t errlen, bool *locked)
{
    *locked = false;
    struct pool_layout lbuf;
    lay = layout_norm(lay, &lbuf);
    struct pool_capacity cap;
    if (replaced && replaced_len)
        replaced[0] = 0;
    if (pool_plan(lay, pp, &cap, err, errlen) != 0)
        return NULL;
    char norm[POOL_NAME_MAX + 2];
    if (pp->name && name_norm(pp->name, norm, err, errlen) != 0)
        return NULL;
    pool_t *p = pool_alloc_struct(pp->name ? norm : NULL, err, errlen);
    if (p == NULL)
        return NULL;
    p->owner = true;
    p->unlink_on_close = pp->name != NULL && pp->unlink_on_close;
    p->size = cap.total_bytes;

    bool adopt = false;
    if (pp->name) {
        bool created;
        int orc = open_locked(norm, pp->exclusive, &p->fd, &created, err, errlen);
        for (int retry = 0; orc == KVD_EPERM && pp->exclusive && retry < 4; retry++) {
            /* the name is taken (another user may have made it first): one of
             * our own, with a random suffix nobody can guess */
            uint64_t r;
            if (random_bytes(&r, sizeof(r)) != 0)
                break;
            char alt[POOL_NAME_MAX + 2];
            snprintf(alt, sizeof(alt), "%.*s-%016llx", (int)(POOL_NAME_MAX - 17), norm, (unsigned long long)r);
            snprintf(norm, sizeof(norm), "%s", alt);
            snprintf(p->name, sizeof(p->name), "%s", alt);
            orc = open_locked(norm, true, &p->fd, &created, err, errlen);
        }
        if (orc != 0) {
            *locked = orc == KVD_ESTATE;
            free(p);
            return NULL;
        }
        char reason[300] = "";
        if (!created) {
            adopt = can_adopt(p->fd, lay, cap.n_blocks, pp->reuse, params_on_device(pp), reason,
                              sizeof(reason)) == 1;
            if (!adopt) {
                /* Replace it with a new object, so that any process still mapping
                 * the old memory keeps it intact; we hold the old one's lock while
                 * the new one is made. */
                if (replaced && replaced_len)
                    snprintf(replaced, replaced_len, "replaced pool %s: %s", norm, reason);
                shm_unlink(norm);
                int old = p->fd;
                p->fd = -1;
                bool c2;
                int rc = open_locked(norm, false, &p->fd, &c2, err, errlen);
                close(old);
                if (rc != 0) {
                    free(p);
                    return NULL;
                }
            }
        }
        if (!adopt) {
            if (ftruncate(p->fd, 0) != 0 || ftruncate(p->fd, (off_t)cap.total_bytes) != 0) {
                kvd_seterr(err, errlen, KVD_EIO, "pool %s: cannot size it to %llu bytes: %s", norm,
                           (unsigned long long)cap.total_bytes, strerror(errno));
                goto fail_unlink;
            }
            /* reserve the memory now: a tmpfs that is too small is an error here,
             * not a SIGBUS on first touch */
            int rc = posix_fallocate(p->fd, 0, (off_t)cap.total_bytes);
            if (rc != 0) {
                kvd_seterr(err, errlen, KVD_ENOMEM,
                           "pool %s: cannot reserve %llu bytes of shared memory: %s "
                           "(the size of /dev/shm limits the pool)",
                           norm, (unsigned long long)cap.total_bytes, strerror(rc));
                goto fail_unlink;
            }
        }
    }
    p->base = map_segment(p->fd, p->size, PROT_READ | PROT_WRITE);
    if (p->base == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "pool: cannot map %llu bytes: %s",
                   (unsigned long long)p->size, strerror(errno));
        goto fail_unlink;
    }
    struct pool_header *h = (struct pool_header *)p->base;
    if (adopt) {
        h->owner_pid = (int32_t)getpid();
        h->generation++;
        if (random_bytes(&h->instance, sizeof(h->instance)) != 0) {
            kvd_seterr(err, errlen, KVD_EIO, "pool: cannot read random bytes for its instance");
            goto fail_unlink;
        }
        h->state = POOL_STATE_LIVE;
    } else {
        if (header_init(h, lay, cap.n_blocks, pp) != 0) {
            kvd_seterr(err, errlen, KVD_EIO, "pool: cannot read random bytes for the secret");
            goto fail_unlink;
        }
        h->state = POOL_STATE_LIVE;
        p->fresh = true;
    }
    advise_huge(p, h);
    return p;

fail_unlink:
    if (pp->name)
        shm_unlink(norm);
    pool_free_struct(p);
    return NULL;
}

pool_t *pool_create(const struct pool_layout *lay, const struct pool_params *pp,
                    char *replaced, size_t replaced_len, char *err, size_t errlen)
{
    bool locked;
    return create(lay, pp, replaced, replaced_len, err, errlen, &locked);
}

/* pool_attach; *code: why it failed (a KVD_E* code). */
static pool_t *attach(const char *name, const struct pool_layout *lay, char *err, size_t errlen, int *code);

pool_t *pool_attach(const char *name, const struct pool_layout *lay, char *err, size_t errlen)
{
    int code;
    return attach(name, lay, err, errlen, &code);
}

static pool_t *attach(const char *name, const struct pool_layout *lay, char *err, size_t errlen, int *code)
{
    *code = KVD_EIO;
    struct pool_layout lbuf;
    lay = layout_norm(lay, &lbuf);
    char norm[POOL_NAME_MAX + 2];
    if (name == NULL) {
        kvd_seterr(err, errlen, KVD_EINVAL, "pool: an anonymous pool cannot be attached by name");
        return NULL;
    }
    if (name_norm(name, norm, err, errlen) != 0)
        return NULL;
    pool_t *p = pool_alloc_struct(norm, err, errlen);
    if (p == NULL)
        return NULL;
    p->fd = shm_open(norm, O_RDWR, 0);
    if (p->fd < 0) {
        kvd_seterr(err, errlen, errno == ENOENT ? KVD_ENOTFOUND : errno == EACCES ? KVD_EPERM : KVD_EIO,
                   "pool %s: %s", norm, errno == ENOENT ? "no such pool (is its owner running?)" : strerror(errno));
        goto fail;
    }
    if ((*code = segment_check(p->fd, norm, err, errlen)) != 0)
        goto fail;
    struct stat st;
    if (fstat(p->fd, &st) != 0 || (uint64_t)st.st_size < POOL_HEADER_BYTES) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "pool %s: too small to hold a header", norm);
        goto fail;
    }
    struct pool_header *h = (struct pool_header *)map_segment(p->fd, POOL_HEADER_BYTES, PROT_READ);
    if (h == NULL) {
        kvd_seterr(err, errlen, KVD_EIO, "pool %s: cannot map its header", norm);
        goto fail;
    }
    char why[256];
    int rc = header_check(h, (uint64_t)st.st_size, lay, why, sizeof(why));
    uint32_t state = h->state;
    int pid = h->owner_pid;
    uint64_t total = h->total_bytes;
    munmap(h, POOL_HEADER_BYTES);
    if (rc != 0) {
        *code = rc;
        kvd_seterr(err, errlen, rc, "pool %s: %s", norm, why);
        goto fail;
    }
    if (state != POOL_STATE_LIVE) {
        kvd_seterr(err, errlen, KVD_ESTATE, "pool %s is not live (%s)", norm,
                   state == POOL_STATE_CLOSED ? "closed by its owner" : "still being created");
        goto fail;
    }
    /* a live pool whose owner's lock is free was left by a crashed owner */
    if (flock(p->fd, LOCK_SH | LOCK_NB) == 0) {
        flock(p->fd, LOCK_UN);
        kvd_seterr(err, errlen, KVD_ESTATE, "pool %s is stale: its owner (pid %d) is gone", norm, pid);
        goto fail;
    }
    p->size = total;
    p->base = map_segment(p->fd, p->size, PROT_READ | PROT_WRITE);
    if (p->base == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "pool %s: cannot map: %s", norm, strerror(errno));
        goto fail;
    }
    h = (struct pool_header *)p->base;
    /* workers never write metadata: make that a fault, not a corruption */
    if (mprotect(p->base, h->data_off, PROT_READ) != 0) {
        kvd_seterr(err, errlen, KVD_EIO, "pool %s: mprotect: %s", norm, strerror(errno));
        goto fail;
    }
    advise_huge(p, h);
    return p;
fail:
    pool_free_struct(p);
    return NULL;
}

pool_t *pool_join(const char *name, const struct pool_layout *lay, const struct pool_params *pp,
                  bool *created, char *err, size_t errlen)
{
    *created = false;
    if (name == NULL || (pp->kv_where != 0 && pp->kv_where != POOL_KV_HOST)) {
        kvd_seterr(err, errlen, KVD_EINVAL, "pool: a host's own pool needs a name and host memory");
        return NULL;
    }
    /* Another worker of this host may be creating it at the same moment: its
     * lock makes our create fail, and its pool is live a moment later. */
    int mismatched = 0;
    for (int attempt = 0; attempt < 50; attempt++) {
        int code;
        pool_t *p = attach(name, lay, err, errlen, &code);
        if (p != NULL)
            return p;
        struct pool_params cp = *pp;
        cp.name = name;
        cp.reuse = false;
        cp.unlink_on_close = true;
        char note[256];
        bool locked;
        p = create(lay, &cp, note, sizeof(note), err, errlen, &locked);
        if (p != NULL) {
            *created = true;
            return p;
        }
        if (!locked)
            return NULL;
        if (code == KVD_EUNSUPPORTED && ++mismatched >= 3) {
            /* its live owner made it for another model, layout or build (seen
             * three times: not a header half written by a creator at work) */
            return attach(name, lay, err, errlen, &code);
        }
        usleep(100000);
    }
    return NULL;
}

void pool_close(pool_t **pp)
{
    if (pp == NULL || *pp == NULL)
        return;
    pool_t *p = *pp;
    if (p->owner && p->base) {
        struct pool_header *h = (struct pool_header *)p->base;
        h->state = POOL_STATE_CLOSED;
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
    if (p->owner && p->unlink_on_close && p->name[0])
        shm_unlink(p->name);
    pool_free_struct(p); /* closing the descriptor drops the flock */
    *pp = NULL;
}

int pool_unlink(const char *name)
{
    char norm[POOL_NAME_MAX + 2];
    if (name == NULL || name_norm(name, norm, NULL, 0) != 0)
        return KVD_EINVAL;
    return shm_unlink(norm) == 0 ? 0 : KVD_ENOTFOUND;
}

int pool_reclaim_stale(const char *prefix, void (*log)(void *user, const char *name), void *user)
{
    DIR *d = opendir("/dev/shm");
    if (d == NULL)
        return 0;
    const size_t pl = strlen(prefix);
    int n = 0;
    const struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        const char *nm = e->d_name;
        if (strncmp(nm, prefix, pl) != 0)
            continue;
        char *end;
        const long pid = strtol(nm + pl, &end, 10);
        if (end == nm + pl || (*end != '\0' && *end != '-') || pid <= 0 || pid > INT32_MAX)
            continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue;   /* its process runs (or is another user's): not ours to judge */
        char norm[POOL_NAME_MAX + 2];
        if (name_norm(nm, norm, NULL, 0) != 0)
            continue;
        const int fd = shm_open(norm, O_RDWR, 0);
        if (fd < 0)
            continue;
        bool stale = false;
        struct stat st;
        if (segment_check(fd, norm, NULL, 0) == 0 && flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &st) == 0) {
            stale = true;   /* too small for a header: a creator died before writing one */
            if ((size_t)st.st_size >= sizeof(struct pool_header)) {
                const struct pool_header *h = (const struct pool_header *)map_segment(fd, sizeof(*h), PROT_READ);
                stale = h == NULL || h->magic != POOL_MAGIC || h->state != POOL_STATE_CLOSED;
                if (h != NULL)
                    munmap((void *)h, sizeof(*h));
            }
        }
        if (stale && shm_unlink(norm) == 0) {
            n++;
            if (log != NULL)
                log(user, nm);
        }
        close(fd);
    }
    closedir(d);
    return n;
}

bool pool_is_owner(const pool_t *p) { return p->owner; }
bool pool_is_fresh(const pool_t *p) { return p->fresh; }
struct pool_header *pool_header(const pool_t *p) { return (struct pool_header *)p->base; }
const char *pool_name(const pool_t *p) { return p->name[0] ? p->name : NULL; }
bool pool_huge_pages(const pool_t *p) { return p->huge; }

struct pool_block *pool_records(const pool_t *p)
{
    return (struct pool_block *)(p->base + pool_header(p)->records_off);
}

int32_t *pool_tokens(const pool_t *p)
{
    return (int32_t *)(p->base + pool_header(p)->tokens_off);
}

uint32_t *pool_buckets(const pool_t *p)
{
    return (uint32_t *)(p->base + pool_header(p)->buckets_off);
}

void *pool_data(const pool_t *p)
{
    if (pool_header(p)->kv_where == POOL_KV_REMOTE)
        return NULL;
    if (pool_header(p)->kv_where == POOL_KV_DEVICE)
        return p->dev_base;
    return p->base + pool_header(p)->data_off;
}

int pool_kv_device(const pool_t *p)
{
    const struct pool_header *h = pool_header(p);
    return h->kv_where == POOL_KV_DEVICE ? h->kv_device : -1;
}

int pool_set_device_kv(pool_t *p, void *base, uint64_t bytes)
{
    if (pool_header(p)->kv_where != POOL_KV_DEVICE)
        return KVD_ESTATE;
    if (base == NULL || bytes < pool_data_bytes(p))
        return KVD_EINVAL;
    p->dev_base = base;
    p->dev_bytes = bytes;
    return 0;
}

uint64_t pool_data_bytes(const pool_t *p)
{
    const struct pool_header *h = pool_header(p);
    return (uint64_t)h->n_blocks * h->block_bytes;
}

void *pool_block_addr(const pool_t *p, uint32_t id)
{
    const struct pool_header *h = pool_header(p);
    if (id >= h->n_blocks || h->kv_where == POOL_KV_REMOTE)
        return NULL;
    if (h->kv_where == POOL_KV_DEVICE)
        return p->dev_base ? p->dev_base + (uint64_t)id * h->block_bytes : NULL;
    return p->base + h->data_off + (uint64_t)id * h->block_bytes;
}
