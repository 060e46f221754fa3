//! GPU page selection (`kernels-gpu/src/select`: scorer, top-K with reuse, step counters)
//! against the CPU reference (`reference::select::select_from_cache`).
//!
//! Each case builds a random paged cache (random head kinds over one or two layers, MHA or GQA,
//! D 64 / 128, lengths not multiples of pages, physical pages shuffled by a freed filler
//! sequence and interleaved growth), fills it with `write_tokens` (which pools the statistics),
//! poisons the statistics rows of logical pages past each sequence's end, then runs several
//! decode steps: grow every sequence by one token on the host, copy statistics and block tables
//! to the device, poison the index tables and the score workspace, select on the GPU for every
//! layer, advance the step counters, and check against the reference:
//! - raw physical-page scores: relative `1e-4` (of the larger of the score and the pair's
//!   largest score magnitude); rows of pairs that are not due, and pages past the sequence,
//!   stay poisoned;
//! - due pairs: the selection equals the reference's, except on near-ties (pages whose
//!   reference score is within `1e-4` of the K-th score, relative), `docs/ARCHITECTURE.md`
//!   "Equivalence rules";
//! - reused pairs: the held selection is unchanged and the selector leaves the index entry alone
//!   (the decode append keeps it; `tests/gpu_decode.rs`);
//! - pairs of sequences at most `dynamic_min_len` long: index tables untouched (poison).
//!
//! Ignored without a GPU (reported as ignored, never passed); `--ignored` runs them, and there a
//! missing GPU is a failure.

mod common;

use common::{
    check_selection, entry_units, f16_or_bf16, gpu, head_pattern, random_vec, SELECTION_TOL,
};
use std::collections::BTreeMap;

use half::bf16;
use lserve::config::{GqaAggregation, SelectionUnit, SparsityConfig};
use lserve::dtype::Element;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    advance_decode_steps, download_selection, poison_index_tables, reset_selection_state,
    score_pages, select_pages, select_top_k, upload_key_stats, DecodeBatch, DeviceElement,
    DeviceKvCache, GpuContext, SelectWorkspace,
};
use lserve::head_pattern::HeadPattern;
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId, SequenceView};
use lserve::quant::StatsFormat;
use lserve::reference::kv_write::write_tokens;
use lserve::reference::select::select_from_cache;
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const INDEX_POISON: u32 = 0xDEAD_BEEF;
const SCORE_POISON_BITS: u32 = 0x7FC0_DEAD; // a NaN
/// Relative tolerance of raw scores and of near-ties.

#[derive(Debug, Clone)]
struct Case {
    head_dim: usize,
    kv_heads: usize,
    group: usize,
    /// `[layer][kv_head]`: streaming?
    streaming: Vec<Vec<bool>>,
    page_tokens: usize,
    logical_per_page: usize,
    top_k: usize,
    dynamic_min_len: usize,
    reuse: usize,
    always_first: bool,
    mean: bool,
    prompts: Vec<usize>,
    steps: usize,
    f16: bool,
    /// Selection from 8-bit statistics.
    q8: bool,
    /// Logical-page selection, where the logical pages are whole decode tiles (else physical
    /// pages are selected).
    logical: bool,
    seed: u64,
}

impl Case {
    /// The selection unit: logical pages when asked and they are whole 16-row decode tiles.
    fn selection_unit(&self) -> SelectionUnit {
        if self.logical && (self.page_tokens / self.logical_per_page) % 16 == 0 {
            SelectionUnit::LogicalPage
        } else {
            SelectionUnit::PhysicalPage
        }
    }
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(64usize), Just(128)],
        1usize..=4,
        // Every GQA group the scorer is built for, the non-powers of two included.
        1usize..=ModelGeometry::MAX_GROUP,
        1usize..=2,
    )
        .prop_flat_map(|(head_dim, kv_heads, group, layers)| {
            (
                Just((head_dim, kv_heads, group)),
                prop::collection::vec(prop::collection::vec(any::<bool>(), kv_heads), layers),
                (
                    prop_oneof![Just(16usize), Just(32), Just(64)],
                    prop_oneof![Just(1usize), Just(2), Just(4), Just(8), Just(16)],
                    1usize..=8,
                ),
                (
                    0usize..=400,
                    prop_oneof![Just(1usize), Just(4)],
                    any::<bool>(),
                    any::<bool>(),
                    any::<bool>(),
                ),
                (
                    prop::collection::vec(1usize..=1500, 1..=8),
                    1usize..=6,
                    any::<bool>(),
                    any::<bool>(),
                    any::<u64>(),
                ),
            )
        })
        .prop_map(
            |(
                (head_dim, kv_heads, group),
                streaming,
                (page_tokens, lpp, top_k),
                (dynamic_min_len, reuse, always_first, mean, logical),
                (prompts, steps, f16, q8, seed),
            )| Case {
                head_dim,
                kv_heads,
                group,
                streaming,
                page_tokens,
                logical_per_page: lpp.min(page_tokens),
                top_k,
                dynamic_min_len,
                reuse,
                always_first,
                mean,
                prompts,
                steps,
                f16,
                q8,
                logical,
                seed,
            },
        )
}

