//! The page scorer: physical-page scores of every (sequence, dense KV head) pair whose selection
//! is due, from the logical-page key statistics.
//!
//! Grid `(chunks, pairs)`, [`SCORE_THREADS`] threads. A *row group* of `D / 8` lanes reads one
//! logical page's statistics row (`kmin` and `kmax`, 16 bytes per lane each: the row is one
//! coalesced run) and scores it for every query head of the group:
//! `S_h(j) = Σ_i max(q_h[i] · kmax_j[i], q_h[i] · kmin_j[i])`. Since `kmax ≥ kmin`, the max is
//! `q⁺ · kmax + q⁻ · kmin` with `q⁺ = max(q, 0)`, `q⁻ = min(q, 0)`: two multiply-adds, no
//! compare, and exactly the product the max would pick. The lane sums meet in a row-group
//! shuffle reduction, the group's heads are aggregated (max or mean), and a row group keeps the
//! max over the logical pages of its unit: a physical page, or with logical-page selection
//! (`SelectionLayout::units_per_page > 1`) the logical page itself. Each row group walks whole
//! units, `chunks * row_groups` apart (a grid-stride loop: any grid covers every unit, so a captured
//! launch stays correct as sequences grow); it issues the loads of up to [`Rows::IN_FLIGHT`]
//! logical pages before using any.
//!
//! What a row group reads is a [`StatRows`]: the 16-bit rows ([`HalfStats`], `score_pages_*`) or
//! their 8-bit codes ([`CodedStats`], `score_pages_q8_*`: one 16-byte load of 8 `kmin` and 8
//! `kmax` codes per lane and the group's `(s, m)` word, half the bytes). With codes, the bound
//! of the dequantized statistics `c · s + m` is `s · (q⁺ · c_hi + q⁻ · c_lo) + m · Σ q` per
//! group of 32 channels: the same two FMAs per (head, channel) on the codes, and one more per
//! head and lane.

use lserve_abi::buffers::STAT_GROUP_CHANNELS;
use lserve_abi::select::{score_offset, selection_due, ScoreArgs, AGGREGATE_MEAN, SCORE_THREADS};

use crate::convert::Half16;
use crate::math::{fma, Vec16};
use crate::pool_page::in_pool;
use crate::thread::{block_idx_x, block_idx_y, grid_dim_x, lane, thread_in_block, WARP_SIZE};
use crate::unroll8;
use crate::warp::group_sum_f32;

/// How head dimension `D` and group size `G` map onto lanes and loads.
pub struct Rows<const D: usize, const G: usize>;

impl<const D: usize, const G: usize> Rows<D, G> {
    /// Lanes reading one statistics row (a row group): 8 elements, 16 bytes each.
    pub const LANES: u32 = (D / 8) as u32;
    /// Row groups per block.
    pub const GROUPS: u32 = SCORE_THREADS / Self::LANES;
    /// Logical pages whose loads a row group issues before computing (fewer for `G = 8`, whose
    /// `q⁺`/`q⁻` already take 128 registers).
    pub const IN_FLIGHT: usize = if G >= 8 { 2 } else { 4 };
}

/// The KV head whose dense index is `dense_head` (the head map lists each KV head's index).
///
/// # Safety
/// `head_map` holds `kv_heads` entries, one of them `dense_head`.
#[inline(always)]
unsafe fn kv_head_of(head_map: *const u32, kv_heads: u32, dense_head: u32) -> u32 {
    let mut h = 0;
    while h < kv_heads {
        // SAFETY: `h < kv_heads`.
        if unsafe { *head_map.add(h as usize) } == dense_head {
            return h;
        }
        h += 1;
    }
    0
}

