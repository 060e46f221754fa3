//! Writing an integer-coded cache: K and V rows quantized to INT8 or INT4 per token and head as
//! they are written ([`Codes`], the store of the coded append and row write), and the statistics of the
//! logical pages a prefill writes, pooled from its activation rows ([`pool_key_stats_rows`]): a
//! coded cache keeps no 16-bit keys, and the statistics bound the unquantized keys.

use core::arch::asm;
use core::marker::PhantomData;

use lserve_abi::buffers::{CachePtrs, CodedKvPtrs};
use lserve_abi::kv_write::{logical_pages_of, pool_pages_per_block, PoolRowsArgs, CHUNK_ELEMS};
use lserve_abi::layout::CacheLayout;

use super::quantize::{quantize_chunk, CodedChunk};
use super::stat_codes::store_stat_codes;
use super::stats::Bounds;
use super::target::{chunk_at, load, store, KvLoad, KvStore, RowTarget};
use crate::convert::{word_params, Half16};
use crate::math::{fma, Vec16};
use crate::pool_page::in_pool;
use crate::thread::{block_idx_x, block_idx_y, block_idx_z, thread_idx_x};
use lserve_abi::decode::{CODED_HEAD_DIM, HEAD_STREAMING};

/// The store of a coded cache of `BITS`-bit codes (8 or 4): each row quantized across its lanes
/// ([`quantize_chunk`]), 8 (or 4) code bytes per chunk, the row word written by the lane of
/// chunk 0. Coded caches have rows of [`CODED_HEAD_DIM`] channels (the host makes no other), so
/// the row's lanes and its word index are compile-time shifts.
#[derive(Clone, Copy)]
pub struct Codes<E, const BITS: u32> {
    ptrs: CodedKvPtrs,
    elem: PhantomData<E>,
}

impl<E, const BITS: u32> Codes<E, BITS> {
    /// The store writing into `ptrs`.
    #[inline(always)]
    pub fn new(ptrs: CodedKvPtrs) -> Self {
        Self {
            ptrs,
            elem: PhantomData,
        }
    }
}

/// Stores 8 code bytes at `p` with one 8-byte access.
///
/// # Safety
/// `p` is 8-byte aligned and 8 writable bytes.
#[inline(always)]
unsafe fn store_codes(p: *mut u8, codes: [u32; 2]) {
    // SAFETY: forwarded; a generic-address vector store of 8 aligned bytes.
    unsafe {
        asm!("st.v2.u32 [{0}], {{{1}, {2}}};", in(reg64) p, in(reg32) codes[0],
             in(reg32) codes[1], options(nostack));
    }
}

/// Stores 4 code bytes at `p` with one 4-byte access.
///
/// # Safety
/// `p` is 4-byte aligned and 4 writable bytes.
#[inline(always)]
unsafe fn store_code_word(p: *mut u8, codes: u32) {
    // SAFETY: forwarded; a generic-address store of 4 aligned bytes.
    unsafe { asm!("st.u32 [{0}], {1};", in(reg64) p, in(reg32) codes, options(nostack)) };
}

/// Where a coded cache keeps one row of K and of V: the code buffers, the word buffers and the
/// row's element offset (its codes start at byte `row * BITS / 8`, its word is word `row / D`).
struct CodedRow {
    codes: (*mut u8, *mut u8),
    words: (*mut u32, *mut u32),
    row: usize,
}

impl<E, const BITS: u32> Codes<E, BITS> {
    /// The row `target` names; `None` for [`RowTarget::Nowhere`].
    #[inline(always)]
    fn row(&self, c: &CacheLayout, target: RowTarget, slot: u32) -> Option<CodedRow> {
        let p = &self.ptrs;
        match target {
            RowTarget::Dense { page, head, token } => Some(CodedRow {
                codes: (p.k_pool.get(), p.v_pool.get()),
                words: (p.k_pool_words.get(), p.v_pool_words.get()),
                row: c.paged.kv_row(page, head, token),
            }),
            RowTarget::Streaming { head, row } => Some(CodedRow {
                codes: (p.k_stream.get(), p.v_stream.get()),
                words: (p.k_stream_words.get(), p.v_stream_words.get()),
                row: c.streaming.kv_row(slot, head, row),
            }),
            RowTarget::Nowhere => None,
        }
    }
}

