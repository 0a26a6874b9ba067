#!/usr/bin/env python3
"""Context windowing: the perplexity of a text many times longer than the context, scored in one
sequence, kvd against llama.cpp's context shift on the same token ids (markdown).

Every token of the text (after the first) is scored once, fed 64 tokens a step into one sequence
of --ctx positions. When the next step would pass the context:

  kvd window         kvd-run --perplexity-stream --context-overflow window: the first --sinks
                     tokens (whole blocks of 16) stay, the older half of the rest goes, the kept
                     keys are turned to their new positions (docs/models.md)
  kvd window, 0 sinks  the same without sinks (what attention sinks are for)
  kvd restart        an empty cache from the next token on (no sinks, no history)
  llama.cpp shift    llama.cpp's context shift as its server does it, through its own API
                     (llama_memory_seq_rm of [n_keep, n_keep + n_discard), llama_memory_seq_add
                     of -n_discard to the rest; n_keep = --sinks, n_discard = half of the rest),
                     run from llama-cpp-python's ctypes bindings over a native libllama
  in context         kvd-run --perplexity --ctx N: llama.cpp's perplexity protocol (windows of N,
                     the second half of each scored), the value a window should stay close to

and one row per --ctx stretch of the text, so that what happens once the context fills shows.
The text: /usr/share/common-licenses/GPL-3 (about 7,600 tokens for SmolLM2), or --text.

llama.cpp needs llama-cpp-python's package directory (--llama-py DIR, its `llama_cpp` inside) and
a libllama built from the same llama.cpp (--llama-lib DIR with libllama.so): bench/bench_peers.sh
leaves both under ~/.cache/kvd-peers/llama.cpp, which are the defaults. Needs numpy.

    python3 bench/bench_window.py [--bin-dir build] [--model M] [--ctx 512] [--sinks 4] [--text F]
                                  [--no-llama] [--plot DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import plot

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path.home() / ".cache" / "kvd-peers" / "llama.cpp"
CHUNK = 64


def kvd_run(args: argparse.Namespace, *extra: str) -> dict:
    cmd = [str(args.bin_dir / "kvd-run"), "-m", str(args.model), "-t", str(args.threads), "--json",
           "--kv-type", "f16", *extra]   # llama.cpp's cache, not kvd's auto
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def stream(args: argparse.Namespace, mode: str, sinks: int) -> dict:
    return kvd_run(args, "--perplexity-stream", str(args.text), "--ctx", str(args.ctx),
                   "--context-overflow", mode, "--sinks", str(sinks))


def llama_shift(args: argparse.Namespace, ids: list[int]) -> dict:
    """Streaming perplexity over ids with llama.cpp's context shift."""
    import numpy as np
    os.environ["LLAMA_CPP_LIB_PATH"] = str(args.llama_lib)
    sys.path.insert(0, str(args.llama_py))
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(args.model).encode(), mp)
    if not model:
        raise SystemExit("llama.cpp cannot load the model")
    cp = L.llama_context_default_params()
    cp.n_ctx = args.ctx
    cp.n_batch = CHUNK
    cp.n_ubatch = CHUNK
    cp.n_threads = cp.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    batch = L.llama_batch_init(CHUNK, 0, 1)
    n_keep = args.sinks
    n_past, nll, scored, shifts = 0, 0.0, 0, 0
    seg = [[0.0, 0] for _ in range((len(ids) + args.ctx - 1) // args.ctx)]
    t0 = time.monotonic()
    nxt = 0
    while nxt + 1 < len(ids):
        m = min(CHUNK, len(ids) - nxt)
        if n_past + m > args.ctx:
            n_discard = (n_past - n_keep) // 2
            L.llama_memory_seq_rm(mem, 0, n_keep, n_keep + n_discard)
            L.llama_memory_seq_add(mem, 0, n_keep + n_discard, n_past, -n_discard)
            n_past -= n_discard
            shifts += 1
            m = min(m, args.ctx - n_past)
        batch.n_tokens = m
        for j in range(m):
            batch.token[j] = ids[nxt + j]
            batch.pos[j] = n_past + j
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = 0
            batch.logits[j] = 1
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        for j in range(m):
            at = nxt + j + 1
            if at >= len(ids):
                break
            row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).astype(np.float64)
            mx = row.max()
            lse = mx + math.log(np.exp(row - mx).sum())
            loss = lse - row[ids[at]]
            nll += loss
            scored += 1
            seg[at // args.ctx][0] += loss
            seg[at // args.ctx][1] += 1
        n_past += m
        nxt += m
    ms = (time.monotonic() - t0) * 1e3
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {"perplexity": math.exp(nll / scored), "tokens_scored": scored, "windows": shifts, "ms": ms,
            "segments": [math.exp(a / n) for a, n in seg if n > 0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--llama-py", type=Path, default=PEERS / "llama_cpp_python-0.3.36")
    ap.add_argument("--llama-lib", type=Path, default=PEERS / "build" / "bin")
    ap.add_argument("--plot", type=Path, help="directory for the PNG chart")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.plot:
        plot._pyplot()
    rows: dict[str, dict] = {}
    rows["kvd window"] = stream(args, "window", args.sinks)
    rows["kvd window, 0 sinks"] = stream(args, "window", 0)
    rows["kvd restart"] = stream(args, "restart", args.sinks)
    if not args.no_llama:
        ids = json.loads(subprocess.run([str(args.bin_dir / "kvd-run"), "-m", str(args.model), "--tokenize",
                                         args.text.read_text()], capture_output=True, text=True,
                                        check=True).stdout)
        rows["llama.cpp shift"] = llama_shift(args, ids)
    ref = kvd_run(args, "--perplexity", str(args.text), "--ctx", str(args.ctx))["perplexity"]
    n = rows["kvd window"]["tokens_scored"]
    print(f"Perplexity of {args.text} ({n:,} tokens, {n / args.ctx:.1f}x the context) in one sequence "
          f"of --ctx {args.ctx}, {args.model.name}, fed {CHUNK} tokens a step; {args.sinks} sinks")
    print(f"in context (kvd-run --perplexity --ctx {args.ctx}, llama.cpp's protocol): {ref:.3f}\n")
    print("| run | perplexity | against in-context | windows / restarts |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        moves = r.get("windows", 0) or r.get("restarts", 0)
        print(f"| {name} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / ref - 1):+.1f}% | {moves} |")
    print(f"\nper {args.ctx} text tokens:")
    for name, r in rows.items():
        print(f"  {name:22s} " + " ".join(f"{x:.2f}" for x in r["segments"]))
    if args.json:
        args.json.write_text(json.dumps({"in_context": ref, "runs": rows}, indent=2))
    if args.plot:
        series = {name: (list(range(1, len(r["segments"]) + 1)), r["segments"]) for name, r in rows.items()}
        series["in context"] = ([1, len(rows["kvd window"]["segments"])], [ref, ref])
        plot.line(args.plot / "window.png", f"Perplexity past the context (--ctx {args.ctx}, {args.model.stem})",
                  f"stretch of {args.ctx} text tokens", "perplexity", series, logy=True,
                  note=f"{args.sinks} sinks; " + plot.machine_note())


if __name__ == "__main__":
    main()
