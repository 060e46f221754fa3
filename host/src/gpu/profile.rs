//! LServe's offline profiling of `dynamic_min_len`: from which context length page selection
//! (scoring, top-K, attending to the selected pages) is faster on this GPU than attending to
//! every page.

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::cache::{DecodeBatch, DeviceElement, DeviceKvCache};
use super::decode::{DecodePlan, DecodeWorkspace};
use super::kv_write::{fill_random, pool_key_stats, KvWritePlan};
use super::select::{advance_decode_steps, SelectPlan, SelectWorkspace};
use super::GpuContext;
use crate::config::SparsityConfig;
use crate::geometry::ModelGeometry;
use crate::head_pattern::HeadPattern;
use crate::paging::KvCacheManager;
use crate::{LserveError, Result};

/// One measured context length.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProfilePoint {
    /// Tokens in each sequence (after the step's token).
    pub context: usize,
    /// Median microseconds of a decode step's attention over every page (one layer).
    pub dense_us: f64,
    /// Median microseconds of a step with page selection (select when due, attend, advance).
    pub selected_us: f64,
}

/// What [`profile_dynamic_min_len`] measured and what it recommends.
#[derive(Clone, Debug, PartialEq)]
pub struct CrossoverProfile {
    /// Every length measured, ascending.
    pub points: Vec<ProfilePoint>,
    /// The recommended `dynamic_min_len`: the longest measured length at which attending to
    /// every page was still at least as fast as selecting, so that sequences longer than it
    /// select (`None` when selection paid off at every length measured: use the shortest).
    pub dynamic_min_len: Option<usize>,
}

/// Timed replays per measurement, and measurements per point (the median is kept).
const REPLAYS: usize = 20;
const REPEATS: usize = 5;

/// Measures, on `gpu`, one layer of `geometry` with every head dense, `batch` sequences of each
/// length in `contexts`: attention over all pages against page selection with `config`'s budget,
/// page sizes, aggregation and reuse interval (selection amortized over the interval, as in
/// decoding). Each variant is captured in a CUDA graph and replayed; times are CUDA-event
/// medians. Returns the points and the crossover.
///
/// Allocates and synchronizes: run it once, offline, not inside a decode loop.
///
/// ```no_run
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{profile_dynamic_min_len, GpuContext};
///
/// let gpu = GpuContext::new(0)?;
/// let profile = profile_dynamic_min_len::<half::bf16>(
///     &gpu,
///     ModelGeometry::llama3_8b(),
///     &SparsityConfig::default(),
///     1,
///     &[4096, 8192, 16384, 32768],
/// )?;
/// let config = SparsityConfig {
///     dynamic_min_len: profile.dynamic_min_len.unwrap_or(0),
///     ..SparsityConfig::default()
/// };
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn profile_dynamic_min_len<E: DeviceElement>(
    gpu: &GpuContext,
    geometry: ModelGeometry,
    config: &SparsityConfig,
    batch: usize,
    contexts: &[usize],
) -> Result<CrossoverProfile> {
    config.validate()?;
    if batch == 0 {
        return Err(LserveError::Empty("batch"));
    }
    if contexts.is_empty() || contexts.contains(&0) {
        return Err(LserveError::InvalidArgument {
            what: "contexts",
            reason: "need at least one length, all > 0".into(),
        });
    }
    let layer = ModelGeometry::new(
        1,
        geometry.q_heads(),
        geometry.kv_heads(),
        geometry.head_dim(),
    )?;
    let mut lengths = contexts.to_vec();
    lengths.sort_unstable();
    lengths.dedup();
    let mut points = Vec::with_capacity(lengths.len());
    for &context in &lengths {
        let dense = Variant::<E>::new(gpu, layer, config, batch, context, false)?;
        let dense_us = dense.median_us(gpu)?;
        drop(dense);
        let selected = Variant::<E>::new(gpu, layer, config, batch, context, true)?;
        let selected_us = selected.median_us(gpu)?;
        points.push(ProfilePoint {
            context,
            dense_us,
            selected_us,
        });
    }
    let dynamic_min_len = points
        .iter()
        .filter(|p| p.dense_us <= p.selected_us)
        .map(|p| p.context)
        .max();
    Ok(CrossoverProfile {
        points,
        dynamic_min_len,
    })
}

/// One configured layer with its decode step captured in a graph: with selection, once with the
/// selector and once without, replayed as `DecodeStep` launches them (the selector only on the
/// steps `SparsityConfig::selects_at` names). The graphs hold the buffers' addresses, so they
/// live (and are freed) with them.
struct Variant<E> {
    graph: cudarc::driver::CudaGraph,
    /// With selection: the step without the selector, and which replays select.
    reusing: Option<(cudarc::driver::CudaGraph, SparsityConfig, usize)>,
    /// Replays so far (the device's step counters advance once per replay, from 0).
    replays: std::cell::Cell<u64>,
    _buffers: (
        DeviceKvCache<E>,
        DecodeBatch,
        DecodeWorkspace,
        SelectWorkspace,
    ),
    _tensors: (cudarc::driver::CudaSlice<E>, cudarc::driver::CudaSlice<E>),
}

