//! Page selection on the device (`kernels-gpu/src/select`): the page scorer, the top-K selector
//! with reuse, and the per-sequence decode step counters.
//!
//! A decode step of a model, for the selection part:
//! 1. per layer, after the token's K/V were appended (the statistics are current):
//!    [`SelectPlan::run`] (or its two halves, [`SelectPlan::run_score`] then
//!    [`SelectPlan::run_top_k`]), one plan made for the batch serving every layer;
//! 2. once, after every layer: [`advance_decode_steps`].
//!
//! When a sequence is added to a slot (or the slot is reused), the batch or step that first
//! describes it ([`DecodeBatch::set`]) zeroes its step counter and held selections (as
//! [`reset_selection_state`] does). The manager's step counters are the truth: the device's
//! follow them ([`DecodeBatch::set`] writes the manager's where the device's differ).
//!
//! Selection runs for a (sequence, dense KV head) when the sequence is longer than `dynamic_min_len` and its step counter is a multiple of the
//! reuse interval, or the head holds no selection yet; in between the held selection is reused
//! plus the newest page, which the decode append adds to the entry (`docs/ARCHITECTURE.md`,
//! "Reuse"). Everything — counters, held selections, index tables — stays on the device: the
//! step launches allocate nothing and never synchronize, so they can be captured in a CUDA
//! graph. Launch sizes come from the batch's lengths as last set, but every kernel loops over
//! what it finds on the device, so a captured launch stays correct as the sequences grow.
//!
//! ```no_run
//! use half::bf16;
//! use lserve::config::SparsityConfig;
//! use lserve::geometry::ModelGeometry;
//! use lserve::gpu::{advance_decode_steps, DecodeBatch, DeviceKvCache, GpuContext, SelectPlan,
//!                   SelectWorkspace};
//! use lserve::head_pattern::HeadPattern;
//! use lserve::paging::KvCacheManager;
//!
//! let gpu = GpuContext::new(0)?;
//! let g = ModelGeometry::llama3_8b();
//! let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?,
//!                                   SparsityConfig::default(), 8192, 4, 1 << 18)?;
//! let seq = mgr.add_sequence()?;
//! mgr.reserve(seq, 100_000)?;
//! let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
//! let mut ws = SelectWorkspace::new(&gpu, &cache, 4)?;
//! let mut batch = DecodeBatch::new(&gpu, 4)?;
//! batch.set(&gpu, &mgr, &mut cache, &[seq])?;
//! let q = gpu.stream().alloc_zeros::<bf16>(g.q_heads() * g.head_dim())?;
//! let plan = SelectPlan::new(&gpu, &cache, &batch, &ws)?;
//! for layer in 0..g.layers() {
//!     plan.run(&gpu, &mut cache, layer, &q, &mut ws)?;
//! }
//! advance_decode_steps(&gpu, &mut cache, &batch)?;
//! mgr.advance_decode_step(seq)?; // the manager's counter: the device's follows it
//! # Ok::<(), lserve::LserveError>(())
//! ```

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};
use lserve_abi::buffers::StatCodesPtrs;
use lserve_abi::layout::TokenStrides;
use lserve_abi::select::{
    score_smem_bytes, score_tile_units, ScoreArgs, SelectArgs, SelectParams, StepArgs,
    AGGREGATE_MAX, AGGREGATE_MEAN, SCORE_BLOCKS_PER_SM, SCORE_THREADS, SELECT_SMEM_BYTES,
    SELECT_THREADS, STEP_THREADS,
};

use super::cache::{
    fresh_id, layer_out_of_range, DecodeBatch, DeviceElement, DeviceKvCache, DeviceLayer,
};
use super::launch::{check_shape, Launch};
use super::stat_codes::StatCodesLayer;
use super::tokens::Tokens;
use super::GpuContext;
use crate::config::{GqaAggregation, SparsityConfig};
use crate::dtype::DType;
use crate::paging::HostKvCache;
use crate::quant::StatsFormat;
use crate::{LserveError, Result};

/// Device scratch of page selection: the unit scores of every (sequence, dense KV head) pair,
/// `[max_batch][dense heads][max_units]` `f32`, `max_units` the block tables' `max_pages` times
/// the units per page (for a layer with `Hd` dense heads the score of unit `u` of pair `(b, h)`
/// is at `(b * Hd + h) * max_units + u`). Allocated once; one workspace serves every layer, one
/// layer at a time.
pub struct SelectWorkspace {
    /// This workspace's identity (plans record it).
    id: u64,
    scores: CudaSlice<f32>,
    max_batch: usize,
    dense_heads: usize,
    max_units: usize,
}

