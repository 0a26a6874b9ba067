#!/usr/bin/env python3
"""Two hosts against one, and dispatch by cached prefix against round-robin,
on a shared-prompt load, side by side in one run.

Each "host" is a kvd-worker started with --host NAME and a pool of its own
(--kv-memory per host), reaching kvd over tcp:// on loopback; kvd runs no
worker of its own (-w 0). Three runs, one kvd each:

  one host              1 worker, its pool
  two hosts, round-robin  2 workers, a pool each; each request to the next free worker
  two hosts, by prefix    the same; each request to the host whose pool holds most of it

The load: --prompts system prompts of some 700 tokens, more than one host's
pool holds at once, each asked --questions different short questions, in a
seeded random order, by --clients concurrent clients; --max-tokens greedy
tokens each. Printed: wall time, requests/s, generated tokens/s, prompt
tokens/s (computed and cached, all that was served), the hit rate (cached
prompt tokens / prompt tokens), and each run's ratio to one host. On a
machine of few cores the hosts share its cores: a second host adds a pool
more than it adds compute.

    python3 bench/bench_hosts.py [--bin-dir build] [--model M] [--prompts 4] [--questions 8]
                                 [--clients 4] [--max-tokens 8] [--kv-memory 40MiB] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import kvd_client
from kvdbench import Kvd, free_port

ROOT = Path(__file__).resolve().parents[1]


def system_prompt(p: int) -> str:
    return " ".join(
        f"Clause {p}.{i}: for customers of region {p}, item {i} ships within {(p * 7 + i) % 9 + 1} days "
        f"and may be returned within {(p + i) % 30 + 10} days."
        for i in range(1, 24)
    )


def load(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    rng = random.Random(1234)
    reqs = [
        [{"role": "system", "content": system_prompt(p)},
         {"role": "user", "content": f"Question {q}: when does item {q + 3} ship?"}]
        for p in range(args.prompts) for q in range(args.questions)
    ]
    rng.shuffle(reqs)
    return reqs


def run(args: argparse.Namespace, tmp: Path, n_hosts: int, dispatch: str) -> dict:
    work = tmp / f"{n_hosts}-{dispatch}"
    work.mkdir(parents=True)
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    tag = uuid.uuid4().hex[:8]
    workers = []
    for i in range(n_hosts):
        log = open(work / f"worker{i}.log", "wb")
        workers.append(subprocess.Popen(
            [str(args.bin_dir / "kvd-worker"), "--model", str(args.model), "--pool", f"kvdbench-{tag}-{i}",
             "--connect", ep, "--id", str(i + 1), "--host", f"h{i}", "--kv-memory", args.kv_memory,
             "--threads", str(args.threads), "--ctx", "2048"],
            stdout=log, stderr=subprocess.STDOUT))
        log.close()
    kvd = Kvd(args.bin_dir, args.model, work / "kvd",
              ["-w", "0", "--kv-memory", "16MiB", "--ctx", "2048", "--worker-endpoint", ep, "--insecure",
               "--dispatch", dispatch])
    try:
        with kvd_client.Client(kvd.endpoint, timeout=600) as c:
            for _ in range(600):
                if sum(1 for h in c.stats().hosts if h.name and h.workers) == n_hosts:
                    break
                time.sleep(0.1)
        reqs = load(args)
        lock = threading.Lock()
        done = {"gen": 0, "prompt": 0, "cached": 0, "n": 0}

        def client(part: list[list[dict[str, str]]]) -> None:
            with kvd_client.Client(kvd.endpoint, timeout=600) as cc:
                for msgs in part:
                    r = cc.generate(messages=msgs, max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
                    with lock:
                        done["gen"] += r.usage.completion_tokens
                        done["prompt"] += r.usage.prompt_tokens
                        done["cached"] += r.usage.cached_prompt_tokens
                        done["n"] += 1

        parts = [reqs[i::args.clients] for i in range(args.clients)]
        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(p,)) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        with kvd_client.Client(kvd.endpoint, timeout=60) as c:
            hosts = [(h.name, h.requests, h.cached_prompt_tokens, h.prompt_tokens) for h in c.stats().hosts if h.name]
        return {
            "hosts": n_hosts, "dispatch": dispatch, "wall_s": wall, "requests": done["n"],
            "req_per_s": done["n"] / wall, "gen_tok_per_s": done["gen"] / wall,
            "prompt_tok_per_s": done["prompt"] / wall,
            "hit_rate": done["cached"] / done["prompt"] if done["prompt"] else 0.0, "per_host": hosts,
        }
    finally:
        kvd.stop()
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build")
    ap.add_argument("--model", type=Path, default=ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="threads per worker")
    ap.add_argument("--kv-memory", default="40MiB", help="each host's pool")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvd-bench-hosts-") as t:
        tmp = Path(t)
        tmp.chmod(0o700)
        runs = [run(args, tmp, 1, "prefix"), run(args, tmp, 2, "round-robin"), run(args, tmp, 2, "prefix")]
    base = runs[0]
    print(f"{args.prompts} system prompts x {args.questions} questions, {args.clients} clients, "
          f"{args.max_tokens} tokens each; a pool of {args.kv_memory} per host, {args.threads} thread(s) "
          "per worker")
    print(f"{'run':<24} {'wall s':>8} {'req/s':>7} {'gen tok/s':>10} {'prompt tok/s':>13} {'hit rate':>9} "
          f"{'req/s vs one':>13}")
    for r in runs:
        name = "one host" if r["hosts"] == 1 else f"two hosts, {r['dispatch']}"
        print(f"{name:<24} {r['wall_s']:>8.1f} {r['req_per_s']:>7.2f} {r['gen_tok_per_s']:>10.1f} "
              f"{r['prompt_tok_per_s']:>13.0f} {100 * r['hit_rate']:>8.1f}% "
              f"{r['req_per_s'] / base['req_per_s']:>12.2f}x")
    for r in runs:
        print(f"  {r['hosts']} host(s), {r['dispatch']}: requests, cached / prompt tokens per host: "
              + ", ".join(f"{n} {q} ({c}/{p})" for n, q, c, p in r["per_host"]))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
