//! The two-way paged KV cache in device memory, and the per-step batch description.
//!
//! [`DeviceKvCache`] mirrors [`HostKvCache`] buffer for buffer (same layouts, from
//! `lserve-abi`), plus the tables the kernels read: block tables (shared by all layers), per
//! layer the index tables and the head map. Everything is allocated when the cache is built;
//! nothing in a decode step allocates. The host's [`KvCacheManager`] stays the owner of the
//! page pool and of the decode step counters; the cache remembers which of the manager's
//! tables it holds (a [`TableGeneration`](crate::paging::TableGeneration) and each row's
//! generation). Whatever launches read the tables is described by a value that brings the cache
//! to the manager's tables when it is made and records what it was made against:
//! [`DecodeBatch::set`] (and [`DecodeStep::plan`](super::DecodeStep::plan), which sets one),
//! [`KvWritePlan::upload`](super::KvWritePlan::upload). Only the rows that changed are copied
//! (of a row that grew, its new entries), a slot that changed hands has its selection state
//! reset, and a launch given a batch or plan made against other tables is refused
//! (`StaleTables`) before anything is enqueued.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use lserve_abi::buffers::{BatchPtrs, CachePtrs, CodedKvPtrs, SelectionPtrs, StatCodesPtrs};
use lserve_abi::decode::{CODED_HEAD_DIM, HEAD_STREAMING};
use lserve_abi::ptr::{GlobalPtr, GlobalPtrMut};
use lserve_abi::{CacheLayout, PagedLayout, SelectionLayout, StreamingLayout};

use super::launch::Launch;
use super::stat_codes::{check_device_stats, StatCodesLayer};
use super::table_sync::{RowCopy, TableMirror};
use super::GpuContext;
use crate::dtype::Element;
use crate::head_pattern::{HeadKind, HeadPattern};
use crate::index_table::IndexTables;
use crate::paging::{HostKvCache, KvCacheManager, SeqId, TableGeneration, PAD_PAGE};
use crate::quant::{CodeBits, IntFormat, KvFormat, QuantGroup, StatsFormat};
use crate::reference::quant::quantize_rows;
use crate::{LserveError, Result};

/// An [`Element`] the device buffers can hold (bf16 and f16).
pub trait DeviceElement: Element + DeviceRepr + ValidAsZeroBits {}
impl DeviceElement for half::bf16 {}
impl DeviceElement for half::f16 {}

/// One layer's device buffers.
pub struct DeviceLayer<E> {
    /// Dense pool layout.
    pub(crate) paged: PagedLayout,
    /// Streaming store layout.
    pub(crate) streaming: StreamingLayout,
    pub(crate) k_pool: CudaSlice<E>,
    pub(crate) v_pool: CudaSlice<E>,
    pub(crate) kmin: CudaSlice<E>,
    pub(crate) kmax: CudaSlice<E>,
    pub(crate) k_stream: CudaSlice<E>,
    pub(crate) v_stream: CudaSlice<E>,
    /// The tensor maps of `k_pool`, `v_pool`, `k_stream` and `v_stream`, in that order
    /// (`lserve_abi::decode::DECODE_TENSOR_MAPS`): the bulk-copy decode kernels' copies.
    pub(crate) tensor_maps: CudaSlice<u8>,
    /// `[kv_heads]`: dense index, or streaming index | [`HEAD_STREAMING`].
    pub(crate) head_map: CudaSlice<u32>,
    /// `[slots][dense_heads][entry_capacity]` selected physical pages.
    pub(crate) index_pages: CudaSlice<u32>,
    /// `[slots][dense_heads]` entries used.
    pub(crate) index_lens: CudaSlice<u32>,
    /// `[slots][dense_heads][held_capacity]` the held selection (logical page numbers,
    /// ascending) from the last step that selected, reused until the next one; the row's last
    /// word repeats the selection's newest page (`lserve_abi::select::held_newest_at`).
    pub(crate) held_pages: CudaSlice<u32>,
    /// `[slots][dense_heads]` pages in the held selection (0: nothing held).
    pub(crate) held_lens: CudaSlice<u32>,
    /// The integer-coded K/V of a coded cache ([`DeviceKvCache::new_coded`]); its 16-bit K/V
    /// buffers (`k_pool` .. `v_stream`) then hold one element each and are never addressed.
    pub(crate) codes: Option<CodedLayer>,
    /// The 8-bit copy of `kmin`/`kmax`, where the configuration keeps one
    /// ([`StatsFormat::Int8`](crate::quant::StatsFormat::Int8)).
    pub(crate) stat_codes: Option<StatCodesLayer>,
}

/// One layer's integer-coded K/V (`lserve_abi::decode::CodedKvPtrs`): INT8 or INT4 codes where a
/// 16-bit cache keeps its elements (one byte, or half a byte, per element), and per row one
/// `(scale, minimum)` word.
pub(crate) struct CodedLayer {
    k_pool: CudaSlice<u8>,
    v_pool: CudaSlice<u8>,
    k_pool_words: CudaSlice<u32>,
    v_pool_words: CudaSlice<u32>,
    k_stream: CudaSlice<u8>,
    v_stream: CudaSlice<u8>,
    k_stream_words: CudaSlice<u32>,
    v_stream_words: CudaSlice<u32>,
}

/// The codes (in the row layout of `crate::quant`: INT4 two to a byte) and row words of `rows`
/// (`[n][head_dim]`, a 16-bit buffer's elements) quantized to `format` (one group per row) by
/// the reference (`reference::quant::quantize_rows`).
fn quantize_buffer<E: Element>(
    rows: &[E],
    head_dim: usize,
    format: IntFormat,
) -> Result<(Vec<u8>, Vec<u32>)> {
    let values: Vec<f32> = rows.iter().map(|x| x.to_f32()).collect();
    let q = quantize_rows(&values, head_dim, format)?;
    let n = q.rows();
    let code_bytes = format.code_bytes(head_dim)?;
    let codes = (0..n)
        .flat_map(|r| q.stored_row(r).into_iter().take(code_bytes))
        .collect();
    let words = (0..n).map(|r| q.params(r, 0).word()).collect();
    Ok((codes, words))
}

impl CodedLayer {
    /// Zeroed codes and words of `format` for a layer laid out as `paged` and `streaming`.
    fn zeroed(
        stream: &Arc<CudaStream>,
        paged: &PagedLayout,
        streaming: &StreamingLayout,
        format: IntFormat,
    ) -> Result<Self> {
        let d = paged.head_dim as usize;
        let (pool, store) = (paged.kv_elements(), streaming.kv_elements());
        let bytes = |elements: usize| elements * format.bits.bits() as usize / 8;
        Ok(Self {
            k_pool: zeros(stream, bytes(pool))?,
            v_pool: zeros(stream, bytes(pool))?,
            k_pool_words: zeros(stream, pool / d)?,
            v_pool_words: zeros(stream, pool / d)?,
            k_stream: zeros(stream, bytes(store))?,
            v_stream: zeros(stream, bytes(store))?,
            k_stream_words: zeros(stream, store / d)?,
            v_stream_words: zeros(stream, store / d)?,
        })
    }

