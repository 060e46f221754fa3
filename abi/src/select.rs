//! Launch parameters of the page scorer, the top-K page selector and the decode step counter
//! (`kernels-gpu/src/select`), and the selection rules the host and the kernels share.
//!
//! A layer's page selection is two launches over every (sequence, dense KV head) *pair* of the
//! batch (`pair = b * dense_heads + dense_head`):
//! 1. the scorer, grid `(chunks, pairs)`, [`SCORE_THREADS`] threads: the physical-page scores of
//!    the pairs whose selection is due, into a workspace `[batch][dense_heads][max_pages]` of
//!    `f32` ([`score_offset`]);
//! 2. the selector, grid `pairs`, [`SELECT_THREADS`] threads, [`SELECT_SMEM_BYTES`] of dynamic
//!    shared memory: the exact top-K of the due pairs into their held selection and their
//!    index-table entry (held selection plus the newest page). Between selections the decode
//!    append keeps the entries (`kv_write::AppendParams`).
//!
//! Both decide "due" with [`selection_due`] on the same state, so they agree.

use crate::buffers::{BatchPtrs, SelectionPtrs, StatCodesPtrs};
use crate::layout::{CacheLayout, SelectionLayout, TokenStrides};
use crate::ptr::{GlobalPtr, GlobalPtrMut};

/// Threads per block of the scorer (8 warps).
pub const SCORE_THREADS: u32 = 256;

/// Scorer blocks resident on an SM at once: its registers are capped for them (`.minnctapersm`),
/// and the host sizes its grid to one wave of them.
pub const SCORE_BLOCKS_PER_SM: u32 = 2;

/// Dynamic shared memory of a scorer launch at head dimension `head_dim`: the query heads'
/// `B` fragments, 8 bytes per lane of each of its `head_dim / 8` products.
///
/// ```
/// assert_eq!(lserve_abi::select::score_smem_bytes(128), 4096);
/// ```
#[inline(always)]
pub const fn score_smem_bytes(head_dim: u32) -> u32 {
    head_dim / 8 * 32 * 8
}

/// Logical pages one scorer warp scores at once: the `M` rows of its tensor-core products.
pub const SCORE_TILE_ROWS: u32 = 16;

/// Units (of `per_unit` logical pages each) one scorer warp tile covers: the whole units its
/// [`SCORE_TILE_ROWS`] rows hold, or one unit (in several passes) when a unit is longer.
///
/// ```
/// use lserve_abi::select::score_tile_units;
/// assert_eq!(score_tile_units(4), 4); // 64-token pages of 16-token logical pages
/// assert_eq!(score_tile_units(1), 16); // logical-page selection
/// assert_eq!(score_tile_units(3), 5); // one row unused
/// assert_eq!(score_tile_units(32), 1); // two passes per unit
/// ```
#[inline(always)]
pub const fn score_tile_units(per_unit: u32) -> u32 {
    if per_unit == 0 || per_unit >= SCORE_TILE_ROWS {
        1
    } else {
        SCORE_TILE_ROWS / per_unit
    }
}

/// Threads per block of the selector (16 warps).
pub const SELECT_THREADS: u32 = 512;

/// Dynamic shared memory of the selector, in bytes: one 256-bin histogram per radix pass (4),
/// then two partial sums per warp (room for 32 warps), all `u32`.
pub const SELECT_SMEM_BYTES: u32 = (4 * 256 + 2 * 32) * 4;

/// Threads per block of the decode step counter kernel.
pub const STEP_THREADS: u32 = 128;

/// [`SelectParams::aggregation`]: maximum over the group's query heads.
pub const AGGREGATE_MAX: u32 = 0;
/// [`SelectParams::aggregation`]: mean over the group's query heads.
pub const AGGREGATE_MEAN: u32 = 1;

/// Scalars of one scorer or selector launch (both kernels take the same struct).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectParams {
    /// Sequences in the batch (`B`).
    pub batch: u32,
    /// The layer's cache: KV heads (the query heads are `[B][kv_heads * G][D]`), the block-table
    /// stride (also the score workspace's), the dense pool's statistics layout.
    pub cache: CacheLayout,
    /// The selection state's row strides.
    pub selection: SelectionLayout,
    /// Sequences of at most this many tokens attend densely: no selection, tables untouched.
    pub dynamic_min_len: u32,
    /// Reuse interval `C` (at least 1).
    pub reuse_interval: u32,
    /// Pages chosen by score (`K = token_budget / N_P`).
    pub top_k: u32,
    /// 1 if physical page 0 is always selected, else 0.
    pub always_include_first: u32,
    /// [`AGGREGATE_MAX`] or [`AGGREGATE_MEAN`].
    pub aggregation: u32,
    /// Query heads per KV head (`G`, 1 to 8): the scorer's query rows of one pair.
    pub group: u32,
    /// Token strides; `q` (the batch's query rows) is the one the scorer uses.
    pub strides: TokenStrides,
}

