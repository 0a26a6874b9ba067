/*
 * fdpass.h - handing a file descriptor to another process over a Unix domain
 * socket (SCM_RIGHTS), with a small fixed header that says what it is.
 *
 * This is how a GPU pool's KV memory and the model's weights reach the
 * workers: the coordinator exports its device allocations
 * (shm/devmem.h) as POSIX file descriptors and sends them to
 * every worker of that GPU that connects to its socket, one message each;
 * the kernel duplicates each descriptor into the receiver. Plain
 * POSIX: nothing here knows about CUDA, and any descriptor (a memfd, a pipe)
 * travels the same way.
 *
 * One message is exactly one struct fdpass_msg and exactly one descriptor.
 * The receiver trusts nothing: a short or long message, a wrong magic or
 * version, no descriptor, more than one, or a peer that closes or stalls is
 * an error with a reason, and any descriptor that did arrive is closed.
 * Sockets may be SOCK_SEQPACKET (preferred: one record per message) or
 * SOCK_STREAM.
 */
#ifndef KVD_FDPASS_H
#define KVD_FDPASS_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>

#define FDPASS_MAGIC UINT64_C(0x315350444644564b) /* "KVDFDPS1" in little-endian bytes */
#define FDPASS_VERSION 2u   /* 2: kvd sends the weights' allocation after the KV one */

/* What the descriptor is (fdpass_msg.kind). */
enum fdpass_kind {
    FDPASS_KIND_CUDA_VMM = 1,   /* a CUDA VMM allocation (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) */
    FDPASS_KIND_MEMORY = 2,     /* host memory that can be mmap()ed (memfd, shm) */
    FDPASS_KIND_CUDA_WEIGHTS = 3, /* a CUDA VMM allocation holding a model's weights as
                                 * gpu_weights_upload lays them out (engine/gpu_engine.h) */
};

/* The header sent with the descriptor. Fixed size and byte order (the peer is
 * a process of the same build on the same host): an ABI all the same. */
struct fdpass_msg {
    uint64_t magic;         /* FDPASS_MAGIC */
    uint32_t version;       /* FDPASS_VERSION */
    uint32_t kind;          /* enum fdpass_kind */
    uint64_t bytes;         /* size of the memory behind the descriptor */
    int32_t device;         /* CUDA device index it lives on, -1 for host memory */
    uint32_t reserved;      /* zero */
    uint64_t generation;    /* pool_header.generation of the pool it backs */
    uint64_t instance;      /* pool_header.instance of that pool (random per owner open) */
};
static_assert(sizeof(struct fdpass_msg) == 48, "fdpass_msg is part of the ABI");

/*
 * Sends *m and a duplicate of fd on the connected socket sock. Retries on
 * EINTR; never raises SIGPIPE. 0, KVD_EINVAL (bad fd or message),
 * KVD_EPROTOCOL (the peer is gone) or KVD_EIO, with a reason in err.
 */
int fdpass_send(int sock, const struct fdpass_msg *m, int fd, char *err, size_t errlen);

/*
 * Receives one message and its descriptor from sock, waiting at most
 * timeout_ms (negative: forever). On success *fd_out is a new descriptor
 * (close-on-exec) owned by the caller and *m the checked header. On failure
 * *fd_out is -1, nothing stays open, and the code says why:
 *   KVD_ETIMEOUT   nothing complete arrived in time
 *   KVD_EPROTOCOL  the peer closed early, or sent no or several descriptors
 *   KVD_EFORMAT    a truncated or oversized message, a wrong magic or kind
 *   KVD_EUNSUPPORTED another version of the header
 *   KVD_EIO        the socket failed
 */
int fdpass_recv(int sock, struct fdpass_msg *m, int *fd_out, int timeout_ms, char *err,
                size_t errlen);

/* ---- the socket a coordinator serves descriptors on ------------------------------------ */

/*
 * Binds and listens on a Unix SOCK_SEQPACKET socket at path (an old socket
 * file there is replaced; the directory should be private). Returns the
 * listening descriptor (non-blocking, close-on-exec) or a negative KVD_E*
 * with a reason: KVD_EINVAL for a path longer than a socket address holds.
 */
int fdpass_listen(const char *path, char *err, size_t errlen);

/*
 * Accepts one waiting connection on a listening socket and checks that the
 * peer runs as this user (SO_PEERCRED). Returns the connected descriptor
 * (blocking, close-on-exec), KVD_ETIMEOUT when no connection is waiting, or
 * another negative KVD_E* with a reason (a peer of another user is refused
 * and disconnected: KVD_EPROTOCOL).
 */
int fdpass_accept(int listen_fd, char *err, size_t errlen);

/* Connects to the socket at path, retrying for up to timeout_ms while it does
 * not exist yet or refuses. The descriptor (close-on-exec) or a negative KVD_E*. */
int fdpass_connect(const char *path, int timeout_ms, char *err, size_t errlen);

#endif
