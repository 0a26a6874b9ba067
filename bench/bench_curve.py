#!/usr/bin/env python3
"""What CURVE costs a client of kvd over tcp://: the same kvd, once with
--insecure (plain tcp) and once with --curve-secret and --clients-allow
(every message encrypted and authenticated), side by side in one run.

Measured from the Python client, default model, one worker:
  - a cached 1-token request: the same short prompt again and again
    (max_tokens 1; after the first, its prefix is in the pool), median and
    p99 of --requests round trips;
  - a stream: --stream-tokens tokens (greedy, ignore_eos), tokens per second
    from the first chunk to the last, median of --streams;
each mode --rounds times in alternation (one kvd per run), medians over them.

    python3 bench/bench_curve.py [--bin-dir build] [--model M] [--requests 200] [--streams 3]
                                 [--stream-tokens 256] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import kvd_client
from kvdbench import Kvd, free_port

ROOT = Path(__file__).resolve().parents[1]


def run(args: argparse.Namespace, tmp: Path, curve: bool) -> dict:
    work = tmp / ("curve" if curve else "plain")
    work.mkdir(parents=True)
    ep = f"tcp://127.0.0.1:{free_port()}"
    extra = ["--listen", ep, "-w", "1", "-t", str(args.threads), "--kv-memory", "64MiB"]
    kw: dict[str, str] = {}
    if curve:
        keys, allow = work / "keys", work / "allow"
        keys.mkdir()
        allow.mkdir()
        for name in ("kvd", "bench"):
            subprocess.run([str(args.bin_dir / "kvd-keygen"), "--dir", str(keys), name], check=True,
                           capture_output=True)
        shutil.copy(keys / "bench.key", allow / "bench.key")
        extra += ["--curve-secret", str(keys / "kvd.key_secret"), "--clients-allow", str(allow)]
        kw = {"server_key": str(keys / "kvd.key"), "cert": str(keys / "bench.key_secret")}
    else:
        extra += ["--insecure"]
    k = Kvd(args.bin_dir, args.model, work, extra)
    try:
        with kvd_client.Client(ep, timeout=600, **kw) as c:
            c.generate("The capital of France is", max_tokens=1, temperature=0)     # cached from here on
            lat = []
            for _ in range(args.requests):
                t = time.perf_counter()
                r = c.generate("The capital of France is", max_tokens=1, temperature=0)
                lat.append((time.perf_counter() - t) * 1000)
                assert r.usage.cached_prompt_tokens > 0 or r.usage.prompt_tokens < 16
            rates = []
            for _ in range(args.streams):
                times = []
                with c.stream("Write a long story about a lighthouse keeper.", max_tokens=args.stream_tokens,
                              temperature=0, ignore_eos=True) as st:
                    n = 0
                    for chunk in st:
                        times.append(time.perf_counter())
                        n += len(chunk.token_ids)
                rates.append((n - 1) / (times[-1] - times[0]))
        lat.sort()
        return {"mode": "curve" if curve else "plain", "latency_median_ms": statistics.median(lat),
                "latency_p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                "stream_tok_s": statistics.median(rates)}
    finally:
        k.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="kvd runs per mode, alternating (medians over them)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-curve-"))
    tmp.chmod(0o700)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    try:
        for i in range(args.rounds):
            for curve in ((False, True) if i % 2 == 0 else (True, False)):
                runs[curve].append(run(args, tmp / f"round{i}", curve))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [{"mode": runs[c][0]["mode"],
             **{key: statistics.median(r[key] for r in runs[c])
                for key in ("latency_median_ms", "latency_p99_ms", "stream_tok_s")}} for c in (False, True)]
    plain, curve = rows
    print(f"bench-curve: {args.model.name}, kvd over tcp://127.0.0.1, 1 worker x {args.threads} threads; "
          f"{args.requests} cached 1-token requests, {args.streams} streams of {args.stream_tokens} tokens; "
          f"{args.rounds} kvd runs per mode, alternating, medians")
    print("| tcp:// | cached 1-token request median ms | p99 ms | streamed tok/s |")
    print("|---|---|---|---|")
    for r in rows:
        label = "plain (--insecure)" if r["mode"] == "plain" else "CURVE (--curve-secret)"
        print(f"| {label} | {r['latency_median_ms']:.2f} | {r['latency_p99_ms']:.2f} | {r['stream_tok_s']:.1f} |")
    print(f"CURVE/plain: latency x{curve['latency_median_ms'] / plain['latency_median_ms']:.2f}, "
          f"stream x{curve['stream_tok_s'] / plain['stream_tok_s']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
