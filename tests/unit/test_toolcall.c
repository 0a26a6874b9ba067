/*
 * test_toolcall.c - the tool-call grammar (engine/toolcall.h): which answers
 * it takes (calls of the tools, with arguments that follow their schemas, one
 * or several) and which definitions it refuses, with the reason.
 */
#include "check.h"

#include <string.h>

#include "err.h"
#include "toolcall.h"

static const char *const tools[] = {
    "{\"name\":\"get_weather\",\"description\":\"The weather.\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":20},\"days\":{\"type\":\"integer\","
    "\"minimum\":1,\"maximum\":7}},\"required\":[\"city\"]}}",
    "{\"name\":\"get\",\"parameters\":{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"integer\"}},"
    "\"required\":[\"id\"]}}",
    "{\"name\":\"ping\"}",
};

#define CALL(name, args) "<tool_call>\n{\"name\": \"" name "\", \"arguments\": " args "}\n</tool_call>"

/* True when g matches text whole. */
static bool matches(const grammar_t *g, const char *text)
{
    gstate_t *s = grammar_state_new(g);
    REQUIRE(s != NULL);
    const bool ok = grammar_accept_bytes(s, text, strlen(text)) && grammar_is_complete(s);
    grammar_state_destroy(&s);
    return ok;
}

static grammar_t *compile(const char *only, bool parallel)
{
    char err[256] = "";
    grammar_t *g = toolcall_compile(tools, 3, only, parallel, err, sizeof err);
    if (g == NULL)
        fprintf(stderr, "  toolcall_compile: %s\n", err);
    REQUIRE(g != NULL);
    return g;
}

static void test_answers(void)
{
    grammar_t *g = compile(NULL, false);
    CHECK(matches(g, CALL("get_weather", "{\"city\": \"Paris\"}")));
    CHECK(matches(g, CALL("get_weather", "{\"city\": \"Oslo\", \"days\": 3}")));
    CHECK(matches(g, CALL("get", "{\"id\": 42}")));        /* a name that is a prefix of another */
    CHECK(matches(g, CALL("ping", "{}")));                  /* no parameters: an empty object */
    CHECK(!matches(g, CALL("ping", "{\"x\": 1}")));
    CHECK(!matches(g, CALL("get_weather", "{\"days\": 3}")));           /* city is required */
    CHECK(!matches(g, CALL("get_weather", "{\"city\": \"Paris\", \"days\": 9}")));    /* over 7 */
    CHECK(!matches(g, CALL("get_weather", "{\"city\": \"A city whose name is far too long\"}")));
    CHECK(!matches(g, CALL("get_time", "{}")));             /* no such function */
    CHECK(!matches(g, "Sure! " CALL("ping", "{}")));        /* nothing before the call */
    CHECK(!matches(g, "<tool_call>\n{\"name\": \"ping\"}\n</tool_call>"));   /* arguments missing */
    CHECK(!matches(g, CALL("ping", "{}") "\n" CALL("ping", "{}")));  /* one call only */
    CHECK(!matches(g, "<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}"));     /* not closed */
    grammar_destroy(&g);

    /* parallel: one or more, up to TOOLCALL_MAX_CALLS */
    g = compile(NULL, true);
    CHECK(matches(g, CALL("ping", "{}")));
    CHECK(matches(g, CALL("ping", "{}") "\n" CALL("get", "{\"id\": 1}")));
    char many[4096] = "";
    for (int i = 0; i < TOOLCALL_MAX_CALLS; i++)
        strcat(strcat(many, i ? "\n" : ""), CALL("ping", "{}"));
    CHECK(matches(g, many));
    strcat(many, "\n" CALL("ping", "{}"));
    CHECK(!matches(g, many));
    CHECK(!matches(g, ""));
    grammar_destroy(&g);

    /* a named function: that one only */
    g = compile("get", true);
    CHECK(matches(g, CALL("get", "{\"id\": 7}")));
    CHECK(!matches(g, CALL("ping", "{}")));
    CHECK(!matches(g, CALL("get_weather", "{\"city\": \"Rome\"}")));
    grammar_destroy(&g);
}

/* toolcall_compile refuses defs with a reason that holds `want`. */
static void refused(const char *const *defs, size_t n, const char *only, const char *want)
{
    char err[256] = "";
    grammar_t *g = toolcall_compile(defs, n, only, false, err, sizeof err);
    CHECK(g == NULL);
    if (strstr(err, want) == NULL) {
        fprintf(stderr, "  want \"%s\" in \"%s\"\n", want, err);
        CHECK(strstr(err, want) != NULL);
    }
    grammar_destroy(&g);
}

static void test_refused(void)
{
    const char *bad_name[] = { "{\"name\":\"has space\"}" };
    refused(bad_name, 1, NULL, "name");
    const char *twice[] = { "{\"name\":\"f\"}", "{\"name\":\"f\"}" };
    refused(twice, 2, NULL, "twice");
    const char *not_json[] = { "{\"name\":" };
    refused(not_json, 1, NULL, "tools[0]");
    const char *not_object[] = { "{\"name\":\"f\",\"parameters\":{\"type\":\"string\"}}" };
    refused(not_object, 1, NULL, "object schema");
    const char *subset[] = { "{\"name\":\"f\",\"parameters\":{\"type\":\"object\",\"patternProperties\":{}}}" };
    refused(subset, 1, NULL, "patternProperties");
    refused(subset, 1, "f", "patternProperties");
    refused(tools, 3, "nope", "no function is named 'nope'");
    refused(tools, 0, NULL, "1 to 64");
    const char *many[TOOLCALL_MAX_TOOLS + 1];
    for (int i = 0; i <= TOOLCALL_MAX_TOOLS; i++)
        many[i] = "{\"name\":\"f\"}";
    refused(many, TOOLCALL_MAX_TOOLS + 1, NULL, "1 to 64");
    /* a function another choice names is still checked */
    const char *other_bad[] = { "{\"name\":\"f\"}", "{\"name\":\"g\",\"parameters\":{\"type\":\"object\","
                                "\"properties\":{\"x\":{\"not\":{}}}}}" };
    refused(other_bad, 2, "f", "not");
    CHECK(toolcall_name_ok("a-b_C9", 6));
    CHECK(!toolcall_name_ok("", 0));
    CHECK(!toolcall_name_ok("a.b", 3));
}

int main(void)
{
    test_answers();
    test_refused();
    return CHECK_DONE();
}
