//! Compiles the kernel crate (`../kernels-gpu`) to PTX and leaves it in `OUT_DIR` for
//! `include_str!`.
//!
//! The kernels need a pinned nightly (rustc's NVPTX back end, `-Zbuild-std=core`); the host
//! crate does not. So whatever toolchain builds this crate (stable, for a consumer), this script
//! runs `rustup run <pinned nightly> cargo build` in the kernel crate, in its own target dir under
//! `OUT_DIR`, with the outer build's `CARGO*`/`RUST*` variables removed from its environment
//! (`kernel_build.rs`, which `cargo xtask ptx` shares).
//!
//! Environment:
//! - `LSERVE_CUDA_ARCH` (default `sm_90`): the `-C target-cpu` the PTX is built for.
//! - `LSERVE_PTX`: path of a prebuilt `.ptx` to embed instead (no nightly needed).

#[path = "kernel_build.rs"]
mod kernel_build;

use std::env;
use std::fs;
use std::path::PathBuf;

use kernel_build::{built_ptx, kernel_build_command, toolchain_channel, PTX_NAME};

fn main() {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let kernel_dir = manifest_dir.join("../kernels-gpu");
    let abi_dir = manifest_dir.join("../abi");
    println!("cargo:rerun-if-env-changed=LSERVE_CUDA_ARCH");
    println!("cargo:rerun-if-env-changed=LSERVE_PTX");

    let arch = env::var("LSERVE_CUDA_ARCH").unwrap_or_else(|_| "sm_90".to_string());
    println!("cargo:rustc-env=LSERVE_CUDA_ARCH={arch}");

    if let Some(prebuilt) = env::var_os("LSERVE_PTX") {
        let prebuilt = PathBuf::from(prebuilt);
        println!("cargo:rerun-if-changed={}", prebuilt.display());
        fs::copy(&prebuilt, out_dir.join(PTX_NAME))
            .unwrap_or_else(|e| panic!("LSERVE_PTX={}: {e}", prebuilt.display()));
        return;
    }

    for dir in [kernel_dir.join("src"), abi_dir.join("src")] {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    for file in ["Cargo.toml", "rust-toolchain.toml"] {
        println!("cargo:rerun-if-changed={}", kernel_dir.join(file).display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        abi_dir.join("Cargo.toml").display()
    );

    let toolchain = toolchain_channel(&kernel_dir.join("rust-toolchain.toml"))
        .unwrap_or_else(|e| panic!("lserve: {e}"));
    let target_dir = out_dir.join("kernels-target");
    let mut cmd = kernel_build_command(&kernel_dir, &toolchain, &target_dir, &arch);
    let status = cmd.status().unwrap_or_else(|e| {
        panic!("lserve: could not run `rustup` to build the GPU kernels ({e}); install rustup, or set LSERVE_PTX to a prebuilt PTX file")
    });
    if !status.success() {
        panic!(
            "lserve: building the GPU kernels failed. They need the toolchain `{toolchain}` with \
             components rust-src, llvm-bitcode-linker-preview, llvm-tools-preview: run \
             `rustup toolchain install {toolchain} --profile minimal -c rust-src -c \
             llvm-bitcode-linker-preview -c llvm-tools-preview`, or set LSERVE_PTX to a prebuilt PTX file"
        );
    }
    let ptx = built_ptx(&target_dir);
    fs::copy(&ptx, out_dir.join(PTX_NAME))
        .unwrap_or_else(|e| panic!("lserve: no PTX at {}: {e}", ptx.display()));
}
