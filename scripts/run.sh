#!/usr/bin/env bash
# kvd's main job, from a fresh machine: installs what is missing, fetches the
# default model, builds, starts the daemon (kvd, one worker) and runs a demo:
# two chat sessions that share a long system prompt. The first computes it;
# the second finds it in the shared KV cache, and says so (cached prompt
# tokens, time to first token). Then kvd is stopped (SIGTERM, a clean drain).
#   scripts/run.sh ["your question"]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

scripts/install-deps.sh
scripts/fetch-model.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" >/dev/null

question=${1:-"Explain in two sentences what a KV cache is in a language model."}
run=$(mktemp -d /tmp/kvd-demo-XXXXXX)
endpoint="ipc://$run/kvd.sock"
# the KV pool takes kvd's default size: 1 GiB, or half of /dev/shm's free space if less
build/kvd --model models/SmolLM2-135M-Instruct.Q4_1.gguf --listen "$endpoint" \
          --ctx 4096 --workers 1 2>"$run/kvd.log" &
kvd_pid=$!
cleanup() {
  kill -TERM "$kvd_pid" 2>/dev/null || true
  wait "$kvd_pid" 2>/dev/null || true
  rm -rf "$run"
}
trap cleanup EXIT
for _ in $(seq 1 120); do
  build/kvcli -e "$endpoint" --timeout 500 health >/dev/null 2>&1 && break
  sleep 0.25
done
build/kvcli -e "$endpoint" health >/dev/null || { cat "$run/kvd.log" >&2; exit 1; }

# a long system prompt both sessions start with (about 800 tokens)
system=$(head -c 3600 tests/data/ppl_text.txt)
ask() {  # ask QUESTION: one chat session; prints the answer, then what the cache did
  local out
  out=$(build/kvcli -e "$endpoint" generate --chat --system "$system" -n 96 --temp 0 --json "$1")
  python3 - "$out" <<'EOF'
import json, sys
r = json.loads(sys.argv[1])
print(r["text"].strip())
u, t = r["usage"], r["timings"]
print(f"  [{u['prompt_tokens']} prompt tokens, {u['cached_prompt_tokens']} from the KV cache; "
      f"first token after {t['ttft_ms']:.0f} ms; {u['completion_tokens']} tokens generated]")
EOF
}
echo "== session 1: $question"
ask "$question"
echo
echo "== session 2 (same system prompt, another question): What is this text about?"
ask "What is this text about? Answer in one sentence."
echo
build/kvcli -e "$endpoint" stats
