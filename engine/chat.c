/*
 * chat.c - chat templates (see chat.h).
 *
 * A ChatML template is recognized by its markers. Its default system message,
 * if any, is the Jinja string literal that opens with "<|im_start|>system\n"
 * and holds "<|im_end|>" (SmolLM2:
 *   {% if loop.first and messages[0]['role'] != 'system' %}
 *   {{ '<|im_start|>system\nYou are a helpful AI assistant ...<|im_end|>\n' }}
 * ); the literal is kept whole and emitted verbatim. When it sits inside the
 * template's message loop it is emitted only before a first message (a
 * conversation with no messages gets none), as the Jinja does.
 *
 * A Gemma template is recognized by "<start_of_turn>", and is also what a
 * gemma3 file without a template gets (Gemma 3 270M ships none). Its format,
 * as llama.cpp's built-in "gemma" template renders it (Google's Jinja starts
 * with "{{ bos_token }}", left here to the tokenizer, which adds BOS to Gemma
 * prompts): a leading system message is no turn of its own but its content,
 * trimmed, and "\n\n" open the first turn; each message is
 * "<start_of_turn>ROLE\n" + content, trimmed, + "<end_of_turn>\n" with the
 * assistant's role named "model"; the generation prompt is
 * "<start_of_turn>model\n". Trimming strips ASCII whitespace (the system
 * text too, as llama.cpp does; Google's Jinja keeps it as it is).
 */
#include "chat.h"

#include "err.h"
#include "toolcall.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define IM_START "<|im_start|>"
#define IM_END "<|im_end|>"
#define SYS_OPEN IM_START "system\n"

enum chat_format { FORMAT_CHATML, FORMAT_GEMMA };

#define TURN_OPEN "<start_of_turn>"
#define TURN_CLOSE "<end_of_turn>\n"

struct chat_template {
    int format;                 /* enum chat_format */
    char *default_block;        /* the default system literal, unescaped, or NULL */
    char *default_system;       /* its message text, or NULL */
    bool default_in_loop;       /* emitted only before a first message */
};

static const char *find(const char *s, size_t len, const char *needle)
{
    return memmem(s, len, needle, strlen(needle));
}

/* Unescapes the Jinja string literal s[0..len) (without its quotes) into a
 * new NUL-terminated string. Python escapes \n \t \r \\ \' \" are decoded;
 * any other backslash stays as it is. */
static char *unescape(const char *s, size_t len)
{
    char *out = malloc(len + 1);
    size_t n = 0;
    if (out == NULL)
        return NULL;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (c == '\\' && i + 1 < len) {
            char e = s[i + 1];
            char r = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' :
                     (e == '\\' || e == '\'' || e == '"') ? e : 0;
            if (r != 0) {
                out[n++] = r;
                i++;
                continue;
            }
        }
        out[n++] = c;
    }
    out[n] = '\0';
    return out;
}

/* Looks through the string literals inside the template's {{ }} and {% %}
 * tags for the default system message. Returns 0 or KVD_ENOMEM. */
static int find_default_system(struct chat_template *t, const char *s, size_t len)
{
    const char *loop = find(s, len, "for message in messages");
    const char *endloop = find(s, len, "endfor");
    bool in_tag = false;
    for (size_t i = 0; i < len; i++) {
        if (!in_tag) {
            if (s[i] == '{' && i + 1 < len && (s[i + 1] == '{' || s[i + 1] == '%')) {
                in_tag = true;
                i++;
            }
            continue;
        }
        if ((s[i] == '}' || s[i] == '%') && i + 1 < len && s[i + 1] == '}') {
            in_tag = false;
            i++;
            continue;
        }
        if (s[i] != '\'' && s[i] != '"')
            continue;
        char q = s[i];
        size_t start = i + 1, end = start;
        while (end < len && s[end] != q)
            end += s[end] == '\\' ? 2 : 1;
        if (end > len)
            end = len;
        char *lit = unescape(s + start, end - start);
        if (lit == NULL)
            return KVD_ENOMEM;
        const char *close = strstr(lit, IM_END);
        if (strncmp(lit, SYS_OPEN, strlen(SYS_OPEN)) == 0 && close != NULL) {
            size_t body = (size_t)(close - lit) - strlen(SYS_OPEN);
            t->default_system = malloc(body + 1);
            if (t->default_system == NULL) {
                free(lit);
                return KVD_ENOMEM;
            }
            memcpy(t->default_system, lit + strlen(SYS_OPEN), body);
            t->default_system[body] = '\0';
            t->default_block = lit;
            t->default_in_loop = loop != NULL && endloop != NULL &&
                                 s + i > loop && s + i < endloop;
            return 0;
        }
        free(lit);
        i = end;                                    /* past the closing quote */
    }
    return 0;
}

