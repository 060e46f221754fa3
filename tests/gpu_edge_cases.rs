//! Numerical edge cases on the GPU (`docs/ARCHITECTURE.md`, "Non-finite and extreme inputs")
//! against the CPU reference, the cases of `tests/numerical_edge_cases.rs` where a GPU path
//! exists:
//! - queries and keys of large magnitude through a decode step with selection (|x| up to 6e4)
//!   and prefill (|x| up to 3e3: scaled logits up to 1e8, inside prefill's `2^30`), bf16 and
//!   f16: finite outputs that match the reference; two top keys of scaled logits 7.7e7, one f32
//!   step apart, in different KV blocks weigh as the reference says;
//! - all-equal page scores: the device's top-K takes the lowest pages, exactly the reference's;
//! - one-token pages: a typed error from the device cache (its pages are whole decode tiles);
//!   one-token logical pages decode and select as the reference;
//! - one-token sequences: prefill, and the first decode step of an empty sequence;
//! - NaN in keys, values and queries, in prefill and in a decode step: the non-finite outputs
//!   are exactly the reference's (the rows that attend the poisoned row), every other output
//!   matches the reference; in prefill, query rows of the poisoned (sequence, KV group) that are
//!   masked from the poisoned key but share its 128-query tile may also turn NaN (allowed, not
//!   required).
//!
//! Each decode step runs whole on the device (`DecodeStep`: append, selection when due,
//! attention); its selection is checked against the reference's (near-ties allowed, `tests/common`
//! `check_selection`) and its output against the reference attending the device's index tables.
//!
//! Ignored without a GPU (reported as ignored, never passed); `--ignored` runs them, and there a
//! missing GPU is a failure.

mod common;

use common::{check_selection, gpu, head_kinds, head_pattern, prefilled, tolerance};
use half::{bf16, f16};
use lserve::config::{GqaAggregation, SparsityConfig};
use lserve::dtype::Element;
use lserve::geometry::ModelGeometry;
use lserve::gpu::PrefillArgs;
use lserve::gpu::{prefill_attention, DecodeStep, DeviceElement, DeviceKvCache, GpuContext};
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId};
use lserve::reference::decode::{decode_attention_tables, decode_step};
use lserve::reference::prefill::PrefillInput;
use lserve::reference::select::{select_from_cache, ReuseState};
use lserve::reference::{self, TokenPattern};
use lserve::LserveError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const D: usize = 64;

/// Query rows of the unmasked prefill kernel's tile (`lserve_abi::prefill::TILE_Q`): the rows
/// computed against the same K/V tiles.
const PREFILL_TILE_Q: usize = 128;

/// `n` values of magnitude `10^3 ..= 6e4` (log-uniform), random sign.
fn large_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    large_vec_in(rng, n, 3.0..4.778)
}

/// `n` values of magnitude `10^e` for `e` uniform in `exponents`, random sign.
fn large_vec_in(rng: &mut StdRng, n: usize, exponents: core::ops::Range<f32>) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let m = 10f32.powf(rng.gen_range(exponents.clone()));
            if rng.gen() {
                m
            } else {
                -m
            }
        })
        .collect()
}

/// `n` values uniform in `[-1, 1)`.
fn unit_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

fn rounded<E: Element>(xs: &[f32]) -> Vec<E> {
    xs.iter().map(|&x| E::from_f32(x)).collect()
}

/// Compares one output row with the reference's: the same coordinates are NaN, the same are
/// infinite (same sign), and the finite ones agree by relative error under the element type's
/// tolerance. Returns the reason it does not.
fn row_matches<E: Element>(got: &[E], want: &[f64]) -> Result<(), String> {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (c, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32() as f64;
        if g.is_nan() != w.is_nan() || (g.is_infinite() || w.is_infinite()) && g != w {
            return Err(format!("channel {c}: GPU {g}, reference {w}"));
        }
        if w.is_finite() {
            diff += (g - w) * (g - w);
            norm += w * w;
        }
    }
    let err = (diff / norm.max(1e-30)).sqrt();
    let tol = tolerance::<E>();
    if err < tol {
        Ok(())
    } else {
        Err(format!("relative error {err:.3e} (tolerance {tol:.0e})"))
    }
}

