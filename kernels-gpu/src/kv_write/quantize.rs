//! INT8 or INT4 codes of one K or V row per token and head, computed by the `D / 8` lanes that
//! hold the row's chunks: the reference's rule (`lserve::reference::quant::codes`) in the same
//! arithmetic, so the codes and the row word are those of `quantize_rows` bit for bit.
//!
//! - The row's minimum `lo` and maximum `hi` in f32 (exact: the elements are 16-bit), in the
//!   total order of finite floats (`-0.0 < +0.0`, as `f32::total_cmp`), so the result does not
//!   depend on the order the lanes combine in; reduced by butterfly shuffles among the row's lanes
//!   only.
//! - The minimum `m`: the largest bf16 not above `lo` (a bit operation on `lo`).
//! - The scale `s`: the smallest bf16 not below `(hi - m) / L` (`L` the largest code, 255 or
//!   15), the quotient in f64 as in the
//!   reference (`sub.rn.f64`, `div.rn.f64`), rounded up to f32 (`cvt.rp`) and then to bf16 (every
//!   bf16 is an f32, so the smallest bf16 above the f32 is the smallest above the quotient).
//! - Each code the integer nearest to the exact `(x - m) / s` (ties to even), within `0..=L`;
//!   0 where `s` is 0. An estimate `k` from an approximate reciprocal of `s` (`rcp.approx`, one
//!   per row) is within one of it; the ends `m + (k ± 1/2) s` of `k`'s rounding interval are
//!   exact in f64 (`fma`; the reference says why), so comparing `x` with them moves `k` to the
//!   nearest integer exactly. Per element that is a subtraction, a multiply, two `fma` and
//!   compares in f64 instead of a division (tried `div.rn.f64` per element: the append took 5.4
//!   µs instead of the 16-bit append's 2.7, H200, 2026-12-02).
//! - A row with a non-finite element, or whose `m` or `s` is not finite, gets the bf16 NaN for
//!   both and codes 0.

use core::arch::asm;

use crate::convert::Half16;
use crate::math::Vec16;
use crate::unroll8;
use crate::warp::{group_members, group_shfl_xor_u32};

/// bf16 NaN bits (`half::bf16::NAN`).
pub(super) const BF16_NAN: u32 = 0x7fc0;

/// The largest code of `bits`-bit codes.
#[inline(always)]
const fn levels(bits: u32) -> f64 {
    ((1u32 << bits) - 1) as f64
}

/// One chunk (8 channels) of a coded row in the row layout (`lserve::quant`), and the row's word
/// `(s, m)` (scale bits 0..16, minimum bits 16..32; every lane of the row holds it).
#[derive(Clone, Copy)]
pub struct CodedChunk {
    /// The 8 codes: INT8 channel `i` in byte `i % 4` of word `i / 4`; INT4 channel `i` in bits
    /// `4 i .. 4 i + 4` of word 0 (channel `2b` the low nibble of byte `b`), word 1 zero.
    pub codes: [u32; 2],
    /// The row's `(s, m)` word.
    pub word: u32,
}

/// `x`'s key in the total order of floats, as a signed integer (`f32::total_cmp`'s).
#[inline(always)]
pub(super) fn ordered(x: f32) -> i32 {
    let b = x.to_bits() as i32;
    b ^ ((((b >> 31) as u32) >> 1) as i32)
}

/// The float of an [`ordered`] key.
#[inline(always)]
pub(super) fn from_ordered(k: i32) -> f32 {
    f32::from_bits((k ^ ((((k >> 31) as u32) >> 1) as i32)) as u32)
}

/// The largest bf16 not above `x` (finite `x`), as bits.
#[inline(always)]
pub(super) fn bf16_down(x: f32) -> u32 {
    let (b, t) = (x.to_bits(), x.to_bits() >> 16);
    // Truncation rounds toward zero: down for a positive value, up for a negative one.
    if b & 0xffff != 0 && b >> 31 != 0 {
        t + 1
    } else {
        t
    }
}

/// The smallest bf16 not below `x` (`x >= 0` or any finite), as bits; `+inf` above bf16's range.
#[inline(always)]
pub(super) fn bf16_up(x: f32) -> u32 {
    let (b, t) = (x.to_bits(), x.to_bits() >> 16);
    if b & 0xffff != 0 && b >> 31 == 0 {
        t + 1
    } else {
        t
    }
}

/// The f32 of bf16 bits.
#[inline(always)]
pub(super) fn bf16_value(bits: u32) -> f32 {
    f32::from_bits(bits << 16)
}

/// Whether bf16 bits are finite.
#[inline(always)]
pub(super) fn bf16_finite(bits: u32) -> bool {
    bits & 0x7f80 != 0x7f80
}

