//! Hopper prefill attention (sm_90a): `wgmma` products from shared memory, tensor-map copies
//! into an `mbarrier` ring, and a producer warp beside two consumer warpgroups (the
//! FlashAttention-3 structure), for launches without caller masks and without the
//! log-sum-exp. Same work items, head patterns and walk as the `mma.sync` kernel
//! ([`super::prefill_attention`]): a tile of two query blocks, the union of their KV blocks
//! ([`TileSpan`]), taken [`WGMMA_STEP_BLOCKS`] at a time: step `j` is the walk's blocks `2j`
//! and `2j + 1` (adjacent or not: the sink range's last block and the local range's first
//! share a step), 128 keys, so `S` is one `64 x 128` product per `k16`.
//!
//! Block `(x, h)`, [`WGMMA_PREFILL_THREADS`] threads:
//! - **warps 8-11, the producer warpgroup**, give their registers to the consumers
//!   ([`release_registers`]); one thread of warp 8 copies the query tile (two 64-row blocks of
//!   `D` columns, `D / 64` boxes each) once, then, per step, waits until its stage of the
//!   [`STAGES`]-deep ring is free (the stage's *empty* barrier: every consumer warp arrived) and
//!   copies the step's two K and V blocks into it, counted in bytes on the stage's *full*
//!   barrier. A walk of odd length ends in a step whose second block is absent: its boxes are
//!   copied from row `-64`, wholly outside the tensor, so they land as zeros.
//! - **warpgroup `g` = warps `4g .. 4g + 4`, a consumer** ([`claim_registers`]), owns query
//!   block `g` of the tile (64 rows, 16 per warp). Its steps run through the one holding its
//!   diagonal, pipelined: `S_j = Q K_jᵀ` (`D / 16` products `m64n128k16`, both operands in shared
//!   memory) is issued together with `O += P_{j-1} V_{j-1}` (8 products `m64nDk16`, `P` from
//!   registers, V read transposed); once `S_j` is in, its masks (per block [`mask::apply`] where
//!   needed, all `-inf` for a block the warpgroup does not visit) and the online softmax over
//!   both blocks ([`RowSoftmax`]; the accumulators hold `mma.sync`'s fragment layout) run while
//!   `P V` does; then `O` is rescaled, step `j - 1`'s stage released (one arrival per warp on
//!   its empty barrier) and `P_j` packed. The steps after its own it waits for and releases, so
//!   no warp arrives twice in one phase.
//! - The output `O / l` is written from the registers, as in the `mma.sync` kernel.
//!
//! The two consumer warpgroups share the tensor cores: while one runs its softmax the other's
//! products run. V rows past the sequence's end (only in the tile's last block, which only the
//! last query block's warpgroup visits) are zeroed in shared memory before its `P V`, since
//! the copy brings whatever follows the sequence (`0 · inf` would be NaN).

use lserve_abi::prefill::{
    wgmma_prefill_smem_bytes, PrefillParams, PrefillWorkItem, BLOCK_KV, BLOCK_Q, TILE_Q,
    TILE_Q_BLOCKS, WGMMA_BOX_COLUMNS, WGMMA_PREFILL_BARRIERS, WGMMA_PREFILL_HEADER_WORDS,
    WGMMA_PREFILL_STAGES as STAGES, WGMMA_PREFILL_THREADS, WGMMA_STEP_BLOCKS,
};

use super::block_iter::{SpanVisitor, TileSpan, Window};
use super::mask;
use super::softmax::{rescale_unless_settled, RowSoftmax};
use super::tiles::{MAX_O_TILES, S_TILES};
use crate::bulk_copy::{
    fence_mbarrier_init, fence_proxy_async_shared, mbarrier_arrive, mbarrier_arrive_expect_tx,
    mbarrier_init, mbarrier_wait_parity, tensor_copy_3d,
};
use crate::math::opaque_u32;
use crate::mma::{FragA, FragC};
use crate::smem::{dynamic_smem, shared_addr, st_shared_v4_u32};
use crate::sync::{sync_named, sync_threads, sync_warp};
use crate::thread::{block_idx_x, block_idx_y, lane, warp_in_block, WARP_SIZE};
use crate::tile::fragments::{k_steps, n_tiles, p_fragment};
use crate::tile::SoftmaxState;
use crate::warp::shfl_idx_u32;
use crate::wgmma::{
    claim_registers, commit_group, fence, fence_fragments, fence_operands, mma_64x128_ss,
    mma_64xn_rs, release_registers, wait_group, SmemDesc, WgmmaElement,
};

/// Consumer warps (two warpgroups); the producer warpgroup is the four after them.
pub(super) const CONSUMER_WARPS: u32 = 8;
/// Registers per thread of the consumer warpgroups and of the producer warpgroup after the
/// reallocation ([`claim_registers`], [`release_registers`]): the block is launched with
/// `65536 / 384 = 168` per thread (the register file, rounded down to a multiple of 8), and
/// `2 · 128 · 232 + 128 · 40 = 384 · 168`.
pub(super) const CONSUMER_REGISTERS: u32 = 232;
pub(super) const PRODUCER_REGISTERS: u32 = 40;
const _: () =
    assert!(2 * 128 * CONSUMER_REGISTERS + 128 * PRODUCER_REGISTERS == WGMMA_PREFILL_THREADS * 168);
