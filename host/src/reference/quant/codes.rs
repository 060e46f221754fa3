//! Integer codes of K/V rows: per group of channels a bf16 scale `s` and minimum `m`, per channel
//! a code `c` in `0..=levels`, the value `c · s + m`.
//!
//! Quantizing a group `x` (as the device's `quantize` step computes it too):
//! 1. `m` = the largest bf16 not above `min x` (the minimum in the total order of floats, so a
//!    zero minimum is `-0.0` if the group holds one, whatever the order); `s` = the smallest
//!    bf16 not below `(max x - m) / levels` with the difference and the quotient rounded to
//!    nearest in f64, so `[m, m + levels · s]` holds every `x`;
//! 2. `c` = the integer nearest to the exact quotient `(x - m) / s`, ties to even (0 where
//!    `s = 0`, i.e. all `x` equal `m`).
//!
//! Then `|x - (c · s + m)| <= s / 2` for every element, and the kernels' f32 `fma(c, s, m)` adds
//! at most half an ulp of the result. A group with a value that is not finite, or whose `m` or
//! `s` is not (values beyond bf16's range), has `s = m = NaN`: every element of it dequantizes to
//! NaN, as a NaN in a bf16 row reaches every output that reads the row.

use half::bf16;

use super::round;
use crate::error::Result;
use crate::quant::{CodeBits, IntFormat, GROUP_PARAM_BYTES};
use crate::reference::check_len;

/// A group's scale and minimum, as stored (bf16).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupParams {
    scale: bf16,
    min: bf16,
}

impl GroupParams {
    /// The parameters of a group holding `xs` for codes up to `levels` (rule in the module docs).
    pub(super) fn of(xs: impl IntoIterator<Item = f32> + Clone, levels: u32) -> Self {
        let nan = Self {
            scale: bf16::NAN,
            min: bf16::NAN,
        };
        if xs.clone().into_iter().any(|x| !x.is_finite()) {
            return nan;
        }
        // In the total order of floats (`-0.0 < +0.0`): the result does not depend on the
        // order the values are combined in (the kernels reduce a row across lanes).
        let (lo, hi) = xs
            .into_iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), x| {
                (
                    if x.total_cmp(&lo).is_lt() { x } else { lo },
                    if x.total_cmp(&hi).is_gt() { x } else { hi },
                )
            });
        let min = round::down(lo as f64);
        let scale = round::up((hi as f64 - min.to_f64()) / levels as f64);
        if !min.is_finite() || !scale.is_finite() {
            return nan;
        }
        Self { scale, min }
    }

    /// From stored bits.
    pub(super) fn from_parts(scale: bf16, min: bf16) -> Self {
        Self { scale, min }
    }

    /// The scale `s` (one code step).
    pub fn scale(&self) -> f32 {
        self.scale.to_f32()
    }

    /// The minimum `m` (the value of code 0).
    pub fn min(&self) -> f32 {
        self.min.to_f32()
    }

    /// The word a device cache stores for the group: the scale's bf16 bits in bits 0..16, the
    /// minimum's in bits 16..32 (`lserve_abi::decode::CodedKvPtrs`).
    ///
    /// ```
    /// use lserve::quant::{CodeBits, IntFormat, QuantGroup};
    /// use lserve::reference::quant::quantize_rows;
    /// let q = quantize_rows(&[0.0; 8], 8, IntFormat::new(CodeBits::Int8, QuantGroup::TokenHead)).unwrap();
    /// let w = q.params(0, 0).word();
    /// assert_eq!(f32::from_bits(w & 0xFFFF_0000), q.params(0, 0).min());
    /// ```
    pub fn word(&self) -> u32 {
        self.scale.to_bits() as u32 | (self.min.to_bits() as u32) << 16
    }

    /// The value of code `c`: `fma(c, s, m)` in f32, as the kernels compute it.
    pub fn value(&self, c: u8) -> f32 {
        (c as f32).mul_add(self.scale(), self.min())
    }

    /// The code of `x`: the integer nearest to the exact quotient `(x - m) / s` (ties to even),
    /// within `0..=levels`.
    ///
    /// An estimate `k` from the f64 quotient is within one of it; the ends `m + (k ± 1/2) s` of
    /// `k`'s rounding interval are exact in f64 (`s` has 8 significant bits, `k ± 1/2` 9, and
    /// `m + (k ± 1/2) s` spans less than 53 bits for rows of 16-bit values: `s` is at least the
    /// row's range over 255, and a nonzero range is at least `2^-11 |m|`), so comparing `x` with
    /// them moves `k` to the nearest integer exactly. The kernels compute the same with an
    /// approximate reciprocal for the estimate (`kernels-gpu/src/kv_write/quantize.rs`).
    pub(super) fn code(&self, x: f32, levels: u32) -> u8 {
        let (s, m) = (self.scale.to_f64(), self.min.to_f64());
        if s == 0.0 || s.is_nan() {
            return 0;
        }
        let x = x as f64;
        let mut k = ((x - m) / s).round_ties_even();
        let (lo, hi) = ((k - 0.5).mul_add(s, m), (k + 0.5).mul_add(s, m));
        let odd = k % 2.0 != 0.0;
        if x > hi || (x == hi && odd) {
            k += 1.0;
        } else if x < lo || (x == lo && odd) {
            k -= 1.0;
        }
        k.clamp(0.0, levels as f64) as u8
    }

    /// The stored bytes: `s` then `m`, bf16 little-endian.
    fn bytes(&self) -> [u8; GROUP_PARAM_BYTES] {
        let (s, m) = (self.scale.to_le_bytes(), self.min.to_le_bytes());
        [s[0], s[1], m[0], m[1]]
    }
}

