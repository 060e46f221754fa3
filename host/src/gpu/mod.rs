//! The GPU side: a context that owns the loaded kernel module, and the launches.

mod context;
#[doc(hidden)]
pub mod primitives_testing;

pub use context::{GpuContext, PTX, PTX_ARCH};
