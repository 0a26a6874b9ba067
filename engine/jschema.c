/* jschema.c - a JSON Schema subset compiled to a byte grammar (grammar.h). */
#include "jschema.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"

#define JS_MAX_NEST 128         /* schema objects inside each other, before $ref */
#define JS_MAX_INT_DIGITS 15    /* integers stay inside jansson's json_int_t */
#define JS_MAX_FRAC_DIGITS 15
#define JS_MAX_EXP_DIGITS 2     /* no overflow to infinity */
#define RX_MAX_REPEAT 1000      /* the largest bound of a {n,m} */
#define RX_MAX_STATES 200000    /* states one pattern may take */

struct jschema_params jschema_default_params(void)
{
    struct jschema_params p = { .ws_compact = false, .ws_max_indent = 16, .strict = true };
    return p;
}

/* A schema object compiled to a rule (or being compiled: -2 for a $ref in
 * progress, to find circular ones). */
struct memo {
    const json_t *node;         /* a schema object of the document */
    int32_t rule;               /* its rule */
};

struct jc {
    gbuild_t *b;                /* the builder the rules go to */
    struct jschema_params p;    /* whitespace and strictness */
    const json_t *root;         /* the document, for $ref */
    struct memo *memo;          /* (n_memo) */
    size_t n_memo, cap_memo;    /* entries, room */
    int32_t any_rule;           /* any JSON value; -1 until needed */
    char *err;
    size_t errlen;
    int code;                   /* the first failure, 0 */
};

/* Frees what json_dumps returned, with the allocator jansson was given (a
 * program may have set its own: kvd's HTTP layer counts its JSON's memory). */
static void json_text_free(char *t)
{
    json_free_t f = NULL;
    json_get_alloc_funcs(NULL, &f);
    (f ? f : free)(t);
}

__attribute__((format(printf, 3, 4)))
static int32_t fail(struct jc *c, int code, const char *fmt, ...)
{
    if (c->code == 0) {
        c->code = code;
        if (c->err != NULL && c->errlen > 0) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(c->err, c->errlen, fmt, ap);
            va_end(ap);
        }
    }
    return -1;
}

/* "at /properties/x", or "at the top level". */
static const char *where(const char *path, char *buf, size_t n)
{
    if (path[0] == '\0')
        snprintf(buf, n, "at the top level");
    else
        snprintf(buf, n, "at %s", path);
    return buf;
}

#define WHERE(path) where((path), (char[600]){ 0 }, 600)

/* path + "/" + name, with name escaped as a JSON pointer token. */
static void path_add(char *out, size_t n, const char *path, const char *name)
{
    size_t k = (size_t)snprintf(out, n, "%s/", path);
    for (const char *p = name; *p && k + 3 < n; p++) {
        if (*p == '~') {
            out[k++] = '~';
            out[k++] = '0';
        } else if (*p == '/') {
            out[k++] = '~';
            out[k++] = '1';
        } else {
            out[k++] = *p;
        }
    }
    if (k < n)
        out[k] = '\0';
}

static void path_idx(char *out, size_t n, const char *path, const char *name, size_t i)
{
    snprintf(out, n, "%s/%s/%zu", path, name, i);
}

static int32_t memo_get(const struct jc *c, const json_t *node)
{
    for (size_t i = 0; i < c->n_memo; i++)
        if (c->memo[i].node == node)
            return c->memo[i].rule;
    return -1;
}

static bool memo_set(struct jc *c, const json_t *node, int32_t rule)
{
    for (size_t i = 0; i < c->n_memo; i++)
        if (c->memo[i].node == node) {
            c->memo[i].rule = rule;
            return true;
        }
    if (c->n_memo == c->cap_memo) {
        size_t cap = c->cap_memo ? c->cap_memo * 2 : 32;
        struct memo *m = realloc(c->memo, cap * sizeof *m);
        if (m == NULL) {
            fail(c, KVD_ENOMEM, "out of memory");
            return false;
        }
        c->memo = m;
        c->cap_memo = cap;
    }
    c->memo[c->n_memo++] = (struct memo){ node, rule };
    return true;
}

/* ---- pieces of JSON -------------------------------------------------------------- */

static int32_t ws(struct jc *c, int32_t s)
{
    if (s < 0)
        return -1;
    if (c->p.ws_compact)
        return s;
    return grammar_build_ws(c->b, s, c->p.ws_max_indent);
}

static int32_t lit(struct jc *c, int32_t s, const char *text)
{
    return grammar_build_lit(c->b, s, text, strlen(text));
}

static int32_t state(struct jc *c, int32_t like) { return grammar_build_state(c->b, like); }

static void bytes(struct jc *c, int32_t from, uint8_t lo, uint8_t hi, int32_t to)
{
    grammar_build_bytes(c->b, from, lo, hi, to, GRAMMAR_OP_NONE, 0);
}

static void eps(struct jc *c, int32_t from, int32_t to) { grammar_build_eps(c->b, from, to); }

/* -?(0|[1-9][0-9]{0,14}) */
static int32_t build_integer(struct jc *c, int32_t from)
{
    int32_t m = state(c, from), end = state(c, from), d = state(c, from);
    eps(c, from, m);
    bytes(c, from, '-', '-', m);
    bytes(c, m, '0', '0', end);
    bytes(c, m, '1', '9', d);
    eps(c, d, end);
    for (int k = 1; k < JS_MAX_INT_DIGITS; k++) {
        int32_t d2 = state(c, from);
        bytes(c, d, '0', '9', d2);
        eps(c, d2, end);
        d = d2;
    }
    return end;
}

/* integer (\.[0-9]{1,15})? ([eE][+-]?[0-9]{1,2})? */
static int32_t build_number(struct jc *c, int32_t from)
{
    int32_t ip = build_integer(c, from);
    int32_t fe = state(c, from), f = state(c, from);
    eps(c, ip, fe);
    bytes(c, ip, '.', '.', f);
    for (int k = 0; k < JS_MAX_FRAC_DIGITS; k++) {
        int32_t f2 = state(c, from);
        bytes(c, f, '0', '9', f2);
        eps(c, f2, fe);
        f = f2;
    }
    int32_t end = state(c, from), e0 = state(c, from), e1 = state(c, from);
    eps(c, fe, end);
    bytes(c, fe, 'e', 'e', e0);
    bytes(c, fe, 'E', 'E', e0);
    eps(c, e0, e1);
    bytes(c, e0, '+', '+', e1);
    bytes(c, e0, '-', '-', e1);
    int32_t x = e1;
    for (int k = 0; k < JS_MAX_EXP_DIGITS; k++) {
        int32_t x2 = state(c, from);
        bytes(c, x, '0', '9', x2);
        eps(c, x2, end);
        x = x2;
    }
    return end;
}

/* The rule of any JSON value (the schema true, json_object's values). */
static int32_t build_any_object(struct jc *c, int32_t from, int32_t value);
static int32_t any_rule(struct jc *c)
{
    if (c->any_rule >= 0)
        return c->any_rule;
    int32_t r = grammar_build_rule(c->b);
    c->any_rule = r;
    int32_t s = grammar_build_start(c->b, r), end = state(c, s);
    grammar_build_final(c->b, end);
    eps(c, lit(c, s, "null"), end);
    eps(c, lit(c, s, "true"), end);
    eps(c, lit(c, s, "false"), end);
    eps(c, build_number(c, s), end);
    eps(c, grammar_build_string(c->b, lit(c, s, "\""), 0, UINT32_MAX), end);
    eps(c, build_any_object(c, s, r), end);
    /* [ ws (value (, ws value)*)? ws ] */
    int32_t a = ws(c, lit(c, s, "[")), v = state(c, s);
    bytes(c, a, ']', ']', end);
    grammar_build_call(c->b, a, r, v, GRAMMAR_OP_NONE, 0);
    bytes(c, ws(c, v), ']', ']', end);
    grammar_build_call(c->b, ws(c, lit(c, v, ",")), r, v, GRAMMAR_OP_NONE, 0);
    return r;
}

/* { ws ("key" : ws value (, ws "key" : ws value)*)? ws } with values of rule `value` */
static int32_t build_any_object(struct jc *c, int32_t from, int32_t value)
{
    int32_t end = state(c, from), a = ws(c, lit(c, from, "{")), v = state(c, from);
    bytes(c, a, '}', '}', end);
    int32_t k = grammar_build_string(c->b, lit(c, a, "\""), 0, UINT32_MAX);
    grammar_build_call(c->b, ws(c, lit(c, k, ":")), value, v, GRAMMAR_OP_NONE, 0);
    bytes(c, ws(c, v), '}', '}', end);
    int32_t k2 = grammar_build_string(c->b, lit(c, ws(c, lit(c, v, ",")), "\""), 0, UINT32_MAX);
    grammar_build_call(c->b, ws(c, lit(c, k2, ":")), value, v, GRAMMAR_OP_NONE, 0);
    return end;
}

