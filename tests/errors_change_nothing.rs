//! Bad input across the CPU-side API (docs/ARCHITECTURE.md, "Errors"): each case gets its
//! typed error, and the pool, store, cache, tables or mask it was called on compare equal to a
//! clone taken before the call.

use half::bf16;
use lserve::block_iter::{
    dense_decode_pages, prefill_blocks, streaming_decode_tokens, BlockMask, PrefillShape,
};
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::index_table::IndexTables;
use lserve::paging::{
    BlockTable, HostKvCache, KvCacheManager, PagePool, SequenceView, StreamingStore,
};
use lserve::reference::select::ReuseState;
use lserve::LserveError;

#[test]
fn page_pool_bad_frees_and_allocations_change_nothing() {
    let mut pool = PagePool::new(4).unwrap();
    let pages = pool.alloc(3).unwrap(); // 0, 1, 2
    let before = pool.clone();
    assert!(matches!(
        pool.free(&[pages[0], 9]),
        Err(LserveError::PageOutOfRange {
            page: 9,
            capacity: 4
        })
    ));
    assert!(matches!(
        pool.free(&[pages[1], 3]), // 3 was never handed out
        Err(LserveError::PageNotAllocated { page: 3 })
    ));
    assert!(matches!(
        pool.free(&[pages[2], pages[2]]), // listed twice
        Err(LserveError::PageNotAllocated { page: 2 })
    ));
    assert!(matches!(
        pool.check_owned(&[u32::MAX]),
        Err(LserveError::PageOutOfRange { .. })
    ));
    assert!(matches!(
        pool.alloc(2),
        Err(LserveError::PoolExhausted { needed: 2, free: 1 })
    ));
    assert_eq!(pool, before, "a failed free or allocation changed the pool");
    assert!(pages.iter().all(|&p| pool.is_allocated(p)));
    pool.free(&pages).unwrap();
    assert!(matches!(
        pool.free(&pages[..1]), // double free
        Err(LserveError::PageNotAllocated { page: 0 })
    ));
    assert_eq!(pool.free_pages(), 4);
}

#[test]
fn streaming_slot_misuse_changes_nothing() {
    let mut store = StreamingStore::new(2, 4, 8).unwrap();
    assert_eq!(store.acquire().unwrap(), 0);
    let before = store.clone();
    for slot in [1, 2, u32::MAX] {
        assert!(matches!(
            store.release(slot),
            Err(LserveError::InvalidArgument { what: "slot", .. })
        ));
    }
    assert_eq!(store, before);
    assert_eq!(store.acquire().unwrap(), 1);
    let before = store.clone();
    assert!(matches!(
        store.acquire(),
        Err(LserveError::NoFreeSlot { slots: 2 })
    ));
    assert_eq!(store, before);
}

/// A manager and its cache: layer 0 has a dense and a streaming head, layer 1 two dense heads;
/// 8-token pages, sinks 2, ring 4, 6 pages, 2 slots.
fn setup() -> (KvCacheManager, HostKvCache<bf16>) {
    let g = ModelGeometry::new(2, 2, 2, 64).unwrap();
    let kinds = vec![
        vec![HeadKind::Dense, HeadKind::Streaming],
        vec![HeadKind::Dense, HeadKind::Dense],
    ];
    let config = SparsityConfig {
        sink_tokens: 2,
        local_tokens: 4,
        page_tokens: 8,
        logical_page_tokens: 4,
        token_budget: 16,
        ..Default::default()
    };
    let pattern = HeadPattern::from_kinds(g, kinds).unwrap();
    let mgr = KvCacheManager::new(g, pattern, config, 6, 2, 64).unwrap();
    let cache = HostKvCache::for_manager(&mgr).unwrap();
    (mgr, cache)
}

fn row(x: f32) -> Vec<bf16> {
    vec![bf16::from_f32(x); 2 * 64]
}

