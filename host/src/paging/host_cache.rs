//! K/V and key statistics in host memory, in the device's layout.

use lserve_abi::{PagedLayout, StreamingLayout};

use super::sequences::{KvCacheManager, SequenceView};
use super::streaming_store::StreamingStore;
use crate::config::SparsityConfig;
use crate::dtype::Element;
use crate::error::{checked_elements, LserveError, Result};
use crate::head_pattern::{HeadKind, HeadPattern};

/// One layer's dense page pool: `k`, `v` `[capacity][Hd][N_P][D]`, `kmin`, `kmax`
/// `[capacity][Hd][N_P / N_L][D]`, addressed with [`PagedLayout`]. `head` arguments are compact
/// dense indices ([`HeadPattern::dense_index`]).
#[derive(Clone, Debug, PartialEq)]
pub struct DenseLayerCache<E> {
    layout: PagedLayout,
    /// `K` and `V`.
    kv: RowPair<E>,
    /// `kmin` and `kmax`.
    stats: RowPair<E>,
}

/// One layer's streaming store: `k`, `v` `[slots][Hs][sink + local][D]`, addressed with
/// [`StreamingLayout`]. `head` arguments are compact streaming indices
/// ([`HeadPattern::streaming_index`]).
#[derive(Clone, Debug, PartialEq)]
pub struct StreamingLayerCache<E> {
    layout: StreamingLayout,
    /// `K` and `V`.
    kv: RowPair<E>,
}

/// Two buffers of the same shape addressed together (`K` and `V`, or `kmin` and `kmax`): the
/// rows of `head_dim` elements at one offset in both.
#[derive(Clone, Debug, PartialEq)]
struct RowPair<E> {
    first: Vec<E>,
    second: Vec<E>,
    head_dim: usize,
}

impl<E: Element> RowPair<E> {
    /// Two zeroed buffers of `elements` each.
    fn zeroed(elements: usize, head_dim: u32) -> Self {
        let zero = E::from_f32(0.0);
        Self {
            first: vec![zero; elements],
            second: vec![zero; elements],
            head_dim: head_dim as usize,
        }
    }

    /// The two rows at element offset `offset`.
    fn rows(&self, offset: usize) -> (&[E], &[E]) {
        let r = offset..offset + self.head_dim;
        (&self.first[r.clone()], &self.second[r])
    }

    /// The two rows at element offset `offset`, mutably.
    fn rows_mut(&mut self, offset: usize) -> (&mut [E], &mut [E]) {
        let r = offset..offset + self.head_dim;
        (&mut self.first[r.clone()], &mut self.second[r])
    }
}

impl<E: Element> DenseLayerCache<E> {
    fn new(layout: PagedLayout) -> Self {
        Self {
            layout,
            kv: RowPair::zeroed(layout.kv_elements(), layout.head_dim),
            stats: RowPair::zeroed(layout.stats_elements(), layout.head_dim),
        }
    }

    /// The layout (capacity, dense heads, `N_P`, `N_L`, `D`).
    pub fn layout(&self) -> PagedLayout {
        self.layout
    }

    fn check_kv(&self, page: u32, head: usize, token: usize) -> Result<usize> {
        let l = self.layout;
        if page >= l.capacity {
            return Err(LserveError::PageOutOfRange {
                page,
                capacity: l.capacity,
            });
        }
        check_index("dense head", head, l.heads as usize)?;
        check_index("token in page", token, l.page_tokens as usize)?;
        Ok(l.kv_row(page, head as u32, token as u32))
    }

    fn check_stats(&self, page: u32, head: usize, logical: usize) -> Result<usize> {
        let l = self.layout;
        if page >= l.capacity {
            return Err(LserveError::PageOutOfRange {
                page,
                capacity: l.capacity,
            });
        }
        check_index("dense head", head, l.heads as usize)?;
        check_index(
            "logical page in page",
            logical,
            l.logical_per_page() as usize,
        )?;
        Ok(l.stats_row(page, head as u32, logical as u32))
    }

    /// Key row (`D` elements) of `token` (within the page) of dense head `head` in `page`.
    pub fn key(&self, page: u32, head: usize, token: usize) -> Result<&[E]> {
        let o = self.check_kv(page, head, token)?;
        Ok(self.kv.rows(o).0)
    }

