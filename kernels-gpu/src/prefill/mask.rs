//! Element masks on a partially covered (query block, KV block) tile.
//!
//! Only blocks that [`Window::needs_mask`] flags come here: the diagonal (causal edge, sequence
//! end) and, for streaming heads, blocks crossing the sink edge or the local window's edge.
//! Invisible scores become `-inf`, so they weigh `2^-inf = 0` in the softmax.

use super::block_iter::Window;
use super::tiles::S_TILES;
use crate::mma::{c_coord, FragC};
use crate::unroll8;

/// Sets to `-inf` every score of this lane's `S` accumulators whose (query, key) pair `window`
/// hides. `q_first` is the position of the warp's first query row, `k_first` of the block's
/// first key (both sequence-local).
#[inline(always)]
pub fn apply(s: &mut [FragC; S_TILES], window: Window, q_first: u32, k_first: u32, lane: u32) {
    unroll8!(n in 0..S_TILES => {
        unroll8!(i in 0..4 => {
            let (row, col) = c_coord(lane, i as u32);
            let (t, j) = (q_first + row, k_first + 8 * n as u32 + col);
            if !window.visible(t, j) {
                s[n].regs[i] = f32::NEG_INFINITY;
            }
        });
    });
}