#[test]
fn host_cache_writes_with_bad_shapes_positions_or_views_change_nothing() {
    let (mut mgr, mut cache) = setup();
    let a = mgr.add_sequence().unwrap();
    for pos in mgr.reserve(a, 10).unwrap() {
        let view = mgr.view(a).unwrap();
        for layer in 0..2 {
            cache
                .write_token(layer, &view, pos, &row(pos as f32), &row(-(pos as f32)))
                .unwrap();
        }
    }
    let view = mgr.view(a).unwrap();
    let before = cache.clone();
    let (short, long) = (vec![bf16::ZERO; 2 * 64 - 1], vec![bf16::ZERO; 2 * 64 + 1]);
    // Shapes.
    assert!(matches!(
        cache.write_token(0, &view, 3, &short, &row(1.0)),
        Err(LserveError::ShapeMismatch {
            what: "k",
            expected: 128,
            actual: 127
        })
    ));
    assert!(matches!(
        cache.write_token(0, &view, 3, &row(1.0), &long),
        Err(LserveError::ShapeMismatch { what: "v", .. })
    ));
    // Positions at or past the view's length.
    for pos in [10, 11, usize::MAX] {
        assert!(matches!(
            cache.write_token(0, &view, pos, &row(1.0), &row(1.0)),
            Err(LserveError::TokenNotStored { position, len: 10 }) if position == pos
        ));
    }
    // A layer out of range.
    assert!(matches!(
        cache.write_token(2, &view, 3, &row(1.0), &row(1.0)),
        Err(LserveError::InvalidArgument { what: "layer", .. })
    ));
    // A view whose block table lacks the page of the position (too short for its length).
    let short_table = BlockTable::from_pages(vec![view.block_table.pages()[0]]);
    let short_view = SequenceView {
        block_table: &short_table,
        ..view
    };
    assert!(matches!(
        cache.write_token(1, &short_view, 9, &row(1.0), &row(1.0)),
        Err(LserveError::InvalidArgument {
            what: "logical page",
            ..
        })
    ));
    // A view with a page id past the cache's capacity (6 pages).
    let foreign = BlockTable::from_pages(vec![0, 6]);
    let foreign_view = SequenceView {
        block_table: &foreign,
        ..view
    };
    assert!(matches!(
        cache.write_token(1, &foreign_view, 9, &row(1.0), &row(1.0)),
        Err(LserveError::PageOutOfRange {
            page: 6,
            capacity: 6
        })
    ));
    // A view whose slot is past the streaming store (2 slots); layer 0 has a streaming head.
    let far_view = SequenceView { slot: 2, ..view };
    assert!(matches!(
        cache.write_token(0, &far_view, 9, &row(1.0), &row(1.0)),
        Err(LserveError::InvalidArgument { what: "slot", .. })
    ));
    assert_eq!(cache, before, "a failed write changed the cache");
    // What was written reads back, on the dense head and (held) on the streaming head.
    assert_eq!(cache.key(0, &view, 0, 3).unwrap(), &row(3.0)[..64]);
    assert_eq!(cache.value(0, &view, 1, 9).unwrap(), &row(-9.0)[..64]);
}

#[test]
fn host_cache_accessors_out_of_range_change_nothing() {
    let (mut mgr, mut cache) = setup();
    let a = mgr.add_sequence().unwrap();
    mgr.reserve(a, 10).unwrap();
    let view = mgr.view(a).unwrap();
    let before = cache.clone();
    // Reads: a KV head out of range, a layer out of range, a token that left the ring.
    assert!(matches!(
        cache.token(0, &view, 2, 0),
        Err(LserveError::InvalidArgument {
            what: "kv head",
            ..
        })
    ));
    assert!(matches!(
        cache.key(5, &view, 0, 0),
        Err(LserveError::InvalidArgument { what: "layer", .. })
    ));
    assert!(matches!(
        cache.key(0, &view, 1, 4), // sinks 0..2, ring 6..10
        Err(LserveError::TokenNotStored {
            position: 4,
            len: 10
        })
    ));
    // Low-level rows: page, head, token, logical page, slot, row out of range.
    let dense = cache.dense_mut(0).unwrap();
    assert!(matches!(
        dense.kv_rows_mut(6, 0, 0),
        Err(LserveError::PageOutOfRange {
            page: 6,
            capacity: 6
        })
    ));
    assert!(matches!(
        dense.kv_rows_mut(0, 1, 0), // layer 0 has one dense head
        Err(LserveError::InvalidArgument {
            what: "dense head",
            ..
        })
    ));
    assert!(matches!(
        dense.kv_rows_mut(0, 0, 8),
        Err(LserveError::InvalidArgument {
            what: "token in page",
            ..
        })
    ));
    assert!(matches!(
        dense.stats_mut(0, 0, 2), // 2 logical pages per page
        Err(LserveError::InvalidArgument {
            what: "logical page in page",
            ..
        })
    ));
    let streaming = cache.streaming_mut(0).unwrap();
    assert!(matches!(
        streaming.kv_rows_mut(2, 0, 0),
        Err(LserveError::InvalidArgument { what: "slot", .. })
    ));
    assert!(matches!(
        streaming.kv_rows_mut(0, 0, 6), // 2 + 4 rows
        Err(LserveError::InvalidArgument {
            what: "streaming row",
            ..
        })
    ));
    assert!(cache.dense_mut(2).is_err() && cache.streaming_mut(2).is_err());
    assert_eq!(cache, before, "a failed access changed the cache");
}

