/* grammar.c - byte grammars as recursive automata, their matcher, and the vocabulary mask. */
#include "grammar.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"

/* ---- UTF-8 inside a JSON string --------------------------------------------------- */

/* Where a strict UTF-8 decoder stands between bytes: at a character boundary,
 * or inside a character, waiting for continuation bytes from a given range. */
enum {
    U_S0 = 0,   /* at a character boundary */
    U_T1,       /* one more 80..BF */
    U_T2,       /* two more 80..BF */
    U_T3,       /* three more 80..BF */
    U_E0,       /* after E0: A0..BF, then one more */
    U_ED,       /* after ED: 80..9F (no surrogates), then one more */
    U_F0,       /* after F0: 90..BF, then two more */
    U_F4,       /* after F4: 80..8F (up to U+10FFFF), then two more */
    U_N         /* substates */
};

/* The substate after byte c of a JSON string's plain content (no quote, no
 * backslash, no control character) from substate u, or -1 when c cannot come
 * there. */
static int utf8_plain_step(int u, unsigned c)
{
    switch (u) {
    case U_S0:
        if (c >= 0x20 && c <= 0x7F)
            return (c == '"' || c == '\\') ? -1 : U_S0;
        if (c >= 0xC2 && c <= 0xDF)
            return U_T1;
        if (c == 0xE0)
            return U_E0;
        if (c == 0xED)
            return U_ED;
        if (c >= 0xE1 && c <= 0xEF)
            return U_T2;
        if (c == 0xF0)
            return U_F0;
        if (c >= 0xF1 && c <= 0xF3)
            return U_T3;
        if (c == 0xF4)
            return U_F4;
        return -1;
    case U_T1: return (c >= 0x80 && c <= 0xBF) ? U_S0 : -1;
    case U_T2: return (c >= 0x80 && c <= 0xBF) ? U_T1 : -1;
    case U_T3: return (c >= 0x80 && c <= 0xBF) ? U_T2 : -1;
    case U_E0: return (c >= 0xA0 && c <= 0xBF) ? U_T1 : -1;
    case U_ED: return (c >= 0x80 && c <= 0x9F) ? U_T1 : -1;
    case U_F0: return (c >= 0x90 && c <= 0xBF) ? U_T2 : -1;
    case U_F4: return (c >= 0x80 && c <= 0x8F) ? U_T2 : -1;
    default: return -1;
    }
}

/* ---- the builder: nondeterministic rules ------------------------------------------ */

enum { NE_BYTES = 0, NE_EPS = 1, NE_CALL = 2 };
enum { TAG_NONE = 0, TAG_STR = 1 };

struct nedge {
    int32_t from;           /* NFA state */
    int32_t to;             /* NFA state (the return point of a call) */
    int32_t callee;         /* NE_CALL: the rule called */
    uint32_t arg;           /* the counter operation's bound */
    uint8_t kind;           /* NE_* */
    uint8_t lo, hi;         /* NE_BYTES: the byte range */
    uint8_t op;             /* enum grammar_op */
};

struct nstate {
    int32_t rule;           /* the rule this state belongs to */
    uint8_t final;          /* the rule may end here */
    uint8_t tag;            /* TAG_*: a plain-string state (grammar_mask's fast path) */
    uint8_t tag_u;          /* TAG_STR: the UTF-8 substate U_* */
    uint32_t tag_max;       /* TAG_STR: the string's maximum length (UINT32_MAX: none) */
};

struct gbuild {
    struct nstate *st;      /* (n_st) states */
    uint32_t n_st, cap_st;
    struct nedge *ed;       /* (n_ed) edges */
    uint32_t n_ed, cap_ed;
    int32_t *start;         /* (n_rules) each rule's start state */
    uint32_t n_rules, cap_rules;
    int err;                /* the first failure: KVD_ENOMEM, KVD_ERANGE, KVD_EINVAL; 0 */
};

#define NFA_MAX_STATES GRAMMAR_MAX_STATES     /* a bound on what one request can make us build */
#define NFA_MAX_EDGES (4 * GRAMMAR_MAX_STATES)

static bool grow(void **p, uint32_t *cap, uint32_t need, size_t elem)
{
    if (need <= *cap)
        return true;
    uint32_t c = *cap ? *cap : 16;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    if (q == NULL)
        return false;
    *p = q;
    *cap = c;
    return true;
}

gbuild_t *grammar_build_new(void)
{
    return calloc(1, sizeof(gbuild_t));
}

void grammar_build_destroy(gbuild_t **bp)
{
    if (bp == NULL || *bp == NULL)
        return;
    gbuild_t *b = *bp;
    free(b->st);
    free(b->ed);
    free(b->start);
    free(b);
    *bp = NULL;
}

static void build_fail(gbuild_t *b, int code)
{
    if (b->err == 0)
        b->err = code;
}

static int32_t new_state(gbuild_t *b, int32_t rule)
{
    if (b->err)
        return -1;
    if (b->n_st >= NFA_MAX_STATES) {
        build_fail(b, KVD_ERANGE);
        return -1;
    }
    if (!grow((void **)&b->st, &b->cap_st, b->n_st + 1, sizeof *b->st)) {
        build_fail(b, KVD_ENOMEM);
        return -1;
    }
    struct nstate *s = &b->st[b->n_st];
    memset(s, 0, sizeof *s);
    s->rule = rule;
    return (int32_t)b->n_st++;
}

static bool valid_state(gbuild_t *b, int32_t s)
{
    if (s < 0 || (uint32_t)s >= b->n_st) {
        if (s >= 0)
            build_fail(b, KVD_EINVAL);
        else
            build_fail(b, b->err ? b->err : KVD_EINVAL);
        return false;
    }
    return true;
}

int32_t grammar_build_rule(gbuild_t *b)
{
    if (b == NULL || b->err)
        return -1;
    if (!grow((void **)&b->start, &b->cap_rules, b->n_rules + 1, sizeof *b->start)) {
        build_fail(b, KVD_ENOMEM);
        return -1;
    }
    int32_t s = new_state(b, (int32_t)b->n_rules);
    if (s < 0)
        return -1;
    b->start[b->n_rules] = s;
    return (int32_t)b->n_rules++;
}

int32_t grammar_build_start(const gbuild_t *b, int32_t rule)
{
    if (b == NULL || b->err || rule < 0 || (uint32_t)rule >= b->n_rules)
        return -1;
    return b->start[rule];
}

int32_t grammar_build_state(gbuild_t *b, int32_t like)
{
    if (b == NULL || b->err || !valid_state(b, like))
        return -1;
    return new_state(b, b->st[like].rule);
}

static int add_edge(gbuild_t *b, const struct nedge *e)
{
    if (b->n_ed >= NFA_MAX_EDGES) {
        build_fail(b, KVD_ERANGE);
        return -1;
    }
    if (!grow((void **)&b->ed, &b->cap_ed, b->n_ed + 1, sizeof *b->ed)) {
        build_fail(b, KVD_ENOMEM);
        return -1;
    }
    b->ed[b->n_ed++] = *e;
    return 0;
}

static bool same_rule(gbuild_t *b, int32_t from, int32_t to)
{
    if (!valid_state(b, from) || !valid_state(b, to))
        return false;
    if (b->st[from].rule != b->st[to].rule) {
        build_fail(b, KVD_EINVAL);
        return false;
    }
    return true;
}

int grammar_build_bytes(gbuild_t *b, int32_t from, uint8_t lo, uint8_t hi, int32_t to,
                        enum grammar_op op, uint32_t arg)
{
    if (b == NULL || b->err || !same_rule(b, from, to))
        return -1;
    if (lo > hi || op > GRAMMAR_OP_MIN) {
        build_fail(b, KVD_EINVAL);
        return -1;
    }
    struct nedge e = { .from = from, .to = to, .callee = -1, .arg = op ? arg : 0,
                       .kind = NE_BYTES, .lo = lo, .hi = hi, .op = (uint8_t)op };
    return add_edge(b, &e);
}

int grammar_build_eps(gbuild_t *b, int32_t from, int32_t to)
{
    if (b == NULL || b->err || !same_rule(b, from, to))
        return -1;
    struct nedge e = { .from = from, .to = to, .callee = -1, .kind = NE_EPS };
    return add_edge(b, &e);
}

int grammar_build_call(gbuild_t *b, int32_t from, int32_t callee, int32_t to, enum grammar_op op,
                       uint32_t arg)
{
    if (b == NULL || b->err || !same_rule(b, from, to))
        return -1;
    if (callee < 0 || (uint32_t)callee >= b->n_rules || op > GRAMMAR_OP_MIN) {
        build_fail(b, KVD_EINVAL);
        return -1;
    }
    struct nedge e = { .from = from, .to = to, .callee = callee, .arg = op ? arg : 0,
                       .kind = NE_CALL, .op = (uint8_t)op };
    return add_edge(b, &e);
}

int grammar_build_final(gbuild_t *b, int32_t state)
{
    if (b == NULL || b->err || !valid_state(b, state))
        return -1;
    b->st[state].final = 1;
    return 0;
}

int32_t grammar_build_lit(gbuild_t *b, int32_t from, const void *s, size_t n)
{
    const uint8_t *p = s;
    int32_t cur = from;
    if (b == NULL || b->err || !valid_state(b, from))
        return -1;
    if (n == 0) {
        int32_t end = grammar_build_state(b, from);
        grammar_build_eps(b, from, end);
        return b->err ? -1 : end;
    }
    for (size_t i = 0; i < n && cur >= 0; i++) {
        int32_t next = grammar_build_state(b, from);
        grammar_build_bytes(b, cur, p[i], p[i], next, GRAMMAR_OP_NONE, 0);
        cur = next;
    }
    return b->err ? -1 : cur;
}

int32_t grammar_build_ws(gbuild_t *b, int32_t from, uint32_t max_indent)
{
    if (b == NULL || b->err || !valid_state(b, from))
        return -1;
    int32_t end = grammar_build_state(b, from);
    grammar_build_eps(b, from, end);
    grammar_build_bytes(b, from, ' ', ' ', end, GRAMMAR_OP_NONE, 0);
    int32_t cur = grammar_build_state(b, from);
    grammar_build_bytes(b, from, '\n', '\n', cur, GRAMMAR_OP_NONE, 0);
    grammar_build_eps(b, cur, end);
    for (uint32_t i = 0; i < max_indent && !b->err; i++) {
        int32_t next = grammar_build_state(b, from);
        grammar_build_bytes(b, cur, ' ', ' ', next, GRAMMAR_OP_NONE, 0);
        grammar_build_eps(b, next, end);
        cur = next;
    }
    return b->err ? -1 : end;
}

