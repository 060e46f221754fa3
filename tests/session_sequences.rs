//! The session's host half without a GPU (`lserve::session::Sequences`, `KvMemory`): the
//! prefill reservation is all or nothing, each bad input is its typed error and changes neither
//! the manager nor any sequence's state, a later chunk of a sequence is refused as chunked
//! prefill, decode batches are checked before anything is reserved, and the memory sizes follow
//! the pool and slots in use.

use lserve::config::SparsityConfig;
use lserve::dtype::DType;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::KvCacheManager;
use lserve::session::{KvMemory, SequenceState, Sequences};
use lserve::LserveError;

/// One layer of two KV heads (one dense, one streaming), 16-token pages, `pages` in the pool,
/// 3 slots, sequences of up to 256 tokens.
fn sequences(pages: usize) -> Sequences {
    let g = ModelGeometry::new(1, 4, 2, 64).unwrap();
    let pattern =
        HeadPattern::from_kinds(g, vec![vec![HeadKind::Dense, HeadKind::Streaming]]).unwrap();
    let config = SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 16,
        token_budget: 32,
        sink_tokens: 16,
        local_tokens: 32,
        dynamic_min_len: 64,
        ..SparsityConfig::default()
    };
    Sequences::new(KvCacheManager::new(g, pattern, config, pages, 3, 256).unwrap()).unwrap()
}

/// Runs `f`, which must fail, and checks that it changed neither the manager nor any state.
fn fails_unchanged<T: std::fmt::Debug>(
    seqs: &mut Sequences,
    f: impl FnOnce(&mut Sequences) -> lserve::Result<T>,
) -> LserveError {
    let manager = seqs.manager().clone();
    let states: Vec<_> = seqs
        .live()
        .into_iter()
        .map(|s| (s, seqs.state(s).unwrap()))
        .collect();
    let err = f(seqs).expect_err("the call must fail");
    assert_eq!(
        seqs.manager(),
        &manager,
        "manager changed by a failing call: {err}"
    );
    let after: Vec<_> = seqs
        .live()
        .into_iter()
        .map(|s| (s, seqs.state(s).unwrap()))
        .collect();
    assert_eq!(after, states, "states changed by a failing call: {err}");
    err
}

#[test]
fn a_manager_with_sequences_is_refused() {
    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    let mut mgr = KvCacheManager::new(
        g,
        HeadPattern::all_dense(g),
        SparsityConfig::default(),
        4,
        2,
        1024,
    )
    .unwrap();
    mgr.add_sequence().unwrap();
    assert!(matches!(
        Sequences::new(mgr),
        Err(LserveError::InvalidArgument {
            what: "manager",
            ..
        })
    ));
}

#[test]
fn prefill_reservation_is_all_or_nothing() {
    let mut seqs = sequences(10);
    let (a, b, c) = (
        seqs.add().unwrap(),
        seqs.add().unwrap(),
        seqs.add().unwrap(),
    );
    // 7 + 4 pages needed, 10 free: nothing reserved.
    let err = fails_unchanged(&mut seqs, |s| s.reserve_prefill(&[(a, 100), (b, 64)]));
    assert!(
        matches!(
            err,
            LserveError::PoolExhausted {
                needed: 11,
                free: 10
            }
        ),
        "{err}"
    );
    // One chunk past max_seq_len: nothing reserved for the others either.
    let err = fails_unchanged(&mut seqs, |s| s.reserve_prefill(&[(a, 16), (b, 257)]));
    assert!(
        matches!(err, LserveError::SequenceTooLong { len: 257, max: 256 }),
        "{err}"
    );
    let ranges = seqs.reserve_prefill(&[(b, 64), (a, 80)]).unwrap();
    assert_eq!(ranges, vec![(b, 0..64), (a, 0..80)]);
    assert_eq!(seqs.manager().len(a).unwrap(), 80);
    assert_eq!(seqs.manager().pool().free_pages(), 1);
    assert_eq!(seqs.state(a).unwrap(), SequenceState::Incomplete);
    assert_eq!(seqs.state(b).unwrap(), SequenceState::Incomplete);
    assert_eq!(seqs.state(c).unwrap(), SequenceState::Ready);
}

#[test]
fn bad_prefill_chunks_are_typed_errors_that_change_nothing() {
    let mut seqs = sequences(32);
    let (a, b) = (seqs.add().unwrap(), seqs.add().unwrap());
    let err = fails_unchanged(&mut seqs, |s| s.reserve_prefill(&[]));
    assert!(matches!(err, LserveError::Empty(_)), "{err}");
    let err = fails_unchanged(&mut seqs, |s| s.reserve_prefill(&[(a, 10), (b, 0)]));
    assert!(matches!(err, LserveError::Empty(_)), "{err}");
    let err = fails_unchanged(&mut seqs, |s| s.reserve_prefill(&[(a, 10), (a, 10)]));
    assert!(
        matches!(
            err,
            LserveError::InvalidArgument {
                what: "prefill chunks",
                ..
            }
        ),
        "{err}"
    );
    let ghost = {
        let g = seqs.add().unwrap();
        seqs.free(g).unwrap();
        g
    };
    let err = fails_unchanged(&mut seqs, |s| s.reserve_prefill(&[(a, 10), (ghost, 10)]));
    assert!(matches!(err, LserveError::UnknownSequence(_)), "{err}");
}

