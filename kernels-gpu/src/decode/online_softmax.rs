//! Online softmax in base 2 over the `S` accumulators of the decode kernel.
//!
//! Lane `l` of a warp holds, for query head `l / 4` of the group (row `l / 4` of the `mma`
//! products), the scores of keys `2 (l % 4) + {0, 1}` and `8 + 2 (l % 4) + {0, 1}` of each tile:
//! a head's 16 scores are spread over the 4 lanes of a quad. The state is the running maximum `m`
//! (log2 units, softmax scale folded in, the same in the 4 lanes) and this lane's part of the
//! denominator `l = Σ 2^(s - m)` (the quad sums its parts at the end). States over disjoint keys
//! merge associatively ([`merge_weight`]), which makes both the warp split inside a block and the
//! flash-decoding split across blocks exact.

use crate::math::{exp2, fma};
use crate::mma::FragC;
use crate::warp::quad_max_f32;

/// One lane's softmax state for its query head.
#[derive(Clone, Copy)]
pub struct HeadSoftmax {
    /// Running maximum score (log2 units; `-inf` before the first key).
    pub m: f32,
    /// This lane's part of the running denominator, relative to `m`.
    pub l: f32,
}

impl HeadSoftmax {
    /// The state of no keys.
    pub const EMPTY: Self = Self {
        m: f32::NEG_INFINITY,
        l: 0.0,
    };

    /// Adds one tile: turns its raw scores `s` into probabilities `2^(scale·s - m_new)` in place,
    /// keys `valid..16` masked to zero, and returns the factor `2^(m_old - m_new)` by which the
    /// output accumulators must be scaled first.
    ///
    /// # Safety
    /// All 32 lanes call it (quad shuffles); `1 <= valid <= 16`.
    #[inline(always)]
    pub unsafe fn add_tile(
        &mut self,
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
        let m_new = self.m.max(unsafe { quad_max_f32(tile_max) });
        // Finite: key 0 of every tile is valid. `2^(-inf) = 0` covers the first tile.
        let correction = exp2(self.m - m_new);
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
        self.l = fma(self.l, correction, sum);
        self.m = m_new;
        correction
    }
}

/// The weight of a partial state with maximum `m` in a merge whose overall maximum is `m_all`:
/// `2^(m - m_all)`, and `0` for a state that saw no key (avoids `-inf - -inf`).
#[inline(always)]
pub fn merge_weight(m: f32, m_all: f32) -> f32 {
    if m == f32::NEG_INFINITY {
        0.0
    } else {
        exp2(m - m_all)
    }
}
