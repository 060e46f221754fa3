//! Where a KV head keeps a token: the one place the write kernels look at the head pattern.

use core::arch::asm;

use lserve_abi::buffers::CachePtrs;
use lserve_abi::decode::HEAD_STREAMING;
use lserve_abi::kv_write::CHUNK_ELEMS;
use lserve_abi::layout::CacheLayout;

use crate::math::Vec16;
use crate::pool_page::in_pool;

/// Where one KV head keeps one token.
#[derive(Clone, Copy)]
pub enum RowTarget {
    /// A dense head: row `token` of physical page `page`, compact dense index `head`.
    Dense {
        /// Physical page id.
        page: u32,
        /// Index among the layer's dense heads.
        head: u32,
        /// Row within the page (`pos % N_P`).
        token: u32,
    },
    /// A streaming head holding the position: `row` of the sequence's slot.
    Streaming {
        /// Index among the layer's streaming heads.
        head: u32,
        /// Sink or ring row (`StreamingLayout::row_of_token`).
        row: u32,
    },
    /// A streaming head that does not hold the position at the sequence's length, or a dense
    /// head whose block table entry is not a page of the pool (`crate::pool_page`).
    Nowhere,
}

impl RowTarget {
    /// Where KV head `kv_head` keeps position `pos` of the sequence in `slot` of length `len`.
    ///
    /// # Safety
    /// `kv_head < c.kv_heads`, `slot` is a row of the block tables and `pos / N_P` is below its
    /// width (a dense head reads that entry; an entry past the pool gives `Nowhere`).
    #[inline(always)]
    pub unsafe fn of(
        c: &CacheLayout,
        bufs: &CachePtrs,
        kv_head: u32,
        slot: u32,
        pos: u32,
        len: u32,
    ) -> Self {
        // SAFETY: `kv_head < kv_heads`.
        let entry = unsafe { *bufs.head_map.get().add(kv_head as usize) };
        let head = entry & !HEAD_STREAMING;
        if entry & HEAD_STREAMING != 0 {
            return if c.streaming_resident(pos, len) {
                RowTarget::Streaming {
                    head,
                    row: c.streaming.row_of_token(pos),
                }
            } else {
                RowTarget::Nowhere
            };
        }
        let n_p = c.paged.page_tokens;
        // SAFETY: the caller guarantees the block table row reaches page `pos / N_P`.
        let page = unsafe {
            *bufs
                .block_tables
                .get()
                .add(slot as usize * c.max_pages as usize + (pos / n_p) as usize)
        };
        if !in_pool(&c.paged, page) {
            // A block table entry past the pool: nothing is written (`pool_page`'s invariant).
            return RowTarget::Nowhere;
        }
        RowTarget::Dense {
            page,
            head,
            token: pos % n_p,
        }
    }
}

/// Element offset of chunk `chunk` of a row that starts at `row_offset`.
#[inline(always)]
pub fn chunk_at(row_offset: usize, chunk: u32) -> usize {
    row_offset + (chunk * CHUNK_ELEMS) as usize
}

/// Loads the 8 elements at `p` with one 16-byte access.
///
/// (Inline PTX: a plain copy of a 16-byte aggregate is lowered as two 8-byte accesses through a
/// local-memory temporary.)
///
/// # Safety
/// `p` is 16-byte aligned and 16 readable bytes.
#[inline(always)]
pub unsafe fn load(p: *const u16) -> Vec16 {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: forwarded; a generic-address vector load of 16 aligned bytes.
    unsafe {
        asm!("ld.v4.u32 {{{0}, {1}, {2}, {3}}}, [{4}];",
             out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg64) p,
             options(readonly, nostack));
    }
    Vec16([a, b, c, d])
}

/// Stores 8 elements at `p` with one 16-byte access.
///
/// # Safety
/// `p` is 16-byte aligned and 16 writable bytes.
#[inline(always)]
pub unsafe fn store(p: *mut u16, x: Vec16) {
    // SAFETY: forwarded; a generic-address vector store of 16 aligned bytes.
    unsafe {
        asm!("st.v4.u32 [{0}], {{{1}, {2}, {3}, {4}}};",
             in(reg64) p, in(reg32) x.0[0], in(reg32) x.0[1], in(reg32) x.0[2], in(reg32) x.0[3],
             options(nostack));
    }
}

