//! The page-size study (`docs/PAGE_SIZE.md`), on the CPU reference: page selection at equal
//! token budget on synthetic long contexts with realistic key statistics (outlier channel
//! pairs, RoPE at every position: `common::rope_context`) and planted needles of several
//! strengths. For flat pages (`N_P = N_L` = 16 / 32 / 64 / 128), hierarchical pages (`N_L` 16
//! in `N_P` = 32 / 64 / 128) and logical-page selection (16-token logical pages inside 64-token
//! pages, `SelectionUnit::LogicalPage`), each from bf16 statistics and from 8-bit statistics
//! per 32 channels (`StatsFormat::DEVICE_INT8`, what the device keeps), at two token budgets:
//! needle recall (a needle counts when the unit holding it is selected) and attention mass
//! captured (the softmax weight, over every token, of the selected units' tokens).
//!
//! The selection is the library's: the config's `SelectionParams` (as
//! `reference::select::select_from_cache` builds them: first and newest unit always included,
//! `K = token_budget / unit_tokens` more) through `reference::select::select_pages`, the
//! statistics from `reference::kv_write::key_stats`, 8-bit ones through
//! `reference::quant::quantize_key_stats` and back. One query head (no GQA aggregation).
//!
//! `cargo run --release --example page_size_study -- [--contexts N] [--out DIR]` prints the
//! tables as Markdown and, with `--out`, writes `summary.tsv`, `strength.tsv`, `paired.tsv` and
//! `run.md` there, what `lserve-page-size-report` (crate `report`) turns into
//! `docs/page-size/REPORT.md` and its plots.

mod common;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use common::{capture, rope_context, selection_params, Captured, OUTLIER_PAIRS, ROPE_BASE};
use lserve::config::{SelectionUnit, SparsityConfig};
use lserve::quant::StatsFormat;
use lserve::reference::kv_write::{key_stats, KeyStats};
use lserve::reference::quant::quantize_key_stats;

/// Tokens of every context.
const LEN: usize = 65536;
/// The token budgets (`SparsityConfig::token_budget`: tokens besides the first and newest unit).
const BUDGETS: [usize; 2] = [2048, 4096];
/// Needle strengths: standard deviations of the background's post-RoPE `q · k` above its mean,
/// one needle of each per context.
const STRENGTHS: [f64; 8] = [5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
/// Contexts by default: a setting's recall then has a standard error of about a third of a point,
/// a paired difference between two settings less.
const CONTEXTS: usize = 1600;

/// How pages are cut and what the selection picks.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Layout {
    /// `flatN`, `hierN`, `logicalN` (`N = N_P`).
    id: &'static str,
    n_p: usize,
    n_l: usize,
    unit: SelectionUnit,
}

const fn layout(id: &'static str, n_p: usize, n_l: usize, unit: SelectionUnit) -> Layout {
    Layout { id, n_p, n_l, unit }
}

const LAYOUTS: [Layout; 8] = [
    layout("flat16", 16, 16, SelectionUnit::PhysicalPage),
    layout("flat32", 32, 32, SelectionUnit::PhysicalPage),
    layout("flat64", 64, 64, SelectionUnit::PhysicalPage),
    layout("flat128", 128, 128, SelectionUnit::PhysicalPage),
    layout("hier32", 32, 16, SelectionUnit::PhysicalPage),
    layout("hier64", 64, 16, SelectionUnit::PhysicalPage),
    layout("hier128", 128, 16, SelectionUnit::PhysicalPage),
    layout("logical64", 64, 16, SelectionUnit::LogicalPage),
];

/// The statistics formats: name in the files, format.
const STATS: [(&str, StatsFormat); 2] = [
    ("bf16", StatsFormat::Half),
    ("q8", StatsFormat::DEVICE_INT8),
];

/// One measured setting.
#[derive(Clone, Copy, Debug)]
struct Setting {
    layout: Layout,
    stats: usize,
    budget: usize,
    config: SparsityConfig,
}

impl Setting {
    fn name(&self) -> String {
        format!("{}:{}", self.layout.id, STATS[self.stats].0)
    }
}

fn settings() -> Vec<Setting> {
    let mut v = Vec::new();
    for budget in BUDGETS {
        for layout in LAYOUTS {
            for (stats, &(_, format)) in STATS.iter().enumerate() {
                let config = SparsityConfig {
                    token_budget: budget,
                    page_tokens: layout.n_p,
                    logical_page_tokens: layout.n_l,
                    selection_unit: layout.unit,
                    stats_format: format,
                    ..SparsityConfig::default()
                };
                config.validate().expect("a valid config");
                v.push(Setting {
                    layout,
                    stats,
                    budget,
                    config,
                });
            }
        }
    }
    v
}

