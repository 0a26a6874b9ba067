/*
 * fuzz_wire.c - the wire layer on arbitrary bytes: each input is unpacked as
 * each of the four message types, in an arena reset in between. Whatever an
 * unpack function accepts must pack again, unpack again (in a fresh arena)
 * and pack to the same bytes; a generate request's prompt text must decode
 * or be refused cleanly. Every refusal must carry a one-line reason. Anything
 * else - a crash, a sanitizer report, a broken property - is a bug.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_BUDGET ((size_t)16 << 20)  /* room for an 8 MiB prompt_lz4 too */

typedef ProtobufCMessage *(*unpack_fn)(wire_arena_t *a, const void *buf, size_t len, int *code,
                                       char *err, size_t errlen);

static ProtobufCMessage *client(wire_arena_t *a, const void *b, size_t n, int *c, char *e,
                                size_t el)
{
    return (ProtobufCMessage *)wire_client_request_unpack(a, b, n, c, e, el);
}

static ProtobufCMessage *reply(wire_arena_t *a, const void *b, size_t n, int *c, char *e, size_t el)
{
    return (ProtobufCMessage *)wire_server_reply_unpack(a, b, n, c, e, el);
}

static ProtobufCMessage *from_worker(wire_arena_t *a, const void *b, size_t n, int *c, char *e,
                                     size_t el)
{
    return (ProtobufCMessage *)wire_from_worker_unpack(a, b, n, c, e, el);
}

static ProtobufCMessage *to_worker(wire_arena_t *a, const void *b, size_t n, int *c, char *e,
                                   size_t el)
{
    return (ProtobufCMessage *)wire_to_worker_unpack(a, b, n, c, e, el);
}

/* A refusal must have a code and a reason on one line. */
static void check_refusal(int code, const char *err)
{
    if (code >= 0 || err[0] == '\0' || strchr(err, '\n') != NULL)
        abort();
}

static void check_prompt_text(wire_arena_t *a, const Kvd__ClientRequest *r)
{
    if (r->body_case != KVD__CLIENT_REQUEST__BODY_GENERATE)
        return;
    const Kvd__GenerateRequest *g = r->generate;
    const char *text = NULL;
    size_t len = 0;
    char err[256] = "";
    int rc = wire_prompt_text(a, g, &text, &len, err, sizeof(err));
    if (rc == 0) {
        if (text == NULL || len > WIRE_MAX_PROMPT_BYTES)
            abort();
        if (g->prompt == NULL || g->prompt[0] == '\0') {
            if (len != g->prompt_lz4_size || text[len] != '\0')
                abort();
        }
        volatile char sink = len > 0 ? text[len - 1] : 0;
        (void)sink;
    } else if (rc != KVD_ENOTFOUND) {
        check_refusal(rc, err);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static wire_arena_t *a, *b;
    if (a == NULL) {
        a = wire_arena_new(FUZZ_BUDGET);
        b = wire_arena_new(FUZZ_BUDGET);
        if (a == NULL || b == NULL)
            abort();
    }
    static const unpack_fn unpackers[] = { client, reply, from_worker, to_worker };
    for (size_t k = 0; k < sizeof(unpackers) / sizeof(unpackers[0]); k++) {
        wire_arena_reset(a);
        int code = 1;
        char err[256] = "";
        ProtobufCMessage *m = unpackers[k](a, data, size, &code, err, sizeof(err));
        if (m == NULL) {
            check_refusal(code, err);
            continue;
        }
        if (code != 0)
            abort();
        if (k == 0)
            check_prompt_text(a, (const Kvd__ClientRequest *)m);

        /* what was accepted packs, unpacks again and packs to the same bytes */
        uint8_t *p1 = NULL, *p2 = NULL;
        size_t n1 = 0, n2 = 0;
        if (wire_pack(m, &p1, &n1) != 0)
            abort();
        wire_arena_reset(b);
        ProtobufCMessage *m2 = unpackers[k](b, p1, n1, &code, err, sizeof(err));
        if (m2 == NULL || wire_pack(m2, &p2, &n2) != 0)
            abort();
        if (n1 != n2 || memcmp(p1, p2, n1) != 0)
            abort();
        free(p1);
        free(p2);
    }
    return 0;
}