    /// Value row, as [`key`](Self::key).
    pub fn value(&self, page: u32, head: usize, token: usize) -> Result<&[E]> {
        let o = self.check_kv(page, head, token)?;
        Ok(self.kv.rows(o).1)
    }

    /// Mutable key and value rows of `token` of `head` in `page`.
    pub fn kv_rows_mut(
        &mut self,
        page: u32,
        head: usize,
        token: usize,
    ) -> Result<(&mut [E], &mut [E])> {
        let o = self.check_kv(page, head, token)?;
        Ok(self.kv.rows_mut(o))
    }

    /// `kmin` and `kmax` rows (`D` elements each) of logical page `logical` (within the
    /// physical page) of `head` in `page`.
    pub fn stats(&self, page: u32, head: usize, logical: usize) -> Result<(&[E], &[E])> {
        Ok(self.stats.rows(self.check_stats(page, head, logical)?))
    }

    /// Mutable `kmin` and `kmax` rows, as [`stats`](Self::stats). Maintaining them is the
    /// caller's job (the reference's key-statistics pooling).
    pub fn stats_mut(
        &mut self,
        page: u32,
        head: usize,
        logical: usize,
    ) -> Result<(&mut [E], &mut [E])> {
        let o = self.check_stats(page, head, logical)?;
        Ok(self.stats.rows_mut(o))
    }

    /// The whole `K` buffer (for upload).
    pub fn k(&self) -> &[E] {
        &self.kv.first
    }

    /// The whole `V` buffer.
    pub fn v(&self) -> &[E] {
        &self.kv.second
    }

    /// The whole `kmin` buffer.
    pub fn kmin(&self) -> &[E] {
        &self.stats.first
    }

    /// The whole `kmax` buffer.
    pub fn kmax(&self) -> &[E] {
        &self.stats.second
    }

    /// All four buffers mutably: `(k, v, kmin, kmax)` (e.g. to download device results into).
    pub fn buffers_mut(&mut self) -> (&mut [E], &mut [E], &mut [E], &mut [E]) {
        (
            &mut self.kv.first,
            &mut self.kv.second,
            &mut self.stats.first,
            &mut self.stats.second,
        )
    }
}

impl<E: Element> StreamingLayerCache<E> {
    fn new(layout: StreamingLayout) -> Self {
        Self {
            layout,
            kv: RowPair::zeroed(layout.kv_elements(), layout.head_dim),
        }
    }

    /// The layout (slots, streaming heads, sink, local, `D`).
    pub fn layout(&self) -> StreamingLayout {
        self.layout
    }

    fn check(&self, slot: u32, head: usize, row: usize) -> Result<usize> {
        let l = self.layout;
        check_index("slot", slot as usize, l.slots as usize)?;
        check_index("streaming head", head, l.heads as usize)?;
        check_index("streaming row", row, l.rows() as usize)?;
        Ok(l.kv_row(slot, head as u32, row as u32))
    }

    /// Key row (`D` elements) at `row` (see [`StreamingLayout::row_of_token`]) of streaming
    /// head `head` in `slot`.
    pub fn key(&self, slot: u32, head: usize, row: usize) -> Result<&[E]> {
        let o = self.check(slot, head, row)?;
        Ok(self.kv.rows(o).0)
    }

    /// Value row, as [`key`](Self::key).
    pub fn value(&self, slot: u32, head: usize, row: usize) -> Result<&[E]> {
        let o = self.check(slot, head, row)?;
        Ok(self.kv.rows(o).1)
    }

    /// Mutable key and value rows, as [`key`](Self::key).
    pub fn kv_rows_mut(
        &mut self,
        slot: u32,
        head: usize,
        row: usize,
    ) -> Result<(&mut [E], &mut [E])> {
        let o = self.check(slot, head, row)?;
        Ok(self.kv.rows_mut(o))
    }

    /// The whole `K` buffer (for upload).
    pub fn k(&self) -> &[E] {
        &self.kv.first
    }

    /// The whole `V` buffer.
    pub fn v(&self) -> &[E] {
        &self.kv.second
    }

