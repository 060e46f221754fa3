//! Block-sparse prefill attention (FlashAttention-2 forward on `mma.sync` tensor cores), one
//! launch for dense and streaming heads.
//!
//! One body, [`prefill_attention`], generic over the element type, the head dimension and the
//! block-level mask ([`mask::Mask`]), which fixes the query rows per warp (`ROW_TILES` `mma`
//! row tiles of 16) and hence the query tile of a launch block:
//! - `prefill_attention_*` ([`mask::HeadPattern`], launches without caller masks): 32 rows per
//!   warp, a tile of two query blocks ([`TILE_Q_BLOCKS`]); warps 0-1 own the first query block,
//!   warps 2-3 the second. Every K/V fragment feeds two row tiles; `Q` is re-read from shared
//!   memory per KV block.
//! - `prefill_masked_attention_*` ([`mask::BlockMask`], launches with caller block masks): 16
//!   rows per warp, a tile of one query block ([`MASKED_TILE_Q_BLOCKS`]), `Q` in registers. A
//!   random mask per query block makes a two-block tile visit the union of two KV sets with half
//!   its warps idle; one block per tile visits exactly its own set.
//!
//! Grid `(items, q_heads)`, [`PREFILL_THREADS`] threads (4 warps). Block `(x, h)` computes the
//! query tile of `items[x]` for query head `h` (GQA: KV head `h / G`):
//!
//! 1. the query rows go to shared memory;
//! 2. the mask walks the KV blocks to visit (per query block the head's pattern — causal or Λ —
//!    intersected with the caller block mask if there is one, the diagonal kept; the tile visits
//!    the union): [`block_iter::TileSpan`] (arithmetic in the block counter) or
//!    [`block_iter::TileBlocks`] (a bitset walk); K/V tiles stream through a
//!    [`PREFILL_STAGES`]-stage `cp.async` ring, one block ahead of the computation;
//! 3. per block, in the warps whose query block visits it: `S = Q Kᵀ` ([`scores`]), element
//!    masks where the block is partially visible ([`mask::apply`]), online softmax in registers
//!    ([`softmax`]), `O += P V` with `P` taken straight from `S`'s registers
//!    ([`accumulate_pv`]);
//! 4. `O / l` is written as the output element type.
//!
//! The loop body is the same for every head, block and mask: what differs is only which blocks
//! the walk yields, which warps skip one, and whether the block needs element masks.
//!
//! On sm_90a, [`wgmma`] computes what `prefill_attention_*` and `prefill_lse_attention_*` do
//! with Hopper's warpgroup products, tensor-map copies and a producer warpgroup
//! (`prefill_wgmma_attention_*`, `prefill_wgmma_lse_attention_*`), and [`wgmma_masked`] what
//! `prefill_masked_attention_*` does (`prefill_wgmma_masked_attention_*`).

pub mod block_iter;
pub mod mask;
pub mod softmax;
pub mod tiles;
#[cfg(target_feature = "sm_90a")]
pub mod wgmma;
#[cfg(target_feature = "sm_90a")]
pub mod wgmma_masked;

use lserve_abi::prefill::{
    PrefillArgs, PrefillParams, PrefillWorkItem, BLOCK_KV, BLOCK_Q, MASKED_TILE_Q_BLOCKS,
    PREFILL_STAGES, PREFILL_THREADS, TILE_Q_BLOCKS,
};

use crate::convert::{Bf16, F16};
use crate::cp_async::{commit_group, wait_all, wait_group};
use crate::math::{opaque, opaque_u32};
use crate::mma::{mma_m16n8k16, FragA, FragC, MmaElement};
use crate::sync::sync_threads;
use crate::thread::{block_idx_x, block_idx_y, lane, thread_in_block, warp_in_block, WARP_SIZE};
use crate::tile::fragments::{
    k_steps, load_k_fragments, load_q_fragment, load_v_fragments, n_tiles, p_fragment,
};
use crate::tile::{SmemTile, SoftmaxState};
use crate::warp::shfl_idx_u32;
use block_iter::Window;
use mask::{BlockMask, HeadPattern, Mask};
use softmax::{rescale_unless_settled, RowSoftmax};
use tiles::{
    load_query_tile_async, load_tiles_async, KvTile, QRows, SmemLayout, MAX_O_TILES, S_TILES,
};

