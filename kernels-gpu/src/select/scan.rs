//! Block-wide prefix sums of `u32` (warp shuffles, then one partial sum per warp in shared
//! memory).

use crate::sync::sync_threads;
use crate::thread::{lane, thread_in_block, WARP_SIZE};
use crate::warp::shfl_idx_u32;

/// Inclusive prefix sum of `x` over the warp's lanes (Kogge-Stone).
///
/// # Safety
/// All 32 lanes call it.
#[inline(always)]
unsafe fn warp_inclusive_scan(mut x: u32) -> u32 {
    let lane = lane();
    let mut offset = 1;
    while offset < WARP_SIZE {
        let from = if lane >= offset { lane - offset } else { lane };
        // SAFETY: forwarded: the whole warp participates.
        let y = unsafe { shfl_idx_u32(x, from) };
        if lane >= offset {
            x += y;
        }
        offset <<= 1;
    }
    x
}

/// The sum of `x` over the block's threads up to and including this one (in linear thread
/// order), and the block's total.
///
/// # Safety
/// Every thread of a block of `threads` threads (a multiple of 32, at most 1024) calls it
/// (block-uniform control flow); `warp_sums` points to `threads / 32` `u32` of shared memory
/// that no thread uses during the call.
#[inline(always)]
pub unsafe fn block_inclusive_scan(x: u32, warp_sums: *mut u32, threads: u32) -> (u32, u32) {
    let warps = threads / WARP_SIZE;
    let warp = thread_in_block() / WARP_SIZE;
    // SAFETY (shuffles): whole warps call; (barriers): block-uniform; (shared accesses): inside
    // `warp_sums`, ordered by the barriers.
    unsafe {
        let within = warp_inclusive_scan(x);
        if lane() == WARP_SIZE - 1 {
            *warp_sums.add(warp as usize) = within;
        }
        sync_threads();
        if warp == 0 {
            let total = if lane() < warps {
                *warp_sums.add(lane() as usize)
            } else {
                0
            };
            let scanned = warp_inclusive_scan(total);
            if lane() < warps {
                *warp_sums.add(lane() as usize) = scanned;
            }
        }
        sync_threads();
        let before = if warp > 0 {
            *warp_sums.add(warp as usize - 1)
        } else {
            0
        };
        let total = *warp_sums.add(warps as usize - 1);
        // Every thread has read `warp_sums` before anyone may reuse it.
        sync_threads();
        (within + before, total)
    }
}
