//! Tile shapes of the decode kernel and the moves between global memory, shared memory and
//! `mma` fragments.
//!
//! A tile is [`DECODE_TILE_ROWS`] (16) consecutive K/V rows of one page. Each warp streams its
//! own tiles through [`DECODE_STAGES`] stages of shared memory (K tile, then V tile), rows
//! `D + DECODE_ROW_PAD` elements apart so the eight 16-byte rows of an `ldmatrix` 8x8 load fall in
//! distinct bank groups. A tile arrives by 16-byte `cp.async` copies ([`AsyncCopy`]) or as 32
//! bulk copies (`cp.async.bulk`, one K or V row per lane) counted on the stage's `mbarrier`
//! (after the stage area: one per warp and stage; [`BulkCopy`]).
//!
//! The products, per warp and tile, with the `G` query heads of the KV group as the `M` rows of
//! the `m16n8k16` products (rows `G..16` are zero and never written out):
//! - `S = Q Kᵀ`: 2 accumulators (keys 0..8, 8..16); `Q` is `D/16` A fragments loaded once from
//!   global memory; `Kᵀ`'s B fragments come from the row-major K tile with plain `ldmatrix`;
//! - `O += P V`: `D/8` accumulators of 8 dims; `P` reuses `S`'s registers as one A fragment;
//!   `V`'s B fragments come from the row-major V tile with `ldmatrix.trans`.

use lserve_abi::decode::{
    decode_stage_bytes, DECODE_ROW_PAD, DECODE_STAGES, DECODE_THREADS, DECODE_TILE_ROWS,
};

use super::newest::NewestRow;
use crate::bulk_copy::{
    bulk_copy_with_policy, fence_mbarrier_init, fence_proxy_async_shared,
    mbarrier_arrive_expect_tx, mbarrier_init, mbarrier_wait_parity,
};
use crate::cp_async::{
    commit_group, cp_async_16_with_policy, l2_evict_first, wait_all, wait_group,
};
use crate::ldmatrix::{load_b_pair_k_major, load_b_pair_n_major};
use crate::mma::{FragA, FragB, FragC, MmaElement};
use crate::smem::{dynamic_smem, shared_addr, st_shared_v4_u32};
use crate::sync::sync_warp;
use crate::thread::WARP_SIZE;

/// Warps per block.
pub const WARPS: u32 = DECODE_THREADS / WARP_SIZE;
/// Most `Q` fragments (`D = 128`: 8 steps of 16 dims).
pub const MAX_Q_STEPS: usize = 8;
/// Most `O` accumulators (`D = 128`: 16 groups of 8 dims).
pub const MAX_O_TILES: usize = 16;

/// The tile geometry for head dimension `D` (64 or 128).
pub struct Tile<const D: usize>;

impl<const D: usize> Tile<D> {
    /// Bytes between consecutive rows in shared memory.
    pub const ROW_BYTES: u32 = (D as u32 + DECODE_ROW_PAD) * 2;
    /// Bytes of one K (or V) tile in shared memory.
    pub const BYTES: u32 = DECODE_TILE_ROWS * Self::ROW_BYTES;
    /// Bytes of one warp's stage (a K and a V tile).
    const STAGE_BYTES: u32 = 2 * Self::BYTES;
    /// 16-byte chunks per row.
    const CHUNKS_PER_ROW: u32 = D as u32 / 8;
    /// Chunks each lane copies per K (or V) tile with `cp.async`.
    const CHUNKS_PER_LANE: u32 = DECODE_TILE_ROWS * Self::CHUNKS_PER_ROW / WARP_SIZE;
    /// Bytes of one K (or V) row in global memory: one bulk copy.
    const ROW_COPY_BYTES: u32 = D as u32 * 2;
    /// Bytes a stage's barrier counts per tile: 16 K and 16 V rows.
    pub const TILE_COPY_BYTES: u32 = 2 * DECODE_TILE_ROWS * Self::ROW_COPY_BYTES;
    /// `mma` steps of 16 along the head dimension (`Q Kᵀ`'s reduction).
    pub const D_STEPS: usize = D / 16;
    /// Accumulators of 8 dims in `O`.
    pub const O_TILES: usize = D / 8;

    /// Shared-window address of warp `warp`'s K tile in `stage` (its V tile follows).
    #[inline(always)]
    pub fn k_tile(warp: u32, stage: u32) -> u32 {
        shared_addr(dynamic_smem::<u8>(0)) + (warp * DECODE_STAGES + stage) * Self::STAGE_BYTES
    }

