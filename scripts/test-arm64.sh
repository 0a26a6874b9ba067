#!/usr/bin/env bash
# The aarch64 build, checked on any x86 machine: installs Debian's cross
# compiler, qemu-user and the arm64 libraries when they are missing, builds
# the whole project for aarch64 (cmake/aarch64-linux-gnu.cmake, warnings as
# errors, no CUDA), and runs its unit tests and fuzz-corpus replays under
# qemu-user: the kernels (gemm, attn, quant, ops), the engine (forward, and the
# numbers contract: batch, chunking and threads change no bit), the pool, the
# prefix cache, the wire format. On aarch64 the kernels take their portable C
# path (NEON is not written yet); every path is held to the C reference there.
# scripts/test.sh runs this.
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
