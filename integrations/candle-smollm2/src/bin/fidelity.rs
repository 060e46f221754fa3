//! The fidelity run: teacher-forced negative log-likelihood of the last tokens of a text under
//! each attention configuration, with per-layer attention mass and output error against dense.
//!
//! ```text
//! cargo run --release --bin fidelity -- [--gguf PATH] [--text PATH] [--context N] [--eval N]
//!     [--settings LIST] [--probe-every K] [--out DIR]
//! ```
//!
//! The prompt is the `N` tokens before the evaluated ones; it is prefilled once per streaming
//! fraction (prefill does not select pages). Then each evaluated position is one decode step of
//! that configuration, fed the true token; its logits score the next true token.
//!
//! `--settings` is a comma-separated list of `dense`, `stream:F`, `flat:B[:F]`,
//! `lserve:B:C[:F]` (`B` token budget, `C` reuse interval, `F` streaming fraction).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use lserve::reference::decode::HeadVisit;
use lserve_candle_smollm2::engine::{
    cache_for, decode_token, geometry, nll, prefill, Selection, Setting, Timing,
};
use lserve_candle_smollm2::model::Llama;
use lserve_candle_smollm2::{default_gguf_path, tokenizer};

struct Args {
    gguf: PathBuf,
    text: PathBuf,
    context: usize,
    eval: usize,
    settings: Vec<Setting>,
    probe_every: usize,
    out: Option<PathBuf>,
}

fn parse_setting(s: &str) -> Result<Setting> {
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
    Ok(match parts[0] {
        "dense" => Setting {
            streaming: 0.0,
            selection: Selection::Dense,
        },
        "stream" => Setting {
            streaming: frac(1)?,
            selection: Selection::Dense,
        },
        "flat" => Setting {
            streaming: frac(2)?,
            selection: Selection::Flat { budget: num(1)? },
        },
        "lserve" => Setting {
            streaming: frac(3)?,
            selection: Selection::Hierarchical {
                budget: num(1)?,
                reuse: num(2)?,
            },
        },
        other => bail!("unknown setting kind {other:?} (dense, stream, flat, lserve)"),
    })
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        gguf: default_gguf_path().context("no HOME: give --gguf")?,
        text: PathBuf::from("/usr/share/common-licenses/GPL-3"),
        context: 4096,
        eval: 256,
        settings: Vec::new(),
        probe_every: 4,
        out: None,
    };
    let mut settings = "dense".to_string();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--gguf" => args.gguf = value()?.into(),
            "--text" => args.text = value()?.into(),
            "--context" => args.context = value()?.parse().context("--context")?,
            "--eval" => args.eval = value()?.parse().context("--eval")?,
            "--settings" => settings = value()?,
            "--probe-every" => args.probe_every = value()?.parse().context("--probe-every")?,
            "--out" => args.out = Some(value()?.into()),
            "--help" | "-h" => {
                println!("see the module documentation of src/bin/fidelity.rs");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    args.settings = settings
        .split(',')
        .map(parse_setting)
        .collect::<Result<_>>()?;
    if args.probe_every == 0 {
        bail!("--probe-every must be >= 1");
    }
    Ok(args)
}

/// What one setting measured.
struct Outcome {
    setting: Setting,
    nll: Vec<f64>,
    /// Per layer: mass and tokens of the dense heads, mass of the streaming heads, rel. error.
    layer_mass_dense: Vec<Vec<f64>>,
    layer_mass_stream: Vec<Vec<f64>>,
    layer_rel_err: Vec<Vec<f64>>,
    tokens_attended: Vec<f64>,
    selected_steps: usize,
    timing: Timing,
    seconds: f64,
}

