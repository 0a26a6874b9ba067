#!/usr/bin/env bash
# tests/gpu/run.sh - builds kvd with the CUDA backend (Release, its own build
# directory), runs every GPU test (ctest -L gpu) and the GPU benchmark, and
# prints a short table last. Run from anywhere: bash tests/gpu/run.sh
#
# Environment:
#   KVD_GPU_BUILD  build directory (default: build-gpu in the repository)
#   JOBS           parallel build jobs (default: the CPU count)
#   OUT            when set, logs and the summary are written there as well
#   KVD_GPU_MPS    0: skip the serving benchmark under MPS (run where
#                  nvidia-cuda-mps-control exists and time is left)
#   KVD_GPU_BUDGET seconds the whole run may take (default 450): later steps
#                  get what is left, and are skipped when too little is
# Exit status: 0 when every GPU test passed; 1 when one failed, the build
# failed, or the tests skipped although nvidia-smi lists a GPU.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${KVD_GPU_BUILD:-$root/build-gpu}
jobs=${JOBS:-$(nproc)}
t0=$(date +%s)
deadline=$((t0 + ${KVD_GPU_BUDGET:-450}))
# with OUT set the logs are written there as they come, so that a run cut
# short still leaves them
if [ -n "${OUT:-}" ]; then logs=$OUT/gpu-run; else logs=$build/gpu-logs; fi

# seconds left before the deadline, less a reserve
left() { echo $((deadline - $(date +%s) - ${1:-0})); }
# a timeout of at most $1 seconds within what is left (less reserve $2); 0: none left
budget() {
    local l
    l=$(left "${2:-0}")
    [ "$l" -gt "$1" ] && l=$1
    [ "$l" -lt 0 ] && l=0
    echo "$l"
}

case ":$PATH:" in
*:/usr/local/cuda/bin:*) ;;
*) [ -x /usr/local/cuda/bin/nvcc ] && PATH=$PATH:/usr/local/cuda/bin ;;
esac

step() { printf '\n== %s (%ds)\n' "$*" $(($(date +%s) - t0)); }

mkdir -p "$build" || exit 1
rm -rf "$logs"
mkdir -p "$logs"

step "device"
gpu_listed=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >"$logs/nvidia-smi.txt" 2>&1; then
    cat "$logs/nvidia-smi.txt"
    grep -q '^GPU ' "$logs/nvidia-smi.txt" && gpu_listed=1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null
else
    echo "nvidia-smi: not available"
fi
command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -2
if ! command -v cmake >/dev/null 2>&1; then
    echo "run.sh: cmake is not installed here; nothing can be built"
    exit 1
fi
# build for this GPU alone (CI builds every architecture)
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
arch=()
case "$cc" in [0-9][0-9]|[0-9][0-9][0-9]) arch=(-DCMAKE_CUDA_ARCHITECTURES="$cc") ;; esac

step "dependencies"
# a GPU machine that can fetch nothing: Debian packages carried in .gpudeps
# (tests/gpu/fetch-deps.sh) are unpacked into a private prefix when needed
kvd_deps_root=$root
# shellcheck source=tests/gpu/deps-env.sh
. "$root/tests/gpu/deps-env.sh"

step "configure ($build)"
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
# a Ninja cache from another generator would refuse; start over then
if [ -f "$build/CMakeCache.txt" ] && ! grep -q "CMAKE_GENERATOR:INTERNAL=${gen[1]:-Unix Makefiles}" "$build/CMakeCache.txt"; then
    rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
fi
if ! cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DKVD_CUDA=ON "${arch[@]}" \
        -DKVD_GPU_EMU=OFF -DCMAKE_CUDA_FLAGS="-t0" >"$logs/configure.log" 2>&1; then
    tail -30 "$logs/configure.log"
    echo "run.sh: configure failed (the whole project configures: libzmq, protobuf-c, lz4, xxhash are"
    echo "needed; where they cannot be installed, run tests/gpu/fetch-deps.sh elsewhere and carry .gpudeps)"
    status=1
fi

status=${status:-0}
if [ "$status" = 0 ]; then
    step "build (-j$jobs)"
    # every GPU test program (tests/gpu/test_*.c; ctest -L gpu runs them all) and the benchmark
    targets=$(for f in "$root"/tests/gpu/test_*.c; do basename "$f" .c; done)
    # shellcheck disable=SC2086
    if ! cmake --build "$build" -j "$jobs" --target $targets bench-gpu test_kvd_gpu >"$logs/build.log" 2>&1; then
        grep -E "error|Error" "$logs/build.log" | head -30
        echo "run.sh: build failed (full log: $logs/build.log)"
        status=1
    else
        tail -1 "$logs/build.log"
    fi
fi

