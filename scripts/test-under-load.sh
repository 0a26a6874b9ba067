#!/usr/bin/env bash
# Runs the test command (scripts/test.sh) several times in a row, each time in
# a fresh clone of the committed HEAD, while busy loops keep the cores
# occupied: the check that no test depends on the machine's speed. Prints one
# line per run and a summary; exits non-zero if any run failed.
#
#   scripts/test-under-load.sh [-n RUNS] [-l BUSY_LOOPS] [-i ISA] [-d DIR]
#
#   -n RUNS        runs in a row (default 3)
#   -l BUSY_LOOPS  busy processes beside the suite (default: one per core)
#   -i ISA         KVD_ISA for the runs: c, avx2, avx512 (default: the CPU's best)
#   -d DIR         where the clones and logs go (default: a new directory in /tmp)
#
# A run's output is kept in DIR/run-N.log; the model is copied from this
# checkout's models/ when present (else the clone fetches it).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

runs=3
loops=$(nproc 2>/dev/null || echo 2)
isa=
dir=
while getopts "n:l:i:d:" opt; do
  case $opt in
    n) runs=$OPTARG ;;
    l) loops=$OPTARG ;;
    i) isa=$OPTARG ;;
    d) dir=$OPTARG ;;
    *) sed -n '2,15p' "$0" >&2; exit 2 ;;
  esac
done
[ -n "$dir" ] || dir=$(mktemp -d /tmp/kvd-load-XXXXXX)
mkdir -p "$dir"

busy=()
stop_busy() { [ ${#busy[@]} -eq 0 ] || kill "${busy[@]}" 2>/dev/null || true; }
trap stop_busy EXIT
for ((i = 0; i < loops; i++)); do
  yes >/dev/null &
  busy+=($!)
done

commit=$(git -C "$root" rev-parse --short HEAD)
echo "test-under-load: $runs runs of scripts/test.sh at $commit, KVD_ISA=${isa:-default}," \
     "$loops busy loops, logs in $dir"
failed=0
for ((r = 1; r <= runs; r++)); do
  clone="$dir/clone-$r"
  rm -rf "$clone"
  git clone -q "$root" "$clone"
  git -C "$clone" checkout -q "$commit"   # every run tests the same commit
  if [ -f "$root/models/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    mkdir -p "$clone/models"
    cp "$root/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$clone/models/"
  fi
  start=$(date +%s)
  rc=0
  if [ -n "$isa" ]; then
    (cd "$clone" && KVD_ISA=$isa bash scripts/test.sh) >"$dir/run-$r.log" 2>&1 || rc=$?
  else
    (cd "$clone" && bash scripts/test.sh) >"$dir/run-$r.log" 2>&1 || rc=$?
  fi
  secs=$(($(date +%s) - start))
  [ $rc -eq 0 ] || failed=$((failed + 1))
  printf 'run %d: rc %d in %dm%02ds (%s)\n' "$r" "$rc" $((secs / 60)) $((secs % 60)) \
         "$(grep -E 'tests passed|passed in' "$dir/run-$r.log" | tr '\n' ' ')"
  [ $rc -eq 0 ] || tail -n 40 "$dir/run-$r.log" | sed 's/^/    /'
  rm -rf "$clone/build-test/pyenv"
done
echo "test-under-load: $((runs - failed)) of $runs runs passed"
[ $failed -eq 0 ]
