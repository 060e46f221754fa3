//! The reference on the crate's paged KV cache: key-statistics pooling and update, decode
//! attention over index tables, and a whole decode step of one layer for a batch.
//!
//! These take what a GPU decode step takes: the [`KvCacheManager`] (lengths, block tables,
//! slots, decode step counters), the cache contents ([`HostKvCache`], same layout as the
//! device), the [`IndexTables`], and the activations `q [B][Hq][D]`, `k`, `v [B][Hkv][D]` in the
//! element type.
//!
//! A model's decode step with this reference: for each sequence of the batch
//! [`KvCacheManager::reserve`] one token; for each layer [`decode_step`]; then for each sequence
//! [`KvCacheManager::advance_decode_step`].

use std::ops::Range;

use super::attend::{attend_rows, check_len};
use super::{select_pages, KeyStats, ReuseKey, ReuseState, Selection, SelectionParams};
use crate::dtype::Element;
use crate::error::{LserveError, Result};
use crate::head_pattern::HeadKind;
use crate::index_table::IndexTables;
use crate::paging::{HostKvCache, KvCacheManager, SeqId, SequenceView, StreamingStore};

fn to_f32<E: Element>(xs: &[E]) -> Vec<f32> {
    xs.iter().map(|x| x.to_f32()).collect()
}

/// Pools the key statistics of every dense head of `layer` for the logical pages that hold a
/// token of `tokens`: each such page's `kmin`/`kmax` is recomputed from the keys in the cache,
/// over the page's tokens that exist (below `view.len`). Call after writing those tokens (e.g.
/// after prefill).
///
/// Errors: `TokenNotStored` if `tokens` reaches past `view.len`; the cache's errors for a bad
/// layer, block table or page.
pub fn pool_key_stats<E: Element>(
    cache: &mut HostKvCache<E>,
    layer: usize,
    view: &SequenceView<'_>,
    tokens: Range<usize>,
) -> Result<()> {
    if tokens.end > view.len {
        return Err(LserveError::TokenNotStored {
            position: tokens.end - 1,
            len: view.len,
        });
    }
    if tokens.is_empty() {
        return Ok(());
    }
    let config = *cache.config();
    let (n_p, n_l) = (config.page_tokens, config.logical_page_tokens);
    let dense = cache.pattern().dense_heads(layer);
    let d = cache.pattern().geometry().head_dim();
    for head in 0..dense {
        for logical in tokens.start / n_l..=(tokens.end - 1) / n_l {
            let rows = logical * n_l..((logical + 1) * n_l).min(view.len);
            let page = view.block_table.physical(rows.start / n_p)?;
            let pool = cache.dense(layer)?;
            let keys = rows
                .map(|t| pool.key(page, head, t % n_p).map(to_f32))
                .collect::<Result<Vec<_>>>()?;
            let (lo, hi) = super::page_stats(keys.iter().map(Vec::as_slice));
            debug_assert_eq!(lo.len(), d);
            let (kmin, kmax) =
                cache
                    .dense_mut(layer)?
                    .stats_mut(page, head, (logical * n_l % n_p) / n_l)?;
            for i in 0..d {
                kmin[i] = E::from_f32(lo[i]);
                kmax[i] = E::from_f32(hi[i]);
            }
        }
    }
    Ok(())
}

/// Updates the key statistics of every dense head of `layer` for a token just written at
/// position `pos`: its logical page's `kmin`/`kmax` become the key itself if `pos` starts the
/// logical page, else their per-channel min/max with the key.
///
/// Errors as [`pool_key_stats`].
pub fn update_key_stats<E: Element>(
    cache: &mut HostKvCache<E>,
    layer: usize,
    view: &SequenceView<'_>,
    pos: usize,
) -> Result<()> {
    if pos >= view.len {
        return Err(LserveError::TokenNotStored {
            position: pos,
            len: view.len,
        });
    }
    let config = *cache.config();
    let (n_p, n_l) = (config.page_tokens, config.logical_page_tokens);
    let page = match cache.pattern().dense_heads(layer) {
        0 => return Ok(()),
        _ => view.block_table.physical(pos / n_p)?,
    };
    for head in 0..cache.pattern().dense_heads(layer) {
        let key = cache.dense(layer)?.key(page, head, pos % n_p)?.to_vec();
        let (kmin, kmax) = cache
            .dense_mut(layer)?
            .stats_mut(page, head, (pos % n_p) / n_l)?;
        let first = pos % n_l == 0;
        for ((lo, hi), &x) in kmin.iter_mut().zip(kmax.iter_mut()).zip(&key) {
            if first || x.to_f32() < lo.to_f32() {
                *lo = x;
            }
            if first || x.to_f32() > hi.to_f32() {
                *hi = x;
            }
        }
    }
    Ok(())
}

