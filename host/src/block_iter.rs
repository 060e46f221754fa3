//! What each attention kernel visits: KV blocks per (head, query block) at prefill, tokens or
//! pages per (sequence, head) at decode.
//!
//! Prefill works on blocks of [`BLOCK_Q`] queries and [`BLOCK_KV`] keys (`lserve_abi::prefill`).
//! Query block `qb` of a sequence of `seq_len` tokens holds positions
//! `qb * BLOCK_Q .. min((qb + 1) * BLOCK_Q, seq_len)`, KV blocks likewise. A dense head sees key
//! `j` from query `t` iff `j <= t` (causal); a streaming head iff also `j < sink_tokens` or
//! `t - j < local_tokens` (the Λ mask, [`token_visible`]). The iterator yields exactly the KV
//! blocks holding at least one visible (query, key) pair, ascending, each once, and flags those
//! that also hold an invisible pair (the kernel masks elements there). A caller [`BlockMask`]
//! is intersected with this, the diagonal block always kept.

use std::num::NonZeroUsize;
use std::ops::Range;

use crate::error::{checked_elements, LserveError, Result};
use crate::head_pattern::HeadKind;
use crate::paging::{BlockTable, PageId, StreamingStore};

/// Queries per prefill block.
pub const BLOCK_Q: usize = lserve_abi::prefill::BLOCK_Q as usize;
/// Keys per prefill block.
pub const BLOCK_KV: usize = lserve_abi::prefill::BLOCK_KV as usize;

// The diagonal rule (query block `qb` always keeps KV block `qb`) relies on equal block sizes.
const _: () = assert!(BLOCK_Q == BLOCK_KV);

/// Blocks covering `seq_len` tokens (`ceil(seq_len / 64)`), for queries and keys alike.
pub const fn num_blocks(seq_len: usize) -> usize {
    seq_len.div_ceil(BLOCK_KV)
}

/// Whether query position `t` sees key position `j` for a head of `kind` (token-level
/// definition: causal for dense heads, the Λ mask for streaming heads).
pub const fn token_visible(kind: HeadKind, t: usize, j: usize, sink: usize, local: usize) -> bool {
    match kind {
        HeadKind::Dense => j <= t,
        HeadKind::Streaming => j <= t && (j < sink || t - j < local),
    }
}

/// How much of a (query block, KV block) tile is visible.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockCoverage {
    /// No visible pair: the block is skipped.
    Empty,
    /// Some pairs visible, some not: visited with element masking.
    Partial,
    /// Every pair visible: visited without masking.
    Full,
}

/// The shape of one sequence's prefill for one head: its kind, length and Λ parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillShape {
    /// Dense (causal) or streaming (Λ).
    pub kind: HeadKind,
    /// Tokens in the sequence (> 0).
    pub seq_len: usize,
    /// Sink tokens (streaming heads; may be 0).
    pub sink_tokens: usize,
    /// Local window (streaming heads; > 0).
    pub local_tokens: usize,
}

impl PrefillShape {
    /// Checks `seq_len > 0` and, for streaming heads, `local_tokens > 0`.
    pub fn validate(&self) -> Result<()> {
        if self.seq_len == 0 {
            return Err(LserveError::Empty("prefill sequence"));
        }
        if self.kind == HeadKind::Streaming && self.local_tokens == 0 {
            return Err(LserveError::InvalidConfig {
                field: "local_tokens",
                reason: "must be > 0".into(),
            });
        }
        Ok(())
    }

    /// Query (and KV) blocks of the sequence.
    pub const fn num_blocks(&self) -> usize {
        num_blocks(self.seq_len)
    }

