/* fdpass.c - one descriptor and its header over a Unix domain socket (SCM_RIGHTS). */
#include "fdpass.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "err.h"

#define MAX_FDS 4                 /* descriptors one receive can take in (to close extras) */
#define SEND_STALL_MS 2000        /* a send that cannot proceed for this long fails */

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Waits until sock is ready for events or the deadline (negative: none)
 * passes; 1 ready, 0 timed out, KVD_EIO on failure. */
static int wait_ready(int sock, short events, double deadline)
{
    for (;;) {
        int ms = -1;
        if (deadline >= 0) {
            double left = deadline - now_ms();
            ms = left <= 0 ? 0 : (int)(left + 0.999);
        }
        struct pollfd pf = { .fd = sock, .events = events };
        int n = poll(&pf, 1, ms);
        if (n > 0)
            return 1;
        if (n == 0)
            return 0;
        if (errno != EINTR)
            return KVD_EIO;
    }
}

static void close_all(int *fds, int n)
{
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

/* ---- sending ---------------------------------------------------------------------------- */

int fdpass_send(int sock, const struct fdpass_msg *m, int fd, char *err, size_t errlen)
{
    if (m == NULL || fd < 0 || fcntl(fd, F_GETFD) < 0)
        return kvd_seterr(err, errlen, KVD_EINVAL, "fdpass: nothing valid to send (fd %d)", fd);
    const uint8_t *buf = (const uint8_t *)m;
    size_t done = 0;
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int))];
    } ctl;
    while (done < sizeof(*m)) {
        struct iovec iov = { .iov_base = (void *)(buf + done), .iov_len = sizeof(*m) - done };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
        if (done == 0) {
            /* the descriptor rides with the first byte */
            memset(&ctl, 0, sizeof(ctl));
            mh.msg_control = ctl.space;
            mh.msg_controllen = sizeof(ctl.space);
            struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(c), &fd, sizeof(int));
        }
        ssize_t n = sendmsg(sock, &mh, MSG_NOSIGNAL);
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = wait_ready(sock, POLLOUT, now_ms() + SEND_STALL_MS);
            if (r == 1)
                continue;
            return kvd_seterr(err, errlen, r == 0 ? KVD_ETIMEOUT : KVD_EIO,
                              "fdpass: the peer does not take the message");
        }
        if (n < 0 && (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN))
            return kvd_seterr(err, errlen, KVD_EPROTOCOL, "fdpass: the peer closed the connection");
        return kvd_seterr(err, errlen, KVD_EIO, "fdpass: sendmsg: %s",
                          n < 0 ? strerror(errno) : "sent nothing");
    }
    return 0;
}

/* ---- receiving ---------------------------------------------------------------------------- */

/* Takes the descriptors out of a received message's control data. */
static void take_fds(struct msghdr *mh, int *fds, int *n_fds)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c != NULL; c = CMSG_NXTHDR(mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len < CMSG_LEN(0))
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (*n_fds < MAX_FDS)
                fds[(*n_fds)++] = fd;
            else
                close(fd);
        }
    }
}

int fdpass_recv(int sock, struct fdpass_msg *m, int *fd_out, int timeout_ms, char *err,
                size_t errlen)
{
    int fds[MAX_FDS], n_fds = 0, rc = 0;
    bool ctrunc = false;
    *fd_out = -1;
    int type = 0;
    socklen_t tl = sizeof(type);
    if (getsockopt(sock, SOL_SOCKET, SO_TYPE, &type, &tl) != 0)
        return kvd_seterr(err, errlen, KVD_EIO, "fdpass: not a socket: %s", strerror(errno));
    bool stream = type == SOCK_STREAM;
    double deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    /* one spare byte tells an oversized record from an exact one */
    uint8_t buf[sizeof(struct fdpass_msg) + 1];
    size_t got = 0;
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(MAX_FDS * sizeof(int))];
    } ctl;
    for (;;) {
        int r = wait_ready(sock, POLLIN, deadline);
        if (r == 0) {
            rc = kvd_seterr(err, errlen, KVD_ETIMEOUT, "fdpass: no message within %d ms%s",
                            timeout_ms, got ? " (a partial one arrived)" : "");
            goto fail;
        }
        if (r < 0) {
            rc = kvd_seterr(err, errlen, KVD_EIO, "fdpass: poll: %s", strerror(errno));
            goto fail;
        }
        /* a stream socket is read up to the message's end, never into a next one */
        size_t want = stream ? sizeof(struct fdpass_msg) - got : sizeof(buf);
        struct iovec iov = { .iov_base = buf + got, .iov_len = want };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
        memset(&ctl, 0, sizeof(ctl));
        mh.msg_control = ctl.space;
        mh.msg_controllen = sizeof(ctl.space);
        ssize_t n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
            continue;
        if (n < 0) {
            rc = kvd_seterr(err, errlen, errno == ECONNRESET ? KVD_EPROTOCOL : KVD_EIO,
                            "fdpass: recvmsg: %s", strerror(errno));
            goto fail;
        }
        take_fds(&mh, fds, &n_fds);
        ctrunc |= (mh.msg_flags & MSG_CTRUNC) != 0;
        if (n == 0 && got == 0 && n_fds == 0) {
            rc = kvd_seterr(err, errlen, KVD_EPROTOCOL,
                            "fdpass: the peer closed the connection before sending anything");
            goto fail;
        }
        got += (size_t)n;
        if (!stream) {
            if ((mh.msg_flags & MSG_TRUNC) || got > sizeof(struct fdpass_msg)) {
                rc = kvd_seterr(err, errlen, KVD_EFORMAT,
                                "fdpass: oversized message (more than %zu bytes)",
                                sizeof(struct fdpass_msg));
                goto fail;
            }
            break;
        }
        if (got == sizeof(struct fdpass_msg))
            break;
        if (n == 0)
            break; /* end of stream inside the message: truncated, reported below */
    }
    if (got < sizeof(struct fdpass_msg)) {
        rc = kvd_seterr(err, errlen, KVD_EFORMAT, "fdpass: truncated message (%zu of %zu bytes)", got,
                        sizeof(struct fdpass_msg));
        goto fail;
    }
    if (ctrunc) {
        rc = kvd_seterr(err, errlen, KVD_EPROTOCOL,
                        "fdpass: descriptors were dropped in transit (too many sent, or this "
                        "process is at its descriptor limit)");
        goto fail;
    }
    if (n_fds != 1) {
        rc = kvd_seterr(err, errlen, KVD_EPROTOCOL, "fdpass: the message carries %s",
                        n_fds == 0 ? "no descriptor" : "more than one descriptor");
        goto fail;
    }
    struct fdpass_msg h;
    memcpy(&h, buf, sizeof(h));
    if (h.magic != FDPASS_MAGIC) {
        rc = kvd_seterr(err, errlen, KVD_EFORMAT, "fdpass: not a kvd descriptor message (bad magic)");
        goto fail;
    }
    if (h.version != FDPASS_VERSION) {
        rc = kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                        "fdpass: message version %u (this build speaks %u)", h.version,
                        FDPASS_VERSION);
        goto fail;
    }
    if ((h.kind != FDPASS_KIND_CUDA_VMM && h.kind != FDPASS_KIND_MEMORY && h.kind != FDPASS_KIND_CUDA_WEIGHTS) ||
        h.reserved != 0 ||
        h.bytes == 0 || h.device < -1) {
        rc = kvd_seterr(err, errlen, KVD_EFORMAT,
                        "fdpass: malformed header (kind %u, %llu bytes, device %d)", h.kind,
                        (unsigned long long)h.bytes, h.device);
        goto fail;
    }
    *m = h;
    *fd_out = fds[0];
    return 0;