impl SelectWorkspace {
    /// Room for batches of up to `max_batch` sequences of `cache` (its widest layer and its
    /// longest block table). `Empty` if `max_batch == 0`.
    pub fn new<E: DeviceElement>(
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        max_batch: usize,
    ) -> Result<Self> {
        if max_batch == 0 {
            return Err(LserveError::Empty("batch"));
        }
        let dense_heads = cache.pattern().max_dense_heads();
        let max_units = cache.max_units();
        let n = (max_batch * dense_heads * max_units).max(1);
        Ok(Self {
            id: fresh_id(),
            scores: gpu.stream().alloc_zeros(n)?,
            max_batch,
            dense_heads,
            max_units,
        })
    }

    /// The largest batch the workspace serves.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// The scores as last written (layout in the type's docs), for tests and debugging;
    /// synchronizes the stream.
    #[doc(hidden)]
    pub fn download_scores(&self, gpu: &GpuContext) -> Result<Vec<f32>> {
        let scores = gpu.stream().clone_dtoh(&self.scores)?;
        gpu.stream().synchronize()?;
        Ok(scores)
    }

    /// Overwrites every score with `value` (tests poison the workspace before a run).
    #[doc(hidden)]
    pub fn poison(&mut self, gpu: &GpuContext, value: f32) -> Result<()> {
        let fill = vec![value; self.scores.len()];
        gpu.stream().memcpy_htod(&fill, &mut self.scores)?;
        Ok(())
    }
}

/// The scorer for element type, head dim and statistics (`score_pages_bf16_d128`,
/// `score_pages_q8_bf16_d128` over 8-bit statistics; the group size is a launch parameter).
fn score_kernel_name(
    dtype: DType,
    head_dim: usize,
    group: usize,
    stats: StatsFormat,
) -> Result<String> {
    check_shape(head_dim, group)?;
    let q8 = match stats {
        StatsFormat::Half => "",
        StatsFormat::Int8(_) => "q8_",
    };
    Ok(format!("score_pages_{q8}{}_d{head_dim}", dtype.name()))
}

/// The top-K kernel for `config`'s selection unit: `select_pages` for physical pages (or logical
/// pages as large as them), `select_logical_pages` for logical pages inside them.
fn top_k_kernel_name(config: &SparsityConfig) -> &'static str {
    if config.units_per_page() > 1 {
        "select_logical_pages"
    } else {
        "select_pages"
    }
}

/// Scorer blocks per pair (`grid.x`): one tile per warp covers the longest sequence (`tiles`
/// warp tiles of [`score_tile_units`] units), but no more than [`SCORE_BLOCKS_PER_SM`] blocks
/// per SM over all `pairs`
/// (one wave, rounded down, so a launch is never a wave and a small tail) — past that the warps
/// loop (the kernel's grid-stride loop covers any grid, so this only sizes the work, never
/// decides what is scored). More blocks would only queue: on a step where no pair is due every
/// block launches just to exit (kernels-gpu/src/select/DESIGN.md has the measurements).
fn score_blocks_per_pair(sm_count: u32, pairs: u32, tiles: u32) -> u32 {
    let cover = tiles.div_ceil(SCORE_THREADS / 32).max(1);
    let fill = ((SCORE_BLOCKS_PER_SM * sm_count.max(1)) / pairs.max(1)).max(1);
    cover.min(fill)
}

/// The launch parameters of `layer` for a batch of `batch` sequences, after checking the
/// cache's capacities hold what selection writes.
fn select_params<E: DeviceElement>(
    cache: &DeviceKvCache<E>,
    layer: &DeviceLayer<E>,
    batch: usize,
) -> Result<SelectParams> {
    let cfg = &cache.config;
    let top_k = cfg.pages_per_selection();
    let reuse_interval =
        u32::try_from(cfg.reuse_interval).map_err(|_| LserveError::InvalidConfig {
            field: "reuse_interval",
            reason: format!("{} does not fit in u32", cfg.reuse_interval),
        })?;
    // An index entry never lists more than the sequence's units. A held row also keeps the
    // selection's newest unit in its last word.
    let held_needed = cfg.held_selection_pages() + 1;
    let entry_needed = cfg.selection_entry_pages().min(cache.max_units());
    if (cache.held_capacity as usize) < held_needed
        || (cache.entry_capacity as usize) < entry_needed
    {
        return Err(LserveError::InvalidArgument {
            what: "cache",
            reason: format!(
                "held / index capacities {} / {} below {held_needed} / {entry_needed}",
                cache.held_capacity, cache.entry_capacity
            ),
        });
    }
    Ok(SelectParams {
        batch: batch as u32,
        cache: layer.layout(cache.pattern().geometry().kv_heads(), cache.max_pages),
        selection: cache.selection_layout(),
        dynamic_min_len: cache.dynamic_min_len,
        reuse_interval,
        top_k: top_k as u32,
        always_include_first: u32::from(cfg.always_include_first_page),
        aggregation: match cfg.gqa_aggregation {
            GqaAggregation::Max => AGGREGATE_MAX,
            GqaAggregation::Mean => AGGREGATE_MEAN,
        },
        group: cache.pattern().geometry().group() as u32,
        // The scorer's are set from its `q` (`SelectPlan::check`); the top-K reads none.
        strides: TokenStrides::packed(
            cache.pattern().geometry().q_heads() as u32,
            cache.pattern().geometry().kv_heads() as u32,
        ),
    })
}

