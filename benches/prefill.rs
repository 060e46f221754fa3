//! Prefill benchmarks (criterion), Hq 32, Hkv 8, D 128, bf16, batch 1:
//!
//! - `prefill/dense` and `prefill/streaming50`: every head causal, and 50% streaming heads
//!   (sink 64, local 256), contexts 4K to 128K, on the default module's kernel (the `wgmma`
//!   one on compute capability 9.0); there also `prefill/{dense,streaming50}_mma_sync`, the
//!   `mma.sync` kernel of the sm_90 module in the same run;
//! - `prefill_block_sparse/{0,40,50,80}`: at 32K, dense heads with a random caller block mask
//!   keeping 100/60/50/20% of the causal blocks off the diagonal (the oracle is dense time x
//!   the kept fraction, the shape of the paper's Figure 12);
//! - `prefill_cache/*`: the "cache write fused or separate" decision, at 4K, 16K and 64K, LServe
//!   pattern (50% streaming KV heads, interleaved; sink 64, local 256), one prompt into a paged
//!   cache (pages of 64, logical pages of 16), every piece in the same run:
//!   - `attention`: the prefill attention alone on plain tensors ([`PrefillPlan::run`], plan
//!     made once);
//!   - `write`: the cache write alone ([`write_kv_rows`]: dense heads' rows into their pages,
//!     streaming heads' sinks and last window);
//!   - `pool`: the dense heads' logical-page key statistics alone ([`pool_key_stats`]);
//!   - `write_pool`: both, back to back: what `prefill_into_cache` does besides attention;
//!   - `separate`: write + pool + attention with a plan made once (an engine reusing one plan
//!     across layers);
//!   - `into_cache`: [`prefill_into_cache`] end to end (it also makes and uploads the attention
//!     plan on every call).
//!
//!   If `write_pool` is small against `attention` (and `into_cache` ≈ `attention` +
//!   `write_pool`), keeping the write separate costs little; a fused kernel could at best save
//!   the K/V re-read of the write and the K re-read of the pool.
//!
//! - `prefill_chunked/*`: a prompt prefilled in chunks against the paged cache against the same
//!   prompt in one piece, one layer, at 32K and 128K, dense heads and the LServe pattern (as
//!   `prefill_cache`): `{dense,lserve}_one_shot/L` reserves the prompt, uploads its write plan
//!   and runs [`prefill_into_cache`]; `{dense,lserve}_chunks_8192/L` does the same per chunk of
//!   8192 tokens with [`prefill_chunks_into_cache`] (each chunk gathers the cached prefix into
//!   the scratch, writes and pools itself, and attends to prefix and chunk). Each iteration
//!   starts from an empty sequence. Throughput: the attention FLOPs visited, as `prefill_cache`.
//!
//! Throughput is given as elements = floating-point operations of the attention actually
//! visited at the token level for dense (`4 Hq D L^2 / 2`, causal), so criterion's "elem/s"
//! reads as FLOP/s; compare with `benches/torch_sdpa.py prefill` from the same device run. In
//! `prefill_cache`, `attention`, `separate` and `into_cache` count the FLOPs visited at the token
//! level by the pattern (streaming heads: their sinks and window only), and `write`, `pool`,
//! `write_pool` count bytes that must move (K/V read from the activations and written to the
//! cache; the dense heads' K read and statistics written), so their rate reads as bandwidth.
//! Timed with CUDA events around back-to-back eager launches (`iter_custom`). Without a GPU the
//! benchmarks are skipped.
//!
//! Case ids: `prefill/{dense,streaming50}/L`, `prefill_block_sparse/sparsity_percent/S`,
//! `prefill_cache/NAME/L`, `prefill_chunked/NAME/L`. Set `LSERVE_BENCH_ONLY` to a substring of
//! the ids to build (or several, comma-separated): only matching cases allocate their tensors
//! and cache, e.g. `LSERVE_BENCH_ONLY=prefill_cache ./prefill --bench`.

mod common;

