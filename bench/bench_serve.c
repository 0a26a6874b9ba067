/*
 * bench_serve.c - bench-serve: kvd as a server, against itself without the
 * prefix cache and against llama.cpp's server, on one chat workload.
 *
 * Workload: S sessions, each a multi-turn chat (T turns) that starts with the
 * same system prompt of about L tokens (cut from a text file) and asks its own
 * questions; every session is one client, all S at once. Each turn streams
 * max_tokens tokens (greedy, end-of-generation ignored, so every server
 * produces the same amount of work) and carries the previous answers as
 * assistant messages, as a chat client does. Measured per run: time to first
 * token (p50, p99, client-side), aggregate output tokens/s (all tokens / wall
 * time), prefix hit rate (cached prompt tokens / prompt tokens), KV blocks
 * held at the end. One warm-up request with the system prompt runs first.
 *
 * Runs, one after the other in one invocation:
 *   kvd             the cache on
 *   TTFT alone      one request at a time (a new question after the system
 *                   prompt): cached against the prefix cache bypassed, median of 3
 *   llama-server    (--llama-server PATH) same model, same threads, one slot
 *                   per session (-np S), its own prompt cache on, prompts
 *                   through /completion with the ChatML text kvd's template
 *                   makes
 * and the daemon's overhead: a 1-token request whose prompt is all cached,
 * through kvd (client to client), against the same work done in-process by
 * the engine (kvd-run's path: template, tokenizer, cache, one step, sampler),
 * alternating, medians of 31.
 *
 * With --sampled, the kvd run is repeated with kvd's default sampling
 * (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05; a seed per request),
 * and the ratio of its output tokens/s to the greedy run's is printed.
 *
 * With --kv-types LIST (e.g. f16,q8_0) it measures memory pressure instead:
 * for each KV type, kvd with --kv-memory SIZE (default 1 GiB) and that type
 * serves the workload, and the table gives, beside the run's numbers, the
 * preemptions (sequences whose blocks were taken back and recomputed later)
 * and evictions of kvd's stats. --distinct gives every session its own system
 * prompt (a line naming the session before the text), so that nothing is
 * shared and every session holds its own blocks: a pool too small for the
 * f16 run then shows what a smaller KV type buys.
 *
 * With --tiers the --distinct workload runs through a pool of --kv-memory too
 * small for every session's prompt three times: without a tier, with the host
 * tier (--host-cache 2GiB) and with the disk tier alone (--cache-dir): hit
 * rate, throughput, TTFT, evictions and the prompt tokens each tier gave back.
 *
 * With --http the same workload goes through kvd's OpenAI-compatible HTTP API
 * (kvd --http) and, given --llama-server, through llama-server's, both as
 * streamed POST /v1/chat/completions with usage; the table has both and the
 * ratio of output tokens/s. --http-overhead measures the HTTP layer alone: a
 * cached 1-token chat request over HTTP (one kept-alive connection) against
 * the same over ZeroMQ, alternating, the median of 31 paired differences.
 *
 * Usage: bench-serve [-m MODEL] [--llama-server PATH] [--sessions S] [--turns T]
 *                    [--system-tokens L] [--max-tokens N] [-t THREADS] [--sampled] [--json]
 *        bench-serve --kv-types LIST [--kv-memory SIZE] [--distinct] [--sessions S] ...
 *        bench-serve --tiers --kv-memory SIZE [--sessions S] [--turns T] ...
 *        bench-serve --http [--llama-server PATH] ...    bench-serve --http-overhead
 */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chat.h"
#include "forward.h"
#include "kvcache.h"
#include "kvd_client.h"
#include "model.h"
#include "pool.h"
#include "prefix.h"
#include "sampler.h"
#include "tok.h"
#include "types.h"

#define MAX_SESSIONS 64
#define MAX_TURNS 8
#define LLAMA_PORT 18931
#define KVD_BENCH_KV_BYTES (1ull << 30)   /* kvd's --kv-memory, and the in-process pool's */

struct cfg {
    const char *model, *llama, *text_file;
    int sessions, turns, max_tokens, threads, system_tokens;
    bool json;
    bool overhead_only;     /* only the daemon-overhead measurement */
    bool sampled;           /* also a run with kvd's default sampling (--sampled) */
    const char *kv_types;   /* --kv-types: the memory-pressure runs, one per type */
    const char *kv_memory;  /* --kv-memory: kvd's pool size (default 1 GiB) */
    const char *kv_type;    /* the type kvd runs with now */
    bool distinct;          /* --distinct: a system prompt per session */
    bool http_overhead;     /* --http-overhead: a cached 1-token request over HTTP against ZeroMQ */
    bool http;              /* --http: both servers through their OpenAI chat endpoints */
    int http_port;          /* kvd's --http port (0: none) */
    bool tiers;             /* --tiers: the distinct-prompt load without and with the tiers */
    const char *tier_args[6];   /* extra kvd arguments of the run now (--host-cache, --cache-dir) */
    char bin_dir[4096], tmp[64];
};