/// Keys `[n][Hkv][D]` near a per-head mean (`means[h]`): pages differ, and scores take both
/// signs (so a page counting a zero or garbage statistics row would show).
fn keys_near<E: Element>(rng: &mut StdRng, means: &[Vec<f32>], n: usize, spread: f32) -> Vec<E> {
    let mut out = Vec::with_capacity(n * means.len() * means[0].len());
    for _ in 0..n {
        for m in means {
            out.extend(
                m.iter()
                    .map(|&x| E::from_f32(x + spread * rng.gen_range(-1.0f32..1.0))),
            );
        }
    }
    out
}

/// Sets the statistics rows of the logical pages past `view.len` in the sequence's last
/// physical page to a wide range (`[-50, 50]`): a scorer that read them would score the page
/// far higher than the reference.
fn poison_missing_stats<E: Element>(host: &mut HostKvCache<E>, layer: usize, view: &SequenceView) {
    let c = *host.config();
    let (n_p, n_l) = (c.page_tokens, c.logical_page_tokens);
    let last = view.len.div_ceil(n_p) - 1;
    let page = view.block_table.physical(last).unwrap();
    for logical in view.len.div_ceil(n_l)..(last + 1) * n_p / n_l {
        for head in 0..host.pattern().dense_heads(layer) {
            let (lo, hi) = host
                .dense_mut(layer)
                .unwrap()
                .stats_mut(page, head, logical % (n_p / n_l))
                .unwrap();
            lo.iter_mut().for_each(|x| *x = E::from_f32(-50.0));
            hi.iter_mut().for_each(|x| *x = E::from_f32(50.0));
        }
    }
}

/// Checks the raw scores of a due pair (`row` is its `max_pages` scores).
fn check_scores(row: &[f32], want: &[f64]) -> Result<(), String> {
    let scale = want.iter().fold(0.0f64, |m, s| m.max(s.abs()));
    for (p, (&g, &w)) in row.iter().zip(want).enumerate() {
        let g = g as f64;
        if g.is_nan() || (g - w).abs() > SELECTION_TOL * w.abs().max(scale) {
            return Err(format!("page {p}: GPU score {g}, reference {w}"));
        }
    }
    if let Some(p) = row[want.len()..]
        .iter()
        .position(|s| s.to_bits() != SCORE_POISON_BITS)
    {
        return Err(format!(
            "score written past the sequence's pages (page {})",
            want.len() + p
        ));
    }
    Ok(())
}

/// The GPU-side selection state the test expects: per (sequence, layer, dense head) the held
/// selection (logical pages), from the GPU's own due steps.
type Held = BTreeMap<(u32, usize, usize), Vec<u32>>;