/// Checks that `ws` holds a layer's scores for `batch` (`dense` dense heads); returns the number
/// of pairs (`B * Hd`).
fn check_pairs<E: DeviceElement>(
    cache: &DeviceKvCache<E>,
    dense: usize,
    batch: &DecodeBatch,
    ws: &SelectWorkspace,
) -> Result<usize> {
    let b = batch.len();
    if b > ws.max_batch || dense > ws.dense_heads || ws.max_units != cache.max_units() {
        return Err(LserveError::InvalidArgument {
            what: "workspace",
            reason: "sized for a smaller batch or another cache".into(),
        });
    }
    let pairs = b * dense;
    if pairs > 65535 {
        return Err(LserveError::InvalidArgument {
            what: "batch",
            reason: format!("{pairs} (sequence, dense head) pairs: at most 65535 per launch"),
        });
    }
    Ok(pairs)
}

/// One layer's top-K launch, checked when its [`SelectPlan`] was made, with its kernel looked up
/// ([`SelectPlan::run_top_k`]; a part of [`SelectLaunch`]).
struct TopKLaunch {
    /// The top-K selector.
    function: CudaFunction,
    /// (sequence, dense KV head) pairs: `B * Hd`; 0 for a layer without dense heads.
    pairs: usize,
    /// The launch parameters (the scorer's too).
    params: SelectParams,
}

impl TopKLaunch {
    /// Enqueues the top-K selector. Its only errors are the launch's own; the arguments must be
    /// the ones its plan checked ([`SelectPlan::check`]).
    fn launch<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        batch: &DecodeBatch,
        ws: &SelectWorkspace,
    ) -> Result<()> {
        if self.pairs == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (self.pairs as u32, 1, 1),
            block_dim: (SELECT_THREADS, 1, 1),
            shared_mem_bytes: SELECT_SMEM_BYTES,
        };
        let (l, block_tables, decode_steps) = cache.layer_parts_mut(layer)?;
        let mut launch = Launch::overlapped(gpu, &self.function);
        let scores = launch.read(&ws.scores);
        let block_tables = launch.read(block_tables);
        let decode_steps = launch.read(decode_steps);
        let selection = l.selection_mut(&mut launch);
        let args = SelectArgs {
            params: self.params,
            scores,
            block_tables,
            batch: batch.ptrs(&mut launch),
            decode_steps,
            selection,
        };
        // SAFETY: `select_pages`'s argument struct, of the buffers registered above. Grid
        // `B * Hd`, `SELECT_THREADS` threads, `SELECT_SMEM_BYTES` of shared memory as the kernel
        // requires; the capacities were checked (`held_capacity >= K + 3`, `entry_capacity >=
        // min(K + 3, max_units)`); slots are live and distinct (`DecodeBatch::set`), so each pair
        // owns its held state and index entry; the workspace rows were written by the scorer for
        // the due pairs of this batch (the only rows whose scores the selector uses; it may load
        // a not-due pair's row before deciding, harmlessly: the workspace is allocated, zeroed,
        // for `max_batch`). Overlapped: the kernel reads `seq_len`, `seq_slot` and the block
        // tables (host copies, enqueued before the previous kernel) before it waits for the
        // previous kernel (`overlapped_entry`), everything else after.
        unsafe { launch.launch(cfg, &args) }?;
        Ok(())
    }
}

/// One layer's page selection (scorer, then top-K), checked by its plan ([`SelectPlan::check`]:
/// the plan's checks, then the layer's and `q`'s), launched without checking again
/// ([`SelectLaunch::launch`]) with the plan's cache, layer, batch, `q` and workspace.
pub(crate) struct SelectLaunch<'p> {
    /// The scorer for the model's element type, head dim and group.
    scorer: &'p CudaFunction,
    /// The token strides of the `q` the launch was checked with.
    strides: TokenStrides,
    /// The top-K half, whose checks are a part of the scorer's.
    top_k: &'p TopKLaunch,
}

