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
//! is always kept. [`KvBlocks`] walks that set as a bitset, 32 blocks per word, yielding the set
//! bits in ascending order: blocks outside it are never produced (the gap between the ranges is
//! jumped over), so the kernel's loop body has no "skip" branch.

use lserve_abi::prefill::{BLOCK_KV, BLOCK_Q};

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

/// The KV blocks one (query head, query block) visits, ascending (see the module docs).
///
/// Cloning gives an independent walk over the same blocks: the kernel runs one walk ahead to
/// issue loads and one to compute.
#[derive(Clone, Copy)]
pub struct KvBlocks {
    q_block: u32,
    /// Sink blocks are `0 .. sink_end` (clipped to `q_block + 1`).
    sink_end: u32,
    /// The local range is `local_start ..= q_block`.
    local_start: u32,
    /// The caller mask row of this (query head, query block), or null for none.
    mask: *const u32,
    /// The current word and its not yet yielded bits.
    word: u32,
    bits: u32,
}

impl KvBlocks {
    /// The walk for query block `q_block` of a head with pattern `window`, intersected with the
    /// caller mask row `mask` (null: no mask).
    ///
    /// # Safety
    /// A non-null `mask` points to at least `q_block / 32 + 1` readable words.
    #[inline(always)]
    pub unsafe fn new(window: Window, q_block: u32, mask: *const u32) -> Self {
        let sink_end = window.sink.div_ceil(BLOCK_KV).min(q_block + 1);
        let first_local_key = (q_block * BLOCK_Q + 1).saturating_sub(window.local);
        let local_start = (first_local_key / BLOCK_KV).max(sink_end);
        let mut walk = Self {
            q_block,
            sink_end,
            local_start,
            mask,
            word: 0,
            bits: 0,
        };
        // SAFETY: word 0 <= q_block / 32.
        walk.bits = unsafe { walk.candidates(0) };
        walk
    }

    /// The blocks of word `word` to visit: pattern ∩ mask, plus the diagonal.
    ///
    /// # Safety
    /// `word <= q_block / 32` (the mask row holds it).
    #[inline(always)]
    unsafe fn candidates(&self, word: u32) -> u32 {
        let pattern = range_bits(word, 0, self.sink_end)
            | range_bits(word, self.local_start, self.q_block + 1);
        let caller = if self.mask.is_null() {
            u32::MAX
        } else {
            // SAFETY: forwarded: the row holds `word`.
            unsafe { self.mask.add(word as usize).read() }
        };
        let diagonal = range_bits(word, self.q_block, self.q_block + 1);
        (pattern & caller) | diagonal
    }
}

impl Iterator for KvBlocks {
    type Item = u32;

    #[inline(always)]
    fn next(&mut self) -> Option<u32> {
        loop {
            if self.bits != 0 {
                let kv_block = 32 * self.word + self.bits.trailing_zeros();
                self.bits &= self.bits - 1;
                return Some(kv_block);
            }
            if self.word >= self.q_block / 32 {
                return None;
            }
            let mut next = self.word + 1;
            // Jump over whole words between the sink range and the local range: no block there
            // is visible, whatever the mask says.
            if 32 * next >= self.sink_end && 32 * next < self.local_start {
                next = self.local_start / 32;
            }
            self.word = next;
            // SAFETY: `next <= local_start / 32 <= q_block / 32`, or `word + 1 <= q_block / 32`.
            self.bits = unsafe { self.candidates(next) };
        }
    }
}
