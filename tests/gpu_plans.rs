//! The decode-side plans on the device (`AppendPlan`, `SelectPlan`, `DecodePlan`,
//! `AppendAttendPlan`): a plan made once serves every layer and computes what the one-launch
//! functions compute layer by layer; what a plan checks when made is refused then; a run checks
//! the layer, the tensors and the identities the plan recorded (the batch's cache and tables,
//! the workspace), refusing with a typed error that leaves the cache as it was.
//!
//! Ignored without a GPU (reported as ignored, never passed); `--ignored` runs them, and there a
//! missing GPU is a failure.

mod common;

use common::{gpu, head_pattern};
use half::bf16;
use lserve::config::SparsityConfig;
use lserve::cudarc::driver::CudaSlice;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    append_and_attend, decode_attention, download_selection, fill_random, pool_key_stats,
    select_pages, AppendAttendPlan, AppendLaunch, AppendPlan, DecodeBatch, DecodePlan,
    DecodeWorkspace, DeviceKvCache, GpuContext, KvWritePlan, SelectPlan, SelectWorkspace,
    SelectionState,
};
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId};
use lserve::LserveError;

const LAYERS: usize = 2;
const MAX_BATCH: usize = 2;

/// Two layers of 4 query heads over 2 KV heads, D 64: layer 0 one dense and one streaming head,
/// layer 1 two dense heads (so the layers' launches differ in size); 16-token pages, a 32-token
/// budget, selection past 40 tokens every 4 steps; 2 slots of at most 512 tokens.
fn manager() -> KvCacheManager {
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
    let pattern = head_pattern(g, &[vec![false, true], vec![false, false]]);
    KvCacheManager::new(g, pattern, config, 128, MAX_BATCH, 512).unwrap()
}

/// A cache of `mgr`'s sequences filled with pseudo-random K/V (`seed`) and their statistics.
fn filled_cache(
    gpu: &GpuContext,
    mgr: &KvCacheManager,
    seqs: &[SeqId],
    seed: u64,
) -> DeviceKvCache<bf16> {
    let mut cache = DeviceKvCache::<bf16>::new(gpu, mgr).unwrap();
    cache.fill_random(gpu, seed).unwrap();
    let ranges: Vec<_> = seqs.iter().map(|&s| (s, 0..mgr.len(s).unwrap())).collect();
    let plan = KvWritePlan::new(mgr, &ranges)
        .unwrap()
        .upload(gpu, mgr, &mut cache)
        .unwrap();
    for layer in 0..LAYERS {
        pool_key_stats(gpu, &mut cache, layer, &plan).unwrap();
    }
    cache
}

/// A step's activations for [`MAX_BATCH`] sequences, pseudo-random.
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
    let mut t = Tensors {
        q: s.alloc_zeros(MAX_BATCH * hq * d).unwrap(),
        k: s.alloc_zeros(MAX_BATCH * hkv * d).unwrap(),
        v: s.alloc_zeros(MAX_BATCH * hkv * d).unwrap(),
        out: s.alloc_zeros(MAX_BATCH * hq * d).unwrap(),
    };
    fill_random(gpu, &mut t.q, 11).unwrap();
    fill_random(gpu, &mut t.k, 12).unwrap();
    fill_random(gpu, &mut t.v, 13).unwrap();
    t
}

/// Everything the device cache holds: K/V, statistics, index tables, per layer the held
/// selections and step counters, and the block tables.
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

/// Two sequences past `dynamic_min_len` (they select), the step's token reserved.
fn two_sequences(mgr: &mut KvCacheManager) -> [SeqId; 2] {
    let seqs = [mgr.add_sequence().unwrap(), mgr.add_sequence().unwrap()];
    mgr.reserve(seqs[0], 101).unwrap();
    mgr.reserve(seqs[1], 77).unwrap();
    seqs
}

