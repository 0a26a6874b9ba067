/*
 * gpu_engine.h - the forward step of engine/forward.h, run whole on one CUDA
 * device.
 *
 * gpu_engine_new uploads every weight matrix once, as the GGUF stores it
 * (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K or F16 layers; the embedding table as F32,
 * F16, Q4_0, Q4_1 or Q8_0; norms as f32), for llama and gemma3 models, or borrows a copy another process uploaded
 * (gpu_weights_upload, shared through a VMM allocation), and sets up a paged
 * KV cache in device memory (K and V each F16, Q8_0 or Q4_0, optionally
 * Hadamard-rotated, as kv_params describes it) with exactly the layout of
 * kvcache.h: block b of layer l holds
 *     [K heads][V heads], each head [token in block][row of its type]
 * at base + b * block_bytes + l * n_head_kv * (k_head_bytes + v_head_bytes),
 * so a block id, and a block's bytes, mean the same to the CPU engine, to
 * this one and to every process mapping a shared pool. A cache of several
 * parts (common/kvparts.h: Gemma's windowed layers apart from its full ones)
 * holds one part's layers per block, layer l at its slot in its part, and a
 * step reads each layer through its part's table. The cache is allocated by the
 * engine, or borrowed from the caller (a device pool allocated elsewhere).
 *
 * gpu_engine_step takes the batches engine_step takes (struct fwd_seq: prefill
 * chunks and decode tokens mixed), checks them with the same rules and the
 * same messages, and returns logits on the host. As on the CPU, a sequence's
 * results depend only on its own tokens: not on the batch, the chunking, nor
 * on whether the step ran as a recorded CUDA graph, bit for bit (the GPU's
 * bits, which differ from the CPU engine's by rounding; see
 * tests/gpu/test_gpu_engine.c for the bounds).
 *
 * Steps whose sequences all decode one token are recorded as CUDA graphs and
 * replayed: one per (batch bucket, context bucket), the batch padded with
 * copies of its first token up to 1, 2, 4, 8, then multiples of 8 up to 64 and
 * of 32 beyond, the context rounded up to a power of two; the 32 most
 * recently used are kept. KVD_CUDA_GRAPHS=0 in the environment (or
 * params.graphs = 0) runs every kernel one by one instead, without padding.
 *
 * One engine is used by one thread at a time. Built only with the CUDA backend
 * (library kvd_gpu); the header needs no CUDA.
 */
#ifndef KVD_GPU_ENGINE_H
#define KVD_GPU_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "forward.h"
#include "model.h"
#include "sampler.h"

struct gpu_engine_params {
    uint32_t max_tokens;    /* most tokens in one step (device scratch), default 512 */
    uint32_t max_ctx;       /* longest sequence, default the model's training context */
    uint32_t block_tokens;  /* positions per KV block, default 16 */
    uint32_t kv_blocks;     /* blocks in the cache, default 1024 */
    uint32_t k_type;        /* KERN_F16 (default), KERN_Q8_0 or KERN_Q4_0 */
    uint32_t v_type;        /* the same choices, for V */
    uint32_t rotate;        /* KV_ROT_K | KV_ROT_V: halves stored Hadamard-rotated (default 0) */
    void *kv_base;          /* NULL: the engine allocates (and zeroes) the cache; else
                             * device memory of >= kv_blocks * block bytes, 16-byte
                             * aligned, borrowed (it must outlive the engine) */
    uint64_t kv_bytes;      /* with kv_base: the bytes there, checked against the
                             * blocks' size (0: not checked) */
    uint32_t attn_split;    /* positions per attention split, a multiple of 32; 0: 256.
                             * Engines whose results must agree use the same value. */
    int graphs;             /* 1: record decode steps as graphs, 0: never;
                             * -1 (default): yes unless KVD_CUDA_GRAPHS=0 */
    void *weights_base;     /* NULL: the engine uploads its own copy; else device memory
                             * where gpu_weights_upload put this model's weights, borrowed
                             * (it must outlive the engine): engines of several processes
                             * share one copy */
    uint64_t weights_bytes; /* with weights_base: the bytes there, checked against the model */
    const struct kv_parts *parts; /* which layers a block holds (kvparts.h; copied), as the
                             * CPU cache's kv_params.parts: steps then take one block table
                             * per part (fwd_seq.tables). NULL: one part of all layers */
};

