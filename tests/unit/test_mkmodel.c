/*
 * test_mkmodel.c - the GGUF writer (engine/gguf_write.c) and the random model
 * writer (engine/mkmodel.c), read back with kvd's GGUF reader.
 *
 * Writer: every value type round trips, keys replace in place, alignment is
 * honoured, bad tensors and keys are refused. Models: several shapes and
 * types are written to a temporary directory and checked key by key and
 * tensor by tensor; the vocabulary's merges are consistent; the same seed
 * gives the same bytes; bad parameters are refused with a reason.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "err.h"
#include "gguf.h"
#include "gguf_write.h"
#include "mkmodel.h"
#include "quant.h"
#include "types.h"

static char tmpdir[256];

static bool str_is(struct gguf_str s, const char *c) { return gguf_str_eq(s, c); }

/* ---- the writer ---------------------------------------------------------------- */

static void test_writer_values(void)
{
    gguf_writer_t *w = gguf_writer_new();
    REQUIRE(w != NULL);
    CHECK_INT(gguf_writer_set_u8(w, "t.u8", 200), 0);
    CHECK_INT(gguf_writer_set_i8(w, "t.i8", -100), 0);
    CHECK_INT(gguf_writer_set_u16(w, "t.u16", 60000), 0);
    CHECK_INT(gguf_writer_set_i16(w, "t.i16", -30000), 0);
    CHECK_INT(gguf_writer_set_u32(w, "t.u32", 4000000000u), 0);
    CHECK_INT(gguf_writer_set_i32(w, "t.i32", -2000000000), 0);
    CHECK_INT(gguf_writer_set_f32(w, "t.f32", 1.5f), 0);
    CHECK_INT(gguf_writer_set_bool(w, "t.bool", true), 0);
    CHECK_INT(gguf_writer_set_u64(w, "t.u64", 1ull << 40), 0);
    CHECK_INT(gguf_writer_set_i64(w, "t.i64", -(1ll << 40)), 0);
    CHECK_INT(gguf_writer_set_f64(w, "t.f64", 0.1), 0);
    CHECK_INT(gguf_writer_set_str(w, "t.str", "hello"), 0);
    CHECK_INT(gguf_writer_set_strn(w, "t.bin", "a\0b", 3), 0);
    const int16_t arr16[3] = { -1, 2, -3 };
    CHECK_INT(gguf_writer_set_arr(w, "t.arr_i16", GGUF_VT_INT16, arr16, 3), 0);
    const float arrf[2] = { 0.25f, -4.0f };
    CHECK_INT(gguf_writer_set_arr(w, "t.arr_f32", GGUF_VT_FLOAT32, arrf, 2), 0);
    const uint8_t arrb[2] = { 1, 0 };
    CHECK_INT(gguf_writer_set_arr(w, "t.arr_bool", GGUF_VT_BOOL, arrb, 2), 0);
    CHECK_INT(gguf_writer_set_arr(w, "t.arr_empty", GGUF_VT_UINT64, NULL, 0), 0);
    const char *strs[3] = { "x", "", "zz z" };
    CHECK_INT(gguf_writer_set_arr_str(w, "t.arr_str", strs, 3), 0);
    /* replacing keeps the place and changes the type */
    CHECK_INT(gguf_writer_set_str(w, "t.u16", "now a string"), 0);

    /* refused */
    CHECK_INT(gguf_writer_set_u32(w, "", 1), KVD_EINVAL);
    CHECK_INT(gguf_writer_set_u32(w, NULL, 1), KVD_EINVAL);
    CHECK_INT(gguf_writer_set_str(w, "t.null", NULL), KVD_EINVAL);
    CHECK_INT(gguf_writer_set_arr(w, "t.bad", GGUF_VT_STRING, strs, 3), KVD_EINVAL);
    CHECK_INT(gguf_writer_set_arr(w, "t.bad", GGUF_VT_ARRAY, arr16, 1), KVD_EINVAL);
    CHECK_INT(gguf_writer_set_arr(w, "t.bad", 77, arr16, 1), KVD_EINVAL);
    const uint8_t badb[1] = { 2 };
    CHECK_INT(gguf_writer_set_arr(w, "t.bad", GGUF_VT_BOOL, badb, 1), KVD_EINVAL);
    CHECK_INT(gguf_writer_set_u32(w, "general.alignment", 48), KVD_EINVAL);
    CHECK_INT(gguf_writer_set_u32(w, "general.alignment", 0), KVD_EINVAL);
    CHECK_INT(gguf_writer_set_u64(w, "general.alignment", 64), KVD_EINVAL);
    CHECK_INT(gguf_writer_set_str(w, "general.alignment", "64"), KVD_EINVAL);

    void *buf = NULL;
    size_t len = 0;
    CHECK_INT(gguf_writer_write_buffer(w, &buf, &len), 0);
    CHECK_INT(len, gguf_writer_size(w));
    char err[256] = "";
    gguf_ctx_t *g = gguf_open_buffer(buf, len, err, sizeof(err));
    if (g == NULL)
        fprintf(stderr, "gguf_open_buffer: %s\n", err);
    REQUIRE(g != NULL);
    CHECK_INT(gguf_version(g), 3);
    CHECK_INT(gguf_n_kv(g), 18);
    CHECK_INT(gguf_n_tensors(g), 0);
    CHECK(str_is(gguf_kv_at(g, 0)->key, "t.u8"));
    CHECK(str_is(gguf_kv_at(g, 2)->key, "t.u16"));
    CHECK_INT(gguf_kv_at(g, 2)->type, GGUF_VT_STRING);

    const struct gguf_kv *kv;
    uint32_t u32;
    kv = gguf_find(g, "t.u8");
    CHECK(kv && kv->type == GGUF_VT_UINT8 && kv->data[0] == 200);
    kv = gguf_find(g, "t.i8");
    CHECK(kv && kv->type == GGUF_VT_INT8 && (int8_t)kv->data[0] == -100);
    kv = gguf_find(g, "t.i16");
    int16_t i16 = 0;
    if (kv) memcpy(&i16, kv->data, 2);
    CHECK(kv && kv->type == GGUF_VT_INT16 && i16 == -30000);
    CHECK_INT(gguf_get_u32(g, "t.u32", &u32), 0);
    CHECK(u32 == 4000000000u);
    kv = gguf_find(g, "t.i32");
    int32_t i32 = 0;
    if (kv) memcpy(&i32, kv->data, 4);
    CHECK(kv && kv->type == GGUF_VT_INT32 && i32 == -2000000000);
    float f = 0;
    CHECK_INT(gguf_get_f32(g, "t.f32", &f), 0);
    CHECK(f == 1.5f);
    bool b = false;
    CHECK_INT(gguf_get_bool(g, "t.bool", &b), 0);
    CHECK(b);
    kv = gguf_find(g, "t.u64");
    uint64_t u64 = 0;
    if (kv) memcpy(&u64, kv->data, 8);
    CHECK(kv && kv->type == GGUF_VT_UINT64 && u64 == 1ull << 40);
    kv = gguf_find(g, "t.i64");
    int64_t i64 = 0;
    if (kv) memcpy(&i64, kv->data, 8);
    CHECK(kv && kv->type == GGUF_VT_INT64 && i64 == -(1ll << 40));
    kv = gguf_find(g, "t.f64");
    double f64 = 0;
    if (kv) memcpy(&f64, kv->data, 8);
    CHECK(kv && kv->type == GGUF_VT_FLOAT64 && f64 == 0.1);
    struct gguf_str s;
    CHECK_INT(gguf_get_str(g, "t.str", &s), 0);
    CHECK(str_is(s, "hello"));
    CHECK_INT(gguf_get_str(g, "t.bin", &s), 0);
    CHECK(s.len == 3 && memcmp(s.ptr, "a\0b", 3) == 0);
    CHECK_INT(gguf_get_str(g, "t.u16", &s), 0);
    CHECK(str_is(s, "now a string"));

    uint32_t at;
    uint64_t n;
    CHECK_INT(gguf_get_arr(g, "t.arr_i16", &at, &n, &kv), 0);
    CHECK(at == GGUF_VT_INT16 && n == 3);
    CHECK(gguf_arr_int(kv, 0) == -1 && gguf_arr_int(kv, 1) == 2 && gguf_arr_int(kv, 2) == -3);
    CHECK_INT(gguf_get_arr(g, "t.arr_f32", &at, &n, &kv), 0);
    float fa[2] = { 0, 0 };
    if (n == 2) memcpy(fa, kv->data, 8);
    CHECK(at == GGUF_VT_FLOAT32 && n == 2 && fa[0] == 0.25f && fa[1] == -4.0f);
    CHECK_INT(gguf_get_arr(g, "t.arr_bool", &at, &n, &kv), 0);
    CHECK(at == GGUF_VT_BOOL && n == 2 && kv->data[0] == 1 && kv->data[1] == 0);
    CHECK_INT(gguf_get_arr(g, "t.arr_empty", &at, &n, &kv), 0);
    CHECK(at == GGUF_VT_UINT64 && n == 0);
    CHECK_INT(gguf_get_arr(g, "t.arr_str", &at, &n, &kv), 0);
    CHECK(at == GGUF_VT_STRING && n == 3 && kv->strs != NULL);
    if (kv->strs != NULL && n == 3)
        CHECK(str_is(kv->strs[0], "x") && str_is(kv->strs[1], "") && str_is(kv->strs[2], "zz z"));
    gguf_close(&g);
    CHECK(g == NULL);
    free(buf);
    gguf_writer_destroy(&w);
    CHECK(w == NULL);
    gguf_writer_destroy(&w);   /* NULL is fine */
}

