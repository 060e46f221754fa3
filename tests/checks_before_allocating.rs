//! Constructors reject bad sizes before allocating anything: a manager or host cache whose
//! slot count is invalid must not first allocate a page pool of billions of pages (found by
//! fuzzing `fuzz/harness/constructors.rs`: the pool was built, then the slot count rejected).
//! A counting global allocator records the largest single allocation of this test binary, which
//! holds this one test so that nothing else allocates beside it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::HeadPattern;
use lserve::paging::{HostKvCache, KvCacheManager};
use lserve::LserveError;

struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; only a counter is updated.
unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's layout contract is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: as `alloc`; `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

/// Runs `f` and returns its result with the largest allocation made meanwhile.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.store(0, Ordering::Relaxed);
    let r = f();
    (r, LARGEST.load(Ordering::Relaxed))
}

#[test]
fn bad_sizes_are_rejected_before_anything_is_allocated() {
    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    let pattern = HeadPattern::all_dense(g);
    let config = SparsityConfig::default();
    let big_pool = u32::MAX as usize - 1; // a valid capacity: its free list is 16 GiB
    const SMALL: usize = 1 << 16;

    for slots in [0, u32::MAX as usize + 1] {
        let (r, largest) = largest_allocation(|| {
            KvCacheManager::new(g, pattern.clone(), config, big_pool, slots, 1024)
        });
        assert!(
            matches!(
                r,
                Err(LserveError::InvalidConfig {
                    field: "max_sequences",
                    ..
                })
            ),
            "{r:?}"
        );
        assert!(
            largest < SMALL,
            "manager: {largest} bytes allocated before the error"
        );

        let (r, largest) =
            largest_allocation(|| HostKvCache::<bf16>::new(&pattern, &config, 1, slots));
        assert!(matches!(r, Err(LserveError::InvalidConfig { .. })), "{r:?}");
        assert!(
            largest < SMALL,
            "host cache: {largest} bytes allocated before the error"
        );
    }
    // A bad capacity with many valid slots: the slots are not allocated first either.
    let (r, largest) = largest_allocation(|| {
        KvCacheManager::new(g, pattern.clone(), config, 0, u32::MAX as usize, 1024)
    });
    assert!(
        matches!(
            r,
            Err(LserveError::InvalidConfig {
                field: "capacity_pages",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(
        largest < SMALL,
        "manager: {largest} bytes allocated before the error"
    );
    let (r, largest) =
        largest_allocation(|| HostKvCache::<bf16>::new(&pattern, &config, 0, u32::MAX as usize));
    assert!(matches!(r, Err(LserveError::InvalidConfig { .. })), "{r:?}");
    assert!(
        largest < SMALL,
        "host cache: {largest} bytes allocated before the error"
    );

    // The same constructors with valid sizes do allocate (the counter sees them).
    let (r, largest) =
        largest_allocation(|| KvCacheManager::new(g, pattern.clone(), config, 1 << 20, 1, 1024));
    assert!(r.is_ok());
    assert!(largest >= 4 << 20, "{largest}");
}
