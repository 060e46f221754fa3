//! The fidelity report: reads the folders that the SmolLM2 member's `fidelity` binary writes
//! (`integrations/candle-smollm2`, `fidelity --out DIR`: `nll.tsv`, the per-token negative
//! log-likelihoods, and `layers.tsv`, the per-layer attention mass and output error) and writes
//! `REPORT.md` with every setting's ΔNLL against dense (with the paired standard error over the
//! evaluated tokens), the comparisons the real-model issue asks for, and two PNG plots: ΔNLL and
//! captured mass against the token budget, and the mass and output error per layer.
//!
//! Several runs may be read together (one run per head pattern: each prefills once); their
//! settings are paired token by token with the `dense` setting of whichever run has one over the
//! same positions.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use plotters::prelude::SeriesLabelPosition;

use crate::plot::{self, Panel, Series};

/// What to read and where to write.
#[derive(Clone, Debug)]
pub struct Options {
    /// The `fidelity --out` folders, in the order their settings are listed.
    pub runs: Vec<PathBuf>,
    /// Where `REPORT.md` and the PNGs go (created).
    pub out: PathBuf,
    /// The budget whose settings the per-layer plot shows [default: the largest budget read].
    pub layer_budget: Option<usize>,
}

/// How a setting's dense heads attend (the part of its name before the budget).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Method {
    /// Every key (`dense`, and `stream-…`: streaming heads beside dense ones).
    Dense,
    /// Flat pages of `page` tokens (`flat`, `flat32`, `flat64`).
    Flat { page: usize },
    /// LServe's hierarchical pages: 64 physical, 16 logical (`lserve`).
    Hierarchical,
    /// 16-token logical pages selected inside 64-token physical pages (`logical`).
    Logical,
}

impl Method {
    /// The plots' and tables' label.
    pub fn label(self) -> String {
        match self {
            Method::Dense => "dense".into(),
            Method::Flat { page } => format!("flat {page}"),
            Method::Hierarchical => "LServe 64/16".into(),
            Method::Logical => "logical 16 in 64".into(),
        }
    }
}

/// A setting's name as `fidelity` writes it (`Setting::name` of the member), parsed:
/// `METHOD[-bBUDGET][-rREUSE][-sFRACTION[-HEADS]][-mean]`.
#[derive(Clone, Debug, PartialEq)]
pub struct SettingName {
    pub method: Method,
    pub budget: Option<usize>,
    pub reuse: Option<usize>,
    /// Fraction of KV heads streaming (0 for none).
    pub streaming: f64,
    /// Which heads stream: `""` (evenly spread), `calib`, `calibout`, `randSEED`.
    pub heads: String,
    /// Mean GQA aggregation instead of max.
    pub mean: bool,
}

impl SettingName {
    /// Parses `name`; `None` for a name `fidelity` does not write.
    pub fn parse(name: &str) -> Option<SettingName> {
        let mut parts = name.split('-').peekable();
        let method = match parts.next()? {
            "dense" | "stream" => Method::Dense,
            "flat" => Method::Flat { page: 16 },
            "flat32" => Method::Flat { page: 32 },
            "flat64" => Method::Flat { page: 64 },
            "lserve" => Method::Hierarchical,
            "logical" => Method::Logical,
            _ => return None,
        };
        let mut s = SettingName {
            method,
            budget: None,
            reuse: None,
            streaming: 0.0,
            heads: String::new(),
            mean: false,
        };
        while let Some(part) = parts.next() {
            if let Some(b) = part.strip_prefix('b') {
                s.budget = Some(b.parse().ok()?);
            } else if let Some(r) = part
                .strip_prefix('r')
                .filter(|r| r.parse::<usize>().is_ok())
            {
                s.reuse = Some(r.parse().ok()?);
            } else if let Some(f) = part.strip_prefix('s') {
                s.streaming = f.parse().ok()?;
                if let Some(&h) = parts.peek() {
                    if h != "mean" {
                        s.heads = h.to_string();
                        parts.next();
                    }
                }
            } else if part == "mean" && parts.peek().is_none() {
                s.mean = true;
            } else {
                return None;
            }
        }
        ((method == Method::Dense) == s.budget.is_none()).then_some(s)
    }

