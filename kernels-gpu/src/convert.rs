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

/// Integer codes as exact 16-bit values, centred: 8-bit codes `c` (0 ..= 255) as `c - 128`,
/// 4-bit codes (0 ..= 15) as `c - 8`. The integer-coded decode kernels multiply the centred codes
/// on the tensor cores and apply each row's scale and minimum to the products (`decode::coded`;
/// centred, the products and the row's offset term do not cancel). Every integer of magnitude up
/// to 256 is exact in bf16 and f16.
pub trait CodeElement: Half16 {
    /// Bytes 0 and 1 of `w`, centred, as a packed pair (byte 0 in the low half).
    fn codes_lo(w: u32) -> u32;

    /// Bytes 2 and 3 of `w`, centred, as a packed pair (byte 2 in the low half).
    fn codes_hi(w: u32) -> u32;

    /// The low nibbles of bytes 0 and 2 of `w`, centred, as a packed pair (byte 0's in the low
    /// half).
    fn nibbles_lo(w: u32) -> u32;

    /// The high nibbles of bytes 0 and 2 of `w`, centred, as a packed pair (byte 0's in the low
    /// half).
    fn nibbles_hi(w: u32) -> u32;
}

/// The `(s, m)` of a code row's or an 8-bit statistics group's word (`GroupParams::word` on the
/// host): the bf16 scale in bits 0..16 and the bf16 minimum in bits 16..32, as f32 (exact).
#[inline(always)]
pub fn word_params(word: u32) -> (f32, f32) {
    (
        f32::from_bits(word << 16),
        f32::from_bits(word & 0xFFFF_0000),
    )
}

/// What 8-bit codes are centred by.
pub const CODE_CENTRE: f32 = 128.0;

/// What 4-bit codes are centred by.
pub const NIBBLE_CENTRE: f32 = 8.0;

/// The low nibbles of bytes 0 and 2.
const NIBBLES_LO: u32 = 0x000F_000F;
/// The high nibbles of bytes 0 and 2.
const NIBBLES_HI: u32 = 0x00F0_00F0;

/// f32 bits `0x4B00_00cc` are `2^23 + c`: a byte becomes the f32 `c - 128` with one `prmt` and
/// one subtraction, and its bf16 is the f32's upper half (exact: `c - 128` has at most 8
/// significant bits).
const F32_MAGIC: u32 = 0x4B00_0000;
/// `2^23 + 128`.
const F32_MAGIC_CENTRE: f32 = 8_388_736.0;

/// bf16 codes through f32: per pair two `prmt` (the byte into `2^23 + c`), two subtractions and
/// one `prmt` (the upper halves).
impl CodeElement for Bf16 {
    #[inline(always)]
    fn codes_lo(w: u32) -> u32 {
        let lo = f32::from_bits(crate::math::byte_perm::<0x7540>(w, F32_MAGIC)) - F32_MAGIC_CENTRE;
        let hi = f32::from_bits(crate::math::byte_perm::<0x7541>(w, F32_MAGIC)) - F32_MAGIC_CENTRE;
        crate::math::byte_perm::<0x7632>(lo.to_bits(), hi.to_bits())
    }

    #[inline(always)]
    fn codes_hi(w: u32) -> u32 {
        let lo = f32::from_bits(crate::math::byte_perm::<0x7542>(w, F32_MAGIC)) - F32_MAGIC_CENTRE;
        let hi = f32::from_bits(crate::math::byte_perm::<0x7543>(w, F32_MAGIC)) - F32_MAGIC_CENTRE;
        crate::math::byte_perm::<0x7632>(lo.to_bits(), hi.to_bits())
    }

    #[inline(always)]
    fn nibbles_lo(w: u32) -> u32 {
        fma_bf16x2((w & NIBBLES_LO) | BF16_MAGIC, BF16_ONE, BF16_MINUS_136)
    }

    #[inline(always)]
    fn nibbles_hi(w: u32) -> u32 {
        Self::nibbles_lo(w >> 4)
    }
}

