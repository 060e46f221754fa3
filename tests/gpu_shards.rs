//! Tensor-parallel shards on the GPU: a model's KV heads split over 2 and 4 ranks
//! (`ModelGeometry::shard`, `HeadPattern::shard`), each shard with its own device cache sized for
//! its heads, run one after another on one GPU. Their whole decode steps (append, selection when
//! due, attention; two layers) give per (sequence, query head) what the unsharded model gives,
//! within the equivalence tolerance (the attention's split count depends on how many heads a
//! launch has, so the summation order differs; the selection does not), and the same selected
//! pages, page for page. The exact equality of the shards' reference runs is
//! `tests/tensor_parallel_shards.rs`.
//!
//! Ignored without a GPU (reported as ignored, never passed); `--ignored` runs them, and there a
//! missing GPU is a failure.

mod common;

use common::{
    gpu, head_pattern, heads_of, prefilled, prompt_rows, random_vec_in, tolerance, Prefilled,
};
use half::bf16;
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{DecodeStep, DeviceKvCache, GpuContext};
use lserve::head_pattern::HeadPattern;
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId};
use rand::rngs::StdRng;
use rand::SeedableRng;

const D: usize = 64;

/// `n` values uniform in `[-2, 2)`, as bf16.
fn random(rng: &mut StdRng, n: usize) -> Vec<bf16> {
    random_vec_in(rng, n, -2.0..2.0)
}

fn config() -> SparsityConfig {
    SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 16,
        token_budget: 48,
        sink_tokens: 16,
        local_tokens: 32,
        dynamic_min_len: 64,
        reuse_interval: 2,
        ..SparsityConfig::default()
    }
}

/// A model (or shard) on the device: `pattern`'s heads, `prompts` prefilled from `k`, `v`
/// (`[T][Hkv][D]`, sequences one after another) on every layer.
struct Model {
    mgr: KvCacheManager,
    cache: DeviceKvCache<bf16>,
    step: DecodeStep,
    seqs: Vec<SeqId>,
}

impl Model {
    fn new(
        gpu: &GpuContext,
        pattern: &HeadPattern,
        prompts: &[usize],
        k: &[bf16],
        v: &[bf16],
    ) -> Self {
        let max_len = prompts.iter().max().unwrap() + 16;
        let kv = prompt_rows(prompts, pattern.geometry().kv_heads(), D, k, v);
        let Prefilled {
            mgr,
            host,
            tables,
            seqs,
            ..
        } = prefilled::<bf16>(pattern.clone(), config(), prompts, max_len, 0, kv);
        let cache = DeviceKvCache::upload(gpu, &mgr, &host, &tables).unwrap();
        let step = DecodeStep::new(gpu, &cache, seqs.len()).unwrap();
        Self {
            mgr,
            cache,
            step,
            seqs,
        }
    }

    /// One decode step over every layer, the same `q`, `k`, `v` (`[B][H][D]`) per layer: the
    /// outputs `[layer][B][Hq][D]` and, per layer, the device's index tables after it.
    fn decode(
        &mut self,
        gpu: &GpuContext,
        q: &[bf16],
        k: &[bf16],
        v: &[bf16],
    ) -> (Vec<Vec<bf16>>, IndexTables) {
        let s = gpu.stream().clone();
        let (q, k, v) = (
            s.clone_htod(q).unwrap(),
            s.clone_htod(k).unwrap(),
            s.clone_htod(v).unwrap(),
        );
        let mut out = s.alloc_zeros::<bf16>(q.len()).unwrap();
        let layers = self.mgr.geometry().layers();
        let mut plan = self
            .step
            .plan(gpu, &mut self.mgr, &mut self.cache, &self.seqs)
            .unwrap();
        let mut outs = Vec::new();
        for layer in 0..layers {
            plan.layer(gpu, &mut self.cache, layer, &q, &k, &v, &mut out)
                .unwrap();
            outs.push(s.clone_dtoh(&out).unwrap());
        }
        plan.finish(gpu, &mut self.cache).unwrap();
        let mut host = HostKvCache::<bf16>::for_manager(&self.mgr).unwrap();
        let mut tables = IndexTables::for_manager(&self.mgr).unwrap();
        self.cache.download(gpu, &mut host, &mut tables).unwrap();
        (outs, tables)
    }
}

