//! Decode benchmarks (criterion), one layer of Llama-3-8B geometry (Hq 32, Hkv 8, D 128), bf16,
//! batch 1 and 16, contexts 4K to 256K (the page-size sweep: 8K and 128K):
//!
//! - `attention/dense`: our paged decode with every head dense (the dense baseline);
//! - `attention/static`: 50% streaming heads, the rest dense; `attention/static_int8`,
//!   `attention/static_int4` the same over an INT8 or INT4 cache;
//! - `step/dynamic`: every head dense with page selection (budget 4096, reuse 4): a decode step's
//!   layer (`PlannedStep::layer_with_selector`: the append, selection when due, the attention),
//!   per layer, averaged over steps (so selection counts 1 in 4); `step/dynamic_int8_q8`,
//!   `step/dynamic_int4_q8` the same over an INT8 or INT4 cache with 8-bit statistics. The graph
//!   holds a whole step of [`step_layers`] layers (8 at batch 1, 4 at batch 16), each with its
//!   own cache, and the step advance once at the end, as an engine runs it; the time reported is
//!   the graph's divided by the layers. (One layer replayed alone would keep its few MB of
//!   selected pages in the 50 MB L2 from one replay to the next, and would count the once-per-step
//!   advance once per layer.)
//! - `step/lserve`: both sparsities, timed the same way; `step/lserve_int8`, `step/lserve_int4`
//!   the same over an INT8 or INT4 cache (the append quantizes, the coded attention reads codes;
//!   statistics bf16); `step/lserve_q8`, `step/lserve_int8_q8` and `step/lserve_int4_q8` select
//!   from 8-bit statistics
//!   (`StatsFormat::DEVICE_INT8`: the append codes them, the selector reads only them);
//!   `step/lserve_logical` selects 16-token logical pages (`SelectionUnit::LogicalPage`: 256 of
//!   them for the 4096-token budget) inside the 64-token pages;
//! - `selector/reuse1`, `selector/reuse4`: page selection alone (LServe pattern), timed per layer
//!   of a step graph like `step/*` (so the once-per-step advance is shared by the layers, as in a
//!   step, and the selector's cost compares with the rest of a step layer); `selector/reuse1_q8`
//!   from 8-bit statistics, `selector/reuse1_logical` of logical pages;
//! - `kv/append`: the decode append alone (`append_kv`: one token's K/V per sequence of the
//!   batch written into the cache, with the incremental `kmin`/`kmax` update), every head dense
//!   (each KV head updates its statistics), the token at position `context - 1` (inside a
//!   logical page, as 15 of 16 steps are: the update reads and writes the statistics);
//!   `kv/append_int8`, `kv/append_int4` the same into an INT8 or INT4 cache (the rows quantized
//!   as they are written);
//!   `kv/append_q8` into a bf16 cache that keeps 8-bit statistics (the page's codes rewritten);
//! - `kv/pool`: key-statistics pooling over the whole context (`pool_key_stats` of `0..context`,
//!   every head dense), batch 1 only;
//! - `attention/dense_mha`, `step/lserve_mha`: the dense baseline and the LServe step for one
//!   layer of Llama-2-7B geometry (MHA: Hq = Hkv = 32, D 128), batch 1 only: the LServe paper's
//!   ~51x at 256K is an A100 layer of this geometry. With 4 query heads per KV head (Llama-3-8B)
//!   dense decode reads 4x fewer bytes, while the step's fixed costs stay;
//! - `attention/dense_int8`, `attention/dense_int4`: `attention/dense` over a cache of INT8 or
//!   INT4 codes per token-head (132 or 68 bytes a row instead of 256;
//!   `DeviceKvCache::new_coded`), random codes and scales; `_f16`: with f16 queries;
//! - `pages/lserve_F_pN`, `pages/dense_F_pN` (`F` = `bf16`, `int8`, `int4`; `N` = 16, 32, 64,
//!   128), contexts 8K and 128K only: the page-size sweep ([`pages`]). `step/lserve` (`lserve`)
//!   and `attention/dense` (`dense`) over a cache of `F` (codes per token-head, statistics bf16)
//!   with physical pages of `N` tokens and logical pages of 16 (hierarchical; flat at 16), page
//!   selection from 4096 tokens on (so the 8K step selects one step in four, as the 128K one);
//!   `LSERVE_BENCH_ONLY=pages/` builds only these;
//! - `copy`: a device-to-device copy, the bandwidth ceiling, in the same run.
//!
//! Each is captured in a CUDA graph (as an engine runs a decode step) and timed with CUDA
//! events around `iters` back-to-back replays (criterion's `iter_custom`). A case with page
//! selection is captured twice, with the selector and without (as `DecodeStep` launches it only
//! on steps `PlannedStep::selects` names), and each replay takes the graph its step needs:
//! with reuse 4, one replay in four selects. Throughput is the
//! bytes that must move (K and V of the rows visited, the key statistics the selector reads,
//! amortized over the reuse interval; for `kv/append` the K/V activations read, the cache rows
//! written and the statistics read and written; for `kv/pool` the dense heads' K rows read and
//! the statistics written), so criterion's GB/s is the achieved bandwidth. Without a GPU the
//! benchmarks are skipped (and say so).
//!
//! Case ids are `group/name/bB/context` (e.g. `kv/append/b16/65536`) and
//! `copy/device_to_device_1GiB`. Set `LSERVE_BENCH_ONLY` to a substring of the ids to build
//! (or several, comma-separated): only matching cases allocate and fill their cache, e.g.
//! `LSERVE_BENCH_ONLY=kv/ ./decode --bench` (criterion's own filter argument still applies to
//! what is timed, but every case's cache would be built without this).

