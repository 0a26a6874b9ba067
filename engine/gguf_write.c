/*
 * gguf_write.c - the GGUF v3 writer (see gguf_write.h).
 *
 * Each key/value is serialized into its own byte string when it is set, so
 * that writing is a walk over finished pieces; tensors keep their data until
 * write time, when their offsets are laid out. One sink abstraction counts,
 * fills a buffer or writes a FILE, so the three outputs cannot disagree.
 */
#include "gguf_write.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "err.h"
#include "types.h"

#define GGUF_WRITE_VERSION 3u

struct wkv {
    char *key;                  /* NUL-terminated copy */
    uint8_t *val;               /* serialized value: type u32 + payload */
    size_t val_len;             /* bytes in val */
};

struct wtensor {
    char *name;                 /* NUL-terminated copy */
    uint32_t n_dims;            /* 1..GGUF_MAX_DIMS */
    int64_t ne[GGUF_MAX_DIMS];  /* sizes, ne[0] fastest; unused 1 */
    uint32_t type;              /* enum kern_type */
    uint8_t *data;              /* nbytes, owned */
    size_t nbytes;              /* data size */
};

struct gguf_writer {
    struct wkv *kv;             /* n_kv entries, in first-set order */
    size_t n_kv, cap_kv;
    struct wtensor *t;          /* n_t entries, in added order */
    size_t n_t, cap_t;
    uint32_t alignment;         /* from general.alignment, default 32 */
};

/* ---- growing byte strings ---------------------------------------------------- */

struct bytes {
    uint8_t *p;                 /* data */
    size_t len, cap;            /* used and allocated bytes */
    bool oom;                   /* an append failed */
};

static void b_put(struct bytes *b, const void *src, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->len + n)
            cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (p == NULL) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void b_u32(struct bytes *b, uint32_t v) { b_put(b, &v, 4); }
static void b_u64(struct bytes *b, uint64_t v) { b_put(b, &v, 8); }
static void b_str(struct bytes *b, const char *s, size_t len) { b_u64(b, len); b_put(b, s, len); }

/* ---- writer lifecycle ----------------------------------------------------------- */

gguf_writer_t *gguf_writer_new(void)
{
    gguf_writer_t *w = calloc(1, sizeof(*w));
    if (w != NULL)
        w->alignment = GGUF_DEFAULT_ALIGNMENT;
    return w;
}

void gguf_writer_destroy(gguf_writer_t **wp)
{
    if (wp == NULL || *wp == NULL)
        return;
    gguf_writer_t *w = *wp;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].val);
    }
    for (size_t i = 0; i < w->n_t; i++) {
        free(w->t[i].name);
        free(w->t[i].data);
    }
    free(w->kv);
    free(w->t);
    free(w);
    *wp = NULL;
}

/* ---- key/values ---------------------------------------------------------------------- */

static bool key_ok(const char *key)
{
    if (key == NULL)
        return false;
    size_t n = strlen(key);
    return n >= 1 && n <= 65535;
}

/* Stores the serialized value b (type + payload) under key; takes b's memory
 * (also on failure). */
static int put_kv(gguf_writer_t *w, const char *key, struct bytes *b)
{
    if (b->oom) {
        free(b->p);
        return KVD_ENOMEM;
    }
    for (size_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->kv[i].key, key) == 0) {
            free(w->kv[i].val);
            w->kv[i].val = b->p;
            w->kv[i].val_len = b->len;
            return 0;
        }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? 2 * w->cap_kv : 16;
        struct wkv *kv = realloc(w->kv, cap * sizeof(*kv));
        if (kv == NULL) {
            free(b->p);
            return KVD_ENOMEM;
        }
        w->kv = kv;
        w->cap_kv = cap;
    }
    char *k = strdup(key);
    if (k == NULL) {
        free(b->p);
        return KVD_ENOMEM;
    }
    w->kv[w->n_kv++] = (struct wkv){ k, b->p, b->len };
    return 0;
}

static int set_scalar(gguf_writer_t *w, const char *key, uint32_t type, const void *v)
{
    if (w == NULL || !key_ok(key))
        return KVD_EINVAL;
    uint32_t align = 0;
    if (strcmp(key, "general.alignment") == 0) {
        if (type != GGUF_VT_UINT32 || (memcpy(&align, v, 4), align == 0) || (align & (align - 1)) != 0)
            return KVD_EINVAL;
    }
    struct bytes b = { 0 };
    b_u32(&b, type);
    b_put(&b, v, gguf_vtype_size(type));
    int rc = put_kv(w, key, &b);
    if (rc == 0 && align != 0)
        w->alignment = align;
    return rc;
}