    /// The coverage of the (query block `q_block`, KV block `kv_block`) tile, clipped to the
    /// sequence; `Empty` for blocks past its end (any block index, however large).
    pub fn coverage(&self, q_block: usize, kv_block: usize) -> BlockCoverage {
        let n = self.seq_len;
        let blocks = self.num_blocks();
        if q_block >= blocks || kv_block >= blocks || kv_block > q_block {
            return BlockCoverage::Empty; // past the end, or no causal pair
        }
        // Both blocks start inside the sequence, so these neither overflow nor underflow.
        let (q0, k0) = (q_block * BLOCK_Q, kv_block * BLOCK_KV);
        let q_last = q0 + (n - q0).min(BLOCK_Q) - 1;
        let k_last = k0 + (n - k0).min(BLOCK_KV) - 1;
        let causal_full = k_last <= q0;
        let (any, all) = match self.kind {
            HeadKind::Dense => (true, causal_full),
            HeadKind::Streaming => {
                let (sink, local) = (self.sink_tokens, self.local_tokens);
                // The closest causal pair: distance 0 if the ranges overlap.
                let min_dist = q0.saturating_sub(k_last);
                let any = k0 < sink || min_dist < local;
                // The farthest pair of a non-sink key: the first such key and the last query.
                let first_non_sink = k0.max(sink);
                let all =
                    causal_full && (first_non_sink > k_last || q_last - first_non_sink < local);
                (any, all)
            }
        };
        match (any, all) {
            (false, _) => BlockCoverage::Empty,
            (true, false) => BlockCoverage::Partial,
            (true, true) => BlockCoverage::Full,
        }
    }
}

/// A KV block to visit at prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrefillBlock {
    /// The KV block index (keys `kv_block * BLOCK_KV ..`).
    pub kv_block: usize,
    /// Whether some (query, key) pair of the tile is invisible, so the kernel must mask
    /// elements (`BlockCoverage::Partial`).
    pub needs_mask: bool,
}

/// The KV blocks one (head, query block) visits at prefill, ascending.
///
/// ```
/// use lserve::block_iter::{prefill_blocks, PrefillBlock, PrefillShape};
/// use lserve::head_pattern::HeadKind;
/// // Streaming head, 1000 tokens, 64 sinks, 128 local: query block 10 (positions 640..704)
/// // sees the sink block 0 and keys 513..=703 (blocks 8, 9, 10).
/// let shape = PrefillShape { kind: HeadKind::Streaming, seq_len: 1000, sink_tokens: 64, local_tokens: 128 };
/// let blocks: Vec<PrefillBlock> = prefill_blocks(&shape, 10, None)?.collect();
/// let ids: Vec<usize> = blocks.iter().map(|b| b.kv_block).collect();
/// assert_eq!(ids, [0, 8, 9, 10]);
/// assert!(!blocks[0].needs_mask && blocks[1].needs_mask && blocks[3].needs_mask);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug)]
pub struct PrefillBlocks<'a> {
    shape: PrefillShape,
    q_block: usize,
    mask: Option<BlockMaskRow<'a>>,
    /// The next candidate block.
    next: usize,
    /// Candidates are `0..skip_from` and `skip_to..end`.
    skip_from: usize,
    skip_to: usize,
    end: usize,
}

/// The KV blocks query block `q_block` of a head of shape `shape` visits, optionally
/// intersected with a caller block-mask row (the diagonal block is kept regardless).
///
/// Errors: the shape's own rules, `InvalidArgument` if `q_block` is past the sequence,
/// `ShapeMismatch` if the mask row is not `num_blocks(seq_len)` wide.
pub fn prefill_blocks<'a>(
    shape: &PrefillShape,
    q_block: usize,
    mask: Option<BlockMaskRow<'a>>,
) -> Result<PrefillBlocks<'a>> {
    shape.validate()?;
    let n = shape.num_blocks();
    if q_block >= n {
        return Err(LserveError::InvalidArgument {
            what: "q_block",
            reason: format!("{q_block} is not below {n} blocks"),
        });
    }
    if let Some(row) = &mask {
        if row.kv_blocks != n {
            return Err(LserveError::ShapeMismatch {
                what: "block mask row (KV blocks)",
                expected: n,
                actual: row.kv_blocks,
            });
        }
    }
    let end = q_block + 1;
    let (skip_from, skip_to) = match shape.kind {
        HeadKind::Dense => (end, end),
        HeadKind::Streaming => {
            let sink_end = shape.sink_tokens.div_ceil(BLOCK_KV).min(end);
            let first_local_key = (q_block * BLOCK_Q + 1).saturating_sub(shape.local_tokens);
            (sink_end, (first_local_key / BLOCK_KV).max(sink_end))
        }
    };
    Ok(PrefillBlocks {
        shape: *shape,
        q_block,
        mask,
        next: 0,
        skip_from,
        skip_to,
        end,
    })
}

