//! GPU tests of the device primitives (`kernels-gpu/src/{thread,smem,sync,warp,convert,mma,
//! ldmatrix,cp_async}.rs`), each through its test kernel, against a CPU computation.
//!
//! They need a CUDA GPU, so they are `#[ignore]`d: on a machine without one they are reported as
//! ignored, never as passed. Run them with `cargo test --test gpu_primitives -- --ignored` on a
//! GPU machine, or through the GPU bundle (`cargo xtask gpu-bundle`). There, a missing GPU is a
//! failure. Inputs are random; the seed is printed (set `LSERVE_TEST_SEED` to replay one).

mod common;

use common::gpu;
use half::{bf16, f16};
use lserve::dtype::DType;
use lserve::gpu::primitives_testing as pt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn rng(test: &str) -> StdRng {
    let seed = std::env::var("LSERVE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen());
    eprintln!("{test}: LSERVE_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(lo..hi)).collect()
}

// ---------------------------------------------------------------------------------------------
// thread.rs

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn thread_and_block_indices() {
    let gpu = gpu();
    // A block of 144 threads has a partial last warp; y > 1 checks the x-fastest linearization.
    for (grid, block) in [((3, 2), (64, 2)), ((2, 3), (48, 3)), ((5, 1), (32, 1))] {
        let records = pt::thread_indices(&gpu, grid, block).unwrap();
        let per_block = block.0 * block.1;
        assert_eq!(records.len(), (grid.0 * grid.1 * per_block) as usize);
        let mut index = 0;
        for by in 0..grid.1 {
            for bx in 0..grid.0 {
                for ty in 0..block.1 {
                    for tx in 0..block.0 {
                        let linear = ty * block.0 + tx;
                        let want = pt::ThreadRecord {
                            thread_x: tx,
                            thread_y: ty,
                            block_x: bx,
                            block_y: by,
                            block_dim_x: block.0,
                            block_dim_y: block.1,
                            grid_dim_x: grid.0,
                            grid_dim_y: grid.1,
                            thread_in_block: linear,
                            warp: linear / 32,
                            lane: linear % 32,
                        };
                        assert_eq!(
                            records[index], want,
                            "grid {grid:?} block {block:?} #{index}"
                        );
                        index += 1;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// smem.rs + sync.rs

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn shared_memory_round_trip_through_barrier() {
    let gpu = gpu();
    let mut rng = rng("shared_memory_round_trip_through_barrier");
    for (block, blocks, offset) in [(256u32, 5usize, 0u32), (1024, 3, 48), (96, 7, 4)] {
        let x = uniform(&mut rng, block as usize * blocks, -100.0, 100.0);
        let y = pt::smem_reverse_f32(&gpu, &x, block, offset).unwrap();
        for (b, (xs, ys)) in x
            .chunks(block as usize)
            .zip(y.chunks(block as usize))
            .enumerate()
        {
            let want: Vec<u32> = xs.iter().rev().map(|v| v.to_bits()).collect();
            let got: Vec<u32> = ys.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "block {b} (blockDim {block}, offset {offset})");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// warp.rs

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn warp_shuffles() {
    let gpu = gpu();
    let mut rng = rng("warp_shuffles");
    let x = uniform(&mut rng, 4 * pt::PRIMITIVE_BLOCK as usize, -1e3, 1e3);
    for (xor_mask, rotate) in [(1, 0), (5, 1), (16, 7), (31, 31), (0, 13)] {
        let (by_xor, by_idx) = pt::warp_shuffle(&gpu, &x, xor_mask, rotate).unwrap();
        for i in 0..x.len() {
            let (warp, lane) = (i / 32 * 32, i % 32);
            let xor_src = warp + (lane ^ xor_mask as usize);
            let idx_src = warp + (lane + rotate as usize) % 32;
            assert_eq!(
                by_xor[i].to_bits(),
                x[xor_src].to_bits(),
                "xor {xor_mask}, thread {i}"
            );
            assert_eq!(
                by_idx[i].to_bits(),
                x[idx_src].to_bits(),
                "rotate {rotate}, thread {i}"
            );
        }
    }
}

/// The butterfly the device runs (`v[i] += v[i ^ m]` for each mask), in f32: bit-exact.
fn butterfly(values: &[f32], masks: &[usize], op: fn(f32, f32) -> f32) -> Vec<f32> {
    let mut v = values.to_vec();
    for &m in masks {
        v = (0..v.len()).map(|i| op(v[i], v[i ^ m])).collect();
    }
    v
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn warp_and_quad_reductions() {
    let gpu = gpu();
    let mut rng = rng("warp_and_quad_reductions");
    let mut x = uniform(&mut rng, 8 * pt::PRIMITIVE_BLOCK as usize, -10.0, 10.0);
    // One all-negative warp, so that the max is not trivially positive.
    for v in &mut x[64..96] {
        *v = -v.abs() - 1.0;
    }
    let out = pt::warp_reduce(&gpu, &x).unwrap();
    let add = |a: f32, b: f32| a + b;
    for (w, (xs, outs)) in x.chunks(32).zip(out.chunks(32)).enumerate() {
        let sums = butterfly(xs, &[16, 8, 4, 2, 1], add);
        let maxs = butterfly(xs, &[16, 8, 4, 2, 1], f32::max);
        let quad_sums = butterfly(xs, &[2, 1], add);
        let quad_maxs = butterfly(xs, &[2, 1], f32::max);
        let exact_sum: f64 = xs.iter().map(|&v| v as f64).sum();
        let abs_sum: f64 = xs.iter().map(|&v| (v as f64).abs()).sum();
        let true_max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for lane in 0..32 {
            let [sum, max, quad_sum, quad_max] = outs[lane];
            let at = format!("warp {w} lane {lane}");
            assert_eq!(sum.to_bits(), sums[lane].to_bits(), "{at}: warp sum");
            assert!(
                (sum as f64 - exact_sum).abs() <= 1e-5 * abs_sum,
                "{at}: sum {sum} vs {exact_sum}"
            );
            assert_eq!(max, true_max, "{at}: warp max");
            assert_eq!(max.to_bits(), maxs[lane].to_bits(), "{at}: warp max");
            let quad = &xs[lane / 4 * 4..lane / 4 * 4 + 4];
            assert_eq!(
                quad_sum.to_bits(),
                quad_sums[lane].to_bits(),
                "{at}: quad sum"
            );
            assert_eq!(
                quad_max,
                quad.iter().copied().fold(f32::NEG_INFINITY, f32::max),
                "{at}: quad max"
            );
            assert_eq!(
                quad_max.to_bits(),
                quad_maxs[lane].to_bits(),
                "{at}: quad max"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// convert.rs

/// Finite, non-NaN f32 inputs that stress rounding: random bit patterns (all exponents,
/// subnormals, infinities), ordinary values, exact ties between neighbouring 16-bit values, and
/// edge cases.
fn conversion_inputs(rng: &mut StdRng, dtype: DType) -> Vec<f32> {
    let mut x: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        65504.0,
        65519.996,
        65520.0,
        1e-8,
        5.96e-8,
        3e-8,
        3.4e38,
        1.0 + f32::EPSILON,
    ];
    while x.len() < 4096 {
        let bits: u32 = rng.gen();
        let v = f32::from_bits(bits);
        if !v.is_nan() {
            x.push(v);
        }
    }
    x.extend(uniform(rng, 4096, -70000.0, 70000.0));
    x.extend(uniform(rng, 2048, -1e-4, 1e-4));
    // Ties: exactly halfway between two consecutive finite 16-bit values (both signs).
    for _ in 0..4096 {
        let h: u16 = rng.gen::<u16>() & 0x7fff;
        let (lo, hi) = match dtype {
            DType::BF16 => (bf16::from_bits(h).to_f64(), bf16::from_bits(h + 1).to_f64()),
            DType::F16 => (f16::from_bits(h).to_f64(), f16::from_bits(h + 1).to_f64()),
        };
        if lo.is_finite() && hi.is_finite() {
            let mid = ((lo + hi) / 2.0) as f32;
            assert_eq!(mid as f64, (lo + hi) / 2.0, "midpoint must be exact in f32");
            x.push(if rng.gen() { mid } else { -mid });
        }
    }
    if x.len() % 2 == 1 {
        x.push(0.5);
    }
    x
}

fn host_round(dtype: DType, v: f32) -> u16 {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_bits(),
        DType::F16 => f16::from_f32(v).to_bits(),
    }
}

fn host_widen(dtype: DType, bits: u16) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_bits(bits).to_f32(),
        DType::F16 => f16::from_bits(bits).to_f32(),
    }
}

fn check_conversions(dtype: DType) {
    let gpu = gpu();
    let mut rng = rng(&format!("conversions {dtype:?}"));
    let x = conversion_inputs(&mut rng, dtype);
    // Every non-NaN 16-bit pattern appears among the values to widen (cycled over x's length).
    let patterns: Vec<u16> = (0..=u16::MAX)
        .filter(|&b| !host_widen(dtype, b).is_nan())
        .collect();
    let offset = rng.gen_range(0..patterns.len());
    let bits: Vec<u16> = (0..x.len())
        .map(|i| patterns[(offset + i) % patterns.len()])
        .collect();
    let mut covered = 0;
    for chunk_start in (0..patterns.len()).step_by(x.len()) {
        // A second launch per chunk so every pattern is widened at least once.
        let chunk: Vec<u16> = (0..x.len())
            .map(|i| patterns[(chunk_start + i) % patterns.len()])
            .collect();
        let out = pt::convert(&gpu, dtype, &x, &chunk).unwrap();
        for (i, &b) in chunk.iter().enumerate() {
            assert_eq!(
                out.widened[i].to_bits(),
                host_widen(dtype, b).to_bits(),
                "{dtype:?} widen {b:#06x}"
            );
        }
        covered += chunk.len();
    }
    assert!(covered >= patterns.len());

    let out = pt::convert(&gpu, dtype, &x, &bits).unwrap();
    for (i, &v) in x.iter().enumerate() {
        let want = host_round(dtype, v);
        assert_eq!(
            out.rounded[i],
            want,
            "{dtype:?} round {v:e} ({:#010x})",
            v.to_bits()
        );
        assert_eq!(
            out.widened[i].to_bits(),
            host_widen(dtype, bits[i]).to_bits()
        );
    }
    for (j, &pair) in out.packed.iter().enumerate() {
        let want =
            host_round(dtype, x[2 * j]) as u32 | (host_round(dtype, x[2 * j + 1]) as u32) << 16;
        assert_eq!(
            pair,
            want,
            "{dtype:?} pack2({:e}, {:e})",
            x[2 * j],
            x[2 * j + 1]
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn bf16_conversions_match_half() {
    check_conversions(DType::BF16);
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn f16_conversions_match_half() {
    check_conversions(DType::F16);
}

// ---------------------------------------------------------------------------------------------
// mma.rs

fn random_halves(rng: &mut StdRng, dtype: DType, n: usize, range: f32) -> Vec<u16> {
    (0..n)
        .map(|_| host_round(dtype, rng.gen_range(-range..range)))
        .collect()
}

/// `A (16x16) B (16x8) + C` in f64, `b` k-major; also the sum of magnitudes per output (the
/// scale of the f32 accumulation error).
fn reference_product(
    dtype: DType,
    a: &[u16],
    b: &[u16],
    c: Option<&[f32]>,
) -> (Vec<f64>, Vec<f64>) {
    let (mut d, mut scale) = (vec![0.0; 128], vec![0.0; 128]);
    for m in 0..16 {
        for n in 0..8 {
            let c = c.map_or(0.0, |c| c[m * 8 + n] as f64);
            let (mut acc, mut mag) = (c, c.abs());
            for k in 0..16 {
                let p = host_widen(dtype, a[m * 16 + k]) as f64
                    * host_widen(dtype, b[k * 8 + n]) as f64;
                acc += p;
                mag += p.abs();
            }
            d[m * 8 + n] = acc;
            scale[m * 8 + n] = mag;
        }
    }
    (d, scale)
}

fn assert_product(what: &str, got: &[f32], want: &[f64], scale: &[f64]) {
    for i in 0..want.len() {
        let err = (got[i] as f64 - want[i]).abs();
        // f32 accumulation of 17 terms: a few ulps of the magnitude sum. A wrong fragment layout
        // gives errors of the order of the values themselves.
        assert!(
            err <= 1e-5 * scale[i] + 1e-30,
            "{what}: D[{}][{}] = {} but the f64 product is {} (err {err:e})",
            i / 8,
            i % 8,
            got[i],
            want[i]
        );
    }
}

fn check_mma(dtype: DType) {
    let gpu = gpu();
    let mut rng = rng(&format!("mma {dtype:?}"));
    let count = 64;
    let a = random_halves(&mut rng, dtype, count * 256, 4.0);
    let b = random_halves(&mut rng, dtype, count * 128, 4.0);
    let c = uniform(&mut rng, count * 128, -8.0, 8.0);
    let d = pt::mma(&gpu, dtype, &a, &b, &c).unwrap();
    for p in 0..count {
        let (want, scale) = reference_product(
            dtype,
            &a[p * 256..][..256],
            &b[p * 128..][..128],
            Some(&c[p * 128..][..128]),
        );
        assert_product(
            &format!("{dtype:?} problem {p}"),
            &d[p * 128..][..128],
            &want,
            &scale,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn mma_m16n8k16_bf16_matches_f64_product() {
    check_mma(DType::BF16);
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn mma_m16n8k16_f16_matches_f64_product() {
    check_mma(DType::F16);
}

fn check_mma_smem(dtype: DType) {
    let gpu = gpu();
    let mut rng = rng(&format!("mma_smem {dtype:?}"));
    for _ in 0..8 {
        let a = random_halves(&mut rng, dtype, 256, 2.0);
        let b_kn = random_halves(&mut rng, dtype, 128, 2.0);
        let mut b_nk = vec![0u16; 128];
        for k in 0..16 {
            for n in 0..8 {
                b_nk[n * 16 + k] = b_kn[k * 8 + n];
            }
        }
        let (d_kn, d_nk) = pt::mma_smem(&gpu, dtype, &a, &b_kn, &b_nk).unwrap();
        let (want, scale) = reference_product(dtype, &a, &b_kn, None);
        assert_product(
            &format!("{dtype:?} ldmatrix.x2.trans (k-major B)"),
            &d_kn,
            &want,
            &scale,
        );
        assert_product(
            &format!("{dtype:?} ldmatrix.x2 (n-major B)"),
            &d_nk,
            &want,
            &scale,
        );
        // Both paths must build the very same B fragment, so the products agree bit for bit.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&d_kn),
            bits(&d_nk),
            "{dtype:?}: k-major and n-major B differ"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn cp_async_ldmatrix_mma_bf16() {
    check_mma_smem(DType::BF16);
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn cp_async_ldmatrix_mma_f16() {
    check_mma_smem(DType::F16);
}

// ---------------------------------------------------------------------------------------------
// ldmatrix.rs

/// What `ldmatrix` must give lane `l` for the 8x8 matrix at (`r0`, `c0`) of `tile` (16x16
/// row-major), per the PTX ISA: plain: row `l/4`, columns `2(l%4)`, `+1`; `.trans`: column `l/4`,
/// rows `2(l%4)`, `+1`. Low half = first element.
fn expected_ldmatrix(tile: &[u16], (r0, c0): (usize, usize), lane: usize, trans: bool) -> u32 {
    let at = |r: usize, c: usize| tile[(r0 + r) * 16 + c0 + c] as u32;
    let (g, q) = (lane / 4, lane % 4);
    if trans {
        at(2 * q, g) | at(2 * q + 1, g) << 16
    } else {
        at(g, 2 * q) | at(g, 2 * q + 1) << 16
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn ldmatrix_x4_x2_and_trans() {
    let gpu = gpu();
    let mut rng = rng("ldmatrix_x4_x2_and_trans");
    // Quadrant order the kernel addresses: (0,0), (8,0), (0,8), (8,8).
    let origins = [(0, 0), (8, 0), (0, 8), (8, 8)];
    for ld in [16u32, 24, 40] {
        let tile: Vec<u16> = (0..256).map(|_| rng.gen::<u16>() & 0x7fff).collect();
        let out = pt::ldmatrix(&gpu, &tile, ld).unwrap();
        for lane in 0..32 {
            for j in 0..4 {
                let at = format!("ld {ld} lane {lane} reg {j}");
                assert_eq!(
                    out.x4[4 * lane + j],
                    expected_ldmatrix(&tile, origins[j], lane, false),
                    "x4 {at}"
                );
                assert_eq!(
                    out.x4_trans[4 * lane + j],
                    expected_ldmatrix(&tile, origins[j], lane, true),
                    "x4.trans {at}"
                );
            }
            for j in 0..2 {
                let at = format!("ld {ld} lane {lane} reg {j}");
                assert_eq!(
                    out.x2[2 * lane + j],
                    expected_ldmatrix(&tile, origins[j], lane, false),
                    "x2 {at}"
                );
                assert_eq!(
                    out.x2_trans[2 * lane + j],
                    expected_ldmatrix(&tile, origins[j], lane, true),
                    "x2.trans {at}"
                );
            }
            // And `.x4` in that quadrant order is the mma A fragment (PTX ISA table for
            // m16n8k16: a_i at row g + 8 * ((i / 2) % 2), column 2q + i % 2 + 8 * (i / 4)).
            for i in 0..8 {
                let (g, q) = (lane / 4, lane % 4);
                let (row, col) = (g + 8 * ((i / 2) % 2), 2 * q + i % 2 + 8 * (i / 4));
                let reg = out.x4[4 * lane + i / 2];
                let half = if i % 2 == 0 { reg & 0xffff } else { reg >> 16 };
                assert_eq!(
                    half as u16,
                    tile[row * 16 + col],
                    "A fragment lane {lane} a{i}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// cp_async.rs

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn cp_async_multi_stage_pipeline() {
    let gpu = gpu();
    let mut rng = rng("cp_async_multi_stage_pipeline");
    let tile = pt::CP_ASYNC_TILE_BYTES as usize;
    // Fewer tiles than stages, exactly the stages, and many more.
    for n_tiles in [1usize, 2, 3, 4, 7, 32] {
        let src: Vec<u8> = (0..n_tiles * tile).map(|_| rng.gen()).collect();
        let dst = pt::cp_async_pipeline(&gpu, &src).unwrap();
        if let Some(i) = (0..src.len()).find(|&i| src[i] != dst[i]) {
            panic!(
                "{n_tiles} tiles: first difference at byte {i} (tile {}, chunk {}): {:#04x} vs {:#04x}",
                i / tile,
                i % tile / 16,
                dst[i],
                src[i]
            );
        }
    }
}

/// Every kernel of the module, as this GPU's driver compiled it, uses no local memory (no spill
/// slots, no stack). `cargo xtask ptx` checks the same with the toolkit's `ptxas`; the PTX that
/// runs is compiled by the driver's, which may allocate differently (the prefill kernels sit at
/// 255 registers).
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn no_kernel_uses_local_memory() {
    let gpu = gpu();
    let names = gpu.kernel_names();
    assert!(
        names.len() > 50,
        "{} kernels in the {} PTX",
        names.len(),
        gpu.ptx().arch
    );
    let mut spilling = Vec::new();
    for name in names {
        let r = gpu.kernel_resources(&name).unwrap();
        if r.local_bytes > 0 {
            spilling.push(format!(
                "{name}: {} local bytes, {} registers",
                r.local_bytes, r.registers
            ));
        }
    }
    assert!(spilling.is_empty(), "{spilling:#?}");
}
