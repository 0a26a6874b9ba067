/*
 * tok.c - GPT-2 byte-level BPE and SentencePiece BPE tokenizers (see tok.h).
 *
 * Layout: every token keeps three byte strings in three blobs: its text (as
 * the vocabulary spells it, "Ġthe" or "▁the"), its raw bytes (" the"; GPT2
 * only, for texts made entirely of byte-level characters) and its piece (what
 * decoding writes). Two hash tables map text -> id and raw bytes -> id; a
 * third maps a pair of token ids to the rank of their merge and the id of the
 * result, so BPE works on ids and never builds strings. SPM needs no merge
 * table: a pair merges when its concatenation is a token, which the text
 * table answers (adjacent symbols are adjacent bytes of one buffer), and the
 * token's score orders the merges.
 *
 * Matching llama.cpp: the pre-tokenizers below are written from the regexes
 * llama.cpp uses for each tokenizer.ggml.pre name, with llama.cpp's reading
 * of them (digit pre-splits, lookahead that stops at the end of a fragment,
 * \s as White_Space). Text is decoded as leniently as llama.cpp decodes it
 * and re-encoded before BPE: each undecodable byte becomes U+FFFD, an
 * overlong form becomes the shortest one.
 */
#include "tok.h"

#include "err.h"
#include "unicode.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- pre-tokenizers ------------------------------------------------------ */

enum pre_kind {
    PRE_DEFAULT,    /* llama.cpp's fallback: punctuation runs, GPT-2, digit runs, digit triples */
    PRE_GPT2,       /* the GPT-2 regex alone */
    PRE_SMOLLM,     /* each \p{N} alone, then GPT-2 (starcoder family) */
    PRE_LLAMA3,     /* the llama3 regex: \p{N}{1,3}, newline runs, any-case contractions */
};

struct pre_info {
    const char *name;           /* tokenizer.ggml.pre value */
    enum pre_kind kind;         /* splitting rules */
    bool ignore_merges;         /* a word that is a token is emitted whole */
    bool add_bos;               /* default when add_bos_token is absent */
};

static const struct pre_info pre_table[] = {
    {"default", PRE_DEFAULT, false, false},
    {"gpt-2", PRE_GPT2, false, false},
    {"phi-2", PRE_GPT2, false, false},
    {"mpt", PRE_GPT2, false, false},
    {"olmo", PRE_GPT2, false, false},
    {"smollm", PRE_SMOLLM, false, false},
    {"starcoder", PRE_SMOLLM, false, false},
    {"refact", PRE_SMOLLM, false, false},
    {"command-r", PRE_SMOLLM, false, false},
    {"codeshell", PRE_SMOLLM, false, false},
    {"exaone", PRE_SMOLLM, false, false},
    {"minerva-7b", PRE_SMOLLM, false, false},
    {"llama3", PRE_LLAMA3, true, true},
    {"llama-v3", PRE_LLAMA3, true, true},
    {"llama-bpe", PRE_LLAMA3, true, true},
    {"falcon3", PRE_LLAMA3, true, true},
    {"dbrx", PRE_LLAMA3, false, false},
    {"smaug-bpe", PRE_LLAMA3, false, false},
};

/* Texts that end generation (llama.cpp's list); such tokens become CONTROL. */
static const char *const eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    /* fill-in-the-middle pad / repo / file separators, which llama.cpp also stops on */
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>",
    "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
    "</s>",     /* llama.cpp stops on it (and makes it CONTROL) in every vocabulary */
};

/* Texts that name the end-of-turn token when tokenizer.ggml.eot_token_id is
 * absent, in order of preference. */
static const char *const eot_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>",
};

/* ---- the tokenizer ------------------------------------------------------- */

#define NO_RAW UINT32_MAX       /* raw_len of a text that is not byte-level */
#define N_BYTE_CPS 324          /* code points bytes_to_unicode uses: < 256 + 68 */

struct tok_entry {
    uint32_t text_off;          /* into text blob */
    uint32_t text_len;          /* bytes */
    uint32_t raw_off;           /* into raw blob */
    uint32_t raw_len;           /* bytes, or NO_RAW */
    uint32_t piece_off;         /* into piece blob */
    uint32_t piece_len;         /* bytes */
    uint8_t type;               /* enum tok_type, after EOG promotion */
    bool eog;                   /* ends generation */
};

struct idmap {
    int32_t *slots;             /* token ids, -1 = empty; power-of-two count */
    size_t mask;                /* slot count - 1 */
};

struct merge_slot {
    uint64_t key;               /* left id << 32 | right id; MERGE_EMPTY = free */
    int32_t rank;               /* merge priority, lower first */
    int32_t result;             /* id of the merged text, or -1 */
};

#define MERGE_EMPTY UINT64_MAX

struct tok {
    enum tok_model model;       /* GPT2 or SPM */
    size_t n;                   /* tokens */
    struct tok_entry *tokens;   /* n entries */
    char *text_blob;            /* all texts */
    char *raw_blob;             /* raw bytes of byte-level texts */
    char *piece_blob;           /* decoded pieces */
    struct idmap by_text;       /* text -> id, last duplicate wins */
    struct idmap by_raw;        /* raw bytes -> id */
    float *scores;              /* SPM: n token scores (higher merges first); GPT2: NULL */
    struct merge_slot *merges;  /* open-addressed pair -> merge (GPT2) */
    size_t merge_mask;          /* slot count - 1 */
    int32_t byte_tok[256];      /* token each byte falls back to, or -1 (SPM: <0xXX>, else unk) */
    uint32_t byte_cp[256];      /* bytes_to_unicode: byte -> code point */
    int16_t cp_byte[N_BYTE_CPS];/* its inverse, -1 where no byte maps */
    int32_t *specials;          /* control / unknown / user-defined ids, longest text first */
    size_t n_specials;          /* entries in specials */
    uint32_t *sp_slots;         /* special text -> 1 + its first index in specials; 0 = empty */
    size_t sp_mask;             /* slot count - 1 */
    int32_t *sp_next;           /* n_specials: next index in specials with the same text, or -1 */
    uint32_t *sp_lens;          /* the distinct lengths of special texts, ascending */
    size_t n_sp_lens;           /* entries in sp_lens */
    uint8_t sp_start[8192];     /* bit (b0 << 8 | b1): some special text starts with b0 b1 */
    uint8_t sp_byte[32];        /* bit b: some special text is the one byte b */
    const struct pre_info *pre; /* pre-tokenizer */
    int32_t bos, eos, eot, eom, unk, pad; /* special ids or -1 */
    bool add_bos;               /* callers should prepend bos */
    bool add_space_prefix;      /* SPM: a space before text at the start or after a special */
};

void tok_vocab_init(struct tok_vocab *v)
{
    memset(v, 0, sizeof *v);
    v->bos = v->eos = v->eot = v->eom = v->unk = v->pad = -1;
    v->add_bos = -1;
    v->add_space_prefix = -1;
}

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;    /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_pair(uint64_t key)
{
    key *= 0x9E3779B97F4A7C15ull;
    return key ^ (key >> 31);
}

static size_t pow2_at_least(size_t n)
{
    size_t p = 16;
    while (p < n)
        p <<= 1;
    return p;
}

/* Key bytes of id in a map: its text, or its raw bytes. */
static const char *key_text(const struct tok *t, int32_t id, size_t *len)
{
    *len = t->tokens[id].text_len;
    return t->text_blob + t->tokens[id].text_off;
}

static const char *key_raw(const struct tok *t, int32_t id, size_t *len)
{
    *len = t->tokens[id].raw_len;
    return t->raw_blob + t->tokens[id].raw_off;
}

typedef const char *(*key_fn)(const struct tok *t, int32_t id, size_t *len);

static int idmap_init(struct idmap *m, size_t n)
{
    size_t cap = pow2_at_least(n * 2);
    m->slots = malloc(cap * sizeof *m->slots);
    if (m->slots == NULL)
        return KVD_ENOMEM;
    memset(m->slots, 0xFF, cap * sizeof *m->slots);
    m->mask = cap - 1;
    return 0;
}

/* Returns the slot holding key, or the empty slot where it would go. */
static size_t idmap_slot(const struct tok *t, const struct idmap *m, key_fn key,
                         const char *s, size_t n)
{
    size_t i = (size_t)hash_bytes(s, n) & m->mask;
    for (;;) {
        int32_t id = m->slots[i];
        if (id < 0)
            return i;
        size_t klen;
        const char *k = key(t, id, &klen);
        if (klen == n && memcmp(k, s, n) == 0)
            return i;
        i = (i + 1) & m->mask;
    }
}

static int32_t idmap_get(const struct tok *t, const struct idmap *m, key_fn key,
                         const char *s, size_t n)
{
    return m->slots[idmap_slot(t, m, key, s, n)];
}