/* The states of one JSON string body (grammar_build_string). */
struct strstates {
    int32_t u[U_N];         /* plain content, by UTF-8 substate */
    int32_t end;            /* after the closing quote */
};

static void tag_str(gbuild_t *b, int32_t s, int u, uint32_t max)
{
    if (s < 0)
        return;
    b->st[s].tag = TAG_STR;
    b->st[s].tag_u = (uint8_t)u;
    b->st[s].tag_max = max;
}

static void hex_edges(gbuild_t *b, int32_t from, int32_t to, bool zero)
{
    if (zero)
        grammar_build_bytes(b, from, '0', '9', to, GRAMMAR_OP_NONE, 0);
    else
        grammar_build_bytes(b, from, '1', '9', to, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, from, 'A', 'F', to, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, from, 'a', 'f', to, GRAMMAR_OP_NONE, 0);
}

/* Builds a string body entered at state s->u[U_S0] (a new state), its
 * escapes and its closing quote into s. */
static void build_str_states(gbuild_t *b, int32_t like, uint32_t min_len, uint32_t max_len,
                             struct strstates *s)
{
    bool counting = min_len > 0 || max_len != UINT32_MAX;
    enum grammar_op inc = counting ? GRAMMAR_OP_INC : GRAMMAR_OP_NONE;
    uint32_t arg = counting ? max_len : 0;
    for (int u = 0; u < U_N; u++) {
        s->u[u] = grammar_build_state(b, like);
        tag_str(b, s->u[u], u, max_len);
    }
    s->end = grammar_build_state(b, like);
    int32_t esc = grammar_build_state(b, like);
    if (b->err)
        return;
    int32_t s0 = s->u[U_S0];
    /* plain content: the transitions of utf8_plain_step, exactly */
    grammar_build_bytes(b, s0, 0x20, 0x21, s0, inc, arg);
    grammar_build_bytes(b, s0, 0x23, 0x5B, s0, inc, arg);
    grammar_build_bytes(b, s0, 0x5D, 0x7F, s0, inc, arg);
    grammar_build_bytes(b, s0, 0xC2, 0xDF, s->u[U_T1], inc, arg);
    grammar_build_bytes(b, s0, 0xE0, 0xE0, s->u[U_E0], inc, arg);
    grammar_build_bytes(b, s0, 0xE1, 0xEC, s->u[U_T2], inc, arg);
    grammar_build_bytes(b, s0, 0xED, 0xED, s->u[U_ED], inc, arg);
    grammar_build_bytes(b, s0, 0xEE, 0xEF, s->u[U_T2], inc, arg);
    grammar_build_bytes(b, s0, 0xF0, 0xF0, s->u[U_F0], inc, arg);
    grammar_build_bytes(b, s0, 0xF1, 0xF3, s->u[U_T3], inc, arg);
    grammar_build_bytes(b, s0, 0xF4, 0xF4, s->u[U_F4], inc, arg);
    grammar_build_bytes(b, s->u[U_T1], 0x80, 0xBF, s0, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, s->u[U_T2], 0x80, 0xBF, s->u[U_T1], GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, s->u[U_T3], 0x80, 0xBF, s->u[U_T2], GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, s->u[U_E0], 0xA0, 0xBF, s->u[U_T1], GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, s->u[U_ED], 0x80, 0x9F, s->u[U_T1], GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, s->u[U_F0], 0x90, 0xBF, s->u[U_T2], GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, s->u[U_F4], 0x80, 0x8F, s->u[U_T2], GRAMMAR_OP_NONE, 0);
    /* the end, and escapes (one character each) */
    grammar_build_bytes(b, s0, '"', '"', s->end, min_len ? GRAMMAR_OP_MIN : GRAMMAR_OP_NONE, min_len);
    grammar_build_bytes(b, s0, '\\', '\\', esc, inc, arg);
    static const char simple[] = "\"\\/bfnrt";
    for (const char *c = simple; *c; c++)
        grammar_build_bytes(b, esc, (uint8_t)*c, (uint8_t)*c, s0, GRAMMAR_OP_NONE, 0);
    /* \uXXXX: no surrogates (D800..DFFF), no \u0000 */
    int32_t u1 = grammar_build_state(b, like), u2 = grammar_build_state(b, like);
    int32_t u2z = grammar_build_state(b, like), u2d = grammar_build_state(b, like);
    int32_t u3 = grammar_build_state(b, like), u3z = grammar_build_state(b, like);
    int32_t u4 = grammar_build_state(b, like), u4z = grammar_build_state(b, like);
    grammar_build_bytes(b, esc, 'u', 'u', u1, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, u1, '0', '0', u2z, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, u1, '1', '9', u2, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, u1, 'A', 'C', u2, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, u1, 'a', 'c', u2, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, u1, 'D', 'D', u2d, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, u1, 'd', 'd', u2d, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, u1, 'E', 'F', u2, GRAMMAR_OP_NONE, 0);
    grammar_build_bytes(b, u1, 'e', 'f', u2, GRAMMAR_OP_NONE, 0);
    hex_edges(b, u2, u3, true);
    grammar_build_bytes(b, u2z, '0', '0', u3z, GRAMMAR_OP_NONE, 0);
    hex_edges(b, u2z, u3, false);
    grammar_build_bytes(b, u2d, '0', '7', u3, GRAMMAR_OP_NONE, 0);
    hex_edges(b, u3, u4, true);
    grammar_build_bytes(b, u3z, '0', '0', u4z, GRAMMAR_OP_NONE, 0);
    hex_edges(b, u3z, u4, false);
    hex_edges(b, u4, s0, true);
    hex_edges(b, u4z, s0, false);
}

int32_t grammar_build_string(gbuild_t *b, int32_t from, uint32_t min_len, uint32_t max_len)
{
    if (b == NULL || b->err || !valid_state(b, from))
        return -1;
    if (min_len > max_len) {
        build_fail(b, KVD_EINVAL);
        return -1;
    }
    struct strstates s;
    build_str_states(b, from, min_len, max_len, &s);
    grammar_build_eps(b, from, s.u[U_S0]);
    return b->err ? -1 : s.end;
}

/* A trie node of grammar_build_string_except. */
struct xnode {
    int32_t state;          /* its NFA state */
    int32_t child;          /* first child (xnode index), -1 */
    int32_t next;           /* next sibling, -1 */
    uint8_t byte;           /* the byte leading here */
    int8_t u;               /* UTF-8 substate after the path; -2 just after a backslash,
                               -1 inside \\uXXXX */
    uint8_t esc;            /* bytes of an escape still to come (0: none) */
    uint8_t is_key;         /* a whole excluded key ends here */
};

int32_t grammar_build_string_except(gbuild_t *b, int32_t from, const char *const *keys,
                                    const size_t *lens, size_t n_keys)
{
    if (b == NULL || b->err || !valid_state(b, from))
        return -1;
    struct strstates fb;
    build_str_states(b, from, 0, UINT32_MAX, &fb);
    if (b->err)
        return -1;
    size_t cap = 1;
    for (size_t k = 0; k < n_keys; k++)
        cap += lens[k];
    struct xnode *x = malloc(cap * sizeof *x);
    if (x == NULL) {
        build_fail(b, KVD_ENOMEM);
        return -1;
    }
    size_t nx = 1;
    x[0] = (struct xnode){ .state = grammar_build_state(b, from), .child = -1, .next = -1,
                           .u = U_S0 };
    grammar_build_eps(b, from, x[0].state);
    for (size_t k = 0; k < n_keys && !b->err; k++) {
        size_t cur = 0;
        for (size_t i = 0; i < lens[k]; i++) {
            uint8_t c = (uint8_t)keys[k][i];
            int32_t ch = x[cur].child;
            while (ch >= 0 && x[ch].byte != c)
                ch = x[ch].next;
            if (ch < 0) {
                struct xnode nn = { .state = grammar_build_state(b, from), .child = -1,
                                    .next = x[cur].child, .byte = c };
                /* where the encoded key stands: escapes are matched byte for byte */
                if (x[cur].u == -2) {           /* the escape's letter: \u takes four hex digits */
                    nn.esc = (c == 'u') ? 4 : 0;
                    nn.u = nn.esc ? -1 : U_S0;
                } else if (x[cur].esc > 0) {    /* a hex digit of \uXXXX */
                    nn.esc = (uint8_t)(x[cur].esc - 1);
                    nn.u = nn.esc ? -1 : U_S0;
                } else if (x[cur].u < 0) {      /* not a string: nothing leaves from here */
                    nn.u = -1;
                } else if (c == '\\') {
                    nn.u = -2;
                } else {
                    int v = utf8_plain_step(x[cur].u, c);
                    nn.u = (int8_t)(v < 0 ? -1 : v);
                }
                x[nx] = nn;
                x[cur].child = (int32_t)nx;
                grammar_build_bytes(b, x[cur].state, c, c, nn.state, GRAMMAR_OP_NONE, 0);
                cur = nx++;
            } else {
                cur = (size_t)ch;
            }
        }
        x[cur].is_key = 1;
    }
    /* leaving the trie: a plain byte that no key continues with, or the quote */
    for (size_t i = 0; i < nx && !b->err; i++) {
        if (x[i].u < 0)
            continue;       /* inside an escape: only the keys' own bytes */
        if (x[i].u == U_S0 && !x[i].is_key)
            grammar_build_bytes(b, x[i].state, '"', '"', fb.end, GRAMMAR_OP_NONE, 0);
        for (unsigned c = 0; c < 256; c++) {
            int v = utf8_plain_step(x[i].u, c);
            if (v < 0)
                continue;
            bool taken = false;
            for (int32_t ch = x[i].child; ch >= 0 && !taken; ch = x[ch].next)
                taken = x[ch].byte == c;
            if (!taken)
                grammar_build_bytes(b, x[i].state, (uint8_t)c, (uint8_t)c, fb.u[v],
                                    GRAMMAR_OP_NONE, 0);
        }
    }
    free(x);
    return b->err ? -1 : fb.end;
}

/* ---- the finished grammar --------------------------------------------------------- */

