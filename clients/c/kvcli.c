/*
 * kvcli.c - kvcli, the command line of kvd: generate text (streamed, whole,
 * or as JSON), print the daemon's statistics, check its health, list, make,
 * unpin and evict pinned prefixes (kvcli cache).
 *
 * Exit status: 0 done, 1 an error from kvd or the connection (one line
 * "kvcli: ..." on stderr), 2 a usage error, 130 a streamed generate
 * cancelled with Ctrl-C (what came is printed, the request is cancelled at
 * kvd; a second Ctrl-C quits at once).
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "cli.h"
#include "kvd_client.h"
#include "units.h"

#define MAX_STOPS 16
#define MAX_IDS (1u << 20)

struct options {
    const char *endpoint;       /* -e; NULL: kvd_default_endpoint() */
    int timeout_ms;             /* --timeout; 0: the library's default */
    bool json;                  /* --json */
    bool prometheus;            /* stats --prometheus */
    bool chat;                  /* --chat */
    bool stream;                /* not --no-stream */
    const char *system;         /* --system / --system-file contents */
    char *system_buf;           /* owned copy read from --system-file */
    const char *prompt;         /* PROMPT, or stdin for "-" */
    char *prompt_buf;           /* owned copy read from stdin */
    int32_t *ids;               /* --prompt-ids */
    size_t n_ids;
    const char *stops[MAX_STOPS]; /* --stop */
    size_t n_stops;
    struct kvd_gen_params gp;   /* sampling and the rest, as the library takes them */
};

static const char *prog = "kvcli";

static void die_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die_call(int rc, const char *msg, uint32_t retry_after_ms) __attribute__((noreturn));

/* A usage error: one line, exit 2. */
static void die_usage(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs(" (see kvcli --help)\n", stderr);
    exit(2);
}

/* Any other error: one line, exit 1. */
static void die(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

static void usage(FILE *f)
{
    fputs("usage: kvcli [-e ENDPOINT] [--timeout MS] COMMAND [options]\n"
          "       (a kvd with CURVE: KVD_CURVE_SERVER_KEY=its public key or key file,\n"
          "        KVD_CURVE_CERT=this client's secret certificate from kvd-keygen)\n"
          "\n"
          "commands:\n"
          "  generate [options] PROMPT  generate a continuation of PROMPT (\"-\": read stdin)\n"
          "  stats [--json | --prometheus]  the daemon's statistics (--prometheus: as /metrics)\n"
          "  health                     print ok / not ok (exit status 0 / 1)\n"
          "  cache list [--namespace NS] [--json]   the pinned prefixes (of NS's tenant)\n"
          "  cache pin [--ttl 5m|1h|SECONDS] [--messages-file F [--pin-messages N] | --prompt-file F | PROMPT]\n"
          "            [--namespace NS] [--json]    compute a prompt into the cache and pin it\n"
          "                             (a messages file: a JSON array of {\"role\", \"content\"};\n"
          "                             --pin-messages N: the prefix of its first N messages)\n"
          "  cache unpin|evict [--namespace NS] [--json] PIN_ID  drop a pin (evict: its blocks too)\n"
          "\n"
          "global options:\n"
          "  -e, --endpoint ENDPOINT    kvd's endpoint (default $KVD_ENDPOINT, else\n"
          "                             ipc://$XDG_RUNTIME_DIR/kvd/kvd.sock or\n"
          "                             ipc:///tmp/kvd-UID/kvd.sock)\n"
          "      --timeout MS           longest wait for one message from kvd (default 30000)\n"
          "  -h, --help                 this text\n"
          "\n"
          "generate options:\n"
          "      --chat                 send PROMPT as a user message, through the chat template\n"
          "      --system TEXT          a system message first (with --chat)\n"
          "      --system-file FILE     the same, read from FILE\n"
          "      --prompt-ids IDS       token ids (comma-separated) instead of PROMPT\n"
          "  -n N                       tokens to generate at most (default: kvd's, 256)\n"
          "      --temp T               temperature (0: greedy)\n"
          "      --top-k K, --top-p P, --min-p P, --repeat-penalty R\n"
          "      --seed S               sampling seed (default random)\n"
          "      --stop STR             stop at STR (repeatable, up to 16)\n"
          "      --namespace NS         prefix-cache namespace (a convenience, not isolation)\n"
          "      --no-cache             neither use nor fill the prefix cache\n"
          "      --logprobs N           with --json: each token's logprob and its N (0..20)\n"
          "                             most likely alternatives, as [id, logprob] pairs\n"
          "      --deadline MS          give up after MS milliseconds at kvd\n"
          "      --ignore-eos           generate past end-of-generation tokens\n"
          "      --no-stream            print the text once it is complete\n"
          "      --json                 print one JSON object: text, tokens, finish_reason,\n"
          "                             usage and timings\n",
          f);
}

/* ---- parsing ------------------------------------------------------------------------ */

static long long parse_int(const char *s, const char *what, long long lo, long long hi)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi)
        die_usage("%s must be an integer in [%lld, %lld], got '%s'", what, lo, hi, s);
    return v;
}

