//! Chunked prefill's staging copy: a sequence's cached positions (from the cache) and its new
//! chunk (from the activations) as one run of contiguous K/V rows, which the prefill attention
//! then reads as a whole prompt's.
//!
//! Grid `(ceil(max_end * Hkv * D / 8 / KV_WRITE_THREADS), sequences)`: block `(x, s)` takes
//! chunks `x * KV_WRITE_THREADS ..` of range `s`'s positions `0..end` (`[pos][Hkv][D / 8]`,
//! row-major, so a block writes contiguous rows). Every output row of the range is written: a
//! streaming head's position the cache no longer holds (and a dense head's page past the pool)
//! becomes zeros, so no row the attention may load is left from an earlier launch.

use lserve_abi::kv_write::{GatherArgs, CHUNK_ELEMS, KV_WRITE_THREADS};

use super::target::{load, store, KvLoad, RowTarget};
use crate::thread::{block_idx_x, block_idx_y, thread_idx_x};

/// The gather body: cached rows read through `rows` (16-bit rows as they are, or codes
/// dequantized to the element type), the chunk's rows copied.
///
/// # Safety
/// Launched with the grid above and `KV_WRITE_THREADS` threads; `ranges` holds `p.sequences`
/// entries with `prefix <= end`, live slots whose block-table rows map every page below
/// `prefix` (and whose streaming rows hold the sequence at length `prefix`); `k`, `v` hold the
/// rows `first_row .. first_row + end - prefix` of every range as `[kv_heads][head_dim]`;
/// `k_out`, `v_out` hold rows `out_row .. out_row + end` of every range, packed, the ranges'
/// rows disjoint; the cache buffers hold the layouts in `p`, `head_dim % 8 == 0`.
#[inline(always)]
pub unsafe fn gather_kv_rows<L: KvLoad>(a: &GatherArgs, rows: L) {
    let (p, bufs, ranges) = (&a.params, &a.cache, a.ranges.get());
    let c = &p.cache;
    // SAFETY: `block_idx_y() < sequences`.
    let r = unsafe { *ranges.add(block_idx_y() as usize) };
    let per_token = c.chunks_per_token();
    let i = block_idx_x() * KV_WRITE_THREADS + thread_idx_x();
    if i >= r.end * per_token {
        return;
    }
    let (pos, in_token) = (i / per_token, i % per_token);
    let chunks_per_head = c.paged.head_dim / CHUNK_ELEMS;
    let (kv_head, chunk) = (in_token / chunks_per_head, in_token % chunks_per_head);
    let (key, value) = if pos >= r.prefix {
        let src = (r.first_row + pos - r.prefix) as usize
            * (p.strides.kv * c.paged.head_dim) as usize
            + (in_token * CHUNK_ELEMS) as usize;
        // SAFETY: activation row `first_row + pos - prefix` exists, 16-byte aligned chunks.
        unsafe { (load(a.k.get().add(src)), load(a.v.get().add(src))) }
    } else {
        // SAFETY: `kv_head < kv_heads`, `pos < prefix`: the block table maps `pos`'s page.
        let target = unsafe { RowTarget::of(c, bufs, kv_head, r.slot, pos, r.prefix) };
        // SAFETY: `target` is this sequence's.
        unsafe { rows.read(c, bufs, target, r.slot, chunk) }
    };
    let dst = (r.out_row + pos) as usize * (c.kv_heads * c.paged.head_dim) as usize
        + (in_token * CHUNK_ELEMS) as usize;
    // SAFETY: output row `out_row + pos` is the range's (launch contract).
    unsafe {
        store(a.k_out.get().add(dst), key);
        store(a.v_out.get().add(dst), value);
    }
}