    /// Both buffers mutably: `(k, v)`.
    pub fn buffers_mut(&mut self) -> (&mut [E], &mut [E]) {
        (&mut self.kv.first, &mut self.kv.second)
    }
}

/// The whole KV cache in host memory: per layer a [`DenseLayerCache`] and a
/// [`StreamingLayerCache`], with the same layouts as the device buffers. Buffers start zeroed.
///
/// Token-level helpers route a KV head to its place: a dense head's token `pos` is row
/// `pos % N_P` of physical page `block_table[pos / N_P]`; a streaming head's token is row
/// [`StreamingLayout::row_of_token`] of the sequence's slot, and only the sinks and the last
/// `local_tokens` positions (at the view's length) are held.
///
/// See the [module example](super) for a round trip.
#[derive(Clone, Debug, PartialEq)]
pub struct HostKvCache<E> {
    pattern: HeadPattern,
    config: SparsityConfig,
    dense: Vec<DenseLayerCache<E>>,
    streaming: Vec<StreamingLayerCache<E>>,
}

impl<E: Element> HostKvCache<E> {
    /// A zeroed cache of `capacity_pages` pages and `max_sequences` streaming slots per layer.
    ///
    /// Errors (`InvalidConfig`, before anything is allocated): an invalid config, capacity or
    /// slot count, or buffers whose sizes overflow.
    pub fn new(
        pattern: &HeadPattern,
        config: &SparsityConfig,
        capacity_pages: usize,
        max_sequences: usize,
    ) -> Result<Self> {
        config.validate()?;
        let g = pattern.geometry();
        config.stats_format.check(g.head_dim())?;
        // The buffer sizes are checked before anything is allocated.
        for layer in 0..g.layers() {
            let (dense, streaming) = (pattern.dense_heads(layer), pattern.streaming_heads(layer));
            let rows = config.sink_tokens + config.local_tokens; // validate: fits u32
            let kv = [capacity_pages, dense, config.page_tokens, g.head_dim()];
            let ring = [max_sequences, streaming, rows, g.head_dim()];
            if checked_elements::<E>(&kv).is_none() || checked_elements::<E>(&ring).is_none() {
                return Err(LserveError::InvalidConfig {
                    field: "capacity_pages",
                    reason: format!(
                        "layer {layer}'s K/V buffers overflow: {kv:?} dense, {ring:?} streaming"
                    ),
                });
            }
        }
        super::page_pool::PagePool::check_capacity(capacity_pages)?;
        StreamingStore::check(max_sequences, config.sink_tokens, config.local_tokens)?;
        let store = StreamingStore::new(max_sequences, config.sink_tokens, config.local_tokens)?;
        let dense = (0..g.layers())
            .map(|layer| {
                DenseLayerCache::new(super::paged_layout(pattern, config, capacity_pages, layer))
            })
            .collect();
        let streaming = (0..g.layers())
            .map(|layer| {
                StreamingLayerCache::new(store.layout(pattern.streaming_heads(layer), g.head_dim()))
            })
            .collect();
        Ok(Self {
            pattern: pattern.clone(),
            config: *config,
            dense,
            streaming,
        })
    }

    /// A cache shaped for `manager` (its pattern, config, capacity and slots).
    pub fn for_manager(manager: &KvCacheManager) -> Result<Self> {
        Self::new(
            manager.pattern(),
            manager.config(),
            manager.pool().capacity(),
            manager.max_sequences(),
        )
    }

    /// The head pattern the cache routes by.
    pub fn pattern(&self) -> &HeadPattern {
        &self.pattern
    }

    /// The sparsity configuration (page sizes, sink and ring).
    pub fn config(&self) -> &SparsityConfig {
        &self.config
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.dense.len()
    }

    /// Layer `layer`'s dense pool (`InvalidArgument` if out of range).
    pub fn dense(&self, layer: usize) -> Result<&DenseLayerCache<E>> {
        check_index("layer", layer, self.dense.len())?;
        Ok(&self.dense[layer])
    }

    /// Layer `layer`'s dense pool, mutably.
    pub fn dense_mut(&mut self, layer: usize) -> Result<&mut DenseLayerCache<E>> {
        check_index("layer", layer, self.dense.len())?;
        Ok(&mut self.dense[layer])
    }

