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

if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root (or sudo) to install: ${need[*]}" >&2; exit 1; }
  sudo=sudo
fi
echo "install-deps: installing ${need[*]}" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
