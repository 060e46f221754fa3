//! Head patterns without training: score each KV head by the attention mass its query heads
//! put outside the streaming head's Λ mask (sinks + local window) on calibration text, and make
//! the heads that lose the least streaming ([`HeadPattern::from_calibration`]).
//!
//! An engine runs calibration text through the model with dense attention and hands each
//! layer's post-RoPE queries and keys to [`Calibration::add_layer`]; the accumulator keeps one
//! sum and one count per KV head, never an attention matrix.

use crate::config::SparsityConfig;
use crate::error::{checked_elements, invalid, LserveError, Result};
use crate::geometry::ModelGeometry;
use crate::head_pattern::{streaming_count, HeadPattern};

/// Per (layer, KV head): the mean softmax mass that dense attention puts on keys a streaming
/// head would not see, accumulated over calibration sequences.
///
/// For a query at position `t` (of a sequence that starts at position 0) the Λ mask of
/// `sink_tokens` and `local_tokens` keeps key `j <= t` iff `j < sink_tokens` or
/// `t - j < local_tokens` (as [`TokenPattern::Lambda`](crate::reference::TokenPattern)); the
/// *out-of-window mass* of the query is the dense softmax probability (over keys `0..=t`) of
/// the other keys, `sink_tokens <= j <= t - local_tokens`. Only positions
/// `t >= sink_tokens + local_tokens` have such keys; of those, every `stride`-th is sampled:
/// `t = sink_tokens + local_tokens + i * stride`. A KV head's score is the mean over the
/// sampled positions and over its group's query heads ([`ModelGeometry::group`]).
///
/// Cost of one [`add_layer`](Self::add_layer): `O(positions × tokens × q_heads × head_dim)`
/// with `positions ≈ (tokens - sink_tokens - local_tokens) / stride`; memory: one row of
/// `tokens` logits.
///
/// ```
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::{Calibration, HeadKind, HeadPattern};
/// // One layer, 2 KV heads (one query head each), D = 64; sinks 1, local 2.
/// let g = ModelGeometry::new(1, 2, 2, 64)?;
/// let config = SparsityConfig { sink_tokens: 1, local_tokens: 2, ..SparsityConfig::default() };
/// let mut cal = Calibration::new(g, &config)?;
/// // 8 tokens; keys are one-hot: key j is e_j for both KV heads.
/// let (t, d) = (8, 64);
/// let mut k = vec![0.0f32; t * 2 * d];
/// for j in 0..t {
///     for h in 0..2 {
///         k[(j * 2 + h) * d + j] = 1.0;
///     }
/// }
/// // Query head 0 looks at the sink (key 0), query head 1 at key 1 (outside the window
/// // from position 3 on).
/// let mut q = vec![0.0f32; t * 2 * d];
/// for p in 0..t {
///     q[(p * 2) * d] = 1000.0;
///     q[(p * 2 + 1) * d + 1] = 1000.0;
/// }
/// assert_eq!(cal.add_layer(0, t, &q, &k)?, 5); // positions 3..8
/// let scores = cal.scores()?;
/// assert!(scores[0][0] < 1e-6 && scores[0][1] > 0.99);
/// let p = HeadPattern::from_calibration(&cal, 0.5)?;
/// assert_eq!(p.layer_kinds(0), &[HeadKind::Streaming, HeadKind::Dense]);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    geometry: ModelGeometry,
    sink_tokens: usize,
    local_tokens: usize,
    scale: f64,
    stride: usize,
    /// `[layer * kv_heads + kv_head]`: out-of-window mass summed over the layer's sampled
    /// positions and the group's query heads.
    mass: Vec<f64>,
    /// `[layer]`: sampled positions added (every KV head of a layer has the same ones).
    positions: Vec<u64>,
    /// `[layer * kv_heads + kv_head]`: `Σ ||o_dense - o_Λ||²` over the rows added with values.
    error: Vec<f64>,
    /// `[layer * kv_heads + kv_head]`: `Σ ||o_dense||²` over the same rows.
    output: Vec<f64>,
    /// `[layer]`: sampled positions added with values.
    value_positions: Vec<u64>,
}

