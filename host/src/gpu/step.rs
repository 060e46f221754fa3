//! A whole decode step on the device: per layer the append, the selector when due and the
//! attention (the append inside the attention launch where that is latency-bound, else the
//! append kernel first); then advance the step counters. No allocation, no host
//! synchronization: a step can be captured in a CUDA graph and replayed (the batch description
//! and the changed block-table rows are rewritten in place before each replay).
//!
//! A step is a value: [`DecodeStep::plan`] reserves the step's token of every sequence, brings
//! the device's block tables to the manager's (only the rows that changed; a slot that changed
//! hands has its selection state reset), writes the batch description, decides whether the step
//! selects, and returns a [`PlannedStep`] that records the tables it was planned against and
//! holds the manager until the step ends ([`PlannedStep::finish`], or
//! [`PlannedStep::replayed`] after a graph replay, advances the manager's step counters and the
//! device's together). A layer run with a plan on another cache, or on a cache that has taken
//! other tables since (another manager synced it), is `StaleTables`, checked before anything
//! is enqueued.
//!
//! A captured step keeps the launch shapes of its capture: whether it selects
//! ([`PlannedStep::selects`], decided before capturing; a step captured with the selector is
//! correct on every step, one without only where `selects` is false), the batch size, and the
//! number of splits per (sequence, KV head), which was sized for the lengths at capture time.
//! Lengths may grow between replays (the kernels read them, and every split takes a share of the
//! rows found on the device); a different batch size needs another capture.

use cudarc::driver::CudaSlice;

use super::cache::{DecodeBatch, DeviceElement, DeviceKvCache};
use super::decode::{check_lse, AppendAttendPlan, AppendLaunch, DecodeWorkspace};
use super::select::{advance_decode_steps, SelectPlan, SelectWorkspace};
use super::tokens::{Tokens, TokensMut};
use super::GpuContext;
use crate::paging::{KvCacheManager, SeqId};
use crate::Result;

/// The scratch a decode step needs and its batch description, allocated once for batches of up
/// to `max_batch` sequences. [`plan`](Self::plan) starts a step.
///
/// ```no_run
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{DecodeStep, DeviceKvCache, GpuContext};
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
///
/// let gpu = GpuContext::new(0)?;
/// let g = ModelGeometry::llama3_8b();
/// let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 4, 65536)?;
/// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
/// let seq = mgr.add_sequence()?;
/// // ... prefill the sequence into `cache` ...
/// let mut step = DecodeStep::new(&gpu, &cache, 4)?;
/// let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
/// let q = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
/// let k = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let v = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let mut out = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
/// // Reserves the new token, copies the changed table rows, describes the batch.
/// let mut plan = step.plan(&gpu, &mut mgr, &mut cache, &[seq])?;
/// for layer in 0..g.layers() {
///     plan.layer(&gpu, &mut cache, layer, &q, &k, &v, &mut out)?;
/// }
/// plan.finish(&gpu, &mut cache)?; // advances the manager's and the device's step counters
/// assert_eq!(mgr.decode_step(seq)?, 1);
/// # Ok::<(), lserve::LserveError>(())
/// ```
///
/// The manager stays borrowed by the plan until the step ends: it cannot change the tables under
/// a planned step.
///
/// ```compile_fail,E0499
/// # use half::bf16;
/// # use lserve::config::SparsityConfig;
/// # use lserve::geometry::ModelGeometry;
/// # use lserve::gpu::{DecodeStep, DeviceKvCache, GpuContext};
/// # use lserve::head_pattern::HeadPattern;
/// # use lserve::paging::KvCacheManager;
/// # let gpu = GpuContext::new(0)?;
/// # let g = ModelGeometry::llama3_8b();
/// # let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 4, 65536)?;
/// # let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
/// # let seq = mgr.add_sequence()?;
/// # mgr.reserve(seq, 100)?;
/// # let mut step = DecodeStep::new(&gpu, &cache, 4)?;
/// let plan = step.plan(&gpu, &mut mgr, &mut cache, &[seq])?;
/// mgr.free_sequence(seq)?; // error: `mgr` is borrowed by the plan
/// plan.finish(&gpu, &mut cache)?;
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct DecodeStep {
    attention: DecodeWorkspace,
    selection: SelectWorkspace,
    /// The batch description the kernels read, rewritten in place by each plan.
    batch: DecodeBatch,
    /// Where the append runs ([`AppendLaunch::Auto`] unless set).
    append: AppendLaunch,
}

