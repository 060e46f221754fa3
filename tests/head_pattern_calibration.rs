//! Head patterns from calibration activations (`Calibration`, `HeadPattern::from_calibration`):
//! synthetic queries and keys where some heads attend only to the sinks or the local window and
//! others to planted keys just outside it; the scores against a brute-force softmax over the
//! reference's Λ visibility; typed errors that leave the accumulator unchanged.

use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{Calibration, CalibrationScore, HeadKind, HeadPattern};
use lserve::reference::decode::attend_rows;
use lserve::reference::TokenPattern;
use lserve::LserveError;

const D: usize = 64;
const SINK: usize = 4;
const LOCAL: usize = 8;
/// Tokens of the synthetic sequence: at most `D`, so that one-hot keys are orthogonal.
const T: usize = 48;
/// Query magnitude: with the default scale `1/8`, a logit of 200 on the aligned keys, 0
/// elsewhere, so a head's mass is on its aligned keys up to `T * e^-200`.
const BIG: f32 = 1600.0;

fn config() -> SparsityConfig {
    SparsityConfig {
        sink_tokens: SINK,
        local_tokens: LOCAL,
        ..SparsityConfig::default()
    }
}

/// What one query head attends to at position `t` (the keys its query is aligned with).
#[derive(Clone, Copy, Debug)]
enum Behaviour {
    /// The sinks (keys 0 and 1): streaming-like.
    Sink,
    /// Itself and the previous token: streaming-like.
    Local,
    /// Key `SINK`, the first key after the sinks: outside the window from position
    /// `SINK + LOCAL` on.
    FarAfterSinks,
    /// Key `t - LOCAL`, the newest key outside the local window.
    FarEdge,
}

impl Behaviour {
    fn aligned(self, t: usize) -> Vec<usize> {
        match self {
            Behaviour::Sink => vec![0, 1],
            Behaviour::Local => vec![t, t.saturating_sub(1)],
            Behaviour::FarAfterSinks => vec![SINK],
            Behaviour::FarEdge => vec![t.saturating_sub(LOCAL)],
        }
    }
}

/// One layer's `q [T][Hq][D]` and `k [T][Hkv][D]`: key `j` of every KV head is `e_j`; query
/// head `h` at `t` is `BIG` on the keys `behaviour[h]` aligns it with.
fn layer_activations(g: &ModelGeometry, behaviour: &[Behaviour]) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(behaviour.len(), g.q_heads());
    let (hq, hkv) = (g.q_heads(), g.kv_heads());
    let mut k = vec![0.0f32; T * hkv * D];
    for j in 0..T {
        for h in 0..hkv {
            k[(j * hkv + h) * D + j] = 1.0;
        }
    }
    let mut q = vec![0.0f32; T * hq * D];
    for t in 0..T {
        for (h, b) in behaviour.iter().enumerate() {
            for j in b.aligned(t) {
                q[(t * hq + h) * D + j] = BIG;
            }
        }
    }
    (q, k)
}

/// Two layers of 4 KV heads, 2 query heads each. Streaming-like KV heads: layer 0 heads 0, 1, 3
/// and layer 1 head 1 (3 in one layer, 1 in the other: a per-layer quantile would pick 2 and
/// 2). Layer 1 head 2 is mixed: one query head sink, one far (score about 0.5).
fn planted() -> (ModelGeometry, Vec<Vec<Behaviour>>) {
    use Behaviour::{FarAfterSinks as Far, FarEdge as Edge, Local, Sink};
    let g = ModelGeometry::new(2, 8, 4, D).unwrap();
    let per_kv = [[Sink, Local, Far, Local], [Edge, Sink, Sink, Far]];
    let mut layers: Vec<Vec<Behaviour>> = per_kv
        .iter()
        .map(|row| row.iter().flat_map(|&b| [b, b]).collect())
        .collect();
    layers[1][5] = Edge; // layer 1, KV head 2: query heads 4 (sink) and 5 (far)
    (g, layers)
}

fn calibrated(stride: usize) -> Calibration {
    let (g, layers) = planted();
    let mut cal = Calibration::new(g, &config())
        .unwrap()
        .with_stride(stride)
        .unwrap();
    for (layer, behaviour) in layers.iter().enumerate() {
        let (q, k) = layer_activations(&g, behaviour);
        let n = cal.add_layer(layer, T, &q, &k).unwrap();
        assert_eq!(n, (T - SINK - LOCAL).div_ceil(stride));
    }
    cal
}

