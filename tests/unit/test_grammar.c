/*
 * test_grammar.c - byte grammars (grammar), JSON Schema compiled to them
 * (jschema), and the vocabulary mask.
 *
 * Without a model: schemas accepted and refused (the reason names the
 * construct and where it is), and documents fed byte by byte, valid and not.
 * With the default model's tokenizer (SmolLM2, 49,152 tokens): seeded random
 * walks that draw each token among those the mask allows until the end of
 * generation, whose text must parse with jansson and validate against the
 * schema (a validator of the subset, written here from the JSON Schema
 * specification); the mask compared with feeding every token's bytes to the
 * state (exact, both ways); and the mask applied to a sampler's logits.
 */
#include "check.h"
#include "err.h"
#include "gguf.h"
#include "grammar.h"
#include "jschema.h"
#include "sampler.h"
#include "tok.h"

#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- a validator of the subset ------------------------------------------------- */

static const json_t *resolve(const json_t *root, const char *ref)
{
    if (ref[0] != '#')
        return NULL;
    const json_t *t = root;
    const char *p = ref + 1;
    while (*p && t) {
        if (*p++ != '/')
            return NULL;
        char tok[256];
        size_t k = 0;
        while (*p && *p != '/' && k + 1 < sizeof tok) {
            if (p[0] == '~' && p[1] == '1')
                tok[k++] = '/', p += 2;
            else if (p[0] == '~' && p[1] == '0')
                tok[k++] = '~', p += 2;
            else
                tok[k++] = *p++;
        }
        tok[k] = '\0';
        t = json_is_object(t) ? json_object_get(t, tok) : json_is_array(t) ? json_array_get(t, (size_t)atol(tok)) : NULL;
    }
    return t;
}

static size_t cp_len(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

static bool all_of(const char *s, size_t n, const char *set)
{
    for (size_t i = 0; i < n; i++)
        if (!strchr(set, s[i]) || s[i] == '\0')
            return false;
    return true;
}

static bool digits(const char *s, size_t n) { return all_of(s, n, "0123456789"); }

static bool is_date(const char *s, size_t n)
{
    if (n != 10 || s[4] != '-' || s[7] != '-' || !digits(s, 4) || !digits(s + 5, 2) || !digits(s + 8, 2))
        return false;
    int m = atoi(s + 5), d = atoi(s + 8);
    return m >= 1 && m <= 12 && d >= 1 && d <= 31;
}

static bool is_time(const char *s, size_t n)
{
    if (n < 9 || s[2] != ':' || s[5] != ':' || !digits(s, 2) || !digits(s + 3, 2) || !digits(s + 6, 2))
        return false;
    if (atoi(s) > 23 || atoi(s + 3) > 59 || atoi(s + 6) > 59)
        return false;
    size_t i = 8;
    if (s[i] == '.') {
        size_t j = ++i;
        while (i < n && s[i] >= '0' && s[i] <= '9')
            i++;
        if (i == j || i - j > 6)
            return false;
    }
    if (i < n && s[i] == 'Z')
        return i + 1 == n;
    return n - i == 6 && (s[i] == '+' || s[i] == '-') && s[i + 3] == ':' && digits(s + i + 1, 2) &&
           digits(s + i + 4, 2) && atoi(s + i + 1) <= 23 && atoi(s + i + 4) <= 59;
}

static bool check_format(const char *f, const char *s, size_t n)
{
    if (!strcmp(f, "date"))
        return is_date(s, n);
    if (!strcmp(f, "time"))
        return is_time(s, n);
    if (!strcmp(f, "date-time"))
        return n > 11 && s[10] == 'T' && is_date(s, 10) && is_time(s + 11, n - 11);
    if (!strcmp(f, "uuid")) {
        if (n != 36)
            return false;
        for (size_t i = 0; i < 36; i++)
            if ((i == 8 || i == 13 || i == 18 || i == 23) ? s[i] != '-' : !strchr("0123456789abcdef", s[i]))
                return false;
        return true;
    }
    if (!strcmp(f, "email")) {
        const char *at = memchr(s, '@', n);
        if (at == NULL || at == s || memchr(at + 1, '@', n - (size_t)(at + 1 - s)))
            return false;
        const char *dom = at + 1;
        size_t dn = n - (size_t)(dom - s);
        return dn >= 3 && memchr(dom, '.', dn) && dom[0] != '.' && dom[dn - 1] != '.' &&
               all_of(s, n, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_+-.@");
    }
    return false;
}

/* The test patterns, checked by hand: ^[A-Z]{3}-[0-9]{2,4}$ and ^[0-9]{5}$. */
static bool check_pattern(const char *re, const char *s, size_t n)
{
    if (!strcmp(re, "^[A-Z]{3}-[0-9]{2,4}$"))
        return n >= 6 && n <= 8 && all_of(s, 3, "ABCDEFGHIJKLMNOPQRSTUVWXYZ") && s[3] == '-' &&
               digits(s + 4, n - 4);
    if (!strcmp(re, "^[0-9]{5}$"))
        return n == 5 && digits(s, 5);
    if (!strcmp(re, "ab+c")) {
        for (size_t i = 0; i + 2 < n + 0 && i < n; i++)
            if (s[i] == 'a') {
                size_t j = i + 1;
                while (j < n && s[j] == 'b')
                    j++;
                if (j > i + 1 && j < n && s[j] == 'c')
                    return true;
            }
        return false;
    }
    fprintf(stderr, "no checker for pattern %s\n", re);
    return false;
}

static bool valid(const json_t *root, const json_t *s, const json_t *v, int depth);

static bool type_ok(const char *t, const json_t *v)
{
    if (!strcmp(t, "null"))
        return json_is_null(v);
    if (!strcmp(t, "boolean"))
        return json_is_boolean(v);
    if (!strcmp(t, "integer"))
        return json_is_integer(v) || (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)));
    if (!strcmp(t, "number"))
        return json_is_number(v);
    if (!strcmp(t, "string"))
        return json_is_string(v);
    if (!strcmp(t, "array"))
        return json_is_array(v);
    if (!strcmp(t, "object"))
        return json_is_object(v);
    return false;
}

