/*
 * test_gguf.c - the GGUF reader: every value type round-trips through the
 * writer, and truncated, corrupt or unsupported files give an error that
 * names the problem (never a crash: this runs under ASan+UBSan too).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "err.h"
#include "gguf.h"
#include "gguf_write.h"
#include "mkmodel.h"
#include "model.h"
#include "types.h"

static void *build(gguf_writer_t *w, size_t *len)
{
    void *buf = NULL;
    REQUIRE(gguf_writer_write_buffer(w, &buf, len) == 0);
    return buf;
}

/* A small file with one key of every type and two tensors. */
static gguf_writer_t *sample_writer(void)
{
    gguf_writer_t *w = gguf_writer_new();
    REQUIRE(w != NULL);
    REQUIRE(gguf_writer_set_u8(w, "t.u8", 200) == 0);
    REQUIRE(gguf_writer_set_i8(w, "t.i8", -5) == 0);
    REQUIRE(gguf_writer_set_u16(w, "t.u16", 60000) == 0);
    REQUIRE(gguf_writer_set_i16(w, "t.i16", -300) == 0);
    REQUIRE(gguf_writer_set_u32(w, "t.u32", 4000000000u) == 0);
    REQUIRE(gguf_writer_set_i32(w, "t.i32", -70000) == 0);
    REQUIRE(gguf_writer_set_f32(w, "t.f32", 1.5f) == 0);
    REQUIRE(gguf_writer_set_bool(w, "t.bool", true) == 0);
    REQUIRE(gguf_writer_set_str(w, "t.str", "hello") == 0);
    REQUIRE(gguf_writer_set_u64(w, "t.u64", 123456789012345ull) == 0);
    REQUIRE(gguf_writer_set_i64(w, "t.i64", -123456789012345ll) == 0);
    REQUIRE(gguf_writer_set_f64(w, "t.f64", 0.25) == 0);
    int16_t arr[4] = { -1, 2, -3, 4 };
    REQUIRE(gguf_writer_set_arr(w, "t.arr", GGUF_VT_INT16, arr, 4) == 0);
    const char *strs[3] = { "a", "", "ccc" };
    REQUIRE(gguf_writer_set_arr_str(w, "t.strs", strs, 3) == 0);
    float f[64];
    for (int i = 0; i < 64; i++)
        f[i] = (float)i;
    int64_t ne1[1] = { 64 }, ne2[2] = { 32, 2 };
    REQUIRE(gguf_writer_add_tensor(w, "a", 1, ne1, KERN_F32, f, sizeof(f)) == 0);
    uint8_t q[2 * 20];
    memset(q, 0, sizeof(q));
    REQUIRE(gguf_writer_add_tensor(w, "b.q4_1", 2, ne2, KERN_Q4_1, q, sizeof(q)) == 0);
    return w;
}