/// bf16 bits `0x430n` are `128 + n` (`n < 128`): a nibble pair is one `lop3` (the two nibbles
/// under `0x43`) and one `fma.rn.bf16x2` by `(1, -136)`, exact; a high nibble is shifted down first
/// (`16 n` does not fit bf16's 7 mantissa bits).
const BF16_MAGIC: u32 = 0x4300_4300;
/// `(1, 1)` as a bf16 pair.
const BF16_ONE: u32 = 0x3F80_3F80;
/// `(-136, -136)` as a bf16 pair (`-(128 + 8)`).
const BF16_MINUS_136: u32 = 0xC308_C308;

/// f16 bits `0x64cc` are `1024 + c`: a pair is one `prmt` (the two bytes under `0x64`) and one
/// `sub.f16x2` of `(1152, 1152)`, exact.
const F16_MAGIC: u32 = 0x6464_6464;
/// `(1024 + 128, 1024 + 128)` as an f16 pair.
const F16_1152: u32 = 0x6480_6480;

impl CodeElement for F16 {
    #[inline(always)]
    fn codes_lo(w: u32) -> u32 {
        sub_f16x2(crate::math::byte_perm::<0x4140>(w, F16_MAGIC), F16_1152)
    }

    #[inline(always)]
    fn codes_hi(w: u32) -> u32 {
        sub_f16x2(crate::math::byte_perm::<0x4342>(w, F16_MAGIC), F16_1152)
    }

    #[inline(always)]
    fn nibbles_lo(w: u32) -> u32 {
        sub_f16x2((w & NIBBLES_LO) | F16_NIBBLE_MAGIC, F16_1032)
    }

    #[inline(always)]
    fn nibbles_hi(w: u32) -> u32 {
        fma_f16x2(
            (w & NIBBLES_HI) | F16_NIBBLE_MAGIC,
            F16_SIXTEENTH,
            F16_MINUS_72,
        )
    }
}

/// f16 bits `0x64xy` are `1024 + 0xxy`: a low nibble pair under `0x64` is `1024 + n`, less
/// `1032` (one `lop3`, one `sub.f16x2`); a high nibble pair is `1024 + 16 n`, times `1 / 16` less
/// `72` (one `lop3`, one `fma.rn.f16x2`). Exact.
const F16_NIBBLE_MAGIC: u32 = 0x6400_6400;
/// `(1024 + 8, 1024 + 8)` as an f16 pair.
const F16_1032: u32 = 0x6408_6408;
/// `(1 / 16, 1 / 16)` as an f16 pair.
const F16_SIXTEENTH: u32 = 0x2C00_2C00;
/// `(-72, -72)` as an f16 pair (`-(64 + 8)`).
const F16_MINUS_72: u32 = 0xD480_D480;

/// `a - b` on packed f16 pairs (`sub.rn.f16x2`).
#[inline(always)]
fn sub_f16x2(a: u32, b: u32) -> u32 {
    let d: u32;
    // SAFETY: register-only instruction.
    unsafe {
        asm!("sub.rn.f16x2 {0}, {1}, {2};", out(reg32) d, in(reg32) a, in(reg32) b,
             options(pure, nomem, nostack));
    }
    d
}

/// `a * b + c` on packed f16 pairs, rounded once (`fma.rn.f16x2`).
#[inline(always)]
fn fma_f16x2(a: u32, b: u32, c: u32) -> u32 {
    let d: u32;
    // SAFETY: register-only instruction.
    unsafe {
        asm!("fma.rn.f16x2 {0}, {1}, {2}, {3};", out(reg32) d, in(reg32) a, in(reg32) b,
             in(reg32) c, options(pure, nomem, nostack));
    }
    d
}

/// `a * b + c` on packed bf16 pairs, rounded once (`fma.rn.bf16x2`, sm_80+).
#[inline(always)]
fn fma_bf16x2(a: u32, b: u32, c: u32) -> u32 {
    let d: u32;
    // SAFETY: register-only instruction.
    unsafe {
        asm!("fma.rn.bf16x2 {0}, {1}, {2}, {3};", out(reg32) d, in(reg32) a, in(reg32) b,
             in(reg32) c, options(pure, nomem, nostack));
    }
    d
}