/* ---- regular expressions (pattern, format) -------------------------------------- */

struct cr {
    uint32_t lo, hi;            /* code points, inclusive */
};

struct cset {
    struct cr *r;               /* (n) sorted, disjoint, not adjacent once normalized */
    uint32_t n, cap;            /* ranges, room */
};

enum { RX_SET, RX_CAT, RX_ALT, RX_REP };

struct rx {
    uint8_t kind;               /* RX_* */
    uint32_t min, max;          /* RX_REP: bounds (max UINT32_MAX: none) */
    struct cset set;            /* RX_SET */
    struct rx **kid;            /* (n_kid) RX_CAT, RX_ALT: parts; RX_REP: one */
    uint32_t n_kid, cap_kid;    /* parts, room */
};

struct rxp {
    struct jc *c;               /* for failures */
    const char *s;              /* the pattern */
    size_t i, n;                /* position, length */
    const char *what;           /* "pattern" or "format 'date'", for messages */
    const char *path;           /* the schema's place, for messages */
};

static void rx_free(struct rx *r)
{
    if (r == NULL)
        return;
    for (uint32_t i = 0; i < r->n_kid; i++)
        rx_free(r->kid[i]);
    free(r->kid);
    free(r->set.r);
    free(r);
}

static struct rx *rx_new(struct rxp *p, int kind)
{
    struct rx *r = calloc(1, sizeof *r);
    if (r == NULL)
        fail(p->c, KVD_ENOMEM, "out of memory");
    else
        r->kind = (uint8_t)kind;
    return r;
}

static bool rx_add(struct rxp *p, struct rx *r, struct rx *k)
{
    if (k == NULL)
        return false;
    if (r->n_kid == r->cap_kid) {
        uint32_t cap = r->cap_kid ? r->cap_kid * 2 : 4;
        struct rx **q = realloc(r->kid, cap * sizeof *q);
        if (q == NULL) {
            rx_free(k);
            fail(p->c, KVD_ENOMEM, "out of memory");
            return false;
        }
        r->kid = q;
        r->cap_kid = cap;
    }
    r->kid[r->n_kid++] = k;
    return true;
}

static bool cset_add(struct rxp *p, struct cset *s, uint32_t lo, uint32_t hi)
{
    if (s->n == s->cap) {
        uint32_t cap = s->cap ? s->cap * 2 : 8;
        struct cr *q = realloc(s->r, cap * sizeof *q);
        if (q == NULL) {
            fail(p->c, KVD_ENOMEM, "out of memory");
            return false;
        }
        s->r = q;
        s->cap = cap;
    }
    s->r[s->n++] = (struct cr){ lo, hi };
    return true;
}

static int cmp_cr(const void *a, const void *b)
{
    const struct cr *x = a, *y = b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

static void cset_norm(struct cset *s)
{
    if (s->n == 0)
        return;
    qsort(s->r, s->n, sizeof *s->r, cmp_cr);
    uint32_t k = 0;
    for (uint32_t i = 1; i < s->n; i++) {
        if (s->r[i].lo <= s->r[k].hi + 1) {
            if (s->r[i].hi > s->r[k].hi)
                s->r[k].hi = s->r[i].hi;
        } else {
            s->r[++k] = s->r[i];
        }
    }
    s->n = k + 1;
}

/* s := all code points not in s (s normalized). */
static bool cset_negate(struct rxp *p, struct cset *s)
{
    struct cset o = { 0 };
    uint32_t next = 0;
    for (uint32_t i = 0; i < s->n; i++) {
        if (s->r[i].lo > next && !cset_add(p, &o, next, s->r[i].lo - 1))
            goto fail;
        next = s->r[i].hi + 1;
    }
    if (next <= 0x10FFFF && !cset_add(p, &o, next, 0x10FFFF))
        goto fail;
    free(s->r);
    *s = o;
    return true;
fail:
    free(o.r);
    return false;
}

/* \d \w \s and their negations into s; false when c is none of them. */
static bool class_escape(struct rxp *p, struct cset *s, char c, bool *ok)
{
    struct cset t = { 0 };
    *ok = true;
    switch (c) {
    case 'd': case 'D':
        *ok = cset_add(p, &t, '0', '9');
        break;
    case 'w': case 'W':
        *ok = cset_add(p, &t, '0', '9') && cset_add(p, &t, 'A', 'Z') && cset_add(p, &t, 'a', 'z') &&
              cset_add(p, &t, '_', '_');
        break;
    case 's': case 'S':
        *ok = cset_add(p, &t, '\t', '\r') && cset_add(p, &t, ' ', ' ');
        break;
    default:
        return false;
    }
    cset_norm(&t);
    if (*ok && (c == 'D' || c == 'W' || c == 'S'))
        *ok = cset_negate(p, &t);
    for (uint32_t i = 0; *ok && i < t.n; i++)
        *ok = cset_add(p, s, t.r[i].lo, t.r[i].hi);
    free(t.r);
    return true;
}

static struct rx *rx_err(struct rxp *p, const char *msg)
{
    fail(p->c, KVD_EUNSUPPORTED, "unsupported %s: %s %s", p->what, msg, WHERE(p->path));
    return NULL;
}

/* One UTF-8 character of the pattern. */
static uint32_t rx_char(struct rxp *p)
{
    const unsigned char *s = (const unsigned char *)p->s;
    uint32_t c = s[p->i++];
    int more = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : 0;
    if (more)
        c &= 0x3Fu >> more;
    while (more-- > 0 && p->i < p->n)
        c = (c << 6) | (s[p->i++] & 0x3Fu);
    return c;
}

/* A character after a backslash (not a class escape); false when unsupported. */
static bool rx_escape_char(struct rxp *p, uint32_t *out)
{
    if (p->i >= p->n)
        return false;
    char e = p->s[p->i];
    switch (e) {
    case 'n': p->i++; *out = '\n'; return true;
    case 't': p->i++; *out = '\t'; return true;
    case 'r': p->i++; *out = '\r'; return true;
    case 'f': p->i++; *out = '\f'; return true;
    case 'v': p->i++; *out = '\v'; return true;
    case 'u': {
        if (p->i + 5 > p->n)
            return false;
        uint32_t v = 0;
        for (int k = 1; k <= 4; k++) {
            char h = p->s[p->i + (size_t)k];
            v <<= 4;
            if (h >= '0' && h <= '9')
                v |= (uint32_t)(h - '0');
            else if (h >= 'a' && h <= 'f')
                v |= (uint32_t)(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F')
                v |= (uint32_t)(h - 'A' + 10);
            else
                return false;
        }
        p->i += 5;
        *out = v;
        return true;
    }
    default:
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9'))
            return false;       /* \b, \B, \1, \p{..}, ... */
        *out = rx_char(p);
        return true;
    }
}

static struct rx *rx_alt(struct rxp *p, int depth);

static struct rx *rx_class(struct rxp *p)
{
    struct rx *r = rx_new(p, RX_SET);
    if (r == NULL)
        return NULL;
    bool neg = false, first = true;
    if (p->i < p->n && p->s[p->i] == '^') {
        neg = true;
        p->i++;
    }
    for (;;) {
        if (p->i >= p->n) {
            rx_free(r);
            return rx_err(p, "an unclosed '['");
        }
        if (p->s[p->i] == ']' && !first) {
            p->i++;
            break;
        }
        first = false;
        uint32_t lo;
        if (p->s[p->i] == '\\') {
            p->i++;
            bool ok;
            if (p->i < p->n && class_escape(p, &r->set, p->s[p->i], &ok)) {
                p->i++;
                if (!ok) {
                    rx_free(r);
                    return NULL;
                }
                continue;
            }
            if (p->i < p->n && p->s[p->i] == 'b') {
                p->i++;
                lo = '\b';
            } else if (!rx_escape_char(p, &lo)) {
                rx_free(r);
                return rx_err(p, "an unsupported escape");
            }
        } else {
            lo = rx_char(p);
        }
        uint32_t hi = lo;
        if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
            p->i++;
            if (p->s[p->i] == '\\') {
                p->i++;
                if (!rx_escape_char(p, &hi)) {
                    rx_free(r);
                    return rx_err(p, "an unsupported escape");
                }
            } else {
                hi = rx_char(p);
            }
            if (hi < lo) {
                rx_free(r);
                return rx_err(p, "a reversed range");
            }
        }
        if (!cset_add(p, &r->set, lo, hi)) {
            rx_free(r);
            return NULL;
        }
    }
    cset_norm(&r->set);
    if (neg && !cset_negate(p, &r->set)) {
        rx_free(r);
        return NULL;
    }
    return r;
}

static struct rx *rx_atom(struct rxp *p, int depth)
{
    char ch = p->s[p->i];
    if (ch == '(') {
        p->i++;
        if (p->i < p->n && p->s[p->i] == '?') {
            if (p->i + 1 < p->n && p->s[p->i + 1] == ':')
                p->i += 2;
            else
                return rx_err(p, "a lookaround or named group");
        }
        struct rx *r = rx_alt(p, depth + 1);
        if (r == NULL)
            return NULL;
        if (p->i >= p->n || p->s[p->i] != ')') {
            rx_free(r);
            return rx_err(p, "an unclosed '('");
        }
        p->i++;
        return r;
    }
    if (ch == '[') {
        p->i++;
        return rx_class(p);
    }
    struct rx *r = rx_new(p, RX_SET);
    if (r == NULL)
        return NULL;
    bool ok = true;
    if (ch == '.') {
        p->i++;
        ok = cset_add(p, &r->set, 0, '\n' - 1) && cset_add(p, &r->set, '\n' + 1, 0x10FFFF);
    } else if (ch == '\\') {
        p->i++;
        uint32_t cp;
        if (p->i < p->n && class_escape(p, &r->set, p->s[p->i], &ok)) {
            p->i++;
        } else if (rx_escape_char(p, &cp)) {
            ok = cset_add(p, &r->set, cp, cp);
        } else {
            rx_free(r);
            return rx_err(p, "an unsupported escape (\\b, a backreference, \\p)");
        }
    } else if (ch == '^' || ch == '$') {
        rx_free(r);
        return rx_err(p, "an anchor inside the expression");
    } else if (ch == '*' || ch == '+' || ch == '?' || ch == ')' || ch == '|') {
        rx_free(r);
        return rx_err(p, "a misplaced operator");
    } else {
        uint32_t cp = rx_char(p);
        ok = cset_add(p, &r->set, cp, cp);
    }
    if (!ok) {
        rx_free(r);
        return NULL;
    }
    cset_norm(&r->set);
    return r;
}

/* {n}, {n,}, {n,m} at p->i; false (p->i unchanged) when it is not one. */
static bool rx_braces(struct rxp *p, uint32_t *min, uint32_t *max)
{
    size_t i = p->i + 1;
    uint64_t a = 0, b;
    size_t d = 0;
    while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9' && d < 9) {
        a = a * 10 + (uint64_t)(p->s[i++] - '0');
        d++;
    }
    if (d == 0 || i >= p->n)
        return false;
    if (p->s[i] == '}') {
        b = a;
    } else if (p->s[i] == ',') {
        i++;
        d = 0;
        b = 0;
        while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9' && d < 9) {
            b = b * 10 + (uint64_t)(p->s[i++] - '0');
            d++;
        }
        if (d == 0)
            b = UINT32_MAX;
        if (i >= p->n || p->s[i] != '}')
            return false;
    } else {
        return false;
    }
    p->i = i + 1;
    *min = (uint32_t)a;
    *max = (uint32_t)b;
    return true;
}

