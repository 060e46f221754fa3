//! Helpers shared by the test files (`mod common;` in each). Every test file is a crate of its
//! own and uses only some of them, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::ops::Range;

use lserve::config::SparsityConfig;
use lserve::dtype::{DType, Element};
use lserve::geometry::ModelGeometry;
use lserve::gpu::{read_stat_codes, CodedLayerContents, DeviceElement, DeviceKvCache, GpuContext};
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId};
use lserve::quant::{CodeBits, IntFormat, QuantGroup, StatsFormat};
use lserve::reference::kv_write::{write_tokens, KeyStats};
use lserve::reference::quant::{quantize_key_stats, quantize_rows};
use lserve::reference::select::{ReuseState, Selection};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use rand::rngs::StdRng;
use rand::Rng;

/// The GPU these tests run on. They are `#[ignore]`d, so this only runs when asked for
/// (`--ignored`/`--include-ignored`): then a machine without a usable GPU is a failure, never a
/// silent pass.
pub fn gpu() -> GpuContext {
    GpuContext::new(0).unwrap_or_else(|e| {
        panic!(
            "GPU test run without a usable CUDA GPU ({e}): these tests must run on a GPU machine"
        )
    })
}

/// The head kinds of one layer from a case's flags (`true`: streaming, `false`: dense).
pub fn head_kinds(streaming: &[bool]) -> Vec<HeadKind> {
    streaming
        .iter()
        .map(|&s| {
            if s {
                HeadKind::Streaming
            } else {
                HeadKind::Dense
            }
        })
        .collect()
}

/// The head pattern of a case's flags, `[layer][kv_head]` (`true`: streaming, `false`: dense).
pub fn head_pattern(geometry: ModelGeometry, streaming: &[Vec<bool>]) -> HeadPattern {
    let kinds = streaming.iter().map(|layer| head_kinds(layer)).collect();
    HeadPattern::from_kinds(geometry, kinds).unwrap()
}

/// The six element arrays of `layer` in two caches, side by side and named: the dense K and V
/// pools, the key statistics (`kmin`, `kmax`), the streaming K and V stores.
pub fn layer_arrays<'a, E: Element>(
    got: &'a HostKvCache<E>,
    want: &'a HostKvCache<E>,
    layer: usize,
) -> [(&'static str, &'a [E], &'a [E]); 6] {
    let (gd, wd) = (got.dense(layer).unwrap(), want.dense(layer).unwrap());
    let (gs, ws) = (
        got.streaming(layer).unwrap(),
        want.streaming(layer).unwrap(),
    );
    [
        ("K pool", gd.k(), wd.k()),
        ("V pool", gd.v(), wd.v()),
        ("kmin", gd.kmin(), wd.kmin()),
        ("kmax", gd.kmax(), wd.kmax()),
        ("K stream", gs.k(), ws.k()),
        ("V stream", gs.v(), ws.v()),
    ]
}

/// `n` values uniform in `[-1, 1)`, rounded to `E`.
pub fn random_vec<E: Element>(rng: &mut StdRng, n: usize) -> Vec<E> {
    random_vec_in(rng, n, -1.0..1.0)
}

/// `n` values uniform in `range`, rounded to `E`.
pub fn random_vec_in<E: Element>(rng: &mut StdRng, n: usize, range: Range<f32>) -> Vec<E> {
    (0..n)
        .map(|_| E::from_f32(rng.gen_range(range.clone())))
        .collect()
}

/// Rows `[tokens][heads][d]` of `x` restricted to heads `first .. first + count`.
pub fn heads_of<T: Copy>(x: &[T], heads: usize, d: usize, first: usize, count: usize) -> Vec<T> {
    x.chunks(heads * d)
        .flat_map(|row| row[first * d..(first + count) * d].iter().copied())
        .collect()
}

/// The prompt rows of `k`, `v` (`[T][heads][d]`, the prompts' tokens one after another) as
/// [`prefilled`]'s `kv`: token `pos` of sequence `b`, as `f32`.
pub fn prompt_rows<'a, E: Element>(
    prompts: &[usize],
    heads: usize,
    d: usize,
    k: &'a [E],
    v: &'a [E],
) -> impl FnMut(usize, usize) -> (Vec<f32>, Vec<f32>) + 'a {
    let starts: Vec<usize> = prompts
        .iter()
        .scan(0, |start, &n| {
            let first = *start;
            *start += n;
            Some(first)
        })
        .collect();
    let row = heads * d;
    move |b, pos| {
        let at = (starts[b] + pos) * row;
        let f32s = |x: &[E]| x[at..at + row].iter().map(|e| e.to_f32()).collect();
        (f32s(k), f32s(v))
    }
}

