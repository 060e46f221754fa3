//! Isolation on the device (`docs/ARCHITECTURE.md`, "Isolation on the device"): device tables
//! corrupted behind the host's back (`lserve::gpu::overwrite_device_table`, after a valid
//! upload) with page ids past the pool (`u32::MAX`, the pool's page count) or lengths past their
//! entries never make a kernel fail or touch another sequence's pages, and the host refuses to
//! upload an index table that lists another sequence's page.
//!
//! Two sequences, `A` (corrupted) and `B`, share a pool with interleaved pages; KV head 0 is
//! dense, head 1 streaming (one query head each). Each test runs the operation once on clean
//! tables and once on corrupted ones and checks: no CUDA error; `B`'s output (and `A`'s streaming
//! head's) equal to the clean run's bit for bit; `A`'s dense output equal (within the
//! reference tolerance) to attention over `A`'s own rows with each page past the pool read as
//! zero rows (what the kernels make of it: `lserve_kernels::pool_page`); the pool's pages other
//! than the ones written through valid entries unchanged. Meant to run under
//! `compute-sanitizer --tool memcheck` as well (0 errors expected).
//!
//! Ignored without a GPU (reported as ignored, never passed); `--ignored` runs them, and there a
//! missing GPU is a failure.

mod common;

use common::{gpu, head_pattern, layer_arrays, random_vec, tolerance};
use half::bf16;
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    append_kv, decode_attention, download_selection, overwrite_device_table, pool_key_stats,
    select_pages, write_kv_rows, AppendAttendPlan, AppendLaunch, DecodeBatch, DecodeWorkspace,
    DeviceKvCache, DeviceTable, GpuContext, KvWritePlan, SelectWorkspace, SelectionState,
};
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId, PAD_PAGE};
use lserve::reference::decode::attend_rows;
use lserve::reference::kv_write::write_tokens;
use lserve::LserveError;
use rand::rngs::StdRng;
use rand::SeedableRng;

type E = bf16;

const D: usize = 64;
const HKV: usize = 2;
const PAGE: usize = 16;
/// Prompt lengths of `A` and `B`.
const PROMPTS: [usize; 2] = [70, 50];
/// The ids past the pool each test tries (`capacity` stands for the pool's page count).
const PAST_POOL: [Bad; 2] = [Bad::Max, Bad::Capacity];

#[derive(Clone, Copy, Debug)]
enum Bad {
    Max,
    Capacity,
}

impl Bad {
    fn id(self, w: &World) -> u32 {
        match self {
            Bad::Max => u32::MAX,
            Bad::Capacity => w.capacity,
        }
    }
}

/// The model, the manager with `A` and `B` prompted, and the host cache holding their rows.
struct World {
    mgr: KvCacheManager,
    host: HostKvCache<E>,
    seqs: [SeqId; 2],
    /// Each sequence's prompt K and V, `[tokens][HKV][D]`.
    prompt_kv: [(Vec<E>, Vec<E>); 2],
    capacity: u32,
    rng: StdRng,
}

/// `dynamic_min_len` decides what the attention reads: past the lengths, every page from the
/// block table; below them, the index tables.
fn world(dynamic_min_len: usize, seed: u64) -> World {
    let mut rng = StdRng::seed_from_u64(seed);
    let geometry = ModelGeometry::new(1, HKV, HKV, D).unwrap();
    let pattern = head_pattern(geometry, &[vec![false, true]]);
    let config = SparsityConfig {
        sink_tokens: 4,
        local_tokens: 16,
        page_tokens: PAGE,
        logical_page_tokens: PAGE / 2,
        token_budget: 2 * PAGE,
        reuse_interval: 4,
        dynamic_min_len,
        always_include_first_page: true,
        ..SparsityConfig::default()
    };
    let max_len = 96;
    let capacity = 2 * max_len / PAGE + 3;
    let mut mgr = KvCacheManager::new(geometry, pattern, config, capacity, 2, max_len).unwrap();
    let mut host = HostKvCache::<E>::for_manager(&mgr).unwrap();
    let seqs = [mgr.add_sequence().unwrap(), mgr.add_sequence().unwrap()];
    let row = HKV * D;
    let prompt_kv = PROMPTS.map(|n| {
        (
            random_vec::<E>(&mut rng, n * row),
            random_vec(&mut rng, n * row),
        )
    });
    // Interleaved reservations: the sequences' pages alternate in the pool.
    let mut done = [0usize; 2];
    while done != PROMPTS {
        for b in 0..2 {
            let n = PAGE.min(PROMPTS[b] - done[b]);
            if n == 0 {
                continue;
            }
            let range = mgr.reserve(seqs[b], n).unwrap();
            let view = mgr.view(seqs[b]).unwrap();
            let (k, v) = &prompt_kv[b];
            write_tokens(
                &mut host,
                0,
                &view,
                range.start,
                &k[range.start * row..range.end * row],
                &v[range.start * row..range.end * row],
            )
            .unwrap();
            done[b] += n;
        }
    }
    World {
        mgr,
        host,
        seqs,
        prompt_kv,
        capacity: capacity as u32,
        rng,
    }
}

