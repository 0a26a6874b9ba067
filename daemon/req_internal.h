/*
 * req_internal.h - what the files of kvd's request module share; the rest of
 * kvd calls the module through requests.h.
 *
 *   requests.c  request records, tenants, replies, the client messages other
 *               than Generate and Stats, time
 *   admit.c     a Generate checked, its prompt built, queued or refused
 *   dispatch.c  queued requests onto workers, blocks and leases, preemption,
 *               prefixes back from the tiers
 *   window.c    context windowing at --ctx
 *   output.c    worker reports into streamed text and the final reply
 *   stats.c     latency histograms and the Stats reply
 */
#ifndef KVD_REQ_INTERNAL_H
#define KVD_REQ_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd.h"
#include "requests.h"

/* A request whose workers die this many times is failed rather than resumed
 * again: one that brings its worker down every time would otherwise take
 * every worker down, one after another. From SUSPECT_AFTER deaths on it runs
 * alone on an idle worker, so that requests that merely shared a batch with
 * it are not taken down with it again. */
#define MAX_WORKERS_LOST 3
#define SUSPECT_AFTER 2

/* requests.c */
/* Sends a reply to a client: rid's first byte names the socket it came on
 * (RID_*), the rest is its routing id there. A client that is gone cancels
 * its request. */
int req_reply(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, Kvd__ServerReply *m);
/* An error reply; retry_after > 0 tells the client how many ms to wait
 * before trying again (OVERLOADED). Counts nothing. */
void req_reply_error_after(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id, int code,
                           const char *msg, uint32_t retry_after);
/* r out of, or onto the end of, the list at *head (kvd.queue, kvd.active). */
void req_list_remove(struct request **head, struct request *r);
void req_list_append(struct request **head, struct request *r);
/* r's tenant entry, or NULL when it has none. */
struct kvd_tenant *req_tenant_of(struct kvd *k, const struct request *r);
/* r leaves the queue (dispatched, finished, or let go from it). */
void req_dequeue(struct kvd *k, struct request *r);
/* The running (or stopping) request of kvd id seq_id, or NULL. */
struct request *req_find_active(struct kvd *k, uint64_t seq_id);
/* The queued or running request of a client's id (rid as req_on_client got
 * it), or NULL. */
struct request *req_find_client(struct kvd *k, const uint8_t *rid, size_t rid_len, uint64_t id);
/* The prefix cache of the pool that r's blocks are in (kvd.h: struct kvd_host). */
prefix_t *req_px(const struct kvd *k, const struct request *r);
/* Frees r and everything it owns (its blocks are released before). */
void req_free(struct request *r);
/* The tokens r's positions hold (req_seq_n of them): its history, or once
 * windowed the windowed history (the first sinks, then the newer tokens).
 * Everything about blocks and positions (the prefix index, leases, commits,
 * assignments) reads these; r->tok stays the whole record the output comes
 * from. */
const int32_t *req_seq_tok(const struct request *r);
uint32_t req_seq_n(const struct request *r);
/* The index of tenant name[0..n) in k->tenants, or -1 when it has no entry. */
int32_t req_tenant_find(const struct kvd *k, const char *name, size_t n);
/* An entry for tenant name[0..n) (a request of it was admitted): a new one,
 * or, once --max-tenants are in the table, the first whose tenant has
 * nothing queued, running or held. -1 when every entry's tenant has (or
 * without memory): the request is refused, never served unaccounted. */
int32_t req_tenant_add(struct kvd *k, const char *name, size_t n);

/* admit.c */
/* Room for n more tokens in r->tok; 0 or KVD_ENOMEM. */
int req_reserve_tokens(struct request *r, uint32_t n);
/* Tokenizes text into r->tok (after a BOS when the model wants one). */
int req_tokenize(struct kvd *k, struct request *r, const char *text, size_t len, bool special);
/* Fills r's prompt from the request; 0 or an error code and message. */
int req_build_prompt(struct kvd *k, struct request *r, const Kvd__GenerateRequest *g, char *msg,
                     size_t msg_len);
/* A Generate: answered with Accepted and queued, or with an error. */
void req_on_generate(struct kvd *k, const uint8_t *rid, size_t rid_len, const char *tenant, uint64_t id,
                     const Kvd__GenerateRequest *g);

