//! The CPU reference of every LServe operation: the executable specification.
//!
//! Everything here is written for clarity, not speed. Inputs are `f32` (convert bf16/f16 with
//! [`to_f32_vec`]); every dot product, softmax and sum accumulates in `f64`; outputs are `f64`
//! (the GPU writes the element type and is compared by relative error, `docs/ARCHITECTURE.md`
//! "Equivalence rules"). Semantics follow `docs/ARCHITECTURE.md` ("Semantics pinned down here")
//! exactly.
//!
//! Two layers:
//! - pure functions over plain slices and explicit parameters:
//!   [`prefill_attention`] (causal / Λ per KV head, optional caller block mask, LSE per row),
//!   [`key_stats`] (per-logical-page `kmin`/`kmax`), [`logical_scores`], [`aggregate_scores`],
//!   [`physical_scores`], [`top_k_pages`] and [`select_pages`] (query-aware page selection),
//!   [`ReuseState`] (selection reuse across decode steps), [`decode_attention`] (one query head
//!   over explicit key/value rows), [`decode_tokens`] / [`tokens_of_pages`] / [`attend_tokens`]
//!   (a GQA group over the tokens a decode query sees);
//! - on the crate's types: [`prefill_layer`] (a layer's prefill from the head pattern, config
//!   and per-sequence [`BlockMask`](crate::block_iter::BlockMask)s), and in [`decode_step`] the
//!   paged-KV-cache pieces (statistics pooling and update, decode attention over index tables,
//!   a whole decode step of a layer for a batch).
//!
//! ```
//! use lserve::reference::{prefill_attention, PrefillInput, TokenPattern};
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

mod attend;
mod decode;
mod key_stats;
mod page_select;
mod prefill;
mod reuse;

pub mod decode_step;

pub use attend::{attend_rows, decode_attention, Attended};
pub use decode::{attend_tokens, decode_tokens, tokens_of_pages};
pub use key_stats::{key_stats, page_stats, KeyStats};
pub use page_select::{
    aggregate_scores, logical_scores, physical_scores, select_pages, top_k_pages, Selection,
    SelectionParams,
};
pub use prefill::{
    layer_token_patterns, prefill_attention, prefill_layer, BlockCoord, PrefillInput, PrefillOutput,
};
pub use reuse::{ReuseKey, ReuseState};

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
