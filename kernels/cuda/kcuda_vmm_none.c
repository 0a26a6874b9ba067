/*
 * kcuda_vmm_none.c - kcuda_vmm.h in a build without CUDA (-DKVD_CUDA=OFF, or
 * no toolkit found): every call fails with the same reason, so that --gpu
 * says what is missing instead of what went wrong.
 */
#include "err.h"
#include "kcuda_vmm.h"

#define NOT_BUILT "built without CUDA (configure with -DKVD_CUDA=ON where the CUDA toolkit is installed)"

int kcuda_vmm_probe(int dev, struct kcuda_vmm_dev *info, char *why, size_t whylen)
{
    (void)dev;
    (void)info;
    return kvd_seterr(why, whylen, KVD_EUNSUPPORTED, NOT_BUILT);
}

kcuda_vmm_t *kcuda_vmm_create(int dev, uint64_t bytes, char *err, size_t errlen)
{
    (void)dev;
    (void)bytes;
    kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
    return NULL;
}

kcuda_vmm_t *kcuda_vmm_import(int dev, int fd, uint64_t bytes, char *err, size_t errlen)
{
    (void)dev;
    (void)fd;
    (void)bytes;
    kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
    return NULL;
}

void kcuda_vmm_destroy(kcuda_vmm_t **m)
{
    if (m != NULL)
        *m = NULL; /* nothing can have been made */
}

void *kcuda_vmm_ptr(const kcuda_vmm_t *m) { (void)m; return NULL; }
uint64_t kcuda_vmm_bytes(const kcuda_vmm_t *m) { (void)m; return 0; }
int kcuda_vmm_device(const kcuda_vmm_t *m) { (void)m; return -1; }
int kcuda_vmm_fd(const kcuda_vmm_t *m) { (void)m; return -1; }

int kcuda_vmm_read(void *dst_host, const void *src_dev, size_t bytes, char *err, size_t errlen)
{
    (void)dst_host;
    (void)src_dev;
    (void)bytes;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
}

int kcuda_vmm_write(void *dst_dev, const void *src_host, size_t bytes, char *err, size_t errlen)
{
    (void)dst_dev;
    (void)src_host;
    (void)bytes;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
}

void *kcuda_vmm_host_alloc(size_t bytes)
{
    (void)bytes;
    return NULL;
}

void kcuda_vmm_host_free(void *p) { (void)p; }

int kcuda_vmm_fence(kcuda_stream_t stream, char *err, size_t errlen)
{
    (void)stream;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
}
