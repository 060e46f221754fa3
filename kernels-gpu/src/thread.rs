//! Where the calling thread is: thread, block, warp and lane indices.
//!
//! Thin, safe wrappers over the PTX special registers (`%tid`, `%ctaid`, `%ntid`, `%nctaid`,
//! `%laneid`). Reading a special register has no preconditions, so these functions are safe.

use core::arch::asm;
use core::arch::nvptx::*;

/// Threads in a warp.
pub const WARP_SIZE: u32 = 32;

/// `threadIdx.x`.
#[inline(always)]
pub fn thread_idx_x() -> u32 {
    // SAFETY: reads a special register; no memory is touched.
    unsafe { _thread_idx_x() as u32 }
}

/// `threadIdx.y`.
#[inline(always)]
pub fn thread_idx_y() -> u32 {
    // SAFETY: as above.
    unsafe { _thread_idx_y() as u32 }
}

/// `threadIdx.z`.
#[inline(always)]
pub fn thread_idx_z() -> u32 {
    // SAFETY: as above.
    unsafe { _thread_idx_z() as u32 }
}

/// `blockIdx.x`.
#[inline(always)]
pub fn block_idx_x() -> u32 {
    // SAFETY: as above.
    unsafe { _block_idx_x() as u32 }
}

/// `blockIdx.y`.
#[inline(always)]
pub fn block_idx_y() -> u32 {
    // SAFETY: as above.
    unsafe { _block_idx_y() as u32 }
}

/// `blockIdx.z`.
#[inline(always)]
pub fn block_idx_z() -> u32 {
    // SAFETY: as above.
    unsafe { _block_idx_z() as u32 }
}

/// `blockDim.x`.
#[inline(always)]
pub fn block_dim_x() -> u32 {
    // SAFETY: as above.
    unsafe { _block_dim_x() as u32 }
}

/// `blockDim.y`.
#[inline(always)]
pub fn block_dim_y() -> u32 {
    // SAFETY: as above.
    unsafe { _block_dim_y() as u32 }
}

/// `blockDim.z`.
#[inline(always)]
pub fn block_dim_z() -> u32 {
    // SAFETY: as above.
    unsafe { _block_dim_z() as u32 }
}

/// `gridDim.x`.
#[inline(always)]
pub fn grid_dim_x() -> u32 {
    // SAFETY: as above.
    unsafe { _grid_dim_x() as u32 }
}

/// `gridDim.y`.
#[inline(always)]
pub fn grid_dim_y() -> u32 {
    // SAFETY: as above.
    unsafe { _grid_dim_y() as u32 }
}

/// `gridDim.z`.
#[inline(always)]
pub fn grid_dim_z() -> u32 {
    // SAFETY: as above.
    unsafe { _grid_dim_z() as u32 }
}

/// The thread's linear index inside its block (`x` fastest, then `y`, then `z`), the order in
/// which the hardware packs threads into warps.
#[inline(always)]
pub fn thread_in_block() -> u32 {
    (thread_idx_z() * block_dim_y() + thread_idx_y()) * block_dim_x() + thread_idx_x()
}

/// The block's linear index inside the grid (`x` fastest).
#[inline(always)]
pub fn block_in_grid() -> u32 {
    (block_idx_z() * grid_dim_y() + block_idx_y()) * grid_dim_x() + block_idx_x()
}

/// Threads per block.
#[inline(always)]
pub fn threads_per_block() -> u32 {
    block_dim_x() * block_dim_y() * block_dim_z()
}

/// The warp's index inside its block (from the linear thread index; unlike `%warpid`, stable).
#[inline(always)]
pub fn warp_in_block() -> u32 {
    thread_in_block() / WARP_SIZE
}

/// The lane (0..32) of the thread inside its warp (`%laneid`).
#[inline(always)]
pub fn lane() -> u32 {
    let lane: u32;
    // SAFETY: reads a special register; no memory is touched.
    unsafe { asm!("mov.u32 {0}, %laneid;", out(reg32) lane, options(pure, nomem, nostack)) };
    lane
}