chat_template_t *chat_template_new(const char *jinja, size_t len, char *err, size_t errlen)
{
    if (jinja == NULL || len == 0) {
        kvd_seterr(err, errlen, KVD_EINVAL, "unsupported chat template: the template is empty");
        return NULL;
    }
    if (find(jinja, len, TURN_OPEN) != NULL)
        return chat_template_gemma(err, errlen);
    if (find(jinja, len, IM_START) == NULL || find(jinja, len, IM_END) == NULL) {
        /* show the start of the template on one line */
        char snip[61];
        size_t n = len < sizeof snip - 1 ? len : sizeof snip - 1;
        for (size_t i = 0; i < n; i++) {
            unsigned char c = (unsigned char)jinja[i];
            snip[i] = c < 0x20 || c == 0x7F ? ' ' : (char)c;
        }
        snip[n] = '\0';
        kvd_seterr(err, errlen, KVD_EUNSUPPORTED,
                   "unsupported chat template: \"%s%s\" (ChatML and Gemma are supported)",
                   snip, len > n ? "..." : "");
        return NULL;
    }
    struct chat_template *t = calloc(1, sizeof *t);
    if (t == NULL || find_default_system(t, jinja, len) < 0) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        chat_template_destroy(&t);
        return NULL;
    }
    return t;
}

void chat_template_destroy(chat_template_t **tp)
{
    if (tp == NULL || *tp == NULL)
        return;
    free((*tp)->default_block);
    free((*tp)->default_system);
    free(*tp);
    *tp = NULL;
}

chat_template_t *chat_template_gemma(char *err, size_t errlen)
{
    struct chat_template *t = calloc(1, sizeof *t);
    if (t == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        return NULL;
    }
    t->format = FORMAT_GEMMA;
    return t;
}

chat_template_t *chat_template_for_model(const gguf_ctx_t *g, char *err, size_t errlen)
{
    struct gguf_str tmpl, arch;
    if (gguf_get_str(g, "tokenizer.chat_template", &tmpl) == 0)
        return chat_template_new(tmpl.ptr, (size_t)tmpl.len, err, errlen);
    if (gguf_get_str(g, "general.architecture", &arch) == 0 && gguf_str_eq(arch, "gemma3"))
        return chat_template_gemma(err, errlen);
    kvd_seterr(err, errlen, KVD_ENOTFOUND, "the model has no chat template (tokenizer.chat_template)");
    return NULL;
}

const char *chat_template_format(const chat_template_t *t)
{
    return t->format == FORMAT_GEMMA ? "gemma" : "chatml";
}

const char *chat_template_default_system(const chat_template_t *t)
{
    return t->default_system;
}

struct buf {
    char *p;                    /* bytes, NUL-terminated once done */
    size_t n;                   /* bytes used */
};

static void put(struct buf *b, const char *s)
{
    size_t k = strlen(s);
    memcpy(b->p + b->n, s, k);
    b->n += k;
}

/* Adds k to *total unless that overflows. */
static bool add_len(size_t *total, size_t k)
{
    if (k > SIZE_MAX - 1 - *total)
        return false;
    *total += k;
    return true;
}

static bool is_trim_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* Appends s without its leading and trailing ASCII whitespace. */
static void put_trimmed(struct buf *b, const char *s)
{
    size_t len = strlen(s);
    while (len > 0 && is_trim_space(*s))
        s++, len--;
    while (len > 0 && is_trim_space(s[len - 1]))
        len--;
    memcpy(b->p + b->n, s, len);
    b->n += len;
}

/* The Gemma rendering (see the top of this file). */
static int apply_gemma(const struct chat_msg *msgs, size_t n, bool add_generation_prompt, char **out,
                       size_t *out_len)
{
    for (size_t i = 0; i < n; i++)
        if (msgs[i].role == NULL || msgs[i].content == NULL)
            return KVD_EINVAL;
    const bool system = n > 0 && strcmp(msgs[0].role, "system") == 0;
    size_t total = 0;
    bool ok = true;
    for (size_t i = 0; ok && i < n; i++)
        ok = add_len(&total, strlen(TURN_OPEN) + strlen(msgs[i].role) + 1 + strlen(msgs[i].content) + 2 +
                                 strlen(TURN_CLOSE) + 8);
    if (!ok || !add_len(&total, strlen(TURN_OPEN "model\n")))
        return KVD_ENOMEM;
    struct buf b = { malloc(total + 1), 0 };
    if (b.p == NULL)
        return KVD_ENOMEM;
    for (size_t i = system ? 1 : 0; i < n; i++) {
        put(&b, TURN_OPEN);
        put(&b, strcmp(msgs[i].role, "assistant") == 0 ? "model" : msgs[i].role);
        put(&b, "\n");
        if (system && i == 1) {
            put_trimmed(&b, msgs[0].content);
            put(&b, "\n\n");
        }
        put_trimmed(&b, msgs[i].content);
        put(&b, TURN_CLOSE);
    }
    if (add_generation_prompt)
        put(&b, TURN_OPEN "model\n");
    b.p[b.n] = '\0';
    *out = b.p;
    *out_len = b.n;
    return 0;
}

