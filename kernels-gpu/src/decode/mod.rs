//! Paged sparse decode attention (flash-decoding over index tables, on the tensor cores).
//!
//! Grid `(splits, batch * kv_heads)`, 128 threads (4 warps). Block `(s, y)` serves KV head
//! `y % kv_heads` of sequence `y / kv_heads` — all `G` query heads of the group, so every K/V row
//! is loaded once — over split `s` of that pair's tiles of 16 rows ([`rows::RowSource`]). Inside
//! the block, warp `w` takes every fourth tile of the split (`w, w + 4, ...`) and streams them
//! through its own [`DECODE_STAGES`]-stage ring (no block barrier in the loop), filled by
//! `cp.async` (`decode_attention_*`) or by bulk copies (`decode_attention_bulk_*`, for long
//! splits; [`tiles::TileCopy`]). Per tile it computes `S = Q Kᵀ` and `O += P V` with `mma.sync`
//! m16n8k16, the group's query heads being the rows of the products ([`tiles`]), with an online
//! softmax per head in registers ([`online_softmax`]). At the end the warps' states merge through
//! shared memory and the block writes one partial state per query head; [`combine`] merges the
//! splits into the output.

pub mod combine;
pub mod online_softmax;
pub mod rows;
pub mod tiles;

use lserve_abi::decode::{DecodeParams, DECODE_STAGES};

use crate::convert::{Bf16, F16};
use crate::math::fma;
use crate::mma::{mma_m16n8k16, FragC, MmaElement};
use crate::smem::dynamic_smem;
use crate::sync::{sync_threads, sync_warp};
use crate::thread::{block_idx_x, block_idx_y, lane, thread_in_block, warp_in_block};
use crate::warp::quad_sum_f32;
use online_softmax::{merge_weight, HeadSoftmax};
use rows::{CacheBuffers, RowSource};
use tiles::{
    load_k_fragments, load_q_fragments, load_v_fragments, p_fragment, AsyncCopy, BulkCopy, Tile,
    TileCopy, MAX_O_TILES, WARPS,
};

/// One warp's pass over its tiles: the softmax state of its lane's query head and the
/// unnormalized output accumulators (rows `lane / 4`, see [`tiles`]).
struct WarpState {
    softmax: HeadSoftmax,
    o: [FragC; MAX_O_TILES],
}

/// Runs warp `warp`'s share of the block's tiles `first..first + count`: tiles
/// `first + warp + WARPS * j`, each through a stage of the warp's ring.
///
/// # Safety
/// All 32 lanes of the warp call it; `first + count <= src.tiles()`; the warp's stages are free.
#[inline(always)]
unsafe fn attend_tiles<E: MmaElement, const D: usize, const G: usize, C: TileCopy>(
    p: &DecodeParams,
    src: &RowSource,
    q_group: *const u16,
    first: u32,
    count: u32,
    warp: u32,
) -> WarpState {
    let lane = lane();
    let mut state = WarpState {
        softmax: HeadSoftmax::EMPTY,
        o: [FragC::default(); MAX_O_TILES],
    };
    let mine = if count > warp {
        (count - warp).div_ceil(WARPS)
    } else {
        0
    };
    if mine == 0 {
        return state;
    }
    let tile = |j: u32| first + warp + j * WARPS;
    // SAFETY: `q_group` holds the group's `G x D` query elements (the caller's layout).
    let q = unsafe { load_q_fragments::<E, D, G>(q_group, lane) };
    // SAFETY: the whole warp is here (`mine` is warp-uniform), before any issue.
    unsafe { C::start::<D>(warp, lane) };
    // Issues tile `j` (at element offset `offset`) into its stage.
    let issue = |j: u32, offset: usize| {
        // SAFETY: `tile(j) < first + count <= tiles`, `offset` is its offset; the stage is free
        // (see the loop).
        unsafe {
            let (k, v) = src.tile_at(offset);
            C::issue::<D>(warp, j, k, v, src.tile_rows(tile(j)), lane);
        }
    };

    // Prologue: the first STAGES - 1 tiles in flight.
    let mut j = 0;
    while j < DECODE_STAGES - 1 {
        if j < mine {
            // SAFETY: `tile(j)` is one of this warp's tiles.
            issue(j, unsafe { src.tile_offset(p, tile(j)) });
        }
        C::commit();
        j += 1;
    }
    // Where the next tile to issue lives, looked up one step ahead: a dense head's page-list
    // read then overlaps a tile's compute instead of stalling the copy issue.
    let mut next_offset = 0;
    if DECODE_STAGES - 1 < mine {
        // SAFETY: as above.
        next_offset = unsafe { src.tile_offset(p, tile(DECODE_STAGES - 1)) };
    }

    let mut j = 0;
    while j < mine {
        // SAFETY: tile `j` was issued (`j < mine`) and committed, in ring order.
        unsafe { C::wait::<D>(warp, j) };
        // SAFETY: the whole warp is here (`mine` is warp-uniform). Tile `j`'s rows are visible to
        // each lane (the wait above); after the barrier every lane has finished reading the stage
        // of tile `j - 1`, which the next copy overwrites.
        unsafe { sync_warp() };
        let next = j + DECODE_STAGES - 1;
        if next < mine {
            issue(next, next_offset);
        }
        C::commit();
        if next + 1 < mine {
            // SAFETY: `tile(next + 1)` is one of this warp's tiles.
            next_offset = unsafe { src.tile_offset(p, tile(next + 1)) };
        }

        let k_tile = Tile::<D>::k_tile(warp, j % DECODE_STAGES);
        let v_tile = k_tile + Tile::<D>::BYTES;
        // S = Q Kᵀ for the tile's 16 keys.
        let mut s = [FragC::default(); 2];
        crate::unroll8!(kk in 0..Tile::<D>::D_STEPS => {
            // SAFETY: the tile arrived (wait + warp barrier above); the whole warp is here.
            unsafe {
                let [b0, b1] = load_k_fragments::<E, D>(k_tile, kk as u32, lane);
                s[0] = mma_m16n8k16(&q[kk], &b0, &s[0]);
                s[1] = mma_m16n8k16(&q[kk], &b1, &s[1]);
            }
        });
        // SAFETY: every lane is here; the tile has at least one row.
        let correction = unsafe {
            state
                .softmax
                .add_tile(&mut s, src.tile_rows(tile(j)), lane, p.scale_log2)
        };
        // O = correction · O + P V.
        let pf = p_fragment::<E>(&s);
        crate::unroll8!(pair in 0..Tile::<D>::O_TILES / 2 => {
            let o = &mut state.o;
            let mut c = 0;
            while c < 2 {
                o[2 * pair].regs[c] *= correction;
                o[2 * pair + 1].regs[c] *= correction;
                c += 1;
            }
            // SAFETY: as for K.
            unsafe {
                let [b0, b1] = load_v_fragments::<E, D>(v_tile, pair as u32, lane);
                o[2 * pair] = mma_m16n8k16(&pf, &b0, &o[2 * pair]);
                o[2 * pair + 1] = mma_m16n8k16(&pf, &b1, &o[2 * pair + 1]);
            }
        });
        j += 1;
    }
    state
}

