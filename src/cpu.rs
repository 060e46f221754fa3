//! Without a GPU: a small version on the CPU reference (f64), in seconds: the pattern's first
//! two layers, at most 2048 tokens of context and 2 sequences, 8 decode steps, with a token
//! budget of 256 (page selection from 512 tokens on) so that selection and reuse run at this
//! size. The prompts are written into the host cache as prefill writes them (no prefill
//! attention: its reference is quadratic in f64).

use std::time::Instant;

use half::bf16;
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager};
use lserve::reference::decode::{decode_step, HeadVisit};
use lserve::reference::kv_write::write_tokens;
use lserve::reference::select::ReuseState;
use lserve::Result;

use crate::synth::{self, SplitMix, DECODE_SETS, KEY_LAYERS};
use crate::Options;

pub fn run(o: &Options, pattern: &HeadPattern) -> Result<()> {
    let full = *pattern.geometry();
    let layers = full.layers().min(2);
    let g = ModelGeometry::new(layers, full.q_heads(), full.kv_heads(), full.head_dim())?;
    let kinds: Vec<Vec<HeadKind>> = (0..layers)
        .map(|l| pattern.layer_kinds(l).to_vec())
        .collect();
    let pattern = HeadPattern::from_kinds(g, kinds)?;
    let config = SparsityConfig {
        token_budget: 256,
        dynamic_min_len: 512,
        ..SparsityConfig::default()
    };
    let (context, batch, steps) = (o.context.min(2048), o.batch.min(2), o.steps.min(8));
    let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    println!(
        "CPU reference version: {layers} layers, {batch} sequence(s) of {context} tokens, {steps} decode steps, token budget {} (selection past {} tokens)",
        config.token_budget, config.dynamic_min_len
    );
    let max_len = context + steps;
    let pages = batch * config.pages_for_len(max_len);
    let mut mgr = KvCacheManager::new(g, pattern.clone(), config, pages, batch, max_len)?;
    let mut host = HostKvCache::<bf16>::for_manager(&mgr)?;
    let mut tables = IndexTables::for_manager(&mgr)?;
    let mut reuse = ReuseState::new(config.reuse_interval)?;
    let keys: Vec<Vec<bf16>> = (0..KEY_LAYERS)
        .map(|kl| synth::keys(kl, context, hkv, d))
        .collect();
    let mut rng = SplitMix(0x5eed);
    let values: Vec<bf16> = (0..context * hkv * d)
        .map(|_| bf16::from_f32(rng.uniform()))
        .collect();
    let mut seqs = Vec::new();
    for _ in 0..batch {
        let seq = mgr.add_sequence()?;
        mgr.reserve(seq, context)?;
        let view = mgr.view(seq)?;
        for layer in 0..layers {
            write_tokens(
                &mut host,
                layer,
                &view,
                0,
                &keys[layer % KEY_LAYERS],
                &values,
            )?;
        }
        seqs.push(seq);
    }
    let start = Instant::now();
    let mut last = None;
    for step in 0..steps {
        for &seq in &seqs {
            mgr.reserve(seq, 1)?;
        }
        for layer in 0..layers {
            let x = synth::decode_inputs(
                (step + layer) % DECODE_SETS,
                batch,
                context + step,
                hq,
                hkv,
                d,
            );
            let o = decode_step(
                &mgr,
                &mut host,
                &mut tables,
                &mut reuse,
                layer,
                &seqs,
                &x.q,
                &x.k,
                &x.v,
            )?;
            if layer == 0 {
                last = Some(o);
            }
        }
        for &seq in &seqs {
            mgr.advance_decode_step(seq)?;
        }
    }
    let per_step = start.elapsed() / steps as u32;
    println!(
        "decode step ({layers} layers, CPU reference): {:.2} ms",
        per_step.as_secs_f64() * 1e3
    );
    if let Some(o) = last {
        let finite = o.out.iter().all(|x| x.is_finite());
        println!("last step, layer 0, first sequence (output finite: {finite}):");
        for (h, v) in o.visits[0].iter().enumerate() {
            let what = match v {
                HeadVisit::Streaming => "streaming: sinks + ring".to_string(),
                HeadVisit::AllPages => "dense: every page".to_string(),
                HeadVisit::Selected {
                    pages,
                    selected_now,
                } => format!(
                    "dense: {} of {} pages ({})",
                    pages.len(),
                    config.units_for_len(context + steps),
                    if *selected_now {
                        "selected now"
                    } else {
                        "reused"
                    }
                ),
            };
            println!("  KV head {h}: {what}");
        }
    }
    println!();
    Ok(())
}
