//! Sizes that reach the interesting values: small counts, powers of two and their neighbours, the
//! `u32` and `usize` boundaries.

use arbitrary::Arbitrary;

/// A `usize` drawn mostly from the values where size checks can go wrong.
#[derive(Arbitrary, Clone, Copy, Debug)]
pub enum Size {
    /// `0..=255`.
    Small(u8),
    /// `0..=65535`.
    Medium(u16),
    /// `2^k` (k below 64).
    Pow2(u8),
    /// `2^k - 1` (k in 1..=64).
    BelowPow2(u8),
    /// `u32::MAX - 2 ..= u32::MAX + 2`.
    NearU32(u8),
    /// `usize::MAX - 3 ..= usize::MAX`, and `isize::MAX`.
    NearUsize(u8),
    /// Any value.
    Raw(u64),
}

impl Size {
    /// The value.
    pub fn get(self) -> usize {
        match self {
            Size::Small(x) => x as usize,
            Size::Medium(x) => x as usize,
            Size::Pow2(k) => 1usize << (k % 64),
            Size::BelowPow2(k) => usize::MAX >> (63 - k % 64),
            Size::NearU32(d) => (u32::MAX as usize - 2) + (d % 5) as usize,
            Size::NearUsize(d) => match d % 5 {
                4 => isize::MAX as usize,
                d => usize::MAX - d as usize,
            },
            Size::Raw(x) => x as usize,
        }
    }
}

/// The product of `dims`, `None` on overflow.
pub fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// Whether `v` is in `1..=u32::MAX` (the rule of most sizes).
pub fn in_u32_range(v: usize) -> bool {
    v != 0 && u32::try_from(v).is_ok()
}
