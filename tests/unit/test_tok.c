/*
 * test_tok.c - the tokenizer (tok), its Unicode tables (unicode) and the chat
 * template (chat).
 *
 * Most checks use a small vocabulary built here: the 256 byte tokens (id =
 * byte value), a few merges and special tokens. When the default model is
 * present, a few ids are also checked against what llama.cpp gives for it.
 */
#include "chat.h"
#include "check.h"
#include "err.h"
#include "gguf.h"
#include "tok.h"
#include "unicode.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- building vocabularies ------------------------------------------------ */

/* GPT-2's bytes_to_unicode, written here independently of tok.c. */
static bool byte_prints(unsigned b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

static unsigned byte_cp(unsigned b)
{
    unsigned n = 0;
    if (byte_prints(b))
        return b;
    for (unsigned c = 0; c < b; c++)
        n += !byte_prints(c);
    return 256 + n;
}

/* Byte-level text of raw[0..n) into out (6 bytes of room per input byte). */
static size_t encode_bytes(const char *raw, size_t n, char *out)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += unicode_utf8_encode(byte_cp((unsigned char)raw[i]), out + k);
    out[k] = '\0';
    return k;
}

#define MAX_TOK 600
#define MAX_MERGE 64

struct tv {
    char *texts[MAX_TOK];       /* byte-level texts, malloc'd */
    int32_t types[MAX_TOK];     /* TOK_TYPE_* */
    size_t n;                   /* tokens */
    char *merges[MAX_MERGE];    /* "A B", malloc'd */
    size_t n_merges;            /* merges */
};

static int32_t tv_add(struct tv *v, const char *text, int type)
{
    REQUIRE(v->n < MAX_TOK);
    v->texts[v->n] = strdup(text);
    v->types[v->n] = type;
    return (int32_t)v->n++;
}

/* Adds the merge of raw strings a + b, and (with add_result) the merged token. */
static void tv_merge(struct tv *v, const char *a, const char *b, bool add_result)
{
    char ea[64], eb[64], rule[130], both[32], eboth[130];
    REQUIRE(v->n_merges < MAX_MERGE && strlen(a) + strlen(b) < sizeof both);
    encode_bytes(a, strlen(a), ea);
    encode_bytes(b, strlen(b), eb);
    snprintf(rule, sizeof rule, "%s %s", ea, eb);
    v->merges[v->n_merges++] = strdup(rule);
    if (add_result) {
        snprintf(both, sizeof both, "%s%s", a, b);
        encode_bytes(both, strlen(both), eboth);
        tv_add(v, eboth, TOK_TYPE_NORMAL);
    }
}

static void tv_free(struct tv *v)
{
    for (size_t i = 0; i < v->n; i++)
        free(v->texts[i]);
    for (size_t i = 0; i < v->n_merges; i++)
        free(v->merges[i]);
    memset(v, 0, sizeof *v);
}

/* The test vocabulary: bytes, merges, special tokens. */
static void tv_standard(struct tv *v)
{
    memset(v, 0, sizeof *v);
    for (unsigned b = 0; b < 256; b++) {
        char text[8];
        text[unicode_utf8_encode(byte_cp(b), text)] = '\0';
        tv_add(v, text, TOK_TYPE_NORMAL);
    }
    tv_merge(v, "h", "e", true);        /* rank 0 */
    tv_merge(v, "t", "he", true);       /* rank 1 */
    tv_merge(v, " ", "the", true);      /* rank 2 */
    tv_merge(v, "i", "n", true);        /* rank 3 */
    tv_merge(v, "in", "g", true);       /* rank 4 */
    tv_merge(v, "a", "a", true);        /* rank 5 */
    tv_merge(v, "b", "c", true);        /* rank 6: before "a b" */
    tv_merge(v, "a", "b", true);        /* rank 7 */
    tv_merge(v, "x", "y", false);       /* rank 8: "xy" is not a token */
    tv_merge(v, " ", " ", true);        /* rank 9 */
    tv_merge(v, "\n", "\n", true);      /* rank 10 */
    tv_merge(v, "'", "s", true);        /* rank 11 */
    tv_merge(v, "\xed", "\x95", true); /* rank 12 */
    tv_merge(v, "\xed\x95", "\x9c", true); /* rank 13: U+D55C, a Hangul syllable */
    tv_add(v, "<|endoftext|>", TOK_TYPE_NORMAL);    /* promoted to CONTROL on load */
    tv_add(v, "<|im_start|>", TOK_TYPE_CONTROL);
    tv_add(v, "<|im_end|>", TOK_TYPE_CONTROL);
    tv_add(v, "<|im", TOK_TYPE_CONTROL);            /* a prefix of two longer ones */
    tv_add(v, "<tool>", TOK_TYPE_USER_DEFINED);
    tv_add(v, "<unk>", TOK_TYPE_UNKNOWN);
    tv_add(v, "<unused0>", TOK_TYPE_UNUSED);
}

static struct tok_vocab tv_vocab(const struct tv *v, const char *pre)
{
    struct tok_vocab vv;
    tok_vocab_init(&vv);
    vv.n_tokens = v->n;
    vv.texts = (const char *const *)v->texts;
    vv.types = v->types;
    vv.n_merges = v->n_merges;
    vv.merges = (const char *const *)v->merges;
    vv.pre = pre;
    return vv;
}

/* Id of the token with this exact text in v, or -1. */
static int32_t tv_id(const struct tv *v, const char *text)
{
    for (size_t i = 0; i < v->n; i++)
        if (strcmp(v->texts[i], text) == 0)
            return (int32_t)i;
    return -1;
}

static tok_t *tv_build(const struct tv *v, const char *pre)
{
    char err[256] = "";
    struct tok_vocab vv = tv_vocab(v, pre);
    vv.bos = tv_id(v, "<|im_start|>");
    vv.eos = tv_id(v, "<|endoftext|>");
    tok_t *t = tok_new(&vv, err, sizeof err);
    if (t == NULL)
        fprintf(stderr, "tok_new: %s\n", err);
    return t;
}

/* Id of the token whose raw bytes are raw (NUL-terminated), or -1. */
static int32_t rid(const tok_t *t, const char *raw)
{
    char text[256];
    encode_bytes(raw, strlen(raw), text);
    return tok_find(t, text);
}

/* Prints s[0..n) with control bytes and non-ASCII escaped. */
static void put_escaped(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c >= 0x7F || c == '"' || c == '\\')
            fprintf(stderr, "\\x%02x", c);
        else
            fputc(c, stderr);
    }
}

/* Encodes text[0..len) and compares with want[0..n); prints both on mismatch. */
static bool ids_are(const tok_t *t, const char *text, size_t len, bool special,
                    const int32_t *want, size_t n)
{
    int32_t got[512];
    size_t ng = 0;
    int rc = tok_encode(t, text, len, special, got, 512, &ng);
    bool ok = rc == 0 && ng == n && memcmp(got, want, n * sizeof *got) == 0;
    if (!ok) {
        fprintf(stderr, "  encode(\"");
        put_escaped(text, len);
        fprintf(stderr, "\", %d): rc %d, got", special, rc);
        for (size_t i = 0; i < ng && i < 512; i++)
            fprintf(stderr, " %d", got[i]);
        fprintf(stderr, "; want");
        for (size_t i = 0; i < n; i++)
            fprintf(stderr, " %d", want[i]);
        fprintf(stderr, "\n");
    }
    return ok;
}

#define CHECK_IDS(t, text, special, ...) do { \
    const int32_t want_[] = {__VA_ARGS__}; \
    CHECK(ids_are(t, text, strlen(text), special, want_, sizeof want_ / sizeof want_[0])); \
} while (0)

/* The pre-tokenizer's words of text, joined with '|'. */
static const char *splits(const tok_t *t, const char *text)
{
    static char buf[2048];
    size_t ends[256], n = 0, k = 0, a = 0;
    if (tok_pretokenize(t, text, strlen(text), ends, 256, &n) != 0)
        return "(error)";
    for (size_t i = 0; i < n; i++) {
        if (i > 0)
            buf[k++] = '|';
        memcpy(buf + k, text + a, ends[i] - a);
        k += ends[i] - a;
        a = ends[i];
    }
    buf[k] = '\0';
    return buf;
}

#define CHECK_SPLIT(t, text, want) do { \
    const char *got_ = splits(t, text); \
    check_count++; \
    if (strcmp(got_, want) != 0) { \
        check_failures++; \
        fprintf(stderr, "%s:%d: split(\"", __FILE__, __LINE__); \
        put_escaped(text, strlen(text)); \
        fprintf(stderr, "\") = \""); \
        put_escaped(got_, strlen(got_)); \
        fprintf(stderr, "\", want \""); \
        put_escaped(want, strlen(want)); \
        fprintf(stderr, "\"\n"); \
    } \
} while (0)

/* text[0..len) as llama.cpp reads it, into out (3 * len bytes): every byte
 * that does not decode becomes U+FFFD, overlong forms their shortest form. */
static size_t llama_reading(const char *text, size_t len, char *out)
{
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        i += unicode_utf8_decode(text + i, len - i, &cp);
        n += unicode_utf8_encode(cp > 0x10FFFF ? 0xFFFD : cp, out + n);
    }
    return n;
}

