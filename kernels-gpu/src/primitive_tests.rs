//! Test kernels: each exercises one device primitive on device data, so that the host tests
//! (`tests/gpu_primitives.rs`) can compare with a CPU computation. Not used by the library.
//!
//! Launch shapes are part of each kernel's contract (stated per kernel); the host wrappers in
//! `lserve::gpu::primitives_testing` follow them.

use lserve_abi::primitives::{
    ThreadRecord, CP_ASYNC_STAGES, CP_ASYNC_TILE_BYTES, MMA_K, MMA_M, MMA_N, PRIMITIVE_BLOCK,
};

use crate::convert::{Bf16, Half16, F16};
use crate::cp_async::{commit_group, cp_async_16, wait_group};
use crate::ldmatrix::{
    ldmatrix_x2, ldmatrix_x2_trans, ldmatrix_x4, ldmatrix_x4_trans, load_a_row_major,
    load_b_k_major, load_b_n_major, x4_quadrant_row_addr,
};
use crate::mma::{mma_m16n8k16, FragA, FragB, FragC, MmaElement};
use crate::smem::{dynamic_smem, shared_addr};
use crate::sync::sync_threads;
use crate::thread::*;
use crate::warp::*;

/// Every thread writes its [`ThreadRecord`] at its linear global index
/// (`block_in_grid * threads_per_block + thread_in_block`). Any 2D grid and block.
///
/// # Safety
/// `out` holds one record per thread of the grid.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_thread_indices(out: *mut ThreadRecord) {
    let record = ThreadRecord {
        thread_x: thread_idx_x(),
        thread_y: thread_idx_y(),
        block_x: block_idx_x(),
        block_y: block_idx_y(),
        block_dim_x: block_dim_x(),
        block_dim_y: block_dim_y(),
        grid_dim_x: grid_dim_x(),
        grid_dim_y: grid_dim_y(),
        thread_in_block: thread_in_block(),
        warp: warp_in_block(),
        lane: lane(),
    };
    let index = block_in_grid() * threads_per_block() + thread_in_block();
    // SAFETY: one record per thread, by the caller's guarantee.
    unsafe { out.add(index as usize).write(record) };
}

/// Reverses each block's slice of `x` through dynamic shared memory:
/// `y[b * B + t] = x[b * B + (B - 1 - t)]`, `B = blockDim.x`. The shared array starts at byte
/// `smem_offset` (a multiple of 4) of the dynamic shared memory.
///
/// # Safety
/// 1D launch; `x`, `y` hold `gridDim.x * blockDim.x` `f32`; dynamic shared memory is at least
/// `smem_offset + 4 * blockDim.x` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_smem_reverse_f32(
    smem_offset: u32,
    x: *const f32,
    y: *mut f32,
) {
    let (t, n) = (thread_idx_x(), block_dim_x());
    let base = (block_idx_x() * n) as usize;
    let smem = dynamic_smem::<f32>(smem_offset as usize);
    // SAFETY: t < n, inside x and inside the shared array sized at launch.
    unsafe { smem.add(t as usize).write(x.add(base + t as usize).read()) };
    // SAFETY: every thread of the block reaches this barrier.
    unsafe { sync_threads() };
    // SAFETY: n - 1 - t < n; written by thread n - 1 - t before the barrier.
    unsafe {
        y.add(base + t as usize)
            .write(smem.add((n - 1 - t) as usize).read())
    };
}

/// Per thread `i` (1D): `xor_out[i] = x[lane ^ xor_mask]` and `idx_out[i] = x[(lane + rotate) %
/// 32]` (lanes of the same warp).
///
/// # Safety
/// 1D launch, `blockDim.x` a multiple of 32; all three arrays hold one `f32` per thread;
/// `xor_mask < 32`.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_warp_shuffle(
    x: *const f32,
    xor_out: *mut f32,
    idx_out: *mut f32,
    xor_mask: u32,
    rotate: u32,
) {
    let i = (block_idx_x() * block_dim_x() + thread_idx_x()) as usize;
    // SAFETY: one element per thread.
    let v = unsafe { x.add(i).read() };
    // SAFETY: full warps (blockDim.x % 32 == 0), no lane has exited; lane indices < 32.
    let (by_xor, by_idx) = unsafe {
        (
            shfl_xor_f32(v, xor_mask),
            shfl_idx_f32(v, (lane() + rotate) % WARP_SIZE),
        )
    };
    // SAFETY: one element per thread.
    unsafe {
        xor_out.add(i).write(by_xor);
        idx_out.add(i).write(by_idx);
    }
}