#[allow(clippy::too_many_arguments)]
fn run_step<E: DeviceElement>(
    gpu: &GpuContext,
    mgr: &KvCacheManager,
    host: &HostKvCache<E>,
    cache: &mut DeviceKvCache<E>,
    ws: &mut SelectWorkspace,
    batch: &mut DecodeBatch,
    seqs: &[SeqId],
    steps: &BTreeMap<u32, u32>,
    held: &mut Held,
    rng: &mut StdRng,
) -> Result<(), String> {
    let g = *mgr.geometry();
    let config = *mgr.config();
    let (hq, d, group) = (g.q_heads(), g.head_dim(), g.group());
    let pattern = mgr.pattern();
    let q: Vec<E> = random_vec(rng, seqs.len() * hq * d);
    let q_dev = gpu.stream().clone_htod(&q).map_err(|e| e.to_string())?;
    batch
        .set(gpu, mgr, cache, seqs)
        .map_err(|e| e.to_string())?;
    for layer in 0..g.layers() {
        ws.poison(gpu, f32::from_bits(SCORE_POISON_BITS))
            .map_err(|e| e.to_string())?;
        poison_index_tables(gpu, cache, layer, INDEX_POISON).map_err(|e| e.to_string())?;
        // The two halves, so the scores can be read in between.
        score_pages(gpu, cache, layer, batch, &q_dev, ws).map_err(|e| e.to_string())?;
        let scores = ws.download_scores(gpu).map_err(|e| e.to_string())?;
        select_top_k(gpu, cache, layer, batch, ws).map_err(|e| e.to_string())?;
        let state = download_selection(gpu, cache, layer).map_err(|e| e.to_string())?;
        let hd = pattern.dense_heads(layer);
        let upp = config.units_per_page() as u32;
        let max_units = mgr.max_pages_per_seq() * upp as usize;
        for (b, &seq) in seqs.iter().enumerate() {
            let view = mgr.view(seq).map_err(|e| e.to_string())?;
            let slot = view.slot as usize;
            let step = steps[&seq.get()];
            for dh in 0..hd {
                let kv_head = pattern.dense_kv_head(layer, dh);
                let at = |what: &str| {
                    format!(
                        "layer {layer} seq {} (b {b}, slot {slot}, L {}) dense head {dh} \
                         step {step}: {what}",
                        seq.get(),
                        view.len
                    )
                };
                let row = &scores[(b * hd + dh) * max_units..][..max_units];
                let entry = slot * hd + dh;
                let index_len = state.index_lens[entry];
                let index = &state.index_pages[entry * state.entry_capacity..]
                    [..(index_len as usize).min(state.entry_capacity)];
                let key = (seq.get(), layer, dh);
                if !config.uses_page_selection(view.len) {
                    if index_len != INDEX_POISON
                        || index.iter().any(|&p| p != INDEX_POISON)
                        || row.iter().any(|s| s.to_bits() != SCORE_POISON_BITS)
                    {
                        return Err(at("dense decode, but the tables or scores were written"));
                    }
                    continue;
                }
                let due = (step as usize).is_multiple_of(config.reuse_interval)
                    || !held.contains_key(&key);
                let held_now = &state.held_pages[entry * state.held_capacity..]
                    [..state.held_lens[entry] as usize];
                if due {
                    if index_len as usize > state.entry_capacity {
                        return Err(at(&format!("index length {index_len:#x}")));
                    }
                    let logical = entry_units(view.block_table.pages(), index, upp);
                    if let Some(i) = logical.iter().position(|&u| u == u32::MAX) {
                        let p = index[i] / upp;
                        return Err(at(&format!("page {p:#x} not in the block table")));
                    }
                    let q_group: Vec<f32> = q[(b * hq + kv_head * group) * d..][..group * d]
                        .iter()
                        .map(|x| x.to_f32())
                        .collect();
                    let want = select_from_cache(host, layer, &view, kv_head, &q_group)
                        .map_err(|e| e.to_string())?;
                    check_scores(row, &want.physical_scores).map_err(|e| at(&e))?;
                    check_selection(
                        &logical,
                        &want,
                        config.pages_per_selection(),
                        config.always_include_first_page,
                    )
                    .map_err(|e| at(&e))?;
                    if held_now != logical.as_slice() {
                        return Err(at(&format!("held {held_now:?}, index {logical:?}")));
                    }
                    held.insert(key, logical);
                } else {
                    if row.iter().any(|s| s.to_bits() != SCORE_POISON_BITS) {
                        return Err(at("reused step, but the scorer wrote scores"));
                    }
                    let want = &held[&key];
                    if held_now != want.as_slice() {
                        return Err(at(&format!("held changed: {held_now:?} vs {want:?}")));
                    }
                    // The decode append keeps a reusing pair's entry (tests/gpu_decode.rs).
                    if index_len != INDEX_POISON || index.iter().any(|&p| p != INDEX_POISON) {
                        return Err(at("reused step, but the selector wrote the index entry"));
                    }
                }
            }
        }
    }
    advance_decode_steps(gpu, cache, batch).map_err(|e| e.to_string())?;
    let state = download_selection(gpu, cache, 0).map_err(|e| e.to_string())?;
    for &seq in seqs {
        let slot = mgr.slot(seq).map_err(|e| e.to_string())? as usize;
        if state.decode_steps[slot] != steps[&seq.get()] + 1 {
            return Err(format!(
                "slot {slot}: step counter {}, want {}",
                state.decode_steps[slot],
                steps[&seq.get()] + 1
            ));
        }
    }
    Ok(())
}

