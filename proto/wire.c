/*
 * wire.c - budgeted unpacking and field-by-field checks of kvd's wire
 * messages, plus packing and the LZ4 prompt codec.
 *
 * The arena. protobuf-c 1.4 allocates everything it unpacks through a
 * ProtobufCAllocator and has no limits of its own, so each arena hands it
 * 16-byte aligned memory bumped out of malloc'd blocks and refuses (returns
 * NULL, which makes the unpack fail) once the bytes handed out since the last
 * reset would pass the budget. free is a no-op; a reset rewinds everything,
 * keeping one block of up to ARENA_KEEP bytes for the next message. The
 * budget counts bytes handed out (rounded to 16); the blocks holding them add
 * at most about as much again. The unpack functions do not reset (the caller
 * does, between messages), and an arena serves one thread at a time.
 *
 * Sizing the budget. What protobuf-c allocates for a frame of n bytes: a
 * packed int32/uint32 field up to 4 bytes per wire byte (1-byte varints), a
 * string or bytes field its length plus 16, a repeated message or an unknown
 * field about 100 bytes per entry of 2-3 wire bytes (struct, pointer and the
 * unpacker's own scan tables). Legitimate messages are made of the first two,
 * so a caller should pass
 *
 *     budget = 4 * (largest frame the socket accepts) + 1 MiB
 *              (+ WIRE_MAX_PROMPT_BYTES + 16 where wire_prompt_text is used,
 *                since a 33 KiB prompt_lz4 can decompress to 8 MiB)
 *
 * e.g. 4 * WIRE_MAX_FRAME + WIRE_MAX_PROMPT_BYTES + 1 MiB for kvd's client
 * socket. The budget is a cap, not a reservation: blocks are allocated as the
 * message needs them. A hostile frame built of thousands of tiny repeated or
 * unknown fields (up to ~60x its size) hits the cap and is refused as "too
 * large for its budget".
 *
 * Error codes of the checks: KVD_EUNSUPPORTED for another protocol version;
 * KVD_EFORMAT for a message whose shape is wrong (no version, no body, a
 * required field absent, no prompt or two prompt forms); KVD_ETOOLONG for a
 * prompt over its limits (text bytes, prompt_lz4_size, chat content bytes,
 * token count), so that kvd can answer ERR_TOO_LONG; KVD_ERANGE for any other
 * value or count out of range. Beyond those, the unpack functions return
 * KVD_ENOMEM when malloc fails (the budget not being reached), and
 * wire_prompt_text does when the text does not fit what is left of the budget.
 *
 * Choices worth knowing:
 * - Strings are bytes (protobuf-c does not check UTF-8) and, as protobuf-c
 *   hands them over NUL-terminated, end at their first NUL byte: a stop string
 *   that starts with NUL is empty, a prompt is cut at its first NUL. Embedded
 *   NULs cannot be detected after unpacking, so they are not rejected.
 * - An empty prompt counts as no prompt.
 * - Unknown fields are accepted and ignored (they still cost budget), except
 *   those numbered 0 or above 2^29 - 1, which are not valid protobuf.
 * - A field given twice keeps protobuf semantics (the last wins; a singular
 *   submessage is merged; of a oneof, the last member wins).
 * - Fields whose absence would silently read as a valid 0 are required:
 *   ClientRequest.request_id, CancelRequest.target, the seq_id of every
 *   worker message about a sequence, Commit/TokenChunk.n_written,
 *   LeaseRequest.n_positions, Done.reason, and Ready's fingerprint,
 *   block_tokens and max_batch.
 * - A server reply's strings (chunk.text, final.text, error.message,
 *   health.model) must be present, possibly "", so that clients need no NULL
 *   checks; otherwise its checks are lighter: enum values known, token counts
 *   bounded, token ids >= 0.
 * - Reasons quote untrusted strings only escaped and shortened, so a reason
 *   is always one printable line.
 */
#include "wire.h"

#include <assert.h>
#include <limits.h>
#include <lz4.h>
#include <math.h>
#include <stdalign.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"

/* ---- the arena --------------------------------------------------------------- */

#if defined(__SANITIZE_ADDRESS__)
#define ARENA_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ARENA_ASAN 1
#endif
#endif

#ifdef ARENA_ASAN
/* Under ASan, unused block space is poisoned and each allocation is followed
 * by a poisoned gap, so overruns inside a block are caught too. */
void __asan_poison_memory_region(void const volatile *addr, size_t size);
void __asan_unpoison_memory_region(void const volatile *addr, size_t size);
#define ARENA_POISON(p, n) __asan_poison_memory_region((p), (n))
#define ARENA_UNPOISON(p, n) __asan_unpoison_memory_region((p), (n))
#define ARENA_REDZONE 16u
#else
#define ARENA_POISON(p, n) ((void)(p), (void)(n))
#define ARENA_UNPOISON(p, n) ((void)(p), (void)(n))
#define ARENA_REDZONE 0u
#endif

#define ARENA_ALIGN 16u
#define ARENA_FIRST_BLOCK (64u << 10)   /* the first block's size */
#define ARENA_MAX_GROWTH (16u << 20)    /* blocks double up to this; bigger requests get one each */
#define ARENA_KEEP (1u << 20)           /* a reset keeps one block of at most this size */

struct arena_block {
    struct arena_block *next;           /* the block allocated before this one */
    size_t cap;                         /* bytes in data[] */
    size_t off;                         /* bytes of data[] handed out, padding included */
    size_t pad_;                        /* keeps data[] 16-aligned */
    alignas(16) unsigned char data[];   /* cap bytes */
};
static_assert(sizeof(struct arena_block) % ARENA_ALIGN == 0 &&
              offsetof(struct arena_block, data) % ARENA_ALIGN == 0, "data[] must stay 16-aligned");

struct wire_arena {
    ProtobufCAllocator pc;              /* what protobuf-c calls; allocator_data is this arena */
    size_t budget;                      /* bytes that may be handed out between resets */
    size_t used;                        /* bytes handed out since the last reset (rounded to 16) */
    struct arena_block *head;           /* the block allocations come from; older ones follow */
    bool over_budget;                   /* an allocation was refused for the budget */
    bool no_memory;                     /* malloc failed (both flags: since the last unpack) */
};

