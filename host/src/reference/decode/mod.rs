//! The reference of `lserve-kernels`' `decode`: decode attention, and a whole decode step of a
//! layer for a batch.
//!
//! - [`attend_rows`], [`decode_attention`], [`attend_tokens`]: softmax attention of query rows
//!   over an explicit set of key/value rows (plain slices) — what the kernels'
//!   `decode::online_softmax` and `decode::combine` compute in pieces;
//! - [`tokens_of_pages`], [`decode_tokens`]: which tokens a decode query attends to — the
//!   kernels' `decode::rows`;
//! - [`decode_attention_tables`]: a layer's decode attention for a batch over the index tables
//!   and the cache — the decode kernel itself;
//! - [`decode_step`]: a whole decode step of a layer (append, selection with reuse, attention),
//!   what [`DecodeStep`](crate::gpu::DecodeStep) launches.
//!
//! The last two take what a GPU decode step takes: the [`KvCacheManager`] (lengths, block tables,
//! slots, decode step counters), the cache contents ([`HostKvCache`], same layout as the
//! device), the [`IndexTables`], and the activations `q [B][Hq][D]`, `k`, `v [B][Hkv][D]` in the
//! element type.
//!
//! A model's decode step with this reference: for each sequence of the batch
//! [`KvCacheManager::reserve`] one token; for each layer [`decode_step`]; then for each sequence
//! [`KvCacheManager::advance_decode_step`].

mod rows;
mod softmax;
mod step;

pub use rows::{decode_tokens, tokens_of_pages};
pub use softmax::{attend_rows, attend_tokens, decode_attention, Attended};
pub use step::{decode_step, DecodeStepOutput, HeadVisit};

use crate::dtype::Element;
use crate::error::{LserveError, Result};
use crate::head_pattern::HeadKind;
use crate::index_table::IndexTables;
use crate::paging::{HostKvCache, KvCacheManager, SeqId, SequenceView, StreamingStore};
use crate::quant::IntFormat;
use crate::reference::quant::quantize_rows;
use crate::reference::{check_len, to_f32};

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
/// each query head of a dense KV head attends over the tokens of the units in its (sequence
/// slot, dense head) entry of `tables` (physical pages, or logical-page ids under
/// [`SelectionUnit::LogicalPage`](crate::config::SelectionUnit::LogicalPage); a unit's tokens
/// that exist: all but for the sequence's last unit); each query head of a streaming KV head attends over its sink and
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
    Ok(decode_attention_tables_with_lse(mgr, cache, tables, layer, seqs, q)?.0)
}

/// [`decode_attention_tables`] and the log-sum-exp of each query head's scaled scores over the
/// rows it attended (natural log, `[B][Hq]`): what the decode step's combine writes when given
/// a log-sum-exp buffer. Same errors.
pub fn decode_attention_tables_with_lse<E: Element>(
    mgr: &KvCacheManager,
    cache: &HostKvCache<E>,
    tables: &IndexTables,
    layer: usize,
    seqs: &[SeqId],
    q: &[E],
) -> Result<(Vec<f64>, Vec<f64>)> {
    attention_over_rows(mgr, cache, tables, layer, seqs, q, |r| Ok(to_f32(r)))
}

