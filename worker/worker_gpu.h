/*
 * worker_gpu.h - kvd-worker's GPU side (--gpu N): the pool's KV data in device
 * memory, received from kvd, and the seam where the GPU engine plugs in.
 *
 * Start-up: the worker attaches the pool's metadata by name as any worker
 * does (shm/pool.h), then wgpu_open() connects to kvd's descriptor socket,
 * receives the device allocations (shm/fdpass.h): the KV data, then the
 * model's weights, checks that they belong to this pool (device,
 * generation, instance; the KV memory's size here, the weights' size by the
 * engine), imports and maps them
 * (shm/devmem.h) and tells the pool where the KV data is mapped,
 * so that pool_block_addr() gives device addresses. The engine borrows the
 * weights: one copy per GPU, whatever the number of workers. kvd keeps both
 * allocations for its whole life; a worker that dies or restarts only drops
 * its own mappings.
 *
 * The engine: wgpu_engine_start() and wgpu_step_sample() have the contract
 * of engine_new() and engine_step() (engine/forward.h) over the device pool,
 * the step choosing tokens on the device rather than returning logits.
 * They reach the GPU engine through the seam at the end of this header:
 * worker_gpu_engine.c where the CUDA backend is built, else
 * worker_gpu_engine_none.c, whose calls fail with "GPU engine not built" (the
 * worker then exits with CLI_EXIT_UNUSABLE, which kvd reports and does not
 * restart; a kvd of such a build refuses --gpu before starting any).
 *
 * Ordering: after every step, and before the worker sends anything that says
 * a block is written (Commit, TokenChunk, Done), it calls wgpu_fence(), which
 * returns once the step's kernels have completed ("Ordering across processes"
 * in shm/pool.h).
 */
#ifndef KVD_WORKER_GPU_H
#define KVD_WORKER_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "forward.h"
#include "model.h"
#include "pool.h"
#include "sampler.h"

typedef struct wgpu wgpu_t;

/* How long a worker waits for kvd's descriptor socket and its message. */
#define WGPU_CONNECT_MS 10000

/*
 * Receives pool's device memory for device dev from kvd's socket at
 * socket_path and maps it (pool is borrowed and must outlive the result; it
 * must be a device pool on dev). NULL with a one-line reason: no usable
 * device, built without CUDA, kvd unreachable, a message that is malformed
 * or meant for another pool or device, an import that fails.
 */
wgpu_t *wgpu_open(pool_t *pool, int dev, const char *socket_path, char *err, size_t errlen);

/* Stops the engine and unmaps this process's view of the memory (kvd still
 * holds it). Accepts NULL and sets *g to NULL. */
void wgpu_close(wgpu_t **g);

/* The device address of the KV data (what the GPU engine takes as its base)
 * and the bytes mapped there. */
void *wgpu_kv_base(const wgpu_t *g);
uint64_t wgpu_kv_bytes(const wgpu_t *g);

/*
 * Creates the GPU engine for model m over the device pool (as engine_new;
 * m must outlive g). 0, or a negative KVD_E* with a reason: KVD_EUNSUPPORTED
 * "GPU engine not built" while this program has none.
 */
int wgpu_engine_start(wgpu_t *g, const model_t *m, const struct engine_params *p, char *err,
                      size_t errlen);

/* One step, choosing each sequence's token on the device: as
 * gpu_engine_step_sample (engine/gpu_engine.h), draws[i] for row i (NULL:
 * no token wanted, id -1). *ids is valid until the next step. The step's
 * kernels may still be running when it returns. */
int wgpu_step_sample(wgpu_t *g, const struct fwd_seq *seqs, uint32_t n_seqs,
                     const struct sampler_draw *const *draws, const int32_t **ids, uint32_t *n_rows, char *err,
                     size_t errlen);

/* The same, returning every row's logits in host memory instead (as
 * gpu_engine_step): for steps where a sequence wants its logprobs, which the
 * worker computes on the host, choosing the tokens there too. */
