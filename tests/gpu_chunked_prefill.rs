//! Chunked prefill against the paged cache (`gpu::prefill_chunks_into_cache`) and the prefill
//! log-sum-exp (`PrefillPlan::run_with_lse`).
//!
//! - A prompt prefilled in random chunks (block-aligned or not, some of a few tokens) gives bit
//!   for bit the output rows and the cache of a one-shot `prefill_into_cache` of the whole
//!   prompt, for dense and streaming heads, MHA and GQA, D 64 and 128, bf16 and f16.
//! - The same into an INT8 or INT4 cache: every chunk's output rows against the f64 reference
//!   over the prompt whose cached positions are their dequantized rows (rounded to the element
//!   type), the chunk's own positions its activations; the codes, row words and statistics
//!   equal those of a one-shot prefill bit for bit.
//! - The log-sum-exp of the 64-query-tile kernel and of the masked kernel, and the output of a
//!   launch with `prefix_lens` on plain tensors, against the f64 reference.
//!
//! GPU tests are ignored without a GPU (reported as ignored, never passed).

mod common;

use common::{gpu, head_pattern, layer_arrays, tolerance};
use half::{bf16, f16};
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    prefill_chunks_into_cache, prefill_into_cache, read_coded_layer, CodedLayerContents,
    DeviceElement, DeviceKvCache, GpuContext, KvWritePlan, PrefillArgs, PrefillPlan,
    PrefillScratch,
};
use lserve::head_pattern::HeadKind;
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager};
use lserve::quant::{CodeBits, IntFormat, QuantGroup};
use lserve::reference::prefill::{layer_token_patterns, prefill_attention, PrefillInput};
use lserve::reference::quant::quantize_rows;
use lserve::reference::TokenPattern;
use lserve::LserveError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const LAYERS: usize = 2;

fn config(sink: usize, local: usize) -> SparsityConfig {
    SparsityConfig {
        sink_tokens: sink,
        local_tokens: local,
        page_tokens: 64,
        logical_page_tokens: 16,
        ..SparsityConfig::default()
    }
}

/// Random chunk lengths summing to `len`: aligned and unaligned, a few of 1-5 tokens.
fn chunks(rng: &mut StdRng, len: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut left = len;
    while left > 0 {
        let n = match rng.gen_range(0..4) {
            0 => rng.gen_range(1..=5),
            1 => 64 * rng.gen_range(1..=4),
            _ => rng.gen_range(1..=400),
        }
        .min(left);
        out.push(n);
        left -= n;
    }
    out
}

struct Run<E> {
    /// The last layer's output rows, `[len][Hq][D]`.
    out: Vec<E>,
    /// The cache: downloaded (16-bit), or each layer's codes, words and statistics (coded).
    host: Option<HostKvCache<E>>,
    coded: Vec<CodedLayerContents<E>>,
}

