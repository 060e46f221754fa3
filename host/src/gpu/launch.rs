//! Kernel launches: `lserve-abi` parameter structs passed by value, and launches that overlap
//! the previous kernel's end ([`OverlappedLaunch`]).

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::{
    sys, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, SyncOnDrop,
};

use super::cache::DeviceElement;
use super::GpuContext;
use crate::dtype::DType;
use crate::geometry::ModelGeometry;
use crate::{LserveError, Result};

/// The kernel of element type `E` among a (bf16, f16) pair of entry points.
pub(crate) fn kernel_of<E: DeviceElement>(bf16: &'static str, f16: &'static str) -> &'static str {
    match E::DTYPE {
        DType::BF16 => bf16,
        DType::F16 => f16,
    }
}

/// Checks that the decode attention and the page scorer serve head dimension `head_dim` and
/// GQA group `group`: the shapes a [`ModelGeometry`] accepts (head dimensions
/// [`ModelGeometry::SUPPORTED_HEAD_DIMS`], groups 1 to [`ModelGeometry::MAX_GROUP`]). Only
/// arguments that did not come from a geometry can fail it.
pub(crate) fn check_shape(head_dim: usize, group: usize) -> Result<()> {
    if !ModelGeometry::SUPPORTED_HEAD_DIMS.contains(&head_dim) {
        return Err(LserveError::InvalidArgument {
            what: "head_dim",
            reason: format!(
                "{head_dim}: the GPU kernels support {:?}",
                ModelGeometry::SUPPORTED_HEAD_DIMS
            ),
        });
    }
    if !(1..=ModelGeometry::MAX_GROUP).contains(&group) {
        return Err(LserveError::InvalidArgument {
            what: "group",
            reason: format!(
                "{group}: the GPU kernels support GQA groups 1 to {}",
                ModelGeometry::MAX_GROUP
            ),
        });
    }
    Ok(())
}

/// Whether every embedded PTX module defines the kernel entry point `name` (the tests check every
/// name the launchers can ask for).
#[cfg(test)]
pub(crate) fn ptx_has_kernel(name: &str) -> bool {
    static NAMES: std::sync::OnceLock<Vec<Vec<String>>> = std::sync::OnceLock::new();
    let names = NAMES.get_or_init(|| super::KERNEL_PTX.iter().map(|m| m.kernel_names()).collect());
    names.iter().all(|module| module.iter().any(|n| n == name))
}

/// A launch-parameter struct from `lserve-abi`, passed to a kernel by value.
///
/// cudarc copies a kernel argument's bytes into the launch's parameter buffer; the kernels take
/// these structs as `.param .align 4 .b8 [size]` in C layout (`#[repr(C)]` on both sides, the
/// same definition compiled for host and device), so the bytes line up.
#[repr(transparent)]
pub(crate) struct ByValue<T>(pub T);

/// The parameter structs that may cross the launch by value: `#[repr(C)]`, `Copy`, no pointers
/// the kernel would dereference without the launcher's checks, no padding the kernel reads.
pub(crate) trait LaunchParams: Copy {}

impl LaunchParams for lserve_abi::decode::DecodeParams {}
impl LaunchParams for lserve_abi::decode::CombineParams {}

// SAFETY: `ByValue<T>` is `repr(transparent)` over a `#[repr(C)]` plain-data struct shared with
// the kernel crate (see `LaunchParams`); its bytes are exactly what the kernel reads.
unsafe impl<T: LaunchParams> DeviceRepr for ByValue<T> {}

