//! Types shared by the host crate (`lserve`) and the GPU kernels (`kernels-gpu`).
//!
//! Everything here compiles for both `x86_64` (host) and `nvptx64-nvidia-cuda` (kernels):
//! `#![no_std]`, no allocation, `#[repr(C)]` launch-parameter structs whose layout is the
//! contract between a host launch and the kernel that reads it.
#![no_std]

pub mod primitives;
