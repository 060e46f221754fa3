//! The page scorer: the unit scores (physical pages, or logical pages under logical-page
//! selection) of every (sequence, dense KV head) pair whose selection is due, from the
//! logical-page key statistics.
//!
//! A logical page's bound for query head `h` is `S_h(j) = Σ_i max(q_h[i] · kmax_j[i], q_h[i] ·
//! kmin_j[i])`. Since `kmax ≥ kmin` the max is `q⁺ · kmax + q⁻ · kmin` with `q⁺ = max(q, 0)`,
//! `q⁻ = min(q, 0)`: exactly the product the max would pick, so the bounds of 16 logical pages
//! for the group's heads are one matrix product, `[16 pages] x [kmin | kmax] · [q⁻ ; q⁺] x
//! [heads]`, on the tensor cores (`mma.sync` m16n8k16, f32 accumulation).
//!
//! **Tiles.** Grid `(chunks, pairs)`, [`SCORE_THREADS`] threads. A warp takes a *tile*: 16
//! consecutive logical pages of one pair (the `M` rows), holding whole units
//! ([`score_tile_units`]; a unit longer than 16 logical pages takes several passes). Lane `(g, t)`
//! (`g = lane / 4`, `t = lane % 4`) holds rows `g` and `g + 8` of the `A` operand and, for every
//! *segment* of 32 channels, loads the 16 bytes of its 8 channels `32 i + 8 t ..` of each row
//! (a quad reads a segment's 64 bytes, one coalesced run): the four products of a segment take
//! `kmin`'s pairs (channels `8 t .. +4`, `+4 .. +8`) and then `kmax`'s, and the `B` operand
//! (the group's heads as the `N` columns, [`Queries`]) holds `q⁻` and `q⁺` of the same channels
//! (a sum does not care about the order of its terms). Tiles go to warps `chunks · warps` apart
//! (a grid-stride loop: any grid covers every unit, so a captured launch stays correct as
//! sequences grow).
//!
//! **Rows.** The accumulator holds, per lane, rows `g` and `g + 8` for heads `2t` and `2t + 1`:
//! the group's heads are aggregated over the quad (max or mean), a row that is not a logical
//! page of the sequence (or whose page is past the pool, `crate::pool_page`) scores `-inf`, and
//! lane `u` of the warp takes the max over unit `u`'s rows ([`unit_max`]) and writes it.
//!
//! What a lane reads is a [`StatRows`]: the 16-bit rows ([`HalfStats`], `score_pages_*`: the
//! statistics are the `A` operand as they are, the queries `B` in the same element type) or
//! their 8-bit codes ([`CodedStats`], `score_pages_q8_*`: 16 code bytes per lane and segment, 8
//! `kmin` then 8 `kmax` codes, and the segment's `(s, m)` word; half the bytes). Codes `c` enter
//! the products centred, `u = c - 128` as exact f16, against queries scaled to f16 by a power of
//! two per head; the dequantized bound `s c + m = s u + o` (`o = m + 128 s`) of a segment is
//! `s · (q⁺ · u_hi + q⁻ · u_lo) + o · Σ q`: one accumulator per segment, its scale applied
//! after the products.

use lserve_abi::buffers::STAT_GROUP_CHANNELS;
use lserve_abi::decode::MAX_GROUP;
use lserve_abi::select::{
    score_offset, score_tile_units, selection_due, ScoreArgs, AGGREGATE_MEAN, SCORE_THREADS,
    SCORE_TILE_ROWS,
};

use crate::convert::{word_params, CodeElement, Half16, CODE_CENTRE, F16};
use crate::math::{fma, pow2_scale, Vec16};
use crate::mma::{mma_m16n8k16, FragA, FragB, FragC, MmaElement};
use crate::pool_page::in_pool;
use crate::smem::{dynamic_smem, ld_shared_v2_u32, shared_addr, st_shared_u32};
use crate::sync::sync_threads;
use crate::thread::{block_idx_x, block_idx_y, grid_dim_x, lane, warp_in_block, WARP_SIZE};
use crate::warp::{quad_max_f32, quad_sum_f32, shfl_idx_f32};
use crate::{unroll16, unroll8};

