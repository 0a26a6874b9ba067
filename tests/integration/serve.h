/*
 * serve.h - helpers of the serving tests (test_serve_*_ref.c): kvd as a real
 * process in a temporary directory, talked to over ipc:// with the C client
 * or with a raw ZeroMQ DEALER for hand-made frames.
 *
 * sv_start() forks and execs kvd (its stderr, and its workers', into a log in
 * the directory), in a process group of its own and with PR_SET_PDEATHSIG,
 * and waits until kvd_health says ok. sv_stop() sends SIGTERM and waits for
 * the exit. Whatever still runs when the test exits (a REQUIRE failure exits
 * at once) is killed by an atexit handler, which also prints the logs when a
 * check failed (or KVD_TEST_LOGS is set) and removes the temporary
 * directories and the pool segments of killed daemons. Header-only: each
 * test is its own program.
 *
 * Tests assert behaviour, never speed (these machines may be slow, busy, or
 * run the portable C kernels): they wait for conditions, and every wait is
 * bounded by SV_WAIT_MS, which only fails a test that hangs.
 */
#ifndef KVD_TEST_SERVE_H
#define KVD_TEST_SERVE_H

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "check.h"
#include "kvd_client.h"
#include "wire.h"

#define SV_MAX_PROCS 8
#define SV_MAX_PIDS 16
/* The longest any one wait may take (a reply, a state, an exit): a bound on a
 * hang, never a measure of speed. */
#define SV_WAIT_MS 300000
/* --worker-timeout where hangs are not the subject: minutes, so that no step
 * of a slow or busy machine makes a live worker look dead (below SV_WAIT_MS,
 * so that a real hang is still reported by kvd first). */
#define SV_WORKER_TIMEOUT "120000"

/* One kvd process. */
struct sv_kvd {
    pid_t pid;                  /* kvd while it runs; 0 once reaped */
    pid_t first_pid;            /* kvd's pid, kept after the reap */
    int status;                 /* its waitpid status once reaped */
    char dir[64];               /* its temporary directory */
    char ep[128];               /* ipc:// endpoint of its client socket */
    char log[128];              /* kvd's (and its workers') stderr */
    pid_t workers[SV_MAX_PIDS]; /* worker pids seen; killed at exit if still there */
    int n_workers;
};

static struct sv_kvd sv_procs[SV_MAX_PROCS];
static int sv_n_procs;
static bool sv_ok;              /* set by sv_pass(): the test got to its end */
static void *sv_zctx;           /* context of the raw DEALER sockets */

