//! Page scores: logical-page upper bounds of `q · k` from the key statistics, GQA aggregation,
//! physical-page scores (the kernels' `select::score`).

use crate::config::GqaAggregation;
use crate::reference::kv_write::KeyStats;

/// Scores of one query head against every logical page:
/// `S(j) = Σ_i max(q[i] · kmax_j[i], q[i] · kmin_j[i])`, in `f64` (an upper bound of `q · k` over
/// the page's keys; unscaled).
///
/// # Panics
/// If `q.len() != stats.head_dim()`.
pub fn logical_scores(q: &[f32], stats: &KeyStats) -> Vec<f64> {
    assert_eq!(q.len(), stats.head_dim(), "query length");
    (0..stats.pages())
        .map(|j| {
            let (lo, hi) = (stats.kmin(j), stats.kmax(j));
            q.iter()
                .zip(lo.iter().zip(hi))
                .map(|(&qi, (&lo, &hi))| {
                    let (qi, lo, hi) = (qi as f64, lo as f64, hi as f64);
                    (qi * hi).max(qi * lo)
                })
                .sum()
        })
        .collect()
}

/// Combines the logical scores of a group's query heads (`per_head[h][j]`, all the same length)
/// into one score per logical page: max or mean over `h`.
///
/// # Panics
/// If `per_head` is empty or its rows differ in length.
pub fn aggregate_scores(per_head: &[Vec<f64>], aggregation: GqaAggregation) -> Vec<f64> {
    assert!(!per_head.is_empty(), "aggregation over no heads");
    let pages = per_head[0].len();
    assert!(
        per_head.iter().all(|s| s.len() == pages),
        "heads differ in page count"
    );
    (0..pages)
        .map(|j| {
            let column = per_head.iter().map(|s| s[j]);
            match aggregation {
                GqaAggregation::Max => column.fold(f64::NEG_INFINITY, f64::max),
                GqaAggregation::Mean => column.sum::<f64>() / per_head.len() as f64,
            }
        })
        .collect()
}

/// Physical-page scores: physical page `p` scores the max over its logical pages
/// `p * g .. min((p + 1) * g, logical.len())` (only logical pages that exist).
///
/// # Panics
/// If `logical_per_page == 0`.
pub fn physical_scores(logical: &[f64], logical_per_page: usize) -> Vec<f64> {
    assert!(logical_per_page > 0, "logical_per_page must be positive");
    logical
        .chunks(logical_per_page)
        .map(|c| c.iter().copied().fold(f64::NEG_INFINITY, f64::max))
        .collect()
}
