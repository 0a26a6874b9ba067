/*
 * jschema.h - JSON Schema to grammar: what structured output constrains
 * generation with (OpenAI's response_format json_schema and json_object).
 *
 * A schema, given as JSON text, compiles to a grammar_t (grammar.h) whose
 * matches are JSON documents that validate against it. The subset:
 *
 *   type            object, array, string, number, integer, boolean, null, or
 *                   an array of them; without type, the keywords present say
 *                   which (properties: object, items: array, ...), none: any
 *   minimum, maximum, exclusiveMinimum, exclusiveMaximum
 *                   on integers any value; on numbers whole values (0, 1, 100),
 *                   and a bounded number is written without an exponent
 *   properties, required, additionalProperties (false, true or a schema)
 *   items, prefixItems, minItems, maxItems
 *   minLength, maxLength, pattern (ECMA regexes without lookaround,
 *                   backreferences or word boundaries), format (date, time,
 *                   date-time, uuid, email, ipv4, uri); a pattern or format
 *                   with length bounds is met exactly (no path is started that
 *                   cannot satisfy both)
 *   enum, const     any JSON values, written compactly as jansson writes them
 *   anyOf, oneOf    as alternatives (oneOf's "exactly one" is not enforced)
 *   allOf           with a single schema
 *   $ref            local JSON pointers ("#", "#/$defs/X", "#/definitions/X",
 *                   any "#/..."), recursion allowed (GRAMMAR_MAX_DEPTH deep)
 *   $defs, definitions, and annotations (title, description, default,
 *                   examples, $schema, $id, $comment, readOnly, writeOnly,
 *                   deprecated, discriminator), which constrain nothing
 *
 * Anything else is refused with a reason naming the construct and where it is
 * ("unsupported JSON Schema keyword 'patternProperties' at /properties/x"), as
 * is a schema whose grammar would pass GRAMMAR_MAX_STATES (an object with
 * about a thousand optional properties: each place in the order has its own
 * states) or that admits no document.
 *
 * What is generated, within what the schema allows: properties in the
 * schema's order, each optional one present or skipped, then (where
 * additionalProperties allows) other names, none equal to a declared one;
 * strings in one canonical spelling per character (no needless escapes);
 * integers of at most 15 digits (jansson's range), numbers with at most 15
 * fraction digits and 2 exponent digits; whitespace bounded so that
 * generation cannot loop on it (struct jschema_params).
 */
#ifndef KVD_JSCHEMA_H
#define KVD_JSCHEMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "grammar.h"

struct jschema_params {
    bool ws_compact;            /* no whitespace at all between tokens of JSON */
    uint32_t ws_max_indent;     /* else: after { [ , : and before } ], nothing, one space,
                                   or a newline and up to this many spaces (default 16) */
    bool strict;                /* an absent additionalProperties means false (OpenAI's
                                   strict mode, and what a client means; default true) */
};

struct jschema_params jschema_default_params(void);

/* Compiles the JSON Schema text[0..len) into a grammar of the JSON documents
 * that validate against it. p may be NULL (the defaults). Returns NULL with a
 * one-line reason in err when the text is not JSON, the schema is invalid,
 * uses a construct outside the subset, or admits no document. */
grammar_t *jschema_compile(const char *text, size_t len, const struct jschema_params *p, char *err,
                           size_t errlen);

/* The grammar of response_format json_object: any JSON object. */
grammar_t *jschema_compile_object(const struct jschema_params *p, char *err, size_t errlen);

/* Adds the schema text[0..len) to builder b as a rule (with the rules it
 * needs), for a grammar that embeds JSON (a tool call's arguments after a
 * fixed prefix). Returns the rule id, or a negative KVD_E* code with a reason
 * in err (b is then unusable). */
int32_t jschema_add(gbuild_t *b, const char *text, size_t len, const struct jschema_params *p,
                    char *err, size_t errlen);

#endif
