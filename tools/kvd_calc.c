/*
 * kvd_calc.c - kvd-calc: how much KV memory a model needs, and what a budget holds.
 *
 *     KV bytes = 2 (K and V) x layers x KV heads x head dim x tokens x batch x bytes/element
 *
 * The shape comes from a GGUF file (-m) or from the command line (--layers,
 * --kv-heads, --head-dim). With --kv-memory it also prints what a pool of that
 * size holds, exactly as kvd and kvd-run would lay it out (blocks plus their
 * metadata). Errors end with one line on stderr and exit status 1.
 */
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "model.h"
#include "err.h"
#include "gguf.h"
#include "kvcache.h"
#include "pool.h"
#include "types.h"
#include "units.h"

static void usage(FILE *f)
{
    fputs("usage: kvd-calc -m MODEL [--ctx N] [--batch B] [--kv-type T] [--kv-memory SIZE]\n"
          "       kvd-calc --layers L --kv-heads H --head-dim D [same options]\n"
          "\n"
          "  -m, --model FILE       GGUF model of the llama family to read the shape from\n"
          "      --layers L         transformer layers      (instead of -m)\n"
          "      --kv-heads H       key/value heads          (instead of -m)\n"
          "      --head-dim D       dimensions per head      (instead of -m)\n"
          "  -c, --ctx N            tokens per sequence (default: the model's context, or 4096)\n"
          "  -b, --batch B          sequences (default 1)\n"
          KV_FLAGS_HELP
          "      --block-tokens N   tokens per KV block (default 16)\n"
          "      --kv-memory SIZE   also show what a pool of SIZE (\"2GiB\") holds\n"
          "      --json             one JSON object\n",
          f);
}

/* Reads layers, KV heads and head dim from a GGUF's metadata. */
/* The layers of a model that attend to a sliding window, the window, and
 * the parts kvd's pool splits the layers into (one part when the model
 * cannot be loaded: the shape alone is read from the file then). */
static uint32_t windowed_layers(const char *path, uint32_t *window, struct kv_parts *parts)
{
    char err[512];
    model_t *m = model_load_unpacked(path, err, sizeof(err));
    uint32_t n = 0;
    *window = 0;
    if (m == NULL)
        return 0;
    for (uint32_t l = 0; l < m->cfg.n_layer; l++)
        n += model_layer_windowed(&m->cfg, l);
    *window = m->cfg.swa_window;
    kv_parts_for_model(&m->cfg, parts);
    model_destroy(&m);
    return n;
}

static void shape_from_gguf(const char *path, struct pool_layout *lay, uint32_t *ctx_train)
{
    char err[512], key[128];
    gguf_ctx_t *g = gguf_open(path, err, sizeof(err));
    if (g == NULL)
        cli_die("%s", err);
    struct gguf_str arch;
    if (gguf_get_str(g, "general.architecture", &arch) != 0 || arch.len == 0 || arch.len > 64)
        cli_die("%s: no general.architecture", path);
    char a[80];
    snprintf(a, sizeof(a), "%.*s", (int)arch.len, arch.ptr);
    uint32_t n_embd = 0, n_head = 0, key_len = 0;
    snprintf(key, sizeof(key), "%s.block_count", a);
    if (gguf_get_u32(g, key, &lay->n_layer) != 0)
        cli_die("%s: no %s", path, key);
    snprintf(key, sizeof(key), "%s.embedding_length", a);
    gguf_get_u32(g, key, &n_embd);
    snprintf(key, sizeof(key), "%s.attention.head_count", a);
    if (gguf_get_u32(g, key, &n_head) != 0 || n_head == 0)
        cli_die("%s: no %s", path, key);
    snprintf(key, sizeof(key), "%s.attention.head_count_kv", a);
    if (gguf_get_u32(g, key, &lay->n_head_kv) != 0)
        lay->n_head_kv = n_head;
    snprintf(key, sizeof(key), "%s.attention.key_length", a);
    if (gguf_get_u32(g, key, &key_len) == 0 && key_len)
        lay->head_dim = key_len;
    else if (n_embd % n_head == 0)
        lay->head_dim = n_embd / n_head;
    else
        cli_die("%s: embedding length %u is not a multiple of %u heads", path, n_embd, n_head);
    snprintf(key, sizeof(key), "%s.context_length", a);
    if (gguf_get_u32(g, key, ctx_train) != 0)
        *ctx_train = 0;
    gguf_close(&g);
}

