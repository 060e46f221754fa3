//! GPU block-sparse prefill attention (`kernels-gpu/src/prefill`) against the CPU reference
//! (`lserve::reference::prefill::prefill_attention`, f64).
//!
//! Each case draws a ragged batch (lengths not multiples of the 64-token blocks), MHA or GQA,
//! random head kinds, random sink / local tokens (multiples of 64 and not), optionally random
//! caller block masks, bf16 or f16 data, runs the kernel into a poisoned output and compares
//! per query head by relative error `‖out − ref‖ / ‖ref‖` (over every token of the batch), and
//! checks that every output element is finite (written).
//!
//! GPU tests are ignored without a GPU (reported as ignored, never passed); `--ignored` runs
//! them, and there a missing GPU is a failure. Argument validation is checked without a GPU.

mod common;

use common::{f16_or_bf16, gpu, head_kinds, layer_arrays, tolerance};
use half::{bf16, f16};
use lserve::block_iter::BlockMask;
use lserve::dtype::Element;
use lserve::gpu::{prefill_attention, DeviceElement, GpuContext, PrefillArgs, PrefillPlan};
use lserve::head_pattern::HeadKind;
use lserve::reference::prefill::{BlockCoord, PrefillInput};
use lserve::reference::{self, TokenPattern};
use lserve::LserveError;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
struct Case {
    head_dim: usize,
    kv_heads: usize,
    group: usize,
    lens: Vec<usize>,
    streaming: Vec<bool>,
    sink: usize,
    local: usize,
    /// Probability that a caller block-mask bit is set; `None`: no mask.
    mask_density: Option<f64>,
    f16: bool,
    seed: u64,
}

impl Case {
    fn q_heads(&self) -> usize {
        self.kv_heads * self.group
    }

    fn kinds(&self) -> Vec<HeadKind> {
        head_kinds(&self.streaming)
    }

    fn cu_seqlens(&self) -> Vec<usize> {
        let mut cu = vec![0];
        for &l in &self.lens {
            cu.push(cu.last().unwrap() + l);
        }
        cu
    }
}

fn token_count() -> impl Strategy<Value = usize> {
    // Mostly small and ragged, sometimes exactly on or next to a block edge.
    prop_oneof![
        4 => 1usize..=300,
        1 => prop_oneof![Just(64usize), Just(65), Just(127), Just(128), Just(192)],
    ]
}

fn window_tokens() -> impl Strategy<Value = usize> {
    prop_oneof![1usize..=200, Just(64usize), Just(128), Just(256)]
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(64usize), Just(128)],
        1usize..=2,
        // Every GQA group the geometry accepts, the non-powers of two included.
        1usize..=lserve::geometry::ModelGeometry::MAX_GROUP,
        prop::collection::vec(token_count(), 1..=4),
        prop_oneof![Just(0usize), window_tokens()],
        window_tokens(),
        prop_oneof![
            2 => Just(None),
            1 => (0.0f64..=1.0).prop_map(Some),
        ],
        any::<bool>(),
        any::<u64>(),
    )
        .prop_flat_map(
            |(head_dim, kv_heads, group, lens, sink, local, mask_density, f16, seed)| {
                prop::collection::vec(any::<bool>(), kv_heads).prop_map(move |streaming| Case {
                    head_dim,
                    kv_heads,
                    group,
                    lens: lens.clone(),
                    streaming,
                    sink,
                    local,
                    mask_density,
                    f16,
                    seed,
                })
            },
        )
}

/// Roughly standard-normal values (sum of uniforms), never all zero.
fn normalish(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (0..4).map(|_| rng.gen_range(-1.0f32..1.0)).sum::<f32>() * 0.87)
        .collect()
}

fn rounded<E: Element>(xs: &[f32]) -> Vec<E> {
    xs.iter().map(|&x| E::from_f32(x)).collect()
}

/// The inputs of one run: element data (already rounded) and masks.
struct Inputs<E> {
    q: Vec<E>,
    k: Vec<E>,
    v: Vec<E>,
    masks: Option<Vec<BlockMask>>,
}

fn inputs<E: Element>(case: &Case) -> Inputs<E> {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let t: usize = case.lens.iter().sum();
    let d = case.head_dim;
    let q = rounded(&normalish(&mut rng, t * case.q_heads() * d));
    let k = rounded(&normalish(&mut rng, t * case.kv_heads * d));
    let v = rounded(&normalish(&mut rng, t * case.kv_heads * d));
    let masks = case.mask_density.map(|p| {
        case.lens
            .iter()
            .map(|&len| BlockMask::from_fn(case.q_heads(), len, |_, _, _| rng.gen_bool(p)).unwrap())
            .collect()
    });
    Inputs { q, k, v, masks }
}