/// Channels of a segment: a quad's four 16-byte chunks of a row, and the 8-bit statistics'
/// group (one `(s, m)` word).
const SEGMENT: usize = STAT_GROUP_CHANNELS as usize;
const _: () = assert!(SEGMENT == 32);
// The group's heads are the 8 columns of one product.
const _: () = assert!(MAX_GROUP <= 8);
/// Segments of a row at the largest head dimension (128).
const MAX_SEGMENTS: usize = 4;
/// Products per segment: `kmin`'s 8 channels of the lane (two pairs each), then `kmax`'s.
const SEGMENT_STEPS: usize = 4;
/// Warps per block.
const WARPS: u32 = SCORE_THREADS / WARP_SIZE;

/// How the scorer reads a lane's share of a logical page's statistics.
pub trait StatRows {
    /// The element type of the products (the statistics' own, or f16 for codes).
    type Mma: MmaElement;
    /// Queries scaled by a power of two per head (codes), or taken as they are.
    const SCALED: bool;
    /// One accumulator per segment (each has its own scale), or one for the whole row.
    const PER_SEGMENT: bool;
    /// What a lane loads of one row and segment.
    type Chunk: Copy;
    /// A chunk not loaded (a row that is not scored).
    const EMPTY: Self::Chunk;
    /// A row's per-segment parameters (the codes' `(s, m)` words).
    type Params: Copy;
    /// Parameters not loaded.
    const NO_PARAMS: Self::Params;

    /// Loads the chunk at element offset `at` of the 16-bit statistics (the lane's 8 channels
    /// of a segment of a row).
    ///
    /// # Safety
    /// `at` is a chunk of an existing logical page of the layer's statistics.
    unsafe fn load<const D: usize>(a: &ScoreArgs, at: usize) -> Self::Chunk;

    /// Loads the parameters of the row at element offset `row`.
    ///
    /// # Safety
    /// `row` is an existing logical page of the layer's statistics.
    unsafe fn load_params<const D: usize>(a: &ScoreArgs, row: usize) -> Self::Params;

    /// The chunk as `A` pairs of [`Self::Mma`]: `kmin`'s channels `(0, 1)`, `(2, 3)`, `(4, 5)`,
    /// `(6, 7)`, then `kmax`'s.
    fn pairs(c: Self::Chunk) -> [u32; 8];

    /// A row's bound for one head from the segments' accumulators `acc`, the head's
    /// `Σ q` per segment and inverse scale.
    fn bound<const D: usize>(
        acc: &[f32; MAX_SEGMENTS],
        p: &Self::Params,
        sum: &[f32; MAX_SEGMENTS],
        unscale: f32,
    ) -> f32;
}

/// The 16-bit `kmin`/`kmax` rows of element type `E` (`score_pages_*`).
pub struct HalfStats<E>(core::marker::PhantomData<E>);

impl<E: MmaElement> StatRows for HalfStats<E> {
    type Mma = E;
    const SCALED: bool = false;
    const PER_SEGMENT: bool = false;
    type Chunk = (Vec16, Vec16);
    const EMPTY: Self::Chunk = (Vec16([0; 4]), Vec16([0; 4]));
    type Params = ();
    const NO_PARAMS: Self::Params = ();

    #[inline(always)]
    unsafe fn load<const D: usize>(a: &ScoreArgs, at: usize) -> Self::Chunk {
        // SAFETY: inside `kmin`/`kmax` (caller); chunks are 16-byte aligned.
        unsafe {
            (
                *(a.kmin.get().add(at) as *const Vec16),
                *(a.kmax.get().add(at) as *const Vec16),
            )
        }
    }

    #[inline(always)]
    unsafe fn load_params<const D: usize>(_: &ScoreArgs, _: usize) {}

    #[inline(always)]
    fn pairs(c: Self::Chunk) -> [u32; 8] {
        let ((lo, hi), mut p) = (c, [0u32; 8]);
        unroll8!(i in 0..4 => {
            p[i] = lo.0[i];
            p[4 + i] = hi.0[i];
        });
        p
    }

