/*
 * mkmodel.c - random llama GGUF models for tests (see mkmodel.h).
 *
 * Three parts: the vocabulary (byte tokens, BPE merges learned from a small
 * built-in text, then random merges), the weights (uniform random floats of
 * std 1/sqrt(fan_in) quantized with kern_quantize_row; each tensor's random
 * stream is seeded from the model seed and the tensor name, so tensors do
 * not depend on each other), and the metadata llama.cpp reads.
 */
#include "mkmodel.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "quant.h"
#include "types.h"

#define MAX_TOKEN_BYTES 24      /* longest random merged token */

static const char smollm2_template[] =
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/* The text the first merges are learned from: plain English, a few numbers
 * and some punctuation, so that the merges look like a real tokenizer's. */
static const char corpus[] =
    "The cache keeps the keys and values of every token that the model has already seen, "
    "so the next step only has to compute one new token and then read what is stored. "
    "When many people send the same long system prompt, the server can share those blocks "
    "instead of computing them again. This is why a serving system that remembers its "
    "prefixes can answer faster and use less memory than one that starts from the beginning "
    "every time. A block holds a fixed number of tokens, and a table maps the blocks of each "
    "sequence to places in a shared pool. If the pool is full, the oldest unused blocks are "
    "evicted first, and a request that finds its prefix in the cache skips that part of the "
    "work.\n"
    "In the morning the weather was cold and clear, and the children walked to the school by "
    "the river. They talked about the books they had read, the games they would play and the "
    "things they wanted to learn. The teacher asked them to write a short story about a "
    "journey, and most of them wrote about the sea, the mountains, or the city where they "
    "were born. One of them wrote about a small boat that sailed around the world and came "
    "back home with a letter for her mother.\n"
    "Numbers such as 2024, 100 and 3.14 appear in text too, as do questions? Yes! "
    "And quotes: \"hello, world\". Isn't it? We'll see, they're here.\n";

/* ---- random numbers ------------------------------------------------------------ */

struct rng {
    uint64_t s;                 /* splitmix64 state */
};

