//! Every public constructor and size helper that takes sizes, with sizes at the boundaries
//! ([`Size`]): [`ModelGeometry::new`] and [`SparsityConfig::validate`] against a model of their
//! rules, the helpers on unvalidated configs, [`TokenPattern`], [`StreamingStore`],
//! [`IndexTables`], [`BlockMask`], [`HostKvCache`], [`PagePool`], [`KvCacheManager`], the
//! prefill and decode iterators, the reference's [`KeyStats`] and [`ReuseState`]. None may
//! panic; each must accept what its rules accept and reject the rest with the documented error.

use arbitrary::{Arbitrary, Unstructured};
use half::bf16;
use lserve::block_iter::{
    dense_decode_pages, num_blocks, prefill_blocks, streaming_decode_tokens, token_visible,
    BlockCoverage, BlockMask, PrefillShape,
};
use lserve::config::{GqaAggregation, SelectionUnit, SparsityConfig};
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::index_table::IndexTables;
use lserve::paging::{BlockTable, HostKvCache, KvCacheManager, PagePool, StreamingStore, PAD_PAGE};
use lserve::reference::kv_write::{key_stats, KeyStats};
use lserve::reference::select::ReuseState;
use lserve::reference::TokenPattern;
use lserve::LserveError;

use super::size::{in_u32_range, product, Size};
use super::ALLOC_BUDGET;

#[derive(Arbitrary, Debug)]
enum Call {
    Geometry {
        layers: Size,
        q_heads: Size,
        kv_heads: Size,
        head_dim: Size,
        q_head: Size,
    },
    Config {
        config: Config,
        len: Size,
        step: u64,
        head_dim: Size,
        max_seq_len: Size,
    },
    TokenPattern {
        sink: Size,
        local: Size,
        t: Size,
        j: Size,
    },
    StreamingStore {
        slots: Size,
        sink: Size,
        local: Size,
        t: Size,
        len: Size,
    },
    IndexTables {
        pattern: SmallPattern,
        slots: Size,
        entry_capacity: Size,
        pool_capacity: Size,
    },
    BlockMask {
        q_heads: Size,
        seq_len: Size,
        fill: bool,
        words: Vec<u32>,
    },
    HostKvCache {
        pattern: SmallPattern,
        config: Config,
        capacity: Size,
        slots: Size,
    },
    PagePool(Size),
    Manager {
        pattern: SmallPattern,
        config: Config,
        capacity: Size,
        slots: Size,
        max_seq_len: Size,
    },
    Prefill {
        streaming: bool,
        seq_len: Size,
        sink: Size,
        local: Size,
        q_block: Size,
        kv_block: Size,
    },
    StreamingDecode {
        len: Size,
        sink: Size,
        local: Size,
    },
    DenseDecode {
        pages: Vec<u32>,
        len: Size,
        page_tokens: Size,
        selection: Option<Vec<Size>>,
    },
    KeyStats {
        head_dim: Size,
        kmin: u8,
        kmax: u8,
        keys: u8,
        logical_tokens: Size,
    },
    Reuse(Size),
}

/// A [`SparsityConfig`] with every field drawn.
#[derive(Arbitrary, Debug)]
struct Config {
    sink_tokens: Size,
    local_tokens: Size,
    token_budget: Size,
    page_tokens: Size,
    logical_page_tokens: Size,
    reuse_interval: Size,
    dynamic_min_len: Size,
    mean: bool,
    first_page: bool,
    scale: Option<f32>,
    logical_units: bool,
}

impl Config {
    fn get(&self) -> SparsityConfig {
        SparsityConfig {
            sink_tokens: self.sink_tokens.get(),
            local_tokens: self.local_tokens.get(),
            token_budget: self.token_budget.get(),
            page_tokens: self.page_tokens.get(),
            logical_page_tokens: self.logical_page_tokens.get(),
            reuse_interval: self.reuse_interval.get(),
            dynamic_min_len: self.dynamic_min_len.get(),
            gqa_aggregation: if self.mean {
                GqaAggregation::Mean
            } else {
                GqaAggregation::Max
            },
            always_include_first_page: self.first_page,
            softmax_scale: self.scale,
            stats_format: Default::default(),
            selection_unit: if self.logical_units {
                SelectionUnit::LogicalPage
            } else {
                SelectionUnit::PhysicalPage
            },
        }
    }
}

