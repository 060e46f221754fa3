//! The device buffers several kernels share, one struct each: a layer's cache
//! ([`CachePtrs`]), its 8-bit key statistics ([`StatCodesPtrs`]), its integer-coded K/V
//! ([`CodedKvPtrs`]), its selection state ([`SelectionPtrs`]) and a decode batch's description
//! ([`BatchPtrs`]). A kernel's argument struct (`DecodeArgs`, `AppendArgs`, ...) holds them beside
//! its own buffers and its scalars; their shapes are [`CacheLayout`](crate::layout::CacheLayout)'s
//! and [`SelectionLayout`](crate::layout::SelectionLayout)'s.

use crate::ptr::{GlobalPtr, GlobalPtrMut};

/// One layer of the cache (16-bit elements) and the block tables all layers share.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachePtrs {
    /// Dense pool K, `[capacity][dense_heads][page_tokens][D]` (`PagedLayout`).
    pub k_pool: GlobalPtrMut<u16>,
    /// Dense pool V, as `k_pool`.
    pub v_pool: GlobalPtrMut<u16>,
    /// Key statistics (per channel minimum) of the dense pool,
    /// `[capacity][dense_heads][page_tokens / logical_tokens][D]`.
    pub kmin: GlobalPtrMut<u16>,
    /// Per channel maximum, as `kmin`.
    pub kmax: GlobalPtrMut<u16>,
    /// Streaming store K, `[slots][streaming_heads][sink + local][D]` (`StreamingLayout`).
    pub k_stream: GlobalPtrMut<u16>,
    /// Streaming store V, as `k_stream`.
    pub v_stream: GlobalPtrMut<u16>,
    /// `[slots][max_pages]` physical page ids.
    pub block_tables: GlobalPtr<u32>,
    /// `[kv_heads]`: a KV head's index among the layer's dense heads, or among its streaming
    /// heads with `decode::HEAD_STREAMING` set.
    pub head_map: GlobalPtr<u32>,
    /// The 8-bit copy of `kmin`/`kmax` the selector reads, where the cache keeps one (null
    /// pointers where it does not): every kernel that writes `kmin`/`kmax` writes it too.
    pub stat_codes: StatCodesPtrs,
}

/// A layer's key statistics in 8 bits (`lserve::quant::StatsFormat::Int8`), derived from the
/// 16-bit `kmin`/`kmax` logical page by logical page: per group of [`STAT_GROUP_CHANNELS`]
/// channels of a logical page a bf16 scale `s` and minimum `m` over both vectors (one word, as
/// [`CodedKvPtrs`]' row words), per channel a `kmin` code rounded down and a `kmax` code rounded
/// up (the value of code `c` is `fma(c, s, m)` in f32).
///
/// Laid out on the 16-bit statistics' element offsets `o` (`PagedLayout::stats_row` + channel):
/// the codes of the 8 channels of chunk `o / 8` are bytes `2 o ..` (8 `kmin` codes, then 8 `kmax`
/// codes: one 16-byte load per chunk), the word of channel `o` is word `o / 32`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatCodesPtrs {
    /// `[capacity][dense_heads][N_P / N_L][D / 8][16]` bytes.
    pub codes: GlobalPtrMut<u8>,
    /// `[capacity][dense_heads][N_P / N_L][D / 32]` `(s, m)` words.
    pub words: GlobalPtrMut<u32>,
}

impl StatCodesPtrs {
    /// No 8-bit statistics.
    pub const NONE: Self = Self {
        codes: GlobalPtrMut::NULL,
        words: GlobalPtrMut::NULL,
    };

    /// Whether the cache keeps 8-bit statistics.
    #[inline(always)]
    pub fn present(&self) -> bool {
        self.codes.addr() != 0
    }
}

/// Channels sharing one scale and minimum in [`StatCodesPtrs`].
pub const STAT_GROUP_CHANNELS: u32 = 32;

/// One layer's page selection state, per (slot, dense head) pair.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectionPtrs {
    /// `[slots][dense_heads][held_capacity]` held selections (logical page numbers, ascending;
    /// the row's last word is the selection's newest page, `select::held_newest_at`).
    pub held_pages: GlobalPtrMut<u32>,
    /// `[slots][dense_heads]` held selection lengths (0: nothing held).
    pub held_lens: GlobalPtrMut<u32>,
    /// `[slots][dense_heads][entry_capacity]` index tables (physical page ids).
    pub index_pages: GlobalPtrMut<u32>,
    /// `[slots][dense_heads]` index table lengths.
    pub index_lens: GlobalPtrMut<u32>,
}

/// A decode batch: per sequence `b < batch`, its length (after this step's token) and slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchPtrs {
    /// `[batch]` sequence lengths.
    pub seq_len: GlobalPtr<u32>,
    /// `[batch]` sequence slots (block-table rows, streaming-store slots).
    pub seq_slot: GlobalPtr<u32>,
}

/// A layer's K and V as integer codes (`lserve::quant`, INT8 or INT4 per token-head): rows where
/// a 16-bit cache keeps them (`PagedLayout::kv_row`, `StreamingLayout::kv_row`), at one byte per
/// element for INT8 and half a byte for INT4 (the row at element offset `o` begins at byte `o`,
/// or `o / 2`; INT4 channel `2i` in the low nibble of byte `i`, `2i + 1` in the high one), and
/// per row one 32-bit word `(s, m)`: the bf16 scale in bits 0..16, the bf16 minimum in bits
/// 16..32 (element `c` is `fma(c, s, m)`). The word of the row at element offset `o` is word
/// `o / head_dim`. The pointers are `GlobalPtrMut` because the write kernels (`kv_write`'s coded
/// append and row write) take the same struct; the attention only reads through them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodedKvPtrs {
    /// Dense pool K codes, `[capacity][dense_heads][page_tokens][D]` codes.
    pub k_pool: GlobalPtrMut<u8>,
    /// Dense pool V codes, as `k_pool`.
    pub v_pool: GlobalPtrMut<u8>,
    /// Dense pool K row words, `[capacity][dense_heads][page_tokens]`.
    pub k_pool_words: GlobalPtrMut<u32>,
    /// Dense pool V row words, as `k_pool_words`.
    pub v_pool_words: GlobalPtrMut<u32>,
    /// Streaming store K codes, `[slots][streaming_heads][sink + local][D]` codes.
    pub k_stream: GlobalPtrMut<u8>,
    /// Streaming store V codes, as `k_stream`.
    pub v_stream: GlobalPtrMut<u8>,
    /// Streaming store K row words, `[slots][streaming_heads][sink + local]`.
    pub k_stream_words: GlobalPtrMut<u32>,
    /// Streaming store V row words, as `k_stream_words`.
    pub v_stream_words: GlobalPtrMut<u32>,
}