struct gpu_engine_params gpu_engine_default_params(void);

typedef struct gpu_engine gpu_engine_t;

/* The device cache as the engine sees it. */
struct gpu_engine_kv {
    void *base;             /* device address of block 0 */
    uint32_t n_blocks;      /* blocks */
    uint32_t block_tokens;  /* positions per block */
    uint64_t block_bytes;   /* bytes per block (a part's layers, K and V) */
    uint64_t k_head_bytes;  /* one K head of one layer of one block */
    uint64_t v_head_bytes;  /* one V head of one layer of one block */
    bool owned;             /* allocated by the engine */
};

/* What the engine has done with graphs so far. */
struct gpu_engine_graph_stats {
    bool enabled;           /* decode steps are recorded (false once capture failed) */
    uint64_t captures;      /* graphs recorded and instantiated */
    uint64_t replays;       /* steps run as a graph (a capture's first run included) */
    uint64_t eager_steps;   /* steps run kernel by kernel */
    char why_disabled[160]; /* "" or why graphs are off */
};

/*
 * Opens CUDA device `device`, uploads model m's weights (m is borrowed only
 * during the call; the engine keeps no pointer into it) and allocates the
 * cache and scratch. NULL with a one-line reason in err: no such device
 * (KVD_EUNAVAILABLE-class reasons), a weight type or shape the kernels
 * cannot compute (head dim other than 64/128/256, more than 8 query heads per
 * KV head (4 at 256), Q5_K...), parts that do not fit the model's windows, bad
 * parameters, or not enough device memory.
 */
gpu_engine_t *gpu_engine_new(const model_t *m, int device, const struct gpu_engine_params *p,
                             char *err, size_t errlen);

/* The device bytes of model m's weights in the engine's layout (every matrix
 * as the GGUF stores it, norms as f32, 256-byte aligned). */
uint64_t gpu_weights_bytes(const model_t *m);

/*
 * Uploads m's weights to device memory at base on device `device` (bytes
 * there, at least gpu_weights_bytes(m)) in the layout an engine reads through
 * params.weights_base, and waits until they are there. This is how the
 * workers of a GPU share one copy: kvd uploads into a VMM allocation, each
 * worker maps it and borrows it. 0, or KVD_EUNSUPPORTED (a model the kernels
 * cannot compute), KVD_ERANGE (too few bytes), KVD_EINTERNAL with a reason.
 */
int gpu_weights_upload(const model_t *m, int device, void *base, uint64_t bytes, char *err, size_t errlen);

/* Frees device and host memory (never a borrowed cache nor borrowed weights);
 * accepts NULL and sets *e to NULL. */
void gpu_engine_destroy(gpu_engine_t **e);

/*
 * Runs one step, as engine_step: returns 0 and points *logits at n_rows rows
 * of n_vocab floats in host memory (sequence order; all_logits sequences give
 * n_tokens rows, others one), valid until the next call on this engine.
 * Checks every sequence first and returns KVD_EINVAL (empty batch or
 * sequence), KVD_ERANGE (bad token id, block id, too many tokens) or
 * KVD_ETOOLONG (past max_ctx) without touching the device; KVD_EINTERNAL
 * when the device failed (the engine is unusable after a kernel fault).
 */
int gpu_engine_step(gpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                    const float **logits, uint32_t *n_rows, char *err, size_t errlen);

/* The same, returning each row's greedy token (sampler_argmax of the row,
 * computed on the device) instead of the logits, which stay on the device:
 * *ids points at n_rows ids, valid until the next call. */
