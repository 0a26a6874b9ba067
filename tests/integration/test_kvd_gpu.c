/*
 * test_kvd_gpu.c - kvd --gpu and kvd-worker --gpu where they cannot run: with
 * no GPU, no driver or a build without CUDA they fail at once with one clear
 * line, before loading a model; option mistakes are named; a worker refuses
 * a pool whose KV data is not where it was told to look, and exits with the
 * status kvd does not restart (CLI_EXIT_UNUSABLE). Runs everywhere: on a
 * machine with a usable GPU the no-GPU messages are not expected, and the
 * checks that need their absence say so and check what happens instead.
 */
#include <string.h>
#include <time.h>

#include "check.h"
#include "cli.h"
#include "err.h"
#include "kvcache.h"
#include "mkmodel.h"
#include "model.h"
#include "pool.h"
#include "testutil.h"
#include "types.h"

#define KVD KVD_BIN_DIR "/kvd"
#define WORKER KVD_BIN_DIR "/kvd-worker"

static char dir[] = "/tmp/kvd-test-gpu-XXXXXX";
static char model[128], sock[160], ep[160], pname[64];
static char *last;  /* output of the last run (stdout and stderr) */

static int run(char **argv)
{
    free(last);
    return tu_run_ex(argv, &last, NULL, 1);
}

#define RUN(...) run((char *[]){ __VA_ARGS__, NULL })

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void expect(const char *needle)
{
    if (strstr(last, needle) == NULL)
        fprintf(stderr, "expected '%s' in: %s", needle, last);
    CHECK(strstr(last, needle) != NULL);
}

/* The message of a device that cannot be used here, or NULL when the device
 * check passed (a GPU is usable). */
static const char *no_gpu_reason(const char *prefix)
{
    const char *p = strstr(last, prefix);
    if (p == NULL)
        return NULL;
    p += strlen(prefix);
    if (strncmp(p, "no usable CUDA device: ", 23) == 0 || strncmp(p, "built without CUDA", 18) == 0)
        return p;
    return NULL;
}

static void test_kvd(void)
{
    /* no GPU: fails in the device check, before the (missing) model */
    double t0 = now_ms();
    int rc = RUN(KVD, "--gpu", "0", "--model", "/nonexistent/model.gguf");
    double ms = now_ms() - t0;
    CHECK_INT(rc, 1);
    const char *why = no_gpu_reason("kvd: --gpu 0: ");
    if (why) {
        printf("kvd --gpu 0: %.0f ms: %s", ms, last);
        CHECK(strncmp(last, "kvd: --gpu 0: ", 14) == 0);
        char *nl = strchr(last, '\n');
        CHECK(nl != NULL && nl[1] == '\0'); /* one line */
        CHECK(ms < 120000); /* a bound on a hang (a probe waiting for a device), not a speed */
        CHECK(strstr(last, "/nonexistent") == NULL);
    } else {
        printf("kvd --gpu 0: a GPU is usable here; it got past the device check: %s", last);
        expect("/nonexistent");
    }
    /* a device that no machine has */
    CHECK_INT(RUN(KVD, "--gpu", "1023", "--model", "/nonexistent/model.gguf"), 1);
    CHECK(no_gpu_reason("kvd: --gpu 1023: ") != NULL);
    if (no_gpu_reason("kvd: --gpu 1023: ") == NULL)
        fprintf(stderr, "got: %s", last);
    /* auto (the default above, or given) is f16 with --gpu, whatever this CPU would pick */
    CHECK_INT(RUN(KVD, "--gpu", "1023", "--kv-type", "auto", "--model", "/nonexistent/model.gguf"), 1);
    CHECK(no_gpu_reason("kvd: --gpu 1023: ") != NULL);
    /* option mistakes */
    CHECK_INT(RUN(KVD, "--workers-per-gpu", "2"), 1);
    expect("--workers-per-gpu needs --gpu");
    CHECK_INT(RUN(KVD, "--gpu", "0", "--workers", "2"), 1);
    expect("--workers-per-gpu");
    CHECK_INT(RUN(KVD, "--gpu", "-1"), 1);
    expect("--gpu must be an integer");
    CHECK_INT(RUN(KVD, "--gpu", "0", "--workers-per-gpu", "65"), 1);
    expect("--workers-per-gpu");
    /* KV types: unknown ones, and f32 and bf16 blocks, which the GPU kernels do not read */
    CHECK_INT(RUN(KVD, "--kv-type", "q5_0"), 1);
    expect("--kv-type must be auto, f16, bf16, f32, q8_0 or q4_0, got 'q5_0'");
    CHECK_INT(RUN(KVD, "--kv-rotate", "sideways"), 1);
    expect("--kv-rotate must be on, off or auto");
    CHECK_INT(RUN(KVD, "--gpu", "0", "--v-type", "f32"), 1);
    expect("the GPU engine reads f16, q8_0 and q4_0 KV blocks, not f32");
    CHECK_INT(RUN(KVD, "--gpu", "0", "--k-type", "bf16"), 1);
    expect("the GPU engine reads f16, q8_0 and q4_0 KV blocks, not bf16");
}

