/*
 * fuzz_gguf.c - the GGUF reader, and everything that trusts it, on arbitrary
 * bytes: parse, read every key and tensor, then try to build a model and a
 * tokenizer from it. Anything but a clean error or success is a bug.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "gguf.h"
#include "model.h"
#include "tok.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];
    gguf_ctx_t *g = gguf_open_buffer(data, size, err, sizeof(err));
    if (g == NULL)
        return 0;
    volatile uint64_t sink = 0;
    for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
        const struct gguf_kv *kv = gguf_kv_at(g, i);
        sink += kv->key.len;
        if (kv->type == GGUF_VT_ARRAY && kv->arr_type != GGUF_VT_STRING && kv->arr_len > 0)
            sink += (uint64_t)gguf_arr_int(kv, kv->arr_len - 1);
        if (kv->strs != NULL && kv->arr_len > 0)
            sink += kv->strs[kv->arr_len - 1].len;
    }
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        if (t->nbytes > 0)
            sink += ((const uint8_t *)t->data)[t->nbytes - 1];
    }
    tok_t *tok = tok_new_from_gguf(g, err, sizeof(err));
    if (tok != NULL) {
        int32_t ids[64];
        size_t n;
        static const char text[] = "Hello, world! 123 <|im_start|>user\n\xea\xb0\x80 \xf0\x9f\x98\x80";
        if (tok_encode(tok, text, sizeof(text) - 1, true, ids, 64, &n) == 0)
            sink += n;
        tok_destroy(&tok);
    }
    model_t *m = model_from_gguf(&g, err, sizeof(err));  /* takes g */
    model_destroy(&m);
    (void)sink;
    return 0;
}
