//! The selector: exact top-K pages of each due (sequence, dense KV head) pair into its held
//! selection and its index-table entry. Pairs that reuse their selection are left alone: the
//! decode append keeps their entries (`kv_write::append`).
//!
//! Grid `pairs`, [`SELECT_THREADS`] threads, [`SELECT_SMEM_BYTES`] of shared memory.
//!
//! **Top-K, ties to the lower index.** Scores become order-preserving `u32` keys
//! ([`score_key`]). A radix select finds the key `T` of the K-th largest candidate in four
//! passes of 8 bits (each pass counts the keys that match the digits fixed so far into a 256-bin
//! shared histogram of its own; after one barrier every warp sums the bins from the top itself
//! to find the digit holding the K-th key, so no result is broadcast), and how many keys equal to
//! `T` the top-K holds (`take_equal`). A candidate is selected iff its key is above `T`, or equal
//! to `T` and among the first `take_equal` such candidates by page index. Each thread owns a
//! contiguous run of candidates, the runs ascending with the thread index, so one block prefix
//! sum of the per-thread counts of keys above and equal to `T` ranks the equal keys by index and
//! gives every selected page its place: the held selection comes out in ascending page order, no
//! sort needed.
//!
//! **Where the keys live.** Up to [`KEY_BATCH`] x [`SELECT_THREADS`] candidates (4096 less the
//! up to 3 of the alignment [`ResidentRun`] describes: at 64-token pages every candidate up to
//! 256K tokens when the workspace rows are 16-byte aligned, `max_pages % 4 == 0`), each thread's
//! run is [`KEY_BATCH`] slots, loaded once (16-byte loads) and kept
//! in registers through the radix passes and the placement, and the block-table entries of its
//! candidates are loaded before the kernel waits for the scorer. After the wait two global round
//! trips remain: the step counter and held length (is the pair due?), then the keys.
//! With more candidates ([`select_streamed`]) the radix passes keep the first 4096 (strided) in
//! registers and re-read the others from the score workspace (L2-resident after the scorer) on
//! each pass, and the two passes over each thread's run load [`KEY_BATCH`] keys at a time: no
//! hard maximum. `DESIGN.md` counts the round trips and barriers.

use lserve_abi::layout::{unit_id, unit_page};
use lserve_abi::select::{
    held_newest_at, score_key, score_offset, selection_due, SelectArgs, SELECT_SMEM_BYTES,
    SELECT_THREADS,
};

use super::scan::{block_inclusive_scan_pair, warp_inclusive_scan};
use crate::math::Vec16;
use crate::smem::{dynamic_smem, ld_shared_v4_u32, shared_addr, shared_increment_u32};
use crate::sync::{overlapped_entry, sync_threads};
use crate::thread::{block_idx_x, lane, thread_in_block};
use crate::warp::{ballot, shfl_idx_u32};

/// Radix passes of 8 bits over the 32-bit keys.
const RADIX_PASSES: usize = 4;
/// Bins of a pass's histogram.
const BINS: usize = 256;

/// Shared memory, in `u32` words: one histogram per radix pass, all zeroed once before the
/// passes (so no pass zeroes one, or waits for that), then the block scan's two partial sums
/// per warp. Each region is written in one phase and read in the next, never reused.
const HISTS: usize = 0;
const WARP_SUMS: usize = HISTS + RADIX_PASSES * BINS;
const _: () = assert!((WARP_SUMS + 2 * 32) * 4 <= SELECT_SMEM_BYTES as usize);
const _: () = assert!(RADIX_PASSES * BINS == 2 * SELECT_THREADS as usize);

/// Keys a thread holds at once: a resident run, the radix passes' strided keys of a streamed
/// selection, and a batch of a streamed run.
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

