//! The generator on a fixture folder (`tests/fixtures/reports/`: hand-made logs in the formats
//! criterion and `benches/torch_sdpa.py` print; made-up numbers, not results): it writes every
//! PNG and the markdown, with the measured numbers and "not measured" for the rest.

use std::fs;
use std::path::{Path, PathBuf};

use lserve_report::{generate, Options};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reports")
}

fn out_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = fs::remove_dir_all(&dir);
    dir
}

fn is_png(path: &Path) -> bool {
    let bytes = fs::read(path).unwrap();
    bytes.len() > 1000 && bytes.starts_with(b"\x89PNG\r\n\x1a\n")
}

#[test]
fn writes_the_markdown_and_every_png_from_a_fixture_folder() {
    let out = out_dir("report-fixture");
    let machine = fs::read_to_string(fixtures().join("machine.txt")).unwrap();
    let w = generate(&Options {
        reports: fixtures(),
        out: out.clone(),
        commit: Some("0123456789abcdef\n".into()),
        machine: Some(machine),
    })
    .unwrap();
    assert_eq!(w.logs.len(), 4);
    let names: Vec<String> = w
        .pngs
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "decode_latency.png",
            "decode_speedup.png",
            "selector.png",
            "prefill_tflops.png",
            "decode_bandwidth.png",
            "page_size_8K.png",
            "page_size_128K.png"
        ]
    );
    for p in &w.pngs {
        assert!(is_png(p), "{} is not a PNG", p.display());
    }
    let md = fs::read_to_string(&w.markdown).unwrap();
    for png in &names {
        assert!(md.contains(&format!("]({png})")), "REPORT.md links {png}");
    }
    assert!(md.contains("- **Date**: 2026-01-01T00:00:00Z"));
    assert!(md.contains("`0123456789abcdef`"));
    assert!(md.contains("NVIDIA H200, 000.00.00, 143771 MiB"));
    // Fixture numbers as criterion printed them, in the tables.
    assert!(md.contains("| `copy/device_to_device_1GiB` | 534.60 µs | 540.00 µs | 545.40 µs |"));
    // A case the logs lack, and one the bench skipped.
    assert!(md.contains("not measured"));
    assert!(md.contains("- `attention/static/b16/262144`: out of memory"));
    // Dense b1 256K / LServe b1 256K, both from the fixture.
    let dense = lserve_report::read_reports(&fixtures()).unwrap().0;
    let ratio = dense.get("attention/dense/b1/262144").unwrap().est()
        / dense.get("step/lserve/b1/262144").unwrap().est();
    assert!(
        md.contains(&format!("{ratio:.3}x")),
        "speedup {ratio:.3}x in the report"
    );
    // Prefill TFLOP/s from the shape: 2 L^2 D Hq / t.
    let t = dense.get("prefill/dense/4096").unwrap().est();
    let tflops = 2.0 * 4096f64 * 4096.0 * 128.0 * 32.0 / t / 1e12;
    assert!(md.contains(&format!("{tflops:.1}")));
    // torch's lines.
    assert!(md.contains("| prefill | cudnn | 1 | 4096 | 330.0 µs | 416.5 TFLOP/s |"));
    assert!(md.contains("unsupported"));
    // The page-size sweep: its own table (N_P 16 over N_P 64: 15.2 / 12.0), and its 8K context
    // not a row of the decode grid's tables.
    assert!(
        md.contains("| `pages/lserve_bf16` | 1 | 128K | 15.200 µs | 13.100 µs | 12.000 µs | 12.500 µs | 1.267x |"),
        "{md}"
    );
    assert!(md.contains("- `pages/dense_int4_p16/b16/8192`: out of memory"));
    assert!(!md.lines().any(|l| l.starts_with("| 8K |")), "{md}");
}

#[test]
fn an_empty_folder_gives_a_report_of_nothing_measured() {
    let reports = out_dir("report-empty-in");
    fs::create_dir_all(&reports).unwrap();
    let out = out_dir("report-empty-out");
    let w = generate(&Options {
        reports,
        out,
        commit: None,
        machine: None,
    })
    .unwrap();
    assert_eq!(w.measurements, 0);
    for p in &w.pngs {
        assert!(is_png(p));
    }
    let md = fs::read_to_string(&w.markdown).unwrap();
    assert!(md.contains("not recorded (no machine.txt)"));
    assert!(md.contains("None: the logs hold no criterion measurement."));
    // Every decode cell of the latency tables says so: no number at all.
    assert!(!md.contains(" µs |"));
}
