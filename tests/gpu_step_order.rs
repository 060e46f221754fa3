//! The orders in which a decode step could be misused, on the device: a reservation that opens
//! a page outside the step, a sequence freed and another added in its slot, step counters
//! advanced on one side only, a planned step run against another cache or a cache that another
//! manager synced since, and a plan that cannot be made. Each is either made harmless by the
//! plan (the tables and counters are brought to the manager's, a slot that changed hands is
//! reset) or refused with a typed error that leaves the cache and the manager as they were;
//! none faults the device (every test synchronizes at its end).
//!
//! Ignored without a GPU (reported as ignored, never passed); `--ignored` runs them, and there a
//! missing GPU is a failure.

mod common;

use common::gpu;
use half::bf16;
use lserve::config::SparsityConfig;
use lserve::cudarc::driver::CudaSlice;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    advance_decode_steps, append_kv, download_selection, DecodeBatch, DecodeStep, DeviceKvCache,
    GpuContext, PlannedStep, SelectionState,
};
use lserve::head_pattern::HeadPattern;
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId};
use lserve::LserveError;

const LAYERS: usize = 2;
const MAX_BATCH: usize = 2;

/// Two layers of 4 query heads over 2 KV heads (one dense, one streaming), D 64; 16-token
/// pages, a 32-token budget, selection past 40 tokens every 4 steps; `capacity` pages, 2 slots
/// of at most 512 tokens.
fn manager(capacity: usize) -> KvCacheManager {
    let g = ModelGeometry::new(LAYERS, 4, 2, 64).unwrap();
    let config = SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 16,
        token_budget: 32,
        sink_tokens: 4,
        local_tokens: 16,
        dynamic_min_len: 40,
        reuse_interval: 4,
        ..SparsityConfig::default()
    };
    let pattern = HeadPattern::interleaved(g, 0.5).unwrap();
    KvCacheManager::new(g, pattern, config, capacity, MAX_BATCH, 512).unwrap()
}

/// A step's activations for up to [`MAX_BATCH`] sequences (zeros: the tests check tables,
/// counters and errors, not values).
struct Tensors {
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
}

fn tensors(gpu: &GpuContext, mgr: &KvCacheManager) -> Tensors {
    let g = *mgr.geometry();
    let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    let s = gpu.stream();
    Tensors {
        q: s.alloc_zeros(MAX_BATCH * hq * d).unwrap(),
        k: s.alloc_zeros(MAX_BATCH * hkv * d).unwrap(),
        v: s.alloc_zeros(MAX_BATCH * hkv * d).unwrap(),
        out: s.alloc_zeros(MAX_BATCH * hq * d).unwrap(),
    }
}

/// Every layer of a planned step.
fn layers(
    plan: &mut PlannedStep<'_>,
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<bf16>,
    t: &mut Tensors,
) -> lserve::Result<()> {
    for layer in 0..LAYERS {
        plan.layer(gpu, cache, layer, &t.q, &t.k, &t.v, &mut t.out)?;
    }
    Ok(())
}

/// One whole step of `seqs`: plan, layers, finish.
fn step(
    step: &mut DecodeStep,
    gpu: &GpuContext,
    mgr: &mut KvCacheManager,
    cache: &mut DeviceKvCache<bf16>,
    seqs: &[SeqId],
    t: &mut Tensors,
) {
    let mut plan = step.plan(gpu, mgr, cache, seqs).unwrap();
    layers(&mut plan, gpu, cache, t).unwrap();
    plan.finish(gpu, cache).unwrap();
}

/// Everything the device cache holds: K/V, statistics, index tables, per layer the held
/// selections and step counters, and the block tables (`shapes`: a manager shaped as the
/// cache's).
#[derive(PartialEq)]
struct Snapshot {
    host: HostKvCache<bf16>,
    index: IndexTables,
    selection: Vec<SelectionState>,
    block_tables: Vec<u32>,
}

fn snapshot(gpu: &GpuContext, shapes: &KvCacheManager, cache: &DeviceKvCache<bf16>) -> Snapshot {
    let mut host = HostKvCache::<bf16>::for_manager(shapes).unwrap();
    let mut index = IndexTables::for_manager(shapes).unwrap();
    cache.download(gpu, &mut host, &mut index).unwrap();
    Snapshot {
        host,
        index,
        selection: (0..LAYERS)
            .map(|l| download_selection(gpu, cache, l).unwrap())
            .collect(),
        block_tables: cache.download_block_tables(gpu).unwrap(),
    }
}