struct gedge {
    uint8_t lo, hi;         /* byte range */
    uint8_t op;             /* enum grammar_op */
    uint32_t to;            /* target state */
    uint32_t arg;           /* the op's bound */
};

struct gcall {
    uint32_t start;         /* the callee's start state */
    uint32_t ret;           /* where the caller continues */
    uint32_t arg;           /* the op's bound */
    uint8_t op;             /* enum grammar_op on the caller's counter */
    int32_t callee;         /* the callee rule */
};

struct gdst {
    uint32_t bits[8];       /* bytes with an edge */
    uint32_t e0, ne;        /* edges [e0, e0 + ne), sorted by lo */
    uint32_t c0, nc;        /* calls [c0, c0 + nc) */
    uint32_t tag_max;       /* TAG_STR: the string's maximum length */
    int32_t rule;           /* the rule it belongs to */
    uint8_t final;          /* the rule may end here */
    uint8_t tag;            /* TAG_* */
    uint8_t tag_u;          /* TAG_STR: UTF-8 substate */
    uint8_t height;         /* return points a shortest way to this rule's end needs on top
                               of the stack (HEIGHT_INF: more than GRAMMAR_MAX_DEPTH) */
};

#define HEIGHT_INF 255

struct grammar {
    struct gdst *st;        /* (n_st) */
    uint32_t n_st;
    struct gedge *ed;       /* (n_ed) */
    uint32_t n_ed;
    struct gcall *calls;    /* (n_calls) */
    uint32_t n_calls;
    uint32_t *rule_start;   /* (n_rules) start state of each rule */
    uint32_t n_rules;
    uint32_t root;          /* start state of the root rule */
};

void grammar_destroy(grammar_t **gp)
{
    if (gp == NULL || *gp == NULL)
        return;
    grammar_t *g = *gp;
    free(g->st);
    free(g->ed);
    free(g->calls);
    free(g->rule_start);
    free(g);
    *gp = NULL;
}

uint32_t grammar_n_states(const grammar_t *g) { return g->n_st; }

int32_t grammar_build_counted(gbuild_t *b, int32_t from, const grammar_t *sub, uint32_t min,
                              uint32_t max, uint32_t max_states)
{
    if (b == NULL || b->err || sub == NULL || !valid_state(b, from))
        return -1;
    if (min > max) {
        build_fail(b, KVD_EINVAL);
        return -1;
    }
    /* counts above k_top behave alike: past the maximum is refused, and with
     * no maximum, past the minimum all are equal */
    uint32_t k_top = max != UINT32_MAX ? max : min;
    uint64_t cells = (uint64_t)sub->n_st * ((uint64_t)k_top + 1);
    if (cells > max_states)
        return -2;
    for (uint32_t k = 0; k < sub->n_st; k++)
        if (sub->st[k].nc) {
            build_fail(b, KVD_EINVAL);
            return -1;
        }
    int32_t *id = malloc(cells * sizeof *id);
    uint32_t *queue = malloc(cells * sizeof *queue);
    if (id == NULL || queue == NULL) {
        free(id);
        free(queue);
        build_fail(b, KVD_ENOMEM);
        return -1;
    }
    for (uint64_t i = 0; i < cells; i++)
        id[i] = -1;
    int32_t end = grammar_build_state(b, from);
    uint32_t nq = 0;
    uint64_t c0 = (uint64_t)sub->root * (k_top + 1);
    id[c0] = grammar_build_state(b, from);
    queue[nq++] = (uint32_t)c0;
    grammar_build_eps(b, from, id[c0]);
    for (uint32_t qi = 0; qi < nq && !b->err; qi++) {
        uint32_t cell = queue[qi], st = cell / (k_top + 1), k = cell % (k_top + 1);
        const struct gdst *s = &sub->st[st];
        if (s->final && k >= min)
            grammar_build_eps(b, id[cell], end);
        for (uint32_t e = s->e0; e < s->e0 + s->ne; e++) {
            const struct gedge *ed = &sub->ed[e];
            uint32_t k2 = k;
            if (ed->op == GRAMMAR_OP_INC) {
                if (max != UINT32_MAX && k + 1 > max)
                    continue;
                k2 = k + 1 > k_top ? k_top : k + 1;
            }
            uint64_t c2 = (uint64_t)ed->to * (k_top + 1) + k2;
            if (id[c2] < 0) {
                id[c2] = grammar_build_state(b, from);
                queue[nq++] = (uint32_t)c2;
            }
            grammar_build_bytes(b, id[cell], ed->lo, ed->hi, id[c2], GRAMMAR_OP_NONE, 0);
        }
    }
    free(id);
    free(queue);
    return b->err ? -1 : end;
}

/* ---- determinizing: subset construction, rule by rule ---------------------------- */

struct det {
    const gbuild_t *b;
    uint32_t *eoff;         /* (n_st + 1) CSR of the NFA edges by source */
    uint32_t *eidx;         /* (n_ed) edge indices */
    uint32_t *mark;         /* (n_st) closure marks */
    uint32_t gen;           /* the current mark */
    uint32_t *stack;        /* (n_st) closure work */
    uint32_t *pool;         /* every DFA state's NFA set, concatenated */
    uint32_t n_pool, cap_pool;
    uint32_t *set_off;      /* (n_dfa) offset of each set in pool */
    uint32_t *set_len;      /* (n_dfa) */
    int32_t *dfa_rule;      /* (n_dfa) */
    uint32_t n_dfa;         /* DFA states so far */
    uint32_t cap_dfa, cap_dfa2, cap_dfa3; /* capacities of set_off, set_len, dfa_rule */
    uint32_t *hash;         /* open addressing: dfa id + 1, 0 empty */
    uint32_t hcap;
    struct gdst *st;        /* (n_dfa) the output */
    uint32_t cap_st;
    struct gedge *ed;
    uint32_t n_ed, cap_ed;
    struct gcall *calls;
    uint32_t n_calls, cap_calls;
    uint32_t *tmp;          /* a set under construction */
    uint32_t n_tmp, cap_tmp;
    char *err;
    size_t errlen;
    int code;
};

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* Closes d->tmp under empty edges, sorted and unique. */
static bool det_close(struct det *d)
{
    const gbuild_t *b = d->b;
    if (++d->gen == 0) {
        memset(d->mark, 0, b->n_st * sizeof *d->mark);
        d->gen = 1;
    }
    uint32_t n_stack = 0, n_in = d->n_tmp;
    d->n_tmp = 0;
    for (uint32_t i = 0; i < n_in; i++) {
        uint32_t s = d->tmp[i];
        if (d->mark[s] != d->gen) {
            d->mark[s] = d->gen;
            d->stack[n_stack++] = s;
        }
    }
    uint32_t n_out = 0;
    while (n_stack > 0) {
        uint32_t s = d->stack[--n_stack];
        if (!grow((void **)&d->tmp, &d->cap_tmp, n_out + 1, sizeof *d->tmp))
            return false;
        d->tmp[n_out++] = s;
        for (uint32_t k = d->eoff[s]; k < d->eoff[s + 1]; k++) {
            const struct nedge *e = &b->ed[d->eidx[k]];
            if (e->kind == NE_EPS && d->mark[e->to] != d->gen) {
                d->mark[e->to] = d->gen;
                d->stack[n_stack++] = (uint32_t)e->to;
            }
        }
    }
    qsort(d->tmp, n_out, sizeof *d->tmp, cmp_u32);
    d->n_tmp = n_out;
    return true;
}

static uint32_t hash_set(const uint32_t *s, uint32_t n)
{
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
    for (uint32_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 29;
    }
    return (uint32_t)(h ^ (h >> 32));
}

static bool det_rehash(struct det *d, uint32_t cap)
{
    uint32_t *h = calloc(cap, sizeof *h);
    if (h == NULL)
        return false;
    for (uint32_t k = 0; k < d->n_dfa; k++) {
        uint32_t i = hash_set(d->pool + d->set_off[k], d->set_len[k]) & (cap - 1);
        while (h[i])
            i = (i + 1) & (cap - 1);
        h[i] = k + 1;
    }
    free(d->hash);
    d->hash = h;
    d->hcap = cap;
    return true;
}

/* The DFA state of the set in d->tmp (closed), made when new; -1 on failure. */
static int64_t det_state(struct det *d, int32_t rule)
{
    uint32_t h = hash_set(d->tmp, d->n_tmp);
    for (uint32_t i = h & (d->hcap - 1);; i = (i + 1) & (d->hcap - 1)) {
        uint32_t k = d->hash[i];
        if (k == 0)
            break;
        k--;
        if (d->set_len[k] == d->n_tmp &&
            memcmp(d->pool + d->set_off[k], d->tmp, d->n_tmp * sizeof *d->tmp) == 0)
            return k;
    }
    if (d->n_dfa >= GRAMMAR_MAX_STATES) {
        d->code = kvd_seterr(d->err, d->errlen, KVD_ERANGE, "grammar: more than %u states",
                             GRAMMAR_MAX_STATES);
        return -1;
    }
    if (!grow((void **)&d->pool, &d->cap_pool, d->n_pool + d->n_tmp, sizeof *d->pool) ||
        !grow((void **)&d->set_off, &d->cap_dfa, d->n_dfa + 1, sizeof *d->set_off) ||
        !grow((void **)&d->set_len, &d->cap_dfa2, d->n_dfa + 1, sizeof *d->set_len) ||
        !grow((void **)&d->dfa_rule, &d->cap_dfa3, d->n_dfa + 1, sizeof *d->dfa_rule) ||
        !grow((void **)&d->st, &d->cap_st, d->n_dfa + 1, sizeof *d->st))
        goto nomem;
    uint32_t k = d->n_dfa++;
    memcpy(d->pool + d->n_pool, d->tmp, d->n_tmp * sizeof *d->tmp);
    d->set_off[k] = d->n_pool;
    d->set_len[k] = d->n_tmp;
    d->dfa_rule[k] = rule;
    d->n_pool += d->n_tmp;
    if (d->n_dfa * 2 > d->hcap) {
        if (!det_rehash(d, d->hcap * 2))
            goto nomem;
    } else {
        uint32_t i = h & (d->hcap - 1);
        while (d->hash[i])
            i = (i + 1) & (d->hcap - 1);
        d->hash[i] = k + 1;
    }
    return k;
nomem:
    d->code = kvd_seterr(d->err, d->errlen, KVD_ENOMEM, "grammar: out of memory");
    return -1;
}