/// Every setting's capture of context `seed`.
fn run_context(seed: u64, settings: &[Setting]) -> Vec<Captured> {
    let c = rope_context(seed, LEN, &STRENGTHS);
    // The statistics per (logical page tokens, format), computed once.
    let mut exact: Vec<(usize, KeyStats)> = Vec::new();
    let mut stats: Vec<((usize, usize), KeyStats)> = Vec::new();
    settings
        .iter()
        .map(|s| {
            let n_l = s.layout.n_l;
            if !exact.iter().any(|(k, _)| *k == n_l) {
                exact.push((n_l, key_stats(&c.keys, common::D, n_l).expect("stats")));
            }
            let key = (n_l, s.stats);
            if !stats.iter().any(|(k, _)| *k == key) {
                let e = &exact.iter().find(|(k, _)| *k == n_l).expect("computed").1;
                let st = match s.config.stats_format {
                    StatsFormat::Half => e.clone(),
                    StatsFormat::Int8(group) => quantize_key_stats(e, group)
                        .expect("8-bit statistics")
                        .dequantized(),
                };
                stats.push((key, st));
            }
            let st = &stats.iter().find(|(k, _)| *k == key).expect("computed").1;
            let (params, unit_tokens) = selection_params(&s.config);
            capture(&c, st, &params, unit_tokens)
        })
        .collect()
}

/// Mean and standard error of the mean.
fn mean_se(x: impl Iterator<Item = f64>) -> (f64, f64) {
    let v: Vec<f64> = x.collect();
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, (var / n).sqrt())
}

/// A number per capture.
type Metric = fn(&Captured) -> f64;

fn recall(c: &Captured) -> f64 {
    c.needles.iter().filter(|&&f| f).count() as f64 / c.needles.len() as f64
}

struct Args {
    contexts: usize,
    out: Option<PathBuf>,
}

fn args() -> Args {
    let mut a = Args {
        contexts: CONTEXTS,
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{arg} takes a value"));
        match arg.as_str() {
            "--contexts" => a.contexts = value().parse().expect("--contexts N"),
            "--out" => a.out = Some(PathBuf::from(value())),
            _ => panic!("usage: page_size_study [--contexts N] [--out DIR]"),
        }
    }
    assert!(a.contexts >= 2, "--contexts: at least 2");
    a
}

