#!/usr/bin/env bash
# Downloads (here, where Debian's archive is reachable) the Debian packages that
# kvd's build needs beyond a CUDA image's compiler and CMake, into .gpudeps/ at
# the repository root (ignored by git), so that they can travel with the
# working tree to a GPU machine that can fetch nothing. tests/gpu/run.sh
# unpacks them there into a private prefix (never into /) when the system
# lacks the headers, and builds against that prefix.
#
#   bash tests/gpu/fetch-deps.sh     # then carry .gpudeps to the GPU machine
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$root/.gpudeps"
mkdir -p "$out"
pkgs=(
  libxxhash-dev libxxhash0                       # XXH3: prefix keys, model fingerprints
  libzmq3-dev libzmq5 libsodium23 libpgm-5.3-0 libnorm1 libbsd0 libmd0
  libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1
  libprotobuf-c-dev libprotobuf-c1 protobuf-c-compiler libprotoc32 libprotobuf32
  liblz4-dev liblz4-1
)
cd "$out"
# apt-get download writes into the current directory; _apt cannot, so it warns
apt-get download "${pkgs[@]}" 2>&1 | grep -v "unsandboxed" || true
ls -1 "$out"/*.deb | wc -l | xargs echo "packages in $out:"
du -sh "$out"