static void test_writer_tensors(uint32_t alignment)
{
    gguf_writer_t *w = gguf_writer_new();
    REQUIRE(w != NULL);
    if (alignment != GGUF_DEFAULT_ALIGNMENT)
        CHECK_INT(gguf_writer_set_u32(w, "general.alignment", alignment), 0);
    float a[3 * 5];
    for (int i = 0; i < 15; i++)
        a[i] = (float)i;
    const int64_t ne_a[2] = { 3, 5 };
    CHECK_INT(gguf_writer_add_tensor(w, "a", 2, ne_a, KERN_F32, a, sizeof(a)), 0);
    uint8_t q[2 * 18];
    for (size_t i = 0; i < sizeof(q); i++)
        q[i] = (uint8_t)(i * 7);
    const int64_t ne_q[3] = { 32, 1, 2 };
    CHECK_INT(gguf_writer_add_tensor(w, "b.q4_0", 3, ne_q, KERN_Q4_0, q, sizeof(q)), 0);
    const int64_t ne_c[1] = { 1 };
    CHECK_INT(gguf_writer_add_tensor(w, "c", 1, ne_c, KERN_F16, "\x00\x3c", 2), 0);

    /* refused */
    CHECK_INT(gguf_writer_add_tensor(w, "a", 2, ne_a, KERN_F32, a, sizeof(a)), KVD_EINVAL);
    CHECK_INT(gguf_writer_add_tensor(w, "d", 2, ne_a, KERN_F32, a, sizeof(a) - 4), KVD_EINVAL);
    CHECK_INT(gguf_writer_add_tensor(w, "d", 2, ne_a, KERN_Q4_0, a, sizeof(a)), KVD_EINVAL);
    CHECK_INT(gguf_writer_add_tensor(w, "d", 0, ne_a, KERN_F32, a, sizeof(a)), KVD_EINVAL);
    CHECK_INT(gguf_writer_add_tensor(w, "d", 5, ne_a, KERN_F32, a, sizeof(a)), KVD_EINVAL);
    CHECK_INT(gguf_writer_add_tensor(w, "d", 2, ne_a, 99, a, sizeof(a)), KVD_EINVAL);
    CHECK_INT(gguf_writer_add_tensor(w, "", 2, ne_a, KERN_F32, a, sizeof(a)), KVD_EINVAL);
    const int64_t ne_bad[2] = { 3, 0 };
    CHECK_INT(gguf_writer_add_tensor(w, "d", 2, ne_bad, KERN_F32, a, 0), KVD_EINVAL);
    char longname[80];
    memset(longname, 'n', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = 0;
    CHECK_INT(gguf_writer_add_tensor(w, longname, 2, ne_a, KERN_F32, a, sizeof(a)), KVD_EINVAL);

    char path[512];
    snprintf(path, sizeof(path), "%s/tensors_%u.gguf", tmpdir, alignment);
    char err[256] = "";
    CHECK_INT(gguf_writer_write_file(w, path, err, sizeof(err)), 0);
    struct stat st;
    CHECK(stat(path, &st) == 0 && (size_t)st.st_size == gguf_writer_size(w));
    CHECK_INT(st.st_size % alignment, 0);
    gguf_writer_destroy(&w);

    gguf_ctx_t *g = gguf_open(path, err, sizeof(err));
    if (g == NULL)
        fprintf(stderr, "gguf_open: %s\n", err);
    REQUIRE(g != NULL);
    CHECK_INT(gguf_alignment(g), alignment);
    CHECK_INT(gguf_n_tensors(g), 3);
    const uint8_t *base = gguf_base(g);
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        CHECK_INT(((const uint8_t *)t->data - base) % alignment, 0);
    }
    const struct gguf_tensor *t = gguf_find_tensor(g, "a");
    REQUIRE(t != NULL);
    CHECK(t->n_dims == 2 && t->ne[0] == 3 && t->ne[1] == 5 && t->ne[2] == 1 && t->type == KERN_F32);
    CHECK(t->nbytes == sizeof(a) && memcmp(t->data, a, sizeof(a)) == 0);
    t = gguf_find_tensor(g, "b.q4_0");
    REQUIRE(t != NULL);
    CHECK(t->n_dims == 3 && t->ne[0] == 32 && t->ne[1] == 1 && t->ne[2] == 2 && t->type == KERN_Q4_0);
    CHECK(t->nbytes == sizeof(q) && memcmp(t->data, q, sizeof(q)) == 0);
    t = gguf_find_tensor(g, "c");
    REQUIRE(t != NULL);
    CHECK(t->n_dims == 1 && t->ne[0] == 1 && t->type == KERN_F16 && memcmp(t->data, "\x00\x3c", 2) == 0);
    gguf_close(&g);

    /* an unwritable path fails cleanly */
    w = gguf_writer_new();
    REQUIRE(w != NULL);
    snprintf(path, sizeof(path), "%s/no/such/dir/x.gguf", tmpdir);
    err[0] = 0;
    CHECK_INT(gguf_writer_write_file(w, path, err, sizeof(err)), KVD_EIO);
    CHECK(err[0] != 0);
    gguf_writer_destroy(&w);
}

