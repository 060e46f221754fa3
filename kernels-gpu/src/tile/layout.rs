//! Tiles in shared memory: rows of 16-bit elements, addressed by 16-byte chunks (8 elements,
//! what one `cp.async` copies and one `ldmatrix` lane addresses).
//!
//! A [`SmemTile`] is a tile's 32-bit shared-window address and, as a type, its [`Layout`]: where
//! chunk `c` of row `r` lies. Two layouts, both leaving the eight 16-byte rows an `ldmatrix` 8x8
//! load reads in distinct bank groups:
//! - [`Swizzled`]: `D / 64` boxes of `ROWS` rows of 128 bytes (64 elements); chunk `c` of a box
//!   row `r` at chunk `c ^ (r % 8)`. This is what a tensor copy with the 128-byte swizzle
//!   writes (the tile on a 1024-byte boundary), and every row starts on a 128-byte line;
//! - [`Padded`]: rows `D + PAD` elements apart, chunk `c` at `16 c` bytes.

use core::marker::PhantomData;

/// Where the chunks of a tile of `ROWS` rows of `D` elements lie, relative to the tile's start.
pub trait Layout {
    /// Bytes of the tile.
    const BYTES: u32;
    /// 16-byte chunks per row (`D / 8`).
    const ROW_CHUNKS: u32;

    /// The shared-window address of chunk `chunk` (elements `8 chunk .. + 8`) of row `row` of
    /// the tile at `tile`.
    fn chunk_addr(tile: u32, row: u32, chunk: u32) -> u32;

    /// The address a lane gives an `ldmatrix` load of the 16 x 16 block whose first row is `row`
    /// and first element column `col` (a multiple of 8): row `row + lane_row`, chunk
    /// `lane_chunk` (0 or 1) of the block, for the lane's part (`lane_row`, `lane_chunk`) that
    /// the loader derives from the lane.
    fn block_addr(tile: u32, row: u32, col: u32, lane_row: u32, lane_chunk: u32) -> u32;
}

/// The 128-byte swizzle: `D / 64` boxes of `ROWS` rows x 64 elements, chunk `c` of box row `r`
/// at chunk `c ^ (r % 8)` of that row (see the module docs). `ROWS` is a multiple of 8, so every
/// box starts on a swizzle span (8 rows of 128 bytes).
pub struct Swizzled<const D: usize, const ROWS: u32>;

impl<const D: usize, const ROWS: u32> Swizzled<D, ROWS> {
    /// Bytes of a box row: 64 elements.
    pub const BOX_ROW_BYTES: u32 = 128;
    /// Bytes of a box: `ROWS` rows of 64 elements.
    pub const BOX_BYTES: u32 = ROWS * Self::BOX_ROW_BYTES;
    /// Columns of a box.
    pub const BOX_COLUMNS: u32 = 64;
}

impl<const D: usize, const ROWS: u32> Layout for Swizzled<D, ROWS> {
    const BYTES: u32 = (D as u32 / Self::BOX_COLUMNS) * Self::BOX_BYTES;
    const ROW_CHUNKS: u32 = D as u32 / 8;

    /// Box `chunk / 8`, box row `row`, swizzled chunk `(chunk % 8) ^ (row % 8)`.
    #[inline(always)]
    fn chunk_addr(tile: u32, row: u32, chunk: u32) -> u32 {
        let (box_index, c) = (chunk / 8, chunk % 8);
        // Summed from the tile's address on: LLVM keeps this order, and the decode loop's
        // fragment addresses then fold into fewer instructions than with the offset summed
        // first.
        tile + box_index * Self::BOX_BYTES + row * Self::BOX_ROW_BYTES + ((c ^ (row % 8)) * 16)
    }

    /// [`Self::chunk_addr`] of the lane's row and chunk (the chunk is swizzled, so the column
    /// goes in as a chunk).
    #[inline(always)]
    fn block_addr(tile: u32, row: u32, col: u32, lane_row: u32, lane_chunk: u32) -> u32 {
        Self::chunk_addr(tile, lane_row + row, lane_chunk + col / 8)
    }
}

/// Rows of `D` elements, `D + PAD` elements apart (`PAD` a multiple of 8: rows stay 16-byte
/// aligned, and a pad of 8 moves consecutive rows by one bank group).
pub struct Padded<const D: usize, const ROWS: u32, const PAD: u32>;

impl<const D: usize, const ROWS: u32, const PAD: u32> Padded<D, ROWS, PAD> {
    /// Bytes between consecutive rows.
    pub const ROW_BYTES: u32 = (D as u32 + PAD) * 2;
}

impl<const D: usize, const ROWS: u32, const PAD: u32> Layout for Padded<D, ROWS, PAD> {
    const BYTES: u32 = ROWS * Self::ROW_BYTES;
    const ROW_CHUNKS: u32 = D as u32 / 8;

    #[inline(always)]
    fn chunk_addr(tile: u32, row: u32, chunk: u32) -> u32 {
        tile + row * Self::ROW_BYTES + chunk * 16
    }

    /// Row and element column summed first, then scaled: with the column in elements (not
    /// chunks) the per-step offsets of an unrolled loop fold into the instruction's immediate.
    #[inline(always)]
    fn block_addr(tile: u32, row: u32, col: u32, lane_row: u32, lane_chunk: u32) -> u32 {
        tile + (row + lane_row) * Self::ROW_BYTES + (col + 8 * lane_chunk) * 2
    }
}

/// A tile in shared memory: its shared-window address, laid out as `L`.
///
/// Computing addresses is safe; what reads or writes them (`ldmatrix`, `cp.async`, `st.shared`)
/// states the rows and chunks it touches, which must lie inside the tile.
#[repr(transparent)]
pub struct SmemTile<L> {
    addr: u32,
    layout: PhantomData<L>,
}

// Not derived: a derive would ask `L: Clone`, and the layouts are markers.
impl<L> Clone for SmemTile<L> {
    #[inline(always)]
    fn clone(&self) -> Self {
        *self
    }
}

impl<L> Copy for SmemTile<L> {}

impl<L: Layout> SmemTile<L> {
    /// The tile at shared-window address `addr` (16-byte aligned; 1024-byte aligned for
    /// [`Swizzled`], whose swizzle is that of absolute addresses).
    #[inline(always)]
    pub fn at(addr: u32) -> Self {
        Self {
            addr,
            layout: PhantomData,
        }
    }

    /// The tile's shared-window address.
    #[inline(always)]
    pub fn addr(self) -> u32 {
        self.addr
    }

    /// The tile of the same layout right after this one ([`Layout::BYTES`] later).
    #[inline(always)]
    pub fn next(self) -> Self {
        Self::at(self.addr + L::BYTES)
    }

    /// The shared-window address of chunk `chunk` of row `row`.
    #[inline(always)]
    pub fn chunk(self, row: u32, chunk: u32) -> u32 {
        L::chunk_addr(self.addr, row, chunk)
    }
}