    /// Layer `layer`'s streaming store.
    pub fn streaming(&self, layer: usize) -> Result<&StreamingLayerCache<E>> {
        check_index("layer", layer, self.streaming.len())?;
        Ok(&self.streaming[layer])
    }

    /// Layer `layer`'s streaming store, mutably.
    pub fn streaming_mut(&mut self, layer: usize) -> Result<&mut StreamingLayerCache<E>> {
        check_index("layer", layer, self.streaming.len())?;
        Ok(&mut self.streaming[layer])
    }

    /// Writes token `pos` of a sequence for every KV head of `layer`: `k`, `v` are
    /// `[Hkv][D]`. Dense heads go to their page row; streaming heads to their sink or ring row,
    /// and only if `pos` is held at the view's length (an older position is skipped, as the
    /// ring would have overwritten it), so write order does not matter.
    ///
    /// Errors (nothing written): layer out of range, `ShapeMismatch` for `k`/`v`,
    /// `TokenNotStored` if `pos >= view.len`, `InvalidArgument` for a position past `u32` or if
    /// the block table lacks the page, `PageOutOfRange` for a page id past the capacity,
    /// `InvalidArgument` for a slot past the store.
    pub fn write_token(
        &mut self,
        layer: usize,
        view: &SequenceView<'_>,
        pos: usize,
        k: &[E],
        v: &[E],
    ) -> Result<()> {
        check_index("layer", layer, self.dense.len())?;
        let g = *self.pattern.geometry();
        let (hkv, d) = (g.kv_heads(), g.head_dim());
        for (what, buf) in [("k", k), ("v", v)] {
            if buf.len() != hkv * d {
                return Err(LserveError::ShapeMismatch {
                    what,
                    expected: hkv * d,
                    actual: buf.len(),
                });
            }
        }
        let page = self.dense_page_of(layer, view, pos)?;
        let streaming_row = self.streaming_row_of(layer, view, pos)?;
        for kv_head in 0..hkv {
            let src = kv_head * d..(kv_head + 1) * d;
            let idx = self.pattern.compact_index(layer, kv_head);
            let (kr, vr) = match self.pattern.kind(layer, kv_head) {
                HeadKind::Dense => {
                    let page = page.expect("a dense head exists, so its page was checked");
                    self.dense[layer].kv_rows_mut(page, idx, pos % self.config.page_tokens)?
                }
                HeadKind::Streaming => match streaming_row {
                    Some(row) => self.streaming[layer].kv_rows_mut(view.slot, idx, row)?,
                    None => continue,
                },
            };
            kr.copy_from_slice(&k[src.clone()]);
            vr.copy_from_slice(&v[src]);
        }
        Ok(())
    }

    /// The key row (`D` elements) of token `pos` of `kv_head` in `layer` for a sequence.
    /// `TokenNotStored` if `pos >= view.len` or a streaming head no longer holds `pos`;
    /// `InvalidArgument` for a position past `u32`.
    pub fn key(
        &self,
        layer: usize,
        view: &SequenceView<'_>,
        kv_head: usize,
        pos: usize,
    ) -> Result<&[E]> {
        Ok(self.token(layer, view, kv_head, pos)?.0)
    }

    /// The value row of token `pos`, as [`key`](Self::key).
    pub fn value(
        &self,
        layer: usize,
        view: &SequenceView<'_>,
        kv_head: usize,
        pos: usize,
    ) -> Result<&[E]> {
        Ok(self.token(layer, view, kv_head, pos)?.1)
    }

    /// Key and value rows of token `pos`, as [`key`](Self::key).
    pub fn token(
        &self,
        layer: usize,
        view: &SequenceView<'_>,
        kv_head: usize,
        pos: usize,
    ) -> Result<(&[E], &[E])> {
        check_index("layer", layer, self.dense.len())?;
        check_index("kv head", kv_head, self.pattern.geometry().kv_heads())?;
        let idx = self.pattern.compact_index(layer, kv_head);
        match self.pattern.kind(layer, kv_head) {
            HeadKind::Dense => {
                let page = self
                    .dense_page_of(layer, view, pos)?
                    .expect("layer has a dense head");
                let t = pos % self.config.page_tokens;
                let c = &self.dense[layer];
                Ok((c.key(page, idx, t)?, c.value(page, idx, t)?))
            }
            HeadKind::Streaming => {
                let row = self.streaming_row_of(layer, view, pos)?.ok_or(
                    LserveError::TokenNotStored {
                        position: pos,
                        len: view.len,
                    },
                )?;
                let c = &self.streaming[layer];
                Ok((c.key(view.slot, idx, row)?, c.value(view.slot, idx, row)?))
            }
        }
    }