int gguf_writer_set_u8(gguf_writer_t *w, const char *key, uint8_t v) { return set_scalar(w, key, GGUF_VT_UINT8, &v); }
int gguf_writer_set_i8(gguf_writer_t *w, const char *key, int8_t v) { return set_scalar(w, key, GGUF_VT_INT8, &v); }
int gguf_writer_set_u16(gguf_writer_t *w, const char *key, uint16_t v) { return set_scalar(w, key, GGUF_VT_UINT16, &v); }
int gguf_writer_set_i16(gguf_writer_t *w, const char *key, int16_t v) { return set_scalar(w, key, GGUF_VT_INT16, &v); }
int gguf_writer_set_u32(gguf_writer_t *w, const char *key, uint32_t v) { return set_scalar(w, key, GGUF_VT_UINT32, &v); }
int gguf_writer_set_i32(gguf_writer_t *w, const char *key, int32_t v) { return set_scalar(w, key, GGUF_VT_INT32, &v); }
int gguf_writer_set_f32(gguf_writer_t *w, const char *key, float v) { return set_scalar(w, key, GGUF_VT_FLOAT32, &v); }
int gguf_writer_set_u64(gguf_writer_t *w, const char *key, uint64_t v) { return set_scalar(w, key, GGUF_VT_UINT64, &v); }
int gguf_writer_set_i64(gguf_writer_t *w, const char *key, int64_t v) { return set_scalar(w, key, GGUF_VT_INT64, &v); }
int gguf_writer_set_f64(gguf_writer_t *w, const char *key, double v) { return set_scalar(w, key, GGUF_VT_FLOAT64, &v); }

int gguf_writer_set_bool(gguf_writer_t *w, const char *key, bool v)
{
    uint8_t b = v ? 1 : 0;
    return set_scalar(w, key, GGUF_VT_BOOL, &b);
}

int gguf_writer_set_strn(gguf_writer_t *w, const char *key, const char *s, size_t len)
{
    if (w == NULL || !key_ok(key) || (s == NULL && len > 0) || strcmp(key, "general.alignment") == 0)
        return KVD_EINVAL;
    struct bytes b = { 0 };
    b_u32(&b, GGUF_VT_STRING);
    b_str(&b, s, len);
    return put_kv(w, key, &b);
}

int gguf_writer_set_str(gguf_writer_t *w, const char *key, const char *s)
{
    if (s == NULL)
        return KVD_EINVAL;
    return gguf_writer_set_strn(w, key, s, strlen(s));
}

int gguf_writer_set_arr(gguf_writer_t *w, const char *key, uint32_t elem_type,
                        const void *data, uint64_t n)
{
    const size_t esz = gguf_vtype_size(elem_type);
    if (w == NULL || !key_ok(key) || esz == 0 || (data == NULL && n > 0) ||
        n > SIZE_MAX / esz || strcmp(key, "general.alignment") == 0)
        return KVD_EINVAL;
    if (elem_type == GGUF_VT_BOOL)
        for (uint64_t i = 0; i < n; i++)
            if (((const uint8_t *)data)[i] > 1)
                return KVD_EINVAL;
    struct bytes b = { 0 };
    b_u32(&b, GGUF_VT_ARRAY);
    b_u32(&b, elem_type);
    b_u64(&b, n);
    if (n > 0)
        b_put(&b, data, (size_t)n * esz);
    return put_kv(w, key, &b);
}

int gguf_writer_set_arr_str(gguf_writer_t *w, const char *key, const char *const *strs, uint64_t n)
{
    if (w == NULL || !key_ok(key) || (strs == NULL && n > 0) || strcmp(key, "general.alignment") == 0)
        return KVD_EINVAL;
    for (uint64_t i = 0; i < n; i++)
        if (strs[i] == NULL)
            return KVD_EINVAL;
    struct bytes b = { 0 };
    b_u32(&b, GGUF_VT_ARRAY);
    b_u32(&b, GGUF_VT_STRING);
    b_u64(&b, n);
    for (uint64_t i = 0; i < n; i++)
        b_str(&b, strs[i], strlen(strs[i]));
    return put_kv(w, key, &b);
}

/* ---- tensors ---------------------------------------------------------------------------- */

