//! Numerical edge cases of the CPU reference (`docs/ARCHITECTURE.md`, "Semantics pinned down
//! here", "Non-finite and extreme inputs"):
//! - queries and keys of large magnitude (|x| up to 6e4, the f16 range): softmax stays finite and
//!   every output is a convex combination of the attended values;
//! - all-equal page scores: ties go to the lower page index;
//! - pages of one token (a valid config: selection then ranks single tokens by `q · k`);
//! - sequences of one token (prefill, the first decode step);
//! - an empty selection budget (`token_budget == 0`: a typed error; `K = 0` on plain slices: only
//!   the mandatory pages);
//! - NaN and infinities in queries, keys and values: what becomes non-finite (the rows that
//!   attend the poisoned row, nothing else), how key statistics and page scores treat NaN.
//!
//! Expected values come from hand-derived formulas or from independent runs (a clean twin of a
//! poisoned input), never from a recorded run.

mod common;

use common::{head_pattern, prefilled, Prefilled};
use half::bf16;
use lserve::config::{GqaAggregation, SparsityConfig};
use lserve::dtype::Element;
use lserve::geometry::ModelGeometry;
use lserve::paging::KvCacheManager;
use lserve::reference::decode::{
    attend_tokens, decode_attention, decode_step, DecodeStepOutput, HeadVisit,
};
use lserve::reference::kv_write::{key_stats, update_key_stats, KeyStats};
use lserve::reference::prefill::{prefill_attention, PrefillInput};
use lserve::reference::select::{select_pages, top_k_pages, SelectionParams};
use lserve::reference::TokenPattern;
use lserve::LserveError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const D: usize = 64;

/// `n` values of magnitude `10^3 ..= 6e4` (log-uniform), random sign, rounded to bf16.
fn large_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let m = 10f32.powf(rng.gen_range(3.0f32..4.778));
            let s = if rng.gen() { 1.0 } else { -1.0 };
            bf16::from_f32(s * m).to_f32()
        })
        .collect()
}