static bool valid(const json_t *root, const json_t *s, const json_t *v, int depth)
{
    if (depth > 200)
        return false;
    if (json_is_true(s))
        return true;
    if (json_is_false(s) || !json_is_object(s))
        return false;
    const json_t *k;
    if ((k = json_object_get(s, "$ref")) && !valid(root, resolve(root, json_string_value(k)), v, depth + 1))
        return false;
    if ((k = json_object_get(s, "allOf")))
        for (size_t i = 0; i < json_array_size(k); i++)
            if (!valid(root, json_array_get(k, i), v, depth + 1))
                return false;
    const char *alt = json_object_get(s, "anyOf") ? "anyOf" : json_object_get(s, "oneOf") ? "oneOf" : NULL;
    if (alt) {
        bool any = false;
        k = json_object_get(s, alt);
        for (size_t i = 0; i < json_array_size(k) && !any; i++)
            any = valid(root, json_array_get(k, i), v, depth + 1);
        if (!any)
            return false;
    }
    if ((k = json_object_get(s, "type"))) {
        bool any = false;
        if (json_is_string(k))
            any = type_ok(json_string_value(k), v);
        for (size_t i = 0; json_is_array(k) && i < json_array_size(k) && !any; i++)
            any = type_ok(json_string_value(json_array_get(k, i)), v);
        if (!any)
            return false;
    }
    if ((k = json_object_get(s, "const")) && !json_equal((json_t *)k, (json_t *)v))
        return false;
    if ((k = json_object_get(s, "enum"))) {
        bool any = false;
        for (size_t i = 0; i < json_array_size(k) && !any; i++)
            any = json_equal(json_array_get(k, i), (json_t *)v);
        if (!any)
            return false;
    }
    if (json_is_number(v)) {
        double x = json_number_value(v);
        if ((k = json_object_get(s, "minimum")) && x < json_number_value(k))
            return false;
        if ((k = json_object_get(s, "maximum")) && x > json_number_value(k))
            return false;
        if ((k = json_object_get(s, "exclusiveMinimum")) && x <= json_number_value(k))
            return false;
        if ((k = json_object_get(s, "exclusiveMaximum")) && x >= json_number_value(k))
            return false;
    }
    if (json_is_string(v)) {
        size_t n = json_string_length(v), len = cp_len(json_string_value(v), n);
        if ((k = json_object_get(s, "minLength")) && len < (size_t)json_integer_value(k))
            return false;
        if ((k = json_object_get(s, "maxLength")) && len > (size_t)json_integer_value(k))
            return false;
        if ((k = json_object_get(s, "format")) && !check_format(json_string_value(k), json_string_value(v), n))
            return false;
        if ((k = json_object_get(s, "pattern")) && !check_pattern(json_string_value(k), json_string_value(v), n))
            return false;
    }
    if (json_is_array(v)) {
        size_t n = json_array_size(v), np = 0;
        if ((k = json_object_get(s, "minItems")) && n < (size_t)json_integer_value(k))
            return false;
        if ((k = json_object_get(s, "maxItems")) && n > (size_t)json_integer_value(k))
            return false;
        if ((k = json_object_get(s, "prefixItems"))) {
            np = json_array_size(k);
            for (size_t i = 0; i < n && i < np; i++)
                if (!valid(root, json_array_get(k, i), json_array_get(v, i), depth + 1))
                    return false;
        }
        if ((k = json_object_get(s, "items")))
            for (size_t i = np; i < n; i++)
                if (!valid(root, k, json_array_get(v, i), depth + 1))
                    return false;
    }
    if (json_is_object(v)) {
        const json_t *props = json_object_get(s, "properties"), *addl = json_object_get(s, "additionalProperties");
        const char *key;
        json_t *val;
        if ((k = json_object_get(s, "required")))
            for (size_t i = 0; i < json_array_size(k); i++)
                if (!json_object_get(v, json_string_value(json_array_get(k, i))))
                    return false;
        json_object_foreach((json_t *)v, key, val) {
            const json_t *ps = props ? json_object_get(props, key) : NULL;
            if (ps ? !valid(root, ps, val, depth + 1) : (addl && !valid(root, addl, val, depth + 1)))
                return false;
        }
    }
    return true;
}

/* ---- helpers -------------------------------------------------------------------- */

static grammar_t *compile_ok(const char *schema)
{
    char err[512] = "";
    grammar_t *g = jschema_compile(schema, strlen(schema), NULL, err, sizeof err);
    if (g == NULL)
        fprintf(stderr, "  schema refused: %s\n  %s\n", err, schema);
    return g;
}

/* Feeds text to a new state: 1 accepted and complete, 0 accepted but not
 * complete, -1 refused at some byte. */
static int feed(const grammar_t *g, const char *text, size_t n)
{
    gstate_t *s = grammar_state_new(g);
    REQUIRE(s != NULL);
    int r = -1;
    size_t i = 0;
    while (i < n && grammar_accept_byte(s, (uint8_t)text[i]))
        i++;
    if (i == n)
        r = grammar_is_complete(s) ? 1 : 0;
    grammar_state_destroy(&s);
    return r;
}

#define ACCEPT(g, text) do { int r_ = feed((g), (text), strlen(text)); check_count++; if (r_ != 1) { \
    check_failures++; fprintf(stderr, "%s:%d: not accepted (%d): %s\n", __FILE__, __LINE__, r_, (text)); } } while (0)
#define REJECT(g, text) do { int r_ = feed((g), (text), strlen(text)); check_count++; if (r_ == 1) { \
    check_failures++; fprintf(stderr, "%s:%d: accepted: %s\n", __FILE__, __LINE__, (text)); } } while (0)

/* ---- schemas refused ---------------------------------------------------------- */

