//! Paged sparse decode attention on the device: one launch for every (sequence, KV head) pair of
//! a layer, then a combine of the splits (`kernels-gpu/src/decode`).

use cudarc::driver::{CudaSlice, LaunchConfig};
use lserve_abi::decode::{
    combine_smem_bytes, decode_smem_bytes, CombineParams, DecodeParams, COMBINE_THREADS,
    DECODE_BLOCKS_PER_SM, DECODE_THREADS, DECODE_TILE_ROWS,
};

use super::cache::{DecodeBatch, DeviceElement, DeviceKvCache};
use super::launch::{grouped_kernel_name, ByValue, OverlappedLaunch};
use super::GpuContext;
use crate::dtype::DType;
use crate::{LserveError, Result};

/// Scratch for the split partial states, sized once for the largest batch.
pub struct DecodeWorkspace {
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    max_pairs: usize,
    max_splits: u32,
    group: usize,
    head_dim: usize,
}

pub use lserve_abi::decode::MAX_SPLITS;

impl DecodeWorkspace {
    /// Room for batches of up to `max_batch` sequences of a model with `kv_heads`, `group` and
    /// `head_dim`.
    pub fn new(
        gpu: &GpuContext,
        max_batch: usize,
        kv_heads: usize,
        group: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let max_pairs = max_batch * kv_heads;
        if max_pairs == 0 {
            return Err(LserveError::Empty("batch"));
        }
        let states = max_pairs * MAX_SPLITS as usize * group;
        Ok(Self {
            part_acc: gpu.stream().alloc_zeros(states * head_dim)?,
            part_ml: gpu.stream().alloc_zeros(states * 2)?,
            max_pairs,
            max_splits: MAX_SPLITS,
            group,
            head_dim,
        })
    }

    /// At most `max_splits` splits per (sequence, KV head) in launches with this workspace
    /// (default [`MAX_SPLITS`]): fewer, longer splits trade parallelism for less combine work.
    ///
    /// Errors: `InvalidArgument` unless `1 <= max_splits <= MAX_SPLITS`.
    ///
    /// ```no_run
    /// use lserve::gpu::{DecodeWorkspace, GpuContext};
    /// let gpu = GpuContext::new(0)?;
    /// let ws = DecodeWorkspace::new(&gpu, 1, 8, 4, 128)?.with_max_splits(16)?;
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn with_max_splits(mut self, max_splits: u32) -> Result<Self> {
        if !(1..=MAX_SPLITS).contains(&max_splits) {
            return Err(LserveError::InvalidArgument {
                what: "max_splits",
                reason: format!("{max_splits}: expected 1 to {MAX_SPLITS}"),
            });
        }
        self.max_splits = max_splits;
        Ok(self)
    }
}

/// How many splits a launch uses: one wave of blocks of the `heavy_pairs` long pairs (the dense
/// heads; streaming heads have a few hundred rows) at [`DECODE_BLOCKS_PER_SM`] resident blocks per
/// SM — rounded down, so a launch is never a full wave plus a small tail — but no split shorter
/// than [`MIN_SPLIT_TILES`] tiles of the longest pair.
fn choose_splits(sm_count: u32, heavy_pairs: u32, max_rows: u32, max_splits: u32) -> u32 {
    let fill = (DECODE_BLOCKS_PER_SM * sm_count) / heavy_pairs.max(1);
    let by_length = max_rows.div_ceil(MIN_SPLIT_TILES * DECODE_TILE_ROWS).max(1);
    fill.min(by_length).clamp(1, max_splits)
}

/// The shortest split worth its partial state: two tiles per warp.
const MIN_SPLIT_TILES: u32 = 8;

/// Splits of at least this many tiles per warp read their tiles with bulk copies.
///
/// Measured A/B, one device run (H200, 2026-11-29, `benches/decode.rs`, every launch with bulk
/// copies against every launch with `cp.async`): dense b16 256K −3.6% (2048 tiles per warp),
/// b16 128K −3.9%, b1 256K −3.3% (62 tiles per warp); but the LServe step +10% at b16 256K
/// (sparse pairs at ~17 tiles per warp, streaming heads at 1-2) and +1.4% at b1 (2 per warp):
/// a bulk-copied tile arrives later (32 copies issued one by one, an `mbarrier` round trip), which
/// only a long stream of tiles hides. The line sits between the measured sides.
const BULK_MIN_TILES_PER_WARP: u32 = 24;

