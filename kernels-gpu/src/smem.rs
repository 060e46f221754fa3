//! Dynamic shared memory.
//!
//! One module-level declaration, `.extern .shared .align 16 .b8 SMEM[];`, sized at launch
//! (`shared_mem_bytes`). Kernels carve it up by byte offsets. Two kinds of address exist:
//! - a *generic* pointer (`cvta.shared.u64`), usable with ordinary Rust loads and stores;
//! - a 32-bit *shared-window* address, what `ldmatrix`, `cp.async` and `ld.shared` take.

use core::arch::{asm, global_asm};

global_asm!(".extern .shared .align 16 .b8 SMEM[];");

/// A generic pointer to byte `offset` of the block's dynamic shared memory, typed as `T`.
///
/// Computing the pointer is safe; using it is not: the caller of any read or write must keep
/// `offset + size` within the launch's `shared_mem_bytes` and respect `T`'s alignment (the base is
/// 16-byte aligned).
#[inline(always)]
pub fn dynamic_smem<T>(offset: usize) -> *mut T {
    let base: u64;
    // SAFETY: takes the address of the extern shared array; no memory is accessed.
    unsafe {
        asm!("cvta.shared.u64 {0}, SMEM;", out(reg64) base, options(pure, nomem, nostack));
    }
    (base as usize + offset) as *mut T
}

/// The 32-bit shared-window address of a generic pointer into shared memory (for `ldmatrix`,
/// `cp.async`, `ld.shared`/`st.shared`).
///
/// Safe to compute; meaningful only when `ptr` points into shared memory (the result of
/// [`dynamic_smem`] or an offset from it).
#[inline(always)]
pub fn shared_addr<T>(ptr: *const T) -> u32 {
    let window: u64;
    // SAFETY: pure address arithmetic; no memory is accessed.
    unsafe {
        asm!("cvta.to.shared.u64 {0}, {1};", out(reg64) window, in(reg64) ptr as u64,
             options(pure, nomem, nostack));
    }
    // The shared window is below 4 GiB (at most 228 KiB on sm_90): the truncation is exact.
    window as u32
}

/// The `u32` of shared memory at shared-window address `addr` (`ld.shared.u32`).
///
/// # Safety
/// `addr` is 4-byte aligned and `addr..addr + 4` lies inside the block's shared memory; no other
/// thread writes those bytes concurrently (order with a barrier).
#[inline(always)]
pub unsafe fn ld_shared_u32(addr: u32) -> u32 {
    let v: u32;
    // SAFETY: the caller guarantees the address; reads memory (no `nomem`).
    unsafe {
        asm!("ld.shared.u32 {0}, [{1}];", out(reg32) v, in(reg32) addr,
             options(nostack, readonly));
    }
    v
}

/// Four consecutive `u32` of shared memory at shared-window address `addr` (one `ld.shared.v4`).
///
/// # Safety
/// `addr` is 16-byte aligned and `addr..addr + 16` lies inside the block's shared memory; no
/// other thread writes those bytes concurrently (order with a barrier).
#[inline(always)]
pub unsafe fn ld_shared_v4_u32(addr: u32) -> [u32; 4] {
    let v: [u32; 4];
    // SAFETY: the caller guarantees the address. Reads memory, so it stays ordered after earlier
    // barriers and shared atomics (inline asm without `nomem`).
    unsafe {
        let (a, b, c, d): (u32, u32, u32, u32);
        asm!("ld.shared.v4.u32 {{{0}, {1}, {2}, {3}}}, [{4}];",
             out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg32) addr,
             options(nostack, readonly));
        v = [a, b, c, d];
    }
    v
}

/// Two consecutive `u32` of shared memory at shared-window address `addr` (one `ld.shared.v2`).
///
/// # Safety
/// `addr` is 8-byte aligned and `addr..addr + 8` lies inside the block's shared memory; no
/// other thread writes those bytes concurrently (order with a barrier).
#[inline(always)]
pub unsafe fn ld_shared_v2_u32(addr: u32) -> [u32; 2] {
    // SAFETY: the caller guarantees the address. Reads memory, so it stays ordered after earlier
    // barriers and shared atomics (inline asm without `nomem`).
    unsafe {
        let (a, b): (u32, u32);
        asm!("ld.shared.v2.u32 {{{0}, {1}}}, [{2}];",
             out(reg32) a, out(reg32) b, in(reg32) addr, options(nostack, readonly));
        [a, b]
    }
}

/// Adds 1 to the shared `u32` at shared-window address `addr` (`red.shared.add`, atomic among
/// the block's threads).
///
/// # Safety
/// `addr` is 4-byte aligned and inside the block's shared memory.
#[inline(always)]
pub unsafe fn shared_increment_u32(addr: u32) {
    // SAFETY: the caller guarantees the address. Writes memory: no `nomem`.
    unsafe { asm!("red.shared.add.u32 [{0}], 1;", in(reg32) addr, options(nostack)) };
}

/// Stores `v` at shared-window address `addr` (`st.shared.u32`).
///
/// # Safety
/// `addr` is 4-byte aligned and `addr..addr + 4` lies inside the block's shared memory; no other
/// thread reads or writes those bytes concurrently (order with a barrier).
#[inline(always)]
pub unsafe fn st_shared_u32(addr: u32, v: u32) {
    // SAFETY: the caller guarantees the address. Writes memory: no `nomem`.
    unsafe { asm!("st.shared.u32 [{0}], {1};", in(reg32) addr, in(reg32) v, options(nostack)) };
}

/// Stores four consecutive `u32` at shared-window address `addr` (one `st.shared.v4`).
///
/// # Safety
/// `addr` is 16-byte aligned and `addr..addr + 16` lies inside the block's shared memory; no
/// other thread reads or writes those bytes concurrently (order with a barrier).
#[inline(always)]
pub unsafe fn st_shared_v4_u32(addr: u32, v: [u32; 4]) {
    // SAFETY: the caller guarantees the address. Writes memory: no `nomem`.
    unsafe {
        asm!("st.shared.v4.u32 [{0}], {{{1}, {2}, {3}, {4}}};",
             in(reg32) addr, in(reg32) v[0], in(reg32) v[1], in(reg32) v[2], in(reg32) v[3],
             options(nostack));
    }
}