fn run_case<E: DeviceElement>(gpu: &GpuContext, case: &Case) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let layers = case.streaming.len();
    let geometry = ModelGeometry::new(
        layers,
        case.kv_heads * case.group,
        case.kv_heads,
        case.head_dim,
    )
    .unwrap();
    let pattern = head_pattern(geometry, &case.streaming);
    let config = SparsityConfig {
        sink_tokens: 4,
        local_tokens: 16,
        page_tokens: case.page_tokens,
        logical_page_tokens: case.page_tokens / case.logical_per_page,
        token_budget: case.top_k * case.page_tokens,
        reuse_interval: case.reuse,
        dynamic_min_len: case.dynamic_min_len,
        gqa_aggregation: if case.mean {
            GqaAggregation::Mean
        } else {
            GqaAggregation::Max
        },
        always_include_first_page: case.always_first,
        softmax_scale: None,
        stats_format: if case.q8 {
            StatsFormat::DEVICE_INT8
        } else {
            StatsFormat::Half
        },
        selection_unit: case.selection_unit(),
    };
    let batch = case.prompts.len();
    let max_len = case.prompts.iter().max().unwrap() + case.steps;
    let filler_tokens = (rng.gen_range(1..=8) * case.page_tokens).min(max_len);
    let capacity =
        batch * max_len.div_ceil(case.page_tokens) + filler_tokens.div_ceil(case.page_tokens);
    let mut mgr =
        KvCacheManager::new(geometry, pattern, config, capacity, batch + 1, max_len).unwrap();
    let (hkv, d) = (geometry.kv_heads(), geometry.head_dim());

    // A filler sequence takes the first pages and is freed later: physical ids start anywhere
    // and come back in the pool's order; prompts grow in interleaved random chunks.
    let filler = mgr.add_sequence().unwrap();
    mgr.reserve(filler, filler_tokens).unwrap();
    let mut seqs: Vec<SeqId> = (0..batch).map(|_| mgr.add_sequence().unwrap()).collect();
    let mut left = case.prompts.clone();
    let mut freed = false;
    while left.iter().any(|&n| n > 0) {
        let b = rng.gen_range(0..batch);
        if left[b] == 0 {
            continue;
        }
        let n = rng.gen_range(1..=left[b]);
        left[b] -= n;
        mgr.reserve(seqs[b], n).unwrap();
        if !freed && rng.gen_bool(0.3) {
            mgr.free_sequence(filler).unwrap();
            freed = true;
        }
    }
    if !freed {
        mgr.free_sequence(filler).unwrap();
    }
    let mut host = HostKvCache::<E>::for_manager(&mgr).unwrap();
    let means: Vec<Vec<Vec<f32>>> = (0..batch)
        .map(|_| {
            (0..hkv)
                .map(|_| (0..d).map(|_| rng.gen_range(-1.0f32..1.0)).collect())
                .collect()
        })
        .collect();
    for (b, &seq) in seqs.iter().enumerate() {
        let view = mgr.view(seq).unwrap();
        for layer in 0..layers {
            let k = keys_near::<E>(&mut rng, &means[b], view.len, 0.3);
            let v = random_vec::<E>(&mut rng, view.len * hkv * d);
            write_tokens(&mut host, layer, &view, 0, &k, &v).unwrap();
            poison_missing_stats(&mut host, layer, &view);
        }
    }

    let index = IndexTables::for_manager(&mgr).unwrap();
    let mut cache = DeviceKvCache::upload(gpu, &mgr, &host, &index).unwrap();
    for &seq in &seqs {
        reset_selection_state(gpu, &mut cache, mgr.slot(seq).unwrap()).unwrap();
    }
    let mut ws = SelectWorkspace::new(gpu, &cache, batch).unwrap();
    let mut batch_dev = DecodeBatch::new(gpu, batch).unwrap();
    let mut steps: BTreeMap<u32, u32> = seqs.iter().map(|s| (s.get(), 0)).collect();
    let mut held = Held::new();
    for _ in 0..case.steps {
        // The step's token, on the host; then statistics and tables to the device.
        for (b, &seq) in seqs.iter().enumerate() {
            mgr.reserve(seq, 1).unwrap();
            let view = mgr.view(seq).unwrap();
            for layer in 0..layers {
                let k = keys_near::<E>(&mut rng, &means[b], 1, 0.3);
                let v = random_vec::<E>(&mut rng, hkv * d);
                write_tokens(&mut host, layer, &view, view.len - 1, &k, &v).unwrap();
                poison_missing_stats(&mut host, layer, &view);
            }
        }
        upload_key_stats(gpu, &mut cache, &host).unwrap();
        seqs.shuffle(&mut rng); // batch order is not slot order
        run_step(
            gpu,
            &mgr,
            &host,
            &mut cache,
            &mut ws,
            &mut batch_dev,
            &seqs,
            &steps,
            &mut held,
            &mut rng,
        )?;
        // The manager's counters advance with the device's (the batch of the next step writes
        // the manager's into the device where they differ).
        for &seq in &seqs {
            mgr.advance_decode_step(seq).unwrap();
        }
        steps.values_mut().for_each(|s| *s += 1);
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn selection_matches_reference() {
    let gpu = gpu();
    let mut runner = TestRunner::new(ProptestConfig::default());
    runner
        .run(&case_strategy(), |case| {
            f16_or_bf16!(case.f16, run_case(&gpu, &case)).map_err(TestCaseError::fail)
        })
        .unwrap();
}

/// Reuse 4 over many steps, all heads past `dynamic_min_len`: the selector writes the held
/// selections and index tables only on steps 0, 4, 8 and 12 (the third run selects 16-token
/// logical pages of 64-token pages).
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn reuse_four_changes_tables_only_on_due_steps() {
    let gpu = gpu();
    for (seed, group, logical) in [(1u64, 4usize, false), (2, 1, false), (3, 3, true)] {
        let case = Case {
            head_dim: 128,
            kv_heads: 2,
            group,
            streaming: vec![vec![false, true]],
            page_tokens: if logical { 64 } else { 16 },
            logical_per_page: 4,
            top_k: 3,
            dynamic_min_len: 0,
            reuse: 4,
            always_first: true,
            mean: false,
            prompts: vec![200, 37, 95],
            steps: 13,
            f16: false,
            q8: seed == 2,
            logical,
            seed,
        };
        run_case::<bf16>(&gpu, &case).unwrap();
    }
}

/// Every (head dim, GQA group, element type) the geometry accepts, with both aggregations over
/// the group and both statistics formats: the scores of every physical page and the selections
/// against the reference. Three
/// KV heads (two dense) over two layers, several sequences past `dynamic_min_len`.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn every_group_and_head_dim_scores_like_the_reference() {
    let gpu = gpu();
    for head_dim in ModelGeometry::SUPPORTED_HEAD_DIMS {
        for group in 1..=ModelGeometry::MAX_GROUP {
            for (use_f16, mean, q8) in [
                (false, false, false),
                (false, true, false),
                (true, false, false),
                (true, true, false),
                (false, false, true),
                (true, true, true),
            ] {
                let case = Case {
                    head_dim,
                    kv_heads: 3,
                    group,
                    streaming: vec![vec![false, true, false], vec![true, false, false]],
                    page_tokens: 32,
                    logical_per_page: 4,
                    top_k: 3,
                    dynamic_min_len: 64,
                    reuse: 1,
                    always_first: true,
                    mean,
                    prompts: vec![300, 97, 1025],
                    steps: 2,
                    f16: use_f16,
                    q8,
                    logical: false,
                    seed: (head_dim * 100 + group * 10 + 2 * use_f16 as usize + mean as usize)
                        as u64,
                };
                if let Err(e) = f16_or_bf16!(use_f16, run_case(&gpu, &case)) {
                    panic!("D {head_dim} group {group} f16 {use_f16} mean {mean} q8 {q8}: {e}");
                }
            }
        }
    }
}