/// The device's step counter of `seq`'s slot.
fn device_step(
    gpu: &GpuContext,
    mgr: &KvCacheManager,
    cache: &DeviceKvCache<bf16>,
    seq: SeqId,
) -> u32 {
    download_selection(gpu, cache, 0).unwrap().decode_steps[mgr.slot(seq).unwrap() as usize]
}

/// Pages held by `slot`'s dense head (layer 0 has one dense head).
fn held_len(gpu: &GpuContext, cache: &DeviceKvCache<bf16>, slot: u32) -> u32 {
    download_selection(gpu, cache, 0).unwrap().held_lens[slot as usize]
}

/// Misuse 1: the engine reserves tokens across a page boundary itself, and no call copies the
/// tables before the step: the plan copies the new entry (the append never writes through a
/// padding page id). A batch set before that copy is refused afterwards, changing nothing.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn a_page_opened_outside_the_step_is_copied_by_the_plan() {
    let gpu = gpu();
    let mut mgr = manager(64);
    let a = mgr.add_sequence().unwrap();
    mgr.reserve(a, 15).unwrap();
    let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr).unwrap();
    let mut t = tensors(&gpu, &mgr);
    let mut ds = DecodeStep::new(&gpu, &cache, MAX_BATCH).unwrap();
    let mut old = DecodeBatch::new(&gpu, MAX_BATCH).unwrap();
    old.set(&gpu, &mgr, &mut cache, &[a]).unwrap();

    mgr.reserve(a, 2).unwrap(); // 17 tokens: page 1 opens, on the host only
    assert_ne!(cache.generation(), mgr.generation());
    assert_ne!(
        cache.download_block_tables(&gpu).unwrap(),
        mgr.device_block_tables().pages
    );
    step(&mut ds, &gpu, &mut mgr, &mut cache, &[a], &mut t);
    assert_eq!(mgr.len(a).unwrap(), 18);
    assert_eq!(cache.generation(), mgr.generation());
    assert_eq!(
        cache.download_block_tables(&gpu).unwrap(),
        mgr.device_block_tables().pages
    );

    // The batch set before the page opened describes rows the cache no longer holds.
    let shapes = mgr.clone();
    let before = snapshot(&gpu, &shapes, &cache);
    assert!(matches!(
        append_kv(&gpu, &mut cache, 0, &old, &t.k, &t.v),
        Err(LserveError::StaleTables { what: "batch", .. })
    ));
    assert!(snapshot(&gpu, &shapes, &cache) == before);
    gpu.stream().synchronize().unwrap();
}

/// Misuse 2: a sequence freed and another added in its slot, with nothing in between: the new
/// sequence's first step sees its own pages only and no held selection of the old owner (it
/// selects, although its counter is not due), and a batch of the old owner is refused.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn free_and_add_never_hands_over_pages_or_selections() {
    let gpu = gpu();
    let mut mgr = manager(64);
    let a = mgr.add_sequence().unwrap();
    mgr.reserve(a, 100).unwrap();
    let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr).unwrap();
    let mut t = tensors(&gpu, &mgr);
    let mut ds = DecodeStep::new(&gpu, &cache, MAX_BATCH).unwrap();
    step(&mut ds, &gpu, &mut mgr, &mut cache, &[a], &mut t); // selects: step 0
    let slot = mgr.slot(a).unwrap();
    assert!(held_len(&gpu, &cache, slot) > 0, "a's step selected");
    let mut old = DecodeBatch::new(&gpu, MAX_BATCH).unwrap();
    old.set(&gpu, &mgr, &mut cache, &[a]).unwrap();

    mgr.free_sequence(a).unwrap();
    let b = mgr.add_sequence().unwrap();
    assert_eq!(mgr.slot(b).unwrap(), slot);
    mgr.reserve(b, 60).unwrap();
    // Step 1 of `b` by its counter: not due; but the slot holds no selection of `b`'s.
    mgr.advance_decode_step(b).unwrap();
    // The plan ends unfinished here (its token stays reserved).
    let tables = {
        let plan = ds.plan(&gpu, &mut mgr, &mut cache, &[b]).unwrap();
        assert!(plan.selects(), "a slot that changed hands selects");
        plan.manager().device_block_tables().pages
    };
    assert_eq!(cache.download_block_tables(&gpu).unwrap(), tables);
    assert_eq!(held_len(&gpu, &cache, slot), 0, "a's selection is gone");
    assert_eq!(
        device_step(&gpu, &mgr, &cache, b),
        1,
        "the manager's counter"
    );

    // The old owner's batch is refused, changing nothing.
    let shapes = mgr.clone();
    let before = snapshot(&gpu, &shapes, &cache);
    assert!(matches!(
        append_kv(&gpu, &mut cache, 0, &old, &t.k, &t.v),
        Err(LserveError::StaleTables { what: "batch", .. })
    ));
    assert!(snapshot(&gpu, &shapes, &cache) == before);

    // `b`'s step runs (its token was reserved by the dropped plan, the next one adds another).
    step(&mut ds, &gpu, &mut mgr, &mut cache, &[b], &mut t);
    assert_eq!(mgr.len(b).unwrap(), 62);
    assert_eq!(mgr.decode_step(b).unwrap(), 2);
    assert!(held_len(&gpu, &cache, slot) > 0, "b's step selected");
    assert_eq!(
        cache.download_block_tables(&gpu).unwrap(),
        mgr.device_block_tables().pages
    );
    gpu.stream().synchronize().unwrap();
}

