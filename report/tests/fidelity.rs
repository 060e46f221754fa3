//! The fidelity report on a fixture (`tests/fixtures/fidelity/`: two runs in the formats the
//! SmolLM2 member's `fidelity --out` writes; made-up numbers, not results): the paired ΔNLL,
//! the comparisons at one budget and both PNGs.

use std::fs;
use std::path::{Path, PathBuf};

use lserve_report::fidelity::{generate, Options};

fn fixture(run: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fidelity")
        .join(run)
}

#[test]
fn writes_the_fidelity_report_from_two_runs() {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fidelity-fixture");
    let _ = fs::remove_dir_all(&out);
    let w = generate(&Options {
        runs: vec![fixture("run-a"), fixture("run-b")],
        out: out.clone(),
        layer_budget: Some(512),
    })
    .unwrap();
    assert_eq!(w.settings, 9);
    let md = fs::read_to_string(&w.markdown).unwrap();
    // Every token of flat-b512 is dense's + 0.1: ΔNLL 0.1 with no spread, 5% of dense's 2.0.
    assert!(
        md.contains(
            "| run-a | flat-b512 | 2.1000 | +0.1000 ± 0.0000 | +5.00% | 0.8600 | - | 0.0600 |"
        ),
        "{md}"
    );
    // run-b has no dense setting: it is paired with run-a's over the same positions.
    assert!(
        md.contains("| run-b | stream-s0.5-calib | 2.2500 | +0.2500 ± 0.0000 |"),
        "{md}"
    );
    assert!(
        md.contains("| lserve-b512-r4 − flat64-b512 | +0.2000 ± 0.0000 | -0.1000 |"),
        "{md}"
    );
    // Hierarchical +0.5, flat 16 +0.1, logical +0.2: logical closes 0.3 of the 0.4 gap.
    assert!(
        md.contains("share of the gap that logical-b512-r4 closes | 75% |"),
        "{md}"
    );
    assert!(
        md.contains("- prefill 100 tokens, streaming 0 (made up): 1.0s"),
        "{md}"
    );
    assert_eq!(w.pngs.len(), 2);
    for p in &w.pngs {
        let bytes = fs::read(p).unwrap();
        assert!(bytes.len() > 1000 && bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
    }
}

#[test]
fn a_missing_run_is_an_error_naming_it() {
    let err = generate(&Options {
        runs: vec![fixture("no-such-run")],
        out: Path::new(env!("CARGO_TARGET_TMPDIR")).join("fidelity-missing"),
        layer_budget: None,
    })
    .unwrap_err();
    assert!(err.contains("no-such-run/nll.tsv"), "{err}");
}

/// `docs/fidelity/REPORT.md` is what the generator makes of the runs committed beside it
/// (`docs/fidelity/data/`): regenerate it after changing either
/// (`cargo run -p lserve-report --bin lserve-fidelity-report -- --run docs/fidelity/data/8k-s0
/// --run docs/fidelity/data/8k-s05 --run docs/fidelity/data/8k-b2048-calibout --out docs/fidelity
/// --layer-budget 1024`).
#[test]
fn the_committed_fidelity_report_is_current() {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/fidelity");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fidelity-committed");
    let _ = fs::remove_dir_all(&out);
    let w = generate(&Options {
        runs: vec![
            docs.join("data/8k-s0"),
            docs.join("data/8k-s05"),
            docs.join("data/8k-b2048-calibout"),
        ],
        out,
        layer_budget: Some(1024),
    })
    .unwrap();
    let made = fs::read_to_string(&w.markdown).unwrap();
    let committed = fs::read_to_string(docs.join("REPORT.md")).unwrap();
    assert!(
        made == committed,
        "docs/fidelity/REPORT.md is stale; regenerate it"
    );
}