/* A byte edge of a DFA state's members, one per byte of its range. */
struct bent {
    uint32_t to;            /* NFA target */
    uint32_t arg;           /* the counter operation's bound */
    uint8_t byte;           /* the byte */
    uint8_t op;             /* enum grammar_op */
};

/* A call of a DFA state's members. */
struct cent {
    int32_t callee;         /* the rule called */
    uint32_t to;            /* NFA return state */
    uint32_t arg;           /* the counter operation's bound */
    uint8_t op;             /* enum grammar_op */
};

static int cmp_cent(const void *a, const void *b)
{
    const struct cent *x = a, *y = b;
    if (x->callee != y->callee)
        return x->callee < y->callee ? -1 : 1;
    if (x->op != y->op)
        return x->op < y->op ? -1 : 1;
    if (x->arg != y->arg)
        return x->arg < y->arg ? -1 : 1;
    return (x->to > y->to) - (x->to < y->to);
}

/* Fills the edges, calls, final flag and tag of DFA state k. */
static bool det_expand(struct det *d, uint32_t k, const uint32_t *rule_dstart, struct bent **bents,
                       uint32_t *cap_b, struct cent **cents, uint32_t *cap_c)
{
    const gbuild_t *b = d->b;
    uint32_t off = d->set_off[k], len = d->set_len[k];
    struct gdst st;
    memset(&st, 0, sizeof st);
    st.rule = d->dfa_rule[k];
    uint32_t n_b = 0, n_c = 0, n_contrib = 0, tagged = 0;
    for (uint32_t i = 0; i < len; i++) {
        uint32_t s = d->pool[off + i];
        const struct nstate *ns = &b->st[s];
        bool contributes = ns->final;
        if (ns->final)
            st.final = 1;
        for (uint32_t j = d->eoff[s]; j < d->eoff[s + 1]; j++) {
            const struct nedge *e = &b->ed[d->eidx[j]];
            if (e->kind == NE_BYTES) {
                contributes = true;
                if (!grow((void **)bents, cap_b, n_b + (e->hi - e->lo) + 1u, sizeof **bents))
                    goto nomem;
                for (unsigned c = e->lo; c <= e->hi; c++)
                    (*bents)[n_b++] = (struct bent){ .to = (uint32_t)e->to, .arg = e->arg,
                                                     .byte = (uint8_t)c, .op = e->op };
            } else if (e->kind == NE_CALL) {
                contributes = true;
                if (!grow((void **)cents, cap_c, n_c + 1, sizeof **cents))
                    goto nomem;
                (*cents)[n_c++] = (struct cent){ .callee = e->callee, .to = (uint32_t)e->to,
                                                 .arg = e->arg, .op = e->op };
            }
        }
        if (contributes) {
            n_contrib++;
            if (ns->tag)
                tagged = s + 1;
        }
    }
    /* the plain-string mark survives only where that state is all there is */
    if (n_contrib == 1 && tagged) {
        const struct nstate *ns = &b->st[tagged - 1];
        st.tag = ns->tag;
        st.tag_u = ns->tag_u;
        st.tag_max = ns->tag_max;
    }
    /* bytes: group the entries by byte (counting sort, stable) */
    uint32_t cnt[257] = { 0 };
    for (uint32_t i = 0; i < n_b; i++)
        cnt[(*bents)[i].byte + 1]++;
    for (int c = 0; c < 256; c++)
        cnt[c + 1] += cnt[c];
    struct bent *sorted = malloc((n_b ? n_b : 1) * sizeof *sorted);
    if (sorted == NULL)
        goto nomem;
    {
        uint32_t pos[256];
        memcpy(pos, cnt, sizeof pos);
        for (uint32_t i = 0; i < n_b; i++)
            sorted[pos[(*bents)[i].byte]++] = (*bents)[i];
    }
    st.e0 = d->n_ed;
    int64_t prev_id = -1;
    uint32_t prev_lo = 0, prev_hi = 0;
    for (int c = 0; c < 256; c++) {
        uint32_t a = cnt[c], z = cnt[c + 1];
        if (a == z)
            continue;
        uint8_t op = sorted[a].op;
        uint32_t arg = sorted[a].arg;
        for (uint32_t i = a + 1; i < z; i++)
            if (sorted[i].op != op || sorted[i].arg != arg) {
                free(sorted);
                d->code = kvd_seterr(d->err, d->errlen, KVD_EINVAL,
                                     "grammar: two counter operations on byte 0x%02x in rule %d",
                                     c, st.rule);
                return false;
            }
        /* the same targets as the byte before: the same state */
        int64_t id = -1;
        if (c > 0 && prev_id >= 0 && prev_hi == (uint32_t)c - 1 && cnt[c - 1] != cnt[c] &&
            z - a == cnt[c] - cnt[c - 1]) {
            bool same = true;
            for (uint32_t i = 0; i < z - a && same; i++)
                same = sorted[a + i].to == sorted[prev_lo + i].to;
            const struct gedge *last = &d->ed[d->n_ed - 1];
            if (same && last->op == op && last->arg == arg)
                id = prev_id;
        }
        if (id < 0) {
            if (!grow((void **)&d->tmp, &d->cap_tmp, z - a, sizeof *d->tmp))
                goto nomem_sorted;
            d->n_tmp = 0;
            for (uint32_t i = a; i < z; i++)
                d->tmp[d->n_tmp++] = sorted[i].to;
            if (!det_close(d))
                goto nomem_sorted;
            id = det_state(d, st.rule);
            if (id < 0) {
                free(sorted);
                return false;
            }
        }
        struct gedge *last = d->n_ed > st.e0 ? &d->ed[d->n_ed - 1] : NULL;
        if (last && last->hi == c - 1 && last->to == (uint32_t)id && last->op == op && last->arg == arg) {
            last->hi = (uint8_t)c;
        } else {
            if (!grow((void **)&d->ed, &d->cap_ed, d->n_ed + 1, sizeof *d->ed))
                goto nomem_sorted;
            d->ed[d->n_ed++] = (struct gedge){ .lo = (uint8_t)c, .hi = (uint8_t)c, .op = op,
                                               .to = (uint32_t)id, .arg = arg };
        }
        prev_id = id;
        prev_lo = a;
        prev_hi = (uint32_t)c;
    }
    free(sorted);
    st.ne = d->n_ed - st.e0;
    /* calls: one per callee and counter operation, returning to the union */
    if (n_c > 1)
        qsort(*cents, n_c, sizeof **cents, cmp_cent);
    st.c0 = d->n_calls;
    for (uint32_t i = 0; i < n_c;) {
        uint32_t j = i;
        d->n_tmp = 0;
        while (j < n_c && (*cents)[j].callee == (*cents)[i].callee && (*cents)[j].op == (*cents)[i].op &&
               (*cents)[j].arg == (*cents)[i].arg) {
            if (!grow((void **)&d->tmp, &d->cap_tmp, d->n_tmp + 1, sizeof *d->tmp))
                goto nomem;
            d->tmp[d->n_tmp++] = (*cents)[j].to;
            j++;
        }
        if (!det_close(d))
            goto nomem;
        int64_t ret = det_state(d, st.rule);
        if (ret < 0)
            return false;
        if (!grow((void **)&d->calls, &d->cap_calls, d->n_calls + 1, sizeof *d->calls))
            goto nomem;
        d->calls[d->n_calls++] = (struct gcall){ .start = rule_dstart[(*cents)[i].callee],
                                                 .ret = (uint32_t)ret, .arg = (*cents)[i].arg,
                                                 .op = (*cents)[i].op, .callee = (*cents)[i].callee };
        i = j;
    }
    st.nc = d->n_calls - st.c0;
    d->st[k] = st;
    return true;
nomem_sorted:
    free(sorted);
nomem:
    d->code = kvd_seterr(d->err, d->errlen, KVD_ENOMEM, "grammar: out of memory");
    return false;
}

static void det_free(struct det *d)
{
    free(d->eoff);
    free(d->eidx);
    free(d->mark);
    free(d->stack);
    free(d->pool);
    free(d->set_off);
    free(d->set_len);
    free(d->dfa_rule);
    free(d->hash);
    free(d->st);
    free(d->ed);
    free(d->calls);
    free(d->tmp);
}

/* ---- checks on the finished automaton --------------------------------------------- */

/* Removes every state from which its rule cannot end, and every edge and call
 * into one (or into a rule with no finite match). False when the root rule
 * has none. */
static bool prune_dead(grammar_t *g, char *err, size_t errlen, int *code)
{
    uint8_t *live = calloc(g->n_st ? g->n_st : 1, 1);
    if (live == NULL) {
        *code = kvd_seterr(err, errlen, KVD_ENOMEM, "grammar: out of memory");
        return false;
    }
    bool changed = true;
    while (changed) {
        changed = false;
        for (uint32_t k = g->n_st; k-- > 0;) {
            if (live[k])
                continue;
            const struct gdst *s = &g->st[k];
            bool ok = s->final;
            for (uint32_t e = s->e0; e < s->e0 + s->ne && !ok; e++)
                ok = live[g->ed[e].to];
            for (uint32_t c = s->c0; c < s->c0 + s->nc && !ok; c++)
                ok = live[g->calls[c].start] && live[g->calls[c].ret];
            if (ok) {
                live[k] = 1;
                changed = true;
            }
        }
    }
    if (!live[g->root]) {
        free(live);
        *code = kvd_seterr(err, errlen, KVD_EINVAL, "the grammar matches nothing finite");
        return false;
    }
    uint32_t ne = 0, nc = 0;
    for (uint32_t k = 0; k < g->n_st; k++) {
        struct gdst *s = &g->st[k];
        uint32_t e0 = ne, c0 = nc;
        for (uint32_t e = s->e0; e < s->e0 + s->ne; e++)
            if (live[k] && live[g->ed[e].to])
                g->ed[ne++] = g->ed[e];
        for (uint32_t c = s->c0; c < s->c0 + s->nc; c++)
            if (live[k] && live[g->calls[c].start] && live[g->calls[c].ret])
                g->calls[nc++] = g->calls[c];
        s->e0 = e0;
        s->ne = ne - e0;
        s->c0 = c0;
        s->nc = nc - c0;
        if (!live[k])
            s->final = 0;
        memset(s->bits, 0, sizeof s->bits);
        for (uint32_t e = s->e0; e < s->e0 + s->ne; e++)
            for (unsigned c = g->ed[e].lo; c <= g->ed[e].hi; c++)
                s->bits[c >> 5] |= 1u << (c & 31);
    }
    g->n_ed = ne;
    g->n_calls = nc;
    free(live);
    return true;
}

