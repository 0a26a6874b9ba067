/*
 * example.c - the smallest useful program on libkvd-client: one chat request
 * to kvd at its default endpoint, the answer streamed to stdout.
 *
 *   cc example.c $(pkg-config --cflags --libs kvd-client) -o kvd-example
 *   ./kvd-example "Why is the sky blue?"
 */
#include <stdio.h>

#include <kvd_client.h>

/* Prints each piece of text as it comes; returning non-zero would cancel. */
static int print_chunk(void *user, const char *text, size_t len, const int32_t *tokens,
                       size_t n_tokens, uint32_t seq)
{
    (void)user, (void)tokens, (void)n_tokens, (void)seq;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv)
{
    const char *question = argc > 1 ? argv[1] : "What is a KV cache? Answer in one sentence.";
    char err[256];
    kvd_client_t *c = kvd_client_new(NULL, 0, err, sizeof(err));
    if (c == NULL) {
        fprintf(stderr, "kvd-example: %s\n", err);
        return 1;
    }

    struct kvd_chat_msg msgs[] = {
        { "system", "You are a helpful assistant." },
        { "user", question },
    };
    struct kvd_gen_params p;
    kvd_gen_params_init(&p);
    p.messages = msgs;
    p.n_messages = 2;
    p.max_tokens = 128;

    struct kvd_result r;
    int rc = kvd_generate_stream(c, &p, print_chunk, NULL, &r);
    putchar('\n');
    if (rc != 0)
        fprintf(stderr, "kvd-example: %s%s%s\n", kvd_strerror(rc), r.error[0] ? ": " : "",
                r.error);
    else
        fprintf(stderr, "kvd-example: %u prompt tokens (%u cached), %u generated in %.0f ms\n",
                r.prompt_tokens, r.cached_prompt_tokens, r.completion_tokens, r.total_ms);
    kvd_result_free(&r);
    kvd_client_destroy(&c);
    return rc == 0 ? 0 : 1;
}