/// A thread's run of candidates when every candidate's key fits in registers. The runs tile a
/// frame that starts at the 16-byte boundary at or below candidate 0 (`lead` scores before it):
/// thread `t` owns frame slots `KEY_BATCH * t .. KEY_BATCH * (t + 1)`, so each 4-slot chunk of a
/// run is one aligned 16-byte load, and the runs ascend with `t`. Slot `i` is candidate
/// `origin + i`, one of the pair's iff bit `i` of `valid` is set.
#[derive(Clone, Copy)]
struct ResidentRun {
    /// The candidate of slot 0 (wrapping: thread 0's first `lead` slots precede candidate 0).
    origin: u32,
    /// Bit `i`: slot `i` is a candidate.
    valid: u32,
}

impl ResidentRun {
    /// Thread `t`'s run, or `None` when the candidates do not fit the frame. `scores` points at
    /// candidate 0's score (4-byte aligned).
    #[inline(always)]
    fn new(scores: *const f32, candidates: u32, t: u32) -> Option<Self> {
        let lead = (scores as usize / 4 % 4) as u32;
        if candidates + lead > KEY_BATCH as u32 * SELECT_THREADS {
            return None;
        }
        let start = KEY_BATCH as u32 * t;
        // Slots of this run below frame slot `n`.
        let below = |n: u32| (1u32 << n.saturating_sub(start).min(KEY_BATCH as u32)) - 1;
        Some(Self {
            origin: start.wrapping_sub(lead),
            // Frame slots `lead .. lead + candidates` are the candidates.
            valid: below(lead + candidates) & !below(lead),
        })
    }

    /// Whether slot `i` is a candidate.
    #[inline(always)]
    fn holds(self, i: usize) -> bool {
        self.valid >> i & 1 != 0
    }

    /// The candidate of slot `i` (meaningful if [`Self::holds`] it).
    #[inline(always)]
    fn candidate(self, i: usize) -> u32 {
        self.origin.wrapping_add(i as u32)
    }

    /// The index-entry ids of the run's candidates (unit `rows.first + candidate`; 0 in the
    /// other slots), all block-table loads issued before any is used.
    ///
    /// # Safety
    /// `rows.table` is the sequence's block table row and the candidates are its units.
    #[inline(always)]
    unsafe fn unit_ids(self, rows: &Rows) -> [u32; KEY_BATCH] {
        let mut ids = [0u32; KEY_BATCH];
        crate::unroll8!(i in 0..KEY_BATCH => {
            if self.holds(i) {
                // SAFETY: a unit of the sequence.
                ids[i] = unsafe { rows.unit_id(rows.first + self.candidate(i)) };
            }
        });
        ids
    }

    /// The scores of the run's candidates (0 in the other slots), all loads issued before any
    /// is used: a whole chunk of 4 candidates in one 16-byte load, a chunk at either end of the
    /// candidates one score at a time. Scores, not keys: converted inside this function, ptxas
    /// would wait for a chunk's load before issuing the next chunk's.
    ///
    /// # Safety
    /// `scores` points at candidate 0's score and holds every candidate's.
    #[inline(always)]
    unsafe fn scores(self, scores: *const f32) -> [f32; KEY_BATCH] {
        let mut raw = [0f32; KEY_BATCH];
        crate::unroll8!(chunk in 0..KEY_BATCH / 4 => {
            let s = 4 * chunk;
            if self.valid >> s & 0xf == 0xf {
                // SAFETY: four candidates' scores; the chunk starts at a frame slot that is a
                // multiple of 4, so at a 16-byte boundary.
                let v = unsafe { scores.add(self.candidate(s) as usize).cast::<Vec16>().read() };
                raw[s..s + 4].copy_from_slice(&v.0.map(f32::from_bits));
            } else {
                crate::unroll8!(u in 0..4 => {
                    if self.holds(s + u) {
                        // SAFETY: a candidate's score.
                        raw[s + u] = unsafe { *scores.add(self.candidate(s + u) as usize) };
                    }
                });
            }
        });
        raw
    }
}

