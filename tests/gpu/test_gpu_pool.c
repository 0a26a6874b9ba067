/*
 * test_gpu_pool.c - device memory shared between processes, as a GPU pool
 * shares its KV data (shm/devmem.h, shm/fdpass.h), and kvd's
 * hand-off of it to its GPU workers.
 *
 *   1. Process A allocates (devmem_create: the size rounded up to the
 *      granularity), writes a pattern with a copy and one with a memset
 *      kernel, and sends the descriptor over a socketpair to process B, which
 *      it forks and execs (CUDA does not survive a bare fork).
 *   2. B imports and maps it, reads A's patterns, writes its own (a copy),
 *      waits for its work (devmem_fence) and says so; A reads B's pattern.
 *   3. B queues a long run of kernels on the memory and A kills it with
 *      SIGKILL mid-way: A's mapping stays valid, A's patterns are intact, and
 *      A can still write and read all of it.
 *   4. A second B (a restarted worker) gets the descriptor again and sees
 *      everything A and the first B left.
 *   5. Bad imports fail with a reason and leave the context usable: a memfd,
 *      /dev/null, a closed descriptor, a size larger than the allocation or
 *      not a whole granule; an allocation larger than the device fails too.
 *   6. kvd --gpu 0 with a small random model and two GPU workers: kvd
 *      allocates the pool on the device and uploads the weights once, each
 *      worker receives and maps both over kvd's socket and says Ready (this
 *      program is built with the CUDA backend, so kvd and its workers have
 *      the GPU engine); kvd stops on SIGTERM with status 0.
 *
 * Exits 77 (skip) with the reason where no device with VMM and POSIX
 * descriptor support is usable.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "err.h"
#include "fdpass.h"
#include "kcuda.h"
#include "devmem.h"
#include "mkmodel.h"

#define DEV 0
#define ASK_BYTES ((8u << 20) + 12345u)   /* not a whole granule: must be rounded up */

static uint32_t pat_a(size_t i) { return (uint32_t)(i * 2654435761u) ^ 0xa5a5a5a5u; }
static uint32_t pat_b(size_t i) { return (uint32_t)(i * 40503u + 17u) ^ 0x5a5a0000u; }

/* The regions of the allocation (bytes, all multiples of 4 KiB):
 *   [0, q)        A, by copy        [q, 2q)  A, memset 0x3c
 *   [2q, 3q)      B, by copy        [3q, 4q) B's kernels while it is killed */
static uint64_t quarter(uint64_t bytes) { return bytes / 4 / 4096 * 4096; }

static void put_words(uint8_t *dev, size_t bytes, uint32_t (*pat)(size_t))
{
    uint32_t *h = malloc(bytes);
    REQUIRE(h != NULL);
    for (size_t i = 0; i < bytes / 4; i++)
        h[i] = pat(i);
    REQUIRE(kcuda_upload(dev, h, bytes) == 0);
    free(h);
}

/* True when bytes at dev hold pat (or, with pat NULL, all `fill` bytes). */
static bool has_words(const uint8_t *dev, size_t bytes, uint32_t (*pat)(size_t), uint8_t fill)
{
    uint32_t *h = malloc(bytes);
    REQUIRE(h != NULL);
    if (kcuda_download(h, dev, bytes) != 0) {
        fprintf(stderr, "download: %s\n", kcuda_last_error());
        free(h);
        return false;
    }
    uint32_t f = fill * 0x01010101u;
    bool ok = true;
    for (size_t i = 0; i < bytes / 4 && ok; i++)
        if (h[i] != (pat ? pat(i) : f)) {
            fprintf(stderr, "word %zu: %08x, expected %08x\n", i, h[i], pat ? pat(i) : f);
            ok = false;
        }
    free(h);
    return ok;
}

static void put_byte(int s, char c)
{
    REQUIRE(send(s, &c, 1, MSG_NOSIGNAL) == 1);
}

static char get_byte(int s)
{
    char c = 0;
    ssize_t n;
    do
        n = recv(s, &c, 1, 0);
    while (n < 0 && errno == EINTR);
    return n == 1 ? c : 0;
}

