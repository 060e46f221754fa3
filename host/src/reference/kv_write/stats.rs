//! Key statistics: per-channel minimum and maximum of the keys of each logical page (the
//! kernels' `kv_write::stats`), on plain slices and as stored in the cache.

use crate::dtype::Element;
use crate::error::{LserveError, Result};
use crate::paging::{HostKvCache, SequenceView};
use crate::reference::check_len;

/// Per-logical-page key statistics of one KV head: `kmin`, `kmax` are `[pages][head_dim]`.
///
/// Page `p` covers tokens `p * logical_tokens .. min((p + 1) * logical_tokens, len)`: only
/// tokens that exist, so the last page may be partial. `head_dim` is positive and both buffers
/// hold whole rows (checked by [`KeyStats::new`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KeyStats {
    head_dim: usize,
    kmin: Vec<f32>,
    kmax: Vec<f32>,
}

impl KeyStats {
    /// Statistics from their rows: `kmin` and `kmax` are `[pages][head_dim]` each.
    ///
    /// Errors: `InvalidArgument` for `head_dim == 0`; `ShapeMismatch` unless `kmin` is whole
    /// rows and `kmax` is as long.
    ///
    /// ```
    /// use lserve::reference::kv_write::KeyStats;
    /// let s = KeyStats::new(2, vec![0.0, -1.0, 2.0, 3.0], vec![1.0, 0.0, 2.0, 4.0])?;
    /// assert_eq!((s.pages(), s.kmax(1)), (2, &[2.0, 4.0][..]));
    /// assert!(KeyStats::new(0, vec![], vec![]).is_err());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn new(head_dim: usize, kmin: Vec<f32>, kmax: Vec<f32>) -> Result<Self> {
        if head_dim == 0 {
            return Err(LserveError::InvalidArgument {
                what: "head_dim",
                reason: "must be positive".into(),
            });
        }
        check_len("kmin", kmin.len() / head_dim * head_dim, kmin.len())?;
        check_len("kmax", kmin.len(), kmax.len())?;
        Ok(Self {
            head_dim,
            kmin,
            kmax,
        })
    }

    /// Head dimension (`D`).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Number of logical pages.
    pub fn pages(&self) -> usize {
        self.kmin.len() / self.head_dim
    }

    /// `kmin` of logical page `page`.
    ///
    /// # Panics
    /// If `page >= self.pages()`.
    pub fn kmin(&self, page: usize) -> &[f32] {
        &self.kmin[page * self.head_dim..][..self.head_dim]
    }

    /// `kmax` of logical page `page`.
    ///
    /// # Panics
    /// If `page >= self.pages()`.
    pub fn kmax(&self, page: usize) -> &[f32] {
        &self.kmax[page * self.head_dim..][..self.head_dim]
    }
}

/// The statistics of one page: per-channel `(kmin, kmax)` over `rows` (each `head_dim` long).
///
/// The rule of [`update_key_stats`](super::update_key_stats) and of the kernels: the first row
/// sets both bounds; a later row replaces a bound only where it is strictly below (above) it, in
/// `f32`. So a NaN in the first row stays in that channel's bounds, a NaN in a later row is
/// never taken, and of `-0.0` and `+0.0` the first is kept (pooling and appending the same keys
/// give the same bits; `docs/ARCHITECTURE.md`, "Non-finite and extreme inputs").
///
/// ```
/// use lserve::reference::kv_write::page_stats;
/// let (lo, hi) = page_stats([&[f32::NAN, 1.0][..], &[2.0, f32::NAN][..], &[-1.0, 3.0][..]]);
/// assert!(lo[0].is_nan() && hi[0].is_nan());
/// assert_eq!((lo[1], hi[1]), (1.0, 3.0));
/// ```
///
/// # Panics
/// If `rows` is empty (a page with no tokens has no statistics).
pub fn page_stats<'a>(rows: impl IntoIterator<Item = &'a [f32]>) -> (Vec<f32>, Vec<f32>) {
    let mut rows = rows.into_iter();
    let first = rows.next().expect("page statistics of an empty page");
    let mut kmin = first.to_vec();
    let mut kmax = first.to_vec();
    for row in rows {
        for ((lo, hi), &x) in kmin.iter_mut().zip(kmax.iter_mut()).zip(row) {
            if x < *lo {
                *lo = x;
            }
            if x > *hi {
                *hi = x;
            }
        }
    }
    (kmin, kmax)
}