    #[inline(always)]
    fn bound<const D: usize>(
        acc: &[f32; MAX_SEGMENTS],
        _: &(),
        _: &[f32; MAX_SEGMENTS],
        _: f32,
    ) -> f32 {
        acc[0]
    }
}

/// The 8-bit statistics (`lserve_abi::buffers::StatCodesPtrs`, `score_pages_q8_*`).
pub struct CodedStats;

impl StatRows for CodedStats {
    type Mma = F16;
    const SCALED: bool = true;
    const PER_SEGMENT: bool = true;
    /// The 8 `kmin` codes, then the 8 `kmax` codes.
    type Chunk = Vec16;
    const EMPTY: Self::Chunk = Vec16([0; 4]);
    /// The `(s, m)` word of each segment.
    type Params = [u32; MAX_SEGMENTS];
    const NO_PARAMS: Self::Params = [0; MAX_SEGMENTS];

    #[inline(always)]
    unsafe fn load<const D: usize>(a: &ScoreArgs, at: usize) -> Self::Chunk {
        // SAFETY: the chunk's 16 code bytes start at byte `2 at` (16-byte aligned), inside the
        // plane (caller).
        unsafe { *(a.stat_codes.codes.get().add(2 * at) as *const Vec16) }
    }

    #[inline(always)]
    unsafe fn load_params<const D: usize>(a: &ScoreArgs, row: usize) -> Self::Params {
        // SAFETY: the row's `D / 32` words start at word `row / 32` (`row` is a multiple of `D`:
        // 16-byte aligned at D 128, 8-byte at D 64), inside the plane (caller).
        let at = unsafe { a.stat_codes.words.get().add(row / SEGMENT) };
        let mut words = Self::NO_PARAMS;
        if D / SEGMENT == 4 {
            // SAFETY: the row's 4 words, 16-byte aligned (above).
            words = unsafe { (*(at as *const Vec16)).0 };
        } else {
            // SAFETY: the row's 2 words, 8-byte aligned (above).
            let pair = unsafe { *(at as *const u64) };
            (words[0], words[1]) = (pair as u32, (pair >> 32) as u32);
        }
        words
    }

    #[inline(always)]
    fn pairs(c: Self::Chunk) -> [u32; 8] {
        let w = c.0;
        [
            F16::codes_lo(w[0]),
            F16::codes_hi(w[0]),
            F16::codes_lo(w[1]),
            F16::codes_hi(w[1]),
            F16::codes_lo(w[2]),
            F16::codes_hi(w[2]),
            F16::codes_lo(w[3]),
            F16::codes_hi(w[3]),
        ]
    }

    #[inline(always)]
    fn bound<const D: usize>(
        acc: &[f32; MAX_SEGMENTS],
        p: &Self::Params,
        sum: &[f32; MAX_SEGMENTS],
        unscale: f32,
    ) -> f32 {
        // Σ_i s_i (q⁺ · u_hi + q⁻ · u_lo)_i + o_i Σ q_i, the products scaled back once; the
        // offset `o = m + 128 s` is the value of the centre code.
        let (mut products, mut offsets) = (0.0, 0.0);
        unroll8!(i in 0..D / SEGMENT => {
            let (s, m) = word_params(p[i]);
            products = fma(s, acc[i], products);
            offsets = fma(fma(CODE_CENTRE, s, m), sum[i], offsets);
        });
        fma(products, unscale, offsets)
    }
}

/// What the scorer keeps of the group's queries: the `B` operand in shared memory
/// ([`store_queries`]), and per lane the terms of its columns (heads `2t`, `2t + 1`) that the
/// codes' bound adds after the products.
struct Queries {
    /// `Σ q` of each segment's channels of heads `2t` and `2t + 1` (unscaled; codes only).
    sum: [[f32; MAX_SEGMENTS]; 2],
    /// The inverse of those heads' scales.
    unscale: [f32; 2],
}