/// `‖a - b‖ / ‖b‖` over one row.
fn relative_error(a: &[bf16], b: &[bf16]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (x.to_f32() as f64, y.to_f32() as f64);
        num += (x - y) * (x - y);
        den += y * y;
    }
    (num / den.max(1e-30)).sqrt()
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn shards_decode_as_the_unsharded_model() {
    let gpu = gpu();
    let g = ModelGeometry::new(2, 16, 4, D).unwrap();
    let pattern = head_pattern(
        g,
        &[
            vec![false, true, false, false],
            vec![true, false, false, true],
        ],
    );
    let prompts = [150, 40, 97];
    let steps = 5;
    let mut rng = StdRng::seed_from_u64(9);
    let t: usize = prompts.iter().sum();
    let (hq, hkv, b) = (g.q_heads(), g.kv_heads(), prompts.len());
    let (k, v) = (random(&mut rng, t * hkv * D), random(&mut rng, t * hkv * D));
    let inputs: Vec<[Vec<bf16>; 3]> = (0..steps)
        .map(|_| {
            [
                random(&mut rng, b * hq * D),
                random(&mut rng, b * hkv * D),
                random(&mut rng, b * hkv * D),
            ]
        })
        .collect();
    let mut full = Model::new(&gpu, &pattern, &prompts, &k, &v);
    let want: Vec<_> = inputs
        .iter()
        .map(|[q, k, v]| full.decode(&gpu, q, k, v))
        .collect();
    for ranks in [2, 4] {
        let (sq, skv) = (hq / ranks, hkv / ranks);
        for rank in 0..ranks {
            let shard = pattern.shard(rank, ranks).unwrap();
            let part =
                |x: &[bf16], heads: usize, per: usize| heads_of(x, heads, D, rank * per, per);
            let mut m = Model::new(
                &gpu,
                &shard,
                &prompts,
                &part(&k, hkv, skv),
                &part(&v, hkv, skv),
            );
            for (s, [q, k, v]) in inputs.iter().enumerate() {
                let (outs, tables) = m.decode(
                    &gpu,
                    &part(q, hq, sq),
                    &part(k, hkv, skv),
                    &part(v, hkv, skv),
                );
                let (want_outs, want_tables) = &want[s];
                for layer in 0..g.layers() {
                    let expected = heads_of(&want_outs[layer], hq, D, rank * sq, sq);
                    for (r, (got, exp)) in outs[layer].chunks(D).zip(expected.chunks(D)).enumerate()
                    {
                        let err = relative_error(got, exp);
                        assert!(
                            err < tolerance::<bf16>(),
                            "{ranks} ranks, rank {rank}, step {s}, layer {layer}, row {r}: {err:.2e}"
                        );
                    }
                    // The shard's dense heads are the model's dense heads of its KV heads, in
                    // order: the same selected pages.
                    let dense: Vec<usize> = shard.dense_kv_heads(layer).to_vec();
                    for (dh, &h) in dense.iter().enumerate() {
                        let model_dh = pattern.compact_index(layer, rank * skv + h);
                        for &seq in &m.seqs {
                            let slot = m.mgr.slot(seq).unwrap() as usize;
                            assert_eq!(
                                tables.get(layer, slot, dh).unwrap(),
                                want_tables.get(layer, slot, model_dh).unwrap(),
                                "{ranks} ranks, rank {rank}, step {s}, layer {layer}, slot {slot}"
                            );
                        }
                    }
                }
            }
        }
    }
}
