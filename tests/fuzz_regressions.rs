//! The fuzz harnesses (`fuzz/harness/`, run by cargo-fuzz from `fuzz/`) as plain tests: every
//! input kept in `fuzz/regressions/<target>/*.hex` (the cases fuzzing found, each fixed in the
//! library; the input's bytes as hex text, `xxd -p` style) is replayed, and each harness also
//! runs on a few thousand seeded random inputs so that it keeps building and passing without
//! cargo-fuzz.

#[path = "../fuzz/harness/mod.rs"]
#[allow(dead_code)]
mod harness;

use std::path::Path;

use rand::{Rng, SeedableRng};

#[test]
fn kept_fuzz_inputs_replay_without_a_finding() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions");
    let mut replayed = 0;
    for (name, run) in harness::TARGETS {
        let dir = root.join(name);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut files: Vec<_> = entries
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "hex"))
            .collect();
        files.sort();
        for file in files {
            let data = from_hex(&std::fs::read_to_string(&file).unwrap());
            eprintln!("replaying {}", file.display());
            run(&data);
            replayed += 1;
        }
    }
    assert!(replayed > 0, "no kept inputs under {}", root.display());
}

#[test]
fn harnesses_pass_on_seeded_random_inputs() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5EED_F022);
    for (name, run) in harness::TARGETS {
        for i in 0..1500 {
            let len = rng.gen_range(0..600);
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            let r = std::panic::catch_unwind(|| run(&data));
            assert!(
                r.is_ok(),
                "{name}: random input {i} ({len} bytes): {data:?}"
            );
        }
    }
}

/// The bytes of hex text (whitespace ignored).
fn from_hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text
        .bytes()
        .filter(|b| !b.is_ascii_whitespace())
        .map(|b| (b as char).to_digit(16).expect("a hex digit") as u8)
        .collect();
    assert!(digits.len() % 2 == 0, "an odd number of hex digits");
    digits.chunks(2).map(|p| p[0] << 4 | p[1]).collect()
}
