//! The synthetic long contexts of the CPU studies (`quant_study`, `page_size_study`) and how a
//! page selection over them is scored: needle recall and attention mass captured. Each example
//! uses part of it, hence the `dead_code` allowance.
//!
//! Two key models, both `D = 128` channels of one KV head, bf16-rounded:
//!
//! - [`context`]: keys independent normal, a few outlier channels (scale 8, offset +4), no
//!   positions; needles along the query (`quant_study`, `docs/QUANTIZATION.md`);
//! - [`rope_context`]: keys with per-channel means and scales, outlier channels as RoPE pairs
//!   with large means, rotated by RoPE at their positions (base 500000, Llama 3), and a query
//!   rotated at the decode position; needles planted so the post-RoPE `q · k` stands a given
//!   number of standard deviations above the background (`page_size_study`,
//!   `docs/PAGE_SIZE.md`).
#![allow(dead_code)]

use half::bf16;
use lserve::config::SparsityConfig;
use lserve::reference::kv_write::KeyStats;
use lserve::reference::select::{select_pages, SelectionParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Head dimension of every study.
pub const D: usize = 128;

/// A standard normal sample (Box-Muller).
pub fn normal(rng: &mut StdRng) -> f32 {
    let (u, v): (f64, f64) = (rng.gen_range(f64::EPSILON..1.0), rng.gen());
    ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
}

pub fn bf16_round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Keys as real models have them, roughly: normal channels, a few outlier channels with a
/// large scale and offset (`outliers` of them, 8x and +4), bf16-rounded.
pub fn keys(rng: &mut StdRng, len: usize, outliers: usize) -> Vec<f32> {
    (0..len * D)
        .map(|i| {
            let x = normal(rng);
            bf16_round(if i % D < outliers { 8.0 * x + 4.0 } else { x })
        })
        .collect()
}

/// One synthetic context: `keys` (`[len][D]`), a query, planted needle keys.
pub struct Context {
    pub keys: Vec<f32>,
    pub q: Vec<f32>,
    /// The needles' positions, in the order of their strengths.
    pub needles: Vec<usize>,
    /// Softmax weights of every token for `q` (scale `1 / sqrt(D)`).
    pub weights: Vec<f64>,
    /// The same over the background: the needles left out (weight 0), the rest renormalized.
    pub background: Vec<f64>,
}

impl Context {
    pub fn len(&self) -> usize {
        self.weights.len()
    }
}

/// `q · k` of every key (`f64`, unscaled).
fn dots(keys: &[f32], q: &[f32]) -> Vec<f64> {
    keys.chunks(D)
        .map(|k| q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum())
        .collect()
}

/// The softmax of `scale · s` over every token, and over every token but `left_out`.
fn softmax_without(s: &[f64], scale: f64, left_out: &[usize]) -> (Vec<f64>, Vec<f64>) {
    let all = softmax(s, scale);
    let mut s = s.to_vec();
    for &t in left_out {
        s[t] = f64::NEG_INFINITY;
    }
    (all, softmax(&s, scale))
}

/// The softmax of `scale · s`.
fn softmax(s: &[f64], scale: f64) -> Vec<f64> {
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (scale * (x - m)).exp()).collect();
    let total: f64 = e.iter().sum();
    e.iter().map(|x| x / total).collect()
}

/// A context of [`keys`] with 4 outlier channels, a normal query, and `needles` planted keys,
/// each `strength |q|` along `q` (the background's `q · k` has a standard deviation of about
/// `|q|`, more with the outliers), none in the newest 128 tokens.
pub fn context(seed: u64, len: usize, needles: usize, strength: f32) -> Context {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut keys = keys(&mut rng, len, 4);
    let q: Vec<f32> = (0..D).map(|_| bf16_round(normal(&mut rng))).collect();
    let norm = q.iter().map(|x| x * x).sum::<f32>().sqrt();
    let mut at: Vec<usize> = (0..needles).map(|_| rng.gen_range(0..len - 128)).collect();
    at.sort_unstable();
    for &t in &at {
        for (i, k) in keys[t * D..][..D].iter_mut().enumerate() {
            *k = bf16_round(*k + strength * q[i] / norm);
        }
    }
    let (weights, background) = softmax_without(&dots(&keys, &q), 1.0 / (D as f64).sqrt(), &at);
    Context {
        keys,
        q,
        needles: at,
        weights,
        background,
    }
}

/// Llama 3's RoPE base.
pub const ROPE_BASE: f64 = 500_000.0;