#[test]
fn scores_separate_streaming_like_heads_from_far_attending_ones() {
    let scores = calibrated(1).scores().unwrap();
    let low = [(0, 0), (0, 1), (0, 3), (1, 1)];
    let high = [(0, 2), (1, 0), (1, 3)];
    for (l, h) in low {
        assert!(scores[l][h] < 1e-9, "({l}, {h}): {}", scores[l][h]);
    }
    for (l, h) in high {
        assert!(scores[l][h] > 1.0 - 1e-9, "({l}, {h}): {}", scores[l][h]);
    }
    // The mixed head: the mean over its two query heads.
    assert!((scores[1][2] - 0.5).abs() < 1e-9, "{}", scores[1][2]);
}

#[test]
fn from_calibration_marks_exactly_the_streaming_like_heads() {
    use HeadKind::{Dense as D_, Streaming as S};
    for stride in [1, 3, 7] {
        let cal = calibrated(stride);
        // 4 of 8 streaming-like: fraction 0.5 picks exactly them, globally (3 in layer 0).
        let p = HeadPattern::from_calibration(&cal, 0.5).unwrap();
        assert_eq!(p.layer_kinds(0), &[S, S, D_, S], "stride {stride}");
        assert_eq!(p.layer_kinds(1), &[D_, S, D_, D_], "stride {stride}");
        // One more: the mixed head (score 0.5) comes next.
        let p = HeadPattern::from_calibration(&cal, 5.0 / 8.0).unwrap();
        assert_eq!(p.layer_kinds(1), &[D_, S, S, D_]);
        assert_eq!(p.total_streaming_heads(), 5);
        // round(0.3 * 8) = 2: the two lowest by (score, layer, head); all four score ~0, so the
        // first two of layer 0 unless rounding noise reorders them: only check the count and
        // that they are streaming-like.
        let p = HeadPattern::from_calibration(&cal, 0.3).unwrap();
        assert_eq!(p.total_streaming_heads(), 2);
        for l in 0..2 {
            for &h in p.streaming_kv_heads(l) {
                assert!([(0, 0), (0, 1), (0, 3), (1, 1)].contains(&(l, h)));
            }
        }
        let none = HeadPattern::from_calibration(&cal, 0.0).unwrap();
        assert_eq!(none, HeadPattern::all_dense(*cal.geometry()));
        let all = HeadPattern::from_calibration(&cal, 1.0).unwrap();
        assert_eq!(all.total_streaming_heads(), 8);
    }
}

#[test]
fn from_calibration_thresholds_like_from_gating_values() {
    let cal = calibrated(2);
    let scores = cal.scores().unwrap();
    for s in [0.0, 0.1, 0.25, 0.5, 0.6, 0.75, 0.9, 1.0] {
        assert_eq!(
            HeadPattern::from_calibration(&cal, s).unwrap(),
            HeadPattern::from_gating_values(&scores, *cal.geometry(), s).unwrap(),
            "fraction {s}"
        );
    }
}

/// Deterministic pseudo-random values in `[-1, 1)` (splitmix64).
fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The score of every KV head, brute force: per sampled query row, a softmax over keys `0..=t`
/// and the mass on keys the reference's Λ pattern does not show; mean over rows.
fn brute_force(
    g: &ModelGeometry,
    c: &SparsityConfig,
    stride: usize,
    seqs: &[(usize, Vec<f32>, Vec<f32>)],
) -> Vec<f64> {
    let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    let lambda = TokenPattern::Lambda {
        sink_tokens: c.sink_tokens,
        local_tokens: c.local_tokens,
    };
    let scale = 1.0 / (d as f64).sqrt();
    let (mut sum, mut rows) = (vec![0.0; hkv], vec![0usize; hkv]);
    for (t_len, q, k) in seqs {
        for t in (c.sink_tokens + c.local_tokens..*t_len).step_by(stride) {
            for qh in 0..hq {
                let kvh = g.kv_head_of(qh);
                let logits: Vec<f64> = (0..=t)
                    .map(|j| {
                        scale
                            * (0..d)
                                .map(|i| {
                                    q[(t * hq + qh) * d + i] as f64
                                        * k[(j * hkv + kvh) * d + i] as f64
                                })
                                .sum::<f64>()
                    })
                    .collect();
                let z: f64 = logits.iter().map(|l| l.exp()).sum();
                sum[kvh] += (0..=t)
                    .filter(|&j| !lambda.visible(t, j))
                    .map(|j| logits[j].exp() / z)
                    .sum::<f64>();
                rows[kvh] += 1;
            }
        }
    }
    sum.iter().zip(&rows).map(|(s, &n)| s / n as f64).collect()
}

