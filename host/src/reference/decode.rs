//! Decode attention on plain slices: which tokens a decode query sees, and attention of a GQA
//! group over a chosen token set.

use super::attend::{attend_rows, check_len, Attended};
use super::TokenPattern;
use crate::error::{LserveError, Result};

/// The token positions (ascending) of the physical pages `pages` of a sequence of `len` tokens
/// with pages of `page_tokens` (`N_P`) tokens: only tokens that exist.
///
/// ```
/// assert_eq!(lserve::reference::tokens_of_pages(&[0, 2], 3, 8), vec![0, 1, 2, 6, 7]);
/// ```
pub fn tokens_of_pages(pages: &[u32], page_tokens: usize, len: usize) -> Vec<usize> {
    let mut tokens: Vec<usize> = pages
        .iter()
        .flat_map(|&p| {
            let start = p as usize * page_tokens;
            start.min(len)..(start + page_tokens).min(len)
        })
        .collect();
    tokens.sort_unstable();
    tokens.dedup();
    tokens
}

/// The token positions (ascending) the decode query at position `len - 1` sees under `pattern`:
/// all `len` tokens for [`TokenPattern::Causal`], sink + last-local tokens for the Λ mask.
///
/// ```
/// use lserve::reference::{decode_tokens, TokenPattern};
/// let p = TokenPattern::Lambda { sink_tokens: 2, local_tokens: 3 };
/// assert_eq!(decode_tokens(p, 10), vec![0, 1, 7, 8, 9]);
/// assert_eq!(decode_tokens(p, 4), vec![0, 1, 2, 3]);
/// ```
pub fn decode_tokens(pattern: TokenPattern, len: usize) -> Vec<usize> {
    match len.checked_sub(1) {
        None => Vec::new(),
        Some(t) => (0..len).filter(|&j| pattern.visible(t, j)).collect(),
    }
}

/// Decode attention of a GQA group: each query head of `q_group` (`[G][head_dim]`) attends over
/// the rows `tokens` of one KV head's `keys` and `values` (`[len][head_dim]`), softmax over that
/// set only. Returns one [`Attended`] per query head.
///
/// Errors: `Empty` if `tokens` or `q_group` is empty; `InvalidArgument` for `head_dim == 0` or
/// a token out of range; `ShapeMismatch` for buffers that are not whole rows or differ in size.
///
/// ```
/// use lserve::reference::attend_tokens;
/// // Two query heads, D = 1, three tokens; attend tokens 0 and 2 only.
/// let out = attend_tokens(&[0.0, 0.0], &[1.0, 2.0, 3.0], &[10.0, 99.0, 20.0], 1, &[0, 2], 1.0)
///     .unwrap();
/// assert_eq!(out[0].out, vec![15.0]);
/// assert_eq!(out[1].out, vec![15.0]);
/// ```
pub fn attend_tokens(
    q_group: &[f32],
    keys: &[f32],
    values: &[f32],
    head_dim: usize,
    tokens: &[usize],
    scale: f64,
) -> Result<Vec<Attended>> {
    if head_dim == 0 {
        return Err(LserveError::InvalidArgument {
            what: "head_dim",
            reason: "must be positive".into(),
        });
    }
    if tokens.is_empty() {
        return Err(LserveError::Empty("token set"));
    }
    if q_group.is_empty() {
        return Err(LserveError::Empty("query group"));
    }
    check_len(
        "q_group",
        q_group.len() / head_dim * head_dim,
        q_group.len(),
    )?;
    check_len("keys", keys.len() / head_dim * head_dim, keys.len())?;
    check_len("values", keys.len(), values.len())?;
    let len = keys.len() / head_dim;
    if let Some(&t) = tokens.iter().find(|&&t| t >= len) {
        return Err(LserveError::InvalidArgument {
            what: "tokens",
            reason: format!("token {t} out of range (length {len})"),
        });
    }
    let k: Vec<&[f32]> = tokens
        .iter()
        .map(|&t| &keys[t * head_dim..][..head_dim])
        .collect();
    let v: Vec<&[f32]> = tokens
        .iter()
        .map(|&t| &values[t * head_dim..][..head_dim])
        .collect();
    Ok(q_group
        .chunks_exact(head_dim)
        .map(|q| attend_rows(q, &k, &v, scale))
        .collect())
}
