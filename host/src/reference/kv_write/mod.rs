//! The reference of `lserve-kernels`' `kv_write`: writing the KV cache and keeping the key
//! statistics of the dense heads.
//!
//! - [`KeyStats`]: per-logical-page `kmin`/`kmax` on plain slices ([`key_stats`],
//!   [`page_stats`]) and as stored in the cache ([`stored_key_stats`]) — the kernels'
//!   `kv_write::stats`;
//! - [`pool_key_stats`]: the statistics of every logical page a token range touches,
//!   recomputed from the cache — `kv_write::pool`;
//! - [`update_key_stats`]: a decode token folded into its logical page's statistics — the
//!   statistics part of `kv_write::append`;
//! - [`write_tokens`]: prefill's write of a token range, then pooling — `kv_write::rows` and
//!   `kv_write::pool`.
//!
//! The functions on the cache take the [`HostKvCache`](crate::paging::HostKvCache) (same layout
//! as the device) and the sequence's [`SequenceView`](crate::paging::SequenceView).

mod append;
mod pool;
mod rows;
mod stats;

pub use append::update_key_stats;
pub use pool::pool_key_stats;
pub use rows::write_tokens;
pub use stats::{key_stats, page_stats, stored_key_stats, KeyStats};
