//! The engine: the candle model with every layer's attention through lserve
//! ([`crate::adapter`]), and the attention configurations the fidelity report compares.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use candle_core::Tensor;
use half::f16;
use lserve::config::{GqaAggregation, SelectionUnit, SparsityConfig};
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{Calibration, CalibrationScore, HeadPattern};
use lserve::reference::decode::HeadVisit;

use crate::adapter::{prefill_attention, to_f16, LserveAttention, Probe};
use crate::model::{Llama, Qkv};

/// How the dense (non-streaming) heads attend at decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// Every token (no page selection).
    Dense,
    /// Quest-like flat page selection: pages of `page` tokens (16 for Quest's), statistics per
    /// page (physical page = logical page), selection every step.
    Flat {
        /// Tokens a dense head attends to.
        budget: usize,
        /// Tokens per page (a multiple of 16).
        page: usize,
    },
    /// LServe's hierarchical pages: physical 64, logical 16 tokens, selection every `reuse`
    /// steps.
    Hierarchical {
        /// Tokens a dense head attends to.
        budget: usize,
        /// Reuse interval (1: select every step).
        reuse: usize,
    },
    /// Logical-page selection (`SelectionUnit::LogicalPage`): physical pages of 64 tokens as
    /// LServe's, but the top-K picks 16-token logical pages inside them (flat 16's selection
    /// over LServe's layout), every `reuse` steps.
    Logical {
        /// Tokens a dense head attends to.
        budget: usize,
        /// Reuse interval (1: select every step).
        reuse: usize,
    },
}

/// Which KV heads stream at a setting's fraction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heads {
    /// `HeadPattern::interleaved`: evenly spread (a synthetic default; there is no published
    /// DuoAttention gating for SmolLM2).
    Interleaved,
    /// `HeadPattern::from_calibration`: the heads with the least attention mass outside the
    /// sinks + local window on calibration text ([`calibrate`]).
    Calibrated,
    /// `HeadPattern::from_calibration_by` with `CalibrationScore::OutputError`: the heads whose
    /// attention output the Λ mask changes least (relative to dense) on calibration text.
    CalibratedOutput,
    /// A uniformly random choice of the same number of heads ([`random_pattern`]).
    Random {
        /// The seed.
        seed: u64,
    },
}

/// One attention configuration: which heads stream, how the dense heads select.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Setting {
    /// Fraction of KV heads that are streaming heads (sinks 64 + local 256).
    pub streaming: f64,
    /// Which heads those are.
    pub heads: Heads,
    /// The dense heads' selection.
    pub selection: Selection,
    /// How a KV group's query heads combine their page scores (LServe's default: max).
    pub aggregation: GqaAggregation,
}

impl Setting {
    /// A short name: `dense`, `stream-s0.25`, `flat-b1024`, `lserve-b1024-r4-s0.5`, ..., with
    /// `-calib` or `-randSEED` after the fraction for calibrated or random heads (nothing for
    /// interleaved ones), and `-mean` last for mean GQA aggregation.
    pub fn name(&self) -> String {
        let name = self.selection_name();
        match self.aggregation {
            GqaAggregation::Max => name,
            GqaAggregation::Mean => format!("{name}-mean"),
        }
    }

    /// [`name`](Self::name) without the aggregation.
    fn selection_name(&self) -> String {
        let s = if self.streaming > 0.0 {
            let heads = match self.heads {
                Heads::Interleaved => String::new(),
                Heads::Calibrated => "-calib".into(),
                Heads::CalibratedOutput => "-calibout".into(),
                Heads::Random { seed } => format!("-rand{seed}"),
            };
            format!("s{}{heads}", self.streaming)
        } else {
            String::new()
        };
        let join = |a: String| {
            if s.is_empty() {
                a
            } else {
                format!("{a}-{s}")
            }
        };
        match self.selection {
            Selection::Dense if s.is_empty() => "dense".into(),
            Selection::Dense => format!("stream-{s}"),
            Selection::Flat { budget, page: 16 } => join(format!("flat-b{budget}")),
            Selection::Flat { budget, page } => join(format!("flat{page}-b{budget}")),
            Selection::Hierarchical { budget, reuse } => join(format!("lserve-b{budget}-r{reuse}")),
            Selection::Logical { budget, reuse } => join(format!("logical-b{budget}-r{reuse}")),
        }
    }

