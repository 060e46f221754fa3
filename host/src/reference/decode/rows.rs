//! Which tokens a decode query attends to, on plain slices (the kernels' `decode::rows`).

use crate::error::Result;
use crate::reference::TokenPattern;

/// The token positions (ascending) of the physical pages `pages` of a sequence of `len` tokens
/// with pages of `page_tokens` (`N_P`) tokens: only tokens that exist.
///
/// ```
/// assert_eq!(lserve::reference::decode::tokens_of_pages(&[0, 2], 3, 8), vec![0, 1, 2, 6, 7]);
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
/// all `len` tokens for [`TokenPattern::Causal`], sink + last-local tokens for the Λ mask (none
/// for `len == 0`).
///
/// Errors: `InvalidConfig` for a Λ mask with no local tokens ([`TokenPattern::validate`], the
/// rule prefill applies).
///
/// ```
/// use lserve::reference::decode::decode_tokens;
/// use lserve::reference::TokenPattern;
/// let p = TokenPattern::Lambda { sink_tokens: 2, local_tokens: 3 };
/// assert_eq!(decode_tokens(p, 10)?, vec![0, 1, 7, 8, 9]);
/// assert_eq!(decode_tokens(p, 4)?, vec![0, 1, 2, 3]);
/// assert!(decode_tokens(TokenPattern::Lambda { sink_tokens: 2, local_tokens: 0 }, 10).is_err());
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn decode_tokens(pattern: TokenPattern, len: usize) -> Result<Vec<usize>> {
    pattern.validate()?;
    Ok(match len.checked_sub(1) {
        None => Vec::new(),
        Some(t) => (0..len).filter(|&j| pattern.visible(t, j)).collect(),
    })
}
