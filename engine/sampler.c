/* sampler.c - penalties, truncation, temperature and a seeded draw. */
#include "sampler.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "err.h"

struct cand {
    int32_t id;             /* token id */
    float logit;            /* adjusted logit, then probability */
};

struct sampler {
    struct sampler_params p;
    uint32_t n_vocab;
    uint64_t rng[4];        /* xoshiro256** state */
    struct cand *cands;     /* (n_vocab) */
    struct cand *spare;     /* (n_vocab) the radix sort's other buffer */
    float *work;            /* (n_vocab) penalized logits */
    int32_t *pen;           /* penalized ids of the last plan */
    size_t pen_cap;         /* ids pen holds: min(repeat_last_n, n_vocab) */
    int32_t *lb_id;         /* (p.n_logit_bias) the logit bias, copied */
    float *lb;              /* (p.n_logit_bias) */
    struct addend *tab;     /* (tab_cap) open addressing by id: a plan's addends */
    uint32_t tab_cap;       /* a power of two, or 0 */
    int32_t *add_id;        /* (tab_cap / 2) a plan's biased ids */
    float *add;             /* (tab_cap / 2) their addends */
};

/* One token's additive terms in a plan. */
struct addend {
    int32_t id;             /* -1: a free slot */
    uint32_t count;         /* times the output holds it */
    float bias;             /* its logit_bias */
};

struct sampler_params sampler_default_params(void)
{
    struct sampler_params p = {
        .temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
        .repeat_penalty = 1.0f, .repeat_last_n = 64, .seed = 0,
    };
    return p;
}

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(uint64_t s[4])
{
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t s[4]) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

sampler_t *sampler_new(const struct sampler_params *p, uint32_t n_vocab, char *err, size_t errlen)
{
    if (!(p->temperature >= 0.0f) || p->temperature > 100.0f) {
        kvd_seterr(err, errlen, KVD_EINVAL, "sampler: temperature must be in [0, 100]");
        return NULL;
    }
    if (p->top_k < 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "sampler: top-k must be >= 0");
        return NULL;
    }
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f)) {
        kvd_seterr(err, errlen, KVD_EINVAL, "sampler: top-p must be in (0, 1]");
        return NULL;
    }
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f)) {
        kvd_seterr(err, errlen, KVD_EINVAL, "sampler: min-p must be in [0, 1]");
        return NULL;
    }
    if (!(p->repeat_penalty > 0.0f && p->repeat_penalty <= 10.0f) || p->repeat_last_n < 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "sampler: repetition penalty must be in (0, 10]");
        return NULL;
    }
    if (n_vocab == 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "sampler: empty vocabulary");
        return NULL;
    }
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f) ||
        !(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f)) {
        kvd_seterr(err, errlen, KVD_EINVAL, "sampler: presence and frequency penalties must be in [-2, 2]");
        return NULL;
    }
    if (p->n_logit_bias > SAMPLER_MAX_LOGIT_BIAS || (p->n_logit_bias > 0 && (p->logit_bias_ids == NULL ||
                                                                            p->logit_bias == NULL))) {
        kvd_seterr(err, errlen, KVD_EINVAL, "sampler: at most %d logit biases", SAMPLER_MAX_LOGIT_BIAS);
        return NULL;
    }
    for (uint32_t i = 0; i < p->n_logit_bias; i++) {
        const int32_t id = p->logit_bias_ids[i];
        if (id < 0 || (uint32_t)id >= n_vocab || !(p->logit_bias[i] >= -100.0f && p->logit_bias[i] <= 100.0f)) {
            kvd_seterr(err, errlen, KVD_EINVAL, "sampler: logit bias %d: %g is outside the vocabulary or "
                       "[-100, 100]", (int)id, (double)p->logit_bias[i]);
            return NULL;
        }
        for (uint32_t j = 0; j < i; j++)
            if (p->logit_bias_ids[j] == id) {
                kvd_seterr(err, errlen, KVD_EINVAL, "sampler: token %d has two logit biases", (int)id);
                return NULL;
            }
    }
    sampler_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        goto nomem;
    s->p = *p;
    s->n_vocab = n_vocab;
    if (p->n_logit_bias > 0) {
        s->lb_id = malloc(p->n_logit_bias * sizeof(int32_t));
        s->lb = malloc(p->n_logit_bias * sizeof(float));
        if (s->lb_id == NULL || s->lb == NULL)
            goto nomem;
        memcpy(s->lb_id, p->logit_bias_ids, p->n_logit_bias * sizeof(int32_t));
        memcpy(s->lb, p->logit_bias, p->n_logit_bias * sizeof(float));
    }
    s->p.logit_bias_ids = s->lb_id;
    s->p.logit_bias = s->lb;
    s->cands = malloc((size_t)n_vocab * sizeof(*s->cands));
    s->spare = malloc((size_t)n_vocab * sizeof(*s->spare));
    s->work = malloc((size_t)n_vocab * sizeof(float));
    /* distinct in-range ids of the window: at most the window, at most the vocabulary */
    s->pen_cap = (uint32_t)p->repeat_last_n < n_vocab ? (uint32_t)p->repeat_last_n : n_vocab;
    s->pen = malloc((s->pen_cap ? s->pen_cap : 1) * sizeof(int32_t));
    if (s->cands == NULL || s->spare == NULL || s->work == NULL || s->pen == NULL)
        goto nomem;
    sampler_reseed(s, p->seed);
    return s;