mod common;

use common::{gpu_or_skip, selected, timed};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use lserve::config::{SelectionUnit, SparsityConfig};
use lserve::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use lserve::cudarc::driver::{CudaGraph, CudaSlice};
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    advance_decode_steps, append_kv, fill_random, pool_key_stats, DecodeBatch, DecodePlan,
    DecodeStep, DecodeWorkspace, DeviceElement, DeviceKvCache, DeviceKvWritePlan, GpuContext,
    KvWritePlan, SelectPlan, SelectWorkspace,
};
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::{KvCacheManager, SeqId};
use lserve::quant::{CodeBits, IntFormat, QuantGroup, StatsFormat};

const CONTEXTS: [usize; 5] = [4096, 16384, 65536, 131072, 262144];
const BATCHES: [usize; 2] = [1, 16];
/// One layer's attention geometry (D 128, bf16).
#[derive(Clone, Copy)]
struct Model {
    hq: usize,
    hkv: usize,
}
/// Llama-3-8B (GQA, 4 query heads per KV head): every case.
const LLAMA3_8B: Model = Model { hq: 32, hkv: 8 };
/// Llama-2-7B (MHA): the geometry of the LServe paper's ~51x at 256K (one A100 layer);
/// `attention/dense_mha` and `step/lserve_mha`, batch 1 only.
const LLAMA2_7B: Model = Model { hq: 32, hkv: 32 };
const D: usize = 128;
/// Bytes of one bf16 row of `D` channels.
const ROW_BYTES: usize = D * 2;

/// One configured case: a cache of one or more layers, batch, workspaces, query, the step's new
/// K/V.
struct Bench {
    model: Model,
    cache: DeviceKvCache<bf16>,
    batch: DecodeBatch,
    attention: DecodeWorkspace,
    selection: SelectWorkspace,
    /// The decode step (`step/*`: a layer as an engine runs it).
    step: DecodeStep,
    /// The sequences' manager.
    mgr: KvCacheManager,
    seqs: Vec<SeqId>,
    q: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    /// The step token's K and V, `[B][Hkv][D]` (what `AppendPlan::run` writes).
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    /// Every sequence's `0..len`: the plan that pooled the statistics.
    plan: DeviceKvWritePlan,
    config: SparsityConfig,
    pattern: HeadPattern,
    len: usize,
    /// Bytes of one K or V row in the cache (`ROW_BYTES`, or an INT8 row and its word).
    kv_row_bytes: usize,
}

/// Layers in the graph of a `step/*` case: enough that the selected pages of all of them
/// (about 9 MB per layer at batch 1) exceed the L2, few enough that batch 16's caches fit.
fn step_layers(batch: usize) -> usize {
    if batch == 1 {
        8
    } else {
        4
    }
}

/// What a bench case's cache stores (K/V in bf16 or INT8/INT4 codes, statistics 16-bit or
/// 8-bit) and how it is paged.
#[derive(Clone, Copy)]
struct Store {
    /// K/V as integer codes per token-head of these bits (bf16 without).
    codes: Option<CodeBits>,
    /// 8-bit statistics (`StatsFormat::DEVICE_INT8`).
    q8: bool,
    /// Logical pages selected (`SelectionUnit::LogicalPage`), not physical ones.
    logical: bool,
    /// Tokens per physical page (`SparsityConfig::page_tokens`; `None`: the default, 64).
    /// Logical pages stay 16 tokens.
    page_tokens: Option<usize>,
    /// Where a case with page selection starts selecting (`SparsityConfig::dynamic_min_len`;
    /// `None`: the default, 8192).
    dynamic_min_len: Option<usize>,
}