/// Bytes of one tensor-map box: 64 rows of 128 bytes, the swizzle's atoms (8 rows, 1024 bytes)
/// back to back.
const BOX_BYTES: u32 = BLOCK_KV * 128;
/// Bytes of a step's column group: its blocks' boxes of the same 64 columns, back to back (so
/// the step's 128 rows are one K-major operand).
const STEP_BOX_BYTES: u32 = WGMMA_STEP_BLOCKS * BOX_BYTES;
/// Bytes between 8-row groups of a swizzled tile.
const ATOM_BYTES: u32 = 1024;

const _: () = assert!(
    WGMMA_PREFILL_THREADS == (CONSUMER_WARPS + 4) * WARP_SIZE
        && TILE_Q_BLOCKS == 2
        && BLOCK_Q == 64
        && BLOCK_KV == 64
        && TILE_Q == 128
        && WGMMA_BOX_COLUMNS == 64
        && WGMMA_STEP_BLOCKS == 2
        && S_TILES == 8
);

/// Scores of a step for a warp's 16 rows: per block of the step, 8 accumulators of 8 keys.
pub(super) type StepScores = [[FragC; S_TILES]; WGMMA_STEP_BLOCKS as usize];

/// Where the tiles and barriers live (shared-window addresses from a 1024-byte aligned base):
/// the query tile (query block `g`'s 64 rows at `q(g)`, its `D / 64` column boxes
/// [`BOX_BYTES`] apart), the stages (a K then a V tile of a step: per 64 columns a
/// [`STEP_BOX_BYTES`] group holding block 0's box then block 1's), the barriers, the step
/// headers.
#[derive(Clone, Copy)]
pub(super) struct Smem<const D: usize> {
    base: u32,
}

impl<const D: usize> Smem<D> {
    /// Bytes of one 64-row tile of `D` columns.
    pub(super) const TILE_BYTES: u32 = (D as u32 / WGMMA_BOX_COLUMNS) * BOX_BYTES;
    /// Bytes of a step's K (or V) tile.
    const STEP_BYTES: u32 = WGMMA_STEP_BLOCKS * Self::TILE_BYTES;

    /// The layout in this block's dynamic shared memory.
    #[inline(always)]
    pub(super) fn new() -> Self {
        let raw = shared_addr(dynamic_smem::<u8>(0));
        Self {
            base: (raw + ATOM_BYTES - 1) & !(ATOM_BYTES - 1),
        }
    }

    /// Query block `g`'s rows of the query tile.
    #[inline(always)]
    pub(super) fn q(&self, g: u32) -> u32 {
        self.base + g * Self::TILE_BYTES
    }

    /// The K tile of `stage`.
    #[inline(always)]
    pub(super) fn k(&self, stage: u32) -> u32 {
        self.base + TILE_Q_BLOCKS * Self::TILE_BYTES + 2 * stage * Self::STEP_BYTES
    }

    /// The V tile of `stage`.
    #[inline(always)]
    pub(super) fn v(&self, stage: u32) -> u32 {
        self.k(stage) + Self::STEP_BYTES
    }

    /// The barriers: the query tile's, then per consumer set (`set` 0 and 1) and stage a full
    /// one, then per stage an empty one.
    #[inline(always)]
    fn barrier(&self, i: u32) -> u32 {
        self.base + TILE_Q_BLOCKS * Self::TILE_BYTES + 2 * STAGES * Self::STEP_BYTES + 8 * i
    }

    #[inline(always)]
    pub(super) fn q_full(&self) -> u32 {
        self.barrier(0)
    }

    /// The full barrier of `stage` for the consumers of set `set` (the unmasked kernel's two
    /// warpgroups wait on set 0 together; the masked kernel's warpgroup `g` on set `g`).
    #[inline(always)]
    pub(super) fn full(&self, set: u32, stage: u32) -> u32 {
        self.barrier(1 + set * STAGES + stage)
    }

    #[inline(always)]
    pub(super) fn empty(&self, stage: u32) -> u32 {
        self.barrier(1 + 2 * STAGES + stage)
    }

    /// The masked kernel's merge barriers: `merge(0)` completes when warpgroup 0's products
    /// are all done, `merge(1)` when warpgroup 1's part is written (each one arrival per thread
    /// of the warpgroup).
    #[inline(always)]
    pub(super) fn merge(&self, i: u32) -> u32 {
        self.barrier(1 + 3 * STAGES + i)
    }

