//! Launch parameters of the KV-cache write kernels: append (one decode token per sequence),
//! ragged row writes (prefill), key-statistics pooling, and the random fill used by benchmarks;
//! the append and the row write of integer-coded caches, and the pooling from activation rows
//! that such a cache's statistics take (it keeps no 16-bit keys to pool).
//!
//! Every kernel here moves rows of `head_dim` elements in chunks of 8 (16 bytes): a *chunk* is
//! the unit of work of one thread, so a launch is a flat range of chunks cut into blocks of
//! [`KV_WRITE_THREADS`] threads. `head_dim` must be a multiple of 8.

use crate::buffers::{BatchPtrs, CachePtrs, CodedKvPtrs, SelectionPtrs};
use crate::layout::{CacheLayout, SelectionLayout, TokenStrides};
use crate::ptr::{GlobalPtr, GlobalPtrMut};

/// Threads per block of every kernel in this module.
pub const KV_WRITE_THREADS: u32 = 128;

/// Elements one thread moves (16 bytes of a 16-bit type).
pub const CHUNK_ELEMS: u32 = 8;

/// Scalars of one `append_kv_*` launch: grid `ceil(batch * chunks_per_token / KV_WRITE_THREADS)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendParams {
    /// Sequences in the batch (`B`); `k`, `v` are `[B][kv_heads][head_dim]`.
    pub batch: u32,
    /// Where rows go.
    pub cache: CacheLayout,
    /// Sequences longer than this select pages: the append makes each dense head's index-table
    /// entry its held selection followed by the token's page (unless the selection ends with
    /// it), so a step that reuses its selection needs no selector launch. Equal to the layer's
    /// `SelectParams::dynamic_min_len`.
    pub dynamic_min_len: u32,
    /// The selection state's row strides (every held selection is shorter than an entry).
    pub selection: SelectionLayout,
    /// Token strides; `kv` (the batch's `k`/`v` rows) is the one the append uses.
    pub strides: TokenStrides,
}

/// The one argument of an `append_kv_*` launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AppendArgs {
    /// Scalars.
    pub params: AppendParams,
    /// `[batch]` rows of `[kv_heads][head_dim]` keys, `params.strides.kv` heads apart.
    pub k: GlobalPtr<u16>,
    /// The values, as `k`.
    pub v: GlobalPtr<u16>,
    /// Where rows go (the statistics of the token's logical page are updated).
    pub cache: CachePtrs,
    /// The entries the append keeps: reads `held_lens`, writes `index_pages` and `index_lens`.
    pub selection: SelectionPtrs,
    /// The batch's lengths (after the token) and slots.
    pub batch: BatchPtrs,
}

/// One sequence's token range for `write_kv_rows_*` and `pool_key_stats_*`: positions
/// `start..end` of the sequence in `slot`, whose length is `len` (`end <= len`). For a row write,
/// position `pos` is activation row `first_row + (pos - start)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqRange {
    /// The sequence's slot (block-table row, streaming-store slot).
    pub slot: u32,
    /// First position of the range.
    pub start: u32,
    /// One past the last position.
    pub end: u32,
    /// The sequence's length (tokens that exist; streaming residency is judged at this length).
    pub len: u32,
    /// Activation row of position `start` (the ragged batch's `cu_seqlens[b]`).
    pub first_row: u32,
}

/// Scalars of one `write_kv_rows_*` launch: grid `(ceil(max_tokens * chunks_per_token /
/// KV_WRITE_THREADS), sequences)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRowsParams {
    /// Entries of the range list (`grid.y`).
    pub sequences: u32,
    /// Where rows go.
    pub cache: CacheLayout,
    /// Token strides; `kv` (the activation rows of `k`/`v`) is the one the row write uses.
    pub strides: TokenStrides,
}

/// The one argument of a `write_kv_rows_*` launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WriteRowsArgs {
    /// Scalars.
    pub params: WriteRowsParams,
    /// `[sequences]` token ranges.
    pub ranges: GlobalPtr<SeqRange>,
    /// Activation rows of `[kv_heads][head_dim]` keys, `params.strides.kv` heads apart.
    pub k: GlobalPtr<u16>,
    /// The values, as `k`.
    pub v: GlobalPtr<u16>,
    /// Where rows go (`kmin`/`kmax` are not touched: `pool_key_stats_*` computes them).
    pub cache: CachePtrs,
}

