//! Per-channel minimum and maximum of keys, in the element type (exact: the min or max of values
//! of `E` is one of them).
//!
//! Comparisons are strict and in `f32` (`E -> f32` is exact): a channel keeps its current bound
//! unless the new key is strictly below (above) it. That is the CPU reference's rule
//! (`update_key_stats` and `page_stats`): a NaN in a logical page's first key stays in that
//! channel's bounds, a NaN in a later key is never taken, and of `-0.0` and `+0.0` the first is
//! kept.

use crate::convert::Half16;
use crate::math::Vec16;
use crate::unroll8;

/// Per 16-bit half of the packed pairs `x` and `bound`: `x`'s half where `wins(x, bound)` (as
/// `f32`), else `bound`'s.
#[inline(always)]
fn select_pair<E: Half16>(x: u32, bound: u32, wins: impl Fn(f32, f32) -> bool) -> u32 {
    let (x_lo, x_hi) = E::unpack2(x);
    let (b_lo, b_hi) = E::unpack2(bound);
    let lo = if wins(x_lo, b_lo) { x } else { bound } & 0x0000_ffff;
    let hi = if wins(x_hi, b_hi) { x } else { bound } & 0xffff_0000;
    lo | hi
}

/// Running per-channel bounds of 8 channels.
#[derive(Clone, Copy)]
pub struct Bounds {
    /// Per-channel minimum.
    pub lo: Vec16,
    /// Per-channel maximum.
    pub hi: Vec16,
}

impl Bounds {
    /// The bounds of a single key.
    #[inline(always)]
    pub fn of(key: Vec16) -> Self {
        Self { lo: key, hi: key }
    }

    /// Widens the bounds to include `key`: a channel's bound changes only if the key is strictly
    /// outside it.
    #[inline(always)]
    pub fn include<E: Half16>(&mut self, key: Vec16) {
        // Unrolled in the source: a register array indexed by a loop LLVM keeps rolled moves to
        // local memory.
        unroll8!(w in 0..4 => {
            self.lo.0[w] = select_pair::<E>(key.0[w], self.lo.0[w], |x, b| x < b);
            self.hi.0[w] = select_pair::<E>(key.0[w], self.hi.0[w], |x, b| x > b);
        });
    }
}
