//! Launch parameters of the paged sparse decode attention kernel and its split combine.
//!
//! One launch serves every (sequence, KV head) pair of a layer: grid `(splits, batch * kv_heads)`,
//! [`DECODE_THREADS`] threads. A pair reads either the streaming store (sink + ring rows) or a
//! page list: the block table (all pages, while the sequence is not longer than
//! `dynamic_min_len`) or its index table (the selected pages). Its rows are cut into tiles of
//! [`DECODE_TILE_ROWS`]; split `s` of `splits` takes a contiguous run of tiles and writes a
//! partial softmax state, which [`CombineParams`]' kernel merges into the output.

use crate::buffers::{BatchPtrs, CachePtrs, SelectionPtrs};
use crate::layout::{CacheLayout, PagedLayout, SelectionLayout, StreamingLayout, TokenStrides};
use crate::ptr::{GlobalPtr, GlobalPtrMut};

/// Threads per block of the decode attention kernel (4 warps).
pub const DECODE_THREADS: u32 = 128;
/// Rows (tokens) per tile: the unit of loading, of splitting and of the page size (pages are a
/// whole number of tiles).
pub const DECODE_TILE_ROWS: u32 = 16;
/// Copy stages per warp (`cp.async` or bulk copies): each warp streams its own tiles (two in
/// flight while it computes on a third).
pub const DECODE_STAGES: u32 = 3;
/// Alignment of the decode kernel's tile stages in shared memory: the 128-byte swizzle the tiles
/// are laid out with repeats every 8 rows of 128 bytes, and a tensor copy's destination starts on
/// such a boundary.
pub const DECODE_STAGE_ALIGN: u32 = 1024;
/// Blocks of the decode attention kernel that fit on one SM (shared memory bound at D 128); the
/// host sizes splits to fill the GPU with this many per SM.
pub const DECODE_BLOCKS_PER_SM: u32 = 2;
/// Threads per block of the combine kernel.
pub const COMBINE_THREADS: u32 = 128;
/// The most splits per (sequence, KV head) pair (the combine kernel keeps one weight per split
/// in shared memory).
pub const MAX_SPLITS: u32 = 256;

/// Shared memory of the combine kernel, in bytes: a weight per split, a word per warp for block
/// reductions, and four partial sums per thread (the slices' sums).
pub const fn combine_smem_bytes() -> u32 {
    (MAX_SPLITS + COMBINE_THREADS / 32 + 4 * COMBINE_THREADS) * 4
}

/// `head_map` entry flag: the KV head is streaming (low bits: its index among the layer's
/// streaming heads); without it the low bits are its index among the layer's dense heads.
pub const HEAD_STREAMING: u32 = 1 << 31;

/// Bytes of the stage area of the decode attention kernel for head dimension `head_dim`: per
/// warp, [`DECODE_STAGES`] K and V tiles of [`DECODE_TILE_ROWS`] rows, and room to start them on
/// a [`DECODE_STAGE_ALIGN`] boundary (the cross-warp merge area reuses it at the end).
pub const fn decode_stage_bytes(head_dim: u32) -> u32 {
    let warps = DECODE_THREADS / 32;
    warps * DECODE_STAGES * 2 * DECODE_TILE_ROWS * head_dim * 2 + DECODE_STAGE_ALIGN
}

/// Bytes of the decode kernel's copy barriers, after the stage area: one 8-byte `mbarrier` per
/// warp and stage.
pub const DECODE_BARRIER_BYTES: u32 = (DECODE_THREADS / 32) * DECODE_STAGES * 8;

/// Shared memory of the decode attention kernel for head dimension `head_dim`, in bytes: the
/// stage area ([`decode_stage_bytes`]), then the copy barriers ([`DECODE_BARRIER_BYTES`]).
pub const fn decode_smem_bytes(head_dim: u32) -> u32 {
    decode_stage_bytes(head_dim) + DECODE_BARRIER_BYTES
}

/// The largest GQA group (query heads per KV head) the decode attention and the page scorer
/// serve; they serve every group from 1 to this. The decode kernel puts a group's query heads in
/// the rows of `m16n8k16` products whose rows `8..16` it keeps zero, and the scorer is built once
/// per group size (`kernels-gpu/src/shapes.rs`).
pub const MAX_GROUP: u32 = 8;

/// Bytes of the cross-warp merge area at the end of a decode block: per warp and query head of
/// the group, the running maximum, the denominator and `head_dim` accumulators (f32). It fits in
/// the stage area ([`decode_stage_bytes`]) for every supported shape (`group <= MAX_GROUP`,
/// `head_dim` 64 or 128).
pub const fn decode_merge_bytes(head_dim: u32, group: u32) -> u32 {
    (DECODE_THREADS / 32) * group * (head_dim + 2) * 4
}

