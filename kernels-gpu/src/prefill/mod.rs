//! Block-sparse prefill attention (FlashAttention-2 forward on `mma.sync` tensor cores), one
//! launch for dense and streaming heads.
//!
//! Grid `(items, q_heads)`, [`PREFILL_THREADS`] threads (4 warps). Block `(x, h)` computes query
//! block `items[x].q_block` of sequence `items[x]` for query head `h` (GQA: KV head `h / G`):
//!
//! 1. the 64 query rows go to shared memory, then each warp's 16 rows into `Q` fragments;
//! 2. the KV blocks to visit come from [`block_iter::KvBlocks`] (the head's pattern — causal or
//!    Λ — intersected with the optional caller block mask, the diagonal kept); K/V tiles stream
//!    through a [`PREFILL_STAGES`]-stage `cp.async` ring, a second walk of the same iterator
//!    running ahead to issue the loads;
//! 3. per block: `S = Q Kᵀ` ([`scores`]), element masks where the block is partially visible
//!    ([`mask`]), online softmax in registers ([`softmax`]), `O += P V` with `P` taken straight
//!    from `S`'s registers ([`accumulate_pv`]);
//! 4. `O / l` is written as the output element type.
//!
//! The loop body is the same for every head and block: what differs is only which blocks the
//! iterator yields and whether the block needs element masks.