/* Inserts id under its key; a later id replaces an earlier one with the same key. */
static void idmap_put(const struct tok *t, struct idmap *m, key_fn key, int32_t id)
{
    size_t n;
    const char *s = key(t, id, &n);
    m->slots[idmap_slot(t, m, key, s, n)] = id;
}

static const struct merge_slot *merge_get(const struct tok *t, int32_t a, int32_t b)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = (size_t)hash_pair(key) & t->merge_mask;
    for (;;) {
        const struct merge_slot *s = &t->merges[i];
        if (s->key == key)
            return s;
        if (s->key == MERGE_EMPTY)
            return NULL;
        i = (i + 1) & t->merge_mask;
    }
}

/* Inserts a merge unless the pair already has one (the first rule wins). */
static void merge_put(struct tok *t, int32_t a, int32_t b, int32_t rank, int32_t result)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = (size_t)hash_pair(key) & t->merge_mask;
    while (t->merges[i].key != MERGE_EMPTY) {
        if (t->merges[i].key == key)
            return;
        i = (i + 1) & t->merge_mask;
    }
    t->merges[i].key = key;
    t->merges[i].rank = rank;
    t->merges[i].result = result;
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
 * other 68 bytes take U+0100.. in byte order. */
static void byte_map_init(struct tok *t)
{
    uint32_t next = 256;
    for (int c = 0; c < N_BYTE_CPS; c++)
        t->cp_byte[c] = -1;
    for (int b = 0; b < 256; b++) {
        bool self = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        t->byte_cp[b] = self ? (uint32_t)b : next++;
        t->cp_byte[t->byte_cp[b]] = (int16_t)b;
    }
}

/* Writes the raw bytes that a byte-level text stands for into out (room for
 * len bytes); returns their count, or -1 when the text holds a character
 * outside the byte-level alphabet (or is not UTF-8). */
static long text_to_raw(const struct tok *t, const char *s, size_t len, char *out)
{
    size_t i = 0, n = 0;
    while (i < len) {
        uint32_t cp;
        size_t k = unicode_utf8_decode(s + i, len - i, &cp);
        if (cp >= N_BYTE_CPS || t->cp_byte[cp] < 0 || (k == 1 && (unsigned char)s[i] >= 0x80))
            return -1;
        out[n++] = (char)t->cp_byte[cp];
        i += k;
    }
    return (long)n;
}

/* What decoding a normal token writes: its raw bytes where the text is
 * byte-level; characters outside the alphabet are copied as they are. */
static size_t text_to_piece(const struct tok *t, const char *s, size_t len, char *out)
{
    size_t i = 0, n = 0;
    while (i < len) {
        uint32_t cp;
        size_t k = unicode_utf8_decode(s + i, len - i, &cp);
        if (cp < N_BYTE_CPS && t->cp_byte[cp] >= 0 && !(k == 1 && (unsigned char)s[i] >= 0x80)) {
            out[n++] = (char)t->cp_byte[cp];
        } else {
            memcpy(out + n, s + i, k);
            n += k;
        }
        i += k;
    }
    return n;
}

static const struct pre_info *pre_lookup(const char *name)
{
    if (name == NULL)
        return &pre_table[0];
    for (size_t i = 0; i < sizeof pre_table / sizeof pre_table[0]; i++)
        if (strcmp(pre_table[i].name, name) == 0)
            return &pre_table[i];
    return NULL;
}

static bool is_special_type(int type)
{
    return type == TOK_TYPE_CONTROL || type == TOK_TYPE_UNKNOWN || type == TOK_TYPE_USER_DEFINED;
}

struct special_key {
    uint32_t len;               /* text length */
    int32_t id;                 /* token id */
};

/* Longest text first; equal lengths by id, so that the order is stable. */
static int special_cmp(const void *pa, const void *pb)
{
    const struct special_key *a = pa, *b = pb;
    if (a->len != b->len)
        return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static int32_t find_text(const struct tok *t, const char *s, size_t n)
{
    return idmap_get(t, &t->by_text, key_text, s, n);
}

/* Copies the texts, builds the text and raw tables and the pieces. */
static int build_tokens(struct tok *t, const struct tok_vocab *v, char *err, size_t errlen)
{
    size_t total = 0;
    for (size_t i = 0; i < t->n; i++) {
        if (v->texts[i] == NULL)
            return kvd_seterr(err, errlen, KVD_EINVAL, "token %zu has no text", i);
        size_t len = v->text_lens ? v->text_lens[i] : strlen(v->texts[i]);
        if (len > UINT32_MAX - total)
            return kvd_seterr(err, errlen, KVD_ERANGE, "token texts exceed 4 GiB");
        t->tokens[i].text_off = (uint32_t)total;
        t->tokens[i].text_len = (uint32_t)len;
        total += len;
        int type = v->types ? v->types[i] : TOK_TYPE_NORMAL;
        if (type < TOK_TYPE_UNDEFINED || type > TOK_TYPE_BYTE)
            return kvd_seterr(err, errlen, KVD_EFORMAT, "token %zu has unknown type %d", i, type);
        t->tokens[i].type = (uint8_t)type;
    }
    /* pieces and raw bytes are never longer than the text */
    bool gpt2 = t->model == TOK_MODEL_GPT2;
    t->text_blob = malloc(total + 1);
    t->raw_blob = gpt2 ? malloc(total + 1) : NULL;
    t->piece_blob = malloc(total + 1);
    if (t->text_blob == NULL || (gpt2 && t->raw_blob == NULL) || t->piece_blob == NULL)
        return kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory for %zu bytes of tokens", total);
    size_t raw_n = 0;
    for (size_t i = 0; i < t->n; i++) {
        struct tok_entry *e = &t->tokens[i];
        char *text = t->text_blob + e->text_off;
        memcpy(text, v->texts[i], e->text_len);
        long r = gpt2 ? text_to_raw(t, text, e->text_len, t->raw_blob + raw_n) : -1;
        e->raw_off = (uint32_t)raw_n;
        e->raw_len = r < 0 ? NO_RAW : (uint32_t)r;
        raw_n += r < 0 ? 0 : (size_t)r;
    }
    if (idmap_init(&t->by_text, t->n) < 0 || (gpt2 && idmap_init(&t->by_raw, t->n) < 0))
        return kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory for the token tables");
    for (size_t i = 0; i < t->n; i++) {
        if (t->tokens[i].text_len == 0)
            continue;                               /* an empty text matches nothing */
        idmap_put(t, &t->by_text, key_text, (int32_t)i);
        if (t->tokens[i].raw_len != NO_RAW)
            idmap_put(t, &t->by_raw, key_raw, (int32_t)i);
    }
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        if (gpt2) {
            t->byte_tok[b] = idmap_get(t, &t->by_raw, key_raw, &c, 1);
            continue;
        }
        /* llama.cpp's byte_to_token: <0xXX>, else the byte itself as a text;
         * where llama.cpp would throw, the unknown token */
        char hex[7];
        snprintf(hex, sizeof hex, "<0x%02X>", b);
        int32_t id = find_text(t, hex, 6);
        if (id < 0)
            id = find_text(t, &c, 1);
        t->byte_tok[b] = id >= 0 ? id : t->unk;
    }
    return 0;
}

/* Marks end-of-generation tokens (promoting them to CONTROL, as llama.cpp
 * does) and finds the end-of-turn token when the vocabulary names none. */
static void mark_eog(struct tok *t)
{
    for (size_t k = 0; k < sizeof eog_texts / sizeof eog_texts[0]; k++) {
        int32_t id = find_text(t, eog_texts[k], strlen(eog_texts[k]));
        if (id >= 0) {
            t->tokens[id].eog = true;
            t->tokens[id].type = TOK_TYPE_CONTROL;
        }
    }
    for (size_t k = 0; t->eot < 0 && k < sizeof eot_texts / sizeof eot_texts[0]; k++)
        t->eot = find_text(t, eot_texts[k], strlen(eot_texts[k]));
    int32_t ids[3] = {t->eos, t->eot, t->eom};
    for (int k = 0; k < 3; k++)
        if (ids[k] >= 0)
            t->tokens[ids[k]].eog = true;
}

/* U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's visible space */
#define SPM_SPACE "\xe2\x96\x81"

/* What decoding a normal SPM token writes: its text with U+2581 as ' '. */
static size_t spm_text_to_piece(const char *s, size_t len, char *out)
{
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        if (i + 3 <= len && memcmp(s + i, SPM_SPACE, 3) == 0) {
            out[n++] = ' ';
            i += 3;
        } else {
            out[n++] = s[i++];
        }
    }
    return n;
}

