#!/usr/bin/env python3
"""kvd's CPU engine against llama.cpp, side by side: prefill, single-sequence decode, batch decode.

What it measures: kvd-run --bench and the same procedure run on llama.cpp (through the
llama-cpp-python package), on the same model file, with the same thread count and the same text.
Each round runs kvd once, then llama.cpp once (each in a fresh process); after all rounds it prints
the medians and their ratios (kvd / llama.cpp), with the CPU model and the thread count.

    warm-up           32 tokens from an empty cache, not timed, then forgotten (faults the weights in)
    prefill 512       tokenize the text (no BOS, special tokens parsed), take its first 512 tokens
                      (the token list repeated if shorter), run them as one step of 512 from an empty
                      cache: 512 / time
    decode b1, 128    then 128 greedy steps (argmax of the last logits fed back), one token at a
                      time, continuing that sequence: 128 / time
    batch decode bB   for B in 1, 8, 32: B sequences, sequence i's prompt the 128 tokens starting at
                      token 16*i (wrapping), prefilled (not timed); then 64 steps, each feeding one
                      greedy token per sequence, all B in one batch: B*64 / time
    resident memory   kvd: rss_mib of its JSON; llama.cpp: the worker process's VmRSS after the whole
                      run (model, both contexts, all weights touched) minus VmRSS before loading
    decode b1 / floor kvd's decode b1 over the batch-1 floor of `bench-ceiling -b` run right after
                      it on the same path (the weights a step reads / the read bandwidth over that
                      many bytes, as measured that minute); each round's ratio, then the median

llama.cpp runs with n_batch = n_ubatch = 512, an f16 KV cache, n_threads = n_threads_batch = N;
prefill and decode b1 go through llama_cpp.Llama (n_ctx 1024), batch decode through the low-level
API (llama_batch_init / llama_decode, one llama_decode per step for all B sequences) on a second
context of the same model with n_seq_max 32 and n_ctx 8192 (32 per-sequence KV streams of 256
cells, llama.cpp's smallest; one unified buffer with --llama-kv-unified, slower here). Flash
attention is off unless --llama-flash-attn (llama-cpp-python's default, and faster here at decode;
kvd's attention materialises the scores too). Greedy tokens are checked, not timed: sequence 0 of
every batch size should continue the same way (batch_seq0_agreement_with_b1 in the JSON).

Not part of CI: it needs llama-cpp-python (which compiles llama.cpp on install, tens of minutes on
two cores) and numpy, and it prints times, which tests never assert on. Machines are noisy: trust
the ratios more than the absolute numbers, and run nothing else meanwhile.

--kvd-paths LIST runs kvd on each of several kernel paths in every round (e.g. avx512vnni,
avx2+avxvnni,avx2 on a CPU that has them all: KVD_ISA and KVD_AVXVNNI select the lower ones) against
the same llama.cpp runs, and prints a table for each; kvd-run must report the path asked for.

--kv-ctx N measures something else: decode at batch 1 and 8 after N tokens of context (e.g. 4096),
for each KV cache type of --kv-types (default f16,q8_0,q4_0; K and V the same type), kvd (kvd-run
--bench --bench-ctx N --kv-type T) against llama.cpp (type_k = type_v = T, flash attention on for
every type, as llama.cpp's quantized V cache requires): sequence b's context is the N tokens from
token 16*b of the text (wrapping), prefilled, not timed; then 32 steps at batch 1 and 16 at batch 8,
one token per sequence per step, timed. kvd rotates its q4_0 blocks (its default); llama.cpp has no
rotation.

    pip install llama-cpp-python numpy
    python3 bench/bench_cpu.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--threads 2]
                               [--rounds 3] [--kvd build/kvd-run] [--text tests/data/ppl_text.txt]
                               [--json OUT] [--only-llama | --only-kvd]
                               [--kvd-paths avx512vnni,avx2+avxvnni,avx2]
                               [--kv-ctx N [--kv-types f16,q8_0,q4_0]]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WARMUP = 32
PREFILL = 512
DECODE_B1 = 128
BATCHES = (1, 8, 32)
BATCH_PROMPT = 128
BATCH_STRIDE = 16
BATCH_STEPS = 64
N_BATCH = 512
SEED = 1234
LLAMA_CTX = 1024                      # >= PREFILL + DECODE_B1
LLAMA_BATCH_SEQ_CTX = 256             # cells per sequence in the batch context (>= 128 + 64; llama.cpp
                                      # pads a stream to a multiple of 256)
WORKER_TIMEOUT_S = 1800
QUIET_BUSY = 0.15                     # CPU fraction above which the machine is not idle


# ---------------------------------------------------------------- shared helpers

def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


#: the CPU features the kernels choose a path by (and those a future path would use)
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "amx_int8", "asimddp", "i8mm")


def cpu_flags():
    """The kernel-relevant features /proc/cpuinfo lists for the first CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in KERNEL_FLAGS if x in have]
    except OSError:
        pass
    return []


