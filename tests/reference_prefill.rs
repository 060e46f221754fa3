//! The prefill reference against a naive dense formulation: plain softmax attention with an
//! explicit token mask matrix (causal, Λ, and a caller block mask expanded to tokens).

use half::bf16;
use lserve::reference::prefill::{prefill_attention, BlockCoord, PrefillInput};
use lserve::reference::TokenPattern;
use lserve::LserveError;
use proptest::prelude::*;
use rand::{rngs::StdRng, Rng, SeedableRng};

const BLOCK: usize = 64;

/// Random values in [-2, 2], rounded to bf16 like real activations (never all zeros).
fn random_values(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| bf16::from_f32(rng.gen_range(-2.0f32..2.0)).to_f32())
        .collect()
}

/// Naive masked softmax attention: `q` is `[n][d]`, `k`, `v` are `[n][d]` (one head, one
/// sequence), `mask[t][j]` says whether query `t` sees key `j`. Returns (out `[n][d]`, lse `[n]`).
fn naive_attention(
    q: &[Vec<f64>],
    k: &[Vec<f64>],
    v: &[Vec<f64>],
    mask: &[Vec<bool>],
    scale: f64,
) -> (Vec<Vec<f64>>, Vec<f64>) {
    let n = q.len();
    let d = q[0].len();
    let mut out = vec![vec![0.0; d]; n];
    let mut lse = vec![0.0; n];
    for t in 0..n {
        let mut scores = vec![f64::NEG_INFINITY; n];
        for j in 0..n {
            if mask[t][j] {
                scores[j] = scale * (0..d).map(|i| q[t][i] * k[j][i]).sum::<f64>();
            }
        }
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        assert!(max.is_finite(), "row {t} sees no key");
        let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let z: f64 = p.iter().sum();
        for j in 0..n {
            for i in 0..d {
                out[t][i] += p[j] / z * v[j][i];
            }
        }
        lse[t] = max + z.ln();
    }
    (out, lse)
}

/// The explicit token mask of a head: pattern matrix AND the block mask expanded to tokens
/// (diagonal blocks forced on).
fn token_mask(
    n: usize,
    pattern: TokenPattern,
    block_bits: Option<&dyn Fn(usize, usize) -> bool>,
) -> Vec<Vec<bool>> {
    let mut m = vec![vec![false; n]; n];
    for (t, row) in m.iter_mut().enumerate() {
        for (j, cell) in row.iter_mut().enumerate() {
            let causal = j <= t;
            let pat = match pattern {
                TokenPattern::Causal => causal,
                TokenPattern::Lambda {
                    sink_tokens,
                    local_tokens,
                } => causal && (j < sink_tokens || t < j + local_tokens),
            };
            let (qb, kb) = (t / BLOCK, j / BLOCK);
            let block = match block_bits {
                None => true,
                Some(bits) => qb == kb || bits(qb, kb),
            };
            *cell = pat && block;
        }
    }
    m
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tweak {
    None,
    ShorterLocal,
    IgnoreBlockMask,
}

#[derive(Debug, Clone)]
struct Case {
    lens: Vec<usize>,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    patterns: Vec<TokenPattern>,
    block_density: Option<f64>,
    seed: u64,
}

fn pattern_strategy() -> impl Strategy<Value = TokenPattern> {
    prop_oneof![
        Just(TokenPattern::Causal),
        (0usize..6, 1usize..48).prop_map(|(sink_tokens, local_tokens)| TokenPattern::Lambda {
            sink_tokens,
            local_tokens
        }),
    ]
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        1usize..=3,
        1usize..=3,
        prop_oneof![1usize..=8, Just(16usize)],
    )
        .prop_flat_map(|(kv_heads, group, head_dim)| {
            (
                prop::collection::vec(1usize..150, 1..=3),
                prop::collection::vec(pattern_strategy(), kv_heads),
                prop::option::of(0.0f64..1.0),
                any::<u64>(),
            )
                .prop_map(move |(lens, patterns, block_density, seed)| Case {
                    lens,
                    kv_heads,
                    group,
                    head_dim,
                    patterns,
                    block_density,
                    seed,
                })
        })
}