/// Writes tokens `first..first + n` of a sequence into `layer` of the cache (`k`, `v` are
/// `[n][Hkv][D]`) and pools the dense heads' key statistics over them: what prefill does to
/// the cache. The tokens must have been reserved (`first + n <= view.len`).
///
/// ```
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::{HostKvCache, KvCacheManager};
/// use lserve::reference::decode_step::write_tokens;
///
/// let g = ModelGeometry::new(1, 1, 1, 64)?;
/// let config = SparsityConfig { page_tokens: 4, logical_page_tokens: 2, token_budget: 4,
///                               ..Default::default() };
/// let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), config, 4, 1, 16)?;
/// let mut cache = HostKvCache::<bf16>::for_manager(&mgr)?;
/// let seq = mgr.add_sequence()?;
/// mgr.reserve(seq, 3)?;
/// let k: Vec<bf16> = (0..3 * 64).map(|i| bf16::from_f32((i % 7) as f32)).collect();
/// write_tokens(&mut cache, 0, &mgr.view(seq)?, 0, &k, &k)?;
/// let page = mgr.block_table(seq)?.physical(0)?;
/// let (kmin, kmax) = cache.dense(0)?.stats(page, 0, 1)?; // logical page 1: token 2 only
/// assert_eq!((kmin, kmax), (&k[128..192], &k[128..192]));
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn write_tokens<E: Element>(
    cache: &mut HostKvCache<E>,
    layer: usize,
    view: &SequenceView<'_>,
    first: usize,
    k: &[E],
    v: &[E],
) -> Result<()> {
    let g = *cache.pattern().geometry();
    let row = g.kv_heads() * g.head_dim();
    check_len("k", k.len() / row * row, k.len())?;
    check_len("v", k.len(), v.len())?;
    let n = k.len() / row;
    if first + n > view.len {
        return Err(LserveError::TokenNotStored {
            position: first + n - 1,
            len: view.len,
        });
    }
    for i in 0..n {
        cache.write_token(
            layer,
            view,
            first + i,
            &k[i * row..][..row],
            &v[i * row..][..row],
        )?;
    }
    pool_key_stats(cache, layer, view, first..first + n)
}

/// The stored key statistics of dense KV head `kv_head` of `layer` for a sequence: its
/// `ceil(len / N_L)` logical pages in order, read from the cache (as `f32`).
///
/// Errors: `InvalidArgument` if `kv_head` is not dense; the cache's errors otherwise.
pub fn stored_key_stats<E: Element>(
    cache: &HostKvCache<E>,
    layer: usize,
    view: &SequenceView<'_>,
    kv_head: usize,
) -> Result<KeyStats> {
    let head = dense_index(cache, layer, kv_head)?;
    let config = cache.config();
    let (n_p, n_l) = (config.page_tokens, config.logical_page_tokens);
    let d = cache.pattern().geometry().head_dim();
    let mut stats = KeyStats {
        head_dim: d,
        kmin: Vec::new(),
        kmax: Vec::new(),
    };
    for logical in 0..view.len.div_ceil(n_l) {
        let page = view.block_table.physical(logical * n_l / n_p)?;
        let (lo, hi) = cache
            .dense(layer)?
            .stats(page, head, (logical * n_l % n_p) / n_l)?;
        stats.kmin.extend(lo.iter().map(|x| x.to_f32()));
        stats.kmax.extend(hi.iter().map(|x| x.to_f32()));
    }
    Ok(stats)
}

fn dense_index<E: Element>(cache: &HostKvCache<E>, layer: usize, kv_head: usize) -> Result<usize> {
    let pattern = cache.pattern();
    if layer >= pattern.geometry().layers() || kv_head >= pattern.geometry().kv_heads() {
        return Err(LserveError::InvalidArgument {
            what: "layer / kv_head",
            reason: format!("({layer}, {kv_head}) out of range"),
        });
    }
    pattern
        .dense_index(layer, kv_head)
        .ok_or_else(|| LserveError::InvalidArgument {
            what: "kv_head",
            reason: format!("KV head {kv_head} of layer {layer} is streaming"),
        })
}

