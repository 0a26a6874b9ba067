/*
 * gpu.c - kvd --gpu N: the KV pool's data in the memory of GPU N.
 *
 * kvd checks the device before anything else (a missing GPU fails in
 * milliseconds, not after the model has loaded), creates the pool with its
 * KV data "on device N" (the metadata stays in shared memory), allocates that
 * data with the VMM API (shm/devmem.h) and keeps the allocation
 * until it exits, so that no worker's death can free it. Workers connect to
 * a Unix socket in kvd's private runtime directory and each gets the
 * allocation's descriptor with a header naming the device, size and pool
 * (shm/fdpass.h); a restarted worker connects again and gets it again. Only
 * processes of this user may connect (the directory is 0700, and the peer's
 * uid is checked).
 *
 * The model's weights go up once per GPU, the same way: kvd uploads them into
 * a second VMM allocation (engine/gpu_engine.h's gpu_weights_upload) and
 * sends its descriptor after the KV memory's; every worker maps it and its
 * engine borrows it, so N workers hold one copy, not N.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "err.h"
#include "fdpass.h"
#ifdef KVD_HAVE_GPU_ENGINE
#include "gpu_engine.h"
#endif
#include "devmem.h"
#include "kvd.h"
#include "gpu.h"
#include "units.h"

void gpu_probe(struct kvd *k)
{
    k->gpu_fd = -1;
    if (k->o.gpu < 0)
        return;
    char why[512];
    struct devmem_dev info;
    if (devmem_probe(k->o.gpu, &info, why, sizeof(why)) != 0)
        cli_die("--gpu %d: %s", k->o.gpu, why);
    snprintf(k->gpu_name, sizeof(k->gpu_name), "%s", info.name);
    k->gpu_free = info.free_bytes;
}

uint64_t gpu_default_kv_bytes(const struct kvd *k)
{
    /* 1 GiB, or half of what is free when that is less: the weights (one
     * copy, kvd's) and every worker's context and scratch need room on the
     * same device */
    uint64_t want = 1ull << 30;
    if (k->gpu_free / 2 < want)
        want = k->gpu_free / 2;
    return want;
}

/* Gives back the pool (removing its name) and the device memory, then dies
 * with "kvd: --gpu N: message". */
static void __attribute__((noreturn, format(printf, 2, 3))) setup_fail(struct kvd *k,
                                                                       const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    prefix_destroy(&k->px);
    pool_close(&k->pool);
    devmem_destroy(&k->vmm);
    devmem_destroy(&k->wvmm);
    cli_die("--gpu %d: %s", k->o.gpu, msg);
}

void gpu_setup(struct kvd *k, const char *run_dir)
{
    if (k->o.gpu < 0)
        return;
    char err[512];
    uint64_t bytes = pool_data_bytes(k->pool);
    k->vmm = devmem_create(k->o.gpu, bytes, err, sizeof(err));
    if (k->vmm == NULL)
        setup_fail(k, "%s", err);
    if (pool_set_device_kv(k->pool, devmem_ptr(k->vmm), devmem_bytes(k->vmm)) != 0)
        setup_fail(k, "the device memory does not fit the pool");
#ifdef KVD_HAVE_GPU_ENGINE
    const uint64_t wbytes = gpu_weights_bytes(k->model);
    k->wvmm = devmem_create(k->o.gpu, wbytes, err, sizeof(err));
    if (k->wvmm == NULL)
        setup_fail(k, "weights: %s", err);
    if (gpu_weights_upload(k->model, k->o.gpu, devmem_ptr(k->wvmm), devmem_bytes(k->wvmm), err,
                           sizeof(err)) != 0)
        setup_fail(k, "%s", err);
#else
    setup_fail(k, "this kvd was built without the GPU engine");
#endif
    int n = snprintf(k->gpu_sock, sizeof(k->gpu_sock), "%s/gpu%d-%d.sock", run_dir, k->o.gpu,
                     (int)getpid());
    if (n < 0 || (size_t)n >= sizeof(k->gpu_sock))
        setup_fail(k, "the runtime directory %s is too long a path for a Unix socket (set "
                   "XDG_RUNTIME_DIR or KVD_ENDPOINT to a shorter one)", run_dir);
    k->gpu_fd = fdpass_listen(k->gpu_sock, err, sizeof(err));
    if (k->gpu_fd < 0)
        setup_fail(k, "%s", err);
    char sz[32];
    char wsz[32];
    kvd_log(k, "GPU %d (%s): %s of KV data and %s of weights (one copy for all its workers) in device "
            "memory; workers get them from %s", k->o.gpu, k->gpu_name[0] ? k->gpu_name : "?",
            kvd_format_bytes(devmem_bytes(k->vmm), sz, sizeof(sz)),
            kvd_format_bytes(devmem_bytes(k->wvmm), wsz, sizeof(wsz)), k->gpu_sock);
}

/* Hands the device memory, KV then weights, to every worker waiting on the socket. */
void gpu_serve(struct kvd *k)
{
    if (k->gpu_fd < 0)
        return;
    const struct pool_header *h = pool_header(k->pool);
    struct fdpass_msg m = {
        .magic = FDPASS_MAGIC, .version = FDPASS_VERSION, .kind = FDPASS_KIND_CUDA_VMM,
        .bytes = devmem_bytes(k->vmm), .device = k->o.gpu, .generation = h->generation,
        .instance = h->instance,
    };
    struct fdpass_msg wm = m;
    wm.kind = FDPASS_KIND_CUDA_WEIGHTS;
    wm.bytes = devmem_bytes(k->wvmm);
    char err[256];
    for (;;) {
        int c = fdpass_accept(k->gpu_fd, err, sizeof(err));
        if (c == KVD_ETIMEOUT)
            return;
        if (c < 0) {
            kvd_log(k, "GPU socket: %s", err);
            if (c != KVD_EPROTOCOL)
                return; /* a failing socket is retried at the next poll */
            continue;
        }
        if (fdpass_send(c, &m, devmem_fd(k->vmm), err, sizeof(err)) != 0 ||
            fdpass_send(c, &wm, devmem_fd(k->wvmm), err, sizeof(err)) != 0)
            kvd_log(k, "GPU socket: %s", err);
        else if (k->o.verbose)
            kvd_log(k, "GPU socket: handed the device memory to a worker");
        close(c);
    }
}

void gpu_fini(struct kvd *k)
{
    if (k->gpu_fd >= 0) {
        close(k->gpu_fd);
        unlink(k->gpu_sock);
        k->gpu_fd = -1;
    }
    /* every worker is stopped by now: nothing else uses the memory */
    devmem_destroy(&k->vmm);
    devmem_destroy(&k->wvmm);
}
