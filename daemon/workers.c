/* workers.c - kvd's worker processes: spawn, register, watch, restart. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <zmq.h>

#include "kvd.h"
#include "hosts.h"
#include "requests.h"
#include "workers.h"

/* a started worker must say Ready within this, or --worker-timeout if longer
 * (it loads the model first: a slow disk or CPU takes longer) */
#define READY_TIMEOUT_MS 60000.0

static int slot_by_rid(const struct kvd *k, const uint8_t *rid, size_t len)
{
    for (int i = 0; i < KVD_MAX_WORKERS; i++)
        if (k->workers[i].used && k->workers[i].alive && k->workers[i].rid_len == len &&
            memcmp(k->workers[i].rid, rid, len) == 0)
            return i;
    return -1;
}

static int spawn(struct kvd *k, int i)
{
    struct worker *w = &k->workers[i];
    char path[4200], id[16], threads[16], bt[16], step[16], batch[16], ctx[16], step_ms[16], gpu[16];
    snprintf(path, sizeof(path), "%s/kvd-worker", k->exe_dir);
    snprintf(id, sizeof(id), "%u", w->id);
    int t = k->o.threads;
    if (t <= 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        t = (int)(cpus / (k->o.n_workers > 0 ? k->o.n_workers : 1));
        if (t < 1)
            t = 1;
    }
    snprintf(threads, sizeof(threads), "%d", t);
    snprintf(bt, sizeof(bt), "%u", k->o.block_tokens);
    snprintf(step, sizeof(step), "%u", k->o.step_tokens);
    snprintf(batch, sizeof(batch), "%u", k->o.max_batch);
    snprintf(ctx, sizeof(ctx), "%u", k->n_ctx);
    /* steps short enough that heartbeats and progress come well within the timeout */
    uint32_t sm = k->o.worker_timeout_ms / 8;
    snprintf(step_ms, sizeof(step_ms), "%u", sm < 10 ? 10 : sm > 500 ? 500 : sm);
    snprintf(gpu, sizeof(gpu), "%d", k->o.gpu);
    char *argv[40] = { path, "--model", (char *)k->o.model, "--pool", k->pool_name, "--connect",
                       k->worker_ep, "--id", id, "--threads", threads, "--block-tokens", bt,
                       "--k-type", (char *)kv_type_name(k->o.kv.k_type),
                       "--v-type", (char *)kv_type_name(k->o.kv.v_type),
                       "--kv-rotate", (char *)kv_rotate_arg(k->o.kv.rotate),
                       "--step-tokens", step, "--max-batch", batch, "--ctx", ctx, "--step-ms", step_ms };
    int n = 0;
    while (argv[n] != NULL)
        n++;
    if (k->o.gpu >= 0) {
        /* GPU workers: the device and where kvd hands out its memory */
        argv[n++] = "--gpu";
        argv[n++] = gpu;
        argv[n++] = "--gpu-socket";
        argv[n++] = k->gpu_sock;
    }
    if (k->auth != NULL && strncmp(k->worker_ep, "tcp://", 6) == 0) {
        /* a CURVE worker endpoint: kvd's own workers hold its key pair */
        argv[n++] = "--curve-server-key";
        argv[n++] = k->cert.public_key;
        argv[n++] = "--curve-cert";
        argv[n++] = (char *)k->o.curve_secret;
    }
    argv[n] = NULL;
    fflush(NULL);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL); /* kvd blocks signals for its signalfd */
        prctl(PR_SET_PDEATHSIG, SIGTERM);     /* a worker does not outlive its kvd */
        if (getppid() != parent)
            _exit(1);
        execv(path, argv);
        fprintf(stderr, "kvd: cannot start %s: %s\n", path, strerror(errno));
        _exit(127);
    }
    w->pid = pid;
    w->spawned = true;
    w->alive = false;
    w->last_heartbeat = cli_now_ms();
    w->restart_at = 0;
    kvd_log(k, "worker %u: started, pid %d", w->id, (int)pid);
    return 0;
}

int workers_start(struct kvd *k)
{
    for (int i = 0; i < k->o.n_workers; i++) {
        struct worker *w = &k->workers[i];
        memset(w, 0, sizeof(*w));
        w->used = true;
        w->id = (uint32_t)i;
        if (spawn(k, i) != 0)
            return -1;
    }
    return 0;
}

int workers_alive(const struct kvd *k)
{
    int n = 0;
    for (int i = 0; i < KVD_MAX_WORKERS; i++)
        n += k->workers[i].used && k->workers[i].alive && !k->workers[i].draining;
    return n;
}

