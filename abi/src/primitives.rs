//! Launch parameters of the primitive test kernels (the building blocks later kernels use).

/// Threads per block of the primitive test kernels.
pub const PRIMITIVE_BLOCK: u32 = 128;
