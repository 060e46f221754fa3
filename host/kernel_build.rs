//! How the kernel crate (`kernels-gpu`) is built to PTX, shared by `host/build.rs` (which embeds
//! the PTX) and `cargo xtask ptx` (which checks it with `ptxas`; it includes this file by path),
//! so the PTX that is checked is built exactly like the PTX that ships.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// File name of the PTX the kernel crate's build writes.
pub const PTX_NAME: &str = "lserve_kernels.ptx";

/// `rustup run <toolchain> cargo build --release` of the kernel crate in `kernel_dir` for the
/// NVPTX target and `-C target-cpu=<arch>` into `target_dir`, with the calling cargo's
/// `CARGO*` / `RUST*` variables (toolchain, flags, jobserver) removed from its environment.
///
/// PTX ISA 8.0 (CUDA 12.0 drivers and later) is requested: the decode kernel's tensor-map bulk
/// copies (`cp.async.bulk.tensor`, `mbarrier` transaction counts) need it; 7.8 is the back end's
/// default.
pub fn kernel_build_command(
    kernel_dir: &Path,
    toolchain: &str,
    target_dir: &Path,
    arch: &str,
) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.current_dir(kernel_dir)
        .args(["run", toolchain, "cargo", "build", "--release", "--locked"])
        .args(["--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core"])
        .arg("--target-dir")
        .arg(target_dir);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        let keep = key == "CARGO_HOME" || key == "RUSTUP_HOME";
        if !keep && (key.starts_with("CARGO") || key.starts_with("RUST")) {
            cmd.env_remove(&key);
        }
    }
    cmd.env(
        "CARGO_ENCODED_RUSTFLAGS",
        format!("-Ctarget-cpu={arch}\x1f-Ctarget-feature=+ptx80"),
    );
    cmd
}

/// Where [`kernel_build_command`] leaves the PTX under `target_dir`.
pub fn built_ptx(target_dir: &Path) -> PathBuf {
    target_dir
        .join("nvptx64-nvidia-cuda/release")
        .join(PTX_NAME)
}

/// The `channel` of a `rust-toolchain.toml` (the kernel crate's pins its nightly there).
pub fn toolchain_channel(path: &Path) -> Result<String, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    text.lines()
        .filter_map(|line| line.trim().strip_prefix("channel"))
        .filter_map(|rest| rest.trim().strip_prefix('='))
        .map(|value| value.trim().trim_matches('"').to_string())
        .next()
        .ok_or_else(|| format!("no channel in {}", path.display()))
}
