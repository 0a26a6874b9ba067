/*
 * fuzz_zap.c - kvd's ZAP handler (daemon/auth.h) on arbitrary requests: the
 * input is cut into frames (a first byte for how many, 0-8, then each frame
 * as one length byte and its bytes) and handed to auth_decide over a fixed
 * set of keys: alice and bob may connect as clients, carol as a worker. The
 * answer must be 200 exactly when the request is well formed (7 frames,
 * version 1.0, mechanism CURVE, a 32-byte key) and names a key allowed in its
 * domain, with that key's name; anything else is 400. A crash, a sanitizer
 * report or any other answer is a bug.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "auth.h"
#include "curve.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Fixed secret keys (any 32 bytes are one), so that a corpus can hold the
 * public keys they make. */
static const char *const secrets[3] = {
    "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6",     /* alice, a client */
    "D:)Q[IlAW!ahhC2ac:9*A}h:p?([4%wOTJ%JR%cs",     /* bob, a client */
    "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7",     /* carol, a worker */
};
static const char *const names[3] = { "alice", "bob", "carol" };
static uint8_t raw[3][32];
static kvd_auth_t *auth;

static void setup(void)
{
    char dir[] = "/tmp/kvd-fuzz-zap-XXXXXX", path[256], err[256];
    if (mkdtemp(dir) == NULL)
        abort();
    char sub[2][128];
    for (int d = 0; d < 2; d++) {
        snprintf(sub[d], sizeof(sub[d]), "%s/%s", dir, d ? "workers" : "clients");
        if (mkdir(sub[d], 0700) != 0)
            abort();
    }
    for (int i = 0; i < 3; i++) {
        struct curve_cert c;
        memset(&c, 0, sizeof(c));
        if (zmq_curve_public(c.public_key, secrets[i]) != 0 || zmq_z85_decode(raw[i], c.public_key) == NULL)
            abort();
        snprintf(path, sizeof(path), "%s/%s.key", sub[i == 2], names[i]);
        if (curve_cert_write(path, &c, false, err, sizeof(err)) != 0)
            abort();
    }
    auth = auth_new(NULL, sub[0], sub[1], NULL, NULL, NULL, NULL, err, sizeof(err));
    if (auth == NULL) {
        fprintf(stderr, "auth_new: %s\n", err);
        abort();
    }
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof(path), "%s/%s.key", sub[i == 2], names[i]);
        unlink(path);
    }
    rmdir(sub[0]);
    rmdir(sub[1]);
    rmdir(dir);
}

static bool is(const uint8_t *f, size_t n, const char *s)
{
    return n == strlen(s) && memcmp(f, s, n) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (auth == NULL)
        setup();
    const uint8_t *f[8];
    size_t len[8];
    int n = size > 0 ? data[0] % 9 : 0;
    size_t at = size > 0 ? 1 : 0;
    for (int i = 0; i < n; i++) {
        size_t l = at < size ? data[at++] : 0;
        if (l > size - at)
            l = size - at;
        f[i] = data + at;
        len[i] = l;
        at += l;
    }
    char name[AUTH_NAME_MAX + 1];
    const int code = auth_decide(auth, f, len, n, name);
    /* what the answer must be */
    int want = -1;      /* the index of the key that must be admitted, or -1 */
    if (n == 7 && is(f[0], len[0], "1.0") && is(f[5], len[5], "CURVE") && len[6] == 32) {
        const int domain = is(f[2], len[2], "clients") ? 0 : is(f[2], len[2], "workers") ? 1 : -1;
        for (int i = 0; i < 3 && domain >= 0; i++)
            if ((i == 2) == (domain == 1) && memcmp(f[6], raw[i], 32) == 0)
                want = i;
    }
    if (want >= 0 ? code != 200 || strcmp(name, names[want]) != 0 : code != 400 || name[0] != '\0') {
        fprintf(stderr, "fuzz_zap: answered %d (%s), want %s\n", code, name, want >= 0 ? names[want] : "400");
        abort();
    }
    return 0;
}