/// Zeroes the radix passes' histograms, two words per thread. A barrier must separate it from
/// the first pass.
///
/// # Safety
/// Every thread of the block calls it (or the histograms are not all zero); shared memory as
/// laid out above, not in use.
#[inline(always)]
unsafe fn zero_histograms(t: u32) {
    let hists = dynamic_smem::<u32>(HISTS * 4);
    // SAFETY: words `2t` and `2t + 1` of the `2 * SELECT_THREADS` histogram words.
    unsafe {
        *hists.add(2 * t as usize) = 0;
        *hists.add(2 * t as usize + 1) = 0;
    }
}

/// One radix pass: its histogram and the digits fixed by the passes before it.
#[derive(Clone, Copy)]
struct RadixPass {
    /// Shared-window address of the pass's histogram.
    hist: u32,
    prefix: u32,
    mask: u32,
    shift: u32,
}

impl RadixPass {
    /// Counts `key` in its digit's bin if it matches the digits fixed so far.
    ///
    /// # Safety
    /// Called inside [`radix_select`]'s pass (its `count_all`).
    #[inline(always)]
    unsafe fn count(self, key: u32) {
        if key & self.mask == self.prefix {
            // SAFETY: a bin of the pass's histogram.
            unsafe { shared_increment_u32(self.hist + 4 * ((key >> self.shift) & 0xff)) };
        }
    }
}

/// The digit of the `need`-th largest key counted in the 256-bin histogram at `hist`, and the
/// rank of that key among the keys with that digit (`need` less the keys with a higher digit).
/// Every warp runs it on the same histogram and gets the same answer, so nothing is broadcast.
///
/// # Safety
/// All 32 lanes call it; the histogram is complete (a barrier after its last increment) and
/// holds at least `need >= 1` keys.
#[inline(always)]
unsafe fn find_digit(hist: u32, need: u32) -> (u32, u32) {
    // Lane `l` holds digits `base .. base + 8`, lane 0 the top eight.
    let base = BINS as u32 - 8 - 8 * lane();
    // SAFETY: 16-byte aligned (the window is; `4 * base` is a multiple of 32), inside the
    // histogram; complete (caller).
    let bins = unsafe {
        let [a, b, c, d] = ld_shared_v4_u32(hist + 4 * base);
        let [e, f, g, h] = ld_shared_v4_u32(hist + 4 * (base + 4));
        [a, b, c, d, e, f, g, h]
    };
    let sum = bins.iter().sum::<u32>();
    // Keys with a digit >= `base`: the counts of lanes `0..=l`, growing with the lane.
    // SAFETY: the whole warp calls.
    let [through] = unsafe { warp_inclusive_scan([sum]) };
    // The lane whose digits hold the `need`-th key: the first whose running count reaches it.
    // SAFETY: the whole warp calls.
    let holder = unsafe { ballot(through < need) }.count_ones();
    // On every lane, the digit at which its running count crosses `need`, if any.
    let mut above = through - sum;
    let (mut digit, mut rank) = (0, 0);
    crate::unroll8!(i in 0..8 => {
        let j = 7 - i;
        let higher = above;
        above += bins[j];
        if higher < need && above >= need {
            digit = base + j as u32;
            rank = need - higher;
        }
    });
    // SAFETY: the whole warp calls; `holder < 32` as the histogram holds `need` keys.
    unsafe { (shfl_idx_u32(digit, holder), shfl_idx_u32(rank, holder)) }
}

/// The top K as the radix select leaves it: every key above `threshold`, and the first
/// `take_equal` keys equal to it by page index.
#[derive(Clone, Copy)]
struct Cut {
    threshold: u32,
    take_equal: u32,
}

impl Cut {
    /// Every candidate (every key is >= 0).
    const ALL: Cut = Cut {
        threshold: 0,
        take_equal: u32::MAX,
    };

    /// Adds `key` to a thread's counts of keys above and equal to the threshold.
    #[inline(always)]
    fn tally(self, key: u32, above: &mut u32, equal: &mut u32) {
        *above += (key > self.threshold) as u32;
        *equal += (key == self.threshold) as u32;
    }
}

