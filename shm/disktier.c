/*
 * disktier.c - the disk tier (disktier.h): files, an index of them, and a
 * writer thread; the directory's key secret.
 */
#include "disktier.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY
#include <sodium.h>
#include <xxhash.h>

#include "err.h"
#include "kvformat.h"

#define MAGIC "KVDTIER\x01"
#define VERSION 2u              /* 2: keyed BLAKE2b MACs (1: unkeyed XXH3 checksums) */
#define MAC_BYTES 32u
#define QUEUE_MAX 16384         /* queued writes at most */
#define QUEUE_BYTES (256u << 20)/* and at most this much data */
#define NAME_LEN 37             /* 32 hex digits, ".kvb", NUL */

/* Header layout: offsets of the fixed fields (little-endian), then the token
 * ids, then the header's own checksum. */
enum {
    H_MAGIC = 0, H_VERSION = 8, H_SIZE = 12,
    H_MODEL = 16, H_TOKENIZER = 32, H_KTYPE = 48, H_VTYPE = 52, H_ROTATE = 56, H_BT = 60,
    H_BBYTES = 64, H_NPARTS = 72, H_PLAYERS = 76, H_KEYS = 80,
    H_KEY = 96, H_PARENT = 112, H_NS = 128, H_PATH = 144, H_DBYTES = 160, H_DMAC = 168, H_TOKENS = 200,
};

struct dentry {
    char name[NAME_LEN];        /* file name in the directory */
    struct prefix_tier_block id;/* tokens: the entry's own copy */
    uint64_t bytes;             /* the file's size */
    uint64_t used;              /* last use (nanoseconds since the epoch) */
    struct dentry *hnext, *prev, *next;    /* hash chain; LRU (prev toward the most recent) */
};

struct job {
    struct prefix_tier_block id;/* tokens: the job's own copy */
    uint8_t *data;
    struct job *next;
};

struct disk_tier {
    char dir[4096];
    int dir_fd;
    uid_t uid;                  /* ours: every file read must be this user's */
    uint64_t max_bytes;
    struct disk_tier_layout lay;
    size_t header_bytes;
    pthread_mutex_t mu;
    pthread_cond_t cv;          /* the writer waits for jobs; flush waits for an empty queue */
    pthread_t writer;
    bool stop, busy;
    struct job *q_head, *q_tail;
    uint64_t q_n, q_bytes;
    struct dentry **bucket;
    uint64_t mask;
    struct dentry *head, *tail; /* LRU */
    struct disk_tier_stats st;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static bool same_id(uint32_t bt, const struct prefix_tier_block *a, const struct prefix_tier_block *b)
{
    return a->key.lo == b->key.lo && a->key.hi == b->key.hi && a->parent.lo == b->parent.lo &&
           a->parent.hi == b->parent.hi && a->ns.lo == b->ns.lo && a->ns.hi == b->ns.hi &&
           a->path.lo == b->path.lo && a->path.hi == b->path.hi &&
           memcmp(a->tokens, b->tokens, (size_t)bt * 4) == 0;
}

/* The file name of an identity: a digest of all of it. */
static void name_of(const disk_tier_t *d, const struct prefix_tier_block *b, char out[NAME_LEN])
{
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, &b->key, sizeof(b->key));
    XXH3_128bits_update(&st, &b->parent, sizeof(b->parent));
    XXH3_128bits_update(&st, &b->ns, sizeof(b->ns));
    XXH3_128bits_update(&st, &b->path, sizeof(b->path));
    XXH3_128bits_update(&st, b->tokens, (size_t)d->lay.block_tokens * 4);
    const XXH128_hash_t h = XXH3_128bits_digest(&st);
    snprintf(out, NAME_LEN, "%016llx%016llx.kvb", (unsigned long long)h.high64, (unsigned long long)h.low64);
}

/* The keyed MAC of n bytes. */
static void mac(const disk_tier_t *d, const void *p, size_t n, uint8_t out[MAC_BYTES])
{
    crypto_generichash(out, MAC_BYTES, p, n, d->lay.mac_key, sizeof(d->lay.mac_key));
}