/* ---- models --------------------------------------------------------------------- */

static uint32_t get_u32(const gguf_ctx_t *g, const char *key)
{
    uint32_t v = 0xdeadbeef;
    CHECK_INT(gguf_get_u32(g, key, &v), 0);
    return v;
}

static void check_matrix(const gguf_ctx_t *g, const char *name, uint32_t type, int64_t ne0, int64_t ne1)
{
    const struct gguf_tensor *t = gguf_find_tensor(g, name);
    if (t == NULL) {
        fprintf(stderr, "missing tensor %s\n", name);
        CHECK(t != NULL);
        return;
    }
    const bool vec = ne1 == 0;
    if (t->n_dims != (vec ? 1u : 2u) || t->ne[0] != ne0 || (!vec && t->ne[1] != ne1) || t->type != type)
        fprintf(stderr, "%s: %u dims [%lld, %lld] type %u, want [%lld, %lld] type %u\n", name, t->n_dims,
                (long long)t->ne[0], (long long)t->ne[1], t->type, (long long)ne0, (long long)ne1, type);
    CHECK_INT(t->n_dims, vec ? 1 : 2);
    CHECK_INT(t->ne[0], ne0);
    CHECK_INT(t->ne[1], vec ? 1 : ne1);
    CHECK_INT(t->type, type);
    CHECK_INT(((const uint8_t *)t->data - (const uint8_t *)gguf_base(g)) % gguf_alignment(g), 0);
    CHECK_INT(t->offset % gguf_alignment(g), 0);

    /* the values: norms about 1 +- 0.1, matrices about std 1/sqrt(ne0) */
    const int64_t rows = vec ? 1 : (ne1 < 8 ? ne1 : 8);
    float *x = malloc((size_t)(ne0 * rows) * sizeof(float));
    REQUIRE(x != NULL);
    CHECK_INT(kern_dequantize_row(type, t->data, x, ne0 * rows), 0);
    double s1 = 0, s2 = 0;
    for (int64_t i = 0; i < ne0 * rows; i++) {
        s1 += x[i];
        s2 += (double)x[i] * x[i];
    }
    const double mean = s1 / (double)(ne0 * rows), sd = sqrt(s2 / (double)(ne0 * rows) - mean * mean);
    if (vec) {
        CHECK(fabs(mean - 1.0) < 0.05 && sd < 0.08);
    } else {
        const double want = 1.0 / sqrt((double)ne0);
        if (!(fabs(mean) < 0.25 * want && sd > 0.8 * want && sd < 1.2 * want))
            fprintf(stderr, "%s: mean %g sd %g, want sd %g\n", name, mean, sd, want);
        CHECK(fabs(mean) < 0.25 * want && sd > 0.8 * want && sd < 1.2 * want);
    }
    free(x);
}

