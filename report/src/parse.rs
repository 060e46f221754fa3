//! Parsers of what a bundle run writes to `reports/`: criterion's text output (the bench
//! executables' logs) and `benches/torch_sdpa.py`'s lines.

use std::collections::BTreeMap;

/// What criterion's `thrpt:` line counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThroughputKind {
    /// `B/s`, `KiB/s`, .. `GiB/s` (binary) or `KB/s` .. `GB/s` (decimal): stored as bytes/s.
    Bytes,
    /// `elem/s`, `Kelem/s`, `Melem/s`, `Gelem/s`: stored as elements/s.
    Elements,
}

/// One criterion measurement: `<id>  time: [lo est hi]`, maybe `thrpt: [lo est hi]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Criterion {
    pub id: String,
    /// Seconds: the confidence interval's lower bound, the point estimate, the upper bound.
    pub time: [f64; 3],
    /// Per second, in the order criterion prints (from the time's upper bound, the estimate, the
    /// lower bound), with what it counts.
    pub thrpt: Option<([f64; 3], ThroughputKind)>,
    /// The log file it came from.
    pub source: String,
}

impl Criterion {
    /// The point estimate, seconds.
    pub fn est(&self) -> f64 {
        self.time[1]
    }

    /// The point estimate's bytes per second, if the case counts bytes.
    pub fn bytes_per_s(&self) -> Option<f64> {
        match self.thrpt {
            Some((v, ThroughputKind::Bytes)) => Some(v[1]),
            _ => None,
        }
    }
}

/// One line of `torch_sdpa.py decode` or `prefill`.
#[derive(Clone, Debug, PartialEq)]
pub enum TorchResult {
    /// Median microseconds and the rate the script printed (decode: TB/s, prefill: TFLOP/s).
    Measured { median_us: f64, rate: f64 },
    /// The back end refused the shape; the script's message.
    Unsupported(String),
}

/// Everything read from one `reports/` folder.
#[derive(Clone, Debug, Default)]
pub struct Measurements {
    /// In the order read; a later measurement of the same id replaces an earlier one.
    pub criterion: Vec<Criterion>,
    /// `group/name/bB/C` -> the reason a bench printed for skipping the case.
    pub skipped: BTreeMap<String, String>,
    /// Lines saying a whole bench was skipped (`... benchmarks skipped: no usable GPU (..)`).
    pub bench_notes: Vec<String>,
    /// `device: ...` lines (the benches' and torch's), deduplicated, in order.
    pub devices: Vec<String>,
    /// (back end, batch, context) -> result.
    pub torch_decode: BTreeMap<(String, usize, usize), TorchResult>,
    /// (back end, context) -> result.
    pub torch_prefill: BTreeMap<(String, usize), TorchResult>,
    /// torch's device-to-device copy (read + write), TB/s.
    pub torch_copy_tbps: Option<f64>,
    /// Ids that were measured more than once (the last is kept).
    pub repeated: Vec<String>,
}

impl Measurements {
    /// The measurement of `id`, if any.
    pub fn get(&self, id: &str) -> Option<&Criterion> {
        self.criterion.iter().find(|c| c.id == id)
    }

    fn push(&mut self, c: Criterion) {
        if let Some(old) = self.criterion.iter_mut().find(|o| o.id == c.id) {
            self.repeated.push(c.id.clone());
            *old = c;
        } else {
            self.criterion.push(c);
        }
    }

    fn device(&mut self, line: &str) {
        let line = line.trim().to_string();
        if !self.devices.contains(&line) {
            self.devices.push(line);
        }
    }

    /// Reads one log file's text: criterion lines and torch lines both (a file holds one or the
    /// other; each parser ignores the other's lines).
    pub fn read_log(&mut self, source: &str, text: &str) {
        let text = strip_ansi(text);
        self.read_criterion(source, &text);
        self.read_torch(&text);
        // A Python exception's last line (e.g. no torch on the machine): why a log has no lines.
        for line in text.lines() {
            let line = line.trim();
            if let Some((name, _)) = line.split_once(": ") {
                if name.ends_with("Error") && name.chars().all(|c| c.is_ascii_alphanumeric()) {
                    self.bench_notes.push(format!("{source}: {line}"));
                }
            }
        }
    }