static struct arena_block *block_new(size_t cap)
{
    if (cap > SIZE_MAX - sizeof(struct arena_block) - ARENA_ALIGN)
        return NULL;
    size_t bytes = sizeof(struct arena_block) + cap;
    bytes = (bytes + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
    struct arena_block *b = aligned_alloc(ARENA_ALIGN, bytes);
    if (b == NULL)
        return NULL;
    b->next = NULL;
    b->cap = cap;
    b->off = 0;
    b->pad_ = 0;
    ARENA_POISON(b->data, cap);
    return b;
}

/* Returns size bytes, 16-aligned, or NULL once the budget (or malloc) says no. */
static void *arena_alloc(wire_arena_t *a, size_t size)
{
    if (size == 0)
        size = 1;
    size_t left = a->budget - a->used;
    if (size > left || size > SIZE_MAX - ARENA_ALIGN) {
        a->over_budget = true;
        return NULL;
    }
    size_t rounded = (size + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
    if (rounded > left) {
        a->over_budget = true;
        return NULL;
    }
    size_t need = rounded + ARENA_REDZONE;
    struct arena_block *b = a->head;
    if (b == NULL || b->cap - b->off < need) {
        size_t grow = b == NULL ? ARENA_FIRST_BLOCK
                    : b->cap >= ARENA_MAX_GROWTH / 2 ? ARENA_MAX_GROWTH : b->cap * 2;
        size_t room = left > SIZE_MAX - ARENA_REDZONE ? SIZE_MAX : left + ARENA_REDZONE;
        if (grow > room)
            grow = room;                        /* never more block than the budget can use */
        struct arena_block *nb = block_new(need > grow ? need : grow);
        if (nb == NULL) {
            a->no_memory = true;
            return NULL;
        }
        nb->next = b;
        a->head = b = nb;
    }
    void *p = b->data + b->off;
    b->off += need;
    a->used += rounded;
    ARENA_UNPOISON(p, size);
    return p;
}

static void *arena_pc_alloc(void *data, size_t size) { return arena_alloc(data, size); }

static void arena_pc_free(void *data, void *p)
{
    (void)data;
    (void)p;    /* freed by the next reset */
}

wire_arena_t *wire_arena_new(size_t budget)
{
    wire_arena_t *a = calloc(1, sizeof(*a));
    if (a == NULL)
        return NULL;
    a->pc.alloc = arena_pc_alloc;
    a->pc.free = arena_pc_free;
    a->pc.allocator_data = a;
    a->budget = budget;
    return a;
}

void wire_arena_destroy(wire_arena_t **ap)
{
    if (ap == NULL || *ap == NULL)
        return;
    struct arena_block *b = (*ap)->head;
    while (b != NULL) {
        struct arena_block *next = b->next;
        free(b);
        b = next;
    }
    free(*ap);
    *ap = NULL;
}

void wire_arena_reset(wire_arena_t *a)
{
    if (a == NULL)
        return;
    struct arena_block *keep = NULL;
    for (struct arena_block *b = a->head; b != NULL; b = b->next)
        if (b->cap <= ARENA_KEEP && (keep == NULL || b->cap > keep->cap))
            keep = b;
    struct arena_block *b = a->head;
    while (b != NULL) {
        struct arena_block *next = b->next;
        if (b != keep)
            free(b);
        b = next;
    }
    if (keep != NULL) {
        keep->next = NULL;
        keep->off = 0;
        ARENA_POISON(keep->data, keep->cap);
    }
    a->head = keep;
    a->used = 0;
    a->over_budget = false;
    a->no_memory = false;
}

/* ---- unpacking ------------------------------------------------------------------- */

static void set_code(int *code, int rc)
{
    if (code != NULL)
        *code = rc;
}

/* Field numbers protobuf allows. protobuf-c 1.4 accepts an unknown field
 * numbered 0 (written as a two-byte varint) or above 2^29 - 1, and then packs
 * it so that it cannot read it back; such a message is not valid protobuf. */
static int check_unknown_fields(const ProtobufCMessage *m, char *err, size_t errlen)
{
    for (unsigned i = 0; i < m->n_unknown_fields; i++) {
        uint32_t tag = m->unknown_fields[i].tag;
        if (tag == 0 || tag > 0x1fffffffu)
            return kvd_seterr(err, errlen, KVD_EFORMAT,
                              "%s has a field numbered %u, not valid protobuf",
                              m->descriptor->short_name, tag);
    }
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned f = 0; f < d->n_fields; f++) {
        const ProtobufCFieldDescriptor *fd = &d->fields[f];
        if (fd->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        const char *base = (const char *)m;
        size_t n = 1;
        ProtobufCMessage *const *subs = (ProtobufCMessage *const *)(base + fd->offset);
        if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            n = *(const size_t *)(base + fd->quantifier_offset);
            subs = *(ProtobufCMessage *const *const *)(base + fd->offset);
        } else if ((fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
                   *(const uint32_t *)(base + fd->quantifier_offset) != fd->id) {
            continue;   /* another member of the oneof is set */
        }
        for (size_t i = 0; i < n; i++) {
            int rc = subs[i] != NULL ? check_unknown_fields(subs[i], err, errlen) : 0;
            if (rc)
                return rc;
        }
    }
    return 0;
}

/* Gates one and two: the frame's size, then protobuf-c over the arena. */
static ProtobufCMessage *unpack(wire_arena_t *a, const ProtobufCMessageDescriptor *desc,
                                const char *what, const void *buf, size_t len, int *code,
                                char *err, size_t errlen)
{
    if (len > WIRE_MAX_FRAME) {
        set_code(code, kvd_seterr(err, errlen, KVD_EFORMAT,
                                  "%s frame of %zu bytes exceeds the limit of %u bytes",
                                  what, len, WIRE_MAX_FRAME));
        return NULL;
    }
    if (len == 0) {
        set_code(code, kvd_seterr(err, errlen, KVD_EFORMAT,
                                  "empty frame (0 bytes): not a %s (it has no version)", what));
        return NULL;
    }
    assert(buf != NULL);
    a->over_budget = false;
    a->no_memory = false;
    size_t used_before = a->used;
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, &a->pc, len, buf);
    if (m != NULL) {
        int rc = check_unknown_fields(m, err, errlen);
        if (rc == 0)
            return m;
        set_code(code, rc);
        return NULL;
    }
    if (a->no_memory)
        set_code(code, kvd_seterr(err, errlen, KVD_ENOMEM,
                                  "out of memory unpacking a %s of %zu bytes", what, len));
    else if (a->over_budget)
        set_code(code, kvd_seterr(err, errlen, KVD_EFORMAT,
                                  "%s of %zu bytes is too large for its budget "
                                  "(%zu bytes, %zu in use before it)",
                                  what, len, a->budget, used_before));
    else
        set_code(code, kvd_seterr(err, errlen, KVD_EFORMAT,
                                  "not a valid %s message (%zu bytes)", what, len));
    return NULL;
}

Kvd__ClientRequest *wire_client_request_unpack(wire_arena_t *a, const void *buf, size_t len,
                                               int *code, char *err, size_t errlen)
{
    ProtobufCMessage *m = unpack(a, &kvd__client_request__descriptor, "ClientRequest",
                                 buf, len, code, err, errlen);
    if (m == NULL)
        return NULL;
    int rc = wire_check_client_request((const Kvd__ClientRequest *)m, err, errlen);
    set_code(code, rc);
    return rc == 0 ? (Kvd__ClientRequest *)m : NULL;
}

Kvd__ServerReply *wire_server_reply_unpack(wire_arena_t *a, const void *buf, size_t len,
                                           int *code, char *err, size_t errlen)
{
    ProtobufCMessage *m = unpack(a, &kvd__server_reply__descriptor, "ServerReply",
                                 buf, len, code, err, errlen);
    if (m == NULL)
        return NULL;
    int rc = wire_check_server_reply((const Kvd__ServerReply *)m, err, errlen);
    set_code(code, rc);
    return rc == 0 ? (Kvd__ServerReply *)m : NULL;
}

Kvdw__FromWorker *wire_from_worker_unpack(wire_arena_t *a, const void *buf, size_t len,
                                          int *code, char *err, size_t errlen)
{
    ProtobufCMessage *m = unpack(a, &kvdw__from_worker__descriptor, "FromWorker",
                                 buf, len, code, err, errlen);
    if (m == NULL)
        return NULL;
    int rc = wire_check_from_worker((const Kvdw__FromWorker *)m, err, errlen);
    set_code(code, rc);
    return rc == 0 ? (Kvdw__FromWorker *)m : NULL;
}

Kvdw__ToWorker *wire_to_worker_unpack(wire_arena_t *a, const void *buf, size_t len,
                                      int *code, char *err, size_t errlen)
{
    ProtobufCMessage *m = unpack(a, &kvdw__to_worker__descriptor, "ToWorker",
                                 buf, len, code, err, errlen);
    if (m == NULL)
        return NULL;
    int rc = wire_check_to_worker((const Kvdw__ToWorker *)m, err, errlen);
    set_code(code, rc);
    return rc == 0 ? (Kvdw__ToWorker *)m : NULL;
}

/* ---- checks shared by several messages -------------------------------------------- */

/* A printable, shortened copy of untrusted text s, for a reason line. */
static const char *printable(char *buf, size_t n, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0, i = 0;
    for (; s[i] != '\0' && o + 4 + 4 < n; i++) {   /* room for one escape and "..." */
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
            buf[o++] = (char)c;
        } else {
            buf[o++] = '\\';
            buf[o++] = 'x';
            buf[o++] = hex[c >> 4];
            buf[o++] = hex[c & 15];
        }
    }
    if (s[i] != '\0') {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

static int check_version(bool has, uint32_t v, const char *what, char *err, size_t errlen)
{
    if (!has)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "%s has no version (empty, or not a kvd message)", what);
    if (v != WIRE_VERSION)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "%s has protocol version %u, expected %u", what, v, WIRE_VERSION);
    return 0;
}