/// A one-layer model whose prompts are on the host: KV heads of the given kinds (`true`:
/// streaming), `group` query heads each, sequence `b` prefilled with `prompts[b]` tokens whose
/// keys and values come from `kv(b, pos)` (`[Hkv][D]` each, as `f32`).
struct Model<E> {
    config: SparsityConfig,
    mgr: KvCacheManager,
    host: HostKvCache<E>,
    tables: IndexTables,
    reuse: ReuseState,
    seqs: Vec<SeqId>,
}

fn model<E: DeviceElement>(
    streaming: &[bool],
    group: usize,
    config: SparsityConfig,
    prompts: &[usize],
    kv: impl FnMut(usize, usize) -> (Vec<f32>, Vec<f32>),
) -> Model<E> {
    let hkv = streaming.len();
    let g = ModelGeometry::new(1, hkv * group, hkv, D).unwrap();
    let pattern = head_pattern(g, &[streaming.to_vec()]);
    let max_len = prompts.iter().max().unwrap() + 8;
    let p = prefilled::<E>(pattern, config, prompts, max_len, 2, kv);
    Model {
        config,
        mgr: p.mgr,
        host: p.host,
        tables: p.tables,
        reuse: p.reuse,
        seqs: p.seqs,
    }
}

/// What one decode step gave on the device and what the reference expects of it.
struct StepResult<E> {
    /// The device's output, `[B][Hq][D]`.
    got: Vec<E>,
    /// The reference attending the device's selections: its own index tables with the entries of
    /// the sequences past `dynamic_min_len` taken from the device's.
    want: Vec<f64>,
    /// The reference's own output.
    reference: Vec<f64>,
    /// The device's index tables after the step.
    gpu_tables: IndexTables,
}

impl<E: DeviceElement> Model<E> {
    /// One whole decode step on the device (`DecodeStep`, layer 0) and the reference step on the
    /// same inputs (`f32`, rounded to `E`). Checks the device's selection against the
    /// reference's (near-ties allowed).
    fn step(&mut self, gpu: &GpuContext, q: &[f32], k: &[f32], v: &[f32]) -> StepResult<E> {
        let (q, k, v) = (rounded::<E>(q), rounded::<E>(k), rounded::<E>(v));
        let g = *self.mgr.geometry();
        let stream = gpu.stream().clone();
        let mut cache = DeviceKvCache::upload(gpu, &self.mgr, &self.host, &self.tables).unwrap();
        let mut step = DecodeStep::new(gpu, &cache, self.seqs.len()).unwrap();
        let q_dev = stream.clone_htod(&q).unwrap();
        let k_dev = stream.clone_htod(&k).unwrap();
        let v_dev = stream.clone_htod(&v).unwrap();
        // Poisoned with a finite value: a NaN the device writes is its own.
        let mut out = stream
            .clone_htod(&vec![E::from_f32(12345.0); q.len()])
            .unwrap();
        let mut plan = step
            .plan(gpu, &mut self.mgr, &mut cache, &self.seqs)
            .unwrap();
        let reference_step = decode_step(
            plan.manager(),
            &mut self.host,
            &mut self.tables,
            &mut self.reuse,
            0,
            &self.seqs,
            &q,
            &k,
            &v,
        )
        .unwrap();
        plan.layer(gpu, &mut cache, 0, &q_dev, &k_dev, &v_dev, &mut out)
            .unwrap();
        plan.finish(gpu, &mut cache).unwrap();
        let got: Vec<E> = stream.clone_dtoh(&out).unwrap();
        let mut gpu_host = HostKvCache::<E>::for_manager(&self.mgr).unwrap();
        let mut gpu_tables = IndexTables::for_manager(&self.mgr).unwrap();
        cache.download(gpu, &mut gpu_host, &mut gpu_tables).unwrap();

        let pattern = self.mgr.pattern().clone();
        let group = g.group();
        // Below `dynamic_min_len` the device reads the block table and leaves the entry alone.
        let mut device_selections = self.tables.clone();
        for (b, &s) in self.seqs.iter().enumerate() {
            let view = self.mgr.view(s).unwrap();
            if !self.config.uses_page_selection(view.len) {
                continue;
            }
            for &h in pattern.dense_kv_heads(0) {
                let dh = pattern.compact_index(0, h);
                let got_pages = gpu_tables.get(0, view.slot as usize, dh).unwrap();
                let want_pages = self.tables.get(0, view.slot as usize, dh).unwrap();
                if got_pages == want_pages {
                    continue;
                }
                device_selections
                    .set(0, view.slot as usize, dh, got_pages)
                    .unwrap();
                let q_group: Vec<f32> = q[(b * g.q_heads() + h * group) * D..][..group * D]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let sel = select_from_cache(&self.host, 0, &view, h, &q_group).unwrap();
                let logical: Vec<u32> = got_pages
                    .iter()
                    .map(|x| {
                        let pages = view.block_table.pages();
                        pages.iter().position(|y| y == x).unwrap_or(usize::MAX) as u32
                    })
                    .collect();
                let near_tie = check_selection(
                    &logical,
                    &sel,
                    self.config.pages_per_selection(),
                    self.config.always_include_first_page,
                );
                assert!(
                    near_tie.is_ok(),
                    "seq {b}, head {h}: GPU pages {got_pages:?}, reference {want_pages:?}: {near_tie:?}"
                );
            }
        }
        let want =
            decode_attention_tables(&self.mgr, &self.host, &device_selections, 0, &self.seqs, &q)
                .unwrap();
        StepResult {
            got,
            want,
            reference: reference_step.out,
            gpu_tables,
        }
    }
}