const BF16: Store = Store {
    codes: None,
    q8: false,
    logical: false,
    page_tokens: None,
    dynamic_min_len: None,
};
const INT8: Store = Store {
    codes: Some(CodeBits::Int8),
    q8: false,
    logical: false,
    page_tokens: None,
    dynamic_min_len: None,
};
const Q8: Store = Store {
    codes: None,
    q8: true,
    logical: false,
    page_tokens: None,
    dynamic_min_len: None,
};
const INT8_Q8: Store = Store {
    codes: Some(CodeBits::Int8),
    q8: true,
    logical: false,
    page_tokens: None,
    dynamic_min_len: None,
};
const INT4: Store = Store {
    codes: Some(CodeBits::Int4),
    q8: false,
    logical: false,
    page_tokens: None,
    dynamic_min_len: None,
};
const INT4_Q8: Store = Store {
    codes: Some(CodeBits::Int4),
    q8: true,
    logical: false,
    page_tokens: None,
    dynamic_min_len: None,
};
const LOGICAL: Store = Store {
    codes: None,
    q8: false,
    logical: true,
    page_tokens: None,
    dynamic_min_len: None,
};

/// `layers` layers of `batch` sequences of `len` tokens each, cache filled with random K/V and
/// the statistics pooled from it (`store.codes`: an INT8 or INT4 cache of random codes, words and
/// statistics, `DeviceKvCache::fill_random`; `store.q8`: 8-bit statistics beside them, coded by
/// the pooling, random with INT8). With `planned`, the last token is left for the step's plan to
/// reserve (`DecodeStep::plan`, as an engine's step does).
#[allow(clippy::too_many_arguments)]
fn bench_case(
    gpu: &GpuContext,
    model: Model,
    layers: usize,
    batch: usize,
    len: usize,
    planned: bool,
    streaming: bool,
    selection: bool,
    reuse: usize,
    store: Store,
) -> lserve::Result<Bench> {
    let format = store
        .codes
        .map(|bits| IntFormat::new(bits, QuantGroup::TokenHead));
    let coded = format.is_some();
    let g = ModelGeometry::new(layers, model.hq, model.hkv, D)?;
    let pattern = if streaming {
        HeadPattern::interleaved(g, 0.5)?
    } else {
        HeadPattern::all_dense(g)
    };
    let defaults = SparsityConfig::default();
    let config = SparsityConfig {
        dynamic_min_len: if selection {
            store.dynamic_min_len.unwrap_or(defaults.dynamic_min_len)
        } else {
            len
        },
        page_tokens: store.page_tokens.unwrap_or(defaults.page_tokens),
        reuse_interval: reuse,
        stats_format: if store.q8 {
            StatsFormat::DEVICE_INT8
        } else {
            StatsFormat::Half
        },
        selection_unit: if store.logical {
            SelectionUnit::LogicalPage
        } else {
            SelectionUnit::PhysicalPage
        },
        ..defaults
    };
    let pages = config.pages_for_len(len);
    let mut mgr = KvCacheManager::new(g, pattern.clone(), config, batch * pages, batch, len)?;
    let seqs: Vec<_> = (0..batch)
        .map(|_| mgr.add_sequence())
        .collect::<lserve::Result<_>>()?;
    let cached = len - usize::from(planned);
    for &s in &seqs {
        mgr.reserve(s, cached)?;
    }
    let mut cache = match format {
        Some(format) => DeviceKvCache::<bf16>::new_coded(gpu, &mgr, format)?,
        None => DeviceKvCache::<bf16>::new(gpu, &mgr)?,
    };
    cache.fill_random(gpu, 17)?;
    let ranges: Vec<_> = seqs.iter().map(|&s| (s, 0..cached)).collect();
    let plan = KvWritePlan::new(&mgr, &ranges)?.upload(gpu, &mgr, &mut cache)?;
    if !coded {
        for layer in 0..layers {
            pool_key_stats(gpu, &mut cache, layer, &plan)?;
        }
    }
    let mut b = DecodeBatch::new(gpu, batch)?;
    b.set(gpu, &mgr, &mut cache, &seqs)?;
    let stream = gpu.stream();
    let mut q = stream.alloc_zeros::<bf16>(batch * model.hq * D)?;
    fill_random(gpu, &mut q, 99)?;
    let out = stream.alloc_zeros::<bf16>(batch * model.hq * D)?;
    let mut k = stream.alloc_zeros::<bf16>(batch * model.hkv * D)?;
    let mut v = stream.alloc_zeros::<bf16>(batch * model.hkv * D)?;
    fill_random(gpu, &mut k, 5)?;
    fill_random(gpu, &mut v, 6)?;
    let attention = DecodeWorkspace::new(gpu, batch, model.hkv, model.hq / model.hkv, D)?;
    let selection = SelectWorkspace::new(gpu, &cache, batch)?;
    let step = DecodeStep::new(gpu, &cache, batch)?;
    stream.synchronize()?;
    Ok(Bench {
        model,
        cache,
        batch: b,
        attention,
        selection,
        step,
        mgr,
        seqs,
        q,
        out,
        k,
        v,
        plan,
        config,
        pattern,
        len,
        kv_row_bytes: match format {
            Some(format) => format.row_bytes(D)?,
            None => ROW_BYTES,
        },
    })
}