/// Loads the group's queries for statistics `S`, writes the `B` fragments of every product to
/// shared memory (warp 0; [`b_fragment`] reads them) and returns this lane's [`Queries`]. Product
/// `4 i + s` of segment `i` takes head `lane / 4`'s `q⁻` (`s` 0, 1) or `q⁺` (`s` 2, 3) of
/// channels `32 i + 8 t + 4 (s % 2) .. +4`, scaled where the statistics want it; zero for heads
/// past the group. In shared memory the B fragments stay out of the 128 registers a thread has
/// (two blocks an SM): the tile's loads need them.
///
/// # Safety
/// The whole block calls it; `q_group` points to `group * D` readable elements (the group's
/// heads, contiguous), 16-byte aligned; the launch has `lserve_abi::select::score_smem_bytes(D)` bytes of shared
/// memory.
#[inline(always)]
unsafe fn store_queries<E: Half16, S: StatRows, const D: usize>(
    q_group: *const u16,
    group: u32,
    lane: u32,
) -> Queries {
    let (g, t) = (lane / 4, lane % 4);
    let mut x = [[0.0f32; 8]; MAX_SEGMENTS];
    if g < group {
        unroll8!(i in 0..D / SEGMENT => {
            // SAFETY: head `g < group`, channels `32 i + 8 t .. +8 < D`; 16-byte aligned.
            let raw = unsafe {
                *(q_group.add(g as usize * D + i * SEGMENT + 8 * t as usize) as *const Vec16)
            };
            x[i] = raw.to_f32::<E>();
        });
    }
    let (mut scale, mut q) = (
        1.0,
        Queries {
            sum: [[0.0; MAX_SEGMENTS]; 2],
            unscale: [1.0; 2],
        },
    );
    if S::SCALED {
        let mut largest = 0.0f32;
        let mut own = [0.0f32; MAX_SEGMENTS];
        unroll8!(i in 0..D / SEGMENT => {
            unroll8!(j in 0..8 => {
                own[i] += x[i][j];
                largest = largest.max(x[i][j].abs());
            });
            // SAFETY: the whole warp is here.
            own[i] = unsafe { quad_sum_f32(own[i]) };
        });
        // SAFETY: the whole warp is here.
        let own_unscale;
        (scale, own_unscale) = pow2_scale(unsafe { quad_max_f32(largest) });
        // This lane's columns are heads 2t and 2t + 1: from the quads that loaded them.
        // SAFETY: the whole warp is here.
        let column = |x: f32, c: u32| unsafe { shfl_idx_f32(x, 4 * (2 * t + c)) };
        unroll8!(c in 0..2 => {
            q.unscale[c] = column(own_unscale, c as u32);
            unroll8!(i in 0..D / SEGMENT => {
                q.sum[c][i] = column(own[i], c as u32);
            });
        });
    }
    if warp_in_block() == 0 {
        unroll8!(i in 0..D / SEGMENT => {
            unroll8!(s in 0..SEGMENT_STEPS => {
                let part = |j: usize| {
                    let v = x[i][4 * (s % 2) + j];
                    scale * if s < 2 { v.min(0.0) } else { v.max(0.0) }
                };
                let at = b_fragment_addr(SEGMENT_STEPS * i + s, lane);
                // SAFETY: inside the launch's `score_smem_bytes(D)`; only warp 0 writes, before
                // the barrier below.
                unsafe {
                    st_shared_u32(at, S::Mma::pack2(part(0), part(1)));
                    st_shared_u32(at + 4, S::Mma::pack2(part(2), part(3)));
                }
            });
        });
    }
    // SAFETY: the whole block is here (the pair's due test above it is block-uniform).
    unsafe { sync_threads() };
    q
}

/// The shared-window address of lane `lane`'s `B` fragment of product `k` (`[k][lane]`, 8 bytes
/// each: a warp's read of one product is 256 contiguous bytes).
#[inline(always)]
fn b_fragment_addr(k: usize, lane: u32) -> u32 {
    shared_addr(dynamic_smem::<u8>(0)) + (k as u32 * WARP_SIZE + lane) * 8
}

