/*
 * grammar.h - constrained decoding: a grammar over bytes, a matcher that
 * follows one sequence through it, and the per-step mask over a vocabulary.
 *
 * A grammar is a set of rules, each a deterministic automaton over bytes
 * whose edges may also call another rule (a recursive transition network, a
 * pushdown automaton): matching keeps a stack of return points, at most
 * GRAMMAR_MAX_DEPTH deep. Rules are written as nondeterministic automata with
 * empty edges (grammar_build_*) and made deterministic rule by rule when the
 * grammar is finished; where two calls can start on the same byte (JSON
 * Schema's anyOf), the matcher follows every path at once, at most
 * GRAMMAR_MAX_PATHS of them. An edge may count: each rule invocation has a
 * counter (string characters, array items) that an edge increments up to a
 * maximum or requires to have reached a minimum, so lengths cost no states.
 *
 * Finishing a grammar refuses left recursion and schemas nested deeper than
 * the stack without recursion, and removes every state from which the rule
 * cannot end (a rule with no finite match, an edge into such a state). Each
 * state knows how many return points a shortest way to its rule's end needs,
 * and the matcher takes an edge or a call only where the stack has room for
 * that: recursion stops at GRAMMAR_MAX_DEPTH without cutting a path off. So
 * every byte the matcher accepts leaves a way to complete, except where more
 * than GRAMMAR_MAX_PATHS ambiguous paths had to be dropped.
 *
 * The mask: a gtrie_t holds a vocabulary's tokens as a trie of their bytes,
 * built once per tokenizer; grammar_mask walks it depth first from a state,
 * one copy of the state per byte, pruning a subtree at the first byte the
 * grammar rejects. Inside a JSON string, where nearly every token is allowed,
 * subtrees known to hold only plain string characters are taken whole. A
 * sampler sets the logits of disallowed tokens to -INFINITY
 * (grammar_mask_apply) before its chain runs, then advances the state by the
 * token it drew (grammar_advance_token).
 *
 * Threads: a grammar_t and a gtrie_t are immutable once built and may be used
 * by any number of threads; a gstate_t belongs to one sequence (one thread at
 * a time). engine/jschema.h compiles a JSON Schema into a grammar_t.
 *
 * In a server:
 *   per model     trie = grammar_trie_new(tok, err, n)
 *   per request   g = jschema_compile(schema, len, NULL, err, n)   NULL: a 400 with err
 *                 (or jschema_compile_object for json_object); shared by its n choices
 *   per sequence  s = grammar_state_new(g)
 *   per step      grammar_mask(s, trie, mask, &n_allowed)          n_allowed 0: stop it
 *                 grammar_mask_apply(mask, logits, n_vocab), then the sampler
 *                 grammar_advance_token(s, trie, id)
 *   at the end    grammar_state_destroy(&s), then grammar_destroy(&g)
 * A sequence ends when the sampler draws an end-of-generation token, which
 * the mask offers only once the document is whole (and alone once nothing
 * can follow it).
 */
#ifndef KVD_GRAMMAR_H
#define KVD_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tok.h"