static void check_vocab(const gguf_ctx_t *g, uint32_t n_vocab)
{
    uint32_t at;
    uint64_t n;
    const struct gguf_kv *tok, *tt, *mg;
    CHECK_INT(gguf_get_arr(g, "tokenizer.ggml.tokens", &at, &n, &tok), 0);
    REQUIRE(at == GGUF_VT_STRING && n == n_vocab && tok->strs != NULL);
    CHECK_INT(gguf_get_arr(g, "tokenizer.ggml.token_type", &at, &n, &tt), 0);
    REQUIRE(at == GGUF_VT_INT32 && n == n_vocab);
    CHECK_INT(gguf_get_arr(g, "tokenizer.ggml.merges", &at, &n, &mg), 0);
    REQUIRE(at == GGUF_VT_STRING && n == n_vocab - MKMODEL_MIN_VOCAB && (n == 0 || mg->strs != NULL));

    CHECK(str_is(tok->strs[0], "<|endoftext|>"));
    CHECK(str_is(tok->strs[1], "<|im_start|>"));
    CHECK(str_is(tok->strs[2], "<|im_end|>"));
    for (int i = 0; i < 3; i++)
        CHECK_INT(gguf_arr_int(tt, (uint64_t)i), 3);
    for (uint32_t i = 3; i < n_vocab; i++)
        CHECK_INT(gguf_arr_int(tt, i), 1);
    /* GPT-2's byte map: printable ASCII stands for itself, space is U+0120,
     * newline U+010A, byte 0 U+0100, byte 0xAD U+0143 */
    CHECK(str_is(tok->strs[3 + 'a'], "a"));
    CHECK(str_is(tok->strs[3 + '!'], "!"));
    CHECK(str_is(tok->strs[3 + ' '], "\xc4\xa0"));
    CHECK(str_is(tok->strs[3 + '\n'], "\xc4\x8a"));
    CHECK(str_is(tok->strs[3 + 0], "\xc4\x80"));
    CHECK(str_is(tok->strs[3 + 0xad], "\xc5\x83"));
    CHECK(str_is(tok->strs[3 + 0xe9], "\xc3\xa9"));

    /* tokens are distinct; merge i joins two earlier tokens into token 259+i */
    int dup = 0, bad_merge = 0;
    for (uint32_t i = 0; i < n_vocab && n_vocab <= 4096; i++)
        for (uint32_t j = i + 1; j < n_vocab; j++)
            dup += tok->strs[i].len == tok->strs[j].len &&
                   memcmp(tok->strs[i].ptr, tok->strs[j].ptr, tok->strs[i].len) == 0;
    CHECK_INT(dup, 0);
    for (uint64_t m = 0; m < n; m++) {
        const struct gguf_str ms = mg->strs[m], res = tok->strs[MKMODEL_MIN_VOCAB + m];
        const char *sp = memchr(ms.ptr, ' ', ms.len);
        if (sp == NULL || memchr(sp + 1, ' ', ms.len - (size_t)(sp + 1 - ms.ptr)) != NULL) {
            bad_merge++;
            continue;
        }
        const size_t la = (size_t)(sp - ms.ptr), lb = ms.len - la - 1;
        if (la == 0 || lb == 0 || res.len != la + lb || memcmp(res.ptr, ms.ptr, la) != 0 ||
            memcmp(res.ptr + la, sp + 1, lb) != 0) {
            bad_merge++;
            continue;
        }
        bool fa = false, fb = false;
        for (uint64_t i = 0; i < MKMODEL_MIN_VOCAB + m && !(fa && fb); i++) {
            fa |= tok->strs[i].len == la && memcmp(tok->strs[i].ptr, ms.ptr, la) == 0;
            fb |= tok->strs[i].len == lb && memcmp(tok->strs[i].ptr, sp + 1, lb) == 0;
        }
        bad_merge += !(fa && fb);
    }
    CHECK_INT(bad_merge, 0);
    /* the first merges come from English text */
    if (n > 4) {
        bool common = false;
        for (int m = 0; m < 4; m++)
            common |= str_is(mg->strs[m], "\xc4\xa0 t") || str_is(mg->strs[m], "h e");
        CHECK(common);
    }
}

