#!/usr/bin/env python3
"""Make kvd's llama.cpp reference data (token ids, perplexity, greedy continuations).

Not part of CI: it needs llama-cpp-python (which compiles llama.cpp on install, tens of minutes on
two cores), jinja2 and numpy. Its outputs are committed under tests/data/ and the C tests read
those, never this script.

    pip install llama-cpp-python jinja2 numpy
    python3 scripts/make_reference.py MODEL.gguf        # SmolLM2-135M-Instruct.Q4_1.gguf
    python3 scripts/make_reference.py --tokenizer-only MODEL.gguf   # gemma-3-270m-q4_k_m.gguf
    python3 scripts/make_reference.py --second-model MODEL.gguf     # the same, plus perplexity and greedy

Reads   tests/data/tok_strings.txt, tests/data/ppl_text.txt, tests/data/chat_prompts.txt
Writes  tests/data/tok_vectors.tsv  tokenization of every test string, parse_special 0 and 1
        tests/data/ppl_ref.txt      perplexity of ppl_text.txt as llama.cpp's perplexity tool computes it
        tests/data/greedy_ref.tsv   32-token greedy continuations of the chat prompts, with logit gaps

With --tokenizer-only, for a second model's tokenizer (ARCH = the model's general.architecture):
Reads   tests/data/tok_strings.txt and tests/data/ARCH/tok_strings_extra.txt (when present)
Writes  tests/data/ARCH/tok_vectors.tsv  as tok_vectors.tsv, plus a fourth column: llama.cpp's
        detokenization of the ids (llama_detokenize, remove_special=0, unparse_special=1)

With --second-model, also (ARCH as above; the model's window and chat format are its own):
Reads   tests/data/ppl_text.txt then tests/data/ARCH/ppl_text_extra.txt, tests/data/chat_prompts.txt
Writes  tests/data/ARCH/ppl_ref.txt     perplexity of the two texts joined, windows of 2,048 tokens
        tests/data/ARCH/greedy_ref.tsv  16-token greedy continuations of the chat prompts, the prompt
                                        rendered by llama.cpp's built-in template for the architecture
                                        when the file ships none (llama_chat_apply_template)

String escaping (inputs and outputs): one string per line; \\n \\t \\r \\\\ and \\xNN (one raw byte)
are the only escapes; '#' starts a comment line (a string starting with '#' is written \\x23...);
trailing spaces and all-space strings are written as \\x20 so that editors cannot strip them.
"""

import ctypes
import hashlib
import math
import os
import re
import sys

import jinja2
import numpy as np
import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")

N_THREADS = 2
N_BATCH = 512
SEED = 1234
PPL_WINDOWS = (512, 256)
GREEDY_TOKENS = 32
GREEDY_NCTX = 512
EOG_IDS = {0: "<|endoftext|>", 2: "<|im_end|>"}
BUILTIN_CHAT = {"gemma3": "gemma"}   # llama.cpp's built-in chat template of an architecture
VENDORED = {"0.3.36": "ggml-org/llama.cpp@0c1e57098"}   # from llama-cpp-python's CHANGELOG


# ---------------------------------------------------------------- escaping

def unescape(s: str) -> bytes:
    """Line of a data file (without its newline) -> the bytes it stands for."""
    out = bytearray()
    i = 0
    while i < len(s):
        c = s[i]
        if c != "\\":
            out += c.encode("utf-8")
            i += 1
            continue
        if i + 1 >= len(s):
            raise ValueError(f"dangling backslash in {s!r}")
        e = s[i + 1]
        if e in "nrt\\":
            out += {"n": b"\n", "r": b"\r", "t": b"\t", "\\": b"\\"}[e]
            i += 2
        elif e == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", s[i + 2:i + 4]):
            out.append(int(s[i + 2:i + 4], 16))
            i += 4
        else:
            raise ValueError(f"bad escape \\{e} in {s!r}")
    return bytes(out)