/// Which per-head statistic of a [`Calibration`] ranks the heads (the lowest become
/// streaming).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CalibrationScore {
    /// The mean dense attention mass outside the Λ mask ([`Calibration::scores`]).
    #[default]
    OutOfWindowMass,
    /// The relative error of the Λ mask's attention output against dense attention
    /// ([`Calibration::output_errors`]; needs rows added with
    /// [`add_layer_with_values`](Calibration::add_layer_with_values)).
    OutputError,
}

impl Calibration {
    /// An empty accumulator for `geometry`, with the Λ mask (`sink_tokens`, `local_tokens`)
    /// and the softmax scale ([`SparsityConfig::softmax_scale_for`]) of `config`, sampling
    /// every position (stride 1; see [`with_stride`](Self::with_stride)).
    ///
    /// Errors: what [`SparsityConfig::validate`] rejects.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::Calibration;
    /// let g = ModelGeometry::new(2, 8, 4, 64)?;
    /// let cal = Calibration::new(g, &SparsityConfig::default())?;
    /// assert_eq!(cal.positions(), &[0, 0]);
    /// let bad = SparsityConfig { local_tokens: 0, ..SparsityConfig::default() };
    /// assert!(Calibration::new(g, &bad).is_err());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn new(geometry: ModelGeometry, config: &SparsityConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            geometry,
            sink_tokens: config.sink_tokens,
            local_tokens: config.local_tokens,
            scale: f64::from(config.softmax_scale_for(geometry.head_dim())),
            stride: 1,
            mass: vec![0.0; geometry.total_kv_heads()],
            positions: vec![0; geometry.layers()],
            error: vec![0.0; geometry.total_kv_heads()],
            output: vec![0.0; geometry.total_kv_heads()],
            value_positions: vec![0; geometry.layers()],
        })
    }

    /// The same accumulator sampling every `stride`-th eligible position (bounds the cost of
    /// [`add_layer`](Self::add_layer) by `1 / stride`).
    ///
    /// Errors: `stride == 0` is `InvalidArgument { what: "stride" }`.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::Calibration;
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// let cal = Calibration::new(g, &SparsityConfig::default())?.with_stride(16)?;
    /// assert_eq!(cal.stride(), 16);
    /// assert!(Calibration::new(g, &SparsityConfig::default())?.with_stride(0).is_err());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn with_stride(self, stride: usize) -> Result<Self> {
        if stride == 0 {
            return Err(invalid("stride", "must be >= 1"));
        }
        Ok(Self { stride, ..self })
    }

    /// The sampling stride.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::Calibration;
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// assert_eq!(Calibration::new(g, &SparsityConfig::default())?.stride(), 1);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// The geometry the accumulator was made for.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::Calibration;
    /// let g = ModelGeometry::new(3, 8, 4, 64)?;
    /// let cal = Calibration::new(g, &SparsityConfig::default())?;
    /// assert_eq!(*cal.geometry(), g);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn geometry(&self) -> &ModelGeometry {
        &self.geometry
    }

    /// Sampled positions added so far, per layer (each counts once per query head of every KV
    /// head of the layer).
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::Calibration;
    /// let g = ModelGeometry::new(2, 1, 1, 64)?;
    /// let config = SparsityConfig { sink_tokens: 2, local_tokens: 3, ..SparsityConfig::default() };
    /// let mut cal = Calibration::new(g, &config)?.with_stride(2)?;
    /// let t = 10; // eligible positions 5..10, sampled 5, 7, 9
    /// let (q, k) = (vec![0.5f32; t * 64], vec![0.25f32; t * 64]);
    /// cal.add_layer(1, t, &q, &k)?;
    /// assert_eq!(cal.positions(), &[0, 3]);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn positions(&self) -> &[u64] {
        &self.positions
    }

    /// Adds one calibration sequence's layer `layer`: `q` `[tokens][q_heads][head_dim]` and `k`
    /// `[tokens][kv_heads][head_dim]`, post-RoPE, the sequence's tokens `0..tokens` (the first
    /// ones are its sinks). Each sampled query row is one softmax over keys `0..=t`, in `f64`;
    /// its mass on keys outside the Λ mask is added to its KV head's sum. Returns the number
    /// of positions sampled (0 when `tokens <= sink_tokens + local_tokens`: no key is outside
    /// the window). Several sequences (several calls per layer) add up.
    ///
    /// Errors (and the accumulator is unchanged): `layer >= layers` is `InvalidArgument {
    /// what: "layer" }`; a `tokens` whose buffers would overflow is `InvalidArgument { what:
    /// "tokens" }`; `q` or `k` of another length is `ShapeMismatch`; a NaN or infinite element
    /// is `InvalidArgument { what: "q" }` (or `"k"`).
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::Calibration;
    /// let g = ModelGeometry::new(1, 2, 1, 64)?;
    /// let config = SparsityConfig { sink_tokens: 1, local_tokens: 1, ..SparsityConfig::default() };
    /// let mut cal = Calibration::new(g, &config)?;
    /// let t = 4;
    /// // All logits equal: each query spreads evenly, so the query at t has mass (t - 1) / (t + 1)
    /// // outside the window (keys 1..t); positions 2 and 3 give 1/3 and 2/4.
    /// let (q, k) = (vec![0.0f32; t * 2 * 64], vec![0.0f32; t * 64]);
    /// assert_eq!(cal.add_layer(0, t, &q, &k)?, 2);
    /// assert!((cal.scores()?[0][0] - (1.0 / 3.0 + 0.5) / 2.0).abs() < 1e-12);
    /// assert!(cal.add_layer(1, t, &q, &k).is_err()); // no layer 1
    /// assert!(cal.add_layer(0, t, &q[1..], &k).is_err()); // q too short
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn add_layer(
        &mut self,
        layer: usize,
        tokens: usize,
        q: &[f32],
        k: &[f32],
    ) -> Result<usize> {
        self.accumulate(layer, tokens, q, k, None)
    }

    /// [`add_layer`](Self::add_layer) with the layer's values `v` `[tokens][kv_heads][head_dim]`
    /// too: besides the mass, each sampled row adds to its KV head the squared distance between
    /// its dense attention output `o` and the Λ mask's `o_Λ` (the softmax over the visible keys
    /// only), and `||o||²` ([`output_errors`](Self::output_errors)).
    ///
    /// Errors: as [`add_layer`](Self::add_layer), and for `v` as for `k` (`ShapeMismatch {
    /// what: "v" }`, `InvalidArgument { what: "v" }`).
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::Calibration;
    /// let g = ModelGeometry::new(1, 1, 1, 64)?;
    /// let config = SparsityConfig { sink_tokens: 1, local_tokens: 1, ..SparsityConfig::default() };
    /// let mut cal = Calibration::new(g, &config)?;
    /// // Equal logits; values 1 on the sink and the query's own token, 0 between: the Λ
    /// // output is 1, the dense one (2/3 at t = 2), so the error is 1/2 of it there.
    /// let t = 3;
    /// let (q, k) = (vec![0.0f32; t * 64], vec![0.0f32; t * 64]);
    /// let mut v = vec![1.0f32; t * 64];
    /// v[64..128].fill(0.0);
    /// assert_eq!(cal.add_layer_with_values(0, t, &q, &k, &v)?, 1);
    /// assert!((cal.output_errors()?[0][0] - 0.5).abs() < 1e-12);
    /// assert!(cal.add_layer_with_values(0, t, &q, &k, &v[1..]).is_err());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn add_layer_with_values(
        &mut self,
        layer: usize,
        tokens: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> Result<usize> {
        self.accumulate(layer, tokens, q, k, Some(v))
    }

    fn accumulate(
        &mut self,
        layer: usize,
        tokens: usize,
        q: &[f32],
        k: &[f32],
        v: Option<&[f32]>,
    ) -> Result<usize> {
        let g = self.geometry;
        let (hq, hkv, d, group) = (g.q_heads(), g.kv_heads(), g.head_dim(), g.group());
        if layer >= g.layers() {
            return Err(invalid(
                "layer",
                format!("{layer} is not below the geometry's {} layers", g.layers()),
            ));
        }
        let q_len = checked_elements::<f32>(&[tokens, hq, d]);
        let k_len = checked_elements::<f32>(&[tokens, hkv, d]);
        let (Some(q_len), Some(k_len)) = (q_len, k_len) else {
            return Err(invalid(
                "tokens",
                format!("{tokens} tokens overflow the activation buffers' size"),
            ));
        };
        let mut buffers = vec![("q", q, q_len), ("k", k, k_len)];
        buffers.extend(v.map(|v| ("v", v, k_len)));
        for (what, buf, expected) in buffers {
            if buf.len() != expected {
                return Err(LserveError::ShapeMismatch {
                    what,
                    expected,
                    actual: buf.len(),
                });
            }
            if let Some(i) = buf.iter().position(|x| !x.is_finite()) {
                return Err(invalid(
                    what,
                    format!("element {i} is {}, not finite", buf[i]),
                ));
            }
        }
        let window = self.sink_tokens + self.local_tokens;
        let sampled: Vec<usize> = (window..tokens).step_by(self.stride).collect();
        let mut delta = vec![0.0f64; hkv];
        let (mut d_error, mut d_output) = (vec![0.0f64; hkv], vec![0.0f64; hkv]);
        let mut logits = vec![0.0f64; tokens];
        let (mut o_all, mut o_in) = (vec![0.0f64; d], vec![0.0f64; d]);
        for &t in &sampled {
            let outside = self.sink_tokens..=t - self.local_tokens;
            for qh in 0..hq {
                let kvh = qh / group;
                let qrow = &q[(t * hq + qh) * d..][..d];
                let mut max = f64::NEG_INFINITY;
                for (j, l) in logits[..=t].iter_mut().enumerate() {
                    let krow = &k[(j * hkv + kvh) * d..][..d];
                    let dot: f64 = qrow
                        .iter()
                        .zip(krow)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum();
                    *l = self.scale * dot;
                    max = max.max(*l);
                }
                // p_j = exp(l_j - max) / sum: dividing by the sum rather than subtracting the
                // log-sum-exp, whose `ln(sum)` rounds away next to a logit of magnitude past 2^53.
                let sum: f64 = logits[..=t].iter().map(|&l| (l - max).exp()).sum();
                let prob = |l: f64| (l - max).exp() / sum;
                delta[kvh] += logits[outside.clone()]
                    .iter()
                    .map(|&l| prob(l))
                    .sum::<f64>();
                let Some(v) = v else { continue };
                // o = Σ p_j v_j over all keys; o_Λ = Σ_visible p_j v_j / Σ_visible p_j.
                o_all.fill(0.0);
                o_in.fill(0.0);
                let mut mass_in = 0.0;
                for (j, &l) in logits[..=t].iter().enumerate() {
                    let p = prob(l);
                    let visible = !outside.contains(&j);
                    if visible {
                        mass_in += p;
                    }
                    let vrow = &v[(j * hkv + kvh) * d..][..d];
                    for ((a, b), &x) in o_all.iter_mut().zip(o_in.iter_mut()).zip(vrow) {
                        *a += p * f64::from(x);
                        if visible {
                            *b += p * f64::from(x);
                        }
                    }
                }
                // The query's own key is visible, so mass_in is 0 only if every visible
                // probability underflows (logits ~745 below the max); o_Λ is then taken as 0.
                let inv = if mass_in > 0.0 { 1.0 / mass_in } else { 0.0 };
                for (a, b) in o_all.iter().zip(&o_in) {
                    d_error[kvh] += (a - b * inv) * (a - b * inv);
                    d_output[kvh] += a * a;
                }
            }
        }
        if v.is_some() {
            for (e, de) in self.error[layer * hkv..][..hkv].iter_mut().zip(&d_error) {
                *e += de;
            }
            for (o, dout) in self.output[layer * hkv..][..hkv].iter_mut().zip(&d_output) {
                *o += dout;
            }
            self.value_positions[layer] += sampled.len() as u64;
        }
        for (m, dm) in self.mass[layer * hkv..][..hkv].iter_mut().zip(&delta) {
            *m += dm;
        }
        self.positions[layer] += sampled.len() as u64;
        Ok(sampled.len())
    }

    /// The scores, `[layer][kv_head]`: each KV head's mean out-of-window mass over the sampled
    /// positions and its group's query heads, in `[0, 1]` (up to rounding).
    ///
    /// Errors: a layer with no sampled position yet is `InvalidArgument { what: "calibration"
    /// }` naming it.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::Calibration;
    /// let g = ModelGeometry::new(1, 1, 1, 64)?;
    /// let mut cal = Calibration::new(g, &SparsityConfig::default())?;
    /// assert!(cal.scores().is_err()); // nothing added yet
    /// let t = 400;
    /// let (q, k) = (vec![0.0f32; t * 64], vec![0.0f32; t * 64]);
    /// cal.add_layer(0, t, &q, &k)?;
    /// let s = cal.scores()?[0][0];
    /// assert!(s > 0.0 && s < 1.0);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn scores(&self) -> Result<Vec<Vec<f64>>> {
        let (hkv, group) = (self.geometry.kv_heads(), self.geometry.group());
        if let Some(layer) = self.positions.iter().position(|&n| n == 0) {
            return Err(invalid(
                "calibration",
                format!(
                    "layer {layer} has no sampled position (add it with more than sink_tokens + \
                     local_tokens = {} tokens)",
                    self.sink_tokens + self.local_tokens
                ),
            ));
        }
        Ok(self
            .positions
            .iter()
            .zip(self.mass.chunks(hkv))
            .map(|(&n, mass)| {
                let rows = n as f64 * group as f64;
                mass.iter().map(|m| m / rows).collect()
            })
            .collect())
    }
}

