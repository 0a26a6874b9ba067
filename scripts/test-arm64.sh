#!/usr/bin/env bash
# The aarch64 build, checked on any x86 machine: installs Debian's cross
# compiler, qemu-user and the arm64 libraries when they are missing, builds
# the whole project for aarch64 (cmake/aarch64-linux-gnu.cmake, warnings as
# errors, no CUDA), and runs its unit tests and fuzz-corpus replays under
# qemu-user: the kernels (gemm, attn, quant, ops), the engine (forward, and the
# numbers contract: batch, chunking and threads change no bit), the pool, the
# prefix cache, the wire format. qemu's default CPU has the dot product and the
# int8 matrix multiply, so the kernels' every aarch64 level (C, NEON with sdot,
# I8MM with smmla) is held to the C reference and the contract there; then the
# run-time choice is checked on CPUs without I8MM (Cortex-A76) and without the
# dot product (Cortex-A57). scripts/test.sh runs this.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

scripts/install-deps.sh --arm64
jobs=$(nproc 2>/dev/null || echo 2)
echo "== aarch64 cross build (-Werror)"
cmake -S . -B build-arm64 -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DKVD_CUDA=OFF \
      -DKVD_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-arm64 -j "$jobs"
for exe in kvd kvd-worker kvcli kvd-run; do
  aarch64-linux-gnu-readelf -h "build-arm64/$exe" | grep -q AArch64 || { echo "$exe: not an aarch64 build" >&2; exit 1; }
done
echo "== aarch64 unit tests and fuzz replays, under qemu-user"
ctest --test-dir build-arm64 -L 'unit|fuzz' --output-on-failure -j "$jobs"
echo "== aarch64 run-time choice of kernels"
for want in "cortex-a76 neon" "cortex-a57 c" "max i8mm"; do
  set -- $want
  out=$(QEMU_CPU=$1 qemu-aarch64-static build-arm64/tests/test_gemm 2>&1) || { echo "$out" >&2; exit 1; }
  echo "$out" | grep -q "best path: $2," || { echo "QEMU_CPU=$1: expected the $2 path" >&2; echo "$out" >&2; exit 1; }
  echo "QEMU_CPU=$1: $2 path, $(echo "$out" | tail -1)"
done
