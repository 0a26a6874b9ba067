#!/usr/bin/env python3
"""What quantized KV blocks cost and buy, for one model, as three tables (markdown).

Quality (kvd-run --perplexity --kl-divergence): the log-probabilities of every scored position of
llama.cpp's perplexity protocol (windows of --ctx tokens, the second half of each scored) are saved
with the f16 cache, then compared with each other KV type: mean and 99th percentile of the KL
divergence KL(f16 || type), the share of positions whose most likely token is unchanged, and the
perplexity's change. Two contexts: 512 on tests/data/ppl_text.txt and 4,096 on the GPL-3, LGPL-2.1
and GFDL-1.3 texts Debian ships in /usr/share/common-licenses (about 18,000 tokens of English;
--long-text to use another file). Error grows with context, so the 4,096 row is the one that counts.

Capacity (kvd-calc): concurrent sequences of 4,096 tokens that a 1 GiB pool holds, per type.

Speed (kvd-run --bench --bench-ctx 4096): decode tokens/s at batch 1 and 8 after 4,096 tokens of
context, per type, and the ratio to f16 (attention reads fewer bytes from a quantized cache).

The llama.cpp columns of the issue (its own quantized cache, side by side) are not measured here:
they need llama-cpp-python, which compiles llama.cpp (see bench_cpu.py).

    python3 bench/bench_kv.py [--kvd-run build/kvd-run] [--kvd-calc build/kvd-calc]
                              [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--threads 2]
                              [--chunks 2] [--skip-quality] [--skip-speed] [--json OUT]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LICENSES = ["GPL-3", "LGPL-2.1", "GFDL-1.3"]

# (label, kvd-run flags) for each type compared with f16
TYPES = [
    ("f32", ["--kv-type", "f32"]),
    ("q8_0 (rotated)", ["--kv-type", "q8_0"]),
    ("q8_0", ["--kv-type", "q8_0", "--kv-rotate", "off"]),
    ("K f16, V q4_0 (rotated)", ["--v-type", "q4_0"]),
    ("q4_0 (rotated)", ["--kv-type", "q4_0"]),
    ("q4_0", ["--kv-type", "q4_0", "--kv-rotate", "off"]),
]
SPEED_TYPES = [("f16", [])] + [t for t in TYPES if t[0] != "f32"]


def run_json(cmd):
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def quality(args, text, ctx, tmp):
    base = os.path.join(tmp, f"f16-{ctx}.kld")
    common = [args.kvd_run, "-m", args.model, "-t", str(args.threads), "--perplexity", text,
              "--ctx", str(ctx), "--chunks", str(args.chunks), "--json"]
    b = run_json(common + ["--kl-divergence-base", base])
    rows = []
    for label, flags in TYPES:
        r = run_json(common + ["--kl-divergence", base] + flags)
        r["label"] = label
        rows.append(r)
        print(f"  ctx {ctx} {label}: KLD {r['kld_mean']:.5f}", file=sys.stderr)
    os.unlink(base)
    return {"ctx": ctx, "perplexity_f16": b["perplexity"], "positions": b["tokens_scored"], "rows": rows}


def capacity(args):
    rows = []
    for label, flags in SPEED_TYPES:
        r = run_json([args.kvd_calc, "-m", args.model, "--ctx", "4096", "--kv-memory", "1GiB", "--json"] + flags)
        rows.append({"label": label, "bytes_per_token": r["bytes_per_token"], "sequences": r["pool"]["sequences"]})
    return rows


def speed(args):
    rows = []
    for label, flags in SPEED_TYPES:
        r = run_json([args.kvd_run, "-m", args.model, "-t", str(args.threads), "--bench", "--bench-ctx", "4096",
                      "--json"] + flags)
        rows.append({"label": label, "isa": r["isa"], "b1": r["decode"][0]["tokens_per_s"],
                     "b8": r["decode"][1]["tokens_per_s"]})
        print(f"  speed {label}: {rows[-1]['b1']:.1f} / {rows[-1]['b8']:.1f} tok/s", file=sys.stderr)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvd-run", default=os.path.join(ROOT, "build", "kvd-run"))
    ap.add_argument("--kvd-calc", default=os.path.join(ROOT, "build", "kvd-calc"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=2, help="windows per context (default 2)")
    ap.add_argument("--long-text", help="text for the 4,096 context (default: Debian's license texts)")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    result = {"cpu": "", "threads": args.threads}
    try:
        with open("/proc/cpuinfo") as f:
            result["cpu"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_quality:
            long_text = args.long_text
            if long_text is None:
                long_text = os.path.join(tmp, "licenses.txt")
                with open(long_text, "w") as out:
                    for name in LICENSES:
                        with open(os.path.join("/usr/share/common-licenses", name)) as f:
                            out.write(f.read() + "\n")
            result["quality"] = [quality(args, os.path.join(ROOT, "tests", "data", "ppl_text.txt"), 512, tmp),
                                 quality(args, long_text, 4096, tmp)]
        result["capacity"] = capacity(args)
        if not args.skip_speed:
            result["speed"] = speed(args)

    print(f"CPU: {result['cpu']}, {args.threads} threads\n")
    for q in result.get("quality", []):
        print(f"Quality at ctx {q['ctx']} ({q['positions']} positions, f16 perplexity {q['perplexity_f16']:.4f}):\n")
        print("| K/V against f16 | mean KLD | p99 KLD | same top-1 | perplexity |")
        print("|---|---|---|---|---|")
        for r in q["rows"]:
            print(f"| {r['label']} | {r['kld_mean']:.5f} | {r['kld_p99']:.5f} | {r['same_top1_pct']:.2f}% "
                  f"| {r['perplexity_delta_pct']:+.2f}% |")
        print()
    f16 = result["capacity"][0]
    print("Capacity, 4,096-token sequences in a 1 GiB pool:\n")
    print("| K/V | bytes per token | sequences | against f16 |")
    print("|---|---|---|---|")
    for r in result["capacity"]:
        print(f"| {r['label']} | {r['bytes_per_token']} | {r['sequences']} | {r['sequences'] / f16['sequences']:.2f}x |")
    print()
    if "speed" in result:
        s16 = result["speed"][0]
        print(f"Decode after 4,096 tokens of context ({s16['isa']}, tokens/s):\n")
        print("| K/V | batch 1 | against f16 | batch 8 | against f16 |")
        print("|---|---|---|---|---|")
        for r in result["speed"]:
            print(f"| {r['label']} | {r['b1']:.1f} | {r['b1'] / s16['b1']:.2f}x | {r['b8']:.1f} | "
                  f"{r['b8'] / s16['b8']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
