//! `mma` m16n8k16 operands from shared-memory tiles ([`SmemTile`]) and from `S`'s registers.
//!
//! Every loader reads one 16 x 16 block of a tile with one `ldmatrix.x4` and takes
//! `(tile, row, col, lane)` and the tile's [`Layout`] `L` as a type parameter: `tile` is the
//! tile's shared-window address ([`SmemTile::addr`]), `row` the block's first row, `col` its
//! first element column (a multiple of 8), `lane` the caller's lane; the lane's part of the
//! address joins the block's as the layout says ([`Layout::block_addr`]). (The address rather
//! than the [`SmemTile`]: with the struct passed in, LLVM folds the lane's part of the addresses
//! differently and the decode kernels' loop preheaders grow by 6 instructions and 2 registers.)
//! In attention the tile rows are the query rows (`Q`) or the keys (`K`, `V`), the columns the
//! head dimensions:
//! - [`load_q_fragment`]: an A fragment, rows x columns (`Q` of `S = Q Kᵀ`);
//! - [`load_k_fragments`]: the B fragments of `Kᵀ` (keys are B's `n`), plain `ldmatrix`;
//! - [`load_v_fragments`]: the B fragments of `V` (keys are B's `k`), `ldmatrix.trans`;
//! - [`p_fragment`]: the A fragment of `P` from two `S` accumulators (FlashAttention-2's
//!   register reuse), no memory.
//!
//! Lane `l` of an `.x4` load gives the address of row `l % 8` of matrix `l / 8`
//! ([`crate::ldmatrix`]); each loader's matrix order is the fragment order of [`crate::mma`].

use super::layout::Layout;
#[cfg(doc)]
use super::layout::SmemTile;
use crate::ldmatrix::{ldmatrix_x4, ldmatrix_x4_trans};
use crate::mma::{FragA, FragB, FragC, MmaElement};

/// `mma` steps of 16 columns across `d` columns (the reduction steps of `Q Kᵀ` over the head
/// dimension).
pub const fn k_steps(d: usize) -> usize {
    d / 16
}

/// Accumulators of 8 columns across `d` columns (`O`'s per row tile).
pub const fn n_tiles(d: usize) -> usize {
    d / 8
}

/// The A fragment of rows `row .. + 16`, columns `col .. + 16` (row-major: the tile's rows are
/// A's rows).
///
/// Matrices: (rows +0..8, cols +0..8), (rows +8..16, cols +0..8), (rows +0..8, cols +8..16),
/// (rows +8..16, cols +8..16), exactly A's `a0a1`, `a2a3`, `a4a5`, `a6a7`.
///
/// # Safety
/// The whole warp calls it; `tile` is a tile laid out as `L`; rows `row .. row + 16` and columns
/// `col .. col + 16` are inside it and were written before a barrier that orders them for every
/// lane.
#[inline(always)]
pub unsafe fn load_q_fragment<E: MmaElement, L: Layout>(
    tile: u32,
    row: u32,
    col: u32,
    lane: u32,
) -> FragA<E> {
    let at = L::block_addr(tile, row, col, lane % 16, lane / 16);
    // SAFETY: inside the tile (the caller's contract); forwarded barrier.
    FragA::from_regs(unsafe { ldmatrix_x4(at) })
}

/// The B fragments of `Kᵀ` for keys (rows) `row .. + 16` and dims (columns) `col .. + 16`: two
/// accumulators' worth, keys `+0..8` and `+8..16` (keys are B's `n`, dims its `k`), with plain
/// `ldmatrix` from the row-major K tile.
///
/// Matrices: (keys +0..8, dims +0..8), (keys +0..8, dims +8..16), (keys +8..16, dims +0..8),
/// (keys +8..16, dims +8..16).
///
/// # Safety
/// As [`load_q_fragment`].
#[inline(always)]
pub unsafe fn load_k_fragments<E: MmaElement, L: Layout>(
    tile: u32,
    row: u32,
    col: u32,
    lane: u32,
) -> [FragB<E>; 2] {
    let (matrix, r) = (lane / 8, lane % 8);
    let at = L::block_addr(tile, row, col, r + 8 * (matrix / 2), matrix % 2);
    // SAFETY: inside the tile (the caller's contract); forwarded barrier.
    let m = unsafe { ldmatrix_x4(at) };
    [
        FragB::from_regs([m[0], m[1]]),
        FragB::from_regs([m[2], m[3]]),
    ]
}

/// The B fragments of `V` for keys (rows) `row .. + 16` and dims (columns) `col .. + 16`: two
/// accumulators' worth, dims `+0..8` and `+8..16` (keys are B's `k`, dims its `n`), with
/// `ldmatrix.trans` from the row-major V tile.
///
/// Matrices: (keys +0..8, dims +0..8), (keys +8..16, dims +0..8), (keys +0..8, dims +8..16),
/// (keys +8..16, dims +8..16); the transpose gives each lane two consecutive keys of one dim.
///
/// # Safety
/// As [`load_q_fragment`].
#[inline(always)]
pub unsafe fn load_v_fragments<E: MmaElement, L: Layout>(
    tile: u32,
    row: u32,
    col: u32,
    lane: u32,
) -> [FragB<E>; 2] {
    let (matrix, r) = (lane / 8, lane % 8);
    let at = L::block_addr(tile, row, col, r + 8 * (matrix % 2), matrix / 2);
    // SAFETY: inside the tile (the caller's contract); forwarded barrier.
    let m = unsafe { ldmatrix_x4_trans(at) };
    [
        FragB::from_regs([m[0], m[1]]),
        FragB::from_regs([m[2], m[3]]),
    ]
}

/// The A fragment of `P` for 16 keys from the two `S` accumulators of those keys, `lo` (keys
/// `+0..8`) and `hi` (keys `+8..16`): a C accumulator holds rows `lane / 4` (`regs[0..2]`) and
/// `lane / 4 + 8` (`regs[2..4]`) of 8 keys, exactly A's `a0a1` / `a2a3` for `lo` and `a4a5` /
/// `a6a7` for `hi`.
///
/// `ROWS` is how many of the 16 rows the products use: 16, or 8, where rows `8..16` are zero by
/// construction (decode: the group's query heads are rows `0..8`) and their registers are
/// zeros rather than converted scores.
#[inline(always)]
pub fn p_fragment<E: MmaElement, const ROWS: u32>(lo: &FragC, hi: &FragC) -> FragA<E> {
    const { assert!(ROWS == 8 || ROWS == 16) };
    let upper = |c: &FragC| {
        if ROWS == 16 {
            E::pack2(c.regs[2], c.regs[3])
        } else {
            0
        }
    };
    FragA::from_regs([
        E::pack2(lo.regs[0], lo.regs[1]),
        upper(lo),
        E::pack2(hi.regs[0], hi.regs[1]),
        upper(hi),
    ])
}
