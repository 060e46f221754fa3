//! The host side of a decode step's ordering (CPU only): the manager's table generation changes
//! exactly when a block-table row or a slot's owner does, reservations for a step are all or
//! nothing, and a write plan made before such a change is refused with a typed error. The device
//! side of the same orders is in `gpu_step_order.rs`; the incremental table copies and the step
//! counters' mirror are unit-tested in `host/src/gpu/table_sync.rs`.

use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::gpu::KvWritePlan;
use lserve::head_pattern::HeadPattern;
use lserve::paging::KvCacheManager;
use lserve::LserveError;

/// 16-token pages, `capacity` pages, `slots` slots of at most 256 tokens.
fn manager(capacity: usize, slots: usize) -> KvCacheManager {
    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    let config = SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 16,
        token_budget: 32,
        sink_tokens: 4,
        local_tokens: 16,
        ..SparsityConfig::default()
    };
    KvCacheManager::new(g, HeadPattern::all_dense(g), config, capacity, slots, 256).unwrap()
}

#[test]
fn the_generation_changes_with_the_tables_only() {
    let mut mgr = manager(4, 2);
    let g0 = mgr.generation();
    let a = mgr.add_sequence().unwrap();
    let g1 = mgr.generation();
    assert_ne!(g1, g0, "a slot changed hands");
    mgr.reserve(a, 10).unwrap();
    let g2 = mgr.generation();
    assert_ne!(g2, g1, "page 0 opened");
    mgr.reserve(a, 6).unwrap();
    assert_eq!(mgr.generation(), g2, "still page 0");
    mgr.advance_decode_step(a).unwrap();
    assert_eq!(mgr.generation(), g2, "a step counter is not a table");
    // Failed calls change nothing, the generation included.
    let before = mgr.clone();
    assert!(matches!(
        mgr.reserve(a, 4 * 16),
        Err(LserveError::PoolExhausted { .. })
    ));
    assert!(matches!(
        mgr.reserve(a, 300),
        Err(LserveError::SequenceTooLong { .. })
    ));
    mgr.free_sequence(a).unwrap();
    let g3 = mgr.generation();
    assert_ne!(g3, g2, "the slot was freed");
    assert!(matches!(
        mgr.free_sequence(a),
        Err(LserveError::UnknownSequence(_))
    ));
    assert_eq!(mgr.generation(), g3);
    assert_ne!(before.generation(), g2, "a clone is another manager");
    assert_ne!(before, mgr);
}

#[test]
fn reserving_a_steps_tokens_is_all_or_nothing() {
    let mut mgr = manager(3, 3);
    let (a, b, c) = (
        mgr.add_sequence().unwrap(),
        mgr.add_sequence().unwrap(),
        mgr.add_sequence().unwrap(),
    );
    mgr.reserve(a, 16).unwrap();
    mgr.reserve(b, 16).unwrap();
    mgr.reserve(c, 15).unwrap();
    let before = mgr.clone();
    let generation = mgr.generation();
    // `a` and `b` each open a page, one is free.
    assert!(matches!(
        mgr.reserve_each(&[c, a, b], 1),
        Err(LserveError::PoolExhausted { needed: 2, free: 0 })
    ));
    assert!(matches!(
        mgr.reserve_each(&[c, c], 1),
        Err(LserveError::InvalidArgument { .. })
    ));
    assert!(matches!(
        mgr.reserve_each(&[c], 0),
        Err(LserveError::Empty(_))
    ));
    assert!(matches!(
        mgr.reserve_each(&[c], 300),
        Err(LserveError::SequenceTooLong { .. })
    ));
    mgr.free_sequence(b).unwrap();
    let freed = mgr.clone();
    let freed_generation = mgr.generation();
    assert!(matches!(
        mgr.reserve_each(&[c, b], 1),
        Err(LserveError::UnknownSequence(_))
    ));
    assert_eq!(mgr, freed);
    assert_eq!(mgr.generation(), freed_generation);
    assert_ne!(before, freed);
    assert_ne!(generation, freed_generation);
    // `c` stays in its page; `a` takes the freed one.
    mgr.reserve_each(&[c, a], 1).unwrap();
    assert_eq!((mgr.len(a).unwrap(), mgr.len(c).unwrap()), (17, 16));
    assert_eq!(mgr.pool().free_pages(), 0);
}

/// The first misuse order: tokens reserved across a page boundary after the writes were
/// planned, with no sync in between. The plan no longer describes the tables.
#[test]
fn a_write_plan_made_before_a_page_opened_is_stale() {
    let mut mgr = manager(8, 2);
    let a = mgr.add_sequence().unwrap();
    let b = mgr.add_sequence().unwrap();
    let prompt_a = mgr.reserve(a, 20).unwrap();
    let prompt_b = mgr.reserve(b, 5).unwrap();
    let plan = KvWritePlan::new(&mgr, &[(a, prompt_a.clone()), (b, prompt_b)]).unwrap();
    plan.check_current(&mgr).unwrap();
    mgr.reserve(b, 3).unwrap(); // within page 0 of `b`
    plan.check_current(&mgr).unwrap();
    let pool = mgr.pool().clone();
    mgr.reserve(a, 16).unwrap(); // opens page 2 of `a`
    assert_ne!(mgr.pool(), &pool);
    assert!(matches!(
        plan.check_current(&mgr),
        Err(LserveError::StaleTables { what: "plan", .. })
    ));
    // A plan of the other sequence alone is unaffected.
    let only_b = KvWritePlan::new(&mgr, &[(b, 0..8)]).unwrap();
    mgr.reserve(a, 16).unwrap();
    only_b.check_current(&mgr).unwrap();
}

/// The second misuse order: a sequence freed and another added in its slot, with no sync in
/// between. A plan for the old owner is refused; the new owner's is not.
#[test]
fn a_write_plan_of_a_freed_slot_is_stale() {
    let mut mgr = manager(8, 1);
    let a = mgr.add_sequence().unwrap();
    let prompt = mgr.reserve(a, 20).unwrap();
    let plan = KvWritePlan::new(&mgr, &[(a, prompt)]).unwrap();
    mgr.free_sequence(a).unwrap();
    let b = mgr.add_sequence().unwrap();
    assert_eq!(mgr.slot(b).unwrap(), 0, "the slot `a` held");
    let prompt = mgr.reserve(b, 20).unwrap();
    assert!(matches!(
        plan.check_current(&mgr),
        Err(LserveError::StaleTables { what: "plan", .. })
    ));
    KvWritePlan::new(&mgr, &[(b, prompt)])
        .unwrap()
        .check_current(&mgr)
        .unwrap();
}

/// A plan is tied to the manager it was made from: a clone (same content) refuses it.
#[test]
fn a_write_plan_belongs_to_its_manager() {
    let mut mgr = manager(8, 1);
    let a = mgr.add_sequence().unwrap();
    let prompt = mgr.reserve(a, 20).unwrap();
    let plan = KvWritePlan::new(&mgr, &[(a, prompt)]).unwrap();
    let clone = mgr.clone();
    assert_eq!(clone, mgr);
    assert!(matches!(
        plan.check_current(&clone),
        Err(LserveError::StaleTables { what: "plan", .. })
    ));
    plan.check_current(&mgr).unwrap();
}
