//! SmolLM2 (Llama architecture) from a GGUF file, on candle's CPU backend: token embedding,
//! RMSNorm, quantized projections, RoPE (GGUF's interleaved pairs), SwiGLU, tied output head.
//!
//! The model stops at attention: [`Llama::qkv`] hands a layer's Q, K, V (after RoPE) to the
//! caller, who attends (through lserve, [`crate::adapter`]) and hands the result back to
//! [`Llama::finish_layer`].

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{DType, Device, Module, Tensor, D};

/// The shape of the model, read from the GGUF metadata (`llama.*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (GQA).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Hidden size.
    pub hidden: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// RoPE base frequency.
    pub rope_base: f64,
    /// Trained context length.
    pub context: usize,
}

struct Block {
    attn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    ffn_norm: Tensor,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
}

/// The model's weights and the RoPE tables.
pub struct Llama {
    config: Config,
    embedding: Tensor,
    blocks: Vec<Block>,
    output_norm: Tensor,
    output: QMatMul,
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

/// A layer's attention inputs for `T` tokens, after RoPE: `q [T][Hq][D]`, `k`, `v [T][Hkv][D]`,
/// `f32`, contiguous.
pub struct Qkv {
    /// Queries.
    pub q: Tensor,
    /// Keys.
    pub k: Tensor,
    /// Values.
    pub v: Tensor,
}

fn meta_u(ct: &gguf_file::Content, key: &str) -> Result<usize> {
    let v = ct
        .metadata
        .get(key)
        .with_context(|| format!("GGUF metadata has no {key}"))?;
    Ok(v.to_u32().with_context(|| format!("{key} is not a u32"))? as usize)
}

fn meta_f(ct: &gguf_file::Content, key: &str) -> Result<f64> {
    let v = ct
        .metadata
        .get(key)
        .with_context(|| format!("GGUF metadata has no {key}"))?;
    Ok(v.to_f32().with_context(|| format!("{key} is not an f32"))? as f64)
}

/// RMSNorm over the last dimension.
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?
        .broadcast_mul(weight)?)
}