impl SelectLaunch<'_> {
    /// Enqueues the scorer, then the top-K selector ([`SelectPlan::run`]). Its only errors are
    /// the launches' own; the arguments must be the ones [`SelectPlan::check`] passed.
    pub(crate) fn launch<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        batch: &DecodeBatch,
        q: &Tokens<'_, E>,
        ws: &mut SelectWorkspace,
    ) -> Result<()> {
        self.score(gpu, cache, layer, batch, q, ws)?;
        self.top_k.launch(gpu, cache, layer, batch, ws)
    }

    /// Enqueues the scorer ([`SelectPlan::run_score`]). Its only errors are the launch's own;
    /// the arguments must be the ones [`SelectPlan::check`] passed.
    fn score<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        layer: usize,
        batch: &DecodeBatch,
        q: &Tokens<'_, E>,
        ws: &mut SelectWorkspace,
    ) -> Result<()> {
        let pairs = self.top_k.pairs;
        if pairs == 0 {
            return Ok(()); // no dense heads in this layer
        }
        let params = SelectParams {
            strides: self.strides,
            ..self.top_k.params
        };
        let l = cache.layer(layer)?;
        let longest = batch.host_lens.iter().copied().max().unwrap_or(1);
        let units = (longest as usize).div_ceil(cache.config.unit_tokens()) as u32;
        let per_unit = (cache.config.unit_tokens() / cache.config.logical_page_tokens) as u32;
        let tiles = units.div_ceil(score_tile_units(per_unit));
        let blocks = score_blocks_per_pair(gpu.sm_count(), pairs as u32, tiles);
        let cfg = LaunchConfig {
            grid_dim: (blocks, pairs as u32, 1),
            block_dim: (SCORE_THREADS, 1, 1),
            shared_mem_bytes: score_smem_bytes(cache.pattern().geometry().head_dim() as u32),
        };
        let mut launch = Launch::overlapped(gpu, self.scorer);
        let args = ScoreArgs {
            params,
            q: launch.read(q.view()).cast(),
            kmin: launch.read(&l.kmin).cast(),
            kmax: launch.read(&l.kmax).cast(),
            stat_codes: match &l.stat_codes {
                Some(c) => c.ptrs(&mut launch),
                None => StatCodesPtrs::NONE,
            },
            block_tables: launch.read(&cache.block_tables),
            head_map: launch.read(&l.head_map),
            batch: batch.ptrs(&mut launch),
            decode_steps: launch.read(&cache.decode_steps),
            held_lens: launch.read(&l.held_lens),
            scores: launch.write(&mut ws.scores),
        };
        // SAFETY: `score_pages_*`'s argument struct, of the buffers registered above. Grid
        // `(blocks, B * Hd)` with `SCORE_THREADS` threads and `score_smem_bytes(D)` of shared
        // memory as the kernel requires; `params.group` is the geometry's (1 to 8, checked when
        // the geometry was made); `q` holds `B * Hq * D` elements (checked); the
        // statistics have the layout in `params.cache.paged` (built from this layer), and the
        // `q8` scorer was looked up only for a cache whose layers keep 8-bit statistics (the
        // configuration's `stats_format`, which built them); the batch's slots
        // and lengths are live (validated by `DecodeBatch::set`) and their block tables hold pool
        // page ids; the workspace holds `B * Hd * max_units` scores (checked). Overlapped: the
        // kernel waits for the previous one (`overlapped_entry`) before touching anything a
        // kernel writes.
        unsafe { launch.launch(cfg, &args) }?;
        Ok(())
    }
}

