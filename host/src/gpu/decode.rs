//! Paged sparse decode attention on the device: one launch for every (sequence, KV head) pair of
//! a layer, then a combine of the splits (`kernels-gpu/src/decode`).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};
use lserve_abi::decode::{
    coded_blocks_per_sm, coded_decode_smem_bytes, combine_smem_bytes, decode_smem_bytes,
    CodedDecodeArgs, CombineArgs, CombineParams, DecodeArgs, DecodeParams, COMBINE_THREADS,
    DECODE_BLOCKS_PER_SM, DECODE_THREADS, DECODE_TILE_ROWS,
};
use lserve_abi::layout::TokenStrides;
use lserve_abi::ptr::GlobalPtrMut;

use super::cache::{
    check_coded_format, fresh_id, layer_out_of_range, DecodeBatch, DeviceElement, DeviceKvCache,
};
use super::kv_write::AppendPlan;
use super::launch::{check_shape, kernel_of, Launch};
use super::tokens::{kv_stride, Tokens, TokensMut};
use super::GpuContext;
use crate::dtype::DType;
use crate::error::invalid;
use crate::quant::{KvFormat, StatsFormat};
use crate::{LserveError, Result};

/// Scratch for the split partial states, sized once for the largest batch.
pub struct DecodeWorkspace {
    /// This workspace's identity (plans record it; a new split limit makes a new one).
    id: u64,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    max_pairs: usize,
    max_splits: u32,
    group: usize,
    head_dim: usize,
}

pub use lserve_abi::decode::MAX_SPLITS;

impl DecodeWorkspace {
    /// Room for batches of up to `max_batch` sequences of a model with `kv_heads`, `group` and
    /// `head_dim`.
    ///
    /// Errors (nothing allocated): `Empty` for no (sequence, KV head) pair; `InvalidArgument`
    /// for a head dim or group no kernel serves (what a
    /// [`ModelGeometry`](crate::geometry::ModelGeometry) accepts: head dims 64 and 128, groups 1
    /// to 8), or for a `max_batch x kv_heads` whose scratch size overflows.
    pub fn new(
        gpu: &GpuContext,
        max_batch: usize,
        kv_heads: usize,
        group: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let (max_pairs, acc, ml) = workspace_elements(max_batch, kv_heads, group, head_dim)?;
        Ok(Self {
            id: fresh_id(),
            part_acc: gpu.stream().alloc_zeros(acc)?,
            part_ml: gpu.stream().alloc_zeros(ml)?,
            max_pairs,
            max_splits: MAX_SPLITS,
            group,
            head_dim,
        })
    }

    /// At most `max_splits` splits per (sequence, KV head) in launches with this workspace
    /// (default [`MAX_SPLITS`]): fewer, longer splits trade parallelism for less combine work.
    /// Plans made with the workspace before refuse it after (they were sized for the old limit).
    ///
    /// Errors: `InvalidArgument` unless `1 <= max_splits <= MAX_SPLITS`.
    ///
    /// ```no_run
    /// use lserve::gpu::{DecodeWorkspace, GpuContext};
    /// let gpu = GpuContext::new(0)?;
    /// let ws = DecodeWorkspace::new(&gpu, 1, 8, 4, 128)?.with_max_splits(16)?;
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn with_max_splits(mut self, max_splits: u32) -> Result<Self> {
        if !(1..=MAX_SPLITS).contains(&max_splits) {
            return Err(LserveError::InvalidArgument {
                what: "max_splits",
                reason: format!("{max_splits}: expected 1 to {MAX_SPLITS}"),
            });
        }
        self.max_splits = max_splits;
        self.id = fresh_id();
        Ok(self)
    }
}

/// The checked sizes of a [`DecodeWorkspace`]: its (sequence, KV head) pairs and the `f32`
/// elements of its partial accumulators and of its (max, sum) pairs.
fn workspace_elements(
    max_batch: usize,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
) -> Result<(usize, usize, usize)> {
    if max_batch == 0 || kv_heads == 0 {
        return Err(LserveError::Empty("batch"));
    }
    check_shape(head_dim, group)?;
    let overflow = || LserveError::InvalidArgument {
        what: "max_batch",
        reason: format!("{max_batch} sequences x {kv_heads} KV heads overflow the scratch size"),
    };
    let max_pairs = max_batch.checked_mul(kv_heads).ok_or_else(overflow)?;
    let states = crate::error::checked_elements::<f32>(&[max_pairs, MAX_SPLITS as usize, group])
        .ok_or_else(overflow)?;
    let acc = crate::error::checked_elements::<f32>(&[states, head_dim]).ok_or_else(overflow)?;
    let ml = crate::error::checked_elements::<f32>(&[states, 2]).ok_or_else(overflow)?;
    Ok((max_pairs, acc, ml))
}

/// How many splits a launch uses: one wave of blocks of the `heavy_pairs` long pairs (the dense
/// heads; streaming heads have a few hundred rows) at [`DECODE_BLOCKS_PER_SM`] resident blocks per
/// SM — rounded down, so a launch is never a full wave plus a small tail — but no split shorter
/// than [`MIN_SPLIT_TILES`] tiles of the longest pair. Where the blocks of all `pairs` then
/// overflow one wave by a few splits' worth (at most [`WAVE_TRIM`] of the splits), the splits are
/// trimmed so that every block is resident at once: the overflow would otherwise wait for a
/// slot, and the launch's end with it.
fn choose_splits(
    sm_count: u32,
    blocks_per_sm: u32,
    heavy_pairs: u32,
    pairs: u32,
    max_rows: u32,
    max_splits: u32,
) -> u32 {
    let slots = blocks_per_sm * sm_count;
    let fill = slots / heavy_pairs.max(1);
    let by_length = max_rows.div_ceil(MIN_SPLIT_TILES * DECODE_TILE_ROWS).max(1);
    let splits = fill.min(by_length).clamp(1, max_splits);
    let one_wave = slots / pairs.max(1);
    if one_wave < splits && (splits - one_wave) * WAVE_TRIM.1 <= splits * WAVE_TRIM.0 {
        one_wave.max(1)
    } else {
        splits
    }
}

/// The largest share of a launch's splits ([`choose_splits`]) trimmed to fit all its blocks in
/// one wave, as a fraction `(numerator, denominator)`.
///
/// Measured (H200, 2026-11-30, `benches/decode.rs` `step/lserve` b1, LServe pattern: 8 pairs,
/// 4 of them dense, 34 splits = 272 blocks for 264 slots; kernels-gpu/src/decode/DESIGN.md):
/// 33 splits 14.83 / 14.86 µs against 15.21 / 15.22 µs at 34 (256K), 11.50 / 11.52 against
/// 11.95 / 11.94 µs (16K); 24 and 17 splits measured like 34, 12 splits 7-9% slower.
const WAVE_TRIM: (u32, u32) = (1, 16);