    /// The series a setting belongs to in the budget plot: everything but the budget.
    fn series_key(&self) -> (Method, Option<usize>, u64, String, bool) {
        (
            self.method,
            self.reuse,
            self.streaming.to_bits(),
            self.heads.clone(),
            self.mean,
        )
    }

    /// `LServe 64/16, reuse 4, 50% streaming (calib)`.
    pub fn series_label(&self) -> String {
        let mut s = self.method.label();
        if let Some(r) = self.reuse {
            let _ = write!(s, ", reuse {r}");
        }
        if self.streaming > 0.0 {
            let _ = write!(s, ", {}% streaming", (self.streaming * 100.0).round());
            if !self.heads.is_empty() {
                let _ = write!(s, " ({})", self.heads);
            }
        }
        if self.mean {
            s.push_str(", mean");
        }
        s
    }
}

/// One layer's row of `layers.tsv`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerRow {
    pub mass_dense: f64,
    pub mass_streaming: f64,
    pub rel_err: f64,
}

/// One setting of one run.
#[derive(Clone, Debug)]
pub struct Setting {
    pub name: String,
    pub parsed: SettingName,
    /// The run's folder name.
    pub run: String,
    /// (position, NLL) in the order of `nll.tsv`.
    pub nll: Vec<(usize, f64)>,
    /// Per layer, from `layers.tsv` (empty when the run has none for it).
    pub layers: Vec<LayerRow>,
}

impl Setting {
    pub fn mean_nll(&self) -> f64 {
        mean(self.nll.iter().map(|&(_, n)| n))
    }

    /// The mean of `f` over the layers where it is a number (a layer whose KV heads all
    /// stream has no dense-head mass, one without streaming heads no streaming-head mass); NaN
    /// when there is none.
    pub fn layer_mean(&self, f: impl Fn(&LayerRow) -> f64) -> f64 {
        mean(self.layers.iter().map(f).filter(|x| !x.is_nan()))
    }
}

/// A paired difference over tokens: mean and standard error of the mean.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Paired {
    pub mean: f64,
    pub se: f64,
    pub tokens: usize,
}

/// `a - b` token by token over the positions both have (`None` when they share fewer than 2).
pub fn paired(a: &Setting, b: &Setting) -> Option<Paired> {
    let b: BTreeMap<usize, f64> = b.nll.iter().copied().collect();
    let d: Vec<f64> = a
        .nll
        .iter()
        .filter_map(|&(p, n)| b.get(&p).map(|m| n - m))
        .collect();
    let n = d.len();
    if n < 2 {
        return None;
    }
    let m = mean(d.iter().copied());
    let var = d.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1) as f64;
    Some(Paired {
        mean: m,
        se: (var / n as f64).sqrt(),
        tokens: n,
    })
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        s / n as f64
    }
}

