//! The page-size study's report: reads the folder that `page_size_study --out DIR` writes (the
//! suite's example: `summary.tsv`, every setting's needle recall and attention mass with their
//! standard errors; `strength.tsv`, recall per needle strength; `paired.tsv`, differences
//! between settings paired over the same contexts; `run.md`, what ran) and writes `REPORT.md`
//! with the tables, the verdicts on the targets, and three PNG plots: recall and
//! background mass against the physical page size, and recall against the needle strength.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use plotters::prelude::SeriesLabelPosition;

use crate::plot::{self, Panel, Series};

/// What to read and where to write.
#[derive(Clone, Debug)]
pub struct Options {
    /// The folder `page_size_study --out` wrote.
    pub data: PathBuf,
    /// Where `REPORT.md` and the PNGs go (created).
    pub out: PathBuf,
}

/// One setting at one budget (`summary.tsv`); fractions, not percent.
#[derive(Clone, Debug, PartialEq)]
pub struct Setting {
    /// `flatN`, `hierN`, `logicalN`.
    pub layout: String,
    pub n_p: usize,
    pub n_l: usize,
    /// `physical` or `logical` (what the top-K picks).
    pub unit: String,
    /// `bf16` or `q8` (8-bit per 32 channels).
    pub stats: String,
    pub budget: usize,
    pub contexts: usize,
    pub needles: usize,
    pub recall: (f64, f64),
    /// Over every token (needles included).
    pub mass: (f64, f64),
    /// Over the background's softmax (needles left out).
    pub bg_mass: (f64, f64),
}

impl Setting {
    /// `hier64:bf16`, as `paired.tsv` names settings.
    pub fn name(&self) -> String {
        format!("{}:{}", self.layout, self.stats)
    }
}

/// Recall of the needles of one strength (`strength.tsv`).
#[derive(Clone, Debug, PartialEq)]
pub struct StrengthRow {
    pub layout: String,
    pub stats: String,
    pub budget: usize,
    pub strength: f64,
    pub recall: (f64, f64),
}

/// `a − b` over the same contexts (`paired.tsv`).
#[derive(Clone, Debug, PartialEq)]
pub struct PairedRow {
    pub budget: usize,
    /// `recall`, `mass` or `bg_mass`.
    pub metric: String,
    pub a: String,
    pub b: String,
    pub diff: (f64, f64),
}

/// Everything the study wrote.
#[derive(Clone, Debug)]
pub struct Study {
    pub settings: Vec<Setting>,
    pub strengths: Vec<StrengthRow>,
    pub paired: Vec<PairedRow>,
    /// `run.md` (empty without one).
    pub run: String,
}

/// The label of a layout id: `flat16` → `flat 16`, `hier64` → `hierarchical 64/16`,
/// `logical64` → `logical 16 in 64` (logical pages of 16 tokens).
pub fn layout_label(id: &str, n_l: usize) -> String {
    let n = |p: &str| id.strip_prefix(p).map(str::to_string);
    if let Some(p) = n("flat") {
        format!("flat {p}")
    } else if let Some(p) = n("hier") {
        format!("hierarchical {p}/{n_l}")
    } else if let Some(p) = n("logical") {
        format!("logical {n_l} in {p}")
    } else {
        id.to_string()
    }
}

fn stats_label(stats: &str) -> &str {
    match stats {
        "bf16" => "bf16",
        "q8" => "8-bit / 32 ch",
        other => other,
    }
}

/// Splits the data lines of `text` (after the header `head`) into fields, with `file` and the
/// line number in errors.
fn rows<'a>(text: &'a str, file: &str, head: &str) -> Result<Vec<(usize, Vec<&'a str>)>, String> {
    let mut lines = text.lines();
    if lines.next() != Some(head) {
        return Err(format!("{file}: the header is not {head:?}"));
    }
    let n = head.split('\t').count();
    lines
        .enumerate()
        .filter(|(_, l)| !l.is_empty())
        .map(|(i, l)| {
            let f: Vec<&str> = l.split('\t').collect();
            if f.len() == n {
                Ok((i + 2, f))
            } else {
                Err(format!(
                    "{file} line {}: {} fields, not {n}",
                    i + 2,
                    f.len()
                ))
            }
        })
        .collect()
}

fn num<T: std::str::FromStr>(x: &str, file: &str, line: usize) -> Result<T, String> {
    x.parse()
        .map_err(|_| format!("{file} line {line}: {x:?} is not a number"))
}

