/*
 * kvd_run.c - kvd-run, the single-process front end of the engine.
 *
 * Loads a GGUF model, tokenizes a prompt (optionally through the model's chat
 * template), runs it over a paged KV cache and prints the continuation; or
 * prints token ids (--tokenize), the perplexity of a file (--perplexity), or
 * the log-probability of a continuation after a context (--score).
 * Every bad argument or input ends with one line on stderr and exit status 1.
 */
#include <assert.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chat.h"
#include "cli.h"
#include "cpu.h"
#include "err.h"
#include "f16.h"
#include "forward.h"
#include "kvcache.h"
#include "model.h"
#include "pool.h"
#include "prefix.h"
#include "sampler.h"
#include "tok.h"
#include "units.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define MAX_STOPS 8
#define MAX_SCORES 4096         /* --score pairs in one run */

struct options {
    const char *model;          /* -m */
    const char *prompt;         /* -p, or --file contents */
    char *prompt_buf;           /* owned copy read from --file */
    int32_t *prompt_ids;        /* --prompt-ids */
    size_t n_prompt_ids;
    const char *pool;           /* --pool NAME: a shared, persistent KV pool */
    const char *ns;             /* --namespace */
    uint64_t kv_bytes;          /* --kv-memory */
    const char *logits_out;     /* --logits-out FILE */
    const char *system;         /* --system / --system-file contents */
    char *system_buf;           /* owned copy read from --system-file */
    const char *tokenize;       /* --tokenize TEXT */
    const char *ppl_file;       /* --perplexity FILE */
    const char *kld_base;       /* --kl-divergence-base FILE: save the log-probabilities */
    const char *kld;            /* --kl-divergence FILE: compare with those saved */
    int chunks;                 /* --chunks: windows of the perplexity text (0: all) */
    const char *stops[MAX_STOPS]; /* --stop */
    int n_stops;
    int n_predict;              /* -n */
    int n_ctx;                  /* --ctx: context (generation) or window (perplexity) */
    int n_threads;              /* -t */
    int block_tokens;           /* --block-tokens */
    struct kv_params kv;        /* --kv-type, --k-type, --v-type, --kv-rotate: types, rotation */
    const char *kv_flags[4];    /* the values of those four flags as given (NULL: not given) */
    bool chat;                  /* --chat */
    bool json;                  /* --json */
    bool special;               /* --special */
    bool ignore_eos;            /* --ignore-eos */
    bool bench;                 /* --bench */
    const char *bench_file;     /* --bench-file: the text the benchmark's prompts come from */
    int bench_ctx;              /* --bench-ctx N: decode after N tokens of context instead */
    bool seed_set;
    struct sampler_params sp;
    int overflow;               /* --context-overflow: OVERFLOW_* */
    bool overflow_set;
    int sinks;                  /* --sinks: first tokens a window keeps (default 4) */
    const char *ppl_stream;     /* --perplexity-stream FILE */
    const char **score_ctx;     /* --score TEXT, in order (MAX_SCORES) */
    const char **score_cont;    /* --continuation TEXT, paired with them in order */
    int n_score_ctx, n_score_cont;
};

enum { OVERFLOW_STOP, OVERFLOW_WINDOW, OVERFLOW_RESTART };

static void usage(FILE *f)
{
    fputs("usage: kvd-run [-m MODEL] -p PROMPT [options]\n"
          "       kvd-run [-m MODEL] --tokenize TEXT [--special]\n"
          "       kvd-run [-m MODEL] --perplexity FILE [--ctx N]\n"
          "       kvd-run [-m MODEL] --perplexity-stream FILE [--ctx N] [--context-overflow M]\n"
          "       kvd-run [-m MODEL] --score CONTEXT --continuation TEXT [--score ...]\n"
          "       kvd-run [-m MODEL] --bench [--bench-file FILE] [-t N] [--json]\n"
          "\n"
          "  -m, --model FILE       GGUF model (default " DEFAULT_MODEL ")\n"
          "  -p, --prompt TEXT      prompt to continue\n"
          "  -f, --file FILE        prompt read from a file\n"
          "      --prompt-ids LIST  prompt as token ids (\"1,2,3\"; no BOS added)\n"
          "  -n, --n-predict N      tokens to generate (default 256)\n"
          "      --chat             wrap the prompt in the model's chat template\n"
          "      --system TEXT      system message (with --chat)\n"
          "      --system-file F    system message read from a file (with --chat)\n"
          "      --temp T           temperature, 0 = greedy (default 0.8)\n"
          "      --top-k K          (default 40, 0 = off)\n"
          "      --top-p P          (default 0.95, 1 = off)\n"
          "      --min-p P          (default 0.05, 0 = off)\n"
          "      --repeat-penalty R (default 1.0 = off)\n"
          "      --seed S           sampling seed (default: random)\n"
          "      --stop STR         stop when STR is generated (repeatable)\n"
          "      --ignore-eos       keep generating past end-of-generation tokens\n"
          "  -c, --ctx N            context length (default 4096, at most the model's);\n"
          "                         with --perplexity the window (default 512)\n"
          "  -t, --threads N        threads (default: all CPUs)\n"
          "      --block-tokens N   KV block size in tokens (default 16)\n"
          KV_FLAGS_HELP
          "      --kv-memory SIZE   KV pool size (\"512MiB\", \"2G\"; default: one context)\n"
          "      --pool NAME        keep the KV pool in shared memory under NAME: a later\n"
          "                         run with the same model and pool reuses its cached\n"
          "                         prompt prefixes (prints how many tokens it skipped)\n"
          "      --namespace NS     prefix-cache namespace (default \"\")\n"
          "      --logits-out FILE  write the last prompt token's logits (f32) to FILE\n"
          "      --json             print one JSON object instead of the text\n"
          "      --tokenize TEXT    print TEXT's token ids as a JSON array\n"
          "      --special          parse special tokens in the text (--tokenize, -p)\n"
          "      --perplexity FILE  print the perplexity of FILE\n"
          "      --chunks N         score only the first N windows of it\n"
          "      --score CONTEXT    with --continuation TEXT (repeatable, paired in order):\n"
          "                         print a JSON line per pair with the continuation's\n"
          "                         tokens, their log-probabilities after the context and\n"
          "                         the rest of them, their sum and whether each was the\n"
          "                         likeliest (lm-eval's loglikelihood)\n"
          "      --continuation TEXT  the text scored after the last --score's context\n"
          "      --kl-divergence-base OUT  with --perplexity: save every scored position's\n"
          "                         log-probabilities (f16) to OUT\n"
          "      --kl-divergence BASE  with --perplexity: KL divergence, same-top-token share\n"
          "                         and perplexity against BASE (e.g. another --kv-type)\n"
          "      --context-overflow stop|window  what a sequence that reaches --ctx does:\n"
          "                         stop (the default), or window: keep the first --sinks\n"
          "                         tokens (whole blocks) and the newer half of the rest,\n"
          "                         the keys moved to their new positions, and go on\n"
          "      --sinks N          tokens a window keeps from the start (default 4;\n"
          "                         rounded up to whole KV blocks; 0: none)\n"
          "      --perplexity-stream FILE  the perplexity of every token of FILE in one\n"
          "                         sequence fed 64 tokens a step, past --ctx (default 512)\n"
          "                         by --context-overflow window (the default here) or\n"
          "                         restart (an empty cache from the next token on)\n"
          "      --bench            measure prefill (512 tokens), decode at batch 1 (128\n"
          "                         tokens after that prefill, and from an empty context)\n"
          "                         and aggregate decode at batch 1, 8 and 32\n"
          "      --bench-file F     text the benchmark prompts are cut from\n"
          "      --bench-ctx N      with --bench: decode at batch 1 and 8 after N tokens\n"
          "                         of context instead (the KV types' cost)\n",
          f);
}

static float parse_float(const char *s, const char *what)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end != '\0' || !isfinite(v))
        cli_die("%s must be a number, got '%s'", what, s);
    return v;
}

/* Reads a whole file into a NUL-terminated buffer; dies on failure. */
static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        cli_die("cannot open %s: %s", path, strerror(errno));
    char *buf = cli_read_stream(f, path, 1u << 30, len);
    fclose(f);
    return buf;
}

enum {
    OPT_TEMP = 256, OPT_TOPK, OPT_TOPP, OPT_MINP, OPT_REPEAT, OPT_SEED, OPT_STOP, OPT_CHAT,
    OPT_SYSTEM, OPT_SYSTEM_FILE, OPT_JSON, OPT_TOKENIZE, OPT_SPECIAL, OPT_PPL, OPT_BLOCK,
    OPT_KVTYPE, OPT_KTYPE, OPT_VTYPE, OPT_ROTATE, OPT_CHUNKS, OPT_KLD_BASE, OPT_KLD, OPT_IGNORE_EOS, OPT_BENCH, OPT_BENCH_FILE, OPT_BENCH_CTX, OPT_PROMPT_IDS, OPT_POOL, OPT_NS,
    OPT_KVMEM, OPT_LOGITS_OUT, OPT_OVERFLOW, OPT_SINKS, OPT_PPL_STREAM, OPT_SCORE, OPT_CONT,
};