/// Warps per launch block.
const WARPS: u32 = PREFILL_THREADS / WARP_SIZE;
/// Most `Q` fragments of a row tile (`D = 128`: 8 steps of 16 dims).
const MAX_Q_STEPS: usize = 8;

// A tile of `ROW_TILES` row tiles per warp is `ROW_TILES` query blocks (`16 * ROW_TILES * 4`
// rows): the two kernels' tiles are the ABI's.
const _: () = assert!(
    BLOCK_Q == 16 * WARPS
        && TILE_Q_BLOCKS == 2
        && MASKED_TILE_Q_BLOCKS == 1
        && BLOCK_KV == tiles::TILE_ROWS
        && PREFILL_STAGES == 2
);

/// `S` of a warp: per row tile, 8 accumulators of 8 keys.
type Scores<const ROW_TILES: usize> = [[FragC; S_TILES]; ROW_TILES];
/// `O` of a warp: per row tile, `D / 8` accumulators of 8 dims.
type Output<const ROW_TILES: usize> = [[FragC; MAX_O_TILES]; ROW_TILES];

// The loads and products below are in program order, each `ldmatrix` just before the products
// that use it: `ptxas` schedules the loop itself and ignores the PTX order of `ldmatrix` and
// `mma` (a source-level software pipeline, fragments loaded one step ahead into a second set of
// registers, gave byte-identical SASS). How far ahead of its products it issues a load depends on
// the registers it has to spare (DESIGN.md, "Variants that lost").

/// `S = Q Kᵀ` for this warp's rows and the 64 keys of the K tile at `k_tile`; `q(m, kk)` is the
/// `Q` fragment of row tile `m`, dims `16 kk .. + 16` (from registers or shared memory). Each K
/// fragment feeds every row tile.
///
/// # Safety
/// The whole warp calls it after the barrier that follows the tiles' arrival.
#[inline(always)]
unsafe fn scores<E: MmaElement, const D: usize, const ROW_TILES: usize>(
    q: impl Fn(usize, usize) -> FragA<E>,
    k_tile: SmemTile<KvTile<D>>,
    lane: u32,
) -> Scores<ROW_TILES> {
    let mut s = [[FragC::default(); S_TILES]; ROW_TILES];
    crate::unroll8!(kk in 0..k_steps(D) => {
        let q: [FragA<E>; ROW_TILES] = core::array::from_fn(|m| q(m, kk));
        crate::unroll8!(pair in 0..S_TILES / 2 => {
            let (row, col) = (16 * pair as u32, 16 * kk as u32);
            // SAFETY: forwarded.
            let b = unsafe { load_k_fragments::<E, KvTile<D>>(k_tile.addr(), row, col, lane) };
            crate::unroll8!(m in 0..ROW_TILES => {
                // SAFETY: the whole warp executes the products.
                unsafe {
                    s[m][2 * pair] = mma_m16n8k16(&q[m], &b[0], &s[m][2 * pair]);
                    s[m][2 * pair + 1] = mma_m16n8k16(&q[m], &b[1], &s[m][2 * pair + 1]);
                }
            });
        });
    });
    s
}

/// `O += P V` for this warp's rows, `P` the probabilities in `s`, V the tile at `v_tile`. Each V
/// fragment feeds every row tile.
///
/// # Safety
/// As [`scores`].
#[inline(always)]
unsafe fn accumulate_pv<E: MmaElement, const D: usize, const ROW_TILES: usize>(
    s: &Scores<ROW_TILES>,
    v_tile: SmemTile<KvTile<D>>,
    o: &mut Output<ROW_TILES>,
    lane: u32,
) {
    crate::unroll8!(kk in 0..S_TILES / 2 => {
        let p: [FragA<E>; ROW_TILES] =
            core::array::from_fn(|m| p_fragment::<E, 16>(&s[m][2 * kk], &s[m][2 * kk + 1]));
        crate::unroll8!(pair in 0..n_tiles(D) / 2 => {
            let (row, col) = (16 * kk as u32, 16 * pair as u32);
            // SAFETY: forwarded.
            let b = unsafe { load_v_fragments::<E, KvTile<D>>(v_tile.addr(), row, col, lane) };
            crate::unroll8!(m in 0..ROW_TILES => {
                // SAFETY: the whole warp executes the products.
                unsafe {
                    o[m][2 * pair] = mma_m16n8k16(&p[m], &b[0], &o[m][2 * pair]);
                    o[m][2 * pair + 1] = mma_m16n8k16(&p[m], &b[1], &o[m][2 * pair + 1]);
                }
            });
        });
    });
}