impl Iterator for PrefillBlocks<'_> {
    type Item = PrefillBlock;

    fn next(&mut self) -> Option<PrefillBlock> {
        while self.next < self.end {
            if self.next == self.skip_from && self.skip_to > self.skip_from {
                self.next = self.skip_to;
                continue;
            }
            let kb = self.next;
            self.next += 1;
            let kept = kb == self.q_block || self.mask.as_ref().is_none_or(|m| m.contains(kb));
            if !kept {
                continue;
            }
            match self.shape.coverage(self.q_block, kb) {
                BlockCoverage::Empty => continue,
                c => {
                    return Some(PrefillBlock {
                        kv_block: kb,
                        needs_mask: c == BlockCoverage::Partial,
                    })
                }
            }
        }
        None
    }
}

/// A caller block mask for one sequence's prefill: per query head, per query block, a bit per
/// KV block (bit set = may visit). Intersected with each head's pattern; the diagonal is kept
/// regardless. Stored as `u32` words, `[q_heads][q_blocks][words_per_row]`, bit `kb % 32` of
/// word `kb / 32` for KV block `kb`; bits past the last block are zero.
///
/// ```
/// use lserve::block_iter::BlockMask;
/// let mut m = BlockMask::new(2, 300, false)?; // 2 query heads, 5 blocks
/// m.set(1, 4, 2, true)?;
/// assert!(m.get(1, 4, 2)?);
/// assert!(!m.get(0, 4, 2)?);
/// assert!(m.set(1, 4, 5, true).is_err()); // KV block out of range
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMask {
    q_heads: usize,
    blocks: usize,
    words_per_row: usize,
    words: Vec<u32>,
}

/// One (query head, query block) row of a [`BlockMask`].
#[derive(Clone, Copy, Debug)]
pub struct BlockMaskRow<'a> {
    words: &'a [u32],
    kv_blocks: usize,
}

impl BlockMaskRow<'_> {
    /// Whether KV block `kv_block` is set (false past the row).
    pub fn contains(&self, kv_block: usize) -> bool {
        kv_block < self.kv_blocks && self.words[kv_block / 32] >> (kv_block % 32) & 1 == 1
    }

    /// KV blocks in the row.
    pub fn kv_blocks(&self) -> usize {
        self.kv_blocks
    }
}

impl BlockMask {
    /// A mask for `q_heads` query heads and a sequence of `seq_len` tokens, every bit `fill`.
    /// `Empty` for no heads or no tokens; `InvalidArgument` if the mask's size overflows.
    pub fn new(q_heads: usize, seq_len: usize, fill: bool) -> Result<Self> {
        Self::from_fn(q_heads, seq_len, |_, _, _| fill)
    }

    /// A mask whose bit (head, query block, KV block) is `f(head, q_block, kv_block)`.
    pub fn from_fn(
        q_heads: usize,
        seq_len: usize,
        mut f: impl FnMut(usize, usize, usize) -> bool,
    ) -> Result<Self> {
        let mut m = Self::empty(q_heads, seq_len)?;
        for h in 0..q_heads {
            for qb in 0..m.blocks {
                for kb in 0..m.blocks {
                    if f(h, qb, kb) {
                        let i = m.word(h, qb, kb);
                        m.words[i] |= 1 << (kb % 32);
                    }
                }
            }
        }
        Ok(m)
    }

    /// A mask from its device words (`[q_heads][q_blocks][words_per_row]`); checks the length
    /// (`ShapeMismatch`) and that no bit past the last KV block is set (`InvalidArgument`).
    pub fn from_words(q_heads: usize, seq_len: usize, words: Vec<u32>) -> Result<Self> {
        let mut m = Self::empty(q_heads, seq_len)?;
        if words.len() != m.words.len() {
            return Err(LserveError::ShapeMismatch {
                what: "block mask words",
                expected: m.words.len(),
                actual: words.len(),
            });
        }
        let tail_bits = m.blocks % 32;
        if tail_bits != 0 {
            let stray = words
                .chunks(m.words_per_row)
                .any(|row| row[m.words_per_row - 1] >> tail_bits != 0);
            if stray {
                return Err(LserveError::InvalidArgument {
                    what: "block mask words",
                    reason: format!("bits set past KV block {}", m.blocks - 1),
                });
            }
        }
        m.words = words;
        Ok(m)
    }

