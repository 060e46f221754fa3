//! Prefix sums of `u32` over a warp and over a block (warp shuffles, then one partial sum per
//! warp in shared memory, read back by every warp: one barrier per block scan).

use crate::sync::sync_threads;
use crate::thread::{lane, thread_in_block, WARP_SIZE};
use crate::warp::shfl_idx_u32;

/// Inclusive prefix sums of the `N` values of `x` over the warp's lanes (Kogge-Stone, the `N`
/// shuffles of a step independent of each other).
///
/// # Safety
/// All 32 lanes call it.
#[inline(always)]
pub unsafe fn warp_inclusive_scan<const N: usize>(mut x: [u32; N]) -> [u32; N] {
    let lane = lane();
    let mut offset = 1;
    while offset < WARP_SIZE {
        let from = if lane >= offset { lane - offset } else { lane };
        for v in x.iter_mut() {
            // SAFETY: forwarded: the whole warp participates.
            let y = unsafe { shfl_idx_u32(*v, from) };
            if lane >= offset {
                *v += y;
            }
        }
        offset <<= 1;
    }
    x
}

/// The sums of `x[0]` and of `x[1]` over the block's threads up to and including this one (in
/// linear thread order), and the block's totals. One barrier: after it every warp scans the
/// per-warp partial sums itself (no second barrier to publish them).
///
/// # Safety
/// Every thread of a block of `threads` threads (a multiple of 32, at most 1024) calls it
/// (block-uniform control flow); `warp_sums` points to `2 * threads / 32` `u32` of shared memory
/// that no thread uses during the call, and that are not written again by the block after it
/// (the call ends without a barrier: other warps may still be reading them).
#[inline(always)]
pub unsafe fn block_inclusive_scan_pair(
    x: [u32; 2],
    warp_sums: *mut u32,
    threads: u32,
) -> ([u32; 2], [u32; 2]) {
    let warps = threads / WARP_SIZE;
    let warp = thread_in_block() / WARP_SIZE;
    // SAFETY (shuffles): whole warps call; (barrier): block-uniform; (shared accesses): inside
    // `warp_sums`, each word written once, read only after the barrier.
    unsafe {
        let within = warp_inclusive_scan(x);
        if lane() == WARP_SIZE - 1 {
            *warp_sums.add(2 * warp as usize) = within[0];
            *warp_sums.add(2 * warp as usize + 1) = within[1];
        }
        sync_threads();
        let partial = if lane() < warps {
            [
                *warp_sums.add(2 * lane() as usize),
                *warp_sums.add(2 * lane() as usize + 1),
            ]
        } else {
            [0, 0]
        };
        let through = warp_inclusive_scan(partial);
        // Lane `w` now holds the sums of warps `0..=w`: this warp's offset is lane `warp`'s
        // exclusive sum, the totals are lane `warps - 1`'s inclusive sums.
        let before = [through[0] - partial[0], through[1] - partial[1]];
        let mut out = [0u32; 2];
        let mut total = [0u32; 2];
        for i in 0..2 {
            out[i] = within[i] + shfl_idx_u32(before[i], warp);
            total[i] = shfl_idx_u32(through[i], warps - 1);
        }
        (out, total)
    }
}