static struct rx *rx_cat(struct rxp *p, int depth)
{
    struct rx *cat = rx_new(p, RX_CAT);
    if (cat == NULL)
        return NULL;
    while (p->i < p->n && p->s[p->i] != '|' && p->s[p->i] != ')') {
        struct rx *a = rx_atom(p, depth);
        if (a == NULL) {
            rx_free(cat);
            return NULL;
        }
        for (;;) {
            uint32_t min, max;
            if (p->i >= p->n)
                break;
            char q = p->s[p->i];
            if (q == '*') {
                min = 0, max = UINT32_MAX, p->i++;
            } else if (q == '+') {
                min = 1, max = UINT32_MAX, p->i++;
            } else if (q == '?') {
                min = 0, max = 1, p->i++;
            } else if (q == '{' && rx_braces(p, &min, &max)) {
                if (min > max || (max != UINT32_MAX && max > RX_MAX_REPEAT) || min > RX_MAX_REPEAT) {
                    rx_free(a);
                    rx_free(cat);
                    return rx_err(p, "a repetition bound above 1000 (or reversed)");
                }
            } else {
                break;
            }
            if (p->i < p->n && p->s[p->i] == '?')
                p->i++;     /* lazy: the same language */
            struct rx *r = rx_new(p, RX_REP);
            if (r == NULL || !rx_add(p, r, a)) {
                rx_free(r);
                rx_free(cat);
                return NULL;
            }
            r->min = min;
            r->max = max;
            a = r;
        }
        if (!rx_add(p, cat, a)) {
            rx_free(cat);
            return NULL;
        }
    }
    return cat;
}

static struct rx *rx_alt(struct rxp *p, int depth)
{
    if (depth > 64)
        return rx_err(p, "groups nested too deep");
    struct rx *alt = rx_new(p, RX_ALT);
    if (alt == NULL)
        return NULL;
    for (;;) {
        if (!rx_add(p, alt, rx_cat(p, depth))) {
            rx_free(alt);
            return NULL;
        }
        if (p->i < p->n && p->s[p->i] == '|') {
            p->i++;
            continue;
        }
        return alt;
    }
}

/* A rough count of the states rx_emit makes (for a size limit). */
static uint64_t rx_size(const struct rx *r)
{
    uint64_t n = 1;
    switch (r->kind) {
    case RX_SET:
        return 8 + 2 * (uint64_t)r->set.n;
    case RX_CAT:
    case RX_ALT:
        for (uint32_t i = 0; i < r->n_kid; i++)
            n += rx_size(r->kid[i]);
        return n;
    default: {
        uint64_t k = rx_size(r->kid[0]);
        uint64_t copies = r->max == UINT32_MAX ? (uint64_t)r->min + 1 : r->max;
        return 2 + k * (copies ? copies : 1);
    }
    }
}

struct rxe {
    struct jc *c;               /* the compiler and its builder */
    enum grammar_op op;         /* on each character's first byte: the length counter */
    uint32_t arg;               /* its bound */
};

