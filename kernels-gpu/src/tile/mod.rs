//! The tile layer of the attention kernels: one shared-memory tile type, one set of `ldmatrix`
//! fragment loaders, one online-softmax state. [`crate::decode`] and [`crate::prefill`] are built
//! on it (`tile/DESIGN.md`).
//!
//! - [`layout`]: [`SmemTile`], a tile of rows in shared memory addressed by 16-byte chunks
//!   (`tile.chunk(row, chunk)`), generic over how its chunks are placed: [`Swizzled`] (boxes of
//!   64 columns, the 128-byte swizzle of the tensor copies; decode) or [`Padded`] (rows padded
//!   past `D`, prefill's layout);
//! - [`fragments`]: the `mma` operands read from a tile, every loader taking
//!   `(tile, row, col, lane)` (the tile's address, the block's first row and element column, the
//!   lane; the layout as a type parameter): `Q`'s A fragment, `Kᵀ`'s and `V`'s B fragment
//!   pairs, and `P`'s A fragment taken from `S`'s registers;
//! - [`softmax`]: [`SoftmaxState`], one row's running maximum and denominator, which the
//!   kernels' per-tile updates move forward ([`SoftmaxState::rescale_add`]) and which merges
//!   states over disjoint keys ([`SoftmaxState::merge`]: decode's warps inside a block, the
//!   split combine across blocks).
//!

pub mod fragments;
pub mod layout;
pub mod softmax;

pub use layout::{Layout, Padded, SmemTile, Swizzled};
pub use softmax::SoftmaxState;
