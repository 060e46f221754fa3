//! The reference of `lserve-kernels`' `select`: query-aware page selection
//! (`docs/ARCHITECTURE.md`, "Page selection" and "Reuse").
//!
//! - [`logical_scores`], [`aggregate_scores`], [`physical_scores`]: the page scores — the
//!   kernels' `select::score`;
//! - [`top_k_pages`]: top-K with the always-include rules — `select::top_k`;
//! - [`select_pages`] (plain slices) and [`select_from_cache`] (the cache's stored statistics):
//!   the two in one selection;
//! - [`ReuseState`]: the held selections and the rule that reuses them across decode steps —
//!   the held selections of `select::top_k` and the step counters of `select::steps`.

mod reuse;
mod score;
mod top_k;

pub use reuse::{ReuseKey, ReuseState};
pub use score::{aggregate_scores, logical_scores, physical_scores};
pub use top_k::top_k_pages;

use crate::config::GqaAggregation;
use crate::dtype::Element;
use crate::error::{LserveError, Result};
use crate::paging::{HostKvCache, SequenceView};
use crate::quant::StatsFormat;
use crate::reference::check_len;
use crate::reference::kv_write::{stored_key_stats, KeyStats};
use crate::reference::quant::quantize_key_stats;

/// The parameters of one page selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectionParams {
    /// Logical pages per selection unit: `g = N_P / N_L` when physical pages are selected, 1
    /// when logical pages are ([`SparsityConfig::logical_per_unit`](crate::config::SparsityConfig::logical_per_unit)).
    /// The "pages" of this module are the units.
    pub logical_per_page: usize,
    /// Units chosen by score (`K = token_budget / unit_tokens`), besides the always-included.
    pub top_k: usize,
    /// Whether unit 0 (the attention sink) is always selected.
    pub always_include_first: bool,
    /// GQA aggregation of the group's logical scores.
    pub aggregation: GqaAggregation,
}

/// The outcome of [`select_pages`].
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    /// The selected units in sequence order, ascending: physical pages as indices into the
    /// block table, or (logical-page selection) the sequence's logical page numbers.
    pub pages: Vec<u32>,
    /// The score of every unit of the sequence (also the non-candidates), so a test can tell
    /// near-ties apart.
    pub physical_scores: Vec<f64>,
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
/// use lserve::reference::kv_write::key_stats;
/// use lserve::reference::select::{select_pages, SelectionParams};
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
    let d = stats.head_dim();
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

/// Page selection for dense KV head `kv_head` of `layer` from the cache's stored statistics:
/// `q_group` is the group's queries `[G][D]` (as `f32`). See [`select_pages`]; the units are
/// the config's ([`SelectionUnit`](crate::config::SelectionUnit)). With 8-bit
/// statistics (`SparsityConfig::stats_format`) the scores are those of the stored statistics
/// quantized ([`quantize_key_stats`](crate::reference::quant::quantize_key_stats)) and
/// dequantized, as the device's selector reads them.
pub fn select_from_cache<E: Element>(
    cache: &HostKvCache<E>,
    layer: usize,
    view: &SequenceView<'_>,
    kv_head: usize,
    q_group: &[f32],
) -> Result<Selection> {
    let stats = stored_key_stats(cache, layer, view, kv_head)?;
    let c = cache.config();
    let stats = match c.stats_format {
        StatsFormat::Half => stats,
        StatsFormat::Int8(group) => quantize_key_stats(&stats, group)?.dequantized(),
    };
    let params = SelectionParams {
        logical_per_page: c.logical_per_unit(),
        top_k: c.pages_per_selection(),
        always_include_first: c.always_include_first_page,
        aggregation: c.gqa_aggregation,
    };
    select_pages(q_group, &stats, &params)
}
