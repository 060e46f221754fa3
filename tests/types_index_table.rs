//! Index tables: device shape, validated setters, bulk overwrite, clearing.

use lserve::config::{SelectionUnit, SparsityConfig};
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::index_table::IndexTables;
use lserve::paging::{KvCacheManager, PAD_PAGE};
use lserve::LserveError;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

fn pattern() -> HeadPattern {
    let g = ModelGeometry::new(2, 6, 3, 64).unwrap();
    use HeadKind::{Dense as D, Streaming as S};
    HeadPattern::from_kinds(g, vec![vec![D, S, D], vec![S, S, D]]).unwrap()
}

#[test]
fn random_entries_round_trip_and_pad() {
    let p = pattern();
    let mut t = IndexTables::new(&p, 4, 6, 50).unwrap();
    assert_eq!(
        (t.layer(0).unwrap().heads(), t.layer(1).unwrap().heads()),
        (2, 1)
    );
    assert_eq!(t.layer(0).unwrap().pages().len(), 4 * 2 * 6);
    assert_eq!(t.layer(1).unwrap().lens().len(), 4);
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let mut expected = std::collections::HashMap::new();
    for _ in 0..300 {
        let (layer, slot) = (rng.gen_range(0..2), rng.gen_range(0..4));
        let head = rng.gen_range(0..p.dense_heads(layer));
        let mut ids: Vec<u32> = (0..50).collect();
        ids.shuffle(&mut rng);
        ids.truncate(rng.gen_range(0..=6));
        t.set(layer, slot, head, &ids).unwrap();
        expected.insert((layer, slot, head), ids);
        for (&(l, s, h), ids) in &expected {
            assert_eq!(t.get(l, s, h).unwrap(), &ids[..]);
            let lt = t.layer(l).unwrap();
            let e = s * lt.heads() + h;
            assert_eq!(lt.lens()[e] as usize, ids.len());
            assert!(lt.pages()[e * 6 + ids.len()..(e + 1) * 6]
                .iter()
                .all(|&x| x == PAD_PAGE));
        }
    }
    // Bulk overwrite with the same content is a no-op; a copy made from device-shaped buffers
    // with junk past the lengths normalizes the junk to padding.
    let before = t.clone();
    let l0 = t.layer(0).unwrap().clone();
    let mut junk = l0.pages().to_vec();
    for (e, &len) in l0.lens().iter().enumerate() {
        for x in &mut junk[e * 6 + len as usize..(e + 1) * 6] {
            *x = 12345;
        }
    }
    t.overwrite_layer(0, &junk, l0.lens()).unwrap();
    assert_eq!(t, before);
}