static void test_refused(void)
{
    static const struct {
        const char *schema;
        const char *want;       /* in the reason */
    } cases[] = {
        { "{\"type\":\"object\",\"patternProperties\":{\"^x\":{}}}",
          "unsupported JSON Schema keyword 'patternProperties' at the top level" },
        { "{\"properties\":{\"x\":{\"type\":\"object\",\"patternProperties\":{}}}}",
          "unsupported JSON Schema keyword 'patternProperties' at /properties/x" },
        { "{\"type\":\"integer\",\"multipleOf\":2}", "keyword 'multipleOf' at the top level" },
        { "{\"type\":\"number\",\"minimum\":-2.5}", "'minimum' -2.5 on a number (whole-number bounds only)" },
        { "{\"type\":\"integer\",\"minimum\":10,\"maximum\":5}", "admits no JSON document" },
        { "{\"type\":\"integer\",\"exclusiveMinimum\":true}", "'exclusiveMinimum' must be a number" },
        { "{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"a~b/c\":{\"not\":{}}}}}",
          "keyword 'not' at /items/properties/a~0b~1c" },
        { "{\"anyOf\":[{\"type\":\"null\"},{\"type\":\"string\",\"maxLength\":3,\"contains\":1}]}",
          "keyword 'contains' at /anyOf/1" },
        { "{\"type\":\"string\",\"format\":\"hostname\"}", "unsupported JSON Schema format 'hostname'" },
        { "{\"type\":\"string\",\"pattern\":\"(?=a)b\"}", "lookaround" },
        { "{\"type\":\"string\",\"pattern\":\"\\\\bword\"}", "unsupported escape" },
        { "{\"type\":\"string\",\"pattern\":\"a{2000}\"}", "repetition bound" },
        { "{\"type\":\"string\",\"pattern\":\"(ab\"}", "unclosed '('" },
        { "{\"$ref\":\"http://example.com/s.json\"}", "only local ones" },
        { "{\"$ref\":\"#/$defs/missing\"}", "unresolvable '$ref' '#/$defs/missing'" },
        { "{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/b\"},\"b\":{\"$ref\":\"#/$defs/a\"}},\"$ref\":\"#/$defs/a\"}",
          "circular '$ref'" },
        { "{\"anyOf\":[{\"$ref\":\"#\"},{\"type\":\"null\"}]}", "refers to itself before any JSON text" },
        { "{\"type\":\"strin\"}", "unknown type 'strin'" },
        { "{\"type\":\"string\",\"minLength\":5,\"maxLength\":2}", "'minLength' 5 is above 'maxLength' 2" },
        { "{\"type\":\"array\",\"minItems\":3,\"maxItems\":1}", "'minItems' 3 is above 'maxItems' 1" },
        { "{\"type\":\"array\",\"items\":false,\"minItems\":1}", "needs more items" },
        { "{\"allOf\":[{\"type\":\"string\"},{\"maxLength\":3}]}", "'allOf' with more than one schema" },
        { "{\"$ref\":\"#/$defs/a\",\"type\":\"string\",\"$defs\":{\"a\":{}}}", "'type' beside '$ref'" },
        { "{\"type\":\"string\",\"anyOf\":[{}]}", "'type' beside 'anyOf'" },
        { "{\"type\":", "not JSON" },
        { "{\"type\":\"object\",\"properties\":{\"a\":false},\"required\":[\"a\"]}", "admits no JSON document" },
        { "{\"type\":\"array\",\"uniqueItems\":true}", "'uniqueItems'" },
        { "{\"type\":\"string\",\"format\":\"date\",\"maxLength\":5}", "admits no JSON document" },
        { "{\"type\":\"string\",\"pattern\":\"[^\\\\s\\\\S]\",\"maxLength\":5}", "matches no string" },
        { "{\"enum\":[1,2],\"type\":\"string\"}", "no value of 'enum' has the schema's type" },
        { "{\"type\":\"string\",\"maxLength\":-1}", "'maxLength' must be a non-negative integer" },
        { "{\"type\":\"object\",\"required\":[\"x\"],\"additionalProperties\":false}",
          "required property 'x' is not in 'properties'" },
        { "{\"properties\":{\"x\":{\"$ref\":\"#/properties/y\"},\"y\":3}}", "must be an object or a boolean at /properties/y" },
        { "{\"$defs\":{\"n\":{\"type\":\"object\",\"properties\":{\"next\":{\"$ref\":\"#/$defs/n\"}},"
          "\"required\":[\"next\"]}},\"$ref\":\"#/$defs/n\"}", "admits no JSON document" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char err[512] = "";
        grammar_t *g = jschema_compile(cases[i].schema, strlen(cases[i].schema), NULL, err, sizeof err);
        check_count++;
        if (g != NULL || strstr(err, cases[i].want) == NULL) {
            check_failures++;
            fprintf(stderr, "refusal %zu: %s\n  got %s \"%s\", want \"%s\"\n", i, cases[i].schema,
                    g ? "a grammar" : "", err, cases[i].want);
        }
        grammar_destroy(&g);
    }
    /* nesting deeper than the stack without recursion */
    char deep[4096] = "";
    for (int i = 0; i < 70; i++)
        strcat(deep, "{\"type\":\"array\",\"items\":");
    strcat(deep, "{\"type\":\"null\"}");
    for (int i = 0; i < 70; i++)
        strcat(deep, "}");
    char err[512] = "";
    grammar_t *g = jschema_compile(deep, strlen(deep), NULL, err, sizeof err);
    CHECK(g == NULL && strstr(err, "nested deeper than 64"));
    grammar_destroy(&g);
    /* a grammar past the size limit: many optional properties in order */
    {
        size_t cap = 1 << 17, n = 0;
        char *big = malloc(cap);
        REQUIRE(big != NULL);
        n += (size_t)snprintf(big + n, cap - n, "{\"type\":\"object\",\"properties\":{");
        for (int i = 0; i < 1500; i++)
            n += (size_t)snprintf(big + n, cap - n, "%s\"property_%04d\":{\"type\":\"null\"}", i ? "," : "", i);
        n += (size_t)snprintf(big + n, cap - n, "}}");
        g = jschema_compile(big, n, NULL, err, sizeof err);
        CHECK(g == NULL && strstr(err, "too large"));
        grammar_destroy(&g);
        free(big);
    }
    /* what is accepted: annotations, pydantic's shapes */
    static const char *const ok[] = {
        "{}",
        "true",
        "{\"title\":\"T\",\"description\":\"d\",\"$schema\":\"https://json-schema.org/draft/2020-12/schema\","
        "\"type\":\"object\",\"properties\":{\"a\":{\"title\":\"A\",\"default\":1,\"type\":\"integer\","
        "\"examples\":[1]}},\"required\":[]}",
        "{\"$defs\":{\"Color\":{\"enum\":[\"red\",\"green\"],\"title\":\"Color\",\"type\":\"string\"}},"
        "\"properties\":{\"c\":{\"$ref\":\"#/$defs/Color\"},\"d\":{\"anyOf\":[{\"$ref\":\"#/$defs/Color\"},"
        "{\"type\":\"null\"}],\"default\":null}},\"required\":[\"c\"],\"title\":\"M\",\"type\":\"object\"}",
        "{\"definitions\":{\"x\":{\"type\":\"integer\"}},\"type\":\"array\",\"items\":{\"allOf\":[{\"$ref\":\"#/definitions/x\"}]}}",
        "{\"type\":\"array\",\"items\":[{\"type\":\"string\"},{\"type\":\"number\"}]}",
        "{\"type\":\"string\",\"pattern\":\"^(\\\\d{3}|[a-z]+)\\\\.x?$\",\"maxLength\":9}",
        "{\"type\":\"string\",\"format\":\"date-time\"}",
        "{\"type\":\"array\",\"uniqueItems\":false}",
    };
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
        grammar_t *gg = compile_ok(ok[i]);
        CHECK(gg != NULL);
        grammar_destroy(&gg);
    }
}

