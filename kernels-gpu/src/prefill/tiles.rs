//! Tile shapes and the moves between global memory, shared memory and `mma` fragments.
//!
//! A K or V tile is 64 rows (keys) of `D` elements, the query tile 64 rows per query block of
//! the kernel's tile (128 unmasked, 64 masked). In shared memory rows are `D + PREFILL_ROW_PAD`
//! elements apart, so the eight 16-byte rows of every `ldmatrix` 8x8 load land in distinct bank
//! groups. Shared memory holds per stage a K and a V tile, then the query tile
//! ([`SmemLayout`]: the K/V addresses do not depend on the query tile's size).
//!
//! Per warp (`ROW_TILES` `mma` row tiles of 16 query rows: 2 unmasked, 1 masked), with `D/16`
//! head-dimension steps:
//! - `Q` is `D/16` A fragments per row tile (rows x dims): with two row tiles they are read from
//!   shared memory per KV block (keeping them in registers would not leave room for twice the
//!   accumulators), with one they are loaded once and stay in registers;
//! - `S = Q Kᵀ` is 8 accumulators per row tile (16 rows x 8 keys each); `Kᵀ`'s B fragments come
//!   from the row-major K tile with plain `ldmatrix` (keys are B's `n`, dims its `k`);
//! - `O` is `D/8` accumulators per row tile (16 rows x 8 dims each); `V`'s B fragments come from
//!   the row-major V tile with `ldmatrix.trans` (keys are B's `k`, dims its `n`).
//!
//! Every K and V fragment feeds every row tile: one `ldmatrix.x4` per `2 * ROW_TILES` `mma`.

use lserve_abi::prefill::{
    prefill_smem_bytes, BLOCK_KV, BLOCK_Q, MASKED_TILE_Q_BLOCKS, PREFILL_ROW_PAD, PREFILL_STAGES,
    PREFILL_THREADS, TILE_Q_BLOCKS,
};

use crate::cp_async::cp_async_16_zfill;
use crate::ldmatrix::{load_a_row_major, load_b_pair_k_major, load_b_pair_n_major};
use crate::math::opaque_u32;
use crate::mma::{FragA, FragB, FragC, MmaElement};
use crate::smem::{dynamic_smem, shared_addr};

/// Rows of a K/V tile (keys).
pub const TILE_ROWS: u32 = BLOCK_KV;
/// Accumulators of `S` per row tile: 64 keys in groups of 8.
pub const S_TILES: usize = (BLOCK_KV / 8) as usize;
/// Most accumulators of `O` per row tile (`D = 128`: 16 groups of 8 dims).
pub const MAX_O_TILES: usize = 16;

/// The tile geometry for head dimension `D` (64 or 128).
pub struct Tile<const D: usize>;

impl<const D: usize> Tile<D> {
    /// Bytes between consecutive rows in shared memory.
    pub const ROW_BYTES: u32 = (D as u32 + PREFILL_ROW_PAD) * 2;
    /// Bytes of one K or V tile in shared memory.
    pub const BYTES: u32 = TILE_ROWS * Self::ROW_BYTES;
    /// 16-byte chunks per row.
    const CHUNKS_PER_ROW: u32 = D as u32 / 8;
    /// `mma` steps of 16 along the head dimension (`Q Kᵀ`'s reduction).
    pub const D_STEPS: usize = D / 16;
    /// Accumulators of 8 dims in `O`.
    pub const O_TILES: usize = D / 8;
}

/// Where the tiles live in dynamic shared memory (32-bit shared-window addresses).
pub struct SmemLayout<const D: usize>;

impl<const D: usize> SmemLayout<D> {
    /// The K tile of `stage`.
    #[inline(always)]
    pub fn k(stage: u32) -> u32 {
        shared_addr(dynamic_smem::<u8>(0)) + Tile::<D>::BYTES * 2 * stage
    }

    /// The V tile of `stage`.
    #[inline(always)]
    pub fn v(stage: u32) -> u32 {
        Self::k(stage) + Tile::<D>::BYTES
    }

