//! The committed per-kernel resource baseline of `cargo xtask ptx`: one line per shipped kernel
//! (entry function) with the registers, spill bytes (stores + loads) and static shared memory that
//! `ptxas -v` reports. A kernel that grows past its line, or is not listed, fails the check;
//! `--bless` rewrites the file from the current build.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::ptx::KernelInfo;

/// What the baseline records about one kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub registers: u32,
    /// Spill stores plus spill loads, in bytes.
    pub spill_bytes: u32,
    /// Static shared memory, in bytes (dynamic shared memory is sized at launch).
    pub shared_bytes: u32,
}

impl Usage {
    fn of(kernel: &KernelInfo) -> Self {
        Self {
            registers: kernel.registers,
            spill_bytes: kernel.spill_stores + kernel.spill_loads,
            shared_bytes: kernel.shared_bytes,
        }
    }

    /// Whether any of the three is above `baseline`'s.
    fn grew_from(&self, baseline: &Usage) -> bool {
        self.registers > baseline.registers
            || self.spill_bytes > baseline.spill_bytes
            || self.shared_bytes > baseline.shared_bytes
    }
}

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} regs, {} spill bytes, {} smem bytes",
            self.registers, self.spill_bytes, self.shared_bytes
        )
    }
}

/// Kernel name -> usage, sorted by name.
pub type Baseline = BTreeMap<String, Usage>;

/// The baseline of the entry functions in `kernels` (helper functions are left out).
pub fn from_kernels(kernels: &[KernelInfo]) -> Baseline {
    kernels
        .iter()
        .filter(|k| k.entry)
        .map(|k| (k.name.clone(), Usage::of(k)))
        .collect()
}

/// The baseline file's text for `arch`: a header, then `name registers spill_bytes shared_bytes`
/// per kernel, sorted by name (so a merge that adds kernels conflicts only where the lines meet,
/// and `--bless` after the merge settles it).
pub fn render(arch: &str, baseline: &Baseline) -> String {
    let mut out = format!(
        "# `cargo xtask ptx --arch {arch}` baseline: per kernel, ptxas's registers, spill bytes\n\
         # (stores + loads) and static shared memory bytes. The check fails when a kernel grows\n\
         # past its line or is missing here; `cargo xtask ptx --arch {arch} --bless` rewrites it.\n\
         # kernel registers spill_bytes shared_bytes\n"
    );
    for (name, u) in baseline {
        let _ = writeln!(
            out,
            "{name} {} {} {}",
            u.registers, u.spill_bytes, u.shared_bytes
        );
    }
    out
}

/// Parses a baseline file (`#` comments and blank lines ignored).
pub fn parse(text: &str) -> Result<Baseline, String> {
    let mut baseline = Baseline::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let numbers: Option<Vec<u32>> = fields[1..].iter().map(|n| n.parse().ok()).collect();
        let Some([registers, spill_bytes, shared_bytes]) =
            numbers.and_then(|n| <[u32; 3]>::try_from(n).ok())
        else {
            return Err(format!(
                "line {}: expected `kernel registers spill_bytes shared_bytes`, got `{line}`",
                i + 1
            ));
        };
        let usage = Usage {
            registers,
            spill_bytes,
            shared_bytes,
        };
        if baseline.insert(fields[0].to_string(), usage).is_some() {
            return Err(format!(
                "line {}: kernel `{}` listed twice",
                i + 1,
                fields[0]
            ));
        }
    }
    Ok(baseline)
}

/// How the current build's kernels stand against the baseline.
#[derive(Debug, Default, PartialEq)]
pub struct Comparison {
    /// Kernels above their baseline in registers, spills or shared memory: (name, baseline, now).
    pub grown: Vec<(String, Usage, Usage)>,
    /// Kernels below their baseline in one of the three and above it in none.
    pub shrunk: Vec<(String, Usage, Usage)>,
    /// Kernels the baseline does not list.
    pub added: Vec<(String, Usage)>,
    /// Kernels the baseline lists that the build no longer has.
    pub removed: Vec<String>,
}

impl Comparison {
    /// Whether the check passes: nothing grew and nothing is unlisted (removals and shrinking
    /// are reported only).
    pub fn passes(&self) -> bool {
        self.grown.is_empty() && self.added.is_empty()
    }

    /// One line per kernel that differs from the baseline, grouped by kind.
    pub fn report(&self) -> String {
        let mut out = String::new();
        for (name, was, now) in &self.grown {
            let _ = writeln!(out, "GREW     {name}: {was} -> {now}");
        }
        for (name, now) in &self.added {
            let _ = writeln!(out, "NEW      {name}: {now} (not in the baseline)");
        }
        for name in &self.removed {
            let _ = writeln!(out, "removed  {name} (in the baseline, not built)");
        }
        for (name, was, now) in &self.shrunk {
            let _ = writeln!(
                out,
                "shrank   {name}: {was} -> {now} (`--bless` lowers its line)"
            );
        }
        out
    }
}