static int utf8_enc(uint32_t cp, uint8_t *o)
{
    if (cp < 0x80) {
        o[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (uint8_t)(0xC0 | (cp >> 6));
        o[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (uint8_t)(0xE0 | (cp >> 12));
        o[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (uint8_t)(0xF0 | (cp >> 18));
    o[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/* Code points [lo, hi] of one UTF-8 length, as chains of byte ranges. */
static void emit_utf8(struct rxe *e, int32_t from, int32_t end, uint32_t lo, uint32_t hi)
{
    uint8_t a[4], z[4];
    int n = utf8_enc(lo, a);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                emit_utf8(e, from, end, lo, lo | m);
                emit_utf8(e, from, end, (lo | m) + 1, hi);
                return;
            }
            if ((hi & m) != m) {
                emit_utf8(e, from, end, lo, (hi & ~m) - 1);
                emit_utf8(e, from, end, hi & ~m, hi);
                return;
            }
        }
    }
    utf8_enc(hi, z);
    int32_t s = from;
    for (int k = 0; k < n; k++) {
        int32_t t = k == n - 1 ? end : state(e->c, from);
        grammar_build_bytes(e->c->b, s, a[k], z[k], t, k == 0 ? e->op : GRAMMAR_OP_NONE, e->arg);
        s = t;
    }
}

/* One escaped character: its JSON spelling. */
static void emit_escaped(struct rxe *e, int32_t from, int32_t end, const char *spelling)
{
    size_t n = strlen(spelling);
    int32_t s = from;
    for (size_t k = 0; k < n; k++) {
        int32_t t = k == n - 1 ? end : state(e->c, from);
        uint8_t ch = (uint8_t)spelling[k];
        grammar_build_bytes(e->c->b, s, ch, ch, t, k == 0 ? e->op : GRAMMAR_OP_NONE, e->arg);
        s = t;
    }
}

/* The characters of set s, each in its JSON spelling (raw UTF-8; \" \\ \t \n
 * \r for those; other control characters are left out). */
static void emit_set(struct rxe *e, const struct cset *s, int32_t from, int32_t end)
{
    static const uint32_t cuts[] = { 0x20, 0x22, 0x23, 0x5C, 0x5D, 0x80, 0x800, 0xD800, 0xE000, 0x10000 };
    for (uint32_t i = 0; i < s->n; i++) {
        uint32_t lo = s->r[i].lo, hi = s->r[i].hi;
        while (lo <= hi) {
            uint32_t top = hi;
            for (size_t k = 0; k < sizeof cuts / sizeof *cuts; k++)
                if (cuts[k] > lo && cuts[k] - 1 < top)
                    top = cuts[k] - 1;
            if (lo < 0x20) {
                for (uint32_t cp = lo; cp <= top; cp++)
                    if (cp == '\t' || cp == '\n' || cp == '\r')
                        emit_escaped(e, from, end, cp == '\t' ? "\\t" : cp == '\n' ? "\\n" : "\\r");
            } else if (lo == '"') {
                emit_escaped(e, from, end, "\\\"");
            } else if (lo == '\\') {
                emit_escaped(e, from, end, "\\\\");
            } else if (lo < 0xD800 || lo >= 0xE000) {
                emit_utf8(e, from, end, lo, top);
            }
            if (top == 0x10FFFF)
                break;
            lo = top + 1;
        }
    }
}

static int32_t rx_emit(struct rxe *e, const struct rx *r, int32_t from)
{
    struct jc *c = e->c;
    if (from < 0 || c->code)
        return -1;
    switch (r->kind) {
    case RX_SET: {
        int32_t end = state(c, from);
        emit_set(e, &r->set, from, end);
        return end;
    }
    case RX_CAT: {
        int32_t s = from;
        if (r->n_kid == 0) {
            s = state(c, from);
            eps(c, from, s);
        }
        for (uint32_t i = 0; i < r->n_kid; i++)
            s = rx_emit(e, r->kid[i], s);
        return s;
    }
    case RX_ALT: {
        int32_t end = state(c, from);
        for (uint32_t i = 0; i < r->n_kid; i++)
            eps(c, rx_emit(e, r->kid[i], from), end);
        return end;
    }
    default: {
        int32_t s = from;
        for (uint32_t k = 0; k < r->min; k++)
            s = rx_emit(e, r->kid[0], s);
        if (r->max == UINT32_MAX) {
            int32_t loop = state(c, from);
            eps(c, s, loop);
            eps(c, rx_emit(e, r->kid[0], loop), loop);
            return loop;
        }
        int32_t end = state(c, from);
        eps(c, s, end);
        for (uint32_t k = r->min; k < r->max; k++) {
            s = rx_emit(e, r->kid[0], s);
            eps(c, s, end);
        }
        return end;
    }
    }
}

/* A string (from its opening quote on) whose text matches the ECMA regex re,
 * searched (unanchored unless ^ / $), between min_len and max_len characters. */
static int32_t build_pattern(struct jc *c, int32_t from, const char *re, const char *what,
                             const char *path, uint32_t min_len, uint32_t max_len)
{
    size_t n = strlen(re);
    bool head = n > 0 && re[0] == '^';
    bool tail = false;
    if (n > (size_t)head && re[n - 1] == '$') {
        size_t bs = 0;      /* an escaped $ is a character */
        for (size_t k = n - 1; k > 0 && re[k - 1] == '\\'; k--)
            bs++;
        tail = bs % 2 == 0;
    }
    struct rxp p = { .c = c, .s = re + head, .i = 0, .n = n - head - tail, .what = what, .path = path };
    struct rx *r = rx_alt(&p, 0);
    if (r == NULL)
        return -1;
    if (p.i != p.n) {
        rx_free(r);
        rx_err(&p, "an unmatched ')'");
        return -1;
    }
    if (rx_size(r) > RX_MAX_STATES) {
        rx_free(r);
        return fail(c, KVD_EUNSUPPORTED, "%s is too large to compile %s", what, WHERE(path));
    }
    /* with a length bound, the pattern alone is made deterministic (each
     * character's first byte marked), then laid out once per count, so that
     * no path leads where the pattern and the bound cannot both be met */
    bool counting = min_len > 0 || max_len != UINT32_MAX;
    struct rxe e = { .c = c, .op = counting ? GRAMMAR_OP_INC : GRAMMAR_OP_NONE, .arg = UINT32_MAX };
    struct cset any = { 0 };
    struct rxp q = p;
    if (!cset_add(&q, &any, 1, 0x10FFFF)) {
        rx_free(r);
        return -1;
    }
    gbuild_t *main_b = c->b, *sub = NULL;
    int32_t s, sub_rule = -1;
    if (counting) {
        sub = grammar_build_new();
        if (sub == NULL) {
            free(any.r);
            rx_free(r);
            return fail(c, KVD_ENOMEM, "out of memory");
        }
        c->b = sub;
        sub_rule = grammar_build_rule(sub);
        s = grammar_build_start(sub, sub_rule);
    } else {
        s = lit(c, from, "\"");
    }
    if (!head) {
        int32_t loop = state(c, s);
        eps(c, s, loop);
        emit_set(&e, &any, loop, loop);
        s = loop;
    }
    s = rx_emit(&e, r, s);
    if (!tail) {
        int32_t loop = state(c, s);
        eps(c, s, loop);
        emit_set(&e, &any, loop, loop);
        s = loop;
    }
    free(any.r);
    rx_free(r);
    c->b = main_b;
    if (counting) {
        grammar_build_final(sub, s);
        char gerr[256];
        grammar_t *g = grammar_build_finish(&sub, sub_rule, gerr, sizeof gerr);
        if (g == NULL)
            return fail(c, KVD_EINVAL, "%s %s: %s", what, WHERE(path),
                        strstr(gerr, "matches nothing") ? "matches no string" : gerr);
        s = grammar_build_counted(c->b, lit(c, from, "\""), g, min_len, max_len, RX_MAX_STATES);
        grammar_destroy(&g);
        if (s == -2)
            return fail(c, KVD_EUNSUPPORTED, "%s with its length bounds is too large to compile %s",
                        what, WHERE(path));
    }
    int32_t end = state(c, from);
    bytes(c, s, '"', '"', end);
    return end;
}

/* ---- numbers with bounds ---------------------------------------------------------- */

#define JS_INT_TOP 999999999999999LL     /* the largest integer of JS_MAX_INT_DIGITS digits */

/* Decimal strings of d digits from L to U (both d digits, L <= U), from
 * `from` to `end`. */
static void digits_range(struct jc *c, int32_t from, int32_t end, const char *L, const char *U, size_t d)
{
    if (c->code || from < 0)
        return;
    if (d == 0) {
        eps(c, from, end);
        return;
    }
    static const char nines[] = "999999999999999", zeros[] = "000000000000000";
    if (memcmp(L, zeros, d) == 0 && memcmp(U, nines, d) == 0) {    /* any d digits */
        int32_t s = from;
        for (size_t k = 0; k < d; k++) {
            int32_t t = k + 1 == d ? end : state(c, from);
            bytes(c, s, '0', '9', t);
            s = t;
        }
        return;
    }
    if (L[0] == U[0]) {
        int32_t s = state(c, from);
        bytes(c, from, (uint8_t)L[0], (uint8_t)L[0], s);
        digits_range(c, s, end, L + 1, U + 1, d - 1);
        return;
    }
    int32_t s = state(c, from);
    bytes(c, from, (uint8_t)L[0], (uint8_t)L[0], s);
    digits_range(c, s, end, L + 1, nines, d - 1);
    if (L[0] + 1 <= U[0] - 1) {
        int32_t m = state(c, from);
        bytes(c, from, (uint8_t)(L[0] + 1), (uint8_t)(U[0] - 1), m);
        digits_range(c, m, end, zeros, nines, d - 1);
    }
    int32_t t = state(c, from);
    bytes(c, from, (uint8_t)U[0], (uint8_t)U[0], t);
    digits_range(c, t, end, zeros, U + 1, d - 1);
}

/* The integers a..b (0 <= a <= b <= JS_INT_TOP) without leading zeros. */
static void int_range(struct jc *c, int32_t from, int32_t end, long long a, long long b)
{
    long long p = 1;
    for (size_t d = 1; d <= JS_MAX_INT_DIGITS; d++, p *= 10) {
        long long lo = a > (d == 1 ? 0 : p) ? a : (d == 1 ? 0 : p), hi = b < p * 10 - 1 ? b : p * 10 - 1;
        if (lo > hi)
            continue;
        char L[32], U[32];
        snprintf(L, sizeof L, "%0*lld", (int)d, lo);
        snprintf(U, sizeof U, "%0*lld", (int)d, hi);
        digits_range(c, from, end, L, U, d);
    }
}

enum { FRAC_ANY, FRAC_NONZERO, FRAC_ZERO };

/* An optional fraction ("." and 1..15 digits) after `from`: any, one with a
 * digit other than 0 (required, then), or only zeros. */
static void fraction(struct jc *c, int32_t from, int32_t end, int kind)
{
    if (kind != FRAC_NONZERO)
        eps(c, from, end);
    int32_t dot = state(c, from);
    bytes(c, from, '.', '.', dot);
    int32_t z = dot, nz = -1;   /* after k digits: all zeros so far, or not */
    for (int k = 0; k < JS_MAX_FRAC_DIGITS; k++) {
        int32_t z2 = state(c, from), nz2 = kind == FRAC_ZERO ? -1 : state(c, from);
        bytes(c, z, '0', '0', z2);
        if (kind != FRAC_ZERO) {
            bytes(c, z, '1', '9', nz2);
            if (nz >= 0)
                bytes(c, nz, '0', '9', nz2);
            eps(c, nz2, end);
        }
        if (kind != FRAC_NONZERO)
            eps(c, z2, end);
        z = z2;
        nz = nz2;
    }
}

/* Magnitudes M in [A, B] (0 <= A; unbounded: B is JS_INT_TOP, the most
 * digits written), each end included or not; with_frac: M may have a
 * fraction (numbers) or not (integers). */
static void magnitudes(struct jc *c, int32_t from, int32_t end, long long A, bool a_excl, long long B,
                       bool b_excl, bool unbounded, bool with_frac)
{
    if (unbounded)
        B = JS_INT_TOP, b_excl = false;
    if (!with_frac) {       /* integers: the bounds move inwards */
        if (a_excl)
            A++;
        if (b_excl)
            B--;
        if (A <= B)
            int_range(c, from, end, A, B);
        return;
    }
    if (A > B || (A == B && (a_excl || b_excl)))
        return;
    if (A == B) {
        int32_t s = state(c, from);
        int_range(c, from, s, A, A);
        fraction(c, s, end, FRAC_ZERO);
        return;
    }
    int32_t s = state(c, from);
    int_range(c, from, s, A, A);
    fraction(c, s, end, a_excl ? FRAC_NONZERO : FRAC_ANY);
    if (A + 1 <= B - 1) {
        int32_t m = state(c, from);
        int_range(c, from, m, A + 1, B - 1);
        fraction(c, m, end, FRAC_ANY);
    }
    if (!b_excl && !unbounded) {
        int32_t t = state(c, from);
        int_range(c, from, t, B, B);
        fraction(c, t, end, FRAC_ZERO);
    } else if (unbounded) {
        int32_t t = state(c, from);
        int_range(c, from, t, B, B);
        fraction(c, t, end, FRAC_ANY);
    }
}

/* A bound keyword: false when absent; refuses non-numbers and, with
 * fractions, values that are not whole numbers. */
static bool get_bound(struct jc *c, const json_t *node, const char *key, const char *path, bool integer,
                      bool upper, long long *out, bool *ok)
{
    const json_t *v = json_object_get(node, key);
    *ok = true;
    if (v == NULL)
        return false;
    if (!json_is_number(v)) {
        *ok = false;
        fail(c, json_is_boolean(v) ? KVD_EUNSUPPORTED : KVD_EINVAL, "'%s' must be a number %s", key,
             WHERE(path));
        return false;
    }
    double d = json_number_value(v);
    if (d != d || d > 1e300 || d < -1e300) {
        *ok = false;
        fail(c, KVD_EINVAL, "'%s' is out of range %s", key, WHERE(path));
        return false;
    }
    double r = upper ? floor(d) : ceil(d);
    if (!integer && r != d) {
        *ok = false;
        fail(c, KVD_EUNSUPPORTED, "unsupported: '%s' %g on a number (whole-number bounds only) %s", key, d,
             WHERE(path));
        return false;
    }
    /* an integer bound between whole numbers: the nearest one inside, and
     * an exclusive one then no longer excludes itself */
    if (r > (double)JS_INT_TOP + 1)
        r = (double)JS_INT_TOP + 1;
    if (r < -(double)JS_INT_TOP - 1)
        r = -(double)JS_INT_TOP - 1;
    *out = (long long)r;
    return true;
}

/* A number or an integer, with minimum / maximum / exclusiveMinimum /
 * exclusiveMaximum when the schema has them (then without an exponent). */
static int32_t build_numeric(struct jc *c, const json_t *node, const char *path, int32_t from, bool integer)
{
    long long lo = 0, hi = 0, x;
    bool has_lo = false, has_hi = false, lo_excl = false, hi_excl = false, ok;
    static const char *const keys[] = { "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum" };
    for (int k = 0; k < 4; k++) {
        bool upper = k >= 2, excl = k & 1;
        if (!get_bound(c, node, keys[k], path, integer, upper, &x, &ok)) {
            if (!ok)
                return -1;
            continue;
        }
        double d = json_number_value(json_object_get(node, keys[k]));
        bool whole = d == (double)x;
        if (!upper && (!has_lo || x > lo || (x == lo && excl && whole))) {
            lo = x;
            lo_excl = excl && whole;
            has_lo = true;
        } else if (upper && (!has_hi || x < hi || (x == hi && excl && whole))) {
            hi = x;
            hi_excl = excl && whole;
            has_hi = true;
        }
    }
    if (!has_lo && !has_hi)
        return integer ? build_integer(c, from) : build_number(c, from);
    if (!has_lo)
        lo = -JS_INT_TOP;
    if (!has_hi)
        hi = JS_INT_TOP;
    int32_t end = state(c, from);
    /* x >= 0: magnitudes from max(lo, 0); x < 0: "-" and magnitudes up to -lo */
    if (hi > 0 || (hi == 0 && !hi_excl)) {
        long long A = lo < 0 ? 0 : lo;
        bool a_excl = lo < 0 ? false : lo_excl;
        magnitudes(c, from, end, A, a_excl, hi, hi_excl, !has_hi, !integer);
    }
    if (lo < 0) {
        int32_t m = state(c, from);
        bytes(c, from, '-', '-', m);
        long long A = hi < 0 ? -hi : 0;
        bool a_excl = hi < 0 ? hi_excl : true;     /* "-0" is not written */
        magnitudes(c, m, end, A, a_excl, -lo, lo_excl, !has_lo, !integer);
    }
    return end;
}

/* ---- schemas ------------------------------------------------------------------------ */

static const char *const annotation_words[] = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly",
    "writeOnly", "deprecated", "discriminator", "$defs", "definitions", NULL,
};

static const char *const constraint_words[] = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "minLength", "maxLength", "pattern", "format", "enum", "const", "anyOf", "oneOf",
    "allOf", "$ref", "uniqueItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL,
};

static bool in_list(const char *const *list, const char *k)
{
    for (; *list; list++)
        if (strcmp(*list, k) == 0)
            return true;
    return false;
}

static const struct {
    const char *name;
    const char *re;
} formats[] = {
    { "date", "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$" },
    { "time", "^([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$" },
    { "date-time", "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:"
                   "[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$" },
    { "uuid", "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$" },
    { "email", "^[A-Za-z0-9_+-]+(\\.[A-Za-z0-9_+-]+)*@[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
               "(\\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)+$" },
    { "ipv4", "^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}"
              "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$" },
    { "uri", "^[A-Za-z][A-Za-z0-9+.-]*:[A-Za-z0-9._~:/?#@!$&'()*+,;=%-]+$" },
};

enum {
    T_NULL = 1 << 0, T_BOOLEAN = 1 << 1, T_INTEGER = 1 << 2, T_NUMBER = 1 << 3,
    T_STRING = 1 << 4, T_ARRAY = 1 << 5, T_OBJECT = 1 << 6, T_ANY = 0x7F,
};

static const struct {
    const char *name;
    int bit;
} type_names[] = {
    { "null", T_NULL }, { "boolean", T_BOOLEAN }, { "integer", T_INTEGER }, { "number", T_NUMBER },
    { "string", T_STRING }, { "array", T_ARRAY }, { "object", T_OBJECT },
};

static int32_t compile(struct jc *c, const json_t *node, const char *path, int depth);

/* A non-negative integer keyword; UINT32_MAX (dflt) when absent. */
static bool get_count(struct jc *c, const json_t *node, const char *key, const char *path,
                      uint32_t dflt, uint32_t *out)
{
    const json_t *v = json_object_get(node, key);
    *out = dflt;
    if (v == NULL)
        return true;
    double d = -1;
    if (json_is_integer(v))
        d = (double)json_integer_value(v);
    else if (json_is_real(v) && json_real_value(v) == (double)(long long)json_real_value(v))
        d = json_real_value(v);
    if (d < 0) {
        fail(c, KVD_EINVAL, "'%s' must be a non-negative integer %s", key, WHERE(path));
        return false;
    }
    *out = d >= (double)(UINT32_MAX - 1) ? UINT32_MAX - 1 : (uint32_t)d;
    return true;
}

static int32_t build_string_type(struct jc *c, const json_t *node, const char *path, int32_t from)
{
    uint32_t min, max;
    if (!get_count(c, node, "minLength", path, 0, &min) ||
        !get_count(c, node, "maxLength", path, UINT32_MAX, &max))
        return -1;
    if (min > max)
        return fail(c, KVD_EINVAL, "'minLength' %u is above 'maxLength' %u %s", min, max, WHERE(path));
    const json_t *pat = json_object_get(node, "pattern"), *fmt = json_object_get(node, "format");
    if (pat != NULL && fmt != NULL)
        return fail(c, KVD_EUNSUPPORTED, "unsupported: 'pattern' with 'format' %s", WHERE(path));
    if (pat != NULL) {
        if (!json_is_string(pat))
            return fail(c, KVD_EINVAL, "'pattern' must be a string %s", WHERE(path));
        return build_pattern(c, from, json_string_value(pat), "'pattern'", path, min, max);
    }
    if (fmt != NULL) {
        if (!json_is_string(fmt))
            return fail(c, KVD_EINVAL, "'format' must be a string %s", WHERE(path));
        for (size_t i = 0; i < sizeof formats / sizeof *formats; i++)
            if (strcmp(formats[i].name, json_string_value(fmt)) == 0) {
                char what[64];
                snprintf(what, sizeof what, "format '%s'", formats[i].name);
                return build_pattern(c, from, formats[i].re, what, path, min, max);
            }
        return fail(c, KVD_EUNSUPPORTED, "unsupported JSON Schema format '%s' %s",
                    json_string_value(fmt), WHERE(path));
    }
    return grammar_build_string(c->b, lit(c, from, "\""), min, max);
}

static int32_t build_array_type(struct jc *c, const json_t *node, const char *path, int depth,
                                int32_t from)
{
    uint32_t min, max;
    char sub[512];
    if (!get_count(c, node, "minItems", path, 0, &min) ||
        !get_count(c, node, "maxItems", path, UINT32_MAX, &max))
        return -1;
    if (min > max)
        return fail(c, KVD_EINVAL, "'minItems' %u is above 'maxItems' %u %s", min, max, WHERE(path));
    const json_t *items = json_object_get(node, "items"), *prefix = json_object_get(node, "prefixItems");
    const json_t *uniq = json_object_get(node, "uniqueItems");
    if (uniq != NULL && !json_is_false(uniq))
        return fail(c, KVD_EUNSUPPORTED, "unsupported JSON Schema keyword 'uniqueItems' %s", WHERE(path));
    const char *prefix_name = "prefixItems";
    if (json_is_array(items)) {     /* draft 4-2019 tuples: no further items here */
        if (prefix != NULL)
            return fail(c, KVD_EINVAL, "'items' as an array with 'prefixItems' %s", WHERE(path));
        prefix = items;
        prefix_name = "items";
        items = json_false();
    }
    if (prefix != NULL && !json_is_array(prefix))
        return fail(c, KVD_EINVAL, "'prefixItems' must be an array %s", WHERE(path));
    size_t n = prefix ? json_array_size(prefix) : 0;
    int32_t item_rule = -1;
    if (items == NULL || !json_is_false(items)) {
        path_add(sub, sizeof sub, path, "items");
        item_rule = items == NULL ? any_rule(c) : compile(c, items, sub, depth + 1);
        if (item_rule < 0)
            return -1;
    } else if (min > n) {
        return fail(c, KVD_EINVAL, "'minItems' %u needs more items than the %zu allowed %s", min, n,
                    WHERE(path));
    }
    bool counting = min > 0 || max != UINT32_MAX;
    enum grammar_op inc = counting ? GRAMMAR_OP_INC : GRAMMAR_OP_NONE;
    enum grammar_op close = min ? GRAMMAR_OP_MIN : GRAMMAR_OP_NONE;
    int32_t a = ws(c, lit(c, from, "[")), end = state(c, from);
    if (min == 0)
        bytes(c, a, ']', ']', end);
    /* items are counted as they start: the first at its call, the others at
     * their comma, so that a comma is refused once no item may follow; the
     * whitespace after an item comes before the comma too, so that whichever
     * bound holds, the comma or the bracket can follow it */
    int32_t prev = a;
    for (size_t k = 0; k < n; k++) {
        path_idx(sub, sizeof sub, path, prefix_name, k);
        int32_t r = compile(c, json_array_get(prefix, k), sub, depth + 1);
        if (r < 0)
            return -1;
        int32_t v = state(c, from), w = -1;
        grammar_build_call(c->b, prev, r, v, k == 0 ? inc : GRAMMAR_OP_NONE, max);
        w = ws(c, v);
        grammar_build_bytes(c->b, w, ']', ']', end, close, min);
        if (k + 1 < n || item_rule >= 0) {
            prev = state(c, from);
            grammar_build_bytes(c->b, w, ',', ',', prev, inc, max);
            prev = ws(c, prev);
        }
    }
    if (item_rule >= 0) {
        int32_t v = state(c, from), comma = state(c, from);
        grammar_build_call(c->b, prev, item_rule, v, n == 0 ? inc : GRAMMAR_OP_NONE, max);
        int32_t w = ws(c, v);
        grammar_build_bytes(c->b, w, ']', ']', end, close, min);
        grammar_build_bytes(c->b, w, ',', ',', comma, inc, max);
        grammar_build_call(c->b, ws(c, comma), item_rule, v, GRAMMAR_OP_NONE, 0);
    }
    return end;
}

struct prop {
    const char *name;           /* borrowed from the schema */
    char *lit;                  /* "\"name\":", the JSON spelling */
    int32_t rule;               /* its value's rule */
    bool required;              /* in 'required' */
};

static int32_t build_object_type(struct jc *c, const json_t *node, const char *path, int depth,
                                 int32_t from)
{
    const json_t *props = json_object_get(node, "properties"), *req = json_object_get(node, "required");
    const json_t *addl = json_object_get(node, "additionalProperties");
    char sub[512];
    if (props != NULL && !json_is_object(props))
        return fail(c, KVD_EINVAL, "'properties' must be an object %s", WHERE(path));
    if (req != NULL && !json_is_array(req))
        return fail(c, KVD_EINVAL, "'required' must be an array %s", WHERE(path));
    for (size_t i = 0; req && i < json_array_size(req); i++)
        if (!json_is_string(json_array_get(req, i)))
            return fail(c, KVD_EINVAL, "'required' must hold strings %s", WHERE(path));
    if (addl != NULL && !json_is_boolean(addl) && !json_is_object(addl))
        return fail(c, KVD_EINVAL, "'additionalProperties' must be a boolean or a schema %s", WHERE(path));
    /* other properties: their rule, or -1 for none */
    int32_t addl_rule = -1;
    if (addl == NULL ? !c->p.strict : json_is_true(addl)) {
        addl_rule = any_rule(c);
    } else if (json_is_object(addl)) {
        path_add(sub, sizeof sub, path, "additionalProperties");
        addl_rule = compile(c, addl, sub, depth + 1);
    }
    if (c->code)
        return -1;
    size_t n = (props ? json_object_size(props) : 0) + (req ? json_array_size(req) : 0);
    struct prop *pp = calloc(n ? n : 1, sizeof *pp);
    if (pp == NULL)
        return fail(c, KVD_ENOMEM, "out of memory");
    size_t np = 0;
    int32_t end = -1;
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)props, key, val) {
        char p2[512];
        path_add(p2, sizeof p2, path, "properties");
        path_add(sub, sizeof sub, p2, key);
        pp[np].name = key;
        pp[np].rule = compile(c, val, sub, depth + 1);
        if (pp[np++].rule < 0)
            goto out;
    }
    for (size_t i = 0; req && i < json_array_size(req); i++) {
        const char *name = json_string_value(json_array_get(req, i));
        size_t k = 0;
        while (k < np && strcmp(pp[k].name, name) != 0)
            k++;
        if (k == np) {      /* required but not declared: a property of the other kind */
            if (addl_rule < 0) {
                fail(c, KVD_EINVAL, "required property '%s' is not in 'properties' and no other "
                     "property is allowed %s", name, WHERE(path));
                goto out;
            }
            pp[np].name = name;
            pp[np++].rule = addl_rule;
        }
        pp[k].required = true;
    }
    for (size_t k = 0; k < np; k++) {
        json_t *s = json_string(pp[k].name);
        char *q = s ? json_dumps(s, JSON_ENCODE_ANY) : NULL;
        json_decref(s);
        if (q == NULL) {
            fail(c, KVD_ENOMEM, "out of memory");
            goto out;
        }
        pp[k].lit = malloc(strlen(q) + 2);
        if (pp[k].lit)
            sprintf(pp[k].lit, "%s:", q);
        json_text_free(q);
        if (pp[k].lit == NULL) {
            fail(c, KVD_ENOMEM, "out of memory");
            goto out;
        }
    }
    /* other names: one string that is none of the declared ones, shared by all
     * places one may start; after one, only others follow */
    int32_t other = -1, after_other = -1;
    int32_t a = ws(c, lit(c, from, "{"));
    end = state(c, from);
    if (addl_rule >= 0) {
        const char **names = malloc((np ? np : 1) * sizeof *names);
        size_t *lens = malloc((np ? np : 1) * sizeof *lens);
        if (names == NULL || lens == NULL) {
            free(names);
            free(lens);
            fail(c, KVD_ENOMEM, "out of memory");
            end = -1;
            goto out;
        }
        for (size_t k = 0; k < np; k++) {
            names[k] = pp[k].lit + 1;                   /* without the quotes and colon */
            lens[k] = strlen(pp[k].lit) - 3;
        }
        other = state(c, from);
        int32_t k = grammar_build_string_except(c->b, other, names, lens, np);
        free(names);
        free(lens);
        after_other = state(c, from);
        grammar_build_call(c->b, ws(c, lit(c, k, ":")), addl_rule, after_other, GRAMMAR_OP_NONE, 0);
        bytes(c, ws(c, after_other), '}', '}', end);
        eps(c, lit(c, ws(c, lit(c, after_other, ",")), "\""), other);
    }
    /* declared names in order: from after property i (or the start, i = -1),
     * any later one up to and including the next required one */
    int32_t *after = malloc((np ? np : 1) * sizeof *after);
    if (after == NULL) {
        fail(c, KVD_ENOMEM, "out of memory");
        end = -1;
        goto out;
    }
    for (size_t k = 0; k < np; k++)
        after[k] = state(c, from);
    for (long i = -1; i < (long)np; i++) {
        size_t j0 = (size_t)(i + 1);
        bool req_left = false;
        for (size_t j = j0; j < np; j++)
            req_left |= pp[j].required;
        if (i >= 0 && j0 == np && addl_rule < 0 && !req_left) {
            bytes(c, ws(c, after[i]), '}', '}', end);
            continue;
        }
        int32_t k = i < 0 ? a : ws(c, lit(c, after[i], ","));
        for (size_t j = j0; j < np; j++) {
            grammar_build_call(c->b, ws(c, lit(c, k, pp[j].lit)), pp[j].rule, after[j],
                               GRAMMAR_OP_NONE, 0);
            if (pp[j].required)
                break;
        }
        if (!req_left) {
            bytes(c, i < 0 ? a : ws(c, after[i]), '}', '}', end);
            if (other >= 0)
                eps(c, lit(c, k, "\""), other);
        }
    }
    free(after);