/// The one argument of an `append_kv_int8_*` launch: an [`AppendArgs`] (same grid, threads and
/// statistics, index entries and batch; its cache's 16-bit K/V pointers are not used) and the
/// coded K/V the token's rows are quantized into.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CodedAppendArgs {
    /// What a 16-bit append takes.
    pub append: AppendArgs,
    /// Where the codes and row words go.
    pub codes: CodedKvPtrs,
}

/// The one argument of a `write_kv_rows_int8_*` launch: a [`WriteRowsArgs`] (same grid and
/// threads; its cache's 16-bit K/V pointers are not used) and the coded K/V the rows are
/// quantized into. The statistics come from `pool_key_stats_rows_*` with the same ranges.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CodedWriteRowsArgs {
    /// What a 16-bit row write takes.
    pub rows: WriteRowsArgs,
    /// Where the codes and row words go.
    pub codes: CodedKvPtrs,
}

/// Scalars of one `pool_key_stats_*` launch: grid `(ceil(max_logical_pages /
/// pool_pages_per_block(head_dim)), dense_heads, sequences)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolParams {
    /// Entries of the range list (`grid.z`).
    pub sequences: u32,
    /// Where the keys and statistics are.
    pub cache: CacheLayout,
}

/// The one argument of a `pool_key_stats_*` launch: reads `cache.k_pool` and the block tables,
/// writes `cache.kmin` and `cache.kmax`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolArgs {
    /// Scalars.
    pub params: PoolParams,
    /// `[sequences]` token ranges.
    pub ranges: GlobalPtr<SeqRange>,
    /// The layer's cache.
    pub cache: CachePtrs,
}

/// The one argument of a `pool_key_stats_rows_*` launch: the statistics of every logical page a
/// range touches, from the activation rows of the range's positions (the keys before
/// quantization) instead of the pool. Grid `(ceil(max_logical_pages /
/// pool_pages_per_block(head_dim)), kv_heads, sequences)`: `grid.y` is a KV head (streaming heads
/// exit), because the activation rows are indexed by KV head. A logical page that begins before
/// the range's `start` starts from its statistics in the cache (those of its earlier tokens) and
/// takes the range's rows; its tokens at or past `end` are not read.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolRowsArgs {
    /// The scalars, ranges and cache of a `pool_key_stats_*` launch (`cache.k_pool` not read).
    pub pool: PoolArgs,
    /// Activation rows of `[kv_heads][head_dim]` keys, `kv_stride` heads apart; position `pos` of
    /// a range is row `first_row + pos - start`.
    pub k: GlobalPtr<u16>,
    /// Heads from one activation row to the next (`TokenStrides::kv`).
    pub kv_stride: u32,
}

/// One sequence of a `gather_kv_rows_*` launch: its positions `0..end` become rows
/// `out_row .. out_row + end` of contiguous K/V buffers (`[rows][kv_heads][head_dim]`, packed).
/// Positions below `prefix` come from the cache, as it holds them at length `prefix` (a
/// streaming head's rows it no longer holds are zero), positions `prefix..end` from activation
/// rows `first_row ..`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatherRange {
    /// The sequence's slot (block-table row, streaming-store slot).
    pub slot: u32,
    /// Positions already in the cache.
    pub prefix: u32,
    /// One past the last position gathered.
    pub end: u32,
    /// Activation row of position `prefix`.
    pub first_row: u32,
    /// Output row of position 0.
    pub out_row: u32,
}

/// Scalars of one `gather_kv_rows_*` launch: grid `(ceil(max_end * chunks_per_token /
/// KV_WRITE_THREADS), sequences)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherParams {
    /// Entries of the range list (`grid.y`).
    pub sequences: u32,
    /// Where the cached rows are.
    pub cache: CacheLayout,
    /// Token strides; `kv` (the activation rows of `k`/`v`) is the one the gather uses.
    pub strides: TokenStrides,
}

/// The one argument of a `gather_kv_rows_*` launch: reads the cache and the activations, writes
/// `k_out` and `v_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatherArgs {
    /// Scalars.
    pub params: GatherParams,
    /// `[sequences]` ranges.
    pub ranges: GlobalPtr<GatherRange>,
    /// Activation rows of `[kv_heads][head_dim]` keys, `params.strides.kv` heads apart.
    pub k: GlobalPtr<u16>,
    /// The values, as `k`.
    pub v: GlobalPtr<u16>,
    /// The layer's cache (read only).
    pub cache: CachePtrs,
    /// `[rows][kv_heads][head_dim]` keys out.
    pub k_out: GlobalPtrMut<u16>,
    /// The values out, as `k_out`.
    pub v_out: GlobalPtrMut<u16>,
}