impl DecodeStep {
    /// Workspaces and a batch description for `cache`'s geometry and batches of up to
    /// `max_batch` sequences.
    pub fn new<E: DeviceElement>(
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        max_batch: usize,
    ) -> Result<Self> {
        let g = *cache.pattern().geometry();
        Ok(Self {
            attention: DecodeWorkspace::new(gpu, max_batch, g.kv_heads(), g.group(), g.head_dim())?,
            selection: SelectWorkspace::new(gpu, cache, max_batch)?,
            batch: DecodeBatch::new(gpu, max_batch)?,
            append: AppendLaunch::Auto,
        })
    }

    /// Places the append of every layer as `how` says (default [`AppendLaunch::Auto`]: inside
    /// the attention launch where that is latency-bound). The results are the same.
    ///
    /// ```no_run
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::{AppendLaunch, DecodeStep, DeviceKvCache, GpuContext};
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # let gpu = GpuContext::new(0)?;
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 4, 65536)?;
    /// # let cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// let step = DecodeStep::new(&gpu, &cache, 4)?.with_append_launch(AppendLaunch::Separate);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn with_append_launch(mut self, how: AppendLaunch) -> Self {
        self.append = how;
        self
    }

    /// At most `max_splits` splits per (sequence, KV head) in this step's attention launches
    /// ([`DecodeWorkspace::with_max_splits`]).
    ///
    /// Errors: `InvalidArgument` unless `1 <= max_splits <= MAX_SPLITS`.
    ///
    /// ```no_run
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::{DecodeStep, DeviceKvCache, GpuContext};
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # let gpu = GpuContext::new(0)?;
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 4, 65536)?;
    /// # let cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// let step = DecodeStep::new(&gpu, &cache, 4)?.with_max_splits(16)?;
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn with_max_splits(mut self, max_splits: u32) -> Result<Self> {
        self.attention = self.attention.with_max_splits(max_splits)?;
        Ok(self)
    }

    /// Plans one decode step of `seqs` (in this order): reserves one token per sequence (all
    /// or none, [`KvCacheManager::reserve_each`]), brings `cache`'s block tables to the manager's
    /// (only the rows that changed, into the buffers allocated with the cache; a slot that
    /// changed hands has its step counter and held selections reset), writes the manager's step
    /// counters into the device's where they differ, rewrites the batch description in place,
    /// and decides whether the step launches the selector ([`PlannedStep::selects`]). The plan
    /// holds the manager until [`finish`](PlannedStep::finish) or
    /// [`replayed`](PlannedStep::replayed).
    ///
    /// Errors (nothing changed): `Empty` for no sequence, `InvalidArgument` for more than
    /// `max_batch`, a sequence listed twice or a manager shaped differently from the cache,
    /// `UnknownSequence`, and the errors of the reservation (`PoolExhausted`, `SequenceTooLong`).
    /// A driver error after the reservation leaves the tokens reserved.
    ///
    /// ```no_run
    /// use half::bf16;
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::gpu::{DecodeStep, DeviceKvCache, GpuContext};
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    ///
    /// let gpu = GpuContext::new(0)?;
    /// let g = ModelGeometry::llama3_8b();
    /// let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 4, 65536)?;
    /// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// let seq = mgr.add_sequence()?;
    /// mgr.reserve(seq, 20_000)?;
    /// let mut step = DecodeStep::new(&gpu, &cache, 4)?;
    /// let plan = step.plan(&gpu, &mut mgr, &mut cache, &[seq])?;
    /// assert_eq!(plan.manager().len(seq)?, 20_001);
    /// // Decode step 0 of a sequence past `dynamic_min_len`: it selects.
    /// assert!(plan.selects());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn plan<'a, E: DeviceElement>(
        &'a mut self,
        gpu: &GpuContext,
        manager: &'a mut KvCacheManager,
        cache: &mut DeviceKvCache<E>,
        seqs: &[SeqId],
    ) -> Result<PlannedStep<'a>> {
        self.batch.check_ids(manager, seqs)?;
        cache.check_manager(manager)?;
        manager.reserve_each(seqs, 1)?;
        // Checked above; every sequence now holds the step's token.
        self.batch.write(gpu, manager, cache, seqs)?;
        let Self {
            attention,
            selection,
            batch,
            append,
        } = self;
        let batch: &'a DecodeBatch = batch;
        let selects = batch.selection_due() || cache.selection_pending(batch);
        Ok(PlannedStep {
            attend: AppendAttendPlan::new(gpu, cache, batch, attention, *append)?,
            select: None,
            batch,
            attention,
            selection,
            manager,
            selects,
            selected: false,
        })
    }
}