nomem:
    sampler_destroy(&s);
    kvd_seterr(err, errlen, KVD_ENOMEM, "sampler: out of memory");
    return NULL;
}

void sampler_reseed(sampler_t *s, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = splitmix64(&x);
}

void sampler_destroy(sampler_t **sp)
{
    if (sp == NULL || *sp == NULL)
        return;
    free((*sp)->cands);
    free((*sp)->spare);
    free((*sp)->work);
    free((*sp)->pen);
    free((*sp)->lb_id);
    free((*sp)->lb);
    free((*sp)->tab);
    free((*sp)->add_id);
    free((*sp)->add);
    free(*sp);
    *sp = NULL;
}

#if defined(__x86_64__)
/* The same answer eight lanes at a time: the largest value (max_ps with the
 * running maximum second skips NaNs, as the scalar > does), then the first
 * position holding it. */
__attribute__((target("avx2"))) static int32_t argmax_avx2(const float *x, uint32_t n)
{
    __m256 m = _mm256_set1_ps(-INFINITY);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float best = lanes[0];
    for (int k = 1; k < 8; k++)
        best = lanes[k] > best ? lanes[k] : best;
    for (; i < n; i++)
        best = x[i] > best ? x[i] : best;
    const __m256 b = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
        if (hit)
            return (int32_t)(i + (uint32_t)__builtin_ctz((unsigned)hit));
    }
    for (; i < n; i++)
        if (x[i] == best)
            return (int32_t)i;
    return 0;  /* every value NaN or -inf */
}
#endif

int32_t sampler_argmax(const float *logits, uint32_t n)
{
#if defined(__x86_64__)
    /* a NaN first element wins in the scalar loop (nothing compares above it) */
    if (n >= 8 && !isnan(logits[0]) && kern_isa() >= KERN_ISA_AVX2)
        return argmax_avx2(logits, n);
#endif
    int32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (logits[i] > logits[best])
            best = (int32_t)i;
    return best;
}

void sampler_logprobs(const float *logits, uint32_t n_vocab, int32_t chosen, uint32_t n_top,
                      struct sampler_logprobs *out)
{
    if (n_top > SAMPLER_MAX_TOP_LOGPROBS)
        n_top = SAMPLER_MAX_TOP_LOGPROBS;
    if (n_top > n_vocab)
        n_top = n_vocab;
    out->n_top = 0;
    /* the top n_top by insertion into a short sorted list: a logit below the
     * list's last entry (the common case) costs one comparison */
    float max = -INFINITY;
    bool nan = false;
    for (uint32_t i = 0; i < n_vocab; i++) {
        float l = logits[i];
        if (isnan(l)) {
            nan = true;
            continue;
        }
        if (l > max)
            max = l;
        uint32_t n = out->n_top;
        if (n == n_top && (n == 0 || !(l > logits[out->top_id[n - 1]])))
            continue;
        uint32_t j = n < n_top ? n : n - 1;
        while (j > 0 && l > logits[out->top_id[j - 1]]) {
            out->top_id[j] = out->top_id[j - 1];
            j--;
        }
        out->top_id[j] = (int32_t)i;
        if (n < n_top)
            out->n_top++;
    }
    double lse = NAN;
    if (!nan && isfinite(max)) {
        double sum = 0;
        for (uint32_t i = 0; i < n_vocab; i++)
            sum += exp((double)logits[i] - max);
        lse = max + log(sum);
    }
    for (uint32_t j = 0; j < out->n_top; j++)
        out->top_logprob[j] = (float)((double)logits[out->top_id[j]] - lse);
    out->logprob = chosen >= 0 && (uint32_t)chosen < n_vocab ? (float)((double)logits[chosen] - lse) : NAN;
    /* the chosen one's place in the order above: larger logits, then equal
     * ones of lower ids, come before it */
    out->rank = 0;
    if (!nan && chosen >= 0 && (uint32_t)chosen < n_vocab) {
        const float c = logits[chosen];
        uint32_t before = 0;
        for (uint32_t i = 0; i < n_vocab; i++)
            before += logits[i] > c || (logits[i] == c && i < (uint32_t)chosen);
        out->rank = before + 1;
    }
}

