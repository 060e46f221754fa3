//! Warp shuffles and warp-wide reductions (`shfl.sync`, full-warp member mask).
//!
//! All functions here must be called by all 32 lanes of the warp together (convergent, no lane
//! exited): that is their safety invariant, so they are `unsafe`. The exceptions are the `group_*`
//! exchanges with a member mask ([`group_members`]), which only the lanes of one aligned group
//! execute together.

use core::arch::asm;

/// Returns the value of `x` held by lane `lane ^ lane_mask` (butterfly exchange).
///
/// # Safety
/// All 32 lanes execute this call with the same `lane_mask` (< 32).
#[inline(always)]
pub unsafe fn shfl_xor_u32(x: u32, lane_mask: u32) -> u32 {
    let y: u32;
    // SAFETY: caller guarantees the whole warp participates; c = 0x1f: no segmenting.
    unsafe {
        asm!("shfl.sync.bfly.b32 {0}, {1}, {2}, 0x1f, -1;",
             out(reg32) y, in(reg32) x, in(reg32) lane_mask, options(nomem, nostack));
    }
    y
}

/// Returns the value of `x` held by lane `src_lane` (broadcast / gather).
///
/// # Safety
/// All 32 lanes execute this call; `src_lane < 32` (it may differ per lane).
#[inline(always)]
pub unsafe fn shfl_idx_u32(x: u32, src_lane: u32) -> u32 {
    let y: u32;
    // SAFETY: caller guarantees the whole warp participates.
    unsafe {
        asm!("shfl.sync.idx.b32 {0}, {1}, {2}, 0x1f, -1;",
             out(reg32) y, in(reg32) x, in(reg32) src_lane, options(nomem, nostack));
    }
    y
}

/// The member mask of this lane's group of `lanes` lanes (a power of two up to 32; groups are
/// aligned: lanes `g * lanes ..`).
#[inline(always)]
pub fn group_members(lanes: u32) -> u32 {
    if lanes >= 32 {
        return u32::MAX;
    }
    let base = (crate::thread::thread_idx_x() % 32) & !(lanes - 1);
    ((1u32 << lanes) - 1) << base
}

/// [`shfl_xor_u32`] among the lanes of `members` only ([`group_members`]): the lanes of the
/// warp outside it may have exited or branched away.
///
/// # Safety
/// Every lane of `members` executes this call with the same `members` and `lane_mask`, and
/// `lane ^ lane_mask` is in `members` for each of them.
#[inline(always)]
pub unsafe fn group_shfl_xor_u32(x: u32, lane_mask: u32, members: u32) -> u32 {
    let y: u32;
    // SAFETY: caller guarantees every member lane participates and the partner is a member.
    unsafe {
        asm!("shfl.sync.bfly.b32 {0}, {1}, {2}, 0x1f, {3};",
             out(reg32) y, in(reg32) x, in(reg32) lane_mask, in(reg32) members,
             options(nomem, nostack));
    }
    y
}

/// [`shfl_xor_u32`] for `f32`.
///
/// # Safety
/// As [`shfl_xor_u32`].
#[inline(always)]
pub unsafe fn shfl_xor_f32(x: f32, lane_mask: u32) -> f32 {
    // SAFETY: forwarded invariant.
    f32::from_bits(unsafe { shfl_xor_u32(x.to_bits(), lane_mask) })
}

/// [`shfl_idx_u32`] for `f32`.
///
/// # Safety
/// As [`shfl_idx_u32`].
#[inline(always)]
pub unsafe fn shfl_idx_f32(x: f32, src_lane: u32) -> f32 {
    // SAFETY: forwarded invariant.
    f32::from_bits(unsafe { shfl_idx_u32(x.to_bits(), src_lane) })
}

/// Sum of `x` over the warp, returned to every lane (butterfly: all lanes get the same bits).
///
/// # Safety
/// All 32 lanes call it.
#[inline(always)]
pub unsafe fn warp_sum_f32(mut x: f32) -> f32 {
    let mut mask = 16;
    while mask > 0 {
        // SAFETY: forwarded invariant.
        x += unsafe { shfl_xor_f32(x, mask) };
        mask >>= 1;
    }
    x
}

/// Maximum of `x` over the warp, returned to every lane.
///
/// # Safety
/// All 32 lanes call it.
#[inline(always)]
pub unsafe fn warp_max_f32(mut x: f32) -> f32 {
    let mut mask = 16;
    while mask > 0 {
        // SAFETY: forwarded invariant.
        x = x.max(unsafe { shfl_xor_f32(x, mask) });
        mask >>= 1;
    }
    x
}

/// Sum of `x` over each aligned group of 4 lanes (a quad: the lanes that hold one row of an
/// `mma` accumulator), returned to every lane of the quad.
///
/// # Safety
/// All 32 lanes call it.
#[inline(always)]
pub unsafe fn quad_sum_f32(mut x: f32) -> f32 {
    // SAFETY: forwarded invariant.
    unsafe {
        x += shfl_xor_f32(x, 2);
        x += shfl_xor_f32(x, 1);
    }
    x
}

/// Maximum of `x` over each aligned group of 4 lanes, returned to every lane of the quad.
///
/// # Safety
/// All 32 lanes call it.
#[inline(always)]
pub unsafe fn quad_max_f32(mut x: f32) -> f32 {
    // SAFETY: forwarded invariant.
    unsafe {
        x = x.max(shfl_xor_f32(x, 2));
        x = x.max(shfl_xor_f32(x, 1));
    }
    x
}

/// Sum of `x` over each aligned group of `lanes` consecutive lanes (a power of two, at most 32;
/// a compile-time constant after inlining, so the loop unrolls), returned to every lane of the
/// group: the reduction of a row that `lanes` lanes read together.
///
/// # Safety
/// All 32 lanes call it with the same `lanes`.
#[inline(always)]
pub unsafe fn group_sum_f32(mut x: f32, lanes: u32) -> f32 {
    let mut offset = 1;
    while offset < lanes {
        // SAFETY: forwarded: the whole warp participates.
        x += unsafe { shfl_xor_f32(x, offset) };
        offset <<= 1;
    }
    x
}

/// The lanes whose `pred` is true, one bit per lane (`vote.sync.ballot.b32`, full member mask).
///
/// # Safety
/// All 32 lanes call it.
#[inline(always)]
pub unsafe fn ballot(pred: bool) -> u32 {
    let mask: u32;
    // SAFETY: caller guarantees the whole warp participates; no memory is touched.
    unsafe {
        asm!("{{ .reg .pred p; setp.ne.u32 p, {1}, 0; vote.sync.ballot.b32 {0}, p, -1; }}",
             out(reg32) mask, in(reg32) pred as u32, options(nomem, nostack));
    }
    mask
}
