//! The free list of physical page ids.

use crate::error::{LserveError, Result};

/// A physical page id (an index into every layer's page pool).
pub type PageId = u32;

/// The padding value of device-shaped page lists (block tables, index tables) past their length.
/// It is never a valid page id (capacities are below it), so a kernel that reads past a
/// length faults instead of reading some other sequence's page.
pub const PAD_PAGE: PageId = u32::MAX;

/// Physical pages `0..capacity` and which of them are handed out.
///
/// Allocation is all-or-nothing; a free of a page that is not allocated is an error. Pages are
/// handed out lowest id first from a fresh pool, and freed pages are reused last-freed first.
///
/// ```
/// use lserve::paging::PagePool;
/// let mut pool = PagePool::new(4)?;
/// let pages = pool.alloc(3)?;
/// assert_eq!(pages, vec![0, 1, 2]);
/// assert!(pool.alloc(2).is_err()); // only 1 free: nothing allocated
/// assert_eq!(pool.free_pages(), 1);
/// pool.free(&pages)?;
/// assert!(pool.free(&[1]).is_err()); // double free
/// assert_eq!(pool.free_pages(), 4);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PagePool {
    /// Free ids; the next allocation pops from the end.
    free: Vec<PageId>,
    /// `allocated[page]`.
    allocated: Vec<bool>,
}

impl PagePool {
    /// A pool of `capacity` free pages; `capacity` must be > 0 and below [`PAD_PAGE`].
    pub fn new(capacity: usize) -> Result<Self> {
        Self::check_capacity(capacity)?;
        Ok(Self {
            free: (0..capacity as PageId).rev().collect(),
            allocated: vec![false; capacity],
        })
    }

    /// The capacity rule of [`new`](Self::new), checked without allocating.
    pub(crate) fn check_capacity(capacity: usize) -> Result<()> {
        if capacity == 0 || capacity >= PAD_PAGE as usize {
            return Err(LserveError::InvalidConfig {
                field: "capacity_pages",
                reason: format!("{capacity} is not in 1..{PAD_PAGE}"),
            });
        }
        Ok(())
    }

    /// Pages in the pool.
    pub fn capacity(&self) -> usize {
        self.allocated.len()
    }

    /// Pages not handed out.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Pages handed out.
    pub fn used_pages(&self) -> usize {
        self.capacity() - self.free_pages()
    }

    /// Whether `page` is handed out (false for ids out of range).
    pub fn is_allocated(&self, page: PageId) -> bool {
        self.allocated.get(page as usize).copied().unwrap_or(false)
    }

    /// Hands out `n` pages, or none (`PoolExhausted`) if fewer than `n` are free.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>> {
        if n > self.free.len() {
            return Err(LserveError::PoolExhausted {
                needed: n,
                free: self.free.len(),
            });
        }
        let pages: Vec<PageId> = self.free.drain(self.free.len() - n..).rev().collect();
        for &p in &pages {
            self.allocated[p as usize] = true;
        }
        Ok(pages)
    }

    /// Returns `pages` to the pool, or none of them if any is out of range (`PageOutOfRange`),
    /// not allocated, or listed twice (`PageNotAllocated`).
    pub fn free(&mut self, pages: &[PageId]) -> Result<()> {
        self.check_owned(pages)?;
        for &p in pages.iter().rev() {
            self.allocated[p as usize] = false;
            self.free.push(p);
        }
        Ok(())
    }

    /// Checks that every page of `pages` is in range and allocated, and that none repeats.
    pub fn check_owned(&self, pages: &[PageId]) -> Result<()> {
        let mut seen = vec![false; self.capacity()];
        for &p in pages {
            if p as usize >= self.capacity() {
                return Err(LserveError::PageOutOfRange {
                    page: p,
                    capacity: self.capacity() as u32,
                });
            }
            if !self.allocated[p as usize] || seen[p as usize] {
                return Err(LserveError::PageNotAllocated { page: p });
            }
            seen[p as usize] = true;
        }
        Ok(())
    }
}
