//! Online softmax over the rows of a warp's accumulators, in registers (FlashAttention-2).
//!
//! A lane holds two query rows of the warp's 16 (`group` and `group + 8`, see [`crate::mma`]);
//! each row is spread over the 4 lanes of a quad, so row maxima are quad reductions. Per row the
//! state is the running maximum `m` of the scores in base-2 units (`max s · scale_log2`, rounded
//! to f32) and this lane's share of the running denominator `l` (the quad's shares are summed
//! once, at the end: every lane of a quad rescales by the same factors). Scores are scaled inside
//! the exponent, one `fma` per score: `p = 2^(s · scale_log2 − m)`. The maximum score's
//! exponent is the rounding residual of `m` (at most half an ulp of `m`, the same for every `p`
//! of the row after the corrections, so it cancels in `O / l`): exact softmax up to rounding
//! while `|m| < 2^30` (scaled logits of about 10^9), not finite beyond (`docs/ARCHITECTURE.md`,
//! "Non-finite and extreme inputs"). Each row's `(m, l)` is the tile layer's
//! [`SoftmaxState`], moved by [`SoftmaxState::rescale_add`] once per block; a prefill block owns
//! its rows over all their keys, so it never merges.

use super::tiles::{MAX_O_TILES, S_TILES};
use crate::math::{exp2, fma};
use crate::mma::FragC;
use crate::tile::SoftmaxState;
use crate::unroll8;
use crate::warp::{ballot, quad_max_f32};

/// The softmax state of this lane's two rows.
pub struct RowSoftmax {
    /// Per row: the running maximum of the scaled scores (`-inf` before any visible key) and
    /// this lane's share of the running denominator.
    rows: [SoftmaxState; 2],
    scale_log2: f32,
}

impl RowSoftmax {
    /// No keys seen yet.
    #[inline(always)]
    pub fn new(scale_log2: f32) -> Self {
        Self {
            rows: [SoftmaxState::EMPTY; 2],
            scale_log2,
        }
    }

    /// Folds one step of scores in (`H` KV blocks of [`S_TILES`] accumulators each, one for the
    /// `mma.sync` kernels, two for the Hopper kernel's 128-key steps): updates the row maxima and
    /// the denominators and turns `s` into the probabilities `p = 2^(s · scale_log2 − m)`
    /// (masked scores, `-inf`, become 0).
    ///
    /// Without `LATENCY_TUNED` it also rescales `o` (its first `o_tiles` accumulators) by the
    /// rows' corrections `2^((m_old − m_new) · scale_log2)` and returns `[1.0; 2]`: the form the
    /// block-mask kernel uses (it measured 3% slower with the tuning, prefill DESIGN.md). With it
    /// (the kernel without caller masks) it returns the corrections (exactly 1 where the
    /// maximum did not move) and leaves `o` to the caller, and the dependent chains between the
    /// two products of a block, which two warps per scheduler cannot hide, are shorter:
    /// - a row's block maximum and probability sum are pairwise trees (4 levels over a lane's
    ///   `16 H` values) instead of running chains (the maximum is the same; the sum rounds
    ///   differently, as any order does);
    /// - `o` is left alone: the caller rescales all its row tiles at once, and not at all when
    ///   no maximum of the warp moved ([`rescale_unless_settled`]).
    ///
    /// # Safety
    /// The whole warp calls it (quad shuffles).
    #[inline(always)]
    pub unsafe fn update<const LATENCY_TUNED: bool, const H: usize>(
        &mut self,
        s: &mut [[FragC; S_TILES]; H],
        o: &mut [FragC; MAX_O_TILES],
        o_tiles: usize,
    ) -> [f32; 2] {
        let mut corrections = [1.0f32; 2];
        unroll8!(r in 0..2 => {
            let block_max = if LATENCY_TUNED {
                let mut v = [[f32::NEG_INFINITY; 2 * S_TILES]; H];
                unroll8!(h in 0..H => {
                    unroll8!(n in 0..S_TILES => {
                        v[h][2 * n] = s[h][n].regs[2 * r];
                        v[h][2 * n + 1] = s[h][n].regs[2 * r + 1];
                    });
                });
                tree(v, f32::max)
            } else {
                let mut block_max = f32::NEG_INFINITY;
                unroll8!(h in 0..H => {
                    unroll8!(n in 0..S_TILES => {
                        block_max = block_max.max(s[h][n].regs[2 * r]).max(s[h][n].regs[2 * r + 1]);
                    });
                });
                block_max
            };
            // The row maximum in base-2 units: `m = max(m, block_max · scale_log2)` (rounding is
            // monotone, so this is the rounded maximum of the scaled scores).
            // SAFETY: forwarded: the whole warp is here.
            let m_new = self.rows[r]
                .m
                .max(unsafe { quad_max_f32(block_max) } * self.scale_log2);
            // A row that has seen only masked keys keeps m = -inf: use 0 as its reference so
            // that no `-inf - -inf` appears (its p are all 0 and its correction is irrelevant).
            let m_ref = if m_new == f32::NEG_INFINITY {
                0.0
            } else {
                m_new
            };
            // Every `p` of the row is relative to the stored `m`, and the correction moves them
            // from the old stored `m` to the new one, so the exponents of all blocks share one
            // reference. With `LATENCY_TUNED` a maximum that did not move gives exactly 1 (and
            // `o` is not rescaled for nothing).
            let correction = if LATENCY_TUNED && m_new == self.rows[r].m {
                1.0
            } else {
                exp2(self.rows[r].m - m_ref)
            };
            let row_sum = if LATENCY_TUNED {
                let mut v = [[0.0f32; 2 * S_TILES]; H];
                unroll8!(h in 0..H => {
                    unroll8!(n in 0..S_TILES => {
                        unroll8!(c in 0..2 => {
                            let p = exp2(fma(s[h][n].regs[2 * r + c], self.scale_log2, -m_ref));
                            s[h][n].regs[2 * r + c] = p;
                            v[h][2 * n + c] = p;
                        });
                    });
                });
                tree(v, |a, b| a + b)
            } else {
                let mut row_sum = 0.0;
                unroll8!(h in 0..H => {
                    unroll8!(n in 0..S_TILES => {
                        unroll8!(c in 0..2 => {
                            let p = exp2(fma(s[h][n].regs[2 * r + c], self.scale_log2, -m_ref));
                            s[h][n].regs[2 * r + c] = p;
                            row_sum += p;
                        });
                    });
                });
                row_sum
            };
            self.rows[r].rescale_add(m_new, correction, row_sum);
            if LATENCY_TUNED {
                corrections[r] = correction;
            } else {
                crate::unroll16!(n in 0..o_tiles => {
                    o[n].regs[2 * r] *= correction;
                    o[n].regs[2 * r + 1] *= correction;
                });
            }
        });
        corrections
    }

