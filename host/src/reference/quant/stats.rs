//! 8-bit key statistics that stay bounds: a logical page's `kmin`/`kmax` as codes `0..=255` with
//! a bf16 scale `s` and minimum `m` per page and group of channels (over both vectors of those
//! channels), `kmax` rounded up and `kmin` rounded down.
//!
//! Per group, with `lo = min kmin`, `hi = max kmax` over its channels: `m` is the largest bf16
//! not above `lo`, `s` the smallest bf16 not below `(hi - m) / 255`; then a `kmin` code is the
//! largest `c` in `0..=255` whose value `fma(c, s, m)` (f32, as the kernels compute it) is not
//! above `kmin`, a `kmax` code the smallest whose value is not below `kmax` (codes 0 where
//! `s = 0`; `s` raised by one bf16 step while code 255 cannot reach some `kmax`; a group whose
//! `s` would leave bf16's range is NaN). So, channel by channel, the dequantized
//! `kmax' >= kmax` and `kmin' <= kmin` in the arithmetic the selector uses, within one step
//! `s` of the exact values; each term `max(q_i kmax'_i, q_i kmin'_i)` is at least the exact
//! statistics' term, and the page score is still an upper bound of every key's `q · k`.
//!
//! The statistics quantized are those of the unquantized keys ([`KeyStats`] from
//! [`key_stats`](crate::reference::kv_write::key_stats) of the f32/bf16 keys), whatever format the
//! keys are then stored in. A group with a statistic that is not finite has `s = m = NaN`, and
//! every statistic of it dequantizes to NaN (as the bf16 statistics holding it would give a NaN
//! term).

use half::bf16;

use super::codes::GroupParams;
use super::round;
use crate::error::Result;
use crate::quant::StatsGroup;
use crate::reference::kv_write::KeyStats;

/// Highest 8-bit code.
const LEVELS: u32 = 255;

/// One KV head's key statistics in 8 bits: per logical page `D` codes of `kmin`, `D` of `kmax`,
/// and a [`GroupParams`] per group of channels.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantKeyStats {
    head_dim: usize,
    group: usize,
    kmin: Vec<u8>,
    kmax: Vec<u8>,
    params: Vec<GroupParams>,
}

/// Quantizes `stats` to 8 bits with one scale and minimum per page and `group` (rule in the
/// module docs).
///
/// Errors: `InvalidArgument` for a group the head dimension does not allow
/// ([`StatsGroup::group_channels`]).
///
/// ```
/// use lserve::quant::StatsGroup;
/// use lserve::reference::kv_write::key_stats;
/// use lserve::reference::quant::quantize_key_stats;
/// use lserve::reference::select::logical_scores;
/// let keys: Vec<f32> = (0..64).map(|i| ((i * 37) % 23) as f32 / 7.0 - 1.5).collect();
/// let exact = key_stats(&keys, 8, 4)?; // D = 8, logical pages of 4 keys
/// let q8 = quantize_key_stats(&exact, StatsGroup::Page)?;
/// let q = [0.5f32, -1.0, 0.25, 2.0, -0.75, 0.0, 1.0, -2.0];
/// let (bound, exact_bound) = (logical_scores(&q, &q8.dequantized()), logical_scores(&q, &exact));
/// assert!(bound.iter().zip(&exact_bound).all(|(b, e)| b >= e));
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn quantize_key_stats(stats: &KeyStats, group: StatsGroup) -> Result<QuantKeyStats> {
    let head_dim = stats.head_dim();
    let g = group.group_channels(head_dim)?;
    let mut out = QuantKeyStats {
        head_dim,
        group: g,
        kmin: Vec::with_capacity(stats.pages() * head_dim),
        kmax: Vec::with_capacity(stats.pages() * head_dim),
        params: Vec::with_capacity(stats.pages() * head_dim / g),
    };
    for page in 0..stats.pages() {
        for (lo, hi) in stats.kmin(page).chunks(g).zip(stats.kmax(page).chunks(g)) {
            let (p, lo_c, hi_c) = quantize_group(lo, hi);
            out.params.push(p);
            out.kmin.extend(lo_c);
            out.kmax.extend(hi_c);
        }
    }
    Ok(out)
}