tests_ok=0
if [ "$status" = 0 ]; then
    step "ctest -L gpu"
    # the GPU tests, and kvd --gpu end to end (its workers on the shared device pool)
    # most of what is left, keeping ~3 minutes for the benchmarks
    (cd "$build" && timeout "$(budget 330 150)" ctest -R '^gpu\.|^integration\.kvd_gpu$' -V -j2 --timeout 240) \
        >"$logs/ctest.log" 2>&1
    rc=$?
    [ $rc = 124 ] && echo "run.sh: the tests ran out of time (budget ${KVD_GPU_BUDGET:-450} s)"
    # each test's own summary lines, then ctest's verdicts
    grep -E '^[0-9]+: (device|skip|decode|prefill|gemm|quantize|get_rows|rmsnorm|swiglu|rope|kv shift|hadamard|argmax|sample|engine|pool|import|allocation|kvd --gpu|serve|[0-9]+ checks)' \
        "$logs/ctest.log" | sed 's/^[0-9]*: /  /'
    grep -E 'Test +#[0-9]+: ' "$logs/ctest.log"
    if [ $rc -ne 0 ]; then
        grep -E 'CHECK|REQUIRE|failed|EMU|error' "$logs/ctest.log" | head -40
        status=1
    elif grep -q 'Skipped' "$logs/ctest.log"; then
        if [ $gpu_listed = 1 ]; then
            echo "run.sh: the GPU tests skipped although nvidia-smi lists a GPU:"
            grep -E 'skip:' "$logs/ctest.log" | head -2
            status=1
        fi
    else
        tests_ok=1
    fi

    step "bench-gpu"
    timeout "$(budget 200 50)" "$build/bench-gpu" >"$logs/bench.log" 2>&1
    brc=$?
    sed -n '1,/^== GPU summary/p' "$logs/bench.log" | grep -v '^== GPU summary'
    [ $brc -ne 0 ] && [ $brc -ne 77 ] && echo "run.sh: bench-gpu exited with $brc"

    step "serving: tokens/s with 1, 2 and 4 workers on one GPU"
    if [ "$(left 40)" -gt 0 ]; then
        timeout "$(budget 200 5)" "$build/tests/test_gpu_serve" --bench >"$logs/serve-bench.log" 2>&1
        grep -E '^serve bench|skip' "$logs/serve-bench.log" || tail -3 "$logs/serve-bench.log"
    else
        echo "run.sh: no time left for it"
    fi

    # what no emulation shows: races, barrier misuse and bad accesses on the
    # device itself, every kernel on small shapes
    if command -v compute-sanitizer >/dev/null 2>&1 && [ $gpu_listed = 1 ]; then
        step "compute-sanitizer (racecheck, synccheck, memcheck) on small shapes"
        for tool in racecheck synccheck memcheck; do
            for prog in test_gpu_attn test_gpu_ops; do
                if [ "$(left 60)" -le 0 ]; then
                    echo "  $tool $prog: no time left"
                    continue
                fi
                timeout "$(budget 60 50)" compute-sanitizer --tool $tool --error-exitcode 3 \
                    "$build/tests/$prog" --quick >"$logs/sanitize-$tool-$prog.log" 2>&1
                src=$?
                printf '  %-9s %-14s %s\n' $tool $prog "$(case $src in 0) echo clean ;; 3) echo "ERRORS (see sanitize-$tool-$prog.log)" ;; 124) echo "out of time" ;; *) echo "exit $src" ;; esac)"
                [ $src = 3 ] && { grep -m5 -E 'Error|Race|Hazard|Invalid' "$logs/sanitize-$tool-$prog.log"; status=1; }
            done
        done | tee "$logs/sanitize.txt"
        grep -q ERRORS "$logs/sanitize.txt" && status=1
    fi

    # the same under MPS, where the machine has it: without it the workers'
    # kernels take turns on the GPU; with it they run side by side. A private
    # control daemon for this run only, told to quit afterwards.
    if [ "${KVD_GPU_MPS:-1}" = 1 ] && [ $gpu_listed = 1 ] && [ "$(left 60)" -gt 0 ] &&
        command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
        step "serving under MPS"
        mps=$(mktemp -d /tmp/kvd-mps-XXXXXX)
        mkdir -p "$mps/pipe" "$mps/log"
        if CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log \
                nvidia-cuda-mps-control -d >"$logs/mps.log" 2>&1; then
            CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log \
                timeout "$(budget 150 25)" "$build/tests/test_gpu_serve" --bench >"$logs/serve-bench-mps.log" 2>&1
            grep -E '^serve bench' "$logs/serve-bench-mps.log" | sed 's/^serve bench/serve bench (MPS)/' ||
                tail -3 "$logs/serve-bench-mps.log"
            echo quit | CUDA_MPS_PIPE_DIRECTORY=$mps/pipe timeout 20 nvidia-cuda-mps-control >>"$logs/mps.log" 2>&1
        else
            echo "run.sh: MPS did not start ($(head -1 "$logs/mps.log"))"
        fi
    fi
fi

# the short table, last
{
    printf '\n==== kvd GPU run: %s, %ds ====\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" $(($(date +%s) - t0))
    head -1 "$logs/nvidia-smi.txt" 2>/dev/null
    if [ -f "$logs/ctest.log" ]; then
        echo "tests:"
        grep -E 'Test +#[0-9]+: ' "$logs/ctest.log" | sed -E 's/^ *[0-9]+\/[0-9]+ +Test +#[0-9]+: /  /; s/ \.+/ /'
    fi
    if [ -f "$logs/ctest.log" ] && grep -q '^[0-9]*: engine ' "$logs/ctest.log"; then
        echo "GPU engine against the CPU engine (test_gpu_engine):"
        grep -E '^[0-9]+: engine ' "$logs/ctest.log" | sed 's/^[0-9]*: /  /'
    fi
    [ -f "$logs/bench.log" ] && sed -n '/^== GPU summary/,$p' "$logs/bench.log"
    [ -f "$logs/serve-bench.log" ] && grep -E '^serve bench' "$logs/serve-bench.log"
    [ -f "$logs/sanitize.txt" ] && { echo "compute-sanitizer:"; cat "$logs/sanitize.txt"; }
    [ -f "$logs/serve-bench-mps.log" ] && grep -E '^serve bench' "$logs/serve-bench-mps.log" |
        sed 's/^serve bench/serve bench (MPS)/'

    [ "$status" = 0 ] && [ $tests_ok = 1 ] && echo "result: GPU tests passed"
    [ "$status" = 0 ] && [ $tests_ok = 0 ] && echo "result: GPU tests skipped (no usable GPU)"
    [ "$status" != 0 ] && echo "result: FAILED (logs in $logs)"
    true
} | tee "$logs/summary.txt"

exit "$status"