/* decode(encode(text)) is text as llama.cpp reads it (text itself when it is
 * valid UTF-8). */
static bool round_trips(const tok_t *t, const char *text, size_t len, bool special)
{
    size_t n = 0, m = 0;
    int32_t *ids = malloc((3 * len + 1) * sizeof *ids); /* never more ids than bytes */
    char *back = malloc(3 * len + 1), *want = malloc(3 * len + 1);
    size_t wl = want ? llama_reading(text, len, want) : 0;
    bool ok = ids && back && want && tok_encode(t, text, len, special, ids, 3 * len + 1, &n) == 0 &&
              tok_decode(t, ids, n, back, 3 * len + 1, &m) == 0 && m == wl &&
              memcmp(back, want, wl) == 0;
    if (!ok) {
        fprintf(stderr, "  round trip of \"");
        put_escaped(text, len);
        fprintf(stderr, "\" gave \"");
        put_escaped(back ? back : "", back ? m : 0);
        fprintf(stderr, "\"\n");
    }
    free(ids);
    free(back);
    free(want);
    return ok;
}

/* ---- unicode --------------------------------------------------------------- */

static void test_unicode(void)
{
    CHECK(unicode_flags('a') & UNICODE_LETTER);
    CHECK(unicode_flags('5') & UNICODE_NUMBER);
    CHECK(unicode_flags('!') & UNICODE_PUNCT);
    CHECK(unicode_flags('$') & UNICODE_SYMBOL);
    CHECK_INT(unicode_flags(' '), UNICODE_SEPARATOR | UNICODE_SPACE);
    CHECK_INT(unicode_flags('\n'), UNICODE_CONTROL | UNICODE_SPACE);
    CHECK(unicode_is_space(0x85));                  /* NEXT LINE */
    CHECK(unicode_is_space(0xA0));                  /* NO-BREAK SPACE */
    CHECK(unicode_is_space(0x3000));                /* IDEOGRAPHIC SPACE */
    CHECK(unicode_is_space(0x2028));
    CHECK(!unicode_is_space(0x1C));                 /* str.isspace() says yes; \s says no */
    CHECK(!unicode_is_space(0x200B));               /* ZERO WIDTH SPACE is Cf */
    CHECK(unicode_is_letter(0xD55C));               /* Hangul */
    CHECK(unicode_is_letter(0x4E2D));               /* CJK */
    CHECK(unicode_is_letter(0xE9));
    CHECK(unicode_is_number(0x661));                /* Arabic-Indic one */
    CHECK(unicode_is_number(0xB2));                 /* superscript two (No) */
    CHECK(unicode_is_number(0x216B));               /* Roman numeral (Nl) */
    CHECK_INT(unicode_flags(0x301), UNICODE_MARK);
    CHECK_INT(unicode_flags(0x1F600), UNICODE_SYMBOL);
    CHECK_INT(unicode_flags(0xE000), UNICODE_CONTROL);  /* private use */
    CHECK_INT(unicode_flags(0x378), UNICODE_CONTROL);   /* unassigned */
    CHECK_INT(unicode_flags(0x10FFFF), UNICODE_CONTROL);
    CHECK_INT(unicode_flags(0x110000), UNICODE_UNDEFINED);
    CHECK_INT(unicode_flags(0xFFFFFFFFu), UNICODE_UNDEFINED);

    bool sorted = unicode_ranges[0].first == 0 &&
                  unicode_ranges[unicode_n_ranges - 1].first == 0x110000;
    for (size_t i = 1; i < unicode_n_ranges; i++)
        sorted = sorted && unicode_ranges[i - 1].first < unicode_ranges[i].first;
    CHECK(sorted);
    bool ascii_same = true;     /* the ASCII shortcut agrees with the ranges */
    for (size_t i = 0; i + 1 < unicode_n_ranges && unicode_ranges[i].first < 128; i++)
        for (uint32_t c = unicode_ranges[i].first; c < unicode_ranges[i + 1].first && c < 128; c++)
            ascii_same = ascii_same && unicode_ascii_flags[c] == unicode_ranges[i].flags;
    CHECK(ascii_same);

    uint32_t cp = 0;
    CHECK_INT(unicode_utf8_decode("\xc3\xa9", 2, &cp), 2);
    CHECK_INT(cp, 0xE9);
    CHECK_INT(unicode_utf8_decode("\xf0\x9f\x98\x80", 4, &cp), 4);
    CHECK_INT(cp, 0x1F600);
    CHECK_INT(unicode_utf8_decode("\xff", 1, &cp), 1);
    CHECK_INT(cp, UNICODE_REPLACEMENT);
    CHECK_INT(unicode_utf8_decode("\xe2\x82", 2, &cp), 1);  /* truncated */
    CHECK_INT(cp, UNICODE_REPLACEMENT);
    CHECK_INT(unicode_utf8_decode("\x80" "a", 2, &cp), 1);  /* stray continuation */
    CHECK_INT(cp, UNICODE_REPLACEMENT);
    CHECK_INT(unicode_utf8_decode("\xc0\xaf", 2, &cp), 2);  /* overlong, accepted like llama.cpp */
    CHECK_INT(cp, '/');
    CHECK_INT(unicode_utf8_decode("\xf4\x90\x80\x80", 4, &cp), 4);
    CHECK_INT(cp, 0x110000);
    CHECK_INT(unicode_utf8_decode("a", 0, &cp), 0);

    const uint32_t cps[] = {0, 0x7F, 0x80, 0x7FF, 0x800, 0xFFFF, 0x10000, 0x10FFFF};
    bool enc_ok = true;
    for (size_t i = 0; i < sizeof cps / sizeof cps[0]; i++) {
        char b[4];
        size_t n = unicode_utf8_encode(cps[i], b);
        uint32_t back = 0;
        enc_ok = enc_ok && n > 0 && unicode_utf8_decode(b, n, &back) == n && back == cps[i] &&
                 unicode_utf8_valid(b, n);
    }
    CHECK(enc_ok);
    char b4[4];
    CHECK_INT(unicode_utf8_encode(0x110000, b4), 0);
    CHECK(unicode_utf8_valid("h\xc3\xa9llo \xf4\x8f\xbf\xbf", 11));
    CHECK(!unicode_utf8_valid("\xc0\xaf", 2));
    CHECK(!unicode_utf8_valid("\xed\xa0\x80", 3));  /* surrogate */
    CHECK(!unicode_utf8_valid("\xf4\x90\x80\x80", 4));
    CHECK(!unicode_utf8_valid("a\xff", 2));
}

/* ---- pre-tokenizers ---------------------------------------------------------- */

static void test_pretokenize(const struct tv *v)
{
    tok_t *t = tv_build(v, "smollm");
    REQUIRE(t != NULL);
    CHECK_SPLIT(t, "Hello world! 123", "Hello| world|!| |1|2|3");
    CHECK_SPLIT(t, "I'm you're WE'LL", "I|'m| you|'re| WE|'|LL");   /* case-sensitive */
    CHECK_SPLIT(t, "it's 'tis", "it|'s| '|tis");
    CHECK_SPLIT(t, "IT'S", "IT|'|S");
    CHECK_SPLIT(t, "a   b", "a|  | b");                 /* the last space joins the word */
    CHECK_SPLIT(t, "a \n b", "a| \n| b");
    CHECK_SPLIT(t, "a\n\nb", "a|\n|\n|b");
    CHECK_SPLIT(t, "\t\tx", "\t|\t|x");                 /* only ' ' prefixes a word */
    CHECK_SPLIT(t, "end  ", "end|  ");                  /* trailing run stays whole */
    CHECK_SPLIT(t, "  x", " | x");
    CHECK_SPLIT(t, "line1\nline2", "line|1|\n|line|2");
    CHECK_SPLIT(t, "x 42", "x| |4|2");                  /* digits go first, one by one */
    CHECK_SPLIT(t, "\xec\x95\x88\xeb\x85\x95 \xec\x84\xb8\xea\xb3\x84",
                "\xec\x95\x88\xeb\x85\x95| \xec\x84\xb8\xea\xb3\x84");     /* Korean */
    CHECK_SPLIT(t, "na\xc3\xafve caf\xc3\xa9", "na\xc3\xafve| caf\xc3\xa9");
    CHECK_SPLIT(t, "cafe\xcc\x81 x", "cafe|\xcc\x81| x");  /* a combining mark is not \p{L} */
    CHECK_SPLIT(t, "hi \xf0\x9f\x98\x80\xf0\x9f\x98\x80!", "hi| \xf0\x9f\x98\x80\xf0\x9f\x98\x80!");
    CHECK_SPLIT(t, "x\xd9\xa1\xd9\xa2\xc2\xb2", "x|\xd9\xa1|\xd9\xa2|\xc2\xb2");  /* \p{N} */
    CHECK_SPLIT(t, "a\xc2\xa0" "b", "a|\xc2\xa0|b");     /* NBSP is \s */
    CHECK_SPLIT(t, "a \x1c" "b", "a| \x1c|b");           /* U+001C is not */
    CHECK_SPLIT(t, "a\xff\xfe b", "a|\xff\xfe| b");      /* bad bytes read as U+FFFD */
    CHECK_SPLIT(t, "", "");
    tok_destroy(&t);

    t = tv_build(v, NULL);                              /* llama.cpp's "default" */
    REQUIRE(t != NULL);
    CHECK(strcmp(tok_pre_name(t), "default") == 0);
    CHECK_SPLIT(t, "1234567 a,b!!c", "123|456|7| a|,|b|!!|c");
    CHECK_SPLIT(t, "x ``!!", "x| ``|!!");               /* the backtick is not in its class */
    tok_destroy(&t);

    t = tv_build(v, "gpt-2");
    REQUIRE(t != NULL);
    CHECK_SPLIT(t, "1234567 a,b!!c", "1234567| a|,|b|!!|c");
    CHECK_SPLIT(t, "x ``!!", "x| ``!!");
    tok_destroy(&t);

    t = tv_build(v, "llama3");
    REQUIRE(t != NULL);
    CHECK_SPLIT(t, "HELLO'S 12345\n\n  x", "HELLO|'S| |123|45|\n\n| | x");
    CHECK_SPLIT(t, "!!\n\nx", "!!\n\n|x");
    CHECK_SPLIT(t, "(word", "(word");
    tok_destroy(&t);
}