def escape(b: bytes) -> str:
    """Bytes -> one line that unescape() maps back to them (canonical form)."""
    out = []
    i = 0
    while i < len(b):
        # decode the longest valid UTF-8 character at i, else emit the byte as \xNN
        ch = None
        for n in (1, 2, 3, 4):
            try:
                ch = b[i:i + n].decode("utf-8")
                break
            except UnicodeDecodeError:
                continue
        if ch is None:
            out.append("\\x%02x" % b[i])
            i += 1
            continue
        i += len(ch.encode("utf-8"))
        if ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append("\\x%02x" % ord(ch))
        else:
            out.append(ch)
    if out and out[0] == "#":
        out[0] = "\\x23"
    j = len(out)                      # trailing spaces (all of them for an all-space string)
    while j > 0 and out[j - 1] == " ":
        out[j - 1] = "\\x20"
        j -= 1
    s = "".join(out)
    assert unescape(s) == b, (b, s)
    return s


def read_lines(name):
    """Data lines of tests/data/NAME: comments and blank lines dropped, still escaped."""
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return [l.rstrip("\n") for l in f if l.strip() and not l.startswith("#")]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- llama.cpp helpers

def provenance(model_path, model_sha):
    return [
        f"# made by scripts/make_reference.py with llama-cpp-python {llama_cpp.__version__} "
        f"(llama.cpp {VENDORED.get(llama_cpp.__version__, 'commit unknown')}, "
        f"llama_version {llama_cpp.llama_version().decode()})",
        f"# model {os.path.basename(model_path)} sha256 {model_sha}",
        f"# system_info {llama_cpp.llama_print_system_info().decode().strip()}",
    ]


def load(model_path, n_ctx, logits_all, flash_attn):
    """A context with the settings every reference run shares (f16 K and V cache)."""
    return llama_cpp.Llama(
        model_path=model_path, n_ctx=n_ctx, n_batch=N_BATCH, n_ubatch=N_BATCH,
        n_threads=N_THREADS, n_threads_batch=N_THREADS, seed=SEED,
        logits_all=logits_all, flash_attn=flash_attn,
        type_k=llama_cpp.GGML_TYPE_F16, type_v=llama_cpp.GGML_TYPE_F16,
        verbose=False)


def clear(llm):
    """Forget every cached token of the context (llama.cpp: llama_memory_clear)."""
    llm.reset()
    llm._ctx.kv_cache_clear()


def last_logits(llm):
    """Logits of the last token of the last llm.eval() call (float32, one row)."""
    p = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(p, shape=(llm.n_vocab(),)).copy()


# ---------------------------------------------------------------- a) tokenizer vectors

def detokenize(vocab, ids):
    """llama.cpp's own detokenizer on ids: llama_detokenize(remove_special=0, unparse_special=1),
    control tokens written as their text; kvd's tok_decode mirrors it. (Llama.detokenize instead
    joins pieces from a 32-byte buffer and strips a leading space after a BOS itself.)"""
    v = llama_cpp.llama_model_get_vocab(vocab._model.model)
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 64 + 16 * len(ids)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(v, arr, len(ids), buf, size, False, True)
        if n >= 0:
            return buf.raw[:n]
        size = -n


def make_tok_vectors(model_path, head, out_dir="", extra=None):
    """Rows for every string of tok_strings.txt (then of extra, a file under tests/data) into
    out_dir/tok_vectors.tsv; with out_dir, a fourth column holds llama.cpp's detokenization."""
    vocab = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    lines = read_lines("tok_strings.txt") + (read_lines(extra) if extra else [])
    rows = []
    for line in lines:
        b = unescape(line)
        for special in (0, 1):
            ids = vocab.tokenize(b, add_bos=False, special=bool(special))
            row = f"{escape(b)}\t{special}\t{' '.join(map(str, ids))}"
            if out_dir:
                row += "\t" + escape(detokenize(vocab, ids))
            rows.append(row)
    strings = "tok_strings.txt" + (f" and {extra}" if extra else "")
    columns = ("# columns: escaped string (escaping as in tok_strings.txt) <TAB> parse_special 0|1 "
               "<TAB> token ids, space-separated")
    notes = []
    if out_dir:
        meta = vocab.metadata
        columns += " <TAB> escaped detokenization of the ids"
        notes = [
            f"# tokenizer: tokenizer.ggml.model {meta.get('tokenizer.ggml.model')}, "
            f"pre {meta.get('tokenizer.ggml.pre')}, {vocab.n_vocab()} tokens, "
            f"add_bos_token {meta.get('tokenizer.ggml.add_bos_token')}, "
            f"add_space_prefix {meta.get('tokenizer.ggml.add_space_prefix')}",
            "# detokenization: llama_detokenize(ids, remove_special=0, unparse_special=1)",
        ]
    path = os.path.join(DATA, out_dir, "tok_vectors.tsv")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(head + notes + [
            f"# llm.tokenize(bytes, add_bos=False, special=parse_special) on every string of {strings}",
            columns,
        ] + rows) + "\n")
    print(f"{os.path.relpath(path, ROOT)}: {len(lines)} strings, {len(rows)} rows")