/// The shortest split worth its partial state: two tiles per warp.
const MIN_SPLIT_TILES: u32 = 8;

/// Appending launches whose splits have at least this many tiles per warp read their tiles with
/// tensor-map bulk copies; shorter ones use `cp.async`. Launches that do not append always use
/// the tensor-map copies ([`uses_bulk_copies`]).
///
/// Measured (H200, 2026-11-30, `benches/decode.rs`, one device call, the tensor-map kernels
/// with this line moved by a diagnostic knob; kernels-gpu/src/decode/DESIGN.md): tensor-map
/// copies in every launch against this line, `attention/static` b1 4K 8.67 / 8.69 against 9.47 /
/// 9.40 µs (not appending: −8%), `step/lserve` b16 256K 85.7 / 85.4 against 86.6 / 86.5 µs (its
/// attention does not append: −1%); but the appending launches of `step/lserve` b1 256K 14.88 /
/// 14.88 against 14.81 / 14.81 µs and `step/dynamic` b1 256K 19.52 / 19.52 against 19.42 / 19.43 µs
/// (+0.4 to +0.5%). For appending launches the line sits between measured sides (H200,
/// 2026-11-29: 62 tiles per warp and more gained from bulk copies, 17 and fewer lost; a
/// bulk-copied tile arrives later than a `cp.async` one, which only a long stream hides).
const BULK_MIN_TILES_PER_WARP: u32 = 24;

/// Whether a launch whose longest pair visits `max_rows` rows in `splits` splits, appending the
/// step's token or not, uses the tensor-map bulk-copy kernel.
fn uses_bulk_copies(max_rows: u32, splits: u32, append: bool) -> bool {
    !append || tiles_per_warp(max_rows, splits) >= BULK_MIN_TILES_PER_WARP
}

/// The most tiles one warp streams in a launch whose longest pair visits `max_rows` rows in
/// `splits` splits (a split count of 0 read as 1).
fn tiles_per_warp(max_rows: u32, splits: u32) -> u32 {
    let warp_rows = DECODE_TILE_ROWS * (DECODE_THREADS / 32);
    max_rows.div_ceil(splits.max(1)).div_ceil(warp_rows)
}

/// The two kernels of an attention launch, looked up once when it is planned (nothing is
/// enqueued if one is missing) and launched by [`launch_attention`].
#[derive(Clone)]
struct AttentionKernels {
    /// The attention kernel for the launch's plan (appending or not), allowed its shared memory.
    attention: CudaFunction,
    /// The split combine.
    combine: CudaFunction,
}

impl AttentionKernels {
    /// The kernels a launch planned as `plan` runs, appending the step's token or not.
    fn look_up<E: DeviceElement>(
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        plan: LaunchPlan,
        append: bool,
    ) -> Result<Self> {
        let geometry = *cache.pattern().geometry();
        let d = geometry.head_dim();
        if append && cache.config.stats_format != StatsFormat::Half {
            return Err(LserveError::InvalidArgument {
                what: "append launch",
                reason: "the appending attention does not code 8-bit statistics: a cache that \
                         keeps them takes the append kernel first (AppendLaunch::Auto or Separate)"
                    .into(),
            });
        }
        let (name, smem) = match cache.format() {
            KvFormat::Float(_) => {
                let bulk = uses_bulk_copies(plan.max_rows, plan.splits, append);
                let name = kernel_name(E::DTYPE, d, geometry.group(), bulk, append)?;
                (name, decode_smem_bytes(d as u32))
            }
            KvFormat::Int(format) => {
                if append {
                    return Err(LserveError::InvalidArgument {
                        what: "append launch",
                        reason: "the integer-coded attention does not append: a coded cache \
                                 takes the append kernel first (AppendLaunch::Auto or Separate)"
                            .into(),
                    });
                }
                check_coded_format(format, d)?;
                check_shape(d, geometry.group())?;
                let bits = format.bits.bits();
                (
                    format!("decode_attention_int{bits}_{}_d{d}", E::DTYPE.name()),
                    coded_decode_smem_bytes(d as u32, bits),
                )
            }
        };
        Ok(Self {
            attention: gpu.function_with_smem(&name, smem)?,
            combine: gpu.function(kernel_of::<E>("decode_combine_bf16", "decode_combine_f16"))?,
        })
    }
}

/// The attention kernel for element type, head dim and launch kind: one kernel per (element
/// type, head dim) serves every group `1..=MAX_GROUP` (a launch parameter); other shapes are
/// typed errors (only arguments that did not come from a geometry can be one).
fn kernel_name(
    dtype: DType,
    head_dim: usize,
    group: usize,
    bulk: bool,
    append: bool,
) -> Result<String> {
    check_shape(head_dim, group)?;
    // Launches that do not append always copy their tiles through the tensor maps.
    let prefix = match (append, bulk) {
        (false, _) => "decode_attention_bulk",
        (true, false) => "decode_attention_append",
        (true, true) => "decode_attention_append_bulk",
    };
    Ok(format!("{prefix}_{}_d{head_dim}", dtype.name()))
}

/// Decode attention of one batch over the cache as it is, checked once for every layer:
/// [`DecodePlan::new`] checks the batch against the cache and the workspace against the batch,
/// sizes every layer's launch (its splits) and looks its kernels up; [`DecodePlan::run`]
/// attends in one layer, checking only the layer, the tensors, the workspace's identity and that
/// the cache still holds the batch's block tables.
///
/// A run computes `q [B][Hq][D]` -> `out [B][Hq][D]` over the cache as it is (the step's token
/// already appended, e.g. by [`AppendPlan`](super::AppendPlan)). Streaming heads attend to their
/// sink and ring rows; dense heads to every page of the block table while the sequence is at
/// most `dynamic_min_len` long, else to the pages of their index-table entry (the held selection
/// followed by the newest page unless the selection ends with it, as the selector and the append
/// keep it).
///
/// The plan borrows the batch (it cannot be set again while the plan lives) and records the
/// workspace it was checked with. Its splits were sized for the batch's lengths when planned.
///
/// ```no_run
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{DecodeBatch, DecodePlan, DecodeWorkspace, DeviceKvCache, GpuContext};
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
///
/// let gpu = GpuContext::new(0)?;
/// let g = ModelGeometry::llama3_8b();
/// let pattern = HeadPattern::interleaved(g, 0.5)?;
/// let mut mgr = KvCacheManager::new(g, pattern, SparsityConfig::default(), 4096, 1, 65536)?;
/// let seq = mgr.add_sequence()?;
/// mgr.reserve(seq, 1000)?;
/// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
/// // ... write the 1000 tokens' K/V ...
/// let mut batch = DecodeBatch::new(&gpu, 1)?;
/// batch.set(&gpu, &mgr, &mut cache, &[seq])?;
/// let mut ws = DecodeWorkspace::new(&gpu, 1, g.kv_heads(), g.group(), g.head_dim())?;
/// let q = gpu.stream().alloc_zeros::<bf16>(g.q_heads() * g.head_dim())?;
/// let mut out = gpu.stream().alloc_zeros::<bf16>(g.q_heads() * g.head_dim())?;
/// let plan = DecodePlan::new(&gpu, &cache, &batch, &ws)?;
/// for layer in 0..g.layers() {
///     plan.run(&gpu, &cache, layer, &q, &mut out, &mut ws)?;
/// }
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct DecodePlan<'b> {
    layers: AttentionLayers<'b>,
}