static uint64_t rng_u64(struct rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static float rng_sym(struct rng *r)
{
    return (float)((double)(rng_u64(r) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static uint64_t fnv1a(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static struct rng rng_for(uint64_t seed, const char *what)
{
    struct rng r = { seed ^ fnv1a(what, strlen(what)) };
    rng_u64(&r);
    return r;
}

/* ---- vocabulary ------------------------------------------------------------------ */

struct vocab {
    char **tok;                 /* n token strings (UTF-8), owned */
    int32_t *type;              /* n token types (1 normal, 3 control) */
    uint32_t n, cap;            /* tokens, room (= n_vocab) */
    char **merges;              /* n_merges "left right" strings, owned */
    uint32_t n_merges;
    int32_t *set;               /* open-addressed token ids by text, -1 empty */
    uint32_t set_mask;          /* set size - 1 (a power of two minus one) */
};

static int32_t vocab_find(const struct vocab *v, const char *s, size_t len)
{
    for (uint32_t i = (uint32_t)fnv1a(s, len) & v->set_mask;; i = (i + 1) & v->set_mask) {
        int32_t id = v->set[i];
        if (id < 0)
            return -1;
        if (strlen(v->tok[id]) == len && memcmp(v->tok[id], s, len) == 0)
            return id;
    }
}

/* Adds s (taking ownership) as the next token; the caller checked it is new
 * and that there is room. */
static void vocab_add(struct vocab *v, char *s, int32_t type)
{
    const int32_t id = (int32_t)v->n++;
    v->tok[id] = s;
    v->type[id] = type;
    uint32_t i = (uint32_t)fnv1a(s, strlen(s)) & v->set_mask;
    while (v->set[i] >= 0)
        i = (i + 1) & v->set_mask;
    v->set[i] = id;
}

static void vocab_free(struct vocab *v)
{
    for (uint32_t i = 0; i < v->n; i++)
        free(v->tok[i]);
    for (uint32_t i = 0; i < v->n_merges; i++)
        free(v->merges[i]);
    free(v->tok);
    free(v->type);
    free(v->merges);
    free(v->set);
    memset(v, 0, sizeof(*v));
}

static int vocab_init(struct vocab *v, uint32_t n_vocab)
{
    memset(v, 0, sizeof(*v));
    uint32_t sz = 16;
    while (sz < 2 * n_vocab)
        sz *= 2;
    v->cap = n_vocab;
    v->tok = calloc(n_vocab, sizeof(*v->tok));
    v->type = calloc(n_vocab, sizeof(*v->type));
    v->merges = calloc(n_vocab, sizeof(*v->merges));
    v->set = malloc(sz * sizeof(*v->set));
    v->set_mask = sz - 1;
    if (v->tok == NULL || v->type == NULL || v->merges == NULL || v->set == NULL) {
        vocab_free(v);
        return KVD_ENOMEM;
    }
    memset(v->set, 0xff, sz * sizeof(*v->set));
    return 0;
}

/* GPT-2's byte-to-unicode map: printable Latin-1 bytes stand for
 * themselves, the others (controls, space, 0x7f-0xa0, 0xad) for 256, 257,
 * ... in byte order. */
static bool byte_is_printable(int b)
{
    return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
}

static uint32_t byte_to_codepoint(int b)
{
    if (byte_is_printable(b))
        return (uint32_t)b;
    uint32_t k = 0;
    for (int c = 0; c < b; c++)
        k += !byte_is_printable(c);
    return 256 + k;
}

/* Code points here are below 0x800: one or two UTF-8 bytes. */
static char *utf8_of(uint32_t cp)
{
    char *s = malloc(3);
    if (s == NULL)
        return NULL;
    if (cp < 0x80) {
        s[0] = (char)cp;
        s[1] = 0;
    } else {
        s[0] = (char)(0xc0 | (cp >> 6));
        s[1] = (char)(0x80 | (cp & 0x3f));
        s[2] = 0;
    }
    return s;
}

/* Adds the merge of tokens a and b (whose concatenation is new). */
static int vocab_merge(struct vocab *v, int32_t a, int32_t b)
{
    const size_t la = strlen(v->tok[a]), lb = strlen(v->tok[b]);
    char *t = malloc(la + lb + 1);
    char *m = malloc(la + lb + 2);
    if (t == NULL || m == NULL) {
        free(t);
        free(m);
        return KVD_ENOMEM;
    }
    memcpy(t, v->tok[a], la);
    memcpy(t + la, v->tok[b], lb + 1);
    memcpy(m, v->tok[a], la);
    m[la] = ' ';
    memcpy(m + la + 1, v->tok[b], lb + 1);
    v->merges[v->n_merges++] = m;
    vocab_add(v, t, 1);
    return 0;
}

/* True when the concatenation of tokens a and b is already a token. */
static bool merge_exists(const struct vocab *v, int32_t a, int32_t b)
{
    char buf[256];
    const size_t la = strlen(v->tok[a]), lb = strlen(v->tok[b]);
    if (la + lb > sizeof(buf))
        return true;            /* never merge into something that long */
    memcpy(buf, v->tok[a], la);
    memcpy(buf + la, v->tok[b], lb);
    return vocab_find(v, buf, la + lb) >= 0;
}

/* -- BPE training on the corpus -- */

struct word {
    int32_t *sym;               /* len token ids */
    int len;                    /* symbols left */
    int count;                  /* occurrences in the corpus */
};

enum { CL_LETTER, CL_DIGIT, CL_SPACE, CL_NL, CL_OTHER };

static int char_class(unsigned char c)
{
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80)
        return CL_LETTER;
    if (c >= '0' && c <= '9')
        return CL_DIGIT;
    if (c == ' ')
        return CL_SPACE;
    if (c == '\n')
        return CL_NL;
    return CL_OTHER;
}

/* Splits the corpus into pieces like GPT-2's pre-tokenizer does (roughly:
 * an optional leading space plus a run of letters, digits or punctuation)
 * and collects the distinct pieces with their counts. */
static int corpus_words(struct word **out, int *n_out)
{
    const size_t n = sizeof(corpus) - 1;
    struct word *w = calloc(n, sizeof(*w));
    if (w == NULL)
        return KVD_ENOMEM;
    int nw = 0;
    for (size_t i = 0; i < n;) {
        size_t start = i;
        int cl = char_class((unsigned char)corpus[i]);
        if (cl == CL_SPACE && i + 1 < n && char_class((unsigned char)corpus[i + 1]) != CL_SPACE &&
            char_class((unsigned char)corpus[i + 1]) != CL_NL) {
            i++;
            cl = char_class((unsigned char)corpus[i]);
        }
        while (i < n && char_class((unsigned char)corpus[i]) == cl)
            i++;
        const int len = (int)(i - start);
        int k;
        for (k = 0; k < nw; k++) {
            bool same = w[k].len == len;
            for (int j = 0; j < len && same; j++)
                same = w[k].sym[j] == MKMODEL_N_SPECIAL + (unsigned char)corpus[start + (size_t)j];
            if (same)
                break;
        }
        if (k < nw) {
            w[k].count++;
            continue;
        }
        w[nw].sym = malloc((size_t)len * sizeof(int32_t));
        if (w[nw].sym == NULL) {
            for (int j = 0; j < nw; j++)
                free(w[j].sym);
            free(w);
            return KVD_ENOMEM;
        }
        for (int j = 0; j < len; j++)
            w[nw].sym[j] = MKMODEL_N_SPECIAL + (unsigned char)corpus[start + (size_t)j];
        w[nw].len = len;
        w[nw].count = 1;
        nw++;
    }
    *out = w;
    *n_out = nw;
    return 0;
}

#define PAIR_SLOTS 8192         /* > 2x the distinct pairs the corpus can hold */

struct pair_slot {
    uint64_t key;               /* left << 32 | right; 0 = empty (ids are >= 3) */
    int count;                  /* weighted occurrences */
};

static void pair_add(struct pair_slot *t, uint64_t key, int count)
{
    uint32_t i = (uint32_t)fnv1a(&key, sizeof(key)) & (PAIR_SLOTS - 1);
    while (t[i].key != 0 && t[i].key != key)
        i = (i + 1) & (PAIR_SLOTS - 1);
    t[i].key = key;
    t[i].count += count;
}

/* Learns merges from the corpus until the vocabulary is full or no pair
 * occurs twice. The most frequent pair wins; ties go to the smaller ids. */
static int train_merges(struct vocab *v)
{
    struct word *w;
    int nw, rc;
    if ((rc = corpus_words(&w, &nw)))
        return rc;
    struct pair_slot *t = malloc(PAIR_SLOTS * sizeof(*t));
    if (t == NULL) {
        rc = KVD_ENOMEM;
        goto out;
    }
    while (v->n < v->cap) {
        memset(t, 0, PAIR_SLOTS * sizeof(*t));
        for (int k = 0; k < nw; k++)
            for (int j = 0; j + 1 < w[k].len; j++)
                pair_add(t, (uint64_t)w[k].sym[j] << 32 | (uint32_t)w[k].sym[j + 1], w[k].count);
        uint64_t best = 0;
        int best_count = 1;
        for (int i = 0; i < PAIR_SLOTS; i++) {
            if (t[i].key == 0 || t[i].count < best_count)
                continue;
            if (t[i].count == best_count && (best == 0 || t[i].key > best))
                continue;
            if (merge_exists(v, (int32_t)(t[i].key >> 32), (int32_t)(uint32_t)t[i].key))
                continue;
            best = t[i].key;
            best_count = t[i].count;
        }
        if (best == 0 || best_count < 2)
            break;
        const int32_t a = (int32_t)(best >> 32), b = (int32_t)(uint32_t)best;
        if ((rc = vocab_merge(v, a, b)))
            goto out;
        const int32_t m = (int32_t)v->n - 1;
        for (int k = 0; k < nw; k++) {
            int o = 0;
            for (int j = 0; j < w[k].len; j++) {
                if (j + 1 < w[k].len && w[k].sym[j] == a && w[k].sym[j + 1] == b) {
                    w[k].sym[o++] = m;
                    j++;
                } else {
                    w[k].sym[o++] = w[k].sym[j];
                }
            }
            w[k].len = o;
        }
    }
    rc = 0;
out:
    free(t);
    for (int k = 0; k < nw; k++)
        free(w[k].sym);
    free(w);
    return rc;
}

/* Fills the vocabulary up to n_vocab with merges of random earlier tokens. */
static int random_merges(struct vocab *v, uint64_t seed)
{
    struct rng r = rng_for(seed, "vocab");
    uint64_t tries = 0;
    while (v->n < v->cap) {
        if (++tries > 1000ull * v->cap + 100000)
            return KVD_ENOMEM;  /* cannot happen for the sizes allowed */
        const uint32_t span = v->n - MKMODEL_N_SPECIAL;
        const int32_t a = MKMODEL_N_SPECIAL + (int32_t)(rng_u64(&r) % span);
        const int32_t b = MKMODEL_N_SPECIAL + (int32_t)(rng_u64(&r) % span);
        if (strlen(v->tok[a]) + strlen(v->tok[b]) > MAX_TOKEN_BYTES || merge_exists(v, a, b))
            continue;
        int rc = vocab_merge(v, a, b);
        if (rc)
            return rc;
    }
    return 0;
}

static int vocab_build(struct vocab *v, uint32_t n_vocab, uint64_t seed)
{
    static const char *const special[MKMODEL_N_SPECIAL] = { "<|endoftext|>", "<|im_start|>", "<|im_end|>" };
    int rc = vocab_init(v, n_vocab);
    if (rc)
        return rc;
    for (int i = 0; i < MKMODEL_N_SPECIAL; i++) {
        char *s = strdup(special[i]);
        if (s == NULL)
            goto oom;
        vocab_add(v, s, 3);
    }
    for (int b = 0; b < 256; b++) {
        char *s = utf8_of(byte_to_codepoint(b));
        if (s == NULL)
            goto oom;
        vocab_add(v, s, 1);
    }
    if ((rc = train_merges(v)) || (rc = random_merges(v, seed))) {
        vocab_free(v);
        return rc;
    }
    return 0;
oom:
    vocab_free(v);
    return KVD_ENOMEM;
}

/* ---- weights ---------------------------------------------------------------------- */

/* A [ne0, ne1] matrix of uniform random values with std 1/sqrt(ne0)
 * (ne0 is the input dimension), quantized to type. */
static int add_matrix(gguf_writer_t *w, const char *name, uint32_t type, int64_t ne0, int64_t ne1,
                      uint64_t seed)
{
    struct rng r = rng_for(seed, name);
    const size_t rb = kern_row_bytes(type, ne0);
    uint8_t *data = malloc(rb * (size_t)ne1);
    float *row = malloc((size_t)ne0 * sizeof(float));
    int rc = KVD_ENOMEM;
    if (data == NULL || row == NULL)
        goto out;
    const float amp = sqrtf(3.0f / (float)ne0);
    for (int64_t i = 0; i < ne1; i++) {
        for (int64_t j = 0; j < ne0; j++)
            row[j] = amp * rng_sym(&r);
        if ((rc = kern_quantize_row(type, row, data + rb * (size_t)i, ne0)))
            goto out;
    }
    const int64_t ne[2] = { ne0, ne1 };
    rc = gguf_writer_add_tensor(w, name, 2, ne, type, data, rb * (size_t)ne1);
out:
    free(data);
    free(row);
    return rc;
}

/* A norm weight: n values 1.0 +- 0.1, F32. */
static int add_norm(gguf_writer_t *w, const char *name, int64_t n, uint64_t seed)
{
    struct rng r = rng_for(seed, name);
    float *x = malloc((size_t)n * sizeof(float));
    if (x == NULL)
        return KVD_ENOMEM;
    for (int64_t i = 0; i < n; i++)
        x[i] = 1.0f + 0.1f * rng_sym(&r);
    int rc = gguf_writer_add_tensor(w, name, 1, &n, KERN_F32, x, (size_t)n * sizeof(float));
    free(x);
    return rc;
}

/* ---- parameters --------------------------------------------------------------------- */

struct mkmodel_params mkmodel_default_params(void)
{
    struct mkmodel_params p = {
        .n_layer = 2,
        .n_embd = 64,
        .n_head = 4,
        .n_head_kv = 2,
        .n_ff = 128,
        .n_vocab = 512,
        .n_ctx = 256,
        .rope_freq_base = 10000.0f,
        .rms_eps = 1e-5f,
        .wtype = KERN_Q4_1,
        .embd_type = KERN_Q8_0,
        .tied = true,
        .seed = 1,
        .chat_template = NULL,
    };
    return p;
}

const char *mkmodel_default_chat_template(void) { return smollm2_template; }

static bool writable_type(uint32_t t)
{
    switch (t) {
    case KERN_F32: case KERN_F16: case KERN_BF16: case KERN_Q4_0: case KERN_Q4_1:
    case KERN_Q5_0: case KERN_Q5_1: case KERN_Q8_0: case KERN_Q4_K: case KERN_Q5_K: case KERN_Q6_K:
        return true;
    default:
        return false;
    }
}

static const char *type_name(uint32_t t)
{
    const struct kern_type_info *ti = kern_type_info(t);
    return ti != NULL ? ti->name : "unknown";
}

int mkmodel_check(const struct mkmodel_params *p, char *err, size_t errlen)
{
    if (p == NULL)
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: no parameters");
    if (p->n_layer < 1 || p->n_layer > 512)
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: layers must be 1..512, not %u", p->n_layer);
    if (p->n_embd < 1 || p->n_embd > 65536)
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: embedding size must be 1..65536, not %u", p->n_embd);
    if (p->n_ff < 1 || p->n_ff > 262144)
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: feed-forward size must be 1..262144, not %u", p->n_ff);
    if (p->gemma3 && p->head_dim != 0) {
        if (p->n_head < 1 || p->head_dim % 2 != 0 || p->head_dim > 512 ||
            ((uint64_t)p->n_head * p->head_dim) % kern_type_info(p->wtype)->block_elems != 0)
            return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: head width %u must be even, at most 512, and "
                              "heads x width a whole number of weight blocks", p->head_dim);
    } else if (p->n_head < 1 || p->n_embd % p->n_head != 0 || (p->n_embd / p->n_head) % 2 != 0) {
        return kvd_seterr(err, errlen, KVD_EINVAL,
                          "mkmodel: %u heads must divide the embedding size %u into an even head dim",
                          p->n_head, p->n_embd);
    }
    if (p->gemma3 && p->swa_window < 1)
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: a gemma3 model needs a sliding window");
    if (p->n_head_kv < 1 || p->n_head % p->n_head_kv != 0)
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: %u KV heads must divide %u heads",
                          p->n_head_kv, p->n_head);
    if (p->n_vocab < MKMODEL_MIN_VOCAB || p->n_vocab > (1u << 20))
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: vocabulary must be %u..%u tokens, not %u",
                          MKMODEL_MIN_VOCAB, 1u << 20, p->n_vocab);
    if (p->n_ctx < 1)
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: context length must be at least 1");
    if (!(p->rope_freq_base > 0.0f) || !isfinite(p->rope_freq_base) || !(p->rms_eps > 0.0f) ||
        !isfinite(p->rms_eps))
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: rope base and rms epsilon must be positive");
    if (!writable_type(p->wtype))
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: cannot write weights of type %s",
                          type_name(p->wtype));
    if (!writable_type(p->embd_type))
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: cannot write embeddings of type %s",
                          type_name(p->embd_type));
    const uint32_t wb = kern_type_info(p->wtype)->block_elems;
    const uint32_t eb = kern_type_info(p->embd_type)->block_elems;
    if (p->n_embd % wb != 0 || p->n_ff % wb != 0)
        return kvd_seterr(err, errlen, KVD_EINVAL,
                          "mkmodel: %s needs embedding size (%u) and feed-forward size (%u) to be multiples of %u",
                          type_name(p->wtype), p->n_embd, p->n_ff, wb);
    if (p->n_embd % eb != 0)
        return kvd_seterr(err, errlen, KVD_EINVAL,
                          "mkmodel: %s embeddings need an embedding size (%u) that is a multiple of %u",
                          type_name(p->embd_type), p->n_embd, eb);
    return 0;
}

