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
