//! Writing the KV cache on the device (`kernels-gpu/src/kv_write`): the decode append, prefill's
//! row writes, key-statistics pooling, and a pseudo-random fill for benchmarks.
//!
//! - [`AppendPlan`] (or [`append_kv`], plan then run): one token per sequence of a
//!   [`DecodeBatch`], checked once, run per layer (part of a decode step: allocates nothing,
//!   never synchronizes, so it can be captured in a CUDA graph).
//! - [`KvWritePlan`] → [`DeviceKvWritePlan`]: token ranges of a batch of sequences, planned on
//!   the host from the [`KvCacheManager`] and uploaded once (plan / run split: one plan serves
//!   every layer); then [`write_kv_rows`] writes a ragged batch's K/V and [`pool_key_stats`]
//!   recomputes the statistics of the logical pages the ranges touch.
//! - [`fill_random`]: deterministic values in `[-1, 1]` without an upload.
//!
//! The device block tables must map the tokens written: [`KvWritePlan::upload`] brings the
//! cache's tables to the manager's and records them, and the writes refuse a plan whose slots'
//! rows the cache no longer holds (`StaleTables`). [`AppendPlan`] takes a [`DecodeBatch`], which
//! does the same ([`DecodeBatch::set`]).
//!
//! ```no_run
//! use half::bf16;
//! use lserve::config::SparsityConfig;
//! use lserve::geometry::ModelGeometry;
//! use lserve::gpu::{fill_random, pool_key_stats, write_kv_rows, DeviceKvCache, GpuContext, KvWritePlan};
//! use lserve::head_pattern::HeadPattern;
//! use lserve::paging::KvCacheManager;
//!
//! let gpu = GpuContext::new(0)?;
//! let g = ModelGeometry::llama3_8b();
//! let pattern = HeadPattern::interleaved(g, 0.5)?;
//! let mut mgr = KvCacheManager::new(g, pattern, SparsityConfig::default(), 4096, 1, 1 << 18)?;
//! let seq = mgr.add_sequence()?;
//! let prompt = mgr.reserve(seq, 1000)?;
//! let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
//! // Prefill's K and V for the prompt, [1000][Hkv][D] (random here).
//! let mut k = gpu.stream().alloc_zeros::<bf16>(1000 * 8 * 128)?;
//! let mut v = gpu.stream().alloc_zeros::<bf16>(1000 * 8 * 128)?;
//! fill_random(&gpu, &mut k, 1)?;
//! fill_random(&gpu, &mut v, 2)?;
//! let plan = KvWritePlan::new(&mgr, &[(seq, prompt)])?.upload(&gpu, &mgr, &mut cache)?;
//! for layer in 0..g.layers() {
//!     write_kv_rows(&gpu, &mut cache, layer, &plan, &k, &v)?;
//!     pool_key_stats(&gpu, &mut cache, layer, &plan)?;
//! }
//! # Ok::<(), lserve::LserveError>(())
//! ```

use std::ops::Range;

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};
use lserve_abi::kv_write::{
    logical_pages_of, pool_pages_per_block, AppendArgs, AppendParams, CodedAppendArgs,
    CodedGatherArgs, CodedWriteRowsArgs, FillArgs, FillParams, GatherArgs, GatherParams, PoolArgs,
    PoolParams, PoolRowsArgs, SeqRange, WriteRowsArgs, WriteRowsParams, CHUNK_ELEMS,
    KV_WRITE_THREADS,
};
use lserve_abi::layout::TokenStrides;

use super::cache::{DecodeBatch, DeviceElement, DeviceKvCache, DeviceLayer};
use super::launch::{kernel_of, Launch};
use super::tokens::{kv_stride, Tokens};
use super::GpuContext;
use crate::error::invalid;
use crate::paging::{KvCacheManager, SeqId};
use crate::quant::KvFormat;
use crate::{LserveError, Result};

/// `u32` words of one [`SeqRange`] as the kernels read it (`#[repr(C)]`, five `u32`).
const RANGE_WORDS: usize = 5;
const _: () = assert!(std::mem::size_of::<SeqRange>() == RANGE_WORDS * 4);

/// The largest `gridDim.y` / `gridDim.z`.
const MAX_GRID_YZ: usize = 65_535;
/// The largest `gridDim.x`.
const MAX_GRID_X: usize = (1 << 31) - 1;

/// Blocks covering `chunks` chunks, one per thread.
fn blocks_for(chunks: usize) -> Result<u32> {
    let blocks = chunks.div_ceil(KV_WRITE_THREADS as usize);
    if blocks > MAX_GRID_X {
        return Err(invalid(
            "launch",
            format!("{chunks} chunks exceed one grid"),
        ));
    }
    Ok(blocks as u32)
}