/* ---- documents, byte by byte ----------------------------------------------------- */

static const char *S_PERSON =
    "{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":20},"
    "\"age\":{\"type\":\"integer\"},"
    "\"email\":{\"type\":\"string\",\"format\":\"email\",\"maxLength\":40},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",\"c\"]},\"maxItems\":3},"
    "\"address\":{\"type\":\"object\",\"properties\":{\"street\":{\"type\":\"string\"},"
    "\"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]{5}$\"}},\"required\":[\"street\"]}},"
    "\"required\":[\"name\",\"age\"]}";

static void test_documents(void)
{
    grammar_t *g = compile_ok(S_PERSON);
    REQUIRE(g != NULL);
    ACCEPT(g, "{\"name\":\"Al\",\"age\":30}");
    ACCEPT(g, "{\"name\": \"Al\", \"age\": -5, \"tags\": [\"a\", \"c\"]}");
    ACCEPT(g, "{\n  \"name\": \"x\",\n  \"age\": 0,\n  \"address\": {\n    \"street\": \"Main\",\n"
              "    \"zip\": \"12345\"\n  }\n}");
    ACCEPT(g, "{\"name\":\"\\u00e9\\n\\\"q\\\" caf\xc3\xa9 \xf0\x9f\x98\x80\",\"age\":123456789012345}");
    ACCEPT(g, "{\"name\":\"x\",\"age\":1,\"email\":\"a.b+c@ex-ample.co.uk\",\"tags\":[]}");
    ACCEPT(g, "{\"name\":\"12345678901234567890\",\"age\":1}");     /* 20 characters */
    ACCEPT(g, "{\"name\":\"\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"
              "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\",\"age\":1}");
    REJECT(g, "{\"name\":\"Al\"}");                                  /* age is required */
    REJECT(g, "{\"age\":30,\"name\":\"Al\"}");                       /* valid, but not in the schema's order */
    REJECT(g, "{\"name\":\"Al\",\"age\":30.5}");
    REJECT(g, "{\"name\":\"Al\",\"age\":30,\"x\":1}");               /* strict: no other properties */
    REJECT(g, "{\"name\":\"\",\"age\":1}");                          /* minLength 1 */
    REJECT(g, "{\"name\":\"123456789012345678901\",\"age\":1}");     /* 21 characters */
    REJECT(g, "{\"name\":\"x\",\"age\":1,\"tags\":[\"d\"]}");
    REJECT(g, "{\"name\":\"x\",\"age\":1,\"tags\":[\"a\",\"a\",\"a\",\"a\"]}");
    REJECT(g, "{\"name\":\"x\",\"age\":1,\"email\":\"nobody\"}");
    REJECT(g, "{\"name\":\"x\",\"age\":1,\"address\":{\"zip\":\"12345\"}}");
    REJECT(g, "{\"name\":\"x\",\"age\":1,\"address\":{\"street\":\"s\",\"zip\":\"1234\"}}");
    REJECT(g, "{\"name\":\"x\",\"age\":0123}");
    REJECT(g, "{\"name\":\"x\",\"age\":1234567890123456}");          /* 16 digits */
    REJECT(g, "{\"name\":\"a\tb\",\"age\":1}");                      /* a raw control character */
    REJECT(g, "{\"name\":\"\xc0\x80\",\"age\":1}");                  /* overlong */
    REJECT(g, "{\"name\":\"\xed\xa0\x80\",\"age\":1}");              /* a surrogate */
    REJECT(g, "{\"name\":\"\xf4\x90\x80\x80\",\"age\":1}");          /* above U+10FFFF */
    REJECT(g, "{\"name\":\"\\u0000\",\"age\":1}");
    REJECT(g, "{\"name\":\"\\ud800\",\"age\":1}");
    REJECT(g, "{\"name\":\"\\x\",\"age\":1}");
    REJECT(g, "{\"name\":\"x\",\"age\":1}  ");                       /* nothing after the document */
    REJECT(g, "{\"name\" :\"x\",\"age\":1}");                        /* no space before a colon */
    REJECT(g, "{\"name\":\"x\",\n\n\"age\":1}");                     /* one newline at a time */
    REJECT(g, "{\"name\":\"x\",\"age\":1,\n                  }");   /* no trailing comma */
    /* state operations: a refused byte leaves the state as it was; copies are independent */
    gstate_t *s = grammar_state_new(g), *t = grammar_state_new(g);
    REQUIRE(s && t);
    CHECK(grammar_accept_bytes(s, "{\"name\":\"a", 10));
    CHECK(!grammar_accept_byte(s, '\x01'));
    CHECK(!grammar_accept_bytes(s, "bc\",\"x", 6));
    CHECK_INT(grammar_state_copy(t, s), 0);
    CHECK(grammar_accept_bytes(t, "bc\",\"age\":7}", 12) && grammar_is_complete(t));
    CHECK(!grammar_is_complete(s));
    CHECK(grammar_accept_bytes(s, "\",\"age\":-1}", 11) && grammar_is_complete(s));
    grammar_state_reset(s);
    CHECK(!grammar_is_complete(s) && grammar_accept_byte(s, '{') && !grammar_accept_byte(s, '}'));
    grammar_state_destroy(&s);
    grammar_state_destroy(&t);
    grammar_destroy(&g);

    /* additional properties: names other than the declared ones */
    g = compile_ok("{\"type\":\"object\",\"properties\":{\"ab\":{\"type\":\"integer\"},\"a\\\"c\":{\"type\":\"null\"}},"
                   "\"additionalProperties\":{\"type\":\"boolean\"}}");
    REQUIRE(g != NULL);
    ACCEPT(g, "{}");
    ACCEPT(g, "{\"ab\":1,\"a\\\"c\":null,\"a\":true,\"abc\":false,\"b\":true}");
    ACCEPT(g, "{\"x\\n\\u00e9\":true}");
    ACCEPT(g, "{\"a\\\"\":true}");
    REJECT(g, "{\"ab\":true}");                 /* a declared name takes its own schema */
    REJECT(g, "{\"x\":true,\"ab\":1}");         /* declared ones first */
    REJECT(g, "{\"a\\u0062\":true}");           /* "ab" spelled otherwise */
    REJECT(g, "{\"a\\\"c\":true}");
    REJECT(g, "{\"x\":1}");
    grammar_destroy(&g);

    /* json_object mode, and whitespace choices */
    char err[256];
    g = jschema_compile_object(NULL, err, sizeof err);
    REQUIRE(g != NULL);
    ACCEPT(g, "{}");
    ACCEPT(g, "{\"a\": [1, 2.5e-3, \"x\", {\"b\": null}, [], true, false], \"\": {}}");
    REJECT(g, "[]");
    REJECT(g, "\"x\"");
    REJECT(g, "{\"a\":1,}");
    REJECT(g, "{\"a\":1e999}");
    grammar_destroy(&g);
    struct jschema_params p = jschema_default_params();
    p.ws_compact = true;
    const char *arr = "{\"type\":\"array\",\"items\":{\"type\":\"number\"}}";
    g = jschema_compile(arr, strlen(arr), &p, err, sizeof err);
    REQUIRE(g != NULL);
    ACCEPT(g, "[1,-0.5,3e+7,0E1]");
    REJECT(g, "[1, 2]");
    REJECT(g, "[01]");
    REJECT(g, "[1.]");
    REJECT(g, "[.5]");
    grammar_destroy(&g);

    /* arrays: bounds, prefixItems */
    g = compile_ok("{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"integer\"}],"
                   "\"items\":{\"type\":\"boolean\"},\"minItems\":1,\"maxItems\":4}");
    REQUIRE(g != NULL);
    ACCEPT(g, "[\"a\"]");
    ACCEPT(g, "[\"a\", 1, true, false]");
    REJECT(g, "[]");
    REJECT(g, "[1]");
    REJECT(g, "[\"a\", 1, true, false, true]");
    REJECT(g, "[\"a\", true]");
    grammar_destroy(&g);

    gstate_t *st;
    /* patterns and formats */
    g = compile_ok("{\"type\":\"object\",\"properties\":{\"p\":{\"type\":\"string\",\"pattern\":\"ab+c\"},"
                   "\"d\":{\"type\":\"string\",\"format\":\"date\"},\"u\":{\"type\":\"string\",\"format\":\"uuid\"},"
                   "\"q\":{\"type\":\"string\",\"pattern\":\"^[^a-z\\\"]{2,3}$\",\"minLength\":3}}}");
    REQUIRE(g != NULL);
    ACCEPT(g, "{\"p\":\"xxabbbcyy\"}");
    ACCEPT(g, "{\"p\":\"abc\",\"d\":\"2024-02-29\",\"u\":\"123e4567-e89b-12d3-a456-426614174000\"}");
    ACCEPT(g, "{\"q\":\"\\\\\xc3\xa9Z\"}");      /* a backslash, escaped */
    REJECT(g, "{\"q\":\"\\\"\xc3\xa9Z\"}");      /* a quote: not in the class */
    REJECT(g, "{\"p\":\"ac\"}");
    REJECT(g, "{\"d\":\"2024-13-01\"}");
    REJECT(g, "{\"u\":\"123e4567e89b12d3a456426614174000\"}");
    REJECT(g, "{\"q\":\"AB\"}");                /* minLength 3 */
    REJECT(g, "{\"q\":\"AbC\"}");
    grammar_destroy(&g);

    /* numbers between bounds */
    g = compile_ok("{\"type\":\"array\",\"prefixItems\":[{\"type\":\"integer\",\"minimum\":-5,\"maximum\":12},"
                   "{\"type\":\"integer\",\"exclusiveMinimum\":0},{\"type\":\"number\",\"minimum\":0,\"maximum\":1},"
                   "{\"type\":\"number\",\"exclusiveMinimum\":0,\"exclusiveMaximum\":1},{\"type\":\"number\",\"maximum\":-1},"
                   "{\"type\":\"integer\",\"minimum\":2.5,\"exclusiveMaximum\":1000}],\"items\":false}");
    REQUIRE(g != NULL);
    ACCEPT(g, "[-5]");
    ACCEPT(g, "[12, 1, 0, 0.5, -1, 3]");
    ACCEPT(g, "[0, 999, 1.000, 0.001, -1.5, 999]");
    ACCEPT(g, "[-4, 1000000, 0.25, 0.9999, -100.25, 10]");
    REJECT(g, "[-6]");
    REJECT(g, "[13]");
    REJECT(g, "[-0]");                  /* zero is written 0 */
    REJECT(g, "[1.5]");
    REJECT(g, "[0, 0]");
    REJECT(g, "[0, -1]");
    REJECT(g, "[0, 1, 1.01]");
    REJECT(g, "[0, 1, -0.1]");
    REJECT(g, "[0, 1, 1e0]");           /* no exponent with bounds */
    REJECT(g, "[0, 1, 1, 0]");
    REJECT(g, "[0, 1, 1, 0.0]");
    REJECT(g, "[0, 1, 1, 1.0]");
    REJECT(g, "[0, 1, 1, 0.5, 0]");
    REJECT(g, "[0, 1, 1, 0.5, -0.5]");
    REJECT(g, "[0, 1, 1, 0.5, -1, 2]");
    REJECT(g, "[0, 1, 1, 0.5, -1, 1000]");
    grammar_destroy(&g);

    /* a pattern with a length bound: no path that cannot meet both */
    g = compile_ok("{\"type\":\"array\",\"items\":{\"anyOf\":[{\"type\":\"string\",\"pattern\":\"^a+b$\",\"maxLength\":3},"
                   "{\"type\":\"string\",\"pattern\":\"^[0-9]{2,6}$\",\"minLength\":4},"
                   "{\"type\":\"string\",\"format\":\"uri\",\"maxLength\":12}]}}");
    REQUIRE(g != NULL);
    ACCEPT(g, "[\"ab\", \"aab\", \"1234\", \"123456\", \"a:b\", \"https://a.io\"]");
    REJECT(g, "[\"aaab\"]");
    REJECT(g, "[\"123\"]");
    REJECT(g, "[\"https://ab.io\"]");
    st = grammar_state_new(g);
    CHECK(grammar_accept_bytes(st, "[\"123", 5) && !grammar_accept_byte(st, '"'));
    grammar_state_destroy(&st);
    grammar_destroy(&g);
    g = compile_ok("{\"type\":\"string\",\"pattern\":\"^a+b$\",\"maxLength\":3}");
    REQUIRE(g != NULL);
    st = grammar_state_new(g);
    CHECK(grammar_accept_bytes(st, "\"aa", 3) && !grammar_accept_byte(st, 'a') && grammar_accept_byte(st, 'b'));
    grammar_state_destroy(&st);
    grammar_destroy(&g);

    /* recursion through $ref; scalars at the top */
    g = compile_ok("{\"$defs\":{\"t\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
                   "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/t\"}}},\"required\":[\"v\"]}},"
                   "\"$ref\":\"#/$defs/t\"}");
    REQUIRE(g != NULL);
    ACCEPT(g, "{\"v\":1,\"kids\":[{\"v\":2},{\"v\":3,\"kids\":[{\"v\":4,\"kids\":[]}]}]}");
    REJECT(g, "{\"v\":1,\"kids\":[{\"kids\":[]}]}");
    {   /* the stack holds 64 return points: recursion stops where it would have no
         * room to finish, and what is open can still be closed */
        int levels = 0;
        st = grammar_state_new(g);
        while (levels < 100 && grammar_accept_bytes(st, "{\"v\":0,\"kids\":[", 15))
            levels++;
        CHECK(levels > 10 && levels < 64);
        CHECK(!grammar_accept_byte(st, '{'));
        for (int i = 0; i < levels; i++)
            CHECK(grammar_accept_bytes(st, "]}", 2));
        CHECK(grammar_is_complete(st));
        grammar_state_destroy(&st);
    }
    grammar_destroy(&g);
    g = compile_ok("{\"type\":[\"integer\",\"null\"]}");
    REQUIRE(g != NULL);
    ACCEPT(g, "12");
    ACCEPT(g, "null");
    REJECT(g, "1.5");
    st = grammar_state_new(g);
    CHECK(grammar_accept_bytes(st, "12", 2) && grammar_is_complete(st) && grammar_accept_byte(st, '3'));
    grammar_state_destroy(&st);
    grammar_destroy(&g);
}