impl Bench {
    /// Bytes one decode step must move: K+V rows visited, plus (selection on) the key
    /// statistics of the dense heads once per reuse interval, plus q and out.
    fn step_bytes(&self, with_selection: bool, with_attention: bool) -> u64 {
        let n_u = self.config.unit_tokens();
        let row = 2 * self.kv_row_bytes;
        let batch = self.batch.len();
        let mut bytes = 0usize;
        for h in 0..self.model.hkv {
            let kind = self.pattern.kind(0, h);
            let selecting = kind == HeadKind::Dense && self.config.uses_page_selection(self.len);
            if with_attention {
                let rows = match kind {
                    HeadKind::Streaming => self.len.min(self.config.streaming_rows()),
                    HeadKind::Dense if !selecting => self.len,
                    HeadKind::Dense => {
                        let units = self.config.units_for_len(self.len);
                        let first = usize::from(self.config.always_include_first_page);
                        let full = (self.config.pages_per_selection() + first).min(units - 1);
                        full * n_u + (self.len - (units - 1) * n_u)
                    }
                };
                bytes += rows * row;
            }
            if with_selection && selecting {
                let page_bytes = match self.config.stats_format {
                    StatsFormat::Half => 2 * ROW_BYTES,
                    StatsFormat::Int8(group) => group.page_bytes(D).expect("D 128"),
                };
                bytes += self.len.div_ceil(self.config.logical_page_tokens) * page_bytes
                    / self.config.reuse_interval;
            }
        }
        (batch * (bytes + 2 * self.model.hq * ROW_BYTES)) as u64
    }

    /// Bytes one `AppendPlan::run` must move: per sequence and KV head, the token's K and V read from
    /// the activations and written into the cache, and for a dense head its logical page's
    /// `kmin`/`kmax` written (and read first unless the token starts the logical page).
    fn append_bytes(&self) -> u64 {
        let pos = self.len - 1;
        let starts_logical = pos.is_multiple_of(self.config.logical_page_tokens);
        let mut per_seq = 0usize;
        for h in 0..self.model.hkv {
            per_seq += 2 * (ROW_BYTES + self.kv_row_bytes); // K+V: read, then written
            if self.pattern.kind(0, h) == HeadKind::Dense {
                let stats = 2 * ROW_BYTES; // kmin + kmax of one head
                per_seq += if starts_logical { stats } else { 2 * stats };
                if let StatsFormat::Int8(group) = self.config.stats_format {
                    per_seq += group.page_bytes(D).expect("D 128"); // the page's codes written
                }
            }
        }
        (self.batch.len() * per_seq) as u64
    }

    /// Bytes pooling `0..len` of every sequence must move: the dense heads' K rows read, their
    /// logical pages' `kmin`/`kmax` written.
    fn pool_bytes(&self) -> u64 {
        let dense = (0..self.model.hkv)
            .filter(|&h| self.pattern.kind(0, h) == HeadKind::Dense)
            .count();
        let pages = self.len.div_ceil(self.config.logical_page_tokens);
        (self.batch.len() * dense * (self.len * ROW_BYTES + pages * 2 * ROW_BYTES)) as u64
    }
}

/// One case of the decode grid: what runs over which cache.
#[derive(Clone, Copy)]
struct Variant {
    model: Model,
    /// Half the KV heads streaming (`HeadPattern::interleaved`), else every head dense.
    streaming: bool,
    /// Page selection on (the dense heads attend to selected pages).
    selection: bool,
    /// The reuse interval `C`.
    reuse: usize,
    /// The selector runs (on the steps `SparsityConfig::selects_at` names).
    run_select: bool,
    /// The attention runs.
    run_attend: bool,
    store: Store,
    /// A decode step as an engine runs it (`DecodeStep::plan`, `PlannedStep::layer_with_selector`:
    /// the append, the selector when due, the attention), not the plans alone.
    planned: bool,
}

