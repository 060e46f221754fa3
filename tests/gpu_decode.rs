//! GPU decode attention (`kernels-gpu/src/decode`) against the CPU reference.
//!
//! Each case builds a random paged cache (random head kinds, GQA or MHA, small pages, ragged
//! prompts, physical pages interleaved between sequences), then runs several reference decode
//! steps (append, select when due, attend). After each step the reference's cache and index
//! tables are uploaded, the GPU attends with the same queries into a poisoned output, and the
//! result is compared per (sequence, query head) with the reference by relative error.
//!
//! Ignored without a GPU (reported as ignored, never passed); `--ignored` runs them, and there a
//! missing GPU is a failure.

use half::{bf16, f16};
use lserve::config::{GqaAggregation, SparsityConfig};
use lserve::dtype::Element;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    decode_attention, DecodeBatch, DecodeWorkspace, DeviceElement, DeviceKvCache, GpuContext,
};
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId};
use lserve::reference::decode_step::{decode_step, write_tokens};
use lserve::reference::ReuseState;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn gpu() -> GpuContext {
    GpuContext::new(0).unwrap_or_else(|e| {
        panic!(
            "GPU test run without a usable CUDA GPU ({e}): these tests must run on a GPU machine"
        )
    })
}

#[derive(Debug, Clone)]
struct Case {
    head_dim: usize,
    kv_heads: usize,
    group: usize,
    streaming: Vec<bool>,
    page_tokens: usize,
    logical_per_page: usize,
    top_k: usize,
    sink: usize,
    local: usize,
    dynamic_min_len: usize,
    reuse: usize,
    prompts: Vec<usize>,
    steps: usize,
    f16: bool,
    seed: u64,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(64usize), Just(128)],
        1usize..=4,
        prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
    )
        .prop_flat_map(|(head_dim, kv_heads, group)| {
            (
                Just((head_dim, kv_heads, group)),
                prop::collection::vec(any::<bool>(), kv_heads),
                (
                    prop_oneof![Just(16usize), Just(32), Just(64)],
                    prop_oneof![Just(1usize), Just(2), Just(4)],
                ),
                (1usize..=4, 0usize..=24, 1usize..=48),
                (0usize..=400, prop_oneof![Just(1usize), Just(4)]),
                (
                    prop::collection::vec(1usize..=600, 1..=5),
                    1usize..=6,
                    any::<bool>(),
                    any::<u64>(),
                ),
            )
        })
        .prop_map(
            |(
                (head_dim, kv_heads, group),
                streaming,
                (page_tokens, lpp),
                (top_k, sink, local),
                (min_len, reuse),
                (prompts, steps, f16, seed),
            )| Case {
                head_dim,
                kv_heads,
                group,
                streaming,
                page_tokens,
                logical_per_page: lpp.min(page_tokens / 16).max(1),
                top_k,
                sink,
                local,
                dynamic_min_len: min_len,
                reuse,
                prompts,
                steps,
                f16,
                seed,
            },
        )
}

fn random_vec<E: Element>(rng: &mut StdRng, n: usize) -> Vec<E> {
    (0..n)
        .map(|_| E::from_f32(rng.gen_range(-1.0f32..1.0)))
        .collect()
}

/// Relative error of `got` against `want` per row of `d` elements; the worst row.
fn worst_row_error<E: Element>(got: &[E], want: &[f64], d: usize) -> f64 {
    got.chunks(d)
        .zip(want.chunks(d))
        .map(|(g, w)| {
            let (mut diff, mut norm) = (0.0f64, 0.0f64);
            for (&a, &b) in g.iter().zip(w) {
                let a = a.to_f32() as f64;
                if a.is_nan() {
                    return f64::INFINITY;
                }
                diff += (a - b) * (a - b);
                norm += b * b;
            }
            (diff / norm.max(1e-30)).sqrt()
        })
        .fold(0.0, f64::max)
}

