//! A whole decode step on the device: per layer the append, the selector when due and the
//! attention (the append inside the attention launch where that is latency-bound, else the
//! append kernel first); then advance the step counters. No allocation, no host
//! synchronization: a step can be captured in a CUDA graph and replayed (the batch description
//! is rewritten in place before each replay).
//!
//! A captured step keeps the launch shapes of its capture: whether it selects
//! ([`DecodeStep::selects`], decided before capturing; a step captured with the selector is
//! correct on every step, one without only where `selects` is false), the batch size, and the
//! number of splits per (sequence, KV head), which was sized for the lengths at capture time.
//! Lengths may grow between replays (the kernels read them, and every split takes a share of the
//! rows found on the device); a different batch size needs another capture.

use cudarc::driver::CudaSlice;

use super::cache::{DecodeBatch, DeviceElement, DeviceKvCache};
use super::decode::{AppendAttend, AppendLaunch, DecodeWorkspace};
use super::select::{advance_decode_steps, SelectLaunch, SelectWorkspace};
use super::GpuContext;
use crate::Result;

/// The scratch a decode step needs, allocated once for batches of up to `max_batch` sequences.
///
/// ```no_run
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{DecodeBatch, DecodeStep, DeviceKvCache, GpuContext};
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
/// let mut batch = DecodeBatch::new(&gpu, 4)?;
/// mgr.reserve(seq, 1)?; // room for the new token
/// cache.sync_tables(&gpu, &mgr)?;
/// batch.set(&gpu, &mgr, &[seq])?;
/// let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
/// let q = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
/// let k = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let v = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let mut out = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
/// for layer in 0..g.layers() {
///     step.layer(&gpu, &mut cache, layer, &batch, &q, &k, &v, &mut out)?;
/// }
/// step.finish(&gpu, &mut cache, &batch)?;
/// mgr.advance_decode_step(seq)?;
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct DecodeStep {
    attention: DecodeWorkspace,
    selection: SelectWorkspace,
    /// Whether a layer of the current step launched the selector.
    selected: bool,
    /// Where the append runs ([`AppendLaunch::Auto`] unless set).
    append: AppendLaunch,
}