/// A pattern over a small geometry (the size checks concern the other arguments): up to 3
/// layers of up to 16 KV heads, head dim 64 or 128.
#[derive(Arbitrary, Debug)]
struct SmallPattern {
    layers: u8,
    kv_heads: u8,
    wide: bool,
    kinds: u64,
}

impl SmallPattern {
    fn get(&self) -> HeadPattern {
        let layers = 1 + self.layers as usize % 3;
        let kv = 1 + self.kv_heads as usize % 16;
        let g = ModelGeometry::new(layers, kv, kv, if self.wide { 128 } else { 64 })
            .expect("a served geometry");
        let kinds = (0..layers)
            .map(|l| {
                (0..kv)
                    .map(|h| match self.kinds >> ((l * kv + h) % 64) & 1 {
                        1 => HeadKind::Streaming,
                        _ => HeadKind::Dense,
                    })
                    .collect()
            })
            .collect();
        HeadPattern::from_kinds(g, kinds).expect("shape matches")
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let u = Unstructured::new(data);
    let Ok(calls) = Vec::<Call>::arbitrary_take_rest(u) else {
        return;
    };
    for call in calls.into_iter().take(8) {
        one(call);
    }
}

fn one(call: Call) {
    match call {
        Call::Geometry {
            layers,
            q_heads,
            kv_heads,
            head_dim,
            q_head,
        } => geometry(
            layers.get(),
            q_heads.get(),
            kv_heads.get(),
            head_dim.get(),
            q_head.get(),
        ),
        Call::Config {
            config,
            len,
            step,
            head_dim,
            max_seq_len,
        } => config_rules(
            &config.get(),
            len.get(),
            step,
            head_dim.get(),
            max_seq_len.get(),
        ),
        Call::TokenPattern { sink, local, t, j } => {
            let (sink, local, t, j) = (sink.get(), local.get(), t.get(), j.get());
            let p = TokenPattern::Lambda {
                sink_tokens: sink,
                local_tokens: local,
            };
            match p.validate() {
                Ok(()) => assert!(local > 0),
                Err(LserveError::InvalidConfig {
                    field: "local_tokens",
                    ..
                }) => assert_eq!(local, 0),
                Err(e) => panic!("TokenPattern::validate: {e:?}"),
            }
            assert!(TokenPattern::Causal.validate().is_ok());
            let want = j <= t && (j < sink || t - j < local);
            assert_eq!(p.visible(t, j), want);
            assert_eq!(token_visible(HeadKind::Streaming, t, j, sink, local), want);
            assert_eq!(TokenPattern::Causal.visible(t, j), j <= t);
        }
        Call::StreamingStore {
            slots,
            sink,
            local,
            t,
            len,
        } => streaming_store(slots.get(), sink.get(), local.get(), t.get(), len.get()),
        Call::IndexTables {
            pattern,
            slots,
            entry_capacity,
            pool_capacity,
        } => {
            let pattern = pattern.get();
            let (slots, cap, pool) = (slots.get(), entry_capacity.get(), pool_capacity.get());
            let sizes_ok = in_u32_range(slots) && in_u32_range(cap) && in_u32_range(pool);
            let per_layer: Vec<Option<usize>> = (0..pattern.geometry().layers())
                .map(|l| product(&[slots, pattern.dense_heads(l), cap, 4]))
                .collect();
            let overflow = per_layer
                .iter()
                .any(|p| p.is_none_or(|b| b > isize::MAX as usize));
            let total: usize = per_layer
                .iter()
                .map(|p| p.unwrap_or(usize::MAX) / 4)
                .fold(0, usize::saturating_add);
            if sizes_ok && !overflow && total.saturating_add(slots) > ALLOC_BUDGET {
                return; // valid, but too much memory to allocate here
            }
            match IndexTables::new(&pattern, slots, cap, pool) {
                Ok(t) => {
                    assert!(sizes_ok && !overflow);
                    assert_eq!(t.layers(), pattern.geometry().layers());
                    assert_eq!(t.pool_capacity(), pool);
                    for l in 0..t.layers() {
                        let lt = t.layer(l).unwrap();
                        assert_eq!(
                            (lt.slots(), lt.heads(), lt.entry_capacity()),
                            (slots, pattern.dense_heads(l), cap)
                        );
                        assert_eq!(lt.pages().len(), slots * lt.heads() * cap);
                        assert!(lt.pages().iter().all(|&p| p == PAD_PAGE));
                    }
                    assert!(t.layer(t.layers()).is_err());
                }
                Err(LserveError::InvalidConfig { .. }) => assert!(!sizes_ok || overflow),
                Err(e) => panic!("IndexTables::new: {e:?}"),
            }
        }
        Call::BlockMask {
            q_heads,
            seq_len,
            fill,
            words,
        } => {
            let (q_heads, seq_len) = (q_heads.get(), seq_len.get());
            let blocks = num_blocks(seq_len);
            let wpr = blocks.div_ceil(32);
            let count = product(&[q_heads, blocks, wpr, 4]);
            let overflow = count.is_none_or(|b| b > isize::MAX as usize);
            let empty = q_heads == 0 || seq_len == 0;
            // `new` visits every (head, q block, kv block).
            let work = product(&[q_heads, blocks, blocks]);
            if !empty && !overflow && work.is_none_or(|w| w > ALLOC_BUDGET) {
                return;
            }
            match BlockMask::new(q_heads, seq_len, fill) {
                Ok(m) => {
                    assert!(!empty && !overflow);
                    assert_eq!(
                        (m.q_heads(), m.blocks(), m.words_per_row()),
                        (q_heads, blocks, wpr)
                    );
                    let last = blocks - 1;
                    assert_eq!(m.get(q_heads - 1, last, last).unwrap(), fill);
                    assert!(m.get(q_heads, 0, 0).is_err());
                    assert!(m.get(0, blocks, 0).is_err());
                    assert!(m.get(0, 0, blocks).is_err());
                    assert!(m.check_shape(q_heads, seq_len).is_ok());
                    let words = words
                        .into_iter()
                        .cycle()
                        .take(m.words().len())
                        .collect::<Vec<_>>();
                    let stray = blocks % 32 != 0
                        && words.len() == m.words().len()
                        && words.chunks(wpr).any(|r| r[wpr - 1] >> (blocks % 32) != 0);
                    match BlockMask::from_words(q_heads, seq_len, words.clone()) {
                        Ok(m2) => {
                            assert!(words.len() == m.words().len() && !stray);
                            assert_eq!(m2.words(), &words[..]);
                        }
                        Err(LserveError::ShapeMismatch { .. }) => {
                            assert_ne!(words.len(), m.words().len())
                        }
                        Err(LserveError::InvalidArgument { .. }) => assert!(stray),
                        Err(e) => panic!("from_words: {e:?}"),
                    }
                }
                Err(LserveError::Empty(_)) => assert!(empty),
                Err(LserveError::InvalidArgument { .. }) => assert!(overflow && !empty),
                Err(e) => panic!("BlockMask::new: {e:?}"),
            }
        }
        Call::HostKvCache {
            pattern,
            config,
            capacity,
            slots,
        } => {
            let pattern = pattern.get();
            let config = config.get();
            let (capacity, slots) = (capacity.get(), slots.get());
            let valid = config.validate().is_ok();
            let g = *pattern.geometry();
            let rows = config.sink_tokens.saturating_add(config.local_tokens);
            let mut overflow = false;
            let mut total = 0usize;
            for l in 0..g.layers() {
                let kv = product(&[
                    capacity,
                    pattern.dense_heads(l),
                    config.page_tokens,
                    g.head_dim(),
                    2,
                ]);
                let ring = product(&[slots, pattern.streaming_heads(l), rows, g.head_dim(), 2]);
                overflow |= kv.is_none_or(|b| b > isize::MAX as usize)
                    || ring.is_none_or(|b| b > isize::MAX as usize);
                total = total
                    .saturating_add(kv.unwrap_or(usize::MAX) / 2)
                    .saturating_add(ring.unwrap_or(usize::MAX) / 2);
            }
            let sizes_ok = in_u32_range(slots) && capacity != 0 && capacity < PAD_PAGE as usize;
            if valid
                && sizes_ok
                && !overflow
                && total.saturating_add(capacity).saturating_add(slots) > ALLOC_BUDGET
            {
                return;
            }
            match HostKvCache::<bf16>::new(&pattern, &config, capacity, slots) {
                Ok(c) => {
                    assert!(valid && sizes_ok && !overflow);
                    assert_eq!(c.layers(), g.layers());
                    for l in 0..g.layers() {
                        let d = c.dense(l).unwrap();
                        assert_eq!(d.layout().capacity as usize, capacity);
                        assert_eq!(
                            d.k().len(),
                            capacity * pattern.dense_heads(l) * config.page_tokens * g.head_dim()
                        );
                        let st = c.streaming(l).unwrap();
                        assert_eq!(
                            st.k().len(),
                            slots * pattern.streaming_heads(l) * rows * g.head_dim()
                        );
                    }
                    assert!(c.dense(g.layers()).is_err() && c.streaming(g.layers()).is_err());
                }
                Err(LserveError::InvalidConfig { .. }) => assert!(!valid || !sizes_ok || overflow),
                Err(e) => panic!("HostKvCache::new: {e:?}"),
            }
        }
        Call::PagePool(capacity) => {
            let capacity = capacity.get();
            let ok = capacity != 0 && capacity < PAD_PAGE as usize;
            if ok && capacity > ALLOC_BUDGET {
                return;
            }
            match PagePool::new(capacity) {
                Ok(p) => {
                    assert!(ok);
                    assert_eq!(
                        (p.capacity(), p.free_pages(), p.used_pages()),
                        (capacity, capacity, 0)
                    );
                }
                Err(LserveError::InvalidConfig {
                    field: "capacity_pages",
                    ..
                }) => assert!(!ok),
                Err(e) => panic!("PagePool::new: {e:?}"),
            }
        }
        Call::Manager {
            pattern,
            config,
            capacity,
            slots,
            max_seq_len,
        } => {
            let pattern = pattern.get();
            let config = config.get();
            let (capacity, slots, max_seq_len) = (capacity.get(), slots.get(), max_seq_len.get());
            let valid = config.validate().is_ok();
            let ok = valid
                && capacity != 0
                && capacity < PAD_PAGE as usize
                && in_u32_range(slots)
                && in_u32_range(max_seq_len);
            if ok && capacity.saturating_add(slots) > ALLOC_BUDGET {
                return;
            }
            let g = *pattern.geometry();
            match KvCacheManager::new(g, pattern, config, capacity, slots, max_seq_len) {
                Ok(mut m) => {
                    assert!(ok);
                    assert_eq!((m.max_sequences(), m.max_seq_len()), (slots, max_seq_len));
                    assert_eq!(
                        m.max_pages_per_seq(),
                        max_seq_len.div_ceil(config.page_tokens)
                    );
                    assert_eq!(m.pool().capacity(), capacity);
                    let entry = IndexTables::entry_capacity_for(m.config(), max_seq_len);
                    let units = m.max_pages_per_seq() * m.config().units_per_page();
                    assert!(entry >= 1 && entry <= units.max(1));
                    for l in 0..g.layers() {
                        let pl = m.paged_layout(l);
                        assert_eq!(pl.capacity as usize, capacity);
                        let sl = m.streaming_layout(l);
                        assert_eq!(sl.slots as usize, slots);
                    }
                    if slots.saturating_mul(m.max_pages_per_seq()) <= ALLOC_BUDGET {
                        let a = m.add_sequence().unwrap();
                        let _ = m.reserve(a, max_seq_len);
                        let t = m.device_block_tables();
                        assert_eq!(t.pages.len(), slots * m.max_pages_per_seq());
                    }
                }
                Err(LserveError::InvalidConfig { .. }) => assert!(!ok),
                Err(e) => panic!("KvCacheManager::new: {e:?}"),
            }
        }
        Call::Prefill {
            streaming,
            seq_len,
            sink,
            local,
            q_block,
            kv_block,
        } => {
            let shape = PrefillShape {
                kind: if streaming {
                    HeadKind::Streaming
                } else {
                    HeadKind::Dense
                },
                seq_len: seq_len.get(),
                sink_tokens: sink.get(),
                local_tokens: local.get(),
            };
            let valid = shape.seq_len > 0 && !(streaming && shape.local_tokens == 0);
            assert_eq!(shape.validate().is_ok(), valid);
            let (qb, kb) = (q_block.get(), kv_block.get());
            let cov = shape.coverage(qb, kb);
            let blocks = shape.num_blocks();
            if qb >= blocks || kb >= blocks || kb > qb {
                assert_eq!(
                    cov,
                    BlockCoverage::Empty,
                    "block past the end or above the diagonal"
                );
            }
            match prefill_blocks(&shape, qb, None) {
                Ok(it) => {
                    assert!(valid && qb < blocks);
                    let mut last = None;
                    for b in it.take(64) {
                        assert!(b.kv_block <= qb);
                        assert!(last.is_none_or(|l| l < b.kv_block));
                        let c = shape.coverage(qb, b.kv_block);
                        assert_ne!(c, BlockCoverage::Empty);
                        assert_eq!(b.needs_mask, c == BlockCoverage::Partial);
                        last = Some(b.kv_block);
                    }
                }
                Err(_) => assert!(!valid || qb >= blocks),
            }
            // The diagonal block is visible whenever the shape is valid.
            if valid {
                let q = qb % blocks;
                assert_ne!(shape.coverage(q, q), BlockCoverage::Empty);
            }
        }
        Call::StreamingDecode { len, sink, local } => {
            let (len, sink, local) = (len.get(), sink.get(), local.get());
            match streaming_decode_tokens(len, sink, local) {
                Ok(it) => {
                    assert!(len > 0 && local > 0);
                    let mut it = it;
                    let mut prev = None;
                    for t in it.by_ref().take(16) {
                        assert!(
                            t.pos < len && StreamingStore::is_resident(t.pos, len, sink, local)
                        );
                        assert!(prev.is_none_or(|p| p < t.pos));
                        assert_eq!(t.row, StreamingStore::ring_row(t.pos, sink, local).unwrap());
                        assert!(t.row < sink.saturating_add(local));
                        prev = Some(t.pos);
                    }
                }
                Err(LserveError::Empty(_)) => assert_eq!(len, 0),
                Err(LserveError::InvalidConfig { .. }) => assert!(len > 0 && local == 0),
                Err(e) => panic!("streaming_decode_tokens: {e:?}"),
            }
        }
        Call::DenseDecode {
            pages,
            len,
            page_tokens,
            selection,
        } => {
            let table = BlockTable::from_pages(pages.into_iter().take(16).collect());
            let (len, pt) = (len.get(), page_tokens.get());
            let selection: Option<Vec<usize>> =
                selection.map(|s| s.into_iter().take(16).map(Size::get).collect());
            match dense_decode_pages(&table, len, pt, selection.as_deref()) {
                Ok(it) => {
                    assert!(len > 0 && pt > 0);
                    let n = len.div_ceil(pt);
                    assert!(table.len() >= n);
                    let want = selection.as_ref().map_or(n, Vec::len);
                    assert_eq!(it.len(), want);
                    for p in it {
                        assert!(p.logical < n);
                        assert_eq!(p.physical, table.pages()[p.logical]);
                        assert!(p.tokens.start < p.tokens.end && p.tokens.end <= len);
                        assert!(p.tokens.end - p.tokens.start <= pt);
                    }
                }
                Err(LserveError::Empty(_)) => assert_eq!(len, 0),
                Err(LserveError::InvalidConfig { .. }) => assert!(len > 0 && pt == 0),
                Err(LserveError::InvalidArgument { .. }) => {}
                Err(e) => panic!("dense_decode_pages: {e:?}"),
            }
        }
        Call::KeyStats {
            head_dim,
            kmin,
            kmax,
            keys,
            logical_tokens,
        } => {
            let d = head_dim.get();
            let f = |n: u8| vec![0.5f32; n as usize];
            match KeyStats::new(d, f(kmin), f(kmax)) {
                Ok(s) => {
                    assert!(d > 0 && (kmin as usize).is_multiple_of(d) && kmin == kmax);
                    for p in 0..s.pages() {
                        assert_eq!(s.kmin(p).len(), d);
                        assert_eq!(s.kmax(p).len(), d);
                    }
                }
                Err(_) => assert!(d == 0 || !(kmin as usize).is_multiple_of(d) || kmin != kmax),
            }
            let n = logical_tokens.get();
            match key_stats(&f(keys), d, n) {
                Ok(s) => {
                    assert!(d > 0 && n > 0 && (keys as usize).is_multiple_of(d));
                    let rows = keys as usize / d;
                    assert_eq!(s.pages(), rows.div_ceil(n));
                }
                Err(_) => assert!(
                    d == 0
                        || n == 0
                        || !(keys as usize).is_multiple_of(d)
                        || n.checked_mul(d).is_none()
                ),
            }
        }
        Call::Reuse(interval) => {
            let c = interval.get();
            match ReuseState::new(c) {
                Ok(r) => assert!(c > 0 && r.interval() == c),
                Err(_) => assert_eq!(c, 0),
            }
        }
    }
}

fn geometry(layers: usize, q: usize, kv: usize, d: usize, q_head: usize) {
    let field = [
        ("layers", layers),
        ("q_heads", q),
        ("kv_heads", kv),
        ("head_dim", d),
    ]
    .into_iter()
    .find(|&(_, v)| !in_u32_range(v))
    .map(|(f, _)| f)
    .or_else(|| (!q.is_multiple_of(kv)).then_some("kv_heads"))
    .or_else(|| (q / kv > ModelGeometry::MAX_GROUP).then_some("group"))
    .or_else(|| (!ModelGeometry::SUPPORTED_HEAD_DIMS.contains(&d)).then_some("head_dim"));
    match (ModelGeometry::new(layers, q, kv, d), field) {
        (Ok(g), None) => {
            assert_eq!(
                (g.layers(), g.q_heads(), g.kv_heads(), g.head_dim()),
                (layers, q, kv, d)
            );
            assert_eq!(g.group(), q / kv);
            assert_eq!(g.kv_head_of(q_head), q_head / (q / kv));
            assert_eq!(g.total_kv_heads() as u128, layers as u128 * kv as u128);
            assert!(g.default_softmax_scale().is_finite());
        }
        (Err(LserveError::InvalidConfig { field: f, .. }), Some(want)) => {
            assert_eq!(f, want, "ModelGeometry::new({layers}, {q}, {kv}, {d})")
        }
        (r, want) => {
            panic!("ModelGeometry::new({layers}, {q}, {kv}, {d}): {r:?}, rules say {want:?}")
        }
    }
}

/// The first rule of `validate`'s documented order that `c` breaks, by field name.
fn broken_rule(c: &SparsityConfig) -> Option<&'static str> {
    let fits = |v: usize| u32::try_from(v).is_ok();
    if !fits(c.sink_tokens) {
        return Some("sink_tokens");
    }
    if !fits(c.local_tokens) {
        return Some("local_tokens");
    }
    if !fits(c.token_budget) {
        return Some("token_budget");
    }
    if !fits(c.page_tokens) {
        return Some("page_tokens");
    }
    if !fits(c.dynamic_min_len) {
        return Some("dynamic_min_len");
    }
    if c.page_tokens == 0 {
        return Some("page_tokens");
    }
    if c.logical_page_tokens == 0 || !c.page_tokens.is_multiple_of(c.logical_page_tokens) {
        return Some("logical_page_tokens");
    }
    if c.token_budget == 0 || !c.token_budget.is_multiple_of(c.page_tokens) {
        return Some("token_budget");
    }
    if c.local_tokens == 0 {
        return Some("local_tokens");
    }
    if !fits(c.sink_tokens + c.local_tokens) {
        return Some("sink_tokens + local_tokens");
    }
    if c.reuse_interval == 0 {
        return Some("reuse_interval");
    }
    if c.softmax_scale.is_some_and(|s| !(s.is_finite() && s > 0.0)) {
        return Some("softmax_scale");
    }
    None
}

