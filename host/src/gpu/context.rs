//! Device context: a CUDA context and the stream lserve enqueues on (its own, or an engine's),
//! plus the kernel module loaded from the embedded PTX that suits the device ([`module_for`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use super::ptx::{module_for, KernelPtx, PTX_ARCH_VAR};
use crate::{LserveError, Result};

/// Dynamic shared memory a kernel may use without opting in.
const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;

/// A CUDA device with lserve's kernels loaded, and the one stream lserve enqueues on.
///
/// Everything lserve enqueues (launches, copies, allocations) goes to [`stream`](Self::stream),
/// in order. Two ways to get one:
///
/// - [`GpuContext::new`]: lserve's own context and stream, with cudarc's cross-stream event
///   tracking off (every use of lserve's buffers is ordered by that one stream).
/// - [`GpuContext::from_stream`]: on an engine's stream (candle's `CudaDevice::cuda_stream()`,
///   or any cudarc [`CudaStream`]); lserve's launches and copies then interleave with the
///   engine's own work on that stream, in order, and lserve leaves the engine's context as it
///   is.
///
/// # Event tracking
///
/// cudarc orders buffers across streams by itself when the context *manages stream synchronization*
/// ([`CudaContext::is_managing_stream_synchronization`]: event tracking on, the default, and a
/// stream made with `new_stream` or `fork`, not only the default or per-thread stream; candle's
/// `Device::new_cuda_with_stream` makes one, `Device::new_cuda` not). Then each buffer allocated
/// while tracking was on carries a read and a write event: a use of it makes the stream wait for
/// the buffer's last write (and, for a write, its last read), and records the buffer's read or
/// write event after the use. lserve honours this for every buffer it reads or writes, the engine's
/// and its own: cudarc's launch builder and copies do it, and lserve's own launch path keeps
/// cudarc's guards until the kernel is enqueued, so an event marks the end of the kernel that used
/// the buffer. An engine may then read lserve's outputs on another of its streams without
/// synchronizing by hand. lserve never turns tracking off on a context it did not create. The price
/// is a wait and a record per tracked buffer per launch (the decode attention takes about twenty
/// buffers), enqueued between the kernels; a decode loop on one stream needs none of it.
///
/// # Capturing a decode step in a CUDA graph
///
/// A decode step ([`DecodeStep`](super::DecodeStep), or its calls one by one) allocates nothing
/// and never synchronizes, so it can be captured on the context's stream
/// ([`CudaStream::begin_capture`] .. [`CudaStream::end_capture`]) and replayed. What the engine
/// must arrange:
///
/// - Capture on a stream made with `new_stream` (or another stream that may be captured), not the
///   legacy default stream (`CudaContext::default_stream`).
/// - No event tracking in the capture. While the context manages stream synchronization,
///   cudarc's waits and records happen inside the capture: a capturing stream may not wait on an
///   event recorded outside the capture (cudarc passes no external-wait flag), nor on one
///   recorded in another capture, and an event recorded in a capture becomes a captured event
///   that later waits and queries outside it reject (`CUDA_ERROR_CAPTURED_EVENT`). CUDA then
///   invalidates the capture or fails the call. So either the context has tracking off
///   (`CudaContext::disable_event_tracking`, as [`GpuContext::new`] does; candle's
///   `CudaDevice::disable_event_tracking`), or it turns it off for the capture: synchronize
///   the streams that used the step's buffers, `disable_event_tracking`, capture,
///   `enable_event_tracking` (cudarc checks the setting at each use, so the buffers'
///   existing events are left alone). A replay records no events: order the graph's launches
///   with work on other streams by hand (an event recorded after the replay, a wait on it).
/// - The buffers the capture uses, allocated before it (the cache, the workspaces, the
///   [`DecodeBatch`](super::DecodeBatch)), outlive every replay.
///
/// ```no_run
/// use std::sync::Arc;
/// use lserve::cudarc::driver::CudaContext;
/// use lserve::gpu::GpuContext;
///
/// // lserve's own context and stream:
/// let gpu = GpuContext::new(0)?;
/// println!("running on {}", gpu.device_name()?);
///
/// // On an engine's stream (here a plain cudarc one; with candle: `device.cuda_stream()`):
/// let ctx = CudaContext::new(0)?;
/// let stream = ctx.new_stream()?;
/// let gpu = GpuContext::from_stream(stream.clone())?;
/// assert!(Arc::ptr_eq(gpu.stream(), &stream));
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
    /// Opens device `ordinal` (loading `libcuda` at run time where cudarc loads it dynamically)
    /// with a context and stream of lserve's own, and loads the embedded kernels (as
    /// [`from_stream`](Self::from_stream)). Event tracking is off on this context (see
    /// [`GpuContext`]): lserve's stream orders every use of its buffers, and a decode step
    /// captures as it is.
    ///
    /// On a machine without an NVIDIA driver this is [`LserveError::NoCudaDriver`], not a panic;
    /// on a GPU older than sm_80, [`LserveError::UnsupportedDevice`].
    ///
    /// ```no_run
    /// let gpu = lserve::gpu::GpuContext::new(0)?;
    /// assert!(!gpu.context().is_event_tracking());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn new(ordinal: usize) -> Result<Self> {
        if !driver_present() {
            return Err(LserveError::NoCudaDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: this context is lserve's own, and every launch and copy lserve makes goes to
        // its one stream, in order, so cudarc's cross-stream event tracking has nothing to order;
        // without it the decode step records no events and can be captured in a CUDA graph. A
        // caller who uses lserve's buffers on another stream synchronizes with `stream()` itself
        // (documented on `GpuContext`).
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own, not the legacy default stream: only those can be captured.
        let stream = ctx.new_stream()?;
        let requested = std::env::var(PTX_ARCH_VAR).ok();
        Self::with_stream(ctx, stream, requested.as_deref())
    }

    /// [`new`](Self::new) with the PTX module of architecture `arch` (`sm_80`, `sm_90` or
    /// `sm_90a`) instead of the newest the device runs (`LSERVE_PTX_ARCH` is not read): e.g. an
    /// sm_90 context on an H100 runs the `mma.sync` prefill where the default (sm_90a) runs the
    /// `wgmma` one, side by side in one process.
    ///
    /// Errors: as [`new`](Self::new); [`LserveError::UnsupportedDevice`] if the device does not
    /// run that module, `InvalidArgument` for an unknown `arch`.
    ///
    /// ```no_run
    /// let gpu = lserve::gpu::GpuContext::with_ptx_arch(0, "sm_90")?;
    /// assert_eq!(gpu.ptx().arch, "sm_90");
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn with_ptx_arch(ordinal: usize, arch: &str) -> Result<Self> {
        if !driver_present() {
            return Err(LserveError::NoCudaDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: as in `new`.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        Self::with_stream(ctx, stream, Some(arch))
    }

    /// lserve on an engine's stream: loads the embedded kernels into the stream's context (the
    /// newest PTX module the device runs, or the one the environment variable `LSERVE_PTX_ARCH`
    /// names: `sm_80` on a Hopper GPU tests that module there), and every launch and copy lserve
    /// makes goes to `stream`. The context is left as it is: its
    /// event tracking setting is the engine's, and lserve honours it (see [`GpuContext`]).
    ///
    /// With candle (`candle-core` with its `cuda` feature), `stream` is the device's
    /// `CudaDevice::cuda_stream()`, and a tensor's buffer is the `CudaSlice` of its
    /// `CudaStorage` (`as_cuda_slice::<bf16>()`).
    ///
    /// Errors: [`LserveError::UnsupportedDevice`] on a GPU older than sm_80 (or one that does not
    /// run the module `LSERVE_PTX_ARCH` names); a driver error loading the module or reading the
    /// device's attributes.
    ///
    /// ```no_run
    /// use lserve::cudarc::driver::CudaContext;
    /// use lserve::gpu::GpuContext;
    ///
    /// let ctx = CudaContext::new(0)?;
    /// let stream = ctx.new_stream()?;
    /// let gpu = GpuContext::from_stream(stream)?;
    /// // The engine's context keeps cudarc's default: event tracking on.
    /// assert!(gpu.context().is_event_tracking());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn from_stream(stream: Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context().clone();
        let requested = std::env::var(PTX_ARCH_VAR).ok();
        Self::with_stream(ctx, stream, requested.as_deref())
    }

    /// Loads the kernels into `ctx`, whose stream `stream` is: the module `requested` names, or
    /// the newest the device runs.
    fn with_stream(
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        requested: Option<&str>,
    ) -> Result<Self> {
        let capability = ctx.compute_capability()?;
        let ptx = module_for((capability.0 as u32, capability.1 as u32), requested)?;
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

    /// The stream every launch and copy of this context goes to (the engine's, for a context
    /// made by [`from_stream`](Self::from_stream)).
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

/// Whether the CUDA driver library (`libcuda`) can be loaded. Where cudarc loads the driver at
/// run time (its `dynamic-loading` mode) it panics on first use when the library is missing, so
/// [`GpuContext::new`] checks this first; where the binary links the driver (cudarc's
/// `dynamic-linking`, as candle builds it) the library is loaded already and this is `true`.
///
/// ```
/// // Either answer is fine; `GpuContext::new` turns `false` into `LserveError::NoCudaDriver`.
/// let present: bool = lserve::gpu::driver_present();
/// # let _ = present;
/// ```
pub fn driver_present() -> bool {
    DRIVER_LIBRARIES.iter().any(|name| {
        // SAFETY: opening the driver library runs only its own initialisers (no CUDA call is
        // made); the handle is dropped at once, which leaves a library loaded elsewhere loaded.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

/// The names the driver library is installed under (cudarc tries these among others).
#[cfg(windows)]
const DRIVER_LIBRARIES: &[&str] = &["nvcuda.dll"];
#[cfg(not(windows))]
const DRIVER_LIBRARIES: &[&str] = &["libcuda.so", "libcuda.so.1"];
