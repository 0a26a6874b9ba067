/*
 * testutil.h - helpers shared by the tests: the escaped-line format of the
 * reference data in tests/data, id lists, and running a program to capture
 * its output. Header-only: each test is its own program.
 */
#ifndef KVD_TESTUTIL_H
#define KVD_TESTUTIL_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Decodes the escapes of tests/data (\n \t \r \\ \xNN) from s[0..n) into a
 * new NUL-terminated buffer; *len gets the decoded length. NULL on a bad escape. */
static inline char *tu_unescape(const char *s, size_t n, size_t *len)
{
    char *out = malloc(n + 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\') {
            out[o++] = s[i];
            continue;
        }
        if (++i >= n)
            goto bad;
        switch (s[i]) {
        case 'n': out[o++] = '\n'; break;
        case 't': out[o++] = '\t'; break;
        case 'r': out[o++] = '\r'; break;
        case '\\': out[o++] = '\\'; break;
        case 'x': {
            if (i + 2 >= n)
                goto bad;
            char hex[3] = { s[i + 1], s[i + 2], 0 };
            char *end;
            long v = strtol(hex, &end, 16);
            if (*end != '\0')
                goto bad;
            out[o++] = (char)v;
            i += 2;
            break;
        }
        default: goto bad;
        }
    }
    out[o] = '\0';
    *len = o;
    return out;
bad:
    free(out);
    return NULL;
}

/* Splits line (modified in place) at tabs into at most max fields; returns the count. */
static inline int tu_fields(char *line, char **f, int max)
{
    int n = 0;
    f[n++] = line;
    for (char *p = line; *p && n < max; p++)
        if (*p == '\t') {
            *p = '\0';
            f[n++] = p + 1;
        }
    return n;
}

/* Parses space- or comma-separated integers into ids (cap entries); returns the count. */
static inline size_t tu_ids(const char *s, int32_t *ids, size_t cap)
{
    size_t n = 0;
    while (*s && n < cap) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s)
            break;
        ids[n++] = (int32_t)v;
        s = end;
        while (*s == ' ' || *s == ',')
            s++;
    }
    return n;
}

/* Reads the next line without its newline into *line (realloc'd); false at EOF. */
static inline int tu_getline(FILE *f, char **line, size_t *cap)
{
    ssize_t n = getline(line, cap, f);
    if (n < 0)
        return 0;
    if (n > 0 && (*line)[n - 1] == '\n')
        (*line)[n - 1] = '\0';
    return 1;
}

/* Runs argv (argv[0] a path) with stdout captured into a new buffer (stderr
 * too when merge_stderr, else it passes through). Returns the exit status (or
 * -1) and sets *out. */
static inline int tu_run_ex(char *const argv[], char **out, size_t *out_len, int merge_stderr)
{
    int fds[2];
    *out = NULL;
    if (pipe(fds) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        dup2(fds[1], 1);
        if (merge_stderr)
            dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execv(argv[0], argv);
        _exit(127);
    }
    close(fds[1]);
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (n + 1 >= cap)
            buf = realloc(buf, cap *= 2);
        ssize_t r = read(fds[0], buf + n, cap - n - 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    close(fds[0]);
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    *out = buf;
    if (out_len)
        *out_len = n;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static inline int tu_run(char *const argv[], char **out, size_t *out_len)
{
    return tu_run_ex(argv, out, out_len, 0);
}

/* What a *_ref test runs on: the model and the directory of its reference
 * data. The defaults are the default model and tests/data; a second model's
 * tests say --model PATH, --model-env VAR (a variable that overrides PATH),
 * --fetch NAME (how scripts/fetch-model.sh gets it, for the message) and
 * --data DIR. */
struct tu_ref {
    const char *model, *model_env, *fetch, *data;
};

/* Takes argv[*i] (and its value) when it is one of the options above: 1, or
 * 0 when it is not one of them. */
static inline int tu_ref_arg(struct tu_ref *r, int argc, char **argv, int *i)
{
    if (*i + 1 >= argc)
        return 0;
    const char **dst = strcmp(argv[*i], "--model") == 0       ? &r->model
                       : strcmp(argv[*i], "--model-env") == 0 ? &r->model_env
                       : strcmp(argv[*i], "--fetch") == 0     ? &r->fetch
                       : strcmp(argv[*i], "--data") == 0      ? &r->data
                                                              : NULL;
    if (dst == NULL)
        return 0;
    *dst = argv[++*i];
    return 1;
}

/* Applies --model-env and checks the model is there: 1, or 0 after saying
 * how to fetch it (a test then fails, never skips). */
static inline int tu_ref_ready(struct tu_ref *r)
{
    if (r->model_env != NULL && getenv(r->model_env) != NULL && getenv(r->model_env)[0] != '\0')
        r->model = getenv(r->model_env);
    if (access(r->model, R_OK) == 0)
        return 1;
    fprintf(stderr, "FAIL: no model at %s: run scripts/fetch-model.sh%s%s", r->model, r->fetch ? " --model " : "",
            r->fetch ? r->fetch : "");
    if (r->model_env != NULL)
        fprintf(stderr, " (or set $%s to the model file)", r->model_env);
    fprintf(stderr, "\n");
    return 0;
}

/* Parses the JSON integer array that follows "key": in json into ids. */
static inline size_t tu_json_ids(const char *json, const char *key, int32_t *ids, size_t cap)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":[", key);
    const char *p = strstr(json, pat);
    if (p == NULL)
        return 0;
    return tu_ids(p + strlen(pat), ids, cap);
}

#endif