const SUMMARY_HEAD: &str = "layout\tn_p\tn_l\tunit\tstats\tbudget\tcontexts\tneedles\trecall\trecall_se\tmass\tmass_se\tbg_mass\tbg_mass_se";
const STRENGTH_HEAD: &str =
    "layout\tn_p\tn_l\tunit\tstats\tbudget\tstrength\tneedles\trecall\trecall_se";
const PAIRED_HEAD: &str = "budget\tmetric\ta\tb\tdiff\tdiff_se";

/// Reads the study's folder.
pub fn read(dir: &Path) -> Result<Study, String> {
    let read = |name: &str| {
        let p = dir.join(name);
        fs::read_to_string(&p)
            .map(|t| (t, p.display().to_string()))
            .map_err(|e| format!("reading {}: {e}", p.display()))
    };
    let (text, file) = read("summary.tsv")?;
    let mut settings = Vec::new();
    for (line, f) in rows(&text, &file, SUMMARY_HEAD)? {
        let x = |i: usize| num::<f64>(f[i], &file, line);
        let u = |i: usize| num::<usize>(f[i], &file, line);
        settings.push(Setting {
            layout: f[0].into(),
            n_p: u(1)?,
            n_l: u(2)?,
            unit: f[3].into(),
            stats: f[4].into(),
            budget: u(5)?,
            contexts: u(6)?,
            needles: u(7)?,
            recall: (x(8)?, x(9)?),
            mass: (x(10)?, x(11)?),
            bg_mass: (x(12)?, x(13)?),
        });
    }
    if settings.is_empty() {
        return Err(format!("{file} has no settings"));
    }
    let (text, file) = read("strength.tsv")?;
    let mut strengths = Vec::new();
    for (line, f) in rows(&text, &file, STRENGTH_HEAD)? {
        let x = |i: usize| num::<f64>(f[i], &file, line);
        strengths.push(StrengthRow {
            layout: f[0].into(),
            stats: f[4].into(),
            budget: num(f[5], &file, line)?,
            strength: x(6)?,
            recall: (x(8)?, x(9)?),
        });
    }
    let (text, file) = read("paired.tsv")?;
    let mut paired = Vec::new();
    for (line, f) in rows(&text, &file, PAIRED_HEAD)? {
        paired.push(PairedRow {
            budget: num(f[0], &file, line)?,
            metric: f[1].into(),
            a: f[2].into(),
            b: f[3].into(),
            diff: (num(f[4], &file, line)?, num(f[5], &file, line)?),
        });
    }
    let run = fs::read_to_string(dir.join("run.md")).unwrap_or_default();
    Ok(Study {
        settings,
        strengths,
        paired,
        run,
    })
}

impl Study {
    /// The budgets, ascending.
    pub fn budgets(&self) -> Vec<usize> {
        let mut b: Vec<usize> = self.settings.iter().map(|s| s.budget).collect();
        b.sort_unstable();
        b.dedup();
        b
    }

    /// The layouts in the order the study lists them.
    fn layouts(&self) -> Vec<&Setting> {
        let mut v: Vec<&Setting> = Vec::new();
        for s in &self.settings {
            if !v.iter().any(|o| o.layout == s.layout) {
                v.push(s);
            }
        }
        v
    }

    pub fn setting(&self, layout: &str, stats: &str, budget: usize) -> Option<&Setting> {
        self.settings
            .iter()
            .find(|s| s.layout == layout && s.stats == stats && s.budget == budget)
    }

    /// `a − b` of `metric` at `budget` (settings named `layout:stats`).
    pub fn diff(&self, budget: usize, metric: &str, a: &str, b: &str) -> Option<(f64, f64)> {
        self.paired
            .iter()
            .find(|p| p.budget == budget && p.metric == metric && p.a == a && p.b == b)
            .map(|p| p.diff)
    }
}

/// `82.62 ± 0.34` (percent).
fn pct((m, se): (f64, f64)) -> String {
    format!("{:.2} ± {:.2}", 100.0 * m, 100.0 * se)
}

/// `+1.25 ± 0.34` (percentage points).
fn points((m, se): (f64, f64)) -> String {
    format!("{:+.2} ± {:.2}", 100.0 * m, 100.0 * se)
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "**yes**"
    } else {
        "**no**"
    }
}