fn args<'a>(
    case: &Case,
    cu: &'a [usize],
    kinds: &'a [HeadKind],
    masks: Option<&'a [BlockMask]>,
) -> PrefillArgs<'a> {
    PrefillArgs {
        q_heads: case.q_heads(),
        kv_heads: case.kv_heads,
        head_dim: case.head_dim,
        cu_seqlens: cu,
        kinds,
        sink_tokens: case.sink,
        local_tokens: case.local,
        block_masks: masks,
        softmax_scale: None,
        prefix_lens: None,
        with_lse: false,
    }
}

/// Runs the kernel into a poisoned output and downloads it.
fn run_gpu<E: DeviceElement>(gpu: &GpuContext, args: &PrefillArgs<'_>, x: &Inputs<E>) -> Vec<E> {
    let s = gpu.stream();
    let q = s.clone_htod(&x.q).unwrap();
    let k = s.clone_htod(&x.k).unwrap();
    let v = s.clone_htod(&x.v).unwrap();
    // NaN in both bf16 and f16: an element the kernel does not write stays non-finite.
    let poison = E::from_f32(f32::NAN);
    let mut out = s.clone_htod(&vec![poison; x.q.len()]).unwrap();
    prefill_attention(gpu, args, &q, &k, &v, &mut out).unwrap();
    s.synchronize().unwrap();
    s.clone_dtoh(&out).unwrap()
}

/// The f64 reference for `case` on the rounded inputs (`patterns` per KV head).
fn run_reference<E: Element>(
    case: &Case,
    cu: &[usize],
    patterns: &[TokenPattern],
    x: &Inputs<E>,
) -> Vec<f64> {
    let to_f32 = |xs: &[E]| xs.iter().map(|e| e.to_f32()).collect::<Vec<f32>>();
    let (q, k, v) = (to_f32(&x.q), to_f32(&x.k), to_f32(&x.v));
    let bit = |c: BlockCoord| {
        x.masks.as_ref().unwrap()[c.seq]
            .get(c.q_head, c.q_block, c.kv_block)
            .unwrap()
    };
    reference::prefill::prefill_attention(&PrefillInput {
        cu_seqlens: cu,
        q: &q,
        k: &k,
        v: &v,
        q_heads: case.q_heads(),
        kv_heads: case.kv_heads,
        head_dim: case.head_dim,
        patterns,
        block_mask: x
            .masks
            .as_ref()
            .map(|_| &bit as &dyn Fn(BlockCoord) -> bool),
        scale: 1.0 / (case.head_dim as f64).sqrt(),
    })
    .unwrap()
    .out
}

fn patterns(case: &Case) -> Vec<TokenPattern> {
    case.streaming
        .iter()
        .map(|&s| {
            if s {
                TokenPattern::Lambda {
                    sink_tokens: case.sink,
                    local_tokens: case.local,
                }
            } else {
                TokenPattern::Causal
            }
        })
        .collect()
}

/// The worst per-query-head relative error of `out` against `want`; fails on a non-finite
/// element (naming its token and head).
fn worst_head_error<E: Element>(
    out: &[E],
    want: &[f64],
    q_heads: usize,
    d: usize,
) -> Result<(f64, usize), TestCaseError> {
    let mut worst = (0.0f64, 0);
    for h in 0..q_heads {
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for (row, (o, w)) in out.chunks(d).zip(want.chunks(d)).enumerate() {
            if row % q_heads != h {
                continue;
            }
            for (&o, &w) in o.iter().zip(w) {
                let o = o.to_f32() as f64;
                prop_assert!(
                    o.is_finite(),
                    "non-finite output at token {}, head {h}",
                    row / q_heads
                );
                diff += (o - w) * (o - w);
                norm += w * w;
            }
        }
        let err = (diff / norm).sqrt();
        if err > worst.0 {
            worst = (err, h);
        }
    }
    Ok(worst)
}