/* The byte of an SPM byte token "<0xXX>", or -1 when the text is not of that form. */
static int spm_byte_value(const char *s, size_t len)
{
    if (len != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
        return -1;
    int v = 0;
    for (int k = 3; k < 5; k++) {
        char c = s[k];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 :
                c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

static void build_pieces(struct tok *t)
{
    size_t n = 0;
    for (size_t i = 0; i < t->n; i++) {
        struct tok_entry *e = &t->tokens[i];
        const char *text = t->text_blob + e->text_off;
        e->piece_off = (uint32_t)n;
        int byte;
        switch (e->type) {
        case TOK_TYPE_NORMAL:
            if (t->model == TOK_MODEL_SPM)
                e->piece_len = (uint32_t)spm_text_to_piece(text, e->text_len, t->piece_blob + n);
            else
                e->piece_len = (uint32_t)text_to_piece(t, text, e->text_len, t->piece_blob + n);
            break;
        case TOK_TYPE_BYTE:                         /* SPM: the byte "<0xXX>" stands for */
            byte = t->model == TOK_MODEL_SPM ? spm_byte_value(text, e->text_len) : -1;
            if (byte >= 0)
                t->piece_blob[n] = (char)byte;
            e->piece_len = byte >= 0;
            break;
        case TOK_TYPE_CONTROL:
        case TOK_TYPE_UNKNOWN:
        case TOK_TYPE_USER_DEFINED:
            memcpy(t->piece_blob + n, text, e->text_len);
            e->piece_len = e->text_len;
            break;
        default:                                    /* unused, undefined */
            e->piece_len = 0;
            break;
        }
        n += e->piece_len;
    }
}

static const char *special_text(const struct tok *t, size_t k, size_t *len)
{
    const struct tok_entry *e = &t->tokens[t->specials[k]];
    *len = e->text_len;
    return t->text_blob + e->text_off;
}

/* Returns the index in specials of the first special whose text is s[0..n),
 * or -1. */
static int32_t special_find(const struct tok *t, const char *s, size_t n)
{
    for (size_t i = (size_t)hash_bytes(s, n) & t->sp_mask;; i = (i + 1) & t->sp_mask) {
        uint32_t v = t->sp_slots[i];
        if (v == 0)
            return -1;
        size_t kl;
        const char *k = special_text(t, v - 1, &kl);
        if (kl == n && memcmp(k, s, n) == 0)
            return (int32_t)(v - 1);
    }
}

/* Indexes the special texts, so that partition() finds the specials a text
 * holds in one pass instead of searching it for each of them (Gemma has 6,000). */
static int build_special_index(struct tok *t)
{
    size_t cap = pow2_at_least(t->n_specials * 2);
    t->sp_slots = calloc(cap, sizeof *t->sp_slots);
    t->sp_next = malloc((t->n_specials ? t->n_specials : 1) * sizeof *t->sp_next);
    t->sp_lens = malloc((t->n_specials ? t->n_specials : 1) * sizeof *t->sp_lens);
    if (t->sp_slots == NULL || t->sp_next == NULL || t->sp_lens == NULL)
        return KVD_ENOMEM;
    t->sp_mask = cap - 1;
    for (size_t k = 0; k < t->n_specials; k++) {
        size_t n;
        const char *s = special_text(t, k, &n);
        t->sp_next[k] = -1;
        int32_t first = special_find(t, s, n);
        if (first >= 0) {                           /* a later special with the same text */
            int32_t j = first;
            while (t->sp_next[j] >= 0)
                j = t->sp_next[j];
            t->sp_next[j] = (int32_t)k;
        } else {
            size_t i = (size_t)hash_bytes(s, n) & t->sp_mask;
            while (t->sp_slots[i] != 0)
                i = (i + 1) & t->sp_mask;
            t->sp_slots[i] = (uint32_t)k + 1;
        }
        unsigned char b0 = (unsigned char)s[0];
        if (n == 1) {
            t->sp_byte[b0 >> 3] |= (uint8_t)(1u << (b0 & 7));
        } else {
            unsigned two = (unsigned)b0 << 8 | (unsigned char)s[1];
            t->sp_start[two >> 3] |= (uint8_t)(1u << (two & 7));
        }
        /* specials are longest first: lengths come in descending order */
        if (t->n_sp_lens == 0 || t->sp_lens[t->n_sp_lens - 1] != n)
            t->sp_lens[t->n_sp_lens++] = (uint32_t)n;
    }
    for (size_t a = 0, b = t->n_sp_lens; a + 1 < b; a++, b--) {  /* ascending */
        uint32_t x = t->sp_lens[a];
        t->sp_lens[a] = t->sp_lens[b - 1];
        t->sp_lens[b - 1] = x;
    }
    return 0;
}

static int build_specials(struct tok *t)
{
    size_t n = 0;
    struct special_key *keys = malloc((t->n ? t->n : 1) * sizeof *keys);
    t->specials = malloc((t->n ? t->n : 1) * sizeof *t->specials);
    if (keys == NULL || t->specials == NULL) {
        free(keys);
        return KVD_ENOMEM;
    }
    for (size_t i = 0; i < t->n; i++)
        if (is_special_type(t->tokens[i].type) && t->tokens[i].text_len > 0)
            keys[n++] = (struct special_key){t->tokens[i].text_len, (int32_t)i};
    qsort(keys, n, sizeof *keys, special_cmp);
    for (size_t i = 0; i < n; i++)
        t->specials[i] = keys[i].id;
    t->n_specials = n;
    free(keys);
    return build_special_index(t);
}

/* Shows at most 40 bytes of a token text in an error message. */
#define SHOW(len) ((int)((len) > 40 ? 40 : (len)))

static int build_merges(struct tok *t, const struct tok_vocab *v, char *err, size_t errlen)
{
    if (v->n_merges > INT32_MAX)
        return kvd_seterr(err, errlen, KVD_ERANGE, "%zu merges is too many", v->n_merges);
    size_t cap = pow2_at_least(v->n_merges * 2);
    t->merges = malloc(cap * sizeof *t->merges);
    if (t->merges == NULL)
        return kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory for %zu merges", v->n_merges);
    for (size_t i = 0; i < cap; i++)
        t->merges[i].key = MERGE_EMPTY;
    t->merge_mask = cap - 1;

    char *both = NULL;
    size_t both_cap = 0;
    int rc = 0;
    for (size_t i = 0; i < v->n_merges; i++) {
        const char *m = v->merges[i];
        if (m == NULL) {
            rc = kvd_seterr(err, errlen, KVD_EINVAL, "merge %zu is missing", i);
            break;
        }
        size_t len = v->merge_lens ? v->merge_lens[i] : strlen(m);
        /* "A B": the separator is the first space after the first byte */
        const char *sp = len > 1 ? memchr(m + 1, ' ', len - 1) : NULL;
        if (sp == NULL || sp + 1 == m + len) {
            rc = kvd_seterr(err, errlen, KVD_EFORMAT,
                            "merge %zu \"%.*s\" is not of the form \"A B\"", i, SHOW(len), m);
            break;
        }
        size_t la = (size_t)(sp - m), lb = len - la - 1;
        int32_t a = find_text(t, m, la), b = find_text(t, sp + 1, lb);
        if (a < 0 || b < 0) {
            const char *bad = a < 0 ? m : sp + 1;
            size_t lbad = a < 0 ? la : lb;
            rc = kvd_seterr(err, errlen, KVD_EFORMAT,
                            "merge %zu \"%.*s\" names \"%.*s\", which is not a token",
                            i, SHOW(len), m, SHOW(lbad), bad);
            break;
        }
        if (la + lb > both_cap) {
            char *nb = realloc(both, la + lb);
            if (nb == NULL) {
                rc = kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
                break;
            }
            both = nb;
            both_cap = la + lb;
        }
        memcpy(both, m, la);
        memcpy(both + la, sp + 1, lb);
        merge_put(t, a, b, (int32_t)i, find_text(t, both, la + lb));
    }
    free(both);
    return rc;
}

tok_t *tok_new(const struct tok_vocab *v, char *err, size_t errlen)
{
    if (v == NULL || v->n_tokens == 0 || v->texts == NULL) {
        kvd_seterr(err, errlen, KVD_EINVAL, "the vocabulary has no tokens");
        return NULL;
    }
    if (v->n_tokens >= INT32_MAX) {
        kvd_seterr(err, errlen, KVD_ERANGE, "%zu tokens is too many", v->n_tokens);
        return NULL;
    }
    if (v->model != TOK_MODEL_GPT2 && v->model != TOK_MODEL_SPM) {
        kvd_seterr(err, errlen, KVD_EINVAL, "unknown tokenizer model %d", (int)v->model);
        return NULL;
    }
    if (v->model == TOK_MODEL_SPM && v->n_merges > 0) {
        kvd_seterr(err, errlen, KVD_EINVAL,
                   "%zu merges for a SentencePiece vocabulary (it merges by score)", v->n_merges);
        return NULL;
    }
    if (v->n_merges > 0 && v->merges == NULL) {
        kvd_seterr(err, errlen, KVD_EINVAL, "%zu merges but no merge array", v->n_merges);
        return NULL;
    }
    const struct pre_info *pre = v->model == TOK_MODEL_SPM ? &pre_table[0] : pre_lookup(v->pre);
    if (pre == NULL) {
        kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                   "unsupported pre-tokenizer '%.64s' (supported: default, gpt-2, smollm, "
                   "starcoder, llama3, ...)", v->pre);
        return NULL;
    }
    const struct { const char *name; int32_t id; } ids[] = {
        {"bos", v->bos}, {"eos", v->eos}, {"eot", v->eot},
        {"eom", v->eom}, {"unknown", v->unk}, {"padding", v->pad},
    };
    for (size_t k = 0; k < sizeof ids / sizeof ids[0]; k++) {
        if (ids[k].id < -1 || ids[k].id >= (int64_t)v->n_tokens) {
            kvd_seterr(err, errlen, KVD_ERANGE, "%s token id %d is out of range (%zu tokens)",
                       ids[k].name, ids[k].id, v->n_tokens);
            return NULL;
        }
    }

    struct tok *t = calloc(1, sizeof *t);
    if (t == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        return NULL;
    }
    t->model = v->model;
    t->n = v->n_tokens;
    t->pre = pre;
    t->bos = v->bos;
    t->eos = v->eos;
    t->eot = v->eot;
    t->eom = v->eom;
    t->unk = v->unk;
    t->pad = v->pad;
    if (t->model == TOK_MODEL_SPM) {
        t->add_bos = v->add_bos != 0;               /* -1: llama.cpp's SPM default, on */
        t->add_space_prefix = v->add_space_prefix != 0;
    } else {
        t->add_bos = v->add_bos < 0 ? pre->add_bos : v->add_bos != 0;
    }
    byte_map_init(t);
    t->tokens = calloc(t->n, sizeof *t->tokens);
    if (t->tokens == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory for %zu tokens", t->n);
        goto fail;
    }
    if (t->model == TOK_MODEL_SPM) {
        t->scores = malloc(t->n * sizeof *t->scores);
        if (t->scores == NULL) {
            kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory for %zu scores", t->n);
            goto fail;
        }
        for (size_t i = 0; i < t->n; i++)
            t->scores[i] = v->scores ? v->scores[i] : 0.0f;
    }
    if (build_tokens(t, v, err, errlen) < 0)
        goto fail;
    mark_eog(t);
    build_pieces(t);
    if (build_specials(t) < 0) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        goto fail;
    }
    if (build_merges(t, v, err, errlen) < 0)
        goto fail;
    return t;

fail:
    tok_destroy(&t);
    return NULL;
}

void tok_destroy(tok_t **tp)
{
    if (tp == NULL || *tp == NULL)
        return;
    struct tok *t = *tp;
    free(t->tokens);
    free(t->text_blob);
    free(t->raw_blob);
    free(t->piece_blob);
    free(t->by_text.slots);
    free(t->by_raw.slots);
    free(t->merges);
    free(t->scores);
    free(t->specials);
    free(t->sp_slots);
    free(t->sp_next);
    free(t->sp_lens);
    free(t);
    *tp = NULL;
}

/* ---- loading from GGUF --------------------------------------------------- */

static bool is_int_type(uint32_t type)
{
    switch (type) {
    case GGUF_VT_UINT8: case GGUF_VT_INT8: case GGUF_VT_UINT16: case GGUF_VT_INT16:
    case GGUF_VT_UINT32: case GGUF_VT_INT32: case GGUF_VT_UINT64: case GGUF_VT_INT64:
        return true;
    default:
        return false;
    }
}

/* Reads an optional token id; dflt when absent (-1 when dflt is out of range). */
static int gguf_token_id(const gguf_ctx_t *g, const char *key, uint64_t n, int32_t dflt,
                         int32_t *id, char *err, size_t errlen)
{
    uint32_t v;
    int rc = gguf_get_u32(g, key, &v);
    if (rc == KVD_ENOTFOUND) {
        *id = dflt >= 0 && (uint64_t)dflt < n ? dflt : -1;
        return 0;
    }
    if (rc < 0)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "%s is not an unsigned integer", key);
    if (v >= n)
        return kvd_seterr(err, errlen, KVD_ERANGE, "%s = %u is out of range (%llu tokens)",
                          key, v, (unsigned long long)n);
    *id = (int32_t)v;
    return 0;
}

