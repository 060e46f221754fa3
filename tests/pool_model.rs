//! Model-based property test of the paged KV cache: random add / reserve+write / free
//! sequences against a simple model of lengths and free pages.
//!
//! After every operation: no page leaked, none owned twice, free + owned == capacity, every
//! live sequence's K/V reads back intact (dense pages; streaming sinks + ring holding the last
//! `local_tokens`), and a failed operation changed nothing (manager and cache compared whole).
//! Case counts come from `PROPTEST_CASES` (proptest's default config reads it).

use half::{bf16, f16};
use lserve::config::SparsityConfig;
use lserve::dtype::Element;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::{
    BlockTable, HostKvCache, KvCacheManager, SeqId, SequenceView, StreamingStore, PAD_PAGE,
};
use lserve::LserveError;
use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// The value of dimension `dim` of token `pos` of a sequence, per layer, KV head, K or V:
/// small integers (exact in bf16 and f16), rarely zero, different for every coordinate.
fn expected_value(
    seq: SeqId,
    pos: usize,
    layer: usize,
    head: usize,
    is_v: bool,
    dim: usize,
) -> f32 {
    let mut h = (seq.get() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (pos as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ ((layer * 8 + head) as u64 * 2 + is_v as u64).wrapping_mul(0x1656_67B1_9E37_79F9);
    h ^= h >> 29;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 32;
    ((h.wrapping_add(dim as u64 * 0x9E37)) >> 8) as f32 % 201.0 - 100.0
}

fn token_rows<E: Element>(
    g: &ModelGeometry,
    seq: SeqId,
    pos: usize,
    layer: usize,
) -> (Vec<E>, Vec<E>) {
    let row = |is_v| {
        (0..g.kv_heads())
            .flat_map(|h| {
                (0..g.head_dim())
                    .map(move |d| E::from_f32(expected_value(seq, pos, layer, h, is_v, d)))
            })
            .collect()
    };
    (row(false), row(true))
}

#[derive(Clone, Debug)]
enum Op {
    Add,
    /// Reserve `n` tokens for live sequence `which % live` and write them in a shuffled order.
    Reserve {
        which: usize,
        n: usize,
        order_seed: u64,
    },
    Free {
        which: usize,
    },
    /// Free the sequence freed last (again).
    FreeStale,
    /// A write past the sequence's length or with a wrong shape: must fail and change nothing.
    BadWrite {
        which: usize,
        past_end: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Add),
        5 => (any::<usize>(), 0..20usize, any::<u64>()).prop_map(|(which, n, order_seed)| Op::Reserve { which, n, order_seed }),
        2 => any::<usize>().prop_map(|which| Op::Free { which }),
        1 => Just(Op::FreeStale),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(which, past_end)| Op::BadWrite { which, past_end }),
    ]
}

#[derive(Clone, Debug)]
struct Setup {
    geometry: ModelGeometry,
    kinds: Vec<Vec<HeadKind>>,
    config: SparsityConfig,
    capacity: usize,
    max_sequences: usize,
    max_seq_len: usize,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        1..=2usize,
        1..=2usize,
        1..=2usize,
        0..2usize,
        0..=5usize,
        1..=10usize,
        1..=12usize,
        1..=3usize,
        1..=48usize,
    )
        .prop_flat_map(
            |(layers, kv, group, page_pow, sink, local, capacity, max_sequences, max_seq_len)| {
                let kinds = proptest::collection::vec(
                    proptest::collection::vec(
                        prop_oneof![Just(HeadKind::Dense), Just(HeadKind::Streaming)],
                        kv,
                    ),
                    layers,
                );
                kinds.prop_map(move |kinds| {
                    let page_tokens = 4 << page_pow;
                    Setup {
                        geometry: ModelGeometry::new(layers, kv * group, kv, 64).unwrap(),
                        kinds,
                        config: SparsityConfig {
                            sink_tokens: sink,
                            local_tokens: local,
                            page_tokens,
                            logical_page_tokens: page_tokens / 2,
                            token_budget: page_tokens,
                            ..SparsityConfig::default()
                        },
                        capacity,
                        max_sequences,
                        max_seq_len,
                    }
                })
            },
        )
}

/// The model: live sequences with their lengths, and ids that were freed.
struct Model {
    live: Vec<(SeqId, usize)>,
    freed: Vec<SeqId>,
}

impl Model {
    fn pages_used(&self, page_tokens: usize) -> usize {
        self.live
            .iter()
            .map(|&(_, len)| len.div_ceil(page_tokens))
            .sum()
    }
}