/// Many candidates (pages of 16 tokens, one logical page each), statistics from eight distinct
/// rows so that scores tie exactly: the top-K must be exactly the reference's (ties to the lower
/// page), and so must every score.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn many_candidates_with_exact_ties() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(7);
    let geometry = ModelGeometry::new(1, 1, 1, 64).unwrap();
    // 16384 candidates (past the 4096 the selector keeps in registers, so it re-reads), and
    // 4092-4097 around that limit (it holds a thread's run from a 16-byte boundary, so the limit
    // moves with the alignment of candidate 0: `always_first` shifts it by one).
    let cases = [16386usize, 4094, 4095, 4096, 4097, 4098]
        .into_iter()
        .flat_map(|pages| {
            [(64usize, true), (5, false), (700, true)]
                .into_iter()
                .map(move |(top_k, always_first)| (pages, top_k, always_first))
        });
    for (pages, top_k, always_first) in cases {
        let len = (pages - 1) * 16 + 5;
        let config = SparsityConfig {
            sink_tokens: 4,
            local_tokens: 16,
            page_tokens: 16,
            logical_page_tokens: 16,
            token_budget: top_k * 16,
            reuse_interval: 1,
            dynamic_min_len: 0,
            always_include_first_page: always_first,
            ..Default::default()
        };
        let pattern = HeadPattern::all_dense(geometry);
        let mut mgr = KvCacheManager::new(geometry, pattern, config, pages + 3, 2, len).unwrap();
        let filler = mgr.add_sequence().unwrap();
        mgr.reserve(filler, 3 * 16).unwrap();
        let seq = mgr.add_sequence().unwrap();
        mgr.reserve(seq, 100).unwrap();
        mgr.free_sequence(filler).unwrap();
        mgr.reserve(seq, len - 100).unwrap();
        let mut host = HostKvCache::<bf16>::for_manager(&mgr).unwrap();
        let rows: Vec<(Vec<bf16>, Vec<bf16>)> = (0..8)
            .map(|_| {
                let lo: Vec<f32> = (0..64).map(|_| rng.gen_range(-1.0f32..0.5)).collect();
                let hi: Vec<f32> = lo.iter().map(|&x| x + rng.gen_range(0.0f32..0.5)).collect();
                (
                    lo.iter().map(|&x| bf16::from_f32(x)).collect(),
                    hi.iter().map(|&x| bf16::from_f32(x)).collect(),
                )
            })
            .collect();
        {
            let view = mgr.view(seq).unwrap();
            for p in 0..pages {
                let page = view.block_table.physical(p).unwrap();
                let (lo, hi) = &rows[rng.gen_range(0..8)];
                let (kmin, kmax) = host.dense_mut(0).unwrap().stats_mut(page, 0, 0).unwrap();
                kmin.copy_from_slice(lo);
                kmax.copy_from_slice(hi);
            }
        }
        let index = IndexTables::for_manager(&mgr).unwrap();
        let mut cache = DeviceKvCache::upload(&gpu, &mgr, &host, &index).unwrap();
        let mut ws = SelectWorkspace::new(&gpu, &cache, 1).unwrap();
        let mut batch = DecodeBatch::new(&gpu, 1).unwrap();
        batch.set(&gpu, &mgr, &mut cache, &[seq]).unwrap();
        let q: Vec<bf16> = random_vec(&mut rng, 64);
        let q_dev = gpu.stream().clone_htod(&q).unwrap();
        ws.poison(&gpu, f32::from_bits(SCORE_POISON_BITS)).unwrap();
        poison_index_tables(&gpu, &mut cache, 0, INDEX_POISON).unwrap();
        select_pages(&gpu, &mut cache, 0, &batch, &q_dev, &mut ws).unwrap();
        let scores = ws.download_scores(&gpu).unwrap();
        let state = download_selection(&gpu, &cache, 0).unwrap();
        let view = mgr.view(seq).unwrap();
        let q32: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
        let want = select_from_cache(&host, 0, &view, 0, &q32).unwrap();
        check_scores(&scores[..mgr.max_pages_per_seq()], &want.physical_scores).unwrap();
        // Equal rows give bit-equal GPU scores; distinct rows are far apart: exact match.
        let slot = view.slot as usize;
        let n = state.index_lens[slot] as usize;
        let got: Vec<u32> = state.index_pages[slot * state.entry_capacity..][..n].to_vec();
        let want_physical: Vec<u32> = want
            .pages
            .iter()
            .map(|&p| view.block_table.physical(p as usize).unwrap())
            .collect();
        assert_eq!(
            got, want_physical,
            "{pages} pages, top {top_k}, always first {always_first}"
        );
    }
}