    /// Shared-window address of the `mbarrier` that counts the copies into warp `warp`'s
    /// `stage` (after the stage area).
    #[inline(always)]
    pub fn stage_barrier(warp: u32, stage: u32) -> u32 {
        shared_addr(dynamic_smem::<u8>(0))
            + decode_stage_bytes(D as u32)
            + (warp * DECODE_STAGES + stage) * 8
    }
}

// The layout above is what `decode_stage_bytes` sizes; `decode_smem_bytes` adds the barriers.
const _: () = assert!(decode_stage_bytes(128) == WARPS * DECODE_STAGES * Tile::<128>::STAGE_BYTES);
const _: () = assert!(decode_stage_bytes(64) == WARPS * DECODE_STAGES * Tile::<64>::STAGE_BYTES);
const _: () = assert!(
    lserve_abi::decode::decode_smem_bytes(128)
        == decode_stage_bytes(128) + WARPS * DECODE_STAGES * 8
);
// One row copy per lane: 16 K rows and 16 V rows.
const _: () = assert!(2 * DECODE_TILE_ROWS == WARP_SIZE);

/// How a warp's K/V tiles travel from global memory into its stages: the kernel is generic over
/// it, the host picks per launch (`AsyncCopy` for short splits, `BulkCopy` for long ones;
/// `host/src/gpu/decode.rs` says where the line is and why).
///
/// The ring protocol: [`start`](TileCopy::start) once; per tile `j` [`issue`](TileCopy::issue)
/// into stage `j % DECODE_STAGES`; one [`commit`](TileCopy::commit) per prologue slot and per
/// loop step (whether or not a tile was issued); [`wait`](TileCopy::wait) for tile `j` before
/// reading it; at the end [`finish`](TileCopy::finish) before the stage area is reused.
pub trait TileCopy {
    /// Prepares warp `warp`'s stages.
    ///
    /// # Safety
    /// All 32 lanes of the warp call it, once, before the first issue.
    unsafe fn start<const D: usize>(warp: u32, lane: u32);

    /// Starts the copy of tile `j`'s K and V rows into its stage of warp `warp`: row `r` comes
    /// from row `min(r, valid_rows - 1)` of the source (rows past the end repeat the last existing
    /// row, so every value `P V` multiplies is finite; their scores are masked).
    ///
    /// # Safety
    /// All 32 lanes of the warp call it; the stage is not being read (its previous tile was
    /// waited for and every lane is past reading it); `1 <= valid_rows <= 16` rows of `D`
    /// elements are readable at `k_src` and `v_src` (rows contiguous, 16-byte aligned).
    unsafe fn issue<const D: usize>(
        warp: u32,
        j: u32,
        k_src: *const u16,
        v_src: *const u16,
        valid_rows: u32,
        lane: u32,
    );

    /// Closes the copies issued since the last commit.
    fn commit();

    /// Waits until tile `j` (issued and committed) has landed, as seen by this lane.
    ///
    /// # Safety
    /// Tiles `0..=j` of the warp were issued in order and the ring protocol above was followed.
    unsafe fn wait<const D: usize>(warp: u32, j: u32);

    /// Waits for every copy still in flight.
    fn finish();

    /// Orders this lane's plain shared-memory stores into a stage (the newest row's patch,
    /// [`patch_rows`]) before the later copies that will overwrite that stage.
    fn after_plain_stores();
}

/// 16-byte `cp.async` copies, each lane a share of every row, tracked in commit groups.
pub struct AsyncCopy;

impl TileCopy for AsyncCopy {
    #[inline(always)]
    unsafe fn start<const D: usize>(_warp: u32, _lane: u32) {}

    #[inline(always)]
    unsafe fn issue<const D: usize>(
        warp: u32,
        j: u32,
        k_src: *const u16,
        v_src: *const u16,
        valid_rows: u32,
        lane: u32,
    ) {
        // K and V are read once per step: keep them from pushing other lines out of the L2.
        let policy = l2_evict_first();
        let k_dst = Tile::<D>::k_tile(warp, j % DECODE_STAGES);
        let mut i = 0;
        while i < Tile::<D>::CHUNKS_PER_LANE {
            let c = lane + i * WARP_SIZE;
            let (row, chunk) = (c / Tile::<D>::CHUNKS_PER_ROW, c % Tile::<D>::CHUNKS_PER_ROW);
            let src = (row.min(valid_rows - 1) * D as u32 + chunk * 8) as usize;
            let dst = k_dst + row * Tile::<D>::ROW_BYTES + chunk * 16;
            // SAFETY: the source row exists and `chunk * 8 + 8 <= D`; the destination is inside
            // the stage (`row < 16`), 16-byte aligned (`ROW_BYTES` is a multiple of 16).
            unsafe {
                cp_async_16_with_policy(dst, k_src.add(src) as *const u8, policy);
                cp_async_16_with_policy(
                    dst + Tile::<D>::BYTES,
                    v_src.add(src) as *const u8,
                    policy,
                );
            }
            i += 1;
        }
    }