impl<E: Half16, const BITS: u32> KvStore for Codes<E, BITS> {
    #[inline(always)]
    unsafe fn write(
        &self,
        c: &CacheLayout,
        _bufs: &CachePtrs,
        target: RowTarget,
        slot: u32,
        chunk: u32,
        k: Vec16,
        v: Vec16,
    ) {
        // The row's lanes share the target: they leave together.
        let Some(CodedRow { codes, words, row }) = self.row(c, target, slot) else {
            return;
        };
        let lanes = CODED_HEAD_DIM / CHUNK_ELEMS;
        // SAFETY: the row's lanes are here together (caller), `lanes` is `D / 8`.
        let (k, v): (CodedChunk, CodedChunk) = unsafe {
            (
                quantize_chunk::<E, BITS>(k, lanes),
                quantize_chunk::<E, BITS>(v, lanes),
            )
        };
        let at = chunk_at(row, chunk);
        // SAFETY: code rows are `D` codes where a 16-bit row has its `D` elements (`D` is
        // `CODED_HEAD_DIM`), at `BITS / 8` bytes an element, inside their buffer by the layout;
        // `D % 8 == 0`, so a chunk's 8 (INT4: 4) bytes are 8- (4-) byte aligned; the row's word
        // is word `row / D` of its word buffer.
        unsafe {
            if BITS == 4 {
                store_code_word(codes.0.add(at / 2), k.codes[0]);
                store_code_word(codes.1.add(at / 2), v.codes[0]);
            } else {
                store_codes(codes.0.add(at), k.codes);
                store_codes(codes.1.add(at), v.codes);
            }
            if chunk == 0 {
                let w = row / CODED_HEAD_DIM as usize;
                *words.0.add(w) = k.word;
                *words.1.add(w) = v.word;
            }
        }
    }
}

impl<E: Half16, const BITS: u32> KvLoad for Codes<E, BITS> {
    /// The chunk dequantized as the reference does (`fma(c, s, m)` in f32) and rounded to `E`.
    #[inline(always)]
    unsafe fn read(
        &self,
        c: &CacheLayout,
        _bufs: &CachePtrs,
        target: RowTarget,
        slot: u32,
        chunk: u32,
    ) -> (Vec16, Vec16) {
        let Some(CodedRow { codes, words, row }) = self.row(c, target, slot) else {
            return (Vec16([0; 4]), Vec16([0; 4]));
        };
        let (at, w) = (chunk_at(row, chunk), row / CODED_HEAD_DIM as usize);
        // SAFETY: as `write`'s stores: the chunk's codes and the row's word, aligned.
        unsafe {
            (
                dequantize_chunk::<E, BITS>(codes.0.add(at * BITS as usize / 8), *words.0.add(w)),
                dequantize_chunk::<E, BITS>(codes.1.add(at * BITS as usize / 8), *words.1.add(w)),
            )
        }
    }
}

/// The 8 values of the chunk whose `BITS`-bit codes start at `codes` (INT4: channel `2i` in the
/// low nibble of byte `i`), in the row whose `(s, m)` word is `word`: `fma(c, s, m)`, rounded to
/// `E`.
///
/// # Safety
/// `codes` is `BITS` readable bytes, `BITS`-byte aligned.
#[inline(always)]
unsafe fn dequantize_chunk<E: Half16, const BITS: u32>(codes: *const u8, word: u32) -> Vec16 {
    let bytes: u64 = if BITS == 4 {
        // SAFETY: forwarded (4 bytes, 4-byte aligned).
        let w = unsafe { *(codes as *const u32) } as u64;
        // Nibble `j` of the word to byte `j`.
        let mut out = 0u64;
        let mut j = 0;
        while j < 8 {
            out |= ((w >> (4 * j)) & 0xF) << (8 * j);
            j += 1;
        }
        out
    } else {
        // SAFETY: forwarded (8 bytes, 8-byte aligned).
        unsafe { *(codes as *const u64) }
    };
    let (s, m) = word_params(word);
    let mut x = [0.0f32; 8];
    let mut j = 0;
    while j < 8 {
        x[j] = fma(((bytes >> (8 * j)) & 0xFF) as f32, s, m);
        j += 1;
    }
    Vec16::from_f32::<E>(&x)
}