/* llama.cpp's general.file_type for a model whose layers are of type t. */
static uint32_t file_type_of(uint32_t t)
{
    switch (t) {
    case KERN_F32: return 0;
    case KERN_F16: return 1;
    case KERN_Q4_0: return 2;
    case KERN_Q4_1: return 3;
    case KERN_Q8_0: return 7;
    case KERN_Q5_0: return 8;
    case KERN_Q5_1: return 9;
    case KERN_Q4_K: return 14;  /* Q4_K_S */
    case KERN_Q5_K: return 16;  /* Q5_K_S */
    case KERN_Q6_K: return 18;
    case KERN_BF16: return 32;
    default: return 0;
    }
}

/* ---- the model ------------------------------------------------------------------------- */

static uint32_t head_dim_of(const struct mkmodel_params *p)
{
    return p->gemma3 && p->head_dim ? p->head_dim : p->n_embd / p->n_head;
}

static int add_metadata(gguf_writer_t *w, const struct mkmodel_params *p, const struct vocab *v)
{
    const uint32_t hd = head_dim_of(p);
    const char *arch = p->gemma3 ? "gemma3" : "llama";
    char key[96];
#define KEY(name) (snprintf(key, sizeof(key), "%s." name, arch), key)
    int rc = 0;
    rc = rc ? rc : gguf_writer_set_str(w, "general.architecture", arch);
    rc = rc ? rc : gguf_writer_set_str(w, "general.name", p->gemma3 ? "kvd random gemma3" : "kvd random llama");
    rc = rc ? rc : gguf_writer_set_u32(w, "general.file_type", file_type_of(p->wtype));
    rc = rc ? rc : gguf_writer_set_u32(w, "general.quantization_version", 2);
    rc = rc ? rc : gguf_writer_set_u32(w, KEY("block_count"), p->n_layer);
    rc = rc ? rc : gguf_writer_set_u32(w, KEY("context_length"), p->n_ctx);
    rc = rc ? rc : gguf_writer_set_u32(w, KEY("embedding_length"), p->n_embd);
    rc = rc ? rc : gguf_writer_set_u32(w, KEY("feed_forward_length"), p->n_ff);
    rc = rc ? rc : gguf_writer_set_u32(w, KEY("attention.head_count"), p->n_head);
    rc = rc ? rc : gguf_writer_set_u32(w, KEY("attention.head_count_kv"), p->n_head_kv);
    rc = rc ? rc : gguf_writer_set_f32(w, KEY("rope.freq_base"), p->rope_freq_base);
    rc = rc ? rc : gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), p->rms_eps);
    rc = rc ? rc : gguf_writer_set_u32(w, KEY("rope.dimension_count"), hd);
    rc = rc ? rc : gguf_writer_set_u32(w, KEY("vocab_size"), p->n_vocab);
    if (p->gemma3) {
        rc = rc ? rc : gguf_writer_set_u32(w, KEY("attention.key_length"), hd);
        rc = rc ? rc : gguf_writer_set_u32(w, KEY("attention.value_length"), hd);
        rc = rc ? rc : gguf_writer_set_u32(w, KEY("attention.sliding_window"), p->swa_window);
    }