bool workers_can_come_back(const struct kvd *k)
{
    for (int i = 0; i < KVD_MAX_WORKERS; i++) {
        const struct worker *w = &k->workers[i];
        if (w->used && w->spawned && !w->alive && (w->pid > 0 || w->restart_at > 0))
            return true;
    }
    return false;
}

/* True once process pid has exited (reaping it when it is our child). */
static bool process_gone(pid_t pid)
{
    int st;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid)
        return true;
    if (r == 0)
        return false;
    /* not our child (a worker started by hand): gone when absent or a zombie,
     * which has closed its descriptors and so its GPU context */
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return true;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    return p == NULL || p[1] == 0 || p[2] == 'Z' || p[2] == 'X';
}

/* GPU pools: a killed worker's kernels may still be writing into its pending
 * blocks until the driver has torn its context down, which is done when the
 * process is gone. Waits for that (bounded) before the blocks are reused. */
static void wait_gone(struct kvd *k, struct worker *w)
{
    double until = cli_now_ms() + 10000;
    while (!process_gone(w->pid)) {
        if (cli_now_ms() > until) {
            kvd_log(k, "worker %u (pid %d): still there 10 s after SIGKILL; releasing its blocks "
                    "anyway", w->id, (int)w->pid);
            return;
        }
        usleep(2000);
    }
    if (w->spawned)
        w->pid = 0; /* reaped here: no kill() on a recycled pid */
}

/* Declares worker i dead: makes sure it can write nothing more, hands its
 * sequences back, and schedules a restart for the ones kvd started. */
static void lose(struct kvd *k, int i, const char *why)
{
    struct worker *w = &k->workers[i];
    bool was_alive = w->alive;
    if (w->pid > 0 && w->host == 0) {
        kill(w->pid, SIGKILL); /* a hung or stopped worker must never write again */
        if (pool_kv_device(k->pool) >= 0 && was_alive)
            wait_gone(k, w);
    }
    w->alive = false;
    kvd_log(k, "worker %u (pid %d): %s", w->id, (int)w->pid, why);
    if (was_alive)
        req_on_worker_lost(k, i);
    w->running = 0;
    w->isolating = false;
    w->starved = 0;
    hosts_check(k, w->host);
    if (w->spawned && !k->draining && !w->unusable &&
        (k->o.max_restarts < 0 || (int)w->restarts < k->o.max_restarts)) {
        double backoff = 200.0 * (1u << (w->restarts < 5 ? w->restarts : 5));
        w->restart_at = cli_now_ms() + backoff;
    } else {
        w->restart_at = 0;
    }
}

void workers_reap(struct kvd *k)
{
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        for (int i = 0; i < KVD_MAX_WORKERS; i++) {
            struct worker *w = &k->workers[i];
            if (!w->used || !w->spawned || w->pid != pid)   /* only kvd's children are reaped here */
                continue;
            char why[160];
            if (WIFSIGNALED(st))
                snprintf(why, sizeof(why), "killed by signal %d", WTERMSIG(st));
            else if (WEXITSTATUS(st) == CLI_EXIT_UNUSABLE && w->spawned)
                snprintf(why, sizeof(why), "cannot run in this configuration (its reason is above); "
                         "not restarted");
            else
                snprintf(why, sizeof(why), "exited with status %d", WEXITSTATUS(st));
            w->pid = 0; /* reaped: no kill() on a recycled pid */
            w->unusable |= WIFEXITED(st) && WEXITSTATUS(st) == CLI_EXIT_UNUSABLE && w->spawned;
            lose(k, i, why);
        }
    }
    /* kvd started workers and none of them can ever run: serving nothing
     * forever would hide the reason, so stop and say so */
    bool any = false, all_unusable = true;
    for (int i = 0; i < KVD_MAX_WORKERS; i++) {
        const struct worker *w = &k->workers[i];
        if (!w->used)
            continue;
        if (w->spawned)
            any = true;
        if (w->alive || (w->spawned && !w->unusable))
            all_unusable = false;
    }
    if (any && all_unusable && !k->stop) {
        kvd_log(k, "no worker can run (see the reasons above); stopping");
        k->exit_status = 1;
        k->stop = true;
    }
}