def vm_rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def cpu_busy(seconds=1.0):
    """Fraction of all CPUs busy over the next `seconds` (/proc/stat), or None."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v), idle
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (i1 - i0) / (t1 - t0) if t1 > t0 else None


def wait_quiet(max_wait_s, who):
    """Waits (up to max_wait_s) until the machine is idle; returns the last busy fraction seen.
    Another process on the CPUs makes both sides slow, llama.cpp's spinning OpenMP threads very."""
    deadline = time.monotonic() + max_wait_s
    busy = cpu_busy()
    while busy is not None and busy > QUIET_BUSY and time.monotonic() < deadline:
        busy = cpu_busy(2.0)
    if busy is not None and busy > QUIET_BUSY:
        print(f"warning: the CPUs are {busy:.0%} busy before the {who} run; its numbers are suspect",
              file=sys.stderr, flush=True)
    return busy


def parse_json_output(text, who):
    """The one JSON object a run printed (tolerating other lines around it)."""
    s = text.strip()
    try:
        return json.loads(s)
    except ValueError:
        pass
    a, b = s.find("{"), s.rfind("}")
    if a >= 0 and b > a:
        try:
            return json.loads(s[a:b + 1])
        except ValueError:
            pass
    raise RuntimeError(f"{who} printed no JSON object:\n{text[-2000:]}")


def metrics(res):
    """Flat {metric: value} of one run's JSON (kvd's schema; the llama.cpp worker prints the same)."""
    m = {
        "prefill_tokens_per_s": res.get("prefill_tokens_per_s"),
        "decode_b1_tokens_per_s": res.get("decode_b1_tokens_per_s"),
        "rss_mib": res.get("rss_mib"),
    }
    for row in res.get("batch_decode") or []:
        m[f"batch_b{row['batch']}_tokens_per_s"] = row.get("tokens_per_s")
    b1, b32 = m.get("batch_b1_tokens_per_s"), m.get("batch_b32_tokens_per_s")
    if b1 and b32:
        m["batch_b32_over_b1"] = b32 / b1
    floor, d = res.get("floor_b1_tokens_per_s"), m.get("decode_b1_tokens_per_s")
    if floor and d:
        m["floor_b1_tokens_per_s"] = floor
        m["decode_b1_over_floor"] = d / floor
    return m


def medians(runs):
    keys = []
    for r in runs:
        for k in r:
            if k not in keys:
                keys.append(k)
    out = {}
    for k in keys:
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        out[k] = statistics.median(vals) if vals else None
    return out


# ---------------------------------------------------------------- the llama.cpp side (worker process)

