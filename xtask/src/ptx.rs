//! `cargo xtask ptx`: build the PTX, check it with `ptxas -v`, report per kernel, fail on spills
//! and on kernels that grew past the committed baseline ([`crate::baseline`]).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::baseline;
use crate::kernel_build::{built_ptx, kernel_build_command, toolchain_channel, with_launch_bounds};

/// The most parameters a production kernel entry point may take: each takes its one argument
/// struct from `lserve-abi` (issue "One shape inside": no positional pointer lists).
pub const MAX_ENTRY_PARAMS: usize = 4;

/// The committed baseline of `arch`, relative to the workspace root.
pub fn baseline_path(arch: &str) -> String {
    format!("kernels-gpu/ptx-baseline-{arch}.txt")
}

/// What `ptxas -v` says about one function.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct KernelInfo {
    pub name: String,
    pub entry: bool,
    pub registers: u32,
    pub shared_bytes: u32,
    pub barriers: u32,
    pub stack_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// Builds and checks the PTX for `arch`; with `bless`, rewrites the baseline from this build
/// (after the spill check passed) instead of comparing with it.
pub fn run(root: &Path, arch: &str, bless: bool) -> Result<(), String> {
    if !arch.starts_with("sm_") {
        return Err(format!("--arch {arch}: expected sm_XX"));
    }
    let kernel_dir = root.join("kernels-gpu");
    let channel = check_toolchains(root, &kernel_dir)?;
    let ptx = build_ptx(&kernel_dir, &channel, arch)?;
    let ptxas = find_ptxas()?;
    let cubin = root.join("target/ptx-check.cubin");
    fs::create_dir_all(root.join("target")).map_err(|e| e.to_string())?;
    let output = Command::new(&ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .arg(&ptx)
        .arg("-o")
        .arg(&cubin)
        .output()
        .map_err(|e| format!("running {}: {e}", ptxas.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if !output.status.success() {
        return Err(format!("ptxas rejected {}:\n{text}", ptx.display()));
    }
    let ptx_text =
        fs::read_to_string(&ptx).map_err(|e| format!("reading {}: {e}", ptx.display()))?;
    let too_many: Vec<String> = entry_params(&ptx_text)
        .into_iter()
        .filter(|(_, n)| *n > MAX_ENTRY_PARAMS)
        .map(|(name, n)| format!("{name} ({n})"))
        .collect();
    let kernels = parse_ptxas(&text);
    if kernels.is_empty() {
        return Err(format!("ptxas reported no functions:\n{text}"));
    }
    // Kernels allowed to spill on every architecture, and on this one only.
    let mut allowed = read_allow_list(&kernel_dir.join("spills-allowed.txt"))?;
    allowed.extend(read_allow_list(
        &kernel_dir.join(format!("spills-allowed-{arch}.txt")),
    )?);
    let mut report = format!(
        "PTX {} (toolchain {channel}), ptxas {} -arch={arch}\n\n",
        ptx.display(),
        ptxas.display()
    );
    report.push_str(&table(&kernels));
    report
        .push_str("\n(shared = static shared memory; dynamic shared memory is sized at launch)\n");
    let spilling: Vec<&KernelInfo> = kernels
        .iter()
        .filter(|k| k.spill_stores + k.spill_loads > 0)
        .collect();
    let forbidden: Vec<&str> = spilling
        .iter()
        .map(|k| k.name.as_str())
        .filter(|n| !allowed.contains(*n))
        .collect();
    if forbidden.is_empty() {
        let _ = writeln!(
            report,
            "spills: none outside kernels-gpu/spills-allowed[-{arch}].txt"
        );
    } else {
        let _ = writeln!(report, "SPILLS not allowed: {}", forbidden.join(", "));
    }
    let mut failures = Vec::new();
    if too_many.is_empty() {
        let _ = writeln!(
            report,
            "entry points: none takes more than {MAX_ENTRY_PARAMS} parameters"
        );
    } else {
        failures.push(format!(
            "entry points with more than {MAX_ENTRY_PARAMS} parameters: {}",
            too_many.join(", ")
        ));
    }
    if !forbidden.is_empty() {
        failures.push(format!(
            "register spills in {} (list a kernel in kernels-gpu/spills-allowed[-{arch}].txt to allow it)",
            forbidden.join(", ")
        ));
    }
    let current = baseline::from_kernels(&kernels);
    let baseline_file = root.join(baseline_path(arch));
    if !bless {
        if let Err(e) = check_baseline(&baseline_file, arch, &current, &mut report) {
            failures.push(e);
        }
    } else if failures.is_empty() {
        fs::write(&baseline_file, baseline::render(arch, &current))
            .map_err(|e| format!("writing {}: {e}", baseline_file.display()))?;
        let _ = writeln!(
            report,
            "baseline: wrote {} ({} kernels)",
            baseline_path(arch),
            current.len()
        );
    } else {
        let _ = writeln!(report, "baseline: not written (spills)");
    }
    print!("{report}");
    let path = root.join("target/ptx-report.txt");
    fs::write(&path, &report).map_err(|e| format!("writing {}: {e}", path.display()))?;
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

/// Compares `current` with the baseline file of `arch` (missing: empty), appends the differences
/// to `report`; an error when a kernel grew or is not listed.
fn check_baseline(
    file: &Path,
    arch: &str,
    current: &baseline::Baseline,
    report: &mut String,
) -> Result<(), String> {
    let path = baseline_path(arch);
    let committed = match fs::read_to_string(file) {
        Ok(text) => baseline::parse(&text).map_err(|e| format!("{}: {e}", file.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let _ = writeln!(report, "\nno baseline file {path}");
            baseline::Baseline::new()
        }
        Err(e) => return Err(format!("reading {}: {e}", file.display())),
    };
    let comparison = baseline::compare(&committed, current);
    let _ = writeln!(report, "\nbaseline {path}:");
    report.push_str(&comparison.report());
    if comparison.passes() {
        let _ = writeln!(report, "no kernel grew, none unlisted");
        Ok(())
    } else {
        Err(format!(
            "{} kernel(s) grew past {path}, {} not in it (see above; after a deliberate change, \
             `cargo xtask ptx --arch {arch} --bless` rewrites it)",
            comparison.grown.len(),
            comparison.added.len(),
        ))
    }
}

/// Both `rust-toolchain.toml` files must name the same channel; returns it.
fn check_toolchains(root: &Path, kernel_dir: &Path) -> Result<String, String> {
    let workspace = toolchain_channel(&root.join("rust-toolchain.toml"))?;
    let kernels = toolchain_channel(&kernel_dir.join("rust-toolchain.toml"))?;
    if workspace != kernels {
        return Err(format!(
            "toolchain mismatch: rust-toolchain.toml says {workspace}, kernels-gpu/rust-toolchain.toml says {kernels}"
        ));
    }
    Ok(kernels)
}

/// Builds the kernel crate like `host/build.rs` does; returns the `.ptx` path.
fn build_ptx(kernel_dir: &Path, channel: &str, arch: &str) -> Result<PathBuf, String> {
    let target_dir = kernel_dir.join("target");
    let mut cmd = kernel_build_command(kernel_dir, channel, &target_dir, arch);
    let status = cmd.status().map_err(|e| format!("running rustup: {e}"))?;
    if !status.success() {
        return Err(format!(
            "building the kernels with {channel} failed (is the toolchain installed? \
             `rustup toolchain install` in kernels-gpu/ installs it with its components)"
        ));
    }
    let built = built_ptx(&target_dir);
    let text =
        fs::read_to_string(&built).map_err(|e| format!("no PTX at {}: {e}", built.display()))?;
    // The PTX as the library embeds it (the launch bounds added, `kernel_build.rs`).
    let ptx = built.with_extension("bounded.ptx");
    fs::write(&ptx, with_launch_bounds(&text))
        .map_err(|e| format!("writing {}: {e}", ptx.display()))?;
    Ok(ptx)
}

/// `ptxas`: `$PTXAS`, else on `PATH`, else in Python's `nvidia` packages (PyPI
/// `nvidia-cuda-nvcc`: `nvidia/cu13/bin/ptxas`, or `nvidia/cuda_nvcc/bin/ptxas` for 12.x).
fn find_ptxas() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("PTXAS") {
        return Ok(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("ptxas");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    let script = "import importlib.util, os\n\
                  s = importlib.util.find_spec('nvidia')\n\
                  for p in (s.submodule_search_locations if s else []):\n\
                  \x20   for sub in ('cu13', 'cuda_nvcc'):\n\
                  \x20       print(os.path.join(p, sub, 'bin', 'ptxas'))\n";
    if let Ok(out) = Command::new("python3").args(["-c", script]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let candidate = PathBuf::from(line.trim());
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(
        "ptxas not found: set PTXAS, put it on PATH, or `pip install nvidia-cuda-nvcc` (13.0.x)"
            .into(),
    )
}

fn read_allow_list(path: &Path) -> Result<BTreeSet<String>, String> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(text
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeSet::new()),
        Err(e) => Err(format!("reading {}: {e}", path.display())),
    }
}

/// Each `.entry` of a PTX module with its number of `.param`s, in order of appearance.
pub fn entry_params(ptx: &str) -> Vec<(String, usize)> {
    ptx.split(".entry ")
        .skip(1)
        .filter_map(|chunk| {
            let name: String = chunk
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let open = chunk.find('(')?;
            let close = chunk.find(')')?;
            (open < close && !name.is_empty())
                .then(|| (name, chunk[open..close].matches(".param").count()))
        })
        .collect()
}

/// The number just before `unit` in `line` (`"Used 18 registers"`, `"registers"` -> 18).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].split_whitespace().next_back()?.parse().ok()
}

/// Parses `ptxas -v` output into one record per function, in order of appearance.
pub fn parse_ptxas(text: &str) -> Vec<KernelInfo> {
    let mut kernels: Vec<KernelInfo> = Vec::new();
    let mut entries = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(name) = rest.split('\'').next() {
                entries.insert(name.to_string());
            }
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            let name = rest.trim().to_string();
            kernels.push(KernelInfo {
                entry: entries.contains(&name),
                name,
                ..Default::default()
            });
        } else if let Some(k) = kernels.last_mut() {
            if line.contains("stack frame") {
                k.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                k.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                k.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("registers") {
                k.registers = number_before(line, "registers").unwrap_or(0);
                k.barriers = number_before(line, "barriers").unwrap_or(0);
                k.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    kernels
}

fn table(kernels: &[KernelInfo]) -> String {
    let width = kernels
        .iter()
        .map(|k| k.name.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut out = format!(
        "{:<width$}  {:>4}  {:>6}  {:>4}  {:>5}  {:>9}  {:>8}\n",
        "kernel", "regs", "shared", "bars", "stack", "spill st", "spill ld"
    );
    let _ = writeln!(out, "{}", "-".repeat(width + 49));
    for k in kernels {
        let name = if k.entry {
            k.name.clone()
        } else {
            format!("{} (fn)", k.name)
        };
        let _ = writeln!(
            out,
            "{:<width$}  {:>4}  {:>6}  {:>4}  {:>5}  {:>9}  {:>8}",
            name,
            k.registers,
            k.shared_bytes,
            k.barriers,
            k.stack_bytes,
            k.spill_stores,
            k.spill_loads
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_verbose_output() {
        let text = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'k1' for 'sm_90'\n\
            ptxas info    : Function properties for k1\n\
            \x20   8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
            ptxas info    : Used 168 registers, used 1 barriers, 2048 bytes smem, 384 bytes cmem[0]\n\
            ptxas info    : Compile time = 2.0 ms\n\
            ptxas info    : Function properties for helper\n\
            \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Compiling entry function 'k2' for 'sm_90'\n\
            ptxas info    : Function properties for k2\n\
            \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 10 registers, used 0 barriers\n";
        let ks = parse_ptxas(text);
        assert_eq!(ks.len(), 3);
        assert_eq!(
            ks[0],
            KernelInfo {
                name: "k1".into(),
                entry: true,
                registers: 168,
                shared_bytes: 2048,
                barriers: 1,
                stack_bytes: 8,
                spill_stores: 4,
                spill_loads: 12,
            }
        );
        assert!(!ks[1].entry);
        assert_eq!(
            (ks[2].name.as_str(), ks[2].registers, ks[2].shared_bytes),
            ("k2", 10, 0)
        );
    }

    #[test]
    fn counts_entry_parameters() {
        let ptx = ".visible .entry one(\n\t.param .align 8 .b8 one_param_0[104]\n)  // @one\n{\n}\n\
            .visible .entry two(\n\t.param .u64 .ptr .align 1 two_param_0,\n\t.param .u32 two_param_1\n)\n{\n}\n\
            .visible .entry none()\n{\n}\n";
        assert_eq!(
            entry_params(ptx),
            vec![("one".into(), 1), ("two".into(), 2), ("none".into(), 0)]
        );
    }

    #[test]
    fn workspace_and_kernel_toolchains_agree() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let channel = check_toolchains(root, &root.join("kernels-gpu")).unwrap();
        assert!(channel.starts_with("nightly-"), "{channel}");
    }
}