/// Misuse 3: step counters advanced on one side only. The manager's is the truth: a plan
/// writes it into the device's, so due selections are neither skipped nor repeated.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn the_device_step_counter_follows_the_manager() {
    let gpu = gpu();
    let mut mgr = manager(64);
    let a = mgr.add_sequence().unwrap();
    mgr.reserve(a, 100).unwrap();
    let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr).unwrap();
    let mut t = tensors(&gpu, &mgr);
    let mut ds = DecodeStep::new(&gpu, &cache, MAX_BATCH).unwrap();
    step(&mut ds, &gpu, &mut mgr, &mut cache, &[a], &mut t);
    assert_eq!(mgr.decode_step(a).unwrap(), 1);
    assert_eq!(device_step(&gpu, &mgr, &cache, a), 1, "advanced together");

    // The manager advanced alone (twice): the next plan takes its counter.
    mgr.advance_decode_step(a).unwrap();
    mgr.advance_decode_step(a).unwrap();
    let plan = ds.plan(&gpu, &mut mgr, &mut cache, &[a]).unwrap();
    assert!(!plan.selects(), "step 3 of reuse 4 reuses");
    plan.finish(&gpu, &mut cache).unwrap();
    assert_eq!(mgr.decode_step(a).unwrap(), 4);
    assert_eq!(device_step(&gpu, &mgr, &cache, a), 4);

    // The device advanced alone: the next plan writes the manager's counter back, and the
    // step it names (4: due) selects.
    let mut batch = DecodeBatch::new(&gpu, MAX_BATCH).unwrap();
    batch.set(&gpu, &mgr, &mut cache, &[a]).unwrap();
    advance_decode_steps(&gpu, &mut cache, &batch).unwrap();
    assert_eq!(device_step(&gpu, &mgr, &cache, a), 5);
    let selects = ds.plan(&gpu, &mut mgr, &mut cache, &[a]).unwrap().selects();
    assert!(selects, "step 4 of reuse 4 selects");
    assert_eq!(device_step(&gpu, &mgr, &cache, a), 4);
    gpu.stream().synchronize().unwrap();
}

/// Misuse 4: a step planned against one cache, run against another: every layer and the end
/// are refused before anything is enqueued; neither cache nor the manager's counters change.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn a_step_runs_only_against_the_cache_it_was_planned_for() {
    let gpu = gpu();
    let mut mgr = manager(64);
    let a = mgr.add_sequence().unwrap();
    mgr.reserve(a, 100).unwrap();
    let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr).unwrap();
    let mut other = DeviceKvCache::<bf16>::new(&gpu, &mgr).unwrap();
    let mut t = tensors(&gpu, &mgr);
    let mut ds = DecodeStep::new(&gpu, &cache, MAX_BATCH).unwrap();
    let shapes = mgr.clone();

    let mut plan = ds.plan(&gpu, &mut mgr, &mut cache, &[a]).unwrap();
    let (ours, theirs) = (
        snapshot(&gpu, &shapes, &cache),
        snapshot(&gpu, &shapes, &other),
    );
    for layer in 0..LAYERS {
        assert!(matches!(
            plan.layer(&gpu, &mut other, layer, &t.q, &t.k, &t.v, &mut t.out),
            Err(LserveError::StaleTables { what: "batch", .. })
        ));
    }
    assert!(matches!(
        plan.finish(&gpu, &mut other),
        Err(LserveError::StaleTables { .. })
    ));
    assert!(snapshot(&gpu, &shapes, &cache) == ours);
    assert!(snapshot(&gpu, &shapes, &other) == theirs);
    assert_eq!(
        mgr.decode_step(a).unwrap(),
        0,
        "the refused finish advanced nothing"
    );

    // Planned against the other cache, it runs there.
    step(&mut ds, &gpu, &mut mgr, &mut other, &[a], &mut t);
    assert_eq!(mgr.decode_step(a).unwrap(), 1);
    gpu.stream().synchronize().unwrap();
}

