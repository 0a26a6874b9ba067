/* auth.c - the ZAP handler and CURVE servers (auth.h). */
#include "auth.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "err.h"

/* ZMQ_ZAP_ENFORCE_DOMAIN is a draft option in libzmq 4.3's header; the
 * library takes it (auth_curve_server checks that it did). */
#ifndef ZMQ_ZAP_ENFORCE_DOMAIN
#define ZMQ_ZAP_ENFORCE_DOMAIN 93
#endif

static const char *const domain_name[AUTH_DOMAINS] = { "clients", "workers", "events" };

struct key {
    char z85[CURVE_KEY_Z85 + 1];
    char name[AUTH_NAME_MAX + 1];
};

struct keyset {
    struct key *v;
    uint32_t n;
};

struct kvd_auth {
    void *zctx;
    char *dir[AUTH_DOMAINS];
    struct key extra;               /* extra worker key ("" when none) */
    void (*log)(void *user, const char *line);
    void *user;
    pthread_mutex_t mu;             /* keys and stats: the handler reads, reload swaps */
    struct keyset keys[AUTH_DOMAINS];
    struct auth_stats st;
    void *rep;                      /* the handler's socket (its thread's) */
    volatile int stop;
    pthread_t thread;
};

static bool name_ok(const char *s, size_t n)
{
    if (n == 0 || n > AUTH_NAME_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '.' || s[i] == '_' || s[i] == '-'))
            return false;
    return true;
}

/* The public keys of dir: every NAME.key file (a certificate or a bare key). */
static int load_dir(kvd_auth_t *a, const char *dir, struct keyset *out, char *err, size_t errlen)
{
    out->v = NULL;
    out->n = 0;
    DIR *d = opendir(dir);
    if (d == NULL)
        return kvd_seterr(err, errlen, KVD_EIO, "%s: %s", dir, strerror(errno));
    struct dirent *e;
    uint32_t cap = 0;
    int rc = 0;
    while ((e = readdir(d)) != NULL) {
        const size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".key") != 0)
            continue;
        char path[4200], why[300], line[4400];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        struct curve_cert c;
        if (!name_ok(e->d_name, len - 4)) {
            snprintf(line, sizeof(line), "auth: %s skipped: a key's name is 1-%d of [A-Za-z0-9._-]", path,
                     AUTH_NAME_MAX);
        } else if (curve_cert_read(path, false, &c, why, sizeof(why)) != 0) {
            snprintf(line, sizeof(line), "auth: skipped: %s", why);
        } else {
            if (out->n == cap) {
                cap = cap ? 2 * cap : 16;
                struct key *v = realloc(out->v, cap * sizeof(*v));
                if (v == NULL) {
                    rc = kvd_seterr(err, errlen, KVD_ENOMEM, "auth: out of memory");
                    break;
                }
                out->v = v;
            }
            struct key *k = &out->v[out->n++];
            memcpy(k->z85, c.public_key, sizeof(k->z85));
            memcpy(k->name, e->d_name, len - 4);
            k->name[len - 4] = '\0';
            continue;
        }
        if (a->log)
            a->log(a->user, line);
    }
    closedir(d);
    if (rc != 0) {
        free(out->v);
        out->v = NULL;
        out->n = 0;
    }
    return rc;
}

int auth_reload(kvd_auth_t *a, char *err, size_t errlen)
{
    struct keyset fresh[AUTH_DOMAINS];
    memset(fresh, 0, sizeof(fresh));
    for (int d = 0; d < AUTH_DOMAINS; d++)
        if (a->dir[d] != NULL && load_dir(a, a->dir[d], &fresh[d], err, errlen) != 0) {
            for (int j = 0; j < d; j++)
                free(fresh[j].v);
            return KVD_EIO;
        }
    pthread_mutex_lock(&a->mu);
    for (int d = 0; d < AUTH_DOMAINS; d++) {
        free(a->keys[d].v);
        a->keys[d] = fresh[d];
        a->st.keys[d] = fresh[d].n;
    }
    pthread_mutex_unlock(&a->mu);
    return 0;
}