static void check_model(const char *path, const struct mkmodel_params *p)
{
    char err[256] = "";
    gguf_ctx_t *g = gguf_open(path, err, sizeof(err));
    if (g == NULL)
        fprintf(stderr, "gguf_open %s: %s\n", path, err);
    REQUIRE(g != NULL);
    struct gguf_str s;
    CHECK_INT(gguf_get_str(g, "general.architecture", &s), 0);
    CHECK(str_is(s, "llama"));
    const uint32_t hd = p->n_embd / p->n_head;
    CHECK_INT(get_u32(g, "llama.block_count"), p->n_layer);
    CHECK_INT(get_u32(g, "llama.context_length"), p->n_ctx);
    CHECK_INT(get_u32(g, "llama.embedding_length"), p->n_embd);
    CHECK_INT(get_u32(g, "llama.feed_forward_length"), p->n_ff);
    CHECK_INT(get_u32(g, "llama.attention.head_count"), p->n_head);
    CHECK_INT(get_u32(g, "llama.attention.head_count_kv"), p->n_head_kv);
    CHECK_INT(get_u32(g, "llama.rope.dimension_count"), hd);
    CHECK_INT(get_u32(g, "llama.vocab_size"), p->n_vocab);
    float f = 0;
    CHECK_INT(gguf_get_f32(g, "llama.rope.freq_base", &f), 0);
    CHECK(f == p->rope_freq_base);
    CHECK_INT(gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &f), 0);
    CHECK(f == p->rms_eps);
    CHECK_INT(gguf_get_str(g, "tokenizer.ggml.model", &s), 0);
    CHECK(str_is(s, "gpt2"));
    CHECK_INT(gguf_get_str(g, "tokenizer.ggml.pre", &s), 0);
    CHECK(str_is(s, "default"));
    CHECK_INT(get_u32(g, "tokenizer.ggml.bos_token_id"), 1);
    CHECK_INT(get_u32(g, "tokenizer.ggml.eos_token_id"), 2);
    bool b = true;
    CHECK_INT(gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b), 0);
    CHECK(!b);
    CHECK_INT(gguf_get_str(g, "tokenizer.chat_template", &s), 0);
    CHECK(str_is(s, p->chat_template ? p->chat_template : mkmodel_default_chat_template()));
    check_vocab(g, p->n_vocab);

    const int64_t E = p->n_embd, F = p->n_ff, V = p->n_vocab, Q = (int64_t)p->n_head * hd,
                  KV = (int64_t)p->n_head_kv * hd;
    CHECK_INT(gguf_n_tensors(g), 2 + 9 * p->n_layer + (p->tied ? 0 : 1));
    check_matrix(g, "token_embd.weight", p->embd_type, E, V);
    check_matrix(g, "output_norm.weight", KERN_F32, E, 0);
    if (p->tied)
        CHECK(gguf_find_tensor(g, "output.weight") == NULL);
    else
        check_matrix(g, "output.weight", p->embd_type, E, V);
    char name[64];
    for (uint32_t l = 0; l < p->n_layer; l++) {
#define N(sfx) (snprintf(name, sizeof(name), "blk.%u." sfx, l), name)
        check_matrix(g, N("attn_norm.weight"), KERN_F32, E, 0);
        check_matrix(g, N("attn_q.weight"), p->wtype, E, Q);
        check_matrix(g, N("attn_k.weight"), p->wtype, E, KV);
        check_matrix(g, N("attn_v.weight"), p->wtype, E, KV);
        check_matrix(g, N("attn_output.weight"), p->wtype, Q, E);
        check_matrix(g, N("ffn_norm.weight"), KERN_F32, E, 0);
        check_matrix(g, N("ffn_gate.weight"), p->wtype, E, F);
        check_matrix(g, N("ffn_up.weight"), p->wtype, E, F);
        check_matrix(g, N("ffn_down.weight"), p->wtype, F, E);
#undef N
    }
    gguf_close(&g);
}

