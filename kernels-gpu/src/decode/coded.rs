//! Decode attention over an integer-coded cache: INT8 or INT4 codes with a bf16 scale `s` and
//! minimum `m` per token and KV head (element `c` is `fma(c, s, m)`, `lserve::quant`).
//!
//! Same grid, blocks, warps, page lists ([`RowSource`]), per-warp stage ring, online softmax and
//! merges as the 16-bit kernel ([`super`]); what differs is what a tile is and how it becomes
//! `mma` operands. A stage holds 16 K code rows and 16 V code rows (`D` or `D / 2` bytes each,
//! copied with 16-byte `cp.async`) and their rows' `(s, m)` words (4-byte `cp.async`). The codes
//! themselves go through the tensor cores, centred (`c - 128`, `c - 8`) and made exact 16-bit
//! values in registers ([`CodeElement`]); the scales and offsets act on the products, per key.
//! With `u` the centred code and a row's offset `o = m + centre · s` (its value at the centre
//! code), `k_j = s_j u_j + o_j`:
//! - `S = Q Kᵀ`: `q · k_j = s_j (q · u_j) + o_j Σ q`, so `S' = Q Uᵀ` on the tensor cores, then
//!   one `fma` per score with the row sum of `q` (once per block);
//! - `O += P V`: `Σ_j p_j v_j = Σ_j (p_j s_j) u_j + Σ_j p_j o_j`, so `P` is scaled per key before
//!   it becomes the A operand, and `Σ_j p_j o_j` is one more running sum per query head, added to
//!   every dimension at the end.
//!
//! Centred, the products carry the row's spread and the offset its level (uncentred codes put
//! both in the products, to cancel against `Σ p m`).
//!
//! Operand order. The tile's 16 keys are the `M` rows of the products and the group's query
//! heads their `N` columns (`Sᵀ = U_k Qᵀ`, `Oᵀ = U_vᵀ P'ᵀ`): 8 `m16n8k16` per product instead of 16
//! with the heads as rows (whose rows `G..16` are zero). Lane `(r, t)` (`r = lane / 4`,
//! `t = lane % 4`) holds:
//! - `Sᵀ`: keys `r`, `r + 8` of heads `2t`, `2t + 1`, over dimensions `32 t .. 32 t + 32` of
//!   every key (the sum over dimensions does not care in which order `mma` sees them; each
//!   format's [`CodeFormat::key_fragment`] says which of them a `k` step takes, and the queries
//!   are loaded in the same order, [`CodeFormat::query_elements`]);
//! - a head's 16 scores are in the 8 lanes of one `t`: its softmax reduces over lanes
//!   `t, t + 4, ..`;
//! - `P'ᵀ` (B of `Oᵀ`): the keys of `k` indices `2t, 2t+1, 2t+8, 2t+9` are `t, t + 8, t + 4,
//!   t + 12` (another order the sum over keys allows), each a pair of one lane's `Sᵀ` registers
//!   (4 shuffles a tile);
//! - `Oᵀ`: lane `(r, t)` reads dimensions `16 r .. 16 r + 16` of value rows `t`, `t + 4`, `t + 8`,
//!   `t + 12`, and accumulator `i`'s rows `r`, `r + 8` are dimensions `16 r + 2 i`,
//!   `16 r + 2 i + 1`.
//!
//! The two formats ([`CodeFormat`]): [`Int8Codes`] (a lane reads two 16-byte chunks of each of
//! its key rows and one of each value row; a byte pair becomes an f16 pair with one `prmt` and
//! one subtraction) and [`Int4Codes`] (one chunk of each key row and 8 bytes of each value row;
//! a nibble pair becomes a 16-bit pair with one `lop3` and one subtraction or `fma`). Each lays
//! its tiles' 16-byte chunks out so that the eight lanes of each phase of its loads hit eight
//! different chunks of a 128-byte line.

use core::marker::PhantomData;

use lserve_abi::decode::{
    coded_row_bytes, coded_stage_bytes, coded_stages, CodedDecodeArgs, CODED_HEAD_DIM,
    DECODE_TILE_ROWS,
};

use super::online_softmax::add_column_tile;
use super::rows::{PairInputs, RowSource};
use super::tiles::WARPS;
use crate::convert::{word_params, Bf16, CodeElement, Half16, CODE_CENTRE, F16, NIBBLE_CENTRE};
use crate::cp_async::{
    commit_group, cp_async_16_zfill_with_policy, cp_async_4_zfill_with_policy, l2_evict_first,
    wait_all, wait_group,
};
use crate::math::{byte_perm, fma, pow2_scale};
use crate::mma::{mma_m16n8k16, FragA, FragB, FragC, MmaElement};
use crate::smem::{dynamic_smem, ld_shared_u32, ld_shared_v2_u32, ld_shared_v4_u32, shared_addr};
use crate::sync::{sync_threads, sync_warp};
use crate::thread::{block_idx_x, block_idx_y, lane, warp_in_block, WARP_SIZE};
use crate::tile::SoftmaxState;
use crate::warp::{quad_max_f32, quad_sum_f32, shfl_idx_f32, shfl_idx_u32, shfl_xor_f32};

