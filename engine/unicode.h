/*
 * unicode.h - UTF-8 decoding and encoding, and the code-point classes that the
 * tokenizer's pre-tokenizers match on (\p{L}, \p{N}, \s, ...).
 *
 * The class table is engine/unicode_data.c, generated from Python's
 * unicodedata by scripts/gen_unicode_data.py; classes are those of llama.cpp's
 * tables, so that text splits into the same words. Lookup is a binary search
 * over sorted ranges (an array for ASCII). Nothing here allocates.
 */
#ifndef KVD_UNICODE_H
#define KVD_UNICODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Class flags of a code point: exactly one of the general-category bits (or
 * UNDEFINED), plus SPACE for White_Space code points. */
enum unicode_flag {
    UNICODE_LETTER = 1 << 0,    /* \p{L} */
    UNICODE_NUMBER = 1 << 1,    /* \p{N} */
    UNICODE_PUNCT = 1 << 2,     /* \p{P} */
    UNICODE_SYMBOL = 1 << 3,    /* \p{S} */
    UNICODE_MARK = 1 << 4,      /* \p{M} */
    UNICODE_SEPARATOR = 1 << 5, /* \p{Z} */
    UNICODE_CONTROL = 1 << 6,   /* \p{C}: Cc Cf Cs Co and unassigned code points */
    UNICODE_UNDEFINED = 1 << 7, /* past U+10FFFF: not a code point */
    UNICODE_SPACE = 1 << 8,     /* \s: the White_Space property (not U+1C..U+1F) */
};

#define UNICODE_MAX 0x10FFFFu       /* the last code point */
#define UNICODE_REPLACEMENT 0xFFFDu /* what an undecodable byte reads as */

/* One row of the generated table. */
struct unicode_range {
    uint32_t first;             /* first code point of the range */
    uint16_t flags;             /* UNICODE_* flags of every code point in it */
};

extern const struct unicode_range unicode_ranges[]; /* sorted by first; last row is 0x110000 */
extern const size_t unicode_n_ranges;               /* rows in unicode_ranges */
extern const char unicode_data_version[];           /* Unicode version of the table */
extern const uint16_t unicode_ascii_flags[128];     /* flags of U+0000..U+007F */

/* Returns the UNICODE_* flags of cp; UNICODE_UNDEFINED for cp > U+10FFFF. */
uint16_t unicode_flags(uint32_t cp);

static inline bool unicode_is_letter(uint32_t cp) { return unicode_flags(cp) & UNICODE_LETTER; }
static inline bool unicode_is_number(uint32_t cp) { return unicode_flags(cp) & UNICODE_NUMBER; }
static inline bool unicode_is_space(uint32_t cp) { return unicode_flags(cp) & UNICODE_SPACE; }

/* Decodes one code point from s[0..len) (len > 0) into *cp and returns the
 * number of bytes it used (1..4). Decoding is as lenient as llama.cpp's:
 * a lead byte followed by the right number of continuation bytes is accepted
 * even when overlong, a surrogate or past U+10FFFF; anything else (a stray
 * continuation byte, a truncated sequence, 0xF8..0xFF) reads as one byte of
 * value UNICODE_REPLACEMENT. Returns 0 only when len == 0. */
size_t unicode_utf8_decode(const char *s, size_t len, uint32_t *cp);

/* Writes the UTF-8 form of cp into out (4 bytes of room) and returns its
 * length, or 0 when cp > U+10FFFF. Surrogates are encoded as they are. */
size_t unicode_utf8_encode(uint32_t cp, char *out);

/* True when s[0..len) is strict UTF-8 (shortest form, no surrogates, at most
 * U+10FFFF). */
bool unicode_utf8_valid(const char *s, size_t len);

#endif
