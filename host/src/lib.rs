//! # lserve
//!
//! LServe's unified sparse attention for long-context LLM serving: streaming heads (Λ mask),
//! query-aware page selection over a hierarchical paged KV cache, reusable selection, on GPU
//! kernels written in Rust, with a typed host API and a CPU reference of every operation.
//!
//! The modules:
//! - [`geometry`], [`head_pattern`], [`config`], [`dtype`]: what the model looks like, which heads
//!   are streaming, the sparsity configuration (LServe's defaults, validated), element types.
//! - [`paging`]: the two-way paged KV cache: page pool, block tables, streaming sink+ring store,
//!   sequence lifecycle; [`index_table`] and [`block_iter`]: what each kernel visits.
//! - [`quant`]: the quantized KV formats (INT8/INT4 codes, 8-bit key statistics) and their row
//!   layout.
//! - [`reference`](mod@reference): the CPU reference of every operation (the executable specification).
//! - [`gpu`]: the device context, the embedded PTX and the kernel launches.
//! - [`session`]: the engine's view, [`SparseAttention`]: one value per model that owns the
//!   manager, the device cache, the decode workspace and each sequence's state; prefill,
//!   decode steps layer by layer (eager or replayed CUDA graphs), sequences joining and leaving.
//!
//! Layouts and the semantics chosen where the paper leaves room: `docs/ARCHITECTURE.md`.
#![warn(missing_docs)]

pub mod block_iter;
pub mod config;
pub mod dtype;
pub mod error;
pub mod geometry;
pub mod gpu;
pub mod head_pattern;
pub mod index_table;
pub mod paging;
pub mod quant;
pub mod reference;
pub mod session;

/// The `cudarc` lserve is built on (device buffers, streams, graphs), re-exported so callers use
/// the same version.
pub use cudarc;
pub use error::{LserveError, Result};
pub use session::SparseAttention;

/// The repository README's examples, compiled as doctests (the README is not in the published
/// crate, so only where it is beside the sources).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
