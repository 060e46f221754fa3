//! The GPU side: a context that owns the loaded kernel module, and the launches.

mod context;

pub use context::{GpuContext, PTX, PTX_ARCH};