/// The page selection of one batch, checked once for every layer: [`SelectPlan::new`] checks the
/// batch against the cache, the workspace's size and the cache's selection capacities, and looks
/// the kernels up; [`SelectPlan::run`] selects the pages of one layer, checking only the layer,
/// `q`, the workspace's identity and that the cache still holds the batch's block tables.
///
/// A run scores the physical pages of every (sequence, dense KV head) pair whose selection is
/// due on this step into the workspace ([`run_score`](Self::run_score)), then runs their top-K
/// selection and writes each due pair's held selection and index-table entry (the selection,
/// newest page included; ascending logical order, as physical page ids;
/// [`run_top_k`](Self::run_top_k)). Pairs that are not due (dense decode, or reusing their held
/// selection) are left alone: the append ([`AppendPlan`](super::AppendPlan), or the attention
/// launch that appends, [`AppendAttendPlan`](super::AppendAttendPlan)) keeps a reusing pair's
/// entry (the held selection, then the token's page), so decode tokens are written with one of
/// those; attention reads the block table of sequences at most `dynamic_min_len` long.
///
/// The plan borrows the batch (it cannot be set again while the plan lives) and records the
/// workspace it was checked with.
///
/// ```no_run
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{DecodeBatch, DeviceKvCache, GpuContext, SelectPlan, SelectWorkspace};
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
///
/// let gpu = GpuContext::new(0)?;
/// let g = ModelGeometry::llama3_8b();
/// let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?,
///                                   SparsityConfig::default(), 8192, 4, 1 << 18)?;
/// let seq = mgr.add_sequence()?;
/// mgr.reserve(seq, 100_000)?;
/// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
/// let mut ws = SelectWorkspace::new(&gpu, &cache, 4)?;
/// let mut batch = DecodeBatch::new(&gpu, 4)?;
/// batch.set(&gpu, &mgr, &mut cache, &[seq])?;
/// let q = gpu.stream().alloc_zeros::<bf16>(g.q_heads() * g.head_dim())?;
/// let plan = SelectPlan::new(&gpu, &cache, &batch, &ws)?;
/// for layer in 0..g.layers() {
///     plan.run(&gpu, &mut cache, layer, &q, &mut ws)?;
/// }
/// # Ok::<(), lserve::LserveError>(())
/// ```
///
/// The batch stays borrowed by the plan: it cannot be set again under it.
///
/// ```compile_fail,E0502
/// # use half::bf16;
/// # use lserve::config::SparsityConfig;
/// # use lserve::geometry::ModelGeometry;
/// # use lserve::gpu::{DecodeBatch, DeviceKvCache, GpuContext, SelectPlan, SelectWorkspace};
/// # use lserve::head_pattern::HeadPattern;
/// # use lserve::paging::KvCacheManager;
/// # let gpu = GpuContext::new(0)?;
/// # let g = ModelGeometry::llama3_8b();
/// # let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 4, 65536)?;
/// # let seq = mgr.add_sequence()?;
/// # mgr.reserve(seq, 20_000)?;
/// # let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
/// # let mut ws = SelectWorkspace::new(&gpu, &cache, 4)?;
/// # let q = gpu.stream().alloc_zeros::<bf16>(g.q_heads() * g.head_dim())?;
/// let mut batch = DecodeBatch::new(&gpu, 4)?;
/// batch.set(&gpu, &mgr, &mut cache, &[seq])?;
/// let plan = SelectPlan::new(&gpu, &cache, &batch, &ws)?;
/// batch.set(&gpu, &mgr, &mut cache, &[seq])?; // error: `batch` is borrowed by the plan
/// plan.run(&gpu, &mut cache, 0, &q, &mut ws)?;
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct SelectPlan<'b> {
    batch: &'b DecodeBatch,
    /// The workspace the plan was checked with.
    workspace: u64,
    /// The scorer for the model's element type, head dim and group.
    scorer: CudaFunction,
    /// Per layer, its top-K launch (pairs and parameters).
    layers: Vec<TopKLaunch>,
}

impl<'b> SelectPlan<'b> {
    /// Checks `batch` against `cache`, `ws`'s size against the batch and the cache's widest
    /// layer, the cache's selection capacities, and every layer's launch size; looks the
    /// kernels up. Launches nothing.
    ///
    /// Errors: `Empty` for an empty batch; `StaleTables` for a batch set against another cache
    /// or tables the cache no longer holds; `InvalidArgument` for a batch the cache cannot
    /// hold, a workspace sized for less, capacities below what selection writes, or more than
    /// 65535 (sequence, dense head) pairs in a layer.
    pub fn new<E: DeviceElement>(
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        batch: &'b DecodeBatch,
        ws: &SelectWorkspace,
    ) -> Result<Self> {
        cache.check_batch(batch)?;
        let geometry = *cache.pattern().geometry();
        let name = score_kernel_name(
            E::DTYPE,
            geometry.head_dim(),
            geometry.group(),
            cache.config.stats_format,
        )?;
        let top_k = gpu.function(top_k_kernel_name(&cache.config))?;
        let layers = (0..cache.layers())
            .map(|layer| {
                let l = cache.layer(layer)?;
                Ok(TopKLaunch {
                    pairs: check_pairs(cache, l.paged.heads as usize, batch, ws)?,
                    params: select_params(cache, l, batch.len())?,
                    function: top_k.clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            batch,
            workspace: ws.id,
            scorer: gpu.function(&name)?,
            layers,
        })
    }

    /// The batch the plan was made for.
    pub fn batch(&self) -> &'b DecodeBatch {
        self.batch
    }

    /// Page selection of `layer` (see the type's docs): the scorer, then the top-K selector. After
    /// it, the layer's index tables hold every selecting pair's pages for this step. `q` is
    /// `[B][Hq][D]`: a `&CudaSlice` or a [`Tokens`](super::Tokens) view with its token stride.
    /// Every check runs before the first launch. Enqueued on the context's stream; allocates
    /// nothing and does not synchronize.
    ///
    /// Errors (nothing launched): `StaleTables` for another cache than the batch's, or one that
    /// took other tables for its slots since; `ShapeMismatch` for a short `q`;
    /// `InvalidArgument` for a bad layer or another workspace than the plan's.
    pub fn run<'t, E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        ws: &mut SelectWorkspace,
    ) -> Result<()> {
        let q = q.into();
        self.check(gpu, cache, layer, &q, ws)?
            .launch(gpu, cache, layer, self.batch, &q, ws)
    }