def llama_decode_entries(llama_cpp, bctx, batch, entries):
    """One llama_decode of entries (token, pos, seq, want_logits) through batch."""
    for k, (tok, pos, seq, lg) in enumerate(entries):
        batch.token[k] = tok
        batch.pos[k] = pos
        batch.n_seq_id[k] = 1
        batch.seq_id[k][0] = seq
        batch.logits[k] = 1 if lg else 0
    batch.n_tokens = len(entries)
    rc = llama_cpp.llama_decode(bctx, batch)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")


def llama_worker(a):
    """Runs the benchmark procedure on llama.cpp once; prints one JSON object shaped like kvd's."""
    import ctypes
    import numpy as np
    import llama_cpp

    rss0 = vm_rss_mib()
    N = a.threads
    llm = llama_cpp.Llama(
        model_path=a.model, n_ctx=LLAMA_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH,
        n_threads=N, n_threads_batch=N, seed=SEED, flash_attn=a.llama_flash_attn,
        type_k=llama_cpp.GGML_TYPE_F16, type_v=llama_cpp.GGML_TYPE_F16, verbose=False)
    rss_load = vm_rss_mib()
    n_vocab = llm.n_vocab()
    ctx = llm._ctx.ctx

    with open(a.text, "rb") as f:
        text = f.read()
    toks = llm.tokenize(text, add_bos=False, special=True)
    if not toks:
        raise SystemExit("the text has no tokens")

    def take(start, n):
        return [toks[(start + k) % len(toks)] for k in range(n)]

    def last_logits_argmax():
        p = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.ctypeslib.as_array(p, shape=(n_vocab,)).argmax())

    # warm-up as kvd-run --bench does (fault the weights in): 32 tokens, not timed, then forgotten
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(take(0, WARMUP))

    # prefill: one step of 512 from an empty cache
    llm.reset()
    llm._ctx.kv_cache_clear()                     # llama_memory_clear(llama_get_memory(ctx), true)
    mem = llama_cpp.llama_get_memory(ctx)
    if llama_cpp.llama_memory_seq_pos_max(mem, 0) != -1:
        raise SystemExit("llama.cpp cache not empty after clear")
    prompt = take(0, PREFILL)
    t0 = time.perf_counter()
    llm.eval(prompt)
    llama_cpp.llama_synchronize(ctx)
    t_prefill = time.perf_counter() - t0
    if llama_cpp.llama_memory_seq_pos_max(mem, 0) != PREFILL - 1:
        raise SystemExit("llama.cpp prefill did not fill the cache as expected")

    # decode b1: 128 greedy single-token steps continuing the sequence
    gen = []
    t0 = time.perf_counter()
    for _ in range(DECODE_B1):
        t = last_logits_argmax()
        gen.append(t)
        llm.eval([t])
    llama_cpp.llama_synchronize(ctx)
    t_decode = time.perf_counter() - t0

    # batch decode: a second context of the same model that holds 32 sequences
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = max(BATCHES) * LLAMA_BATCH_SEQ_CTX
    cp.n_batch = N_BATCH
    cp.n_ubatch = N_BATCH
    cp.n_seq_max = max(BATCHES)
    cp.kv_unified = bool(a.llama_kv_unified)
    cp.n_threads = N
    cp.n_threads_batch = N
    cp.type_k = llama_cpp.GGML_TYPE_F16
    cp.type_v = llama_cpp.GGML_TYPE_F16
    cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if a.llama_flash_attn
                          else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.no_perf = True
    bctx = llama_cpp.llama_init_from_model(llm._model.model, cp)
    if not bctx:
        raise SystemExit("llama_init_from_model failed for the batch context")
    bmem = llama_cpp.llama_get_memory(bctx)
    batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)

    def decode(entries):
        llama_decode_entries(llama_cpp, bctx, batch, entries)

    batch_rows = []
    check = {}
    for B in BATCHES:
        llama_cpp.llama_memory_clear(bmem, True)
        # prefill (not timed), packed n_batch tokens per llama_decode
        entries = []
        for i in range(B):
            p = take(BATCH_STRIDE * i, BATCH_PROMPT)
            entries += [(p[k], k, i, k == BATCH_PROMPT - 1) for k in range(BATCH_PROMPT)]
        nxt = [0] * B
        for s in range(0, len(entries), N_BATCH):
            chunk = entries[s:s + N_BATCH]
            decode(chunk)
            for k, (_, pos, seq, lg) in enumerate(chunk):
                if lg:
                    p = llama_cpp.llama_get_logits_ith(bctx, k)
                    nxt[seq] = int(np.ctypeslib.as_array(p, shape=(n_vocab,)).argmax())
        for i in range(B):
            if llama_cpp.llama_memory_seq_pos_max(bmem, i) != BATCH_PROMPT - 1:
                raise SystemExit(f"batch prefill: sequence {i} has the wrong length")
        # 64 steps, one token per sequence per step, one llama_decode per step
        seqs = [[] for _ in range(B)]
        t0 = time.perf_counter()
        for step in range(BATCH_STEPS):
            decode([(nxt[i], BATCH_PROMPT + step, i, True) for i in range(B)])
            lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits(bctx), shape=(B, n_vocab))
            am = lg.argmax(axis=1)
            for i in range(B):
                seqs[i].append(nxt[i])
                nxt[i] = int(am[i])
        llama_cpp.llama_synchronize(bctx)
        dt = time.perf_counter() - t0
        batch_rows.append({"batch": B, "tokens_per_s": B * BATCH_STEPS / dt})
        check[B] = seqs[0]
    rss_end = vm_rss_mib()
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(bctx)

    # sequence 0 has the same prompt for every B: its greedy tokens should (nearly) agree
    agree = {str(B): sum(x == y for x, y in zip(check[1], check[B])) for B in BATCHES}
    sysinfo = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    print(json.dumps({
        "threads": N,
        "isa": sysinfo,
        "prefill_tokens": PREFILL,
        "prefill_tokens_per_s": PREFILL / t_prefill,
        "decode_b1_tokens": DECODE_B1,
        "decode_b1_tokens_per_s": DECODE_B1 / t_decode,
        "batch_decode": batch_rows,
        "rss_mib": rss_end - rss0,
        "rss_mib_after_load": rss_load - rss0,
        "text_tokens": len(toks),
        "decode_b1_first_tokens": gen[:16],
        "batch_seq0_agreement_with_b1": agree,
        "llama_cpp_python": llama_cpp.__version__,
        "flash_attn": bool(a.llama_flash_attn),
        "kv_unified": bool(a.llama_kv_unified),
    }))


