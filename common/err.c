/* err.c - kvd_strerror() and the error-message helper. */
#include "err.h"

#include <stdarg.h>
#include <stdio.h>

const char *kvd_strerror(int code)
{
    switch (code) {
    case KVD_OK: return "success";
    case KVD_EINVAL: return "invalid argument";
    case KVD_ENOMEM: return "out of memory";
    case KVD_EIO: return "input/output error";
    case KVD_EFORMAT: return "corrupt or truncated data";
    case KVD_EUNSUPPORTED: return "unsupported";
    case KVD_ERANGE: return "value out of range";
    case KVD_ENOSPACE: return "no free KV block";
    case KVD_ETOOLONG: return "longer than the context";
    case KVD_ENOTFOUND: return "not found";
    case KVD_ESTATE: return "invalid state";
    case KVD_ETIMEOUT: return "timed out (is the daemon running?)";
    case KVD_EOVERLOADED: return "overloaded, retry later";
    case KVD_ECANCELLED: return "cancelled";
    case KVD_EDEADLINE: return "deadline exceeded";
    case KVD_EUNAVAILABLE: return "no worker available";
    case KVD_EPROTOCOL: return "protocol error";
    case KVD_ESHUTDOWN: return "shutting down";
    case KVD_EINTERNAL: return "internal error";
    case KVD_EBADREQUEST: return "bad request";
    case KVD_EAUTH: return "authentication failed";
    case KVD_EPERM: return "not this user's, or open to others";
    default: return "unknown error";
    }
}

int kvd_seterr(char *err, size_t errlen, int code, const char *fmt, ...)
{
    if (err != NULL && errlen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}
