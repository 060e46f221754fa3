//! The online-softmax state of one row (a query head in decode, a query row in prefill).
//!
//! Over some keys with scores `s_j`, the state is the running maximum `m` and the denominator
//! `l = Σ 2^(s_j - m)`; the caller keeps the matching accumulators `acc = Σ 2^(s_j - m) v_j`
//! (in the `mma` accumulators, or as partial states in memory). Two ways the state moves:
//! - **one more tile of keys** ([`SoftmaxState::rescale_add`]): with the tile, the maximum moves
//!   to `m' >= m`; the old sums are scaled by `c = 2^(m - m')` and the tile's probabilities,
//!   already relative to `m'`, added: `l' = c · l + Σ p`, `acc' = c · acc + P V`;
//! - **a merge of states over disjoint keys** ([`SoftmaxState::merge`]): for parts
//!   `(m_s, l_s, acc_s)` and `M = max m_s`, each part weighs `w_s = 2^(m_s - M)` and
//!   `l = Σ w_s l_s`, `acc = Σ w_s acc_s`. `M` comes first (the parts are all at hand: decode's
//!   warps in shared memory, the splits in global memory), so each part costs one `exp2`.
//!
//! The merge is exact up to rounding whatever the parts are, which is what lets decode split a
//! pair's keys over warps and over blocks. Merges take `m` in log2 units (scores scaled by
//! `log2(e) / sqrt(D)` first, as decode does); prefill keeps raw scores in `m` and scales inside
//! the exponent, and never merges.

use crate::math::{exp2, fma};
use crate::warp::quad_sum_f32;

/// One row's running maximum and denominator (or a lane's share of the denominator, see
/// [`quad_total`](Self::quad_total)).
#[derive(Clone, Copy)]
pub struct SoftmaxState {
    /// Running maximum score (`-inf` before the first key).
    pub m: f32,
    /// The denominator relative to `m`.
    pub l: f32,
}

impl SoftmaxState {
    /// The log-sum-exp of the final state in natural units, `ln Σ_j e^(scale · s_j)`: `m` is in
    /// base-2 units and `l` relative to `2^m`, so it is `(m + log2 l) · ln 2`.
    #[inline(always)]
    pub fn natural_lse(self) -> f32 {
        (self.m + crate::math::log2(self.l)) * core::f32::consts::LN_2
    }

    /// The state of no keys.
    pub const EMPTY: Self = Self {
        m: f32::NEG_INFINITY,
        l: 0.0,
    };

    /// Moves the state to the maximum `m_new` (not below `m`), its sum scaled by `correction`
    /// (`2^(m - m_new)`, the caller's: the kernels compute it in their own units and forms), and
    /// adds `sum`, the new keys' probabilities relative to `m_new`. The caller scales its
    /// accumulators by the same `correction`.
    #[inline(always)]
    pub fn rescale_add(&mut self, m_new: f32, correction: f32, sum: f32) {
        self.l = fma(self.l, correction, sum);
        self.m = m_new;
    }

    /// The state with the denominator shares of the 4 lanes of this lane's quad summed (a row's
    /// keys are spread over a quad, [`crate::mma`]; every lane of it holds the same `m`).
    ///
    /// # Safety
    /// The whole warp calls it (quad shuffles).
    #[inline(always)]
    pub unsafe fn quad_total(self) -> Self {
        Self {
            m: self.m,
            // SAFETY: forwarded.
            l: unsafe { quad_sum_f32(self.l) },
        }
    }

    /// The start of a merge whose largest part maximum is `m_all`: no part added yet (`l = 0`,
    /// accumulators zero).
    #[inline(always)]
    pub fn merge_at(m_all: f32) -> Self {
        Self { m: m_all, l: 0.0 }
    }

    /// The weight `2^(m - m_all)` of this state's sums in a merge whose maximum is `m_all`, and 0
    /// for a state that saw no key (avoids `-inf - -inf`).
    #[inline(always)]
    pub fn weight(&self, m_all: f32) -> f32 {
        if self.m == f32::NEG_INFINITY {
            0.0
        } else {
            exp2(self.m - m_all)
        }
    }

    /// Merges `part` (keys disjoint from those merged so far, `part.m <= self.m`; `self` from
    /// [`merge_at`](Self::merge_at)) and its accumulators `part_acc` into this merge and `acc`:
    /// `l += w · part.l`, `acc += w · part_acc`, with `w` [`part.weight(m)`](Self::weight), which
    /// it returns (for accumulators the caller merges elsewhere, with [`add_weighted`]).
    #[inline(always)]
    pub fn merge<const N: usize>(
        &mut self,
        part: Self,
        acc: &mut [f32; N],
        part_acc: &[f32; N],
    ) -> f32 {
        let w = part.weight(self.m);
        add_weighted(acc, w, part_acc);
        self.l = fma(w, part.l, self.l);
        w
    }
}

/// `acc += w · part`, element by element (the accumulators' side of
/// [`SoftmaxState::merge`]).
#[inline(always)]
pub fn add_weighted<const N: usize>(acc: &mut [f32; N], w: f32, part: &[f32; N]) {
    let mut i = 0;
    while i < N {
        acc[i] = fma(w, part[i], acc[i]);
        i += 1;
    }
}