/* Parses "1,2,3" (commas and/or white space) into a new array; dies on error. */
static int32_t *parse_ids(const char *s, size_t *n)
{
    size_t cap = 16, k = 0;
    int32_t *ids = malloc(cap * sizeof(int32_t));
    while (ids != NULL) {
        while (*s == ',' || *s == ' ' || *s == '\n' || *s == '\t')
            s++;
        if (*s == '\0')
            break;
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (errno || end == s || v < 0 || v > INT32_MAX)
            cli_die("--prompt-ids: '%.20s' is not a token id", s);
        if (k == cap)
            ids = realloc(ids, (cap *= 2) * sizeof(int32_t));
        if (ids != NULL)
            ids[k++] = (int32_t)v;
        s = end;
    }
    if (ids == NULL)
        cli_die("out of memory");
    *n = k;
    return ids;
}

static void parse_args(int argc, char **argv, struct options *o)
{
    static const struct option longs[] = {
        { "model", required_argument, NULL, 'm' },
        { "prompt", required_argument, NULL, 'p' },
        { "n-predict", required_argument, NULL, 'n' },
        { "ctx", required_argument, NULL, 'c' },
        { "threads", required_argument, NULL, 't' },
        { "help", no_argument, NULL, 'h' },
        { "temp", required_argument, NULL, OPT_TEMP },
        { "top-k", required_argument, NULL, OPT_TOPK },
        { "top-p", required_argument, NULL, OPT_TOPP },
        { "min-p", required_argument, NULL, OPT_MINP },
        { "repeat-penalty", required_argument, NULL, OPT_REPEAT },
        { "seed", required_argument, NULL, OPT_SEED },
        { "stop", required_argument, NULL, OPT_STOP },
        { "chat", no_argument, NULL, OPT_CHAT },
        { "system", required_argument, NULL, OPT_SYSTEM },
        { "system-file", required_argument, NULL, OPT_SYSTEM_FILE },
        { "json", no_argument, NULL, OPT_JSON },
        { "tokenize", required_argument, NULL, OPT_TOKENIZE },
        { "special", no_argument, NULL, OPT_SPECIAL },
        { "perplexity", required_argument, NULL, OPT_PPL },
        { "chunks", required_argument, NULL, OPT_CHUNKS },
        { "kl-divergence-base", required_argument, NULL, OPT_KLD_BASE },
        { "kl-divergence", required_argument, NULL, OPT_KLD },
        { "block-tokens", required_argument, NULL, OPT_BLOCK },
        { "kv-type", required_argument, NULL, OPT_KVTYPE },
        { "k-type", required_argument, NULL, OPT_KTYPE },
        { "v-type", required_argument, NULL, OPT_VTYPE },
        { "kv-rotate", required_argument, NULL, OPT_ROTATE },
        { "ignore-eos", no_argument, NULL, OPT_IGNORE_EOS },
        { "bench", no_argument, NULL, OPT_BENCH },
        { "bench-file", required_argument, NULL, OPT_BENCH_FILE },
        { "bench-ctx", required_argument, NULL, OPT_BENCH_CTX },
        { "file", required_argument, NULL, 'f' },
        { "prompt-ids", required_argument, NULL, OPT_PROMPT_IDS },
        { "pool", required_argument, NULL, OPT_POOL },
        { "namespace", required_argument, NULL, OPT_NS },
        { "kv-memory", required_argument, NULL, OPT_KVMEM },
        { "logits-out", required_argument, NULL, OPT_LOGITS_OUT },
        { "context-overflow", required_argument, NULL, OPT_OVERFLOW },
        { "sinks", required_argument, NULL, OPT_SINKS },
        { "perplexity-stream", required_argument, NULL, OPT_PPL_STREAM },
        { "score", required_argument, NULL, OPT_SCORE },
        { "continuation", required_argument, NULL, OPT_CONT },
        { NULL, 0, NULL, 0 },
    };
    memset(o, 0, sizeof(*o));
    o->model = getenv("KVD_MODEL") ? getenv("KVD_MODEL") : DEFAULT_MODEL;
    o->n_predict = 256;
    o->block_tokens = 16;
    o->sp = sampler_default_params();
    o->ns = "";
    o->sinks = 4;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, ":m:p:f:n:c:t:h", longs, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'p': o->prompt = optarg; break;
        case 'f': {
            size_t len;
            free(o->prompt_buf);
            o->prompt_buf = read_file(optarg, &len);
            o->prompt = o->prompt_buf;
            break;
        }
        case OPT_PROMPT_IDS:
            free(o->prompt_ids);
            o->prompt_ids = parse_ids(optarg, &o->n_prompt_ids);
            if (o->n_prompt_ids == 0)
                cli_die("--prompt-ids holds no ids");
            break;
        case OPT_POOL: o->pool = optarg; break;
        case OPT_NS: o->ns = optarg; break;
        case OPT_KVMEM:
            if (kvd_parse_size(optarg, &o->kv_bytes) != 0 || o->kv_bytes == 0)
                cli_die("--kv-memory must be a size such as 512MiB or 2G, got '%s'", optarg);
            break;
        case OPT_LOGITS_OUT: o->logits_out = optarg; break;
        case OPT_OVERFLOW:
            if (strcmp(optarg, "stop") == 0)
                o->overflow = OVERFLOW_STOP;
            else if (strcmp(optarg, "window") == 0)
                o->overflow = OVERFLOW_WINDOW;
            else if (strcmp(optarg, "restart") == 0)
                o->overflow = OVERFLOW_RESTART;
            else
                cli_die("--context-overflow takes stop, window or restart, got '%s'", optarg);
            o->overflow_set = true;
            break;
        case OPT_SINKS: o->sinks = (int)cli_long(optarg, "--sinks", 0, 1 << 20); break;
        case OPT_PPL_STREAM: o->ppl_stream = optarg; break;
        case 'n': o->n_predict = (int)cli_long(optarg, "-n", 0, 1 << 20); break;
        case 'c': o->n_ctx = (int)cli_long(optarg, "--ctx", 8, 1 << 20); break;
        case 't': o->n_threads = (int)cli_long(optarg, "-t", 1, 256); break;
        case 'h': usage(stdout); exit(0);
        case OPT_TEMP: o->sp.temperature = parse_float(optarg, "--temp"); break;
        case OPT_TOPK: o->sp.top_k = (int32_t)cli_long(optarg, "--top-k", 0, 1 << 24); break;
        case OPT_TOPP: o->sp.top_p = parse_float(optarg, "--top-p"); break;
        case OPT_MINP: o->sp.min_p = parse_float(optarg, "--min-p"); break;
        case OPT_REPEAT: o->sp.repeat_penalty = parse_float(optarg, "--repeat-penalty"); break;
        case OPT_SEED:
            o->sp.seed = (uint64_t)cli_long(optarg, "--seed", 0, 0x7fffffffffffffffL);
            o->seed_set = true;
            break;
        case OPT_STOP:
            if (o->n_stops == MAX_STOPS)
                cli_die("at most %d --stop strings", MAX_STOPS);
            if (optarg[0] == '\0')
                cli_die("--stop needs a non-empty string");
            o->stops[o->n_stops++] = optarg;
            break;
        case OPT_CHAT: o->chat = true; break;
        case OPT_SYSTEM: o->system = optarg; break;
        case OPT_SYSTEM_FILE: {
            size_t len;
            free(o->system_buf);
            o->system_buf = read_file(optarg, &len);
            o->system = o->system_buf;
            break;
        }
        case OPT_JSON: o->json = true; break;
        case OPT_TOKENIZE: o->tokenize = optarg; break;
        case OPT_SPECIAL: o->special = true; break;
        case OPT_PPL: o->ppl_file = optarg; break;
        case OPT_CHUNKS: o->chunks = (int)cli_long(optarg, "--chunks", 1, 1 << 20); break;
        case OPT_KLD_BASE: o->kld_base = optarg; break;
        case OPT_KLD: o->kld = optarg; break;
        case OPT_BLOCK: o->block_tokens = (int)cli_long(optarg, "--block-tokens", 1, 4096); break;
        case OPT_KVTYPE: o->kv_flags[0] = optarg; break;
        case OPT_KTYPE: o->kv_flags[1] = optarg; break;
        case OPT_VTYPE: o->kv_flags[2] = optarg; break;
        case OPT_ROTATE: o->kv_flags[3] = optarg; break;
        case OPT_IGNORE_EOS: o->ignore_eos = true; break;
        case OPT_BENCH: o->bench = true; break;
        case OPT_BENCH_FILE: o->bench_file = optarg; break;
        case OPT_BENCH_CTX: o->bench_ctx = (int)cli_long(optarg, "--bench-ctx", 16, 1 << 20); break;
        case OPT_SCORE:
        case OPT_CONT: {
            const char ***list = c == OPT_SCORE ? &o->score_ctx : &o->score_cont;
            int *n = c == OPT_SCORE ? &o->n_score_ctx : &o->n_score_cont;
            if (*n == MAX_SCORES)
                cli_die("at most %d --score pairs", MAX_SCORES);
            if (*list == NULL && (*list = calloc(MAX_SCORES, sizeof(**list))) == NULL)
                cli_die("out of memory");
            (*list)[(*n)++] = optarg;
            break;
        }
        case ':': cli_die("option %s needs a value", argv[optind - 1]);
        default: cli_die("unknown option %s (see --help)", argv[optind - 1]);
        }
    }
    if (optind < argc)
        cli_die("unexpected argument '%s' (see --help)", argv[optind]);
    char kv_err[256];
    if (kv_params_from_flags(&o->kv, o->kv_flags[0], o->kv_flags[1], o->kv_flags[2], o->kv_flags[3],
                             kv_err, sizeof(kv_err)) != 0)
        cli_die("%s", kv_err);
    if (o->prompt != NULL && o->prompt_ids != NULL)
        cli_die("-p/--file and --prompt-ids exclude each other");
    if (o->prompt_ids != NULL && o->chat)
        cli_die("--prompt-ids and --chat exclude each other");
    int modes = (o->prompt != NULL || o->prompt_ids != NULL) + (o->tokenize != NULL) + (o->ppl_file != NULL) +
                (o->ppl_stream != NULL) + o->bench + (o->n_score_ctx > 0 || o->n_score_cont > 0);
    if (modes == 0)
        cli_die("nothing to do: give -p PROMPT, -f FILE, --prompt-ids, --tokenize TEXT, --perplexity FILE, "
                "--perplexity-stream FILE or --bench (see --help)");
    if (modes > 1)
        cli_die("-p, --tokenize, --perplexity, --perplexity-stream, --score and --bench exclude each other");
    if (o->n_score_ctx != o->n_score_cont)
        cli_die("every --score CONTEXT needs its --continuation TEXT (%d and %d given)", o->n_score_ctx,
                o->n_score_cont);
    for (int i = 0; i < o->n_score_cont; i++)
        if (o->score_cont[i][0] == '\0')
            cli_die("--continuation needs a non-empty text");
    if (o->overflow_set && o->prompt == NULL && o->prompt_ids == NULL && o->ppl_stream == NULL)
        cli_die("--context-overflow goes with a prompt or --perplexity-stream");
    if (o->overflow == OVERFLOW_RESTART && o->ppl_stream == NULL)
        cli_die("--context-overflow restart is for --perplexity-stream (a comparison); generation takes "
                "stop or window");
    if (o->ppl_stream != NULL && !o->overflow_set)
        o->overflow = OVERFLOW_WINDOW;
    if (o->bench_ctx > 0 && !o->bench)
        cli_die("--bench-ctx goes with --bench");
    if ((o->kld_base != NULL || o->kld != NULL) && o->ppl_file == NULL)
        cli_die("--kl-divergence-base and --kl-divergence need --perplexity FILE");
    if (o->kld_base != NULL && o->kld != NULL)
        cli_die("--kl-divergence-base and --kl-divergence exclude each other");
    if (o->system != NULL && !o->chat)
        cli_die("--system and --system-file need --chat");
    if (!o->seed_set)
        o->sp.seed = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
}