/// `n` values uniform in `[-1, 1)`, rounded to bf16.
fn unit_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| bf16::from_f32(rng.gen_range(-1.0f32..1.0)).to_f32())
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Asserts that `out` lies in the per-channel range of `values` (rows of `D`): a convex
/// combination of them.
fn assert_convex(out: &[f64], values: &[&[f32]], what: &str) {
    for (c, &o) in out.iter().enumerate() {
        let lo = values
            .iter()
            .map(|v| v[c] as f64)
            .fold(f64::INFINITY, f64::min);
        let hi = values
            .iter()
            .map(|v| v[c] as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        assert!(
            o.is_finite() && o >= lo - 1e-12 && o <= hi + 1e-12,
            "{what}: channel {c} = {o}, values in [{lo}, {hi}]"
        );
    }
}

/// The index of the highest score and its lead over the second highest.
fn argmax_and_gap(scores: &[f64]) -> (usize, f64) {
    let best = (0..scores.len())
        .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
        .unwrap();
    let second = (0..scores.len())
        .filter(|&j| j != best)
        .map(|j| scores[j])
        .fold(f64::NEG_INFINITY, f64::max);
    (best, scores[best] - second)
}

#[test]
fn large_magnitude_scores_give_finite_convex_outputs() {
    let scale = 1.0 / (D as f64).sqrt();
    let mut one_hot = 0;
    for seed in 0..20 {
        let mut rng = StdRng::seed_from_u64(seed);
        let n = 24;
        let q = large_vec(&mut rng, D);
        let k = large_vec(&mut rng, n * D);
        let v = unit_vec(&mut rng, n * D);
        let a = decode_attention(&q, &k, &v, D, scale).unwrap();
        let rows: Vec<&[f32]> = v.chunks(D).collect();
        assert_convex(&a.out, &rows, &format!("seed {seed}"));
        let scores: Vec<f64> = k.chunks(D).map(|kj| scale * dot(&q, kj)).collect();
        let (best, gap) = argmax_and_gap(&scores);
        // m <= lse <= m + ln(n), m the largest score.
        let slack = 1e-9 * scores[best].abs();
        assert!(a.lse >= scores[best] - slack && a.lse <= scores[best] + (n as f64).ln() + slack);
        // Scores of order 1e10: a lead of more than 50 leaves the others a weight below e^-50.
        if gap > 50.0 {
            one_hot += 1;
            for (c, &o) in a.out.iter().enumerate() {
                assert!((o - rows[best][c] as f64).abs() < 1e-12, "seed {seed}");
            }
        }
    }
    assert!(
        one_hot >= 15,
        "only {one_hot} of 20 cases had a clear winner"
    );
}

#[test]
fn large_magnitude_exact_ties_average_their_values() {
    let scale = 1.0 / (D as f64).sqrt();
    let mut rng = StdRng::seed_from_u64(3);
    let n = 16;
    let q = large_vec(&mut rng, D);
    let mut k = large_vec(&mut rng, n * D);
    let v = unit_vec(&mut rng, n * D);
    let scores: Vec<f64> = k.chunks(D).map(|kj| scale * dot(&q, kj)).collect();
    let (best, gap) = argmax_and_gap(&scores);
    assert!(gap > 50.0, "the draw has no clear winner");
    // Key `twin` becomes a copy of the winner: two exactly equal top scores of order 1e10.
    let twin = (best + 5) % n;
    let winner = k[best * D..][..D].to_vec();
    k[twin * D..][..D].copy_from_slice(&winner);
    let a = decode_attention(&q, &k, &v, D, scale).unwrap();
    for (c, &o) in a.out.iter().enumerate() {
        let mean = (v[best * D + c] as f64 + v[twin * D + c] as f64) / 2.0;
        assert!((o - mean).abs() < 1e-12, "channel {c}: {o} vs {mean}");
    }
    let want_lse = scores[best] + 2f64.ln();
    assert!((a.lse - want_lse).abs() <= 1e-9 * want_lse.abs());
}

#[test]
fn large_magnitude_prefill_is_finite_and_convex() {
    let mut rng = StdRng::seed_from_u64(11);
    let (t, hq) = (100, 2);
    let q = large_vec(&mut rng, t * hq * D);
    let k = large_vec(&mut rng, t * D);
    let v = unit_vec(&mut rng, t * D);
    let scale = 1.0 / (D as f64).sqrt();
    let out = prefill_attention(&PrefillInput {
        cu_seqlens: &[0, t],
        q: &q,
        k: &k,
        v: &v,
        q_heads: hq,
        kv_heads: 1,
        head_dim: D,
        patterns: &[TokenPattern::Causal],
        block_mask: None,
        scale,
    })
    .unwrap();
    let rows: Vec<&[f32]> = v.chunks(D).collect();
    for i in 0..t {
        for h in 0..hq {
            let o = &out.out[(i * hq + h) * D..][..D];
            assert_convex(o, &rows[..=i], &format!("token {i}, head {h}"));
            let qh = &q[(i * hq + h) * D..][..D];
            let scores: Vec<f64> = (0..=i).map(|j| scale * dot(qh, rows_k(&k, j))).collect();
            let (best, gap) = argmax_and_gap(&scores);
            if i == 0 || gap > 50.0 {
                for c in 0..D {
                    assert!((o[c] - rows[best][c] as f64).abs() < 1e-12, "token {i}");
                }
            }
        }
    }
}

fn rows_k(k: &[f32], j: usize) -> &[f32] {
    &k[j * D..][..D]
}

/// The expected top-K of all-equal scores: the lowest `k` candidates, the newest and the first.
fn lowest_pages(pages: usize, k: usize, first: bool) -> Vec<u32> {
    let newest = pages - 1;
    let lo = usize::from(first).min(newest);
    let mut want: Vec<u32> = (lo..newest).take(k).map(|p| p as u32).collect();
    if first {
        want.insert(0, 0);
    }
    want.push(newest as u32);
    want.dedup();
    want
}

#[test]
fn all_equal_scores_select_the_lowest_pages() {
    let mut rng = StdRng::seed_from_u64(5);
    // Eleven identical keys: every logical page (N_L = 2) has the same statistics, so every
    // page scores the same bits whatever the query.
    let key = unit_vec(&mut rng, D);
    let keys: Vec<f32> = key.iter().copied().cycle().take(11 * D).collect();
    let stats = key_stats(&keys, D, 2).unwrap();
    let q_group = unit_vec(&mut rng, 3 * D);
    for aggregation in [GqaAggregation::Max, GqaAggregation::Mean] {
        for first in [false, true] {
            for top_k in 0..=4 {
                let params = SelectionParams {
                    logical_per_page: 2,
                    top_k,
                    always_include_first: first,
                    aggregation,
                };
                let s = select_pages(&q_group, &stats, &params).unwrap();
                assert_eq!(s.physical_scores.len(), 3);
                assert!(s.physical_scores.windows(2).all(|w| w[0] == w[1]));
                assert_eq!(s.pages, lowest_pages(3, top_k, first), "{params:?}");
            }
        }
    }
    // On scores directly, with more pages: ties among the best go to the lower index.
    for first in [false, true] {
        for top_k in 0..=9 {
            let got = top_k_pages(&[7.5; 9], top_k, first);
            assert_eq!(
                got,
                lowest_pages(9, top_k, first),
                "k {top_k}, first {first}"
            );
        }
    }
    assert_eq!(
        top_k_pages(&[1.0, 3.0, 2.0, 3.0, 3.0, 0.0], 2, false),
        [1, 3, 5]
    );
}

/// A one-layer model: KV heads of the given kinds (`true`: streaming), `group` query heads
/// each, sequences prefilled with `prompts[b]` tokens whose keys and values come from `kv`
/// (`(seq, pos) -> (k, v)`, `[Hkv][D]` each).
type Model = Prefilled<bf16>;

fn model(
    streaming: &[bool],
    group: usize,
    config: SparsityConfig,
    prompts: &[usize],
    kv: impl FnMut(usize, usize) -> (Vec<f32>, Vec<f32>),
) -> Model {
    let hkv = streaming.len();
    let g = ModelGeometry::new(1, hkv * group, hkv, D).unwrap();
    let pattern = head_pattern(g, &[streaming.to_vec()]);
    let max_len = prompts.iter().max().unwrap() + 8;
    prefilled(pattern, config, prompts, max_len, 0, kv)
}

impl Model {
    /// Reserves one token per sequence and runs the reference decode step on `q`, `k`, `v`
    /// (`f32`, rounded to bf16).
    fn step(&mut self, q: &[f32], k: &[f32], v: &[f32]) -> DecodeStepOutput {
        for &s in &self.seqs {
            self.mgr.reserve(s, 1).unwrap();
        }
        let e = |xs: &[f32]| xs.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        decode_step(
            &self.mgr,
            &mut self.host,
            &mut self.tables,
            &mut self.reuse,
            0,
            &self.seqs,
            &e(q),
            &e(k),
            &e(v),
        )
        .unwrap()
    }
}

#[test]
fn one_token_pages_rank_single_tokens_by_their_dot_product() {
    let config = SparsityConfig {
        page_tokens: 1,
        logical_page_tokens: 1,
        token_budget: 3,
        dynamic_min_len: 4,
        reuse_interval: 1,
        sink_tokens: 1,
        local_tokens: 2,
        ..Default::default()
    };
    config.validate().unwrap();
    assert_eq!(config.pages_per_selection(), 3);
    let mut rng = StdRng::seed_from_u64(9);
    let prompt = 12;
    let keys: Vec<Vec<f32>> = (0..=prompt).map(|_| unit_vec(&mut rng, D)).collect();
    let values: Vec<Vec<f32>> = (0..=prompt).map(|_| unit_vec(&mut rng, D)).collect();
    let (k0, v0) = (keys.clone(), values.clone());
    let mut m = model(&[false], 2, config, &[prompt], |_, p| {
        (k0[p].clone(), v0[p].clone())
    });
    let q = unit_vec(&mut rng, 2 * D);
    let out = m.step(&q, &keys[prompt], &values[prompt]);

    // A one-token page's bounds are the key itself: its score is max over the two query heads
    // of q_h · k. Candidates: tokens 1..prompt (0 always, `prompt` the newest).
    let score = |t: usize| {
        (0..2)
            .map(|h| dot(&q[h * D..][..D], &keys[t]))
            .fold(f64::MIN, f64::max)
    };
    let mut candidates: Vec<usize> = (1..prompt).collect();
    candidates.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
    let mut want: Vec<usize> = candidates[..3].to_vec();
    want.extend([0, prompt]);
    want.sort_unstable();
    let want_pages: Vec<u32> = want.iter().map(|&t| t as u32).collect();
    assert_eq!(
        out.visits[0][0],
        HeadVisit::Selected {
            pages: want_pages,
            selected_now: true
        }
    );
    // The output: softmax over exactly those tokens.
    let flat = |rows: &[Vec<f32>]| rows.concat();
    let scale = 1.0 / (D as f64).sqrt();
    let a = attend_tokens(&q, &flat(&keys), &flat(&values), D, &want, scale).unwrap();
    for h in 0..2 {
        for c in 0..D {
            assert!((out.out[h * D + c] - a[h].out[c]).abs() < 1e-12);
        }
    }
}

#[test]
fn a_one_token_sequence_attends_to_itself() {
    let mut rng = StdRng::seed_from_u64(1);
    // Prefill: two sequences of one token, two query heads on one KV head.
    let q = unit_vec(&mut rng, 2 * 2 * D);
    let k = unit_vec(&mut rng, 2 * D);
    let v = unit_vec(&mut rng, 2 * D);
    let scale = 0.125;
    let out = prefill_attention(&PrefillInput {
        cu_seqlens: &[0, 1, 2],
        q: &q,
        k: &k,
        v: &v,
        q_heads: 2,
        kv_heads: 1,
        head_dim: D,
        patterns: &[TokenPattern::Causal],
        block_mask: None,
        scale,
    })
    .unwrap();
    for t in 0..2 {
        for h in 0..2 {
            let row = (t * 2 + h) * D;
            let want: Vec<f64> = v[t * D..][..D].iter().map(|&x| x as f64).collect();
            assert_eq!(out.out[row..row + D], want[..]);
            let lse = scale * dot(&q[row..row + D], &k[t * D..][..D]);
            assert!((out.lse[t * 2 + h] - lse).abs() <= 1e-12 * lse.abs().max(1.0));
        }
    }

    // The first decode step of an empty sequence: a dense and a streaming KV head, attending to
    // every token (L = 1 <= dynamic_min_len) or selecting (dynamic_min_len 0: one page, the
    // newest).
    for dynamic_min_len in [8, 0] {
        let config = SparsityConfig {
            page_tokens: 16,
            logical_page_tokens: 4,
            token_budget: 32,
            sink_tokens: 2,
            local_tokens: 4,
            dynamic_min_len,
            ..Default::default()
        };
        let mut m = model(&[false, true], 2, config, &[0], |_, _| unreachable!());
        let q = unit_vec(&mut rng, 4 * D);
        let k = unit_vec(&mut rng, 2 * D);
        let v = unit_vec(&mut rng, 2 * D);
        let out = m.step(&q, &k, &v);
        for h in 0..4 {
            let want: Vec<f64> = v[h / 2 * D..][..D].iter().map(|&x| x as f64).collect();
            assert_eq!(out.out[h * D..][..D], want[..], "query head {h}");
        }
        let dense = if dynamic_min_len == 0 {
            HeadVisit::Selected {
                pages: vec![0],
                selected_now: true,
            }
        } else {
            HeadVisit::AllPages
        };
        assert_eq!(out.visits[0], [dense, HeadVisit::Streaming]);
    }
}

#[test]
fn an_empty_selection_budget_is_a_typed_error() {
    let config = SparsityConfig {
        token_budget: 0,
        ..Default::default()
    };
    let field = |e: LserveError| match e {
        LserveError::InvalidConfig { field, .. } => field,
        other => panic!("not InvalidConfig: {other:?}"),
    };
    assert_eq!(field(config.validate().unwrap_err()), "token_budget");
    let g = ModelGeometry::new(1, 2, 1, D).unwrap();
    let pattern = lserve::head_pattern::HeadPattern::all_dense(g);
    let made = KvCacheManager::new(g, pattern, config, 16, 1, 256);
    assert_eq!(
        field(made.expect_err("a manager of no budget")),
        "token_budget"
    );
    // Less than one page is no budget either: not a multiple of `page_tokens`.
    let short = SparsityConfig {
        token_budget: 32,
        page_tokens: 64,
        ..Default::default()
    };
    assert_eq!(field(short.validate().unwrap_err()), "token_budget");
}

#[test]
fn a_top_k_of_zero_selects_only_the_mandatory_pages() {
    let scores = [4.0, 9.0, 8.0, -1.0, 2.0];
    assert_eq!(top_k_pages(&scores, 0, false), [4]);
    assert_eq!(top_k_pages(&scores, 0, true), [0, 4]);
    assert_eq!(top_k_pages(&[3.0], 0, true), [0]);
    let mut rng = StdRng::seed_from_u64(2);
    let stats = key_stats(&unit_vec(&mut rng, 20 * D), D, 4).unwrap();
    for first in [false, true] {
        let params = SelectionParams {
            logical_per_page: 1,
            top_k: 0,
            always_include_first: first,
            aggregation: GqaAggregation::Max,
        };
        let s = select_pages(&unit_vec(&mut rng, D), &stats, &params).unwrap();
        assert_eq!(s.pages, if first { vec![0, 4] } else { vec![4] });
    }
}

#[test]
fn nan_in_an_attended_row_poisons_only_what_reads_it() {
    let mut rng = StdRng::seed_from_u64(4);
    let n = 6;
    let q = unit_vec(&mut rng, 2 * D); // two query heads of one KV head
    let k = unit_vec(&mut rng, n * D);
    let v = unit_vec(&mut rng, n * D);
    let all: Vec<usize> = (0..n).collect();
    let scale = 0.125;
    let clean = attend_tokens(&q, &k, &v, D, &all, scale).unwrap();

    // A NaN in one channel of key 2: both query heads' rows are NaN (every channel, and the
    // log-sum-exp); attending without key 2 is unaffected.
    let mut bad_k = k.clone();
    bad_k[2 * D + 7] = f32::NAN;
    let a = attend_tokens(&q, &bad_k, &v, D, &all, scale).unwrap();
    assert!(a
        .iter()
        .all(|r| r.out.iter().all(|x| x.is_nan()) && r.lse.is_nan()));
    let without = [0, 1, 3, 4, 5];
    assert_eq!(
        attend_tokens(&q, &bad_k, &v, D, &without, scale).unwrap(),
        attend_tokens(&q, &k, &v, D, &without, scale).unwrap()
    );

    // A NaN in one channel of value 4: that channel is NaN, the others and the log-sum-exp are
    // the clean run's.
    let mut bad_v = v.clone();
    bad_v[4 * D + 9] = f32::NAN;
    let a = attend_tokens(&q, &k, &bad_v, D, &all, scale).unwrap();
    for (got, want) in a.iter().zip(&clean) {
        assert_eq!(got.lse, want.lse);
        for c in 0..D {
            assert_eq!(got.out[c].is_nan(), c == 9);
            if c != 9 {
                assert_eq!(got.out[c], want.out[c]);
            }
        }
    }

    // A NaN in query head 1: its row only.
    let mut bad_q = q.clone();
    bad_q[D + 3] = f32::NAN;
    let a = attend_tokens(&bad_q, &k, &v, D, &all, scale).unwrap();
    assert_eq!(a[0], clean[0]);
    assert!(a[1].out.iter().all(|x| x.is_nan()) && a[1].lse.is_nan());
}

#[test]
fn infinite_scores_and_values() {
    let mut rng = StdRng::seed_from_u64(6);
    let n = 5;
    let mut q = unit_vec(&mut rng, D);
    q[0] = 0.5;
    let k = unit_vec(&mut rng, n * D);
    let v = unit_vec(&mut rng, n * D);
    let scale = 0.125;
    let with_key = |x: f32| {
        let mut k = k.clone();
        k[3 * D] = x;
        decode_attention(&q, &k, &v, D, scale).unwrap()
    };
    // +inf in key 3 where q is positive: the score is +inf, the row NaN (inf - inf).
    let plus = with_key(f32::INFINITY);
    assert!(plus.out.iter().all(|x| x.is_nan()));
    // -inf there: the score is -inf, key 3 gets weight 0, as if it were not attended.
    let minus = with_key(f32::NEG_INFINITY);
    let rest = [0, 1, 2, 4];
    let want = attend_tokens(&q, &k, &v, D, &rest, scale).unwrap();
    assert_eq!(minus.out, want[0].out);
    assert_eq!(minus.lse, want[0].lse);
    // +inf in one channel of a value: that channel is +inf, the others finite.
    let mut inf_v = v.clone();
    inf_v[2 * D + 5] = f32::INFINITY;
    let a = decode_attention(&q, &k, &inf_v, D, scale).unwrap();
    for (c, &x) in a.out.iter().enumerate() {
        assert_eq!(x == f64::INFINITY, c == 5);
        assert_eq!(x.is_finite(), c != 5);
    }
}

/// Decode-step inputs of a batch: `(q, k, v)` as `f32`.
fn step_inputs(rng: &mut StdRng, m: &Model) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let g = *m.mgr.geometry();
    let b = m.seqs.len();
    (
        unit_vec(rng, b * g.q_heads() * D),
        unit_vec(rng, b * g.kv_heads() * D),
        unit_vec(rng, b * g.kv_heads() * D),
    )
}