/// What [`generate`] wrote.
#[derive(Debug)]
pub struct Written {
    pub markdown: PathBuf,
    pub pngs: Vec<PathBuf>,
    pub settings: usize,
}

/// Reads `opts.data` and writes `REPORT.md` and the PNGs into `opts.out`.
pub fn generate(opts: &Options) -> Result<Written, String> {
    let study = read(&opts.data)?;
    fs::create_dir_all(&opts.out).map_err(|e| format!("{}: {e}", opts.out.display()))?;
    let mut md = String::from("# Page-size study\n\n");
    md.push_str(
        "Generated by `lserve-page-size-report` (crate `report`) from the files \
         `page_size_study --out` wrote (`data/`); every number below is computed from them. \
         Percentages ± the standard error of the mean over the contexts; differences between \
         settings are paired over the same contexts (± their standard error).\n\n",
    );
    if !study.run.trim().is_empty() {
        md.push_str(study.run.trim_end());
        md.push_str("\n\n");
    }
    targets(&mut md, &study);
    tables(&mut md, &study);
    against_flat16(&mut md, &study);
    by_strength(&mut md, &study);

    let mut pngs = Vec::new();
    let budgets = study.budgets();
    let recall_png = opts.out.join("page_size_recall.png");
    plot::draw(
        &recall_png,
        "Needle recall against the physical page size, at equal token budget",
        &budgets
            .iter()
            .map(|&b| page_panel(&study, b, "needle recall (%)", |s| s.recall.0))
            .collect::<Vec<_>>(),
    )?;
    pngs.push(recall_png);
    let mass_png = opts.out.join("page_size_mass.png");
    plot::draw(
        &mass_png,
        "Background attention mass captured against the physical page size",
        &budgets
            .iter()
            .map(|&b| page_panel(&study, b, "background mass (%)", |s| s.bg_mass.0))
            .collect::<Vec<_>>(),
    )?;
    pngs.push(mass_png);
    let strength_png = opts.out.join("page_size_strength.png");
    plot::draw(
        &strength_png,
        "Needle recall against the needle's strength (bf16 statistics)",
        &budgets
            .iter()
            .map(|&b| strength_panel(&study, b))
            .collect::<Vec<_>>(),
    )?;
    pngs.push(strength_png);
    md.push_str("## Plots\n\n");
    let markdown = plot::write_markdown(&opts.out, md, &pngs)?;
    Ok(Written {
        markdown,
        pngs,
        settings: study.settings.len(),
    })
}

/// The targets, judged on the point estimates: hierarchical 64/16 recall within 1
/// point of flat 16 and above flat 64 at the same budget; 8-bit statistics lose at most 0.5
/// points of recall against bf16 statistics.
fn targets(md: &mut String, s: &Study) {
    md.push_str(
        "## Targets\n\nJudged on the point estimates (a difference is `a − b` in percentage \
         points, paired over the contexts).\n\n\
         | target | budget | statistics | measured | met |\n| --- | ---: | --- | --- | --- |\n",
    );
    for b in s.budgets() {
        for stats in ["bf16", "q8"] {
            let h = format!("hier64:{stats}");
            if let Some(d) = s.diff(b, "recall", &h, &format!("flat16:{stats}")) {
                let _ = writeln!(
                    md,
                    "| hierarchical 64/16 within 1 point of flat 16 | {b} | {} | {} | {} |",
                    stats_label(stats),
                    points(d),
                    yes_no(100.0 * d.0 >= -1.0)
                );
            }
            if let Some(d) = s.diff(b, "recall", &h, &format!("flat64:{stats}")) {
                let _ = writeln!(
                    md,
                    "| hierarchical 64/16 above flat 64 | {b} | {} | {} | {} |",
                    stats_label(stats),
                    points(d),
                    yes_no(d.0 > 0.0)
                );
            }
        }
        let worst = s
            .layouts()
            .into_iter()
            .filter_map(|l| {
                let d = s.diff(
                    b,
                    "recall",
                    &format!("{}:q8", l.layout),
                    &format!("{}:bf16", l.layout),
                )?;
                Some((l, d))
            })
            .min_by(|x, y| x.1 .0.total_cmp(&y.1 .0));
        if let Some((l, d)) = worst {
            let _ = writeln!(
                md,
                "| 8-bit statistics lose at most 0.5 points of recall | {b} | 8-bit / 32 ch − bf16, \
                 the worst layout ({}) | {} | {} |",
                layout_label(&l.layout, l.n_l),
                points(d),
                yes_no(100.0 * d.0 >= -0.5)
            );
        }
    }
    md.push('\n');
}