impl Variant {
    /// Builds the case at `batch` and `context` and times it as `group_name/name/bB/context`.
    fn bench(
        self,
        c: &mut Criterion,
        gpu: &GpuContext,
        group_name: &str,
        name: &str,
        batch_size: usize,
        context: usize,
    ) -> lserve::Result<()> {
        let (run_select, run_attend) = (self.run_select, self.run_attend);
        // Attention alone is one layer (a dense layer's cache is 1 GiB per sequence at 256K);
        // selection is timed per layer of a step graph, like the steps.
        let layers = if self.planned || run_select {
            step_layers(batch_size)
        } else {
            1
        };
        // The step's token is in the cache: `context + 1` tokens (a step's plan reserves it).
        let mut l = bench_case(
            gpu,
            self.model,
            layers,
            batch_size,
            context + 1,
            self.planned,
            self.streaming,
            self.selection,
            self.reuse,
            self.store,
        )?;
        let mut bytes = l.step_bytes(run_select, run_attend);
        if self.planned {
            bytes += l.append_bytes();
        }
        // One decode step (or selector run), as an engine runs it: captured once with the
        // selector and once without, and each replay takes the one the step's
        // `SparsityConfig::selects_at` asks for (the device's step counters advance one per
        // replay from 0, as the replays count them).
        let (config, len) = (l.config, l.len);
        let Bench {
            cache,
            batch,
            attention,
            selection,
            step,
            mgr,
            seqs,
            q,
            out,
            k,
            v,
            ..
        } = &mut l;
        // `step/*`: one planned step (its token reserved, tables and batch written), captured
        // twice; the replays rewrite the same token's position.
        let mut plan = match self.planned {
            true => Some(step.plan(gpu, mgr, cache, seqs)?),
            false => None,
        };
        // `selection/*`, `attention/*`: the batch's plans, made once for every layer.
        let batch = &*batch;
        let select_plan = match plan.is_none() && run_select {
            true => Some(SelectPlan::new(gpu, cache, batch, selection)?),
            false => None,
        };
        let attend_plan = match plan.is_none() && run_attend {
            true => Some(DecodePlan::new(gpu, cache, batch, attention)?),
            false => None,
        };
        let mut run_step = |select: bool| {
            for layer in 0..layers {
                if let Some(plan) = plan.as_mut() {
                    // A decode step's layer: the append (inside the attention launch or before
                    // the selector), the selector if `select`, the attention.
                    plan.layer_with_selector(select, gpu, cache, layer, &*q, &*k, &*v, &mut *out)
                        .expect("step layer");
                    continue;
                }
                if let Some(p) = select_plan.as_ref().filter(|_| select) {
                    p.run(gpu, cache, layer, &*q, selection).expect("select");
                }
                if let Some(p) = &attend_plan {
                    p.run(gpu, cache, layer, &*q, &mut *out, attention)
                        .expect("attend");
                }
            }
            if run_select {
                let batch = plan.as_ref().map_or(batch, |p| p.batch());
                advance_decode_steps(gpu, cache, batch).expect("advance");
            }
        };
        let reusing = capture(gpu, || run_step(false));
        let selecting = run_select.then(|| capture(gpu, || run_step(true)));
        let graph_for = |replay: u64| match &selecting {
            Some(graph) if config.selects_at(len, replay) => graph,
            _ => &reusing,
        };
        let id = BenchmarkId::new(name, format!("b{batch_size}/{context}"));
        bench_replays(c, gpu, group_name, id, bytes, layers, graph_for);
        Ok(())
    }
}

