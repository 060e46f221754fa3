//! Deterministic pseudo-random fill (benchmark setup: a 256K-token cache without an upload).
//!
//! Grid `ceil(len / (KV_WRITE_THREADS * 8))`; thread `i` writes elements `8 i .. 8 i + 8`, each
//! [`random_value`]`(seed, index)` rounded to `E` (to nearest even), one 16-byte store where the
//! whole chunk is in range.

use lserve_abi::kv_write::{random_value, FillArgs, CHUNK_ELEMS, KV_WRITE_THREADS};

use super::target::store;
use crate::convert::Half16;
use crate::math::Vec16;
use crate::thread::{block_idx_x, thread_idx_x};

/// The fill body for element type `E`.
///
/// # Safety
/// Launched with the grid above and `KV_WRITE_THREADS` threads; `out` holds `p.len` elements and
/// is 16-byte aligned.
#[inline(always)]
pub unsafe fn fill_random<E: Half16>(a: &FillArgs) {
    let (p, out) = (&a.params, a.out.get());
    let i = block_idx_x() as u64 * KV_WRITE_THREADS as u64 + thread_idx_x() as u64;
    let first = i * CHUNK_ELEMS as u64;
    if first >= p.len {
        return;
    }
    if first + CHUNK_ELEMS as u64 <= p.len {
        let mut x = [0.0f32; 8];
        let mut j = 0;
        while j < 8 {
            x[j] = random_value(p.seed, first + j as u64);
            j += 1;
        }
        // SAFETY: the 8 elements are in range; `first` is a multiple of 8 of an aligned buffer.
        unsafe { store(out.add(first as usize), Vec16::from_f32::<E>(&x)) };
    } else {
        let mut index = first;
        while index < p.len {
            // SAFETY: element `index < len`.
            unsafe { *out.add(index as usize) = E::from_f32(random_value(p.seed, index)) };
            index += 1;
        }
    }
}