int main(int argc, char **argv)
{
    enum { OPT_LAYERS = 256, OPT_HEADS, OPT_DIM, OPT_TYPE, OPT_KTYPE, OPT_VTYPE, OPT_ROTATE, OPT_BLOCK, OPT_MEM, OPT_JSON };
    static const struct option longs[] = {
        { "model", required_argument, NULL, 'm' },
        { "ctx", required_argument, NULL, 'c' },
        { "batch", required_argument, NULL, 'b' },
        { "help", no_argument, NULL, 'h' },
        { "layers", required_argument, NULL, OPT_LAYERS },
        { "kv-heads", required_argument, NULL, OPT_HEADS },
        { "head-dim", required_argument, NULL, OPT_DIM },
        { "kv-type", required_argument, NULL, OPT_TYPE },
        { "k-type", required_argument, NULL, OPT_KTYPE },
        { "v-type", required_argument, NULL, OPT_VTYPE },
        { "kv-rotate", required_argument, NULL, OPT_ROTATE },
        { "block-tokens", required_argument, NULL, OPT_BLOCK },
        { "kv-memory", required_argument, NULL, OPT_MEM },
        { "json", no_argument, NULL, OPT_JSON },
        { NULL, 0, NULL, 0 },
    };
    cli_init("kvd-calc");
    const char *model = NULL;
    struct pool_layout lay = { .block_tokens = 16 };
    const char *kv_flags[4] = { NULL, NULL, NULL, NULL };
    long ctx = 0, batch = 1;
    uint64_t kv_bytes = 0;
    bool json = false, have_mem = false;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, ":m:c:b:h", longs, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'c': ctx = cli_long(optarg, "--ctx", 1, 1L << 30); break;
        case 'b': batch = cli_long(optarg, "--batch", 1, 1L << 20); break;
        case 'h': usage(stdout); return 0;
        case OPT_LAYERS: lay.n_layer = (uint32_t)cli_long(optarg, "--layers", 1, 1024); break;
        case OPT_HEADS: lay.n_head_kv = (uint32_t)cli_long(optarg, "--kv-heads", 1, 1024); break;
        case OPT_DIM: lay.head_dim = (uint32_t)cli_long(optarg, "--head-dim", 1, 4096); break;
        case OPT_BLOCK: lay.block_tokens = (uint32_t)cli_long(optarg, "--block-tokens", 1, 4096); break;
        case OPT_TYPE: kv_flags[0] = optarg; break;
        case OPT_KTYPE: kv_flags[1] = optarg; break;
        case OPT_VTYPE: kv_flags[2] = optarg; break;
        case OPT_ROTATE: kv_flags[3] = optarg; break;
        case OPT_MEM:
            if (kvd_parse_size(optarg, &kv_bytes) != 0)
                cli_die("--kv-memory must be a size such as 512MiB or 2G, got '%s'", optarg);
            have_mem = true;
            break;
        case OPT_JSON: json = true; break;
        case ':': cli_die("option %s needs a value", argv[optind - 1]);
        default: cli_die("unknown option %s (see --help)", argv[optind - 1]);
        }
    }
    if (optind < argc)
        cli_die("unexpected argument '%s' (see --help)", argv[optind]);
    struct kv_params kp;
    char err[512];
    if (kv_params_from_flags(&kp, kv_flags[0], kv_flags[1], kv_flags[2], kv_flags[3], err, sizeof(err)) != 0)
        cli_die("%s", err);
    lay.k_type = (uint16_t)kp.k_type;
    lay.v_type = (uint16_t)kp.v_type;
    lay.rotate = kp.rotate;
    uint32_t ctx_train = 0;
    if (model != NULL) {
        if (lay.n_layer || lay.n_head_kv || lay.head_dim)
            cli_die("-m and --layers/--kv-heads/--head-dim exclude each other");
        shape_from_gguf(model, &lay, &ctx_train);
    } else if (!lay.n_layer || !lay.n_head_kv || !lay.head_dim) {
        cli_die("give -m MODEL, or all of --layers, --kv-heads and --head-dim (see --help)");
    }
    if (ctx == 0)
        ctx = ctx_train ? ctx_train : 4096;
    uint32_t window = 0;
    kv_parts_single(lay.n_layer, &lay.parts);
    const uint32_t n_win = model ? windowed_layers(model, &window, &lay.parts) : 0;

    if (kv_format_check(lay.head_dim, lay.k_type, lay.v_type, lay.rotate, err, sizeof(err)) != 0)
        cli_die("%s", err);
    const uint64_t per_token = kv_token_bytes(lay.n_layer, lay.n_head_kv, lay.head_dim, lay.k_type, lay.v_type);
    const uint64_t tokens = (uint64_t)ctx * (uint64_t)batch;
    const uint64_t bytes = per_token * tokens;
    const uint64_t blocks_per_seq = ((uint64_t)ctx + lay.block_tokens - 1) / lay.block_tokens;
    /* paged: whole blocks per sequence; the last one partly empty */
    const uint64_t paged = blocks_per_seq * (uint64_t)batch * lay.block_tokens * per_token;
    /* kvd's pool: blocks of a part of the layers; the windowed parts keep their window */
    const uint64_t held_per_seq = kv_parts_blocks_held(&lay.parts, (uint64_t)ctx, lay.block_tokens);
    const uint64_t part_block_bytes = per_token / lay.n_layer * lay.parts.part_layers * lay.block_tokens;
    const uint64_t pool_bytes = held_per_seq * (uint64_t)batch * part_block_bytes;

    struct pool_capacity cap;
    char line[512] = "";
    if (have_mem) {
        struct pool_params pp = pool_default_params();
        pp.kv_bytes = kv_bytes;
        if (pool_plan(&lay, &pp, &cap, err, sizeof(err)) != 0)
            cli_die("%s", err);
        pool_describe(&lay, &cap, (uint32_t)ctx, line, sizeof(line));
    }
    if (json) {
        printf("{\"layers\":%u,\"kv_heads\":%u,\"head_dim\":%u,\"k_type\":\"%s\",\"v_type\":\"%s\","
               "\"bytes_per_token\":%llu,\"ctx\":%ld,\"batch\":%ld,\"tokens\":%llu,\"bytes\":%llu,"
               "\"block_tokens\":%u,\"blocks\":%llu,\"paged_bytes\":%llu",
               lay.n_layer, lay.n_head_kv, lay.head_dim, kv_type_name(lay.k_type), kv_type_name(lay.v_type),
               (unsigned long long)per_token, ctx, batch, (unsigned long long)tokens,
               (unsigned long long)bytes, lay.block_tokens,
               (unsigned long long)(blocks_per_seq * (uint64_t)batch), (unsigned long long)paged);
        if (have_mem)
            printf(",\"pool\":{\"budget\":%llu,\"total_bytes\":%llu,\"blocks\":%u,\"tokens\":%llu,"
                   "\"sequences\":%llu}",
                   (unsigned long long)kv_bytes, (unsigned long long)cap.total_bytes, cap.n_blocks,
                   (unsigned long long)cap.n_tokens,
                   (unsigned long long)(cap.n_blocks / held_per_seq));
        printf(",\"parts\":{\"parts\":%u,\"part_layers\":%u,\"blocks\":%llu,\"bytes\":%llu}",
               lay.parts.n_parts, lay.parts.part_layers, (unsigned long long)(held_per_seq * (uint64_t)batch),
               (unsigned long long)pool_bytes);
        printf("}\n");
        return 0;
    }
    char b1[32], b2[32];
    printf("shape:           %u layers, %u KV heads, head dim %u, K %s, V %s\n", lay.n_layer,
           lay.n_head_kv, lay.head_dim, kv_type_name(lay.k_type), kv_type_name(lay.v_type));
    printf("per token:       %u x %u x (%zu B of K + %zu B of V) = %llu bytes (%s)\n", lay.n_layer,
           lay.n_head_kv, kv_row_bytes(lay.k_type, lay.head_dim), kv_row_bytes(lay.v_type, lay.head_dim),
           (unsigned long long)per_token, kvd_format_bytes(per_token, b1, sizeof(b1)));
    printf("%ld x %ld tokens:  %llu bytes (%s); paged in blocks of %u: %llu blocks, %s\n", batch,
           ctx, (unsigned long long)bytes, kvd_format_bytes(bytes, b1, sizeof(b1)),
           lay.block_tokens, (unsigned long long)(blocks_per_seq * (uint64_t)batch),
           kvd_format_bytes(paged, b2, sizeof(b2)));
    /* the same tokens with K and V both of each type (q8_0 and q4_0 rows carry
     * one f16 scale per 32 values: 34 and 18 bytes a block) */
    static const uint32_t others[] = { KERN_F32, KERN_F16, KERN_BF16, KERN_Q8_0, KERN_Q4_0 };
    const char *sep = "other types:     ";
    for (size_t i = 0; i < sizeof(others) / sizeof(others[0]); i++) {
        const uint64_t b = kv_token_bytes(lay.n_layer, lay.n_head_kv, lay.head_dim, others[i], others[i]) * tokens;
        if (b == 0)
            continue;   /* a quantized type the head size does not divide into */
        printf("%s%s %s", sep, kv_type_name(others[i]), kvd_format_bytes(b, b1, sizeof(b1)));
        sep = ", ";
    }
    printf("\n");
    if (have_mem)
        printf("pool:            %s\n", line);
    if (n_win > 0) {
        /* the seed's formula per layer group: windowed layers need at most
         * the window and one block of each sequence */
        const uint64_t per_layer = per_token / lay.n_layer;
        const uint64_t keep = (uint64_t)ctx < (uint64_t)window + lay.block_tokens ? (uint64_t)ctx
                                                                                 : (uint64_t)window + lay.block_tokens;
        const uint64_t grouped = per_layer * ((uint64_t)(lay.n_layer - n_win) * (uint64_t)ctx + (uint64_t)n_win * keep) *
                                 (uint64_t)batch;
        printf("layer groups:    %u full, %u windowed (%u positions): per layer group, %llu x %ld tokens need "
               "%s, %.1fx less than %s\n", lay.n_layer - n_win, n_win, window, (unsigned long long)batch, ctx,
               kvd_format_bytes(grouped, b1, sizeof(b1)), (double)bytes / (double)grouped,
               kvd_format_bytes(bytes, b2, sizeof(b2)));
        if (lay.parts.n_parts > 1) {
            printf("kvd's pool:      blocks of %u layers, a table per part (%u): %llu x %ld tokens hold %llu "
                   "blocks, %s, %.1fx less than %s\n",
                   lay.parts.part_layers, lay.parts.n_parts, (unsigned long long)batch, ctx,
                   (unsigned long long)(held_per_seq * (uint64_t)batch),
                   kvd_format_bytes(pool_bytes, b1, sizeof(b1)),
                   (double)paged / (double)pool_bytes, kvd_format_bytes(paged, b2, sizeof(b2)));
        }
    }
    return 0;
}