/// Asserts every `[B][Hq]` row of a step matches the reference (`row_matches`).
fn assert_rows_match<E: Element>(got: &[E], want: &[f64], q_heads: usize, what: &str) {
    for (r, (g, w)) in got.chunks(D).zip(want.chunks(D)).enumerate() {
        if let Err(e) = row_matches(g, w) {
            panic!(
                "{what}: seq {}, query head {}: {e}",
                r / q_heads,
                r % q_heads
            );
        }
    }
}

/// Asserts that the device's index-table entries are the reference's, page for page, for every
/// dense head of every sequence past `dynamic_min_len` (below it the device reads the block
/// table, not the entry).
fn assert_same_entries<E>(m: &Model<E>, gpu_tables: &IndexTables, what: &str) {
    let pattern = m.mgr.pattern();
    for (b, &s) in m.seqs.iter().enumerate() {
        let view = m.mgr.view(s).unwrap();
        if !m.config.uses_page_selection(view.len) {
            continue;
        }
        for &h in pattern.dense_kv_heads(0) {
            let dh = pattern.compact_index(0, h);
            assert_eq!(
                gpu_tables.get(0, view.slot as usize, dh).unwrap(),
                m.tables.get(0, view.slot as usize, dh).unwrap(),
                "{what}: seq {b}, KV head {h}"
            );
        }
    }
}

/// A small paged config: pages of 32 tokens, logical pages of 16, `top_k` pages, selection past
/// `dynamic_min_len`.
fn config(top_k: usize, dynamic_min_len: usize, first: bool) -> SparsityConfig {
    SparsityConfig {
        sink_tokens: 4,
        local_tokens: 16,
        token_budget: top_k * 32,
        page_tokens: 32,
        logical_page_tokens: 16,
        reuse_interval: 4,
        dynamic_min_len,
        gqa_aggregation: GqaAggregation::Max,
        always_include_first_page: first,
        softmax_scale: None,
        stats_format: Default::default(),
        selection_unit: Default::default(),
    }
}

