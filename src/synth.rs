//! Synthetic activations of a Llama-3-8B-geometry model (no weights).
//!
//! Generating 128K tokens x 32 layers of Q/K/V on the host is too slow for the main job, so:
//! - **keys** are generated on the host with the structure page selection sees (Gaussian-like
//!   noise, a few outlier channels per head with large magnitudes, RoPE at each token's
//!   position, base 500000 as Llama 3) for [`KEY_LAYERS`] distinct layers, which the model's
//!   layers cycle through (layer `l` takes `l % KEY_LAYERS`);
//! - **prefill queries and values** are filled on the device by `gpu::fill_random` (uniform in
//!   `[-1, 1)`, reproducible on the host by `gpu::random_fill_value`): prefill attention's cost
//!   does not depend on them, and the reference check recomputes them;
//! - **decode queries, keys and values** are host-generated with the same structure (queries
//!   lean on the keys' outlier channels, RoPE at the new token's position), [`DECODE_SETS`]
//!   distinct sets that the steps and layers cycle through.

use half::bf16;

/// Distinct key layers the model cycles through.
pub const KEY_LAYERS: usize = 2;
/// Distinct decode input sets the steps cycle through.
pub const DECODE_SETS: usize = 4;
/// Outlier channels per head (of each half of the RoPE pairs).
const OUTLIERS: usize = 3;

/// A small, fast generator (splitmix64).
pub struct SplitMix(pub u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    /// Roughly normal (sum of three uniforms), unit variance.
    pub fn normal(&mut self) -> f32 {
        self.uniform() + self.uniform() + self.uniform()
    }
}

/// The outlier channels of KV head `h` (below `d / 2`; their RoPE partners are `+ d / 2`).
fn outliers(h: usize, d: usize) -> [usize; OUTLIERS] {
    [
        (7 * h + 3) % (d / 2),
        (11 * h + 17) % (d / 2),
        (5 * h + 29) % (d / 2),
    ]
}

/// The RoPE rotation `(cos, sin)` of each pair `(i, i + d / 2)` at position `pos`.
fn rotation(pos: usize, d: usize) -> Vec<(f64, f64)> {
    (0..d / 2)
        .map(|i| {
            let theta = pos as f64 * 500_000f64.powf(-2.0 * i as f64 / d as f64);
            let (s, c) = theta.sin_cos();
            (c, s)
        })
        .collect()
}

/// RoPE of one head row `x` (`d` values, pairs `(i, i + d / 2)`) by `rot` ([`rotation`]).
fn rope(x: &mut [f32], rot: &[(f64, f64)]) {
    let half = x.len() / 2;
    for (i, &(c, s)) in rot.iter().enumerate() {
        let (a, b) = (x[i] as f64, x[i + half] as f64);
        x[i] = (a * c - b * s) as f32;
        x[i + half] = (a * s + b * c) as f32;
    }
}

/// One key row of KV head `h` (`d` values), rotated by `rot`.
fn key_row(rng: &mut SplitMix, h: usize, rot: &[(f64, f64)], out: &mut [f32]) {
    let d = out.len();
    for x in out.iter_mut() {
        *x = 0.5 * rng.normal();
    }
    for (j, &c) in outliers(h, d).iter().enumerate() {
        out[c] += 6.0 + 2.0 * j as f32 + rng.normal();
    }
    rope(out, rot);
}

/// Keys `[tokens][kv_heads][d]` at positions `0..tokens`, for key layer `layer`.
pub fn keys(layer: usize, tokens: usize, kv_heads: usize, d: usize) -> Vec<bf16> {
    let mut rng = SplitMix(0x6b65_7973 ^ (layer as u64) << 32);
    let mut out = Vec::with_capacity(tokens * kv_heads * d);
    let mut row = vec![0f32; d];
    for t in 0..tokens {
        let rot = rotation(t, d);
        for h in 0..kv_heads {
            key_row(&mut rng, h, &rot, &mut row);
            out.extend(row.iter().map(|&x| bf16::from_f32(x)));
        }
    }
    out
}

/// One decode step's inputs for a batch: `q [B][Hq][D]`, `k`, `v [B][Hkv][D]`, the keys and
/// queries rotated at position `pos` of every sequence.
pub struct DecodeInputs {
    pub q: Vec<bf16>,
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
}

/// Decode input set `set` for `batch` sequences at position `pos`.
pub fn decode_inputs(
    set: usize,
    batch: usize,
    pos: usize,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
) -> DecodeInputs {
    let mut rng = SplitMix(0x6465_636f ^ (set as u64) << 40);
    let group = q_heads / kv_heads;
    let mut row = vec![0f32; d];
    let rot = rotation(pos, d);
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..batch {
        for h in 0..q_heads {
            for x in row.iter_mut() {
                *x = 0.3 * rng.normal();
            }
            for &c in &outliers(h / group, d) {
                row[c] += 0.5 * rng.normal();
            }
            rope(&mut row, &rot);
            q.extend(row.iter().map(|&x| bf16::from_f32(x)));
        }
        for h in 0..kv_heads {
            key_row(&mut rng, h, &rot, &mut row);
            k.extend(row.iter().map(|&x| bf16::from_f32(x)));
            v.extend((0..d).map(|_| bf16::from_f32(rng.uniform())));
        }
    }
    DecodeInputs { q, k, v }
}