/// The decode append of one batch, checked once for every layer: [`AppendPlan::new`] checks
/// the batch against the cache and looks the kernel up; [`AppendPlan::run`] appends the token of
/// each sequence to one layer, checking only the layer, the tensors and that the cache still
/// holds the batch's block tables.
///
/// What a run writes: the token of each sequence (position `len - 1`, `len` as set in the
/// batch), `k`, `v` `[B][Hkv][D]` (at least that many elements). Dense KV heads write row
/// `(len - 1) % N_P` of page `block_table[(len - 1) / N_P]` and update their logical page's
/// `kmin`/`kmax` (the key itself if the token starts the logical page, else the per-channel
/// min/max with it: exactly `reference::kv_write::update_key_stats`); streaming KV heads write
/// their sink or ring row. The block tables on the device map the token's page: reserve it, then
/// set the batch ([`DecodeBatch::set`] copies the tables). For a sequence past
/// `dynamic_min_len`, each dense head's index-table entry becomes its held selection followed by
/// the token's page (unless the selection ends with it): between the steps that select, the
/// entries stay current without a selector launch (see [`SelectPlan`](super::SelectPlan)).
///
/// The plan borrows the batch: it cannot be set again while the plan lives.
///
/// ```no_run
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{AppendPlan, DecodeBatch, DeviceKvCache, GpuContext};
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
///
/// let gpu = GpuContext::new(0)?;
/// let g = ModelGeometry::llama3_8b();
/// let pattern = HeadPattern::interleaved(g, 0.5)?;
/// let mut mgr = KvCacheManager::new(g, pattern, SparsityConfig::default(), 4096, 1, 65536)?;
/// let seq = mgr.add_sequence()?;
/// mgr.reserve(seq, 1001)?; // 1000 cached tokens and the new one
/// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
/// let mut batch = DecodeBatch::new(&gpu, 1)?;
/// batch.set(&gpu, &mgr, &mut cache, &[seq])?;
/// let (hkv, d) = (g.kv_heads(), g.head_dim());
/// let k = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let v = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let plan = AppendPlan::new(&gpu, &cache, &batch)?;
/// for layer in 0..g.layers() {
///     // ... the engine computes this layer's k, v of the new token ...
///     plan.run(&gpu, &mut cache, layer, &k, &v)?;
/// }
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct AppendPlan<'b> {
    batch: &'b DecodeBatch,
    /// The append kernel for the cache's element type and format.
    function: CudaFunction,
    /// Whether the cache is integer-coded (`append_kv_int{8,4}_*`).
    coded: bool,
    /// Blocks of the launch: one thread per chunk of the batch's `B * Hkv * D` elements.
    blocks: u32,
}

impl<'b> AppendPlan<'b> {
    /// Checks `batch` against `cache` and looks the kernel up. Launches nothing.
    ///
    /// Errors: `Empty` for an empty batch, `StaleTables` for a batch set against another cache
    /// or tables the cache no longer holds, `InvalidArgument` for a batch length the block
    /// tables cannot hold.
    pub fn new<E: DeviceElement>(
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        batch: &'b DecodeBatch,
    ) -> Result<Self> {
        cache.check_batch(batch)?;
        let g = *cache.pattern().geometry();
        let chunks = batch.len() * g.kv_heads() * g.head_dim() / CHUNK_ELEMS as usize;
        let coded = matches!(cache.format(), KvFormat::Int(_));
        Ok(Self {
            batch,
            function: gpu.function(&kernel_for::<E>("append_kv", cache.format()))?,
            coded,
            blocks: blocks_for(chunks)?,
        })
    }

