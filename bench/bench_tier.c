/*
 * bench_tier.c - bench-tier: what LZ4 does to real KV blocks, the numbers a
 * compressed host tier of the cache (issue 18) is designed from.
 *
 * The model prefills a text (tests/data/ppl_text.txt, 2,048 tokens by
 * default) into a cache of each KV format kvd has (f16, q8_0 and q4_0 with
 * their default rotation, f32), then every full block (all layers' K and V of
 * 16 positions, as kvd would evict it) is compressed with LZ4 (the fast mode,
 * LZ4_compress_default) as it is, and after a byte shuffle:
 *   f16 / f32: the bytes of every element regrouped by significance (all
 *              low bytes, ..., all high bytes: sign and exponent together);
 *   q8_0 / q4_0: the half-precision scales of every 32-value unit first, as
 *              two byte planes, then all the codes.
 * Printed per format: the block's bytes, the compressed size against them,
 * and compress / decompress speed in GB/s of uncompressed bytes on one thread
 * (median of 9 passes over all blocks). Every block is decompressed and
 * unshuffled back and compared with the original.
 *
 * Usage: bench-tier [-m MODEL] [--text FILE] [--tokens N] [-t THREADS] [--json]
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <lz4.h>

#include "err.h"
#include "forward.h"
#include "kvcache.h"
#include "model.h"
#include "tok.h"
#include "types.h"

#define PASSES 9

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void die(const char *what, const char *why)
{
    fprintf(stderr, "bench-tier: %s: %s\n", what, why);
    exit(1);
}

/* The shuffle of one block of n bytes made of units of `unit` bytes whose
 * first `planes` bytes are regrouped by position (see the top). */
static void shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t unit, size_t planes)
{
    const size_t units = n / unit, rest = unit - planes;
    uint8_t *o = dst;
    for (size_t p = 0; p < planes; p++)
        for (size_t u = 0; u < units; u++)
            *o++ = src[u * unit + p];
    for (size_t u = 0; u < units && rest > 0; u++, o += rest)
        memcpy(o, src + u * unit + planes, rest);
}

static void unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t unit, size_t planes)
{
    const size_t units = n / unit, rest = unit - planes;
    const uint8_t *in = src;
    for (size_t p = 0; p < planes; p++)
        for (size_t u = 0; u < units; u++)
            dst[u * unit + p] = *in++;
    for (size_t u = 0; u < units && rest > 0; u++, in += rest)
        memcpy(dst + u * unit + planes, in, rest);
}

struct result {
    double ratio, c_gbs, d_gbs;
};

/* Compresses the n_blocks blocks of bb bytes at mem (shuffled when unit > 0)
 * PASSES times; checks the round trip. */
static struct result measure(const uint8_t *mem, size_t n_blocks, size_t bb, size_t unit, size_t planes)
{
    const int cap = LZ4_compressBound((int)bb);
    uint8_t *sh = malloc(bb), *comp = malloc((size_t)cap * n_blocks), *back = malloc(bb), *un = malloc(bb);
    int *clen = malloc(n_blocks * sizeof(int));
    if (!sh || !comp || !back || !un || !clen)
        die("memory", "out of memory");
    double ct[PASSES], dt[PASSES];
    size_t total = 0;
    for (int pass = 0; pass < PASSES; pass++) {
        double t0 = now_s();
        total = 0;
        for (size_t b = 0; b < n_blocks; b++) {
            const uint8_t *src = mem + b * bb;
            if (unit) {
                shuffle(sh, src, bb, unit, planes);
                src = sh;
            }
            clen[b] = LZ4_compress_default((const char *)src, (char *)comp + b * (size_t)cap, (int)bb, cap);
            if (clen[b] <= 0)
                die("LZ4", "compression failed");
            total += (size_t)clen[b];
        }
        ct[pass] = now_s() - t0;
        t0 = now_s();
        for (size_t b = 0; b < n_blocks; b++) {
            int got = LZ4_decompress_safe((const char *)comp + b * (size_t)cap, (char *)back, clen[b], (int)bb);
            if (got != (int)bb)
                die("LZ4", "decompression failed");
            const uint8_t *out = back;
            if (unit) {
                unshuffle(un, back, bb, unit, planes);
                out = un;
            }
            if (pass == 0 && memcmp(out, mem + b * bb, bb) != 0)
                die("round trip", "a block came back different");
        }
        dt[pass] = now_s() - t0;
    }
    qsort(ct, PASSES, sizeof(double), cmp_double);
    qsort(dt, PASSES, sizeof(double), cmp_double);
    const double bytes = (double)bb * (double)n_blocks;
    struct result r = { (double)total / bytes, bytes / ct[PASSES / 2] / 1e9, bytes / dt[PASSES / 2] / 1e9 };
    free(sh);
    free(comp);
    free(back);
    free(un);
    free(clen);
    return r;
}

