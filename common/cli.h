/*
 * cli.h - what kvd's programs share on their command lines: a one-line fatal
 * error prefixed with the program's name, integer arguments checked against
 * a range, and a monotonic clock.
 */
#ifndef KVD_CLI_H
#define KVD_CLI_H

#include <stddef.h>
#include <stdio.h>

/* Exit status of a worker that cannot run in its configuration (no usable
 * GPU, no GPU engine in this build): kvd reports it and does not restart the
 * worker (EX_CONFIG of sysexits.h). cli_die exits with 1. */
#define CLI_EXIT_UNUSABLE 78

/* Names the program for cli_die's prefix ("kvd-run: ..."). */
void cli_init(const char *prog);

/* Prints "prog: message" and a newline on stderr and exits with status 1. */
void cli_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* s as an integer in [lo, hi]; anything else dies naming `what`. */
long cli_long(const char *s, const char *what, long lo, long hi);

/* Reads all of f (named `name` in messages) into a new NUL-terminated buffer;
 * *len (when given) gets its length. Dies when it cannot read, has no
 * memory, or the input is longer than max_bytes. */
char *cli_read_stream(FILE *f, const char *name, size_t max_bytes, size_t *len);

/* Milliseconds on the monotonic clock. */
double cli_now_ms(void);

#endif