/// The body of `pool_key_stats_rows_*` for element type `E` (`lserve_abi::kv_write::PoolRowsArgs`
/// says what it computes): block `(x, h, s)` takes `pool_pages_per_block(D)` logical pages of
/// range `s` for KV head `h`, `D / 8` threads per logical page.
///
/// # Safety
/// Launched with that grid and `KV_WRITE_THREADS` threads; `ranges` holds `sequences` entries
/// with `start <= end <= len` whose block-table rows map every page below `len`; `k` holds each
/// range's `end - start` rows from `first_row`, `kv_stride` heads apart; the buffers hold the
/// layouts in the parameters, `head_dim % 8 == 0`; the statistics of a logical page that begins
/// before a range's `start` hold those of its earlier tokens.
#[inline(always)]
pub unsafe fn pool_key_stats_rows<E: Half16>(a: &PoolRowsArgs) {
    let (p, ranges) = (&a.pool.params, a.pool.ranges.get());
    let (kmin, kmax) = (a.pool.cache.kmin.get(), a.pool.cache.kmax.get());
    let c = &p.cache;
    let layout = &c.paged;
    let d = layout.head_dim;
    let chunks_per_head = d / CHUNK_ELEMS;
    let (page_in_block, chunk) = (
        thread_idx_x() / chunks_per_head,
        thread_idx_x() % chunks_per_head,
    );
    if page_in_block >= pool_pages_per_block(d) {
        return;
    }
    let kv_head = block_idx_y();
    // SAFETY: `kv_head < kv_heads` (grid), `block_idx_z() < sequences`.
    let (entry, r) = unsafe {
        (
            *a.pool.cache.head_map.get().add(kv_head as usize),
            *ranges.add(block_idx_z() as usize),
        )
    };
    if entry & HEAD_STREAMING != 0 {
        return;
    }
    let head = entry;
    let n_l = layout.logical_tokens;
    let (first, end) = logical_pages_of(r.start, r.end, n_l);
    let logical = first + block_idx_x() * pool_pages_per_block(d) + page_in_block;
    if logical >= end {
        return;
    }
    let token0 = logical * n_l;
    let n_p = layout.page_tokens;
    // SAFETY: `token0 < end <= len`, so the block table maps its page.
    let page = unsafe {
        *a.pool
            .cache
            .block_tables
            .get()
            .add(r.slot as usize * c.max_pages as usize + (token0 / n_p) as usize)
    };
    if !in_pool(layout, page) {
        // A block table entry past the pool: nothing is read or written (`pool_page`).
        return;
    }
    let out = chunk_at(layout.stats_row(page, head, (token0 % n_p) / n_l), chunk);
    let from = if token0 > r.start { token0 } else { r.start };
    let to = if token0 + n_l < r.end {
        token0 + n_l
    } else {
        r.end
    };
    let row_stride = (a.kv_stride * d) as usize;
    let key_at = |pos: u32| {
        (r.first_row + pos - r.start) as usize * row_stride
            + chunk_at((kv_head * d) as usize, chunk)
    };
    let k = a.k.get();
    // SAFETY: `from < to <= end`: activation rows of the range (caller); the statistics row of
    // this logical page, inside `kmin`/`kmax`; one thread per (page, head, chunk).
    unsafe {
        let mut bounds = if token0 < r.start {
            Bounds {
                lo: load(kmin.add(out)),
                hi: load(kmax.add(out)),
            }
        } else {
            Bounds::of(load(k.add(key_at(from))))
        };
        let mut pos = if token0 < r.start { from } else { from + 1 };
        while pos < to {
            bounds.include::<E>(load(k.add(key_at(pos))));
            pos += 1;
        }
        store(kmin.add(out), bounds.lo);
        store(kmax.add(out), bounds.hi);
        // The row group is whole here (the exits above are per logical page).
        store_stat_codes::<E>(&a.pool.cache.stat_codes, out, bounds);
    }
}
