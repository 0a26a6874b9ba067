/*
 * endpoint.h - the endpoint kvd listens on and its clients connect to when
 * none is given: one definition for the daemon, the C client library (which
 * exports it as part of its API, kvd_client.h), kvcli and the tests.
 */
#ifndef KVD_ENDPOINT_H
#define KVD_ENDPOINT_H

#include <stddef.h>

/* Writes "ipc://" + a socket in a private runtime directory
 * ($XDG_RUNTIME_DIR/kvd, else /tmp/kvd-<uid>), or $KVD_ENDPOINT when set,
 * into buf (len bytes). Returns buf. */
char *kvd_default_endpoint(char *buf, size_t len);

#endif
