/*
 * wire.h - packing, unpacking and checking kvd's wire messages (kvd.proto,
 * worker.proto), the one way bytes from a socket become messages.
 *
 * Every byte from outside is untrusted. Unpacking goes through three gates:
 * the frame's size (WIRE_MAX_FRAME; sockets also set ZMQ_MAXMSGSIZE to it),
 * protobuf-c's unpacker running over a budget allocator (wire_arena_t: a fixed
 * amount of memory per message, so a small frame that claims huge repeated
 * fields fails instead of allocating), then field-by-field range checks of
 * the unpacked message (wire_check_*). What passes all three can be trusted
 * up to the limits below; what fails gets an error code and a one-line reason
 * that may be sent back to the peer.
 *
 * Limits that depend on the model (token ids below the vocabulary size, a
 * prompt that fits the context) are checked by kvd, not here.
 */
#ifndef KVD_WIRE_H
#define KVD_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "kvd.pb-c.h"
#include "worker.pb-c.h"

#define WIRE_VERSION 1u

#define WIRE_MAX_FRAME (16u << 20)        /* bytes in one frame (ZMQ_MAXMSGSIZE too) */
#define WIRE_MAX_PROMPT_BYTES (8u << 20)  /* prompt text, after LZ4 decompression */
#define WIRE_MAX_TOKENS (1u << 20)        /* token ids in one message */
#define WIRE_MAX_SCHEMA_BYTES (64u << 10)  /* a structured output's JSON Schema */
#define WIRE_MAX_LOGIT_BIAS 1024          /* logit biases of one request (SAMPLER_MAX_LOGIT_BIAS) */
#define WIRE_MAX_MESSAGES 1024u           /* chat messages in one request */
#define WIRE_MAX_TOOLS 64u                /* function definitions (TOOLCALL_MAX_TOOLS) */
#define WIRE_MAX_TOOL_BYTES (64u << 10)   /* bytes of one definition (TOOLCALL_MAX_DEF_BYTES) */
#define WIRE_MAX_TOOL_CALLS 64u           /* tool calls of one chat message */
#define WIRE_MAX_STOPS 16u                /* stop strings */
#define WIRE_MAX_STOP_BYTES 256u          /* bytes in one stop string */
#define WIRE_MAX_NAMESPACE 256u           /* bytes in a namespace */
#define WIRE_MAX_PIN_TTL_S 604800u        /* a pin's TTL at most (kvd's --pin-max-ttl is lower) */
#define WIRE_MAX_NEW_TOKENS (1u << 20)    /* max_tokens */
#define WIRE_MAX_DEADLINE_MS (24u * 3600u * 1000u)
#define WIRE_MAX_BLOCKS (1u << 20)        /* block ids in one message */
#define WIRE_MAX_POOL_BLOCKS (1u << 22)   /* a remote host's pool (kvd keeps its metadata: some
                                           * 150 bytes a block) */
#define WIRE_MAX_TOP_LOGPROBS 20u         /* alternatives per token (logprobs) */

/* A budget allocator for one unpacked message: an arena of at most `budget`
 * bytes, reset between messages. */
typedef struct wire_arena wire_arena_t;

/* NULL on no memory. */
wire_arena_t *wire_arena_new(size_t budget);
void wire_arena_destroy(wire_arena_t **a);

/* Frees everything unpacked from the arena since the last reset. */
void wire_arena_reset(wire_arena_t *a);

/*
 * Unpack + check. Each returns the message (owned by the arena, valid until
 * its next reset) or NULL with *code set (KVD_EFORMAT for bytes that are not
 * the message, or too large for the arena; KVD_ERANGE for a field out of
 * range; KVD_ETOOLONG for an over-long prompt; KVD_EUNSUPPORTED for another
 * protocol version; KVD_ENOMEM) and a one-line reason in err. Strings are
 * NUL-terminated by protobuf-c, so text after an embedded NUL is not seen.
 * The message's version field is checked against WIRE_VERSION.
 */
Kvd__ClientRequest *wire_client_request_unpack(wire_arena_t *a, const void *buf, size_t len,
                                               int *code, char *err, size_t errlen);
Kvd__ServerReply *wire_server_reply_unpack(wire_arena_t *a, const void *buf, size_t len,
                                           int *code, char *err, size_t errlen);
Kvdw__FromWorker *wire_from_worker_unpack(wire_arena_t *a, const void *buf, size_t len,
                                          int *code, char *err, size_t errlen);
Kvdw__ToWorker *wire_to_worker_unpack(wire_arena_t *a, const void *buf, size_t len,
                                      int *code, char *err, size_t errlen);

/*
 * The range checks alone (the unpack functions call them): 0, or KVD_ERANGE /
 * KVD_EFORMAT / KVD_EUNSUPPORTED with a reason. A client request must have a
 * body; a generate request exactly one prompt form (prompt, prompt_lz4,
 * messages or token_ids) within the limits above, with sampling parameters in
 * range (temperature 0..100, top_k 0..2^20, top_p and min_p 0..1,
 * repeat_penalty > 0 and <= 100, all finite), non-empty stop strings, and
 * token ids >= 0.
 */
int wire_check_client_request(const Kvd__ClientRequest *m, char *err, size_t errlen);
int wire_check_server_reply(const Kvd__ServerReply *m, char *err, size_t errlen);
int wire_check_from_worker(const Kvdw__FromWorker *m, char *err, size_t errlen);
int wire_check_to_worker(const Kvdw__ToWorker *m, char *err, size_t errlen);

/*
 * The prompt text of a generate request that has one: points *text at the
 * plain prompt, or decompresses prompt_lz4 into the arena (exactly
 * prompt_lz4_size bytes, at most WIRE_MAX_PROMPT_BYTES, else KVD_EFORMAT).
 * Returns 0, KVD_ENOTFOUND when the request's prompt is not text, or
 * KVD_ENOMEM when the text does not fit what is left of the arena's budget.
 */
int wire_prompt_text(wire_arena_t *a, const Kvd__GenerateRequest *g, const char **text,
                     size_t *len, char *err, size_t errlen);

/* The request_id of a ClientRequest frame that may fail to unpack or check:
 * scans the top-level fields only (no allocation) for field 2. 0 when the
 * frame is unreadable before it or has none. Lets an error reply carry the
 * id the client will wait for. */
uint64_t wire_client_request_id(const void *buf, size_t len);

/*
 * Packs a message into a new malloc'd buffer (*buf, *len; the caller frees).
 * 0, KVD_ENOMEM, or KVD_ERANGE when the packed size exceeds WIRE_MAX_FRAME.
 */
int wire_pack(const ProtobufCMessage *m, uint8_t **buf, size_t *len);

/* Compresses text for GenerateRequest.prompt_lz4 into a new malloc'd buffer;
 * 0 or KVD_ENOMEM / KVD_ERANGE (text over WIRE_MAX_PROMPT_BYTES). */
int wire_lz4_compress(const char *text, size_t len, uint8_t **out, size_t *out_len);

#endif
