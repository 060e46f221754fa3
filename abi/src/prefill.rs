//! Prefill block granularity: the unit of the block iterator and of caller block masks.

/// Queries per prefill block (rows of a query tile; the granularity of a block mask's rows).
pub const BLOCK_Q: u32 = 64;
/// Keys per prefill block (the granularity of the KV blocks a query block visits).
pub const BLOCK_KV: u32 = 64;
