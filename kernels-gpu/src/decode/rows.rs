//! Which KV rows a (sequence, KV head) pair attends to, as a run of tiles.
//!
//! The decode kernel's loop body never asks what kind of head it serves: a [`RowSource`] turns a
//! tile index into the addresses of that tile's K and V rows. Streaming heads read their slot of
//! the streaming store (sinks then the ring: all rows that exist, since softmax does not care
//! about order); dense heads read a page list (the block table, or the index table of selected
//! pages) whose last entry is the newest, partially filled page.

use lserve_abi::decode::{
    DecodeArgs, DecodeParams, DECODE_TILE_ROWS, HEAD_STREAMING, TENSOR_MAP_BYTES, TENSOR_MAP_POOL,
    TENSOR_MAP_STREAM,
};
use lserve_abi::layout::unit_id;
use lserve_abi::select::held_newest_at;

use super::newest::EntryTail;
use crate::global::load_u32;
use crate::math::opaque_u32;
use crate::pool_page::pool_page;

/// The rows of one (sequence, KV head) pair.
#[derive(Clone, Copy)]
pub struct RowSource {
    k: *const u16,
    v: *const u16,
    /// The tensor maps of `k` and `v` (for the tensor-map copies).
    maps: *const u8,
    /// Dense: the page list; null for streaming heads.
    pages: *const u32,
    /// Element offsets at or past this are no rows of `k`/`v`: the pool's end for dense heads
    /// (where [`tile_offset`](Self::tile_offset) puts a page past the pool), none for
    /// streaming heads.
    pub offset_end: usize,
    /// Dense: units taken from `pages`; any after them is `newest_page`.
    listed: u32,
    /// Dense: the id of the sequence's newest unit (its newest page's, for whole pages).
    newest_page: u32,
    /// Dense: log2 of the units per physical page of the list's ids: 0 for the block table
    /// (pages), that of `SelectionLayout::units_per_page` for the index table. A unit is
    /// `page_tokens >> unit_shift` tokens, a multiple of the tile's rows.
    unit_shift: u32,
    /// Whether pages from `listed` on are `newest_page` (a launch that appends, whose index
    /// entries' tails are being rewritten); else every page comes from `pages`.
    newest_after_listed: bool,
    /// The head's index among the layer's dense (or streaming) heads.
    head: u32,
    /// The sequence's slot (streaming store row block).
    slot: u32,
    /// Rows that exist (the last tile may be partial).
    pub rows: u32,
    /// Which of the rows holds the newest token (position `len - 1`), or [`NO_ROW`] if the
    /// head does not hold it (a streaming head without local tokens, past its sinks).
    pub newest_row: u32,
    /// A selecting dense head in a launch that appends: its index entry (`[slots][dense_heads]`
    /// index) and tail as listed; `tail.held == 0` otherwise.
    pub entry: u32,
    /// See `entry`.
    pub tail: EntryTail,
}

/// [`RowSource::newest_row`] of a pair that does not hold the newest token.
pub const NO_ROW: u32 = u32::MAX;

/// What a pair's rows depend on that the host wrote (read before the kernel waits for the
/// kernel before it): the sequence's length and slot, the head map entry, and a dense head's
/// newest physical page.
#[derive(Clone, Copy)]
pub struct PairInputs {
    /// The sequence's length (its newest token is position `len - 1`).
    pub len: u32,
    /// The sequence's slot.
    pub slot: u32,
    /// The KV head's head map entry.
    pub head_map_entry: u32,
    /// Dense heads in a launch that appends: the block table's entry for the newest page; else
    /// unused.
    pub newest_page: u32,
}

