//! Types shared by the host crate (`lserve`) and the GPU kernels (`kernels-gpu`).
//!
//! Everything here compiles for both `x86_64` (host) and `nvptx64-nvidia-cuda` (kernels):
//! `#![no_std]`, no allocation, one `#[repr(C)]` argument struct per kernel (its scalars and
//! its device buffers as typed [`GlobalPtr`]s) whose layout is the contract between a host launch
//! and the kernel that reads it, and the index math of the paged
//! KV cache, so that the CPU reference and the kernels address memory with the same code.
#![no_std]

pub mod buffers;
pub mod decode;
pub mod kv_write;
pub mod layout;
pub mod prefill;
pub mod primitives;
pub mod ptr;
pub mod select;

pub use layout::{CacheLayout, PagedLayout, SelectionLayout, StreamingLayout, TokenStrides};
pub use ptr::{GlobalPtr, GlobalPtrMut};