impl<'b> DecodePlan<'b> {
    /// Checks `batch` against `cache` and `ws` against the batch, sizes every layer's launch and
    /// looks its kernels up. Launches nothing.
    ///
    /// Errors: `Empty` for an empty batch, `StaleTables` for a batch set against another cache
    /// or tables the cache no longer holds ([`DecodeBatch::set`]), `InvalidArgument` for a batch
    /// the cache cannot hold or a workspace sized for another geometry or a smaller batch.
    ///
    /// A coded cache ([`DeviceKvCache::new_coded`]) is attended by the integer-coded kernels
    /// (`decode_attention_int{8,4}_*`, `kernels-gpu/src/decode/coded.rs`).
    pub fn new<E: DeviceElement>(
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        batch: &'b DecodeBatch,
        ws: &DecodeWorkspace,
    ) -> Result<Self> {
        Ok(Self {
            layers: AttentionLayers::new(gpu, cache, batch, ws, None)?,
        })
    }

    /// The batch the plan was made for.
    pub fn batch(&self) -> &'b DecodeBatch {
        self.layers.batch
    }

    /// Decode attention of `layer` (see the type's docs): `q [B][Hq][D]` -> `out [B][Hq][D]`,
    /// each a `&CudaSlice` (packed rows) or a [`Tokens`] / [`TokensMut`] view with its token
    /// stride. Enqueued on the context's stream; allocates nothing and does not synchronize.
    ///
    /// Errors (nothing launched): `StaleTables` for another cache than the batch's, or one that
    /// took other tables for its slots since; `ShapeMismatch` for short `q`/`out`;
    /// `InvalidArgument` for a bad layer or another workspace than the plan's.
    pub fn run<'t, E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
        ws: &mut DecodeWorkspace,
    ) -> Result<()> {
        self.run_inner(gpu, cache, layer, q.into(), out.into(), None, ws)
    }

    /// [`run`](Self::run), and the log-sum-exp of each query head's scaled scores over the keys
    /// it attended (natural log) into `lse [B][Hq]`, as
    /// [`PlannedStep::layer_with_lse`](crate::gpu::PlannedStep::layer_with_lse).
    ///
    /// Errors: those of [`run`](Self::run), and `ShapeMismatch` for `lse` shorter than `B · Hq`
    /// (nothing launched).
    ///
    /// ```no_run
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::{DecodeBatch, DecodePlan, DecodeWorkspace, DeviceKvCache, GpuContext};
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # let gpu = GpuContext::new(0)?;
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 1, 65536)?;
    /// # let seq = mgr.add_sequence()?;
    /// # mgr.reserve(seq, 1000)?;
    /// # let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
    /// # let mut batch = DecodeBatch::new(&gpu, 1)?;
    /// # batch.set(&gpu, &mgr, &mut cache, &[seq])?;
    /// # let mut ws = DecodeWorkspace::new(&gpu, 1, g.kv_heads(), g.group(), g.head_dim())?;
    /// # let (hq, d) = (g.q_heads(), g.head_dim());
    /// # let q = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
    /// # let mut out = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
    /// let mut lse = gpu.stream().alloc_zeros::<f32>(hq)?;
    /// let plan = DecodePlan::new(&gpu, &cache, &batch, &ws)?;
    /// plan.run_with_lse(&gpu, &cache, 0, &q, &mut out, &mut lse, &mut ws)?;
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn run_with_lse<'t, E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
        lse: &mut CudaSlice<f32>,
        ws: &mut DecodeWorkspace,
    ) -> Result<()> {
        self.run_inner(gpu, cache, layer, q.into(), out.into(), Some(lse), ws)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_inner<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        layer: usize,
        q: Tokens<'_, E>,
        mut out: TokensMut<'_, E>,
        lse: Option<&mut CudaSlice<f32>>,
        ws: &mut DecodeWorkspace,
    ) -> Result<()> {
        let (l, plan) = self.layers.check(gpu, cache, layer, &q, None, &out, ws)?;
        if let Some(lse) = &lse {
            let q_heads = cache.pattern().geometry().q_heads();
            check_lse(lse, self.layers.batch.len(), q_heads)?;
        }
        launch_attention(
            gpu,
            cache,
            layer,
            self.layers.batch,
            &q,
            None,
            &mut out,
            lse,
            ws,
            plan,
            &l.kernels,
        )
    }
}

/// `ShapeMismatch` unless `lse` holds a log-sum-exp per query head of a batch of `batch`.
pub(crate) fn check_lse(lse: &CudaSlice<f32>, batch: usize, q_heads: usize) -> Result<()> {
    if lse.len() < batch * q_heads {
        return Err(LserveError::ShapeMismatch {
            what: "lse (a value per sequence and query head)",
            expected: batch * q_heads,
            actual: lse.len(),
        });
    }
    Ok(())
}

/// Decode attention of one layer for `batch`: [`DecodePlan::new`] then [`DecodePlan::run`]
/// (keep a plan to attend in every layer with one check of the batch).
///
/// Errors (nothing launched): as [`DecodePlan::new`] and [`DecodePlan::run`].
///
/// ```no_run
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{decode_attention, DecodeBatch, DecodeWorkspace, DeviceKvCache, GpuContext};
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
///
/// let gpu = GpuContext::new(0)?;
/// let g = ModelGeometry::llama3_8b();
/// let pattern = HeadPattern::interleaved(g, 0.5)?;
/// let mut mgr = KvCacheManager::new(g, pattern, SparsityConfig::default(), 4096, 1, 65536)?;
/// let seq = mgr.add_sequence()?;
/// mgr.reserve(seq, 1000)?;
/// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
/// let mut batch = DecodeBatch::new(&gpu, 1)?;
/// batch.set(&gpu, &mgr, &mut cache, &[seq])?;
/// let mut ws = DecodeWorkspace::new(&gpu, 1, g.kv_heads(), g.group(), g.head_dim())?;
/// let q = gpu.stream().alloc_zeros::<bf16>(g.q_heads() * g.head_dim())?;
/// let mut out = gpu.stream().alloc_zeros::<bf16>(g.q_heads() * g.head_dim())?;
/// decode_attention(&gpu, &cache, 0, &batch, &q, &mut out, &mut ws)?;
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn decode_attention<'t, E: DeviceElement>(
    gpu: &GpuContext,
    cache: &DeviceKvCache<E>,
    layer: usize,
    batch: &DecodeBatch,
    q: impl Into<Tokens<'t, E>>,
    out: impl Into<TokensMut<'t, E>>,
    ws: &mut DecodeWorkspace,
) -> Result<()> {
    DecodePlan::new(gpu, cache, batch, ws)?.run(gpu, cache, layer, q, out, ws)
}

