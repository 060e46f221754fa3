//! Activations as views: the `q`, `k`, `v` and `out` tensors of an operation are token rows of
//! whole heads in device memory, `stride` elements apart, so a view into a fused
//! `[tokens][Hq + 2 Hkv][D]` QKV buffer works without a copy.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr};

use super::GpuContext;
use crate::{LserveError, Result};

/// An input tensor of an operation: token rows of whole heads, `stride` elements apart (packed
/// rows unless given). A `&CudaSlice` or a `CudaView` converts into a packed one.
///
/// The rule every operation checks for a tensor of `n` tokens of `heads` heads of `D` elements
/// (prefill and decode alike): the stride is a multiple of `D` and at least `heads * D`, the view
/// holds at least `(n - 1) * stride + heads * D` elements (more is fine), and its start is
/// 16-byte aligned. Otherwise the operation returns a typed error and enqueues nothing.
///
/// ```no_run
/// use half::bf16;
/// use lserve::gpu::{GpuContext, Tokens};
/// let gpu = GpuContext::new(0)?;
/// let (t, hq, hkv, d) = (1024, 32, 8, 128);
/// let row = (hq + 2 * hkv) * d; // one token of a fused QKV projection
/// let qkv = gpu.stream().alloc_zeros::<bf16>(t * row)?;
/// let q = Tokens::strided(qkv.slice(..), row);
/// let k = Tokens::strided(qkv.slice(hq * d..), row);
/// let v = Tokens::strided(qkv.slice((hq + hkv) * d..), row);
/// # let _ = (q, k, v);
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct Tokens<'a, E> {
    view: CudaView<'a, E>,
    /// Elements between consecutive tokens; `None`: packed rows.
    stride: Option<usize>,
}

/// An output tensor of an operation, as [`Tokens`] (a `&mut CudaSlice` or a `CudaViewMut`
/// converts into a packed one).
///
/// ```no_run
/// use half::bf16;
/// use lserve::gpu::{GpuContext, TokensMut};
/// let gpu = GpuContext::new(0)?;
/// let mut out = gpu.stream().alloc_zeros::<bf16>(1024 * 32 * 128)?;
/// let out = TokensMut::strided(out.slice_mut(..), 32 * 128);
/// # let _ = out;
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct TokensMut<'a, E> {
    view: CudaViewMut<'a, E>,
    stride: Option<usize>,
}

impl<'a, E> Tokens<'a, E> {
    /// Token rows `stride` elements apart, the first at the start of `view`.
    pub fn strided(view: CudaView<'a, E>, stride: usize) -> Self {
        Self {
            view,
            stride: Some(stride),
        }
    }

    /// The device memory.
    pub(crate) fn view(&self) -> &CudaView<'a, E> {
        &self.view
    }

    /// The same rows, borrowed again (to hand them to another operation).
    pub(crate) fn reborrow(&self) -> Tokens<'_, E> {
        Tokens {
            view: self.view.slice(..),
            stride: self.stride,
        }
    }

    /// Checks the tensor holds `tokens` rows of `heads` heads of `head_dim` elements by the
    /// rule above; returns its stride in heads (the kernels' `TokenStrides` unit).
    pub(crate) fn heads_stride(
        &self,
        gpu: &GpuContext,
        what: &'static str,
        tokens: usize,
        heads: usize,
        head_dim: usize,
    ) -> Result<u32> {
        let (ptr, _guard) = self.view.device_ptr(gpu.stream());
        check_rows(
            what,
            ptr,
            self.view.len(),
            self.stride,
            tokens,
            heads,
            head_dim,
        )
    }
}

impl<'a, E> TokensMut<'a, E> {
    /// Token rows `stride` elements apart, the first at the start of `view`.
    pub fn strided(view: CudaViewMut<'a, E>, stride: usize) -> Self {
        Self {
            view,
            stride: Some(stride),
        }
    }

    /// The device memory.
    pub(crate) fn view_mut(&mut self) -> &mut CudaViewMut<'a, E> {
        &mut self.view
    }

    /// As [`Tokens::heads_stride`].
    pub(crate) fn heads_stride(
        &self,
        gpu: &GpuContext,
        what: &'static str,
        tokens: usize,
        heads: usize,
        head_dim: usize,
    ) -> Result<u32> {
        let (ptr, _guard) = self.view.device_ptr(gpu.stream());
        check_rows(
            what,
            ptr,
            self.view.len(),
            self.stride,
            tokens,
            heads,
            head_dim,
        )
    }
}