/* ---- BPE ------------------------------------------------------------------------ */

static void test_bpe(const tok_t *t)
{
    CHECK_IDS(t, "the", false, rid(t, "the"));
    CHECK_IDS(t, " the", false, rid(t, " the"));
    CHECK_IDS(t, "he the", false, rid(t, "he"), rid(t, " the"));
    CHECK_IDS(t, "thing", false, 't', 'h', rid(t, "ing"));
    CHECK_IDS(t, "abc", false, 'a', rid(t, "bc"));              /* lowest rank first */
    CHECK_IDS(t, "aaa", false, rid(t, "aa"), 'a');              /* leftmost on ties */
    CHECK_IDS(t, "aaaa", false, rid(t, "aa"), rid(t, "aa"));
    CHECK_IDS(t, "xy", false, 'x', 'y');                        /* merged, not a token: bytes */
    CHECK_IDS(t, "\xed\x95\x9c", false, rid(t, "\xed\x95\x9c"));
    CHECK_IDS(t, "\xc3\xa9", false, 0xC3, 0xA9);
    CHECK_IDS(t, "it's", false, 'i', 't', rid(t, "'s"));
    CHECK_IDS(t, "\n\n\n", false, rid(t, "\n\n"), '\n');
    CHECK_IDS(t, "a  b", false, 'a', ' ', ' ', 'b');            /* words "a", " ", " b" */
    CHECK_IDS(t, "a  <|im_end|>", true, 'a', rid(t, "  "), tok_find(t, "<|im_end|>"));
    size_t n = 99;
    int32_t one[1];
    CHECK_INT(tok_encode(t, "", 0, true, one, 1, &n), 0);
    CHECK_INT(n, 0);
}

/* ---- special tokens ------------------------------------------------------------ */

static void test_special(const tok_t *t)
{
    int32_t start = tok_find(t, "<|im_start|>"), end = tok_find(t, "<|im_end|>");
    int32_t im = tok_find(t, "<|im"), tool = tok_find(t, "<tool>"), unk = tok_find(t, "<unk>");
    int32_t eot = tok_find(t, "<|endoftext|>");
    REQUIRE(start >= 0 && end >= 0 && im >= 0 && tool >= 0 && unk >= 0 && eot >= 0);

    CHECK_IDS(t, "<|im_start|>user\nhi<|im_end|>", true,
              start, 'u', 's', 'e', 'r', '\n', 'h', 'i', end);
    CHECK_IDS(t, "<|im_end|><|im_end|>", true, end, end);
    CHECK_IDS(t, "<|im_start|>", true, start);                  /* not "<|im" + rest */
    CHECK_IDS(t, "<|imx", true, im, 'x');
    CHECK_IDS(t, "a<tool>b", false, 'a', tool, 'b');            /* user-defined: always */
    CHECK_IDS(t, "<unk>", true, unk);
    CHECK_IDS(t, "<unk>", false, '<', 'u', 'n', 'k', '>');
    CHECK_IDS(t, "<|endoftext|>", true, eot);                   /* NORMAL in the vocab, */
    CHECK_INT(tok_type(t, eot), TOK_TYPE_CONTROL);              /* promoted like llama.cpp */

    /* without parse_special the markers are plain text */
    const char *chat = "<|im_start|>user\nhi<|im_end|>";
    int32_t ids[64];
    size_t n = 0;
    CHECK_INT(tok_encode(t, chat, strlen(chat), false, ids, 64, &n), 0);
    bool plain = n > 2;
    for (size_t i = 0; i < n; i++)
        plain = plain && tok_type(t, ids[i]) == TOK_TYPE_NORMAL;
    CHECK(plain);
    CHECK_INT(ids[0], '<');
    CHECK_INT(ids[1], '|');
    CHECK(round_trips(t, chat, strlen(chat), false));
    CHECK(round_trips(t, chat, strlen(chat), true));
}

/* ---- decoding -------------------------------------------------------------------- */

static void test_decode(const tok_t *t)
{
    char buf[64];
    size_t n = 0;
    CHECK_INT(tok_decode_piece(t, ' ', buf, sizeof buf, &n), 0);   /* "Ġ" */
    CHECK(n == 1 && buf[0] == ' ');
    CHECK_INT(tok_decode_piece(t, rid(t, " the"), buf, sizeof buf, &n), 0);
    CHECK(n == 4 && memcmp(buf, " the", 4) == 0);
    CHECK_INT(tok_decode_piece(t, tok_find(t, "<|im_end|>"), buf, sizeof buf, &n), 0);
    CHECK(n == 10 && memcmp(buf, "<|im_end|>", 10) == 0);
    CHECK_INT(tok_decode_piece(t, tok_find(t, "<unused0>"), buf, sizeof buf, &n), 0);
    CHECK_INT(n, 0);
    CHECK_INT(tok_decode_piece(t, rid(t, " the"), buf, 2, &n), KVD_ERANGE);
    CHECK_INT(n, 4);
    CHECK_INT(tok_decode_piece(t, -1, buf, sizeof buf, &n), KVD_EINVAL);
    CHECK_INT(tok_decode_piece(t, (int32_t)tok_n_vocab(t), buf, sizeof buf, &n), KVD_EINVAL);

    const int32_t two[2] = {rid(t, "he"), rid(t, " the")};
    CHECK_INT(tok_decode(t, two, 2, buf, sizeof buf, &n), 0);
    CHECK(n == 6 && memcmp(buf, "he the", 6) == 0);
    CHECK_INT(tok_decode(t, two, 2, buf, 3, &n), KVD_ERANGE);
    CHECK_INT(n, 6);

    static const char *const texts[] = {
        "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n\n",
        "I'm sure you'll see they've gone", "1234567890 3.14", "\xec\x95\x88\xeb\x85\x95",
        "\xe4\xbd\xa0\xe5\xa5\xbd", "caf\xc3\xa9 cafe\xcc\x81",
        "\xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9",
        "<|im_start|>x<|im_end|><tool><|endoftext|>",
    };
    bool all = true;
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        all = round_trips(t, texts[i], strlen(texts[i]), true) &&
              round_trips(t, texts[i], strlen(texts[i]), false) && all;
    CHECK(all);

    /* invalid UTF-8 reads as llama.cpp reads it */
#define FFFD "\xef\xbf\xbd"
    static const struct { const char *s; size_t n; const char *want; } bad[] = {
        {"\xff\xfe", 2, FFFD FFFD}, {"\xc3", 1, FFFD}, {"a\x80" "b", 3, "a" FFFD "b"},
        {"\xed\xa0\x80", 3, "\xed\xa0\x80"}, {"\xf4\x90\x80\x80", 4, FFFD}, {"\xc0\xaf", 2, "/"},
        {"\xe2\x82 x", 4, FFFD FFFD " x"}, {"\xf8\x88\x80", 3, FFFD FFFD FFFD},
    };
    all = true;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int32_t bid[16];
        size_t bn = 0, wl = strlen(bad[i].want);
        all = tok_encode(t, bad[i].s, bad[i].n, false, bid, 16, &bn) == 0 &&
              tok_decode(t, bid, bn, buf, sizeof buf, &n) == 0 && n == wl &&
              memcmp(buf, bad[i].want, wl) == 0 && all;
    }
    CHECK(all);
    CHECK_IDS(t, "\xff", false, 0xEF, 0xBF, 0xBD);
    CHECK(round_trips(t, "nul\0byte", 8, false));

    /* random bytes, and random mixes of words and specials */
    static const char *const parts[] = {
        " ", "  ", "\n", "the", " the", "'s", "'S", "12", "\xc3\xa9", "\xed\x95\x9c", "<|im_end|>",
        "<tool>", "<|im", "\xff", "\x80", "!", "\xf0\x9f\x98\x80", "\t", "aa", "\xc2\xa0",
    };
    uint32_t seed = 12345;
    char s[256];
    all = true;
    for (int round = 0; round < 300; round++) {
        size_t len = 0;
        int k = 1 + round % 17;
        for (int j = 0; j < k; j++) {
            seed = seed * 1103515245u + 12345u;
            if (round % 3 == 0) {
                s[len++] = (char)(seed >> 16);
            } else {
                const char *p = parts[(seed >> 16) % (sizeof parts / sizeof parts[0])];
                memcpy(s + len, p, strlen(p));
                len += strlen(p);
            }
        }
        all = round_trips(t, s, len, round % 2 == 0) && all;
    }
    CHECK(all);

    /* a buffer too small: the count needed, and the ids that fit */
    int32_t ids[3], full[16];
    size_t nf = 0;
    CHECK_INT(tok_encode(t, "he the aaaa", 11, false, full, 16, &nf), 0);
    CHECK_INT(nf, 5);                                   /* he, " the", " ", aa, aa */
    CHECK_INT(tok_encode(t, "he the aaaa", 11, false, ids, 3, &n), KVD_ERANGE);
    CHECK_INT(n, 5);
    CHECK(memcmp(ids, full, 3 * sizeof *ids) == 0);
    CHECK_INT(tok_encode(t, "he", 2, false, NULL, 0, &n), KVD_ERANGE);
    CHECK_INT(n, 1);
    CHECK_INT(tok_encode(t, NULL, 3, false, ids, 3, &n), KVD_EINVAL);
    CHECK_INT(tok_encode(t, "x", 1, false, ids, 3, NULL), KVD_EINVAL);

    /* a long text */
    size_t big_len = 50000;
    char *big = malloc(big_len);
    REQUIRE(big != NULL);
    for (size_t i = 0; i < big_len; i++)
        big[i] = "the thing aa bc\n  12 <|im_end|>"[i % 31];
    CHECK(round_trips(t, big, big_len, true));
    free(big);
}