/// The step's append and decode attention of one batch (what
/// [`PlannedStep::layer`](super::PlannedStep::layer) runs, with the selector in between where
/// the append is its own launch), checked once for every layer as [`DecodePlan`], the append
/// placed per layer as the plan's [`AppendLaunch`] says.
///
/// A run writes the token of each sequence (`k`, `v` `[B][Hkv][D]`) into the cache exactly as
/// [`AppendPlan::run`](super::AppendPlan::run) does (rows, key statistics, index entries), and
/// attends `q [B][Hq][D]` -> `out [B][Hq][D]` as [`DecodePlan::run`] would after that append.
/// Where the attention is latency-bound (short splits: small batches of sparse or short
/// sequences) it is one launch: the warp that attends to a (sequence, KV head) pair's newest row
/// takes it from `k`, `v` and writes it into the cache, one kernel boundary fewer per layer.
/// Otherwise the append kernel runs first (measured faster there; `fuses_append` in the source
/// has the numbers).
///
/// ```no_run
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{AppendAttendPlan, AppendLaunch, DecodeBatch, DecodeWorkspace, DeviceKvCache,
///                   GpuContext};
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
/// let mut ws = DecodeWorkspace::new(&gpu, 1, g.kv_heads(), g.group(), g.head_dim())?;
/// let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
/// let q = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
/// let k = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let v = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let mut out = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
/// let plan = AppendAttendPlan::new(&gpu, &cache, &batch, &ws, AppendLaunch::Auto)?;
/// for layer in 0..g.layers() {
///     plan.run(&gpu, &mut cache, layer, &q, &k, &v, &mut out, &mut ws)?;
/// }
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct AppendAttendPlan<'b> {
    layers: AttentionLayers<'b>,
    /// The append kernel's plan, where some layer appends before its attention.
    append: Option<AppendPlan<'b>>,
}

impl<'b> AppendAttendPlan<'b> {
    /// [`DecodePlan::new`]'s checks and sizing, and per layer where the append runs (as `how`
    /// says); looks the kernels up (the append kernel where a layer appends on its own).
    /// Launches nothing.
    ///
    /// On an integer-coded cache ([`DeviceKvCache::new_coded`]) the append is always the append
    /// kernel (`append_kv_int8_*`, which quantizes the token's rows), then the coded attention;
    /// so it is on a cache that keeps 8-bit statistics (`SparsityConfig::stats_format`: the
    /// append kernel codes them).
    ///
    /// Errors: as [`DecodePlan::new`]; `InvalidArgument` for [`AppendLaunch::Fused`] on a coded
    /// cache or one with 8-bit statistics.
    pub fn new<E: DeviceElement>(
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        batch: &'b DecodeBatch,
        ws: &DecodeWorkspace,
        how: AppendLaunch,
    ) -> Result<Self> {
        let layers = AttentionLayers::new(gpu, cache, batch, ws, Some(how))?;
        let append = layers
            .layers
            .iter()
            .any(|l| !l.fused)
            .then(|| AppendPlan::new(gpu, cache, batch))
            .transpose()?;
        Ok(Self { layers, append })
    }

    /// The batch the plan was made for.
    pub fn batch(&self) -> &'b DecodeBatch {
        self.layers.batch
    }

    /// The append and the attention of `layer` (see the type's docs). Each tensor is a
    /// `&CudaSlice` (packed rows) or a [`Tokens`] / [`TokensMut`] view with its token stride
    /// (`k` and `v` share one). Every check runs before the first launch. Enqueued on the
    /// context's stream; allocates nothing and does not synchronize.
    ///
    /// Errors (nothing launched): as [`DecodePlan::run`], and `ShapeMismatch` for short `k`/`v`.
    #[allow(clippy::too_many_arguments)]
    pub fn run<'t, E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
        ws: &mut DecodeWorkspace,
    ) -> Result<()> {
        let (q, k, v, mut out) = (q.into(), k.into(), v.into(), out.into());
        let step = self.check(gpu, cache, layer, &q, (&k, &v), &out, ws)?;
        step.append_first(gpu, cache, layer, (&k, &v))?;
        step.attend(gpu, cache, layer, &q, (&k, &v), &mut out, None, ws)
    }

    /// The checks of a run (launches nothing): the layer's launches, ready to enqueue.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        layer: usize,
        q: &Tokens<'_, E>,
        (k, v): (&Tokens<'_, E>, &Tokens<'_, E>),
        out: &TokensMut<'_, E>,
        ws: &DecodeWorkspace,
    ) -> Result<AppendAttend<'_>> {
        let (l, plan) = self
            .layers
            .check(gpu, cache, layer, q, Some((k, v)), out, ws)?;
        // Planned with the append kernel wherever a layer is not fused.
        let append = match (l.fused, self.append.as_ref()) {
            (true, _) => None,
            (false, Some(append)) => Some(append),
            (false, None) => return Err(invalid("plan", "no append planned for this layer")),
        };
        Ok(AppendAttend {
            batch: self.layers.batch,
            plan,
            kernels: &l.kernels,
            append,
        })
    }
}

/// The step's append and decode attention of one layer for `batch`:
/// [`AppendAttendPlan::new`] (with [`AppendLaunch::Auto`]) then [`AppendAttendPlan::run`]
/// (keep a plan to run every layer with one check of the batch).
///
/// Errors (nothing launched): as [`AppendAttendPlan::new`] and [`AppendAttendPlan::run`].
///
/// ```no_run
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{append_and_attend, DecodeBatch, DecodeWorkspace, DeviceKvCache, GpuContext};
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
/// let mut ws = DecodeWorkspace::new(&gpu, 1, g.kv_heads(), g.group(), g.head_dim())?;
/// let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
/// let q = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
/// let k = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let v = gpu.stream().alloc_zeros::<bf16>(hkv * d)?;
/// let mut out = gpu.stream().alloc_zeros::<bf16>(hq * d)?;
/// append_and_attend(&gpu, &mut cache, 0, &batch, &q, &k, &v, &mut out, &mut ws)?;
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn append_and_attend<'t, E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    layer: usize,
    batch: &DecodeBatch,
    q: impl Into<Tokens<'t, E>>,
    k: impl Into<Tokens<'t, E>>,
    v: impl Into<Tokens<'t, E>>,
    out: impl Into<TokensMut<'t, E>>,
    ws: &mut DecodeWorkspace,
) -> Result<()> {
    AppendAttendPlan::new(gpu, cache, batch, ws, AppendLaunch::Auto)?
        .run(gpu, cache, layer, q, k, v, out, ws)
}