fn run_case<E: DeviceElement>(gpu: &GpuContext, case: &Case) -> Result<(), TestCaseError> {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let geometry =
        ModelGeometry::new(1, case.kv_heads * case.group, case.kv_heads, case.head_dim).unwrap();
    let kinds = vec![case
        .streaming
        .iter()
        .map(|&s| {
            if s {
                HeadKind::Streaming
            } else {
                HeadKind::Dense
            }
        })
        .collect::<Vec<_>>()];
    let pattern = HeadPattern::from_kinds(geometry, kinds).unwrap();
    let config = SparsityConfig {
        sink_tokens: case.sink,
        local_tokens: case.local,
        page_tokens: case.page_tokens,
        logical_page_tokens: case.page_tokens / case.logical_per_page,
        token_budget: case.top_k * case.page_tokens,
        reuse_interval: case.reuse,
        dynamic_min_len: case.dynamic_min_len,
        gqa_aggregation: if rng.gen() {
            GqaAggregation::Max
        } else {
            GqaAggregation::Mean
        },
        always_include_first_page: rng.gen(),
        softmax_scale: None,
    };
    let max_len = case.prompts.iter().max().unwrap() + case.steps;
    let batch = case.prompts.len();
    let capacity = batch * max_len.div_ceil(case.page_tokens) + 3;
    let mut mgr =
        KvCacheManager::new(geometry, pattern.clone(), config, capacity, batch, max_len).unwrap();
    let mut host = HostKvCache::<E>::for_manager(&mgr).unwrap();
    let mut tables = IndexTables::for_manager(&mgr).unwrap();
    let mut reuse = ReuseState::new(case.reuse).unwrap();
    let (hq, hkv, d) = (geometry.q_heads(), geometry.kv_heads(), geometry.head_dim());

    // Prompts grow in interleaved random chunks, so physical pages of sequences interleave.
    let seqs: Vec<SeqId> = (0..batch).map(|_| mgr.add_sequence().unwrap()).collect();
    let mut left = case.prompts.clone();
    while left.iter().any(|&n| n > 0) {
        let b = rng.gen_range(0..batch);
        if left[b] == 0 {
            continue;
        }
        let n = rng.gen_range(1..=left[b]);
        left[b] -= n;
        let range = mgr.reserve(seqs[b], n).unwrap();
        let view = mgr.view(seqs[b]).unwrap();
        let k = random_vec::<E>(&mut rng, n * hkv * d);
        let v = random_vec::<E>(&mut rng, n * hkv * d);
        write_tokens(&mut host, 0, &view, range.start, &k, &v).unwrap();
    }

    let mut batch_dev = DecodeBatch::new(gpu, batch).unwrap();
    let mut ws = DecodeWorkspace::new(gpu, batch, hkv, geometry.group(), d).unwrap();
    for step in 0..case.steps {
        for &s in &seqs {
            mgr.reserve(s, 1).unwrap();
        }
        let q = random_vec::<E>(&mut rng, batch * hq * d);
        let k = random_vec::<E>(&mut rng, batch * hkv * d);
        let v = random_vec::<E>(&mut rng, batch * hkv * d);
        let want = decode_step(
            &mgr,
            &mut host,
            &mut tables,
            &mut reuse,
            0,
            &seqs,
            &q,
            &k,
            &v,
        )
        .unwrap();
        for &s in &seqs {
            mgr.advance_decode_step(s).unwrap();
        }

        let cache = DeviceKvCache::upload(gpu, &mgr, &host, &tables).unwrap();
        batch_dev.set(gpu, &mgr, &seqs).unwrap();
        let q_dev = gpu.stream().clone_htod(&q).unwrap();
        let mut out = gpu
            .stream()
            .clone_htod(&vec![E::from_f32(f32::NAN); batch * hq * d])
            .unwrap();
        decode_attention(gpu, &cache, 0, &batch_dev, &q_dev, &mut out, &mut ws).unwrap();
        let got: Vec<E> = gpu.stream().clone_dtoh(&out).unwrap();
        let err = worst_row_error(&got, &want.out, d);
        let tol = if E::DTYPE == lserve::dtype::DType::F16 {
            2e-3
        } else {
            1e-2
        };
        prop_assert!(
            err < tol,
            "step {step}: worst relative error {err:.3e} (tolerance {tol:.0e})"
        );
    }
    Ok(())
}

proptest! {
    #[test]
    #[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
    fn decode_attention_matches_reference(case in case_strategy()) {
        let gpu = gpu();
        if case.f16 {
            run_case::<f16>(&gpu, &case)?;
        } else {
            run_case::<bf16>(&gpu, &case)?;
        }
    }
}

/// A long dense sequence split over many blocks: the split/combine path with many tiles.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn long_dense_sequence_uses_many_splits() {
    let gpu = gpu();
    let case = Case {
        head_dim: 128,
        kv_heads: 2,
        group: 4,
        streaming: vec![false, true],
        page_tokens: 64,
        logical_per_page: 4,
        top_k: 8,
        sink: 64,
        local: 256,
        dynamic_min_len: 1 << 20,
        reuse: 1,
        prompts: vec![20_000],
        steps: 1,
        f16: false,
        seed: 7,
    };
    run_case::<bf16>(&gpu, &case).unwrap();
}
