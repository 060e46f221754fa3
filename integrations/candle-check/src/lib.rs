//! lserve beside candle, in one dependency graph: candle's CUDA tensors passed to lserve's
//! prefill attention, on candle's stream.
//!
//! candle (`candle-core` with `cuda`) builds cudarc with `dynamic-linking` and the CUDA version
//! of the toolkit it finds (`cuda-version-from-build-system`); lserve takes cudarc as the
//! engine builds it. A candle tensor's buffer is the `CudaSlice` of its `CudaStorage`, its
//! device's stream is `CudaDevice::cuda_stream()`, and lserve's context is built on that stream
//! ([`GpuContext::from_stream`]), so lserve's launches and copies run in order with candle's
//! own work, and candle's event tracking (if it is on) covers lserve's reads and writes.
//!
//! `scripts/candle_check.sh` compile-checks this crate on a machine without a GPU; the test
//! below runs it on a GPU.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use lserve::gpu::PrefillArgs;
//! use lserve::head_pattern::HeadKind;
//!
//! let device = Device::new_cuda_with_stream(0)?;
//! let gpu = lserve_candle_check::lserve_on(device.as_cuda_device()?)?;
//! let (t, hq, hkv, d) = (100, 8, 2, 128);
//! let q = Tensor::zeros((t, hq, d), DType::BF16, &device)?;
//! let k = Tensor::zeros((t, hkv, d), DType::BF16, &device)?;
//! let v = Tensor::zeros((t, hkv, d), DType::BF16, &device)?;
//! let args = PrefillArgs {
//!     q_heads: hq, kv_heads: hkv, head_dim: d,
//!     cu_seqlens: &[0, t],
//!     kinds: &[HeadKind::Dense, HeadKind::Streaming],
//!     sink_tokens: 16, local_tokens: 32,
//!     block_masks: None, softmax_scale: None, prefix_lens: None, with_lse: false,
//! };
//! let out: Tensor = lserve_candle_check::prefill_attention(&gpu, &args, &q, &k, &v)?;
//! assert_eq!(out.dims(), &[t, hq, d]);
//! # Ok::<(), lserve_candle_check::Error>(())
//! ```

use std::fmt;

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Layout, Storage, Tensor};
use half::bf16;
use lserve::cudarc::driver::CudaSlice;
use lserve::gpu::{GpuContext, PrefillArgs};
use lserve::LserveError;

/// What can go wrong between candle and lserve.
#[derive(Debug)]
pub enum Error {
    /// candle's error (not a CUDA tensor, not bf16, an allocation).
    Candle(candle_core::Error),
    /// lserve's error (shapes, arguments, the driver).
    Lserve(LserveError),
    /// A tensor lserve cannot take as a plain buffer: not contiguous from the start of its
    /// storage, not on lserve's stream.
    Tensor {
        /// Which argument.
        what: &'static str,
        /// Why.
        reason: &'static str,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Candle(e) => write!(f, "candle: {e}"),
            Error::Lserve(e) => write!(f, "lserve: {e}"),
            Error::Tensor { what, reason } => write!(f, "tensor `{what}`: {reason}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Candle(e)
    }
}

impl From<LserveError> for Error {
    fn from(e: LserveError) -> Self {
        Error::Lserve(e)
    }
}

/// lserve's kernels on candle's device, launching on the device's stream.
pub fn lserve_on(device: &CudaDevice) -> Result<GpuContext, Error> {
    Ok(GpuContext::from_stream(device.cuda_stream())?)
}

/// The bf16 device buffer of a tensor (its storage and layout), which must lie on `gpu`'s
/// stream and fill its buffer exactly (contiguous, from offset 0, no other elements: lserve's
/// calls take whole buffers).
fn cuda_buffer<'a>(
    gpu: &GpuContext,
    what: &'static str,
    storage: &'a Storage,
    layout: &Layout,
) -> Result<&'a CudaSlice<bf16>, Error> {
    let Storage::Cuda(storage) = storage else {
        return Err(Error::Tensor {
            what,
            reason: "not on a CUDA device",
        });
    };
    if storage.device.cuda_stream().cu_stream() != gpu.stream().cu_stream() {
        return Err(Error::Tensor {
            what,
            reason: "on another CUDA stream than lserve's context",
        });
    }
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        return Err(Error::Tensor {
            what,
            reason: "not contiguous from the start of its buffer (call `.contiguous()` or copy)",
        });
    }
    let slice = storage.as_cuda_slice::<bf16>()?;
    if slice.len() != layout.shape().elem_count() {
        return Err(Error::Tensor {
            what,
            reason: "a view of part of its buffer (copy it into a tensor of its own)",
        });
    }
    Ok(slice)
}