/* The rendering of msgs as they are (no tools, no tool turns). */
static int render(const chat_template_t *t, const struct chat_msg *msgs, size_t n, bool add_generation_prompt,
                  char **out, size_t *out_len)
{
    if (t->format == FORMAT_GEMMA)
        return apply_gemma(msgs, n, add_generation_prompt, out, out_len);
    bool first_is_system = n > 0 && msgs[0].role != NULL && strcmp(msgs[0].role, "system") == 0;
    bool with_default = t->default_block != NULL && !first_is_system &&
                        (n > 0 || !t->default_in_loop);

    /* size it first */
    size_t total = 0;
    bool ok = true;
    if (with_default)
        ok = add_len(&total, strlen(t->default_block));
    for (size_t i = 0; ok && i < n; i++) {
        if (msgs[i].role == NULL || msgs[i].content == NULL)
            return KVD_EINVAL;
        ok = add_len(&total, strlen(IM_START) + 1 + strlen(IM_END) + 1) &&
             add_len(&total, strlen(msgs[i].role)) && add_len(&total, strlen(msgs[i].content));
    }
    if (ok && add_generation_prompt)
        ok = add_len(&total, strlen(IM_START "assistant\n"));
    if (!ok)
        return KVD_ENOMEM;

    struct buf b = {malloc(total + 1), 0};
    if (b.p == NULL)
        return KVD_ENOMEM;
    if (with_default)
        put(&b, t->default_block);
    for (size_t i = 0; i < n; i++) {
        put(&b, IM_START);
        put(&b, msgs[i].role);
        put(&b, "\n");
        put(&b, msgs[i].content);
        put(&b, IM_END "\n");
    }
    if (add_generation_prompt)
        put(&b, IM_START "assistant\n");
    b.p[b.n] = '\0';
    *out = b.p;
    *out_len = b.n;
    return 0;
}

/* ---- tools (kvd's default convention, toolcall.h) ------------------------------------------------ */

#define TOOLS_INTRO                                                                                   \
    "# Tools\n\n"                                                                                     \
    "You may call functions to answer the user. Their definitions, one JSON object a line, are "      \
    "between <tools> and </tools>:\n<tools>\n"
#define TOOLS_OUTRO                                                                                   \
    "</tools>\n\n"                                                                                    \
    "To call a function, answer with a JSON object that names it and gives its arguments, between "  \
    "<tool_call> and </tool_call>:\n"                                                                 \
    TOOLCALL_OPEN "\n{\"name\": \"<function name>\", \"arguments\": {<arguments as JSON>}}\n"        \
    TOOLCALL_CLOSE
#define RESPONSE_OPEN "<tool_response>\n"
#define RESPONSE_CLOSE "\n</tool_response>"

/* A new string: the concatenation of the n strings parts[0..n) (NULLs
 * skipped), or NULL on no memory. */
static char *concat(const char *const *parts, size_t n)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        if (parts[i] != NULL && !add_len(&total, strlen(parts[i])))
            return NULL;
    struct buf b = { malloc(total + 1), 0 };
    if (b.p == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++)
        if (parts[i] != NULL)
            put(&b, parts[i]);
    b.p[b.n] = '\0';
    return b.p;
}

/* The system text with the tools after base (NULL: none). */
static char *tools_system(const char *base, const char *const *tools, size_t n_tools)
{
    size_t total = 0;
    bool ok = add_len(&total, strlen(TOOLS_INTRO) + strlen(TOOLS_OUTRO) + 2) &&
              add_len(&total, base ? strlen(base) : 0);
    for (size_t i = 0; ok && i < n_tools; i++)
        ok = tools[i] != NULL && add_len(&total, strlen(tools[i]) + 1);
    struct buf b = { ok ? malloc(total + 1) : NULL, 0 };
    if (b.p == NULL)
        return NULL;
    if (base != NULL && base[0] != '\0') {
        put(&b, base);
        put(&b, "\n\n");
    }
    put(&b, TOOLS_INTRO);
    for (size_t i = 0; i < n_tools; i++) {
        put(&b, tools[i]);
        put(&b, "\n");
    }
    put(&b, TOOLS_OUTRO);
    b.p[b.n] = '\0';
    return b.p;
}

