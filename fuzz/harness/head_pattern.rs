//! The DuoAttention head-gating parser and every way of building a [`HeadPattern`]: gating text
//! (arbitrary bytes, and mutations of the published files), gating values, explicit kinds, the
//! interleaved default, published names. A pattern that is built is checked against its rules:
//! the streaming count, the ranking by `(alpha, layer, kv_head)`, the compact indices.

use arbitrary::{Arbitrary, Unstructured};
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{parse_gating_tsv, HeadKind, HeadPattern, PublishedGating};
use lserve::LserveError;

#[derive(Arbitrary, Debug)]
struct Input {
    /// Geometry: layers 1..=8, KV heads 1..=8, group 1..=8, head dim 64 or 128.
    layers: u8,
    kv_heads: u8,
    group: u8,
    wide: bool,
    fraction: Fraction,
    source: Source,
}

#[derive(Arbitrary, Debug)]
enum Fraction {
    /// `k / 256`, in `[0, 1)`.
    Eighths(u8),
    One,
    Raw(f64),
}

#[derive(Arbitrary, Debug)]
enum Source {
    /// Gating text from raw bytes (UTF-8 checked, and lossily converted).
    Bytes(Vec<u8>),
    /// Gating text assembled from fields: numbers, separators and junk.
    Fields(Vec<Vec<Field>>),
    /// A published file with edits at given byte offsets.
    Published {
        which: u8,
        edits: Vec<(u16, u8)>,
        truncate: Option<u16>,
    },
    /// Gating values directly.
    Values(Vec<Vec<f64>>),
    /// Explicit kinds.
    Kinds(Vec<Vec<bool>>),
    /// A published model by (perhaps mangled) name.
    Name(String),
    /// The synthetic default.
    Interleaved,
}

#[derive(Arbitrary, Debug)]
enum Field {
    Number(f64),
    Int(i32),
    Text(String),
    Padded(f32),
}

impl Fraction {
    fn get(&self) -> f64 {
        match *self {
            Fraction::Eighths(k) => k as f64 / 256.0,
            Fraction::One => 1.0,
            Fraction::Raw(x) => x,
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
        [8, 8, 8],
    );
    let fraction = input.fraction.get();
    let fraction_ok = (0.0..=1.0).contains(&fraction);
    match input.source {
        Source::Bytes(bytes) => {
            if let Ok(text) = std::str::from_utf8(&bytes) {
                check_text(text, g, fraction);
            }
            check_text(&String::from_utf8_lossy(&bytes), g, fraction);
        }
        Source::Fields(rows) => {
            let text: String = rows
                .iter()
                .map(|row| {
                    let fields: Vec<String> = row
                        .iter()
                        .map(|f| match f {
                            Field::Number(x) => format!("{x}"),
                            Field::Int(i) => format!("{i}"),
                            Field::Text(s) => s.clone(),
                            Field::Padded(x) => format!("  {x:e} "),
                        })
                        .collect();
                    fields.join("\t") + "\n"
                })
                .collect();
            check_text(&text, g, fraction);
        }
        Source::Published {
            which,
            edits,
            truncate,
        } => {
            let p = &PublishedGating::ALL[which as usize % PublishedGating::ALL.len()];
            let mut bytes = p.tsv.as_bytes().to_vec();
            for (at, b) in edits.into_iter().take(16) {
                let at = at as usize % bytes.len();
                bytes[at] = b;
            }
            if let Some(n) = truncate {
                bytes.truncate(n as usize % (bytes.len() + 1));
            }
            if let Ok(text) = std::str::from_utf8(&bytes) {
                check_text(text, p.geometry, fraction);
                check_text(text, g, fraction);
            }
        }
        Source::Values(values) => {
            let values: Vec<Vec<f64>> = values
                .into_iter()
                .take(16)
                .map(|r| r.into_iter().take(16).collect())
                .collect();
            check_values(&values, g, fraction);
        }
        Source::Kinds(bits) => {
            let kinds: Vec<Vec<HeadKind>> = bits
                .into_iter()
                .take(16)
                .map(|r| r.into_iter().take(16).map(kind).collect())
                .collect();
            let shape_ok =
                kinds.len() == g.layers() && kinds.iter().all(|r| r.len() == g.kv_heads());
            match HeadPattern::from_kinds(g, kinds.clone()) {
                Ok(p) => {
                    assert!(shape_ok);
                    check_pattern(&p, g);
                    for (layer, row) in kinds.iter().enumerate() {
                        assert_eq!(p.layer_kinds(layer), &row[..]);
                    }
                }
                Err(LserveError::HeadPattern(_)) => assert!(!shape_ok),
                Err(e) => panic!("from_kinds: unexpected {e:?}"),
            }
        }
        Source::Name(name) => match HeadPattern::published(&name, fraction) {
            Ok(p) => {
                assert!(fraction_ok);
                let published = PublishedGating::find(&name).expect("a known name");
                assert_eq!(*p.geometry(), published.geometry);
                check_pattern(&p, published.geometry);
            }
            Err(LserveError::HeadPattern(_)) => {
                assert!(PublishedGating::find(&name).is_err())
            }
            Err(LserveError::InvalidConfig {
                field: "streaming_fraction",
                ..
            }) => assert!(!fraction_ok),
            Err(e) => panic!("published: unexpected {e:?}"),
        },
        Source::Interleaved => match HeadPattern::interleaved(g, fraction) {
            Ok(p) => {
                assert!(fraction_ok);
                check_pattern(&p, g);
                assert_eq!(p.total_streaming_heads(), expected_count(g, fraction));
            }
            Err(LserveError::InvalidConfig {
                field: "streaming_fraction",
                ..
            }) => assert!(!fraction_ok),
            Err(e) => panic!("interleaved: unexpected {e:?}"),
        },
    }
}

fn kind(streaming: bool) -> HeadKind {
    if streaming {
        HeadKind::Streaming
    } else {
        HeadKind::Dense
    }
}

/// `round(fraction * total)`, half away from zero.
fn expected_count(g: ModelGeometry, fraction: f64) -> usize {
    (fraction * g.total_kv_heads() as f64).round() as usize
}

/// Parses `text` by the documented rules (blank lines skipped, tab-separated fields, each
/// trimmed and parsed as `f64`); `None` where a field does not parse.
fn model_parse(text: &str) -> Option<Vec<Vec<f64>>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.split('\t')
                .map(|f| f.trim().parse::<f64>().ok())
                .collect()
        })
        .collect()
}