out:
    for (size_t k = 0; k < np; k++)
        free(pp[k].lit);
    free(pp);
    return c->code ? -1 : end;
}

static bool type_matches(const json_t *v, int types)
{
    if (json_is_null(v))
        return types & T_NULL;
    if (json_is_boolean(v))
        return types & T_BOOLEAN;
    if (json_is_integer(v))
        return types & (T_INTEGER | T_NUMBER);
    if (json_is_real(v)) {
        double d = json_real_value(v);
        return (types & T_NUMBER) || ((types & T_INTEGER) && d == (double)(long long)d);
    }
    if (json_is_string(v))
        return types & T_STRING;
    if (json_is_array(v))
        return types & T_ARRAY;
    return types & T_OBJECT;
}

/* The literal values of enum / const, of the allowed types, from `from` to `end`. */
static bool build_values(struct jc *c, const json_t *vals, bool is_const, int types, const char *path,
                         int32_t from, int32_t end)
{
    size_t n = is_const ? 1 : json_array_size(vals), used = 0;
    for (size_t i = 0; i < n; i++) {
        const json_t *v = is_const ? vals : json_array_get(vals, i);
        if (!type_matches(v, types))
            continue;
        char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        if (text == NULL) {
            fail(c, KVD_ENOMEM, "out of memory");
            return false;
        }
        eps(c, lit(c, from, text), end);
        json_text_free(text);
        used++;
    }
    if (used == 0) {
        fail(c, KVD_EINVAL, "no value of '%s' has the schema's type %s", is_const ? "const" : "enum",
             WHERE(path));
        return false;
    }
    return true;
}