def llama_ctx_worker(a):
    """--kv-ctx: llama.cpp's decode at batch 1 and 8 after a.kv_ctx tokens over a cache of a.kv_type."""
    import numpy as np
    import llama_cpp

    gtype = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
             "q4_0": llama_cpp.GGML_TYPE_Q4_0}[a.kv_type]
    N, ctx_n = a.threads, a.kv_ctx
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=256, n_threads=N, n_threads_batch=N, verbose=False)
    n_vocab = llm.n_vocab()
    with open(a.text, "rb") as f:
        toks = llm.tokenize(f.read(), add_bos=False, special=True)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 8 * (ctx_n + 64)
    cp.n_batch = cp.n_ubatch = N_BATCH
    cp.n_seq_max = 8
    cp.n_threads = cp.n_threads_batch = N
    cp.type_k = cp.type_v = gtype
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    cp.no_perf = True
    bctx = llama_cpp.llama_init_from_model(llm._model.model, cp)
    if not bctx:
        raise SystemExit("llama_init_from_model failed")
    bmem = llama_cpp.llama_get_memory(bctx)
    batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)

    def decode(entries):
        llama_decode_entries(llama_cpp, bctx, batch, entries)

    rows = []
    for B, steps in ((1, 32), (8, 16)):
        llama_cpp.llama_memory_clear(bmem, True)
        nxt = []
        for b in range(B):
            ids = [toks[(16 * b + i) % len(toks)] for i in range(ctx_n)]
            for s0 in range(0, ctx_n, N_BATCH):
                part = ids[s0:s0 + N_BATCH]
                decode([(t, s0 + k, b, s0 + k == ctx_n - 1) for k, t in enumerate(part)])
            p = llama_cpp.llama_get_logits_ith(bctx, len(ids[s0:]) - 1)
            nxt.append(int(np.ctypeslib.as_array(p, shape=(n_vocab,)).argmax()))
        t0 = time.perf_counter()
        for step in range(steps):
            decode([(nxt[b], ctx_n + step, b, True) for b in range(B)])
            lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits(bctx), shape=(B, n_vocab))
            nxt = [int(x) for x in lg.argmax(axis=1)]
        llama_cpp.llama_synchronize(bctx)
        rows.append({"batch": B, "tokens_per_s": B * steps / (time.perf_counter() - t0)})
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(bctx)
    print(json.dumps({"ctx": ctx_n, "kv_type": a.kv_type, "decode": rows,
                      "llama_cpp_python": llama_cpp.__version__}))