/// The keys' outlier channel pairs of [`rope_context`]: (RoPE pair `i`, the magnitude of its
/// pre-RoPE mean). Pair `i` is channels `(i, i + D / 2)` and turns by `ROPE_BASE^(-2i/D)`
/// radians per position: pair 22 by 0.011 (a turn in 570 tokens: 0.2 rad over a 16-token page,
/// 1.4 over 128), pair 40 by 2.7e-4, pairs 50 and 60 by 3.5e-5 and 4.6e-6 (constant over a
/// page). Most outliers sit in the slow pairs, as in Llama's keys.
pub const OUTLIER_PAIRS: [(usize, f32); 4] = [(22, 6.0), (40, 8.0), (50, 10.0), (60, 12.0)];

/// A small, fast generator for the long contexts (splitmix64; `StdRng` is a third of the time of
/// a 64K-token context).
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `(0, 1]`.
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.unit() * n as f64) as usize % n
    }

    /// Two independent standard normal samples (Marsaglia's polar method: no trigonometry).
    pub fn normal_pair(&mut self) -> (f32, f32) {
        loop {
            let (u, v) = (2.0 * self.unit() - 1.0, 2.0 * self.unit() - 1.0);
            let r2 = u * u + v * v;
            if r2 > 0.0 && r2 < 1.0 {
                let f = (-2.0 * r2.ln() / r2).sqrt();
                return ((u * f) as f32, (v * f) as f32);
            }
        }
    }

    /// `out` filled with standard normal samples.
    pub fn normals(&mut self, out: &mut [f32]) {
        for pair in out.chunks_mut(2) {
            let (a, b) = self.normal_pair();
            pair[0] = a;
            if let Some(x) = pair.get_mut(1) {
                *x = b;
            }
        }
    }
}

/// RoPE's angle per position of each pair `i < D / 2`: `ROPE_BASE^(-2i/D)`.
pub fn rope_frequencies() -> Vec<f64> {
    (0..D / 2)
        .map(|i| ROPE_BASE.powf(-2.0 * i as f64 / D as f64))
        .collect()
}

/// RoPE at `pos` of one head row `x` (`D` values; pairs `(i, i + D / 2)`, the "rotate half"
/// layout of Hugging Face's Llama): `(x_i, x_{i+D/2})` turns by `pos · freq[i]`
/// ([`rope_frequencies`]).
pub fn rope(x: &mut [f32], pos: usize, freq: &[f64]) {
    let half = x.len() / 2;
    for (i, &f) in freq.iter().enumerate() {
        let (s, c) = (pos as f64 * f).sin_cos();
        let (a, b) = (x[i] as f64, x[i + half] as f64);
        x[i] = (a * c - b * s) as f32;
        x[i + half] = (a * s + b * c) as f32;
    }
}