/// One plan of each kind run over every layer writes what the one-launch functions write layer
/// by layer (selection state, cache, outputs), bit for bit: the plans keep each layer's launch
/// apart (layer 0 and 1 differ in dense heads, so in pairs and splits).
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn plans_over_every_layer_match_the_one_launch_functions() {
    let gpu = gpu();
    let mut mgr = manager();
    let seqs = two_sequences(&mut mgr);
    let g = *mgr.geometry();
    let t = tensors(&gpu, &mgr);
    let (hq, d) = (g.q_heads(), g.head_dim());
    for how in [AppendLaunch::Fused, AppendLaunch::Separate] {
        let mut planned = filled_cache(&gpu, &mgr, &seqs, 5);
        let mut single = filled_cache(&gpu, &mgr, &seqs, 5);
        let mut pb = DecodeBatch::new(&gpu, MAX_BATCH).unwrap();
        let mut sb = DecodeBatch::new(&gpu, MAX_BATCH).unwrap();
        pb.set(&gpu, &mgr, &mut planned, &seqs).unwrap();
        sb.set(&gpu, &mgr, &mut single, &seqs).unwrap();
        let mut sel_p = SelectWorkspace::new(&gpu, &planned, MAX_BATCH).unwrap();
        let mut sel_s = SelectWorkspace::new(&gpu, &single, MAX_BATCH).unwrap();
        let new_ws = || DecodeWorkspace::new(&gpu, MAX_BATCH, g.kv_heads(), g.group(), d).unwrap();
        let (mut att_p, mut att_s) = (new_ws(), new_ws());
        let mut outs_p = Vec::new();
        let mut outs_s = Vec::new();
        let mut out = gpu
            .stream()
            .alloc_zeros::<bf16>(MAX_BATCH * hq * d)
            .unwrap();

        // Planned: the step's append and attention, the selector in between for the second
        // attention (over the cache as it is).
        let step = AppendAttendPlan::new(&gpu, &planned, &pb, &att_p, how).unwrap();
        let select = SelectPlan::new(&gpu, &planned, &pb, &sel_p).unwrap();
        let attend = DecodePlan::new(&gpu, &planned, &pb, &att_p).unwrap();
        for layer in 0..LAYERS {
            step.run(
                &gpu,
                &mut planned,
                layer,
                &t.q,
                &t.k,
                &t.v,
                &mut out,
                &mut att_p,
            )
            .unwrap();
            outs_p.push(gpu.stream().clone_dtoh(&out).unwrap());
            select
                .run(&gpu, &mut planned, layer, &t.q, &mut sel_p)
                .unwrap();
            attend
                .run(&gpu, &planned, layer, &t.q, &mut out, &mut att_p)
                .unwrap();
            outs_p.push(gpu.stream().clone_dtoh(&out).unwrap());
        }
        // One launch at a time (the fused placement where `Fused` is asked for; `Auto` fuses
        // these short launches too, `Separate` is the plan's own append kernel).
        for layer in 0..LAYERS {
            if how == AppendLaunch::Separate {
                AppendPlan::new(&gpu, &single, &sb)
                    .unwrap()
                    .run(&gpu, &mut single, layer, &t.k, &t.v)
                    .unwrap();
                decode_attention(&gpu, &single, layer, &sb, &t.q, &mut out, &mut att_s).unwrap();
            } else {
                append_and_attend(
                    &gpu,
                    &mut single,
                    layer,
                    &sb,
                    &t.q,
                    &t.k,
                    &t.v,
                    &mut out,
                    &mut att_s,
                )
                .unwrap();
            }
            outs_s.push(gpu.stream().clone_dtoh(&out).unwrap());
            select_pages(&gpu, &mut single, layer, &sb, &t.q, &mut sel_s).unwrap();
            decode_attention(&gpu, &single, layer, &sb, &t.q, &mut out, &mut att_s).unwrap();
            outs_s.push(gpu.stream().clone_dtoh(&out).unwrap());
        }
        gpu.stream().synchronize().unwrap();
        assert!(outs_p == outs_s, "{how:?}: the outputs differ");
        assert!(
            snapshot(&gpu, &mgr, &planned) == snapshot(&gpu, &mgr, &single),
            "{how:?}: the caches differ"
        );
    }
}

