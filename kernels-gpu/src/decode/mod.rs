//! Paged sparse decode attention (flash-decoding over index tables).
//!
//! Grid `(splits, batch * kv_heads)`, 128 threads. Block `(s, y)` serves KV head `y % kv_heads`
//! of sequence `y / kv_heads` — all `G` query heads of the group, so every K/V row is loaded once —
//! over split `s` of that pair's tiles ([`rows::RowSource`]). Tiles of 16 rows stream through a
//! 4-stage `cp.async` ring in shared memory. In a tile, each row is read by a *row group* of
//! `D / 8` lanes (8 elements, 16 bytes per lane); the row's score for each query head is a
//! row-group shuffle reduction, and each row group keeps its own online softmax state
//! ([`online_softmax::SoftmaxState`]). At the end the row groups merge (shuffles, then shared
//! memory across warps) and the block writes one partial state per query head; [`combine`]
//! merges the splits into the output.

pub mod combine;
pub mod online_softmax;
pub mod rows;

use lserve_abi::decode::{DecodeParams, DECODE_STAGES, DECODE_THREADS, DECODE_TILE_ROWS};

use crate::convert::{Bf16, Half16, F16};
use crate::cp_async::{commit_group, cp_async_16, wait_all, wait_group};
use crate::math::Vec16;
use crate::smem::{dynamic_smem, shared_addr};
use crate::sync::sync_threads;
use crate::thread::{block_idx_x, block_idx_y, lane, thread_in_block, warp_in_block, WARP_SIZE};
use crate::unroll8;
use crate::warp::{group_sum_f32, shfl_xor_f32};
use online_softmax::SoftmaxState;
use rows::{CacheBuffers, RowSource};

const WARPS: u32 = DECODE_THREADS / WARP_SIZE;
/// The most rows of a tile one row group reads (D 128: 2).
const MAX_ROWS_PER_THREAD: usize = 2;

/// How a head dimension `D` maps onto lanes: each lane owns 8 consecutive elements of a row.
struct RowGeometry<const D: usize>;

impl<const D: usize> RowGeometry<D> {
    /// Lanes reading one row (a row group).
    const LANES_PER_ROW: u32 = (D / 8) as u32;
    /// Rows a warp reads at once.
    const ROWS_PER_WARP: u32 = WARP_SIZE / Self::LANES_PER_ROW;
    /// Rows the block reads at once.
    const ROWS_PER_STEP: u32 = Self::ROWS_PER_WARP * WARPS;
    /// Rows of a tile one row group reads (1 at D 64, 2 at D 128).
    const ROWS_PER_THREAD: u32 = DECODE_TILE_ROWS / Self::ROWS_PER_STEP;
    /// Bytes of one K (or V) tile in shared memory.
    const TILE_BYTES: u32 = DECODE_TILE_ROWS * D as u32 * 2;
    /// 16-byte chunks of one tile.
    const TILE_CHUNKS: u32 = Self::TILE_BYTES / 16;
}

/// Issues the `cp.async` copies of tile `t`, at element offset `offset`, into stage `stage`
/// (rows past the tile's end are not copied: they are never read).
///
/// # Safety
/// `t < src.tiles()`, `offset == src.tile_offset(p, t)`; the shared memory holds
/// `DECODE_STAGES` K and V tiles.
#[inline(always)]
unsafe fn load_tile<const D: usize>(src: &RowSource, t: u32, offset: usize, stage: u32) {
    let rows = src.tile_rows(t);
    // SAFETY: forwarded.
    let (k, v) = unsafe { src.tile_at(offset) };
    let k_stage = shared_addr(dynamic_smem::<u8>(
        (stage * 2 * RowGeometry::<D>::TILE_BYTES) as usize,
    ));
    let v_stage = k_stage + RowGeometry::<D>::TILE_BYTES;
    let chunks_per_row = (D / 8) as u32;
    let mut c = thread_in_block();
    while c < RowGeometry::<D>::TILE_CHUNKS {
        let row = c / chunks_per_row;
        if row < rows {
            let elem = (c * 8) as usize; // rows are contiguous inside a tile
                                         // SAFETY: `row < rows` keeps the source inside the tile's existing rows; the stage
                                         // has room for the whole tile.
            unsafe {
                cp_async_16(k_stage + c * 16, k.add(elem) as *const u8);
                cp_async_16(v_stage + c * 16, v.add(elem) as *const u8);
            }
        }
        c += DECODE_THREADS;
    }
}

