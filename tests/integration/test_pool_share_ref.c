/*
 * test_pool_share_ref.c - a prefix computed by one process is reused by
 * another, through a KV pool in shared memory, with the default model.
 *
 * Process A creates the pool and prefills a 1,000-token prefix into it, then
 * exits (closing the pool cleanly). Process B adopts the pool, finds the
 * prefix, prefills only the remainder, and its last logits (and greedy
 * continuation) equal those of a from-scratch run in a third process, bit for
 * bit. Another namespace shares nothing; another model replaces the pool
 * instead of reading it.
 */
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "mkmodel.h"
#include "pool.h"
#include "testutil.h"

#define PREFIX 1000
#define TOTAL 1100
#define BLOCK 16

static char pool[64];
static char dir[] = "/tmp/kvd-test-share-XXXXXX";

/* Runs kvd-run with a --prompt-ids list and extra arguments; returns stdout. */
static char *kvd_run(const int32_t *ids, int n, char **extra)
{
    static char list[TOTAL * 8];
    size_t k = 0;
    for (int i = 0; i < n; i++)
        k += (size_t)snprintf(list + k, sizeof(list) - k, "%s%d", i ? "," : "", ids[i]);
    char *argv[32];
    int a = 0;
    argv[a++] = KVD_BIN_DIR "/kvd-run";
    argv[a++] = "-m";
    argv[a++] = KVD_TEST_MODEL;
    argv[a++] = "--prompt-ids";
    argv[a++] = list;
    argv[a++] = "-c";
    argv[a++] = "2048";
    argv[a++] = "--temp";
    argv[a++] = "0";
    argv[a++] = "--json";
    while (*extra)
        argv[a++] = *extra++;
    argv[a] = NULL;
    char *out;
    int rc = tu_run_ex(argv, &out, NULL, 0);
    CHECK_INT(rc, 0);
    return out;
}

static long cached(const char *json)
{
    const char *p = strstr(json, "\"cached_prompt_tokens\":");
    REQUIRE(p != NULL);
    return strtol(p + 23, NULL, 10);
}

static size_t read_all(const char *path, void *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    REQUIRE(f != NULL);
    size_t n = fread(buf, 1, cap, f);
    fclose(f);
    return n;
}

int main(void)
{
    REQUIRE(access(KVD_TEST_MODEL, R_OK) == 0);
    REQUIRE(mkdtemp(dir) != NULL);
    snprintf(pool, sizeof(pool), "kvd-test-share-%d", (int)getpid());
    pool_unlink(pool);

    /* token ids of our own text: 1,100 of them */
    FILE *f = fopen(KVD_TEST_DATA "/ppl_text.txt", "r");
    REQUIRE(f != NULL);
    static char text[16384];
    size_t tn = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[tn] = '\0';
    char *out;
    REQUIRE(tu_run((char *[]){ KVD_BIN_DIR "/kvd-run", "-m", KVD_TEST_MODEL, "--tokenize", text,
                               NULL }, &out, NULL) == 0);
    static int32_t ids[8192];
    size_t n = tu_ids(out + 1, ids, 8192);
    free(out);
    REQUIRE(n >= TOTAL);

    char lb[256], lc[256];
    snprintf(lb, sizeof(lb), "%s/b.f32", dir);
    snprintf(lc, sizeof(lc), "%s/c.f32", dir);

    /* A: creates the pool and fills it with the prefix */
    out = kvd_run(ids, PREFIX, (char *[]){ "--pool", pool, "--kv-memory", "48MiB", "-n", "0", NULL });
    CHECK_INT(cached(out), 0);
    free(out);

    /* B: another process reuses every full block of the prefix */
    out = kvd_run(ids, TOTAL, (char *[]){ "--pool", pool, "--kv-memory", "48MiB", "-n", "8",
                                          "--logits-out", lb, NULL });
    CHECK_INT(cached(out), PREFIX / BLOCK * BLOCK);
    int32_t gen_b[16], gen_c[16];
    size_t nb = tu_json_ids(out, "tokens", gen_b, 16);
    free(out);

    /* C: from scratch, no pool */
    out = kvd_run(ids, TOTAL, (char *[]){ "-n", "8", "--logits-out", lc, NULL });
    CHECK_INT(cached(out), 0);
    size_t nc = tu_json_ids(out, "tokens", gen_c, 16);
    free(out);

    static float logit_b[65536], logit_c[65536];
    size_t sb = read_all(lb, logit_b, sizeof(logit_b)), sc = read_all(lc, logit_c, sizeof(logit_c));
    CHECK(sb > 0 && sb == sc);
    CHECK(memcmp(logit_b, logit_c, sb) == 0); /* bit for bit */
    CHECK_INT(nb, 8);
    CHECK(nb == nc && memcmp(gen_b, gen_c, nb * sizeof(int32_t)) == 0);

    /* the whole of B's prompt is cached now, in blocks; another namespace sees none of it */
    out = kvd_run(ids, TOTAL, (char *[]){ "--pool", pool, "--kv-memory", "48MiB", "-n", "0", NULL });
    CHECK_INT(cached(out), (TOTAL - 1) / BLOCK * BLOCK);
    free(out);
    out = kvd_run(ids, TOTAL, (char *[]){ "--pool", pool, "--kv-memory", "48MiB", "-n", "0",
                                          "--namespace", "tenant-b", NULL });
    CHECK_INT(cached(out), 0);
    free(out);

    /* a pool too small for one sequence is refused with a reason */
    REQUIRE(tu_run_ex((char *[]){ KVD_BIN_DIR "/kvd-run", "-m", KVD_TEST_MODEL, "-p", "hi", "-c",
                                  "2048", "--kv-memory", "4MiB", "--pool", pool, NULL },
                      &out, NULL, 1) == 1);
    CHECK(strstr(out, "fewer than one sequence") != NULL);
    free(out);

    /* another model under the same pool name replaces the pool, never reads it */
    char model[256];
    snprintf(model, sizeof(model), "%s/m.gguf", dir);
    struct mkmodel_params mp = mkmodel_default_params();
    mp.n_ctx = 256;
    char err[256];
    REQUIRE(mkmodel_write(&mp, model, err, sizeof(err)) == 0);
    REQUIRE(tu_run_ex((char *[]){ KVD_BIN_DIR "/kvd-run", "-m", model, "-p", "hello", "-n", "2",
                                  "--pool", pool, "--kv-memory", "4MiB", NULL },
                      &out, NULL, 1) == 0);
    if (strstr(out, "replaced pool") == NULL || strstr(out, "another model") == NULL)
        fprintf(stderr, "expected a replaced pool in: %s\n", out);
    CHECK(strstr(out, "replaced pool") != NULL && strstr(out, "another model") != NULL);
    free(out);

    pool_unlink(pool);
    unlink(lb);
    unlink(lc);
    unlink(model);
    rmdir(dir);
    return CHECK_DONE();
}
