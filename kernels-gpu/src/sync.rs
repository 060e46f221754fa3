//! Barriers.

use core::arch::asm;

/// Block-wide barrier (`bar.sync 0`, CUDA's `__syncthreads()`): waits until every thread of the
/// block arrives, and makes shared- and global-memory writes made before it by any thread of the
/// block visible to all threads of the block after it.
///
/// # Safety
/// Every thread of the block must reach this same barrier (not under divergent control flow
/// that some threads skip), or the block deadlocks / behaves undefined.
#[inline(always)]
pub unsafe fn sync_threads() {
    // SAFETY: the caller guarantees block-uniform control flow. No `nomem`: this is a memory
    // fence for the compiler too.
    unsafe { asm!("bar.sync 0;", options(nostack)) };
}

/// Warp-wide barrier (`bar.warp.sync 0xffffffff`): reconverges the warp and orders memory
/// between its lanes.
///
/// # Safety
/// All 32 lanes of the warp must execute it.
#[inline(always)]
pub unsafe fn sync_warp() {
    // SAFETY: the caller guarantees all lanes arrive.
    unsafe { asm!("bar.warp.sync -1;", options(nostack)) };
}