/* The schema a $ref or single-schema allOf node stands for, and its path;
 * false (with the reason) when it has other constraints or does not resolve. */
static bool follow_ref(struct jc *c, const json_t *node, const char *path, const json_t **out,
                       char *sub, size_t subn)
{
    const json_t *ref = json_object_get(node, "$ref"), *all = json_object_get(node, "allOf");
    const char *kw = ref ? "$ref" : "allOf", *key;
    const json_t *val;
    json_object_foreach((json_t *)node, key, val)
        if (in_list(constraint_words, key) && strcmp(key, kw) != 0) {
            fail(c, KVD_EUNSUPPORTED, "unsupported: '%s' beside '%s' %s", key, kw, WHERE(path));
            return false;
        }
    if (ref == NULL) {
        if (!json_is_array(all) || json_array_size(all) == 0) {
            fail(c, KVD_EINVAL, "'allOf' must be a non-empty array %s", WHERE(path));
            return false;
        }
        if (json_array_size(all) > 1) {
            fail(c, KVD_EUNSUPPORTED, "unsupported: 'allOf' with more than one schema %s", WHERE(path));
            return false;
        }
        *out = json_array_get(all, 0);
        path_idx(sub, subn, path, "allOf", 0);
        return true;
    }
    if (!json_is_string(ref)) {
        fail(c, KVD_EINVAL, "'$ref' must be a string %s", WHERE(path));
        return false;
    }
    const char *r = json_string_value(ref);
    if (r[0] != '#') {
        fail(c, KVD_EUNSUPPORTED, "unsupported '$ref' '%s' (only local ones, \"#...\") %s", r,
             WHERE(path));
        return false;
    }
    /* a JSON pointer: /-separated tokens, ~1 = '/', ~0 = '~' */
    const json_t *target = c->root;
    const char *p = r + 1;
    snprintf(sub, subn, "%s", p);
    while (*p && target != NULL) {
        if (*p != '/') {
            target = NULL;
            break;
        }
        p++;
        char tokn[256];
        size_t k = 0;
        while (*p && *p != '/' && k + 1 < sizeof tokn) {
            if (p[0] == '~' && p[1] == '1')
                tokn[k++] = '/', p += 2;
            else if (p[0] == '~' && p[1] == '0')
                tokn[k++] = '~', p += 2;
            else
                tokn[k++] = *p++;
        }
        tokn[k] = '\0';
        if (json_is_object(target)) {
            target = json_object_get(target, tokn);
        } else if (json_is_array(target)) {
            char *e;
            unsigned long ix = strtoul(tokn, &e, 10);
            target = (*e || !k) ? NULL : json_array_get(target, ix);
        } else {
            target = NULL;
        }
    }
    if (target == NULL) {
        fail(c, KVD_EINVAL, "unresolvable '$ref' '%s' %s", r, WHERE(path));
        return false;
    }
    *out = target;
    return true;
}