void disk_tier_mac_key(const uint8_t *secret, size_t n, uint8_t out[32])
{
    static const char label[] = "kvd disk tier MAC key 1";
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, 32);
    crypto_generichash_update(&st, (const uint8_t *)label, sizeof(label));
    crypto_generichash_update(&st, secret, n);
    crypto_generichash_final(&st, out, 32);
}

/* The header of a file for block b whose data has MAC dmac. */
static void header_make(const disk_tier_t *d, const struct prefix_tier_block *b, const uint8_t dmac[MAC_BYTES],
                        uint8_t *h)
{
    const struct disk_tier_layout *l = &d->lay;
    memset(h, 0, d->header_bytes);
    memcpy(h + H_MAGIC, MAGIC, 8);
    put32(h + H_VERSION, VERSION);
    put32(h + H_SIZE, (uint32_t)d->header_bytes);
    memcpy(h + H_MODEL, l->model, 16);
    memcpy(h + H_TOKENIZER, l->tokenizer, 16);
    put32(h + H_KTYPE, l->k_type);
    put32(h + H_VTYPE, l->v_type);
    put32(h + H_ROTATE, l->rotate);
    put32(h + H_BT, l->block_tokens);
    put64(h + H_BBYTES, l->block_bytes);
    put32(h + H_NPARTS, l->n_parts);
    put32(h + H_PLAYERS, l->part_layers);
    memcpy(h + H_KEYS, l->keys, 16);
    memcpy(h + H_KEY, &b->key, 16);
    memcpy(h + H_PARENT, &b->parent, 16);
    memcpy(h + H_NS, &b->ns, 16);
    memcpy(h + H_PATH, &b->path, 16);
    put64(h + H_DBYTES, l->block_bytes);
    memcpy(h + H_DMAC, dmac, MAC_BYTES);
    memcpy(h + H_TOKENS, b->tokens, (size_t)l->block_tokens * 4);
    const size_t mac_at = d->header_bytes - MAC_BYTES;
    mac(d, h, mac_at, h + mac_at);
}

enum hcheck { H_OK, H_DAMAGED, H_OTHER, H_OTHER_KV /* this model's, in other KV types */ };

/* Checks a header read from a file: damaged (magic, or its MAC under our
 * key), made for another version or secret (told before the MAC is checked:
 * another secret's files are not ours to judge) or, MAC checked, for another
 * layout (another model sharing the directory and its secret), or usable;
 * fills b (tokens into tok). */
static enum hcheck header_check(const disk_tier_t *d, const uint8_t *h, struct prefix_tier_block *b, int32_t *tok)
{
    if (memcmp(h + H_MAGIC, MAGIC, 8) != 0)
        return H_DAMAGED;
    const struct disk_tier_layout *l = &d->lay;
    if (get32(h + H_VERSION) != VERSION || get32(h + H_SIZE) != d->header_bytes ||
        memcmp(h + H_KEYS, l->keys, 16) != 0)
        return H_OTHER;         /* another version of the format, another block size or secret */
    const size_t mac_at = d->header_bytes - MAC_BYTES;
    uint8_t want[MAC_BYTES];
    mac(d, h, mac_at, want);
    if (sodium_memcmp(want, h + mac_at, MAC_BYTES) != 0)
        return H_DAMAGED;
    if (memcmp(h + H_MODEL, l->model, 16) == 0 &&
        (get32(h + H_KTYPE) != l->k_type || get32(h + H_VTYPE) != l->v_type))
        return H_OTHER_KV;
    if (memcmp(h + H_MODEL, l->model, 16) != 0 || memcmp(h + H_TOKENIZER, l->tokenizer, 16) != 0 ||
        get32(h + H_KTYPE) != l->k_type || get32(h + H_VTYPE) != l->v_type || get32(h + H_ROTATE) != l->rotate ||
        get64(h + H_BBYTES) != l->block_bytes || get32(h + H_NPARTS) != l->n_parts ||
        get32(h + H_PLAYERS) != l->part_layers || get64(h + H_DBYTES) != l->block_bytes)
        return H_OTHER;
    memcpy(&b->key, h + H_KEY, 16);
    memcpy(&b->parent, h + H_PARENT, 16);
    memcpy(&b->ns, h + H_NS, 16);
    memcpy(&b->path, h + H_PATH, 16);
    memcpy(tok, h + H_TOKENS, (size_t)l->block_tokens * 4);
    b->tokens = tok;
    return H_OK;
}

