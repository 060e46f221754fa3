//! The measurements behind the quantized formats (`docs/QUANTIZATION.md`), on the CPU reference:
//!
//! 1. the error of attention over K/V rows quantized to each format against attention over the
//!    bf16 rows, on random heads (normal K/V; keys also with outlier channels), for a flat and a
//!    peaked softmax;
//! 2. page selection from 8-bit key statistics against bf16 statistics, on synthetic long
//!    contexts with planted needle keys: needle recall and attention mass captured, for flat
//!    `N_P = N_L` = 16 / 32 / 64 and hierarchical 64 / 16 at one token budget.
//!
//! `cargo run --release --example quant_study` prints both tables as Markdown.

mod common;

use common::{bf16_round, capture, context, keys, normal, Context, D};
use lserve::config::GqaAggregation;
use lserve::quant::{CodeBits, IntFormat, QuantGroup, StatsGroup};
use lserve::reference::decode::attend_rows;
use lserve::reference::kv_write::{key_stats, KeyStats};
use lserve::reference::quant::{quantize_key_stats, quantize_rows};
use lserve::reference::select::SelectionParams;
use rand::rngs::StdRng;
use rand::SeedableRng;

fn rows_of(x: &[f32]) -> Vec<&[f32]> {
    x.chunks(D).collect()
}

fn relative_error(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

/// Mean and largest relative error of attention over `format` rows against bf16 rows, over
/// `trials` heads of `len` keys.
fn attention_error(
    format: IntFormat,
    outliers: usize,
    temperature: f32,
    trials: u64,
) -> (f64, f64) {
    let len = 2048;
    let errors: Vec<f64> = (0..trials)
        .map(|seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            let k = keys(&mut rng, len, outliers);
            let v = keys(&mut rng, len, 0);
            let q: Vec<f32> = (0..D)
                .map(|_| bf16_round(normal(&mut rng) * temperature))
                .collect();
            let kq = quantize_rows(&k, D, format).unwrap().dequantize();
            let vq = quantize_rows(&v, D, format).unwrap().dequantize();
            let scale = 1.0 / (D as f64).sqrt();
            let exact = attend_rows(&q, &rows_of(&k), &rows_of(&v), scale).out;
            let quant = attend_rows(&q, &rows_of(&kq), &rows_of(&vq), scale).out;
            relative_error(&quant, &exact)
        })
        .collect();
    let mean = errors.iter().sum::<f64>() / errors.len() as f64;
    (mean, errors.iter().copied().fold(0.0, f64::max))
}

fn error_table() {
    let formats = [
        IntFormat::new(CodeBits::Int8, QuantGroup::TokenHead),
        IntFormat::new(CodeBits::Int8, QuantGroup::Channels(32)),
        IntFormat::new(CodeBits::Int4, QuantGroup::TokenHead),
        IntFormat::new(CodeBits::Int4, QuantGroup::Channels(64)),
        IntFormat::new(CodeBits::Int4, QuantGroup::Channels(32)),
        IntFormat::new(CodeBits::Int4, QuantGroup::Channels(16)),
    ];
    println!("| format | bytes per row (D 128) | vs bf16 | normal K, T 1 | normal K, T 4 | outlier K, T 1 | outlier K, T 4 |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for format in formats {
        let bytes = format.row_bytes(D).unwrap();
        let mut cells = Vec::new();
        for outliers in [0, 4] {
            for temperature in [1.0, 4.0] {
                let (mean, max) = attention_error(format, outliers, temperature, 16);
                cells.push(format!("{mean:.2e} / {max:.2e}"));
            }
        }
        println!(
            "| {format} | {bytes} | {:.2}x | {} |",
            (2 * D) as f64 / bytes as f64,
            cells.join(" | ")
        );
    }
}

/// Needle recall and attention mass of the pages selected from `stats` (logical pages of
/// `n_l` tokens, physical of `n_p`) at `budget` tokens, the newest page always included.
fn select(c: &Context, stats: &KeyStats, n_l: usize, n_p: usize, budget: usize) -> (f64, f64) {
    let params = SelectionParams {
        logical_per_page: n_p / n_l,
        top_k: budget / n_p,
        always_include_first: false,
        aggregation: GqaAggregation::Max,
    };
    let got = capture(c, stats, &params, n_p);
    let found = got.needles.iter().filter(|&&f| f).count();
    (found as f64 / got.needles.len() as f64, got.mass)
}

fn selection_table() {
    let (len, budget, trials) = (32768, 2048, 48);
    let layouts = [(16, 16), (32, 32), (64, 64), (16, 64)];
    let stats_kinds: [(&str, Option<StatsGroup>); 3] = [
        ("bf16", None),
        ("8-bit, per page", Some(StatsGroup::Page)),
        ("8-bit, per 32 channels", Some(StatsGroup::Channels(32))),
    ];
    let strengths = [6.0, 10.0];
    println!(
        "| pages (N_L / N_P) | statistics | bytes per page-head (D 128) | needle recall, 6 / 10 | attention mass, 6 / 10 |"
    );
    println!("| --- | --- | ---: | ---: | ---: |");
    let contexts: Vec<Vec<Context>> = strengths
        .iter()
        .map(|&s| (0..trials).map(|seed| context(seed, len, 8, s)).collect())
        .collect();
    for (n_l, n_p) in layouts {
        for (name, kind) in stats_kinds {
            let (mut recall, mut mass) = (Vec::new(), Vec::new());
            for cs in &contexts {
                let (mut r_sum, mut m_sum) = (0.0, 0.0);
                for c in cs {
                    let exact = key_stats(&c.keys, D, n_l).unwrap();
                    let stats = match kind {
                        None => exact,
                        Some(g) => quantize_key_stats(&exact, g).unwrap().dequantized(),
                    };
                    let (r, m) = select(c, &stats, n_l, n_p, budget);
                    r_sum += r / trials as f64;
                    m_sum += m / trials as f64;
                }
                recall.push(format!("{:.1}%", 100.0 * r_sum));
                mass.push(format!("{:.1}%", 100.0 * m_sum));
            }
            let bytes = match kind {
                None => 4 * D,
                Some(g) => g.page_bytes(D).unwrap(),
            };
            println!(
                "| {n_l} / {n_p} | {name} | {bytes} | {} | {} |",
                recall.join(" / "),
                mass.join(" / ")
            );
        }
    }
    println!(
        "\n{trials} contexts of {len} tokens per needle strength, D {D}, 4 outlier key channels \
         (8x, +4), 8 needles each at 6 or 10 |q| along q, budget {budget} tokens, one query head \
         (no GQA aggregation)."
    );
}

fn main() {
    println!("## Attention error per format (mean / max relative error, 16 heads of 2048 keys)\n");
    error_table();
    println!("\n## Page selection from bf16 and 8-bit key statistics\n");
    selection_table();
}
