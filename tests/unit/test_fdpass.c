/*
 * test_fdpass.c - descriptors over Unix sockets between real processes: a
 * memfd whose contents both sides see and change, a pipe, the listening
 * socket of a coordinator, and every way a message can be wrong (truncated,
 * oversized, bad magic or version, no descriptor, two descriptors, a peer
 * that closes early or says nothing), each of which must fail with its code
 * and leave no descriptor open.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <linux/sockios.h>

#include "check.h"
#include "err.h"
#include "fdpass.h"

#define PAGE 4096
/* the longest wait for a peer that is sending: an upper bound that fails a
 * hung test, never a speed */
#define PATIENCE_MS 60000

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void check_has(const char *s, const char *needle)
{
    if (strstr(s, needle) == NULL)
        fprintf(stderr, "expected '%s' in: '%s'\n", needle, s);
    CHECK(strstr(s, needle) != NULL);
}

/* Descriptors this process has open. */
static int open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    REQUIRE(d != NULL);
    int n = 0;
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n;
}

static struct fdpass_msg good_msg(uint64_t bytes)
{
    struct fdpass_msg m = { .magic = FDPASS_MAGIC, .version = FDPASS_VERSION,
                            .kind = FDPASS_KIND_MEMORY, .bytes = bytes, .device = -1,
                            .generation = 7, .instance = 0x1234567890abcdefull };
    return m;
}

static int wait_child(pid_t pid)
{
    int st;
    REQUIRE(waitpid(pid, &st, 0) == pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Sends len raw bytes with nfd copies of fd (nfd may be 0). */
static void send_raw(int sock, const void *buf, size_t len, int fd, int nfd)
{
    struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(4 * sizeof(int))];
    } ctl;
    if (nfd > 0) {
        memset(&ctl, 0, sizeof(ctl));
        mh.msg_control = ctl.space;
        mh.msg_controllen = CMSG_SPACE((size_t)nfd * sizeof(int));
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN((size_t)nfd * sizeof(int));
        for (int i = 0; i < nfd; i++)
            memcpy(CMSG_DATA(c) + i * sizeof(int), &fd, sizeof(int));
    }
    REQUIRE(sendmsg(sock, &mh, MSG_NOSIGNAL) == (ssize_t)len);
}

/* ---- a memfd shared both ways --------------------------------------------------------- */

static void test_memfd(void)
{
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) == 0);
    int mfd = memfd_create("kvd-fdpass-test", MFD_CLOEXEC);
    REQUIRE(mfd >= 0);
    REQUIRE(ftruncate(mfd, 4 * PAGE) == 0);
    uint8_t *mem = mmap(NULL, 4 * PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    REQUIRE(mem != MAP_FAILED);
    for (int i = 0; i < 4 * PAGE; i++)
        mem[i] = (uint8_t)(i * 7 + 1);
    fflush(NULL);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        close(mfd);
        munmap(mem, 4 * PAGE);
        struct fdpass_msg m;
        int fd;
        char err[256];
        if (fdpass_recv(sv[1], &m, &fd, PATIENCE_MS, err, sizeof(err)) != 0) {
            fprintf(stderr, "child: %s\n", err);
            _exit(2);
        }
        if (m.bytes != 4 * PAGE || m.generation != 7 || m.instance != 0x1234567890abcdefull ||
            m.kind != FDPASS_KIND_MEMORY || m.device != -1)
            _exit(3);
        if (!(fcntl(fd, F_GETFD) & FD_CLOEXEC))
            _exit(4);
        uint8_t *p = mmap(NULL, m.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
            _exit(5);
        for (int i = 0; i < 4 * PAGE; i++)
            if (p[i] != (uint8_t)(i * 7 + 1))
                _exit(6);
        for (int i = 0; i < 4 * PAGE; i++)
            p[i] = (uint8_t)(255 - i % 251);
        _exit(0);
    }
    close(sv[1]);
    struct fdpass_msg m = good_msg(4 * PAGE);
    char err[256];
    CHECK_INT(fdpass_send(sv[0], &m, mfd, err, sizeof(err)), 0);
    CHECK_INT(wait_child(pid), 0);
    bool same = true;
    for (int i = 0; i < 4 * PAGE; i++)
        same &= mem[i] == (uint8_t)(255 - i % 251);
    CHECK(same);
    /* the child is gone: sending again fails cleanly, without SIGPIPE */
    CHECK_INT(fdpass_send(sv[0], &m, mfd, err, sizeof(err)), KVD_EPROTOCOL);
    /* nothing to send */
    CHECK_INT(fdpass_send(sv[0], &m, -1, err, sizeof(err)), KVD_EINVAL);
    CHECK_INT(fdpass_send(sv[0], &m, 1000000, err, sizeof(err)), KVD_EINVAL);
    munmap(mem, 4 * PAGE);
    close(mfd);
    close(sv[0]);
}

