/*
 * kvformat.h - the formats a KV block stores: the element types of K and V,
 * their rotation, and the bytes they take per head, token and layer.
 *
 * Plain arithmetic over a KV shape, without a model: the pool (shm/) sizes
 * and checks its blocks with it, the engine (engine/kvcache.h) lays them out.
 */
#ifndef KVD_KVFORMAT_H
#define KVD_KVFORMAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Rotation flags (kv_params.rotate): which of K and V are stored rotated by
 * the orthonormal Walsh-Hadamard matrix H of the head size (kern_hadamard).
 * H is symmetric and its own inverse, so q.k is unchanged when q is rotated
 * too, and the attention output over rotated V is rotated back by H. It
 * spreads an outlier channel over the whole head before quantization. */
enum {
    KV_ROT_K = 1,           /* K rows rotated; queries are rotated to meet them */
    KV_ROT_V = 2,           /* V rows rotated; attention outputs are rotated back */
};

/* True for a type a cache may hold: f32, f16, bf16, q8_0, q4_0. */
bool kv_type_ok(uint32_t type);

/* "f32", "f16", "bf16", "q8_0", "q4_0"; "?" for anything else. */
const char *kv_type_name(uint32_t type);

/* Parses a type name as above into *type; KVD_EINVAL for anything else. */
int kv_type_parse(const char *name, uint32_t *type);

/* The rotation used unless asked otherwise: the quantized halves are rotated. */
uint32_t kv_rotate_default(uint32_t k_type, uint32_t v_type);

/* Parses --kv-rotate's value: "on" (rotate K and V), "off", "auto"
 * (kv_rotate_default), or exactly "k", "v", "kv" (what kv_rotate_arg
 * writes); 0 or KVD_EINVAL. */
int kv_rotate_parse(const char *s, uint32_t k_type, uint32_t v_type, uint32_t *rotate);

/* "K+V", "K", "V" or "off", for people. */
const char *kv_rotate_name(uint32_t rotate);

/* "kv", "k", "v" or "off": the --kv-rotate value that gives exactly this. */
const char *kv_rotate_arg(uint32_t rotate);

/* Checks that a head of head_dim values can be stored as k_type / v_type with
 * that rotation (quantized types need head_dim % 32 == 0, rotation a power of
 * two up to KERN_MAX_HEAD_DIM); 0 or KVD_EINVAL with the reason in err. */
int kv_format_check(uint32_t head_dim, uint32_t k_type, uint32_t v_type, uint32_t rotate,
                    char *err, size_t errlen);

/* Bytes of one head of one token of a type (0 for a type or size it cannot hold). */
size_t kv_row_bytes(uint32_t type, uint32_t head_dim);

/* Bytes of KV per token: layers x kv_heads x (K row + V row). */
uint64_t kv_token_bytes(uint32_t n_layer, uint32_t n_head_kv, uint32_t head_dim, uint32_t k_type,
                        uint32_t v_type);

#endif
