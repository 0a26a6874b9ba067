/*
 * view.c - the pools as a picture, for kvd --http's page (Stats.pool_view):
 * every block's state and tenant per host, the largest cached prefix trees
 * with their sharers and hits, and a ring of per-second samples (hit rate,
 * time to first token, tokens computed) for the last minutes.
 *
 * Whatever the pool's size, the picture is bounded: a host's blocks are drawn
 * in at most VIEW_CELLS cells sent as runs, the prefix trees in at most
 * VIEW_NODES nodes. A viewer sees what its statistics would let it see: all
 * of it (a trusted client, the operator), or a tenant's own blocks and
 * prefixes and the public prefix's, or (anonymous) those of no tenant; the
 * others' blocks are drawn by state alone and their prefixes left out.
 */
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "kvd.h"
#include "hosts.h"
#include "requests.h"
#include "view.h"
#include "workers.h"

#define VIEW_CELLS_ALL 65536    /* cells of every host together */
#define VIEW_CELLS_HOST 16384   /* at most per host */
#define VIEW_CELLS_MIN 1024     /* at least per host */
#define VIEW_NODES 256          /* prefix nodes in all */
#define VIEW_ROOTS 16           /* prefix trees */
#define VIEW_KIDS 32            /* children of a node, the largest */
#define VIEW_TEXT 64            /* bytes of a node's text */
#define N_STATES 5              /* Kvd__BlockState */

_Static_assert(sizeof(((struct kvd_view *)0)->texts[0]) == VIEW_TEXT + 1, "a node's text");

/* ---- samples ----------------------------------------------------------------------------------- */

/* The cumulative counters a sample is the difference of. */
static void counters(const struct kvd *k, uint64_t c[6], double *ttft_sum)
{
    uint64_t ttft_n = 0, computed = 0;
    for (int i = 0; i <= KVD_HIST_N; i++)
        ttft_n += k->st.ttft.counts[i];
    for (int i = 0; i < KVD_MAX_WORKERS; i++)
        if (k->workers[i].used)
            computed += k->workers[i].tokens;
    c[0] = k->st.prompt_tokens;
    c[1] = k->st.cached_prompt_tokens;
    c[2] = k->st.completion_tokens;
    c[3] = ttft_n;
    c[4] = computed;
    c[5] = 0;
    *ttft_sum = k->st.ttft.sum;
}

void view_tick(struct kvd *k)
{
    struct kvd_samples *s = &k->samples;
    const double now = cli_now_ms();
    uint64_t c[6];
    double ttft;
    counters(k, c, &ttft);
    if (s->next_ms == 0) {          /* the first tick: the baseline */
        memcpy(s->last, c, sizeof(s->last));
        s->last_ttft = ttft;
        s->next_ms = now + 1000;
        return;
    }
    if (now < s->next_ms)
        return;
    /* a loop that slept past several seconds: the work goes to the last one */
    while (now >= s->next_ms + 1000) {
        s->next_ms += 1000;
        memset(&s->ring[s->head], 0, sizeof(s->ring[0]));
        s->head = (s->head + 1) % KVD_SAMPLES;
        if (s->n < KVD_SAMPLES)
            s->n++;
    }
    s->next_ms += 1000;
    struct kvd_sample *x = &s->ring[s->head];
    uint64_t d[6];
    for (int i = 0; i < 6; i++)
        d[i] = c[i] >= s->last[i] ? c[i] - s->last[i] : 0;     /* a restarted worker's count */
    x->prompt_tokens = d[0];
    x->cached_prompt_tokens = d[1];
    x->completion_tokens = d[2];
    x->first_tokens = (uint32_t)d[3];
    x->ttft_seconds = ttft - s->last_ttft;
    x->computed_tokens = d[4];
    memcpy(s->last, c, sizeof(s->last));
    s->last_ttft = ttft;
    s->head = (s->head + 1) % KVD_SAMPLES;
    if (s->n < KVD_SAMPLES)
        s->n++;
}

/* ---- who sees what ------------------------------------------------------------------------------ */

struct viewer {
    bool all;                   /* sees everything */
    int32_t tenant;             /* else: its tenant's index, -1: anonymous (or a tenant with no entry) */
    bool anonymous;
};