/// A host-side cache with its prompts prefilled: the manager, host cache, index tables and
/// reuse state of the CPU reference, and the sequences in the order of the prompts.
pub struct Prefilled<E> {
    pub mgr: KvCacheManager,
    pub host: HostKvCache<E>,
    pub tables: IndexTables,
    pub reuse: ReuseState,
    pub seqs: Vec<SeqId>,
}

/// A cache for `pattern` and `config` with room for `prompts.len()` sequences of up to
/// `max_len` tokens (plus `spare_pages` pages), and sequence `b` prefilled on every layer with
/// `prompts[b]` tokens whose keys and values are `kv(b, pos)` (`[Hkv][D]` each, rounded to `E`).
/// Sequences are added, reserved and written in order, so page ids follow from the prompts.
pub fn prefilled<E: Element>(
    pattern: HeadPattern,
    config: SparsityConfig,
    prompts: &[usize],
    max_len: usize,
    spare_pages: usize,
    mut kv: impl FnMut(usize, usize) -> (Vec<f32>, Vec<f32>),
) -> Prefilled<E> {
    let g = *pattern.geometry();
    let pages = prompts.len() * config.pages_for_len(max_len) + spare_pages;
    let mut mgr = KvCacheManager::new(g, pattern, config, pages, prompts.len(), max_len).unwrap();
    let mut host = HostKvCache::<E>::for_manager(&mgr).unwrap();
    let tables = IndexTables::for_manager(&mgr).unwrap();
    let reuse = ReuseState::new(config.reuse_interval).unwrap();
    let mut seqs = Vec::new();
    for (b, &n) in prompts.iter().enumerate() {
        let seq = mgr.add_sequence().unwrap();
        seqs.push(seq);
        if n == 0 {
            continue;
        }
        mgr.reserve(seq, n).unwrap();
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for pos in 0..n {
            let (kp, vp) = kv(b, pos);
            k.extend(kp.iter().map(|&x| E::from_f32(x)));
            v.extend(vp.iter().map(|&x| E::from_f32(x)));
        }
        let view = mgr.view(seq).unwrap();
        for layer in 0..g.layers() {
            write_tokens(&mut host, layer, &view, 0, &k, &v).unwrap();
        }
    }
    Prefilled {
        mgr,
        host,
        tables,
        reuse,
        seqs,
    }
}

/// The relative error a GPU attention output of element type `E` must stay under against the
/// f64 reference: `2e-3` for f16, `1e-2` for bf16.
pub fn tolerance<E: Element>() -> f64 {
    match E::DTYPE {
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
    }
}

/// Relative error `‖got − want‖ / ‖want‖` of one row of a GPU output against the reference;
/// infinite if `got` holds a NaN.
pub fn row_error<E: Element>(got: &[E], want: &[f64]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&a, &b) in got.iter().zip(want) {
        let a = a.to_f32() as f64;
        if a.is_nan() {
            return f64::INFINITY;
        }
        diff += (a - b) * (a - b);
        norm += b * b;
    }
    (diff / norm.max(1e-30)).sqrt()
}

/// [`row_error`] of every row of `d` elements; the worst.
pub fn worst_row_error<E: Element>(got: &[E], want: &[f64], d: usize) -> f64 {
    got.chunks(d)
        .zip(want.chunks(d))
        .map(|(g, w)| row_error(g, w))
        .fold(0.0, f64::max)
}

/// `f16_or_bf16!(flag, f(args))` calls `f::<f16>(args)` when `flag` is true, else
/// `f::<bf16>(args)`: runs a case in the element type it drew.
#[allow(unused_macros)] // the module's `dead_code` allowance does not cover macros
macro_rules! f16_or_bf16 {
    ($f16:expr, $f:ident($($arg:expr),* $(,)?)) => {
        if $f16 {
            $f::<half::f16>($($arg),*)
        } else {
            $f::<half::bf16>($($arg),*)
        }
    };
}
#[allow(unused_imports)] // as the macro: not every test file dispatches on the element type
pub(crate) use f16_or_bf16;