    /// The first half of [`run`](Self::run): scores the pages of every due pair of `layer` into
    /// `ws`. Errors as [`run`](Self::run).
    pub fn run_score<'t, E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        ws: &mut SelectWorkspace,
    ) -> Result<()> {
        let q = q.into();
        self.check(gpu, cache, layer, &q, ws)?
            .score(gpu, cache, layer, self.batch, &q, ws)
    }

    /// The second half of [`run`](Self::run): the top-K selection of every due pair of `layer`
    /// from the scores in `ws` (written by [`run_score`](Self::run_score) on the same batch and
    /// step). Errors as [`run`](Self::run), less the ones about `q`.
    pub fn run_top_k<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        ws: &SelectWorkspace,
    ) -> Result<()> {
        self.check_layer(cache, layer, ws)?
            .launch(gpu, cache, layer, self.batch, ws)
    }

    /// The checks of a run: [`check_layer`](Self::check_layer), then `q`'s length and stride.
    /// Launches nothing.
    pub(crate) fn check<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        layer: usize,
        q: &Tokens<'_, E>,
        ws: &SelectWorkspace,
    ) -> Result<SelectLaunch<'_>> {
        let top_k = self.check_layer(cache, layer, ws)?;
        let geometry = *cache.pattern().geometry();
        let (hq, d) = (geometry.q_heads(), geometry.head_dim());
        let strides = TokenStrides {
            q: q.heads_stride(gpu, "q", self.batch.len(), hq, d)?,
            ..top_k.params.strides
        };
        Ok(SelectLaunch {
            scorer: &self.scorer,
            strides,
            top_k,
        })
    }

    /// The checks of a run less `q`'s: the cache holds the batch's tables, `ws` is the plan's,
    /// `layer` is one of the cache's. Returns the layer's top-K launch.
    fn check_layer<E: DeviceElement>(
        &self,
        cache: &DeviceKvCache<E>,
        layer: usize,
        ws: &SelectWorkspace,
    ) -> Result<&TopKLaunch> {
        cache.check_tables(self.batch)?;
        if ws.id != self.workspace {
            return Err(LserveError::InvalidArgument {
                what: "workspace",
                reason: "not the one the plan was made with".into(),
            });
        }
        self.layers
            .get(layer)
            .ok_or_else(|| layer_out_of_range(layer, self.layers.len()))
    }
}

/// Scores the pages of `layer`'s due pairs into `ws`: [`SelectPlan::new`] then
/// [`SelectPlan::run_score`] (keep a plan to score every layer with one check of the batch).
///
/// Errors (nothing launched): as [`SelectPlan::new`] and [`SelectPlan::run`].
pub fn score_pages<'t, E: DeviceElement>(
    gpu: &GpuContext,
    cache: &DeviceKvCache<E>,
    layer: usize,
    batch: &DecodeBatch,
    q: impl Into<Tokens<'t, E>>,
    ws: &mut SelectWorkspace,
) -> Result<()> {
    SelectPlan::new(gpu, cache, batch, ws)?.run_score(gpu, cache, layer, q, ws)
}

/// The top-K selection of `layer`'s due pairs from the scores in `ws`: [`SelectPlan::new`] then
/// [`SelectPlan::run_top_k`].
///
/// Errors (nothing launched): as [`SelectPlan::new`] and [`SelectPlan::run_top_k`].
pub fn select_top_k<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    layer: usize,
    batch: &DecodeBatch,
    ws: &SelectWorkspace,
) -> Result<()> {
    SelectPlan::new(gpu, cache, batch, ws)?.run_top_k(gpu, cache, layer, ws)
}