fn run_case<E: DeviceElement>(gpu: &GpuContext, case: &Case) -> Result<(), TestCaseError> {
    let x = inputs::<E>(case);
    let (cu, kinds) = (case.cu_seqlens(), case.kinds());
    let out = run_gpu(gpu, &args(case, &cu, &kinds, x.masks.as_deref()), &x);
    let want = run_reference(case, &cu, &patterns(case), &x);
    let (err, head) = worst_head_error(&out, &want, case.q_heads(), case.head_dim)?;
    let tol = tolerance::<E>();
    eprintln!("{}: worst head {head}, relative error {err:.3e}", E::DTYPE);
    prop_assert!(
        err < tol,
        "query head {head}: relative error {err:.3e} (tolerance {tol:.0e})"
    );
    Ok(())
}

proptest! {
    #[test]
    #[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
    fn prefill_attention_matches_reference(case in case_strategy()) {
        let gpu = gpu();
        f16_or_bf16!(case.f16, run_case(&gpu, &case))?;
    }
}

/// All-dense heads are plain causal attention; and a streaming head whose window covers the
/// whole sequence (no sink, local >= length) visits the same blocks with the same masks, so it
/// gives bit-identical output.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn dense_heads_are_causal_attention() {
    let gpu = gpu();
    for (head_dim, group) in [(128, 4), (64, 1), (64, 3), (128, 7)] {
        let mut case = Case {
            head_dim,
            kv_heads: 2,
            group,
            lens: vec![300, 1, 129, 64],
            streaming: vec![false, false],
            sink: 0,
            local: 300,
            mask_density: None,
            f16: false,
            seed: 7,
        };
        let x = inputs::<bf16>(&case);
        let (cu, kinds) = (case.cu_seqlens(), case.kinds());
        let dense = run_gpu(&gpu, &args(&case, &cu, &kinds, None), &x);
        let causal = run_reference(&case, &cu, &[TokenPattern::Causal; 2], &x);
        let (err, head) = worst_head_error(&dense, &causal, case.q_heads(), head_dim).unwrap();
        assert!(err < 1e-2, "D {head_dim}: head {head} error {err:.3e}");

        case.streaming = vec![true, true];
        let kinds = case.kinds();
        let wide = run_gpu(&gpu, &args(&case, &cu, &kinds, None), &x);
        let same = dense
            .iter()
            .zip(&wide)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "D {head_dim}: a full-window streaming head differs from dense"
        );
    }
}

/// A long sequence with streaming heads (sink 64, local 256): query blocks far from the start
/// skip most KV blocks (the gap between the sink block and the local window); one dense head
/// beside them, GQA, bf16 and f16.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn long_sequence_streaming_heads() {
    let gpu = gpu();
    for f16_data in [false, true] {
        let case = Case {
            head_dim: 128,
            kv_heads: 2,
            group: 2,
            lens: vec![2000, 333],
            streaming: vec![true, false],
            sink: 64,
            local: 256,
            mask_density: None,
            f16: f16_data,
            seed: 11,
        };
        f16_or_bf16!(f16_data, run_case(&gpu, &case)).unwrap();
    }
}

/// The same long shape with a sparse caller block mask (10% of blocks) on top of the patterns:
/// exercises the mask words past the first 32 blocks and the diagonal rule.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn long_sequence_with_block_mask() {
    let gpu = gpu();
    let case = Case {
        head_dim: 64,
        kv_heads: 1,
        group: 2,
        lens: vec![2500],
        streaming: vec![false],
        sink: 100,
        local: 200,
        mask_density: Some(0.1),
        f16: false,
        seed: 5,
    };
    run_case::<bf16>(&gpu, &case).unwrap();
    let case = Case {
        streaming: vec![true],
        ..case
    };
    run_case::<bf16>(&gpu, &case).unwrap();
}

/// Both kernels at every (head dim, element type): without masks the 128-row kernel
/// (`prefill_attention_*`, tiles of two query blocks), with masks the 64-row one
/// (`prefill_masked_attention_*`, one query block per tile) — an all-ones mask (the masked
/// kernel on the plain patterns) and a half-density one. Lengths give tiles that end inside a
/// query block (300, 129), a one-token sequence, and an odd number of query blocks (129, 300:
/// the unmasked kernel's last tile has one query block).
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn both_kernels_all_shapes() {
    let gpu = gpu();
    for head_dim in [64, 128] {
        for f16_data in [false, true] {
            for mask_density in [None, Some(1.0), Some(0.5)] {
                let case = Case {
                    head_dim,
                    kv_heads: 2,
                    group: 2,
                    lens: vec![300, 1, 129, 64],
                    streaming: vec![true, false],
                    sink: 70,
                    local: 100,
                    mask_density,
                    f16: f16_data,
                    seed: 13,
                };
                eprintln!("D {head_dim}, f16 {f16_data}, mask {mask_density:?}");
                f16_or_bf16!(f16_data, run_case(&gpu, &case)).unwrap();
            }
        }
    }
}