/// Misuse 5: the tables under a planned step change. The planning manager cannot change while
/// the plan holds it (a compile error, `DecodeStep`'s docs); another manager can sync the same
/// cache, after which the plan's layers and end are refused, changing nothing.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn a_step_is_refused_after_its_cache_took_other_tables() {
    let gpu = gpu();
    let mut mgr = manager(64);
    let a = mgr.add_sequence().unwrap();
    mgr.reserve(a, 100).unwrap();
    let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr).unwrap();
    let mut t = tensors(&gpu, &mgr);
    let mut ds = DecodeStep::new(&gpu, &cache, MAX_BATCH).unwrap();
    let mut intruder = mgr.clone();
    let b = intruder.add_sequence().unwrap();
    intruder.reserve(b, 30).unwrap();
    let shapes = mgr.clone();

    let mut plan = ds.plan(&gpu, &mut mgr, &mut cache, &[a]).unwrap();
    layers(&mut plan, &gpu, &mut cache, &mut t).unwrap();
    let mut batch = DecodeBatch::new(&gpu, MAX_BATCH).unwrap();
    batch.set(&gpu, &intruder, &mut cache, &[b]).unwrap();
    let before = snapshot(&gpu, &shapes, &cache);
    assert!(matches!(
        plan.layer(&gpu, &mut cache, 0, &t.q, &t.k, &t.v, &mut t.out),
        Err(LserveError::StaleTables { what: "batch", .. })
    ));
    assert!(matches!(
        plan.finish(&gpu, &mut cache),
        Err(LserveError::StaleTables { .. })
    ));
    assert!(snapshot(&gpu, &shapes, &cache) == before);
    assert_eq!(mgr.decode_step(a).unwrap(), 0);

    // Planned again, the step brings the cache back to this manager's tables and runs.
    step(&mut ds, &gpu, &mut mgr, &mut cache, &[a], &mut t);
    assert_eq!(
        cache.download_block_tables(&gpu).unwrap(),
        mgr.device_block_tables().pages
    );
    gpu.stream().synchronize().unwrap();
}

/// A plan that cannot be made (the pool lacks a page, an unknown or repeated sequence, too
/// many) changes neither the manager nor the cache.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn a_refused_plan_changes_nothing() {
    let gpu = gpu();
    let mut mgr = manager(2);
    let (a, b) = (mgr.add_sequence().unwrap(), mgr.add_sequence().unwrap());
    mgr.reserve(a, 16).unwrap();
    mgr.reserve(b, 10).unwrap();
    let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr).unwrap();
    let mut ds = DecodeStep::new(&gpu, &cache, MAX_BATCH).unwrap();
    let shapes = mgr.clone();
    let (before_mgr, before) = (mgr.clone(), snapshot(&gpu, &shapes, &cache));
    // `a` needs a third page.
    assert!(matches!(
        ds.plan(&gpu, &mut mgr, &mut cache, &[b, a]).map(|_| ()),
        Err(LserveError::PoolExhausted { .. })
    ));
    assert!(matches!(
        ds.plan(&gpu, &mut mgr, &mut cache, &[b, b]).map(|_| ()),
        Err(LserveError::InvalidArgument { .. })
    ));
    assert!(matches!(
        ds.plan(&gpu, &mut mgr, &mut cache, &[]).map(|_| ()),
        Err(LserveError::Empty(_))
    ));
    assert_eq!(mgr, before_mgr);
    assert!(snapshot(&gpu, &shapes, &cache) == before);
    // `b` alone fits.
    let plan = ds.plan(&gpu, &mut mgr, &mut cache, &[b]).unwrap();
    assert_eq!(plan.manager().len(b).unwrap(), 11);
    gpu.stream().synchronize().unwrap();
}
