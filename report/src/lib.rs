//! `lserve-report`: reads the `reports/` folder a GPU bundle run writes (`run.sh benches` or
//! `run.sh report`: criterion's text output of `benches/decode` and `benches/prefill`,
//! `benches/torch_sdpa.py decode|prefill`'s lines, `machine.txt`) and writes `REPORT.md` with
//! tables of every measured number and PNG plots (see `docs/BENCHMARKS.md`, "The report").
//!
//! Nothing is made up: a case the logs do not hold shows as "not measured" (or "skipped" with
//! the bench's reason), and is left out of the plots.

pub mod fidelity;
pub mod page_size;
pub mod parse;
pub mod plot;

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use parse::{Criterion, Measurements, TorchResult};
use plot::{Panel, Series};
use plotters::prelude::SeriesLabelPosition;

/// The case grid of `benches/decode.rs` (what the tables list, measured or not).
pub const DECODE_CONTEXTS: [usize; 5] = [4096, 16384, 65536, 131072, 262144];
pub const DECODE_BATCHES: [usize; 2] = [1, 16];
/// The page-size sweep of `benches/decode.rs` (`pages/{lserve,dense}_F_pN/bB/C`): physical page
/// sizes, contexts, and the K/V formats `F`.
pub const PAGE_SIZES: [usize; 4] = [16, 32, 64, 128];
pub const PAGE_CONTEXTS: [usize; 2] = [8192, 131072];
pub const PAGE_FORMATS: [&str; 3] = ["bf16", "int8", "int4"];
/// `benches/prefill.rs`: `prefill/{dense,streaming50}/L`.
pub const PREFILL_LENS: [usize; 5] = [4096, 16384, 32768, 65536, 131072];
/// `prefill_block_sparse/sparsity_percent/S` (32K).
pub const BLOCK_SPARSITIES: [usize; 4] = [0, 40, 50, 80];
/// `prefill_cache/NAME/L`.
pub const CACHE_LENS: [usize; 3] = [4096, 16384, 65536];
pub const CACHE_NAMES: [&str; 6] = [
    "attention",
    "write",
    "pool",
    "write_pool",
    "separate",
    "into_cache",
];
/// Llama-3-8B (and Llama-2-7B): decoder layers in a model's step.
pub const LAYERS: f64 = 32.0;
/// The prefill benches' (and torch's) geometry: query heads, head dimension.
pub const PREFILL_HQ: f64 = 32.0;
pub const PREFILL_D: f64 = 128.0;
pub const COPY_ID: &str = "copy/device_to_device_1GiB";

/// What to read and where to write.
#[derive(Clone, Debug)]
pub struct Options {
    /// The folder of logs (`reports/`): every `bench-*.txt` in it is read.
    pub reports: PathBuf,
    /// Where `REPORT.md` and the PNGs go (created).
    pub out: PathBuf,
    /// The commit the bundle was built from (`COMMIT` in the bundle).
    pub commit: Option<String>,
    /// The machine description (`reports/machine.txt`: `date:`, `host:` and nvidia-smi's CSV).
    pub machine: Option<String>,
}

/// What [`generate`] wrote.
#[derive(Debug)]
pub struct Written {
    pub markdown: PathBuf,
    pub pngs: Vec<PathBuf>,
    /// Criterion measurements read.
    pub measurements: usize,
    /// Log files read.
    pub logs: Vec<String>,
}

/// Reads the logs of `reports` into [`Measurements`], with the file names read.
pub fn read_reports(reports: &Path) -> Result<(Measurements, Vec<String>), String> {
    let mut files: Vec<PathBuf> = fs::read_dir(reports)
        .map_err(|e| format!("reading {}: {e}", reports.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("bench-") && n.ends_with(".txt"))
        })
        .collect();
    files.sort();
    let mut m = Measurements::default();
    let mut names = Vec::new();
    for f in &files {
        let bytes = fs::read(f).map_err(|e| format!("reading {}: {e}", f.display()))?;
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        m.read_log(&name, &String::from_utf8_lossy(&bytes));
        names.push(name);
    }
    Ok((m, names))
}

