/*
 * tpool.h - a persistent pool of threads that run one parallel job at a time.
 *
 * tpool_run(p, fn, ctx) calls fn(ctx, i, n) once for every i in [0, n), where
 * n is the pool's thread count, the caller's thread being thread 0, and returns
 * when all calls have returned. Work is split by the callee from (i, n), or
 * taken by the threads as they come free (the matrix products' chunks); either
 * way a job's results never depend on timing: each output is computed whole
 * by one call, the same wherever it runs.
 */
#ifndef KVD_TPOOL_H
#define KVD_TPOOL_H

typedef struct tpool tpool_t;
typedef void (*tpool_fn)(void *ctx, int ith, int nth);

/* Starts n_threads - 1 workers (n_threads >= 1; 0 means the CPU count).
 * Returns NULL when threads cannot be created. */
tpool_t *tpool_new(int n_threads);

/* Stops and joins the workers; accepts NULL and sets *p to NULL. */
void tpool_destroy(tpool_t **p);

int tpool_size(const tpool_t *p);

/* Runs fn on every thread of the pool and waits for all of them. Not reentrant. */
void tpool_run(tpool_t *p, tpool_fn fn, void *ctx);

/* The [begin, end) share of thread ith out of nth over n items. */
static inline void tpool_split(long n, int ith, int nth, long *begin, long *end)
{
    long per = n / nth, extra = n % nth;
    *begin = ith * per + (ith < extra ? ith : extra);
    *end = *begin + per + (ith < extra ? 1 : 0);
}

#endif