/// One group's parameters and codes: `kmin` rounded down, `kmax` up, in the f32 `fma` the
/// kernels dequantize with.
fn quantize_group(kmin: &[f32], kmax: &[f32]) -> (GroupParams, Vec<u8>, Vec<u8>) {
    let nan = || {
        (
            GroupParams::from_parts(bf16::NAN, bf16::NAN),
            vec![0; kmin.len()],
            vec![0; kmax.len()],
        )
    };
    let mut p = GroupParams::of(kmin.iter().chain(kmax).copied(), LEVELS);
    if p.scale().is_nan() {
        return nan();
    }
    loop {
        if p.scale() == 0.0 {
            return (p, vec![0; kmin.len()], vec![0; kmax.len()]);
        }
        // `value` is monotone in the code (an f32 `fma` of a positive scale), so each rule is a
        // partition point of the 256 codes.
        let codes: Vec<u8> = (0..=LEVELS as u8).collect();
        // The largest code not above `x` (code 0 is `m <= kmin`).
        let lo: Vec<u8> = kmin
            .iter()
            .map(|&x| (codes.partition_point(|&c| p.value(c) <= x).max(1) - 1) as u8)
            .collect();
        // The smallest code not below `x`; none (256) if code 255 is below it.
        let hi: Vec<usize> = kmax
            .iter()
            .map(|&x| codes.partition_point(|&c| p.value(c) < x))
            .collect();
        if hi.iter().all(|&c| c <= LEVELS as usize) {
            return (p, lo, hi.into_iter().map(|c| c as u8).collect());
        }
        let up = round::next_up(bf16::from_f32(p.scale()));
        if !up.is_finite() {
            return nan();
        }
        p = GroupParams::from_parts(up, bf16::from_f32(p.min()));
    }
}

impl QuantKeyStats {
    /// Head dimension (`D`).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Number of logical pages.
    pub fn pages(&self) -> usize {
        self.kmin.len() / self.head_dim
    }

    /// Channels per scale.
    pub fn group_channels(&self) -> usize {
        self.group
    }

    /// The `kmin` code of channel `channel` of page `page`.
    ///
    /// # Panics
    /// If `page >= self.pages()` or `channel >= D`.
    pub fn kmin_code(&self, page: usize, channel: usize) -> u8 {
        assert!(channel < self.head_dim, "channel out of range");
        self.kmin[page * self.head_dim + channel]
    }

    /// The `kmax` code of channel `channel` of page `page`.
    ///
    /// # Panics
    /// If `page >= self.pages()` or `channel >= D`.
    pub fn kmax_code(&self, page: usize, channel: usize) -> u8 {
        assert!(channel < self.head_dim, "channel out of range");
        self.kmax[page * self.head_dim + channel]
    }

    /// Scale and minimum of group `group` of page `page`.
    ///
    /// # Panics
    /// If `page >= self.pages()` or `group` is not below `D / group_channels`.
    pub fn params(&self, page: usize, group: usize) -> GroupParams {
        let groups = self.head_dim / self.group;
        assert!(group < groups, "group out of range");
        self.params[page * groups + group]
    }

    /// The codes as a device cache lays them out (`lserve_abi::buffers::StatCodesPtrs`): per
    /// logical page and chunk of 8 channels the 8 `kmin` codes, then the 8 `kmax` codes.
    ///
    /// # Panics
    /// If `D` is not a multiple of 8 (no device layout).
    pub fn device_codes(&self) -> Vec<u8> {
        assert!(self.head_dim % 8 == 0, "the device layout needs D % 8 == 0");
        self.kmin
            .chunks(8)
            .zip(self.kmax.chunks(8))
            .flat_map(|(lo, hi)| lo.iter().chain(hi).copied())
            .collect()
    }

    /// Every group's `(s, m)` word in order (page, then group), as a device cache stores them
    /// ([`GroupParams::word`]).
    pub fn words(&self) -> Vec<u32> {
        self.params.iter().map(GroupParams::word).collect()
    }

    /// The statistics the selector sees: every code dequantized (`fma(c, s, m)` in f32), to score
    /// with [`logical_scores`](crate::reference::select::logical_scores).
    pub fn dequantized(&self) -> KeyStats {
        let value = |codes: &[u8]| -> Vec<f32> {
            codes
                .iter()
                .enumerate()
                .map(|(i, &c)| {
                    let (page, channel) = (i / self.head_dim, i % self.head_dim);
                    self.params(page, channel / self.group).value(c)
                })
                .collect()
        };
        KeyStats::new(self.head_dim, value(&self.kmin), value(&self.kmax))
            .expect("whole rows of a positive head dimension")
    }
}
