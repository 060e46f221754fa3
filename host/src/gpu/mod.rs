//! The GPU side: a context that owns the loaded kernel module, and the launches.

mod context;

pub use context::{driver_present, GpuContext, PTX, PTX_ARCH};
