//! The one check of a physical page id a kernel reads from a device table (a block table, an
//! index table) before it addresses the dense pool with it.
//!
//! **Invariant.** A kernel never reads or writes the pool (K, V, `kmin`, `kmax`) at a page id
//! it took from device memory without passing it through [`pool_page`]: an id at or past the
//! pool's page count (`PagedLayout::capacity`; e.g. `PAD_PAGE = u32::MAX`, an engine bug or
//! memory corruption) is *skipped*, never clamped onto a real page (that would read a page of
//! another sequence):
//! - a write through it writes nothing (`kv_write::target::RowTarget::Nowhere`; the pooling of
//!   key statistics returns);
//! - the page scorer loads no statistics for it and scores it `-inf`;
//! - the decode attention copies nothing for its tiles: they land as zero rows (a tensor-map
//!   box past the pool is filled with zeros by the copy engine; a `cp.async` tile copies 0
//!   bytes and fills zeros), so such a page takes part in the softmax as keys of score 0 with
//!   values 0, and no pool byte outside the sequence's valid pages is read.
//!
//! Which ids a kernel cannot tell apart: a valid id of a page another sequence owns. The host
//! never uploads one (`docs/ARCHITECTURE.md`, "Isolation on the device").

use lserve_abi::layout::PagedLayout;

/// `page` if it is a page of the pool, else `paged.capacity` (the first id past it): every
/// row, statistics row or tensor-map block computed from the result for a page past the pool
/// lies past the pool's last page (block `capacity * heads + head` is outside the pool's
/// tensor map, `[capacity * heads][page_tokens][D]`). One unsigned `min`.
#[inline(always)]
pub fn pool_page(paged: &PagedLayout, page: u32) -> u32 {
    page.min(paged.capacity)
}

/// Whether `page` (read from a table, or returned by [`pool_page`]) is a page of the pool. One
/// unsigned compare.
#[inline(always)]
pub fn in_pool(paged: &PagedLayout, page: u32) -> bool {
    page < paged.capacity
}