/// Merges the row groups' states of a warp (row groups of `lanes` lanes) into every lane.
///
/// # Safety
/// All 32 lanes call it.
#[inline(always)]
unsafe fn merge_row_groups<const G: usize>(state: &mut [SoftmaxState; G], lanes: u32) {
    let mut offset = lanes;
    while offset < WARP_SIZE {
        unroll8!(g in 0..G => {
            let s = &mut state[g];
            // SAFETY (all shuffles): the whole warp participates.
            let mut other = SoftmaxState {
                m: unsafe { shfl_xor_f32(s.m, offset) },
                l: unsafe { shfl_xor_f32(s.l, offset) },
                acc: [0.0; 8],
            };
            let mut i = 0;
            while i < 8 {
                other.acc[i] = unsafe { shfl_xor_f32(s.acc[i], offset) };
                i += 1;
            }
            s.merge(&other);
        });
        offset <<= 1;
    }
}

/// The kernel body, generic over element type `E`, head dimension `D` and group size `G`.
///
/// # Safety
/// Launched with grid `(p.splits, p.batch * p.kv_heads)`, `DECODE_THREADS` threads and
/// `decode_smem_bytes(D)` bytes of dynamic shared memory; every pointer holds the layout the
/// host-side launcher documents.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn decode_attention<E: Half16, const D: usize, const G: usize>(
    p: &DecodeParams,
    q: *const u16,
    bufs: &CacheBuffers,
    seq_len: *const u32,
    seq_slot: *const u32,
    head_map: *const u32,
    part_acc: *mut f32,
    part_ml: *mut f32,
) {
    let lanes_per_row = RowGeometry::<D>::LANES_PER_ROW;
    let split = block_idx_x();
    let pair = block_idx_y();
    let (b, kv_head) = (pair / p.kv_heads, pair % p.kv_heads);
    // SAFETY: `b < batch`, `kv_head < kv_heads` by the grid.
    let (len, slot, entry) = unsafe {
        (
            *seq_len.add(b as usize),
            *seq_slot.add(b as usize),
            *head_map.add(kv_head as usize),
        )
    };
    // SAFETY: the host validated slot, lengths and tables.
    let src = unsafe { RowSource::new(p, bufs, entry, slot, len) };

    // This block's run of tiles.
    let tiles = src.tiles();
    let per_split = tiles.div_ceil(p.splits);
    let first = split * per_split;
    let end = if first + per_split < tiles {
        first + per_split
    } else {
        tiles
    };
    let count = end.saturating_sub(first);

    // The query heads of the group, this lane's 8 dimensions, pre-scaled into log2 units.
    let col = lane() % lanes_per_row;
    let mut qf = [[0.0f32; 8]; G];
    unroll8!(g in 0..G => {
        let q_head = (b * p.kv_heads + kv_head) * G as u32 + g as u32;
        // SAFETY: `q` is `[batch][q_heads][D]`, 16-byte aligned rows.
        let raw = unsafe { *(q.add(q_head as usize * D + col as usize * 8) as *const Vec16) };
        let x = raw.to_f32::<E>();
        let mut i = 0;
        while i < 8 {
            qf[g][i] = x[i] * p.scale_log2;
            i += 1;
        }
    });

    let mut state = [SoftmaxState::EMPTY; G];

    // Prologue: the first STAGES - 1 tiles in flight.
    let mut s = 0;
    while s < DECODE_STAGES - 1 {
        if s < count {
            // SAFETY: `first + s < end <= tiles`.
            unsafe { load_tile::<D>(&src, first + s, src.tile_offset(p, first + s), s) };
        }
        commit_group();
        s += 1;
    }
    // Where the next tile to issue lives, looked up one step ahead: a dense head's page-list
    // read then overlaps a tile's compute instead of stalling the copy issue.
    let mut next_offset = 0;
    if DECODE_STAGES - 1 < count {
        // SAFETY: `first + STAGES - 1 < end`.
        next_offset = unsafe { src.tile_offset(p, first + DECODE_STAGES - 1) };
    }

    let row_in_step = warp_in_block() * RowGeometry::<D>::ROWS_PER_WARP + lane() / lanes_per_row;
    let mut i = 0;
    while i < count {
        wait_group::<{ DECODE_STAGES - 2 }>();
        // SAFETY: uniform control flow: `count` is block-uniform.
        unsafe { sync_threads() };
        let next = i + DECODE_STAGES - 1;
        if next < count {
            // SAFETY: `first + next < end`, `next_offset` is its offset; its stage was last read
            // in step `i - 1`, which every thread finished before the barrier above.
            unsafe { load_tile::<D>(&src, first + next, next_offset, next % DECODE_STAGES) };
        }
        commit_group();
        if next + 1 < count {
            // SAFETY: `first + next + 1 < end`.
            next_offset = unsafe { src.tile_offset(p, first + next + 1) };
        }

        let stage = i % DECODE_STAGES;
        let k_tile = dynamic_smem::<u16>((stage * 2 * RowGeometry::<D>::TILE_BYTES) as usize);
        let v_tile = dynamic_smem::<u16>(((stage * 2 + 1) * RowGeometry::<D>::TILE_BYTES) as usize);
        let rows = src.tile_rows(first + i);
        // A row group reads `ROWS_PER_THREAD` rows of the tile: their scores first, then one
        // rescale per query head for all of them, then the values.
        let mut scores = [[f32::NEG_INFINITY; MAX_ROWS_PER_THREAD]; G];
        unroll8!(r in 0..RowGeometry::<D>::ROWS_PER_THREAD as usize => {
            let row = r as u32 * RowGeometry::<D>::ROWS_PER_STEP + row_in_step;
            // SAFETY: `row < DECODE_TILE_ROWS`: inside the stage. Rows past `rows` hold stale
            // data; their scores are computed (the shuffles need every lane) but never used.
            let k = unsafe { *(k_tile.add(row as usize * D + col as usize * 8) as *const Vec16) }
                .to_f32::<E>();
            unroll8!(g in 0..G => {
                let mut dot = 0.0f32;
                let mut d = 0;
                while d < 8 {
                    dot += qf[g][d] * k[d];
                    d += 1;
                }
                // SAFETY: every lane of the warp reaches this reduction.
                let score = unsafe { group_sum_f32(dot, lanes_per_row) };
                if row < rows {
                    scores[g][r] = score;
                }
            });
        });
        unroll8!(g in 0..G => {
            let mut m = f32::NEG_INFINITY;
            unroll8!(r in 0..RowGeometry::<D>::ROWS_PER_THREAD as usize => {
                m = m.max(scores[g][r]);
            });
            state[g].raise_max(m);
        });
        unroll8!(r in 0..RowGeometry::<D>::ROWS_PER_THREAD as usize => {
            let row = r as u32 * RowGeometry::<D>::ROWS_PER_STEP + row_in_step;
            if row < rows {
                // SAFETY: as for `k`.
                let v = unsafe { *(v_tile.add(row as usize * D + col as usize * 8) as *const Vec16) }
                    .to_f32::<E>();
                unroll8!(g in 0..G => {
                    state[g].add(scores[g][r], &v);
                });
            }
        });
        i += 1;
    }

    // Merge: row groups inside each warp, then warps through shared memory (the tile ring is
    // free once every copy has landed and every thread is past its last read).
    // SAFETY: all lanes of every warp are here (the loop bounds are block-uniform).
    unsafe { merge_row_groups(&mut state, lanes_per_row) };
    wait_all();
    // SAFETY: block-uniform.
    unsafe { sync_threads() };
    let warp = warp_in_block();
    let merge_area = dynamic_smem::<f32>(0);
    // Per warp: G × (m, l, acc[D]).
    let per_warp = G * (2 + D);
    if lane() < lanes_per_row {
        unroll8!(g in 0..G => {
            let base = warp as usize * per_warp + g * (2 + D);
            // SAFETY: inside the ring (decode_smem_bytes(D) ≥ WARPS × G × (2 + D) × 4 for G ≤ 8).
            unsafe {
                if col == 0 {
                    *merge_area.add(base) = state[g].m;
                    *merge_area.add(base + 1) = state[g].l;
                }
                let mut d = 0;
                while d < 8 {
                    *merge_area.add(base + 2 + col as usize * 8 + d) = state[g].acc[d];
                    d += 1;
                }
            }
        });
    }
    // SAFETY: block-uniform.
    unsafe { sync_threads() };
    if warp == 0 && lane() < lanes_per_row {
        unroll8!(g in 0..G => {
            let mut total = SoftmaxState::EMPTY;
            let mut w = 0;
            while w < WARPS as usize {
                let base = w * per_warp + g * (2 + D);
                // SAFETY: written above, after the barrier.
                let other = unsafe {
                    let mut acc = [0.0f32; 8];
                    let mut d = 0;
                    while d < 8 {
                        acc[d] = *merge_area.add(base + 2 + col as usize * 8 + d);
                        d += 1;
                    }
                    SoftmaxState {
                        m: *merge_area.add(base),
                        l: *merge_area.add(base + 1),
                        acc,
                    }
                };
                total.merge(&other);
                w += 1;
            }
            let out = ((pair * p.splits + split) as usize) * G + g;
            // SAFETY: `part_acc` is `[pairs][splits][G][D]`, `part_ml` `[pairs][splits][G][2]`.
            unsafe {
                let mut d = 0;
                while d < 8 {
                    *part_acc.add(out * D + col as usize * 8 + d) = total.acc[d];
                    d += 1;
                }
                if col == 0 {
                    *part_ml.add(out * 2) = total.m;
                    *part_ml.add(out * 2 + 1) = total.l;
                }
            }
        });
    }
}

