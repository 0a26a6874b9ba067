/*
 * gguf.c - a checked GGUF reader.
 *
 * The parser walks the file with a bounded cursor: every read first checks
 * that the bytes exist, every count is checked against the bytes that could
 * possibly hold it (so a forged count cannot make us allocate gigabytes), and
 * every tensor's extent is checked to lie inside the data section.
 */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "types.h"

struct gguf_ctx {
    const uint8_t *base;        /* file bytes */
    size_t size;                /* file size */
    bool mapped;                /* base came from mmap and must be unmapped */
    uint32_t version;           /* 2 or 3 */
    uint32_t alignment;         /* data section alignment */
    uint64_t n_kv;
    struct gguf_kv *kv;         /* n_kv entries */
    uint64_t n_tensors;
    struct gguf_tensor *tensors;/* n_tensors entries */
    uint64_t data_offset;       /* start of the data section in the file */
};

struct cursor {
    const uint8_t *p;           /* next byte */
    const uint8_t *end;         /* one past the last byte */
    char *err;
    size_t errlen;
};

static size_t cur_left(const struct cursor *c) { return (size_t)(c->end - c->p); }

static int cur_take(struct cursor *c, void *dst, size_t n, const char *what)
{
    if (cur_left(c) < n)
        return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                          "gguf: file truncated while reading %s", what);
    memcpy(dst, c->p, n);
    c->p += n;
    return 0;
}

static int cur_u32(struct cursor *c, uint32_t *v, const char *what) { return cur_take(c, v, 4, what); }
static int cur_u64(struct cursor *c, uint64_t *v, const char *what) { return cur_take(c, v, 8, what); }

static int cur_str(struct cursor *c, struct gguf_str *s, const char *what)
{
    uint64_t len = 0;
    int rc = cur_u64(c, &len, what);
    if (rc)
        return rc;
    if (len > cur_left(c))
        return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                          "gguf: %s has length %llu past the end of the file",
                          what, (unsigned long long)len);
    s->ptr = (const char *)c->p;
    s->len = len;
    c->p += len;
    return 0;
}

size_t gguf_vtype_size(uint32_t t)
{
    switch (t) {
    case GGUF_VT_UINT8: case GGUF_VT_INT8: case GGUF_VT_BOOL: return 1;
    case GGUF_VT_UINT16: case GGUF_VT_INT16: return 2;
    case GGUF_VT_UINT32: case GGUF_VT_INT32: case GGUF_VT_FLOAT32: return 4;
    case GGUF_VT_UINT64: case GGUF_VT_INT64: case GGUF_VT_FLOAT64: return 8;
    default: return 0;
    }
}

static int parse_kv(struct cursor *c, struct gguf_kv *kv, uint64_t idx)
{
    int rc = cur_str(c, &kv->key, "a metadata key");
    if (rc)
        return rc;
    if (kv->key.len == 0 || kv->key.len > 65535)
        return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                          "gguf: metadata key %llu has invalid length %llu",
                          (unsigned long long)idx, (unsigned long long)kv->key.len);
    if ((rc = cur_u32(c, &kv->type, "a metadata type")))
        return rc;
    int klen = (int)kv->key.len;
    if (kv->type >= GGUF_VT_COUNT)
        return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                          "gguf: key '%.*s' has unknown value type %u", klen, kv->key.ptr, kv->type);
    if (kv->type == GGUF_VT_STRING) {
        struct gguf_str s;
        kv->data = c->p;
        return cur_str(c, &s, "a string value");
    }
    if (kv->type != GGUF_VT_ARRAY) {
        kv->data = c->p;
        size_t sz = gguf_vtype_size(kv->type);
        if (cur_left(c) < sz)
            return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                              "gguf: file truncated in the value of '%.*s'", klen, kv->key.ptr);
        c->p += sz;
        return 0;
    }
    if ((rc = cur_u32(c, &kv->arr_type, "an array type")) || (rc = cur_u64(c, &kv->arr_len, "an array length")))
        return rc;
    if (kv->arr_type == GGUF_VT_ARRAY || kv->arr_type >= GGUF_VT_COUNT)
        return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                          "gguf: array '%.*s' has invalid element type %u", klen, kv->key.ptr, kv->arr_type);
    kv->data = c->p;
    if (kv->arr_type != GGUF_VT_STRING) {
        size_t sz = gguf_vtype_size(kv->arr_type);
        if (kv->arr_len > cur_left(c) / sz)
            return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                              "gguf: array '%.*s' of %llu elements runs past the end of the file",
                              klen, kv->key.ptr, (unsigned long long)kv->arr_len);
        c->p += kv->arr_len * sz;
        return 0;
    }
    /* every string takes at least its 8-byte length */
    if (kv->arr_len > cur_left(c) / 8)
        return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                          "gguf: string array '%.*s' of %llu elements runs past the end of the file",
                          klen, kv->key.ptr, (unsigned long long)kv->arr_len);
    kv->strs = calloc(kv->arr_len ? kv->arr_len : 1, sizeof(*kv->strs));
    if (kv->strs == NULL)
        return kvd_seterr(c->err, c->errlen, KVD_ENOMEM, "gguf: out of memory");
    for (uint64_t i = 0; i < kv->arr_len; i++)
        if ((rc = cur_str(c, &kv->strs[i], "a string array element")))
            return rc;
    return 0;
}

