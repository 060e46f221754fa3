//! Online softmax state in base 2, one per (row group, query head of the KV group).
//!
//! A state summarises the rows it has seen: `m` the largest score (in log2 units, the softmax
//! scale folded in), `l = Σ 2^(s - m)` and `acc = Σ 2^(s - m) · v` over this thread's eight
//! output dimensions. States merge associatively, which is what makes both the row-group split
//! inside a block and the flash-decoding split across blocks exact.

use crate::math::exp2;

/// One row group's softmax state for one query head, over this thread's 8 dimensions.
#[derive(Clone, Copy)]
pub struct SoftmaxState {
    /// Running maximum score (`-inf` before the first row).
    pub m: f32,
    /// Running denominator relative to `m`.
    pub l: f32,
    /// Running numerator relative to `m`, this thread's 8 dimensions.
    pub acc: [f32; 8],
}

/// `2^(m_old - m_new)`, with `0` for a state that saw no row yet (avoids `-inf - -inf`).
#[inline(always)]
fn rescale(m_old: f32, m_new: f32) -> f32 {
    if m_old == f32::NEG_INFINITY {
        0.0
    } else {
        exp2(m_old - m_new)
    }
}

impl SoftmaxState {
    /// The state of no rows.
    pub const EMPTY: Self = Self {
        m: f32::NEG_INFINITY,
        l: 0.0,
        acc: [0.0; 8],
    };

    /// Raises the running maximum to at least `m` (log2 units), rescaling `l` and `acc`: the
    /// first half of adding rows whose largest score is `m`.
    #[inline(always)]
    pub fn raise_max(&mut self, m: f32) {
        let m_new = self.m.max(m);
        if m_new == self.m {
            return;
        }
        let corr = rescale(self.m, m_new);
        self.l *= corr;
        let mut i = 0;
        while i < 8 {
            self.acc[i] *= corr;
            i += 1;
        }
        self.m = m_new;
    }

    /// Adds a row with score `s` (log2 units, at most the running maximum: call
    /// [`raise_max`](Self::raise_max) first) and value slice `v`.
    #[inline(always)]
    pub fn add(&mut self, s: f32, v: &[f32; 8]) {
        let p = exp2(s - self.m);
        self.l += p;
        let mut i = 0;
        while i < 8 {
            self.acc[i] += p * v[i];
            i += 1;
        }
    }

    /// Merges another state (over disjoint rows) into this one.
    #[inline(always)]
    pub fn merge(&mut self, other: &Self) {
        let m_new = self.m.max(other.m);
        if m_new == f32::NEG_INFINITY {
            return;
        }
        let a = rescale(self.m, m_new);
        let b = rescale(other.m, m_new);
        self.l = self.l * a + other.l * b;
        let mut i = 0;
        while i < 8 {
            self.acc[i] = self.acc[i] * a + other.acc[i] * b;
            i += 1;
        }
        self.m = m_new;
    }
}
