//! Hopper prefill attention with caller block masks (sm_90a): the pieces of [`super::wgmma`]
//! (tensor-map copies into the `mbarrier` ring, `wgmma` products, a producer warpgroup that
//! gives its registers to two consumer warpgroups) for a tile of **one** query block, whose
//! set of KV blocks (the head's pattern ∩ the caller's mask row, the diagonal kept) is a bitset
//! walk ([`TileBlocks`]): blocks outside the set are never copied nor computed.
//!
//! A random mask gives every query block its own set, so two query blocks in one tile would
//! visit the union with half of it wasted on each; here both consumer warpgroups work on the
//! same 64 query rows and split the walk's steps between them, then merge:
//! - **the producer** (one thread of warp 8) copies the query block and, while it lands, counts
//!   the walk (a popcount per mask word) into the step header, then takes the walk two blocks at
//!   a time: step `j` (the
//!   walk's blocks `2j`, `2j + 1`; the second absent at the end of a walk of odd length) goes to
//!   stage `j % STAGES` with its blocks in the stage's header words, counted on the full barrier
//!   of consumer warpgroup `j % 2`. Per (warpgroup, stage) barrier, so each warpgroup waits on
//!   every phase of its barriers in order (with one full barrier per stage, a warpgroup that
//!   sees every other phase could take a phase two behind for the one it waits for).
//! - **consumer warpgroup `g`** takes steps `g, g + 2, ...`: per step `S = Q Kᵀ` over the step's
//!   128 keys, the element masks of the blocks that need them ([`Rows::mask`]; an absent block
//!   is `-inf`), the online softmax, `O += P V`, then releases the stage (one arrival per warp, by the lane that read the step header,
//!   four per phase). The two warpgroups' steps overlap: one's softmax runs under the other's
//!   products.
//! - **the merge**: once warpgroup 0 is past its last step (its arrivals on a merge barrier),
//!   warpgroup 1 leaves its rows' `(m, l)` shares and `O` in stage 0 (free then: every copy
//!   landed and was read) and arrives on the other; warpgroup 0 merges them into its own
//!   ([`SoftmaxState::weight`]) and writes `O / l` and, if asked, the log-sum-exp.
//!
//! A query block's walk holds at least its diagonal block, so every row with a query sees a key
//! in one of the two parts.

use lserve_abi::prefill::{
    mask_words_per_row, PrefillParams, PrefillWorkItem, BLOCK_Q, WGMMA_PREFILL_STAGES as STAGES,
};

use super::block_iter::{TileBlocks, TileMask};
use super::softmax::{rescale_unless_settled, RowSoftmax};
use super::tiles::{MAX_O_TILES, S_TILES};
use super::wgmma::{
    copy_query_block, copy_step, fence_operands_step, init_barriers, issue_pv, issue_scores,
    p_fragments, release, reread_item, write_rows, zero_tails, BlockWork, Maps, Rows, Smem, Step,
    StepScores, CONSUMER_REGISTERS, CONSUMER_WARPS, PRODUCER_REGISTERS,
};
use crate::bulk_copy::{mbarrier_arrive, mbarrier_expect_tx, mbarrier_wait_parity};
use crate::mma::FragC;
use crate::smem::{ld_shared_u32, ld_shared_v4_u32, st_shared_u32, st_shared_v4_u32};
use crate::tile::fragments::n_tiles;
use crate::tile::SoftmaxState;
use crate::warp::shfl_idx_u32;
use crate::wgmma::{claim_registers, fence_operands, release_registers, wait_group, WgmmaElement};

/// A step header's second block when the step has none (the last step of a walk of odd length).
const NO_BLOCK: u32 = u32::MAX;
/// Warps that release a stage: the one warpgroup that consumed it.
const STAGE_CONSUMER_WARPS: u32 = 4;