/* ---- queries ----------------------------------------------------------------------- */

static void test_queries(const struct tv *v, const tok_t *t)
{
    CHECK_INT(tok_n_vocab(t), v->n);
    CHECK_INT(tok_bos(t), tv_id(v, "<|im_start|>"));
    CHECK_INT(tok_eos(t), tv_id(v, "<|endoftext|>"));
    CHECK_INT(tok_eot(t), tv_id(v, "<|im_end|>"));     /* found by its text */
    CHECK_INT(tok_unk(t), -1);
    CHECK_INT(tok_pad(t), -1);
    CHECK(!tok_add_bos(t));
    CHECK(strcmp(tok_pre_name(t), "smollm") == 0);
    CHECK(tok_is_eog(t, tv_id(v, "<|im_end|>")));
    CHECK(tok_is_eog(t, tv_id(v, "<|endoftext|>")));
    CHECK(!tok_is_eog(t, tv_id(v, "<|im_start|>")));
    CHECK(!tok_is_eog(t, 'a'));
    CHECK(!tok_is_eog(t, -1));
    CHECK(!tok_is_eog(t, (int32_t)v->n));
    CHECK_INT(tok_type(t, 'a'), TOK_TYPE_NORMAL);
    CHECK_INT(tok_type(t, tv_id(v, "<tool>")), TOK_TYPE_USER_DEFINED);
    CHECK_INT(tok_type(t, -5), -1);
    CHECK_INT(tok_find(t, "he"), tv_id(v, "he"));
    CHECK_INT(tok_find(t, "\xc4\xa0the"), tv_id(v, "\xc4\xa0the"));  /* "Ġthe" */
    CHECK_INT(tok_find(t, " the"), -1);                 /* raw bytes are not a text */
    CHECK_INT(tok_find(t, "nope"), -1);
    CHECK_INT(tok_find(t, ""), -1);
    size_t len = 0;
    const char *text = tok_text(t, tv_id(v, "<|im_end|>"), &len);
    CHECK(text != NULL && len == 10 && memcmp(text, "<|im_end|>", 10) == 0);
    CHECK(tok_text(t, -1, &len) == NULL);

    tok_t *l3 = tv_build(v, "llama3");
    REQUIRE(l3 != NULL);
    CHECK(tok_add_bos(l3));                             /* the llama3 default */
    CHECK_IDS(l3, "thing", false, 't', 'h', rid(l3, "ing"));
    tok_destroy(&l3);

    /* duplicate texts: the last one wins, as in llama.cpp */
    struct tv d = {0};
    tv_add(&d, "a", TOK_TYPE_NORMAL);
    tv_add(&d, "b", TOK_TYPE_NORMAL);
    tv_add(&d, "a", TOK_TYPE_NORMAL);
    tok_t *td = tv_build(&d, NULL);
    REQUIRE(td != NULL);
    CHECK_INT(tok_find(td, "a"), 2);
    CHECK_IDS(td, "ab", false, 2, 1);
    tok_destroy(&td);
    tv_free(&d);

    /* a repeated merge rule keeps its first rank, as in llama.cpp */
    tv_add(&d, "a", TOK_TYPE_NORMAL);
    tv_add(&d, "b", TOK_TYPE_NORMAL);
    tv_add(&d, "c", TOK_TYPE_NORMAL);
    tv_merge(&d, "b", "c", true);       /* rank 0, token 3 */
    tv_merge(&d, "a", "b", true);       /* rank 1, token 4 */
    tv_merge(&d, "b", "c", false);      /* rank 2: ignored */
    td = tv_build(&d, NULL);
    REQUIRE(td != NULL);
    CHECK_IDS(td, "abc", false, 0, 3);
    tok_destroy(&td);
    tv_free(&d);
}

/* ---- bad vocabularies ---------------------------------------------------------- */

static bool contains(const char *s, const char *sub)
{
    return strstr(s, sub) != NULL;
}

/* tok_new must fail with an error naming `want`. */
static bool rejects(const struct tok_vocab *vv, const char *want)
{
    char err[256] = "";
    tok_t *t = tok_new(vv, err, sizeof err);
    bool ok = t == NULL && contains(err, want);
    if (!ok)
        fprintf(stderr, "  tok_new: %s, error \"%s\", want \"%s\"\n",
                t ? "accepted" : "rejected", err, want);
    tok_destroy(&t);
    return ok;
}

static void test_bad_vocab(const struct tv *v)
{
    struct tok_vocab vv = tv_vocab(v, "smollm");
    tok_t *good = tok_new(&vv, NULL, 0);
    CHECK(good != NULL);                                /* the baseline is fine */
    tok_destroy(&good);

    const char *merges[MAX_MERGE + 1];
    memcpy(merges, v->merges, v->n_merges * sizeof *merges);
    vv.merges = merges;
    vv.n_merges = v->n_merges + 1;
    merges[v->n_merges] = "q zz";
    CHECK(rejects(&vv, "\"zz\", which is not a token"));
    merges[v->n_merges] = "ab";
    CHECK(rejects(&vv, "is not of the form"));
    merges[v->n_merges] = "a ";
    CHECK(rejects(&vv, "is not of the form"));
    vv = tv_vocab(v, "smollm");

    int32_t types[MAX_TOK];
    memcpy(types, v->types, v->n * sizeof *types);
    types[7] = 9;
    vv.types = types;
    CHECK(rejects(&vv, "token 7 has unknown type 9"));
    vv = tv_vocab(v, "smollm");

    vv.bos = (int32_t)v->n;
    CHECK(rejects(&vv, "bos token id"));
    vv = tv_vocab(v, "smollm");
    vv.eos = -7;
    CHECK(rejects(&vv, "out of range"));
    vv = tv_vocab(v, "smollm");

    vv.pre = "bogus-pre";
    CHECK(rejects(&vv, "unsupported pre-tokenizer 'bogus-pre'"));
    vv = tv_vocab(v, "smollm");

    vv.n_tokens = 0;
    CHECK(rejects(&vv, "no tokens"));
    vv = tv_vocab(v, "smollm");

    const char *texts[MAX_TOK];
    memcpy(texts, v->texts, v->n * sizeof *texts);
    texts[3] = NULL;
    vv.texts = texts;
    CHECK(rejects(&vv, "token 3 has no text"));
}

/* ---- GGUF ------------------------------------------------------------------------- */

/* A growing buffer holding a GGUF file written here. */
struct gb {
    char *p;                    /* bytes */
    size_t n, cap;              /* used, allocated */
    uint64_t n_kv;              /* key/values written */
};

static void gb_put(struct gb *b, const void *d, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2;
        b->p = realloc(b->p, b->cap);
        REQUIRE(b->p != NULL);
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}

static void gb_u32(struct gb *b, uint32_t v) { gb_put(b, &v, 4); }
static void gb_u64(struct gb *b, uint64_t v) { gb_put(b, &v, 8); }

static void gb_str(struct gb *b, const char *s)
{
    gb_u64(b, strlen(s));
    gb_put(b, s, strlen(s));
}

static void gb_key(struct gb *b, const char *key, uint32_t type)
{
    gb_str(b, key);
    gb_u32(b, type);
    b->n_kv++;
}

static void gb_kv_str(struct gb *b, const char *key, const char *val)
{
    gb_key(b, key, GGUF_VT_STRING);
    gb_str(b, val);
}

static void gb_kv_u32(struct gb *b, const char *key, uint32_t val)
{
    gb_key(b, key, GGUF_VT_UINT32);
    gb_u32(b, val);
}

static void gb_kv_strs(struct gb *b, const char *key, char *const *arr, size_t n)
{
    gb_key(b, key, GGUF_VT_ARRAY);
    gb_u32(b, GGUF_VT_STRING);
    gb_u64(b, n);
    for (size_t i = 0; i < n; i++)
        gb_str(b, arr[i]);
}

