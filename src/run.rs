//! One decode step of one layer on a `context`-token sequence: on the CPU reference, and on the
//! GPU when one is usable (then checked against the reference).

use half::bf16;
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{DecodeStep, DeviceKvCache, GpuContext};
use lserve::head_pattern::HeadPattern;
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId};
use lserve::reference::decode::{decode_step as reference_step, HeadVisit};
use lserve::reference::kv_write::write_tokens;
use lserve::reference::select::ReuseState;
use lserve::Result;

/// What the step ran on and what it did.
pub struct StepReport {
    /// "ran on ..." line.
    pub device: String,
    /// What the step visited.
    pub summary: String,
}

/// A small, fast generator for the demo's random keys and values (splitmix64).
struct SplitMix(u64);

impl SplitMix {
    fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.next_f32())).collect()
    }
}

/// The layer's cache state after a `context`-token prompt, on the host.
pub struct Prompt {
    pub manager: KvCacheManager,
    pub host: HostKvCache<bf16>,
    pub tables: IndexTables,
    pub seq: SeqId,
    rng: SplitMix,
}

/// Builds one layer (the `layer`-th of `pattern`) holding a `context`-token prompt of random
/// keys and values, statistics pooled, room for one more token.
pub fn prompt(
    pattern: &HeadPattern,
    config: &SparsityConfig,
    layer: usize,
    context: usize,
) -> Result<Prompt> {
    let g = *pattern.geometry();
    let one_layer = ModelGeometry::new(1, g.q_heads(), g.kv_heads(), g.head_dim())?;
    let pattern = HeadPattern::from_kinds(one_layer, vec![pattern.layer_kinds(layer).to_vec()])?;
    let max_len = context + 1;
    let pages = config.pages_for_len(max_len);
    let mut manager = KvCacheManager::new(one_layer, pattern, *config, pages, 1, max_len)?;
    let mut host = HostKvCache::<bf16>::for_manager(&manager)?;
    let tables = IndexTables::for_manager(&manager)?;
    let seq = manager.add_sequence()?;
    let mut rng = SplitMix(0x5eed);
    let row = g.kv_heads() * g.head_dim();
    let chunk = 4096;
    let mut written = 0;
    while written < context {
        let n = chunk.min(context - written);
        let range = manager.reserve(seq, n)?;
        let view = manager.view(seq)?;
        let (k, v) = (rng.vec(n * row), rng.vec(n * row));
        write_tokens(&mut host, 0, &view, range.start, &k, &v)?;
        written += n;
    }
    Ok(Prompt {
        manager,
        host,
        tables,
        seq,
        rng,
    })
}

/// Runs the step on the CPU reference, or on the GPU when present and not `force_cpu`.
pub fn decode_step(
    pattern: &HeadPattern,
    config: &SparsityConfig,
    layer: usize,
    context: usize,
    force_cpu: bool,
) -> Result<StepReport> {
    let mut p = prompt(pattern, config, layer, context)?;
    let g = *p.manager.geometry();
    let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    let q = p.rng.vec(hq * d);
    let k = p.rng.vec(hkv * d);
    let v = p.rng.vec(hkv * d);
    let gpu = match force_cpu {
        true => Err("--cpu was given".to_string()),
        false => GpuContext::new(0).map_err(|e| format!("no usable GPU: {e}")),
    };
    // The GPU starts from the cache as it stood before the step (the reference appends to it);
    // its step reserves the token itself.
    let before = gpu
        .as_ref()
        .ok()
        .map(|_| (p.manager.clone(), p.host.clone(), p.tables.clone()));
    p.manager.reserve(p.seq, 1)?;
    let mut reuse = ReuseState::new(config.reuse_interval)?;
    let want = reference_step(
        &p.manager,
        &mut p.host,
        &mut p.tables,
        &mut reuse,
        0,
        &[p.seq],
        &q,
        &k,
        &v,
    )?;
    let finite = want.out.iter().all(|x| x.is_finite());
    let summary = summarize(&want.visits[0], config, context + 1, finite, &want.out, d);
    let (gpu, (mut manager, host, tables)) = match (gpu, before) {
        (Ok(gpu), Some(before)) => (gpu, before),
        (Err(why), _) => {
            return Ok(StepReport {
                device: format!("ran on: CPU reference (f64 accumulation), layer {layer}; {why}"),
                summary,
            })
        }
        (Ok(_), None) => unreachable!("the state is cloned whenever a GPU is present"),
    };

    // The same step on the GPU: reserve, append, select, attend, advance.
    let mut cache = DeviceKvCache::upload(&gpu, &manager, &host, &tables)?;
    let mut step = DecodeStep::new(&gpu, &cache, 1)?;
    let mut plan = step.plan(&gpu, &mut manager, &mut cache, &[p.seq])?;
    let stream = gpu.stream();
    let (q_dev, k_dev, v_dev) = (
        stream.clone_htod(&q)?,
        stream.clone_htod(&k)?,
        stream.clone_htod(&v)?,
    );
    let mut out = stream.clone_htod(&vec![bf16::NAN; hq * d])?;
    plan.layer(&gpu, &mut cache, 0, &q_dev, &k_dev, &v_dev, &mut out)?;
    plan.finish(&gpu, &mut cache)?;
    let got: Vec<bf16> = stream.clone_dtoh(&out)?;
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(&want.out) {
        diff += (g.to_f64() - w) * (g.to_f64() - w);
        norm += w * w;
    }
    let rel = (diff / norm).sqrt();
    Ok(StepReport {
        device: format!(
            "ran on: GPU ({}), layer {layer}: append + page selection + attention, \
             checked against the CPU reference: relative error {rel:.2e} over all query heads",
            gpu.device_name()?
        ),
        summary,
    })
}

fn summarize(
    visits: &[HeadVisit],
    config: &SparsityConfig,
    len: usize,
    finite: bool,
    out: &[f64],
    d: usize,
) -> String {
    let pages = config.pages_for_len(len);
    let mut lines = Vec::new();
    for (h, v) in visits.iter().enumerate() {
        let what = match v {
            HeadVisit::Streaming => format!(
                "streaming: sinks + ring, {} of {len} tokens",
                len.min(config.streaming_rows())
            ),
            HeadVisit::AllPages => format!("dense, below dynamic_min_len: all {pages} pages"),
            HeadVisit::Selected {
                pages: sel,
                selected_now,
            } => format!(
                "dense, {} of {pages} pages{} (first {:?}, newest {})",
                sel.len(),
                if *selected_now {
                    ", selected now"
                } else {
                    ", reused"
                },
                &sel[..sel.len().min(4)],
                sel.last().copied().unwrap_or(0)
            ),
        };
        lines.push(format!("  KV head {h}: {what}"));
    }
    let norm = (out.iter().map(|x| x * x).sum::<f64>() / (out.len() / d) as f64).sqrt();
    lines.push(format!(
        "  output: [{} query heads x {d}], finite: {finite}, mean row norm {norm:.4}",
        out.len() / d
    ));
    lines.join("\n")
}