/// One planned decode step ([`DecodeStep::plan`]): its layers, then its end. It holds the
/// manager (read it with [`manager`](Self::manager)) and records the block tables it was planned
/// against; every layer checks them against the cache it is given (`StaleTables` for another
/// cache, or one that took other tables since) before anything is enqueued.
///
/// Dropped without [`finish`](Self::finish) or [`replayed`](Self::replayed), the step's tokens
/// stay reserved and the step counters stay where they were.
///
/// ```no_run
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{DecodeStep, DeviceKvCache, GpuContext};
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
/// use lserve::LserveError;
///
/// let gpu = GpuContext::new(0)?;
/// let g = ModelGeometry::llama3_8b();
/// let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 1, 65536)?;
/// let seq = mgr.add_sequence()?;
/// mgr.reserve(seq, 1000)?;
/// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
/// let mut elsewhere = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
/// let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
/// let q = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
/// let k = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let v = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let mut out = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
/// let mut step = DecodeStep::new(&gpu, &cache, 1)?;
/// let mut plan = step.plan(&gpu, &mut mgr, &mut cache, &[seq])?;
/// assert_eq!(plan.batch().len(), 1);
/// assert_eq!(plan.manager().len(seq)?, 1001);
/// // Planned for `cache`: refused on another, before anything is enqueued.
/// assert!(matches!(
///     plan.layer(&gpu, &mut elsewhere, 0, &q, &k, &v, &mut out),
///     Err(LserveError::StaleTables { .. })
/// ));
/// for layer in 0..g.layers() {
///     plan.layer(&gpu, &mut cache, layer, &q, &k, &v, &mut out)?;
/// }
/// plan.finish(&gpu, &mut cache)?;
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[must_use = "a planned step ends with `finish` (or `replayed` after a graph replay)"]
pub struct PlannedStep<'a> {
    /// The step's batch description, as the plan wrote it.
    batch: &'a DecodeBatch,
    attention: &'a mut DecodeWorkspace,
    selection: &'a mut SelectWorkspace,
    /// Every layer's append and attention, planned with the step.
    attend: AppendAttendPlan<'a>,
    /// Every layer's selection, planned at the first layer that launches the selector.
    select: Option<SelectPlan<'a>>,
    manager: &'a mut KvCacheManager,
    /// Whether the step launches the selector (decided when planned).
    selects: bool,
    /// Whether a layer of the step launched the selector.
    selected: bool,
}

impl<'a> PlannedStep<'a> {
    /// Whether the step launches the selector: when some sequence's selection is due by the
    /// manager's step counters ([`DecodeBatch::selection_due`]), or a slot of the batch holds
    /// no selection yet (the cache was made, or the slot changed hands, since its last selecting
    /// step). An engine that replays captured steps captures one with the selector and one
    /// without and replays the one this names.
    pub fn selects(&self) -> bool {
        self.selects
    }