/* ---- the index (callers hold mu) ---------------------------------------------------- */

static struct dentry **slot_of(const disk_tier_t *d, const struct prefix_tier_block *b)
{
    return &d->bucket[(b->key.lo ^ b->key.hi ^ b->parent.lo) & d->mask];
}

static struct dentry *find(const disk_tier_t *d, const struct prefix_tier_block *b)
{
    for (struct dentry *e = *slot_of(d, b); e != NULL; e = e->hnext)
        if (same_id(d->lay.block_tokens, &e->id, b))
            return e;
    return NULL;
}

static void lru_unlink(disk_tier_t *d, struct dentry *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        d->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        d->tail = e->prev;
    e->prev = e->next = NULL;
}

/* Inserts e in LRU order by its use time (the newest are at the head). */
static void lru_insert(disk_tier_t *d, struct dentry *e)
{
    struct dentry *at = d->head;
    while (at != NULL && at->used > e->used)
        at = at->next;
    e->next = at;
    e->prev = at ? at->prev : d->tail;
    if (e->prev)
        e->prev->next = e;
    else
        d->head = e;
    if (at)
        at->prev = e;
    else
        d->tail = e;
}

static void index_add(disk_tier_t *d, struct dentry *e)
{
    struct dentry **slot = slot_of(d, &e->id);
    e->hnext = *slot;
    *slot = e;
    lru_insert(d, e);
    d->st.files++;
    d->st.bytes += e->bytes;
}

/* Takes e out of the index and frees it (the file is the caller's business). */
static void index_drop(disk_tier_t *d, struct dentry *e)
{
    struct dentry **link = slot_of(d, &e->id);
    while (*link != e)
        link = &(*link)->hnext;
    *link = e->hnext;
    lru_unlink(d, e);
    d->st.files--;
    d->st.bytes -= e->bytes;
    free((void *)e->id.tokens);
    free(e);
}

static void remove_file(disk_tier_t *d, const char *name)
{
    if (unlinkat(d->dir_fd, name, 0) != 0 && errno != ENOENT)
        return;
}

/* Drops least recently used files until the budget holds (other layouts'
 * files, counted in bytes, are not ours to drop). */
static void shrink(disk_tier_t *d)
{
    while (d->st.bytes > d->max_bytes && d->tail != NULL) {
        struct dentry *e = d->tail;
        remove_file(d, e->name);
        index_drop(d, e);
        d->st.removed++;
    }
}

static struct dentry *dentry_new(const disk_tier_t *d, const struct prefix_tier_block *b, const char *name,
                                 uint64_t bytes, uint64_t used)
{
    struct dentry *e = calloc(1, sizeof(*e));
    int32_t *tok = malloc((size_t)d->lay.block_tokens * 4);
    if (e == NULL || tok == NULL) {
        free(e);
        free(tok);
        return NULL;
    }
    memcpy(tok, b->tokens, (size_t)d->lay.block_tokens * 4);
    e->id = *b;
    e->id.tokens = tok;
    snprintf(e->name, sizeof(e->name), "%s", name);
    e->bytes = bytes;
    e->used = used;
    return e;
}

/* ---- writing -------------------------------------------------------------------- */