fn tables(md: &mut String, s: &Study) {
    for b in s.budgets() {
        let _ = writeln!(
            md,
            "## Budget {b}\n\nRecall: needles whose unit was selected. Background mass: the \
             softmax weight captured of the context without its needles. Mass: of every token \
             (the needles hold nearly all of it).\n\n\
             | layout | N_P | N_L | recall bf16 | recall 8-bit | Δ recall 8-bit | background mass bf16 \
             | background mass 8-bit | Δ background mass 8-bit | mass bf16 |\n\
             | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        );
        for l in s.layouts() {
            let (Some(x), Some(q)) = (
                s.setting(&l.layout, "bf16", b),
                s.setting(&l.layout, "q8", b),
            ) else {
                continue;
            };
            let d = |metric: &str| {
                s.diff(b, metric, &q.name(), &x.name())
                    .map_or("-".to_string(), points)
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                layout_label(&l.layout, l.n_l),
                l.n_p,
                l.n_l,
                pct(x.recall),
                pct(q.recall),
                d("recall"),
                pct(x.bg_mass),
                pct(q.bg_mass),
                d("bg_mass"),
                pct(x.mass),
            );
        }
        if let Some(x) = s.settings.iter().find(|x| x.budget == b) {
            let _ = writeln!(
                md,
                "\n{} contexts, {} needles per setting.\n",
                x.contexts, x.needles
            );
        }
    }
}

fn against_flat16(md: &mut String, s: &Study) {
    md.push_str(
        "## Against flat 16 and against the flat layout of the same page\n\nPaired differences in \
         percentage points (`layout − flat 16`; `layout − flat N_P` for the hierarchical and \
         logical layouts).\n\n\
         | budget | statistics | layout | Δ recall vs flat 16 | Δ background mass vs flat 16 | \
         Δ recall vs flat N_P | Δ background mass vs flat N_P |\n\
         | ---: | --- | --- | ---: | ---: | ---: | ---: |\n",
    );
    for b in s.budgets() {
        for stats in ["bf16", "q8"] {
            for l in s.layouts() {
                if l.layout == "flat16" {
                    continue;
                }
                let a = format!("{}:{stats}", l.layout);
                let f16 = format!("flat16:{stats}");
                let fp = format!("flat{}:{stats}", l.n_p);
                let cell = |metric: &str, other: &str| {
                    if other == a {
                        return "".to_string();
                    }
                    s.diff(b, metric, &a, other).map_or("-".into(), points)
                };
                let _ = writeln!(
                    md,
                    "| {b} | {} | {} | {} | {} | {} | {} |",
                    stats_label(stats),
                    layout_label(&l.layout, l.n_l),
                    cell("recall", &f16),
                    cell("bg_mass", &f16),
                    cell("recall", &fp),
                    cell("bg_mass", &fp),
                );
            }
        }
    }
    md.push('\n');
}

fn strengths_of(s: &Study) -> Vec<f64> {
    let mut v: Vec<f64> = s.strengths.iter().map(|r| r.strength).collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    v
}

fn by_strength(md: &mut String, s: &Study) {
    let zs = strengths_of(s);
    if zs.is_empty() {
        return;
    }
    md.push_str(
        "## Recall by needle strength (bf16 statistics)\n\nA needle of strength z: its post-RoPE \
         `q · k` is z standard deviations of the background's above the background's mean. \
         Percent of the needles of that strength found.\n\n",
    );
    let _ = writeln!(
        md,
        "| budget | layout | {} |\n| ---: | --- |{}",
        zs.iter()
            .map(|z| format!("z {z}"))
            .collect::<Vec<_>>()
            .join(" | "),
        " ---: |".repeat(zs.len())
    );
    for b in s.budgets() {
        for l in s.layouts() {
            let cells: Vec<String> = zs
                .iter()
                .map(|&z| {
                    s.strengths
                        .iter()
                        .find(|r| {
                            r.layout == l.layout
                                && r.stats == "bf16"
                                && r.budget == b
                                && r.strength == z
                        })
                        .map_or("-".into(), |r| format!("{:.1}", 100.0 * r.recall.0))
                })
                .collect();
            let _ = writeln!(
                md,
                "| {b} | {} | {} |",
                layout_label(&l.layout, l.n_l),
                cells.join(" | ")
            );
        }
    }
    md.push('\n');
}

/// A metric against `N_P` at `budget`: flat pages (`N_L = N_P`) and hierarchical pages
/// (`N_L` 16; flat 16 at `N_P` 16), each from bf16 (solid) and 8-bit statistics (dashed), and
/// logical-page selection as its own point.
fn page_panel(s: &Study, budget: usize, y_desc: &str, value: fn(&Setting) -> f64) -> Panel {
    let line = |stats: &str, flat: bool| -> Vec<(f64, f64)> {
        let mut pts: Vec<(f64, f64)> = s
            .settings
            .iter()
            .filter(|x| x.budget == budget && x.stats == stats && x.unit == "physical")
            .filter(|x| if flat { x.n_l == x.n_p } else { x.n_l == 16 })
            .map(|x| (x.n_p as f64, 100.0 * value(x)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        pts
    };
    let logical = |stats: &str| -> Vec<(f64, f64)> {
        s.settings
            .iter()
            .filter(|x| x.budget == budget && x.stats == stats && x.unit == "logical")
            .map(|x| (x.n_p as f64, 100.0 * value(x)))
            .collect()
    };
    let mut span: Vec<f64> = s.settings.iter().map(|x| x.n_p as f64).collect();
    span.sort_by(f64::total_cmp);
    span.dedup();
    let series = vec![
        Series::new("flat (N_L = N_P), bf16", line("bf16", true), 0),
        Series::new("flat, 8-bit stats", line("q8", true), 0).dashed(),
        Series::new("hierarchical (N_L 16), bf16", line("bf16", false), 3),
        Series::new("hierarchical, 8-bit stats", line("q8", false), 3).dashed(),
        Series::new("logical 16 in N_P, bf16", logical("bf16"), 2),
    ];
    let lowest = series
        .iter()
        .flat_map(|x| x.points.iter().map(|p| p.1))
        .fold(f64::INFINITY, f64::min);
    Panel {
        title: format!("budget {budget} tokens"),
        log_x: true,
        x_desc: "physical page N_P (tokens)".into(),
        y_desc: y_desc.into(),
        log_y: false,
        y_min: lowest
            .is_finite()
            .then(|| ((lowest - 5.0) / 5.0).floor().max(0.0) * 5.0),
        x_span: span,
        series,
        hlines: Vec::new(),
        legend: SeriesLabelPosition::LowerLeft,
    }
}

/// Recall against the needle strength at `budget`, one line per layout (bf16 statistics;
/// logical-page selection left out: it selects what flat 16 does).
fn strength_panel(s: &Study, budget: usize) -> Panel {
    let series = s
        .layouts()
        .iter()
        .filter(|l| l.unit == "physical")
        .enumerate()
        .map(|(i, l)| {
            let mut pts: Vec<(f64, f64)> = s
                .strengths
                .iter()
                .filter(|r| r.layout == l.layout && r.stats == "bf16" && r.budget == budget)
                .map(|r| (r.strength, 100.0 * r.recall.0))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let series = Series::new(layout_label(&l.layout, l.n_l), pts, i);
            if l.n_l == l.n_p {
                series
            } else {
                series.dashed()
            }
        })
        .collect();
    Panel {
        title: format!("budget {budget} tokens"),
        log_x: false,
        x_desc: "needle strength (background standard deviations)".into(),
        y_desc: "needle recall (%)".into(),
        log_y: false,
        y_min: Some(0.0),
        x_span: strengths_of(s),
        series,
        hlines: Vec::new(),
        legend: SeriesLabelPosition::LowerRight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_labels() {
        assert_eq!(layout_label("flat32", 32), "flat 32");
        assert_eq!(layout_label("hier64", 16), "hierarchical 64/16");
        assert_eq!(layout_label("logical64", 16), "logical 16 in 64");
        assert_eq!(layout_label("other", 16), "other");
    }

    #[test]
    fn a_short_line_is_an_error_naming_it() {
        let text = format!("{PAIRED_HEAD}\n2048\trecall\ta\tb\t0.1\n");
        let err = rows(&text, "paired.tsv", PAIRED_HEAD).unwrap_err();
        assert_eq!(err, "paired.tsv line 2: 5 fields, not 6");
        assert!(rows("x\n", "paired.tsv", PAIRED_HEAD)
            .unwrap_err()
            .contains("header"));
    }
}
