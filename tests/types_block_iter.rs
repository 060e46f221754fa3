//! Block iterators against brute force over the token-level masks.

use lserve::block_iter::{
    dense_decode_pages, num_blocks, prefill_blocks, streaming_decode_tokens, token_visible,
    BlockCoverage, BlockMask, PrefillShape, BLOCK_KV, BLOCK_Q,
};
use lserve::head_pattern::HeadKind;
use lserve::paging::{BlockTable, StreamingStore};
use lserve::LserveError;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Brute force: (visible pairs, invisible pairs) of the tile, clipped to the sequence.
fn tile_counts(shape: &PrefillShape, qb: usize, kb: usize) -> (usize, usize) {
    let n = shape.seq_len;
    let (mut vis, mut invis) = (0, 0);
    for t in qb * BLOCK_Q..((qb + 1) * BLOCK_Q).min(n) {
        for j in kb * BLOCK_KV..((kb + 1) * BLOCK_KV).min(n) {
            if token_visible(shape.kind, t, j, shape.sink_tokens, shape.local_tokens) {
                vis += 1;
            } else {
                invis += 1;
            }
        }
    }
    (vis, invis)
}

fn random_shape(rng: &mut impl Rng) -> PrefillShape {
    let kind = if rng.gen() {
        HeadKind::Dense
    } else {
        HeadKind::Streaming
    };
    // Lengths around and between block boundaries; sinks and windows not multiples of 64.
    let seq_len = match rng.gen_range(0..3) {
        0 => rng.gen_range(1..70),
        1 => rng.gen_range(1..8) * BLOCK_Q + rng.gen_range(0..3),
        _ => rng.gen_range(1..700),
    };
    let sink_tokens = [0, 1, 4, 63, 64, 65, 100, 200][rng.gen_range(0..8)];
    let local_tokens = [1, 2, 17, 64, 65, 128, 150, 300][rng.gen_range(0..8)];
    PrefillShape {
        kind,
        seq_len,
        sink_tokens,
        local_tokens,
    }
}

#[test]
fn token_visibility_definition() {
    assert!(token_visible(HeadKind::Dense, 5, 5, 0, 1));
    assert!(!token_visible(HeadKind::Dense, 5, 6, 0, 1));
    assert!(token_visible(HeadKind::Dense, 500, 0, 0, 1));
    // Streaming: sink 4, local 8: query 20 sees 0..4 and 13..=20.
    let seen: Vec<usize> = (0..30)
        .filter(|&j| token_visible(HeadKind::Streaming, 20, j, 4, 8))
        .collect();
    assert_eq!(seen, [0, 1, 2, 3, 13, 14, 15, 16, 17, 18, 19, 20]);
}

#[test]
fn prefill_blocks_match_brute_force() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut checked = (0, 0, 0); // (visited, partial, masked off by the caller)
    for case in 0..400 {
        let shape = random_shape(&mut rng);
        let n = num_blocks(shape.seq_len);
        let q_heads = rng.gen_range(1..3);
        let density: f64 = rng.gen();
        let mask =
            BlockMask::from_fn(q_heads, shape.seq_len, |_, _, _| rng.gen_bool(density)).unwrap();
        let use_mask = case % 3 != 0;
        for head in 0..q_heads {
            for qb in 0..n {
                let row = use_mask.then(|| mask.row(head, qb).unwrap());
                let got: Vec<_> = prefill_blocks(&shape, qb, row).unwrap().collect();
                let mut expected = Vec::new();
                for kb in 0..n {
                    let (vis, invis) = tile_counts(&shape, qb, kb);
                    let coverage = shape.coverage(qb, kb);
                    let want = match (vis, invis) {
                        (0, _) => BlockCoverage::Empty,
                        (_, 0) => BlockCoverage::Full,
                        _ => BlockCoverage::Partial,
                    };
                    assert_eq!(coverage, want, "{shape:?} qb {qb} kb {kb}");
                    let allowed = !use_mask || kb == qb || mask.get(head, qb, kb).unwrap();
                    if vis > 0 && allowed {
                        expected.push((kb, invis > 0));
                    }
                    if vis > 0 && !allowed {
                        checked.2 += 1;
                    }
                }
                let got: Vec<(usize, bool)> =
                    got.iter().map(|b| (b.kv_block, b.needs_mask)).collect();
                assert_eq!(got, expected, "{shape:?} qb {qb} mask {use_mask}");
                checked.0 += got.len();
                checked.1 += got.iter().filter(|b| b.1).count();
                // The diagonal is always visited.
                assert!(got.iter().any(|&(kb, _)| kb == qb));
            }
        }
    }
    let (visited, partial, masked) = checked;
    assert!(
        visited > 1000 && partial > 300 && masked > 100,
        "{checked:?}"
    );
}