impl DecodeStep {
    /// Workspaces for `cache`'s geometry and batches of up to `max_batch` sequences.
    pub fn new<E: DeviceElement>(
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        max_batch: usize,
    ) -> Result<Self> {
        let g = *cache.pattern().geometry();
        Ok(Self {
            attention: DecodeWorkspace::new(gpu, max_batch, g.kv_heads(), g.group(), g.head_dim())?,
            selection: SelectWorkspace::new(gpu, cache, max_batch)?,
            selected: false,
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

    /// Whether a step of `batch` launches the selector: when some sequence's selection is due
    /// by the step counters ([`DecodeBatch::selection_due`]), or a slot of the batch holds no
    /// selection yet (the cache was uploaded, or the slot's selection state reset, since its
    /// last selecting step). An engine that replays captured steps captures one with the
    /// selector and one without and replays the one this names.
    ///
    /// ```no_run
    /// use half::bf16;
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::gpu::{DecodeBatch, DecodeStep, DeviceKvCache, GpuContext};
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
    /// cache.sync_tables(&gpu, &mgr)?;
    /// let mut batch = DecodeBatch::new(&gpu, 4)?;
    /// batch.set(&gpu, &mgr, &[seq])?;
    /// // Decode step 0 of a sequence past `dynamic_min_len`: due by the counters, and the new
    /// // cache holds no selection either.
    /// assert!(batch.selection_due() && DecodeStep::selects(&cache, &batch));
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn selects<E: DeviceElement>(cache: &DeviceKvCache<E>, batch: &DecodeBatch) -> bool {
        batch.selection_due() || cache.selection_pending(batch)
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
    /// [`with_append_launch`](Self::with_append_launch)). Every launch is checked before the
    /// first is enqueued: an error leaves the cache unchanged.
    #[allow(clippy::too_many_arguments)]
    pub fn layer<E: DeviceElement>(
        &mut self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        batch: &DecodeBatch,
        q: &CudaSlice<E>,
        k: &CudaSlice<E>,
        v: &CudaSlice<E>,
        out: &mut CudaSlice<E>,
    ) -> Result<()> {
        let selects = Self::selects(cache, batch);
        self.layer_with_selector(selects, gpu, cache, layer, batch, q, k, v, out)
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
    /// # use lserve::gpu::{DecodeBatch, DecodeStep, DeviceKvCache, GpuContext};
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # let gpu = GpuContext::new(0)?;
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 1, 65536)?;
    /// # let seq = mgr.add_sequence()?;
    /// # mgr.reserve(seq, 20_001)?;
    /// # let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// # cache.sync_tables(&gpu, &mgr)?;
    /// # let mut batch = DecodeBatch::new(&gpu, 1)?;
    /// # batch.set(&gpu, &mgr, &[seq])?;
    /// # let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    /// # let q = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
    /// # let k = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
    /// # let v = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
    /// # let mut out = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
    /// let mut step = DecodeStep::new(&gpu, &cache, 1)?;
    /// let select = DecodeStep::selects(&cache, &batch);
    /// for layer in 0..g.layers() {
    ///     step.layer_with_selector(select, &gpu, &mut cache, layer, &batch, &q, &k, &v, &mut out)?;
    /// }
    /// step.finish(&gpu, &mut cache, &batch)?;
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn layer_with_selector<E: DeviceElement>(
        &mut self,
        selects: bool,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        batch: &DecodeBatch,
        q: &CudaSlice<E>,
        k: &CudaSlice<E>,
        v: &CudaSlice<E>,
        out: &mut CudaSlice<E>,
    ) -> Result<()> {
        // Every launch is checked before the first is enqueued: an error leaves the cache as it
        // was.
        let attend = AppendAttend::check(
            self.append,
            gpu,
            cache,
            layer,
            batch,
            q,
            (k, v),
            out,
            &self.attention,
        )?;
        let select = selects
            .then(|| SelectLaunch::check(gpu, cache, layer, batch, q, &self.selection))
            .transpose()?;
        // The append kernel (where the append is not inside the attention launch), then the
        // selector: it may also run before the append, since it never ranks the newest page (always
        // attended), the one page whose statistics the append changes.
        attend.append_first(gpu, cache, layer, batch, (k, v))?;
        if let Some(select) = select {
            select.launch(gpu, cache, layer, batch, q, &mut self.selection)?;
            self.selected = true;
        }
        attend.attend(
            gpu,
            cache,
            layer,
            batch,
            q,
            (k, v),
            out,
            &mut self.attention,
        )
    }

    /// After replaying a captured step of `batch` (captured with
    /// [`layer_with_selector`](Self::layer_with_selector) and [`finish`](Self::finish)): marks
    /// the slots of `batch` as holding a selection if the replayed graph launched the selector,
    /// as `finish` does when it runs. Without it [`selects`](Self::selects) keeps naming the
    /// selecting graph after a cache upload or a selection reset (correct, but slower).
    ///
    /// ```no_run
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::{DecodeBatch, DecodeStep, DeviceKvCache, GpuContext};
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # let gpu = GpuContext::new(0)?;
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 1, 65536)?;
    /// # let seq = mgr.add_sequence()?;
    /// # mgr.reserve(seq, 20_001)?;
    /// # let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// # cache.sync_tables(&gpu, &mgr)?;
    /// # let mut batch = DecodeBatch::new(&gpu, 1)?;
    /// # batch.set(&gpu, &mgr, &[seq])?;
    /// let select = DecodeStep::selects(&cache, &batch);
    /// // ... replay the graph captured with `select` ...
    /// DecodeStep::replayed(&mut cache, &batch, select);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn replayed<E: DeviceElement>(
        cache: &mut DeviceKvCache<E>,
        batch: &DecodeBatch,
        selected: bool,
    ) {
        if selected {
            cache.clear_selection_pending(batch);
        }
    }

    /// Ends the step for every sequence of `batch`: advances their decode step counters on the
    /// device and, if a layer launched the selector, marks their slots as holding a selection.
    /// Call once, after the last layer; then advance the manager's counters of exactly the
    /// batch's sequences (`KvCacheManager::advance_decode_step`).
    pub fn finish<E: DeviceElement>(
        &mut self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        batch: &DecodeBatch,
    ) -> Result<()> {
        advance_decode_steps(gpu, cache, batch)?;
        Self::replayed(cache, batch, std::mem::take(&mut self.selected));
        Ok(())
    }
}