const _: () = assert!(decode_merge_bytes(64, MAX_GROUP) <= decode_stage_bytes(64));
const _: () = assert!(decode_merge_bytes(128, MAX_GROUP) <= decode_stage_bytes(128));

/// Elements along a row in one tensor-map copy box of the bulk-copy kernels: 128 bytes, the
/// widest box the 128-byte swizzle allows. A K or V tile is `head_dim / 64` such boxes of
/// [`DECODE_TILE_ROWS`] rows.
pub const DECODE_BOX_COLUMNS: u32 = 64;
/// Bytes of one tensor map (CUDA's `CUtensorMap`).
pub const TENSOR_MAP_BYTES: usize = 128;
/// The tensor maps a layer's cache describes its K/V buffers with, in this order
/// ([`TENSOR_MAP_BYTES`] each, in one device buffer): the bulk-copy decode kernels copy their
/// tiles through them.
pub const DECODE_TENSOR_MAPS: usize = 4;
/// Index of the dense pool's K map; its V map follows.
pub const TENSOR_MAP_POOL: usize = 0;
/// Index of the streaming store's K map; its V map follows.
pub const TENSOR_MAP_STREAM: usize = 2;

/// The three dimensions (innermost first) of the dense pool's K (or V) buffer as the tensor
/// maps see it: `[capacity * heads][page_tokens][head_dim]`, so a tile is the box at
/// `(column, token, page * heads + head)` and never leaves its page.
///
/// ```
/// use lserve_abi::decode::pool_tensor_dims;
/// use lserve_abi::layout::PagedLayout;
/// let paged = PagedLayout { capacity: 10, heads: 4, page_tokens: 64, logical_tokens: 16, head_dim: 128 };
/// assert_eq!(pool_tensor_dims(&paged), [128, 64, 40]);
/// ```
pub const fn pool_tensor_dims(paged: &PagedLayout) -> [u64; 3] {
    [
        paged.head_dim as u64,
        paged.page_tokens as u64,
        paged.capacity as u64 * paged.heads as u64,
    ]
}

/// The three dimensions (innermost first) of the streaming store's K (or V) buffer as the tensor
/// maps see it: `[slots * heads][rows][head_dim]`; a tile is the box at
/// `(column, row, slot * heads + head)` (rows past `rows` read as zeros).
///
/// ```
/// use lserve_abi::decode::stream_tensor_dims;
/// use lserve_abi::layout::StreamingLayout;
/// let s = StreamingLayout { slots: 2, heads: 4, sink_tokens: 64, local_tokens: 256, head_dim: 128 };
/// assert_eq!(stream_tensor_dims(&s), [128, 320, 8]);
/// ```
pub const fn stream_tensor_dims(s: &StreamingLayout) -> [u64; 3] {
    [
        s.head_dim as u64,
        s.rows() as u64,
        s.slots as u64 * s.heads as u64,
    ]
}

/// Scalars of one decode attention launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeParams {
    /// Sequences in the batch (`B`); `grid.y = batch * cache.kv_heads`.
    pub batch: u32,
    /// Query heads per KV head (`G`, 1 to [`MAX_GROUP`]): a block's query heads, the first `G`
    /// rows of its `mma` products.
    pub group: u32,
    /// Splits per (sequence, KV head) (`grid.x`).
    pub splits: u32,
    /// A sequence of at most this many tokens attends to all its pages (block table).
    pub dynamic_min_len: u32,
    /// Softmax scale times `log2(e)` (the kernel works in base 2).
    pub scale_log2: f32,
    /// The layer's cache: KV heads, block-table stride, dense pool and streaming store.
    pub cache: CacheLayout,
    /// The selection state's row strides.
    pub selection: SelectionLayout,
    /// Token strides of `q` (`batch` rows of `q_heads` heads) and of the new token's `k`/`v`
    /// (rows of `kv_heads` heads); `out` is unused (the combine writes the output).
    pub strides: TokenStrides,
}