/// The one argument of a scorer launch (`score_pages_*`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScoreArgs {
    /// Scalars.
    pub params: SelectParams,
    /// `[B]` rows of `[q_heads][D]` queries, `params.strides.q` heads apart.
    pub q: GlobalPtr<u16>,
    /// The layer's `kmin` (`[capacity][dense_heads][N_P / N_L][D]`).
    pub kmin: GlobalPtr<u16>,
    /// The layer's `kmax`, as `kmin`.
    pub kmax: GlobalPtr<u16>,
    /// The layer's 8-bit statistics (`score_pages_q8_*` reads them instead of `kmin`/`kmax`;
    /// null for the 16-bit scorers).
    pub stat_codes: StatCodesPtrs,
    /// `[slots][max_pages]` physical page ids.
    pub block_tables: GlobalPtr<u32>,
    /// `[kv_heads]` head map of the layer (`buffers::CachePtrs::head_map`).
    pub head_map: GlobalPtr<u32>,
    /// The batch's lengths (after this step's token) and slots.
    pub batch: BatchPtrs,
    /// `[slots]` decode step counters.
    pub decode_steps: GlobalPtr<u32>,
    /// `[slots][dense_heads]` held selection lengths.
    pub held_lens: GlobalPtr<u32>,
    /// `[B][dense_heads][max_pages]` physical-page scores (written for due pairs only).
    pub scores: GlobalPtrMut<f32>,
}

/// The one argument of a selector launch (`select_pages`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectArgs {
    /// Scalars.
    pub params: SelectParams,
    /// `[B][dense_heads][max_pages]` physical-page scores (from the scorer).
    pub scores: GlobalPtr<f32>,
    /// `[slots][max_pages]` physical page ids.
    pub block_tables: GlobalPtr<u32>,
    /// The batch's lengths (after this step's token) and slots.
    pub batch: BatchPtrs,
    /// `[slots]` decode step counters.
    pub decode_steps: GlobalPtr<u32>,
    /// The layer's selection state: the due pairs' held selections and index entries written.
    pub selection: SelectionPtrs,
}

/// The one argument of an `advance_decode_steps` launch: grid `ceil(batch / STEP_THREADS)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepArgs {
    /// Sequences in the batch.
    pub batch: u32,
    /// `[batch]` sequence slots.
    pub seq_slot: GlobalPtr<u32>,
    /// `[slots]` decode step counters, each of the batch's slots incremented.
    pub decode_steps: GlobalPtrMut<u32>,
}

/// Position, in a held-selection row of `held_capacity` words, of the selection's newest page
/// (a logical page number; the top-K writes it with the held length). The selection itself is
/// the row's first `held_len` words, and always ends with that page. The decode kernel reads it
/// beside the held length, so it knows whether the current newest page follows the selection
/// without a second dependent load.
///
/// ```
/// use lserve_abi::select::held_newest_at;
/// // K = 64: up to 66 pages held, and the word after them.
/// assert_eq!(held_newest_at(67), 66);
/// ```
#[inline(always)]
pub const fn held_newest_at(held_capacity: u32) -> u32 {
    held_capacity - 1
}

/// Whether a (sequence, dense KV head) pair runs page selection on this step
/// (`docs/ARCHITECTURE.md`, "Reuse"): the sequence is past `dynamic_min_len` and either its
/// decode step counter is a multiple of the reuse interval or the pair holds no selection yet.
///
/// ```
/// use lserve_abi::select::selection_due;
/// assert!(!selection_due(100, 100, 0, 4, 0)); // dense decode: never
/// assert!(selection_due(101, 100, 8, 4, 5)); // step 8 of C = 4
/// assert!(!selection_due(101, 100, 9, 4, 5)); // reuse
/// assert!(selection_due(101, 100, 9, 4, 0)); // nothing held yet
/// ```
#[inline(always)]
pub const fn selection_due(
    len: u32,
    dynamic_min_len: u32,
    step: u32,
    reuse_interval: u32,
    held_len: u32,
) -> bool {
    let interval = if reuse_interval == 0 {
        1
    } else {
        reuse_interval
    };
    len > dynamic_min_len && (step % interval == 0 || held_len == 0)
}

/// Offset of pair (`b`, `dense_head`)'s first page score in the workspace
/// `[batch][dense_heads][max_pages]`.
#[inline(always)]
pub const fn score_offset(b: u32, dense_head: u32, dense_heads: u32, max_pages: u32) -> usize {
    (b as usize * dense_heads as usize + dense_head as usize) * max_pages as usize
}

/// The order-preserving `u32` key of an `f32` score: `a < b` (IEEE total order, so `-0 < +0`)
/// iff `key(a) < key(b)`. Negative values have every bit flipped, the others their sign bit set.
///
/// ```
/// use lserve_abi::select::score_key;
/// let xs = [f32::NEG_INFINITY, -2.5, -0.0, 0.0, 1e-30, 3.0, f32::INFINITY];
/// assert!(xs.windows(2).all(|w| score_key(w[0]) < score_key(w[1])));
/// ```
#[inline(always)]
pub const fn score_key(x: f32) -> u32 {
    let bits = x.to_bits();
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}