/// The kernel body, generic over element type `E`, head dimension `D` and group size `G`.
///
/// # Safety
/// Launched with grid `(p.splits, p.batch * p.kv_heads)`, `DECODE_THREADS` threads and
/// `decode_smem_bytes(D)` bytes of dynamic shared memory; every pointer holds the layout the
/// host-side launcher documents; `seq_len`, `seq_slot`, `head_map` and the block tables are
/// written by host copies enqueued before the previous kernel (not by a kernel): they are read
/// before `overlapped_entry`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn decode_attention<E: MmaElement, const D: usize, const G: usize, C: TileCopy>(
    p: &DecodeParams,
    q: *const u16,
    bufs: &CacheBuffers,
    seq_len: *const u32,
    seq_slot: *const u32,
    head_map: *const u32,
    part_acc: *mut f32,
    part_ml: *mut f32,
) {
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
    // Overlapped with the kernel before (the append or the selector): the batch description
    // and the head map above are copies from the host, complete before that kernel started;
    // the index tables, the cache rows and `q` may be its outputs.
    // SAFETY: before this thread's first access of anything a kernel before it reads or writes
    // (everything above is host copies).
    unsafe { crate::sync::overlapped_entry() };
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

    let warp = warp_in_block();
    // SAFETY: `q` is `[batch][q_heads][D]` and pair `(b, kv_head)`'s query heads are the `G`
    // consecutive rows from `pair * G`; `first + count <= tiles`; the stages are unused so far.
    let state = unsafe {
        attend_tiles::<E, D, G, C>(p, &src, q.add(pair as usize * G * D), first, count, warp)
    };

    // Merge the warps through shared memory (the stage area, free once every copy has landed and
    // every warp is past its last read): per warp and head, `m`, `l` and `D` accumulators.
    C::finish();
    // SAFETY: block-uniform.
    unsafe { sync_threads() };
    let lane = lane();
    let area = dynamic_smem::<f32>(0);
    let slot_of = |w: u32, g: u32| ((w * G as u32 + g) * (D as u32 + 2)) as usize;
    // SAFETY: every lane of the warp is here (quad shuffle).
    let l = unsafe { quad_sum_f32(state.softmax.l) };
    let (g, quad) = (lane / 4, lane % 4);
    if g < G as u32 {
        let at = slot_of(warp, g);
        // SAFETY: inside the merge area (`decode_merge_bytes(D, G) <= decode_stage_bytes(D)`).
        unsafe {
            if quad == 0 {
                *area.add(at) = state.softmax.m;
                *area.add(at + 1) = l;
            }
            let mut n = 0;
            while n < Tile::<D>::O_TILES {
                let d = (8 * n as u32 + 2 * quad) as usize;
                *area.add(at + 2 + d) = state.o[n].regs[0];
                *area.add(at + 2 + d + 1) = state.o[n].regs[1];
                n += 1;
            }
        }
    }
    // SAFETY: block-uniform.
    unsafe { sync_threads() };
    // Thread `t` merges (head, dim) pairs `t, t + 128, ...` over the warps.
    let mut i = thread_in_block();
    while i < (G * D) as u32 {
        let (g, d) = (i / D as u32, (i % D as u32) as usize);
        // SAFETY (reads): written above, before the barrier.
        let m_of = |w: u32| unsafe { *area.add(slot_of(w, g)) };
        let mut m_all = f32::NEG_INFINITY;
        let mut w = 0;
        while w < WARPS {
            m_all = m_all.max(m_of(w));
            w += 1;
        }
        let (mut num, mut den) = (0.0f32, 0.0f32);
        let mut w = 0;
        while w < WARPS {
            let weight = merge_weight(m_of(w), m_all);
            // SAFETY: as above.
            unsafe {
                num = fma(weight, *area.add(slot_of(w, g) + 2 + d), num);
                den = fma(weight, *area.add(slot_of(w, g) + 1), den);
            }
            w += 1;
        }
        let out = ((pair * p.splits + split) as usize) * G + g as usize;
        // SAFETY: `part_acc` is `[pairs][splits][G][D]`, `part_ml` `[pairs][splits][G][2]`.
        unsafe {
            *part_acc.add(out * D + d) = num;
            if d == 0 {
                *part_ml.add(out * 2) = m_all;
                *part_ml.add(out * 2 + 1) = den;
            }
        }
        i += crate::thread::block_dim_x();
    }
}