    /// The rows of a host layer, quantized.
    fn quantized<E: Element>(
        stream: &Arc<CudaStream>,
        head_dim: usize,
        format: IntFormat,
        buffers: [&[E]; 4],
    ) -> Result<Self> {
        let [k_pool, v_pool, k_stream, v_stream] = buffers;
        let part = |rows: &[E]| -> Result<(CudaSlice<u8>, CudaSlice<u32>)> {
            let (codes, words) = quantize_buffer(rows, head_dim, format)?;
            Ok((upload(stream, &codes)?, upload(stream, &words)?))
        };
        let (k_pool, k_pool_words) = part(k_pool)?;
        let (v_pool, v_pool_words) = part(v_pool)?;
        let (k_stream, k_stream_words) = part(k_stream)?;
        let (v_stream, v_stream_words) = part(v_stream)?;
        Ok(Self {
            k_pool,
            v_pool,
            k_pool_words,
            v_pool_words,
            k_stream,
            v_stream,
            k_stream_words,
            v_stream_words,
        })
    }

    /// The coded buffers for a kernel that only reads them, registered with `launch` as read.
    /// (The pointers are `GlobalPtrMut` because the struct is shared with the kernels that write
    /// codes; a launch given these must not write.)
    pub(crate) fn ptrs<'a>(&'a self, launch: &mut Launch<'a>) -> CodedKvPtrs {
        fn writable<T>(p: GlobalPtr<T>) -> GlobalPtrMut<T> {
            GlobalPtrMut::from_addr(p.addr())
        }
        CodedKvPtrs {
            k_pool: writable(launch.read(&self.k_pool)),
            v_pool: writable(launch.read(&self.v_pool)),
            k_pool_words: writable(launch.read(&self.k_pool_words)),
            v_pool_words: writable(launch.read(&self.v_pool_words)),
            k_stream: writable(launch.read(&self.k_stream)),
            v_stream: writable(launch.read(&self.v_stream)),
            k_stream_words: writable(launch.read(&self.k_stream_words)),
            v_stream_words: writable(launch.read(&self.v_stream_words)),
        }
    }

    /// The pool's and the streaming store's codes and words, copied to the host (test-only
    /// reads).
    #[cfg(feature = "test-kernels")]
    #[allow(clippy::type_complexity)]
    pub(crate) fn download(
        &self,
        stream: &Arc<CudaStream>,
    ) -> Result<(
        (Vec<u8>, Vec<u8>, Vec<u32>, Vec<u32>),
        (Vec<u8>, Vec<u8>, Vec<u32>, Vec<u32>),
    )> {
        Ok((
            (
                stream.clone_dtoh(&self.k_pool)?,
                stream.clone_dtoh(&self.v_pool)?,
                stream.clone_dtoh(&self.k_pool_words)?,
                stream.clone_dtoh(&self.v_pool_words)?,
            ),
            (
                stream.clone_dtoh(&self.k_stream)?,
                stream.clone_dtoh(&self.v_stream)?,
                stream.clone_dtoh(&self.k_stream_words)?,
                stream.clone_dtoh(&self.v_stream_words)?,
            ),
        ))
    }

    /// The coded buffers for a kernel that writes codes, registered with `launch` as written.
    pub(crate) fn ptrs_mut<'a>(&'a mut self, launch: &mut Launch<'a>) -> CodedKvPtrs {
        let CodedLayer {
            k_pool,
            v_pool,
            k_pool_words,
            v_pool_words,
            k_stream,
            v_stream,
            k_stream_words,
            v_stream_words,
        } = self;
        CodedKvPtrs {
            k_pool: launch.write(k_pool),
            v_pool: launch.write(v_pool),
            k_pool_words: launch.write(k_pool_words),
            v_pool_words: launch.write(v_pool_words),
            k_stream: launch.write(k_stream),
            v_stream: launch.write(v_stream),
            k_stream_words: launch.write(k_stream_words),
            v_stream_words: launch.write(v_stream_words),
        }
    }
}

/// The formats the device kernels read: INT8 and INT4 codes per token-head
/// (`decode_attention_int{8,4}_*`), at head dimension [`CODED_HEAD_DIM`].
pub(crate) const DEVICE_KV_FORMATS: [IntFormat; 2] = [
    IntFormat::new(CodeBits::Int8, QuantGroup::TokenHead),
    IntFormat::new(CodeBits::Int4, QuantGroup::TokenHead),
];

/// `InvalidArgument` unless the device kernels read `format` at `head_dim`
/// ([`DEVICE_KV_FORMATS`] at head dimension 128). The other formats of [`crate::quant`] have a
/// reference and no kernels yet.
pub(crate) fn check_coded_format(format: IntFormat, head_dim: usize) -> Result<()> {
    if !DEVICE_KV_FORMATS.contains(&format) || head_dim != CODED_HEAD_DIM as usize {
        let [int8, int4] = DEVICE_KV_FORMATS;
        return Err(LserveError::InvalidArgument {
            what: "KV format",
            reason: format!(
                "the device kernels read {int8} or {int4} at head_dim {CODED_HEAD_DIM}, not \
                 {format} at head_dim {head_dim}"
            ),
        });
    }
    Ok(())
}

impl<E: DeviceElement> DeviceLayer<E> {
    /// `InvalidArgument` for a coded layer: `what` reads or writes the 16-bit K/V buffers.
    pub(crate) fn check_float(&self, what: &'static str) -> Result<()> {
        if self.codes.is_some() {
            return Err(coded_unsupported(what));
        }
        Ok(())
    }

    /// The layer as the kernels' argument structs address it (`kv_heads` of the model,
    /// `max_pages` the block tables' row stride).
    pub(crate) fn layout(&self, kv_heads: usize, max_pages: u32) -> CacheLayout {
        CacheLayout {
            kv_heads: kv_heads as u32,
            max_pages,
            paged: self.paged,
            streaming: self.streaming,
        }
    }