/// Prefills one sequence of `len` tokens of `q`, `k`, `v` in the given chunks (one chunk of
/// `len`: the one-shot path) into a fresh cache (16-bit, or of `format`), layer by layer;
/// returns the output rows and the cache.
#[allow(clippy::too_many_arguments)]
fn prefill_in_chunks<E: DeviceElement>(
    gpu: &GpuContext,
    g: ModelGeometry,
    streaming: &[Vec<bool>],
    config: SparsityConfig,
    format: Option<IntFormat>,
    len: usize,
    sizes: &[usize],
    x: &[Vec<E>; 3],
) -> Run<E> {
    let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    let pattern = head_pattern(g, streaming);
    let mut mgr =
        KvCacheManager::new(g, pattern, config, config.pages_for_len(len) + 2, 1, len).unwrap();
    let mut cache = match format {
        None => DeviceKvCache::<E>::new(gpu, &mgr).unwrap(),
        Some(f) => DeviceKvCache::<E>::new_coded(gpu, &mgr, f).unwrap(),
    };
    let mut scratch = PrefillScratch::<E>::new(gpu, &g, len).unwrap();
    let seq = mgr.add_sequence().unwrap();
    let s = gpu.stream();
    let mut out = vec![E::from_f32(f32::NAN); len * hq * d];
    let mut start = 0;
    for &n in sizes {
        let range = mgr.reserve(seq, n).unwrap();
        assert_eq!(range, start..start + n);
        let plan = KvWritePlan::new(&mgr, &[(seq, range)])
            .unwrap()
            .upload(gpu, &mgr, &mut cache)
            .unwrap();
        for layer in 0..LAYERS {
            // Each layer its own activations: the chunk's rows of layer-shifted data.
            let rows = |t: &Vec<E>, heads: usize| -> Vec<E> {
                let per = heads * d;
                let base = layer * len * per;
                t[base + start * per..base + (start + n) * per].to_vec()
            };
            let q = s.clone_htod(&rows(&x[0], hq)).unwrap();
            let k = s.clone_htod(&rows(&x[1], hkv)).unwrap();
            let v = s.clone_htod(&rows(&x[2], hkv)).unwrap();
            let mut o = s
                .clone_htod(&vec![E::from_f32(f32::NAN); n * hq * d])
                .unwrap();
            if sizes.len() == 1 {
                prefill_into_cache(gpu, &mut cache, layer, &plan, None, &q, &k, &v, &mut o)
                    .unwrap();
            } else {
                prefill_chunks_into_cache(
                    gpu,
                    &mut cache,
                    layer,
                    &plan,
                    &mut scratch,
                    &q,
                    &k,
                    &v,
                    &mut o,
                )
                .unwrap();
            }
            let got: Vec<E> = s.clone_dtoh(&o).unwrap();
            if layer == LAYERS - 1 {
                out[start * hq * d..(start + n) * hq * d].copy_from_slice(&got);
            }
        }
        start += n;
    }
    if format.is_some() {
        let coded = (0..LAYERS)
            .map(|layer| read_coded_layer(gpu, &cache, layer).unwrap())
            .collect();
        return Run {
            out,
            host: None,
            coded,
        };
    }
    let mut host = HostKvCache::<E>::for_manager(&mgr).unwrap();
    let mut tables = IndexTables::for_manager(&mgr).unwrap();
    cache.download(gpu, &mut host, &mut tables).unwrap();
    Run {
        out,
        host: Some(host),
        coded: Vec::new(),
    }
}

/// A random case's shape: geometry, head kinds, Λ parameters.
fn random_shape(rng: &mut StdRng, d: usize) -> (ModelGeometry, Vec<Vec<bool>>, SparsityConfig) {
    let hkv = rng.gen_range(1..=3);
    let group = rng.gen_range(1..=4);
    let g = ModelGeometry::new(LAYERS, hkv * group, hkv, d).unwrap();
    let streaming: Vec<Vec<bool>> = (0..LAYERS)
        .map(|_| (0..hkv).map(|_| rng.gen_bool(0.5)).collect())
        .collect();
    let sink = [0, 4, 64, 100][rng.gen_range(0..4)];
    let local = [16, 64, 200, 256][rng.gen_range(0..4)];
    (g, streaming, config(sink, local))
}

/// Every layer's Q, K, V rows (`[layers][len][heads][D]` each), uniform in `[-2, 2)`.
fn activations<E: DeviceElement>(rng: &mut StdRng, g: ModelGeometry, len: usize) -> [Vec<E>; 3] {
    [g.q_heads(), g.kv_heads(), g.kv_heads()].map(|heads| {
        (0..LAYERS * len * heads * g.head_dim())
            .map(|_| E::from_f32(rng.gen_range(-2.0f32..2.0)))
            .collect()
    })
}