#undef KEY

    rc = rc ? rc : gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    rc = rc ? rc : gguf_writer_set_str(w, "tokenizer.ggml.pre", "default");
    rc = rc ? rc : gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)v->tok, v->n);
    rc = rc ? rc : gguf_writer_set_arr(w, "tokenizer.ggml.token_type", GGUF_VT_INT32, v->type, v->n);
    rc = rc ? rc : gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", (const char *const *)v->merges,
                                           v->n_merges);
    rc = rc ? rc : gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    rc = rc ? rc : gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    rc = rc ? rc : gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    rc = rc ? rc : gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", 2);
    rc = rc ? rc : gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", false);
    rc = rc ? rc : gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", false);
    rc = rc ? rc : gguf_writer_set_str(w, "tokenizer.chat_template",
                                       p->chat_template ? p->chat_template : smollm2_template);
    return rc;
}

static int add_weights(gguf_writer_t *w, const struct mkmodel_params *p)
{
    const int64_t E = p->n_embd, F = p->n_ff, V = p->n_vocab;
    const int64_t hd = head_dim_of(p), Q = p->n_head * hd, KV = p->n_head_kv * hd;
    const uint64_t s = p->seed;
    int rc = add_matrix(w, "token_embd.weight", p->embd_type, E, V, s);
    char name[GGUF_WRITER_MAX_NAME + 1];
#define BLK(suffix) (snprintf(name, sizeof(name), "blk.%u." suffix, l), name)
    for (uint32_t l = 0; l < p->n_layer && rc == 0; l++) {
        rc = rc ? rc : add_norm(w, BLK("attn_norm.weight"), E, s);
        rc = rc ? rc : add_matrix(w, BLK("attn_q.weight"), p->wtype, E, Q, s);
        rc = rc ? rc : add_matrix(w, BLK("attn_k.weight"), p->wtype, E, KV, s);
        rc = rc ? rc : add_matrix(w, BLK("attn_v.weight"), p->wtype, E, KV, s);
        rc = rc ? rc : add_matrix(w, BLK("attn_output.weight"), p->wtype, Q, E, s);
        rc = rc ? rc : add_norm(w, BLK("ffn_norm.weight"), E, s);
        rc = rc ? rc : add_matrix(w, BLK("ffn_gate.weight"), p->wtype, E, F, s);
        rc = rc ? rc : add_matrix(w, BLK("ffn_up.weight"), p->wtype, E, F, s);
        rc = rc ? rc : add_matrix(w, BLK("ffn_down.weight"), p->wtype, F, E, s);
        if (p->gemma3) {
            rc = rc ? rc : add_norm(w, BLK("attn_q_norm.weight"), hd, s);
            rc = rc ? rc : add_norm(w, BLK("attn_k_norm.weight"), hd, s);
            rc = rc ? rc : add_norm(w, BLK("post_attention_norm.weight"), E, s);
            rc = rc ? rc : add_norm(w, BLK("post_ffw_norm.weight"), E, s);
        }
    }
#undef BLK
    rc = rc ? rc : add_norm(w, "output_norm.weight", E, s);
    if (!p->tied)
        rc = rc ? rc : add_matrix(w, "output.weight", p->embd_type, E, V, s);
    return rc;
}