    /// The layer's cache and selection buffers for a kernel that only reads them, registered
    /// with `launch` as read. (The pointers are `GlobalPtrMut` because the argument structs are
    /// shared with the kernels that write them; a launch given these must not write.)
    pub(crate) fn ptrs<'a>(
        &'a self,
        launch: &mut Launch<'a>,
        block_tables: &'a CudaSlice<u32>,
    ) -> (CachePtrs, SelectionPtrs) {
        let writable = |p: GlobalPtr<E>| GlobalPtrMut::<u16>::from_addr(p.addr());
        let writable_u32 = |p: GlobalPtr<u32>| GlobalPtrMut::<u32>::from_addr(p.addr());
        let cache = CachePtrs {
            k_pool: writable(launch.read(&self.k_pool)),
            v_pool: writable(launch.read(&self.v_pool)),
            kmin: writable(launch.read(&self.kmin)),
            kmax: writable(launch.read(&self.kmax)),
            k_stream: writable(launch.read(&self.k_stream)),
            v_stream: writable(launch.read(&self.v_stream)),
            block_tables: launch.read(block_tables),
            head_map: launch.read(&self.head_map),
            stat_codes: match &self.stat_codes {
                Some(c) => c.ptrs(launch),
                None => StatCodesPtrs::NONE,
            },
        };
        let selection = SelectionPtrs {
            held_pages: writable_u32(launch.read(&self.held_pages)),
            held_lens: writable_u32(launch.read(&self.held_lens)),
            index_pages: writable_u32(launch.read(&self.index_pages)),
            index_lens: writable_u32(launch.read(&self.index_lens)),
        };
        (cache, selection)
    }

    /// The layer's selection buffers for a kernel that writes them (the selector), registered
    /// with `launch` as written.
    pub(crate) fn selection_mut<'a>(&'a mut self, launch: &mut Launch<'a>) -> SelectionPtrs {
        SelectionPtrs {
            held_pages: launch.write(&mut self.held_pages),
            held_lens: launch.write(&mut self.held_lens),
            index_pages: launch.write(&mut self.index_pages),
            index_lens: launch.write(&mut self.index_lens),
        }
    }

    /// The layer's cache and selection buffers for a kernel that writes them, registered with
    /// `launch` as written (the block tables and the head map as read).
    ///
    /// Errors: `InvalidArgument` for a coded layer (its 16-bit K/V buffers hold one element).
    pub(crate) fn ptrs_mut<'a>(
        &'a mut self,
        launch: &mut Launch<'a>,
        block_tables: &'a CudaSlice<u32>,
    ) -> Result<(CachePtrs, SelectionPtrs)> {
        self.check_float("a kernel that writes the cache")?;
        let (cache, selection, _) = self.all_ptrs_mut(launch, block_tables);
        Ok((cache, selection))
    }

    /// [`ptrs_mut`](Self::ptrs_mut) and the codes, for a kernel that writes a coded layer (its
    /// `CachePtrs`' 16-bit K/V pointers are one-element buffers the kernel does not address).
    ///
    /// Errors: `InvalidArgument` for a layer that is not coded.
    pub(crate) fn coded_ptrs_mut<'a>(
        &'a mut self,
        launch: &mut Launch<'a>,
        block_tables: &'a CudaSlice<u32>,
    ) -> Result<(CachePtrs, SelectionPtrs, CodedKvPtrs)> {
        match self.all_ptrs_mut(launch, block_tables) {
            (cache, selection, Some(codes)) => Ok((cache, selection, codes)),
            (_, _, None) => Err(LserveError::InvalidArgument {
                what: "KV format",
                reason: "a kernel that writes codes was given a 16-bit cache".into(),
            }),
        }
    }

    /// Every buffer of the layer registered with `launch` as written (the block tables and the
    /// head map as read).
    fn all_ptrs_mut<'a>(
        &'a mut self,
        launch: &mut Launch<'a>,
        block_tables: &'a CudaSlice<u32>,
    ) -> (CachePtrs, SelectionPtrs, Option<CodedKvPtrs>) {
        let DeviceLayer {
            k_pool,
            v_pool,
            kmin,
            kmax,
            k_stream,
            v_stream,
            head_map,
            index_pages,
            index_lens,
            held_pages,
            held_lens,
            codes,
            stat_codes,
            ..
        } = self;
        let cache = CachePtrs {
            k_pool: launch.write(k_pool).cast(),
            v_pool: launch.write(v_pool).cast(),
            kmin: launch.write(kmin).cast(),
            kmax: launch.write(kmax).cast(),
            k_stream: launch.write(k_stream).cast(),
            v_stream: launch.write(v_stream).cast(),
            block_tables: launch.read(block_tables),
            head_map: launch.read(head_map),
            stat_codes: match stat_codes {
                Some(c) => c.ptrs_mut(launch),
                None => StatCodesPtrs::NONE,
            },
        };
        let selection = SelectionPtrs {
            held_pages: launch.write(held_pages),
            held_lens: launch.write(held_lens),
            index_pages: launch.write(index_pages),
            index_lens: launch.write(index_lens),
        };
        let codes = codes.as_mut().map(|c| c.ptrs_mut(launch));
        (cache, selection, codes)
    }
}

/// The error of an operation that a coded cache does not serve yet.
pub(crate) fn coded_unsupported(what: &'static str) -> LserveError {
    LserveError::InvalidArgument {
        what: "KV format",
        reason: format!(
            "{what} reads or writes 16-bit K/V; this cache holds int8 codes (coded caches are \
             written by the append, the row write and prefill into the cache, and read by the \
             decode attention and the selector)"
        ),
    }
}

/// The paged KV cache of every layer on the device.
///
/// ```no_run
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{DeviceKvCache, GpuContext};
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
///
/// let gpu = GpuContext::new(0)?;
/// let g = ModelGeometry::llama3_8b();
/// let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 8, 65536)?;
/// let cache = DeviceKvCache::<half::bf16>::new(&gpu, &mgr)?;
/// assert_eq!(cache.layers(), 32);
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct DeviceKvCache<E> {
    /// This cache's identity (batches and plans record it).
    id: u64,
    pattern: HeadPattern,
    layers: Vec<DeviceLayer<E>>,
    /// `[slots][max_pages]` physical page ids.
    pub(crate) block_tables: CudaSlice<u32>,
    pub(crate) max_pages: u32,
    pub(crate) entry_capacity: u32,
    /// Words per held-selection row: room for `K` + the first page + the newest page at
    /// selection time, and one more word that repeats that newest page.
    pub(crate) held_capacity: u32,
    /// `[slots]` decode step counter of the sequence in each slot (selection is due on steps
    /// `0, C, 2C, ...`), kept on the device so that a step never waits for the host.
    pub(crate) decode_steps: CudaSlice<u32>,
    pub(crate) slots: u32,
    /// What the block tables, step counters and held selections hold (host side).
    pub(crate) mirror: TableMirror,
    /// `[max_pages]` of `PAD_PAGE`: the source of the copies that clear a row's entries.
    pad_row: Vec<u32>,
    /// `[most dense heads of a layer x entry_capacity]` of `PAD_PAGE`: the source of the copies
    /// that clear a slot's index entries when it changes hands.
    pad_entries: Vec<u32>,
    /// Sequences up to this length decode densely (`SparsityConfig::dynamic_min_len`).
    pub(crate) dynamic_min_len: u32,
    /// Softmax scale of the attention (`SparsityConfig::softmax_scale_for`).
    pub(crate) softmax_scale: f32,
    /// The manager's sparsity configuration (page selection reads budget, reuse, rules).
    pub(crate) config: crate::config::SparsityConfig,
    /// The K/V element format.
    format: KvFormat,
}

/// A device copy of `data`, at least one element long (the driver refuses empty allocations;
/// a layer may have no dense or no streaming heads).
pub(crate) fn upload<T: DeviceRepr + Default + Clone>(
    stream: &Arc<CudaStream>,
    data: &[T],
) -> Result<CudaSlice<T>> {
    if data.is_empty() {
        Ok(stream.clone_htod(&[T::default()])?)
    } else {
        Ok(stream.clone_htod(data)?)
    }
}

/// `n` zeroed elements on the device, at least one.
fn zeros<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<CudaSlice<T>> {
    Ok(stream.alloc_zeros(n.max(1))?)
}

/// What a new device cache starts with.
enum Contents<'a, E> {
    /// Zeroes, index entries of `entry_capacity` pages.
    Zeroed { entry_capacity: usize },
    /// A copy of a host cache and its index tables.
    Host {
        host: &'a HostKvCache<E>,
        index: &'a IndexTables,
    },
}

/// The per-layer buffers whose contents depend on [`Contents`].
struct LayerBuffers<E> {
    k_pool: CudaSlice<E>,
    v_pool: CudaSlice<E>,
    kmin: CudaSlice<E>,
    kmax: CudaSlice<E>,
    k_stream: CudaSlice<E>,
    v_stream: CudaSlice<E>,
    index_pages: CudaSlice<u32>,
    index_lens: CudaSlice<u32>,
}

/// Hands out the identities of device caches and workspaces.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// A fresh identity (caches and workspaces record one; plans check them).
pub(crate) fn fresh_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// The decode step counter of the sequence in each slot of `manager` (0 for free slots).
fn step_counters(manager: &KvCacheManager) -> Vec<u32> {
    let mut steps = vec![0; manager.max_sequences()];
    for seq in manager.sequences() {
        if let (Ok(slot), Ok(step)) = (manager.slot(seq), manager.decode_step(seq)) {
            steps[slot as usize] = step as u32;
        }
    }
    steps
}