    #[inline(always)]
    fn commit() {
        commit_group();
    }

    #[inline(always)]
    unsafe fn wait<const D: usize>(_warp: u32, _j: u32) {
        // Tile `j`'s group is older than the `DECODE_STAGES - 2` committed after it.
        wait_group::<{ DECODE_STAGES - 2 }>();
    }

    #[inline(always)]
    fn finish() {
        wait_all();
    }

    #[inline(always)]
    fn after_plain_stores() {
        // `cp.async` writes through the generic proxy: program order and the warp barriers
        // of the ring suffice.
    }
}

/// Bulk copies (`cp.async.bulk`, the tensor memory accelerator): one K or V row per lane, counted
/// in bytes on one `mbarrier` per stage (tile `j` is phase `j / DECODE_STAGES` of its stage's
/// barrier). Fewer instructions and requests per byte than [`AsyncCopy`], more latency per tile.
pub struct BulkCopy;

impl TileCopy for BulkCopy {
    #[inline(always)]
    unsafe fn start<const D: usize>(warp: u32, lane: u32) {
        // One barrier per stage, one arrival (lane 0's) per phase.
        if lane == 0 {
            let mut stage = 0;
            while stage < DECODE_STAGES {
                // SAFETY: the warp's own barrier words, after the stage area; nobody uses them
                // yet.
                unsafe { mbarrier_init(Tile::<D>::stage_barrier(warp, stage), 1) };
                stage += 1;
            }
            fence_mbarrier_init();
        }
        // SAFETY: the whole warp is here (caller); the lanes see the barriers from now on.
        unsafe { sync_warp() };
    }

    #[inline(always)]
    unsafe fn issue<const D: usize>(
        warp: u32,
        j: u32,
        k_src: *const u16,
        v_src: *const u16,
        valid_rows: u32,
        lane: u32,
    ) {
        // K and V are read once per step: keep them from pushing other lines out of the L2.
        let policy = l2_evict_first();
        let stage = j % DECODE_STAGES;
        let bar = Tile::<D>::stage_barrier(warp, stage);
        if lane == 0 {
            // SAFETY: tile `j` is the phase `j / STAGES` of its stage's barrier, which nobody has
            // arrived on yet (the previous phase was waited for); 8 KiB < 2^20.
            unsafe { mbarrier_arrive_expect_tx(bar, Tile::<D>::TILE_COPY_BYTES) };
        }
        let (row, is_v) = (lane % DECODE_TILE_ROWS, lane / DECODE_TILE_ROWS);
        let src = if is_v == 0 { k_src } else { v_src };
        let dst =
            Tile::<D>::k_tile(warp, stage) + is_v * Tile::<D>::BYTES + row * Tile::<D>::ROW_BYTES;
        // SAFETY: the source row exists (`min(row, valid_rows - 1) < valid_rows`) and is 16-byte
        // aligned; `ROW_COPY_BYTES` (128 or 256) is a multiple of 16; the destination row is
        // inside the stage (`row < 16`) and 16-byte aligned (`ROW_BYTES` is a multiple of 16);
        // the 32 copies add up to the `TILE_COPY_BYTES` lane 0 announced.
        unsafe {
            let from = src.add((row.min(valid_rows - 1) * D as u32) as usize);
            bulk_copy_with_policy(
                dst,
                from as *const u8,
                Tile::<D>::ROW_COPY_BYTES,
                bar,
                policy,
            );
        }
    }

    #[inline(always)]
    fn commit() {}

    #[inline(always)]
    unsafe fn wait<const D: usize>(warp: u32, j: u32) {
        // SAFETY: the barrier was initialized by `start`; tile `j` (issued) is its phase
        // `j / STAGES`: the current phase or, if it already completed, the one before.
        unsafe {
            mbarrier_wait_parity(
                Tile::<D>::stage_barrier(warp, j % DECODE_STAGES),
                (j / DECODE_STAGES) % 2,
            )
        };
    }

    #[inline(always)]
    fn finish() {
        // Every warp waited for each tile it issued.
    }

    #[inline(always)]
    fn after_plain_stores() {
        // The bulk copies write through the async proxy.
        fence_proxy_async_shared();
    }
}

