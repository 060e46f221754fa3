//! The candle <-> lserve glue: lserve's CPU attention (`lserve::reference`) on candle CPU
//! [`Tensor`]s. Everything the engine knows of lserve is in this module.
//!
//! Tensors are `f32` `[T][heads][D]`; the cache holds `f16` (`HostKvCache<f16>`), so Q, K and V
//! are rounded to `f16` on the way in, as a GPU engine would hand them over; outputs come back
//! as `f32` `[T][Hq * D]`.

use anyhow::{anyhow, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use half::f16;
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId};
use lserve::reference::decode::{
    attend_rows, decode_step, decode_tokens, tokens_of_pages, HeadVisit,
};
use lserve::reference::kv_write::write_tokens;
use lserve::reference::prefill::{layer_token_patterns, prefill_layer};
use lserve::reference::select::ReuseState;

/// A tensor's elements as `f16`, row-major.
pub fn to_f16(t: &Tensor) -> Result<Vec<f16>> {
    Ok(t.to_dtype(DType::F16)?.flatten_all()?.to_vec1::<f16>()?)
}

/// `f64` rows `[T][width]` as an `f32` tensor.
fn to_tensor(x: &[f64], t: usize, width: usize) -> Result<Tensor> {
    let v: Vec<f32> = x.iter().map(|&x| x as f32).collect();
    Ok(Tensor::from_vec(v, (t, width), &Device::Cpu)?)
}

