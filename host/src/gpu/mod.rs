//! The GPU side: a context that owns the loaded kernel module, the device KV cache, and the
//! launches.

mod cache;
mod context;
mod decode;
mod kv_write;
mod launch;
mod prefill;
#[doc(hidden)]
pub mod primitives_testing;
mod select;

pub use cache::{DecodeBatch, DeviceElement, DeviceKvCache};
pub use context::{driver_present, GpuContext, PTX, PTX_ARCH};
pub use decode::{decode_attention, DecodeWorkspace, MAX_SPLITS};