/* Descending by logit, ascending id on ties: a total order, so results do not
 * depend on the sort's stability. */
static int cand_cmp(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->logit != y->logit)
        return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The slot of id in s->tab (its own, or the free one it would take). */
static struct addend *tab_slot(sampler_t *s, int32_t id)
{
    uint32_t h = (uint32_t)id * 0x9e3779b1u;
    for (;;) {
        struct addend *a = &s->tab[h & (s->tab_cap - 1)];
        if (a->id == id || a->id < 0)
            return a;
        h++;
    }
}

/* The additive terms of a draw: the logit bias, and the presence and
 * frequency penalties of the output's tokens, one addend per distinct id (in
 * the table's order, which depends on the ids alone). 0 or KVD_ENOMEM. */
static int plan_addends(sampler_t *s, const int32_t *history, size_t n_hist, struct sampler_draw *d)
{
    const struct sampler_params *p = &s->p;
    const bool counts = p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
    const size_t from = p->output_from < n_hist ? p->output_from : n_hist;
    const size_t n_out = counts && history != NULL ? n_hist - from : 0;
    size_t want = 2 * ((size_t)p->n_logit_bias + n_out) + 2;
    if (want > 2 * (size_t)s->n_vocab + 2)
        want = 2 * (size_t)s->n_vocab + 2;      /* no more distinct ids than the vocabulary */
    if (want > s->tab_cap) {
        uint32_t cap = 16;
        while (cap < want)
            cap *= 2;
        struct addend *t = malloc(cap * sizeof(*t));
        int32_t *ai = malloc(cap / 2 * sizeof(int32_t));
        float *av = malloc(cap / 2 * sizeof(float));
        if (t == NULL || ai == NULL || av == NULL) {
            free(t);
            free(ai);
            free(av);
            return KVD_ENOMEM;
        }
        free(s->tab);
        free(s->add_id);
        free(s->add);
        s->tab = t;
        s->add_id = ai;
        s->add = av;
        s->tab_cap = cap;
    }
    for (uint32_t i = 0; i < s->tab_cap; i++)
        s->tab[i] = (struct addend){ .id = -1 };
    for (uint32_t i = 0; i < p->n_logit_bias; i++)
        *tab_slot(s, p->logit_bias_ids[i]) = (struct addend){ p->logit_bias_ids[i], 0, p->logit_bias[i] };
    for (size_t i = 0; i < n_out; i++) {
        const int32_t id = history[from + i];
        if (id < 0 || (uint32_t)id >= s->n_vocab)
            continue;
        struct addend *a = tab_slot(s, id);
        a->id = id;
        a->count++;
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < s->tab_cap; i++) {
        const struct addend *a = &s->tab[i];
        if (a->id < 0)
            continue;
        const float add = a->bias - ((a->count > 0 ? p->presence_penalty : 0.0f) +
                                     p->frequency_penalty * (float)a->count);
        if (add != 0.0f) {
            s->add_id[n] = a->id;
            s->add[n++] = add;
        }
    }
    d->n_biased = n;
    d->biased = s->add_id;
    d->bias = s->add;
    return 0;
}

