//! Key-statistics pooling: `kmin`/`kmax` of every logical page a token range touches, recomputed
//! from the keys in the pool.
//!
//! Grid `(ceil(max_logical_pages / pages_per_block), dense_heads, sequences)`, where a block pools
//! `pool_pages_per_block(D)` logical pages of one (range, dense head) and each logical page takes
//! `D / 8` threads (one chunk of 8 channels each). A logical page's bounds run over its tokens
//! that exist (below the sequence's length), so a partial last page is handled. Where the cache
//! keeps 8-bit statistics, they are coded from the new bounds ([`stat_codes`](super::stat_codes)).

use lserve_abi::kv_write::{
    logical_pages_of, pool_pages_per_block, PoolArgs, SeqRange, CHUNK_ELEMS,
};

use super::stat_codes::store_stat_codes;
use super::stats::Bounds;
use super::target::{chunk_at, load, store};
use crate::convert::Half16;
use crate::pool_page::in_pool;
use crate::thread::{block_idx_x, block_idx_y, block_idx_z, thread_idx_x};

/// The pooling body for element type `E`.
///
/// # Safety
/// Launched with the grid above and `KV_WRITE_THREADS` threads; `ranges` holds `p.sequences`
/// entries with `start <= end <= len` whose block-table rows map every page below `len`; the
/// buffers hold the layouts in `p`, `head_dim % 8 == 0`.
#[inline(always)]
pub unsafe fn pool_key_stats<E: Half16>(a: &PoolArgs) {
    let (p, ranges) = (&a.params, a.ranges.get());
    let (k_pool, kmin, kmax) = (a.cache.k_pool.get(), a.cache.kmin.get(), a.cache.kmax.get());
    let block_tables = a.cache.block_tables.get();
    let c = &p.cache;
    let layout = &c.paged;
    let chunks_per_head = layout.head_dim / CHUNK_ELEMS;
    let (page_in_block, chunk) = (
        thread_idx_x() / chunks_per_head,
        thread_idx_x() % chunks_per_head,
    );
    let pages_per_block = pool_pages_per_block(layout.head_dim);
    if page_in_block >= pages_per_block {
        return;
    }
    // SAFETY: `block_idx_z() < sequences`.
    let r: SeqRange = unsafe { *ranges.add(block_idx_z() as usize) };
    let (first, end) = logical_pages_of(r.start, r.end, layout.logical_tokens);
    let logical = first + block_idx_x() * pages_per_block + page_in_block;
    if logical >= end {
        return;
    }
    let head = block_idx_y();
    let n_l = layout.logical_tokens;
    let token0 = logical * n_l;
    let tokens = if token0 + n_l < r.len {
        n_l
    } else {
        r.len - token0
    };
    let n_p = layout.page_tokens;
    // SAFETY: `token0 < end <= len`, so the block table maps its page.
    let page = unsafe {
        *block_tables.add(r.slot as usize * c.max_pages as usize + (token0 / n_p) as usize)
    };
    if !in_pool(layout, page) {
        // A block table entry past the pool: nothing is read or written (`pool_page`).
        return;
    }
    let row0 = chunk_at(layout.kv_row(page, head, token0 % n_p), chunk);
    let stride = layout.head_dim as usize;
    // SAFETY: rows `token0 % n_p ..` + `tokens` lie in the same physical page (a logical page
    // never straddles two), inside the pool.
    let mut bounds = Bounds::of(unsafe { load(k_pool.add(row0)) });
    let mut t = 1;
    while t < tokens {
        // SAFETY: as above.
        bounds.include::<E>(unsafe { load(k_pool.add(row0 + t as usize * stride)) });
        t += 1;
    }
    let out = chunk_at(layout.stats_row(page, head, (token0 % n_p) / n_l), chunk);
    // SAFETY: the statistics row of this logical page; one thread per (page, head, chunk).
    unsafe {
        store(kmin.add(out), bounds.lo);
        store(kmax.add(out), bounds.hi);
        // The row group is whole here (the exits above are per logical page).
        store_stat_codes::<E>(&a.cache.stat_codes, out, bounds);
    }
}
