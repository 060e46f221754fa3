//! Project tasks, run as `cargo xtask <task>` (alias in `.cargo/config.toml`):
//!
//! - `ptx [--arch sm_90] [--bless]`: builds the kernel PTX with the pinned nightly (as
//!   `host/build.rs` does), runs `ptxas -arch=<arch> -v` on it, prints a per-kernel table
//!   (registers, shared memory, stack, spills), writes it to `target/ptx-report.txt`, and fails on
//!   invalid PTX, on spills not listed in `kernels-gpu/spills-allowed.txt`, when the workspace's
//!   and the kernel crate's `rust-toolchain.toml` channels differ, or when a kernel has more
//!   registers, spill bytes or static shared memory than its line in the committed baseline
//!   `kernels-gpu/ptx-baseline-<arch>.txt`, or has no line there. `--bless` rewrites that baseline
//!   from the build instead (still failing on disallowed spills).
//! - `package`: builds the library's PTX from the kernel sources into `host/ptx/`, packages
//!   `lserve-abi` and `lserve` (`target/package/`), and checks the shipped PTX is what the sources
//!   build.
//! - `gpu-bundle [--out DIR]`: builds every GPU test and bench executable (release, stripped)
//!   into one folder (default `./gpu-bundle`) with the report generator (`bin/lserve-report`),
//!   the commit (`COMMIT`) and a `run.sh` to run them all on a GPU machine.

mod baseline;
mod bundle;
mod json;
// How the kernels are built, shared with host/build.rs (which uses all of it).
#[path = "../../host/kernel_build.rs"]
#[allow(dead_code)]
mod kernel_build;
mod package;
mod ptx;

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str =
    "usage: cargo xtask ptx [--arch sm_XX] [--bless] | cargo xtask package | cargo xtask gpu-bundle [--out DIR]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ptx") => {
            let (bless, rest) = flag(&args[1..], "--bless");
            option(&rest, "--arch").and_then(|arch| {
                ptx::run(&workspace_root(), arch.as_deref().unwrap_or("sm_90"), bless)
            })
        }
        Some("package") => {
            option(&args[1..], "--none").and_then(|_| package::run(&workspace_root()))
        }
        Some("gpu-bundle") => option(&args[1..], "--out").and_then(|out| {
            let root = workspace_root();
            let out = out
                .map(PathBuf::from)
                .unwrap_or_else(|| root.join("gpu-bundle"));
            bundle::run(&root, &out)
        }),
        _ => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The value of `--name VALUE` / `--name=VALUE` in `args`; any other argument is an error.
fn option(args: &[String], name: &str) -> Result<Option<String>, String> {
    let mut value = None;
    let mut i = 0;
    while i < args.len() {
        if args[i] == name {
            value = Some(
                args.get(i + 1)
                    .ok_or(format!("{name} needs a value"))?
                    .clone(),
            );
            i += 2;
        } else if let Some(v) = args[i].strip_prefix(&format!("{name}=")) {
            value = Some(v.to_string());
            i += 1;
        } else {
            return Err(format!("unexpected argument `{}`\n{USAGE}", args[i]));
        }
    }
    Ok(value)
}

/// Whether the flag `name` is in `args`, and the other arguments.
fn flag(args: &[String], name: &str) -> (bool, Vec<String>) {
    let rest: Vec<String> = args.iter().filter(|a| *a != name).cloned().collect();
    (rest.len() < args.len(), rest)
}

/// The workspace root: the parent of this crate's directory. `cargo run` (the `xtask` alias) sets
/// `CARGO_MANIFEST_DIR` for the run too; that value wins over the one compiled in, which names
/// another checkout when the build directory was copied from there and cargo kept the binary.
fn workspace_root() -> PathBuf {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}