    /// The query tile (after the last stage; as many rows as the kernel's tile has).
    #[inline(always)]
    pub fn q() -> u32 {
        Self::k(PREFILL_STAGES)
    }
}

// The layout above is what `prefill_smem_bytes` sizes, for both kernels' query tiles.
const _: () = {
    let kv = 2 * PREFILL_STAGES * Tile::<128>::BYTES;
    let q_block = BLOCK_Q * Tile::<128>::ROW_BYTES;
    assert!(prefill_smem_bytes(128, TILE_Q_BLOCKS) == kv + TILE_Q_BLOCKS * q_block);
    assert!(prefill_smem_bytes(128, MASKED_TILE_Q_BLOCKS) == kv + MASKED_TILE_Q_BLOCKS * q_block);
};

/// Starts the asynchronous copy of `ROWS` rows into each of the `N` consecutive tiles from
/// `dst` (tile `j` at `dst + j * ROWS * ROW_BYTES`): its row `r < valid_rows` comes from
/// `src[j] + r * row_stride`, rows past the end are zero-filled (finite; the kernel masks them
/// out). The query tile is one tile of 64 or 128 rows, a KV block two (K, then V) of 64 rows
/// with the same stride and row count.
///
/// Thread `t` copies chunk `t % CHUNKS_PER_ROW` of rows `t / CHUNKS_PER_ROW + i * ROW_STEP` of
/// every tile: its addresses are one element offset added to each source, plus multiples of a
/// constant step, and whether a row exists is one compare against a per-call count, so a copy
/// costs an address and a select.
///
/// # Safety
/// All [`PREFILL_THREADS`] threads call it; `dst` is a tile of this layout followed by `N - 1`
/// more, each of `ROWS` rows (64 or 128); `1 <= valid_rows`, and `valid_rows` rows of `D`
/// elements at `src[j] + r * row_stride` are readable, 16-byte aligned.
#[inline(always)]
pub unsafe fn load_tiles_async<const D: usize, const ROWS: u32, const N: usize>(
    dst: u32,
    src: [*const u16; N],
    row_stride: usize,
    valid_rows: u32,
    thread: u32,
) {
    let row_step = PREFILL_THREADS / Tile::<D>::CHUNKS_PER_ROW;
    let (row, chunk) = (
        thread / Tile::<D>::CHUNKS_PER_ROW,
        thread % Tile::<D>::CHUNKS_PER_ROW,
    );
    let dst = dst + row * Tile::<D>::ROW_BYTES + chunk * 16;
    // Rows `row + i * row_step` exist for `i * row_step < rows_left`.
    let rows_left = valid_rows.saturating_sub(row);
    // This thread's first row that exists (its own, or the last one: a source for the
    // zero-filled copies, which read nothing), as an element offset from every source. The
    // chunk's part is opaque to LLVM: otherwise it adds it to the K and V base pointers outside
    // the kernel's KV loop and keeps the two 64-bit sums live across the loop (the 128-row D 128
    // kernel then spilled; DESIGN.md, "Variants that lost").
    let first = opaque_u32(chunk * 8) as usize + row.min(valid_rows - 1) as usize * row_stride;
    // A running pointer rather than `first + i * step`: the products `i * step` would be loop
    // invariants of the kernel's KV loop, hoisted out of it into eight live registers.
    let step = row_step as usize * row_stride;
    crate::unroll8!(j in 0..N => {
        // SAFETY: row `min(row, valid_rows - 1) < valid_rows` exists and `chunk * 8 + 8 <= D`.
        let first = unsafe { src[j].add(first) };
        let mut next = first;
        let mut i = 0;
        while i < ROWS / row_step {
            let (from, bytes) = if i * row_step < rows_left {
                (next, 16)
            } else {
                (first, 0)
            };
            // SAFETY: `from` is a readable 16-byte chunk (row `row + i * row_step < valid_rows`,
            // as `first` is row `row` then), or nothing is read; the destination is inside tile
            // `j` (`row + i * row_step < ROWS`), 16-byte aligned (`ROW_BYTES` is a multiple of
            // 16).
            unsafe {
                cp_async_16_zfill(
                    dst + (j as u32 * ROWS + i * row_step) * Tile::<D>::ROW_BYTES,
                    from as *const u8,
                    bytes,
                )
            };
            next = next.wrapping_add(step);
            i += 1;
        }
    });
}

