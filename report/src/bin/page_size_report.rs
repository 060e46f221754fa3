//! `lserve-page-size-report --data DIR --out DIR`: the markdown report with PNG plots of the
//! page-size study (see the library's `page_size` module).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Writes REPORT.md and PNG plots from a `page_size_study --out` folder.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// The folder `page_size_study --out` wrote (`summary.tsv`, `strength.tsv`, `paired.tsv`,
    /// `run.md`).
    #[arg(long)]
    data: PathBuf,
    /// Where REPORT.md and the PNGs go.
    #[arg(long)]
    out: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let opts = lserve_report::page_size::Options {
        data: args.data,
        out: args.out,
    };
    match lserve_report::page_size::generate(&opts) {
        Ok(w) => {
            println!(
                "lserve-page-size-report: {} ({} settings; {} plots)",
                w.markdown.display(),
                w.settings,
                w.pngs.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lserve-page-size-report: {e}");
            ExitCode::FAILURE
        }
    }
}