impl World {
    fn slot(&self, b: usize) -> u32 {
        self.mgr.slot(self.seqs[b]).unwrap()
    }

    fn page(&self, b: usize, logical: usize) -> u32 {
        self.mgr.block_table(self.seqs[b]).unwrap().pages()[logical]
    }

    fn len(&self, b: usize) -> usize {
        self.mgr.len(self.seqs[b]).unwrap()
    }

    /// The index of `A`'s block-table entry for logical page `logical`.
    fn table_at(&self, logical: usize) -> usize {
        self.slot(0) as usize * self.mgr.max_pages_per_seq() + logical
    }

    fn upload(&self, gpu: &GpuContext, tables: &IndexTables) -> DeviceKvCache<E> {
        DeviceKvCache::upload(gpu, &self.mgr, &self.host, tables).unwrap()
    }

    fn batch(&self, gpu: &GpuContext, cache: &mut DeviceKvCache<E>) -> DecodeBatch {
        let mut batch = DecodeBatch::new(gpu, 2).unwrap();
        batch.set(gpu, &self.mgr, cache, &self.seqs).unwrap();
        batch
    }

    /// The dense head's rows of physical page `page`, `rows` of them, from the host cache
    /// (`None`: a page past the pool, zero rows).
    fn page_rows(&self, page: Option<u32>, rows: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
        let dense = self.host.dense(0).unwrap();
        (0..rows)
            .map(|t| match page {
                Some(p) => (
                    to_f32(dense.key(p, 0, t).unwrap()),
                    to_f32(dense.value(p, 0, t).unwrap()),
                ),
                None => (vec![0.0; D], vec![0.0; D]),
            })
            .collect()
    }
}

fn to_f32(x: &[E]) -> Vec<f32> {
    x.iter().map(|e| e.to_f32()).collect()
}

fn softmax_scale(w: &World) -> f64 {
    w.mgr.config().softmax_scale_for(D) as f64
}

/// Query head `head`'s output row of sequence `b` in a `[2][HKV][D]` output.
fn out_row(out: &[E], b: usize, head: usize) -> &[E] {
    &out[(b * HKV + head) * D..(b * HKV + head + 1) * D]
}

/// Checks the run on corrupted tables against the clean one: `B` (both heads) and `A`'s
/// streaming head bit for bit, `A`'s dense head against attention over `rows`.
fn check_outputs(
    w: &World,
    q: &[E],
    clean: &[E],
    got: &[E],
    rows: &[(Vec<f32>, Vec<f32>)],
    what: &str,
) {
    assert_eq!(
        out_row(got, 1, 0),
        out_row(clean, 1, 0),
        "{what}: B's dense head changed"
    );
    assert_eq!(
        out_row(got, 1, 1),
        out_row(clean, 1, 1),
        "{what}: B's streaming head changed"
    );
    assert_eq!(
        out_row(got, 0, 1),
        out_row(clean, 0, 1),
        "{what}: A's streaming head changed"
    );
    let keys: Vec<&[f32]> = rows.iter().map(|(k, _)| k.as_slice()).collect();
    let values: Vec<&[f32]> = rows.iter().map(|(_, v)| v.as_slice()).collect();
    let want = attend_rows(&to_f32(out_row(q, 0, 0)), &keys, &values, softmax_scale(w)).out;
    let got = to_f32(out_row(got, 0, 0));
    let err: f64 = want
        .iter()
        .zip(&got)
        .map(|(&r, &g)| (r - g as f64).powi(2))
        .sum::<f64>()
        .sqrt()
        / want.iter().map(|r| r * r).sum::<f64>().sqrt().max(1e-30);
    assert!(
        err < tolerance::<E>(),
        "{what}: A's dense head is {err:.3e} from attention over its own rows"
    );
}

