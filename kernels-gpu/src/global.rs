//! Global-memory accesses with the state space spelled out (`ld.global`, `st.global`).
//!
//! A kernel's buffers reach it as addresses inside its by-value argument struct, which LLVM
//! cannot tell point to global memory, so a plain Rust load or store through them is a generic
//! `ld`/`st`. Where that changed ptxas's allocation of a kernel (`docs/ARCHITECTURE.md`, "Kernel
//! arguments"), the kernel uses these instead; each converts its generic address with
//! `cvta.to.global`, as the `cp.async` copies do.

use core::arch::asm;

/// Stores `value` at `p` (`st.global.b32`).
///
/// # Safety
/// `p` is a 4-byte-aligned pointer to 4 writable bytes of global memory.
#[inline(always)]
pub unsafe fn store_u32(p: *mut u32, value: u32) {
    // SAFETY: the caller guarantees the address; `cvta.to.global` turns the generic pointer into
    // the global-window address `st.global` requires.
    unsafe {
        asm!(
            "{{",
            ".reg .u64 g;",
            "cvta.to.global.u64 g, {0};",
            "st.global.b32 [g], {1};",
            "}}",
            in(reg64) p as u64, in(reg32) value,
            options(nostack),
        );
    }
}

/// Loads the `u32` at `p` (`ld.global.b32`).
///
/// # Safety
/// `p` is a 4-byte-aligned pointer to 4 readable bytes of global memory that no thread writes
/// while the kernel runs (the load may be reordered with other memory accesses).
#[inline(always)]
pub unsafe fn load_u32(p: *const u32) -> u32 {
    let value: u32;
    // SAFETY: as for `store_u32`.
    unsafe {
        asm!(
            "{{",
            ".reg .u64 g;",
            "cvta.to.global.u64 g, {1};",
            "ld.global.b32 {0}, [g];",
            "}}",
            out(reg32) value, in(reg64) p as u64,
            options(pure, readonly, nostack),
        );
    }
    value
}