/// The head dimension these kernels serve.
const D: usize = CODED_HEAD_DIM as usize;
/// `k` steps of `Sᵀ = U_k Qᵀ` over the head dimension.
const K_STEPS: usize = D / 16;
/// `Oᵀ` accumulators of 16 dimensions.
const O_TILES: usize = D / 16;

/// A code format of the coded kernel: its row bytes, where a tile's chunks sit in shared memory,
/// and how a lane's share of a landed tile becomes `mma` operands (module docs, "Operand order").
pub trait CodeFormat {
    /// Bits per code (8 or 4).
    const BITS: u32;
    /// The code the products are centred on.
    const CENTRE: f32;
    /// Bytes of one code row (`D` channels).
    const ROW_BYTES: u32 = coded_row_bytes(D as u32, Self::BITS);
    /// 16-byte chunks per code row.
    const ROW_CHUNKS: u32 = Self::ROW_BYTES / 16;
    /// Bytes of one K (or V) code tile.
    const TILE_BYTES: u32 = DECODE_TILE_ROWS * Self::ROW_BYTES;
    /// Stages of a warp's ring.
    const STAGES: u32 = coded_stages(Self::BITS);
    /// A stage's bytes.
    const STAGE_BYTES: u32 = coded_stage_bytes(D as u32, Self::BITS);

    /// Where logical chunk `c` of code row `r` of a tile sits in its row.
    fn chunk_at(r: u32, c: u32) -> u32;

    /// The words of key rows `r` and `r + 8` this lane multiplies (dimensions
    /// `32 t .. 32 t + 32`).
    type KeyRows: Copy;

    /// Loads lane `(r, t)`'s [`KeyRows`](Self::KeyRows) from a landed K tile at `tile`.
    ///
    /// # Safety
    /// `tile` is a landed code tile (the caller's wait and barrier); `r < 8`, `t < 4`.
    unsafe fn load_keys(tile: u32, r: u32, t: u32) -> Self::KeyRows;

    /// The A fragment of `k` step `kk` (keys `r`, `r + 8`), centred f16 codes.
    fn key_fragment(rows: &Self::KeyRows, kk: usize) -> [u32; 4];

    /// Which of the lane's 32 query elements (dimensions `32 t ..`) `k` step `kk` pairs in its
    /// B register `reg` (0 or 1), low half first: the dimensions [`key_fragment`]'s registers
    /// `reg` and `reg + 2` hold.
    ///
    /// [`key_fragment`]: Self::key_fragment
    fn query_elements(kk: usize, reg: usize) -> (usize, usize);

    /// The words of value rows `t`, `t + 4`, `t + 8`, `t + 12` this lane multiplies (dimensions
    /// `16 r .. 16 r + 16`).
    type ValueRows: Copy;

    /// Loads lane `(r, t)`'s [`ValueRows`](Self::ValueRows) from a landed V tile at `tile`.
    ///
    /// # Safety
    /// As [`load_keys`](Self::load_keys).
    unsafe fn load_values(tile: u32, r: u32, t: u32) -> Self::ValueRows;

    /// The A fragments of accumulators `2w` and `2w + 1` (dimensions `16 r + 4 w .. + 4`), centred
    /// codes in the element type `E`.
    fn value_fragments<E: CodeElement>(rows: &Self::ValueRows, w: usize) -> ([u32; 4], [u32; 4]);
}

/// INT8 codes: a 128-byte row of eight chunks; chunk `c` of row `r` at `c ^ (2 (r % 4) ^ (r % 2))`.
/// Lane `(r, t)` reads chunks `2t`, `2t + 1` of key rows `r`, `r + 8` (in `k` step `kk`
/// dimensions `32 t + 4 kk + 0..4`) and chunk `r` of each value row.
pub struct Int8Codes;

impl CodeFormat for Int8Codes {
    const BITS: u32 = 8;
    const CENTRE: f32 = CODE_CENTRE;

    #[inline(always)]
    fn chunk_at(r: u32, c: u32) -> u32 {
        chunk_at(r, c)
    }

    type KeyRows = [[u32; 8]; 2];

    #[inline(always)]
    unsafe fn load_keys(tile: u32, r: u32, t: u32) -> Self::KeyRows {
        let at = |row: u32, c: u32| tile_chunk::<Self>(tile, row, c);
        // SAFETY: rows < 16, chunks < 8 of the landed tile (caller).
        let (k0, k1, k8, k9) = unsafe {
            (
                ld_shared_v4_u32(at(r, 2 * t)),
                ld_shared_v4_u32(at(r, 2 * t + 1)),
                ld_shared_v4_u32(at(r + 8, 2 * t)),
                ld_shared_v4_u32(at(r + 8, 2 * t + 1)),
            )
        };
        [
            [k0[0], k0[1], k0[2], k0[3], k1[0], k1[1], k1[2], k1[3]],
            [k8[0], k8[1], k8[2], k8[3], k9[0], k9[1], k9[2], k9[3]],
        ]
    }