static int missing(const char *what, const char *field, char *err, size_t errlen)
{
    return kvd_seterr(err, errlen, KVD_EFORMAT, "%s has no %s", what, field);
}

/* v must lie in [lo, hi], or in (lo, hi] when lo_open; NaN and infinities never do. */
static int check_float(float v, double lo, bool lo_open, double hi, const char *path,
                       const char *name, char *err, size_t errlen)
{
    double d = v;
    if (isfinite(d) && (lo_open ? d > lo : d >= lo) && d <= hi)
        return 0;
    return kvd_seterr(err, errlen, KVD_ERANGE, "%s.%s = %g is outside %c%g, %g]",
                      path, name, d, lo_open ? '(' : '[', lo, hi);
}

static int check_sampling(const Kvd__SamplingParams *s, const char *path, char *err, size_t errlen)
{
    int rc = 0;
    if (s->has_temperature)
        rc = check_float(s->temperature, 0, false, 100, path, "temperature", err, errlen);
    if (rc == 0 && s->has_top_k && (s->top_k < 0 || s->top_k > (1 << 20)))
        rc = kvd_seterr(err, errlen, KVD_ERANGE, "%s.top_k = %d is outside [0, %d]",
                        path, s->top_k, 1 << 20);
    if (rc == 0 && s->has_top_p)
        rc = check_float(s->top_p, 0, false, 1, path, "top_p", err, errlen);
    if (rc == 0 && s->has_min_p)
        rc = check_float(s->min_p, 0, false, 1, path, "min_p", err, errlen);
    if (rc == 0 && s->has_repeat_penalty)
        rc = check_float(s->repeat_penalty, 0, true, 10, path, "repeat_penalty", err, errlen);  /* the sampler's */
    if (rc == 0 && s->has_presence_penalty)
        rc = check_float(s->presence_penalty, -2, false, 2, path, "presence_penalty", err, errlen);
    if (rc == 0 && s->has_frequency_penalty)
        rc = check_float(s->frequency_penalty, -2, false, 2, path, "frequency_penalty", err, errlen);
    if (rc == 0 && (s->n_logit_bias_ids != s->n_logit_bias || s->n_logit_bias > WIRE_MAX_LOGIT_BIAS))
        rc = kvd_seterr(err, errlen, KVD_ERANGE, "%s.logit_bias: %zu ids and %zu values (equal, at most %d)", path,
                        s->n_logit_bias_ids, s->n_logit_bias, WIRE_MAX_LOGIT_BIAS);
    for (size_t i = 0; rc == 0 && i < s->n_logit_bias; i++) {
        if (s->logit_bias_ids[i] < 0)
            rc = kvd_seterr(err, errlen, KVD_ERANGE, "%s.logit_bias_ids[%zu] = %d is negative", path, i,
                            (int)s->logit_bias_ids[i]);
        else
            rc = check_float(s->logit_bias[i], -100, false, 100, path, "logit_bias", err, errlen);
        for (size_t j = 0; rc == 0 && j < i; j++)      /* at most 1,024: a quadratic check is cheap */
            if (s->logit_bias_ids[j] == s->logit_bias_ids[i])
                rc = kvd_seterr(err, errlen, KVD_ERANGE, "%s.logit_bias_ids: %d appears twice", path,
                                (int)s->logit_bias_ids[i]);
    }
    return rc;
}

static int check_tokens(const int32_t *t, size_t n, const char *path, char *err, size_t errlen)
{
    for (size_t i = 0; i < n; i++)
        if (t[i] < 0)
            return kvd_seterr(err, errlen, KVD_ERANGE, "%s[%zu] = %d is negative",
                              path, i, (int)t[i]);
    return 0;
}

/* At most WIRE_MAX_TOKENS token ids, each >= 0. */
static int check_token_list(const int32_t *t, size_t n, const char *path, char *err,
                            size_t errlen)
{
    if (n > WIRE_MAX_TOKENS)
        return kvd_seterr(err, errlen, KVD_ERANGE, "%s has %zu token ids, over the limit of %u",
                          path, n, WIRE_MAX_TOKENS);
    return check_tokens(t, n, path, err, errlen);
}

/* None, or one per token: each with as many alternatives (ids >= 0) as
 * logprobs, at most WIRE_MAX_TOP_LOGPROBS. */
static int check_logprobs(Kvd__TokenLogprob *const *lp, size_t n, size_t n_tokens, const char *path,
                          char *err, size_t errlen)
{
    if (n != 0 && n != n_tokens)
        return kvd_seterr(err, errlen, KVD_ERANGE, "%s has %zu entries for %zu tokens", path, n, n_tokens);
    for (size_t i = 0; i < n; i++) {
        if (lp[i] == NULL)
            return kvd_seterr(err, errlen, KVD_EFORMAT, "%s[%zu] is missing", path, i);
        if (lp[i]->n_top_ids != lp[i]->n_top_logprobs || lp[i]->n_top_ids > WIRE_MAX_TOP_LOGPROBS ||
            (lp[i]->n_top_tokens != 0 && lp[i]->n_top_tokens != lp[i]->n_top_ids))
            return kvd_seterr(err, errlen, KVD_ERANGE,
                              "%s[%zu] has %zu alternatives, %zu logprobs and %zu token texts (at most %u)",
                              path, i, lp[i]->n_top_ids, lp[i]->n_top_logprobs, lp[i]->n_top_tokens,
                              WIRE_MAX_TOP_LOGPROBS);
        int rc = check_tokens(lp[i]->top_ids, lp[i]->n_top_ids, path, err, errlen);
        if (rc)
            return rc;
    }
    return 0;
}