static inline double sv_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static inline void sv_sleep_ms(int ms)
{
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static inline void sv_print_log(const struct sv_kvd *k)
{
    FILE *f = fopen(k->log, "r");
    if (f == NULL)
        return;
    fprintf(stderr, "---- %s ----\n", k->log);
    char line[1024];
    while (fgets(line, sizeof(line), f))
        fputs(line, stderr);
    fprintf(stderr, "---- end of %s ----\n", k->log);
    fclose(f);
}

/* Whether pid is a live process (a zombie of ours counts as gone). */
static inline bool sv_alive(pid_t pid)
{
    if (pid <= 0 || kill(pid, 0) != 0)
        return false;
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return false;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    return p == NULL || (p[1] == ' ' && p[2] != 'Z' && p[2] != 'X');
}

/* Whether pid is a live kvd-worker (not a process that reused the pid). */
static inline bool sv_is_worker(pid_t pid)
{
    char path[64], comm[64] = "";
    snprintf(path, sizeof(path), "/proc/%d/comm", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return false;
    bool got = fgets(comm, sizeof(comm), f) != NULL;
    fclose(f);
    return got && strncmp(comm, "kvd-worker", 10) == 0 && sv_alive(pid);
}

/* Kills and reaps what is left; prints the logs when something failed. */
static inline void sv_cleanup(void)
{
    bool failed = !sv_ok || check_failures > 0 || getenv("KVD_TEST_LOGS") != NULL;
    for (int i = 0; i < sv_n_procs; i++) {
        struct sv_kvd *k = &sv_procs[i];
        if (k->pid > 0) {
            kill(-k->pid, SIGKILL); /* its process group: kvd and the workers it started */
            kill(k->pid, SIGKILL);
            waitpid(k->pid, NULL, 0);
            k->pid = 0;
            char shm[64];
            snprintf(shm, sizeof(shm), "/dev/shm/kvd-%d", (int)k->first_pid);
            unlink(shm);
        }
        for (int j = 0; j < k->n_workers; j++)
            if (sv_is_worker(k->workers[j])) {
                kill(k->workers[j], SIGKILL);
                kill(k->workers[j], SIGCONT);
            }
        for (int j = 0; j < k->n_workers; j++) {
            /* orphans reparented to us (not our children: ECHILD at once) */
            double until = sv_now_ms() + 2000;
            while (waitpid(k->workers[j], NULL, WNOHANG) == 0 && sv_now_ms() < until)
                sv_sleep_ms(10);
        }
        if (failed)
            sv_print_log(k);
        char path[512];
        snprintf(path, sizeof(path), "%s/kvd.sock", k->dir);
        unlink(path);
        snprintf(path, sizeof(path), "%s/workers-%d.sock", k->dir, (int)k->first_pid);
        unlink(path);
        snprintf(path, sizeof(path), "%s/kvd.log", k->dir);
        unlink(path);
        rmdir(k->dir);
    }
    sv_n_procs = 0;
}

/* Marks the test as having reached its end (logs are printed only on failure). */
static inline void sv_pass(void)
{
    sv_ok = true;
}

/* Remembers a worker pid, so that cleanup makes sure it is gone. */
static inline void sv_note_worker(struct sv_kvd *k, pid_t pid)
{
    for (int i = 0; i < k->n_workers; i++)
        if (k->workers[i] == pid)
            return;
    if (pid > 0 && k->n_workers < SV_MAX_PIDS)
        k->workers[k->n_workers++] = pid;
}

/* A client of k (the caller destroys it). */
static inline kvd_client_t *sv_client(const struct sv_kvd *k, int timeout_ms)
{
    char err[256];
    kvd_client_t *c = kvd_client_new(k->ep, timeout_ms, err, sizeof(err));
    if (c == NULL)
        fprintf(stderr, "kvd_client_new: %s\n", err);
    REQUIRE(c != NULL);
    return c;
}

/* kvd's stats (through a fresh client) into *s, which the caller frees with
 * kvd_stats_free (a filled *s is overwritten, not freed); REQUIREs an answer.
 * Notes the worker pids. */
static inline void sv_stats(struct sv_kvd *k, struct kvd_stats *s)
{
    kvd_client_t *c = sv_client(k, SV_WAIT_MS);
    int rc = kvd_stats(c, s);
    if (rc != 0)
        fprintf(stderr, "kvd_stats: %s\n", kvd_strerror(rc));
    REQUIRE(rc == 0);
    kvd_client_destroy(&c);
    for (uint32_t i = 0; i < s->n_workers; i++)
        sv_note_worker(k, s->workers[i].pid);
}

static inline void sv_print_stats(const char *what, const struct kvd_stats *s)
{
    fprintf(stderr,
            "%s: running %llu queued %llu done %llu failed %llu; prompt %llu cached %llu "
            "generated %llu; blocks %u: free %u cached %u in use %u pending %u; evictions %llu "
            "preemptions %llu bad messages %llu\n",
            what, (unsigned long long)s->requests_running, (unsigned long long)s->requests_queued,
            (unsigned long long)s->requests_done, (unsigned long long)s->requests_failed,
            (unsigned long long)s->prompt_tokens, (unsigned long long)s->cached_prompt_tokens,
            (unsigned long long)s->completion_tokens, s->blocks_total, s->blocks_free,
            s->blocks_cached, s->blocks_in_use, s->blocks_pending,
            (unsigned long long)s->evictions, (unsigned long long)s->preemptions,
            (unsigned long long)s->bad_messages);
    for (uint32_t i = 0; i < s->n_workers; i++)
        fprintf(stderr, "  worker %u: pid %d %s, %u running, %llu tokens, %u restarts\n",
                s->workers[i].id, s->workers[i].pid, s->workers[i].alive ? "alive" : "dead",
                s->workers[i].running, (unsigned long long)s->workers[i].tokens,
                s->workers[i].restarts);
}

/* Polls stats until nothing runs or waits and no block is referenced or
 * pending; false after timeout_ms. The last stats are in *s either way, for
 * the caller to free with kvd_stats_free. */
static inline bool sv_wait_idle(struct sv_kvd *k, struct kvd_stats *s, int timeout_ms)
{
    double until = sv_now_ms() + timeout_ms;
    for (;;) {
        sv_stats(k, s);
        if (s->requests_running == 0 && s->requests_queued == 0 && s->blocks_in_use == 0 &&
            s->blocks_pending == 0)
            return true;
        if (sv_now_ms() > until) {
            sv_print_stats("not idle", s);
            return false;
        }
        kvd_stats_free(s);
        sv_sleep_ms(50);
    }
}

/* Starts kvd with the model, an ipc:// endpoint in a new temporary directory
 * and the given extra arguments (NULL-terminated), and waits (up to
 * SV_WAIT_MS) until its health is ok with all of its --workers alive. */
static inline struct sv_kvd *sv_start(const char *const *args)
{
    static bool registered;
    if (!registered) {
        atexit(sv_cleanup);
        /* workers orphaned by a killed kvd become ours to reap, not init's */
        prctl(PR_SET_CHILD_SUBREAPER, 1);
        registered = true;
    }
    REQUIRE(sv_n_procs < SV_MAX_PROCS);
    struct sv_kvd *k = &sv_procs[sv_n_procs];
    memset(k, 0, sizeof(*k));
    char dir[] = "/tmp/kvd-test-serve-XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL);
    snprintf(k->dir, sizeof(k->dir), "%s", dir);
    sv_n_procs++;
    snprintf(k->ep, sizeof(k->ep), "ipc://%s/kvd.sock", dir);
    snprintf(k->log, sizeof(k->log), "%s/kvd.log", dir);

    char *argv[64];
    int a = 0;
    argv[a++] = KVD_BIN_DIR "/kvd";
    argv[a++] = "--model";
    argv[a++] = KVD_TEST_MODEL;
    argv[a++] = "--listen";
    argv[a++] = k->ep;
    for (int i = 0; args && args[i] && a < 62; i++)
        argv[a++] = (char *)args[i];
    argv[a] = NULL;
    fprintf(stderr, "starting:");
    for (int i = 0; i < a; i++)
        fprintf(stderr, " %s", argv[i]);
    fputc('\n', stderr);

    fflush(NULL);
    pid_t parent = getpid();
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test */
        if (getppid() != parent)
            _exit(1);
        int fd = open(k->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int null = open("/dev/null", O_RDWR);
        if (fd < 0 || null < 0)
            _exit(126);
        dup2(null, 0);
        dup2(fd, 1);
        dup2(fd, 2);
        execv(argv[0], argv);
        _exit(127);
    }
    setpgid(pid, pid);
    k->pid = k->first_pid = pid;

    uint32_t want = 1; /* every worker asked for, not just the first, is up */
    for (int i = 0; args && args[i] && args[i + 1]; i++)
        if (strcmp(args[i], "--workers") == 0 || strcmp(args[i], "-w") == 0)
            want = (uint32_t)atoi(args[i + 1]);
    kvd_client_t *c = sv_client(k, 500);
    double until = sv_now_ms() + SV_WAIT_MS;
    bool ok = false;
    while (!ok && sv_now_ms() < until) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            k->pid = 0;
            k->status = st;
            fprintf(stderr, "kvd exited during start-up (status %d)\n", st);
            sv_print_log(k);
            break;
        }
        uint32_t alive = 0;
        if (kvd_health(c, &ok, &alive) != 0 || alive < want)
            ok = false;
        if (!ok)
            sv_sleep_ms(50);
    }
    kvd_client_destroy(&c);
    REQUIRE(ok);
    struct kvd_stats s;
    sv_stats(k, &s); /* notes the workers' pids */
    kvd_stats_free(&s);
    return k;
}