/// Page selection for dense KV head `kv_head` of `layer` from the cache's stored statistics:
/// `q_group` is the group's queries `[G][D]` (as `f32`). See [`select_pages`].
pub fn select_from_cache<E: Element>(
    cache: &HostKvCache<E>,
    layer: usize,
    view: &SequenceView<'_>,
    kv_head: usize,
    q_group: &[f32],
) -> Result<Selection> {
    let stats = stored_key_stats(cache, layer, view, kv_head)?;
    let c = cache.config();
    let params = SelectionParams {
        logical_per_page: c.logical_per_page(),
        top_k: c.pages_per_selection(),
        always_include_first: c.always_include_first_page,
        aggregation: c.gqa_aggregation,
    };
    select_pages(q_group, &stats, &params)
}

/// Validates a batch: non-empty, distinct live sequences of at least one token, `q` of
/// `[B][Hq][D]` elements; returns the views.
fn batch_views<'m, E: Element>(
    mgr: &'m KvCacheManager,
    cache: &HostKvCache<E>,
    layer: usize,
    seqs: &[SeqId],
    q: &[E],
) -> Result<Vec<SequenceView<'m>>> {
    if seqs.is_empty() {
        return Err(LserveError::Empty("batch"));
    }
    let g = mgr.geometry();
    if cache.pattern() != mgr.pattern() || cache.config() != mgr.config() {
        return Err(LserveError::InvalidArgument {
            what: "cache",
            reason: "built for another pattern or config than the manager".into(),
        });
    }
    if layer >= g.layers() {
        return Err(LserveError::InvalidArgument {
            what: "layer",
            reason: format!("{layer} is not below {}", g.layers()),
        });
    }
    check_len("q", seqs.len() * g.q_heads() * g.head_dim(), q.len())?;
    let mut sorted = seqs.to_vec();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1]) {
        return Err(LserveError::InvalidArgument {
            what: "seqs",
            reason: "a sequence appears twice in the batch".into(),
        });
    }
    seqs.iter()
        .map(|&s| {
            let view = mgr.view(s)?;
            if view.len == 0 {
                return Err(LserveError::Empty("sequence"));
            }
            Ok(view)
        })
        .collect()
}

/// Decode attention of one layer for a batch, reading only the index tables and the cache:
/// each query head of a dense KV head attends over the tokens of the physical pages in its
/// (sequence slot, dense head) entry of `tables` (a page's tokens that exist: all `N_P` but for
/// the sequence's last page); each query head of a streaming KV head attends over its sink and
/// ring rows (the sinks and the last `local_tokens` tokens). Returns `out [B][Hq][D]`.
///
/// This is also how to check a GPU run whose selection differs on near-ties: run this on the
/// GPU's index tables.
///
/// Errors: `Empty` for an empty batch, a sequence of no tokens or an empty table entry;
/// `InvalidArgument` for a table page that is not one of the sequence's pages, a repeated
/// sequence, a bad layer; `ShapeMismatch` for `q`; `UnknownSequence`.
pub fn decode_attention_tables<E: Element>(
    mgr: &KvCacheManager,
    cache: &HostKvCache<E>,
    tables: &IndexTables,
    layer: usize,
    seqs: &[SeqId],
    q: &[E],
) -> Result<Vec<f64>> {
    let views = batch_views(mgr, cache, layer, seqs, q)?;
    let g = *mgr.geometry();
    let config = mgr.config();
    let (hq, hkv, d, n_p) = (g.q_heads(), g.kv_heads(), g.head_dim(), config.page_tokens);
    let group = g.group();
    let scale = config.softmax_scale_for(d) as f64;
    let pattern = mgr.pattern();
    let mut out = vec![0.0f64; seqs.len() * hq * d];
    for (b, view) in views.iter().enumerate() {
        for kv_head in 0..hkv {
            // The (key, value) rows this head attends, as f32.
            let mut keys: Vec<Vec<f32>> = Vec::new();
            let mut values: Vec<Vec<f32>> = Vec::new();
            match pattern.kind(layer, kv_head) {
                HeadKind::Dense => {
                    let head = pattern.compact_index(layer, kv_head);
                    let entry = tables.get(layer, view.slot as usize, head)?;
                    if entry.is_empty() {
                        return Err(LserveError::Empty("index table entry"));
                    }
                    let pool = cache.dense(layer)?;
                    for &page in entry {
                        let logical = view.block_table.pages().iter().position(|&p| p == page);
                        let logical = logical.ok_or_else(|| LserveError::InvalidArgument {
                            what: "index table entry",
                            reason: format!("page {page} is not in the sequence's block table"),
                        })?;
                        for t in 0..n_p.min(view.len - logical * n_p) {
                            keys.push(to_f32(pool.key(page, head, t)?));
                            values.push(to_f32(pool.value(page, head, t)?));
                        }
                    }
                }
                HeadKind::Streaming => {
                    let (sink, local) = (config.sink_tokens, config.local_tokens);
                    for pos in StreamingStore::resident_positions(view.len, sink, local) {
                        let (k, v) = cache.token(layer, view, kv_head, pos)?;
                        keys.push(to_f32(k));
                        values.push(to_f32(v));
                    }
                }
            }
            let k_rows: Vec<&[f32]> = keys.iter().map(Vec::as_slice).collect();
            let v_rows: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
            for h in kv_head * group..(kv_head + 1) * group {
                let row = (b * hq + h) * d;
                let qh = to_f32(&q[row..row + d]);
                out[row..row + d].copy_from_slice(&attend_rows(&qh, &k_rows, &v_rows, scale).out);
            }
        }
    }
    Ok(out)
}