/// A context with realistic key statistics, one needle per entry of `strengths`.
///
/// - **Keys** (`len` tokens at positions `0..len`): pre-RoPE channel `c` of token `t` is
///   `mean[c] + scale[c] · n` (`n` standard normal, independent over tokens), with per-context
///   channel means `0.5 · N(0, 1)` and scale 1, except the [`OUTLIER_PAIRS`]: a mean vector of
///   their magnitude in a random direction of the pair's plane, scale a quarter of it. Then
///   RoPE at `t` ([`rope`]), then bf16.
/// - **Query**: standard normal channels, rotated at position `len` (the decode token's), bf16.
/// - **Needles**: at random positions in `[128, len - 128)`, each in its own 128-token span (so
///   no two share a page of any size studied, and none the first or newest page). Needle `j`'s
///   post-RoPE key moves along `q` until its `q · k` is `mean + strengths[j] · sd` of the
///   background's (every key before planting): post-RoPE `q · k` is what makes it strong.
///   Before RoPE that is a move along the query as seen from the needle's distance,
///   `R(len − t) q₀`.
pub fn rope_context(seed: u64, len: usize, strengths: &[f64]) -> Context {
    assert!(len >= 256 + 128 * strengths.len(), "room for the needles");
    let mut rng = SplitMix(seed ^ 0x726f_7065_0000_0000);
    let half = D / 2;
    let mut mean = vec![0f32; D];
    rng.normals(&mut mean);
    mean.iter_mut().for_each(|m| *m *= 0.5);
    let mut scale = vec![1f32; D];
    for &(i, a) in &OUTLIER_PAIRS {
        let phi = std::f64::consts::TAU * rng.unit();
        (mean[i], mean[i + half]) = (a * phi.cos() as f32, a * phi.sin() as f32);
        (scale[i], scale[i + half]) = (a / 4.0, a / 4.0);
    }
    // The rotation of each pair at position t, `(cos, sin)(t · freq[i])`, advanced by one
    // position per token (in f64: after 64K steps it is off by about 1e-11).
    let freq = rope_frequencies();
    let step: Vec<(f64, f64)> = freq.iter().map(|f| (f.cos(), f.sin())).collect();
    let mut turn: Vec<(f64, f64)> = vec![(1.0, 0.0); half];
    let mut keys = vec![0f32; len * D];
    for row in keys.chunks_mut(D) {
        rng.normals(row);
        for (c, x) in row.iter_mut().enumerate() {
            *x = mean[c] + scale[c] * *x;
        }
        for (i, (cs, &(dc, ds))) in turn.iter_mut().zip(&step).enumerate() {
            let (c, s) = *cs;
            let (a, b) = (row[i] as f64, row[i + half] as f64);
            row[i] = bf16_round((a * c - b * s) as f32);
            row[i + half] = bf16_round((a * s + b * c) as f32);
            *cs = (c * dc - s * ds, c * ds + s * dc);
        }
    }
    let mut q = vec![0f32; D];
    rng.normals(&mut q);
    rope(&mut q, len, &freq);
    let q: Vec<f32> = q.into_iter().map(bf16_round).collect();
    let q2: f64 = q.iter().map(|&x| x as f64 * x as f64).sum();

    let mut s = dots(&keys, &q);
    let n = len as f64;
    let m = s.iter().sum::<f64>() / n;
    let sd = (s.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0)).sqrt();
    let spans = (len - 256) / 128;
    let mut taken: Vec<usize> = Vec::with_capacity(strengths.len());
    let mut needles = Vec::with_capacity(strengths.len());
    for &z in strengths {
        let span = loop {
            let span = rng.below(spans);
            if !taken.contains(&span) {
                break span;
            }
        };
        taken.push(span);
        let t = 128 * (span + 1) + rng.below(128);
        let beta = (m + z * sd - s[t]) / q2;
        let k = &mut keys[t * D..][..D];
        for (x, &qi) in k.iter_mut().zip(&q) {
            *x = bf16_round((*x as f64 + beta * qi as f64) as f32);
        }
        s[t] = q
            .iter()
            .zip(k.iter())
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum();
        needles.push(t);
    }
    let (weights, background) = softmax_without(&s, 1.0 / (D as f64).sqrt(), &needles);
    Context {
        keys,
        q,
        needles,
        weights,
        background,
    }
}

/// The parameters the library's selection runs with for `config` (what
/// `reference::select::select_from_cache` builds), and the tokens of its unit.
pub fn selection_params(config: &SparsityConfig) -> (SelectionParams, usize) {
    (
        SelectionParams {
            logical_per_page: config.logical_per_unit(),
            top_k: config.pages_per_selection(),
            always_include_first: config.always_include_first_page,
            aggregation: config.gqa_aggregation,
        },
        config.unit_tokens(),
    )
}

/// What one selection captured of a context.
pub struct Captured {
    /// Per needle (in [`Context::needles`]' order), whether its unit was selected.
    pub needles: Vec<bool>,
    /// The softmax weight of the tokens of the selected units (exact, over every token).
    pub mass: f64,
    /// The same of the background's softmax ([`Context::background`]).
    pub background_mass: f64,
}

/// Selects units of `unit_tokens` tokens from `stats` with `params` (one query head:
/// `reference::select::select_pages`) and scores the selection on `c`.
pub fn capture(
    c: &Context,
    stats: &KeyStats,
    params: &SelectionParams,
    unit_tokens: usize,
) -> Captured {
    let selection = select_pages(&c.q, stats, params).expect("selection");
    let units = c.len().div_ceil(unit_tokens);
    let mut chosen = vec![false; units];
    for &u in &selection.pages {
        chosen[u as usize] = true;
    }
    let sum = |w: &[f64]| -> f64 {
        (0..units)
            .filter(|&u| chosen[u])
            .map(|u| {
                w[u * unit_tokens..(u * unit_tokens + unit_tokens).min(w.len())]
                    .iter()
                    .sum::<f64>()
            })
            .sum()
    };
    Captured {
        needles: c.needles.iter().map(|&t| chosen[t / unit_tokens]).collect(),
        mass: sum(&c.weights),
        background_mass: sum(&c.background),
    }
}