    /// Word `i` of the step headers (after the barriers): word 0 the walk's length, words
    /// `2 + 2 s`, `3 + 2 s` the KV blocks of the step in stage `s`.
    #[inline(always)]
    pub(super) fn header(&self, i: u32) -> u32 {
        self.barrier(WGMMA_PREFILL_BARRIERS) + 4 * i
    }
}

/// The end of [`Smem`]'s layout: query tile `q` bytes per block, stage `step` bytes per tile.
const fn layout_end(q: u32, step: u32) -> u32 {
    1024 + TILE_Q_BLOCKS * q
        + 2 * STAGES * step
        + 8 * WGMMA_PREFILL_BARRIERS
        + 4 * WGMMA_PREFILL_HEADER_WORDS
}
const _: () = assert!(WGMMA_PREFILL_BARRIERS == 3 + 3 * STAGES);

// The layout fits what the host sizes.
const _: () = {
    let (q128, step128) = (Smem::<128>::TILE_BYTES, Smem::<128>::STEP_BYTES);
    assert!(wgmma_prefill_smem_bytes(128) == layout_end(q128, step128));
    let (q64, step64) = (Smem::<64>::TILE_BYTES, Smem::<64>::STEP_BYTES);
    assert!(wgmma_prefill_smem_bytes(64) == layout_end(q64, step64));
};

/// The descriptor of a K-major operand at `tile` (rows of `D` columns, column groups of 64
/// `group_bytes` apart) for columns `16 kk .. 16 kk + 16`: group `kk / 4`, 32 bytes per step
/// inside the 128-byte rows.
#[inline(always)]
fn k_major(tile: u32, group_bytes: u32, kk: usize) -> SmemDesc {
    let kk = kk as u32;
    SmemDesc::swizzled_128b(
        tile + (kk / 4) * group_bytes + (kk % 4) * 32,
        16,
        ATOM_BYTES,
    )
}

/// The descriptor of a step's V tile at `tile` as the MN-major `B` of `P V` for the step's keys
/// `16 kk .. 16 kk + 16`: two 8-row atoms per step, the 64-column groups [`STEP_BOX_BYTES`]
/// apart.
#[inline(always)]
fn v_operand(tile: u32, kk: usize) -> SmemDesc {
    SmemDesc::swizzled_128b(
        tile + kk as u32 * 2 * ATOM_BYTES,
        STEP_BOX_BYTES,
        ATOM_BYTES,
    )
}

/// The tensor maps of `q`, `k`, `v` (generic addresses of kernel parameters).
#[derive(Clone, Copy)]
pub struct Maps {
    /// `q` as `(D, q_heads, query rows)`.
    pub q: *const u8,
    /// `k` as `(D, kv_heads, tokens)`.
    pub k: *const u8,
    /// `v` as `k`.
    pub v: *const u8,
}

/// What both Hopper prefill kernels read first: the warp index, the lane, the block's query head and
/// its KV head, its work item, and the KV head's pattern.
///
/// The warp index is broadcast from lane 0: ptxas then knows it is warp-uniform and keeps it
/// and what derives from it (the warp's rows, query block and walk bounds) in uniform registers
/// beside the per-thread ones (CUTLASS's `canonical_warp_idx_sync` does the same). The lane is
/// taken `% WARP_SIZE`, which gives LLVM its range (the `%laneid` read is opaque to it): the
/// lane-derived parts of fragment addresses then fold with the per-step offsets into immediates
/// rather than into loop-invariant registers, which ptxas would spend on issuing fragment loads
/// further ahead of their products.
#[derive(Clone, Copy)]
pub(super) struct BlockWork {
    pub(super) warp: u32,
    pub(super) lane: u32,
    pub(super) head: u32,
    pub(super) kv_head: u32,
    pub(super) item: PrefillWorkItem,
    pub(super) window: Window,
}

impl BlockWork {
    /// # Safety
    /// The whole warp, before any divergence; the grid is `(items, q_heads)` and `head_map`
    /// holds an entry per KV head of `p` (the host checks both).
    #[inline(always)]
    pub(super) unsafe fn load(
        p: &PrefillParams,
        items: *const PrefillWorkItem,
        head_map: *const u32,
    ) -> Self {
        let lane = lane() % WARP_SIZE;
        // SAFETY: the whole warp is here.
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
        Self {
            warp,
            lane,
            head,
            kv_head,
            item,
            window: Window::of_head(entry, p.sink_tokens, p.local_tokens),
        }
    }
}

/// The blocks of step `j` of `span`: the walk's blocks `2j` and `2j + 1`, the second `None`
/// past the walk's end.
#[inline(always)]
pub(super) fn step_blocks(span: &TileSpan, j: u32) -> [Option<u32>; 2] {
    let i = WGMMA_STEP_BLOCKS * j;
    [
        Some(span.kv_block(i)),
        (i + 1 < span.len()).then(|| span.kv_block(i + 1)),
    ]
}

