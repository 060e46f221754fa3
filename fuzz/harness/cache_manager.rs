//! Random operation sequences on a [`KvCacheManager`] and its [`HostKvCache`] against a model:
//! live sequences with their slot, length, decode step, block table and the tokens written,
//! the pool's free-id stack, freed ids. After every operation the manager must agree with the
//! model (sequences, lengths, slots (lowest free), page ids (the pool's documented order),
//! device-shaped tables, the generation changing exactly when a table row or slot owner
//! changes), a failed operation must leave manager and cache equal to their clones from before
//! it, and every token read back must be the one written for that sequence (no page or ring row
//! shared between sequences).

use std::collections::BTreeSet;

use arbitrary::{Arbitrary, Unstructured};
use half::bf16;
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::{HostKvCache, KvCacheManager, PageId, SeqId, StreamingStore};
use lserve::LserveError;

use super::manager_model::{check_live, pattern_of, LiveSeq, Sizes};
use super::size::Size;

#[derive(Arbitrary, Debug)]
struct Input {
    layers: u8,
    kv_heads: u8,
    group: u8,
    /// Bit `layer * kv_heads + head` set: streaming.
    kinds: u16,
    page_pow: u8,
    logical_pow: u8,
    sink: u8,
    local: u8,
    capacity: u8,
    max_sequences: u8,
    max_seq_len: u8,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add,
    Reserve {
        which: Which,
        n: Count,
    },
    ReserveEach {
        which: Vec<Which>,
        n: Count,
    },
    Free(Which),
    Advance(Which),
    /// Writes token `pos` (see [`Pos`]) of every KV head of `layer`.
    Write {
        which: Which,
        layer: u8,
        pos: Pos,
    },
    /// Writes every reserved token of every layer.
    WriteAll(Which),
    /// A write of the wrong shape.
    BadShape {
        which: Which,
        short_v: bool,
    },
    /// Reads a token of a KV head (any layer, head and position).
    Read {
        which: Which,
        layer: u8,
        head: u8,
        pos: Pos,
    },
}