/// On a device whose default module is sm_90a (compute capability 9.0) launches take the
/// `wgmma` kernels (without caller masks the one of 128-query tiles, with them the masked one),
/// and an sm_90 context (the `mma.sync` kernels) on the same inputs gives the same attention:
/// each within the tolerance of the reference, and within twice that of each other. Ragged
/// lengths not multiples of the tiles, a one-token sequence, streaming and dense heads, MHA and
/// GQA, both head dims and element types, without masks and with a random one (walks of odd
/// and even length, steps whose two blocks are far apart). Elsewhere (no sm_90a module) only
/// the default kernels run.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn wgmma_and_mma_sync_kernels_agree() {
    let gpu = gpu();
    let capability = gpu.context().compute_capability().unwrap();
    assert_eq!(
        gpu.ptx().has_wgmma(),
        capability == (9, 0) && std::env::var("LSERVE_PTX_ARCH").is_err(),
        "module {}",
        gpu.ptx().arch
    );
    let other = gpu
        .ptx()
        .has_wgmma()
        .then(|| GpuContext::with_ptx_arch(0, "sm_90").unwrap());
    for (head_dim, group, f16_data, mask_density) in [
        (128, 4, false, None),
        (64, 1, true, None),
        (128, 3, true, None),
        (64, 2, false, None),
        (128, 4, false, Some(0.4)),
        (64, 1, true, Some(0.4)),
        (128, 3, true, Some(0.7)),
        (64, 2, false, Some(0.7)),
    ] {
        let case = Case {
            head_dim,
            kv_heads: 2,
            group,
            lens: vec![1000, 1, 191, 64, 130],
            streaming: vec![false, true],
            sink: 64,
            local: 200,
            mask_density,
            f16: f16_data,
            seed: 21,
        };
        f16_or_bf16!(f16_data, run_case(&gpu, &case)).unwrap();
        if let Some(other) = &other {
            f16_or_bf16!(f16_data, run_case(other, &case)).unwrap();
            fn outputs<E: DeviceElement>(a: &GpuContext, b: &GpuContext, case: &Case) -> f64 {
                let x = inputs::<E>(case);
                let (cu, kinds) = (case.cu_seqlens(), case.kinds());
                let args = args(case, &cu, &kinds, x.masks.as_deref());
                let (oa, ob) = (run_gpu(a, &args, &x), run_gpu(b, &args, &x));
                let want: Vec<f64> = ob.iter().map(|e| e.to_f32() as f64).collect();
                worst_head_error(&oa, &want, case.q_heads(), case.head_dim)
                    .unwrap()
                    .0
            }
            let err = f16_or_bf16!(f16_data, outputs(&gpu, other, &case));
            eprintln!(
                "D {head_dim}, group {group}, f16 {f16_data}, mask {mask_density:?}: \
                 wgmma vs mma.sync {err:.3e}"
            );
            assert!(err < 2e-2, "wgmma against mma.sync: {err:.3e}");
        }
    }
}