/// Compares `current` with `baseline`, kernel by kernel.
pub fn compare(baseline: &Baseline, current: &Baseline) -> Comparison {
    let mut c = Comparison::default();
    for (name, now) in current {
        match baseline.get(name) {
            None => c.added.push((name.clone(), *now)),
            Some(was) if now.grew_from(was) => c.grown.push((name.clone(), *was, *now)),
            Some(was) if now != was => c.shrunk.push((name.clone(), *was, *now)),
            Some(_) => {}
        }
    }
    c.removed = baseline
        .keys()
        .filter(|name| !current.contains_key(*name))
        .cloned()
        .collect();
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(registers: u32, spill_bytes: u32, shared_bytes: u32) -> Usage {
        Usage {
            registers,
            spill_bytes,
            shared_bytes,
        }
    }

    fn baseline(entries: &[(&str, Usage)]) -> Baseline {
        entries.iter().map(|(n, u)| (n.to_string(), *u)).collect()
    }

    #[test]
    fn from_kernels_keeps_entries_and_sums_spills() {
        let kernels = [
            KernelInfo {
                name: "k".into(),
                entry: true,
                registers: 40,
                shared_bytes: 512,
                spill_stores: 4,
                spill_loads: 8,
                ..Default::default()
            },
            KernelInfo {
                name: "helper".into(),
                registers: 99,
                ..Default::default()
            },
        ];
        assert_eq!(
            from_kernels(&kernels),
            baseline(&[("k", usage(40, 12, 512))])
        );
    }

    #[test]
    fn render_then_parse_round_trips() {
        let b = baseline(&[
            ("b_kernel", usage(10, 0, 0)),
            ("a_kernel", usage(255, 8, 1024)),
        ]);
        let text = render("sm_90", &b);
        assert!(text.contains("--arch sm_90"), "{text}");
        // Sorted by name.
        let a_at = text.find("a_kernel 255 8 1024").unwrap();
        let b_at = text.find("b_kernel 10 0 0").unwrap();
        assert!(a_at < b_at, "{text}");
        assert_eq!(parse(&text).unwrap(), b);
    }

    #[test]
    fn parse_rejects_malformed_and_duplicate_lines() {
        assert!(parse("k 1 2\n").unwrap_err().contains("line 1"));
        assert!(parse("k 1 2 x\n").unwrap_err().contains("line 1"));
        assert!(parse("k 1 2 3 4\n").unwrap_err().contains("line 1"));
        assert!(parse("# c\nk 1 2 3\nk 1 2 3\n")
            .unwrap_err()
            .contains("line 3: kernel `k` listed twice"));
        assert_eq!(
            parse("  # only comments\n\nk 1 2 3 # trailing\n").unwrap(),
            baseline(&[("k", usage(1, 2, 3))])
        );
    }

    #[test]
    fn equal_build_passes_with_an_empty_report() {
        let b = baseline(&[("k", usage(100, 0, 0))]);
        let c = compare(&b, &b);
        assert!(c.passes());
        assert_eq!(c, Comparison::default());
        assert_eq!(c.report(), "");
    }

    #[test]
    fn growth_in_any_resource_fails() {
        let b = baseline(&[
            ("regs", usage(100, 0, 0)),
            ("spill", usage(100, 0, 0)),
            ("smem", usage(100, 0, 16)),
            ("same", usage(100, 0, 0)),
        ]);
        let now = baseline(&[
            ("regs", usage(101, 0, 0)),
            ("spill", usage(100, 4, 0)),
            ("smem", usage(100, 0, 32)),
            ("same", usage(100, 0, 0)),
        ]);
        let c = compare(&b, &now);
        assert!(!c.passes());
        let grown: Vec<&str> = c.grown.iter().map(|(n, ..)| n.as_str()).collect();
        assert_eq!(grown, ["regs", "smem", "spill"]);
        let report = c.report();
        assert!(
            report.contains("GREW     regs: 100 regs, 0 spill bytes, 0 smem bytes -> 101 regs"),
            "{report}"
        );
        assert!(!report.contains("same"), "{report}");
    }

    #[test]
    fn growth_wins_over_shrinking_in_another_resource() {
        let b = baseline(&[("k", usage(100, 0, 64))]);
        let c = compare(&b, &baseline(&[("k", usage(90, 0, 128))]));
        assert_eq!(c.grown.len(), 1);
        assert!(c.shrunk.is_empty());
    }

    #[test]
    fn shrinking_and_removal_are_reported_but_pass() {
        let b = baseline(&[("k", usage(100, 8, 0)), ("gone", usage(10, 0, 0))]);
        let c = compare(&b, &baseline(&[("k", usage(96, 0, 0))]));
        assert!(c.passes());
        assert_eq!(c.removed, ["gone"]);
        assert_eq!(c.shrunk.len(), 1);
        let report = c.report();
        assert!(report.contains("removed  gone"), "{report}");
        assert!(report.contains("shrank   k"), "{report}");
    }

    #[test]
    fn unlisted_kernel_fails_until_blessed() {
        let b = baseline(&[("old", usage(10, 0, 0))]);
        let now = baseline(&[("old", usage(10, 0, 0)), ("new", usage(20, 0, 0))]);
        let c = compare(&b, &now);
        assert!(!c.passes());
        assert_eq!(c.added, [("new".to_string(), usage(20, 0, 0))]);
        assert!(c.report().contains("NEW      new"));
        // Blessing writes the current build; it then compares equal.
        let blessed = parse(&render("sm_90", &now)).unwrap();
        assert!(compare(&blessed, &now).passes());
        assert_eq!(compare(&blessed, &now), Comparison::default());
    }
}
