//! Online softmax over the rows of a warp's accumulators, in registers (FlashAttention-2).
//!
//! A lane holds two query rows of the warp's 16 (`group` and `group + 8`, see [`crate::mma`]);
//! each row is spread over the 4 lanes of a quad, so row maxima are quad reductions. Per row the
//! state is the running maximum `m` of the raw scores and this lane's share of the running
//! denominator `l` (the quad's shares are summed once, at the end: every lane of a quad rescales
//! by the same factors). Scores are scaled into base 2 inside the exponent:
//! `p = 2^(s · scale_log2 − m · scale_log2)`.

use super::tiles::{MAX_O_TILES, S_TILES};
use crate::math::{exp2, fma};
use crate::mma::FragC;
use crate::unroll8;
use crate::warp::{quad_max_f32, quad_sum_f32};

/// The softmax state of this lane's two rows.
pub struct RowSoftmax {
    /// Running maximum raw score per row (`-inf` before any visible key).
    m: [f32; 2],
    /// This lane's share of the running denominator per row.
    l: [f32; 2],
    scale_log2: f32,
}

impl RowSoftmax {
    /// No keys seen yet.
    #[inline(always)]
    pub fn new(scale_log2: f32) -> Self {
        Self {
            m: [f32::NEG_INFINITY; 2],
            l: [0.0; 2],
            scale_log2,
        }
    }

    /// Folds one block of scores in: updates the row maxima, rescales `o` (its first `o_tiles`
    /// accumulators) and the denominators, and turns `s` into the probabilities
    /// `p = 2^(s · scale_log2 − m)` (masked scores, `-inf`, become 0).
    ///
    /// # Safety
    /// The whole warp calls it (quad shuffles).
    #[inline(always)]
    pub unsafe fn update(
        &mut self,
        s: &mut [FragC; S_TILES],
        o: &mut [FragC; MAX_O_TILES],
        o_tiles: usize,
    ) {
        unroll8!(r in 0..2 => {
            let mut block_max = f32::NEG_INFINITY;
            unroll8!(n in 0..S_TILES => {
                block_max = block_max.max(s[n].regs[2 * r]).max(s[n].regs[2 * r + 1]);
            });
            // SAFETY: forwarded: the whole warp is here.
            let m_new = self.m[r].max(unsafe { quad_max_f32(block_max) });
            // A row that has seen only masked keys keeps m = -inf: use 0 as its reference so
            // that no `-inf - -inf` appears (its p are all 0 and its correction is irrelevant).
            let m_scaled = if m_new == f32::NEG_INFINITY {
                0.0
            } else {
                m_new * self.scale_log2
            };
            let correction = exp2(fma(self.m[r], self.scale_log2, -m_scaled));
            let mut row_sum = 0.0;
            unroll8!(n in 0..S_TILES => {
                unroll8!(c in 0..2 => {
                    let p = exp2(fma(s[n].regs[2 * r + c], self.scale_log2, -m_scaled));
                    s[n].regs[2 * r + c] = p;
                    row_sum += p;
                });
            });
            self.l[r] = fma(self.l[r], correction, row_sum);
            crate::unroll16!(n in 0..o_tiles => {
                o[n].regs[2 * r] *= correction;
                o[n].regs[2 * r + 1] *= correction;
            });
            self.m[r] = m_new;
        });
    }

    /// `1 / l` of both rows (the quad's shares summed). Every row saw its diagonal key, so
    /// `l >= 1`.
    ///
    /// # Safety
    /// The whole warp calls it (quad shuffles).
    #[inline(always)]
    pub unsafe fn inverse_denominators(&self) -> [f32; 2] {
        // SAFETY: forwarded.
        unsafe { [1.0 / quad_sum_f32(self.l[0]), 1.0 / quad_sum_f32(self.l[1])] }
    }
}
