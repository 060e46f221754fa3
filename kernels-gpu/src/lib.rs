//! LServe's GPU kernels, written in Rust and compiled to PTX.
#![no_std]
#![feature(abi_gpu_kernel, stdarch_nvptx, asm_experimental_arch)]

use core::arch::nvptx::*;

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