fn check_invariants(s: &Setup, mgr: &KvCacheManager, cache: &HostKvCache<bf16>, model: &Model) {
    let p = s.config.page_tokens;
    let pool = mgr.pool();
    assert_eq!(pool.capacity(), s.capacity);
    assert_eq!(
        mgr.sequences(),
        model.live.iter().map(|l| l.0).collect::<Vec<_>>()
    );
    // Ownership: each live page owned once, allocated, and free + owned == capacity.
    let mut owner = vec![None; s.capacity];
    let mut slots = vec![false; s.max_sequences];
    for &(seq, len) in &model.live {
        assert_eq!(mgr.len(seq).unwrap(), len);
        let table = mgr.block_table(seq).unwrap();
        assert_eq!(table.len(), len.div_ceil(p));
        for &page in table.pages() {
            assert!(
                pool.is_allocated(page),
                "page {page} of {seq:?} is not allocated"
            );
            assert!(
                owner[page as usize].replace(seq).is_none(),
                "page {page} owned twice"
            );
        }
        let slot = mgr.slot(seq).unwrap() as usize;
        assert!(
            !std::mem::replace(&mut slots[slot], true),
            "slot {slot} shared"
        );
    }
    let owned = owner.iter().filter(|o| o.is_some()).count();
    assert_eq!(owned, model.pages_used(p));
    assert_eq!(pool.free_pages() + owned, s.capacity, "leaked pages");
    assert_eq!(
        (0..s.capacity as u32)
            .filter(|&pg| pool.is_allocated(pg))
            .count(),
        owned
    );
    // Device-shaped block tables agree.
    let dev = mgr.device_block_tables();
    for &(seq, len) in &model.live {
        let slot = mgr.slot(seq).unwrap() as usize;
        let row = &dev.pages[slot * dev.max_pages_per_seq..(slot + 1) * dev.max_pages_per_seq];
        let n = dev.num_pages[slot] as usize;
        assert_eq!(&row[..n], mgr.block_table(seq).unwrap().pages());
        assert!(row[n..].iter().all(|&x| x == PAD_PAGE));
        assert_eq!(dev.seq_lens[slot] as usize, len);
    }
    // Contents.
    for &(seq, len) in &model.live {
        let view = mgr.view(seq).unwrap();
        check_contents(s, cache, seq, &view, len);
    }
}

