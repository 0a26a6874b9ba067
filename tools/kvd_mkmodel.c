/*
 * kvd_mkmodel.c - kvd-mkmodel: writes a small random llama GGUF model.
 *
 *   kvd-mkmodel -o PATH [--layers N] [--embd N] [--heads N] [--kv-heads N]
 *               [--ff N] [--vocab N] [--ctx N] [--type T] [--embd-type T]
 *               [--untied] [--seed S] [--rope-base F] [--rms-eps F]
 *               [--gemma3 [--head-dim N] [--window W]]
 *
 * --gemma3 writes a gemma3 file (Q/K and post norms, GEGLU, every sixth layer
 * full and the others in a sliding window of W positions) with the same
 * vocabulary.
 *
 * Defaults are mkmodel_default_params(). Bad arguments get a one-line error
 * and exit status 2; a failed write exits 1.
 */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "err.h"
#include "mkmodel.h"
#include "types.h"

static const char usage[] =
    "usage: kvd-mkmodel -o PATH [--layers N] [--embd N] [--heads N] [--kv-heads N] [--ff N]\n"
    "                   [--vocab N] [--ctx N] [--type T] [--embd-type T] [--untied] [--seed S]\n"
    "                   [--rope-base F] [--rms-eps F] [--gemma3 [--head-dim N] [--window W]]\n"
    "  types: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K\n";

static int bad(const char *fmt, const char *a, const char *b)
{
    fprintf(stderr, "kvd-mkmodel: ");
    fprintf(stderr, fmt, a, b);
    fprintf(stderr, " (try --help)\n");
    return 2;
}

/* Parses a whole decimal number into [lo, hi]; false otherwise. */
static bool parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    if (s == NULL || *s < '0' || *s > '9')
        return false;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

static bool parse_u32(const char *s, uint32_t *out)
{
    uint64_t v;
    if (!parse_u64(s, 1, UINT32_MAX, &v))
        return false;
    *out = (uint32_t)v;
    return true;
}

static bool parse_pos_float(const char *s, float *out)
{
    if (s == NULL || *s == '\0')
        return false;
    errno = 0;
    char *end;
    float v = strtof(s, &end);
    if (errno != 0 || *end != '\0' || !(v > 0.0f))
        return false;
    *out = v;
    return true;
}

/* A type by its name ("Q4_1", any case); false when unknown. */
static bool parse_type(const char *s, uint32_t *out)
{
    for (uint32_t t = 0; t < KERN_TYPE_LIMIT; t++) {
        const struct kern_type_info *ti = kern_type_info(t);
        if (ti != NULL && strcasecmp(ti->name, s) == 0) {
            *out = t;
            return true;
        }
    }
    return false;
}

int main(int argc, char **argv)
{
    enum { O_LAYERS = 256, O_EMBD, O_HEADS, O_KV_HEADS, O_FF, O_VOCAB, O_CTX, O_TYPE,
           O_EMBD_TYPE, O_UNTIED, O_SEED, O_ROPE, O_EPS, O_GEMMA3, O_HEAD_DIM, O_WINDOW };
    static const struct option opts[] = {
        { "output", required_argument, NULL, 'o' },
        { "help", no_argument, NULL, 'h' },
        { "layers", required_argument, NULL, O_LAYERS },
        { "embd", required_argument, NULL, O_EMBD },
        { "heads", required_argument, NULL, O_HEADS },
        { "kv-heads", required_argument, NULL, O_KV_HEADS },
        { "ff", required_argument, NULL, O_FF },
        { "vocab", required_argument, NULL, O_VOCAB },
        { "ctx", required_argument, NULL, O_CTX },
        { "type", required_argument, NULL, O_TYPE },
        { "embd-type", required_argument, NULL, O_EMBD_TYPE },
        { "untied", no_argument, NULL, O_UNTIED },
        { "seed", required_argument, NULL, O_SEED },
        { "rope-base", required_argument, NULL, O_ROPE },
        { "rms-eps", required_argument, NULL, O_EPS },
        { "gemma3", no_argument, NULL, O_GEMMA3 },
        { "head-dim", required_argument, NULL, O_HEAD_DIM },
        { "window", required_argument, NULL, O_WINDOW },
        { NULL, 0, NULL, 0 },
    };
    struct mkmodel_params p = mkmodel_default_params();
    const char *path = NULL;
    opterr = 0;
    int c, idx = -1;
    while ((c = getopt_long(argc, argv, ":o:h", opts, &idx)) != -1) {
        const char *name = idx >= 0 ? opts[idx].name : "output";
        bool ok = true;
        idx = -1;
        switch (c) {
        case 'o': path = optarg; break;
        case 'h': fputs(usage, stdout); return 0;
        case O_LAYERS: ok = parse_u32(optarg, &p.n_layer); break;
        case O_EMBD: ok = parse_u32(optarg, &p.n_embd); break;
        case O_HEADS: ok = parse_u32(optarg, &p.n_head); break;
        case O_KV_HEADS: ok = parse_u32(optarg, &p.n_head_kv); break;
        case O_FF: ok = parse_u32(optarg, &p.n_ff); break;
        case O_VOCAB: ok = parse_u32(optarg, &p.n_vocab); break;
        case O_CTX: ok = parse_u32(optarg, &p.n_ctx); break;
        case O_TYPE: ok = parse_type(optarg, &p.wtype); break;
        case O_EMBD_TYPE: ok = parse_type(optarg, &p.embd_type); break;
        case O_UNTIED: p.tied = false; break;
        case O_SEED: ok = parse_u64(optarg, 0, UINT64_MAX, &p.seed); break;
        case O_ROPE: ok = parse_pos_float(optarg, &p.rope_freq_base); break;
        case O_EPS: ok = parse_pos_float(optarg, &p.rms_eps); break;
        case O_GEMMA3: p.gemma3 = true; break;
        case O_HEAD_DIM: ok = parse_u32(optarg, &p.head_dim); break;
        case O_WINDOW: ok = parse_u32(optarg, &p.swa_window); break;
        case ':': return bad("option %s needs a value%s", argv[optind - 1], "");
        default: return bad("unknown option %s%s", argv[optind - 1], "");
        }
        if (!ok)
            return bad("bad value '%s' for --%s", optarg, name);
    }
    if (optind < argc)
        return bad("unexpected argument '%s'%s", argv[optind], "");
    if (path == NULL)
        return bad("no output file: give -o PATH%s%s", "", "");

    char err[256] = "";
    int rc = mkmodel_check(&p, err, sizeof(err));
    if (rc) {
        fprintf(stderr, "kvd-mkmodel: %s\n", err);
        return 2;
    }
    rc = mkmodel_write(&p, path, err, sizeof(err));
    if (rc) {
        fprintf(stderr, "kvd-mkmodel: %s\n", err);
        return 1;
    }
    printf("kvd-mkmodel: wrote %s (%u layers, embd %u, %u/%u heads, ff %u, vocab %u, %s, embd %s, %s)\n",
           path, p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.n_ff, p.n_vocab,
           kern_type_info(p.wtype)->name, kern_type_info(p.embd_type)->name, p.tied ? "tied" : "untied");
    return 0;
}
