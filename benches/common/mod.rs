//! Timing shared by the GPU benchmarks.

use std::time::Duration;

use lserve::cudarc::driver::sys::CUevent_flags;
use lserve::gpu::GpuContext;

/// Runs `f` `iters` times back to back on the context's stream and returns the time between a
/// CUDA event recorded before and one recorded after (what criterion's `iter_custom` wants).
pub fn timed(gpu: &GpuContext, iters: u64, mut f: impl FnMut()) -> Duration {
    let stream = gpu.stream();
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags).expect("event");
    for _ in 0..iters {
        f();
    }
    let end = stream.record_event(flags).expect("event");
    let ms = start.elapsed_ms(&end).expect("elapsed");
    Duration::from_secs_f64(ms as f64 * 1e-3)
}

/// The environment variable that limits a run to some cases: see [`selected`].
pub const ONLY_VAR: &str = "LSERVE_BENCH_ONLY";

/// Whether the case `id` (criterion's id: `group/name/parameter`, e.g.
/// `attention/dense/b1/4096` or `prefill_cache/into_cache/16384`) is to be built and timed.
/// `LSERVE_BENCH_ONLY` unset or empty selects every case; otherwise it is a comma-separated list
/// of substrings and a case is selected when its id contains any of them. The benches check it
/// before allocating a case's cache or tensors (criterion's own filter only skips the timing).
pub fn selected(id: &str) -> bool {
    match std::env::var(ONLY_VAR) {
        Ok(only) if !only.trim().is_empty() => only
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .any(|s| id.contains(s)),
        _ => true,
    }
}

/// Prints the active `LSERVE_BENCH_ONLY` filter, if any (once, at the start of a bench).
pub fn announce_filter() {
    if let Ok(only) = std::env::var(ONLY_VAR) {
        if !only.trim().is_empty() {
            println!("{ONLY_VAR}={only}: building only the cases whose id contains one of these");
        }
    }
}

/// The GPU the `what` benchmarks run on, announced with the case filter; `None` (after saying
/// why, so a run without a usable GPU shows the benchmarks as skipped) if there is none.
pub fn gpu_or_skip(what: &str) -> Option<GpuContext> {
    match GpuContext::new(0) {
        Ok(gpu) => {
            println!("device: {}", gpu.device_name().unwrap_or_default());
            announce_filter();
            Some(gpu)
        }
        Err(e) => {
            println!("{what} benchmarks skipped: no usable GPU ({e})");
            None
        }
    }
}