static int32_t compile(struct jc *c, const json_t *node, const char *path, int depth)
{
    if (c->code)
        return -1;
    if (depth > JS_MAX_NEST)
        return fail(c, KVD_EUNSUPPORTED, "schema nested deeper than %d levels %s", JS_MAX_NEST,
                    WHERE(path));
    if (json_is_true(node))
        return any_rule(c);
    if (json_is_false(node))
        return grammar_build_rule(c->b);    /* no match: calls to it are removed */
    if (!json_is_object(node))
        return fail(c, KVD_EINVAL, "a schema must be an object or a boolean %s", WHERE(path));
    int32_t known = memo_get(c, node);
    if (known >= 0)
        return known;
    /* every keyword must be known */
    const char *key;
    const json_t *val;
    size_t n_constraints = 0;
    json_object_foreach((json_t *)node, key, val) {
        if (in_list(constraint_words, key))
            n_constraints++;
        else if (!in_list(annotation_words, key))
            return fail(c, KVD_EUNSUPPORTED, "unsupported JSON Schema keyword '%s' %s", key,
                        WHERE(path));
    }
    if (json_object_get(node, "$ref") != NULL || json_object_get(node, "allOf") != NULL) {
        /* a chain of references must reach a schema of its own */
        const json_t *t = node, *target = NULL;
        char sub[512];
        if (!follow_ref(c, node, path, &target, sub, sizeof sub))
            return -1;
        for (int hops = 0; hops < 64; hops++) {
            if (!json_is_object(target) ||
                (!json_object_get(target, "$ref") && !json_object_get(target, "allOf")))
                break;
            char sub2[512];
            if (!follow_ref(c, target, sub, &t, sub2, sizeof sub2))
                return -1;
            if (t == node || hops == 63)
                return fail(c, KVD_EINVAL, "circular '$ref' %s", WHERE(path));
            target = t;
            snprintf(sub, sizeof sub, "%s", sub2);
        }
        int32_t r = compile(c, target, sub, depth + 1);
        if (r >= 0 && !memo_set(c, node, r))
            return -1;
        return r;
    }
    int32_t rule = grammar_build_rule(c->b);
    if (rule < 0 || !memo_set(c, node, rule))
        return fail(c, KVD_ENOMEM, "out of memory");
    int32_t start = grammar_build_start(c->b, rule), end = state(c, start);
    grammar_build_final(c->b, end);
    char sub[512];
    /* anyOf / oneOf: alternatives, each its own rule */
    const json_t *alts = json_object_get(node, "anyOf");
    const char *altkw = "anyOf";
    if (alts == NULL) {
        alts = json_object_get(node, "oneOf");
        altkw = "oneOf";
    }
    if (alts != NULL) {
        if (json_object_get(node, "anyOf") && json_object_get(node, "oneOf"))
            return fail(c, KVD_EUNSUPPORTED, "unsupported: 'anyOf' beside 'oneOf' %s", WHERE(path));
        json_object_foreach((json_t *)node, key, val)
            if (in_list(constraint_words, key) && strcmp(key, altkw) != 0)
                return fail(c, KVD_EUNSUPPORTED, "unsupported: '%s' beside '%s' %s", key, altkw,
                            WHERE(path));
        if (!json_is_array(alts) || json_array_size(alts) == 0)
            return fail(c, KVD_EINVAL, "'%s' must be a non-empty array %s", altkw, WHERE(path));
        for (size_t i = 0; i < json_array_size(alts); i++) {
            path_idx(sub, sizeof sub, path, altkw, i);
            int32_t r = compile(c, json_array_get(alts, i), sub, depth + 1);
            if (r < 0)
                return -1;
            grammar_build_call(c->b, start, r, end, GRAMMAR_OP_NONE, 0);
        }
        return c->code ? -1 : rule;
    }
    /* the types */
    int types = 0;
    const json_t *type = json_object_get(node, "type");
    if (type != NULL) {
        size_t nt = json_is_array(type) ? json_array_size(type) : 1;
        for (size_t i = 0; i < nt; i++) {
            const json_t *t = json_is_array(type) ? json_array_get(type, i) : type;
            if (!json_is_string(t))
                return fail(c, KVD_EINVAL, "'type' must be a string or an array of strings %s",
                            WHERE(path));
            int bit = 0;
            for (size_t k = 0; k < sizeof type_names / sizeof *type_names; k++)
                if (strcmp(type_names[k].name, json_string_value(t)) == 0)
                    bit = type_names[k].bit;
            if (bit == 0)
                return fail(c, KVD_EINVAL, "unknown type '%s' %s", json_string_value(t), WHERE(path));
            types |= bit;
        }
        if (types == 0)
            return fail(c, KVD_EINVAL, "'type' is an empty array %s", WHERE(path));
    } else {
        static const char *const obj_kw[] = { "properties", "required", "additionalProperties", NULL };
        static const char *const arr_kw[] = { "items", "prefixItems", "minItems", "maxItems", NULL };
        static const char *const str_kw[] = { "minLength", "maxLength", "pattern", "format", NULL };
        json_object_foreach((json_t *)node, key, val) {
            if (in_list(obj_kw, key))
                types |= T_OBJECT;
            else if (in_list(arr_kw, key))
                types |= T_ARRAY;
            else if (in_list(str_kw, key))
                types |= T_STRING;
        }
        if (types == 0)
            types = T_ANY;
    }
    const json_t *en = json_object_get(node, "enum"), *cn = json_object_get(node, "const");
    if (en != NULL || cn != NULL) {
        if (en != NULL && cn != NULL)
            return fail(c, KVD_EUNSUPPORTED, "unsupported: 'enum' beside 'const' %s", WHERE(path));
        json_object_foreach((json_t *)node, key, val)
            if (in_list(constraint_words, key) && strcmp(key, "type") != 0 && strcmp(key, "enum") != 0 &&
                strcmp(key, "const") != 0)
                return fail(c, KVD_EUNSUPPORTED, "unsupported: '%s' beside '%s' %s", key,
                            en ? "enum" : "const", WHERE(path));
        if (en != NULL && (!json_is_array(en) || json_array_size(en) == 0))
            return fail(c, KVD_EINVAL, "'enum' must be a non-empty array %s", WHERE(path));
        if (!build_values(c, en ? en : cn, en == NULL, types, path, start, end))
            return -1;
        return rule;
    }
    if (types == T_ANY && type == NULL) {
        grammar_build_call(c->b, start, any_rule(c), end, GRAMMAR_OP_NONE, 0);
        return c->code ? -1 : rule;
    }
    if (types & T_NULL)
        eps(c, lit(c, start, "null"), end);
    if (types & T_BOOLEAN) {
        eps(c, lit(c, start, "true"), end);
        eps(c, lit(c, start, "false"), end);
    }
    if (types & (T_NUMBER | T_INTEGER))
        eps(c, build_numeric(c, node, path, start, !(types & T_NUMBER)), end);
    if (types & T_STRING)
        eps(c, build_string_type(c, node, path, start), end);
    if (types & T_ARRAY)
        eps(c, build_array_type(c, node, path, depth, start), end);
    if (types & T_OBJECT)
        eps(c, build_object_type(c, node, path, depth, start), end);
    return c->code ? -1 : rule;
}

