//! The head-pattern calibration accumulator ([`Calibration`]) and the patterns made from it
//! ([`HeadPattern::from_calibration_by`]) under arbitrary geometries, Λ masks, strides and calls:
//! activations of the right and wrong lengths, with NaN, infinite and huge elements, layers past
//! the geometry. Checked against the documented rules: a call errs exactly when its layer,
//! lengths or elements are bad, and then leaves the accumulator equal to its copy from before;
//! a call that succeeds samples `ceil((tokens - sinks - local) / stride)` positions; the masses
//! lie in `[0, 1]` and the output errors are finite and non-negative; the pattern is the one the
//! scores make as gating values (`head_pattern::check_values`: `round(s × heads)` streaming heads,
//! the lowest-scored ones).

use arbitrary::{Arbitrary, Unstructured};
use lserve::config::SparsityConfig;
use lserve::head_pattern::{Calibration, CalibrationScore, HeadPattern};
use lserve::LserveError;

use super::head_pattern::check_values;

#[derive(Arbitrary, Debug)]
struct Input {
    /// Geometry: layers 1..=3, KV heads 1..=4, group 1..=2, head dim 64 or 128.
    layers: u8,
    kv_heads: u8,
    group: u8,
    wide: bool,
    /// The Λ mask: sinks 0..=7, local 0..=7 (0 is refused by the config's validation).
    sinks: u8,
    local: u8,
    /// 0 is refused by `with_stride`.
    stride: u8,
    calls: Vec<Call>,
    /// `k / 255`, or past 1 when `k` is 255 and `beyond` is set.
    fraction: u8,
    beyond: bool,
    by_error: bool,
}

#[derive(Arbitrary, Debug)]
struct Call {
    /// Layer `layer % (layers + 1)`: one past the last is refused.
    layer: u8,
    /// Tokens 0..=24.
    tokens: u8,
    with_values: bool,
    /// Elements removed from the end of `q`, `k`, `v` (0 leaves the length right).
    trim: [u8; 3],
    fill: Fill,
}

#[derive(Arbitrary, Debug)]
enum Fill {
    /// SplitMix64 values in `[-4, 4)`.
    Seeded(u64),
    /// Seeded, times a large power of two (the logits far apart, softmax underflow).
    Scaled(u64, u8),
    /// One value everywhere (possibly NaN, infinite or huge).
    Constant(f32),
    /// Seeded with one element replaced.
    Poisoned { seed: u64, at: u16, value: f32 },
}

