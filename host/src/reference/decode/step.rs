//! A whole decode step of one layer for a batch: the append, the selection with reuse, the
//! index tables, the attention (the launches of [`DecodeStep`](crate::gpu::DecodeStep)).

use super::{batch_views, decode_attention_tables};
use crate::dtype::Element;
use crate::error::{LserveError, Result};
use crate::head_pattern::HeadKind;
use crate::index_table::IndexTables;
use crate::paging::{HostKvCache, KvCacheManager, SeqId};
use crate::reference::kv_write::update_key_stats;
use crate::reference::select::{select_from_cache, ReuseKey, ReuseState};
use crate::reference::{check_len, to_f32};

/// What one (sequence, KV head) did in a [`decode_step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeadVisit {
    /// Dense head with `L <= dynamic_min_len`: every page of the sequence.
    AllPages,
    /// Dense head with page selection: the units attended (ascending) and whether selection
    /// ran on this step (`false`: the held selection plus the newest unit).
    Selected {
        /// The units' numbers in the sequence (pages: block-table indices; logical pages: the
        /// sequence's logical page numbers, [`SparsityConfig::unit_tokens`](crate::config::SparsityConfig::unit_tokens)
        /// tokens each), ascending.
        pages: Vec<u32>,
        /// Whether selection ran on this step.
        selected_now: bool,
    },
    /// Streaming head: the sinks and the ring.
    Streaming,
}

/// The result of [`decode_step`].
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeStepOutput {
    /// `[B][Hq][D]`.
    pub out: Vec<f64>,
    /// `[B][Hkv]`: what each KV head of each sequence visited.
    pub visits: Vec<Vec<HeadVisit>>,
}

impl DecodeStepOutput {
    /// The output rounded to `f32` (`[B][Hq][D]`).
    pub fn out_f32(&self) -> Vec<f32> {
        self.out.iter().map(|&x| x as f32).collect()
    }
}