/// Reads one `fidelity --out` folder's settings.
pub fn read_run(dir: &Path) -> Result<Vec<Setting>, String> {
    let run = dir
        .file_name()
        .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into());
    let read = |name: &str| {
        fs::read_to_string(dir.join(name))
            .map_err(|e| format!("reading {}: {e}", dir.join(name).display()))
    };
    let mut settings: Vec<Setting> = Vec::new();
    let nll = read("nll.tsv")?;
    for (i, line) in nll.lines().enumerate().skip(1) {
        let bad = || format!("{}/nll.tsv line {}: {line:?}", dir.display(), i + 1);
        let f: Vec<&str> = line.split('\t').collect();
        let [name, pos, value] = f[..] else {
            return Err(bad());
        };
        let pos: usize = pos.parse().map_err(|_| bad())?;
        let value: f64 = value.parse().map_err(|_| bad())?;
        match settings.iter_mut().find(|s| s.name == name) {
            Some(s) => s.nll.push((pos, value)),
            None => settings.push(Setting {
                name: name.to_string(),
                parsed: SettingName::parse(name)
                    .ok_or_else(|| format!("{}: setting name {name:?}", dir.display()))?,
                run: run.clone(),
                nll: vec![(pos, value)],
                layers: Vec::new(),
            }),
        }
    }
    if let Ok(layers) = read("layers.tsv") {
        for (i, line) in layers.lines().enumerate().skip(1) {
            let bad = || format!("{}/layers.tsv line {}: {line:?}", dir.display(), i + 1);
            let f: Vec<&str> = line.split('\t').collect();
            let [name, layer, md, ms, err] = f[..] else {
                return Err(bad());
            };
            let num = |x: &str| x.parse::<f64>().map_err(|_| bad());
            let row = LayerRow {
                mass_dense: num(md)?,
                mass_streaming: num(ms)?,
                rel_err: num(err)?,
            };
            let layer: usize = layer.parse().map_err(|_| bad())?;
            let s = settings
                .iter_mut()
                .find(|s| s.name == name)
                .ok_or_else(bad)?;
            if layer != s.layers.len() {
                return Err(bad());
            }
            s.layers.push(row);
        }
    }
    if settings.is_empty() {
        return Err(format!("{}/nll.tsv has no rows", dir.display()));
    }
    Ok(settings)
}

/// What [`generate`] wrote.
#[derive(Debug)]
pub struct Written {
    pub markdown: PathBuf,
    pub pngs: Vec<PathBuf>,
    pub settings: usize,
}

/// The dense reference of `s`: a `dense` setting (no streaming heads) over the same positions.
fn dense_for<'a>(all: &'a [Setting], s: &Setting) -> Option<&'a Setting> {
    let positions = |x: &Setting| x.nll.iter().map(|&(p, _)| p).collect::<Vec<_>>();
    all.iter().find(|d| {
        d.parsed.method == Method::Dense
            && d.parsed.streaming == 0.0
            && positions(d) == positions(s)
    })
}

fn fmt4(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else {
        format!("{x:.4}")
    }
}

/// Reads `opts.runs` and writes `REPORT.md` and the PNGs into `opts.out`.
pub fn generate(opts: &Options) -> Result<Written, String> {
    let mut all = Vec::new();
    for dir in &opts.runs {
        all.extend(read_run(dir)?);
    }
    fs::create_dir_all(&opts.out).map_err(|e| format!("{}: {e}", opts.out.display()))?;
    let mut md = String::from("# Fidelity report\n\n");
    md.push_str(
        "Generated by `lserve-fidelity-report` (crate `report`) from the folders `fidelity --out` \
         wrote; every number below is computed from their `nll.tsv` and `layers.tsv`.\n\n",
    );
    for dir in &opts.runs {
        let name = dir
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into());
        let _ = writeln!(md, "Run `{name}`:\n");
        if let Ok(report) = fs::read_to_string(dir.join("report.md")) {
            for line in report.lines().take_while(|l| !l.starts_with('|')) {
                if !line.trim().is_empty() {
                    let _ = writeln!(md, "{line}");
                }
            }
        }
        md.push('\n');
    }
    settings_table(&mut md, &all);
    comparisons(&mut md, &all);

    let mut pngs = Vec::new();
    let budget_png = opts.out.join("fidelity_budget.png");
    plot::draw(
        &budget_png,
        "SmolLM2-135M: selection against the token budget",
        &budget_panels(&all),
    )?;
    pngs.push(budget_png);
    let layer_budget = opts
        .layer_budget
        .or_else(|| all.iter().filter_map(|s| s.parsed.budget).max());
    if let Some(b) = layer_budget {
        let layer_png = opts.out.join("fidelity_layers.png");
        plot::draw(
            &layer_png,
            &format!("SmolLM2-135M: per layer, budget {b}"),
            &layer_panels(&all, b),
        )?;
        pngs.push(layer_png);
    }
    md.push_str("\n## Plots\n\n");
    let markdown = plot::write_markdown(&opts.out, md, &pngs)?;
    Ok(Written {
        markdown,
        pngs,
        settings: all.len(),
    })
}