int gpu_engine_step_argmax(gpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                           const int32_t **ids, uint32_t *n_rows, char *err, size_t errlen);

/*
 * The same, choosing each row's token on the device: draws[i] is what
 * sampler_pick would do with row i (engine/sampler.h's plan), NULL when row i
 * needs no token (its id is -1); there are n_rows of them, as many as the
 * step gives rows. Greedy draws, and sampled ones that keep at most
 * KCUDA_SAMPLE_MAX_K (1024) candidates, run on the device (kcuda_sample) and
 * the logits never leave it; a sampled draw with top-k off or larger copies
 * its row to the host and runs sampler_pick there. Either way the id is
 * sampler_pick's for that row (see kcuda_sample for the one exception).
 * KVD_EINVAL for a draw out of range (a penalized id twice or outside the
 * vocabulary, u outside [0, 1), a negative top-k, a NaN temperature),
 * KVD_ENOMEM when the penalized ids find no room. *ids points at n_rows
 * ids, valid until the next call.
 */
int gpu_engine_step_sample(gpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                           const struct sampler_draw *const *draws, const int32_t **ids, uint32_t *n_rows,
                           char *err, size_t errlen);

/* Returns once every kernel this engine enqueued has completed, so that its
 * K/V writes are visible to every process mapping the cache. Steps already
 * wait for their results, so after a step this returns at once; it exists for
 * callers whose contract has a separate fence. 0 or KVD_EINTERNAL. */
int gpu_engine_fence(gpu_engine_t *e, char *err, size_t errlen);

/* Copies KV block `block` (block_bytes bytes) between the device cache and
 * host memory. 0, KVD_ERANGE (no such block) or KVD_EINTERNAL. */
int gpu_engine_kv_read(gpu_engine_t *e, uint32_t block, void *dst, char *err, size_t errlen);
int gpu_engine_kv_write(gpu_engine_t *e, uint32_t block, const void *src, char *err, size_t errlen);

/*
 * Context windowing on the device, as the CPU engine's cache does it on the
 * host. gpu_engine_kv_copy copies whole blocks from[i] -> to[i], i < n, in
 * that order, within the device cache (kvcache_copy_block's twin: the private
 * copies of a Window). gpu_engine_kv_shift moves the keys of blocks[0..n) by
 * delta positions, with engine_kv_shift's contract and arithmetic
 * (kcuda_kv_shift for every layer, each at its own RoPE base: the windowed
 * layers' where a model has them); the blocks must be distinct.
 * Both return once the device is done: 0, KVD_ERANGE (a block outside the
 * cache; nothing is changed), KVD_EUNSUPPORTED (shift: a cache of several
 * parts), KVD_ENOMEM or KVD_EINTERNAL.
 */
int gpu_engine_kv_copy(gpu_engine_t *e, const uint32_t *from, const uint32_t *to, uint32_t n, char *err,
                       size_t errlen);
int gpu_engine_kv_shift(gpu_engine_t *e, const uint32_t *blocks, uint32_t n, int32_t delta, char *err,
                        size_t errlen);

void gpu_engine_kv_info(const gpu_engine_t *e, struct gpu_engine_kv *out);
void gpu_engine_graph_stats(const gpu_engine_t *e, struct gpu_engine_graph_stats *out);

/* Turns graph recording on or off from the next step (on only where the
 * build and device support it); recorded graphs are kept. */
void gpu_engine_set_graphs(gpu_engine_t *e, bool on);

/* Bytes of weights on the device (matrices and norms). */
uint64_t gpu_engine_weight_bytes(const gpu_engine_t *e);

/* Whether the weights are borrowed (params.weights_base) rather than the engine's own. */
bool gpu_engine_weights_borrowed(const gpu_engine_t *e);

const struct model_config *gpu_engine_config(const gpu_engine_t *e);

#endif