static int parse_tensor_info(struct cursor *c, struct gguf_tensor *t, uint64_t idx)
{
    int rc = cur_str(c, &t->name, "a tensor name");
    if (rc)
        return rc;
    if (t->name.len == 0 || t->name.len > 255)
        return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                          "gguf: tensor %llu has invalid name length %llu",
                          (unsigned long long)idx, (unsigned long long)t->name.len);
    int nlen = (int)t->name.len;
    if ((rc = cur_u32(c, &t->n_dims, "tensor dimensions")))
        return rc;
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                          "gguf: tensor '%.*s' has %u dimensions (1..%d allowed)",
                          nlen, t->name.ptr, t->n_dims, GGUF_MAX_DIMS);
    uint64_t nelem = 1;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
        uint64_t ne = 1;
        if (d < t->n_dims && (rc = cur_u64(c, &ne, "a tensor dimension")))
            return rc;
        if (ne == 0 || ne > (1ull << 40) || nelem > (1ull << 62) / ne)
            return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                              "gguf: tensor '%.*s' has an invalid dimension %llu",
                              nlen, t->name.ptr, (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
        nelem *= ne;
    }
    if ((rc = cur_u32(c, &t->type, "a tensor type")) || (rc = cur_u64(c, &t->offset, "a tensor offset")))
        return rc;
    const struct kern_type_info *ti = kern_type_info(t->type);
    if (ti == NULL)
        return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                          "gguf: tensor '%.*s' has unknown type id %u", nlen, t->name.ptr, t->type);
    if (t->ne[0] % ti->block_elems != 0)
        return kvd_seterr(c->err, c->errlen, KVD_EFORMAT,
                          "gguf: tensor '%.*s' row of %lld is not a multiple of the %s block (%u)",
                          nlen, t->name.ptr, (long long)t->ne[0], ti->name, ti->block_elems);
    t->nbytes = nelem / ti->block_elems * ti->block_bytes;
    return 0;
}

static void ctx_free(struct gguf_ctx *g)
{
    if (g->kv != NULL)
        for (uint64_t i = 0; i < g->n_kv; i++)
            free(g->kv[i].strs);
    free(g->kv);
    free(g->tensors);
    if (g->mapped && g->base != NULL)
        munmap((void *)g->base, g->size);
    free(g);
}

