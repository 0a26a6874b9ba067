#!/usr/bin/env python3
"""What the tiers below the pool buy: time to first token of a request whose
system prompt of ~2,000 tokens (cut from tests/data/ppl_text.txt) is

    cold     cached nowhere (a namespace of its own)
    pool     in the pool (the same request again)
    host     evicted from the pool, in the host tier (--host-cache)
    disk     after a kvd restart on the same --cache-dir (a new pool, an empty
             host tier): read back from the disk tier's files; the page cache
             is dropped first where this runs as root (else the files may come
             from memory, and the table says so)

each the median of --runs requests (a new question each time, max_tokens 1),
and what it costs per 1,000 prompt tokens: TTFT less the pool's TTFT, over the
tokens that came from where the row says (computed for cold). The disk
tier's TTFT after a restart should be at least 10x lower than cold.

kvd runs with one worker, --kv-memory small enough that two other prompts of the
same size evict the first, --host-cache 1GiB and a --cache-dir in a temporary
directory (removed after). Needs kvd's Python client (pip install ./clients/python).

    python3 bench/bench_tiers.py [--bin-dir build] [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
                                 [--threads 2] [--tokens 2000] [--runs 3] [--json OUT] [--plot DIR]

With --plot DIR it also draws the TTFTs as bars into DIR/tiers.png (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import kvd_client
from kvdbench import Kvd, drop_page_cache

import plot

ROOT = Path(__file__).resolve().parents[1]


def system_prompt(words: list[str], start: int, n_words: int, tag: str) -> str:
    return f"[{tag}] " + " ".join(words[(start + i) % len(words)] for i in range(n_words))


def start(args: argparse.Namespace, work: Path, pool: str, cache: Path) -> Kvd:
    return Kvd(args.bin_dir, args.model, work,
               ["-w", "1", "-t", str(args.threads), "--ctx", "4096", "--kv-memory", args.kv_memory,
                "--pool", pool, "--host-cache", "1GiB", "--cache-dir", str(cache)])


def ask(c: kvd_client.Client, system: str, q: int, ns: str) -> kvd_client.Result:
    return c.generate(messages=[{"role": "system", "content": system},
                                {"role": "user", "content": f"Question {q}: what is the third word?"}],
                      max_tokens=1, temperature=0, namespace=ns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-memory", default="")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="directory for the PNG chart")
    args = ap.parse_args()
    if args.plot:
        plot._pyplot()      # fail before measuring, not after
    words = (ROOT / "tests" / "data" / "ppl_text.txt").read_text().split()
    n_words = int(args.tokens * 0.88)       # about 1.14 tokens a word in this text
    # a pool for one such prompt and a little: two more evict it
    if not args.kv_memory:
        args.kv_memory = f"{max(16, int(args.tokens * 23040 * 1.6 / 2**20))}MiB"
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-tiers-"))
    cache = tmp / "cache"
    pools = [f"kvd-bench-tiers-{os.getpid()}-{i}" for i in range(2)]
    rows: dict[str, dict[str, float]] = {}
    try:
        k = start(args, tmp / "k1", pools[0], cache)
        with kvd_client.Client(k.endpoint, timeout=3600) as c:
            main_sys = system_prompt(words, 0, n_words, "main")
            others = [system_prompt(words, 997 * (i + 1), n_words, f"other{i}") for i in range(2)]
            cold, pool, host = [], [], []
            prompt = 0
            for run in range(args.runs):
                ns = f"cold-{run}"
                r = ask(c, main_sys, run, ns)
                assert r.usage.cached_prompt_tokens == 0
                cold.append(r.timings.ttft_ms)
                prompt = r.usage.prompt_tokens
                r = ask(c, main_sys, 100 + run, ns)
                pool.append(r.timings.ttft_ms)
                for o in others:            # evict it from the pool
                    ask(c, o, 200 + run, ns)
                r = ask(c, main_sys, 300 + run, ns)
                if r.usage.host_cached_prompt_tokens == 0:
                    raise SystemExit(f"bench-tiers: nothing came from the host tier: {r.usage}")
                host.append(r.timings.ttft_ms)
                host_tokens = r.usage.host_cached_prompt_tokens
            s = c.stats()
            # every namespace's blocks written to disk before the restart
            while s.disk_cache_pending:
                time.sleep(0.05)
                s = c.stats()
        k.stop()
        subprocess.run(["rm", "-f", f"/dev/shm/{pools[0]}"], check=False)
        disk = []
        dropped = False
        for run in range(args.runs):
            dropped = drop_page_cache()
            k = start(args, tmp / f"k2-{run}", f"{pools[1]}-{run}", cache)
            with kvd_client.Client(k.endpoint, timeout=3600) as c:
                r = ask(c, main_sys, 400 + run, f"cold-{run}")
                if r.usage.disk_cached_prompt_tokens == 0:
                    raise SystemExit(f"bench-tiers: nothing came from disk after the restart: {r.usage}")
                disk.append(r.timings.ttft_ms)
                disk_tokens = r.usage.disk_cached_prompt_tokens
            k.stop()
        med = {name: statistics.median(v) for name, v in
               (("cold", cold), ("pool", pool), ("host", host), ("disk", disk))}
        per_k = {
            "cold": (med["cold"] - med["pool"]) / prompt * 1000,
            "host": (med["host"] - med["pool"]) / host_tokens * 1000,
            "disk": (med["disk"] - med["pool"]) / disk_tokens * 1000,
        }
        print(f"bench-tiers: {args.model.name}, a system prompt of {prompt} tokens, kvd --kv-memory "
              f"{args.kv_memory} --host-cache 1GiB --cache-dir (page cache "
              f"{'dropped before each disk run' if dropped else 'not dropped: not root'}), "
              f"{args.threads} threads, median of {args.runs}")
        print("| prefix | TTFT ms | against cold | ms per 1,000 prompt tokens |")
        print("|---|---|---|---|")
        for name, label in (("cold", "computed (cold)"), ("pool", "in the pool"),
                            ("host", "host tier (evicted from the pool)"),
                            ("disk", "disk tier (after a kvd restart)")):
            extra = f"{per_k[name]:.2f} ({'compute' if name == 'cold' else 'restore'})" if name in per_k else "-"
            print(f"| {label} | {med[name]:.1f} | {med['cold'] / med[name]:.1f}x lower | {extra} |")
        print(f"disk tier after a restart vs cold: {med['cold'] / med['disk']:.1f}x lower (target >= 10x)")
        rows = {"ttft_ms": med, "per_1000_ms": per_k, "prompt_tokens": prompt,
                "page_cache_dropped": dropped}
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        if args.plot:
            plot.bars(args.plot / "tiers.png",
                      f"TTFT of a {prompt:,}-token system prompt, by where it is",
                      "TTFT (ms, log scale)",
                      {"computed": med["cold"], "pool": med["pool"], "host tier": med["host"],
                       "disk tier\n(after restart)": med["disk"]}, logy=True,
                      note=f"{args.model.stem}, 1 worker x {args.threads} threads, median of {args.runs}; "
                           + plot.machine_note())
    finally:
        for p in pools + [f"{pools[1]}-{i}" for i in range(args.runs)]:
            subprocess.run(["rm", "-f", f"/dev/shm/{p}"], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
