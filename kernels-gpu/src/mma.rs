//! Warp-wide tensor-core products: `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{..}.f32`,
//! `D (16x8, f32) = A (16x16) * B (16x8) + C (16x8, f32)`.
//!
//! Each of the 32 lanes holds a fixed piece of every operand (a *fragment*). With
//! `group = lane / 4` (0..8) and `quad = lane % 4` (the thread in the group), the PTX ISA
//! ("Matrix Fragments for mma.m16n8k16 with floating point type") places them as follows. A
//! packed `u32` holds two 16-bit elements, the lower-indexed one in bits 0..16.
//!
//! **A** (16x16, row-major, 4 × `u32` = 8 elements `a0..a7`):
//!
//! | register | elements | row         | columns                  |
//! |----------|----------|-------------|--------------------------|
//! | `regs[0]`| a0, a1   | `group`     | `2*quad`, `2*quad + 1`   |
//! | `regs[1]`| a2, a3   | `group + 8` | `2*quad`, `2*quad + 1`   |
//! | `regs[2]`| a4, a5   | `group`     | `2*quad + 8`, `+ 9`      |
//! | `regs[3]`| a6, a7   | `group + 8` | `2*quad + 8`, `+ 9`      |
//!
//! **B** (16x8, "col": each lane's pair runs along `k`, 2 × `u32` = 4 elements `b0..b3`):
//!
//! | register | elements | rows (k)               | column (n) |
//! |----------|----------|------------------------|------------|
//! | `regs[0]`| b0, b1   | `2*quad`, `2*quad + 1` | `group`    |
//! | `regs[1]`| b2, b3   | `2*quad + 8`, `+ 9`    | `group`    |
//!
//! **C / D** (16x8, f32, 4 values `c0..c3`):
//!
//! | value            | row         | columns                |
//! |------------------|-------------|------------------------|
//! | `regs[0..2]`     | `group`     | `2*quad`, `2*quad + 1` |
//! | `regs[2..4]`     | `group + 8` | `2*quad`, `2*quad + 1` |
//!
//! So a row of C/D is spread over the 4 lanes of a quad: row reductions (softmax max / sum) are
//! [`crate::warp::quad_max_f32`] / [`crate::warp::quad_sum_f32`].
//!
//! `ldmatrix` (see [`crate::ldmatrix`]) produces exactly these A and B fragments from shared
//! memory; the `load_*` functions here read them from any memory with plain loads (slow, for
//! tests and edge tiles).

use core::arch::asm;
use core::marker::PhantomData;

use crate::convert::{Bf16, Half16, F16};

/// `(row, col)` of element `i` (0..8) of lane `lane`'s A fragment (see the module table).
#[inline(always)]
pub const fn a_coord(lane: u32, i: u32) -> (u32, u32) {
    let (group, quad) = (lane / 4, lane % 4);
    let row = group + 8 * ((i / 2) % 2);
    let col = 2 * quad + (i % 2) + 8 * (i / 4);
    (row, col)
}

/// `(k, n)` of element `i` (0..4) of lane `lane`'s B fragment.
#[inline(always)]
pub const fn b_coord(lane: u32, i: u32) -> (u32, u32) {
    let (group, quad) = (lane / 4, lane % 4);
    (2 * quad + (i % 2) + 8 * (i / 2), group)
}

/// `(row, col)` of value `i` (0..4) of lane `lane`'s C/D fragment.
#[inline(always)]
pub const fn c_coord(lane: u32, i: u32) -> (u32, u32) {
    let (group, quad) = (lane / 4, lane % 4);
    (group + 8 * (i / 2), 2 * quad + (i % 2))
}

/// A lane's piece of a 16x16 A operand of element type `E`.
#[derive(Clone, Copy)]
pub struct FragA<E> {
    /// Packed element pairs, see the module table.
    pub regs: [u32; 4],
    _elem: PhantomData<E>,
}

/// A lane's piece of a 16x8 B operand of element type `E`.
#[derive(Clone, Copy)]
pub struct FragB<E> {
    /// Packed element pairs, see the module table.
    pub regs: [u32; 2],
    _elem: PhantomData<E>,
}

/// A lane's piece of a 16x8 f32 accumulator (C in, D out).
#[derive(Clone, Copy, Default)]
pub struct FragC {
    /// See the module table.
    pub regs: [f32; 4],
}

impl<E: Half16> FragA<E> {
    /// Wraps registers already laid out as an A fragment (e.g. from `ldmatrix`).
    #[inline(always)]
    pub fn from_regs(regs: [u32; 4]) -> Self {
        Self {
            regs,
            _elem: PhantomData,
        }
    }

    /// Loads this lane's fragment of the 16x16 tile at `tile` (row-major, `ld` elements per row).
    ///
    /// # Safety
    /// `tile` points to 16 rows of `ld >= 16` readable elements; `ld` even (4-byte pairs).
    #[inline(always)]
    pub unsafe fn load_row_major(tile: *const u16, ld: usize, lane: u32) -> Self {
        let mut regs = [0u32; 4];
        let mut r = 0;
        while r < 4 {
            let (row, col) = a_coord(lane, 2 * r as u32);
            // SAFETY: (row, col) and (row, col + 1) are inside the 16x16 tile; col is even.
            regs[r] = unsafe {
                tile.add(row as usize * ld + col as usize)
                    .cast::<u32>()
                    .read()
            };
            r += 1;
        }
        Self::from_regs(regs)
    }
}