/// Lane `lane`'s `B` fragment of product `k` ([`store_queries`]).
///
/// # Safety
/// After [`store_queries`]; `k < D / 8`.
#[inline(always)]
unsafe fn b_fragment<M: MmaElement>(k: usize, lane: u32) -> FragB<M> {
    // SAFETY: written by `store_queries` before its barrier; 8-byte aligned.
    FragB::from_regs(unsafe { ld_shared_v2_u32(b_fragment_addr(k, lane)) })
}

/// The max over unit `lane`'s rows of the tile (rows `lane · per_unit ..`, or all 16 when a unit
/// is longer), from the row scores `rows` (`rows[0]` row `g`, `rows[1]` row `g + 8`, the same in
/// every lane of quad `g`). Lanes past the tile's units get a value they must not use.
///
/// # Safety
/// The whole warp calls it.
#[inline(always)]
unsafe fn unit_max(rows: [f32; 2], per_unit: u32, lane: u32) -> f32 {
    let (first, end) = if per_unit >= SCORE_TILE_ROWS {
        (0, SCORE_TILE_ROWS)
    } else {
        (lane * per_unit, (lane + 1) * per_unit)
    };
    let mut best = f32::NEG_INFINITY;
    unroll16!(r in 0..16 => {
        // SAFETY: the whole warp is here.
        let v = unsafe { shfl_idx_f32(rows[r / 8], 4 * (r % 8) as u32) };
        if (r as u32) >= first && (r as u32) < end {
            best = best.max(v);
        }
    });
    best
}