/// The one argument of a `gather_kv_rows_int{8,4}_*` launch: the 16-bit gather's, over a coded
/// cache (its `cache` K/V pointers are not addressed; the cached rows are read from `codes`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CodedGatherArgs {
    /// What a 16-bit gather takes.
    pub gather: GatherArgs,
    /// Where the codes and row words are (read only).
    pub codes: CodedKvPtrs,
}

/// Logical pages one `pool_key_stats_*` block pools: each takes `head_dim / 8` threads.
pub const fn pool_pages_per_block(head_dim: u32) -> u32 {
    KV_WRITE_THREADS / (head_dim / CHUNK_ELEMS)
}

/// The logical pages (of `logical_tokens`) that hold a position of `start..end`, as a half-open
/// range of logical page numbers (empty if `start >= end`).
#[inline(always)]
pub const fn logical_pages_of(start: u32, end: u32, logical_tokens: u32) -> (u32, u32) {
    if start >= end {
        (0, 0)
    } else {
        (start / logical_tokens, (end - 1) / logical_tokens + 1)
    }
}

/// The value `fill_random_*` writes at index `index` for `seed`, in `f32` (the kernel rounds it
/// to the element type, to nearest even): `(n - 2^23) / 2^23` for a 24-bit `n` from a
/// SplitMix64 hash of `(seed, index)`, so in `[-1, 1)` before rounding, exact in `f32`, and never
/// `-0.0`.
#[inline(always)]
pub fn random_value(seed: u64, index: u64) -> f32 {
    let n = (splitmix64(seed ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03)) >> 40) as i32;
    (n - (1 << 23)) as f32 * (1.0 / (1u32 << 23) as f32)
}

/// SplitMix64's output function of `x + golden gamma` (a counter-based hash).
#[inline(always)]
pub const fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Scalars of one `fill_random_*` launch: grid `ceil(len / (KV_WRITE_THREADS * 8))`, each thread
/// writing 8 consecutive elements.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FillParams {
    /// Elements to write.
    pub len: u64,
    /// Seed of the hash.
    pub seed: u64,
}

/// The one argument of a `fill_random_*` launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FillArgs {
    /// Scalars.
    pub params: FillParams,
    /// `params.len` elements to write.
    pub out: GlobalPtrMut<u16>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{PagedLayout, StreamingLayout};

    #[test]
    fn logical_pages_cover_the_range() {
        assert_eq!(logical_pages_of(0, 1, 4), (0, 1));
        assert_eq!(logical_pages_of(3, 5, 4), (0, 2));
        assert_eq!(logical_pages_of(4, 8, 4), (1, 2));
        assert_eq!(logical_pages_of(4, 9, 4), (1, 3));
        assert_eq!(logical_pages_of(5, 5, 4), (0, 0));
    }

    #[test]
    fn random_values_are_in_range_and_vary() {
        let mut distinct = 0;
        let mut last = 2.0;
        for i in 0..10_000u64 {
            let x = random_value(7, i);
            assert!((-1.0..1.0).contains(&x));
            assert!(!(x == 0.0 && x.is_sign_negative()));
            if x != last {
                distinct += 1;
            }
            last = x;
        }
        assert!(distinct > 9_900);
        assert_ne!(random_value(7, 3), random_value(8, 3));
    }

    #[test]
    fn residency_matches_the_ring() {
        let c = CacheLayout {
            kv_heads: 1,
            max_pages: 1,
            paged: PagedLayout {
                capacity: 1,
                heads: 0,
                page_tokens: 16,
                logical_tokens: 16,
                head_dim: 64,
            },
            streaming: StreamingLayout {
                slots: 1,
                heads: 1,
                sink_tokens: 2,
                local_tokens: 3,
                head_dim: 64,
            },
        };
        let held: [bool; 10] = core::array::from_fn(|p| c.streaming_resident(p as u32, 10));
        assert_eq!(
            held,
            [true, true, false, false, false, false, false, true, true, true]
        );
        assert!(!c.streaming_resident(10, 10));
    }
}