/// What a plan checks when made: an empty batch, a workspace too small for the batch or made
/// for another geometry.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn a_plan_that_cannot_run_is_refused_when_made() {
    let gpu = gpu();
    let mut mgr = manager();
    let seqs = two_sequences(&mut mgr);
    let g = *mgr.geometry();
    let mut cache = filled_cache(&gpu, &mgr, &seqs, 5);
    let mut batch = DecodeBatch::new(&gpu, MAX_BATCH).unwrap();
    let small_sel = SelectWorkspace::new(&gpu, &cache, 1).unwrap();
    let small_att = DecodeWorkspace::new(&gpu, 1, g.kv_heads(), g.group(), 64).unwrap();
    let other_geometry = DecodeWorkspace::new(&gpu, MAX_BATCH, g.kv_heads(), 1, 64).unwrap();
    let att = DecodeWorkspace::new(&gpu, MAX_BATCH, g.kv_heads(), g.group(), 64).unwrap();
    assert!(matches!(
        AppendPlan::new(&gpu, &cache, &batch),
        Err(LserveError::Empty("batch"))
    ));
    assert!(matches!(
        SelectPlan::new(&gpu, &cache, &batch, &small_sel),
        Err(LserveError::Empty("batch"))
    ));
    assert!(matches!(
        DecodePlan::new(&gpu, &cache, &batch, &att),
        Err(LserveError::Empty("batch"))
    ));
    batch.set(&gpu, &mgr, &mut cache, &seqs).unwrap();
    assert!(matches!(
        SelectPlan::new(&gpu, &cache, &batch, &small_sel),
        Err(LserveError::InvalidArgument {
            what: "workspace",
            ..
        })
    ));
    for ws in [&small_att, &other_geometry] {
        assert!(matches!(
            DecodePlan::new(&gpu, &cache, &batch, ws),
            Err(LserveError::InvalidArgument {
                what: "workspace",
                ..
            })
        ));
        assert!(matches!(
            AppendAttendPlan::new(&gpu, &cache, &batch, ws, AppendLaunch::Auto),
            Err(LserveError::InvalidArgument {
                what: "workspace",
                ..
            })
        ));
    }
    gpu.stream().synchronize().unwrap();
}