static void jc_fini(struct jc *c) { free(c->memo); }

int32_t jschema_add(gbuild_t *b, const char *text, size_t len, const struct jschema_params *p,
                    char *err, size_t errlen)
{
    struct jc c = { .b = b, .p = p ? *p : jschema_default_params(), .any_rule = -1, .err = err,
                    .errlen = errlen };
    if (err && errlen)
        err[0] = '\0';
    if (b == NULL || text == NULL)
        return kvd_seterr(err, errlen, KVD_EINVAL, "no schema");
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_DECODE_ANY, &je);
    if (root == NULL)
        return kvd_seterr(err, errlen, KVD_EINVAL, "the schema is not JSON: %s (line %d, column %d)",
                          je.text, je.line, je.column);
    c.root = root;
    int32_t r = compile(&c, root, "", 0);
    if (c.code == 0 && grammar_build_start(b, r) < 0)
        fail(&c, KVD_ERANGE, "the schema's grammar is too large (more than %u states) or memory ran out",
             GRAMMAR_MAX_STATES);
    json_decref(root);
    jc_fini(&c);
    return c.code ? c.code : r;
}

grammar_t *jschema_compile(const char *text, size_t len, const struct jschema_params *p, char *err,
                           size_t errlen)
{
    gbuild_t *b = grammar_build_new();
    if (b == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        return NULL;
    }
    int32_t r = jschema_add(b, text, len, p, err, errlen);
    if (r < 0) {
        grammar_build_destroy(&b);
        return NULL;
    }
    char gerr[256];
    grammar_t *g = grammar_build_finish(&b, r, gerr, sizeof gerr);
    if (g == NULL)
        kvd_seterr(err, errlen, KVD_EINVAL, "the schema %s",
                   strstr(gerr, "matches nothing") ? "admits no JSON document"
                   : strstr(gerr, "left recursion") ? "refers to itself before any JSON text ($ref "
                                                      "through anyOf or allOf alone)"
                   : gerr);
    return g;
}

grammar_t *jschema_compile_object(const struct jschema_params *p, char *err, size_t errlen)
{
    gbuild_t *b = grammar_build_new();
    if (b == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        return NULL;
    }
    struct jc c = { .b = b, .p = p ? *p : jschema_default_params(), .any_rule = -1, .err = err,
                    .errlen = errlen };
    int32_t r = grammar_build_rule(b);
    int32_t s = grammar_build_start(b, r);
    grammar_build_final(b, build_any_object(&c, s, any_rule(&c)));
    jc_fini(&c);
    return grammar_build_finish(&b, r, err, errlen);
}