/// The global tensors of a launch (`u16` = bf16 or f16 bits).
#[derive(Clone, Copy)]
struct Tensors {
    q: *const u16,
    k: *const u16,
    v: *const u16,
    out: *mut u16,
    lse: *mut f32,
}

/// `Q` fragments of a warp held in registers: per row tile, `D / 16` of them (the rest unused).
type QRegs<E, const ROW_TILES: usize> = [[FragA<E>; MAX_Q_STEPS]; ROW_TILES];

/// The prefill kernel body, generic over the element type `E`, head dimension `D` (64 or 128),
/// the `mma` row tiles per warp (`ROW_TILES` = query blocks per tile) and the block-level mask
/// `M` (which blocks a tile visits; see the module docs for the two instantiations).
///
/// # Safety
/// Launched with grid `(p.items, p.q_heads)`, [`PREFILL_THREADS`] threads and
/// `prefill_smem_bytes(D, ROW_TILES)` bytes of dynamic shared memory. `items` holds `p.items`
/// work items (tiles of `ROW_TILES` query blocks, each holding a position `>= q_first`) of
/// sequences whose keys and values lie inside `k`, `v [Tk][Hkv][D]` and whose queries
/// (positions `q_first .. seq_len`) inside `q [Tq][Hq][D]` and `out [Tq][Hq][D]` (16-byte
/// aligned), and `lse [Tq][Hq]` unless it is null; `head_map` holds `Hkv` entries (bit
/// [`HEAD_STREAMING`] = streaming); for [`BlockMask`], `mask` holds every item's rows
/// (`mask_row + h * mask_head_stride`, each `mask_words_per_row(seq_len)` words).
#[inline(always)]
unsafe fn prefill_attention<
    E: MmaElement,
    const D: usize,
    const ROW_TILES: usize,
    M: Mask<ROW_TILES>,
    const LSE: bool,