/// Declares one `extern "gpu-kernel"` entry point `$name` for element type, head dim and group
/// size, with the tile copy `$copy`.
macro_rules! decode_kernel {
    ($copy:ty, $name:ident: $elem:ty, $d:literal, $g:literal) => {
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
            let bufs = CacheBuffers {
                k_pool,
                v_pool,
                k_stream,
                v_stream,
                block_tables,
                index_tables,
                index_lens,
            };
            // SAFETY: forwarded launch contract (the body waits for the kernel before).
            unsafe {
                decode_attention::<$elem, $d, $g, $copy>(
                    &p, q, &bufs, seq_len, seq_slot, head_map, part_acc, part_ml,
                )
            }
        }
    };
}

/// Declares, per (element type, head dim, group size), the entry point that fills its tiles by
/// `cp.async` (`$name`: short splits, i.e. the sparse and streaming heads and short sequences)
/// and the one that fills them by bulk copies (`$bulk`: long splits, the dense heads of long
/// sequences); the host picks per launch.
macro_rules! decode_kernels {
    ($($name:ident, $bulk:ident: $elem:ty, $d:literal, $g:literal;)*) => {$(
        decode_kernel!(AsyncCopy, $name: $elem, $d, $g);
        decode_kernel!(BulkCopy, $bulk: $elem, $d, $g);
    )*};
}

decode_kernels! {
    decode_attention_bf16_d64_g1, decode_attention_bulk_bf16_d64_g1: Bf16, 64, 1;
    decode_attention_bf16_d64_g2, decode_attention_bulk_bf16_d64_g2: Bf16, 64, 2;
    decode_attention_bf16_d64_g4, decode_attention_bulk_bf16_d64_g4: Bf16, 64, 4;
    decode_attention_bf16_d64_g8, decode_attention_bulk_bf16_d64_g8: Bf16, 64, 8;
    decode_attention_bf16_d128_g1, decode_attention_bulk_bf16_d128_g1: Bf16, 128, 1;
    decode_attention_bf16_d128_g2, decode_attention_bulk_bf16_d128_g2: Bf16, 128, 2;
    decode_attention_bf16_d128_g4, decode_attention_bulk_bf16_d128_g4: Bf16, 128, 4;
    decode_attention_bf16_d128_g8, decode_attention_bulk_bf16_d128_g8: Bf16, 128, 8;
    decode_attention_f16_d64_g1, decode_attention_bulk_f16_d64_g1: F16, 64, 1;
    decode_attention_f16_d64_g2, decode_attention_bulk_f16_d64_g2: F16, 64, 2;
    decode_attention_f16_d64_g4, decode_attention_bulk_f16_d64_g4: F16, 64, 4;
    decode_attention_f16_d64_g8, decode_attention_bulk_f16_d64_g8: F16, 64, 8;
    decode_attention_f16_d128_g1, decode_attention_bulk_f16_d128_g1: F16, 128, 1;
    decode_attention_f16_d128_g2, decode_attention_bulk_f16_d128_g2: F16, 128, 2;
    decode_attention_f16_d128_g4, decode_attention_bulk_f16_d128_g4: F16, 128, 4;
    decode_attention_f16_d128_g8, decode_attention_bulk_f16_d128_g8: F16, 128, 8;
}