/* Reads a string array into parallel pointer / length arrays (borrowed from g). */
static int gguf_str_array(const gguf_ctx_t *g, const char *key, bool required, uint64_t *n,
                          const char ***ptrs, size_t **lens, char *err, size_t errlen)
{
    uint32_t type;
    const struct gguf_kv *kv;
    int rc = gguf_get_arr(g, key, &type, n, &kv);
    *ptrs = NULL;
    *lens = NULL;
    if (rc == KVD_ENOTFOUND && !required) {
        *n = 0;
        return 0;
    }
    if (rc == KVD_ENOTFOUND)
        return kvd_seterr(err, errlen, KVD_ENOTFOUND, "%s is missing", key);
    if (rc < 0 || type != GGUF_VT_STRING || kv->strs == NULL)
        return kvd_seterr(err, errlen, KVD_EFORMAT, "%s is not an array of strings", key);
    if (*n >= INT32_MAX)
        return kvd_seterr(err, errlen, KVD_ERANGE, "%s has %llu entries", key,
                          (unsigned long long)*n);
    *ptrs = malloc((*n ? *n : 1) * sizeof **ptrs);
    *lens = malloc((*n ? *n : 1) * sizeof **lens);
    if (*ptrs == NULL || *lens == NULL)
        return kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
    for (uint64_t i = 0; i < *n; i++) {
        (*ptrs)[i] = kv->strs[i].ptr;
        (*lens)[i] = (size_t)kv->strs[i].len;
    }
    return 0;
}

/* Reads tokenizer.ggml.scores (float32 or int32, at least n entries) into a
 * new array in *scores; NULL when absent. */
static int gguf_scores(const gguf_ctx_t *g, uint64_t n, float **scores, char *err, size_t errlen)
{
    uint32_t type;
    uint64_t n_scores;
    const struct gguf_kv *kv;
    *scores = NULL;
    int rc = gguf_get_arr(g, "tokenizer.ggml.scores", &type, &n_scores, &kv);
    if (rc == KVD_ENOTFOUND)
        return 0;
    if (rc < 0 || (type != GGUF_VT_FLOAT32 && type != GGUF_VT_INT32))
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "tokenizer.ggml.scores is not an array of float32 or int32");
    if (n_scores < n)
        return kvd_seterr(err, errlen, KVD_EFORMAT,
                          "tokenizer.ggml.scores has %llu entries for %llu tokens",
                          (unsigned long long)n_scores, (unsigned long long)n);
    *scores = malloc((n ? n : 1) * sizeof **scores);
    if (*scores == NULL)
        return kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
    for (uint64_t i = 0; i < n; i++) {
        if (type == GGUF_VT_FLOAT32)
            memcpy(&(*scores)[i], kv->data + 4 * i, 4);     /* unaligned in the file */
        else
            (*scores)[i] = (float)gguf_arr_int(kv, i);
    }
    return 0;
}

