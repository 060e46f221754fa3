//! How the kernel crate (`kernels-gpu`) is built to PTX, shared by `host/build.rs` (which embeds
//! the PTX), `cargo xtask ptx` (which checks it with `ptxas`) and `cargo xtask package` (which
//! ships it in the published crate); the xtasks include this file by path, so the PTX that is
//! checked and shipped is built exactly like the PTX that is embedded.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// File name of the PTX the kernel crate's build writes.
pub const PTX_NAME: &str = "lserve_kernels.ptx";

/// The architectures the library's PTX is built for, oldest first: the host loads the newest
/// one the device runs (`sm_90a`, architecture-specific, runs on compute capability 9.0 only).
pub const ARCHES: [&str; 3] = ["sm_80", "sm_90", "sm_90a"];

/// The architecture the test-kernel module is built for (the tests run on Hopper).
pub const TEST_ARCH: &str = "sm_90";

/// Kernels whose PTX states their launch bounds (`.maxntid`, and `.minnctapersm` where given:
/// what CUDA C's `__launch_bounds__(threads, blocks)` emits; rustc's NVPTX back end has no
/// attribute for it): entry-name prefix, threads per block, blocks that must fit an SM at once.
/// Without the block size the driver's compiler may give a kernel more registers than its block
/// can hold (`CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES` at launch); the block count caps the registers
/// so that many blocks are resident (the scorer's occupancy: `kernels-gpu/src/select/DESIGN.md`).
pub const LAUNCH_BOUNDS: [(&str, u32, Option<u32>); 3] = [
    (
        "prefill_wgmma_",
        lserve_abi::prefill::WGMMA_PREFILL_THREADS,
        None,
    ),
    (
        "decode_attention_int4_",
        lserve_abi::decode::DECODE_THREADS,
        Some(lserve_abi::decode::coded_blocks_per_sm(4)),
    ),
    (
        "score_pages_",
        lserve_abi::select::SCORE_THREADS,
        Some(lserve_abi::select::SCORE_BLOCKS_PER_SM),
    ),
];

/// `ptx` with the launch bounds [`LAUNCH_BOUNDS`] names on each of its entries (between the
/// parameter list and the body); the rest unchanged. An entry that states a block size already
/// keeps its own bounds.
pub fn with_launch_bounds(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 64 * LAUNCH_BOUNDS.len());
    let mut pending = None;
    for line in ptx.split_inclusive('\n') {
        if let Some((_, rest)) = line.split_once(".entry ") {
            let name = rest.split('(').next().unwrap_or("").trim();
            pending = LAUNCH_BOUNDS
                .iter()
                .find(|(prefix, _, _)| name.starts_with(prefix))
                .map(|&(_, threads, blocks)| (threads, blocks));
        }
        if line.trim_start().starts_with(".maxntid") {
            pending = None; // already stated
        }
        if line.trim() == "{" {
            if let Some((threads, blocks)) = pending.take() {
                out.push_str(&format!(".maxntid {threads}, 1, 1\n"));
                if let Some(blocks) = blocks {
                    out.push_str(&format!(".minnctapersm {blocks}\n"));
                }
            }
        }
        out.push_str(line);
    }
    out
}

/// One PTX module lserve embeds: the library's kernels for an architecture, or the test kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtxModule {
    /// `-C target-cpu` of the build.
    pub arch: &'static str,
    /// The kernel crate's `test-kernels` feature: the device-primitive test kernels only.
    pub test_kernels: bool,
}

impl PtxModule {
    /// The library's kernels for every architecture in [`ARCHES`].
    pub fn library() -> impl Iterator<Item = PtxModule> {
        ARCHES.into_iter().map(|arch| PtxModule {
            arch,
            test_kernels: false,
        })
    }

    /// The test-kernel module.
    pub const TESTS: PtxModule = PtxModule {
        arch: TEST_ARCH,
        test_kernels: true,
    };

    /// The module's file name where lserve keeps it (`OUT_DIR`, the package's `ptx/`):
    /// `lserve_kernels.sm_90.ptx`, `lserve_test_kernels.sm_90.ptx`.
    pub fn file_name(&self) -> String {
        let stem = if self.test_kernels {
            "lserve_test_kernels"
        } else {
            "lserve_kernels"
        };
        format!("{stem}.{}.ptx", self.arch)
    }

    /// A target directory of the module's own under `root` (the builds differ in flags and
    /// features, and run in parallel).
    pub fn target_dir(&self, root: &Path) -> PathBuf {
        let tests = if self.test_kernels { "-tests" } else { "" };
        root.join(format!("{}{tests}", self.arch))
    }

    /// `rustup run <toolchain> cargo build --release` of the kernel crate in `kernel_dir` for
    /// this module into `target_dir` ([`kernel_build_command`]).
    pub fn build_command(&self, kernel_dir: &Path, toolchain: &str, target_dir: &Path) -> Command {
        let mut cmd = kernel_build_command(kernel_dir, toolchain, target_dir, self.arch);
        if self.test_kernels {
            cmd.args(["--features", "test-kernels"]);
        }
        cmd
    }
}

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

/// Builds `modules` from the kernel crate in `kernel_dir` with `toolchain`, all at once (one
/// child `cargo` each, in its own target directory under `target_root`), and copies each PTX to
/// `out_dir` under its [`PtxModule::file_name`]. An error says which build failed and why.
pub fn build_modules(
    kernel_dir: &Path,
    toolchain: &str,
    target_root: &Path,
    modules: &[PtxModule],
    out_dir: &Path,
) -> Result<(), String> {
    let mut children = Vec::new();
    for m in modules {
        let target_dir = m.target_dir(target_root);
        let child = m
            .build_command(kernel_dir, toolchain, &target_dir)
            .spawn()
            .map_err(|e| format!("could not run `rustup` to build the GPU kernels ({e})"))?;
        children.push((m, target_dir, child));
    }
    let mut failed = Vec::new();
    for (m, target_dir, mut child) in children {
        let ok = child.wait().map(|s| s.success()).unwrap_or(false);
        if !ok {
            failed.push(m.file_name());
            continue;
        }
        let ptx = built_ptx(&target_dir);
        let to = out_dir.join(m.file_name());
        let text =
            fs::read_to_string(&ptx).map_err(|e| format!("reading {}: {e}", ptx.display()))?;
        fs::write(&to, with_launch_bounds(&text))
            .map_err(|e| format!("writing {}: {e}", to.display()))?;
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "building {} failed. The kernels need the toolchain `{toolchain}` with components \
             rust-src, llvm-bitcode-linker-preview, llvm-tools-preview: `rustup toolchain install \
             {toolchain} --profile minimal -c rust-src -c llvm-bitcode-linker-preview -c \
             llvm-tools-preview`",
            failed.join(", ")
        ))
    }
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
