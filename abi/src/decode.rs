//! Launch parameters of the paged sparse decode attention kernel and its split combine.
//!
//! One launch serves every (sequence, KV head) pair of a layer: grid `(splits, batch * kv_heads)`,
//! [`DECODE_THREADS`] threads. A pair reads either the streaming store (sink + ring rows) or a
//! page list: the block table (all pages, while the sequence is not longer than
//! `dynamic_min_len`) or its index table (the selected pages). Its rows are cut into tiles of
//! [`DECODE_TILE_ROWS`]; split `s` of `splits` takes a contiguous run of tiles and writes a
//! partial softmax state, which [`CombineParams`]' kernel merges into the output.

use crate::layout::{PagedLayout, StreamingLayout};

/// Threads per block of the decode attention kernel (4 warps).
pub const DECODE_THREADS: u32 = 128;
/// Rows (tokens) per tile: the unit of loading, of splitting and of the page size (pages are a
/// whole number of tiles).
pub const DECODE_TILE_ROWS: u32 = 16;
/// Tiles in flight per block (`cp.async` stages).
pub const DECODE_STAGES: u32 = 4;
/// Threads per block of the combine kernel.
pub const COMBINE_THREADS: u32 = 128;
/// The most splits per (sequence, KV head) pair (the combine kernel keeps one weight per split
/// in shared memory).
pub const MAX_SPLITS: u32 = 256;

/// Shared memory of the combine kernel, in bytes: a weight per split and a word per warp for
/// block reductions.
pub const fn combine_smem_bytes() -> u32 {
    (MAX_SPLITS + COMBINE_THREADS / 32) * 4
}

/// `head_map` entry flag: the KV head is streaming (low bits: its index among the layer's
/// streaming heads); without it the low bits are its index among the layer's dense heads.
pub const HEAD_STREAMING: u32 = 1 << 31;

/// Shared memory of the decode attention kernel for head dimension `head_dim`, in bytes: K and V
/// tiles for every stage, plus the cross-warp merge area.
pub const fn decode_smem_bytes(head_dim: u32) -> u32 {
    DECODE_STAGES * 2 * DECODE_TILE_ROWS * head_dim * 2
}

/// Scalars of one decode attention launch (by value).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeParams {
    /// Sequences in the batch (`B`).
    pub batch: u32,
    /// KV heads of the model (`Hkv`); `grid.y = batch * kv_heads`.
    pub kv_heads: u32,
    /// Splits per (sequence, KV head) (`grid.x`).
    pub splits: u32,
    /// Row stride of the block tables (`[slots][max_pages]`).
    pub max_pages: u32,
    /// Row stride of the index tables (`[slots][dense_heads][max_selected]`).
    pub max_selected: u32,
    /// A sequence of at most this many tokens attends to all its pages (block table).
    pub dynamic_min_len: u32,
    /// Softmax scale times `log2(e)` (the kernel works in base 2).
    pub scale_log2: f32,
    /// The layer's dense pool.
    pub paged: PagedLayout,
    /// The layer's streaming store.
    pub streaming: StreamingLayout,
}

/// Scalars of one combine launch (by value): grid `batch * q_heads`, [`COMBINE_THREADS`] threads.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombineParams {
    /// Sequences in the batch.
    pub batch: u32,
    /// Query heads (`Hq`).
    pub q_heads: u32,
    /// Query heads per KV head (`G`).
    pub group: u32,
    /// Head dimension (`D`).
    pub head_dim: u32,
    /// Splits per (sequence, KV head) written by the attention launch.
    pub splits: u32,
}
