/*
 * pins.c - pinned prefixes (pins.h): the table, TTLs, limits, the cache
 * management requests and the pins file of the disk tier's directory.
 */
#include "pins.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "err.h"
#include "requests.h"
#include "tiers.h"

#define PINS_FILE_MAX (64u << 20)   /* the pins file is refused past this size */

struct kvd_pin {
    char id[40];                    /* "pin_" + 32 hex digits: its last block's key */
    char tenant[KVD_TENANT_NAME_MAX + 1]; /* "" for none */
    char ns_name[WIRE_MAX_NAMESPACE + 1]; /* the namespace its request named */
    prefix_ns_t ns;                 /* the namespace its blocks are keyed in */
    int32_t *tok;                   /* (n_tok + 1) the pinned tokens and one spare for begin */
    uint32_t n_tok;                 /* whole blocks' tokens */
    struct prefix_seq ps;           /* holds its blocks in kvd's own pool */
    uint32_t blocks;                /* blocks ps holds, every part's */
    uint64_t hits;                  /* requests whose cached prefix covered it */
    uint64_t created_ms, expires_ms;/* unix ms */
    uint32_t ttl_s;
};

struct kvd_pins {
    struct kvd_pin *v;              /* n pins, in no order */
    uint32_t n, cap;
    uint64_t expired, refused;      /* counters for the stats */
};

static uint64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

int pins_init(struct kvd *k)
{
    k->pins = calloc(1, sizeof(*k->pins));
    return k->pins ? 0 : KVD_ENOMEM;
}

static void pin_drop(struct kvd *k, uint32_t i, bool evict)
{
    struct kvd_pins *t = k->pins;
    struct kvd_pin *p = &t->v[i];
    if (evict)
        prefix_seq_release_evict(k->px, &p->ps);
    else
        prefix_seq_release(k->px, &p->ps);
    prefix_seq_fini(&p->ps);
    free(p->tok);
    t->v[i] = t->v[--t->n];
}

void pins_fini(struct kvd *k)
{
    if (k->pins == NULL)
        return;
    while (k->pins->n > 0)
        pin_drop(k, k->pins->n - 1, false);
    free(k->pins->v);
    free(k->pins);
    k->pins = NULL;
}

static struct kvd_pin *pin_find(const struct kvd *k, const char *id)
{
    for (uint32_t i = 0; i < k->pins->n; i++)
        if (strcmp(k->pins->v[i].id, id) == 0)
            return &k->pins->v[i];
    return NULL;
}

/* The blocks ps holds, every part's. */
static uint32_t seq_blocks(const struct prefix_seq *ps)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < ps->n_blocks; i++)
        for (uint32_t p = 0; p < (ps->n_parts ? ps->n_parts : 1); p++)
            n += (p == 0 ? ps->blocks[i] : ps->tables[p][i]) != POOL_NONE;
    return n;
}

void pins_count(const struct kvd *k, const char *name, uint32_t *n, uint32_t *blocks)
{
    *n = *blocks = 0;
    for (uint32_t i = 0; k->pins != NULL && i < k->pins->n; i++)
        if (name == NULL || strcmp(k->pins->v[i].tenant, name) == 0) {
            (*n)++;
            *blocks += k->pins->v[i].blocks;
        }
}

void pins_counters(const struct kvd *k, uint64_t *expired, uint64_t *refused)
{
    *expired = k->pins ? k->pins->expired : 0;
    *refused = k->pins ? k->pins->refused : 0;
}

/* Writes r's tenant name into out ("" for none). */
static void tenant_of_request(const struct kvd *k, const struct request *r, char *out)
{
    out[0] = '\0';
    if (r->tenant >= 0)
        snprintf(out, KVD_TENANT_NAME_MAX + 1, "%s", k->tenants[r->tenant].name);
}

/* The limits for a pin of `blocks` more blocks of tenant (renewing none):
 * 0 or a code with msg. */
