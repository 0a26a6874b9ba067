/*
 * test_client_kvcli.c - kvcli as a user drives it, against fake_kvd.h (a
 * scripted stand-in for kvd's socket, not kvd): streamed, whole and JSON
 * output, the options as they reach the wire, stats and health, one-line
 * errors with exit 1, usage errors with exit 2, and Ctrl-C cancelling a
 * streamed generate (exit 130). The end-to-end tests against kvd are
 * elsewhere.
 */
#include <poll.h>
#include <signal.h>
#include <string.h>

#include "check.h"
#include "fake_kvd.h"
#include "testutil.h"

#define KVCLI KVD_BIN_DIR "/kvcli"

static struct fake_kvd *fake;
static char *last;      /* stdout and stderr of the last run */

#define RUN(...) run((char *[]){ KVCLI, "-e", fake->endpoint, __VA_ARGS__, NULL })

static int run(char **argv)
{
    free(last);
    return tu_run_ex(argv, &last, NULL, 1);
}

#define CHECK_OUT(want) do { check_count++; if (strcmp(last, (want)) != 0) { check_failures++; \
    fprintf(stderr, "%s:%d: output\n  '%s'\nwanted\n  '%s'\n", __FILE__, __LINE__, last, \
            (want)); } } while (0)

#define CHECK_PREFIX(want) do { check_count++; if (strncmp(last, (want), strlen(want)) != 0) { \
    check_failures++; fprintf(stderr, "%s:%d: output\n  '%s'\ndoes not start with\n  '%s'\n", \
                              __FILE__, __LINE__, last, (want)); } } while (0)

#define CHECK_HAS(needle) do { check_count++; if (strstr(last, (needle)) == NULL) { \
    check_failures++; fprintf(stderr, "%s:%d: '%s' not in output:\n%s\n", __FILE__, __LINE__, \
                              (needle), last); } } while (0)

/* A failed run: the status and exactly one line, "kvcli: " and the needle. */
static void expect_error(int rc, int want_rc, const char *needle)
{
    CHECK_INT(rc, want_rc);
    const char *line = strstr(last, "kvcli: ");
    CHECK(line != NULL);
    if (line == NULL)
        return;
    if (strstr(line, needle) == NULL)
        fprintf(stderr, "expected '%s' in: %s", needle, line);
    CHECK(strstr(line, needle) != NULL);
    const char *nl = strchr(line, '\n');
    CHECK(nl != NULL && nl[1] == '\0');
}

static void test_generate(void)
{
    CHECK_INT(RUN("generate", "stream"), 0);
    CHECK_OUT("Hello\n");
    CHECK_INT(RUN("generate", "--no-stream", "stream"), 0);
    CHECK_OUT("Hello\n");
    CHECK_INT(RUN("generate", "--json", "stream"), 0);
    CHECK_PREFIX("{\"text\":\"Hello\",\"tokens\":[10,11],\"finish_reason\":\"length\","
              "\"cached_prompt_tokens\":4,\"usage\":{\"prompt_tokens\":7,"
              "\"cached_prompt_tokens\":4,\"host_cached_prompt_tokens\":0,\"disk_cached_prompt_tokens\":0,"
              "\"completion_tokens\":2},\"timings\":{"
              "\"queued_ms\":1.0,\"ttft_ms\":2.0,\"decode_ms\":3.0,\"total_ms\":4.0},"
              "\"chunks\":2,\"request_id\":");
    CHECK_INT(RUN("generate", "deadline"), 0);
    CHECK_OUT("par\n");
    CHECK_INT(RUN("generate", "--json", "--no-stream", "deadline"), 0);
    CHECK_HAS("\"finish_reason\":\"deadline\"");

    /* every option, as the fake saw it (it describes the request) */
    CHECK_INT(RUN("generate", "--no-stream", "-n", "16", "--temp", "0.5", "--top-k", "20",
                  "--top-p", "0.9", "--min-p", "0.05", "--repeat-penalty", "1.1", "--seed", "42",
                  "--stop", "a", "--stop", "bc", "--namespace", "tenant", "--no-cache",
                  "--deadline", "5000", "--ignore-eos", "echo all"), 0);
    char want[512];
    snprintf(want, sizeof(want), "prompt len=8 hash=%08x temp=0.50 top_k=20 top_p=0.90 "
             "min_p=0.05 rep=1.10 seed=42 max=16 stream=1 deadline=5000 ns=tenant eos=1 "
             "nocache=1 stops=a,bc\n", fake_kvd_hash("echo all", 8));
    CHECK_OUT(want);
    CHECK_INT(RUN("generate", "--no-stream", "--chat", "--system", "Be brief.", "echo hi"), 0);
    CHECK_HAS("msgs=system:Be brief.|user:echo hi temp=- ");
    CHECK_INT(RUN("generate", "--no-stream", "--chat", "echo hi"), 0);
    CHECK_HAS("msgs=user:echo hi temp=- ");
    CHECK_INT(RUN("generate", "--no-stream", "--prompt-ids", "5,6,7"), 0);
    CHECK_HAS("ids=5,6,7 temp=- ");
    /* options after the prompt, and global options after the command */
    CHECK_INT(run((char *[]){ KVCLI, "generate", "echo late", "--no-stream", "--seed", "7",
                              "-e", fake->endpoint, "--timeout", "60000", NULL }), 0);
    CHECK_HAS(" seed=7 ");

    /* PROMPT "-" reads stdin */
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "printf 'echo from stdin' | %s -e %s generate --no-stream -",
             KVCLI, fake->endpoint);
    CHECK_INT(run((char *[]){ "/bin/sh", "-c", cmd, NULL }), 0);
    snprintf(want, sizeof(want), "prompt len=15 hash=%08x ", fake_kvd_hash("echo from stdin", 15));
    CHECK_HAS(want);
}