static struct cfg C;
static char *system_prompt;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...)
{
    va_list ap;
    fputs("bench-serve: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

/* ---- one run's numbers ----------------------------------------------------------------- */

struct sample {
    double ttft, total;
    uint32_t prompt, cached, completion;
    bool ok;
};

struct run {
    const char *name;
    struct sample s[MAX_SESSIONS * MAX_TURNS];
    int n;
    double wall_ms;
    uint32_t blocks;        /* KV blocks held at the end (kvd) */
    char note[160];
    pthread_mutex_t mu;
};

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(const struct run *r, double p)
{
    double v[MAX_SESSIONS * MAX_TURNS];
    int n = 0;
    for (int i = 0; i < r->n; i++)
        if (r->s[i].ok)
            v[n++] = r->s[i].ttft;
    if (n == 0)
        return NAN;
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    int k = (int)ceil(p * n) - 1;
    return v[k < 0 ? 0 : k];
}

static void totals(const struct run *r, uint64_t *prompt, uint64_t *cached, uint64_t *gen, int *ok)
{
    *prompt = *cached = *gen = 0;
    *ok = 0;
    for (int i = 0; i < r->n; i++)
        if (r->s[i].ok) {
            *prompt += r->s[i].prompt;
            *cached += r->s[i].cached;
            *gen += r->s[i].completion;
            (*ok)++;
        }
}

static void record(struct run *r, const struct sample *s)
{
    pthread_mutex_lock(&r->mu);
    if (r->n < MAX_SESSIONS * MAX_TURNS)
        r->s[r->n++] = *s;
    pthread_mutex_unlock(&r->mu);
}

/* ---- questions -------------------------------------------------------------------------- */

static const char *topics[] = { "memory", "speed", "caching", "reading", "errors", "tests",
                                "numbers", "order", "time", "words", "servers", "blocks",
                                "threads", "files", "users", "costs" };

static void question(int session, int turn, char *buf, size_t len)
{
    snprintf(buf, len, "Session %d, question %d: what does the text above say about %s? "
             "Answer in two sentences.", session, turn + 1, topics[(session + turn) % 16]);
}

/* ---- kvd ------------------------------------------------------------------------------------ */

static char kvd_ep[256];
static pid_t kvd_pid;

static void start_kvd(void)
{
    snprintf(kvd_ep, sizeof(kvd_ep), "ipc://%s/kvd.sock", C.tmp);
    char path[4200], threads[16], log[256];
    snprintf(path, sizeof(path), "%s/kvd", C.bin_dir);
    snprintf(threads, sizeof(threads), "%d", C.threads);
    snprintf(log, sizeof(log), "%s/kvd.log", C.tmp);
    kvd_pid = fork();
    if (kvd_pid == 0) {
        setenv("KVD_WORKER_TRACE", "1", 1); /* step times in the log, for the overhead split */
        FILE *f = freopen(log, "w", stderr);
        (void)f;
        char http[64];
        snprintf(http, sizeof(http), "127.0.0.1:%d", C.http_port);
        const char *args[32] = { path, "--model", C.model, "--listen", kvd_ep, "-w", "1", "-t", threads,
                                 "--kv-memory", C.kv_memory, "--kv-type", C.kv_type, "--ctx", "4096",
                                 "--max-batch", "64" };
        int n = 17;
        if (C.http_port > 0) {
            args[n++] = "--http";
            args[n++] = http;
        }
        for (int i = 0; i < 6 && C.tier_args[i] != NULL; i++)
            args[n++] = C.tier_args[i];
        args[n] = NULL;
        execv(path, (char *const *)args);
        _exit(127);
    }
    kvd_client_t *c = kvd_client_new(kvd_ep, 500, NULL, 0);
    for (int i = 0; i < 120; i++) {
        bool ok = false;
        uint32_t alive;
        if (kvd_health(c, &ok, &alive) == 0 && ok)
            break;
        usleep(250000);
    }
    kvd_client_destroy(&c);
}

static void stop_child(pid_t *pid)
{
    if (*pid <= 0)
        return;
    kill(*pid, SIGTERM);
    int st;
    double until = now_ms() + 15000;
    while (waitpid(*pid, &st, WNOHANG) == 0) {
        if (now_ms() > until) {
            kill(*pid, SIGKILL);
            waitpid(*pid, &st, 0);
            break;
        }
        usleep(50000);
    }
    *pid = 0;
}

struct session_arg {
    struct run *run;
    int session, turns;
    bool no_cache;
    bool llama;
    bool sampled;           /* kvd's default sampling, seeded, instead of greedy */
};

struct first_chunk {
    double t0, ttft;
};

static int on_chunk(void *user, const char *text, size_t len, const int32_t *t, size_t n, uint32_t seq)
{
    struct first_chunk *fc = user;
    if (fc->ttft < 0 && (n > 0 || len > 0))
        fc->ttft = now_ms() - fc->t0;
    return 0;
}

static void *kvd_session(void *p)
{
    struct session_arg *a = p;
    kvd_client_t *c = kvd_client_new(kvd_ep, 600000, NULL, 0);
    struct kvd_chat_msg msgs[2 + 2 * MAX_TURNS];
    char q[MAX_TURNS][256];
    char *answers[MAX_TURNS] = { 0 };
    size_t nm = 0;
    char *own = NULL;       /* --distinct: this session's system prompt */
    if (C.distinct && !a->llama) {
        own = malloc(strlen(system_prompt) + 64);
        sprintf(own, "This is session %d of the benchmark.\n%s", a->session, system_prompt);
    }
    msgs[nm++] = (struct kvd_chat_msg){ "system", own ? own : system_prompt };
    for (int t = 0; t < a->turns; t++) {
        question(a->session, t, q[t], sizeof(q[t]));
        msgs[nm++] = (struct kvd_chat_msg){ "user", q[t] };
        struct kvd_gen_params gp;
        kvd_gen_params_init(&gp);
        gp.messages = msgs;
        gp.n_messages = nm;
        gp.max_tokens = (uint32_t)C.max_tokens;
        if (a->sampled)
            gp.seed = (uint64_t)(a->session * 100 + t + 1);    /* the server's default sampling */
        else
            gp.temperature = 0;
        gp.ignore_eos = true;
        gp.no_cache = a->no_cache;
        struct kvd_result res;
        struct first_chunk fc = { now_ms(), -1 };
        int rc = kvd_generate_stream(c, &gp, on_chunk, &fc, &res);
        struct sample s = { fc.ttft, now_ms() - fc.t0, res.prompt_tokens, res.cached_prompt_tokens,
                            res.completion_tokens, rc == 0 };
        if (rc != 0)
            fprintf(stderr, "bench-serve: kvd request failed: %s %s\n", kvd_strerror(rc), res.error);
        record(a->run, &s);
        answers[t] = strdup(res.text ? res.text : "");
        msgs[nm++] = (struct kvd_chat_msg){ "assistant", answers[t] };
        kvd_result_free(&res);
    }
    for (int t = 0; t < a->turns; t++)
        free(answers[t]);
    free(own);
    kvd_client_destroy(&c);
    return NULL;
}

/* ---- llama-server over HTTP ------------------------------------------------------------------ */

static pid_t llama_pid;

static void json_escape(const char *s, char **out, size_t *len, size_t *cap)
{
    for (; *s; s++) {
        char tmp[8];
        const char *piece = tmp;
        unsigned char ch = (unsigned char)*s;
        if (ch == '"')
            piece = "\\\"";
        else if (ch == '\\')
            piece = "\\\\";
        else if (ch == '\n')
            piece = "\\n";
        else if (ch < 0x20)
            snprintf(tmp, sizeof(tmp), "\\u%04x", ch);
        else {
            tmp[0] = (char)ch;
            tmp[1] = 0;
        }
        size_t pl = strlen(piece);
        if (*len + pl + 1 > *cap) {
            *cap = (*len + pl + 1) * 2;
            *out = realloc(*out, *cap);
        }
        memcpy(*out + *len, piece, pl);
        *len += pl;
        (*out)[*len] = 0;
    }
}

static void append(char **out, size_t *len, size_t *cap, const char *s)
{
    size_t n = strlen(s);
    if (*len + n + 1 > *cap) {
        *cap = (*len + n + 1) * 2;
        *out = realloc(*out, *cap);
    }
    memcpy(*out + *len, s, n + 1);
    *len += n;
}

static int http_connect_port(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int http_connect(void)
{
    return http_connect_port(LLAMA_PORT);
}

static long json_num(const char *s, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = strstr(s, pat);
    return p ? strtol(p + strlen(pat), NULL, 10) : -1;
}

/* A streamed event's "content" text, when it has some: appended to the
 * answer, and the first one's time is the sample's TTFT. */
static void take_content(const char *ev, struct sample *s, double t0, char **ans, size_t *al, size_t *ac)
{
    const char *content = strstr(ev, "\"content\":\"");
    if (content == NULL || content[11] == '"')
        return;
    if (s->ttft < 0)
        s->ttft = now_ms() - t0;
    const char *c0 = content + 11, *c1 = c0;
    while (*c1 && !(*c1 == '"' && c1[-1] != '\\'))
        c1++;
    char piece[1024];
    snprintf(piece, sizeof(piece), "%.*s", (int)(c1 - c0), c0);
    append(ans, al, ac, piece);
}

/* One streamed /completion; fills s and the answer text. */
static void llama_request(const char *prompt, struct sample *s, char **answer)
{
    char *body = NULL;
    size_t len = 0, cap = 0;
    char head[256];
    snprintf(head, sizeof(head), "{\"n_predict\":%d,\"temperature\":0,\"ignore_eos\":true,"
             "\"stream\":true,\"cache_prompt\":true,\"prompt\":\"", C.max_tokens);
    append(&body, &len, &cap, head);
    json_escape(prompt, &body, &len, &cap);
    append(&body, &len, &cap, "\"}");
    double t0 = now_ms();
    s->ok = false;
    s->ttft = -1;
    int fd = http_connect();
    if (fd < 0)
        return;
    char req[512];
    int hl = snprintf(req, sizeof(req), "POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n"
                      "Connection: close\r\n\r\n", len);
    if (write(fd, req, (size_t)hl) != hl || write(fd, body, len) != (ssize_t)len) {
        close(fd);
        free(body);
        return;
    }
    free(body);
    char *resp = NULL, *ans = NULL;
    size_t rl = 0, rc = 0, al = 0, ac = 0;
    char buf[8192];
    ssize_t n;
    size_t scanned = 0;
    while ((n = read(fd, buf, sizeof(buf) - 1)) > 0) {
        buf[n] = 0;
        append(&resp, &rl, &rc, buf);
        /* every complete event: "data: {...}\n\n" */
        char *ev;
        while ((ev = strstr(resp + scanned, "data: ")) != NULL) {
            char *end = strstr(ev, "\n\n");
            if (end == NULL)
                break;
            *end = 0;
            take_content(ev, s, t0, &ans, &al, &ac);
            if (strstr(ev, "\"stop\":true")) {
                long pn = json_num(ev, "prompt_n"), cn = json_num(ev, "cache_n");
                long tp = json_num(ev, "predicted_n");
                s->prompt = (uint32_t)((pn > 0 ? pn : 0) + (cn > 0 ? cn : 0));
                s->cached = (uint32_t)(cn > 0 ? cn : 0);
                s->completion = (uint32_t)(tp > 0 ? tp : 0);
                s->ok = true;
            }
            *end = '\n';
            scanned = (size_t)(end + 2 - resp);
        }
    }
    close(fd);
    s->total = now_ms() - t0;
    free(resp);
    /* the answer as text: undo the escapes that matter for a prompt */
    char *out = malloc(al + 1);
    size_t o = 0;
    for (size_t i = 0; ans && i < al; i++) {
        if (ans[i] == '\\' && i + 1 < al) {
            char e = ans[++i];
            out[o++] = e == 'n' ? '\n' : e == 't' ? '\t' : e;
        } else {
            out[o++] = ans[i];
        }
    }
    out[o] = 0;
    free(ans);
    *answer = out;
}

/* The ChatML text kvd's template makes for these messages. */
static char *chatml(const struct kvd_chat_msg *m, size_t n)
{
    char *s = NULL;
    size_t len = 0, cap = 0;
    for (size_t i = 0; i < n; i++) {
        append(&s, &len, &cap, "<|im_start|>");
        append(&s, &len, &cap, m[i].role);
        append(&s, &len, &cap, "\n");
        append(&s, &len, &cap, m[i].content);
        append(&s, &len, &cap, "<|im_end|>\n");
    }
    append(&s, &len, &cap, "<|im_start|>assistant\n");
    return s;
}

/* One turn of a chat session over HTTP: the messages so far, the answer back. */
typedef void (*chat_turn_fn)(const struct session_arg *a, const struct kvd_chat_msg *m, size_t nm, struct sample *s,
                             char **answer);

/* A session's turns through `turn`: the system prompt, then each question with
 * the answers before it, as a chat client sends them. */
static void chat_session(struct session_arg *a, chat_turn_fn turn, const char *who)
{
    struct kvd_chat_msg msgs[2 + 2 * MAX_TURNS];
    char q[MAX_TURNS][256];
    char *answers[MAX_TURNS] = { 0 };
    size_t nm = 0;
    msgs[nm++] = (struct kvd_chat_msg){ "system", system_prompt };
    for (int t = 0; t < a->turns; t++) {
        question(a->session, t, q[t], sizeof(q[t]));
        msgs[nm++] = (struct kvd_chat_msg){ "user", q[t] };
        struct sample s = { 0 };
        turn(a, msgs, nm, &s, &answers[t]);
        if (!s.ok)
            fprintf(stderr, "bench-serve: a %s request failed\n", who);
        record(a->run, &s);
        msgs[nm++] = (struct kvd_chat_msg){ "assistant", answers[t] ? answers[t] : "" };
    }
    for (int t = 0; t < a->turns; t++)
        free(answers[t]);
}

/* llama-server's /completion, the messages as ChatML text. */
static void llama_turn(const struct session_arg *a, const struct kvd_chat_msg *m, size_t nm, struct sample *s,
                       char **answer)
{
    (void)a;
    char *prompt = chatml(m, nm);
    llama_request(prompt, s, answer);
    free(prompt);
}

static void *llama_session(void *p)
{
    chat_session(p, llama_turn, "llama-server");
    return NULL;
}

static bool start_llama(void)
{
    char np[16], ctx[16], threads[16], log[256];
    snprintf(np, sizeof(np), "%d", C.sessions);
    snprintf(ctx, sizeof(ctx), "%d", C.sessions * 4096);
    snprintf(threads, sizeof(threads), "%d", C.threads);
    snprintf(log, sizeof(log), "%s/llama.log", C.tmp);
    char port[16];
    snprintf(port, sizeof(port), "%d", LLAMA_PORT);
    llama_pid = fork();
    if (llama_pid == 0) {
        FILE *f = freopen(log, "w", stderr);
        f = freopen(log, "a", stdout);
        (void)f;
        execl(C.llama, C.llama, "-m", C.model, "--host", "127.0.0.1", "--port", port, "-np", np,
              "-c", ctx, "-t", threads, "-tb", threads, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 240; i++) {
        int fd = http_connect();
        if (fd >= 0) {
            const char *req = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
            char buf[512] = { 0 };
            ssize_t w = write(fd, req, strlen(req));
            ssize_t n = w > 0 ? read(fd, buf, sizeof(buf) - 1) : -1;
            close(fd);
            if (n > 0 && strstr(buf, " 200 "))
                return true;
        }
        usleep(250000);
    }
    return false;
}

/* ---- either server over OpenAI's chat endpoint (--http) ----------------------------------------- */

/* One streamed POST /v1/chat/completions to 127.0.0.1:port (greedy, max_tokens,
 * end-of-generation ignored, usage asked for); fills s and the answer text. */
static void oai_request(int port, const struct kvd_chat_msg *m, size_t nm, struct sample *s, char **answer)
{
    char *body = NULL;
    size_t len = 0, cap = 0;
    append(&body, &len, &cap, "{\"messages\":[");
    for (size_t i = 0; i < nm; i++) {
        append(&body, &len, &cap, i ? ",{\"role\":\"" : "{\"role\":\"");
        append(&body, &len, &cap, m[i].role);
        append(&body, &len, &cap, "\",\"content\":\"");
        json_escape(m[i].content, &body, &len, &cap);
        append(&body, &len, &cap, "\"}");
    }
    char tail[192];
    snprintf(tail, sizeof(tail), "],\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
             "\"stream_options\":{\"include_usage\":true}}", C.max_tokens);
    append(&body, &len, &cap, tail);
    char head[256];
    const int hl = snprintf(head, sizeof(head), "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                            "Content-Type: application/json\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
                            len);
    char *req = malloc((size_t)hl + len);
    memcpy(req, head, (size_t)hl);
    memcpy(req + hl, body, len);
    free(body);
    *s = (struct sample){ .ttft = -1 };
    double t0 = now_ms();
    int fd = http_connect_port(port);
    if (fd < 0) {
        free(req);
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (write(fd, req, (size_t)hl + len) != (ssize_t)((size_t)hl + len)) {
        close(fd);
        free(req);
        return;
    }
    free(req);
    char *resp = NULL, *ans = NULL, *raw = NULL;
    size_t rl = 0, rc = 0, al = 0, ac = 0, scanned = 0, wl = 0, wc = 0, used = 0;
    char buf[8192];
    ssize_t n;
    bool in_body = false, chunked = false;
    while ((n = read(fd, buf, sizeof(buf) - 1)) > 0) {
        buf[n] = 0;
        append(&raw, &wl, &wc, buf);
        /* the body, de-chunked when the server chunks it, into resp */
        if (!in_body) {
            char *eoh = strstr(raw, "\r\n\r\n");
            if (eoh == NULL)
                continue;
            in_body = true;
            const char *te = strcasestr(raw, "Transfer-Encoding: chunked");
            chunked = te != NULL && te < eoh;
            used = (size_t)(eoh + 4 - raw);
        }
        for (;;) {
            if (!chunked) {
                append(&resp, &rl, &rc, raw + used);
                used = wl;
                break;
            }
            char *eol = strstr(raw + used, "\r\n");
            if (eol == NULL)
                break;
            const size_t size = strtoul(raw + used, NULL, 16);
            if (wl < (size_t)(eol + 2 - raw) + size + 2)
                break;      /* the chunk is not all here yet */
            char *data = eol + 2, keep = data[size];
            data[size] = 0;
            append(&resp, &rl, &rc, data);
            data[size] = keep;
            used = (size_t)(data + size + 2 - raw);
            if (size == 0)
                break;
        }
        if (resp == NULL)
            continue;
        char *ev;
        while ((ev = strstr(resp + scanned, "data: ")) != NULL) {
            char *end = strstr(ev, "\n\n");
            if (end == NULL)
                break;
            *end = 0;
            if (strncmp(ev + 6, "[DONE]", 6) == 0)
                s->ok = s->completion > 0;
            take_content(ev, s, t0, &ans, &al, &ac);
            const char *usage = strstr(ev, "\"usage\":{");
            if (usage != NULL) {
                long pt = json_num(usage, "prompt_tokens"), ct = json_num(usage, "completion_tokens");
                long cached = json_num(usage, "cached_tokens");
                if (cached < 0)
                    cached = json_num(ev, "cache_n");     /* llama-server's timings */
                s->prompt = (uint32_t)(pt > 0 ? pt : 0);
                s->completion = (uint32_t)(ct > 0 ? ct : 0);
                s->cached = (uint32_t)(cached > 0 ? cached : 0);
            }
            *end = '\n';
            scanned = (size_t)(end + 2 - resp);
        }
    }
    close(fd);
    s->total = now_ms() - t0;
    free(raw);
    free(resp);
    *answer = ans ? ans : strdup("");
}

/* Either server's /v1/chat/completions (--http). */
static void oai_turn(const struct session_arg *a, const struct kvd_chat_msg *m, size_t nm, struct sample *s,
                     char **answer)
{
    oai_request(a->llama ? LLAMA_PORT : C.http_port, m, nm, s, answer);
}

static void *oai_session(void *p)
{
    const struct session_arg *a = p;
    chat_session(p, oai_turn, a->llama ? "llama-server (HTTP)" : "kvd (HTTP)");
    return NULL;
}

/* ---- runs ------------------------------------------------------------------------------------- */

static void run_sessions(struct run *r, int sessions, int turns, bool no_cache, bool llama, bool sampled)
{
    pthread_t th[MAX_SESSIONS];
    struct session_arg args[MAX_SESSIONS];
    pthread_mutex_init(&r->mu, NULL);
    double t0 = now_ms();
    for (int i = 0; i < sessions; i++) {
        args[i] = (struct session_arg){ r, i, turns, no_cache, llama, sampled };
        pthread_create(&th[i], NULL, C.http ? oai_session : llama ? llama_session : kvd_session, &args[i]);
    }
    for (int i = 0; i < sessions; i++)
        pthread_join(th[i], NULL);
    r->wall_ms = now_ms() - t0;
}

static void warm_up(bool llama)
{
    struct run w = { .name = "warm-up" };
    pthread_mutex_init(&w.mu, NULL);
    struct session_arg a = { &w, 999, 1, false, llama, false };
    if (C.http)
        oai_session(&a);
    else if (llama)
        llama_session(&a);
    else
        kvd_session(&a);
}

/* The workload on llama-server (started, warmed up, stopped) into r; false
 * when it did not start. */
static bool llama_run(struct run *r)
{
    bool ok = start_llama();
    if (ok) {
        warm_up(true);
        run_sessions(r, C.sessions, C.turns, false, true, false);
    } else {
        fprintf(stderr, "bench-serve: llama-server did not start (see %s/llama.log)\n", C.tmp);
    }
    stop_child(&llama_pid);
    return ok;
}

/* Overhead: the same 1-token request whose whole prompt but its last block is
 * cached, through kvd and in-process. Returns medians in *through, *alone. */
/* The last n step times (ms) the worker traced into kvd's log; how many found. */
static int traced_steps(double *out, int n)
{
    char path[256], line[512];
    snprintf(path, sizeof(path), "%s/kvd.log", C.tmp);
    FILE *f = fopen(path, "r");
    int k = 0;
    static double all[1 << 16];
    while (f && fgets(line, sizeof(line), f)) {
        const char *p = strstr(line, " tokens, ");
        if (strncmp(line, "kvd-worker ", 11) == 0 && p && k < (1 << 16))
            all[k++] = strtod(p + 9, NULL);
    }
    if (f)
        fclose(f);
    int m = k < n ? k : n;
    memcpy(out, all + k - m, (size_t)m * sizeof(double));
    return m;
}

struct overhead_parts {
    double through, alone;          /* client to client through kvd; in-process, all of it */
    double worker_step, own_step;   /* the step itself: in kvd-worker; in-process */
    double tokenize;                /* template + tokenizer, in-process (kvd does the same) */
    double kvd_queued;              /* kvd: arrival to dispatch (the tokenizer included) */
};

static double median_of(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    return n ? v[n / 2] : NAN;
}

static void overhead(int gap_ms, struct overhead_parts *op)
{
    enum { N = 31 };
    double a[N], b[N], tok_ms[N], st[N], q[N];
    /* in-process, as kvd-run does it: set up once */
    char err[512];
    model_t *m = model_load(C.model, err, sizeof(err));
    tok_t *tk = m ? tok_new_from_gguf(m->gguf, err, sizeof(err)) : NULL;
    if (tk == NULL)
        die("overhead: %s", err);
    chat_template_t *ct = chat_template_for_model(m->gguf, err, sizeof(err));
    struct chat_msg cm[2] = { { "system", system_prompt }, { "user", "Say one word." } };
    char *text;
    size_t tl, n;
    if (ct == NULL || chat_apply(ct, cm, 2, true, &text, &tl) != 0)
        die("overhead: chat template");
    int32_t *ids = malloc((tl + 2) * sizeof(int32_t));
    tok_encode(tk, text, tl, true, ids, tl + 2, &n);
    struct pool_layout lay;
    kv_pool_layout(m, 16, KERN_F16, KERN_F16, 0, false, &lay);
    struct pool_params pp = pool_default_params();
    /* a pool like kvd's (named shared memory of the same size): the KV
     * memory's kind and size change the step's time by several percent */
    char pool_name[64];
    snprintf(pool_name, sizeof(pool_name), "kvd-bench-%d", (int)getpid());
    pp.name = pool_name;
    pp.kv_bytes = KVD_BENCH_KV_BYTES;
    pp.unlink_on_close = true;
    pool_t *pool = pool_create(&lay, &pp, NULL, 0, err, sizeof(err));
    prefix_t *px = pool ? prefix_new(pool, NULL, 0, err, sizeof(err)) : NULL;
    struct kv_params kp = kv_default_params();
    kp.n_blocks = pool ? pool_header(pool)->n_blocks : 0;
    kp.parts = &lay.parts;
    kvcache_t *kv = px ? kvcache_wrap(&m->cfg, &kp, pool_data(pool), pool_data_bytes(pool), err,
                                      sizeof(err)) : NULL;
    struct engine_params ep = engine_default_params();
    ep.n_threads = C.threads;
    ep.max_ctx = 4096;
    engine_t *e = kv ? engine_new(m, kv, &ep, err, sizeof(err)) : NULL;
    if (e == NULL)
        die("overhead: %s", err);
    prefix_ns_t ns = prefix_namespace(px, "", 0);
    struct prefix_seq s = { 0 };

    struct kvd_chat_msg msgs[2] = { { "system", system_prompt }, { "user", "Say one word." } };
    kvd_client_t *c = kvd_client_new(kvd_ep, 600000, NULL, 0);
    struct kvd_gen_params gp;
    kvd_gen_params_init(&gp);
    gp.messages = msgs;
    gp.n_messages = 2;
    gp.max_tokens = 1;
    gp.temperature = 0;
    /* alternating, so that the machine's noise falls on both alike; the first
     * rounds fill both caches */
    for (int i = -2; i < N; i++) {
        struct kvd_result res;
        usleep((useconds_t)gap_ms * 1000); /* gap_ms > 0: both sides start idle */
        double t0 = now_ms();
        kvd_generate(c, &gp, &res);
        if (i >= 0) {
            a[i] = now_ms() - t0;
            q[i] = res.queued_ms;
        }
        kvd_result_free(&res);

        usleep((useconds_t)gap_ms * 1000);
        t0 = now_ms();
        /* per request, as kvd-run does: the template, the tokenizer, the cache */
        char *t2;
        size_t tl2, n2;
        if (chat_apply(ct, cm, 2, true, &t2, &tl2) != 0 ||
            tok_encode(tk, t2, tl2, true, ids, tl + 2, &n2) != 0 || n2 != n)
            die("overhead: the prompt changed");
        free(t2);
        double t_tok = now_ms();
        if (i >= 0)
            tok_ms[i] = t_tok - t0;
        int64_t cached = prefix_seq_begin(px, &s, ns, ids, n, NULL);
        for (uint32_t pos = (uint32_t)cached; pos < n; pos += 512) {
            uint32_t k = (uint32_t)n - pos < 512 ? (uint32_t)n - pos : 512;
            prefix_seq_grow(px, &s, pos + k, ids, n);
            struct fwd_seq fs = { ids + pos, k, pos, s.blocks, s.n_blocks, false,
                                   prefix_seq_tables(&s) };
            const float *lg;
            uint32_t rows;
            double ts = now_ms();
            engine_step(e, &fs, 1, &lg, &rows, err, sizeof(err));
            if (i >= 0)
                st[i] = now_ms() - ts;
            prefix_seq_commit(px, &s, ids, pos + k);
            if (pos + k == n) {
                /* a sampler per request, as kvd-run (and a worker) makes one */
                struct sampler_params sp = sampler_default_params();
                sp.temperature = 0;
                sampler_t *smp = sampler_new(&sp, m->cfg.n_vocab, err, sizeof(err));
                if (smp == NULL)
                    die("overhead: %s", err);
                sampler_sample(smp, lg, ids, n);
                sampler_destroy(&smp);
            }
        }
        prefix_seq_release(px, &s);
        if (i >= 0)
            b[i] = now_ms() - t0;
    }
    kvd_client_destroy(&c);
    prefix_seq_fini(&s);
    engine_destroy(&e);
    kvcache_destroy(&kv);
    prefix_destroy(&px);
    pool_close(&pool);
    chat_template_destroy(&ct);
    free(text);
    free(ids);
    tok_destroy(&tk);
    model_destroy(&m);
    double ws[N];
    int nw = traced_steps(ws, N); /* one step per request: the last N are this loop's */
    op->through = median_of(a, N);
    op->alone = median_of(b, N);
    op->tokenize = median_of(tok_ms, N);
    op->own_step = median_of(st, N);
    op->kvd_queued = median_of(q, N);
    op->worker_step = nw == N ? median_of(ws, nw) : NAN;
}

/* What kvd adds beyond the work kvd-run does too (template, tokenizer, one step). */
static double coordination(const struct overhead_parts *op)
{
    return op->through - op->worker_step - op->tokenize;
}

static void print_overhead(const char *label, const struct overhead_parts *op)
{
    printf("1-token request, all cached (%s): through kvd %.2f ms, in-process %.2f ms: "
           "%.2f ms more\n", label, op->through, op->alone, op->through - op->alone);
    printf("  split: the step %.2f ms in kvd-worker vs %.2f ms in-process; template + tokenizer "
           "%.2f ms (kvd: arrival to dispatch %.2f ms); kvd's coordination (messages, "
           "scheduling, sampler, replies) %.2f ms (target < 1 ms)\n", op->worker_step,
           op->own_step, op->tokenize, op->kvd_queued, coordination(op));
}

/* Time to first token of one request alone (a fresh question after the
 * system prompt), cache on or bypassed; median of 3. */
static double ttft_alone(bool no_cache)
{
    double v[3];
    kvd_client_t *c = kvd_client_new(kvd_ep, 600000, NULL, 0);
    for (int i = 0; i < 3; i++) {
        char q[128];
        snprintf(q, sizeof(q), "Alone %d: what is the text above about?", i);
        struct kvd_chat_msg msgs[2] = { { "system", system_prompt }, { "user", q } };
        struct kvd_gen_params gp;
        kvd_gen_params_init(&gp);
        gp.messages = msgs;
        gp.n_messages = 2;
        gp.max_tokens = 2;
        gp.temperature = 0;
        gp.no_cache = no_cache;
        struct kvd_result res;
        struct first_chunk fc = { now_ms(), -1 };
        if (kvd_generate_stream(c, &gp, on_chunk, &fc, &res) != 0)
            die("ttft request failed: %s", res.error);
        v[i] = fc.ttft;
        kvd_result_free(&res);
    }
    kvd_client_destroy(&c);
    qsort(v, 3, sizeof(double), cmp_d);
    return v[1];
}

static void print_run(const struct run *r, bool first)
{
    uint64_t prompt, cached, gen;
    int ok;
    totals(r, &prompt, &cached, &gen, &ok);
    double tps = gen / (r->wall_ms / 1e3);
    if (C.json) {
        printf("%s{\"name\":\"%s\",\"requests\":%d,\"ok\":%d,\"ttft_p50_ms\":%.1f,"
               "\"ttft_p99_ms\":%.1f,\"output_tokens_per_s\":%.2f,\"hit_rate\":%.4f,"
               "\"prompt_tokens\":%llu,\"cached_tokens\":%llu,\"output_tokens\":%llu,"
               "\"wall_ms\":%.0f,\"blocks\":%u}", first ? "" : ",", r->name, r->n, ok,
               pct(r, 0.5), pct(r, 0.99), tps, prompt ? (double)cached / prompt : 0.0,
               (unsigned long long)prompt, (unsigned long long)cached, (unsigned long long)gen,
               r->wall_ms, r->blocks);
        return;
    }
    printf("| %-22s | %4d/%-4d | %9.1f | %9.1f | %8.1f | %6.1f%% | %6u |\n", r->name, ok, r->n,
           pct(r, 0.5), pct(r, 0.99), tps, prompt ? 100.0 * cached / prompt : 0.0, r->blocks);
}

/* One run of the workload on a fresh kvd (started here, stopped after, its
 * stats taken last) into *r and *st (the caller frees *st with kvd_stats_free). */
static void kvd_run(struct run *r, const char *name, struct kvd_stats *st)
{
    start_kvd();
    memset(r, 0, sizeof(*r));
    r->name = name;
    warm_up(false);
    run_sessions(r, C.sessions, C.turns, false, false, false);
    kvd_client_t *c = kvd_client_new(kvd_ep, 5000, NULL, 0);
    memset(st, 0, sizeof(*st));
    if (c == NULL || kvd_stats(c, st) != 0)
        fprintf(stderr, "bench-serve: no stats from kvd (%s)\n", name);
    kvd_client_destroy(&c);
    stop_child(&kvd_pid);
}

/* --kv-types: the workload once per KV type, each on a fresh kvd with a pool
 * of --kv-memory; kvd's preemptions and evictions beside the run's numbers. */
static void pressure_runs(void)
{
    char types[256];
    snprintf(types, sizeof(types), "%s", C.kv_types);
    printf("bench-serve: %d sessions x %d turns, %s system prompt%s of ~%d tokens, %d tokens per answer "
           "(greedy), %d threads, kvd --kv-memory %s\n", C.sessions, C.turns,
           C.distinct ? "a distinct" : "one shared", C.distinct ? " per session" : "", C.system_tokens,
           C.max_tokens, C.threads, C.kv_memory);
    printf("| %-10s | %-9s | %-9s | %-9s | %-8s | %-7s | %-11s | %-9s | %-15s |\n", "KV type", "ok/reqs",
           "TTFT p50", "TTFT p99", "out tok/s", "hit", "preemptions", "evictions", "bytes per token");
    printf("|------------|-----------|-----------|-----------|----------|---------|-------------|-----------|"
           "-----------------|\n");
    for (char *save = NULL, *t = strtok_r(types, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        C.kv_type = t;
        static struct run r;
        struct kvd_stats st;
        kvd_run(&r, t, &st);
        uint64_t prompt, cached, gen;
        int ok;
        totals(&r, &prompt, &cached, &gen, &ok);
        printf("| %-10s | %4d/%-4d | %9.1f | %9.1f | %8.1f | %6.1f%% | %11llu | %9llu | %15llu |\n", t, ok,
               r.n, pct(&r, 0.5), pct(&r, 0.99), gen / (r.wall_ms / 1e3),
               prompt ? 100.0 * cached / prompt : 0.0, (unsigned long long)st.preemptions,
               (unsigned long long)st.evictions, (unsigned long long)st.kv_bytes_per_token);
        kvd_stats_free(&st);
        fflush(stdout);
    }
}

/* --tiers: every session its own system prompt (--distinct) through a pool of
 * --kv-memory too small for all of them, with no tier, with the host tier
 * (--host-cache 2GiB) and with the disk tier alone (--cache-dir in the
 * temporary directory): hit rate, throughput, TTFT, and where the cached
 * tokens came from. */
static void tier_runs(void)
{
    static const char *names[3] = { "no tier", "host tier", "disk tier" };
    char dir[128];
    snprintf(dir, sizeof(dir), "%s/cache", C.tmp);
    C.distinct = true;
    printf("bench-serve --tiers: %d sessions x %d turns, a distinct system prompt per session of ~%d tokens, "
           "%d tokens per answer (greedy), %d threads, kvd --kv-memory %s\n", C.sessions, C.turns,
           C.system_tokens, C.max_tokens, C.threads, C.kv_memory);
    printf("| %-9s | %-9s | %-9s | %-9s | %-9s | %-7s | %-9s | %-11s | %-11s |\n", "tiers", "ok/reqs", "TTFT p50",
           "TTFT p99", "out tok/s", "hit", "evictions", "host tokens", "disk tokens");
    printf("|-----------|-----------|-----------|-----------|-----------|---------|-----------|-------------|"
           "-------------|\n");
    for (int k = 0; k < 3; k++) {
        memset(C.tier_args, 0, sizeof(C.tier_args));
        if (k == 1) {
            C.tier_args[0] = "--host-cache";
            C.tier_args[1] = "2GiB";
        } else if (k == 2) {
            C.tier_args[0] = "--cache-dir";
            C.tier_args[1] = dir;
        }
        static struct run r;
        struct kvd_stats st;
        kvd_run(&r, names[k], &st);
        uint64_t prompt, cached, gen;
        int ok;
        totals(&r, &prompt, &cached, &gen, &ok);
        printf("| %-9s | %4d/%-4d | %9.1f | %9.1f | %9.1f | %6.1f%% | %9llu | %11llu | %11llu |\n", names[k], ok,
               r.n, pct(&r, 0.5), pct(&r, 0.99), gen / (r.wall_ms / 1e3), prompt ? 100.0 * cached / prompt : 0.0,
               (unsigned long long)st.evictions, (unsigned long long)st.host_cached_prompt_tokens,
               (unsigned long long)st.disk_cached_prompt_tokens);
        kvd_stats_free(&st);
        fflush(stdout);
    }
    memset(C.tier_args, 0, sizeof(C.tier_args));
}

/* --http-overhead: the same cached 1-token chat request (the system prompt and
 * "Say one word.", greedy) through kvd's HTTP API on one kept-alive connection
 * and through the C client over ZeroMQ, alternating, medians of 31. */
static void http_overhead(void)
{
    char *body = NULL;
    size_t len = 0, cap = 0;
    append(&body, &len, &cap, "{\"messages\":[{\"role\":\"system\",\"content\":\"");
    json_escape(system_prompt, &body, &len, &cap);
    append(&body, &len, &cap, "\"},{\"role\":\"user\",\"content\":\"Say one word.\"}],"
                              "\"max_tokens\":1,\"temperature\":0}");
    char head[256];
    const int hl = snprintf(head, sizeof(head), "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                            "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n", len);
    int fd = http_connect_port(C.http_port);
    if (fd < 0)
        die("cannot connect to kvd's HTTP port %d", C.http_port);
    int one = 1;    /* no Nagle delay on a request's last segment, as HTTP clients set */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    char *req = malloc((size_t)hl + len);   /* one write: head and body */
    memcpy(req, head, (size_t)hl);
    memcpy(req + hl, body, len);
    kvd_client_t *c = kvd_client_new(kvd_ep, 60000, NULL, 0);
    struct kvd_chat_msg msgs[2] = { { "system", system_prompt }, { "user", "Say one word." } };
    enum { N = 31 };
    double t_http[N + 2], t_zmq[N + 2];
    char *resp = malloc(1 << 20);
    for (int i = 0; i < N + 2; i++) {   /* the first two: warm-up, not counted */
        double t0 = now_ms();
        if (write(fd, req, (size_t)hl + len) != (ssize_t)((size_t)hl + len))
            die("HTTP write failed");
        size_t got = 0;
        long want = -1;
        for (;;) {      /* headers, then Content-Length bytes of body */
            ssize_t n = read(fd, resp + got, (1 << 20) - 1 - got);
            if (n <= 0)
                die("HTTP read failed");
            got += (size_t)n;
            resp[got] = 0;
            char *eoh = strstr(resp, "\r\n\r\n");
            if (eoh != NULL) {
                if (want < 0) {
                    char *cl = strcasestr(resp, "Content-Length:");
                    want = cl ? strtol(cl + 15, NULL, 10) + (long)(eoh + 4 - resp) : -1;
                    if (strncmp(resp, "HTTP/1.1 200", 12) != 0)
                        die("kvd's HTTP API answered: %.80s", resp);
                }
                if (want >= 0 && (long)got >= want)
                    break;
            }
        }
        t_http[i] = now_ms() - t0;
        struct kvd_gen_params gp;
        kvd_gen_params_init(&gp);
        gp.messages = msgs;
        gp.n_messages = 2;
        gp.max_tokens = 1;
        gp.temperature = 0;
        struct kvd_result res;
        t0 = now_ms();
        if (kvd_generate(c, &gp, &res) != 0)
            die("ZeroMQ request failed: %s", res.error);
        t_zmq[i] = now_ms() - t0;
        kvd_result_free(&res);
    }
    close(fd);
    kvd_client_destroy(&c);
    free(resp);
    free(req);
    free(body);
    double d[N];
    for (int i = 0; i < N; i++)
        d[i] = t_http[i + 2] - t_zmq[i + 2];
    const double h = median_of(t_http + 2, N), z = median_of(t_zmq + 2, N), dd = median_of(d, N);
    printf("cached 1-token chat request, medians of %d: over HTTP %.3f ms, over ZeroMQ %.3f ms; HTTP adds "
           "%.3f ms (median of the paired differences)   (target < 0.3 ms)\n", N, h, z, dd);
}

/* --http: the workload through kvd's HTTP API and, given --llama-server,
 * through llama-server's, both over /v1/chat/completions. */
static void http_runs(void)
{
    static struct run k = { .name = "kvd (HTTP)" }, l = { .name = "llama-server (HTTP)" };
    C.http_port = 18000 + (int)(getpid() % 2000);
    start_kvd();
    warm_up(false);
    run_sessions(&k, C.sessions, C.turns, false, false, false);
    stop_child(&kvd_pid);
    const bool have_llama = C.llama && llama_run(&l);
    printf("bench-serve --http: %d sessions x %d turns, one system prompt of ~%d tokens, %d tokens per answer "
           "(greedy), %d threads per server, both over POST /v1/chat/completions (streamed)\n", C.sessions, C.turns,
           C.system_tokens, C.max_tokens, C.threads);
    printf("| %-22s | %-9s | %-9s | %-9s | %-8s | %-7s | %-6s |\n", "run", "ok/reqs", "TTFT p50", "TTFT p99",
           "out tok/s", "cached", "blocks");
    printf("|------------------------|-----------|-----------|-----------|----------|---------|--------|\n");
    print_run(&k, true);
    if (have_llama) {
        print_run(&l, false);
        uint64_t p, c, g1, g2;
        int ok;
        totals(&k, &p, &c, &g1, &ok);
        totals(&l, &p, &c, &g2, &ok);
        printf("output tokens/s, kvd / llama-server over HTTP: %.2fx\n",
               (g1 / (k.wall_ms / 1e3)) / (g2 / (l.wall_ms / 1e3)));
    }
}

static uint32_t kvd_blocks_held(void)
{
    kvd_client_t *c = kvd_client_new(kvd_ep, 5000, NULL, 0);
    struct kvd_stats st;
    uint32_t held = 0;
    if (kvd_stats(c, &st) == 0) {
        held = st.blocks_cached + st.blocks_in_use + st.blocks_pending;
        kvd_stats_free(&st);
    }
    kvd_client_destroy(&c);
    return held;
}

int main(int argc, char **argv)
{
    C.model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    C.text_file = "tests/data/ppl_text.txt";
    C.sessions = 16;
    C.turns = 2;
    C.max_tokens = 32;
    C.threads = 2;
    C.system_tokens = 2000;
    C.kv_memory = "1073741824";
    C.kv_type = "f16";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-m") && v) C.model = argv[++i];
        else if (!strcmp(a, "--llama-server") && v) C.llama = argv[++i];
        else if (!strcmp(a, "--sessions") && v) C.sessions = atoi(argv[++i]);
        else if (!strcmp(a, "--turns") && v) C.turns = atoi(argv[++i]);
        else if (!strcmp(a, "--max-tokens") && v) C.max_tokens = atoi(argv[++i]);
        else if (!strcmp(a, "--system-tokens") && v) C.system_tokens = atoi(argv[++i]);
        else if (!strcmp(a, "--text") && v) C.text_file = argv[++i];
        else if (!strcmp(a, "-t") && v) C.threads = atoi(argv[++i]);
        else if (!strcmp(a, "--json")) C.json = true;
        else if (!strcmp(a, "--overhead-only")) C.overhead_only = true;
        else if (!strcmp(a, "--sampled")) C.sampled = true;
        else if (!strcmp(a, "--kv-types") && v) C.kv_types = argv[++i];
        else if (!strcmp(a, "--kv-memory") && v) C.kv_memory = argv[++i];
        else if (!strcmp(a, "--distinct")) C.distinct = true;
        else if (!strcmp(a, "--http-overhead")) C.http_overhead = true;
        else if (!strcmp(a, "--http")) C.http = true;
        else if (!strcmp(a, "--tiers")) C.tiers = true;
        else die("usage: bench-serve [-m MODEL] [--llama-server PATH] [--sessions S] [--turns T] "
                 "[--system-tokens L] [--max-tokens N] [--text FILE] [-t THREADS] [--sampled] [--json] "
                 "[--kv-types LIST [--kv-memory SIZE] [--distinct]] [--tiers [--kv-memory SIZE]] [--http] "
                 "[--http-overhead]");
    }
    if (C.sessions < 1 || C.sessions > MAX_SESSIONS || C.turns < 1 || C.turns > MAX_TURNS)
        die("--sessions 1..%d, --turns 1..%d", MAX_SESSIONS, MAX_TURNS);
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    exe[n > 0 ? n : 0] = 0;
    char *slash = strrchr(exe, '/');
    if (slash)
        *slash = 0;
    snprintf(C.bin_dir, sizeof(C.bin_dir), "%s", exe);
    snprintf(C.tmp, sizeof(C.tmp), "/tmp/kvd-bench-XXXXXX");
    if (mkdtemp(C.tmp) == NULL)
        die("mkdtemp");
    /* the system prompt: about system_tokens tokens (~4.3 characters each) of the text */
    FILE *f = fopen(C.text_file, "r");
    if (f == NULL)
        die("cannot open %s", C.text_file);
    size_t want = (size_t)C.system_tokens * 43 / 10;
    system_prompt = calloc(want + 1, 1);
    size_t got = fread(system_prompt, 1, want, f);
    fclose(f);
    system_prompt[got] = 0;

    if (C.kv_types != NULL) {
        pressure_runs();
        return 0;
    }
    if (C.tiers) {
        tier_runs();
        return 0;
    }
    if (C.http) {
        http_runs();
        return 0;
    }
    if (C.http_overhead) {
        C.http_port = 18000 + (int)(getpid() % 2000);
        start_kvd();
        warm_up(false);
        http_overhead();
        stop_child(&kvd_pid);
        return 0;
    }
    static struct run on = { .name = "kvd" }, llama = { .name = "llama-server" },
                      sampled = { .name = "kvd, sampled" };
    start_kvd();
    if (C.overhead_only) {
        struct overhead_parts busy, idle;
        overhead(0, &busy);
        overhead(100, &idle);
        stop_child(&kvd_pid);
        print_overhead("back to back", &busy);
        print_overhead("after 100 ms idle", &idle);
        return 0;
    }
    warm_up(false);
    run_sessions(&on, C.sessions, C.turns, false, false, false);
    on.blocks = kvd_blocks_held();
    if (C.sampled) {
        run_sessions(&sampled, C.sessions, C.turns, false, false, true);
        sampled.blocks = kvd_blocks_held();
    }
    double ttft_cached = ttft_alone(false), ttft_uncached = ttft_alone(true);
    struct overhead_parts busy, idle;
    overhead(0, &busy);
    overhead(100, &idle);
    stop_child(&kvd_pid);
    const bool have_llama = C.llama && llama_run(&llama);
    double ttft_ratio = ttft_uncached / ttft_cached;
    uint64_t p, c, g1, g2;
    int ok;
    totals(&on, &p, &c, &g1, &ok);
    totals(&llama, &p, &c, &g2, &ok);
    double tps_ratio = have_llama ? (g1 / (on.wall_ms / 1e3)) / (g2 / (llama.wall_ms / 1e3)) : NAN;
    if (C.json) {
        printf("{\"sessions\":%d,\"turns\":%d,\"max_tokens\":%d,\"threads\":%d,\"runs\":[",
               C.sessions, C.turns, C.max_tokens, C.threads);
        print_run(&on, true);
        if (have_llama)
            print_run(&llama, false);
        if (C.sampled)
            print_run(&sampled, false);
        printf("],\"ttft_alone_cached_ms\":%.1f,\"ttft_alone_uncached_ms\":%.1f", ttft_cached,
               ttft_uncached);
        printf(",\"ttft_cache_ratio\":%.2f,\"tps_vs_llama\":%.3f,\"overhead_ms\":%.3f,"
               "\"through_kvd_ms\":%.3f,\"in_process_ms\":%.3f,\"overhead_idle_ms\":%.3f,"
               "\"worker_step_ms\":%.3f,\"in_process_step_ms\":%.3f,\"coordination_ms\":%.3f}\n",
               ttft_ratio, tps_ratio, busy.through - busy.alone, busy.through, busy.alone,
               idle.through - idle.alone, busy.worker_step, busy.own_step, coordination(&busy));
        return 0;
    }
    printf("bench-serve: %d sessions x %d turns, one system prompt of ~%d tokens, %d tokens per "
           "answer (greedy), %d threads per server\n", C.sessions, C.turns, C.system_tokens,
           C.max_tokens, C.threads);
    printf("| %-22s | %-9s | %-9s | %-9s | %-8s | %-7s | %-6s |\n", "run", "ok/reqs", "TTFT p50",
           "TTFT p99", "out tok/s", "hit", "blocks");
    printf("|------------------------|-----------|-----------|-----------|----------|---------|--------|\n");
    print_run(&on, true);
    if (have_llama)
        print_run(&llama, false);
    if (C.sampled) {
        print_run(&sampled, false);
        uint64_t gs;
        totals(&sampled, &p, &c, &gs, &ok);
        printf("output tokens/s, sampled (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) / greedy: "
               "%.2fx\n", (gs / (sampled.wall_ms / 1e3)) / (g1 / (on.wall_ms / 1e3)));
    }
    printf("TTFT alone (new question after the system prompt): cached %.1f ms, cache bypassed "
           "%.1f ms: %.1fx   (target >= 20x)\n", ttft_cached, ttft_uncached, ttft_ratio);
    if (have_llama)
        printf("output tokens/s, kvd / llama-server:      %.2fx   (target >= 1.5x; llama-server "
               "-np %d -t %d, prompt cache on)\n", tps_ratio, C.sessions, C.threads);
    print_overhead("back to back", &busy);
    print_overhead("after 100 ms idle", &idle);
    return 0;
}
