//! Random operation sequences on a session's host half ([`Sequences`]) against a model: live
//! sequences with their slot, length, state and pages, the pool's free-id stack, freed ids.
//!
//! The operations: `add`; `free` of live and freed ids; `reserve_prefill` of random chunk lists
//! (first chunks, later chunks of sequences that hold tokens, 0 tokens, lengths at and past
//! `max_seq_len`, near `u32::MAX` and `usize::MAX`, past the pool, a sequence twice, freed ids,
//! no chunk, 65535 chunks and more); `check_decode` of random batches; a decode step's host
//! calls; `Sequences::new` over the session's manager; a reset (every sequence freed, a new
//! `Sequences` over the same manager). Some configs have `max_seq_len` past `2^31` and pages of
//! `2^20` tokens and more, where a prefill's token limit (`2^31 - 1`) applies.
//!
//! A decode step reserves and advances in the device half (`DecodeStep::plan` and
//! `PlannedStep::finish`, which need a GPU), so the session's own sequences never decode here:
//! the harness calls `check_decode` on the session and, when it passes, runs the step's host
//! calls (`reserve_each(batch, 1)`, then `advance_decode_step` of each) on a clone of the
//! session's manager, checked against the model.
//!
//! After every operation the session must agree with the model (live ids, each state, length,
//! slot (the lowest free), pages (the pool's documented order), decode step, no page shared or
//! leaked, free pages, streaming slots, device-shaped tables, [`KvMemory`]), an error must be
//! the one the documented checks give first, and a failed operation must leave the session
//! (manager and states) equal to its clone from before it.

use std::ops::Range;

use arbitrary::{Arbitrary, Unstructured};
use lserve::config::SparsityConfig;
use lserve::dtype::DType;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::{KvCacheManager, PageId, SeqId};
use lserve::session::{KvMemory, SequenceState, Sequences};
use lserve::LserveError;

use super::manager_model::{check_live, pattern_of, LiveSeq, Sizes};
use super::size::Size;