/// Overwrites the newest row of a landed tile in its stage (`k_tile`: the K tile; V follows)
/// with the activations `newest` holds, and the rows after it that repeat it (a partial tile's
/// padding rows, [`TileCopy::issue`]): the cache's copy of that row is being written by the same
/// launch (`newest`).
///
/// # Safety
/// All 32 lanes of the warp call it after the tile's wait and a warp barrier; `valid_rows` is
/// the tile's count of existing rows and `newest.row < valid_rows`.
#[inline(always)]
pub unsafe fn patch_rows<const D: usize, C: TileCopy>(
    k_tile: u32,
    newest: &NewestRow,
    valid_rows: u32,
    lane: u32,
) {
    let end = if newest.row + 1 == valid_rows {
        DECODE_TILE_ROWS
    } else {
        newest.row + 1
    };
    if lane < Tile::<D>::CHUNKS_PER_ROW {
        let mut r = newest.row;
        while r < end {
            let at = k_tile + r * Tile::<D>::ROW_BYTES + 16 * lane;
            // SAFETY: row `r < 16` of the stage, chunk `lane < D / 8`: inside it, 16-byte
            // aligned; the copy landed (the caller's wait) and no lane reads the tile before the
            // barrier below.
            unsafe {
                st_shared_v4_u32(at, newest.key.0);
                st_shared_v4_u32(at + Tile::<D>::BYTES, newest.value.0);
            }
            r += 1;
        }
    }
    C::after_plain_stores();
    // SAFETY: every lane is here (the caller's contract).
    unsafe { sync_warp() };
}

/// The `D/16` A fragments of the group's query heads: row `g < G` is query head `g` of the
/// group (`q_group` points to its `G x D` elements), rows `G..16` are zero.
///
/// # Safety
/// `q_group` points to `G * D` readable elements, 4-byte aligned.
#[inline(always)]
pub unsafe fn load_q_fragments<E: MmaElement, const D: usize, const G: usize>(
    q_group: *const u16,
    lane: u32,
) -> [FragA<E>; MAX_Q_STEPS] {
    let mut q = [FragA::from_regs([0; 4]); MAX_Q_STEPS];
    let (row, col) = (lane / 4, 2 * (lane % 4));
    if row < G as u32 {
        crate::unroll8!(kk in 0..Tile::<D>::D_STEPS => {
            let at = |c: u32| {
                // SAFETY: `row < G`, `c + 2 <= D`: inside the group's elements; `c` even.
                unsafe { *(q_group.add(row as usize * D + c as usize) as *const u32) }
            };
            // A's registers 1 and 3 are rows `row + 8` (always past `G <= 8`): zero.
            q[kk] = FragA::from_regs([at(16 * kk as u32 + col), 0, at(16 * kk as u32 + 8 + col), 0]);
        });
    }
    q
}

/// The B fragments of `Kᵀ` for the tile's 16 keys (two accumulators of 8) and dims
/// `16 * kk .. + 16`, with one `ldmatrix.x4` from the row-major K tile (keys are B's `n`).
///
/// # Safety
/// The whole warp calls it after the tile arrived and a warp barrier.
#[inline(always)]
pub unsafe fn load_k_fragments<E: MmaElement, const D: usize>(
    k_tile: u32,
    kk: u32,
    lane: u32,
) -> [FragB<E>; 2] {
    // SAFETY: 16 keys x dims `16 kk .. + 16 <= D`: inside the tile; forwarded barrier.
    unsafe { load_b_pair_n_major(k_tile, Tile::<D>::ROW_BYTES, 0, 16 * kk, lane) }
}

/// The B fragments of `V` for the tile's 16 keys and dims `16 * pair .. + 16` (two accumulators
/// of 8 dims), with one `ldmatrix.x4.trans` from the row-major V tile (keys are B's `k`).
///
/// # Safety
/// As [`load_k_fragments`].
#[inline(always)]
pub unsafe fn load_v_fragments<E: MmaElement, const D: usize>(
    v_tile: u32,
    pair: u32,
    lane: u32,
) -> [FragB<E>; 2] {
    // SAFETY: 16 keys x dims `16 pair .. + 16 <= D`: inside the tile; forwarded barrier.
    unsafe { load_b_pair_k_major(v_tile, Tile::<D>::ROW_BYTES, 0, 16 * pair, lane) }
}

/// The A fragment of `P` from the two `S` accumulators of a tile (FlashAttention-2's register
/// reuse): accumulator 0 holds keys `0..8` of row `lane / 4` in `regs[0..2]`, accumulator 1 keys
/// `8..16`; rows `+8` (`regs[2..4]`) are past the group and stay zero.
#[inline(always)]
pub fn p_fragment<E: MmaElement>(s: &[FragC; 2]) -> FragA<E> {
    FragA::from_regs([
        E::pack2(s[0].regs[0], s[0].regs[1]),
        0,
        E::pack2(s[1].regs[0], s[1].regs[1]),
        0,
    ])
}