static void test_errors(void)
{
    expect_error(RUN("generate", "overloaded"), 1,
                 "kvcli: overloaded, retry later: queue full (retry after 250 ms)");
    expect_error(RUN("generate", "toolong"), 1, "longer than the context: prompt of 9000");
    expect_error(RUN("generate", "midfail"), 1, "internal error: worker died");
    CHECK(strncmp(last, "par\n", 4) == 0);     /* what came, then the error */
    expect_error(RUN("generate", "garbage"), 1, "unreadable reply from kvd");
    expect_error(RUN("generate", "errcancel"), 1, "cancelled: cancelled by admin");
    expect_error(RUN("generate", "--temp", "1000", "echo"), 1, "temperature");

    char nowhere[] = "ipc:///tmp/kvd-test-nobody-here/kvd.sock";
    expect_error(run((char *[]){ KVCLI, "-e", nowhere, "--timeout", "300", "health", NULL }), 1,
                 "no reply from kvd at ipc:///tmp/kvd-test-nobody-here");
    expect_error(run((char *[]){ KVCLI, "-e", nowhere, "--timeout", "300", "generate", "x",
                                 NULL }), 1, "kvd at ipc:///tmp/kvd-test-nobody-here");
    expect_error(run((char *[]){ KVCLI, "-e", "nonsense", "health", NULL }), 1,
                 "malformed endpoint");

    /* usage errors: exit 2 */
    expect_error(run((char *[]){ KVCLI, NULL }), 2, "no command");
    expect_error(RUN("frobnicate"), 2, "unknown command");
    expect_error(RUN("generate"), 2, "needs a PROMPT");
    expect_error(RUN("generate", "a", "b"), 2, "unexpected argument 'b'");
    expect_error(RUN("generate", "--system", "x", "hi"), 2, "need --chat");
    expect_error(RUN("generate", "--temp", "hot", "hi"), 2, "--temp");
    expect_error(RUN("generate", "--bogus", "hi"), 2, "unknown option --bogus");
    expect_error(RUN("generate", "-n"), 2, "needs a value");
    expect_error(RUN("generate", "--prompt-ids", "1,x"), 2, "--prompt-ids");
    expect_error(RUN("stats", "extra"), 2, "unexpected argument");
    expect_error(RUN("health", "--json"), 2, "no --json");
    CHECK_INT(run((char *[]){ KVCLI, "--help", NULL }), 0);
    CHECK_HAS("usage: kvcli");
}