#[test]
fn scores_match_a_brute_force_softmax_over_the_lambda_mask() {
    let g = ModelGeometry::new(1, 6, 2, D).unwrap();
    let c = SparsityConfig {
        sink_tokens: 3,
        local_tokens: 5,
        ..SparsityConfig::default()
    };
    let stride = 2;
    // Two sequences of different lengths, added to the same layer: their rows pool.
    let seqs: Vec<(usize, Vec<f32>, Vec<f32>)> = [(40usize, 1u64), (23, 2)]
        .iter()
        .map(|&(t, seed)| {
            let q = noise(seed, t * 6 * D).iter().map(|x| 3.0 * x).collect();
            let k = noise(seed + 100, t * 2 * D);
            (t, q, k)
        })
        .collect();
    let mut cal = Calibration::new(g, &c)
        .unwrap()
        .with_stride(stride)
        .unwrap();
    for (t, q, k) in &seqs {
        cal.add_layer(0, *t, q, k).unwrap();
    }
    assert_eq!(cal.positions(), &[16 + 8]);
    let want = brute_force(&g, &c, stride, &seqs);
    let got = &cal.scores().unwrap()[0];
    for h in 0..2 {
        assert!(
            (got[h] - want[h]).abs() < 1e-9,
            "head {h}: {} vs {}",
            got[h],
            want[h]
        );
        assert!(
            got[h] > 0.05 && got[h] < 0.95,
            "not a trivial score: {}",
            got[h]
        );
    }
}