/// The cut of the top `k` of the candidates each thread counts with `count_all`
/// (`1 <= k < candidates`): four passes, one barrier each.
///
/// # Safety
/// Every thread of the block calls it (block-uniform); the histograms zeroed by
/// [`zero_histograms`] with a barrier since, and not used since.
#[inline(always)]
unsafe fn radix_select(k: u32, count_all: impl Fn(RadixPass)) -> Cut {
    let hists = shared_addr(dynamic_smem::<u32>(HISTS * 4));
    let (mut prefix, mut mask, mut need) = (0u32, 0u32, k);
    for pass in 0..RADIX_PASSES as u32 {
        let shift = 24 - 8 * pass;
        let hist = hists + pass * BINS as u32 * 4;
        count_all(RadixPass {
            hist,
            prefix,
            mask,
            shift,
        });
        // Every increment of the pass is done before any warp reads its histogram. The next
        // pass counts into a histogram of its own, so nothing orders these reads before it.
        // SAFETY: block-uniform control flow; the histogram then holds every matching key, at
        // least `need` of them.
        let (digit, rank) = unsafe {
            sync_threads();
            find_digit(hist, need)
        };
        prefix |= digit << shift;
        mask |= 0xff << shift;
        need = rank;
    }
    Cut {
        threshold: prefix,
        take_equal: need,
    }
}

/// Where a thread's selected candidates go in the held selection and the index entry.
struct Placement {
    cut: Cut,
    /// The next position to write.
    at: u32,
    /// Keys equal to the threshold before the thread's next candidate.
    equal_seen: u32,
    /// Candidates the block selects.
    total: u32,
}

impl Placement {
    /// From the thread's counts of keys above and equal to `cut`'s threshold; `offset`
    /// positions precede the selected candidates. One block scan (one barrier).
    ///
    /// # Safety
    /// Every thread of the block calls it (block-uniform), once per launch (it uses the scan's
    /// shared words).
    #[inline(always)]
    unsafe fn new(cut: Cut, above: u32, equal: u32, offset: u32) -> Self {
        let warp_sums = dynamic_smem::<u32>(WARP_SUMS * 4);
        // SAFETY: forwarded; the scan's words are used by this call only.
        let ([equal_through, above_through], [equal_total, above_total]) =
            unsafe { block_inclusive_scan_pair([equal, above], warp_sums, SELECT_THREADS) };
        let (equal_before, above_before) = (equal_through - equal, above_through - above);
        // Runs ascend with the thread: the equal keys taken are the first `take_equal` of the
        // block's, and the threads before this one hold `equal_before` of them.
        Self {
            cut,
            at: offset + above_before + equal_before.min(cut.take_equal),
            equal_seen: equal_before,
            total: above_total + equal_total.min(cut.take_equal),
        }
    }

    /// Whether the thread's next candidate, with key `key`, is selected. Called once for each
    /// candidate of the run, in order.
    #[inline(always)]
    fn take(&mut self, key: u32) -> bool {
        let equal = key == self.cut.threshold;
        let take = key > self.cut.threshold || (equal && self.equal_seen < self.cut.take_equal);
        self.equal_seen += equal as u32;
        take
    }

    /// Writes a selected page (logical number and physical id) at the next position.
    ///
    /// # Safety
    /// `held` and `index` are the pair's rows, with room for the selection.
    #[inline(always)]
    unsafe fn put(&mut self, held: *mut u32, index: *mut u32, page: u32, id: u32) {
        // SAFETY: `at < 1 + K <= held_capacity`, and below the entry capacity.
        unsafe {
            *held.add(self.at as usize) = page;
            *index.add(self.at as usize) = id;
        }
        self.at += 1;
    }
}