/// The producer: the query tile, then every step of the walk into its stage.
///
/// # Safety
/// One thread of the block; the barriers are initialized; `maps` describe the launch's tensors.
#[inline(always)]
unsafe fn produce<const D: usize>(
    smem: Smem<D>,
    maps: Maps,
    span: TileSpan,
    q_row0: i32,
    head: u32,
    kv_row0: u32,
    kv_head: u32,
) {
    // SAFETY: the query barrier's phase 0 expects this arrival and the tile's bytes.
    unsafe {
        mbarrier_arrive_expect_tx(smem.q_full(), TILE_Q_BLOCKS * Smem::<D>::TILE_BYTES);
        let mut g = 0;
        while g < TILE_Q_BLOCKS {
            copy_query_block(smem, maps, g, q_row0 + (g * BLOCK_Q) as i32, head);
            g += 1;
        }
    }
    let steps = span.len().div_ceil(WGMMA_STEP_BLOCKS);
    let mut j = 0;
    while j < steps {
        let stage = j % STAGES;
        if j >= STAGES {
            // Step `j - STAGES`, the stage's previous tenant, is done in every consumer warp:
            // phase `j / STAGES - 1` of the empty barrier.
            // SAFETY: initialized; that phase is the current one or the one before.
            unsafe { mbarrier_wait_parity(smem.empty(stage), (j / STAGES + 1) % 2) };
        }
        // SAFETY: the stage's full barrier's phase `j / STAGES` expects this arrival (its
        // previous phase completed before the empty barrier's did); nobody reads the stage's
        // tiles before that phase completes.
        unsafe {
            let full = smem.full(0, stage);
            copy_step(
                smem,
                maps,
                stage,
                step_blocks(&span, j),
                full,
                kv_row0,
                kv_head,
            )
        };
        j += 1;
    }
}

/// Copies the K and V boxes of a step's `blocks` into `stage`, counted on the barrier `full`
/// (one arrival with the step's bytes). An absent block's boxes are read from rows `-64 .. 0`,
/// outside the tensor: zeros, all bytes counted.
///
/// # Safety
/// One thread; `full`'s current phase expects this arrival and nobody reads the stage's tiles
/// until it completes; `maps` describe the launch's `k` and `v`, whose rows `kv_row0 + 64 b ..`
/// hold the blocks `b`.
#[inline(always)]
pub(super) unsafe fn copy_step<const D: usize>(
    smem: Smem<D>,
    maps: Maps,
    stage: u32,
    blocks: [Option<u32>; 2],
    full: u32,
    kv_row0: u32,
    kv_head: u32,
) {
    let boxes = D as u32 / WGMMA_BOX_COLUMNS;
    // SAFETY: forwarded; the boxes land in the stage's tiles.
    unsafe {
        mbarrier_arrive_expect_tx(full, 2 * Smem::<D>::STEP_BYTES);
        crate::unroll8!(h in 0..WGMMA_STEP_BLOCKS as usize => {
            let row = match blocks[h] {
                Some(kv_block) => (kv_row0 + kv_block * BLOCK_KV) as i32,
                None => -(BLOCK_KV as i32),
            };
            let mut b = 0;
            while b < boxes {
                let col = (b * WGMMA_BOX_COLUMNS) as i32;
                let at = b * STEP_BOX_BYTES + h as u32 * BOX_BYTES;
                tensor_copy_3d(smem.k(stage) + at, maps.k, col, kv_head as i32, row, full);
                tensor_copy_3d(smem.v(stage) + at, maps.v, col, kv_head as i32, row, full);
                b += 1;
            }
        });
    }
}

/// Copies query block `g`'s tile (its `D / 64` boxes from row `q_row0`; rows outside the tensor
/// land as zeros), counted on the query barrier.
///
/// # Safety
/// One thread; the query barrier's current phase expects these bytes (a preceding
/// `mbarrier_arrive_expect_tx`); `maps.q` describes the launch's `q`.
#[inline(always)]
pub(super) unsafe fn copy_query_block<const D: usize>(
    smem: Smem<D>,
    maps: Maps,
    g: u32,
    q_row0: i32,
    head: u32,
) {
    let mut b = 0;
    while b < D as u32 / WGMMA_BOX_COLUMNS {
        // SAFETY: forwarded; each box lands in its own 1024-byte aligned 8 KiB of the tile.
        unsafe {
            tensor_copy_3d(
                smem.q(g) + b * BOX_BYTES,
                maps.q,
                (b * WGMMA_BOX_COLUMNS) as i32,
                head as i32,
                q_row0,
                smem.q_full(),
            )
        };
        b += 1;
    }
}