static float parse_float(const char *s, const char *what)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end != '\0' || !isfinite(v) || v < 0)
        die_usage("%s must be a number >= 0, got '%s'", what, s);
    return v;
}

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        die("cannot open %s: %s", path, strerror(errno));
    char *s = cli_read_stream(f, path, 64u << 20, NULL);
    fclose(f);
    return s;
}

static int32_t *parse_ids(const char *s, size_t *n)
{
    size_t cap = 64;
    int32_t *ids = malloc(cap * sizeof(*ids));
    *n = 0;
    while (ids != NULL && *s) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || v < 0 || v > INT32_MAX)
            die_usage("--prompt-ids wants comma-separated ids >= 0, got '%s'", s);
        if (*n == MAX_IDS)
            die_usage("--prompt-ids: more than %u ids", MAX_IDS);
        if (*n == cap)
            ids = realloc(ids, (cap *= 2) * sizeof(*ids));
        if (ids == NULL)
            break;
        ids[(*n)++] = (int32_t)v;
        s = end;
        while (*s == ',' || *s == ' ')
            s++;
    }
    if (ids == NULL)
        die("out of memory");
    return ids;
}

enum {
    OPT_TIMEOUT = 256, OPT_CHAT, OPT_SYSTEM, OPT_SYSTEM_FILE, OPT_JSON, OPT_TEMP, OPT_TOPK,
    OPT_TOPP, OPT_MINP, OPT_REPEAT, OPT_SEED, OPT_STOP, OPT_NS, OPT_NO_CACHE, OPT_LOGPROBS, OPT_DEADLINE,
    OPT_IGNORE_EOS, OPT_NO_STREAM, OPT_IDS, OPT_PROM, OPT_TTL, OPT_MSGFILE, OPT_PROMPTFILE, OPT_PINMSGS,
};

static int parse_timeout(const char *s)
{
    return (int)parse_int(s, "--timeout", 1, 24 * 3600 * 1000);
}

/* Parses the options of stats and health (argv[0] is the command). */
static void parse_simple(int argc, char **argv, struct options *o)
{
    static const struct option longs[] = {
        { "json", no_argument, NULL, OPT_JSON },
        { "prometheus", no_argument, NULL, OPT_PROM },
        { "endpoint", required_argument, NULL, 'e' },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    bool is_stats = strcmp(argv[0], "stats") == 0;
    optind = 0;
    int c;
    while ((c = getopt_long(argc, argv, ":e:h", longs, NULL)) != -1) {
        switch (c) {
        case 'e': o->endpoint = optarg; break;
        case OPT_TIMEOUT: o->timeout_ms = parse_timeout(optarg); break;
        case OPT_JSON:
            if (!is_stats)
                die_usage("%s takes no --json", argv[0]);
            o->json = true;
            break;
        case OPT_PROM:
            if (!is_stats)
                die_usage("%s takes no --prometheus", argv[0]);
            o->prometheus = true;
            break;
        case 'h': usage(stdout); exit(0);
        case ':': die_usage("option %s needs a value", argv[optind - 1]);
        default: die_usage("unknown option %s", argv[optind - 1]);
        }
    }
    if (optind < argc)
        die_usage("%s: unexpected argument '%s'", argv[0], argv[optind]);
}

/* Parses the options before the command; returns the command's index in argv. */
static int parse_global(int argc, char **argv, struct options *o)
{
    static const struct option longs[] = {
        { "endpoint", required_argument, NULL, 'e' },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "+:e:h", longs, NULL)) != -1) {
        switch (c) {
        case 'e': o->endpoint = optarg; break;
        case OPT_TIMEOUT: o->timeout_ms = parse_timeout(optarg); break;
        case 'h': usage(stdout); exit(0);
        case ':': die_usage("option %s needs a value", argv[optind - 1]);
        default: die_usage("unknown option %s", argv[optind - 1]);
        }
    }
    if (optind >= argc)
        die_usage("no command (generate, stats, health or cache)");
    return optind;
}

