/* units.c - parsing and printing byte sizes. */
#include "units.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>

#include "err.h"

int kvd_parse_size(const char *s, uint64_t *out)
{
    if (s == NULL)
        return KVD_EINVAL;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !isfinite(v) || v < 0)
        return KVD_EINVAL;
    static const struct { const char *suffix; double mult; } units[] = {
        { "", 1 }, { "b", 1 },
        { "k", 1024.0 }, { "kib", 1024.0 }, { "kb", 1e3 },
        { "m", 1048576.0 }, { "mib", 1048576.0 }, { "mb", 1e6 },
        { "g", 1073741824.0 }, { "gib", 1073741824.0 }, { "gb", 1e9 },
        { "t", 1099511627776.0 }, { "tib", 1099511627776.0 }, { "tb", 1e12 },
    };
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        if (strcasecmp(end, units[i].suffix) == 0) {
            double b = v * units[i].mult;
            if (b >= 9.2e18)
                return KVD_EINVAL;
            *out = (uint64_t)(b + 0.5);
            return 0;
        }
    }
    return KVD_EINVAL;
}

char *kvd_format_bytes(uint64_t bytes, char *buf, size_t len)
{
    static const char *names[] = { "B", "KiB", "MiB", "GiB", "TiB" };
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%llu B", (unsigned long long)bytes);
    else
        snprintf(buf, len, "%.*f %s", v < 10 ? 2 : v < 100 ? 1 : 0, v, names[u]);
    return buf;
}
