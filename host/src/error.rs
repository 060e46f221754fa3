//! The crate's error type: every misuse the host API can detect is one of these.

use thiserror::Error;

/// Result alias used across the crate.
pub type Result<T, E = LserveError> = core::result::Result<T, E>;

/// Everything that can go wrong in `lserve`, as typed variants.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LserveError {
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}
