//! Paged sparse decode attention (flash-decoding over index tables, on the tensor cores).
//!
//! Grid `(splits, batch * kv_heads)`, 128 threads (4 warps). Block `(s, y)` serves KV head
//! `y % kv_heads` of sequence `y / kv_heads` — all `G` query heads of the group, so every K/V row
//! is loaded once — over split `s` of that pair's tiles of 16 rows ([`rows::RowSource`]). Inside
//! the block, warp `w` takes every fourth tile of the split (`w, w + 4, ...`) and streams them
//! through its own [`DECODE_STAGES`]-stage ring (no block barrier in the loop), filled by
//! tensor-map bulk copies (`decode_attention_bulk_*`, `decode_attention_append_bulk_*`) or by
//! `cp.async` (`decode_attention_append_*`, short splits; [`tiles::TileCopy`]). Per tile it
//! computes `S = Q Kᵀ` and `O += P V` with `mma.sync` m16n8k16, the group's query heads being the
//! rows of the products ([`tiles`], fragments from [`crate::tile::fragments`]), with an online
//! softmax per head in registers ([`online_softmax`]). At the end the warps' states merge through
//! shared memory ([`SoftmaxState::merge`]) and the block writes one partial state per query head;
//! [`combine`] merges the splits into the output the same way. The
//! `decode_attention_append_*` entry points also append the step's token ([`newest`]): a step that
//! uses them needs no append launch.

pub mod coded;
pub mod combine;
pub mod newest;
pub mod online_softmax;
pub mod rows;
pub mod tiles;

use lserve_abi::decode::{DecodeArgs, DecodeParams, DECODE_STAGES, DECODE_TILE_ROWS};

use crate::convert::{Bf16, F16};
use crate::mma::{mma_m16n8k16, FragC, MmaElement};
use crate::smem::dynamic_smem;
use crate::sync::{sync_threads, sync_warp};
use crate::thread::{block_idx_x, block_idx_y, lane, thread_in_block, warp_in_block};
use crate::tile::fragments::{k_steps, load_k_fragments, load_v_fragments, n_tiles, p_fragment};
use crate::tile::SoftmaxState;
use newest::{NewestRow, StatsUpdate};
use rows::{PairInputs, RowSource, NO_ROW};
use tiles::{
    load_q_fragments, patch_rows, AsyncCopy, KvLayout, LongSplitCopy, Stages, TileCopy,
    MAX_O_TILES, WARPS,
};

/// One warp's pass over its tiles: the softmax state of its lane's query head and the
/// unnormalized output accumulators (rows `lane / 4`, see [`tiles`]).
struct WarpState {
    softmax: SoftmaxState,
    o: [FragC; MAX_O_TILES],
}