/* ---- process B ------------------------------------------------------------------------------ */

/* B: receives the memory on socket s; role 'w' (first B: verify, write, run
 * kernels until killed) or 'r' (restarted B: verify everything). Exit status
 * says where it failed. */
static int child(int s, char role)
{
    alarm(600); /* bounds on a hang, not speeds */
    struct fdpass_msg m;
    int fd;
    char err[512];
    if (fdpass_recv(s, &m, &fd, 300000, err, sizeof(err)) != 0) {
        fprintf(stderr, "B: %s\n", err);
        return 10;
    }
    if (m.kind != FDPASS_KIND_CUDA_VMM || m.device != DEV)
        return 11;
    devmem_t *mem = devmem_import(DEV, fd, m.bytes, err, sizeof(err));
    close(fd);
    if (mem == NULL) {
        fprintf(stderr, "B: import: %s\n", err);
        return 12;
    }
    uint8_t *base = devmem_ptr(mem);
    uint64_t q = quarter(devmem_bytes(mem));
    if (devmem_bytes(mem) != m.bytes)
        return 13;
    if (!has_words(base, q, pat_a, 0) || !has_words(base + q, q, NULL, 0x3c))
        return 14;
    if (role == 'r') {
        bool ok = has_words(base + 2 * q, q, pat_b, 0);
        devmem_destroy(&mem);
        return ok ? 0 : 15;
    }
    put_words(base + 2 * q, q, pat_b);
    if (devmem_fence(NULL, err, sizeof(err)) != 0) {
        fprintf(stderr, "B: fence: %s\n", err);
        return 16;
    }
    put_byte(s, 'W');
    if (get_byte(s) != 'K')
        return 17;
    /* a long queue of work on the last quarter, then tell A to kill us while
     * (most likely) some of it has not run yet */
    for (int i = 0; i < 20000; i++)
        if (kcuda_memset(base + 3 * q, i & 0xff, q, NULL) != 0)
            return 18;
    put_byte(s, 'B');
    pause();
    return 19;
}

