//! Which KV blocks a (query head, query block) visits, and which of them need element masks.
//!
//! A head's pattern is a [`Window`]: key `j` is visible from query `t` iff
//! `j <= t && (j < sink || t - j < local)`. Streaming heads use their sink / local tokens (the Λ
//! mask); dense heads use `sink = local = u32::MAX`, which leaves plain causal attention — so the
//! kernel never branches on the head kind.
//!
//! At block level the pattern of query block `qb` is two ranges of KV blocks: the sink blocks
//! `0 .. sink_end` and the local range `local_start ..= qb` (for a dense head, `0 ..= qb`). A
//! caller block mask (a bit per KV block) is intersected with them and the diagonal block `qb`
//! is always kept ([`BlockSet`]).
//!
//! A kernel computes a *query tile* of `N` consecutive query blocks per launch block (two for
//! the unmasked kernel, one for the masked one), and walks the union of the tile's sets:
//! - with a caller mask, [`TileBlocks`] walks it as a bitset, 32 blocks per word, yielding the
//!   set bits in ascending order together with which query blocks visit each: blocks outside the
//!   union are never produced (the gap between the ranges is jumped over);
//! - without one, the union is again two ranges ([`TileSpan`]), so block `i` of the walk is
//!   arithmetic in `i`: the KV loop keeps a counter instead of the bitset walk's state (words,
//!   bits, sets, the block ahead), which leaves registers to the fragment loads.
//!
//! The warps of a query block that does not visit a yielded block skip its arithmetic.

use lserve_abi::prefill::{BLOCK_KV, BLOCK_Q};

// Query and KV blocks are the same size: the diagonal of query block `qb` is KV block `qb`, and
// the next query block's range is one KV block further ([`TileSpan`]).
const _: () = assert!(BLOCK_Q == BLOCK_KV);

/// The token-level pattern of a head: `j <= t && (j < sink || t - j < local)`.
#[derive(Clone, Copy)]
pub struct Window {
    /// Keys below this are always visible (to queries at or after them).
    pub sink: u32,
    /// A key is visible to the `local` queries starting at its own position.
    pub local: u32,
}

impl Window {
    /// Dense heads: causal attention.
    pub const CAUSAL: Self = Self {
        sink: u32::MAX,
        local: u32::MAX,
    };

    /// The pattern of a KV head whose head-map entry is `entry`: Λ with the launch's `sink` /
    /// `local` tokens for a streaming head (bit `HEAD_STREAMING`), causal otherwise.
    #[inline(always)]
    pub fn of_head(entry: u32, sink: u32, local: u32) -> Self {
        if entry & lserve_abi::decode::HEAD_STREAMING != 0 {
            Self { sink, local }
        } else {
            Self::CAUSAL
        }
    }

    /// Whether query position `t` sees key position `j`.
    #[inline(always)]
    pub fn visible(&self, t: u32, j: u32) -> bool {
        j <= t && (j < self.sink || t - j < self.local)
    }

    /// Whether KV block `kv_block` of query block `q_block` (a sequence of `seq_len` tokens)
    /// holds an invisible (query, key) pair among existing queries, i.e. needs element masks:
    /// the diagonal block always does (causal edge and sequence end); a block below it does when
    /// its non-sink keys are not all inside the window of the block's last query.
    #[inline(always)]
    pub fn needs_mask(&self, q_block: u32, kv_block: u32, seq_len: u32) -> bool {
        if kv_block == q_block {
            return true;
        }
        let k_first = kv_block * BLOCK_KV;
        let k_last = k_first + BLOCK_KV - 1; // < q_block * BLOCK_Q: every pair is causal
        let q_last = (q_block * BLOCK_Q + BLOCK_Q - 1).min(seq_len - 1);
        let first_non_sink = k_first.max(self.sink);
        let all_visible = first_non_sink > k_last || q_last - first_non_sink < self.local;
        !all_visible
    }
}