/* Parses `generate`'s options and its PROMPT (argv[0] is "generate"). */
static void parse_generate(int argc, char **argv, struct options *o)
{
    static const struct option longs[] = {
        { "chat", no_argument, NULL, OPT_CHAT },
        { "system", required_argument, NULL, OPT_SYSTEM },
        { "system-file", required_argument, NULL, OPT_SYSTEM_FILE },
        { "json", no_argument, NULL, OPT_JSON },
        { "temp", required_argument, NULL, OPT_TEMP },
        { "top-k", required_argument, NULL, OPT_TOPK },
        { "top-p", required_argument, NULL, OPT_TOPP },
        { "min-p", required_argument, NULL, OPT_MINP },
        { "repeat-penalty", required_argument, NULL, OPT_REPEAT },
        { "seed", required_argument, NULL, OPT_SEED },
        { "stop", required_argument, NULL, OPT_STOP },
        { "namespace", required_argument, NULL, OPT_NS },
        { "no-cache", no_argument, NULL, OPT_NO_CACHE },
        { "logprobs", required_argument, NULL, OPT_LOGPROBS },
        { "deadline", required_argument, NULL, OPT_DEADLINE },
        { "ignore-eos", no_argument, NULL, OPT_IGNORE_EOS },
        { "no-stream", no_argument, NULL, OPT_NO_STREAM },
        { "prompt-ids", required_argument, NULL, OPT_IDS },
        { "endpoint", required_argument, NULL, 'e' },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    struct kvd_gen_params *p = &o->gp;
    optind = 0;     /* glibc: start over, in the default (permuting) order */
    int c;
    while ((c = getopt_long(argc, argv, ":n:e:h", longs, NULL)) != -1) {
        switch (c) {
        case 'e': o->endpoint = optarg; break;
        case OPT_TIMEOUT: o->timeout_ms = parse_timeout(optarg); break;
        case OPT_CHAT: o->chat = true; break;
        case OPT_SYSTEM: o->system = optarg; break;
        case OPT_SYSTEM_FILE:
            free(o->system_buf);
            o->system = o->system_buf = read_file(optarg);
            break;
        case OPT_JSON: o->json = true; break;
        case 'n': p->max_tokens = (uint32_t)parse_int(optarg, "-n", 1, 1 << 20); break;
        case OPT_TEMP: p->temperature = parse_float(optarg, "--temp"); break;
        case OPT_TOPK: p->top_k = (int32_t)parse_int(optarg, "--top-k", 0, 1 << 20); break;
        case OPT_TOPP: p->top_p = parse_float(optarg, "--top-p"); break;
        case OPT_MINP: p->min_p = parse_float(optarg, "--min-p"); break;
        case OPT_REPEAT: p->repeat_penalty = parse_float(optarg, "--repeat-penalty"); break;
        case OPT_SEED: p->seed = parse_int(optarg, "--seed", 0, INT64_MAX); break;
        case OPT_STOP:
            if (o->n_stops == MAX_STOPS)
                die_usage("at most %d --stop strings", MAX_STOPS);
            if (optarg[0] == '\0')
                die_usage("--stop needs a non-empty string");
            o->stops[o->n_stops++] = optarg;
            break;
        case OPT_NS: p->ns = optarg; break;
        case OPT_NO_CACHE: p->no_cache = true; break;
        case OPT_LOGPROBS:
            p->logprobs = (int32_t)parse_int(optarg, "--logprobs", 0, KVD_MAX_TOP_LOGPROBS);
            break;
        case OPT_DEADLINE:
            p->deadline_ms = (uint32_t)parse_int(optarg, "--deadline", 1, 24 * 3600 * 1000);
            break;
        case OPT_IGNORE_EOS: p->ignore_eos = true; break;
        case OPT_NO_STREAM: o->stream = false; break;
        case OPT_IDS:
            free(o->ids);
            o->ids = parse_ids(optarg, &o->n_ids);
            if (o->n_ids == 0)
                die_usage("--prompt-ids holds no ids");
            break;
        case 'h': usage(stdout); exit(0);
        case ':': die_usage("option %s needs a value", argv[optind - 1]);
        default: die_usage("unknown option %s", argv[optind - 1]);
        }
    }
    int left = argc - optind;
    if (o->ids != NULL) {
        if (left > 0)
            die_usage("--prompt-ids and PROMPT exclude each other");
        if (o->chat)
            die_usage("--prompt-ids and --chat exclude each other");
    } else {
        if (left == 0)
            die_usage("generate needs a PROMPT (or --prompt-ids)");
        if (left > 1)
            die_usage("unexpected argument '%s' (quote the prompt)", argv[optind + 1]);
        o->prompt = argv[optind];
        if (strcmp(o->prompt, "-") == 0)
            o->prompt = o->prompt_buf = cli_read_stream(stdin, "stdin", 64u << 20, NULL);
    }
    if (o->system != NULL && !o->chat)
        die_usage("--system and --system-file need --chat");
}

/* ---- output ------------------------------------------------------------------------- */

static void json_str(FILE *f, const char *s, size_t n)
{
    fputc('"', f);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': fputs("\\\"", f); break;
        case '\\': fputs("\\\\", f); break;
        case '\n': fputs("\\n", f); break;
        case '\r': fputs("\\r", f); break;
        case '\t': fputs("\\t", f); break;
        default:
            if (c < 0x20 || c == 0x7f)
                fprintf(f, "\\u%04x", c);
            else
                fputc(c, f);
        }
    }
    fputc('"', f);
}

static const char *finish_name(int f)
{
    switch (f) {
    case KVD_FINISH_STOP: return "stop";
    case KVD_FINISH_LENGTH: return "length";
    case KVD_FINISH_CANCELLED: return "cancelled";
    case KVD_FINISH_DEADLINE: return "deadline";
    default: return "none";
    }
}