/* An assistant's text followed by its calls, a newline apart. */
static char *with_calls(const struct chat_msg *m, const struct chat_calls *c)
{
    size_t total = 0;
    bool ok = add_len(&total, strlen(m->content) + 1);
    for (size_t i = 0; ok && i < c->n; i++)
        ok = c->json[i] != NULL &&
             add_len(&total, strlen(TOOLCALL_OPEN) + strlen(c->json[i]) + strlen(TOOLCALL_CLOSE) + 3);
    struct buf b = { ok ? malloc(total + 1) : NULL, 0 };
    if (b.p == NULL)
        return NULL;
    put(&b, m->content);
    for (size_t i = 0; i < c->n; i++) {
        if (b.n > 0)
            put(&b, "\n");
        put(&b, TOOLCALL_OPEN "\n");
        put(&b, c->json[i]);
        put(&b, "\n" TOOLCALL_CLOSE);
    }
    b.p[b.n] = '\0';
    return b.p;
}

int chat_apply_tools(const chat_template_t *t, const struct chat_msg *msgs, const struct chat_calls *calls,
                     size_t n, const char *const *tools, size_t n_tools, bool add_generation_prompt, char **out,
                     size_t *out_len)
{
    if (t == NULL || out == NULL || out_len == NULL || (msgs == NULL && n > 0) || (tools == NULL && n_tools > 0))
        return KVD_EINVAL;
    *out = NULL;
    *out_len = 0;
    bool plain = n_tools == 0;
    for (size_t i = 0; i < n; i++) {
        if (msgs[i].role == NULL || msgs[i].content == NULL || (calls && calls[i].json == NULL && calls[i].n))
            return KVD_EINVAL;
        plain &= (calls == NULL || calls[i].n == 0) && strcmp(msgs[i].role, "tool") != 0;
    }
    if (plain)
        return render(t, msgs, n, add_generation_prompt, out, out_len);

    /* the messages rewritten in the convention, then rendered as they are */
    const bool first_is_system = n > 0 && strcmp(msgs[0].role, "system") == 0;
    const bool add_system = n_tools > 0 && !first_is_system;
    const size_t n2 = n + add_system;
    struct chat_msg *m2 = calloc(n2 ? n2 : 1, sizeof(*m2));
    char **owned = calloc(n2 ? n2 : 1, sizeof(*owned));
    int rc = m2 == NULL || owned == NULL ? KVD_ENOMEM : 0;
    for (size_t i = 0; rc == 0 && i < n2; i++) {
        const struct chat_msg *m = i < (size_t)add_system ? NULL : &msgs[i - add_system];
        const struct chat_calls *c = m != NULL && calls != NULL ? &calls[i - add_system] : NULL;
        if (m == NULL || (i == 0 && n_tools > 0)) {
            /* the system message, with the tools */
            const char *base = m ? m->content : t->format == FORMAT_CHATML ? t->default_system : NULL;
            owned[i] = tools_system(base, tools, n_tools);
            m2[i] = (struct chat_msg){ .role = "system", .content = owned[i] };
        } else if (strcmp(m->role, "tool") == 0) {
            const char *parts[] = { RESPONSE_OPEN, m->content, RESPONSE_CLOSE };
            owned[i] = concat(parts, 3);
            m2[i] = (struct chat_msg){ .role = t->format == FORMAT_GEMMA ? "user" : "tool", .content = owned[i] };
        } else if (c != NULL && c->n > 0) {
            owned[i] = with_calls(m, c);
            m2[i] = (struct chat_msg){ .role = m->role, .content = owned[i] };
        } else {
            m2[i] = (struct chat_msg){ .role = m->role, .content = m->content };
            continue;
        }
        if (owned[i] == NULL)
            rc = KVD_ENOMEM;
    }
    if (rc == 0)
        rc = render(t, m2, n2, add_generation_prompt, out, out_len);
    for (size_t i = 0; owned != NULL && i < n2; i++)
        free(owned[i]);
    free(owned);
    free(m2);
    return rc;
}

int chat_apply(const chat_template_t *t, const struct chat_msg *msgs, size_t n, bool add_generation_prompt,
               char **out, size_t *out_len)
{
    return chat_apply_tools(t, msgs, NULL, n, NULL, 0, add_generation_prompt, out, out_len);
}
