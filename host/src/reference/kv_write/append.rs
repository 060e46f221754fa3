//! A decode token folded into the key statistics (the statistics part of the kernels'
//! `kv_write::append`).

use crate::dtype::Element;
use crate::error::{LserveError, Result};
use crate::paging::{HostKvCache, SequenceView};

/// Updates the key statistics of every dense head of `layer` for a token just written at
/// position `pos`: its logical page's `kmin`/`kmax` become the key itself if `pos` starts the
/// logical page, else their per-channel min/max with the key.
///
/// Errors as [`pool_key_stats`](super::pool_key_stats).
pub fn update_key_stats<E: Element>(
    cache: &mut HostKvCache<E>,
    layer: usize,
    view: &SequenceView<'_>,
    pos: usize,
) -> Result<()> {
    cache.dense(layer)?;
    if pos >= view.len {
        return Err(LserveError::TokenNotStored {
            position: pos,
            len: view.len,
        });
    }
    let config = *cache.config();
    let (n_p, n_l) = (config.page_tokens, config.logical_page_tokens);
    let page = match cache.pattern().dense_heads(layer) {
        0 => return Ok(()),
        _ => view.block_table.physical(pos / n_p)?,
    };
    for head in 0..cache.pattern().dense_heads(layer) {
        let key = cache.dense(layer)?.key(page, head, pos % n_p)?.to_vec();
        let (kmin, kmax) = cache
            .dense_mut(layer)?
            .stats_mut(page, head, (pos % n_p) / n_l)?;
        let first = pos % n_l == 0;
        for ((lo, hi), &x) in kmin.iter_mut().zip(kmax.iter_mut()).zip(&key) {
            if first || x.to_f32() < lo.to_f32() {
                *lo = x;
            }
            if first || x.to_f32() > hi.to_f32() {
                *hi = x;
            }
        }
    }
    Ok(())
}