/* The name of key z85 in domain d, copied into name; false when not allowed. */
static bool lookup(kvd_auth_t *a, int d, const char *z85, char name[AUTH_NAME_MAX + 1])
{
    bool found = false;
    pthread_mutex_lock(&a->mu);
    for (uint32_t i = 0; i < a->keys[d].n && !found; i++)
        if (strcmp(a->keys[d].v[i].z85, z85) == 0) {
            memcpy(name, a->keys[d].v[i].name, AUTH_NAME_MAX + 1);
            found = true;
        }
    if (!found && d == AUTH_WORKERS && a->extra.z85[0] && strcmp(a->extra.z85, z85) == 0) {
        memcpy(name, a->extra.name, AUTH_NAME_MAX + 1);
        found = true;
    }
    if (found)
        a->st.admitted[d]++;
    else
        a->st.refused[d]++;
    pthread_mutex_unlock(&a->mu);
    return found;
}

static void send_str(void *s, const char *v, size_t n, bool more)
{
    zmq_send(s, v, n, more ? ZMQ_SNDMORE : 0);
}

int auth_decide(kvd_auth_t *a, const uint8_t *const *f, const size_t *len, int n, char name[AUTH_NAME_MAX + 1])
{
    name[0] = '\0';
    if (n != 7 || len[0] != 3 || memcmp(f[0], "1.0", 3) != 0)
        return 400;
    int d = -1;
    for (int i = 0; i < AUTH_DOMAINS; i++)
        if (len[2] == strlen(domain_name[i]) && memcmp(f[2], domain_name[i], len[2]) == 0)
            d = i;
    if (d < 0)
        return 400;
    char z85[CURVE_KEY_Z85 + 1];
    const bool curve = len[5] == 5 && memcmp(f[5], "CURVE", 5) == 0;
    if (curve && len[6] == 32 && zmq_z85_encode(z85, f[6], 32) != NULL && lookup(a, d, z85, name))
        return 200;
    if (!curve) {       /* lookup counted the others */
        pthread_mutex_lock(&a->mu);
        a->st.refused[d]++;
        pthread_mutex_unlock(&a->mu);
    }
    name[0] = '\0';
    return 400;
}

/* One ZAP request off the handler's socket, answered. */
static void answer(kvd_auth_t *a)
{
    enum { MAXF = 8 };
    zmq_msg_t f[MAXF];
    int n = 0;
    int more = 1;
    while (more && n < MAXF) {
        zmq_msg_init(&f[n]);
        if (zmq_msg_recv(&f[n], a->rep, 0) < 0) {
            zmq_msg_close(&f[n]);
            break;
        }
        more = zmq_msg_more(&f[n]);
        n++;
    }
    bool extra = false;
    while (more) {      /* more frames than a request has: drain them */
        zmq_msg_t junk;
        zmq_msg_init(&junk);
        more = zmq_msg_recv(&junk, a->rep, 0) >= 0 && zmq_msg_more(&junk);
        zmq_msg_close(&junk);
        extra = true;
    }
    const uint8_t *data[MAXF];
    size_t len[MAXF];
    for (int i = 0; i < n; i++) {
        data[i] = zmq_msg_data(&f[i]);
        len[i] = zmq_msg_size(&f[i]);
    }
    char name[AUTH_NAME_MAX + 1];
    const int code = extra ? 400 : auth_decide(a, data, len, n, name);
    if (code != 200)
        name[0] = '\0';
    send_str(a->rep, "1.0", 3, true);
    if (n >= 2)
        zmq_send(a->rep, data[1], len[1], ZMQ_SNDMORE);
    else
        send_str(a->rep, "", 0, true);
    send_str(a->rep, code == 200 ? "200" : "400", 3, true);
    send_str(a->rep, code == 200 ? "OK" : "refused", code == 200 ? 2 : 7, true);
    send_str(a->rep, name, strlen(name), true);
    send_str(a->rep, "", 0, false);
    for (int i = 0; i < n; i++)
        zmq_msg_close(&f[i]);
}

static void *thread_main(void *arg)
{
    kvd_auth_t *a = arg;
    while (!a->stop) {
        zmq_pollitem_t it = { a->rep, 0, ZMQ_POLLIN, 0 };
        if (zmq_poll(&it, 1, 100) > 0)
            answer(a);
    }
    zmq_close(a->rep);      /* unbound: every later handshake is refused */
    return NULL;
}