static int check_limits(struct kvd *k, const char *tenant, uint32_t ttl_s, uint32_t blocks, char *msg, size_t len)
{
    if (ttl_s == 0 || ttl_s > k->o.pin_max_ttl_s) {
        snprintf(msg, len, "a pin's TTL is %u s; kvd allows 1 to %u s (--pin-max-ttl)", ttl_s, k->o.pin_max_ttl_s);
        return KVD__ERROR_CODE__ERR_BAD_REQUEST;
    }
    uint32_t n, held, n_all, held_all;
    pins_count(k, tenant, &n, &held);
    pins_count(k, NULL, &n_all, &held_all);
    const char *who = tenant[0] ? tenant : "(none)";
    if (n + 1 > k->o.pin_max_per_tenant) {
        snprintf(msg, len, "tenant %s holds %u pins, the most kvd allows (--pin-max-per-tenant)", who, n);
        return KVD__ERROR_CODE__ERR_BAD_REQUEST;
    }
    if (tenant[0] && k->tenant_blocks > 0 && held + blocks > k->tenant_blocks) {
        snprintf(msg, len, "the pin needs %u blocks; tenant %s has %u pinned of the %u it may hold "
                 "(--tenant-max-blocks)", blocks, who, held, k->tenant_blocks);
        return KVD__ERROR_CODE__ERR_BAD_REQUEST;
    }
    struct prefix_stats st;
    prefix_stats(k->px, &st);
    if (held_all + blocks > st.n_blocks / 2) {
        snprintf(msg, len, "the pin needs %u blocks; pins hold %u, and together they may hold half the "
                 "pool (%u)", blocks, held_all, st.n_blocks / 2);
        return KVD__ERROR_CODE__ERR_BAD_REQUEST;
    }
    return 0;
}

/* A pin's id: its last block's key (which stands for the whole chain, in its
 * namespace) mixed with its tenant's name, so that two tenants pinning the
 * same shared prefix (--public-prefix blocks, keyed alike for all) hold two
 * pins, neither able to renew or see the other's. */
static void id_of_key(prefix_key_t key, const char *tenant, char *id)
{
    uint8_t in[16 + KVD_TENANT_NAME_MAX + 1];
    const size_t tl = strlen(tenant);
    memcpy(in, &key.lo, 8);
    memcpy(in + 8, &key.hi, 8);
    memcpy(in + 16, tenant, tl);
    const XXH128_hash_t h = XXH3_128bits(in, 16 + tl);
    snprintf(id, 40, "pin_%016" PRIx64 "%016" PRIx64, (uint64_t)h.high64, (uint64_t)h.low64);
}

int pins_admit(struct kvd *k, const struct request *r, char *msg, size_t len)
{
    char tenant[KVD_TENANT_NAME_MAX + 1];
    if (k->pins == NULL) {
        snprintf(msg, len, "pins are not set up");
        return KVD__ERROR_CODE__ERR_UNAVAILABLE;
    }
    tenant_of_request(k, r, tenant);
    const uint32_t bt = k->o.block_tokens;
    if (r->pin_tokens < bt) {
        snprintf(msg, len, "nothing to pin: the prefix has fewer tokens than a block (%u)", bt);
        return KVD__ERROR_CODE__ERR_BAD_REQUEST;
    }
    if (r->no_cache) {
        snprintf(msg, len, "a pin needs the cache: no_cache cannot go with it");
        return KVD__ERROR_CODE__ERR_BAD_REQUEST;
    }
    /* a pin of the same prefix is renewed, not counted again: look for one
     * by its chain's key */
    prefix_key_t *keys = malloc((r->pin_tokens / bt) * sizeof(*keys));
    if (keys == NULL)
        return KVD__ERROR_CODE__ERR_INTERNAL;
    const uint32_t nb = r->pin_tokens / bt, np = r->ps.n_public < nb ? r->ps.n_public : nb;
    if (np > 0)
        prefix_hash_chain(k->px, k->public_ns, r->tok, np, keys);
    /* past --public-prefix's blocks the chain goes on in r's namespace, which
     * hashing alone does not follow: such a pin is taken as new here (its
     * renewal is recognised when it is taken) */
    char id[40];
    if (np == 0) {
        prefix_hash_chain(k->px, r->ns, r->tok, nb, keys);
        id_of_key(keys[nb - 1], tenant, id);
    } else {
        id[0] = '\0';
    }
    free(keys);
    if (id[0] && pin_find(k, id) != NULL && r->pin_ttl_s <= k->o.pin_max_ttl_s)
        return 0;   /* renewed (the TTL past the limit is refused below) */
    const int code = check_limits(k, tenant, r->pin_ttl_s, nb, msg, len);
    if (code != 0)
        k->pins->refused++;
    return code;
}

/* ---- the pins file ---------------------------------------------------------------------------- */

static void hex_put(FILE *f, const char *s)
{
    if (s[0] == '\0')
        fputc('-', f);
    for (; *s; s++)
        fprintf(f, "%02x", (unsigned char)*s);
}