/// Chunks one prefill covers at most, and tokens (`reserve_prefill`'s documented limits).
const MAX_CHUNKS: usize = 65_535;
const MAX_ROWS: usize = (1 << 31) - 1;

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
    max_seq_len: MaxLen,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum MaxLen {
    /// `1..=80` tokens, pages of 1 to 8 tokens.
    Small(u8),
    /// `2^31 - 1`, `2^31`, `2^31 + 1` or `u32::MAX` tokens, pages of `2^20` to `2^24` tokens.
    Huge(u8),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add,
    Free(Which),
    /// `reserve_prefill` of these chunks (the first 6).
    Prefill(Vec<(Which, Count)>),
    /// `reserve_prefill` of `65535 + extra % 3` chunks of `n` tokens, the live sequences in
    /// turn (or one freed id).
    ManyChunks {
        which: Which,
        extra: u8,
        n: Count,
    },
    /// `check_decode` of this batch (the first 6).
    CheckDecode(Vec<Which>),
    /// `check_decode`, then `1 + steps % 8` decode steps' host calls on a clone of the manager.
    DecodeSteps {
        batch: Vec<Which>,
        steps: u8,
    },
    /// `Sequences::new` over a clone of the session's manager.
    NewFromManager,
    /// Frees every live sequence (from the `start`-th on, in turn; backwards if `backwards`)
    /// and starts a new `Sequences` over the manager.
    Reset {
        start: u8,
        backwards: bool,
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
    /// `max_seq_len - len + d` with `d` in `-2..=2`.
    ToMax(u8),
    /// `free_pages * page_tokens + d` with `d` in `-2..=2`.
    ToPool(u8),
    Any(Size),
}

impl Count {
    fn get(self, s: &Setup, model: &Model, len: usize) -> usize {
        let near = |base: usize, d: u8| match d % 5 {
            d @ 0..=1 => base.saturating_sub(2 - d as usize),
            d => base.saturating_add(d as usize - 2),
        };
        match self {
            Count::Small(n) => n as usize,
            Count::ToMax(d) => near(s.max_seq_len.saturating_sub(len), d),
            Count::ToPool(d) => near(model.free.len() * s.config.page_tokens, d),
            Count::Any(x) => x.get(),
        }
    }
}

#[derive(Clone, Debug)]
struct Live {
    id: SeqId,
    slot: u32,
    len: usize,
    state: SequenceState,
    /// The manager's decode step counter (only a clone's advances).
    step: u64,
    pages: Vec<PageId>,
}

#[derive(Clone, Debug)]
struct Model {
    live: Vec<Live>,
    freed: Vec<SeqId>,
    /// The pool's free ids; the next allocation pops from the end.
    free: Vec<PageId>,
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

    fn live(&self, id: SeqId) -> Option<&Live> {
        self.live.iter().find(|l| l.id == id)
    }

    fn live_mut(&mut self, id: SeqId) -> Option<&mut Live> {
        self.live.iter_mut().find(|l| l.id == id)
    }

    fn len(&self, id: SeqId) -> usize {
        self.live(id).map_or(0, |l| l.len)
    }

    /// Takes `n` pages from the pool, in its order.
    fn alloc(&mut self, n: usize) -> Vec<PageId> {
        (0..n)
            .map(|_| self.free.pop().expect("the model checked the free pages"))
            .collect()
    }
}

struct Setup {
    pattern: HeadPattern,
    config: SparsityConfig,
    capacity: usize,
    slots: usize,
    max_seq_len: usize,
}

/// The error an operation must return, by the documented checks.
#[derive(Debug)]
enum Want {
    Empty,
    /// `InvalidArgument` with this `what`.
    Invalid(&'static str),
    Unknown(SeqId),
    TooLong {
        len: usize,
        max: usize,
    },
    Exhausted {
        needed: usize,
        free: usize,
    },
    NoFreeSlot {
        slots: usize,
    },
}

impl Want {
    fn matches(&self, e: &LserveError) -> bool {
        match (self, e) {
            (Want::Empty, LserveError::Empty(_)) => true,
            (Want::Invalid(w), LserveError::InvalidArgument { what, .. }) => what == w,
            (Want::Unknown(id), LserveError::UnknownSequence(x)) => *x == id.get(),
            (Want::TooLong { len, max }, LserveError::SequenceTooLong { len: l, max: m }) => {
                (l, m) == (len, max)
            }
            (
                Want::Exhausted { needed, free },
                LserveError::PoolExhausted { needed: n, free: f },
            ) => (n, f) == (needed, free),
            (Want::NoFreeSlot { slots }, LserveError::NoFreeSlot { slots: s }) => s == slots,
            _ => false,
        }
    }
}

/// Asserts that `r` failed with `want`.
fn assert_err<T: std::fmt::Debug>(r: &lserve::Result<T>, want: &Want, what: &str) {
    match r {
        Err(e) if want.matches(e) => {}
        r => panic!("{what}: {r:?}, the model wants {want:?}"),
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let u = Unstructured::new(data);
    let Ok(input) = Input::arbitrary_take_rest(u) else {
        return;
    };
    let pattern = pattern_of(input.layers, input.kv_heads, input.group, input.kinds);
    let g = *pattern.geometry();
    let (page_pow, max_seq_len) = match input.max_seq_len {
        MaxLen::Small(m) => (input.page_pow as usize % 4, 1 + m as usize % 80),
        MaxLen::Huge(m) => (
            20 + input.page_pow as usize % 5,
            [MAX_ROWS, MAX_ROWS + 1, MAX_ROWS + 2, u32::MAX as usize][m as usize % 4],
        ),
    };
    let page_tokens = 1 << page_pow;
    let config = SparsityConfig {
        sink_tokens: input.sink as usize % 6,
        local_tokens: 1 + input.local as usize % 10,
        page_tokens,
        logical_page_tokens: page_tokens >> (input.logical_pow as usize % 4).min(page_pow),
        token_budget: page_tokens,
        ..SparsityConfig::default()
    };
    let s = Setup {
        pattern: pattern.clone(),
        config,
        capacity: 1 + input.capacity as usize % 16,
        slots: 1 + input.max_sequences as usize % 4,
        max_seq_len,
    };
    let mgr = KvCacheManager::new(g, pattern, config, s.capacity, s.slots, s.max_seq_len)
        .expect("a valid manager");
    let mut seqs = Sequences::new(mgr).expect("an empty manager");
    let mut model = Model {
        live: Vec::new(),
        freed: Vec::new(),
        free: (0..s.capacity as PageId).rev().collect(),
    };
    check(&s, &seqs, &model);
    for op in input.ops.into_iter().take(64) {
        let before = seqs.clone();
        let failed = apply(&s, &mut seqs, &mut model, op);
        if failed {
            assert_same(&seqs, &before);
        }
        check(&s, &seqs, &model);
    }
}

/// `a` and `b` hold the same manager (content) and the same sequences in the same states.
fn assert_same(a: &Sequences, b: &Sequences) {
    assert!(
        a.manager() == b.manager(),
        "a failed operation changed the manager"
    );
    assert_eq!(
        a.live(),
        b.live(),
        "a failed operation changed the sequences"
    );
    for id in a.live() {
        assert_eq!(
            a.state(id).unwrap(),
            b.state(id).unwrap(),
            "a failed operation changed a state"
        );
    }
}

/// Applies `op` to the session and the model; returns whether it failed (and must have
/// changed nothing).
fn apply(s: &Setup, seqs: &mut Sequences, model: &mut Model, op: Op) -> bool {
    match op {
        Op::Add => {
            let r = seqs.add();
            if model.live.len() == s.slots {
                assert_err(&r, &Want::NoFreeSlot { slots: s.slots }, "add");
                return true;
            }
            let id = r.expect("a free slot");
            let slot = (0..s.slots as u32)
                .find(|&sl| model.live.iter().all(|l| l.slot != sl))
                .expect("a free slot");
            assert_eq!(
                seqs.manager().slot(id).unwrap(),
                slot,
                "not the lowest free slot"
            );
            assert!(model.live(id).is_none(), "a live id handed out again");
            assert!(!model.freed.contains(&id), "an id was reused");
            model.live.push(Live {
                id,
                slot,
                len: 0,
                state: SequenceState::Ready,
                step: 0,
                pages: Vec::new(),
            });
            false
        }
        Op::Free(which) => {
            let Some(id) = model.seq(which) else {
                return false;
            };
            let r = seqs.free(id);
            if model.live(id).is_none() {
                assert_err(&r, &Want::Unknown(id), "free");
                return true;
            }
            r.expect("a live sequence frees");
            free_in_model(model, id);
            false
        }
        Op::Prefill(chunks) => {
            let mut list = Vec::new();
            for (w, n) in chunks.into_iter().take(6) {
                if let Some(id) = model.seq(w) {
                    let n = n.get(s, model, model.len(id));
                    list.push((id, n));
                }
            }
            prefill(s, seqs, model, &list)
        }
        Op::ManyChunks { which, extra, n } => {
            let count = MAX_CHUNKS + extra as usize % 3;
            let ids: Vec<SeqId> = match (which, model.seq(which)) {
                (Which::Freed(_), Some(id)) => vec![id],
                _ if !model.live.is_empty() => model.live.iter().map(|l| l.id).collect(),
                _ => return false,
            };
            let n = n.get(s, model, model.len(ids[0]));
            let list: Vec<(SeqId, usize)> = (0..count).map(|i| (ids[i % ids.len()], n)).collect();
            prefill(s, seqs, model, &list)
        }
        Op::CheckDecode(batch) => {
            let batch: Vec<SeqId> = batch.iter().take(6).filter_map(|&w| model.seq(w)).collect();
            let r = seqs.check_decode(&batch);
            match expect_decode(model, &batch) {
                Some(want) => assert_err(&r, &want, "check_decode"),
                None => r.expect("a decodable batch"),
            }
            // It only checks.
            true
        }
        Op::DecodeSteps { batch, steps } => {
            let batch: Vec<SeqId> = batch.iter().take(6).filter_map(|&w| model.seq(w)).collect();
            let r = seqs.check_decode(&batch);
            if let Some(want) = expect_decode(model, &batch) {
                assert_err(&r, &want, "check_decode");
                return true;
            }
            r.expect("a decodable batch");
            decode_steps_on_a_clone(s, seqs, model, &batch, 1 + steps as usize % 8);
            // The session itself is not changed.
            true
        }
        Op::NewFromManager => {
            let r = Sequences::new(seqs.manager().clone());
            if model.live.is_empty() {
                let fresh = r.expect("a manager without sequences");
                assert_same(&fresh, seqs);
            } else {
                assert_err(&r, &Want::Invalid("manager"), "Sequences::new");
            }
            true
        }
        Op::Reset { start, backwards } => {
            let mut order: Vec<SeqId> = model.live.iter().map(|l| l.id).collect();
            if !order.is_empty() {
                let k = start as usize % order.len();
                order.rotate_left(k);
            }
            if backwards {
                order.reverse();
            }
            for id in order {
                seqs.free(id).expect("a live sequence frees");
                free_in_model(model, id);
            }
            assert!(seqs.live().is_empty());
            *seqs = Sequences::new(seqs.manager().clone()).expect("every sequence was freed");
            false
        }
    }
}

/// Frees live `id` in the model: its pages go back to the pool (the last one first).
fn free_in_model(model: &mut Model, id: SeqId) {
    let i = model.live.iter().position(|l| l.id == id).unwrap();
    let l = model.live.remove(i);
    for &pg in l.pages.iter().rev() {
        model.free.push(pg);
    }
    model.freed.push(id);
}

/// `reserve_prefill(list)` on the session and the model; returns whether it failed.
fn prefill(s: &Setup, seqs: &mut Sequences, model: &mut Model, list: &[(SeqId, usize)]) -> bool {
    let r = seqs.reserve_prefill(list);
    match expect_prefill(s, model, list) {
        Err(want) => {
            assert_err(&r, &want, "reserve_prefill");
            true
        }
        Ok(ranges) => {
            let got = r.unwrap_or_else(|e| panic!("reserve_prefill({list:?}): {e:?}"));
            let want: Vec<(SeqId, Range<usize>)> =
                ranges.iter().map(|(id, r, _)| (*id, r.clone())).collect();
            assert_eq!(got, want, "reserve_prefill ranges");
            for (id, range, pages) in ranges {
                let pages = model.alloc(pages);
                let l = model.live_mut(id).unwrap();
                l.pages.extend(pages);
                l.len = range.end;
                l.state = SequenceState::Incomplete;
            }
            false
        }
    }
}

/// The outcome `reserve_prefill(chunks)` must have: each chunk's positions and new pages, or
/// the error its documented checks give first.
#[allow(clippy::type_complexity)]
fn expect_prefill(
    s: &Setup,
    model: &Model,
    chunks: &[(SeqId, usize)],
) -> Result<Vec<(SeqId, Range<usize>, usize)>, Want> {
    if chunks.is_empty() {
        return Err(Want::Empty);
    }
    if chunks.len() > MAX_CHUNKS {
        return Err(Want::Invalid("prefill chunks"));
    }
    let p = s.config.page_tokens;
    let (mut rows, mut pages) = (0usize, 0usize);
    let mut out = Vec::new();
    for (i, &(id, n)) in chunks.iter().enumerate() {
        if chunks[..i].iter().any(|&(x, _)| x == id) {
            return Err(Want::Invalid("prefill chunks"));
        }
        if n == 0 {
            return Err(Want::Empty);
        }
        let Some(l) = model.live(id) else {
            return Err(Want::Unknown(id));
        };
        if l.state != SequenceState::Ready {
            return Err(Want::Invalid("sequence"));
        }
        // A chunk follows what the sequence holds (a later chunk: its cached prefix).
        let start = l.len;
        let Some(end) = start.checked_add(n).filter(|&end| end <= s.max_seq_len) else {
            return Err(Want::TooLong {
                len: start.saturating_add(n),
                max: s.max_seq_len,
            });
        };
        rows = rows.saturating_add(n);
        let new_pages = end.div_ceil(p) - l.pages.len();
        pages = pages.saturating_add(new_pages);
        out.push((id, start..end, new_pages));
    }
    if rows > MAX_ROWS {
        return Err(Want::Invalid("prefill chunks"));
    }
    if pages > model.free.len() {
        return Err(Want::Exhausted {
            needed: pages,
            free: model.free.len(),
        });
    }
    Ok(out)
}

/// The error `check_decode(batch)` must return, if any.
fn expect_decode(model: &Model, batch: &[SeqId]) -> Option<Want> {
    if batch.is_empty() {
        return Some(Want::Empty);
    }
    for (i, &id) in batch.iter().enumerate() {
        if batch[..i].contains(&id) {
            return Some(Want::Invalid("batch"));
        }
        match model.live(id) {
            None => return Some(Want::Unknown(id)),
            Some(l) if l.state == SequenceState::Incomplete => {
                return Some(Want::Invalid("sequence"))
            }
            Some(_) => {}
        }
    }
    None
}

/// Runs `steps` decode steps' host calls for `batch` (live, distinct, ready) on a clone of the
/// session's manager: `reserve_each(batch, 1)` (all or none), then `advance_decode_step` of
/// each; the clone must follow a copy of the model, and stop changing at the first error.
fn decode_steps_on_a_clone(
    s: &Setup,
    seqs: &Sequences,
    model: &Model,
    batch: &[SeqId],
    steps: usize,
) {
    let mut mgr = seqs.manager().clone();
    let mut m = model.clone();
    let p = s.config.page_tokens;
    for _ in 0..steps {
        let before = mgr.clone();
        let r = mgr.reserve_each(batch, 1);
        let mut needed = 0usize;
        let mut want = None;
        for &id in batch {
            let l = m.live(id).unwrap();
            if l.len + 1 > s.max_seq_len {
                want = Some(Want::TooLong {
                    len: l.len + 1,
                    max: s.max_seq_len,
                });
                break;
            }
            needed += (l.len + 1).div_ceil(p) - l.pages.len();
        }
        if want.is_none() && needed > m.free.len() {
            want = Some(Want::Exhausted {
                needed,
                free: m.free.len(),
            });
        }
        if let Some(want) = want {
            assert_err(&r, &want, "reserve_each(batch, 1)");
            assert!(mgr == before, "a failed reservation changed the manager");
            break;
        }
        r.unwrap_or_else(|e| panic!("reserve_each({batch:?}, 1): {e:?}"));
        for &id in batch {
            let l = m.live(id).unwrap();
            let new = (l.len + 1).div_ceil(p) - l.pages.len();
            let pages = m.alloc(new);
            let l = m.live_mut(id).unwrap();
            l.pages.extend(pages);
            l.len += 1;
        }
        for &id in batch {
            let l = m.live_mut(id).unwrap();
            l.step += 1;
            assert_eq!(mgr.advance_decode_step(id).unwrap(), l.step);
        }
        check_manager(s, &mgr, &m);
    }
    // A session needs a manager without sequences: the batch is live in the clone.
    let r = Sequences::new(mgr);
    assert_err(&r, &Want::Invalid("manager"), "Sequences::new");
}

/// The session agrees with the model.
fn check(s: &Setup, seqs: &Sequences, model: &Model) {
    let mut ids: Vec<SeqId> = model.live.iter().map(|l| l.id).collect();
    ids.sort();
    assert_eq!(seqs.live(), ids);
    for l in &model.live {
        assert_eq!(seqs.state(l.id).unwrap(), l.state, "state of {:?}", l.id);
    }
    for &id in &model.freed {
        assert_err(&seqs.state(id), &Want::Unknown(id), "state of a freed id");
    }
    check_manager(s, seqs.manager(), model);
}

/// The manager agrees with the model.
fn check_manager(s: &Setup, mgr: &KvCacheManager, model: &Model) {
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
        slots: s.slots,
        max_seq_len: s.max_seq_len,
        page_tokens: s.config.page_tokens,
    };
    let n_owned = check_live(mgr, &sizes, &live, model.free.len());
    for &id in &model.freed {
        assert!(!mgr.contains(id));
        assert_err(&mgr.len(id), &Want::Unknown(id), "len of a freed id");
    }

    // Bytes as documented: a page holds K and V of its tokens and kmin, kmax of its logical
    // pages for every dense head of every layer; a slot K and V of the sinks and the ring for
    // every streaming head.
    let g = mgr.geometry();
    let (d, e) = (g.head_dim() as u64, DType::BF16.size_bytes() as u64);
    let c = s.config;
    let rows_per_page = (c.page_tokens + c.page_tokens / c.logical_page_tokens) as u64;
    let rows_per_slot = (c.sink_tokens + c.local_tokens) as u64;
    let (mut page, mut slot) = (0u64, 0u64);
    for layer in 0..g.layers() {
        for head in 0..g.kv_heads() {
            match s.pattern.kind(layer, head) {
                HeadKind::Dense => page += rows_per_page * d * 2 * e,
                HeadKind::Streaming => slot += rows_per_slot * d * 2 * e,
            }
        }
    }
    let m = KvMemory::of(mgr, DType::BF16);
    assert_eq!((m.dense_page_bytes, m.streaming_slot_bytes), (page, slot));
    assert_eq!(
        m.allocated_bytes,
        s.capacity as u64 * page + s.slots as u64 * slot
    );
    assert_eq!(
        m.used_bytes,
        n_owned as u64 * page + model.live.len() as u64 * slot
    );
}