fn attend(
    gpu: &GpuContext,
    w: &World,
    cache: &DeviceKvCache<E>,
    batch: &DecodeBatch,
    q: &[E],
) -> Vec<E> {
    let stream = gpu.stream();
    let q_dev = stream.clone_htod(q).unwrap();
    let mut out = stream
        .clone_htod(&vec![E::from_f32(f32::NAN); 2 * HKV * D])
        .unwrap();
    let mut ws = DecodeWorkspace::new(gpu, 2, HKV, 1, D).unwrap();
    decode_attention(gpu, cache, 0, batch, &q_dev, &mut out, &mut ws).unwrap();
    let _ = w;
    stream.clone_dtoh(&out).unwrap()
}

fn overwrite(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    table: DeviceTable,
    at: usize,
    words: &[u32],
) {
    overwrite_device_table(gpu, cache, table, at, words).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn block_table_pages_past_the_pool_read_as_zero_rows() {
    let gpu = gpu();
    let mut w = world(1024, 1); // dense decode: every page from the block table
    let tables = IndexTables::for_manager(&w.mgr).unwrap();
    let q = random_vec::<E>(&mut w.rng, 2 * HKV * D);
    let mut cache = w.upload(&gpu, &tables);
    let batch = w.batch(&gpu, &mut cache);
    let clean = attend(&gpu, &w, &cache, &batch, &q);
    let (len, pages) = (w.len(0), w.len(0).div_ceil(PAGE));
    let rows_of = |bad_page: Option<usize>| -> Vec<(Vec<f32>, Vec<f32>)> {
        (0..pages)
            .flat_map(|j| {
                let rows = PAGE.min(len - j * PAGE);
                w.page_rows((Some(j) != bad_page).then(|| w.page(0, j)), rows)
            })
            .collect()
    };
    check_outputs(&w, &q, &clean, &clean, &rows_of(None), "clean tables");
    for bad in PAST_POOL {
        for logical in [1, pages - 1] {
            overwrite(
                &gpu,
                &mut cache,
                DeviceTable::BlockTables,
                w.table_at(logical),
                &[bad.id(&w)],
            );
            let got = attend(&gpu, &w, &cache, &batch, &q);
            check_outputs(
                &w,
                &q,
                &clean,
                &got,
                &rows_of(Some(logical)),
                &format!("{bad:?} at page {logical}"),
            );
            overwrite(
                &gpu,
                &mut cache,
                DeviceTable::BlockTables,
                w.table_at(logical),
                &[w.page(0, logical)],
            );
        }
    }
}

/// The append (inside the attention launch, `cp.async` tiles, or before it) through a block
/// table whose newest entry of `A` is past the pool: `A`'s dense row is stored nowhere, every
/// other page (`B`'s, the free ones, `A`'s others) holds what the reference writes.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn appending_through_a_newest_entry_past_the_pool_writes_nothing_of_it() {
    let gpu = gpu();
    for how in [AppendLaunch::Fused, AppendLaunch::Separate] {
        for bad in PAST_POOL {
            let mut w = world(1024, 2);
            let tables = IndexTables::for_manager(&w.mgr).unwrap();
            for b in 0..2 {
                w.mgr.reserve(w.seqs[b], 1).unwrap();
            }
            let q = random_vec::<E>(&mut w.rng, 2 * HKV * D);
            let k = random_vec::<E>(&mut w.rng, 2 * HKV * D);
            let v = random_vec::<E>(&mut w.rng, 2 * HKV * D);
            let run = |corrupt: bool| -> (Vec<E>, HostKvCache<E>) {
                let mut cache = w.upload(&gpu, &tables);
                let batch = w.batch(&gpu, &mut cache);
                if corrupt {
                    let newest = (w.len(0) - 1) / PAGE;
                    overwrite(
                        &gpu,
                        &mut cache,
                        DeviceTable::BlockTables,
                        w.table_at(newest),
                        &[bad.id(&w)],
                    );
                }
                let stream = gpu.stream();
                let (q_dev, k_dev, v_dev) = (
                    stream.clone_htod(&q).unwrap(),
                    stream.clone_htod(&k).unwrap(),
                    stream.clone_htod(&v).unwrap(),
                );
                let mut out = stream
                    .clone_htod(&vec![E::from_f32(f32::NAN); 2 * HKV * D])
                    .unwrap();
                let mut ws = DecodeWorkspace::new(&gpu, 2, HKV, 1, D).unwrap();
                AppendAttendPlan::new(&gpu, &cache, &batch, &ws, how)
                    .unwrap()
                    .run(
                        &gpu, &mut cache, 0, &q_dev, &k_dev, &v_dev, &mut out, &mut ws,
                    )
                    .unwrap();
                let mut host = HostKvCache::<E>::for_manager(&w.mgr).unwrap();
                let mut index = IndexTables::for_manager(&w.mgr).unwrap();
                cache.download(&gpu, &mut host, &mut index).unwrap();
                (stream.clone_dtoh(&out).unwrap(), host)
            };
            let (clean, _) = run(false);
            let (got, after) = run(true);
            let what = format!("{how:?}, {bad:?}");

            // A's dense rows: every page but the newest as stored; the newest reads as zeros,
            // with the new row patched in where the attention appends itself.
            let (len, pages) = (w.len(0), w.len(0).div_ceil(PAGE));
            let mut rows: Vec<(Vec<f32>, Vec<f32>)> = (0..pages - 1)
                .flat_map(|j| w.page_rows(Some(w.page(0, j)), PAGE))
                .collect();
            let fill = len - (pages - 1) * PAGE;
            rows.extend(w.page_rows(None, fill - 1));
            rows.push(match how {
                AppendLaunch::Separate => (vec![0.0; D], vec![0.0; D]),
                _ => (to_f32(&k[..D]), to_f32(&v[..D])),
            });
            check_outputs(&w, &q, &clean, &got, &rows, &what);

            // The dense pool: B's token written, A's nowhere; the streaming store: both.
            let row = HKV * D;
            let mut with_b = w.host.clone();
            let view_b = w.mgr.view(w.seqs[1]).unwrap();
            write_tokens(&mut with_b, 0, &view_b, w.len(1) - 1, &k[row..], &v[row..]).unwrap();
            let mut with_both = with_b.clone();
            let view_a = w.mgr.view(w.seqs[0]).unwrap();
            write_tokens(&mut with_both, 0, &view_a, len - 1, &k[..row], &v[..row]).unwrap();
            // The dense arrays (K, V, kmin, kmax) as `with_b`, the streaming ones as `with_both`.
            let (dense, streaming) = (
                layer_arrays(&after, &with_b, 0),
                layer_arrays(&after, &with_both, 0),
            );
            for (name, got, want) in dense[..4].iter().chain(&streaming[4..]) {
                assert!(got == want, "{what}: {name}");
            }
        }
    }
}