# ---------------------------------------------------------------- b) perplexity

def nll_rows(logits, targets):
    """Negative log-likelihood of targets[i] under logits[i], log-softmax in float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
    return lse - x[np.arange(len(targets)), targets]


def perplexity(model_path, tokens, n_ctx, add_bos, bos, flash_attn):
    """llama.cpp perplexity tool: non-overlapping windows of n_ctx tokens (tail dropped), each
    from an empty KV cache, first token replaced by BOS when add_bos; score positions
    j in [n_ctx/2, n_ctx-1): logits at j predict token j+1."""
    llm = load(model_path, n_ctx, logits_all=True, flash_attn=flash_attn)
    first = n_ctx // 2
    nll, count = 0.0, 0
    windows = len(tokens) // n_ctx
    for w in range(windows):
        win = list(tokens[w * n_ctx:(w + 1) * n_ctx])
        if add_bos:
            win[0] = bos
        clear(llm)
        llm.eval(win)
        lg = llm.scores[first:n_ctx - 1]
        nll += float(nll_rows(lg, np.array(win[first + 1:n_ctx])).sum())
        count += n_ctx - 1 - first
    llm.close()
    return windows, count, math.exp(nll / count)


def make_ppl_ref(model_path, head, out_dir="", windows=PPL_WINDOWS, extra=None):
    vocab = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    add_bos = vocab.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    bos = vocab.token_bos()
    with open(os.path.join(DATA, "ppl_text.txt"), "rb") as f:
        text = f.read()
    name = "ppl_text.txt"
    if extra is not None:
        with open(os.path.join(DATA, extra), "rb") as f:
            text += b"\n" + f.read()
        name += f" + newline + {extra}"
    tokens = vocab.tokenize(text, add_bos=add_bos, special=True)
    lines = head + [
        f"# {name}: {len(text)} bytes, {len(tokens)} tokens "
        f"(tokenize add_bos={int(add_bos)} from tokenizer.ggml.add_bos_token, parse_special=1, "
        f"as llama-perplexity)",
        "# method: llama.cpp perplexity tool; non-overlapping windows of n_ctx tokens, tail dropped,",
        "#   each window from an empty KV cache in one batch (n_batch=n_ubatch=512), first token -> BOS",
        "#   only when add_bos; NLL of token j+1 from logits at j for j in [n_ctx/2, n_ctx-1),",
        "#   log-softmax in float64; ppl = exp(mean NLL).",
        f"# settings: n_threads={N_THREADS} type_k=f16 type_v=f16; the main lines use flash_attn=0",
        "#   (llama-cpp-python's default); the fa=1 lines are the same with flash attention on",
        "#   (what the llama-perplexity CLI's flash_attn=auto picks on a CPU).",
    ]
    for fa in (False, True):
        for n_ctx in windows:
            n_win, count, ppl = perplexity(model_path, tokens, n_ctx, add_bos, bos, fa)
            tag = "" if not fa else " fa 1"
            lines.append(f"ctx {n_ctx} windows {n_win} tokens_scored {count} ppl {ppl:.6f}{tag}")
            print(lines[-1])
    with open(os.path.join(DATA, out_dir, "ppl_ref.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------- c) greedy continuations

def render_chat(template, system, user):
    env = jinja2.Environment(loader=jinja2.BaseLoader())
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
               [{"role": "user", "content": user}]
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def builtin_chat(name, system, user):
    """llama.cpp's built-in chat template `name` (llama_chat_apply_template) on one exchange."""
    msgs = ([("system", system)] if system is not None else []) + [("user", user)]
    arr = (llama_cpp.llama_chat_message * len(msgs))()
    keep = []
    for i, (role, content) in enumerate(msgs):
        keep += [role.encode(), content.encode("utf-8")]
        arr[i].role, arr[i].content = keep[-2], keep[-1]
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(msgs), True, buf, size)
        if n < 0:
            raise RuntimeError(f"llama.cpp has no chat template {name!r}")
        if n <= size:
            return buf.raw[:n].decode("utf-8")
        size = n