/* Waits up to timeout_ms for kvd to exit (after a SIGTERM sent by the
 * caller); returns its exit status (-1: ended by a signal, or killed here
 * after the timeout). Checks that the pool segment and the workers are gone. */
static inline int sv_wait_exit(struct sv_kvd *k, int timeout_ms)
{
    REQUIRE(k->pid > 0);
    double until = sv_now_ms() + timeout_ms;
    int st = 0;
    pid_t got = 0;
    while ((got = waitpid(k->pid, &st, WNOHANG)) == 0 && sv_now_ms() < until)
        sv_sleep_ms(20);
    if (got != k->pid) {
        fprintf(stderr, "kvd did not exit within %d ms of SIGTERM\n", timeout_ms);
        kill(-k->pid, SIGKILL);
        kill(k->pid, SIGKILL);
        waitpid(k->pid, &st, 0);
        k->pid = 0;
        return -1;
    }
    k->pid = 0;
    k->status = st;
    char shm[64];
    snprintf(shm, sizeof(shm), "/dev/shm/kvd-%d", (int)k->first_pid);
    CHECK(access(shm, F_OK) != 0);
    /* its workers went with it */
    double wuntil = sv_now_ms() + SV_WAIT_MS;
    for (int i = 0; i < k->n_workers; i++) {
        while (sv_alive(k->workers[i]) && sv_now_ms() < wuntil)
            sv_sleep_ms(20);
        if (sv_alive(k->workers[i]))
            fprintf(stderr, "worker %d outlived its kvd\n", (int)k->workers[i]);
        CHECK(!sv_alive(k->workers[i]));
    }
    if (!WIFEXITED(st)) {
        fprintf(stderr, "kvd ended by signal %d\n", WIFSIGNALED(st) ? WTERMSIG(st) : 0);
        return -1;
    }
    return WEXITSTATUS(st);
}