    #[inline(always)]
    fn key_fragment(rows: &Self::KeyRows, kk: usize) -> [u32; 4] {
        let (lo, hi) = (rows[0][kk], rows[1][kk]);
        [
            F16::codes_lo(lo),
            F16::codes_lo(hi),
            F16::codes_hi(lo),
            F16::codes_hi(hi),
        ]
    }

    #[inline(always)]
    fn query_elements(kk: usize, reg: usize) -> (usize, usize) {
        (4 * kk + 2 * reg, 4 * kk + 2 * reg + 1)
    }

    type ValueRows = [[u32; 4]; 4];

    #[inline(always)]
    unsafe fn load_values(tile: u32, r: u32, t: u32) -> Self::ValueRows {
        let at = |row: u32| tile_chunk::<Self>(tile, row, r);
        // SAFETY: rows < 16, chunk r < 8 of the landed tile (caller).
        unsafe {
            [
                ld_shared_v4_u32(at(t)),
                ld_shared_v4_u32(at(t + 4)),
                ld_shared_v4_u32(at(t + 8)),
                ld_shared_v4_u32(at(t + 12)),
            ]
        }
    }

    #[inline(always)]
    fn value_fragments<E: CodeElement>(rows: &Self::ValueRows, w: usize) -> ([u32; 4], [u32; 4]) {
        // Bytes of rows (t, t + 8) and (t + 4, t + 12) side by side: dimensions 16 r + 4 w + 0..2
        // and + 2..4, i.e. accumulators 2w and 2w + 1 (rows r and r + 8 of each).
        let lo_08 = byte_perm::<0x5140>(rows[0][w], rows[2][w]);
        let hi_08 = byte_perm::<0x7362>(rows[0][w], rows[2][w]);
        let lo_4c = byte_perm::<0x5140>(rows[1][w], rows[3][w]);
        let hi_4c = byte_perm::<0x7362>(rows[1][w], rows[3][w]);
        (
            [
                E::codes_lo(lo_08),
                E::codes_hi(lo_08),
                E::codes_lo(lo_4c),
                E::codes_hi(lo_4c),
            ],
            [
                E::codes_lo(hi_08),
                E::codes_hi(hi_08),
                E::codes_lo(hi_4c),
                E::codes_hi(hi_4c),
            ],
        )
    }
}

/// INT4 codes: a 64-byte row of four chunks, two rows to a 128-byte line; chunk `c` of row `r` at
/// `c ^ (2 ((r / 2) % 2))` ([`int4_chunk_at`]). Lane `(r, t)` reads chunk `t` of key rows `r`,
/// `r + 8` (word `w` holds dimensions `32 t + 8 w + 0..8`; `k` step `2w` takes dimensions
/// `(0, 4)`, `(1, 5)` of them, step `2w + 1` `(2, 6)`, `(3, 7)`) and bytes `8 r .. 8 r + 8` of each
/// value row (one 8-byte load: two phases of 16 lanes, rows `t` and `t + 2` in different halves
/// of their lines).
pub struct Int4Codes;

/// Where logical chunk `c` of INT4 code row `r` sits in its 64-byte row ([`Int4Codes`]).
#[inline(always)]
pub const fn int4_chunk_at(r: u32, c: u32) -> u32 {
    c ^ (2 * ((r / 2) % 2))
}

impl CodeFormat for Int4Codes {
    const BITS: u32 = 4;
    const CENTRE: f32 = NIBBLE_CENTRE;

    #[inline(always)]
    fn chunk_at(r: u32, c: u32) -> u32 {
        int4_chunk_at(r, c)
    }

    type KeyRows = [[u32; 4]; 2];

    #[inline(always)]
    unsafe fn load_keys(tile: u32, r: u32, t: u32) -> Self::KeyRows {
        // SAFETY: rows < 16, chunk t < 4 of the landed tile (caller).
        unsafe {
            [
                ld_shared_v4_u32(tile_chunk::<Self>(tile, r, t)),
                ld_shared_v4_u32(tile_chunk::<Self>(tile, r + 8, t)),
            ]
        }
    }

    #[inline(always)]
    fn key_fragment(rows: &Self::KeyRows, kk: usize) -> [u32; 4] {
        // Step 2w + 1 takes bytes 1 and 3 of word w.
        let shift = 8 * (kk % 2) as u32;
        let (lo, hi) = (rows[0][kk / 2] >> shift, rows[1][kk / 2] >> shift);
        [
            F16::nibbles_lo(lo),
            F16::nibbles_lo(hi),
            F16::nibbles_hi(lo),
            F16::nibbles_hi(hi),
        ]
    }

    #[inline(always)]
    fn query_elements(kk: usize, reg: usize) -> (usize, usize) {
        let first = 8 * (kk / 2) + 2 * (kk % 2) + reg;
        (first, first + 4)
    }