    /// The batch the plan was made for.
    pub fn batch(&self) -> &'b DecodeBatch {
        self.batch
    }

    /// Appends the batch's token to `layer` (see the type's docs): `k`, `v` `[B][Hkv][D]`, each
    /// a `&CudaSlice` (packed rows) or a [`Tokens`] view with its token stride (the two share
    /// one). Enqueued on the context's stream; allocates nothing and does not synchronize (it
    /// runs inside a captured decode step).
    ///
    /// Errors (nothing launched): `StaleTables` for another cache than the batch's, or one that
    /// took other tables for its slots since; `ShapeMismatch` for short `k`/`v`;
    /// `InvalidArgument` for a bad layer.
    pub fn run<'t, E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
    ) -> Result<()> {
        let (k, v) = (k.into(), v.into());
        cache.check_tables(self.batch)?;
        cache.layer(layer)?;
        let kv = self.check_tensors(gpu, cache, &k, &v)?;
        self.launch(gpu, cache, layer, kv, &k, &v)
    }

    /// The token stride `k` and `v` share, in heads, after checking they hold the batch's rows.
    pub(crate) fn check_tensors<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        k: &Tokens<'_, E>,
        v: &Tokens<'_, E>,
    ) -> Result<u32> {
        let g = *cache.pattern().geometry();
        kv_stride(gpu, k, v, self.batch.len(), g.kv_heads(), g.head_dim())
    }

    /// Enqueues the append on a cache, layer and tensors that passed the checks of
    /// [`run`](Self::run) (`kv`: the tensors' stride).
    pub(crate) fn launch<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        kv: u32,
        k: &Tokens<'_, E>,
        v: &Tokens<'_, E>,
    ) -> Result<()> {
        let batch = self.batch;
        let g = *cache.pattern().geometry();
        let hkv = g.kv_heads();
        let b = batch.len();
        let (max_pages, dynamic_min_len) = (cache.max_pages, cache.dynamic_min_len);
        let selection_layout = cache.selection_layout();
        let (l, tables, _) = cache.layer_parts_mut(layer)?;
        let params = AppendParams {
            batch: b as u32,
            cache: l.layout(hkv, max_pages),
            dynamic_min_len,
            selection: selection_layout,
            strides: TokenStrides {
                kv,
                ..TokenStrides::packed(g.q_heads() as u32, hkv as u32)
            },
        };
        let cfg = LaunchConfig {
            grid_dim: (self.blocks, 1, 1),
            block_dim: (KV_WRITE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = Launch::overlapped(gpu, &self.function);
        let (k, v) = (launch.read(k.view()).cast(), launch.read(v.view()).cast());
        let batch_ptrs = batch.ptrs(&mut launch);
        let (cache_ptrs, selection, codes) = if self.coded {
            let (cache, selection, codes) = l.coded_ptrs_mut(&mut launch, tables)?;
            (cache, selection, Some(codes))
        } else {
            let (cache, selection) = l.ptrs_mut(&mut launch, tables)?;
            (cache, selection, None)
        };
        let append = AppendArgs {
            params,
            k,
            v,
            cache: cache_ptrs,
            selection,
            batch: batch_ptrs,
        };
        if let Some(codes) = codes {
            let args = CodedAppendArgs { append, codes };
            // SAFETY: `append_kv_int{8,4}_*`'s argument struct (the kernel of the cache's
            // format): the 16-bit append's (see below) and
            // the layer's coded buffers, laid out as its 16-bit ones would be (`CodedLayer`); the
            // kernel quantizes each row across its `D / 8` lanes, and the grid is whole rows.
            return unsafe { launch.launch(cfg, &args) };
        }
        let args = append;
        // SAFETY: `append_kv_*`'s argument struct, of the buffers registered above. The grid covers `B * Hkv * D / 8` chunks, `k`/`v` hold at least `B * Hkv * D`
        // elements (checked), the cache buffers have the layouts in `params` (taken from them; the
        // held selections, written by the selector, are shorter than `entry_capacity`), the
        // batch holds distinct live slots of lengths in `1..=max_pages * N_P` (checked when
        // planned; the batch is borrowed, so not set since, and its tables are the cache's:
        // checked on the run), and the block tables hold page ids below the capacity (the
        // manager's).
        // Overlapped: the kernel waits for the previous one (`overlapped_entry`) before touching
        // anything a kernel writes.
        unsafe { launch.launch(cfg, &args) }?;
        Ok(())
    }
}

/// Appends the token of each sequence of `batch` to `layer` of the cache: [`AppendPlan::new`]
/// then [`AppendPlan::run`] (what it writes is in [`AppendPlan`]'s docs; keep a plan to append
/// to every layer with one check of the batch).
///
/// Errors (nothing launched): as [`AppendPlan::new`] and [`AppendPlan::run`].
pub fn append_kv<'t, E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    layer: usize,
    batch: &DecodeBatch,
    k: impl Into<Tokens<'t, E>>,
    v: impl Into<Tokens<'t, E>>,
) -> Result<()> {
    AppendPlan::new(gpu, cache, batch)?.run(gpu, cache, layer, k, v)
}

/// Token ranges of a batch of sequences, planned on the host: for each `(sequence, start..end)`
/// its slot, its current length and where its rows sit in a ragged activation batch (the
/// sequences' tokens concatenated in order, as prefill lays out `k`, `v` `[T][Hkv][D]` with
/// `cu_seqlens`).
///
/// Build it after reserving the tokens; [`upload`](Self::upload) it once and use it for every
/// layer. It records the manager's block-table rows it was made against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvWritePlan {
    ranges: Vec<SeqRange>,
    /// Per range, the manager's row generation of its slot when planned.
    row_generations: Vec<u64>,
    /// The manager it was made from.
    manager: u64,
    rows: usize,
    max_tokens: u32,
    slots: u32,
    max_pages: u32,
    page_tokens: u32,
    logical_tokens: u32,
}

