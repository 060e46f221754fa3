//! Merges the decode splits' partial softmax states into the output.
//!
//! Grid `batch * q_heads`, `COMBINE_THREADS` threads. For split states `(m_s, l_s, acc_s)` (log2
//! units): `M = max m_s`, `w_s = 2^(m_s - M)`, `out = Σ w_s acc_s / Σ w_s l_s`, the merge of
//! [`SoftmaxState::merge`] spread over the block: the denominator's side (`w_s`, `Σ w_s l_s`) by
//! the threads that own split `s`, the accumulators' ([`add_weighted`]) by slices. The splits are
//! spread over the threads for `M` and the weights (block reductions), so no thread walks them
//! one dependent load at a time. For the sums the block is cut into *slices* of `D / 4` threads,
//! each thread owning 4 consecutive dimensions (one 16-byte load per split): slice `k` sums splits
//! `k, k + slices, ...`, and the slices meet in shared memory. A thread loads its first 16 splits'
//! accumulators before anything else, so that their round trip overlaps the loads and reductions
//! of `M` and the weights (at D 128 that is every split up to 64); further splits follow with
//! eight loads in flight. With a log-sum-exp buffer, thread 0 also writes the row's
//! `(M + log2 Σ w_s l_s) · ln 2`, the natural log-sum-exp of its scaled scores.

use lserve_abi::decode::{CombineArgs, CombineParams, COMBINE_THREADS, MAX_SPLITS};

use crate::convert::{Bf16, Half16, F16};
use crate::math::Vec16;
use crate::smem::dynamic_smem;
use crate::sync::sync_threads;
use crate::thread::{block_idx_x, lane, thread_in_block, warp_in_block, WARP_SIZE};
use crate::tile::softmax::add_weighted;
use crate::tile::SoftmaxState;
use crate::warp::{warp_max_f32, warp_sum_f32};

const WARPS: u32 = COMBINE_THREADS / WARP_SIZE;
/// Split states each thread loads at once when summing.
const IN_FLIGHT: u32 = 8;
/// Split states each thread loads first thing, before the weights (64 splits at D 128).
const EARLY: usize = 16;

/// Reduces `x` over the block with `warp_op` inside warps and `op` across them, through
/// `scratch` (`WARPS` words of shared memory); every thread gets the result.
///
/// # Safety
/// Every thread of the block calls it (it has barriers); `scratch` points to `WARPS` shared words
/// no one else uses meanwhile.
#[inline(always)]
unsafe fn block_reduce(
    x: f32,
    scratch: *mut f32,
    warp_op: unsafe fn(f32) -> f32,
    op: fn(f32, f32) -> f32,
) -> f32 {
    // SAFETY: the caller guarantees block-uniform control flow and the scratch words.
    unsafe {
        let x = warp_op(x);
        if lane() == 0 {
            *scratch.add(warp_in_block() as usize) = x;
        }
        sync_threads();
        let mut total = *scratch;
        let mut w = 1;
        while w < WARPS as usize {
            total = op(total, *scratch.add(w));
            w += 1;
        }
        sync_threads(); // the scratch may be reused right after
        total
    }
}

