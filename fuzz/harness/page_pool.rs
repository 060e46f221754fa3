//! Random operation sequences on a [`PagePool`] against a model of its documented behaviour: a
//! stack of free ids (a fresh pool hands out the lowest id first, freed pages are reused last
//! freed first), all-or-nothing allocation, frees and ownership checks that fail on the first
//! bad id with its typed error and change nothing.

use arbitrary::{Arbitrary, Unstructured};
use lserve::paging::{PageId, PagePool};
use lserve::LserveError;

use super::size::Size;

#[derive(Arbitrary, Debug)]
struct Input {
    capacity: u8,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc(Size),
    /// Frees the pages picked by `picks` (see [`pick`]).
    Free(Vec<Pick>),
    CheckOwned(Vec<Pick>),
    IsAllocated(Pick),
}

/// A page id: one that is allocated, one that is free, or any id.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Pick {
    Allocated(u8),
    Free(u8),
    Raw(u32),
}

struct Model {
    capacity: usize,
    /// The free ids; the next allocation pops from the end.
    free: Vec<PageId>,
    allocated: Vec<bool>,
}

impl Model {
    fn pick(&self, p: Pick) -> PageId {
        let of = |want: bool, i: u8| {
            let ids: Vec<PageId> = (0..self.capacity as PageId)
                .filter(|&id| self.allocated[id as usize] == want)
                .collect();
            if ids.is_empty() {
                self.capacity as PageId // out of range
            } else {
                ids[i as usize % ids.len()]
            }
        };
        match p {
            Pick::Allocated(i) => of(true, i),
            Pick::Free(i) => of(false, i),
            Pick::Raw(id) => id,
        }
    }

    /// The first bad id of `pages`, as the error the pool must give.
    fn check(&self, pages: &[PageId]) -> Option<LserveError> {
        let mut seen = vec![false; self.capacity];
        for &p in pages {
            if p as usize >= self.capacity {
                return Some(LserveError::PageOutOfRange {
                    page: p,
                    capacity: self.capacity as u32,
                });
            }
            if !self.allocated[p as usize] || seen[p as usize] {
                return Some(LserveError::PageNotAllocated { page: p });
            }
            seen[p as usize] = true;
        }
        None
    }
}

fn same_error(got: &LserveError, want: &LserveError) -> bool {
    match (got, want) {
        (
            LserveError::PageOutOfRange { page, capacity },
            LserveError::PageOutOfRange {
                page: p,
                capacity: c,
            },
        ) => (page, capacity) == (p, c),
        (LserveError::PageNotAllocated { page }, LserveError::PageNotAllocated { page: p }) => {
            page == p
        }
        (
            LserveError::PoolExhausted { needed, free },
            LserveError::PoolExhausted { needed: n, free: f },
        ) => (needed, free) == (n, f),
        _ => false,
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let u = Unstructured::new(data);
    let Ok(input) = Input::arbitrary_take_rest(u) else {
        return;
    };
    let capacity = input.capacity as usize;
    let mut pool = match PagePool::new(capacity) {
        Ok(pool) => pool,
        Err(LserveError::InvalidConfig {
            field: "capacity_pages",
            ..
        }) => {
            assert_eq!(capacity, 0);
            return;
        }
        Err(e) => panic!("PagePool::new({capacity}): {e:?}"),
    };
    let mut model = Model {
        capacity,
        free: (0..capacity as PageId).rev().collect(),
        allocated: vec![false; capacity],
    };
    for op in input.ops.into_iter().take(256) {
        let before = pool.clone();
        match op {
            Op::Alloc(n) => {
                let n = n.get();
                match pool.alloc(n) {
                    Ok(pages) => {
                        assert!(n <= model.free.len());
                        let want: Vec<PageId> =
                            (0..n).map(|_| model.free.pop().expect("checked")).collect();
                        assert_eq!(pages, want, "alloc({n}) handed out other pages");
                        for p in pages {
                            model.allocated[p as usize] = true;
                        }
                    }
                    Err(e) => {
                        let want = LserveError::PoolExhausted {
                            needed: n,
                            free: model.free.len(),
                        };
                        assert!(n > model.free.len() && same_error(&e, &want), "{e:?}");
                        assert_eq!(pool, before);
                    }
                }
            }
            Op::Free(picks) => {
                let pages: Vec<PageId> = picks.iter().take(32).map(|&p| model.pick(p)).collect();
                match (pool.free(&pages), model.check(&pages)) {
                    (Ok(()), None) => {
                        for &p in pages.iter().rev() {
                            model.allocated[p as usize] = false;
                            model.free.push(p);
                        }
                    }
                    (Err(e), Some(want)) => {
                        assert!(same_error(&e, &want), "free: {e:?}, model {want:?}");
                        assert_eq!(pool, before);
                    }
                    (r, want) => panic!("free({pages:?}): {r:?}, model {want:?}"),
                }
            }
            Op::CheckOwned(picks) => {
                let pages: Vec<PageId> = picks.iter().take(32).map(|&p| model.pick(p)).collect();
                match (pool.check_owned(&pages), model.check(&pages)) {
                    (Ok(()), None) => {}
                    (Err(e), Some(want)) => assert!(same_error(&e, &want), "{e:?} {want:?}"),
                    (r, want) => panic!("check_owned({pages:?}): {r:?}, model {want:?}"),
                }
                assert_eq!(pool, before);
            }
            Op::IsAllocated(p) => {
                let id = model.pick(p);
                let want = model.allocated.get(id as usize).copied().unwrap_or(false);
                assert_eq!(pool.is_allocated(id), want);
            }
        }
        assert_eq!(pool.capacity(), capacity);
        assert_eq!(pool.free_pages(), model.free.len());
        assert_eq!(pool.used_pages(), capacity - model.free.len());
        let allocated = (0..capacity as PageId)
            .filter(|&p| pool.is_allocated(p))
            .count();
        assert_eq!(allocated, capacity - model.free.len());
    }
}