static bool hex_get(const char *h, char *out, size_t cap)
{
    if (strcmp(h, "-") == 0) {
        out[0] = '\0';
        return true;
    }
    size_t n = strlen(h);
    if (n % 2 || n / 2 >= cap)
        return false;
    for (size_t i = 0; i < n / 2; i++) {
        unsigned v;
        if (sscanf(h + 2 * i, "%2x", &v) != 1 || v == 0)
            return false;
        out[i] = (char)v;
    }
    out[n / 2] = '\0';
    return true;
}

/* Writes every pin to DIR/pins: a temporary file, fsynced, renamed. */
static void pins_save(struct kvd *k)
{
    if (k->o.cache_dir == NULL || k->disk == NULL)
        return;
    char path[4200], tmp[4300];
    snprintf(path, sizeof(path), "%s/pins", k->o.cache_dir);
    snprintf(tmp, sizeof(tmp), "%s/pins.tmp.%d", k->o.cache_dir, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (f == NULL) {
        kvd_log(k, "pins: cannot write %s: %s", tmp, strerror(errno));
        if (fd >= 0)
            close(fd);
        return;
    }
    fprintf(f, "kvd-pins 1\n");
    for (uint32_t i = 0; i < k->pins->n; i++) {
        const struct kvd_pin *p = &k->pins->v[i];
        fprintf(f, "%s %u %" PRIu64 " %" PRIu64 " %" PRIu64 " %016" PRIx64 " %016" PRIx64 " ", p->id, p->ttl_s,
                p->created_ms, p->expires_ms, p->hits, p->ns.lo, p->ns.hi);
        hex_put(f, p->tenant);
        fputc(' ', f);
        hex_put(f, p->ns_name);
        fprintf(f, " %u", p->n_tok);
        for (uint32_t j = 0; j < p->n_tok; j++)
            fprintf(f, " %d", p->tok[j]);
        fputc('\n', f);
    }
    const bool ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    if (fclose(f) != 0 || !ok || rename(tmp, path) != 0) {
        kvd_log(k, "pins: cannot write %s: %s", path, strerror(errno));
        unlink(tmp);
        return;
    }
    int dfd = open(k->o.cache_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
}

/* Takes a pin of p's tokens into p->ps from the pool (pool_only) or the
 * tiers: true when every block of it was had. Otherwise *got (when not NULL)
 * is the tokens that were (a negative code: none) and *pending whether the
 * next block is one another request is still writing. */
static bool pin_hold(struct kvd *k, struct kvd_pin *p, uint16_t owner, bool pool_only, int64_t *got_out,
                     bool *pending)
{
    p->ps.owner = owner;
    p->ps.pool_only = pool_only;
    p->ps.n_public = req_public_blocks(k, p->tok, p->n_tok + 1);
    p->ps.public_ns = k->public_ns;
    p->tok[p->n_tok] = 0;   /* the spare token begin leaves to compute */
    uint32_t wait = POOL_NONE;
    const int64_t got = prefix_seq_begin(k->px, &p->ps, p->ns, p->tok, p->n_tok + 1ull, &wait);
    if (got_out != NULL)
        *got_out = got;
    if (pending != NULL)
        *pending = wait != POOL_NONE;
    if (got != (int64_t)p->n_tok) {
        prefix_seq_release(k->px, &p->ps);
        return false;
    }
    p->blocks = seq_blocks(&p->ps);
    return true;
}

void pins_load(struct kvd *k)
{
    if (k->o.cache_dir == NULL || k->disk == NULL)
        return;
    char path[4200];
    snprintf(path, sizeof(path), "%s/pins", k->o.cache_dir);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT)
            kvd_log(k, "pins: cannot open %s: %s", path, strerror(errno));
        return;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_uid != geteuid() || (sb.st_mode & 022) ||
        sb.st_size > PINS_FILE_MAX) {
        kvd_log(k, "pins: %s is not a regular file of this user's, writable by it alone and under %u MiB: "
                "ignored", path, PINS_FILE_MAX >> 20);
        close(fd);
        return;
    }
    FILE *f = fdopen(fd, "r");
    if (f == NULL) {
        close(fd);
        return;
    }
    char *line = NULL;
    size_t cap = 0;
    uint32_t kept = 0, dropped = 0, bad = 0;
    const uint64_t now = unix_ms();
    if (getline(&line, &cap, f) < 0 || strcmp(line, "kvd-pins 1\n") != 0) {
        kvd_log(k, "pins: %s has no kvd-pins 1 header: ignored", path);
        goto out;
    }
    tiers_sync(k, true);
    while (getline(&line, &cap, f) > 0) {
        struct kvd_pin p = { 0 };
        char tenant_hex[2 * KVD_TENANT_NAME_MAX + 2], ns_hex[2 * WIRE_MAX_NAMESPACE + 2];
        int off = 0;
        if (sscanf(line, "%39s %u %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNx64 " %" SCNx64 " %255s %513s %u%n",
                   p.id, &p.ttl_s, &p.created_ms, &p.expires_ms, &p.hits, &p.ns.lo, &p.ns.hi, tenant_hex,
                   ns_hex, &p.n_tok, &off) != 10 ||
            !hex_get(tenant_hex, p.tenant, sizeof(p.tenant)) || !hex_get(ns_hex, p.ns_name, sizeof(p.ns_name)) ||
            p.n_tok == 0 || p.n_tok % k->o.block_tokens || p.n_tok >= k->n_ctx || pin_find(k, p.id) != NULL ||
            (p.tok = malloc((p.n_tok + 1ull) * sizeof(int32_t))) == NULL) {
            bad++;
            continue;
        }
        const char *s = line + off;
        uint32_t j = 0;
        for (; j < p.n_tok; j++) {
            char *end;
            long v = strtol(s, &end, 10);
            if (end == s || v < 0 || v >= (long)k->model->cfg.n_vocab)
                break;
            p.tok[j] = (int32_t)v;
            s = end;
        }
        if (j < p.n_tok) {
            free(p.tok);
            bad++;
            continue;
        }
        if (p.expires_ms <= now) {
            free(p.tok);
            dropped++;
            continue;
        }
        /* the file is kvd's, but what it holds is held to today's limits as a
         * new pin would be: a TTL no longer than --pin-max-ttl from now, the
         * tenant's and the pool's shares, and a tenant's pin in its own
         * namespace ("tenant:NAME/...") */
        char why[200];
        const size_t tl = strlen(p.tenant);
        if (p.expires_ms > now + (uint64_t)k->o.pin_max_ttl_s * 1000u)
            p.expires_ms = now + (uint64_t)k->o.pin_max_ttl_s * 1000u;
        if (p.ttl_s > k->o.pin_max_ttl_s)
            p.ttl_s = k->o.pin_max_ttl_s;
        if ((tl > 0 && (strncmp(p.ns_name, "tenant:", 7) != 0 || strncmp(p.ns_name + 7, p.tenant, tl) != 0 ||
                        (p.ns_name[7 + tl] != '\0' && p.ns_name[7 + tl] != '/'))) ||
            check_limits(k, p.tenant, p.ttl_s, p.n_tok / k->o.block_tokens, why, sizeof(why)) != 0) {
            kvd_log(k, "pins: %s: %s; dropped", p.id, tl > 0 && strncmp(p.ns_name, "tenant:", 7) != 0
                                                         ? "not in its tenant's namespace" : why);
            free(p.tok);
            dropped++;
            continue;
        }
        int32_t owner = p.tenant[0] ? req_tenant_entry(k, p.tenant, strlen(p.tenant)) : -1;
        if ((p.tenant[0] && owner < 0) || !pin_hold(k, &p, (uint16_t)(owner + 1), false, NULL, NULL)) {
            kvd_log(k, "pins: %s: its blocks are no longer in the tiers; dropped", p.id);
            prefix_seq_fini(&p.ps);
            free(p.tok);
            dropped++;
            continue;
        }
        char id[40];
        id_of_key(p.ps.key, p.tenant, id);
        if (strcmp(id, p.id) != 0) {
            bad++;
            prefix_seq_release(k->px, &p.ps);
            prefix_seq_fini(&p.ps);
            free(p.tok);
            continue;
        }
        if (k->pins->n == k->pins->cap) {
            const uint32_t nc = k->pins->cap ? 2 * k->pins->cap : 16;
            struct kvd_pin *v = realloc(k->pins->v, nc * sizeof(*v));
            if (v == NULL) {
                prefix_seq_release(k->px, &p.ps);
                prefix_seq_fini(&p.ps);
                free(p.tok);
                break;
            }
            k->pins->v = v;
            k->pins->cap = nc;
        }
        k->pins->v[k->pins->n++] = p;
        kept++;
    }
    tiers_sync(k, false);
    kvd_log(k, "pins: %u taken again from %s (%u expired or gone, %u unreadable lines)", kept, path, dropped, bad);
out:
    free(line);
    fclose(f);
    if (dropped || bad)
        pins_save(k);
}