/// A plan is reusable: two runs on different data give each its own reference result.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn plan_runs_many_times() {
    let gpu = gpu();
    let case = Case {
        head_dim: 64,
        kv_heads: 2,
        group: 1,
        lens: vec![70, 200],
        streaming: vec![true, false],
        sink: 3,
        local: 77,
        mask_density: None,
        f16: true,
        seed: 1,
    };
    let (cu, kinds) = (case.cu_seqlens(), case.kinds());
    let plan = PrefillPlan::new(&gpu, &args(&case, &cu, &kinds, None)).unwrap();
    assert_eq!(plan.tokens(), 270);
    assert_eq!(plan.items(), 1 + 2); // query tiles of 2 x 64 queries
                                     // With masks, the masked kernel's work items are single query blocks.
    let masks: Vec<BlockMask> = case
        .lens
        .iter()
        .map(|&len| BlockMask::from_fn(case.q_heads(), len, |_, _, _| true).unwrap())
        .collect();
    let masked = PrefillPlan::new(&gpu, &args(&case, &cu, &kinds, Some(&masks))).unwrap();
    assert_eq!(masked.items(), 2 + 4); // query blocks of 64 queries
    for seed in [1, 2] {
        let case = Case {
            seed,
            ..case.clone()
        };
        let x = inputs::<f16>(&case);
        let s = gpu.stream();
        let (q, k, v) = (
            s.clone_htod(&x.q).unwrap(),
            s.clone_htod(&x.k).unwrap(),
            s.clone_htod(&x.v).unwrap(),
        );
        let mut out = s.alloc_zeros::<f16>(x.q.len()).unwrap();
        plan.run(&gpu, &q, &k, &v, &mut out).unwrap();
        let out = s.clone_dtoh(&out).unwrap();
        let want = run_reference(&case, &cu, &patterns(&case), &x);
        let (err, _) = worst_head_error(&out, &want, case.q_heads(), 64).unwrap();
        assert!(err < 2e-3, "seed {seed}: error {err:.3e}");
    }
    // Tensors of the wrong length are refused before any launch.
    let s = gpu.stream();
    let short = s.alloc_zeros::<f16>(10).unwrap();
    let mut out = s.alloc_zeros::<f16>(270 * 2 * 64).unwrap();
    let err = plan
        .run(&gpu, &short, &short, &short, &mut out)
        .unwrap_err();
    assert!(
        matches!(err, LserveError::ShapeMismatch { what: "q", .. }),
        "{err}"
    );
}

/// Bad arguments are typed errors (checked on the host, no GPU needed).
#[test]
fn invalid_arguments_are_typed_errors() {
    let kinds = [HeadKind::Dense, HeadKind::Streaming];
    let mask = BlockMask::new(4, 100, true).unwrap();
    let masks = [mask.clone()];
    let good = PrefillArgs {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 128,
        cu_seqlens: &[0, 100],
        kinds: &kinds,
        sink_tokens: 4,
        local_tokens: 64,
        block_masks: Some(&masks),
        softmax_scale: None,
        prefix_lens: None,
        with_lse: false,
    };
    assert_eq!(good.validate().unwrap(), 100);

    let bad = |a: PrefillArgs<'_>| a.validate().unwrap_err();
    assert!(matches!(
        bad(PrefillArgs {
            head_dim: 96,
            ..good
        }),
        LserveError::InvalidArgument {
            what: "head_dim",
            ..
        }
    ));
    assert!(matches!(
        bad(PrefillArgs {
            kv_heads: 3,
            ..good
        }),
        LserveError::InvalidArgument {
            what: "q_heads",
            ..
        }
    ));
    assert!(matches!(
        bad(PrefillArgs {
            kinds: &kinds[..1],
            ..good
        }),
        LserveError::ShapeMismatch { .. }
    ));
    assert!(matches!(
        bad(PrefillArgs {
            local_tokens: 0,
            ..good
        }),
        LserveError::InvalidConfig {
            field: "local_tokens",
            ..
        }
    ));
    // All-dense heads do not need a window.
    let dense = [HeadKind::Dense; 2];
    assert!(PrefillArgs {
        local_tokens: 0,
        kinds: &dense,
        ..good
    }
    .validate()
    .is_ok());
    assert!(matches!(
        bad(PrefillArgs {
            cu_seqlens: &[0],
            ..good
        }),
        LserveError::Empty(_)
    ));
    assert!(matches!(
        bad(PrefillArgs {
            cu_seqlens: &[1, 100],
            ..good
        }),
        LserveError::InvalidArgument {
            what: "cu_seqlens",
            ..
        }
    ));
    assert!(matches!(
        bad(PrefillArgs {
            cu_seqlens: &[0, 100, 100],
            block_masks: None,
            ..good
        }),
        LserveError::Empty(_)
    ));
    assert!(matches!(
        bad(PrefillArgs {
            softmax_scale: Some(f32::NAN),
            ..good
        }),
        LserveError::InvalidArgument {
            what: "softmax_scale",
            ..
        }
    ));
    // Mask count and shape.
    let two = [mask.clone(), mask.clone()];
    assert!(matches!(
        bad(PrefillArgs {
            block_masks: Some(&two),
            ..good
        }),
        LserveError::ShapeMismatch { .. }
    ));
    let wrong = [BlockMask::new(4, 200, true).unwrap()];
    assert!(matches!(
        bad(PrefillArgs {
            block_masks: Some(&wrong),
            ..good
        }),
        LserveError::ShapeMismatch {
            what: "block mask (blocks)",
            ..
        }
    ));
}

