//! The reference of `lserve-kernels`' `prefill`: prefill attention of a ragged batch, causal for
//! dense heads, Λ for streaming heads, optionally intersected with a caller block mask (dynamic
//! prefill sparsity). Which keys a query sees ([`PrefillInput::visible`]) is what the kernels'
//! `prefill::block_iter` and `prefill::mask` decide per block and element; every row is one
//! softmax over exactly those keys ([`attend_rows`]).

use lserve_abi::prefill::{BLOCK_KV, BLOCK_Q};

use crate::block_iter::BlockMask;
use crate::config::SparsityConfig;
use crate::dtype::Element;
use crate::error::{LserveError, Result};
use crate::head_pattern::{HeadKind, HeadPattern};
use crate::reference::decode::attend_rows;
use crate::reference::{check_len, check_scale, to_f32, TokenPattern};

/// One bit of a caller block mask: may query block `q_block` of query head `q_head` in sequence
/// `seq` visit KV block `kv_block`? Blocks are sequence-local, `BLOCK_Q` queries and `BLOCK_KV`
/// keys (`lserve_abi::prefill`), so query `t` of a sequence is in block `t / BLOCK_Q`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockCoord {
    /// Sequence index in the batch.
    pub seq: usize,
    /// Query head.
    pub q_head: usize,
    /// Query block (sequence-local).
    pub q_block: usize,
    /// KV block (sequence-local).
    pub kv_block: usize,
}

/// The inputs of [`prefill_attention`], in the activation layouts of `docs/ARCHITECTURE.md`.
#[derive(Clone, Copy)]
pub struct PrefillInput<'a> {
    /// `B + 1` token offsets of the ragged batch: sequence `b` is tokens
    /// `cu_seqlens[b]..cu_seqlens[b + 1]`, at positions `0..len` within the sequence.
    pub cu_seqlens: &'a [usize],
    /// Queries, `[T][q_heads][head_dim]`.
    pub q: &'a [f32],
    /// Keys, `[T][kv_heads][head_dim]`.
    pub k: &'a [f32],
    /// Values, `[T][kv_heads][head_dim]`.
    pub v: &'a [f32],
    /// Query heads (`Hq`).
    pub q_heads: usize,
    /// KV heads (`Hkv`, divides `Hq`); query head `h` uses KV head `h / (Hq / Hkv)`.
    pub kv_heads: usize,
    /// Head dimension (`D`).
    pub head_dim: usize,
    /// The pattern of each KV head (`kv_heads` entries); its query heads follow it.
    pub patterns: &'a [TokenPattern],
    /// Optional caller block mask, intersected with the pattern; the diagonal block
    /// (`kv_block == q_block`) is always kept whatever the mask says.
    pub block_mask: Option<&'a dyn Fn(BlockCoord) -> bool>,
    /// Softmax scale (usually `1/sqrt(D)`), finite and `> 0`.
    pub scale: f64,
}

/// The result of [`prefill_attention`].
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillOutput {
    /// `[T][q_heads][head_dim]`.
    pub out: Vec<f64>,
    /// Log-sum-exp of each row's scaled scores, `[T][q_heads]`.
    pub lse: Vec<f64>,
}

impl PrefillInput<'_> {
    /// Whether query `t` of sequence `seq`, query head `q_head`, sees key `j` (both
    /// sequence-local positions): the head's token pattern, intersected with the caller block
    /// mask, the diagonal block always kept.
    pub fn visible(&self, seq: usize, q_head: usize, t: usize, j: usize) -> bool {
        let group = self.q_heads / self.kv_heads;
        if !self.patterns[q_head / group].visible(t, j) {
            return false;
        }
        let q_block = t / BLOCK_Q as usize;
        let kv_block = j / BLOCK_KV as usize;
        match self.block_mask {
            None => true,
            Some(mask) => {
                kv_block == q_block
                    || mask(BlockCoord {
                        seq,
                        q_head,
                        q_block,
                        kv_block,
                    })
            }
        }
    }

    fn validate(&self) -> Result<usize> {
        let invalid = |what, reason: &str| LserveError::InvalidArgument {
            what,
            reason: reason.into(),
        };
        if self.q_heads == 0 || self.kv_heads == 0 || self.q_heads % self.kv_heads != 0 {
            return Err(invalid(
                "q_heads",
                "kv_heads must be positive and divide q_heads",
            ));
        }
        if self.head_dim == 0 {
            return Err(invalid("head_dim", "must be positive"));
        }
        check_scale(self.scale)?;
        check_len("patterns", self.kv_heads, self.patterns.len())?;
        for p in self.patterns {
            p.validate()?;
        }
        if self.cu_seqlens.len() < 2 {
            return Err(LserveError::Empty("batch"));
        }
        if self.cu_seqlens[0] != 0 {
            return Err(invalid("cu_seqlens", "must start at 0"));
        }
        if self.cu_seqlens.windows(2).any(|w| w[1] <= w[0]) {
            return Err(LserveError::Empty("sequence"));
        }
        let tokens = *self.cu_seqlens.last().unwrap();
        let elements = |heads: usize| {
            tokens
                .checked_mul(heads)
                .and_then(|n| n.checked_mul(self.head_dim))
                .ok_or_else(|| invalid("cu_seqlens", "tokens x heads x head_dim overflows"))
        };
        check_len("q", elements(self.q_heads)?, self.q.len())?;
        check_len("k", elements(self.kv_heads)?, self.k.len())?;
        check_len("v", elements(self.kv_heads)?, self.v.len())?;
        Ok(tokens)
    }
}