/* ---- JSON output ------------------------------------------------------------------ */

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
            if (c < 0x20)
                fprintf(f, "\\u%04x", c);
            else
                fputc(c, f);
        }
    }
    fputc('"', f);
}

static void json_ids(FILE *f, const int32_t *ids, size_t n)
{
    fputc('[', f);
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%s%d", i ? "," : "", ids[i]);
    fputc(']', f);
}

/* ---- tokenization ------------------------------------------------------------------ */

/* Tokenizes text into a new array; dies on error. */
static int32_t *encode(const tok_t *t, const char *text, size_t len, bool special, size_t *n)
{
    size_t cap = len + 16;
    int32_t *ids = malloc(cap * sizeof(int32_t));
    if (ids == NULL)
        cli_die("out of memory");
    int rc = tok_encode(t, text, len, special, ids, cap, n);
    if (rc == KVD_ERANGE) {
        cap = *n;
        ids = realloc(ids, cap * sizeof(int32_t));
        if (ids == NULL)
            cli_die("out of memory");
        rc = tok_encode(t, text, len, special, ids, cap, n);
    }
    if (rc != 0)
        cli_die("cannot tokenize the text: %s", kvd_strerror(rc));
    return ids;
}

/* ---- the runtime: model, pool, prefix cache, engine ---------------------------------- */

struct runtime {
    model_t *model;
    tok_t *tok;
    pool_t *pool;           /* the KV pool: anonymous, or shared under --pool */
    prefix_t *px;           /* its allocator and prefix index */
    kvcache_t *kv;          /* the pool's KV data as the engine addresses it */
    engine_t *engine;
    uint32_t n_ctx;         /* context in effect */
    uint32_t step;          /* most tokens per step */
    double load_ms;
};

/* Loads the model for a context of n_ctx_req positions per sequence, over a KV
 * pool of --kv-memory bytes, or else of kv_positions positions (0: one
 * sequence's context). */
static void runtime_open(struct runtime *rt, const struct options *o, uint32_t n_ctx_req,
                         uint32_t kv_positions)
{
    char err[512], note[512];
    double t0 = cli_now_ms();
    memset(rt, 0, sizeof(*rt));
    rt->model = model_load(o->model, err, sizeof(err));
    if (rt->model == NULL)
        cli_die("%s", err);
    rt->tok = tok_new_from_gguf(rt->model->gguf, err, sizeof(err));
    if (rt->tok == NULL)
        cli_die("%s", err);
    const struct model_config *c = &rt->model->cfg;
    if (n_ctx_req > c->n_ctx_train)
        cli_die("context %u is longer than the model's %u", n_ctx_req, c->n_ctx_train);
    rt->n_ctx = n_ctx_req;
    rt->step = rt->n_ctx < 512 ? rt->n_ctx : 512;

    struct pool_layout lay;
    kv_pool_layout(rt->model, (uint32_t)o->block_tokens, o->kv.k_type, o->kv.v_type, o->kv.rotate,
                          o->pool != NULL, &lay); /* only a shared pool needs the model's identity */
    struct pool_params pp = pool_default_params();
    pp.name = o->pool;
    pp.reuse = true;
    pp.kv_bytes = o->kv_bytes;
    if (kv_positions < rt->n_ctx)
        kv_positions = rt->n_ctx;
    /* every part holds a whole prompt's blocks until its chunks are written */
    pp.n_blocks = (kv_positions + lay.block_tokens - 1) / lay.block_tokens * lay.parts.n_parts;
    struct pool_capacity cap;
    if (pool_plan(&lay, &pp, &cap, err, sizeof(err)) != 0)
        cli_die("%s", err);
    if (cap.n_blocks / lay.parts.n_parts < (rt->n_ctx + lay.block_tokens - 1) / lay.block_tokens)
        cli_die("a KV pool of %llu bytes holds %llu tokens, fewer than one sequence of %u; "
            "raise --kv-memory or lower --ctx", (unsigned long long)o->kv_bytes,
            (unsigned long long)cap.n_tokens / lay.parts.n_parts, rt->n_ctx);
    rt->pool = pool_create(&lay, &pp, note, sizeof(note), err, sizeof(err));
    if (rt->pool == NULL)
        cli_die("%s", err);
    if (note[0])
        fprintf(stderr, "kvd-run: %s\n", note);
    rt->px = prefix_new(rt->pool, note, sizeof(note), err, sizeof(err));
    if (rt->px == NULL)
        cli_die("%s", err);
    if (note[0])
        fprintf(stderr, "kvd-run: pool %s: %s\n", o->pool, note);
    if (o->pool != NULL || o->kv_bytes != 0) {
        pool_describe(&lay, &cap, rt->n_ctx, err, sizeof(err));
        fprintf(stderr, "kvd-run: KV pool %s: %s\n", o->pool ? o->pool : "(private)", err);
    }
    struct kv_params kp = kv_default_params();
    kp.block_tokens = lay.block_tokens;
    kp.k_type = lay.k_type;
    kp.v_type = lay.v_type;
    kp.rotate = lay.rotate;
    kp.n_blocks = cap.n_blocks;
    kp.parts = &lay.parts;
    rt->kv = kvcache_wrap(c, &kp, pool_data(rt->pool), pool_data_bytes(rt->pool), err, sizeof(err));
    if (rt->kv == NULL)
        cli_die("%s", err);
    struct engine_params ep = engine_default_params();
    ep.max_tokens = rt->step;
    ep.max_ctx = rt->n_ctx;
    ep.n_threads = o->n_threads;
    rt->engine = engine_new(rt->model, rt->kv, &ep, err, sizeof(err));
    if (rt->engine == NULL)
        cli_die("%s", err);
    rt->load_ms = cli_now_ms() - t0;
}

static void runtime_close(struct runtime *rt)
{
    engine_destroy(&rt->engine);
    kvcache_destroy(&rt->kv);
    prefix_destroy(&rt->px);
    pool_close(&rt->pool);  /* a named pool stays, closed, with its cache */
    tok_destroy(&rt->tok);
    model_destroy(&rt->model);
}

/* ---- a sequence over the pool ---------------------------------------------------------- */

struct seq {
    struct prefix_seq ps;   /* block table, held through the prefix cache */
    uint32_t pos;           /* positions whose K/V are written */
};

/* Computes hist[s->pos, s->pos + n) in steps of at most chunk tokens; hist is
 * the sequence's whole history from position 0. After each step the written
 * blocks are committed, so full ones become reusable. The logits of the last
 * step are left in *logits (all rows when all_logits). */
