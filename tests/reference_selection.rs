//! Key statistics, page scoring, top-K and decode attention over the selected pages: the
//! reference against brute force, a full sort, and plain softmax over an explicit token mask.

use half::bf16;
use lserve::config::GqaAggregation;
use lserve::reference::decode::{attend_tokens, decode_attention, tokens_of_pages};
use lserve::reference::kv_write::{key_stats, KeyStats};
use lserve::reference::select::{logical_scores, select_pages, top_k_pages, SelectionParams};
use lserve::LserveError;
use proptest::prelude::*;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn random_values(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| bf16::from_f32(rng.gen_range(-2.0f32..2.0)).to_f32())
        .collect()
}

/// Brute-force statistics: for every logical page and channel, scan all tokens and keep those
/// whose page is `p`.
fn brute_stats(keys: &[f32], len: usize, d: usize, n_l: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let pages = len.div_ceil(n_l);
    let mut kmin = vec![vec![f32::INFINITY; d]; pages];
    let mut kmax = vec![vec![f32::NEG_INFINITY; d]; pages];
    for t in 0..len {
        for i in 0..d {
            let x = keys[t * d + i];
            if x < kmin[t / n_l][i] {
                kmin[t / n_l][i] = x;
            }
            if x > kmax[t / n_l][i] {
                kmax[t / n_l][i] = x;
            }
        }
    }
    (kmin, kmax)
}

/// Naive selection: physical page scores from brute-force statistics, then a full sort of the
/// candidates by (score desc, index asc).
#[allow(clippy::too_many_arguments)]
fn naive_selection(
    q_group: &[f32],
    keys: &[f32],
    len: usize,
    d: usize,
    n_l: usize,
    n_p: usize,
    k: usize,
    first: bool,
    mean: bool,
) -> (Vec<u32>, Vec<f64>) {
    let (kmin, kmax) = brute_stats(keys, len, d, n_l);
    let g = q_group.len() / d;
    let bound = |h: usize, lp: usize| -> f64 {
        (0..d)
            .map(|i| {
                let qi = q_group[h * d + i] as f64;
                f64::max(qi * kmax[lp][i] as f64, qi * kmin[lp][i] as f64)
            })
            .sum()
    };
    let physical = len.div_ceil(n_p);
    let mut phys_scores = vec![f64::NEG_INFINITY; physical];
    for lp in 0..kmin.len() {
        let per_head: Vec<f64> = (0..g).map(|h| bound(h, lp)).collect();
        let agg = if mean {
            per_head.iter().sum::<f64>() / g as f64
        } else {
            per_head.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
        };
        let p = lp * n_l / n_p;
        phys_scores[p] = phys_scores[p].max(agg);
    }
    let newest = physical - 1;
    let mut cands: Vec<(f64, usize)> = (0..newest)
        .filter(|&p| !(first && p == 0))
        .map(|p| (phys_scores[p], p))
        .collect();
    cands.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
    let mut sel: Vec<u32> = cands.iter().take(k).map(|c| c.1 as u32).collect();
    sel.push(newest as u32);
    if first {
        sel.push(0);
    }
    sel.sort();
    sel.dedup();
    (sel, phys_scores)
}