/// Bits `0 .. n` set (`n <= 32`).
#[inline(always)]
fn low_bits(n: u32) -> u32 {
    if n >= 32 {
        u32::MAX
    } else {
        (1u32 << n) - 1
    }
}

/// The bits of word `word` (blocks `32 * word ..`) for the blocks in `start .. end`.
#[inline(always)]
fn range_bits(word: u32, start: u32, end: u32) -> u32 {
    let base = 32 * word;
    let lo = start.saturating_sub(base).min(32);
    let hi = end.saturating_sub(base).min(32);
    low_bits(hi) & !low_bits(lo)
}

/// The KV blocks one (query head, query block) visits, as bit words (see the module docs).
#[derive(Clone, Copy)]
pub struct BlockSet {
    q_block: u32,
    /// Sink blocks are `0 .. sink_end` (clipped to `q_block + 1`).
    sink_end: u32,
    /// The local range is `local_start ..= q_block`.
    local_start: u32,
}

impl BlockSet {
    /// The set of query block `q_block` of a head with pattern `window` (before the caller mask).
    #[inline(always)]
    pub fn new(window: Window, q_block: u32) -> Self {
        let sink_end = window.sink.div_ceil(BLOCK_KV).min(q_block + 1);
        let first_local_key = (q_block * BLOCK_Q + 1).saturating_sub(window.local);
        let local_start = (first_local_key / BLOCK_KV).max(sink_end);
        Self {
            q_block,
            sink_end,
            local_start,
        }
    }

    /// The blocks of word `word` to visit: pattern ∩ the caller mask row `mask` (null: none),
    /// plus the diagonal.
    ///
    /// # Safety
    /// A non-null `mask` row holds word `word`.
    #[inline(always)]
    unsafe fn candidates(&self, word: u32, mask: *const u32) -> u32 {
        let pattern = range_bits(word, 0, self.sink_end)
            | range_bits(word, self.local_start, self.q_block + 1);
        let caller = if mask.is_null() {
            u32::MAX
        } else {
            // SAFETY: forwarded: the row holds `word`.
            unsafe { crate::global::load_u32(mask.add(word as usize)) }
        };
        let diagonal = range_bits(word, self.q_block, self.q_block + 1);
        (pattern & caller) | diagonal
    }

    /// The first word after `word` that may hold a block of the set: the next one, or the local
    /// range's first word when the next one lies in the gap between the sink and local ranges
    /// (no block there is visible, whatever the mask says).
    #[inline(always)]
    fn next_word(&self, word: u32) -> u32 {
        let next = word + 1;
        if 32 * next >= self.sink_end && 32 * next < self.local_start {
            self.local_start / 32
        } else {
            next
        }
    }
}

/// One KV block of a query tile's walk: its index and whether each of the tile's `N` query
/// blocks visits it.
#[derive(Clone, Copy)]
pub struct TileBlock<const N: usize> {
    /// The KV block (keys `kv_block * BLOCK_KV ..`).
    pub kv_block: u32,
    /// Whether the tile's query block `i` visits it.
    pub visits: [bool; N],
}

/// The caller block mask rows of a query tile: the mask array (null: no mask), the first query
/// block's row (a word offset) and the distance between consecutive query blocks' rows.
#[derive(Clone, Copy)]
pub struct TileMask {
    /// The mask array, or null.
    pub words: *const u32,
    /// Word offset of the first query block's row.
    pub row: u32,
    /// Words per row: query block `i` of the tile has its row at `row + i * row_words`.
    pub row_words: u32,
}

/// The KV blocks a (query head, query tile of `N` query blocks) visits: the union of its query
/// blocks' sets, ascending (see the module docs). With `N = 1` this is the plain walk over one
/// query block's set (every yielded block is visited by it).
#[derive(Clone, Copy)]
pub struct TileBlocks<const N: usize> {
    sets: [BlockSet; N],
    mask: TileMask,
    /// Query blocks of the tile that exist (`1 ..= N`); the sets of the others are empty.
    blocks: u32,
    /// The current word and, per query block, its not yet yielded bits.
    word: u32,
    bits: [u32; N],
}

