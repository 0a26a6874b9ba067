/*
 * gguf.h - a checked reader of GGUF v2/v3 model files.
 *
 * The file is memory-mapped read-only and parsed once: every count, length,
 * offset and size is checked against the file before it is used, so a
 * truncated or hostile file yields an error naming the problem, never a read
 * out of bounds. Strings point into the mapping and are NOT NUL-terminated.
 * Everything returned by the getters lives as long as the gguf_ctx.
 */
#ifndef KVD_GGUF_H
#define KVD_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum gguf_vtype {
    GGUF_VT_UINT8 = 0,
    GGUF_VT_INT8 = 1,
    GGUF_VT_UINT16 = 2,
    GGUF_VT_INT16 = 3,
    GGUF_VT_UINT32 = 4,
    GGUF_VT_INT32 = 5,
    GGUF_VT_FLOAT32 = 6,
    GGUF_VT_BOOL = 7,
    GGUF_VT_STRING = 8,
    GGUF_VT_ARRAY = 9,
    GGUF_VT_UINT64 = 10,
    GGUF_VT_INT64 = 11,
    GGUF_VT_FLOAT64 = 12,
    GGUF_VT_COUNT
};

#define GGUF_MAGIC 0x46554747u  /* "GGUF" little-endian */
#define GGUF_MAX_DIMS 4
#define GGUF_DEFAULT_ALIGNMENT 32

struct gguf_str {
    const char *ptr;        /* into the mapping; not NUL-terminated */
    uint64_t len;           /* bytes */
};

struct gguf_kv {
    struct gguf_str key;
    uint32_t type;          /* enum gguf_vtype */
    uint32_t arr_type;      /* element type when type == ARRAY */
    uint64_t arr_len;       /* element count when type == ARRAY */
    const uint8_t *data;    /* scalar value, or first array element */
    struct gguf_str *strs;  /* arr_len strings when arr_type == STRING, else NULL */
};

struct gguf_tensor {
    struct gguf_str name;
    uint32_t n_dims;        /* 1..GGUF_MAX_DIMS */
    int64_t ne[GGUF_MAX_DIMS]; /* elements per dimension, ne[0] fastest; unused dims 1 */
    uint32_t type;          /* enum kern_type */
    uint64_t offset;        /* from the start of the data section */
    uint64_t nbytes;        /* checked to lie inside the file */
    const void *data;       /* into the mapping */
};

typedef struct gguf_ctx gguf_ctx_t;

/* Maps and parses the file at path. Returns NULL on failure with a one-line
 * reason in err (which may be NULL). */
gguf_ctx_t *gguf_open(const char *path, char *err, size_t errlen);

/* Parses a buffer the caller keeps alive for the context's lifetime. */
gguf_ctx_t *gguf_open_buffer(const void *buf, size_t len, char *err, size_t errlen);

/* Unmaps and frees; accepts NULL and sets *g to NULL. */
void gguf_close(gguf_ctx_t **g);

uint32_t gguf_version(const gguf_ctx_t *g);
uint32_t gguf_alignment(const gguf_ctx_t *g);
const void *gguf_base(const gguf_ctx_t *g);   /* start of the file bytes */
size_t gguf_size(const gguf_ctx_t *g);        /* file size in bytes */

uint64_t gguf_n_kv(const gguf_ctx_t *g);
const struct gguf_kv *gguf_kv_at(const gguf_ctx_t *g, uint64_t i);
/* Returns the key/value named key, or NULL. */
const struct gguf_kv *gguf_find(const gguf_ctx_t *g, const char *key);

/* Typed getters: 0, KVD_ENOTFOUND when absent, KVD_EFORMAT when the stored
 * type cannot represent the request (integers convert when in range). */
int gguf_get_u32(const gguf_ctx_t *g, const char *key, uint32_t *out);
int gguf_get_f32(const gguf_ctx_t *g, const char *key, float *out);
int gguf_get_bool(const gguf_ctx_t *g, const char *key, bool *out);
int gguf_get_str(const gguf_ctx_t *g, const char *key, struct gguf_str *out);
/* Array of any element type: *n elements of type *type starting at *data
 * (strings: use kv->strs). */
int gguf_get_arr(const gguf_ctx_t *g, const char *key, uint32_t *type,
                 uint64_t *n, const struct gguf_kv **kv);

/* Reads element i of an integer array as int64 (any integer element type). */
int64_t gguf_arr_int(const struct gguf_kv *kv, uint64_t i);

uint64_t gguf_n_tensors(const gguf_ctx_t *g);

/* Whether the tensor data is a read-only mapping of the file (gguf_open),
 * rather than a caller's buffer. */
bool gguf_is_mapped(const gguf_ctx_t *g);
const struct gguf_tensor *gguf_tensor_at(const gguf_ctx_t *g, uint64_t i);
/* Returns the tensor named name, or NULL. */
const struct gguf_tensor *gguf_find_tensor(const gguf_ctx_t *g, const char *name);

/* Bytes of one scalar of a value type; 0 for STRING, ARRAY and unknown types. */
size_t gguf_vtype_size(uint32_t type);

/* True when s equals the NUL-terminated c. */
bool gguf_str_eq(struct gguf_str s, const char *c);

#endif
