//! Head patterns: DuoAttention gating files thresholded at several fractions, explicit kinds,
//! the synthetic default, and geometry mismatches.

use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{parse_gating_tsv, HeadKind, HeadPattern, PublishedGating};
use lserve::LserveError;

/// The gating files as the repository ships them (the crate embeds the same files).
const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/host/data/duo-attention");

fn gating_path(model: &str) -> String {
    format!("{DATA}/{model}/full_attention_heads.tsv")
}

type GeometryPreset = fn() -> ModelGeometry;

const MODELS: [(&str, GeometryPreset); 2] = [
    (
        "Llama-3-8B-Instruct-Gradient-1048k",
        ModelGeometry::llama3_8b,
    ),
    ("Llama-2-7B-32K-Instruct", ModelGeometry::llama2_7b),
];

/// Checks the invariants of a thresholded pattern against the raw gating values.
#[allow(clippy::needless_range_loop)]
fn check_threshold(p: &HeadPattern, alpha: &[Vec<f64>], fraction: f64) {
    let g = *p.geometry();
    let total = g.total_kv_heads();
    let expected = (fraction * total as f64).round() as usize;
    assert_eq!(p.total_streaming_heads(), expected, "fraction {fraction}");
    assert!((p.streaming_fraction() - expected as f64 / total as f64).abs() < 1e-12);
    let (mut max_streaming, mut min_dense) = (f64::NEG_INFINITY, f64::INFINITY);
    for layer in 0..g.layers() {
        assert_eq!(
            p.dense_heads(layer) + p.streaming_heads(layer),
            g.kv_heads()
        );
        for head in 0..g.kv_heads() {
            let a = alpha[layer][head];
            match p.kind(layer, head) {
                HeadKind::Streaming => max_streaming = max_streaming.max(a),
                HeadKind::Dense => min_dense = min_dense.min(a),
            }
        }
    }
    assert!(
        max_streaming <= min_dense,
        "streaming alpha {max_streaming} > dense alpha {min_dense}"
    );
}

#[test]
fn duo_attention_files_threshold_at_several_fractions() {
    for (model, geometry) in MODELS {
        let g = geometry();
        let text = std::fs::read_to_string(gating_path(model)).unwrap();
        let alpha = parse_gating_tsv(&text).unwrap();
        assert_eq!(alpha.len(), g.layers());
        assert!(alpha.iter().all(|row| row.len() == g.kv_heads()));
        let mut previous: Option<HeadPattern> = None;
        for fraction in [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0] {
            let p = HeadPattern::from_gating_file(gating_path(model), g, fraction).unwrap();
            assert_eq!(p, HeadPattern::from_gating_tsv(&text, g, fraction).unwrap());
            check_threshold(&p, &alpha, fraction);
            // Monotone: a head streaming at a lower fraction stays streaming at a higher one.
            if let Some(prev) = &previous {
                for layer in 0..g.layers() {
                    for head in 0..g.kv_heads() {
                        if prev.kind(layer, head) == HeadKind::Streaming {
                            assert_eq!(p.kind(layer, head), HeadKind::Streaming);
                        }
                    }
                }
            }
            previous = Some(p);
        }
    }
}

#[test]
fn fraction_extremes() {
    let g = ModelGeometry::llama3_8b();
    let text = std::fs::read_to_string(gating_path(MODELS[0].0)).unwrap();
    let none = HeadPattern::from_gating_tsv(&text, g, 0.0).unwrap();
    assert_eq!(none, HeadPattern::all_dense(g));
    let all = HeadPattern::from_gating_tsv(&text, g, 1.0).unwrap();
    assert!((0..32).all(|l| all.dense_heads(l) == 0 && all.streaming_heads(l) == 8));
    assert_eq!(all.max_dense_heads(), 0);
}