/// What one (sequence, KV head) did in a [`decode_step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeadVisit {
    /// Dense head with `L <= dynamic_min_len`: every page of the sequence.
    AllPages,
    /// Dense head with page selection: the logical pages attended (ascending) and whether
    /// selection ran on this step (`false`: the held selection plus the newest page).
    Selected {
        /// Logical page numbers, ascending.
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
/// 2. for each dense KV head fills its index-table entry: every page if `L <= dynamic_min_len`,
///    else the selected pages, selection running when due per `reuse` and the sequence's decode
///    step counter ([`KvCacheManager::decode_step`]), in ascending logical order mapped to
///    physical ids;
/// 3. attends ([`decode_attention_tables`]) and returns `out [B][Hq][D]` with what each head
///    visited.
///
/// It does not advance the decode step counters (a model step runs every layer first).
///
/// Errors: as [`decode_attention_tables`], plus `ShapeMismatch` for `k`/`v`; the batch, shape
/// and layer checks run before anything is written.
///
/// ```
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::{HeadKind, HeadPattern};
/// use lserve::index_table::IndexTables;
/// use lserve::paging::{HostKvCache, KvCacheManager};
/// use lserve::reference::decode_step::{decode_step, HeadVisit};
/// use lserve::reference::ReuseState;
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
    // Every check before the first write: a step that fails changes nothing.
    let capacity = tables.layer(layer)?.entry_capacity();
    for view in &views {
        let pages = view.block_table.len();
        let needed = match config.uses_page_selection(view.len) {
            true => pages.min(config.selection_entry_pages()),
            false => pages,
        };
        if needed > capacity {
            return Err(LserveError::InvalidArgument {
                what: "tables",
                reason: format!("an entry may need {needed} pages, the tables hold {capacity}"),
            });
        }
    }
    let pattern = mgr.pattern();
    let group = g.group();
    let mut visits = Vec::with_capacity(seqs.len());
    for (b, (view, &seq)) in views.iter().zip(seqs).enumerate() {
        let pos = view.len - 1;
        let row = hkv * d;
        cache.write_token(layer, view, pos, &k[b * row..][..row], &v[b * row..][..row])?;
        update_key_stats(cache, layer, view, pos)?;
        let step = mgr.decode_step(seq)?;
        let pages_of_seq = view.block_table.len();
        let newest = (pages_of_seq - 1) as u32;
        let mut seq_visits = Vec::with_capacity(hkv);
        for kv_head in 0..hkv {
            let logical_pages: Vec<u32> = match pattern.kind(layer, kv_head) {
                HeadKind::Streaming => {
                    seq_visits.push(HeadVisit::Streaming);
                    continue;
                }
                HeadKind::Dense if !config.uses_page_selection(view.len) => {
                    seq_visits.push(HeadVisit::AllPages);
                    (0..pages_of_seq as u32).collect()
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
            let physical = logical_pages
                .iter()
                .map(|&p| view.block_table.physical(p as usize))
                .collect::<Result<Vec<_>>>()?;
            let head = pattern.compact_index(layer, kv_head);
            tables.set(layer, view.slot as usize, head, &physical)?;
        }
        visits.push(seq_visits);
    }
    let out = decode_attention_tables(mgr, cache, tables, layer, seqs, q)?;
    Ok(DecodeStepOutput { out, visits })
}
