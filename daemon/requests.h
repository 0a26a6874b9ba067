/*
 * requests.h - kvd's client requests (requests.c and the files of
 * req_internal.h), as the rest of kvd calls them
 */
#ifndef KVD_REQUESTS_H
#define KVD_REQUESTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd.h"

/* A client's message; rid is its routing id with the socket's byte first
 * (RID_*), tenant the name its CURVE key was admitted under (NULL: a client
 * of the plain socket, trusted by the runtime directory's permissions). */
void req_on_client(struct kvd *k, const uint8_t *rid, size_t rid_len, const char *tenant, const void *buf,
                   size_t len);
void req_dispatch(struct kvd *k);
void req_tick(struct kvd *k);
void req_on_commit(struct kvd *k, int w, const Kvdw__Commit *c);
void req_on_tokens(struct kvd *k, int w, const Kvdw__TokenChunk *c);
void req_on_lease(struct kvd *k, int w, uint64_t seq_id, uint32_t n_positions, bool ahead);
void req_on_window(struct kvd *k, int w, uint64_t seq_id, uint32_t n_written);
void req_on_done(struct kvd *k, int w, uint64_t seq_id, int reason, uint32_t n_written,
                 const char *error);
void req_on_worker_lost(struct kvd *k, int w);
void req_cancel_all(struct kvd *k, const char *why);
void req_fail_queued(struct kvd *k, int code, const char *why);
/* After the workers are stopped: ends every request and releases its blocks. */
void req_release_all(struct kvd *k);
/* Fails the queued requests that no pool left can hold (after a host was lost). */
void req_fail_unfit(struct kvd *k);
/* Blocks came free outside a worker's report (fenced ones released): leases
 * that waited are retried and the queue dispatched. */
void req_blocks_freed(struct kvd *k);
void req_on_restored(struct kvd *k);
/* Replies to a client (rid as req_on_client got it). */
int req_reply(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, Kvd__ServerReply *m);
void req_reply_error(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, int code, const char *msg);
/* The tenant of a client (its CURVE key's name) or of a namespace "tenant:NAME/...":
 * into *name (not NUL-terminated) and *len; false when none. */
bool req_tenant_name(const char *tenant, const char *ns, const char **name, size_t *len);
/* The entry of tenant name[0..n) in k->tenants, made when missing; -1 when none can be. */
int32_t req_tenant_entry(struct kvd *k, const char *name, size_t n);
/* How many leading full blocks of tok[0..n) --public-prefix shares (keyed in
 * k->public_ns), leaving at least one token past them. */
uint32_t req_public_blocks(const struct kvd *k, const int32_t *tok, uint32_t n);

/* The UTF-8 sequence at s[0..n): 1 and its length in *len when it is one
 * character, 0 when n cuts a valid start short, -1 when s[0] starts none. */
int kvd_utf8_seq(const unsigned char *s, size_t n, size_t *len);

#endif
