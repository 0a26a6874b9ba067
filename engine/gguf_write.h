/*
 * gguf_write.h - builds GGUF v3 files: metadata key/values, tensors, data.
 *
 * A writer collects key/values and tensors in memory (it copies everything
 * it is given), then serializes them into a file or a buffer. Layout:
 * header, key/values in the order they were first set, tensor infos in the
 * order they were added, zero padding to the alignment, then each tensor's
 * data at an aligned offset, zero padded to the alignment. The alignment is
 * general.alignment when set (a power-of-two u32), else 32.
 *
 * kvd uses it for the random test models (mkmodel.c) and for tests that
 * need hand-made GGUF files.
 */
#ifndef KVD_GGUF_WRITE_H
#define KVD_GGUF_WRITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

#define GGUF_WRITER_MAX_NAME 63   /* longest tensor name, in bytes (ggml's limit) */

typedef struct gguf_writer gguf_writer_t;

/* Returns an empty writer, or NULL when out of memory. */
gguf_writer_t *gguf_writer_new(void);

/* Frees the writer and everything it copied; accepts NULL, sets *w to NULL. */
void gguf_writer_destroy(gguf_writer_t **w);

/* Sets key (NUL-terminated, 1..65535 bytes) to a scalar value. Setting a key
 * again replaces its value and type but keeps its place. Returns 0,
 * KVD_EINVAL (bad key; general.alignment set to anything but a power-of-two
 * u32) or KVD_ENOMEM. */
int gguf_writer_set_u8(gguf_writer_t *w, const char *key, uint8_t v);
int gguf_writer_set_i8(gguf_writer_t *w, const char *key, int8_t v);
int gguf_writer_set_u16(gguf_writer_t *w, const char *key, uint16_t v);
int gguf_writer_set_i16(gguf_writer_t *w, const char *key, int16_t v);
int gguf_writer_set_u32(gguf_writer_t *w, const char *key, uint32_t v);
int gguf_writer_set_i32(gguf_writer_t *w, const char *key, int32_t v);
int gguf_writer_set_f32(gguf_writer_t *w, const char *key, float v);
int gguf_writer_set_bool(gguf_writer_t *w, const char *key, bool v);
int gguf_writer_set_u64(gguf_writer_t *w, const char *key, uint64_t v);
int gguf_writer_set_i64(gguf_writer_t *w, const char *key, int64_t v);
int gguf_writer_set_f64(gguf_writer_t *w, const char *key, double v);

/* A string value of len bytes (may hold any bytes); _str takes a C string. */
int gguf_writer_set_strn(gguf_writer_t *w, const char *key, const char *s, size_t len);
int gguf_writer_set_str(gguf_writer_t *w, const char *key, const char *s);

/* An array of n scalars of elem_type (any enum gguf_vtype but STRING and
 * ARRAY), read from data in host (little-endian) order; bool elements are
 * one byte, 0 or 1. Returns 0, KVD_EINVAL, KVD_ENOMEM. */
int gguf_writer_set_arr(gguf_writer_t *w, const char *key, uint32_t elem_type,
                        const void *data, uint64_t n);

/* An array of n C strings. */
int gguf_writer_set_arr_str(gguf_writer_t *w, const char *key, const char *const *strs, uint64_t n);

/* Adds a tensor: name (1..GGUF_WRITER_MAX_NAME bytes, unique), n_dims
 * (1..GGUF_MAX_DIMS) sizes ne[] with ne[0] the fastest-varying dimension,
 * type (enum kern_type) and nbytes of data, which must equal the size the
 * type and shape give (ne[0] a multiple of the type's block). The data is
 * copied. Returns 0, KVD_EINVAL or KVD_ENOMEM. */
int gguf_writer_add_tensor(gguf_writer_t *w, const char *name, uint32_t n_dims, const int64_t *ne,
                           uint32_t type, const void *data, size_t nbytes);

/* Bytes the serialized file will take. */
size_t gguf_writer_size(const gguf_writer_t *w);

/* Serializes into a new malloc'd buffer that the caller frees: *buf, *len.
 * Returns 0 or KVD_ENOMEM. */
int gguf_writer_write_buffer(const gguf_writer_t *w, void **buf, size_t *len);

/* Writes the file at path (created or truncated; removed again when writing
 * fails). Returns 0 or KVD_EIO with a one-line reason in err. */
int gguf_writer_write_file(const gguf_writer_t *w, const char *path, char *err, size_t errlen);

#endif