impl PairInputs {
    /// Reads pair `(b, kv_head)`'s inputs; a dense head's newest page only when `appending`
    /// (the list's tail then comes from it).
    ///
    /// # Safety
    /// `b < batch`, `kv_head < kv_heads`; the slot and length are valid for the tables.
    #[inline(always)]
    pub unsafe fn read(a: &DecodeArgs, b: u32, kv_head: u32, appending: bool) -> Self {
        let p = &a.params;
        let (seq_len, seq_slot) = (a.batch.seq_len.get(), a.batch.seq_slot.get());
        let head_map = a.cache.head_map.get();
        // SAFETY: forwarded.
        unsafe {
            let (len, slot, head_map_entry) = (
                load_u32(seq_len.add(b as usize)),
                load_u32(seq_slot.add(b as usize)),
                load_u32(head_map.add(kv_head as usize)),
            );
            let newest_page = if appending && head_map_entry & HEAD_STREAMING == 0 {
                let newest = (len - 1) / p.cache.paged.page_tokens;
                load_u32(
                    a.cache
                        .block_tables
                        .get()
                        .add((slot * p.cache.max_pages + newest) as usize),
                )
            } else {
                0
            };
            Self {
                len,
                slot,
                head_map_entry,
                newest_page,
            }
        }
    }
}

