//! `lserve-fidelity-report --run DIR [--run DIR ...] --out DIR [--layer-budget B]`: the
//! markdown report with PNG plots of the SmolLM2 member's fidelity runs (see the library's
//! `fidelity` module).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Writes REPORT.md and PNG plots from `fidelity --out` folders.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// A folder `fidelity --out` wrote (`nll.tsv`, `layers.tsv`, `report.md`); repeat for
    /// several runs (one per head pattern).
    #[arg(long = "run", required = true)]
    runs: Vec<PathBuf>,
    /// Where REPORT.md and the PNGs go.
    #[arg(long)]
    out: PathBuf,
    /// The budget the per-layer plot shows [default: the largest one read].
    #[arg(long)]
    layer_budget: Option<usize>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let opts = lserve_report::fidelity::Options {
        runs: args.runs,
        out: args.out,
        layer_budget: args.layer_budget,
    };
    match lserve_report::fidelity::generate(&opts) {
        Ok(w) => {
            println!(
                "lserve-fidelity-report: {} ({} settings; {} plots)",
                w.markdown.display(),
                w.settings,
                w.pngs.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lserve-fidelity-report: {e}");
            ExitCode::FAILURE
        }
    }
}
