//! Prefill's cache write of a token range (the kernels' `kv_write::rows`, then
//! `kv_write::pool`).

use super::pool_key_stats;
use crate::dtype::Element;
use crate::error::{LserveError, Result};
use crate::paging::{HostKvCache, SequenceView};
use crate::reference::check_len;

/// Writes tokens `first..first + n` of a sequence into `layer` of the cache (`k`, `v` are
/// `[n][Hkv][D]`) and pools the dense heads' key statistics over them: what prefill does to
/// the cache. The tokens must have been reserved (`first + n <= view.len`).
///
/// Errors (nothing written): `ShapeMismatch` for `k`/`v`; `TokenNotStored` past `view.len`;
/// `InvalidArgument` if `first + n` overflows; any token's
/// [`HostKvCache::write_token`] error (e.g. `PageOutOfRange` for a cache sized for a smaller
/// pool), every token checked before the first is written.
///
/// ```
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::{HostKvCache, KvCacheManager};
/// use lserve::reference::kv_write::write_tokens;
///
/// let g = ModelGeometry::new(1, 1, 1, 64)?;
/// let config = SparsityConfig { page_tokens: 4, logical_page_tokens: 2, token_budget: 4,
///                               ..Default::default() };
/// let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), config, 4, 1, 16)?;
/// let mut cache = HostKvCache::<bf16>::for_manager(&mgr)?;
/// let seq = mgr.add_sequence()?;
/// mgr.reserve(seq, 3)?;
/// let k: Vec<bf16> = (0..3 * 64).map(|i| bf16::from_f32((i % 7) as f32)).collect();
/// write_tokens(&mut cache, 0, &mgr.view(seq)?, 0, &k, &k)?;
/// let page = mgr.block_table(seq)?.physical(0)?;
/// let (kmin, kmax) = cache.dense(0)?.stats(page, 0, 1)?; // logical page 1: token 2 only
/// assert_eq!((kmin, kmax), (&k[128..192], &k[128..192]));
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn write_tokens<E: Element>(
    cache: &mut HostKvCache<E>,
    layer: usize,
    view: &SequenceView<'_>,
    first: usize,
    k: &[E],
    v: &[E],
) -> Result<()> {
    let g = *cache.pattern().geometry();
    let row = g.kv_heads() * g.head_dim();
    check_len("k", k.len() / row * row, k.len())?;
    check_len("v", k.len(), v.len())?;
    let n = k.len() / row;
    let end = first
        .checked_add(n)
        .ok_or_else(|| LserveError::InvalidArgument {
            what: "first",
            reason: format!("{first} + {n} tokens overflows usize"),
        })?;
    if end > view.len {
        return Err(LserveError::TokenNotStored {
            position: end - 1,
            len: view.len,
        });
    }
    // Every token checked before the first write: a failed call changes nothing.
    for pos in first..end {
        cache.check_write(layer, view, pos)?;
    }
    for i in 0..n {
        cache.write_token(
            layer,
            view,
            first + i,
            &k[i * row..][..row],
            &v[i * row..][..row],
        )?;
    }
    pool_key_stats(cache, layer, view, first..first + n)
}