impl KvWritePlan {
    /// Plans positions `range` of each `(seq, range)`, in this order.
    ///
    /// Errors (nothing planned): `Empty` for no ranges; `UnknownSequence`; `TokenNotStored` for a
    /// range past the sequence's length; `InvalidArgument` for a reversed range, a sequence
    /// listed twice, or more ranges or tokens than one launch can cover.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::gpu::KvWritePlan;
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    ///
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 64, 4, 4096)?;
    /// let (a, b) = (mgr.add_sequence()?, mgr.add_sequence()?);
    /// mgr.reserve(a, 100)?;
    /// mgr.reserve(b, 30)?;
    /// let grown = mgr.reserve(a, 20)?; // 100..120
    /// let plan = KvWritePlan::new(&mgr, &[(a, grown), (b, 0..30)])?;
    /// assert_eq!(plan.cu_seqlens(), [0, 20, 50]);
    /// assert_eq!(plan.rows(), 50);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn new(manager: &KvCacheManager, ranges: &[(SeqId, Range<usize>)]) -> Result<Self> {
        if ranges.is_empty() {
            return Err(LserveError::Empty("ranges"));
        }
        if ranges.len() > MAX_GRID_YZ {
            return Err(invalid(
                "ranges",
                format!("{} sequences, at most {MAX_GRID_YZ}", ranges.len()),
            ));
        }
        let mut planned = Vec::with_capacity(ranges.len());
        let mut rows = 0usize;
        for (i, (seq, range)) in ranges.iter().enumerate() {
            if ranges[..i].iter().any(|(s, _)| s == seq) {
                return Err(invalid(
                    "ranges",
                    format!("sequence {} listed twice", seq.get()),
                ));
            }
            let len = manager.len(*seq)?;
            if range.start > range.end {
                return Err(invalid("ranges", format!("reversed range {range:?}")));
            }
            if range.end > len {
                return Err(LserveError::TokenNotStored {
                    position: range.end - 1,
                    len,
                });
            }
            planned.push(SeqRange {
                slot: manager.slot(*seq)?,
                start: range.start as u32,
                end: range.end as u32,
                len: len as u32,
                first_row: u32::try_from(rows)
                    .map_err(|_| invalid("ranges", "more than u32::MAX rows"))?,
            });
            rows += range.len();
        }
        u32::try_from(rows).map_err(|_| invalid("ranges", "more than u32::MAX rows"))?;
        let config = manager.config();
        Ok(Self {
            max_tokens: planned.iter().map(|r| r.end - r.start).max().unwrap_or(0),
            row_generations: planned
                .iter()
                .map(|r| manager.row_generation(r.slot))
                .collect(),
            manager: manager.id(),
            ranges: planned,
            rows,
            slots: manager.max_sequences() as u32,
            max_pages: manager.max_pages_per_seq() as u32,
            page_tokens: config.page_tokens as u32,
            logical_tokens: config.logical_page_tokens as u32,
        })
    }

    /// The planned ranges, in order.
    pub fn ranges(&self) -> &[SeqRange] {
        &self.ranges
    }

    /// Activation rows the ranges take together (`T`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The ragged batch's offsets: `B + 1` entries, range `b`'s rows are
    /// `cu_seqlens[b]..cu_seqlens[b + 1]`.
    pub fn cu_seqlens(&self) -> Vec<u32> {
        let mut cu: Vec<u32> = self.ranges.iter().map(|r| r.first_row).collect();
        cu.push(self.rows as u32);
        cu
    }

    /// The most logical pages one range touches (the pooling launch's extent).
    pub fn max_logical_pages(&self) -> u32 {
        self.ranges
            .iter()
            .map(|r| {
                let (first, end) = logical_pages_of(r.start, r.end, self.logical_tokens);
                end - first
            })
            .max()
            .unwrap_or(0)
    }

    /// Checks that the plan describes `manager`'s block tables as they are now: made from this
    /// manager, and no planned slot's row changed since (a reservation that opened a page, a
    /// slot that changed hands). `StaleTables` otherwise. [`upload`](Self::upload) checks this
    /// first.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::gpu::KvWritePlan;
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    /// use lserve::LserveError;
    ///
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 8, 2, 4096)?;
    /// let seq = mgr.add_sequence()?;
    /// let prompt = mgr.reserve(seq, 100)?; // pages 0 and 1
    /// let plan = KvWritePlan::new(&mgr, &[(seq, prompt)])?;
    /// mgr.reserve(seq, 20)?; // still page 1
    /// plan.check_current(&mgr)?;
    /// mgr.reserve(seq, 20)?; // opens page 2
    /// assert!(matches!(plan.check_current(&mgr), Err(LserveError::StaleTables { .. })));
    /// assert!(matches!(plan.check_current(&mgr.clone()), Err(LserveError::StaleTables { .. })));
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn check_current(&self, manager: &KvCacheManager) -> Result<()> {
        if manager.id() != self.manager {
            return Err(LserveError::StaleTables {
                what: "plan",
                reason: "made from another manager".into(),
            });
        }
        for (r, &generation) in self.ranges.iter().zip(&self.row_generations) {
            if manager.row_generation(r.slot) != generation {
                return Err(LserveError::StaleTables {
                    what: "plan",
                    reason: format!(
                        "slot {}'s block table changed since the plan was made: plan again",
                        r.slot
                    ),
                });
            }
        }
        Ok(())
    }

    /// The ranges in device memory, for [`write_kv_rows`] and [`pool_key_stats`] on `cache`:
    /// brings the cache's block tables to `manager`'s (only the rows that changed; a slot that
    /// changed hands gets its selection state reset) and records them.
    ///
    /// Errors (nothing changed): `StaleTables` if `manager` is not the one the plan was made
    /// from or changed a planned slot's block table since; `InvalidArgument` for a plan or
    /// manager shaped differently from the cache.
    ///
    /// ```no_run
    /// use half::bf16;
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::gpu::{DeviceKvCache, GpuContext, KvWritePlan};
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    /// use lserve::LserveError;
    ///
    /// let gpu = GpuContext::new(0)?;
    /// let g = ModelGeometry::llama3_8b();
    /// let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 2, 65536)?;
    /// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// let seq = mgr.add_sequence()?;
    /// let prompt = mgr.reserve(seq, 100)?;
    /// let plan = KvWritePlan::new(&mgr, &[(seq, prompt)])?;
    /// mgr.reserve(seq, 100)?; // opens a page: the plan no longer describes the tables
    /// assert!(matches!(plan.upload(&gpu, &mgr, &mut cache), Err(LserveError::StaleTables { .. })));
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn upload<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        manager: &KvCacheManager,
        cache: &mut DeviceKvCache<E>,
    ) -> Result<DeviceKvWritePlan> {
        self.check_current(manager)?;
        if self.slots != cache.slots
            || self.max_pages != cache.max_pages
            || self.page_tokens as usize != cache.config.page_tokens
            || self.logical_tokens as usize != cache.config.logical_page_tokens
        {
            return Err(invalid(
                "plan",
                "made for a manager shaped differently from this cache",
            ));
        }
        cache.sync(gpu, manager)?;
        let words: Vec<u32> = self
            .ranges
            .iter()
            .flat_map(|r| [r.slot, r.start, r.end, r.len, r.first_row])
            .collect();
        Ok(DeviceKvWritePlan {
            ranges: gpu.stream().clone_htod(&words)?,
            plan: self.clone(),
            cache: cache.id(),
        })
    }

    /// Whether this plan was made for a cache shaped like `cache`'s layer `l`.
    fn check_cache<E>(
        &self,
        cache_slots: u32,
        cache_max_pages: u32,
        l: &DeviceLayer<E>,
    ) -> Result<()> {
        if self.slots != cache_slots
            || self.max_pages != cache_max_pages
            || self.page_tokens != l.paged.page_tokens
            || self.logical_tokens != l.paged.logical_tokens
        {
            return Err(invalid(
                "plan",
                "made for a manager shaped differently from this cache",
            ));
        }
        Ok(())
    }
}