def greedy(llm, prompt_ids, n_tokens=GREEDY_TOKENS, eog=EOG_IDS):
    """Argmax decoding from an empty cache: prompt in one batch, then one token per step.
    Returns (generated ids, top1-top2 logit gaps); stops after an end-of-generation token."""
    clear(llm)
    llm.eval(prompt_ids)
    out, gaps = [], []
    for _ in range(n_tokens):
        lg = last_logits(llm)
        tok = int(np.argmax(lg))                 # first maximum, as llama.cpp's greedy sampler
        top = np.partition(lg, -2)
        gaps.append(float(top[-1] - top[-2]))    # 0 on an exact tie
        out.append(tok)
        if tok in eog:
            break
        llm.eval([tok])
    return out, gaps


def make_greedy_ref_second(model_path, head, arch):
    """The greedy reference of a second model family: its own chat format (the file's template, or
    llama.cpp's built-in one for the architecture), BOS as the model adds it, 16 tokens."""
    llm = load(model_path, GREEDY_NCTX * 2, logits_all=False, flash_attn=False)
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    template = llm.metadata.get("tokenizer.chat_template")
    v = llama_cpp.llama_model_get_vocab(llm.model)
    eog = {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(v, i)}
    rows, first = [], None
    for line in read_lines("chat_prompts.txt"):
        parts = line.split("\t")
        system = unescape(parts[0]).decode("utf-8") if len(parts) == 2 else None
        user = unescape(parts[-1]).decode("utf-8")
        rendered = (render_chat(template, system, user) if template
                    else builtin_chat(BUILTIN_CHAT.get(arch, arch), system, user))
        first = first or rendered
        prompt_ids = llm.tokenize(rendered.encode("utf-8"), add_bos=add_bos, special=True)
        gen, gaps = greedy(llm, prompt_ids, 16, eog)
        rows.append("\t".join(["" if system is None else escape(system.encode("utf-8")),
                               escape(user.encode("utf-8")), " ".join(map(str, prompt_ids)),
                               " ".join(map(str, gen)), ",".join(f"{g:.4f}" for g in gaps)]))
        print(f"{user!r} -> {llm.detokenize(gen, special=True)!r} min gap {min(gaps):.4f}")
    llm.close()
    with open(os.path.join(DATA, arch, "greedy_ref.tsv"), "w", encoding="utf-8") as f:
        f.write("\n".join(head + [
            "# Greedy (argmax) continuations of tests/data/chat_prompts.txt, 16 tokens.",
            "# Prompt: " + ("the file's tokenizer.chat_template rendered with jinja2" if template else
                            f"llama.cpp's built-in '{arch}' chat template (llama_chat_apply_template)") +
            f", add_generation_prompt; tokenized with add_bos={int(add_bos)}, parse_special=1;",
            "#   evaluated from an empty cache in one batch, then one token per llm.eval() step;",
            "#   an end-of-generation token stops the run and is the last generated id.",
            f"# Settings: n_ctx={GREEDY_NCTX * 2} n_batch={N_BATCH} n_threads={N_THREADS} f16 K/V, flash_attn=0.",
            "# Rendered prompt of the first row: " + escape(first.encode("utf-8")),
            "# columns: escaped system (empty: none) <TAB> escaped user <TAB> prompt ids <TAB> generated ids",
            "#   <TAB> top1-top2 logit gap at each generated position (comma-separated, 4 decimals)",
        ] + rows) + "\n")