/// Runs the reference and the naive formulation on `case`; returns the worst relative error of
/// the output per (sequence, head) and the worst absolute LSE error.
/// `tweak` deliberately breaks the naive side (to show the comparison can fail).
fn compare(case: &Case, tweak: Tweak) -> (f64, f64) {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let (hkv, d) = (case.kv_heads, case.head_dim);
    let hq = hkv * case.group;
    let mut cu = vec![0usize];
    for l in &case.lens {
        cu.push(cu.last().unwrap() + l);
    }
    let t_total = *cu.last().unwrap();
    let q = random_values(&mut rng, t_total * hq * d);
    let k = random_values(&mut rng, t_total * hkv * d);
    let v = random_values(&mut rng, t_total * hkv * d);
    // Block-mask bits [seq][q_head][q_block][kv_block].
    let max_blocks = case.lens.iter().max().unwrap().div_ceil(BLOCK);
    let bits: Vec<bool> = match case.block_density {
        Some(p) => (0..case.lens.len() * hq * max_blocks * max_blocks)
            .map(|_| rng.gen_bool(p))
            .collect(),
        None => Vec::new(),
    };
    let bit = |c: BlockCoord| {
        bits[((c.seq * hq + c.q_head) * max_blocks + c.q_block) * max_blocks + c.kv_block]
    };
    let mask_fn: &dyn Fn(BlockCoord) -> bool = &bit;
    let scale = 1.0 / (d as f64).sqrt();
    let got = prefill_attention(&PrefillInput {
        cu_seqlens: &cu,
        q: &q,
        k: &k,
        v: &v,
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        patterns: &case.patterns,
        block_mask: case.block_density.map(|_| mask_fn),
        scale,
    })
    .unwrap();
    assert_eq!(got.out.len(), t_total * hq * d);
    assert_eq!(got.lse.len(), t_total * hq);

    let mut worst_rel = 0.0f64;
    let mut worst_lse = 0.0f64;
    for (s, &len) in case.lens.iter().enumerate() {
        let start = cu[s];
        for h in 0..hq {
            let kvh = h / case.group;
            let rows = |buf: &[f32], heads: usize, head: usize| -> Vec<Vec<f64>> {
                (0..len)
                    .map(|t| {
                        (0..d)
                            .map(|i| buf[((start + t) * heads + head) * d + i] as f64)
                            .collect()
                    })
                    .collect()
            };
            let (qh, kh, vh) = (rows(&q, hq, h), rows(&k, hkv, kvh), rows(&v, hkv, kvh));
            let pattern = match (tweak, case.patterns[kvh]) {
                (
                    Tweak::ShorterLocal,
                    TokenPattern::Lambda {
                        sink_tokens,
                        local_tokens,
                    },
                ) => TokenPattern::Lambda {
                    sink_tokens,
                    local_tokens: local_tokens - 1,
                },
                (_, p) => p,
            };
            let use_blocks = case.block_density.is_some() && tweak != Tweak::IgnoreBlockMask;
            let block_bits = |qb: usize, kb: usize| {
                bit(BlockCoord {
                    seq: s,
                    q_head: h,
                    q_block: qb,
                    kv_block: kb,
                })
            };
            let bits_dyn: &dyn Fn(usize, usize) -> bool = &block_bits;
            let mask = token_mask(len, pattern, use_blocks.then_some(bits_dyn));
            let (want, want_lse) = naive_attention(&qh, &kh, &vh, &mask, scale);
            let (mut diff, mut norm) = (0.0f64, 0.0f64);
            for t in 0..len {
                for i in 0..d {
                    let g = got.out[((start + t) * hq + h) * d + i];
                    diff += (g - want[t][i]).powi(2);
                    norm += want[t][i].powi(2);
                }
                worst_lse = worst_lse.max((got.lse[(start + t) * hq + h] - want_lse[t]).abs());
            }
            worst_rel = worst_rel.max(diff.sqrt() / norm.sqrt().max(f64::MIN_POSITIVE));
        }
    }
    (worst_rel, worst_lse)
}