#[test]
fn nan_in_the_cache_stays_in_its_sequence_and_kv_group() {
    // Two sequences, KV heads dense, dense, streaming (sink 2, local 4), two query heads each;
    // dense heads attend to every token. Seq 0 gets a NaN in one key channel of KV head 0
    // (token 3); seq 1 a NaN in KV head 2's key at token 8, which the ring has dropped by the
    // step (neither a sink nor among the last 4).
    let config = SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 4,
        token_budget: 32,
        sink_tokens: 2,
        local_tokens: 4,
        dynamic_min_len: 1000,
        ..Default::default()
    };
    let prompts = [20, 30];
    let mut rng = StdRng::seed_from_u64(8);
    let data: Vec<Vec<(Vec<f32>, Vec<f32>)>> = prompts
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| (unit_vec(&mut rng, 3 * D), unit_vec(&mut rng, 3 * D)))
                .collect()
        })
        .collect();
    let kinds = [false, false, true];
    let mut clean = model(&kinds, 2, config, &prompts, |b, p| data[b][p].clone());
    let mut bad = model(&kinds, 2, config, &prompts, |b, p| {
        let (mut k, v) = data[b][p].clone();
        if (b, p) == (0, 3) {
            k[11] = f32::NAN; // KV head 0, channel 11
        }
        if (b, p) == (1, 8) {
            k[2 * D] = f32::NAN; // KV head 2, channel 0
        }
        (k, v)
    });
    let (q, k, v) = step_inputs(&mut rng, &clean);
    let want = clean.step(&q, &k, &v);
    let got = bad.step(&q, &k, &v);
    let hq = 6;
    for b in 0..2 {
        for h in 0..hq {
            let row = (b * hq + h) * D;
            let (g, w) = (&got.out[row..row + D], &want.out[row..row + D]);
            if b == 0 && h < 2 {
                assert!(g.iter().all(|x| x.is_nan()), "seq {b}, head {h}");
            } else {
                assert_eq!(g, w, "seq {b}, head {h}");
            }
        }
    }
}