#[test]
fn explicit_softmax_scale_is_used() {
    // Uniform keys, one query aligned with key 0 (a sink): a smaller scale spreads the mass
    // outward, so the score grows.
    let g = ModelGeometry::new(1, 1, 1, D).unwrap();
    let t = 30;
    let (mut q, mut k) = (vec![0.0f32; t * D], vec![0.0f32; t * D]);
    for j in 0..t {
        k[j * D + j] = 1.0;
        q[j * D] = 160.0;
    }
    let score = |scale| {
        let c = SparsityConfig {
            softmax_scale: scale,
            ..config()
        };
        let mut cal = Calibration::new(g, &c).unwrap();
        cal.add_layer(0, t, &q, &k).unwrap();
        cal.scores().unwrap()[0][0]
    };
    let (default, small) = (score(None), score(Some(0.01)));
    assert!(small > 10.0 * default, "{small} vs {default}");
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let (g, layers) = planted();
    let (q, k) = layer_activations(&g, &layers[0]);
    let mut cal = Calibration::new(g, &config()).unwrap();
    cal.add_layer(0, T, &q, &k).unwrap();
    let before = cal.clone();

    let err = cal.add_layer(2, T, &q, &k).unwrap_err();
    assert!(
        matches!(err, LserveError::InvalidArgument { what: "layer", .. }),
        "{err}"
    );
    let err = cal.add_layer(1, T, &q[..q.len() - 1], &k).unwrap_err();
    assert!(
        matches!(err, LserveError::ShapeMismatch { what: "q", expected, actual }
            if expected == q.len() && actual == q.len() - 1),
        "{err}"
    );
    let err = cal.add_layer(1, T, &q, &k[..k.len() - D]).unwrap_err();
    assert!(
        matches!(err, LserveError::ShapeMismatch { what: "k", .. }),
        "{err}"
    );
    let err = cal.add_layer(1, T + 1, &q, &k).unwrap_err();
    assert!(
        matches!(err, LserveError::ShapeMismatch { what: "q", .. }),
        "{err}"
    );
    let err = cal.add_layer(1, usize::MAX / 2, &q, &k).unwrap_err();
    assert!(
        matches!(err, LserveError::InvalidArgument { what: "tokens", .. }),
        "{err}"
    );
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut q2 = q.clone();
        q2[q.len() - 1] = bad; // the last query row: the last one the loop would reach
        let err = cal.add_layer(0, T, &q2, &k).unwrap_err();
        assert!(
            matches!(err, LserveError::InvalidArgument { what: "q", .. }),
            "{err}"
        );
        let mut k2 = k.clone();
        k2[5] = bad;
        let err = cal.add_layer(0, T, &q, &k2).unwrap_err();
        assert!(
            matches!(err, LserveError::InvalidArgument { what: "k", .. }),
            "{err}"
        );
    }
    assert_eq!(cal, before, "a failed add_layer changed the accumulator");

    // Layer 1 has no position yet: no scores, no pattern, whatever the fraction.
    let err = cal.scores().unwrap_err();
    assert!(
        matches!(&err, LserveError::InvalidArgument { what: "calibration", reason }
            if reason.contains("layer 1")),
        "{err}"
    );
    let err = HeadPattern::from_calibration(&cal, 0.5).unwrap_err();
    assert!(
        matches!(
            err,
            LserveError::InvalidArgument {
                what: "calibration",
                ..
            }
        ),
        "{err}"
    );
    // A sequence no longer than the window adds nothing and is not an error.
    let short = SINK + LOCAL;
    let n = cal
        .add_layer(1, short, &q[..short * 8 * D], &k[..short * 4 * D])
        .unwrap();
    assert_eq!(n, 0);
    assert_eq!(cal, before);
    assert!(HeadPattern::from_calibration(&cal, 0.5).is_err());

    let (q1, k1) = layer_activations(&g, &layers[1]);
    cal.add_layer(1, T, &q1, &k1).unwrap();
    for bad in [-0.1, 1.0 + 1e-9, f64::NAN, f64::INFINITY] {
        let err = HeadPattern::from_calibration(&cal, bad).unwrap_err();
        assert!(
            matches!(
                err,
                LserveError::InvalidConfig {
                    field: "streaming_fraction",
                    ..
                }
            ),
            "{bad}: {err}"
        );
    }
    // A fresh accumulator: no positions at all.
    let fresh = Calibration::new(g, &config()).unwrap();
    assert!(matches!(
        HeadPattern::from_calibration(&fresh, 0.5).unwrap_err(),
        LserveError::InvalidArgument {
            what: "calibration",
            ..
        }
    ));
    assert!(matches!(
        Calibration::new(g, &config())
            .unwrap()
            .with_stride(0)
            .unwrap_err(),
        LserveError::InvalidArgument { what: "stride", .. }
    ));
    let bad_config = SparsityConfig {
        softmax_scale: Some(f32::NAN),
        ..config()
    };
    assert!(Calibration::new(g, &bad_config).is_err());
}

/// The planted layers again, with values (pseudo-random per key): the Λ mask's output error
/// ranks the heads as the mass does, and picks the same streaming heads.
#[test]
fn output_error_separates_the_planted_heads() {
    let (g, layers) = planted();
    let mut cal = Calibration::new(g, &config()).unwrap();
    for (layer, behaviour) in layers.iter().enumerate() {
        let (q, k) = layer_activations(&g, behaviour);
        let v = noise(layer as u64, T * 4 * D);
        cal.add_layer_with_values(layer, T, &q, &k, &v).unwrap();
    }
    let err = cal.output_errors().unwrap();
    for (l, h) in [(0, 0), (0, 1), (0, 3), (1, 1)] {
        assert!(err[l][h] < 1e-9, "({l}, {h}): {}", err[l][h]);
    }
    for (l, h) in [(0, 2), (1, 0), (1, 3), (1, 2)] {
        assert!(err[l][h] > 0.3, "({l}, {h}): {}", err[l][h]);
    }
    use HeadKind::{Dense as D_, Streaming as S};
    let p = HeadPattern::from_calibration_by(&cal, CalibrationScore::OutputError, 0.5).unwrap();
    assert_eq!(p.layer_kinds(0), &[S, S, D_, S]);
    assert_eq!(p.layer_kinds(1), &[D_, S, D_, D_]);
    // The mass is accumulated as by add_layer.
    assert_eq!(cal.scores().unwrap(), calibrated(1).scores().unwrap());
}

