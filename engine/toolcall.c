/*
 * toolcall.c - the tool-call grammar (see toolcall.h).
 *
 * Two rules around the functions' parameter schemas (jschema_add):
 *
 *   answer := call ("\n" call)*        the repeat only when parallel, counted
 *   call   := "<tool_call>\n{\"name\": \"" ( NAME_i "\", \"arguments\": " PARAMS_i )|...
 *             "}\n</tool_call>"
 *
 * The names' alternatives share their common prefixes once the rule is made
 * deterministic, so a name that is a prefix of another is no problem.
 */
#include "toolcall.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "jschema.h"

#define CALL_HEAD TOOLCALL_OPEN "\n{\"name\": \""
#define CALL_ARGS "\", \"arguments\": "
#define CALL_TAIL "}\n" TOOLCALL_CLOSE

bool toolcall_name_ok(const char *name, size_t len)
{
    if (name == NULL || len == 0 || len > TOOLCALL_MAX_NAME)
        return false;
    for (size_t i = 0; i < len; i++) {
        const char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return false;
    }
    return true;
}

/* Adds function definition def (JSON text) as an alternative after state
 * `from` of the call rule, ending at state `to`; `*name_out` gets a copy of
 * its name (the caller frees). 0, or a negative KVD_E* with err. */
static int add_function(gbuild_t *b, const char *def, int32_t from, int32_t to, char **name_out, size_t i,
                        char *err, size_t errlen)
{
    json_error_t je;
    json_t *d = json_loads(def, JSON_REJECT_DUPLICATES, &je);
    int rc = 0;
    if (!json_is_object(d)) {
        rc = kvd_seterr(err, errlen, KVD_EINVAL, "tools[%zu] is not a JSON object", i);
        goto out;
    }
    json_t *name = json_object_get(d, "name");
    if (!json_is_string(name) || !toolcall_name_ok(json_string_value(name), json_string_length(name))) {
        rc = kvd_seterr(err, errlen, KVD_EINVAL, "tools[%zu]: a function's name must be 1 to %d of "
                        "[A-Za-z0-9_-]", i, TOOLCALL_MAX_NAME);
        goto out;
    }
    json_t *params = json_object_get(d, "parameters");
    const char *type = json_string_value(json_object_get(params, "type"));
    if (params != NULL && !json_is_null(params) && (!json_is_object(params) || type == NULL ||
                                                    strcmp(type, "object") != 0)) {
        rc = kvd_seterr(err, errlen, KVD_EINVAL, "tools[%zu] (%s): 'parameters' must be an object schema "
                        "({\"type\": \"object\", ...})", i, json_string_value(name));
        goto out;
    }
    static const char no_params[] = "{\"type\":\"object\",\"properties\":{}}";
    char *text = params != NULL && !json_is_null(params) ? json_dumps(params, JSON_COMPACT) : NULL;
    if (params != NULL && !json_is_null(params) && text == NULL) {
        rc = kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        goto out;
    }
    char serr[200];
    const int32_t rule = text ? jschema_add(b, text, strlen(text), NULL, serr, sizeof serr)
                              : jschema_add(b, no_params, strlen(no_params), NULL, serr, sizeof serr);
    if (text != NULL) {
        /* json_dumps' memory goes back to the allocator jansson was given */
        json_free_t free_fn;
        json_get_alloc_funcs(NULL, &free_fn);
        free_fn(text);
    }
    if (rule < 0) {
        rc = kvd_seterr(err, errlen, rule, "tools[%zu] (%s): parameters: %s", i, json_string_value(name), serr);
        goto out;
    }
    int32_t s = grammar_build_lit(b, from, json_string_value(name), json_string_length(name));
    s = grammar_build_lit(b, s, CALL_ARGS, strlen(CALL_ARGS));
    const int32_t after = grammar_build_state(b, s);
    grammar_build_call(b, s, rule, after, GRAMMAR_OP_NONE, 0);
    grammar_build_eps(b, grammar_build_lit(b, after, CALL_TAIL, strlen(CALL_TAIL)), to);
    if ((*name_out = strdup(json_string_value(name))) == NULL)
        rc = kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
out:
    json_decref(d);
    return rc;
}

