/*
 * auth.h - who may talk to kvd over tcp://: CurveZMQ on its sockets and a
 * ZAP handler (ZeroMQ's authentication protocol, RFC 27) that admits the
 * public keys of an allow directory.
 *
 * Each authenticated socket is a CURVE server with kvd's key pair, a ZAP
 * domain of its own ("clients", "workers", "events": the subscribers of
 * --kv-events) and ZAP_ENFORCE_DOMAIN set, so a
 * connection is admitted only when the handler answers 200: a missing
 * handler refuses everyone, and one that stops answering admits no one. The
 * handler runs on a thread of its own (an inproc REP socket, the address
 * ZeroMQ asks), admits a key found in its domain's directory, and names the
 * peer after the key's file: the User-Id that kvd reads off each message,
 * a client's tenant. The directories are read again by auth_reload
 * (kvd's SIGHUP): a key removed is refused from its next connection on.
 */
#ifndef KVD_AUTH_H
#define KVD_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "curve.h"

typedef struct kvd_auth kvd_auth_t;

enum { AUTH_CLIENTS = 0, AUTH_WORKERS = 1, AUTH_EVENTS = 2, AUTH_DOMAINS = 3 };

#define AUTH_NAME_MAX 64        /* a peer's name: [A-Za-z0-9._-], from its key file */

struct auth_stats {
    uint64_t admitted[AUTH_DOMAINS];
    uint64_t refused[AUTH_DOMAINS];     /* keys not in the domain's directory */
    uint32_t keys[AUTH_DOMAINS];        /* keys allowed now */
};

/* The handler in zctx for the directories (NULL: that domain admits no
 * one); with zctx NULL, the keys alone, for auth_decide. extra_worker, when given, is one more key admitted as worker
 * "kvd" (the workers kvd starts itself use kvd's own key pair). log(user,
 * line) hears about files skipped. NULL with a reason. */
kvd_auth_t *auth_new(void *zctx, const char *clients_dir, const char *workers_dir, const char *events_dir,
                     const char *extra_worker, void (*log)(void *user, const char *line), void *user, char *err,
                     size_t errlen);

/* The answer to one ZAP request of n frames (RFC 27: version, request id,
 * domain, address, identity, mechanism, credentials): 200 with the peer's
 * name in name when it is a CURVE request of version 1.0 in a known domain
 * whose 32-byte key is allowed there, else 400 (anything malformed, another
 * mechanism, an unknown domain or key). Counted in the statistics. */
int auth_decide(kvd_auth_t *a, const uint8_t *const *f, const size_t *len, int n, char name[AUTH_NAME_MAX + 1]);

/* Reads the directories again; the old keys stay when one cannot be read. */
int auth_reload(kvd_auth_t *a, char *err, size_t errlen);

void auth_stats(kvd_auth_t *a, struct auth_stats *st);

/* Stops the handler thread (every later handshake is refused) and frees it.
 * Accepts NULL; sets *a to NULL. */
void auth_destroy(kvd_auth_t **a);

#define AUTH_HANDSHAKE_MS 3000   /* a CURVE connection must prove its key within this long */

/* Makes sock (before it binds) a CURVE server with key pair server in ZAP
 * domain `domain` (AUTH_CLIENTS, AUTH_WORKERS, AUTH_EVENTS), the domain enforced. 0, or
 * KVD_EUNSUPPORTED with the reason. */
int auth_curve_server(void *sock, const struct curve_cert *server, int domain, char *err, size_t errlen);

/* The User-Id the handler gave the peer that sent msg (a zmq_msg_t *), or NULL. */
const char *auth_peer(void *msg);

#endif