/* Rule-level checks: no rule reaches itself without consuming a byte (left
 * recursion), and no chain of calls without recursion is deeper than the
 * stack. */
struct rcheck {
    const grammar_t *g;
    uint32_t *aoff;         /* (n_rules + 1) CSR of the rule call graph */
    uint32_t *adj;          /* callees */
    uint32_t *loff;         /* (n_rules + 1) CSR of the left-call graph */
    uint32_t *ladj;
    uint8_t *color;         /* DFS colors */
    uint32_t *depth;        /* longest chain below a rule */
};

static bool left_cycle(struct rcheck *r, uint32_t v)
{
    r->color[v] = 1;
    for (uint32_t i = r->loff[v]; i < r->loff[v + 1]; i++) {
        uint32_t w = r->ladj[i];
        if (r->color[w] == 1 || (r->color[w] == 0 && left_cycle(r, w)))
            return true;
    }
    r->color[v] = 2;
    return false;
}

static uint32_t chain_depth(struct rcheck *r, uint32_t v)
{
    if (r->color[v] == 2)
        return r->depth[v];
    r->color[v] = 1;
    uint32_t best = 0;
    for (uint32_t i = r->aoff[v]; i < r->aoff[v + 1]; i++) {
        uint32_t w = r->adj[i];
        if (r->color[w] == 1)
            continue;       /* recursion: bounded at run time */
        uint32_t dd = 1 + chain_depth(r, w);
        if (dd > best)
            best = dd;
        if (best > GRAMMAR_MAX_DEPTH)
            break;
    }
    r->color[v] = 2;
    r->depth[v] = best;
    return best;
}

/* Fills each state's height: the fewest return points above it that some way
 * to its rule's end needs, so that the matcher enters a state or a call only
 * where the stack has room to finish (recursion stops where it would not, and
 * never leaves a path without a way on). */
static bool set_heights(grammar_t *g, char *err, size_t errlen, int *code)
{
    for (uint32_t k = 0; k < g->n_st; k++)
        g->st[k].height = g->st[k].final ? 0 : HEIGHT_INF;
    for (bool changed = true; changed;) {
        changed = false;
        for (uint32_t k = g->n_st; k-- > 0;) {
            struct gdst *s = &g->st[k];
            unsigned h = s->height;
            for (uint32_t e = s->e0; e < s->e0 + s->ne; e++)
                if (g->st[g->ed[e].to].height < h)
                    h = g->st[g->ed[e].to].height;
            for (uint32_t c = s->c0; c < s->c0 + s->nc; c++) {
                unsigned a = g->st[g->calls[c].start].height + 1u, b = g->st[g->calls[c].ret].height;
                unsigned m = a > b ? a : b;
                if (m < h)
                    h = m;
            }
            if (h > GRAMMAR_MAX_DEPTH)
                h = HEIGHT_INF;
            if (h < s->height) {
                s->height = (uint8_t)h;
                changed = true;
            }
        }
    }
    if (g->st[g->root].height > GRAMMAR_MAX_DEPTH) {
        *code = kvd_seterr(err, errlen, KVD_ERANGE, "grammar: every match is nested deeper than %d levels",
                           GRAMMAR_MAX_DEPTH);
        return false;
    }
    return true;
}

static bool check_rules(grammar_t *g, char *err, size_t errlen, int *code)
{
    uint32_t nr = g->n_rules;
    struct rcheck r = { .g = g };
    uint8_t *nullable = calloc(nr, 1);
    uint8_t *zr = calloc(g->n_st ? g->n_st : 1, 1);
    uint32_t *queue = malloc((g->n_st ? g->n_st : 1) * sizeof *queue);
    r.aoff = calloc(nr + 1, sizeof *r.aoff);
    r.loff = calloc(nr + 1, sizeof *r.loff);
    r.adj = malloc((g->n_calls ? g->n_calls : 1) * sizeof *r.adj);
    r.ladj = malloc((g->n_calls ? g->n_calls : 1) * sizeof *r.ladj);
    r.color = calloc(nr, 1);
    r.depth = calloc(nr, sizeof *r.depth);
    bool ok = false;
    if (!nullable || !zr || !queue || !r.aoff || !r.loff || !r.adj || !r.ladj || !r.color || !r.depth) {
        *code = kvd_seterr(err, errlen, KVD_ENOMEM, "grammar: out of memory");
        goto out;
    }
    /* the states each rule reaches without a byte; nullable rules, to a fixpoint */
    for (int changed = 1; changed;) {
        changed = 0;
        memset(zr, 0, g->n_st);
        for (uint32_t rr = 0; rr < nr; rr++) {
            uint32_t nq = 0;
            queue[nq++] = g->rule_start[rr];
            zr[g->rule_start[rr]] = 1;
            bool fin = false;
            for (uint32_t qi = 0; qi < nq; qi++) {
                const struct gdst *s = &g->st[queue[qi]];
                fin |= s->final;
                for (uint32_t c = s->c0; c < s->c0 + s->nc; c++)
                    if (nullable[g->calls[c].callee] && !zr[g->calls[c].ret]) {
                        zr[g->calls[c].ret] = 1;
                        queue[nq++] = g->calls[c].ret;
                    }
            }
            if (fin && !nullable[rr]) {
                nullable[rr] = 1;
                changed = 1;
            }
        }
    }
    if (nullable[g->st[g->root].rule]) {
        *code = kvd_seterr(err, errlen, KVD_EINVAL, "grammar: the root rule matches the empty string");
        goto out;
    }
    /* call graphs: all calls, and those made before any byte */
    for (uint32_t k = 0; k < g->n_st; k++) {
        const struct gdst *s = &g->st[k];
        r.aoff[s->rule + 1] += s->nc;
        if (zr[k])
            r.loff[s->rule + 1] += s->nc;
    }
    for (uint32_t i = 0; i < nr; i++) {
        r.aoff[i + 1] += r.aoff[i];
        r.loff[i + 1] += r.loff[i];
    }
    {
        uint32_t *pa = malloc((nr + 1) * sizeof *pa), *pl = malloc((nr + 1) * sizeof *pl);
        if (!pa || !pl) {
            free(pa);
            free(pl);
            *code = kvd_seterr(err, errlen, KVD_ENOMEM, "grammar: out of memory");
            goto out;
        }
        memcpy(pa, r.aoff, (nr + 1) * sizeof *pa);
        memcpy(pl, r.loff, (nr + 1) * sizeof *pl);
        for (uint32_t k = 0; k < g->n_st; k++) {
            const struct gdst *s = &g->st[k];
            for (uint32_t c = s->c0; c < s->c0 + s->nc; c++) {
                r.adj[pa[s->rule]++] = (uint32_t)g->calls[c].callee;
                if (zr[k])
                    r.ladj[pl[s->rule]++] = (uint32_t)g->calls[c].callee;
            }
        }
        free(pa);
        free(pl);
    }
    for (uint32_t v = 0; v < nr; v++)
        if (r.color[v] == 0 && left_cycle(&r, v)) {
            *code = kvd_seterr(err, errlen, KVD_EINVAL,
                               "grammar: left recursion (a rule reaches itself before any byte)");
            goto out;
        }
    memset(r.color, 0, nr);
    if (chain_depth(&r, (uint32_t)g->st[g->root].rule) + 1 > GRAMMAR_MAX_DEPTH) {
        *code = kvd_seterr(err, errlen, KVD_ERANGE, "grammar: nested deeper than %d levels",
                           GRAMMAR_MAX_DEPTH);
        goto out;
    }
    ok = true;
out:
    free(nullable);
    free(zr);
    free(queue);
    free(r.aoff);
    free(r.loff);
    free(r.adj);
    free(r.ladj);
    free(r.color);
    free(r.depth);
    return ok;
}

grammar_t *grammar_build_finish(gbuild_t **bp, int32_t root, char *err, size_t errlen)
{
    gbuild_t *b = bp ? *bp : NULL;
    if (bp)
        *bp = NULL;
    if (b == NULL) {
        kvd_seterr(err, errlen, KVD_EINVAL, "grammar: no builder");
        return NULL;
    }
    grammar_t *g = NULL;
    struct det d = { .b = b, .err = err, .errlen = errlen };
    struct bent *bents = NULL;
    struct cent *cents = NULL;
    uint32_t cap_b = 0, cap_c = 0;
    uint32_t *rule_dstart = NULL;
    if (b->err) {
        kvd_seterr(err, errlen, b->err, "grammar: building failed: %s", kvd_strerror(b->err));
        goto fail;
    }
    if (root < 0 || (uint32_t)root >= b->n_rules) {
        kvd_seterr(err, errlen, KVD_EINVAL, "grammar: no root rule %d", root);
        goto fail;
    }
    d.eoff = calloc(b->n_st + 1, sizeof *d.eoff);
    d.eidx = malloc((b->n_ed ? b->n_ed : 1) * sizeof *d.eidx);
    d.mark = calloc(b->n_st, sizeof *d.mark);
    d.stack = malloc(b->n_st * sizeof *d.stack);
    rule_dstart = malloc(b->n_rules * sizeof *rule_dstart);
    if (!d.eoff || !d.eidx || !d.mark || !d.stack || !rule_dstart || !det_rehash(&d, 1024))
        goto nomem;
    for (uint32_t i = 0; i < b->n_ed; i++)
        d.eoff[b->ed[i].from + 1]++;
    for (uint32_t i = 0; i < b->n_st; i++)
        d.eoff[i + 1] += d.eoff[i];
    {
        uint32_t *pos = malloc((b->n_st + 1) * sizeof *pos);
        if (pos == NULL)
            goto nomem;
        memcpy(pos, d.eoff, (b->n_st + 1) * sizeof *pos);
        for (uint32_t i = 0; i < b->n_ed; i++)
            d.eidx[pos[b->ed[i].from]++] = i;
        free(pos);
    }
    for (uint32_t r = 0; r < b->n_rules; r++) {
        if (!grow((void **)&d.tmp, &d.cap_tmp, 1, sizeof *d.tmp))
            goto nomem;
        d.tmp[0] = (uint32_t)b->start[r];
        d.n_tmp = 1;
        if (!det_close(&d))
            goto nomem;
        int64_t k = det_state(&d, (int32_t)r);
        if (k < 0)
            goto fail;
        rule_dstart[r] = (uint32_t)k;
    }
    for (uint32_t k = 0; k < d.n_dfa; k++)
        if (!det_expand(&d, k, rule_dstart, &bents, &cap_b, &cents, &cap_c))
            goto fail;
    g = calloc(1, sizeof *g);
    if (g == NULL)
        goto nomem;
    g->st = d.st;
    g->n_st = d.n_dfa;
    g->ed = d.ed;
    g->n_ed = d.n_ed;
    g->calls = d.calls;
    g->n_calls = d.n_calls;
    g->rule_start = rule_dstart;
    g->n_rules = b->n_rules;
    g->root = rule_dstart[root];
    d.st = NULL;
    d.ed = NULL;
    d.calls = NULL;
    rule_dstart = NULL;
    int code = 0;
    if (!prune_dead(g, err, errlen, &code) || !check_rules(g, err, errlen, &code) ||
        !set_heights(g, err, errlen, &code))
        goto fail;
    det_free(&d);
    free(bents);
    free(cents);
    grammar_build_destroy(&b);
    return g;
nomem:
    kvd_seterr(err, errlen, KVD_ENOMEM, "grammar: out of memory");
fail:
    grammar_destroy(&g);
    det_free(&d);
    free(bents);
    free(cents);
    free(rule_dstart);
    grammar_build_destroy(&b);
    return NULL;
}