    fn empty(q_heads: usize, seq_len: usize) -> Result<Self> {
        if q_heads == 0 {
            return Err(LserveError::Empty("block mask (0 query heads)"));
        }
        if seq_len == 0 {
            return Err(LserveError::Empty("block mask (0 tokens)"));
        }
        let blocks = num_blocks(seq_len);
        let words_per_row = blocks.div_ceil(32);
        let words =
            checked_elements::<u32>(&[q_heads, blocks, words_per_row]).ok_or_else(|| {
                LserveError::InvalidArgument {
                    what: "block mask",
                    reason: format!("{q_heads} query heads x {seq_len} tokens overflow its size"),
                }
            })?;
        Ok(Self {
            q_heads,
            blocks,
            words_per_row,
            words: vec![0; words],
        })
    }

    fn word(&self, head: usize, q_block: usize, kv_block: usize) -> usize {
        (head * self.blocks + q_block) * self.words_per_row + kv_block / 32
    }

    fn check(&self, head: usize, q_block: usize, kv_block: usize) -> Result<()> {
        for (what, v, bound) in [
            ("query head", head, self.q_heads),
            ("q_block", q_block, self.blocks),
            ("kv_block", kv_block, self.blocks),
        ] {
            if v >= bound {
                return Err(LserveError::InvalidArgument {
                    what,
                    reason: format!("{v} is not below {bound}"),
                });
            }
        }
        Ok(())
    }

    /// Query heads.
    pub fn q_heads(&self) -> usize {
        self.q_heads
    }

    /// Query blocks (= KV blocks) of the sequence.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// `u32` words per row.
    pub fn words_per_row(&self) -> usize {
        self.words_per_row
    }

    /// The device words, `[q_heads][q_blocks][words_per_row]`.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Bit (head, query block, KV block).
    pub fn get(&self, head: usize, q_block: usize, kv_block: usize) -> Result<bool> {
        self.check(head, q_block, kv_block)?;
        Ok(self.words[self.word(head, q_block, kv_block)] >> (kv_block % 32) & 1 == 1)
    }

    /// Sets bit (head, query block, KV block) to `on`.
    pub fn set(&mut self, head: usize, q_block: usize, kv_block: usize, on: bool) -> Result<()> {
        self.check(head, q_block, kv_block)?;
        let i = self.word(head, q_block, kv_block);
        let bit = 1u32 << (kv_block % 32);
        if on {
            self.words[i] |= bit;
        } else {
            self.words[i] &= !bit;
        }
        Ok(())
    }

    /// The row of (head, query block), to pass to [`prefill_blocks`].
    pub fn row(&self, head: usize, q_block: usize) -> Result<BlockMaskRow<'_>> {
        self.check(head, q_block, 0)?;
        let start = self.word(head, q_block, 0);
        Ok(BlockMaskRow {
            words: &self.words[start..start + self.words_per_row],
            kv_blocks: self.blocks,
        })
    }

    /// Checks the mask fits a prefill of `q_heads` query heads over `seq_len` tokens
    /// (`ShapeMismatch` otherwise).
    pub fn check_shape(&self, q_heads: usize, seq_len: usize) -> Result<()> {
        if self.q_heads != q_heads {
            return Err(LserveError::ShapeMismatch {
                what: "block mask (query heads)",
                expected: q_heads,
                actual: self.q_heads,
            });
        }
        if self.blocks != num_blocks(seq_len) {
            return Err(LserveError::ShapeMismatch {
                what: "block mask (blocks)",
                expected: num_blocks(seq_len),
                actual: self.blocks,
            });
        }
        Ok(())
    }
}

/// A token a streaming head holds at decode: its position and its row in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamingToken {
    /// Token position in the sequence.
    pub pos: usize,
    /// Row in the (slot, head) of the streaming store.
    pub row: usize,
}

/// The tokens a streaming head attends to at decode, ascending by position: the sinks
/// `0..min(sink, len)` and the ring `max(sink, len - local)..len` (exactly the Λ mask for the
/// query at `len - 1`).
///
/// ```
/// use lserve::block_iter::streaming_decode_tokens;
/// let toks: Vec<_> = streaming_decode_tokens(10, 2, 4)?.map(|t| (t.pos, t.row)).collect();
/// assert_eq!(toks, [(0, 0), (1, 1), (6, 2), (7, 3), (8, 4), (9, 5)]);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug)]
pub struct StreamingDecodeTokens {
    positions: std::iter::Chain<Range<usize>, Range<usize>>,
    sink_tokens: usize,
    local_tokens: NonZeroUsize,
}

