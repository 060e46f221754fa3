//! The decode append: one new token per sequence, every KV head.
//!
//! Grid `ceil(batch * Hkv * D / 8 / KV_WRITE_THREADS)`; thread `i` owns chunk `i` of the
//! activations `k`, `v` `[batch][Hkv][D]`, i.e. 8 channels of one (sequence, KV head). The token
//! is position `len - 1` of its sequence. A dense head writes it into its page and folds it into
//! the statistics of its logical page: the key itself if the token starts the logical page, else
//! the running per-channel min/max ([`Bounds::include`]). A streaming head writes its sink or
//! ring row (the newest token is always held).

use lserve_abi::kv_write::{AppendParams, CHUNK_ELEMS, KV_WRITE_THREADS};

use super::stats::Bounds;
use super::target::{chunk_at, load, store, write_chunk, CacheBuffers, RowTarget};
use crate::convert::Half16;
use crate::thread::{block_idx_x, thread_idx_x};

/// The append body for element type `E`.
///
/// # Safety
/// Launched with the grid above and `KV_WRITE_THREADS` threads; `k`, `v` hold `batch` rows of
/// `[kv_heads][head_dim]`; `seq_slot`, `seq_len` hold `batch` distinct live slots and lengths
/// `>= 1` whose block-table rows map the page of position `len - 1`; the buffers hold the
/// layouts in `p` and `head_dim % 8 == 0`.
#[inline(always)]
pub unsafe fn append_kv<E: Half16>(
    p: &AppendParams,
    k: *const u16,
    v: *const u16,
    bufs: &CacheBuffers,
    seq_slot: *const u32,
    seq_len: *const u32,
) {
    let c = &p.cache;
    let per_token = c.chunks_per_token();
    let i = block_idx_x() * KV_WRITE_THREADS + thread_idx_x();
    if i >= p.batch * per_token {
        return;
    }
    let (b, in_token) = (i / per_token, i % per_token);
    let chunks_per_head = c.paged.head_dim / CHUNK_ELEMS;
    let (kv_head, chunk) = (in_token / chunks_per_head, in_token % chunks_per_head);
    // SAFETY: `b < batch`; activation chunk `i` is inside `[batch][kv_heads][head_dim]`.
    let (slot, len, key, value) = unsafe {
        (
            *seq_slot.add(b as usize),
            *seq_len.add(b as usize),
            load(k.add((i * CHUNK_ELEMS) as usize)),
            load(v.add((i * CHUNK_ELEMS) as usize)),
        )
    };
    let pos = len - 1;
    // SAFETY: `kv_head < kv_heads`, `pos < len`, the block table maps `pos`'s page.
    let target = unsafe { RowTarget::of(c, bufs, kv_head, slot, pos, len) };
    // SAFETY: `target` is this sequence's, `chunk < D / 8`.
    unsafe { write_chunk(c, bufs, target, slot, chunk, key, value) };

    if let RowTarget::Dense { page, head, token } = target {
        let n_l = c.paged.logical_tokens;
        let offset = chunk_at(c.paged.stats_row(page, head, token / n_l), chunk);
        // SAFETY: the statistics row of the token's logical page, inside `kmin`/`kmax`; no other
        // thread touches these 8 channels (sequences of a batch are distinct).
        unsafe {
            let (lo, hi) = (bufs.kmin.add(offset), bufs.kmax.add(offset));
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
        }
    }
}