tok_t *tok_new_from_gguf(const gguf_ctx_t *g, char *err, size_t errlen)
{
    struct tok_vocab v;
    struct gguf_str s;
    char pre[65];
    const char **texts = NULL, **merges = NULL;
    size_t *text_lens = NULL, *merge_lens = NULL;
    int32_t *types = NULL;
    float *scores = NULL;
    tok_t *t = NULL;
    uint64_t n_tok = 0, n_merge = 0;

    tok_vocab_init(&v);
    if (g == NULL) {
        kvd_seterr(err, errlen, KVD_EINVAL, "no model file");
        return NULL;
    }
    int rc = gguf_get_str(g, "tokenizer.ggml.model", &s);
    if (rc == KVD_ENOTFOUND) {
        kvd_seterr(err, errlen, KVD_ENOTFOUND, "the model has no tokenizer (tokenizer.ggml.model)");
        return NULL;
    }
    if (rc < 0) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "tokenizer.ggml.model is not a string");
        return NULL;
    }
    if (gguf_str_eq(s, "llama")) {
        v.model = TOK_MODEL_SPM;
    } else if (!gguf_str_eq(s, "gpt2")) {
        kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                   "unsupported tokenizer model '%.*s' (only 'gpt2' byte-level BPE and "
                   "'llama' SentencePiece BPE)", SHOW(s.len), s.ptr);
        return NULL;
    }
    bool spm = v.model == TOK_MODEL_SPM;
    rc = spm ? KVD_ENOTFOUND : gguf_get_str(g, "tokenizer.ggml.pre", &s);  /* SPM ignores it */
    if (rc == 0) {
        if (s.len >= sizeof pre || memchr(s.ptr, '\0', (size_t)s.len) != NULL) {
            kvd_seterr(err, errlen, KVD_EUNSUPPORTED, "unsupported pre-tokenizer '%.*s'",
                       SHOW(s.len), s.ptr);
            return NULL;
        }
        memcpy(pre, s.ptr, (size_t)s.len);
        pre[s.len] = '\0';
        v.pre = pre;
    } else if (rc != KVD_ENOTFOUND) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "tokenizer.ggml.pre is not a string");
        return NULL;
    }

    if (gguf_str_array(g, "tokenizer.ggml.tokens", true, &n_tok, &texts, &text_lens,
                       err, errlen) < 0)
        goto out;
    if (!spm && gguf_str_array(g, "tokenizer.ggml.merges", true, &n_merge, &merges, &merge_lens,
                               err, errlen) < 0)
        goto out;
    if (spm && gguf_scores(g, n_tok, &scores, err, errlen) < 0)
        goto out;

    uint32_t type;
    uint64_t n_types;
    const struct gguf_kv *kv;
    rc = gguf_get_arr(g, "tokenizer.ggml.token_type", &type, &n_types, &kv);
    if (rc == 0) {
        if (!is_int_type(type)) {
            kvd_seterr(err, errlen, KVD_EFORMAT,
                       "tokenizer.ggml.token_type is not an integer array");
            goto out;
        }
        if (n_types != n_tok) {
            kvd_seterr(err, errlen, KVD_EFORMAT,
                       "tokenizer.ggml.token_type has %llu entries for %llu tokens",
                       (unsigned long long)n_types, (unsigned long long)n_tok);
            goto out;
        }
        types = malloc((n_tok ? n_tok : 1) * sizeof *types);
        if (types == NULL) {
            kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
            goto out;
        }
        for (uint64_t i = 0; i < n_tok; i++) {
            int64_t ty = gguf_arr_int(kv, i);
            types[i] = ty < INT32_MIN || ty > INT32_MAX ? -1 : (int32_t)ty;
        }
    } else if (rc != KVD_ENOTFOUND) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "tokenizer.ggml.token_type is not an array");
        goto out;
    }

    /* absent ids: none for GPT2, llama.cpp's LLaMA defaults for SPM */
    if (gguf_token_id(g, "tokenizer.ggml.bos_token_id", n_tok, spm ? 1 : -1, &v.bos,
                      err, errlen) < 0 ||
        gguf_token_id(g, "tokenizer.ggml.eos_token_id", n_tok, spm ? 2 : -1, &v.eos,
                      err, errlen) < 0 ||
        gguf_token_id(g, "tokenizer.ggml.eot_token_id", n_tok, -1, &v.eot, err, errlen) < 0 ||
        gguf_token_id(g, "tokenizer.ggml.eom_token_id", n_tok, -1, &v.eom, err, errlen) < 0 ||
        gguf_token_id(g, "tokenizer.ggml.unknown_token_id", n_tok, spm ? 0 : -1, &v.unk,
                      err, errlen) < 0 ||
        gguf_token_id(g, "tokenizer.ggml.padding_token_id", n_tok, -1, &v.pad, err, errlen) < 0)
        goto out;
    bool add_bos;
    rc = gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos);
    if (rc == 0) {
        v.add_bos = add_bos;
    } else if (rc != KVD_ENOTFOUND) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "tokenizer.ggml.add_bos_token is not a bool");
        goto out;
    }
    bool add_space_prefix;
    rc = spm ? gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &add_space_prefix)
             : KVD_ENOTFOUND;
    if (rc == 0) {
        v.add_space_prefix = add_space_prefix;
    } else if (rc != KVD_ENOTFOUND) {
        kvd_seterr(err, errlen, KVD_EFORMAT, "tokenizer.ggml.add_space_prefix is not a bool");
        goto out;
    }

    v.n_tokens = (size_t)n_tok;
    v.texts = texts;
    v.text_lens = text_lens;
    v.types = types;
    v.scores = scores;
    v.n_merges = (size_t)n_merge;
    v.merges = merges;
    v.merge_lens = merge_lens;
    t = tok_new(&v, err, errlen);
out:
    free(texts);
    free(text_lens);
    free(merges);
    free(merge_lens);
    free(types);
    free(scores);
    return t;
}

/* ---- encoding ------------------------------------------------------------ */

struct frag {
    size_t off;                 /* byte offset into the text */
    size_t len;                 /* bytes; 0 for a special token */
    int32_t id;                 /* special token id, or -1 for raw text */
};

struct sym {
    int32_t id;                 /* token of the symbol's bytes, or -1 */
    int32_t prev, next;         /* neighbours in the word, -1 at the ends */
    uint32_t start, len;        /* bytes of the word; len 0 once merged away */
};

struct bigram {
    uint32_t rank;              /* merge rank (GPT2) or score_rank() (SPM): lower pops first */
    int32_t left, right;        /* symbol indexes; left breaks rank ties */
    int32_t result;             /* token id of the merge */
    uint32_t len;               /* bytes of left + right when queued (staleness check) */
};

/* Scratch space of one call, grown as needed. */
struct work {
    uint32_t *cp;               /* code points of the fragment */
    uint16_t *fl;               /* their UNICODE_* flags */
    size_t *src;                /* byte offset of each code point in the text, and its end */
    char *norm;                 /* the code points re-encoded (3 * cp_cap bytes) */
    size_t *boff;               /* byte offset of each code point in norm, and its end */
    size_t *ends, *ends2;       /* word ends (code point indexes), and the next stage's */
    size_t cp_cap;              /* capacity of the arrays above */
    size_t n_ends;              /* words in ends */
    struct sym *sym;            /* one word's symbols */
    struct bigram *heap;        /* candidate merges, a binary heap */
    size_t sym_cap;             /* capacity of sym; heap holds 3 * sym_cap */
    size_t heap_n;              /* entries in heap */
    struct frag *frags, *frags2;/* special-token partition, and the next pass */
    size_t frag_cap, frag_cap2; /* their capacities */
    char *esc;                  /* SPM: one fragment with ' ' as U+2581 */
    size_t esc_cap;             /* its capacity */
    uint8_t *present;           /* per special (index in specials): its text occurs in the text */
};

struct sink {
    int32_t *out;               /* caller's array */
    size_t cap;                 /* its capacity */
    size_t n;                   /* ids produced, may exceed cap */
};

static void sink_put(struct sink *s, int32_t id)
{
    if (s->n < s->cap)
        s->out[s->n] = id;
    s->n++;
}

static void work_free(struct work *w)
{
    free(w->cp);
    free(w->fl);
    free(w->src);
    free(w->norm);
    free(w->boff);
    free(w->ends);
    free(w->ends2);
    free(w->sym);
    free(w->heap);
    free(w->frags);
    free(w->frags2);
    free(w->esc);
    free(w->present);
}

static int work_reserve_cps(struct work *w, size_t n)
{
    if (n <= w->cp_cap)
        return 0;
    free(w->cp);
    free(w->fl);
    free(w->src);
    free(w->norm);
    free(w->boff);
    free(w->ends);
    free(w->ends2);
    w->cp = malloc(n * sizeof *w->cp);
    w->fl = malloc(n * sizeof *w->fl);
    w->src = malloc((n + 1) * sizeof *w->src);
    w->norm = n <= SIZE_MAX / 3 ? malloc(3 * n) : NULL;
    w->boff = malloc((n + 1) * sizeof *w->boff);
    w->ends = malloc(n * sizeof *w->ends);
    w->ends2 = malloc(n * sizeof *w->ends2);
    if (!w->cp || !w->fl || !w->src || !w->norm || !w->boff || !w->ends || !w->ends2) {
        w->cp_cap = 0;
        return KVD_ENOMEM;
    }
    w->cp_cap = n;
    return 0;
}

static int work_reserve_syms(struct work *w, size_t n)
{
    if (n <= w->sym_cap)
        return 0;
    free(w->sym);
    free(w->heap);
    w->sym = malloc(n * sizeof *w->sym);
    w->heap = malloc(3 * n * sizeof *w->heap);
    if (w->sym == NULL || w->heap == NULL) {
        w->sym_cap = 0;
        return KVD_ENOMEM;
    }
    w->sym_cap = n;
    return 0;
}

/* Flags of code point i of the piece ending at b; 0 past its end, which is
 * how the matchers see the end of a piece (lookahead never crosses it). */
static inline uint16_t fl_at(const struct work *w, size_t i, size_t b)
{
    return i < b ? w->fl[i] : 0;
}

#define LNS (UNICODE_LETTER | UNICODE_NUMBER | UNICODE_SPACE)

/* One match of 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * at pos of the piece ending at b: returns where it ends. The contractions
 * are case-sensitive, as in GPT-2. */
