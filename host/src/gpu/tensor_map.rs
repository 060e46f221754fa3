//! Tensor maps (CUDA's `CUtensorMap`) of a layer's K/V buffers: the bulk-copy decode kernels copy
//! their tiles through them (`cp.async.bulk.tensor`), landing in shared memory with the 128-byte
//! swizzle (`kernels-gpu/src/decode/tiles.rs`).
//!
//! Each buffer is seen as a 3-D tensor of 16-bit elements, innermost first
//! (`lserve_abi::decode::{pool_tensor_dims, stream_tensor_dims}`): a row of `head_dim` elements,
//! the rows of one block (a page of one head, or a slot's streaming rows of one head), the blocks.
//! A copy box is [`DECODE_BOX_COLUMNS`] elements (128 bytes) by [`DECODE_TILE_ROWS`] rows of one
//! block. The maps are encoded once, when the cache is built, and live in one device buffer per
//! layer beside the buffers they describe.

use std::sync::Arc;

use cudarc::driver::sys::{
    cuTensorMapEncodeTiled, cudaError_enum, CUtensorMap, CUtensorMapDataType,
    CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use lserve_abi::decode::{
    pool_tensor_dims, stream_tensor_dims, DECODE_BOX_COLUMNS, DECODE_TENSOR_MAPS, DECODE_TILE_ROWS,
    TENSOR_MAP_BYTES,
};
use lserve_abi::prefill::{BLOCK_KV, WGMMA_BOX_COLUMNS};
use lserve_abi::{PagedLayout, StreamingLayout};

use crate::{LserveError, Result};

/// The encoded map of the 16-bit tensor at `ptr` with dimensions `dims` (innermost first,
/// densely packed), or all zeros for a tensor with no elements (a layer without dense or
/// without streaming heads: no pair ever copies from it).
fn encode(ptr: u64, dims: [u64; 3]) -> Result<[u8; TENSOR_MAP_BYTES]> {
    let strides = [dims[0] * 2, dims[0] * dims[1] * 2];
    encode_boxes(
        ptr,
        dims,
        strides,
        [DECODE_BOX_COLUMNS, DECODE_TILE_ROWS, 1],
    )
}

/// The map of a prefill tensor at `ptr` (`q`, `k` or `v`): `rows` token rows of `heads` heads of
/// `head_dim` 16-bit elements, rows `token_stride` elements apart, seen as `(head_dim, heads,
/// rows)` with boxes of 64 columns, one head and 64 rows (`lserve_abi::prefill::WgmmaPrefillArgs`).
pub(crate) fn prefill_tensor_map(
    ptr: u64,
    head_dim: usize,
    heads: usize,
    rows: usize,
    token_stride: usize,
) -> Result<[u8; TENSOR_MAP_BYTES]> {
    let dims = [head_dim as u64, heads as u64, rows as u64];
    let strides = [head_dim as u64 * 2, token_stride as u64 * 2];
    encode_boxes(ptr, dims, strides, [WGMMA_BOX_COLUMNS, 1, BLOCK_KV])
}

/// The map of the tensor at `ptr` with dimensions `dims` and byte strides `strides` of its outer
/// two dimensions, copied in boxes `boxes` with the 128-byte swizzle, or all zeros for a tensor
/// with no elements (a layer without dense or without streaming heads: no pair ever copies from
/// it).
fn encode_boxes(
    ptr: u64,
    dims: [u64; 3],
    strides: [u64; 2],
    boxes: [u32; 3],
) -> Result<[u8; TENSOR_MAP_BYTES]> {
    if dims.contains(&0) {
        return Ok([0; TENSOR_MAP_BYTES]);
    }
    let element_strides = [1u32; 3];
    let mut map = CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer argument points to a live array of the length the rank (3) asks
    // for (strides: rank - 1); `map` is writable. The call only encodes the description; it
    // does not touch device memory.
    let status = unsafe {
        cuTensorMapEncodeTiled(
            &mut map,
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            3,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if status != cudaError_enum::CUDA_SUCCESS {
        return Err(LserveError::InvalidArgument {
            what: "tensor",
            reason: format!(
                "the driver cannot describe it as a tensor map ({status:?}; dims {dims:?})"
            ),
        });
    }
    Ok(bytemuck::cast(map.opaque))
}

/// The layer's [`DECODE_TENSOR_MAPS`] tensor maps (pool K, pool V, streaming K, streaming V),
/// in one new device buffer.
pub(crate) fn layer_tensor_maps<E>(
    stream: &Arc<CudaStream>,
    paged: &PagedLayout,
    streaming: &StreamingLayout,
    k_pool: &CudaSlice<E>,
    v_pool: &CudaSlice<E>,
    k_stream: &CudaSlice<E>,
    v_stream: &CudaSlice<E>,
) -> Result<CudaSlice<u8>> {
    let (pool, stored) = (pool_tensor_dims(paged), stream_tensor_dims(streaming));
    let mut bytes = Vec::with_capacity(DECODE_TENSOR_MAPS * TENSOR_MAP_BYTES);
    for (buffer, dims) in [
        (k_pool, pool),
        (v_pool, pool),
        (k_stream, stored),
        (v_stream, stored),
    ] {
        let (ptr, _sync) = buffer.device_ptr(stream);
        bytes.extend_from_slice(&encode(ptr, dims)?);
    }
    Ok(stream.clone_htod(&bytes)?)
}
