//! Real activations as test data: the post-RoPE queries, keys and values of a few layers of the
//! model over a long text, with dense attention, saved as a safetensors file for lserve's GPU
//! tests (`tests/gpu_real_activations.rs` in the main workspace; `scripts/dump_activations.sh`
//! makes the file).
//!
//! The forward is the model's ([`Llama`]) with each layer's attention [`causal_attention`]: dense
//! causal softmax attention in candle ops (`f32`, query rows in chunks), on Q, K and V rounded to
//! `f16` as [`crate::adapter`] hands them to lserve. lserve's reference prefill would give the
//! same attention but is quadratic in `f64` on the CPU (about 15 minutes a layer pattern at 8K
//! tokens on a 2-core machine); candle's matrix products are several times faster.
//!
//! The file ([`FORMAT`]), for every dumped layer `L`:
//!
//! | tensor | shape | what |
//! | --- | --- | --- |
//! | `layer.L.k` | `[T][Hkv][D]` | keys after RoPE, every position |
//! | `layer.L.v` | `[T][Hkv][D]` | values, every position |
//! | `layer.L.q` | `[W][N][Hq][D]` | queries after RoPE at positions `end - N .. end` of each of the `W` window ends |
//!
//! all `f16`, and `tokens` (`[T]`, `u32`, the token ids). The metadata (strings) names the
//! geometry and the windows: `format`, `model`, `text`, `tokens` (T), `layers` (comma-separated),
//! `q_heads`, `kv_heads`, `head_dim`, `rope_base`, `query_ends` (comma-separated, each at most T),
//! `queries` (N), `attention`.
//!
//! A decode step at position `p` (0-based) appends `k[p]`, `v[p]` and attends `q[p]` over
//! positions `0..=p`: window end `e` is `N` decode steps after a prompt of `e - N` tokens. The
//! model is causal, so these are the activations of the text's first `e` tokens as well.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use half::f16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::model::Llama;

/// The value of the `format` metadata key.
pub const FORMAT: &str = "lserve-activations/1";

/// What to dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpSpec {
    /// Layers, ascending, each below the model's layer count.
    pub layers: Vec<usize>,
    /// Window ends: positions after each window's last query, ascending, each in
    /// `queries..=tokens`.
    pub query_ends: Vec<usize>,
    /// Queries per window (`N`).
    pub queries: usize,
}

/// One layer's dumped activations (`f16`, row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerActivations {
    /// The layer.
    pub layer: usize,
    /// Queries `[W][N][Hq][D]`.
    pub q: Vec<f16>,
    /// Keys `[T][Hkv][D]`.
    pub k: Vec<f16>,
    /// Values `[T][Hkv][D]`.
    pub v: Vec<f16>,
}

/// A dump: the tokens, the geometry, the windows and the layers' activations.
#[derive(Clone, Debug, PartialEq)]
pub struct Activations {
    /// Token ids (`T` of them).
    pub tokens: Vec<u32>,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// The windows' ends and queries per window.
    pub spec: DumpSpec,
    /// Per dumped layer, in `spec.layers` order.
    pub layers: Vec<LayerActivations>,
}

impl DumpSpec {
    /// Checks the spec against a model of `layers` layers and a text of `tokens` tokens.
    pub fn check(&self, layers: usize, tokens: usize) -> Result<()> {
        ensure!(!self.layers.is_empty(), "no layer to dump");
        ensure!(
            self.layers.windows(2).all(|w| w[0] < w[1]),
            "layers {:?} are not ascending",
            self.layers
        );
        ensure!(
            self.layers.iter().all(|&l| l < layers),
            "layers {:?}: the model has {layers}",
            self.layers
        );
        ensure!(self.queries > 0, "no query per window");
        ensure!(!self.query_ends.is_empty(), "no window");
        ensure!(
            self.query_ends.windows(2).all(|w| w[0] < w[1]),
            "window ends {:?} are not ascending",
            self.query_ends
        );
        ensure!(
            self.query_ends
                .iter()
                .all(|&e| e >= self.queries && e <= tokens),
            "window ends {:?} must lie in {}..={tokens}",
            self.query_ends,
            self.queries
        );
        Ok(())
    }

    /// The query positions, window after window.
    pub fn positions(&self) -> impl Iterator<Item = usize> + '_ {
        self.query_ends
            .iter()
            .flat_map(move |&e| e - self.queries..e)
    }
}

