//! The selector: exact top-K pages of each due (sequence, dense KV head) pair into its held
//! selection and its index-table entry. Pairs that reuse their selection are left alone: the
//! decode append keeps their entries (`kv_write::append`).
//!
//! Grid `pairs`, [`SELECT_THREADS`] threads, [`SELECT_SMEM_BYTES`] of shared memory.
//!
//! **Top-K, ties to the lower index.** Scores become order-preserving `u32` keys
//! ([`score_key`]). A radix select finds the key `T` of the K-th largest candidate in four
//! passes of 8 bits (a 256-bin shared histogram of the keys that match the digits fixed so far;
//! a prefix sum over the bins from the top finds the digit holding the K-th key), and how many
//! keys equal to `T` the top-K holds (`take_equal`). A candidate is selected iff its key is
//! above `T`, or equal to `T` and among the first `take_equal` such candidates by page index.
//! Each thread owns a contiguous run of candidates, so a block prefix sum of the per-thread
//! counts of equal keys ranks them by index, and a second one over the selected counts gives
//! every selected page its place: the held selection comes out in ascending page order, no
//! sort needed. The radix passes keep the first [`KEY_BATCH`] x [`SELECT_THREADS`] candidates'
//! keys in registers (4096: every candidate up to 256K tokens at 64-token pages), loaded once,
//! all at the same time; candidates past them are re-read from the score workspace (global
//! memory, L2-resident after the scorer) on each pass, so there is no hard maximum. The two
//! passes over each thread's contiguous run load [`KEY_BATCH`] keys at a time.

use core::arch::asm;

use lserve_abi::select::{score_key, score_offset, selection_due, SelectParams, SELECT_THREADS};

use super::scan::block_inclusive_scan;
use crate::smem::{dynamic_smem, shared_addr};
use crate::sync::sync_threads;
use crate::thread::{block_idx_x, thread_in_block};

/// The buffers the selector reads and writes.
#[derive(Clone, Copy)]
pub struct SelectBuffers {
    /// `[B][Hd][max_pages]` physical-page scores (from the scorer).
    pub scores: *const f32,
    /// `[slots][max_pages]` physical page ids.
    pub block_tables: *const u32,
    /// `[B]` sequence lengths (after this step's token).
    pub seq_len: *const u32,
    /// `[B]` sequence slots.
    pub seq_slot: *const u32,
    /// `[slots]` decode step counters (read only).
    pub decode_steps: *const u32,
    /// `[slots][Hd][held_capacity]` held selections (logical page numbers, ascending).
    pub held_pages: *mut u32,
    /// `[slots][Hd]` held selection lengths.
    pub held_lens: *mut u32,
    /// `[slots][Hd][entry_capacity]` index tables (physical page ids).
    pub index_pages: *mut u32,
    /// `[slots][Hd]` index table lengths.
    pub index_lens: *mut u32,
}

/// Shared memory, in `u32` words.
const HIST: usize = 0;
const WARP_SUMS: usize = 256;
const BROADCAST: usize = 256 + 32;

/// Adds 1 to the shared `u32` at window address `addr`.
///
/// # Safety
/// `addr` is a 4-byte aligned address inside the block's shared memory.
#[inline(always)]
unsafe fn shared_increment(addr: u32) {
    // SAFETY: the caller guarantees the address; `red` is atomic among the block's threads.
    unsafe { asm!("red.shared.add.u32 [{0}], 1;", in(reg32) addr, options(nostack)) };
}

/// Keys loaded at once: the radix passes' register-resident keys of a thread, and a batch of a
/// thread's contiguous run.
const KEY_BATCH: usize = 8;

/// The keys of candidates `first + i * step` for `i < KEY_BATCH` that are below `end` (the rest
/// zero; callers skip them), all loaded before any is used, so that their L2 round trips
/// overlap: the selector's loops do shared-memory increments or global stores between uses,
/// which would otherwise order each load after the previous one.
///
/// # Safety
/// `scores` holds at least `end` values.
#[inline(always)]
unsafe fn key_batch(scores: *const f32, first: u32, step: u32, end: u32) -> [u32; KEY_BATCH] {
    let mut keys = [0u32; KEY_BATCH];
    crate::unroll8!(i in 0..KEY_BATCH => {
        let c = first + i as u32 * step;
        // SAFETY: `c < end`.
        keys[i] = if c < end { score_key(unsafe { *scores.add(c as usize) }) } else { 0 };
    });
    keys
}

