/* restore.c - the restore thread (restore.h). */
#include "restore.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "devmem.h"
#include "err.h"

struct job {
    struct job *next;
    struct prefix_tier_block b;     /* .tokens points at tok */
    void *dst;
    struct restore_done done;
    int32_t tok[];
};

struct restorer {
    tier_t *host;
    disk_tier_t *disk;
    uint64_t block_bytes;
    uint32_t bt;
    int device;                     /* -1: a host pool */
    uint8_t *stage;                 /* device >= 0: page-locked, one block */
    int efd;
    pthread_mutex_t mu;
    pthread_cond_t cv;              /* the thread waits for jobs, collect(wait) for none left */
    struct job *todo, **todo_tail;  /* FIFO */
    struct job *done, **done_tail;  /* FIFO */
    uint32_t busy;                  /* jobs queued or running */
    uint32_t unsignalled;           /* jobs done since the loop was last woken */
    bool stop;
    pthread_t thread;
};

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

/* Reads b from the host tier (else from disk) into dst, through the staging
 * buffer for a device pool. */
static int copy_one(restorer_t *r, const struct prefix_tier_block *b, void *dst)
{
    void *to = r->stage != NULL ? r->stage : dst;
    int from = RESTORE_FAILED;
    if (r->host != NULL && tier_get(r->host, b, to))
        from = RESTORE_HOST;
    else if (r->disk != NULL && disk_tier_get(r->disk, b, to))
        from = RESTORE_DISK;
    char err[256];
    if (from != RESTORE_FAILED && r->stage != NULL &&
        devmem_write(dst, r->stage, r->block_bytes, err, sizeof(err)) != 0) {
        fprintf(stderr, "kvd: tiers: %s\n", err);
        from = RESTORE_FAILED;
    }
    return from;
}

/* Hands a finished job to the loop (under r->mu). The loop is woken once the
 * queue has run dry (or every WAKE_EVERY jobs, should it never), not for
 * every block: a prompt's blocks come back together, and each wake-up costs
 * the loop a turn. */
enum { WAKE_EVERY = 64 };

static void post(restorer_t *r, struct job *j)
{
    j->next = NULL;
    *r->done_tail = j;
    r->done_tail = &j->next;
    if (r->todo != NULL && ++r->unsignalled < WAKE_EVERY)
        return;
    r->unsignalled = 0;
    const uint64_t one = 1;
    if (write(r->efd, &one, sizeof(one)) < 0) {
        /* the counter cannot overflow at our rates; nothing to do */
    }
}

static void *thread_main(void *arg)
{
    restorer_t *r = arg;
    char err[256];
    if (r->device >= 0 && devmem_attach(r->device, err, sizeof(err)) != 0)
        fprintf(stderr, "kvd: tiers: %s\n", err);   /* its copies fail, each a miss */
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (r->todo == NULL && !r->stop)
            pthread_cond_wait(&r->cv, &r->mu);
        struct job *j = r->todo;
        if (j == NULL)
            break;      /* stopping, and nothing is left */
        r->todo = j->next;
        if (r->todo == NULL)
            r->todo_tail = &r->todo;
        pthread_mutex_unlock(&r->mu);
        const double t0 = now_ns();
        j->done.from = copy_one(r, &j->b, j->dst);
        j->done.ns = now_ns() - t0;
        pthread_mutex_lock(&r->mu);
        post(r, j);
        r->busy--;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

restorer_t *restorer_new(tier_t *host, disk_tier_t *disk, uint64_t block_bytes, uint32_t block_tokens,
                         int device, char *err, size_t errlen)
{
    restorer_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "tiers: out of memory");
        return NULL;
    }
    r->host = host;
    r->disk = disk;
    r->block_bytes = block_bytes;
    r->bt = block_tokens;
    r->device = device;
    r->todo_tail = &r->todo;
    r->done_tail = &r->done;
    r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->efd < 0) {
        kvd_seterr(err, errlen, KVD_EIO, "tiers: eventfd: %s", strerror(errno));
        free(r);
        return NULL;
    }
    if (device >= 0 && (r->stage = devmem_host_alloc(block_bytes)) == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "tiers: no page-locked host memory for the GPU pool's copies");
        close(r->efd);
        free(r);
        return NULL;
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    if (pthread_create(&r->thread, NULL, thread_main, r) != 0) {
        kvd_seterr(err, errlen, KVD_EIO, "tiers: cannot start the restore thread");
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->cv);
        devmem_host_free(r->stage);
        close(r->efd);
        free(r);
        return NULL;
    }
    return r;
}

static void free_list(struct job *j)
{
    while (j != NULL) {
        struct job *next = j->next;
        free(j);
        j = next;
    }
}

void restorer_destroy(restorer_t **rp)
{
    if (rp == NULL || *rp == NULL)
        return;
    restorer_t *r = *rp;
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thread, NULL);      /* it finishes what is queued first */
    free_list(r->done);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    devmem_host_free(r->stage);
    close(r->efd);
    free(r);
    *rp = NULL;
}

int restorer_fd(const restorer_t *r)
{
    return r->efd;
}

bool restorer_submit(restorer_t *r, void *owner, const struct prefix_tier_block *b, uint32_t logical,
                     void *dst)
{
    struct job *j = malloc(sizeof(*j) + (size_t)r->bt * sizeof(int32_t));
    if (j == NULL)
        return false;
    memcpy(j->tok, b->tokens, (size_t)r->bt * sizeof(int32_t));
    j->b = *b;
    j->b.tokens = j->tok;
    j->dst = dst;
    j->done = (struct restore_done){ .owner = owner, .logical = logical, .part = b->part };
    j->next = NULL;
    pthread_mutex_lock(&r->mu);
    *r->todo_tail = j;
    r->todo_tail = &j->next;
    r->busy++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return true;
}

size_t restorer_collect(restorer_t *r, bool wait, void (*fn)(void *user, const struct restore_done *d),
                        void *user)
{
    uint64_t v;
    if (read(r->efd, &v, sizeof(v)) < 0) {
        /* not signalled since the last read: the list is looked at all the same */
    }
    pthread_mutex_lock(&r->mu);
    while (wait && r->busy > 0)
        pthread_cond_wait(&r->cv, &r->mu);
    struct job *list = r->done;
    r->done = NULL;
    r->done_tail = &r->done;
    pthread_mutex_unlock(&r->mu);
    size_t n = 0;
    while (list != NULL) {
        struct job *next = list->next;
        fn(user, &list->done);
        free(list);
        n++;
        list = next;
    }
    return n;
}