/// Index entries (the attention's page lists past `dynamic_min_len`) with a page past the pool,
/// or a length past the entry: the list stays inside `A`'s entry, whose words past its length
/// are `PAD_PAGE` (read as zero rows).
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn index_entries_past_the_pool_or_their_length_stay_in_the_entry() {
    let gpu = gpu();
    let mut w = world(PAGE, 3);
    let mut tables = IndexTables::for_manager(&w.mgr).unwrap();
    let listed = [w.page(0, 0), w.page(0, 2), w.page(0, 4)];
    tables.set(0, w.slot(0) as usize, 0, &listed).unwrap();
    tables
        .set(0, w.slot(1) as usize, 0, &[w.page(1, 1), w.page(1, 3)])
        .unwrap();
    let cap = tables.layer(0).unwrap().entry_capacity();
    let q = random_vec::<E>(&mut w.rng, 2 * HKV * D);
    let mut cache = w.upload(&gpu, &tables);
    let batch = w.batch(&gpu, &mut cache);
    let clean = attend(&gpu, &w, &cache, &batch, &q);
    let fill = w.len(0) - (w.len(0).div_ceil(PAGE) - 1) * PAGE;
    // The rows of a list: full pages, the last one `fill` rows.
    let rows_of = |list: &[Option<u32>]| -> Vec<(Vec<f32>, Vec<f32>)> {
        let last = list.len() - 1;
        list.iter()
            .enumerate()
            .flat_map(|(i, &p)| w.page_rows(p, if i == last { fill } else { PAGE }))
            .collect()
    };
    check_outputs(
        &w,
        &q,
        &clean,
        &clean,
        &rows_of(&listed.map(Some)),
        "clean tables",
    );
    let entry = w.slot(0) as usize; // one dense head: entry = slot
    for bad in PAST_POOL {
        overwrite(
            &gpu,
            &mut cache,
            DeviceTable::IndexPages(0),
            entry * cap + 1,
            &[bad.id(&w)],
        );
        let got = attend(&gpu, &w, &cache, &batch, &q);
        check_outputs(
            &w,
            &q,
            &clean,
            &got,
            &rows_of(&[Some(listed[0]), None, Some(listed[2])]),
            &format!("{bad:?} listed"),
        );
        overwrite(
            &gpu,
            &mut cache,
            DeviceTable::IndexPages(0),
            entry * cap + 1,
            &[listed[1]],
        );
    }
    for len in [u32::MAX, cap as u32 + 1] {
        overwrite(&gpu, &mut cache, DeviceTable::IndexLens(0), entry, &[len]);
        let got = attend(&gpu, &w, &cache, &batch, &q);
        let mut list: Vec<Option<u32>> = listed.map(Some).to_vec();
        list.resize(cap, None);
        check_outputs(
            &w,
            &q,
            &clean,
            &got,
            &rows_of(&list),
            &format!("entry length {len}"),
        );
    }
}

