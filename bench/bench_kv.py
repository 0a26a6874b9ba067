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

--llama adds llama.cpp's columns to the quality tables: the same measurement of llama.cpp's own
quantized cache (llama-cpp-python: type_k / type_v, flash attention on, as its quantized V cache
requires), on the same model file, text and windows, each type against llama.cpp's own f16 cache,
with the base log-probabilities rounded to f16 as kvd-run stores them. llama.cpp rotates quantized
halves too (its default); its unrotated rows run with LLAMA_ATTN_ROT_DISABLE=1. It needs llama-cpp-python
and numpy (`pip install llama-cpp-python numpy`; the install compiles llama.cpp, tens of minutes on
two cores), in the Python that runs this script.

    python3 bench/bench_kv.py [--kvd-run build/kvd-run] [--kvd-calc build/kvd-calc]
                              [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--threads 2]
                              [--chunks 2] [--llama] [--skip-quality] [--skip-speed] [--json OUT]
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
    ("K f16, V q4_0 (rotated)", ["--kv-type", "f16", "--v-type", "q4_0"]),
    ("q4_0 (rotated)", ["--kv-type", "q4_0"]),
    ("q4_0", ["--kv-type", "q4_0", "--kv-rotate", "off"]),
]
SPEED_TYPES = [("f16", ["--kv-type", "f16"])] + [t for t in TYPES if t[0] != "f32"]

# llama.cpp's ggml type ids, and its configuration beside each of kvd's rows: (type_k, type_v,
# rotated). llama.cpp rotates quantized K and V by a Hadamard transform by default as well
# (attn_rot_k / attn_rot_v); LLAMA_ATTN_ROT_DISABLE=1 turns that off, for the unrotated rows.
GGML_F16, GGML_Q4_0, GGML_Q8_0 = 1, 2, 8
LLAMA_TYPES = {
    "q8_0 (rotated)": (GGML_Q8_0, GGML_Q8_0, True),
    "q8_0": (GGML_Q8_0, GGML_Q8_0, False),
    "K f16, V q4_0 (rotated)": (GGML_F16, GGML_Q4_0, True),
    "q4_0 (rotated)": (GGML_Q4_0, GGML_Q4_0, True),
    "q4_0": (GGML_Q4_0, GGML_Q4_0, False),
}


def llama_key(label):
    """The llama.cpp configuration beside kvd's row `label` (None for f32)."""
    return label if label in LLAMA_TYPES else None


def llama_worker(spec):
    """Runs in its own process: llama.cpp's KLD of each type pair in spec against its f16 cache."""
    import numpy as np
    import llama_cpp

    with open(spec["text"], "rb") as f:
        text = f.read()
    ctx, chunks, first = spec["ctx"], spec["chunks"], spec["ctx"] // 2

    def make(tk, tv):
        return llama_cpp.Llama(model_path=spec["model"], n_ctx=ctx, n_batch=512, n_ubatch=512,
                               n_threads=spec["threads"], n_threads_batch=spec["threads"], logits_all=True,
                               flash_attn=True, type_k=tk, type_v=tv, verbose=False)

    def log_probs(llm, ids):
        """Per window: the log-probabilities (float64) of the scored positions and their targets."""
        bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
        for k in range(chunks):
            w = list(ids[k * ctx:(k + 1) * ctx])
            if bos:
                w[0] = llm.token_bos()
            llm.reset()
            llm.eval(w)
            logits = np.asarray(llm.scores[first:ctx - 1], dtype=np.float64)
            m = logits.max(axis=1, keepdims=True)
            lp = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
            yield lp, np.asarray(w[first + 1:ctx])

    base = make(GGML_F16, GGML_F16)
    ids = base.tokenize(text, add_bos=False, special=False)
    n_win = len(ids) // ctx
    chunks = min(chunks, n_win) if chunks > 0 else n_win
    base_lp, nll_base = [], 0.0
    for lp, tgt in log_probs(base, ids):
        nll_base -= lp[np.arange(len(tgt)), tgt].sum()
        base_lp.append(lp.astype(np.float16))   # stored as kvd-run stores its base
    del base
    positions = sum(len(b) for b in base_lp)
    out = {"tokens": len(ids), "positions": positions, "perplexity_f16": float(np.exp(nll_base / positions)),
           "rows": {}}
    for key in spec["types"]:
        tk, tv, rotated = LLAMA_TYPES[key]
        if rotated:
            os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
        else:
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
        llm = make(tk, tv)
        klds, same, nll = [], 0, 0.0
        for (lp, tgt), b16 in zip(log_probs(llm, ids), base_lp):
            b = b16.astype(np.float64)
            bm = b.max(axis=1, keepdims=True)
            lb = b - bm - np.log(np.exp(b - bm).sum(axis=1, keepdims=True))
            klds.append(np.maximum((np.exp(lb) * (lb - lp)).sum(axis=1), 0.0))
            same += int((b16.argmax(axis=1) == lp.argmax(axis=1)).sum())
            nll -= lp[np.arange(len(tgt)), tgt].sum()
        del llm
        kld = np.sort(np.concatenate(klds))
        ppl = float(np.exp(nll / positions))
        out["rows"][key] = {"kld_mean": float(kld.mean()), "kld_p99": float(kld[int((len(kld) - 1) * 0.99)]),
                            "same_top1_pct": 100.0 * same / positions, "perplexity": ppl,
                            "perplexity_delta_pct": 100.0 * (ppl / out["perplexity_f16"] - 1.0)}
        print(f"  llama.cpp ctx {ctx} {key}: KLD {out['rows'][key]['kld_mean']:.5f}", file=sys.stderr)
    return out