/// What a run checks: the layer, the tensors, the workspace the plan was made with (a new split
/// limit makes another); each refusal leaves the cache as it was.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn a_run_checks_its_layer_tensors_and_workspace() {
    let gpu = gpu();
    let mut mgr = manager();
    let seqs = two_sequences(&mut mgr);
    let g = *mgr.geometry();
    let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    let mut cache = filled_cache(&gpu, &mgr, &seqs, 5);
    let mut batch = DecodeBatch::new(&gpu, MAX_BATCH).unwrap();
    batch.set(&gpu, &mgr, &mut cache, &seqs).unwrap();
    let mut t = tensors(&gpu, &mgr);
    let s = gpu.stream();
    let short_q = s.alloc_zeros::<bf16>(MAX_BATCH * hq * d - 1).unwrap();
    let short_kv = s.alloc_zeros::<bf16>(MAX_BATCH * hkv * d - 1).unwrap();
    let mut short_out = s.alloc_zeros::<bf16>(MAX_BATCH * hq * d - 1).unwrap();
    let mut sel = SelectWorkspace::new(&gpu, &cache, MAX_BATCH).unwrap();
    let mut other_sel = SelectWorkspace::new(&gpu, &cache, MAX_BATCH).unwrap();
    let mut att = DecodeWorkspace::new(&gpu, MAX_BATCH, hkv, g.group(), d).unwrap();
    let mut other_att = DecodeWorkspace::new(&gpu, MAX_BATCH, hkv, g.group(), d).unwrap();
    let append = AppendPlan::new(&gpu, &cache, &batch).unwrap();
    let select = SelectPlan::new(&gpu, &cache, &batch, &sel).unwrap();
    let attend = DecodePlan::new(&gpu, &cache, &batch, &att).unwrap();
    let step = AppendAttendPlan::new(&gpu, &cache, &batch, &att, AppendLaunch::Auto).unwrap();
    let before = snapshot(&gpu, &mgr, &cache);

    let layer_error = |r: lserve::Result<()>| {
        matches!(r, Err(LserveError::InvalidArgument { what: "layer", .. }))
    };
    assert!(layer_error(
        append.run(&gpu, &mut cache, LAYERS, &t.k, &t.v)
    ));
    assert!(layer_error(
        select.run(&gpu, &mut cache, LAYERS, &t.q, &mut sel)
    ));
    assert!(layer_error(
        select.run_top_k(&gpu, &mut cache, LAYERS, &sel)
    ));
    assert!(layer_error(
        attend.run(&gpu, &cache, LAYERS, &t.q, &mut t.out, &mut att)
    ));
    assert!(layer_error(step.run(
        &gpu, &mut cache, LAYERS, &t.q, &t.k, &t.v, &mut t.out, &mut att
    )));

    let shape_error = |r: lserve::Result<()>, name: &str| matches!(r, Err(LserveError::ShapeMismatch { what, .. }) if what == name);
    assert!(shape_error(
        append.run(&gpu, &mut cache, 0, &short_kv, &t.v),
        "k"
    ));
    assert!(shape_error(
        append.run(&gpu, &mut cache, 0, &t.k, &short_kv),
        "v"
    ));
    assert!(shape_error(
        select.run(&gpu, &mut cache, 0, &short_q, &mut sel),
        "q"
    ));
    assert!(shape_error(
        select.run_score(&gpu, &cache, 0, &short_q, &mut sel),
        "q"
    ));
    assert!(shape_error(
        attend.run(&gpu, &cache, 0, &short_q, &mut t.out, &mut att),
        "q"
    ));
    assert!(shape_error(
        attend.run(&gpu, &cache, 0, &t.q, &mut short_out, &mut att),
        "out"
    ));
    assert!(shape_error(
        step.run(&gpu, &mut cache, 0, &t.q, &short_kv, &t.v, &mut t.out, &mut att),
        "k"
    ));
    assert!(shape_error(
        step.run(
            &gpu,
            &mut cache,
            0,
            &t.q,
            &t.k,
            &t.v,
            &mut short_out,
            &mut att
        ),
        "out"
    ));

    let workspace_error = |r: lserve::Result<()>| {
        matches!(
            r,
            Err(LserveError::InvalidArgument {
                what: "workspace",
                ..
            })
        )
    };
    assert!(workspace_error(select.run(
        &gpu,
        &mut cache,
        0,
        &t.q,
        &mut other_sel
    )));
    assert!(workspace_error(
        select.run_top_k(&gpu, &mut cache, 0, &other_sel)
    ));
    assert!(workspace_error(attend.run(
        &gpu,
        &cache,
        0,
        &t.q,
        &mut t.out,
        &mut other_att
    )));
    assert!(workspace_error(step.run(
        &gpu,
        &mut cache,
        0,
        &t.q,
        &t.k,
        &t.v,
        &mut t.out,
        &mut other_att
    )));
    // A new split limit: the plan was sized for the old one.
    let mut att = att.with_max_splits(1).unwrap();
    assert!(workspace_error(
        attend.run(&gpu, &cache, 0, &t.q, &mut t.out, &mut att)
    ));
    gpu.stream().synchronize().unwrap();
    assert!(
        snapshot(&gpu, &mgr, &cache) == before,
        "a refused run changed the cache"
    );

    // The plans run with what they were made for.
    let mut att = DecodeWorkspace::new(&gpu, MAX_BATCH, hkv, g.group(), d).unwrap();
    let attend = DecodePlan::new(&gpu, &cache, &batch, &att).unwrap();
    append.run(&gpu, &mut cache, 0, &t.k, &t.v).unwrap();
    select.run(&gpu, &mut cache, 0, &t.q, &mut sel).unwrap();
    attend
        .run(&gpu, &cache, 0, &t.q, &mut t.out, &mut att)
        .unwrap();
    gpu.stream().synchronize().unwrap();
}