/// Like [`crate::unroll8!`], for constant bounds up to 16 (the `O` accumulators at `D = 128`):
/// the body is repeated in the source, so register arrays it indexes stay in registers.
macro_rules! unroll16 {
    ($i:ident in 0..$n:expr => $body:block) => {
        unroll16!(@each $i, $n, $body, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@each $i:ident, $n:expr, $body:block, $($k:literal)*) => {
        $(
            #[allow(clippy::reversed_empty_ranges, unused_comparisons)]
            if $k < $n {
                let $i: usize = $k;
                $body
            }
        )*
    };
}

pub mod block_iter;
pub mod mask;
pub mod softmax;
pub mod tiles;

use lserve_abi::decode::HEAD_STREAMING;
use lserve_abi::prefill::{
    PrefillParams, PrefillWorkItem, BLOCK_KV, BLOCK_Q, PREFILL_STAGES, PREFILL_THREADS,
};

use crate::convert::{Bf16, F16};
use crate::cp_async::{commit_group, wait_all, wait_group};
use crate::mma::{mma_m16n8k16, FragA, FragC, MmaElement};
use crate::sync::sync_threads;
use crate::thread::{block_idx_x, block_idx_y, lane, thread_in_block, warp_in_block};
use block_iter::{KvBlocks, Window};
use softmax::RowSoftmax;
use tiles::{
    load_k_fragments, load_q_fragments, load_tile_async, load_v_fragments, p_fragment, SmemLayout,
    Tile, MAX_O_TILES, MAX_Q_STEPS, S_TILES,
};

const _: () = assert!(BLOCK_Q == 16 * (PREFILL_THREADS / 32) && BLOCK_KV == tiles::TILE_ROWS);

/// `S = Q Kᵀ` for this warp's 16 rows and the 64 keys of the K tile at `k_tile`.
///
/// # Safety
/// The whole warp calls it after the barrier that follows the tile's arrival.
#[inline(always)]
unsafe fn scores<E: MmaElement, const D: usize>(
    q: &[FragA<E>; MAX_Q_STEPS],
    k_tile: u32,
    lane: u32,
) -> [FragC; S_TILES] {
    let mut s = [FragC::default(); S_TILES];
    crate::unroll8!(kk in 0..Tile::<D>::D_STEPS => {
        crate::unroll8!(pair in 0..S_TILES / 2 => {
            // SAFETY: forwarded.
            let b = unsafe { load_k_fragments::<E, D>(k_tile, pair as u32, kk as u32, lane) };
            // SAFETY: the whole warp executes the products.
            unsafe {
                s[2 * pair] = mma_m16n8k16(&q[kk], &b[0], &s[2 * pair]);
                s[2 * pair + 1] = mma_m16n8k16(&q[kk], &b[1], &s[2 * pair + 1]);
            }
        });
    });
    s
}

/// `O += P V` for this warp's rows, `P` the probabilities in `s`, V the tile at `v_tile`.
///
/// # Safety
/// As [`scores`].
#[inline(always)]
unsafe fn accumulate_pv<E: MmaElement, const D: usize>(
    s: &[FragC; S_TILES],
    v_tile: u32,
    o: &mut [FragC; MAX_O_TILES],
    lane: u32,
) {
    crate::unroll8!(kk in 0..S_TILES / 2 => {
        let p = p_fragment::<E>(&s[2 * kk], &s[2 * kk + 1]);
        crate::unroll8!(pair in 0..Tile::<D>::O_TILES / 2 => {
            // SAFETY: forwarded.
            let b = unsafe { load_v_fragments::<E, D>(v_tile, kk as u32, pair as u32, lane) };
            // SAFETY: the whole warp executes the products.
            unsafe {
                o[2 * pair] = mma_m16n8k16(&p, &b[0], &o[2 * pair]);
                o[2 * pair + 1] = mma_m16n8k16(&p, &b[1], &o[2 * pair + 1]);
            }
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
}

/// The kernel body, generic over the element type `E` and head dimension `D` (64 or 128).
///
/// # Safety
/// Launched with grid `(p.items, p.q_heads)`, [`PREFILL_THREADS`] threads and
/// `prefill_smem_bytes(D)` bytes of dynamic shared memory. `items` holds `p.items` work items of
/// sequences inside `q [T][Hq][D]`, `k`, `v [T][Hkv][D]`, `out [T][Hq][D]` (16-byte aligned);
/// `head_map` holds `Hkv` entries (bit [`HEAD_STREAMING`] = streaming); with `p.has_mask != 0`,
/// `mask` holds every item's rows (`mask_row + h * mask_head_stride`, `q_block / 32 + 1` words
/// at least).
#[inline(always)]
unsafe fn prefill_attention<E: MmaElement, const D: usize>(
    p: &PrefillParams,
    items: *const PrefillWorkItem,
    head_map: *const u32,
    mask: *const u32,
    t: Tensors,
) {
    let (thread, warp, lane) = (thread_in_block(), warp_in_block(), lane());
    let head = block_idx_y();
    let kv_head = head / p.group;
    // SAFETY: `block_idx_x < items`, `kv_head < kv_heads` by the grid and the host's checks.
    let (item, entry) = unsafe {
        (
            items.add(block_idx_x() as usize).read(),
            head_map.add(kv_head as usize).read(),
        )
    };
    let window = if entry & HEAD_STREAMING != 0 {
        Window {
            sink: p.sink_tokens,
            local: p.local_tokens,
        }
    } else {
        Window::CAUSAL
    };
    let mask_row = if p.has_mask != 0 {
        // SAFETY: inside the mask array by the host's plan.
        unsafe { mask.add((item.mask_row + head * item.mask_head_stride) as usize) }
    } else {
        core::ptr::null()
    };
    let (seq_start, seq_len) = (item.seq_start as usize, item.seq_len);
    let q_first = item.q_block * BLOCK_Q;
    let (q_stride, kv_stride) = (p.q_heads as usize * D, p.kv_heads as usize * D);

    // The query tile, first into shared memory (its own `cp.async` group).
    let q_rows = (seq_len - q_first).min(BLOCK_Q);
    // SAFETY: rows `q_first .. q_first + q_rows` of the sequence exist in `q`.
    unsafe {
        let src =
            t.q.add((seq_start + q_first as usize) * q_stride + head as usize * D);
        load_tile_async::<D>(SmemLayout::<D>::q(), src, q_stride, q_rows, thread);
    }
    commit_group();

    // Two walks over the same blocks: `loads` runs `PREFILL_STAGES - 1` ahead of `blocks`.
    // SAFETY: the mask row holds `q_block / 32 + 1` words (host plan).
    let mut blocks = unsafe { KvBlocks::new(window, item.q_block, mask_row) };
    let mut loads = blocks;
    let load_kv = |kv_block: u32, stage: u32| {
        let k_first = kv_block * BLOCK_KV;
        let rows = (seq_len - k_first).min(BLOCK_KV);
        let offset = (seq_start + k_first as usize) * kv_stride + kv_head as usize * D;
        // SAFETY: `kv_block <= q_block`, so its rows `0 .. rows` exist in `k` and `v`.
        unsafe {
            load_tile_async::<D>(
                SmemLayout::<D>::k(stage),
                t.k.add(offset),
                kv_stride,
                rows,
                thread,
            );
            load_tile_async::<D>(
                SmemLayout::<D>::v(stage),
                t.v.add(offset),
                kv_stride,
                rows,
                thread,
            );
        }
    };
    let mut stage = 0;
    while stage < PREFILL_STAGES - 1 {
        if let Some(kv_block) = loads.next() {
            load_kv(kv_block, stage);
        }
        commit_group();
        stage += 1;
    }

    // The query tile has landed once at most `PREFILL_STAGES - 1` groups are pending.
    wait_group::<{ PREFILL_STAGES - 1 }>();
    // SAFETY: block-uniform control flow.
    unsafe { sync_threads() };
    // SAFETY: the whole warp, after the barrier.
    let q = unsafe { load_q_fragments::<E, D>(warp, lane) };

    let mut o = [FragC::default(); MAX_O_TILES];
    let mut softmax = RowSoftmax::new(p.scale_log2);
    let q_first_warp = q_first + 16 * warp;
    let mut i = 0;
    while let Some(kv_block) = blocks.next() {
        // Block `i` has landed (for everyone after the barrier), and everyone is done reading
        // the stage the next load overwrites (it held block `i - 1`).
        wait_group::<{ PREFILL_STAGES - 2 }>();
        // SAFETY: the iterator is block-uniform, so every thread runs the same iterations.
        unsafe { sync_threads() };
        if let Some(next) = loads.next() {
            load_kv(next, (i + PREFILL_STAGES - 1) % PREFILL_STAGES);
        }
        commit_group();

        let stage = i % PREFILL_STAGES;
        // SAFETY: the whole warp, after the barrier that follows the stage's arrival.
        let mut s = unsafe { scores::<E, D>(&q, SmemLayout::<D>::k(stage), lane) };
        if window.needs_mask(item.q_block, kv_block, seq_len) {
            mask::apply(&mut s, window, q_first_warp, kv_block * BLOCK_KV, lane);
        }
        // SAFETY: the whole warp.
        unsafe {
            softmax.update(&mut s, &mut o, Tile::<D>::O_TILES);
            accumulate_pv::<E, D>(&s, SmemLayout::<D>::v(stage), &mut o, lane);
        }
        i += 1;
    }
    wait_all();

    // O / l, rows that exist only.
    // SAFETY: the whole warp.
    let inv = unsafe { softmax.inverse_denominators() };
    let (group, quad) = (lane / 4, lane % 4);
    crate::unroll8!(half in 0..2 => {
        let row = q_first_warp + group + 8 * half as u32;
        if row < seq_len {
            let base = (seq_start + row as usize) * q_stride + head as usize * D;
            unroll16!(n in 0..Tile::<D>::O_TILES => {
                let c = &o[n].regs[2 * half..2 * half + 2];
                let pair = E::pack2(c[0] * inv[half], c[1] * inv[half]);
                // SAFETY: row `row` of the sequence exists; dims `8 n + 2 quad, +1 < D`.
                unsafe {
                    t.out
                        .add(base + 8 * n + 2 * quad as usize)
                        .cast::<u32>()
                        .write(pair)
                };
            });
        }
    });
}

/// Declares one `extern "gpu-kernel"` entry point per (element type, head dim).
macro_rules! prefill_kernels {
    ($($name:ident: $elem:ty, $d:literal;)*) => {$(
        /// Prefill attention entry point (see the module docs).
        ///
        /// # Safety
        /// As `prefill_attention`'s: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "gpu-kernel" fn $name(
            p: PrefillParams,
            items: *const PrefillWorkItem,
            head_map: *const u32,
            mask: *const u32,
            q: *const u16,
            k: *const u16,
            v: *const u16,
            out: *mut u16,
        ) {
            // SAFETY: forwarded launch contract.
            unsafe {
                prefill_attention::<$elem, $d>(&p, items, head_map, mask, Tensors { q, k, v, out })
            }
        }
    )*};
}

prefill_kernels! {
    prefill_attention_bf16_d64: Bf16, 64;
    prefill_attention_bf16_d128: Bf16, 128;
    prefill_attention_f16_d64: F16, 64;
    prefill_attention_f16_d128: F16, 128;
}