/// The pair's rows the selection writes, and where its candidates are. Candidates are the
/// sequence's selection units: physical pages, or logical pages (`units_per_page > 1`).
#[derive(Clone, Copy)]
struct Rows {
    /// Candidate 0's score (the workspace row from the first candidate on).
    scores: *const f32,
    /// The sequence's block table.
    table: *const u32,
    held: *mut u32,
    index: *mut u32,
    /// The unit of candidate 0.
    first: u32,
    candidates: u32,
    /// Held positions before the first selected candidate (unit 0 when always included).
    offset: u32,
    /// Selection units per physical page.
    units_per_page: u32,
}

impl Rows {
    /// The index-entry id of the sequence's unit `unit` (`lserve_abi::layout::unit_id` of its
    /// page's block-table entry).
    ///
    /// # Safety
    /// `unit` is a unit of the sequence, so its page is in the block table row.
    #[inline(always)]
    unsafe fn unit_id(&self, unit: u32) -> u32 {
        let upp = self.units_per_page;
        // SAFETY: forwarded.
        let page = unsafe { *self.table.add(unit_page(unit, upp) as usize) };
        unit_id(page, unit, upp)
    }
}

/// Selects from resident runs (`keys` and `ids` loaded by `run`); returns how many candidates
/// the block selects.
///
/// # Safety
/// Every thread of the block calls it, each with its own run (block-uniform); histograms as
/// [`radix_select`] needs; rows as [`select_pages`] sets them up.
#[inline(always)]
unsafe fn select_resident(
    k: u32,
    rows: Rows,
    run: ResidentRun,
    keys: [u32; KEY_BATCH],
    ids: [u32; KEY_BATCH],
) -> u32 {
    let cut = if rows.candidates > k {
        // SAFETY: forwarded; `1 <= k < candidates`.
        unsafe {
            radix_select(k, |pass| {
                crate::unroll8!(i in 0..KEY_BATCH => {
                    if run.holds(i) {
                        pass.count(keys[i]);
                    }
                });
            })
        }
    } else {
        Cut::ALL
    };
    let (mut above, mut equal) = (0u32, 0u32);
    crate::unroll8!(i in 0..KEY_BATCH => {
        if run.holds(i) {
            cut.tally(keys[i], &mut above, &mut equal);
        }
    });
    // SAFETY: forwarded.
    let mut place = unsafe { Placement::new(cut, above, equal, rows.offset) };
    // Stores only: the block-table entries were loaded before the wait.
    crate::unroll8!(i in 0..KEY_BATCH => {
        if run.holds(i) && place.take(keys[i]) {
            let page = rows.first + run.candidate(i);
            // SAFETY: the pair's rows.
            unsafe { place.put(rows.held, rows.index, page, ids[i]) };
        }
    });
    place.total
}

