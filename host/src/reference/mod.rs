//! The CPU reference of every LServe operation: the executable specification.
//!
//! Everything here is written for clarity, not speed. Inputs are `f32` (convert bf16/f16 with
//! [`to_f32_vec`]); every dot product, softmax and sum accumulates in `f64`; outputs are `f64`
//! (the GPU writes the element type and is compared by relative error, `docs/ARCHITECTURE.md`
//! "Equivalence rules"). Semantics follow `docs/ARCHITECTURE.md` ("Semantics pinned down here")
//! exactly.
//!
//! The modules mirror the kernel modules of `lserve-kernels` (`kernels-gpu/src/`), one
//! reference module per kernel module, under the same name:
//! - [`kv_write`]: the KV cache writes and the key statistics (`kmin`/`kmax` per logical page:
//!   on plain slices, pooled over a token range of the cache, updated by a decode token);
//! - [`select`]: query-aware page selection (logical-page scores, GQA aggregation,
//!   physical-page scores, top-K with the always-include rules) and its reuse across steps;
//! - [`decode`]: decode attention (one query row over explicit rows, a GQA group over a token
//!   set, a layer's batch over index tables) and a whole decode step of a layer for a batch;
//! - [`quant`]: the quantized KV formats' codes and 8-bit key statistics (the quantized kernels'
//!   rounding rules; [`crate::quant`] has the formats);
//! - [`prefill`]: prefill attention of a ragged batch (causal / Λ per KV head, optional caller
//!   block mask, LSE per row), on plain slices or a layer on the crate's types.
//!
//! Functions on plain slices take explicit parameters; those on the crate's types take what a
//! GPU launch takes (the [`KvCacheManager`](crate::paging::KvCacheManager), the
//! [`HostKvCache`](crate::paging::HostKvCache) with the device's layout, the
//! [`IndexTables`](crate::index_table::IndexTables), activations in the element type).
//!
//! ```
//! use lserve::reference::prefill::{prefill_attention, PrefillInput};
//! use lserve::reference::TokenPattern;
//! // One sequence of 3 tokens, one head, D = 2: causal attention.
//! let q = [1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0];
//! let k = q;
//! let v = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
//! let out = prefill_attention(&PrefillInput {
//!     cu_seqlens: &[0, 3],
//!     q: &q, k: &k, v: &v,
//!     q_heads: 1, kv_heads: 1, head_dim: 2,
//!     patterns: &[TokenPattern::Causal],
//!     block_mask: None,
//!     scale: 1.0,
//! })
//! .unwrap();
//! // The first token sees only itself.
//! assert_eq!(&out.out[0..2], &[1.0, 2.0]);
//! ```

use crate::dtype::Element;
use crate::error::{LserveError, Result};

pub mod decode;
pub mod kv_write;
pub mod prefill;
pub mod quant;
pub mod select;

/// Converts a slice of elements (bf16, f16, or anything with a lossless conversion to `f32`) to
/// `f32`, the reference's input precision.
///
/// ```
/// let x = [half::bf16::from_f32(1.5), half::bf16::from_f32(-2.0)];
/// assert_eq!(lserve::reference::to_f32_vec(&x), vec![1.5, -2.0]);
/// ```
pub fn to_f32_vec<T: Copy + Into<f32>>(xs: &[T]) -> Vec<f32> {
    xs.iter().map(|&x| x.into()).collect()
}

/// The token-level attention pattern of a KV head: which keys a query position sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenPattern {
    /// Dense (retrieval) head: causal, query `t` sees every key `j <= t`.
    Causal,
    /// Streaming head: the Λ mask, query `t` sees key `j` iff `j <= t` and
    /// (`j < sink_tokens` or `t - j < local_tokens`).
    Lambda {
        /// Attention-sink tokens kept from the start of the sequence.
        sink_tokens: usize,
        /// Most recent tokens kept (the query itself counts as one of them).
        local_tokens: usize,
    },
}

impl TokenPattern {
    /// Whether query position `t` sees key position `j` under this pattern.
    ///
    /// ```
    /// use lserve::reference::TokenPattern;
    /// let p = TokenPattern::Lambda { sink_tokens: 2, local_tokens: 3 };
    /// let seen: Vec<usize> = (0..10).filter(|&j| p.visible(9, j)).collect();
    /// assert_eq!(seen, vec![0, 1, 7, 8, 9]);
    /// assert!(TokenPattern::Causal.visible(9, 5) && !TokenPattern::Causal.visible(5, 9));
    /// ```
    pub fn visible(&self, t: usize, j: usize) -> bool {
        match *self {
            TokenPattern::Causal => j <= t,
            TokenPattern::Lambda {
                sink_tokens,
                local_tokens,
            } => j <= t && (j < sink_tokens || t - j < local_tokens),
        }
    }
}

impl TokenPattern {
    /// Checks the pattern's one rule, the same for prefill and decode (and as
    /// [`SparsityConfig::validate`](crate::config::SparsityConfig::validate) and the GPU paths
    /// check it): a Λ mask keeps at least one local token (the query itself), so
    /// `local_tokens == 0` is `InvalidConfig { field: "local_tokens" }`.
    ///
    /// ```
    /// use lserve::reference::TokenPattern;
    /// assert!(TokenPattern::Lambda { sink_tokens: 4, local_tokens: 1 }.validate().is_ok());
    /// assert!(TokenPattern::Lambda { sink_tokens: 4, local_tokens: 0 }.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<()> {
        match *self {
            TokenPattern::Lambda {
                local_tokens: 0, ..
            } => Err(LserveError::InvalidConfig {
                field: "local_tokens",
                reason: "a streaming head needs local_tokens >= 1".into(),
            }),
            _ => Ok(()),
        }
    }
}

/// Elements of the cache or the activations as `f32` (exact for bf16 and f16).
pub(crate) fn to_f32<E: Element>(xs: &[E]) -> Vec<f32> {
    xs.iter().map(|x| x.to_f32()).collect()
}

/// `Err(ShapeMismatch)` unless `actual == expected`.
pub(crate) fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(LserveError::ShapeMismatch {
            what,
            expected,
            actual,
        })
    }
}

/// `Err(InvalidArgument)` unless the softmax scale is finite and positive (as
/// [`SparsityConfig::validate`](crate::config::SparsityConfig::validate) requires of an explicit
/// one).
pub(crate) fn check_scale(scale: f64) -> Result<()> {
    if scale.is_finite() && scale > 0.0 {
        Ok(())
    } else {
        Err(LserveError::InvalidArgument {
            what: "scale",
            reason: format!("{scale} is not finite and > 0"),
        })
    }
}