/// Reads `opts.reports`, writes `REPORT.md` and the PNGs into `opts.out`.
pub fn generate(opts: &Options) -> Result<Written, String> {
    let (m, logs) = read_reports(&opts.reports)?;
    fs::create_dir_all(&opts.out).map_err(|e| format!("creating {}: {e}", opts.out.display()))?;
    let r = Report { m: &m };
    let mut pngs = Vec::new();
    let mut png = |name: &str, caption: &str, panels: Vec<Panel>| -> Result<String, String> {
        let path = opts.out.join(name);
        plot::draw(&path, caption, &panels)?;
        pngs.push(path);
        Ok(name.to_string())
    };
    let latency = png(
        "decode_latency.png",
        "Decode latency per layer (Llama-3-8B geometry)",
        DECODE_BATCHES.iter().map(|&b| r.latency_panel(b)).collect(),
    )?;
    let speedup = png(
        "decode_speedup.png",
        "End-to-end decode speedup of LServe over dense (32 layers)",
        vec![r.speedup_panel()],
    )?;
    let selector = png(
        "selector.png",
        "Page selector against the rest of the LServe step",
        DECODE_BATCHES
            .iter()
            .map(|&b| r.selector_panel(b))
            .collect(),
    )?;
    let prefill = png(
        "prefill_tflops.png",
        "Causal prefill throughput (Hq 32, Hkv 8, D 128, bf16)",
        vec![r.prefill_panel()],
    )?;
    let bandwidth = png(
        "decode_bandwidth.png",
        "Decode achieved bandwidth against the device copy",
        DECODE_BATCHES
            .iter()
            .map(|&b| r.bandwidth_panel(b))
            .collect(),
    )?;
    let pages = PAGE_CONTEXTS
        .iter()
        .map(|&ctx| {
            png(
                &format!("page_size_{}.png", plot::tokens_label(ctx as f64)),
                &format!(
                    "Decode latency per layer against the physical page size, {} context",
                    plot::tokens_label(ctx as f64)
                ),
                DECODE_BATCHES
                    .iter()
                    .map(|&b| r.page_size_panel(b, ctx))
                    .collect(),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;

    let mut md = String::new();
    r.header(&mut md, opts, &logs);
    r.formulas(&mut md);
    r.decode_latency(&mut md, &latency);
    r.decode_speedup(&mut md, &speedup);
    r.selector(&mut md, &selector);
    r.prefill(&mut md, &prefill);
    r.bandwidth(&mut md, &bandwidth);
    r.page_sizes(&mut md, &pages);
    r.everything(&mut md);
    let markdown = opts.out.join("REPORT.md");
    fs::write(&markdown, md).map_err(|e| format!("writing {}: {e}", markdown.display()))?;
    Ok(Written {
        markdown,
        pngs,
        measurements: m.criterion.len(),
        logs,
    })
}

/// A time in seconds the way criterion writes it (4 significant digits, µs/ms/s).
pub fn fmt_time(s: f64) -> String {
    let (v, unit) = if s < 1e-6 {
        (s * 1e9, "ns")
    } else if s < 1e-3 {
        (s * 1e6, "µs")
    } else if s < 1.0 {
        (s * 1e3, "ms")
    } else {
        (s, "s")
    };
    format!("{} {unit}", sig4(v))
}

/// 4 significant digits (criterion's `short`).
fn sig4(n: f64) -> String {
    if n < 10.0 {
        format!("{n:.4}")
    } else if n < 100.0 {
        format!("{n:.3}")
    } else if n < 1000.0 {
        format!("{n:.2}")
    } else if n < 10000.0 {
        format!("{n:.1}")
    } else {
        format!("{n:.0}")
    }
}

/// torch's median as the script prints it (µs, one decimal).
fn torch_us(us: f64) -> String {
    format!("{us:.1} µs")
}

fn ratio(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.1}x")
    } else {
        format!("{x:.3}x")
    }
}

const NOT_MEASURED: &str = "not measured";

struct Report<'a> {
    m: &'a Measurements,
}

