//! The host half of isolation on the device (`docs/ARCHITECTURE.md`, "Isolation on the
//! device"): index tables an engine hands to `DeviceKvCache::upload` are checked against the
//! manager first (`IndexTables::check_against`). Each bad table gets its typed error, and the
//! tables and the manager compare equal to clones taken before the call (the
//! GPU test `gpu_isolation.rs` shows the upload refusing one, nothing allocated).

use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::HeadPattern;
use lserve::index_table::IndexTables;
use lserve::paging::{KvCacheManager, SeqId};
use lserve::LserveError;

const CAPACITY: usize = 12;

/// Two layers of two dense heads, three slots: `a` and `b` hold 3 and 2 pages, the third slot
/// is free, and some pages of the pool are free.
fn manager() -> (KvCacheManager, SeqId, SeqId) {
    let g = ModelGeometry::new(2, 2, 2, 64).unwrap();
    let config = SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 8,
        token_budget: 32,
        ..SparsityConfig::default()
    };
    let mut mgr =
        KvCacheManager::new(g, HeadPattern::all_dense(g), config, CAPACITY, 3, 256).unwrap();
    let (a, b) = (mgr.add_sequence().unwrap(), mgr.add_sequence().unwrap());
    mgr.reserve(a, 20).unwrap();
    mgr.reserve(b, 30).unwrap();
    mgr.reserve(a, 20).unwrap();
    (mgr, a, b)
}

fn pages(mgr: &KvCacheManager, seq: SeqId) -> Vec<u32> {
    mgr.block_table(seq).unwrap().pages().to_vec()
}

/// Runs the check and shows it changed neither the tables nor the manager.
fn check(mgr: &KvCacheManager, tables: &IndexTables) -> Result<(), LserveError> {
    let (tables_before, mgr_before) = (tables.clone(), mgr.clone());
    let result = tables.check_against(mgr);
    assert_eq!(tables, &tables_before);
    assert!(mgr == &mgr_before, "the manager changed");
    result
}

#[test]
fn tables_of_the_sequences_own_pages_pass() {
    let (mgr, a, b) = manager();
    let mut t = IndexTables::for_manager(&mgr).unwrap();
    let (sa, sb) = (mgr.slot(a).unwrap() as usize, mgr.slot(b).unwrap() as usize);
    t.set(0, sa, 0, &pages(&mgr, a)).unwrap();
    t.set(1, sa, 1, &pages(&mgr, a)[1..]).unwrap();
    t.set(1, sb, 0, &pages(&mgr, b)).unwrap();
    assert!(check(&mgr, &t).is_ok());
}

#[test]
fn a_page_of_another_sequence_is_not_owned() {
    let (mgr, a, b) = manager();
    let mut t = IndexTables::for_manager(&mgr).unwrap();
    let sa = mgr.slot(a).unwrap();
    let foreign = pages(&mgr, b)[1];
    t.set(1, sa as usize, 1, &[pages(&mgr, a)[0], foreign])
        .unwrap();
    assert!(matches!(
        check(&mgr, &t),
        Err(LserveError::PageNotOwned { page, slot }) if page == foreign && slot == sa
    ));
}

#[test]
fn a_free_page_or_any_page_in_a_free_slot_is_not_owned() {
    let (mgr, a, b) = manager();
    let used: Vec<u32> = [pages(&mgr, a), pages(&mgr, b)].concat();
    let free = (0..CAPACITY as u32).find(|p| !used.contains(p)).unwrap();
    let sa = mgr.slot(a).unwrap();
    let mut t = IndexTables::for_manager(&mgr).unwrap();
    t.set(0, sa as usize, 1, &[free]).unwrap();
    assert!(matches!(
        check(&mgr, &t),
        Err(LserveError::PageNotOwned { page, slot }) if page == free && slot == sa
    ));

    // The free slot, listing a page of `a`.
    let free_slot = (0..3u32)
        .find(|&s| s != sa && s != mgr.slot(b).unwrap())
        .unwrap();
    let mut t = IndexTables::for_manager(&mgr).unwrap();
    let page = pages(&mgr, a)[0];
    t.set(0, free_slot as usize, 0, &[page]).unwrap();
    assert!(matches!(
        check(&mgr, &t),
        Err(LserveError::PageNotOwned { page: p, slot }) if p == page && slot == free_slot
    ));
}

#[test]
fn a_page_past_the_managers_pool_is_out_of_range() {
    let (mgr, a, _) = manager();
    // Tables checked against a larger pool accept the id; the manager's pool does not have it.
    let mut t = IndexTables::new(mgr.pattern(), 3, 5, CAPACITY + 10).unwrap();
    let sa = mgr.slot(a).unwrap() as usize;
    t.set(1, sa, 0, &[pages(&mgr, a)[0], CAPACITY as u32])
        .unwrap();
    assert!(matches!(
        check(&mgr, &t),
        Err(LserveError::PageOutOfRange { page, capacity })
            if page == CAPACITY as u32 && capacity == CAPACITY as u32
    ));
}

#[test]
fn tables_shaped_for_another_manager_are_refused() {
    let (mgr, _, _) = manager();
    let cap = IndexTables::for_manager(&mgr)
        .unwrap()
        .layer(0)
        .unwrap()
        .entry_capacity();
    // Fewer slots than the manager has (the device would read past them).
    let t = IndexTables::new(mgr.pattern(), 2, cap, CAPACITY).unwrap();
    assert!(matches!(
        check(&mgr, &t),
        Err(LserveError::InvalidArgument {
            what: "index tables",
            ..
        })
    ));
    // Another layer count.
    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    let t = IndexTables::new(&HeadPattern::all_dense(g), 3, cap, CAPACITY).unwrap();
    assert!(matches!(
        check(&mgr, &t),
        Err(LserveError::InvalidArgument {
            what: "index tables",
            ..
        })
    ));
    // Another number of dense heads in a layer.
    let g2 = ModelGeometry::new(2, 2, 2, 64).unwrap();
    let one_dense = HeadPattern::interleaved(g2, 0.5).unwrap();
    let t = IndexTables::new(&one_dense, 3, cap, CAPACITY).unwrap();
    assert!(matches!(
        check(&mgr, &t),
        Err(LserveError::InvalidArgument {
            what: "index tables",
            ..
        })
    ));
}