    type ValueRows = [[u32; 2]; 4];

    #[inline(always)]
    unsafe fn load_values(tile: u32, r: u32, t: u32) -> Self::ValueRows {
        // Bytes 8r .. 8r + 8: half r % 2 of logical chunk r / 2.
        let at = |row: u32| tile_chunk::<Self>(tile, row, r / 2) + 8 * (r % 2);
        // SAFETY: rows < 16, chunk r / 2 < 4 of the landed tile (caller), 8-byte aligned.
        unsafe {
            [
                ld_shared_v2_u32(at(t)),
                ld_shared_v2_u32(at(t + 4)),
                ld_shared_v2_u32(at(t + 8)),
                ld_shared_v2_u32(at(t + 12)),
            ]
        }
    }

    #[inline(always)]
    fn value_fragments<E: CodeElement>(rows: &Self::ValueRows, w: usize) -> ([u32; 4], [u32; 4]) {
        // Dimensions 16 r + 4 w .. + 4 are bytes 2 (w % 2), 2 (w % 2) + 1 of word w / 2: those of
        // rows (t, t + 8) and of (t + 4, t + 12) side by side, so a nibble pair is one key pair.
        let (x, high) = (w / 2, w % 2 == 1);
        let pair = |a: u32, b: u32| {
            if high {
                byte_perm::<0x7632>(a, b)
            } else {
                byte_perm::<0x5410>(a, b)
            }
        };
        let (z08, z4c) = (pair(rows[0][x], rows[2][x]), pair(rows[1][x], rows[3][x]));
        (
            [
                E::nibbles_lo(z08),
                E::nibbles_hi(z08),
                E::nibbles_lo(z4c),
                E::nibbles_hi(z4c),
            ],
            [
                E::nibbles_lo(z08 >> 8),
                E::nibbles_hi(z08 >> 8),
                E::nibbles_lo(z4c >> 8),
                E::nibbles_hi(z4c >> 8),
            ],
        )
    }
}

const _: () = assert!(Int8Codes::ROW_CHUNKS == 8 && Int4Codes::ROW_CHUNKS == 4);

/// Where logical chunk `c` of INT8 code row `r` of a tile sits in its 128-byte row (see
/// [`Int8Codes`]).
#[inline(always)]
pub const fn chunk_at(r: u32, c: u32) -> u32 {
    c ^ ((2 * (r % 4)) ^ (r % 2))
}

/// Shared address of logical chunk `c` of row `r` of a code tile of format `F` at `tile`.
#[inline(always)]
fn tile_chunk<F: CodeFormat>(tile: u32, r: u32, c: u32) -> u32 {
    tile + r * F::ROW_BYTES + 16 * F::chunk_at(r, c)
}

/// One stage of a warp's ring of format `F`: K codes, V codes, K row words, V row words.
struct Stage<F> {
    base: u32,
    format: PhantomData<F>,
}

impl<F> Clone for Stage<F> {
    #[inline(always)]
    fn clone(&self) -> Self {
        *self
    }
}

impl<F> Copy for Stage<F> {}

impl<F: CodeFormat> Stage<F> {
    /// Warp `warp`'s stage `stage`.
    #[inline(always)]
    fn of(warp: u32, stage: u32) -> Self {
        Self {
            base: shared_addr(dynamic_smem::<u8>(0)) + (warp * F::STAGES + stage) * F::STAGE_BYTES,
            format: PhantomData,
        }
    }

    /// The K code tile; the V tile follows it.
    #[inline(always)]
    fn codes(self, is_v: bool) -> u32 {
        self.base + if is_v { F::TILE_BYTES } else { 0 }
    }

    /// The 16 row words of the K (or V) tile.
    #[inline(always)]
    fn words(self, is_v: bool) -> u32 {
        self.base + 2 * F::TILE_BYTES + if is_v { 4 * DECODE_TILE_ROWS } else { 0 }
    }
}

/// Where a pair's coded rows are: the pool's or the store's code and word buffers.
#[derive(Clone, Copy)]
struct CodedRows {
    k: *const u8,
    v: *const u8,
    k_words: *const u32,
    v_words: *const u32,
}

impl CodedRows {
    #[inline(always)]
    fn of(a: &CodedDecodeArgs, src: &RowSource) -> Self {
        let c = &a.codes;
        if src.is_streaming() {
            Self {
                k: c.k_stream.get(),
                v: c.v_stream.get(),
                k_words: c.k_stream_words.get(),
                v_words: c.v_stream_words.get(),
            }
        } else {
            Self {
                k: c.k_pool.get(),
                v: c.v_pool.get(),
                k_words: c.k_pool_words.get(),
                v_words: c.v_pool_words.get(),
            }
        }
    }