/// Per thread `i` (1D): warp sum / max and quad (4-lane group) sum / max of `x`, written by every
/// lane: `out[4 * i + {0, 1, 2, 3}] = (warp_sum, warp_max, quad_sum, quad_max)`.
///
/// # Safety
/// 1D launch, `blockDim.x` a multiple of 32; `x` holds one `f32` per thread, `out` four.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_warp_reduce(x: *const f32, out: *mut f32) {
    let i = (block_idx_x() * block_dim_x() + thread_idx_x()) as usize;
    // SAFETY: one element per thread.
    let v = unsafe { x.add(i).read() };
    // SAFETY: full, converged warps.
    let r = unsafe {
        [
            warp_sum_f32(v),
            warp_max_f32(v),
            quad_sum_f32(v),
            quad_max_f32(v),
        ]
    };
    // SAFETY: four elements per thread.
    unsafe { out.add(4 * i).cast::<[f32; 4]>().write(r) };
}

/// Conversions of element type `E`, thread `i < n`:
/// `rounded[i] = E(x[i])` (nearest-even bits), `widened[i] = f32(bits[i])`, and for even `i`
/// `packed[i / 2] = pack2(x[i], x[i + 1])`.
///
/// # Safety
/// `x`, `rounded`, `bits`, `widened` hold `n` elements, `packed` `n / 2`; `n` even.
#[inline(always)]
unsafe fn convert<E: Half16>(
    n: u32,
    x: *const f32,
    rounded: *mut u16,
    packed: *mut u32,
    bits: *const u16,
    widened: *mut f32,
) {
    let i = block_idx_x() * block_dim_x() + thread_idx_x();
    if i >= n {
        return;
    }
    let i = i as usize;
    // SAFETY: i < n, and i + 1 < n when i is even (n even); the caller sized the buffers.
    unsafe {
        let v = x.add(i).read();
        rounded.add(i).write(E::from_f32(v));
        widened.add(i).write(E::to_f32(bits.add(i).read()));
        if i % 2 == 0 {
            packed.add(i / 2).write(E::pack2(v, x.add(i + 1).read()));
        }
    }
}

/// [`convert`] for bf16.
///
/// # Safety
/// As [`convert`].
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_convert_bf16(
    n: u32,
    x: *const f32,
    rounded: *mut u16,
    packed: *mut u32,
    bits: *const u16,
    widened: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { convert::<Bf16>(n, x, rounded, packed, bits, widened) }
}

/// [`convert`] for f16.
///
/// # Safety
/// As [`convert`].
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_convert_f16(
    n: u32,
    x: *const f32,
    rounded: *mut u16,
    packed: *mut u32,
    bits: *const u16,
    widened: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { convert::<F16>(n, x, rounded, packed, bits, widened) }
}

/// One product per block (one warp): `d[p] = a[p] * b[p] + c[p]` with `a[p]` 16x16 row-major,
/// `b[p]` 16x8 k-major (`b[k][n]`), `c[p]`, `d[p]` 16x8 f32 row-major; fragments loaded with
/// plain loads in the documented layout.
///
/// # Safety
/// `blockDim = (32, 1, 1)`; the arrays hold `gridDim.x` problems.
#[inline(always)]
unsafe fn mma_global<E: MmaElement>(a: *const u16, b: *const u16, c: *const f32, d: *mut f32) {
    let p = block_idx_x() as usize;
    let l = lane();
    // SAFETY: problem p is inside the arrays; the whole warp runs the mma.
    unsafe {
        let fa = FragA::<E>::load_row_major(a.add(p * MMA_M * MMA_K), MMA_K, l);
        let fb = FragB::<E>::load_k_major(b.add(p * MMA_K * MMA_N), MMA_N, l);
        let fc = FragC::load_row_major(c.add(p * MMA_M * MMA_N), MMA_N, l);
        mma_m16n8k16(&fa, &fb, &fc).store_row_major(d.add(p * MMA_M * MMA_N), MMA_N, l);
    }
}

/// [`mma_global`] for bf16.
///
/// # Safety
/// As [`mma_global`].
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_mma_bf16(
    a: *const u16,
    b: *const u16,
    c: *const f32,
    d: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { mma_global::<Bf16>(a, b, c, d) }
}

