//! Prefill's cache write: every token of a ragged batch, every KV head.
//!
//! Grid `(ceil(max_tokens * Hkv * D / 8 / KV_WRITE_THREADS), sequences)`: block `(x, s)` takes
//! chunks `x * KV_WRITE_THREADS ..` of range `s`'s tokens (`[tokens][Hkv][D / 8]`, row-major, so
//! a block reads contiguous activations). A dense head writes every token into its page; a
//! streaming head only the tokens it holds at the sequence's length (sinks and the last
//! `local_tokens`), so the ring's rows are written once each and the order of writes does not
//! matter. Key statistics are not touched: `pool_key_stats` runs after.

use lserve_abi::kv_write::{WriteRowsArgs, CHUNK_ELEMS, KV_WRITE_THREADS};

use super::target::{load, KvStore, RowTarget};
use crate::thread::{block_idx_x, block_idx_y, thread_idx_x};

/// The row-write body, storing the rows through `rows` (a 16-bit cache's elements, moved as bits,
/// or codes).
///
/// # Safety
/// Launched with the grid above and `KV_WRITE_THREADS` threads; `ranges` holds `p.sequences`
/// entries with `start <= end <= len`, distinct slots whose block-table rows map every page
/// below `len`; `k`, `v` hold the rows `first_row .. first_row + end - start` of every range as
/// `[kv_heads][head_dim]`; the buffers hold the layouts in `p`, `head_dim % 8 == 0`.
#[inline(always)]
pub unsafe fn write_kv_rows<S: KvStore>(a: &WriteRowsArgs, rows: S) {
    let (p, bufs, ranges) = (&a.params, &a.cache, a.ranges.get());
    let (k, v) = (a.k.get(), a.v.get());
    let c = &p.cache;
    // SAFETY: `block_idx_y() < sequences`.
    let r = unsafe { *ranges.add(block_idx_y() as usize) };
    let per_token = c.chunks_per_token();
    let i = block_idx_x() * KV_WRITE_THREADS + thread_idx_x();
    if i >= (r.end - r.start) * per_token {
        return;
    }
    let (t, in_token) = (i / per_token, i % per_token);
    let chunks_per_head = c.paged.head_dim / CHUNK_ELEMS;
    let (kv_head, chunk) = (in_token / chunks_per_head, in_token % chunks_per_head);
    let pos = r.start + t;
    let src = (r.first_row + t) as usize * (p.strides.kv * c.paged.head_dim) as usize
        + (in_token * CHUNK_ELEMS) as usize;
    // SAFETY: `kv_head < kv_heads`, `pos < end <= len`, the block table maps `pos`'s page.
    let target = unsafe { RowTarget::of(c, bufs, kv_head, r.slot, pos, r.len) };
    if let RowTarget::Nowhere = target {
        return;
    }
    // SAFETY: activation row `first_row + t` exists; `target` is this sequence's; distinct
    // (sequence, position, head) triples have distinct destination rows; a row's `D / 8` lanes
    // are here together (blocks are whole rows, and they share the target).
    unsafe {
        let (key, value) = (load(k.add(src)), load(v.add(src)));
        rows.write(c, bufs, target, r.slot, chunk, key, value);
    }
}
