#!/usr/bin/env bash
# The project's test command (README, "Run the tests"; .ci/run calls it).
# Installs what a fresh machine lacks (the pinned nightly with its components, a stable
# toolchain for the consumer check, ptxas from PyPI), then runs every check:
# formatting, `cargo xtask ptx` (PTX valid, no spills, no kernel above its baseline), clippy,
# the workspace's tests (GPU tests show as ignored without a GPU), and a stable build of a crate
# that depends on lserve.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "toolchains"
rustup toolchain install            # reads rust-toolchain.toml: pinned nightly + components
rustup toolchain list | grep -q '^stable' || rustup toolchain install stable --profile minimal

step "ptxas (PyPI nvidia-cuda-nvcc 13.0.x)"
if ! python3 -m pip show nvidia-cuda-nvcc >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check 'nvidia-cuda-nvcc==13.0.*'
fi

export PROPTEST_CASES="${PROPTEST_CASES:-256}"
export CARGO_TERM_COLOR=never

step "rustfmt"
cargo fmt --all --check
(cd kernels-gpu && cargo fmt --check)

step "cargo xtask ptx"
cargo xtask ptx

step "clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "tests (PROPTEST_CASES=$PROPTEST_CASES)"
cargo test --workspace

step "a crate depending on lserve builds with stable"
(cd consumer-check && cargo +stable build)