impl<E: Half16> FragB<E> {
    /// Wraps registers already laid out as a B fragment (e.g. from `ldmatrix`).
    #[inline(always)]
    pub fn from_regs(regs: [u32; 2]) -> Self {
        Self {
            regs,
            _elem: PhantomData,
        }
    }

    /// Loads this lane's fragment of the 16x8 tile `B[k][n]` stored k-major (`tile[k * ld + n]`,
    /// like V in attention).
    ///
    /// # Safety
    /// `tile` points to 16 rows of `ld >= 8` readable elements.
    #[inline(always)]
    pub unsafe fn load_k_major(tile: *const u16, ld: usize, lane: u32) -> Self {
        let mut regs = [0u32; 2];
        let mut r = 0;
        while r < 2 {
            let (k0, n) = b_coord(lane, 2 * r as u32);
            // SAFETY: rows k0 and k0 + 1 (< 16), column n (< 8) are inside the tile.
            let (lo, hi) = unsafe {
                (
                    tile.add(k0 as usize * ld + n as usize).read(),
                    tile.add((k0 as usize + 1) * ld + n as usize).read(),
                )
            };
            regs[r] = lo as u32 | (hi as u32) << 16;
            r += 1;
        }
        Self::from_regs(regs)
    }
}

impl FragC {
    /// Loads this lane's values of the 16x8 f32 tile at `tile` (row-major, `ld` per row).
    ///
    /// # Safety
    /// `tile` points to 16 rows of `ld >= 8` readable `f32`.
    #[inline(always)]
    pub unsafe fn load_row_major(tile: *const f32, ld: usize, lane: u32) -> Self {
        let mut regs = [0f32; 4];
        let mut i = 0;
        while i < 4 {
            let (row, col) = c_coord(lane, i as u32);
            // SAFETY: inside the tile by the caller's guarantee.
            regs[i] = unsafe { tile.add(row as usize * ld + col as usize).read() };
            i += 1;
        }
        Self { regs }
    }

    /// Stores this lane's values into the 16x8 f32 tile at `tile` (row-major, `ld` per row).
    ///
    /// # Safety
    /// `tile` points to 16 rows of `ld >= 8` writable `f32`, not written concurrently by others.
    #[inline(always)]
    pub unsafe fn store_row_major(&self, tile: *mut f32, ld: usize, lane: u32) {
        let mut i = 0;
        while i < 4 {
            let (row, col) = c_coord(lane, i as u32);
            // SAFETY: inside the tile by the caller's guarantee.
            unsafe {
                tile.add(row as usize * ld + col as usize)
                    .write(self.regs[i])
            };
            i += 1;
        }
    }
}

/// Element types with an `m16n8k16` f32-accumulate tensor-core product.
pub trait MmaElement: Half16 {
    /// `D = A * B + C` for one warp (see [`mma_m16n8k16`]).
    ///
    /// # Safety
    /// As [`mma_m16n8k16`].
    unsafe fn mma_m16n8k16(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4];
}

macro_rules! impl_mma {
    ($ty:ty, $name:literal) => {
        impl MmaElement for $ty {
            #[inline(always)]
            unsafe fn mma_m16n8k16(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
                let (d0, d1, d2, d3): (f32, f32, f32, f32);
                // SAFETY: register-only warp-collective op; the caller guarantees a converged warp.
                unsafe {
                    asm!(
                        concat!("mma.sync.aligned.m16n8k16.row.col.f32.", $name, ".", $name, ".f32 ",
                                "{{{0}, {1}, {2}, {3}}}, {{{4}, {5}, {6}, {7}}}, {{{8}, {9}}}, ",
                                "{{{10}, {11}, {12}, {13}}};"),
                        out(reg32) d0, out(reg32) d1, out(reg32) d2, out(reg32) d3,
                        in(reg32) a[0], in(reg32) a[1], in(reg32) a[2], in(reg32) a[3],
                        in(reg32) b[0], in(reg32) b[1],
                        in(reg32) c[0], in(reg32) c[1], in(reg32) c[2], in(reg32) c[3],
                        // Not `pure`: a warp-collective op must not be speculated or merged.
                        options(nomem, nostack),
                    );
                }
                [d0, d1, d2, d3]
            }
        }
    };
}

impl_mma!(Bf16, "bf16");
impl_mma!(F16, "f16");

/// `D = A * B + C` on the tensor cores, one 16x8x16 product per warp, f32 accumulation.
///
/// # Safety
/// All 32 lanes of the warp execute this call together (converged, `mma.sync.aligned`), each
/// passing its own fragments.
#[inline(always)]
pub unsafe fn mma_m16n8k16<E: MmaElement>(a: &FragA<E>, b: &FragB<E>, c: &FragC) -> FragC {
    // SAFETY: forwarded invariant.
    FragC {
        regs: unsafe { E::mma_m16n8k16(a.regs, b.regs, c.regs) },
    }
}
