/* cli.c - fatal errors, checked integers and the clock for kvd's programs. */
#include "cli.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *prog_name = "kvd";

void cli_init(const char *prog)
{
    prog_name = prog;
}

void cli_die(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", prog_name);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

long cli_long(const char *s, const char *what, long lo, long hi)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi)
        cli_die("%s must be an integer in [%ld, %ld], got '%s'", what, lo, hi, s);
    return v;
}

char *cli_read_stream(FILE *f, const char *name, size_t max_bytes, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (buf == NULL)
            cli_die("out of memory reading %s", name);
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1)
            break;
        if (n > max_bytes)
            cli_die("%s is larger than %zu bytes", name, max_bytes);
        cap *= 2;
        buf = realloc(buf, cap);
    }
    if (ferror(f))
        cli_die("cannot read %s: %s", name, strerror(errno));
    if (n > max_bytes)
        cli_die("%s is larger than %zu bytes", name, max_bytes);
    buf[n] = '\0';
    if (len)
        *len = n;
    return buf;
}

double cli_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}