/// The device's encoding of a layer's head pattern (see [`HEAD_STREAMING`]).
fn head_map(pattern: &HeadPattern, layer: usize) -> Vec<u32> {
    (0..pattern.geometry().kv_heads())
        .map(|h| match pattern.kind(layer, h) {
            HeadKind::Dense => pattern.compact_index(layer, h) as u32,
            HeadKind::Streaming => pattern.compact_index(layer, h) as u32 | HEAD_STREAMING,
        })
        .collect()
}

impl<E: DeviceElement> DeviceKvCache<E> {
    /// A zeroed cache shaped for `manager`: its pool capacity, slots, longest sequence and
    /// head pattern. Index tables hold [`IndexTables::entry_capacity_for`] pages per entry.
    ///
    /// Allocates on the device only (a long-context cache need not fit in host memory).
    pub fn new(gpu: &GpuContext, manager: &KvCacheManager) -> Result<Self> {
        Self::zeroed(gpu, manager, None)
    }

    /// A cache holding a copy of `host` (K/V and statistics) and of `index`, with the block
    /// tables and decode step counters of `manager`. The three must describe the same cache.
    /// Held selections start empty, so each sequence past `dynamic_min_len` selects at its next
    /// decode step.
    ///
    /// `index` is checked first, before anything is allocated
    /// ([`IndexTables::check_against`]): a page past the pool is `PageOutOfRange`, a page that
    /// is not one of the sequence in that slot (another sequence's, a free one, any in a slot no
    /// sequence holds) is `PageNotOwned`.
    pub fn upload(
        gpu: &GpuContext,
        manager: &KvCacheManager,
        host: &HostKvCache<E>,
        index: &IndexTables,
    ) -> Result<Self> {
        Self::copied(gpu, manager, host, index, None)
    }

    /// A zeroed cache as [`new`](Self::new) whose K and V are integer codes in `format`: INT8 or
    /// INT4 per token-head at head dimension 128 (a byte or half a byte per element and a bf16
    /// scale and minimum per row: 132 or 68 bytes a row instead of 256). The key statistics stay
    /// 16-bit (or 8-bit, as the manager's configuration says). Such a cache is read by
    /// [`DecodePlan`](super::DecodePlan) (`decode_attention_int{8,4}_*`) and the selector, and
    /// written by the quantizing append and row write; what reads or writes 16-bit K/V
    /// refuses it with `InvalidArgument` before anything is enqueued.
    ///
    /// Errors: `InvalidArgument` for a format or head dimension without device kernels
    /// (`check_coded_format`); those of [`new`](Self::new).
    ///
    /// ```no_run
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::gpu::{DeviceKvCache, GpuContext};
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    /// use lserve::quant::{CodeBits, IntFormat, KvFormat, QuantGroup};
    ///
    /// let gpu = GpuContext::new(0)?;
    /// let g = ModelGeometry::llama3_8b();
    /// let mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 4096, 8, 65536)?;
    /// let int8 = IntFormat::new(CodeBits::Int8, QuantGroup::TokenHead);
    /// let cache = DeviceKvCache::<half::bf16>::new_coded(&gpu, &mgr, int8)?;
    /// assert_eq!(cache.format(), KvFormat::Int(int8));
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn new_coded(
        gpu: &GpuContext,
        manager: &KvCacheManager,
        format: IntFormat,
    ) -> Result<Self> {
        check_coded_format(format, manager.geometry().head_dim())?;
        Self::zeroed(gpu, manager, Some(format))
    }

    /// A coded cache (as [`new_coded`](Self::new_coded)) holding `host`'s K/V quantized to
    /// `format` row by row with the reference quantizer
    /// ([`quantize_rows`](crate::reference::quant::quantize_rows)), its statistics and `index`,
    /// as [`upload`](Self::upload). What attention over it computes is the reference's attention
    /// over the dequantized rows.
    ///
    /// Errors: those of [`new_coded`](Self::new_coded) and [`upload`](Self::upload).
    pub fn upload_coded(
        gpu: &GpuContext,
        manager: &KvCacheManager,
        host: &HostKvCache<E>,
        index: &IndexTables,
        format: IntFormat,
    ) -> Result<Self> {
        check_coded_format(format, manager.geometry().head_dim())?;
        Self::copied(gpu, manager, host, index, Some(format))
    }

    /// [`new`](Self::new) / [`new_coded`](Self::new_coded): a zeroed cache, its K/V 16-bit or
    /// `coded`.
    fn zeroed(
        gpu: &GpuContext,
        manager: &KvCacheManager,
        coded: Option<IntFormat>,
    ) -> Result<Self> {
        let entry_capacity =
            IndexTables::entry_capacity_for(manager.config(), manager.max_seq_len());
        Self::build(gpu, manager, Contents::Zeroed { entry_capacity }, coded)
    }

    /// [`upload`](Self::upload) / [`upload_coded`](Self::upload_coded): a copy of `host` and
    /// `index`, its K/V 16-bit or `coded`.
    fn copied(
        gpu: &GpuContext,
        manager: &KvCacheManager,
        host: &HostKvCache<E>,
        index: &IndexTables,
        coded: Option<IntFormat>,
    ) -> Result<Self> {
        // Before anything is allocated: the tables list only pages of the pool, each in the
        // slot of the sequence that owns it (the kernels cannot tell another sequence's page
        // from their own).
        index.check_against(manager)?;
        if host.pattern() != manager.pattern() || host.layers() != index.layers() {
            return Err(LserveError::InvalidArgument {
                what: "host cache / index tables",
                reason: "shaped for a different pattern than the manager".into(),
            });
        }
        Self::build(gpu, manager, Contents::Host { host, index }, coded)
    }

    /// The format of the cache's K and V.
    pub fn format(&self) -> KvFormat {
        self.format
    }

    /// The format of the key statistics the selector reads (the manager's
    /// `SparsityConfig::stats_format`; with `Int8` the cache keeps their 8-bit codes beside the
    /// 16-bit statistics).
    pub fn stats_format(&self) -> StatsFormat {
        self.config.stats_format
    }

