//! The two-way paged KV cache.
//!
//! - Dense heads store their K/V in a pool of physical pages of `N_P` tokens ([`PagePool`]); a
//!   sequence's [`BlockTable`] maps its logical pages to physical ids, shared by all layers.
//! - Streaming heads keep only their sink tokens and a ring of the last `local_tokens` tokens,
//!   in one slot per sequence of the [`StreamingStore`].
//! - [`KvCacheManager`] owns the pool, the slots and the per-sequence state (length, block
//!   table, decode step counter): the sequence lifecycle, all-or-nothing.
//! - [`HostKvCache`] holds the K/V/statistics buffers in host memory, in the device's layout.
//!
//! ```
//! use lserve::config::SparsityConfig;
//! use lserve::geometry::ModelGeometry;
//! use lserve::head_pattern::HeadPattern;
//! use lserve::paging::{HostKvCache, KvCacheManager};
//! use half::bf16;
//!
//! let g = ModelGeometry::new(1, 2, 2, 64)?;
//! let pattern = HeadPattern::interleaved(g, 0.5)?; // head 0 dense, head 1 streaming
//! let config = SparsityConfig { page_tokens: 16, logical_page_tokens: 8, token_budget: 32,
//!                               sink_tokens: 4, local_tokens: 8, ..Default::default() };
//! let mut mgr = KvCacheManager::new(g, pattern, config, 8, 2, 128)?;
//! let mut cache = HostKvCache::<bf16>::for_manager(&mgr)?;
//! let seq = mgr.add_sequence()?;
//! let new_positions = mgr.reserve(seq, 20)?; // 0..20: two pages
//! assert_eq!(mgr.block_table(seq)?.len(), 2);
//! let k: Vec<bf16> = (0..2 * 64).map(|i| bf16::from_f32(i as f32)).collect();
//! let view = mgr.view(seq)?;
//! for pos in new_positions {
//!     cache.write_token(0, &view, pos, &k, &k)?;
//! }
//! assert_eq!(cache.key(0, &view, 0, 3)?, &k[..64]); // dense head 0, token 3
//! assert!(cache.key(0, &view, 1, 5).is_err()); // streaming head: token 5 left the ring
//! mgr.free_sequence(seq)?;
//! assert_eq!(mgr.pool().free_pages(), 8);
//! # Ok::<(), lserve::LserveError>(())
//! ```

mod block_table;
mod host_cache;
mod page_pool;
mod sequences;
mod streaming_store;

pub use block_table::BlockTable;
pub use host_cache::{DenseLayerCache, HostKvCache, StreamingLayerCache};
pub use page_pool::{PageId, PagePool, PAD_PAGE};
pub use sequences::{DeviceBlockTables, KvCacheManager, SeqId, SequenceView, TableGeneration};
pub use streaming_store::StreamingStore;

use lserve_abi::PagedLayout;

use crate::config::SparsityConfig;
use crate::head_pattern::HeadPattern;

/// Layer `layer`'s dense pool layout for a pool of `capacity` pages: the one place the host's
/// cache ([`HostKvCache`]) and the manager ([`KvCacheManager::paged_layout`], which the device
/// cache follows) derive it.
fn paged_layout(
    pattern: &HeadPattern,
    config: &SparsityConfig,
    capacity: usize,
    layer: usize,
) -> PagedLayout {
    PagedLayout {
        capacity: capacity as u32,
        heads: pattern.dense_heads(layer) as u32,
        page_tokens: config.page_tokens as u32,
        logical_tokens: config.logical_page_tokens as u32,
        head_dim: pattern.geometry().head_dim() as u32,
    }
}
