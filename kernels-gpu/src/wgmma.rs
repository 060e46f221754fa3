//! Warpgroup tensor-core products (sm_90, PTX ISA 8.0): `wgmma.mma_async`, issued by the four
//! warps of a warpgroup (128 threads, warps `4w .. 4w + 4`) together, reading `B` (and `A`, or
//! taking it from registers) straight from shared memory through matrix descriptors.
//!
//! **Shapes used here**: `m64nNk16`, `D (64xN, f32) = A (64x16) * B (16xN) + D`, bf16 or f16
//! operands, `N` 64 or 128. Warp `w` of the warpgroup owns rows `16w .. 16w + 16` of `A` and
//! `D`, and its lanes hold them exactly as an `mma.sync.m16n8k16` holds its 16 rows
//! ([`crate::mma`]): the accumulator of a warp is `N / 8` [`FragC`]s (columns `8j .. 8j + 8`
//! in the `j`-th), and `A` from registers is one [`FragA`] per 16 columns. So the softmax and
//! the masks written for `mma.sync` fragments apply unchanged.
//!
//! **Shared-memory operands** ([`SmemDesc`]) use the 128-byte swizzle, the layout a tensor-map
//! copy with `CU_TENSOR_MAP_SWIZZLE_128B` writes: rows of 128 bytes (64 elements), the 16-byte
//! chunk `c` of row `r` stored at chunk `c ^ (r % 8)`, atoms of 8 rows (1024 bytes, 1024-byte
//! aligned). A K-major operand (rows along M or N, the 64 elements of a row along K) steps
//! through K by moving the start address 32 bytes per `k16` inside an atom row; an MN-major
//! operand (`B` with `tnspB`, rows along K) has its 64-element column groups `lbo` bytes apart.
//!
//! **Ordering**: [`fence`] before the first product of a batch (it orders the registers and
//! shared memory the products read against earlier accesses), [`commit_group`] after the
//! batch, [`wait_group`] before anything reads the accumulators or overwrites what the
//! products read. The compiler does not know that an accumulator is written after the
//! instruction issues: [`fence_operands`] pins the accumulator registers at the wait, so that
//! no read of them moves above it.

use core::arch::asm;

use crate::convert::{Bf16, F16};
use crate::mma::{FragA, FragC, MmaElement};

/// A shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address,
/// leading- and stride-dimension byte offsets (all in 16-byte units), swizzle mode 1 (128-byte).
#[derive(Clone, Copy)]
pub struct SmemDesc(u64);

impl SmemDesc {
    /// The descriptor of an operand at shared-window address `addr` (16-byte aligned; its atom
    /// 1024-byte aligned) with the 128-byte swizzle: `sbo` bytes between 8-row groups along
    /// the strided dimension, `lbo` bytes between 64-element groups along the leading one
    /// (MN-major operands; unused by K-major ones, pass 16).
    #[inline(always)]
    pub fn swizzled_128b(addr: u32, lbo: u32, sbo: u32) -> Self {
        let field = |bytes: u32| ((bytes >> 4) & 0x3FFF) as u64;
        Self(field(addr) | field(lbo) << 16 | field(sbo) << 32 | 1u64 << 62)
    }
}

/// `wgmma.fence`: the registers and shared memory the next products read are ordered after
/// this warp's earlier accesses of them.
///
/// # Safety
/// The whole warpgroup executes it (`.sync.aligned`).
#[inline(always)]
pub unsafe fn fence() {
    // SAFETY: forwarded. Not `nomem`: shared-memory accesses must not move across it.
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack)) };
}

/// `wgmma.commit_group`: the products issued since the last commit form one group.
///
/// # Safety
/// The whole warpgroup executes it.
#[inline(always)]
pub unsafe fn commit_group() {
    // SAFETY: forwarded.
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) };
}

/// `wgmma.wait_group N`: waits until at most `N` committed groups are pending; the
/// accumulators of the others are written and their shared-memory reads done.
///
/// # Safety
/// The whole warpgroup executes it.
#[inline(always)]
pub unsafe fn wait_group<const N: u32>() {
    // SAFETY: forwarded. Not `nomem`: the shared memory the products read may be overwritten
    // only after this.
    unsafe { asm!("wgmma.wait_group.sync.aligned {0};", const N, options(nostack)) };
}