/// `attention/dense_int8`, `attention/dense_int4`: `attention/dense` (Llama-3-8B, every head
/// dense, one layer) over a cache of `bits` codes per token-head (`DeviceKvCache::new_coded`,
/// random codes and scales); throughput is the code rows and their `(scale, minimum)` words
/// read, plus q and out.
fn coded_dense<E: DeviceElement>(
    c: &mut Criterion,
    gpu: &GpuContext,
    batch: usize,
    len: usize,
    bits: CodeBits,
    id: BenchmarkId,
) -> lserve::Result<()> {
    let model = LLAMA3_8B;
    let g = ModelGeometry::new(1, model.hq, model.hkv, D)?;
    let config = SparsityConfig {
        dynamic_min_len: len,
        ..SparsityConfig::default()
    };
    let pages = config.pages_for_len(len);
    let mut mgr = KvCacheManager::new(
        g,
        HeadPattern::all_dense(g),
        config,
        batch * pages,
        batch,
        len,
    )?;
    let seqs: Vec<_> = (0..batch)
        .map(|_| mgr.add_sequence())
        .collect::<lserve::Result<_>>()?;
    for &s in &seqs {
        mgr.reserve(s, len)?;
    }
    let format = IntFormat::new(bits, QuantGroup::TokenHead);
    let mut cache = DeviceKvCache::<E>::new_coded(gpu, &mgr, format)?;
    cache.fill_random(gpu, 17)?;
    let mut b = DecodeBatch::new(gpu, batch)?;
    b.set(gpu, &mgr, &mut cache, &seqs)?;
    let stream = gpu.stream();
    let mut q = stream.alloc_zeros::<E>(batch * model.hq * D)?;
    fill_random(gpu, &mut q, 99)?;
    let mut out = stream.alloc_zeros::<E>(batch * model.hq * D)?;
    let mut ws = DecodeWorkspace::new(gpu, batch, model.hkv, model.hq / model.hkv, D)?;
    let plan = DecodePlan::new(gpu, &cache, &b, &ws)?;
    stream.synchronize()?;
    let row = 2 * format.row_bytes(D)?;
    let bytes = (batch * (model.hkv * len * row + 2 * model.hq * ROW_BYTES)) as u64;
    bench_captured(c, gpu, "attention", id, bytes, 1, || {
        plan.run(gpu, &cache, 0, &q, &mut out, &mut ws)
            .expect("attend");
    });
    Ok(())
}

/// What `launches` enqueues on the context's stream, captured in a CUDA graph.
fn capture(gpu: &GpuContext, launches: impl FnOnce()) -> CudaGraph {
    let stream = gpu.stream().clone();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("capture");
    launches();
    stream
        .end_capture(CUgraphInstantiate_flags(0))
        .expect("capture")
        .expect("a non-empty graph")
}

/// Captures what `launches` enqueues on the context's stream in a CUDA graph (as an engine runs
/// a decode step) and times back-to-back replays of it between two events, as `group/id`; the
/// graph holds `layers` layers' worth of work and the time reported is per layer.
fn bench_captured(
    c: &mut Criterion,
    gpu: &GpuContext,
    group_name: &str,
    id: BenchmarkId,
    bytes: u64,
    layers: usize,
    launches: impl FnOnce(),
) {
    let graph = capture(gpu, launches);
    bench_replays(c, gpu, group_name, id, bytes, layers, |_| &graph);
}

/// Times back-to-back replays of the graph `graph_for(i)` for replay `i = 0, 1, 2, ..` (counted
/// across criterion's calls), as `group/id`, per layer of the `layers` each graph holds.
fn bench_replays<'g>(
    c: &mut Criterion,
    gpu: &GpuContext,
    group_name: &str,
    id: BenchmarkId,
    bytes: u64,
    layers: usize,
    graph_for: impl Fn(u64) -> &'g CudaGraph,
) {
    let mut replays = 0u64;
    let mut group = c.benchmark_group(group_name);
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(800));
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            timed(gpu, iters, || {
                graph_for(replays).launch().expect("replay");
                replays += 1;
            }) / layers as u32
        })
    });
    group.finish();
}

fn copy(c: &mut Criterion, gpu: &GpuContext) {
    if !selected("copy/device_to_device_1GiB") {
        return;
    }
    let n = 1usize << 30;
    let src = gpu.stream().alloc_zeros::<u8>(n).expect("alloc");
    let mut dst = gpu.stream().alloc_zeros::<u8>(n).expect("alloc");
    let mut group = c.benchmark_group("copy");
    group.throughput(Throughput::Bytes(2 * n as u64));
    group.bench_function("device_to_device_1GiB", |b| {
        b.iter_custom(|iters| {
            timed(gpu, iters, || {
                gpu.stream().memcpy_dtod(&src, &mut dst).expect("copy")
            })
        })
    });
    group.finish();
}

/// The page-size sweep's physical page sizes (`N_P`; logical pages 16 tokens).
const PAGE_SIZES: [usize; 4] = [16, 32, 64, 128];
/// The page-size sweep's contexts.
const PAGE_CONTEXTS: [usize; 2] = [8192, 131072];