/// A [`KvWritePlan`] in device memory, for the cache it was uploaded for.
pub struct DeviceKvWritePlan {
    ranges: CudaSlice<u32>,
    plan: KvWritePlan,
    /// The cache it was uploaded for.
    cache: u64,
}

impl DeviceKvWritePlan {
    /// The host plan it was uploaded from.
    pub fn plan(&self) -> &KvWritePlan {
        &self.plan
    }

    /// Checks that `cache` is the one the plan was uploaded for and still holds the planned
    /// slots' block-table rows (`StaleTables` otherwise).
    pub(crate) fn check_current<E: DeviceElement>(&self, cache: &DeviceKvCache<E>) -> Result<()> {
        if cache.id() != self.cache {
            return Err(LserveError::StaleTables {
                what: "plan",
                reason: "uploaded for another device cache".into(),
            });
        }
        cache.mirror.check_rows(
            "plan",
            self.plan.manager,
            self.plan
                .ranges
                .iter()
                .map(|r| r.slot)
                .zip(self.plan.row_generations.iter().copied()),
        )
    }
}

/// Writes a ragged batch's K/V into `layer` of the cache: `k`, `v` are `[T][Hkv][D]` with `T =
/// plan.rows()`, the tokens of each planned range in order ([`KvWritePlan::cu_seqlens`]).
///
/// Dense heads write every token into its page; streaming heads only the tokens they hold at the
/// sequence's length (the sinks and the last `local_tokens`), as
/// `HostKvCache::write_token`. Key statistics are left alone: run [`pool_key_stats`] with the
/// same plan after. Enqueued on the context's stream.
///
/// On an integer-coded cache ([`DeviceKvCache::new_coded`]) each row is quantized as it is
/// written, exactly as `reference::quant::quantize_rows` does, and the statistics of every
/// logical page the ranges touch are computed here too, from `k` (the keys before quantization,
/// which the statistics bound; a logical page that begins before a range's start keeps its
/// earlier tokens' bounds and takes the range's rows). [`pool_key_stats`] is then refused: such a
/// cache keeps no 16-bit keys to pool from.
///
/// Errors (nothing launched): `StaleTables` for a plan uploaded for another cache or made
/// against rows the cache no longer holds; `ShapeMismatch` for short `k`/`v`; `InvalidArgument`
/// for a bad layer or a plan made for another cache shape.
pub fn write_kv_rows<'t, E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    layer: usize,
    plan: &DeviceKvWritePlan,
    k: impl Into<Tokens<'t, E>>,
    v: impl Into<Tokens<'t, E>>,
) -> Result<()> {
    let (k, v) = (k.into(), v.into());
    plan.check_current(cache)?;
    let g = *cache.pattern().geometry();
    let (hkv, d) = (g.kv_heads(), g.head_dim());
    let host = &plan.plan;
    let kv = kv_stride(gpu, &k, &v, host.rows, hkv, d)?;
    let (slots, max_pages, format) = (cache.slots, cache.max_pages, cache.format());
    let (l, tables, _) = cache.layer_parts_mut(layer)?;
    host.check_cache(slots, max_pages, l)?;
    let chunks = host.max_tokens as usize * hkv * d / CHUNK_ELEMS as usize;
    if chunks == 0 {
        return Ok(());
    }
    let params = WriteRowsParams {
        sequences: host.ranges.len() as u32,
        cache: l.layout(hkv, max_pages),
        strides: TokenStrides {
            kv,
            ..TokenStrides::packed(g.q_heads() as u32, hkv as u32)
        },
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks_for(chunks)?, host.ranges.len() as u32, 1),
        block_dim: (KV_WRITE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    if l.codes.is_some() {
        let pool = coded_pool_launch(l, hkv, max_pages, host)?;
        let f = gpu.function(&kernel_for::<E>("write_kv_rows", format))?;
        let pool_f = gpu.function(kernel_of::<E>(
            "pool_key_stats_rows_bf16",
            "pool_key_stats_rows_f16",
        ))?;
        {
            let mut launch = Launch::new(gpu, &f);
            let (k, v) = (launch.read(k.view()).cast(), launch.read(v.view()).cast());
            let ranges = launch.read(&plan.ranges).cast();
            let (cache_ptrs, _, codes) = l.coded_ptrs_mut(&mut launch, tables)?;
            let rows = WriteRowsArgs {
                params,
                ranges,
                k,
                v,
                cache: cache_ptrs,
            };
            let args = CodedWriteRowsArgs { rows, codes };
            // SAFETY: `write_kv_rows_int{8,4}_*`'s argument struct (the kernel of the cache's
            // format): the 16-bit row write's (see
            // below) and the layer's coded buffers, laid out as its 16-bit ones would be
            // (`CodedLayer`); each row is quantized across its `D / 8` lanes, and the blocks
            // are whole rows (`KV_WRITE_THREADS` is a multiple of `D / 8`).
            unsafe { launch.launch(cfg, &args) }?;
        }
        let Some((pool_params, pool_cfg)) = pool else {
            return Ok(());
        };
        let mut launch = Launch::new(gpu, &pool_f);
        let k = launch.read(k.view()).cast();
        let ranges = launch.read(&plan.ranges).cast();
        let (cache_ptrs, _, _) = l.coded_ptrs_mut(&mut launch, tables)?;
        let args = PoolRowsArgs {
            pool: PoolArgs {
                params: pool_params,
                ranges,
                cache: cache_ptrs,
            },
            k,
            kv_stride: kv,
        };
        // SAFETY: `pool_key_stats_rows_*`'s argument struct, of the buffers registered above;
        // the ranges are valid for a cache of this shape (checked), `k` holds the plan's `T`
        // rows at stride `kv` (checked), the grid is `(logical page blocks, KV heads, ranges)`.
        return unsafe { launch.launch(pool_cfg, &args) };
    }
    let f = gpu.function(kernel_of::<E>("write_kv_rows_bf16", "write_kv_rows_f16"))?;
    let mut launch = Launch::new(gpu, &f);
    let (k, v) = (launch.read(k.view()).cast(), launch.read(v.view()).cast());
    let ranges = launch.read(&plan.ranges).cast();
    let (cache_ptrs, _) = l.ptrs_mut(&mut launch, tables)?;
    let args = WriteRowsArgs {
        params,
        ranges,
        k,
        v,
        cache: cache_ptrs,
    };
    // SAFETY: `write_kv_rows_*`'s argument struct, of the buffers registered above; `plan.ranges` holds
    // `sequences` `SeqRange`s (five `u32` each, `#[repr(C)]`) that the manager validated
    // (`start <= end <= len`, distinct live slots) for a cache of this shape (checked), so their
    // block-table rows map every page below `len`; `k`/`v` hold `T` rows of `Hkv * D` elements at
    // their stride (checked);
    // the grid covers the longest range's chunks.
    unsafe { launch.launch(cfg, &args) }?;
    Ok(())
}

/// Recomputes `kmin`/`kmax` of every dense head of `layer` for each logical page that holds a
/// position of a planned range, over the page's tokens below the sequence's length: exactly
/// `reference::kv_write::pool_key_stats`. Run after the rows are in the cache (e.g. after
/// [`write_kv_rows`] with the same plan). Enqueued on the context's stream.
///
/// Errors (nothing launched): `StaleTables` as [`write_kv_rows`]; `InvalidArgument` for a bad
/// layer, a plan made for another cache shape, or an integer-coded cache (its statistics are
/// computed by [`write_kv_rows`], from the keys before quantization).
pub fn pool_key_stats<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    layer: usize,
    plan: &DeviceKvWritePlan,
) -> Result<()> {
    plan.check_current(cache)?;
    if matches!(cache.format(), KvFormat::Int(_)) {
        return Err(invalid(
            "cache",
            "an integer-coded cache keeps no 16-bit keys to pool: write_kv_rows computes its \
             statistics from the keys it quantizes",
        ));
    }
    let hkv = cache.pattern().geometry().kv_heads();
    let host = &plan.plan;
    let (slots, max_pages) = (cache.slots, cache.max_pages);
    let (l, tables, _) = cache.layer_parts_mut(layer)?;
    host.check_cache(slots, max_pages, l)?;
    let dense_heads = l.paged.heads as usize;
    let pages = host.max_logical_pages();
    if dense_heads == 0 || pages == 0 {
        return Ok(());
    }
    if dense_heads > MAX_GRID_YZ {
        return Err(invalid("layer", "more dense heads than one launch covers"));
    }
    let params = PoolParams {
        sequences: host.ranges.len() as u32,
        cache: l.layout(hkv, max_pages),
    };
    let f = gpu.function(kernel_of::<E>("pool_key_stats_bf16", "pool_key_stats_f16"))?;
    let cfg = LaunchConfig {
        grid_dim: (
            pages.div_ceil(pool_pages_per_block(l.paged.head_dim)),
            dense_heads as u32,
            host.ranges.len() as u32,
        ),
        block_dim: (KV_WRITE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = Launch::new(gpu, &f);
    let ranges = launch.read(&plan.ranges).cast();
    let (cache_ptrs, _) = l.ptrs_mut(&mut launch, tables)?;
    let args = PoolArgs {
        params,
        ranges,
        cache: cache_ptrs,
    };
    // SAFETY: `pool_key_stats_*`'s argument struct, of the buffers registered above; the ranges are valid for
    // a cache of this shape (checked, see `write_kv_rows`); the grid is `(logical page blocks,
    // dense heads, ranges)` as the kernel expects.
    unsafe { launch.launch(cfg, &args) }?;
    Ok(())
}

/// The parameters and grid of `pool_key_stats_rows_*` for `plan` on layer `l` (`None`: nothing
/// to pool, no dense head or no logical page).
fn coded_pool_launch<E: DeviceElement>(
    l: &DeviceLayer<E>,
    kv_heads: usize,
    max_pages: u32,
    plan: &KvWritePlan,
) -> Result<Option<(PoolParams, LaunchConfig)>> {
    let pages = plan.max_logical_pages();
    if l.paged.heads == 0 || pages == 0 {
        return Ok(None);
    }
    if kv_heads > MAX_GRID_YZ {
        return Err(invalid("layer", "more KV heads than one launch covers"));
    }
    let params = PoolParams {
        sequences: plan.ranges.len() as u32,
        cache: l.layout(kv_heads, max_pages),
    };
    let cfg = LaunchConfig {
        grid_dim: (
            pages.div_ceil(pool_pages_per_block(l.paged.head_dim)),
            kv_heads as u32,
            plan.ranges.len() as u32,
        ),
        block_dim: (KV_WRITE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok(Some((params, cfg)))
}

/// Gathers positions `0..end` of each range of `ranges` (`sequences` [`GatherRange`]s as
/// words; `max_end` the longest) into `k_out` / `v_out` (packed `[rows][Hkv][D]`): the cached
/// positions below `prefix` from `layer` of the cache, the rest from `k` / `v` (activation rows
/// `stride` heads apart). For [`super::prefill_chunks_into_cache`], which checked the ranges
/// (live slots of the cache's current tables, `prefix < end`, activation rows inside `k` / `v`,
/// output rows inside `k_out` / `v_out`, disjoint).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gather_kv_rows<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &DeviceKvCache<E>,
    layer: usize,
    ranges: &CudaSlice<u32>,
    sequences: usize,
    max_end: u32,
    stride: u32,
    k: &Tokens<'_, E>,
    v: &Tokens<'_, E>,
    k_out: &mut CudaSlice<E>,
    v_out: &mut CudaSlice<E>,
) -> Result<()> {
    let g = *cache.pattern().geometry();
    let (hkv, d) = (g.kv_heads(), g.head_dim());
    let l = cache.layer(layer)?;
    let chunks = max_end as usize * hkv * d / CHUNK_ELEMS as usize;
    if chunks == 0 || sequences == 0 {
        return Ok(());
    }
    if sequences > MAX_GRID_YZ {
        return Err(invalid(
            "ranges",
            format!("{sequences} sequences, at most {MAX_GRID_YZ}"),
        ));
    }
    let params = GatherParams {
        sequences: sequences as u32,
        cache: l.layout(hkv, cache.max_pages),
        strides: TokenStrides {
            kv: stride,
            ..TokenStrides::packed(g.q_heads() as u32, hkv as u32)
        },
    };
    let f = gpu.function(&kernel_for::<E>("gather_kv_rows", cache.format()))?;
    let cfg = LaunchConfig {
        grid_dim: (blocks_for(chunks)?, sequences as u32, 1),
        block_dim: (KV_WRITE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = Launch::new(gpu, &f);
    let (k, v) = (launch.read(k.view()).cast(), launch.read(v.view()).cast());
    let ranges = launch.read(ranges).cast();
    let (cache_ptrs, _) = l.ptrs(&mut launch, &cache.block_tables);
    let gather = GatherArgs {
        params,
        ranges,
        k,
        v,
        cache: cache_ptrs,
        k_out: launch.write(k_out).cast(),
        v_out: launch.write(v_out).cast(),
    };
    match &l.codes {
        None => {
            // SAFETY: `gather_kv_rows_*`'s argument struct, of the buffers registered above (the
            // cache read only, as the kernel only reads it); the ranges meet the kernel's
            // contract (the caller's checks above); the grid covers the longest range's chunks.
            unsafe { launch.launch(cfg, &gather) }?;
        }
        Some(codes) => {
            let args = CodedGatherArgs {
                gather,
                codes: codes.ptrs(&mut launch),
            };
            // SAFETY: `gather_kv_rows_int{8,4}_*`'s argument struct (the kernel of the cache's
            // format), as the 16-bit gather's above, with the layer's codes and words laid out
            // as its 16-bit K/V would be (`CodedLayer`; the kernel reads the rows from them and
            // never addresses the 16-bit K/V pointers), registered as read.
            unsafe { launch.launch(cfg, &args) }?;
        }
    }
    Ok(())
}

/// The value [`fill_random`] writes at `index` for `seed`, before rounding to the element type:
/// `(n - 2^23) / 2^23` for a 24-bit `n` from a SplitMix64 hash of `(seed, index)` (the kernel
/// runs this same function, from `lserve-abi`).
///
/// ```
/// let x = lserve::gpu::random_fill_value(7, 123);
/// assert!((-1.0..1.0).contains(&x));
/// assert_eq!(x, lserve::gpu::random_fill_value(7, 123));
/// ```
pub fn random_fill_value(seed: u64, index: u64) -> f32 {
    lserve_abi::kv_write::random_value(seed, index)
}

/// Fills `buf` with deterministic pseudo-random values: element `i` is
/// [`random_fill_value`]`(seed, i)` (in `[-1, 1)`, never `-0.0`) rounded to `E` to
/// nearest even (so `1.0` can appear). Enqueued on the context's stream; an empty buffer is left
/// alone.
pub fn fill_random<E: DeviceElement>(
    gpu: &GpuContext,
    buf: &mut CudaSlice<E>,
    seed: u64,
) -> Result<()> {
    fill_random_bits::<E, E>(gpu, buf, seed)
}

/// [`fill_random`] of the bytes of a buffer of any element type `T`: its whole 16-bit words get
/// the values `fill_random` gives an `E` buffer (coded caches' codes and row words).
pub(crate) fn fill_random_bits<E: DeviceElement, T: cudarc::driver::DeviceRepr>(
    gpu: &GpuContext,
    buf: &mut CudaSlice<T>,
    seed: u64,
) -> Result<()> {
    let len = buf.len() * std::mem::size_of::<T>() / 2;
    if len == 0 {
        return Ok(());
    }
    let params = FillParams {
        len: len as u64,
        seed,
    };
    let f = gpu.function(kernel_of::<E>("fill_random_bf16", "fill_random_f16"))?;
    let cfg = LaunchConfig {
        grid_dim: (blocks_for(len.div_ceil(CHUNK_ELEMS as usize))?, 1, 1),
        block_dim: (KV_WRITE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = Launch::new(gpu, &f);
    let args = FillArgs {
        params,
        out: launch.write(buf).cast(),
    };
    // SAFETY: `fill_random_*`'s argument struct, of the buffer registered above; `buf` holds at
    // least `len` 16-bit words, allocated by the driver (16-byte aligned); the grid covers
    // `len / 8` chunks.
    unsafe { launch.launch(cfg, &args) }?;
    Ok(())
}

/// The name of write kernel `base` for element type `E` and a cache of `format`:
/// `{base}_{dtype}` for a 16-bit cache, `{base}_int{bits}_{dtype}` for a coded one.
fn kernel_for<E: DeviceElement>(base: &str, format: KvFormat) -> String {
    let dtype = E::DTYPE.name();
    match format {
        KvFormat::Float(_) => format!("{base}_{dtype}"),
        KvFormat::Int(f) => format!("{base}_int{}_{dtype}", f.bits.bits()),
    }
}