fn config_rules(c: &SparsityConfig, len: usize, step: u64, head_dim: usize, max_seq_len: usize) {
    let rule = broken_rule(c);
    match (c.validate(), rule) {
        (Ok(()), None) => {
            // The helpers' exact values on a valid config.
            assert_eq!(c.pages_per_selection() * c.unit_tokens(), c.token_budget);
            assert_eq!(c.units_per_page() * c.unit_tokens(), c.page_tokens);
            assert_eq!(
                c.logical_per_unit() * c.logical_page_tokens,
                c.unit_tokens()
            );
            assert_eq!(c.units_for_len(len), len.div_ceil(c.unit_tokens()));
            assert_eq!(c.held_selection_pages(), c.pages_per_selection() + 2);
            assert_eq!(c.selection_entry_pages(), c.pages_per_selection() + 3);
            assert_eq!(c.logical_per_page() * c.logical_page_tokens, c.page_tokens);
            assert_eq!(c.streaming_rows(), c.sink_tokens + c.local_tokens);
            assert_eq!(c.pages_for_len(len), len.div_ceil(c.page_tokens));
            assert_eq!(
                c.is_selection_step(step),
                step.is_multiple_of(c.reuse_interval as u64)
            );
            let entry = IndexTables::entry_capacity_for(c, max_seq_len);
            assert!(entry >= 1);
            assert!(
                entry
                    <= (c
                        .pages_for_len(max_seq_len)
                        .saturating_mul(c.units_per_page()))
                    .max(1)
            );
            assert!(StreamingStore::new(1, c.sink_tokens, c.local_tokens).is_ok());
            if let Some(s) = c.softmax_scale {
                assert_eq!(c.softmax_scale_for(head_dim), s);
            }
        }
        (Err(LserveError::InvalidConfig { field, .. }), Some(want)) => {
            assert_eq!(field, want, "{c:?}")
        }
        (r, want) => panic!("validate({c:?}): {r:?}, rules say {want:?}"),
    }
    // The helpers never panic, whatever the config.
    let _ = (
        c.pages_per_selection(),
        c.held_selection_pages(),
        c.selection_entry_pages(),
        c.logical_per_page(),
        c.unit_tokens(),
        c.units_per_page(),
        c.logical_per_unit(),
        c.units_for_len(len),
        c.streaming_rows(),
        c.pages_for_len(len),
        c.softmax_scale_for(head_dim),
        c.uses_page_selection(len),
        c.is_selection_step(step),
        c.selects_at(len, step),
        IndexTables::entry_capacity_for(c, max_seq_len),
    );
}