/* The tenant value of a block taken for owner (0: none) in nodes and runs, as
 * the viewer may see it: 0 (no tenant), owner (tenants[owner - 1]) for all of
 * it; else 0, 1 (the viewer's own, the one name it gets) or hidden, so that
 * nothing tells how many other tenants there are. */
static uint32_t tenant_shown(const struct viewer *v, uint16_t owner, bool public, uint32_t hidden)
{
    if (v->all)
        return owner;
    if (public)
        return 0;
    if (owner == 0)
        return v->anonymous ? 0 : hidden;
    return (int32_t)owner - 1 == v->tenant && !v->anonymous ? 1 : hidden;
}

static bool is_public(const struct kvd *k, const struct prefix_block_info *bi)
{
    return k->public_tok != NULL && bi->indexed && bi->part == 0 && bi->ns.lo == k->public_ns.lo &&
           bi->ns.hi == k->public_ns.hi;
}

/* ---- the block map ------------------------------------------------------------------------------ */

static uint32_t block_state(const struct prefix_block_info *bi)
{
    if (bi->state == POOL_BLOCK_FREE)
        return KVD__BLOCK_STATE__BLOCK_FREE;
    if (bi->state == POOL_BLOCK_PENDING)
        return KVD__BLOCK_STATE__BLOCK_PENDING;
    return bi->refs > 0 ? KVD__BLOCK_STATE__BLOCK_IN_USE : KVD__BLOCK_STATE__BLOCK_CACHED;
}

/* Marks the blocks of host h's fenced sequences in fenced[] (n entries). */
static void mark_fenced(const struct kvd_host *h, uint8_t *fenced, uint32_t n)
{
    for (const struct kvd_fenced *f = h->fenced; f; f = f->next)
        for (uint32_t p = 0; p < f->ps.n_parts; p++)
            for (uint32_t i = 0; i < f->ps.n_blocks; i++) {
                const uint32_t id = f->ps.tables[p] != NULL ? f->ps.tables[p][i] : POOL_NONE;
                if (id < n)
                    fenced[id] = 1;
            }
}

struct runs {
    uint32_t *state, *tenant, *cells;
    size_t n, cap;
};

static int run_add(struct runs *r, uint32_t state, uint32_t tenant)
{
    if (r->n > 0 && r->state[r->n - 1] == state && r->tenant[r->n - 1] == tenant) {
        r->cells[r->n - 1]++;
        return 0;
    }
    if (r->n == r->cap)
        return KVD_ENOMEM;      /* sized for one run per cell: never */
    r->state[r->n] = state;
    r->tenant[r->n] = tenant;
    r->cells[r->n] = 1;
    r->n++;
    return 0;
}

/* Host h's blocks as runs of at most max_cells cells into *x (its arrays
 * malloc'd: freed by view_free). */