#[test]
fn streaming_visits_only_sink_and_window_blocks() {
    // 64K tokens, sink 64, local 256: every query block visits at most 1 + 5 + 1 blocks.
    let shape = PrefillShape {
        kind: HeadKind::Streaming,
        seq_len: 65_536,
        sink_tokens: 64,
        local_tokens: 256,
    };
    let mut total = 0;
    for qb in 0..num_blocks(shape.seq_len) {
        let blocks: Vec<usize> = prefill_blocks(&shape, qb, None)
            .unwrap()
            .map(|b| b.kv_block)
            .collect();
        assert!(blocks.len() <= 6, "qb {qb}: {blocks:?}");
        assert!(blocks.windows(2).all(|w| w[0] < w[1]));
        total += blocks.len();
    }
    let dense_total: usize = (1..=1024).sum();
    assert!(total * 50 < dense_total);
}

#[test]
fn prefill_errors() {
    let shape = PrefillShape {
        kind: HeadKind::Streaming,
        seq_len: 100,
        sink_tokens: 4,
        local_tokens: 16,
    };
    assert!(matches!(
        prefill_blocks(&shape, 2, None),
        Err(LserveError::InvalidArgument { .. })
    ));
    let empty = PrefillShape {
        seq_len: 0,
        ..shape
    };
    assert!(matches!(
        prefill_blocks(&empty, 0, None),
        Err(LserveError::Empty(_))
    ));
    let no_local = PrefillShape {
        local_tokens: 0,
        ..shape
    };
    assert!(matches!(
        prefill_blocks(&no_local, 0, None),
        Err(LserveError::InvalidConfig { .. })
    ));
    let dense_no_local = PrefillShape {
        kind: HeadKind::Dense,
        ..no_local
    };
    assert_eq!(prefill_blocks(&dense_no_local, 1, None).unwrap().count(), 2);
    let wrong = BlockMask::new(1, 1000, true).unwrap();
    assert!(matches!(
        prefill_blocks(&shape, 0, Some(wrong.row(0, 0).unwrap())),
        Err(LserveError::ShapeMismatch { .. })
    ));
}

#[test]
fn block_mask_validation() {
    assert!(matches!(
        BlockMask::new(0, 10, true),
        Err(LserveError::Empty(_))
    ));
    assert!(matches!(
        BlockMask::new(1, 0, true),
        Err(LserveError::Empty(_))
    ));
    let mut m = BlockMask::new(3, 64 * 40, false).unwrap(); // 40 blocks: 2 words per row
    assert_eq!(
        (m.blocks(), m.words_per_row(), m.words().len()),
        (40, 2, 3 * 40 * 2)
    );
    m.set(2, 39, 35, true).unwrap();
    m.set(2, 39, 3, true).unwrap();
    assert!(m.get(2, 39, 35).unwrap() && m.get(2, 39, 3).unwrap() && !m.get(2, 39, 4).unwrap());
    m.set(2, 39, 3, false).unwrap();
    assert!(!m.get(2, 39, 3).unwrap());
    let before = m.clone();
    assert!(m.set(3, 0, 0, true).is_err());
    assert!(m.set(0, 40, 0, true).is_err());
    assert!(m.set(0, 0, 40, true).is_err());
    assert!(m.get(0, 0, 40).is_err());
    assert!(m.row(0, 40).is_err());
    assert_eq!(m, before);
    let back = BlockMask::from_words(3, 64 * 40, m.words().to_vec()).unwrap();
    assert_eq!(back, m);
    assert!(matches!(
        BlockMask::from_words(3, 64 * 40, vec![0; 5]),
        Err(LserveError::ShapeMismatch { .. })
    ));
    let mut stray = vec![0u32; 3 * 40 * 2];
    stray[1] = 1 << 8; // KV block 40: past the end
    assert!(matches!(
        BlockMask::from_words(3, 64 * 40, stray),
        Err(LserveError::InvalidArgument { .. })
    ));
    let full = BlockMask::new(1, 64 * 40, true).unwrap();
    assert_eq!(full.words()[1], (1 << 8) - 1); // no stray bits when filled
    m.check_shape(3, 64 * 40 - 5).unwrap();
    assert!(m.check_shape(2, 64 * 40).is_err());
    assert!(m.check_shape(3, 64 * 40 + 1).is_err());
}

#[test]
fn streaming_decode_tokens_match_the_lambda_mask() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for _ in 0..500 {
        let len = rng.gen_range(1..600);
        let sink = rng.gen_range(0..80);
        let local = rng.gen_range(1..200);
        let got: Vec<_> = streaming_decode_tokens(len, sink, local).unwrap().collect();
        let expected: Vec<usize> = (0..len)
            .filter(|&j| token_visible(HeadKind::Streaming, len - 1, j, sink, local))
            .collect();
        assert_eq!(got.iter().map(|t| t.pos).collect::<Vec<_>>(), expected);
        // Rows: distinct, within sink + local, and per the layout rule.
        let mut rows: Vec<usize> = got.iter().map(|t| t.row).collect();
        let store = StreamingStore::new(1, sink, local).unwrap();
        for t in &got {
            assert_eq!(t.row, store.row_of_token(t.pos));
        }
        rows.sort_unstable();
        rows.dedup();
        assert_eq!(rows.len(), got.len());
        assert!(rows.iter().all(|&r| r < sink + local));
    }
    assert!(matches!(
        streaming_decode_tokens(0, 4, 4),
        Err(LserveError::Empty(_))
    ));
    assert!(matches!(
        streaming_decode_tokens(5, 4, 0),
        Err(LserveError::InvalidConfig { .. })
    ));
}