    /// Both rows' states as they stand, with this lane's share of each denominator (for a
    /// merge with another part of the rows' keys; [`SoftmaxState::quad_total`] after it).
    #[inline(always)]
    pub fn lane_states(&self) -> [SoftmaxState; 2] {
        self.rows
    }

    /// Both rows' final states, the quad's denominator shares summed. Every row saw its
    /// diagonal key, so `l >= 1`.
    ///
    /// # Safety
    /// The whole warp calls it (quad shuffles).
    #[inline(always)]
    pub unsafe fn totals(&self) -> [SoftmaxState; 2] {
        // SAFETY: forwarded.
        unsafe { [self.rows[0].quad_total(), self.rows[1].quad_total()] }
    }
}

/// `op` over the `16 H` values of `H` blocks (`H` 1 or 2) as a pairwise tree (the blocks
/// combined first, then 4 dependent levels).
#[inline(always)]
fn tree<const H: usize>(v: [[f32; 2 * S_TILES]; H], op: impl Fn(f32, f32) -> f32) -> f32 {
    const { assert!(2 * S_TILES == 16 && (H == 1 || H == 2)) };
    let mut v16 = v[0];
    if H == 2 {
        crate::unroll16!(i in 0..16 => { v16[i] = op(v16[i], v[H - 1][i]); });
    }
    crate::unroll8!(i in 0..8 => { v16[i] = op(v16[i], v16[i + 8]); });
    crate::unroll8!(i in 0..4 => { v16[i] = op(v16[i], v16[i + 4]); });
    crate::unroll8!(i in 0..2 => { v16[i] = op(v16[i], v16[i + 2]); });
    op(v16[0], v16[1])
}

/// Rescales the warp's accumulators `o` (their first `o_tiles`) by the row corrections that
/// [`RowSoftmax::update`] returned with `LATENCY_TUNED`, unless every one of the warp's rows
/// kept its maximum (all corrections exactly 1: the multiplications would leave `o` bit for bit
/// unchanged, so skipping them is exact). One vote for all the warp's rows, so the softmax of
/// both row tiles stays one branch-free stretch of code.
///
/// # Safety
/// The whole warp calls it (a vote).
#[inline(always)]
pub unsafe fn rescale_unless_settled<const ROW_TILES: usize>(
    o: &mut [[FragC; MAX_O_TILES]; ROW_TILES],
    corrections: &[[f32; 2]; ROW_TILES],
    o_tiles: usize,
) {
    let mut moved = false;
    crate::unroll8!(m in 0..ROW_TILES => {
        moved |= corrections[m][0] != 1.0 || corrections[m][1] != 1.0;
    });
    // SAFETY: forwarded: the whole warp is here.
    if unsafe { ballot(moved) } != 0 {
        crate::unroll8!(m in 0..ROW_TILES => {
            crate::unroll8!(r in 0..2 => {
                crate::unroll16!(n in 0..o_tiles => {
                    o[m][n].regs[2 * r] *= corrections[m][r];
                    o[m][n].regs[2 * r + 1] *= corrections[m][r];
                });
            });
        });
    }
}