#[test]
fn key_statistics_keep_a_nan_of_the_first_token_and_ignore_later_ones() {
    // Logical pages of 4 tokens. Channel 0: NaN in token 0 (the page's first); channel 1: NaN in
    // token 1. Pooled (prefill) and appended (decode) statistics agree bit for bit.
    let config = SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 4,
        token_budget: 32,
        ..Default::default()
    };
    let mut rng = StdRng::seed_from_u64(10);
    let keys: Vec<Vec<f32>> = (0..6)
        .map(|t| {
            let mut k = unit_vec(&mut rng, D);
            if t == 0 {
                k[0] = f32::NAN;
            }
            if t == 1 {
                k[1] = f32::NAN;
            }
            k
        })
        .collect();
    let pooled = model(&[false], 1, config, &[6], |_, p| {
        (keys[p].clone(), keys[p].clone())
    });
    let mut appended = model(&[false], 1, config, &[0], |_, _| unreachable!());
    let seq = appended.seqs[0];
    for (t, key) in keys.iter().enumerate() {
        appended.mgr.reserve(seq, 1).unwrap();
        let view = appended.mgr.view(seq).unwrap();
        let e: Vec<bf16> = key.iter().map(|&x| bf16::from_f32(x)).collect();
        appended.host.write_token(0, &view, t, &e, &e).unwrap();
        update_key_stats(&mut appended.host, 0, &view, t).unwrap();
    }
    let stats = |m: &Model| {
        let page = m.mgr.block_table(m.seqs[0]).unwrap().physical(0).unwrap();
        let dense = m.host.dense(0).unwrap();
        let (lo, hi) = dense.stats(page, 0, 0).unwrap();
        let bits = |xs: &[bf16]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        (
            bits(lo),
            bits(hi),
            lserve::reference::to_f32_vec(lo),
            lserve::reference::to_f32_vec(hi),
        )
    };
    let (p_lo, p_hi, lo, hi) = stats(&pooled);
    let (a_lo, a_hi, _, _) = stats(&appended);
    assert_eq!(
        (p_lo, p_hi),
        (a_lo, a_hi),
        "pooled and appended statistics differ"
    );
    assert!(lo[0].is_nan() && hi[0].is_nan());
    let over = |c: usize, ts: &[usize]| {
        let xs = ts.iter().map(|&t| keys[t][c]);
        (
            xs.clone().fold(f32::INFINITY, f32::min),
            xs.fold(f32::NEG_INFINITY, f32::max),
        )
    };
    assert_eq!((lo[1], hi[1]), over(1, &[0, 2, 3]));
    for c in 2..D {
        assert_eq!((lo[c], hi[c]), over(c, &[0, 1, 2, 3]));
    }
    // The plain-slice statistics follow the same rule.
    let s = key_stats(&keys.concat(), D, 4).unwrap();
    assert!(s.kmin(0)[0].is_nan() && s.kmax(0)[0].is_nan());
    assert_eq!((s.kmin(0)[1], s.kmax(0)[1]), over(1, &[0, 2, 3]));
}