/// Zeroes rows `valid .. 64` of the V block at `block` (a step's V tile plus the block's box
/// offset: its column boxes [`STEP_BOX_BYTES`] apart), generic-proxy stores then ordered before
/// the warpgroup's products: one warpgroup, 16-byte stores.
///
/// # Safety
/// The whole warpgroup `g` (threads `128 g ..`) calls it, after the tile landed and before its
/// products read it; nobody else reads the tile meanwhile.
#[inline(always)]
unsafe fn zero_v_rows<const D: usize>(block: u32, valid: u32, thread_in_group: u32, g: u32) {
    let chunks_per_row = D as u32 / 8;
    let chunks = (BLOCK_KV - valid) * chunks_per_row;
    let mut c = thread_in_group;
    while c < chunks {
        let (row, chunk) = (valid + c / chunks_per_row, c % chunks_per_row);
        let (b, within) = (chunk / 8, chunk % 8);
        let at = block + b * STEP_BOX_BYTES + row * 128 + within * 16;
        // SAFETY: row < 64, box < D / 64: inside the block; whole 16-byte chunks of the row (the
        // swizzle only permutes a row's chunks, so every chunk of the row is zeroed).
        unsafe { st_shared_v4_u32(at, [0; 4]) };
        c += 128;
    }
    fence_proxy_async_shared();
    // SAFETY: the warpgroup's 128 threads, barrier 1 + g is this warpgroup's alone.
    unsafe {
        if g == 0 {
            sync_named::<1>(128)
        } else {
            sync_named::<2>(128)
        }
    };
}

/// This warp is done with a stage: one arrival (lane 0's) on its empty barrier.
///
/// # Safety
/// The whole warp; the stage's current phase of `empty` still expects this warp's arrival.
#[inline(always)]
pub(super) unsafe fn release(empty: u32, lane: u32) {
    // SAFETY: forwarded.
    unsafe {
        sync_warp();
        if lane == 0 {
            mbarrier_arrive(empty);
        }
    }
}

/// `O += P V` for this warpgroup: `P` the eight 16-key `A` fragments of a step, V the step's
/// tile at `v_tile` (issued, not waited for).
///
/// # Safety
/// The whole warpgroup, after a [`fence`]; the tile landed and stays until the products are
/// waited for.
#[inline(always)]
unsafe fn accumulate_pv<E: WgmmaElement, const D: usize>(
    o: &mut [FragC; MAX_O_TILES],
    p: &[FragA<E>; 8],
    v_tile: u32,
) {
    // SAFETY: forwarded; the casts view the first `D / 8` accumulators (the ones in use).
    unsafe {
        if D == 128 {
            let acc = &mut *(o as *mut [FragC; MAX_O_TILES]).cast::<[FragC; 16]>();
            crate::unroll8!(kk in 0..8 => {
                mma_64xn_rs::<E, 16>(acc, &p[kk], v_operand(v_tile, kk));
            });
        } else {
            let acc = &mut *(o as *mut [FragC; MAX_O_TILES]).cast::<[FragC; 8]>();
            crate::unroll8!(kk in 0..8 => {
                mma_64xn_rs::<E, 8>(acc, &p[kk], v_operand(v_tile, kk));
            });
        }
    }
}

/// Issues `S = Q Kᵀ` into `s` for this warpgroup's query block (its tile at `q_tile`) and a
/// step's 128 keys (the K tile at `k_tile`), as one committed group (not waited for).
///
/// # Safety
/// The whole warpgroup; the tiles landed; `s` is read only after a wait covers the group.
#[inline(always)]
pub(super) unsafe fn issue_scores<E: WgmmaElement, const D: usize>(
    s: &mut StepScores,
    q_tile: u32,
    k_tile: u32,
) {
    // The step's two blocks as one 64x128 accumulator (arrays of arrays have no padding).
    // SAFETY: the same 16 `FragC`s.
    let acc = unsafe { &mut *(s as *mut StepScores).cast::<[FragC; 16]>() };
    // Every accumulator defined before the products start (ptxas serializes products whose
    // accumulators a plain instruction writes between them).
    fence_operands(acc);
    // SAFETY: forwarded.
    unsafe {
        fence();
        crate::unroll8!(kk in 0..k_steps(D) => {
            mma_64x128_ss::<E>(
                acc,
                k_major(q_tile, BOX_BYTES, kk),
                k_major(k_tile, STEP_BOX_BYTES, kk),
                kk > 0,
            );
        });
        commit_group();
    }
}

/// Issues `O += P V` for this warpgroup (`P` the step's eight 16-key `A` fragments, V the
/// step's tile at `v_tile`) as one committed group (not waited for).
///
/// # Safety
/// The whole warpgroup; V landed (its tail rows zeroed); `o` and `p` are neither read nor
/// written before a wait covers the group.
#[inline(always)]
pub(super) unsafe fn issue_pv<E: WgmmaElement, const D: usize>(
    o: &mut [FragC; MAX_O_TILES],
    p: &mut [FragA<E>; 8],
    v_tile: u32,
) {
    fence_operands(o);
    fence_fragments(p);
    // SAFETY: forwarded.
    unsafe {
        fence();
        accumulate_pv::<E, D>(o, p, v_tile);
        commit_group();
    }
}

/// [`fence_operands`] for both blocks of a step's scores.
#[inline(always)]
pub(super) fn fence_operands_step(s: &mut StepScores) {
    fence_operands(&mut s[0]);
    fence_operands(&mut s[1]);
}

