//! Prefill block granularity (the unit of the block iterator and of caller block masks) and the
//! launch contract of the block-sparse prefill attention kernel.
//!
//! One launch serves a ragged batch for one layer: grid `(items, q_heads)`, [`PREFILL_THREADS`]
//! threads. A *work item* is one (sequence, query tile) pair — a tile is [`TILE_Q_BLOCKS`]
//! consecutive query blocks for the unmasked kernel, [`MASKED_TILE_Q_BLOCKS`] for the kernel of
//! launches with caller block masks — described by a
//! [`PrefillWorkItem`] in a small device array built on the host (the plan); grid `x` indexes it,
//! grid `y` is the query head. The KV blocks the item visits follow from its head's kind (dense:
//! causal; streaming: Λ, with [`PrefillParams::sink_tokens`] / [`PrefillParams::local_tokens`])
//! and, optionally, a caller block mask.

/// Queries per prefill block (rows of a query tile; the granularity of a block mask's rows).
pub const BLOCK_Q: u32 = 64;
/// Keys per prefill block (the granularity of the KV blocks a query block visits).
pub const BLOCK_KV: u32 = 64;

/// Query blocks per work item of the unmasked kernel (`prefill_attention_*`: dense and
/// streaming heads, no caller mask). The block granularity above is what the iterator and
/// block masks mean; this kernel computes two query blocks per launch block (32 rows per warp)
/// so that every K/V fragment it loads feeds two `mma` row tiles.
pub const TILE_Q_BLOCKS: u32 = 2;
/// Query rows of a work item's tile (unmasked kernel).
pub const TILE_Q: u32 = TILE_Q_BLOCKS * BLOCK_Q;
/// Query blocks per work item of the masked kernel (`prefill_masked_attention_*`, launches with
/// caller block masks): one query block (16 rows per warp), so a launch block visits exactly
/// its query block's KV set and no warp idles on a block another query block needs.
pub const MASKED_TILE_Q_BLOCKS: u32 = 1;

/// Threads per block of the prefill kernels: 4 warps (32 or 16 query rows each).
pub const PREFILL_THREADS: u32 = 128;
/// K/V tiles in flight per block (`cp.async` stages).
pub const PREFILL_STAGES: u32 = 2;
/// Padding of every shared-memory tile row, in elements (16 bytes): rows `D + 8` elements apart
/// make the eight row addresses of an `ldmatrix` 8x8 load fall in distinct bank groups.
pub const PREFILL_ROW_PAD: u32 = 8;

/// Shared memory of the prefill kernel for head dimension `head_dim` and `tile_q_blocks` query
/// blocks per work item ([`TILE_Q_BLOCKS`] or [`MASKED_TILE_Q_BLOCKS`]), in bytes: a K and a V
/// tile per stage plus the query tile (`tile_q_blocks * BLOCK_Q` rows), rows padded by
/// [`PREFILL_ROW_PAD`].
pub const fn prefill_smem_bytes(head_dim: u32, tile_q_blocks: u32) -> u32 {
    (tile_q_blocks * BLOCK_Q + 2 * PREFILL_STAGES * BLOCK_KV) * (head_dim + PREFILL_ROW_PAD) * 2
}

/// Words of one block-mask row (one query block, a bit per KV block) of a sequence of
/// `seq_len` tokens: a row of query block `qb + 1` follows the row of `qb` at this offset.
pub const fn mask_words_per_row(seq_len: u32) -> u32 {
    seq_len.div_ceil(BLOCK_KV).div_ceil(32)
}