#[test]
fn nan_page_scores_rank_last_and_infinite_ones_first() {
    // D = 2, six logical pages, one per physical page. Page 1: NaN bounds; page 2: kmax = +inf
    // in channel 0 (the query is positive there).
    let mut kmin = vec![
        0.0f32,
        -1.0,
        f32::NAN,
        f32::NAN,
        0.0,
        0.0,
        1.0,
        1.0,
        2.0,
        0.0,
        0.0,
        0.0,
    ];
    let mut kmax = vec![
        1.0f32,
        0.0,
        f32::NAN,
        f32::NAN,
        f32::INFINITY,
        0.0,
        1.5,
        1.0,
    ];
    kmax.extend([2.5, 0.5, 0.0, 0.0]);
    let stats = KeyStats::new(2, kmin.clone(), kmax.clone()).unwrap();
    let q = [1.0f32, 0.5];
    let params = |top_k, aggregation| SelectionParams {
        logical_per_page: 1,
        top_k,
        always_include_first: false,
        aggregation,
    };
    for aggregation in [GqaAggregation::Max, GqaAggregation::Mean] {
        let s = select_pages(&q, &stats, &params(1, aggregation)).unwrap();
        let want = [1.0, f64::NEG_INFINITY, f64::INFINITY, 2.0, 2.75, 0.0];
        assert_eq!(s.physical_scores, want, "{aggregation:?}");
        assert_eq!(s.pages, [2, 5]);
        // Four of five candidates: all but the NaN page.
        let s = select_pages(&q, &stats, &params(4, aggregation)).unwrap();
        assert_eq!(s.pages, [0, 2, 3, 4, 5]);
    }
    // Two logical pages per physical page: a NaN logical score (mean aggregation) is skipped by
    // the physical max.
    let s = select_pages(
        &q,
        &KeyStats::new(2, kmin.drain(..8).collect(), kmax.drain(..8).collect()).unwrap(),
        &SelectionParams {
            logical_per_page: 2,
            ..params(1, GqaAggregation::Mean)
        },
    )
    .unwrap();
    assert_eq!(s.physical_scores, [1.0, f64::INFINITY]);
    // A group with a NaN query: under max aggregation its head is skipped (the selection is the
    // other head's); under mean every page scores -inf (ties: the lowest pages).
    let mut rng = StdRng::seed_from_u64(12);
    let stats = key_stats(&unit_vec(&mut rng, 40 * D), D, 4).unwrap();
    let other = unit_vec(&mut rng, D);
    let mut group = vec![f32::NAN; D];
    group.extend(&other);
    let p = |aggregation| SelectionParams {
        logical_per_page: 2,
        top_k: 2,
        always_include_first: true,
        aggregation,
    };
    let alone = select_pages(&other, &stats, &p(GqaAggregation::Max)).unwrap();
    assert_eq!(
        select_pages(&group, &stats, &p(GqaAggregation::Max)).unwrap(),
        alone
    );
    let mean = select_pages(&group, &stats, &p(GqaAggregation::Mean)).unwrap();
    assert!(mean.physical_scores.iter().all(|&s| s == f64::NEG_INFINITY));
    assert_eq!(mean.pages, lowest_pages(5, 2, true));
}

/// Elements of `E` round-trip NaN and infinities (what the cache stores is what the tests put
/// there).
#[test]
fn element_types_keep_non_finite_values() {
    fn check<E: Element>() {
        assert!(E::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(E::from_f32(f32::INFINITY).to_f32(), f32::INFINITY);
        assert!(E::from_f32(6e4).to_f32().is_finite());
    }
    check::<bf16>();
    check::<half::f16>();
}