#define GRAMMAR_MAX_DEPTH 64    /* return points on a stack: deeper recursion is refused */
#define GRAMMAR_MAX_PATHS 64    /* paths followed at once: more ambiguous ones are dropped */
#define GRAMMAR_MAX_STATES (1u << 16) /* states in one grammar (and in its builder): compiling
                                       * one costs at most about 0.3 s (kvd compiles a request's) */

typedef struct grammar grammar_t;   /* a finished grammar: immutable */
typedef struct gstate gstate_t;     /* one sequence's position in a grammar */
typedef struct gtrie gtrie_t;       /* a vocabulary's token bytes as a trie: immutable */
typedef struct gbuild gbuild_t;     /* a grammar under construction */

/* ---- building ------------------------------------------------------------------ */

/* What an edge does to the counter of its rule invocation (which starts at 0). */
enum grammar_op {
    GRAMMAR_OP_NONE = 0,    /* nothing */
    GRAMMAR_OP_INC = 1,     /* counter += 1; the edge is refused when that would exceed arg */
    GRAMMAR_OP_MIN = 2,     /* the edge is refused while counter < arg */
};

/* A new, empty builder; NULL on no memory. */
gbuild_t *grammar_build_new(void);

/* Frees a builder; accepts NULL and sets *b to NULL. */
void grammar_build_destroy(gbuild_t **b);

/* A new rule with its start state; returns the rule's id (>= 0). Rules may be
 * called before their body is written, which is how recursion is built. All
 * grammar_build_* functions return -1 (and the builder remembers KVD_ENOMEM or
 * KVD_ERANGE for grammar_build_finish) when they fail; they accept -1 inputs
 * and do nothing, so a sequence of calls needs one check at the end. */
int32_t grammar_build_rule(gbuild_t *b);

/* The start state of rule r. */
int32_t grammar_build_start(const gbuild_t *b, int32_t rule);

/* A new state in the rule that state `like` belongs to. */
int32_t grammar_build_state(gbuild_t *b, int32_t like);

/* Edges from state `from` to state `to` (both of one rule): on any byte in
 * [lo, hi]; on no byte; and calling rule `callee` then continuing at `to`.
 * op/arg act on the counter of from's rule invocation. Return 0 or -1. */
int grammar_build_bytes(gbuild_t *b, int32_t from, uint8_t lo, uint8_t hi, int32_t to,
                        enum grammar_op op, uint32_t arg);
int grammar_build_eps(gbuild_t *b, int32_t from, int32_t to);
int grammar_build_call(gbuild_t *b, int32_t from, int32_t callee, int32_t to, enum grammar_op op,
                       uint32_t arg);

/* Marks a state where its rule may end (return to the caller). */
int grammar_build_final(gbuild_t *b, int32_t state);

/* Helpers that build a piece after state `from` and return the state where it
 * ends (a new state of from's rule), or -1. */

/* The bytes s[0..n) in order. */
int32_t grammar_build_lit(gbuild_t *b, int32_t from, const void *s, size_t n);

/* Optional JSON whitespace, bounded so that generation cannot loop on it:
 * nothing, one space, or a newline followed by at most max_indent spaces. */
int32_t grammar_build_ws(gbuild_t *b, int32_t from, uint32_t max_indent);

/* A JSON string's body and closing quote (the opening quote is the caller's):
 * valid UTF-8 with the control characters escaped, escapes \" \\ \/ \b \f \n
 * \r \t and \uXXXX (no surrogates, no \u0000, which jansson and other parsers
 * refuse alone), between min_len and max_len characters (UINT32_MAX: no
 * maximum; an escape is one character). Uses the counter of from's rule
 * invocation when a length is bounded, so the rule must not count anything
 * else meanwhile. Its states are marked for grammar_mask's fast path. */
int32_t grammar_build_string(gbuild_t *b, int32_t from, uint32_t min_len, uint32_t max_len);

/* A JSON string's body and closing quote (as grammar_build_string, no length
 * bounds) whose text is none of keys[0..n_keys), each given as its JSON
 * encoding without quotes (keys[i][0..lens[i])): an object's other property
 * names. A backslash is allowed only where it cannot spell an excluded key. */
int32_t grammar_build_string_except(gbuild_t *b, int32_t from, const char *const *keys,
                                    const size_t *lens, size_t n_keys);

/* The matches of sub's root rule (a finished grammar without calls) whose
 * edges with GRAMMAR_OP_INC, counted, number between min and max (UINT32_MAX:
 * no maximum): sub laid out once per count, so that every path can still meet
 * both sub and the bounds. A pattern with a length bound is built so. Returns
 * the end state; -2 when that takes more than max_states states (nothing is
 * added then), -1 on other failures. sub is only read. */
int32_t grammar_build_counted(gbuild_t *b, int32_t from, const grammar_t *sub, uint32_t min,
                              uint32_t max, uint32_t max_states);

/* Finishes the builder (always consumed: *b becomes NULL) into a grammar whose
 * matches are those of rule `root`. Each rule is made deterministic; left
 * recursion, calls nested deeper than GRAMMAR_MAX_DEPTH without recursion, two
 * counter operations on one byte of one state, more than GRAMMAR_MAX_STATES
 * states and a root with no finite match are refused. Returns NULL with a
 * one-line reason in err on failure. */
grammar_t *grammar_build_finish(gbuild_t **b, int32_t root, char *err, size_t errlen);

/* Frees a grammar; accepts NULL and sets *g to NULL. Every state of it must
 * be destroyed first. */
void grammar_destroy(grammar_t **g);

/* Deterministic states of g (its size, for diagnostics). */
uint32_t grammar_n_states(const grammar_t *g);

/* ---- matching ------------------------------------------------------------------ */

/* A state at the start of g; g must outlive it. NULL on no memory. */
gstate_t *grammar_state_new(const grammar_t *g);

/* Frees a state; accepts NULL and sets *s to NULL. */
void grammar_state_destroy(gstate_t **s);

/* Makes dst the same position as src (both of one grammar): a copy of a few
 * hundred bytes in the common case. Returns 0, KVD_EINVAL (another grammar)
 * or KVD_ENOMEM (dst unchanged). */
int grammar_state_copy(gstate_t *dst, const gstate_t *src);

/* Puts s back at the start of its grammar. */
void grammar_state_reset(gstate_t *s);

/* Feeds one byte: true and advanced when the grammar allows it here, false
 * and s unchanged otherwise (also after an end of generation was accepted). */
bool grammar_accept_byte(gstate_t *s, uint8_t byte);

/* Feeds bytes p[0..n) all or nothing: true and advanced, or false with s
 * unchanged. */
bool grammar_accept_bytes(gstate_t *s, const void *p, size_t n);

/* True when the bytes so far are a whole match of the grammar (more bytes may
 * still be allowed: a number can go on). */
bool grammar_is_complete(const gstate_t *s);

/* True once an end-of-generation token was accepted (grammar_advance_token). */
bool grammar_is_ended(const gstate_t *s);

/* ---- the vocabulary mask ------------------------------------------------------- */

/* The trie of t's tokens: every NORMAL, BYTE and USER_DEFINED token with a
 * non-empty piece (tok_decode_piece); control, unknown and unused tokens are
 * never allowed, except the end-of-generation ones (tok_is_eog), which are
 * allowed exactly when the state is complete. The trie copies what it keeps.
 * Returns NULL with a reason in err on failure. */
gtrie_t *grammar_trie_new(const tok_t *t, char *err, size_t errlen);

/* Frees a trie; accepts NULL and sets *t to NULL. */
void grammar_trie_destroy(gtrie_t **t);

/* Tokens in the trie's vocabulary (tok_n_vocab); a mask has
 * (n_vocab + 31) / 32 words. */
uint32_t grammar_trie_n_vocab(const gtrie_t *t);

/* Number of trie nodes (for diagnostics). */
uint32_t grammar_trie_n_nodes(const gtrie_t *t);

/* Fills bitmask[0..(n_vocab + 31) / 32) with the tokens allowed after s: bit
 * (id % 32) of word id / 32 is set when the token's bytes can be fed to s
 * (grammar_accept_bytes would succeed), or when it ends generation and s is
 * complete. s is not changed. *n_allowed (may be NULL) gets the number of bits
 * set; 0 means the sequence cannot go on (only possible where the limits in
 * the banner were hit, or after an end of generation). Returns 0 or
 * KVD_ENOMEM (bitmask then undefined). */
int grammar_mask(const gstate_t *s, const gtrie_t *trie, uint32_t *bitmask, uint32_t *n_allowed);

/* The same by brute force: every token's bytes fed to a copy of s (tests). */
int grammar_mask_bruteforce(const gstate_t *s, const gtrie_t *trie, uint32_t *bitmask,
                            uint32_t *n_allowed);

/* Sets logits[id] to -INFINITY for every id in [0, n_vocab) whose bit in
 * bitmask is clear, before the sampler's chain (sampler.h) runs. */
void grammar_mask_apply(const uint32_t *bitmask, float *logits, uint32_t n_vocab);

/* True when bit id of bitmask is set. */
static inline bool grammar_mask_has(const uint32_t *bitmask, int32_t id)
{
    return (bitmask[(uint32_t)id >> 5] >> ((uint32_t)id & 31)) & 1u;
}

/* Advances s by token id's bytes (the sampler's choice). Returns 0; KVD_EINVAL
 * when the mask would not have allowed it (s unchanged); an end-of-generation
 * token is accepted only when s is complete, and after it nothing more is.
 * Returns KVD_ERANGE for an id outside the vocabulary. */
int grammar_advance_token(gstate_t *s, const gtrie_t *trie, int32_t id);

#endif
