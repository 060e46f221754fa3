//! Top-K physical pages with the always-include rules (the kernels' `select::top_k`).

/// Top-K physical pages with the always-include rules, ascending.
///
/// With `P = scores.len()` pages, the newest page is `P - 1`. Candidates are all pages except
/// the newest (and except page 0 when `always_include_first`). The `k` candidates with the
/// highest score win, ties to the lower page index (all candidates if there are at most `k`).
/// The result is top-K ∪ {newest} ∪ ({0} if `always_include_first`), in ascending order.
///
/// ```
/// use lserve::reference::select::top_k_pages;
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
