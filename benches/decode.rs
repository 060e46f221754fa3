//! Decode benchmarks (criterion), one layer of Llama-3-8B geometry (Hq 32, Hkv 8, D 128), bf16,
//! batch 1 and 16, contexts 4K to 256K:
//!
//! - `attention/dense`: our paged decode with every head dense (the dense baseline);
//! - `attention/static`: 50% streaming heads, the rest dense;
//! - `step/dynamic`: every head dense with page selection (budget 4096, reuse 4): selection when
//!   due + attention + step advance, averaged over steps (so selection counts 1 in 4);
//! - `step/lserve`: both sparsities;
//! - `selector/reuse1`, `selector/reuse4`: page selection alone (LServe pattern);
//! - `copy`: a device-to-device copy, the bandwidth ceiling, in the same run.
//!
//! Each is captured once in a CUDA graph (as an engine runs a decode step) and timed with CUDA
//! events around `iters` back-to-back replays (criterion's `iter_custom`). Throughput is the bytes that must move (K and V of the rows visited, the key
//! statistics the selector reads, amortized over the reuse interval), so criterion's GB/s is the
//! achieved bandwidth. Without a GPU the benchmarks are skipped (and say so).

mod common;

use common::timed;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use lserve::config::SparsityConfig;
use lserve::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use lserve::cudarc::driver::CudaSlice;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    advance_decode_steps, decode_attention, fill_random, pool_key_stats, select_pages, DecodeBatch,
    DecodeWorkspace, DeviceKvCache, GpuContext, KvWritePlan, SelectWorkspace,
};
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::KvCacheManager;

const CONTEXTS: [usize; 5] = [4096, 16384, 65536, 131072, 262144];
const BATCHES: [usize; 2] = [1, 16];

/// One configured layer: cache, batch, workspaces, query.
struct Layer {
    cache: DeviceKvCache<bf16>,
    batch: DecodeBatch,
    attention: DecodeWorkspace,
    selection: SelectWorkspace,
    q: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    config: SparsityConfig,
    pattern: HeadPattern,
    len: usize,
}

fn layer(
    gpu: &GpuContext,
    batch: usize,
    context: usize,
    streaming: bool,
    selection: bool,
    reuse: usize,
) -> lserve::Result<Layer> {
    let g = ModelGeometry::new(1, 32, 8, 128)?;
    let pattern = if streaming {
        HeadPattern::interleaved(g, 0.5)?
    } else {
        HeadPattern::all_dense(g)
    };
    let len = context + 1; // the step's token is in the cache
    let config = SparsityConfig {
        dynamic_min_len: if selection {
            SparsityConfig::default().dynamic_min_len
        } else {
            len
        },
        reuse_interval: reuse,
        ..SparsityConfig::default()
    };
    let pages = config.pages_for_len(len);
    let mut mgr = KvCacheManager::new(g, pattern.clone(), config, batch * pages, batch, len)?;
    let seqs: Vec<_> = (0..batch)
        .map(|_| mgr.add_sequence())
        .collect::<lserve::Result<_>>()?;
    for &s in &seqs {
        mgr.reserve(s, len)?;
    }
    let mut cache = DeviceKvCache::<bf16>::new(gpu, &mgr)?;
    cache.sync_tables(gpu, &mgr)?;
    cache.fill_random(gpu, 17)?;
    let ranges: Vec<_> = seqs.iter().map(|&s| (s, 0..len)).collect();
    let plan = KvWritePlan::new(&mgr, &ranges)?.upload(gpu)?;
    pool_key_stats(gpu, &mut cache, 0, &plan)?;
    let mut b = DecodeBatch::new(gpu, batch)?;
    b.set(gpu, &mgr, &seqs)?;
    let mut q = gpu.stream().alloc_zeros::<bf16>(batch * 32 * 128)?;
    fill_random(gpu, &mut q, 99)?;
    let out = gpu.stream().alloc_zeros::<bf16>(batch * 32 * 128)?;
    let attention = DecodeWorkspace::new(gpu, batch, 8, 4, 128)?;
    let selection = SelectWorkspace::new(gpu, &cache, batch)?;
    gpu.stream().synchronize()?;
    Ok(Layer {
        cache,
        batch: b,
        attention,
        selection,
        q,
        out,
        config,
        pattern,
        len,
    })
}

