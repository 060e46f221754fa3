//! `cargo xtask gpu-bundle`: every GPU test and bench executable of the workspace, built in
//! release and stripped, in one folder with a `run.sh` for the GPU machine (which has no Rust
//! toolchain). The CPU-only test executables stay out (CI runs them, `scripts/test.sh`): with
//! them the folder passed the 64 MiB the GPU machine takes (about 66 MiB on 2026-12-02).
//!
//! Layout of the folder: `tests/<name>` (the GPU integration tests by name), `benches/<name>` and
//! `benches/*.py`, `bin/lserve-report` (the report
//! generator, `report/`), `COMMIT` (the commit it was built from), `run.sh`. GPU test executables
//! are the integration tests named `gpu_*` (`tests/gpu_*.rs`); `run.sh sanitize` runs those under
//! compute-sanitizer; `run.sh report` runs the benches and then `bin/lserve-report`.
//! `tests/gpu_real_activations` reads a data file the bundle does not hold
//! (`scripts/dump_activations.sh`); `run.sh` looks for it and lists that executable as NOT RUN
//! without it.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::json::Json;

/// The folder must stay below this (what fits the transfer to the GPU machine).
const MAX_BUNDLE_BYTES: u64 = 64 * 1024 * 1024;

/// One built executable to ship.
struct Artifact {
    /// File name inside the bundle.
    name: String,
    path: PathBuf,
    /// An integration test named `gpu_*`.
    gpu: bool,
}

pub fn run(root: &Path, out: &Path) -> Result<(), String> {
    prepare_out_dir(out)?;
    let mut names = BTreeSet::new();
    // xtask's own tests check the source tree, and lserve-report's read fixtures from it; the GPU
    // machine has neither (and both are CPU tests).
    let tests = build(
        root,
        &[
            "test",
            "--release",
            "--workspace",
            "--exclude",
            "xtask",
            "--exclude",
            REPORT_PACKAGE,
            "--no-run",
        ],
        false,
        &mut names,
    )?;
    let benches = build(
        root,
        &[
            "bench",
            "--workspace",
            "--exclude",
            "xtask",
            "--exclude",
            REPORT_PACKAGE,
            "--benches",
            "--no-run",
        ],
        true,
        &mut names,
    )?;
    if tests.is_empty() {
        return Err("cargo built no test executables".into());
    }
    let report = build_bin(root, REPORT_PACKAGE, REPORT_BIN)?;
    let (mut tests, mut benches) = (tests, benches);
    tests.retain(|a| a.gpu);
    tests.sort_by(|a, b| a.name.cmp(&b.name));
    benches.sort_by(|a, b| a.name.cmp(&b.name));
    fs::create_dir_all(out.join("tests")).map_err(|e| e.to_string())?;
    fs::create_dir_all(out.join("benches")).map_err(|e| e.to_string())?;
    for a in &tests {
        install(&a.path, &out.join("tests").join(&a.name))?;
    }
    for a in &benches {
        install(&a.path, &out.join("benches").join(&a.name))?;
    }
    fs::create_dir_all(out.join("bin")).map_err(|e| e.to_string())?;
    install(&report, &out.join("bin").join(REPORT_BIN))?;
    let commit = commit(root);
    fs::write(out.join("COMMIT"), format!("{commit}\n")).map_err(|e| e.to_string())?;
    let mut scripts = Vec::new();
    if let Ok(dir) = fs::read_dir(root.join("benches")) {
        for entry in dir.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "py") {
                let name = entry.file_name().to_string_lossy().into_owned();
                fs::copy(&path, out.join("benches").join(&name))
                    .map_err(|e| format!("copying {}: {e}", path.display()))?;
                scripts.push(name);
            }
        }
    }
    let script = run_script(&tests, &benches);
    let run_sh = out.join("run.sh");
    fs::write(&run_sh, script).map_err(|e| format!("writing {}: {e}", run_sh.display()))?;
    make_executable(&run_sh)?;

    let size = dir_size(out)?;
    println!(
        "gpu-bundle: {} ({} test executables, {} bench executables, {} python scripts, bin/{REPORT_BIN}; commit {commit}), {:.1} MiB",
        out.display(),
        tests.len(),
        benches.len(),
        scripts.len(),
        size as f64 / (1024.0 * 1024.0)
    );
    for a in &tests {
        println!("  tests/{}{}", a.name, if a.gpu { "   (GPU)" } else { "" });
    }
    for a in &benches {
        println!("  benches/{}", a.name);
    }
    if size > MAX_BUNDLE_BYTES {
        return Err(format!(
            "the bundle is {:.1} MiB, over the 64 MiB limit",
            size as f64 / (1024.0 * 1024.0)
        ));
    }
    println!("copy the folder to the GPU machine and run `./run.sh` there (`./run.sh sanitize` for compute-sanitizer, `./run.sh report` for the benchmark report)");
    Ok(())
}