fn large_magnitude_decode<E: DeviceElement>(gpu: &GpuContext, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let prompts = [150, 90];
    let data: Vec<Vec<(Vec<f32>, Vec<f32>)>> = prompts
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| (large_vec(&mut rng, 2 * D), unit_vec(&mut rng, 2 * D)))
                .collect()
        })
        .collect();
    let mut m = model::<E>(&[false, true], 2, config(2, 64, true), &prompts, |b, p| {
        data[b][p].clone()
    });
    let q = large_vec(&mut rng, 2 * 4 * D);
    let k = large_vec(&mut rng, 2 * 2 * D);
    let v = unit_vec(&mut rng, 2 * 2 * D);
    let r = m.step(gpu, &q, &k, &v);
    assert!(r.reference.iter().all(|x| x.is_finite()));
    assert!(r.want.iter().all(|x| x.is_finite()));
    assert_rows_match(
        &r.got,
        &r.want,
        4,
        &format!("{} large magnitudes", E::DTYPE),
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn large_magnitude_decode_step_matches_reference() {
    let gpu = gpu();
    for seed in 0..2 {
        large_magnitude_decode::<bf16>(&gpu, seed);
        large_magnitude_decode::<f16>(&gpu, seed);
    }
}

/// Runs the prefill kernel on `q`, `k`, `v` (`f32`, rounded to `E`) for one layer of KV heads of
/// the given kinds (sink 16, local 64 for streaming ones) and returns the device's output and
/// the reference's on the rounded inputs.
fn prefill_pair<E: DeviceElement>(
    gpu: &GpuContext,
    streaming: &[bool],
    group: usize,
    lens: &[usize],
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> (Vec<E>, Vec<f64>) {
    let (sink, local) = (16, 64);
    let hkv = streaming.len();
    let mut cu = vec![0];
    for &l in lens {
        cu.push(cu.last().unwrap() + l);
    }
    let kinds = head_kinds(streaming);
    let args = PrefillArgs {
        q_heads: hkv * group,
        kv_heads: hkv,
        head_dim: D,
        cu_seqlens: &cu,
        kinds: &kinds,
        sink_tokens: sink,
        local_tokens: local,
        block_masks: None,
        softmax_scale: None,
        prefix_lens: None,
        with_lse: false,
    };
    let (qe, ke, ve) = (rounded::<E>(q), rounded::<E>(k), rounded::<E>(v));
    let s = gpu.stream();
    let q_dev = s.clone_htod(&qe).unwrap();
    let k_dev = s.clone_htod(&ke).unwrap();
    let v_dev = s.clone_htod(&ve).unwrap();
    let mut out = s.clone_htod(&vec![E::from_f32(12345.0); qe.len()]).unwrap();
    prefill_attention(gpu, &args, &q_dev, &k_dev, &v_dev, &mut out).unwrap();
    s.synchronize().unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    let patterns: Vec<TokenPattern> = streaming
        .iter()
        .map(|&st| {
            if st {
                TokenPattern::Lambda {
                    sink_tokens: sink,
                    local_tokens: local,
                }
            } else {
                TokenPattern::Causal
            }
        })
        .collect();
    let f = |xs: &[E]| xs.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let want = reference::prefill::prefill_attention(&PrefillInput {
        cu_seqlens: &cu,
        q: &f(&qe),
        k: &f(&ke),
        v: &f(&ve),
        q_heads: hkv * group,
        kv_heads: hkv,
        head_dim: D,
        patterns: &patterns,
        block_mask: None,
        scale: 1.0 / (D as f64).sqrt(),
    })
    .unwrap()
    .out;
    (got, want)
}

fn large_magnitude_prefill<E: DeviceElement>(gpu: &GpuContext) {
    let mut rng = StdRng::seed_from_u64(21);
    let lens = [1, 100, 200];
    let t: usize = lens.iter().sum();
    // |q · k| <= 64 · 3e3², scaled by log2(e) / 8: below 1.1e8, inside the 2^30 of the prefill
    // softmax (`kernels-gpu/src/prefill/softmax.rs`).
    let q = large_vec_in(&mut rng, t * 4 * D, 2.0..3.477);
    let k = large_vec_in(&mut rng, t * 2 * D, 2.0..3.477);
    let v = unit_vec(&mut rng, t * 2 * D);
    let (got, want) = prefill_pair::<E>(gpu, &[false, true], 2, &lens, &q, &k, &v);
    assert!(want.iter().all(|x| x.is_finite()));
    assert_rows_match(&got, &want, 4, &format!("{} prefill", E::DTYPE));
}

/// Two keys whose scores are `12992 · 32768 ≈ 4.3e8` and one f32 step (32) above it (scaled
/// logits about 7.7e7, weights 1 : 2^5.77), in KV blocks 0 and 1, every other key scoring 0; their
/// values are all `+1` and all `-1`, so a row that sees both outputs the weights' difference. The
/// running maximum moves between the blocks, so the block-0 weight passes through one
/// correction: the kernel's exponents must share one reference across it (the rounding residual
/// of the first maximum is -1.7 in the exponent, which would weigh the first key by 2^-1.7 more).
fn near_tied_large_logits_across_blocks<E: DeviceElement>(gpu: &GpuContext) {
    let len = 128;
    let mut q = vec![0.0f32; len * D];
    let mut k = vec![0.0f32; len * D];
    let mut rng = StdRng::seed_from_u64(22);
    let mut v = unit_vec(&mut rng, len * D);
    for t in 0..len {
        q[t * D] = 12992.0;
        q[t * D + 1] = 1.0;
    }
    for (pos, second, value) in [(10, 0.0, 1.0), (100, 32.0, -1.0)] {
        k[pos * D] = 32768.0;
        k[pos * D + 1] = second;
        v[pos * D..][..D].fill(value);
    }
    let (got, want) = prefill_pair::<E>(gpu, &[false], 1, &[len], &q, &k, &v);
    let w_first = 1.0 / (1.0 + (32.0 * std::f64::consts::LOG2_E / 8.0).exp2());
    assert!((want[127 * D] - (2.0 * w_first - 1.0)).abs() < 1e-9);
    assert_rows_match(
        &got,
        &want,
        1,
        &format!("{} near-tied large logits", E::DTYPE),
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn near_tied_large_logits_across_blocks_match_reference() {
    let gpu = gpu();
    near_tied_large_logits_across_blocks::<bf16>(&gpu);
    near_tied_large_logits_across_blocks::<f16>(&gpu);
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn large_magnitude_prefill_matches_reference() {
    let gpu = gpu();
    large_magnitude_prefill::<bf16>(&gpu);
    large_magnitude_prefill::<f16>(&gpu);
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn all_equal_scores_select_the_lowest_pages_on_the_device() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(4);
    // One key row for every token of every head: every logical page has the same statistics,
    // so every candidate scores the same bits; values random.
    let key = unit_vec(&mut rng, D);
    let keys: Vec<f32> = key.iter().copied().cycle().take(2 * D).collect();
    for (first, mean) in [(true, false), (false, true)] {
        let mut c = config(3, 40, first);
        if mean {
            c.gqa_aggregation = GqaAggregation::Mean;
        }
        let prompts = [300, 161];
        let mut m = model::<bf16>(&[false, false], 3, c, &prompts, |_, _| {
            (keys.clone(), unit_vec(&mut rng, 2 * D))
        });
        let mut rng = StdRng::seed_from_u64(5);
        let q = unit_vec(&mut rng, 2 * 6 * D);
        let v = unit_vec(&mut rng, 2 * 2 * D);
        let k: Vec<f32> = keys.iter().copied().cycle().take(2 * 2 * D).collect();
        let r = m.step(&gpu, &q, &k, &v);
        // The reference takes the lowest candidates (`numerical_edge_cases.rs` checks that); the
        // device's tables must be the same, page for page.
        assert_same_entries(&m, &r.gpu_tables, &format!("first {first}, mean {mean}"));
        for (b, &s) in m.seqs.iter().enumerate() {
            let pages = m.mgr.config().pages_for_len(m.mgr.len(s).unwrap());
            let lo = usize::from(first);
            let mut want: Vec<u32> = (lo..lo + 3).map(|p| p as u32).collect();
            if first {
                want.insert(0, 0);
            }
            want.push(pages as u32 - 1);
            let table = m.mgr.block_table(s).unwrap();
            let physical: Vec<u32> = want
                .iter()
                .map(|&p| table.physical(p as usize).unwrap())
                .collect();
            for h in 0..2 {
                let slot = m.mgr.slot(s).unwrap() as usize;
                assert_eq!(
                    r.gpu_tables.get(0, slot, h).unwrap(),
                    physical,
                    "seq {b}, head {h}"
                );
            }
        }
        assert_rows_match(&r.got, &r.reference, 6, "all-equal scores");
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn one_token_pages_are_a_typed_error_and_one_token_logical_pages_decode() {
    let gpu = gpu();
    // Physical pages of one token: a valid config, but the device cache's pages are whole
    // decode tiles of 16 rows.
    let one = SparsityConfig {
        page_tokens: 1,
        logical_page_tokens: 1,
        token_budget: 4,
        ..config(4, 8, true)
    };
    let m = model::<bf16>(&[false], 2, one, &[20], |_, _| (vec![0.5; D], vec![0.5; D]));
    let field = |r: lserve::Result<DeviceKvCache<bf16>>| match r {
        Err(LserveError::InvalidConfig { field, .. }) => field,
        Err(e) => panic!("not InvalidConfig: {e:?}"),
        Ok(_) => panic!("a device cache of one-token pages"),
    };
    assert_eq!(
        field(DeviceKvCache::upload(&gpu, &m.mgr, &m.host, &m.tables)),
        "page_tokens"
    );
    assert_eq!(field(DeviceKvCache::new(&gpu, &m.mgr)), "page_tokens");

    // Logical pages of one token (16 per physical page): statistics per token, selection over
    // them, as the reference.
    let c = SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 1,
        token_budget: 32,
        ..config(2, 24, true)
    };
    let mut rng = StdRng::seed_from_u64(8);
    let mut m = model::<bf16>(&[false, true], 2, c, &[100, 37], |_, _| {
        (unit_vec(&mut rng, 2 * D), unit_vec(&mut rng, 2 * D))
    });
    let q = unit_vec(&mut rng, 2 * 4 * D);
    let k = unit_vec(&mut rng, 2 * 2 * D);
    let v = unit_vec(&mut rng, 2 * 2 * D);
    let r = m.step(&gpu, &q, &k, &v);
    assert_rows_match(&r.got, &r.want, 4, "one-token logical pages");
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn one_token_sequences_prefill_and_decode() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(2);
    // Prefill: three sequences of one token beside one of 70.
    let lens = [1, 1, 70, 1];
    let t: usize = lens.iter().sum();
    let q = unit_vec(&mut rng, t * 4 * D);
    let k = unit_vec(&mut rng, t * 2 * D);
    let v = unit_vec(&mut rng, t * 2 * D);
    let (got, want) = prefill_pair::<bf16>(&gpu, &[false, true], 2, &lens, &q, &k, &v);
    assert_rows_match(&got, &want, 4, "one-token prefill");
    // A one-token sequence's output is its value row.
    for (tok, head) in [(0, 0), (1, 3), (72, 1)] {
        let out = &want[(tok * 4 + head) * D..][..D];
        let v_row = &v[(tok * 2 + head / 2) * D..][..D];
        for c in 0..D {
            assert_eq!(out[c], bf16::from_f32(v_row[c]).to_f32() as f64);
        }
    }

    // The first decode step of empty sequences (beside one of 5 tokens): attending to every
    // token, and selecting (dynamic_min_len 0: the one page, the newest).
    for dynamic_min_len in [64, 0] {
        let mut m = model::<bf16>(
            &[false, true],
            2,
            config(2, dynamic_min_len, true),
            &[0, 5, 0],
            |_, _| (unit_vec(&mut rng, 2 * D), unit_vec(&mut rng, 2 * D)),
        );
        let q = unit_vec(&mut rng, 3 * 4 * D);
        let k = unit_vec(&mut rng, 3 * 2 * D);
        let v = unit_vec(&mut rng, 3 * 2 * D);
        let r = m.step(&gpu, &q, &k, &v);
        assert_same_entries(&m, &r.gpu_tables, "first decode step");
        assert_rows_match(&r.got, &r.reference, 4, "first decode step");
    }
}

fn nan_decode(gpu: &GpuContext, dynamic_min_len: usize) {
    // KV heads dense, dense, streaming (sink 4, local 16), two query heads each; pages of 32
    // tokens, the first always attended. Poisoned: seq 0, KV head 0, key of token 5 (channel 11;
    // not the first of its logical page, so the statistics ignore it; page 0); seq 0, KV head 1,
    // value of token 70 (channel 4; page 2, attended if selected); seq 1, KV head 1, value of
    // token 20 (channel 7; page 0); seq 1, KV head 2 (streaming), value of its last prompt
    // token (channel 3; in the ring at the step); attending every token, also seq 0's query
    // head 3 (channel 0).
    let prompts = [140, 133];
    let mut rng = StdRng::seed_from_u64(31);
    let mut m = model::<bf16>(
        &[false, false, true],
        2,
        config(2, dynamic_min_len, true),
        &prompts,
        |b, p| {
            let (mut k, mut v) = (unit_vec(&mut rng, 3 * D), unit_vec(&mut rng, 3 * D));
            match (b, p) {
                (0, 5) => k[11] = f32::NAN,
                (0, 70) => v[D + 4] = f32::NAN,
                (1, 20) => v[D + 7] = f32::NAN,
                (1, 132) => v[2 * D + 3] = f32::NAN,
                _ => {}
            }
            (k, v)
        },
    );
    let mut q = unit_vec(&mut rng, 2 * 6 * D);
    let dense = dynamic_min_len > 100;
    if dense {
        q[3 * D] = f32::NAN;
    }
    let k = unit_vec(&mut rng, 2 * 3 * D);
    let v = unit_vec(&mut rng, 2 * 3 * D);
    let r = m.step(gpu, &q, &k, &v);
    // What the reference says (the CPU tests pin it down): seq 0 heads 0, 1 NaN everywhere;
    // seq 1 heads 4, 5 NaN in channel 3, heads 2, 3 in channel 7; attending every token, seq 0
    // head 3 NaN everywhere and head 2 in channel 4.
    let nan_rows = |b: usize, h: usize| {
        r.want[(b * 6 + h) * D..][..D]
            .iter()
            .filter(|x| x.is_nan())
            .count()
    };
    assert_eq!((nan_rows(0, 0), nan_rows(0, 1)), (D, D));
    assert_eq!(
        (
            nan_rows(1, 2),
            nan_rows(1, 3),
            nan_rows(1, 4),
            nan_rows(1, 5)
        ),
        (1, 1, 1, 1)
    );
    if dense {
        assert_eq!((nan_rows(0, 2), nan_rows(0, 3)), (1, D));
    }
    assert_rows_match(
        &r.got,
        &r.want,
        6,
        &format!("NaN, dynamic_min_len {dynamic_min_len}"),
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn nan_in_a_decode_step_stays_in_the_rows_that_attend_it() {
    let gpu = gpu();
    nan_decode(&gpu, 1000); // every token attended
    nan_decode(&gpu, 16); // selection
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn nan_in_prefill_stays_in_its_sequence_and_kv_group() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(41);
    let lens = [100, 70, 130];
    let cu = [0, 100, 170, 300];
    let (hq, hkv) = (4, 2);
    let t = cu[3];
    let mut q = unit_vec(&mut rng, t * hq * D);
    let mut k = unit_vec(&mut rng, t * hkv * D);
    let mut v = unit_vec(&mut rng, t * hkv * D);
    // (sequence, token, KV head) of each poisoned key or value: seq 0's key 80 (KV head 0),
    // seq 1's first value (KV head 1: right after seq 0's last token in the packed batch),
    // seq 2's last key (KV head 1); and seq 2's query 3 of head 0.
    let poisoned = [(0, 80, 0), (1, 0, 1), (2, 129, 1)];
    k[((cu[0] + 80) * hkv) * D + 1] = f32::NAN;
    v[((cu[1]) * hkv + 1) * D + 5] = f32::NAN;
    k[((cu[2] + 129) * hkv + 1) * D + 9] = f32::NAN;
    q[((cu[2] + 3) * hq) * D + 2] = f32::NAN;
    let (got, want) = prefill_pair::<bf16>(&gpu, &[false, false], 2, &lens, &q, &k, &v);
    let tile = PREFILL_TILE_Q;
    for b in 0..lens.len() {
        for i in 0..lens[b] {
            for h in 0..hq {
                // Masked from a poisoned row of its group but in the same 128-query tile: the
                // device may write NaN there (a zero weight times NaN).
                let free = poisoned
                    .iter()
                    .any(|&(pb, j, g)| pb == b && g == h / 2 && i < j && i >= j / tile * tile);
                if free {
                    continue;
                }
                let row = ((cu[b] + i) * hq + h) * D;
                if let Err(e) = row_matches(&got[row..row + D], &want[row..row + D]) {
                    panic!("seq {b}, token {i}, head {h}: {e}");
                }
            }
        }
    }
    // The reference's NaN rows: seq 0 tokens 80.. of heads 0, 1; seq 1 channel 5 of heads 2, 3;
    // seq 2 token 129 of heads 2, 3 and token 3 of head 0.
    let nan = |b: usize, i: usize, h: usize| {
        want[((cu[b] + i) * hq + h) * D..][..D]
            .iter()
            .filter(|x| x.is_nan())
            .count()
    };
    assert_eq!(
        (nan(0, 79, 0), nan(0, 80, 0), nan(0, 99, 1), nan(0, 99, 2)),
        (0, D, D, 0)
    );
    assert_eq!((nan(1, 0, 2), nan(1, 69, 3), nan(1, 69, 1)), (1, 1, 0));
    assert_eq!(
        (nan(2, 129, 2), nan(2, 128, 3), nan(2, 3, 0), nan(2, 3, 1)),
        (D, 0, D, 0)
    );
}