>(
    p: &PrefillParams,
    items: *const PrefillWorkItem,
    head_map: *const u32,
    mask: *const u32,
    t: Tensors,
) {
    // Query rows of a warp and of the tile; with one row tile `Q` stays in registers.
    let warp_rows = 16 * ROW_TILES as u32;
    let tile_rows = warp_rows * WARPS;
    let q_resident = ROW_TILES == 1;

    // `% WARP_SIZE` gives LLVM the lane's range (the `%laneid` read is opaque to it): the
    // lane-derived parts of the fragment addresses then combine with the per-step offsets into
    // immediates rather than into loop-invariant registers, which ptxas spends on issuing the
    // fragment loads further ahead of their products.
    let (thread, lane) = (thread_in_block(), lane() % WARP_SIZE);
    // The warp index broadcast from lane 0: ptxas then knows it (and what derives from it: the
    // warp's rows, query block and walk bounds) is warp-uniform and keeps those values in
    // uniform registers, beside the 255 per thread rather than among them (CUTLASS's
    // `canonical_warp_idx_sync` does the same).
    // SAFETY: the whole warp is here (no divergence before this point).
    let warp = unsafe { shfl_idx_u32(warp_in_block(), 0) };
    let head = block_idx_y();
    let kv_head = head / p.group;
    // SAFETY: `block_idx_x < items`, `kv_head < kv_heads` by the grid and the host's checks.
    let (item, entry) = unsafe {
        (
            items.add(block_idx_x() as usize).read(),
            head_map.add(kv_head as usize).read(),
        )
    };
    let window = Window::of_head(entry, p.sink_tokens, p.local_tokens);
    let (seq_start, seq_len) = (item.seq_start as usize, item.seq_len);
    // The tile's first position (`item.q_first`, the sequence's first query, may lie after it).
    let q_first = item.q_block * BLOCK_Q;
    // Query blocks of the tile that exist (the last tile of a sequence may be short).
    let tile_blocks = (seq_len.div_ceil(BLOCK_Q) - item.q_block).min(ROW_TILES as u32);
    let (q_stride, kv_stride) = (p.strides.q as usize * D, p.strides.kv as usize * D);

    // The query tile, into shared memory (its own `cp.async` group): positions
    // `max(q_first, item.q_first) .. q_first + q_rows` have queries; the rows before them (a
    // chunk's tile that starts in the cached prefix) are zero.
    let q_rows = (seq_len - q_first).min(tile_rows);
    let lead = item.q_first.saturating_sub(q_first);
    // SAFETY: positions `q_first + lead .. q_first + q_rows` have queries, rows
    // `item.q_row + (position - item.q_first)` of `q`; `lead < q_rows` (the host's tiles each
    // hold a query); the tile has `tile_rows` rows (`ROW_TILES` query blocks).
    unsafe {
        let first_query = item.q_row + (q_first + lead - item.q_first);
        let src = t.q.add(first_query as usize * q_stride + head as usize * D);
        if ROW_TILES == 1 {
            load_query_tile_async::<D, BLOCK_Q>(
                SmemLayout::<D>::q().addr(),
                src,
                q_stride,
                lead,
                q_rows,
                thread,
            );
        } else {
            load_query_tile_async::<D, { 2 * BLOCK_Q }>(
                SmemLayout::<D>::q().addr(),
                src,
                q_stride,
                lead,
                q_rows,
                thread,
            );
        }
    }
    commit_group();

    // Elements from `k` / `v` to this head's first row of the sequence.
    let kv_offset = seq_start * kv_stride + kv_head as usize * D;
    let load_kv = |kv_block: u32, stage: u32| {
        let k_first = kv_block * BLOCK_KV;
        let rows = (seq_len - k_first).min(BLOCK_KV);
        let offset = opaque(kv_offset) + k_first as usize * kv_stride;
        // SAFETY: `kv_block` is at most the tile's last diagonal block, a block of the
        // sequence, so its rows `0 .. rows` exist in `k` and `v`.
        // The V tile follows the K tile (`SmemLayout`).
        unsafe {
            load_tiles_async::<D, BLOCK_KV, 2>(
                SmemLayout::<D>::k(stage).addr(),
                [t.k.add(offset), t.v.add(offset)],
                kv_stride,
                rows,
                thread,
            )
        }
    };

    // This warp's query block (in the tile) and rows.
    let my_block = warp * warp_rows / BLOCK_Q;
    let my_q_block = item.q_block + my_block;
    let q_first_warp = q_first + warp_rows * warp;
    let q_rows_smem = SmemLayout::<D>::q().addr() + warp_rows * warp * QRows::<D>::ROW_BYTES;

    let mut o = [[FragC::default(); MAX_O_TILES]; ROW_TILES];
    let mut softmax: [RowSoftmax; ROW_TILES] =
        core::array::from_fn(|_| RowSoftmax::new(p.scale_log2));
    // The walk's first block, into stage 0 (its own group); then, with one row tile, the warp's
    // `Q` fragments, loaded once (the query tile's group is the older of the two in flight).
    let start = |kv_block: u32| {
        load_kv(kv_block, 0);
        commit_group();
        let mut q_regs = [[FragA::<E>::from_regs([0; 4]); MAX_Q_STEPS]; ROW_TILES];
        if q_resident {
            wait_group::<1>();
            // SAFETY: block-uniform; the query tile has landed for everyone after it.
            unsafe { sync_threads() };
            crate::unroll8!(kk in 0..k_steps(D) => {
                let col = 16 * kk as u32;
                // SAFETY: the whole warp, after the barrier that follows the query tile's
                // arrival.
                q_regs[0][kk] =
                    unsafe { load_q_fragment::<E, QRows<D>>(q_rows_smem, 0, col, lane) };
            });
        }
        q_regs
    };
    // One KV block: block `i` of the walk, `kv_block`, whose tiles were loaded into stage
    // `i % PREFILL_STAGES` one block earlier; starts the load of the walk's next block `next`
    // into the other stage, then, if this warp's query block visits the block (warp-uniform),
    // computes it (`q_regs`: the warp's `Q` fragments if they are resident).
    // Inlined into the walk's loop (LLVM otherwise calls it, with `O` in local memory).
    let step =
        #[inline(always)]
        |i: u32, kv_block: u32, next: Option<u32>, visited: bool, q_regs: &QRegs<E, ROW_TILES>| {
            // Block `i` (and, the first time, the query tile) has landed (for everyone after the
            // barrier), and everyone is done reading the stage the next load overwrites (it held
            // block `i - 1`).
            wait_group::<0>();
            // SAFETY: the walk is block-uniform, so every thread runs the same iterations.
            unsafe { sync_threads() };
            if let Some(next) = next {
                load_kv(next, (i + 1) % PREFILL_STAGES);
            }
            commit_group();
            if !visited {
                return;
            }
            let q_fragment = |m: usize, kk: usize| {
                if q_resident {
                    q_regs[m][kk]
                } else {
                    let (row, col) = (16 * m as u32, 16 * kk as u32);
                    // SAFETY: called by the whole warp inside `scores`, after the barrier that
                    // follows the query tile's arrival.
                    unsafe { load_q_fragment::<E, QRows<D>>(q_rows_smem, row, col, lane) }
                }
            };
            let stage = i % PREFILL_STAGES;
            // SAFETY: the whole warp, after the barrier that follows the tiles' arrival.
            let mut s =
                unsafe { scores::<E, D, ROW_TILES>(&q_fragment, SmemLayout::<D>::k(stage), lane) };
            if window.needs_mask(my_q_block, kv_block, seq_len) {
                // The rows recomputed here, on the rare masked blocks, rather than kept live.
                let q_first_warp = opaque_u32(q_first_warp);
                crate::unroll8!(m in 0..ROW_TILES => {
                    let rows = q_first_warp + 16 * m as u32;
                    mask::apply(&mut s[m], window, rows, kv_block * BLOCK_KV, lane);
                });
            }
            if M::LATENCY_TUNED_SOFTMAX {
                let mut corrections = [[1.0f32; 2]; ROW_TILES];
                crate::unroll8!(m in 0..ROW_TILES => {
                    let block = core::array::from_mut(&mut s[m]);
                    // SAFETY: the whole warp.
                    corrections[m] = unsafe {
                        softmax[m].update::<true, 1>(block, &mut o[m], n_tiles(D))
                    };
                });
                // SAFETY: the whole warp.
                unsafe { rescale_unless_settled(&mut o, &corrections, n_tiles(D)) };
            } else {
                crate::unroll8!(m in 0..ROW_TILES => {
                    let block = core::array::from_mut(&mut s[m]);
                    // SAFETY: the whole warp.
                    unsafe {
                        softmax[m].update::<false, 1>(block, &mut o[m], n_tiles(D))
                    };
                });
            }
            // SAFETY: the whole warp, after the barrier.
            unsafe {
                accumulate_pv::<E, D, ROW_TILES>(&s, SmemLayout::<D>::v(stage), &mut o, lane)
            };
        };

    // SAFETY: `1 <= tile_blocks <= ROW_TILES` query blocks of the sequence; the mask rows by the
    // launch contract.
    unsafe { M::new(mask).walk(&item, head, window, tile_blocks, my_block, start, step) };
    wait_all();

    // O / l, and the log-sum-exp if asked for, of the positions that have queries. The output's
    // stride and the item's query rows are read here (the item again, from memory), opaque to
    // LLVM, so that nothing derived from them is kept live across the walk (the D 128 kernel
    // spilled with the stride).
    let out_stride = opaque_u32(p.strides.out) as usize * D;
    // SAFETY: as the first read of the item.
    let (first_query, query_row) = unsafe {
        let it = items.add(block_idx_x() as usize);
        (
            core::ptr::read_volatile(&raw const (*it).q_first),
            core::ptr::read_volatile(&raw const (*it).q_row),
        )
    };
    // Row of `out` of position `t >= first_query`: `t + row_offset` (mod 2^32).
    let row_offset = query_row.wrapping_sub(first_query);
    let (group, quad) = (lane / 4, lane % 4);
    let mut totals = [[SoftmaxState::EMPTY; 2]; ROW_TILES];
    crate::unroll8!(m in 0..ROW_TILES => {
        // SAFETY: the whole warp.
        totals[m] = unsafe { softmax[m].totals() };
        crate::unroll8!(half in 0..2 => {
            let row = q_first_warp + 16 * m as u32 + group + 8 * half as u32;
            if row >= first_query && row < seq_len {
                let out_row = row.wrapping_add(row_offset) as usize;
                let inv = 1.0 / totals[m][half].l;
                let base = out_row * out_stride + head as usize * D;
                crate::unroll16!(n in 0..n_tiles(D) => {
                    let c = &o[m][n].regs[2 * half..2 * half + 2];
                    let pair = E::pack2(c[0] * inv, c[1] * inv);
                    // SAFETY: position `row` has an output row; dims `8 n + 2 quad, +1 < D`.
                    unsafe {
                        crate::global::store_u32(
                            t.out.add(base + 8 * n + 2 * quad as usize).cast::<u32>(),
                            pair,
                        )
                    };
                });
            }
        });
    });
    // The log-sum-exp after every output (the accumulators are dead by then), one lane per row.
    if !LSE || t.lse.is_null() || quad != 0 {
        return;
    }
    crate::unroll8!(m in 0..ROW_TILES => {
        crate::unroll8!(half in 0..2 => {
            let row = q_first_warp + 16 * m as u32 + group + 8 * half as u32;
            if row >= first_query && row < seq_len {
                let out_row = row.wrapping_add(row_offset) as usize;
                // SAFETY: `lse` holds `[query rows][q_heads]` f32 (launch contract).
                unsafe {
                    t.lse
                        .add(out_row * p.q_heads as usize + head as usize)
                        .write(totals[m][half].natural_lse())
                };
            }
        });
    });
}