    /// lserve's config for this setting. Selection is on whenever the sequence is longer than
    /// the budget (`dynamic_min_len = budget`); the first page is always attended (the
    /// attention sink), as in LServe's defaults.
    pub fn config(&self) -> SparsityConfig {
        let base = SparsityConfig {
            gqa_aggregation: self.aggregation,
            ..SparsityConfig::default()
        };
        match self.selection {
            Selection::Dense => SparsityConfig {
                dynamic_min_len: u32::MAX as usize,
                ..base
            },
            Selection::Flat { budget, page } => SparsityConfig {
                page_tokens: page,
                logical_page_tokens: page,
                token_budget: budget,
                reuse_interval: 1,
                dynamic_min_len: budget,
                ..base
            },
            Selection::Hierarchical { budget, reuse } => SparsityConfig {
                page_tokens: 64,
                logical_page_tokens: 16,
                token_budget: budget,
                reuse_interval: reuse,
                dynamic_min_len: budget,
                ..base
            },
            Selection::Logical { budget, reuse } => SparsityConfig {
                page_tokens: 64,
                logical_page_tokens: 16,
                token_budget: budget,
                reuse_interval: reuse,
                dynamic_min_len: budget,
                selection_unit: SelectionUnit::LogicalPage,
                ..base
            },
        }
    }

    /// The head pattern at this setting's fraction, per [`Heads`]; calibrated heads need the
    /// `calibration` (an error without it).
    pub fn pattern(
        &self,
        g: ModelGeometry,
        calibration: Option<&Calibration>,
    ) -> Result<HeadPattern> {
        Ok(match self.heads {
            Heads::Interleaved => HeadPattern::interleaved(g, self.streaming)?,
            Heads::Calibrated | Heads::CalibratedOutput => {
                let cal = calibration.with_context(|| {
                    format!("{}: calibrated heads need a calibration", self.name())
                })?;
                ensure!(
                    *cal.geometry() == g,
                    "the calibration is of another geometry"
                );
                let score = if self.heads == Heads::Calibrated {
                    CalibrationScore::OutOfWindowMass
                } else {
                    CalibrationScore::OutputError
                };
                HeadPattern::from_calibration_by(cal, score, self.streaming)?
            }
            Heads::Random { seed } => random_pattern(g, self.streaming, seed)?,
        })
    }
}

/// `round(fraction * layers * kv_heads)` streaming heads chosen uniformly at random (seeded):
/// every head gets a pseudo-random gating value (splitmix64 of `seed`, in `[0, 1)`) and
/// `HeadPattern::from_gating_values` thresholds them, so the count is the one every other
/// pattern of that fraction has.
pub fn random_pattern(g: ModelGeometry, fraction: f64, seed: u64) -> Result<HeadPattern> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    };
    let alpha: Vec<Vec<f64>> = (0..g.layers())
        .map(|_| (0..g.kv_heads()).map(|_| next()).collect())
        .collect();
    Ok(HeadPattern::from_gating_values(&alpha, g, fraction)?)
}

/// lserve's geometry of the model.
pub fn geometry(model: &Llama) -> Result<ModelGeometry> {
    let c = model.config();
    Ok(ModelGeometry::new(
        c.layers, c.q_heads, c.kv_heads, c.head_dim,
    )?)
}

/// Time spent in candle (matrix work) and in lserve (attention).
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    /// candle: embedding, norms, projections, RoPE, MLP, output head.
    pub candle: Duration,
    /// lserve: attention (and cache writes).
    pub lserve: Duration,
}

/// A prompt run through the model: every layer's keys and values (after RoPE, `f16`,
/// `[T][Hkv][D]`) and the last token's hidden state. The same for every [`Setting`] with the
/// same streaming heads (prefill does not select pages), so one prefill serves them all.
pub struct Prefilled {
    /// Per layer: keys and values.
    pub kv: Vec<(Vec<f16>, Vec<f16>)>,
    /// The last prompt token's hidden state `[1][hidden]`.
    pub last_hidden: Tensor,
    /// Prompt tokens.
    pub tokens: usize,
    /// Where the time went.
    pub timing: Timing,
}

/// Runs `tokens` through the model, each layer's attention lserve's reference prefill with
/// `pattern`'s streaming heads (Λ mask of `config`'s sinks and local tokens).
pub fn prefill(
    model: &Llama,
    pattern: &HeadPattern,
    config: &SparsityConfig,
    tokens: &[u32],
) -> Result<Prefilled> {
    prefill_observed(model, pattern, config, tokens, &mut |_, _| Ok(()))
}