/* ---- matching ---------------------------------------------------------------------- */

/* A path's position (an active configuration), or a return point on a stack:
 * the state, its rule invocation's counter, the return point below (index in
 * a frame pool, -1 for none) and the number of return points below. */
struct gpos {
    uint32_t state;
    uint32_t counter;
    int32_t up;
    uint32_t depth;
};

/* The working memory of a step. */
struct gwork {
    const grammar_t *g;
    struct gpos *fr;        /* frame pool (grows) */
    uint32_t n_fr, cap_fr;
    struct gpos *out;       /* (GRAMMAR_MAX_PATHS) the step's result */
    uint32_t n_out;
    bool complete;          /* a path ended the root rule */
    bool nomem;
};

struct gstate {
    const grammar_t *g;
    struct gpos cfg[GRAMMAR_MAX_PATHS]; /* the live paths: states with byte edges */
    uint32_t n_cfg;
    struct gpos *fr;        /* (n_fr) the return points they share */
    uint32_t n_fr, cap_fr;
    struct gpos *fr2;       /* compaction buffer */
    uint32_t cap_fr2;
    int32_t *remap;         /* compaction map */
    uint32_t cap_remap;
    bool complete;          /* the bytes so far match the grammar */
    bool ended;             /* an end of generation was accepted */
};

static inline bool apply_op(uint8_t op, uint32_t arg, uint32_t c, uint32_t *out)
{
    if (op == GRAMMAR_OP_INC) {
        if (c >= arg)
            return false;
        *out = c + 1;
        return true;
    }
    if (op == GRAMMAR_OP_MIN && c < arg)
        return false;
    *out = c;
    return true;
}

static bool same_stack(const struct gpos *fr, int32_t a, int32_t b)
{
    while (a != b) {
        if (a < 0 || b < 0)
            return false;
        if (fr[a].state != fr[b].state || fr[a].counter != fr[b].counter)
            return false;
        a = fr[a].up;
        b = fr[b].up;
    }
    return true;
}

static void add_active(struct gwork *w, uint32_t st, uint32_t c, int32_t up, uint32_t depth)
{
    for (uint32_t i = 0; i < w->n_out; i++) {
        const struct gpos *o = &w->out[i];
        if (o->state == st && o->counter == c && o->depth == depth && same_stack(w->fr, o->up, up))
            return;
    }
    if (w->n_out < GRAMMAR_MAX_PATHS)
        w->out[w->n_out++] = (struct gpos){ st, c, up, depth };
}

/* Follows path (st, c, up, depth) through returns and calls to the states
 * that wait for a byte. */
static void closure(struct gwork *w, uint32_t st, uint32_t c, int32_t up, uint32_t depth)
{
    const grammar_t *g = w->g;
    const struct gdst *s = &g->st[st];
    if (s->ne)
        add_active(w, st, c, up, depth);
    if (s->final) {
        if (up < 0) {
            w->complete = true;
        } else {
            struct gpos f = w->fr[up];
            closure(w, f.state, f.counter, f.up, f.depth);
        }
    }
    for (uint32_t i = 0; i < s->nc; i++) {
        const struct gcall *k = &g->calls[s->c0 + i];
        uint32_t c2;
        if (depth + 1u + g->st[k->start].height > GRAMMAR_MAX_DEPTH ||
            depth + (uint32_t)g->st[k->ret].height > GRAMMAR_MAX_DEPTH || !apply_op(k->op, k->arg, c, &c2))
            continue;
        if (w->n_fr >= w->cap_fr && !grow((void **)&w->fr, &w->cap_fr, w->n_fr + 1, sizeof *w->fr)) {
            w->nomem = true;
            return;
        }
        int32_t f = (int32_t)w->n_fr++;
        w->fr[f] = (struct gpos){ k->ret, c2, up, depth };
        closure(w, k->start, 0, f, depth + 1);
    }
}

static inline const struct gedge *find_edge(const grammar_t *g, const struct gdst *s, uint8_t c)
{
    const struct gedge *e = g->ed + s->e0, *end = e + s->ne;
    for (; e < end; e++)
        if (c <= e->hi)
            return c >= e->lo ? e : NULL;
    return NULL;
}

/* Steps paths in[0..n_in) by byte c into w->out. */
static void step(struct gwork *w, const struct gpos *in, uint32_t n_in, uint8_t c)
{
    const grammar_t *g = w->g;
    w->n_out = 0;
    w->complete = false;
    for (uint32_t i = 0; i < n_in; i++) {
        const struct gdst *s = &g->st[in[i].state];
        if (!((s->bits[c >> 5] >> (c & 31)) & 1u))
            continue;
        const struct gedge *e = find_edge(g, s, c);
        uint32_t c2;
        if (e == NULL || !apply_op(e->op, e->arg, in[i].counter, &c2))
            continue;
        const struct gdst *t = &g->st[e->to];
        if (in[i].depth + (uint32_t)t->height > GRAMMAR_MAX_DEPTH)
            continue;       /* no room on the stack to finish from there */
        if (n_in == 1 && t->nc == 0 && !t->final) {
            /* the common case: one path, staying in its rule */
            w->out[0] = (struct gpos){ e->to, c2, in[i].up, in[i].depth };
            w->n_out = 1;
            return;
        }
        closure(w, e->to, c2, in[i].up, in[i].depth);
    }
}

static void state_start(gstate_t *s)
{
    struct gwork w = { .g = s->g, .fr = s->fr, .cap_fr = s->cap_fr, .out = s->cfg };
    closure(&w, s->g->root, 0, -1, 0);
    s->fr = w.fr;
    s->cap_fr = w.cap_fr;
    s->n_fr = w.n_fr;
    s->n_cfg = w.n_out;
    s->complete = w.complete;
    s->ended = false;
}

gstate_t *grammar_state_new(const grammar_t *g)
{
    if (g == NULL)
        return NULL;
    gstate_t *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    s->g = g;
    state_start(s);
    return s;
}

void grammar_state_destroy(gstate_t **sp)
{
    if (sp == NULL || *sp == NULL)
        return;
    gstate_t *s = *sp;
    free(s->fr);
    free(s->fr2);
    free(s->remap);
    free(s);
    *sp = NULL;
}

void grammar_state_reset(gstate_t *s)
{
    s->n_fr = 0;
    state_start(s);
}

int grammar_state_copy(gstate_t *dst, const gstate_t *src)
{
    if (dst == src)
        return 0;
    if (dst->g != src->g)
        return KVD_EINVAL;
    if (!grow((void **)&dst->fr, &dst->cap_fr, src->n_fr, sizeof *dst->fr))
        return KVD_ENOMEM;
    memcpy(dst->cfg, src->cfg, src->n_cfg * sizeof *src->cfg);
    if (src->n_fr)
        memcpy(dst->fr, src->fr, src->n_fr * sizeof *src->fr);
    dst->n_cfg = src->n_cfg;
    dst->n_fr = src->n_fr;
    dst->complete = src->complete;
    dst->ended = src->ended;
    return 0;
}

/* Keeps only the return points the live paths use. */
static bool state_compact(gstate_t *s, const struct gpos *cfg, uint32_t n_cfg)
{
    if (!grow((void **)&s->remap, &s->cap_remap, s->n_fr, sizeof *s->remap) ||
        !grow((void **)&s->fr2, &s->cap_fr2, s->n_fr, sizeof *s->fr2))
        return false;
    for (uint32_t i = 0; i < s->n_fr; i++)
        s->remap[i] = -1;
    uint32_t n = 0;
    int32_t chain[GRAMMAR_MAX_DEPTH + 1];
    for (uint32_t i = 0; i < n_cfg; i++) {
        uint32_t m = 0;
        for (int32_t f = cfg[i].up; f >= 0 && s->remap[f] < 0; f = s->fr[f].up)
            chain[m++] = f;
        while (m > 0) {
            int32_t f = chain[--m];
            struct gpos p = s->fr[f];
            p.up = p.up >= 0 ? s->remap[p.up] : -1;
            s->fr2[n] = p;
            s->remap[f] = (int32_t)n++;
        }
    }
    for (uint32_t i = 0; i < n_cfg; i++) {
        s->cfg[i] = cfg[i];
        s->cfg[i].up = cfg[i].up >= 0 ? s->remap[cfg[i].up] : -1;
    }
    s->n_cfg = n_cfg;
    struct gpos *t = s->fr;
    uint32_t tc = s->cap_fr;
    s->fr = s->fr2;
    s->cap_fr = s->cap_fr2;
    s->fr2 = t;
    s->cap_fr2 = tc;
    s->n_fr = n;
    return true;
}

