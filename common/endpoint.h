/*
 * endpoint.h - the endpoint kvd listens on and its clients connect to when
 * none is given: one definition for the daemon, the C client library (which
 * exports it as part of its API, kvd_client.h), kvcli and the tests; and
 * what a tcp:// address kvd is asked to bind reaches.
 */
#ifndef KVD_ENDPOINT_H
#define KVD_ENDPOINT_H

#include <stddef.h>

/* Writes "ipc://" + a socket in a private runtime directory
 * ($XDG_RUNTIME_DIR/kvd, else /tmp/kvd-<uid>), or $KVD_ENDPOINT when set,
 * into buf (len bytes). Returns buf. */
char *kvd_default_endpoint(char *buf, size_t len);

/* Whether binding "tcp://HOST:PORT" (or a bare "HOST:PORT", "[V6]:PORT")
 * reaches this machine's loopback interface only, HOST resolved as ZeroMQ
 * resolves a bind: an interface name (its flags say whether it is the
 * loopback one), else a numeric address in any form getaddrinfo takes ("0",
 * "127.1", "::1") or a host name (every address it resolves to). "*" and
 * the any-addresses are every interface. 1 loopback only; 0 not (why says
 * what it reaches); -1 malformed or unresolvable (why says so). */
int endpoint_loopback(const char *hostport, char *why, size_t whylen);

#endif