proptest! {
    #[test]
    fn prefill_matches_naive_masked_softmax(case in case_strategy()) {
        let (rel, lse) = compare(&case, Tweak::None);
        prop_assert!(rel < 1e-9, "relative error {rel}");
        prop_assert!(lse < 1e-9, "lse error {lse}");
    }
}

/// The comparison can fail: a naive side with a local window one token shorter disagrees.
#[test]
fn comparison_detects_an_off_by_one_local_window() {
    let case = Case {
        lens: vec![100],
        kv_heads: 1,
        group: 2,
        head_dim: 8,
        patterns: vec![TokenPattern::Lambda {
            sink_tokens: 4,
            local_tokens: 16,
        }],
        block_density: None,
        seed: 7,
    };
    assert!(compare(&case, Tweak::None).0 < 1e-9);
    assert!(compare(&case, Tweak::ShorterLocal).0 > 1e-3);
}

/// The comparison can fail: a naive side that ignores the caller's block mask disagrees.
#[test]
fn comparison_detects_an_ignored_block_mask() {
    let case = Case {
        lens: vec![200],
        kv_heads: 2,
        group: 1,
        head_dim: 4,
        patterns: vec![TokenPattern::Causal, TokenPattern::Causal],
        block_density: Some(0.3),
        seed: 11,
    };
    assert!(compare(&case, Tweak::None).0 < 1e-9);
    assert!(compare(&case, Tweak::IgnoreBlockMask).0 > 1e-3);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let x = [1.0f32; 8];
    let base = PrefillInput {
        cu_seqlens: &[0, 2],
        q: &x[..4],
        k: &x[..4],
        v: &x[..4],
        q_heads: 1,
        kv_heads: 1,
        head_dim: 2,
        patterns: &[TokenPattern::Causal],
        block_mask: None,
        scale: 1.0,
    };
    assert!(prefill_attention(&base).is_ok());
    assert!(prefill_attention(&PrefillInput { q: &x, ..base }).is_err());
    assert!(prefill_attention(&PrefillInput {
        cu_seqlens: &[0, 2, 2],
        ..base
    })
    .is_err());
    assert!(prefill_attention(&PrefillInput {
        cu_seqlens: &[0],
        ..base
    })
    .is_err());
    assert!(prefill_attention(&PrefillInput {
        q_heads: 3,
        kv_heads: 2,
        ..base
    })
    .is_err());
    assert!(prefill_attention(&PrefillInput {
        patterns: &[TokenPattern::Lambda {
            sink_tokens: 1,
            local_tokens: 0
        }],
        ..base
    })
    .is_err());
}