/// Prefill attention of a ragged batch (each sequence starts at position 0).
///
/// Every query row attends, with softmax over exactly the keys [`PrefillInput::visible`] admits,
/// to the keys of its own sequence; accumulation in `f64`.
///
/// Errors: `InvalidArgument` for bad head counts, `head_dim == 0`, a scale that is not finite
/// and positive, `cu_seqlens` not starting at 0, or buffer sizes that overflow;
/// `InvalidConfig` for a streaming pattern with no local tokens ([`TokenPattern::validate`]);
/// `Empty` for an empty batch or a sequence of no tokens; `ShapeMismatch` for buffers of the
/// wrong size.
///
/// ```
/// use lserve::reference::prefill::{prefill_attention, PrefillInput};
/// use lserve::reference::TokenPattern;
/// // Two sequences (2 and 1 tokens), MHA with 2 heads of D = 1: head 0 causal, head 1 a Λ head
/// // with no sink and one local token (every query sees only itself).
/// let q = [1.0f32, 1.0, 1.0, 1.0, 1.0, 1.0];
/// let v = [1.0f32, 10.0, 2.0, 20.0, 3.0, 30.0];
/// let o = prefill_attention(&PrefillInput {
///     cu_seqlens: &[0, 2, 3],
///     q: &q, k: &q, v: &v,
///     q_heads: 2, kv_heads: 2, head_dim: 1,
///     patterns: &[TokenPattern::Causal, TokenPattern::Lambda { sink_tokens: 0, local_tokens: 1 }],
///     block_mask: None,
///     scale: 1.0,
/// })
/// .unwrap();
/// assert_eq!(o.out, vec![1.0, 10.0, 1.5, 20.0, 3.0, 30.0]);
/// ```
pub fn prefill_attention(input: &PrefillInput<'_>) -> Result<PrefillOutput> {
    let tokens = input.validate()?;
    let (hq, hkv, d) = (input.q_heads, input.kv_heads, input.head_dim);
    let group = hq / hkv;
    let mut out = vec![0.0f64; tokens * hq * d];
    let mut lse = vec![0.0f64; tokens * hq];
    for (seq, w) in input.cu_seqlens.windows(2).enumerate() {
        let (start, len) = (w[0], w[1] - w[0]);
        for h in 0..hq {
            let kvh = h / group;
            let key_row = |j: usize| &input.k[((start + j) * hkv + kvh) * d..][..d];
            let value_row = |j: usize| &input.v[((start + j) * hkv + kvh) * d..][..d];
            for t in 0..len {
                let seen: Vec<usize> = (0..len).filter(|&j| input.visible(seq, h, t, j)).collect();
                let keys: Vec<&[f32]> = seen.iter().map(|&j| key_row(j)).collect();
                let values: Vec<&[f32]> = seen.iter().map(|&j| value_row(j)).collect();
                let row = (start + t) * hq + h;
                let q = &input.q[row * d..][..d];
                let a = attend_rows(q, &keys, &values, input.scale);
                out[row * d..][..d].copy_from_slice(&a.out);
                lse[row] = a.lse;
            }
        }
    }
    Ok(PrefillOutput { out, lse })
}