static bool write_all(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n > 0) {
        const ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

/* A new file `name` of dir_fd for writing, mode 0600: never an existing one
 * (O_EXCL; a leftover or planted one is removed first) nor a link's target. */
static int create_new(int dir_fd, const char *name)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        const int fd = openat(dir_fd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd >= 0 || errno != EEXIST)
            return fd;
        unlinkat(dir_fd, name, 0);  /* the entry itself, never what a link points to */
    }
    return -1;
}

/* Opens name of dir_fd to read: a regular file of ours only (not a link,
 * whose open fails; not a FIFO, which O_NONBLOCK opens at once and fstat
 * shows). -1 otherwise; *st gets its status. */
static int open_ours(const disk_tier_t *d, const char *name, struct stat *st)
{
    const int fd = openat(d->dir_fd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return -1;
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode) || st->st_uid != d->uid) {
        close(fd);
        errno = EPERM;
        return -1;
    }
    return fd;
}

/* Writes one block's file: temporary name, fsync, rename, directory fsync. */
static bool write_block(disk_tier_t *d, const struct job *j, const char *name)
{
    char tmp[NAME_LEN + 8];
    snprintf(tmp, sizeof(tmp), ".tmp-%s", name);
    uint8_t *h = malloc(d->header_bytes);
    if (h == NULL)
        return false;
    uint8_t dmac[MAC_BYTES];
    mac(d, j->data, d->lay.block_bytes, dmac);
    header_make(d, &j->id, dmac, h);
    const int fd = create_new(d->dir_fd, tmp);
    bool ok = fd >= 0 && write_all(fd, h, d->header_bytes) && write_all(fd, j->data, d->lay.block_bytes) &&
              fsync(fd) == 0;
    if (fd >= 0)
        close(fd);
    free(h);
    ok = ok && renameat(d->dir_fd, tmp, d->dir_fd, name) == 0;
    if (!ok) {
        unlinkat(d->dir_fd, tmp, 0);
        return false;
    }
    fsync(d->dir_fd);       /* the rename itself survives a crash */
    return true;
}

