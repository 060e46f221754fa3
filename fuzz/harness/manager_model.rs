//! The checks of a `KvCacheManager` against a harness's model of its live sequences, and the
//! model shape an input's bytes give, shared by the `cache_manager` and `session` harnesses.

use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::{KvCacheManager, PageId, SeqId, PAD_PAGE};

/// The harnesses' model shape from an input's bytes: 1-2 layers, 1-3 KV heads, group 1 or 2,
/// head dim 64, and head kinds from `kinds` (bit `layer * kv_heads + head` set: streaming).
pub fn pattern_of(layers: u8, kv_heads: u8, group: u8, kinds: u16) -> HeadPattern {
    let layers = 1 + layers as usize % 2;
    let kv = 1 + kv_heads as usize % 3;
    let g = ModelGeometry::new(layers, kv * (1 + group as usize % 2), kv, 64)
        .expect("a served geometry");
    let kinds = (0..layers)
        .map(|l| {
            (0..kv)
                .map(|h| match kinds >> (l * kv + h) & 1 {
                    1 => HeadKind::Streaming,
                    _ => HeadKind::Dense,
                })
                .collect()
        })
        .collect();
    HeadPattern::from_kinds(g, kinds).expect("shape matches")
}

/// What the model holds of one live sequence.
pub struct LiveSeq<'a> {
    pub id: SeqId,
    pub slot: u32,
    pub len: usize,
    pub step: u64,
    pub pages: &'a [PageId],
}

/// The manager's sizes as the harness built it.
pub struct Sizes {
    pub capacity: usize,
    pub slots: usize,
    pub max_seq_len: usize,
    pub page_tokens: usize,
}

/// Asserts that `mgr` holds exactly `live` (ids, lengths, slots, decode steps, block tables),
/// `free_pages` free pages, each page in at most one table and none leaked, a streaming slot per
/// live sequence, and device-shaped block tables that hold each slot's row (padding elsewhere);
/// returns the pages in use.
pub fn check_live(mgr: &KvCacheManager, s: &Sizes, live: &[LiveSeq], free_pages: usize) -> usize {
    let p = s.page_tokens;
    let mut ids: Vec<SeqId> = live.iter().map(|l| l.id).collect();
    ids.sort();
    assert_eq!(mgr.sequences(), ids);
    assert_eq!(mgr.num_sequences(), ids.len());
    let pool = mgr.pool();
    assert_eq!(pool.free_pages(), free_pages, "free pages");
    let mut owned = vec![false; s.capacity];
    for l in live {
        assert!(mgr.contains(l.id));
        assert_eq!(mgr.len(l.id).unwrap(), l.len, "length of {:?}", l.id);
        assert_eq!(mgr.slot(l.id).unwrap(), l.slot);
        assert_eq!(mgr.decode_step(l.id).unwrap(), l.step);
        let table = mgr.block_table(l.id).unwrap();
        assert_eq!(table.pages(), l.pages, "block table of {:?}", l.id);
        assert_eq!(table.len(), l.len.div_ceil(p));
        for &pg in table.pages() {
            assert!(pool.is_allocated(pg));
            assert!(
                !std::mem::replace(&mut owned[pg as usize], true),
                "page {pg} owned twice"
            );
        }
    }
    let n_owned = owned.iter().filter(|&&o| o).count();
    assert_eq!(n_owned + pool.free_pages(), s.capacity, "leaked pages");
    assert_eq!(mgr.streaming_store().slots_in_use(), live.len());

    let t = mgr.device_block_tables();
    assert_eq!(
        (t.slots, t.max_pages_per_seq),
        (s.slots, s.max_seq_len.div_ceil(p))
    );
    for slot in 0..s.slots {
        let row = &t.pages[slot * t.max_pages_per_seq..(slot + 1) * t.max_pages_per_seq];
        match live.iter().find(|l| l.slot == slot as u32) {
            Some(l) => {
                assert_eq!(&row[..l.pages.len()], l.pages);
                assert!(row[l.pages.len()..].iter().all(|&x| x == PAD_PAGE));
                assert_eq!(t.num_pages[slot] as usize, l.pages.len());
                assert_eq!(t.seq_lens[slot] as usize, l.len);
            }
            None => {
                assert!(row.iter().all(|&x| x == PAD_PAGE));
                assert_eq!((t.num_pages[slot], t.seq_lens[slot]), (0, 0));
            }
        }
    }
    n_owned
}