/// Where one step's scores come from: its blocks and which of them this warpgroup visits.
#[derive(Clone, Copy)]
pub(super) struct Step {
    pub(super) stage: u32,
    pub(super) blocks: [Option<u32>; 2],
    pub(super) visits: [bool; 2],
}

impl Step {
    #[inline(always)]
    fn new(span: &TileSpan, visitor: &SpanVisitor, j: u32) -> Self {
        let blocks = step_blocks(span, j);
        Self {
            stage: j % STAGES,
            blocks,
            visits: blocks.map(|b| b.is_some_and(|kv_block| visitor.visits(span, kv_block))),
        }
    }
}

/// One consumer warp's rows: their query block, first position and pattern.
pub(super) struct Rows {
    pub(super) q_block: u32,
    pub(super) q_first: u32,
    pub(super) seq_len: u32,
    pub(super) window: Window,
    pub(super) lane: u32,
}

impl Rows {
    /// The masks of a step's scores: `-inf` for a block this warpgroup does not visit, element
    /// masks for a visited block that needs them.
    #[inline(always)]
    pub(super) fn mask(&self, s: &mut StepScores, step: &Step) {
        crate::unroll8!(h in 0..2 => {
            let kv_block = step.blocks[h].unwrap_or(0);
            if !step.visits[h] {
                s[h] = [FragC { regs: [f32::NEG_INFINITY; 4] }; S_TILES];
            } else if self.window.needs_mask(self.q_block, kv_block, self.seq_len) {
                let (q_first, k_first) = (opaque_u32(self.q_first), kv_block * BLOCK_KV);
                mask::apply(&mut s[h], self.window, q_first, k_first, self.lane);
            }
        });
    }
}

/// Zeroes the V rows past the sequence's end in a step's visited blocks (only the sequence's
/// last block has them, and only the last query block's warpgroup visits it).
///
/// # Safety
/// The whole warpgroup `g`; the step's tiles landed; no product reads its V meanwhile.
#[inline(always)]
pub(super) unsafe fn zero_tails<const D: usize>(
    smem: &Smem<D>,
    step: &Step,
    seq_len: u32,
    thread_in_group: u32,
    g: u32,
) {
    crate::unroll8!(h in 0..2 => {
        let valid = seq_len - step.blocks[h].unwrap_or(0) * BLOCK_KV;
        if step.visits[h] && valid < BLOCK_KV {
            let block = smem.v(step.stage) + h as u32 * BOX_BYTES;
            // SAFETY: forwarded (uniform in the warpgroup).
            unsafe { zero_v_rows::<D>(block, valid, thread_in_group, g) };
        }
    });
}

/// `P` as `A` fragments, all eight packed before the products (a register written between two
/// products would make ptxas fence them apart).
#[inline(always)]
pub(super) fn p_fragments<E: WgmmaElement>(s: &StepScores) -> [FragA<E>; 8] {
    core::array::from_fn(|kk| {
        let (h, n) = (kk / 4, 2 * (kk % 4));
        p_fragment::<E, 16>(&s[h][n], &s[h][n + 1])
    })
}

