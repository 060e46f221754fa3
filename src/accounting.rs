//! What LServe visits against dense attention, per stage, for the whole model.
//!
//! Prefill counts 64x64 (query block, KV block) tiles from the block iterator: causal for dense
//! heads, the Λ pattern for streaming heads. Decode counts the KV tokens each head reads and the
//! bytes moved: K and V of those tokens, plus for dense heads under page selection the key
//! statistics the selector reads, once every `reuse_interval` steps.

use lserve::block_iter::{num_blocks, prefill_blocks, PrefillShape};
use lserve::config::SparsityConfig;
use lserve::head_pattern::{HeadKind, HeadPattern};

/// Something LServe visits, against what dense attention visits.
struct Visited {
    dense: f64,
    lserve: f64,
}

impl Visited {
    /// The fraction skipped, `r`.
    fn skipped(&self) -> f64 {
        1.0 - self.lserve / self.dense
    }

    fn row(&self, stage: &str, what: &str) {
        let r = self.skipped();
        println!(
            "{stage:<8} {what:<38} {:>14.4e} {:>14.4e} {:>8.4} {:>10.2}x",
            self.dense,
            self.lserve,
            r,
            1.0 / (1.0 - r)
        );
    }
}

/// Prefill tiles one head of `kind` visits for a sequence of `len` tokens.
fn prefill_tiles(kind: HeadKind, len: usize, config: &SparsityConfig) -> f64 {
    let shape = PrefillShape {
        kind,
        seq_len: len,
        sink_tokens: config.sink_tokens,
        local_tokens: config.local_tokens,
    };
    (0..num_blocks(len))
        .map(|qb| prefill_blocks(&shape, qb, None).map_or(0, |blocks| blocks.count()) as f64)
        .sum()
}

/// KV tokens one head reads at a decode step of a sequence that is `len` tokens long after the
/// step's token: `(dense attention, LServe)` for a head of `kind`, and whether page selection
/// is on (`dynamic`).
fn decode_tokens(kind: HeadKind, len: usize, config: &SparsityConfig, dynamic: bool) -> f64 {
    match kind {
        HeadKind::Streaming => len.min(config.streaming_rows()) as f64,
        HeadKind::Dense if !dynamic || !config.uses_page_selection(len) => len as f64,
        HeadKind::Dense => {
            let unit = config.unit_tokens();
            let units = config.units_for_len(len);
            let newest_fill = len - (units - 1) * unit;
            let first = usize::from(config.always_include_first_page);
            let full = (config.pages_per_selection() + first).min(units - 1);
            (full * unit + newest_fill) as f64
        }
    }
}

/// Bytes of key statistics the selector reads for one dense head, per step (amortized over
/// the reuse interval).
fn selector_bytes(len: usize, config: &SparsityConfig, head_dim: usize) -> f64 {
    if !config.uses_page_selection(len) {
        return 0.0;
    }
    let logical = len.div_ceil(config.logical_page_tokens);
    (logical * 2 * head_dim * 2) as f64 / config.reuse_interval as f64
}

/// Prints the per-stage table for a `context`-token prompt and the decode step that follows.
pub fn report(pattern: &HeadPattern, config: &SparsityConfig, context: usize) {
    let g = *pattern.geometry();
    let (group, d) = (g.group(), g.head_dim());
    let heads =
        || (0..g.layers()).flat_map(move |l| (0..g.kv_heads()).map(move |h| pattern.kind(l, h)));

    let dense_tiles = prefill_tiles(HeadKind::Dense, context, config);
    let streaming_tiles = prefill_tiles(HeadKind::Streaming, context, config);
    let prefill = Visited {
        dense: heads().count() as f64 * group as f64 * dense_tiles,
        lserve: heads()
            .map(|k| match k {
                HeadKind::Dense => dense_tiles,
                HeadKind::Streaming => streaming_tiles,
            })
            .sum::<f64>()
            * group as f64,
    };

    let len = context + 1;
    let row_bytes = (2 * d * 2) as f64; // K and V rows, 16-bit
    let step = |static_on: bool, dynamic_on: bool| -> (f64, f64) {
        let mut tokens = 0.0;
        let mut bytes = 0.0;
        for kind in heads() {
            let kind = if static_on { kind } else { HeadKind::Dense };
            let t = decode_tokens(kind, len, config, dynamic_on);
            tokens += t;
            bytes += t * row_bytes;
            if kind == HeadKind::Dense && dynamic_on {
                bytes += selector_bytes(len, config, d);
            }
        }
        (tokens, bytes)
    };
    let (dense_tokens, dense_bytes) = step(false, false);
    let (static_tokens, static_bytes) = step(true, false);
    let (dynamic_tokens, dynamic_bytes) = step(false, true);
    let (both_tokens, both_bytes) = step(true, true);

    println!(
        "what LServe visits against dense attention (whole model, {} layers, {context}-token context)",
        g.layers()
    );
    println!(
        "{:<8} {:<38} {:>14} {:>14} {:>8} {:>11}",
        "stage", "what", "dense", "LServe", "r", "1/(1-r)"
    );
    prefill.row("prefill", "KV tiles (64x64) over all query heads");
    Visited {
        dense: dense_tokens,
        lserve: both_tokens,
    }
    .row("decode", "KV tokens read (all KV heads)");
    Visited {
        dense: dense_bytes,
        lserve: static_bytes,
    }
    .row("decode", "bytes: static sparsity only");
    Visited {
        dense: dense_bytes,
        lserve: dynamic_bytes,
    }
    .row("decode", "bytes: dynamic sparsity only");
    Visited {
        dense: dense_bytes,
        lserve: both_bytes,
    }
    .row("decode", "bytes: LServe (static + dynamic)");
    println!(
        "\n(decode bytes: K+V of the tokens read, plus the key statistics the selector reads every \
         {} steps; static-only {static_tokens:.0} tokens, dynamic-only {dynamic_tokens:.0})",
        config.reuse_interval
    );
}