bool grammar_accept_bytes(gstate_t *s, const void *p, size_t n)
{
    const uint8_t *bytes = p;
    if (s->ended)
        return n == 0;
    if (n == 0)
        return true;
    struct gpos a[GRAMMAR_MAX_PATHS], b[GRAMMAR_MAX_PATHS];
    const struct gpos *in = s->cfg;
    uint32_t n_in = s->n_cfg;
    struct gwork w = { .g = s->g, .fr = s->fr, .n_fr = s->n_fr, .cap_fr = s->cap_fr };
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        w.out = (i & 1) ? b : a;
        step(&w, in, n_in, bytes[i]);
        in = w.out;
        n_in = w.n_out;
        ok = !w.nomem && (n_in > 0 || w.complete);
    }
    s->fr = w.fr;
    s->cap_fr = w.cap_fr;
    if (!ok)
        return false;
    uint32_t keep = s->n_fr;
    s->n_fr = w.n_fr;
    if (!state_compact(s, in, n_in)) {
        s->n_fr = keep;
        return false;
    }
    s->complete = w.complete;
    return true;
}

bool grammar_accept_byte(gstate_t *s, uint8_t byte)
{
    return grammar_accept_bytes(s, &byte, 1);
}

bool grammar_is_complete(const gstate_t *s) { return s->complete && !s->ended; }

bool grammar_is_ended(const gstate_t *s) { return s->ended; }

/* ---- the token trie ----------------------------------------------------------------- */

/* A trie node; nodes are stored in preorder, children in byte order. */
struct tnode {
    uint32_t end;           /* index past the subtree */
    uint32_t tok;           /* first token of the subtree in trie order (those ending here first) */
    uint16_t depth;         /* bytes from the root (1 for the root's children) */
    uint16_t height;        /* bytes from this one to the end of the subtree's longest token */
    uint16_t n_here;        /* tokens whose bytes end here */
    uint8_t byte;           /* the byte leading here */
    uint8_t plain;          /* bit u: every token below, from this byte on, is plain string
                               content from UTF-8 substate u */
};

enum { PIECE_NONE = 0, PIECE_TRIE = 1, PIECE_EOG = 2 };

#define PLAIN_NMAX 64       /* plain tokens by characters, for strings with a maximum length */

struct gtrie {
    uint32_t n_vocab;
    uint32_t words;         /* mask words */
    struct tnode *nodes;    /* (n_nodes) preorder */
    uint32_t n_nodes;
    int32_t *order;         /* (n_order) token ids in trie order */
    uint32_t n_order;
    uint32_t *plainmask;    /* (U_N * words) tokens whose bytes are all plain content from u */
    uint32_t *plainn;       /* (PLAIN_NMAX * words) row n - 1: tokens of plain content from a
                               character boundary that start at most n characters */
    uint32_t max_nchar;     /* the most characters a plain token starts */
    uint32_t *eog;          /* (n_eog) end-of-generation ids */
    uint32_t n_eog;
    uint32_t *piece_off;    /* (n_vocab) each token's bytes in pieces */
    uint16_t *piece_len;    /* (n_vocab) */
    uint8_t *piece_kind;    /* (n_vocab) PIECE_* */
    char *pieces;
    uint32_t max_len;       /* longest token in the trie, bytes */
};

/* A token's bytes, for sorting the vocabulary into trie order. */
struct tsort {
    const char *p;          /* its bytes (in the trie's pieces) */
    uint32_t len;           /* bytes */
    int32_t id;             /* token id */
};

static int cmp_tsort(const void *a, const void *b)
{
    const struct tsort *x = a, *y = b;
    uint32_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, n);
    if (c)
        return c;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

void grammar_trie_destroy(gtrie_t **tp)
{
    if (tp == NULL || *tp == NULL)
        return;
    gtrie_t *t = *tp;
    free(t->nodes);
    free(t->order);
    free(t->plainmask);
    free(t->plainn);
    free(t->eog);
    free(t->piece_off);
    free(t->piece_len);
    free(t->piece_kind);
    free(t->pieces);
    free(t);
    *tp = NULL;
}

uint32_t grammar_trie_n_vocab(const gtrie_t *t) { return t->n_vocab; }

uint32_t grammar_trie_n_nodes(const gtrie_t *t) { return t->n_nodes; }

gtrie_t *grammar_trie_new(const tok_t *tk, char *err, size_t errlen)
{
    size_t nv = tk ? tok_n_vocab(tk) : 0;
    if (nv == 0 || nv > INT32_MAX) {
        kvd_seterr(err, errlen, KVD_EINVAL, "grammar trie: no vocabulary");
        return NULL;
    }
    gtrie_t *t = calloc(1, sizeof *t);
    struct tsort *ts = NULL;
    uint32_t *stack = NULL;
    if (t == NULL)
        goto nomem;
    t->n_vocab = (uint32_t)nv;
    t->words = (uint32_t)((nv + 31) / 32);
    t->piece_off = calloc(nv, sizeof *t->piece_off);
    t->piece_len = calloc(nv, sizeof *t->piece_len);
    t->piece_kind = calloc(nv, 1);
    t->eog = malloc(nv * sizeof *t->eog);
    if (!t->piece_off || !t->piece_len || !t->piece_kind || !t->eog)
        goto nomem;
    /* every token's bytes */
    size_t n_bytes = 0, cap_bytes = 0;
    char buf[1024];
    for (size_t id = 0; id < nv; id++) {
        size_t n = 0;
        if (tok_is_eog(tk, (int32_t)id)) {
            t->piece_kind[id] = PIECE_EOG;
            t->eog[t->n_eog++] = (uint32_t)id;
            continue;
        }
        int type = tok_type(tk, (int32_t)id);
        if (type != TOK_TYPE_NORMAL && type != TOK_TYPE_BYTE && type != TOK_TYPE_USER_DEFINED)
            continue;
        int rc = tok_decode_piece(tk, (int32_t)id, buf, sizeof buf, &n);
        if (rc != 0 || n == 0 || n > UINT16_MAX)
            continue;       /* no bytes, or a piece too long to ever be worth it */
        if (n_bytes + n > cap_bytes) {
            size_t c = cap_bytes ? cap_bytes * 2 : 1 << 20;
            while (c < n_bytes + n)
                c *= 2;
            char *q = realloc(t->pieces, c);
            if (q == NULL)
                goto nomem;
            t->pieces = q;
            cap_bytes = c;
        }
        memcpy(t->pieces + n_bytes, buf, n);
        t->piece_off[id] = (uint32_t)n_bytes;
        t->piece_len[id] = (uint16_t)n;
        t->piece_kind[id] = PIECE_TRIE;
        n_bytes += n;
        t->n_order++;
        if (n > t->max_len)
            t->max_len = (uint32_t)n;
    }
    /* the trie in preorder, from the pieces sorted */
    ts = malloc((t->n_order ? t->n_order : 1) * sizeof *ts);
    t->order = malloc((t->n_order ? t->n_order : 1) * sizeof *t->order);
    t->nodes = malloc((n_bytes ? n_bytes : 1) * sizeof *t->nodes);
    stack = malloc((t->max_len + 1) * sizeof *stack);
    if (!ts || !t->order || !t->nodes || !stack)
        goto nomem;
    uint32_t k = 0;
    for (size_t id = 0; id < nv; id++)
        if (t->piece_kind[id] == PIECE_TRIE)
            ts[k++] = (struct tsort){ t->pieces + t->piece_off[id], t->piece_len[id], (int32_t)id };
    qsort(ts, t->n_order, sizeof *ts, cmp_tsort);
    uint32_t depth = 0;     /* nodes on stack[0..depth): the path of the previous token */
    const struct tsort *prev = NULL;
    for (uint32_t i = 0; i < t->n_order; i++) {
        const struct tsort *s = &ts[i];
        t->order[i] = s->id;
        uint32_t lcp = 0;
        if (prev != NULL)
            while (lcp < prev->len && lcp < s->len && prev->p[lcp] == s->p[lcp])
                lcp++;
        while (depth > lcp)
            t->nodes[stack[--depth]].end = t->n_nodes;
        for (uint32_t j = lcp; j < s->len; j++) {
            struct tnode *nd = &t->nodes[t->n_nodes];
            memset(nd, 0, sizeof *nd);
            nd->tok = i;
            nd->depth = (uint16_t)(j + 1);
            nd->byte = (uint8_t)s->p[j];
            stack[depth++] = t->n_nodes++;
        }
        if (t->nodes[stack[depth - 1]].n_here < UINT16_MAX)
            t->nodes[stack[depth - 1]].n_here++;
        prev = s;
    }
    while (depth > 0)
        t->nodes[stack[--depth]].end = t->n_nodes;
    if (t->n_nodes > 0) {
        struct tnode *q = realloc(t->nodes, t->n_nodes * sizeof *t->nodes);
        if (q != NULL)
            t->nodes = q;
    }
    /* heights and plain bits, children before parents */
    for (uint32_t i = t->n_nodes; i-- > 0;) {
        struct tnode *nd = &t->nodes[i];
        uint32_t h = 1;
        uint8_t plain = 0;
        int next[U_N];
        for (int u = 0; u < U_N; u++) {
            next[u] = utf8_plain_step(u, nd->byte);
            if (next[u] >= 0)
                plain |= (uint8_t)(1u << u);
        }
        for (uint32_t c = i + 1; c < nd->end; c = t->nodes[c].end) {
            const struct tnode *ch = &t->nodes[c];
            if (ch->height + 1u > h)
                h = ch->height + 1u;
            for (int u = 0; u < U_N; u++)
                if (next[u] < 0 || !((ch->plain >> next[u]) & 1u))
                    plain &= (uint8_t)~(1u << u);
        }
        nd->height = (uint16_t)(h > UINT16_MAX ? UINT16_MAX : h);
        nd->plain = plain;
    }
    /* the tokens that are plain content as a whole, from each substate */
    t->plainmask = calloc((size_t)U_N * t->words, sizeof *t->plainmask);
    t->plainn = calloc((size_t)PLAIN_NMAX * t->words, sizeof *t->plainn);
    if (t->plainmask == NULL || t->plainn == NULL)
        goto nomem;
    for (size_t id = 0; id < nv; id++) {
        if (t->piece_kind[id] != PIECE_TRIE)
            continue;
        const uint8_t *p = (const uint8_t *)t->pieces + t->piece_off[id];
        for (int u = 0; u < U_N; u++) {
            int v = u;
            for (uint32_t j = 0; j < t->piece_len[id] && v >= 0; j++)
                v = utf8_plain_step(v, p[j]);
            if (v < 0)
                continue;
            t->plainmask[(size_t)u * t->words + id / 32] |= 1u << (id % 32);
            if (u != U_S0)
                continue;
            /* the characters it starts: the string's counter goes up by as many */
            uint32_t nc = 0;
            for (uint32_t j = 0; j < t->piece_len[id]; j++)
                nc += (p[j] & 0xC0) != 0x80;
            if (nc > t->max_nchar)
                t->max_nchar = nc;
            if (nc <= PLAIN_NMAX)
                t->plainn[(size_t)(nc ? nc - 1 : 0) * t->words + id / 32] |= 1u << (id % 32);
        }
    }
    for (uint32_t n = 1; n < PLAIN_NMAX; n++)      /* at most n: the rows below too */
        for (uint32_t i = 0; i < t->words; i++)
            t->plainn[(size_t)n * t->words + i] |= t->plainn[(size_t)(n - 1) * t->words + i];
    free(ts);
    free(stack);
    return t;
nomem:
    kvd_seterr(err, errlen, KVD_ENOMEM, "grammar trie: out of memory");
    free(ts);
    free(stack);
    grammar_trie_destroy(&t);
    return NULL;
}