int wgpu_step_logits(wgpu_t *g, const struct fwd_seq *seqs, uint32_t n_seqs, const float **logits,
                     uint32_t *n_rows, char *err, size_t errlen);

/* Returns once every kernel of the steps so far has completed: their K/V
 * writes are in device memory for every process. 0 or KVD_EINTERNAL. */
int wgpu_fence(wgpu_t *g, char *err, size_t errlen);

/* Context windowing on the device pool (kvd's Window): wgpu_kv_copy copies
 * whole blocks from[i] -> to[i], i < n, in order; wgpu_kv_shift moves the
 * keys of blocks[0..n) by delta positions (engine_kv_shift's contract), as
 * gpu_engine_kv_copy / gpu_engine_kv_shift. Both return once the device is
 * done (the blocks are then written for every process). 0 or a negative
 * KVD_E* with a reason; KVD_ESTATE before the engine is started. */
int wgpu_kv_copy(wgpu_t *g, const uint32_t *from, const uint32_t *to, uint32_t n, char *err, size_t errlen);
int wgpu_kv_shift(wgpu_t *g, const uint32_t *blocks, uint32_t n, int32_t delta, char *err, size_t errlen);

/* ---- SEAM: the GPU engine ----------------------------------------------------------------
 *
 * What kvd-worker needs of a GPU engine, and the one place it is called. A
 * build links exactly one implementation: worker_gpu_engine.c over
 * engine/gpu_engine.h where the CUDA backend is built, else
 * worker_gpu_engine_none.c ("GPU engine not built"); worker/CMakeLists.txt
 * chooses.
 */
typedef struct wgpu_engine wgpu_engine_t;

/* The device memory an engine computes in, all of it borrowed (kvd owns it;
 * it outlives the engine). */
struct wgpu_mem {
    void *kv_base;          /* the pool's KV data, laid out as kernels/cuda/kcuda.h says */
    uint64_t kv_bytes;      /* bytes mapped there */
    uint32_t kv_blocks;     /* blocks */
    uint32_t block_tokens;  /* positions per block */
    uint32_t k_type, v_type;/* the pool's KV types (KERN_F16, KERN_Q8_0, KERN_Q4_0) */
    uint32_t rotate;        /* KV_ROT_K | KV_ROT_V */
    void *weights_base;     /* the model's weights as gpu_weights_upload lays them out */
    uint64_t weights_bytes; /* bytes mapped there */
    const struct kv_parts *parts; /* the pool's parts (its header's layout) */
};

/* An engine for model m (borrowed for the call) on device dev over mem; p as
 * for engine_new. NULL with a reason. */
wgpu_engine_t *wgpu_engine_new(const model_t *m, int dev, const struct wgpu_mem *mem,
                               const struct engine_params *p, char *err, size_t errlen);

/* One step, as gpu_engine_step_sample. */
int wgpu_engine_step_sample(wgpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs,
                            const struct sampler_draw *const *draws, const int32_t **ids, uint32_t *n_rows,
                            char *err, size_t errlen);

/* One step, as gpu_engine_step (logits on the host). */
int wgpu_engine_step_logits(wgpu_engine_t *e, const struct fwd_seq *seqs, uint32_t n_seqs, const float **logits,
                            uint32_t *n_rows, char *err, size_t errlen);

/* Block copies and the keys' turn of a Window, as gpu_engine_kv_copy and
 * gpu_engine_kv_shift. */
int wgpu_engine_kv_copy(wgpu_engine_t *e, const uint32_t *from, const uint32_t *to, uint32_t n, char *err,
                        size_t errlen);
int wgpu_engine_kv_shift(wgpu_engine_t *e, const uint32_t *blocks, uint32_t n, int32_t delta, char *err,
                         size_t errlen);

/* Frees the engine (never the borrowed memory); accepts NULL, sets *e to NULL. */
void wgpu_engine_destroy(wgpu_engine_t **e);

#endif
