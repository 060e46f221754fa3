//! The fidelity run: teacher-forced negative log-likelihood of the last tokens of a text under
//! each attention configuration, with per-layer attention mass and output error against dense.
//!
//! ```text
//! cargo run --release --bin fidelity -- [--gguf PATH] [--text PATH] [--context N] [--eval N]
//!     [--settings LIST] [--probe-every K] [--out DIR]
//!     [--calib-text PATH] [--calib-tokens N] [--calib-stride K]
//! ```
//!
//! The prompt is the `N` tokens before the evaluated ones; it is prefilled once per streaming
//! fraction (prefill does not select pages). Then each evaluated position is one decode step of
//! that configuration, fed the true token; its logits score the next true token.
//!
//! `--settings` is a comma-separated list of `dense`, `stream:F`, `flat:B[:F]` (16-token pages;
//! `flat32:`, `flat64:` for 32- and 64-token pages), `lserve:B:C[:F]` (hierarchical 64/16),
//! `logical:B:C[:F]` (16-token logical pages selected inside 64-token physical pages) (`B`
//! token budget, `C` reuse interval, `F` streaming fraction), each optionally followed by `+mean`
//! (mean GQA aggregation of the group's page scores instead of max), then
//! optionally followed by `@HEADS`, which heads stream: `@even` (the default,
//! `HeadPattern::interleaved`), `@calib` (`HeadPattern::from_calibration` on the calibration
//! text: the least attention mass outside the sinks + local window), `@calib-out` (the same
//! calibration, ranked by the Λ mask's relative output error, `CalibrationScore::OutputError`)
//! or `@random:SEED` (a seeded uniformly random choice of as many heads).
//!
//! Calibration (only when a setting asks for `@calib`): the first `--calib-tokens` tokens
//! (default 2048) of `--calib-text` (no default: it should be another text than `--text`) run
//! through the model with dense attention; every `--calib-stride`-th position (default 8) past
//! the sinks + local window scores each KV head by its attention mass outside the window.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use lserve::config::GqaAggregation;
use lserve::head_pattern::Calibration;
use lserve_candle_smollm2::engine::{calibrate, geometry, prefill, Heads, Selection, Setting};
use lserve_candle_smollm2::eval::{by_pattern, evaluate, mean, Outcome, Window};
use lserve_candle_smollm2::model::Llama;
use lserve_candle_smollm2::{default_gguf_path, tokenizer, DEFAULT_TEXT};

/// Teacher-forced NLL of a text's last tokens under each attention setting (module docs).
#[derive(Parser)]
struct Args {
    /// The GGUF [default: where scripts/fetch_smollm2.sh puts it].
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// The text whose last `--eval` tokens are scored.
    #[arg(long, default_value = DEFAULT_TEXT)]
    text: PathBuf,
    /// Prompt tokens before the evaluated ones (at most what the text has before them).
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Evaluated tokens: the text's last ones, each one decode step.
    #[arg(long, default_value_t = 256)]
    eval: usize,
    /// Comma-separated settings (module docs: dense, stream:F, flat:B[:F], flat32:, flat64:,
    /// lserve:B:C[:F], logical:B:C[:F], each optionally +mean and @HEADS).
    #[arg(long, value_delimiter = ',', value_parser = parse_setting, default_value = "dense")]
    settings: Vec<Setting>,
    /// Probe every K-th decode step against dense attention.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    probe_every: u64,
    /// Where report.md and the TSVs go (nothing written without it).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The calibration text (for @calib and @calib-out settings; another text than --text).
    #[arg(long)]
    calib_text: Option<PathBuf>,
    /// The calibration text's first tokens used.
    #[arg(long, default_value_t = 2048)]
    calib_tokens: usize,
    /// Every K-th position past the sinks and local window is scored.
    #[arg(long, default_value_t = 8)]
    calib_stride: usize,
}