static void *writer_main(void *arg)
{
    disk_tier_t *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (d->q_head == NULL && !d->stop)
            pthread_cond_wait(&d->cv, &d->mu);
        if (d->q_head == NULL && d->stop)
            break;
        struct job *j = d->q_head;
        d->busy = true;
        pthread_mutex_unlock(&d->mu);
        char name[NAME_LEN];
        name_of(d, &j->id, name);
        const bool ok = write_block(d, j, name);
        pthread_mutex_lock(&d->mu);
        d->q_head = j->next;
        if (d->q_head == NULL)
            d->q_tail = NULL;
        d->q_n--;
        d->q_bytes -= d->lay.block_bytes;
        d->busy = false;
        if (ok && find(d, &j->id) == NULL) {
            struct dentry *e = dentry_new(d, &j->id, name, d->header_bytes + d->lay.block_bytes, now_ns());
            if (e != NULL) {
                index_add(d, e);
                d->st.written++;
                shrink(d);
            } else {
                remove_file(d, name);
                d->st.dropped_writes++;
            }
        } else if (!ok) {
            d->st.dropped_writes++;
        }
        free((void *)j->id.tokens);
        free(j->data);
        free(j);
        pthread_cond_broadcast(&d->cv);     /* flush() may wait for an empty queue */
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* ---- opening ------------------------------------------------------------------------ */

static void note(disk_tier_log_fn log, void *user, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void note(disk_tier_log_fn log, void *user, const char *fmt, ...)
{
    if (log == NULL)
        return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    log(user, line);
}

/* Indexes the directory: temporaries removed, headers checked. */
static int scan(disk_tier_t *d, disk_tier_log_fn log, void *log_user, char *err, size_t errlen)
{
    const int fd = dup(d->dir_fd);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (dir == NULL) {
        if (fd >= 0)
            close(fd);
        return kvd_seterr(err, errlen, KVD_EIO, "disk tier: cannot read %s: %s", d->dir, strerror(errno));
    }
    uint8_t *h = malloc(d->header_bytes);
    int32_t *tok = malloc((size_t)d->lay.block_tokens * 4);
    if (h == NULL || tok == NULL) {
        free(h);
        free(tok);
        closedir(dir);
        return kvd_seterr(err, errlen, KVD_ENOMEM, "disk tier: out of memory");
    }
    char first_other[NAME_LEN] = "", other_types[512] = "";
    const struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        const char *nm = de->d_name;
        if (strncmp(nm, ".tmp-", 5) == 0) {
            remove_file(d, nm);     /* a write a crash cut short */
            continue;
        }
        const size_t len = strlen(nm);
        if (len != NAME_LEN - 1 || strcmp(nm + len - 4, ".kvb") != 0)
            continue;           /* not ours */
        struct stat sb;
        const int f = open_ours(d, nm, &sb);
        if (f < 0) {
            if (errno != ENOENT && d->st.refused++ == 0)
                note(log, log_user, "disk tier: %s/%s is not a regular file of this user's (a link, a FIFO, "
                     "another user's): refused and left alone", d->dir, nm);
            continue;
        }
        const bool whole = pread(f, h, d->header_bytes, 0) == (ssize_t)d->header_bytes;
        close(f);
        struct prefix_tier_block b;
        const enum hcheck c = whole ? header_check(d, h, &b, tok) : H_DAMAGED;
        char want[NAME_LEN];
        if (c == H_OK)
            name_of(d, &b, want);
        if (c == H_OTHER || c == H_OTHER_KV) {
            if (d->st.ignored++ == 0) {
                memcpy(first_other, nm, NAME_LEN - 1);      /* a name of NAME_LEN - 1 (checked above) */
                first_other[NAME_LEN - 1] = '\0';
            }
            /* said once, as a change of the default type (--kv-type auto) may be what happened */
            const struct disk_tier_layout *l = &d->lay;
            if (c == H_OTHER_KV && other_types[0] == '\0')
                snprintf(other_types, sizeof(other_types),
                         "; %.*s holds K %s / V %s blocks, this kvd keeps K %s / V %s (--kv-type)",
                         (int)(NAME_LEN - 1), nm,
                         kv_type_name(get32(h + H_KTYPE)), kv_type_name(get32(h + H_VTYPE)),
                         kv_type_name(l->k_type), kv_type_name(l->v_type));
            d->st.foreign_bytes += (uint64_t)sb.st_size;    /* its room is taken all the same */
            d->st.bytes += (uint64_t)sb.st_size;
            continue;
        }
        if (c == H_DAMAGED || strcmp(want, nm) != 0 ||
            (uint64_t)sb.st_size != d->header_bytes + d->lay.block_bytes) {
            note(log, log_user, "disk tier: %s/%s is damaged or truncated: removed", d->dir, nm);
            remove_file(d, nm);
            d->st.corrupt++;
            continue;
        }
        const uint64_t used = (uint64_t)sb.st_mtim.tv_sec * 1000000000ull + (uint64_t)sb.st_mtim.tv_nsec;
        struct dentry *e = dentry_new(d, &b, nm, (uint64_t)sb.st_size, used);
        if (e == NULL)
            break;
        index_add(d, e);
        d->st.indexed++;
    }
    closedir(dir);
    free(h);
    free(tok);
    if (d->st.ignored > 0)
        note(log, log_user, "disk tier: %llu files in %s were made for another model, layout or secret (%s, ...%s): "
             "ignored; their %llu bytes count against the budget", (unsigned long long)d->st.ignored, d->dir,
             first_other, other_types, (unsigned long long)d->st.foreign_bytes);
    if (d->st.foreign_bytes + d->header_bytes + d->lay.block_bytes > d->max_bytes)
        note(log, log_user, "disk tier: other files fill the budget of %s: no block can be kept there",
             d->dir);
    shrink(d);
    return 0;
}

/* Opens directory dir (made, 0700, when missing) for a tier or its secret: it
 * must be this user's, and no one else may write in it. Its descriptor, or
 * -1 with the reason. */
static int dir_open_checked(const char *dir, char *err, size_t errlen, int *code)
{
    *code = KVD_EIO;
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        kvd_seterr(err, errlen, KVD_EIO, "cannot make %s: %s", dir, strerror(errno));
        return -1;
    }
    const int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        kvd_seterr(err, errlen, KVD_EIO, "cannot open %s: %s", dir, strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    if (st.st_uid != geteuid() || (st.st_mode & 022) != 0) {
        *code = kvd_seterr(err, errlen, KVD_EPERM, "%s %s (mode 0%o, uid %u): refusing a directory that %s",
                           st.st_uid != geteuid() ? "another user owns" : "others may write in", dir,
                           (unsigned)(st.st_mode & 0777), (unsigned)st.st_uid,
                           st.st_uid != geteuid() ? "is not this user's" : "is not this user's alone to write");
        close(fd);
        return -1;
    }
    return fd;
}

int disk_tier_secret(const char *dir, uint8_t *out, size_t n, bool *made, char *err, size_t errlen)
{
    int code;
    *made = false;
    const int dfd = dir_open_checked(dir, err, errlen, &code);
    if (dfd < 0)
        return code;
    int rc = 0;
    const int fd = openat(dfd, "secret", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0 && errno != ENOENT) {
        rc = kvd_seterr(err, errlen, errno == ELOOP ? KVD_EPERM : KVD_EIO, "%s/secret: %s", dir,
                        errno == ELOOP ? "a symbolic link: refused" : strerror(errno));
    } else if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
                           (st.st_mode & 077) != 0)) {
        rc = kvd_seterr(err, errlen, KVD_EPERM, "%s/secret is not a file only this user may read (mode 0%o): "
                        "refusing it (remove it, and the files made under it)", dir, (unsigned)(st.st_mode & 0777));
    } else if (fd >= 0) {
        const ssize_t got = read(fd, out, n);
        uint8_t extra;
        if (got == (ssize_t)n && read(fd, &extra, 1) == 0) {
            close(fd);
            close(dfd);
            return 0;
        }
        rc = 1;     /* not a secret: made anew below */
    }
    if (fd >= 0)
        close(fd);
    if (rc < 0) {
        close(dfd);
        return rc;
    }
    /* a new one: random bytes to a temporary name of its own, synced, then put in place */
    size_t have = 0;
    while (have < n) {
        const ssize_t r = getrandom(out + have, n - have, 0);
        if (r < 0 && errno != EINTR) {
            close(dfd);
            return kvd_seterr(err, errlen, KVD_EIO, "cannot read random bytes for a key secret");
        }
        have += r > 0 ? (size_t)r : 0;
    }
    const int tfd = create_new(dfd, ".tmp-secret");
    const bool ok = tfd >= 0 && write_all(tfd, out, n) && fsync(tfd) == 0;
    if (tfd >= 0)
        close(tfd);
    /* first made wins: a secret another kvd put in place meanwhile is kept (read again) */
    const bool placed = ok && (rc == 1 ? renameat(dfd, ".tmp-secret", dfd, "secret") == 0
                                       : linkat(dfd, ".tmp-secret", dfd, "secret", 0) == 0);
    const int why = errno;
    unlinkat(dfd, ".tmp-secret", 0);
    if (ok && !placed && why == EEXIST) {
        close(dfd);
        return disk_tier_secret(dir, out, n, made, err, errlen);
    }
    if (!placed) {
        close(dfd);
        return kvd_seterr(err, errlen, KVD_EIO, "cannot write %s/secret: %s", dir, strerror(why));
    }
    fsync(dfd);
    close(dfd);
    *made = true;
    return 0;
}