static size_t match_gpt2(const struct work *w, size_t pos, size_t b)
{
    const uint32_t *cp = w->cp;
    uint32_t c = cp[pos];
    if (c == '\'' && pos + 1 < b) {
        uint32_t c1 = cp[pos + 1];
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
            return pos + 2;
        if (pos + 2 < b) {
            uint32_t c2 = cp[pos + 2];
            if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
                return pos + 3;
        }
    }
    size_t s = pos + (c == ' ');                    /* an optional leading space */
    uint16_t f = fl_at(w, s, b);
    size_t end = s;
    if (f & UNICODE_LETTER) {
        while (fl_at(w, end, b) & UNICODE_LETTER)
            end++;
        return end;
    }
    if (f & UNICODE_NUMBER) {
        while (fl_at(w, end, b) & UNICODE_NUMBER)
            end++;
        return end;
    }
    if (f != 0 && !(f & LNS)) {
        uint16_t g;
        while ((g = fl_at(w, end, b)) != 0 && !(g & LNS))
            end++;
        return end;
    }
    size_t nws = 0;
    while (fl_at(w, pos + nws, b) & UNICODE_SPACE)
        nws++;
    if (nws > 1 && pos + nws < b)
        return pos + nws - 1;                       /* \s+(?!\S): leave one for the next word */
    if (nws > 0)
        return pos + nws;
    return pos + 1;
}

static uint32_t ascii_lower(uint32_t c)
{
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

/* One match of the llama3 regex (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|
 * \p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ . Lower-casing
 * ASCII suffices: no other code point lower-cases to these letters (checked
 * by scripts/gen_unicode_data.py). */
static size_t match_llama3(const struct work *w, size_t pos, size_t b)
{
    const uint32_t *cp = w->cp;
    uint32_t c = cp[pos];
    uint16_t f = w->fl[pos];
    if (c == '\'' && pos + 1 < b) {
        uint32_t c1 = ascii_lower(cp[pos + 1]);
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
            return pos + 2;
        if (pos + 2 < b) {
            uint32_t c2 = ascii_lower(cp[pos + 2]);
            if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
                return pos + 3;
        }
    }
    if (!(c == '\r' || c == '\n' || (f & UNICODE_NUMBER)) &&
        ((f & UNICODE_LETTER) || (fl_at(w, pos + 1, b) & UNICODE_LETTER))) {
        size_t end = pos + 1;
        while (fl_at(w, end, b) & UNICODE_LETTER)
            end++;
        return end;
    }
    if (f & UNICODE_NUMBER) {
        size_t end = pos;
        while (end < pos + 3 && (fl_at(w, end, b) & UNICODE_NUMBER))
            end++;
        return end;
    }
    size_t s = pos + (c == ' ');
    uint16_t f2 = fl_at(w, s, b);
    if (!(f2 & LNS) && f != 0) {
        size_t end = s;
        uint16_t g;
        while ((g = fl_at(w, end, b)) != 0 && !(g & LNS))
            end++;
        while (end < b && (cp[end] == '\r' || cp[end] == '\n'))
            end++;
        return end;
    }
    size_t nws = 0, last_nl = 0;
    while (fl_at(w, pos + nws, b) & UNICODE_SPACE) {
        if (cp[pos + nws] == '\r' || cp[pos + nws] == '\n')
            last_nl = pos + nws + 1;
        nws++;
    }
    if (last_nl > 0)
        return last_nl;                             /* \s*[\r\n]+ */
    if (nws > 1 && pos + nws < b)
        return pos + nws - 1;
    if (nws > 0)
        return pos + nws;
    return pos + 1;
}

/* A stage splits the piece [a, b) of code points, appending word ends. */
typedef void (*stage_fn)(const struct work *w, size_t a, size_t b, size_t *ends, size_t *n);

static void stage_gpt2(const struct work *w, size_t a, size_t b, size_t *ends, size_t *n)
{
    for (size_t pos = a; pos < b;)
        ends[(*n)++] = pos = match_gpt2(w, pos, b);
}

static void stage_llama3(const struct work *w, size_t a, size_t b, size_t *ends, size_t *n)
{
    for (size_t pos = a; pos < b;)
        ends[(*n)++] = pos = match_llama3(w, pos, b);
}

/* \p{N}: every number code point alone, the text between as one piece. */
static void stage_each_number(const struct work *w, size_t a, size_t b, size_t *ends, size_t *n)
{
    size_t run = a;
    for (size_t i = a; i < b; i++) {
        if (w->fl[i] & UNICODE_NUMBER) {
            if (run < i)
                ends[(*n)++] = i;
            ends[(*n)++] = i + 1;
            run = i + 1;
        }
    }
    if (run < b)
        ends[(*n)++] = b;
}

/* Splits [a, b) into alternating runs of code points that match and don't. */
static void split_runs(const struct work *w, size_t a, size_t b, size_t *ends, size_t *n,
                       bool (*match)(uint32_t cp, uint16_t fl))
{
    for (size_t i = a + 1; i <= b; i++)
        if (i == b || match(w->cp[i], w->fl[i]) != match(w->cp[i - 1], w->fl[i - 1]))
            ends[(*n)++] = i;
}

/* [\p{P}\$\+<=>\^~\|] as llama.cpp reads it: ASCII punctuation and symbols
 * except the backtick, and non-ASCII punctuation. */
static bool is_default_punct(uint32_t cp, uint16_t fl)
{
    if (cp < 128)
        return cp > ' ' && cp < 127 && cp != '`' && !(fl & (UNICODE_LETTER | UNICODE_NUMBER));
    return (fl & UNICODE_PUNCT) && !(fl & UNICODE_SPACE);
}

static bool is_number(uint32_t cp, uint16_t fl)
{
    (void)cp;
    return fl & UNICODE_NUMBER;
}

static void stage_punct_runs(const struct work *w, size_t a, size_t b, size_t *ends, size_t *n)
{
    split_runs(w, a, b, ends, n, is_default_punct);
}

static void stage_number_runs(const struct work *w, size_t a, size_t b, size_t *ends, size_t *n)
{
    split_runs(w, a, b, ends, n, is_number);
}

static bool is_digit(uint32_t c)
{
    return c >= '0' && c <= '9';
}

/* [0-9][0-9][0-9]: leftmost non-overlapping triples of ASCII digits. */
static void stage_digit_triples(const struct work *w, size_t a, size_t b, size_t *ends, size_t *n)
{
    size_t gap = a, i = a;
    while (i < b) {
        if (i + 2 < b && is_digit(w->cp[i]) && is_digit(w->cp[i + 1]) && is_digit(w->cp[i + 2])) {
            if (gap < i)
                ends[(*n)++] = i;
            i += 3;
            ends[(*n)++] = i;
            gap = i;
        } else {
            i++;
        }
    }
    if (gap < b)
        ends[(*n)++] = b;
}

/* Decodes text[0..len) and splits it into words: w->ends[0..w->n_ends) in
 * code points; w->src maps them to bytes of the text, w->boff to bytes of
 * w->norm, the text as BPE sees it (re-encoded, U+FFFD for bad bytes). */
static int pretokenize(const struct tok *t, struct work *w, const char *text, size_t len)
{
    static const stage_fn stages_default[] = {stage_punct_runs, stage_gpt2, stage_number_runs,
                                              stage_digit_triples, NULL};
    static const stage_fn stages_gpt2[] = {stage_gpt2, NULL};
    static const stage_fn stages_smollm[] = {stage_each_number, stage_gpt2, NULL};
    static const stage_fn stages_llama3[] = {stage_llama3, NULL};
    const stage_fn *stages;

    if (work_reserve_cps(w, len + 1) < 0)
        return KVD_ENOMEM;
    size_t ncp = 0, nb = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t k = unicode_utf8_decode(text + i, len - i, &cp);
        if (cp > UNICODE_MAX)
            cp = UNICODE_REPLACEMENT;   /* llama.cpp fails on these; the sane reading */
        w->cp[ncp] = cp;
        w->fl[ncp] = unicode_flags(cp);
        w->src[ncp] = i;
        w->boff[ncp] = nb;
        nb += unicode_utf8_encode(cp, w->norm + nb);
        ncp++;
        i += k;
    }
    w->src[ncp] = len;
    w->boff[ncp] = nb;
    w->n_ends = 0;
    if (ncp == 0)
        return 0;
    w->ends[w->n_ends++] = ncp;

    switch (t->pre->kind) {
    case PRE_GPT2: stages = stages_gpt2; break;
    case PRE_SMOLLM: stages = stages_smollm; break;
    case PRE_LLAMA3: stages = stages_llama3; break;
    default: stages = stages_default; break;
    }
    for (; *stages != NULL; stages++) {
        size_t n2 = 0, a = 0;
        for (size_t k = 0; k < w->n_ends; k++) {
            (*stages)(w, a, w->ends[k], w->ends2, &n2);
            a = w->ends[k];
        }
        size_t *tmp = w->ends;
        w->ends = w->ends2;
        w->ends2 = tmp;
        w->n_ends = n2;
    }
    return 0;
}

static bool bigram_less(const struct bigram *x, const struct bigram *y)
{
    return x->rank < y->rank || (x->rank == y->rank && x->left < y->left);
}

static inline void heap_push(struct work *w, struct bigram g)
{
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!bigram_less(&g, &w->heap[parent]))
            break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = g;
}