def llama_quality(args, text, ctx):
    spec = {"model": args.model, "text": text, "ctx": ctx, "chunks": args.chunks, "threads": args.threads,
            "types": list(LLAMA_TYPES)}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--llama-worker", json.dumps(spec)],
                         check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_json(cmd):
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def quality(args, text, ctx, tmp):
    base = os.path.join(tmp, f"f16-{ctx}.kld")
    common = [args.kvd_run, "-m", args.model, "-t", str(args.threads), "--perplexity", text,
              "--ctx", str(ctx), "--chunks", str(args.chunks), "--json"]
    b = run_json(common + ["--kl-divergence-base", base, "--kv-type", "f16"])  # not kvd's auto
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
    ap.add_argument("--llama", action="store_true", help="add llama.cpp's columns (needs llama-cpp-python)")
    ap.add_argument("--llama-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_worker:
        print(json.dumps(llama_worker(json.loads(args.llama_worker))))
        return

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
            texts = [(os.path.join(ROOT, "tests", "data", "ppl_text.txt"), 512), (long_text, 4096)]
            result["quality"] = [quality(args, text, ctx, tmp) for text, ctx in texts]
            if args.llama:
                for q, (text, ctx) in zip(result["quality"], texts):
                    q["llama"] = llama_quality(args, text, ctx)
        result["capacity"] = capacity(args)
        if not args.skip_speed:
            result["speed"] = speed(args)

    print(f"CPU: {result['cpu']}, {args.threads} threads\n")
    for q in result.get("quality", []):
        print(f"Quality at ctx {q['ctx']} ({q['positions']} positions, f16 perplexity {q['perplexity_f16']:.4f}):\n")
        lq = q.get("llama")
        if lq is None:
            print("| K/V against f16 | mean KLD | p99 KLD | same top-1 | perplexity |")
            print("|---|---|---|---|---|")
        else:
            print(f"(llama.cpp: {lq['positions']} positions, its f16 perplexity {lq['perplexity_f16']:.4f})\n")
            print("| K/V against f16 | mean KLD | p99 KLD | same top-1 | perplexity "
                  "| llama.cpp mean KLD | p99 KLD | same top-1 | perplexity | KLD kvd / llama.cpp |")
            print("|---|---|---|---|---|---|---|---|---|---|")
        for r in q["rows"]:
            line = (f"| {r['label']} | {r['kld_mean']:.5f} | {r['kld_p99']:.5f} | {r['same_top1_pct']:.2f}% "
                    f"| {r['perplexity_delta_pct']:+.2f}% |")
            if lq is not None:
                key = llama_key(r["label"])
                lr = lq["rows"].get(key) if key else None
                if lr is None:
                    line += " – | – | – | – | – |"
                else:
                    line += (f" {lr['kld_mean']:.5f} | {lr['kld_p99']:.5f} | {lr['same_top1_pct']:.2f}% "
                             f"| {lr['perplexity_delta_pct']:+.2f}% | {r['kld_mean'] / lr['kld_mean']:.2f} |")
            print(line)
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