/* SIGTERM, then sv_wait_exit(). */
static inline int sv_stop(struct sv_kvd *k, int timeout_ms)
{
    REQUIRE(k->pid > 0);
    kill(k->pid, SIGTERM);
    return sv_wait_exit(k, timeout_ms);
}

/* Whether kvd's log contains needle. */
static inline bool sv_log_has(const struct sv_kvd *k, const char *needle)
{
    FILE *f = fopen(k->log, "r");
    if (f == NULL)
        return false;
    char line[2048];
    bool found = false;
    while (!found && fgets(line, sizeof(line), f))
        found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}

/* ---- raw DEALER ---------------------------------------------------------------------- */

/* A DEALER connected to k (close with zmq_close). */
static inline void *sv_dealer(const struct sv_kvd *k)
{
    if (sv_zctx == NULL)
        sv_zctx = zmq_ctx_new();
    REQUIRE(sv_zctx != NULL);
    void *s = zmq_socket(sv_zctx, ZMQ_DEALER);
    REQUIRE(s != NULL);
    int zero = 0;
    int64_t maxmsg = WIRE_MAX_FRAME;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    REQUIRE(zmq_connect(s, k->ep) == 0);
    return s;
}

/* Sends len raw bytes as one frame (flags: ZMQ_SNDMORE for multi-part). */
static inline void sv_send_raw(void *s, const void *buf, size_t len, int flags)
{
    REQUIRE(zmq_send(s, buf, len, flags) == (int)len);
}

/* Packs m with wire_pack and sends it. */
static inline void sv_send_msg(void *s, const Kvd__ClientRequest *m)
{
    uint8_t *buf;
    size_t len;
    REQUIRE(wire_pack(&m->base, &buf, &len) == 0);
    sv_send_raw(s, buf, len, 0);
    free(buf);
}

/* A ClientRequest with version 1 and request_id id, no body. */
static inline void sv_req_init(Kvd__ClientRequest *m, uint64_t id)
{
    kvd__client_request__init(m);
    m->has_version = true;
    m->version = WIRE_VERSION;
    m->has_request_id = true;
    m->request_id = id;
}

/* Receives one reply within timeout_ms, unpacked into arena (reset first);
 * NULL on a timeout. REQUIREs that what came is a readable reply. */
static inline Kvd__ServerReply *sv_recv(void *s, wire_arena_t *arena, int timeout_ms)
{
    zmq_pollitem_t it = { s, 0, ZMQ_POLLIN, 0 };
    double until = sv_now_ms() + timeout_ms;
    for (;;) {
        double left = until - sv_now_ms();
        if (left < 0)
            left = 0;
        int n = zmq_poll(&it, 1, (long)left);
        if (n > 0)
            break;
        if (n < 0 && errno == EINTR)
            continue;
        if (sv_now_ms() >= until)
            return NULL;
    }
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    REQUIRE(zmq_msg_recv(&msg, s, 0) >= 0);
    CHECK(!zmq_msg_more(&msg));
    wire_arena_reset(arena);
    int code;
    char err[256];
    Kvd__ServerReply *r = wire_server_reply_unpack(arena, zmq_msg_data(&msg), zmq_msg_size(&msg),
                                                   &code, err, sizeof(err));
    if (r == NULL)
        fprintf(stderr, "unreadable reply from kvd: %s\n", err);
    REQUIRE(r != NULL);
    zmq_msg_close(&msg);
    return r;
}

/* ---- prompts ----------------------------------------------------------------------- */

/* tests/data/ppl_text.txt, read once (NUL-terminated). */
static inline const char *sv_text(size_t *len)
{
    static char *text;
    static size_t n;
    if (text == NULL) {
        FILE *f = fopen(KVD_TEST_DATA "/ppl_text.txt", "rb");
        REQUIRE(f != NULL);
        text = malloc(1 << 20);
        REQUIRE(text != NULL);
        n = fread(text, 1, (1 << 20) - 1, f);
        text[n] = '\0';
        fclose(f);
    }
    if (len)
        *len = n;
    return text;
}

/* A new string of about n bytes of the text from byte `from`, cut at word
 * boundaries on both ends. */
static inline char *sv_slice(size_t from, size_t n)
{
    size_t len;
    const char *t = sv_text(&len);
    REQUIRE(from < len);
    while (from > 0 && from < len && t[from - 1] != ' ' && t[from - 1] != '\n')
        from++;
    size_t end = from + n < len ? from + n : len;
    while (end > from + 1 && end < len && t[end] != ' ' && t[end] != '\n')
        end--;
    return strndup(t + from, end - from);
}

#endif