/// Page selection of `layer` for `batch`: [`SelectPlan::new`] then [`SelectPlan::run`] (keep a
/// plan to select in every layer with one check of the batch).
///
/// Errors (nothing launched): as [`SelectPlan::new`] and [`SelectPlan::run`].
pub fn select_pages<'t, E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    layer: usize,
    batch: &DecodeBatch,
    q: impl Into<Tokens<'t, E>>,
    ws: &mut SelectWorkspace,
) -> Result<()> {
    SelectPlan::new(gpu, cache, batch, ws)?.run(gpu, cache, layer, q, ws)
}

/// Advances the device's decode step counter of every sequence of `batch` by one: call once per
/// model step, after every layer's selection, with the manager's
/// (`KvCacheManager::advance_decode_step`; [`PlannedStep::finish`](super::PlannedStep::finish)
/// does both). Where the two differ at the next [`DecodeBatch::set`], the device takes the
/// manager's. Allocates nothing, does not synchronize.
pub fn advance_decode_steps<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    batch: &DecodeBatch,
) -> Result<()> {
    enqueue_advance(gpu, cache, batch)?;
    cache.mirror.advanced(&batch.host_slots);
    Ok(())
}

/// [`advance_decode_steps`]' launch without recording it in the cache's host mirror: for a
/// launch captured in a graph that may never run (the session captures a step twice, with and
/// without the selector, and replays one; the replay records the advance,
/// [`PlannedStep::replayed`](super::PlannedStep::replayed)).
pub(crate) fn enqueue_advance<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    batch: &DecodeBatch,
) -> Result<()> {
    cache.check_batch(batch)?;
    let b = batch.len();
    let f = gpu.function("advance_decode_steps")?;
    let cfg = LaunchConfig {
        grid_dim: ((b as u32).div_ceil(STEP_THREADS), 1, 1),
        block_dim: (STEP_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = Launch::overlapped(gpu, &f);
    let args = StepArgs {
        batch: b as u32,
        seq_slot: launch.read(&batch.seq_slot),
        decode_steps: launch.write(&mut cache.decode_steps),
    };
    // SAFETY: `advance_decode_steps`'s argument struct, of the buffers registered above; the grid covers `b`
    // threads; the batch's slots are distinct live slots below the cache's slot count
    // (`DecodeBatch::set`), each with one counter.
    // Overlapped: the kernel waits for the previous one (`overlapped_entry`) before touching
    // anything a kernel writes.
    unsafe { launch.launch(cfg, &args) }?;
    Ok(())
}

/// Zeroes the selection state of `slot`: its decode step counter and, in every layer, the held
/// selections of its dense heads; its next step selects. [`DecodeBatch::set`] does this for
/// every slot that changed hands; for a live sequence the next `set` writes the manager's counter
/// back (the manager's is the truth). Asynchronous on the context's stream.
///
/// Errors: `InvalidArgument` if `slot` is not below the cache's slot count.
pub fn reset_selection_state<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    slot: u32,
) -> Result<()> {
    if slot >= cache.slots {
        return Err(LserveError::InvalidArgument {
            what: "slot",
            reason: format!("{slot} is not below {}", cache.slots),
        });
    }
    cache.reset_selection_state(gpu, slot)
}

/// A layer's selection state as downloaded by [`download_selection`] (device layouts).
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectionState {
    /// `[slots][Hd][held_capacity]` held selections (logical page numbers).
    pub held_pages: Vec<u32>,
    /// `[slots][Hd]`.
    pub held_lens: Vec<u32>,
    /// `[slots][Hd][entry_capacity]` index tables (physical page ids).
    pub index_pages: Vec<u32>,
    /// `[slots][Hd]`.
    pub index_lens: Vec<u32>,
    /// `[slots]` decode step counters.
    pub decode_steps: Vec<u32>,
    /// Row stride of `held_pages`.
    pub held_capacity: usize,
    /// Row stride of `index_pages`.
    pub entry_capacity: usize,
}

/// Downloads `layer`'s held selections and index tables and the step counters (tests and
/// debugging; synchronizes).
#[doc(hidden)]
pub fn download_selection<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &DeviceKvCache<E>,
    layer: usize,
) -> Result<SelectionState> {
    let l = cache.layer(layer)?;
    let stream = gpu.stream();
    let state = SelectionState {
        held_pages: stream.clone_dtoh(&l.held_pages)?,
        held_lens: stream.clone_dtoh(&l.held_lens)?,
        index_pages: stream.clone_dtoh(&l.index_pages)?,
        index_lens: stream.clone_dtoh(&l.index_lens)?,
        decode_steps: stream.clone_dtoh(&cache.decode_steps)?,
        held_capacity: cache.held_capacity as usize,
        entry_capacity: cache.entry_capacity as usize,
    };
    stream.synchronize()?;
    Ok(state)
}