static void gb_kv_i32s(struct gb *b, const char *key, const int32_t *arr, size_t n)
{
    gb_key(b, key, GGUF_VT_ARRAY);
    gb_u32(b, GGUF_VT_INT32);
    gb_u64(b, n);
    gb_put(b, arr, n * 4);
}

/* What the GGUF written from a test vocabulary holds. */
struct gopt {
    const char *model;          /* tokenizer.ggml.model */
    const char *pre;            /* tokenizer.ggml.pre, or NULL for none */
    size_t n_types;             /* entries of token_type to write */
    bool merges;                /* write tokenizer.ggml.merges */
    uint32_t bos;               /* bos_token_id */
};

/* A GGUF file of the metadata kv (freed) and no tensors, built in b, which
 * the context then borrows. */
static gguf_ctx_t *gguf_of_kv(struct gb *b, struct gb *kv)
{
    memset(b, 0, sizeof *b);
    gb_put(b, "GGUF", 4);
    gb_u32(b, 3);
    gb_u64(b, 0);                                       /* tensors */
    gb_u64(b, kv->n_kv);
    gb_put(b, kv->p, kv->n);
    free(kv->p);
    char err[256] = "";
    gguf_ctx_t *g = gguf_open_buffer(b->p, b->n, err, sizeof err);
    if (g == NULL)
        fprintf(stderr, "  gguf_open_buffer: %s\n", err);
    return g;
}

/* Writes v as GGUF metadata into b (which the context then borrows). */
static gguf_ctx_t *tv_gguf(const struct tv *v, struct gb *b, const struct gopt *o)
{
    struct gb kv = {0};
    gb_kv_str(&kv, "general.architecture", "llama");
    gb_kv_str(&kv, "tokenizer.ggml.model", o->model);
    if (o->pre)
        gb_kv_str(&kv, "tokenizer.ggml.pre", o->pre);
    gb_kv_strs(&kv, "tokenizer.ggml.tokens", v->texts, v->n);
    gb_kv_i32s(&kv, "tokenizer.ggml.token_type", v->types, o->n_types);
    if (o->merges)
        gb_kv_strs(&kv, "tokenizer.ggml.merges", v->merges, v->n_merges);
    gb_kv_u32(&kv, "tokenizer.ggml.bos_token_id", o->bos);
    gb_kv_u32(&kv, "tokenizer.ggml.eos_token_id", 'z');
    return gguf_of_kv(b, &kv);
}

/* Loads the GGUF of o; returns whether the outcome is as wanted (NULL `want`
 * = success), and the tokenizer in *tp when it loaded. */
static bool gguf_case(const struct tv *v, const struct gopt *o, const char *want, tok_t **tp)
{
    struct gb b;
    char err[256] = "";
    gguf_ctx_t *g = tv_gguf(v, &b, o);
    tok_t *t = g ? tok_new_from_gguf(g, err, sizeof err) : NULL;
    bool ok = g != NULL && (want == NULL ? t != NULL : t == NULL && contains(err, want));
    if (!ok)
        fprintf(stderr, "  tok_new_from_gguf: %s, error \"%s\", want \"%s\"\n",
                t ? "accepted" : "rejected", err, want ? want : "success");
    gguf_close(&g);
    free(b.p);                  /* the tokenizer keeps no pointer into the file */
    if (tp != NULL)
        *tp = t;
    else
        tok_destroy(&t);
    return ok;
}

static void test_gguf(const struct tv *v)
{
    struct gopt o = {"gpt2", "smollm", v->n, true, 5};
    tok_t *t = NULL;
    CHECK(gguf_case(v, &o, NULL, &t));
    if (t != NULL) {
        CHECK_INT(tok_n_vocab(t), v->n);
        CHECK_INT(tok_bos(t), 5);
        CHECK_INT(tok_eos(t), 'z');
        CHECK(tok_is_eog(t, 'z'));
        CHECK_IDS(t, " the aaa<|im_end|>", true, rid(t, " the"), ' ', rid(t, "aa"), 'a',
                  tok_find(t, "<|im_end|>"));
        CHECK_INT(tok_type(t, tok_find(t, "<tool>")), TOK_TYPE_USER_DEFINED);
        tok_destroy(&t);
    }

    o = (struct gopt){"bert", "smollm", v->n, true, 5};
    CHECK(gguf_case(v, &o, "unsupported tokenizer model 'bert'", NULL));
    o = (struct gopt){"gpt2", "klingon", v->n, true, 5};
    CHECK(gguf_case(v, &o, "unsupported pre-tokenizer 'klingon'", NULL));
    o = (struct gopt){"gpt2", NULL, v->n, true, 5};    /* absent: "default" */
    CHECK(gguf_case(v, &o, NULL, &t));
    if (t != NULL)
        CHECK(strcmp(tok_pre_name(t), "default") == 0);
    tok_destroy(&t);
    o = (struct gopt){"gpt2", "smollm", v->n - 1, true, 5};
    CHECK(gguf_case(v, &o, "token_type has", NULL));
    o = (struct gopt){"gpt2", "smollm", v->n, false, 5};
    CHECK(gguf_case(v, &o, "tokenizer.ggml.merges is missing", NULL));
    o = (struct gopt){"gpt2", "smollm", v->n, true, (uint32_t)v->n};
    CHECK(gguf_case(v, &o, "bos_token_id", NULL));
}

/* ---- chat templates -------------------------------------------------------------- */

/* SmolLM2-Instruct's template, with real newlines as in the model file. */
static const char smollm2_template[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}";

/* Renders msgs with template t and compares with want. */
static bool renders(const chat_template_t *t, const struct chat_msg *msgs, size_t n, bool gen,
                    const char *want)
{
    char *out = NULL;
    size_t len = 0;
    int rc = chat_apply(t, msgs, n, gen, &out, &len);
    bool ok = rc == 0 && out != NULL && len == strlen(want) && strcmp(out, want) == 0;
    if (!ok) {
        fprintf(stderr, "  chat_apply: rc %d, got \"", rc);
        put_escaped(out ? out : "", out ? len : 0);
        fprintf(stderr, "\"\n  want \"");
        put_escaped(want, strlen(want));
        fprintf(stderr, "\"\n");
    }
    free(out);
    return ok;
}

#define SMOL_SYS "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, " \
                 "trained by Hugging Face<|im_end|>\n"

static void test_chat(void)
{
    char err[256] = "";
    chat_template_t *t = chat_template_new(smollm2_template, strlen(smollm2_template),
                                           err, sizeof err);
    REQUIRE(t != NULL);
    CHECK(strcmp(chat_template_format(t), "chatml") == 0);
    CHECK(chat_template_default_system(t) != NULL &&
          strcmp(chat_template_default_system(t),
                 "You are a helpful AI assistant named SmolLM, trained by Hugging Face") == 0);

    const struct chat_msg user[] = {{"user", "Hi there"}};
    CHECK(renders(t, user, 1, true,
                  SMOL_SYS "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"));
    CHECK(renders(t, user, 1, false, SMOL_SYS "<|im_start|>user\nHi there<|im_end|>\n"));
    const struct chat_msg sys[] = {{"system", "Be brief."}, {"user", "Hi"},
                                   {"assistant", "Hello!"}, {"user", "Bye"}};
    CHECK(renders(t, sys, 4, true,
                  "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                  "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                  "<|im_start|>assistant\n"));
    /* a system message later on does not stop the default */
    const struct chat_msg late[] = {{"user", "a"}, {"system", "b"}};
    CHECK(renders(t, late, 2, false,
                  SMOL_SYS "<|im_start|>user\na<|im_end|>\n<|im_start|>system\nb<|im_end|>\n"));
    CHECK(renders(t, NULL, 0, true, "<|im_start|>assistant\n"));  /* no loop, no default */
    CHECK(renders(t, NULL, 0, false, ""));
    const struct chat_msg empty[] = {{"user", ""}};
    CHECK(renders(t, empty, 1, false, SMOL_SYS "<|im_start|>user\n<|im_end|>\n"));
    const struct chat_msg null_content[] = {{"user", NULL}};
    char *out = NULL;
    size_t len = 0;
    CHECK_INT(chat_apply(t, null_content, 1, true, &out, &len), KVD_EINVAL);
    CHECK(out == NULL);
    chat_template_destroy(&t);
    CHECK(t == NULL);
    chat_template_destroy(&t);                          /* NULL is fine */

    /* the same template with escaped newlines, as tokenizer_config.json has it */
    const char *escaped =
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}";
    t = chat_template_new(escaped, strlen(escaped), err, sizeof err);
    REQUIRE(t != NULL);
    CHECK(renders(t, user, 1, true,
                  SMOL_SYS "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"));
    chat_template_destroy(&t);

    /* plain ChatML: no default system message */
    const char *plain =
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}";
    t = chat_template_new(plain, strlen(plain), err, sizeof err);
    REQUIRE(t != NULL);
    CHECK(chat_template_default_system(t) == NULL);
    CHECK(renders(t, user, 1, true,
                  "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"));
    chat_template_destroy(&t);

    /* a default outside the message loop (Qwen's shape) applies even with no messages */
    const char *qwen =
        "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
        "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\n"
        "You are Qwen.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if "
        "message.role != 'system' %}{{- '<|im_start|>' + message.role + '\\n' + message.content"
        " + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\\n' }}{%- endif %}";
    t = chat_template_new(qwen, strlen(qwen), err, sizeof err);
    REQUIRE(t != NULL);
    CHECK(chat_template_default_system(t) != NULL &&
          strcmp(chat_template_default_system(t), "You are Qwen.") == 0);
    CHECK(renders(t, NULL, 0, true,
                  "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>assistant\n"));
    chat_template_destroy(&t);

    /* anything else is refused with a clear error */
    const char *llama3 =
        "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}";
    err[0] = '\0';
    t = chat_template_new(llama3, strlen(llama3), err, sizeof err);
    CHECK(t == NULL);
    CHECK(strncmp(err, "unsupported chat template: ", 27) == 0);
    CHECK(strchr(err, '\n') == NULL);                   /* one line */
    err[0] = '\0';
    CHECK(chat_template_new("", 0, err, sizeof err) == NULL);
    CHECK(contains(err, "unsupported chat template"));
    CHECK(chat_template_new("<|im_start|> only", 17, NULL, 0) == NULL);
}

