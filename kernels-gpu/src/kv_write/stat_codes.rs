//! 8-bit key statistics (`lserve_abi::buffers::StatCodesPtrs`): one logical page's `kmin`/`kmax`
//! bounds quantized by the lanes that hold them, the reference's rule
//! (`lserve::reference::quant::quantize_key_stats`) in the same arithmetic, so codes and words
//! are the reference's bit for bit.
//!
//! A group is [`STAT_GROUP_CHANNELS`] channels, i.e. [`GROUP_LANES`] aligned lanes of 8 channels:
//! - `lo`, `hi`: the minimum and maximum over both vectors of the group in the total order of
//!   floats, reduced by butterfly shuffles among the group's lanes; `m` the largest bf16 not above
//!   `lo`, `s` the smallest bf16 not below `(hi - m) / 255` (the quotient in f64), as the K/V
//!   codes' parameters ([`quantize`](super::quantize)).
//! - A `kmin` code is the largest `c` in `0..=255` with `fma(c, s, m) <= kmin` (f32), a `kmax`
//!   code the smallest with `fma(c, s, m) >= kmax`: an estimate from an approximate reciprocal of
//!   `s`, then moved while a neighbour also satisfies the rule (the f32 `fma` is monotone in
//!   `c`, so this ends at the one answer whatever the estimate). Codes are 0 where `s` is 0.
//! - Where code 255 does not reach some `kmax` of the group, `s` goes up by one bf16 step and
//!   the group is coded again (a vote of the group's lanes). (With 16-bit statistics this never
//!   happens; the rule is kept so the bound holds by construction.)
//! - A group with a value that is not finite, or whose `m` or `s` is not (also after a raise),
//!   gets the bf16 NaN for both and codes 0.

use lserve_abi::buffers::{StatCodesPtrs, STAT_GROUP_CHANNELS};
use lserve_abi::kv_write::CHUNK_ELEMS;

use super::quantize::{
    bf16_down, bf16_finite, bf16_up, bf16_value, f32_up, from_ordered, ordered, BF16_NAN,
};
use super::stats::Bounds;
use crate::convert::Half16;
use crate::math::{fma, Vec16};
use crate::unroll8;
use crate::warp::{group_members, group_shfl_xor_u32};

/// Lanes of one group of channels (8 channels each).
pub const GROUP_LANES: u32 = STAT_GROUP_CHANNELS / CHUNK_ELEMS;

/// The highest code.
const LEVELS: u32 = 255;

/// One chunk (8 channels) of a logical page's 8-bit statistics, as stored: the `kmin` codes in
/// bytes 0..8 and the `kmax` codes in bytes 8..16 of `codes`, and the group's `(s, m)` word.
#[derive(Clone, Copy)]
pub struct StatChunk {
    /// `kmin` codes `0..8`, then `kmax` codes `0..8`, channel `i` in byte `i % 4` of its word.
    pub codes: Vec16,
    /// The group's `(s, m)` word (scale bits 0..16, minimum bits 16..32).
    pub word: u32,
}

/// `fma(c, s, m)`: the value of code `c`.
#[inline(always)]
fn value(c: u32, s: f32, m: f32) -> f32 {
    fma(c as f32, s, m)
}

/// The largest code whose value is not above `x`, from the estimate `k`.
#[inline(always)]
fn floor_code(x: f32, s: f32, m: f32, mut k: u32) -> u32 {
    while k < LEVELS && value(k + 1, s, m) <= x {
        k += 1;
    }
    while k > 0 && value(k, s, m) > x {
        k -= 1;
    }
    k
}

/// The smallest code whose value is not below `x`, from the estimate `k` (255 if none is).
#[inline(always)]
fn ceil_code(x: f32, s: f32, m: f32, mut k: u32) -> u32 {
    while k > 0 && value(k - 1, s, m) >= x {
        k -= 1;
    }
    while k < LEVELS && value(k, s, m) < x {
        k += 1;
    }
    k
}

/// `x` reduced by `op` over the [`GROUP_LANES`] lanes of this lane's group.
///
/// # Safety
/// Every lane of the group calls it together.
#[inline(always)]
unsafe fn group_reduce(mut x: u32, op: impl Fn(u32, u32) -> u32) -> u32 {
    let members = group_members(GROUP_LANES);
    let mut offset = 1;
    while offset < GROUP_LANES {
        // SAFETY: the group's lanes are here together (caller); the partner is in the group.
        x = op(x, unsafe { group_shfl_xor_u32(x, offset, members) });
        offset <<= 1;
    }
    x
}