/// The identities a plan records: run on another cache (made from the same manager), or on its
/// cache after another batch synced it with other tables for a planned slot, every plan is
/// refused with `StaleTables` and both caches stay as they were.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn a_plan_runs_only_on_the_tables_it_was_made_for() {
    let gpu = gpu();
    let mut mgr = manager();
    let seqs = two_sequences(&mut mgr);
    let g = *mgr.geometry();
    let (hkv, d) = (g.kv_heads(), g.head_dim());
    let mut cache = filled_cache(&gpu, &mgr, &seqs, 5);
    let mut other = filled_cache(&gpu, &mgr, &seqs, 6);
    let mut batch = DecodeBatch::new(&gpu, MAX_BATCH).unwrap();
    batch.set(&gpu, &mgr, &mut cache, &seqs).unwrap();
    let mut t = tensors(&gpu, &mgr);
    let mut sel = SelectWorkspace::new(&gpu, &cache, MAX_BATCH).unwrap();
    let mut att = DecodeWorkspace::new(&gpu, MAX_BATCH, hkv, g.group(), d).unwrap();
    let append = AppendPlan::new(&gpu, &cache, &batch).unwrap();
    let select = SelectPlan::new(&gpu, &cache, &batch, &sel).unwrap();
    let attend = DecodePlan::new(&gpu, &cache, &batch, &att).unwrap();
    let step = AppendAttendPlan::new(&gpu, &cache, &batch, &att, AppendLaunch::Auto).unwrap();

    let stale = |r: lserve::Result<()>| matches!(r, Err(LserveError::StaleTables { .. }));
    let mut all_refused = |cache: &mut DeviceKvCache<bf16>, t: &mut Tensors| {
        for layer in 0..LAYERS {
            assert!(stale(append.run(&gpu, cache, layer, &t.k, &t.v)));
            assert!(stale(select.run(&gpu, cache, layer, &t.q, &mut sel)));
            assert!(stale(select.run_score(&gpu, cache, layer, &t.q, &mut sel)));
            assert!(stale(select.run_top_k(&gpu, cache, layer, &sel)));
            assert!(stale(
                attend.run(&gpu, cache, layer, &t.q, &mut t.out, &mut att)
            ));
            assert!(stale(step.run(
                &gpu, cache, layer, &t.q, &t.k, &t.v, &mut t.out, &mut att
            )));
        }
    };
    let theirs = snapshot(&gpu, &mgr, &other);
    all_refused(&mut other, &mut t);
    gpu.stream().synchronize().unwrap();
    assert!(
        snapshot(&gpu, &mgr, &other) == theirs,
        "the other cache changed"
    );

    // The second sequence leaves, a new one takes its slot and another batch syncs the cache.
    mgr.free_sequence(seqs[1]).unwrap();
    let c = mgr.add_sequence().unwrap();
    mgr.reserve(c, 60).unwrap();
    let mut newer = DecodeBatch::new(&gpu, MAX_BATCH).unwrap();
    newer.set(&gpu, &mgr, &mut cache, &[seqs[0], c]).unwrap();
    let ours = snapshot(&gpu, &mgr, &cache);
    all_refused(&mut cache, &mut t);
    gpu.stream().synchronize().unwrap();
    assert!(
        snapshot(&gpu, &mgr, &cache) == ours,
        "a refused run changed the cache"
    );
}
