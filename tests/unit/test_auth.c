/*
 * test_auth.c - CURVE certificates (common/curve.h) and kvd's ZAP handler
 * (daemon/auth.h) over real ZeroMQ sockets on loopback: a key in the allow
 * directory is admitted under its file's name, any other is refused, and a
 * CURVE server of kvd's admits no one while no handler answers (none bound,
 * one that never replies, one stopped).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "auth.h"
#include "check.h"
#include "curve.h"
#include "err.h"

static char dir[] = "/tmp/kvd-test-auth-XXXXXX";

static void test_certs(void)
{
    char path[512], pub[512], err[512];
    struct curve_cert a, b, r;
    REQUIRE(curve_keypair(&a, err, sizeof(err)) == 0 && curve_keypair(&b, err, sizeof(err)) == 0);
    CHECK(curve_key_ok(a.public_key) && curve_key_ok(a.secret_key));
    CHECK(!curve_key_ok("short") && !curve_key_ok("0123456789012345678901234567890123456789 "));
    snprintf(path, sizeof(path), "%s/a.key_secret", dir);
    snprintf(pub, sizeof(pub), "%s/a.key", dir);
    CHECK_INT(curve_cert_write(path, &a, true, err, sizeof(err)), 0);
    CHECK_INT(curve_cert_write(pub, &a, false, err, sizeof(err)), 0);
    struct stat st;
    CHECK(stat(path, &st) == 0 && (st.st_mode & 077) == 0);
    CHECK_INT(curve_cert_read(path, true, &r, err, sizeof(err)), 0);
    CHECK(strcmp(r.public_key, a.public_key) == 0 && strcmp(r.secret_key, a.secret_key) == 0);
    CHECK_INT(curve_cert_read(pub, false, &r, err, sizeof(err)), 0);
    CHECK(strcmp(r.public_key, a.public_key) == 0 && r.secret_key[0] == '\0');
    CHECK_INT(curve_cert_read(pub, true, &r, err, sizeof(err)), KVD_EFORMAT);     /* no secret in it */
    /* a pair that does not belong together, garbage, a bare key, a missing file */
    struct curve_cert mixed = a;
    memcpy(mixed.public_key, b.public_key, sizeof(mixed.public_key));
    CHECK_INT(curve_cert_write(path, &mixed, true, err, sizeof(err)), 0);
    CHECK_INT(curve_cert_read(path, true, &r, err, sizeof(err)), KVD_EFORMAT);
    FILE *f = fopen(path, "w");
    REQUIRE(f != NULL);
    fputs("metadata\ncurve\n    public-key = \"not a key at all\"\n", f);
    fclose(f);
    CHECK_INT(curve_cert_read(path, false, &r, err, sizeof(err)), KVD_EFORMAT);
    f = fopen(path, "w");
    REQUIRE(f != NULL);
    fprintf(f, "%s\n", b.public_key);
    fclose(f);
    CHECK_INT(curve_cert_read(path, false, &r, err, sizeof(err)), 0);
    CHECK(strcmp(r.public_key, b.public_key) == 0);
    char key[CURVE_KEY_Z85 + 1];
    CHECK_INT(curve_public_key_arg(b.public_key, key, err, sizeof(err)), 0);
    CHECK_INT(curve_public_key_arg(pub, key, err, sizeof(err)), 0);
    CHECK(strcmp(key, a.public_key) == 0);
    CHECK_INT(curve_cert_read("/nonexistent/x.key", false, &r, err, sizeof(err)), KVD_EIO);
    printf("certificates: written 0600, read back, mismatched / malformed / missing ones refused\n");
}

/* A client with keys me (NULL: none) toward server's public key: it sends
 * "ping"; 1 when the server got it (with *user its User-Id), 0 when the
 * client's monitor reported a failed handshake first, -1 when neither came
 * within wait_ms. */
static int try_client(void *ctx, void *server_sock, const char *ep, const struct curve_cert *server,
                      const struct curve_cert *me, int wait_ms, char *user, size_t user_len)
{
    static int n;
    char mon_ep[64];
    snprintf(mon_ep, sizeof(mon_ep), "inproc://test-auth-mon-%d", n++);
    void *c = zmq_socket(ctx, ZMQ_DEALER);
    const int zero = 0;
    zmq_setsockopt(c, ZMQ_LINGER, &zero, sizeof(zero));
    if (me != NULL) {
        zmq_setsockopt(c, ZMQ_CURVE_SERVERKEY, server->public_key, CURVE_KEY_Z85);
        zmq_setsockopt(c, ZMQ_CURVE_PUBLICKEY, me->public_key, CURVE_KEY_Z85);
        zmq_setsockopt(c, ZMQ_CURVE_SECRETKEY, me->secret_key, CURVE_KEY_Z85);
    }
    REQUIRE(zmq_socket_monitor(c, mon_ep, ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                              ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) == 0);
    void *mon = zmq_socket(ctx, ZMQ_PAIR);
    REQUIRE(zmq_connect(mon, mon_ep) == 0);
    REQUIRE(zmq_connect(c, ep) == 0);
    zmq_send(c, "ping", 4, ZMQ_DONTWAIT);
    int got = -1;
    zmq_pollitem_t it[2] = { { server_sock, 0, ZMQ_POLLIN, 0 }, { mon, 0, ZMQ_POLLIN, 0 } };
    if (zmq_poll(it, 2, wait_ms) > 0) {
        if (it[0].revents & ZMQ_POLLIN) {
            zmq_msg_t id, body;
            zmq_msg_init(&id);
            zmq_msg_init(&body);
            REQUIRE(zmq_msg_recv(&id, server_sock, 0) >= 0 && zmq_msg_recv(&body, server_sock, 0) >= 0);
            const char *u = auth_peer(&body);
            snprintf(user, user_len, "%s", u ? u : "");
            zmq_msg_close(&id);
            zmq_msg_close(&body);
            got = 1;
        } else {
            got = 0;
        }
    }
    zmq_close(mon);
    zmq_close(c);
    return got;
}