/// Declares one `extern "gpu-kernel"` entry point per (element type, head dim, group size).
macro_rules! decode_kernels {
    ($($name:ident: $elem:ty, $d:literal, $g:literal;)*) => {$(
        /// Decode attention entry point (see the module docs); pointers as `decode_attention`.
        ///
        /// # Safety
        /// As [`decode_attention`]'s: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "gpu-kernel" fn $name(
            p: DecodeParams,
            q: *const u16,
            k_pool: *const u16,
            v_pool: *const u16,
            k_stream: *const u16,
            v_stream: *const u16,
            block_tables: *const u32,
            index_tables: *const u32,
            index_lens: *const u32,
            seq_len: *const u32,
            seq_slot: *const u32,
            head_map: *const u32,
            part_acc: *mut f32,
            part_ml: *mut f32,
        ) {
            let bufs = CacheBuffers { k_pool, v_pool, k_stream, v_stream, block_tables, index_tables, index_lens };
            // SAFETY: forwarded launch contract.
            unsafe {
                decode_attention::<$elem, $d, $g>(&p, q, &bufs, seq_len, seq_slot, head_map, part_acc, part_ml)
            }
        }
    )*};
}

decode_kernels! {
    decode_attention_bf16_d64_g1: Bf16, 64, 1;
    decode_attention_bf16_d64_g2: Bf16, 64, 2;
    decode_attention_bf16_d64_g4: Bf16, 64, 4;
    decode_attention_bf16_d64_g8: Bf16, 64, 8;
    decode_attention_bf16_d128_g1: Bf16, 128, 1;
    decode_attention_bf16_d128_g2: Bf16, 128, 2;
    decode_attention_bf16_d128_g4: Bf16, 128, 4;
    decode_attention_bf16_d128_g8: Bf16, 128, 8;
    decode_attention_f16_d64_g1: F16, 64, 1;
    decode_attention_f16_d64_g2: F16, 64, 2;
    decode_attention_f16_d64_g4: F16, 64, 4;
    decode_attention_f16_d64_g8: F16, 64, 8;
    decode_attention_f16_d128_g1: F16, 128, 1;
    decode_attention_f16_d128_g2: F16, 128, 2;
    decode_attention_f16_d128_g4: F16, 128, 4;
    decode_attention_f16_d128_g8: F16, 128, 8;
}