    /// The batch description the step's launches read (for launches of one's own beside the
    /// step's, e.g. a [`DecodePlan`](super::DecodePlan) made with it).
    pub fn batch(&self) -> &'a DecodeBatch {
        self.batch
    }

    /// The manager, as the step planned it (the step's tokens reserved).
    pub fn manager(&self) -> &KvCacheManager {
        self.manager
    }

    /// One layer of the step: writes the new token's `k`, `v` `[B][Hkv][D]` into the cache
    /// (statistics updated), selects pages for the dense heads whose selection is due (sequences
    /// longer than `dynamic_min_len`; every `reuse_interval` steps, else the held selection plus
    /// the newest page), and attends: `q [B][Hq][D]` -> `out [B][Hq][D]`. The selector is
    /// launched only when [`selects`](Self::selects). Where the attention is latency-bound (at
    /// most 3 tiles per warp in its longest split: small batches) the append is part of the
    /// attention launch and the selector runs first, so a small batch's step that reuses every
    /// selection is that launch and the split combine; elsewhere the launches are the append
    /// kernel, the selector and the attention, in that order (as measured fastest; see
    /// [`DecodeStep::with_append_launch`]). Every launch is checked before the first is
    /// enqueued: an error (`StaleTables` for a cache this step was not planned against, or that
    /// took other tables since) leaves the cache unchanged.
    ///
    /// Each tensor is a `&CudaSlice` (packed rows) or a [`Tokens`] / [`TokensMut`] view with
    /// its token stride (e.g. into a fused QKV buffer; `k` and `v` share one stride), under
    /// [`Tokens`]' length rule.
    #[allow(clippy::too_many_arguments)]
    pub fn layer<'t, E: DeviceElement>(
        &mut self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
    ) -> Result<()> {
        let selects = self.selects;
        self.layer_with_selector(selects, gpu, cache, layer, q, k, v, out)
    }

    /// [`layer`](Self::layer) with the selector launched exactly when `selects`: for capturing a
    /// step once with the selector and once without (replay the one [`selects`](Self::selects)
    /// names, then call [`replayed`](Self::replayed)). A layer without the selector on a step
    /// that [`selects`](Self::selects) attends to stale or missing selections: the result is
    /// wrong (never out of bounds).
    ///
    /// ```no_run
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::{DecodeStep, DeviceKvCache, GpuContext};
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # let gpu = GpuContext::new(0)?;
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 1, 65536)?;
    /// # let seq = mgr.add_sequence()?;
    /// # mgr.reserve(seq, 20_000)?;
    /// # let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// # let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    /// # let q = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
    /// # let k = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
    /// # let v = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
    /// # let mut out = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
    /// use lserve::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    /// let mut step = DecodeStep::new(&gpu, &cache, 1)?;
    /// // Step 0, captured with the selector (it selects) and launched.
    /// let mut plan = step.plan(&gpu, &mut mgr, &mut cache, &[seq])?;
    /// let select = plan.selects();
    /// gpu.stream().begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    /// for layer in 0..g.layers() {
    ///     plan.layer_with_selector(select, &gpu, &mut cache, layer, &q, &k, &v, &mut out)?;
    /// }
    /// plan.finish(&gpu, &mut cache)?;
    /// let graph = gpu.stream().end_capture(CUgraphInstantiate_flags(0))?.expect("a graph");
    /// graph.launch()?;
    /// // Step 1: planned (tables and batch rewritten in place), replayed, reported.
    /// let plan = step.plan(&gpu, &mut mgr, &mut cache, &[seq])?;
    /// graph.launch()?; // the selecting graph is correct on every step
    /// plan.replayed(&mut cache, true)?;
    /// assert_eq!(mgr.decode_step(seq)?, 2);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn layer_with_selector<'t, E: DeviceElement>(
        &mut self,
        selects: bool,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
    ) -> Result<()> {
        let (q, k, v, out) = (q.into(), k.into(), v.into(), out.into());
        self.run_layer(selects, gpu, cache, layer, (q, k, v), out, None)
    }

    /// [`layer`](Self::layer), and the log-sum-exp of each query head's scaled scores over the
    /// keys it attended (`ln Σ_j e^(scale · q·k_j)`, natural log) into `lse [B][Hq]`: with it
    /// an engine merges this attention with attention it computes elsewhere (cascade or
    /// shared-prefix attention: `o = (e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b)`).
    ///
    /// Errors: those of [`layer`](Self::layer), and `ShapeMismatch` for `lse` shorter than
    /// `B · Hq` (nothing launched).
    ///
    /// ```no_run
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::{DecodeStep, DeviceKvCache, GpuContext};
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # let gpu = GpuContext::new(0)?;
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 1, 65536)?;
    /// # let seq = mgr.add_sequence()?;
    /// # let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// # let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    /// # let q = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
    /// # let k = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
    /// # let v = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
    /// # let mut out = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
    /// let mut lse = gpu.stream().alloc_zeros::<f32>(hq)?; // batch 1
    /// let mut step = DecodeStep::new(&gpu, &cache, 1)?;
    /// let mut plan = step.plan(&gpu, &mut mgr, &mut cache, &[seq])?;
    /// for layer in 0..g.layers() {
    ///     plan.layer_with_lse(&gpu, &mut cache, layer, &q, &k, &v, &mut out, &mut lse)?;
    /// }
    /// plan.finish(&gpu, &mut cache)?;
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn layer_with_lse<'t, E: DeviceElement>(
        &mut self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (q, k, v, out) = (q.into(), k.into(), v.into(), out.into());
        let selects = self.selects;
        self.run_layer(selects, gpu, cache, layer, (q, k, v), out, Some(lse))
    }

    /// The one path of a layer: every check, then the launches (the selector exactly when
    /// `selects`, as [`layer_with_selector`](Self::layer_with_selector)).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_layer<E: DeviceElement>(
        &mut self,
        selects: bool,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        (q, k, v): (Tokens<'_, E>, Tokens<'_, E>, Tokens<'_, E>),
        mut out: TokensMut<'_, E>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let (q, k, v) = (&q, &k, &v);
        // Every launch is checked before the first is enqueued (the cache's tables first): an
        // error leaves the cache as it was.
        let attend = self
            .attend
            .check(gpu, cache, layer, q, (k, v), &out, self.attention)?;
        if let Some(lse) = &lse {
            check_lse(lse, self.batch.len(), cache.pattern().geometry().q_heads())?;
        }
        if selects && self.select.is_none() {
            self.select = Some(SelectPlan::new(gpu, cache, self.batch, self.selection)?);
        }
        let select = match self.select.as_ref().filter(|_| selects) {
            Some(plan) => Some(plan.check(gpu, cache, layer, q, self.selection)?),
            None => None,
        };
        // The append kernel (where the append is not inside the attention launch), then the
        // selector: it may also run before the append, since it never ranks the newest page (always
        // attended), the one page whose statistics the append changes.
        attend.append_first(gpu, cache, layer, (k, v))?;
        if let Some(select) = select {
            select.launch(gpu, cache, layer, self.batch, q, self.selection)?;
            self.selected = true;
        }
        attend.attend(gpu, cache, layer, q, (k, v), &mut out, lse, self.attention)
    }

    /// Ends the step: advances the device's step counters of the batch's slots (a launch, part
    /// of a captured step) and the manager's of its sequences, together; if a layer launched the
    /// selector, marks the slots as holding a selection. Call once, after the last layer.
    ///
    /// Errors (nothing changed): `StaleTables` as [`layer`](Self::layer).
    pub fn finish<E: DeviceElement>(
        self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
    ) -> Result<()> {
        advance_decode_steps(gpu, cache, self.batch)?;
        let selected = self.selected;
        self.end(cache, selected)
    }

    /// Ends a step whose captured graph (layers and [`finish`](Self::finish), captured on an
    /// earlier step of the same batch size) was replayed in its place: records the replay's
    /// advance of the device's step counters, advances the manager's, and, if the replayed graph
    /// launched the selector (`selected`), marks the slots as holding a selection (without it
    /// [`selects`](Self::selects) keeps naming the selecting graph: correct, but slower).
    ///
    /// Errors (nothing changed): `StaleTables` as [`layer`](Self::layer).
    pub fn replayed<E: DeviceElement>(
        self,
        cache: &mut DeviceKvCache<E>,
        selected: bool,
    ) -> Result<()> {
        cache.check_batch(self.batch)?;
        cache.mirror.advanced(&self.batch.host_slots);
        self.end(cache, selected)
    }

    /// The host's half of the step's end: the manager's counters, the selection marks.
    fn end<E: DeviceElement>(self, cache: &mut DeviceKvCache<E>, selected: bool) -> Result<()> {
        for &seq in &self.batch.host_seqs {
            self.manager.advance_decode_step(seq)?;
        }
        if selected {
            cache.clear_selection_pending(self.batch);
        }
        Ok(())
    }
}