impl Llama {
    /// Loads a Llama-architecture GGUF (and the metadata of its shape).
    ///
    /// Errors: the file cannot be read, is not GGUF, is not `llama`, or lacks a tensor.
    pub fn load(path: &Path) -> Result<(Self, gguf_file::Content)> {
        let device = Device::Cpu;
        let mut file = BufReader::new(
            File::open(path).with_context(|| format!("opening {}", path.display()))?,
        );
        let ct = gguf_file::Content::read(&mut file)
            .with_context(|| format!("reading GGUF {}", path.display()))?;
        let arch = ct
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if arch != "llama" {
            bail!("{}: architecture {arch:?}, expected llama", path.display());
        }
        let hidden = meta_u(&ct, "llama.embedding_length")?;
        let q_heads = meta_u(&ct, "llama.attention.head_count")?;
        let config = Config {
            layers: meta_u(&ct, "llama.block_count")?,
            q_heads,
            kv_heads: meta_u(&ct, "llama.attention.head_count_kv")?,
            head_dim: hidden / q_heads,
            hidden,
            rms_eps: meta_f(&ct, "llama.attention.layer_norm_rms_epsilon")?,
            rope_base: meta_f(&ct, "llama.rope.freq_base").unwrap_or(10_000.0),
            context: meta_u(&ct, "llama.context_length")?,
        };
        let mut tensor = |name: &str| {
            ct.tensor(&mut file, name, &device)
                .with_context(|| format!("GGUF tensor {name}"))
        };
        let embedding_q = tensor("token_embd.weight")?;
        let embedding = embedding_q.dequantize(&device)?;
        let output = match tensor("output.weight") {
            Ok(w) => QMatMul::from_qtensor(w)?,
            // SmolLM2 ties the output head to the embedding.
            Err(_) => QMatMul::from_qtensor(embedding_q)?,
        };
        let output_norm = tensor("output_norm.weight")?.dequantize(&device)?;
        let mut blocks = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let mut q = |n: &str| -> Result<QMatMul> {
                Ok(QMatMul::from_qtensor(tensor(&format!(
                    "blk.{i}.{n}.weight"
                ))?)?)
            };
            blocks.push(Block {
                wq: q("attn_q")?,
                wk: q("attn_k")?,
                wv: q("attn_v")?,
                wo: q("attn_output")?,
                gate: q("ffn_gate")?,
                up: q("ffn_up")?,
                down: q("ffn_down")?,
                attn_norm: tensor(&format!("blk.{i}.attn_norm.weight"))?.dequantize(&device)?,
                ffn_norm: tensor(&format!("blk.{i}.ffn_norm.weight"))?.dequantize(&device)?,
            });
        }
        let (cos, sin) = rope_tables(&config, config.context, &device)?;
        Ok((
            Self {
                config,
                embedding,
                blocks,
                output_norm,
                output,
                cos,
                sin,
                device,
            },
            ct,
        ))
    }

    /// The model's shape.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The hidden states `[T][hidden]` of `tokens`.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let ids = Tensor::new(tokens, &self.device)?;
        Ok(self.embedding.index_select(&ids, 0)?)
    }

    /// Layer `layer`'s attention inputs for hidden states `x [T][hidden]` at positions
    /// `first .. first + T`, RoPE applied to Q and K.
    pub fn qkv(&self, layer: usize, x: &Tensor, first: usize) -> Result<Qkv> {
        let c = &self.config;
        let b = &self.blocks[layer];
        let t = x.dim(0)?;
        if first + t > c.context {
            bail!(
                "positions up to {} past the context {}",
                first + t,
                c.context
            );
        }
        let h = rms_norm(x, &b.attn_norm, c.rms_eps)?;
        let q = b.wq.forward(&h)?.reshape((t, c.q_heads, c.head_dim))?;
        let k = b.wk.forward(&h)?.reshape((t, c.kv_heads, c.head_dim))?;
        let v = b.wv.forward(&h)?.reshape((t, c.kv_heads, c.head_dim))?;
        let cos = self.cos.narrow(0, first, t)?;
        let sin = self.sin.narrow(0, first, t)?;
        Ok(Qkv {
            q: rope_interleaved(&q, &cos, &sin)?,
            k: rope_interleaved(&k, &cos, &sin)?,
            v: v.contiguous()?,
        })
    }

    /// The rest of layer `layer`: output projection of the attention `attn [T][Hq * D]`, the
    /// residual, the SwiGLU MLP and its residual. Returns the new hidden states.
    pub fn finish_layer(&self, layer: usize, x: &Tensor, attn: &Tensor) -> Result<Tensor> {
        let b = &self.blocks[layer];
        let x = (x + b.wo.forward(attn)?)?;
        let h = rms_norm(&x, &b.ffn_norm, self.config.rms_eps)?;
        let gate = b.gate.forward(&h)?;
        let silu = gate.silu()?;
        let mlp = b.down.forward(&(silu * b.up.forward(&h)?)?)?;
        Ok((x + mlp)?)
    }

    /// Logits `[T][vocab]` of hidden states `x [T][hidden]` (final norm, output head).
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let h = rms_norm(x, &self.output_norm, self.config.rms_eps)?;
        Ok(self.output.forward(&h)?.to_dtype(DType::F32)?)
    }
}

/// `cos`, `sin` `[positions][D / 2]` for RoPE with the model's base.
fn rope_tables(c: &Config, positions: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = c.head_dim / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| (1.0 / c.rope_base.powf(2.0 * i as f64 / c.head_dim as f64)) as f32)
        .collect();
    let inv = Tensor::from_vec(inv, (1, half), device)?;
    let pos: Vec<f32> = (0..positions).map(|p| p as f32).collect();
    let pos = Tensor::from_vec(pos, (positions, 1), device)?;
    let angles = pos.broadcast_mul(&inv)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// RoPE on `x [T][H][D]` with GGUF's layout (llama.cpp permutes Llama's Q and K weights so that
/// the rotated pairs are adjacent channels `(2i, 2i + 1)`); `cos`, `sin` `[T][D / 2]`.
pub fn rope_interleaved(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (t, h, d) = x.dims3()?;
    let x = x.reshape((t, h, d / 2, 2))?;
    let x0 = x.narrow(3, 0, 1)?;
    let x1 = x.narrow(3, 1, 1)?;
    let cos = cos.reshape((t, 1, d / 2, 1))?;
    let sin = sin.reshape((t, 1, d / 2, 1))?;
    let r0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
    let r1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
    Ok(Tensor::cat(&[r0, r1], 3)?
        .reshape((t, h, d))?
        .contiguous()?)
}