/* ---- SentencePiece BPE ------------------------------------------------------------ */

#define U "\xe2\x96\x81"        /* U+2581, SentencePiece's space */

/* An SPM vocabulary as arrays, built here. */
struct sv {
    char *texts[MAX_TOK];       /* texts, malloc'd */
    int32_t types[MAX_TOK];     /* TOK_TYPE_* */
    float scores[MAX_TOK];      /* merge scores, higher first */
    size_t n;                   /* tokens */
};

static int32_t sv_add(struct sv *v, const char *text, int type, float score)
{
    REQUIRE(v->n < MAX_TOK);
    v->texts[v->n] = strdup(text);
    v->types[v->n] = type;
    v->scores[v->n] = score;
    return (int32_t)v->n++;
}

static void sv_free(struct sv *v)
{
    for (size_t i = 0; i < v->n; i++)
        free(v->texts[i]);
    v->n = 0;
}

/* <unk> <s> </s> (ids 0, 1, 2: llama.cpp's defaults), the byte tokens
 * <0x00>..<0xFF> but skip_byte (-1: none skipped), single characters, and
 * pieces whose scores set the order of merges. */
static void sv_standard(struct sv *v, int skip_byte)
{
    memset(v, 0, sizeof *v);
    sv_add(v, "<unk>", TOK_TYPE_UNKNOWN, 0);
    sv_add(v, "<s>", TOK_TYPE_CONTROL, 0);
    sv_add(v, "</s>", TOK_TYPE_CONTROL, 0);
    for (int b = 0; b < 256; b++) {
        char hex[8];
        snprintf(hex, sizeof hex, "<0x%02X>", b);
        if (b != skip_byte)
            sv_add(v, hex, TOK_TYPE_BYTE, 0);
    }
    static const char *const chars[] = {U, "a", "b", "c", "d", "e", "f", "g", "h", "i", "j",
                                        "k", "l", "w", "x", "y", "z"};
    for (size_t i = 0; i < sizeof chars / sizeof chars[0]; i++)
        sv_add(v, chars[i], TOK_TYPE_NORMAL, -100.0f - (float)i);
    sv_add(v, "ab", TOK_TYPE_NORMAL, -1);
    sv_add(v, "bc", TOK_TYPE_NORMAL, -2);
    sv_add(v, "abc", TOK_TYPE_NORMAL, -3);      /* made from ab + c */
    sv_add(v, U "a", TOK_TYPE_NORMAL, -4);
    sv_add(v, U U, TOK_TYPE_NORMAL, -5);
    sv_add(v, "aa", TOK_TYPE_NORMAL, -6);
    sv_add(v, "de", TOK_TYPE_NORMAL, -8);
    sv_add(v, "ef", TOK_TYPE_NORMAL, -0.25f);   /* outscores de, though to its right */
    sv_add(v, "gh", TOK_TYPE_NORMAL, -7);
    sv_add(v, "hi", TOK_TYPE_NORMAL, -7);       /* ties with gh */
    sv_add(v, "jk", TOK_TYPE_NORMAL, -0.0f);
    sv_add(v, "kl", TOK_TYPE_NORMAL, 0.0f);     /* ties with jk: -0 == +0 */
    sv_add(v, "xy", TOK_TYPE_UNUSED, -1);       /* merges like any token */
    sv_add(v, "xyz", TOK_TYPE_NORMAL, -2);
    sv_add(v, "<tool>", TOK_TYPE_USER_DEFINED, 0);
}

static tok_t *sv_build(const struct sv *v, int add_space_prefix, int32_t unk)
{
    char err[256] = "";
    struct tok_vocab vv;
    tok_vocab_init(&vv);
    vv.model = TOK_MODEL_SPM;
    vv.n_tokens = v->n;
    vv.texts = (const char *const *)v->texts;
    vv.types = v->types;
    vv.scores = v->scores;
    vv.bos = 1;
    vv.eos = 2;
    vv.unk = unk;
    vv.add_space_prefix = add_space_prefix;
    tok_t *t = tok_new(&vv, err, sizeof err);
    if (t == NULL)
        fprintf(stderr, "tok_new (SPM): %s\n", err);
    return t;
}

/* decode(ids) == want[0..wl). */
static bool decodes_to(const tok_t *t, const int32_t *ids, size_t n, const char *want, size_t wl)
{
    char buf[256];
    size_t m = 0;
    bool ok = tok_decode(t, ids, n, buf, sizeof buf, &m) == 0 && m == wl &&
              memcmp(buf, want, wl) == 0;
    if (!ok) {
        fprintf(stderr, "  decode gave \"");
        put_escaped(buf, m < sizeof buf ? m : 0);
        fprintf(stderr, "\", want \"");
        put_escaped(want, wl);
        fprintf(stderr, "\"\n");
    }
    return ok;
}

/* decode(encode(text)) is text, byte for byte. */
static bool spm_round_trips(const tok_t *t, const char *text, size_t len, bool special)
{
    int32_t ids[256];
    size_t n = 0;
    return tok_encode(t, text, len, special, ids, 256, &n) == 0 &&
           decodes_to(t, ids, n, text, len);
}

#define F(s) tok_find(t, s)