static void test_round_trip(void)
{
    gguf_writer_t *w = sample_writer();
    size_t len;
    uint8_t *buf = build(w, &len);
    char err[256] = "";
    gguf_ctx_t *g = gguf_open_buffer(buf, len, err, sizeof(err));
    if (g == NULL)
        fprintf(stderr, "%s\n", err);
    REQUIRE(g != NULL);
    CHECK_INT(gguf_version(g), 3);
    CHECK_INT(gguf_n_kv(g), 14);
    CHECK_INT(gguf_n_tensors(g), 2);
    uint32_t u;
    CHECK_INT(gguf_get_u32(g, "t.u8", &u), 0);
    CHECK_INT(u, 200);
    CHECK_INT(gguf_get_u32(g, "t.u32", &u), 0);
    CHECK_INT(u, 4000000000u);
    CHECK_INT(gguf_get_u32(g, "t.i8", &u), KVD_EFORMAT);   /* negative */
    CHECK_INT(gguf_get_u32(g, "t.u64", &u), KVD_EFORMAT);  /* too large */
    CHECK_INT(gguf_get_u32(g, "t.nope", &u), KVD_ENOTFOUND);
    CHECK_INT(gguf_get_u32(g, "t.str", &u), KVD_EFORMAT);
    float fv;
    CHECK_INT(gguf_get_f32(g, "t.f32", &fv), 0);
    CHECK_NEAR(fv, 1.5, 0);
    CHECK_INT(gguf_get_f32(g, "t.f64", &fv), 0);
    CHECK_NEAR(fv, 0.25, 0);
    bool b = false;
    CHECK_INT(gguf_get_bool(g, "t.bool", &b), 0);
    CHECK(b);
    struct gguf_str s;
    CHECK_INT(gguf_get_str(g, "t.str", &s), 0);
    CHECK(gguf_str_eq(s, "hello"));
    const struct gguf_kv *kv = gguf_find(g, "t.i16");
    REQUIRE(kv != NULL);
    CHECK_INT(kv->type, GGUF_VT_INT16);
    kv = gguf_find(g, "t.i64");
    REQUIRE(kv != NULL);
    int64_t i64;
    memcpy(&i64, kv->data, 8);
    CHECK_INT(i64, -123456789012345ll);
    uint32_t at;
    uint64_t n;
    CHECK_INT(gguf_get_arr(g, "t.arr", &at, &n, &kv), 0);
    CHECK_INT(at, GGUF_VT_INT16);
    CHECK_INT(n, 4);
    CHECK_INT(gguf_arr_int(kv, 0), -1);
    CHECK_INT(gguf_arr_int(kv, 3), 4);
    CHECK_INT(gguf_arr_int(kv, 4), 0);  /* out of range reads as 0 */
    CHECK_INT(gguf_get_arr(g, "t.strs", &at, &n, &kv), 0);
    CHECK_INT(at, GGUF_VT_STRING);
    REQUIRE(n == 3 && kv->strs != NULL);
    CHECK(gguf_str_eq(kv->strs[0], "a"));
    CHECK(gguf_str_eq(kv->strs[1], ""));
    CHECK(gguf_str_eq(kv->strs[2], "ccc"));
    const struct gguf_tensor *t = gguf_find_tensor(g, "a");
    REQUIRE(t != NULL);
    CHECK_INT(t->n_dims, 1);
    CHECK_INT(t->ne[0], 64);
    CHECK_INT(t->nbytes, 256);
    CHECK_INT(((uintptr_t)t->data - (uintptr_t)buf) % gguf_alignment(g), 0);
    float last;
    memcpy(&last, (const uint8_t *)t->data + 63 * 4, 4);
    CHECK_NEAR(last, 63.0, 0);
    t = gguf_find_tensor(g, "b.q4_1");
    REQUIRE(t != NULL);
    CHECK_INT(t->ne[1], 2);
    CHECK_INT(t->nbytes, 40);
    size_t end = (size_t)((const uint8_t *)t->data - buf) + t->nbytes;
    CHECK(gguf_find_tensor(g, "c") == NULL);
    gguf_close(&g);
    CHECK(g == NULL);
    gguf_close(&g);  /* NULL is accepted */

    /* every truncation before the end of the last tensor fails cleanly (the
     * alignment padding after it may go) */
    CHECK(end <= len && end + 32 > len);
    int failures = 0;
    for (size_t cut = 0; cut < end; cut++) {
        uint8_t *part = malloc(cut ? cut : 1);
        memcpy(part, buf, cut);
        gguf_ctx_t *p = gguf_open_buffer(part, cut, err, sizeof(err));
        failures += p == NULL && err[0] != '\0';
        gguf_close(&p);
        free(part);
    }
    CHECK_INT(failures, (long long)end);
    gguf_writer_destroy(&w);
    free(buf);
}