fn settings_table(md: &mut String, all: &[Setting]) {
    md.push_str(
        "## Settings\n\nΔNLL: the setting's NLL minus dense's, token by token over the evaluated \
         tokens, mean ± standard error of the mean. Mass: the dense softmax mass on the tokens \
         attended (mean over probed steps, then over the layers that have such heads; dense \
         heads and streaming heads apart). \
         Rel. error: the layer's attention output against dense attention on the same inputs.\n\n\
         | run | setting | mean NLL | ΔNLL vs dense | ΔNLL / dense NLL | mass (dense heads) | \
         mass (streaming heads) | rel. error |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for s in all {
        let (delta, rel) = match dense_for(all, s).and_then(|d| Some((d, paired(s, d)?))) {
            Some((d, p)) => (
                format!("{:+.4} ± {:.4}", p.mean, p.se),
                format!("{:+.2}%", 100.0 * p.mean / d.mean_nll()),
            ),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {:.4} | {delta} | {rel} | {} | {} | {} |",
            s.run,
            s.name,
            s.mean_nll(),
            fmt4(s.layer_mean(|r| r.mass_dense)),
            fmt4(s.layer_mean(|r| r.mass_streaming)),
            fmt4(s.layer_mean(|r| r.rel_err)),
        );
    }
}

/// Settings that differ from `s` only in the method.
fn sibling<'a>(all: &'a [Setting], s: &Setting, method: Method) -> Option<&'a Setting> {
    all.iter().find(|o| {
        o.parsed.method == method
            && o.parsed.budget == s.parsed.budget
            && o.parsed.streaming == s.parsed.streaming
            && o.parsed.heads == s.parsed.heads
            && o.parsed.mean == s.parsed.mean
            && o.nll.len() == s.nll.len()
    })
}

fn comparisons(md: &mut String, all: &[Setting]) {
    let mut rows = String::new();
    for h in all
        .iter()
        .filter(|s| s.parsed.method == Method::Hierarchical)
    {
        let at = format!(
            "budget {}, {}% streaming{}",
            h.parsed.budget.unwrap_or(0),
            (h.parsed.streaming * 100.0).round(),
            if h.parsed.heads.is_empty() {
                String::new()
            } else {
                format!(" ({})", h.parsed.heads)
            }
        );
        if let Some(f64_) = sibling(all, h, Method::Flat { page: 64 }) {
            if let Some(p) = paired(h, f64_) {
                let _ = writeln!(
                    rows,
                    "| {at} | {} − {} | {:+.4} ± {:.4} | {:+.4} |",
                    h.name,
                    f64_.name,
                    p.mean,
                    p.se,
                    h.layer_mean(|r| r.mass_dense) - f64_.layer_mean(|r| r.mass_dense),
                );
            }
        }
        let (Some(f16), Some(l)) = (
            sibling(all, h, Method::Flat { page: 16 }),
            all.iter().find(|o| {
                o.parsed.method == Method::Logical
                    && o.parsed.budget == h.parsed.budget
                    && o.parsed.reuse == h.parsed.reuse
                    && o.parsed.streaming == h.parsed.streaming
                    && o.parsed.heads == h.parsed.heads
                    && o.parsed.mean == h.parsed.mean
            }),
        ) else {
            continue;
        };
        let (Some(gap), Some(closed)) = (paired(h, f16), paired(h, l)) else {
            continue;
        };
        let _ = writeln!(
            rows,
            "| {at} | {} − {} | {:+.4} ± {:.4} | {:+.4} |",
            h.name,
            l.name,
            closed.mean,
            closed.se,
            h.layer_mean(|r| r.mass_dense) - l.layer_mean(|r| r.mass_dense),
        );
        let _ = writeln!(
            rows,
            "| {at} | {} − {} (the gap) | {:+.4} ± {:.4} | {:+.4} |",
            h.name,
            f16.name,
            gap.mean,
            gap.se,
            h.layer_mean(|r| r.mass_dense) - f16.layer_mean(|r| r.mass_dense),
        );
        if gap.mean > 0.0 {
            let _ = writeln!(
                rows,
                "| {at} | share of the gap that {} closes | {:.0}% | |",
                l.name,
                100.0 * closed.mean / gap.mean
            );
        }
    }
    if !rows.is_empty() {
        md.push_str(
            "\n## Comparisons at one budget\n\nPaired over the same tokens (mean ± standard \
             error); a positive ΔNLL means the first setting is worse. Δmass: the first's mass \
             (dense heads) minus the second's.\n\n| at | difference | ΔNLL | Δmass |\n\
             | --- | --- | ---: | ---: |\n",
        );
        md.push_str(&rows);
    }
}