static int check_enum(const ProtobufCEnumDescriptor *d, int v, const char *path, char *err,
                      size_t errlen)
{
    if (protobuf_c_enum_descriptor_get_value(d, v) != NULL)
        return 0;
    return kvd_seterr(err, errlen, KVD_ERANGE, "%s = %d is not a known %s", path, v, d->short_name);
}

static int check_blocks(size_t n, const char *path, char *err, size_t errlen)
{
    if (n == 0 || n > WIRE_MAX_BLOCKS)
        return kvd_seterr(err, errlen, KVD_ERANGE, "%s has %zu block ids, outside [1, %u]",
                          path, n, WIRE_MAX_BLOCKS);
    return 0;
}

/* ---- client requests ----------------------------------------------------------------- */

/* Chat messages of a request (`what`: "generate" or "tokenize"). */
static int check_messages(Kvd__ChatMessage *const *msgs, size_t n_msgs, const char *what, char *err,
                          size_t errlen)
{
    if (n_msgs > WIRE_MAX_MESSAGES)
        return kvd_seterr(err, errlen, KVD_ERANGE,
                          "%s.messages has %zu entries, over the limit of %u", what, n_msgs, WIRE_MAX_MESSAGES);
    size_t total = 0;
    for (size_t i = 0; i < n_msgs; i++) {
        const Kvd__ChatMessage *c = msgs[i];
        if (c == NULL)
            return kvd_seterr(err, errlen, KVD_EFORMAT, "%s.messages[%zu] is missing", what, i);
        if (c->role == NULL)
            return kvd_seterr(err, errlen, KVD_EFORMAT, "%s.messages[%zu] has no role", what, i);
        if (strcmp(c->role, "system") != 0 && strcmp(c->role, "user") != 0 &&
            strcmp(c->role, "assistant") != 0 && strcmp(c->role, "tool") != 0) {
            char q[48];
            return kvd_seterr(err, errlen, KVD_ERANGE,
                              "%s.messages[%zu].role = \"%s\" is not system, user, "
                              "assistant or tool",
                              what, i, printable(q, sizeof(q), c->role));
        }
        if (c->content == NULL)
            return kvd_seterr(err, errlen, KVD_EFORMAT, "%s.messages[%zu] has no content", what, i);
        total += strlen(c->content);
        if (c->n_tool_calls > WIRE_MAX_TOOL_CALLS || (c->n_tool_calls > 0 && strcmp(c->role, "assistant") != 0))
            return kvd_seterr(err, errlen, KVD_ERANGE, "%s.messages[%zu] has %zu tool calls (at most %u, an "
                              "assistant's)", what, i, c->n_tool_calls, WIRE_MAX_TOOL_CALLS);
        for (size_t k = 0; k < c->n_tool_calls; k++) {
            if (c->tool_calls[k] == NULL)
                return kvd_seterr(err, errlen, KVD_EFORMAT, "%s.messages[%zu].tool_calls[%zu] is missing",
                                  what, i, k);
            total += strlen(c->tool_calls[k]);
        }
    }
    if (total > WIRE_MAX_PROMPT_BYTES)
        return kvd_seterr(err, errlen, KVD_ETOOLONG,
                          "%s.messages hold %zu bytes of content, over the limit of %u",
                          what, total, WIRE_MAX_PROMPT_BYTES);
    return 0;
}

/* Exactly one prompt form, and that one within its limits. */
static int check_prompt(const Kvd__GenerateRequest *g, char *err, size_t errlen)
{
    bool text = g->prompt != NULL && g->prompt[0] != '\0';
    bool lz4 = g->has_prompt_lz4 || g->has_prompt_lz4_size;
    bool msgs = g->n_messages > 0;
    bool ids = g->n_token_ids > 0;
    int forms = text + lz4 + msgs + ids;
    if (forms == 0)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "generate has no prompt "
                          "(one of prompt, prompt_lz4, messages, token_ids)");
    if (forms > 1) {
        const char *names[4];
        int n = 0;
        if (text)
            names[n++] = "prompt";
        if (lz4)
            names[n++] = "prompt_lz4";
        if (msgs)
            names[n++] = "messages";
        if (ids)
            names[n++] = "token_ids";
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "generate has %d prompt forms (%s, %s%s%s%s%s), exactly one is allowed",
                          n, names[0], names[1], n > 2 ? ", " : "", n > 2 ? names[2] : "",
                          n > 3 ? ", " : "", n > 3 ? names[3] : "");
    }
    if (text) {
        size_t n = strlen(g->prompt);
        if (n > WIRE_MAX_PROMPT_BYTES)
            return kvd_seterr(err, errlen, KVD_ETOOLONG,
                              "generate.prompt is %zu bytes, over the limit of %u",
                              n, WIRE_MAX_PROMPT_BYTES);
    }
    if (lz4) {
        if (!g->has_prompt_lz4_size)
            return missing("generate.prompt_lz4", "prompt_lz4_size", err, errlen);
        if (!g->has_prompt_lz4 || g->prompt_lz4.len == 0)
            return kvd_seterr(err, errlen, KVD_EFORMAT,
                              "generate.prompt_lz4 is empty (prompt_lz4_size = %u)",
                              g->prompt_lz4_size);
        if (g->prompt_lz4_size == 0)
            return kvd_seterr(err, errlen, KVD_ERANGE,
                              "generate.prompt_lz4_size = 0 is outside [1, %u]",
                              WIRE_MAX_PROMPT_BYTES);
        if (g->prompt_lz4_size > WIRE_MAX_PROMPT_BYTES)
            return kvd_seterr(err, errlen, KVD_ETOOLONG,
                              "generate.prompt_lz4_size = %u is over the limit of %u",
                              g->prompt_lz4_size, WIRE_MAX_PROMPT_BYTES);
        size_t bound = (size_t)LZ4_compressBound((int)g->prompt_lz4_size);
        if (g->prompt_lz4.len > bound)
            return kvd_seterr(err, errlen, KVD_EFORMAT,
                              "generate.prompt_lz4 is %zu bytes, more than LZ4 needs for "
                              "prompt_lz4_size = %u (%zu)",
                              g->prompt_lz4.len, g->prompt_lz4_size, bound);
    }
    if (msgs)
        return check_messages(g->messages, g->n_messages, "generate", err, errlen);
    if (ids) {
        if (g->n_token_ids > WIRE_MAX_TOKENS)
            return kvd_seterr(err, errlen, KVD_ETOOLONG,
                              "generate.token_ids has %zu ids, over the limit of %u",
                              g->n_token_ids, WIRE_MAX_TOKENS);
        return check_tokens(g->token_ids, g->n_token_ids, "generate.token_ids", err, errlen);
    }
    return 0;
}

