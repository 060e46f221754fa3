//! lserve on an engine's stream ([`GpuContext::from_stream`]) and on its own
//! ([`GpuContext::new`]).
//!
//! The engine here is plain cudarc: a context with cudarc's defaults (event tracking on) and
//! streams made with `new_stream`, so cudarc manages cross-stream synchronization. The GPU tests
//! check that lserve's launches and copies go to the engine's stream (a capture on that stream
//! holds them), that lserve leaves the engine's event tracking on and honours it (another engine
//! stream reads the output of a prefill and of a decode step with no synchronization by hand, the
//! decode step's launches being lserve's own overlapped ones), that a capture works with tracking
//! turned off around it as `GpuContext`'s docs say, and that the results match the CPU reference.
//! GPU tests are ignored without a GPU; the driver check runs anywhere.

mod common;

use std::sync::Arc;

use common::tolerance;
use half::bf16;
use lserve::config::SparsityConfig;
use lserve::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use lserve::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    driver_present, fill_random, pool_key_stats, prefill_attention, DecodeStep, DeviceKvCache,
    GpuContext, KvWritePlan, PrefillArgs, PrefillPlan,
};
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::KvCacheManager;
use lserve::reference::prefill::PrefillInput;
use lserve::reference::{self, TokenPattern};
use lserve::LserveError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A small ragged prefill batch: two sequences (60 and 90 tokens), one dense and one streaming
/// KV head, two query heads each.
const CU_SEQLENS: [usize; 3] = [0, 60, 150];
const TOKENS: usize = 150;
const Q_HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const KINDS: [HeadKind; 2] = [HeadKind::Dense, HeadKind::Streaming];
const SINK: usize = 8;
const LOCAL: usize = 40;

fn args() -> PrefillArgs<'static> {
    PrefillArgs {
        q_heads: Q_HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        cu_seqlens: &CU_SEQLENS,
        kinds: &KINDS,
        sink_tokens: SINK,
        local_tokens: LOCAL,
        block_masks: None,
        softmax_scale: None,
        prefix_lens: None,
        with_lse: false,
    }
}

/// The batch's q, k, v (bf16) and the f64 reference output.
struct Batch {
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    want: Vec<f64>,
}

fn batch() -> Batch {
    let mut rng = StdRng::seed_from_u64(7);
    let mut draw = |n: usize| -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(rng.gen_range(-1.0f32..1.0)))
            .collect()
    };
    let q = draw(TOKENS * Q_HEADS * HEAD_DIM);
    let k = draw(TOKENS * KV_HEADS * HEAD_DIM);
    let v = draw(TOKENS * KV_HEADS * HEAD_DIM);
    let f32s = |xs: &[bf16]| xs.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let patterns = [
        TokenPattern::Causal,
        TokenPattern::Lambda {
            sink_tokens: SINK,
            local_tokens: LOCAL,
        },
    ];
    let want = reference::prefill::prefill_attention(&PrefillInput {
        cu_seqlens: &CU_SEQLENS,
        q: &f32s(&q),
        k: &f32s(&k),
        v: &f32s(&v),
        q_heads: Q_HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        patterns: &patterns,
        block_mask: None,
        scale: 1.0 / (HEAD_DIM as f64).sqrt(),
    })
    .unwrap()
    .out;
    Batch { q, k, v, want }
}

/// Fails unless every element is finite and the relative error against `want` is within the
/// bf16 tolerance.
fn check(what: &str, got: &[bf16], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: output length");
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32() as f64;
        assert!(g.is_finite(), "{what}: element {i} not written ({g})");
        diff += (g - w) * (g - w);
        norm += w * w;
    }
    let err = (diff / norm).sqrt();
    assert!(
        err < tolerance::<bf16>(),
        "{what}: relative error {err} against the reference"
    );
}

/// An engine's context (cudarc's defaults: event tracking on) and one stream of it.
fn engine() -> (Arc<CudaContext>, Arc<CudaStream>) {
    assert!(
        driver_present(),
        "GPU test run without a CUDA driver: these tests must run on a GPU machine"
    );
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    (ctx, stream)
}