/// One (sequence, query tile) of a prefill launch (`u32` words, `#[repr(C)]`).
///
/// The keys and values of the sequence are rows `seq_start .. seq_start + seq_len` of `k` / `v`
/// (positions `0 .. seq_len`); its queries are the positions `q_first .. seq_len`, rows
/// `q_row ..` of `q` and `out`. A whole prompt has `q_first == 0` and `q_row == seq_start`; a
/// chunk prefilled after a cached prefix has the prefix as leading key rows (`q_first` = its
/// length).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillWorkItem {
    /// First token of the sequence in the ragged batch (`cu_seqlens[b]`).
    pub seq_start: u32,
    /// Tokens in the sequence.
    pub seq_len: u32,
    /// The tile's first query block (sequence-local, a multiple of the kernel's tile blocks):
    /// the tile is queries `q_block * BLOCK_Q ..`, tile-blocks `* BLOCK_Q` of them, those that
    /// exist.
    pub q_block: u32,
    /// Word offset, in the block-mask array, of query head 0's row for query block `q_block`
    /// (in a tile of two, the next query block's row follows after
    /// [`mask_words_per_row`]`(seq_len)` words; unused without a mask).
    pub mask_row: u32,
    /// Words between the rows of consecutive query heads for this sequence
    /// (`q_blocks * words_per_row`; unused without a mask).
    pub mask_head_stride: u32,
    /// The sequence's first position that has a query: 0 for a whole prompt, the cached
    /// prefix's length for a chunk (positions below it are keys only; their query rows in the
    /// tile are zero and their outputs are not written).
    pub q_first: u32,
    /// Row of `q` / `out` (and `lse`) that holds position `q_first`'s query (the chunk's
    /// `cu_seqlens[b]`); position `t >= q_first` is row `q_row + t - q_first`. For a whole
    /// prompt equal to `seq_start`.
    pub q_row: u32,
}

/// Scalars of one prefill launch (by value).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillParams {
    /// Query heads (`Hq`, grid `y`).
    pub q_heads: u32,
    /// KV heads (`Hkv`).
    pub kv_heads: u32,
    /// Query heads per KV head (`G = Hq / Hkv`); query head `h` reads KV head `h / G`.
    pub group: u32,
    /// Work items (grid `x`).
    pub items: u32,
    /// Sink tokens of streaming heads.
    pub sink_tokens: u32,
    /// Local window of streaming heads (> 0 when any head streams).
    pub local_tokens: u32,
    /// Softmax scale times `log2(e)` (the kernel works in base 2).
    pub scale_log2: f32,
    /// 1 if the launch passes a caller block mask (then the plan launches the masked kernel,
    /// which requires it), else 0 (the unmasked kernel, which ignores the mask argument).
    pub has_mask: u32,
    /// Token strides of `q`, `k`/`v` and `out`.
    pub strides: crate::layout::TokenStrides,
}

/// The one argument of a prefill launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillArgs {
    /// Scalars.
    pub params: PrefillParams,
    /// `[items]` work items.
    pub items: crate::ptr::GlobalPtr<PrefillWorkItem>,
    /// `[kv_heads]` head map (`decode::HEAD_STREAMING` marks a streaming head).
    pub head_map: crate::ptr::GlobalPtr<u32>,
    /// The caller's block mask (`params.has_mask == 1`), else unused.
    pub mask: crate::ptr::GlobalPtr<u32>,
    /// `[tokens]` rows of `[q_heads][D]` queries, `params.strides.q` heads apart.
    pub q: crate::ptr::GlobalPtr<u16>,
    /// `[tokens]` rows of `[kv_heads][D]` keys, `params.strides.kv` heads apart.
    pub k: crate::ptr::GlobalPtr<u16>,
    /// The values, as `k`.
    pub v: crate::ptr::GlobalPtr<u16>,
    /// `[tokens]` rows of `[q_heads][D]` outputs, `params.strides.out` heads apart.
    pub out: crate::ptr::GlobalPtrMut<u16>,
    /// Optional `[tokens][q_heads]` log-sum-exp of each output row's scaled scores (natural
    /// log, `ln Σ_j exp(scale · q·k_j)` over the keys the row sees), for merging with attention
    /// computed elsewhere; null: not written.
    pub lse: crate::ptr::GlobalPtrMut<f32>,
}