static int check_generate(const Kvd__GenerateRequest *g, char *err, size_t errlen)
{
    int rc = check_prompt(g, err, errlen);
    if (rc)
        return rc;
    if (g->sampling != NULL && (rc = check_sampling(g->sampling, "generate.sampling", err, errlen)))
        return rc;
    if (g->has_max_tokens && g->max_tokens > WIRE_MAX_NEW_TOKENS)
        return kvd_seterr(err, errlen, KVD_ERANGE,
                          "generate.max_tokens = %u is over the limit of %u",
                          g->max_tokens, WIRE_MAX_NEW_TOKENS);
    if (g->n_stop > WIRE_MAX_STOPS)
        return kvd_seterr(err, errlen, KVD_ERANGE,
                          "generate.stop has %zu strings, over the limit of %u",
                          g->n_stop, WIRE_MAX_STOPS);
    for (size_t i = 0; i < g->n_stop; i++) {
        if (g->stop[i] == NULL)
            return kvd_seterr(err, errlen, KVD_EFORMAT, "generate.stop[%zu] is missing", i);
        size_t n = strlen(g->stop[i]);
        if (n == 0 || n > WIRE_MAX_STOP_BYTES)
            return kvd_seterr(err, errlen, KVD_ERANGE,
                              "generate.stop[%zu] is %zu bytes, outside [1, %u]",
                              i, n, WIRE_MAX_STOP_BYTES);
    }
    if (g->has_logprobs && g->logprobs > WIRE_MAX_TOP_LOGPROBS)
        return kvd_seterr(err, errlen, KVD_ERANGE, "generate.logprobs = %u is over the limit of %u",
                          g->logprobs, WIRE_MAX_TOP_LOGPROBS);
    if (g->json_schema != NULL && strlen(g->json_schema) > WIRE_MAX_SCHEMA_BYTES)
        return kvd_seterr(err, errlen, KVD_ERANGE, "generate.json_schema is %zu bytes, over the limit of %u",
                          strlen(g->json_schema), WIRE_MAX_SCHEMA_BYTES);
    if (g->json_schema != NULL && g->has_json_object && g->json_object)
        return kvd_seterr(err, errlen, KVD_EINVAL, "generate: json_schema and json_object are exclusive");
    if (g->n_tools > WIRE_MAX_TOOLS)
        return kvd_seterr(err, errlen, KVD_ERANGE, "generate.tools has %zu functions, over the limit of %u",
                          g->n_tools, WIRE_MAX_TOOLS);
    for (size_t i = 0; i < g->n_tools; i++)
        if (g->tools[i] == NULL || strlen(g->tools[i]) > WIRE_MAX_TOOL_BYTES)
            return kvd_seterr(err, errlen, KVD_ERANGE, "generate.tools[%zu] is missing or over %u bytes", i,
                              WIRE_MAX_TOOL_BYTES);
    if (g->n_tools > 0 && g->n_messages == 0)
        return kvd_seterr(err, errlen, KVD_EINVAL, "generate.tools need messages (a chat)");
    if (g->tool_choice != NULL && strcmp(g->tool_choice, "auto") != 0) {
        if (g->n_tools == 0)
            return kvd_seterr(err, errlen, KVD_EINVAL, "generate.tool_choice needs tools");
        if (g->json_schema != NULL || (g->has_json_object && g->json_object))
            return kvd_seterr(err, errlen, KVD_EINVAL, "generate: tool_choice and structured output are exclusive");
    }
    if (g->has_context_overflow &&
        (rc = check_enum(&kvd__context_overflow__descriptor, g->context_overflow, "generate.context_overflow",
                         err, errlen)) != 0)
        return rc;
    if (g->has_prompt_logprobs && g->prompt_logprobs > WIRE_MAX_TOP_LOGPROBS)
        return kvd_seterr(err, errlen, KVD_ERANGE, "generate.prompt_logprobs = %u is over the limit of %u",
                          g->prompt_logprobs, WIRE_MAX_TOP_LOGPROBS);
    if (g->has_deadline_ms && g->deadline_ms > WIRE_MAX_DEADLINE_MS)
        return kvd_seterr(err, errlen, KVD_ERANGE,
                          "generate.deadline_ms = %u is over the limit of %u",
                          g->deadline_ms, WIRE_MAX_DEADLINE_MS);
    if (g->namespace_ != NULL) {
        size_t n = strlen(g->namespace_);
        if (n > WIRE_MAX_NAMESPACE)
            return kvd_seterr(err, errlen, KVD_ERANGE,
                              "generate.namespace is %zu bytes, over the limit of %u",
                              n, WIRE_MAX_NAMESPACE);
    }
    if (g->has_pin_ttl_s && (g->pin_ttl_s == 0 || g->pin_ttl_s > WIRE_MAX_PIN_TTL_S))
        return kvd_seterr(err, errlen, KVD_ERANGE, "generate.pin_ttl_s = %u is outside [1, %u]",
                          g->pin_ttl_s, WIRE_MAX_PIN_TTL_S);
    if (g->has_pin_messages && g->pin_messages > 0 && !g->has_pin_ttl_s)
        return kvd_seterr(err, errlen, KVD_EINVAL, "generate.pin_messages needs pin_ttl_s");
    if (g->has_pin_messages && g->pin_messages > g->n_messages)
        return kvd_seterr(err, errlen, KVD_ERANGE, "generate.pin_messages = %u, but there are %zu messages",
                          g->pin_messages, g->n_messages);
    return 0;
}

/* An op, a pin id where it needs one, a namespace within bounds. */
static int check_cache(const Kvd__CacheRequest *c, char *err, size_t errlen)
{
    if (!c->has_op || c->op < KVD__CACHE_REQUEST__OP__OP_LIST || c->op > KVD__CACHE_REQUEST__OP__OP_EVICT)
        return kvd_seterr(err, errlen, KVD_EINVAL, "cache.op must be list, unpin or evict");
    if (c->op != KVD__CACHE_REQUEST__OP__OP_LIST &&
        (c->pin_id == NULL || c->pin_id[0] == '\0' || strlen(c->pin_id) > 64))
        return kvd_seterr(err, errlen, KVD_EINVAL, "cache.pin_id is missing or over 64 bytes");
    if (c->namespace_ != NULL && strlen(c->namespace_) > WIRE_MAX_NAMESPACE)
        return kvd_seterr(err, errlen, KVD_ERANGE, "cache.namespace is over the limit of %u bytes",
                          WIRE_MAX_NAMESPACE);
    return 0;
}

/* Exactly one of text, messages and token ids, within the prompt limits. */
static int check_tokenize(const Kvd__TokenizeRequest *t, char *err, size_t errlen)
{
    const int forms = (t->text != NULL) + (t->n_messages > 0) + (t->n_token_ids > 0);
    if (forms != 1)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "tokenize needs exactly one of text, messages and token_ids (got %d)", forms);
    if (t->text != NULL && strlen(t->text) > WIRE_MAX_PROMPT_BYTES)
        return kvd_seterr(err, errlen, KVD_ETOOLONG, "tokenize.text is over the limit of %u bytes",
                          WIRE_MAX_PROMPT_BYTES);
    if (t->n_messages > 0)
        return check_messages(t->messages, t->n_messages, "tokenize", err, errlen);
    if (t->n_token_ids > WIRE_MAX_TOKENS)
        return kvd_seterr(err, errlen, KVD_ETOOLONG, "tokenize.token_ids has %zu ids, over the limit of %u",
                          t->n_token_ids, WIRE_MAX_TOKENS);
    return check_tokens(t->token_ids, t->n_token_ids, "tokenize.token_ids", err, errlen);
}

