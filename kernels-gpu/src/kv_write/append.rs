//! The decode append: one new token per sequence, every KV head.
//!
//! Grid `ceil(batch * Hkv * D / 8 / KV_WRITE_THREADS)`; thread `i` owns chunk `i` of the
//! activations `k`, `v` `[batch][Hkv][D]`, i.e. 8 channels of one (sequence, KV head). The token
//! is position `len - 1` of its sequence. A dense head writes it into its page and folds it into
//! the statistics of its logical page: the key itself if the token starts the logical page, else
//! the running per-channel min/max ([`Bounds::include`]), and, where the cache keeps them, the
//! page's 8-bit statistics coded again ([`store_stat_codes`]). A streaming head writes its sink or
//! ring row (the newest token is always held).
//!
//! **Index entries between selections.** A dense head's index-table entry is its held selection
//! (physical ids, written by the selector on the steps it selects) followed by the newest page
//! if the selection does not end with it. Every append of a sequence past `dynamic_min_len`
//! rewrites that tail from the token's page, so the entry is right however the sequence reached
//! its length (one token per step, or rows written in between), and a step that reuses its
//! selection needs no selector launch. (On a step that selects, the selector rewrites the entry
//! after the append.)

use lserve_abi::buffers::SelectionPtrs;
use lserve_abi::kv_write::{AppendArgs, AppendParams, CHUNK_ELEMS, KV_WRITE_THREADS};
use lserve_abi::layout::unit_id;

use super::stat_codes::store_stat_codes;
use super::stats::Bounds;
use super::target::{chunk_at, load, store, KvStore, RowTarget};
use crate::convert::Half16;
use crate::thread::{block_idx_x, thread_idx_x};

/// The append body for element type `E`, storing the rows through `rows` (a 16-bit cache's
/// elements, or codes).
///
/// # Safety
/// Launched with the grid above and `KV_WRITE_THREADS` threads; `k`, `v` hold `batch` rows of
/// `[kv_heads][head_dim]`; `seq_slot`, `seq_len` hold `batch` distinct live slots and lengths
/// `>= 1` whose block-table rows map the page of position `len - 1`; the buffers hold the
/// layouts in `p` and `head_dim % 8 == 0`; `index` holds `[slots][dense_heads]` lengths and
/// entries of `p.selection.entry_capacity` pages, each held selection shorter than that capacity;
/// `seq_len`, `seq_slot`, the head map and the block tables are written by host copies enqueued
/// before the previous kernel (not by a kernel): they are read before `overlapped_entry`.
#[inline(always)]
pub unsafe fn append_kv<E: Half16, S: KvStore>(a: &AppendArgs, rows: S) {
    let (p, bufs) = (&a.params, &a.cache);
    let (k, v) = (a.k.get(), a.v.get());
    let (seq_slot, seq_len) = (a.batch.seq_slot.get(), a.batch.seq_len.get());
    let c = &p.cache;
    let per_token = c.chunks_per_token();
    let i = block_idx_x() * KV_WRITE_THREADS + thread_idx_x();
    if i >= p.batch * per_token {
        // Threads past the batch exit without waiting; every block keeps an in-range thread
        // (the grid is `ceil(chunks / KV_WRITE_THREADS)`), which waits below, so this kernel
        // cannot complete before the one it overlaps.
        return;
    }
    let (b, in_token) = (i / per_token, i % per_token);
    let chunks_per_head = c.paged.head_dim / CHUNK_ELEMS;
    let (kv_head, chunk) = (in_token / chunks_per_head, in_token % chunks_per_head);
    // SAFETY: `b < batch`.
    let (slot, len) = unsafe { (*seq_slot.add(b as usize), *seq_len.add(b as usize)) };
    let pos = len - 1;
    // SAFETY: `kv_head < kv_heads`, `pos < len`, the block table maps `pos`'s page.
    let target = unsafe { RowTarget::of(c, bufs, kv_head, slot, pos, len) };
    // Overlapped with the kernel before: the batch description, head map and block tables read
    // so far are copies from the host, complete before that kernel started; `k`, `v`, the cache
    // and the selection state may be its outputs.
    // SAFETY: before this thread's first access of anything a kernel before it reads or writes
    // (everything above is host copies).
    unsafe { crate::sync::overlapped_entry() };
    // SAFETY: `k` and `v` hold `batch` rows of `kv_heads x head_dim` elements, `strides.kv`
    // heads apart: chunk `in_token` of row `b` is inside them.
    let at = (b * p.strides.kv * c.paged.head_dim + in_token * CHUNK_ELEMS) as usize;
    let (key, value) = unsafe { (load(k.add(at)), load(v.add(at))) };
    // SAFETY: `target` is this sequence's, `chunk < D / 8`; a row's `D / 8` lanes are here
    // together (the grid is whole rows, and they share the target).
    unsafe { rows.write(c, bufs, target, slot, chunk, key, value) };

    if let RowTarget::Dense { page, head, token } = target {
        if chunk == 0 && len > p.dynamic_min_len {
            // The token's selection unit (its page, or its logical page).
            let upp = p.selection.units_per_page;
            let unit = unit_id(
                page,
                pos / p.selection.unit_tokens(c.paged.page_tokens),
                upp,
            );
            // SAFETY: the pair's entry exists (`slot` live, `head < dense_heads`).
            unsafe { keep_index_entry(p, &a.selection, slot * c.paged.heads + head, unit) };
        }
        let n_l = c.paged.logical_tokens;
        let offset = chunk_at(c.paged.stats_row(page, head, token / n_l), chunk);
        // SAFETY: the statistics row of the token's logical page, inside `kmin`/`kmax`; no other
        // thread touches these 8 channels (sequences of a batch are distinct).
        unsafe {
            let (lo, hi) = (bufs.kmin.get().add(offset), bufs.kmax.get().add(offset));
            let bounds = if pos % n_l == 0 {
                Bounds::of(key)
            } else {
                let mut bounds = Bounds {
                    lo: load(lo),
                    hi: load(hi),
                };
                bounds.include::<E>(key);
                bounds
            };
            store(lo, bounds.lo);
            store(hi, bounds.hi);
            // A dense head's `D / 8` lanes are all here (they share the target).
            store_stat_codes::<E>(&bufs.stat_codes, offset, bounds);
        }
    }
}

/// Makes index entry `entry` the held selection followed by `page` (the id of the newest unit, the
/// token's), unless the held selection ends with it. Nothing while the pair holds no selection
/// (its first selection writes the entry). Idempotent: a replayed step writes the same.
///
/// # Safety
/// `entry` is a `[slots][dense_heads]` index of `index`'s buffers whose first `held` pages are
/// written. (A held length at or past `p.selection.entry_capacity` is not trusted: nothing is
/// written.)
#[inline(always)]
unsafe fn keep_index_entry(p: &AppendParams, index: &SelectionPtrs, entry: u32, page: u32) {
    // SAFETY: forwarded; `0 < held < entry_capacity` (checked), so positions `held - 1` and
    // `held` are inside the entry.
    unsafe {
        let held = *index.held_lens.get().add(entry as usize);
        // `1 <= held < entry_capacity` in one compare: a held length past the entry (memory
        // corruption) keeps nothing rather than write past the pair's own entry.
        if held.wrapping_sub(1) < p.selection.entry_capacity - 1 {
            let pages = index
                .index_pages
                .get()
                .add((entry * p.selection.entry_capacity) as usize);
            let listed = if *pages.add(held as usize - 1) == page {
                held
            } else {
                *pages.add(held as usize) = page;
                held + 1
            };
            *index.index_lens.get().add(entry as usize) = listed;
        }
    }
}
