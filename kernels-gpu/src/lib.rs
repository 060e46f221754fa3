//! LServe's GPU kernels, written in Rust and compiled to PTX.
//!
//! Device primitives, the pieces every kernel is written in:
//! - [`thread`]: thread / block / warp / lane indices;
//! - [`smem`]: dynamic shared memory (generic pointers and 32-bit shared addresses);
//! - [`sync`]: barriers and overlapped-launch control;
//! - [`warp`]: shuffles and warp / quad reductions;
//! - [`convert`]: bf16 / f16 <-> f32 ([`convert::Bf16`], [`convert::F16`] markers);
//! - [`mma`]: `mma.sync` m16n8k16 fragments and products;
//! - [`ldmatrix`]: shared memory -> fragments;
//! - [`cp_async`]: asynchronous global -> shared copies, commit / wait groups;
//! - [`bulk_copy`]: bulk copies on the tensor memory accelerator, `mbarrier`s.
//!
//! The kernels, each module with a `NOTES.md` of its measurements:
//! - [`kv_write`]: the cache writes (prefill rows, decode append) and key-statistics pooling;
//! - [`prefill`]: block-sparse prefill attention;
//! - [`select`]: the page scorer, the top-K selector and the decode step counters;
//! - [`decode`]: paged sparse decode attention and its split combine.
//!
//! [`shapes`] lists the (element type, head dim, GQA group) shapes the grouped kernels serve.
//!
//! [`primitive_tests`] holds one test kernel per primitive (driven by `tests/gpu_primitives.rs`);
//! the selector's warp scan, ballot and vector shared-memory loads are covered by
//! `tests/gpu_select.rs` instead.
#![no_std]
#![feature(
    abi_gpu_kernel,
    stdarch_nvptx,
    asm_experimental_arch,
    stmt_expr_attributes
)]
// Kernels take their scalar launch parameters as `#[repr(C)]` structs from `lserve-abi`, by
// value. rustc passes them as `.param .align A .b8 name[size]` in C layout (checked in the PTX),
// which is exactly the bytes the host's launch copies; the GPU tests exercise every such kernel.
#![allow(improper_gpu_kernel_arg)]

use core::arch::nvptx::*;

pub mod bulk_copy;
pub mod convert;
pub mod cp_async;
pub mod decode;
pub mod kv_write;
pub mod ldmatrix;
pub mod math;
pub mod mma;
pub mod prefill;
pub mod primitive_tests;
pub mod select;
pub mod shapes;
pub mod smem;
pub mod sync;
pub mod thread;
pub mod warp;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: `trap` aborts the kernel; there is nothing to unwind to on the device.
    unsafe { trap() }
}

/// Writes `value` into `y[0..n]`.
///
/// # Safety
/// `y` points to `n` writable `f32` in device memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn fill_f32(n: u32, value: f32, y: *mut f32) {
    let i = unsafe { _block_idx_x() * _block_dim_x() + _thread_idx_x() } as u32;
    if i < n {
        unsafe { *y.add(i as usize) = value };
    }
}