/// This lane's 8 dimensions of every query head of the group, split by sign, and their sums:
/// `(q⁺, q⁻, Σ q)`.
///
/// # Safety
/// `q` holds `B` rows of `kv_heads * G * D` elements, `q_stride` heads apart, 16-byte aligned;
/// `b < B`, `kv_head < kv_heads`.
#[inline(always)]
unsafe fn query_halves<E: Half16, const D: usize, const G: usize>(
    q: *const u16,
    b: u32,
    kv_head: u32,
    q_stride: u32,
    col: u32,
) -> ([[f32; 8]; G], [[f32; 8]; G], [f32; G]) {
    let mut pos = [[0.0f32; 8]; G];
    let mut neg = [[0.0f32; 8]; G];
    let mut sum = [0.0f32; G];
    unroll8!(g in 0..G => {
        let head = kv_head * G as u32 + g as u32;
        let at = (b * q_stride + head) as usize * D + col as usize * 8;
        // SAFETY: inside `q` by the caller's contract; rows are 16-byte aligned.
        let raw = unsafe { *(q.add(at) as *const Vec16) };
        let x = raw.to_f32::<E>();
        let mut i = 0;
        while i < 8 {
            pos[g][i] = x[i].max(0.0);
            neg[g][i] = x[i].min(0.0);
            sum[g] += x[i];
            i += 1;
        }
    });
    (pos, neg, sum)
}

/// How the scorer reads one lane's 8 channels of a logical page's statistics.
pub trait StatRows {
    /// What one lane loads.
    type Row: Copy;
    /// What it computes with, once per row for all heads.
    type Values: Copy;
    /// A row not loaded (never scored).
    const EMPTY: Self::Row;
    /// Loads the lane's chunk at element offset `at` of the statistics (`stats_row` + `8 col`).
    ///
    /// # Safety
    /// `at` is a chunk of an existing logical page of the layer's statistics.
    unsafe fn load(a: &ScoreArgs, at: usize) -> Self::Row;
    /// The row converted for scoring.
    fn values<E: Half16>(row: Self::Row) -> Self::Values;
    /// This lane's part of one head's bound `Σ max(q·kmax, q·kmin)`, from the head's `q⁺`,
    /// `q⁻` and `Σ q` over the lane's channels.
    fn lane_bound(v: &Self::Values, pos: &[f32; 8], neg: &[f32; 8], sum: f32) -> f32;
}

/// The 16-bit `kmin`/`kmax` rows (`score_pages_*`).
pub struct HalfStats;

impl StatRows for HalfStats {
    type Row = (Vec16, Vec16);
    type Values = ([f32; 8], [f32; 8]);
    const EMPTY: Self::Row = (Vec16([0; 4]), Vec16([0; 4]));

    #[inline(always)]
    unsafe fn load(a: &ScoreArgs, at: usize) -> Self::Row {
        // SAFETY: inside `kmin`/`kmax` (caller); rows are 16-byte aligned.
        unsafe {
            (
                *(a.kmin.get().add(at) as *const Vec16),
                *(a.kmax.get().add(at) as *const Vec16),
            )
        }
    }

    #[inline(always)]
    fn values<E: Half16>(row: Self::Row) -> Self::Values {
        (row.0.to_f32::<E>(), row.1.to_f32::<E>())
    }

    #[inline(always)]
    fn lane_bound(v: &Self::Values, pos: &[f32; 8], neg: &[f32; 8], _sum: f32) -> f32 {
        let (lo, hi) = v;
        let mut s = 0.0f32;
        let mut i = 0;
        while i < 8 {
            // max(q·hi, q·lo) = q⁺·hi + q⁻·lo, as hi ≥ lo (one of the two terms is zero).
            s = fma(pos[i], hi[i], s);
            s = fma(neg[i], lo[i], s);
            i += 1;
        }
        s
    }
}

/// The 8-bit statistics (`lserve_abi::buffers::StatCodesPtrs`, `score_pages_q8_*`).
pub struct CodedStats;

/// Code `j` (byte `j % 4` of `w`) as an f32: the bits `2^23 + c`, less `2^23` (exact).
#[inline(always)]
fn code_f32(w: u32, j: usize) -> f32 {
    f32::from_bits(0x4b00_0000 | ((w >> (8 * (j % 4))) & 0xff)) - 8_388_608.0
}

impl StatRows for CodedStats {
    type Row = (Vec16, u32);
    /// `kmin` codes, `kmax` codes, `s`, `m`.
    type Values = ([f32; 8], [f32; 8], f32, f32);
    const EMPTY: Self::Row = (Vec16([0; 4]), 0);