#[test]
fn output_error_matches_the_reference_attention() {
    let g = ModelGeometry::new(1, 4, 2, D).unwrap();
    let c = SparsityConfig {
        sink_tokens: 2,
        local_tokens: 6,
        ..SparsityConfig::default()
    };
    let t_len = 30;
    let q: Vec<f32> = noise(7, t_len * 4 * D).iter().map(|x| 3.0 * x).collect();
    let k = noise(8, t_len * 2 * D);
    let v = noise(9, t_len * 2 * D);
    let stride = 3;
    let mut cal = Calibration::new(g, &c)
        .unwrap()
        .with_stride(stride)
        .unwrap();
    cal.add_layer_with_values(0, t_len, &q, &k, &v).unwrap();
    let lambda = TokenPattern::Lambda {
        sink_tokens: 2,
        local_tokens: 6,
    };
    let scale = 1.0 / (D as f64).sqrt();
    let (mut num, mut den) = ([0.0f64; 2], [0.0f64; 2]);
    for t in (8..t_len).step_by(stride) {
        for qh in 0..4 {
            let kvh = qh / 2;
            let qrow = &q[(t * 4 + qh) * D..][..D];
            let rows = |keep: &dyn Fn(usize) -> bool| {
                let js: Vec<usize> = (0..=t).filter(|&j| keep(j)).collect();
                let keys: Vec<&[f32]> = js.iter().map(|&j| &k[(j * 2 + kvh) * D..][..D]).collect();
                let vals: Vec<&[f32]> = js.iter().map(|&j| &v[(j * 2 + kvh) * D..][..D]).collect();
                attend_rows(qrow, &keys, &vals, scale).out
            };
            let dense = rows(&|_| true);
            let streaming = rows(&|j| lambda.visible(t, j));
            for (a, b) in dense.iter().zip(&streaming) {
                num[kvh] += (a - b) * (a - b);
                den[kvh] += a * a;
            }
        }
    }
    let got = &cal.output_errors().unwrap()[0];
    for h in 0..2 {
        let want = (num[h] / den[h]).sqrt();
        assert!(
            (got[h] - want).abs() < 1e-9 * want.max(1.0),
            "head {h}: {} vs {want}",
            got[h]
        );
        assert!(want > 0.05, "not a trivial error: {want}");
    }
}

#[test]
fn bad_values_are_typed_errors_and_change_nothing() {
    let (g, layers) = planted();
    let (q, k) = layer_activations(&g, &layers[0]);
    let v = noise(3, k.len());
    let mut cal = Calibration::new(g, &config()).unwrap();
    cal.add_layer(0, T, &q, &k).unwrap();
    cal.add_layer(1, T, &q, &k).unwrap();
    // Mass for every layer, no values: the output error is not available.
    assert!(cal.scores().is_ok());
    let err = cal.output_errors().unwrap_err();
    assert!(
        matches!(&err, LserveError::InvalidArgument { what: "calibration", reason }
            if reason.contains("layer 0")),
        "{err}"
    );
    assert!(HeadPattern::from_calibration_by(&cal, CalibrationScore::OutputError, 0.5).is_err());
    assert!(HeadPattern::from_calibration_by(&cal, CalibrationScore::OutOfWindowMass, 0.5).is_ok());
    let before = cal.clone();
    let err = cal
        .add_layer_with_values(0, T, &q, &k, &v[..v.len() - 1])
        .unwrap_err();
    assert!(
        matches!(err, LserveError::ShapeMismatch { what: "v", .. }),
        "{err}"
    );
    let mut v2 = v.clone();
    v2[v.len() - 1] = f32::NAN;
    let err = cal.add_layer_with_values(0, T, &q, &k, &v2).unwrap_err();
    assert!(
        matches!(err, LserveError::InvalidArgument { what: "v", .. }),
        "{err}"
    );
    let err = cal.add_layer_with_values(5, T, &q, &k, &v).unwrap_err();
    assert!(
        matches!(err, LserveError::InvalidArgument { what: "layer", .. }),
        "{err}"
    );
    assert_eq!(cal, before);
    // Values for layer 0 only: still no output error for layer 1.
    cal.add_layer_with_values(0, T, &q, &k, &v).unwrap();
    let err = cal.output_errors().unwrap_err();
    assert!(format!("{err}").contains("layer 1"), "{err}");
}