static inline struct bigram heap_pop(struct work *w)
{
    struct bigram top = w->heap[0];
    struct bigram last = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && bigram_less(&w->heap[c + 1], &w->heap[c]))
            c++;
        if (!bigram_less(&w->heap[c], &last))
            break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n > 0)
        w->heap[i] = last;
    return top;
}

/* Queues the merge of symbols l and r if the vocabulary has one. */
static void try_pair(const struct tok *t, struct work *w, int32_t l, int32_t r)
{
    if (l < 0 || r < 0 || w->sym[l].id < 0 || w->sym[r].id < 0)
        return;
    const struct merge_slot *m = merge_get(t, w->sym[l].id, w->sym[r].id);
    if (m == NULL)
        return;
    struct bigram g = {(uint32_t)m->rank, l, r, m->result, w->sym[l].len + w->sym[r].len};
    heap_push(w, g);
}

static void merge_queued(const struct tok *t, struct work *w, const char *spm_text);

static void emit_symbol(const struct tok *t, const unsigned char *s, const struct sym *y,
                        struct sink *out)
{
    if (y->id >= 0) {
        sink_put(out, y->id);
        return;
    }
    for (uint32_t i = 0; i < y->len; i++)   /* not a token: one token per byte */
        if (t->byte_tok[s[y->start + i]] >= 0)
            sink_put(out, t->byte_tok[s[y->start + i]]);
}

/* Byte-pair-encodes one word s[0..n) (n > 0). */
static void bpe_word(const struct tok *t, struct work *w, const unsigned char *s, size_t n,
                     struct sink *out)
{
    if (t->pre->ignore_merges) {
        int32_t id = idmap_get(t, &t->by_raw, key_raw, (const char *)s, n);
        if (id >= 0) {
            sink_put(out, id);
            return;
        }
    }
    for (size_t i = 0; i < n; i++) {
        struct sym *y = &w->sym[i];
        y->id = t->byte_tok[s[i]];
        y->prev = (int32_t)i - 1;
        y->next = i + 1 < n ? (int32_t)i + 1 : -1;
        y->start = (uint32_t)i;
        y->len = 1;
    }
    w->heap_n = 0;
    for (size_t i = 1; i < n; i++)
        try_pair(t, w, (int32_t)i - 1, (int32_t)i);
    merge_queued(t, w, NULL);
    for (int32_t i = 0; i >= 0; i = w->sym[i].next)
        emit_symbol(t, s, &w->sym[i], out);
}

/* Tokenizes one stretch of text that holds no special token. */
static int encode_raw(const struct tok *t, struct work *w, const char *text, size_t len,
                      struct sink *out)
{
    int rc = pretokenize(t, w, text, len);
    if (rc < 0)
        return rc;
    size_t longest = 0, a = 0;
    for (size_t k = 0; k < w->n_ends; k++) {
        size_t bytes = w->boff[w->ends[k]] - w->boff[a];
        if (bytes > longest)
            longest = bytes;
        a = w->ends[k];
    }
    if (longest > INT32_MAX / 4)
        return KVD_ERANGE;
    if (work_reserve_syms(w, longest) < 0)
        return KVD_ENOMEM;
    a = 0;
    for (size_t k = 0; k < w->n_ends; k++) {
        size_t from = w->boff[a], to = w->boff[w->ends[k]];
        bpe_word(t, w, (const unsigned char *)w->norm + from, to - from, out);
        a = w->ends[k];
    }
    return 0;
}

/* ---- SentencePiece BPE ------------------------------------------------------ */

/* Bytes of the character whose first byte is c, as llama.cpp counts them when
 * it splits SPM text: by the lead byte alone, so a stray continuation byte is
 * a character of 1 byte and 0xF8..0xFF start one of 4. */
static size_t spm_char_len(unsigned char c)
{
    static const uint8_t len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len[c >> 4];
}

/* The heap key of a token score: higher scores pop first, equal scores tie
 * (and the leftmost pair wins); -0 equals +0, NaN pops last. */
static uint32_t score_rank(float f)
{
    if (isnan(f))
        return UINT32_MAX;
    if (f == 0.0f)
        f = 0.0f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u & 0x80000000u) ? ~u : u | 0x80000000u;  /* unsigned order = float order */
    return ~u;
}

/* Queues the merge of symbols l and r of s when their concatenation is a
 * token (of any type, as in llama.cpp). */
static void spm_try_pair(const struct tok *t, struct work *w, const char *s, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return;
    uint32_t len = w->sym[l].len + w->sym[r].len;
    int32_t id = find_text(t, s + w->sym[l].start, len);     /* l and r are adjacent bytes */
    if (id < 0)
        return;
    struct bigram g = {score_rank(t->scores[id]), l, r, id, len};
    heap_push(w, g);
}

/* Merges the queued pairs, best first, queueing each merge's new neighbour
 * pairs: by rank (BPE, spm_text NULL) or by score over spm_text (SPM). */
static void merge_queued(const struct tok *t, struct work *w, const char *spm_text)
{
    while (w->heap_n > 0) {
        struct bigram g = heap_pop(w);
        struct sym *l = &w->sym[g.left], *r = &w->sym[g.right];
        /* stale: a side was merged away or has grown since it was queued */
        if (l->len == 0 || r->len == 0 || l->len + r->len != g.len)
            continue;
        l->len += r->len;
        l->id = g.result;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0)
            w->sym[r->next].prev = g.left;
        if (spm_text != NULL) {
            spm_try_pair(t, w, spm_text, l->prev, g.left);
            spm_try_pair(t, w, spm_text, g.left, l->next);
        } else {
            try_pair(t, w, l->prev, g.left);
            try_pair(t, w, g.left, l->next);
        }
    }
}

/* Emits one final symbol s[y.start..+y.len): its token, or one byte token per
 * byte. (llama.cpp's resegment() would first re-split a symbol that is not a
 * token along the merges that made it; but a pair merges only when its text is
 * a token, so every merged symbol is a token and only unmerged characters get
 * here.) */
static void spm_emit(const struct tok *t, const unsigned char *s, const struct sym *y,
                     struct sink *out)
{
    int32_t id = y->id >= 0 ? y->id : find_text(t, (const char *)s + y->start, y->len);
    if (id >= 0) {
        sink_put(out, id);
        return;
    }
    for (uint32_t i = 0; i < y->len; i++)
        if (t->byte_tok[s[y->start + i]] >= 0)
            sink_put(out, t->byte_tok[s[y->start + i]]);
}

/* Tokenizes one stretch of text that holds no special token, the SentencePiece
 * way; prefix puts a space before it. */
static int encode_spm(const struct tok *t, struct work *w, const char *text, size_t len,
                      bool prefix, struct sink *out)
{
    size_t spaces = prefix;
    for (size_t i = 0; i < len; i++)
        spaces += text[i] == ' ';
    if (len > INT32_MAX / 4 || spaces > INT32_MAX / 4)
        return KVD_ERANGE;
    size_t n = len + prefix + 2 * spaces;           /* ' ' (1 byte) -> U+2581 (3 bytes) */
    if (n > INT32_MAX / 4)
        return KVD_ERANGE;
    if (n > w->esc_cap) {
        char *e = realloc(w->esc, n);
        if (e == NULL)
            return KVD_ENOMEM;
        w->esc = e;
        w->esc_cap = n;
    }
    if (n == 0)
        return 0;
    if (work_reserve_syms(w, n) < 0)
        return KVD_ENOMEM;
    char *s = w->esc;
    size_t k = 0;
    if (prefix) {
        memcpy(s, SPM_SPACE, 3);
        k = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(s + k, SPM_SPACE, 3);
            k += 3;
        } else {
            s[k++] = text[i];
        }
    }

    int32_t ns = 0;
    for (size_t i = 0; i < n; ns++) {
        size_t cl = spm_char_len((unsigned char)s[i]);
        if (cl > n - i)
            cl = n - i;                             /* a truncated character at the end */
        w->sym[ns] = (struct sym){-1, ns - 1, -1, (uint32_t)i, (uint32_t)cl};
        if (ns > 0)
            w->sym[ns - 1].next = ns;
        i += cl;
    }
    w->heap_n = 0;
    for (int32_t i = 1; i < ns; i++)
        spm_try_pair(t, w, s, i - 1, i);
    merge_queued(t, w, s);
    for (int32_t i = 0; i >= 0; i = w->sym[i].next)
        spm_emit(t, (const unsigned char *)s, &w->sym[i], out);
    return 0;
}

/* ---- special tokens and the entry points ------------------------------------ */

static int frag_push(struct frag **f, size_t *n, size_t *cap, struct frag x)
{
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 16;
        struct frag *nf = realloc(*f, nc * sizeof *nf);
        if (nf == NULL)
            return KVD_ENOMEM;
        *f = nf;
        *cap = nc;
    }
    (*f)[(*n)++] = x;
    return 0;
}