/// The one argument of a decode attention launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeArgs {
    /// Scalars.
    pub params: DecodeParams,
    /// `[batch]` rows of `[q_heads][D]` queries, `params.strides.q` heads apart.
    pub q: GlobalPtr<u16>,
    /// The step's keys, `[batch]` rows of `[kv_heads][D]` (read by the appending kernels only).
    pub k_new: GlobalPtr<u16>,
    /// The step's values, as `k_new`.
    pub v_new: GlobalPtr<u16>,
    /// The layer's cache (written by the appending kernels only).
    pub cache: CachePtrs,
    /// The layer's [`DECODE_TENSOR_MAPS`] tensor maps of the pool's and the store's K and V
    /// (read by the bulk-copy kernels).
    pub tensor_maps: GlobalPtr<u8>,
    /// The layer's selection state: index entries and held selections read; the appending
    /// kernels write the entries' tails.
    pub selection: SelectionPtrs,
    /// The batch's lengths (after the step's token) and slots.
    pub batch: BatchPtrs,
    /// `[pairs][splits][G][D]` partial outputs (`pairs = batch * kv_heads`).
    pub part_acc: GlobalPtrMut<f32>,
    /// `[pairs][splits][G][2]` partial maxima and denominators.
    pub part_ml: GlobalPtrMut<f32>,
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
    /// Token strides; `out` (`batch` rows of `q_heads` heads) is the one the combine uses.
    pub strides: TokenStrides,
}

/// The one argument of a combine launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CombineArgs {
    /// Scalars.
    pub params: CombineParams,
    /// The attention launch's partial outputs (`DecodeArgs::part_acc`).
    pub part_acc: GlobalPtr<f32>,
    /// Its partial maxima and denominators (`DecodeArgs::part_ml`).
    pub part_ml: GlobalPtr<f32>,
    /// `[batch]` rows of `[q_heads][D]` outputs, `params.strides.out` heads apart.
    pub out: GlobalPtrMut<u16>,
    /// `[batch][q_heads]` log-sum-exp of each query head's scaled scores in natural units
    /// (`ln Σ_j e^(scale · q·k_j)` over the keys it attended), or null: not written.
    pub lse: GlobalPtrMut<f32>,
}

/// Head dimension of the integer-coded decode kernels (`decode_attention_int{8,4}_*`): a code
/// row is 128 bytes (INT8) or 64 (INT4), eight or four 16-byte chunks.
pub const CODED_HEAD_DIM: u32 = 128;

/// Copy stages per warp of the integer-coded decode kernel for `code_bits`-bit codes (8 or 4;
/// its tiles are about a half or a quarter of the bytes of a 16-bit tile).
pub const fn coded_stages(code_bits: u32) -> u32 {
    if code_bits == 4 {
        4
    } else {
        3
    }
}

/// Blocks of the integer-coded decode kernel for `code_bits`-bit codes that fit on one SM
/// (registers bound: INT8's 150-158 registers a thread allow 3 blocks of 128 threads; INT4's
/// registers are capped at 128 for 4, `.minnctapersm` in `host/kernel_build.rs`); the host sizes
/// its splits with this.
pub const fn coded_blocks_per_sm(code_bits: u32) -> u32 {
    if code_bits == 4 {
        4
    } else {
        3
    }
}

/// Bytes of one code row (one token, one KV head) of `code_bits`-bit codes: `head_dim` codes, two
/// to a byte for INT4.
pub const fn coded_row_bytes(head_dim: u32, code_bits: u32) -> u32 {
    head_dim * code_bits / 8
}

/// Bytes of one warp stage of the integer-coded decode kernel for head dimension `head_dim` and
/// `code_bits`-bit codes: the K and V code tiles (`DECODE_TILE_ROWS` rows of
/// [`coded_row_bytes`]), then their rows' `(scale, minimum)` words (4 bytes a row each).
pub const fn coded_stage_bytes(head_dim: u32, code_bits: u32) -> u32 {
    2 * DECODE_TILE_ROWS * coded_row_bytes(head_dim, code_bits) + 2 * DECODE_TILE_ROWS * 4
}

/// Shared memory of the integer-coded decode kernel, in bytes: per warp, [`coded_stages`]
/// stages ([`coded_stage_bytes`]); the cross-warp merge at the end reuses them.
pub const fn coded_decode_smem_bytes(head_dim: u32, code_bits: u32) -> u32 {
    let stages =
        (DECODE_THREADS / 32) * coded_stages(code_bits) * coded_stage_bytes(head_dim, code_bits);
    let merge = decode_merge_bytes(head_dim, MAX_GROUP);
    if stages > merge {
        stages
    } else {
        merge
    }
}

/// The one argument of an integer-coded decode attention launch (`decode_attention_int{8,4}_*`):
/// what a 16-bit launch takes ([`DecodeArgs`]; its cache's K/V pointers and tensor maps are not
/// read) and the coded K/V. Same grid, threads and partial outputs; shared memory
/// [`coded_decode_smem_bytes`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CodedDecodeArgs {
    /// Scalars, queries, tables, selection state, batch and partial outputs.
    pub attn: DecodeArgs,
    /// The coded K and V.
    pub codes: crate::buffers::CodedKvPtrs,
}
