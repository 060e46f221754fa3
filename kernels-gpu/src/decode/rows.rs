//! Which KV rows a (sequence, KV head) pair attends to, as a run of tiles.
//!
//! The decode kernel's loop body never asks what kind of head it serves: a [`RowSource`] turns a
//! tile index into the addresses of that tile's K and V rows. Streaming heads read their slot of
//! the streaming store (sinks then the ring: all rows that exist, since softmax does not care
//! about order); dense heads read a page list (the block table, or the index table of selected
//! pages) whose last entry is the newest, partially filled page.

use lserve_abi::decode::{DecodeParams, DECODE_TILE_ROWS, HEAD_STREAMING};

/// The rows of one (sequence, KV head) pair.
#[derive(Clone, Copy)]
pub struct RowSource {
    k: *const u16,
    v: *const u16,
    /// Dense: the page list; null for streaming heads.
    pages: *const u32,
    /// The head's index among the layer's dense (or streaming) heads.
    head: u32,
    /// The sequence's slot (streaming store row block).
    slot: u32,
    /// Rows that exist (the last tile may be partial).
    pub rows: u32,
}

/// Device buffers a decode launch reads its rows from.
#[derive(Clone, Copy)]
pub struct CacheBuffers {
    /// Dense pool K/V of the layer (`PagedLayout`).
    pub k_pool: *const u16,
    /// See `k_pool`.
    pub v_pool: *const u16,
    /// Streaming store K/V of the layer (`StreamingLayout`).
    pub k_stream: *const u16,
    /// See `k_stream`.
    pub v_stream: *const u16,
    /// `[slots][max_pages]` physical page ids.
    pub block_tables: *const u32,
    /// `[slots][dense_heads][max_selected]` selected physical page ids.
    pub index_tables: *const u32,
    /// `[slots][dense_heads]` entries used in each index table.
    pub index_lens: *const u32,
}

impl RowSource {
    /// The rows of KV head entry `head_map_entry` for a sequence of `len` tokens in `slot`.
    ///
    /// # Safety
    /// The buffers hold the layouts `p` describes, `slot` is a live slot and the tables' entries
    /// for it are valid page ids.
    #[inline(always)]
    pub unsafe fn new(
        p: &DecodeParams,
        bufs: &CacheBuffers,
        head_map_entry: u32,
        slot: u32,
        len: u32,
    ) -> Self {
        let head = head_map_entry & !HEAD_STREAMING;
        if head_map_entry & HEAD_STREAMING != 0 {
            let rows = if len < p.streaming.rows() {
                len
            } else {
                p.streaming.rows()
            };
            return Self {
                k: bufs.k_stream,
                v: bufs.v_stream,
                pages: core::ptr::null(),
                head,
                slot,
                rows,
            };
        }
        let page_tokens = p.paged.page_tokens;
        let live_pages = len.div_ceil(page_tokens);
        let newest_fill = len - (live_pages - 1) * page_tokens;
        // SAFETY (both arms): the caller guarantees the tables cover `slot` and `head`.
        let (pages, listed) = if len <= p.dynamic_min_len {
            (
                unsafe { bufs.block_tables.add((slot * p.max_pages) as usize) },
                live_pages,
            )
        } else {
            let entry = slot * p.paged.heads + head;
            // Clamped into the entry: a pair that was never given one (a step replayed without
            // the selector it needed) reads wrong pages of the pool, never past the table.
            let listed = unsafe { *bufs.index_lens.add(entry as usize) }.clamp(1, p.max_selected);
            (
                unsafe { bufs.index_tables.add((entry * p.max_selected) as usize) },
                listed,
            )
        };
        let rows = (listed - 1) * page_tokens + newest_fill;
        Self {
            k: bufs.k_pool,
            v: bufs.v_pool,
            pages,
            head,
            slot,
            rows,
        }
    }

    /// Tiles covering the rows.
    #[inline(always)]
    pub fn tiles(&self) -> u32 {
        self.rows.div_ceil(DECODE_TILE_ROWS)
    }

    /// Rows of tile `t` that exist (`DECODE_TILE_ROWS` except for the last tile).
    #[inline(always)]
    pub fn tile_rows(&self, t: u32) -> u32 {
        let left = self.rows - t * DECODE_TILE_ROWS;
        if left < DECODE_TILE_ROWS {
            left
        } else {
            DECODE_TILE_ROWS
        }
    }

    /// Element offset of the first row of tile `t` in the K (and V) buffer. For dense heads
    /// this reads the page list (global memory): the kernel asks for it a tile ahead.
    ///
    /// # Safety
    /// `t < self.tiles()`.
    #[inline(always)]
    pub unsafe fn tile_offset(&self, p: &DecodeParams, t: u32) -> usize {
        let row = t * DECODE_TILE_ROWS;
        if self.pages.is_null() {
            p.streaming.kv_row(self.slot, self.head, row)
        } else {
            let tiles_per_page = p.paged.page_tokens / DECODE_TILE_ROWS;
            // SAFETY: `t / tiles_per_page` is below the listed page count.
            let page = unsafe { *self.pages.add((t / tiles_per_page) as usize) };
            p.paged
                .kv_row(page, self.head, (t % tiles_per_page) * DECODE_TILE_ROWS)
        }
    }

    /// Pointers to the first K and V rows of the tile at element offset `offset`.
    ///
    /// # Safety
    /// `offset` is a [`tile_offset`](Self::tile_offset) of this source.
    #[inline(always)]
    pub unsafe fn tile_at(&self, offset: usize) -> (*const u16, *const u16) {
        // SAFETY: forwarded; offsets stay inside the buffers by the layouts.
        unsafe { (self.k.add(offset), self.v.add(offset)) }
    }
}
