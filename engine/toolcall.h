/*
 * toolcall.h - tool calls: how a model without a tools section in its chat
 * template is shown functions and answers with calls, and the grammar that
 * holds an answer to calls (OpenAI's tool_choice "required" or a named
 * function).
 *
 * The convention (kvd's default, after the Hermes/Qwen style): the function
 * definitions, one compact JSON object a line, sit inside <tools></tools> in
 * the system message (chat.c renders it); a call is
 *
 *   <tool_call>
 *   {"name": "NAME", "arguments": {...}}
 *   </tool_call>
 *
 * and several calls follow each other, a newline apart. A function
 * definition is OpenAI's function object as JSON text: {"name", "description",
 * "parameters", "strict"}; name is 1 to 64 of [A-Za-z0-9_-], parameters a
 * JSON Schema of engine/jschema.h's subset (absent: an object with no
 * properties).
 */
#ifndef KVD_TOOLCALL_H
#define KVD_TOOLCALL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "grammar.h"

#define TOOLCALL_OPEN "<tool_call>"
#define TOOLCALL_CLOSE "</tool_call>"
#define TOOLCALL_MAX_TOOLS 64           /* function definitions in one request */
#define TOOLCALL_MAX_DEF_BYTES (64u << 10)  /* bytes of one definition's JSON text */
#define TOOLCALL_MAX_CALLS 16           /* calls in one answer (parallel_tool_calls) */
#define TOOLCALL_MAX_NAME 64            /* bytes of a function's name */

/* True when name[0..len) is a valid function name (1 to 64 of [A-Za-z0-9_-]). */
bool toolcall_name_ok(const char *name, size_t len);

/* The grammar of an answer made of tool calls in the convention above: one
 * call (parallel false) or one to TOOLCALL_MAX_CALLS (true), each naming one
 * of tools[0..n_tools) (JSON text of function definitions), or only the one
 * called `only` when it is not NULL, with arguments that validate against
 * that function's parameters. Returns NULL with a one-line reason in err when
 * a definition is not JSON or invalid, a name repeats, `only` is none of
 * them, a schema is outside the subset, or the grammar would pass
 * GRAMMAR_MAX_STATES. */
grammar_t *toolcall_compile(const char *const *tools, size_t n_tools, const char *only, bool parallel,
                            char *err, size_t errlen);

#endif
