//! `ldmatrix`: a warp loads 8x8 tiles of 16-bit elements from shared memory straight into `mma`
//! fragment layout.
//!
//! `ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16`: for `.xN`, lanes `8*j .. 8*j + 8`
//! give the shared addresses of the 8 rows (16 bytes each, 16-byte aligned) of matrix `j`; the
//! other lanes' addresses are ignored. Result register `j` of lane `l` then holds, from matrix `j`:
//! - plain: row `l / 4`, columns `2*(l % 4)` and `2*(l % 4) + 1` (low half, high half);
//! - `.trans`: column `l / 4`, rows `2*(l % 4)` and `2*(l % 4) + 1`, i.e. the same of the
//!   transposed matrix.
//!
//! The `load_*` helpers below pick those row addresses so that the result is an A or B fragment
//! of [`crate::mma`].

use core::arch::asm;

use crate::convert::Half16;
use crate::mma::{FragA, FragB};

/// Loads four 8x8 matrices (`.x4`); `row_addr` is this lane's row address (see module docs).
///
/// # Safety
/// All 32 lanes call it (converged); every lane's `row_addr` is a 16-byte-aligned shared-window
/// address of 16 readable bytes, written before the last barrier that orders them.
#[inline(always)]
pub unsafe fn ldmatrix_x4(row_addr: u32) -> [u32; 4] {
    let (r0, r1, r2, r3): (u32, u32, u32, u32);
    // SAFETY: caller guarantees the addresses and the converged warp.
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{0}, {1}, {2}, {3}}}, [{4}];",
             out(reg32) r0, out(reg32) r1, out(reg32) r2, out(reg32) r3, in(reg32) row_addr,
             options(readonly, nostack));
    }
    [r0, r1, r2, r3]
}

/// [`ldmatrix_x4`] with `.trans`.
///
/// # Safety
/// As [`ldmatrix_x4`].
#[inline(always)]
pub unsafe fn ldmatrix_x4_trans(row_addr: u32) -> [u32; 4] {
    let (r0, r1, r2, r3): (u32, u32, u32, u32);
    // SAFETY: as above.
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{0}, {1}, {2}, {3}}}, [{4}];",
             out(reg32) r0, out(reg32) r1, out(reg32) r2, out(reg32) r3, in(reg32) row_addr,
             options(readonly, nostack));
    }
    [r0, r1, r2, r3]
}

/// Loads two 8x8 matrices (`.x2`); addresses of lanes 0..16 are used.
///
/// # Safety
/// As [`ldmatrix_x4`] (lanes 16..32 should still pass a valid address, e.g. a copy of lane
/// `l % 16`'s: the ISA ignores them, tools may not).
#[inline(always)]
pub unsafe fn ldmatrix_x2(row_addr: u32) -> [u32; 2] {
    let (r0, r1): (u32, u32);
    // SAFETY: as above.
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {{{0}, {1}}}, [{2}];",
             out(reg32) r0, out(reg32) r1, in(reg32) row_addr, options(readonly, nostack));
    }
    [r0, r1]
}

/// [`ldmatrix_x2`] with `.trans`.
///
/// # Safety
/// As [`ldmatrix_x2`].
#[inline(always)]
pub unsafe fn ldmatrix_x2_trans(row_addr: u32) -> [u32; 2] {
    let (r0, r1): (u32, u32);
    // SAFETY: as above.
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {{{0}, {1}}}, [{2}];",
             out(reg32) r0, out(reg32) r1, in(reg32) row_addr, options(readonly, nostack));
    }
    [r0, r1]
}

/// Row address for a 16x16 tile loaded with `.x4` as four 8x8 quadrants in the order
/// (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15):
/// lane `l` points at row `l % 16`, column `8 * (l / 16)`.
///
/// `tile` is the shared-window address of element (0, 0); `row_bytes` the row stride in bytes
/// (a multiple of 16).
#[inline(always)]
pub fn x4_quadrant_row_addr(tile: u32, row_bytes: u32, lane: u32) -> u32 {
    tile + (lane % 16) * row_bytes + (lane / 16) * 16
}

/// Loads the A fragment of a row-major 16x16 tile in shared memory.
///
/// # Safety
/// As [`ldmatrix_x4`]: `tile` is the 16-byte-aligned shared address of element (0, 0), 16 rows of
/// `row_bytes` (a multiple of 16, at least 32) are readable and were written before a barrier.
#[inline(always)]
pub unsafe fn load_a_row_major<E: Half16>(tile: u32, row_bytes: u32, lane: u32) -> FragA<E> {
    // Quadrant order (0,0), (8,0), (0,8), (8,8) is exactly a0a1, a2a3, a4a5, a6a7.
    // SAFETY: forwarded invariant.
    FragA::from_regs(unsafe { ldmatrix_x4(x4_quadrant_row_addr(tile, row_bytes, lane)) })
}

/// Loads the B fragment of a 16x8 tile stored k-major (`B[k][n]` at `k * row_bytes + 2 n`, like
/// V in attention), with `.x2.trans`: matrix 0 is k 0..8, matrix 1 is k 8..16.
///
/// # Safety
/// As [`ldmatrix_x2`]: 16 rows of 16 bytes at `tile + k * row_bytes`, 16-byte aligned.
#[inline(always)]
pub unsafe fn load_b_k_major<E: Half16>(tile: u32, row_bytes: u32, lane: u32) -> FragB<E> {
    // Lane l (0..16) addresses row k = l; the transpose makes lane l hold k = 2*(l%4) (+1) of
    // column n = l/4, which is the B fragment.
    // SAFETY: forwarded invariant.
    FragB::from_regs(unsafe { ldmatrix_x2_trans(tile + (lane % 16) * row_bytes) })
}

/// Loads the B fragment of a 16x8 tile stored n-major (`B[k][n]` at `n * row_bytes + 2 k`, i.e.
/// Bᵀ row-major, like K in `Q Kᵀ`), with `.x2`: matrix 0 is k 0..8, matrix 1 is k 8..16.
///
/// # Safety
/// As [`ldmatrix_x2`]: 8 rows of 32 bytes at `tile + n * row_bytes`, 16-byte aligned.
#[inline(always)]
pub unsafe fn load_b_n_major<E: Half16>(tile: u32, row_bytes: u32, lane: u32) -> FragB<E> {
    // Lane l (0..16) addresses row n = l % 8 at k offset 8 * (l / 8); plain ldmatrix gives lane l
    // row n = l/4, k = 2*(l%4) (+1): the B fragment.
    let l = lane % 16;
    // SAFETY: forwarded invariant.
    FragB::from_regs(unsafe { ldmatrix_x2(tile + (l % 8) * row_bytes + (l / 8) * 16) })
}