/* ---- making, renewing, expiring --------------------------------------------------------------- */

const struct kvd_pin *pins_take(struct kvd *k, const struct request *r, char *msg, size_t len)
{
    if (r->host != 0) {
        snprintf(msg, len, "the request ran on another host's pool; pins are kept in kvd's own");
        return NULL;
    }
    struct kvd_pin p = { 0 };
    tenant_of_request(k, r, p.tenant);
    snprintf(p.ns_name, sizeof(p.ns_name), "%s", r->pin_ns ? r->pin_ns : "");
    p.ns = r->ns;
    p.n_tok = r->pin_tokens;
    p.ttl_s = r->pin_ttl_s;
    if ((p.tok = malloc((p.n_tok + 1ull) * sizeof(int32_t))) == NULL) {
        snprintf(msg, len, "out of memory");
        return NULL;
    }
    memcpy(p.tok, r->tok, p.n_tok * sizeof(int32_t));
    /* r still holds its blocks, so begin finds them all in the pool, unless
     * another request indexed the same blocks first and is still writing
     * them (r's copies are then not findable) */
    int64_t got = 0;
    bool pending = false;
    if (!pin_hold(k, &p, r->ps.owner, true, &got, &pending)) {
        snprintf(msg, len, "only %lld of the %u tokens to pin are cached yet (%s); not pinned",
                 got > 0 ? (long long)got : 0ll, p.n_tok,
                 pending ? "another request is still computing the same blocks"
                         : "the same blocks were computed by another request at the same time");
        k->pins->refused++;
        goto fail;
    }
    const uint64_t now = unix_ms();
    id_of_key(p.ps.key, p.tenant, p.id);
    struct kvd_pin *old = pin_find(k, p.id);
    if (old != NULL) {
        /* renewed: the same blocks, a new TTL from now */
        if (p.ttl_s > k->o.pin_max_ttl_s) {
            snprintf(msg, len, "a pin's TTL is %u s; kvd allows up to %u s (--pin-max-ttl)", p.ttl_s,
                     k->o.pin_max_ttl_s);
            goto fail;
        }
        prefix_seq_release(k->px, &p.ps);
        prefix_seq_fini(&p.ps);
        free(p.tok);
        old->ttl_s = r->pin_ttl_s;
        old->expires_ms = now + (uint64_t)r->pin_ttl_s * 1000u;
        pins_save(k);
        return old;
    }
    int code = check_limits(k, p.tenant, p.ttl_s, p.blocks, msg, len);
    if (code != 0) {
        k->pins->refused++;
        goto fail;
    }
    if (k->pins->n == k->pins->cap) {
        const uint32_t nc = k->pins->cap ? 2 * k->pins->cap : 16;
        struct kvd_pin *v = realloc(k->pins->v, nc * sizeof(*v));
        if (v == NULL) {
            snprintf(msg, len, "out of memory");
            goto fail;
        }
        k->pins->v = v;
        k->pins->cap = nc;
    }
    p.created_ms = now;
    p.expires_ms = now + (uint64_t)p.ttl_s * 1000u;
    k->pins->v[k->pins->n++] = p;
    pins_save(k);
    return &k->pins->v[k->pins->n - 1];
fail:
    prefix_seq_release(k->px, &p.ps);
    prefix_seq_fini(&p.ps);
    free(p.tok);
    return NULL;
}

