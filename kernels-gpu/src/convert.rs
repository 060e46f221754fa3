//! 16-bit floating-point element types and their conversions to and from `f32`.
//!
//! On the device a bf16 or f16 value is just its bits (`u16`); two of them packed in a `u32`
//! (element with the lower index in the low half) are what `mma.sync` and `ldmatrix` move.
//! [`Bf16`] and [`F16`] are zero-sized markers that select the element type of a kernel or an
//! `mma` fragment at compile time.
//!
//! `f32 -> 16 bit` rounds to nearest, ties to even (`cvt.rn`), so results match `half`'s
//! `from_f32` on the host bit for bit (NaN payloads aside). `16 bit -> f32` is exact.

use core::arch::asm;

/// A 16-bit float type the tensor cores take (bf16 or f16), as a compile-time marker.
pub trait Half16: Copy + 'static {
    /// `x` rounded to nearest-even, as bits.
    fn from_f32(x: f32) -> u16;

    /// The exact `f32` value of `bits`.
    fn to_f32(bits: u16) -> f32;

    /// Two values rounded to nearest-even and packed: `lo` in bits 0..16, `hi` in bits 16..32.
    fn pack2(lo: f32, hi: f32) -> u32;

    /// The two values of a packed pair, `(lo, hi)`.
    #[inline(always)]
    fn unpack2(pair: u32) -> (f32, f32) {
        (Self::to_f32(pair as u16), Self::to_f32((pair >> 16) as u16))
    }
}

/// bfloat16 (8-bit exponent, 7-bit mantissa).
#[derive(Clone, Copy, Debug)]
pub struct Bf16;

/// IEEE binary16 (5-bit exponent, 10-bit mantissa).
#[derive(Clone, Copy, Debug)]
pub struct F16;

impl Half16 for Bf16 {
    #[inline(always)]
    fn from_f32(x: f32) -> u16 {
        let bits: u16;
        // SAFETY: register-only conversion (sm_80+).
        unsafe {
            asm!("cvt.rn.bf16.f32 {0}, {1};", out(reg16) bits, in(reg32) x,
                 options(pure, nomem, nostack));
        }
        bits
    }

    #[inline(always)]
    fn to_f32(bits: u16) -> f32 {
        // bf16 is the upper half of an f32: widening is a shift, exact (and works on sm_80,
        // where `cvt.f32.bf16` does not exist).
        f32::from_bits((bits as u32) << 16)
    }

    #[inline(always)]
    fn pack2(lo: f32, hi: f32) -> u32 {
        let pair: u32;
        // SAFETY: register-only conversion. `cvt.rn.bf16x2.f32 d, a, b` puts `a` in the upper
        // half and `b` in the lower half of `d`.
        unsafe {
            asm!("cvt.rn.bf16x2.f32 {0}, {1}, {2};", out(reg32) pair, in(reg32) hi, in(reg32) lo,
                 options(pure, nomem, nostack));
        }
        pair
    }
}

impl Half16 for F16 {
    #[inline(always)]
    fn from_f32(x: f32) -> u16 {
        let bits: u16;
        // SAFETY: register-only conversion.
        unsafe {
            asm!("cvt.rn.f16.f32 {0}, {1};", out(reg16) bits, in(reg32) x,
                 options(pure, nomem, nostack));
        }
        bits
    }

    #[inline(always)]
    fn to_f32(bits: u16) -> f32 {
        let x: f32;
        // SAFETY: register-only conversion (exact: every f16 is an f32).
        unsafe {
            asm!("cvt.f32.f16 {0}, {1};", out(reg32) x, in(reg16) bits,
                 options(pure, nomem, nostack));
        }
        x
    }

    #[inline(always)]
    fn pack2(lo: f32, hi: f32) -> u32 {
        let pair: u32;
        // SAFETY: register-only conversion; `a` (here `hi`) goes to the upper half.
        unsafe {
            asm!("cvt.rn.f16x2.f32 {0}, {1}, {2};", out(reg32) pair, in(reg32) hi, in(reg32) lo,
                 options(pure, nomem, nostack));
        }
        pair
    }
}