    fn build(
        gpu: &GpuContext,
        manager: &KvCacheManager,
        contents: Contents<'_, E>,
        coded: Option<IntFormat>,
    ) -> Result<Self> {
        let pattern = manager.pattern().clone();
        let cfg = manager.config();
        if cfg.page_tokens % lserve_abi::decode::DECODE_TILE_ROWS as usize != 0 {
            return Err(LserveError::InvalidConfig {
                field: "page_tokens",
                reason: format!(
                    "{} is not a multiple of {} (the GPU decode tile)",
                    cfg.page_tokens,
                    lserve_abi::decode::DECODE_TILE_ROWS
                ),
            });
        }
        check_device_stats(cfg.stats_format)?;
        if !cfg.units_per_page().is_power_of_two() {
            return Err(LserveError::InvalidConfig {
                field: "selection_unit",
                reason: format!(
                    "{} logical pages per page: the device selects logical pages when a page \
                     holds a power of two of them",
                    cfg.units_per_page()
                ),
            });
        }
        if cfg.unit_tokens() % lserve_abi::decode::DECODE_TILE_ROWS as usize != 0 {
            return Err(LserveError::InvalidConfig {
                field: "selection_unit",
                reason: format!(
                    "logical pages of {} tokens are not whole {}-row GPU decode tiles",
                    cfg.unit_tokens(),
                    lserve_abi::decode::DECODE_TILE_ROWS
                ),
            });
        }
        let stream = gpu.stream();
        let slots = manager.max_sequences();
        let held_capacity = cfg.held_selection_pages() + 1;
        let geometry = *pattern.geometry();
        let mut layers = Vec::with_capacity(geometry.layers());
        // A coded cache's 16-bit K/V buffers hold one element (never addressed).
        let float_kv = |elements: usize| if coded.is_some() { 1 } else { elements };
        for layer in 0..geometry.layers() {
            let paged = manager.paged_layout(layer);
            let streaming = manager.streaming_layout(layer);
            let dense_heads = paged.heads as usize;
            let layer_buffers = match &contents {
                Contents::Zeroed { entry_capacity } => LayerBuffers {
                    // `PAD_PAGE` (past the pool), not page 0 (a page of some sequence): an entry
                    // read before any selection wrote it reads nothing (`pool_page`).
                    k_pool: zeros(stream, float_kv(paged.kv_elements()))?,
                    v_pool: zeros(stream, float_kv(paged.kv_elements()))?,
                    kmin: zeros(stream, paged.stats_elements())?,
                    kmax: zeros(stream, paged.stats_elements())?,
                    k_stream: zeros(stream, float_kv(streaming.kv_elements()))?,
                    v_stream: zeros(stream, float_kv(streaming.kv_elements()))?,
                    index_pages: upload(
                        stream,
                        &vec![PAD_PAGE; slots * dense_heads * entry_capacity],
                    )?,
                    index_lens: zeros(stream, slots * dense_heads)?,
                },
                Contents::Host { host, index } => {
                    let (dense, stored) = (host.dense(layer)?, host.streaming(layer)?);
                    if dense.layout() != paged || stored.layout() != streaming {
                        return Err(LserveError::InvalidArgument {
                            what: "host cache",
                            reason: format!(
                                "layer {layer} is laid out differently from the manager's"
                            ),
                        });
                    }
                    let table = index.layer(layer)?;
                    let float = |rows: &[E]| -> Result<CudaSlice<E>> {
                        match coded {
                            None => upload(stream, rows),
                            Some(_) => zeros(stream, 1),
                        }
                    };
                    LayerBuffers {
                        k_pool: float(dense.k())?,
                        v_pool: float(dense.v())?,
                        kmin: upload(stream, dense.kmin())?,
                        kmax: upload(stream, dense.kmax())?,
                        k_stream: float(stored.k())?,
                        v_stream: float(stored.v())?,
                        index_pages: upload(stream, table.pages())?,
                        index_lens: upload(stream, table.lens())?,
                    }
                }
            };
            let codes = match (coded, &contents) {
                (None, _) => None,
                (Some(format), Contents::Zeroed { .. }) => {
                    Some(CodedLayer::zeroed(stream, &paged, &streaming, format)?)
                }
                (Some(format), Contents::Host { host, .. }) => {
                    let (dense, stored) = (host.dense(layer)?, host.streaming(layer)?);
                    Some(CodedLayer::quantized(
                        stream,
                        paged.head_dim as usize,
                        format,
                        [dense.k(), dense.v(), stored.k(), stored.v()],
                    )?)
                }
            };
            let stat_codes = match (cfg.stats_format, &contents) {
                (StatsFormat::Half, _) => None,
                (StatsFormat::Int8(_), Contents::Zeroed { .. }) => {
                    Some(StatCodesLayer::zeroed(stream, &paged)?)
                }
                (StatsFormat::Int8(_), Contents::Host { host, .. }) => {
                    let dense = host.dense(layer)?;
                    Some(StatCodesLayer::of(
                        stream,
                        paged.head_dim as usize,
                        dense.kmin(),
                        dense.kmax(),
                    )?)
                }
            };
            // A coded layer's tensor maps are never read (its kernel copies with `cp.async`):
            // zeros, not maps of the one-element 16-bit buffers.
            let tensor_maps = match coded {
                None => super::tensor_map::layer_tensor_maps(
                    stream,
                    &paged,
                    &streaming,
                    &layer_buffers.k_pool,
                    &layer_buffers.v_pool,
                    &layer_buffers.k_stream,
                    &layer_buffers.v_stream,
                )?,
                Some(_) => zeros(
                    stream,
                    lserve_abi::decode::DECODE_TENSOR_MAPS * lserve_abi::decode::TENSOR_MAP_BYTES,
                )?,
            };
            layers.push(DeviceLayer {
                paged,
                streaming,
                tensor_maps,
                k_pool: layer_buffers.k_pool,
                v_pool: layer_buffers.v_pool,
                kmin: layer_buffers.kmin,
                kmax: layer_buffers.kmax,
                k_stream: layer_buffers.k_stream,
                v_stream: layer_buffers.v_stream,
                head_map: upload(stream, &head_map(&pattern, layer))?,
                index_pages: layer_buffers.index_pages,
                index_lens: layer_buffers.index_lens,
                held_pages: zeros(stream, slots * dense_heads * held_capacity)?,
                held_lens: zeros(stream, slots * dense_heads)?,
                codes,
                stat_codes,
            });
        }
        let pattern_head_dim = pattern.geometry().head_dim();
        let max_dense_heads = (0..geometry.layers())
            .map(|layer| pattern.dense_heads(layer))
            .max()
            .unwrap_or(0);
        let tables = manager.device_block_tables();
        let entry_capacity = match &contents {
            Contents::Zeroed { entry_capacity } => *entry_capacity,
            Contents::Host { index, .. } => index.layer(0)?.entry_capacity(),
        } as u32;
        Ok(Self {
            id: fresh_id(),
            pattern,
            layers,
            block_tables: upload(stream, &tables.pages)?,
            max_pages: tables.max_pages_per_seq as u32,
            entry_capacity,
            held_capacity: held_capacity as u32,
            decode_steps: upload(stream, &step_counters(manager))?,
            slots: tables.slots as u32,
            mirror: TableMirror::of(manager),
            pad_row: vec![PAD_PAGE; tables.max_pages_per_seq],
            pad_entries: vec![PAD_PAGE; max_dense_heads * entry_capacity as usize],
            dynamic_min_len: u32::try_from(cfg.dynamic_min_len).unwrap_or(u32::MAX),
            softmax_scale: cfg.softmax_scale_for(pattern_head_dim),
            config: *cfg,
            format: match coded {
                None => KvFormat::Float(E::DTYPE),
                Some(format) => KvFormat::Int(format),
            },
        })
    }

    /// Checks that `manager`'s block tables fit this cache: the same slots, block-table width,
    /// pool capacity and page sizes (its page ids then address this cache's pools).
    pub(crate) fn check_manager(&self, manager: &KvCacheManager) -> Result<()> {
        let (cfg, ours) = (manager.config(), &self.config);
        let capacity = self.layers.first().map(|l| l.paged.capacity as usize);
        if manager.max_sequences() as u32 != self.slots
            || manager.max_pages_per_seq() as u32 != self.max_pages
            || capacity.is_some_and(|c| c != manager.pool().capacity())
            || cfg.page_tokens != ours.page_tokens
            || cfg.logical_page_tokens != ours.logical_page_tokens
            || cfg.stats_format != ours.stats_format
        {
            return Err(LserveError::InvalidArgument {
                what: "manager",
                reason: "block tables shaped differently from this cache's (slots, width, pool \
                         capacity or page sizes), or another statistics format"
                    .into(),
            });
        }
        Ok(())
    }