void pins_note_hits(struct kvd *k, const struct request *r)
{
    if (k->pins == NULL || r->host != 0)
        return;
    char tenant[KVD_TENANT_NAME_MAX + 1];
    tenant_of_request(k, r, tenant);
    for (uint32_t i = 0; i < k->pins->n; i++) {
        struct kvd_pin *p = &k->pins->v[i];
        const uint32_t nb = p->ps.n_blocks;
        /* a block id stands for its whole chain: the same id at the same
         * place means the same prefix in the same namespace; a pin counts
         * its own tenant's requests alone (a shared prefix's others' are
         * theirs to know) */
        if (nb > 0 && r->ps.n_cached >= nb && r->ps.blocks[nb - 1] == p->ps.blocks[nb - 1] &&
            strcmp(p->tenant, tenant) == 0)
            p->hits++;
    }
}

void pins_tick(struct kvd *k)
{
    if (k->pins == NULL)
        return;     /* not set up (a harness that drives requests.c alone) */
    const uint64_t now = unix_ms();
    bool changed = false;
    for (uint32_t i = k->pins->n; i-- > 0;)
        if (k->pins->v[i].expires_ms <= now) {
            if (k->o.verbose)
                kvd_log(k, "pins: %s expired", k->pins->v[i].id);
            pin_drop(k, i, false);
            k->pins->expired++;
            changed = true;
        }
    if (changed) {
        pins_save(k);
        req_blocks_freed(k);
    }
}