#[test]
fn invalid_input_is_rejected_and_changes_nothing() {
    let p = pattern();
    let mut t = IndexTables::new(&p, 2, 3, 10).unwrap();
    t.set(0, 1, 1, &[4, 2]).unwrap();
    let before = t.clone();
    assert!(matches!(
        t.set(0, 1, 1, &[10]),
        Err(LserveError::PageOutOfRange {
            page: 10,
            capacity: 10
        })
    ));
    assert!(matches!(
        t.set(0, 1, 1, &[1, 2, 3, 4]),
        Err(LserveError::InvalidArgument { .. })
    ));
    assert!(matches!(
        t.set(0, 1, 1, &[3, 1, 3]),
        Err(LserveError::InvalidArgument { .. })
    ));
    assert!(t.set(2, 0, 0, &[1]).is_err()); // layer
    assert!(t.set(0, 2, 0, &[1]).is_err()); // slot
    assert!(t.set(1, 0, 1, &[1]).is_err()); // layer 1 has one dense head
    assert!(t.get(0, 0, 2).is_err());
    assert!(t.overwrite_layer(0, &[0; 5], &[0; 4]).is_err());
    assert!(t.overwrite_layer(0, &[0; 12], &[0; 3]).is_err());
    assert!(t.overwrite_layer(0, &[0; 12], &[0, 0, 4, 0]).is_err()); // length over capacity
    assert!(t
        .overwrite_layer(0, &[11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[1, 0, 0, 0])
        .is_err());
    assert!(t
        .overwrite_layer(0, &[1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[2, 0, 0, 0])
        .is_err());
    assert!(t.clear_slot(2).is_err());
    assert_eq!(t, before);
    t.clear_slot(1).unwrap();
    assert!(t.get(0, 1, 1).unwrap().is_empty());
    assert!(t.layer(0).unwrap().pages().iter().all(|&x| x == PAD_PAGE));
    for (args, field) in [
        ((0, 3, 10), "slots"),
        ((2, 0, 10), "entry_capacity"),
        ((2, 3, 0), "pool_capacity"),
    ] {
        assert!(matches!(
            IndexTables::new(&p, args.0, args.1, args.2),
            Err(LserveError::InvalidConfig { field: f, .. }) if f == field
        ));
    }
}

#[test]
fn entry_capacity_covers_dense_and_selected_decode() {
    let c = SparsityConfig::default(); // 64-token pages, K = 64, dense up to 8192 (128 pages)
    assert_eq!(IndexTables::entry_capacity_for(&c, 1 << 20), 128);
    assert_eq!(IndexTables::entry_capacity_for(&c, 1000), 16);
    let small = SparsityConfig {
        dynamic_min_len: 0,
        ..c
    };
    assert_eq!(IndexTables::entry_capacity_for(&small, 1 << 20), 67);
    let g = ModelGeometry::llama3_8b();
    let mgr = KvCacheManager::new(
        g,
        HeadPattern::interleaved(g, 0.5).unwrap(),
        c,
        64,
        3,
        65_536,
    )
    .unwrap();
    let t = IndexTables::for_manager(&mgr).unwrap();
    assert_eq!((t.layers(), t.pool_capacity()), (32, 64));
    assert_eq!(t.layer(5).unwrap().entry_capacity(), 128);
    assert_eq!(t.layer(5).unwrap().slots(), 3);
}

/// Table sizes whose product overflows are `InvalidConfig` before anything is allocated, never
/// an overflow panic.
#[test]
fn overflowing_table_sizes_are_errors() {
    let g = ModelGeometry::new(2, 4, 4, 64).unwrap();
    let pattern = HeadPattern::all_dense(g);
    let max = u32::MAX as usize;
    assert!(matches!(
        IndexTables::new(&pattern, max, max, 1),
        Err(LserveError::InvalidConfig {
            field: "entry_capacity",
            ..
        })
    ));
    let t = IndexTables::new(&pattern, 3, 5, 7).unwrap();
    assert_eq!(t.layer(1).unwrap().pages().len(), 3 * 4 * 5);
}

/// Tables for a manager that selects logical pages list logical-page ids: `physical * 4 + sub`
/// below `capacity * 4`, each owned through its physical page; entries hold the units of
/// `K + 3`; tables listing other units than the manager's config do not fit it.
#[test]
fn logical_page_tables_list_unit_ids() {
    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    let config = SparsityConfig {
        selection_unit: SelectionUnit::LogicalPage,
        token_budget: 128,
        dynamic_min_len: 64,
        ..SparsityConfig::default()
    };
    let pattern = HeadPattern::all_dense(g);
    let mut mgr = KvCacheManager::new(g, pattern.clone(), config, 8, 2, 512).unwrap();
    let (a, b) = (mgr.add_sequence().unwrap(), mgr.add_sequence().unwrap());
    mgr.reserve(a, 200).unwrap();
    mgr.reserve(b, 64).unwrap();
    let mut t = IndexTables::for_manager(&mgr).unwrap();
    assert_eq!(t.units_per_page(), 4);
    // K = 8 units of 16 tokens: 11 per entry (the dense ones hold 64 / 16 = 4).
    assert_eq!(t.layer(0).unwrap().entry_capacity(), 11);
    let page_a = mgr.block_table(a).unwrap().pages()[3];
    let page_b = mgr.block_table(b).unwrap().pages()[0];
    t.set(0, 0, 0, &[page_a * 4, page_a * 4 + 3]).unwrap();
    assert!(t.check_against(&mgr).is_ok());
    assert!(matches!(
        t.set(0, 0, 0, &[8 * 4]),
        Err(LserveError::PageOutOfRange {
            page: 32,
            capacity: 32
        })
    ));
    t.set(0, 0, 1, &[page_b * 4 + 1]).unwrap(); // slot 0 holds `a`
    assert!(matches!(
        t.check_against(&mgr),
        Err(LserveError::PageNotOwned { slot: 0, .. })
    ));
    // Physical-page tables do not fit a manager that selects logical pages.
    let physical = IndexTables::new(&pattern, 2, 11, 8).unwrap();
    assert!(matches!(
        physical.check_against(&mgr),
        Err(LserveError::InvalidArgument {
            what: "index tables",
            ..
        })
    ));
}