/// The smallest f32 not below `x` (`cvt.rp.f32.f64`).
#[inline(always)]
pub(super) fn f32_up(x: f64) -> f32 {
    let y: f32;
    // SAFETY: register-only conversion.
    unsafe {
        asm!("cvt.rp.f32.f64 {0}, {1};", out(reg32) y, in(reg64) x,
             options(pure, nomem, nostack));
    }
    y
}

/// `x` rounded to the nearest integer (ties to even), as an f64 clamped to `0..=levels`.
#[inline(always)]
fn round_clamped(x: f64, levels: f64) -> f64 {
    let k: f64;
    // SAFETY: register-only rounding.
    unsafe {
        asm!("cvt.rni.f64.f64 {0}, {1};", out(reg64) k, in(reg64) x,
             options(pure, nomem, nostack));
    }
    k.clamp(0.0, levels)
}

/// An approximation of `1 / x` (`rcp.approx.ftz.f64`; `x` a normal f64).
#[inline(always)]
fn rcp_approx(x: f64) -> f64 {
    let y: f64;
    // SAFETY: register-only arithmetic.
    unsafe {
        asm!("rcp.approx.ftz.f64 {0}, {1};", out(reg64) y, in(reg64) x,
             options(pure, nomem, nostack));
    }
    y
}

/// `a * b + c` rounded once (`fma.rn.f64`).
#[inline(always)]
fn fma64(a: f64, b: f64, c: f64) -> f64 {
    let y: f64;
    // SAFETY: register-only arithmetic.
    unsafe {
        asm!("fma.rn.f64 {0}, {1}, {2}, {3};", out(reg64) y, in(reg64) a, in(reg64) b,
             in(reg64) c, options(pure, nomem, nostack));
    }
    y
}

/// The code of `x` for scale `s > 0` (finite), minimum `m`, `r ≈ 1 / s` and largest code
/// `levels` (the module's rule).
#[inline(always)]
fn code_of(x: f64, s: f64, m: f64, r: f64, levels: f64) -> u32 {
    let mut k = round_clamped((x - m) * r, levels);
    let (lo, hi) = (fma64(k - 0.5, s, m), fma64(k + 0.5, s, m));
    // `k` is an integer below 2^8: its parity is its low bit.
    let odd = (k as u32) & 1 != 0;
    if x > hi || (x == hi && odd) {
        k += 1.0;
    } else if x < lo || (x == lo && odd) {
        k -= 1.0;
    }
    k.clamp(0.0, levels) as u32
}

/// Quantizes one chunk `x` of a row whose `lanes` chunks (`D / 8`) are held by the aligned group
/// of `lanes` lanes this one belongs to, to `BITS`-bit codes (8 or 4; the module's rule).
///
/// # Safety
/// Every lane of the group calls it together (the others may have exited), with the same
/// `lanes`, a power of two up to 32.
#[inline(always)]
pub unsafe fn quantize_chunk<E: Half16, const BITS: u32>(x: Vec16, lanes: u32) -> CodedChunk {
    let levels = levels(BITS);
    let v = x.to_f32::<E>();
    let (mut lo, mut hi, mut finite) = (i32::MAX, i32::MIN, 1u32);
    unroll8!(i in 0..8 => {
        let k = ordered(v[i]);
        lo = lo.min(k);
        hi = hi.max(k);
        finite &= (v[i].abs() < f32::INFINITY) as u32;
    });
    let members = group_members(lanes);
    let mut offset = 1;
    while offset < lanes {
        // SAFETY: the group's lanes call this together (caller), the partner lane is in the
        // group (`offset < lanes`, groups aligned).
        unsafe {
            lo = lo.min(group_shfl_xor_u32(lo as u32, offset, members) as i32);
            hi = hi.max(group_shfl_xor_u32(hi as u32, offset, members) as i32);
            finite &= group_shfl_xor_u32(finite, offset, members);
        }
        offset <<= 1;
    }
    let m_bits = bf16_down(from_ordered(lo));
    let m = bf16_value(m_bits) as f64;
    let s_bits = bf16_up(f32_up((from_ordered(hi) as f64 - m) / levels));
    if finite == 0 || !bf16_finite(m_bits) || !bf16_finite(s_bits) {
        return CodedChunk {
            codes: [0, 0],
            word: BF16_NAN | BF16_NAN << 16,
        };
    }
    let s = bf16_value(s_bits) as f64;
    let mut codes = [0u32; 2];
    if s != 0.0 {
        let r = rcp_approx(s);
        unroll8!(i in 0..8 => {
            let code = code_of(v[i] as f64, s, m, r, levels);
            if BITS == 4 {
                codes[0] |= code << (4 * i);
            } else {
                codes[i / 4] |= code << (8 * (i % 4));
            }
        });
    }
    CodedChunk {
        codes,
        word: s_bits | m_bits << 16,
    }
}
