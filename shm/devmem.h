/*
 * devmem.h - device memory that several processes share: CUDA virtual
 * memory management (cuMemCreate) exported as a POSIX file descriptor. The
 * pool's device backend, beside its shared-memory one (pool.h) and the tiers
 * below it (tier.h, disktier.h): the coordinator and the workers reach a GPU
 * pool's memory through here, never through kernels/.
 *
 * A GPU pool's KV data lives in one such allocation. The coordinator creates
 * it and keeps it for its whole life; it sends the descriptor
 * (devmem_fd) to each worker of that GPU over a Unix socket
 * (shm/fdpass.h); a worker imports it and gets its own mapping of the same
 * memory. The memory lives while any process holds a mapping or a handle, so
 * a worker that dies takes nothing with it.
 *
 * The driver API is never linked: its functions are looked up at run time
 * through the runtime's cudaGetDriverEntryPointByVersion, so programs that
 * use this start on machines without a GPU or a driver and fail here with a
 * reason. A build without CUDA (-DKVD_CUDA=OFF) links a stand-in whose every
 * call fails with "built without CUDA" (devmem_none.c).
 *
 * Plain C: no CUDA header is needed to use this one. Device addresses are
 * `void *` as everywhere in kcuda.h. CUDA is not fork-safe: a process that
 * used any of this must exec before its children touch CUDA.
 */
#ifndef KVD_DEVMEM_H
#define KVD_DEVMEM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct devmem devmem_t;

/* What devmem_probe found out about a device. */
struct devmem_dev {
    char name[96];          /* "NVIDIA H200" */
    uint64_t total_bytes;   /* device memory */
    uint64_t free_bytes;    /* free device memory when probed */
    uint64_t granularity;   /* allocation sizes are rounded up to this */
};

/*
 * Checks that device dev can hold a shared pool: a driver and the device are
 * there, it supports virtual memory management and POSIX file descriptor
 * handles, and the driver has every entry point used here. Makes dev the
 * calling thread's current device. 0 and *info (may be NULL), or a negative
 * KVD_E* with a one-line reason in why that starts "no usable CUDA device: "
 * (KVD_EUNAVAILABLE: no driver, no device, no such device; KVD_EUNSUPPORTED:
 * no VMM or descriptor support, a driver too old) or, in a build without
 * CUDA, "built without CUDA" (KVD_EUNSUPPORTED).
 */
int devmem_probe(int dev, struct devmem_dev *info, char *why, size_t whylen);

/*
 * Allocates at least bytes of memory on device dev (rounded up to the
 * allocation granularity), maps it read-write into this process and exports
 * it as a descriptor. The memory is not cleared. NULL with a reason (as
 * devmem_probe's, or the driver's error for an allocation that fails).
 */
devmem_t *devmem_create(int dev, uint64_t bytes, char *err, size_t errlen);

/*
 * Maps the allocation behind fd (exported by devmem_create in another
 * process; bytes is its size as that process reports it) read-write into this
 * process. The memory must live on device dev as this process numbers its
 * devices. fd is borrowed: the caller closes it, the import does not need it
 * afterwards. NULL with a reason for a descriptor that is not a CUDA
 * allocation, one on another device, or a size that does not match.
 */
devmem_t *devmem_import(int dev, int fd, uint64_t bytes, char *err, size_t errlen);

/* Unmaps and releases this process's hold on the memory; the memory itself
 * goes when the last process lets go. Waits for this process's work on the
 * device first. Accepts NULL and sets *m to NULL. */
void devmem_destroy(devmem_t **m);

void *devmem_ptr(const devmem_t *m);      /* device address of the mapping */
uint64_t devmem_bytes(const devmem_t *m); /* bytes mapped (the rounded size) */
int devmem_device(const devmem_t *m);     /* device index */

/* The exported descriptor of a created allocation (close-on-exec), owned by
 * m: send it, do not close it. -1 for an imported one. */
int devmem_fd(const devmem_t *m);

/*
 * Waits until every kernel and copy this process queued on stream (a
 * kcuda_stream_t; NULL: on the whole current device) has completed, so that
 * its writes can be reported to other processes (see "Ordering across
 * processes" in shm/pool.h). 0, or KVD_EINTERNAL with the reason when a
 * queued kernel failed.
 */
int devmem_fence(void *stream, char *err, size_t errlen);

/*
 * Copies bytes from device memory this process mapped (a device address in
 * an allocation) to host memory, or from host to device, and waits for the
 * copy: how the coordinator moves a GPU pool's blocks to and from the tiers
 * below it (host memory from devmem_host_alloc copies fastest). 0, or
 * KVD_EINTERNAL with the reason.
 */
int devmem_read(void *dst_host, const void *src_dev, size_t bytes, char *err, size_t errlen);
int devmem_write(void *dst_dev, const void *src_host, size_t bytes, char *err, size_t errlen);

/* Makes device dev the calling thread's for devmem_read / devmem_write (a
 * thread other than the one that mapped the memory calls it once first).
 * 0, or KVD_EUNAVAILABLE with the reason. */
int devmem_attach(int dev, char *err, size_t errlen);

/* Page-locked host memory (NULL when it cannot be had), and its release
 * (accepts NULL). */
void *devmem_host_alloc(size_t bytes);
void devmem_host_free(void *p);

#ifdef __cplusplus
}
#endif

#endif