/* Forks and execs this program as B with socket s. */
static pid_t start_child(const char *self, int s, char role)
{
    char sfd[16], r[2] = { role, 0 };
    snprintf(sfd, sizeof(sfd), "%d", s);
    fflush(NULL);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        fcntl(s, F_SETFD, 0); /* the one descriptor B inherits */
        execl(self, self, "--child", sfd, r, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static int wait_status(pid_t pid)
{
    int st;
    REQUIRE(waitpid(pid, &st, 0) == pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* ---- process A ------------------------------------------------------------------------------ */

static void test_bad_imports(const devmem_t *mem, uint64_t granule)
{
    char err[512];
    int mfd = memfd_create("kvd-not-cuda", MFD_CLOEXEC);
    REQUIRE(mfd >= 0 && ftruncate(mfd, (off_t)granule) == 0);
    CHECK(devmem_import(DEV, mfd, granule, err, sizeof(err)) == NULL);
    printf("import of a memfd: %s\n", err);
    close(mfd);
    int nul = open("/dev/null", O_RDWR | O_CLOEXEC);
    REQUIRE(nul >= 0);
    CHECK(devmem_import(DEV, nul, granule, err, sizeof(err)) == NULL);
    printf("import of /dev/null: %s\n", err);
    close(nul);
    CHECK(devmem_import(DEV, nul, granule, err, sizeof(err)) == NULL); /* closed now */
    CHECK(strstr(err, "not open") != NULL);
    CHECK(devmem_import(DEV, -1, granule, err, sizeof(err)) == NULL);
    /* the real descriptor with a wrong size */
    int fd = devmem_fd(mem);
    CHECK(devmem_import(DEV, fd, devmem_bytes(mem) + 4 * granule, err, sizeof(err)) == NULL);
    printf("import of too many bytes: %s\n", err);
    CHECK(devmem_import(DEV, fd, granule + 1, err, sizeof(err)) == NULL);
    CHECK(strstr(err, "granule") != NULL);
    CHECK(devmem_import(DEV + 4096, fd, granule, err, sizeof(err)) == NULL);
    /* more than the device has */
    CHECK(devmem_create(DEV, 1ull << 50, err, sizeof(err)) == NULL);
    printf("allocation of 1 PiB: %s\n", err);
    CHECK(devmem_create(DEV, 0, err, sizeof(err)) == NULL);
}

/* Reads a whole file into a new string ("" when absent). */
static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return strdup("");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)(n > 0 ? n : 0) + 1);
    REQUIRE(s != NULL);
    size_t got = fread(s, 1, (size_t)(n > 0 ? n : 0), f);
    s[got] = 0;
    fclose(f);
    return s;
}

static int count(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* kvd --gpu 0 with two GPU workers, up to the point where they would compute. */
static void test_kvd(void)
{
    char bin[512];
    snprintf(bin, sizeof(bin), "%s/kvd", KVD_BIN_DIR);
    if (access(bin, X_OK) != 0) {
        printf("kvd: not built (%s): part 6 skipped\n", bin);
        return;
    }
    char dir[] = "/tmp/kvd-gpu-pool-XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL);
    char model[128], log[128], ep[160];
    snprintf(model, sizeof(model), "%s/tiny.gguf", dir);
    snprintf(log, sizeof(log), "%s/kvd.log", dir);
    snprintf(ep, sizeof(ep), "ipc://%s/kvd.sock", dir);
    struct mkmodel_params mp = mkmodel_default_params();
    mp.n_embd = 128;        /* head dimension 64: a shape the GPU kernels compute */
    mp.n_head = 2;
    mp.n_head_kv = 1;
    char err[256];
    REQUIRE(mkmodel_write(&mp, model, err, sizeof(err)) == 0);
    fflush(NULL);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0)
            _exit(126);
        dup2(fd, 1);
        dup2(fd, 2);
        setenv("KVD_ENDPOINT", ep, 1);
        execl(bin, bin, "--model", model, "--gpu", "0", "--workers-per-gpu", "2", "--kv-memory",
              "64MiB", "--max-restarts", "0", "-v", (char *)NULL);
        _exit(127);
    }
    /* its workers become ready, then SIGTERM; or it stops by itself on a failure */
    int st = -1;
    bool signalled = false;
    for (int i = 0; i < 6000; i++) { /* up to 10 minutes: a bound on a hang */
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            break;
        char *text = slurp(log);
        int ready = count(text, "): ready");
        free(text);
        if (ready >= 2 && !signalled) {
            kill(pid, SIGTERM);
            signalled = true;
        }
        usleep(100000);
    }
    if (waitpid(pid, &st, WNOHANG) == 0) {
        fprintf(stderr, "kvd did not stop within 10 minutes\n");
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        CHECK(0);
    }
    char *text = slurp(log);
    int status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    const int ready = count(text, "): ready");
    printf("kvd --gpu 0: exit status %d, %d workers ready\n", status, ready);
    CHECK(strstr(text, "of KV data and") != NULL);
    CHECK(strstr(text, "of weights (one copy for all its workers) in device memory") != NULL);
    CHECK_INT(count(text, "handed the device memory to a worker"), 2);
    CHECK(strstr(text, "cannot reach kvd") == NULL);
    CHECK(strstr(text, "no device memory from kvd") == NULL);
    CHECK(strstr(text, "no weights from kvd") == NULL);
    CHECK(strstr(text, "cannot map kvd's device memory") == NULL);
    CHECK(strstr(text, "belongs to another pool") == NULL);
    CHECK_INT(ready, 2);
    CHECK_INT(status, 0);
    if (check_failures)
        fprintf(stderr, "---- %s ----\n%s---- end ----\n", log, text);
    free(text);
    unlink(log);
    unlink(model);
    rmdir(dir);
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "--child") == 0)
        return child(atoi(argv[2]), argv[3][0]);
    alarm(1700); /* a bound on a hang, under ctest's TIMEOUT */
    char why[512];
    struct devmem_dev info;
    if (devmem_probe(DEV, &info, why, sizeof(why)) != 0) {
        printf("skip: %s\n", why);
        return KVD_TEST_SKIP;
    }
    printf("device: %s, %.1f of %.1f GiB free, allocation granularity %llu KiB\n", info.name,
           info.free_bytes / 1073741824.0, info.total_bytes / 1073741824.0,
           (unsigned long long)info.granularity >> 10);

    /* 1. allocate and fill */
    char err[512];
    devmem_t *mem = devmem_create(DEV, ASK_BYTES, err, sizeof(err));
    if (mem == NULL)
        fprintf(stderr, "create: %s\n", err);
    REQUIRE(mem != NULL);
    uint64_t bytes = devmem_bytes(mem);
    CHECK(bytes >= ASK_BYTES && bytes % info.granularity == 0);
    CHECK(devmem_fd(mem) >= 0);
    CHECK(fcntl(devmem_fd(mem), F_GETFD) & FD_CLOEXEC);
    CHECK_INT(devmem_device(mem), DEV);
    uint8_t *base = devmem_ptr(mem);
    REQUIRE(base != NULL);
    uint64_t q = quarter(bytes);
    put_words(base, q, pat_a);
    REQUIRE(kcuda_memset(base + q, 0x3c, q, NULL) == 0);
    REQUIRE(kcuda_memset(base + 2 * q, 0, 2 * q, NULL) == 0);
    CHECK_INT(devmem_fence(NULL, err, sizeof(err)), 0);
    CHECK(has_words(base, q, pat_a, 0));

    /* 2. B imports, checks, writes */
    struct fdpass_msg m = { .magic = FDPASS_MAGIC, .version = FDPASS_VERSION,
                            .kind = FDPASS_KIND_CUDA_VMM, .bytes = bytes, .device = DEV,
                            .generation = 1, .instance = 42 };
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
    pid_t b = start_child(argv[0], sv[1], 'w');
    close(sv[1]);
    CHECK_INT(fdpass_send(sv[0], &m, devmem_fd(mem), err, sizeof(err)), 0);
    char c = get_byte(sv[0]);
    if (c != 'W') {
        fprintf(stderr, "B failed: status %d\n", wait_status(b));
        REQUIRE(c == 'W');
    }
    CHECK(has_words(base + 2 * q, q, pat_b, 0));
    printf("pool: B read A's patterns and A read B's\n");

    /* 3. B dies with kernels in flight; A's memory lives on */
    put_byte(sv[0], 'K');
    CHECK(get_byte(sv[0]) == 'B');
    kill(b, SIGKILL);
    CHECK_INT(wait_status(b), 128 + SIGKILL);
    close(sv[0]);
    CHECK_INT(kcuda_sync(), 0);
    CHECK(has_words(base, q, pat_a, 0));
    CHECK(has_words(base + q, q, NULL, 0x3c));
    CHECK(has_words(base + 2 * q, q, pat_b, 0));
    REQUIRE(kcuda_memset(base + 3 * q, 0x11, q, NULL) == 0);
    CHECK(has_words(base + 3 * q, q, NULL, 0x11));
    printf("pool: A's memory survived B's SIGKILL with kernels queued\n");

    /* 4. a restarted B gets it again */
    REQUIRE(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
    b = start_child(argv[0], sv[1], 'r');
    close(sv[1]);
    CHECK_INT(fdpass_send(sv[0], &m, devmem_fd(mem), err, sizeof(err)), 0);
    CHECK_INT(wait_status(b), 0);
    close(sv[0]);
    printf("pool: a second B imported it again and saw both patterns\n");

    /* 5. bad imports; the context stays usable */
    test_bad_imports(mem, info.granularity);
    CHECK(has_words(base, q, pat_a, 0));
    devmem_destroy(&mem);
    CHECK(mem == NULL);
    devmem_destroy(&mem);
    CHECK_INT(kcuda_sync(), 0);

    /* 6. kvd and its GPU workers */
    test_kvd();
    return CHECK_DONE();
}