proptest! {
    /// The typed entry point (element inputs, head pattern, config, `BlockMask` per sequence)
    /// against the naive formulation.
    #[test]
    fn prefill_layer_matches_naive(
        kinds in prop::collection::vec(any::<bool>(), 1..=2),
        group in 1usize..=2,
        lens in prop::collection::vec(1usize..100, 1..=2),
        sink in 0usize..5,
        local in 1usize..40,
        density in prop::option::of(0.0f64..1.0),
        seed: u64,
    ) {
        use lserve::block_iter::BlockMask;
        use lserve::config::SparsityConfig;
        use lserve::geometry::ModelGeometry;
        use lserve::head_pattern::{HeadKind, HeadPattern};
        use lserve::reference::prefill::prefill_layer;

        const D: usize = 64;
        let (hkv, hq) = (kinds.len(), kinds.len() * group);
        let g = ModelGeometry::new(1, hq, hkv, D).unwrap();
        let head_kinds = kinds.iter().map(|&s| if s { HeadKind::Streaming } else { HeadKind::Dense }).collect();
        let pattern = HeadPattern::from_kinds(g, vec![head_kinds]).unwrap();
        let config = SparsityConfig { sink_tokens: sink, local_tokens: local, ..Default::default() };
        let mut rng = StdRng::seed_from_u64(seed);
        let mut cu = vec![0usize];
        for l in &lens {
            cu.push(cu.last().unwrap() + l);
        }
        let t_total = *cu.last().unwrap();
        let q: Vec<bf16> = (0..t_total * hq * D).map(|_| bf16::from_f32(rng.gen_range(-2.0f32..2.0))).collect();
        let k: Vec<bf16> = (0..t_total * hkv * D).map(|_| bf16::from_f32(rng.gen_range(-2.0f32..2.0))).collect();
        let v: Vec<bf16> = (0..t_total * hkv * D).map(|_| bf16::from_f32(rng.gen_range(-2.0f32..2.0))).collect();
        let masks: Option<Vec<BlockMask>> = density.map(|p| {
            lens.iter().map(|&l| BlockMask::from_fn(hq, l, |_, _, _| rng.gen_bool(p)).unwrap()).collect()
        });
        let got = prefill_layer(&pattern, &config, 0, &cu, &q, &k, &v, masks.as_deref()).unwrap();
        let scale = 1.0 / (D as f64).sqrt();
        for (s, &len) in lens.iter().enumerate() {
            for h in 0..hq {
                let kvh = h / group;
                let rows = |buf: &[bf16], heads: usize, head: usize| -> Vec<Vec<f64>> {
                    (0..len)
                        .map(|t| (0..D).map(|i| buf[((cu[s] + t) * heads + head) * D + i].to_f64()).collect())
                        .collect()
                };
                let p = if kinds[kvh] {
                    TokenPattern::Lambda { sink_tokens: sink, local_tokens: local }
                } else {
                    TokenPattern::Causal
                };
                let bits = |qb: usize, kb: usize| masks.as_ref().unwrap()[s].get(h, qb, kb).unwrap();
                let bits_dyn: &dyn Fn(usize, usize) -> bool = &bits;
                let mask = token_mask(len, p, masks.as_ref().map(|_| bits_dyn));
                let (want, _) = naive_attention(&rows(&q, hq, h), &rows(&k, hkv, kvh), &rows(&v, hkv, kvh), &mask, scale);
                let (mut diff, mut norm) = (0.0f64, 0.0f64);
                for t in 0..len {
                    for i in 0..D {
                        diff += (got.out[((cu[s] + t) * hq + h) * D + i] - want[t][i]).powi(2);
                        norm += want[t][i].powi(2);
                    }
                }
                prop_assert!((diff / norm).sqrt() < 1e-9);
            }
        }
    }
}

/// A batch whose buffer sizes overflow (`T x heads x D`) is `InvalidArgument`, never an
/// overflow panic.
#[test]
fn overflowing_batch_sizes_are_errors() {
    let x = [1.0f32; 4];
    let input = PrefillInput {
        cu_seqlens: &[0, usize::MAX / 2],
        q: &x,
        k: &x,
        v: &x,
        q_heads: 4,
        kv_heads: 1,
        head_dim: 64,
        patterns: &[TokenPattern::Causal],
        block_mask: None,
        scale: 1.0,
    };
    assert!(matches!(
        prefill_attention(&input),
        Err(LserveError::InvalidArgument {
            what: "cu_seqlens",
            ..
        })
    ));
    let fits = PrefillInput {
        cu_seqlens: &[0, 2],
        q_heads: 1,
        head_dim: 2,
        ..input
    };
    assert!(prefill_attention(&fits).is_ok());
}

/// A softmax scale that is NaN, infinite, zero or negative is `InvalidArgument` on plain slices,
/// and the config's `InvalidConfig` through a layer's config.
#[test]
fn bad_softmax_scales_are_errors() {
    use half::f16;
    use lserve::config::SparsityConfig;
    use lserve::geometry::ModelGeometry;
    use lserve::head_pattern::HeadPattern;
    use lserve::reference::prefill::prefill_layer;

    let x = [1.0f32; 4];
    let input = PrefillInput {
        cu_seqlens: &[0, 2],
        q: &x,
        k: &x,
        v: &x,
        q_heads: 1,
        kv_heads: 1,
        head_dim: 2,
        patterns: &[TokenPattern::Causal],
        block_mask: None,
        scale: 1.0,
    };
    assert!(prefill_attention(&input).is_ok());
    let g = ModelGeometry::new(1, 1, 1, 64).unwrap();
    let pattern = HeadPattern::all_dense(g);
    let q = vec![f16::from_f32(0.5); 3 * 64];
    for scale in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, -1.0] {
        assert!(matches!(
            prefill_attention(&PrefillInput { scale, ..input }),
            Err(LserveError::InvalidArgument { what: "scale", .. })
        ));
        let config = SparsityConfig {
            softmax_scale: Some(scale as f32),
            ..Default::default()
        };
        assert!(matches!(
            prefill_layer(&pattern, &config, 0, &[0, 3], &q, &q, &q, None),
            Err(LserveError::InvalidConfig {
                field: "softmax_scale",
                ..
            })
        ));
    }
    let config = SparsityConfig {
        softmax_scale: Some(0.5),
        ..Default::default()
    };
    assert!(prefill_layer(&pattern, &config, 0, &[0, 3], &q, &q, &q, None).is_ok());
}

