#!/usr/bin/env python3
"""Three curves of kvd alone, as tables and (with --plot DIR) PNG charts:

  kv-bytes      KV bytes one sequence holds against its context, per KV type (f16, q8_0, q4_0),
                for each model present (kvd-calc: the blocks kvd's allocator keeps, every layer's
                blocks for a llama-family model, the live windows of a sliding-window model's
                windowed layers); arithmetic, not a timing.
  ttft-share    time to first token of a --tokens prompt (token ids cut from tests/data/ppl_text.txt)
                against the share of it already in the pool: a prefix of that share is sent first
                (max_tokens 1, its own namespace), then the whole prompt, whose TTFT (kvd's own
                timing, arrival to first token) is kept; median of --runs.
  concurrency   output tokens/s and median TTFT against the number of concurrent requests: a
                shared system prompt of about 1,000 tokens (cached by a warm-up request), each
                request its own question, --max-tokens greedy tokens (end-of-generation ignored),
                2 x C requests at concurrency C.

kvd runs with one worker of --threads threads and its defaults otherwise (KV type auto: bf16 or
f16 by the CPU; a 1 GiB pool).
Needs kvd's Python client (pip install ./clients/python) and, for --plot, matplotlib.

    python3 bench/bench_curves.py [--bin-dir build] [--model M] [--threads 2] [--tokens 2048]
                                  [--runs 3] [--max-tokens 64] [--only kv-bytes|ttft-share|concurrency]
                                  [--plot DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import kvd_client
from kvd_client.aio import AsyncClient
from kvdbench import Kvd

import plot

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"SmolLM2-135M (Q4_1)": ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
          "Gemma 3 270M (Q4_K_M)": ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"}
KV_TYPES = ("f16", "q8_0", "q4_0")


def kv_bytes(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    ctxs = [512, 1024, 2048, 4096, 8192, 16384, 32768]
    out: dict[str, dict[str, list[float]]] = {}
    print("KV bytes per sequence (MiB) against context (kvd-calc, blocks of 16)")
    print("| model | KV type | " + " | ".join(f"{c:,}" for c in ctxs) + " |")
    print("|---|---|" + "---|" * len(ctxs))
    for name, path in MODELS.items():
        if not path.exists():
            print(f"| {name} | (not present: {path}) |")
            continue
        calc = [str(args.bin_dir / "kvd-calc"), "-m", str(path), "--json"]
        limit = json.loads(subprocess.run(calc, capture_output=True, text=True, check=True).stdout)["ctx"]
        for t in KV_TYPES:
            row = []
            for c in (c for c in ctxs if c <= limit):   # up to the model's context
                j = json.loads(subprocess.run(calc + ["--ctx", str(c), "--kv-type", t],
                                              capture_output=True, text=True, check=True).stdout)
                row.append((j["parts"]["bytes"] if "parts" in j else j["paged_bytes"]) / 2**20)
            out[f"{name}, {t}"] = {"ctx": ctxs[:len(row)], "mib": row}
            cells = [f"{v:,.1f}" for v in row] + ["-"] * (len(ctxs) - len(row))
            print(f"| {name} | {t} | " + " | ".join(cells) + " |")
    if args.plot:
        plot.line(args.plot / "kv-bytes.png", "KV memory of one sequence", "context (tokens)", "MiB",
                  {k: (v["ctx"], v["mib"]) for k, v in out.items()}, logx=True, logy=True,
                  note="kvd-calc: blocks kvd's allocator holds; " + plot.machine_note())
    return out


def start(args: argparse.Namespace, work: Path) -> Kvd:
    return Kvd(args.bin_dir, args.model, work, ["-w", "1", "-t", str(args.threads)])


def ttft_share(args: argparse.Namespace, work: Path) -> dict[str, list[float]]:
    shares = [0.0, 0.25, 0.5, 0.75, 0.9, 0.99]
    k = start(args, work)
    res: dict[str, list[float]] = {"share": [], "cached_tokens": [], "ttft_ms": []}
    try:
        with kvd_client.Client(k.endpoint, timeout=3600) as c:
            text = (ROOT / "tests" / "data" / "ppl_text.txt").read_text()
            ids = c.tokenize(text)
            while len(ids) < args.tokens:
                ids += ids
            ids = ids[:args.tokens]
            c.generate(token_ids=ids[:64], max_tokens=1, temperature=0, namespace="warm-up")
            for share in shares:
                ttfts, cached = [], 0
                for run in range(args.runs):
                    ns = f"share-{share}-{run}"
                    pre = int(len(ids) * share)
                    if pre > 0:
                        c.generate(token_ids=ids[:pre], max_tokens=1, temperature=0, namespace=ns)
                    r = c.generate(token_ids=ids, max_tokens=1, temperature=0, namespace=ns)
                    ttfts.append(r.timings.ttft_ms)
                    cached = r.usage.cached_prompt_tokens
                res["share"].append(share)
                res["cached_tokens"].append(cached)
                res["ttft_ms"].append(statistics.median(ttfts))
    finally:
        k.stop()
    n = args.tokens
    print(f"\nTTFT of a {n:,}-token prompt against the share of it in the pool "
          f"({args.model.name}, 1 worker x {args.threads} threads, median of {args.runs})")
    print("| share cached | cached tokens | TTFT ms | against none cached |")
    print("|---|---|---|---|")
    for s, ct, t in zip(res["share"], res["cached_tokens"], res["ttft_ms"]):
        print(f"| {s:.0%} | {ct:,} | {t:,.1f} | {res['ttft_ms'][0] / t:.1f}x lower |")
    if args.plot:
        plot.line(args.plot / "ttft-share.png", f"TTFT of a {n:,}-token prompt against its cached share",
                  "prompt tokens already cached (%)", "TTFT (ms)",
                  {"kvd": ([c / n * 100 for c in res["cached_tokens"]], res["ttft_ms"])},
                  note=f"{args.model.stem}, 1 worker x {args.threads} threads; " + plot.machine_note())
    return res


async def one_level(endpoint: str, system: str, conc: int, max_tokens: int) -> tuple[float, float, int]:
    sem = asyncio.Semaphore(conc)
    ttfts: list[float] = []
    tokens = 0

    async with AsyncClient(endpoint, timeout=3600) as c:
        async def one(i: int) -> None:
            nonlocal tokens
            async with sem:
                r = await c.generate(messages=[{"role": "system", "content": system},
                                               {"role": "user", "content": f"Question {i}: say more."}],
                                     max_tokens=max_tokens, temperature=0, ignore_eos=True)
                ttfts.append(r.timings.ttft_ms)
                tokens += r.usage.completion_tokens

        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(2 * conc)))
        wall = time.monotonic() - t0
    return tokens / wall, statistics.median(ttfts), tokens


def concurrency(args: argparse.Namespace, work: Path) -> dict[str, list[float]]:
    levels = [1, 2, 4, 8, 16, 32]
    words = (ROOT / "tests" / "data" / "ppl_text.txt").read_text().split()
    system = " ".join(words[:880])
    k = start(args, work)
    res: dict[str, list[float]] = {"concurrency": [], "tok_s": [], "ttft_ms": []}
    try:
        with kvd_client.Client(k.endpoint, timeout=3600) as c:
            c.generate(messages=[{"role": "system", "content": system},
                                 {"role": "user", "content": "Warm up."}], max_tokens=1, temperature=0)
        for conc in levels:
            tps, ttft, _ = asyncio.run(one_level(k.endpoint, system, conc, args.max_tokens))
            res["concurrency"].append(conc)
            res["tok_s"].append(tps)
            res["ttft_ms"].append(ttft)
    finally:
        k.stop()
    print(f"\nOutput tokens/s against concurrent requests ({args.model.name}, a shared cached system "
          f"prompt of ~1,000 tokens, {args.max_tokens} tokens each, 1 worker x {args.threads} threads)")
    print("| concurrent requests | output tok/s | median TTFT ms |")
    print("|---|---|---|")
    for cc, t, f in zip(res["concurrency"], res["tok_s"], res["ttft_ms"]):
        print(f"| {cc} | {t:,.1f} | {f:,.1f} |")
    if args.plot:
        plot.line(args.plot / "concurrency.png", "Output tokens/s against concurrent requests",
                  "concurrent requests", "output tokens/s",
                  {"kvd": (res["concurrency"], res["tok_s"])}, logx=True,
                  note=f"{args.model.stem}, 1 worker x {args.threads} threads, a shared cached system prompt; "
                       + plot.machine_note())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build")
    ap.add_argument("--model", type=Path, default=MODELS["SmolLM2-135M (Q4_1)"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--only", choices=["kv-bytes", "ttft-share", "concurrency"])
    ap.add_argument("--plot", type=Path, help="directory for the PNG charts")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.plot:
        plot._pyplot()      # fail before measuring, not after
    out: dict[str, object] = {}
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-curves-"))
    try:
        if args.only in (None, "kv-bytes"):
            out["kv_bytes"] = kv_bytes(args)
        if args.only in (None, "ttft-share"):
            out["ttft_share"] = ttft_share(args, tmp / "share")
        if args.only in (None, "concurrency"):
            out["concurrency"] = concurrency(args, tmp / "conc")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