/// Writes one chunk of a token's K and V rows (`k`, `v`) where `target` says, leaving the
/// statistics alone.
///
/// # Safety
/// `target` came from [`RowTarget::of`] for the sequence in `slot`; `chunk < D / 8`; the buffers
/// hold the layouts `c` describes.
#[inline(always)]
pub unsafe fn write_chunk(
    c: &CacheLayout,
    bufs: &CachePtrs,
    target: RowTarget,
    slot: u32,
    chunk: u32,
    k: Vec16,
    v: Vec16,
) {
    let (k_dst, v_dst, offset) = match target {
        RowTarget::Dense { page, head, token } => (
            bufs.k_pool.get(),
            bufs.v_pool.get(),
            chunk_at(c.paged.kv_row(page, head, token), chunk),
        ),
        RowTarget::Streaming { head, row } => (
            bufs.k_stream.get(),
            bufs.v_stream.get(),
            chunk_at(c.streaming.kv_row(slot, head, row), chunk),
        ),
        RowTarget::Nowhere => return,
    };
    // SAFETY: the row lies inside its buffer by the layout; rows are `D` elements, `D % 8 == 0`,
    // so every chunk is 16-byte aligned.
    unsafe {
        store(k_dst.add(offset), k);
        store(v_dst.add(offset), v);
    }
}

/// How a write kernel stores a token's chunks of K and V: as the 16-bit elements they are
/// ([`Elements`]) or as integer codes (`super::coded::Codes`).
pub trait KvStore {
    /// Stores chunk `chunk` of a token's K and V rows (`k`, `v`) where `target` says, leaving the
    /// statistics alone.
    ///
    /// # Safety
    /// As [`write_chunk`]; and the `D / 8` lanes holding the row's chunks (an aligned group) call
    /// it together with the same `target` (a coded store quantizes across them).
    unsafe fn write(
        &self,
        c: &CacheLayout,
        bufs: &CachePtrs,
        target: RowTarget,
        slot: u32,
        chunk: u32,
        k: Vec16,
        v: Vec16,
    );
}

/// A 16-bit cache: the chunks are stored as they are ([`write_chunk`]).
#[derive(Clone, Copy)]
pub struct Elements;

impl KvStore for Elements {
    #[inline(always)]
    unsafe fn write(
        &self,
        c: &CacheLayout,
        bufs: &CachePtrs,
        target: RowTarget,
        slot: u32,
        chunk: u32,
        k: Vec16,
        v: Vec16,
    ) {
        // SAFETY: forwarded.
        unsafe { write_chunk(c, bufs, target, slot, chunk, k, v) }
    }
}

/// How a kernel reads a token's chunks of K and V back as 16-bit elements: as stored
/// ([`Elements`], [`read_chunk`]) or dequantized from integer codes (`super::coded::Codes`).
pub trait KvLoad {
    /// Chunk `chunk` of the token's K and V rows at `target`; zeros for [`RowTarget::Nowhere`].
    ///
    /// # Safety
    /// As [`read_chunk`].
    unsafe fn read(
        &self,
        c: &CacheLayout,
        bufs: &CachePtrs,
        target: RowTarget,
        slot: u32,
        chunk: u32,
    ) -> (Vec16, Vec16);
}

impl KvLoad for Elements {
    #[inline(always)]
    unsafe fn read(
        &self,
        c: &CacheLayout,
        bufs: &CachePtrs,
        target: RowTarget,
        slot: u32,
        chunk: u32,
    ) -> (Vec16, Vec16) {
        // SAFETY: forwarded.
        unsafe { read_chunk(c, bufs, target, slot, chunk) }
    }
}

/// Reads one chunk of a token's K and V rows from where `target` says; zeros for
/// [`RowTarget::Nowhere`].
///
/// # Safety
/// As [`write_chunk`].
#[inline(always)]
pub unsafe fn read_chunk(
    c: &CacheLayout,
    bufs: &CachePtrs,
    target: RowTarget,
    slot: u32,
    chunk: u32,
) -> (Vec16, Vec16) {
    let (k_src, v_src, offset) = match target {
        RowTarget::Dense { page, head, token } => (
            bufs.k_pool.get(),
            bufs.v_pool.get(),
            chunk_at(c.paged.kv_row(page, head, token), chunk),
        ),
        RowTarget::Streaming { head, row } => (
            bufs.k_stream.get(),
            bufs.v_stream.get(),
            chunk_at(c.streaming.kv_row(slot, head, row), chunk),
        ),
        RowTarget::Nowhere => return (Vec16([0; 4]), Vec16([0; 4])),
    };
    // SAFETY: as `write_chunk`'s stores.
    unsafe { (load(k_src.add(offset)), load(v_src.add(offset))) }
}
