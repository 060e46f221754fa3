//! The decode kernel's tiles: where each warp's stages lie in shared memory, how K/V tiles travel
//! into them, and the query fragments.
//!
//! A tile is [`DECODE_TILE_ROWS`] (16) consecutive K/V rows of one page (or of a slot's streaming
//! rows). Each warp streams its own tiles through [`DECODE_STAGES`] stages of shared memory (K
//! tile, then V tile), each a [`KvTile`]: the shared tile type in the 128-byte swizzle
//! ([`crate::tile::Swizzled`]: `D / 64` boxes of 16 rows of 128 bytes, 16-byte chunk `c` of a box
//! row `r` stored at chunk `c ^ (r % 8)`). The eight rows an `ldmatrix` 8x8 load reads then fall
//! in distinct bank groups, and every row starts on a 128-byte line, so a copy fills whole
//! aligned lines. Two ways of copying ([`TileCopy`]): tensor-map bulk copies ([`TensorCopy`],
//! `cp.async.bulk.tensor`, one per 64 columns of K or V, swizzled by the copy engine and counted
//! on the stage's `mbarrier`, after the stage area: one per warp and stage), or 16-byte
//! `cp.async` copies ([`AsyncCopy`], each chunk placed where the swizzle puts it).
//!
//! The products, per warp and tile, with the `G` query heads of the KV group (`G <= 8`, a launch
//! parameter) as the `M` rows of the `m16n8k16` products (rows `G..16` are zero and never
//! written out):
//! - `S = Q Kᵀ`: 2 accumulators (keys 0..8, 8..16); `Q` is `D/16` A fragments loaded once from
//!   global memory ([`load_q_fragments`]); `Kᵀ`'s B fragments come from the K tile
//!   ([`crate::tile::fragments::load_k_fragments`]);
//! - `O += P V`: `D/8` accumulators of 8 dims; `P` reuses `S`'s registers as one A fragment
//!   whose rows `8..16` are zero ([`crate::tile::fragments::p_fragment`] with 8 rows); `V`'s B
//!   fragments come from the V tile ([`crate::tile::fragments::load_v_fragments`]).

#[cfg(target_feature = "sm_90")]
use lserve_abi::decode::TENSOR_MAP_BYTES;
use lserve_abi::decode::{
    decode_stage_bytes, DecodeParams, DECODE_BOX_COLUMNS, DECODE_STAGES, DECODE_STAGE_ALIGN,
    DECODE_THREADS, DECODE_TILE_ROWS, MAX_GROUP,
};

use super::newest::NewestRow;
use super::rows::RowSource;
#[cfg(target_feature = "sm_90")]
use crate::bulk_copy::{
    fence_mbarrier_init, fence_proxy_async_shared, mbarrier_arrive_expect_tx, mbarrier_init,
    mbarrier_wait_parity, tensor_copy_3d_with_policy,
};
use crate::cp_async::{
    commit_group, cp_async_16_zfill_with_policy, l2_evict_first, wait_all, wait_group,
};
use crate::mma::{FragA, MmaElement};
use crate::smem::{dynamic_smem, shared_addr, st_shared_v4_u32};
use crate::sync::sync_warp;
use crate::thread::WARP_SIZE;
use crate::tile::fragments::k_steps;
use crate::tile::{Layout, SmemTile, Swizzled};

/// Warps per block.
pub const WARPS: u32 = DECODE_THREADS / WARP_SIZE;
/// Most `Q` fragments (`D = 128`: 8 steps of 16 dims).
pub const MAX_Q_STEPS: usize = 8;
/// Most `O` accumulators (`D = 128`: 16 groups of 8 dims).
pub const MAX_O_TILES: usize = 16;

/// The layout of a K (or V) tile for head dimension `D` (64 or 128): 16 rows, 128-byte swizzle.
pub type KvLayout<const D: usize> = Swizzled<D, DECODE_TILE_ROWS>;
/// A K (or V) tile in a warp's stage.
pub type KvTile<const D: usize> = SmemTile<KvLayout<D>>;

/// The stage ring of each warp for head dimension `D`: where its tiles and barriers are.
pub struct Stages<const D: usize>;