    /// Brings the device's block tables to the manager's: copies the entries of the rows that
    /// changed since the last sync (a row that grew: its new entries; a slot that changed hands
    /// or was freed: the new owner's pages and padding over the old owner's), and resets the
    /// selection state (step counter, held selections) of every slot that now holds another
    /// sequence. Nothing when the manager's generation is the one last synced. Asynchronous on
    /// the context's stream; allocates nothing on the device.
    pub(crate) fn sync(&mut self, gpu: &GpuContext, manager: &KvCacheManager) -> Result<()> {
        self.check_manager(manager)?;
        let stream = gpu.stream();
        let width = self.max_pages as usize;
        let Self {
            mirror,
            block_tables,
            pad_row,
            layers,
            decode_steps,
            pad_entries,
            ..
        } = self;
        mirror.sync(manager, |copy| {
            match copy {
                RowCopy::Pages { slot, from, to } => {
                    let (_, table) =
                        manager
                            .slot_owner(slot)
                            .ok_or_else(|| LserveError::InvalidArgument {
                                what: "manager",
                                reason: format!("slot {slot} has no owner"),
                            })?;
                    let row = slot as usize * width;
                    stream.memcpy_htod(
                        &table.pages()[from..to],
                        &mut block_tables.slice_mut(row + from..row + to),
                    )?;
                }
                RowCopy::Pad { slot, from, to } => {
                    let row = slot as usize * width;
                    stream.memcpy_htod(
                        &pad_row[..to - from],
                        &mut block_tables.slice_mut(row + from..row + to),
                    )?;
                }
                RowCopy::ResetSelection { slot } => {
                    zero_selection_state(stream, layers, decode_steps, pad_entries, slot as usize)?;
                }
            }
            Ok(())
        })
    }

    /// Zeroes `slot`'s step counter and held selections (the slot is below the slot count).
    pub(crate) fn reset_selection_state(&mut self, gpu: &GpuContext, slot: u32) -> Result<()> {
        self.mirror.reset(slot);
        zero_selection_state(
            gpu.stream(),
            &mut self.layers,
            &mut self.decode_steps,
            &self.pad_entries,
            slot as usize,
        )
    }

    /// The manager's tables this cache holds, as of its last sync (a plan, a batch set, a write
    /// plan uploaded, or the cache built): equal to `KvCacheManager::generation` when nothing
    /// changed since.
    ///
    /// ```no_run
    /// use half::bf16;
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::gpu::{DecodeBatch, DeviceKvCache, GpuContext};
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    ///
    /// let gpu = GpuContext::new(0)?;
    /// let g = ModelGeometry::llama3_8b();
    /// let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 2, 65536)?;
    /// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// assert_eq!(cache.generation(), mgr.generation());
    /// let seq = mgr.add_sequence()?;
    /// mgr.reserve(seq, 100)?;
    /// assert_ne!(cache.generation(), mgr.generation()); // not copied yet
    /// DecodeBatch::new(&gpu, 2)?.set(&gpu, &mgr, &mut cache, &[seq])?;
    /// assert_eq!(cache.generation(), mgr.generation());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn generation(&self) -> TableGeneration {
        self.mirror.generation()
    }

    /// This cache's identity.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Copies K/V, statistics and index tables back into host structures (for tests and
    /// debugging; synchronizes).
    pub fn download(
        &self,
        gpu: &GpuContext,
        host: &mut HostKvCache<E>,
        index: &mut IndexTables,
    ) -> Result<()> {
        if self.format != KvFormat::Float(E::DTYPE) {
            return Err(coded_unsupported("download"));
        }
        let stream = gpu.stream();
        // Device buffers hold at least one element (`upload`), a host buffer may hold none (a
        // layer without dense or without streaming heads): copy the host's length.
        let copy = |src: &CudaSlice<E>, dst: &mut [E]| -> Result<()> {
            if !dst.is_empty() {
                stream.memcpy_dtoh(&src.slice(..dst.len()), dst)?;
            }
            Ok(())
        };
        let copy_u32 = |src: &CudaSlice<u32>, n: usize| -> Result<Vec<u32>> {
            match n {
                0 => Ok(Vec::new()),
                _ => Ok(stream.clone_dtoh(&src.slice(..n))?),
            }
        };
        for (layer, d) in self.layers.iter().enumerate() {
            let (k, v, kmin, kmax) = host.dense_mut(layer)?.buffers_mut();
            copy(&d.k_pool, k)?;
            copy(&d.v_pool, v)?;
            copy(&d.kmin, kmin)?;
            copy(&d.kmax, kmax)?;
            let (ks, vs) = host.streaming_mut(layer)?.buffers_mut();
            copy(&d.k_stream, ks)?;
            copy(&d.v_stream, vs)?;
            let t = index.layer(layer)?;
            let (n_pages, n_lens) = (t.pages().len(), t.lens().len());
            let pages = copy_u32(&d.index_pages, n_pages)?;
            let lens = copy_u32(&d.index_lens, n_lens)?;
            index.overwrite_layer(layer, &pages, &lens)?;
        }
        stream.synchronize()?;
        Ok(())
    }

    /// The block tables as the device holds them, `[slots][max_pages]` (tests and debugging;
    /// synchronizes). After a [`DecodeBatch::set`] they are the manager's
    /// (`KvCacheManager::device_block_tables`).
    #[doc(hidden)]
    pub fn download_block_tables(&self, gpu: &GpuContext) -> Result<Vec<u32>> {
        let tables = gpu.stream().clone_dtoh(&self.block_tables)?;
        gpu.stream().synchronize()?;
        Ok(tables)
    }

    /// Fills every layer's K and V (pool and streaming store) with deterministic pseudo-random
    /// values ([`fill_random`](super::fill_random), seeded per buffer from `seed`). For
    /// benchmarks and tests that need a long context without uploading one; the key statistics
    /// (and their 8-bit codes) are not updated (run [`pool_key_stats`](super::pool_key_stats)
    /// after). A coded cache gets
    /// random codes and words, and random statistics and 8-bit statistics (no pool computes them
    /// from codes: they bound nothing then, which the time of a selection does not depend on).
    pub fn fill_random(&mut self, gpu: &GpuContext, seed: u64) -> Result<()> {
        for (i, l) in self.layers.iter_mut().enumerate() {
            let base = seed.wrapping_add(4 * i as u64);
            if let Some(c) = &mut l.codes {
                // Random codes; random bf16 pairs as the words (scales and minimums in the
                // generator's range).
                super::fill_random_bits::<E, _>(gpu, &mut c.k_pool, base)?;
                super::fill_random_bits::<E, _>(gpu, &mut c.v_pool, base + 1)?;
                super::fill_random_bits::<E, _>(gpu, &mut c.k_stream, base + 2)?;
                super::fill_random_bits::<E, _>(gpu, &mut c.v_stream, base + 3)?;
                super::fill_random_bits::<half::bf16, _>(gpu, &mut c.k_pool_words, !base)?;
                super::fill_random_bits::<half::bf16, _>(gpu, &mut c.v_pool_words, !base - 1)?;
                super::fill_random_bits::<half::bf16, _>(gpu, &mut c.k_stream_words, !base - 2)?;
                super::fill_random_bits::<half::bf16, _>(gpu, &mut c.v_stream_words, !base - 3)?;
                // Its statistics cannot be pooled from codes: random too.
                super::fill_random(gpu, &mut l.kmin, base ^ 0x5eed)?;
                super::fill_random(gpu, &mut l.kmax, base ^ 0x5eee)?;
                if let Some(sc) = &mut l.stat_codes {
                    let (codes, words) = sc.buffers_mut();
                    super::fill_random_bits::<E, _>(gpu, codes, base ^ 0x5eef)?;
                    super::fill_random_bits::<half::bf16, _>(gpu, words, base ^ 0x5ef0)?;
                }
                continue;
            }
            super::fill_random(gpu, &mut l.k_pool, base)?;
            super::fill_random(gpu, &mut l.v_pool, base + 1)?;
            super::fill_random(gpu, &mut l.k_stream, base + 2)?;
            super::fill_random(gpu, &mut l.v_stream, base + 3)?;
        }
        Ok(())
    }

    /// Checks that `batch` fits this cache: not empty, set against this cache and the block
    /// tables it holds now (`StaleTables` otherwise), every slot below the cache's slot count,
    /// every length within what the block tables reach.
    pub(crate) fn check_batch(&self, batch: &DecodeBatch) -> Result<()> {
        if batch.is_empty() {
            return Err(LserveError::Empty("batch"));
        }
        self.check_tables(batch)?;
        let reach = self.max_pages as usize * self.config.page_tokens;
        for (&slot, &len) in batch.host_slots.iter().zip(&batch.host_lens) {
            if slot >= self.slots || len == 0 || len as usize > reach {
                return Err(LserveError::InvalidArgument {
                    what: "batch",
                    reason: format!(
                        "slot {slot} / length {len} do not fit this cache ({} slots, at most \
                         {reach} tokens): was the batch set from another manager?",
                        self.slots
                    ),
                });
            }
        }
        Ok(())
    }

    /// Checks that `batch` was set against this cache and that the cache still holds the block
    /// tables it was set against (`StaleTables` otherwise): what a plan made with the batch
    /// checks on every run; the rest of [`check_batch`](Self::check_batch) holds while the
    /// batch is not set again.
    pub(crate) fn check_tables(&self, batch: &DecodeBatch) -> Result<()> {
        if batch.cache != self.id {
            return Err(LserveError::StaleTables {
                what: "batch",
                reason: "set against another device cache".into(),
            });
        }
        self.mirror.check_rows(
            "batch",
            batch.manager,
            batch
                .host_slots
                .iter()
                .copied()
                .zip(batch.row_generations.iter().copied()),
        )
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// The head pattern the cache is laid out for.
    pub fn pattern(&self) -> &HeadPattern {
        &self.pattern
    }

    /// Layer `layer`'s buffers.
    pub(crate) fn layer(&self, layer: usize) -> Result<&DeviceLayer<E>> {
        let n = self.layers.len();
        self.layers
            .get(layer)
            .ok_or_else(|| layer_out_of_range(layer, n))
    }

    /// Selection units a sequence may have: the block tables' `max_pages` times the units per
    /// page (the score workspace's row, the longest index entry).
    pub(crate) fn max_units(&self) -> usize {
        self.max_pages as usize * self.config.units_per_page()
    }

    /// The selection state's row strides, as the kernels' argument structs hold them.
    pub(crate) fn selection_layout(&self) -> SelectionLayout {
        SelectionLayout {
            entry_capacity: self.entry_capacity,
            held_capacity: self.held_capacity,
            units_per_page: self.config.units_per_page() as u32,
        }
    }

    /// Layer `layer`'s buffers, mutable.
    pub(crate) fn layer_mut(&mut self, layer: usize) -> Result<&mut DeviceLayer<E>> {
        self.layer_parts_mut(layer).map(|(l, _, _)| l)
    }

    /// Whether a slot of `batch` holds no selection yet (the cache was made, or the slot's
    /// selection state reset, since its last selecting step).
    pub(crate) fn selection_pending(&self, batch: &DecodeBatch) -> bool {
        self.mirror.selection_pending(&batch.host_slots)
    }

    /// Marks the slots of `batch` as holding a selection (a step with the selector ran for them).
    pub(crate) fn clear_selection_pending(&mut self, batch: &DecodeBatch) {
        self.mirror.selected(&batch.host_slots);
    }

    /// Layer `layer`'s buffers, mutable, with what every layer shares to read: the block tables
    /// (what a kernel writing the cache through them takes) and the decode step counters (what
    /// page selection takes).
    pub(crate) fn layer_parts_mut(
        &mut self,
        layer: usize,
    ) -> Result<(&mut DeviceLayer<E>, &CudaSlice<u32>, &CudaSlice<u32>)> {
        let n = self.layers.len();
        let l = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| layer_out_of_range(layer, n))?;
        Ok((l, &self.block_tables, &self.decode_steps))
    }
}