/* ---- a pipe, over a stream socket, in two pieces ----------------------------------------- */

static void test_pipe_stream(void)
{
    int sv[2], pp[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    REQUIRE(pipe(pp) == 0);
    fflush(NULL);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        close(pp[0]);
        /* the header in two writes: the descriptor with the first 10 bytes */
        struct fdpass_msg m = good_msg(1);
        m.kind = FDPASS_KIND_MEMORY;
        send_raw(sv[1], &m, 10, pp[1], 1);
        /* the rest once the parent has read those (nothing is left unread
         * in the socket), so that it surely gets the header in two pieces */
        int unread = 0;
        for (double end = now_ms() + PATIENCE_MS;
             ioctl(sv[1], SIOCOUTQ, &unread) == 0 && unread > 0 && now_ms() < end;)
            usleep(1000);
        send_raw(sv[1], (uint8_t *)&m + 10, sizeof(m) - 10, -1, 0);
        _exit(0);
    }
    close(sv[1]);
    close(pp[1]);
    struct fdpass_msg m;
    int fd;
    char err[256];
    int rc = fdpass_recv(sv[0], &m, &fd, PATIENCE_MS, err, sizeof(err));
    if (rc)
        fprintf(stderr, "%s\n", err);
    REQUIRE(rc == 0);
    CHECK_INT(m.bytes, 1);
    CHECK_INT(write(fd, "pipe!", 5), 5);
    close(fd);
    char buf[8] = { 0 };
    CHECK_INT(read(pp[0], buf, sizeof(buf)), 5);
    CHECK(memcmp(buf, "pipe!", 5) == 0);
    CHECK_INT(wait_child(pid), 0);
    close(pp[0]);
    close(sv[0]);
}

/* ---- bad messages ------------------------------------------------------------------------ */

/* Sends what `bad` says from a child and expects fdpass_recv to fail with code. */
enum bad { BAD_SHORT, BAD_LONG, BAD_MAGIC, BAD_VERSION, BAD_KIND, BAD_NOFD, BAD_TWOFDS,
           BAD_CLOSE, BAD_SILENT, BAD_STREAM_CUT };

static void expect_bad(enum bad what, int code, const char *needle)
{
    int sv[2];
    int type = what == BAD_STREAM_CUT ? SOCK_STREAM : SOCK_SEQPACKET;
    REQUIRE(socketpair(AF_UNIX, type, 0, sv) == 0);
    int go[2];  /* closed by the parent when it is done: a silent child waits for that */
    REQUIRE(pipe(go) == 0);
    fflush(NULL);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        close(go[1]);
        int mfd = memfd_create("kvd-fdpass-bad", 0);
        struct fdpass_msg m = good_msg(PAGE);
        uint8_t big[sizeof(m) + 16] = { 0 };
        switch (what) {
        case BAD_SHORT: send_raw(sv[1], &m, 20, mfd, 1); break;
        case BAD_LONG:
            memcpy(big, &m, sizeof(m));
            send_raw(sv[1], big, sizeof(big), mfd, 1);
            break;
        case BAD_MAGIC: m.magic ^= 1; send_raw(sv[1], &m, sizeof(m), mfd, 1); break;
        case BAD_VERSION: m.version = 99; send_raw(sv[1], &m, sizeof(m), mfd, 1); break;
        case BAD_KIND: m.kind = 42; send_raw(sv[1], &m, sizeof(m), mfd, 1); break;
        case BAD_NOFD: send_raw(sv[1], &m, sizeof(m), -1, 0); break;
        case BAD_TWOFDS: send_raw(sv[1], &m, sizeof(m), mfd, 2); break;
        case BAD_CLOSE: break;
        case BAD_SILENT: {  /* silent, yet there, until the parent has timed out */
            char c;
            while (read(go[0], &c, 1) < 0 && errno == EINTR)
                ;
            break;
        }
        case BAD_STREAM_CUT: send_raw(sv[1], &m, 30, mfd, 1); break;
        }
        _exit(0);
    }
    close(sv[1]);
    close(go[0]);
    int before = open_fds();
    struct fdpass_msg m;
    int fd = 123;
    char err[256] = "";
    int timeout = what == BAD_SILENT ? 100 : PATIENCE_MS;
    CHECK_INT(fdpass_recv(sv[0], &m, &fd, timeout, err, sizeof(err)), code);
    CHECK_INT(fd, -1);
    check_has(err, needle);
    CHECK_INT(open_fds(), before); /* whatever arrived was closed */
    close(go[1]);
    CHECK_INT(wait_child(pid), 0);
    close(sv[0]);
}