/* ---- with a real vocabulary ------------------------------------------------------ */

static uint64_t rng_state = 0x243F6A8885A308D3ull;

static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Tokens weighted for the walks: JSON's punctuation and digits often, plain
 * text seldom, so that strings end and documents stay small. */
static uint16_t *walk_weights(const tok_t *t, bool closing)
{
    size_t nv = tok_n_vocab(t);
    uint16_t *w = malloc(nv * sizeof *w);
    REQUIRE(w != NULL);
    for (size_t id = 0; id < nv; id++) {
        char buf[512];
        size_t n = 0;
        w[id] = 1;
        if (tok_decode_piece(t, (int32_t)id, buf, sizeof buf, &n) != 0)
            continue;
        for (size_t i = 0; i < n; i++)
            if (strchr("\"{}[],:0123456789@\\", buf[i]) && buf[i])
                w[id] = 30;
        /* a long walk closes what it opened: brackets and quotes, not commas */
        for (size_t i = 0; closing && i < n; i++)
            if (strchr("\"}]@.", buf[i]) && buf[i])
                w[id] = 3000;
        for (size_t i = 0; closing && i < n; i++)
            if (strchr("{[,", buf[i]) && buf[i])
                w[id] = 1;
    }
    return w;
}

struct walkstats {
    int walks, done, tokens, exact, checks_failed;
};

