//! Masking: which KV blocks a kernel's query tiles visit ([`Mask`]: the heads' patterns alone,
//! or intersected with caller block masks), and the element masks of partially visible blocks
//! ([`apply`]).
//!
//! The two [`Mask`] types are the kernels of [`super`]: [`HeadPattern`] for launches without
//! caller masks (tiles of [`TILE_Q_BLOCKS`](lserve_abi::prefill::TILE_Q_BLOCKS) query blocks,
//! one for the kernels that write the log-sum-exp), [`BlockMask`] for launches with them (tiles
//! of [`MASKED_TILE_Q_BLOCKS`]).
//!
//! Element masks: only blocks that [`Window::needs_mask`] flags come to [`apply`]: the diagonal
//! (causal edge, sequence end) and, for streaming heads, blocks crossing the sink edge or the
//! local window's edge. Invisible scores become `-inf`, so they weigh `2^-inf = 0` in the
//! softmax.

use lserve_abi::prefill::{mask_words_per_row, PrefillWorkItem, MASKED_TILE_Q_BLOCKS};

use super::block_iter::{TileBlocks, TileMask, TileSpan, Window};
use super::tiles::S_TILES;
use crate::mma::{c_coord, FragC};
use crate::unroll8;

/// The block-level mask of a kernel whose query tiles are `N` query blocks: which KV blocks a
/// tile visits and in which order ([`Mask::walk`]), and the softmax that goes with the kernel's
/// tile shape.
pub trait Mask<const N: usize>: Copy {
    /// Whether the online softmax is the latency-tuned one (`RowSoftmax::update::<true>`, one
    /// rescale for both row tiles, skipped when no maximum moved) or the plain one (measured
    /// faster for the 64-row kernel; prefill DESIGN.md).
    const LATENCY_TUNED_SOFTMAX: bool;

    /// This kernel's mask from the launch's mask argument (`words`, unread without caller masks).
    fn new(words: *const u32) -> Self;

    /// Walks the KV blocks of query head `head`'s tile of `item` (query blocks
    /// `item.q_block .. + blocks`, pattern `window`) for a warp of query block
    /// `warp_block` (in the tile), one block ahead: calls `start(first)` with the walk's first
    /// block once, then `step(i, kv_block, next, visited, &q)` per block `i` of the walk, with
    /// the block after it (`None` for the last) and whether the warp's query block visits it
    /// (warp-uniform; in a two-block tile a block may be visited by one query block only); `q`
    /// is what `start` returned.
    ///
    /// # Safety
    /// `1 <= blocks <= N`, the query blocks of the tile exist in the sequence; with caller masks,
    /// every mask row of the tile holds `mask_words_per_row(item.seq_len)` words.
    unsafe fn walk<Q>(
        self,
        item: &PrefillWorkItem,
        head: u32,
        window: Window,
        blocks: u32,
        warp_block: u32,
        start: impl FnOnce(u32) -> Q,
        step: impl FnMut(u32, u32, Option<u32>, bool, &Q),
    );
}

/// No caller masks: the heads' causal or Λ patterns alone, for tiles of two query blocks (one
/// for the kernels that write the log-sum-exp).
/// The union of the tile's sets is two ranges, so block `i` of the walk is arithmetic in `i`
/// ([`TileSpan`]).
#[derive(Clone, Copy)]
pub struct HeadPattern;

impl<const N: usize> Mask<N> for HeadPattern {
    const LATENCY_TUNED_SOFTMAX: bool = true;

    #[inline(always)]
    fn new(_words: *const u32) -> Self {
        Self
    }

    #[inline(always)]
    unsafe fn walk<Q>(
        self,
        item: &PrefillWorkItem,
        _head: u32,
        window: Window,
        blocks: u32,
        warp_block: u32,
        start: impl FnOnce(u32) -> Q,
        mut step: impl FnMut(u32, u32, Option<u32>, bool, &Q),
    ) {
        let span = TileSpan::new(window, item.q_block, blocks);
        let q = start(span.kv_block(0));
        let visitor = span.visitor(window, item.q_block + warp_block, warp_block < blocks);
        let mut i = 0;
        while i < span.len() {
            let kv_block = span.kv_block(i);
            let next = (i + 1 < span.len()).then(|| span.kv_block(i + 1));
            step(i, kv_block, next, visitor.visits(&span, kv_block), &q);
            i += 1;
        }
    }
}

/// Caller block masks (a bit per KV block, a row per (query head, query block)) intersected
/// with the heads' patterns, the diagonal kept, for tiles of one query block: the set bits,
/// walked as a bitset ([`TileBlocks`]), every one visited by the whole tile.
#[derive(Clone, Copy)]
pub struct BlockMask {
    /// The launch's mask rows.
    words: *const u32,
}

impl Mask<{ MASKED_TILE_Q_BLOCKS as usize }> for BlockMask {
    const LATENCY_TUNED_SOFTMAX: bool = false;

    #[inline(always)]
    fn new(words: *const u32) -> Self {
        Self { words }
    }

    #[inline(always)]
    unsafe fn walk<Q>(
        self,
        item: &PrefillWorkItem,
        head: u32,
        window: Window,
        blocks: u32,
        _warp_block: u32,
        start: impl FnOnce(u32) -> Q,
        mut step: impl FnMut(u32, u32, Option<u32>, bool, &Q),
    ) {
        let rows = TileMask {
            words: self.words,
            row: item.mask_row + head * item.mask_head_stride,
            row_words: mask_words_per_row(item.seq_len),
        };
        // SAFETY: forwarded: the rows hold `mask_words_per_row(seq_len)` words, one per 32 KV
        // blocks of the sequence, and the tile's query block is below that count.
        let mut walk = unsafe { TileBlocks::<1>::new(window, item.q_block, blocks, rows) };
        // The walk yields at least the tile's diagonal block.
        let mut current = walk.next();
        let q = start(current.map_or(item.q_block, |b| b.kv_block));
        let mut ahead = walk.next();
        let mut i = 0;
        while let Some(block) = current {
            step(i, block.kv_block, ahead.map(|b| b.kv_block), true, &q);
            (current, ahead) = (ahead, walk.next());
            i += 1;
        }
    }
}

/// Sets to `-inf` every score of this lane's `S` accumulators whose (query, key) pair `window`
/// hides. `q_first` is the position of the warp's first query row, `k_first` of the block's
/// first key (both sequence-local).
#[inline(always)]
pub fn apply(s: &mut [FragC; S_TILES], window: Window, q_first: u32, k_first: u32, lane: u32) {
    unroll8!(n in 0..S_TILES => {
        unroll8!(i in 0..4 => {
            let (row, col) = c_coord(lane, i as u32);
            let (t, j) = (q_first + row, k_first + 8 * n as u32 + col);
            if !window.visible(t, j) {
                s[n].regs[i] = f32::NEG_INFINITY;
            }
        });
    });
}