static void write_and_check(const char *tag, const struct mkmodel_params *p)
{
    char path[512], err[256] = "";
    snprintf(path, sizeof(path), "%s/%s.gguf", tmpdir, tag);
    int rc = mkmodel_write(p, path, err, sizeof(err));
    if (rc)
        fprintf(stderr, "%s: %s\n", tag, err);
    CHECK_INT(rc, 0);
    if (rc == 0)
        check_model(path, p);
}

static void test_models(void)
{
    struct mkmodel_params p = mkmodel_default_params();
    write_and_check("default", &p);

    p = mkmodel_default_params();
    p.n_layer = 1;
    p.n_embd = 256;
    p.n_head = 4;
    p.n_head_kv = 1;
    p.n_ff = 512;
    p.n_vocab = 600;
    p.wtype = KERN_Q4_K;
    p.embd_type = KERN_Q6_K;
    p.tied = false;
    p.seed = 7;
    write_and_check("k_untied", &p);

    p = mkmodel_default_params();
    p.n_layer = 3;
    p.n_embd = 32;
    p.n_head = 2;
    p.n_head_kv = 2;
    p.n_ff = 64;
    p.n_vocab = MKMODEL_MIN_VOCAB;
    p.wtype = KERN_F32;
    p.embd_type = KERN_BF16;
    p.rope_freq_base = 500000.0f;
    p.rms_eps = 1e-6f;
    p.chat_template = "{{ messages }}";
    write_and_check("f32_minvocab", &p);

    /* every other weight type once */
    static const uint32_t types[] = { KERN_F16, KERN_Q4_0, KERN_Q5_0, KERN_Q5_1, KERN_Q8_0, KERN_Q5_K, KERN_Q6_K };
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        p = mkmodel_default_params();
        p.n_layer = 1;
        p.n_embd = 256;
        p.n_ff = 256;
        p.n_vocab = 300;
        p.wtype = types[i];
        p.embd_type = types[(i + 1) % (sizeof(types) / sizeof(types[0]))];
        char tag[32];
        snprintf(tag, sizeof(tag), "type_%s", kern_type_info(types[i])->name);
        write_and_check(tag, &p);
    }

    /* a larger vocabulary: the random merges fill it */
    p = mkmodel_default_params();
    p.n_layer = 1;
    p.n_vocab = 3000;
    write_and_check("vocab3000", &p);
}