/// K or V rows of one KV head quantized to an [`IntFormat`]: `[rows][D]` codes (one per
/// element, unpacked) and `[rows][groups]` parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedRows {
    format: IntFormat,
    head_dim: usize,
    group: usize,
    codes: Vec<u8>,
    params: Vec<GroupParams>,
}

/// Quantizes `rows` (`[rows][head_dim]`) to `format`, each group by the module's rule.
///
/// Errors: `InvalidArgument` for a head dimension or group the format does not allow
/// ([`IntFormat::group_channels`]); `ShapeMismatch` unless `rows` is whole rows.
pub fn quantize_rows(rows: &[f32], head_dim: usize, format: IntFormat) -> Result<QuantizedRows> {
    let group = format.group_channels(head_dim)?;
    check_len("rows", rows.len() / head_dim * head_dim, rows.len())?;
    let levels = format.bits.levels();
    let mut codes = Vec::with_capacity(rows.len());
    let mut params = Vec::with_capacity(rows.len() / group);
    for xs in rows.chunks_exact(group) {
        let p = GroupParams::of(xs.iter().copied(), levels);
        codes.extend(xs.iter().map(|&x| p.code(x, levels)));
        params.push(p);
    }
    Ok(QuantizedRows {
        format,
        head_dim,
        group,
        codes,
        params,
    })
}

impl QuantizedRows {
    /// The format.
    pub fn format(&self) -> IntFormat {
        self.format
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.codes.len() / self.head_dim
    }

    /// Code of channel `channel` of row `row`.
    ///
    /// # Panics
    /// If `row >= self.rows()` or `channel >= D`.
    pub fn code(&self, row: usize, channel: usize) -> u8 {
        assert!(channel < self.head_dim, "channel out of range");
        self.codes[row * self.head_dim + channel]
    }

    /// Parameters of group `group` of row `row`.
    ///
    /// # Panics
    /// If `row >= self.rows()` or `group` is not below the row's groups.
    pub fn params(&self, row: usize, group: usize) -> GroupParams {
        let groups = self.head_dim / self.group;
        assert!(group < groups, "group out of range");
        self.params[row * groups + group]
    }

    /// Row `row` dequantized (`fma(c, s, m)` in f32 per element).
    ///
    /// # Panics
    /// If `row >= self.rows()`.
    pub fn dequantize_row(&self, row: usize) -> Vec<f32> {
        (0..self.head_dim)
            .map(|c| self.params(row, c / self.group).value(self.code(row, c)))
            .collect()
    }

    /// Every row dequantized, `[rows][D]`.
    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.rows())
            .flat_map(|r| self.dequantize_row(r))
            .collect()
    }

    /// Row `row` in the cache's row layout ([`crate::quant`]): the codes (INT4: channel `2i` in
    /// the low nibble of byte `i`), then each group's `(s, m)` as bf16 little-endian;
    /// [`IntFormat::row_bytes`] long.
    ///
    /// # Panics
    /// If `row >= self.rows()`.
    pub fn stored_row(&self, row: usize) -> Vec<u8> {
        let codes = &self.codes[row * self.head_dim..][..self.head_dim];
        let mut out: Vec<u8> = match self.format.bits {
            CodeBits::Int8 => codes.to_vec(),
            CodeBits::Int4 => codes.chunks_exact(2).map(|c| c[0] | (c[1] << 4)).collect(),
        };
        for g in 0..self.head_dim / self.group {
            out.extend(self.params(row, g).bytes());
        }
        out
    }
}

/// Dequantizes one row from its stored bytes (the layout of [`QuantizedRows::stored_row`]), as a
/// kernel reading the cache does.
///
/// Errors: as [`IntFormat::row_bytes`]; `ShapeMismatch` unless `bytes` is one row long.
///
/// ```
/// use lserve::quant::{CodeBits, IntFormat, QuantGroup};
/// use lserve::reference::quant::{dequantize_stored_row, quantize_rows};
/// let format = IntFormat::new(CodeBits::Int4, QuantGroup::Channels(8));
/// let rows: Vec<f32> = (0..16).map(|i| i as f32 * 0.5 - 3.0).collect();
/// let q = quantize_rows(&rows, 16, format)?;
/// assert_eq!(dequantize_stored_row(&q.stored_row(0), 16, format)?, q.dequantize_row(0));
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn dequantize_stored_row(bytes: &[u8], head_dim: usize, format: IntFormat) -> Result<Vec<f32>> {
    let expected = format.row_bytes(head_dim)?;
    check_len("stored row", expected, bytes.len())?;
    let group = format.group_channels(head_dim)?;
    let code_bytes = format.code_bytes(head_dim)?;
    let (codes, params) = bytes.split_at(code_bytes);
    let code = |c: usize| match format.bits {
        CodeBits::Int8 => codes[c],
        CodeBits::Int4 => (codes[c / 2] >> (4 * (c % 2))) & 0xf,
    };
    let param = |g: usize| {
        let p = &params[g * GROUP_PARAM_BYTES..][..GROUP_PARAM_BYTES];
        GroupParams::from_parts(
            bf16::from_le_bytes([p[0], p[1]]),
            bf16::from_le_bytes([p[2], p[3]]),
        )
    };
    Ok((0..head_dim)
        .map(|c| param(c / group).value(code(c)))
        .collect())
}