fail:
    close_all(fds, n_fds);
    return rc;
}

/* ---- the coordinator's socket ------------------------------------------------------------ */

static int make_addr(const char *path, struct sockaddr_un *a, char *err, size_t errlen)
{
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    if (path == NULL || path[0] == '\0' || strlen(path) >= sizeof(a->sun_path))
        return kvd_seterr(err, errlen, KVD_EINVAL,
                          "fdpass: socket path '%s' is empty or longer than %zu bytes",
                          path ? path : "", sizeof(a->sun_path) - 1);
    memcpy(a->sun_path, path, strlen(path) + 1);
    return 0;
}

int fdpass_listen(const char *path, char *err, size_t errlen)
{
    struct sockaddr_un a;
    int rc = make_addr(path, &a, err, errlen);
    if (rc)
        return rc;
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode))
            return kvd_seterr(err, errlen, KVD_EINVAL, "fdpass: %s exists and is not a socket", path);
        unlink(path);
    }
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return kvd_seterr(err, errlen, KVD_EIO, "fdpass: socket: %s", strerror(errno));
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        rc = kvd_seterr(err, errlen, KVD_EIO, "fdpass: cannot bind %s: %s", path, strerror(errno));
        close(fd);
        return rc;
    }
    if (chmod(path, 0600) != 0 || listen(fd, 64) != 0) {
        rc = kvd_seterr(err, errlen, KVD_EIO, "fdpass: cannot listen on %s: %s", path,
                        strerror(errno));
        close(fd);
        unlink(path);
        return rc;
    }
    return fd;
}

int fdpass_accept(int listen_fd, char *err, size_t errlen)
{
    int fd;
    do
        fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED)
            return kvd_seterr(err, errlen, KVD_ETIMEOUT, "fdpass: no connection waiting");
        return kvd_seterr(err, errlen, KVD_EIO, "fdpass: accept: %s", strerror(errno));
    }
    struct ucred cred;
    socklen_t cl = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 || cred.uid != getuid()) {
        int uid = cl == sizeof(cred) ? (int)cred.uid : -1;
        close(fd);
        return kvd_seterr(err, errlen, KVD_EPROTOCOL,
                          "fdpass: refused a connection from uid %d (not this user)", uid);
    }
    return fd;
}

int fdpass_connect(const char *path, int timeout_ms, char *err, size_t errlen)
{
    struct sockaddr_un a;
    int rc = make_addr(path, &a, err, errlen);
    if (rc)
        return rc;
    double deadline = now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    for (;;) {
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (fd < 0)
            return kvd_seterr(err, errlen, KVD_EIO, "fdpass: socket: %s", strerror(errno));
        if (connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0)
            return fd;
        int e = errno;
        close(fd);
        bool retry = e == ENOENT || e == ECONNREFUSED || e == EAGAIN || e == EINTR;
        if (!retry || now_ms() >= deadline)
            return kvd_seterr(err, errlen, retry ? KVD_ETIMEOUT : KVD_EIO,
                              "fdpass: cannot connect to %s: %s", path, strerror(e));
        struct timespec ts = { 0, 20 * 1000000L };
        nanosleep(&ts, NULL);
    }
}