/// Runs warp `warp`'s share of the block's tiles `first..first + count`: tiles
/// `first + warp + WARPS * j`, each through a stage of the warp's ring.
///
/// # Safety
/// All 32 lanes of the warp call it; `first + count <= src.tiles()`; the warp's stages are free.
#[inline(always)]
unsafe fn attend_tiles<E: MmaElement, const D: usize, C: TileCopy, const APPEND: bool>(
    p: &DecodeParams,
    src: &RowSource,
    q_group: *const u16,
    first: u32,
    count: u32,
    warp: u32,
    newest: NewestRow,
) -> WarpState {
    let lane = lane();
    let mut state = WarpState {
        softmax: SoftmaxState::EMPTY,
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
    // SAFETY: `q_group` holds the group's `p.group x D` query elements (the caller's layout),
    // `p.group <= MAX_GROUP`.
    let q = unsafe { load_q_fragments::<E, D>(q_group, p.group, lane) };
    // SAFETY: the whole warp is here (`mine` is warp-uniform), before any issue.
    unsafe { C::start::<D>(warp, lane) };
    // Issues tile `j` (whose rows are at `at`) into its stage.
    let issue = |j: u32, at: C::At| {
        // SAFETY: `tile(j) < first + count <= tiles`, `at` is where its rows are; the stage is
        // free (see the loop).
        unsafe { C::issue::<D>(warp, j, src, at, src.tile_rows(tile(j)), lane) };
    };

    // Prologue: the first STAGES - 1 tiles in flight.
    let mut j = 0;
    while j < DECODE_STAGES - 1 {
        if j < mine {
            // SAFETY: `tile(j)` is one of this warp's tiles.
            issue(j, unsafe { C::locate(src, p, tile(j)) });
        }
        C::commit();
        j += 1;
    }
    // Where the next tile to issue lives, looked up one step ahead: a dense head's page-list
    // read then overlaps a tile's compute instead of stalling the copy issue.
    let mut next_at = C::NOWHERE;
    if DECODE_STAGES - 1 < mine {
        // SAFETY: as above.
        next_at = unsafe { C::locate(src, p, tile(DECODE_STAGES - 1)) };
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
            issue(next, next_at);
        }
        C::commit();
        if next + 1 < mine {
            // SAFETY: `tile(next + 1)` is one of this warp's tiles.
            next_at = unsafe { C::locate(src, p, tile(next + 1)) };
        }

        let k_tile = Stages::<D>::k_tile(warp, j % DECODE_STAGES);
        let v_tile = k_tile.next();
        // Skipped where the copies repeat the last row: nothing to fix there, and the empty call
        // still changes ptxas's register allocation of the `cp.async` appending kernel and its
        // time (decode/DESIGN.md).
        if !C::REPEATS_LAST_ROW {
            // SAFETY: the whole warp is here, after tile `j`'s wait and barrier.
            unsafe { C::landed::<D>(warp, j, src.tile_rows(tile(j)), lane) };
        }
        if APPEND && tile(j) == newest.tile {
            // SAFETY: the whole warp is here, after the tile's wait and barrier; the newest row
            // is one of the tile's rows.
            unsafe { patch_rows::<D, C>(k_tile, &newest, src.tile_rows(tile(j)), lane) };
        }
        // S = Q Kᵀ for the tile's 16 keys.
        let mut s = [FragC::default(); 2];
        crate::unroll8!(kk in 0..k_steps(D) => {
            // SAFETY: the tile arrived (wait + warp barrier above); the whole warp is here; keys
            // 0..16, dims `16 kk .. + 16` are inside the tile.
            unsafe {
                let [b0, b1] = load_k_fragments::<E, KvLayout<D>>(k_tile.addr(), 0, 16 * kk as u32, lane);
                s[0] = mma_m16n8k16(&q[kk], &b0, &s[0]);
                s[1] = mma_m16n8k16(&q[kk], &b1, &s[1]);
            }
        });
        // SAFETY: every lane is here; the tile has at least one row.
        let correction = unsafe {
            online_softmax::add_tile(
                &mut state.softmax,
                &mut s,
                src.tile_rows(tile(j)),
                lane,
                p.scale_log2,
            )
        };
        // O = correction · O + P V; `P`'s rows 8..16 (past the group) are zero.
        let pf = p_fragment::<E, 8>(&s[0], &s[1]);
        crate::unroll8!(pair in 0..n_tiles(D) / 2 => {
            let o = &mut state.o;
            let mut c = 0;
            while c < 2 {
                o[2 * pair].regs[c] *= correction;
                o[2 * pair + 1].regs[c] *= correction;
                c += 1;
            }
            // SAFETY: as for K (dims `16 pair .. + 16`).
            unsafe {
                let [b0, b1] = load_v_fragments::<E, KvLayout<D>>(v_tile.addr(), 0, 16 * pair as u32, lane);
                o[2 * pair] = mma_m16n8k16(&pf, &b0, &o[2 * pair]);
                o[2 * pair + 1] = mma_m16n8k16(&pf, &b1, &o[2 * pair + 1]);
            }
        });
        j += 1;
    }
    state
}

