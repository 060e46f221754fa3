//! Barriers.

use core::arch::asm;

/// Block-wide barrier (`barrier.sync 0`, CUDA's `__syncthreads()`): waits until every thread of
/// the block arrives, and makes shared- and global-memory writes made before it by any thread of
/// the block visible to all threads of the block after it.
///
/// Deliberately not `bar.sync`, which is `barrier.sync.aligned`: that form requires every thread
/// of the block to execute the *same* barrier instruction with its warp converged, and rustc's
/// LLVM may duplicate an inline-asm barrier into both arms of a preceding branch (it did in the
/// selector, after its block scan's `if warp == 0 { .. }`; compute-sanitizer's synccheck then
/// reported "divergent thread(s) in block"). Without `.aligned` threads may arrive through
/// different barrier instructions and diverged, so source that is correct stays correct whatever
/// LLVM does to the branches around it. Measured no slower (decode/DESIGN.md, "Invariants").
///
/// # Safety
/// Every thread of the block must arrive at a `barrier.sync 0` once per use (not skipped by
/// some threads under divergent control flow), or the block deadlocks / behaves undefined.
#[inline(always)]
pub unsafe fn sync_threads() {
    // SAFETY: the caller guarantees every thread arrives. No `nomem`: this is a memory fence for
    // the compiler too.
    unsafe { asm!("barrier.sync 0;", options(nostack)) };
}

/// Barrier `id` (1..16; 0 is [`sync_threads`]'s) of `threads` threads (a multiple of 32), e.g.
/// one warpgroup's 128 (`barrier.sync id, threads`): waits until that many threads arrived at
/// it, and orders their shared-memory accesses as [`sync_threads`] does for the block.
///
/// # Safety
/// Exactly `threads` threads arrive at barrier `id` per use, whole warps; no other barrier use
/// of `id` overlaps.
#[inline(always)]
pub unsafe fn sync_named<const ID: u32>(threads: u32) {
    const { assert!(ID >= 1 && ID < 16) };
    // SAFETY: forwarded.
    unsafe { asm!("barrier.sync {0}, {1};", const ID, in(reg32) threads, options(nostack)) };
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

/// Waits until the kernels this one was launched to overlap (programmatic dependent launch, the
/// host's `Launch::overlapped`) have completed and their memory writes are visible
/// (`griddepcontrol.wait`, CUDA's `cudaGridDependencySynchronize()`). A no-op for a kernel
/// launched normally. Every kernel the host launches overlapped calls it before its first
/// access (read or write) of global memory that a kernel before it may write or read; only host
/// copies complete before the previous kernel started (the batch's `seq_len` / `seq_slot`, the
/// head map, the block tables) may be read before it.
///
/// Hopper's instruction: in the sm_80 build it is empty, and the host never launches that
/// build's kernels overlapped (each starts after the previous one completed).
///
/// # Safety
/// None; `unsafe` like the other barriers.
#[inline(always)]
pub unsafe fn grid_dependency_wait() {
    // SAFETY: no operands. No `nomem`: memory accesses must not move above it.
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!("griddepcontrol.wait;", options(nostack))
    };
}

/// Lets the kernel launched after this one (overlapped) start its blocks once every block of
/// this kernel has executed this or exited (`griddepcontrol.launch_dependents`). Its blocks
/// still wait for this kernel's completion before touching memory ([`grid_dependency_wait`]).
///
/// # Safety
/// As [`grid_dependency_wait`].
#[inline(always)]
pub unsafe fn launch_dependents() {
    // SAFETY: no operands; a scheduling hint with no memory effect (empty in the sm_80 build, as
    // `grid_dependency_wait`).
    #[cfg(target_feature = "sm_90")]
    unsafe {
        asm!("griddepcontrol.launch_dependents;", options(nostack))
    };
}

/// The entry of a kernel launched overlapped with the previous one: waits for it
/// ([`grid_dependency_wait`]), then lets the next kernel start launching
/// ([`launch_dependents`]): a chain of step kernels thus overlaps each launch with the end of the
/// kernel before, and no kernel's blocks start work before their inputs are complete.
///
/// # Safety
/// As [`grid_dependency_wait`]: every thread that touches global memory calls it before any
/// access other than reads of such host copies, and every block has a thread that calls it.
#[inline(always)]
pub unsafe fn overlapped_entry() {
    // SAFETY: forwarded.
    unsafe {
        grid_dependency_wait();
        launch_dependents();
    }
}