/// Creates `out`, or empties a previous bundle there; refuses a non-empty folder that is not one.
fn prepare_out_dir(out: &Path) -> Result<(), String> {
    if out.exists() {
        let is_empty = fs::read_dir(out)
            .map_err(|e| e.to_string())?
            .next()
            .is_none();
        if !is_empty && !out.join("run.sh").is_file() {
            return Err(format!(
                "{} exists and is not a gpu bundle; choose another --out",
                out.display()
            ));
        }
        for sub in ["tests", "benches", "bin", "reports"] {
            let p = out.join(sub);
            if p.exists() {
                fs::remove_dir_all(&p).map_err(|e| format!("removing {}: {e}", p.display()))?;
            }
        }
    }
    fs::create_dir_all(out).map_err(|e| format!("creating {}: {e}", out.display()))
}

/// The report generator's package and binary (`report/`), shipped as `bin/lserve-report`.
const REPORT_PACKAGE: &str = "lserve-report";
const REPORT_BIN: &str = "lserve-report";

/// Builds the binary `bin` of `package` with the workspace's `small` profile (release, small)
/// and returns its path.
fn build_bin(root: &Path, package: &str, bin: &str) -> Result<PathBuf, String> {
    let args = [
        "build",
        "--profile",
        "small",
        "--package",
        package,
        "--bin",
        bin,
    ];
    for msg in cargo_artifacts(root, &args)? {
        let target = msg.get("target");
        let is_bin = target
            .and_then(|t| t.get("kind"))
            .and_then(Json::as_array)
            .is_some_and(|k| k.iter().any(|k| k.as_str() == Some("bin")));
        let named = target.and_then(|t| t.get("name")).and_then(Json::as_str) == Some(bin);
        if let (true, true, Some(exe)) =
            (is_bin, named, msg.get("executable").and_then(Json::as_str))
        {
            return Ok(PathBuf::from(exe));
        }
    }
    Err(format!("`cargo {}` reported no executable", args.join(" ")))
}

/// `git rev-parse HEAD` of the tree, with `-dirty` when tracked files differ from it; `unknown`
/// without git.
fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .current_dir(root)
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "HEAD"]) {
        Some(head) if !head.is_empty() => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{head}-dirty")
            } else {
                head
            }
        }
        _ => "unknown".into(),
    }
}

/// Runs `cargo <args>` with JSON messages (its diagnostics rendered on stderr) and returns its
/// `compiler-artifact` messages; an error if cargo fails.
fn cargo_artifacts(root: &Path, args: &[&str]) -> Result<Vec<Json>, String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    println!("gpu-bundle: cargo {}", args.join(" "));
    let output = Command::new(cargo)
        .current_dir(root)
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running cargo: {e}"))?;
    if !output.status.success() {
        return Err(format!("`cargo {}` failed", args.join(" ")));
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| Json::parse(line).ok())
        .filter(|msg| msg.get("reason").and_then(Json::as_str) == Some("compiler-artifact"))
        .collect())
}

/// Runs `cargo <args> --message-format=json` and collects the executables it built (test
/// harnesses: `profile.test`; for benches only `bench` targets).
fn build(
    root: &Path,
    args: &[&str],
    benches_only: bool,
    names: &mut BTreeSet<String>,
) -> Result<Vec<Artifact>, String> {
    let mut artifacts = Vec::new();
    for msg in cargo_artifacts(root, args)? {
        let is_test = msg
            .get("profile")
            .and_then(|p| p.get("test"))
            .and_then(Json::as_bool);
        let Some(exe) = msg.get("executable").and_then(Json::as_str) else {
            continue;
        };
        if is_test != Some(true) {
            continue;
        }
        let target = msg.get("target");
        let name = target
            .and_then(|t| t.get("name"))
            .and_then(Json::as_str)
            .unwrap_or("unnamed");
        let kinds: Vec<&str> = target
            .and_then(|t| t.get("kind"))
            .and_then(Json::as_array)
            .unwrap_or(&[])
            .iter()
            .filter_map(Json::as_str)
            .collect();
        let kind = kinds.first().copied().unwrap_or("unknown");
        if benches_only && kind != "bench" {
            continue;
        }
        let base = match kind {
            "test" | "bench" => name.to_string(),
            other => format!("{name}-{other}"),
        };
        let mut unique = base.clone();
        let mut n = 2;
        while !names.insert(unique.clone()) {
            unique = format!("{base}-{n}");
            n += 1;
        }
        artifacts.push(Artifact {
            name: unique,
            path: PathBuf::from(exe),
            gpu: kind == "test" && name.starts_with("gpu"),
        });
    }
    Ok(artifacts)
}