/// The kernel body, generic over element type `E` and head dimension `D`; the group size
/// `G = p.group` is a launch parameter (it only sizes the query fragments' rows and the merge
/// at the end, not the loop over the tiles).
///
/// With `APPEND` the launch also appends the step's token (what the `append_kv` kernel
/// does, so the step needs no launch for it): the warp whose tiles hold a pair's newest row
/// takes it from the activations and writes it, its statistics and the pair's index entry tail
/// ([`newest`]); nothing else of the launch reads what it writes.
///
/// # Safety
/// Launched with grid `(p.splits, p.batch * p.cache.kv_heads)`, `DECODE_THREADS` threads
/// and `decode_smem_bytes(D)` bytes of dynamic shared memory; `1 <= p.group <= MAX_GROUP`
/// (`lserve_abi::decode`); every buffer of `a` holds the layout `DecodeArgs` documents (with
/// `APPEND`, the cache and the selection state as `append_kv`'s contract asks);
/// `seq_len`, `seq_slot`, `head_map` and the block tables are written by host copies enqueued
/// before the previous kernel (not by a kernel): they are read before `overlapped_entry`.
#[inline(always)]
unsafe fn decode_attention<E: MmaElement, const D: usize, C: TileCopy, const APPEND: bool>(
    a: &DecodeArgs,
) {
    let p = &a.params;
    let (part_acc, part_ml) = (a.part_acc.get(), a.part_ml.get());
    let split = block_idx_x();
    let pair = block_idx_y();
    let (b, kv_head) = (pair / p.cache.kv_heads, pair % p.cache.kv_heads);
    // SAFETY: `b < batch`, `kv_head < kv_heads` by the grid; the slot and length are the
    // host's, validated against the tables (`check_batch`), so the newest page's block-table
    // entry exists.
    let inputs = unsafe { PairInputs::read(a, b, kv_head, APPEND) };
    // Overlapped with the kernel before (the append, the selector, or the last kernel of the
    // layer before): the batch description, the head map and the block tables above are copies
    // from the host, complete before that kernel started; the selection state, the cache rows
    // and `q` may be its outputs.
    // SAFETY: before this thread's first access of anything a kernel before it reads or writes
    // (everything above is host copies).
    unsafe { crate::sync::overlapped_entry() };
    // SAFETY: the host validated slot, lengths and tables.
    let src = unsafe { RowSource::new(a, inputs, APPEND) };

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
    // With the append: the warp whose tiles hold the newest row takes it from the activations,
    // stores it into the cache and starts its statistics update.
    let lane = lane();
    let newest_tile = src.newest_row / DECODE_TILE_ROWS;
    let holds_newest = APPEND
        && src.newest_row != NO_ROW
        && newest_tile >= first
        && newest_tile < end
        && (newest_tile - first) % WARPS == warp;
    let (newest, stats) = if holds_newest {
        let target = newest::target(p, &inputs, &src);
        // SAFETY: the activations hold `batch` rows of `kv_heads x D` elements, `p.strides.kv`
        // heads apart, written before the kernel before completed (waited for above). `target` is the pair's row (and statistics row) of the
        // token at `len - 1`, inside the buffers by their layouts; this warp alone holds the
        // pair's newest row, so it is the only writer of both.
        unsafe {
            let at_row = (b * p.strides.kv + kv_head) as usize * D;
            let row = NewestRow::load::<D>(a, at_row, src.newest_row, lane);
            row.store_row::<D>(a, target, inputs.slot, lane);
            let stats = StatsUpdate::start::<D>(a, target, inputs.len, lane);
            (row, stats)
        }
    } else {
        (NewestRow::NONE, None)
    };
    // SAFETY: `q` holds `batch` rows of `q_heads x D` elements, `p.strides.q` heads apart, and pair
    // `(b, kv_head)`'s query heads are the `G` consecutive heads from `kv_head * G` of row `b`,
    // `G <= MAX_GROUP`; `first + count <= tiles`; the stages are unused so far.
    let state = unsafe {
        attend_tiles::<E, D, C, APPEND>(
            p,
            &src,
            a.q.get()
                .add((b * p.strides.q + kv_head * p.group) as usize * D),
            first,
            count,
            warp,
            newest,
        )
    };
    if APPEND && newest.held() {
        // SAFETY: this warp alone writes the pair's statistics and entry tail.
        unsafe {
            if let Some(update) = stats {
                update.finish::<E>(newest.key);
            }
            if lane == 0 {
                newest::keep_entry_tail(a, src.entry, src.tail);
            }
        }
    }

    // Merge the warps through shared memory (the stage area, free once every copy has landed and
    // every warp is past its last read): per warp and head, `m`, `l` and `D` accumulators.
    C::finish();
    // SAFETY: block-uniform.
    unsafe { sync_threads() };
    // SAFETY: every lane of the warp is here (quad shuffle).
    let head = unsafe { state.softmax.quad_total() };
    let quad = lane % 4;
    let (g, group) = (lane / 4, p.group);
    // SAFETY: every copy landed and every warp is past its reads of the stages (the barrier
    // above); the whole block calls it; each lane stores its head's state, rows `g < group`.
    unsafe {
        merge_warps::<D>(p, part_acc, part_ml, pair, split, |area| {
            if g < group {
                let at = merge_slot::<D>(group, warp, g);
                if quad == 0 {
                    *area.add(at) = head.m;
                    *area.add(at + 1) = head.l;
                }
                let mut n = 0;
                while n < n_tiles(D) {
                    let d = (8 * n as u32 + 2 * quad) as usize;
                    *area.add(at + 2 + d) = state.o[n].regs[0];
                    *area.add(at + 2 + d + 1) = state.o[n].regs[1];
                    n += 1;
                }
            }
        })
    };
}

/// Where warp `warp`'s state of query head `g` is stored in the merge area (`f32` offset): `m`,
/// `l`, then `D` accumulators.
#[inline(always)]
pub(crate) fn merge_slot<const D: usize>(group: u32, warp: u32, g: u32) -> usize {
    ((warp * group + g) * (D as u32 + 2)) as usize
}

