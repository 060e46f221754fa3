//! `cargo xtask package`: the publishable crates. Builds the library's PTX modules from the
//! kernel sources into `host/ptx/` (the only way that folder is written: it is not in git),
//! packages `lserve-abi` and `lserve` with `cargo package`, unpacks both into `target/package/`
//! and checks that the packaged PTX is byte for byte what the sources build. `consumer-check/`
//! depends on the unpacked crates: its build (`scripts/test.sh`: stable Rust, offline, no rustup)
//! is the packaged crates' verification, so `cargo package` does not build them itself (its own
//! verification would resolve `lserve-abi` through a scratch registry whose unpacked copy cargo
//! keeps across runs of the same version).

use std::fs;
use std::path::Path;
use std::process::Command;

use crate::kernel_build::{build_modules, toolchain_channel, PtxModule};

pub fn run(root: &Path) -> Result<(), String> {
    let kernel_dir = root.join("kernels-gpu");
    let channel = toolchain_channel(&kernel_dir.join("rust-toolchain.toml"))?;
    let ptx_dir = root.join("host/ptx");
    if ptx_dir.exists() {
        fs::remove_dir_all(&ptx_dir).map_err(|e| format!("clearing {}: {e}", ptx_dir.display()))?;
    }
    fs::create_dir_all(&ptx_dir).map_err(|e| format!("creating {}: {e}", ptx_dir.display()))?;
    let modules: Vec<PtxModule> = PtxModule::library().collect();
    build_modules(
        &kernel_dir,
        &channel,
        &root.join("target/package-ptx"),
        &modules,
        &ptx_dir,
    )?;

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(root)
        .args([
            "package",
            "-p",
            "lserve-abi",
            "-p",
            "lserve",
            "--allow-dirty",
            "--no-verify",
        ])
        .status()
        .map_err(|e| format!("running cargo package: {e}"))?;
    if !status.success() {
        return Err("cargo package failed".into());
    }

    let version = env!("CARGO_PKG_VERSION");
    let package_dir = root.join("target/package");
    for krate in ["lserve-abi", "lserve"] {
        let unpacked = package_dir.join(format!("{krate}-{version}"));
        if unpacked.exists() {
            fs::remove_dir_all(&unpacked)
                .map_err(|e| format!("clearing {}: {e}", unpacked.display()))?;
        }
        let status = Command::new("tar")
            .current_dir(&package_dir)
            // `-m`: the files get the time of unpacking (the archive's are fixed), so builds
            // that depend on the unpacked crates see them change.
            .args(["-xmzf", &format!("{krate}-{version}.crate")])
            .status()
            .map_err(|e| format!("running tar: {e}"))?;
        if !status.success() {
            return Err(format!("unpacking {krate}-{version}.crate failed"));
        }
    }
    let packaged = package_dir.join(format!("lserve-{version}/ptx"));
    for m in &modules {
        let name = m.file_name();
        let built = fs::read(ptx_dir.join(&name)).map_err(|e| format!("{name}: {e}"))?;
        let shipped = fs::read(packaged.join(&name))
            .map_err(|e| format!("the package has no {name}: {e}"))?;
        if built != shipped {
            return Err(format!(
                "the packaged {name} differs from the kernel sources' build"
            ));
        }
        println!(
            "ptx/{name}: {} bytes, as the kernel sources build it",
            built.len()
        );
    }
    for krate in ["lserve-abi", "lserve"] {
        let path = root.join(format!("target/package/{krate}-{version}.crate"));
        let size = fs::metadata(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .len();
        println!("{}: {size} bytes", path.display());
    }
    Ok(())
}