impl RowSource {
    /// The rows of the pair whose host inputs are `pair`.
    ///
    /// A selecting dense head lists its index entry. In a launch that appends, whose newest-row
    /// warp rewrites the entry's tail meanwhile, it lists the held selection (the entry's first
    /// `held` pages), then the newest page unless the selection ends with it: the selection's
    /// newest page (the held row's last word) is read beside the held length, so the list still
    /// needs one dependent load, and nothing that warp writes is read. While no selection is held
    /// (that warp then writes nothing to the entry) it lists the entry as it is, as a launch
    /// that does not append does.
    ///
    /// # Safety
    /// The buffers hold the layouts `p` describes, `pair.slot` is a live slot and the tables'
    /// entries for it are valid page ids; the kernel before (which may write the selection
    /// state) has completed.
    #[inline(always)]
    pub unsafe fn new(a: &DecodeArgs, pair: PairInputs, appending: bool) -> Self {
        let p = &a.params;
        let (cache, selection) = (&a.cache, &a.selection);
        let PairInputs {
            len,
            slot,
            head_map_entry,
            newest_page,
        } = pair;
        let head = head_map_entry & !HEAD_STREAMING;
        if head_map_entry & HEAD_STREAMING != 0 {
            let s = &p.cache.streaming;
            let rows = if len < s.rows() { len } else { s.rows() };
            // Only a launch that appends asks where the newest row is.
            let pos = len - 1;
            let held = appending && p.cache.streaming_resident(pos, len);
            return Self {
                k: cache.k_stream.get(),
                v: cache.v_stream.get(),
                // SAFETY (pointer arithmetic): inside the maps buffer.
                maps: unsafe {
                    a.tensor_maps
                        .get()
                        .add(TENSOR_MAP_STREAM * TENSOR_MAP_BYTES)
                },
                pages: core::ptr::null(),
                offset_end: usize::MAX,
                listed: 0,
                newest_page: 0,
                unit_shift: 0,
                newest_after_listed: false,
                head,
                slot,
                rows,
                newest_row: if held { s.row_of_token(pos) } else { NO_ROW },
                entry: 0,
                tail: EntryTail::NONE,
            };
        }
        let page_tokens = p.cache.paged.page_tokens;
        let live_pages = len.div_ceil(page_tokens);
        let entry = slot * p.cache.paged.heads + head;
        // A selecting list is in selection units (`lserve_abi::layout::unit_id`s); the block
        // table in pages.
        let dense_all = len <= p.dynamic_min_len;
        let unit_shift = if dense_all {
            0
        } else {
            p.selection.units_per_page.trailing_zeros()
        };
        let (unit_tokens, units_per_page) = (page_tokens >> unit_shift, 1 << unit_shift);
        let live_units = len.div_ceil(unit_tokens);
        let newest_fill = len - (live_units - 1) * unit_tokens;
        // The newest unit's id, from the newest page's block-table entry (appending launches).
        let newest_id = unit_id(newest_page, live_units - 1, units_per_page);
        // The list: `pages` units of which the first `listed` come from `pages_at`, the rest
        // (the newest unit) from `newest_id`.
        // SAFETY (all arms): the caller guarantees the tables cover `slot` and `head`.
        let (pages_at, pages, listed, tail) = if dense_all {
            (
                unsafe {
                    cache
                        .block_tables
                        .get()
                        .add((slot * p.cache.max_pages) as usize)
                },
                live_pages,
                live_pages,
                EntryTail::NONE,
            )
        } else if !appending {
            // The entry as the append and the selector left it: the held selection, the newest
            // page last. Clamped into the table: a pair that was never given one (a step
            // replayed without the selector it needed) reads wrong pages, never past the table.
            let listed = unsafe { load_u32(selection.index_lens.get().add(entry as usize)) }
                .clamp(1, p.selection.entry_capacity);
            (
                unsafe {
                    selection
                        .index_pages
                        .read_only()
                        .get()
                        .add((entry * p.selection.entry_capacity) as usize)
                },
                listed,
                listed,
                EntryTail::NONE,
            )
        } else {
            // This launch appends, and the warp holding the newest row rewrites the entry's tail
            // (from `tail` below, `newest::keep_entry_tail`): list the held selection, then the
            // newest page unless the selection ends with it. Three independent loads: the held
            // length, the selection's newest page, and the entry's length (used only while no
            // selection is held, when the owner warp writes nothing to the entry).
            let (held, held_newest, entry_len) = unsafe {
                (
                    load_u32(selection.held_lens.get().add(entry as usize)),
                    load_u32(selection.held_pages.get().add(
                        (entry * p.selection.held_capacity
                            + held_newest_at(p.selection.held_capacity))
                            as usize,
                    )),
                    load_u32(selection.index_lens.get().add(entry as usize)),
                )
            };
            if held == 0 {
                // No selection held (a cache uploaded with its index tables, or a selection
                // reset, and no selector run since): the entry as it is, as a launch that does
                // not append reads it, clamped into the table the same way.
                let listed = entry_len.clamp(1, p.selection.entry_capacity);
                (
                    unsafe {
                        selection
                            .index_pages
                            .read_only()
                            .get()
                            .add((entry * p.selection.entry_capacity) as usize)
                    },
                    listed,
                    listed,
                    EntryTail::NONE,
                )
            } else {
                // A selection may fill the entry only if it covers every unit, the newest
                // included: clamped there, the list never leaves the table.
                let held = held.min(p.selection.entry_capacity);
                let pages = if held_newest == live_units - 1 {
                    held
                } else {
                    held + 1
                };
                (
                    unsafe {
                        selection
                            .index_pages
                            .read_only()
                            .get()
                            .add((entry * p.selection.entry_capacity) as usize)
                    },
                    pages,
                    pages - 1,
                    EntryTail {
                        held,
                        pages,
                        newest_page: newest_id,
                    },
                )
            }
        };
        let rows = (pages - 1) * unit_tokens + newest_fill;
        Self {
            k: cache.k_pool.get(),
            v: cache.v_pool.get(),
            // SAFETY (pointer arithmetic): inside the maps buffer.
            maps: unsafe { a.tensor_maps.get().add(TENSOR_MAP_POOL * TENSOR_MAP_BYTES) },
            pages: pages_at,
            offset_end: p.cache.paged.kv_elements(),
            listed,
            newest_page: newest_id,
            unit_shift,
            newest_after_listed: appending,
            head,
            slot,
            rows,
            newest_row: rows - 1,
            entry,
            tail,
        }
    }