    fn read_criterion(&mut self, source: &str, text: &str) {
        // The id of the case criterion is on: from its `Benchmarking <id>: ...` lines and, for ids
        // over 23 characters, the id printed alone on the line before `time:`.
        let mut current: Option<String> = None;
        let mut previous_line = String::new();
        let mut last: Option<usize> = None; // index of the measurement a `thrpt:` belongs to
        let mut in_change = false;
        for raw in text.lines() {
            // A terminal's progress lines end in `\r` rewrites; keep what was printed last.
            let line = raw.rsplit('\r').next().unwrap_or(raw);
            let trimmed = line.trim();
            if let Some(rest) = trimmed.strip_prefix("Benchmarking ") {
                if let Some((id, _)) = rest.split_once(": ") {
                    current = Some(id.to_string());
                } else {
                    current = Some(rest.trim_end_matches(':').to_string());
                }
                last = None;
                in_change = false;
            } else if trimmed == "change:" {
                // With a saved baseline criterion prints `change:` and then `time:`/`thrpt:`
                // lines of percentages: not measurements.
                in_change = true;
            } else if let Some((before, values)) = split_field(line, "time:") {
                if in_change || values.contains('%') {
                    continue;
                }
                let before = before.trim();
                let id = if !before.is_empty() {
                    Some(before.to_string())
                } else if is_id(previous_line.trim()) {
                    Some(previous_line.trim().to_string())
                } else {
                    current.clone()
                };
                if let (Some(id), Some(time)) = (id, parse_times(values)) {
                    self.push(Criterion {
                        id: id.clone(),
                        time,
                        thrpt: None,
                        source: source.to_string(),
                    });
                    last = self.criterion.iter().position(|c| c.id == id);
                }
            } else if let Some((before, values)) = split_field(line, "thrpt:") {
                if in_change || values.contains('%') || !before.trim().is_empty() {
                    continue;
                }
                if let (Some(i), Some(t)) = (last.take(), parse_rates(values)) {
                    self.criterion[i].thrpt = Some(t);
                }
            } else if let Some((what, reason)) = skipped_case(trimmed) {
                self.skipped.insert(what, reason);
            } else if trimmed.contains(" benchmarks skipped: ") {
                self.bench_notes.push(trimmed.to_string());
            } else if trimmed.starts_with("device: ") {
                self.device(trimmed);
            }
            if !trimmed.is_empty() {
                previous_line = trimmed.to_string();
            }
        }
    }

    fn read_torch(&mut self, text: &str) {
        #[derive(PartialEq)]
        enum Table {
            None,
            Decode,
            Prefill,
        }
        let mut table = Table::None;
        for line in text.lines() {
            let line = line.trim();
            if line == "backend,batch,context,median_us,TB/s" {
                table = Table::Decode;
                continue;
            }
            if line == "backend,context,median_us,TFLOP/s" {
                table = Table::Prefill;
                continue;
            }
            if let Some(rest) = line.strip_prefix("copy (device to device, read + write):") {
                if let Some(v) = rest.trim().strip_suffix("TB/s") {
                    if let Ok(v) = v.trim().parse::<f64>() {
                        self.torch_copy_tbps = Some(v);
                    }
                }
                continue;
            }
            if line.starts_with("device: ") && line.contains(", torch ") {
                self.device(line);
                continue;
            }
            match table {
                Table::None => {}
                Table::Decode => {
                    let f: Vec<&str> = line.splitn(5, ',').collect();
                    if f.len() != 5 {
                        continue;
                    }
                    let (Ok(batch), Ok(ctx)) = (f[1].parse(), f[2].parse()) else {
                        continue;
                    };
                    if let Some(r) = torch_result(f[3], f[4]) {
                        self.torch_decode.insert((f[0].to_string(), batch, ctx), r);
                    }
                }
                Table::Prefill => {
                    let f: Vec<&str> = line.splitn(4, ',').collect();
                    if f.len() != 4 {
                        continue;
                    }
                    let Ok(ctx) = f[1].parse() else { continue };
                    if let Some(r) = torch_result(f[2], f[3]) {
                        self.torch_prefill.insert((f[0].to_string(), ctx), r);
                    }
                }
            }
        }
    }
}

fn torch_result(time: &str, rate: &str) -> Option<TorchResult> {
    if time == "unsupported" {
        return Some(TorchResult::Unsupported(rate.trim().to_string()));
    }
    Some(TorchResult::Measured {
        median_us: time.parse().ok()?,
        rate: rate.trim().parse().ok()?,
    })
}

