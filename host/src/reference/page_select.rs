//! Query-aware page selection: logical-page scores, GQA aggregation, physical-page scores,
//! top-K with the always-include rules (`docs/ARCHITECTURE.md`, "Page selection").

use super::attend::check_len;
use super::KeyStats;
use crate::config::GqaAggregation;
use crate::error::{LserveError, Result};

/// The parameters of one page selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectionParams {
    /// Logical pages per physical page (`g = N_P / N_L`).
    pub logical_per_page: usize,
    /// Physical pages chosen by score (`K = token_budget / N_P`), besides the always-included.
    pub top_k: usize,
    /// Whether physical page 0 (the attention sink) is always selected.
    pub always_include_first: bool,
    /// GQA aggregation of the group's logical scores.
    pub aggregation: GqaAggregation,
}

/// The outcome of [`select_pages`].
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    /// The selected physical pages (logical page numbers of the sequence's physical pages:
    /// index into its block table), ascending.
    pub pages: Vec<u32>,
    /// The score of every physical page of the sequence (also the non-candidates), so a test can
    /// tell near-ties apart.
    pub physical_scores: Vec<f64>,
}

/// Scores of one query head against every logical page:
/// `S(j) = Σ_i max(q[i] · kmax_j[i], q[i] · kmin_j[i])`, in `f64` (an upper bound of `q · k` over
/// the page's keys; unscaled).
///
/// # Panics
/// If `q.len() != stats.head_dim`.
pub fn logical_scores(q: &[f32], stats: &KeyStats) -> Vec<f64> {
    assert_eq!(q.len(), stats.head_dim, "query length");
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

/// Top-K physical pages with the always-include rules, ascending.
///
/// With `P = scores.len()` pages, the newest page is `P - 1`. Candidates are all pages except
/// the newest (and except page 0 when `always_include_first`). The `k` candidates with the
/// highest score win, ties to the lower page index (all candidates if there are at most `k`).
/// The result is top-K ∪ {newest} ∪ ({0} if `always_include_first`), in ascending order.
///
/// ```
/// use lserve::reference::top_k_pages;
/// let scores = [5.0, 1.0, 3.0, 3.0, 0.0, -9.0];
/// // Candidates 1..=4 (page 0 always included, page 5 newest); 2 and 3 tie, 2 wins.
/// assert_eq!(top_k_pages(&scores, 1, true), vec![0, 2, 5]);
/// assert_eq!(top_k_pages(&scores, 2, false), vec![0, 2, 5]);
/// assert_eq!(top_k_pages(&scores, 9, false), vec![0, 1, 2, 3, 4, 5]);
/// assert_eq!(top_k_pages(&[], 4, true), Vec::<u32>::new());
/// ```
pub fn top_k_pages(scores: &[f64], k: usize, always_include_first: bool) -> Vec<u32> {
    let pages = scores.len();
    if pages == 0 {
        return Vec::new();
    }
    let newest = pages - 1;
    let first_candidate = usize::from(always_include_first);
    let mut candidates: Vec<usize> = (first_candidate..newest).collect();
    // Score descending, then page index ascending.
    candidates.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    candidates.truncate(k);
    candidates.push(newest);
    if always_include_first {
        candidates.push(0);
    }
    candidates.sort_unstable();
    candidates.dedup();
    candidates.into_iter().map(|p| p as u32).collect()
}

/// Page selection of one dense KV head: scores the logical pages of `stats` for each query
/// head of the group (`q_group` is `[G][head_dim]`), aggregates over the group, takes the max
/// over each physical page's logical pages, and runs [`top_k_pages`].
///
/// Errors: `InvalidArgument` for `logical_per_page == 0`; `Empty` if `stats` has no pages or
/// `q_group` is empty; `ShapeMismatch` if `q_group` is not a whole number of `head_dim` rows.
///
/// ```
/// use lserve::config::GqaAggregation;
/// use lserve::reference::{key_stats, select_pages, SelectionParams};
/// // D = 1, N_L = 1, N_P = 2: 5 keys make physical pages {0,1}, {2,3}, {4}.
/// let stats = key_stats(&[0.0, -1.0, 4.0, 0.0, 0.0], 1, 1).unwrap();
/// let params = SelectionParams {
///     logical_per_page: 2,
///     top_k: 1,
///     always_include_first: false,
///     aggregation: GqaAggregation::Max,
/// };
/// let s = select_pages(&[1.0], &stats, &params).unwrap();
/// assert_eq!(s.physical_scores, vec![0.0, 4.0, 0.0]);
/// assert_eq!(s.pages, vec![1, 2]);
/// ```
pub fn select_pages(
    q_group: &[f32],
    stats: &KeyStats,
    params: &SelectionParams,
) -> Result<Selection> {
    if params.logical_per_page == 0 {
        return Err(LserveError::InvalidArgument {
            what: "logical_per_page",
            reason: "must be positive".into(),
        });
    }
    if stats.pages() == 0 {
        return Err(LserveError::Empty("key statistics"));
    }
    if q_group.is_empty() {
        return Err(LserveError::Empty("query group"));
    }
    let d = stats.head_dim;
    check_len("q_group", q_group.len() / d * d, q_group.len())?;
    let per_head: Vec<Vec<f64>> = q_group
        .chunks_exact(d)
        .map(|q| logical_scores(q, stats))
        .collect();
    let logical = aggregate_scores(&per_head, params.aggregation);
    let physical_scores = physical_scores(&logical, params.logical_per_page);
    let pages = top_k_pages(&physical_scores, params.top_k, params.always_include_first);
    Ok(Selection {
        pages,
        physical_scores,
    })
}
