#!/usr/bin/env bash
# Compile-checks lserve beside candle (integrations/candle-check: lserve and candle-core with its
# `cuda` feature in one dependency graph) on a machine without a GPU or a CUDA install.
#
# candle's CUDA build compiles its kernels with nvcc in build scripts (candle-kernels, through
# cudaforge) and turns on cudarc's `cuda-version-from-build-system`, which reads `nvcc --version`.
# So this installs the CUDA 13.0 compiler and headers from PyPI (nvcc, its front end and cicc,
# the runtime and C++ headers: cuda_fp16.h, cuda_bf16.h, cuda_fp8.h, cuda/std) into the crate's
# target folder, away from any other Python packages, points PATH and CUDA_ROOT at them, names the
# GPU architecture (no GPU to ask: CUDA_COMPUTE_CAP=90, sm_90 as lserve's PTX), and runs
# `cargo check` of the crate and its tests with the stable toolchain, as an engine would build.
# Linking is not checked: it needs the CUDA libraries (libcuda, cuBLAS, cuRAND, NVRTC).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

crate=integrations/candle-check
cuda_dir="$crate/target/cuda-pypi"
cuda_packages=(
    'nvidia-cuda-nvcc==13.0.*'
    'nvidia-cuda-crt==13.0.*'
    'nvidia-nvvm==13.0.*'
    'nvidia-cuda-runtime==13.0.*'
    'nvidia-cuda-cccl==13.0.*'
)

step "toolchains"
rustup toolchain install            # reads rust-toolchain.toml: lserve's build script needs it
rustup toolchain list | grep -q '^stable' || rustup toolchain install stable --profile minimal

step "CUDA 13.0 compiler and headers (PyPI, into $cuda_dir)"
if [ ! -x "$cuda_dir/nvidia/cu13/bin/nvcc" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$cuda_dir" \
        "${cuda_packages[@]}"
fi
CUDA_ROOT="$(cd "$cuda_dir/nvidia/cu13" && pwd)"
export CUDA_ROOT CUDA_HOME="$CUDA_ROOT"
export PATH="$CUDA_ROOT/bin:$PATH"
export CUDA_COMPUTE_CAP=90
nvcc --version | tail -n 2

step "cargo +stable check (lserve beside candle-core with cuda)"
export CARGO_TERM_COLOR=never
(cd "$crate" && cargo +stable check --locked --all-targets)