    /// Starts the copies of the tile at element offset `at` (a [`RowSource::tile_offset`]) into
    /// `stage`: rows past `valid_rows` repeat the last row; a tile at or past `offset_end` (a
    /// page past the pool) lands as zeros and reads nothing.
    ///
    /// # Safety
    /// All 32 lanes call it; the stage is not being read; `1 <= valid_rows <= 16` rows exist at
    /// `at` unless `at >= offset_end`.
    #[inline(always)]
    unsafe fn issue<F: CodeFormat>(
        self,
        stage: Stage<F>,
        at: usize,
        offset_end: usize,
        valid_rows: u32,
        lane: u32,
    ) {
        let copied = at < offset_end;
        let at = if copied { at } else { 0 };
        // The row at element offset `at` begins at byte `at * BITS / 8`.
        let first_byte = at / (8 / F::BITS) as usize;
        let policy = l2_evict_first();
        let mut i = 0;
        while i < F::TILE_BYTES / 16 / WARP_SIZE {
            let c = lane + i * WARP_SIZE;
            let (row, chunk) = (c / F::ROW_CHUNKS, c % F::ROW_CHUNKS);
            let from = first_byte + (row.min(valid_rows - 1) * F::ROW_BYTES + 16 * chunk) as usize;
            // SAFETY: the source row exists (or nothing is read: 0 bytes), 16-byte aligned (rows
            // are 64 or 128 bytes); the destination is chunk `chunk` of row `row < 16` of the
            // stage's tiles.
            unsafe {
                let bytes = if copied { 16 } else { 0 };
                cp_async_16_zfill_with_policy(
                    tile_chunk::<F>(stage.codes(false), row, chunk),
                    self.k.add(from),
                    bytes,
                    policy,
                );
                cp_async_16_zfill_with_policy(
                    tile_chunk::<F>(stage.codes(true), row, chunk),
                    self.v.add(from),
                    bytes,
                    policy,
                );
            }
            i += 1;
        }
        // Lanes 0..16 copy the K rows' words, lanes 16..32 the V rows'.
        let (is_v, row) = (lane >= DECODE_TILE_ROWS, lane % DECODE_TILE_ROWS);
        let words = if is_v { self.v_words } else { self.k_words };
        let word = at / D + row.min(valid_rows - 1) as usize;
        // SAFETY: the word of an existing row (or nothing is read), 4-byte aligned; the
        // destination is word `row` of the stage's K (or V) words.
        unsafe {
            cp_async_4_zfill_with_policy(
                stage.words(is_v) + 4 * row,
                words.add(word) as *const u8,
                if copied { 4 } else { 0 },
                policy,
            );
        }
    }
}

/// A row word's scale `s` and its value at the centre code, `m + centre · s` (the offset of a
/// row whose centred codes the tensor cores multiply), as f32.
#[inline(always)]
fn scale_offset<F: CodeFormat>(word: u32) -> (f32, f32) {
    let (s, m) = word_params(word);
    (s, fma(F::CENTRE, s, m))
}

/// One warp's pass, for this lane's heads `2t` and `2t + 1` (index `c`): their softmax states
/// (`l` this lane's keys' share; the 8 lanes of a head sum them at the end), the output
/// accumulators (`Oᵀ`, rows dimensions, columns heads), and the running `Σ p_j o_j` of the value
/// offsets (this lane's share).
struct CodedWarpState {
    softmax: [SoftmaxState; 2],
    o: [FragC; O_TILES],
    v_offset: [f32; 2],
}

/// The group's queries as the `Sᵀ` products take them: f16 fragments in the kernel's dimension
/// order (module docs), whatever the element type, each row scaled by a power of two that puts
/// its largest magnitude in `[2^15, 2^16)` (so every bf16 or f16 value converts exactly, up to
/// the f16 subnormals of values below 2^-29 of the row's largest); the key codes then convert
/// with f16's one `prmt` (or `lop3`) and one `sub.f16x2` per pair instead of bf16's five
/// instructions.
struct Queries {
    /// Row `g < group` is query head `g` of the group (scaled), rows past it zero: registers 0
    /// and 2 are the B fragment of head `lane / 4` for `Sᵀ`.
    frags: [FragA<F16>; K_STEPS],
    /// `Σ_d q_d` of the unscaled queries of this lane's columns, heads `2t` and `2t + 1`.
    sum: [f32; 2],
    /// The inverse of those heads' scales: `q · u = unscale · S'`.
    unscale: [f32; 2],
}