#[test]
fn a_later_chunk_waits_for_the_prefill_before_it() {
    let mut seqs = sequences(32);
    let (a, b) = (seqs.add().unwrap(), seqs.add().unwrap());
    seqs.reserve_prefill(&[(a, 40)]).unwrap();
    // `a` holds 40 tokens its prefill has not written (no finish on the host half alone): a
    // second chunk is refused, with or without another sequence's first, nothing reserved.
    let err = fails_unchanged(&mut seqs, |s| s.reserve_prefill(&[(b, 16), (a, 24)]));
    assert!(
        matches!(
            err,
            LserveError::InvalidArgument {
                what: "sequence",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(seqs.manager().len(b).unwrap(), 0);
    assert_eq!(seqs.state(a).unwrap(), SequenceState::Incomplete);
}

#[test]
fn a_later_chunk_of_any_size_is_a_typed_error() {
    let mut seqs = sequences(32);
    let a = seqs.add().unwrap();
    seqs.reserve_prefill(&[(a, 40)]).unwrap();
    // Sizes whose end past the 40 tokens held overflows `usize`, and one that fits: `a` is
    // Incomplete (its prefill never finished), which is checked first.
    for n in [usize::MAX, usize::MAX - 39, 1 << 40] {
        let err = fails_unchanged(&mut seqs, |s| s.reserve_prefill(&[(a, n)]));
        assert!(
            matches!(
                err,
                LserveError::InvalidArgument {
                    what: "sequence",
                    ..
                }
            ),
            "{n}: {err}"
        );
    }
}

#[test]
fn decode_batches_are_checked_before_anything_is_reserved() {
    let mut seqs = sequences(32);
    let (a, b) = (seqs.add().unwrap(), seqs.add().unwrap());
    seqs.check_decode(&[a, b]).unwrap();
    let err = fails_unchanged(&mut seqs, |s| s.check_decode(&[]));
    assert!(matches!(err, LserveError::Empty(_)), "{err}");
    let err = fails_unchanged(&mut seqs, |s| s.check_decode(&[b, a, b]));
    assert!(
        matches!(err, LserveError::InvalidArgument { what: "batch", .. }),
        "{err}"
    );
    // A sequence whose prefill has not finished (here: never will) cannot decode.
    seqs.reserve_prefill(&[(a, 20)]).unwrap();
    let err = fails_unchanged(&mut seqs, |s| s.check_decode(&[b, a]));
    assert!(
        matches!(
            err,
            LserveError::InvalidArgument {
                what: "sequence",
                ..
            }
        ),
        "{err}"
    );
    // Freeing it is the way out; its pages go back.
    seqs.free(a).unwrap();
    assert_eq!(seqs.manager().pool().free_pages(), 32);
    assert!(matches!(
        seqs.state(a),
        Err(LserveError::UnknownSequence(_))
    ));
    assert!(matches!(seqs.free(a), Err(LserveError::UnknownSequence(_))));
    seqs.check_decode(&[b]).unwrap();
    assert_eq!(seqs.live(), vec![b]);
}

#[test]
fn slots_run_out_and_come_back() {
    let mut seqs = sequences(32);
    let ids: Vec<_> = (0..3).map(|_| seqs.add().unwrap()).collect();
    let err = fails_unchanged(&mut seqs, |s| s.add());
    assert!(matches!(err, LserveError::NoFreeSlot { slots: 3 }), "{err}");
    seqs.free(ids[1]).unwrap();
    let d = seqs.add().unwrap();
    assert!(!ids.contains(&d), "ids are never reused");
    assert_eq!(seqs.manager().slot(d).unwrap(), 1);
}

#[test]
fn kv_memory_follows_pages_and_slots_in_use() {
    let mut seqs = sequences(10);
    let m0 = KvMemory::of(seqs.manager(), DType::BF16);
    // Dense head: 16 tokens of K and V plus one logical page's kmin and kmax, 64 channels, 2
    // bytes. Streaming head: 16 + 32 rows of K and V.
    assert_eq!(m0.dense_page_bytes, (16 + 1) * 64 * 2 * 2);
    assert_eq!(m0.streaming_slot_bytes, 48 * 64 * 2 * 2);
    assert_eq!(
        m0.allocated_bytes,
        10 * m0.dense_page_bytes + 3 * m0.streaming_slot_bytes
    );
    assert_eq!(m0.used_bytes, 0);
    let a = seqs.add().unwrap();
    seqs.reserve_prefill(&[(a, 33)]).unwrap(); // 3 pages
    let m = KvMemory::of(seqs.manager(), DType::F16);
    assert_eq!(
        m.used_bytes,
        3 * m.dense_page_bytes + m.streaming_slot_bytes
    );
    assert_eq!(m.allocated_bytes, m0.allocated_bytes);
}