impl Calibration {
    /// The relative output error of the Λ mask per KV head, `[layer][kv_head]`: `sqrt(Σ ||o -
    /// o_Λ||² / Σ ||o||²)` over the rows added with
    /// [`add_layer_with_values`](Self::add_layer_with_values) (the sampled positions of the
    /// group's query heads), `o` the dense attention output, `o_Λ` the output over the visible
    /// keys only. 0 for a head whose dense outputs are all zero.
    ///
    /// Errors: a layer with no sampled position added with values is `InvalidArgument { what:
    /// "calibration" }` naming it.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::Calibration;
    /// let g = ModelGeometry::new(1, 1, 1, 64)?;
    /// let mut cal = Calibration::new(g, &SparsityConfig::default())?;
    /// let t = 400;
    /// let (q, k, v) = (vec![0.0f32; t * 64], vec![0.0f32; t * 64], vec![1.0f32; t * 64]);
    /// cal.add_layer(0, t, &q, &k)?;
    /// assert!(cal.output_errors().is_err()); // no values yet
    /// cal.add_layer_with_values(0, t, &q, &k, &v)?;
    /// // Every value is the same vector: dropping keys changes nothing.
    /// assert!(cal.output_errors()?[0][0] < 1e-12);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn output_errors(&self) -> Result<Vec<Vec<f64>>> {
        if let Some(layer) = self.value_positions.iter().position(|&n| n == 0) {
            return Err(invalid(
                "calibration",
                format!(
                    "layer {layer} has no sampled position added with values \
                     (add_layer_with_values)"
                ),
            ));
        }
        let hkv = self.geometry.kv_heads();
        Ok(self
            .error
            .chunks(hkv)
            .zip(self.output.chunks(hkv))
            .map(|(err, out)| {
                err.iter()
                    .zip(out)
                    .map(|(&e, &o)| {
                        if o > 0.0 {
                            (e / o).min(f64::MAX).sqrt()
                        } else {
                            0.0
                        }
                    })
                    .collect()
            })
            .collect())
    }

    /// The scores of `score`: [`scores`](Self::scores) or
    /// [`output_errors`](Self::output_errors).
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::{Calibration, CalibrationScore};
    /// let g = ModelGeometry::new(1, 1, 1, 64)?;
    /// let mut cal = Calibration::new(g, &SparsityConfig::default())?;
    /// let t = 330;
    /// cal.add_layer(0, t, &vec![0.0; t * 64], &vec![0.0; t * 64])?;
    /// assert_eq!(cal.scores_of(CalibrationScore::OutOfWindowMass)?, cal.scores()?);
    /// assert!(cal.scores_of(CalibrationScore::OutputError).is_err());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn scores_of(&self, score: CalibrationScore) -> Result<Vec<Vec<f64>>> {
        match score {
            CalibrationScore::OutOfWindowMass => self.scores(),
            CalibrationScore::OutputError => self.output_errors(),
        }
    }
}