grammar_t *toolcall_compile(const char *const *tools, size_t n_tools, const char *only, bool parallel,
                            char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (tools == NULL || n_tools == 0 || n_tools > TOOLCALL_MAX_TOOLS) {
        kvd_seterr(err, errlen, KVD_ERANGE, "a tool call needs 1 to %d functions, got %zu", TOOLCALL_MAX_TOOLS,
                   n_tools);
        return NULL;
    }
    gbuild_t *b = grammar_build_new();
    char **names = calloc(n_tools, sizeof(*names));
    grammar_t *g = NULL;
    if (b == NULL || names == NULL) {
        kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
        goto out;
    }
    const int32_t answer = grammar_build_rule(b), call = grammar_build_rule(b);
    const int32_t head = grammar_build_lit(b, grammar_build_start(b, call), CALL_HEAD, strlen(CALL_HEAD));
    const int32_t end = grammar_build_state(b, head);
    grammar_build_final(b, end);
    bool found = only == NULL;
    for (size_t i = 0; i < n_tools; i++) {
        if (tools[i] == NULL || strlen(tools[i]) > TOOLCALL_MAX_DEF_BYTES) {
            kvd_seterr(err, errlen, KVD_ERANGE, "tools[%zu] is missing or over %u bytes", i,
                       TOOLCALL_MAX_DEF_BYTES);
            goto out;
        }
        /* a function another choice names is still checked, not added */
        char *name = NULL;
        gbuild_t *alone = NULL;
        bool chosen = true;
        if (only != NULL) {
            json_t *d = json_loads(tools[i], 0, NULL);
            const char *nm = json_string_value(json_object_get(d, "name"));
            chosen = nm != NULL && strcmp(nm, only) == 0;
            json_decref(d);
            if (!chosen && (alone = grammar_build_new()) == NULL) {
                kvd_seterr(err, errlen, KVD_ENOMEM, "out of memory");
                goto out;
            }
        }
        gbuild_t *into = chosen ? b : alone;
        int32_t from = chosen ? head : grammar_build_start(into, grammar_build_rule(into));
        int32_t to = chosen ? end : grammar_build_state(into, from);
        const int rc = add_function(into, tools[i], from, to, &name, i, err, errlen);
        grammar_build_destroy(&alone);
        if (rc != 0)
            goto out;
        names[i] = name;
        found |= chosen;
        for (size_t k = 0; k < i; k++)
            if (strcmp(names[k], name) == 0) {
                kvd_seterr(err, errlen, KVD_EINVAL, "tools[%zu]: the name '%s' is used twice", i, name);
                goto out;
            }
    }
    if (!found) {
        kvd_seterr(err, errlen, KVD_EINVAL, "no function is named '%.64s'", only);
        goto out;
    }
    const int32_t a0 = grammar_build_start(b, answer);
    const int32_t a1 = grammar_build_state(b, a0);
    grammar_build_call(b, a0, call, a1, GRAMMAR_OP_INC, parallel ? TOOLCALL_MAX_CALLS : 1);
    grammar_build_final(b, a1);
    if (parallel)
        grammar_build_call(b, grammar_build_lit(b, a1, "\n", 1), call, a1, GRAMMAR_OP_INC, TOOLCALL_MAX_CALLS);
    char gerr[200];
    if ((g = grammar_build_finish(&b, answer, gerr, sizeof gerr)) == NULL)
        kvd_seterr(err, errlen, KVD_ERANGE, "the tool calls' grammar: %s", gerr);
out:
    for (size_t i = 0; names != NULL && i < n_tools; i++)
        free(names[i]);
    free(names);
    grammar_build_destroy(&b);
    return g;
}