/// Dense causal softmax attention of `q [T][Hq][D]` over `k`, `v [T][Hkv][D]` (`f32`), query
/// head `h` on KV head `h / (Hq / Hkv)`, scale `1 / sqrt(D)`, in candle ops, `chunk` query rows
/// at a time (each over the keys up to its last row); returns `[T][Hq * D]`.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, chunk: usize) -> Result<Tensor> {
    let (t, hq, d) = q.dims3()?;
    let hkv = k.dim(1)?;
    ensure!(
        hkv > 0 && hq % hkv == 0,
        "{hq} query heads on {hkv} KV heads"
    );
    ensure!(chunk > 0, "chunk of 0 rows");
    let g = hq / hkv;
    // [T][Hkv][D] -> [Hq][T][D], each KV head repeated for its group.
    let expand = |x: &Tensor| -> Result<Tensor> {
        let x = x.transpose(0, 1)?.contiguous()?;
        Ok(x.unsqueeze(1)?
            .expand((hkv, g, t, d))?
            .reshape((hq, t, d))?
            .contiguous()?)
    };
    let (k, v) = (expand(k)?, expand(v)?);
    let q = q.transpose(0, 1)?.contiguous()?;
    let scale = 1.0 / (d as f64).sqrt();
    let mut outs = Vec::new();
    for a in (0..t).step_by(chunk) {
        let b = (a + chunk).min(t);
        let qc = q.narrow(1, a, b - a)?;
        let kc = k.narrow(1, 0, b)?;
        let vc = v.narrow(1, 0, b)?;
        let scores = (qc.matmul(&kc.t()?)? * scale)?;
        let mask: Vec<f32> = (a..b)
            .flat_map(|i| (0..b).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (b - a, b), &Device::Cpu)?;
        let scores = scores.broadcast_add(&mask)?;
        let max = scores.max_keepdim(D::Minus1)?;
        let e = scores.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        outs.push(p.matmul(&vc)?); // [Hq][c][D]
    }
    let o = Tensor::cat(&outs, 1)?;
    Ok(o.transpose(0, 1)?.reshape((t, hq * d))?)
}

/// Rounded to `f16` and back.
fn f16_round(x: &Tensor) -> Result<Tensor> {
    Ok(x.to_dtype(DType::F16)?.to_dtype(DType::F32)?)
}

fn f16s(x: &Tensor) -> Result<Vec<f16>> {
    Ok(x.to_dtype(DType::F16)?.flatten_all()?.to_vec1::<f16>()?)
}

/// Runs `tokens` through the model up to the last dumped layer, every layer's attention
/// [`causal_attention`] on its Q, K, V rounded to `f16`, and keeps the dumped layers' keys and
/// values (every position) and queries (the windows' positions). Reports each layer's time on
/// stderr.
pub fn dump(model: &Llama, tokens: &[u32], spec: &DumpSpec) -> Result<Activations> {
    let c = *model.config();
    spec.check(c.layers, tokens.len())?;
    let positions: Vec<u32> = spec.positions().map(|p| p as u32).collect();
    let positions = Tensor::new(positions.as_slice(), &Device::Cpu)?;
    let mut x = model.embed(tokens)?;
    let mut layers = Vec::new();
    let last = *spec.layers.last().context("no layer")?;
    for layer in 0..=last {
        let start = Instant::now();
        let qkv = model.qkv(layer, &x, 0)?;
        let (q, k, v) = (f16_round(&qkv.q)?, f16_round(&qkv.k)?, f16_round(&qkv.v)?);
        if spec.layers.contains(&layer) {
            layers.push(LayerActivations {
                layer,
                q: f16s(&q.index_select(&positions, 0)?)?,
                k: f16s(&k)?,
                v: f16s(&v)?,
            });
        }
        let attn = causal_attention(&q, &k, &v, 256)?;
        if layer < last {
            x = model.finish_layer(layer, &x, &attn)?;
        }
        eprintln!(
            "layer {layer}: {:.1}s{}",
            start.elapsed().as_secs_f64(),
            if spec.layers.contains(&layer) {
                " (dumped)"
            } else {
                ""
            }
        );
    }
    Ok(Activations {
        tokens: tokens.to_vec(),
        q_heads: c.q_heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        spec: spec.clone(),
        layers,
    })
}