impl Layer {
    /// Bytes one decode step must move: K+V rows visited, plus (selection on) the key
    /// statistics of the dense heads once per reuse interval, plus q and out.
    fn step_bytes(&self, with_selection: bool, with_attention: bool) -> u64 {
        let (d, n_p) = (128usize, self.config.page_tokens);
        let row = 2 * d * 2;
        let batch = self.batch.len();
        let mut bytes = 0usize;
        for h in 0..8 {
            let kind = self.pattern.kind(0, h);
            let selecting = kind == HeadKind::Dense && self.config.uses_page_selection(self.len);
            if with_attention {
                let rows = match kind {
                    HeadKind::Streaming => self.len.min(self.config.streaming_rows()),
                    HeadKind::Dense if !selecting => self.len,
                    HeadKind::Dense => {
                        let pages = self.config.pages_for_len(self.len);
                        let first = usize::from(self.config.always_include_first_page);
                        let full = (self.config.pages_per_selection() + first).min(pages - 1);
                        full * n_p + (self.len - (pages - 1) * n_p)
                    }
                };
                bytes += rows * row;
            }
            if with_selection && selecting {
                bytes += self.len.div_ceil(self.config.logical_page_tokens) * 2 * d * 2
                    / self.config.reuse_interval;
            }
        }
        (batch * (bytes + 2 * 32 * d * 2)) as u64
    }
}

fn copy(c: &mut Criterion, gpu: &GpuContext) {
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

fn decode(c: &mut Criterion) {
    let gpu = match GpuContext::new(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("decode benchmarks skipped: no usable GPU ({e})");
            return;
        }
    };
    println!("device: {}", gpu.device_name().unwrap_or_default());
    copy(c, &gpu);
    for &batch in &BATCHES {
        for &context in &CONTEXTS {
            let id = |name: &str| BenchmarkId::new(name, format!("b{batch}/{context}"));
            // (group, name, streaming heads, page selection, reuse, run selection, run attention)
            let variants = [
                ("attention", "dense", false, false, 4, false, true),
                ("attention", "static", true, false, 4, false, true),
                ("step", "dynamic", false, true, 4, true, true),
                ("step", "lserve", true, true, 4, true, true),
                ("selector", "reuse1", true, true, 1, true, false),
                ("selector", "reuse4", true, true, 4, true, false),
            ];
            for (group_name, name, streaming, selection, reuse, run_select, run_attend) in variants
            {
                let mut l = match layer(&gpu, batch, context, streaming, selection, reuse) {
                    Ok(l) => l,
                    Err(e) => {
                        println!("{group_name}/{name} b{batch}/{context}: skipped ({e})");
                        continue;
                    }
                };
                let mut group = c.benchmark_group(group_name);
                group
                    .sample_size(10)
                    .warm_up_time(Duration::from_millis(300))
                    .measurement_time(Duration::from_millis(800));
                group.throughput(Throughput::Bytes(l.step_bytes(run_select, run_attend)));
                // One decode step (or selector run) captured in a CUDA graph, as an engine runs
                // it; the graph is replayed back to back between two events.
                let stream = gpu.stream().clone();
                stream
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .expect("capture");
                {
                    let Layer {
                        cache,
                        batch,
                        attention,
                        selection,
                        q,
                        out,
                        ..
                    } = &mut l;
                    if run_select {
                        select_pages(&gpu, cache, 0, batch, q, selection).expect("select");
                    }
                    if run_attend {
                        decode_attention(&gpu, cache, 0, batch, q, out, attention).expect("attend");
                    }
                    if run_select {
                        advance_decode_steps(&gpu, cache, batch).expect("advance");
                    }
                }
                let graph = stream
                    .end_capture(CUgraphInstantiate_flags(0))
                    .expect("capture")
                    .expect("a non-empty graph");
                group.bench_function(id(name), |b| {
                    b.iter_custom(|iters| timed(&gpu, iters, || graph.launch().expect("replay")))
                });
                group.finish();
            }
        }
    }
}

criterion_group!(benches, decode);
criterion_main!(benches);
