//! The GPU run: prefill and decode through `lserve::session::SparseAttention`, timed, for the
//! LServe pattern and (with `--dense`) an all-dense pattern at the same cache sizes, and the
//! last step of two layers checked against the CPU reference on the device's selection.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaView};
use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use lserve::config::SparsityConfig;
use lserve::gpu::{download_selection, fill_random, random_fill_value, GpuContext};
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::KvCacheManager;
use lserve::reference::decode::attend_rows;
use lserve::session::SparseAttention;
use lserve::Result;

use crate::synth::{self, DECODE_SETS, KEY_LAYERS};
use crate::Options;

/// The seed of the prefill values of key layer `kl` (`fill_random` on the device).
fn value_seed(kl: usize) -> u64 {
    0x7661_6c00 + kl as u64
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:<28} [{bar:40}] {pos}/{len} {elapsed}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// What one pattern's run measured.
struct Measured {
    /// Prefill of one prompt through every layer.
    ttft: Duration,
    /// One decode step of the batch through every layer.
    per_token: Duration,
    used_bytes: u64,
    allocated_bytes: u64,
    /// Worst relative row error of the checked outputs against the reference.
    error: f64,
}

pub fn run(
    gpu: GpuContext,
    o: &Options,
    pattern: &HeadPattern,
    config: &SparsityConfig,
) -> Result<()> {
    let gpu = Arc::new(gpu);
    let g = *pattern.geometry();
    let (hkv, d) = (g.kv_heads(), g.head_dim());
    let spin = bar(KEY_LAYERS as u64, "keys (host, RoPE)");
    let keys: Vec<Vec<bf16>> = (0..KEY_LAYERS)
        .map(|kl| {
            let k = synth::keys(kl, o.context, hkv, d);
            spin.inc(1);
            k
        })
        .collect();
    spin.finish_and_clear();

    let lserve = measure(&gpu, o, pattern, config, &keys, "LServe")?;
    report("LServe", &lserve);
    if o.dense {
        let dense_pattern = HeadPattern::all_dense(g);
        let dense_config = SparsityConfig {
            dynamic_min_len: 1 << 30,
            ..*config
        };
        let dense = measure(&gpu, o, &dense_pattern, &dense_config, &keys, "dense")?;
        report("dense", &dense);
        println!(
            "LServe vs dense: time to first token {:.2}x, per-token attention {:.2}x, KV memory used {:.2}x less\n",
            dense.ttft.as_secs_f64() / lserve.ttft.as_secs_f64(),
            dense.per_token.as_secs_f64() / lserve.per_token.as_secs_f64(),
            dense.used_bytes as f64 / lserve.used_bytes as f64
        );
    }
    Ok(())
}

fn report(name: &str, m: &Measured) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "{name:<7} time to first token (prefill, all layers) {:>9.1} ms | per-token attention \
         (decode step, all layers) {:>8.1} us | KV memory used {:.2} GiB of {:.2} GiB allocated \
         | reference check: worst relative error {:.2e}",
        m.ttft.as_secs_f64() * 1e3,
        m.per_token.as_secs_f64() * 1e6,
        gib(m.used_bytes),
        gib(m.allocated_bytes),
        m.error
    );
}

/// Tokens `at` of `x`, rows of `row` elements.
fn token_rows(x: &CudaSlice<bf16>, at: Range<usize>, row: usize) -> CudaView<'_, bf16> {
    x.slice(at.start * row..at.end * row)
}

