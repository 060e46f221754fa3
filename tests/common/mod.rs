//! Helpers shared by the GPU test files (`mod common;` in each).

use lserve::gpu::GpuContext;

/// The GPU these tests run on. They are `#[ignore]`d, so this only runs when asked for
/// (`--ignored`/`--include-ignored`): then a machine without a usable GPU is a failure, never a
/// silent pass.
pub fn gpu() -> GpuContext {
    GpuContext::new(0).unwrap_or_else(|e| {
        panic!(
            "GPU test run without a usable CUDA GPU ({e}): these tests must run on a GPU machine"
        )
    })
}