fn parse_setting(full: &str) -> Result<Setting> {
    let (s, heads) = match full.split_once('@') {
        None => (full, Heads::Interleaved),
        Some((s, "even")) => (s, Heads::Interleaved),
        Some((s, "calib")) => (s, Heads::Calibrated),
        Some((s, "calib-out")) => (s, Heads::CalibratedOutput),
        Some((s, h)) => match h.strip_prefix("random:") {
            Some(seed) => (
                s,
                Heads::Random {
                    seed: seed
                        .parse()
                        .with_context(|| format!("setting {full}: seed {seed:?}"))?,
                },
            ),
            None => bail!("setting {full}: heads {h:?} (even, calib, calib-out, random:SEED)"),
        },
    };
    let (s, aggregation) = match s.strip_suffix("+mean") {
        Some(s) => (s, GqaAggregation::Mean),
        None => (s, GqaAggregation::Max),
    };
    let parts: Vec<&str> = s.split(':').collect();
    let num = |i: usize| -> Result<usize> {
        parts
            .get(i)
            .with_context(|| format!("setting {s}: missing field {i}"))?
            .parse()
            .with_context(|| format!("setting {s}: field {i} is not a number"))
    };
    let frac = |i: usize| -> Result<f64> {
        match parts.get(i) {
            None => Ok(0.0),
            Some(f) => f
                .parse()
                .with_context(|| format!("setting {s}: {f} is not a fraction")),
        }
    };
    let (streaming, selection) = match parts[0] {
        "dense" => (0.0, Selection::Dense),
        "stream" => (frac(1)?, Selection::Dense),
        "flat" | "flat16" => (
            frac(2)?,
            Selection::Flat {
                budget: num(1)?,
                page: 16,
            },
        ),
        "flat32" | "flat64" => (
            frac(2)?,
            Selection::Flat {
                budget: num(1)?,
                page: parts[0][4..].parse()?,
            },
        ),
        "lserve" => (
            frac(3)?,
            Selection::Hierarchical {
                budget: num(1)?,
                reuse: num(2)?,
            },
        ),
        "logical" => (
            frac(3)?,
            Selection::Logical {
                budget: num(1)?,
                reuse: num(2)?,
            },
        ),
        other => bail!(
            "unknown setting kind {other:?} (dense, stream, flat, flat32, flat64, lserve, logical)"
        ),
    };
    Ok(Setting {
        streaming,
        heads,
        selection,
        aggregation,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let probe_every = args.probe_every as usize;
    let t0 = Instant::now();
    let gguf = match &args.gguf {
        Some(p) => p.clone(),
        None => default_gguf_path().context("no HOME: give --gguf")?,
    };
    let (model, content) =
        Llama::load(&gguf).context("loading the model (run scripts/fetch_smollm2.sh?)")?;
    let tok = tokenizer::from_gguf(&content)?;
    let text = std::fs::read_to_string(&args.text)
        .with_context(|| format!("reading {}", args.text.display()))?;
    let ids = tokenizer::encode(&tok, &text)?;
    let c = *model.config();
    eprintln!(
        "model: {} layers, {} q heads, {} kv heads, D {}, rope base {}, context {}; loaded in {:.1}s",
        c.layers,
        c.q_heads,
        c.kv_heads,
        c.head_dim,
        c.rope_base,
        c.context,
        t0.elapsed().as_secs_f64()
    );
    eprintln!("text: {} ({} tokens)", args.text.display(), ids.len());
    // The prompt: the `context` tokens before the evaluated ones, which are the text's last.
    let window = Window::last(&ids, args.context, args.eval)?;
    let (first, context) = (window.first, window.prompt.len());
    eprintln!(
        "prompt: tokens {first}..{} ({context}), evaluated: the next {} tokens",
        first + context,
        args.eval
    );

    let g = geometry(&model)?;
    let mut prefill_lines = Vec::new();
    let calibration = if args
        .settings
        .iter()
        .any(|s| matches!(s.heads, Heads::Calibrated | Heads::CalibratedOutput))
    {
        let (cal, line) = run_calibration(&args, &model, &tok)?;
        prefill_lines.push(line);
        Some(cal)
    } else {
        None
    };

    // One prefill per head pattern (settings with the same streaming heads share it), in the
    // order of their first setting.
    let groups = by_pattern(&args.settings, g, calibration.as_ref())?;
    let mut outcomes = Vec::new();
    for (pattern, settings) in &groups {
        let s0 = settings[0];
        let start = Instant::now();
        let pre = prefill(&model, pattern, &s0.config(), window.prompt)?;
        let secs = start.elapsed().as_secs_f64();
        let line = format!(
            "prefill {context} tokens, streaming {} ({}): {secs:.1}s (candle {:.1}s, lserve {:.1}s)",
            pattern.streaming_fraction(),
            settings
                .iter()
                .map(Setting::name)
                .collect::<Vec<_>>()
                .join(", "),
            pre.timing.candle.as_secs_f64(),
            pre.timing.lserve.as_secs_f64()
        );
        eprintln!("{line}");
        prefill_lines.push(line);
        for setting in settings {
            let o = evaluate(&model, setting, pattern, &pre, &window, probe_every)?;
            eprintln!(
                "{:<24} mean NLL {:.4} over {} tokens; {:.1}s (candle {:.1}s, lserve {:.1}s)",
                setting.name(),
                o.mean_nll(),
                o.nll.len(),
                o.seconds,
                o.timing.candle.as_secs_f64(),
                o.timing.lserve.as_secs_f64()
            );
            outcomes.push(o);
        }
    }

    let mut report = render(&args, context, ids.len(), &prefill_lines, &outcomes);
    report.push_str(&random_summary(&outcomes));
    println!("{report}");
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("report.md"), &report)?;
        let mut tsv = String::from("setting\tposition\tnll\n");
        for o in &outcomes {
            for (i, n) in o.nll.iter().enumerate() {
                writeln!(tsv, "{}\t{}\t{n:.6}", o.setting.name(), context + i + 1)?;
            }
        }
        std::fs::write(dir.join("nll.tsv"), tsv)?;
        let mut tsv =
            String::from("setting\tlayer\tmass_dense_heads\tmass_streaming_heads\trel_err\n");
        for o in &outcomes {
            for l in 0..c.layers {
                writeln!(
                    tsv,
                    "{}\t{l}\t{:.6}\t{:.6}\t{:.6}",
                    o.setting.name(),
                    mean(&o.layer_mass_dense[l]),
                    mean(&o.layer_mass_stream[l]),
                    mean(&o.layer_rel_err[l])
                )?;
            }
        }
        std::fs::write(dir.join("layers.tsv"), tsv)?;
        if let Some(cal) = &calibration {
            let mut tsv = String::from("layer\tkv_head\tout_of_window_mass\toutput_error\n");
            for (l, (row, err)) in cal.scores()?.iter().zip(cal.output_errors()?).enumerate() {
                for (h, (m, e)) in row.iter().zip(err).enumerate() {
                    writeln!(tsv, "{l}\t{h}\t{m:.6}\t{e:.6}")?;
                }
            }
            std::fs::write(dir.join("calibration.tsv"), tsv)?;
        }
        let mut tsv = String::from("pattern\tlayer\tstreaming_kv_heads\n");
        for (pattern, settings) in &groups {
            for l in 0..pattern.layers() {
                let heads: Vec<String> = pattern
                    .streaming_kv_heads(l)
                    .iter()
                    .map(ToString::to_string)
                    .collect();
                writeln!(tsv, "{}\t{l}\t{}", settings[0].name(), heads.join(","))?;
            }
        }
        std::fs::write(dir.join("patterns.tsv"), tsv)?;
    }
    Ok(())
}