impl<E: DeviceElement> Variant<E> {
    fn new(
        gpu: &GpuContext,
        geometry: ModelGeometry,
        config: &SparsityConfig,
        batch: usize,
        context: usize,
        selection: bool,
    ) -> Result<Self> {
        let config = SparsityConfig {
            // Selection on: every length selects. Off: no length does.
            dynamic_min_len: if selection { 0 } else { context },
            ..*config
        };
        let pattern = HeadPattern::all_dense(geometry);
        let pages = config.pages_for_len(context);
        let mut mgr =
            KvCacheManager::new(geometry, pattern, config, batch * pages, batch, context)?;
        let seqs = (0..batch)
            .map(|_| mgr.add_sequence())
            .collect::<Result<Vec<_>>>()?;
        for &s in &seqs {
            mgr.reserve(s, context)?;
        }
        let mut cache = DeviceKvCache::<E>::new(gpu, &mgr)?;
        cache.fill_random(gpu, 0x5eed)?;
        let ranges: Vec<_> = seqs.iter().map(|&s| (s, 0..context)).collect();
        let plan = KvWritePlan::new(&mgr, &ranges)?.upload(gpu, &mgr, &mut cache)?;
        pool_key_stats(gpu, &mut cache, 0, &plan)?;
        let mut b = DecodeBatch::new(gpu, batch)?;
        b.set(gpu, &mgr, &mut cache, &seqs)?;
        let (hq, d) = (geometry.q_heads(), geometry.head_dim());
        let mut q = gpu.stream().alloc_zeros::<E>(batch * hq * d)?;
        fill_random(gpu, &mut q, 1)?;
        let mut out = gpu.stream().alloc_zeros::<E>(batch * hq * d)?;
        let mut attention =
            DecodeWorkspace::new(gpu, batch, geometry.kv_heads(), geometry.group(), d)?;
        let mut select_ws = SelectWorkspace::new(gpu, &cache, batch)?;
        let select_plan = selection
            .then(|| SelectPlan::new(gpu, &cache, &b, &select_ws))
            .transpose()?;
        let attend_plan = DecodePlan::new(gpu, &cache, &b, &attention)?;
        gpu.stream().synchronize()?;

        let mut capture = |select: bool| -> Result<cudarc::driver::CudaGraph> {
            let stream = gpu.stream();
            stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let captured = (|| -> Result<()> {
                if let Some(plan) = select_plan.as_ref().filter(|_| select) {
                    plan.run(gpu, &mut cache, 0, &q, &mut select_ws)?;
                }
                attend_plan.run(gpu, &cache, 0, &q, &mut out, &mut attention)?;
                if selection {
                    advance_decode_steps(gpu, &mut cache, &b)?;
                }
                Ok(())
            })();
            let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
            captured?;
            graph.ok_or_else(|| LserveError::InvalidArgument {
                what: "profile",
                reason: "the captured step was empty".into(),
            })
        };
        let graph = capture(selection)?;
        let reusing = if selection {
            Some((capture(false)?, config, context))
        } else {
            None
        };
        drop((select_plan, attend_plan));
        Ok(Self {
            graph,
            reusing,
            replays: std::cell::Cell::new(0),
            _buffers: (cache, b, attention, select_ws),
            _tensors: (q, out),
        })
    }

    /// Replays the step the next decode step needs.
    fn replay(&self) -> Result<()> {
        let i = self.replays.get();
        self.replays.set(i + 1);
        match &self.reusing {
            Some((reusing, config, len)) if !config.selects_at(*len, i) => reusing.launch()?,
            _ => self.graph.launch()?,
        }
        Ok(())
    }

    /// Median over `REPEATS` of the mean time of `REPLAYS` back-to-back replays (rounded up to
    /// whole reuse intervals, so every timed window holds as many selecting steps), in µs.
    fn median_us(&self, gpu: &GpuContext) -> Result<f64> {
        let stream = gpu.stream();
        let replays = match &self.reusing {
            Some((_, config, _)) => REPLAYS.next_multiple_of(config.reuse_interval.max(1)),
            None => REPLAYS,
        };
        for _ in 0..replays {
            self.replay()?; // warm-up
        }
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let mut times = Vec::with_capacity(REPEATS);
        for _ in 0..REPEATS {
            let start = stream.record_event(flags)?;
            for _ in 0..replays {
                self.replay()?;
            }
            let end = stream.record_event(flags)?;
            times.push(start.elapsed_ms(&end)? as f64 * 1e3 / replays as f64);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }
}