/* One walk: draws allowed tokens until the end of generation; the document
 * must parse and validate. Every `exact_every` steps the mask is compared with
 * brute force (0: never). */
static void walk(const grammar_t *g, const gtrie_t *trie, const tok_t *t, uint16_t *const wts[2],
                 const json_t *schema, bool object_only, int exact_every, struct walkstats *ws)
{
    uint32_t nv = grammar_trie_n_vocab(trie), words = (nv + 31) / 32;
    uint32_t *mask = malloc(words * 4), *brute = malloc(words * 4);
    int32_t *ids = malloc(nv * sizeof *ids);
    uint32_t *cum = malloc(nv * sizeof *cum);
    size_t cap = 1 << 16, len = 0;
    char *text = malloc(cap);
    gstate_t *s = grammar_state_new(g);
    REQUIRE(mask && brute && ids && cum && text && s);
    ws->walks++;
    bool ended = false;
    for (int step = 0; step < 3000 && !ended; step++) {
        const uint16_t *w = wts[step >= 300];
        uint32_t n_allowed = 0;
        CHECK_INT(grammar_mask(s, trie, mask, &n_allowed), 0);
        if (exact_every > 0 && step % exact_every == 0) {
            uint32_t nb = 0;
            CHECK_INT(grammar_mask_bruteforce(s, trie, brute, &nb), 0);
            ws->exact++;
            if (memcmp(mask, brute, words * 4) != 0) {
                ws->checks_failed++;
                check_failures++;
                for (uint32_t id = 0, shown = 0; id < nv && shown < 5; id++)
                    if (grammar_mask_has(mask, (int32_t)id) != grammar_mask_has(brute, (int32_t)id)) {
                        char piece[256];
                        size_t pn = 0;
                        tok_decode_piece(t, (int32_t)id, piece, sizeof piece - 1, &pn);
                        piece[pn] = '\0';
                        fprintf(stderr, "  mask %d brute %d: token %u '%s' after '%.*s'\n",
                                grammar_mask_has(mask, (int32_t)id), grammar_mask_has(brute, (int32_t)id),
                                id, piece, (int)len, text);
                        shown++;
                    }
            }
            check_count++;
        }
        if (n_allowed == 0) {
            check_failures++;
            check_count++;
            fprintf(stderr, "  dead end after '%.*s'\n", (int)len, text);
            break;
        }
        /* the end when allowed, mostly; else a weighted draw */
        int32_t pick = -1;
        uint32_t n = 0, total = 0;
        bool eog_ok = grammar_is_complete(s);
        for (uint32_t wi = 0; wi < words; wi++) {
            uint32_t m = mask[wi];
            while (m) {
                uint32_t id = wi * 32 + (uint32_t)__builtin_ctz(m);
                m &= m - 1;
                if (tok_is_eog(t, (int32_t)id))
                    continue;
                total += w[id];
                ids[n] = (int32_t)id;
                cum[n++] = total;
            }
        }
        if (eog_ok && (n == 0 || rnd() % 4 != 0)) {
            pick = tok_eos(t);
            if (!grammar_mask_has(mask, pick))
                pick = -1;
            for (uint32_t id = 0; pick < 0 && id < nv; id++)
                if (tok_is_eog(t, (int32_t)id) && grammar_mask_has(mask, (int32_t)id))
                    pick = (int32_t)id;
        }
        if (pick < 0) {
            REQUIRE(n > 0);
            uint32_t r = (uint32_t)(rnd() % total), lo = 0, hi = n - 1;
            while (lo < hi) {
                uint32_t mid = (lo + hi) / 2;
                if (cum[mid] > r)
                    hi = mid;
                else
                    lo = mid + 1;
            }
            pick = ids[lo];
        }
        if (tok_is_eog(t, pick)) {
            CHECK_INT(grammar_advance_token(s, trie, pick), 0);
            CHECK(grammar_is_ended(s));
            ended = true;
            break;
        }
        char piece[1024];
        size_t pn = 0;
        REQUIRE(tok_decode_piece(t, pick, piece, sizeof piece, &pn) == 0);
        int rc = grammar_advance_token(s, trie, pick);
        CHECK_INT(rc, 0);
        if (rc != 0)
            break;
        if (len + pn + 1 > cap) {
            cap *= 2;
            text = realloc(text, cap);
            REQUIRE(text);
        }
        memcpy(text + len, piece, pn);
        len += pn;
        ws->tokens++;
    }
    text[len] = '\0';
    if (!ended)
        fprintf(stderr, "  unfinished after %d tokens: ...%s\n", ws->tokens, len > 400 ? text + len - 400 : text);
    if (ended) {
        ws->done++;
        json_error_t je;
        json_t *v = json_loadb(text, len, JSON_DECODE_ANY, &je);
        check_count++;
        if (v == NULL) {
            check_failures++;
            fprintf(stderr, "  does not parse (%s): %s\n", je.text, text);
        } else if (object_only ? !json_is_object(v) : !valid(schema, schema, v, 0)) {
            check_failures++;
            fprintf(stderr, "  does not validate: %s\n", text);
        }
        json_decref(v);
        CHECK_INT(feed(g, text, len), 1);
    }
    grammar_state_destroy(&s);
    free(mask);
    free(brute);
    free(ids);
    free(cum);
    free(text);
}