fn mean(x: &[f64]) -> f64 {
    if x.is_empty() {
        f64::NAN
    } else {
        x.iter().sum::<f64>() / x.len() as f64
    }
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let t0 = Instant::now();
    let (model, content) =
        Llama::load(&args.gguf).context("loading the model (run scripts/fetch_smollm2.sh?)")?;
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
    if ids.len() < args.eval + 2 {
        bail!("the text has {} tokens, fewer than --eval + 2", ids.len());
    }
    let context = args.context.min(ids.len() - args.eval - 1);
    // The prompt: the `context` tokens before the evaluated ones, which are the text's last.
    let first = ids.len() - args.eval - 1 - context;
    let prompt = &ids[first..first + context];
    let fed = &ids[first + context..first + context + args.eval];
    let targets = &ids[first + context + 1..first + context + args.eval + 1];
    eprintln!(
        "prompt: tokens {first}..{} ({context}), evaluated: the next {} tokens",
        first + context,
        args.eval
    );

    // One prefill per streaming fraction.
    let mut by_fraction: BTreeMap<u64, Vec<Setting>> = BTreeMap::new();
    for s in &args.settings {
        by_fraction
            .entry(s.streaming.to_bits())
            .or_default()
            .push(*s);
    }
    let g = geometry(&model)?;
    let mut outcomes = Vec::new();
    let mut prefill_lines = Vec::new();
    for settings in by_fraction.values() {
        let s0 = settings[0];
        let start = Instant::now();
        let pre = prefill(&model, &s0.pattern(g)?, &s0.config(), prompt)?;
        let secs = start.elapsed().as_secs_f64();
        let line = format!(
            "prefill {context} tokens, streaming {}: {secs:.1}s (candle {:.1}s, lserve {:.1}s)",
            s0.streaming,
            pre.timing.candle.as_secs_f64(),
            pre.timing.lserve.as_secs_f64()
        );
        eprintln!("{line}");
        prefill_lines.push(line);
        for setting in settings {
            let start = Instant::now();
            let mut attn = cache_for(&model, setting, &pre, args.eval, true)?;
            let mut o = Outcome {
                setting: *setting,
                nll: Vec::new(),
                layer_mass_dense: vec![Vec::new(); c.layers],
                layer_mass_stream: vec![Vec::new(); c.layers],
                layer_rel_err: vec![Vec::new(); c.layers],
                tokens_attended: Vec::new(),
                selected_steps: 0,
                timing: Timing::default(),
                seconds: 0.0,
            };
            let pattern = setting.pattern(g)?;
            for (i, (&token, &target)) in fed.iter().zip(targets).enumerate() {
                let step = decode_token(&model, &mut attn, token, context + i, &mut o.timing)?;
                o.nll.push(nll(&step.logits, target)?);
                if step.visits.iter().flatten().any(|v| {
                    matches!(
                        v,
                        HeadVisit::Selected {
                            selected_now: true,
                            ..
                        }
                    )
                }) {
                    o.selected_steps += 1;
                }
                if i % args.probe_every == 0 {
                    let mut attended = 0usize;
                    for (layer, p) in step.probes.iter().enumerate() {
                        for (h, (&m, &n)) in p.mass.iter().zip(&p.tokens).enumerate() {
                            attended += n;
                            match pattern.kind(layer, h) {
                                lserve::head_pattern::HeadKind::Dense => {
                                    o.layer_mass_dense[layer].push(m)
                                }
                                lserve::head_pattern::HeadKind::Streaming => {
                                    o.layer_mass_stream[layer].push(m)
                                }
                            }
                        }
                        o.layer_rel_err[layer].push(p.rel_err);
                    }
                    o.tokens_attended
                        .push(attended as f64 / (c.layers * c.kv_heads) as f64);
                }
            }
            o.seconds = start.elapsed().as_secs_f64();
            eprintln!(
                "{:<24} mean NLL {:.4} over {} tokens; {:.1}s (candle {:.1}s, lserve {:.1}s)",
                setting.name(),
                mean(&o.nll),
                o.nll.len(),
                o.seconds,
                o.timing.candle.as_secs_f64(),
                o.timing.lserve.as_secs_f64()
            );
            outcomes.push(o);
        }
    }

    let report = render(&args, context, ids.len(), &prefill_lines, &outcomes);
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
        .map(|o| mean(&o.nll));
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
        let m = mean(&o.nll);
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