    /// Checks what [`write_token`](Self::write_token) checks, writing nothing: a caller that
    /// writes several tokens checks them all first, so that its failure changes nothing.
    pub(crate) fn check_write(
        &self,
        layer: usize,
        view: &SequenceView<'_>,
        pos: usize,
    ) -> Result<()> {
        check_index("layer", layer, self.dense.len())?;
        self.dense_page_of(layer, view, pos)?;
        self.streaming_row_of(layer, view, pos)?;
        Ok(())
    }

    /// Checks that layer `layer` holds everything of a sequence a decode step reads or writes:
    /// every page of its block table below the dense pool's capacity (if the layer has dense
    /// heads: `PageOutOfRange`) and its slot below the streaming store's (if it has streaming
    /// heads: `InvalidArgument`).
    pub(crate) fn check_sequence(&self, layer: usize, view: &SequenceView<'_>) -> Result<()> {
        check_index("layer", layer, self.dense.len())?;
        if self.pattern.dense_heads(layer) > 0 {
            let capacity = self.dense[layer].layout.capacity;
            if let Some(&page) = view.block_table.pages().iter().find(|&&p| p >= capacity) {
                return Err(LserveError::PageOutOfRange { page, capacity });
            }
        }
        let layout = self.streaming[layer].layout;
        if layout.heads > 0 {
            check_index("slot", view.slot as usize, layout.slots as usize)?;
        }
        Ok(())
    }

    /// The checked physical page of `pos` if `layer` has dense heads (`None` otherwise).
    fn dense_page_of(
        &self,
        layer: usize,
        view: &SequenceView<'_>,
        pos: usize,
    ) -> Result<Option<u32>> {
        check_position(view, pos)?;
        if self.pattern.dense_heads(layer) == 0 {
            return Ok(None);
        }
        let page = view.block_table.physical(pos / self.config.page_tokens)?;
        let capacity = self.dense[layer].layout.capacity;
        if page >= capacity {
            return Err(LserveError::PageOutOfRange { page, capacity });
        }
        Ok(Some(page))
    }

    /// The checked streaming row of `pos` if `layer` has streaming heads and `pos` is held at
    /// the view's length (`None` otherwise).
    fn streaming_row_of(
        &self,
        layer: usize,
        view: &SequenceView<'_>,
        pos: usize,
    ) -> Result<Option<usize>> {
        let position = check_position(view, pos)?;
        let layout = self.streaming[layer].layout;
        if layout.heads == 0 {
            return Ok(None);
        }
        check_index("slot", view.slot as usize, layout.slots as usize)?;
        let (sink, local) = (self.config.sink_tokens, self.config.local_tokens);
        if !StreamingStore::is_resident(pos, view.len, sink, local) {
            return Ok(None);
        }
        Ok(Some(layout.row_of_token(position) as usize))
    }
}

/// `pos` as the device layouts' `u32` position: `TokenNotStored` unless `pos < view.len`,
/// `InvalidArgument` for a position past `u32` (never truncated).
fn check_position(view: &SequenceView<'_>, pos: usize) -> Result<u32> {
    if pos >= view.len {
        return Err(LserveError::TokenNotStored {
            position: pos,
            len: view.len,
        });
    }
    u32::try_from(pos).map_err(|_| LserveError::InvalidArgument {
        what: "pos",
        reason: format!("token position {pos} does not fit u32"),
    })
}

fn check_index(what: &'static str, index: usize, bound: usize) -> Result<()> {
    if index >= bound {
        return Err(LserveError::InvalidArgument {
            what,
            reason: format!("{index} is not below {bound}"),
        });
    }
    Ok(())
}