int wire_check_client_request(const Kvd__ClientRequest *m, char *err, size_t errlen)
{
    static const char what[] = "ClientRequest";
    int rc = check_version(m->has_version, m->version, what, err, errlen);
    if (rc)
        return rc;
    if (!m->has_request_id)
        return missing(what, "request_id", err, errlen);
    switch (m->body_case) {
    case KVD__CLIENT_REQUEST__BODY_GENERATE:
        if (m->generate == NULL)
            break;
        return check_generate(m->generate, err, errlen);
    case KVD__CLIENT_REQUEST__BODY_CANCEL:
        if (m->cancel == NULL)
            break;
        if (!m->cancel->has_target)
            return missing("cancel", "target", err, errlen);
        return 0;
    case KVD__CLIENT_REQUEST__BODY_STATS:
        if (m->stats == NULL)
            break;
        return 0;
    case KVD__CLIENT_REQUEST__BODY_HEALTH:
        if (m->health == NULL)
            break;
        return 0;
    case KVD__CLIENT_REQUEST__BODY_TOKENIZE:
        if (m->tokenize == NULL)
            break;
        return check_tokenize(m->tokenize, err, errlen);
    case KVD__CLIENT_REQUEST__BODY_CACHE:
        if (m->cache == NULL)
            break;
        return check_cache(m->cache, err, errlen);
    default:
        break;
    }
    return kvd_seterr(err, errlen, KVD_EFORMAT,
                      "ClientRequest has no body (generate, cancel, stats, health, tokenize or cache)");
}

/* ---- server replies ------------------------------------------------------------------ */

static int check_final(const Kvd__Final *f, char *err, size_t errlen)
{
    int rc;
    if (f->has_finish_reason &&
        (rc = check_enum(&kvd__finish_reason__descriptor, f->finish_reason, "final.finish_reason",
                         err, errlen)))
        return rc;
    if (f->text == NULL)
        return missing("final", "text", err, errlen);
    if ((rc = check_token_list(f->token_ids, f->n_token_ids, "final.token_ids", err, errlen)))
        return rc;
    if ((rc = check_logprobs(f->logprobs, f->n_logprobs, f->n_token_ids, "final.logprobs", err, errlen)))
        return rc;
    if ((rc = check_token_list(f->prompt_token_ids, f->n_prompt_token_ids, "final.prompt_token_ids", err, errlen)))
        return rc;
    if (f->n_prompt_logprobs != 0 && f->n_prompt_logprobs != f->n_prompt_token_ids)
        return kvd_seterr(err, errlen, KVD_ERANGE, "final.prompt_logprobs has %zu entries for %zu tokens",
                          f->n_prompt_logprobs, f->n_prompt_token_ids);
    if (f->n_prompt_logprobs > WIRE_MAX_TOKENS)
        return kvd_seterr(err, errlen, KVD_ERANGE, "final.prompt_logprobs has %zu entries, over %u",
                          f->n_prompt_logprobs, WIRE_MAX_TOKENS);
    return check_logprobs(f->prompt_logprobs, f->n_prompt_logprobs, f->n_prompt_logprobs, "final.prompt_logprobs",
                          err, errlen);
}

int wire_check_server_reply(const Kvd__ServerReply *m, char *err, size_t errlen)
{
    int rc = check_version(m->has_version, m->version, "ServerReply", err, errlen);
    if (rc)
        return rc;
    switch (m->body_case) {
    case KVD__SERVER_REPLY__BODY_ACCEPTED:
        if (m->accepted == NULL)
            break;
        return 0;
    case KVD__SERVER_REPLY__BODY_CHUNK:
        if (m->chunk == NULL)
            break;
        if (m->chunk->text == NULL)
            return missing("chunk", "text", err, errlen);
        if ((rc = check_token_list(m->chunk->token_ids, m->chunk->n_token_ids, "chunk.token_ids",
                                   err, errlen)))
            return rc;
        return check_logprobs(m->chunk->logprobs, m->chunk->n_logprobs, m->chunk->n_token_ids,
                              "chunk.logprobs", err, errlen);
    case KVD__SERVER_REPLY__BODY_FINAL:
        if (m->final == NULL)
            break;
        return check_final(m->final, err, errlen);
    case KVD__SERVER_REPLY__BODY_ERROR:
        if (m->error == NULL)
            break;
        if (m->error->has_code &&
            (rc = check_enum(&kvd__error_code__descriptor, m->error->code, "error.code",
                             err, errlen)))
            return rc;
        if (m->error->message == NULL)
            return missing("error", "message", err, errlen);
        return 0;
    case KVD__SERVER_REPLY__BODY_STATS:
        if (m->stats == NULL)
            break;
        for (size_t i = 0; i < m->stats->n_workers; i++)
            if (m->stats->workers[i] == NULL)
                return kvd_seterr(err, errlen, KVD_EFORMAT, "stats.workers[%zu] is missing", i);
        return 0;
    case KVD__SERVER_REPLY__BODY_HEALTH:
        if (m->health == NULL)
            break;
        if (m->health->model == NULL)
            return missing("health", "model", err, errlen);
        return 0;
    case KVD__SERVER_REPLY__BODY_TOKENS:
        if (m->tokens == NULL)
            break;
        return check_token_list(m->tokens->token_ids, m->tokens->n_token_ids, "tokens.token_ids", err, errlen);
    case KVD__SERVER_REPLY__BODY_CACHE:
        if (m->cache == NULL)
            break;
        for (size_t i = 0; i < m->cache->n_pins; i++)
            if (m->cache->pins[i] == NULL || m->cache->pins[i]->id == NULL)
                return kvd_seterr(err, errlen, KVD_EFORMAT, "cache.pins[%zu] is missing or has no id", i);
        return 0;
    default:
        break;
    }
    return kvd_seterr(err, errlen, KVD_EFORMAT, "ServerReply has no body");
}

/* ---- worker -> kvd ------------------------------------------------------------------- */