int mkmodel_build(const struct mkmodel_params *p, gguf_writer_t **out, char *err, size_t errlen)
{
    int rc = mkmodel_check(p, err, errlen);
    if (rc)
        return rc;
    if (out == NULL)
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: no output writer");
    *out = NULL;
    struct vocab v;
    if ((rc = vocab_build(&v, p->n_vocab, p->seed)))
        return kvd_seterr(err, errlen, rc, "mkmodel: building the vocabulary: %s", kvd_strerror(rc));
    gguf_writer_t *w = gguf_writer_new();
    if (w == NULL) {
        rc = KVD_ENOMEM;
    } else {
        rc = add_metadata(w, p, &v);
        rc = rc ? rc : add_weights(w, p);
    }
    vocab_free(&v);
    if (rc) {
        gguf_writer_destroy(&w);
        return kvd_seterr(err, errlen, rc, "mkmodel: building the model: %s", kvd_strerror(rc));
    }
    *out = w;
    return 0;
}

int mkmodel_write(const struct mkmodel_params *p, const char *path, char *err, size_t errlen)
{
    if (path == NULL)
        return kvd_seterr(err, errlen, KVD_EINVAL, "mkmodel: no output path");
    gguf_writer_t *w = NULL;
    int rc = mkmodel_build(p, &w, err, errlen);
    if (rc)
        return rc;
    rc = gguf_writer_write_file(w, path, err, errlen);
    gguf_writer_destroy(&w);
    return rc;
}