static bool read_all(const char *path, uint8_t **buf, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return false;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *buf = malloc((size_t)n + 1);
    bool ok = *buf != NULL && fread(*buf, 1, (size_t)n, f) == (size_t)n;
    fclose(f);
    *len = (size_t)n;
    return ok;
}

static void test_deterministic(void)
{
    struct mkmodel_params p = mkmodel_default_params();
    char a[512], b[512], c[512], err[256];
    snprintf(a, sizeof(a), "%s/det_a.gguf", tmpdir);
    snprintf(b, sizeof(b), "%s/det_b.gguf", tmpdir);
    snprintf(c, sizeof(c), "%s/det_c.gguf", tmpdir);
    CHECK_INT(mkmodel_write(&p, a, err, sizeof(err)), 0);
    CHECK_INT(mkmodel_write(&p, b, err, sizeof(err)), 0);
    p.seed = 2;
    CHECK_INT(mkmodel_write(&p, c, err, sizeof(err)), 0);
    uint8_t *ba = NULL, *bb = NULL, *bc = NULL;
    size_t la = 0, lb = 0, lc = 0;
    REQUIRE(read_all(a, &ba, &la) && read_all(b, &bb, &lb) && read_all(c, &bc, &lc));
    CHECK(la == lb && memcmp(ba, bb, la) == 0);
    CHECK(la != lc || memcmp(ba, bc, la) != 0);
    free(ba);
    free(bb);
    free(bc);

    /* mkmodel_build gives the same bytes in memory */
    p.seed = 1;
    gguf_writer_t *w = NULL;
    CHECK_INT(mkmodel_build(&p, &w, err, sizeof(err)), 0);
    REQUIRE(w != NULL);
    void *mem = NULL;
    size_t lm = 0;
    CHECK_INT(gguf_writer_write_buffer(w, &mem, &lm), 0);
    CHECK(lm == la);
    REQUIRE(read_all(a, &ba, &la));
    CHECK(lm == la && memcmp(mem, ba, la) == 0);
    free(ba);
    free(mem);
    gguf_writer_destroy(&w);
}

