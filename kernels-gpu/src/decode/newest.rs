//! The step's token in a launch that appends it (the `decode_attention_append_*` entry points,
//! `APPEND` in [`super::decode_attention`]).
//!
//! The warp whose tiles hold the newest row (position `len - 1`) of a (sequence, KV head) pair
//! takes that row from the activations instead of the cache ([`NewestRow`], patched into its
//! stage by `tiles::patch_rows`) and is also the one that appends it: it stores the row where
//! the `append_kv` kernel would ([`NewestRow::store_row`]), folds the key into its logical page's
//! statistics ([`StatsUpdate`]: the bounds are loaded before the warp streams its tiles and
//! stored after, so the read's round trip hides behind the tiles), and rewrites the pair's index
//! entry tail from what the attention derived anyway ([`RowSource::tail`]). No other
//! thread of the launch writes any of it, and no other thread reads the newest row from the
//! cache: a step that uses these entry points needs no append launch (the host uses them where
//! the attention is latency-bound, `fuses_append` in `host/src/gpu/decode.rs`).

use lserve_abi::decode::{DecodeArgs, DecodeParams, DECODE_TILE_ROWS, HEAD_STREAMING};

use super::rows::{PairInputs, RowSource, NO_ROW};
use crate::convert::Half16;
use crate::global::store_u32;
use crate::kv_write::stats::Bounds;
use crate::kv_write::target::{chunk_at, load, store, write_chunk, RowTarget};
use crate::math::Vec16;
use crate::pool_page::in_pool;

/// The newest row as one lane of the warp that holds it keeps it: lane `l < D / 8` holds chunk
/// `l` (8 channels, 16 bytes) of the key and of the value; other lanes hold nothing.
#[derive(Clone, Copy)]
pub struct NewestRow {
    /// The tile (of the pair's rows) holding the row, or [`NO_ROW`] where this warp holds none.
    pub tile: u32,
    /// The row within the tile.
    pub row: u32,
    /// This lane's chunk of the key.
    pub key: Vec16,
    /// This lane's chunk of the value.
    pub value: Vec16,
}

impl NewestRow {
    /// Nothing held.
    pub const NONE: Self = Self {
        tile: NO_ROW,
        row: 0,
        key: Vec16([0; 4]),
        value: Vec16([0; 4]),
    };

    /// Whether this warp holds the newest row.
    #[inline(always)]
    pub fn held(&self) -> bool {
        self.tile != NO_ROW
    }

    /// The lane's chunks of a pair's token, whose `D` elements start at element `at_row` of
    /// `a.k_new` and of `a.v_new`, and which is row `row` of the pair's rows.
    ///
    /// # Safety
    /// `at_row + D` is inside `a.k_new` and `a.v_new` (the pair's sequence's row, at its token
    /// stride, plus its KV head's offset), written before the kernel before completed (the
    /// caller waited for it).
    #[inline(always)]
    pub unsafe fn load<const D: usize>(a: &DecodeArgs, at_row: usize, row: u32, lane: u32) -> Self {
        let (mut key, mut value) = (Vec16([0; 4]), Vec16([0; 4]));
        if lane < D as u32 / 8 {
            let at = at_row + 8 * lane as usize;
            // SAFETY: chunk `lane < D / 8` of the pair's row; rows are 16-byte aligned
            // (`D % 8 == 0`, the buffers are).
            unsafe { (key, value) = (load(a.k_new.get().add(at)), load(a.v_new.get().add(at))) };
        }
        Self {
            tile: row / DECODE_TILE_ROWS,
            row: row % DECODE_TILE_ROWS,
            key,
            value,
        }
    }

    /// Stores the lane's chunks into the cache where the pair keeps the token (`target`).
    ///
    /// # Safety
    /// `target` is [`target`]'s for this pair; lane `< D / 8` stores chunk `lane`, and no other
    /// thread stores this row.
    #[inline(always)]
    pub unsafe fn store_row<const D: usize>(
        &self,
        a: &DecodeArgs,
        target: RowTarget,
        slot: u32,
        lane: u32,
    ) {
        if lane < D as u32 / 8 {
            // SAFETY: forwarded; `lane < D / 8`.
            unsafe {
                write_chunk(
                    &a.params.cache,
                    &a.cache,
                    target,
                    slot,
                    lane,
                    self.key,
                    self.value,
                )
            };
        }
    }
}