/// Copies `src` to `dst` stripped (`strip`, else `objcopy --strip-all`, else a plain copy).
fn install(src: &Path, dst: &Path) -> Result<(), String> {
    let stripped = |cmd: &mut Command| {
        cmd.stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let ok = stripped(Command::new("strip").arg("-o").arg(dst).arg(src))
        || stripped(Command::new("objcopy").arg("--strip-all").arg(src).arg(dst));
    if !ok {
        eprintln!(
            "gpu-bundle: could not strip {}; copying it as is",
            src.display()
        );
        fs::copy(src, dst).map_err(|e| format!("copying {}: {e}", src.display()))?;
    }
    make_executable(dst)
}

#[cfg(unix)]
fn make_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
}

#[cfg(not(unix))]
fn make_executable(_: &Path) -> Result<(), String> {
    Ok(())
}

fn dir_size(dir: &Path) -> Result<u64, String> {
    let mut total = 0;
    for entry in fs::read_dir(dir).map_err(|e| e.to_string())?.flatten() {
        let meta = entry.metadata().map_err(|e| e.to_string())?;
        total += if meta.is_dir() {
            dir_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

fn bash_array(items: impl Iterator<Item = String>) -> String {
    items
        .map(|s| format!("\"{s}\""))
        .collect::<Vec<_>>()
        .join(" ")
}

fn run_script(tests: &[Artifact], benches: &[Artifact]) -> String {
    let gpu = bash_array(
        tests
            .iter()
            .filter(|a| a.gpu)
            .map(|a| format!("tests/{}", a.name)),
    );
    let bench = bash_array(benches.iter().map(|a| format!("benches/{}", a.name)));
    RUN_SH
        .replace("@GPU_TESTS@", &gpu)
        .replace("@BENCHES@", &bench)
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# lserve GPU bundle, made by `cargo xtask gpu-bundle`. Run it on the GPU machine:
#
#   ./run.sh            the GPU test executables with --include-ignored, then every bench
#                       executable with --bench; a summary at the end
#   ./run.sh tests      the GPU tests only
#   ./run.sh sanitize   the GPU test executables under compute-sanitizer
#                       (memcheck, racecheck, initcheck, synccheck; SANITIZE_TOOLS picks;
#                       the soak runs LSERVE_SOAK_STEPS steps, default 300; the profiler
#                       test contexts up to LSERVE_PROFILE_MAX_CONTEXT, default 4096)
#   ./run.sh benches    every bench executable, then benches/*.py decode and prefill
#   ./run.sh report     the same as benches, then bin/lserve-report: reports/report/REPORT.md
#                       with PNG plots (tables of every measured number)
#
# Output of each run goes to reports/<name>.txt, the summary to reports/summary.txt, the date,
# host and nvidia-smi's GPU name and driver to reports/machine.txt. The exit
# status is non-zero if anything failed. Extra arguments after the mode go to every test
# executable (e.g. `./run.sh tests gpu_` filters by test name). PROPTEST_CASES is passed through.
#
# tests/gpu_real_activations reads real activations (scripts/dump_activations.sh makes the file;
# it does not fit in the bundle's 64 MiB): LSERVE_ACTIVATIONS names it, else
# activations/smollm2-gpl3.safetensors here or ../gpu-activations/smollm2-gpl3.safetensors beside
# the bundle. Without one that executable is not run, and the summary says so (NOT RUN).
set -u -o pipefail
cd "$(dirname "$0")"

GPU_TESTS=(@GPU_TESTS@)
BENCHES=(@BENCHES@)

MODE="${1:-all}"
[ "$#" -gt 0 ] && shift
REPORTS=reports
mkdir -p "$REPORTS"
SUMMARY="$REPORTS/summary.txt"
FAILED=0
ROWS=()

# Sums the "test result:" lines of a libtest log: "passed failed ignored".
count_results() {
    grep -E '^test result:' "$1" \
        | sed -E 's/.* ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3/' \
        | awk '{p += $1; f += $2; i += $3} END {print p + 0, f + 0, i + 0}'
}

# run_one LABEL LOG COMMAND...: runs, tees to LOG, records a summary row.
run_one() {
    local label="$1" log="$2"
    shift 2
    echo "=== $label: $*" | tee "$log"
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    local counts
    counts=$(count_results "$log")
    ROWS+=("$(printf '%-44s %7s %7s %8s %5s' "$label" $counts "$rc")")
    if [ "$rc" -ne 0 ]; then FAILED=1; fi
}

header() {
    local now
    now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    echo "lserve GPU bundle run: $now on $(hostname)"
    # What the report names as the machine.
    {
        echo "date: $now"
        echo "host: $(hostname)"
        if command -v nvidia-smi >/dev/null 2>&1; then
            nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        fi
    } >"$REPORTS/machine.txt" 2>&1
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    else
        echo "nvidia-smi not found: is this a GPU machine?"
    fi
    if [ -f COMMIT ]; then echo "commit: $(cat COMMIT)"; fi
}

# The real activations for tests/gpu_real_activations (see the top): exports LSERVE_ACTIVATIONS.
for f in "${LSERVE_ACTIVATIONS:-}" activations/smollm2-gpl3.safetensors \
    ../gpu-activations/smollm2-gpl3.safetensors; do
    if [ -n "$f" ] && [ -f "$f" ]; then
        LSERVE_ACTIVATIONS="$(cd "$(dirname "$f")" && pwd)/$(basename "$f")"
        export LSERVE_ACTIVATIONS
        break
    fi
done

# has_data EXE LABEL: whether EXE has the data it reads; if not, a NOT RUN summary row.
has_data() {
    if [ "$(basename "$1")" = gpu_real_activations ] && [ -z "${LSERVE_ACTIVATIONS:-}" ]; then
        echo "=== $2: NOT RUN: no real activations (scripts/dump_activations.sh; LSERVE_ACTIVATIONS)"
        ROWS+=("$(printf '%-44s %7s %7s %8s %5s' "$2" - - - "NOT RUN")")
        return 1
    fi
}

run_tests() {
    local exe
    for exe in "${GPU_TESTS[@]}"; do
        has_data "$exe" "$exe" || continue
        # Its relative errors per run and per layer are on the passing tests' stderr.
        local show=()
        [ "$(basename "$exe")" = gpu_real_activations ] && show=(--show-output)
        run_one "$exe" "$REPORTS/$(basename "$exe").txt" "./$exe" --include-ignored "${show[@]}" "$@"
    done
}

run_benches() {
    local exe py
    for exe in "${BENCHES[@]}"; do
        run_one "$exe" "$REPORTS/bench-$(basename "$exe").txt" "./$exe" --bench
    done
    # Peer numbers in the same run (torch SDPA, cuDNN and flash back ends).
    for py in benches/*.py; do
        [ -f "$py" ] || continue
        for what in decode prefill; do
            run_one "$py $what" "$REPORTS/bench-$(basename "$py" .py)-$what.txt" python3 "$py" "$what"
        done
    done
}

# The report of the bench logs in reports/ (bin/lserve-report): reports/report/.
run_report() {
    run_one "bin/lserve-report" "$REPORTS/report.txt" \
        ./bin/lserve-report --reports "$REPORTS" --out "$REPORTS/report" --commit-file COMMIT
}

run_sanitize() {
    if ! command -v compute-sanitizer >/dev/null 2>&1; then
        echo "compute-sanitizer not found (it ships with the CUDA toolkit, e.g. /usr/local/cuda/bin)" >&2
        exit 2
    fi
    local exe tool
    # The soak (gpu_session) runs a short version under the tools.
    export LSERVE_SOAK_STEPS="${LSERVE_SOAK_STEPS:-300}"
    # The profiler test measures contexts up to 4K under the tools: racecheck's host memory grows
    # with its contexts (127 GB resident at 1K + 4K on the H200 machine's 128 GiB; killed at 16K).
    export LSERVE_PROFILE_MAX_CONTEXT="${LSERVE_PROFILE_MAX_CONTEXT:-4096}"
    for exe in "${GPU_TESTS[@]}"; do
        has_data "$exe" "sanitize $exe" || continue
        for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
            run_one "$tool $exe" "$REPORTS/sanitize-$tool-$(basename "$exe").txt" \
                compute-sanitizer --tool "$tool" --error-exitcode 97 \
                "./$exe" --include-ignored --test-threads=1 "$@"
        done
    done
}

header | tee "$SUMMARY"
case "$MODE" in
    all) run_tests "$@"; run_benches ;;
    tests) run_tests "$@" ;;
    benches) run_benches ;;
    report) run_benches; run_report ;;
    sanitize) run_sanitize "$@" ;;
    *) echo "usage: $0 [all|tests|benches|report|sanitize] [test filter...]" >&2; exit 2 ;;
esac

{
    echo
    printf '%-44s %7s %7s %8s %5s\n' "executable" "passed" "failed" "ignored" "exit"
    printf '%s\n' "${ROWS[@]}"
    if [ "$FAILED" -ne 0 ]; then echo "RESULT: FAILED"; else echo "RESULT: ok"; fi
} | tee -a "$SUMMARY"
exit "$FAILED"
"#;
