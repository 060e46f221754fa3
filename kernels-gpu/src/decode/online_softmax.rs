//! The decode tile's step of the online softmax, in base 2, over the `S` accumulators: with the
//! query heads as rows ([`add_tile`], the 16-bit kernels) or the keys as rows ([`add_column_tile`],
//! the integer-coded kernel).
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
use crate::warp::{quad_max_f32, shfl_xor_f32};

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

/// The step of the online softmax for a tile whose keys are the rows of `s` (`Sᵀ`, the integer-
/// coded kernel, `decode::coded`): registers `2e + c` are key `r + 8e` of head `2t + c`
/// (`r = lane / 4`, `t = lane % 4`), so a head's 16 scores are in the 8 lanes of one `t`; keys
/// `valid..16` masked; turns them into probabilities
/// and returns each head's correction `2^(m_old - m_new)`.
///
/// # Safety
/// All 32 lanes call it (shuffles); `1 <= valid <= 16`.
#[inline(always)]
pub unsafe fn add_column_tile(
    states: &mut [SoftmaxState; 2],
    s: &mut FragC,
    valid: u32,
    scale: f32,
    lane: u32,
) -> [f32; 2] {
    let r = lane / 4;
    let mut corrections = [0.0; 2];
    crate::unroll8!(c in 0..2 => {
        let mut tile_max = f32::NEG_INFINITY;
        crate::unroll8!(e in 0..2 => {
            let key = r + 8 * e as u32;
            let x = if key < valid {
                s.regs[2 * e + c] * scale
            } else {
                f32::NEG_INFINITY
            };
            s.regs[2 * e + c] = x;
            tile_max = tile_max.max(x);
        });
        // The head's 16 keys are in lanes t, t + 4, .., t + 28.
        // SAFETY: forwarded: every lane is here.
        let tile_max = unsafe {
            let m = tile_max.max(shfl_xor_f32(tile_max, 4));
            let m = m.max(shfl_xor_f32(m, 8));
            m.max(shfl_xor_f32(m, 16))
        };
        let state = &mut states[c];
        let m_new = state.m.max(tile_max);
        // Finite: key 0 of every tile is valid. `2^(-inf) = 0` covers the first tile.
        let correction = exp2(state.m - m_new);
        let mut sum = 0.0;
        crate::unroll8!(e in 0..2 => {
            let p = exp2(s.regs[2 * e + c] - m_new);
            s.regs[2 * e + c] = p;
            sum += p;
        });
        state.rescale_add(m_new, correction, sum);
        corrections[c] = correction;
    });
    corrections
}