impl Report<'_> {
    fn time(&self, id: &str) -> Option<f64> {
        self.m.get(id).map(Criterion::est)
    }

    /// The table cell of `id`'s time: the estimate, "skipped" or "not measured".
    fn cell(&self, id: &str) -> String {
        match self.time(id) {
            Some(t) => fmt_time(t),
            None if self.m.skipped.contains_key(id) => "skipped".into(),
            None => NOT_MEASURED.into(),
        }
    }

    /// The contexts of the decode grid and any other the logs hold for `group/name/bB/C` ids
    /// (but the page-size sweep's, `pages/*`, which has tables of its own).
    fn decode_contexts(&self) -> Vec<usize> {
        let mut v: Vec<usize> = DECODE_CONTEXTS.to_vec();
        for c in &self.m.criterion {
            let parts: Vec<&str> = c.id.split('/').collect();
            if parts.len() == 4 && parts[0] != "pages" && parts[2].starts_with('b') {
                if let Ok(ctx) = parts[3].parse() {
                    v.push(ctx);
                }
            }
        }
        v.sort_unstable();
        v.dedup();
        v
    }

    fn lens(&self, prefix: &str, grid: &[usize]) -> Vec<usize> {
        let mut v = grid.to_vec();
        for c in &self.m.criterion {
            if let Some(rest) = c.id.strip_prefix(prefix) {
                if let Ok(l) = rest.parse() {
                    v.push(l);
                }
            }
        }
        v.sort_unstable();
        v.dedup();
        v
    }

    fn decode_id(group_name: &str, batch: usize, ctx: usize) -> String {
        format!("{group_name}/b{batch}/{ctx}")
    }

    fn copy_bps(&self) -> Option<f64> {
        self.m.get(COPY_ID).and_then(Criterion::bytes_per_s)
    }

    fn torch_decode(&self, backend: &str, batch: usize, ctx: usize) -> Option<&TorchResult> {
        self.m.torch_decode.get(&(backend.to_string(), batch, ctx))
    }

    fn torch_decode_us(&self, backend: &str, batch: usize, ctx: usize) -> Option<f64> {
        match self.torch_decode(backend, batch, ctx)? {
            TorchResult::Measured { median_us, .. } => Some(*median_us),
            TorchResult::Unsupported(_) => None,
        }
    }

    fn torch_cell(r: Option<&TorchResult>, show: impl Fn(f64, f64) -> String) -> String {
        match r {
            Some(TorchResult::Measured { median_us, rate }) => show(*median_us, *rate),
            Some(TorchResult::Unsupported(_)) => "unsupported".into(),
            None => NOT_MEASURED.into(),
        }
    }

    fn series(&self, label: &str, color: usize, ids: impl Fn(usize) -> String) -> Series {
        let points = self
            .decode_contexts()
            .into_iter()
            .filter_map(|c| self.time(&ids(c)).map(|t| (c as f64, t * 1e6)))
            .collect();
        Series::new(label, points, color)
    }

    fn x_span(&self) -> Vec<f64> {
        self.decode_contexts().iter().map(|&c| c as f64).collect()
    }

    // --- panels ---

    fn latency_panel(&self, b: usize) -> Panel {
        let s = |label: &str, color: usize, gn: &'static str| {
            self.series(label, color, move |c| Self::decode_id(gn, b, c))
        };
        Panel {
            title: format!("batch {b}"),
            x_desc: "context (tokens)".into(),
            y_desc: "time per layer (µs, log)".into(),
            log_x: true,
            log_y: true,
            y_min: None,
            x_span: self.x_span(),
            series: vec![
                s("dense (attention/dense)", 0, "attention/dense"),
                s("static (attention/static)", 1, "attention/static"),
                s("dynamic (step/dynamic)", 2, "step/dynamic"),
                s("LServe (step/lserve)", 3, "step/lserve"),
            ],
            hlines: vec![],
            legend: SeriesLabelPosition::UpperLeft,
        }
    }

    fn speedup(&self, dense: &str, lserve: &str) -> Option<f64> {
        Some(self.time(dense)? / self.time(lserve)?)
    }

    fn speedup_panel(&self) -> Panel {
        let ctxs = self.decode_contexts();
        let line = |label: &str, color: usize, dense: &str, lserve: &str, b: usize| {
            let points = ctxs
                .iter()
                .filter_map(|&c| {
                    let s = self.speedup(
                        &Self::decode_id(dense, b, c),
                        &Self::decode_id(lserve, b, c),
                    )?;
                    Some((c as f64, s))
                })
                .collect();
            Series::new(label, points, color)
        };
        Panel {
            title: "dense / LServe".into(),
            x_desc: "context (tokens)".into(),
            y_desc: "speedup (x, log)".into(),
            log_x: true,
            log_y: true,
            y_min: None,
            x_span: self.x_span(),
            series: vec![
                line("Llama-3-8B b1", 3, "attention/dense", "step/lserve", 1),
                line("Llama-3-8B b16", 0, "attention/dense", "step/lserve", 16),
                line(
                    "Llama-2-7B (MHA) b1",
                    4,
                    "attention/dense_mha",
                    "step/lserve_mha",
                    1,
                ),
            ],
            hlines: vec![],
            legend: SeriesLabelPosition::UpperLeft,
        }
    }

    fn rest_of_step(&self, b: usize, c: usize) -> Option<f64> {
        let step = self.time(&Self::decode_id("step/lserve", b, c))?;
        let sel = self.time(&Self::decode_id("selector/reuse4", b, c))?;
        Some(step - sel)
    }

    fn selector_panel(&self, b: usize) -> Panel {
        let s = |label: &str, color: usize, gn: &'static str| {
            self.series(label, color, move |c| Self::decode_id(gn, b, c))
        };
        let rest = Series::new(
            "LServe step - selector reuse 4",
            self.decode_contexts()
                .into_iter()
                .filter_map(|c| {
                    self.rest_of_step(b, c)
                        .filter(|&t| t > 0.0)
                        .map(|t| (c as f64, t * 1e6))
                })
                .collect(),
            3,
        );
        Panel {
            title: format!("batch {b}"),
            x_desc: "context (tokens)".into(),
            y_desc: "time per layer (µs, log)".into(),
            log_x: true,
            log_y: true,
            y_min: None,
            x_span: self.x_span(),
            series: vec![
                s("selector reuse 1", 4, "selector/reuse1"),
                s("selector reuse 4", 2, "selector/reuse4"),
                s("LServe step", 6, "step/lserve").dashed(),
                rest,
            ],
            hlines: vec![],
            legend: SeriesLabelPosition::UpperLeft,
        }
    }

    /// `pages/{kind}_{format}_p{n_p}/b{batch}/{ctx}`.
    fn page_id(kind: &str, format: &str, n_p: usize, batch: usize, ctx: usize) -> String {
        format!("pages/{kind}_{format}_p{n_p}/b{batch}/{ctx}")
    }

    fn page_size_panel(&self, b: usize, ctx: usize) -> Panel {
        let line = |kind: &str, format: &str| -> Vec<(f64, f64)> {
            PAGE_SIZES
                .iter()
                .filter_map(|&n| {
                    let t = self.time(&Self::page_id(kind, format, n, b, ctx))?;
                    Some((n as f64, t * 1e6))
                })
                .collect()
        };
        let mut series = Vec::new();
        for (format, color) in PAGE_FORMATS.iter().zip([3, 1, 4]) {
            series.push(Series::new(
                format!("LServe step, {format}"),
                line("lserve", format),
                color,
            ));
        }
        for (format, color) in PAGE_FORMATS.iter().zip([3, 1, 4]) {
            series.push(
                Series::new(format!("dense, {format}"), line("dense", format), color).dashed(),
            );
        }
        Panel {
            title: format!("batch {b}"),
            x_desc: "physical page N_P (tokens; logical pages 16)".into(),
            y_desc: "time per layer (µs, log)".into(),
            log_x: true,
            log_y: true,
            y_min: None,
            x_span: PAGE_SIZES.iter().map(|&n| n as f64).collect(),
            series,
            hlines: vec![],
            legend: SeriesLabelPosition::UpperRight,
        }
    }

    fn prefill_tflops(len: usize, seconds: f64) -> f64 {
        prefill_flops(len) / seconds / 1e12
    }

    fn torch_prefill_tflops(&self, backend: &str, len: usize) -> Option<f64> {
        match self.m.torch_prefill.get(&(backend.to_string(), len))? {
            TorchResult::Measured { rate, .. } => Some(*rate),
            TorchResult::Unsupported(_) => None,
        }
    }

    fn prefill_panel(&self) -> Panel {
        let lens = self.lens("prefill/dense/", &PREFILL_LENS);
        let ours = lens
            .iter()
            .filter_map(|&l| {
                let t = self.time(&format!("prefill/dense/{l}"))?;
                Some((l as f64, Self::prefill_tflops(l, t)))
            })
            .collect();
        let torch = |backend: &str| {
            lens.iter()
                .filter_map(|&l| Some((l as f64, self.torch_prefill_tflops(backend, l)?)))
                .collect()
        };
        Panel {
            title: "dense causal prefill, batch 1".into(),
            x_desc: "prompt (tokens)".into(),
            y_desc: "TFLOP/s".into(),
            log_x: true,
            log_y: false,
            y_min: None,
            x_span: lens.iter().map(|&l| l as f64).collect(),
            series: vec![
                Series::new("ours (prefill/dense)", ours, 3),
                Series::new("torch FlashAttention-2", torch("flash"), 0),
                Series::new("torch cuDNN", torch("cudnn"), 2),
            ],
            hlines: vec![],
            legend: SeriesLabelPosition::LowerRight,
        }
    }

    fn bandwidth_panel(&self, b: usize) -> Panel {
        let ctxs = self.decode_contexts();
        let ours = |gn: &str| -> Vec<(f64, f64)> {
            ctxs.iter()
                .filter_map(|&c| {
                    let bps = self.m.get(&Self::decode_id(gn, b, c))?.bytes_per_s()?;
                    Some((c as f64, bps / 1e9))
                })
                .collect()
        };
        let torch = |backend: &str| -> Vec<(f64, f64)> {
            ctxs.iter()
                .filter_map(|&c| match self.torch_decode(backend, b, c)? {
                    TorchResult::Measured { rate, .. } => Some((c as f64, rate * 1e3)),
                    TorchResult::Unsupported(_) => None,
                })
                .collect()
        };
        let mut hlines = Vec::new();
        if let Some(bps) = self.copy_bps() {
            hlines.push(Series::new(
                "copy (ours, 1 GiB d2d)",
                vec![(0.0, bps / 1e9)],
                6,
            ));
        }
        if let Some(tbps) = self.m.torch_copy_tbps {
            hlines.push(Series::new("copy (torch)", vec![(0.0, tbps * 1e3)], 5));
        }
        Panel {
            title: format!("batch {b}"),
            x_desc: "context (tokens)".into(),
            y_desc: "GB/s".into(),
            log_x: true,
            log_y: false,
            y_min: None,
            x_span: self.x_span(),
            series: vec![
                Series::new("dense (attention/dense)", ours("attention/dense"), 0),
                Series::new("static (attention/static)", ours("attention/static"), 1),
                Series::new("torch cuDNN", torch("cudnn"), 2).dashed(),
                Series::new("torch FlashAttention-2", torch("flash"), 4).dashed(),
            ],
            hlines,
            legend: SeriesLabelPosition::LowerRight,
        }
    }

    // --- markdown ---

    fn header(&self, md: &mut String, opts: &Options, logs: &[String]) {
        let machine = opts.machine.as_deref().unwrap_or("");
        let date = machine
            .lines()
            .find_map(|l| l.strip_prefix("date:"))
            .map(|d| d.trim().to_string())
            .unwrap_or_else(|| format!("{} (when the report was made)", now_utc()));
        let _ = writeln!(md, "# lserve benchmark report\n");
        let _ = writeln!(
            md,
            "Made by `lserve-report` from the logs of one GPU bundle run (`run.sh report`). \
             Every number below is read from those logs; a case they do not hold reads \
             \"{NOT_MEASURED}\".\n"
        );
        let _ = writeln!(md, "- **Date**: {date}");
        let commit = opts
            .commit
            .as_deref()
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .unwrap_or("unknown (no COMMIT file in the bundle)");
        let _ = writeln!(md, "- **Commit**: `{commit}`");
        let host = machine.lines().find_map(|l| l.strip_prefix("host:"));
        if let Some(h) = host {
            let _ = writeln!(md, "- **Host**: {}", h.trim());
        }
        let gpu: Vec<&str> = machine
            .lines()
            .filter(|l| {
                !(l.starts_with("date:")
                    || l.starts_with("host:")
                    || l.starts_with('#')
                    || l.trim().is_empty())
            })
            .collect();
        if opts.machine.is_none() {
            let _ = writeln!(md, "- **Machine**: not recorded (no machine.txt)");
        } else if gpu.is_empty() {
            let _ = writeln!(
                md,
                "- **Machine**: not recorded (machine.txt has no nvidia-smi output)"
            );
        } else {
            let _ = writeln!(md, "- **Machine** (nvidia-smi):\n");
            let _ = writeln!(md, "  ```text");
            for l in gpu {
                let _ = writeln!(md, "  {l}");
            }
            let _ = writeln!(md, "  ```");
        }
        for d in &self.m.devices {
            let _ = writeln!(md, "- As the benches saw it: `{d}`");
        }
        if logs.is_empty() {
            let _ = writeln!(md, "- **Logs read**: none (no `bench-*.txt` in the folder)");
        } else {
            let _ = writeln!(
                md,
                "- **Logs read**: {} ({} criterion measurements, {} torch decode lines, {} torch prefill lines)",
                logs.iter().map(|l| format!("`{l}`")).collect::<Vec<_>>().join(", "),
                self.m.criterion.len(),
                self.m.torch_decode.len(),
                self.m.torch_prefill.len()
            );
        }
        for n in &self.m.bench_notes {
            let _ = writeln!(md, "- Note from a log: `{n}`");
        }
        if !self.m.repeated.is_empty() {
            let _ = writeln!(
                md,
                "- Measured more than once (the last measurement is used): {}",
                self.m
                    .repeated
                    .iter()
                    .map(|i| format!("`{i}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        md.push('\n');
    }

    fn formulas(&self, md: &mut String) {
        md.push_str(
            "## How the numbers are made\n\n\
             - **Time**: criterion's point estimate, the middle value of its `time: [low estimate high]` \
             line (the whole interval is in the last table). Decode cases are per layer: a `step/*` or \
             `selector/*` graph holds a whole step of 8 layers (batch 1) or 4 (batch 16) and its time is \
             divided by them; `attention/*` is one layer. torch's times are the median of its timed calls.\n\
             - **Decode variants** (Llama-3-8B geometry: Hq 32, Hkv 8, D 128, bf16): dense = \
             `attention/dense/bB/C`, static = `attention/static/bB/C` (50% streaming KV heads), \
             dynamic = `step/dynamic/bB/C` (page selection on every head, reuse 4), LServe = \
             `step/lserve/bB/C` (both). The `step/*` cases are a decode step's layer (the append, the \
             selector when due, the attention); `attention/*` is the attention alone.\n\
             - **End-to-end decode step**: `32 × t(layer)` (32 decoder layers of Llama-3-8B, and of \
             Llama-2-7B for the MHA row); speedup = `32 × t(attention/dense) / (32 × t(step/lserve))` \
             = `t(attention/dense) / t(step/lserve)` at the same batch and context. Only the attention \
             part of a layer is timed (no projections, MLP or sampling).\n\
             - **Selector against the rest of the step**: `rest = t(step/lserve) − t(selector/reuse4)`: \
             both amortize one selection over 4 steps, so `rest` is the LServe layer without its \
             selector (append, attention, combine).\n\
             - **Prefill TFLOP/s**: `FLOPs / time / 10^12` with `FLOPs = 4 · Hq · D · L² / 2 = \
             2 · L² · D · Hq` (causal: half of `QKᵀ` and `PV`; Hq 32, D 128), the bench's own \
             `Throughput::Elements` and torch's count alike. The 50% streaming case is counted with the \
             same dense FLOPs (an effective rate: only its time and its ratio to dense matter). `ours / FA2` \
             and `ours / cuDNN` = `t(torch) / t(prefill/dense)` (the ratio of the rates).\n\
             - **Achieved bandwidth**: the bytes a case must move (as the bench counts them for \
             criterion's `thrpt`: K and V of the rows visited, q and out, the key statistics the \
             selector reads) / time; criterion prints GiB/s (`2^30` B/s), shown here in GB/s \
             (`10^9` B/s). Ceiling: `copy/device_to_device_1GiB`, `2 · 2^30` bytes (read + write) / \
             time, in the same run; `% of copy = achieved / copy`. A read-only kernel can exceed a \
             copy, so the copy is a reference, not a hard limit. torch's decode rate is its \
             `(K + V + q + out) bytes / median`, its copy its own `dst.copy_(src)` of 1 GiB.\n\n",
        );
    }

    fn decode_latency(&self, md: &mut String, png: &str) {
        let _ = writeln!(md, "## Decode latency per layer (the paper's Figure 15)\n");
        let _ = writeln!(md, "![decode latency per layer]({png})\n");
        for b in DECODE_BATCHES {
            let _ = writeln!(md, "Batch {b}:\n");
            md.push_str(
                "| context | dense | static | dynamic | LServe | torch cuDNN | torch flash |\n\
                 | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
            );
            for c in self.decode_contexts() {
                let torch = |backend: &str| {
                    Self::torch_cell(self.torch_decode(backend, b, c), |us, _| torch_us(us))
                };
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    plot::tokens_label(c as f64),
                    self.cell(&Self::decode_id("attention/dense", b, c)),
                    self.cell(&Self::decode_id("attention/static", b, c)),
                    self.cell(&Self::decode_id("step/dynamic", b, c)),
                    self.cell(&Self::decode_id("step/lserve", b, c)),
                    torch("cudnn"),
                    torch("flash"),
                );
            }
            md.push('\n');
        }
    }

    fn decode_speedup(&self, md: &mut String, png: &str) {
        let _ = writeln!(md, "## End-to-end decode speedup (the paper's Figure 16)\n");
        let _ = writeln!(md, "![end-to-end decode speedup]({png})\n");
        let rows: [(&str, &str, &str, usize); 3] = [
            ("Llama-3-8B", "attention/dense", "step/lserve", 1),
            ("Llama-3-8B", "attention/dense", "step/lserve", 16),
            (
                "Llama-2-7B (MHA)",
                "attention/dense_mha",
                "step/lserve_mha",
                1,
            ),
        ];
        md.push_str(
            "| model | batch | context | dense step (32 layers) | LServe step (32 layers) | speedup | vs torch cuDNN step |\n\
             | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for (model, dense, lserve, b) in rows {
            for c in self.decode_contexts() {
                let (di, li) = (Self::decode_id(dense, b, c), Self::decode_id(lserve, b, c));
                let step = |id: &str| match self.time(id) {
                    Some(t) => fmt_time(LAYERS * t),
                    None => self.cell(id),
                };
                let s = self
                    .speedup(&di, &li)
                    .map_or(NOT_MEASURED.to_string(), ratio);
                // torch's geometry is Llama-3-8B's only.
                let torch = if dense == "attention/dense" {
                    match (self.torch_decode_us("cudnn", b, c), self.time(&li)) {
                        (Some(us), Some(l)) => ratio(us * 1e-6 / l),
                        _ => NOT_MEASURED.into(),
                    }
                } else {
                    "".into()
                };
                let _ = writeln!(
                    md,
                    "| {model} | {b} | {} | {} | {} | {s} | {torch} |",
                    plot::tokens_label(c as f64),
                    step(&di),
                    step(&li)
                );
            }
        }
        md.push_str(
            "\n\"vs torch cuDNN step\" is `t(torch cuDNN dense decode) / t(step/lserve)` at the same \
             shape.\n\n",
        );
    }

    fn selector(&self, md: &mut String, png: &str) {
        let _ = writeln!(
            md,
            "## Selector against attention, reuse 1 and 4 (the paper's Figure 14)\n"
        );
        let _ = writeln!(md, "![selector against the rest of the step]({png})\n");
        for b in DECODE_BATCHES {
            let _ = writeln!(md, "Batch {b} (time per layer):\n");
            md.push_str(
                "| context | selector reuse 1 | selector reuse 4 | LServe step | rest (step − reuse 4) | reuse 4 / rest | reuse 1 / rest |\n\
                 | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
            );
            for c in self.decode_contexts() {
                let r1 = Self::decode_id("selector/reuse1", b, c);
                let r4 = Self::decode_id("selector/reuse4", b, c);
                let rest = self.rest_of_step(b, c);
                let share = |id: &str| match (self.time(id), rest) {
                    (Some(t), Some(r)) if r > 0.0 => format!("{:.2}", t / r),
                    _ => NOT_MEASURED.into(),
                };
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    plot::tokens_label(c as f64),
                    self.cell(&r1),
                    self.cell(&r4),
                    self.cell(&Self::decode_id("step/lserve", b, c)),
                    rest.map_or(NOT_MEASURED.to_string(), fmt_time),
                    share(&r4),
                    share(&r1),
                );
            }
            md.push('\n');
        }
    }

    fn prefill(&self, md: &mut String, png: &str) {
        let _ = writeln!(md, "## Prefill throughput: ours, FlashAttention-2, cuDNN\n");
        let _ = writeln!(md, "![prefill TFLOP/s]({png})\n");
        md.push_str(
            "| tokens | ours dense | ours TFLOP/s | torch flash (FA2) TFLOP/s | torch cuDNN TFLOP/s | ours / FA2 | ours / cuDNN | ours 50% streaming | dense / streaming |\n\
             | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for l in self.lens("prefill/dense/", &PREFILL_LENS) {
            let dense_id = format!("prefill/dense/{l}");
            let stream_id = format!("prefill/streaming50/{l}");
            let ours = self.time(&dense_id).map(|t| Self::prefill_tflops(l, t));
            let torch = |backend: &str| {
                Self::torch_cell(
                    self.m.torch_prefill.get(&(backend.to_string(), l)),
                    |_, rate| format!("{rate:.1}"),
                )
            };
            // Both count the same FLOPs: the ratio of rates is torch's time over ours.
            let vs = |backend: &str| match (
                self.time(&dense_id),
                self.m.torch_prefill.get(&(backend.to_string(), l)),
            ) {
                (Some(t), Some(TorchResult::Measured { median_us, .. })) => {
                    ratio(median_us * 1e-6 / t)
                }
                _ => NOT_MEASURED.into(),
            };
            let ds = match (self.time(&dense_id), self.time(&stream_id)) {
                (Some(d), Some(s)) => ratio(d / s),
                _ => NOT_MEASURED.into(),
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {ds} |",
                plot::tokens_label(l as f64),
                self.cell(&dense_id),
                ours.map_or(NOT_MEASURED.to_string(), |v| format!("{v:.1}")),
                torch("flash"),
                torch("cudnn"),
                vs("flash"),
                vs("cudnn"),
                self.cell(&stream_id),
            );
        }
        md.push_str(
            "\nBlock-sparse prefill at 32K (`prefill_block_sparse/sparsity_percent/S`: dense heads, a \
             random block mask keeping `(100 − S)%` of the off-diagonal causal blocks):\n\n\
             | sparsity | time | time / time at 0% |\n| ---: | ---: | ---: |\n",
        );
        let base = self.time("prefill_block_sparse/sparsity_percent/0");
        for s in self.lens("prefill_block_sparse/sparsity_percent/", &BLOCK_SPARSITIES) {
            let id = format!("prefill_block_sparse/sparsity_percent/{s}");
            let rel = match (self.time(&id), base) {
                (Some(t), Some(b)) => format!("{:.3}", t / b),
                _ => NOT_MEASURED.into(),
            };
            let _ = writeln!(md, "| {s}% | {} | {rel} |", self.cell(&id));
        }
        md.push_str(
            "\nThe cache write beside the prefill (`prefill_cache/NAME/L`, LServe pattern; `write`, \
             `pool`, `write_pool` with their achieved bandwidth):\n\n",
        );
        let lens = self.lens("prefill_cache/attention/", &CACHE_LENS);
        let _ = writeln!(
            md,
            "| case | {} |",
            lens.iter()
                .map(|&l| plot::tokens_label(l as f64))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        let _ = writeln!(md, "| --- |{}", " ---: |".repeat(lens.len()));
        for name in CACHE_NAMES {
            let cells: Vec<String> = lens
                .iter()
                .map(|l| {
                    let id = format!("prefill_cache/{name}/{l}");
                    let mut cell = self.cell(&id);
                    if let Some(bps) = self.m.get(&id).and_then(Criterion::bytes_per_s) {
                        let _ = write!(cell, " · {:.0} GB/s", bps / 1e9);
                    }
                    cell
                })
                .collect();
            let _ = writeln!(md, "| `{name}` | {} |", cells.join(" | "));
        }
        md.push('\n');
    }

    fn bandwidth(&self, md: &mut String, png: &str) {
        let _ = writeln!(
            md,
            "## Decode achieved bandwidth against the copy ceiling\n"
        );
        let _ = writeln!(md, "![decode bandwidth]({png})\n");
        let copy = self.copy_bps();
        match (self.m.get(COPY_ID), copy) {
            (Some(c), Some(bps)) => {
                let _ = writeln!(
                    md,
                    "Copy ceiling (`{COPY_ID}`): {} = {:.0} GB/s.",
                    fmt_time(c.est()),
                    bps / 1e9
                );
            }
            _ => {
                let _ = writeln!(md, "Copy ceiling (`{COPY_ID}`): {NOT_MEASURED}.");
            }
        }
        match self.m.torch_copy_tbps {
            Some(t) => {
                let _ = writeln!(md, "torch's copy in the same run: {:.0} GB/s.\n", t * 1e3);
            }
            None => {
                let _ = writeln!(md, "torch's copy: {NOT_MEASURED}.\n");
            }
        }
        md.push_str(
            "| case | batch | context | time | GB/s | % of copy |\n| --- | ---: | ---: | ---: | ---: | ---: |\n",
        );
        let cases = [
            "attention/dense",
            "attention/static",
            "step/dynamic",
            "step/lserve",
            "selector/reuse1",
            "selector/reuse4",
            "kv/append",
            "kv/pool",
            "attention/dense_mha",
            "step/lserve_mha",
        ];
        for gn in cases {
            for b in DECODE_BATCHES {
                let single = matches!(gn, "kv/pool" | "attention/dense_mha" | "step/lserve_mha");
                if single && b != 1 {
                    continue;
                }
                for c in self.decode_contexts() {
                    let id = Self::decode_id(gn, b, c);
                    let (gbs, pct) = match self.m.get(&id).and_then(Criterion::bytes_per_s) {
                        Some(bps) => (
                            format!("{:.0}", bps / 1e9),
                            copy.map_or(NOT_MEASURED.to_string(), |cp| {
                                format!("{:.0}%", 100.0 * bps / cp)
                            }),
                        ),
                        None => (NOT_MEASURED.to_string(), NOT_MEASURED.to_string()),
                    };
                    let _ = writeln!(
                        md,
                        "| `{gn}` | {b} | {} | {} | {gbs} | {pct} |",
                        plot::tokens_label(c as f64),
                        self.cell(&id)
                    );
                }
            }
        }
        for backend in ["cudnn", "flash"] {
            for b in DECODE_BATCHES {
                for c in self.decode_contexts() {
                    let r = self.torch_decode(backend, b, c);
                    let (t, gbs, pct) = match r {
                        Some(TorchResult::Measured { median_us, rate }) => (
                            torch_us(*median_us),
                            format!("{:.0}", rate * 1e3),
                            copy.map_or(NOT_MEASURED.to_string(), |cp| {
                                format!("{:.0}%", 100.0 * rate * 1e12 / cp)
                            }),
                        ),
                        Some(TorchResult::Unsupported(_)) => {
                            ("unsupported".into(), "".into(), "".into())
                        }
                        None => (
                            NOT_MEASURED.into(),
                            NOT_MEASURED.into(),
                            NOT_MEASURED.into(),
                        ),
                    };
                    let _ = writeln!(
                        md,
                        "| torch {backend} | {b} | {} | {t} | {gbs} | {pct} |",
                        plot::tokens_label(c as f64)
                    );
                }
            }
        }
        md.push_str("\ntorch's % is against our copy ceiling of the same run.\n\n");
    }

    fn page_sizes(&self, md: &mut String, pngs: &[String]) {
        let _ = writeln!(
            md,
            "## Decode latency against the physical page size (the paper's Table 1)\n"
        );
        md.push_str(
            "`pages/{lserve,dense}_F_pN/bB/C`: the LServe step (as `step/lserve`) and dense decode \
             (as `attention/dense`) with physical pages of N tokens (logical pages 16) over a bf16, \
             INT8 or INT4 cache; time per layer.\n\n",
        );
        for png in pngs {
            let _ = writeln!(md, "![decode latency against the page size]({png})\n");
        }
        let _ = writeln!(
            md,
            "| case | batch | context | {} | N_P 16 / N_P 64 |\n| --- | ---: | ---: |{} ---: |",
            PAGE_SIZES
                .iter()
                .map(|n| format!("N_P {n}"))
                .collect::<Vec<_>>()
                .join(" | "),
            " ---: |".repeat(PAGE_SIZES.len())
        );
        for kind in ["lserve", "dense"] {
            for format in PAGE_FORMATS {
                for b in DECODE_BATCHES {
                    for c in PAGE_CONTEXTS {
                        let cells: Vec<String> = PAGE_SIZES
                            .iter()
                            .map(|&n| self.cell(&Self::page_id(kind, format, n, b, c)))
                            .collect();
                        let rel = match (
                            self.time(&Self::page_id(kind, format, 16, b, c)),
                            self.time(&Self::page_id(kind, format, 64, b, c)),
                        ) {
                            (Some(x), Some(y)) => ratio(x / y),
                            _ => NOT_MEASURED.into(),
                        };
                        let _ = writeln!(
                            md,
                            "| `pages/{kind}_{format}` | {b} | {} | {} | {rel} |",
                            plot::tokens_label(c as f64),
                            cells.join(" | ")
                        );
                    }
                }
            }
        }
        md.push('\n');
    }

    fn everything(&self, md: &mut String) {
        md.push_str("## Every measurement\n\nCriterion (time interval `[low estimate high]`; throughput at the estimate):\n\n");
        if self.m.criterion.is_empty() {
            md.push_str("None: the logs hold no criterion measurement.\n\n");
        } else {
            md.push_str("| id | low | estimate | high | throughput | log |\n| --- | ---: | ---: | ---: | ---: | --- |\n");
            for c in &self.m.criterion {
                let thrpt = match c.thrpt {
                    Some((v, parse::ThroughputKind::Bytes)) => format!("{:.1} GB/s", v[1] / 1e9),
                    Some((v, parse::ThroughputKind::Elements)) => {
                        format!("{:.1} Telem/s", v[1] / 1e12)
                    }
                    None => String::new(),
                };
                let _ = writeln!(
                    md,
                    "| `{}` | {} | {} | {} | {thrpt} | `{}` |",
                    c.id,
                    fmt_time(c.time[0]),
                    fmt_time(c.time[1]),
                    fmt_time(c.time[2]),
                    c.source
                );
            }
            md.push('\n');
        }
        md.push_str("torch SDPA (`benches/torch_sdpa.py`):\n\n");
        if self.m.torch_decode.is_empty() && self.m.torch_prefill.is_empty() {
            md.push_str("None: the logs hold no torch line.\n\n");
        } else {
            md.push_str("| what | back end | batch | context | median | rate |\n| --- | --- | ---: | ---: | ---: | ---: |\n");
            let show = |r: &TorchResult, unit: &str| match r {
                TorchResult::Measured { median_us, rate } => {
                    (torch_us(*median_us), format!("{rate} {unit}"))
                }
                TorchResult::Unsupported(msg) => ("unsupported".into(), msg.replace('|', "\\|")),
            };
            for ((backend, b, c), r) in &self.m.torch_decode {
                let (t, rate) = show(r, "TB/s");
                let _ = writeln!(md, "| decode | {backend} | {b} | {c} | {t} | {rate} |");
            }
            for ((backend, c), r) in &self.m.torch_prefill {
                let (t, rate) = show(r, "TFLOP/s");
                let _ = writeln!(md, "| prefill | {backend} | 1 | {c} | {t} | {rate} |");
            }
            md.push('\n');
        }
        if !self.m.skipped.is_empty() {
            md.push_str("Cases a bench skipped, with its reason:\n\n");
            for (id, why) in &self.m.skipped {
                let _ = writeln!(md, "- `{id}`: {why}");
            }
            md.push('\n');
        }
    }
}

/// FLOPs of causal attention over `len` tokens at the prefill geometry: `4 · Hq · D · L² / 2`.
pub fn prefill_flops(len: usize) -> f64 {
    4.0 * PREFILL_HQ * PREFILL_D * (len as f64) * (len as f64) / 2.0
}

/// `YYYY-MM-DD HH:MM:SSZ` now (UTC), without a date crate.
fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86400, secs % 86400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day) (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(fmt_time(12.679e-6), "12.679 µs");
        assert_eq!(fmt_time(1.9099e-3), "1.9099 ms");
        assert_eq!(fmt_time(400.55e-3), "400.55 ms");
        assert_eq!(fmt_time(2.5), "2.5000 s");
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
    }

    #[test]
    fn prefill_flop_count_is_the_benches() {
        // benches/prefill.rs: (4 * HQ * D) * L^2 / 2 with HQ 32, D 128.
        assert_eq!(
            prefill_flops(4096),
            (4 * 32 * 128) as f64 * 4096.0 * 4096.0 / 2.0
        );
    }
}