/// `n` NaNs on `stream`: an element no kernel writes stays non-finite.
fn poisoned(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<bf16> {
    stream.clone_htod(&vec![bf16::NAN; n]).unwrap()
}

#[test]
fn a_missing_driver_is_an_error_not_a_panic() {
    // Where cudarc loads the driver at run time (this workspace's choice), lserve's check sees
    // the same library cudarc would load.
    // SAFETY: `is_culib_present` only tries to open the driver library by its usual names.
    let cudarc_finds = unsafe { lserve::cudarc::driver::sys::is_culib_present() };
    assert_eq!(driver_present(), cudarc_finds);
    match GpuContext::new(0) {
        Err(LserveError::NoCudaDriver) => assert!(!driver_present()),
        // With a driver: a context, or the driver's own error (no device 0, say).
        _ => assert!(driver_present()),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn lserves_own_context_has_event_tracking_off() {
    let gpu = common::gpu();
    assert!(!gpu.context().is_event_tracking());
    assert!(!gpu.context().is_managing_stream_synchronization());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn launches_go_to_the_engines_stream_and_honour_its_event_tracking() {
    let (ctx, stream) = engine();
    let gpu = GpuContext::from_stream(stream.clone()).unwrap();
    assert!(Arc::ptr_eq(gpu.stream(), &stream));
    assert!(Arc::ptr_eq(gpu.context(), &ctx));
    // lserve left the engine's setting alone: cudarc orders buffers across its streams.
    assert!(ctx.is_event_tracking());
    assert!(ctx.is_managing_stream_synchronization());

    let x = batch();
    let q = stream.clone_htod(&x.q).unwrap();
    let k = stream.clone_htod(&x.k).unwrap();
    let v = stream.clone_htod(&x.v).unwrap();
    let mut out = poisoned(&stream, x.q.len());
    prefill_attention(&gpu, &args(), &q, &k, &v, &mut out).unwrap();

    // Another engine stream reads the output with no synchronization by hand: cudarc makes it
    // wait for the output's write event, recorded after lserve's launch on the engine's stream.
    let reader = ctx.new_stream().unwrap();
    let got = reader.clone_dtoh(&out).unwrap();
    reader.synchronize().unwrap();
    check("read on another stream", &got, &x.want);
}

/// One decode step (two layers, a 10000-token context of pseudo-random K/V: past
/// `dynamic_min_len`, so the selector runs) on `gpu`, its output read on `reader` (`gpu`'s stream
/// if `None`) with no synchronization by hand before the read.
fn decode_step_output(gpu: &GpuContext, reader: Option<&Arc<CudaStream>>) -> Vec<bf16> {
    let g = ModelGeometry::new(2, 8, 2, 128).unwrap();
    let pattern = HeadPattern::interleaved(g, 0.5).unwrap();
    let mut mgr =
        KvCacheManager::new(g, pattern, SparsityConfig::default(), 4096, 1, 1 << 16).unwrap();
    let seq = mgr.add_sequence().unwrap();
    let prompt = mgr.reserve(seq, 10_000).unwrap();
    let mut cache = DeviceKvCache::<bf16>::new(gpu, &mgr).unwrap();
    cache.fill_random(gpu, 11).unwrap();
    let plan = KvWritePlan::new(&mgr, &[(seq, prompt)])
        .unwrap()
        .upload(gpu, &mgr, &mut cache)
        .unwrap();
    for layer in 0..g.layers() {
        pool_key_stats(gpu, &mut cache, layer, &plan).unwrap();
    }
    let mut step = DecodeStep::new(gpu, &cache, 1).unwrap();
    let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    let s = gpu.stream();
    let (mut q, mut k, mut v) = (
        s.alloc_zeros::<bf16>(hq * d).unwrap(),
        s.alloc_zeros::<bf16>(hkv * d).unwrap(),
        s.alloc_zeros::<bf16>(hkv * d).unwrap(),
    );
    fill_random(gpu, &mut q, 21).unwrap();
    fill_random(gpu, &mut k, 22).unwrap();
    fill_random(gpu, &mut v, 23).unwrap();
    let mut out = poisoned(s, hq * d);
    let mut planned = step.plan(gpu, &mut mgr, &mut cache, &[seq]).unwrap();
    for layer in 0..g.layers() {
        planned
            .layer(gpu, &mut cache, layer, &q, &k, &v, &mut out)
            .unwrap();
    }
    planned.finish(gpu, &mut cache).unwrap();
    let reader = reader.unwrap_or(s);
    let got = reader.clone_dtoh(&out).unwrap();
    reader.synchronize().unwrap();
    got
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_decode_step_on_the_engines_stream_is_read_on_another_stream() {
    // The decode step's kernels are launched overlapped (lserve's own launch path, not cudarc's
    // builder): with tracking on, each written buffer's event must be recorded after its kernel,
    // or the reader could copy `out` before the split combine has written it.
    let want = decode_step_output(&common::gpu(), None);
    let (ctx, stream) = engine();
    let gpu = GpuContext::from_stream(stream).unwrap();
    let reader = ctx.new_stream().unwrap();
    let got = decode_step_output(&gpu, Some(&reader));
    assert!(ctx.is_managing_stream_synchronization());
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        let (g, w) = (g.to_f32() as f64, w.to_f32() as f64);
        assert!(g.is_finite() && w.is_finite(), "element {i}: {g} / {w}");
        diff += (g - w) * (g - w);
        norm += w * w;
    }
    let err = (diff / norm).sqrt();
    assert!(
        err < 1e-3,
        "engine stream vs lserve's own context: relative error {err}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_capture_on_the_engines_stream_holds_lserves_launch() {
    let (ctx, stream) = engine();
    let gpu = GpuContext::from_stream(stream.clone()).unwrap();
    let x = batch();
    let q = stream.clone_htod(&x.q).unwrap();
    let k = stream.clone_htod(&x.k).unwrap();
    let v = stream.clone_htod(&x.v).unwrap();
    let mut out = poisoned(&stream, x.q.len());
    // Allocations before the capture (the plan uploads its schedule), and one eager launch, so
    // the kernel is loaded and allowed its shared memory before the capture.
    let plan = PrefillPlan::new(&gpu, &args()).unwrap();
    let mut warm = poisoned(&stream, x.q.len());
    plan.run(&gpu, &q, &k, &v, &mut warm).unwrap();

    // The recipe of `GpuContext`'s docs: tracking off for the capture, back on after it.
    stream.synchronize().unwrap();
    // SAFETY: every buffer above was used on `stream` alone, and it was synchronized.
    unsafe { ctx.disable_event_tracking() };
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let captured = plan.run(&gpu, &q, &k, &v, &mut out);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    // SAFETY: as above; the buffers keep the events they were made with.
    unsafe { ctx.enable_event_tracking() };
    captured.unwrap();
    let graph = graph.unwrap().expect("the capture was not invalidated");

    // Captured, not run: had the launch gone to another stream it would have run (and written
    // `out`) already.
    stream.synchronize().unwrap();
    let before = stream.clone_dtoh(&out).unwrap();
    assert!(
        before.iter().all(|o| o.is_nan()),
        "the launch ran during the capture: it did not go to the engine's stream"
    );

    graph.launch().unwrap();
    stream.synchronize().unwrap();
    let got = stream.clone_dtoh(&out).unwrap();
    check("replayed graph", &got, &x.want);
}
