//! Scorer and selector in one launch, as a decode step runs them: grid `(chunks, pairs)`,
//! [`SCORE_THREADS`] threads, [`SELECT_SMEM_BYTES`](lserve_abi::select::SELECT_SMEM_BYTES) of
//! shared memory.
//!
//! Per pair (`grid.y`):
//! - dense decode: nothing;
//! - reusing its held selection: block 0 writes the index-table entry (held selection plus the
//!   newest page), the other blocks exit at once;
//! - due: every block scores its share of the pages ([`score::score_pair`]); the last block to
//!   finish ([`last_block_to_arrive`] on the pair's arrival counter) runs the top-K and writes
//!   the held selection and index entry ([`top_k::select_pair`]).
//!
//! One launch instead of two saves a kernel boundary per layer and step; the selector's block
//! is the scorer's (fewer threads than the separate selector's, so more candidates per thread).

use lserve_abi::select::{SelectParams, SCORE_THREADS};

use super::score::{self, PairStep, ScoreBuffers};
use super::top_k::{self, SelectBuffers};
use crate::convert::Half16;
use crate::sync::last_block_to_arrive;
use crate::thread::{block_idx_x, block_idx_y, grid_dim_x};

/// The fused body (see the module docs).
///
/// # Safety
/// Launched with grid `(chunks, p.batch * p.paged.heads)`, [`SCORE_THREADS`] threads and
/// `SELECT_SMEM_BYTES` of dynamic shared memory; the buffers and capacities as
/// [`score::score_pages`] and [`top_k::select_pair`] require (`scoring` and `selecting` describe
/// the same batch and state); `arrivals` holds one `u32` per pair, zero at launch (the last
/// block of each due pair leaves it zero again).
#[inline(always)]
pub unsafe fn score_and_select<E: Half16, const D: usize, const G: usize>(
    p: &SelectParams,
    scoring: &ScoreBuffers,
    selecting: &SelectBuffers,
    arrivals: *mut u32,
) {
    let pair = block_idx_y();
    // SAFETY: `pair < batch * dense_heads` by the grid; forwarded buffers.
    match unsafe { score::pair_step(p, scoring, pair) } {
        PairStep::Dense => {}
        PairStep::Reuse => {
            if block_idx_x() == 0 {
                // SAFETY: one block (block 0) serves the pair; forwarded contract.
                unsafe { select_reusing(p, selecting, pair) };
            }
        }
        PairStep::Due { len, slot } => {
            // SAFETY (all): block-uniform (the pair's state is the same for every thread);
            // the pair's counter exists and all `grid.x` blocks of the pair arrive once; the
            // word is free; the last block alone runs the selector, after every block's scores
            // are visible to it.
            unsafe {
                score::score_pair::<E, D, G>(p, scoring, pair, len, slot);
                arrive_and_select(p, selecting, pair, arrivals.add(pair as usize));
            }
        }
    }
}

/// The end of a due pair's block: counts the block's arrival on the pair's `counter`; the last
/// block of the pair runs the selector.
///
/// Called, not inlined, as is [`select_reusing`]: ptxas allocates a called function's registers
/// apart from the kernel's, and a block barrier anywhere in the kernel body made it give the
/// scorer part 148 registers instead of 123 at G = 4 (measured with `cargo xtask ptx`), i.e.
/// one block per SM instead of two.
///
/// # Safety
/// Every thread of the block calls it once, after its share of the pair's scores; `counter` is
/// the pair's arrival counter; as [`top_k::select_pair`] with `SCORE_THREADS` threads.
#[inline(never)]
unsafe fn arrive_and_select(
    p: &SelectParams,
    selecting: &SelectBuffers,
    pair: u32,
    counter: *mut u32,
) {
    // SAFETY: forwarded; all `grid.x` blocks of the pair arrive once.
    unsafe {
        if last_block_to_arrive(counter, grid_dim_x(), top_k::FREE_WORD) {
            top_k::select_pair::<SCORE_THREADS>(p, selecting, pair);
        }
    }
}

/// [`top_k::select_pair`] for a pair that reuses its selection (block 0 of the pair), called
/// (see [`arrive_and_select`]).
///
/// # Safety
/// As [`top_k::select_pair`] with `SCORE_THREADS` threads.
#[inline(never)]
unsafe fn select_reusing(p: &SelectParams, selecting: &SelectBuffers, pair: u32) {
    // SAFETY: forwarded.
    unsafe { top_k::select_pair::<SCORE_THREADS>(p, selecting, pair) }
}