fn render(
    args: &Args,
    context: usize,
    text_tokens: usize,
    prefill_lines: &[String],
    outcomes: &[Outcome],
) -> String {
    let mut s = String::new();
    let dense = outcomes
        .iter()
        .find(|o| o.setting.selection == Selection::Dense && o.setting.streaming == 0.0)
        .map(|o| o.mean_nll());
    let _ = writeln!(
        s,
        "text `{}` ({text_tokens} tokens), prompt {context} tokens, {} evaluated tokens, probes every {} steps\n",
        args.text.display(),
        args.eval,
        args.probe_every
    );
    for l in prefill_lines {
        let _ = writeln!(s, "- {l}");
    }
    let _ = writeln!(
        s,
        "\n| setting | mean NLL | PPL | ΔNLL vs dense | tokens attended / KV head | mass (dense heads) | mass (streaming heads) | rel. error vs dense | steps that selected | decode s (candle / lserve) |"
    );
    let _ = writeln!(
        s,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for o in outcomes {
        let m = o.mean_nll();
        let all = |x: &[Vec<f64>]| mean(&x.iter().flatten().copied().collect::<Vec<_>>());
        let fmt = |x: f64| {
            if x.is_nan() {
                "-".to_string()
            } else {
                format!("{x:.4}")
            }
        };
        let _ = writeln!(
            s,
            "| {} | {m:.4} | {:.3} | {} | {:.0} | {} | {} | {} | {} / {} | {:.0} ({:.0} / {:.0}) |",
            o.setting.name(),
            m.exp(),
            dense.map_or("-".into(), |d| format!("{:+.4}", m - d)),
            mean(&o.tokens_attended),
            fmt(all(&o.layer_mass_dense)),
            fmt(all(&o.layer_mass_stream)),
            fmt(all(&o.layer_rel_err)),
            o.selected_steps,
            o.nll.len(),
            o.seconds,
            o.timing.candle.as_secs_f64(),
            o.timing.lserve.as_secs_f64()
        );
    }
    s
}

/// Runs the calibration text through the model (dense) into a [`Calibration`]; returns it and
/// a report line (tokens, stride, time, the scores' spread).
fn run_calibration(
    args: &Args,
    model: &Llama,
    tok: &tokenizers::Tokenizer,
) -> Result<(Calibration, String)> {
    let path = args
        .calib_text
        .as_ref()
        .context("@calib settings need --calib-text (another text than --text)")?;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let ids = tokenizer::encode(tok, &text)?;
    let n = args.calib_tokens.min(ids.len());
    let config = lserve::config::SparsityConfig::default();
    let start = Instant::now();
    let (cal, _, scoring) = calibrate(model, &config, &ids[..n], args.calib_stride)?;
    let secs = start.elapsed().as_secs_f64();
    let scores: Vec<f64> = cal.scores()?.into_iter().flatten().collect();
    let (lo, hi) = scores
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    let errors: Vec<f64> = cal.output_errors()?.into_iter().flatten().collect();
    let (elo, ehi) = errors
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    let line = format!(
        "calibration: `{}`, its first {n} of {} tokens, dense prefill, every {}th position from \
         {} on ({} positions); {secs:.1}s ({scoring:.1}s scoring); out-of-window mass per KV \
         head {lo:.4}..{hi:.4}, mean {:.4}; Λ output error per KV head {elo:.4}..{ehi:.4}, \
         mean {:.4}",
        path.display(),
        ids.len(),
        args.calib_stride,
        config.sink_tokens + config.local_tokens,
        cal.positions()[0],
        mean(&scores),
        mean(&errors)
    );
    eprintln!("{line}");
    Ok((cal, line))
}

/// For each (selection, fraction) with random-head settings: the median of their mean NLLs,
/// beside the calibrated and evenly spread settings of the same selection and fraction.
fn random_summary(outcomes: &[Outcome]) -> String {
    let mut s = String::new();
    let mut keys: Vec<(Selection, u64)> = Vec::new();
    for o in outcomes {
        let key = (o.setting.selection, o.setting.streaming.to_bits());
        if matches!(o.setting.heads, Heads::Random { .. }) && !keys.contains(&key) {
            keys.push(key);
        }
    }
    for (selection, bits) in keys {
        let same: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| o.setting.selection == selection && o.setting.streaming.to_bits() == bits)
            .collect();
        let mut random: Vec<f64> = same
            .iter()
            .filter(|o| matches!(o.setting.heads, Heads::Random { .. }))
            .map(|o| o.mean_nll())
            .collect();
        random.sort_by(f64::total_cmp);
        let n = random.len();
        let median = if n % 2 == 1 {
            random[n / 2]
        } else {
            (random[n / 2 - 1] + random[n / 2]) / 2.0
        };
        let _ = writeln!(
            s,
            "\nStreaming fraction {}, {selection:?}: median mean NLL of {n} random patterns {median:.4} \
             (min {:.4}, max {:.4})",
            f64::from_bits(bits),
            random[0],
            random[n - 1]
        );
        for o in same
            .iter()
            .filter(|o| !matches!(o.setting.heads, Heads::Random { .. }))
        {
            let m = o.mean_nll();
            let _ = writeln!(
                s,
                "- {}: {m:.4} ({:+.4} vs the random median; {})",
                o.setting.name(),
                m - median,
                if m < median {
                    "below it"
                } else {
                    "not below it"
                }
            );
        }
    }
    s
}
