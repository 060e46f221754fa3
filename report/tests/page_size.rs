//! The page-size study's report on a fixture (`tests/fixtures/page-size/`: the files
//! `page_size_study --out` writes; made-up numbers, not results): the targets' verdicts, the
//! tables and the three PNGs; and the committed report is what the committed data make.

use std::fs;
use std::path::{Path, PathBuf};

use lserve_report::page_size::{generate, Options};

fn out_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = fs::remove_dir_all(&dir);
    dir
}

#[test]
fn writes_the_page_size_report_from_a_fixture() {
    let w = generate(&Options {
        data: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/page-size"),
        out: out_dir("page-size-fixture"),
    })
    .unwrap();
    assert_eq!(w.settings, 8);
    let md = fs::read_to_string(&w.markdown).unwrap();
    assert!(md.contains("- **Contexts**: a made-up fixture (not results)."));
    // Hierarchical 0.795 against flat 16's 0.80: half a point, within 1; 29.5 above flat 64.
    assert!(
        md.contains(
            "| hierarchical 64/16 within 1 point of flat 16 | 1024 | bf16 | -0.50 ± 0.20 | **yes** |"
        ),
        "{md}"
    );
    assert!(
        md.contains("| hierarchical 64/16 above flat 64 | 1024 | bf16 | +29.50 ± 0.30 | **yes** |"),
        "{md}"
    );
    // The worst 8-bit loss is flat 64's 0.8 points: more than 0.5.
    assert!(
        md.contains("the worst layout (flat 64) | -0.80 ± 0.10 | **no** |"),
        "{md}"
    );
    assert!(
        md.contains(
            "| hierarchical 64/16 | 64 | 16 | 79.50 ± 1.00 | 79.50 ± 1.00 | +0.00 ± 0.10 |"
        ),
        "{md}"
    );
    assert!(md.contains("| 1024 | flat 16 | 48.0 | 100.0 |"), "{md}");
    assert_eq!(w.pngs.len(), 3);
    for p in &w.pngs {
        let bytes = fs::read(p).unwrap();
        assert!(bytes.len() > 1000 && bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
        let name = p.file_name().unwrap().to_string_lossy();
        assert!(md.contains(&format!("]({name})")), "REPORT.md links {name}");
    }
}

#[test]
fn a_missing_folder_is_an_error_naming_its_file() {
    let err = generate(&Options {
        data: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/no-such-study"),
        out: out_dir("page-size-missing"),
    })
    .unwrap_err();
    assert!(err.contains("no-such-study/summary.tsv"), "{err}");
}

/// `docs/page-size/REPORT.md` is what the generator makes of the study's files committed beside
/// it (`docs/page-size/data/`): regenerate it after changing either (`cargo run -p
/// lserve-report --bin lserve-page-size-report -- --data docs/page-size/data --out
/// docs/page-size`).
#[test]
fn the_committed_page_size_report_is_current() {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/page-size");
    let w = generate(&Options {
        data: docs.join("data"),
        out: out_dir("page-size-committed"),
    })
    .unwrap();
    let made = fs::read_to_string(&w.markdown).unwrap();
    let committed = fs::read_to_string(docs.join("REPORT.md")).unwrap();
    assert!(
        made == committed,
        "docs/page-size/REPORT.md is stale; regenerate it"
    );
}