/* The field names follow kvd-run --json where they mean the same. */
static void print_json(const struct kvd_result *r)
{
    printf("{\"text\":");
    json_str(stdout, r->text ? r->text : "", r->text_len);
    printf(",\"tokens\":[");
    for (size_t i = 0; i < r->n_tokens; i++)
        printf("%s%d", i ? "," : "", r->tokens[i]);
    printf("],\"finish_reason\":\"%s\",\"cached_prompt_tokens\":%u", finish_name(r->finish_reason),
           r->cached_prompt_tokens);
    printf(",\"usage\":{\"prompt_tokens\":%u,\"cached_prompt_tokens\":%u,"
           "\"host_cached_prompt_tokens\":%u,\"disk_cached_prompt_tokens\":%u,\"completion_tokens\":%u}",
           r->prompt_tokens, r->cached_prompt_tokens, r->host_cached_prompt_tokens, r->disk_cached_prompt_tokens,
           r->completion_tokens);
    printf(",\"timings\":{\"queued_ms\":%.1f,\"ttft_ms\":%.1f,\"decode_ms\":%.1f,"
           "\"total_ms\":%.1f}",
           r->queued_ms, r->ttft_ms, r->decode_ms, r->total_ms);
    printf(",\"chunks\":%u,\"request_id\":%llu", r->chunks, (unsigned long long)r->request_id);
    if (r->logprobs != NULL) {
        /* exact: %.17g gives back the same double, as Python's float does */
        printf(",\"logprobs\":[");
        for (size_t i = 0; i < r->n_logprobs; i++) {
            const struct kvd_logprob *l = &r->logprobs[i];
            printf("%s{\"logprob\":%.17g,\"top\":[", i ? "," : "", isfinite(l->logprob) ? (double)l->logprob : -9999.0);
            for (uint32_t j = 0; j < l->n_top; j++)
                printf("%s[%d,%.17g]", j ? "," : "", l->top_ids[j],
                       isfinite(l->top_logprobs[j]) ? (double)l->top_logprobs[j] : -9999.0);
            printf("]}");
        }
        printf("]");
    }
    printf("}\n");
}

/* Reports a failed call: the daemon's message after the code's name, or the
 * client's own reason alone. */
static void die_call(int rc, const char *msg, uint32_t retry_after_ms)
{
    bool local = rc == KVD_ETIMEOUT || rc == KVD_EPROTOCOL || rc == KVD_EINVAL ||
                 rc == KVD_EIO || rc == KVD_ENOMEM;
    char retry[64] = "";
    if (rc == KVD_EOVERLOADED && retry_after_ms > 0)
        snprintf(retry, sizeof(retry), " (retry after %u ms)", retry_after_ms);
    if (msg == NULL || msg[0] == '\0')
        die("%s%s", kvd_strerror(rc), retry);
    if (local)
        die("%s", msg);
    die("%s: %s%s", kvd_strerror(rc), msg, retry);
}

/* ---- commands ----------------------------------------------------------------------- */

static volatile sig_atomic_t interrupted;

/* First Ctrl-C: cancel at the next chunk; second: quit now. */
static void on_sigint(int sig)
{
    (void)sig;
    if (interrupted)
        _exit(130);
    interrupted = 1;
}

static int print_chunk(void *user, const char *text, size_t len, const int32_t *tokens,
                       size_t n_tokens, uint32_t seq)
{
    const struct options *o = user;
    (void)tokens, (void)n_tokens, (void)seq;
    if (!o->json) {
        fwrite(text, 1, len, stdout);
        fflush(stdout);
    }
    return interrupted ? 1 : 0;
}

static int cmd_generate(kvd_client_t *c, struct options *o)
{
    struct kvd_gen_params *p = &o->gp;
    struct kvd_chat_msg msgs[2];
    if (o->ids != NULL) {
        p->token_ids = o->ids;
        p->n_token_ids = o->n_ids;
    } else if (o->chat) {
        size_t n = 0;
        if (o->system != NULL)
            msgs[n++] = (struct kvd_chat_msg){ "system", o->system };
        msgs[n++] = (struct kvd_chat_msg){ "user", o->prompt };
        p->messages = msgs;
        p->n_messages = n;
    } else {
        p->prompt = o->prompt;
    }
    p->stop = o->stops;
    p->n_stop = o->n_stops;

    struct kvd_result r;
    int rc;
    if (o->stream) {
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_sigint;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
        rc = kvd_generate_stream(c, p, print_chunk, o, &r);
    } else {
        rc = kvd_generate(c, p, &r);
    }
    bool cancelled = rc == KVD_ECANCELLED && interrupted;
    if (rc == 0 || cancelled) {
        if (o->json)
            print_json(&r);
        else if (o->stream)
            putchar('\n');
        else
            printf("%s\n", r.text);
        fflush(stdout);
        kvd_result_free(&r);
        return cancelled ? 130 : 0;
    }
    if (o->stream && !o->json && r.chunks > 0) {
        putchar('\n');  /* end the text that came before the error */
        fflush(stdout);
    }
    die_call(rc, r.error, r.retry_after_ms);
}

/* One field of a table in kvd_stats_fields.h as a JSON member ("name":value,
 * a comma before it unless it is the first). */