def kv_ctx_main(a):
    """--kv-ctx: decode after a long context per KV type, kvd against llama.cpp."""
    types = [t.strip() for t in a.kv_types.split(",") if t.strip()]
    res = {t: {"kvd": [], "llama_cpp": []} for t in types}
    for r in range(a.rounds):
        for t in types:
            if not a.only_llama:
                wait_quiet(a.wait_quiet, "kvd")
                cmd = [a.kvd, "-m", a.model, "--bench", "--bench-ctx", str(a.kv_ctx), "--bench-file", a.text,
                       "-t", str(a.threads), "--kv-type", t, "--json"]
                p, _, wall = run_child(cmd)
                if p.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}:\n{p.stderr[-2000:]}")
                res[t]["kvd"].append(parse_json_output(p.stdout, "kvd-run")["decode"])
                print(f"round {r + 1} {t} kvd: {wall:.0f} s", file=sys.stderr, flush=True)
            if not a.only_kvd:
                wait_quiet(a.wait_quiet, "llama.cpp")
                cmd = [sys.executable, os.path.abspath(__file__), "--llama-ctx-worker", "--model", a.model,
                       "--threads", str(a.threads), "--text", a.text, "--kv-ctx", str(a.kv_ctx), "--kv-type", t]
                p, _, wall = run_child(cmd)
                if p.returncode != 0:
                    raise RuntimeError(f"the llama.cpp worker exited with {p.returncode}:\n{p.stderr[-3000:]}")
                res[t]["llama_cpp"].append(parse_json_output(p.stdout, "the llama.cpp worker")["decode"])
                print(f"round {r + 1} {t} llama.cpp: {wall:.0f} s", file=sys.stderr, flush=True)

    def med(runs, i):
        return statistics.median(x[i]["tokens_per_s"] for x in runs) if runs else None

    print(f"CPU: {cpu_name()}, threads {a.threads}, rounds {a.rounds} (medians); decode after {a.kv_ctx} "
          f"tokens of context, tokens/s")
    print("| K/V | kvd b1 | llama.cpp b1 | kvd/llama.cpp | kvd b8 | llama.cpp b8 | kvd/llama.cpp "
          "| kvd b1 against its f16 | llama.cpp b1 against its f16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = types[0]
    table_rows = {}
    for t in types:
        k1, l1 = med(res[t]["kvd"], 0), med(res[t]["llama_cpp"], 0)
        k8, l8 = med(res[t]["kvd"], 1), med(res[t]["llama_cpp"], 1)
        kb, lb = med(res[base]["kvd"], 0), med(res[base]["llama_cpp"], 0)

        def ratio(x, y):
            return f"{x / y:.2f}x" if x and y else "n/a"
        print(f"| {t} | {fmt(k1)} | {fmt(l1)} | {ratio(k1, l1)} | {fmt(k8)} | {fmt(l8)} | {ratio(k8, l8)} "
              f"| {ratio(k1, kb)} | {ratio(l1, lb)} |")
        table_rows[t] = {"kvd_b1": k1, "llama_b1": l1, "kvd_b8": k8, "llama_b8": l8}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "cpu_flags": cpu_flags(), "threads": a.threads, "rounds": a.rounds, "ctx": a.kv_ctx,
                       "raw": res, "median": table_rows}, f, indent=1)
            f.write("\n")