#[test]
fn compact_indices_are_inverse() {
    let g = ModelGeometry::llama2_7b();
    let p = HeadPattern::from_gating_file(gating_path(MODELS[1].0), g, 0.5).unwrap();
    for layer in 0..g.layers() {
        let (mut d, mut s) = (0, 0);
        for head in 0..g.kv_heads() {
            match p.kind(layer, head) {
                HeadKind::Dense => {
                    assert_eq!(p.dense_index(layer, head), Some(d));
                    assert_eq!(p.streaming_index(layer, head), None);
                    assert_eq!(p.dense_kv_head(layer, d), head);
                    d += 1;
                }
                HeadKind::Streaming => {
                    assert_eq!(p.streaming_index(layer, head), Some(s));
                    assert_eq!(p.dense_index(layer, head), None);
                    assert_eq!(p.streaming_kv_head(layer, s), head);
                    s += 1;
                }
            }
            assert_eq!(
                p.compact_index(layer, head),
                if p.kind(layer, head) == HeadKind::Dense {
                    d - 1
                } else {
                    s - 1
                }
            );
        }
        assert_eq!((d, s), (p.dense_heads(layer), p.streaming_heads(layer)));
        assert_eq!(p.dense_kv_heads(layer).len(), d);
        assert!(p.max_dense_heads() >= d && p.max_streaming_heads() >= s);
    }
    for q in 0..g.q_heads() {
        assert_eq!(p.kind_of_q_head(3, q), p.kind(3, q));
    }
}

#[test]
fn ties_break_by_layer_then_head() {
    let g = ModelGeometry::new(2, 3, 3, 64).unwrap();
    let tsv = "0.5\t0.2\t0.5\n0.5\t0.9\t0.5\n";
    let p = HeadPattern::from_gating_tsv(tsv, g, 0.5).unwrap(); // round(3.0) = 3 streaming
    let kinds: Vec<Vec<HeadKind>> = (0..2).map(|l| p.layer_kinds(l).to_vec()).collect();
    use HeadKind::{Dense as D, Streaming as S};
    // 0.2 first, then the 0.5s in (layer, head) order: (0,0), (0,2); (1,0) and (1,2) stay dense.
    assert_eq!(kinds, vec![vec![S, S, S], vec![D, D, D]]);
}

#[test]
fn geometry_mismatch_and_bad_input_are_errors() {
    let l3 = ModelGeometry::llama3_8b();
    let l2 = ModelGeometry::llama2_7b();
    let t3 = std::fs::read_to_string(gating_path(MODELS[0].0)).unwrap();
    let t2 = std::fs::read_to_string(gating_path(MODELS[1].0)).unwrap();
    for (text, g) in [(&t3, l2), (&t2, l3)] {
        assert!(matches!(
            HeadPattern::from_gating_tsv(text, g, 0.5),
            Err(LserveError::HeadPattern(_))
        ));
    }
    let fewer_layers = ModelGeometry::new(16, 32, 8, 128).unwrap();
    assert!(matches!(
        HeadPattern::from_gating_tsv(&t3, fewer_layers, 0.5),
        Err(LserveError::HeadPattern(_))
    ));
    for f in [-0.1, 1.5, f64::NAN] {
        assert!(matches!(
            HeadPattern::from_gating_tsv(&t3, l3, f),
            Err(LserveError::InvalidConfig {
                field: "streaming_fraction",
                ..
            })
        ));
    }
    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    for bad in [
        "0.1\tabc\n",
        "0.1\t\t0.2\n",
        "0.1\tnan\n",
        "0.1\n",
        "0.1\t0.2\t0.3\n",
        "",
    ] {
        assert!(
            matches!(
                HeadPattern::from_gating_tsv(bad, g, 0.5),
                Err(LserveError::HeadPattern(_))
            ),
            "{bad:?}"
        );
    }
    assert!(HeadPattern::from_gating_tsv("0.1\t0.2\r\n\n", g, 0.5).is_ok());
    assert!(matches!(
        HeadPattern::from_gating_file(
            format!("{DATA}/no-such-model/full_attention_heads.tsv"),
            g,
            0.5
        ),
        Err(LserveError::Io { .. })
    ));
    assert!(matches!(
        HeadPattern::from_kinds(g, vec![vec![HeadKind::Dense; 3]]),
        Err(LserveError::HeadPattern(_))
    ));
    assert!(matches!(
        HeadPattern::from_kinds(g, vec![]),
        Err(LserveError::HeadPattern(_))
    ));
}