/// Selects when the candidates do not fit in registers (see the module docs); returns how many
/// candidates the block selects.
///
/// # Safety
/// As [`select_resident`].
#[inline(always)]
unsafe fn select_streamed(k: u32, rows: Rows) -> u32 {
    let t = thread_in_block();
    let (scores, n) = (rows.scores, rows.candidates);
    let cut = if n > k {
        // The thread's first KEY_BATCH candidates (strided: 4096 per block) stay in registers
        // through the passes; those past them are re-read from the workspace on each pass.
        // SAFETY: the workspace holds the candidates' scores.
        let keys = unsafe { key_batch(scores, t, SELECT_THREADS, n) };
        let spilled_from = t + KEY_BATCH as u32 * SELECT_THREADS;
        // SAFETY: forwarded; `1 <= k < candidates`; the workspace holds the candidates' scores.
        unsafe {
            radix_select(k, |pass| {
                crate::unroll8!(i in 0..KEY_BATCH => {
                    if t + (i as u32) * SELECT_THREADS < n {
                        pass.count(keys[i]);
                    }
                });
                let mut c = spilled_from;
                while c < n {
                    pass.count(score_key(*scores.add(c as usize)));
                    c += SELECT_THREADS;
                }
            })
        }
    } else {
        Cut::ALL
    };

    // This thread's contiguous run of candidates, and what it holds of the top-K.
    let per_thread = n.div_ceil(SELECT_THREADS);
    let begin = (t * per_thread).min(n);
    let end = (begin + per_thread).min(n);
    let (mut above, mut equal) = (0u32, 0u32);
    let mut c = begin;
    while c < end {
        // SAFETY: `end <= candidates`.
        let keys = unsafe { key_batch(scores, c, 1, end) };
        crate::unroll8!(u in 0..KEY_BATCH => {
            if c + (u as u32) < end {
                cut.tally(keys[u], &mut above, &mut equal);
            }
        });
        c += KEY_BATCH as u32;
    }
    // SAFETY: forwarded.
    let mut place = unsafe { Placement::new(cut, above, equal, rows.offset) };
    let mut c = begin;
    while c < end {
        // SAFETY: `end <= candidates`.
        let keys = unsafe { key_batch(scores, c, 1, end) };
        // The batch's block-table loads first, then its stores, so that the loads overlap.
        let (mut taken, mut ids) = (0u32, [0u32; KEY_BATCH]);
        crate::unroll8!(u in 0..KEY_BATCH => {
            if c + (u as u32) < end && place.take(keys[u]) {
                taken |= 1 << u;
                // SAFETY: a unit of the sequence.
                ids[u] = unsafe { rows.unit_id(rows.first + c + u as u32) };
            }
        });
        crate::unroll8!(u in 0..KEY_BATCH => {
            if taken >> u & 1 != 0 {
                // SAFETY: the pair's rows.
                unsafe { place.put(rows.held, rows.index, rows.first + c + u as u32, ids[u]) };
            }
        });
        c += KEY_BATCH as u32;
    }
    place.total
}