/// The scorer body (see the module docs).
///
/// # Safety
/// Launched with grid `(chunks, p.batch * p.cache.paged.heads)`, [`SCORE_THREADS`] threads and
/// `lserve_abi::select::score_smem_bytes(D)` bytes of shared memory; the
/// buffers hold the layouts `p` describes, `1 <= p.group <= MAX_GROUP` (8: the `N` columns of
/// one product), slots and lengths are live, and
/// the block tables hold valid page ids for every page of each sequence.
#[inline(always)]
pub unsafe fn score_pages<E: Half16, S: StatRows, const D: usize>(a: &ScoreArgs) {
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
    let lane = lane();
    let (g, t) = (lane / 4, lane % 4);
    let group = p.group;
    // SAFETY: `b < batch`, `kv_head < kv_heads`: the group's heads of the query row; the whole
    // block is here.
    let q = unsafe {
        let heads = (b * p.strides.q + kv_head * group) as usize;
        store_queries::<E, S, D>(a.q.get().add(heads * D), group, lane)
    };
    let mean = p.aggregation == AGGREGATE_MEAN;

    // The units scored: physical pages (each the max over its logical pages), or with
    // logical-page selection (`units_per_page = 2^shift > 1`) the logical pages themselves.
    let shift = p.selection.units_per_page.trailing_zeros();
    let per_unit = p.cache.paged.logical_per_page() >> shift; // logical pages per unit
    let logical_rows = len.div_ceil(p.cache.paged.logical_tokens); // logical pages that exist
    let units = len.div_ceil(p.cache.paged.page_tokens >> shift);
    let tile_units = score_tile_units(per_unit);
    let passes = per_unit.div_ceil(SCORE_TILE_ROWS);
    // Row `r` of a tile (this lane's `g` and `g + 8`): its unit in the tile and its logical page
    // in the unit (plus `16 · pass`).
    let row_of = |r: u32| {
        if per_unit >= SCORE_TILE_ROWS {
            (0, r)
        } else {
            (r / per_unit, r % per_unit)
        }
    };
    let rows = [row_of(g), row_of(g + 8)];
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

    let tiles = units.div_ceil(tile_units);
    let stride = grid_dim_x() * WARPS;
    let mut tile = block_idx_x() * WARPS + warp_in_block();
    while tile < tiles {
        let first_unit = tile * tile_units;
        let mut best = f32::NEG_INFINITY;
        let mut pass = 0;
        while pass < passes {
            // This lane's two rows: scored or not, and where their statistics are.
            let mut live = [false; 2];
            let mut at = [0usize; 2];
            unroll8!(h in 0..2 => {
                let (in_tile, in_unit) = rows[h];
                let unit = first_unit + in_tile;
                let l = SCORE_TILE_ROWS * pass + in_unit;
                let exists = in_tile < tile_units
                    && l < per_unit
                    && unit < units
                    && unit * per_unit + l < logical_rows;
                // SAFETY: `unit < units`: its physical page is inside the sequence's block table.
                let physical = if exists {
                    unsafe { *table.add((unit >> shift) as usize) }
                } else {
                    0
                };
                // A block table entry past the pool loads no statistics and scores `-inf`
                // (`crate::pool_page`).
                live[h] = exists && in_pool(&p.cache.paged, physical);
                let in_page = (unit & ((1 << shift) - 1)) * per_unit + l;
                at[h] = p.cache.paged.stats_row(physical, dense_head, in_page);
            });
            // Every load of the tile before the first product.
            let mut chunks = [[S::EMPTY; MAX_SEGMENTS]; 2];
            let mut params = [S::NO_PARAMS; 2];
            unroll8!(h in 0..2 => {
                if live[h] {
                    unroll8!(i in 0..D / SEGMENT => {
                        // SAFETY: an existing logical page of a page of the sequence.
                        chunks[h][i] = unsafe {
                            S::load::<D>(a, at[h] + i * SEGMENT + 8 * t as usize)
                        };
                    });
                    // SAFETY: as above.
                    params[h] = unsafe { S::load_params::<D>(a, at[h]) };
                }
            });
            let mut acc = [FragC::default(); MAX_SEGMENTS];
            unroll8!(i in 0..D / SEGMENT => {
                let (top, bottom) = (S::pairs(chunks[0][i]), S::pairs(chunks[1][i]));
                unroll8!(s in 0..SEGMENT_STEPS => {
                    let a_frag = FragA::<S::Mma>::from_regs([
                        top[2 * s],
                        bottom[2 * s],
                        top[2 * s + 1],
                        bottom[2 * s + 1],
                    ]);
                    // SAFETY: after `store_queries`; product `4 i + s < D / 8`.
                    let b_frag = unsafe { b_fragment::<S::Mma>(SEGMENT_STEPS * i + s, lane) };
                    let k = if S::PER_SEGMENT { i } else { 0 };
                    // SAFETY: the whole warp is here (the loop bounds are warp-uniform).
                    acc[k] = unsafe { mma_m16n8k16(&a_frag, &b_frag, &acc[k]) };
                });
            });
            // Row scores, aggregated over the group's heads (columns `2t`, `2t + 1` here).
            let mut scores = [0.0f32; 2];
            unroll8!(h in 0..2 => {
                let mut heads = [0.0f32; 2];
                unroll8!(c in 0..2 => {
                    let mut per_segment = [0.0f32; MAX_SEGMENTS];
                    unroll8!(i in 0..D / SEGMENT => {
                        per_segment[i] = acc[i].regs[2 * h + c];
                    });
                    let v = S::bound::<D>(&per_segment, &params[h], &q.sum[c], q.unscale[c]);
                    let head_live = 2 * t + (c as u32) < group;
                    heads[c] = match (mean, head_live) {
                        (_, true) => v,
                        (true, false) => 0.0,
                        (false, false) => f32::NEG_INFINITY,
                    };
                });
                // SAFETY: the whole warp is here.
                let s = unsafe {
                    if mean {
                        quad_sum_f32(heads[0] + heads[1]) / group as f32
                    } else {
                        quad_max_f32(heads[0].max(heads[1]))
                    }
                };
                scores[h] = if live[h] { s } else { f32::NEG_INFINITY };
            });
            // SAFETY: the whole warp is here.
            best = best.max(unsafe { unit_max(scores, per_unit, lane) });
            pass += 1;
        }
        let unit = first_unit + lane;
        if lane < tile_units && unit < units {
            // SAFETY: `unit < units <= max_pages << shift`: inside the pair's row.
            unsafe { *out.add(unit as usize) = best };
        }
        tile += stride;
    }
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