static int parse(struct gguf_ctx *g, char *err, size_t errlen)
{
    struct cursor c = { g->base, g->base + g->size, err, errlen };
    uint32_t magic = 0;
    int rc;
    if ((rc = cur_u32(&c, &magic, "the header")))
        return rc;
    if (magic != GGUF_MAGIC)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "gguf: not a GGUF file (bad magic)");
    if ((rc = cur_u32(&c, &g->version, "the header")))
        return rc;
    if (g->version < 2 || g->version > 3)
        return kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                          "gguf: version %u is not supported (2 and 3 are)", g->version);
    if ((rc = cur_u64(&c, &g->n_tensors, "the header")) || (rc = cur_u64(&c, &g->n_kv, "the header")))
        return rc;
    /* a key/value takes at least 8+1+4+1 bytes, a tensor info 8+1+4+8+4+8 */
    if (g->n_kv > cur_left(&c) / 14 || g->n_tensors > cur_left(&c) / 33)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "gguf: truncated or corrupt: header claims %llu keys and %llu tensors, more than the file holds",
                          (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors);
    g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof(*g->kv));
    g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof(*g->tensors));
    if (g->kv == NULL || g->tensors == NULL)
        return kvd_seterr(err, errlen, KVD_ENOMEM, "gguf: out of memory");
    for (uint64_t i = 0; i < g->n_kv; i++)
        if ((rc = parse_kv(&c, &g->kv[i], i)))
            return rc;

    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    const struct gguf_kv *al = gguf_find(g, "general.alignment");
    if (al != NULL) {
        uint32_t a;
        if (al->type != GGUF_VT_UINT32 || (memcpy(&a, al->data, 4), a == 0) || (a & (a - 1)) != 0)
            return kvd_seterr(err, errlen, KVD_EFORMAT,
                              "gguf: general.alignment must be a power-of-two uint32");
        g->alignment = a;
    }

    for (uint64_t i = 0; i < g->n_tensors; i++)
        if ((rc = parse_tensor_info(&c, &g->tensors[i], i)))
            return rc;

    uint64_t pos = (uint64_t)(c.p - g->base);
    g->data_offset = (pos + g->alignment - 1) / g->alignment * g->alignment;
    if (g->data_offset > g->size && g->n_tensors > 0)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "gguf: file truncated before the tensor data");
    uint64_t data_size = g->size > g->data_offset ? g->size - g->data_offset : 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct gguf_tensor *t = &g->tensors[i];
        int nlen = (int)t->name.len;
        if (t->offset % g->alignment != 0)
            return kvd_seterr(err, errlen, KVD_EFORMAT,
                              "gguf: tensor '%.*s' offset %llu is not aligned to %u",
                              nlen, t->name.ptr, (unsigned long long)t->offset, g->alignment);
        if (t->offset > data_size || t->nbytes > data_size - t->offset)
            return kvd_seterr(err, errlen, KVD_EFORMAT,
                              "gguf: tensor '%.*s' (%llu bytes at %llu) lies past the end of the file",
                              nlen, t->name.ptr, (unsigned long long)t->nbytes,
                              (unsigned long long)t->offset);
        t->data = g->base + g->data_offset + t->offset;
        for (uint64_t j = 0; j < i; j++)
            if (g->tensors[j].name.len == t->name.len &&
                memcmp(g->tensors[j].name.ptr, t->name.ptr, t->name.len) == 0)
                return kvd_seterr(err, errlen, KVD_EFORMAT,
                                  "gguf: tensor '%.*s' appears twice", nlen, t->name.ptr);
    }
    return 0;
}

gguf_ctx_t *gguf_open_buffer(const void *buf, size_t len, char *err, size_t errlen)
{
    struct gguf_ctx *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "gguf: out of memory");
        return NULL;
    }
    g->base = buf;
    g->size = len;
    if (parse(g, err, errlen) != 0) {
        ctx_free(g);
        return NULL;
    }
    return g;
}

gguf_ctx_t *gguf_open(const char *path, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        kvd_seterr(err, errlen, KVD_EIO, "gguf: cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        kvd_seterr(err, errlen, KVD_EIO, "gguf: %s is not a regular file", path);
        close(fd);
        return NULL;
    }
    if (st.st_size < 24) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "gguf: %s is too short to be a GGUF file (%lld bytes)",
                   path, (long long)st.st_size);
        close(fd);
        return NULL;
    }
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        kvd_seterr(err, errlen, KVD_EIO, "gguf: cannot map %s: %s", path, strerror(errno));
        return NULL;
    }
    struct gguf_ctx *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        munmap(m, (size_t)st.st_size);
        kvd_seterr(err, errlen, KVD_ENOMEM, "gguf: out of memory");
        return NULL;
    }
    g->base = m;
    g->size = (size_t)st.st_size;
    g->mapped = true;
    char inner[384];
    if (parse(g, inner, sizeof(inner)) != 0) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "%s: %s", path, inner);
        ctx_free(g);
        return NULL;
    }
    return g;
}

void gguf_close(gguf_ctx_t **gp)
{
    if (gp == NULL || *gp == NULL)
        return;
    ctx_free(*gp);
    *gp = NULL;
}

uint32_t gguf_version(const gguf_ctx_t *g) { return g->version; }
uint32_t gguf_alignment(const gguf_ctx_t *g) { return g->alignment; }
const void *gguf_base(const gguf_ctx_t *g) { return g->base; }
size_t gguf_size(const gguf_ctx_t *g) { return g->size; }
uint64_t gguf_n_kv(const gguf_ctx_t *g) { return g->n_kv; }
bool gguf_is_mapped(const gguf_ctx_t *g) { return g->mapped; }

uint64_t gguf_n_tensors(const gguf_ctx_t *g) { return g->n_tensors; }

const struct gguf_kv *gguf_kv_at(const gguf_ctx_t *g, uint64_t i)
{
    return i < g->n_kv ? &g->kv[i] : NULL;
}

