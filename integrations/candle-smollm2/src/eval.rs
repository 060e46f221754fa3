//! The teacher-forced evaluation behind the fidelity report (`src/bin/fidelity.rs`) and the
//! smoke test on the real model (`tests/adapter.rs`): a window of a text's tokens, the settings
//! grouped by head pattern (one prefill each), and one setting's decode steps over the
//! evaluated tokens with their negative log-likelihoods and per-layer probes.

use std::time::Instant;

use anyhow::{ensure, Result};
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{Calibration, HeadKind, HeadPattern};
use lserve::reference::decode::HeadVisit;

use crate::engine::{cache_for, decode_token, nll, Prefilled, Setting, Timing};
use crate::model::Llama;

/// The tokens of one evaluation: a prompt, then the evaluated positions, each fed its true
/// token and scored on the next one.
#[derive(Clone, Copy, Debug)]
pub struct Window<'a> {
    /// Index of the prompt's first token in the text.
    pub first: usize,
    /// The prompt (prefilled).
    pub prompt: &'a [u32],
    /// The tokens fed to the decode steps, one each.
    pub fed: &'a [u32],
    /// The tokens the decode steps' logits score: `fed` shifted by one.
    pub targets: &'a [u32],
}

impl<'a> Window<'a> {
    /// The text's last `eval` tokens scored (the last `eval + 1` fed or scored) after a prompt
    /// of the `context` tokens before them, or of as many as the text has.
    ///
    /// Errors: the text has fewer than `eval + 2` tokens.
    pub fn last(ids: &'a [u32], context: usize, eval: usize) -> Result<Self> {
        ensure!(
            ids.len() >= eval + 2,
            "the text has {} tokens, fewer than eval + 2 = {}",
            ids.len(),
            eval + 2
        );
        let context = context.min(ids.len() - eval - 1);
        let first = ids.len() - eval - 1 - context;
        let end = first + context;
        Ok(Self {
            first,
            prompt: &ids[first..end],
            fed: &ids[end..end + eval],
            targets: &ids[end + 1..end + eval + 1],
        })
    }
}

/// `settings` grouped by head pattern (settings with the same streaming heads share one
/// prefill), in the order of each pattern's first setting.
pub fn by_pattern(
    settings: &[Setting],
    g: ModelGeometry,
    calibration: Option<&Calibration>,
) -> Result<Vec<(HeadPattern, Vec<Setting>)>> {
    let mut groups: Vec<(HeadPattern, Vec<Setting>)> = Vec::new();
    for s in settings {
        let pattern = s.pattern(g, calibration)?;
        match groups.iter_mut().find(|(p, _)| *p == pattern) {
            Some((_, list)) => list.push(*s),
            None => groups.push((pattern, vec![*s])),
        }
    }
    Ok(groups)
}

/// What one setting measured over a window's evaluated tokens.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The setting.
    pub setting: Setting,
    /// Per evaluated token: `-ln p(target)`.
    pub nll: Vec<f64>,
    /// Per layer, per probed step and dense KV head: the dense attention mass on the tokens
    /// it attended.
    pub layer_mass_dense: Vec<Vec<f64>>,
    /// The same for the streaming KV heads.
    pub layer_mass_stream: Vec<Vec<f64>>,
    /// Per layer, per probed step: the attention output's relative error against dense.
    pub layer_rel_err: Vec<Vec<f64>>,
    /// Per probed step: tokens attended per KV head (mean over layers and heads).
    pub tokens_attended: Vec<f64>,
    /// Decode steps in which some head ran page selection (the others reused it or attended
    /// everything).
    pub selected_steps: usize,
    /// Where the decode time went.
    pub timing: Timing,
    /// Wall-clock seconds of the decode steps.
    pub seconds: f64,
}

impl Outcome {
    /// The mean negative log-likelihood over the evaluated tokens.
    pub fn mean_nll(&self) -> f64 {
        mean(&self.nll)
    }
}

/// The mean of `x` (NaN when empty).
pub fn mean(x: &[f64]) -> f64 {
    if x.is_empty() {
        f64::NAN
    } else {
        x.iter().sum::<f64>() / x.len() as f64
    }
}

/// `setting` over `window`'s evaluated tokens: a cache holding `pre` (the window's prompt
/// prefilled with `pattern`, the setting's head pattern), then one decode step per fed token,
/// its logits scoring the next true token; every `probe_every`-th step (from the first) probes
/// each layer against dense attention.
pub fn evaluate(
    model: &Llama,
    setting: &Setting,
    pattern: &HeadPattern,
    pre: &Prefilled,
    window: &Window,
    probe_every: usize,
) -> Result<Outcome> {
    ensure!(probe_every >= 1, "probe_every must be >= 1");
    ensure!(
        pre.tokens == window.prompt.len(),
        "the prefill has {} tokens, the window's prompt {}",
        pre.tokens,
        window.prompt.len()
    );
    let c = *model.config();
    let start = Instant::now();
    let mut attn = cache_for(setting, pattern, pre, window.fed.len(), true)?;
    let mut o = Outcome {
        setting: *setting,
        nll: Vec::new(),
        layer_mass_dense: vec![Vec::new(); c.layers],
        layer_mass_stream: vec![Vec::new(); c.layers],
        layer_rel_err: vec![Vec::new(); c.layers],
        tokens_attended: Vec::new(),
        selected_steps: 0,
        timing: Timing::default(),
        seconds: 0.0,
    };
    for (i, (&token, &target)) in window.fed.iter().zip(window.targets).enumerate() {
        let pos = pre.tokens + i;
        let step = decode_token(model, &mut attn, token, pos, &mut o.timing)?;
        o.nll.push(nll(&step.logits, target)?);
        if step.visits.iter().flatten().any(|v| {
            matches!(
                v,
                HeadVisit::Selected {
                    selected_now: true,
                    ..
                }
            )
        }) {
            o.selected_steps += 1;
        }
        if i % probe_every == 0 {
            let mut attended = 0usize;
            for (layer, p) in step.probes.iter().enumerate() {
                for (h, (&m, &n)) in p.mass.iter().zip(&p.tokens).enumerate() {
                    attended += n;
                    match pattern.kind(layer, h) {
                        HeadKind::Dense => o.layer_mass_dense[layer].push(m),
                        HeadKind::Streaming => o.layer_mass_stream[layer].push(m),
                    }
                }
                o.layer_rel_err[layer].push(p.rel_err);
            }
            o.tokens_attended
                .push(attended as f64 / (c.layers * c.kv_heads) as f64);
        }
    }
    o.seconds = start.elapsed().as_secs_f64();
    Ok(o)
}