/// [`prefill`], handing each layer's attention inputs (after RoPE) to `observe` before the
/// layer attends.
pub fn prefill_observed(
    model: &Llama,
    pattern: &HeadPattern,
    config: &SparsityConfig,
    tokens: &[u32],
    observe: &mut dyn FnMut(usize, &Qkv) -> Result<()>,
) -> Result<Prefilled> {
    ensure!(!tokens.is_empty(), "an empty prompt");
    let mut timing = Timing::default();
    let mut kv = Vec::new();
    let start = Instant::now();
    let mut x = model.embed(tokens)?;
    timing.candle += start.elapsed();
    for layer in 0..model.config().layers {
        let start = Instant::now();
        let qkv = model.qkv(layer, &x, 0)?;
        timing.candle += start.elapsed();
        observe(layer, &qkv)?;
        let start = Instant::now();
        let attn = prefill_attention(pattern, config, layer, &qkv.q, &qkv.k, &qkv.v)?;
        kv.push((to_f16(&qkv.k)?, to_f16(&qkv.v)?));
        timing.lserve += start.elapsed();
        let start = Instant::now();
        x = model.finish_layer(layer, &x, &attn)?;
        timing.candle += start.elapsed();
    }
    let last_hidden = x.narrow(0, tokens.len() - 1, 1)?;
    Ok(Prefilled {
        kv,
        last_hidden,
        tokens: tokens.len(),
        timing,
    })
}

/// Calibrates the model's head pattern on `tokens` (one sequence from its first token): a dense
/// prefill, each layer's post-RoPE queries and keys and its values (`f32`, as candle computes
/// them) added to a [`Calibration`] (`add_layer_with_values`: both scores) with `config`'s sinks, local window and scale, sampling every `stride`-th
/// position past the window. Returns it and the seconds spent in it (prefill excluded).
pub fn calibrate(
    model: &Llama,
    config: &SparsityConfig,
    tokens: &[u32],
    stride: usize,
) -> Result<(Calibration, Prefilled, f64)> {
    let g = geometry(model)?;
    let mut cal = Calibration::new(g, config)?.with_stride(stride)?;
    let mut secs = 0.0;
    let pre = prefill_observed(
        model,
        &HeadPattern::all_dense(g),
        config,
        tokens,
        &mut |layer, qkv| {
            let start = Instant::now();
            let q = qkv.q.flatten_all()?.to_vec1::<f32>()?;
            let k = qkv.k.flatten_all()?.to_vec1::<f32>()?;
            let v = qkv.v.flatten_all()?.to_vec1::<f32>()?;
            cal.add_layer_with_values(layer, tokens.len(), &q, &k, &v)?;
            secs += start.elapsed().as_secs_f64();
            Ok(())
        },
    )?;
    Ok((cal, pre, secs))
}

/// A cache for `setting` with head pattern `pattern` (the one `prompt` was prefilled with)
/// holding the prefilled prompt, with room for `decode` more tokens.
pub fn cache_for(
    setting: &Setting,
    pattern: &HeadPattern,
    prompt: &Prefilled,
    decode: usize,
    probe: bool,
) -> Result<LserveAttention> {
    let mut attn = LserveAttention::new(
        pattern.clone(),
        setting.config(),
        prompt.tokens + decode,
        probe,
    )?;
    attn.reserve_prompt(prompt.tokens)?;
    for (layer, (k, v)) in prompt.kv.iter().enumerate() {
        attn.write_prompt(layer, k, v)?;
    }
    Ok(attn)
}

/// One decode step's result.
pub struct Step {
    /// Logits `[vocab]` for the next token.
    pub logits: Vec<f32>,
    /// Per layer: what each KV head visited.
    pub visits: Vec<Vec<HeadVisit>>,
    /// Per layer, with a probing cache: the comparison with dense attention.
    pub probes: Vec<Probe>,
}

/// Decodes `token` at position `pos` through every layer (lserve's decode step for the
/// attention) and returns the next token's logits; adds the time to `timing`.
pub fn decode_token(
    model: &Llama,
    attn: &mut LserveAttention,
    token: u32,
    pos: usize,
    timing: &mut Timing,
) -> Result<Step> {
    let start = Instant::now();
    let mut x = model.embed(&[token])?;
    timing.candle += start.elapsed();
    attn.begin_step()?;
    let (mut visits, mut probes) = (Vec::new(), Vec::new());
    for layer in 0..model.config().layers {
        let start = Instant::now();
        let qkv = model.qkv(layer, &x, pos)?;
        timing.candle += start.elapsed();
        let start = Instant::now();
        let (out, visit, probe) = attn.decode(layer, &qkv.q, &qkv.k, &qkv.v)?;
        timing.lserve += start.elapsed();
        visits.push(visit);
        probes.extend(probe);
        let start = Instant::now();
        x = model.finish_layer(layer, &x, &out)?;
        timing.candle += start.elapsed();
    }
    attn.end_step()?;
    let start = Instant::now();
    let logits = model.logits(&x)?.flatten_all()?.to_vec1::<f32>()?;
    timing.candle += start.elapsed();
    Ok(Step {
        logits,
        visits,
        probes,
    })
}

/// `-ln softmax(logits)[target]`, in `f64`.
pub fn nll(logits: &[f32], target: u32) -> Result<f64> {
    let t = target as usize;
    ensure!(t < logits.len(), "token {t} past the vocabulary");
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - m).exp()).sum();
    Ok(m + sum.ln() - logits[t] as f64)
}
