/* endpoint.c - the endpoint kvd and its clients meet on by default (endpoint.h). */
#include "endpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

char *kvd_default_endpoint(char *buf, size_t len)
{
    if (buf == NULL || len == 0)
        return buf;
    const char *env = getenv("KVD_ENDPOINT");
    if (env != NULL && env[0] != '\0') {
        snprintf(buf, len, "%s", env);
        return buf;
    }
    /* the XDG spec says to ignore a relative XDG_RUNTIME_DIR */
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (xdg != NULL && xdg[0] == '/') {
        size_t n = strlen(xdg);
        while (n > 1 && xdg[n - 1] == '/')
            n--;
        snprintf(buf, len, "ipc://%.*s/kvd/kvd.sock", (int)n, xdg);
    } else {
        snprintf(buf, len, "ipc:///tmp/kvd-%u/kvd.sock", (unsigned)getuid());
    }
    return buf;
}