/// A layer out of range is `InvalidArgument` (not an index panic), from the pattern helper and
/// from the layer entry point (both borrow their inputs immutably and hold no state).
#[test]
fn layer_out_of_range_is_an_error() {
    use half::f16;
    use lserve::config::SparsityConfig;
    use lserve::geometry::ModelGeometry;
    use lserve::head_pattern::{HeadKind, HeadPattern};
    use lserve::reference::prefill::{layer_token_patterns, prefill_layer};

    let g = ModelGeometry::new(2, 2, 2, 64).unwrap();
    let kinds = vec![vec![HeadKind::Dense, HeadKind::Streaming]; 2];
    let pattern = HeadPattern::from_kinds(g, kinds).unwrap();
    let config = SparsityConfig::default();
    assert_eq!(layer_token_patterns(&pattern, &config, 1).unwrap().len(), 2);
    for layer in [2, usize::MAX] {
        assert!(matches!(
            layer_token_patterns(&pattern, &config, layer),
            Err(LserveError::InvalidArgument { what: "layer", .. })
        ));
        let x = vec![f16::from_f32(0.5); 3 * 2 * 64];
        assert!(matches!(
            prefill_layer(&pattern, &config, layer, &[0, 3], &x, &x, &x, None),
            Err(LserveError::InvalidArgument { what: "layer", .. })
        ));
    }
}

/// `prefill_layer` validates its config before anything else: every rule of
/// `SparsityConfig::validate` is `InvalidConfig`, also the ones prefill itself does not read
/// (page sizes, budget, reuse interval) and a streaming head with no local tokens. (It holds no
/// state and borrows its inputs immutably: nothing to leave unchanged.)
#[test]
fn prefill_layer_validates_its_config() {
    use half::f16;
    use lserve::config::SparsityConfig;
    use lserve::geometry::ModelGeometry;
    use lserve::head_pattern::{HeadKind, HeadPattern};
    use lserve::reference::prefill::prefill_layer;

    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    let pattern =
        HeadPattern::from_kinds(g, vec![vec![HeadKind::Dense, HeadKind::Streaming]]).unwrap();
    let x = vec![f16::from_f32(0.5); 3 * 2 * 64];
    let d = SparsityConfig::default();
    prefill_layer(&pattern, &d, 0, &[0, 3], &x, &x, &x, None).unwrap();
    let cases = [
        (
            SparsityConfig {
                token_budget: 100,
                ..d
            },
            "token_budget",
        ),
        (
            SparsityConfig {
                page_tokens: 0,
                ..d
            },
            "page_tokens",
        ),
        (
            SparsityConfig {
                logical_page_tokens: 24,
                ..d
            },
            "logical_page_tokens",
        ),
        (
            SparsityConfig {
                reuse_interval: 0,
                ..d
            },
            "reuse_interval",
        ),
        (
            SparsityConfig {
                local_tokens: 0,
                ..d
            },
            "local_tokens",
        ),
        (
            SparsityConfig {
                sink_tokens: usize::MAX,
                ..d
            },
            "sink_tokens",
        ),
    ];
    for (config, field) in cases {
        match prefill_layer(&pattern, &config, 0, &[0, 3], &x, &x, &x, None) {
            Err(LserveError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: expected InvalidConfig, got {other:?}"),
        }
    }
}
