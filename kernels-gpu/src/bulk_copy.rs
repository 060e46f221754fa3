//! Bulk asynchronous global -> shared copies on the tensor memory accelerator
//! (`cp.async.bulk.tensor`, sm_90, PTX ISA 8.0) and the shared-memory barriers (`mbarrier`) that
//! count their bytes.
//!
//! One instruction moves a whole box of a tensor that a tensor map (`CUtensorMap`, encoded on the
//! host) describes, laid out in shared memory as the map's swizzle says, and reports completion
//! to an `mbarrier` in shared memory as a byte count ("transaction count"), not per issuing
//! thread: no `commit_group`/`wait_group`, and no register per 16-byte chunk. The pattern per
//! buffer (one barrier initialized with one expected arrival):
//! ```text
//! init(bar, 1); fence_init(); (barrier for the threads that use it)
//! loop:
//!     one thread: arrive_expect_tx(bar, total bytes)   // the phase now waits for the bytes
//!     copies: tensor_copy(dst, map, coords, bar) ...    // each completes its box's bytes on bar
//!     everyone: wait_parity(bar, phase & 1)             // data visible to the waiting thread
//! ```
//! A phase completes when its expected arrival came and every expected byte landed; the
//! transaction count may dip below zero if a copy lands before the `expect_tx` (that is allowed:
//! the missing arrival still holds the phase open).

use core::arch::asm;

/// Initializes the `mbarrier` at shared-window address `bar` for `count` arrivals per phase
/// (phase 0 starts).
///
/// # Safety
/// `bar` is an 8-byte-aligned shared-window address of 8 bytes used only as this barrier; no
/// other thread uses it until a [`fence_mbarrier_init`] and a barrier after this.
#[inline(always)]
pub unsafe fn mbarrier_init(bar: u32, count: u32) {
    // SAFETY: forwarded.
    unsafe {
        asm!("mbarrier.init.shared::cta.b64 [{0}], {1};", in(reg32) bar, in(reg32) count,
             options(nostack));
    }
}

/// Makes this thread's earlier [`mbarrier_init`]s visible to other threads and to the bulk-copy
/// unit (`fence.mbarrier_init.release.cluster`); follow it with a thread barrier.
#[inline(always)]
pub fn fence_mbarrier_init() {
    // SAFETY: a fence; no operands.
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack)) };
}

/// Orders this thread's earlier generic-proxy writes to shared memory before later
/// async-proxy accesses of it (`fence.proxy.async.shared::cta`): needed before a bulk copy may
/// overwrite bytes that plain stores wrote.
#[inline(always)]
pub fn fence_proxy_async_shared() {
    // SAFETY: no operands; a fence. No `nomem`: memory accesses must not move across it.
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) };
}

/// Arrives once on `bar` and raises its transaction count by `bytes`: the current phase then
/// completes when `bytes` bytes of bulk copies have landed on it.
///
/// # Safety
/// `bar` is an initialized barrier ([`mbarrier_init`]) whose current phase still expects this
/// arrival; `bytes < 2^20`.
#[inline(always)]
pub unsafe fn mbarrier_arrive_expect_tx(bar: u32, bytes: u32) {
    // SAFETY: forwarded.
    unsafe {
        asm!("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{0}], {1};",
             in(reg32) bar, in(reg32) bytes, options(nostack));
    }
}

/// Raises the transaction count of `bar`'s current phase by `bytes`, without arriving: the
/// phase then completes when its arrivals are in and `bytes` more bytes of bulk copies have
/// landed on it.
///
/// # Safety
/// `bar` is an initialized barrier whose current phase still expects an arrival from this
/// thread (made after this call); `bytes < 2^20`.
#[inline(always)]
pub unsafe fn mbarrier_expect_tx(bar: u32, bytes: u32) {
    // SAFETY: forwarded.
    unsafe {
        asm!("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [{0}], {1};",
             in(reg32) bar, in(reg32) bytes, options(nostack));
    }
}