/// The sequence's unit numbers of an index entry's ids (`page * units_per_page + sub`,
/// `SparsityConfig::unit_id`; the page id itself for whole pages): the page's position in the
/// sequence's block table `pages`, times `units_per_page`, plus `sub`; `u32::MAX` for an id
/// whose page is not the sequence's.
pub fn entry_units(pages: &[u32], ids: &[u32], units_per_page: u32) -> Vec<u32> {
    ids.iter()
        .map(|&id| {
            pages
                .iter()
                .position(|&p| p == id / units_per_page)
                .map_or(u32::MAX, |l| {
                    l as u32 * units_per_page + id % units_per_page
                })
        })
        .collect()
}

/// Relative tolerance of a near-tie in page selection (`docs/ARCHITECTURE.md`, "Equivalence
/// rules").
pub const SELECTION_TOL: f64 = 1e-4;

/// Checks a GPU selection (logical pages) against the reference: same rules, same size, and
/// differences only on near-ties of the K-th candidate score (`docs/ARCHITECTURE.md`, "Equivalence
/// rules"): pages whose reference score is within [`SELECTION_TOL`] of it, relative to the pair's
/// largest score magnitude. The candidates are the pages below the newest, without page 0 when
/// it is always included.
pub fn check_selection(
    got: &[u32],
    want: &Selection,
    top_k: usize,
    always_first: bool,
) -> Result<(), String> {
    let scores = &want.physical_scores;
    let pages = scores.len() as u32;
    let newest = pages - 1;
    if got.windows(2).any(|w| w[0] >= w[1]) || got.iter().any(|&p| p >= pages) {
        return Err(format!("not ascending pages of the sequence: {got:?}"));
    }
    if got.last() != Some(&newest) || (always_first && got[0] != 0) {
        return Err(format!("missing the newest or first page: {got:?}"));
    }
    if got.len() != want.pages.len() {
        return Err(format!("{} pages, reference {:?}", got.len(), want.pages));
    }
    let first = u32::from(always_first).min(newest);
    let mut candidates: Vec<f64> = (first..newest).map(|p| scores[p as usize]).collect();
    if candidates.len() <= top_k {
        return if got == want.pages.as_slice() {
            Ok(())
        } else {
            Err(format!("took all candidates: {got:?} vs {:?}", want.pages))
        };
    }
    candidates.sort_by(|a, b| b.total_cmp(a));
    let kth = candidates[top_k - 1];
    let scale = scores.iter().fold(0.0f64, |m, s| m.max(s.abs()));
    for &p in got
        .iter()
        .filter(|p| !want.pages.contains(p))
        .chain(want.pages.iter().filter(|p| !got.contains(p)))
    {
        let s = scores[p as usize];
        if (s - kth).abs() > SELECTION_TOL * scale.max(f64::MIN_POSITIVE) {
            return Err(format!(
                "page {p} (score {s}) differs, K-th score {kth}: {got:?} vs {:?}",
                want.pages
            ));
        }
    }
    Ok(())
}

/// The one device format: INT8, a scale and minimum per token and head.
pub fn int8() -> IntFormat {
    IntFormat::new(CodeBits::Int8, QuantGroup::TokenHead)
}

/// INT4 codes per token-head (the other format the device kernels read).
pub fn int4() -> IntFormat {
    IntFormat::new(CodeBits::Int4, QuantGroup::TokenHead)
}

/// The codes (in the cache's row layout: INT4 two to a byte) and row words of `rows` (`[n][d]`)
/// as the reference quantizes them to `format` (one group per row).
pub fn quantized<E: Element>(rows: &[E], d: usize, format: IntFormat) -> (Vec<u8>, Vec<u32>) {
    let x: Vec<f32> = rows.iter().map(|e| e.to_f32()).collect();
    let q = quantize_rows(&x, d, format).unwrap();
    let code_bytes = format.code_bytes(d).unwrap();
    let codes = (0..q.rows())
        .flat_map(|r| q.stored_row(r).into_iter().take(code_bytes))
        .collect();
    let words = (0..q.rows()).map(|r| q.params(r, 0).word()).collect();
    (codes, words)
}