#[test]
fn random_gating_values_threshold_correctly() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for _ in 0..200 {
        let kv = [1, 2, 4, 8][rng.gen_range(0..4)];
        let g = ModelGeometry::new(rng.gen_range(1..6), kv * rng.gen_range(1..4), kv, 64).unwrap();
        // Few distinct values, so ties are common.
        let alpha: Vec<Vec<f64>> = (0..g.layers())
            .map(|_| {
                (0..kv)
                    .map(|_| rng.gen_range(0..5) as f64 * 0.25 - 0.1)
                    .collect()
            })
            .collect();
        let tsv: String = alpha
            .iter()
            .map(|r| {
                r.iter()
                    .map(|a| format!("{a:e}"))
                    .collect::<Vec<_>>()
                    .join("\t")
                    + "\n"
            })
            .collect();
        let fraction: f64 = rng.gen();
        let p = HeadPattern::from_gating_tsv(&tsv, g, fraction).unwrap();
        check_threshold(&p, &alpha, fraction);
        // Ties: among equal alphas, streaming ones come first in (layer, head) order.
        let order = |l: usize, h: usize| (l, h);
        for (l1, h1) in (0..g.layers()).flat_map(|l| (0..kv).map(move |h| (l, h))) {
            for (l2, h2) in (0..g.layers()).flat_map(|l| (0..kv).map(move |h| (l, h))) {
                if alpha[l1][h1] == alpha[l2][h2]
                    && order(l1, h1) < order(l2, h2)
                    && p.kind(l2, h2) == HeadKind::Streaming
                {
                    assert_eq!(p.kind(l1, h1), HeadKind::Streaming);
                }
            }
        }
    }
}

#[test]
fn interleaved_spreads_streaming_heads_evenly() {
    let g = ModelGeometry::llama3_8b();
    let p = HeadPattern::interleaved(g, 0.5).unwrap();
    for layer in 0..32 {
        for head in 0..8 {
            let expect = if head % 2 == 1 {
                HeadKind::Streaming
            } else {
                HeadKind::Dense
            };
            assert_eq!(p.kind(layer, head), expect);
        }
    }
    for fraction in [0.0, 0.1, 0.3, 0.5, 0.77, 1.0] {
        for g in [
            ModelGeometry::llama3_8b(),
            ModelGeometry::llama2_7b(),
            ModelGeometry::new(3, 6, 3, 64).unwrap(),
        ] {
            let p = HeadPattern::interleaved(g, fraction).unwrap();
            let n = (fraction * g.total_kv_heads() as f64).round() as usize;
            assert_eq!(p.total_streaming_heads(), n);
            // Even spread: any window of w consecutive heads holds floor or ceil of w * n / total.
            let flat: Vec<bool> = (0..g.layers())
                .flat_map(|l| (0..g.kv_heads()).map(move |h| (l, h)))
                .map(|(l, h)| p.kind(l, h) == HeadKind::Streaming)
                .collect();
            let total = flat.len();
            for w in [1, 2, 5, g.kv_heads()] {
                for start in 0..=total - w {
                    let c = flat[start..start + w].iter().filter(|&&s| s).count() as f64;
                    let ideal = w as f64 * n as f64 / total as f64;
                    assert!(
                        (c - ideal).abs() < 1.0 + 1e-9,
                        "window {start}+{w}: {c} vs {ideal}"
                    );
                }
            }
            assert_eq!(p, HeadPattern::interleaved(g, fraction).unwrap()); // deterministic
        }
    }
}

#[test]
fn published_patterns_are_the_shipped_files() {
    assert_eq!(PublishedGating::ALL.len(), MODELS.len());
    for (model, geometry) in MODELS {
        let g = geometry();
        let published = PublishedGating::find(model).unwrap();
        assert_eq!(published.geometry, g);
        let text = std::fs::read_to_string(gating_path(model)).unwrap();
        assert_eq!(published.tsv, text);
        assert_eq!(
            published.values().unwrap(),
            parse_gating_tsv(&text).unwrap()
        );
        for fraction in [0.0, 0.25, 0.5, 1.0] {
            assert_eq!(
                HeadPattern::published(model, fraction).unwrap(),
                HeadPattern::from_gating_file(gating_path(model), g, fraction).unwrap()
            );
        }
    }
    assert!(matches!(
        HeadPattern::published("Llama-3-8B", 0.5),
        Err(LserveError::HeadPattern(_))
    ));
    assert!(matches!(
        HeadPattern::published(MODELS[0].0, 1.5),
        Err(LserveError::InvalidConfig { .. })
    ));
}