use common::{gpu_or_skip, selected, timed};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use lserve::block_iter::BlockMask;
use lserve::config::SparsityConfig;
use lserve::cudarc::driver::CudaSlice;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    fill_random, pool_key_stats, prefill_chunks_into_cache, prefill_into_cache, write_kv_rows,
    DeviceKvCache, DeviceKvWritePlan, GpuContext, KvWritePlan, PrefillArgs, PrefillPlan,
    PrefillScratch,
};
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::KvCacheManager;

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
/// Bytes of one bf16 row of `D` channels.
const ROW_BYTES: u64 = D as u64 * 2;
/// Prompt lengths of the `prefill_cache` group.
const CACHE_LENS: [usize; 3] = [4096, 16384, 65536];

struct Tensors {
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
}

fn tensors(gpu: &GpuContext, len: usize) -> lserve::Result<Tensors> {
    let s = gpu.stream();
    let mut q = s.alloc_zeros::<bf16>(len * HQ * D)?;
    let mut k = s.alloc_zeros::<bf16>(len * HKV * D)?;
    let mut v = s.alloc_zeros::<bf16>(len * HKV * D)?;
    fill_random(gpu, &mut q, 1)?;
    fill_random(gpu, &mut k, 2)?;
    fill_random(gpu, &mut v, 3)?;
    let out = s.alloc_zeros::<bf16>(len * HQ * D)?;
    Ok(Tensors { q, k, v, out })
}

/// Times `f` (launches on the context's stream) as `group/id`, eager back-to-back calls between
/// two events.
fn bench_eager(
    c: &mut Criterion,
    gpu: &GpuContext,
    group: &str,
    id: BenchmarkId,
    throughput: Throughput,
    mut f: impl FnMut(),
) {
    let mut g = c.benchmark_group(group);
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    g.throughput(throughput);
    g.bench_function(id, |b| b.iter_custom(|iters| timed(gpu, iters, &mut f)));
    g.finish();
}

fn bench_plan(
    c: &mut Criterion,
    gpu: &GpuContext,
    group: &str,
    id: BenchmarkId,
    flops: u64,
    plan: &PrefillPlan,
    t: &mut Tensors,
) {
    bench_eager(c, gpu, group, id, Throughput::Elements(flops), || {
        plan.run(gpu, &t.q, &t.k, &t.v, &mut t.out)
            .expect("prefill")
    });
}

/// FLOPs of a prompt's attention visited at the token level: `4 D` per (query head, query, key
/// seen); a dense head's query `t` sees `t + 1` keys, a streaming head's its window and the
/// sinks before it.
fn visited_flops(kinds: &[HeadKind], config: &SparsityConfig, len: usize) -> u64 {
    let (sink, local) = (config.sink_tokens, config.local_tokens);
    let (mut dense, mut streaming) = (0u64, 0u64);
    for t in 0..len {
        dense += t as u64 + 1;
        let window = (t + 1).min(local);
        streaming += (window + sink.min(t + 1 - window)) as u64;
    }
    let heads = |kind| kinds.iter().filter(|&&k| k == kind).count() as u64;
    let group = (HQ / HKV) as u64;
    4 * D as u64 * group * (heads(HeadKind::Dense) * dense + heads(HeadKind::Streaming) * streaming)
}

/// One prompt of `len` tokens to prefill into a one-layer paged cache (LServe pattern).
struct CacheCase {
    cache: DeviceKvCache<bf16>,
    kv_plan: DeviceKvWritePlan,
    /// The attention's plan, made once (what `prefill_into_cache` makes on every call).
    plan: PrefillPlan,
    t: Tensors,
    kinds: Vec<HeadKind>,
    config: SparsityConfig,
    len: usize,
}