/// The `Q` fragment of row tile `m` of the warp whose rows start at shared address `rows`
/// (in the query tile), for dims `16 * kk .. + 16`.
///
/// # Safety
/// The whole warp calls it after a barrier that follows the query tile's arrival.
#[inline(always)]
pub unsafe fn load_q_fragment<E: MmaElement, const D: usize>(
    rows: u32,
    m: u32,
    kk: u32,
    lane: u32,
) -> FragA<E> {
    // SAFETY: a 16x16 block inside the query tile (row tile `m` of the warp's, `16 kk + 16 <= D`);
    // forwarded barrier.
    unsafe {
        load_a_row_major::<E>(
            rows + 16 * m * Tile::<D>::ROW_BYTES + kk * 32,
            Tile::<D>::ROW_BYTES,
            lane,
        )
    }
}

/// The B fragments of `Kᵀ` for keys `16 * pair .. + 16` (two accumulators of 8 keys) and dims
/// `16 * kk .. + 16`, from the row-major K tile at `k_tile`, with one `ldmatrix.x4` (keys are
/// B's `n`).
///
/// # Safety
/// The whole warp calls it after a barrier that follows the tile's arrival.
#[inline(always)]
pub unsafe fn load_k_fragments<E: MmaElement, const D: usize>(
    k_tile: u32,
    pair: u32,
    kk: u32,
    lane: u32,
) -> [FragB<E>; 2] {
    // SAFETY: keys `16 pair + 16 <= 64`, dims `16 kk + 16 <= D`: inside the tile; forwarded
    // barrier.
    unsafe { load_b_pair_n_major(k_tile, Tile::<D>::ROW_BYTES, 16 * pair, 16 * kk, lane) }
}

/// The B fragments of `V` for keys `16 * kk .. + 16` and dims `16 * pair .. + 16` (two
/// accumulators of 8 dims), from the row-major V tile at `v_tile`, with one `ldmatrix.x4.trans`
/// (keys are B's `k`).
///
/// # Safety
/// As [`load_k_fragments`].
#[inline(always)]
pub unsafe fn load_v_fragments<E: MmaElement, const D: usize>(
    v_tile: u32,
    kk: u32,
    pair: u32,
    lane: u32,
) -> [FragB<E>; 2] {
    // SAFETY: keys `16 kk + 16 <= 64`, dims `16 pair + 16 <= D`: inside the tile; forwarded
    // barrier.
    unsafe { load_b_pair_k_major(v_tile, Tile::<D>::ROW_BYTES, 16 * kk, 16 * pair, lane) }
}

/// The A fragment of `P` for keys `16 * kk .. + 16`, from the two `S` accumulators of those keys
/// (FlashAttention-2's register reuse): accumulator `2 kk` holds keys `+0..8` of rows `group`
/// (`regs[0..2]`) and `group + 8` (`regs[2..4]`), exactly A's `a0a1` / `a2a3`; accumulator
/// `2 kk + 1` holds keys `+8..16`, A's `a4a5` / `a6a7`.
#[inline(always)]
pub fn p_fragment<E: MmaElement>(lo: &FragC, hi: &FragC) -> FragA<E> {
    FragA::from_regs([
        E::pack2(lo.regs[0], lo.regs[1]),
        E::pack2(lo.regs[2], lo.regs[3]),
        E::pack2(hi.regs[0], hi.regs[1]),
        E::pack2(hi.regs[2], hi.regs[3]),
    ])
}