/* Sets w->present[k] for every special k whose text occurs in text[0..len):
 * one pass over the text, looking up only where a special text could start. */
static int find_present(const struct tok *t, struct work *w, const char *text, size_t len)
{
    w->present = calloc(t->n_specials ? t->n_specials : 1, 1);
    if (w->present == NULL)
        return KVD_ENOMEM;
    const unsigned char *u = (const unsigned char *)text;
    for (size_t i = 0; i < len; i++) {
        unsigned two = i + 1 < len ? (unsigned)u[i] << 8 | u[i + 1] : 0;
        bool one = t->sp_byte[u[i] >> 3] & (1u << (u[i] & 7));
        bool more = i + 1 < len && (t->sp_start[two >> 3] & (1u << (two & 7)));
        if (!one && !more)
            continue;
        for (size_t j = 0; j < t->n_sp_lens && t->sp_lens[j] <= len - i; j++) {
            if ((t->sp_lens[j] == 1 && !one) || (t->sp_lens[j] > 1 && !more))
                continue;
            for (int32_t k = special_find(t, text + i, t->sp_lens[j]); k >= 0; k = t->sp_next[k])
                w->present[k] = 1;
        }
    }
    return 0;
}

/* Cuts special tokens out of the text, the way llama.cpp does: for each
 * special token, longest first, every raw fragment is split at each of its
 * leftmost non-overlapping occurrences. Leaves w->frags[0..*n). */
static int partition(const struct tok *t, struct work *w, const char *text, size_t len,
                     bool parse_special, size_t *n)
{
    size_t nf = 0;
    if (len > 0 && frag_push(&w->frags, &nf, &w->frag_cap, (struct frag){0, len, -1}) < 0)
        return KVD_ENOMEM;
    if (len > 0 && find_present(t, w, text, len) < 0)
        return KVD_ENOMEM;
    for (size_t k = 0; k < t->n_specials && nf > 0; k++) {
        int32_t id = t->specials[k];
        const struct tok_entry *e = &t->tokens[id];
        if (!w->present[k] || (!parse_special && e->type != TOK_TYPE_USER_DEFINED))
            continue;
        const char *sp = t->text_blob + e->text_off;
        size_t sl = e->text_len;
        bool found = false;
        for (size_t i = 0; i < nf && !found; i++)
            found = w->frags[i].id < 0 && memmem(text + w->frags[i].off, w->frags[i].len, sp, sl);
        if (!found)
            continue;
        size_t n2 = 0;
        for (size_t i = 0; i < nf; i++) {
            struct frag f = w->frags[i];
            while (f.id < 0) {
                const char *hit = memmem(text + f.off, f.len, sp, sl);
                if (hit == NULL)
                    break;
                size_t at = (size_t)(hit - text);
                struct frag left = {f.off, at - f.off, -1};
                if (at > f.off && frag_push(&w->frags2, &n2, &w->frag_cap2, left) < 0)
                    return KVD_ENOMEM;
                if (frag_push(&w->frags2, &n2, &w->frag_cap2, (struct frag){at, 0, id}) < 0)
                    return KVD_ENOMEM;
                f.len -= at + sl - f.off;
                f.off = at + sl;
            }
            if ((f.id >= 0 || f.len > 0) && frag_push(&w->frags2, &n2, &w->frag_cap2, f) < 0)
                return KVD_ENOMEM;
        }
        struct frag *tf = w->frags;
        w->frags = w->frags2;
        w->frags2 = tf;
        size_t tc = w->frag_cap;
        w->frag_cap = w->frag_cap2;
        w->frag_cap2 = tc;
        nf = n2;
    }
    *n = nf;
    return 0;
}

int tok_encode(const tok_t *t, const char *text, size_t len, bool parse_special,
               int32_t *out, size_t cap, size_t *n_out)
{
    if (t == NULL || n_out == NULL || (text == NULL && len > 0) || (out == NULL && cap > 0))
        return KVD_EINVAL;
    *n_out = 0;
    struct work w = {0};
    struct sink sink = {out, cap, 0};
    size_t nf = 0;
    int rc = partition(t, &w, text, len, parse_special, &nf);
    bool after_special = true;                      /* SPM: the start counts as one */
    for (size_t i = 0; rc == 0 && i < nf; i++) {
        const struct frag *f = &w.frags[i];
        if (f->id >= 0)
            sink_put(&sink, f->id);
        else if (t->model == TOK_MODEL_SPM)
            rc = encode_spm(t, &w, text + f->off, f->len, t->add_space_prefix && after_special,
                            &sink);
        else
            rc = encode_raw(t, &w, text + f->off, f->len, &sink);
        after_special = f->id >= 0;
    }
    work_free(&w);
    if (rc < 0)
        return rc;
    *n_out = sink.n;
    return sink.n > cap ? KVD_ERANGE : 0;
}

int tok_pretokenize(const tok_t *t, const char *text, size_t len,
                    size_t *ends, size_t cap, size_t *n_out)
{
    if (t == NULL || n_out == NULL || (text == NULL && len > 0) || (ends == NULL && cap > 0))
        return KVD_EINVAL;
    *n_out = 0;
    if (t->model == TOK_MODEL_SPM) {                /* no pre-tokenizer: one word */
        *n_out = len > 0;
        if (len > 0 && cap > 0)
            ends[0] = len;
        return len > 0 && cap == 0 ? KVD_ERANGE : 0;
    }
    struct work w = {0};
    int rc = pretokenize(t, &w, text, len);
    if (rc == 0) {
        for (size_t k = 0; k < w.n_ends && k < cap; k++)
            ends[k] = w.src[w.ends[k]];
        *n_out = w.n_ends;
        if (w.n_ends > cap)
            rc = KVD_ERANGE;
    }
    work_free(&w);
    return rc;
}

/* ---- decoding and queries ------------------------------------------------ */

static bool valid_id(const struct tok *t, int32_t id)
{
    return t != NULL && id >= 0 && (size_t)id < t->n;
}

int tok_decode_piece(const tok_t *t, int32_t id, char *buf, size_t cap, size_t *n)
{
    if (n == NULL || (buf == NULL && cap > 0))
        return KVD_EINVAL;
    *n = 0;
    if (!valid_id(t, id))
        return KVD_EINVAL;
    const struct tok_entry *e = &t->tokens[id];
    *n = e->piece_len;
    if (e->piece_len > cap)
        return KVD_ERANGE;
    if (e->piece_len > 0)
        memcpy(buf, t->piece_blob + e->piece_off, e->piece_len);
    return 0;
}

int tok_decode(const tok_t *t, const int32_t *ids, size_t n_ids, char *buf, size_t cap,
               size_t *n)
{
    if (t == NULL || n == NULL || (ids == NULL && n_ids > 0) || (buf == NULL && cap > 0))
        return KVD_EINVAL;
    *n = 0;
    size_t total = 0;
    for (size_t i = 0; i < n_ids; i++) {
        if (!valid_id(t, ids[i]))
            return KVD_EINVAL;
        const struct tok_entry *e = &t->tokens[ids[i]];
        const char *p = t->piece_blob + e->piece_off;
        size_t pl = e->piece_len;
        if (i == 0 && t->add_space_prefix && pl > 0 && p[0] == ' ') {
            p++;                                    /* the space tokenizing put there */
            pl--;
        }
        if (total + pl <= cap && pl > 0)
            memcpy(buf + total, p, pl);
        total += pl;
    }
    *n = total;
    return total > cap ? KVD_ERANGE : 0;
}

size_t tok_n_vocab(const tok_t *t) { return t->n; }
int32_t tok_bos(const tok_t *t) { return t->bos; }
int32_t tok_eos(const tok_t *t) { return t->eos; }
int32_t tok_eot(const tok_t *t) { return t->eot; }
int32_t tok_unk(const tok_t *t) { return t->unk; }
int32_t tok_pad(const tok_t *t) { return t->pad; }
bool tok_add_bos(const tok_t *t) { return t->add_bos; }
const char *tok_pre_name(const tok_t *t) { return t->pre->name; }
enum tok_model tok_model_kind(const tok_t *t) { return t->model; }
bool tok_add_space_prefix(const tok_t *t) { return t->add_space_prefix; }

bool tok_is_eog(const tok_t *t, int32_t id)
{
    return valid_id(t, id) && t->tokens[id].eog;
}

int tok_type(const tok_t *t, int32_t id)
{
    return valid_id(t, id) ? t->tokens[id].type : -1;
}

int32_t tok_find(const tok_t *t, const char *text)
{
    if (t == NULL || text == NULL || text[0] == '\0')
        return -1;
    return find_text(t, text, strlen(text));
}

const char *tok_text(const tok_t *t, int32_t id, size_t *len)
{
    if (!valid_id(t, id))
        return NULL;
    if (len != NULL)
        *len = t->tokens[id].text_len;
    return t->text_blob + t->tokens[id].text_off;
}