#[test]
fn dense_decode_pages_cover_exactly_the_tokens() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for _ in 0..300 {
        let page_tokens = [1, 8, 16, 64][rng.gen_range(0..4)];
        let len: usize = rng.gen_range(1..500);
        let pages = len.div_ceil(page_tokens);
        let mut ids: Vec<u32> = (0..pages as u32 + rng.gen_range(0..3))
            .map(|i| i * 7 + 3)
            .collect();
        ids.shuffle(&mut rng);
        let table = BlockTable::from_pages(ids.clone());
        let all: Vec<_> = dense_decode_pages(&table, len, page_tokens, None)
            .unwrap()
            .collect();
        assert_eq!(all.len(), pages);
        let tokens: Vec<usize> = all.iter().flat_map(|p| p.tokens.clone()).collect();
        assert_eq!(tokens, (0..len).collect::<Vec<_>>());
        assert!(all.iter().all(|p| p.physical == ids[p.logical]));
        let selection: Vec<usize> = (0..pages).filter(|_| rng.gen()).collect();
        let some: Vec<_> = dense_decode_pages(&table, len, page_tokens, Some(&selection))
            .unwrap()
            .collect();
        assert_eq!(
            some.iter().map(|p| p.logical).collect::<Vec<_>>(),
            selection
        );
        for p in &some {
            assert_eq!(p, &all[p.logical]);
        }
    }
    let table = BlockTable::from_pages(vec![1, 2, 3]);
    assert!(matches!(
        dense_decode_pages(&table, 0, 16, None),
        Err(LserveError::Empty(_))
    ));
    assert!(matches!(
        dense_decode_pages(&table, 10, 0, None),
        Err(LserveError::InvalidConfig { .. })
    ));
    assert!(dense_decode_pages(&table, 49, 16, None).is_err()); // needs 4 pages
    for bad in [&[1usize, 0][..], &[1, 1], &[3]] {
        assert!(
            dense_decode_pages(&table, 48, 16, Some(bad)).is_err(),
            "{bad:?}"
        );
    }
}

/// Masks whose word count or byte size overflows are `InvalidArgument`, never an overflow or
/// capacity panic.
#[test]
fn overflowing_block_mask_sizes_are_errors() {
    for (q_heads, seq_len) in [(2, usize::MAX), (1, 1 << 40), (usize::MAX, 64)] {
        assert!(matches!(
            BlockMask::new(q_heads, seq_len, false),
            Err(LserveError::InvalidArgument {
                what: "block mask",
                ..
            })
        ));
        assert!(matches!(
            BlockMask::from_words(q_heads, seq_len, Vec::new()),
            Err(LserveError::InvalidArgument { .. })
        ));
    }
    let m = BlockMask::new(3, 33 * BLOCK_KV, true).unwrap();
    assert_eq!(m.words().len(), 3 * 33 * 2);
}

/// Block indices far past the sequence (found by fuzzing, `fuzz/regressions/constructors/`):
/// `coverage` is `Empty` for any of them, never an overflow panic on `q_block * 64`.
#[test]
fn coverage_of_blocks_past_the_end_is_empty_for_any_index() {
    for kind in [HeadKind::Dense, HeadKind::Streaming] {
        let shape = PrefillShape {
            kind,
            seq_len: 1000,
            sink_tokens: 64,
            local_tokens: 128,
        };
        for (q, k) in [
            (usize::MAX, 0),
            (0, usize::MAX),
            (usize::MAX, usize::MAX),
            (usize::MAX / 64 + 1, 3),
            (16, 0), // the first block past 1000 tokens
        ] {
            assert_eq!(
                shape.coverage(q, k),
                BlockCoverage::Empty,
                "{kind:?} ({q}, {k})"
            );
        }
        assert_ne!(shape.coverage(15, 15), BlockCoverage::Empty);
    }
    // A sequence whose last block ends at usize::MAX: the tile end does not overflow.
    let shape = PrefillShape {
        kind: HeadKind::Dense,
        seq_len: usize::MAX,
        sink_tokens: 0,
        local_tokens: 1,
    };
    let last = num_blocks(usize::MAX) - 1;
    assert_eq!(shape.coverage(last, last), BlockCoverage::Partial);
    assert_eq!(shape.coverage(last, 0), BlockCoverage::Full);
}

/// A page size near `usize::MAX` (found by fuzzing, `fuzz/regressions/constructors/`): the
/// last page's token range ends at the sequence's length, never an overflow panic on
/// `start + page_tokens`.
#[test]
fn dense_decode_pages_with_huge_pages_end_at_the_length() {
    let table = BlockTable::from_pages(vec![3, 7]);
    let pt = (usize::MAX >> 1) + 1;
    let pages: Vec<_> = dense_decode_pages(&table, usize::MAX, pt, None)
        .unwrap()
        .map(|p| (p.physical, p.tokens))
        .collect();
    assert_eq!(pages, [(3, 0..pt), (7, pt..usize::MAX)]);
}
