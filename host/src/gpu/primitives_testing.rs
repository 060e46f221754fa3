//! Launch wrappers for the device-primitive test kernels (`kernels-gpu/src/primitive_tests.rs`).
//!
//! Not public API: these exist so that `tests/gpu_primitives.rs` can run each primitive on the
//! device and compare with a CPU computation. Every wrapper checks its input sizes (the kernels
//! index by them), fills its outputs with a poison value before the launch (so that elements a
//! kernel failed to write show up), launches, waits, and copies the results back.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
pub use lserve_abi::primitives::{
    ThreadRecord, CP_ASYNC_STAGES, CP_ASYNC_TILE_BYTES, MMA_K, MMA_M, MMA_N, MMA_SMEM_BYTES,
    PRIMITIVE_BLOCK, THREAD_RECORD_WORDS,
};

use super::GpuContext;
use crate::dtype::DType;
use crate::{LserveError, Result};

/// Poison for `u32` outputs (as two 16-bit halves: NaN in bf16 and f16).
pub const POISON_U32: u32 = 0xffff_ffff;
/// Poison for 16-bit outputs: NaN in both bf16 and f16 (never produced from finite inputs).
pub const POISON_U16: u16 = 0x7fff;
/// Poison for `f32` outputs: a NaN with a recognizable payload.
pub const POISON_F32: f32 = f32::from_bits(0x7fc0_dead);
/// Poison for byte outputs.
pub const POISON_U8: u8 = 0xa5;

fn check(what: &'static str, ok: bool, reason: impl Into<String>) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(LserveError::InvalidArgument {
            what,
            reason: reason.into(),
        })
    }
}

fn poisoned<T: DeviceRepr + Copy>(gpu: &GpuContext, n: usize, poison: T) -> Result<CudaSlice<T>> {
    Ok(gpu.stream().clone_htod(&vec![poison; n])?)
}

fn download<T: DeviceRepr + Default + Clone>(
    gpu: &GpuContext,
    buf: &CudaSlice<T>,
) -> Result<Vec<T>> {
    gpu.stream().synchronize()?;
    Ok(gpu.stream().clone_dtoh(buf)?)
}

fn one_warp(shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes,
    }
}

fn kernel_for(dtype: DType, bf16: &'static str, f16: &'static str) -> &'static str {
    match dtype {
        DType::BF16 => bf16,
        DType::F16 => f16,
    }
}

/// `test_thread_indices` on a `grid` x `block` (2D) launch: one record per thread, at index
/// `block_in_grid * threads_per_block + thread_in_block`.
pub fn thread_indices(
    gpu: &GpuContext,
    grid: (u32, u32),
    block: (u32, u32),
) -> Result<Vec<ThreadRecord>> {
    let threads = (grid.0 * grid.1 * block.0 * block.1) as usize;
    check(
        "block",
        block.0 * block.1 <= 1024 && threads > 0,
        "1..=1024 threads per block",
    )?;
    let mut out = poisoned(gpu, threads * THREAD_RECORD_WORDS, POISON_U32)?;
    let f = gpu.test_function("test_thread_indices")?;
    let cfg = LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block.0, block.1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `out` holds one record (THREAD_RECORD_WORDS u32) per thread of the launch.
    unsafe { gpu.stream().launch_builder(&f).arg(&mut out).launch(cfg)? };
    let words = download(gpu, &out)?;
    Ok(words
        .chunks_exact(THREAD_RECORD_WORDS)
        .map(|w| ThreadRecord {
            thread_x: w[0],
            thread_y: w[1],
            block_x: w[2],
            block_y: w[3],
            block_dim_x: w[4],
            block_dim_y: w[5],
            grid_dim_x: w[6],
            grid_dim_y: w[7],
            thread_in_block: w[8],
            warp: w[9],
            lane: w[10],
        })
        .collect())
}