/// Key statistics of one KV head's keys `[len][head_dim]` over logical pages of
/// `logical_tokens` (`N_L`) tokens: `ceil(len / N_L)` pages, the last one over the tokens that
/// exist.
///
/// Errors: `InvalidArgument` for `head_dim == 0`, `logical_tokens == 0` or a page size
/// (`logical_tokens x head_dim`) that overflows; `ShapeMismatch` unless `keys` is whole rows.
///
/// ```
/// use lserve::reference::kv_write::key_stats;
/// // Three keys of D = 2, logical pages of 2 tokens: pages {0, 1} and {2}.
/// let s = key_stats(&[1.0, -1.0, 3.0, -2.0, 0.5, 0.25], 2, 2).unwrap();
/// assert_eq!(s.pages(), 2);
/// assert_eq!((s.kmin(0), s.kmax(0)), (&[1.0, -2.0][..], &[3.0, -1.0][..]));
/// assert_eq!((s.kmin(1), s.kmax(1)), (&[0.5, 0.25][..], &[0.5, 0.25][..]));
/// ```
pub fn key_stats(keys: &[f32], head_dim: usize, logical_tokens: usize) -> Result<KeyStats> {
    if head_dim == 0 || logical_tokens == 0 {
        return Err(LserveError::InvalidArgument {
            what: if head_dim == 0 {
                "head_dim"
            } else {
                "logical_tokens"
            },
            reason: "must be positive".into(),
        });
    }
    check_len("keys", keys.len() / head_dim * head_dim, keys.len())?;
    let page_elements =
        logical_tokens
            .checked_mul(head_dim)
            .ok_or_else(|| LserveError::InvalidArgument {
                what: "logical_tokens",
                reason: format!("{logical_tokens} x head_dim {head_dim} overflows"),
            })?;
    let mut stats = KeyStats {
        head_dim,
        kmin: Vec::new(),
        kmax: Vec::new(),
    };
    for page in keys.chunks(page_elements) {
        let (lo, hi) = page_stats(page.chunks_exact(head_dim));
        stats.kmin.extend(lo);
        stats.kmax.extend(hi);
    }
    Ok(stats)
}

/// The stored key statistics of dense KV head `kv_head` of `layer` for a sequence: its
/// `ceil(len / N_L)` logical pages in order, read from the cache (as `f32`).
///
/// Errors: `InvalidArgument` if `kv_head` is not dense; the cache's errors otherwise.
pub fn stored_key_stats<E: Element>(
    cache: &HostKvCache<E>,
    layer: usize,
    view: &SequenceView<'_>,
    kv_head: usize,
) -> Result<KeyStats> {
    let head = dense_index(cache, layer, kv_head)?;
    let config = cache.config();
    let (n_p, n_l) = (config.page_tokens, config.logical_page_tokens);
    let d = cache.pattern().geometry().head_dim();
    let mut stats = KeyStats {
        head_dim: d,
        kmin: Vec::new(),
        kmax: Vec::new(),
    };
    for logical in 0..view.len.div_ceil(n_l) {
        let page = view.block_table.physical(logical * n_l / n_p)?;
        let (lo, hi) = cache
            .dense(layer)?
            .stats(page, head, (logical * n_l % n_p) / n_l)?;
        stats.kmin.extend(lo.iter().map(|x| x.to_f32()));
        stats.kmax.extend(hi.iter().map(|x| x.to_f32()));
    }
    Ok(stats)
}

fn dense_index<E: Element>(cache: &HostKvCache<E>, layer: usize, kv_head: usize) -> Result<usize> {
    let pattern = cache.pattern();
    if layer >= pattern.geometry().layers() || kv_head >= pattern.geometry().kv_heads() {
        return Err(LserveError::InvalidArgument {
            what: "layer / kv_head",
            reason: format!("({layer}, {kv_head}) out of range"),
        });
    }
    pattern
        .dense_index(layer, kv_head)
        .ok_or_else(|| LserveError::InvalidArgument {
            what: "kv_head",
            reason: format!("KV head {kv_head} of layer {layer} is streaming"),
        })
}