/// [`mma_global`] for f16.
///
/// # Safety
/// As [`mma_global`].
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_mma_f16(
    a: *const u16,
    b: *const u16,
    c: *const f32,
    d: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { mma_global::<F16>(a, b, c, d) }
}

/// The full tile path of later kernels, one warp: `cp.async` A (16x16 row-major), `B` k-major
/// (16x8, `b_kn[k][n]`) and the same `B` n-major (8x16, `b_nk[n][k]`) into shared memory, then
/// `ldmatrix` fragments (`.x4` for A, `.x2.trans` for k-major B, `.x2` for n-major B) and
/// `d_kn = A * B`, `d_nk = A * B` (16x8 f32 row-major, C = 0).
///
/// # Safety
/// `blockDim = (32, 1, 1)`, one block; dynamic shared memory at least
/// [`lserve_abi::primitives::MMA_SMEM_BYTES`]; inputs 16-byte aligned.
#[inline(always)]
unsafe fn mma_smem<E: MmaElement>(
    a: *const u16,
    b_kn: *const u16,
    b_nk: *const u16,
    d_kn: *mut f32,
    d_nk: *mut f32,
) {
    const A_BYTES: usize = MMA_M * MMA_K * 2;
    const B_BYTES: usize = MMA_K * MMA_N * 2;
    let l = lane();
    let s_a = dynamic_smem::<u8>(0);
    let s_kn = dynamic_smem::<u8>(A_BYTES);
    let s_nk = dynamic_smem::<u8>(A_BYTES + B_BYTES);
    // SAFETY: A is 32 chunks of 16 bytes (one per lane), each B 16 chunks (lanes 0..16 copy
    // b_kn, lanes 16..32 b_nk); all inside the inputs and the shared memory sized at launch.
    unsafe {
        let chunk = 16 * l as usize;
        cp_async_16(shared_addr(s_a.add(chunk)), a.cast::<u8>().add(chunk));
        let (dst, src) = if l < 16 { (s_kn, b_kn) } else { (s_nk, b_nk) };
        let chunk = 16 * (l % 16) as usize;
        cp_async_16(shared_addr(dst.add(chunk)), src.cast::<u8>().add(chunk));
    }
    commit_group();
    wait_group::<0>();
    // SAFETY: the whole (one-warp) block reaches it; publishes every lane's copies.
    unsafe { sync_threads() };
    // SAFETY: tiles are in shared memory, 16-byte aligned rows; converged warp.
    unsafe {
        let fa = load_a_row_major::<E>(shared_addr(s_a), (MMA_K * 2) as u32, l);
        let fb_kn = load_b_k_major::<E>(shared_addr(s_kn), (MMA_N * 2) as u32, l);
        let fb_nk = load_b_n_major::<E>(shared_addr(s_nk), (MMA_K * 2) as u32, l);
        let zero = FragC::default();
        mma_m16n8k16(&fa, &fb_kn, &zero).store_row_major(d_kn, MMA_N, l);
        mma_m16n8k16(&fa, &fb_nk, &zero).store_row_major(d_nk, MMA_N, l);
    }
}

/// [`mma_smem`] for bf16.
///
/// # Safety
/// As [`mma_smem`].
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_mma_smem_bf16(
    a: *const u16,
    b_kn: *const u16,
    b_nk: *const u16,
    d_kn: *mut f32,
    d_nk: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { mma_smem::<Bf16>(a, b_kn, b_nk, d_kn, d_nk) }
}

/// [`mma_smem`] for f16.
///
/// # Safety
/// As [`mma_smem`].
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_mma_smem_f16(
    a: *const u16,
    b_kn: *const u16,
    b_nk: *const u16,
    d_kn: *mut f32,
    d_nk: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { mma_smem::<F16>(a, b_kn, b_nk, d_kn, d_nk) }
}

