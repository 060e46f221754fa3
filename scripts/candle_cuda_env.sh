# Sourced by scripts/candle_check.sh and scripts/candle_gpu_test.sh (from the repository root):
# the toolchains lserve's build needs, and candle's CUDA build environment on a machine without
# a CUDA install. It installs CUDA 13.0's nvcc, its front end and cicc, the runtime and C++
# headers (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h, cuda/std) from PyPI into the candle crate's
# target folder, away from any other Python packages, points PATH, CUDA_ROOT and CUDA_HOME at
# them, and names the GPU architecture (no GPU to ask: CUDA_COMPUTE_CAP=90, sm_90 as lserve's PTX).
# Defines `step` and `crate`.

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
