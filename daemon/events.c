/*
 * events.c - kvd's block events: the prefix index's observer, packing what it
 * hears with msgpack-c and publishing it on a ZeroMQ PUB socket (events.h).
 *
 * Events are queued in the order the allocator reports them: removals run
 * together into one BlockRemoved until anything else comes, each commit's
 * newly findable run is one BlockStored. kvd's loop flushes the queue once
 * per iteration, so a batch is what one pass over the sockets changed.
 */
#include "events.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <msgpack.h>
#include <zmq.h>

#include "auth.h"
#include "err.h"

/* A batch is sent early once it holds this many events (a flood of commits
 * in one loop pass stays a series of bounded messages). */
#define FLUSH_EVENTS 1024

struct kv_events {
    void *pub;
    prefix_t *px;
    char *topic;
    char *medium;
    uint32_t block_tokens;
    msgpack_sbuffer body;       /* the queued events, packed */
    msgpack_packer pk;
    uint32_t n_events;
    uint64_t *removed;          /* hashes of a BlockRemoved still open */
    uint32_t n_removed, removed_cap;
    uint64_t seq;               /* next sequence number */
    bool all_tokens;            /* every block's token ids */
    prefix_ns_t shared[2];      /* else only these namespaces' */
    uint32_t n_shared;
    bool broken;                /* out of memory: events are lost; the next announce starts over */
};

static void pack_cstr(msgpack_packer *pk, const char *s)
{
    msgpack_pack_str_with_body(pk, s, strlen(s));
}

/* Packs the open BlockRemoved, if any, as one event. */
static void close_removed(kv_events_t *ev)
{
    if (ev->n_removed == 0)
        return;
    msgpack_packer *pk = &ev->pk;
    msgpack_pack_array(pk, 3);
    pack_cstr(pk, "BlockRemoved");
    msgpack_pack_array(pk, ev->n_removed);
    for (uint32_t i = 0; i < ev->n_removed; i++)
        msgpack_pack_uint64(pk, ev->removed[i]);
    pack_cstr(pk, ev->medium);
    ev->n_removed = 0;
    ev->n_events++;
}

static void queued(kv_events_t *ev)
{
    if (ev->n_events >= FLUSH_EVENTS)
        kv_events_flush(ev);
}

/* Whether blocks of namespace ns go out with their token ids. */
static bool tokens_shown(const kv_events_t *ev, prefix_ns_t ns)
{
    if (ev->all_tokens)
        return true;
    for (uint32_t i = 0; i < ev->n_shared; i++)
        if (ev->shared[i].lo == ns.lo && ev->shared[i].hi == ns.hi)
            return true;
    return false;
}

static void on_stored(void *user, const prefix_key_t *keys, uint32_t n, const prefix_key_t *parent,
                      const int32_t *tokens, prefix_ns_t ns)
{
    kv_events_t *ev = user;
    close_removed(ev);
    msgpack_packer *pk = &ev->pk;
    msgpack_pack_array(pk, 8);
    pack_cstr(pk, "BlockStored");
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++)
        msgpack_pack_uint64(pk, keys[i].lo);
    if (parent != NULL)
        msgpack_pack_uint64(pk, parent->lo);
    else
        msgpack_pack_nil(pk);
    const size_t n_tok = tokens_shown(ev, ns) ? (size_t)n * ev->block_tokens : 0;
    msgpack_pack_array(pk, (uint32_t)n_tok);
    for (size_t i = 0; i < n_tok; i++)
        msgpack_pack_int32(pk, tokens[i]);
    msgpack_pack_uint32(pk, ev->block_tokens);
    msgpack_pack_nil(pk);               /* lora_id */
    pack_cstr(pk, ev->medium);
    msgpack_pack_nil(pk);               /* lora_name */
    ev->n_events++;
    queued(ev);
}

static void on_removed(void *user, prefix_key_t key)
{
    kv_events_t *ev = user;
    if (ev->n_removed == ev->removed_cap) {
        uint32_t cap = ev->removed_cap ? ev->removed_cap * 2 : 256;
        uint64_t *r = realloc(ev->removed, cap * sizeof(*r));
        if (r == NULL) {
            ev->broken = true;
            return;
        }
        ev->removed = r;
        ev->removed_cap = cap;
    }
    ev->removed[ev->n_removed++] = key.lo;
    if (ev->n_removed >= FLUSH_EVENTS) {
        close_removed(ev);
        queued(ev);
    }
}

static void on_findable(void *user, prefix_key_t key, const prefix_key_t *parent, const int32_t *tokens,
                        prefix_ns_t ns)
{
    on_stored(user, &key, 1, parent, tokens, ns);
}