/* dispatch.c */
/* Tries to start r on a worker. 1 started, 0 not now (no worker or blocks, or
 * its prefix is being copied back from the tiers), -1 r finished (it can
 * never fit). */
int req_start(struct kvd *k, struct request *r);
/* Logical blocks [from, n_blocks) of ps as Assign and Grant carry them: part
 * 0's table itself for a pool of one part, else a copy (*copy, for the caller
 * to free) with one id per part for each. NULL when out of memory. */
uint32_t *req_wire_blocks(struct prefix_seq *ps, uint32_t from, size_t *n, uint32_t **copy);
/* The measured cost of computing a prompt token (what the host tier's restores
 * are weighed against): dispatch to first token over the tokens computed, for
 * prompts that computed enough to say, averaged over recent requests. */
void req_note_prefill_rate(struct kvd *k, const struct request *r);
/* Requests waiting for a pending prefix try again (after a commit or release). */
void req_wake_waiters(struct kvd *k);
/* One block copy back from the tiers finished (restorer_collect's callback,
 * user the kvd): the last of a request's sends it back to the queue. */
void req_restore_done(void *user, const struct restore_done *d);
/* r's worker gets (or no longer waits for) the blocks it asked for. */
void req_unstarve(struct kvd *k, struct request *r);
/* Retries the leases that waited for blocks. */
void req_retry_leases(struct kvd *k);

/* window.c */
/* Whether r windows at the context (the request's context_overflow, else
 * kvd's --context-overflow), and the cases that cannot. */
int req_admit_window(struct kvd *k, struct request *r, const Kvd__GenerateRequest *g, char *msg, size_t len);
/* Appends t to r's windowed history; 0 or KVD_ENOMEM. */
int req_wtok_push(struct request *r, int32_t t);
/* The worker has made the copies of r's last window (it speaks of the
 * sequence again): what the window kept held goes (prefix_window_done). A
 * request let go releases it with its blocks; a lost host's fence keeps it
 * with them. */
void req_window_settled(struct kvd *k, struct request *r);

/* output.c */
/* The request seq_id that worker w runs, or NULL (a bad message, counted). */
struct request *req_from_worker(struct kvd *k, int w, uint64_t seq_id);
/* Blocks of r's sequence up to n_written are written: the full ones are
 * committed (findable by later prompts). */
void req_commit(struct kvd *k, struct request *r, uint32_t n_written);
/* Ends r: the final reply (or error), statistics, and its memory. r must be in
 * no list and hold no blocks. */
void req_finish(struct kvd *k, struct request *r);
/* Tells r's worker to stop r's sequence (it answers with Done). */
void req_send_cancel(struct kvd *k, struct request *r);
/* Ends r with finish reason `why` (or, with fail_code != 0, an error): at once
 * when it is queued, else after its worker lets go of it. */
void req_stop(struct kvd *k, struct request *r, int why, int fail_code, const char *msg);
/* r's worker no longer touches its blocks: release them and move on. */
void req_let_go(struct kvd *k, struct request *r, int reason, const char *error);
/* Makes r's text valid UTF-8 from r->valid on: every byte that starts no
 * valid character (a NUL byte too: text travels as C strings, and a NUL would
 * cut the chunks and the final text at different places) becomes U+FFFD; a
 * character cut short at the end waits for its bytes, unless `all` (the
 * text is complete). The token ids carry the exact output. */
int req_text_validate(struct request *r, bool all);
/* Appends a token's bytes to the request's text, as valid UTF-8 (req_text_validate). */
int req_append_text(struct request *r, const char *s, size_t n);

/* stats.c */
/* The latencies and finish reason of a request that ends now. */
void req_observe(struct kvd *k, const struct request *r, double now, uint32_t n_gen);
/* A Stats request: kvd's figures, of every tenant for a client of the ipc://
 * socket (tenant NULL), else of that tenant only; the findable blocks'
 * hashes and the pools' picture when asked. */
void req_on_stats(struct kvd *k, const uint8_t *rid, size_t rid_len, const char *tenant, uint64_t id,
                  bool block_hashes, const Kvd__StatsRequest *sr);

#endif