static int check_ready(const Kvdw__Ready *r, char *err, size_t errlen)
{
    if (!r->has_fingerprint)
        return missing("ready", "fingerprint", err, errlen);
    if (r->fingerprint.len != 16)
        return kvd_seterr(err, errlen, KVD_ERANGE, "ready.fingerprint is %zu bytes, expected 16",
                          r->fingerprint.len);
    if (!r->has_block_tokens)
        return missing("ready", "block_tokens", err, errlen);
    if (r->block_tokens < 1 || r->block_tokens > 4096)
        return kvd_seterr(err, errlen, KVD_ERANGE, "ready.block_tokens = %u is outside [1, 4096]",
                          r->block_tokens);
    if (!r->has_max_batch)
        return missing("ready", "max_batch", err, errlen);
    if (r->max_batch < 1)
        return kvd_seterr(err, errlen, KVD_ERANGE, "ready.max_batch = 0 is below 1");
    if (r->host != NULL && r->host[0] != '\0') {
        size_t n = strlen(r->host);
        if (n > 63)
            return kvd_seterr(err, errlen, KVD_ERANGE, "ready.host is %zu bytes, over 63", n);
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)r->host[i] <= ' ' || (unsigned char)r->host[i] >= 0x7f || r->host[i] == '"' ||
                r->host[i] == '\\')
                return kvd_seterr(err, errlen, KVD_EFORMAT,
                                  "ready.host may hold printable ASCII without spaces, quotes or backslashes");
        if (!r->has_pool_instance || r->pool_instance == 0)
            return missing("ready", "pool_instance", err, errlen);
        if (!r->has_pool_blocks || r->pool_blocks < 1)
            return missing("ready", "pool_blocks", err, errlen);
        if (r->pool_blocks > WIRE_MAX_POOL_BLOCKS)
            return kvd_seterr(err, errlen, KVD_ERANGE, "ready.pool_blocks = %u is over the limit of %u",
                              r->pool_blocks, WIRE_MAX_POOL_BLOCKS);
    }
    return 0;
}

int wire_check_from_worker(const Kvdw__FromWorker *m, char *err, size_t errlen)
{
    int rc = check_version(m->has_version, m->version, "FromWorker", err, errlen);
    if (rc)
        return rc;
    switch (m->body_case) {
    case KVDW__FROM_WORKER__BODY_READY:
        if (m->ready == NULL)
            break;
        return check_ready(m->ready, err, errlen);
    case KVDW__FROM_WORKER__BODY_HEARTBEAT:
        if (m->heartbeat == NULL)
            break;
        return 0;
    case KVDW__FROM_WORKER__BODY_COMMIT:
        if (m->commit == NULL)
            break;
        if (!m->commit->has_seq_id)
            return missing("commit", "seq_id", err, errlen);
        if (!m->commit->has_n_written)
            return missing("commit", "n_written", err, errlen);
        if (m->commit->n_prompt_logprobs > WIRE_MAX_TOKENS)
            return kvd_seterr(err, errlen, KVD_ERANGE, "commit.prompt_logprobs has %zu entries, over %u",
                              m->commit->n_prompt_logprobs, WIRE_MAX_TOKENS);
        return check_logprobs(m->commit->prompt_logprobs, m->commit->n_prompt_logprobs,
                              m->commit->n_prompt_logprobs, "commit.prompt_logprobs", err, errlen);
    case KVDW__FROM_WORKER__BODY_CHUNK:
        if (m->chunk == NULL)
            break;
        if (!m->chunk->has_seq_id)
            return missing("chunk", "seq_id", err, errlen);
        if (!m->chunk->has_n_written)
            return missing("chunk", "n_written", err, errlen);
        if ((rc = check_token_list(m->chunk->tokens, m->chunk->n_tokens, "chunk.tokens", err,
                                   errlen)))
            return rc;
        return check_logprobs(m->chunk->logprobs, m->chunk->n_logprobs, m->chunk->n_tokens,
                              "chunk.logprobs", err, errlen);
    case KVDW__FROM_WORKER__BODY_LEASE:
        if (m->lease == NULL)
            break;
        if (!m->lease->has_seq_id)
            return missing("lease", "seq_id", err, errlen);
        if (!m->lease->has_n_positions)
            return missing("lease", "n_positions", err, errlen);
        return 0;
    case KVDW__FROM_WORKER__BODY_WINDOW:
        if (m->window == NULL)
            break;
        if (!m->window->has_seq_id)
            return missing("window", "seq_id", err, errlen);
        if (!m->window->has_n_written)
            return missing("window", "n_written", err, errlen);
        return 0;
    case KVDW__FROM_WORKER__BODY_DONE:
        if (m->done == NULL)
            break;
        if (!m->done->has_seq_id)
            return missing("done", "seq_id", err, errlen);
        if (!m->done->has_reason)
            return missing("done", "reason", err, errlen);
        return check_enum(&kvdw__done_reason__descriptor, m->done->reason, "done.reason",
                          err, errlen);
    default:
        break;
    }
    return kvd_seterr(err, errlen, KVD_EFORMAT, "FromWorker has no body");
}

/* ---- kvd -> worker ------------------------------------------------------------------- */

static int check_assign(const Kvdw__Assign *s, char *err, size_t errlen)
{
    if (!s->has_seq_id)
        return missing("assign", "seq_id", err, errlen);
    if (s->n_tokens == 0 || s->n_tokens > WIRE_MAX_TOKENS)
        return kvd_seterr(err, errlen, KVD_ERANGE,
                          "assign.tokens has %zu token ids, outside [1, %u]",
                          s->n_tokens, WIRE_MAX_TOKENS);
    int rc = check_tokens(s->tokens, s->n_tokens, "assign.tokens", err, errlen);
    if (rc)
        return rc;
    if ((rc = check_blocks(s->n_blocks, "assign.blocks", err, errlen)))
        return rc;
    if (s->has_n_cached && s->n_cached > s->n_tokens)
        return kvd_seterr(err, errlen, KVD_ERANGE,
                          "assign.n_cached = %u is more than its %zu tokens",
                          s->n_cached, s->n_tokens);
    if (s->has_n_generated && s->n_generated > s->n_tokens)
        return kvd_seterr(err, errlen, KVD_ERANGE,
                          "assign.n_generated = %u is more than its %zu tokens",
                          s->n_generated, s->n_tokens);
    if (s->has_max_new && s->max_new > WIRE_MAX_NEW_TOKENS)
        return kvd_seterr(err, errlen, KVD_ERANGE, "assign.max_new = %u is over the limit of %u",
                          s->max_new, WIRE_MAX_NEW_TOKENS);
    if (s->has_logprobs && s->logprobs > WIRE_MAX_TOP_LOGPROBS)
        return kvd_seterr(err, errlen, KVD_ERANGE, "assign.logprobs = %u is over the limit of %u",
                          s->logprobs, WIRE_MAX_TOP_LOGPROBS);
    if (s->json_schema != NULL && strlen(s->json_schema) > WIRE_MAX_SCHEMA_BYTES)
        return kvd_seterr(err, errlen, KVD_ERANGE, "assign.json_schema is %zu bytes, over the limit of %u",
                          strlen(s->json_schema), WIRE_MAX_SCHEMA_BYTES);
    if (s->n_tools > WIRE_MAX_TOOLS)
        return kvd_seterr(err, errlen, KVD_ERANGE, "assign.tools has %zu functions, over the limit of %u",
                          s->n_tools, WIRE_MAX_TOOLS);
    for (size_t i = 0; i < s->n_tools; i++)
        if (s->tools[i] == NULL || strlen(s->tools[i]) > WIRE_MAX_TOOL_BYTES)
            return kvd_seterr(err, errlen, KVD_ERANGE, "assign.tools[%zu] is missing or over %u bytes", i,
                              WIRE_MAX_TOOL_BYTES);
    if (s->tool_choice != NULL && s->n_tools == 0)
        return kvd_seterr(err, errlen, KVD_EINVAL, "assign.tool_choice needs tools");
    if (s->has_prompt_logprobs && s->prompt_logprobs > WIRE_MAX_TOP_LOGPROBS)
        return kvd_seterr(err, errlen, KVD_ERANGE, "assign.prompt_logprobs = %u is over the limit of %u",
                          s->prompt_logprobs, WIRE_MAX_TOP_LOGPROBS);
    if (s->sampling != NULL)
        return check_sampling(s->sampling, "assign.sampling", err, errlen);
    return 0;
}