/// Plain softmax of one query over all `len` keys with an explicit token mask.
fn naive_masked(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    d: usize,
    mask: &[bool],
    scale: f64,
) -> Vec<f64> {
    let len = mask.len();
    let s: Vec<f64> = (0..len)
        .map(|j| {
            if mask[j] {
                scale
                    * (0..d)
                        .map(|i| q[i] as f64 * keys[j * d + i] as f64)
                        .sum::<f64>()
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = p.iter().sum();
    (0..d)
        .map(|i| {
            (0..len)
                .map(|j| p[j] * values[j * d + i] as f64)
                .sum::<f64>()
                / z
        })
        .collect()
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum();
    let norm: f64 = want.iter().map(|b| b * b).sum();
    diff.sqrt() / norm.sqrt()
}

proptest! {
    /// (2) Statistics equal brute force exactly, the last page partial; and each head's logical
    /// score bounds `q · k` of every key of the page.
    #[test]
    fn key_stats_match_brute_force(len in 1usize..200, d in 1usize..=16, n_l in 1usize..=20, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        let keys = random_values(&mut rng, len * d);
        let q = random_values(&mut rng, d);
        let got = key_stats(&keys, d, n_l).unwrap();
        let (kmin, kmax) = brute_stats(&keys, len, d, n_l);
        prop_assert_eq!(got.pages(), len.div_ceil(n_l));
        for p in 0..got.pages() {
            prop_assert_eq!(got.kmin(p), &kmin[p][..]);
            prop_assert_eq!(got.kmax(p), &kmax[p][..]);
        }
        let scores = logical_scores(&q, &got);
        for t in 0..len {
            let qk: f64 = (0..d).map(|i| q[i] as f64 * keys[t * d + i] as f64).sum();
            prop_assert!(qk <= scores[t / n_l] + 1e-12);
        }
    }

    /// (3) Top-K equals a full sort by (score desc, index asc), with the always-include rules;
    /// scores come from a small set so ties are frequent.
    #[test]
    fn top_k_matches_full_sort(
        scores in prop::collection::vec((-3i32..3).prop_map(f64::from), 0..40),
        k in 0usize..45,
        first: bool,
    ) {
        let got = top_k_pages(&scores, k, first);
        if scores.is_empty() {
            prop_assert!(got.is_empty());
            return Ok(());
        }
        let newest = scores.len() - 1;
        let mut all: Vec<(f64, usize)> = scores.iter().cloned().zip(0..).collect();
        all.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
        let mut want: Vec<u32> = all
            .iter()
            .filter(|c| c.1 != newest && !(first && c.1 == 0))
            .take(k)
            .map(|c| c.1 as u32)
            .collect();
        want.push(newest as u32);
        if first {
            want.push(0);
        }
        want.sort();
        want.dedup();
        prop_assert_eq!(&got, &want);
        // Size: min(K, candidates) + the always-included pages.
        let candidates = newest - usize::from(first && newest > 0);
        let always = 1 + usize::from(first && newest > 0);
        prop_assert_eq!(got.len(), k.min(candidates) + always);
    }

    /// (4) Selection equals the naive selection, and attention over the selected pages equals
    /// plain softmax over all keys with the token mask "page of j is selected"; MHA and GQA,
    /// lengths not multiples of the page sizes.
    #[test]
    fn decode_with_selection_matches_token_mask(
        len in 1usize..300,
        d in prop_oneof![1usize..=8, Just(16usize)],
        group in 1usize..=4,
        n_l in 1usize..=8,
        g in 1usize..=4,
        k in 0usize..8,
        first: bool,
        mean: bool,
        seed: u64,
    ) {
        let n_p = n_l * g;
        let mut rng = StdRng::seed_from_u64(seed);
        let keys = random_values(&mut rng, len * d);
        let values = random_values(&mut rng, len * d);
        let q_group = random_values(&mut rng, group * d);
        let params = SelectionParams {
            logical_per_page: g,
            top_k: k,
            always_include_first: first,
            aggregation: if mean { GqaAggregation::Mean } else { GqaAggregation::Max },
        };
        let stats = key_stats(&keys, d, n_l).unwrap();
        let sel = select_pages(&q_group, &stats, &params).unwrap();
        let (want_pages, want_scores) = naive_selection(&q_group, &keys, len, d, n_l, n_p, k, first, mean);
        prop_assert_eq!(&sel.pages, &want_pages);
        prop_assert_eq!(sel.physical_scores.len(), want_scores.len());
        for (a, b) in sel.physical_scores.iter().zip(&want_scores) {
            prop_assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0));
        }

        let scale = 1.0 / (d as f64).sqrt();
        let tokens = tokens_of_pages(&sel.pages, n_p, len);
        let got = attend_tokens(&q_group, &keys, &values, d, &tokens, scale).unwrap();
        let mask: Vec<bool> = (0..len).map(|j| want_pages.contains(&((j / n_p) as u32))).collect();
        prop_assert!(mask[len - 1], "the newest token is always attended");
        for h in 0..group {
            let want = naive_masked(&q_group[h * d..][..d], &keys, &values, d, &mask, scale);
            let e = rel_err(&got[h].out, &want);
            prop_assert!(e < 1e-9, "head {h}: relative error {e}");
        }
    }
}

/// The comparison can fail: attending one page fewer than selected gives a different output.
#[test]
fn comparison_detects_a_dropped_page() {
    let (len, d, n_p) = (50, 8, 8);
    let mut rng = StdRng::seed_from_u64(3);
    let keys = random_values(&mut rng, len * d);
    let values = random_values(&mut rng, len * d);
    let q = random_values(&mut rng, d);
    let pages = [0u32, 3, 6];
    let tokens = tokens_of_pages(&pages[..2], n_p, len);
    let got = attend_tokens(&q, &keys, &values, d, &tokens, 0.5).unwrap();
    let mask: Vec<bool> = (0..len)
        .map(|j| pages.contains(&((j / n_p) as u32)))
        .collect();
    assert!(
        rel_err(
            &got[0].out,
            &naive_masked(&q, &keys, &values, d, &mask, 0.5)
        ) > 1e-3
    );
}

#[test]
fn selection_rejects_bad_inputs() {
    let stats = key_stats(&[1.0, 2.0, 3.0, 4.0], 2, 1).unwrap();
    let p = SelectionParams {
        logical_per_page: 1,
        top_k: 1,
        always_include_first: true,
        aggregation: GqaAggregation::Max,
    };
    assert!(select_pages(&[1.0, 1.0], &stats, &p).is_ok());
    assert!(select_pages(&[1.0, 1.0, 1.0], &stats, &p).is_err());
    assert!(select_pages(&[], &stats, &p).is_err());
    assert!(select_pages(
        &[1.0, 1.0],
        &stats,
        &SelectionParams {
            logical_per_page: 0,
            ..p
        }
    )
    .is_err());
    assert!(key_stats(&[1.0; 3], 2, 1).is_err());
    assert!(key_stats(&[1.0; 4], 2, 0).is_err());
    assert!(attend_tokens(&[1.0, 1.0], &[1.0; 4], &[1.0; 4], 2, &[2], 1.0).is_err());
    assert!(attend_tokens(&[1.0, 1.0], &[1.0; 4], &[1.0; 4], 2, &[], 1.0).is_err());
}

/// Key statistics of head dimension 0 or of partial rows cannot be built, so nothing divides by
/// a zero head dimension; built statistics select as the ones `key_stats` computes.
#[test]
fn key_stats_reject_an_empty_head_dimension() {
    assert!(matches!(
        KeyStats::new(0, vec![], vec![]),
        Err(LserveError::InvalidArgument {
            what: "head_dim",
            ..
        })
    ));
    assert!(matches!(
        key_stats(&[], 0, 1),
        Err(LserveError::InvalidArgument {
            what: "head_dim",
            ..
        })
    ));
    assert!(matches!(
        KeyStats::new(2, vec![1.0; 3], vec![1.0; 3]),
        Err(LserveError::ShapeMismatch { what: "kmin", .. })
    ));
    assert!(matches!(
        KeyStats::new(2, vec![1.0; 4], vec![1.0; 2]),
        Err(LserveError::ShapeMismatch { what: "kmax", .. })
    ));
    let keys = [1.0, 2.0, -3.0, 4.0, 0.5, -1.0];
    let computed = key_stats(&keys, 2, 1).unwrap();
    let built = KeyStats::new(2, keys.to_vec(), keys.to_vec()).unwrap();
    assert_eq!(built, computed);
    assert_eq!((built.head_dim(), built.pages()), (2, 3));
}

/// A logical page whose size (`N_L x D`) overflows is `InvalidArgument`, never an overflow
/// panic.
#[test]
fn key_stats_of_an_overflowing_page_size_are_errors() {
    assert!(matches!(
        key_stats(&[1.0; 4], 2, usize::MAX),
        Err(LserveError::InvalidArgument {
            what: "logical_tokens",
            ..
        })
    ));
    assert_eq!(key_stats(&[1.0; 4], 2, usize::MAX / 2).unwrap().pages(), 1);
}

/// Decode attention with a softmax scale that is NaN, infinite, zero or negative is
/// `InvalidArgument`.
#[test]
fn decode_attention_rejects_bad_softmax_scales() {
    let (q, kv) = ([1.0f32, 0.5], [1.0f32, 2.0, 3.0, 4.0]);
    assert!(decode_attention(&q, &kv, &kv, 2, 0.5).is_ok());
    assert!(attend_tokens(&q, &kv, &kv, 2, &[0, 1], 0.5).is_ok());
    for scale in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, -1.0] {
        assert!(matches!(
            decode_attention(&q, &kv, &kv, 2, scale),
            Err(LserveError::InvalidArgument { what: "scale", .. })
        ));
        assert!(matches!(
            attend_tokens(&q, &kv, &kv, 2, &[0, 1], scale),
            Err(LserveError::InvalidArgument { what: "scale", .. })
        ));
    }
}