int gguf_writer_add_tensor(gguf_writer_t *w, const char *name, uint32_t n_dims, const int64_t *ne,
                           uint32_t type, const void *data, size_t nbytes)
{
    if (w == NULL || name == NULL || ne == NULL || n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return KVD_EINVAL;
    const size_t nlen = strlen(name);
    if (nlen < 1 || nlen > GGUF_WRITER_MAX_NAME)
        return KVD_EINVAL;
    for (size_t i = 0; i < w->n_t; i++)
        if (strcmp(w->t[i].name, name) == 0)
            return KVD_EINVAL;
    const struct kern_type_info *ti = kern_type_info(type);
    if (ti == NULL)
        return KVD_EINVAL;
    uint64_t nelem = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] < 1 || (uint64_t)ne[d] > (UINT64_MAX >> 1) / nelem)
            return KVD_EINVAL;
        nelem *= (uint64_t)ne[d];
    }
    if (ne[0] % ti->block_elems != 0)
        return KVD_EINVAL;
    const uint64_t want = nelem / ti->block_elems * ti->block_bytes;
    if (want != nbytes || (data == NULL && nbytes > 0))
        return KVD_EINVAL;

    if (w->n_t == w->cap_t) {
        size_t cap = w->cap_t ? 2 * w->cap_t : 16;
        struct wtensor *t = realloc(w->t, cap * sizeof(*t));
        if (t == NULL)
            return KVD_ENOMEM;
        w->t = t;
        w->cap_t = cap;
    }
    struct wtensor t = { .n_dims = n_dims, .type = type, .nbytes = nbytes };
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++)
        t.ne[d] = d < n_dims ? ne[d] : 1;
    t.name = strdup(name);
    t.data = malloc(nbytes ? nbytes : 1);
    if (t.name == NULL || t.data == NULL) {
        free(t.name);
        free(t.data);
        return KVD_ENOMEM;
    }
    if (nbytes > 0)
        memcpy(t.data, data, nbytes);
    w->t[w->n_t++] = t;
    return 0;
}

/* ---- serialization ----------------------------------------------------------------------- */

struct sink {
    uint8_t *buf;               /* when non-NULL: write here */
    FILE *f;                    /* when non-NULL: write here */
    size_t pos;                 /* bytes emitted so far */
    bool failed;                /* a file write failed */
};

static void s_put(struct sink *s, const void *p, size_t n)
{
    if (n == 0)
        return;
    if (s->buf != NULL)
        memcpy(s->buf + s->pos, p, n);
    else if (s->f != NULL && !s->failed && fwrite(p, 1, n, s->f) != n)
        s->failed = true;
    s->pos += n;
}

static void s_u32(struct sink *s, uint32_t v) { s_put(s, &v, 4); }
static void s_u64(struct sink *s, uint64_t v) { s_put(s, &v, 8); }

static void s_pad(struct sink *s, uint32_t align)
{
    static const uint8_t zeros[256];
    size_t pad = (align - s->pos % align) % align;
    while (pad > 0) {
        size_t k = pad < sizeof(zeros) ? pad : sizeof(zeros);
        s_put(s, zeros, k);
        pad -= k;
    }
}

static size_t align_up(size_t v, uint32_t a) { return (v + a - 1) / a * a; }

static void serialize(const gguf_writer_t *w, struct sink *s)
{
    s_u32(s, GGUF_MAGIC);
    s_u32(s, GGUF_WRITE_VERSION);
    s_u64(s, w->n_t);
    s_u64(s, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        const size_t klen = strlen(w->kv[i].key);
        s_u64(s, klen);
        s_put(s, w->kv[i].key, klen);
        s_put(s, w->kv[i].val, w->kv[i].val_len);
    }
    size_t off = 0;
    for (size_t i = 0; i < w->n_t; i++) {
        const struct wtensor *t = &w->t[i];
        const size_t nlen = strlen(t->name);
        s_u64(s, nlen);
        s_put(s, t->name, nlen);
        s_u32(s, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++)
            s_u64(s, (uint64_t)t->ne[d]);
        s_u32(s, t->type);
        s_u64(s, off);
        off = align_up(off + t->nbytes, w->alignment);
    }
    s_pad(s, w->alignment);
    for (size_t i = 0; i < w->n_t; i++) {
        s_put(s, w->t[i].data, w->t[i].nbytes);
        s_pad(s, w->alignment);
    }
}

size_t gguf_writer_size(const gguf_writer_t *w)
{
    struct sink s = { 0 };
    serialize(w, &s);
    return s.pos;
}

int gguf_writer_write_buffer(const gguf_writer_t *w, void **buf, size_t *len)
{
    if (w == NULL || buf == NULL || len == NULL)
        return KVD_EINVAL;
    const size_t n = gguf_writer_size(w);
    struct sink s = { .buf = malloc(n) };
    if (s.buf == NULL)
        return KVD_ENOMEM;
    serialize(w, &s);
    *buf = s.buf;
    *len = n;
    return 0;
}

int gguf_writer_write_file(const gguf_writer_t *w, const char *path, char *err, size_t errlen)
{
    if (w == NULL || path == NULL)
        return kvd_seterr(err, errlen, KVD_EINVAL, "gguf_write: no writer or path");
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        return kvd_seterr(err, errlen, KVD_EIO, "gguf_write: cannot create %s: %s", path, strerror(errno));
    struct sink s = { .f = f };
    serialize(w, &s);
    int e = errno;
    bool failed = s.failed;
    if (fclose(f) != 0 && !failed) {
        failed = true;
        e = errno;
    }
    if (failed) {
        unlink(path);
        return kvd_seterr(err, errlen, KVD_EIO, "gguf_write: writing %s failed: %s", path, strerror(e));
    }
    return 0;
}