fn measure(
    gpu: &Arc<GpuContext>,
    o: &Options,
    pattern: &HeadPattern,
    config: &SparsityConfig,
    keys: &[Vec<bf16>],
    name: &str,
) -> Result<Measured> {
    let g = *pattern.geometry();
    let (hq, hkv, d, layers) = (g.q_heads(), g.kv_heads(), g.head_dim(), g.layers());
    let (context, batch, steps) = (o.context, o.batch, o.steps);
    let max_len = context + steps;
    let pages = batch * config.pages_for_len(max_len);
    let mgr = KvCacheManager::new(g, pattern.clone(), *config, pages, batch, max_len)?;
    let chunk = o.chunk.unwrap_or(context).min(context);
    let mut session = SparseAttention::<bf16>::new(gpu.clone(), mgr, batch)?;
    if chunk < context {
        // One sequence's chunks at a time: its whole length is the most a launch gathers.
        session = session.with_prefill_chunks(context)?;
    }
    let s = gpu.stream().clone();

    // Prefill activations: queries and values filled on the device, keys from the host.
    let mut q = s.alloc_zeros::<bf16>(context * hq * d)?;
    fill_random(gpu, &mut q, 0x7100)?;
    let k: Vec<_> = keys
        .iter()
        .map(|k| s.clone_htod(k))
        .collect::<std::result::Result<_, _>>()?;
    let mut v = Vec::new();
    for kl in 0..KEY_LAYERS {
        let mut buf = s.alloc_zeros::<bf16>(context * hkv * d)?;
        fill_random(gpu, &mut buf, value_seed(kl))?;
        v.push(buf);
    }
    let mut out = s.alloc_zeros::<bf16>(context * hq * d)?;
    s.synchronize()?;

    let chunks = context.div_ceil(chunk);
    let pb = bar(
        (batch * chunks * layers) as u64,
        &format!("{name}: prefill"),
    );
    let mut seqs = Vec::new();
    let mut ttft = Duration::ZERO;
    for _ in 0..batch {
        let seq = session.add_sequence()?;
        let start = Instant::now();
        for first in (0..context).step_by(chunk) {
            let n = chunk.min(context - first);
            let mut pf = session.prefill(&[(seq, n)])?;
            for layer in 0..layers {
                let kl = layer % KEY_LAYERS;
                let at = first..first + n;
                pf.layer(
                    layer,
                    token_rows(&q, at.clone(), hq * d),
                    token_rows(&k[kl], at.clone(), hkv * d),
                    token_rows(&v[kl], at.clone(), hkv * d),
                    out.slice_mut(..n * hq * d),
                )?;
                pb.inc(1);
            }
            pf.finish()?;
        }
        s.synchronize()?;
        ttft += start.elapsed();
        seqs.push(seq);
    }
    pb.finish_and_clear();
    drop((q, out));

    // Decode inputs: a few distinct sets on the device, cycled over steps and layers.
    let sets: Vec<synth::DecodeInputs> = (0..DECODE_SETS)
        .map(|i| synth::decode_inputs(i, batch, context, hq, hkv, d))
        .collect();
    let dev: Vec<_> = sets
        .iter()
        .map(|x| {
            Ok((
                s.clone_htod(&x.q)?,
                s.clone_htod(&x.k)?,
                s.clone_htod(&x.v)?,
            ))
        })
        .collect::<Result<_>>()?;
    let mut outs: Vec<_> = (0..layers)
        .map(|_| s.alloc_zeros::<bf16>(batch * hq * d))
        .collect::<std::result::Result<_, _>>()?;
    // The set layer `layer` reads at step `step`.
    let set_of = |step: usize, layer: usize| match o.graph {
        true => layer % DECODE_SETS,
        false => (step + layer) % DECODE_SETS,
    };
    let pb = bar(steps as u64, &format!("{name}: decode"));
    s.synchronize()?;
    let start = Instant::now();
    if o.graph {
        let graphs = session.capture_decode(&seqs, |step| {
            for (layer, out) in outs.iter_mut().enumerate() {
                let (q, k, v) = &dev[set_of(0, layer)];
                step.layer(layer, q, k, v, out)?;
            }
            Ok(())
        })?;
        pb.inc(1);
        for _ in 1..steps {
            session.replay_decode(&graphs, &seqs)?;
            pb.inc(1);
        }
        s.synchronize()?;
    } else {
        for st in 0..steps {
            let mut step = session.decode(&seqs)?;
            for (layer, out) in outs.iter_mut().enumerate() {
                let (q, k, v) = &dev[set_of(st, layer)];
                step.layer(layer, q, k, v, out)?;
            }
            step.finish()?;
            pb.inc(1);
        }
        s.synchronize()?;
    }
    let per_token = start.elapsed() / steps as u32;
    pb.finish_and_clear();

    // The last step of the first and last layer, first sequence, against the reference
    // attending the tokens the device attended.
    let mut error = 0f64;
    let seq = seqs[0];
    let len = session.manager().len(seq)?;
    let block_table = session.manager().block_table(seq)?.pages().to_vec();
    let slot = session.manager().slot(seq)? as usize;
    let scale = config.softmax_scale_for(d) as f64;
    for layer in [0, layers - 1] {
        let kl = layer % KEY_LAYERS;
        let got: Vec<bf16> = s.clone_dtoh(&outs[layer])?;
        let selection = download_selection(gpu, session.cache(), layer)?;
        // K and V of token `t` of this layer, head `h`.
        let row = |t: usize, h: usize| -> (Vec<f32>, Vec<f32>) {
            if t < context {
                let at = (t * hkv + h) * d;
                let k = keys[kl][at..at + d].iter().map(|x| x.to_f32()).collect();
                let v = (0..d)
                    .map(|i| {
                        bf16::from_f32(random_fill_value(value_seed(kl), (at + i) as u64)).to_f32()
                    })
                    .collect();
                (k, v)
            } else {
                let x = &sets[set_of(t - context, layer)];
                let at = h * d; // batch row 0
                let f = |y: &[bf16]| y[at..at + d].iter().map(|e| e.to_f32()).collect();
                (f(&x.k), f(&x.v))
            }
        };
        let q_last = &sets[set_of(steps - 1, layer)].q;
        for h in 0..hkv {
            let tokens: Vec<usize> = match pattern.kind(layer, h) {
                HeadKind::Streaming => (0..len)
                    .filter(|&t| t < config.sink_tokens || len - 1 - t < config.local_tokens)
                    .collect(),
                HeadKind::Dense if !config.uses_page_selection(len) => (0..len).collect(),
                HeadKind::Dense => {
                    let hd = pattern.dense_heads(layer);
                    let e = slot * hd + pattern.compact_index(layer, h);
                    let n = selection.index_lens[e] as usize;
                    let entry = &selection.index_pages[e * selection.entry_capacity..][..n];
                    let mut tokens = Vec::new();
                    for page in entry {
                        let p = block_table
                            .iter()
                            .position(|x| x == page)
                            .unwrap_or(usize::MAX);
                        let first = p.saturating_mul(config.page_tokens);
                        tokens.extend(first..(first + config.page_tokens).min(len));
                    }
                    tokens
                }
            };
            let rows: Vec<(Vec<f32>, Vec<f32>)> = tokens.iter().map(|&t| row(t, h)).collect();
            let ks: Vec<&[f32]> = rows.iter().map(|r| r.0.as_slice()).collect();
            let vs: Vec<&[f32]> = rows.iter().map(|r| r.1.as_slice()).collect();
            for qh in h * g.group()..(h + 1) * g.group() {
                let qrow: Vec<f32> = q_last[qh * d..(qh + 1) * d]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let want = attend_rows(&qrow, &ks, &vs, scale).out;
                let (mut num, mut den) = (0f64, 0f64);
                for (x, y) in got[qh * d..(qh + 1) * d].iter().zip(&want) {
                    num += (x.to_f64() - y).powi(2);
                    den += y * y;
                }
                error = error.max((num / den.max(1e-30)).sqrt());
            }
        }
    }
    let memory = session.memory();
    for seq in seqs {
        session.free_sequence(seq)?;
    }
    Ok(Measured {
        ttft: ttft / batch as u32,
        per_token,
        used_bytes: memory.used_bytes,
        allocated_bytes: memory.allocated_bytes,
        error,
    })
}