#[allow(clippy::needless_range_loop)]
fn check_contents(
    s: &Setup,
    cache: &HostKvCache<bf16>,
    seq: SeqId,
    view: &SequenceView<'_>,
    len: usize,
) {
    let g = &s.geometry;
    let (sink, local) = (s.config.sink_tokens, s.config.local_tokens);
    for layer in 0..g.layers() {
        for head in 0..g.kv_heads() {
            let held = |pos| {
                s.kinds[layer][head] == HeadKind::Dense
                    || StreamingStore::is_resident(pos, len, sink, local)
            };
            for pos in 0..len + 1 {
                match cache.token(layer, view, head, pos) {
                    Ok((k, v)) => {
                        assert!(
                            pos < len && held(pos),
                            "layer {layer} head {head} pos {pos} should not be readable"
                        );
                        for d in 0..g.head_dim() {
                            assert_eq!(
                                k[d].to_f32(),
                                expected_value(seq, pos, layer, head, false, d),
                                "K {seq:?} l{layer} h{head} pos {pos} d{d}"
                            );
                            assert_eq!(
                                v[d].to_f32(),
                                expected_value(seq, pos, layer, head, true, d),
                                "V {seq:?} l{layer} h{head} pos {pos} d{d}"
                            );
                        }
                    }
                    Err(LserveError::TokenNotStored { position, len: l }) => {
                        assert_eq!((position, l), (pos, len));
                        assert!(
                            pos >= len || !held(pos),
                            "layer {layer} head {head} pos {pos} lost"
                        );
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
        }
    }
}

fn run_case(s: Setup, ops: Vec<Op>) {
    let pattern = HeadPattern::from_kinds(s.geometry, s.kinds.clone()).unwrap();
    let mut mgr = KvCacheManager::new(
        s.geometry,
        pattern,
        s.config,
        s.capacity,
        s.max_sequences,
        s.max_seq_len,
    )
    .unwrap();
    let mut cache = HostKvCache::<bf16>::for_manager(&mgr).unwrap();
    let mut model = Model {
        live: Vec::new(),
        freed: Vec::new(),
    };
    let p = s.config.page_tokens;
    for op in ops {
        let (mgr_before, cache_before) = (mgr.clone(), cache.clone());
        let failed = match op {
            Op::Add => {
                let r = mgr.add_sequence();
                if model.live.len() < s.max_sequences {
                    model.live.push((r.unwrap(), 0));
                    false
                } else {
                    assert!(matches!(r, Err(LserveError::NoFreeSlot { .. })), "{r:?}");
                    true
                }
            }
            Op::Reserve {
                which,
                n,
                order_seed,
            } => {
                if model.live.is_empty() {
                    continue;
                }
                let i = which % model.live.len();
                let (seq, len) = model.live[i];
                let new_pages = (len + n).div_ceil(p) - len.div_ceil(p);
                let free = s.capacity - model.pages_used(p);
                let r = mgr.reserve(seq, n);
                if n == 0 {
                    assert!(matches!(r, Err(LserveError::Empty(_))), "{r:?}");
                    true
                } else if len + n > s.max_seq_len {
                    assert!(
                        matches!(r, Err(LserveError::SequenceTooLong { .. })),
                        "{r:?}"
                    );
                    true
                } else if new_pages > free {
                    match r {
                        Err(LserveError::PoolExhausted { needed, free: f }) => {
                            assert_eq!((needed, f), (new_pages, free))
                        }
                        other => panic!("expected PoolExhausted, got {other:?}"),
                    }
                    true
                } else {
                    assert_eq!(r.unwrap(), len..len + n);
                    model.live[i].1 = len + n;
                    // Write every new token of every layer, in a random order.
                    let mut writes: Vec<(usize, usize)> = (0..s.geometry.layers())
                        .flat_map(|l| (len..len + n).map(move |pos| (l, pos)))
                        .collect();
                    writes.shuffle(&mut rand::rngs::StdRng::seed_from_u64(order_seed));
                    let view = mgr.view(seq).unwrap();
                    for (layer, pos) in writes {
                        let (k, v) = token_rows::<bf16>(&s.geometry, seq, pos, layer);
                        cache.write_token(layer, &view, pos, &k, &v).unwrap();
                    }
                    false
                }
            }
            Op::Free { which } => {
                if model.live.is_empty() {
                    continue;
                }
                let (seq, _) = model.live.remove(which % model.live.len());
                mgr.free_sequence(seq).unwrap();
                model.freed.push(seq);
                false
            }
            Op::FreeStale => {
                let Some(&seq) = model.freed.last() else {
                    continue;
                };
                let r = mgr.free_sequence(seq);
                assert!(
                    matches!(r, Err(LserveError::UnknownSequence(id)) if id == seq.get()),
                    "{r:?}"
                );
                true
            }
            Op::BadWrite { which, past_end } => {
                if model.live.is_empty() {
                    continue;
                }
                let (seq, len) = model.live[which % model.live.len()];
                let view = mgr.view(seq).unwrap();
                let (mut k, v) = token_rows::<bf16>(&s.geometry, seq, len, 0);
                let r = if past_end || len == 0 {
                    cache.write_token(0, &view, len, &k, &v)
                } else {
                    k.pop();
                    cache.write_token(0, &view, len - 1, &k, &v)
                };
                match r {
                    Err(LserveError::TokenNotStored { .. }) if past_end || len == 0 => {}
                    Err(LserveError::ShapeMismatch { what: "k", .. }) if !past_end => {}
                    other => panic!("unexpected {other:?}"),
                }
                true
            }
        };
        if failed {
            assert!(mgr == mgr_before, "a failed operation changed the manager");
            assert!(
                cache == cache_before,
                "a failed operation changed the cache"
            );
        }
        check_invariants(&s, &mgr, &cache, &model);
    }
}

proptest! {
    #[test]
    fn cache_matches_model(s in setup(), ops in proptest::collection::vec(op(), 1..32)) {
        run_case(s, ops);
    }
}

fn small_setup() -> (ModelGeometry, HeadPattern, SparsityConfig) {
    let g = ModelGeometry::new(2, 4, 2, 64).unwrap();
    let pattern =
        HeadPattern::from_kinds(g, vec![vec![HeadKind::Dense, HeadKind::Streaming]; 2]).unwrap();
    let config = SparsityConfig {
        sink_tokens: 2,
        local_tokens: 5,
        page_tokens: 8,
        logical_page_tokens: 4,
        token_budget: 16,
        ..Default::default()
    };
    (g, pattern, config)
}

#[test]
fn exhaustion_is_an_error_that_changes_nothing() {
    let (g, pattern, config) = small_setup();
    let mut mgr = KvCacheManager::new(g, pattern, config, 5, 3, 1000).unwrap();
    let a = mgr.add_sequence().unwrap();
    let b = mgr.add_sequence().unwrap();
    mgr.reserve(a, 17).unwrap(); // 3 pages
    mgr.reserve(b, 9).unwrap(); // 2 pages: pool full
    assert_eq!(mgr.pool().free_pages(), 0);
    let before = mgr.clone();
    for (seq, n) in [(a, 8), (b, 8), (a, 100)] {
        match mgr.reserve(seq, n) {
            Err(LserveError::PoolExhausted { needed, free: 0 }) => assert!(needed >= 1),
            other => panic!("expected PoolExhausted, got {other:?}"),
        }
        assert_eq!(mgr, before);
    }
    // Within the last page there is room without a new page.
    mgr.reserve(a, 7).unwrap();
    mgr.reserve(b, 7).unwrap();
    assert_eq!((mgr.len(a).unwrap(), mgr.len(b).unwrap()), (24, 16));
    assert!(mgr.reserve(b, 1).is_err());
    // A third sequence can start but not grow; freeing a lets it.
    let c = mgr.add_sequence().unwrap();
    let before = mgr.clone();
    assert!(matches!(
        mgr.reserve(c, 1),
        Err(LserveError::PoolExhausted { needed: 1, free: 0 })
    ));
    assert!(matches!(
        mgr.add_sequence(),
        Err(LserveError::NoFreeSlot { slots: 3 })
    ));
    assert_eq!(mgr, before, "a failed add or reserve changed the manager");
    mgr.free_sequence(a).unwrap();
    assert_eq!(mgr.pool().free_pages(), 3);
    assert_eq!(mgr.reserve(c, 24).unwrap(), 0..24);
    let before = mgr.clone();
    assert!(matches!(mgr.len(a), Err(LserveError::UnknownSequence(_))));
    assert!(matches!(
        mgr.free_sequence(a),
        Err(LserveError::UnknownSequence(_))
    ));
    assert!(matches!(
        mgr.reserve(a, 1),
        Err(LserveError::UnknownSequence(_))
    ));
    assert!(matches!(
        mgr.advance_decode_step(a),
        Err(LserveError::UnknownSequence(_))
    ));
    assert_eq!(mgr, before, "an operation on a dead id changed the manager");
}

#[test]
fn constructor_and_sequence_errors() {
    let (g, pattern, config) = small_setup();
    let new =
        |cap, seqs, max_len| KvCacheManager::new(g, pattern.clone(), config, cap, seqs, max_len);
    assert!(matches!(
        new(0, 1, 10),
        Err(LserveError::InvalidConfig { .. })
    ));
    assert!(matches!(
        new(4, 0, 10),
        Err(LserveError::InvalidConfig { .. })
    ));
    assert!(matches!(
        new(4, 1, 0),
        Err(LserveError::InvalidConfig { .. })
    ));
    let bad_config = SparsityConfig {
        token_budget: 12,
        ..config
    };
    assert!(KvCacheManager::new(g, pattern.clone(), bad_config, 4, 1, 10).is_err());
    let other = HeadPattern::all_dense(ModelGeometry::llama3_8b());
    assert!(matches!(
        KvCacheManager::new(g, other, config, 4, 1, 10),
        Err(LserveError::HeadPattern(_))
    ));
    let mut mgr = new(4, 1, 20).unwrap();
    let a = mgr.add_sequence().unwrap();
    let before = mgr.clone();
    assert!(matches!(
        mgr.reserve(a, 21),
        Err(LserveError::SequenceTooLong { len: 21, max: 20 })
    ));
    assert!(matches!(mgr.reserve(a, 0), Err(LserveError::Empty(_))));
    assert!(matches!(
        mgr.reserve(a, usize::MAX),
        Err(LserveError::SequenceTooLong { .. })
    ));
    assert_eq!(mgr, before, "a failed reservation changed the manager");
    mgr.reserve(a, 20).unwrap();
    let before = mgr.clone();
    assert!(matches!(
        mgr.reserve(a, 1),
        Err(LserveError::SequenceTooLong { len: 21, max: 20 })
    ));
    assert_eq!(mgr, before, "a failed reservation changed the manager");
    assert_eq!(mgr.decode_step(a).unwrap(), 0);
    assert_eq!(mgr.advance_decode_step(a).unwrap(), 1);
    assert_eq!(mgr.decode_step(a).unwrap(), 1);
    assert_eq!(mgr.max_pages_per_seq(), 3);
}

/// A reservation whose new length overflows `usize` is an error naming the real request (the
/// current length and the tokens asked for), not a saturated length, and changes nothing; the
/// same for `reserve_each`.
#[test]
fn reservation_overflowing_usize_reports_the_request() {
    let (g, pattern, config) = small_setup();
    let mut mgr = KvCacheManager::new(g, pattern, config, 4, 2, 20).unwrap();
    let a = mgr.add_sequence().unwrap();
    mgr.reserve(a, 5).unwrap();
    let before = mgr.clone();
    let n = usize::MAX - 1;
    for r in [mgr.reserve(a, n).map(|_| ()), mgr.reserve_each(&[a], n)] {
        match r {
            Err(LserveError::InvalidArgument { what, reason }) => {
                assert_eq!(what, "n_tokens");
                assert!(reason.contains(&n.to_string()), "{reason}");
                assert!(reason.contains(" 5 "), "{reason}");
            }
            other => panic!("expected InvalidArgument for n_tokens, got {other:?}"),
        }
        assert!(mgr == before, "a failed reservation changed the manager");
    }
    // Not overflowing but too long: the length it would reach.
    assert!(matches!(
        mgr.reserve(a, usize::MAX - 5),
        Err(LserveError::SequenceTooLong {
            len: usize::MAX,
            max: 20
        })
    ));
    assert!(mgr == before);
}

/// The ring at token level, for f16: after a long sequence is written token by token (decode
/// style), a streaming head holds exactly the sinks and the last `local_tokens`.
#[test]
fn streaming_ring_keeps_the_last_local_tokens_f16() {
    let (g, pattern, config) = small_setup();
    let mut mgr = KvCacheManager::new(g, pattern, config, 8, 2, 64).unwrap();
    let mut cache = HostKvCache::<f16>::for_manager(&mgr).unwrap();
    let a = mgr.add_sequence().unwrap();
    for step in 0..40 {
        let pos = mgr.reserve(a, 1).unwrap().start;
        assert_eq!(pos, step);
        let view = mgr.view(a).unwrap();
        for layer in 0..2 {
            let (k, v) = token_rows::<f16>(&g, a, pos, layer);
            cache.write_token(layer, &view, pos, &k, &v).unwrap();
        }
        let len = pos + 1;
        for layer in 0..2 {
            for t in 0..len {
                let resident = t < 2 || t + 5 >= len;
                let dense = cache.key(layer, &view, 0, t).unwrap();
                assert_eq!(dense[7].to_f32(), expected_value(a, t, layer, 0, false, 7));
                match cache.value(layer, &view, 1, t) {
                    Ok(row) => {
                        assert!(resident, "t {t} len {len}");
                        for (d, x) in row.iter().enumerate() {
                            assert_eq!(x.to_f32(), expected_value(a, t, layer, 1, true, d));
                        }
                    }
                    Err(LserveError::TokenNotStored { .. }) => {
                        assert!(!resident, "t {t} len {len}")
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
    }
    // Low-level access agrees with the routed readers.
    let view = mgr.view(a).unwrap();
    let page = view.block_table.physical(3).unwrap();
    assert_eq!(
        cache.dense(1).unwrap().key(page, 0, 5).unwrap(),
        cache.key(1, &view, 0, 3 * 8 + 5).unwrap()
    );
    assert_eq!(
        cache
            .streaming(1)
            .unwrap()
            .key(view.slot, 0, mgr.streaming_store().row_of_token(37))
            .unwrap(),
        cache.key(1, &view, 1, 37).unwrap()
    );
    // Statistics rows are addressable and writable.
    let (kmin, kmax) = cache.dense_mut(0).unwrap().stats_mut(page, 0, 1).unwrap();
    kmin.fill(f16::from_f32(-1.0));
    kmax.fill(f16::from_f32(2.0));
    let (kmin, kmax) = cache.dense(0).unwrap().stats(page, 0, 1).unwrap();
    assert_eq!((kmin[0].to_f32(), kmax[63].to_f32()), (-1.0, 2.0));
    assert!(cache.dense(0).unwrap().stats(page, 0, 2).is_err()); // 2 logical pages per page
    assert!(cache.dense(0).unwrap().key(8, 0, 0).is_err()); // capacity 8
    assert!(cache.dense(2).is_err());
}

/// An empty ring and ring sizes past `usize` are `InvalidConfig`, never a division by zero or an
/// overflow panic; residency near `usize::MAX` does not overflow.
#[test]
fn streaming_store_rejects_an_empty_or_overflowing_ring() {
    assert!(matches!(
        StreamingStore::ring_row(7, 2, 0),
        Err(LserveError::InvalidConfig {
            field: "local_tokens",
            ..
        })
    ));
    assert_eq!(StreamingStore::ring_row(7, 2, 3).unwrap(), 2 + (7 - 2) % 3);
    assert!(matches!(
        StreamingStore::new(1, 2, 0),
        Err(LserveError::InvalidConfig { .. })
    ));
    for (sink, local) in [(usize::MAX, 1), (1, usize::MAX), (usize::MAX, usize::MAX)] {
        assert!(matches!(
            StreamingStore::new(1, sink, local),
            Err(LserveError::InvalidConfig { .. })
        ));
    }
    let big = usize::MAX;
    assert!(StreamingStore::is_resident(big - 1, big, 0, 1));
    assert!(!StreamingStore::is_resident(big - 2, big, 0, 1));
    assert!(StreamingStore::is_resident(big - 8, big, 0, big));
}

/// A token position past `u32` (the device layouts' positions) is an error for writes and
/// reads, never truncated onto another row; `u32::MAX` itself is stored.
#[test]
fn host_cache_positions_past_u32_are_errors() {
    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    let pattern = HeadPattern::from_kinds(g, vec![vec![HeadKind::Streaming; 2]]).unwrap();
    let (_, _, config) = small_setup();
    let mut cache = HostKvCache::<bf16>::new(&pattern, &config, 1, 1).unwrap();
    let table = BlockTable::from_pages(Vec::new());
    let row = |x: f32| vec![bf16::from_f32(x); 2 * 64];
    // Past u32: a truncating cache would write sink row 1.
    let pos = (1usize << 32) + 1;
    let view = SequenceView {
        slot: 0,
        len: pos + 1,
        block_table: &table,
    };
    let before = cache.clone();
    assert!(matches!(
        cache.write_token(0, &view, pos, &row(1.0), &row(2.0)),
        Err(LserveError::InvalidArgument { what: "pos", .. })
    ));
    assert_eq!(cache, before);
    assert!(matches!(
        cache.token(0, &view, 0, pos),
        Err(LserveError::InvalidArgument { what: "pos", .. })
    ));
    // The last position that fits.
    let pos = u32::MAX as usize;
    let view = SequenceView {
        slot: 0,
        len: pos + 1,
        block_table: &table,
    };
    cache
        .write_token(0, &view, pos, &row(3.0), &row(4.0))
        .unwrap();
    let (k, v) = cache.token(0, &view, 1, pos).unwrap();
    assert_eq!((k, v), (&row(3.0)[..64], &row(4.0)[..64]));
}

/// A cache whose K/V buffers would overflow is `InvalidConfig` before anything is allocated,
/// never an overflow panic.
#[test]
fn host_cache_buffer_sizes_that_overflow_are_errors() {
    // Capacity x dense heads x N_P x D = 2^16 x 2^16 x 2^25 x 2^7 = 2^64 elements.
    let g = ModelGeometry::new(1, 1 << 16, 1 << 16, 128).unwrap();
    let config = SparsityConfig {
        page_tokens: 1 << 25,
        logical_page_tokens: 1 << 25,
        token_budget: 1 << 25,
        ..Default::default()
    };
    config.validate().unwrap();
    let pattern = HeadPattern::all_dense(g);
    assert!(matches!(
        HostKvCache::<bf16>::new(&pattern, &config, 1 << 16, 1),
        Err(LserveError::InvalidConfig { .. })
    ));
    // Streaming: slots x heads x (sink + local) x D = 2^9 x 2^16 x 2^31 x 2^7 = 2^63 elements
    // (a count that fits usize) of 2 bytes each: past isize::MAX bytes.
    let streaming = HeadPattern::from_kinds(g, vec![vec![HeadKind::Streaming; 1 << 16]]).unwrap();
    let config = SparsityConfig {
        sink_tokens: 1 << 30,
        local_tokens: 1 << 30,
        ..SparsityConfig::default()
    };
    assert!(matches!(
        HostKvCache::<bf16>::new(&streaming, &config, 1, 1 << 9),
        Err(LserveError::InvalidConfig { .. })
    ));
}
