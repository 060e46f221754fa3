//! The GPU side: a context that owns the loaded kernel module, the device KV cache, and the
//! launches.

mod cache;
mod context;
mod decode;
mod kv_write;
mod launch;
mod prefill;
#[cfg(feature = "test-kernels")]
#[doc(hidden)]
pub mod primitives_testing;
mod profile;
mod ptx;
mod select;
mod stat_codes;
mod step;
mod table_sync;
#[cfg(feature = "test-kernels")]
mod tamper;
mod tensor_map;
mod tokens;

pub use cache::{DecodeBatch, DeviceElement, DeviceKvCache};
pub use context::{driver_present, GpuContext, KernelResources};
pub use decode::{
    append_and_attend, decode_attention, AppendAttendPlan, AppendLaunch, DecodePlan,
    DecodeWorkspace, MAX_SPLITS,
};
pub(crate) use kv_write::fill_random_bits;
pub use kv_write::{
    append_kv, fill_random, pool_key_stats, random_fill_value, write_kv_rows, AppendPlan,
    DeviceKvWritePlan, KvWritePlan,
};
pub use prefill::{
    prefill_attention, prefill_chunks_into_cache, prefill_into_cache, PrefillArgs, PrefillPlan,
    PrefillScratch,
};
pub use profile::{profile_dynamic_min_len, CrossoverProfile, ProfilePoint};
pub use ptx::{module_for, KernelPtx, KERNEL_PTX, PTX_ARCH_VAR};
pub(crate) use select::enqueue_advance;
pub use select::{
    advance_decode_steps, download_selection, poison_index_tables, reset_selection_state,
    score_pages, select_pages, select_top_k, upload_key_stats, SelectPlan, SelectWorkspace,
    SelectionState,
};
pub use step::{DecodeStep, PlannedStep};
#[cfg(feature = "test-kernels")]
#[doc(hidden)]
pub use tamper::{
    overwrite_device_table, read_coded_layer, read_stat_codes, CodedLayerContents, DeviceTable,
    StatCodesContents,
};
pub use tokens::{Tokens, TokensMut};
