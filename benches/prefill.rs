//! Prefill benchmarks (criterion), Hq 32, Hkv 8, D 128, bf16, batch 1:
//!
//! - `prefill/dense` and `prefill/streaming50`: every head causal, and 50% streaming heads
//!   (sink 64, local 256), contexts 4K to 128K;
//! - `prefill_block_sparse/{0,40,50,80}`: at 32K, dense heads with a random caller block mask
//!   keeping 100/60/50/20% of the causal blocks off the diagonal (the oracle is dense time x
//!   the kept fraction, the shape of the paper's Figure 12).
//!
//! Throughput is given as elements = floating-point operations of the attention actually
//! visited at the token level for dense (`4 Hq D L^2 / 2`, causal), so criterion's "elem/s"
//! reads as FLOP/s; compare with `benches/torch_sdpa.py prefill` from the same device run.
//! Timed with CUDA events (`iter_custom`). Without a GPU the benchmarks are skipped.

mod common;

use common::timed;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use lserve::block_iter::BlockMask;
use lserve::cudarc::driver::CudaSlice;
use lserve::gpu::{fill_random, GpuContext, PrefillArgs, PrefillPlan};
use lserve::head_pattern::HeadKind;

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;

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

fn bench_plan(
    c: &mut Criterion,
    gpu: &GpuContext,
    group: &str,
    id: BenchmarkId,
    flops: u64,
    plan: &PrefillPlan,
    t: &mut Tensors,
) {
    let mut g = c.benchmark_group(group);
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    g.throughput(Throughput::Elements(flops));
    g.bench_function(id, |b| {
        b.iter_custom(|iters| {
            timed(gpu, iters, || {
                plan.run(gpu, &t.q, &t.k, &t.v, &mut t.out)
                    .expect("prefill")
            })
        })
    });
    g.finish();
}

fn prefill(c: &mut Criterion) {
    let gpu = match GpuContext::new(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("prefill benchmarks skipped: no usable GPU ({e})");
            return;
        }
    };
    println!("device: {}", gpu.device_name().unwrap_or_default());
    let dense = [HeadKind::Dense; HKV];
    let half: Vec<HeadKind> = (0..HKV)
        .map(|h| {
            if h % 2 == 1 {
                HeadKind::Streaming
            } else {
                HeadKind::Dense
            }
        })
        .collect();
    for len in [4096usize, 16384, 32768, 65536, 131072] {
        let mut t = tensors(&gpu, len).expect("tensors");
        let flops = (4 * HQ * D) as u64 * (len as u64 * len as u64) / 2;
        let cu = [0, len];
        for (name, kinds) in [("dense", &dense[..]), ("streaming50", &half[..])] {
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
            };
            let plan = PrefillPlan::new(&gpu, &args).expect("plan");
            bench_plan(
                c,
                &gpu,
                "prefill",
                BenchmarkId::new(name, len),
                flops,
                &plan,
                &mut t,
            );
        }
    }

    // Block sparsity on dense heads at 32K: keep a random fraction of the off-diagonal blocks.
    let len = 32768;
    let mut t = tensors(&gpu, len).expect("tensors");
    let flops = (4 * HQ * D) as u64 * (len as u64 * len as u64) / 2;
    let cu = [0, len];
    for sparsity in [0u32, 40, 50, 80] {
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

criterion_group!(benches, prefill);
criterion_main!(benches);
