//! Asynchronous global -> shared copies (`cp.async`, sm_80+), the building block of multi-stage
//! pipelines.
//!
//! A thread issues copies, closes them into a *group* with [`commit_group`], and later waits with
//! [`wait_group::<N>`](wait_group) until at most `N` of its groups are still in flight. Waiting
//! only makes the copies visible to the issuing thread: follow it with a barrier
//! ([`crate::sync::sync_threads`]) before other threads read the data.
//!
//! Pipeline pattern with `S` stages (commit a group every step, even an empty one, so that group
//! counting stays uniform):
//! ```text
//! for s in 0..S-1 { issue(tile s -> stage s); commit_group() }
//! for i in 0..n {
//!     wait_group::<{S-2}>(); sync_threads();  // tile i has landed, for everyone
//!     issue(tile i+S-1 -> stage (i+S-1)%S); commit_group();  // stage read at step i-1
//!     compute(stage i%S);
//! }
//! ```

use core::arch::asm;

/// Starts a 16-byte copy from global memory to shared memory, bypassing L1 (`.cg`).
///
/// # Safety
/// `dst` is a 16-byte-aligned shared-window address (see [`crate::smem::shared_addr`]) of 16
/// writable bytes; `src` a 16-byte-aligned pointer to 16 readable bytes of global memory. Neither
/// is touched by other accesses until a [`wait_group`] covering this copy (and, for other
/// threads, a barrier after it).
#[inline(always)]
pub unsafe fn cp_async_16(dst: u32, src: *const u8) {
    // SAFETY: the caller guarantees both addresses; `cvta.to.global` turns the generic pointer
    // into the global-window address `cp.async` requires.
    unsafe {
        asm!(
            "{{",
            ".reg .u64 gsrc;",
            "cvta.to.global.u64 gsrc, {1};",
            "cp.async.cg.shared.global [{0}], [gsrc], 16;",
            "}}",
            in(reg32) dst, in(reg64) src as u64,
            options(nostack),
        );
    }
}

/// An L2 cache policy under which the lines a load brings in are the first to be evicted
/// (`createpolicy.fractional.L2::evict_first`): for data read once, such as decode's K/V stream.
#[inline(always)]
pub fn l2_evict_first() -> u64 {
    let policy: u64;
    // SAFETY: register-only instruction.
    unsafe {
        asm!("createpolicy.fractional.L2::evict_first.b64 {0}, 1.0;", out(reg64) policy,
             options(pure, nomem, nostack));
    }
    policy
}

/// [`cp_async_16_zfill`] with an L2 cache policy (`.L2::cache_hint`, see [`l2_evict_first`]):
/// reads only the first `src_bytes` (0 ..= 16) bytes of `src` and zero-fills the rest (with 0,
/// nothing is read: a copy that must not touch its source).
///
/// # Safety
/// As [`cp_async_16_zfill`]; `policy` comes from `createpolicy`.
#[inline(always)]
pub unsafe fn cp_async_16_zfill_with_policy(dst: u32, src: *const u8, src_bytes: u32, policy: u64) {
    // SAFETY: as `cp_async_16_zfill`; the policy is a hint and changes no semantics.
    unsafe {
        asm!(
            "{{",
            ".reg .u64 gsrc;",
            "cvta.to.global.u64 gsrc, {1};",
            "cp.async.cg.shared.global.L2::cache_hint [{0}], [gsrc], 16, {2}, {3};",
            "}}",
            in(reg32) dst, in(reg64) src as u64, in(reg32) src_bytes, in(reg64) policy,
            options(nostack),
        );
    }
}

/// A 4-byte asynchronous copy (`cp.async.ca`, through the L1) with an L2 cache policy: reads
/// only the first `src_bytes` (0 or 4) bytes of `src` and zero-fills the rest (with 0, nothing is
/// read). Tracked in the same commit groups as the 16-byte copies.
///
/// # Safety
/// `dst` is a 4-byte-aligned shared-window address inside the block's shared memory that no
/// other thread reads or writes until the copy's group is waited for; `src` is 4-byte aligned and
/// readable for `src_bytes` bytes; `policy` comes from `createpolicy`.
#[inline(always)]
pub unsafe fn cp_async_4_zfill_with_policy(dst: u32, src: *const u8, src_bytes: u32, policy: u64) {
    // SAFETY: the caller guarantees both addresses; the policy is a hint.
    unsafe {
        asm!(
            "{{",
            ".reg .u64 gsrc;",
            "cvta.to.global.u64 gsrc, {1};",
            "cp.async.ca.shared.global.L2::cache_hint [{0}], [gsrc], 4, {2}, {3};",
            "}}",
            in(reg32) dst, in(reg64) src as u64, in(reg32) src_bytes, in(reg64) policy,
            options(nostack),
        );
    }
}

/// [`cp_async_16`] reading only the first `src_bytes` (0 ..= 16) bytes of `src`: the rest of
/// the 16 destination bytes are zero-filled (with 0, nothing is read).
///
/// # Safety
/// As [`cp_async_16`], with `src` readable for `src_bytes` bytes (pass any valid 16-byte-aligned
/// global address with 0).
#[inline(always)]
pub unsafe fn cp_async_16_zfill(dst: u32, src: *const u8, src_bytes: u32) {
    // SAFETY: as `cp_async_16`; the copy reads `src_bytes` bytes only.
    unsafe {
        asm!(
            "{{",
            ".reg .u64 gsrc;",
            "cvta.to.global.u64 gsrc, {1};",
            "cp.async.cg.shared.global [{0}], [gsrc], 16, {2};",
            "}}",
            in(reg32) dst, in(reg64) src as u64, in(reg32) src_bytes,
            options(nostack),
        );
    }
}

/// Closes all copies this thread issued since the last commit into one group (possibly empty).
#[inline(always)]
pub fn commit_group() {
    // SAFETY: no operands, touches no memory of ours.
    unsafe { asm!("cp.async.commit_group;", options(nostack)) };
}

/// Waits until at most `N` of this thread's committed groups are pending; everything older is
/// complete and visible to this thread. Other threads see the data only after a barrier.
#[inline(always)]
pub fn wait_group<const N: u32>() {
    // SAFETY: no memory operands; acts as a compiler memory fence (no `nomem`), so reads of
    // the landed data are not hoisted above it.
    unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack)) };
}

/// Waits for all of this thread's `cp.async` copies.
#[inline(always)]
pub fn wait_all() {
    // SAFETY: as for `wait_group`.
    unsafe { asm!("cp.async.wait_all;", options(nostack)) };
}