impl<const N: usize> TileBlocks<N> {
    /// The walk for the tile of query blocks `q_block .. q_block + blocks` (`1 <= blocks <= N`;
    /// query blocks past the sequence's end are left out) of a head with pattern `window`,
    /// intersected with the caller mask rows `mask` (rows of blocks that do not exist are not
    /// read).
    ///
    /// # Safety
    /// With a mask, each row of an existing query block holds `row_words` readable words, and
    /// `row_words >= (q_block + blocks - 1) / 32 + 1` (the walk ends at the tile's last diagonal
    /// block).
    #[inline(always)]
    pub unsafe fn new(window: Window, q_block: u32, blocks: u32, mask: TileMask) -> Self {
        // A query block that does not exist gets the last existing one's set (then emptied by
        // `blocks`), so the walk ends at the last existing diagonal.
        let mut walk = Self {
            sets: core::array::from_fn(|i| {
                BlockSet::new(window, q_block + (i as u32).min(blocks - 1))
            }),
            mask,
            blocks,
            word: 0,
            bits: [0; N],
        };
        // SAFETY: word 0 is in every row.
        unsafe { walk.load_word(0) };
        walk
    }

    /// Whether query block `i` of the tile exists (block 0 always does).
    #[inline(always)]
    fn exists(&self, i: usize) -> bool {
        i == 0 || (i as u32) < self.blocks
    }

    /// Makes `word` the current word.
    ///
    /// # Safety
    /// `word <= sets[N - 1].q_block / 32` (every mask row holds it, see [`Self::new`]).
    #[inline(always)]
    unsafe fn load_word(&mut self, word: u32) {
        self.word = word;
        let m = self.mask;
        crate::unroll8!(i in 0..N => {
            let row = if m.words.is_null() || !self.exists(i) {
                core::ptr::null()
            } else {
                // SAFETY: the row of an existing query block lies inside the mask array.
                unsafe { m.words.add((m.row + i as u32 * m.row_words) as usize) }
            };
            // SAFETY: forwarded (a null row is not read).
            let bits = unsafe { self.sets[i].candidates(word, row) };
            self.bits[i] = if self.exists(i) { bits } else { 0 };
        });
    }
}

impl TileBlocks<1> {
    /// The number of blocks the walk yields from here, counted a word at a time (a popcount per
    /// word of the walk, the words skipped as [`Iterator::next`] skips them).
    ///
    /// # Safety
    /// As [`Self::new`] (the words of the mask rows it reads).
    #[inline(always)]
    pub unsafe fn count_blocks(mut self) -> u32 {
        let last_word = self.sets[0].q_block / 32;
        let mut count = self.bits[0].count_ones();
        while self.word < last_word {
            let next = self.sets[0].next_word(self.word).min(last_word);
            // SAFETY: `next <= last_word`.
            unsafe { self.load_word(next) };
            count += self.bits[0].count_ones();
        }
        count
    }
}

impl<const N: usize> Iterator for TileBlocks<N> {
    type Item = TileBlock<N>;

    #[inline(always)]
    fn next(&mut self) -> Option<TileBlock<N>> {
        loop {
            let mut union = 0;
            crate::unroll8!(i in 0..N => {
                union |= self.bits[i];
            });
            if union != 0 {
                let bit = union.isolate_lowest_one();
                let mut visits = [false; N];
                crate::unroll8!(i in 0..N => {
                    // With one query block, every block of the walk is its own.
                    visits[i] = N == 1 || self.bits[i] & bit != 0;
                    self.bits[i] &= !bit;
                });
                return Some(TileBlock {
                    kv_block: 32 * self.word + bit.trailing_zeros(),
                    visits,
                });
            }
            // The last set's diagonal is the last block of the union.
            let last_word = self.sets[N - 1].q_block / 32;
            if self.word >= last_word {
                return None;
            }
            // No word skipped by every set holds a block of any, so none of the union's.
            let next = self
                .sets
                .iter()
                .fold(last_word, |n, set| n.min(set.next_word(self.word)));
            // SAFETY: `next <= last_word`.
            unsafe { self.load_word(next) };
        }
    }
}

