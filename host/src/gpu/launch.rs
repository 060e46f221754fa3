//! Kernel launches ([`Launch`]): a kernel's buffers registered with the stream, then its one
//! `lserve-abi` argument struct passed by value, optionally overlapping the previous kernel's end.

use std::ffi::c_void;

use cudarc::driver::{
    sys, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop,
};
use lserve_abi::ptr::{GlobalPtr, GlobalPtrMut};

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

/// A kernel's argument struct from `lserve-abi`: every production kernel takes exactly one,
/// by value (`.param .align 8 .b8 [size]`, C layout on both sides from the one definition).
///
/// Implemented for the argument structs only: `#[repr(C)]`, `Copy`, scalars and
/// [`GlobalPtr`]/[`GlobalPtrMut`] device addresses, no padding the kernel reads.
pub(crate) trait KernelArgs: Copy + sealed::Sealed {}

mod sealed {
    pub trait Sealed {}
}

macro_rules! kernel_args {
    ($($t:path),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl KernelArgs for $t {}
    )*};
}

kernel_args!(
    lserve_abi::decode::DecodeArgs,
    lserve_abi::decode::CodedDecodeArgs,
    lserve_abi::decode::CombineArgs,
    lserve_abi::kv_write::AppendArgs,
    lserve_abi::kv_write::CodedAppendArgs,
    lserve_abi::kv_write::WriteRowsArgs,
    lserve_abi::kv_write::CodedWriteRowsArgs,
    lserve_abi::kv_write::PoolRowsArgs,
    lserve_abi::kv_write::GatherArgs,
    lserve_abi::kv_write::CodedGatherArgs,
    lserve_abi::kv_write::PoolArgs,
    lserve_abi::kv_write::FillArgs,
    lserve_abi::select::ScoreArgs,
    lserve_abi::select::SelectArgs,
    lserve_abi::select::StepArgs,
    lserve_abi::prefill::PrefillArgs,
    lserve_abi::prefill::WgmmaPrefillArgs,
);

/// One kernel launch: its buffers are registered first ([`read`](Self::read),
/// [`write`](Self::write)), which gives their addresses for the kernel's argument struct; then
/// [`launch`](Self::launch) enqueues the kernel with that struct, the one parameter.
///
/// Buffers take part in cudarc's event tracking as with cudarc's `LaunchArgs` (where the
/// context manages stream synchronization, see `GpuContext`): registering one makes the stream
/// wait for the buffer's last write (and, for a written buffer, its last read), and the buffer's
/// read or write event is recorded after the launch is enqueued.
///
/// An [`overlapped`](Self::overlapped) launch may overlap the end of the previous kernel on the
/// stream (Hopper's *programmatic dependent launch*): it carries
/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, so the driver may start its blocks
/// once every block of the previous kernel has signalled (`griddepcontrol.launch_dependents`) or
/// exited, instead of after that kernel's completion. The kernel's blocks then wait
/// (`griddepcontrol.wait`, `sync::overlapped_entry` in the kernel crate) until the previous
/// kernel has completed and its writes are visible before they touch memory that a kernel may
/// write (some first read what only host copies write: batch lengths and slots, head map, block
/// tables); what overlaps is the launch itself (block scheduling, parameter loads) and those
/// reads, which is most of a small kernel's cost. The decode step's kernels are launched this
/// way; the ordering is the stream's, as before.
pub(crate) struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    /// Whether to overlap the previous kernel: only where the loaded module's kernels wait for it
    /// themselves (the sm_90 build's `griddepcontrol.wait`).
    overlap: bool,
    /// cudarc's guards of the registered buffers: dropping one records the buffer's read or
    /// write event on the stream (when the context tracks events), so they are dropped only
    /// after the launch is enqueued.
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Launch<'a> {
    /// A launch of `func` on `gpu`'s stream that waits for the previous kernel's completion.
    pub(crate) fn new(gpu: &'a GpuContext, func: &'a CudaFunction) -> Self {
        Self {
            stream: gpu.stream(),
            func,
            overlap: false,
            guards: Vec::with_capacity(24),
        }
    }

    /// A launch of `func` on `gpu`'s stream overlapped with the previous kernel where `gpu`'s
    /// module supports it ([`KernelPtx::is_hopper`](super::KernelPtx::is_hopper)); as
    /// [`new`](Self::new) otherwise. The kernel must wait (`overlapped_entry`) before touching
    /// what the kernel before may write.
    pub(crate) fn overlapped(gpu: &'a GpuContext, func: &'a CudaFunction) -> Self {
        Self {
            overlap: gpu.ptx().is_hopper(),
            ..Self::new(gpu, func)
        }
    }

    /// Registers a buffer the kernel reads; its address.
    pub(crate) fn read<T>(&mut self, buf: &'a impl DevicePtr<T>) -> GlobalPtr<T> {
        // With tracking, this enqueues the wait for the buffer's last write; its guard records
        // the read after the launch.
        let (ptr, guard) = buf.device_ptr(self.stream);
        self.guards.push(guard);
        GlobalPtr::from_addr(ptr)
    }

    /// Registers a buffer the kernel writes (and may read); its address.
    pub(crate) fn write<T>(&mut self, buf: &'a mut impl DevicePtrMut<T>) -> GlobalPtrMut<T> {
        // With tracking, this enqueues the wait for the buffer's last read and write; its guard
        // records the write after the launch.
        let (ptr, guard) = buf.device_ptr_mut(self.stream);
        self.guards.push(guard);
        GlobalPtrMut::from_addr(ptr)
    }

    /// Enqueues the launch with its one argument `args`, then records the buffers' events (see
    /// the type's docs).
    ///
    /// # Safety
    /// `args` is the argument struct of `func`'s kernel, its addresses are the registered
    /// buffers' (or never dereferenced by the kernel), and the grid and the buffers satisfy the
    /// kernel's contract. An overlapped kernel waits for the previous kernel on the stream
    /// (`overlapped_entry`) before its first memory access that could depend on it.
    pub(crate) unsafe fn launch<A: KernelArgs>(self, cfg: LaunchConfig, args: &A) -> Result<()> {
        let mut params = [args as *const A as *mut c_void];
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
        // SAFETY: `config` and `attr` live across the call; `params` holds the kernel's one
        // parameter, a pointer to `args` (alive for the call, which copies it); the caller
        // guarantees it is the kernel's argument struct and the kernel's contract.
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
