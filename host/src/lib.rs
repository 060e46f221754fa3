//! # lserve
//!
//! LServe's unified sparse attention for long-context LLM serving: streaming heads (Λ mask),
//! query-aware page selection over a hierarchical paged KV cache, reusable selection, on GPU
//! kernels written in Rust, with a typed host API and a CPU reference of every operation.
//!
//! The modules:
//! - [`geometry`], [`head_pattern`], [`config`]: what the model looks like and which heads are
//!   streaming; the sparsity configuration (LServe's defaults, validated).
//! - [`paging`]: the two-way paged KV cache: page pool, block tables, streaming sink+ring store,
//!   sequence lifecycle; [`index_table`] and [`block_iter`]: what each kernel visits.
//! - [`reference`]: the CPU reference (the executable specification).
//! - [`gpu`]: the device context, the embedded PTX and the kernel launches.
#![warn(missing_docs)]

pub mod error;
pub mod gpu;

pub use error::{LserveError, Result};
