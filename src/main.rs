//! The main job: one LServe decode step for a long sequence (Llama-3-8B geometry by default).
//!
//! It builds one layer's paged KV cache for a `--context`-token sequence (random keys and values,
//! statistics pooled), runs a decode step (append the token, select pages, attend) on the GPU when
//! one is usable and on the CPU reference otherwise, and reports what LServe visits against dense
//! attention, per stage, for the whole model: prefill KV blocks, decode pages/tokens and bytes,
//! and the theoretical speedup `1 / (1 - r)` where `r` is the fraction skipped.

mod accounting;
mod run;

use std::process::ExitCode;

use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadPattern, PublishedGating};

const USAGE: &str = "\
lserve-demo: one LServe decode step for a long sequence (Llama-3-8B geometry)

USAGE: cargo run --release -- [OPTIONS]

OPTIONS:
  --context N      tokens in the sequence before the step (default 131072)
  --pattern P      a published DuoAttention pattern by model name (Llama-3-8B-Instruct-Gradient-1048k,
                   Llama-2-7B-32K-Instruct: that model's geometry) or a full_attention_heads.tsv
                   file for Llama-3-8B geometry (default: built-in interleaved pattern)
  --fraction S     streaming-head fraction (default 0.5)
  --budget T       decode token budget (default 4096)
  --layer L        which layer's decode step to run (default 0)
  --cpu            run on the CPU reference even if a GPU is present
  -h, --help       this text";

/// The command line.
struct Options {
    context: usize,
    pattern: Option<String>,
    fraction: f64,
    budget: usize,
    layer: usize,
    cpu: bool,
}

fn parse_args() -> Result<Option<Options>, String> {
    let mut o = Options {
        context: 131_072,
        pattern: None,
        fraction: 0.5,
        budget: 4096,
        layer: 0,
        cpu: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "-h" | "--help" => return Ok(None),
            "--context" => o.context = parse(&value("--context")?)?,
            "--pattern" => o.pattern = Some(value("--pattern")?),
            "--fraction" => o.fraction = parse(&value("--fraction")?)?,
            "--budget" => o.budget = parse(&value("--budget")?)?,
            "--layer" => o.layer = parse(&value("--layer")?)?,
            "--cpu" => o.cpu = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Some(o))
}

fn parse<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    s.parse().map_err(|_| format!("not a valid value: {s:?}"))
}

fn main() -> ExitCode {
    let options = match parse_args() {
        Ok(Some(o)) => o,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run_main(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_main(o: &Options) -> lserve::Result<()> {
    let (pattern, source) = match &o.pattern {
        Some(name) if PublishedGating::find(name).is_ok() => (
            HeadPattern::published(name, o.fraction)?,
            format!("DuoAttention's {name} at streaming fraction {}", o.fraction),
        ),
        Some(path) => (
            HeadPattern::from_gating_file(path, ModelGeometry::llama3_8b(), o.fraction)?,
            format!("{path} at streaming fraction {}", o.fraction),
        ),
        None => (
            HeadPattern::interleaved(ModelGeometry::llama3_8b(), o.fraction)?,
            format!(
                "built-in interleaved pattern at streaming fraction {}",
                o.fraction
            ),
        ),
    };
    let config = SparsityConfig {
        token_budget: o.budget,
        dynamic_min_len: 2 * o.budget,
        ..SparsityConfig::default()
    };
    config.validate()?;
    let geometry = *pattern.geometry();
    if o.layer >= geometry.layers() {
        return Err(lserve::LserveError::InvalidArgument {
            what: "--layer",
            reason: format!("{} is not below {} layers", o.layer, geometry.layers()),
        });
    }

    println!(
        "LServe decode step, geometry Hq {} Hkv {} D {}, {} layers, bf16",
        geometry.q_heads(),
        geometry.kv_heads(),
        geometry.head_dim(),
        geometry.layers()
    );
    println!(
        "head pattern: {source}: {} of {} KV heads streaming",
        pattern.total_streaming_heads(),
        geometry.total_kv_heads()
    );
    println!(
        "config: sink {} local {} budget {} N_P {} N_L {} reuse {} dynamic_min_len {}",
        config.sink_tokens,
        config.local_tokens,
        config.token_budget,
        config.page_tokens,
        config.logical_page_tokens,
        config.reuse_interval,
        config.dynamic_min_len
    );
    println!("context: {} tokens before the step\n", o.context);

    let step = run::decode_step(&pattern, &config, o.layer, o.context, o.cpu)?;
    println!("{}", step.device);
    println!("{}\n", step.summary);

    accounting::report(&pattern, &config, o.context);
    Ok(())
}
