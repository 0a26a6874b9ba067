/*
 * err.h - the one error table of kvd.
 *
 * Action functions return 0 on success or a negative KVD_E* code from this
 * table; kvd_strerror() names it. Constructors return NULL and, where they
 * take a `char *err, size_t errlen` pair, write a one-line reason there.
 */
#ifndef KVD_ERR_H
#define KVD_ERR_H

#include <stddef.h>

enum kvd_err {
    KVD_OK = 0,
    KVD_EINVAL = -1,      /* an argument is out of range or malformed */
    KVD_ENOMEM = -2,      /* an allocation failed */
    KVD_EIO = -3,         /* reading or writing a file failed */
    KVD_EFORMAT = -4,     /* a file or message is corrupt or truncated */
    KVD_EUNSUPPORTED = -5,/* valid input that this build cannot handle */
    KVD_ERANGE = -6,      /* a count, id or length is past its limit */
    KVD_ENOSPACE = -7,    /* the KV cache has no free block */
    KVD_ETOOLONG = -8,    /* a prompt or sequence exceeds the context */
    KVD_ENOTFOUND = -9,   /* a name or key is absent */
    KVD_ESTATE = -10,     /* the call is not valid in the object's state */
    KVD_ETIMEOUT = -11,   /* no reply in time (is the daemon running?) */
    KVD_EOVERLOADED = -12,/* the daemon's queue is full; retry later */
    KVD_ECANCELLED = -13, /* the request was cancelled */
    KVD_EDEADLINE = -14,  /* the request's deadline passed */
    KVD_EUNAVAILABLE = -15,/* no worker can run the request */
    KVD_EPROTOCOL = -16,  /* an unreadable or unexpected message */
    KVD_ESHUTDOWN = -17,  /* the daemon is shutting down */
    KVD_EINTERNAL = -18,  /* the daemon failed */
    KVD_EBADREQUEST = -19,/* the daemon refused the request as malformed or out of range */
    KVD_EAUTH = -20,      /* the daemon refused this client's keys (CURVE) */
    KVD_EPERM = -21,      /* a file, segment or directory belongs to another user, is open to
                           * others, or is not what its name says (a link, a FIFO) */
};

/* Returns a static, human-readable name for a KVD_E* code (or "unknown error"). */
const char *kvd_strerror(int code);

/* Formats into err (if non-NULL) like snprintf; returns `code` so that callers
 * can write `return kvd_seterr(err, errlen, KVD_EFORMAT, "...", ...)`. */
int kvd_seterr(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
