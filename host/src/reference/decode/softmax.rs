//! Softmax attention of query rows over an explicit set of key/value rows, in `f64`: what the
//! kernels' `decode::online_softmax` and `decode::combine` compute in pieces (one pass over all
//! rows here).

use crate::error::{LserveError, Result};
use crate::reference::{check_len, check_scale};

/// The result of attending one query row: the output row and the log-sum-exp of the scaled
/// scores (natural log; `lse = m + ln Σ exp(s_j - m)` with `s_j = scale · q·k_j`).
#[derive(Clone, Debug, PartialEq)]
pub struct Attended {
    /// `Σ_j softmax(s)_j · v_j`, `D` values.
    pub out: Vec<f64>,
    /// Log-sum-exp of the scaled scores.
    pub lse: f64,
}

/// Dot product of two `f32` rows, accumulated in `f64`.
fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Attends `q` over the rows `keys[j]`, `values[j]` (all of length `q.len()`): softmax over
/// exactly this set of rows, `f64` throughout. The order of the rows does not matter (up to
/// rounding).
///
/// `scale` is used as given (a checked entry rejects one that is not finite and positive).
///
/// # Panics
/// If `keys` is empty, `keys.len() != values.len()`, or a row's length differs from `q.len()`
/// (the callers in the reference validate first; use [`decode_attention`] for a checked entry).
pub fn attend_rows(q: &[f32], keys: &[&[f32]], values: &[&[f32]], scale: f64) -> Attended {
    assert!(!keys.is_empty(), "attention over an empty key set");
    assert_eq!(keys.len(), values.len(), "keys and values differ in count");
    let d = q.len();
    let scores: Vec<f64> = keys
        .iter()
        .map(|k| {
            assert_eq!(k.len(), d, "key row length");
            scale * dot(q, k)
        })
        .collect();
    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scores.iter().map(|&s| (s - m).exp()).collect();
    let sum: f64 = weights.iter().sum();
    let mut out = vec![0.0f64; d];
    for (w, v) in weights.iter().zip(values) {
        assert_eq!(v.len(), d, "value row length");
        for (o, &x) in out.iter_mut().zip(v.iter()) {
            *o += w * x as f64;
        }
    }
    for o in &mut out {
        *o /= sum;
    }
    Attended {
        out,
        lse: m + sum.ln(),
    }
}

/// Decode attention of one query head over an explicit list of key/value rows: `keys` and
/// `values` are `[n][head_dim]` (row-major), `q` is `[head_dim]`.
///
/// Errors: `InvalidArgument` for `head_dim == 0` or a scale that is not finite and positive;
/// `Empty` for no keys; `ShapeMismatch` for buffers that are not whole rows or differ in size.
///
/// ```
/// use lserve::reference::decode::decode_attention;
/// // Two keys; equal scores, so the output is the mean of the values.
/// let a = decode_attention(&[0.0, 0.0], &[1.0, 2.0, 3.0, 4.0], &[1.0, 0.0, 3.0, 2.0], 2, 0.5)
///     .unwrap();
/// assert_eq!(a.out, vec![2.0, 1.0]);
/// assert!((a.lse - 2f64.ln()).abs() < 1e-15);
/// ```
pub fn decode_attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    head_dim: usize,
    scale: f64,
) -> Result<Attended> {
    if head_dim == 0 {
        return Err(LserveError::InvalidArgument {
            what: "head_dim",
            reason: "must be positive".into(),
        });
    }
    check_scale(scale)?;
    check_len("q", head_dim, q.len())?;
    if keys.is_empty() {
        return Err(LserveError::Empty("key set"));
    }
    if keys.len() % head_dim != 0 {
        return Err(LserveError::ShapeMismatch {
            what: "keys",
            expected: keys.len() / head_dim * head_dim,
            actual: keys.len(),
        });
    }
    check_len("values", keys.len(), values.len())?;
    let k: Vec<&[f32]> = keys.chunks_exact(head_dim).collect();
    let v: Vec<&[f32]> = values.chunks_exact(head_dim).collect();
    Ok(attend_rows(q, &k, &v, scale))
}

/// Decode attention of a GQA group: each query head of `q_group` (`[G][head_dim]`) attends over
/// the rows `tokens` of one KV head's `keys` and `values` (`[len][head_dim]`), softmax over that
/// set only. Returns one [`Attended`] per query head.
///
/// Errors: `Empty` if `tokens` or `q_group` is empty; `InvalidArgument` for `head_dim == 0`, a
/// scale that is not finite and positive, or a token out of range; `ShapeMismatch` for buffers
/// that are not whole rows or differ in size.
///
/// ```
/// use lserve::reference::decode::attend_tokens;
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
    check_scale(scale)?;
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