/// Loads the group's queries ([`Queries`]) in format `F`'s dimension order.
///
/// # Safety
/// The whole warp calls it; `q_group` points to `group * D` readable elements, 4-byte aligned.
#[inline(always)]
unsafe fn load_queries<F: CodeFormat, E: MmaElement>(
    q_group: *const u16,
    group: u32,
    lane: u32,
) -> Queries {
    let mut pairs = [0u32; 2 * K_STEPS];
    let (g, t) = (lane / 4, lane % 4);
    if g < group {
        // SAFETY: row `g < group`, elements `32 t .. 32 t + 32 <= D`; pairs 4-byte aligned.
        let row = unsafe { q_group.add(g as usize * D + 32 * t as usize) as *const u32 };
        crate::unroll16!(i in 0..2 * K_STEPS => {
            // SAFETY: pair `i < 16` of the lane's 32 elements.
            pairs[i] = unsafe { *row.add(i) };
        });
    }
    let (mut sum, mut largest) = (0.0f32, 0.0f32);
    crate::unroll16!(i in 0..2 * K_STEPS => {
        let (a, b) = E::unpack2(pairs[i]);
        sum += a + b;
        largest = largest.max(a.abs()).max(b.abs());
    });
    // SAFETY: the whole warp is here.
    let (sum, largest) = unsafe { (quad_sum_f32(sum), quad_max_f32(largest)) };
    let (scale, unscale) = pow2_scale(largest);
    let mut x = [0.0f32; 4 * K_STEPS];
    crate::unroll16!(i in 0..2 * K_STEPS => {
        (x[2 * i], x[2 * i + 1]) = E::unpack2(pairs[i]);
    });
    let mut frags = [FragA::from_regs([0; 4]); K_STEPS];
    crate::unroll8!(kk in 0..K_STEPS => {
        let f16 = |reg: usize| {
            let (a, b) = F::query_elements(kk, reg);
            F16::pack2(x[a] * scale, x[b] * scale)
        };
        frags[kk] = FragA::from_regs([f16(0), 0, f16(1), 0]);
    });
    // This lane's columns are heads 2t and 2t + 1: their sums and scales from the lanes that
    // loaded them (rows 2t, 2t + 1).
    // SAFETY: the whole warp is here.
    let column = |x: f32, c: u32| unsafe { shfl_idx_f32(x, 4 * (2 * t + c)) };
    Queries {
        frags,
        sum: [column(sum, 0), column(sum, 1)],
        unscale: [column(unscale, 0), column(unscale, 1)],
    }
}

/// Adds one landed tile of format `F` to the warp's state.
///
/// # Safety
/// The whole warp calls it, after the stage's wait and a warp barrier; `1 <= valid <= 16`.
#[inline(always)]
unsafe fn attend_tile<F: CodeFormat, E: MmaElement + CodeElement>(
    state: &mut CodedWarpState,
    stage: Stage<F>,
    q: &Queries,
    valid: u32,
    scale_log2: f32,
    lane: u32,
) {
    let (r, t) = (lane / 4, lane % 4);
    // Sᵀ = U_k Qᵀ over this lane's dimensions of key rows r and r + 8.
    // SAFETY: the landed tile (the caller's wait and barrier); r < 8, t < 4.
    let keys = unsafe { F::load_keys(stage.codes(false), r, t) };
    // Two accumulators (even and odd k steps): two dependency chains of 4 products.
    let mut acc = [FragC::default(); 2];
    crate::unroll8!(kk in 0..K_STEPS => {
        let a = FragA::<F16>::from_regs(F::key_fragment(&keys, kk));
        let qf = &q.frags[kk].regs;
        let b = FragB::<F16>::from_regs([qf[0], qf[2]]);
        // SAFETY: the whole warp is here.
        acc[kk % 2] = unsafe { mma_m16n8k16(&a, &b, &acc[kk % 2]) };
    });
    let mut s = FragC::default();
    crate::unroll8!(i in 0..4 => {
        s.regs[i] = acc[0].regs[i] + acc[1].regs[i];
    });
    // The words of keys r and r + 8.
    // SAFETY: words `r`, `r + 8` of the landed stage.
    let (kw, vw) = unsafe {
        let (k, v) = (stage.words(false), stage.words(true));
        (
            [ld_shared_u32(k + 4 * r), ld_shared_u32(k + 4 * (r + 8))],
            [ld_shared_u32(v + 4 * r), ld_shared_u32(v + 4 * (r + 8))],
        )
    };
    // q · k_j = s_j S'_j + o_j Σ q (register 2e + c: key r + 8e, head 2t + c).
    crate::unroll8!(e in 0..2 => {
        let (k_scale, k_offset) = scale_offset::<F>(kw[e]);
        crate::unroll8!(c in 0..2 => {
            let i = 2 * e + c;
            s.regs[i] = fma(k_scale * q.unscale[c], s.regs[i], k_offset * q.sum[c]);
        });
    });
    // SAFETY: every lane is here; `1 <= valid <= 16`.
    let correction =
        unsafe { add_column_tile(&mut state.softmax, &mut s, valid, scale_log2, lane) };
    // P scaled per key by the value scale; Σ p_j o_j of the value offsets.
    let mut v_off = [0.0f32; 2];
    crate::unroll8!(e in 0..2 => {
        let (v_scale, v_offset) = scale_offset::<F>(vw[e]);
        crate::unroll8!(c in 0..2 => {
            let i = 2 * e + c;
            let p = s.regs[i];
            v_off[c] = fma(p, v_offset, v_off[c]);
            s.regs[i] = p * v_scale;
        });
    });
    crate::unroll8!(c in 0..2 => {
        state.v_offset[c] = fma(state.v_offset[c], correction[c], v_off[c]);
    });
    // P'ᵀ as the B operand: lane (r, t) needs head r's keys (t, t + 8) and (t + 4, t + 12), the
    // pairs lanes (t, r / 2) and (t + 4, r / 2) hold in register r % 2.
    let pairs = [
        E::pack2(s.regs[0], s.regs[2]),
        E::pack2(s.regs[1], s.regs[3]),
    ];
    let (from_lo, from_hi) = (4 * t + r / 2, 4 * (t + 4) + r / 2);
    // SAFETY: the whole warp is here.
    let b = unsafe {
        let pick = |from: u32| {
            let (x0, x1) = (shfl_idx_u32(pairs[0], from), shfl_idx_u32(pairs[1], from));
            if r % 2 == 0 {
                x0
            } else {
                x1
            }
        };
        FragB::<E>::from_regs([pick(from_lo), pick(from_hi)])
    };
    // Oᵀ += U_vᵀ P'ᵀ: lane (r, t) reads dimensions 16 r .. 16 r + 16 of value rows t, t + 4,
    // t + 8, t + 12.
    // SAFETY: the landed tile; r < 8, t < 4.
    let values = unsafe { F::load_values(stage.codes(true), r, t) };
    crate::unroll8!(w in 0..4 => {
        let (even, odd) = F::value_fragments::<E>(&values, w);
        let mut accumulate = |i: usize, a: [u32; 4]| {
            let o = &mut state.o[i];
            o.regs[0] *= correction[0];
            o.regs[1] *= correction[1];
            o.regs[2] *= correction[0];
            o.regs[3] *= correction[1];
            // SAFETY: the whole warp is here.
            *o = unsafe { mma_m16n8k16(&FragA::<E>::from_regs(a), &b, o) };
        };
        accumulate(2 * w, even);
        accumulate(2 * w + 1, odd);
    });
}