const struct gguf_tensor *gguf_tensor_at(const gguf_ctx_t *g, uint64_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

bool gguf_str_eq(struct gguf_str s, const char *c)
{
    size_t n = strlen(c);
    return s.len == n && memcmp(s.ptr, c, n) == 0;
}

const struct gguf_kv *gguf_find(const gguf_ctx_t *g, const char *key)
{
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (gguf_str_eq(g->kv[i].key, key))
            return &g->kv[i];
    return NULL;
}

const struct gguf_tensor *gguf_find_tensor(const gguf_ctx_t *g, const char *name)
{
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (gguf_str_eq(g->tensors[i].name, name))
            return &g->tensors[i];
    return NULL;
}

/* Reads a scalar integer of any width as int64; false for non-integers. */
static bool scalar_int(uint32_t type, const uint8_t *p, int64_t *out)
{
    switch (type) {
    case GGUF_VT_UINT8: *out = *p; return true;
    case GGUF_VT_INT8: *out = (int8_t)*p; return true;
    case GGUF_VT_BOOL: *out = *p != 0; return true;
    case GGUF_VT_UINT16: { uint16_t v; memcpy(&v, p, 2); *out = v; return true; }
    case GGUF_VT_INT16: { int16_t v; memcpy(&v, p, 2); *out = v; return true; }
    case GGUF_VT_UINT32: { uint32_t v; memcpy(&v, p, 4); *out = v; return true; }
    case GGUF_VT_INT32: { int32_t v; memcpy(&v, p, 4); *out = v; return true; }
    case GGUF_VT_UINT64: { uint64_t v; memcpy(&v, p, 8); *out = v > INT64_MAX ? -1 : (int64_t)v; return true; }
    case GGUF_VT_INT64: { int64_t v; memcpy(&v, p, 8); *out = v; return true; }
    default: return false;
    }
}

int gguf_get_u32(const gguf_ctx_t *g, const char *key, uint32_t *out)
{
    const struct gguf_kv *kv = gguf_find(g, key);
    int64_t v;
    if (kv == NULL)
        return KVD_ENOTFOUND;
    if (!scalar_int(kv->type, kv->data, &v) || v < 0 || v > UINT32_MAX)
        return KVD_EFORMAT;
    *out = (uint32_t)v;
    return 0;
}

int gguf_get_f32(const gguf_ctx_t *g, const char *key, float *out)
{
    const struct gguf_kv *kv = gguf_find(g, key);
    if (kv == NULL)
        return KVD_ENOTFOUND;
    if (kv->type == GGUF_VT_FLOAT32) {
        memcpy(out, kv->data, 4);
    } else if (kv->type == GGUF_VT_FLOAT64) {
        double d;
        memcpy(&d, kv->data, 8);
        *out = (float)d;
    } else {
        return KVD_EFORMAT;
    }
    return 0;
}

int gguf_get_bool(const gguf_ctx_t *g, const char *key, bool *out)
{
    const struct gguf_kv *kv = gguf_find(g, key);
    if (kv == NULL)
        return KVD_ENOTFOUND;
    if (kv->type != GGUF_VT_BOOL)
        return KVD_EFORMAT;
    *out = kv->data[0] != 0;
    return 0;
}

int gguf_get_str(const gguf_ctx_t *g, const char *key, struct gguf_str *out)
{
    const struct gguf_kv *kv = gguf_find(g, key);
    if (kv == NULL)
        return KVD_ENOTFOUND;
    if (kv->type != GGUF_VT_STRING)
        return KVD_EFORMAT;
    uint64_t len = 0;
    memcpy(&len, kv->data, 8);
    out->ptr = (const char *)kv->data + 8;
    out->len = len;
    return 0;
}

int gguf_get_arr(const gguf_ctx_t *g, const char *key, uint32_t *type, uint64_t *n,
                 const struct gguf_kv **kvp)
{
    const struct gguf_kv *kv = gguf_find(g, key);
    if (kv == NULL)
        return KVD_ENOTFOUND;
    if (kv->type != GGUF_VT_ARRAY)
        return KVD_EFORMAT;
    *type = kv->arr_type;
    *n = kv->arr_len;
    if (kvp != NULL)
        *kvp = kv;
    return 0;
}

int64_t gguf_arr_int(const struct gguf_kv *kv, uint64_t i)
{
    int64_t v = 0;
    size_t sz = gguf_vtype_size(kv->arr_type);
    if (kv->type != GGUF_VT_ARRAY || i >= kv->arr_len || sz == 0 ||
        !scalar_int(kv->arr_type, kv->data + i * sz, &v))
        return 0;
    return v;
}