/// `(text before "field", text between "[" and "]" after it)`.
fn split_field<'a>(line: &'a str, field: &str) -> Option<(&'a str, &'a str)> {
    let at = line.find(field)?;
    let rest = &line[at + field.len()..];
    let open = rest.find('[')?;
    let close = rest[open..].find(']')? + open;
    if !rest[..open].trim().is_empty() {
        return None;
    }
    Some((&line[..at], &rest[open + 1..close]))
}

/// A criterion id printed alone: one word with a `/`, no `:`.
fn is_id(s: &str) -> bool {
    !s.is_empty() && s.contains('/') && !s.contains(char::is_whitespace) && !s.contains(':')
}

/// The benches' `group/name bB/C: skipped (reason)` lines: `(group/name/bB/C, reason)`.
fn skipped_case(line: &str) -> Option<(String, String)> {
    let (what, rest) = line.split_once(": skipped (")?;
    let reason = rest.strip_suffix(')')?;
    if what.contains(" benchmarks") {
        return None;
    }
    Some((
        what.split_whitespace().collect::<Vec<_>>().join("/"),
        reason.to_string(),
    ))
}

/// Pairs of `number unit`, three of them.
fn pairs(values: &str) -> Option<Vec<(f64, &str)>> {
    let tokens: Vec<&str> = values.split_whitespace().collect();
    if tokens.len() != 6 {
        return None;
    }
    tokens
        .chunks(2)
        .map(|p| Some((p[0].parse::<f64>().ok()?, p[1])))
        .collect()
}

/// Criterion's `[lo est hi]` times: seconds.
pub fn parse_times(values: &str) -> Option<[f64; 3]> {
    let p = pairs(values)?;
    let mut out = [0.0; 3];
    for (o, (v, unit)) in out.iter_mut().zip(p) {
        let scale = match unit {
            "ps" => 1e-12,
            "ns" => 1e-9,
            "µs" | "us" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            _ => return None,
        };
        *o = v * scale;
    }
    Some(out)
}

/// Criterion's `[a b c]` throughputs: per second, with what they count.
pub fn parse_rates(values: &str) -> Option<([f64; 3], ThroughputKind)> {
    let p = pairs(values)?;
    let mut out = [0.0; 3];
    let mut kind = None;
    for (o, (v, unit)) in out.iter_mut().zip(p) {
        let (scale, k) = match unit {
            "B/s" => (1.0, ThroughputKind::Bytes),
            "KiB/s" => (1024.0, ThroughputKind::Bytes),
            "MiB/s" => (1024.0 * 1024.0, ThroughputKind::Bytes),
            "GiB/s" => (1024.0 * 1024.0 * 1024.0, ThroughputKind::Bytes),
            "TiB/s" => (1024f64.powi(4), ThroughputKind::Bytes),
            "KB/s" => (1e3, ThroughputKind::Bytes),
            "MB/s" => (1e6, ThroughputKind::Bytes),
            "GB/s" => (1e9, ThroughputKind::Bytes),
            "TB/s" => (1e12, ThroughputKind::Bytes),
            "elem/s" => (1.0, ThroughputKind::Elements),
            "Kelem/s" => (1e3, ThroughputKind::Elements),
            "Melem/s" => (1e6, ThroughputKind::Elements),
            "Gelem/s" => (1e9, ThroughputKind::Elements),
            _ => return None,
        };
        if kind.is_some_and(|kind| kind != k) {
            return None;
        }
        kind = Some(k);
        *o = v * scale;
    }
    Some((out, kind?))
}

/// The text without ANSI escape sequences (criterion colours its output on a terminal).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                // CSI: parameters and intermediates, then one final byte in @..~.
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // Parser fixtures: hand-made text in the formats criterion 0.5 and benches/torch_sdpa.py
    // print (made up, not results).

    const CRITERION: &str = "\
=== benches/decode: ./benches/decode --bench
device: NVIDIA H200
Benchmarking copy/device_to_device_1GiB
Benchmarking copy/device_to_device_1GiB: Warming up for 3.0000 s
Benchmarking copy/device_to_device_1GiB: Collecting 100 samples in estimated 5.1 s (9.9k iterations)
Benchmarking copy/device_to_device_1GiB: Analyzing
copy/device_to_device_1GiB
                        time:   [500.00 µs 510.00 µs 520.00 µs]
                        thrpt:  [3846.2 GiB/s 3921.6 GiB/s 4000.0 GiB/s]