static const char *const walk_schemas[] = {
    NULL,   /* S_PERSON */
    /* a recursive tree */
    "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"value\":{\"type\":\"number\"},"
    "\"children\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"},\"maxItems\":3}},"
    "\"required\":[\"value\",\"children\"]}},\"$ref\":\"#/$defs/node\"}",
    /* const, formats, a tuple, anyOf with null, enum of mixed values */
    "{\"type\":\"object\",\"properties\":{\"kind\":{\"const\":\"event\"},"
    "\"when\":{\"type\":\"string\",\"format\":\"date-time\"},\"id\":{\"type\":\"string\",\"format\":\"uuid\"},"
    "\"loc\":{\"type\":\"array\",\"prefixItems\":[{\"type\":\"number\",\"minimum\":-90,\"maximum\":90},{\"type\":\"number\"}],\"items\":false,"
    "\"minItems\":2},\"note\":{\"anyOf\":[{\"type\":\"string\",\"minLength\":3,\"maxLength\":10},{\"type\":\"null\"}]},"
    "\"level\":{\"enum\":[1,2.5,\"high\",null,true,{\"x\":[1]}]}},"
    "\"required\":[\"kind\",\"when\",\"id\",\"loc\",\"level\"],\"additionalProperties\":false}",
    /* a map: other properties with a schema */
    "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"boolean\"}},"
    "\"additionalProperties\":{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":1,\"maxItems\":4}}",
    /* objects with enums in an array, a pattern */
    "{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{"
    "\"sku\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{3}-[0-9]{2,4}$\",\"maxLength\":7},\"qty\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":100},"
    "\"status\":{\"enum\":[\"new\",\"shipped\",\"lost\"]},\"memo\":{\"type\":\"string\"}},"
    "\"required\":[\"sku\",\"qty\",\"status\"]},\"minItems\":1,\"maxItems\":5}",
    /* scalars at the top */
    "{\"type\":[\"string\",\"integer\",\"null\"],\"maxLength\":12}",
    /* oneOf of objects that share a prefix */
    "{\"oneOf\":[{\"type\":\"object\",\"properties\":{\"t\":{\"const\":\"a\"},\"x\":{\"type\":\"integer\"}},"
    "\"required\":[\"t\",\"x\"]},{\"type\":\"object\",\"properties\":{\"t\":{\"const\":\"b\"},"
    "\"y\":{\"type\":\"string\",\"maxLength\":5}},\"required\":[\"t\",\"y\"]}]}",
};

/* The mask against brute force at chosen states: strings with and without a
 * maximum length, at every count up to it, inside a character and an escape. */
static void exact_at(const gtrie_t *trie, const char *schema, const char *const *prefixes, size_t n)
{
    grammar_t *g = compile_ok(schema);
    REQUIRE(g != NULL);
    uint32_t nv = grammar_trie_n_vocab(trie), words = (nv + 31) / 32;
    uint32_t *a = malloc(words * 4), *b = malloc(words * 4);
    gstate_t *s = grammar_state_new(g);
    REQUIRE(a && b && s);
    for (size_t i = 0; i < n; i++) {
        grammar_state_reset(s);
        REQUIRE(grammar_accept_bytes(s, prefixes[i], strlen(prefixes[i])));
        uint32_t na = 0, nb = 0;
        CHECK_INT(grammar_mask(s, trie, a, &na), 0);
        CHECK_INT(grammar_mask_bruteforce(s, trie, b, &nb), 0);
        CHECK_INT(na, nb);
        check_count++;
        if (memcmp(a, b, words * 4) != 0) {
            check_failures++;
            fprintf(stderr, "  mask differs from brute force after '%s'\n", prefixes[i]);
        }
    }
    grammar_state_destroy(&s);
    free(a);
    free(b);
    grammar_destroy(&g);
}

/* The mask against brute force at chosen states: strings with and without a
 * maximum length, at every count up to it, inside a character and an escape;
 * several paths at once, strings among them. */
static void test_exact(const gtrie_t *trie)
{
    static const char *const strings[] = {
        "{\"s\":\"", "{\"s\":\"a", "{\"s\":\"\xc3\xa9\xc3\xa9\xc3\xa9", "{\"s\":\"abcdefghijklmnopqrst",
        "{\"s\":\"abcdefghijklmnopqrstuvwxyz0123456789a", "{\"s\":\"abcdefghijklmnopqrstuvwxyz0123456789ab",
        "{\"s\":\"abcdefghijklmnopqrstuvwxyz0123456789abc", "{\"s\":\"abcdefghijklmnopqrstuvwxyz0123456789abcd",
        "{\"s\":\"abcdefghijklmnopqrstuvwxyz01234567\xe2\x82", "{\"s\":\"\xf0\x9f", "{\"s\":\"ab\\",
        "{\"s\":\"ab\\u00", "{\"t\":\"", "{\"t\":\"ab", "{\"t\":\"abc", "{\"u\":\"", "{\"u\":\"\xe2",
        "{\"u\":\"\xe2\x82", "{\"u\":\"x\\", "{\"u\":\"x\"", "{", "{\"", "{\"s\":\"x\",",
    };
    exact_at(trie, "{\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\",\"maxLength\":40},"
             "\"t\":{\"type\":\"string\",\"minLength\":3},\"u\":{\"type\":\"string\"}}}",
             strings, sizeof strings / sizeof *strings);
    static const char *const alts[] = {
        "", "\"", "\"20", "\"x", "\"abcd", "\"abcde", "\"2024-01-0", "1", "-", "[", "[1, ", "[1, \"a",
    };
    exact_at(trie, "{\"anyOf\":[{\"type\":\"string\",\"format\":\"date\"},{\"type\":\"string\",\"maxLength\":5},"
             "{\"type\":\"string\",\"pattern\":\"^x\"},{\"type\":\"string\"},{\"type\":\"number\"},"
             "{\"type\":\"integer\",\"minimum\":-3},{\"type\":\"array\",\"items\":{\"type\":[\"number\",\"string\"]}},"
             "{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":2}}]}",
             alts, sizeof alts / sizeof *alts);
}