/// Where an [`AppendAttendPlan`] (and so [`DecodeStep`](super::DecodeStep)) appends the step's
/// token. The result is the same; only the launches differ.
///
/// ```
/// use lserve::gpu::AppendLaunch;
/// assert_eq!(AppendLaunch::default(), AppendLaunch::Auto);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AppendLaunch {
    /// Inside the attention launch where that is latency-bound (short splits), else before it
    /// (as measured fastest on the H200; `fuses_append` in the source).
    #[default]
    Auto,
    /// Always inside the attention launch.
    Fused,
    /// Always the append kernel, then the attention.
    Separate,
}

/// One layer's append and attention, checked by its plan ([`AppendAttendPlan::check`]; nothing
/// launched yet) and placed: a decode step launches [`append_first`](Self::append_first), then
/// the selector if due, then [`attend`](Self::attend). The append kernel, when it runs on its
/// own, thus runs before the selector, as measured fastest (`fuses_append`).
pub(crate) struct AppendAttend<'p> {
    batch: &'p DecodeBatch,
    /// The layer's launch, with the strides of the tensors it was checked with.
    plan: LaunchPlan,
    kernels: &'p AttentionKernels,
    /// The append kernel, where the append is not inside the attention launch.
    append: Option<&'p AppendPlan<'p>>,
}

impl AppendAttend<'_> {
    /// The append kernel, where the append is not part of the attention launch.
    pub(crate) fn append_first<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        (k, v): (&Tokens<'_, E>, &Tokens<'_, E>),
    ) -> Result<()> {
        match self.append {
            Some(append) => append.launch(gpu, cache, layer, self.plan.strides.kv, k, v),
            None => Ok(()),
        }
    }

    /// The attention (appending inside it where placed so) and the combine.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &mut DeviceKvCache<E>,
        layer: usize,
        q: &Tokens<'_, E>,
        new: (&Tokens<'_, E>, &Tokens<'_, E>),
        out: &mut TokensMut<'_, E>,
        lse: Option<&mut CudaSlice<f32>>,
        ws: &mut DecodeWorkspace,
    ) -> Result<()> {
        // With the append inside, the kernel writes the cache through the pointers
        // `launch_attention` passes: `&mut` here is what makes that visible to the borrow
        // checker.
        let new = self.append.is_none().then_some(new);
        launch_attention(
            gpu,
            &*cache,
            layer,
            self.batch,
            q,
            new,
            out,
            lse,
            ws,
            self.plan,
            self.kernels,
        )
    }
}

/// Whether an [`AppendAttendPlan`] with [`AppendLaunch::Auto`] appends inside the attention launch: when the attention is
/// latency-bound, its longest split holding at most [`FUSED_MAX_TILES_PER_WARP`] tiles per warp.
/// Longer splits take the append kernel first (in a decode step: before the selector), then the
/// attention that does not append.
///
/// Measured (H200, 2026-11-30, `benches/decode.rs` `step/lserve` at 256K, LServe pattern, every
/// launch fused against the append kernel first; kernels-gpu/src/decode/DESIGN.md), by tiles per
/// warp of the longest split:
///
/// | batch | splits | tiles per warp | fused | append first |
/// | ---: | ---: | ---: | ---: | ---: |
/// | 1 | 34 | 2 | 15.04 µs | 15.73 µs |
/// | 2 | 33 | 3 | 22.84 µs | 22.95 µs (after the selector) |
/// | 4 | 16 | 5 | 33.37 µs | 32.87 µs (after the selector) |
/// | 8 | 8 | 9 | 51.98 µs | 51.04 µs (after the selector) |
/// | 16 | 4 | 17 | 88.8-89.4 µs | 86.1 µs (88.2 after the selector) |
///
/// (Batch 1 runs 33 splits, `choose_splits`: at most 3 tiles per warp, fused.)
///
/// The line sits between the measured sides.
fn fuses_append(max_rows: u32, splits: u32) -> bool {
    tiles_per_warp(max_rows, splits) <= FUSED_MAX_TILES_PER_WARP
}

/// See [`fuses_append`].
const FUSED_MAX_TILES_PER_WARP: u32 = 3;

/// How one attention launch runs: the split count and the longest pair's rows it was sized for,
/// and the activations' token strides.
#[derive(Clone, Copy)]
struct LaunchPlan {
    splits: u32,
    max_rows: u32,
    strides: TokenStrides,
}

/// One layer of an attention plan: its launch (strides set per run), where its append runs, and
/// its kernels.
struct AttendLayer {
    plan: LaunchPlan,
    /// Whether the append is inside the attention launch (false in plans that do not append).
    fused: bool,
    kernels: AttentionKernels,
}

/// What the attention plans share: the batch, the workspace they were checked with, and every
/// layer's launch.
struct AttentionLayers<'b> {
    batch: &'b DecodeBatch,
    /// The workspace's identity.
    workspace: u64,
    layers: Vec<AttendLayer>,
}