/// The selector body (see the module docs). Waits for the kernel before itself
/// ([`overlapped_entry`]) after reading what the host wrote.
///
/// # Safety
/// Launched with grid `p.batch * p.cache.paged.heads`, [`SELECT_THREADS`] threads and
/// `SELECT_SMEM_BYTES` of dynamic shared memory, after the scorer on the same batch and state
/// (overlapped or not); buffers as [`SelectArgs`] documents, capacities as `p` states
/// (`held_capacity >= K + 2`, `entry_capacity >= min(K + 3, max_pages)`: the held selection
/// plus the page the append adds between selections), slots live and
/// distinct; `seq_len`, `seq_slot` and the block tables written by host copies enqueued before
/// the previous kernel, not by a kernel.
///
/// `LOGICAL`: the units are logical pages (`p.selection.units_per_page` of them per page); else
/// physical pages, whatever the layout says (one unit per page as a constant, so the physical
/// selector carries none of the unit arithmetic).
#[inline(always)]
pub unsafe fn select_pages<const LOGICAL: bool>(a: &SelectArgs) {
    let p = &a.params;
    let pair = block_idx_x();
    let dense_heads = p.cache.paged.heads;
    let (b, dense_head) = (pair / dense_heads, pair % dense_heads);
    let t = thread_in_block();
    // Overlapped with the kernel before (the scorer): the batch description and the block tables
    // are copies from the host, complete before that kernel started, so they are read before the
    // wait; the scores, the step counters and the held selections may be outputs of the kernels
    // before: read after it.
    // SAFETY: `b < batch` by the grid.
    let (len, slot) = unsafe {
        (
            *a.batch.seq_len.get().add(b as usize),
            *a.batch.seq_slot.get().add(b as usize),
        )
    };
    // Otherwise dense decode: attention reads the block table.
    let selecting = len > p.dynamic_min_len;
    let units_per_page = if LOGICAL {
        p.selection.units_per_page
    } else {
        1
    };
    let unit_tokens = p.cache.paged.page_tokens >> units_per_page.trailing_zeros();
    let newest = len.div_ceil(unit_tokens).saturating_sub(1);
    // Candidates: units first..newest (unit 0 is not one when it is always included).
    let first = p.always_include_first.min(newest);
    let always_first = p.always_include_first != 0;
    let entry = (slot * dense_heads + dense_head) as usize;
    // SAFETY (pointer offsets): the pair's rows of each table, its workspace row from the first
    // candidate on.
    let rows = unsafe {
        Rows {
            scores: a.scores.get().add(
                score_offset(
                    b,
                    dense_head,
                    dense_heads,
                    p.cache.max_pages * units_per_page,
                ) + first as usize,
            ),
            table: a
                .block_tables
                .get()
                .add((slot * p.cache.max_pages) as usize),
            held: a
                .selection
                .held_pages
                .get()
                .add(entry * p.selection.held_capacity as usize),
            index: a
                .selection
                .index_pages
                .get()
                .add(entry * p.selection.entry_capacity as usize),
            first,
            candidates: newest - first,
            offset: always_first as u32,
            units_per_page,
        }
    };
    let resident = ResidentRun::new(rows.scores, rows.candidates, t);
    // Block-table entries whose addresses depend on the length only: the resident run's, and
    // unit 0's and the newest unit's (thread 0 writes those two last).
    let (mut ids, mut ends) = ([0u32; KEY_BATCH], [0u32; 2]);
    if selecting {
        if let Some(run) = resident {
            // SAFETY: the sequence's table row; candidates are its units.
            ids = unsafe { run.unit_ids(&rows) };
        }
        if t == 0 {
            // SAFETY: units 0 and `newest` are the sequence's (`len >= 1` when selecting).
            ends = unsafe { [rows.unit_id(0), rows.unit_id(newest)] };
        }
    }
    // SAFETY: every thread, block-uniform; the barrier separates the zeroing from the passes.
    unsafe {
        zero_histograms(t);
        sync_threads();
    }
    // Every block waits, even one with nothing to do: a kernel that completed before the one it
    // overlaps could let the next kernel (which waits only for this one) start early.
    // SAFETY: before this block's first access of anything a kernel before it reads or writes
    // (everything above is host copies and shared memory).
    unsafe { overlapped_entry() };
    if !selecting {
        return;
    }
    // SAFETY: the slot is live: its counter and held state exist.
    let (step, held_len) = unsafe {
        (
            *a.decode_steps.get().add(slot as usize),
            *a.selection.held_lens.get().add(entry),
        )
    };
    if !selection_due(len, p.dynamic_min_len, step, p.reuse_interval, held_len) {
        return; // reuse: the append keeps the entry (held selection, then the newest page)
    }
    // Not loaded with the counters above, which would save a round trip when due: when not
    // due (3 steps in 4 at reuse 4) the block could not exit before they arrived, from HBM if
    // the workspace row has left the L2 since the last selection.
    let keys = match resident {
        // SAFETY: the workspace row holds every candidate's score.
        Some(run) => unsafe { run.scores(rows.scores) }.map(score_key),
        None => [0; KEY_BATCH],
    };
    // Every thread reads `held_len` above before thread 0 rewrites it below: the block scan of
    // both paths (a barrier) lies between.
    let total = match resident {
        // SAFETY: block-uniform (`resident` depends on the pair only); as set up above.
        Some(run) => unsafe { select_resident(p.top_k, rows, run, keys, ids) },
        // SAFETY: as above.
        None => unsafe { select_streamed(p.top_k, rows) },
    };

    // Held selection: [0 if always included] ++ selected candidates (ascending) ++ [newest].
    if t == 0 {
        // SAFETY: positions below `K + 2 < held_capacity` and the entry capacity; the last
        // position of the held row.
        unsafe {
            let mut n = always_first as u32 + total;
            if always_first {
                *rows.held = 0;
                *rows.index = ends[0];
            }
            if !(always_first && newest == 0) {
                *rows.held.add(n as usize) = newest;
                *rows.index.add(n as usize) = ends[1];
                n += 1;
            }
            // The selection's newest page, where the decode kernel reads it beside the length.
            *rows
                .held
                .add(held_newest_at(p.selection.held_capacity) as usize) = newest;
            *a.selection.held_lens.get().add(entry) = n;
            *a.selection.index_lens.get().add(entry) = n;
        }
    }
}
