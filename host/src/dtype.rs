//! Element types of activations and of the KV cache: `bf16` and `f16`, with f32 conversions.
//!
//! Every buffer the kernels read or write holds one [`Element`] type; accumulation is always f32
//! (f64 in parts of the CPU reference).

use core::fmt;

use half::{bf16, f16};

/// The element types the kernels support, as a runtime value (e.g. to check a buffer's type).
///
/// ```
/// use lserve::dtype::{DType, Element};
/// assert_eq!(<half::bf16 as Element>::DTYPE, DType::BF16);
/// assert_eq!(DType::F16.size_bytes(), 2);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16: 8 exponent bits, 7 mantissa bits.
    BF16,
    /// IEEE half precision: 5 exponent bits, 10 mantissa bits.
    F16,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Short lowercase name: `"bf16"` or `"f16"`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A 16-bit floating-point element type stored in activations and in the KV cache.
///
/// Implemented for [`half::bf16`] and [`half::f16`]. `from_f32` rounds to nearest even;
/// `to_f32` is exact.
///
/// ```
/// use lserve::dtype::Element;
/// use half::bf16;
/// let x = <bf16 as Element>::from_f32(1.5);
/// assert_eq!(x.to_f32(), 1.5);
/// ```
pub trait Element:
    Copy + bytemuck::Pod + Send + Sync + Default + PartialEq + fmt::Debug + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
