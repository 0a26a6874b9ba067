/*
 * sampler.h - choosing the next token from logits.
 *
 * The chain, in llama.cpp's default order: repetition penalty over the last
 * repeat_last_n tokens, then the additive terms (OpenAI's presence and
 * frequency penalties over the output so far, and its logit_bias), then
 * top-k, top-p, min-p, temperature, and a draw from a seeded generator.
 * Temperature 0 is greedy (argmax of the penalized row, lowest id on a tie)
 * and ignores the truncations. Same seed, same logits: same tokens.
 */
#ifndef KVD_SAMPLER_H
#define KVD_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

struct sampler_params {
    float temperature;      /* 0: greedy */
    int32_t top_k;          /* keep the k most likely; 0: off */
    float top_p;            /* keep the smallest set with mass >= p; 1: off */
    float min_p;            /* drop tokens below min_p * p(best); 0: off */
    float repeat_penalty;   /* divide positive (multiply negative) logits of recent tokens; 1: off */
    int32_t repeat_last_n;  /* how many recent tokens the penalty looks at */
    uint64_t seed;          /* generator seed */
    float presence_penalty; /* [-2, 2]: subtracted from the logit of each token the output holds; 0: off */
    float frequency_penalty;/* [-2, 2]: subtracted once per time the output holds the token; 0: off */
    uint32_t output_from;   /* history positions from here on are the output (the penalties above) */
    uint32_t n_logit_bias;  /* entries of the two arrays below (at most SAMPLER_MAX_LOGIT_BIAS) */
    const int32_t *logit_bias_ids;  /* (n_logit_bias) distinct ids < n_vocab; copied by sampler_new */
    const float *logit_bias;        /* (n_logit_bias) in [-100, 100]: added to those ids' logits */
};

#define SAMPLER_MAX_LOGIT_BIAS 1024

struct sampler_params sampler_default_params(void);

typedef struct sampler sampler_t;

/* Returns NULL when a parameter is out of range (err says which) or on no memory. */
sampler_t *sampler_new(const struct sampler_params *p, uint32_t n_vocab, char *err, size_t errlen);
void sampler_destroy(sampler_t **s);

/* The history position the output starts at from now on (params'
 * output_from): for a history that was windowed (older tokens dropped). */
void sampler_set_output_from(sampler_t *s, uint32_t from);

/* Picks a token from n_vocab logits (not modified); history holds the tokens
 * so far (prompt and generated), used by the repetition penalty. */
int32_t sampler_sample(sampler_t *s, const float *logits, const int32_t *history, size_t n_hist);

/* Restarts the generator from seed (as sampler_new did from p->seed). A
 * server that reseeds before every draw from (seed, position) makes each
 * token depend only on its request and position, so that a sequence resumed
 * elsewhere draws what it would have drawn. */
void sampler_reseed(sampler_t *s, uint64_t seed);

/*
 * One draw spelled out. sampler_sample is sampler_plan (the penalized ids of
 * the history, the next uniform of the generator) followed by sampler_pick
 * (penalty, truncations, temperature and the choice over one row of logits).
 * The plan points into no logits, so the pick can run where the logits are:
 * kcuda_sample (kernels/cuda/kcuda.h) is sampler_pick's twin on the GPU.
 */
struct sampler_draw {
    float temperature;      /* <= 0: greedy (argmax of the penalized row) */
    int32_t top_k;          /* 0: off */
    float top_p;            /* 1: off */
    float min_p;            /* 0: off */
    double log_min_p;       /* log(min_p) when min_p > 0 */
    float repeat_penalty;   /* applied to the ids below */
    double u;               /* the draw, uniform in [0, 1); 0 when greedy */
    uint32_t n_penalized;   /* distinct in-range ids of the window, in order of first use */
    const int32_t *penalized; /* owned by the sampler; valid until its next plan */
    uint32_t n_biased;      /* distinct ids whose logit gets an addend, after the repetition penalty */
    const int32_t *biased;  /* (n_biased) owned by the sampler; valid until its next plan */
    const float *bias;      /* (n_biased) the addends: logit_bias - presence - frequency x count */
};

/* Fills *d for the next token: takes the generator's next uniform (only when
 * the temperature is above 0, as sampler_sample does). */
void sampler_plan(sampler_t *s, const int32_t *history, size_t n_hist, struct sampler_draw *d);

/* Picks a token from n_vocab logits (not modified) as d says; s lends its
 * scratch (any sampler of the same vocabulary will do). The candidates are
 * ordered by logit (descending; equal logits by id) and only the top-k are
 * kept: they are selected with a heap (top-k up to 2048) or the row is radix
 * sorted, in both cases into exactly the order of a full sort. */
int32_t sampler_pick(sampler_t *s, const struct sampler_draw *d, const float *logits);

/* The same by the definition: the whole row sorted with qsort, then cut to
 * top-k. The same ids as sampler_pick for every draw (unit.sampler checks). */
int32_t sampler_pick_sorted(sampler_t *s, const struct sampler_draw *d, const float *logits);

/*
 * Log-probabilities of a row for a client that asks for them (OpenAI's
 * logprobs): the log-softmax of the raw logits, before any penalty,
 * truncation or temperature (vLLM's default), in double and rounded to float.
 * Fills out with the logprob of `chosen` and the n_top (at most
 * SAMPLER_MAX_TOP_LOGPROBS) most likely ids, most likely first, equal logits
 * by id. A row with a NaN or no finite maximum gives NaN everywhere.
 */
#define SAMPLER_MAX_TOP_LOGPROBS 20
struct sampler_logprobs {
    float logprob;                              /* of the chosen token */
    uint32_t rank;                              /* its place by logit, 1: first (ties by id); 0: NaNs */
    uint32_t n_top;
    int32_t top_id[SAMPLER_MAX_TOP_LOGPROBS];
    float top_logprob[SAMPLER_MAX_TOP_LOGPROBS];
};
void sampler_logprobs(const float *logits, uint32_t n_vocab, int32_t chosen, uint32_t n_top,
                      struct sampler_logprobs *out);

/* Index of the largest logit, lowest index on a tie. */
int32_t sampler_argmax(const float *logits, uint32_t n);

#endif