/// The tokens a streaming head of a sequence of length `len` (after this step's token)
/// attends to. `Empty` for `len == 0`; `InvalidConfig` for `local_tokens == 0`.
pub fn streaming_decode_tokens(
    len: usize,
    sink_tokens: usize,
    local_tokens: usize,
) -> Result<StreamingDecodeTokens> {
    if len == 0 {
        return Err(LserveError::Empty("decode sequence"));
    }
    let ring = NonZeroUsize::new(local_tokens).ok_or_else(|| LserveError::InvalidConfig {
        field: "local_tokens",
        reason: "must be > 0".into(),
    })?;
    Ok(StreamingDecodeTokens {
        positions: StreamingStore::resident_positions(len, sink_tokens, local_tokens),
        sink_tokens,
        local_tokens: ring,
    })
}

impl Iterator for StreamingDecodeTokens {
    type Item = StreamingToken;

    fn next(&mut self) -> Option<StreamingToken> {
        let pos = self.positions.next()?;
        let row = StreamingStore::row_in(pos, self.sink_tokens, self.local_tokens);
        Some(StreamingToken { pos, row })
    }
}

/// A page a dense head visits at decode.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DensePage {
    /// Logical page number in the sequence.
    pub logical: usize,
    /// Physical page id (from the block table).
    pub physical: PageId,
    /// Token positions of the page that exist (the newest page may be partial).
    pub tokens: Range<usize>,
}

/// The pages a dense head visits at decode, ascending by logical page.
///
/// ```
/// use lserve::block_iter::dense_decode_pages;
/// use lserve::paging::BlockTable;
/// let table = BlockTable::from_pages(vec![4, 0, 9]);
/// let all: Vec<_> = dense_decode_pages(&table, 40, 16, None)?.map(|p| (p.physical, p.tokens)).collect();
/// assert_eq!(all, [(4, 0..16), (0, 16..32), (9, 32..40)]);
/// let some: Vec<_> = dense_decode_pages(&table, 40, 16, Some(&[0, 2]))?.map(|p| p.physical).collect();
/// assert_eq!(some, [4, 9]);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug)]
pub struct DenseDecodePages<'a> {
    table: &'a BlockTable,
    len: usize,
    page_tokens: usize,
    selection: Option<&'a [usize]>,
    next: usize,
    pages: usize,
}

/// The pages a dense head of a sequence of length `len` visits: all its pages, or the given
/// selection of logical pages (strictly ascending, each below `ceil(len / page_tokens)`).
///
/// Errors: `Empty` for `len == 0`, `InvalidConfig` for `page_tokens == 0`, `InvalidArgument` if
/// the block table lacks pages or the selection is not strictly ascending and in range.
pub fn dense_decode_pages<'a>(
    table: &'a BlockTable,
    len: usize,
    page_tokens: usize,
    selection: Option<&'a [usize]>,
) -> Result<DenseDecodePages<'a>> {
    if len == 0 {
        return Err(LserveError::Empty("decode sequence"));
    }
    if page_tokens == 0 {
        return Err(LserveError::InvalidConfig {
            field: "page_tokens",
            reason: "must be > 0".into(),
        });
    }
    let pages = len.div_ceil(page_tokens);
    if table.len() < pages {
        return Err(LserveError::InvalidArgument {
            what: "block table",
            reason: format!(
                "{} pages for a sequence of {len} tokens ({pages} pages)",
                table.len()
            ),
        });
    }
    if let Some(sel) = selection {
        if sel.windows(2).any(|w| w[0] >= w[1]) || sel.last().is_some_and(|&p| p >= pages) {
            return Err(LserveError::InvalidArgument {
                what: "page selection",
                reason: format!("{sel:?} is not strictly ascending below {pages}"),
            });
        }
    }
    let count = selection.map_or(pages, <[usize]>::len);
    Ok(DenseDecodePages {
        table,
        len,
        page_tokens,
        selection,
        next: 0,
        pages: count,
    })
}

impl Iterator for DenseDecodePages<'_> {
    type Item = DensePage;

    fn next(&mut self) -> Option<DensePage> {
        if self.next >= self.pages {
            return None;
        }
        let logical = self.selection.map_or(self.next, |s| s[self.next]);
        self.next += 1;
        // `logical` is a page of the sequence, so `start < len`: the end never passes `usize`.
        let start = logical * self.page_tokens;
        Some(DensePage {
            logical,
            physical: self.table.pages()[logical],
            tokens: start..start + (self.len - start).min(self.page_tokens),
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.pages - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for DenseDecodePages<'_> {}
