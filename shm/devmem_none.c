/*
 * devmem_none.c - devmem.h in a build without CUDA (-DKVD_CUDA=OFF, or
 * no toolkit found): every call fails with the same reason, so that --gpu
 * says what is missing instead of what went wrong.
 */
#include "err.h"
#include "devmem.h"

#define NOT_BUILT "built without CUDA (configure with -DKVD_CUDA=ON where the CUDA toolkit is installed)"

int devmem_probe(int dev, struct devmem_dev *info, char *why, size_t whylen)
{
    (void)dev;
    (void)info;
    return kvd_seterr(why, whylen, KVD_EUNSUPPORTED, NOT_BUILT);
}

devmem_t *devmem_create(int dev, uint64_t bytes, char *err, size_t errlen)
{
    (void)dev;
    (void)bytes;
    kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
    return NULL;
}

devmem_t *devmem_import(int dev, int fd, uint64_t bytes, char *err, size_t errlen)
{
    (void)dev;
    (void)fd;
    (void)bytes;
    kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
    return NULL;
}

void devmem_destroy(devmem_t **m)
{
    if (m != NULL)
        *m = NULL; /* nothing can have been made */
}

void *devmem_ptr(const devmem_t *m) { (void)m; return NULL; }
uint64_t devmem_bytes(const devmem_t *m) { (void)m; return 0; }
int devmem_device(const devmem_t *m) { (void)m; return -1; }
int devmem_fd(const devmem_t *m) { (void)m; return -1; }

int devmem_read(void *dst_host, const void *src_dev, size_t bytes, char *err, size_t errlen)
{
    (void)dst_host;
    (void)src_dev;
    (void)bytes;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
}

int devmem_write(void *dst_dev, const void *src_host, size_t bytes, char *err, size_t errlen)
{
    (void)dst_dev;
    (void)src_host;
    (void)bytes;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
}

int devmem_attach(int dev, char *err, size_t errlen)
{
    (void)dev;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
}

void *devmem_host_alloc(size_t bytes)
{
    (void)bytes;
    return NULL;
}

void devmem_host_free(void *p) { (void)p; }

int devmem_fence(void *stream, char *err, size_t errlen)
{
    (void)stream;
    return kvd_seterr(err, errlen, KVD_EUNSUPPORTED, NOT_BUILT);
}