fn check_text(text: &str, g: ModelGeometry, fraction: f64) {
    let parsed = parse_gating_tsv(text);
    match (&parsed, model_parse(text)) {
        (Ok(rows), Some(model)) => assert!(same_values(rows, &model), "parse disagrees"),
        (Err(LserveError::HeadPattern(_)), None) => {}
        (r, m) => panic!("parse_gating_tsv: {r:?}, model {m:?}"),
    }
    let from_text = HeadPattern::from_gating_tsv(text, g, fraction);
    match parsed {
        Ok(values) => {
            let from_values = HeadPattern::from_gating_values(&values, g, fraction);
            match (from_text, from_values) {
                (Ok(a), Ok(b)) => assert_eq!(a, b),
                (Err(a), Err(b)) => assert_eq!(format!("{a}"), format!("{b}")),
                (a, b) => panic!("text {a:?} and values {b:?} disagree"),
            }
            check_values(&values, g, fraction);
        }
        Err(_) => assert!(from_text.is_err()),
    }
}

/// Equal as numbers, NaN equal to NaN.
fn same_values(a: &[Vec<f64>], b: &[Vec<f64>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()))
        })
}

pub(super) fn check_values(values: &[Vec<f64>], g: ModelGeometry, fraction: f64) {
    let fraction_ok = (0.0..=1.0).contains(&fraction);
    let shape_ok = values.len() == g.layers() && values.iter().all(|r| r.len() == g.kv_heads());
    let finite = values.iter().flatten().all(|a| a.is_finite());
    match HeadPattern::from_gating_values(values, g, fraction) {
        Ok(p) => {
            assert!(fraction_ok && shape_ok && finite);
            check_pattern(&p, g);
            let n = expected_count(g, fraction);
            assert_eq!(p.total_streaming_heads(), n);
            // The n lowest by (alpha, layer, head) are streaming.
            let mut ranked: Vec<(f64, usize, usize)> = values
                .iter()
                .enumerate()
                .flat_map(|(l, r)| r.iter().enumerate().map(move |(h, &a)| (a, l, h)))
                .collect();
            ranked.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
            for (i, &(_, l, h)) in ranked.iter().enumerate() {
                let want = kind(i < n);
                assert_eq!(p.kind(l, h), want, "layer {l} head {h} rank {i} of {n}");
            }
        }
        Err(LserveError::InvalidConfig {
            field: "streaming_fraction",
            ..
        }) => assert!(!fraction_ok),
        Err(LserveError::HeadPattern(_)) => assert!(fraction_ok && !(shape_ok && finite)),
        Err(e) => panic!("from_gating_values: unexpected {e:?}"),
    }
}

/// The pattern's own rules: per layer, dense and streaming heads partition the KV heads in
/// ascending order, compact indices are ranks within the kind, and the query-head view follows
/// the KV head.
fn check_pattern(p: &HeadPattern, g: ModelGeometry) {
    assert_eq!(*p.geometry(), g);
    let mut total_streaming = 0;
    let (mut max_d, mut max_s) = (0, 0);
    for layer in 0..g.layers() {
        let kinds = p.layer_kinds(layer);
        assert_eq!(kinds.len(), g.kv_heads());
        let dense: Vec<usize> = (0..g.kv_heads())
            .filter(|&h| kinds[h] == HeadKind::Dense)
            .collect();
        let streaming: Vec<usize> = (0..g.kv_heads())
            .filter(|&h| kinds[h] == HeadKind::Streaming)
            .collect();
        assert_eq!(p.dense_kv_heads(layer), &dense[..]);
        assert_eq!(p.streaming_kv_heads(layer), &streaming[..]);
        assert_eq!(p.dense_heads(layer), dense.len());
        assert_eq!(p.streaming_heads(layer), streaming.len());
        for (i, &h) in dense.iter().enumerate() {
            assert_eq!(p.dense_index(layer, h), Some(i));
            assert_eq!(p.streaming_index(layer, h), None);
            assert_eq!(p.compact_index(layer, h), i);
            assert_eq!(p.dense_kv_head(layer, i), h);
        }
        for (i, &h) in streaming.iter().enumerate() {
            assert_eq!(p.streaming_index(layer, h), Some(i));
            assert_eq!(p.dense_index(layer, h), None);
            assert_eq!(p.compact_index(layer, h), i);
            assert_eq!(p.streaming_kv_head(layer, i), h);
        }
        for qh in 0..g.q_heads() {
            assert_eq!(p.kind_of_q_head(layer, qh), kinds[qh / g.group()]);
        }
        total_streaming += streaming.len();
        max_d = max_d.max(dense.len());
        max_s = max_s.max(streaming.len());
    }
    assert_eq!(p.total_streaming_heads(), total_streaming);
    assert_eq!(p.max_dense_heads(), max_d);
    assert_eq!(p.max_streaming_heads(), max_s);
    let f = p.streaming_fraction();
    assert_eq!(f, total_streaming as f64 / g.total_kv_heads() as f64);
}
