//! Device context: one CUDA context and stream plus the kernel module loaded from the embedded PTX
//! that suits the device ([`module_for`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use super::ptx::{module_for, KernelPtx, PTX_ARCH_VAR};
use crate::{LserveError, Result};

/// Dynamic shared memory a kernel may use without opting in.
const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;

/// A CUDA device with lserve's kernels loaded.
///
/// Everything lserve enqueues goes to one stream ([`stream`](Self::stream)), in order; cudarc's
/// cross-stream event tracking is off for this context (so a decode step can be captured in a
/// CUDA graph). Using lserve's buffers on another stream needs explicit synchronization with it.
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
    /// The PTX `module` was loaded from.
    ptx: &'static KernelPtx,
    /// The test kernels' module, loaded on first use.
    #[cfg(feature = "test-kernels")]
    test_module: std::sync::OnceLock<Arc<CudaModule>>,
    sm_count: u32,
    /// Kernels looked up so far: a decode step launches the same few every layer.
    functions: Mutex<HashMap<String, LoadedKernel>>,
}

/// A kernel looked up once, and the dynamic shared memory it has been allowed so far.
struct LoadedKernel {
    function: CudaFunction,
    /// Bytes of dynamic shared memory a launch may use (the default, or what was opted in).
    smem_allowed: u32,
}

impl GpuContext {
    /// Opens device `ordinal` (loading `libcuda` at run time) and loads the embedded kernels: the
    /// newest PTX module the device runs, or the one the environment variable `LSERVE_PTX_ARCH`
    /// names (`sm_80` on a Hopper GPU tests that module there).
    ///
    /// On a machine without an NVIDIA driver this is [`LserveError::NoCudaDriver`], not a panic;
    /// on a GPU older than sm_80, [`LserveError::UnsupportedDevice`].
    pub fn new(ordinal: usize) -> Result<Self> {
        if !driver_present() {
            return Err(LserveError::NoCudaDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: every launch and copy lserve makes goes to this context's one stream, in
        // order, so cudarc's cross-stream event tracking has nothing to order; without it the
        // decode step records no events and can be captured in a CUDA graph. A caller who uses
        // lserve's buffers on another stream synchronizes with `stream()` itself (documented on
        // `GpuContext`).
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own, not the legacy default stream: only those can be captured.
        let stream = ctx.new_stream()?;
        let capability = ctx.compute_capability()?;
        let requested = std::env::var(PTX_ARCH_VAR).ok();
        let ptx = module_for(
            (capability.0 as u32, capability.1 as u32),
            requested.as_deref(),
        )?;
        let module = ctx.load_module(Ptx::from_src(ptx.text()))?;
        let sm_count = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        Ok(Self {
            ctx,
            stream,
            module,
            ptx,
            #[cfg(feature = "test-kernels")]
            test_module: std::sync::OnceLock::new(),
            sm_count,
            functions: Mutex::new(HashMap::new()),
        })
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

    /// Streaming multiprocessors on the device.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The PTX module this context loaded ([`module_for`]).
    ///
    /// ```no_run
    /// let gpu = lserve::gpu::GpuContext::new(0)?;
    /// println!("kernels built for {}", gpu.ptx().arch);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn ptx(&self) -> &'static KernelPtx {
        self.ptx
    }

    /// The names of the kernels this context loaded, in PTX order.
    pub fn kernel_names(&self) -> Vec<String> {
        self.ptx.kernel_names()
    }

    /// What the driver compiled kernel `name` into on this GPU (the PTX is compiled when the
    /// module loads, by the driver's own `ptxas`): registers and local memory per thread. Local
    /// memory is spill slots and stack; every kernel lserve ships has none, which
    /// `cargo xtask ptx` checks with the toolkit's `ptxas` and a GPU test checks here.
    ///
    /// ```no_run
    /// let gpu = lserve::gpu::GpuContext::new(0)?;
    /// let r = gpu.kernel_resources("prefill_attention_bf16_d128")?;
    /// assert_eq!(r.local_bytes, 0);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn kernel_resources(&self, name: &str) -> Result<KernelResources> {
        let f = self.function(name)?;
        Ok(KernelResources {
            registers: f.get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)? as u32,
            local_bytes: f
                .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?
                as u32,
        })
    }

    /// A kernel of the test-kernel module (loaded on first use) by its symbol name.
    #[cfg(feature = "test-kernels")]
    pub(crate) fn test_function(&self, name: &str) -> Result<CudaFunction> {
        let module = match self.test_module.get() {
            Some(m) => m.clone(),
            None => {
                let m = self
                    .ctx
                    .load_module(Ptx::from_src(super::ptx::test_ptx()))?;
                self.test_module.get_or_init(|| m).clone()
            }
        };
        Ok(module.load_function(name)?)
    }

    /// A kernel of the embedded module by its symbol name.
    pub(crate) fn function(&self, name: &str) -> Result<CudaFunction> {
        self.function_with_smem(name, 0)
    }

    /// The kernel `name`, allowed `smem_bytes` of dynamic shared memory per launch. Above the
    /// default 48 KB a kernel must opt in; the driver keeps the setting with the function, so it
    /// is made once per kernel (and again only if a launch asks for more).
    pub(crate) fn function_with_smem(&self, name: &str, smem_bytes: u32) -> Result<CudaFunction> {
        // A poisoned lock only means another thread panicked mid-insert: the map is still valid.
        let mut functions = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        let kernel = match functions.get_mut(name) {
            Some(kernel) => kernel,
            None => {
                let function = self.module.load_function(name)?;
                let loaded = LoadedKernel {
                    function,
                    smem_allowed: DEFAULT_SMEM_LIMIT,
                };
                functions.entry(name.to_string()).or_insert(loaded)
            }
        };
        if smem_bytes > kernel.smem_allowed {
            kernel.function.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_bytes as i32,
            )?;
            kernel.smem_allowed = smem_bytes;
        }
        Ok(kernel.function.clone())
    }
}

/// Per-thread resources of a kernel as the driver compiled it ([`GpuContext::kernel_resources`]).
///
/// ```no_run
/// let gpu = lserve::gpu::GpuContext::new(0)?;
/// for name in gpu.kernel_names() {
///     let r: lserve::gpu::KernelResources = gpu.kernel_resources(&name)?;
///     println!("{name}: {} registers, {} local bytes", r.registers, r.local_bytes);
/// }
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of local memory per thread (spills and stack).
    pub local_bytes: u32,
}

/// Whether `libcuda` can be loaded. cudarc panics on first use when it cannot, so every entry
/// point checks this first.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library by its usual names and
    // drops the handle; loading libcuda runs no user-visible initialisation.
    unsafe { cudarc::driver::sys::is_culib_present() }
}
