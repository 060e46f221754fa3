//! A sequence's block table: logical page number -> physical page id.

use super::page_pool::PageId;
use crate::error::{LserveError, Result};

/// Logical page `i` of a sequence (tokens `i * N_P .. (i + 1) * N_P`) lives in physical page
/// `table[i]` of every layer's pool.
///
/// The [`KvCacheManager`](super::KvCacheManager) keeps one per sequence; tests and engines can
/// also build one directly (e.g. with shuffled ids).
///
/// ```
/// use lserve::paging::BlockTable;
/// let t = BlockTable::from_pages(vec![7, 2, 5]);
/// assert_eq!(t.physical(1)?, 2);
/// assert!(t.physical(3).is_err());
/// assert!(t.check_capacity(6).is_err()); // page 7 is out of range for 6 pages
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    pages: Vec<PageId>,
}

impl BlockTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// A table mapping logical page `i` to `pages[i]`.
    pub fn from_pages(pages: Vec<PageId>) -> Self {
        Self { pages }
    }

    /// Logical pages mapped.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether no page is mapped.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// The physical ids, indexed by logical page.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// The physical id of logical page `logical`, or `None` past the end.
    pub fn get(&self, logical: usize) -> Option<PageId> {
        self.pages.get(logical).copied()
    }

    /// The physical id of logical page `logical` (`InvalidArgument` past the end).
    pub fn physical(&self, logical: usize) -> Result<PageId> {
        self.get(logical)
            .ok_or_else(|| LserveError::InvalidArgument {
                what: "logical page",
                reason: format!(
                    "{logical} not mapped (table has {} pages)",
                    self.pages.len()
                ),
            })
    }

    /// Checks every id is below `capacity` (`PageOutOfRange` otherwise).
    pub fn check_capacity(&self, capacity: usize) -> Result<()> {
        match self.pages.iter().find(|&&p| p as usize >= capacity) {
            Some(&page) => Err(LserveError::PageOutOfRange {
                page,
                capacity: capacity as u32,
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn extend(&mut self, pages: &[PageId]) {
        self.pages.extend_from_slice(pages);
    }
}
