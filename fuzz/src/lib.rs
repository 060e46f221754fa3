//! The fuzz harnesses (`../harness/`), shared with the repository's plain test
//! `tests/fuzz_regressions.rs`: each `run(data)` turns libFuzzer's bytes into structured input
//! (`arbitrary`) and panics on a library panic or a mismatch with its model.
#[path = "../harness/mod.rs"]
pub mod harness;