static int host_blocks(const struct kvd *k, int h, const struct viewer *v, uint32_t hidden, uint32_t max_cells,
                       Kvd__HostBlocks *x)
{
    const struct kvd_host *ho = &k->hosts[h];
    struct prefix_stats ps;
    prefix_stats(ho->px, &ps);
    const uint32_t n = ps.n_blocks;
    const uint32_t per = n > max_cells ? (n + max_cells - 1) / max_cells : 1;
    const uint32_t n_cells = n ? (n + per - 1) / per : 0;
    struct runs r = { .cap = n_cells ? n_cells : 1 };
    r.state = malloc(r.cap * sizeof(uint32_t));
    r.tenant = malloc(r.cap * sizeof(uint32_t));
    r.cells = malloc(r.cap * sizeof(uint32_t));
    uint8_t *fenced = ho->fenced != NULL ? calloc(n ? n : 1, 1) : NULL;
    if (r.state == NULL || r.tenant == NULL || r.cells == NULL || (ho->fenced != NULL && fenced == NULL)) {
        free(r.state);
        free(r.tenant);
        free(r.cells);
        free(fenced);
        return KVD_ENOMEM;
    }
    if (fenced != NULL)
        mark_fenced(ho, fenced, n);
    for (uint32_t c = 0; c < n_cells; c++) {
        uint32_t count[N_STATES] = { 0 }, tenant[N_STATES] = { 0 };
        const uint32_t end = (c + 1) * per < n ? (c + 1) * per : n;
        for (uint32_t id = c * per; id < end; id++) {
            struct prefix_block_info bi;
            if (prefix_block_info(ho->px, id, &bi) != 0)
                continue;
            const uint32_t st = fenced != NULL && fenced[id] ? KVD__BLOCK_STATE__BLOCK_FENCED : block_state(&bi);
            if (count[st]++ == 0)
                tenant[st] = st == KVD__BLOCK_STATE__BLOCK_FREE ? 0
                                                                : tenant_shown(v, bi.owner, is_public(k, &bi), hidden);
        }
        uint32_t best = 0;
        for (uint32_t s = 1; s < N_STATES; s++)
            if (count[s] > count[best])
                best = s;
        run_add(&r, best, tenant[best]);
    }
    free(fenced);
    x->name = (char *)ho->name;
    x->has_blocks = x->has_cell_blocks = true;
    x->blocks = n;
    x->cell_blocks = per;
    x->run_state = r.state;
    x->run_tenant = r.tenant;
    x->run_cells = r.cells;
    x->n_run_state = x->n_run_tenant = x->n_run_cells = r.n;
    return 0;
}

/* ---- the prefix trees ------------------------------------------------------------------------- */

/* One host's index as a forest of the blocks the viewer may see (part 0's,
 * findable or pending): children lists and subtree sizes. */
struct forest {
    int h;
    uint32_t n;
    uint32_t *child, *sibling;  /* n: first child, next sibling (POOL_NONE: none) */
    uint32_t *size;             /* n: blocks in its subtree; 0: not in the forest */
};

static void forest_free(struct forest *f)
{
    free(f->child);
    free(f->sibling);
    free(f->size);
}

static bool in_forest(const struct kvd *k, const struct viewer *v, const struct prefix_block_info *bi)
{
    if (!bi->indexed || bi->part != 0 || bi->state == POOL_BLOCK_FREE)
        return false;
    if (v->all || is_public(k, bi))
        return true;
    return tenant_shown(v, bi->owner, false, UINT32_MAX) != UINT32_MAX;
}

/* A tree's root block, its subtree's size and its host's forest. */
struct root {
    uint32_t id, size;
    struct forest *f;
};

/* Builds host h's forest of the blocks v may see into *f (freed by
 * forest_free, or already on KVD_ENOMEM). */
static int forest_build(const struct kvd *k, int h, const struct viewer *v, struct forest *f)
{
    const prefix_t *px = k->hosts[h].px;
    struct prefix_stats ps;
    prefix_stats(px, &ps);
    f->h = h;
    f->n = ps.n_blocks;
    const size_t n = f->n ? f->n : 1;
    f->child = malloc(n * sizeof(uint32_t));
    f->sibling = malloc(n * sizeof(uint32_t));
    f->size = calloc(n, sizeof(uint32_t));
    uint32_t *order = malloc(n * sizeof(uint32_t));
    if (f->child == NULL || f->sibling == NULL || f->size == NULL || order == NULL) {
        free(order);
        forest_free(f);
        return KVD_ENOMEM;
    }
    memset(f->child, 0xff, n * sizeof(uint32_t));
    memset(f->sibling, 0xff, n * sizeof(uint32_t));
    /* size 1 marks a member; parents are linked to the members below them */
    for (uint32_t id = 0; id < f->n; id++) {
        struct prefix_block_info bi;
        if (prefix_block_info(px, id, &bi) == 0 && in_forest(k, v, &bi))
            f->size[id] = 1;
    }
    for (uint32_t id = 0; id < f->n; id++) {
        struct prefix_block_info bi;
        if (f->size[id] == 0 || prefix_block_info(px, id, &bi) != 0)
            continue;
        if (bi.parent < f->n && f->size[bi.parent] != 0) {
            f->sibling[id] = f->child[bi.parent];
            f->child[bi.parent] = id;
        }
    }
    /* subtree sizes: every member in an order where children come after
     * their parents (a breadth-first walk from the roots), then summed back */
    uint32_t m = 0;
    for (uint32_t id = 0; id < f->n; id++) {
        struct prefix_block_info bi;
        if (f->size[id] != 0 && prefix_block_info(px, id, &bi) == 0 &&
            !(bi.parent < f->n && f->size[bi.parent] != 0))
            order[m++] = id;
    }
    for (uint32_t i = 0; i < m; i++)
        for (uint32_t c = f->child[order[i]]; c != POOL_NONE; c = f->sibling[c])
            order[m++] = c;
    for (uint32_t i = m; i-- > 0;)
        for (uint32_t c = f->child[order[i]]; c != POOL_NONE; c = f->sibling[c])
            f->size[order[i]] += f->size[c];
    free(order);
    return 0;
}