fn chunked_case<E: DeviceElement>(gpu: &GpuContext, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let d = if rng.gen_bool(0.5) { 64 } else { 128 };
    let (g, streaming, config) = random_shape(&mut rng, d);
    let len = rng.gen_range(2..=1300);
    let sizes = chunks(&mut rng, len);
    let x = activations::<E>(&mut rng, g, len);
    let whole = prefill_in_chunks(gpu, g, &streaming, config, None, len, &[len], &x);
    let chunked = prefill_in_chunks(gpu, g, &streaming, config, None, len, &sizes, &x);
    let (hkv, group) = (g.kv_heads(), g.group());
    let what = format!("seed {seed}: D {d}, Hkv {hkv}, G {group}, len {len}, chunks {sizes:?}");
    assert!(
        whole.out.iter().all(|e| e.to_f32().is_finite()),
        "{what}: a one-shot output row not written"
    );
    let bits = |xs: &[E]| xs.iter().map(|e| e.to_f32().to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&chunked.out) == bits(&whole.out),
        "{what}: chunked output differs from one-shot"
    );
    let (got, want) = (chunked.host.unwrap(), whole.host.unwrap());
    for layer in 0..LAYERS {
        for (name, got, want) in layer_arrays(&got, &want, layer) {
            assert!(
                bits(got) == bits(want),
                "{what}: layer {layer} {name} differs"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_prefill_equals_one_shot_bit_for_bit() {
    let gpu = gpu();
    for seed in 0..12 {
        if seed % 2 == 0 {
            chunked_case::<bf16>(&gpu, seed);
        } else {
            chunked_case::<f16>(&gpu, seed);
        }
    }
}

/// A prompt prefilled in chunks into a coded cache (format `bits`, per token-head, D 128): each
/// chunk's output rows against the reference over the prompt whose positions before the chunk
/// are what the cache holds (dequantized, rounded to `E`), and the cache equal to a one-shot
/// prefill's bit for bit.
fn coded_chunked_case<E: DeviceElement>(gpu: &GpuContext, seed: u64, bits: CodeBits) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (g, streaming, config) = random_shape(&mut rng, 128);
    let format = IntFormat::new(bits, QuantGroup::TokenHead);
    let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    let len = rng.gen_range(2..=600);
    let sizes = chunks(&mut rng, len);
    let x = activations::<E>(&mut rng, g, len);
    let what = format!(
        "seed {seed}: {bits:?}, Hkv {hkv}, G {}, len {len}, chunks {sizes:?}",
        g.group()
    );
    let whole = prefill_in_chunks(gpu, g, &streaming, config, Some(format), len, &[len], &x);
    let chunked = prefill_in_chunks(gpu, g, &streaming, config, Some(format), len, &sizes, &x);
    assert!(
        chunked.coded == whole.coded,
        "{what}: the cache differs from a one-shot prefill's"
    );
    // The last layer's activations and the K/V rows the cache holds for them.
    let layer = LAYERS - 1;
    let f32s = |t: &Vec<E>, heads: usize| -> Vec<f32> {
        let per = len * heads * d;
        t[layer * per..(layer + 1) * per]
            .iter()
            .map(|e| e.to_f32())
            .collect()
    };
    let (q, k, v) = (f32s(&x[0], hq), f32s(&x[1], hkv), f32s(&x[2], hkv));
    let cached = |rows: &[f32]| -> Vec<f32> {
        quantize_rows(rows, d, format)
            .unwrap()
            .dequantize()
            .iter()
            .map(|&y| E::from_f32(y).to_f32())
            .collect()
    };
    let (k_cached, v_cached) = (cached(&k), cached(&v));
    let patterns = layer_token_patterns(&head_pattern(g, &streaming), &config, layer).unwrap();
    let mut start = 0;
    for &n in &sizes {
        let end = start + n;
        let row = hkv * d;
        // Positions before the chunk from the cache, the chunk's from its activations.
        let mix = |cached: &[f32], own: &[f32]| -> Vec<f32> {
            let mut m = cached[..start * row].to_vec();
            m.extend_from_slice(&own[start * row..end * row]);
            m
        };
        let want = prefill_attention(&PrefillInput {
            cu_seqlens: &[0, end],
            q: &q[..end * hq * d],
            k: &mix(&k_cached, &k),
            v: &mix(&v_cached, &v),
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            patterns: &patterns,
            block_mask: None,
            scale: 1.0 / (d as f64).sqrt(),
        })
        .unwrap();
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for i in start * hq * d..end * hq * d {
            let o = chunked.out[i].to_f32() as f64;
            assert!(o.is_finite(), "{what}: output element {i} not written");
            diff += (o - want.out[i]) * (o - want.out[i]);
            norm += want.out[i] * want.out[i];
        }
        let err = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
        assert!(
            err < tolerance::<E>(),
            "{what}: chunk {start}..{end}: relative error {err}"
        );
        start = end;
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn coded_chunked_prefill_matches_reference() {
    let gpu = gpu();
    for seed in 0..8 {
        let bits = if seed % 2 == 0 {
            CodeBits::Int8
        } else {
            CodeBits::Int4
        };
        if seed % 4 < 2 {
            coded_chunked_case::<bf16>(&gpu, 200 + seed, bits);
        } else {
            coded_chunked_case::<f16>(&gpu, 200 + seed, bits);
        }
    }
}

/// Log-sum-exp and `prefix_lens` on plain tensors against the f64 reference.
fn lse_case<E: DeviceElement>(gpu: &GpuContext, seed: u64, masked: bool) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (hkv, group, d) = (2, 2, if seed % 2 == 0 { 128 } else { 64 });
    let hq = hkv * group;
    let lens = [rng.gen_range(1..=300), rng.gen_range(1..=300)];
    let prefixes = [rng.gen_range(0..lens[0]), rng.gen_range(0..lens[1])];
    let cu = [0, lens[0], lens[0] + lens[1]];
    let kinds = [HeadKind::Dense, HeadKind::Streaming];
    let (sink, local) = (16, 100);
    let t = cu[2];
    let draw = |rng: &mut StdRng, n: usize| -> Vec<E> {
        (0..n)
            .map(|_| E::from_f32(rng.gen_range(-2.0f32..2.0)))
            .collect()
    };
    let (q, k, v) = (
        draw(&mut rng, t * hq * d),
        draw(&mut rng, t * hkv * d),
        draw(&mut rng, t * hkv * d),
    );
    let masks = masked.then(|| {
        lens.iter()
            .map(|&len| {
                lserve::block_iter::BlockMask::from_fn(hq, len, |_, _, _| rng.gen_bool(0.5))
                    .unwrap()
            })
            .collect::<Vec<_>>()
    });
    let f32s = |xs: &[E]| xs.iter().map(|e| e.to_f32()).collect::<Vec<f32>>();
    let bit = |c: lserve::reference::prefill::BlockCoord| {
        masks.as_ref().unwrap()[c.seq]
            .get(c.q_head, c.q_block, c.kv_block)
            .unwrap()
    };
    let want = prefill_attention(&PrefillInput {
        cu_seqlens: &cu,
        q: &f32s(&q),
        k: &f32s(&k),
        v: &f32s(&v),
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        patterns: &[
            TokenPattern::Causal,
            TokenPattern::Lambda {
                sink_tokens: sink,
                local_tokens: local,
            },
        ],
        block_mask: masks
            .as_ref()
            .map(|_| &bit as &dyn Fn(lserve::reference::prefill::BlockCoord) -> bool),
        scale: 1.0 / (d as f64).sqrt(),
    })
    .unwrap();
    // The query rows: positions past each prefix.
    let q_positions: Vec<usize> = (0..2)
        .flat_map(|b| (cu[b] + prefixes[b]..cu[b + 1]).collect::<Vec<_>>())
        .collect();
    let q_rows: Vec<E> = q_positions
        .iter()
        .flat_map(|&r| q[r * hq * d..(r + 1) * hq * d].to_vec())
        .collect();
    let args = PrefillArgs {
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        cu_seqlens: &cu,
        kinds: &kinds,
        sink_tokens: sink,
        local_tokens: local,
        block_masks: masks.as_deref(),
        softmax_scale: None,
        prefix_lens: Some(&prefixes),
        with_lse: true,
    };
    let plan = PrefillPlan::new(gpu, &args).unwrap();
    assert_eq!(plan.query_rows(), q_positions.len());
    let s = gpu.stream();
    let (qd, kd, vd) = (
        s.clone_htod(&q_rows).unwrap(),
        s.clone_htod(&k).unwrap(),
        s.clone_htod(&v).unwrap(),
    );
    let mut out = s
        .clone_htod(&vec![E::from_f32(f32::NAN); q_rows.len()])
        .unwrap();
    let mut lse = s
        .clone_htod(&vec![f32::NAN; q_positions.len() * hq])
        .unwrap();
    plan.run_with_lse(gpu, &qd, &kd, &vd, &mut out, &mut lse)
        .unwrap();
    let (out, lse): (Vec<E>, Vec<f32>) = (s.clone_dtoh(&out).unwrap(), s.clone_dtoh(&lse).unwrap());
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (i, &r) in q_positions.iter().enumerate() {
        for h in 0..hq {
            let (got_lse, want_lse) = (lse[i * hq + h] as f64, want.lse[r * hq + h]);
            assert!(
                (got_lse - want_lse).abs() <= 1e-3 * want_lse.abs().max(1.0),
                "seed {seed}: lse of position row {r} head {h}: {got_lse} vs {want_lse}"
            );
            for c in 0..d {
                let o = out[(i * hq + h) * d + c].to_f32() as f64;
                assert!(o.is_finite(), "seed {seed}: output row {i} not written");
                let w = want.out[(r * hq + h) * d + c];
                diff += (o - w) * (o - w);
                norm += w * w;
            }
        }
    }
    let err = (diff / norm).sqrt();
    assert!(err < tolerance::<E>(), "seed {seed}: relative error {err}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_lse_and_prefixes_match_reference() {
    let gpu = gpu();
    for seed in 0..8 {
        lse_case::<bf16>(&gpu, seed, seed % 4 == 3);
        lse_case::<f16>(&gpu, seed + 100, seed % 4 == 1);
    }
}

/// Bad chunk calls are typed errors that launch nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_chunks_are_typed_errors() {
    let gpu = gpu();
    let g = ModelGeometry::new(1, 2, 1, 64).unwrap();
    let pattern = head_pattern(g, &[vec![false]]);
    let mut mgr = KvCacheManager::new(g, pattern, config(4, 64), 16, 1, 512).unwrap();
    let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr).unwrap();
    let seq = mgr.add_sequence().unwrap();
    mgr.reserve(seq, 100).unwrap();
    let grown = mgr.reserve(seq, 50).unwrap();
    let s = gpu.stream();
    let q = s.alloc_zeros::<bf16>(50 * 2 * 64).unwrap();
    let kv = s.alloc_zeros::<bf16>(50 * 64).unwrap();
    let mut out = s.alloc_zeros::<bf16>(50 * 2 * 64).unwrap();
    // A scratch shorter than the sequence.
    let mut small = PrefillScratch::<bf16>::new(&gpu, &g, 120).unwrap();
    let plan = KvWritePlan::new(&mgr, &[(seq, grown.clone())])
        .unwrap()
        .upload(&gpu, &mgr, &mut cache)
        .unwrap();
    let e = prefill_chunks_into_cache(
        &gpu, &mut cache, 0, &plan, &mut small, &q, &kv, &kv, &mut out,
    )
    .unwrap_err();
    assert!(matches!(e, LserveError::ShapeMismatch { .. }), "{e:?}");
    // A chunk that does not end at the sequence's length.
    let mut scratch = PrefillScratch::<bf16>::new(&gpu, &g, 512).unwrap();
    let short = KvWritePlan::new(&mgr, &[(seq, 100..140)])
        .unwrap()
        .upload(&gpu, &mgr, &mut cache)
        .unwrap();
    let e = prefill_chunks_into_cache(
        &gpu,
        &mut cache,
        0,
        &short,
        &mut scratch,
        &q,
        &kv,
        &kv,
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(e, LserveError::InvalidArgument { .. }), "{e:?}");
    // A layer out of range.
    let e = prefill_chunks_into_cache(
        &gpu,
        &mut cache,
        1,
        &plan,
        &mut scratch,
        &q,
        &kv,
        &kv,
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(e, LserveError::InvalidArgument { .. }), "{e:?}");
    // The log-sum-exp of a plan made without it.
    let cu = [0, 64];
    let args = PrefillArgs {
        q_heads: 2,
        kv_heads: 1,
        head_dim: 64,
        cu_seqlens: &cu,
        kinds: &[HeadKind::Dense],
        sink_tokens: 0,
        local_tokens: 0,
        block_masks: None,
        softmax_scale: None,
        prefix_lens: None,
        with_lse: false,
    };
    let p = PrefillPlan::new(&gpu, &args).unwrap();
    let mut lse = s.alloc_zeros::<f32>(128).unwrap();
    assert!(matches!(
        p.run_with_lse(&gpu, &q, &kv, &kv, &mut out, &mut lse),
        Err(LserveError::InvalidArgument { .. })
    ));
}

/// `prefix_lens` is validated without a GPU: one per sequence, each below its length.
#[test]
fn prefixes_are_checked() {
    let cu = [0, 10, 30];
    let kinds = [HeadKind::Dense];
    let args = |prefixes: &'static [usize]| PrefillArgs {
        q_heads: 1,
        kv_heads: 1,
        head_dim: 64,
        cu_seqlens: &cu,
        kinds: &kinds,
        sink_tokens: 0,
        local_tokens: 0,
        block_masks: None,
        softmax_scale: None,
        prefix_lens: Some(prefixes),
        with_lse: false,
    };
    assert_eq!(args(&[9, 0]).validate().unwrap(), 30);
    assert_eq!(args(&[9, 19]).query_rows(), 2);
    assert!(matches!(
        args(&[10, 0]).validate(),
        Err(LserveError::InvalidArgument { .. })
    ));
    assert!(matches!(
        args(&[1]).validate(),
        Err(LserveError::ShapeMismatch { .. })
    ));
}