static void test_stats_health(void)
{
    CHECK_INT(RUN("stats"), 0);
    CHECK_HAS("requests  2 running, 1 queued, 40 done, 3 failed\n");
    CHECK_HAS("tokens    1000 prompt, 250 of them cached (hit rate 25.0%), 500 generated\n");
    CHECK_HAS("blocks    128 of 16 tokens");
    CHECK_HAS(": 60 free, 30 cached, 36 in use, 2 pending\n");
    CHECK_HAS("events    5 evictions, 1 preemptions, 4 bad messages\n");
    CHECK_HAS("worker 0  pid 1000, alive, 3 running, 5000 tokens, 0 restarts\n");
    CHECK_HAS("worker 1  pid 1001, dead, 2 running, 5001 tokens, 1 restarts\n");
    CHECK_INT(RUN("stats", "--json"), 0);
    CHECK_HAS("\"requests_done\":40,");
    CHECK_HAS("\"cached_prompt_tokens\":250,");
    CHECK_HAS("\"workers\":[{\"id\":0,\"pid\":1000,\"alive\":true,\"running\":3,"
              "\"tokens\":5000,\"restarts\":0,\"host\":\"\"},{\"id\":1,");
    /* every figure of kvd_stats_fields.h, by its name */
    CHECK_HAS("\"host_cache_declined\":0,");
    CHECK_HAS("\"pins_refused\":0,");
    CHECK_HAS(",\"tenants\":[],\"hosts\":[]}\n");

    CHECK_INT(RUN("health"), 0);
    CHECK_OUT("ok (2 workers alive)\n");
    atomic_store(&fake->unhealthy, true);
    CHECK_INT(RUN("health"), 1);
    CHECK_OUT("not ok (0 workers alive)\n");
    atomic_store(&fake->unhealthy, false);
}

/* Whether out is the slow stream's chunks "w0 w1 ... wN " up to some N <
 * 399 (so the stream was stopped before its end), then a newline. */
static bool stopped_stream(const char *out)
{
    const char *p = out;
    unsigned i = 0;
    char want[16];
    for (;; i++) {
        int len = snprintf(want, sizeof(want), "w%u ", i);
        if (strncmp(p, want, (size_t)len) != 0)
            break;
        p += len;
    }
    return i > 0 && i < 400 && strcmp(p, "\n") == 0;
}

/* Ctrl-C in a streamed generate: the text so far, a cancel sent, exit 130. */
static void test_sigint(void)
{
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        execl(KVCLI, KVCLI, "-e", fake->endpoint, "generate", "slow", (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    char out[8192];
    size_t n = 0;
    bool sent = false;
    double end = fake_kvd_now_ms() + 300000; /* a bound on a hang; EOF ends it */
    while (n + 1 < sizeof(out) && fake_kvd_now_ms() < end) {
        struct pollfd pf = { fds[0], POLLIN, 0 };
        if (poll(&pf, 1, 100) <= 0)
            continue;
        ssize_t r = read(fds[0], out + n, sizeof(out) - 1 - n);
        if (r <= 0)
            break;
        n += (size_t)r;
        out[n] = '\0';
        if (!sent && strstr(out, "w2 ") != NULL) {
            kill(pid, SIGINT);
            sent = true;
        }
    }
    out[n] = '\0';
    close(fds[0]);
    int st;
    waitpid(pid, &st, 0);
    CHECK(sent);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 130);
    CHECK(strncmp(out, "w0 w1 w2 ", 9) == 0);
    CHECK(n > 0 && out[n - 1] == '\n');
    /* the chunks so far, in order, then the newline: not the whole stream,
     * however many chunks came before kvcli got the signal */
    if (!stopped_stream(out))
        fprintf(stderr, "kvcli's output: '%s'\n", out);
    CHECK(stopped_stream(out));
    CHECK(fake_kvd_saw_cancel(fake, fake_kvd_last_generate(fake), 300000));
}

int main(void)
{
    fake = fake_kvd_start();
    REQUIRE(fake != NULL);
    test_generate();
    test_errors();
    test_stats_health();
    test_sigint();
    fake_kvd_stop(&fake);
    free(last);
    return CHECK_DONE();
}