/// The kernel body (see the module docs).
///
/// # Safety
/// Launched with grid `(p.items, p.q_heads)`, [`WGMMA_PREFILL_THREADS`] threads and
/// `wgmma_prefill_smem_bytes(D)` bytes of dynamic shared memory; `items` as for
/// [`super::prefill_attention`] (tiles of [`TILE_Q_BLOCKS`] query blocks); `maps` the tensor
/// maps of `q` (`(D, q_heads, query rows)`), `k` and `v` (`(D, kv_heads, tokens)`) with boxes
/// `(64, 1, 64)` and the 128-byte swizzle; `out` holds the query rows (16-byte aligned); with
/// `LSE`, `lse` (unless null) `[query rows][q_heads]` f32 (without, it is not read).
#[inline(always)]
pub unsafe fn prefill_wgmma_attention<E: WgmmaElement, const D: usize, const LSE: bool>(
    p: &PrefillParams,
    items: *const PrefillWorkItem,
    head_map: *const u32,
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
    let tile_blocks = (seq_len.div_ceil(BLOCK_Q) - item.q_block).min(TILE_Q_BLOCKS);
    let span = TileSpan::new(window, item.q_block, tile_blocks);
    let smem = Smem::<D>::new();

    // SAFETY: every thread of the block, once; both warpgroups release every stage.
    unsafe { init_barriers(&smem, warp, lane, 1, CONSUMER_WARPS) };

    if warp >= CONSUMER_WARPS {
        // SAFETY: the whole producer warpgroup, once; the copies need far fewer registers.
        unsafe { release_registers::<PRODUCER_REGISTERS>() };
        if warp == CONSUMER_WARPS && lane == 0 {
            // The tile's row 0 is position `q_first`, row `q_row + q_first - q_first_of_item`
            // of `q` (negative for a chunk's tile that starts in the cached prefix: those rows
            // land as zeros).
            let q_row0 = item.q_row as i32 + q_first as i32 - item.q_first as i32;
            // SAFETY: one thread; barriers initialized; the maps are the launch's.
            unsafe {
                produce::<D>(smem, maps, span, q_row0, head, item.seq_start, kv_head);
            }
        }
        return;
    }

    // SAFETY: the whole consumer warpgroup, once; with the producer's release the block's
    // registers suffice (the constants' assertion).
    unsafe { claim_registers::<CONSUMER_REGISTERS>() };
    // A consumer warp: warpgroup `g`, query block `g` of the tile, rows `16 w ..` of it.
    let (g, w) = (warp / 4, warp % 4);
    let my_q_block = item.q_block + g;
    let visitor = span.visitor(window, my_q_block, g < tile_blocks);
    let q_first_warp = q_first + g * BLOCK_Q + 16 * w;
    let mut o = [FragC::default(); MAX_O_TILES];
    let mut softmax = RowSoftmax::new(p.scale_log2);
    // SAFETY: phase 0 of the query barrier counts the query tile.
    unsafe { mbarrier_wait_parity(smem.q_full(), 0) };

    let rows = Rows {
        q_block: my_q_block,
        q_first: q_first_warp,
        seq_len,
        window,
        lane,
    };
    let thread_in_group = 32 * w + lane;
    let steps = span.len().div_ceil(WGMMA_STEP_BLOCKS);
    // This warpgroup's steps: up to the one holding its diagonal (none for a query block past
    // the sequence's end). Every step before it holds a block it visits.
    let mine = if g < tile_blocks {
        span.position(my_q_block) / WGMMA_STEP_BLOCKS + 1
    } else {
        0
    };
    let wait_full = |j: u32| {
        // SAFETY: step `j` is phase `j / STAGES` of its stage's full barrier.
        unsafe { mbarrier_wait_parity(smem.full(0, j % STAGES), (j / STAGES) % 2) }
    };
    if mine > 0 {
        // Step 0: its scores and probabilities.
        let first = Step::new(&span, &visitor, 0);
        wait_full(0);
        let mut s: StepScores = [[FragC::default(); S_TILES]; 2];
        // SAFETY: the whole warpgroup; the tiles landed.
        unsafe {
            issue_scores::<E, D>(&mut s, smem.q(g), smem.k(0));
            wait_group::<0>();
        }
        fence_operands_step(&mut s);
        rows.mask(&mut s, &first);
        // `O` is zero: no correction to apply.
        // SAFETY: the whole warp.
        unsafe { softmax.update::<true, 2>(&mut s, &mut o, n_tiles(D)) };
        // SAFETY: the whole warpgroup; step 0's tiles landed, no product reads them.
        unsafe { zero_tails(&smem, &first, seq_len, thread_in_group, g) };
        let mut p = p_fragments::<E>(&s);
        let mut prev = first;
        // Step `j`'s `S` and step `j - 1`'s `P V` in flight together; step `j`'s softmax while
        // `P V` runs.
        let mut j = 1;
        while j < mine {
            let step = Step::new(&span, &visitor, j);
            wait_full(j);
            let mut s: StepScores = [[FragC::default(); S_TILES]; 2];
            // SAFETY: the whole warpgroup; step `j`'s tiles and step `j - 1`'s V landed (its
            // tail rows zeroed).
            unsafe {
                issue_scores::<E, D>(&mut s, smem.q(g), smem.k(step.stage));
                issue_pv::<E, D>(&mut o, &mut p, smem.v(prev.stage));
                wait_group::<1>();
            }
            fence_operands_step(&mut s);
            rows.mask(&mut s, &step);
            // SAFETY: the whole warp (`o` is not touched: the corrections are returned).
            let corrections = unsafe { softmax.update::<true, 2>(&mut s, &mut o, n_tiles(D)) };
            // SAFETY: the whole warpgroup; step `j`'s V is not read by the product in flight.
            unsafe { zero_tails(&smem, &step, seq_len, thread_in_group, g) };
            // SAFETY: the whole warpgroup.
            unsafe { wait_group::<0>() };
            fence_operands(&mut o);
            fence_fragments(&mut p);
            let mut acc = [o];
            // SAFETY: the whole warp.
            unsafe { rescale_unless_settled(&mut acc, &[corrections], n_tiles(D)) };
            o = acc[0];
            // SAFETY: the whole warp; it waited for step `j - 1`'s full phase, and its products
            // that read the stage are done.
            unsafe { release(smem.empty(prev.stage), lane) };
            p = p_fragments::<E>(&s);
            prev = step;
            j += 1;
        }
        // SAFETY: the whole warpgroup; the last step's V landed (its tail rows zeroed).
        unsafe {
            issue_pv::<E, D>(&mut o, &mut p, smem.v(prev.stage));
            wait_group::<0>();
        }
        fence_operands(&mut o);
        // SAFETY: as in the loop.
        unsafe { release(smem.empty(prev.stage), lane) };
    }
    // The steps after this warpgroup's: waited for and released, so every phase gets every
    // consumer warp's arrival.
    let mut j = mine;
    while j < steps {
        wait_full(j);
        // SAFETY: the whole warp; it waited for this step's full phase.
        unsafe { release(smem.empty(j % STAGES), lane) };
        j += 1;
    }

    // SAFETY: the whole warp; the rows' keys are all in `o` and `softmax`; the item is the
    // block's (with the log-sum-exp read again: the D 128 kernel spills 20 bytes if its pointer
    // and the item stay live across the loop).
    unsafe {
        let totals = softmax.totals();
        let (item, lse) = if LSE {
            (reread_item(items), lse)
        } else {
            (item, core::ptr::null_mut())
        };
        write_rows::<E, D>(p, &item, head, q_first_warp, &o, totals, out, lse, lane)
    };
}