/// The key of the K-th largest of `scores[0..n]` and how many keys equal to it belong to the
/// top `k` (`1 <= k < n`).
///
/// # Safety
/// Every thread of the block calls it; `scores` holds `n` values; shared memory as laid out
/// above.
#[inline(always)]
unsafe fn radix_select(scores: *const f32, n: u32, k: u32) -> (u32, u32) {
    let t = thread_in_block();
    let hist = dynamic_smem::<u32>(HIST * 4);
    let warp_sums = dynamic_smem::<u32>(WARP_SUMS * 4);
    let broadcast = dynamic_smem::<u32>(BROADCAST * 4);
    // The thread's first KEY_BATCH candidates (strided: 4096 per block, every candidate up to
    // 256K tokens at 64-token pages) stay in registers through the passes; those past them are
    // re-read from the workspace (L2) on each pass.
    // SAFETY: forwarded.
    let keys = unsafe { key_batch(scores, t, SELECT_THREADS, n) };
    let spilled_from = t + KEY_BATCH as u32 * SELECT_THREADS;
    let (mut prefix, mut mask, mut need) = (0u32, 0u32, k);
    let mut shift = 32;
    while shift > 0 {
        shift -= 8;
        // SAFETY (all shared accesses): inside the layout above, ordered by the barriers;
        // (barriers, scans): block-uniform control flow.
        unsafe {
            if t < 256 {
                *hist.add(t as usize) = 0;
            }
            sync_threads();
            let count_key = |key: u32| {
                if key & mask == prefix {
                    shared_increment(shared_addr(hist.add(((key >> shift) & 0xff) as usize)));
                }
            };
            crate::unroll8!(i in 0..KEY_BATCH => {
                if t + (i as u32) * SELECT_THREADS < n {
                    count_key(keys[i]);
                }
            });
            let mut c = spilled_from;
            while c < n {
                count_key(score_key(*scores.add(c as usize)));
                c += SELECT_THREADS;
            }
            sync_threads();
            // Thread t < 256 counts digit 255 - t: the prefix sum is the keys with a digit >= it.
            let count = if t < 256 {
                *hist.add(255 - t as usize)
            } else {
                0
            };
            let (at_least, _) = block_inclusive_scan(count, warp_sums, SELECT_THREADS);
            if t < 256 && at_least >= need && at_least - count < need {
                *broadcast = 255 - t;
                *broadcast.add(1) = need - (at_least - count);
            }
            sync_threads();
            let digit = *broadcast;
            need = *broadcast.add(1);
            prefix |= digit << shift;
            mask |= 0xff << shift;
        }
    }
    (prefix, need)
}

