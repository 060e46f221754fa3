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

/// Waits until the kernels this one was launched to overlap (programmatic dependent launch, the
/// host's `OverlappedLaunch`) have completed and their memory writes are visible
/// (`griddepcontrol.wait`, CUDA's `cudaGridDependencySynchronize()`). A no-op for a kernel
/// launched normally. Every kernel the host launches overlapped calls it before its first
/// memory access.
///
/// # Safety
/// None beyond being device code on sm_90 or later; `unsafe` like the other barriers.
#[inline(always)]
pub unsafe fn grid_dependency_wait() {
    // SAFETY: no operands. No `nomem`: memory accesses must not move above it.
    unsafe { asm!("griddepcontrol.wait;", options(nostack)) };
}

/// Lets the kernel launched after this one (overlapped) start its blocks once every block of
/// this kernel has executed this or exited (`griddepcontrol.launch_dependents`). Its blocks
/// still wait for this kernel's completion before touching memory ([`grid_dependency_wait`]).
///
/// # Safety
/// As [`grid_dependency_wait`].
#[inline(always)]
pub unsafe fn launch_dependents() {
    // SAFETY: no operands; a scheduling hint with no memory effect.
    unsafe { asm!("griddepcontrol.launch_dependents;", options(nostack)) };
}

/// The entry of a kernel launched overlapped with the previous one: waits for it
/// ([`grid_dependency_wait`]), then lets the next kernel start launching
/// ([`launch_dependents`]): a chain of step kernels thus overlaps each launch with the end of the
/// kernel before, and no kernel's blocks start work before their inputs are complete.
///
/// # Safety
/// As [`grid_dependency_wait`]; called first thing in the kernel.
#[inline(always)]
pub unsafe fn overlapped_entry() {
    // SAFETY: forwarded.
    unsafe {
        grid_dependency_wait();
        launch_dependents();
    }
}

/// A fence at GPU scope with acquire and release semantics (`fence.acq_rel.gpu`, CUDA's
/// `__threadfence()`): this thread's memory accesses before it are ordered before its accesses
/// after it as seen by every thread of the device, and it pairs with another thread's fence
/// through an atomic they both access (release before the atomic, acquire after it).
///
/// # Safety
/// None beyond being device code; `unsafe` like the other barriers.
#[inline(always)]
pub unsafe fn fence_gpu() {
    // SAFETY: no operands. No `nomem`: memory accesses must not move across it.
    unsafe { asm!("fence.acq_rel.gpu;", options(nostack)) };
}

/// Whether this block is the last of `blocks` blocks to arrive at `counter` (a GPU-scope arrival
/// count): every block of the group calls it once after its writes; in the last block to arrive
/// every write the others made before their call is visible to all its threads, and the
/// counter is back at zero for the next launch. Uses the `u32` of dynamic shared memory at word
/// `flag` to share the answer within the block.
///
/// The pattern is CUDA's "last block" reduction: each thread fences its writes, the block meets
/// at a barrier, one thread adds 1 to the counter; the thread that finds `blocks - 1` there is in
/// the last block, which fences again (acquire) before reading what the others wrote.
///
/// # Safety
/// Every thread of the block calls it (block-uniform control flow), exactly `blocks` blocks use
/// `counter` (a global `u32` that is zero when the first of them arrives) in this launch, and
/// shared word `flag` is not in use by the block during the call.
#[inline(always)]
pub unsafe fn last_block_to_arrive(counter: *mut u32, blocks: u32, flag: usize) -> bool {
    let flag = crate::smem::dynamic_smem::<u32>(flag * 4);
    // SAFETY (fences, barriers): block-uniform; (atomic, store): `counter` is the group's live
    // global counter; (shared accesses): the caller's free word, ordered by the barriers.
    unsafe {
        fence_gpu();
        sync_threads();
        if crate::thread::thread_in_block() == 0 {
            let arrived: u32;
            asm!("atom.relaxed.gpu.global.add.u32 {0}, [{1}], 1;",
                 out(reg32) arrived, in(reg64) counter as u64, options(nostack));
            let last = arrived == blocks - 1;
            if last {
                // Every other block has arrived: nobody else touches the counter in this launch.
                counter.write_volatile(0);
            }
            *flag = last as u32;
        }
        sync_threads();
        let last = *flag != 0;
        if last {
            fence_gpu();
        }
        // Everyone has read the flag before the block may reuse the word.
        sync_threads();
        last
    }
}