fn streaming_store(slots: usize, sink: usize, local: usize, t: usize, len: usize) {
    let rows_ok = sink
        .checked_add(local)
        .is_some_and(|r| u32::try_from(r).is_ok());
    let ok = in_u32_range(slots) && local > 0 && rows_ok;
    match StreamingStore::ring_row(t, sink, local) {
        Ok(row) => {
            assert!(local > 0);
            let want = if t < sink {
                t
            } else {
                sink + (t - sink) % local
            };
            assert_eq!(row, want);
        }
        Err(LserveError::InvalidConfig { .. }) => assert_eq!(local, 0),
        Err(e) => panic!("ring_row: {e:?}"),
    }
    let resident = StreamingStore::is_resident(t, len, sink, local);
    assert_eq!(resident, t < len && (t < sink || len - t <= local));
    let mut positions = StreamingStore::resident_positions(len, sink, local);
    for p in positions.by_ref().take(4) {
        assert!(
            StreamingStore::is_resident(p, len, sink, local),
            "{p} of {len}"
        );
    }
    if let Some(p) = positions.next_back() {
        assert!(StreamingStore::is_resident(p, len, sink, local));
    }
    if ok && slots > ALLOC_BUDGET {
        return;
    }
    match StreamingStore::new(slots, sink, local) {
        Ok(mut s) => {
            assert!(ok);
            assert_eq!(
                (s.slots(), s.sink_tokens(), s.local_tokens(), s.rows()),
                (slots, sink, local, sink + local)
            );
            assert_eq!(
                s.row_of_token(t),
                StreamingStore::ring_row(t, sink, local).unwrap()
            );
            let layout = s.layout(1, 64);
            assert_eq!(layout.rows() as usize, sink + local);
            assert_eq!(s.acquire().unwrap(), 0);
            assert!(s.release(slots as u32).is_err());
            s.release(0).unwrap();
            assert!(s.release(0).is_err());
        }
        Err(LserveError::InvalidConfig { .. }) => assert!(!ok),
        Err(e) => panic!("StreamingStore::new: {e:?}"),
    }
}