void workers_tick(struct kvd *k)
{
    hosts_tick(k);
    double now = cli_now_ms();
    for (int i = 0; i < KVD_MAX_WORKERS; i++) {
        struct worker *w = &k->workers[i];
        if (!w->used)
            continue;
        if (w->alive && w->unreachable) {
            lose(k, i, "unreachable");
        } else if (w->alive) {
            double quiet = now - w->last_heartbeat;
            /* sequences waiting for blocks from kvd do not count as work */
            double stuck = w->running > w->starved ? now - w->last_progress : 0;
            char why[128];
            if (quiet > k->o.worker_timeout_ms) {
                snprintf(why, sizeof(why), "no heartbeat for %.0f ms: declared dead", quiet);
                lose(k, i, why);
            } else if (stuck > k->o.worker_timeout_ms) {
                snprintf(why, sizeof(why), "no progress for %.0f ms with work: declared hung", stuck);
                lose(k, i, why);
            }
        } else if (w->spawned && w->pid > 0 &&
                   now - w->last_heartbeat > fmax(READY_TIMEOUT_MS, k->o.worker_timeout_ms)) {
            lose(k, i, "never became ready");
        } else if (w->spawned && w->pid == 0 && w->restart_at > 0 && now >= w->restart_at &&
                   !k->draining) {
            w->restarts++;
            if (spawn(k, i) != 0)
                w->restart_at = now + 1000;
        }
    }
}

int workers_send(struct kvd *k, int i, Kvdw__ToWorker *m)
{
    struct worker *w = &k->workers[i];
    m->has_version = true;
    m->version = WIRE_VERSION;
    m->has_epoch = w->epoch != 0;
    m->epoch = w->epoch;
    int rc = kvd_send(k, k->wsock, w->rid, w->rid_len, &m->base);
    if (rc != 0 && w->alive)
        w->unreachable = true;  /* lost at the next tick, outside whatever loop sent this */
    return rc;
}

/* A Ready from a routing id: a started worker reporting in, or one started by hand. */
static void on_ready(struct kvd *k, const uint8_t *rid, size_t len, uint32_t id, const Kvdw__Ready *r)
{
    const struct pool_header *h = pool_header(k->pool);
    if (r->fingerprint.len != 16 || memcmp(r->fingerprint.data, h->layout.fingerprint, 16) != 0 ||
        r->block_tokens != k->o.block_tokens) {
        kvd_log(k, "worker %u (pid %d): refused: another model or block size", id, (int)r->pid);
        k->st.bad_messages++;
        return;
    }
    const bool remote = r->host != NULL && r->host[0] != '\0';
    if (!remote && (!r->has_pool_instance || r->pool_instance != h->instance)) {
        /* a worker of kvd's own pool names it (and so its pid is one kvd may signal) */
        kvd_log(k, "worker %u: refused: it maps no pool of this kvd's (kvd-worker --host for a pool of "
                "its own host's)", id);
        k->st.bad_messages++;
        return;
    }
    int slot = -1;
    for (int i = 0; i < KVD_MAX_WORKERS && slot < 0; i++)
        if (k->workers[i].used && k->workers[i].id == id)
            slot = i;
    if (slot >= 0 && remote && k->workers[slot].spawned) {
        kvd_log(k, "worker %u (host %s): refused: kvd starts the worker of that id here", id, r->host);
        return;
    }
    if (slot >= 0 && k->workers[slot].alive && remote && k->workers[slot].host > 0 &&
        strcmp(k->hosts[k->workers[slot].host].name, r->host) == 0) {
        /* a worker of the same host says Ready again under its id: it fenced itself
         * (kvd went quiet for it) and dropped what it ran; it is lost, then taken back */
        lose(k, slot, "fenced itself (kvd was quiet for its --fence-ms)");
    }
    if (slot >= 0 && k->workers[slot].alive) {
        kvd_log(k, "worker %u (pid %d): refused: id in use by pid %d", id, (int)r->pid,
                (int)k->workers[slot].pid);
        return;
    }
    bool claimed = false;
    if (slot < 0) {
        for (int i = 0; i < KVD_MAX_WORKERS && slot < 0; i++)
            if (!k->workers[i].used)
                slot = i;
        if (slot < 0) {
            kvd_log(k, "worker %u: refused: too many workers", id);
            return;
        }
        memset(&k->workers[slot], 0, sizeof(k->workers[slot]));
        k->workers[slot].used = true;
        k->workers[slot].id = id;
        claimed = true;
    }
    int host = 0;
    if (remote && (host = hosts_join(k, r)) < 0) {
        kvd_log(k, "worker %u (host %s): refused", id, r->host);
        if (claimed)
            k->workers[slot].used = false;  /* the slot is not this refused worker's */
        return;
    }
    struct worker *w = &k->workers[slot];
    w->host = host;
    if (w->spawned && w->pid != r->pid)
        kvd_log(k, "worker %u: ready from pid %d (started as %d)", id, (int)r->pid, (int)w->pid);
    w->pid = r->pid;
    memcpy(w->rid, rid, len);
    w->rid_len = len;
    w->alive = true;
    w->unreachable = false;
    w->epoch = r->has_epoch ? r->epoch : 0;
    w->draining = false;
    w->max_batch = r->max_batch ? r->max_batch : 1;
    w->running = 0;
    w->isolating = false;
    w->starved = 0;
    w->progress = 0;
    w->last_heartbeat = w->last_progress = cli_now_ms();
    if (remote)
        kvd_log(k, "worker %u (pid %d on host %s): ready", id, (int)r->pid, r->host);
    else
        kvd_log(k, "worker %u (pid %d): ready", id, (int)r->pid);
}