/// Declares one `extern "gpu-kernel"` entry point per (mask, element type, head dim): `rows` is
/// the mask's query blocks per tile (the `mma` row tiles per warp).
macro_rules! prefill_kernels {
    ($($name:ident: $mask:ty, $elem:ty, $d:literal, rows $rows:literal, lse $lse:literal;)*) => {$(
        /// Prefill attention entry point (see the module docs).
        ///
        /// # Safety
        /// As `prefill_attention`'s: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $name(a: PrefillArgs) {
            let tensors = Tensors {
                q: a.q.get(),
                k: a.k.get(),
                v: a.v.get(),
                out: a.out.get(),
                lse: a.lse.get(),
            };
            // SAFETY: forwarded launch contract.
            unsafe {
                prefill_attention::<$elem, $d, $rows, $mask, $lse>(
                    &a.params,
                    a.items.get(),
                    a.head_map.get(),
                    a.mask.get(),
                    tensors,
                )
            }
        }
    )*};
}

// Launches without caller masks: 32 rows per warp, tiles of `TILE_Q_BLOCKS` query blocks; no
// log-sum-exp (with it the D 128 kernel spills 24 bytes).
prefill_kernels! {
    prefill_attention_bf16_d64: HeadPattern, Bf16, 64, rows 2, lse false;
    prefill_attention_bf16_d128: HeadPattern, Bf16, 128, rows 2, lse false;
    prefill_attention_f16_d64: HeadPattern, F16, 64, rows 2, lse false;
    prefill_attention_f16_d128: HeadPattern, F16, 128, rows 2, lse false;
}