disk_tier_t *disk_tier_open(const char *dir, uint64_t max_bytes, const struct disk_tier_layout *lay,
                            disk_tier_log_fn log, void *log_user, char *err, size_t errlen)
{
    if (lay->block_tokens == 0 || lay->block_tokens > 4096 || lay->block_bytes == 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "disk tier: bad block layout");
        return NULL;
    }
    const size_t header_bytes = H_TOKENS + (size_t)lay->block_tokens * 4 + MAC_BYTES;
    if (max_bytes < header_bytes + lay->block_bytes) {
        kvd_seterr(err, errlen, KVD_EINVAL, "disk tier: %llu bytes cannot hold one block of %llu",
                   (unsigned long long)max_bytes, (unsigned long long)lay->block_bytes);
        return NULL;
    }
    if (strlen(dir) >= sizeof(((disk_tier_t *)0)->dir)) {
        kvd_seterr(err, errlen, KVD_EINVAL, "disk tier: directory name too long");
        return NULL;
    }
    int code;
    char why[600];
    const int dir_fd = dir_open_checked(dir, why, sizeof(why), &code);
    if (dir_fd < 0) {
        kvd_seterr(err, errlen, code, "disk tier: %s", why);
        return NULL;
    }
    if (sodium_init() < 0) {
        close(dir_fd);
        kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "disk tier: libsodium cannot start");
        return NULL;
    }
    disk_tier_t *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        close(dir_fd);
        kvd_seterr(err, errlen, KVD_ENOMEM, "disk tier: out of memory");
        return NULL;
    }
    snprintf(d->dir, sizeof(d->dir), "%s", dir);
    d->max_bytes = max_bytes;
    d->lay = *lay;
    d->header_bytes = header_bytes;
    d->st.max_bytes = max_bytes;
    uint64_t n = 64;
    while (n < 2 * (max_bytes / lay->block_bytes) && n < (1ull << 26))
        n *= 2;
    d->mask = n - 1;
    d->bucket = calloc(n, sizeof(*d->bucket));
    d->dir_fd = dir_fd;
    d->uid = geteuid();
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    if (d->bucket == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "disk tier: out of memory");
        goto fail;
    }
    if (scan(d, log, log_user, err, errlen) != 0)
        goto fail;
    if (pthread_create(&d->writer, NULL, writer_main, d) != 0) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "disk tier: cannot start its writer");
        goto fail;
    }
    return d;