fn budget_panels(all: &[Setting]) -> Vec<Panel> {
    let mut keys: Vec<(Method, Option<usize>, u64, String, bool)> = Vec::new();
    for s in all.iter().filter(|s| s.parsed.budget.is_some()) {
        if !keys.contains(&s.parsed.series_key()) {
            keys.push(s.parsed.series_key());
        }
    }
    keys.sort();
    let budgets: Vec<f64> = {
        let mut b: Vec<usize> = all.iter().filter_map(|s| s.parsed.budget).collect();
        b.sort_unstable();
        b.dedup();
        b.into_iter().map(|b| b as f64).collect()
    };
    let series = |value: &dyn Fn(&Setting) -> Option<f64>| -> Vec<Series> {
        let mut colors: Vec<Method> = Vec::new();
        keys.iter()
            .map(|key| {
                let mut members: Vec<&Setting> = all
                    .iter()
                    .filter(|s| &s.parsed.series_key() == key)
                    .collect();
                members.sort_by_key(|s| s.parsed.budget);
                let points = members
                    .iter()
                    .filter_map(|s| Some((s.parsed.budget? as f64, value(s)?)))
                    .filter(|p| p.1.is_finite())
                    .collect();
                if !colors.contains(&key.0) {
                    colors.push(key.0);
                }
                let color = colors.iter().position(|m| *m == key.0).unwrap_or(0);
                let s = Series::new(members[0].parsed.series_label(), points, color);
                if members[0].parsed.streaming > 0.0 {
                    s.dashed()
                } else {
                    s
                }
            })
            .collect()
    };
    let delta = |s: &Setting| paired(s, dense_for(all, s)?).map(|p| p.mean);
    let mass = |s: &Setting| Some(s.layer_mean(|r| r.mass_dense));
    vec![
        Panel {
            title: "ΔNLL against dense (nats per token)".into(),
            log_x: true,
            x_desc: "token budget".into(),
            y_desc: "ΔNLL".into(),
            log_y: false,
            y_min: None,
            x_span: budgets.clone(),
            series: series(&delta),
            hlines: Vec::new(),
            legend: SeriesLabelPosition::UpperRight,
        },
        Panel {
            title: "dense softmax mass captured (dense heads)".into(),
            log_x: true,
            x_desc: "token budget".into(),
            y_desc: "mass".into(),
            log_y: false,
            y_min: Some(0.5),
            x_span: budgets,
            series: series(&mass),
            hlines: Vec::new(),
            legend: SeriesLabelPosition::LowerRight,
        },
    ]
}