Found 3 outliers among 100 measurements (3.00%)
  3 (3.00%) high mild
Benchmarking kv/pool/b1/4096: Analyzing
kv/pool/b1/4096         time:   [6.0000 µs 6.5000 µs 7.0000 µs]
                        thrpt:  [1.0000 GiB/s 2.0000 GiB/s 3.0000 GiB/s]
                 change:
                        time:   [-1.0000% +0.5000% +2.0000%] (p = 0.40 > 0.05)
                        thrpt:  [-1.9608% -0.4975% +1.0101%]
                        No change in performance detected.
Benchmarking attention/dense/b16/262144: Analyzing
attention/dense/b16/262144
                        time:   [999.50 µs 1.0001 ms 1.0100 ms]
attention/static b16/262144: skipped (out of memory: CUDA_ERROR_OUT_OF_MEMORY)
Benchmarking prefill/dense/4096: Analyzing
prefill/dense/4096      time:   [500.00 µs 505.00 µs 510.00 µs]
                        thrpt:  [269474 Gelem/s 272126 Gelem/s 274845 Gelem/s]
";

    #[test]
    fn criterion_lines_with_the_id_on_the_line_or_before_it() {
        let mut m = Measurements::default();
        m.read_log("bench-decode.txt", CRITERION);
        let ids: Vec<&str> = m.criterion.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "copy/device_to_device_1GiB",
                "kv/pool/b1/4096",
                "attention/dense/b16/262144",
                "prefill/dense/4096"
            ]
        );
        let copy = m.get("copy/device_to_device_1GiB").unwrap();
        assert!((copy.est() - 510e-6).abs() < 1e-12);
        let gib = 1024f64.powi(3);
        assert!((copy.bytes_per_s().unwrap() - 3921.6 * gib).abs() < 1.0);
        // The change block's percentages are not measurements.
        let pool = m.get("kv/pool/b1/4096").unwrap();
        assert!((pool.time[0] - 6e-6).abs() < 1e-15);
        assert!((pool.bytes_per_s().unwrap() - 2.0 * gib).abs() < 1e-3);
        // Mixed units in one interval; no throughput line.
        let dense = m.get("attention/dense/b16/262144").unwrap();
        assert!((dense.time[0] - 999.5e-6).abs() < 1e-12);
        assert!((dense.time[2] - 1.01e-3).abs() < 1e-12);
        assert_eq!(dense.thrpt, None);
        let prefill = m.get("prefill/dense/4096").unwrap();
        let (rates, kind) = prefill.thrpt.unwrap();
        assert_eq!(kind, ThroughputKind::Elements);
        assert!((rates[1] - 272126e9).abs() < 1.0);
        assert_eq!(
            m.skipped
                .get("attention/static/b16/262144")
                .map(String::as_str),
            Some("out of memory: CUDA_ERROR_OUT_OF_MEMORY")
        );
        assert_eq!(m.devices, ["device: NVIDIA H200"]);
    }

    #[test]
    fn colours_and_carriage_returns() {
        let text = "\u{1b}[32mkv/append/b1/4096\u{1b}[0m       time:   [\u{1b}[2m2.5000 µs\u{1b}[0m \u{1b}[1m2.6000 µs\u{1b}[0m \u{1b}[2m2.7000 µs\u{1b}[0m]\n";
        let mut m = Measurements::default();
        m.read_log("x", text);
        assert!((m.get("kv/append/b1/4096").unwrap().est() - 2.6e-6).abs() < 1e-15);

        let text = "Benchmarking step/lserve/b1/4096: Warming up\rBenchmarking step/lserve/b1/4096: Analyzing\rstep/lserve/b1/4096\n                        time:   [8.0 µs 8.5 µs 9.0 µs]\n";
        let mut m = Measurements::default();
        m.read_log("x", text);
        assert!((m.get("step/lserve/b1/4096").unwrap().est() - 8.5e-6).abs() < 1e-15);
    }

    #[test]
    fn a_later_measurement_replaces_an_earlier_one() {
        let mut m = Measurements::default();
        m.read_log(
            "a",
            "kv/pool/b1/4096         time:   [1.0 µs 2.0 µs 3.0 µs]\n",
        );
        m.read_log(
            "b",
            "kv/pool/b1/4096         time:   [4.0 µs 5.0 µs 6.0 µs]\n",
        );
        assert_eq!(m.criterion.len(), 1);
        assert!((m.get("kv/pool/b1/4096").unwrap().est() - 5e-6).abs() < 1e-15);
        assert_eq!(m.get("kv/pool/b1/4096").unwrap().source, "b");
        assert_eq!(m.repeated, ["kv/pool/b1/4096"]);
    }

    #[test]
    fn broken_lines_give_nothing() {
        let mut m = Measurements::default();
        m.read_log(
            "x",
            "kv/pool/b1/4096 time: [1.0 µs 2.0]\nkv/pool/b1/8 time: [1.0 xs 2.0 µs 3.0 µs]\nwarning: Unable to complete 10 samples in 800.0ms. You may wish to increase target time to 1.2s.\n",
        );
        assert!(m.criterion.is_empty());
    }

    #[test]
    fn torch_decode_and_prefill() {
        let decode = "\
=== benches/torch_sdpa.py decode: python3 benches/torch_sdpa.py decode
device: NVIDIA H200, torch 2.11.0+cu130
copy (device to device, read + write): 4.10 TB/s
backend,batch,context,median_us,TB/s
cudnn,1,4096,30.0,0.071
flash,1,4096,40.0,0.053
cudnn,16,262144,unsupported,No available kernel. Aborting execution, for real
";
        let prefill = "\
device: NVIDIA H200, torch 2.11.0+cu130
backend,context,median_us,TFLOP/s
cudnn,4096,300.0,458.1
flash,4096,unsupported,FlashAttention only supports Ampere GPUs or newer.
";
        let mut m = Measurements::default();
        m.read_log("bench-torch_sdpa-decode.txt", decode);
        m.read_log("bench-torch_sdpa-prefill.txt", prefill);
        assert!(m.criterion.is_empty());
        assert_eq!(m.torch_copy_tbps, Some(4.10));
        assert_eq!(
            m.torch_decode[&("cudnn".to_string(), 1, 4096)],
            TorchResult::Measured {
                median_us: 30.0,
                rate: 0.071
            }
        );
        assert_eq!(
            m.torch_decode[&("cudnn".to_string(), 16, 262144)],
            TorchResult::Unsupported("No available kernel. Aborting execution, for real".into())
        );
        assert_eq!(
            m.torch_prefill[&("cudnn".to_string(), 4096)],
            TorchResult::Measured {
                median_us: 300.0,
                rate: 458.1
            }
        );
        assert!(matches!(
            m.torch_prefill[&("flash".to_string(), 4096)],
            TorchResult::Unsupported(_)
        ));
        assert_eq!(m.devices, ["device: NVIDIA H200, torch 2.11.0+cu130"]);
        assert!(m.bench_notes.is_empty());

        let mut m = Measurements::default();
        m.read_log(
            "bench-torch_sdpa-decode.txt",
            "Traceback (most recent call last):\n  File \"benches/torch_sdpa.py\", line 16, in <module>\n    import torch\nModuleNotFoundError: No module named 'torch'\n",
        );
        assert_eq!(
            m.bench_notes,
            ["bench-torch_sdpa-decode.txt: ModuleNotFoundError: No module named 'torch'"]
        );
    }

    #[test]
    fn units() {
        let close =
            |a: [f64; 3], b: [f64; 3]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-9 * y);
        assert!(close(
            parse_times("1 ns 2 ns 3 ns").unwrap(),
            [1e-9, 2e-9, 3e-9]
        ));
        assert!(close(
            parse_times("4 ps 5 µs 6 ms").unwrap(),
            [4e-12, 5e-6, 6e-3]
        ));
        assert_eq!(parse_times("1 s 2 s 3 s"), Some([1.0, 2.0, 3.0]));
        let (r, k) = parse_rates("1 KB/s 1 MB/s 1 GB/s").unwrap();
        assert_eq!((r, k), ([1e3, 1e6, 1e9], ThroughputKind::Bytes));
        assert_eq!(parse_rates("1 GiB/s 1 Gelem/s 1 GiB/s"), None);
    }
}