/* ---- the management requests ----------------------------------------------------------------- */

void pins_describe(const struct kvd_pin *p, Kvd__Pin *m)
{
    kvd__pin__init(m);
    m->id = (char *)p->id;
    m->tenant = (char *)p->tenant;
    m->namespace_ = (char *)p->ns_name;
    m->has_tokens = m->has_blocks = m->has_hits = m->has_created_unix_ms = m->has_expires_unix_ms = true;
    m->has_ttl_s = true;
    m->tokens = p->n_tok;
    m->blocks = p->blocks;
    m->hits = p->hits;
    m->created_unix_ms = p->created_ms;
    m->expires_unix_ms = p->expires_ms;
    m->ttl_s = p->ttl_s;
}

void pins_on_request(struct kvd *k, const uint8_t *rid, size_t rid_len, const char *tenant, uint64_t id,
                     const Kvd__CacheRequest *c)
{
    /* whose pins: the key's tenant, else the tenant a namespace names, else
     * (the trusted socket naming none) everyone's */
    const char *name = NULL;
    size_t nlen = 0;
    char who[KVD_TENANT_NAME_MAX + 1];
    if (k->pins == NULL) {
        req_reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_UNAVAILABLE, "pins are not set up");
        return;
    }
    const bool scoped = req_tenant_name(tenant, c->namespace_, &name, &nlen);
    if (tenant != NULL && !scoped) {
        req_reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_BAD_REQUEST, "the client's tenant name is unusable");
        return;
    }
    if (scoped)
        snprintf(who, sizeof(who), "%.*s", (int)nlen, name);
    Kvd__ServerReply m = KVD__SERVER_REPLY__INIT;
    Kvd__CacheReply cr = KVD__CACHE_REPLY__INIT;
    m.body_case = KVD__SERVER_REPLY__BODY_CACHE;
    m.cache = &cr;
    if (c->op == KVD__CACHE_REQUEST__OP__OP_LIST) {
        Kvd__Pin *rows = calloc(k->pins->n ? k->pins->n : 1, sizeof(*rows));
        Kvd__Pin **ptrs = calloc(k->pins->n ? k->pins->n : 1, sizeof(*ptrs));
        if (rows == NULL || ptrs == NULL) {
            free(rows);
            free(ptrs);
            req_reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_INTERNAL, "out of memory");
            return;
        }
        for (uint32_t i = 0; i < k->pins->n; i++) {
            if (scoped && strcmp(k->pins->v[i].tenant, who) != 0)
                continue;
            pins_describe(&k->pins->v[i], &rows[cr.n_pins]);
            ptrs[cr.n_pins] = &rows[cr.n_pins];
            cr.n_pins++;
        }
        cr.pins = ptrs;
        req_reply(k, rid, rid_len, id, &m);
        free(rows);
        free(ptrs);
        return;
    }
    struct kvd_pin *p = pin_find(k, c->pin_id);
    if (p == NULL || (scoped && strcmp(p->tenant, who) != 0)) {
        /* another tenant's pin is as absent as one that never was */
        req_reply_error(k, rid, rid_len, id, KVD__ERROR_CODE__ERR_NOT_FOUND, "no such pin");
        return;
    }
    Kvd__Pin row, *rp = &row;
    struct kvd_pin copy = *p;
    pins_describe(&copy, &row);
    cr.pins = &rp;
    cr.n_pins = 1;
    const bool evict = c->op == KVD__CACHE_REQUEST__OP__OP_EVICT;
    const uint32_t i = (uint32_t)(p - k->pins->v);
    struct kvd_pins *t = k->pins;
    /* pin_drop frees the tokens and moves the last pin here: release by hand
     * to count what eviction took */
    uint32_t gone = evict ? prefix_seq_release_evict(k->px, &t->v[i].ps) : 0;
    if (!evict)
        prefix_seq_release(k->px, &t->v[i].ps);
    prefix_seq_fini(&t->v[i].ps);
    int32_t *tok = t->v[i].tok;
    t->v[i] = t->v[--t->n];
    cr.has_blocks_evicted = evict;
    cr.blocks_evicted = gone;
    req_reply(k, rid, rid_len, id, &m);
    free(tok);
    pins_save(k);
    req_blocks_freed(k);
}