#[test]
fn index_tables_addressed_out_of_range_change_nothing() {
    let (mgr, _) = setup();
    let mut t = IndexTables::for_manager(&mgr).unwrap();
    t.set(1, 1, 1, &[4, 0]).unwrap();
    let before = t.clone();
    for (layer, slot, head, what) in [
        (2, 0, 0, "layer"),
        (0, 2, 0, "slot"),
        (0, 0, 1, "dense head"), // layer 0 has one dense head
        (1, 0, 2, "dense head"),
    ] {
        assert!(matches!(
            t.set(layer, slot, head, &[1]),
            Err(LserveError::InvalidArgument { what: w, .. }) if w == what
        ));
        assert!(t.get(layer, slot, head).is_err());
        assert!(t.clear(layer, slot, head).is_err());
    }
    assert!(matches!(
        t.clear_slot(2),
        Err(LserveError::InvalidArgument { what: "slot", .. })
    ));
    let l1 = t.layer(1).unwrap().clone();
    assert!(matches!(
        t.overwrite_layer(1, &l1.pages()[1..], l1.lens()),
        Err(LserveError::ShapeMismatch {
            what: "index table pages",
            ..
        })
    ));
    assert!(matches!(
        t.overwrite_layer(1, l1.pages(), &l1.lens()[1..]),
        Err(LserveError::ShapeMismatch {
            what: "index table lens",
            ..
        })
    ));
    assert!(matches!(
        t.overwrite_layer(3, l1.pages(), l1.lens()),
        Err(LserveError::InvalidArgument { what: "layer", .. })
    ));
    assert_eq!(t, before, "a failed table write changed the tables");
    assert_eq!(t.get(1, 1, 1).unwrap(), &[4, 0]);
}

#[test]
fn block_table_and_decode_iterators_reject_what_does_not_fit() {
    let table = BlockTable::from_pages(vec![4, 0, 9]);
    let before = table.clone();
    assert!(matches!(
        table.physical(3),
        Err(LserveError::InvalidArgument {
            what: "logical page",
            ..
        })
    ));
    // 3 pages of 16 hold 48 tokens: 49 need a fourth.
    assert!(matches!(
        dense_decode_pages(&table, 49, 16, None),
        Err(LserveError::InvalidArgument {
            what: "block table",
            ..
        })
    ));
    for sel in [&[1, 1][..], &[2, 0], &[3]] {
        assert!(matches!(
            dense_decode_pages(&table, 40, 16, Some(sel)),
            Err(LserveError::InvalidArgument {
                what: "page selection",
                ..
            })
        ));
    }
    assert!(matches!(
        dense_decode_pages(&table, 0, 16, None),
        Err(LserveError::Empty(_))
    ));
    assert!(matches!(
        dense_decode_pages(&table, 40, 0, None),
        Err(LserveError::InvalidConfig {
            field: "page_tokens",
            ..
        })
    ));
    assert!(matches!(
        streaming_decode_tokens(0, 4, 8),
        Err(LserveError::Empty(_))
    ));
    assert_eq!(table, before);
}

#[test]
fn prefill_blocks_past_the_sequence_or_with_a_mask_of_another_width_are_errors() {
    let shape = PrefillShape {
        kind: HeadKind::Streaming,
        seq_len: 300, // 5 blocks
        sink_tokens: 64,
        local_tokens: 128,
    };
    assert!(matches!(
        prefill_blocks(&shape, 5, None),
        Err(LserveError::InvalidArgument {
            what: "q_block",
            ..
        })
    ));
    let mask = BlockMask::new(1, 64 * 6, true).unwrap(); // 6 blocks wide
    let before = mask.clone();
    assert!(matches!(
        prefill_blocks(&shape, 0, Some(mask.row(0, 0).unwrap())),
        Err(LserveError::ShapeMismatch {
            what: "block mask row (KV blocks)",
            expected: 5,
            actual: 6
        })
    ));
    assert!(matches!(
        prefill_blocks(
            &PrefillShape {
                seq_len: 0,
                ..shape
            },
            0,
            None
        ),
        Err(LserveError::Empty(_))
    ));
    assert!(matches!(
        prefill_blocks(
            &PrefillShape {
                local_tokens: 0,
                ..shape
            },
            0,
            None
        ),
        Err(LserveError::InvalidConfig {
            field: "local_tokens",
            ..
        })
    ));
    assert_eq!(mask, before);
}

#[test]
fn a_reuse_interval_of_zero_is_an_error() {
    assert!(matches!(
        ReuseState::new(0),
        Err(LserveError::InvalidArgument {
            what: "reuse_interval",
            ..
        })
    ));
    assert_eq!(ReuseState::new(3).unwrap().interval(), 3);
}
