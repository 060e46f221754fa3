//! Key statistics: per-channel minimum and maximum of the keys of each logical page.

use super::attend::check_len;
use crate::error::{LserveError, Result};

/// Per-logical-page key statistics of one KV head: `kmin`, `kmax` are `[pages][head_dim]`.
///
/// Page `p` covers tokens `p * logical_tokens .. min((p + 1) * logical_tokens, len)`: only
/// tokens that exist, so the last page may be partial.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyStats {
    /// Head dimension (`D`).
    pub head_dim: usize,
    /// Per-channel minimum of each logical page's keys, `[pages][head_dim]`.
    pub kmin: Vec<f32>,
    /// Per-channel maximum of each logical page's keys, `[pages][head_dim]`.
    pub kmax: Vec<f32>,
}

impl KeyStats {
    /// Number of logical pages.
    pub fn pages(&self) -> usize {
        self.kmin.len() / self.head_dim
    }

    /// `kmin` of logical page `page`.
    pub fn kmin(&self, page: usize) -> &[f32] {
        &self.kmin[page * self.head_dim..][..self.head_dim]
    }

    /// `kmax` of logical page `page`.
    pub fn kmax(&self, page: usize) -> &[f32] {
        &self.kmax[page * self.head_dim..][..self.head_dim]
    }
}

/// The statistics of one page: per-channel `(kmin, kmax)` over `rows` (each `head_dim` long).
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
            *lo = lo.min(x);
            *hi = hi.max(x);
        }
    }
    (kmin, kmax)
}

/// Key statistics of one KV head's keys `[len][head_dim]` over logical pages of
/// `logical_tokens` (`N_L`) tokens: `ceil(len / N_L)` pages, the last one over the tokens that
/// exist.
///
/// ```
/// use lserve::reference::key_stats;
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
    let mut stats = KeyStats {
        head_dim,
        kmin: Vec::new(),
        kmax: Vec::new(),
    };
    for page in keys.chunks(logical_tokens * head_dim) {
        let (lo, hi) = page_stats(page.chunks_exact(head_dim));
        stats.kmin.extend(lo);
        stats.kmax.extend(hi);
    }
    Ok(stats)
}