/// The selection state of slot `slot` (one dense head): held row and length, index entry and
/// length.
fn slot_state(s: &SelectionState, slot: usize) -> (Vec<u32>, u32, Vec<u32>, u32) {
    (
        s.held_pages[slot * s.held_capacity..(slot + 1) * s.held_capacity].to_vec(),
        s.held_lens[slot],
        s.index_pages[slot * s.entry_capacity..(slot + 1) * s.entry_capacity].to_vec(),
        s.index_lens[slot],
    )
}

/// A held length past the entry (memory corruption) makes the append keep nothing in the entry
/// (the append kernel) or keep it within the entry (the attention that appends): no other
/// slot's entry changes.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn held_lengths_past_the_entry_keep_the_append_inside_it() {
    let gpu = gpu();
    let mut w = world(PAGE, 4);
    let mut tables = IndexTables::for_manager(&w.mgr).unwrap();
    tables
        .set(0, w.slot(0) as usize, 0, &[w.page(0, 0), w.page(0, 4)])
        .unwrap();
    tables
        .set(0, w.slot(1) as usize, 0, &[w.page(1, 0), w.page(1, 3)])
        .unwrap();
    let cap = tables.layer(0).unwrap().entry_capacity();
    for b in 0..2 {
        w.mgr.reserve(w.seqs[b], 1).unwrap();
    }
    let q = random_vec::<E>(&mut w.rng, 2 * HKV * D);
    let k = random_vec::<E>(&mut w.rng, 2 * HKV * D);
    let v = random_vec::<E>(&mut w.rng, 2 * HKV * D);
    let (a, b) = (w.slot(0) as usize, w.slot(1) as usize);
    for fused in [false, true] {
        let run = |held: Option<u32>| -> (SelectionState, Vec<E>) {
            let mut cache = w.upload(&gpu, &tables);
            let batch = w.batch(&gpu, &mut cache);
            // Both entries hold a selection (as after a selecting step), A's length maybe bad.
            overwrite(&gpu, &mut cache, DeviceTable::HeldLens(0), b, &[1]);
            overwrite(
                &gpu,
                &mut cache,
                DeviceTable::HeldLens(0),
                a,
                &[held.unwrap_or(1)],
            );
            let stream = gpu.stream();
            let (q_dev, k_dev, v_dev) = (
                stream.clone_htod(&q).unwrap(),
                stream.clone_htod(&k).unwrap(),
                stream.clone_htod(&v).unwrap(),
            );
            let mut out = stream
                .clone_htod(&vec![E::from_f32(0.0); 2 * HKV * D])
                .unwrap();
            if fused {
                let mut ws = DecodeWorkspace::new(&gpu, 2, HKV, 1, D).unwrap();
                AppendAttendPlan::new(&gpu, &cache, &batch, &ws, AppendLaunch::Fused)
                    .unwrap()
                    .run(
                        &gpu, &mut cache, 0, &q_dev, &k_dev, &v_dev, &mut out, &mut ws,
                    )
                    .unwrap();
            } else {
                append_kv(&gpu, &mut cache, 0, &batch, &k_dev, &v_dev).unwrap();
            }
            (
                download_selection(&gpu, &cache, 0).unwrap(),
                stream.clone_dtoh(&out).unwrap(),
            )
        };
        let (clean, clean_out) = run(None);
        for held in [u32::MAX, cap as u32] {
            let (got, got_out) = run(Some(held));
            let what = format!("fused {fused}, held length {held}");
            assert_eq!(
                slot_state(&got, b),
                slot_state(&clean, b),
                "{what}: B's selection state"
            );
            assert_eq!(
                out_row(&got_out, 1, 0),
                out_row(&clean_out, 1, 0),
                "{what}: B's output"
            );
            let (_, _, pages, len) = slot_state(&got, a);
            let uploaded = tables.layer(0).unwrap().pages()[a * cap..(a + 1) * cap].to_vec();
            assert_eq!(pages, uploaded, "{what}: A's entry pages were written");
            let want_len = if fused { cap as u32 } else { 2 };
            assert_eq!(len, want_len, "{what}: A's entry length");
        }
    }
}

