#!/usr/bin/env bash
# Makes the real activations tests/gpu_real_activations.rs reads: SmolLM2-135M (fetched by
# scripts/fetch_smollm2.sh) over the GPL-3 text with dense attention, post-RoPE K and V of layers
# 0, 10, 20 and 29 at every position and Q of the 64 positions before each window end (1024,
# 2080, 4096, the text's end), f16, one safetensors file (about 23 MiB; the
# `dump_activations` binary of integrations/candle-smollm2, docs/FIDELITY.md, "Real activations
# for the GPU tests"). Outside git's tracked files; never commit it. Prints the file's path.
#
#   bash scripts/dump_activations.sh                   # into ./gpu-activations/
#   LSERVE_ACTIVATIONS_DIR=dir bash scripts/dump_activations.sh
#   bash scripts/dump_activations.sh --layers 0,15     # extra arguments go to the binary
#
# Idempotent: an existing file made by the same member sources (git tree of
# integrations/candle-smollm2 at HEAD), model and arguments is kept (LSERVE_DUMP_FORCE=1 remakes
# it). The member builds with the PTX in host/ptx when that folder has it (`cargo xtask
# package` or `cargo xtask ptx` leave it there; the member never runs a kernel), else from the
# kernel sources with the pinned nightly.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${LSERVE_ACTIVATIONS_DIR:-$repo/gpu-activations}"
out="$dir/smollm2-gpl3.safetensors"
stamp="$out.stamp"

gguf="$(bash "$repo/scripts/fetch_smollm2.sh")"
mkdir -p "$dir"
want="member $(git -C "$repo" rev-parse HEAD:integrations/candle-smollm2 2>/dev/null || echo unknown) $(stat -c %s "$gguf") args $*"
if [ -z "${LSERVE_DUMP_FORCE:-}" ] && [ -f "$out" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "dump_activations: $out is up to date" >&2
    echo "$out"
    exit 0
fi

if [ -z "${LSERVE_PTX_DIR:-}" ] && [ -f "$repo/host/ptx/lserve_kernels.sm_90.ptx" ] &&
    [ -f "$repo/host/ptx/lserve_kernels.sm_80.ptx" ] &&
    [ -f "$repo/host/ptx/lserve_kernels.sm_90a.ptx" ]; then
    export LSERVE_PTX_DIR="$repo/host/ptx"
fi
rm -f "$stamp"
start=$(date +%s)
(cd "$repo/integrations/candle-smollm2" &&
    cargo run --release --locked --bin dump_activations -- --gguf "$gguf" --out "$out.tmp" "$@" >/dev/null)
mv "$out.tmp" "$out"
chmod 644 "$out"
echo "$want" >"$stamp"
echo "dump_activations: $(stat -c %s "$out") bytes in $(($(date +%s) - start)) s (build included)" >&2
echo "$out"