/// `prefill_into_cache`: whole prompts of two sequences (pages interleaved) into layer 1 of a
/// two-layer cache with mixed head kinds; the downloaded cache equals the reference's
/// `write_tokens` (K/V pages, key statistics, streaming sinks and ring) bit for bit, and the
/// output matches `reference::prefill::prefill_layer`.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn prefill_into_cache_writes_the_cache_and_attends() {
    use lserve::config::SparsityConfig;
    use lserve::geometry::ModelGeometry;
    use lserve::gpu::{prefill_into_cache, DeviceKvCache, KvWritePlan};
    use lserve::head_pattern::HeadPattern;
    use lserve::index_table::IndexTables;
    use lserve::paging::{HostKvCache, KvCacheManager};
    use lserve::reference::kv_write::write_tokens;

    let gpu = gpu();
    let (d, layer) = (64, 1);
    let g = ModelGeometry::new(2, 4, 2, d).unwrap();
    let kinds = vec![
        vec![HeadKind::Dense, HeadKind::Streaming],
        vec![HeadKind::Streaming, HeadKind::Dense],
    ];
    let pattern = HeadPattern::from_kinds(g, kinds).unwrap();
    let config = SparsityConfig {
        page_tokens: 64,
        logical_page_tokens: 16,
        token_budget: 128,
        sink_tokens: 32,
        local_tokens: 100,
        ..Default::default()
    };
    let mut mgr = KvCacheManager::new(g, pattern.clone(), config, 16, 3, 512).unwrap();
    let (a, b) = (mgr.add_sequence().unwrap(), mgr.add_sequence().unwrap());
    mgr.reserve(a, 70).unwrap();
    mgr.reserve(b, 150).unwrap();
    mgr.reserve(a, 130).unwrap();
    let plan = KvWritePlan::new(&mgr, &[(b, 0..150), (a, 0..200)]).unwrap();
    let cu: Vec<usize> = plan.cu_seqlens().iter().map(|&x| x as usize).collect();
    let t = plan.rows();

    let mut rng = StdRng::seed_from_u64(3);
    let q: Vec<bf16> = rounded(&normalish(&mut rng, t * 4 * d));
    let k: Vec<bf16> = rounded(&normalish(&mut rng, t * 2 * d));
    let v: Vec<bf16> = rounded(&normalish(&mut rng, t * 2 * d));
    let mut host = HostKvCache::<bf16>::for_manager(&mgr).unwrap();
    let mut index = IndexTables::for_manager(&mgr).unwrap();
    let mut device = DeviceKvCache::upload(&gpu, &mgr, &host, &index).unwrap();
    let s = gpu.stream();
    let (q_dev, k_dev, v_dev) = (
        s.clone_htod(&q).unwrap(),
        s.clone_htod(&k).unwrap(),
        s.clone_htod(&v).unwrap(),
    );
    let mut out_dev = s.clone_htod(&vec![bf16::NAN; t * 4 * d]).unwrap();
    let device_plan = plan.upload(&gpu, &mgr, &mut device).unwrap();
    prefill_into_cache(
        &gpu,
        &mut device,
        layer,
        &device_plan,
        None,
        &q_dev,
        &k_dev,
        &v_dev,
        &mut out_dev,
    )
    .unwrap();
    let mut got = host.clone();
    device.download(&gpu, &mut got, &mut index).unwrap();
    let out = s.clone_dtoh(&out_dev).unwrap();

    let row = 2 * d;
    for (i, seq) in [b, a].into_iter().enumerate() {
        let rows = cu[i] * row..cu[i + 1] * row;
        let view = mgr.view(seq).unwrap();
        write_tokens(&mut host, layer, &view, 0, &k[rows.clone()], &v[rows]).unwrap();
    }
    for l in 0..2 {
        for (what, g, w) in layer_arrays(&got, &host, l) {
            assert_eq!(g.len(), w.len());
            let first = (0..w.len()).find(|&i| g[i].to_bits() != w[i].to_bits());
            assert!(
                first.is_none(),
                "layer {l} {what}: element {first:?} differs"
            );
        }
    }
    let want = reference::prefill::prefill_layer(&pattern, &config, layer, &cu, &q, &k, &v, None)
        .unwrap()
        .out;
    let (err, head) = worst_head_error(&out, &want, 4, d).unwrap();
    assert!(err < 1e-2, "head {head}: relative error {err:.3e}");
}