fn layer_panels(all: &[Setting], budget: usize) -> Vec<Panel> {
    let chosen: Vec<&Setting> = all
        .iter()
        .filter(|s| s.parsed.budget == Some(budget) && !s.layers.is_empty())
        .collect();
    let layers = chosen.iter().map(|s| s.layers.len()).max().unwrap_or(1);
    let mut colors: Vec<Method> = Vec::new();
    let mut color_of = |m: Method| {
        if !colors.contains(&m) {
            colors.push(m);
        }
        colors.iter().position(|c| *c == m).unwrap_or(0)
    };
    let mut mass = Vec::new();
    let mut err = Vec::new();
    for s in &chosen {
        let c = color_of(s.parsed.method);
        let pts = |f: fn(&LayerRow) -> f64| {
            s.layers
                .iter()
                .enumerate()
                .map(|(l, r)| (l as f64, f(r)))
                .filter(|p| p.1.is_finite())
                .collect::<Vec<_>>()
        };
        let mut a = Series::new(s.parsed.series_label(), pts(|r| r.mass_dense), c);
        let mut b = Series::new(s.parsed.series_label(), pts(|r| r.rel_err), c);
        if s.parsed.streaming > 0.0 {
            a = a.dashed();
            b = b.dashed();
        }
        mass.push(a);
        err.push(b);
    }
    let span: Vec<f64> = (0..layers).map(|l| l as f64).collect();
    vec![
        Panel {
            title: "dense softmax mass captured (dense heads)".into(),
            log_x: false,
            x_desc: "layer".into(),
            y_desc: "mass".into(),
            log_y: false,
            y_min: Some(0.4),
            x_span: span.clone(),
            series: mass,
            hlines: Vec::new(),
            legend: SeriesLabelPosition::LowerRight,
        },
        Panel {
            title: "attention output's relative error against dense".into(),
            log_x: false,
            x_desc: "layer".into(),
            y_desc: "relative error".into(),
            log_y: false,
            y_min: None,
            x_span: span,
            series: err,
            hlines: Vec::new(),
            legend: SeriesLabelPosition::UpperRight,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setting_names_parse() {
        let s = SettingName::parse("lserve-b1024-r4-s0.5-calib").unwrap();
        assert_eq!(s.method, Method::Hierarchical);
        assert_eq!((s.budget, s.reuse), (Some(1024), Some(4)));
        assert_eq!(
            (s.streaming, s.heads.as_str(), s.mean),
            (0.5, "calib", false)
        );
        let s = SettingName::parse("flat64-b512").unwrap();
        assert_eq!(s.method, Method::Flat { page: 64 });
        assert_eq!((s.budget, s.reuse, s.streaming), (Some(512), None, 0.0));
        let s = SettingName::parse("stream-s0.25-rand3").unwrap();
        assert_eq!((s.method, s.budget), (Method::Dense, None));
        assert_eq!(s.heads, "rand3");
        let s = SettingName::parse("logical-b512-r4-mean").unwrap();
        assert!(s.mean && s.heads.is_empty());
        let s = SettingName::parse("lserve-b512-r4-s0.5-mean").unwrap();
        assert!(s.mean && s.heads.is_empty() && s.streaming == 0.5);
        assert_eq!(SettingName::parse("dense").unwrap().method, Method::Dense);
        for bad in [
            "quest-b512",
            "flat",
            "dense-b512",
            "lserve-b512-x4",
            "lserve-bx",
        ] {
            assert_eq!(SettingName::parse(bad), None, "{bad}");
        }
    }

    fn setting(name: &str, nll: &[(usize, f64)]) -> Setting {
        Setting {
            name: name.into(),
            parsed: SettingName::parse(name).unwrap(),
            run: "r".into(),
            nll: nll.to_vec(),
            layers: Vec::new(),
        }
    }

    #[test]
    fn paired_difference_over_common_positions() {
        let a = setting("flat-b512", &[(10, 2.0), (11, 3.0), (12, 5.0), (13, 1.0)]);
        let b = setting("dense", &[(11, 2.0), (12, 3.0), (13, 2.0)]);
        // Differences over 11..=13: 1, 2, -1; mean 2/3, sample variance 7/3.
        let p = paired(&a, &b).unwrap();
        assert_eq!(p.tokens, 3);
        assert!((p.mean - 2.0 / 3.0).abs() < 1e-12);
        assert!((p.se - (7.0f64 / 3.0 / 3.0).sqrt()).abs() < 1e-12);
        let c = setting("dense", &[(11, 1.0)]);
        assert_eq!(paired(&a, &c), None);
    }
}