/// Zeroes `slot`'s decode step counter and, in every layer, the held selections of its dense
/// heads, and empties their index entries (lengths 0, pages `PAD_PAGE` from `pad_entries`, at
/// least a layer's dense heads x entry capacity long), so that nothing of a slot's previous
/// owner is listed for the next (enqueued on `stream`).
pub(crate) fn zero_selection_state<E>(
    stream: &Arc<CudaStream>,
    layers: &mut [DeviceLayer<E>],
    decode_steps: &mut CudaSlice<u32>,
    pad_entries: &[u32],
    slot: usize,
) -> Result<()> {
    stream.memset_zeros(&mut decode_steps.slice_mut(slot..slot + 1))?;
    for l in layers {
        let heads = l.paged.heads as usize;
        if heads > 0 {
            let entries = slot * heads..(slot + 1) * heads;
            stream.memset_zeros(&mut l.held_lens.slice_mut(entries.clone()))?;
            stream.memset_zeros(&mut l.index_lens.slice_mut(entries))?;
            let words = l.index_pages.len() / (l.index_lens.len().max(1));
            let pages = slot * heads * words..(slot + 1) * heads * words;
            stream.memcpy_htod(
                &pad_entries[..heads * words],
                &mut l.index_pages.slice_mut(pages),
            )?;
        }
    }
    Ok(())
}

/// The error for a layer index past the cache's `n` layers.
pub(crate) fn layer_out_of_range(layer: usize, n: usize) -> LserveError {
    LserveError::InvalidArgument {
        what: "layer",
        reason: format!("{layer} out of range ({n} layers)"),
    }
}

/// The sequences of one decode step, on the device: for batch row `b`, its slot and its length
/// (after the step's token). Sized for `max_batch` rows when made; [`set`](Self::set) rewrites it
/// in place, so a captured step can be replayed with a new batch. It records the cache and the
/// block tables it was set against: a launch with it on another cache, or after the cache took
/// newer tables for one of its slots, is `StaleTables`.
///
/// [`DecodeStep::plan`](super::DecodeStep::plan) sets the batch of a whole decode step; a
/// `DecodeBatch` of one's own is for the separate launches' plans
/// ([`AppendPlan`](super::AppendPlan), [`SelectPlan`](super::SelectPlan),
/// [`DecodePlan`](super::DecodePlan), [`AppendAttendPlan`](super::AppendAttendPlan)), which
/// borrow it: it cannot be set again while one of them lives.
pub struct DecodeBatch {
    pub(crate) seq_slot: CudaSlice<u32>,
    pub(crate) seq_len: CudaSlice<u32>,
    pub(crate) len: usize,
    /// The lengths, as last set (the host's view; launch sizing reads it).
    pub(crate) host_lens: Vec<u32>,
    /// The slots, as last set (checked against a cache before each launch).
    pub(crate) host_slots: Vec<u32>,
    /// The sequences, as last set.
    pub(crate) host_seqs: Vec<SeqId>,
    /// The row generation of each row's slot, as the cache held it when set.
    row_generations: Vec<u64>,
    /// The cache it was set against.
    cache: u64,
    /// The manager it was set from.
    manager: u64,
    /// Whether some sequence selects pages on this step (as last set).
    selection_due: bool,
}

