//! Dumps real activations for lserve's GPU tests: the model over a long text with dense
//! attention, and for a few layers the post-RoPE keys and values of every position and the
//! queries of the last `--queries` positions before each window end, `f16`, in one safetensors
//! file (`lserve_candle_smollm2::activations` describes it). `scripts/dump_activations.sh` runs
//! it; `tests/gpu_real_activations.rs` (main workspace) reads the file.
//!
//! ```text
//! cargo run --release --bin dump_activations -- --out FILE [--gguf PATH] [--text PATH]
//!     [--max-tokens 8192] [--layers 0,10,20,29] [--query-ends 1024,2080,4096,8192] [--queries 64]
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use lserve_candle_smollm2::activations::{dump, DumpSpec};
use lserve_candle_smollm2::model::Llama;
use lserve_candle_smollm2::{default_gguf_path, tokenizer, DEFAULT_TEXT, GGUF_NAME};

/// Post-RoPE Q, K, V of a few layers of SmolLM2 over a long text, for lserve's GPU tests.
#[derive(Parser, Debug)]
struct Args {
    /// The safetensors file to write.
    #[arg(long)]
    out: PathBuf,
    /// The GGUF (default: where scripts/fetch_smollm2.sh puts it).
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// The text.
    #[arg(long, default_value = DEFAULT_TEXT)]
    text: PathBuf,
    /// The text's first tokens taken (at most the model's context).
    #[arg(long, default_value_t = 8192)]
    max_tokens: usize,
    /// Layers to dump (comma-separated, ascending).
    #[arg(long, value_delimiter = ',', default_value = "0,10,20,29")]
    layers: Vec<usize>,
    /// Window ends (comma-separated, ascending): each window's queries are the `--queries`
    /// positions before it. An end past the text is the text's length (duplicates dropped).
    #[arg(long, value_delimiter = ',', default_value = "1024,2080,4096,8192")]
    query_ends: Vec<usize>,
    /// Queries per window (the decode steps a GPU test runs per window).
    #[arg(long, default_value_t = 64)]
    queries: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let t0 = Instant::now();
    let gguf = match args.gguf {
        Some(p) => p,
        None => default_gguf_path().context("no HOME: give --gguf")?,
    };
    let (model, content) =
        Llama::load(&gguf).context("loading the model (run scripts/fetch_smollm2.sh?)")?;
    let tok = tokenizer::from_gguf(&content)?;
    let text = std::fs::read_to_string(&args.text)
        .with_context(|| format!("reading {}", args.text.display()))?;
    let mut ids = tokenizer::encode(&tok, &text)?;
    let c = *model.config();
    ids.truncate(args.max_tokens.min(c.context));
    let t = ids.len();
    let mut query_ends: Vec<usize> = args.query_ends.iter().map(|&e| e.min(t)).collect();
    query_ends.dedup();
    let spec = DumpSpec {
        layers: args.layers,
        query_ends,
        queries: args.queries,
    };
    eprintln!(
        "{}: {t} tokens of {}; layers {:?}, windows ending at {:?}, {} queries each",
        args.text.display(),
        gguf.display(),
        spec.layers,
        spec.query_ends,
        spec.queries
    );
    let acts = dump(&model, &ids, &spec)?;
    let forward = t0.elapsed().as_secs_f64();
    let text_name = args.text.display().to_string();
    acts.save(
        &args.out,
        &[
            ("model", GGUF_NAME.to_string()),
            ("text", text_name),
            ("rope_base", c.rope_base.to_string()),
            (
                "attention",
                "dense causal softmax (candle f32, scale 1/sqrt(D)) on Q, K, V rounded to f16"
                    .to_string(),
            ),
        ],
    )?;
    let bytes = std::fs::metadata(&args.out)?.len();
    eprintln!(
        "wrote {} ({:.1} MiB) in {:.1}s (forward and load {forward:.1}s)",
        args.out.display(),
        bytes as f64 / (1024.0 * 1024.0),
        t0.elapsed().as_secs_f64()
    );
    println!("{}", args.out.display());
    Ok(())
}