/// The end of a decode block: merges the warps' softmax states and output accumulators through
/// shared memory (the stage area) and writes the block's partial state per query head into
/// `part_acc` / `part_ml`. `store(area)` stores this thread's share of its warp's states: per
/// warp and head, at [`merge_slot`], `m`, `l` (the warp's totals) and `D` accumulators.
///
/// # Safety
/// The whole block calls it, after a block barrier that follows every warp's last read of its
/// stages and every copy's landing; `decode_merge_bytes(D, p.group)` fits the shared memory;
/// `store` writes inside the slots of its warp's heads `< p.group`; `part_acc` / `part_ml` are
/// `[pairs][splits][G][D]` / `[pairs][splits][G][2]`.
#[inline(always)]
pub(crate) unsafe fn merge_warps<const D: usize>(
    p: &DecodeParams,
    part_acc: *mut f32,
    part_ml: *mut f32,
    pair: u32,
    split: u32,
    store: impl FnOnce(*mut f32),
) {
    let group = p.group;
    let area = dynamic_smem::<f32>(0);
    let slot_of = |w: u32, g: u32| merge_slot::<D>(group, w, g);
    store(area);
    // SAFETY: block-uniform.
    unsafe { sync_threads() };
    // Thread `t` merges (head, dim) pairs `t, t + 128, ...` over the warps.
    let mut i = thread_in_block();
    while i < group * D as u32 {
        let (g, d) = (i / D as u32, (i % D as u32) as usize);
        // SAFETY (reads): written above, before the barrier.
        let m_of = |w: u32| unsafe { *area.add(slot_of(w, g)) };
        let mut m_all = f32::NEG_INFINITY;
        let mut w = 0;
        while w < WARPS {
            m_all = m_all.max(m_of(w));
            w += 1;
        }
        let mut merged = SoftmaxState::merge_at(m_all);
        let mut acc = [0.0f32];
        let mut w = 0;
        while w < WARPS {
            // SAFETY: as above.
            let (m, warp_acc, l) = unsafe {
                let at = slot_of(w, g);
                (m_of(w), [*area.add(at + 2 + d)], *area.add(at + 1))
            };
            merged.merge(SoftmaxState { m, l }, &mut acc, &warp_acc);
            w += 1;
        }
        let out = ((pair * p.splits + split) as usize) * group as usize + g as usize;
        // SAFETY: `part_acc` is `[pairs][splits][G][D]`, `part_ml` `[pairs][splits][G][2]`.
        unsafe {
            *part_acc.add(out * D + d) = acc[0];
            if d == 0 {
                *part_ml.add(out * 2) = merged.m;
                *part_ml.add(out * 2 + 1) = merged.l;
            }
        }
        i += crate::thread::block_dim_x();
    }
}

/// Declares one `extern "gpu-kernel"` entry point `$name` for element type and head dim, with
/// the tile copy `$copy`, appending the step's token or not (`$append`).
macro_rules! decode_kernel {
    ($copy:ty, $append:literal, $name:ident: $elem:ty, $d:literal) => {
        /// Decode attention entry point (see the module docs).
        ///
        /// # Safety
        /// As [`decode_attention`]'s: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $name(a: DecodeArgs) {
            // SAFETY: forwarded launch contract (the body waits for the kernel before).
            unsafe { decode_attention::<$elem, $d, $copy, $append>(&a) }
        }
    };
}

/// Declares, per (element type, head dim), the entry points over the cache as it is (`$bulk`:
/// tiles by tensor-map bulk copies) and appending the step's token (`$append`: tiles by
/// `cp.async`, for short splits, i.e. the sparse and streaming heads and short sequences;
/// `$append_bulk`: by tensor-map bulk copies, for long splits); the host picks per launch. Each
/// serves every group size `1..=MAX_GROUP` (`p.group`).
macro_rules! decode_kernels {
    ($($bulk:ident, $append:ident, $append_bulk:ident: $elem:ty, $d:literal;)*) => {$(
        decode_kernel!(LongSplitCopy, false, $bulk: $elem, $d);
        decode_kernel!(AsyncCopy, true, $append: $elem, $d);
        decode_kernel!(LongSplitCopy, true, $append_bulk: $elem, $d);
    )*};
}

decode_kernels! {
    decode_attention_bulk_bf16_d64,
        decode_attention_append_bf16_d64, decode_attention_append_bulk_bf16_d64: Bf16, 64;
    decode_attention_bulk_bf16_d128,
        decode_attention_append_bf16_d128, decode_attention_append_bulk_bf16_d128: Bf16, 128;
    decode_attention_bulk_f16_d64,
        decode_attention_append_f16_d64, decode_attention_append_bulk_f16_d64: F16, 64;
    decode_attention_bulk_f16_d128,
        decode_attention_append_f16_d128, decode_attention_append_bulk_f16_d128: F16, 128;
}
