/*
 * tpool.c - the thread pool: workers spin briefly on a generation counter,
 * so that the many short jobs of a forward step (a few per layer) start and
 * end in well under a microsecond, then sleep on a condition variable when
 * no job comes for a while.
 */
#include "tpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define SPIN_PAUSES 2000    /* polls with a pause before polls start to yield the CPU */
#define SPIN_ROUNDS 20000   /* polls before a worker sleeps */

/* One poll of a spin: a pause at first, then a yield, so that a spinning thread
 * gives its core back when the machine is busier than the pool (another
 * process, or a preempted partner that the spinner is waiting for). */
static inline void spin_wait(int i)
{
    if (i < SPIN_PAUSES)
        cpu_relax();
    else
        sched_yield();
}

struct worker {
    tpool_t *pool;
    int index;              /* 1..n-1; the caller is thread 0 */
    pthread_t thread;
};

struct tpool {
    int n;                  /* threads, including the caller */
    struct worker *workers; /* n - 1 entries */
    pthread_mutex_t mu;     /* guards sleeping workers */
    pthread_cond_t start;   /* wakes sleeping workers */
    unsigned long gen;      /* atomic: incremented per job (and at stop) */
    int pending;            /* atomic: workers still running the current job */
    int sleepers;           /* workers waiting on start (under mu) */
    bool stop;              /* atomic: set by tpool_destroy */
    tpool_fn fn;            /* the current job, published by gen */
    void *ctx;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    tpool_t *p = w->pool;
    unsigned long seen = 0;
    for (;;) {
        unsigned long g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE);
        for (int i = 0; g == seen && i < SPIN_ROUNDS; i++) {
            spin_wait(i);
            g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE);
        }
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            p->sleepers++;
            while ((g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE)) == seen)
                pthread_cond_wait(&p->start, &p->mu);
            p->sleepers--;
            pthread_mutex_unlock(&p->mu);
        }
        seen = g;
        if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE))
            break;
        p->fn(p->ctx, w->index, p->n);
        __atomic_fetch_sub(&p->pending, 1, __ATOMIC_ACQ_REL);
    }
    return NULL;
}

tpool_t *tpool_new(int n_threads)
{
    if (n_threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = c > 0 ? (int)c : 1;
    }
    if (n_threads > 256)
        n_threads = 256;
    tpool_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    p->n = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->start, NULL);
    p->workers = calloc((size_t)n_threads, sizeof(*p->workers));
    if (p->workers == NULL) {
        free(p);
        return NULL;
    }
    for (int i = 1; i < n_threads; i++) {
        struct worker *w = &p->workers[i - 1];
        w->pool = p;
        w->index = i;
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
            p->n = i;  /* join only those started */
            tpool_destroy(&p);
            return NULL;
        }
    }
    return p;
}

void tpool_destroy(tpool_t **pp)
{
    if (pp == NULL || *pp == NULL)
        return;
    tpool_t *p = *pp;
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&p->stop, true, __ATOMIC_RELEASE);
    __atomic_fetch_add(&p->gen, 1, __ATOMIC_ACQ_REL);
    pthread_cond_broadcast(&p->start);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++)
        pthread_join(p->workers[i - 1].thread, NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->start);
    free(p->workers);
    free(p);
    *pp = NULL;
}

int tpool_size(const tpool_t *p) { return p->n; }

void tpool_run(tpool_t *p, tpool_fn fn, void *ctx)
{
    if (p->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    __atomic_store_n(&p->pending, p->n - 1, __ATOMIC_RELAXED);
    /* the release publishes fn, ctx and pending to workers that see the new gen */
    pthread_mutex_lock(&p->mu);
    __atomic_fetch_add(&p->gen, 1, __ATOMIC_ACQ_REL);
    if (p->sleepers > 0)
        pthread_cond_broadcast(&p->start);
    pthread_mutex_unlock(&p->mu);
    fn(ctx, 0, p->n);
    for (int i = 0; __atomic_load_n(&p->pending, __ATOMIC_ACQUIRE) > 0; i++)
        spin_wait(i);
}
