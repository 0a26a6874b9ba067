#!/usr/bin/env bash
# Installs what kvd needs to build and test, from Debian's packages, when it
# is missing. Safe to run again: it installs nothing when all is present.
set -euo pipefail

need=()
command -v cc >/dev/null || need+=(gcc libc6-dev)
command -v c++ >/dev/null || need+=(g++)   # the CPU emulation of the CUDA kernels (tests/gpu/emu)
command -v make >/dev/null || need+=(make)
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v python3 >/dev/null || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
command -v sha256sum >/dev/null || need+=(coreutils)
# libraries: a header is the sign the -dev package is there
[ -f /usr/include/xxhash.h ] || need+=(libxxhash-dev)
[ -f /usr/include/zmq.h ] || need+=(libzmq3-dev)
[ -f /usr/include/protobuf-c/protobuf-c.h ] || need+=(libprotobuf-c-dev)
command -v protoc-c >/dev/null || need+=(protobuf-c-compiler)
[ -f /usr/include/lz4.h ] || need+=(liblz4-dev)
[ -f /usr/include/microhttpd.h ] || need+=(libmicrohttpd-dev)
[ -f /usr/include/jansson.h ] || need+=(libjansson-dev)
[ -f /usr/include/msgpack.h ] || need+=(libmsgpack-dev)
[ -f /usr/include/sodium.h ] || need+=(libsodium-dev)
# the page of kvd --http in a real browser (tests/python/test_web.py): headless
# Chromium, its WebDriver, and a font for the screenshot's text
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
[ -d /usr/share/fonts/truetype/liberation ] || need+=(fonts-liberation)

# --arm64: what the aarch64 cross build needs (scripts/test-arm64.sh): Debian's
# cross compiler, qemu-user to run its tests, and the arm64 builds of the
# libraries above (a multiarch system: dpkg --add-architecture arm64)
arm64=false
[ "${1:-}" = "--arm64" ] && arm64=true
if $arm64; then
  command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu)
  command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
  a=/usr/lib/aarch64-linux-gnu
  [ -f $a/libxxhash.so ] || need+=(libxxhash-dev:arm64)
  [ -f $a/libzmq.so ] || need+=(libzmq3-dev:arm64)
  [ -f $a/libprotobuf-c.so ] || need+=(libprotobuf-c-dev:arm64)
  [ -f $a/liblz4.so ] || need+=(liblz4-dev:arm64)
  [ -f $a/libmicrohttpd.so ] || need+=(libmicrohttpd-dev:arm64)
  [ -f $a/libjansson.so ] || need+=(libjansson-dev:arm64)
  [ -f $a/libmsgpackc.so ] || need+=(libmsgpack-dev:arm64)
  [ -f $a/libsodium.so ] || need+=(libsodium-dev:arm64)
fi

if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root (or sudo) to install: ${need[*]}" >&2; exit 1; }
  sudo=sudo
fi
echo "install-deps: installing ${need[*]}" >&2
if $arm64 && ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $sudo dpkg --add-architecture arm64
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