kv_events_t *kv_events_open(void *zctx, const struct kv_events_params *p, prefix_t *px, char *err, size_t errlen)
{
    kv_events_t *ev = calloc(1, sizeof(*ev));
    if (ev == NULL || (ev->topic = strdup(p->topic)) == NULL || (ev->medium = strdup(p->medium)) == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "--kv-events: out of memory");
        kv_events_close(&ev);
        return NULL;
    }
    ev->px = px;
    ev->block_tokens = prefix_block_tokens(px);
    ev->all_tokens = p->all_tokens;
    ev->n_shared = p->n_shared < 2 ? p->n_shared : 2;
    memcpy(ev->shared, p->shared, sizeof(ev->shared));
    msgpack_sbuffer_init(&ev->body);
    msgpack_packer_init(&ev->pk, &ev->body, msgpack_sbuffer_write);
    ev->pub = zmq_socket(zctx, ZMQ_PUB);
    int hwm = 100000, linger = 1000;
    char why[256];
    if (ev->pub != NULL && p->curve != NULL && auth_curve_server(ev->pub, p->curve, AUTH_EVENTS, why, sizeof(why)) != 0) {
        kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "--kv-events %s: %s", p->endpoint, why);
        kv_events_close(&ev);
        return NULL;
    }
    if (ev->pub == NULL || zmq_setsockopt(ev->pub, ZMQ_SNDHWM, &hwm, sizeof(hwm)) != 0 ||
        zmq_setsockopt(ev->pub, ZMQ_LINGER, &linger, sizeof(linger)) != 0 || zmq_bind(ev->pub, p->endpoint) != 0) {
        kvd_seterr(err, errlen, KVD_EIO, "--kv-events %s: %s", p->endpoint, zmq_strerror(errno));
        kv_events_close(&ev);
        return NULL;
    }
    const struct prefix_observer obs = { .stored = on_stored, .removed = on_removed, .user = ev };
    prefix_set_observer(px, &obs);
    return ev;
}

void kv_events_announce(kv_events_t *ev)
{
    close_removed(ev);
    msgpack_pack_array(&ev->pk, 1);
    pack_cstr(&ev->pk, "AllBlocksCleared");
    ev->n_events++;
    ev->broken = false;
    prefix_for_each_findable(ev->px, on_findable, ev);
}

void kv_events_flush(kv_events_t *ev)
{
    if (ev->broken) {
        /* an event was lost: start the subscribers over from the index itself */
        msgpack_sbuffer_clear(&ev->body);
        ev->n_events = ev->n_removed = 0;
        kv_events_announce(ev);
    }
    close_removed(ev);
    if (ev->n_events == 0)
        return;
    /* [ts, [events...]]: the header, then the events as packed */
    msgpack_sbuffer head;
    msgpack_sbuffer_init(&head);
    msgpack_packer hp;
    msgpack_packer_init(&hp, &head, msgpack_sbuffer_write);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    msgpack_pack_array(&hp, 2);
    msgpack_pack_double(&hp, (double)ts.tv_sec + ts.tv_nsec / 1e9);
    msgpack_pack_array(&hp, ev->n_events);
    zmq_msg_t payload;
    if (zmq_msg_init_size(&payload, head.size + ev->body.size) == 0) {
        memcpy(zmq_msg_data(&payload), head.data, head.size);
        memcpy((char *)zmq_msg_data(&payload) + head.size, ev->body.data, ev->body.size);
        uint8_t seq[8];
        for (int i = 0; i < 8; i++)
            seq[i] = (uint8_t)(ev->seq >> (56 - 8 * i));
        /* PUB never blocks: past the high-water mark a slow subscriber loses
         * batches, and sees the gap in the sequence numbers */
        zmq_send(ev->pub, ev->topic, strlen(ev->topic), ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(ev->pub, seq, sizeof(seq), ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_msg_send(&payload, ev->pub, ZMQ_DONTWAIT);
        zmq_msg_close(&payload);
        ev->seq++;
    } else {
        ev->broken = true;
    }
    msgpack_sbuffer_destroy(&head);
    msgpack_sbuffer_clear(&ev->body);
    ev->n_events = 0;
}

uint64_t kv_events_batches(const kv_events_t *ev)
{
    return ev->seq;
}

void kv_events_close(kv_events_t **evp)
{
    kv_events_t *ev = *evp;
    if (ev == NULL)
        return;
    if (ev->pub != NULL) {
        kv_events_flush(ev);
        prefix_set_observer(ev->px, NULL);
        zmq_close(ev->pub);
    }
    msgpack_sbuffer_destroy(&ev->body);
    free(ev->removed);
    free(ev->topic);
    free(ev->medium);
    free(ev);
    *evp = NULL;
}