    #[inline(always)]
    unsafe fn load(a: &ScoreArgs, at: usize) -> Self::Row {
        // SAFETY: the chunk's 16 code bytes start at byte `2 at` (16-byte aligned) and its
        // group's word is word `at / 32` (`StatCodesPtrs`), inside the plane (caller).
        unsafe {
            (
                *(a.stat_codes.codes.get().add(2 * at) as *const Vec16),
                *a.stat_codes
                    .words
                    .get()
                    .add(at / STAT_GROUP_CHANNELS as usize),
            )
        }
    }

    #[inline(always)]
    fn values<E: Half16>(row: Self::Row) -> Self::Values {
        let (codes, word) = row;
        let mut lo = [0.0f32; 8];
        let mut hi = [0.0f32; 8];
        unroll8!(j in 0..8 => {
            lo[j] = code_f32(codes.0[j / 4], j);
            hi[j] = code_f32(codes.0[2 + j / 4], j);
        });
        let (s, m) = (
            f32::from_bits(word << 16),
            f32::from_bits(word & 0xffff_0000),
        );
        (lo, hi, s, m)
    }

    #[inline(always)]
    fn lane_bound(v: &Self::Values, pos: &[f32; 8], neg: &[f32; 8], sum: f32) -> f32 {
        let (lo, hi, s, m) = v;
        let mut c = 0.0f32;
        let mut i = 0;
        while i < 8 {
            // As `HalfStats`' on the codes (the kmax code is at least the kmin code).
            c = fma(pos[i], hi[i], c);
            c = fma(neg[i], lo[i], c);
            i += 1;
        }
        // Σ q⁺ (c_hi s + m) + q⁻ (c_lo s + m) = s · c + m · Σ q.
        fma(c, *s, *m * sum)
    }
}

/// The group-aggregated score of one statistics row slice (this lane's 8 dimensions), reduced
/// over the row group.
///
/// # Safety
/// All 32 lanes call it.
#[inline(always)]
unsafe fn aggregated_score<E: Half16, S: StatRows, const D: usize, const G: usize>(
    q: &([[f32; 8]; G], [[f32; 8]; G], [f32; G]),
    row: S::Row,
    mean: bool,
) -> f32 {
    let (pos, neg, sum) = q;
    let v = S::values::<E>(row);
    let mut total = if mean { 0.0 } else { f32::NEG_INFINITY };
    unroll8!(g in 0..G => {
        let s = S::lane_bound(&v, &pos[g], &neg[g], sum[g]);
        // SAFETY: forwarded: every lane reaches this reduction.
        let s = unsafe { group_sum_f32(s, Rows::<D, G>::LANES) };
        total = if mean { total + s } else { total.max(s) };
    });
    if mean {
        total / G as f32
    } else {
        total
    }
}

