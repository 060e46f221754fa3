//! The decode tile's step of the online softmax, in base 2, over the `S` accumulators.
//!
//! Lane `l` of a warp holds, for query head `l / 4` of the group (row `l / 4` of the `mma`
//! products), the scores of keys `2 (l % 4) + {0, 1}` and `8 + 2 (l % 4) + {0, 1}` of each tile:
//! a head's 16 scores are spread over the 4 lanes of a quad. The state is the shared
//! [`SoftmaxState`]: the running maximum `m` (log2 units, softmax scale folded in, the same in
//! the 4 lanes) and this lane's part of the denominator (the quad sums its parts at the end,
//! [`SoftmaxState::quad_total`]). The warps' states and then the splits' merge with
//! [`SoftmaxState::merge`].

use crate::math::exp2;
use crate::mma::FragC;
use crate::tile::SoftmaxState;
use crate::warp::quad_max_f32;

/// Adds one tile to `state`, the softmax of this lane's query head: turns the tile's raw scores
/// `s` into probabilities `2^(scale·s - m_new)` in place, keys `valid..16` masked to zero, and
/// returns the factor `2^(m_old - m_new)` by which the output accumulators must be scaled first.
///
/// # Safety
/// All 32 lanes call it (quad shuffles); `1 <= valid <= 16`.
#[inline(always)]
pub unsafe fn add_tile(
    state: &mut SoftmaxState,
    s: &mut [FragC; 2],
    valid: u32,
    lane: u32,
    scale: f32,
) -> f32 {
    let first_key = 2 * (lane % 4);
    let mut tile_max = f32::NEG_INFINITY;
    let mut n = 0;
    while n < 2 {
        let mut c = 0;
        while c < 2 {
            let key = 8 * n as u32 + first_key + c as u32;
            let x = if key < valid {
                s[n].regs[c] * scale
            } else {
                f32::NEG_INFINITY
            };
            s[n].regs[c] = x;
            tile_max = tile_max.max(x);
            c += 1;
        }
        n += 1;
    }
    // SAFETY: forwarded: every lane is here.
    let m_new = state.m.max(unsafe { quad_max_f32(tile_max) });
    // Finite: key 0 of every tile is valid. `2^(-inf) = 0` covers the first tile.
    let correction = exp2(state.m - m_new);
    let mut sum = 0.0;
    let mut n = 0;
    while n < 2 {
        let mut c = 0;
        while c < 2 {
            let p = exp2(s[n].regs[c] - m_new);
            s[n].regs[c] = p;
            sum += p;
            c += 1;
        }
        n += 1;
    }
    state.rescale_add(m_new, correction, sum);
    correction
}
