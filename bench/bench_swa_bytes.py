#!/usr/bin/env python3
"""KV bytes of a model with sliding-window layers (Gemma 3), kvd against llama.cpp (markdown).

One session of each --ctx length (f16 K/V), three ways:

- kvd's pool in parts (common/kvparts.h), from kvd-calc: the blocks its allocator holds for a
  sequence whose positions are all written, every block of the full-attention part and the live
  window of each windowed part (the arithmetic unit.parts checks the allocator against).
- Every block holding every layer (kvd before the pool kept its parts apart; the seed's formula).
- llama.cpp's interleaved-SWA cache, as llama.cpp reports it after creating a context of that
  length (llama-cpp-python, one sequence): with its full-size SWA cache (swa_full, llama-cpp-python's
  default, which keeps what the window left for prompt caching) and with its compact one (llama.cpp's
  own default: the window plus a micro-batch, in cells padded to 256, which cannot be reused
  once the window has moved on).

Then the sessions of --sessions-ctx tokens that --memory holds: kvd's from kvd-calc's pool plan
(the pool's own block count over the blocks one session holds), every-layer blocks' as the budget
over whole sessions of such blocks (metadata left out), llama.cpp's from the bytes one session's
cache takes (compact SWA), likewise.

Needs llama-cpp-python in the Python that runs it (`pip install llama-cpp-python`; the install
compiles llama.cpp, tens of minutes on two cores).

    python3 bench/bench_swa_bytes.py [--model models/gemma-3-270m-q4_k_m.gguf]
                                     [--kvd-calc build/kvd-calc] [--ctx 8192 32768]
"""

import argparse
import json
import re
import subprocess
import sys

MIB = 1 << 20


def kvd(calc: str, model: str, ctx: int, memory: str) -> dict:
    out = subprocess.run([calc, "-m", model, "--ctx", str(ctx), "--kv-memory", memory, "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


LLAMA = """
import llama_cpp, sys
llama_cpp.Llama(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=1, swa_full=sys.argv[3] == "1",
                n_batch=512, n_ubatch=512, verbose=True)
"""


def llama(model: str, ctx: int, swa_full: bool) -> int:
    """Bytes of llama.cpp's KV caches for one sequence of ctx tokens, from its own log."""
    r = subprocess.run([sys.executable, "-c", LLAMA, model, str(ctx), "1" if swa_full else "0"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"llama-cpp-python failed:\n{r.stderr[-2000:]}")
    sizes = re.findall(r"llama_kv_cache: size =\s*([0-9.]+) MiB", r.stderr)
    if not sizes:
        sys.exit("llama.cpp printed no KV cache size (llama_kv_cache: size = ...)")
    return round(sum(float(s) for s in sizes) * MIB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--kvd-calc", default="build/kvd-calc")
    ap.add_argument("--ctx", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--sessions-ctx", type=int, default=8192)
    ap.add_argument("--memory", default="1GiB")
    a = ap.parse_args()

    print("| one session | kvd, pool in parts | every block all layers | llama.cpp, full-size SWA "
          "| llama.cpp, compact SWA | kvd vs all layers | kvd vs llama.cpp compact |")
    print("|---|---|---|---|---|---|---|")
    for ctx in a.ctx:
        k = kvd(a.kvd_calc, a.model, ctx, a.memory)
        ours, flat = k["parts"]["bytes"], k["paged_bytes"]
        full, compact = llama(a.model, ctx, True), llama(a.model, ctx, False)
        print(f"| {ctx:,} tokens | {ours / MIB:.1f} MiB | {flat / MIB:.1f} MiB | {full / MIB:.1f} MiB "
              f"| {compact / MIB:.1f} MiB | {flat / ours:.2f}x less | {compact / ours:.2f}x less |")

    k = kvd(a.kvd_calc, a.model, a.sessions_ctx, a.memory)
    per = llama(a.model, a.sessions_ctx, False)
    budget = k["pool"]["budget"]
    print()
    print(f"| sessions of {a.sessions_ctx:,} tokens in {a.memory} | kvd, pool in parts "
          f"| every block all layers | llama.cpp, compact SWA |")
    print("|---|---|---|---|")
    flat_blocks = budget // (k["paged_bytes"] // k["blocks"])   # its metadata left out: at most this
    print(f"| sessions | {k['pool']['sequences']} | {flat_blocks // k['blocks']} | {budget // per} |")


if __name__ == "__main__":
    main()