/// Waits until tile `j`'s copies landed: at most `STAGES - 2` groups committed after it pending.
#[inline(always)]
fn wait_for_tile<F: CodeFormat>() {
    match F::STAGES {
        3 => wait_group::<1>(),
        4 => wait_group::<2>(),
        5 => wait_group::<3>(),
        _ => wait_all(),
    }
}

/// The kernel body for code format `F` and element type `E` (of the queries; the codes' scale
/// and minimum are bf16): a non-appending launch over the cache as it is.
///
/// # Safety
/// Launched with grid `(p.splits, p.batch * p.cache.kv_heads)`, `DECODE_THREADS` threads and
/// `coded_decode_smem_bytes(128, F::BITS)` bytes of dynamic shared memory; `p.cache.paged.head_dim ==
/// 128`; `1 <= p.group <= MAX_GROUP`; every buffer of `a` holds the layout `CodedDecodeArgs`
/// documents; the host inputs as for the 16-bit kernel.
#[inline(always)]
unsafe fn decode_attention_coded<F: CodeFormat, E: MmaElement + CodeElement>(a: &CodedDecodeArgs) {
    let attn = &a.attn;
    let p = &attn.params;
    let (split, pair) = (block_idx_x(), block_idx_y());
    let (b, kv_head) = (pair / p.cache.kv_heads, pair % p.cache.kv_heads);
    // SAFETY: `b < batch`, `kv_head < kv_heads` by the grid; host-validated slot and length.
    let inputs = unsafe { PairInputs::read(attn, b, kv_head, false) };
    // SAFETY: before this thread's first access of anything a kernel before it writes.
    unsafe { crate::sync::overlapped_entry() };
    // SAFETY: the host validated slot, lengths and tables.
    let src = unsafe { RowSource::new(attn, inputs, false) };
    let rows = CodedRows::of(a, &src);

    let tiles = src.tiles();
    let per_split = tiles.div_ceil(p.splits);
    let first = split * per_split;
    let end = if first + per_split < tiles {
        first + per_split
    } else {
        tiles
    };
    let count = end.saturating_sub(first);
    let (warp, lane) = (warp_in_block(), lane());
    let mine = if count > warp {
        (count - warp).div_ceil(WARPS)
    } else {
        0
    };
    let tile = |j: u32| first + warp + j * WARPS;
    let mut state = CodedWarpState {
        softmax: [SoftmaxState::EMPTY; 2],
        o: [FragC::default(); O_TILES],
        v_offset: [0.0; 2],
    };
    // SAFETY: pair (b, kv_head)'s query heads are the `G` consecutive heads from
    // `kv_head * G` of row `b` (as for the 16-bit kernel); the whole warp is here.
    let q = unsafe {
        load_queries::<F, E>(
            attn.q
                .get()
                .add((b * p.strides.q + kv_head * p.group) as usize * D),
            p.group,
            lane,
        )
    };
    if mine > 0 {
        // Where tile `j`'s rows are (for a dense head a page-list read from global memory).
        // SAFETY: `tile(j) < end <= tiles` for `j < mine`.
        let locate = |j: u32| unsafe { src.tile_offset(p, tile(j)) };
        // SAFETY (issue): `at` is `locate(j)`, `j < mine`; stage `j % STAGES` is free (its
        // previous tile was waited for and every lane is past reading it: the warp barrier after
        // each wait).
        let issue = |j: u32, at: usize| unsafe {
            rows.issue::<F>(
                Stage::<F>::of(warp, j % F::STAGES),
                at,
                src.offset_end,
                src.tile_rows(tile(j)),
                lane,
            )
        };
        let mut j = 0;
        while j < F::STAGES - 1 {
            if j < mine {
                issue(j, locate(j));
            }
            commit_group();
            j += 1;
        }
        // The next tile's place is looked up a tile ahead, so the page-list read overlaps a
        // tile's compute instead of stalling the copies' issue (as in the 16-bit kernel).
        let mut next_at = 0;
        if F::STAGES - 1 < mine {
            next_at = locate(F::STAGES - 1);
        }
        let mut j = 0;
        while j < mine {
            // Tile `j`'s group is older than the `STAGES - 2` committed after it.
            wait_for_tile::<F>();
            // SAFETY: the whole warp is here (`mine` is warp-uniform).
            unsafe { sync_warp() };
            let next = j + F::STAGES - 1;
            if next < mine {
                issue(next, next_at);
            }
            commit_group();
            if next + 1 < mine {
                next_at = locate(next + 1);
            }
            // SAFETY: tile `j` landed and every lane passed the barrier.
            unsafe {
                attend_tile::<F, E>(
                    &mut state,
                    Stage::<F>::of(warp, j % F::STAGES),
                    &q,
                    src.tile_rows(tile(j)),
                    p.scale_log2,
                    lane,
                )
            };
            j += 1;
        }
    }
    wait_all();
    // SAFETY: block-uniform.
    unsafe { sync_threads() };
    // Each head's denominator and value-offset sum over its 8 lanes (t, t + 4, ..).
    // SAFETY: every lane of the warp is here.
    let column_sum = |x: f32| unsafe {
        let x = x + shfl_xor_f32(x, 4);
        let x = x + shfl_xor_f32(x, 8);
        x + shfl_xor_f32(x, 16)
    };
    let (r, t) = (lane / 4, lane % 4);
    let heads = [
        SoftmaxState {
            m: state.softmax[0].m,
            l: column_sum(state.softmax[0].l),
        },
        SoftmaxState {
            m: state.softmax[1].m,
            l: column_sum(state.softmax[1].l),
        },
    ];
    let v_offset = [column_sum(state.v_offset[0]), column_sum(state.v_offset[1])];
    let group = p.group;
    // SAFETY: every copy landed and every warp is past its reads (the barrier above); the
    // whole block calls it; the merge area fits the coded stages (`coded_decode_smem_bytes`);
    // each lane stores into its warp's slots of heads `2t + c < group`.
    unsafe {
        super::merge_warps::<D>(
            p,
            attn.part_acc.get(),
            attn.part_ml.get(),
            pair,
            split,
            |area| {
                let mut c = 0;
                while c < 2 {
                    let g = 2 * t + c as u32;
                    if g < group {
                        let at = super::merge_slot::<D>(group, warp, g);
                        if r == 0 {
                            *area.add(at) = heads[c].m;
                            *area.add(at + 1) = heads[c].l;
                        }
                        crate::unroll8!(i in 0..O_TILES => {
                            let d = at + 2 + (16 * r) as usize + 2 * i;
                            *area.add(d) = state.o[i].regs[c] + v_offset[c];
                            *area.add(d + 1) = state.o[i].regs[2 + c] + v_offset[c];
                        });
                    }
                    c += 1;
                }
            },
        )
    };
}

/// Declares the integer-coded decode entry point `$name` for code format `$format` and element
/// type `$elem`.
macro_rules! coded_kernel {
    ($($name:ident: $format:ty, $elem:ty;)*) => {$(
        /// Integer-coded decode attention entry point (see the module docs).
        ///
        /// # Safety
        /// As [`decode_attention_coded`]'s: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $name(a: CodedDecodeArgs) {
            // SAFETY: forwarded launch contract.
            unsafe { decode_attention_coded::<$format, $elem>(&a) }
        }
    )*};
}

coded_kernel! {
    decode_attention_int8_bf16_d128: Int8Codes, Bf16;
    decode_attention_int8_f16_d128: Int8Codes, F16;
    decode_attention_int4_bf16_d128: Int4Codes, Bf16;
    decode_attention_int4_f16_d128: Int4Codes, F16;
}

// The stage area holds the merge area.
const _: () = assert!(
    lserve_abi::decode::decode_merge_bytes(128, lserve_abi::decode::MAX_GROUP)
        <= lserve_abi::decode::coded_decode_smem_bytes(128, 4)
);