/// The stride `k` and `v` share, in heads, after checking both hold `tokens` rows of `heads`
/// heads of `head_dim` elements ([`Tokens`]' rule); different strides are `InvalidArgument`.
pub(crate) fn kv_stride<E>(
    gpu: &GpuContext,
    k: &Tokens<'_, E>,
    v: &Tokens<'_, E>,
    tokens: usize,
    heads: usize,
    head_dim: usize,
) -> Result<u32> {
    let stride = k.heads_stride(gpu, "k", tokens, heads, head_dim)?;
    if v.heads_stride(gpu, "v", tokens, heads, head_dim)? != stride {
        return Err(LserveError::InvalidArgument {
            what: "v",
            reason: "k and v must have the same token stride".into(),
        });
    }
    Ok(stride)
}

impl<'a, E> From<&'a CudaSlice<E>> for Tokens<'a, E> {
    fn from(slice: &'a CudaSlice<E>) -> Self {
        Self {
            view: slice.as_view(),
            stride: None,
        }
    }
}

impl<'a, E> From<CudaView<'a, E>> for Tokens<'a, E> {
    fn from(view: CudaView<'a, E>) -> Self {
        Self { view, stride: None }
    }
}

impl<'a, E> From<&'a mut CudaSlice<E>> for TokensMut<'a, E> {
    fn from(slice: &'a mut CudaSlice<E>) -> Self {
        Self {
            view: slice.as_view_mut(),
            stride: None,
        }
    }
}

impl<'a, E> From<CudaViewMut<'a, E>> for TokensMut<'a, E> {
    fn from(view: CudaViewMut<'a, E>) -> Self {
        Self { view, stride: None }
    }
}

/// The rule of [`Tokens`] for a view of `len` elements at device address `ptr`.
fn check_rows(
    what: &'static str,
    ptr: u64,
    len: usize,
    stride: Option<usize>,
    tokens: usize,
    heads: usize,
    head_dim: usize,
) -> Result<u32> {
    let row = heads * head_dim;
    let stride = stride.unwrap_or(row);
    if stride < row || stride % head_dim != 0 || stride / head_dim > u32::MAX as usize {
        return Err(LserveError::InvalidArgument {
            what,
            reason: format!(
                "token stride {stride}: a multiple of head_dim {head_dim}, at least a row of \
                 {heads} heads ({row} elements)"
            ),
        });
    }
    let needed = match tokens {
        0 => 0,
        n => (n - 1)
            .checked_mul(stride)
            .and_then(|x| x.checked_add(row))
            .ok_or(LserveError::InvalidArgument {
                what,
                reason: format!("{n} tokens of stride {stride} overflow"),
            })?,
    };
    if len < needed {
        return Err(LserveError::ShapeMismatch {
            what,
            expected: needed,
            actual: len,
        });
    }
    if ptr % 16 != 0 {
        return Err(LserveError::InvalidArgument {
            what,
            reason: format!("the view starts at {ptr:#x}, not 16-byte aligned"),
        });
    }
    Ok((stride / head_dim) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_rule() {
        // Packed: 3 tokens x 4 heads x 64.
        assert_eq!(check_rows("q", 0, 768, None, 3, 4, 64).unwrap(), 4);
        // A fused QKV row of 4 + 2 + 2 heads: q needs (n - 1) * 512 + 256 elements.
        assert_eq!(
            check_rows("q", 0, 2 * 512 + 256, Some(512), 3, 4, 64).unwrap(),
            8
        );
        assert!(matches!(
            check_rows("q", 0, 2 * 512 + 255, Some(512), 3, 4, 64),
            Err(LserveError::ShapeMismatch {
                expected: 1280,
                actual: 1279,
                ..
            })
        ));
        // Larger buffers are fine; a stride shorter than a row, or not whole heads, is not.
        assert!(check_rows("q", 0, 10_000, None, 3, 4, 64).is_ok());
        assert!(check_rows("q", 0, 10_000, Some(192), 3, 4, 64).is_err());
        assert!(check_rows("q", 0, 10_000, Some(260), 3, 4, 64).is_err());
        // Misaligned views and overflowing sizes.
        assert!(check_rows("q", 8, 10_000, None, 3, 4, 64).is_err());
        assert!(check_rows("q", 0, usize::MAX, Some(1 << 62), 8, 4, 64).is_err());
        // No tokens need no elements.
        assert!(check_rows("q", 0, 0, None, 0, 4, 64).is_ok());
    }
}
