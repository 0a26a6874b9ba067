#!/usr/bin/env bash
# Runs kvd's whole test suite, as CI does: installs what is missing, fetches
# the default model and Gemma 3 270M (whose tokenizer test needs it), builds
# with warnings as errors, runs every test, builds the whole project for
# aarch64 and runs its unit tests under qemu-user (scripts/test-arm64.sh), then
# rebuilds under AddressSanitizer + UndefinedBehaviorSanitizer and runs the
# unit tests and fuzz-corpus replays again there.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

scripts/install-deps.sh
scripts/fetch-model.sh
scripts/fetch-model.sh --model gemma3-270m

jobs=$(nproc 2>/dev/null || echo 2)
echo "== build (-Werror)"
cmake -S . -B build-test -G Ninja -DKVD_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-test -j "$jobs"
echo "== tests"
ctest --test-dir build-test --output-on-failure -j "$jobs"

echo "== Python client (clients/python) against kvd"
python3 -m venv --clear build-test/pyenv
build-test/pyenv/bin/python -m pip install -q --disable-pip-version-check \
  ./clients/python -r tests/python/requirements.txt
KVD_BIN_DIR="$root/build-test" \
KVD_MODEL="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
  build-test/pyenv/bin/python -m pytest tests/python

echo "== the perimeter (tests/security: issue 38's items against a real kvd)"
# the same environment (pyzmq, msgpack); run as root, its tests also act as
# another local user (uid 65534) through setpriv
KVD_BIN_DIR="$root/build-test" \
KVD_MODEL="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
  build-test/pyenv/bin/python -m pytest tests/security

echo "== the aarch64 build, its unit tests under qemu-user"
scripts/test-arm64.sh

echo "== unit and fuzz-replay tests under ASan+UBSan"
cmake -S . -B build-asan -G Ninja -DKVD_WERROR=ON -DKVD_ASAN=ON -DKVD_CUDA=OFF \
      -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan -L 'unit|fuzz' --output-on-failure -j "$jobs"