/// Whether a launch whose longest pair visits `max_rows` rows in `splits` splits uses the bulk-copy
/// kernel.
fn uses_bulk_copies(max_rows: u32, splits: u32) -> bool {
    let warp_rows = DECODE_TILE_ROWS * (DECODE_THREADS / 32);
    max_rows.div_ceil(splits.max(1)).div_ceil(warp_rows) >= BULK_MIN_TILES_PER_WARP
}

fn kernel_name(dtype: DType, head_dim: usize, group: usize, bulk: bool) -> Result<String> {
    let prefix = if bulk {
        "decode_attention_bulk"
    } else {
        "decode_attention"
    };
    grouped_kernel_name(prefix, "decode kernel", dtype, head_dim, group)
}

/// Decode attention of one layer for `batch`: `q [B][Hq][D]` -> `out [B][Hq][D]`.
///
/// Streaming heads attend to their sink and ring rows; dense heads to every page of the block
/// table while the sequence is at most `dynamic_min_len` long, else to the pages in their index
/// table (which must hold the newest page last, as selection writes it). Enqueued on the
/// context's stream; allocates nothing and does not synchronize.
pub fn decode_attention<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &DeviceKvCache<E>,
    layer: usize,
    batch: &DecodeBatch,
    q: &CudaSlice<E>,
    out: &mut CudaSlice<E>,
    ws: &mut DecodeWorkspace,
) -> Result<()> {
    let geometry = *cache.pattern().geometry();
    let (hq, hkv, d, group) = (
        geometry.q_heads(),
        geometry.kv_heads(),
        geometry.head_dim(),
        geometry.group(),
    );
    cache.check_batch(batch)?;
    let b = batch.len();
    for (what, buf) in [("q", q.len()), ("out", out.len())] {
        if buf < b * hq * d {
            return Err(LserveError::ShapeMismatch {
                what,
                expected: b * hq * d,
                actual: buf,
            });
        }
    }
    let pairs = b * hkv;
    if pairs > ws.max_pairs || ws.group != group || ws.head_dim != d {
        return Err(LserveError::InvalidArgument {
            what: "workspace",
            reason: "sized for a smaller batch or another geometry".into(),
        });
    }
    let l = cache.layer(layer)?;
    let cfg_min_len = cache.dynamic_min_len;
    // The most rows any pair of the batch visits: a dense head's whole sequence up to
    // `dynamic_min_len`, at most a selection's pages above it (the K selected, the first, and the
    // newest at selection time and now: the index table's content, whatever its capacity).
    let page_tokens = l.paged.page_tokens;
    let selected_rows = cache.config.selection_entry_pages() as u32 * page_tokens;
    let max_rows = batch
        .host_lens
        .iter()
        .map(|&len| {
            if len <= cfg_min_len {
                len
            } else {
                len.min(selected_rows)
            }
        })
        .max()
        .unwrap_or(1)
        .max(l.streaming.rows());
    let dense_heads = l.paged.heads as usize;
    let heavy_pairs = b * if dense_heads > 0 { dense_heads } else { hkv };
    let splits = choose_splits(gpu.sm_count(), heavy_pairs as u32, max_rows, ws.max_splits);

    let params = ByValue(DecodeParams {
        batch: b as u32,
        kv_heads: hkv as u32,
        splits,
        max_pages: cache.max_pages,
        max_selected: cache.entry_capacity,
        dynamic_min_len: cfg_min_len,
        scale_log2: cache.softmax_scale * std::f32::consts::LOG2_E,
        paged: l.paged,
        streaming: l.streaming,
    });
    let name = kernel_name(E::DTYPE, d, group, uses_bulk_copies(max_rows, splits))?;
    let smem = decode_smem_bytes(d as u32);
    let f = gpu.function_with_smem(&name, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (splits, pairs as u32, 1),
        block_dim: (DECODE_THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    let stream = gpu.stream();
    let mut launch = OverlappedLaunch::new(stream, &f);
    launch
        .value(&params)
        .buf(q)
        .buf(&l.k_pool)
        .buf(&l.v_pool)
        .buf(&l.k_stream)
        .buf(&l.v_stream)
        .buf(&cache.block_tables)
        .buf(&l.index_pages)
        .buf(&l.index_lens)
        .buf(&batch.seq_len)
        .buf(&batch.seq_slot)
        .buf(&l.head_map)
        .buf_mut(&mut ws.part_acc)
        .buf_mut(&mut ws.part_ml);
    // SAFETY: the argument list matches the kernel's signature (kernels-gpu/src/decode/mod.rs):
    // `DecodeParams` by value, then the buffers in order. The grid is `(splits, B * Hkv)` with
    // `splits <= MAX_SPLITS` and `B * Hkv <= ws.max_pairs`, so partial states stay inside the
    // workspace; the cache's buffers have the layouts in `params` (built from them), `batch`
    // holds slots and lengths checked against this cache (`check_batch`), and the tables hold
    // page ids below the pool's capacity (the manager and the selection kernels write only those).
    // Overlapped: the kernel waits for the previous one (`overlapped_entry`) before touching
    // anything a kernel writes.
    unsafe { launch.launch(cfg) }?;

    let combine = ByValue(CombineParams {
        batch: b as u32,
        q_heads: hq as u32,
        group: group as u32,
        head_dim: d as u32,
        splits,
    });
    let f = gpu.function(match E::DTYPE {
        DType::BF16 => "decode_combine_bf16",
        DType::F16 => "decode_combine_f16",
    })?;
    let cfg = LaunchConfig {
        grid_dim: ((b * hq) as u32, 1, 1),
        block_dim: (COMBINE_THREADS, 1, 1),
        shared_mem_bytes: combine_smem_bytes(),
    };
    let mut launch = OverlappedLaunch::new(stream, &f);
    launch
        .value(&combine)
        .buf(&ws.part_acc)
        .buf(&ws.part_ml)
        .buf_mut(out);
    // SAFETY: matches `decode_combine_*(CombineParams, *const f32, *const f32, *mut u16)`; the
    // partial states were written for this batch and split count just above, on this stream;
    // `out` holds at least `B * Hq * D` elements (checked).
    // Overlapped: the kernel waits for the previous one (`overlapped_entry`) before touching
    // anything a kernel writes.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_the_gpu_from_the_dense_pairs_but_keep_splits_long() {
        // 132 SMs at 2 blocks each, 4 dense pairs (batch 1, half of 8 KV heads dense), 256K
        // rows: one full wave.
        assert_eq!(choose_splits(132, 4, 262_144, MAX_SPLITS), 66);
        // 128 dense pairs (batch 16): two splits make one wave (264 slots, 256 blocks), where
        // rounding up would make a wave and a half.
        assert_eq!(choose_splits(132, 128, 262_144, MAX_SPLITS), 2);
        // Fewer pairs would want more splits than allowed.
        assert_eq!(choose_splits(132, 1, 262_144, MAX_SPLITS), MAX_SPLITS);
        // A short sequence: at least 8 tiles (128 rows) per split.
        assert_eq!(choose_splits(132, 4, 4160, MAX_SPLITS), 33);
        // Many pairs: one split each at least.
        assert_eq!(choose_splits(132, 10_000, 262_144, MAX_SPLITS), 1);
        assert_eq!(choose_splits(132, 4, 1, MAX_SPLITS), 1);
    }

    #[test]
    fn long_splits_use_bulk_copies() {
        // Dense b16 256K: 2 splits of 131072 rows, 2048 tiles per warp.
        assert!(uses_bulk_copies(262_144, 2));
        // Dense b1 256K: 66 splits, 62 tiles per warp.
        assert!(uses_bulk_copies(262_144, 66));
        // LServe at b16: a selection's ~4.3K rows in 4 splits, 17 tiles per warp.
        assert!(!uses_bulk_copies(67 * 64, 4));
        // LServe at b1: 34 splits, 2 tiles per warp.
        assert!(!uses_bulk_copies(67 * 64, 34));
        assert!(!uses_bulk_copies(1, 0));
    }

    #[test]
    fn unsupported_shapes_are_typed_errors() {
        assert!(kernel_name(DType::BF16, 128, 4, false)
            .is_ok_and(|n| n == "decode_attention_bf16_d128_g4"));
        assert!(kernel_name(DType::BF16, 128, 4, true)
            .is_ok_and(|n| n == "decode_attention_bulk_bf16_d128_g4"));
        assert!(matches!(
            kernel_name(DType::F16, 256, 4, false),
            Err(LserveError::InvalidArgument {
                what: "head_dim",
                ..
            })
        ));
        assert!(matches!(
            kernel_name(DType::F16, 64, 3, true),
            Err(LserveError::InvalidArgument { what: "group", .. })
        ));
    }
}