/// The selector over a block table with one of `A`'s candidate pages past the pool: `B`'s
/// selection is the clean run's, `A`'s entry lists only `A`'s pages and the bad id.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn selection_over_a_page_past_the_pool_lists_only_the_sequences_pages() {
    let gpu = gpu();
    let mut w = world(PAGE, 5);
    let tables = IndexTables::for_manager(&w.mgr).unwrap();
    let q = random_vec::<E>(&mut w.rng, 2 * HKV * D);
    let (a, b) = (w.slot(0) as usize, w.slot(1) as usize);
    for bad in PAST_POOL {
        let run = |corrupt: bool| -> SelectionState {
            let mut cache = w.upload(&gpu, &tables);
            let batch = w.batch(&gpu, &mut cache);
            if corrupt {
                overwrite(
                    &gpu,
                    &mut cache,
                    DeviceTable::BlockTables,
                    w.table_at(2),
                    &[bad.id(&w)],
                );
            }
            let mut ws = SelectWorkspace::new(&gpu, &cache, 2).unwrap();
            let q_dev = gpu.stream().clone_htod(&q).unwrap();
            select_pages(&gpu, &mut cache, 0, &batch, &q_dev, &mut ws).unwrap();
            download_selection(&gpu, &cache, 0).unwrap()
        };
        let (clean, got) = (run(false), run(true));
        assert_eq!(
            slot_state(&got, b),
            slot_state(&clean, b),
            "{bad:?}: B's selection"
        );
        let (_, _, pages, len) = slot_state(&got, a);
        assert!(len >= 2, "{bad:?}: A selected nothing");
        let own = w.mgr.block_table(w.seqs[0]).unwrap().pages().to_vec();
        for &p in &pages[..len as usize] {
            assert!(
                own.contains(&p) || p == bad.id(&w),
                "{bad:?}: A's entry lists page {p}"
            );
        }
    }
}