static void seq_feed(struct runtime *rt, struct seq *s, const int32_t *hist, uint32_t n,
                     uint32_t chunk, bool all_logits, const float **logits, uint32_t *rows)
{
    char err[256];
    for (uint32_t i = 0; i < n; i += chunk) {
        uint32_t m = n - i < chunk ? n - i : chunk;
        if (prefix_seq_grow(rt->px, &s->ps, s->pos + m, hist, s->pos + m) != 0)
            cli_die("the KV pool is full");
        struct fwd_seq fs = { hist + s->pos, m, s->pos, s->ps.blocks, s->ps.n_blocks, all_logits,
                              prefix_seq_tables(&s->ps) };
        if (engine_step(rt->engine, &fs, 1, logits, rows, err, sizeof(err)) != 0)
            cli_die("%s", err);
        s->pos += m;
        prefix_seq_commit(rt->px, &s->ps, hist, s->pos);
    }
}

static void seq_release(struct runtime *rt, struct seq *s)
{
    prefix_seq_release(rt->px, &s->ps);
    s->pos = 0;
}

/* Dies unless a sequence at the end of the context has two full blocks past
 * its sinks to window. */
#define STREAM_CHUNK 64      /* tokens a --perplexity-stream step feeds */

static void window_check(const struct runtime *rt, int sinks)
{
    uint32_t keep, drop;
    if (!kv_window_plan(rt->n_ctx - 1, (uint32_t)sinks, rt->kv->block_tokens, rt->model->cfg.swa_window,
                        &keep, &drop))
        cli_die("a context of %u positions is too short to window with %d sink tokens in blocks of %u%s",
                rt->n_ctx, sinks, rt->kv->block_tokens,
                rt->model->cfg.swa_window ? " and the model's sliding window" : "");
}

/* Windows s, which has reached its context: keeps its first `sinks` tokens
 * (whole blocks) and the newer half of the full blocks after them, drops the
 * older half (prefix_seq_window) and moves the kept blocks' keys to their new
 * positions (engine_kv_shift); hist[0, *n_hist) follows. Returns the
 * positions dropped. */
static double window_ms;    /* time spent in seq_window, for the summaries */

static uint32_t seq_window(struct runtime *rt, struct seq *s, int32_t *hist, size_t *n_hist, int sinks)
{
    char err[256];
    const double t0 = cli_now_ms();
    const uint32_t bt = rt->kv->block_tokens;
    uint32_t keep, drop;
    if (!kv_window_plan(s->pos, (uint32_t)sinks, bt, rt->model->cfg.swa_window, &keep, &drop))
        cli_die("a context of %u positions is too short to window with %d sink tokens in blocks of %u",
                rt->n_ctx, sinks, bt);
    const uint32_t d = drop * bt;
    uint32_t (*copy)[2] = malloc((size_t)s->ps.n_blocks * (s->ps.n_parts ? s->ps.n_parts : 1) * sizeof(*copy));
    if (copy == NULL)
        cli_die("out of memory");
    const int64_t nc = prefix_seq_window(rt->px, &s->ps, keep, drop, copy);
    if (nc < 0)
        cli_die("cannot window the sequence: %s", kvd_strerror((int)nc));
    for (int64_t k = 0; k < nc; k++)
        kvcache_copy_block(rt->kv, copy[k][0], copy[k][1]);
    prefix_window_done(rt->px, &s->ps);
    free(copy);
    if (engine_kv_shift(rt->engine, (const uint32_t *const *)s->ps.tables, keep, s->ps.n_blocks - keep,
                        -(int32_t)d, err, sizeof(err)) != 0)
        cli_die("%s", err);
    memmove(hist + (size_t)keep * bt, hist + (size_t)keep * bt + d,
            (*n_hist - (size_t)keep * bt - d) * sizeof(int32_t));
    *n_hist -= d;
    s->pos -= d;
    window_ms += cli_now_ms() - t0;
    return d;
}

/* "kv":{...}: the cache's types, rotation and bytes per token (a JSON member). */
static void json_kv(FILE *f, const struct runtime *rt)
{
    const kvcache_t *kv = rt->kv;
    fprintf(f, "\"kv\":{\"k_type\":\"%s\",\"v_type\":\"%s\",\"rotate\":\"%s\",\"bytes_per_token\":%llu}",
            kv_type_name(kv->k_type), kv_type_name(kv->v_type), kv_rotate_arg(kv->rotate),
            (unsigned long long)kv_bytes_per_token(&rt->model->cfg, kv->k_type, kv->v_type));
}

/* ---- modes ------------------------------------------------------------------------- */

static int run_tokenize(const struct options *o)
{
    char err[512];
    gguf_ctx_t *g = gguf_open(o->model, err, sizeof(err));
    if (g == NULL)
        cli_die("%s", err);
    tok_t *t = tok_new_from_gguf(g, err, sizeof(err));
    if (t == NULL)
        cli_die("%s", err);
    size_t n;
    int32_t *ids = encode(t, o->tokenize, strlen(o->tokenize), o->special, &n);
    json_ids(stdout, ids, n);
    fputc('\n', stdout);
    free(ids);
    tok_destroy(&t);
    gguf_close(&g);
    return 0;
}

/*
 * The KL-divergence base file (--kl-divergence-base), little-endian:
 *   struct kld_header, then for each scored position (window by window,
 *   positions [ctx/2, ctx-1) of each) the log-probabilities of every token
 *   under the base run, as f16 (n_vocab of them). A log-probability near 0
 *   (the likely tokens, which carry the divergence) keeps ~11 bits there.
 */
#define KLD_MAGIC UINT64_C(0x31444c4b2d44564b) /* "KVD-KLD1" */
struct kld_header {
    uint64_t magic;         /* KLD_MAGIC */
    uint32_t n_vocab;       /* log-probabilities per position */
    uint32_t ctx;           /* window */
    uint64_t n_windows;     /* windows scored */
    uint64_t positions;     /* scored positions that follow */
    uint64_t tokens_hash;   /* FNV-1a of the windows' token ids: the same text, cut the same way */
    double nll;             /* the base run's summed negative log-likelihood */
    char kv_type[48];       /* the base run's KV types (informational) */
};
static_assert(sizeof(struct kld_header) == 96, "the KLD file header is an on-disk format");

static uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * UINT64_C(0x100000001b3);
    return h;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Perplexity as llama.cpp's perplexity tool computes it: non-overlapping
 * windows of n_ctx tokens, each from an empty cache (first token replaced by
 * BOS when the model adds one), scoring positions [n_ctx/2, n_ctx - 1). With
 * --kl-divergence-base the scored positions' log-probabilities are saved;
 * with --kl-divergence they are compared with this run's (typically over
 * another KV type): mean and 99th percentile of KL(base || this), the share
 * of positions whose most likely token is unchanged, and both perplexities. */