/// The scorer body (see the module docs).
///
/// # Safety
/// Launched with grid `(chunks, p.batch * p.cache.paged.heads)` and [`SCORE_THREADS`] threads; the
/// buffers hold the layouts `p` describes, slots and lengths are live, and the block tables
/// hold valid page ids for every page of each sequence.
#[inline(always)]
pub unsafe fn score_pages<E: Half16, S: StatRows, const D: usize, const G: usize>(a: &ScoreArgs) {
    let p = &a.params;
    let pair = block_idx_y();
    let dense_heads = p.cache.paged.heads;
    let (b, dense_head) = (pair / dense_heads, pair % dense_heads);
    // SAFETY: `b < batch` by the grid; the slot is live, so its counters exist.
    let (len, slot) = unsafe {
        (
            *a.batch.seq_len.get().add(b as usize),
            *a.batch.seq_slot.get().add(b as usize),
        )
    };
    let (step, held) = unsafe {
        (
            *a.decode_steps.get().add(slot as usize),
            *a.held_lens
                .get()
                .add((slot * dense_heads + dense_head) as usize),
        )
    };
    if !selection_due(len, p.dynamic_min_len, step, p.reuse_interval, held) {
        return;
    }
    // SAFETY: `dense_head < dense_heads`, so the head map lists it.
    let kv_head = unsafe { kv_head_of(a.head_map.get(), p.cache.kv_heads, dense_head) };

    let lanes = Rows::<D, G>::LANES;
    let col = lane() % lanes;
    // SAFETY: `b < batch`, `kv_head < kv_heads`.
    let q = unsafe { query_halves::<E, D, G>(a.q.get(), b, kv_head, p.strides.q, col) };
    let mean = p.aggregation == AGGREGATE_MEAN;

    // The units scored: physical pages (each the max over its logical pages), or with
    // logical-page selection (`units_per_page = 2^shift > 1`) the logical pages themselves.
    let shift = p.selection.units_per_page.trailing_zeros();
    let per_unit = p.cache.paged.logical_per_page() >> shift; // logical pages per unit
    let logical_rows = len.div_ceil(p.cache.paged.logical_tokens); // logical pages that exist
    let units = len.div_ceil(p.cache.paged.page_tokens >> shift);
    // SAFETY: the slot's block table row.
    let table = unsafe {
        a.block_tables
            .get()
            .add((slot * p.cache.max_pages) as usize)
    };
    // SAFETY: the pair's workspace row.
    let out = unsafe {
        a.scores.get().add(score_offset(
            b,
            dense_head,
            dense_heads,
            p.cache.max_pages << shift,
        ))
    };

    // Units go to row groups `stride` apart. The loop bound is per warp (its first row group's
    // unit), so every lane of a warp runs the same iterations and reaches every shuffle.
    let group = thread_in_block() / lanes;
    let warp_first_group = thread_in_block() / WARP_SIZE * (WARP_SIZE / lanes);
    let stride = grid_dim_x() * Rows::<D, G>::GROUPS;
    let mut unit = block_idx_x() * Rows::<D, G>::GROUPS + group;
    let mut warp_unit = block_idx_x() * Rows::<D, G>::GROUPS + warp_first_group;
    while warp_unit < units {
        let live = unit < units;
        // SAFETY: `unit < units`: its physical page is inside the sequence's block table.
        let physical = if live {
            unsafe { *table.add((unit >> shift) as usize) }
        } else {
            0
        };
        // A block table entry past the pool loads no statistics and scores `-inf`
        // (`crate::pool_page`).
        let stored = live && in_pool(&p.cache.paged, physical);
        // The unit's first logical page: in the sequence, and in its physical page.
        let first_logical = unit * per_unit;
        let in_page = (unit & ((1 << shift) - 1)) * per_unit;
        let stats = p.cache.paged.stats_row(physical, dense_head, in_page) + col as usize * 8;
        let mut best = f32::NEG_INFINITY;
        let mut first = 0;
        while first < per_unit {
            // Issue the loads of up to IN_FLIGHT logical pages, then score them.
            // Eight slots so that `unroll8!`'s statically dead arms index in bounds; only the
            // first IN_FLIGHT are used (registers, no local memory: checked with ptxas).
            let mut rows = [S::EMPTY; 8];
            unroll8!(u in 0..Rows::<D, G>::IN_FLIGHT => {
                let l = first + u as u32;
                if stored && l < per_unit && first_logical + l < logical_rows {
                    // SAFETY: an existing logical page of a page of the sequence.
                    rows[u] = unsafe { S::load(a, stats + l as usize * D) };
                }
            });
            unroll8!(u in 0..Rows::<D, G>::IN_FLIGHT => {
                let l = first + u as u32;
                if l < per_unit {
                    // SAFETY: `l < per_unit` is warp-uniform, so every lane of the warp is here.
                    let s = unsafe { aggregated_score::<E, S, D, G>(&q, rows[u], mean) };
                    if stored && first_logical + l < logical_rows {
                        best = best.max(s);
                    }
                }
            });
            first += Rows::<D, G>::IN_FLIGHT as u32;
        }
        if live && col == 0 {
            // SAFETY: `unit < units <= max_pages << shift`: inside the pair's row.
            unsafe { *out.add(unit as usize) = best };
        }
        unit += stride;
        warp_unit += stride;
    }
}