fn cache_case(gpu: &GpuContext, len: usize) -> lserve::Result<CacheCase> {
    let g = ModelGeometry::new(1, HQ, HKV, D)?;
    let pattern = HeadPattern::interleaved(g, 0.5)?;
    let config = SparsityConfig::default();
    let kinds = pattern.layer_kinds(0).to_vec();
    let mut mgr = KvCacheManager::new(g, pattern, config, config.pages_for_len(len), 1, len)?;
    let seq = mgr.add_sequence()?;
    let prompt = mgr.reserve(seq, len)?;
    let mut cache = DeviceKvCache::<bf16>::new(gpu, &mgr)?;
    let kv_plan = KvWritePlan::new(&mgr, &[(seq, prompt)])?.upload(gpu, &mgr, &mut cache)?;
    let cu = [0, len];
    let plan = PrefillPlan::new(
        gpu,
        &PrefillArgs {
            q_heads: HQ,
            kv_heads: HKV,
            head_dim: D,
            cu_seqlens: &cu,
            kinds: &kinds,
            sink_tokens: config.sink_tokens,
            local_tokens: config.local_tokens,
            block_masks: None,
            softmax_scale: Some(config.softmax_scale_for(D)),
            prefix_lens: None,
            with_lse: false,
        },
    )?;
    let t = tensors(gpu, len)?;
    gpu.stream().synchronize()?;
    Ok(CacheCase {
        cache,
        kv_plan,
        plan,
        t,
        kinds,
        config,
        len,
    })
}

impl CacheCase {
    fn heads(&self, kind: HeadKind) -> u64 {
        self.kinds.iter().filter(|&&k| k == kind).count() as u64
    }

    fn visited_flops(&self) -> u64 {
        visited_flops(&self.kinds, &self.config, self.len)
    }

    /// Bytes the cache write must move: per KV head and token it holds, K and V read from the
    /// activations and written into the cache (a streaming head holds its sinks and window).
    fn write_bytes(&self) -> u64 {
        let held = self.len.min(self.config.streaming_rows()) as u64;
        let rows =
            self.heads(HeadKind::Dense) * self.len as u64 + self.heads(HeadKind::Streaming) * held;
        rows * 2 * (2 * ROW_BYTES)
    }

    /// Bytes the pooling must move: the dense heads' K rows read, their logical pages'
    /// `kmin`/`kmax` written.
    fn pool_bytes(&self) -> u64 {
        let pages = self.len.div_ceil(self.config.logical_page_tokens) as u64;
        self.heads(HeadKind::Dense) * (self.len as u64 * ROW_BYTES + pages * 2 * ROW_BYTES)
    }
}

/// The `prefill_cache` group (see the module docs).
fn prefill_cache(c: &mut Criterion, gpu: &GpuContext) {
    const NAMES: [&str; 6] = [
        "attention",
        "write",
        "pool",
        "write_pool",
        "separate",
        "into_cache",
    ];
    for len in CACHE_LENS {
        let wanted: Vec<&str> = NAMES
            .into_iter()
            .filter(|name| selected(&format!("prefill_cache/{name}/{len}")))
            .collect();
        if wanted.is_empty() {
            continue;
        }
        let mut case = match cache_case(gpu, len) {
            Ok(case) => case,
            Err(e) => {
                println!("prefill_cache {len}: skipped ({e})");
                continue;
            }
        };
        let flops = Throughput::Elements(case.visited_flops());
        let (write_bytes, pool_bytes) = (case.write_bytes(), case.pool_bytes());
        for name in wanted {
            let id = BenchmarkId::new(name, len);
            let CacheCase {
                cache,
                kv_plan,
                plan,
                t,
                ..
            } = &mut case;
            let group = "prefill_cache";
            match name {
                "attention" => bench_eager(c, gpu, group, id, flops.clone(), || {
                    plan.run(gpu, &t.q, &t.k, &t.v, &mut t.out)
                        .expect("attention")
                }),
                "write" => bench_eager(c, gpu, group, id, Throughput::Bytes(write_bytes), || {
                    write_kv_rows(gpu, cache, 0, kv_plan, &t.k, &t.v).expect("write")
                }),
                "pool" => bench_eager(c, gpu, group, id, Throughput::Bytes(pool_bytes), || {
                    pool_key_stats(gpu, cache, 0, kv_plan).expect("pool")
                }),
                "write_pool" => bench_eager(
                    c,
                    gpu,
                    group,
                    id,
                    Throughput::Bytes(write_bytes + pool_bytes),
                    || {
                        write_kv_rows(gpu, cache, 0, kv_plan, &t.k, &t.v).expect("write");
                        pool_key_stats(gpu, cache, 0, kv_plan).expect("pool");
                    },
                ),
                "separate" => bench_eager(c, gpu, group, id, flops.clone(), || {
                    write_kv_rows(gpu, cache, 0, kv_plan, &t.k, &t.v).expect("write");
                    pool_key_stats(gpu, cache, 0, kv_plan).expect("pool");
                    plan.run(gpu, &t.q, &t.k, &t.v, &mut t.out)
                        .expect("attention")
                }),
                "into_cache" => bench_eager(c, gpu, group, id, flops.clone(), || {
                    prefill_into_cache(gpu, cache, 0, kv_plan, None, &t.q, &t.k, &t.v, &mut t.out)
                        .expect("prefill into cache")
                }),
                _ => unreachable!("{name} is one of NAMES"),
            }
        }
    }
}