/// The producer: the walk's length, the query block, then the walk's steps into the ring.
///
/// # Safety
/// One thread of the block; the barriers are initialized; `maps` describe the launch's tensors;
/// `walk`'s blocks lie in the sequence whose keys are rows `kv_row0 ..` of `k` / `v`, and its
/// mask rows hold the words [`TileBlocks::new`] asks for.
#[inline(always)]
unsafe fn produce<const D: usize>(
    smem: Smem<D>,
    maps: Maps,
    walk: TileBlocks<1>,
    q_row0: i32,
    head: u32,
    kv_row0: u32,
    kv_head: u32,
) {
    // The query block's copy first, the walk's length while it lands: the barrier's phase 0
    // completes with this thread's arrival after the length is written (a release) and the
    // block's bytes.
    // SAFETY: the phase expects this thread's arrival and the query block's bytes; nobody reads
    // the header before the phase completes.
    unsafe {
        mbarrier_expect_tx(smem.q_full(), Smem::<D>::TILE_BYTES);
        copy_query_block(smem, maps, 0, q_row0, head);
        st_shared_u32(smem.header(0), walk.count_blocks());
        mbarrier_arrive(smem.q_full());
    }
    let mut walk = walk;
    let mut j = 0;
    while let Some(first) = walk.next() {
        let second = walk.next().map(|b| b.kv_block);
        let stage = j % STAGES;
        if j >= STAGES {
            // Step `j - STAGES`, the stage's previous tenant, was released by its warpgroup:
            // phase `j / STAGES - 1` of the empty barrier.
            // SAFETY: initialized; that phase is the current one or the one before.
            unsafe { mbarrier_wait_parity(smem.empty(stage), (j / STAGES + 1) % 2) };
        }
        // SAFETY: the stage's previous consumer read its header before releasing it; the full
        // barrier of warpgroup `j % 2` for this stage expects this arrival (its previous phase,
        // step `j - 2 STAGES`, completed before step `j - STAGES` was copied), which orders the
        // header words before the consumer's wait.
        unsafe {
            st_shared_u32(smem.header(2 + 2 * stage), first.kv_block);
            st_shared_u32(smem.header(3 + 2 * stage), second.unwrap_or(NO_BLOCK));
            let full = smem.full(j % 2, stage);
            copy_step(
                smem,
                maps,
                stage,
                [Some(first.kv_block), second],
                full,
                kv_row0,
                kv_head,
            );
        }
        j += 1;
    }
}

/// Merges warpgroup 1's part of the rows (its states and `O`, through stage 0) into warpgroup
/// 0's: warpgroup 0 returns the merged states (denominator shares per lane) and `o`; warpgroup
/// 1 returns `None`.
///
/// # Safety
/// Both consumer warpgroups, whole, after their last step (every copy landed, every product
/// waited for), once; nothing else uses stage 0 meanwhile.
#[inline(always)]
unsafe fn merge_parts<const D: usize>(
    smem: &Smem<D>,
    g: u32,
    thread_in_group: u32,
    o: &mut [FragC; MAX_O_TILES],
    softmax: &RowSoftmax,
) -> Option<[SoftmaxState; 2]> {
    // Thread `t`'s words: 16 bytes per chunk, the chunks 2 KiB apart (a warp's stores are one
    // contiguous 512-byte run per chunk).
    let part = smem.k(0) + 16 * thread_in_group;
    let chunk = |c: usize| part + 2048 * c as u32;
    let mine = softmax.lane_states();
    if g == 1 {
        let bits = [mine[0].m, mine[0].l, mine[1].m, mine[1].l].map(f32::to_bits);
        // SAFETY: phase 0 of `merge(0)` completes once warpgroup 0's products (the last readers
        // of stage 0 besides this warpgroup's, which are done) are waited for; stage 0 holds
        // 2 KiB x (1 + D / 8) < its bytes; thread `t`'s own words; the arrival (a release)
        // orders them before warpgroup 0's wait on `merge(1)`.
        unsafe {
            mbarrier_wait_parity(smem.merge(0), 0);
            st_shared_v4_u32(chunk(0), bits);
            crate::unroll16!(n in 0..n_tiles(D) => {
                st_shared_v4_u32(chunk(1 + n), o[n].regs.map(f32::to_bits));
            });
            mbarrier_arrive(smem.merge(1));
        }
        return None;
    }
    // SAFETY: each of the 128 threads arrives once on phase 0 (its products are done), then waits
    // for warpgroup 1's part.
    unsafe {
        mbarrier_arrive(smem.merge(0));
        mbarrier_wait_parity(smem.merge(1), 0);
    }
    // SAFETY: the words warpgroup 1's thread `t` stored.
    let theirs = unsafe { ld_shared_v4_u32(chunk(0)) }.map(f32::from_bits);
    let theirs = [
        SoftmaxState {
            m: theirs[0],
            l: theirs[1],
        },
        SoftmaxState {
            m: theirs[2],
            l: theirs[3],
        },
    ];
    let mut merged = [SoftmaxState::EMPTY; 2];
    let mut weights = [[0.0f32; 2]; 2];
    crate::unroll8!(r in 0..2 => {
        let m = mine[r].m.max(theirs[r].m);
        let (w_mine, w_theirs) = (mine[r].weight(m), theirs[r].weight(m));
        merged[r] = SoftmaxState {
            m,
            l: crate::math::fma(w_theirs, theirs[r].l, w_mine * mine[r].l),
        };
        weights[r] = [w_mine, w_theirs];
    });
    crate::unroll16!(n in 0..n_tiles(D) => {
        // SAFETY: as above.
        let other = unsafe { ld_shared_v4_u32(chunk(1 + n)) }.map(f32::from_bits);
        crate::unroll8!(i in 0..4 => {
            let [w_mine, w_theirs] = weights[i / 2];
            o[n].regs[i] = crate::math::fma(w_theirs, other[i], w_mine * o[n].regs[i]);
        });
    });
    Some(merged)
}