/* Creates this process's pool for the test model with its KV data on device
 * dev (-1: host). */
static pool_t *make_pool(int dev)
{
    char err[256];
    model_t *m = model_load_unpacked(model, err, sizeof(err));
    REQUIRE(m != NULL);
    struct pool_layout lay;
    kv_pool_layout(m, 16, KERN_F16, KERN_F16, 0, true, &lay);
    model_destroy(&m);
    struct pool_params pp = pool_default_params();
    pp.name = pname;
    pp.n_blocks = 64;
    pp.unlink_on_close = true;
    if (dev >= 0) {
        pp.kv_where = POOL_KV_DEVICE;
        pp.kv_device = dev;
    }
    pool_t *p = pool_create(&lay, &pp, NULL, 0, err, sizeof(err));
    if (p == NULL)
        fprintf(stderr, "pool: %s\n", err);
    REQUIRE(p != NULL);
    return p;
}

static void test_worker(void)
{
    pool_t *p = make_pool(0);
    /* a CPU worker cannot use a device pool (given the pool's types: a CPU
     * worker's auto may be bf16, which the pool's layout check refuses first) */
    CHECK_INT(RUN(WORKER, "--model", model, "--pool", pname, "--connect", ep, "--id", "0", "--kv-type", "f16"),
              CLI_EXIT_UNUSABLE);
    expect("keeps its KV data on GPU 0: start the worker with --gpu 0");
    /* nor a worker of another device */
    CHECK_INT(RUN(WORKER, "--model", model, "--pool", pname, "--connect", ep, "--id", "0",
                  "--gpu", "1", "--gpu-socket", sock),
              CLI_EXIT_UNUSABLE);
    expect("keeps its KV data on GPU 0, not GPU 1");
    /* the right device: no GPU here, or (with one) no kvd serving the socket */
    int rc = RUN(WORKER, "--model", model, "--pool", pname, "--connect", ep, "--id", "0",
                 "--gpu", "0", "--gpu-socket", sock);
    CHECK_INT(rc, CLI_EXIT_UNUSABLE);
    if (no_gpu_reason("kvd-worker 0: --gpu 0: ") == NULL)
        expect("cannot reach kvd"); /* a GPU is usable here */
    else
        printf("kvd-worker --gpu 0: %s", last);
    /* --gpu and --gpu-socket go together */
    CHECK_INT(RUN(WORKER, "--model", model, "--pool", pname, "--connect", ep, "--id", "0",
                  "--gpu", "0"),
              1);
    expect("go together");
    pool_close(&p);

    /* a GPU worker cannot use a host pool */
    p = make_pool(-1);
    CHECK_INT(RUN(WORKER, "--model", model, "--pool", pname, "--connect", ep, "--id", "0",
                  "--gpu", "0", "--gpu-socket", sock),
              CLI_EXIT_UNUSABLE);
    expect("keeps its KV data in host memory");
    pool_close(&p);
}

int main(void)
{
    REQUIRE(mkdtemp(dir) != NULL);
    snprintf(model, sizeof(model), "%s/tiny.gguf", dir);
    snprintf(sock, sizeof(sock), "%s/gpu.sock", dir);
    snprintf(ep, sizeof(ep), "ipc://%s/workers.sock", dir);
    snprintf(pname, sizeof(pname), "kvd-test-gpu-%d", (int)getpid());
    struct mkmodel_params mp = mkmodel_default_params();
    char err[256];
    REQUIRE(mkmodel_write(&mp, model, err, sizeof(err)) == 0);
    test_kvd();
    test_worker();
    free(last);
    unlink(model);
    rmdir(dir);
    return CHECK_DONE();
}