/// Prompt lengths and the chunk of the `prefill_chunked` group.
const CHUNKED_LENS: [usize; 2] = [32768, 131072];
const CHUNK: usize = 8192;

/// The `prefill_chunked` group (see the module docs).
fn prefill_chunked(c: &mut Criterion, gpu: &GpuContext) {
    for len in CHUNKED_LENS {
        for (pattern_name, fraction) in [("dense", 0.0), ("lserve", 0.5)] {
            let names = [
                format!("{pattern_name}_one_shot"),
                format!("{pattern_name}_chunks_{CHUNK}"),
            ];
            let wanted: Vec<&String> = names
                .iter()
                .filter(|name| selected(&format!("prefill_chunked/{name}/{len}")))
                .collect();
            if wanted.is_empty() {
                continue;
            }
            let g = ModelGeometry::new(1, HQ, HKV, D).expect("geometry");
            let pattern = HeadPattern::interleaved(g, fraction).expect("pattern");
            let config = SparsityConfig::default();
            let mgr = KvCacheManager::new(
                g,
                pattern.clone(),
                config,
                config.pages_for_len(len),
                1,
                len,
            );
            let (mut mgr, mut t) = match mgr.and_then(|m| Ok((m, tensors(gpu, len)?))) {
                Ok(x) => x,
                Err(e) => {
                    println!("prefill_chunked {len}: skipped ({e})");
                    continue;
                }
            };
            let mut cache = DeviceKvCache::<bf16>::new(gpu, &mgr).expect("cache");
            let mut scratch = PrefillScratch::<bf16>::new(gpu, &g, len).expect("scratch");
            // The FLOPs visited are the whole prompt's either way.
            let flops = visited_flops(pattern.layer_kinds(0), &config, len);
            for name in wanted {
                let chunk = if name.ends_with("one_shot") {
                    len
                } else {
                    CHUNK
                };
                let Tensors { q, k, v, out } = &mut t;
                bench_eager(
                    c,
                    gpu,
                    "prefill_chunked",
                    BenchmarkId::new(name.as_str(), len),
                    Throughput::Elements(flops),
                    || {
                        let seq = mgr.add_sequence().expect("sequence");
                        for first in (0..len).step_by(chunk) {
                            let n = chunk.min(len - first);
                            let range = mgr.reserve(seq, n).expect("reserve");
                            let kv_plan = KvWritePlan::new(&mgr, &[(seq, range)])
                                .and_then(|p| p.upload(gpu, &mgr, &mut cache))
                                .expect("write plan");
                            let (q, k, v) = (
                                q.slice(first * HQ * D..(first + n) * HQ * D),
                                k.slice(first * HKV * D..(first + n) * HKV * D),
                                v.slice(first * HKV * D..(first + n) * HKV * D),
                            );
                            let out = out.slice_mut(..n * HQ * D);
                            prefill_chunks_into_cache(
                                gpu,
                                &mut cache,
                                0,
                                &kv_plan,
                                &mut scratch,
                                q,
                                k,
                                v,
                                out,
                            )
                            .expect("prefill chunk");
                        }
                        mgr.free_sequence(seq).expect("free");
                    },
                );
            }
        }
    }
}

