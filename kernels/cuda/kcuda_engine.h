/*
 * kcuda_engine.h - what a whole forward step on the GPU needs beyond the
 * kernels of kcuda.h: its own stream, page-locked host memory, copies that
 * run in stream order, and CUDA graphs (a step recorded once and replayed).
 *
 * Callable from C; no CUDA headers. Results are the KVD_E* codes of err.h,
 * with the CUDA message in kcuda_last_error().
 */
#ifndef KVD_KCUDA_ENGINE_H
#define KVD_KCUDA_ENGINE_H

#include <stdbool.h>
#include <stddef.h>

#include "kcuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Makes dev the calling thread's device (cheap; no checks beyond CUDA's).
 * 0 or KVD_EINTERNAL. */
int kcuda_set_device(int dev);

/* A stream that does not synchronize with the legacy default stream (graph
 * capture needs one). 0, or KVD_EINTERNAL with *s left NULL. */
int kcuda_stream_new(kcuda_stream_t *s);

/* Waits for the stream's work and destroys it; accepts NULL and sets *s to NULL. */
void kcuda_stream_destroy(kcuda_stream_t *s);

/* Waits for everything enqueued on s. 0, or KVD_EINTERNAL when a kernel
 * failed (the message names the first failure). */
int kcuda_stream_sync(kcuda_stream_t s);

/* Page-locked host memory (fast, truly asynchronous copies); NULL when out of
 * memory. kcuda_host_free accepts NULL. */
void *kcuda_host_alloc(size_t bytes);
void kcuda_host_free(void *p);

/* Copies enqueued on a stream; the host side must stay valid (and, for
 * uploads, unchanged) until the stream reaches them. 0 or KVD_EINTERNAL. */
int kcuda_upload_async(void *dst_dev, const void *src_host, size_t bytes, kcuda_stream_t s);
int kcuda_download_async(void *dst_host, const void *src_dev, size_t bytes, kcuda_stream_t s);

/* ---- graphs ---------------------------------------------------------------- */

typedef struct kcuda_graph kcuda_graph_t;   /* an instantiated, replayable graph */

/* Whether this build and device can capture graphs (false in emulation). */
bool kcuda_graphs_supported(void);

/* Starts recording what is enqueued on s (which must come from
 * kcuda_stream_new) instead of running it; thread-local capture mode, so other
 * threads are unaffected. Nothing enqueued on s runs until the graph is
 * launched. 0, KVD_EUNSUPPORTED or KVD_EINTERNAL. */
int kcuda_capture_begin(kcuda_stream_t s);

/* Ends the recording of s and instantiates it into *g. Always ends the
 * capture, so s is usable again whatever the result; with keep false (a
 * launch failed while recording) the recording is discarded and *g is NULL.
 * 0, or KVD_EINTERNAL with *g NULL. */
int kcuda_capture_end(kcuda_stream_t s, bool keep, kcuda_graph_t **g);

/* Enqueues one replay of g on s. 0 or KVD_EINTERNAL. */
int kcuda_graph_launch(kcuda_graph_t *g, kcuda_stream_t s);

/* Frees g; accepts NULL and sets *g to NULL. */
void kcuda_graph_destroy(kcuda_graph_t **g);

#ifdef __cplusplus
}
#endif

#endif
