//! Launch parameters of the primitive test kernels (the building blocks later kernels use).

/// Threads per block of the primitive test kernels.
pub const PRIMITIVE_BLOCK: u32 = 128;

/// What the thread-index test kernel writes for every thread (`u32` fields, no padding).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadRecord {
    /// `threadIdx.x`.
    pub thread_x: u32,
    /// `threadIdx.y`.
    pub thread_y: u32,
    /// `blockIdx.x`.
    pub block_x: u32,
    /// `blockIdx.y`.
    pub block_y: u32,
    /// `blockDim.x`.
    pub block_dim_x: u32,
    /// `blockDim.y`.
    pub block_dim_y: u32,
    /// `gridDim.x`.
    pub grid_dim_x: u32,
    /// `gridDim.y`.
    pub grid_dim_y: u32,
    /// Linear thread index in the block (`x` fastest).
    pub thread_in_block: u32,
    /// Warp index in the block.
    pub warp: u32,
    /// Lane in the warp (`%laneid`).
    pub lane: u32,
}

/// `u32` words of one [`ThreadRecord`].
pub const THREAD_RECORD_WORDS: usize = core::mem::size_of::<ThreadRecord>() / 4;

/// Shape of one tensor-core product: `M x N x K` = 16 x 8 x 16.
pub const MMA_M: usize = 16;
/// See [`MMA_M`].
pub const MMA_N: usize = 8;
/// See [`MMA_M`].
pub const MMA_K: usize = 16;

/// Stages of the `cp.async` pipeline test kernel.
pub const CP_ASYNC_STAGES: u32 = 3;
/// Bytes per tile (= per stage) of the `cp.async` pipeline test: 16 bytes per thread of a
/// [`PRIMITIVE_BLOCK`]-thread block.
pub const CP_ASYNC_TILE_BYTES: u32 = PRIMITIVE_BLOCK * 16;

/// Dynamic shared memory of the `mma`-from-shared-memory test: A (16x16), B k-major (16x8) and
/// B n-major (8x16), 16-bit elements.
pub const MMA_SMEM_BYTES: u32 = (16 * 16 + 16 * 8 + 8 * 16) * 2;
