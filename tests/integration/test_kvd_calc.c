/*
 * test_kvd_calc.c - kvd-calc as a user runs it: the seed's worked example
 * (32 layers, 8 KV heads, dim 128, 4,096 tokens, f16: 536,870,912 bytes), a
 * shape read from a GGUF, what a budget holds, and one-line errors.
 */
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "mkmodel.h"
#include "testutil.h"

#define CALC KVD_BIN_DIR "/kvd-calc"

static long long field(const char *json, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = strstr(json, pat);
    if (p == NULL) {
        fprintf(stderr, "no %s in %s\n", key, json);
        return -1;
    }
    return strtoll(p + strlen(pat), NULL, 10);
}

int main(void)
{
    char *out;
    CHECK_INT(tu_run((char *[]){ CALC, "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                                 "--ctx", "4096", "--json", NULL }, &out, NULL), 0);
    CHECK_INT(field(out, "bytes_per_token"), 131072);
    CHECK_INT(field(out, "bytes"), 536870912LL);
    CHECK_INT(field(out, "blocks"), 256);
    free(out);
    CHECK_INT(tu_run((char *[]){ CALC, "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                                 "--ctx", "4096", "-b", "4", "--kv-type", "f32", "--json", NULL },
                     &out, NULL), 0);
    CHECK_INT(field(out, "bytes"), 4LL * 2 * 536870912LL);
    free(out);
    /* quantized halves: 34 bytes (q8_0) and 18 bytes (q4_0) per 32 values */
    CHECK_INT(tu_run((char *[]){ CALC, "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                                 "--ctx", "4096", "--kv-type", "q8_0", "--json", NULL }, &out, NULL), 0);
    CHECK_INT(field(out, "bytes_per_token"), 32 * 8 * 2 * 4 * 34);
    free(out);
    CHECK_INT(tu_run((char *[]){ CALC, "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                                 "--ctx", "4096", "--k-type", "q8_0", "--v-type", "q4_0",
                                 "--kv-memory", "1GiB", "--json", NULL }, &out, NULL), 0);
    CHECK_INT(field(out, "bytes_per_token"), 32 * 8 * 4 * (34 + 18));
    CHECK(field(out, "sequences") == (1LL << 30) / (4096LL * 32 * 8 * 4 * (34 + 18)) ||
          field(out, "sequences") == (1LL << 30) / (4096LL * 32 * 8 * 4 * (34 + 18)) - 1);
    free(out);

    /* the shape of a GGUF: 3 layers, 2 KV heads, head dim 16 */
    char dir[] = "/tmp/kvd-test-calc-XXXXXX", model[128], err[256];
    REQUIRE(mkdtemp(dir) != NULL);
    snprintf(model, sizeof(model), "%s/m.gguf", dir);
    struct mkmodel_params p = mkmodel_default_params();
    p.n_layer = 3;
    p.n_head = 4;
    p.n_head_kv = 2;
    p.n_embd = 64;
    p.n_ctx = 512;
    REQUIRE(mkmodel_write(&p, model, err, sizeof(err)) == 0);
    CHECK_INT(tu_run((char *[]){ CALC, "-m", model, "--kv-memory", "1MiB", "--json", NULL }, &out,
                     NULL), 0);
    CHECK_INT(field(out, "layers"), 3);
    CHECK_INT(field(out, "kv_heads"), 2);
    CHECK_INT(field(out, "head_dim"), 16);
    CHECK_INT(field(out, "ctx"), 512); /* the model's own context */
    CHECK_INT(field(out, "bytes_per_token"), 2 * 3 * 2 * 16 * 2);
    long long pool_total = field(out, "total_bytes");
    CHECK(pool_total > 0 && pool_total <= 1 << 20);
    CHECK(field(out, "sequences") >= 1);
    free(out);

    /* errors: one line, exit 1 */
    CHECK_INT(tu_run_ex((char *[]){ CALC, "--layers", "32", NULL }, &out, NULL, 1), 1);
    CHECK(strncmp(out, "kvd-calc: ", 10) == 0 && strstr(out, "--kv-heads") != NULL);
    free(out);
    CHECK_INT(tu_run_ex((char *[]){ CALC, "-m", model, "--kv-memory", "1k", NULL }, &out, NULL, 1), 1);
    CHECK(strstr(out, "smaller than one block") != NULL);
    free(out);
    CHECK_INT(tu_run_ex((char *[]){ CALC, "-m", model, "--kv-memory", "lots", NULL }, &out, NULL, 1), 1);
    CHECK(strstr(out, "must be a size") != NULL);
    free(out);
    CHECK_INT(tu_run_ex((char *[]){ CALC, "-m", model, "--kv-type", "q4_0", NULL }, &out, NULL, 1), 1);
    CHECK(strstr(out, "multiple of 32") != NULL);   /* head dim 16 */
    free(out);
    CHECK_INT(tu_run_ex((char *[]){ CALC, "-m", model, "--v-type", "q5_0", NULL }, &out, NULL, 1), 1);
    CHECK(strstr(out, "--v-type must be auto, f16, bf16, f32, q8_0 or q4_0") != NULL);
    free(out);
    CHECK_INT(tu_run_ex((char *[]){ CALC, "-m", "/nonexistent.gguf", NULL }, &out, NULL, 1), 1);
    CHECK(strncmp(out, "kvd-calc: ", 10) == 0);
    free(out);
    unlink(model);
    rmdir(dir);
    return CHECK_DONE();
}