impl<'b> AttentionLayers<'b> {
    /// Validates what a run does not change (nothing is launched on an error) and plans every
    /// layer's launch, appending the step's token as `append` says or not at all (`None`).
    fn new<E: DeviceElement>(
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        batch: &'b DecodeBatch,
        ws: &DecodeWorkspace,
        append: Option<AppendLaunch>,
    ) -> Result<Self> {
        let geometry = *cache.pattern().geometry();
        let (hkv, d, group) = (geometry.kv_heads(), geometry.head_dim(), geometry.group());
        cache.check_batch(batch)?;
        let b = batch.len();
        let pairs = b * hkv;
        if pairs > ws.max_pairs || ws.group != group || ws.head_dim != d {
            return Err(LserveError::InvalidArgument {
                what: "workspace",
                reason: "sized for a smaller batch or another geometry".into(),
            });
        }
        let layers = (0..cache.layers())
            .map(|layer| {
                let plan = plan_layer(gpu, cache, layer, batch, ws)?;
                // The fused append writes neither codes nor 8-bit statistics.
                let separate = matches!(cache.format(), KvFormat::Int(_))
                    || cache.config.stats_format != StatsFormat::Half;
                let fused = match append {
                    None => false,
                    Some(AppendLaunch::Auto) => {
                        !separate && fuses_append(plan.max_rows, plan.splits)
                    }
                    Some(AppendLaunch::Fused) => true,
                    Some(AppendLaunch::Separate) => false,
                };
                let kernels = AttentionKernels::look_up(gpu, cache, plan, fused)?;
                Ok(AttendLayer {
                    plan,
                    fused,
                    kernels,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            batch,
            workspace: ws.id,
            layers,
        })
    }

    /// The checks of a run: the cache holds the batch's tables, `ws` is the plan's, `layer` is
    /// one of the cache's, the tensors hold the batch's rows (`new`: the step's `k`, `v`, for a
    /// plan that appends). Returns the layer and its launch with the tensors' strides.
    #[allow(clippy::too_many_arguments)]
    fn check<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        cache: &DeviceKvCache<E>,
        layer: usize,
        q: &Tokens<'_, E>,
        new: Option<(&Tokens<'_, E>, &Tokens<'_, E>)>,
        out: &TokensMut<'_, E>,
        ws: &DecodeWorkspace,
    ) -> Result<(&AttendLayer, LaunchPlan)> {
        cache.check_tables(self.batch)?;
        if ws.id != self.workspace {
            return Err(LserveError::InvalidArgument {
                what: "workspace",
                reason: "not the one the plan was made with".into(),
            });
        }
        let l = self
            .layers
            .get(layer)
            .ok_or_else(|| layer_out_of_range(layer, self.layers.len()))?;
        let geometry = *cache.pattern().geometry();
        let (hq, hkv, d) = (geometry.q_heads(), geometry.kv_heads(), geometry.head_dim());
        let b = self.batch.len();
        let strides = TokenStrides {
            q: q.heads_stride(gpu, "q", b, hq, d)?,
            kv: match new {
                Some((k, v)) => kv_stride(gpu, k, v, b, hkv, d)?,
                None => hkv as u32,
            },
            out: out.heads_stride(gpu, "out", b, hq, d)?,
        };
        Ok((l, LaunchPlan { strides, ..l.plan }))
    }
}

/// Sizes `layer`'s launch for `batch` (packed strides: a run sets its tensors').
fn plan_layer<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &DeviceKvCache<E>,
    layer: usize,
    batch: &DecodeBatch,
    ws: &DecodeWorkspace,
) -> Result<LaunchPlan> {
    let geometry = *cache.pattern().geometry();
    let hkv = geometry.kv_heads();
    let b = batch.len();
    let pairs = b * hkv;
    let l = cache.layer(layer)?;
    let cfg_min_len = cache.dynamic_min_len;
    // The most rows any pair of the batch visits: a dense head's whole sequence up to
    // `dynamic_min_len`, at most a selection's units above it (the K selected, the first, and the
    // newest at selection time and now: the index table's content, whatever its capacity).
    let unit_tokens = cache.config.unit_tokens() as u32;
    let selected_rows = cache.config.selection_entry_pages() as u32 * unit_tokens;
    let max_rows = batch
        .host_lens
        .iter()
        .map(|&len| {
            if len <= cfg_min_len {
                len
            } else {
                len.min(selected_rows)
            }
        })
        .max()
        .unwrap_or(1)
        .max(l.streaming.rows());
    let dense_heads = l.paged.heads as usize;
    let heavy_pairs = b * if dense_heads > 0 { dense_heads } else { hkv };
    let blocks_per_sm = match cache.format() {
        KvFormat::Float(_) => DECODE_BLOCKS_PER_SM,
        KvFormat::Int(f) => coded_blocks_per_sm(f.bits.bits()),
    };
    let splits = choose_splits(
        gpu.sm_count(),
        blocks_per_sm,
        heavy_pairs as u32,
        pairs as u32,
        max_rows,
        ws.max_splits,
    );
    Ok(LaunchPlan {
        splits,
        max_rows,
        strides: TokenStrides::packed(geometry.q_heads() as u32, hkv as u32),
    })
}

/// Launches the attention (and the combine) as `plan` says, appending the step's token
/// `new = (k, v)` inside the launch when given (then the kernel writes the cache: the caller
/// holds it mutably). The arguments passed the checks of a plan ([`AttentionLayers::check`]);
/// `kernels` are the layer's, looked up with `append` as `new.is_some()`.
#[allow(clippy::too_many_arguments)]
fn launch_attention<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &DeviceKvCache<E>,
    layer: usize,
    batch: &DecodeBatch,
    q: &Tokens<'_, E>,
    new: Option<(&Tokens<'_, E>, &Tokens<'_, E>)>,
    out: &mut TokensMut<'_, E>,
    lse: Option<&mut CudaSlice<f32>>,
    ws: &mut DecodeWorkspace,
    plan: LaunchPlan,
    kernels: &AttentionKernels,
) -> Result<()> {
    let geometry = *cache.pattern().geometry();
    let (hq, hkv, d, group) = (
        geometry.q_heads(),
        geometry.kv_heads(),
        geometry.head_dim(),
        geometry.group(),
    );
    let (b, l) = (batch.len(), cache.layer(layer)?);
    let (pairs, splits) = (b * hkv, plan.splits);
    let params = DecodeParams {
        batch: b as u32,
        group: group as u32,
        splits,
        dynamic_min_len: cache.dynamic_min_len,
        scale_log2: cache.softmax_scale * std::f32::consts::LOG2_E,
        cache: l.layout(hkv, cache.max_pages),
        selection: cache.selection_layout(),
        strides: plan.strides,
    };
    let cfg = LaunchConfig {
        grid_dim: (splits, pairs as u32, 1),
        block_dim: (DECODE_THREADS, 1, 1),
        shared_mem_bytes: match cache.format() {
            KvFormat::Float(_) => decode_smem_bytes(d as u32),
            KvFormat::Int(format) => coded_decode_smem_bytes(d as u32, format.bits.bits()),
        },
    };
    let mut launch = Launch::overlapped(gpu, &kernels.attention);
    // Without a token the kernel reads `k_new`/`v_new` never: `q` stands in for them.
    let (k_new, v_new) = new.unwrap_or((q, q));
    let (cache_ptrs, selection) = l.ptrs(&mut launch, &cache.block_tables);
    let args = DecodeArgs {
        params,
        q: launch.read(q.view()).cast(),
        k_new: launch.read(k_new.view()).cast(),
        v_new: launch.read(v_new.view()).cast(),
        cache: cache_ptrs,
        tensor_maps: launch.read(&l.tensor_maps),
        selection,
        batch: batch.ptrs(&mut launch),
        part_acc: launch.write(&mut ws.part_acc),
        part_ml: launch.write(&mut ws.part_ml),
    };
    if let Some(codes) = &l.codes {
        // Planned without an append (`AttentionKernels::look_up` refuses one for a coded cache).
        let args = CodedDecodeArgs {
            attn: args,
            codes: codes.ptrs(&mut launch),
        };
        // SAFETY: `decode_attention_int{8,4}_*`'s argument struct (the kernel of the cache's
        // format, `AttentionKernels::look_up`), of the buffers registered above: as for the
        // 16-bit kernel below (grid, workspace, batch, tables), with the codes and row words
        // laid out as the layer's `paged` / `streaming` layouts at the format's bits per
        // element (`CodedLayer`, built from them) and the head dimension 128
        // (`check_coded_format`); the kernel reads neither the 16-bit K/V nor the tensor maps
        // and writes only the workspace.
        unsafe { launch.launch(cfg, &args) }?;
        return launch_combine(gpu, batch, out, lse, ws, plan, kernels, (hq, group, d));
    }
    // SAFETY: `args` is `decode_attention_*`'s argument struct, of the buffers registered above.
    // The grid is `(splits, B * Hkv)` with `splits <= MAX_SPLITS` and `B * Hkv <= ws.max_pairs`,
    // so partial states stay inside the workspace; the cache's buffers have the layouts in
    // `params` (built from them), `batch` holds slots and lengths checked against this cache
    // (`check_batch`), the tensor maps describe the layer's K/V buffers (encoded from them when
    // the cache was built), and the tables hold page ids below the pool's capacity (the manager
    // and the selection kernels write only those). With `new` the kernel writes the cache as
    // `append_kv` does (that function's contract: `k`, `v` hold `B * Hkv * D` elements,
    // checked; distinct live slots; held selections shorter than the index capacity) and the
    // caller holds the cache mutably (`append_and_attend`); without it the kernel writes only
    // the workspace.
    // Overlapped: the kernel waits for the previous one (`overlapped_entry`) before touching
    // anything a kernel writes.
    unsafe { launch.launch(cfg, &args) }?;
    launch_combine(gpu, batch, out, lse, ws, plan, kernels, (hq, group, d))
}

