#!/usr/bin/env bash
# kvd's main job, from a fresh machine: installs what is missing, fetches the
# default model, builds, and answers a chat prompt with kvd-run.
#   scripts/run.sh ["your question"] [more kvd-run options]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

scripts/install-deps.sh
scripts/fetch-model.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" >/dev/null

prompt=${1:-"Explain in two sentences what a KV cache is in a language model."}
shift || true
exec build/kvd-run -m models/SmolLM2-135M-Instruct.Q4_1.gguf --chat -p "$prompt" -n 128 --temp 0 "$@"
