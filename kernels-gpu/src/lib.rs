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
//! - [`bulk_copy`]: bulk copies on the tensor memory accelerator, `mbarrier`s;
//! - `wgmma` (sm_90a only): warpgroup tensor-core products from shared-memory descriptors.
//!
//! [`tile`] is the layer the attention kernels (decode, prefill) share on top of those: one
//! shared-memory tile type, the `ldmatrix` fragment loaders, the online-softmax state and its
//! merge (`tile/DESIGN.md`).
//!
//! The kernels, each module with a `DESIGN.md` (how it works, its floor, the measurements behind
//! its constants):
//! - [`kv_write`]: the cache writes (prefill rows, decode append) and key-statistics pooling;
//! - [`prefill`]: block-sparse prefill attention;
//! - [`select`]: the page scorer, the top-K selector and the decode step counters;
//! - [`decode`]: paged sparse decode attention and its split combine.
//!
//! [`pool_page`] is the one check of a page id read from a device table before the pool is
//! addressed with it (an id past the pool is skipped).
//!
//! The crate builds one of two PTX modules: the kernels above (the default), or, with the
//! `test-kernels` feature, only [`primitive_tests`], one test kernel per primitive (driven by
//! `tests/gpu_primitives.rs`, loaded by tests alone). The selector's warp scan, ballot and vector
//! shared-memory loads are covered by `tests/gpu_select.rs` instead.
//!
//! Targets: sm_90a, sm_90 and sm_80 PTX are built from the same source. Hopper's instructions
//! (tensor-map bulk copies, `mbarrier` transaction counts, programmatic dependent launch) are
//! behind `cfg(target_feature = "sm_90")`; the sm_80 build uses `cp.async` tiles and plain
//! launches; Hopper's architecture-specific `wgmma` (and the prefill kernel built on it) is
//! behind `cfg(target_feature = "sm_90a")`.
#![no_std]
#![feature(
    abi_gpu_kernel,
    stdarch_nvptx,
    asm_experimental_arch,
    stmt_expr_attributes
)]
// Every kernel takes its one `#[repr(C)]` argument struct from `lserve-abi`, by value. rustc
// passes it as `.param .align A .b8 name[size]` in C layout (checked in the PTX), which is exactly
// the bytes the host's launch copies; the GPU tests exercise every such kernel.
#![allow(improper_gpu_kernel_arg)]

use core::arch::nvptx::trap;

#[cfg(target_feature = "sm_90")]
pub mod bulk_copy;
pub mod convert;
pub mod cp_async;
#[cfg(not(feature = "test-kernels"))]
pub mod decode;
pub mod global;
#[cfg(not(feature = "test-kernels"))]
pub mod kv_write;
pub mod ldmatrix;
pub mod math;
pub mod mma;
#[cfg(not(feature = "test-kernels"))]
pub mod pool_page;
#[cfg(not(feature = "test-kernels"))]
pub mod prefill;
#[cfg(feature = "test-kernels")]
pub mod primitive_tests;
#[cfg(not(feature = "test-kernels"))]
pub mod select;
pub mod smem;
pub mod sync;
pub mod thread;
#[cfg(not(feature = "test-kernels"))]
pub mod tile;
pub mod warp;
#[cfg(target_feature = "sm_90a")]
pub mod wgmma;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: `trap` aborts the kernel; there is nothing to unwind to on the device.
    unsafe { trap() }
}