// Launches without caller masks that write the log-sum-exp: 16 rows per warp, tiles of one
// query block.
prefill_kernels! {
    prefill_lse_attention_bf16_d64: HeadPattern, Bf16, 64, rows 1, lse true;
    prefill_lse_attention_bf16_d128: HeadPattern, Bf16, 128, rows 1, lse true;
    prefill_lse_attention_f16_d64: HeadPattern, F16, 64, rows 1, lse true;
    prefill_lse_attention_f16_d128: HeadPattern, F16, 128, rows 1, lse true;
}

// Launches with caller block masks: 16 rows per warp, tiles of `MASKED_TILE_Q_BLOCKS` (one)
// query block; the log-sum-exp where the launch gives a buffer for it.
prefill_kernels! {
    prefill_masked_attention_bf16_d64: BlockMask, Bf16, 64, rows 1, lse true;
    prefill_masked_attention_bf16_d128: BlockMask, Bf16, 128, rows 1, lse true;
    prefill_masked_attention_f16_d64: BlockMask, F16, 64, rows 1, lse true;
    prefill_masked_attention_f16_d128: BlockMask, F16, 128, rows 1, lse true;
}

/// Declares one Hopper prefill entry point per (kernel, element type, head dim) (sm_90a):
/// `wgmma::prefill_wgmma_attention` or `wgmma_masked::prefill_wgmma_masked_attention`.
#[cfg(target_feature = "sm_90a")]
macro_rules! wgmma_prefill_kernels {
    ($($name:ident: $kind:ident, $elem:ty, $d:literal;)*) => {$(
        /// Hopper prefill attention entry point (see the `wgmma` and `wgmma_masked` module
        /// docs).
        ///
        /// # Safety
        /// As the body's: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $name(a: lserve_abi::prefill::WgmmaPrefillArgs) {
            let map = |i: usize| {
                // SAFETY: the argument's three maps are consecutive (launch contract).
                unsafe { a.maps.get().add(i * lserve_abi::prefill::PREFILL_TENSOR_MAP_BYTES) }
            };
            let maps = wgmma::Maps { q: map(0), k: map(1), v: map(2) };
            let b = &a.base;
            // SAFETY: forwarded launch contract.
            unsafe { wgmma_prefill_kernels!(@call $kind, $elem, $d, b, maps) }
        }
    )*};
    (@call unmasked, $elem:ty, $d:literal, $b:ident, $maps:ident) => {
        wgmma_prefill_kernels!(@dense false, $elem, $d, $b, $maps)
    };
    (@call lse, $elem:ty, $d:literal, $b:ident, $maps:ident) => {
        wgmma_prefill_kernels!(@dense true, $elem, $d, $b, $maps)
    };
    (@dense $lse:literal, $elem:ty, $d:literal, $b:ident, $maps:ident) => {
        wgmma::prefill_wgmma_attention::<$elem, $d, $lse>(
            &$b.params, $b.items.get(), $b.head_map.get(), $maps, $b.out.get(), $b.lse.get(),
        )
    };
    (@call masked, $elem:ty, $d:literal, $b:ident, $maps:ident) => {
        wgmma_masked::prefill_wgmma_masked_attention::<$elem, $d>(
            &$b.params,
            $b.items.get(),
            $b.head_map.get(),
            $b.mask.get(),
            $maps,
            $b.out.get(),
            $b.lse.get(),
        )
    };
}