static void test_spm(void)
{
    struct sv v;
    sv_standard(&v, -1);
    tok_t *t = sv_build(&v, 0, 0);
    REQUIRE(t != NULL);
    CHECK_INT(tok_model_kind(t), TOK_MODEL_SPM);
    CHECK(!tok_add_space_prefix(t));
    CHECK(tok_add_bos(t));                                      /* SPM's default */
    CHECK(strcmp(tok_pre_name(t), "default") == 0);
    CHECK(tok_is_eog(t, 2));

    /* the pair whose token scores highest merges first, wherever it is */
    CHECK_IDS(t, "abc", false, F("abc"));                       /* ab (-1), then abc */
    CHECK_IDS(t, "bcd", false, F("bc"), F("d"));
    CHECK_IDS(t, "def", false, F("d"), F("ef"));                /* ef (-0.25) beats de (-8) */
    CHECK_IDS(t, "cab", false, F("c"), F("ab"));
    /* ties: the leftmost pair */
    CHECK_IDS(t, "aaa", false, F("aa"), F("a"));
    CHECK_IDS(t, "aaaa", false, F("aa"), F("aa"));
    CHECK_IDS(t, "ghi", false, F("gh"), F("i"));                /* gh -7 == hi -7 */
    CHECK_IDS(t, "jkl", false, F("jk"), F("l"));                /* jk -0 == kl +0 */
    /* a merged symbol is always a token, of whatever type (llama.cpp's
     * resegment() finds it at once): the unused "xy" builds "xyz" and stands
     * alone where nothing longer forms */
    CHECK_IDS(t, "xyz", false, F("xyz"));
    CHECK_IDS(t, "xyw", false, F("xy"), F("w"));
    CHECK_INT(tok_type(t, F("xy")), TOK_TYPE_UNUSED);

    /* spaces are U+2581, merged like any character */
    CHECK_IDS(t, " a", false, F(U "a"));
    CHECK_IDS(t, "a  a", false, F("a"), F(U), F(U "a"));        /* ▁a (-4) before ▁▁ (-5) */
    CHECK_IDS(t, "a   ", false, F("a"), F(U U), F(U));
    CHECK_IDS(t, "a", false, F("a"));                           /* add_space_prefix off */

    /* characters that are not tokens fall back to byte tokens */
    CHECK_IDS(t, "\xc3\xa9", false, F("<0xC3>"), F("<0xA9>"));
    CHECK_IDS(t, "q", false, F("<0x71>"));
    /* characters split by lead byte, as llama.cpp splits them: 0xFF starts a
     * four-byte "character" that swallows "abc"; a truncated one ends the text */
    CHECK_IDS(t, "\xff" "abcd", false, F("<0xFF>"), F("<0x61>"), F("<0x62>"), F("<0x63>"),
              F("d"));
    CHECK_IDS(t, "a\xe2\x96", false, F("a"), F("<0xE2>"), F("<0x96>"));
    CHECK_IDS(t, "\x80" "a", false, F("<0x80>"), F("a"));

    /* special tokens as in GPT2 */
    CHECK_IDS(t, "a<s>b", true, F("a"), 1, F("b"));
    CHECK_IDS(t, "a<s>b", false, F("a"), F("<0x3C>"), F("<0x73>"), F("<0x3E>"), F("b"));
    CHECK_IDS(t, "a<tool>b", false, F("a"), F("<tool>"), F("b"));   /* user-defined: always */
    CHECK_IDS(t, "<unk>", true, 0);

    /* decoding: U+2581 as ' ', byte tokens as their byte, specials as text */
    char buf[64];
    size_t n = 0;
    CHECK_INT(tok_decode_piece(t, F(U "a"), buf, sizeof buf, &n), 0);
    CHECK(n == 2 && memcmp(buf, " a", 2) == 0);
    CHECK_INT(tok_decode_piece(t, F("<0xC3>"), buf, sizeof buf, &n), 0);
    CHECK(n == 1 && buf[0] == '\xc3');
    CHECK_INT(tok_decode_piece(t, 1, buf, sizeof buf, &n), 0);
    CHECK(n == 3 && memcmp(buf, "<s>", 3) == 0);
    CHECK_INT(tok_decode_piece(t, F("xy"), buf, sizeof buf, &n), 0);   /* unused: nothing */
    CHECK_INT(n, 0);
    static const char *const texts[] = {
        "abc def  ghi", "  a  ", "caf\xc3\xa9 \xe4\xbd\xa0\xe5\xa5\xbd", "\x80\xbf x\xc3",
        "a<s>b</s><tool> z", "\xf0\x9f\x98\x80\xe2\x80\x8d", "tab\tnew\nline\r\n",
    };
    bool all = true;
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        all = spm_round_trips(t, texts[i], strlen(texts[i]), false) &&
              spm_round_trips(t, texts[i], strlen(texts[i]), true) && all;
    CHECK(all);
    CHECK(spm_round_trips(t, "nul\0byte", 8, false));
    /* ...but not where a bad lead byte swallows part of a U+2581: its bytes
     * fall back to byte tokens and decode as U+2581, as in llama.cpp */
    int32_t ids[16];
    CHECK_INT(tok_encode(t, "\xff\xfe\x80 x", 5, false, ids, 16, &n), 0);
    CHECK(decodes_to(t, ids, n, "\xff\xfe\x80" U "x", 7));

    /* no pre-tokenizer: the text is one word */
    size_t ends[4];
    CHECK_INT(tok_pretokenize(t, "ab cd", 5, ends, 4, &n), 0);
    CHECK(n == 1 && ends[0] == 5);
    CHECK_INT(tok_pretokenize(t, "", 0, ends, 4, &n), 0);
    CHECK_INT(n, 0);
    CHECK_INT(tok_pretokenize(t, "ab", 2, ends, 0, &n), KVD_ERANGE);
    CHECK_INT(n, 1);
    tok_destroy(&t);

    /* add_space_prefix: a space before the text and after each special */
    t = sv_build(&v, 1, 0);
    REQUIRE(t != NULL);
    CHECK(tok_add_space_prefix(t));
    CHECK_IDS(t, "a", false, F(U "a"));
    CHECK_IDS(t, " a", false, F(U), F(U "a"));                  /* ▁a (-4) before ▁▁ (-5) */
    CHECK_IDS(t, "a<s>a", true, F(U "a"), 1, F(U "a"));
    CHECK_IDS(t, "<s>a</s>", true, 1, F(U "a"), 2);
    CHECK_IDS(t, "a<tool>a", false, F(U "a"), F("<tool>"), F(U "a"));
    int32_t none[4];
    CHECK_INT(tok_encode(t, "", 0, false, none, 4, &n), 0);     /* nothing: no text */
    CHECK_INT(n, 0);
    /* decoding drops the first piece's leading space only, as llama.cpp does */
    const int32_t two[2] = {F(U "a"), F(U "a")};
    CHECK(decodes_to(t, two, 2, "a a", 3));
    const int32_t bos_a[2] = {1, F(U "a")};
    CHECK(decodes_to(t, bos_a, 2, "<s> a", 5));
    CHECK(spm_round_trips(t, "a b  c", 6, false));
    tok_destroy(&t);
    sv_free(&v);

    /* a byte without a byte token: the unknown token, or nothing without one */
    sv_standard(&v, 0xA9);
    t = sv_build(&v, 0, 0);
    REQUIRE(t != NULL);
    CHECK_IDS(t, "\xc3\xa9" "a", false, F("<0xC3>"), 0, F("a"));
    tok_destroy(&t);
    t = sv_build(&v, 0, -1);
    REQUIRE(t != NULL);
    CHECK_IDS(t, "\xc3\xa9" "a", false, F("<0xC3>"), F("a"));
    tok_destroy(&t);
    sv_add(&v, "\xa9", TOK_TYPE_NORMAL, -50);                   /* the byte itself as a text */
    t = sv_build(&v, 0, 0);
    REQUIRE(t != NULL);
    CHECK_IDS(t, "\xc3\xa9", false, F("<0xC3>"), F("\xa9"));
    tok_destroy(&t);
    sv_free(&v);
}

#undef F

/* An SPM vocabulary as GGUF metadata: scores as float32 (or int32 when
 * int_scores), n_scores of them; add_space_prefix written unless negative. */
static gguf_ctx_t *sv_gguf(const struct sv *v, struct gb *b, bool int_scores, size_t n_scores,
                           int add_space_prefix)
{
    struct gb kv = {0};
    gb_kv_str(&kv, "general.architecture", "gemma3");
    gb_kv_str(&kv, "tokenizer.ggml.model", "llama");
    gb_kv_str(&kv, "tokenizer.ggml.pre", "not-a-pre-tokenizer");   /* ignored for SPM */
    gb_kv_strs(&kv, "tokenizer.ggml.tokens", v->texts, v->n);
    gb_kv_i32s(&kv, "tokenizer.ggml.token_type", v->types, v->n);
    gb_key(&kv, "tokenizer.ggml.scores", GGUF_VT_ARRAY);
    gb_u32(&kv, int_scores ? GGUF_VT_INT32 : GGUF_VT_FLOAT32);
    gb_u64(&kv, n_scores);
    for (size_t i = 0; i < n_scores; i++) {
        int32_t si = (int32_t)v->scores[i];
        gb_put(&kv, int_scores ? (const void *)&si : (const void *)&v->scores[i], 4);
    }
    if (add_space_prefix >= 0) {
        uint8_t flag = (uint8_t)add_space_prefix;
        gb_key(&kv, "tokenizer.ggml.add_space_prefix", GGUF_VT_BOOL);
        gb_put(&kv, &flag, 1);
    }
    return gguf_of_kv(b, &kv);
}

/* Loads sv_gguf(...); NULL want = must load; else the error must name want. */
static tok_t *spm_gguf_case(const struct sv *v, bool int_scores, size_t n_scores, int asp,
                            const char *want)
{
    struct gb b;
    char err[256] = "";
    gguf_ctx_t *g = sv_gguf(v, &b, int_scores, n_scores, asp);
    tok_t *t = g ? tok_new_from_gguf(g, err, sizeof err) : NULL;
    bool ok = g != NULL && (want == NULL ? t != NULL : t == NULL && contains(err, want));
    if (!ok)
        fprintf(stderr, "  tok_new_from_gguf (SPM): %s, error \"%s\", want \"%s\"\n",
                t ? "accepted" : "rejected", err, want ? want : "success");
    CHECK(ok);
    gguf_close(&g);
    free(b.p);
    return t;
}

static void test_spm_gguf(void)
{
    struct sv v;
    sv_standard(&v, -1);
    /* no id keys: llama.cpp's defaults bos 1, eos 2, unknown 0 */
    tok_t *t = spm_gguf_case(&v, false, v.n, 0, NULL);
    if (t != NULL) {
        CHECK_INT(tok_model_kind(t), TOK_MODEL_SPM);
        CHECK_INT(tok_bos(t), 1);
        CHECK_INT(tok_eos(t), 2);
        CHECK_INT(tok_unk(t), 0);
        CHECK(tok_add_bos(t));
        CHECK(!tok_add_space_prefix(t));
        CHECK_IDS(t, "abc def", false, tok_find(t, "abc"), tok_find(t, U), tok_find(t, "d"),
                  tok_find(t, "ef"));
    }
    tok_destroy(&t);
    t = spm_gguf_case(&v, false, v.n, -1, NULL);                /* absent: on */
    if (t != NULL)
        CHECK(tok_add_space_prefix(t));
    tok_destroy(&t);
    t = spm_gguf_case(&v, true, v.n, 0, NULL);                  /* int32 scores */
    if (t != NULL)
        CHECK_IDS(t, "abc", false, tok_find(t, "abc"));
    tok_destroy(&t);
    t = spm_gguf_case(&v, false, v.n - 1, 0, "tokenizer.ggml.scores has");
    tok_destroy(&t);
    sv_free(&v);

    /* tok_new's checks for SPM */
    sv_standard(&v, -1);
    struct tok_vocab vv;
    tok_vocab_init(&vv);
    vv.model = TOK_MODEL_SPM;
    vv.n_tokens = v.n;
    vv.texts = (const char *const *)v.texts;
    const char *merges[] = {"a b"};
    vv.merges = merges;
    vv.n_merges = 1;
    CHECK(rejects(&vv, "merges for a SentencePiece vocabulary"));
    vv.n_merges = 0;
    vv.model = (enum tok_model)7;
    CHECK(rejects(&vv, "unknown tokenizer model 7"));
    vv.model = TOK_MODEL_SPM;
    vv.add_space_prefix = 0;
    vv.scores = NULL;                                           /* all 0: ties everywhere */
    char err[256] = "";
    t = tok_new(&vv, err, sizeof err);
    REQUIRE(t != NULL);
    CHECK_IDS(t, "abc", false, tok_find(t, "abc"));             /* ab (leftmost), then abc */
    CHECK_IDS(t, "bcab", false, tok_find(t, "bc"), tok_find(t, "ab"));
    tok_destroy(&t);
    sv_free(&v);
}