/// The KV blocks a query tile of `blocks` consecutive query blocks visits without a caller mask:
/// the union of their sets, the sink blocks `0 .. sink_end` of the last query block, then the
/// local range from the first query block's `local_start` (not below `sink_end`) to the last
/// diagonal. (Consecutive query blocks' local ranges overlap or touch: the next block's first
/// local key is 64 further, one KV block, and every range ends at its diagonal.)
///
/// Block `i` of the walk is `i`, plus the gap between the ranges once `i` reaches `sink_end`.
#[derive(Clone, Copy)]
pub struct TileSpan {
    /// Walk positions below this are the sink blocks, `i` itself.
    sink_end: u32,
    /// Added to walk positions from `sink_end` on: the local range's first block minus `sink_end`.
    gap: u32,
    /// Blocks in the walk (at least one: the first query block's diagonal).
    len: u32,
}

impl TileSpan {
    /// The walk of the tile of query blocks `q_block .. q_block + blocks` (`blocks >= 1`) of a
    /// head with pattern `window`.
    #[inline(always)]
    pub fn new(window: Window, q_block: u32, blocks: u32) -> Self {
        let first = BlockSet::new(window, q_block);
        let last = BlockSet::new(window, q_block + blocks - 1);
        let local_first = first.local_start.max(last.sink_end);
        Self {
            sink_end: last.sink_end,
            gap: local_first - last.sink_end,
            len: last.sink_end + (last.q_block + 1 - local_first),
        }
    }

    /// Blocks in the walk.
    #[inline(always)]
    pub fn len(&self) -> u32 {
        self.len
    }

    /// The position in the walk of `kv_block`, a block of the walk (inverse of [`Self::kv_block`]).
    #[inline(always)]
    pub fn position(&self, kv_block: u32) -> u32 {
        if kv_block < self.sink_end {
            kv_block
        } else {
            kv_block - self.gap
        }
    }

    /// The KV block at position `i < len` of the walk (ascending in `i`).
    #[inline(always)]
    pub fn kv_block(&self, i: u32) -> u32 {
        if i < self.sink_end {
            i
        } else {
            i + self.gap
        }
    }

    /// Which of the walk's blocks query block `q_block` (of the tile) visits; `exists` false for
    /// a query block past the sequence's end (it visits none).
    #[inline(always)]
    pub fn visitor(&self, window: Window, q_block: u32, exists: bool) -> SpanVisitor {
        SpanVisitor {
            end: if exists { q_block + 1 } else { 0 },
            local_start: BlockSet::new(window, q_block).local_start,
        }
    }
}

/// Which blocks of a [`TileSpan`] one query block of its tile visits: two registers per warp.
#[derive(Clone, Copy)]
pub struct SpanVisitor {
    /// Its diagonal plus one (0: a query block that does not exist).
    end: u32,
    /// Its local range's first block.
    local_start: u32,
}

impl SpanVisitor {
    /// Whether it visits `kv_block`, a block of `span`: up to its diagonal, a sink block of the
    /// span or one of its own local range. (The tile's sink blocks below its own diagonal are its
    /// own sink blocks: a query block's sink range ends only at its diagonal.)
    #[inline(always)]
    pub fn visits(&self, span: &TileSpan, kv_block: u32) -> bool {
        kv_block < self.end && (kv_block < span.sink_end || kv_block >= self.local_start)
    }
}