void sampler_plan(sampler_t *s, const int32_t *history, size_t n_hist, struct sampler_draw *d)
{
    const struct sampler_params *p = &s->p;
    *d = (struct sampler_draw){
        .temperature = p->temperature, .top_k = p->top_k, .top_p = p->top_p, .min_p = p->min_p,
        .log_min_p = p->min_p > 0.0f ? log(p->min_p) : 0.0, .repeat_penalty = p->repeat_penalty,
    };
    if (p->repeat_penalty != 1.0f && history != NULL) {
        const size_t from = n_hist > (size_t)p->repeat_last_n ? n_hist - (size_t)p->repeat_last_n : 0;
        /* each distinct token of the window is penalized once */
        uint32_t np = 0;
        for (size_t i = from; i < n_hist && np < s->pen_cap; i++) {
            const int32_t id = history[i];
            if (id < 0 || (uint32_t)id >= s->n_vocab)
                continue;
            bool seen = false;
            for (size_t j = from; j < i && !seen; j++)
                seen = history[j] == id;
            if (!seen)
                s->pen[np++] = id;
        }
        d->n_penalized = np;
        d->penalized = s->pen;
    }
    if (p->n_logit_bias > 0 || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) {
        if (plan_addends(s, history, n_hist, d) != 0) {
            /* no memory for the table: the additive terms are left out of this
             * draw rather than the draw failing (counted nowhere else) */
            d->n_biased = 0;
        }
    }
    if (p->temperature > 0.0f)
        d->u = rng_uniform(s->rng);
}

int32_t sampler_sample(sampler_t *s, const float *logits, const int32_t *history, size_t n_hist)
{
    struct sampler_draw d;
    sampler_plan(s, history, n_hist, &d);
    return sampler_pick(s, &d, logits);
}

/* The penalized row in s->work; returns false for a greedy draw, with *id set. */
static bool penalize(sampler_t *s, const struct sampler_draw *p, const float *logits, int32_t *id)
{
    float *w = s->work;
    memcpy(w, logits, s->n_vocab * sizeof(float));
    for (uint32_t i = 0; i < p->n_penalized; i++) {
        const int32_t t = p->penalized[i];
        w[t] = w[t] > 0.0f ? w[t] / p->repeat_penalty : w[t] * p->repeat_penalty;
    }
    for (uint32_t i = 0; i < p->n_biased; i++)
        w[p->biased[i]] += p->bias[i];
    if (p->temperature <= 0.0f) {
        *id = sampler_argmax(w, s->n_vocab);
        return false;
    }
    return true;
}

/* k, the candidates top-k keeps (all of them when it is off) */
static size_t keep_k(const struct sampler_draw *p, uint32_t n)
{
    return p->top_k > 0 && (uint32_t)p->top_k < n ? (size_t)p->top_k : n;
}

/* Truncations (top-p, min-p over the k best, in cand_cmp's order in c),
 * temperature and the draw. */