static int run_perplexity(const struct options *o)
{
    struct runtime rt;
    uint32_t win = o->n_ctx ? (uint32_t)o->n_ctx : 512;
    runtime_open(&rt, o, win, 0);
    size_t len, n;
    char *text = read_file(o->ppl_file, &len);
    int32_t *ids = encode(rt.tok, text, len, false, &n);
    if (n < 2 * (size_t)win)
        cli_die("%s has %zu tokens; perplexity with a window of %u needs at least %u",
            o->ppl_file, n, win, 2 * win);
    const uint32_t nv = rt.model->cfg.n_vocab;
    size_t n_win = n / win, scored = 0;
    if (o->chunks > 0 && (size_t)o->chunks < n_win)
        n_win = (size_t)o->chunks;
    double nll = 0.0, t0 = cli_now_ms();
    int32_t *w = malloc(win * sizeof(int32_t));
    float *lg = malloc((size_t)win * nv * sizeof(float));
    double *lp = malloc((size_t)nv * sizeof(double));
    kvd_f16 *row16 = malloc((size_t)nv * sizeof(kvd_f16));
    if (w == NULL || lg == NULL || lp == NULL || row16 == NULL)
        cli_die("out of memory");
    const uint32_t first = win / 2;
    const uint64_t positions = (uint64_t)n_win * (win - 1 - first);
    uint64_t hash = UINT64_C(0xcbf29ce484222325);
    for (size_t k = 0; k < n_win; k++)
        hash = fnv1a(hash, ids + k * win, win * sizeof(int32_t));
    char kv_type[48];
    kv_describe(&o->kv, kv_type, sizeof(kv_type));

    /* the base file: written (--kl-divergence-base) or read (--kl-divergence) */
    FILE *kf = NULL;
    struct kld_header kh;
    double *kld = NULL;
    size_t same_top = 0;
    if (o->kld_base != NULL) {
        kf = fopen(o->kld_base, "wb");
        if (kf == NULL)
            cli_die("cannot write %s: %s", o->kld_base, strerror(errno));
        memset(&kh, 0, sizeof(kh));
        kh = (struct kld_header){ .magic = KLD_MAGIC, .n_vocab = nv, .ctx = win, .n_windows = n_win,
                                  .positions = positions, .tokens_hash = hash };
        snprintf(kh.kv_type, sizeof(kh.kv_type), "%s", kv_type);
        if (fwrite(&kh, sizeof(kh), 1, kf) != 1)
            cli_die("cannot write %s: %s", o->kld_base, strerror(errno));
    } else if (o->kld != NULL) {
        kf = fopen(o->kld, "rb");
        if (kf == NULL)
            cli_die("cannot read %s: %s", o->kld, strerror(errno));
        if (fread(&kh, sizeof(kh), 1, kf) != 1 || kh.magic != KLD_MAGIC)
            cli_die("%s is not a kvd-run KL-divergence base file", o->kld);
        if (kh.n_vocab != nv || kh.ctx != win || kh.n_windows != n_win || kh.positions != positions ||
            kh.tokens_hash != hash)
            cli_die("%s was made from another model, text, --ctx or --chunks (its: %u tokens of "
                    "vocabulary, windows of %u, %llu windows)", o->kld, kh.n_vocab, kh.ctx,
                    (unsigned long long)kh.n_windows);
        kh.kv_type[sizeof(kh.kv_type) - 1] = '\0';
        kld = malloc((size_t)positions * sizeof(double));
        if (kld == NULL)
            cli_die("out of memory");
    }

    struct seq s = { 0 };
    for (size_t k = 0; k < n_win; k++) {
        memcpy(w, ids + k * win, win * sizeof(int32_t));
        if (tok_add_bos(rt.tok))
            w[0] = tok_bos(rt.tok);
        seq_release(&rt, &s);
        for (uint32_t i = 0; i < win; i += rt.step) {
            uint32_t m = win - i < rt.step ? win - i : rt.step;
            const float *out;
            uint32_t rows;
            seq_feed(&rt, &s, w, m, rt.step, true, &out, &rows);
            memcpy(lg + (size_t)i * nv, out, (size_t)m * nv * sizeof(float));
        }
        for (uint32_t j = first; j + 1 < win; j++) {
            const float *row = lg + (size_t)j * nv;
            float max = row[0];
            uint32_t top = 0;
            for (uint32_t v = 1; v < nv; v++)
                if (row[v] > max) {
                    max = row[v];
                    top = v;
                }
            double sum = 0.0;
            for (uint32_t v = 0; v < nv; v++)
                sum += exp((double)row[v] - max);
            const double lse = log(sum);
            nll += -(((double)row[w[j + 1]] - max) - lse);
            if (kf != NULL && o->kld_base != NULL) {
                for (uint32_t v = 0; v < nv; v++)
                    row16[v] = kvd_f32_to_f16((float)(((double)row[v] - max) - lse));
                if (fwrite(row16, sizeof(kvd_f16), nv, kf) != nv)
                    cli_die("cannot write %s: %s", o->kld_base, strerror(errno));
            } else if (kf != NULL) {
                if (fread(row16, sizeof(kvd_f16), nv, kf) != nv)
                    cli_die("%s is truncated", o->kld);
                /* the base distribution, renormalized after its f16 rounding */
                double bmax = -INFINITY, bsum = 0.0, d = 0.0;
                uint32_t btop = 0;
                for (uint32_t v = 0; v < nv; v++) {
                    lp[v] = kvd_f16_to_f32(row16[v]);
                    if (lp[v] > bmax) {
                        bmax = lp[v];
                        btop = v;
                    }
                }
                for (uint32_t v = 0; v < nv; v++)
                    bsum += exp(lp[v] - bmax);
                const double blse = bmax + log(bsum);
                for (uint32_t v = 0; v < nv; v++) {
                    const double lb = lp[v] - blse;
                    d += exp(lb) * (lb - (((double)row[v] - max) - lse));
                }
                kld[scored] = d > 0 ? d : 0;
                same_top += btop == top;
            }
            scored++;
        }
        if (!o->json)
            fprintf(stderr, "[%zu/%zu] running perplexity %.4f\n", k + 1, n_win, exp(nll / scored));
    }
    double ppl = exp(nll / scored), ms = cli_now_ms() - t0;
    if (kf != NULL && o->kld_base != NULL) {
        kh.nll = nll;
        if (fseek(kf, 0, SEEK_SET) != 0 || fwrite(&kh, sizeof(kh), 1, kf) != 1 || fclose(kf) != 0)
            cli_die("cannot write %s: %s", o->kld_base, strerror(errno));
    } else if (kf != NULL) {
        fclose(kf);
    }
    if (kld != NULL) {
        double mean = 0.0;
        for (size_t i = 0; i < scored; i++)
            mean += kld[i];
        mean /= (double)scored;
        qsort(kld, scored, sizeof(double), cmp_double);
        const double p99 = kld[(size_t)((double)(scored - 1) * 0.99)];
        const double ppl_base = exp(kh.nll / (double)scored);
        const double same = 100.0 * (double)same_top / (double)scored;
        if (o->json)
            printf("{\"kld_mean\":%.6g,\"kld_p99\":%.6g,\"same_top1_pct\":%.3f,\"perplexity\":%.6f,"
                   "\"perplexity_base\":%.6f,\"perplexity_delta_pct\":%.4f,\"positions\":%zu,"
                   "\"windows\":%zu,\"ctx\":%u,\"base_kv\":\"%s\",",
                   mean, p99, same, ppl, ppl_base, 100.0 * (ppl / ppl_base - 1.0), scored, n_win, win,
                   kh.kv_type);
        else
            printf("KL divergence against %s (%s): mean %.6f, 99th percentile %.6f; same top token "
                   "%.2f%% of %zu positions; perplexity %.4f against %.4f (%+.3f%%)\n",
                   o->kld, kh.kv_type, mean, p99, same, scored, ppl, ppl_base,
                   100.0 * (ppl / ppl_base - 1.0));
    } else if (o->json) {
        printf("{\"perplexity\":%.6f,\"windows\":%zu,\"ctx\":%u,\"tokens_scored\":%zu,\"ms\":%.1f,",
               ppl, n_win, win, scored, ms);
    } else {
        printf("perplexity: %.4f\n", ppl);
    }
    if (o->json) {
        json_kv(stdout, &rt);
        printf("}\n");
    }
    seq_release(&rt, &s);
    prefix_seq_fini(&s.ps);
    free(kld);
    free(row16);
    free(lp);
    free(w);
    free(lg);
    free(ids);
    free(text);
    runtime_close(&rt);
    return 0;
}

/* Length of the text that may be printed: everything but a tail that could
 * still become the start of a stop string. */
static size_t safe_len(const char *text, size_t len, const struct options *o)
{
    size_t hold = 0;
    for (int i = 0; i < o->n_stops; i++) {
        size_t sl = strlen(o->stops[i]);
        for (size_t k = sl - 1; k > hold; k--)
            if (k <= len && memcmp(text + len - k, o->stops[i], k) == 0) {
                hold = k;
                break;
            }
    }
    return len - hold;
}