/// Waits until the phase of `bar` with parity `parity` (0 for phases 0, 2, ...; 1 for 1, 3, ...)
/// has completed. Acquire: the bytes the phase counted are visible to this thread afterwards.
///
/// # Safety
/// `bar` is an initialized barrier; the phase waited for is the current one or the one before.
#[inline(always)]
pub unsafe fn mbarrier_wait_parity(bar: u32, parity: u32) {
    loop {
        let done: u32;
        // SAFETY: forwarded. No `nomem`: reads of the landed data must not move above it.
        unsafe {
            asm!(
                "{{",
                ".reg .pred p;",
                "mbarrier.try_wait.parity.shared::cta.b64 p, [{1}], {2};",
                "selp.u32 {0}, 1, 0, p;",
                "}}",
                out(reg32) done, in(reg32) bar, in(reg32) parity,
                options(nostack),
            );
        }
        if done != 0 {
            return;
        }
    }
}

/// Starts a tensor-map copy of the box at coordinates `(c0, c1, c2)` (innermost first) of the
/// 3-D tensor that `map` describes into shared-window address `dst`, counted in bytes on barrier
/// `bar` (`cp.async.bulk.tensor.3d ... tile.mbarrier::complete_tx::bytes`), with an L2 cache policy
/// from [`crate::cp_async::l2_evict_first`] (a hint, no semantics). The box lands as the map's
/// swizzle lays it out; elements outside the tensor land as zeros.
///
/// # Safety
/// `map` is the generic address of a valid tensor map (`CUtensorMap`, 64-byte aligned) in global
/// memory, written before this kernel started and describing readable memory; `dst` is aligned as
/// the map's swizzle requires (1024 bytes for the 128-byte swizzle) with the box's bytes writable
/// there; the destination is not accessed by anyone until `bar`'s phase that counts these bytes
/// has completed (an `expect_tx` on that phase accounts for them).
#[inline(always)]
pub unsafe fn tensor_copy_3d_with_policy(
    dst: u32,
    map: *const u8,
    c0: u32,
    c1: u32,
    c2: u32,
    bar: u32,
    policy: u64,
) {
    // SAFETY: forwarded. A `shared::cta` address of this block is a valid `shared::cluster`
    // address of it; the tensor map operand is a generic address.
    unsafe {
        asm!(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes\
             .L2::cache_hint [{0}], [{1}, {{{2}, {3}, {4}}}], [{5}], {6};",
            in(reg32) dst, in(reg64) map as u64, in(reg32) c0, in(reg32) c1, in(reg32) c2,
            in(reg32) bar, in(reg64) policy,
            options(nostack),
        );
    }
}

/// [`tensor_copy_3d_with_policy`] without a cache hint; coordinates are signed (a box that
/// starts before the tensor, e.g. at row `-16`, lands zeros for the rows outside it).
///
/// # Safety
/// As [`tensor_copy_3d_with_policy`].
#[inline(always)]
pub unsafe fn tensor_copy_3d(dst: u32, map: *const u8, c0: i32, c1: i32, c2: i32, bar: u32) {
    // SAFETY: forwarded (as `tensor_copy_3d_with_policy`).
    unsafe {
        asm!(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes \
             [{0}], [{1}, {{{2}, {3}, {4}}}], [{5}];",
            in(reg32) dst, in(reg64) map as u64, in(reg32) c0, in(reg32) c1, in(reg32) c2,
            in(reg32) bar,
            options(nostack),
        );
    }
}

/// Arrives once on `bar` (`mbarrier.arrive`), without a transaction count.
///
/// # Safety
/// `bar` is an initialized barrier whose current phase still expects this arrival.
#[inline(always)]
pub unsafe fn mbarrier_arrive(bar: u32) {
    // SAFETY: forwarded. No `nomem`: this thread's earlier shared-memory reads are ordered
    // before the arrival (release).
    unsafe {
        asm!("mbarrier.arrive.shared::cta.b64 _, [{0}];", in(reg32) bar, options(nostack));
    }
}