static int32_t draw_from(const struct sampler_draw *p, struct cand *c, size_t k)
{
    /* probabilities at temperature 1 for the truncations (llama.cpp applies
     * top-p and min-p before temperature) */
    double sum = 0.0;
    for (size_t i = 0; i < k; i++)
        sum += exp((double)c[i].logit - c[0].logit);
    if (p->top_p < 1.0f) {
        double cum = 0.0;
        for (size_t i = 0; i < k; i++) {
            cum += exp((double)c[i].logit - c[0].logit) / sum;
            if (cum >= p->top_p) {
                k = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0.0f) {
        double floor_logit = c[0].logit + p->log_min_p;
        size_t keep = 1;
        while (keep < k && c[keep].logit >= floor_logit)
            keep++;
        k = keep;
    }

    /* temperature, then a draw */
    const double top = c[0].logit;
    double total = 0.0;
    for (size_t i = 0; i < k; i++) {
        double e = exp(((double)c[i].logit - top) / p->temperature);
        c[i].logit = (float)e;
        total += e;
    }
    double u = p->u * total, acc = 0.0;
    for (size_t i = 0; i < k; i++) {
        acc += c[i].logit;
        if (u < acc)
            return c[i].id;
    }
    return c[k - 1].id;
}

/* a before b in cand_cmp's order (neither NaN) */
static inline bool ahead(float la, int32_t ia, float lb, int32_t ib)
{
    return la > lb || (la == lb && ia < ib);
}

static void sift_down(struct cand *h, size_t k, size_t i)
{
    /* h is a heap whose root is the last in cand_cmp's order */
    for (;;) {
        size_t worst = i, l = 2 * i + 1, r = l + 1;
        if (l < k && ahead(h[worst].logit, h[worst].id, h[l].logit, h[l].id))
            worst = l;
        if (r < k && ahead(h[worst].logit, h[worst].id, h[r].logit, h[r].id))
            worst = r;
        if (worst == i)
            return;
        const struct cand t = h[i];
        h[i] = h[worst];
        h[worst] = t;
        i = worst;
    }
}

/* The k best of w (n values, none NaN) into c[0..k), in cand_cmp's order: a
 * heap of the k best so far, whose root (the worst of them) each newcomer
 * must beat, then a sort of the k. */
static void best_by_heap(struct cand *c, const float *w, uint32_t n, size_t k)
{
    for (size_t i = 0; i < k; i++)
        c[i] = (struct cand){ (int32_t)i, w[i] };
    for (size_t i = k / 2; i-- > 0;)
        sift_down(c, k, i);
    for (uint32_t i = (uint32_t)k; i < n; i++) {
        if (ahead(w[i], (int32_t)i, c[0].logit, c[0].id)) {
            c[0] = (struct cand){ (int32_t)i, w[i] };
            sift_down(c, k, 0);
        }
    }
    qsort(c, k, sizeof(*c), cand_cmp);
}

/* Descending float order as ascending unsigned keys; -0 is +0 (cand_cmp
 * finds them equal, and then the ids decide). */
static inline uint32_t desc_key(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if (u == 0x80000000u)
        u = 0;
    const uint32_t asc = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~asc;
}

/* All n of w (none NaN) into c in cand_cmp's order: a stable radix sort on
 * the keys, four passes of 8 bits, from candidates in id order (so equal
 * logits stay in id order). */
static void all_by_radix(struct cand *c, struct cand *spare, const float *w, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        c[i] = (struct cand){ (int32_t)i, w[i] };
    struct cand *from = c, *to = spare;
    for (int shift = 0; shift < 32; shift += 8) {
        uint32_t count[257] = { 0 };
        for (uint32_t i = 0; i < n; i++)
            count[((desc_key(from[i].logit) >> shift) & 0xff) + 1]++;
        for (int b = 0; b < 256; b++)
            count[b + 1] += count[b];
        for (uint32_t i = 0; i < n; i++)
            to[count[(desc_key(from[i].logit) >> shift) & 0xff]++] = from[i];
        struct cand *t = from;
        from = to;
        to = t;
    }
    /* an even number of passes: the result is back in c */
}

/* Top-k up to this many is a heap selection; more, or off, a radix sort. */
#define HEAP_K_MAX 2048

int32_t sampler_pick(sampler_t *s, const struct sampler_draw *p, const float *logits)
{
    int32_t id;
    if (!penalize(s, p, logits, &id))
        return id;
    const uint32_t n = s->n_vocab;
    const float *w = s->work;
    bool nan = false;
    for (uint32_t i = 0; i < n; i++)
        nan |= w[i] != w[i];
    const size_t k = keep_k(p, n);
    if (nan) {
        /* no total order: the definition's sort, whatever it makes of them */
        for (uint32_t i = 0; i < n; i++)
            s->cands[i] = (struct cand){ (int32_t)i, w[i] };
        qsort(s->cands, n, sizeof(*s->cands), cand_cmp);
    } else if (k <= HEAP_K_MAX && k < n) {
        best_by_heap(s->cands, w, n, k);
    } else {
        all_by_radix(s->cands, s->spare, w, n);
    }
    return draw_from(p, s->cands, k);
}

int32_t sampler_pick_sorted(sampler_t *s, const struct sampler_draw *p, const float *logits)
{
    int32_t id;
    if (!penalize(s, p, logits, &id))
        return id;
    const uint32_t n = s->n_vocab;
    for (uint32_t i = 0; i < n; i++)
        s->cands[i] = (struct cand){ (int32_t)i, s->work[i] };
    qsort(s->cands, n, sizeof(*s->cands), cand_cmp);
    return draw_from(p, s->cands, keep_k(p, n));
}

void sampler_set_output_from(sampler_t *s, uint32_t from)
{
    s->p.output_from = from;
}