fn prefill(c: &mut Criterion) {
    let Some(gpu) = gpu_or_skip("prefill") else {
        return;
    };
    let dense = [HeadKind::Dense; HKV];
    // 50% streaming heads, interleaved (the odd KV heads), as the cache cases use.
    let half_pattern = ModelGeometry::new(1, HQ, HKV, D)
        .and_then(|g| HeadPattern::interleaved(g, 0.5))
        .expect("a valid geometry");
    let half = half_pattern.layer_kinds(0);
    // Where the default module runs the `wgmma` kernel (sm_90a), the `mma.sync` kernel beside
    // it in the same run: a context with the sm_90 module (the same device and primary
    // context, so the tensors are shared).
    let mma_sync = if gpu.ptx().has_wgmma() {
        Some(GpuContext::with_ptx_arch(0, "sm_90").expect("an sm_90 context"))
    } else {
        None
    };
    for len in [4096usize, 16384, 32768, 65536, 131072] {
        let mut patterns: Vec<(&str, &[HeadKind], &GpuContext)> =
            vec![("dense", &dense[..], &gpu), ("streaming50", half, &gpu)];
        if let Some(m) = &mma_sync {
            patterns.push(("dense_mma_sync", &dense[..], m));
            patterns.push(("streaming50_mma_sync", half, m));
        }
        let patterns: Vec<_> = patterns
            .into_iter()
            .filter(|(name, _, _)| selected(&format!("prefill/{name}/{len}")))
            .collect();
        if patterns.is_empty() {
            continue;
        }
        let mut t = tensors(&gpu, len).expect("tensors");
        gpu.stream().synchronize().expect("tensors ready");
        let flops = (4 * HQ * D) as u64 * (len as u64 * len as u64) / 2;
        let cu = [0, len];
        for (name, kinds, gpu) in patterns {
            let args = PrefillArgs {
                q_heads: HQ,
                kv_heads: HKV,
                head_dim: D,
                cu_seqlens: &cu,
                kinds,
                sink_tokens: 64,
                local_tokens: 256,
                block_masks: None,
                softmax_scale: None,
                prefix_lens: None,
                with_lse: false,
            };
            let plan = PrefillPlan::new(gpu, &args).expect("plan");
            bench_plan(
                c,
                gpu,
                "prefill",
                BenchmarkId::new(name, len),
                flops,
                &plan,
                &mut t,
            );
        }
    }

    // Block sparsity on dense heads at 32K: keep a random fraction of the off-diagonal blocks.
    let sparsities: Vec<u32> = [0u32, 40, 50, 80]
        .into_iter()
        .filter(|s| selected(&format!("prefill_block_sparse/sparsity_percent/{s}")))
        .collect();
    if !sparsities.is_empty() {
        let len = 32768;
        let mut t = tensors(&gpu, len).expect("tensors");
        let flops = (4 * HQ * D) as u64 * (len as u64 * len as u64) / 2;
        let cu = [0, len];
        for sparsity in sparsities {
            let mut state = 0x1234_5678_9abc_def0u64 ^ sparsity as u64;
            let mut keep = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % 100) as u32 >= sparsity
            };
            let mask = BlockMask::from_fn(HQ, len, |_, qb, kb| kb == qb || keep()).expect("mask");
            let masks = [mask];
            let args = PrefillArgs {
                q_heads: HQ,
                kv_heads: HKV,
                head_dim: D,
                cu_seqlens: &cu,
                kinds: &dense,
                sink_tokens: 64,
                local_tokens: 256,
                block_masks: Some(&masks),
                softmax_scale: None,
                prefix_lens: None,
                with_lse: false,
            };
            let plan = PrefillPlan::new(&gpu, &args).expect("plan");
            bench_plan(
                c,
                &gpu,
                "prefill_block_sparse",
                BenchmarkId::new("sparsity_percent", sparsity),
                flops,
                &plan,
                &mut t,
            );
        }
    }

    prefill_cache(c, &gpu);
    prefill_chunked(c, &gpu);
}

criterion_group!(benches, prefill);
criterion_main!(benches);