/// A sequence: a live one, or a freed one (`UnknownSequence`).
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Which {
    Live(u8),
    Freed(u8),
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum Count {
    Small(u8),
    Any(Size),
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum Pos {
    /// `len - 1 - k`.
    Back(u8),
    /// `len + k`.
    Past(u8),
    Any(Size),
}

impl Count {
    fn get(self) -> usize {
        match self {
            Count::Small(n) => n as usize % 24,
            Count::Any(s) => s.get(),
        }
    }
}

impl Pos {
    fn get(self, len: usize) -> usize {
        match self {
            Pos::Back(k) => len.wrapping_sub(1 + k as usize),
            Pos::Past(k) => len + k as usize,
            Pos::Any(s) => s.get(),
        }
    }
}

#[derive(Clone, Debug)]
struct Live {
    id: SeqId,
    slot: u32,
    len: usize,
    step: u64,
    pages: Vec<PageId>,
    /// `(layer, pos)` written to the dense heads.
    dense: BTreeSet<(usize, usize)>,
    /// `(layer, pos)` written to the streaming heads (held at the length of the write).
    streaming: BTreeSet<(usize, usize)>,
}

struct Model {
    live: Vec<Live>,
    freed: Vec<SeqId>,
    /// The pool's free ids; the next allocation pops from the end.
    free: Vec<PageId>,
    slots: usize,
}

impl Model {
    fn seq(&self, w: Which) -> Option<SeqId> {
        match w {
            Which::Live(i) if !self.live.is_empty() => {
                Some(self.live[i as usize % self.live.len()].id)
            }
            Which::Freed(i) if !self.freed.is_empty() => {
                Some(self.freed[i as usize % self.freed.len()])
            }
            _ => None,
        }
    }

    fn live_mut(&mut self, id: SeqId) -> Option<&mut Live> {
        self.live.iter_mut().find(|l| l.id == id)
    }

    fn live(&self, id: SeqId) -> Option<&Live> {
        self.live.iter().find(|l| l.id == id)
    }
}

struct Setup {
    g: ModelGeometry,
    pattern: HeadPattern,
    config: SparsityConfig,
    capacity: usize,
    max_seq_len: usize,
}

/// The value of dimension `d` of token `pos` of `seq` (K or V) for `layer` and `head`: small
/// integers (exact in bf16), different for every coordinate.
fn value(seq: SeqId, pos: usize, layer: usize, head: usize, is_v: bool, d: usize) -> f32 {
    let mut h = (seq.get() as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (pos as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ ((layer * 64 + head) as u64 * 2 + is_v as u64).wrapping_mul(0x1656_67B1_9E37_79F9);
    h ^= h >> 29;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 32;
    ((h.wrapping_add(d as u64 * 0x9E37)) >> 8) as f32 % 201.0 - 100.0
}

fn rows(s: &Setup, seq: SeqId, pos: usize, layer: usize) -> (Vec<bf16>, Vec<bf16>) {
    let row = |is_v| {
        (0..s.g.kv_heads())
            .flat_map(|h| {
                (0..s.g.head_dim()).map(move |d| bf16::from_f32(value(seq, pos, layer, h, is_v, d)))
            })
            .collect()
    };
    (row(false), row(true))
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let u = Unstructured::new(data);
    let Ok(input) = Input::arbitrary_take_rest(u) else {
        return;
    };
    let pattern = pattern_of(input.layers, input.kv_heads, input.group, input.kinds);
    let g = *pattern.geometry();
    let page_tokens = 1 << (input.page_pow % 4);
    let config = SparsityConfig {
        sink_tokens: input.sink as usize % 6,
        local_tokens: 1 + input.local as usize % 10,
        page_tokens,
        logical_page_tokens: page_tokens
            >> (input.logical_pow as usize % 4).min(input.page_pow as usize % 4),
        token_budget: page_tokens,
        ..SparsityConfig::default()
    };
    let s = Setup {
        g,
        pattern: pattern.clone(),
        config,
        capacity: 1 + input.capacity as usize % 16,
        max_seq_len: 1 + input.max_seq_len as usize % 80,
    };
    let slots = 1 + input.max_sequences as usize % 4;
    let mut mgr = KvCacheManager::new(g, pattern, config, s.capacity, slots, s.max_seq_len)
        .expect("a valid manager");
    let mut cache = HostKvCache::<bf16>::for_manager(&mgr).expect("a small cache");
    let mut model = Model {
        live: Vec::new(),
        freed: Vec::new(),
        free: (0..s.capacity as PageId).rev().collect(),
        slots,
    };
    check(&s, &mgr, &model);
    for op in input.ops.into_iter().take(64) {
        // Only writes touch the cache: only they need its snapshot (the rest take it unused).
        let writes = matches!(op, Op::Write { .. } | Op::WriteAll(_) | Op::BadShape { .. });
        let mgr_before = mgr.clone();
        let cache_before = writes.then(|| cache.clone());
        let gen_before = mgr.generation();
        // Whether the op must fail (and change nothing), and whether it changes the tables.
        let (failed, tables_changed) = apply(&s, &mut mgr, &mut cache, &mut model, op);
        if failed {
            assert!(mgr == mgr_before, "a failed operation changed the manager");
            if let Some(cache_before) = &cache_before {
                assert!(
                    cache == *cache_before,
                    "a failed operation changed the cache"
                );
            }
        }
        assert_eq!(
            mgr.generation() != gen_before,
            tables_changed,
            "the generation must change exactly when a table row or owner does"
        );
        check(&s, &mgr, &model);
    }
    for l in &model.live {
        check_contents(&s, &mgr, &cache, l);
    }
}

/// Applies `op` to the manager, the cache and the model; returns (failed, tables changed).
fn apply(
    s: &Setup,
    mgr: &mut KvCacheManager,
    cache: &mut HostKvCache<bf16>,
    model: &mut Model,
    op: Op,
) -> (bool, bool) {
    let p = s.config.page_tokens;
    match op {
        Op::Add => {
            let r = mgr.add_sequence();
            if model.live.len() == model.slots {
                assert!(
                    matches!(r, Err(LserveError::NoFreeSlot { slots }) if slots == model.slots),
                    "{r:?}"
                );
                return (true, false);
            }
            let id = r.expect("a free slot");
            let slot = (0..model.slots as u32)
                .find(|&sl| model.live.iter().all(|l| l.slot != sl))
                .expect("a free slot");
            assert_eq!(mgr.slot(id).unwrap(), slot, "not the lowest free slot");
            assert!(
                model.live.iter().all(|l| l.id != id),
                "a live id handed out again"
            );
            assert!(!model.freed.contains(&id), "an id was reused");
            model.live.push(Live {
                id,
                slot,
                len: 0,
                step: 0,
                pages: Vec::new(),
                dense: BTreeSet::new(),
                streaming: BTreeSet::new(),
            });
            (false, true)
        }
        Op::Reserve { which, n } => {
            let Some(id) = model.seq(which) else {
                return (false, false);
            };
            let n = n.get();
            let r = mgr.reserve(id, n);
            if n == 0 {
                // Checked first, whatever the sequence.
                assert!(matches!(r, Err(LserveError::Empty(_))), "{r:?}");
                return (true, false);
            }
            let Some(l) = model.live(id) else {
                assert!(
                    matches!(r, Err(LserveError::UnknownSequence(x)) if x == id.get()),
                    "{r:?}"
                );
                return (true, false);
            };
            let len = l.len;
            let expect = expected_reserve(s, model, len, n, l.pages.len());
            match (r, expect) {
                (Ok(range), Ok(new_pages)) => {
                    assert_eq!(range, len..len + n);
                    let pages: Vec<PageId> =
                        (0..new_pages).map(|_| model.free.pop().unwrap()).collect();
                    let l = model.live_mut(id).unwrap();
                    l.pages.extend(pages);
                    l.len = len + n;
                    (false, new_pages > 0)
                }
                (Err(e), Err(want)) => {
                    assert!(want(&e), "reserve({n}) on {len}: {e:?}");
                    (true, false)
                }
                (r, _) => panic!("reserve({n}) on {len}: {r:?}, model disagrees"),
            }
        }
        Op::ReserveEach { which, n } => {
            let ids: Vec<SeqId> = which.iter().take(6).filter_map(|&w| model.seq(w)).collect();
            let n = n.get();
            let r = mgr.reserve_each(&ids, n);
            // The model: all or none.
            let mut error: Option<&str> = None;
            let mut needed = 0usize;
            if n == 0 {
                error = Some("empty");
            } else {
                for (i, id) in ids.iter().enumerate() {
                    if ids[..i].contains(id) {
                        error = Some("twice");
                        break;
                    }
                    let Some(l) = model.live(*id) else {
                        error = Some("unknown");
                        break;
                    };
                    match l.len.checked_add(n) {
                        Some(new) if new <= s.max_seq_len => {
                            needed += new.div_ceil(p) - l.pages.len();
                        }
                        Some(_) => {
                            error = Some("long");
                            break;
                        }
                        None => {
                            error = Some("overflow");
                            break;
                        }
                    }
                }
                if error.is_none() && needed > model.free.len() {
                    error = Some("exhausted");
                }
            }
            match (r, error) {
                (Ok(()), None) => {
                    for id in &ids {
                        let new_len = model.live(*id).unwrap().len + n;
                        let k = new_len.div_ceil(p) - model.live(*id).unwrap().pages.len();
                        let pages: Vec<PageId> =
                            (0..k).map(|_| model.free.pop().unwrap()).collect();
                        let l = model.live_mut(*id).unwrap();
                        l.pages.extend(pages);
                        l.len = new_len;
                    }
                    (false, needed > 0)
                }
                (Err(e), Some(kind)) => {
                    let ok = match kind {
                        "empty" => matches!(e, LserveError::Empty(_)),
                        "twice" => matches!(
                            e,
                            LserveError::InvalidArgument {
                                what: "sequences",
                                ..
                            }
                        ),
                        "unknown" => matches!(e, LserveError::UnknownSequence(_)),
                        "long" => {
                            matches!(e, LserveError::SequenceTooLong { max, .. } if max == s.max_seq_len)
                        }
                        "overflow" => matches!(
                            e,
                            LserveError::InvalidArgument {
                                what: "n_tokens",
                                ..
                            }
                        ),
                        _ => {
                            matches!(e, LserveError::PoolExhausted { needed: x, free } if x == needed && free == model.free.len())
                        }
                    };
                    assert!(ok, "reserve_each({ids:?}, {n}): {e:?}, model {kind}");
                    (true, false)
                }
                (r, kind) => panic!("reserve_each({ids:?}, {n}): {r:?}, model {kind:?}"),
            }
        }
        Op::Free(which) => {
            let Some(id) = model.seq(which) else {
                return (false, false);
            };
            let r = mgr.free_sequence(id);
            match model.live.iter().position(|l| l.id == id) {
                Some(i) => {
                    r.expect("a live sequence frees");
                    let l = model.live.remove(i);
                    for &pg in l.pages.iter().rev() {
                        model.free.push(pg);
                    }
                    model.freed.push(id);
                    (false, true)
                }
                None => {
                    assert!(
                        matches!(r, Err(LserveError::UnknownSequence(x)) if x == id.get()),
                        "{r:?}"
                    );
                    (true, false)
                }
            }
        }
        Op::Advance(which) => {
            let Some(id) = model.seq(which) else {
                return (false, false);
            };
            let r = mgr.advance_decode_step(id);
            match model.live_mut(id) {
                Some(l) => {
                    l.step += 1;
                    assert_eq!(r.unwrap(), l.step);
                    (false, false)
                }
                None => {
                    assert!(matches!(r, Err(LserveError::UnknownSequence(_))), "{r:?}");
                    (true, false)
                }
            }
        }
        Op::Write { which, layer, pos } => {
            let Some(id) = model.seq(which) else {
                return (false, false);
            };
            let Some(l) = model.live(id) else {
                assert!(mgr.view(id).is_err());
                return (false, false);
            };
            let layer = layer as usize % (s.g.layers() + 1);
            let pos = pos.get(l.len);
            let view = mgr.view(id).unwrap();
            let (k, v) = rows(s, id, pos, layer);
            let r = cache.write_token(layer, &view, pos, &k, &v);
            if layer >= s.g.layers() {
                assert!(
                    matches!(r, Err(LserveError::InvalidArgument { what: "layer", .. })),
                    "{r:?}"
                );
                return (true, false);
            }
            if pos >= l.len {
                assert!(
                    matches!(r, Err(LserveError::TokenNotStored { position, len }) if position == pos && len == l.len),
                    "{r:?}"
                );
                return (true, false);
            }
            r.expect("a write in range");
            let (sink, local) = (s.config.sink_tokens, s.config.local_tokens);
            let held = StreamingStore::is_resident(pos, l.len, sink, local);
            let l = model.live_mut(id).unwrap();
            l.dense.insert((layer, pos));
            if held {
                l.streaming.insert((layer, pos));
            }
            let l = l.clone();
            check_contents(s, mgr, cache, &l);
            (false, false)
        }
        Op::WriteAll(which) => {
            let Some(id) = model.seq(which) else {
                return (false, false);
            };
            if model.live(id).is_none() {
                return (false, false);
            }
            let view = mgr.view(id).unwrap();
            let (sink, local) = (s.config.sink_tokens, s.config.local_tokens);
            let l = model.live_mut(id).unwrap();
            for layer in 0..s.g.layers() {
                for pos in 0..l.len {
                    let (k, v) = rows(s, id, pos, layer);
                    cache
                        .write_token(layer, &view, pos, &k, &v)
                        .expect("a write in range");
                    l.dense.insert((layer, pos));
                    if StreamingStore::is_resident(pos, l.len, sink, local) {
                        l.streaming.insert((layer, pos));
                    }
                }
            }
            let l = l.clone();
            check_contents(s, mgr, cache, &l);
            (false, false)
        }
        Op::BadShape { which, short_v } => {
            let Some(id) = model.seq(which) else {
                return (false, false);
            };
            let Some(l) = model.live(id) else {
                return (false, false);
            };
            let view = mgr.view(id).unwrap();
            let (mut k, mut v) = rows(s, id, 0, 0);
            if short_v {
                v.pop();
            } else {
                k.push(bf16::ZERO);
            }
            let r = cache.write_token(0, &view, l.len.saturating_sub(1), &k, &v);
            assert!(matches!(r, Err(LserveError::ShapeMismatch { .. })), "{r:?}");
            (true, false)
        }
        Op::Read {
            which,
            layer,
            head,
            pos,
        } => {
            let Some(id) = model.seq(which) else {
                return (false, false);
            };
            let Some(l) = model.live(id) else {
                return (false, false);
            };
            let (layer, head) = (
                layer as usize % (s.g.layers() + 1),
                head as usize % (s.g.kv_heads() + 1),
            );
            let pos = pos.get(l.len);
            let view = mgr.view(id).unwrap();
            let r = cache.token(layer, &view, head, pos);
            if layer >= s.g.layers() || head >= s.g.kv_heads() {
                assert!(
                    matches!(r, Err(LserveError::InvalidArgument { .. })),
                    "{r:?}"
                );
            } else if pos >= l.len {
                assert!(
                    matches!(r, Err(LserveError::TokenNotStored { .. })),
                    "{r:?}"
                );
            } else {
                let streaming = s.pattern.kind(layer, head) == HeadKind::Streaming;
                let held = !streaming
                    || StreamingStore::is_resident(
                        pos,
                        l.len,
                        s.config.sink_tokens,
                        s.config.local_tokens,
                    );
                match r {
                    Ok((k, v)) => {
                        assert!(held, "a token that left the ring read back");
                        let written = if streaming {
                            l.streaming.contains(&(layer, pos))
                        } else {
                            l.dense.contains(&(layer, pos))
                        };
                        if written {
                            check_row(id, pos, layer, head, k, v);
                        }
                    }
                    Err(LserveError::TokenNotStored { .. }) => assert!(!held),
                    Err(e) => panic!("token: {e:?}"),
                }
            }
            (true, false)
        }
    }
}

type ErrorCheck = Box<dyn Fn(&LserveError) -> bool>;

/// The outcome `reserve(n)` must have on a sequence of `len` tokens and `pages` pages: the
/// number of new pages, or a check of the error.
fn expected_reserve(
    s: &Setup,
    model: &Model,
    len: usize,
    n: usize,
    pages: usize,
) -> Result<usize, ErrorCheck> {
    let max = s.max_seq_len;
    if n == 0 {
        return Err(Box::new(|e| matches!(e, LserveError::Empty(_))));
    }
    let Some(new_len) = len.checked_add(n) else {
        return Err(Box::new(|e| {
            matches!(
                e,
                LserveError::InvalidArgument {
                    what: "n_tokens",
                    ..
                }
            )
        }));
    };
    if new_len > max {
        return Err(Box::new(
            move |e| matches!(e, LserveError::SequenceTooLong { len: l, max: m } if *l == new_len && *m == max),
        ));
    }
    let new_pages = new_len.div_ceil(s.config.page_tokens) - pages;
    let free = model.free.len();
    if new_pages > free {
        return Err(Box::new(
            move |e| matches!(e, LserveError::PoolExhausted { needed, free: f } if *needed == new_pages && *f == free),
        ));
    }
    Ok(new_pages)
}

fn check_row(id: SeqId, pos: usize, layer: usize, head: usize, k: &[bf16], v: &[bf16]) {
    for (d, (x, y)) in k.iter().zip(v).enumerate() {
        assert_eq!(
            x.to_f32(),
            value(id, pos, layer, head, false, d),
            "K {id:?} pos {pos} l{layer} h{head} d{d}"
        );
        assert_eq!(
            y.to_f32(),
            value(id, pos, layer, head, true, d),
            "V {id:?} pos {pos} l{layer} h{head} d{d}"
        );
    }
}

/// Every written token of `l` that the cache still holds reads back as written.
fn check_contents(s: &Setup, mgr: &KvCacheManager, cache: &HostKvCache<bf16>, l: &Live) {
    let view = mgr.view(l.id).unwrap();
    let (sink, local) = (s.config.sink_tokens, s.config.local_tokens);
    for layer in 0..s.g.layers() {
        for head in 0..s.g.kv_heads() {
            let streaming = s.pattern.kind(layer, head) == HeadKind::Streaming;
            let set = if streaming { &l.streaming } else { &l.dense };
            for &(_, pos) in set.range((layer, 0)..(layer + 1, 0)) {
                let held = !streaming || StreamingStore::is_resident(pos, l.len, sink, local);
                match cache.token(layer, &view, head, pos) {
                    Ok((k, v)) => {
                        assert!(held);
                        check_row(l.id, pos, layer, head, k, v);
                    }
                    Err(LserveError::TokenNotStored { .. }) => assert!(!held),
                    Err(e) => panic!("token: {e:?}"),
                }
            }
        }
    }
}

/// The manager agrees with the model.
fn check(s: &Setup, mgr: &KvCacheManager, model: &Model) {
    let live: Vec<LiveSeq> = model
        .live
        .iter()
        .map(|l| LiveSeq {
            id: l.id,
            slot: l.slot,
            len: l.len,
            step: l.step,
            pages: &l.pages,
        })
        .collect();
    let sizes = Sizes {
        capacity: s.capacity,
        slots: model.slots,
        max_seq_len: s.max_seq_len,
        page_tokens: s.config.page_tokens,
    };
    check_live(mgr, &sizes, &live, model.free.len());
    for l in &model.live {
        let view = mgr.view(l.id).unwrap();
        assert_eq!((view.slot, view.len), (l.slot, l.len));
    }
    for &id in &model.freed {
        assert!(!mgr.contains(id));
        assert!(matches!(mgr.len(id), Err(LserveError::UnknownSequence(_))));
    }
}