int main(int argc, char **argv)
{
    const char *model_path = getenv("KVD_MODEL") ? getenv("KVD_MODEL") : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    const char *text_path = "tests/data/ppl_text.txt";
    long n_tok = 2048;
    int threads = 0;
    bool json = false;
    static const struct option longs[] = {
        { "model", required_argument, NULL, 'm' }, { "text", required_argument, NULL, 'x' },
        { "tokens", required_argument, NULL, 'n' }, { "threads", required_argument, NULL, 't' },
        { "json", no_argument, NULL, 'j' }, { NULL, 0, NULL, 0 },
    };
    int c;
    while ((c = getopt_long(argc, argv, "m:t:", longs, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'x': text_path = optarg; break;
        case 'n': n_tok = atol(optarg); break;
        case 't': threads = atoi(optarg); break;
        case 'j': json = true; break;
        default:
            fprintf(stderr, "usage: bench-tier [-m MODEL] [--text FILE] [--tokens N] [-t THREADS] [--json]\n");
            return 2;
        }
    }
    char err[512];
    model_t *m = model_load(model_path, err, sizeof(err));
    if (m == NULL)
        die(model_path, err);
    tok_t *tk = tok_new_from_gguf(m->gguf, err, sizeof(err));
    if (tk == NULL)
        die("tokenizer", err);
    FILE *f = fopen(text_path, "rb");
    if (f == NULL)
        die(text_path, "cannot open");
    static char text[1 << 20];
    size_t len = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    int32_t *ids = malloc((len + 2) * sizeof(int32_t));
    size_t n = 0;
    if (ids == NULL || tok_encode(tk, text, len, false, ids, len + 2, &n) != 0)
        die("tokenizer", "cannot tokenize the text");
    if ((long)n < n_tok)
        n_tok = (long)n;
    n_tok = n_tok / 16 * 16;
    const uint32_t n_blocks = (uint32_t)(n_tok / 16);
    static const uint32_t types[] = { KERN_F16, KERN_Q8_0, KERN_Q4_0, KERN_F32 };
    if (!json)
        printf("bench-tier: %s, %ld tokens of %s, blocks of 16 positions (all layers' K and V)\n"
               "| KV format | block bytes | LZ4 size | shuffled | compress GB/s | shuffled | decompress GB/s | shuffled |\n"
               "|---|---|---|---|---|---|---|---|\n",
               model_path, n_tok, text_path);
    else
        printf("{\"model\":\"%s\",\"tokens\":%ld,\"formats\":[", model_path, n_tok);
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
        struct kv_params kp = kv_default_params();
        kp.n_blocks = n_blocks + 1;
        kp.k_type = kp.v_type = types[ti];
        kp.rotate = kv_rotate_default(types[ti], types[ti]);
        kvcache_t *kv = kvcache_new(&m->cfg, &kp, err, sizeof(err));
        if (kv == NULL)
            die("cache", err);
        struct engine_params ep = engine_default_params();
        ep.n_threads = threads;
        ep.max_ctx = (uint32_t)n_tok + 16;
        engine_t *e = engine_new(m, kv, &ep, err, sizeof(err));
        if (e == NULL)
            die("engine", err);
        uint32_t *table = malloc(kp.n_blocks * sizeof(uint32_t));
        for (uint32_t i = 0; i < kp.n_blocks; i++)
            table[i] = i;
        for (long at = 0; at < n_tok; at += 512) {
            const uint32_t k = (uint32_t)(n_tok - at < 512 ? n_tok - at : 512);
            struct fwd_seq s = { ids + at, k, (uint32_t)at, table, kp.n_blocks, false, NULL };
            const float *lg;
            uint32_t rows;
            if (engine_step(e, &s, 1, &lg, &rows, err, sizeof(err)) != 0)
                die("prefill", err);
        }
        const size_t unit = types[ti] == KERN_F16 ? 2 : types[ti] == KERN_F32 ? 4 : kv->k_row_bytes / (m->cfg.head_dim / 32);
        const size_t planes = types[ti] == KERN_F32 ? 4 : 2;
        const struct result plain = measure(kv->mem, n_blocks, kv->block_bytes, 0, 0);
        const struct result sh = measure(kv->mem, n_blocks, kv->block_bytes, unit, planes);
        char name[64];
        kv_describe(&kp, name, sizeof(name));
        if (json)
            printf("%s{\"format\":\"%s\",\"block_bytes\":%zu,\"ratio\":%.4f,\"ratio_shuffled\":%.4f,"
                   "\"compress_gbs\":%.3f,\"compress_gbs_shuffled\":%.3f,\"decompress_gbs\":%.3f,"
                   "\"decompress_gbs_shuffled\":%.3f}",
                   ti ? "," : "", name, kv->block_bytes, plain.ratio, sh.ratio, plain.c_gbs, sh.c_gbs, plain.d_gbs,
                   sh.d_gbs);
        else
            printf("| %s | %zu | %.1f%% | %.1f%% | %.2f | %.2f | %.2f | %.2f |\n", name, kv->block_bytes,
                   100 * plain.ratio, 100 * sh.ratio, plain.c_gbs, sh.c_gbs, plain.d_gbs, sh.d_gbs);
        free(table);
        engine_destroy(&e);
        kvcache_destroy(&kv);
    }
    if (json)
        printf("]}\n");
    free(ids);
    tok_destroy(&tk);
    model_destroy(&m);
    return 0;
}