/// `setmaxnreg.inc`: this warpgroup's registers per thread rise to `N` (blocking until another
/// warpgroup of the block has released enough, [`release_registers`]).
///
/// # Safety
/// The whole warpgroup executes it, once, with `N` a multiple of 8 in `24 ..= 256` and at least
/// its current count; the block's warpgroups together never ask for more than it was launched
/// with.
#[inline(always)]
pub unsafe fn claim_registers<const N: u32>() {
    // SAFETY: forwarded.
    unsafe { asm!("setmaxnreg.inc.sync.aligned.u32 {0};", const N, options(nostack, nomem)) };
}

/// `setmaxnreg.dec`: this warpgroup's registers per thread fall to `N`, the rest go back to the
/// block's pool for [`claim_registers`].
///
/// # Safety
/// The whole warpgroup executes it, once, with `N` a multiple of 8 in `24 ..= 256`, at most its
/// current count, and at least what its remaining code needs (ptxas allocates the code after
/// it within `N`).
#[inline(always)]
pub unsafe fn release_registers<const N: u32>() {
    // SAFETY: forwarded.
    unsafe { asm!("setmaxnreg.dec.sync.aligned.u32 {0};", const N, options(nostack, nomem)) };
}

/// Pins the accumulator registers `acc` here: an empty `asm` that reads and writes each, in
/// program order with the `wgmma` instructions (all are volatile `asm`), so that no computation
/// on them moves across a [`wait_group`] or into a batch of products.
#[inline(always)]
pub fn fence_operands<const N: usize>(acc: &mut [FragC; N]) {
    crate::unroll16!(t in 0..N => {
        crate::unroll8!(i in 0..4 => {
            // SAFETY: no instruction; only the register's liveness is constrained.
            unsafe { asm!("/* {0} */", inout(reg32) acc[t].regs[i], options(nomem, nostack)) };
        });
    });
}

/// [`fence_operands`] for `A` fragments that products read from registers: pinned here, their
/// registers stay theirs (unread by anything else, unwritten) until this point.
#[inline(always)]
pub fn fence_fragments<E, const N: usize>(a: &mut [FragA<E>; N]) {
    crate::unroll16!(t in 0..N => {
        crate::unroll8!(i in 0..4 => {
            // SAFETY: no instruction; only the register's liveness is constrained.
            unsafe { asm!("/* {0} */", inout(reg32) a[t].regs[i], options(nomem, nostack)) };
        });
    });
}

/// Element types of the `wgmma` products here.
pub trait WgmmaElement: MmaElement {
    /// `acc (64x128) = A * B (+ acc if accumulate)`, both from shared memory, both K-major.
    ///
    /// # Safety
    /// As [`mma_64x128_ss`].
    unsafe fn mma_64x128_ss(acc: &mut [FragC; 16], a: SmemDesc, b: SmemDesc, accumulate: bool);

    /// `acc (64x64) += A * B`, `A` from registers, `B` from shared memory, MN-major.
    ///
    /// # Safety
    /// As [`mma_64xn_rs`].
    unsafe fn mma_64x64_rs(acc: &mut [FragC; 8], a: &FragA<Self>, b: SmemDesc);

    /// `acc (64x128) += A * B`, `A` from registers, `B` from shared memory, MN-major.
    ///
    /// # Safety
    /// As [`mma_64xn_rs`].
    unsafe fn mma_64x128_rs(acc: &mut [FragC; 16], a: &FragA<Self>, b: SmemDesc);
}

/// The accumulator operands `{0}` .. `{31}` of a 64x64 product.
macro_rules! acc32 {
    () => {
        "{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, \
         {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, \
         {30}, {31}"
    };
}

/// The accumulator operands `{0}` .. `{63}` of a 64x128 product.
macro_rules! acc64 {
    () => {
        concat!(
            acc32!(),
            ", {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, \
             {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, \
             {59}, {60}, {61}, {62}, {63}"
        )
    };
}

/// `asm!` with the accumulator tiles `$t` of `$acc` as the first operands (in, out), then the
/// rest.
macro_rules! with_acc {
    ($template:expr, $acc:ident [$($t:literal)*], $($rest:tt)*) => {
        asm!(
            $template,
            $(
                inout(reg32) $acc[$t].regs[0], inout(reg32) $acc[$t].regs[1],
                inout(reg32) $acc[$t].regs[2], inout(reg32) $acc[$t].regs[3],
            )*
            $($rest)*
        )
    };
}