/// The kernel body (see the module docs).
///
/// # Safety
/// Launched with grid `(p.items, p.q_heads)`, [`lserve_abi::prefill::WGMMA_PREFILL_THREADS`]
/// threads and `wgmma_prefill_smem_bytes(D)` bytes of dynamic shared memory; `items` tiles of
/// one query block, as for the `mma.sync` masked kernel, with `mask` holding every item's rows
/// (`mask_row + h * mask_head_stride`, each `mask_words_per_row(seq_len)` words; null: the
/// heads' patterns alone); `maps` and `out` as for [`super::wgmma::prefill_wgmma_attention`];
/// `lse` (unless null) `[query rows][q_heads]` f32.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub unsafe fn prefill_wgmma_masked_attention<E: WgmmaElement, const D: usize>(
    p: &PrefillParams,
    items: *const PrefillWorkItem,
    head_map: *const u32,
    mask: *const u32,
    maps: Maps,
    out: *mut u16,
    lse: *mut f32,
) {
    // SAFETY: the whole warp is here; grid and `head_map` as this function's contract.
    let BlockWork {
        warp,
        lane,
        head,
        kv_head,
        item,
        window,
    } = unsafe { BlockWork::load(p, items, head_map) };
    let seq_len = item.seq_len;
    let q_first = item.q_block * BLOCK_Q;
    let smem = Smem::<D>::new();
    // SAFETY: every thread of the block, once; a stage is released by its one warpgroup.
    unsafe { init_barriers(&smem, warp, lane, 2, STAGE_CONSUMER_WARPS) };

    if warp >= CONSUMER_WARPS {
        // SAFETY: the whole producer warpgroup, once; the copies need far fewer registers.
        unsafe { release_registers::<PRODUCER_REGISTERS>() };
        if warp == CONSUMER_WARPS && lane == 0 {
            let rows = TileMask {
                words: mask,
                row: item.mask_row + head * item.mask_head_stride,
                row_words: mask_words_per_row(seq_len),
            };
            // SAFETY: the mask rows hold `mask_words_per_row(seq_len)` words (launch contract),
            // one per 32 KV blocks of the sequence, and the query block is below that count.
            let walk = unsafe { TileBlocks::<1>::new(window, item.q_block, 1, rows) };
            // Row 0 of the block is position `q_first` (negative for a chunk's block that
            // starts in the cached prefix: those rows land as zeros).
            let q_row0 = item.q_row as i32 + q_first as i32 - item.q_first as i32;
            // SAFETY: one thread; barriers initialized; the maps are the launch's.
            unsafe { produce::<D>(smem, maps, walk, q_row0, head, item.seq_start, kv_head) };
        }
        return;
    }

    // SAFETY: the whole consumer warpgroup, once; with the producer's release the block's
    // registers suffice.
    unsafe { claim_registers::<CONSUMER_REGISTERS>() };
    // Warpgroup `g` takes the steps `g, g + 2, ...`; warp `w` of it rows `16 w ..` of the block.
    let (g, w) = (warp / 4, warp % 4);
    let thread_in_group = 32 * w + lane;
    let q_first_warp = q_first + 16 * w;
    let rows = Rows {
        q_block: item.q_block,
        q_first: q_first_warp,
        seq_len,
        window,
        lane,
    };
    let mut o = [FragC::default(); MAX_O_TILES];
    let mut softmax = RowSoftmax::new(p.scale_log2);
    // SAFETY: phase 0 of the query barrier counts the query block, and the producer wrote the
    // walk's length before its arrival.
    let steps = unsafe {
        mbarrier_wait_parity(smem.q_full(), 0);
        ld_shared_u32(smem.header(0))
    }
    .div_ceil(2);
    let mut j = g;
    while j < steps {
        let stage = j % STAGES;
        // Warpgroup `g`'s steps in a stage are `j = c + 2 STAGES k` (c < 2 STAGES): phase
        // `j / (2 STAGES)` of its full barrier there. The header was written before the phase's
        // arrival.
        // Lane 0 reads the header and broadcasts it: it is the lane whose arrival releases the
        // stage, so the producer's next header words are ordered after this read by that
        // arrival alone.
        // SAFETY: initialized; this warpgroup waits on its barriers' phases in order; the
        // whole warp shuffles.
        let step = unsafe {
            mbarrier_wait_parity(smem.full(g, stage), (j / (2 * STAGES)) % 2);
            let mut words = [0; 2];
            if lane == 0 {
                words = [
                    ld_shared_u32(smem.header(2 + 2 * stage)),
                    ld_shared_u32(smem.header(3 + 2 * stage)),
                ];
            }
            let [first, second] = words.map(|w| shfl_idx_u32(w, 0));
            Step {
                stage,
                blocks: [Some(first), (second != NO_BLOCK).then_some(second)],
                visits: [true, second != NO_BLOCK],
            }
        };
        let mut s: StepScores = [[FragC::default(); S_TILES]; 2];
        // SAFETY: the whole warpgroup; the step's tiles landed.
        unsafe {
            issue_scores::<E, D>(&mut s, smem.q(0), smem.k(stage));
            wait_group::<0>();
        }
        fence_operands_step(&mut s);
        rows.mask(&mut s, &step);
        // SAFETY: the whole warp.
        let corrections = unsafe { softmax.update::<true, 2>(&mut s, &mut o, n_tiles(D)) };
        let mut acc = [o];
        // SAFETY: the whole warp (no product in flight on `o`).
        unsafe { rescale_unless_settled(&mut acc, &[corrections], n_tiles(D)) };
        o = acc[0];
        // SAFETY: the whole warpgroup; the step's V is read by no product yet.
        unsafe { zero_tails(&smem, &step, seq_len, thread_in_group, g) };
        let mut p = p_fragments::<E>(&s);
        // SAFETY: the whole warpgroup; V landed (its tail rows zeroed).
        unsafe {
            issue_pv::<E, D>(&mut o, &mut p, smem.v(stage));
            wait_group::<0>();
        }
        fence_operands(&mut o);
        // SAFETY: the whole warp; it waited for the step's full phase and its products that
        // read the stage are done.
        unsafe { release(smem.empty(stage), lane) };
        j += 2;
    }

    // SAFETY: both warpgroups, past their last step.
    if let Some(merged) = unsafe { merge_parts(&smem, g, thread_in_group, &mut o, &softmax) } {
        // SAFETY: the whole warp; the rows' keys are all in `o` and `merged`.
        unsafe {
            let totals = [merged[0].quad_total(), merged[1].quad_total()];
            let item = reread_item(items);
            write_rows::<E, D>(p, &item, head, q_first_warp, &o, totals, out, lse, lane)
        };
    }
}