/* Opens a mutated copy and checks the error mentions `needle`. */
static void expect_error(const uint8_t *buf, size_t len, size_t at, const void *bytes, size_t n,
                         const char *needle)
{
    uint8_t *copy = malloc(len);
    memcpy(copy, buf, len);
    memcpy(copy + at, bytes, n);
    char err[256] = "";
    gguf_ctx_t *g = gguf_open_buffer(copy, len, err, sizeof(err));
    CHECK(g == NULL);
    if (strstr(err, needle) == NULL)
        fprintf(stderr, "expected '%s' in: %s\n", needle, err);
    CHECK(strstr(err, needle) != NULL);
    gguf_close(&g);
    free(copy);
}

static size_t find(const uint8_t *buf, size_t len, const char *s)
{
    const uint8_t *p = memmem(buf, len, s, strlen(s));
    REQUIRE(p != NULL);
    return (size_t)(p - buf);
}

static void test_corruption(void)
{
    gguf_writer_t *w = sample_writer();
    size_t len;
    uint8_t *buf = build(w, &len);
    uint32_t u32;
    uint64_t u64;

    expect_error(buf, len, 0, "GGUG", 4, "bad magic");
    u32 = 4;
    expect_error(buf, len, 4, &u32, 4, "version 4");
    u64 = 1ull << 40;
    expect_error(buf, len, 8, &u64, 8, "more than the file holds");   /* tensors */
    expect_error(buf, len, 16, &u64, 8, "more than the file holds");  /* keys */
    /* a string whose length runs past the end */
    size_t key = find(buf, len, "t.str");
    size_t val = key + 5 + 4;  /* key bytes, then the type; then the length */
    u64 = (uint64_t)len;
    expect_error(buf, len, val, &u64, 8, "past the end");
    /* an unknown value type */
    u32 = 77;
    expect_error(buf, len, key + 5, &u32, 4, "unknown value type");
    /* an array of arrays */
    size_t arr = find(buf, len, "t.arr");
    u32 = GGUF_VT_ARRAY;
    expect_error(buf, len, arr + 5 + 4, &u32, 4, "invalid element type");
    /* an array longer than the file */
    u64 = 1ull << 50;
    expect_error(buf, len, arr + 5 + 8, &u64, 8, "past the end");
    /* tensor infos: name "a" then n_dims, ne[0], type, offset */
    size_t ta = find(buf, len, "b.q4_1") - 8 - 8 - 4 - 8 - 4 - 1;  /* back to "a" */
    REQUIRE(buf[ta] == 'a');
    u32 = 5;
    expect_error(buf, len, ta + 1, &u32, 4, "5 dimensions");
    u64 = 0;
    expect_error(buf, len, ta + 5, &u64, 8, "invalid dimension");
    u32 = 99;
    expect_error(buf, len, ta + 13, &u32, 4, "unknown type id 99");
    u64 = 3;
    expect_error(buf, len, ta + 17, &u64, 8, "not aligned");
    u64 = 1ull << 30;
    expect_error(buf, len, ta + 17, &u64, 8, "past the end of the file");
    u64 = 30;  /* a row of 30 is not a whole number of Q4_1 blocks */
    size_t tb = find(buf, len, "b.q4_1") + 6;
    expect_error(buf, len, tb + 4, &u64, 8, "not a multiple");
    /* duplicate names: rename "b.q4_1" to "c.q4_1", then "b" to "c" would
     * need equal lengths; instead name the second tensor like the first */
    gguf_writer_destroy(&w);
    free(buf);
    w = gguf_writer_new();
    float f[32] = { 0 };
    int64_t ne[1] = { 32 };
    REQUIRE(gguf_writer_add_tensor(w, "xa", 1, ne, KERN_F32, f, sizeof(f)) == 0);
    REQUIRE(gguf_writer_add_tensor(w, "xb", 1, ne, KERN_F32, f, sizeof(f)) == 0);
    buf = build(w, &len);
    expect_error(buf, len, find(buf, len, "xb"), "xa", 2, "appears twice");
    gguf_writer_destroy(&w);
    free(buf);

    /* general.alignment must be a power of two */
    w = gguf_writer_new();
    REQUIRE(gguf_writer_set_u32(w, "general.alignment", 64) == 0);
    buf = build(w, &len);
    u32 = 24;
    expect_error(buf, len, find(buf, len, "general.alignment") + 17 + 4, &u32, 4, "power-of-two");
    char err[256] = "";
    gguf_ctx_t *g;
    gguf_writer_destroy(&w);
    free(buf);

    /* a file that is not there, or too short */
    g = gguf_open("/nonexistent/model.gguf", err, sizeof(err));
    CHECK(g == NULL);
    CHECK(strstr(err, "cannot open") != NULL);
}

