//! Device context: one CUDA context and stream plus the kernel module loaded from the embedded PTX.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use crate::Result;

/// The kernels' PTX, compiled from `kernels-gpu/` by `build.rs` and embedded in the library.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/lserve_kernels.ptx"));

/// The `-C target-cpu` the embedded PTX was built for (`sm_90` unless `LSERVE_CUDA_ARCH` said otherwise).
pub const PTX_ARCH: &str = env!("LSERVE_CUDA_ARCH");

/// A CUDA device with lserve's kernels loaded.
///
/// ```no_run
/// let gpu = lserve::gpu::GpuContext::new(0)?;
/// println!("running on {}", gpu.device_name()?);
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct GpuContext {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
}

impl GpuContext {
    /// Opens device `ordinal` (loading `libcuda` at run time) and loads the embedded kernels.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.default_stream();
        let module = ctx.load_module(Ptx::from_src(PTX))?;
        Ok(Self { ctx, stream, module })
    }

    /// The device's name, as the driver reports it.
    pub fn device_name(&self) -> Result<String> {
        Ok(self.ctx.name()?)
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch of this context goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A kernel of the embedded module by its symbol name.
    pub(crate) fn function(&self, name: &str) -> Result<CudaFunction> {
        Ok(self.module.load_function(name)?)
    }
}