/// Overwrites `layer`'s index tables (pages and lengths) with `value` (tests poison outputs).
#[doc(hidden)]
pub fn poison_index_tables<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    layer: usize,
    value: u32,
) -> Result<()> {
    let stream = gpu.stream().clone();
    let l = cache.layer_mut(layer)?;
    stream.memcpy_htod(&vec![value; l.index_pages.len()], &mut l.index_pages)?;
    stream.memcpy_htod(&vec![value; l.index_lens.len()], &mut l.index_lens)?;
    Ok(())
}

/// Copies the key statistics of every layer of `host` to the device, and codes them again
/// where the cache keeps 8-bit statistics (tests that grow sequences on the host between device
/// selections).
#[doc(hidden)]
pub fn upload_key_stats<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    host: &HostKvCache<E>,
) -> Result<()> {
    if host.layers() != cache.layers() {
        return Err(LserveError::InvalidArgument {
            what: "host cache",
            reason: "another layer count".into(),
        });
    }
    let stream = gpu.stream().clone();
    for layer in 0..cache.layers() {
        let dense = host.dense(layer)?;
        let l = cache.layer_mut(layer)?;
        if dense.layout() != l.paged {
            return Err(LserveError::InvalidArgument {
                what: "host cache",
                reason: format!("layer {layer} laid out differently"),
            });
        }
        if !dense.kmin().is_empty() {
            stream.memcpy_htod(dense.kmin(), &mut l.kmin)?;
            stream.memcpy_htod(dense.kmax(), &mut l.kmax)?;
        }
        if l.stat_codes.is_some() {
            let d = l.paged.head_dim as usize;
            l.stat_codes = Some(StatCodesLayer::of(&stream, d, dense.kmin(), dense.kmax())?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::launch::ptx_has_kernel;
    use super::*;
    use crate::geometry::ModelGeometry;

    #[test]
    fn scorer_grid_covers_short_sequences_and_caps_long_batches() {
        // 132 SMs, 8 warps a block: 256K tokens at 64-token pages of 16-token logical pages
        // (4096 pages, 4 a tile: 1024 tiles), one layer's 4 pairs: 128 blocks cover it.
        assert_eq!(score_blocks_per_pair(132, 4, 1024), 66);
        // Few tiles: one block covers them.
        assert_eq!(score_blocks_per_pair(132, 4, 3), 1);
        // Many pairs: at most 2 blocks per SM in all (batch 16: 4 x 64 = 256 blocks, one wave).
        assert_eq!(score_blocks_per_pair(132, 64, 1024), 4);
        // Never zero.
        assert_eq!(score_blocks_per_pair(0, 0, 0), 1);
    }

    #[test]
    fn kernel_names_cover_the_supported_shapes_only() {
        assert_eq!(
            score_kernel_name(DType::BF16, 128, 4, StatsFormat::Half).unwrap(),
            "score_pages_bf16_d128"
        );
        assert_eq!(
            score_kernel_name(DType::F16, 64, 1, StatsFormat::DEVICE_INT8).unwrap(),
            "score_pages_q8_f16_d64"
        );
        assert_eq!(
            score_kernel_name(DType::BF16, 128, 7, StatsFormat::Half).unwrap(),
            "score_pages_bf16_d128"
        );
        assert!(score_kernel_name(DType::BF16, 256, 4, StatsFormat::Half).is_err());
        assert!(score_kernel_name(DType::BF16, 128, 0, StatsFormat::Half).is_err());
        assert!(score_kernel_name(
            DType::BF16,
            128,
            ModelGeometry::MAX_GROUP + 1,
            StatsFormat::Half
        )
        .is_err());
    }

    /// Every shape `ModelGeometry::new` accepts has its page scorer in the PTX (the top-K half
    /// serves any shape).
    #[test]
    fn every_accepted_geometry_has_its_scorer() {
        for &d in &ModelGeometry::SUPPORTED_HEAD_DIMS {
            for group in 1..=ModelGeometry::MAX_GROUP {
                assert!(ModelGeometry::new(1, 3 * group, 3, d).is_ok());
                for dtype in [DType::BF16, DType::F16] {
                    for stats in [StatsFormat::Half, StatsFormat::DEVICE_INT8] {
                        let name = score_kernel_name(dtype, d, group, stats).unwrap();
                        assert!(ptx_has_kernel(&name), "{name} is not in the PTX");
                    }
                }
            }
        }
        for name in [
            "select_pages",
            "select_logical_pages",
            "advance_decode_steps",
        ] {
            assert!(ptx_has_kernel(name), "{name} is not in the PTX");
        }
    }
}