/* Model-level checks: architecture, tensor types, shapes, truncation. */
static void test_model_errors(void)
{
    char dir[] = "/tmp/kvd-test-gguf-XXXXXX", path[128], err[256];
    REQUIRE(mkdtemp(dir) != NULL);
    snprintf(path, sizeof(path), "%s/m.gguf", dir);

    struct mkmodel_params p = mkmodel_default_params();
    gguf_writer_t *w = NULL;
    REQUIRE(mkmodel_build(&p, &w, err, sizeof(err)) == 0);
    REQUIRE(gguf_writer_set_str(w, "general.architecture", "gpt9") == 0);
    REQUIRE(gguf_writer_write_file(w, path, err, sizeof(err)) == 0);
    gguf_writer_destroy(&w);
    model_t *m = model_load(path, err, sizeof(err));
    CHECK(m == NULL);
    CHECK(strstr(err, "architecture 'gpt9' is not supported") != NULL);

    /* a tensor type kvd does not compute with: retype blk.0.ffn_up.weight
     * from Q4_1 to IQ4_NL (same block length, smaller blocks: still inside
     * the file) */
    p = mkmodel_default_params();
    REQUIRE(mkmodel_build(&p, &w, err, sizeof(err)) == 0);
    size_t len;
    uint8_t *buf = build(w, &len);
    gguf_writer_destroy(&w);
    size_t at = find(buf, len, "blk.0.ffn_up.weight") + strlen("blk.0.ffn_up.weight") + 4 + 16;
    uint32_t ty;
    memcpy(&ty, buf + at, 4);
    CHECK_INT(ty, KERN_Q4_1);
    ty = 20;  /* IQ4_NL */
    memcpy(buf + at, &ty, 4);
    gguf_ctx_t *g = gguf_open_buffer(buf, len, err, sizeof(err));
    REQUIRE(g != NULL);
    m = model_from_gguf(&g, err, sizeof(err));
    CHECK(m == NULL && g == NULL);
    CHECK(strstr(err, "blk.0.ffn_up.weight has type IQ4_NL, which kvd does not support") != NULL);
    free(buf);

    /* a model that loads */
    REQUIRE(mkmodel_write(&p, path, err, sizeof(err)) == 0);
    m = model_load(path, err, sizeof(err));
    REQUIRE(m != NULL);
    CHECK_INT(m->cfg.n_layer, p.n_layer);
    CHECK_INT(m->cfg.n_head_kv, p.n_head_kv);
    CHECK(m->output.data == m->tok_embd.data);  /* tied */
    model_destroy(&m);
    CHECK(m == NULL);

    /* truncated: half the file */
    FILE *f = fopen(path, "rb+");
    REQUIRE(f != NULL);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    REQUIRE(truncate(path, size / 2) == 0);
    m = model_load(path, err, sizeof(err));
    CHECK(m == NULL);
    CHECK(strstr(err, "m.gguf") != NULL);  /* names the file */
    CHECK(strstr(err, "past the end of the file") != NULL || strstr(err, "truncated") != NULL);

    char cmd[200];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

int main(void)
{
    test_round_trip();
    test_corruption();
    test_model_errors();
    return CHECK_DONE();
}