/// `pages/*`: the LServe decode step (as `step/lserve`: 50% streaming heads, budget 4096, reuse
/// 4) and dense decode (as `attention/dense`) at each physical page size of [`PAGE_SIZES`], over
/// bf16, INT8 and INT4 caches, batch 1 and 16, contexts [`PAGE_CONTEXTS`]. Selection starts past
/// the budget (`dynamic_min_len` 4096): with the default 8192 the 8K case's sequence of 8193
/// tokens would be on its first selecting step at every replay (nothing held before it), and
/// would select on every step instead of one in four.
fn pages(c: &mut Criterion, gpu: &GpuContext) {
    let budget = SparsityConfig::default().token_budget;
    for batch in BATCHES {
        for context in PAGE_CONTEXTS {
            for (format, store) in [("bf16", BF16), ("int8", INT8), ("int4", INT4)] {
                for n_p in PAGE_SIZES {
                    let store = Store {
                        page_tokens: Some(n_p),
                        dynamic_min_len: Some(budget),
                        ..store
                    };
                    let lserve = Variant {
                        model: LLAMA3_8B,
                        streaming: true,
                        selection: true,
                        reuse: 4,
                        run_select: true,
                        run_attend: true,
                        store,
                        planned: true,
                    };
                    let dense = Variant {
                        streaming: false,
                        selection: false,
                        run_select: false,
                        planned: false,
                        ..lserve
                    };
                    for (kind, variant) in [("lserve", lserve), ("dense", dense)] {
                        let name = format!("{kind}_{format}_p{n_p}");
                        if !selected(&format!("pages/{name}/b{batch}/{context}")) {
                            continue;
                        }
                        if let Err(e) = variant.bench(c, gpu, "pages", &name, batch, context) {
                            println!("pages/{name} b{batch}/{context}: skipped ({e})");
                        }
                    }
                }
            }
        }
    }
}