static bool is_root(const struct forest *f, const prefix_t *px, uint32_t id)
{
    struct prefix_block_info bi;
    return f->size[id] != 0 && prefix_block_info(px, id, &bi) == 0 && !(bi.parent < f->n && f->size[bi.parent] != 0);
}

static int root_cmp(const void *a, const void *b)
{
    const struct root *x = a, *y = b;
    return x->size != y->size ? (x->size < y->size ? 1 : -1) : (x->id > y->id) - (x->id < y->id);
}

/* Valid UTF-8 of at most VIEW_TEXT bytes from the start of s[0..n) into out
 * (room for VIEW_TEXT + 1): whole characters, other bytes as '?', control
 * characters as spaces. */
static void clean_text(const char *s, size_t n, char *out)
{
    size_t o = 0, i = 0;
    while (i < n) {
        size_t len = 0;
        const int v = kvd_utf8_seq((const unsigned char *)s + i, n - i, &len);
        if (v != 1)
            len = 1;
        if (o + (v == 1 ? len : 1) > VIEW_TEXT)
            break;
        if (v != 1)
            out[o++] = '?';
        else if (len == 1 && ((unsigned char)s[i] < 0x20 || s[i] == 0x7f))
            out[o++] = ' ';
        else
            memcpy(out + o, s + i, len), o += len;
        i += len;
    }
    out[o] = '\0';
}

struct nodes {
    Kvd__PrefixNode *v;
    char (*text)[VIEW_TEXT + 1];     /* VIEW_TEXT + 1 == sizeof(kvd_view.texts[0]) */
    size_t n;
};

/* Emits the tree under root r (parents first, larger subtrees first) while
 * room is left. */
static void emit_tree(const struct kvd *k, const struct viewer *v, uint32_t hidden, const struct root *r,
                      uint32_t host_index, struct nodes *out)
{
    const struct forest *f = r->f;
    const prefix_t *px = k->hosts[f->h].px;
    const uint32_t bt = prefix_block_tokens(px);
    /* a stack of (block, parent node) pairs still to emit */
    struct item {
        uint32_t id;
        int32_t parent;
    } stack[VIEW_NODES];
    size_t top = 0;
    stack[top++] = (struct item){ r->id, -1 };
    while (top > 0 && out->n < VIEW_NODES) {
        const struct item it = stack[--top];
        struct prefix_block_info first, last;
        if (prefix_block_info(px, it.id, &first) != 0)
            continue;
        /* the chain while each block has one child */
        uint32_t end = it.id, blocks = 1;
        while (f->child[end] != POOL_NONE && f->sibling[f->child[end]] == POOL_NONE) {
            end = f->child[end];
            blocks++;
        }
        if (prefix_block_info(px, end, &last) != 0)
            continue;
        Kvd__PrefixNode *x = &out->v[out->n];
        kvd__prefix_node__init(x);
        x->has_parent = x->has_host = x->has_blocks = x->has_subtree_blocks = x->has_tenant = true;
        x->has_is_public = x->has_sharers = x->has_hits = x->has_state = true;
        x->parent = it.parent;
        x->host = host_index;
        x->blocks = blocks;
        x->subtree_blocks = f->size[it.id];
        x->is_public = is_public(k, &first);
        x->tenant = tenant_shown(v, first.owner, x->is_public, hidden);
        x->sharers = first.refs;
        x->hits = last.hits;
        x->state = block_state(&last);
        char buf[4096];             /* the text of at most 64 tokens */
        size_t len = 0;
        out->text[out->n][0] = '\0';
        if (k->tok != NULL && tok_decode(k->tok, first.tokens, bt < 64 ? bt : 64, buf, sizeof(buf), &len) == 0)
            clean_text(buf, len, out->text[out->n]);
        x->text = out->text[out->n];
        const int32_t me = (int32_t)out->n++;
        /* its largest VIEW_KIDS children, in increasing size, so that the
         * largest is pushed last and comes out first */
        uint32_t kids[VIEW_KIDS];
        size_t nk = 0;
        for (uint32_t c = f->child[end]; c != POOL_NONE; c = f->sibling[c]) {
            size_t at;
            if (nk < VIEW_KIDS) {
                for (at = nk++; at > 0 && f->size[kids[at - 1]] > f->size[c]; at--)
                    kids[at] = kids[at - 1];
            } else if (f->size[c] > f->size[kids[0]]) {     /* the smallest goes */
                for (at = 0; at + 1 < nk && f->size[kids[at + 1]] < f->size[c]; at++)
                    kids[at] = kids[at + 1];
            } else {
                continue;
            }
            kids[at] = c;
        }
        /* what does not fit the stack is left out (the parent's subtree size says so) */
        const size_t room = VIEW_NODES - top, from = nk > room ? nk - room : 0;
        for (size_t a = from; a < nk; a++)
            stack[top++] = (struct item){ kids[a], me };
    }
}