static void test_zap(void)
{
    char err[512], path[700], adir[512], ep[128], user[128];
    snprintf(adir, sizeof(adir), "%s/allow", dir);
    REQUIRE(mkdir(adir, 0700) == 0);
    struct curve_cert server, alice, bob;
    REQUIRE(curve_keypair(&server, err, sizeof(err)) == 0 && curve_keypair(&alice, err, sizeof(err)) == 0 &&
            curve_keypair(&bob, err, sizeof(err)) == 0);
    snprintf(path, sizeof(path), "%s/alice.key", adir);
    REQUIRE(curve_cert_write(path, &alice, false, err, sizeof(err)) == 0);
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_ROUTER);
    const int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    REQUIRE(auth_curve_server(s, &server, AUTH_CLIENTS, err, sizeof(err)) == 0);
    REQUIRE(zmq_bind(s, "tcp://127.0.0.1:*") == 0);
    size_t len = sizeof(ep);
    REQUIRE(zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &len) == 0);

    /* no handler at all: refused (the domain is enforced), never admitted */
    CHECK_INT(try_client(ctx, s, ep, &server, &alice, 30000, user, sizeof(user)), 0);
    /* a handler bound that never answers: nothing gets through */
    void *mute = zmq_socket(ctx, ZMQ_REP);
    zmq_setsockopt(mute, ZMQ_LINGER, &zero, sizeof(zero));
    REQUIRE(zmq_bind(mute, "inproc://zeromq.zap.01") == 0);
    CHECK(try_client(ctx, s, ep, &server, &alice, 1500, user, sizeof(user)) != 1);
    REQUIRE(zmq_unbind(mute, "inproc://zeromq.zap.01") == 0);     /* a close alone frees it later */
    zmq_close(mute);

    /* kvd's handler: alice in, under her file's name; bob and a plain client out */
    kvd_auth_t *a = auth_new(ctx, adir, NULL, NULL, NULL, NULL, NULL, err, sizeof(err));
    if (a == NULL)
        fprintf(stderr, "auth_new: %s\n", err);
    REQUIRE(a != NULL);
    CHECK_INT(try_client(ctx, s, ep, &server, &alice, 30000, user, sizeof(user)), 1);
    CHECK(strcmp(user, "alice") == 0);
    CHECK_INT(try_client(ctx, s, ep, &server, &bob, 30000, user, sizeof(user)), 0);
    CHECK_INT(try_client(ctx, s, ep, &server, NULL, 30000, user, sizeof(user)), 0);
    struct auth_stats st;
    auth_stats(a, &st);
    CHECK(st.admitted[AUTH_CLIENTS] >= 1 && st.refused[AUTH_CLIENTS] >= 1);
    CHECK_INT(st.keys[AUTH_CLIENTS], 1);
    /* bob's key added and read again: in; alice's removed: out */
    snprintf(path, sizeof(path), "%s/bob.key", adir);
    REQUIRE(curve_cert_write(path, &bob, false, err, sizeof(err)) == 0);
    snprintf(path, sizeof(path), "%s/alice.key", adir);
    REQUIRE(unlink(path) == 0);
    REQUIRE(auth_reload(a, err, sizeof(err)) == 0);
    CHECK_INT(try_client(ctx, s, ep, &server, &bob, 30000, user, sizeof(user)), 1);
    CHECK(strcmp(user, "bob") == 0);
    CHECK_INT(try_client(ctx, s, ep, &server, &alice, 30000, user, sizeof(user)), 0);
    /* the handler stopped: refused again, never admitted */
    auth_destroy(&a);
    CHECK_INT(try_client(ctx, s, ep, &server, &bob, 30000, user, sizeof(user)), 0);
    zmq_close(s);
    zmq_ctx_term(ctx);
    printf("ZAP: allowed key admitted by name, others refused; no handler, a mute one and a stopped one admit "
           "no one; a reload adds and revokes\n");
}

int main(void)
{
    REQUIRE(mkdtemp(dir) != NULL);
    test_certs();
    test_zap();
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return CHECK_DONE();
}