static void test_model(const char *path, int walks, int exact_walks, int exact_every)
{
    if (access(path, R_OK) != 0) {
        fprintf(stderr, "no model at %s: skipping the vocabulary checks\n", path);
        return;
    }
    fprintf(stderr, "%s\n", path);
    char err[256] = "";
    gguf_ctx_t *gg = gguf_open(path, err, sizeof err);
    REQUIRE(gg != NULL);
    tok_t *t = tok_new_from_gguf(gg, err, sizeof err);
    REQUIRE(t != NULL);
    gtrie_t *trie = grammar_trie_new(t, err, sizeof err);
    REQUIRE(trie != NULL);
    CHECK_INT(grammar_trie_n_vocab(trie), tok_n_vocab(t));
    test_exact(trie);
    uint16_t *w[2] = { walk_weights(t, false), walk_weights(t, true) };
    struct walkstats total = { 0 };
    for (size_t i = 0; i <= sizeof walk_schemas / sizeof *walk_schemas; i++) {
        bool object_only = i == sizeof walk_schemas / sizeof *walk_schemas;
        const char *text = i == 0 ? S_PERSON : object_only ? "{}" : walk_schemas[i];
        grammar_t *g = object_only ? jschema_compile_object(NULL, err, sizeof err) : compile_ok(text);
        REQUIRE(g != NULL);
        json_t *schema = json_loads(text, 0, NULL);
        REQUIRE(schema != NULL);
        struct walkstats ws = { 0 };
        for (int k = 0; k < walks; k++)
            walk(g, trie, t, w, schema, object_only, k < exact_walks ? exact_every : 0, &ws);
        fprintf(stderr, "schema %zu: %d walks, %d ended, %d tokens, %d exact-mask checks (%d failed), %u states\n",
                i, ws.walks, ws.done, ws.tokens, ws.exact, ws.checks_failed, grammar_n_states(g));
        CHECK(ws.done >= ws.walks * 9 / 10);
        total.walks += ws.walks;
        total.done += ws.done;
        total.exact += ws.exact;
        json_decref(schema);
        grammar_destroy(&g);
    }
    fprintf(stderr, "vocabulary: %d walks, %d ended and validated, %d masks checked exactly\n",
            total.walks, total.done, total.exact);

    /* the mask on a sampler's logits: every draw is an allowed token */
    grammar_t *g = compile_ok(S_PERSON);
    REQUIRE(g != NULL);
    gstate_t *s = grammar_state_new(g);
    uint32_t nv = grammar_trie_n_vocab(trie);
    uint32_t *mask = malloc(((nv + 31) / 32) * 4);
    float *logits = malloc(nv * sizeof *logits);
    struct sampler_params sp = sampler_default_params();
    sp.seed = 7;
    sampler_t *smp = sampler_new(&sp, nv, err, sizeof err);
    REQUIRE(s && mask && logits && smp);
    int32_t hist[64];
    size_t nh = 0;
    for (int step = 0; step < 40 && !grammar_is_ended(s); step++) {
        for (uint32_t i = 0; i < nv; i++)
            logits[i] = (float)(rnd() % 1000) / 100.0f;
        CHECK_INT(grammar_mask(s, trie, mask, NULL), 0);
        grammar_mask_apply(mask, logits, nv);
        int32_t id = sampler_sample(smp, logits, hist, nh);
        CHECK(grammar_mask_has(mask, id));
        CHECK_INT(grammar_advance_token(s, trie, id), 0);
        if (nh < 64)
            hist[nh++] = id;
    }
    /* tokens the mask refuses are refused by the state too */
    CHECK_INT(grammar_advance_token(s, trie, -1), KVD_ERANGE);
    CHECK_INT(grammar_advance_token(s, trie, (int32_t)nv), KVD_ERANGE);
    grammar_state_reset(s);
    CHECK_INT(grammar_advance_token(s, trie, tok_eos(t)), KVD_EINVAL);
    CHECK_INT(grammar_advance_token(s, trie, tok_find(t, "Hello")), tok_find(t, "Hello") < 0 ? KVD_ERANGE : KVD_EINVAL);
    CHECK_INT(grammar_advance_token(s, trie, tok_find(t, "{")), 0);
    sampler_destroy(&smp);
    free(mask);
    free(logits);
    grammar_state_destroy(&s);
    grammar_destroy(&g);
    free(w[0]);
    free(w[1]);
    grammar_trie_destroy(&trie);
    tok_destroy(&t);
    gguf_close(&gg);
}

int main(void)
{
    test_refused();
    test_documents();
    /* the default model (GPT-2 byte-level BPE), and Gemma 3 (SentencePiece with
     * byte tokens) where it sits beside it */
    const char *path = getenv("KVD_TEST_MODEL") ? getenv("KVD_TEST_MODEL") : KVD_TEST_MODEL;
    int walks = getenv("KVD_GRAMMAR_WALKS") ? atoi(getenv("KVD_GRAMMAR_WALKS")) : 40;
    test_model(path, walks, 4, 2);
    char gemma[1024];
    const char *slash = strrchr(path, '/');
    snprintf(gemma, sizeof gemma, "%.*s/gemma-3-270m-q4_k_m.gguf", slash ? (int)(slash - path) : 1,
             slash ? path : ".");
    if (getenv("KVD_GEMMA3_MODEL"))
        snprintf(gemma, sizeof gemma, "%s", getenv("KVD_GEMMA3_MODEL"));
    test_model(gemma, walks / 5, 2, 6);
    return CHECK_DONE();
}