/// lserve's reference prefill attention of one layer for one sequence of `T` tokens: dense heads
/// causal, streaming heads the Λ mask of `config`. `q [T][Hq][D]`, `k`, `v [T][Hkv][D]`;
/// returns `[T][Hq * D]`.
pub fn prefill_attention(
    pattern: &HeadPattern,
    config: &SparsityConfig,
    layer: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<Tensor> {
    let g = *pattern.geometry();
    let t = q.dim(0)?;
    let (q, k, v) = (to_f16(q)?, to_f16(k)?, to_f16(v)?);
    let o = prefill_layer(pattern, config, layer, &[0, t], &q, &k, &v, None)?;
    to_tensor(&o.out, t, g.q_heads() * g.head_dim())
}

/// What one layer's decode attention did, against dense attention on the same inputs (only
/// when the cache was made with [`LserveAttention::new`]'s `probe`).
#[derive(Clone, Debug, Default)]
pub struct Probe {
    /// Per KV head: the fraction of its query heads' dense attention probability (mean over
    /// the group) that falls on the tokens it attended.
    pub mass: Vec<f64>,
    /// Per KV head: how many tokens it attended.
    pub tokens: Vec<usize>,
    /// `||out - dense|| / ||dense||` over the layer's output row (all query heads).
    pub rel_err: f64,
}

/// One sequence's paged KV cache (every layer) and its decode state, on lserve's CPU reference.
pub struct LserveAttention {
    mgr: KvCacheManager,
    cache: HostKvCache<f16>,
    tables: IndexTables,
    reuse: ReuseState,
    seq: SeqId,
    /// With `probe`: every layer's keys and values, `[L][Hkv][D]`, as `f32` of the `f16` the
    /// cache holds (the dense attention the probe compares against).
    shadow: Option<Vec<(Vec<f32>, Vec<f32>)>>,
}

impl LserveAttention {
    /// A cache for one sequence of up to `max_len` tokens; `probe` keeps a full copy of K and V
    /// to compare each decode step with dense attention ([`Probe`]).
    pub fn new(
        pattern: HeadPattern,
        config: SparsityConfig,
        max_len: usize,
        probe: bool,
    ) -> Result<Self> {
        let g = *pattern.geometry();
        let pages = config.pages_for_len(max_len);
        let mut mgr = KvCacheManager::new(g, pattern, config, pages, 1, max_len)?;
        let cache = HostKvCache::<f16>::for_manager(&mgr)?;
        let tables = IndexTables::for_manager(&mgr)?;
        let reuse = ReuseState::new(config.reuse_interval)?;
        let seq = mgr.add_sequence()?;
        let shadow = probe.then(|| vec![(Vec::new(), Vec::new()); g.layers()]);
        Ok(Self {
            mgr,
            cache,
            tables,
            reuse,
            seq,
            shadow,
        })
    }

    /// The model geometry.
    pub fn geometry(&self) -> ModelGeometry {
        *self.mgr.geometry()
    }

    /// Tokens in the cache (reserved ones included).
    pub fn len(&self) -> Result<usize> {
        Ok(self.mgr.len(self.seq)?)
    }

    /// Whether the cache holds no token.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Reserves `n` prompt tokens; then [`write_prompt`](Self::write_prompt) every layer.
    pub fn reserve_prompt(&mut self, n: usize) -> Result<()> {
        ensure!(self.is_empty()?, "the prompt goes into an empty cache");
        self.mgr.reserve(self.seq, n)?;
        Ok(())
    }

    /// Writes layer `layer`'s prompt keys and values (`[T][Hkv][D]`, `f16`, after RoPE) into
    /// the paged cache and pools their key statistics.
    pub fn write_prompt(&mut self, layer: usize, k: &[f16], v: &[f16]) -> Result<()> {
        let view = self.mgr.view(self.seq)?;
        write_tokens(&mut self.cache, layer, &view, 0, k, v)?;
        if let Some(shadow) = &mut self.shadow {
            let (sk, sv) = shadow.get_mut(layer).context("layer out of range")?;
            *sk = k.iter().map(|x| x.to_f32()).collect();
            *sv = v.iter().map(|x| x.to_f32()).collect();
        }
        Ok(())
    }

    /// Starts a decode step: reserves its token (then [`decode`](Self::decode) every layer,
    /// then [`end_step`](Self::end_step)).
    pub fn begin_step(&mut self) -> Result<()> {
        self.mgr.reserve(self.seq, 1)?;
        Ok(())
    }

    /// Ends a decode step (advances the sequence's step counter, which drives reuse).
    pub fn end_step(&mut self) -> Result<()> {
        self.mgr.advance_decode_step(self.seq)?;
        Ok(())
    }

    /// Layer `layer`'s decode attention for the step's token: appends `k`, `v` (`[1][Hkv][D]`)
    /// and attends `q` (`[1][Hq][D]`) with lserve's decode step (streaming heads over sinks and
    /// ring, dense heads over all pages or the selected ones, reuse per the config). Returns
    /// `[1][Hq * D]`, what each KV head visited, and with `probe` the comparison with dense.
    pub fn decode(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Vec<HeadVisit>, Option<Probe>)> {
        let g = self.geometry();
        let (q, k, v) = (to_f16(q)?, to_f16(k)?, to_f16(v)?);
        let o = decode_step(
            &self.mgr,
            &mut self.cache,
            &mut self.tables,
            &mut self.reuse,
            layer,
            &[self.seq],
            &q,
            &k,
            &v,
        )?;
        let visits = o
            .visits
            .into_iter()
            .next()
            .ok_or_else(|| anyhow!("decode step returned no sequence"))?;
        let probe = match &mut self.shadow {
            None => None,
            Some(shadow) => {
                let (sk, sv) = shadow.get_mut(layer).context("layer out of range")?;
                sk.extend(k.iter().map(|x| x.to_f32()));
                sv.extend(v.iter().map(|x| x.to_f32()));
                let len = self.mgr.len(self.seq)?;
                Some(probe(
                    &g,
                    self.mgr.config(),
                    self.mgr.pattern(),
                    layer,
                    len,
                    &q,
                    (sk, sv),
                    &visits,
                    &o.out,
                )?)
            }
        };
        let out = to_tensor(&o.out, 1, g.q_heads() * g.head_dim())?;
        Ok((out, visits, probe))
    }
}

/// Dense attention of the step's query over all `len` tokens of the layer against what the
/// decode step attended (`visits`, `out`).
#[allow(clippy::too_many_arguments)]
fn probe(
    g: &ModelGeometry,
    config: &SparsityConfig,
    pattern: &HeadPattern,
    layer: usize,
    len: usize,
    q: &[f16],
    (k, v): (&[f32], &[f32]),
    visits: &[HeadVisit],
    out: &[f64],
) -> Result<Probe> {
    let (hkv, d, group) = (g.kv_heads(), g.head_dim(), g.group());
    let scale = config.softmax_scale_for(d) as f64;
    let patterns = layer_token_patterns(pattern, config, layer)?;
    let mut p = Probe::default();
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for kvh in 0..hkv {
        let keys: Vec<&[f32]> = (0..len).map(|t| &k[(t * hkv + kvh) * d..][..d]).collect();
        let values: Vec<&[f32]> = (0..len).map(|t| &v[(t * hkv + kvh) * d..][..d]).collect();
        let seen = match (&visits[kvh], pattern.kind(layer, kvh)) {
            (HeadVisit::Selected { pages, .. }, _) => {
                tokens_of_pages(pages, config.unit_tokens(), len)
            }
            (HeadVisit::Streaming, HeadKind::Streaming) => decode_tokens(patterns[kvh], len)?,
            _ => (0..len).collect(),
        };
        let mut mass = 0.0;
        for h in kvh * group..(kvh + 1) * group {
            let qh: Vec<f32> = q[h * d..][..d].iter().map(|x| x.to_f32()).collect();
            let dense = attend_rows(&qh, &keys, &values, scale);
            for &t in &seen {
                let s: f64 = qh
                    .iter()
                    .zip(keys[t])
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                mass += (scale * s - dense.lse).exp();
            }
            for (o, w) in out[h * d..][..d].iter().zip(&dense.out) {
                diff += (o - w) * (o - w);
                norm += w * w;
            }
        }
        p.mass.push(mass / group as f64);
        p.tokens.push(seen.len());
    }
    p.rel_err = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
    Ok(p)
}