/// One decode step of `layer` for a batch of sequences, exactly as `docs/ARCHITECTURE.md`
/// ("Semantics pinned down here", "The GPU decode step"): for each sequence `seqs[b]` (whose
/// step token the caller has already reserved, so `L = len` and the token is position `L - 1`):
/// 1. writes the token's `k`, `v` (`[B][Hkv][D]`) into the cache and updates the dense heads'
///    key statistics;
/// 2. for each dense KV head fills its index-table entry: every unit (page, or logical page:
///    [`SelectionUnit`](crate::config::SelectionUnit)) if `L <= dynamic_min_len`, else the
///    selected units, selection running when due per `reuse` and the sequence's decode step
///    counter ([`KvCacheManager::decode_step`]), in ascending sequence order mapped to ids
///    ([`SparsityConfig::unit_id`](crate::config::SparsityConfig::unit_id) of the physical page);
/// 3. attends ([`decode_attention_tables`]) and returns `out [B][Hq][D]` with what each head
///    visited.
///
/// It does not advance the decode step counters (a model step runs every layer first).
///
/// Errors: as [`decode_attention_tables`], plus `ShapeMismatch` for `k`/`v`; `PageOutOfRange`
/// for a cache or index tables sized for a smaller pool than a sequence's pages;
/// `InvalidArgument` for tables too small (entries, slots, dense heads) or a held selection
/// (`reuse`) that does not fit the sequence. Every check runs before anything is written: on
/// error the cache, the tables and the reuse state are unchanged.
///
/// ```
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::{HeadKind, HeadPattern};
/// use lserve::index_table::IndexTables;
/// use lserve::paging::{HostKvCache, KvCacheManager};
/// use lserve::reference::decode::{decode_step, HeadVisit};
/// use lserve::reference::select::ReuseState;
///
/// let g = ModelGeometry::new(1, 4, 2, 64)?; // GQA: 2 query heads per KV head
/// let pattern = HeadPattern::from_kinds(g, vec![vec![HeadKind::Dense, HeadKind::Streaming]])?;
/// let config = SparsityConfig { page_tokens: 4, logical_page_tokens: 2, token_budget: 4,
///     dynamic_min_len: 8, sink_tokens: 2, local_tokens: 4, ..Default::default() };
/// let mut mgr = KvCacheManager::new(g, pattern, config, 16, 1, 64)?;
/// let mut cache = HostKvCache::<bf16>::for_manager(&mgr)?;
/// let mut tables = IndexTables::for_manager(&mgr)?;
/// let mut reuse = ReuseState::new(config.reuse_interval)?;
/// let seq = mgr.add_sequence()?;
/// let x = |i: usize| bf16::from_f32(((i * 37 % 11) as f32 - 5.0) / 4.0);
/// for step in 0..12 {
///     mgr.reserve(seq, 1)?;
///     let q: Vec<bf16> = (0..4 * 64).map(|i| x(i + step)).collect();
///     let kv: Vec<bf16> = (0..2 * 64).map(|i| x(i * 3 + step)).collect();
///     let o = decode_step(&mgr, &mut cache, &mut tables, &mut reuse, 0, &[seq], &q, &kv, &kv)?;
///     assert!(o.out.iter().all(|v| v.is_finite()));
///     let dense_visit = &o.visits[0][0];
///     assert_eq!(matches!(dense_visit, HeadVisit::AllPages), step < 8); // L = step + 1
///     mgr.advance_decode_step(seq)?;
/// }
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn decode_step<E: Element>(
    mgr: &KvCacheManager,
    cache: &mut HostKvCache<E>,
    tables: &mut IndexTables,
    reuse: &mut ReuseState,
    layer: usize,
    seqs: &[SeqId],
    q: &[E],
    k: &[E],
    v: &[E],
) -> Result<DecodeStepOutput> {
    let views = batch_views(mgr, cache, layer, seqs, q)?;
    let g = *mgr.geometry();
    let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    check_len("k", seqs.len() * hkv * d, k.len())?;
    check_len("v", seqs.len() * hkv * d, v.len())?;
    let config = *mgr.config();
    let pattern = mgr.pattern();
    // Every check before the first write: a step that fails changes nothing.
    let table = tables.layer(layer)?;
    let capacity = table.entry_capacity();
    let dense_heads = pattern.dense_heads(layer);
    if dense_heads > 0 && table.heads() != dense_heads {
        return Err(LserveError::InvalidArgument {
            what: "tables",
            reason: format!(
                "{} dense heads in layer {layer}, the pattern has {dense_heads}",
                table.heads()
            ),
        });
    }
    for (view, &seq) in views.iter().zip(seqs) {
        cache.check_sequence(layer, view)?;
        if dense_heads == 0 {
            continue;
        }
        if view.slot as usize >= table.slots() {
            return Err(LserveError::InvalidArgument {
                what: "tables",
                reason: format!("slot {} is not below {}", view.slot, table.slots()),
            });
        }
        let pool_capacity = tables.pool_capacity();
        let pages = view.block_table.pages();
        if let Some(&page) = pages.iter().find(|&&p| p as usize >= pool_capacity) {
            return Err(LserveError::PageOutOfRange {
                page,
                capacity: pool_capacity as u32,
            });
        }
        let units = config.units_for_len(view.len);
        let needed = match config.uses_page_selection(view.len) {
            true => units.min(config.selection_entry_pages()),
            false => units,
        };
        if needed > capacity {
            return Err(LserveError::InvalidArgument {
                what: "tables",
                reason: format!("an entry may need {needed} pages, the tables hold {capacity}"),
            });
        }
        if config.uses_page_selection(view.len) {
            check_held_selections(mgr, reuse, layer, seq, units, capacity)?;
        }
    }
    let group = g.group();
    let mut visits = Vec::with_capacity(seqs.len());
    for (b, (view, &seq)) in views.iter().zip(seqs).enumerate() {
        let pos = view.len - 1;
        let row = hkv * d;
        cache.write_token(layer, view, pos, &k[b * row..][..row], &v[b * row..][..row])?;
        update_key_stats(cache, layer, view, pos)?;
        let step = mgr.decode_step(seq)?;
        let units_of_seq = config.units_for_len(view.len);
        let newest = (units_of_seq - 1) as u32;
        let per_page = config.units_per_page();
        let mut seq_visits = Vec::with_capacity(hkv);
        for kv_head in 0..hkv {
            let units: Vec<u32> = match pattern.kind(layer, kv_head) {
                HeadKind::Streaming => {
                    seq_visits.push(HeadVisit::Streaming);
                    continue;
                }
                HeadKind::Dense if !config.uses_page_selection(view.len) => {
                    seq_visits.push(HeadVisit::AllPages);
                    (0..units_of_seq as u32).collect()
                }
                HeadKind::Dense => {
                    let key = ReuseKey {
                        seq: seq.get(),
                        layer,
                        kv_head,
                    };
                    let q_group = to_f32(&q[(b * hq + kv_head * group) * d..][..group * d]);
                    let selection = match reuse.selection_due(key, step) {
                        true => Some(select_from_cache(cache, layer, view, kv_head, &q_group)?),
                        false => None,
                    };
                    let (pages, selected_now) = reuse.pages(key, step, newest, || {
                        selection.expect("selection is due").pages
                    });
                    seq_visits.push(HeadVisit::Selected {
                        pages: pages.clone(),
                        selected_now,
                    });
                    pages
                }
            };
            let ids = units
                .iter()
                .map(|&u| {
                    let page = view.block_table.physical(u as usize / per_page)?;
                    Ok(config.unit_id(page, u % per_page as u32))
                })
                .collect::<Result<Vec<_>>>()?;
            let head = pattern.compact_index(layer, kv_head);
            tables.set(layer, view.slot as usize, head, &ids)?;
        }
        visits.push(seq_visits);
    }
    let out = decode_attention_tables(mgr, cache, tables, layer, seqs, q)?;
    Ok(DecodeStepOutput { out, visits })
}