/// The token patterns of `layer`'s KV heads: [`TokenPattern::Causal`] for dense heads, the Λ
/// mask with the config's sink and local tokens for streaming heads.
///
/// Errors: `InvalidConfig` for a config [`SparsityConfig::validate`] rejects; `InvalidArgument`
/// for a layer out of range.
///
/// ```
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::{HeadKind, HeadPattern};
/// use lserve::reference::prefill::layer_token_patterns;
/// use lserve::reference::TokenPattern;
///
/// let g = ModelGeometry::new(1, 2, 2, 64)?;
/// let pattern = HeadPattern::from_kinds(g, vec![vec![HeadKind::Dense, HeadKind::Streaming]])?;
/// let config = SparsityConfig::default();
/// let lambda = TokenPattern::Lambda { sink_tokens: 64, local_tokens: 256 };
/// assert_eq!(layer_token_patterns(&pattern, &config, 0)?, [TokenPattern::Causal, lambda]);
/// assert!(layer_token_patterns(&pattern, &config, 1).is_err()); // one layer only
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn layer_token_patterns(
    pattern: &HeadPattern,
    config: &SparsityConfig,
    layer: usize,
) -> Result<Vec<TokenPattern>> {
    config.validate()?;
    let layers = pattern.geometry().layers();
    if layer >= layers {
        return Err(LserveError::InvalidArgument {
            what: "layer",
            reason: format!("{layer} is not below {layers}"),
        });
    }
    Ok(pattern
        .layer_kinds(layer)
        .iter()
        .map(|kind| match kind {
            HeadKind::Dense => TokenPattern::Causal,
            HeadKind::Streaming => TokenPattern::Lambda {
                sink_tokens: config.sink_tokens,
                local_tokens: config.local_tokens,
            },
        })
        .collect())
}

/// Prefill attention of `layer` on the GPU path's types: `q [T][Hq][D]`, `k`, `v [T][Hkv][D]`
/// in the element type, the layer's head kinds from `pattern`, sink/local tokens and softmax
/// scale from `config`, and optionally one caller [`BlockMask`] per sequence. Converts to `f32`
/// and runs [`prefill_attention`].
///
/// Errors: `InvalidConfig` for a config [`SparsityConfig::validate`] rejects (checked first);
/// `InvalidArgument` for a layer out of range or a block-mask list of the wrong count; a block
/// mask whose shape does not fit its sequence; [`prefill_attention`]'s errors.
///
/// ```
/// use half::f16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::reference::prefill::prefill_layer;
///
/// let g = ModelGeometry::new(1, 2, 1, 64)?;
/// let x: Vec<f16> = (0..5 * 2 * 64).map(|i| f16::from_f32((i % 13) as f32 / 13.0)).collect();
/// let kv = &x[..5 * 64];
/// let cfg = SparsityConfig::default();
/// let o = prefill_layer(&HeadPattern::all_dense(g), &cfg, 0, &[0, 5], &x, kv, kv, None)?;
/// assert_eq!(o.out.len(), 5 * 2 * 64);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn prefill_layer<E: Element>(
    pattern: &HeadPattern,
    config: &SparsityConfig,
    layer: usize,
    cu_seqlens: &[usize],
    q: &[E],
    k: &[E],
    v: &[E],
    block_masks: Option<&[BlockMask]>,
) -> Result<PrefillOutput> {
    let g = *pattern.geometry();
    let patterns = layer_token_patterns(pattern, config, layer)?;
    if let Some(masks) = block_masks {
        if masks.len() + 1 != cu_seqlens.len() {
            return Err(LserveError::InvalidArgument {
                what: "block_masks",
                reason: format!(
                    "{} masks for {} sequences",
                    masks.len(),
                    cu_seqlens.len().saturating_sub(1)
                ),
            });
        }
        for (mask, w) in masks.iter().zip(cu_seqlens.windows(2)) {
            mask.check_shape(g.q_heads(), w[1].saturating_sub(w[0]))?;
        }
    }
    let bit = |c: BlockCoord| {
        let masks = block_masks.expect("only called with masks");
        masks[c.seq]
            .get(c.q_head, c.q_block, c.kv_block)
            .expect("shape checked")
    };
    let (q, k, v) = (to_f32(q), to_f32(k), to_f32(v));
    prefill_attention(&PrefillInput {
        cu_seqlens,
        q: &q,
        k: &k,
        v: &v,
        q_heads: g.q_heads(),
        kv_heads: g.kv_heads(),
        head_dim: g.head_dim(),
        patterns: &patterns,
        block_mask: block_masks.map(|_| &bit as &dyn Fn(BlockCoord) -> bool),
        scale: config.softmax_scale_for(g.head_dim()) as f64,
    })
}