/* ---- the mask ---------------------------------------------------------------------- */

/* One byte level of the walk: the paths after the bytes down to a node. */
struct lvl {
    uint32_t off, n;        /* paths in the walk's buffer */
    uint32_t n_fr;          /* frame pool size after them */
    uint32_t budget;        /* str: characters the string may still take */
    uint8_t str;            /* one path, in a plain-string state */
    uint8_t u;              /* str: its UTF-8 substate */
    uint8_t pathplain;      /* every byte so far was plain content from the root's string
                               state, and every plain token it accepts is in the mask already */
};

static void lvl_mark(const grammar_t *g, struct lvl *l, const struct gpos *p, bool parent_plain)
{
    l->str = 0;
    l->pathplain = 0;
    if (l->n != 1)
        return;
    const struct gdst *s = &g->st[p->state];
    if (s->tag != TAG_STR)
        return;
    l->str = 1;
    l->u = s->tag_u;
    l->budget = s->tag_max == UINT32_MAX ? UINT32_MAX
                : (p->counter >= s->tag_max ? 0 : s->tag_max - p->counter);
    l->pathplain = parent_plain;
}

static inline void set_bit(uint32_t *m, uint32_t id) { m[id >> 5] |= 1u << (id & 31); }

static uint32_t popcount_mask(const uint32_t *m, uint32_t words)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < words; i++)
        n += (uint32_t)__builtin_popcount(m[i]);
    return n;
}

/* The walk's memory, kept across the paths of one mask. */
struct walk {
    struct lvl *lv;         /* (max_len + 1) */
    struct gpos *buf;       /* paths of every level on the way down */
    uint32_t cap_buf;
    struct gwork w;         /* frames: the state's, then the walk's */
};

/* ORs into mask the tokens whose bytes paths cfg[0..n) accept, walking the
 * trie from them; the frames they use are w->w.fr[0..n_fr). */
static int walk_paths(const grammar_t *g, const gtrie_t *t, struct walk *wk, const struct gpos *cfg,
                      uint32_t n, uint32_t n_fr, uint32_t *mask)
{
    struct lvl *lv = wk->lv;
    struct gpos *buf = wk->buf;
    uint32_t cap_buf = wk->cap_buf;
    struct gwork w = wk->w;
    memcpy(buf, cfg, n * sizeof *buf);
    lv[0] = (struct lvl){ .off = 0, .n = n, .n_fr = n_fr };
    lvl_mark(g, &lv[0], &buf[0], false);
    /* inside a string: every token of plain characters that fits, at once; the
     * walk below then skips every subtree of plain characters */
    if (lv[0].str) {
        const uint32_t *pm = NULL;
        if (lv[0].budget == UINT32_MAX || (lv[0].budget >= t->max_nchar && lv[0].u == U_S0))
            pm = t->plainmask + (size_t)lv[0].u * t->words;
        else if (lv[0].u == U_S0 && lv[0].budget > 0 && lv[0].budget <= PLAIN_NMAX)
            pm = t->plainn + (size_t)(lv[0].budget - 1) * t->words;
        if (pm != NULL) {
            for (uint32_t i = 0; i < t->words; i++)
                mask[i] |= pm[i];
            lv[0].pathplain = 1;
        }
    }
    int rc = 0;
    const struct tnode *nodes = t->nodes;
    for (uint32_t i = 0; i < t->n_nodes;) {
        const struct tnode *nd = &nodes[i];
        uint32_t d = nd->depth;
        struct lvl *P = &lv[d - 1];
        if (P->str && ((nd->plain >> P->u) & 1u)) {
            if (P->pathplain) {         /* plain from the root: in the mask already, or too long */
                i = nd->end;
                continue;
            }
            if (nd->height <= P->budget) {  /* plain characters the string has room for */
                uint32_t hi = nd->end < t->n_nodes ? nodes[nd->end].tok : t->n_order;
                for (uint32_t k = nd->tok; k < hi; k++)
                    set_bit(mask, (uint32_t)t->order[k]);
                i = nd->end;
                continue;
            }
        }
        uint32_t off = P->off + P->n;
        if (off + GRAMMAR_MAX_PATHS > cap_buf) {
            uint32_t c = cap_buf * 2 + GRAMMAR_MAX_PATHS;
            struct gpos *q = realloc(buf, c * sizeof *buf);
            if (q == NULL) {
                rc = KVD_ENOMEM;
                break;
            }
            buf = q;
            cap_buf = c;
        }
        w.n_fr = P->n_fr;
        w.out = buf + off;
        step(&w, buf + P->off, P->n, nd->byte);
        if (w.nomem) {
            rc = KVD_ENOMEM;
            break;
        }
        if (w.n_out == 0 && !w.complete) {
            i = nd->end;
            continue;
        }
        for (uint32_t k = nd->tok; k < nd->tok + nd->n_here; k++)
            set_bit(mask, (uint32_t)t->order[k]);
        if (nd->end > i + 1) {
            struct lvl *L = &lv[d];
            L->off = off;
            L->n = w.n_out;
            L->n_fr = w.n_fr;
            lvl_mark(g, L, buf + off, P->pathplain && P->str);
        }
        i++;
    }
    wk->buf = buf;
    wk->cap_buf = cap_buf;
    wk->w = w;
    return rc;
}

int grammar_mask(const gstate_t *s, const gtrie_t *t, uint32_t *mask, uint32_t *n_allowed)
{
    const grammar_t *g = s->g;
    memset(mask, 0, t->words * sizeof *mask);
    if (n_allowed)
        *n_allowed = 0;
    if (s->ended)
        return 0;
    if (s->complete)
        for (uint32_t i = 0; i < t->n_eog; i++)
            set_bit(mask, t->eog[i]);
    if (s->n_cfg == 0 || t->n_nodes == 0) {
        if (n_allowed)
            *n_allowed = popcount_mask(mask, t->words);
        return 0;
    }
    struct walk wk = { .lv = malloc((t->max_len + 1) * sizeof *wk.lv),
                       .cap_buf = (t->max_len + 1) * 2 + GRAMMAR_MAX_PATHS * 2,
                       .w = { .g = g, .n_fr = s->n_fr } };
    wk.buf = malloc(wk.cap_buf * sizeof *wk.buf);
    if (wk.lv == NULL || wk.buf == NULL || !grow((void **)&wk.w.fr, &wk.w.cap_fr, s->n_fr + 64, sizeof *wk.w.fr)) {
        free(wk.lv);
        free(wk.buf);
        free(wk.w.fr);
        return KVD_ENOMEM;
    }
    if (s->n_fr)
        memcpy(wk.w.fr, s->fr, s->n_fr * sizeof *wk.w.fr);
    /* a token is allowed when some path accepts it: one walk per path, so
     * that each can take the shortcuts of its own state (a string's) */
    int rc = 0;
    for (uint32_t i = 0; i < s->n_cfg && rc == 0; i++)
        rc = walk_paths(g, t, &wk, &s->cfg[i], 1, s->n_fr, mask);
    free(wk.lv);
    free(wk.buf);
    free(wk.w.fr);
    if (rc == 0 && n_allowed)
        *n_allowed = popcount_mask(mask, t->words);
    return rc;
}

int grammar_mask_bruteforce(const gstate_t *s, const gtrie_t *t, uint32_t *mask, uint32_t *n_allowed)
{
    gstate_t *c = grammar_state_new(s->g);
    if (c == NULL)
        return KVD_ENOMEM;
    memset(mask, 0, t->words * sizeof *mask);
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        bool ok = false;
        if (t->piece_kind[id] == PIECE_EOG) {
            ok = grammar_is_complete(s);
        } else if (t->piece_kind[id] == PIECE_TRIE) {
            if (grammar_state_copy(c, s) != 0) {
                grammar_state_destroy(&c);
                return KVD_ENOMEM;
            }
            ok = grammar_accept_bytes(c, t->pieces + t->piece_off[id], t->piece_len[id]);
        }
        if (ok)
            set_bit(mask, id);
    }
    grammar_state_destroy(&c);
    if (n_allowed)
        *n_allowed = popcount_mask(mask, t->words);
    return 0;
}

void grammar_mask_apply(const uint32_t *mask, float *logits, uint32_t n_vocab)
{
    for (uint32_t w = 0; w < (n_vocab + 31) / 32; w++) {
        uint32_t m = mask[w];
        if (m == UINT32_MAX)
            continue;
        uint32_t hi = (w + 1) * 32 < n_vocab ? (w + 1) * 32 : n_vocab;
        for (uint32_t id = w * 32; id < hi; id++)
            if (!((m >> (id & 31)) & 1u))
                logits[id] = -INFINITY;
    }
}

int grammar_advance_token(gstate_t *s, const gtrie_t *t, int32_t id)
{
    if (id < 0 || (uint32_t)id >= t->n_vocab)
        return KVD_ERANGE;
    switch (t->piece_kind[id]) {
    case PIECE_EOG:
        if (!grammar_is_complete(s))
            return KVD_EINVAL;
        s->ended = true;
        return 0;
    case PIECE_TRIE:
        return grammar_accept_bytes(s, t->pieces + t->piece_off[id], t->piece_len[id]) ? 0
                                                                                       : KVD_EINVAL;
    default:
        return KVD_EINVAL;
    }
}
