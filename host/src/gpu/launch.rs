//! Passing `lserve-abi` parameter structs to kernels by value.

use cudarc::driver::DeviceRepr;

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