    /// Whether the pair is a streaming head's (its rows are the streaming store's).
    #[inline(always)]
    pub fn is_streaming(&self) -> bool {
        self.pages.is_null()
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

    /// The physical page of a dense head's tile `t` and the tile's first row in that page, from
    /// the list's unit id (global memory): the kernel asks for it a tile ahead.
    ///
    /// # Safety
    /// `t < self.tiles()`, and the head is dense (`pages` is not null).
    #[inline(always)]
    unsafe fn page_of(&self, p: &DecodeParams, t: u32) -> (u32, u32) {
        let unit_tokens = p.cache.paged.page_tokens >> self.unit_shift;
        let tiles_per_unit = unit_tokens / DECODE_TILE_ROWS;
        // SAFETY: forwarded.
        let id = unsafe { self.unit_of(t / tiles_per_unit) };
        let sub = id & ((1 << self.unit_shift) - 1);
        (
            id >> self.unit_shift,
            sub * unit_tokens + (t % tiles_per_unit) * DECODE_TILE_ROWS,
        )
    }

    /// The id of the list's unit `at` (global memory).
    ///
    /// # Safety
    /// `at` is below the list's unit count, and the head is dense (`pages` is not null).
    #[inline(always)]
    unsafe fn unit_of(&self, at: u32) -> u32 {
        if self.newest_after_listed {
            // The load whatever `at` (inside the list, or its first page if it is empty),
            // then a select: no branch around the load in the tile loop.
            // SAFETY: `min(at, listed - 1)` (or 0) is inside the list's table row.
            let listed =
                unsafe { load_u32(self.pages.add(at.min(self.listed.max(1) - 1) as usize)) };
            // (`opaque_u32`: a value, so LLVM cannot make this a load through a selected
            // pointer, which put `newest_page` in local memory.)
            if at < self.listed {
                listed
            } else {
                opaque_u32(self.newest_page)
            }
        } else {
            // SAFETY: `at` is below the listed page count.
            unsafe { load_u32(self.pages.add(at as usize)) }
        }
    }

    /// Element offset of the first row of tile `t` in the K (and V) buffer; for a dense tile
    /// whose page is past the pool, an offset at or past [`offset_end`](Self::offset_end)
    /// (`crate::pool_page`: the copy reads nothing for it).
    /// For dense heads this reads the page list (global memory): the kernel asks for it a tile
    /// ahead.
    ///
    /// # Safety
    /// `t < self.tiles()`.
    #[inline(always)]
    pub unsafe fn tile_offset(&self, p: &DecodeParams, t: u32) -> usize {
        let row = t * DECODE_TILE_ROWS;
        if self.pages.is_null() {
            p.cache.streaming.kv_row(self.slot, self.head, row)
        } else {
            // SAFETY: forwarded; the head is dense.
            let (page, row) = unsafe { self.page_of(p, t) };
            p.cache
                .paged
                .kv_row(pool_page(&p.cache.paged, page), self.head, row)
        }
    }

    /// Pointers to the first K and V rows of the tile at element offset `offset`.
    ///
    /// # Safety
    /// `offset` is a [`tile_offset`](Self::tile_offset) of this source below
    /// [`offset_end`](Self::offset_end), or 0 (the buffers' first rows).
    #[inline(always)]
    pub unsafe fn tile_at(&self, offset: usize) -> (*const u16, *const u16) {
        // SAFETY: forwarded; offsets stay inside the buffers by the layouts.
        unsafe { (self.k.add(offset), self.v.add(offset)) }
    }

    /// Tile `t` as a tensor-map box: `(block, row)`, the block (`page * heads + head`, or
    /// `slot * heads + head`) and its first row within the block; a page past the pool gives a
    /// block past the map's (`crate::pool_page::pool_page`), whose box the copy engine fills
    /// with zeros without reading. For dense heads this reads the page list, as
    /// [`tile_offset`](Self::tile_offset) does.
    ///
    /// # Safety
    /// `t < self.tiles()`.
    #[inline(always)]
    pub unsafe fn tile_box(&self, p: &DecodeParams, t: u32) -> (u32, u32) {
        let row = t * DECODE_TILE_ROWS;
        if self.pages.is_null() {
            (self.slot * p.cache.streaming.heads + self.head, row)
        } else {
            // SAFETY: forwarded; the head is dense. A page past the pool becomes block
            // `capacity * heads + head`, outside the map: the box lands as zeros.
            let (page, row) = unsafe { self.page_of(p, t) };
            let page = pool_page(&p.cache.paged, page);
            (page * p.cache.paged.heads + self.head, row)
        }
    }

    /// The tensor maps of this source's K buffer and (the next map) its V buffer.
    #[inline(always)]
    pub fn maps(&self) -> *const u8 {
        self.maps
    }
}