static void test_bad(void)
{
    expect_bad(BAD_SHORT, KVD_EFORMAT, "truncated");
    expect_bad(BAD_LONG, KVD_EFORMAT, "oversized");
    expect_bad(BAD_MAGIC, KVD_EFORMAT, "bad magic");
    expect_bad(BAD_VERSION, KVD_EUNSUPPORTED, "version 99");
    expect_bad(BAD_KIND, KVD_EFORMAT, "malformed");
    expect_bad(BAD_NOFD, KVD_EPROTOCOL, "no descriptor");
    expect_bad(BAD_TWOFDS, KVD_EPROTOCOL, "more than one");
    expect_bad(BAD_CLOSE, KVD_EPROTOCOL, "closed");
    expect_bad(BAD_SILENT, KVD_ETIMEOUT, "no message");
    expect_bad(BAD_STREAM_CUT, KVD_EFORMAT, "truncated");
    /* not a socket at all */
    int pp[2];
    REQUIRE(pipe(pp) == 0);
    struct fdpass_msg m;
    int fd;
    char err[256];
    CHECK_INT(fdpass_recv(pp[0], &m, &fd, 10, err, sizeof(err)), KVD_EIO);
    CHECK_INT(fd, -1);
    close(pp[0]);
    close(pp[1]);
}

/* ---- a listening socket, as kvd serves it ------------------------------------------------------ */

static void test_listen(void)
{
    char dir[] = "/tmp/kvd-fdpass-XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL);
    char path[128], err[256];
    snprintf(path, sizeof(path), "%s/gpu.sock", dir);
    int lfd = fdpass_listen(path, err, sizeof(err));
    if (lfd < 0)
        fprintf(stderr, "%s\n", err);
    REQUIRE(lfd >= 0);
    CHECK_INT(fdpass_accept(lfd, err, sizeof(err)), KVD_ETIMEOUT);

    int mfd = memfd_create("kvd-fdpass-listen", MFD_CLOEXEC);
    REQUIRE(mfd >= 0 && ftruncate(mfd, PAGE) == 0);
    REQUIRE(pwrite(mfd, "hello", 5, 0) == 5);
    /* two clients in turn, as a worker and its restarted successor would be */
    for (int round = 0; round < 2; round++) {
        fflush(NULL);
        pid_t pid = fork();
        REQUIRE(pid >= 0);
        if (pid == 0) {
            char e[256];
            int s = fdpass_connect(path, PATIENCE_MS, e, sizeof(e));
            if (s < 0)
                _exit(2);
            struct fdpass_msg m;
            int fd;
            if (fdpass_recv(s, &m, &fd, PATIENCE_MS, e, sizeof(e)) != 0)
                _exit(3);
            char buf[8] = { 0 };
            if (pread(fd, buf, 5, 0) != 5 || memcmp(buf, "hello", 5) != 0)
                _exit(4);
            _exit(0);
        }
        int c = -1;
        for (double end = now_ms() + PATIENCE_MS; c < 0 && now_ms() < end;) {
            c = fdpass_accept(lfd, err, sizeof(err));
            if (c == KVD_ETIMEOUT)
                usleep(10000);
        }
        REQUIRE(c >= 0);
        struct fdpass_msg m = good_msg(PAGE);
        CHECK_INT(fdpass_send(c, &m, mfd, err, sizeof(err)), 0);
        close(c);
        CHECK_INT(wait_child(pid), 0);
    }
    close(mfd);
    close(lfd);
    /* a stale socket file is replaced; a path that is not a socket is refused */
    lfd = fdpass_listen(path, err, sizeof(err));
    CHECK(lfd >= 0);
    close(lfd);
    unlink(path);
    char file[160];
    snprintf(file, sizeof(file), "%s/plain", dir);
    FILE *f = fopen(file, "w");
    REQUIRE(f != NULL);
    fclose(f);
    CHECK_INT(fdpass_listen(file, err, sizeof(err)), KVD_EINVAL);
    check_has(err, "not a socket");
    unlink(file);
    /* nobody listening: connect gives up after its timeout */
    CHECK_INT(fdpass_connect(path, 100, err, sizeof(err)), KVD_ETIMEOUT);
    char longp[200];
    memset(longp, 'a', sizeof(longp) - 1);
    longp[0] = '/';
    longp[sizeof(longp) - 1] = 0;
    CHECK_INT(fdpass_listen(longp, err, sizeof(err)), KVD_EINVAL);
    CHECK_INT(fdpass_connect(longp, 10, err, sizeof(err)), KVD_EINVAL);
    rmdir(dir);
}

int main(void)
{
    signal(SIGPIPE, SIG_DFL); /* fdpass_send must not raise it */
    test_memfd();
    test_pipe_stream();
    test_bad();
    test_listen();
    return CHECK_DONE();
}