/// The combine body for element type `E`.
///
/// # Safety
/// Grid `p.batch * p.q_heads`, `COMBINE_THREADS` threads, `combine_smem_bytes()` of dynamic
/// shared memory, `p.splits <= MAX_SPLITS`; `part_acc` / `part_ml` as the decode kernel wrote
/// them for the same batch, `out` is `[batch][q_heads][head_dim]`, `lse` null or
/// `[batch][q_heads]`.
#[inline(always)]
unsafe fn combine<E: Half16>(
    p: &CombineParams,
    part_acc: *const f32,
    part_ml: *const f32,
    out: *mut u16,
    lse: *mut f32,
) {
    let row = block_idx_x(); // b * q_heads + q_head
    let (b, q_head) = (row / p.q_heads, row % p.q_heads);
    let kv_heads = p.q_heads / p.group;
    let pair = b * kv_heads + q_head / p.group;
    let g = q_head % p.group;
    // Partial state index of split `s`.
    let state = |s: u32| ((pair * p.splits + s) * p.group + g) as usize;
    let weights = dynamic_smem::<f32>(0);
    let scratch = dynamic_smem::<f32>(MAX_SPLITS as usize * 4);
    let tid = thread_in_block();

    // This thread's share of the sums: slices of `D / 4` threads, 4 dimensions each.
    let lanes = p.head_dim / 4;
    let slices = COMBINE_THREADS / lanes;
    let (slice, dims) = (tid / lanes, 4 * (tid % lanes) as usize);
    let d_stride = p.head_dim as usize;
    // Split `s`'s 4 accumulators of this thread.
    let acc = |s: u32| -> [f32; 4] {
        // SAFETY: `s < splits`, `dims + 4 <= head_dim`; the row start is 16-byte aligned (the
        // buffer is, and `head_dim` is a multiple of 4).
        unsafe { (*(part_acc.add(state(s) * d_stride + dims) as *const Vec16)).0 }
            .map(f32::from_bits)
    };
    // The first EARLY of the thread's splits are loaded now, before the weights are known, so
    // that their round trip overlaps the loads and reductions of `M` and the weights below.
    let mut early = [[0.0f32; 4]; EARLY];
    crate::unroll16!(k in 0..EARLY => {
        let s = slice + k as u32 * slices;
        if s < p.splits {
            early[k] = acc(s);
        }
    });

    // M, the largest split maximum.
    let mut m_max = f32::NEG_INFINITY;
    let mut s = tid;
    while s < p.splits {
        // SAFETY: `state(s)` indexes `[pairs][splits][group]` within the batch.
        m_max = m_max.max(unsafe { *part_ml.add(state(s) * 2) });
        s += COMBINE_THREADS;
    }
    // SAFETY: every thread reaches the reductions; `scratch` follows the weights.
    let m_max = unsafe { block_reduce(m_max, scratch, warp_max_f32, f32::max) };

    // The weights, and this thread's splits' part of the denominator.
    let mut merged = SoftmaxState::merge_at(m_max);
    let mut s = tid;
    while s < p.splits {
        // SAFETY: as above; `s < splits <= MAX_SPLITS` weights fit.
        unsafe {
            let (m, l) = (*part_ml.add(state(s) * 2), *part_ml.add(state(s) * 2 + 1));
            // The accumulators merge below, by slices, with the weight.
            let w = merged.merge(SoftmaxState { m, l }, &mut [], &[]);
            *weights.add(s as usize) = w;
        }
        s += COMBINE_THREADS;
    }
    // SAFETY: as above; its barriers also publish the weights.
    let den = unsafe { block_reduce(merged.l, scratch, warp_sum_f32, |a, b| a + b) };
    if tid == 0 && !lse.is_null() {
        let total = SoftmaxState { m: m_max, l: den };
        // SAFETY: `lse` holds `[batch][q_heads]` f32 when not null; `row < batch * q_heads`.
        unsafe { lse.add(row as usize).write(total.natural_lse()) };
    }

    // The sums, per slice: the early splits, then the rest with IN_FLIGHT loads at a time.
    // SAFETY (weights): written before the last barrier of `block_reduce`, `s < splits`.
    let weight = |s: u32| unsafe { *weights.add(s as usize) };
    let load = |s: u32| -> ([f32; 4], f32) { (acc(s), weight(s)) };
    let mut num = [0.0f32; 4];
    crate::unroll16!(k in 0..EARLY => {
        let s = slice + k as u32 * slices;
        if s < p.splits {
            add_weighted(&mut num, weight(s), &early[k]);
        }
    });
    let mut s = slice + EARLY as u32 * slices;
    while s + (IN_FLIGHT - 1) * slices < p.splits {
        let mut parts = [([0.0f32; 4], 0.0f32); IN_FLIGHT as usize];
        let mut k = 0;
        while k < IN_FLIGHT as usize {
            parts[k] = load(s + k as u32 * slices);
            k += 1;
        }
        let mut k = 0;
        while k < IN_FLIGHT as usize {
            let (v, w) = parts[k];
            add_weighted(&mut num, w, &v);
            k += 1;
        }
        s += IN_FLIGHT * slices;
    }
    while s < p.splits {
        let (v, w) = load(s);
        add_weighted(&mut num, w, &v);
        s += slices;
    }
    // The slices meet: slice `k`'s sums at `sums[k][dims..]`, then thread `d` adds its column.
    let sums = dynamic_smem::<f32>((MAX_SPLITS + WARPS) as usize * 4);
    // SAFETY: `slice * head_dim + dims + 4 <= COMBINE_THREADS * 4` floats, the area after the
    // scratch words (`combine_smem_bytes`).
    unsafe { *(sums.add(slice as usize * d_stride + dims) as *mut [f32; 4]) = num };
    // SAFETY: every thread reaches it.
    unsafe { sync_threads() };
    let d = tid as usize;
    if d < d_stride {
        let mut total = 0.0f32;
        let mut k = 0;
        while k < slices as usize {
            // SAFETY: written above by slice `k`, before the barrier.
            total += unsafe { *sums.add(k * d_stride + d) };
            k += 1;
        }
        // SAFETY: `out` holds `batch` rows of `q_heads x head_dim` elements, `strides.out` heads
        // apart.
        let at = (b * p.strides.out + q_head) as usize * d_stride + d;
        unsafe { *out.add(at) = E::from_f32(total / den) };
    }
}

/// Combine entry point for bf16 outputs.
///
/// # Safety
/// As `combine`.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn decode_combine_bf16(a: CombineArgs) {
    // SAFETY: first thing in the kernel; the host launches it overlapped.
    unsafe { crate::sync::overlapped_entry() };
    // SAFETY: forwarded launch contract.
    unsafe {
        combine::<Bf16>(
            &a.params,
            a.part_acc.get(),
            a.part_ml.get(),
            a.out.get(),
            a.lse.get(),
        )
    }
}

/// Combine entry point for f16 outputs.
///
/// # Safety
/// As `combine`.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn decode_combine_f16(a: CombineArgs) {
    // SAFETY: first thing in the kernel; the host launches it overlapped.
    unsafe { crate::sync::overlapped_entry() };
    // SAFETY: forwarded launch contract.
    unsafe {
        combine::<F16>(
            &a.params,
            a.part_acc.get(),
            a.part_ml.get(),
            a.out.get(),
            a.lse.get(),
        )
    }
}