fn decode(c: &mut Criterion) {
    let Some(gpu) = gpu_or_skip("decode") else {
        return;
    };
    copy(c, &gpu);
    for &batch in &BATCHES {
        for &context in &CONTEXTS {
            let id = |name: &str| BenchmarkId::new(name, format!("b{batch}/{context}"));
            let case = |group: &str, name: &str| format!("{group}/{name}/b{batch}/{context}");
            // (model, group, name, streaming heads, page selection, reuse, run selection, run
            // attention, what the cache stores)
            let l3 = LLAMA3_8B;
            let variants = [
                (l3, "attention", "dense", false, false, 4, false, true, BF16),
                (l3, "attention", "static", true, false, 4, false, true, BF16),
                (
                    l3,
                    "attention",
                    "static_int8",
                    true,
                    false,
                    4,
                    false,
                    true,
                    INT8,
                ),
                (
                    l3,
                    "attention",
                    "static_int4",
                    true,
                    false,
                    4,
                    false,
                    true,
                    INT4,
                ),
                (l3, "step", "dynamic", false, true, 4, true, true, BF16),
                (
                    l3,
                    "step",
                    "dynamic_int8_q8",
                    false,
                    true,
                    4,
                    true,
                    true,
                    INT8_Q8,
                ),
                (
                    l3,
                    "step",
                    "dynamic_int4_q8",
                    false,
                    true,
                    4,
                    true,
                    true,
                    INT4_Q8,
                ),
                (l3, "step", "lserve", true, true, 4, true, true, BF16),
                (l3, "step", "lserve_q8", true, true, 4, true, true, Q8),
                (
                    l3,
                    "step",
                    "lserve_logical",
                    true,
                    true,
                    4,
                    true,
                    true,
                    LOGICAL,
                ),
                (l3, "step", "lserve_int8", true, true, 4, true, true, INT8),
                (l3, "step", "lserve_int4", true, true, 4, true, true, INT4),
                (
                    l3,
                    "step",
                    "lserve_int4_q8",
                    true,
                    true,
                    4,
                    true,
                    true,
                    INT4_Q8,
                ),
                (
                    l3,
                    "step",
                    "lserve_int8_q8",
                    true,
                    true,
                    4,
                    true,
                    true,
                    INT8_Q8,
                ),
                (l3, "selector", "reuse1", true, true, 1, true, false, BF16),
                (l3, "selector", "reuse1_q8", true, true, 1, true, false, Q8),
                (
                    l3,
                    "selector",
                    "reuse1_logical",
                    true,
                    true,
                    1,
                    true,
                    false,
                    LOGICAL,
                ),
                (l3, "selector", "reuse4", true, true, 4, true, false, BF16),
                (
                    LLAMA2_7B,
                    "attention",
                    "dense_mha",
                    false,
                    false,
                    4,
                    false,
                    true,
                    BF16,
                ),
                (
                    LLAMA2_7B,
                    "step",
                    "lserve_mha",
                    true,
                    true,
                    4,
                    true,
                    true,
                    BF16,
                ),
            ];
            for (
                model,
                group_name,
                name,
                streaming,
                selection,
                reuse,
                run_select,
                run_attend,
                store,
            ) in variants
            {
                // The MHA model's cases are batch 1 only (the paper's setting).
                let mha = model.hkv == model.hq;
                if (mha && batch != 1) || !selected(&case(group_name, name)) {
                    continue;
                }
                let variant = Variant {
                    model,
                    streaming,
                    selection,
                    reuse,
                    run_select,
                    run_attend,
                    store,
                    planned: group_name == "step",
                };
                if let Err(e) = variant.bench(c, &gpu, group_name, name, batch, context) {
                    println!("{group_name}/{name} b{batch}/{context}: skipped ({e})");
                }
            }

            // Dense attention over INT8 and INT4 coded caches, beside `attention/dense`, with
            // bf16 and f16 queries (the f16 kernels' code conversion is one `prmt` or `lop3` and
            // one `sub.f16x2` or `fma.rn.f16x2` per pair; the bf16 INT8 kernel's two `prmt`, two
            // subtractions and a `prmt`).
            for (name, bits, f16) in [
                ("dense_int8", CodeBits::Int8, false),
                ("dense_int8_f16", CodeBits::Int8, true),
                ("dense_int4", CodeBits::Int4, false),
                ("dense_int4_f16", CodeBits::Int4, true),
            ] {
                if !selected(&case("attention", name)) {
                    continue;
                }
                let len = context + 1;
                let result = if f16 {
                    coded_dense::<half::f16>(c, &gpu, batch, len, bits, id(name))
                } else {
                    coded_dense::<bf16>(c, &gpu, batch, len, bits, id(name))
                };
                if let Err(e) = result {
                    println!("attention/{name} b{batch}/{context}: skipped ({e})");
                }
            }

            // The append alone. Its replay is valid as is: the append changes no length or
            // counter (the sequence lengths are the batch's, written by `DecodeBatch::set`
            // outside the graph, as an engine does between steps), it only writes position
            // `len - 1` and that logical page's `kmin`/`kmax`. Replaying it with the same K/V
            // rewrites the same rows with the same values and folds the same key into the
            // statistics again (min/max are idempotent), so every replay moves exactly the
            // bytes of one engine append and leaves the cache as one append would. The cache
            // holds `context` tokens after the append (position `context - 1`: the last token
            // of a logical page, so the update reads and writes the statistics, as 15 of 16
            // steps do with logical pages of 16).
            // `kv/append_int8`: the same into an INT8 cache (each row quantized as it is
            // written: the codes and the word are the same on every replay too).
            for (name, coded) in [
                ("append", BF16),
                ("append_int8", INT8),
                ("append_int4", INT4),
                ("append_q8", Q8),
            ] {
                if !selected(&case("kv", name)) {
                    continue;
                }
                match bench_case(
                    &gpu, LLAMA3_8B, 1, batch, context, false, false, true, 4, coded,
                ) {
                    Ok(mut l) => {
                        let bytes = l.append_bytes();
                        bench_captured(c, &gpu, "kv", id(name), bytes, 1, || {
                            let Bench {
                                cache, batch, k, v, ..
                            } = &mut l;
                            append_kv(&gpu, cache, 0, batch, &*k, &*v).expect("append");
                        });
                    }
                    Err(e) => println!("kv/{name} b{batch}/{context}: skipped ({e})"),
                }
            }

            // Statistics pooling over the whole context (prefill's pooling of a prompt, or a
            // rebuild): it recomputes `kmin`/`kmax` from the K rows, so replays are state-free.
            if batch == 1 && selected(&case("kv", "pool")) {
                match bench_case(
                    &gpu, LLAMA3_8B, 1, batch, context, false, false, true, 4, BF16,
                ) {
                    Ok(mut l) => {
                        let bytes = l.pool_bytes();
                        bench_captured(c, &gpu, "kv", id("pool"), bytes, 1, || {
                            let Bench { cache, plan, .. } = &mut l;
                            pool_key_stats(&gpu, cache, 0, plan).expect("pool");
                        });
                    }
                    Err(e) => println!("kv/pool b{batch}/{context}: skipped ({e})"),
                }
            }
        }
    }
    pages(c, &gpu);
}

criterion_group!(benches, decode);
criterion_main!(benches);