static int run_generate(const struct options *o)
{
    struct runtime rt;
    uint32_t n_ctx = o->n_ctx ? (uint32_t)o->n_ctx : 4096;
    char err[512];
    /* the model's own context caps the default */
    {
        gguf_ctx_t *g = gguf_open(o->model, err, sizeof(err));
        if (g == NULL)
            cli_die("%s", err);
        uint32_t train = 0;
        if (!o->n_ctx && gguf_get_u32(g, "llama.context_length", &train) == 0 && train && train < n_ctx)
            n_ctx = train;
        gguf_close(&g);
    }
    /* a window copies the cached blocks it moves: room for them beside the context */
    runtime_open(&rt, o, n_ctx, o->overflow == OVERFLOW_WINDOW ? 2 * n_ctx : 0);
    if (o->overflow == OVERFLOW_WINDOW)
        window_check(&rt, o->sinks);

    /* the prompt: ids as given, or text (through the chat template when asked) */
    char *text = NULL;
    size_t text_len = 0;
    bool special = o->special;
    if (o->prompt_ids != NULL) {
        /* no text */
    } else if (o->chat) {
        chat_template_t *ct = chat_template_for_model(rt.model->gguf, err, sizeof(err));
        if (ct == NULL)
            cli_die("--chat: %s", err);
        struct chat_msg msgs[2];
        size_t nm = 0;
        if (o->system != NULL)
            msgs[nm++] = (struct chat_msg){ "system", o->system };
        msgs[nm++] = (struct chat_msg){ "user", o->prompt };
        int rc = chat_apply(ct, msgs, nm, true, &text, &text_len);
        if (rc != 0)
            cli_die("cannot apply the chat template: %s", kvd_strerror(rc));
        chat_template_destroy(&ct);
        special = true;  /* the template's markers are special tokens */
    } else {
        text = strdup(o->prompt);
        text_len = strlen(o->prompt);
    }
    size_t n_prompt;
    int32_t *ids0;
    bool bos;
    if (o->prompt_ids != NULL) {
        n_prompt = o->n_prompt_ids;
        ids0 = malloc(n_prompt * sizeof(int32_t));
        if (ids0 == NULL)
            cli_die("out of memory");
        for (size_t i = 0; i < n_prompt; i++) {
            if ((uint32_t)o->prompt_ids[i] >= rt.model->cfg.n_vocab)
                cli_die("--prompt-ids: id %d is out of range (the vocabulary has %u tokens)",
                    o->prompt_ids[i], rt.model->cfg.n_vocab);
            ids0[i] = o->prompt_ids[i];
        }
        bos = false;
    } else {
        ids0 = encode(rt.tok, text, text_len, special, &n_prompt);
        bos = tok_add_bos(rt.tok);
    }
    free(text);
    size_t n_hist = n_prompt + (bos ? 1 : 0);
    if (n_hist == 0)
        cli_die("the prompt is empty");
    if (n_hist >= rt.n_ctx)
        cli_die("the prompt has %zu tokens, more than the context of %u allows", n_hist, rt.n_ctx);
    size_t cap = n_hist + (size_t)o->n_predict + 1;
    int32_t *hist = malloc(cap * sizeof(int32_t));
    if (hist == NULL)
        cli_die("out of memory");
    if (bos)
        hist[0] = tok_bos(rt.tok);
    memcpy(hist + (bos ? 1 : 0), ids0, n_prompt * sizeof(int32_t));
    free(ids0);
    n_prompt = n_hist;

    sampler_t *smp = sampler_new(&o->sp, rt.model->cfg.n_vocab, err, sizeof(err));
    if (smp == NULL)
        cli_die("%s", err);
    struct seq s = { 0 };

    /* the longest cached prefix is skipped; at least one token is computed */
    double t0 = cli_now_ms();
    prefix_ns_t ns = prefix_namespace(rt.px, o->ns, strlen(o->ns));
    int64_t n_cached = prefix_seq_begin(rt.px, &s.ps, ns, hist, n_prompt, NULL);
    if (n_cached < 0)
        cli_die("prefix cache: %s", kvd_strerror((int)n_cached));
    s.pos = (uint32_t)n_cached;
    const float *logits;
    uint32_t rows;
    seq_feed(&rt, &s, hist, (uint32_t)(n_prompt - s.pos), rt.step, false, &logits, &rows);
    double t_prefill = cli_now_ms() - t0;
    if (o->logits_out != NULL) {
        FILE *lf = fopen(o->logits_out, "wb");
        if (lf == NULL || fwrite(logits, sizeof(float), rt.model->cfg.n_vocab, lf) !=
                              rt.model->cfg.n_vocab || fclose(lf) != 0)
            cli_die("cannot write %s: %s", o->logits_out, strerror(errno));
    }

    size_t out_cap = 4096, out_len = 0, printed = 0;
    char *out = malloc(out_cap);
    if (out == NULL)
        cli_die("out of memory");
    const char *finish = "length";
    int n_gen = 0;
    t0 = cli_now_ms();
    /* the prompt and the generated ids apart from hist, which a window rewrites */
    int32_t *prompt = malloc(n_prompt * sizeof(int32_t)), *gen = malloc(((size_t)o->n_predict + 1) * sizeof(int32_t));
    if (prompt == NULL || gen == NULL)
        cli_die("out of memory");
    memcpy(prompt, hist, n_prompt * sizeof(int32_t));
    uint32_t windows = 0, max_blocks = s.ps.n_blocks;
    uint64_t dropped = 0;
    while (n_gen < o->n_predict) {
        int32_t id = sampler_sample(smp, logits, hist, n_hist);
        gen[n_gen] = id;
        hist[n_hist++] = id;
        n_gen++;
        if (!o->ignore_eos && tok_is_eog(rt.tok, id)) {
            finish = "stop";
            break;
        }
        char piece[256];
        size_t pn = 0;
        if (tok_decode_piece(rt.tok, id, piece, sizeof(piece), &pn) != 0)
            pn = 0;
        if (out_len + pn + 1 > out_cap) {
            out_cap = (out_len + pn + 1) * 2;
            out = realloc(out, out_cap);
            if (out == NULL)
                cli_die("out of memory");
        }
        memcpy(out + out_len, piece, pn);
        size_t before = out_len;
        out_len += pn;
        out[out_len] = '\0';
        bool stopped = false;
        for (int i = 0; i < o->n_stops && !stopped; i++) {
            /* a new match must end inside the new piece */
            size_t sl = strlen(o->stops[i]);
            const char *hit = strstr(out + (before >= sl ? before - sl + 1 : 0), o->stops[i]);
            if (hit != NULL) {
                out_len = (size_t)(hit - out);
                out[out_len] = '\0';
                stopped = true;
            }
        }
        if (!o->json) {
            size_t upto = stopped ? out_len : safe_len(out, out_len, o);
            if (upto > printed) {
                fwrite(out + printed, 1, upto - printed, stdout);
                fflush(stdout);
                printed = upto;
            }
        }
        if (stopped) {
            finish = "stop";
            break;
        }
        if (s.pos + 1 >= rt.n_ctx) {
            if (o->overflow != OVERFLOW_WINDOW) {
                finish = "length";
                break;
            }
            dropped += seq_window(&rt, &s, hist, &n_hist, o->sinks);
            windows++;
        }
        seq_feed(&rt, &s, hist, 1, 1, false, &logits, &rows);
        if (s.ps.n_blocks > max_blocks)
            max_blocks = s.ps.n_blocks;
    }
    double t_decode = cli_now_ms() - t0;

    if (o->json) {
        printf("{\"prompt_tokens\":");
        json_ids(stdout, prompt, n_prompt);
        printf(",\"tokens\":");
        json_ids(stdout, gen, (size_t)n_gen);
        printf(",\"windows\":%u,\"dropped_tokens\":%llu,\"window_ms\":%.2f,\"max_blocks\":%u", windows,
               (unsigned long long)dropped, window_ms, max_blocks);
        printf(",\"text\":");
        json_str(stdout, out, out_len);
        printf(",\"cached_prompt_tokens\":%lld", (long long)n_cached);
        printf(",\"finish_reason\":\"%s\",\"timings\":{\"load_ms\":%.1f,\"prefill_ms\":%.1f,"
               "\"decode_ms\":%.1f,\"prefill_tokens_per_s\":%.2f,\"decode_tokens_per_s\":%.2f},",
               finish, rt.load_ms, t_prefill, t_decode,
               t_prefill > 0 ? n_prompt / (t_prefill / 1e3) : 0.0,
               t_decode > 0 ? n_gen / (t_decode / 1e3) : 0.0);
        json_kv(stdout, &rt);
        printf("}\n");
    } else {
        if (out_len > printed)
            fwrite(out + printed, 1, out_len - printed, stdout);
        fputc('\n', stdout);
        fflush(stdout);
        fprintf(stderr, "kvd-run: %zu prompt tokens (%lld cached) in %.0f ms (%.1f tok/s), "
                "%d generated in %.0f ms (%.1f tok/s), %d threads\n", n_prompt,
                (long long)n_cached, t_prefill,
                t_prefill > 0 ? n_prompt / (t_prefill / 1e3) : 0.0, n_gen, t_decode,
                t_decode > 0 ? n_gen / (t_decode / 1e3) : 0.0, engine_threads(rt.engine));
        if (windows > 0)
            fprintf(stderr, "kvd-run: the context was windowed %u times (%llu tokens dropped, %.1f ms; at most "
                    "%u blocks held)\n", windows, (unsigned long long)dropped, window_ms, max_blocks);
    }
    free(prompt);
    free(gen);
    free(out);
    seq_release(&rt, &s);
    prefix_seq_fini(&s.ps);
    free(hist);
    sampler_destroy(&smp);
    runtime_close(&rt);
    return 0;
}

/* ---- --perplexity-stream ------------------------------------------------------------- */

/* -log p(next) from a row of logits, in double. */
static double row_nll(const float *row, uint32_t nv, int32_t next)
{
    float max = row[0];
    for (uint32_t v = 1; v < nv; v++)
        max = row[v] > max ? row[v] : max;
    double sum = 0.0;
    for (uint32_t v = 0; v < nv; v++)
        sum += exp((double)row[v] - max);
    return -(((double)row[next] - max) - log(sum));
}

/* Every token of a text scored in one sequence (BOS first where the model
 * adds one), fed STREAM_CHUNK tokens a step: row j of a step predicts the
 * token after its j-th. When the next step would pass the context, the
 * sequence is windowed (seq_window), restarted from that token with an empty
 * cache, or (stop) the text ends there. Printed: the perplexity of every
 * scored token and of each stretch of --ctx text tokens, so that what
 * happens after the context fills shows. */