/* ---- the default model ------------------------------------------------------------ */

static void test_model(void)
{
    const char *path = getenv("KVD_TEST_MODEL");
    if (path == NULL)
        path = KVD_TEST_MODEL;
    if (access(path, R_OK) != 0) {
        fprintf(stderr, "no model at %s: skipping its checks\n", path);
        return;
    }
    char err[256] = "";
    gguf_ctx_t *g = gguf_open(path, err, sizeof err);
    REQUIRE(g != NULL);
    tok_t *t = tok_new_from_gguf(g, err, sizeof err);
    if (t == NULL)
        fprintf(stderr, "tok_new_from_gguf: %s\n", err);
    REQUIRE(t != NULL);
    CHECK_INT(tok_n_vocab(t), 49152);
    CHECK(strcmp(tok_pre_name(t), "smollm") == 0);
    CHECK_INT(tok_bos(t), 1);
    CHECK_INT(tok_eos(t), 2);
    CHECK(!tok_add_bos(t));
    CHECK(tok_is_eog(t, 2));
    CHECK(tok_is_eog(t, 0));
    CHECK(!tok_is_eog(t, 1));
    /* ids as llama.cpp gives them for this model */
    CHECK_IDS(t, "Hello, we can use", false, 19556, 28, 392, 416, 722);
    CHECK_IDS(t, "Hello world! 123", false, 19556, 905, 17, 216, 33, 34, 35);
    CHECK_IDS(t, "Caf\xc3\xa9 d\xc3\xa9j\xc3\xa0 vu.", false, 51, 1939, 2756, 32564, 90, 16739, 386,
              101, 30);
    CHECK_IDS(t, "  multiple   spaces", false, 216, 2701, 256, 5600);
    CHECK_IDS(t, "<|im_start|>user\nhi<|im_end|>", true, 1, 4093, 198, 6004, 2);
    CHECK_IDS(t, "\xff\xfe invalid bytes", false, 24211, 24211, 17903, 15590);   /* U+FFFD */
    CHECK_IDS(t, "caf\xc3 truncated", false, 83, 1939, 24211, 45641);

    struct gguf_str s;
    REQUIRE(gguf_get_str(g, "tokenizer.chat_template", &s) == 0);
    chat_template_t *ct = chat_template_new(s.ptr, (size_t)s.len, err, sizeof err);
    REQUIRE(ct != NULL);
    const struct chat_msg user[] = {{"user", "Hi there"}};
    CHECK(renders(ct, user, 1, true,
                  SMOL_SYS "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"));
    chat_template_destroy(&ct);
    tok_destroy(&t);
    gguf_close(&g);
}

/* Renders with tools and compares with want. */
static bool renders_tools(const chat_template_t *t, const struct chat_msg *msgs, const struct chat_calls *calls,
                          size_t n, const char *const *tools, size_t n_tools, const char *want)
{
    char *out = NULL;
    size_t len = 0;
    int rc = chat_apply_tools(t, msgs, calls, n, tools, n_tools, true, &out, &len);
    bool ok = rc == 0 && out != NULL && len == strlen(want) && strcmp(out, want) == 0;
    if (!ok) {
        fprintf(stderr, "  chat_apply_tools: rc %d, got \"", rc);
        put_escaped(out ? out : "", out ? len : 0);
        fprintf(stderr, "\"\n  want \"");
        put_escaped(want, strlen(want));
        fprintf(stderr, "\"\n");
    }
    free(out);
    return ok;
}

#define TOOLS_BLOCK(defs)                                                                             \
    "# Tools\n\nYou may call functions to answer the user. Their definitions, one JSON object a "     \
    "line, are between <tools> and </tools>:\n<tools>\n" defs "</tools>\n\nTo call a function, "      \
    "answer with a JSON object that names it and gives its arguments, between <tool_call> and "       \
    "</tool_call>:\n<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<arguments as "      \
    "JSON>}}\n</tool_call>"

/* kvd's default tools convention, in ChatML and in Gemma's format. */
static void test_chat_tools(void)
{
    char err[256] = "";
    chat_template_t *t = chat_template_new(smollm2_template, strlen(smollm2_template), err, sizeof err);
    REQUIRE(t != NULL);
    const char *const tools[] = { "{\"name\":\"f\"}", "{\"name\":\"g\",\"description\":\"G.\"}" };
    const char *const calls_json[] = { "{\"name\": \"f\", \"arguments\": {\"x\": 1}}",
                                       "{\"name\": \"g\", \"arguments\": {}}" };
    const struct chat_msg user[] = {{"user", "Hi"}};
    /* no system message: the template's default one, then the tools */
    CHECK(renders_tools(t, user, NULL, 1, tools, 2,
                        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                        "Face\n\n" TOOLS_BLOCK("{\"name\":\"f\"}\n{\"name\":\"g\",\"description\":\"G.\"}\n")
                        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
    /* a round trip: the assistant's calls after its text, the tool's result as a tool turn */
    const struct chat_msg trip[] = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", ""},
                                    {"tool", "{\"y\": 2}"}, {"assistant", "Done."}};
    const struct chat_calls calls[] = {{NULL, 0}, {NULL, 0}, {calls_json, 2}, {NULL, 0}, {NULL, 0}};
    const char *trip_tail =
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\n{\"y\": 2}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nDone.<|im_end|>\n<|im_start|>assistant\n";
    char want[4096];
    snprintf(want, sizeof want, "<|im_start|>system\nBe brief.\n\n%s<|im_end|>\n%s",
             TOOLS_BLOCK("{\"name\":\"f\"}\n"), trip_tail);
    CHECK(renders_tools(t, trip, calls, 5, tools, 1, want));
    /* history with calls but no tools now: no tools block, the turns the same */
    snprintf(want, sizeof want, "<|im_start|>system\nBe brief.<|im_end|>\n%s", trip_tail);
    CHECK(renders_tools(t, trip, calls, 5, NULL, 0, want));
    /* text before calls stays, a newline apart */
    const struct chat_msg said[] = {{"user", "Hi"}, {"assistant", "Let me see."}};
    const struct chat_calls said_calls[] = {{NULL, 0}, {calls_json + 1, 1}};
    CHECK(renders_tools(t, said, said_calls, 2, NULL, 0,
                        SMOL_SYS "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nLet me see.\n"
                        "<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
                        "<|im_start|>assistant\n"));
    /* without tools or tool turns, chat_apply_tools is chat_apply */
    CHECK(renders_tools(t, user, NULL, 1, NULL, 0,
                        SMOL_SYS "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
    const struct chat_calls bad_calls[] = {{NULL, 1}};
    char *out = NULL;
    size_t len = 0;
    CHECK_INT(chat_apply_tools(t, user, bad_calls, 1, NULL, 0, true, &out, &len), KVD_EINVAL);
    CHECK_INT(chat_apply_tools(t, user, NULL, 1, NULL, 1, true, &out, &len), KVD_EINVAL);
    chat_template_destroy(&t);

    /* Gemma: the tools open the first user turn (as a system message does), and
     * a tool's result is a user turn */
    t = chat_template_gemma(err, sizeof err);
    REQUIRE(t != NULL);
    snprintf(want, sizeof want,
             "<start_of_turn>user\n%s\n\nHi<end_of_turn>\n"
             "<start_of_turn>model\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
             "<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call><end_of_turn>\n"
             "<start_of_turn>user\n<tool_response>\n{\"y\": 2}\n</tool_response><end_of_turn>\n"
             "<start_of_turn>model\nDone.<end_of_turn>\n<start_of_turn>model\n",
             TOOLS_BLOCK("{\"name\":\"f\"}\n"));
    CHECK(renders_tools(t, trip + 1, calls + 1, 4, tools, 1, want));
    chat_template_destroy(&t);
}

int main(void)
{
    struct tv v;
    tv_standard(&v);
    tok_t *t = tv_build(&v, "smollm");
    REQUIRE(t != NULL);

    test_unicode();
    test_pretokenize(&v);
    test_bpe(t);
    test_special(t);
    test_decode(t);
    test_queries(&v, t);
    test_bad_vocab(&v);
    test_gguf(&v);
    test_spm();
    test_spm_gguf();
    test_chat();
    test_chat_tools();
    test_model();

    tok_destroy(&t);
    CHECK(t == NULL);
    tok_destroy(&t);
    tv_free(&v);
    return CHECK_DONE();
}