int wire_check_to_worker(const Kvdw__ToWorker *m, char *err, size_t errlen)
{
    int rc = check_version(m->has_version, m->version, "ToWorker", err, errlen);
    if (rc)
        return rc;
    switch (m->body_case) {
    case KVDW__TO_WORKER__BODY_ASSIGN:
        if (m->assign == NULL)
            break;
        return check_assign(m->assign, err, errlen);
    case KVDW__TO_WORKER__BODY_GRANT:
        if (m->grant == NULL)
            break;
        if (!m->grant->has_seq_id)
            return missing("grant", "seq_id", err, errlen);
        /* empty: the answer to an ahead lease that the pool has no room for */
        return m->grant->n_blocks == 0 ? 0 : check_blocks(m->grant->n_blocks, "grant.blocks", err, errlen);
    case KVDW__TO_WORKER__BODY_WINDOW:
        if (m->window == NULL)
            break;
        if (!m->window->has_seq_id)
            return missing("window", "seq_id", err, errlen);
        if (!m->window->has_keep || !m->window->has_drop || m->window->drop == 0)
            return missing("window", "keep and drop", err, errlen);
        if (m->window->n_copy_from != m->window->n_copy_to || m->window->n_copy_from > m->window->n_blocks)
            return kvd_seterr(err, errlen, KVD_ERANGE, "window has %zu copy_from, %zu copy_to for %zu blocks",
                              m->window->n_copy_from, m->window->n_copy_to, m->window->n_blocks);
        return check_blocks(m->window->n_blocks, "window.blocks", err, errlen);
    case KVDW__TO_WORKER__BODY_CANCEL:
        if (m->cancel == NULL)
            break;
        if (!m->cancel->has_seq_id)
            return missing("cancel", "seq_id", err, errlen);
        return 0;
    case KVDW__TO_WORKER__BODY_DRAIN:
        if (m->drain == NULL)
            break;
        return 0;
    case KVDW__TO_WORKER__BODY_PING:
        if (m->ping == NULL)
            break;
        return 0;
    default:
        break;
    }
    return kvd_seterr(err, errlen, KVD_EFORMAT, "ToWorker has no body");
}

/* ---- prompt text, packing, compression ------------------------------------------------ */

int wire_prompt_text(wire_arena_t *a, const Kvd__GenerateRequest *g, const char **text,
                     size_t *len, char *err, size_t errlen)
{
    if (g->prompt != NULL && g->prompt[0] != '\0') {
        *text = g->prompt;
        *len = strlen(g->prompt);
        return 0;
    }
    if (!g->has_prompt_lz4 && !g->has_prompt_lz4_size)
        return kvd_seterr(err, errlen, KVD_ENOTFOUND, "generate has no prompt text");
    uint32_t size = g->prompt_lz4_size;
    if (!g->has_prompt_lz4_size || size == 0 || size > WIRE_MAX_PROMPT_BYTES)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "generate.prompt_lz4_size = %u is outside [1, %u]",
                          g->has_prompt_lz4_size ? size : 0, WIRE_MAX_PROMPT_BYTES);
    if (!g->has_prompt_lz4 || g->prompt_lz4.len == 0 || g->prompt_lz4.len > INT_MAX)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "generate.prompt_lz4 is %zu bytes",
                          g->has_prompt_lz4 ? g->prompt_lz4.len : 0);
    char *out = arena_alloc(a, (size_t)size + 1);
    if (out == NULL)
        return kvd_seterr(err, errlen, KVD_ENOMEM,
                          "generate.prompt_lz4: no room for %u bytes of text in the arena", size);
    int n = LZ4_decompress_safe((const char *)g->prompt_lz4.data, out, (int)g->prompt_lz4.len,
                                (int)size);
    if (n < 0)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "generate.prompt_lz4 (%zu bytes) is not LZ4 data of prompt_lz4_size = %u "
                          "bytes", g->prompt_lz4.len, size);
    if ((uint32_t)n != size)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "generate.prompt_lz4 decompresses to %d bytes, but prompt_lz4_size = %u",
                          n, size);
    out[size] = '\0';
    *text = out;
    *len = size;
    return 0;
}

int wire_pack(const ProtobufCMessage *m, uint8_t **buf, size_t *len)
{
    *buf = NULL;
    *len = 0;
    size_t n = protobuf_c_message_get_packed_size(m);
    if (n > WIRE_MAX_FRAME)
        return KVD_ERANGE;
    uint8_t *b = malloc(n > 0 ? n : 1);
    if (b == NULL)
        return KVD_ENOMEM;
    size_t w = protobuf_c_message_pack(m, b);
    assert(w == n);
    (void)w;
    *buf = b;
    *len = n;
    return 0;
}

int wire_lz4_compress(const char *text, size_t len, uint8_t **out, size_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    if (len > WIRE_MAX_PROMPT_BYTES)
        return KVD_ERANGE;
    int bound = LZ4_compressBound((int)len);
    char *b = malloc((size_t)bound);
    if (b == NULL)
        return KVD_ENOMEM;
    int n = LZ4_compress_default(text, b, (int)len, bound);
    if (n <= 0) {   /* cannot happen with a buffer of LZ4_compressBound bytes */
        free(b);
        return KVD_EINTERNAL;
    }
    char *shrunk = realloc(b, (size_t)n);
    *out = (uint8_t *)(shrunk != NULL ? shrunk : b);
    *out_len = (size_t)n;
    return 0;
}

/* Reads a varint at *p (below end); false when truncated or longer than 10 bytes. */
static bool read_varint(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    uint64_t x = 0;
    for (int shift = 0; shift < 70 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        x |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v = x;
            return true;
        }
    }
    return false;
}

uint64_t wire_client_request_id(const void *buf, size_t len)
{
    const uint8_t *p = buf, *end = p + len;
    while (p < end) {
        uint64_t tag, v;
        if (!read_varint(&p, end, &tag))
            return 0;
        switch (tag & 7) {
        case 0: /* varint */
            if (!read_varint(&p, end, &v))
                return 0;
            if (tag >> 3 == 2)
                return v;
            break;
        case 1: /* 64-bit */
            if (end - p < 8)
                return 0;
            p += 8;
            break;
        case 2: /* length-delimited */
            if (!read_varint(&p, end, &v) || v > (uint64_t)(end - p))
                return 0;
            p += v;
            break;
        case 5: /* 32-bit */
            if (end - p < 4)
                return 0;
            p += 4;
            break;
        default:
            return 0;
        }
    }
    return 0;
}