/// `test_smem_reverse_f32`: reverses each `block`-element slice of `x` through dynamic shared
/// memory placed at byte `smem_offset`.
pub fn smem_reverse_f32(
    gpu: &GpuContext,
    x: &[f32],
    block: u32,
    smem_offset: u32,
) -> Result<Vec<f32>> {
    check("block", (1..=1024).contains(&block), "1..=1024 threads")?;
    check(
        "x",
        !x.is_empty() && x.len() % block as usize == 0,
        "a non-empty multiple of block",
    )?;
    check("smem_offset", smem_offset % 4 == 0, "a multiple of 4")?;
    let x_dev = gpu.stream().clone_htod(x)?;
    let mut y = poisoned(gpu, x.len(), POISON_F32)?;
    let f = gpu.test_function("test_smem_reverse_f32")?;
    let cfg = LaunchConfig {
        grid_dim: ((x.len() / block as usize) as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem_offset + 4 * block,
    };
    // SAFETY: x and y hold grid * block f32; shared memory covers offset + 4 * block bytes.
    unsafe {
        gpu.stream()
            .launch_builder(&f)
            .arg(&smem_offset)
            .arg(&x_dev)
            .arg(&mut y)
            .launch(cfg)?
    };
    download(gpu, &y)
}

fn warp_launch(n: usize) -> Result<LaunchConfig> {
    check(
        "x",
        n > 0 && n % PRIMITIVE_BLOCK as usize == 0,
        "a non-empty multiple of PRIMITIVE_BLOCK",
    )?;
    Ok(LaunchConfig {
        grid_dim: ((n / PRIMITIVE_BLOCK as usize) as u32, 1, 1),
        block_dim: (PRIMITIVE_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `test_warp_shuffle`: per element `(x[lane ^ xor_mask], x[(lane + rotate) % 32])` within its
/// warp, as two vectors.
pub fn warp_shuffle(
    gpu: &GpuContext,
    x: &[f32],
    xor_mask: u32,
    rotate: u32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let cfg = warp_launch(x.len())?;
    check("xor_mask", xor_mask < 32, "below 32")?;
    let x_dev = gpu.stream().clone_htod(x)?;
    let mut by_xor = poisoned(gpu, x.len(), POISON_F32)?;
    let mut by_idx = poisoned(gpu, x.len(), POISON_F32)?;
    let f = gpu.test_function("test_warp_shuffle")?;
    // SAFETY: full warps (PRIMITIVE_BLOCK % 32 == 0); one f32 per thread in each array.
    unsafe {
        gpu.stream()
            .launch_builder(&f)
            .arg(&x_dev)
            .arg(&mut by_xor)
            .arg(&mut by_idx)
            .arg(&xor_mask)
            .arg(&rotate)
            .launch(cfg)?
    };
    Ok((download(gpu, &by_xor)?, download(gpu, &by_idx)?))
}

/// `test_warp_reduce`: per element `[warp_sum, warp_max, quad_sum, quad_max]` of its warp / quad.
pub fn warp_reduce(gpu: &GpuContext, x: &[f32]) -> Result<Vec<[f32; 4]>> {
    let cfg = warp_launch(x.len())?;
    let x_dev = gpu.stream().clone_htod(x)?;
    let mut out = poisoned(gpu, 4 * x.len(), POISON_F32)?;
    let f = gpu.test_function("test_warp_reduce")?;
    // SAFETY: full warps; x one f32 per thread, out four.
    unsafe {
        gpu.stream()
            .launch_builder(&f)
            .arg(&x_dev)
            .arg(&mut out)
            .launch(cfg)?
    };
    Ok(download(gpu, &out)?
        .chunks_exact(4)
        .map(|c| [c[0], c[1], c[2], c[3]])
        .collect())
}

/// What `test_convert_{bf16,f16}` produced.
#[derive(Debug, Clone)]
pub struct ConvertOutput {
    /// `x[i]` rounded to nearest-even, as bits.
    pub rounded: Vec<u16>,
    /// `pack2(x[2j], x[2j + 1])`: `x[2j]` in the low half.
    pub packed: Vec<u32>,
    /// The `f32` value of `bits[i]`.
    pub widened: Vec<f32>,
}

/// `test_convert_{bf16,f16}` on `x` (f32 to round and pack) and `bits` (16-bit values to widen),
/// of the same even length.
pub fn convert(gpu: &GpuContext, dtype: DType, x: &[f32], bits: &[u16]) -> Result<ConvertOutput> {
    let n = x.len();
    check(
        "x",
        n > 0 && n % 2 == 0 && n <= u32::MAX as usize,
        "a non-empty even length",
    )?;
    check("bits", bits.len() == n, "as long as x")?;
    let x_dev = gpu.stream().clone_htod(x)?;
    let bits_dev = gpu.stream().clone_htod(bits)?;
    let mut rounded = poisoned(gpu, n, POISON_U16)?;
    let mut packed = poisoned(gpu, n / 2, POISON_U32)?;
    let mut widened = poisoned(gpu, n, POISON_F32)?;
    let f = gpu.test_function(kernel_for(dtype, "test_convert_bf16", "test_convert_f16"))?;
    let n32 = n as u32;
    let cfg = LaunchConfig::for_num_elems(n32);
    // SAFETY: the kernel guards i < n; every array is sized n (packed n / 2), n even.
    unsafe {
        gpu.stream()
            .launch_builder(&f)
            .arg(&n32)
            .arg(&x_dev)
            .arg(&mut rounded)
            .arg(&mut packed)
            .arg(&bits_dev)
            .arg(&mut widened)
            .launch(cfg)?
    };
    Ok(ConvertOutput {
        rounded: download(gpu, &rounded)?,
        packed: download(gpu, &packed)?,
        widened: download(gpu, &widened)?,
    })
}

/// `test_mma_{bf16,f16}`: for each problem `p`, `D = A B + C` with `a[p]` 16x16 row-major,
/// `b[p]` 16x8 k-major (`b[k * 8 + n]`), `c[p]` 16x8 row-major; returns `D` 16x8 row-major per
/// problem, concatenated.
pub fn mma(gpu: &GpuContext, dtype: DType, a: &[u16], b: &[u16], c: &[f32]) -> Result<Vec<f32>> {
    let count = a.len() / (MMA_M * MMA_K);
    check(
        "a",
        count > 0 && a.len() == count * MMA_M * MMA_K,
        "whole 16x16 tiles",
    )?;
    check(
        "b",
        b.len() == count * MMA_K * MMA_N,
        "one 16x8 tile per problem",
    )?;
    check(
        "c",
        c.len() == count * MMA_M * MMA_N,
        "one 16x8 tile per problem",
    )?;
    let a_dev = gpu.stream().clone_htod(a)?;
    let b_dev = gpu.stream().clone_htod(b)?;
    let c_dev = gpu.stream().clone_htod(c)?;
    let mut d = poisoned(gpu, c.len(), POISON_F32)?;
    let f = gpu.test_function(kernel_for(dtype, "test_mma_bf16", "test_mma_f16"))?;
    let cfg = LaunchConfig {
        grid_dim: (count as u32, 1, 1),
        ..one_warp(0)
    };
    // SAFETY: one warp per block, one problem per block, arrays sized for `count` problems.
    unsafe {
        gpu.stream()
            .launch_builder(&f)
            .arg(&a_dev)
            .arg(&b_dev)
            .arg(&c_dev)
            .arg(&mut d)
            .launch(cfg)?
    };
    download(gpu, &d)
}

/// `test_mma_smem_{bf16,f16}`: `cp.async` + `ldmatrix` + `mma`, `A` 16x16 row-major, `B` given
/// k-major (`b_kn[k * 8 + n]`) and n-major (`b_nk[n * 16 + k]`; the caller passes the same
/// matrix, or not); returns `(A B_kn, A B_nk)`, 16x8 row-major each.
pub fn mma_smem(
    gpu: &GpuContext,
    dtype: DType,
    a: &[u16],
    b_kn: &[u16],
    b_nk: &[u16],
) -> Result<(Vec<f32>, Vec<f32>)> {
    check("a", a.len() == MMA_M * MMA_K, "one 16x16 tile")?;
    check("b_kn", b_kn.len() == MMA_K * MMA_N, "one 16x8 tile")?;
    check("b_nk", b_nk.len() == MMA_K * MMA_N, "one 8x16 tile")?;
    let a_dev = gpu.stream().clone_htod(a)?;
    let kn_dev = gpu.stream().clone_htod(b_kn)?;
    let nk_dev = gpu.stream().clone_htod(b_nk)?;
    let mut d_kn = poisoned(gpu, MMA_M * MMA_N, POISON_F32)?;
    let mut d_nk = poisoned(gpu, MMA_M * MMA_N, POISON_F32)?;
    let f = gpu.test_function(kernel_for(dtype, "test_mma_smem_bf16", "test_mma_smem_f16"))?;
    // SAFETY: one warp, MMA_SMEM_BYTES of shared memory, device allocations are 256-byte aligned.
    unsafe {
        gpu.stream()
            .launch_builder(&f)
            .arg(&a_dev)
            .arg(&kn_dev)
            .arg(&nk_dev)
            .arg(&mut d_kn)
            .arg(&mut d_nk)
            .launch(one_warp(MMA_SMEM_BYTES))?
    };
    Ok((download(gpu, &d_kn)?, download(gpu, &d_nk)?))
}

/// What `test_ldmatrix` produced: lane `l`'s register `j` at `[l * N + j]`.
#[derive(Debug, Clone)]
pub struct LdmatrixOutput {
    /// `.x4`, 32 x 4.
    pub x4: Vec<u32>,
    /// `.x4.trans`, 32 x 4.
    pub x4_trans: Vec<u32>,
    /// `.x2`, 32 x 2.
    pub x2: Vec<u32>,
    /// `.x2.trans`, 32 x 2.
    pub x2_trans: Vec<u32>,
}

/// `test_ldmatrix` on a 16x16 tile (row-major, 256 elements) staged in shared memory with a row
/// stride of `ld` elements (a multiple of 8, at least 16).
pub fn ldmatrix(gpu: &GpuContext, tile: &[u16], ld: u32) -> Result<LdmatrixOutput> {
    check("tile", tile.len() == 256, "16x16 elements")?;
    check(
        "ld",
        ld >= 16 && ld % 8 == 0 && ld <= 1024,
        "a multiple of 8 in 16..=1024",
    )?;
    let src = gpu.stream().clone_htod(tile)?;
    let mut x4 = poisoned(gpu, 128, POISON_U32)?;
    let mut x4_trans = poisoned(gpu, 128, POISON_U32)?;
    let mut x2 = poisoned(gpu, 64, POISON_U32)?;
    let mut x2_trans = poisoned(gpu, 64, POISON_U32)?;
    let f = gpu.test_function("test_ldmatrix")?;
    // SAFETY: one warp; shared memory holds 16 rows of `ld` u16; outputs sized as documented.
    unsafe {
        gpu.stream()
            .launch_builder(&f)
            .arg(&src)
            .arg(&ld)
            .arg(&mut x4)
            .arg(&mut x4_trans)
            .arg(&mut x2)
            .arg(&mut x2_trans)
            .launch(one_warp(32 * ld))?
    };
    Ok(LdmatrixOutput {
        x4: download(gpu, &x4)?,
        x4_trans: download(gpu, &x4_trans)?,
        x2: download(gpu, &x2)?,
        x2_trans: download(gpu, &x2_trans)?,
    })
}

/// `test_cp_async_pipeline`: copies `src` (a whole number of `CP_ASYNC_TILE_BYTES` tiles) through
/// the `cp.async` shared-memory ring; the result should equal `src`.
pub fn cp_async_pipeline(gpu: &GpuContext, src: &[u8]) -> Result<Vec<u8>> {
    let tile = CP_ASYNC_TILE_BYTES as usize;
    check(
        "src",
        !src.is_empty() && src.len() % tile == 0,
        "a non-empty multiple of the tile",
    )?;
    let n_tiles = (src.len() / tile) as u32;
    let src_dev = gpu.stream().clone_htod(src)?;
    let mut dst = poisoned(gpu, src.len(), POISON_U8)?;
    let f = gpu.test_function("test_cp_async_pipeline")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (PRIMITIVE_BLOCK, 1, 1),
        shared_mem_bytes: CP_ASYNC_STAGES * CP_ASYNC_TILE_BYTES,
    };
    // SAFETY: one block of PRIMITIVE_BLOCK threads, the ring fits the shared memory given,
    // src/dst hold n_tiles tiles and are 256-byte aligned allocations.
    unsafe {
        gpu.stream()
            .launch_builder(&f)
            .arg(&n_tiles)
            .arg(&src_dev)
            .arg(&mut dst)
            .launch(cfg)?
    };
    download(gpu, &dst)
}