/// Layer `layer` of a coded cache against `want` quantized row by row to `format` (codes and
/// words, bit for bit) and its statistics against `want`'s (which the reference computed from
/// the unquantized keys), naming the first difference.
pub fn assert_coded_layer<E: Element>(
    got: &CodedLayerContents<E>,
    want: &HostKvCache<E>,
    layer: usize,
    format: IntFormat,
) -> Result<(), TestCaseError> {
    let d = want.pattern().geometry().head_dim();
    let row = format.code_bytes(d).unwrap();
    let (dense, streaming) = (want.dense(layer).unwrap(), want.streaming(layer).unwrap());
    for (what, codes, words, rows) in [
        ("K pool", &got.pool.0, &got.pool.2, dense.k()),
        ("V pool", &got.pool.1, &got.pool.3, dense.v()),
        ("K stream", &got.stream.0, &got.stream.2, streaming.k()),
        ("V stream", &got.stream.1, &got.stream.3, streaming.v()),
    ] {
        let (want_codes, want_words) = quantized(rows, d, format);
        if want_words.is_empty() {
            // An empty buffer is one element on the device (nothing addresses it).
            prop_assert!(codes.len() <= 1 && words.len() <= 1, "{what}: not empty");
            continue;
        }
        prop_assert_eq!(codes.len(), want_codes.len());
        prop_assert_eq!(words.len(), want_words.len());
        let differs = |r: usize| {
            words[r] != want_words[r] || codes[r * row..][..row] != want_codes[r * row..][..row]
        };
        if let Some(r) = (0..want_words.len()).find(|&r| differs(r)) {
            return Err(TestCaseError::fail(format!(
                "layer {layer} {what} ({format}): row {r} has word {:#010x} codes {:?}, want \
                 {:#010x} {:?}",
                words[r],
                &codes[r * row..][..row],
                want_words[r],
                &want_codes[r * row..][..row],
            )));
        }
    }
    for (what, g, w) in [
        ("kmin", &got.stats.0, dense.kmin()),
        ("kmax", &got.stats.1, dense.kmax()),
    ] {
        let bits = |xs: &[E]| -> Vec<u32> { xs.iter().map(|x| x.to_f32().to_bits()).collect() };
        let (g, w) = (bits(g), bits(w));
        if let Some(i) = (0..w.len()).find(|&i| g[i] != w[i]) {
            return Err(TestCaseError::fail(format!(
                "layer {layer} {what}: element {i} (row {}, channel {}) is {:#010x}, want {:#010x} (as f32)",
                i / d,
                i % d,
                g[i],
                w[i]
            )));
        }
    }
    Ok(())
}

/// The device's 8-bit statistics of `layer` (where `dev` keeps them) equal the reference's coding
/// of `want`'s 16-bit statistics (`quantize_key_stats`), code for code and word for word.
pub fn assert_stat_codes<E: DeviceElement>(
    gpu: &GpuContext,
    dev: &DeviceKvCache<E>,
    want: &HostKvCache<E>,
    layer: usize,
) -> Result<(), TestCaseError> {
    let StatsFormat::Int8(group) = dev.stats_format() else {
        return Ok(());
    };
    let got = read_stat_codes(gpu, dev, layer).unwrap();
    let dense = want.dense(layer).unwrap();
    if dense.kmin().is_empty() {
        // An empty buffer is one element on the device (nothing addresses it).
        prop_assert!(
            got.codes.len() <= 1 && got.words.len() <= 1,
            "stat codes: not empty"
        );
        return Ok(());
    }
    let d = want.pattern().geometry().head_dim();
    let f32s = |x: &[E]| x.iter().map(|v| v.to_f32()).collect::<Vec<_>>();
    let stats = KeyStats::new(d, f32s(dense.kmin()), f32s(dense.kmax())).unwrap();
    let q = quantize_key_stats(&stats, group).unwrap();
    let (codes, words) = (q.device_codes(), q.words());
    prop_assert_eq!(got.codes.len(), codes.len());
    prop_assert_eq!(got.words.len(), words.len());
    let per_row = words.len() / stats.pages();
    let differs = |r: usize| {
        got.codes[2 * d * r..][..2 * d] != codes[2 * d * r..][..2 * d]
            || got.words[per_row * r..][..per_row] != words[per_row * r..][..per_row]
    };
    if let Some(r) = (0..stats.pages()).find(|&r| differs(r)) {
        return Err(TestCaseError::fail(format!(
            "layer {layer} 8-bit statistics: logical row {r} has words {:x?} codes {:?}, want \
             {:x?} {:?} (kmin {:?}, kmax {:?})",
            &got.words[per_row * r..][..per_row],
            &got.codes[2 * d * r..][..2 * d],
            &words[per_row * r..][..per_row],
            &codes[2 * d * r..][..2 * d],
            stats.kmin(r),
            stats.kmax(r),
        )));
    }
    Ok(())
}