impl HeadPattern {
    /// The pattern a [`Calibration`] implies at a target streaming fraction `s` in `[0, 1]`:
    /// the KV heads with the least out-of-window mass ([`Calibration::scores`]) become
    /// streaming, `round(s * layers * kv_heads)` of them, chosen exactly as
    /// [`from_gating_values`](Self::from_gating_values) chooses (the scores are its alphas): a
    /// global quantile over all layers' heads, not a per-layer one, so a layer may end up with
    /// more or fewer streaming heads than `s * kv_heads`; ties go to the lower layer, then the
    /// lower KV head.
    ///
    /// Errors: a fraction outside `[0, 1]` (or NaN) is `InvalidConfig { field:
    /// "streaming_fraction" }`; a layer with no sampled position, as [`Calibration::scores`].
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::{Calibration, HeadPattern};
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// let mut cal = Calibration::new(g, &SparsityConfig { sink_tokens: 1, local_tokens: 1, ..Default::default() })?;
    /// let t = 6;
    /// cal.add_layer(0, t, &vec![0.0; t * 2 * 64], &vec![0.0; t * 2 * 64])?;
    /// assert_eq!(HeadPattern::from_calibration(&cal, 1.0)?.total_streaming_heads(), 2);
    /// assert_eq!(HeadPattern::from_calibration(&cal, 0.0)?.total_streaming_heads(), 0);
    /// assert!(HeadPattern::from_calibration(&cal, 1.5).is_err());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn from_calibration(calibration: &Calibration, streaming_fraction: f64) -> Result<Self> {
        Self::from_calibration_by(
            calibration,
            CalibrationScore::OutOfWindowMass,
            streaming_fraction,
        )
    }

    /// [`from_calibration`](Self::from_calibration) ranking the heads by `score` (the lowest
    /// become streaming; the same selection). Where the engine can hand the values,
    /// [`CalibrationScore::OutputError`] is the better ranking on SmolLM2-135M (equal or lower
    /// NLL at every fraction measured; `docs/CALIBRATION.md`).
    ///
    /// Errors: as [`from_calibration`](Self::from_calibration); for
    /// [`CalibrationScore::OutputError`], a layer added without values, as
    /// [`Calibration::output_errors`].
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::{Calibration, CalibrationScore, HeadKind, HeadPattern};
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// let config = SparsityConfig { sink_tokens: 1, local_tokens: 1, ..SparsityConfig::default() };
    /// let mut cal = Calibration::new(g, &config)?;
    /// // Both heads spread evenly (the same out-of-window mass); head 0's values are all
    /// // equal, head 1's grow with the token (j²): only head 1's output changes under Λ.
    /// let t = 6;
    /// let (q, k) = (vec![0.0f32; t * 2 * 64], vec![0.0f32; t * 2 * 64]);
    /// let mut v = vec![1.0f32; t * 2 * 64];
    /// for j in 0..t {
    ///     v[(j * 2 + 1) * 64] = (j * j) as f32;
    /// }
    /// cal.add_layer_with_values(0, t, &q, &k, &v)?;
    /// let p = HeadPattern::from_calibration_by(&cal, CalibrationScore::OutputError, 0.5)?;
    /// assert_eq!(p.layer_kinds(0), &[HeadKind::Streaming, HeadKind::Dense]);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn from_calibration_by(
        calibration: &Calibration,
        score: CalibrationScore,
        streaming_fraction: f64,
    ) -> Result<Self> {
        streaming_count(calibration.geometry, streaming_fraction)?;
        let scores = calibration.scores_of(score)?;
        Self::from_gating_values(&scores, calibration.geometry, streaming_fraction)
    }
}
