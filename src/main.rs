//! The main job: LServe's sparse attention through the engine's view
//! (`lserve::session::SparseAttention`) on a synthetic model of Llama-3-8B geometry (32 layers,
//! Hq 32, Hkv 8, D 128, bf16; no weights: random Q/K/V with a few outlier channels in the keys,
//! keys and queries rotated by RoPE at their positions).
//!
//! On a GPU it prefills `--batch` prompts of `--context` tokens through all 32 layers (time to
//! first token), decodes `--steps` steps over all layers (per-token attention latency), does the
//! same with an all-dense pattern at the same cache sizes (`--dense`), reports the KV memory
//! used, and checks sampled outputs against the CPU reference on the device's selection. Without
//! a GPU it says so and runs a small CPU-reference version (short context, two layers).
//! Then it prints what LServe visits against dense attention for the whole model.

mod accounting;
mod cpu;
mod run;
mod synth;

use std::process::ExitCode;

use clap::{ArgAction, Parser};
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadPattern, PublishedGating};

/// LServe sparse attention (streaming heads + query-aware page selection) through the
/// session API on a synthetic Llama-3-8B-geometry model: prefill, then decode.
#[derive(Parser, Debug, Clone)]
#[command(name = "lserve-demo", version, about, long_about = None)]
pub struct Options {
    /// Tokens in each prompt (prefilled through all layers before decoding).
    #[arg(long, default_value_t = 131_072)]
    pub context: usize,
    /// Decode steps timed after the prefill (each: one token per sequence through all layers).
    #[arg(long, default_value_t = 64)]
    pub steps: usize,
    /// Sequences decoded together (each with its own prompt of --context tokens).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Head pattern: a published DuoAttention pattern by model name
    /// (Llama-3-8B-Instruct-Gradient-1048k, Llama-2-7B-32K-Instruct: that model's geometry) or a
    /// full_attention_heads.tsv file for Llama-3-8B geometry; default: a built-in interleaved
    /// pattern.
    #[arg(long, value_name = "NAME|FILE")]
    pub pattern: Option<String>,
    /// Streaming-head fraction of the pattern.
    #[arg(long, default_value_t = 0.5)]
    pub fraction: f64,
    /// Decode token budget of the dense heads' page selection.
    #[arg(long, default_value_t = 4096)]
    pub budget: usize,
    /// Also measure dense attention: an all-dense pattern without page selection, same cache
    /// sizes (`--dense false` skips it).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub dense: bool,
    /// Prefill chunk in tokens (default: the whole prompt): the prompt is prefilled in chunks of
    /// this many tokens, each attending to the cached prefix and to itself.
    #[arg(long)]
    pub chunk: Option<usize>,
    /// Replay the decode steps from CUDA graphs captured on the first step (default: eager
    /// launches).
    #[arg(long)]
    pub graph: bool,
    /// Run the small CPU-reference version even if a GPU is present.
    #[arg(long)]
    pub cpu: bool,
}

fn main() -> ExitCode {
    let options = Options::parse();
    if options.chunk == Some(0) {
        eprintln!("error: --chunk 0: a prefill chunk holds at least one token");
        return ExitCode::from(2);
    }
    match run_main(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The head pattern the options name, and a line describing it.
pub fn pattern(o: &Options) -> lserve::Result<(HeadPattern, String)> {
    Ok(match &o.pattern {
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
    })
}

fn run_main(o: &Options) -> lserve::Result<()> {
    let (pattern, source) = pattern(o)?;
    let config = SparsityConfig {
        token_budget: o.budget,
        dynamic_min_len: 2 * o.budget,
        ..SparsityConfig::default()
    };
    config.validate()?;
    if o.batch == 0 || o.steps == 0 || o.context == 0 {
        return Err(lserve::LserveError::InvalidArgument {
            what: "options",
            reason: "--context, --steps and --batch must be at least 1".into(),
        });
    }
    let geometry = *pattern.geometry();
    println!(
        "synthetic model: Hq {} Hkv {} D {}, {} layers, bf16; head pattern: {source}: {} of {} KV heads streaming",
        geometry.q_heads(),
        geometry.kv_heads(),
        geometry.head_dim(),
        geometry.layers(),
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
    let gpu = match o.cpu {
        true => Err("--cpu was given".to_string()),
        false => lserve::gpu::GpuContext::new(0).map_err(|e| format!("no usable GPU: {e}")),
    };
    match gpu {
        Ok(gpu) => {
            println!(
                "device: {} ({}); {} sequence(s) of {} tokens, {} decode steps\n",
                gpu.device_name()?,
                gpu.ptx().arch,
                o.batch,
                o.context,
                o.steps
            );
            run::run(gpu, o, &pattern, &config)?;
            accounting::report(&pattern, &config, o.context);
        }
        Err(why) => {
            println!("device: CPU reference ({why})\n");
            cpu::run(o, &pattern)?;
            accounting::report(&pattern, &config, o.context);
        }
    }
    Ok(())
}
