//! Index math of the two-way paged KV cache (see `docs/ARCHITECTURE.md`, "Layouts").
//!
//! All offsets are in elements, not bytes. The structs are `#[repr(C)]` and `Copy` so a kernel
//! can take them by value as launch parameters.

/// The distance between consecutive tokens' rows in a launch's activations, in head rows of
/// `head_dim` elements: a packed `[tokens][heads][D]` tensor has stride `heads`; a view into a
/// fused `[tokens][Hq + 2 Hkv][D]` QKV buffer has `Hq + 2 Hkv`. In decode a "token" is a sequence
/// of the batch (one token each). `k` and `v` share one stride. (In head rows, not elements, so
/// a kernel's row offsets are `stride * D` with `D` a constant: the 128-row D 128 prefill kernel
/// spills with an element stride.)
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenStrides {
    /// Of the queries.
    pub q: u32,
    /// Of the keys and of the values.
    pub kv: u32,
    /// Of the output.
    pub out: u32,
}

impl TokenStrides {
    /// The strides of packed tensors: `q_heads` for the queries and the output, `kv_heads` for
    /// the keys and values.
    ///
    /// ```
    /// use lserve_abi::layout::TokenStrides;
    /// let s = TokenStrides::packed(32, 8);
    /// assert_eq!((s.q, s.kv, s.out), (32, 8, 32));
    /// ```
    pub const fn packed(q_heads: u32, kv_heads: u32) -> Self {
        Self {
            q: q_heads,
            kv: kv_heads,
            out: q_heads,
        }
    }
}

/// One layer's cache as the kernels address it: its dense pool and streaming store, and the
/// block tables shared by all layers.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    /// KV heads of the model (`Hkv`): the activations are `[rows][kv_heads][head_dim]`.
    pub kv_heads: u32,
    /// Row stride of the block tables (`[slots][max_pages]`).
    pub max_pages: u32,
    /// The layer's dense pool.
    pub paged: PagedLayout,
    /// The layer's streaming store.
    pub streaming: StreamingLayout,
}

impl CacheLayout {
    /// Chunks of one activation row (`kv_heads * head_dim / 8`).
    #[inline(always)]
    pub const fn chunks_per_token(&self) -> u32 {
        self.kv_heads * (self.paged.head_dim / crate::kv_write::CHUNK_ELEMS)
    }

    /// Whether position `pos` of a sequence of length `len` is held by a streaming head: a sink
    /// token, or one of the last `local_tokens` (`StreamingStore::is_resident`).
    #[inline(always)]
    pub const fn streaming_resident(&self, pos: u32, len: u32) -> bool {
        pos < len && (pos < self.streaming.sink_tokens || pos + self.streaming.local_tokens >= len)
    }
}

/// Row strides of a layer's page selection state (`buffers::SelectionPtrs`), per (slot, dense
/// head) pair.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectionLayout {
    /// Units of one index-table entry (`[slots][dense_heads][entry_capacity]`): a held selection
    /// and the newest unit.
    pub entry_capacity: u32,
    /// Words of one held selection row (`[slots][dense_heads][held_capacity]`); the last word is
    /// the selection's newest unit (`select::held_newest_at`).
    pub held_capacity: u32,
    /// Selection units per physical page: 1 when whole pages are selected, `N_P / N_L` when
    /// logical pages are. A selecting entry lists unit ids ([`unit_id`]); the held selection
    /// and the score workspace are in the sequence's units.
    pub units_per_page: u32,
}

impl SelectionLayout {
    /// Tokens of one selection unit for a pool of `page_tokens`-token pages.
    #[inline(always)]
    pub const fn unit_tokens(&self, page_tokens: u32) -> u32 {
        page_tokens / self.units_per_page
    }
}

/// The index-entry id of a sequence's unit `unit` whose physical page (the block table's entry
/// [`unit_page`]`(unit, units_per_page)`) is `page`: `page * units_per_page + unit %
/// units_per_page`, the page id itself for whole pages. `units_per_page` is a power of two (the
/// device cache checks it). Saturating: a page id past the pool (`PAD_PAGE`) gives an id whose
/// page is still past the pool, as long as `capacity * units_per_page` fits `u32` (checked by
/// the host).
///
/// ```
/// use lserve_abi::layout::{unit_id, unit_page};
/// assert_eq!(unit_id(7, 29, 4), 29); // page 7 holds units 28..32
/// assert_eq!(unit_page(29, 4), 7);
/// assert_eq!(unit_id(7, 3, 1), 7);
/// assert_eq!(unit_id(u32::MAX, 1, 4), u32::MAX);
/// ```
#[inline(always)]
pub const fn unit_id(page: u32, unit: u32, units_per_page: u32) -> u32 {
    page.saturating_mul(units_per_page)
        .saturating_add(unit & (units_per_page - 1))
}

/// The page of unit `unit` (a sequence's unit number or a unit id): `unit / units_per_page`,
/// `units_per_page` a power of two.
#[inline(always)]
pub const fn unit_page(unit: u32, units_per_page: u32) -> u32 {
    unit >> units_per_page.trailing_zeros()
}