fail:
    d->stop = true;
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    for (struct dentry *e = d->head, *next; e != NULL; e = next) {
        next = e->next;
        free((void *)e->id.tokens);
        free(e);
    }
    if (d->dir_fd >= 0)
        close(d->dir_fd);
    free(d->bucket);
    free(d);
    return NULL;
}

void disk_tier_close(disk_tier_t **dp)
{
    if (dp == NULL || *dp == NULL)
        return;
    disk_tier_t *d = *dp;
    pthread_mutex_lock(&d->mu);
    d->stop = true;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->writer, NULL);      /* it writes what is queued first */
    for (struct dentry *e = d->head, *next; e != NULL; e = next) {
        next = e->next;
        free((void *)e->id.tokens);
        free(e);
    }
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    close(d->dir_fd);
    free(d->bucket);
    free(d);
    *dp = NULL;
}

static bool queued(const disk_tier_t *d, const struct prefix_tier_block *b)
{
    for (const struct job *j = d->q_head; j != NULL; j = j->next)
        if (same_id(d->lay.block_tokens, &j->id, b))
            return true;
    return false;
}

int disk_tier_put(disk_tier_t *d, const struct prefix_tier_block *b, const void *data)
{
    pthread_mutex_lock(&d->mu);
    const bool there = find(d, b) != NULL || queued(d, b);
    const bool full = d->q_n >= QUEUE_MAX || d->q_bytes + d->lay.block_bytes > QUEUE_BYTES;
    if (full && !there)
        d->st.dropped_writes++;
    pthread_mutex_unlock(&d->mu);
    if (there)
        return 0;
    if (full)
        return KVD_ENOSPACE;
    /* the copy is made outside the lock: the writer goes on meanwhile */
    struct job *j = calloc(1, sizeof(*j));
    int32_t *tok = malloc((size_t)d->lay.block_tokens * 4);
    uint8_t *data_copy = malloc(d->lay.block_bytes);
    if (j == NULL || tok == NULL || data_copy == NULL) {
        free(j);
        free(tok);
        free(data_copy);
        return KVD_ENOMEM;
    }
    memcpy(tok, b->tokens, (size_t)d->lay.block_tokens * 4);
    memcpy(data_copy, data, d->lay.block_bytes);
    j->id = *b;
    j->id.tokens = tok;
    j->data = data_copy;
    pthread_mutex_lock(&d->mu);
    if (d->q_tail)
        d->q_tail->next = j;
    else
        d->q_head = j;
    d->q_tail = j;
    d->q_n++;
    d->q_bytes += d->lay.block_bytes;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    return 0;
}

