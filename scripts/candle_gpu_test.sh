#!/usr/bin/env bash
# Builds the test executable of integrations/candle-check (lserve beside candle-core with its
# `cuda` feature; its GPU test is ignored without a GPU) on a machine without a GPU or a CUDA
# install, and puts it, stripped, with a `run.sh` into a folder (argument, default ./gpu-candle)
# to carry to a GPU machine that has the NVIDIA driver and the CUDA 13 libraries of a PyTorch
# install (pip's nvidia/*/lib) but no Rust.
#
# The build is the one of scripts/candle_check.sh (CUDA 13.0 nvcc and headers from PyPI,
# CUDA_COMPUTE_CAP=90) plus a link. candle builds cudarc with `dynamic-linking`, so the
# executable links -lcuda -lnvrtc -lcurand -lcublas -lcublasLt, and candle's compiled kernels
# (libmoe) -lcudart, which the compiler's runtime package has. For that link this installs
# cuBLAS, cuRAND and NVRTC for CUDA 13.0 from PyPI (they ship only versioned names, so a link
# folder gets the unversioned ones as symlinks) and writes a stub libcuda.so with the driver's
# SONAME, libcuda.so.1, defining every driver function cudarc declares: the executable then
# needs libcuda.so.1, which the GPU machine's driver provides at run time. The link folder
# reaches cudarc's build script as CUDA_TOOLKIT_ROOT_DIR (it searches `lib` under each of
# CUDA_HOME, CUDA_PATH, CUDA_ROOT, CUDA_TOOLKIT_ROOT_DIR; candle's nvcc lookup reads the first
# three, which stay on the compiler).
#
# The dev profile is built (CANDLE_GPU_PROFILE=release for the release profile): the candle
# kernels' nvcc build and the crates are shared with candle_check.sh's target folder.
set -euo pipefail
cd "$(dirname "$0")/.."

out_dir="${1:-gpu-candle}"
profile="${CANDLE_GPU_PROFILE:-dev}"
# shellcheck source=scripts/candle_cuda_env.sh
source scripts/candle_cuda_env.sh

libs_dir="$crate/target/cuda-libs-pypi"
link_root="$crate/target/cuda-link"
(cd "$crate" && cargo +stable fetch --locked)   # cudarc's sources, for the stub below
cudarc_sys="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10 | head -n 1)/src/driver/sys/mod.rs"
library_packages=(
    'nvidia-cublas==13.0.*'
    'nvidia-curand==10.4.0.*'
    'nvidia-cuda-nvrtc==13.0.*'
)

step "CUDA 13.0 cuBLAS, cuRAND, NVRTC for the link (PyPI, into $libs_dir)"
if [ ! -e "$libs_dir/nvidia/cu13/lib/libcublas.so.13" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$libs_dir" \
        "${library_packages[@]}"
fi
libs="$(cd "$libs_dir/nvidia/cu13/lib" && pwd)"

step "link folder $link_root/lib: unversioned names, stub libcuda.so (SONAME libcuda.so.1)"
mkdir -p "$link_root/lib"
link_lib="$(cd "$link_root/lib" && pwd)"
for soname in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
    ln -sfn "$libs/$soname" "$link_lib/$soname"
    ln -sfn "$libs/$soname" "$link_lib/${soname%.so.*}.so"
done
ln -sfn "$CUDA_ROOT/lib/libcudart.so.13" "$link_lib/libcudart.so"   # candle's kernels (libmoe)
grep -oE '^\s+fn cu[A-Z][A-Za-z0-9_]*\(' "$cudarc_sys" | sed -E 's/^\s+fn (cu[A-Za-z0-9_]+)\(/\1/' \
    | sort -u | sed 's/.*/void &(void) {}/' >"$link_root/cuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link_lib/libcuda.so" "$link_root/cuda_stub.c"
echo "$(wc -l <"$link_root/cuda_stub.c") driver functions stubbed"
export CUDA_TOOLKIT_ROOT_DIR
CUDA_TOOLKIT_ROOT_DIR="$(cd "$link_root" && pwd)"

step "cargo +stable test --no-run (profile $profile)"
export CARGO_TERM_COLOR=never
messages="$link_root/cargo-messages.json"
(cd "$crate" && cargo +stable test --locked --profile "$profile" --lib --no-run \
    --message-format=json-render-diagnostics) >"$messages"
exe="$(jq -r 'select(.reason == "compiler-artifact" and .profile.test and .executable != null)
              | .executable' "$messages" | tail -n 1)"
[ -n "$exe" ] || { echo "no test executable in cargo's messages" >&2; exit 1; }

step "$out_dir: the stripped executable and run.sh"
mkdir -p "$out_dir"
strip -o "$out_dir/candle-check" "$exe"
cat >"$out_dir/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs the candle integration tests, the GPU one included, with the CUDA libraries of the
# Python install's pip packages (nvidia/*/lib) and the system's NVIDIA driver. PYTHON names the
# Python whose packages to use (default: python3, else /opt/torch/.venv/bin/python3).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
"$python" -c 'import nvidia' 2>/dev/null || python=/opt/torch/.venv/bin/python3
nvidia_libs="$("$python" -c 'import glob, os, nvidia
print(":".join(d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, "*", "lib")))))')"
export LD_LIBRARY_PATH="$nvidia_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/candle-check" --include-ignored "$@"
EOF
chmod +x "$out_dir/run.sh"
readelf -d "$out_dir/candle-check" | grep NEEDED
ls -l "$out_dir"