/// Checks that the selections `reuse` holds for `seq`'s dense heads of `layer` that a step
/// reuses (selection not due) fit a sequence of `pages` units and an entry of `capacity`: a
/// held selection from another run (another manager, a freed sequence's id) is an error before
/// the step writes anything.
fn check_held_selections(
    mgr: &KvCacheManager,
    reuse: &ReuseState,
    layer: usize,
    seq: SeqId,
    pages: usize,
    capacity: usize,
) -> Result<()> {
    let step = mgr.decode_step(seq)?;
    for kv_head in 0..mgr.geometry().kv_heads() {
        if mgr.pattern().kind(layer, kv_head) != HeadKind::Dense {
            continue;
        }
        let key = ReuseKey {
            seq: seq.get(),
            layer,
            kv_head,
        };
        let held = match reuse.selection_due(key, step) {
            true => continue,
            false => reuse.held(key).unwrap_or_default(),
        };
        if let Some(&page) = held.iter().find(|&&p| p as usize >= pages) {
            return Err(LserveError::InvalidArgument {
                what: "reuse",
                reason: format!(
                    "the held selection of KV head {kv_head} lists logical page {page}, the \
                     sequence has {pages}"
                ),
            });
        }
        // The entry is the held selection and the newest page, unless the selection ends with
        // it (a selection of every page of a sequence as long as the tables reach, which fills
        // an entry capped at that many pages).
        let ends_with_newest = held.last().is_some_and(|&p| p as usize + 1 == pages);
        if held.len() + usize::from(!ends_with_newest) > capacity {
            return Err(LserveError::InvalidArgument {
                what: "reuse",
                reason: format!(
                    "the held selection of KV head {kv_head} has {} pages, the tables hold \
                     {capacity} per entry",
                    held.len()
                ),
            });
        }
    }
    Ok(())
}