static void expect_bad(struct mkmodel_params p, const char *why)
{
    char err[256] = "";
    const int rc = mkmodel_check(&p, err, sizeof(err));
    if (rc != KVD_EINVAL || err[0] == 0)
        fprintf(stderr, "accepted bad parameters (%s)\n", why);
    CHECK_INT(rc, KVD_EINVAL);
    CHECK(err[0] != 0);
    char path[512];
    snprintf(path, sizeof(path), "%s/bad.gguf", tmpdir);
    CHECK_INT(mkmodel_write(&p, path, err, sizeof(err)), KVD_EINVAL);
    CHECK(access(path, F_OK) != 0);
}

static void test_bad_params(void)
{
    const struct mkmodel_params d = mkmodel_default_params();
    char err[256];
    CHECK_INT(mkmodel_check(&d, err, sizeof(err)), 0);
    struct mkmodel_params p;
    p = d; p.n_layer = 0; expect_bad(p, "no layers");
    p = d; p.n_vocab = 258; expect_bad(p, "vocab too small");
    p = d; p.n_head = 3; expect_bad(p, "heads do not divide embd");
    p = d; p.n_head = 64; expect_bad(p, "odd head dim");
    p = d; p.n_head_kv = 3; expect_bad(p, "kv heads do not divide heads");
    p = d; p.n_head_kv = 0; expect_bad(p, "no kv heads");
    p = d; p.n_ff = 100; expect_bad(p, "ff not a multiple of the block");
    p = d; p.wtype = KERN_Q4_K; expect_bad(p, "K-quant with embd 64");
    p = d; p.embd_type = KERN_Q6_K; expect_bad(p, "K-quant embeddings with embd 64");
    p = d; p.wtype = KERN_Q8_1; expect_bad(p, "activation type as weights");
    p = d; p.wtype = KERN_Q2_K; expect_bad(p, "unsupported type");
    p = d; p.wtype = 200; expect_bad(p, "no such type");
    p = d; p.rms_eps = 0.0f; expect_bad(p, "zero eps");
    p = d; p.rope_freq_base = -1.0f; expect_bad(p, "negative rope base");
    p = d; p.n_ctx = 0; expect_bad(p, "no context");
    CHECK_INT(mkmodel_check(NULL, err, sizeof(err)), KVD_EINVAL);
    CHECK_INT(mkmodel_build(&d, NULL, err, sizeof(err)), KVD_EINVAL);
    char path[512];
    snprintf(path, sizeof(path), "%s/no/such/dir/m.gguf", tmpdir);
    err[0] = 0;
    CHECK_INT(mkmodel_write(&d, path, err, sizeof(err)), KVD_EIO);
    CHECK(err[0] != 0);
}

static void remove_tree(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

int main(void)
{
    const char *base = getenv("TMPDIR");
    snprintf(tmpdir, sizeof(tmpdir), "%s/kvd_test_mkmodel_XXXXXX", base && *base ? base : "/tmp");
    REQUIRE(mkdtemp(tmpdir) != NULL);

    test_writer_values();
    test_writer_tensors(GGUF_DEFAULT_ALIGNMENT);
    test_writer_tensors(64);
    test_writer_tensors(8);
    test_models();
    test_deterministic();
    test_bad_params();

    remove_tree(tmpdir);
    return CHECK_DONE();
}
