//! Merges the decode splits' partial softmax states into the output.
//!
//! Grid `batch * q_heads`, `COMBINE_THREADS` threads; thread `d` (strided) owns output dimension
//! `d`. For split states `(m_s, l_s, acc_s)` (log2 units): `M = max m_s`,
//! `out = Σ 2^(m_s - M) acc_s / Σ 2^(m_s - M) l_s`.

use lserve_abi::decode::{CombineParams, COMBINE_THREADS};

use crate::convert::{Bf16, Half16, F16};
use crate::math::exp2;
use crate::thread::{block_idx_x, thread_in_block};

/// The combine body for element type `E`.
///
/// # Safety
/// Grid `p.batch * p.q_heads`, `COMBINE_THREADS` threads; `part_acc` / `part_ml` as the decode
/// kernel wrote them for the same batch, `out` is `[batch][q_heads][head_dim]`.
#[inline(always)]
unsafe fn combine<E: Half16>(
    p: &CombineParams,
    part_acc: *const f32,
    part_ml: *const f32,
    out: *mut u16,
) {
    let row = block_idx_x(); // b * q_heads + q_head
    let (b, q_head) = (row / p.q_heads, row % p.q_heads);
    let kv_heads = p.q_heads / p.group;
    let pair = b * kv_heads + q_head / p.group;
    let g = q_head % p.group;
    // Partial state index of split `s`.
    let state = |s: u32| ((pair * p.splits + s) * p.group + g) as usize;

    let mut m_max = f32::NEG_INFINITY;
    let mut s = 0;
    while s < p.splits {
        // SAFETY: `state(s)` indexes `[pairs][splits][group]` within the batch.
        m_max = m_max.max(unsafe { *part_ml.add(state(s) * 2) });
        s += 1;
    }
    let mut d = thread_in_block();
    while d < p.head_dim {
        let mut num = 0.0f32;
        let mut den = 0.0f32;
        let mut s = 0;
        while s < p.splits {
            // SAFETY: as above; `d < head_dim`.
            let (m, l, a) = unsafe {
                let i = state(s);
                (
                    *part_ml.add(i * 2),
                    *part_ml.add(i * 2 + 1),
                    *part_acc.add(i * p.head_dim as usize + d as usize),
                )
            };
            if m != f32::NEG_INFINITY {
                let w = exp2(m - m_max);
                num += w * a;
                den += w * l;
            }
            s += 1;
        }
        // SAFETY: `out` is `[batch][q_heads][head_dim]`.
        unsafe {
            *out.add(row as usize * p.head_dim as usize + d as usize) = E::from_f32(num / den)
        };
        d += COMBINE_THREADS;
    }
}

/// Combine entry point for bf16 outputs.
///
/// # Safety
/// As `combine`.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn decode_combine_bf16(
    p: CombineParams,
    part_acc: *const f32,
    part_ml: *const f32,
    out: *mut u16,
) {
    // SAFETY: forwarded launch contract.
    unsafe { combine::<Bf16>(&p, part_acc, part_ml, out) }
}

/// Combine entry point for f16 outputs.
///
/// # Safety
/// As `combine`.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn decode_combine_f16(
    p: CombineParams,
    part_acc: *const f32,
    part_ml: *const f32,
    out: *mut u16,
) {
    // SAFETY: forwarded launch contract.
    unsafe { combine::<F16>(&p, part_acc, part_ml, out) }
}