/// [`decode_attention_tables_with_lse`] over an integer-coded copy of `cache`: every K and V row
/// quantized to `format` ([`quantize_rows`](crate::reference::quant::quantize_rows)) and
/// dequantized, as a coded device cache uploaded from `cache`
/// (`DeviceKvCache::upload_coded`) holds it. Same errors, and those of `quantize_rows`.
///
/// ```
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::index_table::IndexTables;
/// use lserve::paging::{HostKvCache, KvCacheManager};
/// use lserve::quant::{CodeBits, IntFormat, QuantGroup};
/// use lserve::reference::decode::decode_attention_tables_coded;
/// // One streaming KV head (its sink and ring rows: no index entry needed).
/// let g = ModelGeometry::new(1, 2, 1, 64)?;
/// let cfg = SparsityConfig { page_tokens: 16, logical_page_tokens: 16, ..SparsityConfig::default() };
/// let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 1.0)?, cfg, 4, 1, 64)?;
/// let seq = mgr.add_sequence()?;
/// mgr.reserve(seq, 3)?;
/// let cache = HostKvCache::<bf16>::for_manager(&mgr)?;
/// let tables = IndexTables::for_manager(&mgr)?;
/// let q = vec![bf16::ZERO; 2 * 64];
/// let int8 = IntFormat::new(CodeBits::Int8, QuantGroup::TokenHead);
/// let (out, _) = decode_attention_tables_coded(&mgr, &cache, &tables, 0, &[seq], &q, int8)?;
/// assert!(out.iter().all(|&x| x == 0.0)); // zero rows stay zero
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_tables_coded<E: Element>(
    mgr: &KvCacheManager,
    cache: &HostKvCache<E>,
    tables: &IndexTables,
    layer: usize,
    seqs: &[SeqId],
    q: &[E],
    format: IntFormat,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let d = mgr.geometry().head_dim();
    attention_over_rows(mgr, cache, tables, layer, seqs, q, |r| {
        Ok(quantize_rows(&to_f32(r), d, format)?.dequantize_row(0))
    })
}

/// The attention of [`decode_attention_tables_with_lse`] with every K and V row as `row` makes
/// it (f32) from the cache's.
#[allow(clippy::too_many_arguments)]
fn attention_over_rows<E: Element>(
    mgr: &KvCacheManager,
    cache: &HostKvCache<E>,
    tables: &IndexTables,
    layer: usize,
    seqs: &[SeqId],
    q: &[E],
    row: impl Fn(&[E]) -> Result<Vec<f32>>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let views = batch_views(mgr, cache, layer, seqs, q)?;
    let g = *mgr.geometry();
    let config = mgr.config();
    let (hq, hkv, d, n_p) = (g.q_heads(), g.kv_heads(), g.head_dim(), config.page_tokens);
    let group = g.group();
    let scale = config.softmax_scale_for(d) as f64;
    let pattern = mgr.pattern();
    let mut out = vec![0.0f64; seqs.len() * hq * d];
    let mut lse = vec![0.0f64; seqs.len() * hq];
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
                    let (unit, per_page) = (config.unit_tokens(), config.units_per_page() as u32);
                    for &id in entry {
                        let (page, sub) = (id / per_page, (id % per_page) as usize);
                        let logical = view.block_table.pages().iter().position(|&p| p == page);
                        let logical = logical.ok_or_else(|| LserveError::InvalidArgument {
                            what: "index table entry",
                            reason: format!("page {page} is not in the sequence's block table"),
                        })?;
                        let first = sub * unit;
                        let start = logical * n_p + first;
                        for t in first..first + unit.min(view.len.saturating_sub(start)) {
                            keys.push(row(pool.key(page, head, t)?)?);
                            values.push(row(pool.value(page, head, t)?)?);
                        }
                    }
                }
                HeadKind::Streaming => {
                    let (sink, local) = (config.sink_tokens, config.local_tokens);
                    for pos in StreamingStore::resident_positions(view.len, sink, local) {
                        let (k, v) = cache.token(layer, view, kv_head, pos)?;
                        keys.push(row(k)?);
                        values.push(row(v)?);
                    }
                }
            }
            let k_rows: Vec<&[f32]> = keys.iter().map(Vec::as_slice).collect();
            let v_rows: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
            for h in kv_head * group..(kv_head + 1) * group {
                let row = (b * hq + h) * d;
                let qh = to_f32(&q[row..row + d]);
                let a = attend_rows(&qh, &k_rows, &v_rows, scale);
                out[row..row + d].copy_from_slice(&a.out);
                lse[b * hq + h] = a.lse;
            }
        }
    }
    Ok((out, lse))
}