/// Raw `ldmatrix` results for a 16x16 tile of 16-bit values `src` (row-major, 16 per row),
/// staged in shared memory with a row stride of `ld` elements (a multiple of 8, at least 16).
/// Lane `l` addresses row `l % 16`, column `8 * (l / 16)` (quadrants (0,0), (8,0), (0,8),
/// (8,8)) and writes `x4[4 l + j]`, `x4_trans[4 l + j]` (register `j` of `.x4` / `.x4.trans`),
/// `x2[2 l + j]`, `x2_trans[2 l + j]` (`.x2` / `.x2.trans`: matrices (0,0), (8,0)).
///
/// # Safety
/// `blockDim = (32, 1, 1)`, one block; dynamic shared memory at least `32 * ld` bytes; `src` 256
/// elements, `x4`, `x4_trans` 128, `x2`, `x2_trans` 64.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_ldmatrix(
    src: *const u16,
    ld: u32,
    x4: *mut u32,
    x4_trans: *mut u32,
    x2: *mut u32,
    x2_trans: *mut u32,
) {
    let l = lane();
    let tile = dynamic_smem::<u16>(0);
    // Lane l copies row l / 2, half (l % 2) of it: 8 elements.
    let (row, half) = ((l / 2) as usize, (l % 2) as usize);
    let mut k = 0;
    while k < 8 {
        let col = 8 * half + k;
        // SAFETY: row < 16, col < 16 <= ld: inside src and the shared tile.
        unsafe {
            tile.add(row * ld as usize + col)
                .write(src.add(row * 16 + col).read())
        };
        k += 1;
    }
    // SAFETY: the whole (one-warp) block reaches it.
    unsafe { sync_threads() };
    let addr = x4_quadrant_row_addr(shared_addr(tile), 2 * ld, l);
    // SAFETY: every lane's address is a 16-byte-aligned row start inside the tile (ld % 8 == 0);
    // converged warp; outputs sized by the caller.
    unsafe {
        let r = ldmatrix_x4(addr);
        let rt = ldmatrix_x4_trans(addr);
        let s = ldmatrix_x2(addr);
        let st = ldmatrix_x2_trans(addr);
        let l = l as usize;
        x4.add(4 * l).cast::<[u32; 4]>().write(r);
        x4_trans.add(4 * l).cast::<[u32; 4]>().write(rt);
        x2.add(2 * l).cast::<[u32; 2]>().write(s);
        x2_trans.add(2 * l).cast::<[u32; 2]>().write(st);
    }
}

/// Copies `n_tiles` tiles of [`CP_ASYNC_TILE_BYTES`] from `src` to `dst` through a
/// [`CP_ASYNC_STAGES`]-stage `cp.async` ring in shared memory. Thread `t` copies chunk `t` of
/// each tile into shared memory and writes chunk `B - 1 - t` out, so every chunk crosses threads
/// (the barrier after the wait is what makes that correct).
///
/// # Safety
/// `blockDim = (PRIMITIVE_BLOCK, 1, 1)`, one block; dynamic shared memory at least
/// `CP_ASYNC_STAGES * CP_ASYNC_TILE_BYTES`; `src`, `dst` hold `n_tiles` tiles, 16-byte aligned.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn test_cp_async_pipeline(
    n_tiles: u32,
    src: *const u8,
    dst: *mut u8,
) {
    const S: u32 = CP_ASYNC_STAGES;
    const TILE: usize = CP_ASYNC_TILE_BYTES as usize;
    let t = thread_idx_x() as usize;
    let ring = dynamic_smem::<u8>(0);
    let stage = |s: u32| ring.wrapping_add(s as usize * TILE);
    let issue = |tile: u32| {
        if tile < n_tiles {
            // SAFETY: chunk t of tile `tile` is inside src; its stage slot inside the ring.
            unsafe {
                cp_async_16(
                    shared_addr(stage(tile % S).add(16 * t)),
                    src.add(tile as usize * TILE + 16 * t),
                )
            };
        }
        // Commit even when nothing was issued: every step closes exactly one group.
        commit_group();
    };

    for tile in 0..S - 1 {
        issue(tile);
    }
    for i in 0..n_tiles {
        // Committed so far: S - 1 + i groups; tile i is group i, so at most S - 2 may pend.
        wait_group::<{ CP_ASYNC_STAGES - 2 }>();
        // SAFETY: block-uniform loop (n_tiles is a kernel argument).
        unsafe { sync_threads() };
        // Refill the stage everyone finished reading at step i - 1 (ordered by the barrier).
        issue(i + S - 1);
        let mirror = PRIMITIVE_BLOCK as usize - 1 - t;
        // SAFETY: chunk `mirror` of stage i % S landed (wait + barrier); 16-byte aligned.
        unsafe {
            let v = stage(i % S).add(16 * mirror).cast::<[u32; 4]>().read();
            dst.add(i as usize * TILE + 16 * mirror)
                .cast::<[u32; 4]>()
                .write(v);
        }
    }
    wait_group::<0>();
}