/// Prefill's row write and the key-statistics pooling through a block table with one of `A`'s
/// pages past the pool: that page's rows go nowhere; every other page holds what the reference
/// writes (`B`'s, `A`'s others), the free pages stay zero.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn cache_writes_through_a_page_past_the_pool_write_nothing_of_it() {
    let gpu = gpu();
    let w = world(1024, 6);
    let (k, v): (Vec<E>, Vec<E>) = (
        [w.prompt_kv[0].0.clone(), w.prompt_kv[1].0.clone()].concat(),
        [w.prompt_kv[0].1.clone(), w.prompt_kv[1].1.clone()].concat(),
    );
    for bad in PAST_POOL {
        let mut cache = DeviceKvCache::<E>::new(&gpu, &w.mgr).unwrap();
        let ranges = [(w.seqs[0], 0..PROMPTS[0]), (w.seqs[1], 0..PROMPTS[1])];
        let plan = KvWritePlan::new(&w.mgr, &ranges)
            .unwrap()
            .upload(&gpu, &w.mgr, &mut cache)
            .unwrap();
        overwrite(
            &gpu,
            &mut cache,
            DeviceTable::BlockTables,
            w.table_at(1),
            &[bad.id(&w)],
        );
        let stream = gpu.stream();
        let (k_dev, v_dev) = (
            stream.clone_htod(&k).unwrap(),
            stream.clone_htod(&v).unwrap(),
        );
        write_kv_rows(&gpu, &mut cache, 0, &plan, &k_dev, &v_dev).unwrap();
        pool_key_stats(&gpu, &mut cache, 0, &plan).unwrap();
        let mut after = HostKvCache::<E>::for_manager(&w.mgr).unwrap();
        let mut index = IndexTables::for_manager(&w.mgr).unwrap();
        cache.download(&gpu, &mut after, &mut index).unwrap();

        // The reference with A's page 1 as the zeroed cache had it.
        let mut want = w.host.clone();
        let dense = want.dense_mut(0).unwrap();
        let layout = dense.layout();
        let page = w.page(0, 1);
        let (kk, vv, lo, hi) = dense.buffers_mut();
        let rows = layout.kv_row(page, 0, 0)..layout.kv_row(page + 1, 0, 0);
        let stats = layout.stats_row(page, 0, 0)..layout.stats_row(page + 1, 0, 0);
        for buffer in [kk, vv] {
            buffer[rows.clone()].fill(E::from_f32(0.0));
        }
        for buffer in [lo, hi] {
            buffer[stats.clone()].fill(E::from_f32(0.0));
        }
        for (name, got, want) in layer_arrays(&after, &want, 0) {
            assert!(got == want, "{bad:?}: {name}");
        }
    }
}

/// The host refuses index tables that list another sequence's page, or any page in a slot no
/// sequence holds, before anything is allocated (`IndexTables::check_against`; the CPU tests in
/// `isolation_tables.rs` cover every case).
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn an_upload_listing_another_sequences_page_is_refused() {
    let gpu = gpu();
    let w = world(PAGE, 7);
    let mut tables = IndexTables::for_manager(&w.mgr).unwrap();
    tables
        .set(0, w.slot(0) as usize, 0, &[w.page(0, 0), w.page(1, 1)])
        .unwrap();
    let err = DeviceKvCache::upload(&gpu, &w.mgr, &w.host, &tables).err();
    assert!(
        matches!(err, Some(LserveError::PageNotOwned { page, slot }) if page == w.page(1, 1) && slot == w.slot(0)),
        "{err:?}"
    );
}

/// A slot that changes hands keeps nothing of its previous owner's index entries: the sync
/// empties them (lengths 0, pages `PAD_PAGE`), so even a step replayed without the selector it
/// needed reads no page of the previous owner.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn a_slot_that_changes_hands_keeps_no_index_entry() {
    let gpu = gpu();
    let mut w = world(PAGE, 8);
    let mut tables = IndexTables::for_manager(&w.mgr).unwrap();
    let slot = w.slot(0);
    tables
        .set(0, slot as usize, 0, &[w.page(0, 0), w.page(0, 4)])
        .unwrap();
    let mut cache = w.upload(&gpu, &tables);
    w.mgr.free_sequence(w.seqs[0]).unwrap();
    let c = w.mgr.add_sequence().unwrap();
    assert_eq!(
        w.mgr.slot(c).unwrap(),
        slot,
        "the new sequence takes the freed slot"
    );
    w.mgr.reserve(c, 40).unwrap();
    let mut batch = DecodeBatch::new(&gpu, 2).unwrap();
    batch
        .set(&gpu, &w.mgr, &mut cache, &[c, w.seqs[1]])
        .unwrap();
    let s = download_selection(&gpu, &cache, 0).unwrap();
    let (_, held, pages, len) = slot_state(&s, slot as usize);
    assert_eq!((held, len), (0, 0), "the slot's held and index lengths");
    assert!(
        pages.iter().all(|&p| p == PAD_PAGE),
        "the slot's entry: {pages:?}"
    );
}