/// Quantizes this lane's 8 channels of a logical page's bounds `b` (the module's rule).
///
/// # Safety
/// The [`GROUP_LANES`] aligned lanes holding the group's chunks call it together (other lanes of
/// the warp may have exited or branched away).
#[inline(always)]
pub unsafe fn quantize_bounds<E: Half16>(b: Bounds) -> StatChunk {
    let (lo, hi) = (b.lo.to_f32::<E>(), b.hi.to_f32::<E>());
    let (mut min, mut max, mut finite) = (i32::MAX, i32::MIN, 1u32);
    unroll8!(i in 0..8 => {
        min = min.min(ordered(lo[i])).min(ordered(hi[i]));
        max = max.max(ordered(lo[i])).max(ordered(hi[i]));
        finite &= (lo[i].abs() < f32::INFINITY && hi[i].abs() < f32::INFINITY) as u32;
    });
    // SAFETY: the group's lanes are here together (caller).
    let (min, max, finite) = unsafe {
        (
            group_reduce(min as u32, |a, b| (a as i32).min(b as i32) as u32) as i32,
            group_reduce(max as u32, |a, b| (a as i32).max(b as i32) as u32) as i32,
            group_reduce(finite, |a, b| a & b),
        )
    };
    let m_bits = bf16_down(from_ordered(min));
    let mut s_bits = bf16_up(f32_up(
        (from_ordered(max) as f64 - bf16_value(m_bits) as f64) / LEVELS as f64,
    ));
    if finite == 0 || !bf16_finite(m_bits) || !bf16_finite(s_bits) {
        return StatChunk {
            codes: Vec16([0; 4]),
            word: BF16_NAN | BF16_NAN << 16,
        };
    }
    let m = bf16_value(m_bits);
    loop {
        let s = bf16_value(s_bits);
        let mut codes = Vec16([0; 4]);
        let mut reached = 1u32;
        if s != 0.0 {
            let r = 1.0 / s;
            unroll8!(i in 0..8 => {
                let k = (((lo[i] - m) * r) as u32).min(LEVELS);
                codes.0[i / 4] |= floor_code(lo[i], s, m, k) << (8 * (i % 4));
                let k = (((hi[i] - m) * r) as u32).min(LEVELS);
                let c = ceil_code(hi[i], s, m, k);
                reached &= (value(c, s, m) >= hi[i]) as u32;
                codes.0[2 + i / 4] |= c << (8 * (i % 4));
            });
        }
        // SAFETY: as above; every lane of the group takes the same branch after the vote.
        if unsafe { group_reduce(reached, |a, b| a & b) } != 0 {
            return StatChunk {
                codes,
                word: s_bits | m_bits << 16,
            };
        }
        s_bits += 1;
        if !bf16_finite(s_bits) {
            return StatChunk {
                codes: Vec16([0; 4]),
                word: BF16_NAN | BF16_NAN << 16,
            };
        }
    }
}

/// Where the cache keeps 8-bit statistics (`p.present()`), stores this lane's chunk of the
/// logical page whose bounds the group's lanes hold: `b` is the chunk at element offset `offset`
/// of `kmin`/`kmax` (`PagedLayout::stats_row` + `8 * chunk`).
///
/// # Safety
/// As [`quantize_bounds`]; `offset` is a chunk of the layer's statistics, and no other thread
/// writes that logical page's statistics.
#[inline(always)]
pub unsafe fn store_stat_codes<E: Half16>(p: &StatCodesPtrs, offset: usize, b: Bounds) {
    if !p.present() {
        return;
    }
    // SAFETY: forwarded.
    let q = unsafe { quantize_bounds::<E>(b) };
    // SAFETY: byte `2 * offset` starts the chunk's 16 code bytes (16-byte aligned: `offset` is a
    // multiple of 8), and word `offset / 32` is its group's, inside the plane (layout of
    // `StatCodesPtrs`); the group's first lane writes the word.
    unsafe {
        *(p.codes.get().add(2 * offset) as *mut Vec16) = q.codes;
        if (offset / CHUNK_ELEMS as usize) % GROUP_LANES as usize == 0 {
            *p.words.get().add(offset / STAT_GROUP_CHANNELS as usize) = q.word;
        }
    }
}