/// The selector body (see the module docs).
///
/// # Safety
/// Launched with grid `p.batch * p.paged.heads`, [`SELECT_THREADS`] threads and
/// `SELECT_SMEM_BYTES` of dynamic shared memory, after the scorer on the same batch and state;
/// buffers as [`SelectBuffers`] documents, capacities as `p` states (`held_capacity >= K + 2`,
/// `entry_capacity >= min(K + 3, max_pages)`), slots live and distinct.
#[inline(always)]
pub unsafe fn select_pages(p: &SelectParams, bufs: &SelectBuffers) {
    let pair = block_idx_x();
    let dense_heads = p.paged.heads;
    let (b, dense_head) = (pair / dense_heads, pair % dense_heads);
    // SAFETY: `b < batch` by the grid.
    let (len, slot) = unsafe {
        (
            *bufs.seq_len.add(b as usize),
            *bufs.seq_slot.add(b as usize),
        )
    };
    if len <= p.dynamic_min_len {
        return; // dense decode: attention reads the block table
    }
    let entry = (slot * dense_heads + dense_head) as usize;
    // SAFETY: the slot is live: its counter and held state exist.
    let (step, held_len) = unsafe {
        (
            *bufs.decode_steps.add(slot as usize),
            *bufs.held_lens.add(entry),
        )
    };
    if !selection_due(len, p.dynamic_min_len, step, p.reuse_interval, held_len) {
        return; // reuse: the append keeps the entry (held selection, then the newest page)
    }
    let newest = len.div_ceil(p.paged.page_tokens) - 1;
    let t = thread_in_block();
    // SAFETY (pointer offsets): the pair's rows of each table.
    let (table, held, index) = unsafe {
        (
            bufs.block_tables.add((slot * p.max_pages) as usize),
            bufs.held_pages.add(entry * p.held_capacity as usize),
            bufs.index_pages.add(entry * p.entry_capacity as usize),
        )
    };
    // Every thread has read `held_len` before the selection below may rewrite it.
    // SAFETY: block-uniform (everything above is per block).
    unsafe { sync_threads() };

    // Candidates: pages first..newest (page 0 is not one when it is always included).
    let first = p.always_include_first.min(newest);
    let always_first = p.always_include_first != 0;
    let candidates = newest - first;
    // SAFETY: the pair's workspace row, from the first candidate on.
    let scores = unsafe {
        bufs.scores
            .add(score_offset(b, dense_head, dense_heads, p.max_pages) + first as usize)
    };
    let (threshold, take_equal) = if candidates > p.top_k {
        // SAFETY: block-uniform; `1 <= top_k < candidates`.
        unsafe { radix_select(scores, candidates, p.top_k) }
    } else {
        (0, u32::MAX) // every key is >= 0: take them all
    };

    // This thread's contiguous run of candidates, and what it holds of the top-K.
    let per_thread = candidates.div_ceil(SELECT_THREADS);
    let begin = (t * per_thread).min(candidates);
    let end = (begin + per_thread).min(candidates);
    let (mut above, mut equal) = (0u32, 0u32);
    let mut c = begin;
    while c < end {
        // SAFETY: `end <= candidates`.
        let keys = unsafe { key_batch(scores, c, 1, end) };
        crate::unroll8!(u in 0..KEY_BATCH => {
            if c + (u as u32) < end {
                above += (keys[u] > threshold) as u32;
                equal += (keys[u] == threshold) as u32;
            }
        });
        c += KEY_BATCH as u32;
    }
    let warp_sums = dynamic_smem::<u32>(WARP_SUMS * 4);
    // SAFETY: block-uniform.
    let (equal_through, _) = unsafe { block_inclusive_scan(equal, warp_sums, SELECT_THREADS) };
    let equal_before = equal_through - equal;
    let taken = above + equal.min(take_equal.saturating_sub(equal_before));
    // SAFETY: block-uniform.
    let (taken_through, total) = unsafe { block_inclusive_scan(taken, warp_sums, SELECT_THREADS) };

    // Held selection: [0 if always included] ++ selected candidates (ascending) ++ [newest].
    let mut at = always_first as u32 + taken_through - taken;
    let mut equal_seen = equal_before;
    let mut c = begin;
    while c < end {
        // SAFETY: `end <= candidates`.
        let keys = unsafe { key_batch(scores, c, 1, end) };
        crate::unroll8!(u in 0..KEY_BATCH => {
            let key = keys[u];
            if c + (u as u32) < end {
                let take = key > threshold || (key == threshold && equal_seen < take_equal);
                equal_seen += (key == threshold) as u32;
                if take {
                    let page = first + c + u as u32;
                    // SAFETY: `at < 1 + K <= held_capacity`; the page is the sequence's, so its
                    // block table entry exists.
                    unsafe {
                        *held.add(at as usize) = page;
                        *index.add(at as usize) = *table.add(page as usize);
                    }
                    at += 1;
                }
            }
        });
        c += KEY_BATCH as u32;
    }
    if t == 0 {
        // SAFETY: positions below `K + 2 <= held_capacity` and the entry capacity.
        unsafe {
            let mut n = always_first as u32 + total;
            if always_first {
                *held = 0;
                *index = *table;
            }
            if !(always_first && newest == 0) {
                *held.add(n as usize) = newest;
                *index.add(n as usize) = *table.add(newest as usize);
                n += 1;
            }
            *bufs.held_lens.add(entry) = n;
            *bufs.index_lens.add(entry) = n;
        }
    }
}