kvd_auth_t *auth_new(void *zctx, const char *clients_dir, const char *workers_dir, const char *events_dir,
                     const char *extra_worker, void (*log)(void *user, const char *line), void *user, char *err,
                     size_t errlen)
{
    kvd_auth_t *a = calloc(1, sizeof(*a));
    if (a == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "auth: out of memory");
        return NULL;
    }
    a->zctx = zctx;
    a->log = log;
    a->user = user;
    pthread_mutex_init(&a->mu, NULL);
    if ((clients_dir && (a->dir[AUTH_CLIENTS] = strdup(clients_dir)) == NULL) ||
        (workers_dir && (a->dir[AUTH_WORKERS] = strdup(workers_dir)) == NULL) ||
        (events_dir && (a->dir[AUTH_EVENTS] = strdup(events_dir)) == NULL)) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "auth: out of memory");
        auth_destroy(&a);
        return NULL;
    }
    if (extra_worker != NULL) {
        snprintf(a->extra.z85, sizeof(a->extra.z85), "%s", extra_worker);
        snprintf(a->extra.name, sizeof(a->extra.name), "kvd");
    }
    if (auth_reload(a, err, errlen) != 0) {
        auth_destroy(&a);
        return NULL;
    }
    if (zctx == NULL)
        return a;       /* the keys alone: auth_decide (tests) */
    a->rep = zmq_socket(zctx, ZMQ_REP);
    if (a->rep == NULL || zmq_bind(a->rep, "inproc://zeromq.zap.01") != 0) {
        kvd_seterr(err, errlen, KVD_EIO, "auth: the ZAP handler cannot bind: %s", zmq_strerror(errno));
        if (a->rep != NULL)
            zmq_close(a->rep);
        a->rep = NULL;
        auth_destroy(&a);
        return NULL;
    }
    if (pthread_create(&a->thread, NULL, thread_main, a) != 0) {
        kvd_seterr(err, errlen, KVD_EIO, "auth: cannot start the ZAP handler");
        zmq_close(a->rep);
        a->rep = NULL;
        auth_destroy(&a);
        return NULL;
    }
    return a;
}

void auth_stats(kvd_auth_t *a, struct auth_stats *st)
{
    pthread_mutex_lock(&a->mu);
    *st = a->st;
    pthread_mutex_unlock(&a->mu);
}

void auth_destroy(kvd_auth_t **ap)
{
    if (ap == NULL || *ap == NULL)
        return;
    kvd_auth_t *a = *ap;
    if (a->rep != NULL) {
        a->stop = 1;
        pthread_join(a->thread, NULL);
    }
    for (int d = 0; d < AUTH_DOMAINS; d++) {
        free(a->keys[d].v);
        free(a->dir[d]);
    }
    pthread_mutex_destroy(&a->mu);
    free(a);
    *ap = NULL;
}

int auth_curve_server(void *sock, const struct curve_cert *server, int domain, char *err, size_t errlen)
{
    const int one = 1;
    const char *dn = domain_name[domain];
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof(one)) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, server->secret_key, CURVE_KEY_Z85) != 0 ||
        zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, dn, strlen(dn)) != 0)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "CURVE: %s (does this ZeroMQ have CURVE?)",
                          zmq_strerror(errno));
    /* a connection that has not proven a key within this long is dropped, so
     * that unauthenticated connections hold descriptors briefly (ZeroMQ has no
     * limit on a listener's connections: an untrusted network's is the
     * firewall's, e.g. iptables connlimit) */
    const int handshake_ms = AUTH_HANDSHAKE_MS;
    if (zmq_setsockopt(sock, ZMQ_HANDSHAKE_IVL, &handshake_ms, sizeof(handshake_ms)) != 0)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "CURVE: ZMQ_HANDSHAKE_IVL: %s", zmq_strerror(errno));
    if (zmq_setsockopt(sock, ZMQ_ZAP_ENFORCE_DOMAIN, &one, sizeof(one)) != 0)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "this ZeroMQ cannot enforce its ZAP domain (ZMQ_ZAP_ENFORCE_DOMAIN: %s): "
                          "kvd will not run an authenticated socket that could admit everyone",
                          zmq_strerror(errno));
    return 0;
}

const char *auth_peer(void *msg)
{
    return zmq_msg_gets((zmq_msg_t *)msg, "User-Id");
}