/// Where the pair keeps its newest token (`RowTarget::of` for position `len - 1`, from the
/// attention's own inputs: no table reads).
#[inline(always)]
pub fn target(p: &DecodeParams, pair: &PairInputs, src: &RowSource) -> RowTarget {
    let head = pair.head_map_entry & !HEAD_STREAMING;
    if pair.head_map_entry & HEAD_STREAMING != 0 {
        if src.newest_row == NO_ROW {
            RowTarget::Nowhere
        } else {
            RowTarget::Streaming {
                head,
                row: src.newest_row,
            }
        }
    } else if !in_pool(&p.cache.paged, pair.newest_page) {
        // A block table entry past the pool: the token is not stored, its statistics not
        // updated (`pool_page`'s invariant); the attention still sees it (the stage patch).
        RowTarget::Nowhere
    } else {
        RowTarget::Dense {
            page: pair.newest_page,
            head,
            token: (pair.len - 1) % p.cache.paged.page_tokens,
        }
    }
}

/// One lane's update of the newest token's logical-page statistics (8 channels), in two halves:
/// [`start`](Self::start) loads the bounds, [`finish`](Self::finish) folds the key in and stores
/// them (the key itself if the token starts its logical page: nothing to load).
#[derive(Clone, Copy)]
pub struct StatsUpdate {
    lo: *mut u16,
    hi: *mut u16,
    bounds: Bounds,
    fresh: bool,
}

impl StatsUpdate {
    /// Loads lane `lane`'s channels of the bounds a dense target's token folds into; `None`
    /// for other targets and lanes `>= D / 8`.
    ///
    /// # Safety
    /// `target` is [`target`]'s for a pair whose sequence has length `len`; the statistics hold
    /// the layout in `p.cache.paged`; the kernel before completed (the caller waited for it).
    #[inline(always)]
    pub unsafe fn start<const D: usize>(
        a: &DecodeArgs,
        target: RowTarget,
        len: u32,
        lane: u32,
    ) -> Option<Self> {
        let RowTarget::Dense { page, head, token } = target else {
            return None;
        };
        if lane >= D as u32 / 8 {
            return None;
        }
        let paged = &a.params.cache.paged;
        let n_l = paged.logical_tokens;
        let offset = chunk_at(paged.stats_row(page, head, token / n_l), lane);
        let fresh = (len - 1) % n_l == 0;
        // SAFETY: the statistics row of the token's logical page, inside `kmin`/`kmax`.
        let (lo, hi) = unsafe {
            (
                a.cache.kmin.get().add(offset),
                a.cache.kmax.get().add(offset),
            )
        };
        let bounds = if fresh {
            Bounds {
                lo: Vec16([0; 4]),
                hi: Vec16([0; 4]),
            }
        } else {
            // SAFETY: as above; 16-byte aligned chunks.
            unsafe {
                Bounds {
                    lo: load(lo),
                    hi: load(hi),
                }
            }
        };
        Some(Self {
            lo,
            hi,
            bounds,
            fresh,
        })
    }

    /// Folds `key` in and stores the bounds.
    ///
    /// # Safety
    /// No other thread writes these channels meanwhile (one warp per pair holds the token).
    #[inline(always)]
    pub unsafe fn finish<E: Half16>(self, key: Vec16) {
        let bounds = if self.fresh {
            Bounds::of(key)
        } else {
            let mut bounds = self.bounds;
            bounds.include::<E>(key);
            bounds
        };
        // SAFETY: forwarded from `start`.
        unsafe {
            store(self.lo, bounds.lo);
            store(self.hi, bounds.hi);
        }
    }
}

/// Writes pair `entry`'s index entry tail as the attention listed it ([`RowSource::tail`]):
/// the newest page after the held selection unless the selection ends with it, and the length.
/// Nothing while the pair holds no selection (its first selection writes the entry).
///
/// # Safety
/// `entry < slots * dense_heads`; `tail` came from the pair's [`RowSource`]; only one thread
/// per pair calls it.
#[inline(always)]
pub unsafe fn keep_entry_tail(a: &DecodeArgs, entry: u32, tail: EntryTail) {
    let capacity = a.params.selection.entry_capacity;
    if tail.held == 0 {
        return;
    }
    // SAFETY: the entry's own words: position `held < entry_capacity` (checked: a selection fills
    // the entry only if it covers every page, the newest included, and then nothing follows it).
    unsafe {
        if tail.pages > tail.held && tail.held < capacity {
            store_u32(
                a.selection
                    .index_pages
                    .get()
                    .add((entry * capacity + tail.held) as usize),
                tail.newest_page,
            );
        }
        store_u32(
            a.selection.index_lens.get().add(entry as usize),
            tail.pages.min(capacity),
        );
    }
}

/// What a selecting dense pair's list says about its index entry (see [`keep_entry_tail`]).
#[derive(Clone, Copy)]
pub struct EntryTail {
    /// Pages of the held selection (0: none held).
    pub held: u32,
    /// Pages listed: `held`, or `held + 1` with the newest page after the selection.
    pub pages: u32,
    /// The newest page's physical id.
    pub newest_page: u32,
}

impl EntryTail {
    /// No entry to keep (not a selecting dense head of a launch that appends).
    pub const NONE: Self = Self {
        held: 0,
        pages: 0,
        newest_page: 0,
    };
}