/// Initializes the barriers (one thread of the producer warp: the query tile's, `sets` full
/// barriers per stage with one arrival each, the empty ones with `empty_arrivals`, the merge
/// barriers with a warpgroup's threads), then a block-wide barrier.
///
/// # Safety
/// Every thread of the block, once, before any barrier is used.
#[inline(always)]
pub(super) unsafe fn init_barriers<const D: usize>(
    smem: &Smem<D>,
    warp: u32,
    lane: u32,
    sets: u32,
    empty_arrivals: u32,
) {
    if warp == CONSUMER_WARPS && lane == 0 {
        // SAFETY: this block's barrier words, unused until the barrier below.
        unsafe {
            mbarrier_init(smem.q_full(), 1);
            let mut s = 0;
            while s < STAGES {
                let mut set = 0;
                while set < sets {
                    mbarrier_init(smem.full(set, s), 1);
                    set += 1;
                }
                mbarrier_init(smem.empty(s), empty_arrivals);
                s += 1;
            }
            mbarrier_init(smem.merge(0), 128);
            mbarrier_init(smem.merge(1), 128);
        }
        fence_mbarrier_init();
    }
    // SAFETY: forwarded.
    unsafe { sync_threads() };
}

/// The block's work item read again from memory, opaque to LLVM (for the epilogue of a kernel
/// whose registers are short: nothing derived from the first read is kept live across the loop).
///
/// # Safety
/// `items` holds the block's item.
#[inline(always)]
pub(super) unsafe fn reread_item(items: *const PrefillWorkItem) -> PrefillWorkItem {
    // SAFETY: forwarded.
    unsafe { core::ptr::read_volatile(items.add(block_idx_x() as usize)) }
}

/// Writes `O / l` of this warp's rows that have queries (16 rows from position `q_first_warp`
/// of `item`'s sequence, `totals` their final softmax states) to `out`, and their log-sum-exp
/// to `lse` unless it is null (after every output, one lane per row).
///
/// # Safety
/// The whole warp; `out` holds the launch's query rows (`[rows][q_heads][D]` at the output
/// stride), `lse` (if not null) `[rows][q_heads]` f32.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn write_rows<E: WgmmaElement, const D: usize>(
    p: &PrefillParams,
    item: &PrefillWorkItem,
    head: u32,
    q_first_warp: u32,
    o: &[FragC; MAX_O_TILES],
    totals: [SoftmaxState; 2],
    out: *mut u16,
    lse: *mut f32,
    lane: u32,
) {
    let out_stride = opaque_u32(p.strides.out) as usize * D;
    let row_offset = item.q_row.wrapping_sub(item.q_first);
    let (group, quad) = (lane / 4, lane % 4);
    crate::unroll8!(half in 0..2 => {
        let row = q_first_warp + group + 8 * half as u32;
        if row >= item.q_first && row < item.seq_len {
            let out_row = row.wrapping_add(row_offset) as usize;
            let inv = 1.0 / totals[half].l;
            let base = out_row * out_stride + head as usize * D;
            crate::unroll16!(n in 0..n_tiles(D) => {
                let c = &o[n].regs[2 * half..2 * half + 2];
                let pair = E::pack2(c[0] * inv, c[1] * inv);
                // SAFETY: position `row` has an output row; dims `8 n + 2 quad, +1 < D`.
                unsafe {
                    crate::global::store_u32(out.add(base + 8 * n + 2 * quad as usize).cast::<u32>(), pair)
                };
            });
        }
    });
    if lse.is_null() || quad != 0 {
        return;
    }
    crate::unroll8!(half in 0..2 => {
        let row = q_first_warp + group + 8 * half as u32;
        if row >= item.q_first && row < item.seq_len {
            let out_row = row.wrapping_add(row_offset) as usize;
            // SAFETY: `lse` holds `[query rows][q_heads]` f32 (launch contract).
            unsafe {
                lse.add(out_row * p.q_heads as usize + head as usize)
                    .write(totals[half].natural_lse())
            };
        }
    });
}