impl DecodeBatch {
    /// The batch's lengths and slots for a kernel, registered with `launch` as read.
    pub(crate) fn ptrs<'a>(&'a self, launch: &mut Launch<'a>) -> BatchPtrs {
        BatchPtrs {
            seq_len: launch.read(&self.seq_len),
            seq_slot: launch.read(&self.seq_slot),
        }
    }

    /// Room for `max_batch` sequences.
    pub fn new(gpu: &GpuContext, max_batch: usize) -> Result<Self> {
        if max_batch == 0 {
            return Err(LserveError::Empty("batch"));
        }
        Ok(Self {
            seq_slot: gpu.stream().alloc_zeros(max_batch)?,
            seq_len: gpu.stream().alloc_zeros(max_batch)?,
            len: 0,
            host_lens: Vec::with_capacity(max_batch),
            host_slots: Vec::with_capacity(max_batch),
            host_seqs: Vec::with_capacity(max_batch),
            row_generations: Vec::with_capacity(max_batch),
            cache: u64::MAX,
            manager: u64::MAX,
            selection_due: false,
        })
    }

    /// The largest batch it holds.
    pub fn max_batch(&self) -> usize {
        self.seq_slot.len()
    }

    /// Describes `seqs` (in this order) as they stand in `manager` now, for launches on
    /// `cache`: brings the cache's block tables to the manager's (only what changed; a slot that
    /// changed hands gets its selection state reset), writes the manager's decode step counter
    /// of each sequence into the device's where they differ (the manager's is the truth), and
    /// records the tables it was set against. Validates everything before changing anything:
    /// `Empty` for no sequence or an empty one, `InvalidArgument` for too many, a sequence listed
    /// twice or a manager shaped differently from the cache, `UnknownSequence`.
    ///
    /// ```no_run
    /// use half::bf16;
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::gpu::{DecodeBatch, DecodePlan, DecodeWorkspace, DeviceKvCache, GpuContext};
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    /// use lserve::LserveError;
    ///
    /// let gpu = GpuContext::new(0)?;
    /// let g = ModelGeometry::llama3_8b();
    /// let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 2, 65536)?;
    /// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// let a = mgr.add_sequence()?;
    /// mgr.reserve(a, 1000)?;
    /// let mut batch = DecodeBatch::new(&gpu, 2)?;
    /// batch.set(&gpu, &mgr, &mut cache, &[a])?; // copies `a`'s new row
    /// let mut ws = DecodeWorkspace::new(&gpu, 2, g.kv_heads(), g.group(), g.head_dim())?;
    /// let q = gpu.stream().alloc_zeros::<bf16>(2 * g.q_heads() * g.head_dim())?;
    /// let mut out = gpu.stream().alloc_zeros::<bf16>(2 * g.q_heads() * g.head_dim())?;
    /// let plan = DecodePlan::new(&gpu, &cache, &batch, &ws)?;
    /// plan.run(&gpu, &cache, 0, &q, &mut out, &mut ws)?;
    /// // Another batch takes the slot `a` held: the first batch (and its plan) no longer
    /// // describes the cache.
    /// mgr.free_sequence(a)?;
    /// let b = mgr.add_sequence()?;
    /// mgr.reserve(b, 10)?;
    /// let mut other = DecodeBatch::new(&gpu, 2)?;
    /// other.set(&gpu, &mgr, &mut cache, &[b])?;
    /// assert!(matches!(
    ///     plan.run(&gpu, &cache, 0, &q, &mut out, &mut ws),
    ///     Err(LserveError::StaleTables { .. })
    /// ));
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn set<E: DeviceElement>(
        &mut self,
        gpu: &GpuContext,
        manager: &KvCacheManager,
        cache: &mut DeviceKvCache<E>,
        seqs: &[SeqId],
    ) -> Result<()> {
        self.check(manager, seqs)?;
        cache.check_manager(manager)?;
        self.write(gpu, manager, cache, seqs)
    }

    /// [`set`](Self::set) after its checks passed.
    pub(crate) fn write<E: DeviceElement>(
        &mut self,
        gpu: &GpuContext,
        manager: &KvCacheManager,
        cache: &mut DeviceKvCache<E>,
        seqs: &[SeqId],
    ) -> Result<()> {
        cache.sync(gpu, manager)?;
        let stream = gpu.stream();
        self.host_slots.clear();
        self.host_lens.clear();
        self.host_seqs.clear();
        self.row_generations.clear();
        let mut selection_due = false;
        for &s in seqs {
            // Checked above: live, not empty.
            let (len, step, slot) = (manager.len(s)?, manager.decode_step(s)?, manager.slot(s)?);
            selection_due |= manager.config().selects_at(len, step);
            if let Some(value) = cache.mirror.follow_step(slot, step) {
                stream.memcpy_htod(
                    &[value],
                    &mut cache
                        .decode_steps
                        .slice_mut(slot as usize..slot as usize + 1),
                )?;
            }
            self.host_slots.push(slot);
            self.host_lens.push(len as u32);
            self.host_seqs.push(s);
            self.row_generations.push(cache.mirror.row_generation(slot));
        }
        let n = seqs.len();
        stream.memcpy_htod(&self.host_slots, &mut self.seq_slot.slice_mut(..n))?;
        stream.memcpy_htod(&self.host_lens, &mut self.seq_len.slice_mut(..n))?;
        self.len = n;
        self.cache = cache.id();
        self.manager = manager.id();
        self.selection_due = selection_due;
        Ok(())
    }

    /// Checks that `seqs` can be set from `manager`: not empty, room for them, distinct, live,
    /// none empty.
    pub(crate) fn check(&self, manager: &KvCacheManager, seqs: &[SeqId]) -> Result<()> {
        self.check_ids(manager, seqs)?;
        for &s in seqs {
            if manager.len(s)? == 0 {
                return Err(LserveError::Empty("sequence"));
            }
        }
        Ok(())
    }

    /// [`check`](Self::check) less the lengths: not empty, room for them, distinct, live.
    pub(crate) fn check_ids(&self, manager: &KvCacheManager, seqs: &[SeqId]) -> Result<()> {
        if seqs.is_empty() {
            return Err(LserveError::Empty("batch"));
        }
        if seqs.len() > self.seq_slot.len() {
            return Err(LserveError::InvalidArgument {
                what: "batch",
                reason: format!("{} sequences, room for {}", seqs.len(), self.seq_slot.len()),
            });
        }
        for (i, &s) in seqs.iter().enumerate() {
            if seqs[..i].contains(&s) {
                return Err(LserveError::InvalidArgument {
                    what: "batch",
                    reason: format!("sequence {} twice", s.get()),
                });
            }
            manager.len(s)?;
        }
        Ok(())
    }

    /// Whether some sequence of the batch selects pages on this step by the step counters
    /// ([`SparsityConfig::selects_at`](crate::config::SparsityConfig::selects_at) with the
    /// manager's, as last [`set`](Self::set)). [`PlannedStep::selects`](super::PlannedStep::selects)
    /// adds the slots that hold no selection yet.
    ///
    /// ```no_run
    /// use half::bf16;
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::gpu::{DecodeBatch, DeviceKvCache, GpuContext};
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    ///
    /// let gpu = GpuContext::new(0)?;
    /// let g = ModelGeometry::llama3_8b();
    /// let pattern = HeadPattern::interleaved(g, 0.5)?;
    /// let mut mgr = KvCacheManager::new(g, pattern, SparsityConfig::default(), 4096, 4, 65536)?;
    /// let seq = mgr.add_sequence()?;
    /// mgr.reserve(seq, 20_000)?;
    /// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// let mut batch = DecodeBatch::new(&gpu, 4)?;
    /// batch.set(&gpu, &mgr, &mut cache, &[seq])?;
    /// assert!(batch.selection_due()); // decode step 0, 20,000 tokens > dynamic_min_len
    /// mgr.advance_decode_step(seq)?;
    /// mgr.reserve(seq, 1)?;
    /// batch.set(&gpu, &mgr, &mut cache, &[seq])?;
    /// assert!(!batch.selection_due()); // step 1 of reuse interval 4
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn selection_due(&self) -> bool {
        self.selection_due
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no batch was set yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
