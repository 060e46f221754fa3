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

# shellcheck source=scripts/candle_cuda_env.sh
source scripts/candle_cuda_env.sh

step "cargo +stable check (lserve beside candle-core with cuda)"
export CARGO_TERM_COLOR=never
(cd "$crate" && cargo +stable check --locked --all-targets)