/// Launches the split combine of an attention launch made as `plan` for `batch` (`shape`:
/// query heads, group, head dim).
#[allow(clippy::too_many_arguments)]
fn launch_combine<E: DeviceElement>(
    gpu: &GpuContext,
    batch: &DecodeBatch,
    out: &mut TokensMut<'_, E>,
    lse: Option<&mut CudaSlice<f32>>,
    ws: &mut DecodeWorkspace,
    plan: LaunchPlan,
    kernels: &AttentionKernels,
    shape: (usize, usize, usize),
) -> Result<()> {
    let (hq, group, d) = shape;
    let (b, splits) = (batch.len(), plan.splits);
    let params = CombineParams {
        batch: b as u32,
        q_heads: hq as u32,
        group: group as u32,
        head_dim: d as u32,
        splits,
        strides: plan.strides,
    };
    let cfg = LaunchConfig {
        grid_dim: ((b * hq) as u32, 1, 1),
        block_dim: (COMBINE_THREADS, 1, 1),
        shared_mem_bytes: combine_smem_bytes(),
    };
    let mut launch = Launch::overlapped(gpu, &kernels.combine);
    let args = CombineArgs {
        params,
        part_acc: launch.read(&ws.part_acc),
        part_ml: launch.read(&ws.part_ml),
        out: launch.write(out.view_mut()).cast(),
        lse: match lse {
            Some(lse) => launch.write(lse),
            None => GlobalPtrMut::NULL,
        },
    };
    // SAFETY: `decode_combine_*`'s argument struct, of the buffers registered above; the
    // partial states were written for this batch and split count just above, on this stream;
    // `out` holds `B` rows of `Hq * D` elements at its stride (checked), `lse` (when given) at
    // least `B * Hq` values (`check_lse`).
    // Overlapped: the kernel waits for the previous one (`overlapped_entry`) before touching
    // anything a kernel writes.
    unsafe { launch.launch(cfg, &args) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::launch::ptx_has_kernel;
    use super::*;
    use crate::geometry::ModelGeometry;

    /// Scratch sizes that overflow are `InvalidArgument` before anything is allocated, never an
    /// overflow panic or a wrapped size; no pair is `Empty`.
    #[test]
    fn workspace_sizes_that_overflow_are_errors() {
        assert_eq!(
            workspace_elements(2, 8, 4, 128).unwrap(),
            (
                16,
                16 * MAX_SPLITS as usize * 4 * 128,
                16 * MAX_SPLITS as usize * 4 * 2
            )
        );
        for (batch, kv) in [(usize::MAX, 2), (1 << 40, 1 << 20), (usize::MAX / 64, 1)] {
            assert!(matches!(
                workspace_elements(batch, kv, 8, 128),
                Err(LserveError::InvalidArgument {
                    what: "max_batch",
                    ..
                })
            ));
        }
        assert!(matches!(
            workspace_elements(0, usize::MAX, 1, 64),
            Err(LserveError::Empty(_))
        ));
        assert!(matches!(
            workspace_elements(usize::MAX, 0, 1, 64),
            Err(LserveError::Empty(_))
        ));
    }

    #[test]
    fn splits_fill_the_gpu_from_the_dense_pairs_but_keep_splits_long() {
        // 132 SMs at 2 blocks each, 4 dense pairs of 8 (batch 1, half of the KV heads dense),
        // 256K rows: the dense pairs' blocks make one full wave; the streaming pairs' (short)
        // blocks are too many to trim away.
        assert_eq!(
            choose_splits(132, DECODE_BLOCKS_PER_SM, 4, 8, 262_144, MAX_SPLITS),
            66
        );
        // 128 dense pairs (batch 16): two splits make one wave (264 slots, 256 blocks), where
        // rounding up would make a wave and a half.
        assert_eq!(
            choose_splits(132, DECODE_BLOCKS_PER_SM, 128, 128, 262_144, MAX_SPLITS),
            2
        );
        // Fewer pairs would want more splits than allowed.
        assert_eq!(
            choose_splits(132, DECODE_BLOCKS_PER_SM, 1, 1, 262_144, MAX_SPLITS),
            MAX_SPLITS
        );
        // A short sequence: at least 8 tiles (128 rows) per split.
        assert_eq!(
            choose_splits(132, DECODE_BLOCKS_PER_SM, 4, 4, 4160, MAX_SPLITS),
            33
        );
        // Many pairs: one split each at least.
        assert_eq!(
            choose_splits(
                132,
                DECODE_BLOCKS_PER_SM,
                10_000,
                10_000,
                262_144,
                MAX_SPLITS
            ),
            1
        );
        assert_eq!(
            choose_splits(132, DECODE_BLOCKS_PER_SM, 4, 4, 1, MAX_SPLITS),
            1
        );
    }

    #[test]
    fn a_launch_a_few_blocks_over_one_wave_is_trimmed_to_it() {
        // LServe at b1 256K: a selection's 67 pages (4288 rows) want 34 splits; 8 pairs x 34 =
        // 272 blocks for 264 slots, so 33.
        assert_eq!(
            choose_splits(132, DECODE_BLOCKS_PER_SM, 4, 8, 67 * 64, MAX_SPLITS),
            33
        );
        // Batch 2: 16 pairs x 33 splits is two waves; halving the splits is not a trim.
        assert_eq!(
            choose_splits(132, DECODE_BLOCKS_PER_SM, 8, 16, 67 * 64, MAX_SPLITS),
            33
        );
        // Every pair dense: one wave already.
        assert_eq!(
            choose_splits(132, DECODE_BLOCKS_PER_SM, 8, 8, 67 * 64, MAX_SPLITS),
            33
        );
        // Past 1/16 of the splits: 36 wanted, 33 fit: kept.
        assert_eq!(
            choose_splits(132, DECODE_BLOCKS_PER_SM, 4, 8, 36 * 128, MAX_SPLITS),
            36
        );
    }

    proptest::proptest! {
        /// The trim only ever removes a few splits, to make one wave of every pair's blocks;
        /// otherwise the split count is the heavy pairs' one-wave count, within its bounds.
        #[test]
        fn the_wave_trim_is_small_and_makes_one_wave(
            sm_count in 1u32..200,
            heavy in 1u32..300,
            light in 0u32..300,
            max_rows in 1u32..1_000_000,
            max_splits in 1u32..=MAX_SPLITS,
            blocks_per_sm in DECODE_BLOCKS_PER_SM..=coded_blocks_per_sm(4),
        ) {
            let pairs = heavy + light;
            let slots = blocks_per_sm * sm_count;
            let untrimmed =
                choose_splits(sm_count, blocks_per_sm, heavy, heavy, max_rows, max_splits);
            let splits = choose_splits(sm_count, blocks_per_sm, heavy, pairs, max_rows, max_splits);
            proptest::prop_assert!((1..=max_splits).contains(&splits));
            proptest::prop_assert!(splits <= untrimmed);
            if splits < untrimmed {
                proptest::prop_assert!(splits * pairs <= slots);
                proptest::prop_assert!((untrimmed - splits) * 16 <= untrimmed);
            }
        }
    }

    #[test]
    fn tensor_copies_for_plain_launches_and_long_appending_ones() {
        // Launches that do not append: always.
        assert!(uses_bulk_copies(262_144, 2, false));
        assert!(uses_bulk_copies(67 * 64, 34, false));
        assert!(uses_bulk_copies(1, 0, false));
        // Appending: dense b16 256K, 2 splits of 131072 rows, 2048 tiles per warp.
        assert!(uses_bulk_copies(262_144, 2, true));
        // Dense b1 256K: 66 splits, 62 tiles per warp.
        assert!(uses_bulk_copies(262_144, 66, true));
        // LServe at b16: a selection's ~4.3K rows in 4 splits, 17 tiles per warp.
        assert!(!uses_bulk_copies(67 * 64, 4, true));
        // LServe at b1: 34 splits, 2 tiles per warp.
        assert!(!uses_bulk_copies(67 * 64, 34, true));
        assert!(!uses_bulk_copies(1, 0, true));
    }

    #[test]
    fn the_append_joins_latency_bound_launches_only() {
        // LServe at b1 256K: 33 splits of a selection's ~4.3K rows (the one-wave trim of 34),
        // at most 3 tiles per warp; 34 splits, 2.
        assert!(fuses_append(67 * 64, 33));
        assert!(fuses_append(67 * 64, 34));
        // LServe at b4 256K: 16 splits, 5 tiles per warp; b16 256K: 4 splits, 17.
        assert!(!fuses_append(67 * 64, 16));
        assert!(!fuses_append(67 * 64, 4));
        // Dense b1 256K: 66 splits, 62 tiles per warp.
        assert!(!fuses_append(262_144, 66));
        // Three tiles per warp (the line), and a split count of 0 read as 1.
        assert!(fuses_append(3 * 64, 1) && !fuses_append(3 * 64 + 1, 1));
        assert!(fuses_append(64, 0));
    }

    #[test]
    fn unsupported_shapes_are_typed_errors() {
        // Launches that do not append are the tensor-map kernel whatever `bulk` says.
        assert!(kernel_name(DType::BF16, 128, 4, false, false)
            .is_ok_and(|n| n == "decode_attention_bulk_bf16_d128"));
        assert!(kernel_name(DType::BF16, 128, 4, true, false)
            .is_ok_and(|n| n == "decode_attention_bulk_bf16_d128"));
        assert!(kernel_name(DType::F16, 64, 3, false, true)
            .is_ok_and(|n| n == "decode_attention_append_f16_d64"));
        assert!(kernel_name(DType::BF16, 128, 7, true, true)
            .is_ok_and(|n| n == "decode_attention_append_bulk_bf16_d128"));
        assert!(matches!(
            kernel_name(DType::F16, 256, 4, false, true),
            Err(LserveError::InvalidArgument {
                what: "head_dim",
                ..
            })
        ));
        for group in [0, ModelGeometry::MAX_GROUP + 1] {
            assert!(matches!(
                kernel_name(DType::F16, 64, group, true, false),
                Err(LserveError::InvalidArgument { what: "group", .. })
            ));
        }
    }

    /// The geometry's rule and the decode kernels agree: every shape `ModelGeometry::new`
    /// accepts names an attention kernel of each kind that the PTX defines, and the shapes next
    /// to them are rejected at construction.
    #[test]
    fn every_accepted_geometry_has_its_decode_kernels() {
        for d in [32, 64, 96, 128, 256] {
            for group in 1..=ModelGeometry::MAX_GROUP + 1 {
                let accepted = ModelGeometry::new(1, 2 * group, 2, d).is_ok();
                let served = ModelGeometry::SUPPORTED_HEAD_DIMS.contains(&d)
                    && group <= ModelGeometry::MAX_GROUP;
                assert_eq!(accepted, served, "d {d} group {group}");
                for dtype in [DType::BF16, DType::F16] {
                    for (bulk, append) in [(false, false), (false, true), (true, true)] {
                        let name = kernel_name(dtype, d, group, bulk, append);
                        assert_eq!(name.is_ok(), served, "d {d} group {group}");
                        if let Ok(name) = name {
                            assert!(ptx_has_kernel(&name), "{name} is not in the PTX");
                        }
                    }
                }
            }
        }
        for name in ["decode_combine_bf16", "decode_combine_f16"] {
            assert!(ptx_has_kernel(name), "{name} is not in the PTX");
        }
    }
}