/// lserve's block-sparse prefill attention ([`lserve::gpu::prefill_attention`]) of candle bf16
/// tensors `q [T, Hq, D]`, `k`, `v [T, Hkv, D]` on `gpu`'s (candle's) stream; returns
/// `out [T, Hq, D]`, a new candle tensor on the same device. Enqueued only: candle's next use
/// of `out` on that stream comes after it.
///
/// Errors: a tensor not on the stream, not bf16, or not a whole contiguous buffer; lserve's
/// argument and shape errors (nothing launched).
pub fn prefill_attention(
    gpu: &GpuContext,
    args: &PrefillArgs<'_>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<Tensor, Error> {
    let device = q.device().as_cuda_device()?.clone();
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let q_buf = cuda_buffer(gpu, "q", &qs, ql)?;
    let k_buf = cuda_buffer(gpu, "k", &ks, kl)?;
    let v_buf = cuda_buffer(gpu, "v", &vs, vl)?;
    let mut out = device.alloc_zeros::<bf16>(q.elem_count())?;
    lserve::gpu::prefill_attention(gpu, args, q_buf, k_buf, v_buf, &mut out)?;
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, device));
    Ok(Tensor::from_storage(
        storage,
        q.shape().clone(),
        BackpropOp::none(),
        false,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use lserve::head_pattern::HeadKind;
    use lserve::reference::prefill::{prefill_attention as reference_prefill, PrefillInput};
    use lserve::reference::TokenPattern;

    /// candle tensors through lserve's prefill on candle's stream, against lserve's CPU
    /// reference.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn prefill_of_candle_tensors_matches_the_reference() {
        let device = Device::new_cuda_with_stream(0).unwrap();
        let gpu = lserve_on(device.as_cuda_device().unwrap()).unwrap();
        let (t, hq, hkv, d) = (150, 4, 2, 64);
        let values = |n: usize, salt: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * 7919 + salt * 104_729) % 2001) as f32 / 1000.0) - 1.0)
                .map(|x| bf16::from_f32(x).to_f32())
                .collect()
        };
        let (q, k, v) = (
            values(t * hq * d, 1),
            values(t * hkv * d, 2),
            values(t * hkv * d, 3),
        );
        let tensor = |x: &[f32], heads: usize| {
            Tensor::from_slice(x, (t, heads, d), &device)
                .and_then(|x| x.to_dtype(DType::BF16))
                .unwrap()
        };
        let cu = [0, 60, t];
        let kinds = [HeadKind::Dense, HeadKind::Streaming];
        let args = PrefillArgs {
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            cu_seqlens: &cu,
            kinds: &kinds,
            sink_tokens: 8,
            local_tokens: 40,
            block_masks: None,
            softmax_scale: None,
            prefix_lens: None,
            with_lse: false,
        };
        let out = prefill_attention(
            &gpu,
            &args,
            &tensor(&q, hq),
            &tensor(&k, hkv),
            &tensor(&v, hkv),
        )
        .unwrap();
        let got: Vec<f32> = out
            .to_dtype(DType::F32)
            .and_then(|o| o.flatten_all())
            .and_then(|o| o.to_vec1())
            .unwrap();
        let patterns = [
            TokenPattern::Causal,
            TokenPattern::Lambda {
                sink_tokens: 8,
                local_tokens: 40,
            },
        ];
        let want = reference_prefill(&PrefillInput {
            cu_seqlens: &cu,
            q: &q,
            k: &k,
            v: &v,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            patterns: &patterns,
            block_mask: None,
            scale: 1.0 / (d as f64).sqrt(),
        })
        .unwrap()
        .out;
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for (&g, &w) in got.iter().zip(&want) {
            diff += (g as f64 - w) * (g as f64 - w);
            norm += w * w;
        }
        assert_eq!(got.len(), want.len());
        let err = (diff / norm).sqrt();
        assert!(err < 1e-2, "relative error {err} against the reference");
    }
}