/// A kernel launch that may overlap the end of the previous kernel on the stream (Hopper's
/// *programmatic dependent launch*): the launch carries
/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, so the driver may start its blocks
/// once every block of the previous kernel has signalled (`griddepcontrol.launch_dependents`) or
/// exited, instead of after that kernel's completion. The kernel's blocks then wait
/// (`griddepcontrol.wait`, `sync::overlapped_entry` in the kernel crate) until the previous
/// kernel has completed and its writes are visible before they touch memory that a kernel may
/// write (some first read what only host copies write: batch lengths and slots, head map, block
/// tables); what overlaps is the launch itself (block scheduling, parameter loads) and those
/// reads, which is most of a small kernel's cost.
/// The decode step's kernels are launched this way; the ordering is the stream's, as before.
///
/// The builder mirrors cudarc's `LaunchArgs`: arguments in kernel-signature order, then
/// [`launch`](Self::launch), which consumes it. Buffers take part in cudarc's event tracking as
/// with `LaunchArgs` (where the context manages stream synchronization, see `GpuContext`):
/// adding one makes the stream wait for the buffer's last write (and, for a written buffer, its
/// last read), and the buffer's read or write event is recorded after the launch is enqueued.
pub(crate) struct OverlappedLaunch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    args: Vec<Arg<'a>>,
    /// Whether the loaded module's kernels wait for the previous kernel themselves (the sm_90
    /// build's `griddepcontrol.wait`): only then may the launch overlap it.
    overlap: bool,
    /// cudarc's guards of the buffer arguments: dropping one records the buffer's read or write
    /// event on the stream (when the context tracks events), so they are dropped only after
    /// the launch is enqueued.
    guards: Vec<SyncOnDrop<'a>>,
}

/// One kernel argument: a device pointer (held here, so the parameter array can point at it) or
/// a borrowed value.
enum Arg<'a> {
    Pointer(sys::CUdeviceptr),
    Value(*const c_void, PhantomData<&'a ()>),
}

impl<'a> OverlappedLaunch<'a> {
    /// A launch of `func` on `gpu`'s stream, overlapped with the previous kernel where `gpu`'s
    /// module supports it ([`KernelPtx::is_hopper`](super::KernelPtx::is_hopper)); a plain
    /// launch otherwise.
    pub(crate) fn new(gpu: &'a GpuContext, func: &'a CudaFunction) -> Self {
        Self {
            stream: gpu.stream(),
            func,
            args: Vec::with_capacity(16),
            overlap: gpu.ptx().is_hopper(),
            guards: Vec::with_capacity(16),
        }
    }

    /// Appends a buffer argument (the kernel reads or writes through it).
    pub(crate) fn buf<T>(&mut self, slice: &'a impl DevicePtr<T>) -> &mut Self {
        // With tracking, this enqueues the wait for the buffer's last write; its guard records
        // the read after the launch.
        let (ptr, guard) = slice.device_ptr(self.stream);
        self.args.push(Arg::Pointer(ptr));
        self.guards.push(guard);
        self
    }

    /// Appends a buffer argument the kernel writes through.
    pub(crate) fn buf_mut<T>(&mut self, slice: &'a mut impl DevicePtrMut<T>) -> &mut Self {
        // With tracking, this enqueues the wait for the buffer's last read and write; its guard
        // records the write after the launch.
        let (ptr, guard) = slice.device_ptr_mut(self.stream);
        self.args.push(Arg::Pointer(ptr));
        self.guards.push(guard);
        self
    }

    /// Appends a by-value argument (a parameter struct or a scalar).
    pub(crate) fn value<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args
            .push(Arg::Value(value as *const T as *const c_void, PhantomData));
        self
    }

    /// Enqueues the launch, then records the buffers' events (see the type's docs).
    ///
    /// # Safety
    /// As cudarc's `LaunchArgs::launch`: the arguments match the kernel's signature in order and
    /// type, and the grid and the buffers satisfy the kernel's contract. The kernel waits for
    /// the previous kernel on the stream (`grid_dependency_wait`) before its first memory access
    /// that could depend on it.
    pub(crate) unsafe fn launch(self, cfg: LaunchConfig) -> Result<()> {
        // Pointers into `self.args` (not moved or resized from here to the call, which copies
        // the parameters).
        let mut params: Vec<*mut c_void> = self
            .args
            .iter()
            .map(|a| match a {
                Arg::Pointer(p) => p as *const sys::CUdeviceptr as *mut c_void,
                Arg::Value(v, _) => *v as *mut c_void,
            })
            .collect();
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { pad: [0; 64] },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.overlap),
        };
        self.stream.context().bind_to_thread()?;
        // SAFETY: `config` and `attr` live across the call; `params` holds one pointer per kernel
        // parameter, each to memory alive for the call (the caller's values, this builder's
        // pointers); the caller guarantees the signature and the kernel's contract.
        let launched = unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        };
        // After the enqueue: each buffer's event marks the end of this kernel.
        drop(self.guards);
        launched?;
        Ok(())
    }
}
