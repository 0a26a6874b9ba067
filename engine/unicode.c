/*
 * unicode.c - UTF-8 helpers and code-point class lookup (see unicode.h).
 */
#include "unicode.h"

static uint16_t flags_search(uint32_t cp)
{
    /* the last row with first <= cp; row 0 starts at 0 */
    size_t lo = 0, hi = unicode_n_ranges - 1;
    while (lo < hi) {
        size_t mid = lo + (hi - lo + 1) / 2;
        if (unicode_ranges[mid].first <= cp)
            lo = mid;
        else
            hi = mid - 1;
    }
    return unicode_ranges[lo].flags;
}

uint16_t unicode_flags(uint32_t cp)
{
    if (cp < 128)
        return unicode_ascii_flags[cp];
    if (cp > UNICODE_MAX)
        return UNICODE_UNDEFINED;
    return flags_search(cp);
}

static bool is_cont(unsigned char c)
{
    return (c & 0xC0) == 0x80;
}

size_t unicode_utf8_decode(const char *s, size_t len, uint32_t *cp)
{
    const unsigned char *u = (const unsigned char *)s;
    if (len == 0)
        return 0;
    unsigned char c = u[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    if (c < 0xC0)
        goto bad;                                   /* stray continuation byte */
    if (c < 0xE0) {
        if (len < 2 || !is_cont(u[1]))
            goto bad;
        *cp = ((uint32_t)(c & 0x1F) << 6) | (u[1] & 0x3F);
        return 2;
    }
    if (c < 0xF0) {
        if (len < 3 || !is_cont(u[1]) || !is_cont(u[2]))
            goto bad;
        *cp = ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
        return 3;
    }
    if (c < 0xF8) {
        if (len < 4 || !is_cont(u[1]) || !is_cont(u[2]) || !is_cont(u[3]))
            goto bad;
        *cp = ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(u[1] & 0x3F) << 12) |
              ((uint32_t)(u[2] & 0x3F) << 6) | (u[3] & 0x3F);
        return 4;
    }
bad:
    *cp = UNICODE_REPLACEMENT;
    return 1;
}

size_t unicode_utf8_encode(uint32_t cp, char *out)
{
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    if (cp <= UNICODE_MAX) {
        o[0] = (unsigned char)(0xF0 | (cp >> 18));
        o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
        o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[3] = (unsigned char)(0x80 | (cp & 0x3F));
        return 4;
    }
    return 0;
}

bool unicode_utf8_valid(const char *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        uint32_t cp;
        size_t n = unicode_utf8_decode(s + i, len - i, &cp);
        if (n == 1 && (unsigned char)s[i] >= 0x80)
            return false;                           /* undecodable byte */
        /* reject what the lenient decoder lets through */
        if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000))
            return false;                           /* overlong */
        if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > UNICODE_MAX)
            return false;
        i += n;
    }
    return true;
}