/* ---- the whole picture ------------------------------------------------------------------------- */

int view_build(const struct kvd *k, const char *tenant, bool all, struct kvd_view *out)
{
    memset(out, 0, sizeof(*out));
    Kvd__PoolView *pv = &out->pv;
    kvd__pool_view__init(pv);
    struct viewer v = { .all = all, .tenant = -1, .anonymous = !all && (tenant == NULL || tenant[0] == '\0') };
    if (!all && !v.anonymous)
        for (uint32_t i = 0; i < k->n_tenants; i++)
            if (strcmp(k->tenants[i].name, tenant) == 0)
                v.tenant = (int32_t)i;
    /* tenants' names: every one for all of it, else the viewer's own alone */
    const uint32_t nt = all ? k->n_tenants : v.tenant >= 0 ? 1 : 0;
    pv->has_hidden_tenant = true;
    pv->hidden_tenant = nt + 1;
    out->tenants = calloc(nt ? nt : 1, sizeof(char *));
    if (out->tenants == NULL)
        return KVD_ENOMEM;
    for (uint32_t i = 0; i < nt; i++)
        out->tenants[i] = (char *)k->tenants[all ? i : (uint32_t)v.tenant].name;
    pv->tenants = out->tenants;
    pv->n_tenants = nt;
    /* the block maps */
    int hosts[KVD_MAX_HOSTS], n_hosts = 0;
    for (int h = 0; h < KVD_MAX_HOSTS; h++)
        if (k->hosts[h].used)
            hosts[n_hosts++] = h;
    uint32_t max_cells = n_hosts ? VIEW_CELLS_ALL / (uint32_t)n_hosts : VIEW_CELLS_HOST;
    max_cells = max_cells > VIEW_CELLS_HOST ? VIEW_CELLS_HOST : max_cells < VIEW_CELLS_MIN ? VIEW_CELLS_MIN : max_cells;
    out->hosts = calloc((size_t)n_hosts + 1, sizeof(*out->hosts));
    out->host_ptrs = calloc((size_t)n_hosts + 1, sizeof(*out->host_ptrs));
    if (out->hosts == NULL || out->host_ptrs == NULL)
        return KVD_ENOMEM;
    for (int i = 0; i < n_hosts; i++) {
        kvd__host_blocks__init(&out->hosts[i]);
        if (host_blocks(k, hosts[i], &v, pv->hidden_tenant, max_cells, &out->hosts[i]) != 0)
            return KVD_ENOMEM;
        out->host_ptrs[i] = &out->hosts[i];
        pv->n_hosts = (size_t)i + 1;
    }
    pv->hosts = out->host_ptrs;
    /* the prefix trees: the largest roots of every host's forest */
    struct forest f[KVD_MAX_HOSTS];
    struct root roots[VIEW_ROOTS];
    uint32_t host_of[KVD_MAX_HOSTS];
    size_t n_roots = 0;
    int rc = 0, built = 0;
    for (int i = 0; i < n_hosts && rc == 0; i++) {
        rc = forest_build(k, hosts[i], &v, &f[i]);
        if (rc != 0)
            break;
        built++;
        host_of[i] = (uint32_t)i;
        /* the largest VIEW_ROOTS roots, kept in decreasing size */
        for (uint32_t id = 0; id < f[i].n; id++) {
            if (!is_root(&f[i], k->hosts[hosts[i]].px, id))
                continue;
            const struct root r = { id, f[i].size[id], &f[i] };
            if (n_roots == VIEW_ROOTS && root_cmp(&r, &roots[n_roots - 1]) >= 0)
                continue;
            size_t at = n_roots < VIEW_ROOTS ? n_roots++ : VIEW_ROOTS - 1;
            while (at > 0 && root_cmp(&r, &roots[at - 1]) < 0) {
                roots[at] = roots[at - 1];
                at--;
            }
            roots[at] = r;
        }
    }
    if (rc == 0) {
        struct nodes nd = { calloc(VIEW_NODES, sizeof(Kvd__PrefixNode)), calloc(VIEW_NODES, VIEW_TEXT + 1), 0 };
        out->nodes = nd.v;
        out->texts = nd.text;
        out->node_ptrs = calloc(VIEW_NODES, sizeof(*out->node_ptrs));
        if (nd.v == NULL || nd.text == NULL || out->node_ptrs == NULL) {
            rc = KVD_ENOMEM;
        } else {
            for (size_t r = 0; r < n_roots && nd.n < VIEW_NODES; r++)
                emit_tree(k, &v, pv->hidden_tenant, &roots[r], host_of[roots[r].f - f], &nd);
            for (size_t i = 0; i < nd.n; i++)
                out->node_ptrs[i] = &nd.v[i];
            pv->prefixes = out->node_ptrs;
            pv->n_prefixes = nd.n;
        }
    }
    for (int i = 0; i < built; i++)
        forest_free(&f[i]);
    if (rc != 0)
        return rc;
    /* the samples, oldest first */
    const struct kvd_samples *s = &k->samples;
    out->samples = calloc(s->n ? s->n : 1, sizeof(*out->samples));
    out->sample_ptrs = calloc(s->n ? s->n : 1, sizeof(*out->sample_ptrs));
    if (out->samples == NULL || out->sample_ptrs == NULL)
        return KVD_ENOMEM;
    for (uint32_t i = 0; i < s->n; i++) {
        const struct kvd_sample *x = &s->ring[(s->head + KVD_SAMPLES - s->n + i) % KVD_SAMPLES];
        Kvd__Sample *y = &out->samples[i];
        kvd__sample__init(y);
        y->has_prompt_tokens = y->has_cached_prompt_tokens = y->has_completion_tokens = true;
        y->has_first_tokens = y->has_ttft_seconds = y->has_computed_tokens = true;
        y->prompt_tokens = x->prompt_tokens;
        y->cached_prompt_tokens = x->cached_prompt_tokens;
        y->completion_tokens = x->completion_tokens;
        y->first_tokens = x->first_tokens;
        y->ttft_seconds = x->ttft_seconds;
        y->computed_tokens = x->computed_tokens;
        out->sample_ptrs[i] = y;
    }
    pv->samples = out->sample_ptrs;
    pv->n_samples = s->n;
    return 0;
}

void view_free(struct kvd_view *v)
{
    if (v->hosts != NULL)
        for (size_t i = 0; i < v->pv.n_hosts; i++) {
            free(v->hosts[i].run_state);
            free(v->hosts[i].run_tenant);
            free(v->hosts[i].run_cells);
        }
    free(v->hosts);
    free(v->host_ptrs);
    free(v->tenants);
    free(v->nodes);
    free(v->texts);
    free(v->node_ptrs);
    free(v->samples);
    free(v->sample_ptrs);
    memset(v, 0, sizeof(*v));
}
