//! Fast transcendental and vector helpers shared by the attention kernels.

use core::arch::asm;

use crate::convert::Half16;

/// `2^x` with the hardware's approximate `ex2` (relative error ~2^-22; `-inf -> 0`).
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    let y: f32;
    // SAFETY: register-only instruction.
    unsafe {
        asm!("ex2.approx.ftz.f32 {0}, {1};", out(reg32) y, in(reg32) x, options(pure, nomem, nostack))
    };
    y
}

/// `log2(x)` with the hardware's approximate `lg2` (absolute error ~2^-22 near 1, relative
/// ~2^-22 elsewhere; `0 -> -inf`).
#[inline(always)]
pub fn log2(x: f32) -> f32 {
    let y: f32;
    // SAFETY: register-only instruction.
    unsafe {
        asm!("lg2.approx.f32 {0}, {1};", out(reg32) y, in(reg32) x, options(pure, nomem, nostack))
    };
    y
}

/// `a * b + c` rounded once (`fma.rn.f32`). rustc never contracts a multiply and an add (and
/// emits them as `mul.rn` / `add.rn`, which ptxas may not fuse either), so every dot product and
/// accumulation in the kernels goes through this: one instruction instead of two.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    let d: f32;
    // SAFETY: register-only instruction.
    unsafe {
        asm!("fma.rn.f32 {0}, {1}, {2}, {3};", out(reg32) d, in(reg32) a, in(reg32) b,
             in(reg32) c, options(pure, nomem, nostack));
    }
    d
}

/// A power of two `scale` that puts `largest` (a row's largest magnitude) in `[2^15, 2^16)`, and
/// `1 / scale`: a bf16 or f16 value times it is an exact f16 (but for the f16 subnormals of
/// values below 2^-29 of the largest), so a row of queries can meet f16 codes on the tensor
/// cores. Both stay normal f32 for a zero, tiny, infinite or NaN `largest` (the biased exponent
/// of `scale` is kept in 1..=253).
#[inline(always)]
pub fn pow2_scale(largest: f32) -> (f32, f32) {
    // `scale = 2^(15 - e)` for `largest = 1.x · 2^e`.
    let biased = ((largest.to_bits() >> 23) & 0xFF) as i32;
    let scale_biased = (269 - biased).clamp(1, 253) as u32;
    (
        f32::from_bits(scale_biased << 23),
        f32::from_bits((254 - scale_biased) << 23),
    )
}

/// `prmt.b32`: four bytes picked from the eight of `(a, b)` (bytes 0..4 of `a`, then 4..8 of
/// `b`); nibble `i` of `SEL` is the source byte of result byte `i`.
#[inline(always)]
pub fn byte_perm<const SEL: u32>(a: u32, b: u32) -> u32 {
    let d: u32;
    // SAFETY: register-only instruction.
    unsafe {
        asm!("prmt.b32 {0}, {1}, {2}, {3};", out(reg32) d, in(reg32) a, in(reg32) b,
             const SEL, options(pure, nomem, nostack));
    }
    d
}

/// `x`, computed where this is called: the compiler can neither hoist it nor what is derived
/// from it out of a loop, nor reassociate a sum through it. Used for addresses that are cheap to
/// recompute per iteration of the prefill KV loop, so that LLVM does not keep their
/// loop-invariant parts live across the loop beside the `S` and `O` accumulators. (On the K/V
/// global addresses of the 128-row prefill kernel it makes no difference to ptxas's spills; kept
/// because the kernels measured on the GPU have it.)
#[inline(always)]
pub fn opaque(x: usize) -> usize {
    let y: u64;
    // SAFETY: a register move; not `pure`, so it stays where it is called.
    unsafe {
        asm!("mov.b64 {0}, {1};", out(reg64) y, in(reg64) x as u64, options(nomem, nostack));
    }
    y as usize
}

/// [`opaque`] for a 32-bit value (a shared-window address).
#[inline(always)]
pub fn opaque_u32(x: u32) -> u32 {
    let y: u32;
    // SAFETY: as `opaque`.
    unsafe {
        asm!("mov.b32 {0}, {1};", out(reg32) y, in(reg32) x, options(nomem, nostack));
    }
    y
}

/// 16 bytes (eight 16-bit or four 32-bit elements, as bits), aligned so a load or store of it is
/// one vector access.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub struct Vec16(pub [u32; 4]);

impl Vec16 {
    /// The eight elements as `f32`, in memory order.
    #[inline(always)]
    pub fn to_f32<E: Half16>(self) -> [f32; 8] {
        let mut out = [0.0; 8];
        let mut i = 0;
        while i < 4 {
            let (lo, hi) = E::unpack2(self.0[i]);
            out[2 * i] = lo;
            out[2 * i + 1] = hi;
            i += 1;
        }
        out
    }

    /// Eight `f32` rounded to `E` and packed, in memory order.
    #[inline(always)]
    pub fn from_f32<E: Half16>(x: &[f32; 8]) -> Self {
        let mut words = [0u32; 4];
        let mut i = 0;
        while i < 4 {
            words[i] = E::pack2(x[2 * i], x[2 * i + 1]);
            i += 1;
        }
        Vec16(words)
    }
}

/// Runs `$body` once for each `$i` in `0..$n`, unrolled in the source: `$n` must be a constant
/// of at most 8 (a const generic such as a GQA group size). LLVM's own unroller gives up on
/// bodies this large, and a register array indexed by a loop that is not unrolled moves to local
/// memory; this keeps per-head state in registers.
#[macro_export]
macro_rules! unroll8 {
    ($i:ident in 0..$n:expr => $body:block) => {
        $crate::unroll8!(@each $i, $n, $body, 0 1 2 3 4 5 6 7)
    };
    (@each $i:ident, $n:expr, $body:block, $($k:literal)*) => {
        $(
            #[allow(clippy::reversed_empty_ranges, unused_comparisons, unconditional_panic)]
            if $k < $n {
                let $i: usize = $k;
                $body
            }
        )*
    };
}

/// [`unroll8!`] for constant bounds up to 16 (the `O` accumulators at `D = 128`).
#[macro_export]
macro_rules! unroll16 {
    ($i:ident in 0..$n:expr => $body:block) => {
        $crate::unroll8!(@each $i, $n, $body, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
}