macro_rules! impl_wgmma {
    ($ty:ty, $name:literal) => {
        impl WgmmaElement for $ty {
            #[inline(always)]
            unsafe fn mma_64x128_ss(
                acc: &mut [FragC; 16],
                a: SmemDesc,
                b: SmemDesc,
                accumulate: bool,
            ) {
                // SAFETY: forwarded (the caller's warpgroup, fence and operands).
                unsafe {
                    with_acc!(
                        concat!(
                            "{{\n.reg .pred p;\nsetp.ne.b32 p, {66}, 0;\n",
                            "wgmma.mma_async.sync.aligned.m64n128k16.f32.", $name, ".", $name,
                            " {{", acc64!(), "}}, {64}, {65}, p, 1, 1, 0, 0;\n}}"
                        ),
                        acc[0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15],
                        in(reg64) a.0, in(reg64) b.0, in(reg32) accumulate as u32,
                        options(nostack),
                    )
                };
            }

            #[inline(always)]
            unsafe fn mma_64x64_rs(acc: &mut [FragC; 8], a: &FragA<Self>, b: SmemDesc) {
                // SAFETY: forwarded.
                unsafe {
                    with_acc!(
                        concat!(
                            "{{\n.reg .pred p;\nsetp.ne.b32 p, {37}, 0;\n",
                            "wgmma.mma_async.sync.aligned.m64n64k16.f32.", $name, ".", $name,
                            " {{", acc32!(), "}}, {{{32}, {33}, {34}, {35}}}, {36}, p, 1, 1, 1;\n}}"
                        ),
                        acc[0 1 2 3 4 5 6 7],
                        in(reg32) a.regs[0], in(reg32) a.regs[1], in(reg32) a.regs[2],
                        in(reg32) a.regs[3], in(reg64) b.0, in(reg32) 1u32,
                        options(nostack),
                    )
                };
            }

            #[inline(always)]
            unsafe fn mma_64x128_rs(acc: &mut [FragC; 16], a: &FragA<Self>, b: SmemDesc) {
                // SAFETY: forwarded.
                unsafe {
                    with_acc!(
                        concat!(
                            "{{\n.reg .pred p;\nsetp.ne.b32 p, {69}, 0;\n",
                            "wgmma.mma_async.sync.aligned.m64n128k16.f32.", $name, ".", $name,
                            " {{", acc64!(), "}}, {{{64}, {65}, {66}, {67}}}, {68}, p, 1, 1, 1;\n}}"
                        ),
                        acc[0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15],
                        in(reg32) a.regs[0], in(reg32) a.regs[1], in(reg32) a.regs[2],
                        in(reg32) a.regs[3], in(reg64) b.0, in(reg32) 1u32,
                        options(nostack),
                    )
                };
            }
        }
    };
}

impl_wgmma!(Bf16, "bf16");
impl_wgmma!(F16, "f16");

/// `acc = A * B` (or `+= ` with `accumulate`) for this warpgroup's 64 rows and 128 columns over
/// 16 of K: `A` (64x16) and `B` (128 rows of N by 16 of K) both K-major in shared memory.
///
/// # Safety
/// The whole warpgroup executes it, after a [`fence`] that follows every access of `acc` and
/// of the operands' shared memory since the last wait; the descriptors describe 1024-byte
/// aligned swizzled tiles inside the block's shared memory, which nobody writes until a
/// [`wait_group`] covers this product; `acc` is read only after that wait.
#[inline(always)]
pub unsafe fn mma_64x128_ss<E: WgmmaElement>(
    acc: &mut [FragC; 16],
    a: SmemDesc,
    b: SmemDesc,
    accumulate: bool,
) {
    // SAFETY: forwarded.
    unsafe { E::mma_64x128_ss(acc, a, b, accumulate) }
}

/// `acc += A * B` for this warpgroup's 64 rows and `8 * T` columns (`T` 8 or 16) over 16 of K:
/// `A` from this warp's registers (its 16 rows, as an `mma.sync` A fragment), `B` (16 rows of K
/// by N) MN-major in shared memory.
///
/// # Safety
/// As [`mma_64x128_ss`].
#[inline(always)]
pub unsafe fn mma_64xn_rs<E: WgmmaElement, const T: usize>(
    acc: &mut [FragC; T],
    a: &FragA<E>,
    b: SmemDesc,
) {
    const { assert!(T == 8 || T == 16) };
    // SAFETY: forwarded; `T` picks the product of the accumulator's width (the casts are of an
    // array to an array of the same length).
    unsafe {
        if T == 8 {
            E::mma_64x64_rs(&mut *(acc as *mut [FragC; T]).cast::<[FragC; 8]>(), a, b);
        } else {
            E::mma_64x128_rs(&mut *(acc as *mut [FragC; T]).cast::<[FragC; 16]>(), a, b);
        }
    }
}