void workers_on_message(struct kvd *k, const uint8_t *rid, size_t rid_len, const void *buf,
                        size_t len)
{
    char err[256];
    int code;
    wire_arena_reset(k->arena);
    Kvdw__FromWorker *m = wire_from_worker_unpack(k->arena, buf, len, &code, err, sizeof(err));
    if (m == NULL) {
        k->st.bad_messages++;
        kvd_log(k, "dropped a worker message: %s", err);
        return;
    }
    if (m->body_case == KVDW__FROM_WORKER__BODY_READY) {
        on_ready(k, rid, rid_len, m->worker_id, m->ready);
        return;
    }
    int i = slot_by_rid(k, rid, rid_len);
    if (i < 0) {
        k->st.bad_messages++; /* not registered, or declared dead: ignored */
        return;
    }
    struct worker *w = &k->workers[i];
    double now = cli_now_ms();
    w->last_heartbeat = now;
    switch (m->body_case) {
    case KVDW__FROM_WORKER__BODY_HEARTBEAT:
        if (m->heartbeat->progress != w->progress) {
            w->progress = m->heartbeat->progress;
            w->last_progress = now;
        }
        break;
    case KVDW__FROM_WORKER__BODY_COMMIT:
        w->last_progress = now;
        req_on_commit(k, i, m->commit);
        break;
    case KVDW__FROM_WORKER__BODY_CHUNK:
        w->last_progress = now;
        req_on_tokens(k, i, m->chunk);
        break;
    case KVDW__FROM_WORKER__BODY_LEASE:
        req_on_lease(k, i, m->lease->seq_id, m->lease->n_positions, m->lease->has_ahead && m->lease->ahead);
        break;
    case KVDW__FROM_WORKER__BODY_WINDOW:
        req_on_window(k, i, m->window->seq_id, m->window->n_written);
        break;
    case KVDW__FROM_WORKER__BODY_DONE:
        w->last_progress = now;
        req_on_done(k, i, m->done->seq_id, m->done->reason, m->done->n_written, m->done->error);
        break;
    default:
        k->st.bad_messages++;
        break;
    }
}

void workers_stop(struct kvd *k)
{
    Kvdw__ToWorker m = KVDW__TO_WORKER__INIT;
    Kvdw__Drain d = KVDW__DRAIN__INIT;
    m.body_case = KVDW__TO_WORKER__BODY_DRAIN;
    m.drain = &d;
    for (int i = 0; i < KVD_MAX_WORKERS; i++)
        if (k->workers[i].used && k->workers[i].alive) {
            workers_send(k, i, &m);
            k->workers[i].draining = true;
        }
    /* give them a moment to exit on their own, then make sure */
    double until = cli_now_ms() + 3000;
    for (;;) {
        bool any = false;
        for (int i = 0; i < KVD_MAX_WORKERS; i++) {
            struct worker *w = &k->workers[i];
            if (w->used && w->spawned && w->pid > 0) {
                int st;
                if (waitpid(w->pid, &st, WNOHANG) == w->pid)
                    w->pid = 0;
                else
                    any = true;
            }
        }
        if (!any)
            break;
        if (cli_now_ms() > until) {
            for (int i = 0; i < KVD_MAX_WORKERS; i++)
                if (k->workers[i].used && k->workers[i].spawned && k->workers[i].pid > 0) {
                    kill(k->workers[i].pid, SIGKILL);
                    waitpid(k->workers[i].pid, NULL, 0);
                    k->workers[i].pid = 0;
                }
            break;
        }
        usleep(20000);
    }
    for (int i = 0; i < KVD_MAX_WORKERS; i++)
        k->workers[i].alive = false;
}