impl<const D: usize> Stages<D> {
    /// Chunks each lane copies per K (or V) tile with `cp.async`.
    const CHUNKS_PER_LANE: u32 = DECODE_TILE_ROWS * KvLayout::<D>::ROW_CHUNKS / WARP_SIZE;
    /// Bytes a stage's barrier counts per tile: 16 K and 16 V rows.
    pub const TILE_COPY_BYTES: u32 = 2 * KvLayout::<D>::BYTES;

    /// Warp `warp`'s K tile in `stage` (its V tile follows: [`SmemTile::next`]). The stages
    /// start at the first [`DECODE_STAGE_ALIGN`] boundary of the stage area, which has room for
    /// that; the swizzle then matches the tensor copies' (of absolute addresses).
    #[inline(always)]
    pub fn k_tile(warp: u32, stage: u32) -> KvTile<D> {
        let base = shared_addr(dynamic_smem::<u8>(0));
        let base = (base + DECODE_STAGE_ALIGN - 1) & !(DECODE_STAGE_ALIGN - 1);
        SmemTile::at(base + (warp * DECODE_STAGES + stage) * 2 * KvLayout::<D>::BYTES)
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

// The stages and the alignment room are what `decode_stage_bytes` sizes; `decode_smem_bytes`
// adds the barriers.
const _: () = assert!(
    decode_stage_bytes(128)
        == WARPS * DECODE_STAGES * 2 * KvLayout::<128>::BYTES + DECODE_STAGE_ALIGN
);
const _: () = assert!(
    decode_stage_bytes(64)
        == WARPS * DECODE_STAGES * 2 * KvLayout::<64>::BYTES + DECODE_STAGE_ALIGN
);
const _: () = assert!(
    lserve_abi::decode::decode_smem_bytes(128)
        == decode_stage_bytes(128) + WARPS * DECODE_STAGES * 8
);
// The tensor copies' boxes are the layout's; every box (and so every tile and stage) starts on a
// swizzle span: 8 rows of 128 bytes.
const _: () = assert!(KvLayout::<64>::BOX_COLUMNS == DECODE_BOX_COLUMNS);
const _: () = assert!(KvLayout::<64>::BOX_BYTES % DECODE_STAGE_ALIGN == 0);
const _: () = assert!(8 * KvLayout::<64>::BOX_ROW_BYTES == DECODE_STAGE_ALIGN);

/// How a warp's K/V tiles travel from global memory into its stages: the kernel is generic over
/// it, the host picks per launch (`AsyncCopy` for short splits, `TensorCopy` for long ones;
/// `host/src/gpu/decode.rs` says where the line is and why).
///
/// The ring protocol: [`start`](TileCopy::start) once; per tile `j` [`issue`](TileCopy::issue)
/// into stage `j % DECODE_STAGES`; one [`commit`](TileCopy::commit) per prologue slot and per
/// loop step (whether or not a tile was issued); [`wait`](TileCopy::wait) for tile `j` before
/// reading it; at the end [`finish`](TileCopy::finish) before the stage area is reused.
pub trait TileCopy {
    /// Whether [`issue`](TileCopy::issue) fills rows past `valid_rows` by repeating the last
    /// row, so [`landed`](TileCopy::landed) has nothing to do.
    const REPEATS_LAST_ROW: bool;

    /// Where a tile's rows are, as this copy addresses them ([`locate`](TileCopy::locate)).
    type At: Copy;

    /// An `At` for a tile that is never issued.
    const NOWHERE: Self::At;

    /// Where tile `t` of `src` is. For dense heads this reads the page list (global memory):
    /// the kernel asks for it a tile ahead.
    ///
    /// # Safety
    /// `t < src.tiles()`.
    unsafe fn locate(src: &RowSource, p: &DecodeParams, t: u32) -> Self::At;

    /// Prepares warp `warp`'s stages.
    ///
    /// # Safety
    /// All 32 lanes of the warp call it, once, before the first issue.
    unsafe fn start<const D: usize>(warp: u32, lane: u32);

    /// Starts the copy of tile `j`'s K and V rows into its stage of warp `warp`. Rows past
    /// `valid_rows` must end up finite in V once [`landed`](TileCopy::landed) has run (their
    /// scores are masked, but `P V` multiplies them by zero).
    ///
    /// # Safety
    /// All 32 lanes of the warp call it; the stage is not being read (its previous tile was
    /// waited for and every lane is past reading it); `1 <= valid_rows <= 16` rows of `D`
    /// elements exist at `at` (a [`locate`](TileCopy::locate) of `src`'s tile).
    unsafe fn issue<const D: usize>(
        warp: u32,
        j: u32,
        src: &RowSource,
        at: Self::At,
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

    /// Run by the whole warp after tile `j`'s wait and warp barrier, before it is read: makes
    /// rows past `valid_rows` finite where the copy did not.
    ///
    /// # Safety
    /// All 32 lanes call it, after the wait and a warp barrier for tile `j`.
    unsafe fn landed<const D: usize>(warp: u32, j: u32, valid_rows: u32, lane: u32);

    /// Waits for every copy still in flight.
    fn finish();

    /// Orders this lane's plain shared-memory stores into a stage (the newest row's patch,
    /// [`patch_rows`]) before the later copies that will overwrite that stage.
    fn after_plain_stores();
}

/// 16-byte `cp.async` copies, each lane a share of every row, tracked in commit groups.
pub struct AsyncCopy;

impl TileCopy for AsyncCopy {
    const REPEATS_LAST_ROW: bool = true;

    /// The tile's element offset in the K and V buffers.
    type At = usize;

    const NOWHERE: usize = 0;

    #[inline(always)]
    unsafe fn locate(src: &RowSource, p: &DecodeParams, t: u32) -> usize {
        // SAFETY: forwarded.
        unsafe { src.tile_offset(p, t) }
    }

    #[inline(always)]
    unsafe fn start<const D: usize>(_warp: u32, _lane: u32) {}

    /// Row `r` comes from row `min(r, valid_rows - 1)` of the source: rows past the end repeat
    /// the last existing row.
    #[inline(always)]
    unsafe fn issue<const D: usize>(
        warp: u32,
        j: u32,
        src: &RowSource,
        at: usize,
        valid_rows: u32,
        lane: u32,
    ) {
        // A tile whose page is past the pool (an offset past the pool's end) copies 0 bytes from
        // the buffers' first rows: it lands as zeros, nothing is read (`crate::pool_page`).
        let copied = at < src.offset_end;
        let bytes = if copied { 16 } else { 0 };
        // SAFETY: `at` is a tile offset of `src` below its end, or 0.
        let (k_src, v_src) = unsafe { src.tile_at(if copied { at } else { 0 }) };
        // K and V are read once per step: keep them from pushing other lines out of the L2.
        let policy = l2_evict_first();
        let k_dst = Stages::<D>::k_tile(warp, j % DECODE_STAGES);
        let row_chunks = KvLayout::<D>::ROW_CHUNKS;
        let mut i = 0;
        while i < Stages::<D>::CHUNKS_PER_LANE {
            let c = lane + i * WARP_SIZE;
            let (row, chunk) = (c / row_chunks, c % row_chunks);
            let from = (row.min(valid_rows - 1) * D as u32 + chunk * 8) as usize;
            let dst = k_dst.chunk(row, chunk);
            // SAFETY: the source row exists (or nothing is read) and `chunk * 8 + 8 <= D`; the
            // destination is chunk `chunk` of row `row < 16` of the stage's K (and V) tile,
            // 16-byte aligned.
            unsafe {
                cp_async_16_zfill_with_policy(dst, k_src.add(from) as *const u8, bytes, policy);
                cp_async_16_zfill_with_policy(
                    dst + KvLayout::<D>::BYTES,
                    v_src.add(from) as *const u8,
                    bytes,
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
    unsafe fn landed<const D: usize>(_warp: u32, _j: u32, _valid_rows: u32, _lane: u32) {
        // The padding rows repeat the last existing row (`issue`).
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

/// The copy of the launches over long splits: [`TensorCopy`] on Hopper; the sm_80 build has no
/// tensor memory accelerator and copies those tiles with [`AsyncCopy`] too.
#[cfg(target_feature = "sm_90")]
pub type LongSplitCopy = TensorCopy;
/// The copy of the launches over long splits: [`TensorCopy`] on Hopper; the sm_80 build has no
/// tensor memory accelerator and copies those tiles with [`AsyncCopy`] too.
#[cfg(not(target_feature = "sm_90"))]
pub type LongSplitCopy = AsyncCopy;

/// Tensor-map bulk copies (`cp.async.bulk.tensor`, the tensor memory accelerator): per tile,
/// one copy per 64 columns of K and of V (lanes `0 .. D / 32`), landing swizzled, counted in
/// bytes on one `mbarrier` per stage (tile `j` is phase `j / DECODE_STAGES` of its stage's
/// barrier). Each copy writes whole aligned 128-byte lines, which the L2 serves as whole-line
/// requests (decode/DESIGN.md). Fewer instructions per byte than [`AsyncCopy`], more
/// latency per tile.
#[cfg(target_feature = "sm_90")]
pub struct TensorCopy;

#[cfg(target_feature = "sm_90")]
impl TileCopy for TensorCopy {
    const REPEATS_LAST_ROW: bool = false;

    /// The tile's box: its block and first row in the block ([`RowSource::tile_box`]).
    type At = (u32, u32);

    const NOWHERE: (u32, u32) = (0, 0);

    #[inline(always)]
    unsafe fn locate(src: &RowSource, p: &DecodeParams, t: u32) -> (u32, u32) {
        // SAFETY: forwarded.
        unsafe { src.tile_box(p, t) }
    }

    #[inline(always)]
    unsafe fn start<const D: usize>(warp: u32, lane: u32) {
        // One barrier per stage, one arrival (lane 0's) per phase.
        if lane == 0 {
            let mut stage = 0;
            while stage < DECODE_STAGES {
                // SAFETY: the warp's own barrier words, after the stage area; nobody uses them
                // yet.
                unsafe { mbarrier_init(Stages::<D>::stage_barrier(warp, stage), 1) };
                stage += 1;
            }
            fence_mbarrier_init();
        }
        // SAFETY: the whole warp is here (caller); the lanes see the barriers from now on.
        unsafe { sync_warp() };
    }

    /// Rows past `valid_rows` land as whatever the buffer holds there (or zeros past the
    /// block): [`landed`](TileCopy::landed) zeroes them in V.
    #[inline(always)]
    unsafe fn issue<const D: usize>(
        warp: u32,
        j: u32,
        src: &RowSource,
        at: (u32, u32),
        _valid_rows: u32,
        lane: u32,
    ) {
        let (block, row) = at;
        // K and V are read once per step: keep them from pushing other lines out of the L2.
        let policy = l2_evict_first();
        let stage = j % DECODE_STAGES;
        let bar = Stages::<D>::stage_barrier(warp, stage);
        if lane == 0 {
            // SAFETY: tile `j` is the phase `j / STAGES` of its stage's barrier, which nobody has
            // arrived on yet (the previous phase was waited for); 8 KiB < 2^20.
            unsafe { mbarrier_arrive_expect_tx(bar, Stages::<D>::TILE_COPY_BYTES) };
        }
        let boxes = D as u32 / DECODE_BOX_COLUMNS;
        if lane < 2 * boxes {
            let (is_v, box_index) = (lane / boxes, lane % boxes);
            let dst = Stages::<D>::k_tile(warp, stage).addr()
                + is_v * KvLayout::<D>::BYTES
                + box_index * KvLayout::<D>::BOX_BYTES;
            // SAFETY: the maps (K, then V) describe the buffers the rows are in, and the box at
            // (column `64 * box_index`, row `row`, block `block`) is the tile's rows of
            // those columns (the caller's contract); the destination box is inside the stage and
            // 1024-byte aligned (`k_tile` rounds the area up, boxes are multiples of 1024 bytes);
            // the 2 * D / 64 boxes of 16 x 128 bytes add up to the `TILE_COPY_BYTES` lane 0
            // announced.
            unsafe {
                tensor_copy_3d_with_policy(
                    dst,
                    src.maps().add(is_v as usize * TENSOR_MAP_BYTES),
                    box_index * DECODE_BOX_COLUMNS,
                    row,
                    block,
                    bar,
                    policy,
                );
            }
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
                Stages::<D>::stage_barrier(warp, j % DECODE_STAGES),
                (j / DECODE_STAGES) % 2,
            )
        };
    }

    /// A partial tile (the last of a list) zeroes its V rows past `valid_rows`: the copy brought
    /// whatever the page holds there, possibly not finite.
    #[inline(always)]
    unsafe fn landed<const D: usize>(warp: u32, j: u32, valid_rows: u32, lane: u32) {
        if valid_rows < DECODE_TILE_ROWS {
            let v_tile = Stages::<D>::k_tile(warp, j % DECODE_STAGES).next();
            let row_chunks = KvLayout::<D>::ROW_CHUNKS;
            let chunks = (DECODE_TILE_ROWS - valid_rows) * row_chunks;
            let mut i = lane;
            while i < chunks {
                let row = valid_rows + i / row_chunks;
                let chunk = i % row_chunks;
                // SAFETY: row `< 16`, chunk `< D / 8`: inside the landed V tile, 16-byte
                // aligned; no lane reads it before the barrier below.
                unsafe { st_shared_v4_u32(v_tile.chunk(row, chunk), [0; 4]) };
                i += WARP_SIZE;
            }
            Self::after_plain_stores();
            // SAFETY: every lane is here (the caller's contract; `valid_rows` is warp-uniform).
            unsafe { sync_warp() };
        }
    }

    #[inline(always)]
    fn finish() {
        // Every warp waited for each tile it issued.
    }

    #[inline(always)]
    fn after_plain_stores() {
        // The tensor copies write through the async proxy.
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
    k_tile: KvTile<D>,
    newest: &NewestRow,
    valid_rows: u32,
    lane: u32,
) {
    let end = if newest.row + 1 == valid_rows {
        DECODE_TILE_ROWS
    } else {
        newest.row + 1
    };
    if lane < KvLayout::<D>::ROW_CHUNKS {
        let mut r = newest.row;
        while r < end {
            let at = k_tile.chunk(r, lane);
            // SAFETY: row `r < 16` of the stage, chunk `lane < D / 8`: inside it, 16-byte
            // aligned; the copy landed (the caller's wait) and no lane reads the tile before the
            // barrier below.
            unsafe {
                st_shared_v4_u32(at, newest.key.0);
                st_shared_v4_u32(at + KvLayout::<D>::BYTES, newest.value.0);
            }
            r += 1;
        }
    }
    C::after_plain_stores();
    // SAFETY: every lane is here (the caller's contract).
    unsafe { sync_warp() };
}

/// The `D/16` A fragments of the group's query heads: row `g < group` is query head `g` of the
/// group (`q_group` points to its `group x D` elements), rows `group..16` are zero.
///
/// # Safety
/// `group <= MAX_GROUP`; `q_group` points to `group * D` readable elements, 4-byte aligned.
#[inline(always)]
pub unsafe fn load_q_fragments<E: MmaElement, const D: usize>(
    q_group: *const u16,
    group: u32,
    lane: u32,
) -> [FragA<E>; MAX_Q_STEPS] {
    let mut q = [FragA::from_regs([0; 4]); MAX_Q_STEPS];
    let (row, col) = (lane / 4, 2 * (lane % 4));
    if row < group {
        crate::unroll8!(kk in 0..k_steps(D) => {
            let at = |c: u32| {
                // SAFETY: `row < group`, `c + 2 <= D`: inside the group's elements; `c` even.
                unsafe { *(q_group.add(row as usize * D + c as usize) as *const u32) }
            };
            // A's registers 1 and 3 are rows `row + 8` (past every group, `MAX_GROUP <= 8`):
            // zero.
            q[kk] = FragA::from_regs([at(16 * kk as u32 + col), 0, at(16 * kk as u32 + 8 + col), 0]);
        });
    }
    q
}

// A group's query heads are rows `0..8` of the products (`lane / 4`): the rows of A's registers
// 0 and 2.
const _: () = assert!(MAX_GROUP <= 8);