/// SplitMix64's output for `x`.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Fill {
    fn make(&self, salt: u64, len: usize) -> Vec<f32> {
        let seeded = |seed: u64| -> Vec<f32> {
            (0..len as u64)
                .map(|i| {
                    let r = splitmix(seed ^ salt.rotate_left(17) ^ i.wrapping_mul(0x2545_F491));
                    (r >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
                })
                .collect()
        };
        match *self {
            Fill::Seeded(seed) => seeded(seed),
            Fill::Scaled(seed, e) => {
                let s = 2f32.powi(i32::from(e % 64));
                seeded(seed).into_iter().map(|x| x * s).collect()
            }
            Fill::Constant(x) => vec![x; len],
            Fill::Poisoned { seed, at, value } => {
                let mut v = seeded(seed);
                if !v.is_empty() {
                    let i = at as usize % v.len();
                    v[i] = value;
                }
                v
            }
        }
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let u = Unstructured::new(data);
    let Ok(input) = Input::arbitrary_take_rest(u) else {
        return;
    };
    let g = super::small_geometry(
        [input.layers, input.kv_heads, input.group],
        input.wide,
        [3, 4, 2],
    );
    let (layers, kv, hq, d) = (g.layers(), g.kv_heads(), g.q_heads(), g.head_dim());
    let config = SparsityConfig {
        sink_tokens: input.sinks as usize % 8,
        local_tokens: input.local as usize % 8,
        ..SparsityConfig::default()
    };
    let cal = match (Calibration::new(g, &config), config.validate()) {
        (Ok(cal), Ok(())) => cal,
        (Err(a), Err(b)) => {
            assert_eq!(format!("{a}"), format!("{b}"));
            return;
        }
        (a, b) => panic!("Calibration::new {a:?} against validate {b:?}"),
    };
    let mut cal = match cal.with_stride(input.stride as usize) {
        Ok(c) => {
            assert!(input.stride > 0);
            assert_eq!(c.stride(), input.stride as usize);
            c
        }
        Err(LserveError::InvalidArgument { what: "stride", .. }) => {
            assert_eq!(input.stride, 0);
            return;
        }
        Err(e) => panic!("with_stride: unexpected {e:?}"),
    };
    let window = config.sink_tokens + config.local_tokens;
    let stride = input.stride as usize;
    let mut value_positions = vec![0u64; layers];

    for (i, call) in input.calls.iter().take(3).enumerate() {
        let layer = call.layer as usize % (layers + 1);
        let tokens = call.tokens as usize % 25;
        let lens = [tokens * hq * d, tokens * kv * d, tokens * kv * d];
        let bufs: Vec<Vec<f32>> = lens
            .iter()
            .zip(call.trim)
            .enumerate()
            .map(|(b, (&len, trim))| {
                call.fill
                    .make((i * 3 + b) as u64, len.saturating_sub(trim as usize % 3))
            })
            .collect();
        let (q, k, v) = (&bufs[0], &bufs[1], &bufs[2]);
        let used = if call.with_values { 3 } else { 2 };
        let valid = layer < layers
            && bufs[..used].iter().zip(lens).all(|(b, len)| b.len() == len)
            && bufs[..used].iter().flatten().all(|x| x.is_finite());
        let before = cal.clone();
        let result = if call.with_values {
            cal.add_layer_with_values(layer, tokens, q, k, v)
        } else {
            cal.add_layer(layer, tokens, q, k)
        };
        match result {
            Ok(n) => {
                assert!(valid, "accepted a bad call: {call:?}");
                let want = tokens.saturating_sub(window).div_ceil(stride);
                assert_eq!(n, want, "positions sampled");
                assert_eq!(cal.positions()[layer], before.positions()[layer] + n as u64);
                if call.with_values {
                    value_positions[layer] += n as u64;
                }
            }
            Err(LserveError::InvalidArgument { .. } | LserveError::ShapeMismatch { .. }) => {
                assert!(!valid, "refused a good call: {call:?}");
                assert_eq!(cal, before, "a refused call changed the accumulator");
            }
            Err(e) => panic!("add_layer: unexpected {e:?}"),
        }
    }

    let all_sampled = cal.positions().iter().all(|&n| n > 0);
    let masses = cal.scores();
    match &masses {
        Ok(m) => {
            assert!(all_sampled);
            for &x in m.iter().flatten() {
                assert!((0.0..=1.0 + 1e-9).contains(&x), "mass {x}");
            }
        }
        Err(LserveError::InvalidArgument {
            what: "calibration",
            ..
        }) => assert!(!all_sampled),
        Err(e) => panic!("scores: unexpected {e:?}"),
    }
    let all_valued = value_positions.iter().all(|&n| n > 0);
    let errors = cal.output_errors();
    match &errors {
        Ok(e) => {
            assert!(all_valued);
            for &x in e.iter().flatten() {
                assert!(x.is_finite() && x >= 0.0, "output error {x}");
            }
        }
        Err(LserveError::InvalidArgument {
            what: "calibration",
            ..
        }) => assert!(!all_valued),
        Err(e) => panic!("output_errors: unexpected {e:?}"),
    }

    let fraction = if input.beyond && input.fraction == 255 {
        1.5
    } else {
        f64::from(input.fraction) / 255.0
    };
    let (score, ranking) = if input.by_error {
        (CalibrationScore::OutputError, errors)
    } else {
        (CalibrationScore::OutOfWindowMass, masses)
    };
    // The pattern is the one the scores make as gating values, which the gating harness checks
    // (the count, the ranking, the error of a bad fraction); a score that errs is the error.
    let pattern = HeadPattern::from_calibration_by(&cal, score, fraction);
    match ranking {
        Ok(values) => {
            check_values(&values, g, fraction);
            match (
                pattern,
                HeadPattern::from_gating_values(&values, g, fraction),
            ) {
                (Ok(a), Ok(b)) => assert_eq!(a, b),
                (Err(a), Err(b)) => assert_eq!(format!("{a}"), format!("{b}")),
                (a, b) => panic!("from_calibration_by {a:?} against the scores' pattern {b:?}"),
            }
        }
        Err(e) => match pattern {
            Err(LserveError::InvalidConfig {
                field: "streaming_fraction",
                ..
            }) => assert!(fraction > 1.0),
            Err(p) => {
                assert!(fraction <= 1.0);
                assert_eq!(format!("{p}"), format!("{e}"));
            }
            Ok(p) => panic!("a pattern {p:?} from scores that err: {e:?}"),
        },
    }
}
