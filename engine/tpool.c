/* tpool.c - the thread pool: a generation counter under one mutex. */
#include "tpool.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

struct worker {
    tpool_t *pool;
    int index;              /* 1..n-1; the caller is thread 0 */
    pthread_t thread;
};

struct tpool {
    int n;                  /* threads, including the caller */
    struct worker *workers; /* n - 1 entries */
    pthread_mutex_t mu;
    pthread_cond_t start;   /* signalled when a new generation begins */
    pthread_cond_t done;    /* signalled when the last worker finishes */
    unsigned long gen;      /* incremented per job */
    int pending;            /* workers still running the current job */
    bool stop;              /* set by tpool_destroy */
    tpool_fn fn;            /* the current job */
    void *ctx;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    tpool_t *p = w->pool;
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->gen == seen && !p->stop)
            pthread_cond_wait(&p->start, &p->mu);
        if (p->stop)
            break;
        seen = p->gen;
        tpool_fn fn = p->fn;
        void *ctx = p->ctx;
        pthread_mutex_unlock(&p->mu);
        fn(ctx, w->index, p->n);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
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
    pthread_cond_init(&p->done, NULL);
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
    p->stop = true;
    pthread_cond_broadcast(&p->start);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++)
        pthread_join(p->workers[i - 1].thread, NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->start);
    pthread_cond_destroy(&p->done);
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
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->pending = p->n - 1;
    p->gen++;
    pthread_cond_broadcast(&p->start);
    pthread_mutex_unlock(&p->mu);
    fn(ctx, 0, p->n);
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