#define JSON_U64(v) printf("%llu", (unsigned long long)(v))
#define JSON_U32(v) printf("%u", (unsigned)(v))
#define JSON_I32(v) printf("%d", (int)(v))
#define JSON_BOOL(v) fputs((v) ? "true" : "false", stdout)
#define JSON_STR48(v) json_str(stdout, (v), strlen(v))
#define JSON_STR64 JSON_STR48
#define JSON_STR128 JSON_STR48
#define JSON_FIELD(name, type, prom_type, prom_name, help) \
    printf("%s\"" #name "\":", first ? "" : ",");          \
    first = false;                                          \
    JSON_##type(row->name);

/* "key":[{...},...] of n rows, each field by its table. */
#define JSON_ROWS(key, rows, n, FIELDS)                     \
    do {                                                    \
        printf(",\"" key "\":[");                           \
        for (uint32_t i_ = 0; i_ < (n); i_++) {             \
            const __typeof__((rows)[0]) *row = &(rows)[i_]; \
            bool first = true;                              \
            printf("%s{", i_ ? "," : "");                   \
            FIELDS(JSON_FIELD)                              \
            putchar('}');                                   \
        }                                                   \
        putchar(']');                                       \
    } while (0)

/* kvcli stats --json: one object, every figure of KVD_STATS_FIELDS by its
 * name, then the workers', tenants' and hosts' rows. */
static void print_stats_json(const struct kvd_stats *s)
{
    putchar('{');
    {
        const struct kvd_stats *row = s;
        bool first = true;
        KVD_STATS_FIELDS(JSON_FIELD)
    }
    JSON_ROWS("workers", s->workers, s->n_workers, KVD_WORKER_STATS_FIELDS);
    JSON_ROWS("tenants", s->tenants, s->n_tenants, KVD_TENANT_STATS_FIELDS);
    JSON_ROWS("hosts", s->hosts, s->n_hosts, KVD_HOST_STATS_FIELDS);
    printf("}\n");
}

static int cmd_stats(kvd_client_t *c, bool json, bool prometheus)
{
    struct kvd_stats s;
    int rc = kvd_stats(c, &s);
    if (rc != 0)
        return rc;
    if (prometheus) {
        char *text = kvd_stats_prometheus(&s);
        kvd_stats_free(&s);
        if (text == NULL)
            die("out of memory");
        fputs(text, stdout);
        free(text);
        return 0;
    }
    if (json) {
        print_stats_json(&s);
        kvd_stats_free(&s);
        return 0;
    }
    char bytes[32];
    double hit = s.prompt_tokens ? 100.0 * (double)s.cached_prompt_tokens / (double)s.prompt_tokens
                                 : 0.0;
    printf("requests  %llu running, %llu queued, %llu done, %llu failed\n",
           (unsigned long long)s.requests_running, (unsigned long long)s.requests_queued,
           (unsigned long long)s.requests_done, (unsigned long long)s.requests_failed);
    printf("tokens    %llu prompt, %llu of them cached (hit rate %.1f%%), %llu generated\n",
           (unsigned long long)s.prompt_tokens, (unsigned long long)s.cached_prompt_tokens, hit,
           (unsigned long long)s.completion_tokens);
    printf("blocks    %u of %u tokens (%s each): %u free, %u cached, %u in use, %u pending\n",
           s.blocks_total, s.block_tokens, kvd_format_bytes(s.block_bytes, bytes, sizeof(bytes)),
           s.blocks_free, s.blocks_cached, s.blocks_in_use, s.blocks_pending);
    printf("kv        %s, %llu bytes per token\n", s.kv_type[0] ? s.kv_type : "?",
           (unsigned long long)s.kv_bytes_per_token);
    if (s.kv_parts > 1)
        printf("parts     %u tables of %u layers, window %u: %u windowed blocks in use\n", s.kv_parts,
               s.kv_part_layers, s.kv_window, s.blocks_in_use_windowed);
    if (s.host_cache_max_bytes > 0) {
        char held[32], max[32];
        printf("host tier %s of %s, %llu blocks; %llu prompt tokens restored from it; %llu stored, "
               "%llu dropped, %llu corrupt, %llu left to compute\n",
               kvd_format_bytes(s.host_cache_bytes, held, sizeof(held)),
               kvd_format_bytes(s.host_cache_max_bytes, max, sizeof(max)), (unsigned long long)s.host_cache_blocks,
               (unsigned long long)s.host_cached_prompt_tokens, (unsigned long long)s.host_cache_stored,
               (unsigned long long)s.host_cache_dropped, (unsigned long long)s.host_cache_corrupt,
               (unsigned long long)s.host_cache_declined);
    }
    if (s.disk_cache_max_bytes > 0) {
        char held[32], max[32];
        printf("disk tier %s of %s, %llu blocks; %llu prompt tokens read from it; %llu written, %llu queued, "
               "%llu writes dropped, %llu corrupt, %llu of another model, %llu left to compute\n",
               kvd_format_bytes(s.disk_cache_bytes, held, sizeof(held)),
               kvd_format_bytes(s.disk_cache_max_bytes, max, sizeof(max)), (unsigned long long)s.disk_cache_blocks,
               (unsigned long long)s.disk_cached_prompt_tokens, (unsigned long long)s.disk_cache_written,
               (unsigned long long)s.disk_cache_pending, (unsigned long long)s.disk_cache_dropped_writes,
               (unsigned long long)s.disk_cache_corrupt, (unsigned long long)s.disk_cache_ignored,
               (unsigned long long)s.disk_cache_declined);
    }
    if (s.auth_client_keys > 0 || s.auth_clients_refused > 0 || s.auth_handshakes_failed > 0)
        printf("auth      %u client keys; %llu connections admitted, %llu refused; %llu workers refused; "
               "%llu handshakes failed\n",
               s.auth_client_keys, (unsigned long long)s.auth_clients_admitted,
               (unsigned long long)s.auth_clients_refused, (unsigned long long)s.auth_workers_refused,
               (unsigned long long)s.auth_handshakes_failed);
    for (uint32_t i = 0; i < s.n_tenants; i++) {
        const struct kvd_tenant_stats *t = &s.tenants[i];
        printf("tenant    %s: %llu requests, %llu prompt tokens (%llu cached), %u queued, %u running, "
               "%llu blocks held, %llu refused\n",
               t->name, (unsigned long long)t->requests, (unsigned long long)t->prompt_tokens,
               (unsigned long long)t->cached_prompt_tokens, t->queued, t->running,
               (unsigned long long)t->blocks_held, (unsigned long long)t->refused);
    }
    for (uint32_t i = 0; i < s.n_hosts && s.n_hosts > 1; i++) {
        const struct kvd_host_stats *h = &s.hosts[i];
        printf("host      %s: %u workers; %u blocks: %u free, %u cached, %u in use, %u fenced; %llu requests, "
               "%llu prompt tokens (%llu cached)\n",
               h->name[0] ? h->name : "(kvd's own)", h->workers, h->blocks_total, h->blocks_free,
               h->blocks_cached, h->blocks_in_use, h->blocks_fenced, (unsigned long long)h->requests,
               (unsigned long long)h->prompt_tokens, (unsigned long long)h->cached_prompt_tokens);
    }
    if (s.hosts_lost > 0)
        printf("hosts     %llu lost; %llu blocks fenced\n", (unsigned long long)s.hosts_lost,
               (unsigned long long)s.blocks_fenced_total);
    printf("events    %llu evictions, %llu preemptions, %llu bad messages\n",
           (unsigned long long)s.evictions, (unsigned long long)s.preemptions,
           (unsigned long long)s.bad_messages);
    for (uint32_t i = 0; i < s.n_workers; i++) {
        const struct kvd_worker_stats *w = &s.workers[i];
        printf("worker %-2u pid %d%s%s, %s, %u running, %llu tokens, %u restarts\n", w->id, w->pid,
               w->host[0] ? " on host " : "", w->host, w->alive ? "alive" : "dead", w->running,
               (unsigned long long)w->tokens, w->restarts);
    }
    kvd_stats_free(&s);
    return 0;
}

/* Reports a failed stats or health call (no message from kvd comes with them). */
static void die_simple(int rc, const char *endpoint, int timeout_ms)
{
    if (rc == KVD_ETIMEOUT)
        die("no reply from kvd at %s in %d ms (is it running?)", endpoint,
            timeout_ms > 0 ? timeout_ms : 30000);
    die("%s", kvd_strerror(rc));
}

/* ---- kvcli cache ------------------------------------------------------------------------ */

struct cache_opts {
    const char *op;             /* list, pin, unpin, evict */
    const char *ns;             /* --namespace */
    const char *pin_id;         /* unpin, evict */
    uint32_t ttl_s;             /* pin: --ttl (default 5m) */
    uint32_t pin_messages;      /* pin: --pin-messages */
    const char *msg_file, *prompt_file, *prompt;
    bool json;
};

/* --ttl: "5m", "1h" (Anthropic's) or whole seconds. */
static uint32_t parse_ttl(const char *s)
{
    if (strcmp(s, "5m") == 0)
        return 300;
    if (strcmp(s, "1h") == 0)
        return 3600;
    return (uint32_t)parse_int(s, "--ttl (5m, 1h or seconds)", 1, 604800);
}

static void print_pin(const struct kvd_pin *p, bool json, uint32_t blocks_evicted, bool evicted)
{
    if (json) {
        printf("{\"id\":\"%s\",\"tenant\":", p->id);
        json_str(stdout, p->tenant, strlen(p->tenant));
        printf(",\"namespace\":");
        json_str(stdout, p->ns, strlen(p->ns));
        printf(",\"tokens\":%u,\"blocks\":%u,\"hits\":%llu,\"ttl_s\":%u,\"created_unix_ms\":%llu,"
               "\"expires_unix_ms\":%llu", p->tokens, p->blocks, (unsigned long long)p->hits, p->ttl_s,
               (unsigned long long)p->created_unix_ms, (unsigned long long)p->expires_unix_ms);
        if (evicted)
            printf(",\"blocks_evicted\":%u", blocks_evicted);
        printf("}");
        return;
    }
    const time_t exp = (time_t)(p->expires_unix_ms / 1000);
    struct tm tm;
    char when[32] = "?";
    if (gmtime_r(&exp, &tm) != NULL)
        strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
    printf("%s  %u tokens, %u blocks, %llu hits, ttl %u s, expires %s", p->id, p->tokens, p->blocks,
           (unsigned long long)p->hits, p->ttl_s, when);
    if (p->tenant[0] || p->ns[0])
        printf(", tenant %s, namespace %s", p->tenant[0] ? p->tenant : "-", p->ns[0] ? p->ns : "-");
    if (evicted)
        printf(", %u blocks evicted", blocks_evicted);
}

/* Parses `cache OP`'s options (argv[0] is "cache", argv[1] the operation). */
static void parse_cache(int argc, char **argv, struct options *o, struct cache_opts *co)
{
    static const struct option longs[] = {
        { "namespace", required_argument, NULL, OPT_NS },
        { "json", no_argument, NULL, OPT_JSON },
        { "ttl", required_argument, NULL, OPT_TTL },
        { "messages-file", required_argument, NULL, OPT_MSGFILE },
        { "prompt-file", required_argument, NULL, OPT_PROMPTFILE },
        { "pin-messages", required_argument, NULL, OPT_PINMSGS },
        { "endpoint", required_argument, NULL, 'e' },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    if (argc < 2)
        die_usage("cache needs list, pin, unpin or evict");
    co->op = argv[1];
    const bool pin = strcmp(co->op, "pin") == 0, list = strcmp(co->op, "list") == 0;
    if (!pin && !list && strcmp(co->op, "unpin") != 0 && strcmp(co->op, "evict") != 0)
        die_usage("cache: unknown operation '%s' (list, pin, unpin or evict)", co->op);
    co->ttl_s = 300;
    optind = 0;
    int c;
    bool ttl_set = false, pm_set = false;
    while ((c = getopt_long(argc - 1, argv + 1, ":e:h", longs, NULL)) != -1) {
        switch (c) {
        case 'e': o->endpoint = optarg; break;
        case OPT_TIMEOUT: o->timeout_ms = parse_timeout(optarg); break;
        case OPT_NS: co->ns = optarg; break;
        case OPT_JSON: co->json = true; break;
        case OPT_TTL: co->ttl_s = parse_ttl(optarg); ttl_set = true; break;
        case OPT_MSGFILE: co->msg_file = optarg; break;
        case OPT_PROMPTFILE: co->prompt_file = optarg; break;
        case OPT_PINMSGS:
            co->pin_messages = (uint32_t)parse_int(optarg, "--pin-messages", 1, 1024);
            pm_set = true;
            break;
        case 'h': usage(stdout); exit(0);
        case ':': die_usage("option %s needs a value", argv[optind]);
        default: die_usage("unknown option %s", argv[optind]);
        }
    }
    const int left = argc - 1 - optind;
    char **rest = argv + 1 + optind;
    if (!pin && (ttl_set || co->msg_file || co->prompt_file || pm_set))
        die_usage("cache %s takes no --ttl, --messages-file, --prompt-file or --pin-messages", co->op);
    if (list && left > 0)
        die_usage("cache list: unexpected argument '%s'", rest[0]);
    if (!pin && !list) {
        if (left != 1)
            die_usage("cache %s needs one PIN_ID", co->op);
        co->pin_id = rest[0];
    }
    if (pin) {
        const int forms = (co->msg_file != NULL) + (co->prompt_file != NULL) + (left > 0);
        if (forms != 1)
            die_usage("cache pin needs one of --messages-file, --prompt-file and PROMPT");
        if (left > 1)
            die_usage("cache pin: unexpected argument '%s' (quote the prompt)", rest[1]);
        if (pm_set && co->msg_file == NULL)
            die_usage("--pin-messages needs --messages-file");
        co->prompt = left > 0 ? rest[0] : NULL;
    }
}

/* A messages file: a JSON array of {"role": ..., "content": "..."}; any other
 * field is refused by name. The messages point into *root (keep it). */
static struct kvd_chat_msg *read_messages(const char *path, json_t **root, size_t *n)
{
    json_error_t je;
    *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (*root == NULL)
        die("%s: not JSON: %s (line %d)", path, je.text, je.line);
    if (!json_is_array(*root) || json_array_size(*root) == 0)
        die("%s: want a non-empty JSON array of messages", path);
    *n = json_array_size(*root);
    struct kvd_chat_msg *m = calloc(*n, sizeof(*m));
    if (m == NULL)
        die("out of memory");
    size_t i;
    json_t *e;
    json_array_foreach(*root, i, e) {
        const char *k;
        json_t *v;
        json_object_foreach(e, k, v)
            if (strcmp(k, "role") != 0 && strcmp(k, "content") != 0)
                die("%s: message %zu: field '%s' is not supported (role, content)", path, i, k);
        m[i].role = json_string_value(json_object_get(e, "role"));
        m[i].content = json_string_value(json_object_get(e, "content"));
        if (m[i].role == NULL || m[i].content == NULL)
            die("%s: message %zu needs a \"role\" and a \"content\" string", path, i);
    }
    return m;
}

/* cache pin: the prompt computed into the cache (nothing generated) and pinned. */
static int cache_pin(kvd_client_t *c, const struct cache_opts *co)
{
    struct kvd_gen_params gp;
    kvd_gen_params_init(&gp);
    json_t *root = NULL;
    struct kvd_chat_msg *msgs = NULL;
    char *text = NULL;
    if (co->msg_file != NULL) {
        msgs = read_messages(co->msg_file, &root, &gp.n_messages);
        gp.messages = msgs;
        if (co->pin_messages > gp.n_messages)
            die_usage("--pin-messages %u, but %s holds %zu messages", co->pin_messages, co->msg_file,
                      gp.n_messages);
        gp.pin_messages = co->pin_messages;
    } else {
        gp.prompt = co->prompt != NULL ? co->prompt : (text = read_file(co->prompt_file));
    }
    gp.ns = co->ns;
    gp.prefill_only = true;
    gp.pin_ttl_s = co->ttl_s;
    struct kvd_result r;
    const int rc = kvd_generate(c, &gp, &r);
    free(msgs);
    free(text);
    json_decref(root);
    if (rc != 0)
        die_call(rc, r.error, r.retry_after_ms);
    if (!r.has_pin) {
        fprintf(stderr, "%s: not pinned: %s\n", prog, r.pin_error[0] ? r.pin_error : "kvd made no pin");
        kvd_result_free(&r);
        return 1;
    }
    if (co->json) {
        printf("{\"pin\":");
        print_pin(&r.pin, true, 0, false);
        printf(",\"usage\":{\"prompt_tokens\":%u,\"cached_prompt_tokens\":%u,\"cache_creation_tokens\":%u,"
               "\"cached_blocks\":%u}}\n", r.prompt_tokens, r.cached_prompt_tokens, r.cache_creation_tokens,
               r.cached_blocks);
    } else {
        print_pin(&r.pin, false, 0, false);
        printf("\n");
    }
    kvd_result_free(&r);
    return 0;
}

static int cmd_cache(kvd_client_t *c, const struct cache_opts *co)
{
    char err[256] = "";
    int rc;
    if (strcmp(co->op, "pin") == 0)
        return cache_pin(c, co);
    if (strcmp(co->op, "list") == 0) {
        struct kvd_pin *pins = NULL;
        size_t n = 0;
        if ((rc = kvd_cache_list(c, co->ns, &pins, &n, err, sizeof(err))) != 0)
            die_call(rc, err, 0);
        if (co->json)
            printf("[");
        for (size_t i = 0; i < n; i++) {
            if (co->json && i)
                printf(",");
            print_pin(&pins[i], co->json, 0, false);
            if (!co->json)
                printf("\n");
        }
        if (co->json)
            printf("]\n");
        free(pins);
        return 0;
    }
    struct kvd_pin gone;
    uint32_t blocks = 0;
    const bool evict = strcmp(co->op, "evict") == 0;
    rc = evict ? kvd_cache_evict(c, co->ns, co->pin_id, &gone, &blocks, err, sizeof(err))
               : kvd_cache_unpin(c, co->ns, co->pin_id, &gone, err, sizeof(err));
    if (rc == KVD_ENOTFOUND)
        die("no pin %s%s%s", co->pin_id, co->ns ? " in namespace " : "", co->ns ? co->ns : "");
    if (rc != 0)
        die_call(rc, err, 0);
    print_pin(&gone, co->json, blocks, evict);
    printf("\n");
    return 0;
}

/* kvcli cache ...: parse, connect, run. */
static int cache_main(int argc, char **argv, struct options *o)
{
    struct cache_opts co = { 0 };
    parse_cache(argc, argv, o, &co);
    char endpoint[512], err[256];
    if (o->endpoint == NULL)
        o->endpoint = kvd_default_endpoint(endpoint, sizeof(endpoint));
    kvd_client_t *c = kvd_client_new(o->endpoint, o->timeout_ms, err, sizeof(err));
    if (c == NULL)
        die("%s", err);
    const int status = cmd_cache(c, &co);
    kvd_client_destroy(&c);
    return status;
}

int main(int argc, char **argv)
{
    struct options o;
    cli_init(prog);
    memset(&o, 0, sizeof(o));
    o.stream = true;
    kvd_gen_params_init(&o.gp);
    int ci = parse_global(argc, argv, &o);
    const char *cmd = argv[ci];
    if (strcmp(cmd, "cache") == 0)
        return cache_main(argc - ci, argv + ci, &o);
    if (strcmp(cmd, "generate") == 0)
        parse_generate(argc - ci, argv + ci, &o);
    else if (strcmp(cmd, "stats") == 0 || strcmp(cmd, "health") == 0)
        parse_simple(argc - ci, argv + ci, &o);
    else
        die_usage("unknown command '%s' (generate, stats, health or cache)", cmd);

    char endpoint[512];
    if (o.endpoint == NULL)
        o.endpoint = kvd_default_endpoint(endpoint, sizeof(endpoint));
    char err[256];
    kvd_client_t *c = kvd_client_new(o.endpoint, o.timeout_ms, err, sizeof(err));
    if (c == NULL)
        die("%s", err);

    int status;
    if (strcmp(cmd, "generate") == 0) {
        status = cmd_generate(c, &o);
    } else if (strcmp(cmd, "stats") == 0) {
        int rc = cmd_stats(c, o.json, o.prometheus);
        if (rc != 0)
            die_simple(rc, o.endpoint, o.timeout_ms);
        status = 0;
    } else {
        bool ok = false;
        uint32_t alive = 0;
        int rc = kvd_health(c, &ok, &alive);
        if (rc != 0)
            die_simple(rc, o.endpoint, o.timeout_ms);
        printf("%s (%u worker%s alive)\n", ok ? "ok" : "not ok", alive, alive == 1 ? "" : "s");
        status = ok ? 0 : 1;
    }
    kvd_client_destroy(&c);
    free(o.system_buf);
    free(o.prompt_buf);
    free(o.ids);
    return status;
}