# ---------------------------------------------------------------- running the two sides

def run_child(cmd, env=None):
    """subprocess.run, plus the CPU cores the child kept busy on average (user+sys / wall): a
    2-thread run far below 2 did not get its CPUs (or its threads sleep rather than spin)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, env=env)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return p, (cpu / wall if wall > 0 else None), wall


#: --kvd-paths: the environment that selects each kernel path (kernels/cpu.h), and the name
#: kvd-run reports for it
KVD_PATHS = {
    "avx512vnni+amx": {}, "avx512vnni": {"KVD_AMX": "0"}, "i8mm": {},
    "avx2+avxvnni": {"KVD_ISA": "avx2"},
    "avx2": {"KVD_ISA": "avx2", "KVD_AVXVNNI": "0"},
    "neon": {"KVD_ISA": "neon"},
    "c": {"KVD_ISA": "c"},
}


def run_kvd(a, path=None):
    # f16 KV, llama.cpp's cache (kvd's default, auto, is bf16 on some CPUs and would change with the path)
    cmd = [a.kvd, "-m", a.model, "--bench", "--bench-file", a.text, "-t", str(a.threads), "--json",
           "--kv-type", "f16"]
    env = None
    if path is not None:
        env = {k: v for k, v in os.environ.items() if k not in ("KVD_ISA", "KVD_AVXVNNI", "KVD_AMX")}
        env.update(KVD_PATHS[path])
    p, cores, wall = run_child(cmd, env)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}:\n{p.stderr[-2000:]}")
    res = parse_json_output(p.stdout, "kvd-run")
    if path is not None and res.get("isa") != path:
        raise RuntimeError(f"asked for the {path} path, kvd-run ran {res.get('isa')}: this CPU lacks it")
    res["bench_cores_busy"], res["bench_wall_s"] = cores, wall
    res["floor_b1_tokens_per_s"] = run_floor(a, env)
    return res


def run_floor(a, env):
    """The batch-1 decode floor that bench-ceiling -b measures now, on the same path; None without
    bench-ceiling."""
    if not os.access(a.ceiling, os.X_OK):
        return None
    p = subprocess.run([a.ceiling, "-m", a.model, "-t", str(a.threads), "-b"], capture_output=True,
                       text=True, timeout=WORKER_TIMEOUT_S, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("floor, decode batch 1:"):
            return float(line.split(":")[1].split()[0])
    return None


def run_llama(a):
    cmd = [sys.executable, os.path.abspath(__file__), "--llama-worker", "--model", a.model,
           "--threads", str(a.threads), "--text", a.text]
    if a.llama_flash_attn:
        cmd.append("--llama-flash-attn")
    if a.llama_kv_unified:
        cmd.append("--llama-kv-unified")
    p, cores, wall = run_child(cmd)
    if p.returncode != 0:
        raise RuntimeError(f"the llama.cpp worker exited with {p.returncode}:\n{p.stderr[-3000:]}"
                           f"{p.stdout[-1000:]}")
    res = parse_json_output(p.stdout, "the llama.cpp worker")
    res["bench_cores_busy"], res["bench_wall_s"] = cores, wall
    return res


def fmt(v, unit=""):
    if v is None:
        return "n/a"
    if unit == "x":
        return f"{v:.2f}x"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}"


def table(a, kmed, lmed):
    rows = [("prefill 512 (tok/s)", "prefill_tokens_per_s", ""),
            ("decode b1, 128 (tok/s)", "decode_b1_tokens_per_s", "")]
    for B in BATCHES:
        rows.append((f"batch decode b{B} agg (tok/s)", f"batch_b{B}_tokens_per_s", ""))
    rows += [("b32 / b1 (batch decode)", "batch_b32_over_b1", "x"),
             ("resident memory (MiB)", "rss_mib", ""),
             ("decode b1 bandwidth floor (tok/s)", "floor_b1_tokens_per_s", ""),
             ("decode b1 / floor", "decode_b1_over_floor", "x")]
    out = [f"CPU: {cpu_name()}, threads {a.threads}, rounds {a.rounds} (medians)",
           f"model: {os.path.relpath(a.model, ROOT) if a.model.startswith(ROOT) else a.model}",
           f"{'metric':<32}{'kvd':>12}{'llama.cpp':>12}{'kvd/llama.cpp':>16}"]
    ratios = {}
    for label, key, unit in rows:
        kv = kmed.get(key) if kmed is not None else None
        lv = lmed.get(key) if lmed is not None else None
        r = kv / lv if isinstance(kv, (int, float)) and isinstance(lv, (int, float)) and lv else None
        ratios[key] = r
        out.append(f"{label:<32}{fmt(kv, unit):>12}{fmt(lv, unit):>12}"
                   f"{(f'{r:.2f}' if r is not None else 'n/a'):>16}")
    out.append("resident memory: kvd as its JSON reports it; llama.cpp = worker VmRSS after the run "
               "minus before loading")
    return "\n".join(out), ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kvd", default=os.path.join(ROOT, "build", "kvd-run"))
    ap.add_argument("--ceiling", default=os.path.join(ROOT, "build", "bench-ceiling"),
                    help="bench-ceiling, for the decode floor (skipped where it is missing)")
    ap.add_argument("--text", default=os.path.join(ROOT, "tests", "data", "ppl_text.txt"))
    ap.add_argument("--kvd-paths", metavar="LIST",
                    help="kvd's kernel paths to measure in each round against the same llama.cpp runs, "
                         f"comma-separated, of {', '.join(KVD_PATHS)} (default: the one KVD_ISA / KVD_AVXVNNI "
                         "select); a table each")
    ap.add_argument("--json", metavar="OUT", help="write all raw rounds and the medians here")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--only-llama", action="store_true", help="run the llama.cpp side alone")
    only.add_argument("--only-kvd", action="store_true", help="run the kvd side alone")
    ap.add_argument("--llama-flash-attn", action="store_true",
                    help="llama.cpp with flash attention (default off, as llama-cpp-python)")
    ap.add_argument("--llama-kv-unified", action="store_true",
                    help="llama.cpp batch context with one unified KV buffer (default: per-sequence)")
    ap.add_argument("--wait-quiet", type=float, default=120, metavar="S",
                    help="before each run wait up to S seconds for idle CPUs (default 120)")
    ap.add_argument("--kv-ctx", type=int, metavar="N",
                    help="decode after N tokens of context per KV type (see the top of this file)")
    ap.add_argument("--kv-types", default="f16,q8_0,q4_0", help="with --kv-ctx (default f16,q8_0,q4_0)")
    ap.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--llama-ctx-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kv-type", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.threads < 1 or a.rounds < 1:
        ap.error("--threads and --rounds must be at least 1")
    a.model = os.path.abspath(a.model)
    a.text = os.path.abspath(a.text)
    a.kvd = os.path.abspath(a.kvd)
    a.ceiling = os.path.abspath(a.ceiling)

    if a.llama_worker:
        llama_worker(a)
        return
    if a.llama_ctx_worker:
        llama_ctx_worker(a)
        return
    for path, what in ((a.model, "model"), (a.text, "text")):
        if not os.path.isfile(path):
            ap.error(f"{what} {path} not found")
    if not a.only_llama and not os.access(a.kvd, os.X_OK):
        ap.error(f"{a.kvd} is not an executable (build kvd, or pass --kvd or --only-llama)")

    if a.kv_ctx:
        kv_ctx_main(a)
        return
    paths = [None]
    if a.kvd_paths:
        paths = [x.strip() for x in a.kvd_paths.split(",") if x.strip()]
        bad = [x for x in paths if x not in KVD_PATHS]
        if bad:
            ap.error(f"--kvd-paths: unknown {', '.join(bad)} (known: {', '.join(KVD_PATHS)})")
    raw = {"kvd": {p: [] for p in paths}, "llama_cpp": []}
    busy = {"kvd": [], "llama_cpp": []}
    for r in range(a.rounds):               # alternate: kvd (each path), llama.cpp, kvd, llama.cpp, ...
        for path in paths if not a.only_llama else []:
            busy["kvd"].append(wait_quiet(a.wait_quiet, "kvd"))
            res = run_kvd(a, path)
            raw["kvd"][path].append(res)
            m = metrics(res)
            print(f"round {r + 1}/{a.rounds} kvd {res.get('isa')}: prefill {fmt(m['prefill_tokens_per_s'])}, "
                  f"decode {fmt(m['decode_b1_tokens_per_s'])} tok/s, {res['bench_wall_s']:.0f} s, "
                  f"{res['bench_cores_busy']:.2f} cores busy", file=sys.stderr, flush=True)
        if not a.only_kvd:
            busy["llama_cpp"].append(wait_quiet(a.wait_quiet, "llama.cpp"))
            res = run_llama(a)
            raw["llama_cpp"].append(res)
            m = metrics(res)
            print(f"round {r + 1}/{a.rounds} llama.cpp: prefill {fmt(m['prefill_tokens_per_s'])}, "
                  f"decode {fmt(m['decode_b1_tokens_per_s'])} tok/s, {res['bench_wall_s']:.0f} s, "
                  f"{res['bench_cores_busy']:.2f} cores busy", file=sys.stderr, flush=True)

    lmed = medians([metrics(x) for x in raw["llama_cpp"]]) if raw["llama_cpp"] else None
    kmeds, ratios = {}, {}
    for path in paths:
        runs = raw["kvd"][path]
        kmed = medians([metrics(x) for x in runs]) if runs else None
        text, ratios[path] = table(a, kmed, lmed)
        kmeds[path] = kmed
        if runs:
            print(f"kvd path: {runs[0].get('isa')}")
        print(text)
    if raw["llama_cpp"]:
        l0 = raw["llama_cpp"][0]
        print(f"llama.cpp: llama-cpp-python {l0.get('llama_cpp_python')}, flash_attn "
              f"{'on' if l0.get('flash_attn') else 'off'}, batch decode through llama_decode with "
              f"n_seq_max 32 ({'unified' if l0.get('kv_unified') else 'per-sequence'} KV); "
              f"built for: {l0.get('isa')}")
    if not a.only_llama:
        flags = " ".join(cpu_flags()) or "none the kernels use"
        ran = ", ".join(raw["kvd"][p][0].get("isa") for p in paths)
        env = "" if a.kvd_paths else (f" (KVD_ISA={os.environ.get('KVD_ISA', 'unset')}, "
                                      f"KVD_AVXVNNI={os.environ.get('KVD_AVXVNNI', 'unset')})")
        print(f"kvd: kernel paths {ran}{env}; CPU flags: {flags}")
    sys.stdout.flush()

    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "cpu_flags": cpu_flags(), "threads": a.threads, "rounds": a.rounds,
                       "model": a.model, "text": a.text, "cpu_busy_before_runs": busy,
                       "kvd": {str(p): {"rounds": raw["kvd"][p], "median": kmeds[p]} for p in paths},
                       "llama_cpp": {"rounds": raw["llama_cpp"], "median": lmed},
                       "ratio_kvd_over_llama_cpp": {str(p): ratios[p] for p in paths}}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