static int run_perplexity_stream(const struct options *o)
{
    struct runtime rt;
    const uint32_t ctx = o->n_ctx ? (uint32_t)o->n_ctx : 512;
    runtime_open(&rt, o, ctx, o->overflow == OVERFLOW_WINDOW ? 2 * ctx : 0);
    if (o->overflow == OVERFLOW_WINDOW)
        window_check(&rt, o->sinks);
    size_t len, n_text;
    char *text = read_file(o->ppl_stream, &len);
    int32_t *ids = encode(rt.tok, text, len, false, &n_text);
    free(text);
    const bool bos = tok_add_bos(rt.tok);
    const size_t n = n_text + bos;
    int32_t *all = malloc((n + 1) * sizeof(int32_t)), *hist = malloc((n + 1) * sizeof(int32_t));
    if (all == NULL || hist == NULL)
        cli_die("out of memory");
    if (bos)
        all[0] = tok_bos(rt.tok);
    memcpy(all + bos, ids, n_text * sizeof(int32_t));
    free(ids);
    if (n < 2)
        cli_die("%s has too few tokens to score", o->ppl_stream);
    const uint32_t nv = rt.model->cfg.n_vocab;
    const size_t n_seg = (n + ctx - 1) / ctx;
    double *seg_nll = calloc(n_seg, sizeof(double)), nll = 0.0;
    size_t *seg_n = calloc(n_seg, sizeof(size_t)), scored = 0, n_hist = 0, next = 0;
    if (seg_nll == NULL || seg_n == NULL)
        cli_die("out of memory");
    uint32_t windows = 0, restarts = 0, max_blocks = 0, chunk = STREAM_CHUNK < ctx ? STREAM_CHUNK : ctx;
    struct seq s = { 0 };
    const double t0 = cli_now_ms();
    while (next + 1 < n) {
        if (s.pos == ctx) {
            /* the context is full: every run moves at the same point */
            if (o->overflow == OVERFLOW_WINDOW) {
                seq_window(&rt, &s, hist, &n_hist, o->sinks);
                windows++;
            } else if (o->overflow == OVERFLOW_RESTART) {
                seq_release(&rt, &s);
                n_hist = 0;
                restarts++;
            } else {
                break;      /* stop: the text ends at the context */
            }
        }
        uint32_t m = n - next < chunk ? (uint32_t)(n - next) : chunk;
        if (s.pos + m > ctx)
            m = ctx - s.pos;
        memcpy(hist + n_hist, all + next, m * sizeof(int32_t));
        n_hist += m;
        const float *out;
        uint32_t rows;
        seq_feed(&rt, &s, hist, m, m, true, &out, &rows);
        if (s.ps.n_blocks > max_blocks)
            max_blocks = s.ps.n_blocks;
        for (uint32_t j = 0; j < m && next + j + 1 < n; j++) {
            const size_t at = next + j + 1;
            const double l = row_nll(out + (size_t)j * nv, nv, all[at]);
            nll += l;
            scored++;
            seg_nll[(at - bos) / ctx] += l;
            seg_n[(at - bos) / ctx]++;
        }
        next += m;
    }
    const double ms = cli_now_ms() - t0;
    static const char *const mode[] = { "stop", "window", "restart" };
    if (o->json) {
        printf("{\"perplexity\":%.6f,\"mode\":\"%s\",\"ctx\":%u,\"sinks\":%d,\"tokens_scored\":%zu,"
               "\"windows\":%u,\"restarts\":%u,\"max_blocks\":%u,\"ms\":%.1f,\"segments\":[",
               exp(nll / (double)scored), mode[o->overflow], ctx, o->sinks, scored, windows, restarts,
               max_blocks, ms);
        for (size_t k = 0; k < n_seg && seg_n[k] > 0; k++)
            printf("%s%.6f", k ? "," : "", exp(seg_nll[k] / (double)seg_n[k]));
        printf("],");
        json_kv(stdout, &rt);
        printf("}\n");
    } else {
        printf("perplexity: %.4f over %zu tokens (%s, --ctx %u", exp(nll / (double)scored), scored,
               mode[o->overflow], ctx);
        if (o->overflow == OVERFLOW_WINDOW)
            printf(", %d sinks, %u windows", o->sinks, windows);
        else if (o->overflow == OVERFLOW_RESTART)
            printf(", %u restarts", restarts);
        printf("; at most %u blocks held)\nper %u text tokens:", max_blocks, ctx);
        for (size_t k = 0; k < n_seg && seg_n[k] > 0; k++)
            printf(" %.3f", exp(seg_nll[k] / (double)seg_n[k]));
        printf("\n");
    }
    seq_release(&rt, &s);
    prefix_seq_fini(&s.ps);
    free(seg_nll);
    free(seg_n);
    free(all);
    free(hist);
    runtime_close(&rt);
    return 0;
}

/* ---- --score ------------------------------------------------------------------------- */

/*
 * lm-eval's loglikelihood of a continuation after a context: the tokens of
 * context + continuation (a BOS first where the model adds one, as a prompt
 * of kvd's gets), the context's own tokens, and the rest as the
 * continuation's (lm-eval's split); each of those scored given every token
 * before it, as the log-softmax of the raw logits in double precision (what
 * kvd's echo and prompt_logprobs report). One JSON line a pair:
 * {"context_tokens", "tokens", "logprobs", "logprob" (their sum), "greedy"}.
 */
static int run_score(const struct options *o)
{
    char err[512];
    gguf_ctx_t *g = gguf_open(o->model, err, sizeof(err));
    if (g == NULL)
        cli_die("%s", err);
    tok_t *t = tok_new_from_gguf(g, err, sizeof(err));
    if (t == NULL)
        cli_die("%s", err);
    const bool bos = tok_add_bos(t);
    const int n_pairs = o->n_score_ctx;
    int32_t **all = calloc((size_t)n_pairs, sizeof(*all));
    size_t *n_all = calloc((size_t)n_pairs, sizeof(*n_all)), *n_ctx_tok = calloc((size_t)n_pairs, sizeof(size_t));
    if (all == NULL || n_all == NULL || n_ctx_tok == NULL)
        cli_die("out of memory");
    size_t longest = 0;
    for (int i = 0; i < n_pairs; i++) {
        const size_t lc = strlen(o->score_ctx[i]), lt = strlen(o->score_cont[i]);
        char *whole = malloc(lc + lt + 1);
        if (whole == NULL)
            cli_die("out of memory");
        memcpy(whole, o->score_ctx[i], lc);
        memcpy(whole + lc, o->score_cont[i], lt + 1);
        size_t nw, nc;
        int32_t *w = encode(t, whole, lc + lt, false, &nw);
        int32_t *cids = encode(t, o->score_ctx[i], lc, false, &nc);
        free(whole);
        free(cids);
        if (nc + bos == 0 || nw <= nc)
            cli_die("--score %d: the context needs a token and the continuation one more", i + 1);
        if ((all[i] = malloc((nw + bos) * sizeof(int32_t))) == NULL)
            cli_die("out of memory");
        if (bos)
            all[i][0] = tok_bos(t);
        memcpy(all[i] + bos, w, nw * sizeof(int32_t));
        free(w);
        n_all[i] = nw + bos;
        n_ctx_tok[i] = nc + bos;
        longest = n_all[i] > longest ? n_all[i] : longest;
    }
    tok_destroy(&t);
    gguf_close(&g);
    struct runtime rt;
    const uint32_t ctx = o->n_ctx ? (uint32_t)o->n_ctx : (uint32_t)(longest < 16 ? 16 : longest);
    if (longest > ctx)
        cli_die("a --score pair has %zu tokens, more than --ctx %u", longest, ctx);
    runtime_open(&rt, o, ctx, 0);
    const uint32_t nv = rt.model->cfg.n_vocab;
    double *lps = malloc(longest * sizeof(double));
    if (lps == NULL)
        cli_die("out of memory");
    for (int i = 0; i < n_pairs; i++) {
        struct seq s = { 0 };
        const size_t n = n_all[i], first = n_ctx_tok[i];
        bool greedy = true;
        double sum = 0.0;
        /* every position but the last is fed; row p predicts token p + 1 */
        for (size_t at = 0; at + 1 < n;) {
            const uint32_t m = n - 1 - at < rt.step ? (uint32_t)(n - 1 - at) : rt.step;
            const float *out;
            uint32_t rows;
            seq_feed(&rt, &s, all[i], m, m, true, &out, &rows);
            for (uint32_t j = 0; j < m; j++) {
                const size_t next = at + j + 1;
                if (next < first)
                    continue;
                const float *row = out + (size_t)j * nv;
                uint32_t best = 0;
                for (uint32_t v = 1; v < nv; v++)
                    best = row[v] > row[best] ? v : best;
                greedy &= (int32_t)best == all[i][next];
                lps[next - first] = -row_nll(row, nv, all[i][next]);
                sum += lps[next - first];
            }
            at += m;
        }
        printf("{\"context_tokens\":%zu,\"tokens\":", first);
        json_ids(stdout, all[i] + first, n - first);
        printf(",\"logprobs\":[");
        for (size_t k = 0; k < n - first; k++)
            printf("%s%.9g", k ? "," : "", lps[k]);
        printf("],\"logprob\":%.9g,\"greedy\":%s}\n", sum, greedy ? "true" : "false");
        seq_release(&rt, &s);
        prefix_seq_fini(&s.ps);
        free(all[i]);
    }
    free(lps);
    free(all);
    free(n_all);
    free(n_ctx_tok);
    runtime_close(&rt);
    return 0;
}

/* ---- --bench ------------------------------------------------------------------------- */

static double rss_mib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    double kb = 0;
    while (f != NULL && fgets(line, sizeof(line), f))
        if (sscanf(line, "VmRSS: %lf kB", &kb) == 1)
            break;
    if (f != NULL)
        fclose(f);
    return kb / 1024.0;
}

#define BENCH_PREFILL 512
#define BENCH_DECODE 128
#define BENCH_BATCH_PROMPT 128
#define BENCH_BATCH_STEPS 64

static const char bench_text[] =
    "A cache keeps the answers to questions that were asked before, so that the next time the "
    "same question comes the answer is already there. Language models keep the keys and values "
    "of every token they have read, and a server that shares them across requests can skip the "
    "work of reading a long system prompt again and again. ";

/* Batch decode: B sequences with 128-token prompts (not timed), then 64 steps of
 * one token each for all B at once. Returns aggregate tokens per second. */