bool disk_tier_has(disk_tier_t *d, const struct prefix_tier_block *b)
{
    pthread_mutex_lock(&d->mu);
    const bool there = find(d, b) != NULL;
    pthread_mutex_unlock(&d->mu);
    return there;
}

bool disk_tier_get(disk_tier_t *d, const struct prefix_tier_block *b, void *dst)
{
    char name[NAME_LEN];
    pthread_mutex_lock(&d->mu);
    struct dentry *e = find(d, b);
    if (e == NULL) {
        d->st.misses++;
        pthread_mutex_unlock(&d->mu);
        return false;
    }
    snprintf(name, sizeof(name), "%s", e->name);
    pthread_mutex_unlock(&d->mu);

    bool ok = false;
    uint8_t *h = malloc(d->header_bytes);
    int32_t *tok = malloc((size_t)d->lay.block_tokens * 4);
    struct stat st;
    const int fd = open_ours(d, name, &st);
    if (h != NULL && tok != NULL && fd >= 0 && pread(fd, h, d->header_bytes, 0) == (ssize_t)d->header_bytes) {
        struct prefix_tier_block fb;
        uint8_t dmac[MAC_BYTES];
        ok = header_check(d, h, &fb, tok) == H_OK && same_id(d->lay.block_tokens, &fb, b) &&
             pread(fd, dst, d->lay.block_bytes, (off_t)d->header_bytes) == (ssize_t)d->lay.block_bytes;
        if (ok) {
            mac(d, dst, d->lay.block_bytes, dmac);
            ok = sodium_memcmp(dmac, h + H_DMAC, MAC_BYTES) == 0;
        }
    }
    if (fd >= 0) {
        if (ok)
            futimens(fd, NULL);     /* its use, for the LRU order after a restart */
        close(fd);
    }
    free(h);
    free(tok);
    pthread_mutex_lock(&d->mu);
    e = find(d, b);         /* the writer may have dropped it meanwhile */
    if (ok && e != NULL) {
        lru_unlink(d, e);
        e->used = now_ns();
        lru_insert(d, e);
        d->st.hits++;
    } else {
        if (e != NULL) {
            remove_file(d, e->name);
            index_drop(d, e);
            d->st.corrupt++;
        }
        d->st.misses++;
        ok = false;
    }
    pthread_mutex_unlock(&d->mu);
    return ok;
}

void disk_tier_flush(disk_tier_t *d)
{
    pthread_mutex_lock(&d->mu);
    while (d->q_head != NULL)
        pthread_cond_wait(&d->cv, &d->mu);
    pthread_mutex_unlock(&d->mu);
}

void disk_tier_stats(disk_tier_t *d, struct disk_tier_stats *st)
{
    pthread_mutex_lock(&d->mu);
    *st = d->st;
    st->pending = d->q_n;
    pthread_mutex_unlock(&d->mu);
}

bool disk_tier_path_for_test(disk_tier_t *d, const struct prefix_tier_block *b, char *path, size_t len)
{
    pthread_mutex_lock(&d->mu);
    const struct dentry *e = find(d, b);
    if (e != NULL)
        snprintf(path, len, "%s/%s", d->dir, e->name);
    pthread_mutex_unlock(&d->mu);
    return e != NULL;
}
