//! The per-sequence decode step counters that drive reuse (`docs/ARCHITECTURE.md`, "Reuse").

use crate::thread::{block_dim_x, block_idx_x, thread_idx_x};

/// Adds one to the decode step counter of every sequence of the batch: `decode_steps[seq_slot[b]]`
/// for `b < batch`. Run once per model step, after every layer's selection.
///
/// # Safety
/// Grid `ceil(batch / STEP_THREADS)`, `STEP_THREADS` threads; `seq_slot` holds `batch` distinct
/// live slots, `decode_steps` one counter per slot.
#[inline(always)]
pub unsafe fn advance_decode_steps(batch: u32, seq_slot: *const u32, decode_steps: *mut u32) {
    let b = block_idx_x() * block_dim_x() + thread_idx_x();
    if b < batch {
        // SAFETY: `b < batch`; slots are distinct, so no two threads write one counter.
        unsafe {
            let slot = *seq_slot.add(b as usize) as usize;
            *decode_steps.add(slot) = (*decode_steps.add(slot)).wrapping_add(1);
        }
    }
}