/// Threads per block of the Hopper prefill kernels (`prefill_wgmma_*`, sm_90): two consumer
/// warpgroups (warps 0-7: `wgmma` products, softmax, output) and a producer warpgroup (warps
/// 8-11, which give their registers to the consumers; one thread of warp 8 issues the
/// tensor-map copies of Q, K and V). In `prefill_wgmma_attention_*` each consumer warpgroup owns
/// one query block of a [`TILE_Q`]-row tile; in `prefill_wgmma_masked_attention_*` both share
/// one query block and take turns at its steps.
pub const WGMMA_PREFILL_THREADS: u32 = 384;
/// KV blocks per step of the Hopper prefill kernels: `S = Q Kᵀ` of a step spans two blocks of
/// the walk ([`BLOCK_KV`] keys each, not necessarily adjacent), 128 keys.
pub const WGMMA_STEP_BLOCKS: u32 = 2;
/// Steps in the Hopper prefill kernels' ring (each stage a K and a V tile of
/// [`WGMMA_STEP_BLOCKS`] blocks).
pub const WGMMA_PREFILL_STAGES: u32 = 3;
/// Columns of one tensor-map box of the Hopper prefill kernels (128 bytes: the swizzle's
/// width); a tile of `D` columns is `D / 64` boxes of 64 rows.
pub const WGMMA_BOX_COLUMNS: u32 = 64;
/// `mbarrier`s of the Hopper prefill kernels: one for the query tile, a *full* one per stage
/// and consumer warpgroup, an *empty* one per stage, and the two of the masked kernel's merge
/// (one warpgroup's products done, the other's part written).
pub const WGMMA_PREFILL_BARRIERS: u32 = 3 + 3 * WGMMA_PREFILL_STAGES;
/// Words of the Hopper prefill kernels' step headers: the walk's length, then per stage the
/// step's two KV blocks (what the producer found in a caller mask), padded to 8 bytes.
pub const WGMMA_PREFILL_HEADER_WORDS: u32 = 2 + 2 * WGMMA_PREFILL_STAGES;

/// Shared memory of the Hopper prefill kernels for head dimension `head_dim`, in bytes: 1024
/// bytes of slack to align the tiles to the swizzle's 1024-byte atoms, the query tile
/// ([`TILE_Q`] rows), [`WGMMA_PREFILL_STAGES`] K and V tiles of a step, the `mbarrier`s
/// ([`WGMMA_PREFILL_BARRIERS`], 8 bytes each), then the step headers
/// ([`WGMMA_PREFILL_HEADER_WORDS`]).
pub const fn wgmma_prefill_smem_bytes(head_dim: u32) -> u32 {
    1024 + (TILE_Q + 2 * WGMMA_PREFILL_STAGES * WGMMA_STEP_BLOCKS * BLOCK_KV) * head_dim * 2
        + 8 * WGMMA_PREFILL_BARRIERS
        + 4 * WGMMA_PREFILL_HEADER_WORDS
}

/// Bytes of one encoded tensor map (CUDA's `CUtensorMap`, 64-byte aligned).
pub const PREFILL_TENSOR_MAP_BYTES: usize = 128;

/// The one argument of a Hopper prefill launch (`prefill_wgmma_*`): the arguments of the
/// `mma.sync` kernels (the same schedules, masks and outputs; `q`, `k`, `v` are read through the
/// maps) and the tensor maps of `q`, `k` and `v`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WgmmaPrefillArgs {
    /// Scalars, schedule, head map and tensors as for the other prefill kernels.
    pub base: PrefillArgs,
    /// Three tensor maps ([`PREFILL_TENSOR_MAP_BYTES`] each, 64-byte aligned, in global memory):
    /// `q` as `(D, q_heads, query rows)`, `k` and `v` as `(D, kv_heads, tokens)` (16-bit elements,
    /// innermost first, token strides as `base.params.strides`), boxes `(64, 1, 64)`, 128-byte
    /// swizzle.
    pub maps: crate::ptr::GlobalPtr<u8>,
}
