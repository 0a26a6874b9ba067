#!/usr/bin/env python3
"""Whether copying prefixes back from the tiers holds up other requests'
decoding: kvd's restore thread (the default) against copies made on kvd's own
loop (KVD_TIER_SYNC=1), side by side in one run.

For each mode, a first kvd computes --prompts system prompts of about
--tokens tokens each with --cache-dir set (the disk tier writes them behind)
and stops. A second kvd starts on the same directory with a new pool (the
page cache dropped first where this runs as root), two workers of one thread
each. One request streams --stream-tokens tokens (greedy, ignore_eos); while
it streams, each system prompt is asked again, one after another, so its
prefix is read back from disk. The table gives the streaming request's gaps
between chunks while the restores ran (median, p99, largest) and the
restoring requests' TTFT. Every token of a stream passes through kvd's loop,
so time that loop spends copying shows up as a gap.

    python3 bench/bench_restore_stall.py [--bin-dir build] [--model M] [--prompts 4] [--tokens 2000]
                                         [--stream-tokens 400] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import kvd_client
from kvdbench import Kvd, drop_page_cache

ROOT = Path(__file__).resolve().parents[1]


def start(args: argparse.Namespace, work: Path, pool: str, cache: Path, sync: bool) -> Kvd:
    env = dict(os.environ)
    env.pop("KVD_TIER_SYNC", None)
    if sync:
        env["KVD_TIER_SYNC"] = "1"
    return Kvd(args.bin_dir, args.model, work,
               ["-w", "2", "-t", "1", "--ctx", "4096", "--pool", pool, "--cache-dir", str(cache)], env)


def ask(c: kvd_client.Client, system: str, q: int) -> kvd_client.Result:
    return c.generate(messages=[{"role": "system", "content": system},
                                {"role": "user", "content": f"Question {q}: what is the third word?"}],
                      max_tokens=1, temperature=0)


def pct(v: list[float], p: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def run_mode(args: argparse.Namespace, tmp: Path, systems: list[str], sync: bool) -> dict:
    name = "sync" if sync else "async"
    cache = tmp / f"cache-{name}"
    pools = [f"kvd-bench-stall-{os.getpid()}-{name}-{i}" for i in range(2)]
    try:
        k = start(args, tmp / f"{name}-1", pools[0], cache, sync)
        with kvd_client.Client(k.endpoint, timeout=3600) as c:
            for i, s in enumerate(systems):
                ask(c, s, i)
            while c.stats().disk_cache_pending:
                time.sleep(0.05)
        k.stop()
        dropped = drop_page_cache()
        k = start(args, tmp / f"{name}-2", pools[1], cache, sync)
        arrivals: list[float] = []
        started = threading.Event()

        def streamer() -> None:
            with kvd_client.Client(k.endpoint, timeout=3600) as c:
                with c.stream("Write a long story about a lighthouse keeper.", max_tokens=args.stream_tokens,
                              temperature=0, ignore_eos=True) as st:
                    for _ in st:
                        arrivals.append(time.monotonic())
                        if len(arrivals) == 20:
                            started.set()
            started.set()

        th = threading.Thread(target=streamer)
        th.start()
        started.wait()
        ttft, from_disk = [], 0
        with kvd_client.Client(k.endpoint, timeout=3600) as c:
            t0 = time.monotonic()
            for i, s in enumerate(systems):
                r = ask(c, s, 100 + i)
                ttft.append(r.timings.ttft_ms)
                from_disk += r.usage.disk_cached_prompt_tokens
            t1 = time.monotonic()
        th.join()
        k.stop()
        gaps = [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:]) if b >= t0 and a <= t1]
        if from_disk == 0 or len(gaps) < 5:
            raise SystemExit(f"bench-restore-stall: {name}: nothing read back from disk, or the stream "
                             f"ended before the restores ({from_disk} tokens, {len(gaps)} gaps)")
        return {"mode": name, "gap_median_ms": statistics.median(gaps), "gap_p99_ms": pct(gaps, 99),
                "gap_max_ms": max(gaps), "gaps": len(gaps), "restore_ttft_median_ms": statistics.median(ttft),
                "disk_tokens": from_disk, "page_cache_dropped": dropped}
    finally:
        for p in pools:
            subprocess.run(["rm", "-f", f"/dev/shm/{p}"], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    words = (ROOT / "tests" / "data" / "ppl_text.txt").read_text().split()
    n_words = int(args.tokens * 0.88)       # about 1.14 tokens a word in this text
    systems = [f"[stall {i}] " + " ".join(words[(i * 1499 + j) % len(words)] for j in range(n_words))
               for i in range(args.prompts)]
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-stall-"))
    try:
        rows = [run_mode(args, tmp, systems, sync) for sync in (True, False)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"bench-restore-stall: {args.model.name}, {args.prompts} system prompts of ~{args.tokens} tokens read "
          f"back from disk after a restart (page cache "
          f"{'dropped' if rows[0]['page_cache_dropped'] else 'not dropped: not root'}) while another request "
          f"streams; 2 workers x 1 thread")
    print("| copies made | stream gap median ms | p99 ms | largest ms | restoring TTFT median ms | tokens from disk |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        label = "on kvd's loop (KVD_TIER_SYNC=1)" if r["mode"] == "sync" else "on the restore thread"
        print(f"| {label} | {r['gap_median_ms']:.1f} | {r['gap_p99_ms']:.1f} | {r['gap_max_ms']:.1f} | "
              f"{r['restore_ttft_median_ms']:.1f} | {r['disk_tokens']} |")
    print(f"largest gap: {rows[0]['gap_max_ms'] / rows[1]['gap_max_ms']:.2f}x smaller on the restore thread")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