static double bench_batch(struct runtime *rt, const int32_t *ids, size_t n_ids, int B, int prompt,
                          int steps)
{
    char err[256];
    const uint32_t V = rt->model->cfg.n_vocab;
    const size_t H = (size_t)prompt + (size_t)steps; /* history per sequence */
    struct seq *s = calloc((size_t)B, sizeof(*s));
    int32_t *hist = malloc((size_t)B * H * sizeof(int32_t));
    struct fwd_seq *fs = malloc((size_t)B * sizeof(*fs));
    if (s == NULL || hist == NULL || fs == NULL)
        cli_die("out of memory");
    const float *lg;
    uint32_t rows;
    for (int b = 0; b < B; b++) {
        int32_t *h = hist + (size_t)b * H;
        for (int i = 0; i < prompt; i++)
            h[i] = ids[((size_t)16 * b + i) % n_ids];
        seq_feed(rt, &s[b], h, (uint32_t)prompt, rt->step, false, &lg, &rows);
        h[s[b].pos] = sampler_argmax(lg, V);
    }
    double t0 = cli_now_ms();
    for (int step = 0; step < steps; step++) {
        for (int b = 0; b < B; b++) {
            int32_t *h = hist + (size_t)b * H;
            if (prefix_seq_grow(rt->px, &s[b].ps, s[b].pos + 1, h, s[b].pos + 1) != 0)
                cli_die("the KV pool is full");
            fs[b] = (struct fwd_seq){ h + s[b].pos, 1, s[b].pos, s[b].ps.blocks, s[b].ps.n_blocks,
                                      false, prefix_seq_tables(&s[b].ps) };
        }
        if (engine_step(rt->engine, fs, (uint32_t)B, &lg, &rows, err, sizeof(err)) != 0)
            cli_die("%s", err);
        for (int b = 0; b < B; b++) {
            int32_t *h = hist + (size_t)b * H;
            s[b].pos++;
            prefix_seq_commit(rt->px, &s[b].ps, h, s[b].pos);
            if (s[b].pos < H)
                h[s[b].pos] = sampler_argmax(lg + (size_t)b * V, V);
        }
    }
    double ms = cli_now_ms() - t0;
    for (int b = 0; b < B; b++) {
        seq_release(rt, &s[b]);
        prefix_seq_fini(&s[b].ps);
    }
    free(s);
    free(hist);
    free(fs);
    return B * steps / (ms / 1e3);
}

/* Milliseconds of BENCH_DECODE greedy tokens one at a time after s's
 * history (hist[s->pos] its next token); releases s. */
static double bench_decode(struct runtime *rt, struct seq *s, int32_t *hist, uint32_t V)
{
    const float *lg;
    uint32_t rows;
    const double t0 = cli_now_ms();
    for (int i = 0; i < BENCH_DECODE; i++) {
        seq_feed(rt, s, hist, 1, 1, false, &lg, &rows);
        hist[s->pos] = sampler_argmax(lg, V);
    }
    const double ms = cli_now_ms() - t0;
    seq_release(rt, s);
    prefix_seq_fini(&s->ps);
    return ms;
}

/* --bench --bench-ctx N: decode after a context of N tokens, at batch 1 and 8
 * (each sequence its own text, so nothing is shared): what reading the cache
 * costs a step, the KV types' difference. */
static int run_bench_ctx(const struct options *o, struct runtime *rt, const int32_t *ids, size_t n_ids)
{
    const int ctx = o->bench_ctx, batches[2] = { 1, 8 }, steps[2] = { 32, 16 };
    double tps[2];
    for (int i = 0; i < 2; i++)
        tps[i] = bench_batch(rt, ids, n_ids, batches[i], ctx, steps[i]);
    if (o->json) {
        printf("{\"threads\":%d,\"isa\":\"%s\",\"ctx\":%d,\"decode\":[", engine_threads(rt->engine),
               kern_path_name(), ctx);
        for (int i = 0; i < 2; i++)
            printf("%s{\"batch\":%d,\"tokens_per_s\":%.2f}", i ? "," : "", batches[i], tps[i]);
        printf("],");
        json_kv(stdout, rt);
        printf("}\n");
    } else {
        printf("threads %d, kernels %s, K %s, V %s\n", engine_threads(rt->engine), kern_path_name(),
               kv_type_name(rt->kv->k_type), kv_type_name(rt->kv->v_type));
        for (int i = 0; i < 2; i++)
            printf("decode batch %d after %d tokens: %9.1f tokens/s\n", batches[i], ctx, tps[i]);
    }
    return 0;
}

static int run_bench(const struct options *o)
{
    struct runtime rt;
    /* room for the batch-32 run: 32 x (128 + 64) positions, plus slack */
    uint32_t need = 32 * (BENCH_BATCH_PROMPT + BENCH_BATCH_STEPS) + 1024;
    if (o->bench_ctx > 0)   /* 8 sequences of bench_ctx + 16 tokens, and slack */
        need = 8 * ((uint32_t)o->bench_ctx + 64) + 1024;
    runtime_open(&rt, o, o->bench_ctx > 0 ? (uint32_t)o->bench_ctx + 64 : 2048, need);
    size_t len = sizeof(bench_text) - 1, n_ids;
    char *text = o->bench_file ? read_file(o->bench_file, &len) : strdup(bench_text);
    int32_t *ids = encode(rt.tok, text, len, true, &n_ids);
    if (n_ids == 0)
        cli_die("the benchmark text has no tokens");
    if (o->bench_ctx > 0) {
        run_bench_ctx(o, &rt, ids, n_ids);
        free(ids);
        free(text);
        runtime_close(&rt);
        return 0;
    }
    const uint32_t V = rt.model->cfg.n_vocab;
    int32_t hist[BENCH_PREFILL + BENCH_DECODE + 1];
    for (int i = 0; i < BENCH_PREFILL; i++)
        hist[i] = ids[(size_t)i % n_ids];
    struct seq s = { 0 };
    const float *lg;
    uint32_t rows;
    /* warm-up: fault the weights in */
    seq_feed(&rt, &s, hist, 32, 32, false, &lg, &rows);
    seq_release(&rt, &s);

    double t0 = cli_now_ms();
    seq_feed(&rt, &s, hist, BENCH_PREFILL, BENCH_PREFILL, false, &lg, &rows);
    double prefill_ms = cli_now_ms() - t0;
    hist[s.pos] = sampler_argmax(lg, V);
    const double decode_ms = bench_decode(&rt, &s, hist, V);
    /* the same from an empty context, as llama-bench's tg128 (no prompt
     * before: attention reads positions 0..127 only) */
    struct seq s0 = { 0 };
    hist[0] = ids[0];
    const double decode0_ms = bench_decode(&rt, &s0, hist, V);

    const int batches[3] = { 1, 8, 32 };
    double agg[3];
    for (int i = 0; i < 3; i++)
        agg[i] = bench_batch(&rt, ids, n_ids, batches[i], BENCH_BATCH_PROMPT, BENCH_BATCH_STEPS);
    double prefill_tps = BENCH_PREFILL / (prefill_ms / 1e3), decode_tps = BENCH_DECODE / (decode_ms / 1e3);
    double decode0_tps = BENCH_DECODE / (decode0_ms / 1e3);
    if (o->json) {
        printf("{\"threads\":%d,\"isa\":\"%s\",\"prefill_tokens\":%d,\"prefill_tokens_per_s\":%.2f,"
               "\"decode_b1_tokens\":%d,\"decode_b1_depth\":%d,\"decode_b1_tokens_per_s\":%.2f,"
               "\"decode_b1_d0_tokens_per_s\":%.2f,\"batch_decode\":[",
               engine_threads(rt.engine), kern_path_name(), BENCH_PREFILL, prefill_tps,
               BENCH_DECODE, BENCH_PREFILL, decode_tps, decode0_tps);
        for (int i = 0; i < 3; i++)
            printf("%s{\"batch\":%d,\"tokens_per_s\":%.2f}", i ? "," : "", batches[i], agg[i]);
        printf("],\"rss_mib\":%.1f,\"packed_weights_mib\":%.1f,", rss_mib(),
               (double)rt.model->packed_bytes / (1 << 20));
        json_kv(stdout, &rt);
        printf("}\n");
    } else {
        printf("threads %d, kernels %s\n", engine_threads(rt.engine), kern_path_name());
        printf("prefill %d tokens:        %9.1f tokens/s\n", BENCH_PREFILL, prefill_tps);
        printf("decode batch 1, %d:      %9.1f tokens/s (after the %d-token prefill)\n", BENCH_DECODE,
               decode_tps, BENCH_PREFILL);
        printf("decode batch 1, %d:      %9.1f tokens/s (from an empty context)\n", BENCH_DECODE,
               decode0_tps);
        for (int i = 0; i < 3; i++)
            printf("decode batch %-2d (aggregate): %7.1f tokens/s\n", batches[i], agg[i]);
        printf("resident memory:          %9.1f MiB (packed weights %.1f MiB, KV cache %.1f MiB)\n",
               rss_mib(), (double)rt.model->packed_bytes / (1 << 20),
               (double)rt.kv->n_blocks * rt.kv->block_bytes / (1 << 20));
    }
    free(ids);
    free(text);
    runtime_close(&rt);
    return 0;
}

int main(int argc, char **argv)
{
    struct options o;
    cli_init("kvd-run");
    parse_args(argc, argv, &o);
    int rc;
    if (o.tokenize != NULL)
        rc = run_tokenize(&o);
    else if (o.bench)
        rc = run_bench(&o);
    else if (o.ppl_file != NULL)
        rc = run_perplexity(&o);
    else if (o.ppl_stream != NULL)
        rc = run_perplexity_stream(&o);
    else if (o.n_score_ctx > 0)
        rc = run_score(&o);
    else
        rc = run_generate(&o);
    free(o.system_buf);
    free(o.prompt_buf);
    free(o.prompt_ids);
    free(o.score_ctx);
    free(o.score_cont);
    return rc;
}
