//! Prefill's tiles in shared memory and their loads from global memory; the fragments are read
//! with the shared tile layer's loaders ([`crate::tile::fragments`]).
//!
//! A K or V tile is 64 rows (keys) of `D` elements, the query tile 64 rows per query block of
//! the kernel's tile (128 unmasked, 64 masked). Both are [`Padded`] tiles: rows
//! `D + PREFILL_ROW_PAD` elements apart, so the eight 16-byte rows of every `ldmatrix` 8x8 load
//! land in distinct bank groups ([`KvTile`], [`QRows`]). Shared memory holds per stage a K and a
//! V tile, then the query tile ([`SmemLayout`]: the K/V addresses do not depend on the query
//! tile's size).
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
use crate::math::opaque_u32;
use crate::smem::{dynamic_smem, shared_addr};
use crate::tile::{Layout, Padded, SmemTile};

/// Rows of a K/V tile (keys).
pub const TILE_ROWS: u32 = BLOCK_KV;
/// Accumulators of `S` per row tile: 64 keys in groups of 8.
pub const S_TILES: usize = (BLOCK_KV / 8) as usize;
/// Most accumulators of `O` per row tile (`D = 128`: 16 groups of 8 dims).
pub const MAX_O_TILES: usize = 16;

/// A K or V tile: 64 keys of `D` elements, rows padded.
pub type KvTile<const D: usize> = Padded<D, TILE_ROWS, PREFILL_ROW_PAD>;
/// The rows of a query block in the query tile: 64 queries of `D` elements, padded as the K/V
/// tiles.
pub type QRows<const D: usize> = Padded<D, BLOCK_Q, PREFILL_ROW_PAD>;

/// Where the tiles live in dynamic shared memory (32-bit shared-window addresses).
pub struct SmemLayout<const D: usize>;

impl<const D: usize> SmemLayout<D> {
    /// The K tile of `stage`.
    #[inline(always)]
    pub fn k(stage: u32) -> SmemTile<KvTile<D>> {
        SmemTile::at(shared_addr(dynamic_smem::<u8>(0)) + KvTile::<D>::BYTES * 2 * stage)
    }

    /// The V tile of `stage` (right after its K tile).
    #[inline(always)]
    pub fn v(stage: u32) -> SmemTile<KvTile<D>> {
        Self::k(stage).next()
    }

    /// The query tile's first query block (after the last stage; the tile has as many blocks
    /// as the kernel's tile).
    #[inline(always)]
    pub fn q() -> SmemTile<QRows<D>> {
        SmemTile::at(Self::k(PREFILL_STAGES).addr())
    }
}

// The layout above is what `prefill_smem_bytes` sizes, for both kernels' query tiles.
const _: () = {
    let kv = 2 * PREFILL_STAGES * KvTile::<128>::BYTES;
    let q_block = QRows::<128>::BYTES;
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
    let row_step = PREFILL_THREADS / KvTile::<D>::ROW_CHUNKS;
    let (row, chunk) = (
        thread / KvTile::<D>::ROW_CHUNKS,
        thread % KvTile::<D>::ROW_CHUNKS,
    );
    let dst = KvTile::<D>::chunk_addr(dst, row, chunk);
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
                    dst + (j as u32 * ROWS + i * row_step) * KvTile::<D>::ROW_BYTES,
                    from as *const u8,
                    bytes,
                )
            };
            next = next.wrapping_add(step);
            i += 1;
        }
    });
}

/// Starts the asynchronous copy of the query tile (`ROWS` rows at `dst`): its rows
/// `lead .. valid_rows` come from `src + (r - lead) * row_stride`, the others are zero-filled
/// (a chunk's tile that starts inside the cached prefix has `lead` rows of positions without a
/// query; the last tile of a sequence has rows past its end). Once per launch block, outside
/// the KV loop.
///
/// # Safety
/// All [`PREFILL_THREADS`] threads call it; `dst` is a tile of `ROWS` rows (64 or 128) of this
/// layout; `lead < valid_rows <= ROWS`, and `valid_rows - lead` rows of `D` elements at
/// `src + i * row_stride` are readable, 16-byte aligned.
#[inline(always)]
pub unsafe fn load_query_tile_async<const D: usize, const ROWS: u32>(
    dst: u32,
    src: *const u16,
    row_stride: usize,
    lead: u32,
    valid_rows: u32,
    thread: u32,
) {
    let row_step = PREFILL_THREADS / QRows::<D>::ROW_CHUNKS;
    let (row, chunk) = (
        thread / QRows::<D>::ROW_CHUNKS,
        thread % QRows::<D>::ROW_CHUNKS,
    );
    let dst = QRows::<D>::chunk_addr(dst, row, chunk);
    // SAFETY: `chunk * 8 + 8 <= D`; row `lead` of the tile (`src`) exists.
    let fallback = unsafe { src.add(chunk as usize * 8) };
    let mut i = 0;
    while i < ROWS / row_step {
        let r = row + i * row_step;
        let (from, bytes) = if r >= lead && r < valid_rows {
            // SAFETY: tile row `r` is source row `r - lead < valid_rows - lead`.
            (
                unsafe { fallback.add((r - lead) as usize * row_stride) },
                16,
            )
        } else {
            (fallback, 0)
        };
        // SAFETY: `from` is a readable 16-byte chunk, or nothing is read; the destination is
        // inside the tile (`r < ROWS`), 16-byte aligned.
        unsafe {
            cp_async_16_zfill(
                dst + i * row_step * QRows::<D>::ROW_BYTES,
                from as *const u8,
                bytes,
            )
        };
        i += 1;
    }
}