fn main() {
    let args = args();
    let settings = settings();
    let start = Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Context `i` is seed `i`, whatever the thread that runs it.
    let mut runs: Vec<(usize, Vec<Captured>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let settings = &settings;
                scope.spawn(move || {
                    (t..args.contexts)
                        .step_by(threads)
                        .map(|i| (i, run_context(i as u64, settings)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a study thread"))
            .collect()
    });
    runs.sort_by_key(|r| r.0);
    let runs: Vec<Vec<Captured>> = runs.into_iter().map(|r| r.1).collect();
    let seconds = start.elapsed().as_secs_f64();
    let n = runs.len();
    let index = |id: &str, stats: &str, budget: usize| {
        settings
            .iter()
            .position(|s| s.layout.id == id && STATS[s.stats].0 == stats && s.budget == budget)
            .expect("a setting")
    };

    // Logical pages of 16 tokens scored from their own statistics select what flat 16 selects.
    for budget in BUDGETS {
        for (stats, _) in STATS {
            let (a, b) = (
                index("logical64", stats, budget),
                index("flat16", stats, budget),
            );
            assert!(
                runs.iter()
                    .all(|r| r[a].needles == r[b].needles && r[a].mass == r[b].mass),
                "logical 16-in-64 and flat 16 differ ({stats}, budget {budget})"
            );
        }
    }

    let head = "layout\tn_p\tn_l\tunit\tstats\tbudget";
    let key = |s: &Setting| {
        format!(
            "{}\t{}\t{}\t{}\t{}\t{}",
            s.layout.id,
            s.layout.n_p,
            s.layout.n_l,
            match s.layout.unit {
                SelectionUnit::PhysicalPage => "physical",
                SelectionUnit::LogicalPage => "logical",
            },
            STATS[s.stats].0,
            s.budget
        )
    };
    let mut summary = format!(
        "{head}\tcontexts\tneedles\trecall\trecall_se\tmass\tmass_se\tbg_mass\tbg_mass_se\n"
    );
    let mut strength = format!("{head}\tstrength\tneedles\trecall\trecall_se\n");
    for (i, s) in settings.iter().enumerate() {
        let (r, r_se) = mean_se(runs.iter().map(|c| recall(&c[i])));
        let (m, m_se) = mean_se(runs.iter().map(|c| c[i].mass));
        let (b, b_se) = mean_se(runs.iter().map(|c| c[i].background_mass));
        let _ = writeln!(
            summary,
            "{}\t{n}\t{}\t{r:.6}\t{r_se:.6}\t{m:.6}\t{m_se:.6}\t{b:.6}\t{b_se:.6}",
            key(s),
            n * STRENGTHS.len()
        );
        for (j, z) in STRENGTHS.iter().enumerate() {
            let (p, se) = mean_se(runs.iter().map(|c| f64::from(u8::from(c[i].needles[j]))));
            let _ = writeln!(strength, "{}\t{z}\t{n}\t{p:.6}\t{se:.6}", key(s));
        }
    }

    // Paired differences over the same contexts: every layout against flat 16 and against the
    // flat layout of its physical page, 8-bit statistics against bf16.
    let mut paired = String::from("budget\tmetric\ta\tb\tdiff\tdiff_se\n");
    let metrics: [(&str, Metric); 3] = [
        ("recall", recall),
        ("mass", |c| c.mass),
        ("bg_mass", |c| c.background_mass),
    ];
    for budget in BUDGETS {
        let mut pairs: Vec<(usize, usize)> = Vec::new();
        for l in LAYOUTS {
            for (stats, _) in STATS {
                let a = index(l.id, stats, budget);
                if l.id != "flat16" {
                    pairs.push((a, index("flat16", stats, budget)));
                }
                let flat = format!("flat{}", l.n_p);
                if l.id != flat {
                    pairs.push((a, index(&flat, stats, budget)));
                }
            }
            pairs.push((index(l.id, "q8", budget), index(l.id, "bf16", budget)));
        }
        for (metric, f) in metrics {
            for &(a, b) in &pairs {
                let (d, se) = mean_se(runs.iter().map(|c| f(&c[a]) - f(&c[b])));
                let _ = writeln!(
                    paired,
                    "{budget}\t{metric}\t{}\t{}\t{d:.6}\t{se:.6}",
                    settings[a].name(),
                    settings[b].name()
                );
            }
        }
    }

    let outliers: Vec<String> = OUTLIER_PAIRS
        .iter()
        .map(|(i, a)| format!("{i} ({a})"))
        .collect();
    let strengths: Vec<String> = STRENGTHS.iter().map(|z| z.to_string()).collect();
    let run = format!(
        "- **Contexts**: {n} of {LEN} tokens (seeds 0..{n}), one KV head of D {d}, one query head, \
         `common::rope_context`: RoPE base {ROPE_BASE} on pairs (i, i + D/2); outlier pairs \
         (index (mean magnitude)): {}; {} needles per context, strengths {} standard deviations \
         of the background's post-RoPE q · k.\n\
         - **Selection**: the library's defaults but the layout, budget and statistics format \
         (first and newest unit always selected, K = budget / unit tokens more); budgets {}.\n\
         - **Run**: `cargo run --release --example page_size_study -- --contexts {n} --out DIR`, \
         {threads} threads, {seconds:.0} s.\n",
        outliers.join(", "),
        STRENGTHS.len(),
        strengths.join(", "),
        BUDGETS.map(|b| b.to_string()).join(" and "),
        d = common::D,
    );

    println!("# Page-size study\n\n{run}");
    for budget in BUDGETS {
        println!("## Budget {budget}\n");
        println!(
            "| layout | recall bf16 | recall 8-bit | Δ 8-bit | mass bf16 | mass 8-bit | \
             background mass bf16 | background mass 8-bit |"
        );
        println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for l in LAYOUTS {
            let (b, q) = (index(l.id, "bf16", budget), index(l.id, "q8", budget));
            let rb = mean_se(runs.iter().map(|c| recall(&c[b])));
            let rq = mean_se(runs.iter().map(|c| recall(&c[q])));
            let d = mean_se(runs.iter().map(|c| recall(&c[q]) - recall(&c[b])));
            let mb = mean_se(runs.iter().map(|c| c[b].mass));
            let mq = mean_se(runs.iter().map(|c| c[q].mass));
            let bb = mean_se(runs.iter().map(|c| c[b].background_mass));
            let bq = mean_se(runs.iter().map(|c| c[q].background_mass));
            let pct = |(m, se): (f64, f64)| format!("{:.2} ± {:.2}", 100.0 * m, 100.0 * se);
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                l.id,
                pct(rb),
                pct(rq),
                pct(d),
                pct(mb),
                pct(mq),
                pct(bb),
                pct(bq)
            );
        }
        println!();
    }
    if let Some(out) = args.out {
        std::fs::create_dir_all(&out).expect("the output folder");
        for (name, text) in [
            ("summary.tsv", &summary),
            ("strength.tsv", &strength),
            ("paired.tsv", &paired),
            ("run.md", &run),
        ] {
            std::fs::write(out.join(name), text).expect("writing the study's files");
        }
        println!("wrote {}", out.display());
    }
}
