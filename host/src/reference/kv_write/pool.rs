//! Key-statistics pooling over the cache (the kernels' `kv_write::pool`).

use std::ops::Range;

use super::page_stats;
use crate::dtype::Element;
use crate::error::{LserveError, Result};
use crate::paging::{HostKvCache, SequenceView};
use crate::reference::to_f32;

/// Pools the key statistics of every dense head of `layer` for the logical pages that hold a
/// token of `tokens`: each such page's `kmin`/`kmax` is recomputed from the keys in the cache,
/// over the page's tokens that exist (below `view.len`). Call after writing those tokens (e.g.
/// after prefill).
///
/// Errors (nothing written): `InvalidArgument` for a layer out of range or a block table that
/// lacks a page; `TokenNotStored` if `tokens` reaches past `view.len`; `PageOutOfRange` for a
/// page past the cache's capacity. Every page is checked before the first is pooled.
pub fn pool_key_stats<E: Element>(
    cache: &mut HostKvCache<E>,
    layer: usize,
    view: &SequenceView<'_>,
    tokens: Range<usize>,
) -> Result<()> {
    cache.dense(layer)?;
    if tokens.end > view.len {
        return Err(LserveError::TokenNotStored {
            position: tokens.end - 1,
            len: view.len,
        });
    }
    if tokens.is_empty() {
        return Ok(());
    }
    let config = *cache.config();
    let (n_p, n_l) = (config.page_tokens, config.logical_page_tokens);
    let dense = cache.pattern().dense_heads(layer);
    if dense == 0 {
        return Ok(());
    }
    let d = cache.pattern().geometry().head_dim();
    let logical_pages = tokens.start / n_l..=(tokens.end - 1) / n_l;
    // Every page checked before the first write: a failed pooling changes nothing.
    let capacity = cache.dense(layer)?.layout().capacity;
    for logical in logical_pages.clone() {
        let page = view.block_table.physical(logical * n_l / n_p)?;
        if page >= capacity {
            return Err(LserveError::PageOutOfRange { page, capacity });
        }
    }
    for head in 0..dense {
        for logical in logical_pages.clone() {
            let rows = logical * n_l..((logical + 1) * n_l).min(view.len);
            let page = view.block_table.physical(rows.start / n_p)?;
            let pool = cache.dense(layer)?;
            let keys = rows
                .map(|t| pool.key(page, head, t % n_p).map(to_f32))
                .collect::<Result<Vec<_>>>()?;
            let (lo, hi) = page_stats(keys.iter().map(Vec::as_slice));
            debug_assert_eq!(lo.len(), d);
            let (kmin, kmax) =
                cache
                    .dense_mut(layer)?
                    .stats_mut(page, head, (logical * n_l % n_p) / n_l)?;
            for i in 0..d {
                kmin[i] = E::from_f32(lo[i]);
                kmax[i] = E::from_f32(hi[i]);
            }
        }
    }
    Ok(())
}
