//! `lserve-report [--reports DIR] [--out DIR] [--commit-file FILE] [--machine-file FILE]`: the
//! markdown report with PNG plots of one GPU bundle run's bench logs (see the library docs).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Writes REPORT.md and PNG plots from the bench logs of a GPU bundle run.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// The folder of logs the bundle's run.sh writes (every `bench-*.txt` in it is read).
    #[arg(long, default_value = "reports")]
    reports: PathBuf,
    /// Where REPORT.md and the PNGs go [default: REPORTS/report].
    #[arg(long)]
    out: Option<PathBuf>,
    /// The commit the bundle was built from (what `cargo xtask gpu-bundle` writes to COMMIT).
    #[arg(long, default_value = "COMMIT")]
    commit_file: PathBuf,
    /// Date, host and nvidia-smi's CSV of the run [default: REPORTS/machine.txt].
    #[arg(long)]
    machine_file: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let read = |p: &PathBuf| std::fs::read_to_string(p).ok();
    let machine_file = args
        .machine_file
        .clone()
        .unwrap_or_else(|| args.reports.join("machine.txt"));
    let opts = lserve_report::Options {
        out: args
            .out
            .clone()
            .unwrap_or_else(|| args.reports.join("report")),
        commit: read(&args.commit_file),
        machine: read(&machine_file),
        reports: args.reports,
    };
    match lserve_report::generate(&opts) {
        Ok(w) => {
            println!(
                "lserve-report: {} ({} criterion measurements from {} logs; {} plots)",
                w.markdown.display(),
                w.measurements,
                w.logs.len(),
                w.pngs.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lserve-report: {e}");
            ExitCode::FAILURE
        }
    }
}