/// One layer's dense page pool: `K`, `V` are `[capacity][heads][page_tokens][head_dim]`, the key
/// statistics `kmin`, `kmax` are `[capacity][heads][page_tokens / logical_tokens][head_dim]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedLayout {
    /// Physical pages in the pool (shared by all layers: one block table per sequence).
    pub capacity: u32,
    /// Dense KV heads of this layer.
    pub heads: u32,
    /// Tokens per physical page (`N_P`).
    pub page_tokens: u32,
    /// Tokens per logical page (`N_L`); divides `page_tokens`.
    pub logical_tokens: u32,
    /// Head dimension (`D`).
    pub head_dim: u32,
}

impl PagedLayout {
    /// Logical pages per physical page (`g = N_P / N_L`).
    #[inline(always)]
    pub const fn logical_per_page(&self) -> u32 {
        self.page_tokens / self.logical_tokens
    }

    /// Elements of one of `K` or `V` for the whole pool.
    #[inline(always)]
    pub const fn kv_elements(&self) -> usize {
        self.capacity as usize
            * self.heads as usize
            * self.page_tokens as usize
            * self.head_dim as usize
    }

    /// Elements of one of `kmin` or `kmax` for the whole pool.
    #[inline(always)]
    pub const fn stats_elements(&self) -> usize {
        self.capacity as usize
            * self.heads as usize
            * self.logical_per_page() as usize
            * self.head_dim as usize
    }

    /// Offset of row `token` (within the page) of `head` in physical page `page`, in `K` or `V`.
    #[inline(always)]
    pub const fn kv_row(&self, page: u32, head: u32, token: u32) -> usize {
        ((page as usize * self.heads as usize + head as usize) * self.page_tokens as usize
            + token as usize)
            * self.head_dim as usize
    }

    /// Offset of logical page `logical` (within the physical page) of `head` in page `page`, in
    /// `kmin` or `kmax`.
    #[inline(always)]
    pub const fn stats_row(&self, page: u32, head: u32, logical: u32) -> usize {
        ((page as usize * self.heads as usize + head as usize) * self.logical_per_page() as usize
            + logical as usize)
            * self.head_dim as usize
    }
}

/// One layer's streaming store: `K`, `V` are `[slots][heads][sink_tokens + local_tokens][head_dim]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamingLayout {
    /// Sequence slots (the most sequences alive at once).
    pub slots: u32,
    /// Streaming KV heads of this layer.
    pub heads: u32,
    /// Attention-sink tokens kept from the start of the sequence.
    pub sink_tokens: u32,
    /// Most recent tokens kept (the ring).
    pub local_tokens: u32,
    /// Head dimension (`D`).
    pub head_dim: u32,
}

impl StreamingLayout {
    /// Rows per (slot, head): sinks then the ring.
    #[inline(always)]
    pub const fn rows(&self) -> u32 {
        self.sink_tokens + self.local_tokens
    }

    /// Elements of one of `K` or `V` for the whole store.
    #[inline(always)]
    pub const fn kv_elements(&self) -> usize {
        self.slots as usize * self.heads as usize * self.rows() as usize * self.head_dim as usize
    }

    /// The row (within a slot and head) where token position `t` is stored: `t` for sink tokens,
    /// else its place in the ring.
    #[inline(always)]
    pub const fn row_of_token(&self, t: u32) -> u32 {
        if t < self.sink_tokens {
            t
        } else {
            self.sink_tokens + (t - self.sink_tokens) % self.local_tokens
        }
    }

    /// Offset of `row` of `head` in `slot`, in `K` or `V`.
    #[inline(always)]
    pub const fn kv_row(&self, slot: u32, head: u32, row: u32) -> usize {
        ((slot as usize * self.heads as usize + head as usize) * self.rows() as usize
            + row as usize)
            * self.head_dim as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paged_rows_tile_the_pool_without_overlap() {
        let l = PagedLayout {
            capacity: 3,
            heads: 2,
            page_tokens: 8,
            logical_tokens: 4,
            head_dim: 16,
        };
        let mut seen = [false; 3 * 2 * 8];
        for p in 0..3 {
            for h in 0..2 {
                for t in 0..8 {
                    let r = l.kv_row(p, h, t);
                    assert_eq!(r % 16, 0);
                    assert!(!seen[r / 16]);
                    seen[r / 16] = true;
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(l.kv_elements(), 3 * 2 * 8 * 16);
        assert_eq!(l.stats_row(2, 1, 1), ((2 * 2 + 1) * 2 + 1) * 16);
    }

    #[test]
    fn streaming_ring_keeps_sinks_and_wraps_the_rest() {
        let l = StreamingLayout {
            slots: 2,
            heads: 1,
            sink_tokens: 4,
            local_tokens: 6,
            head_dim: 8,
        };
        assert_eq!(l.row_of_token(3), 3);
        assert_eq!(l.row_of_token(4), 4);
        assert_eq!(l.row_of_token(9), 9);
        assert_eq!(l.row_of_token(10), 4);
        assert_eq!(l.row_of_token(16), 4);
        assert_eq!(l.kv_row(1, 0, 2), (10 + 2) * 8);
    }
}