fn list(xs: &[usize]) -> String {
    xs.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn parse_list(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|x| x.parse().with_context(|| format!("{x:?} in {s:?}")))
        .collect()
}

fn le_bytes_f16(x: &[f16]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl Activations {
    /// Writes the dump to `path` as safetensors ([`FORMAT`]), with `extra` metadata (e.g. the
    /// model and the text) beside the geometry.
    pub fn save(&self, path: &Path, extra: &[(&str, String)]) -> Result<()> {
        let (hq, hkv, d) = (self.q_heads, self.kv_heads, self.head_dim);
        let (t, w, n) = (
            self.tokens.len(),
            self.spec.query_ends.len(),
            self.spec.queries,
        );
        let mut buffers: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = vec![(
            "tokens".into(),
            Dtype::U32,
            vec![t],
            self.tokens.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )];
        for l in &self.layers {
            let name = |what: &str| format!("layer.{}.{what}", l.layer);
            buffers.push((name("q"), Dtype::F16, vec![w, n, hq, d], le_bytes_f16(&l.q)));
            buffers.push((name("k"), Dtype::F16, vec![t, hkv, d], le_bytes_f16(&l.k)));
            buffers.push((name("v"), Dtype::F16, vec![t, hkv, d], le_bytes_f16(&l.v)));
        }
        let views = buffers
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                Ok((name.clone(), TensorView::new(*dtype, shape.clone(), bytes)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut meta: HashMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("tokens", t.to_string()),
            ("layers", list(&self.spec.layers)),
            ("q_heads", hq.to_string()),
            ("kv_heads", hkv.to_string()),
            ("head_dim", d.to_string()),
            ("query_ends", list(&self.spec.query_ends)),
            ("queries", n.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        for (k, v) in extra {
            meta.insert(k.to_string(), v.clone());
        }
        safetensors::serialize_to_file(views, Some(meta), path)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }

    /// Reads a dump [`save`](Self::save) wrote, checking every tensor's dtype and shape against
    /// the metadata.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)?;
        let meta = header
            .metadata()
            .clone()
            .with_context(|| format!("{}: no metadata", path.display()))?;
        let get = |k: &str| {
            meta.get(k)
                .with_context(|| format!("{}: no metadata {k}", path.display()))
        };
        if get("format")? != FORMAT {
            bail!(
                "{}: format {:?}, want {FORMAT}",
                path.display(),
                get("format")?
            );
        }
        let num = |k: &str| -> Result<usize> {
            get(k)?
                .parse()
                .with_context(|| format!("metadata {k} is not a number"))
        };
        let st = safetensors::SafeTensors::deserialize(&bytes)?;
        let (t, hq, hkv, d, n) = (
            num("tokens")?,
            num("q_heads")?,
            num("kv_heads")?,
            num("head_dim")?,
            num("queries")?,
        );
        let spec = DumpSpec {
            layers: parse_list(get("layers")?)?,
            query_ends: parse_list(get("query_ends")?)?,
            queries: n,
        };
        let tensor = |name: &str, dtype: Dtype, shape: Vec<usize>| -> Result<Vec<u8>> {
            let view = st.tensor(name)?;
            ensure!(
                view.dtype() == dtype && view.shape() == shape.as_slice(),
                "{name}: {:?} {:?}, want {dtype:?} {shape:?}",
                view.dtype(),
                view.shape()
            );
            Ok(view.data().to_vec())
        };
        let halves = |b: Vec<u8>| -> Vec<f16> {
            b.as_chunks::<2>()
                .0
                .iter()
                .map(|&c| f16::from_le_bytes(c))
                .collect()
        };
        let tokens = tensor("tokens", Dtype::U32, vec![t])?
            .as_chunks::<4>()
            .0
            .iter()
            .map(|&c| u32::from_le_bytes(c))
            .collect();
        let w = spec.query_ends.len();
        let layers = spec
            .layers
            .iter()
            .map(|&layer| {
                let name = |what: &str| format!("layer.{layer}.{what}");
                Ok(LayerActivations {
                    layer,
                    q: halves(tensor(&name("q"), Dtype::F16, vec![w, n, hq, d])?),
                    k: halves(tensor(&name("k"), Dtype::F16, vec![t, hkv, d])?),
                    v: halves(tensor(&name("v"), Dtype::F16, vec![t, hkv, d])?),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            tokens,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            spec,
            layers,
        })
    }
}
