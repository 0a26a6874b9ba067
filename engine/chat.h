/*
 * chat.h - the chat template: turns a list of messages into the prompt text
 * an instruct model was trained on.
 *
 * Models ship their template as Jinja (tokenizer.chat_template). kvd runs no
 * Jinja: it recognizes the template's format and renders that format itself,
 * byte for byte what the Jinja renders. Supported: ChatML
 * ("<|im_start|>role\ncontent<|im_end|>\n" per message), including a default
 * system message that the template inserts when the conversation does not
 * start with one (SmolLM2, Qwen); and Gemma ("<start_of_turn>user\n...
 * <end_of_turn>\n", the system text opening the first user turn; chat.c).
 * Any other template is refused at load.
 *
 * Tools: neither format has a tools section, so both render kvd's default
 * convention (engine/toolcall.h): the function definitions inside
 * <tools></tools> at the end of the system message (the template's default
 * system message, or none, before them when the conversation has no system
 * message), an assistant's calls as <tool_call> blocks after its text, and a
 * tool's result wrapped in <tool_response></tool_response> as a "tool" turn
 * (ChatML) or a user turn (Gemma).
 */
#ifndef KVD_CHAT_H
#define KVD_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "gguf.h"

/* One message; both strings NUL-terminated and borrowed for the call. */
struct chat_msg {
    const char *role;           /* "system", "user", "assistant", "tool" (a tool's result) */
    const char *content;        /* the message text */
};

/* An assistant message's tool calls, each the JSON text {"name": ...,
 * "arguments": {...}}; borrowed for the call. */
struct chat_calls {
    const char *const *json;    /* n of them */
    size_t n;
};

typedef struct chat_template chat_template_t;

/* Recognizes the Jinja template jinja[0..len). Returns NULL with a one-line
 * reason in err ("unsupported chat template: ...") when its format is not
 * supported. The template copies what it keeps. */
chat_template_t *chat_template_new(const char *jinja, size_t len, char *err, size_t errlen);

/* The Gemma format, without a Jinja text to recognize. */
chat_template_t *chat_template_gemma(char *err, size_t errlen);

/* The template of a model file: its tokenizer.chat_template, else (a gemma3
 * file without one) the Gemma format; NULL with a reason when it has none or
 * an unsupported one (KVD_ENOTFOUND's "the model has no chat template"). */
chat_template_t *chat_template_for_model(const gguf_ctx_t *g, char *err, size_t errlen);

/* Frees the template; accepts NULL and sets *t to NULL. */
void chat_template_destroy(chat_template_t **t);

/* Renders msgs[0..n) and, with add_generation_prompt, the header that opens
 * the assistant's reply. On success returns 0 and sets *out to a malloc'd,
 * NUL-terminated string the caller frees, of *out_len bytes. Returns
 * KVD_EINVAL for a NULL role or content, KVD_ENOMEM. */
int chat_apply(const chat_template_t *t, const struct chat_msg *msgs, size_t n,
               bool add_generation_prompt, char **out, size_t *out_len);

/* chat_apply with tools: calls (NULL, or one per message) are the
 * assistant messages' tool calls; tools[0..n_tools) are function
 * definitions, each the JSON text of OpenAI's function object ({"name",
 * "description", "parameters"}), shown to the model in the system message
 * (none: as chat_apply). Same returns. */
int chat_apply_tools(const chat_template_t *t, const struct chat_msg *msgs, const struct chat_calls *calls,
                     size_t n, const char *const *tools, size_t n_tools, bool add_generation_prompt, char **out,
                     size_t *out_len);

/* The format's name ("chatml", "gemma"). */
const char *chat_template_format(const chat_template_t *t);

/* The default system message the template inserts, or NULL when it has none.
 * Lives as long as t. */
const char *chat_template_default_system(const chat_template_t *t);

#endif