// On sm_90a: launches without caller masks, tiles of `TILE_Q_BLOCKS` query blocks (without and
// with the log-sum-exp); launches with them, tiles of one query block (the log-sum-exp where
// the launch gives a buffer for it).
#[cfg(target_feature = "sm_90a")]
wgmma_prefill_kernels! {
    prefill_wgmma_attention_bf16_d64: unmasked, Bf16, 64;
    prefill_wgmma_attention_bf16_d128: unmasked, Bf16, 128;
    prefill_wgmma_attention_f16_d64: unmasked, F16, 64;
    prefill_wgmma_attention_f16_d128: unmasked, F16, 128;
    prefill_wgmma_lse_attention_bf16_d64: lse, Bf16, 64;
    prefill_wgmma_lse_attention_bf16_d128: lse, Bf16, 128;
    prefill_wgmma_lse_attention_f16_d64: lse, F16, 64;
    prefill_wgmma_lse_attention_f16_d128: lse, F16, 128;
    prefill_wgmma_masked_attention_bf16_d64: masked, Bf16, 64;
    prefill_wgmma_masked_attention_bf16_d128: masked, Bf16, 128;
    prefill_wgmma_masked_attention_f16_d64: masked, F16, 64;
    prefill_wgmma_masked_attention_f16_d128: masked, F16, 128;
}