def make_greedy_ref(model_path, head):
    runs = {}
    for fa in (False, True):
        llm = load(model_path, GREEDY_NCTX, logits_all=False, flash_attn=fa)
        template = llm.metadata["tokenizer.chat_template"]
        res, first_rendered = [], None
        for line in read_lines("chat_prompts.txt"):
            parts = line.split("\t")
            system = unescape(parts[0]).decode("utf-8") if len(parts) == 2 else None
            user = unescape(parts[-1]).decode("utf-8")
            rendered = render_chat(template, system, user)
            if first_rendered is None:
                first_rendered = rendered
            prompt_ids = llm.tokenize(rendered.encode("utf-8"), add_bos=False, special=True)
            gen, gaps = greedy(llm, prompt_ids)
            res.append((system, user, prompt_ids, gen, gaps))
        runs[fa] = (res, first_rendered)
        llm.close()

    res, first_rendered = runs[False]
    vocab = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    rows, notes = [], []
    for k, (system, user, prompt_ids, gen, gaps) in enumerate(res):
        esc_sys = "" if system is None else escape(system.encode("utf-8"))
        rows.append("\t".join([
            esc_sys, escape(user.encode("utf-8")),
            " ".join(map(str, prompt_ids)), " ".join(map(str, gen)),
            ",".join(f"{g:.4f}" for g in gaps)]))
        text = vocab.detokenize(gen, special=True)
        stop = EOG_IDS.get(gen[-1], "none (32 tokens)") if gen else "none"
        fa_gen = runs[True][0][k][3]
        same = "same" if fa_gen == gen else \
            f"DIFFERS from token {next((i for i, (a, b) in enumerate(zip(gen, fa_gen)) if a != b), min(len(gen), len(fa_gen)))}"
        notes.append(f"# [{k}] n={len(gen)} stop={stop} min_gap={min(gaps):.4f} "
                     f"min_gap_first16={min(gaps[:16]):.4f} flash_attn=1: {same}")
        notes.append(f"# [{k}] text: {escape(text)}")
        print(f"[{k}] {user!r}\n    -> {text.decode('utf-8', 'replace')!r}\n    {notes[-2][2:]}")
    with open(os.path.join(DATA, "greedy_ref.tsv"), "w", encoding="utf-8") as f:
        f.write("\n".join(head + [
            "# Greedy (argmax) continuations of tests/data/chat_prompts.txt.",
            "# Prompt: the model's tokenizer.chat_template (GGUF metadata) rendered with jinja2,",
            "#   add_generation_prompt=True, no system message given -> the template's default one;",
            "#   tokenized with add_bos=False, parse_special=1; evaluated from an empty cache in one batch,",
            f"#   then one token per llm.eval() step, up to {GREEDY_TOKENS} tokens; an end-of-generation",
            "#   token (<|im_end|> 2, <|endoftext|> 0) stops the run and is the last generated id.",
            f"# Settings: n_ctx={GREEDY_NCTX} n_batch={N_BATCH} n_threads={N_THREADS} f16 K/V, flash_attn=0,",
            "#   logits of the last token only (logits_all=0).",
            "# Near-ties (gap < ~0.05) flip under any change of summation order: flash attention,",
            "#   or a prefill fed in other chunks (one token at a time, say); see the notes at the end.",
            "# Rendered prompt of the first row: " + escape(first_rendered.encode("utf-8")),
            "# columns: escaped system (empty: none) <TAB> escaped user <TAB> prompt ids <TAB> generated ids",
            "#   <TAB> top1-top2 logit gap at each generated position (comma-separated, 4 decimals)",
        ] + rows + ["# Decoded continuations and checks (flash_attn=1 run compared token by token):"]
            + notes) + "\n")


def main():
    args = sys.argv[1:]
    tokenizer_only = "--tokenizer-only" in args
    second = "--second-model" in args
    args = [a for a in args if a not in ("--tokenizer-only", "--second-model", "--greedy-only")]
    if len(args) != 1 or args[0].startswith("-"):
        sys.exit(__doc__)
    model_path = args[0]
    head = provenance(model_path, sha256(model_path))
    if tokenizer_only or second:
        vocab = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
        arch = vocab.metadata["general.architecture"]
        os.makedirs(os.path.join(DATA, arch), exist_ok=True)
        extra = os.path.join(arch, "tok_strings_extra.txt")
        make_tok_vectors(model_path, head, arch,
                         extra if os.path.exists(os.path.join(DATA, extra)) else None)
        if second:
            if "--greedy-only" not in sys.argv:
                make_ppl_ref(model_path, head, arch, (2048,), os.path.join(arch, "ppl_text_extra.txt"))
            make_greedy_ref_second(model_path, head, arch)
        return
    make_tok_vectors(model_path, head)
    make_ppl_ref(model_path, head)
    make_greedy_ref(model_path, head)


if __name__ == "__main__":
    main()
