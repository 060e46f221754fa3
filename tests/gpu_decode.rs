//! GPU decode attention (`kernels-gpu/src/decode`) against the CPU reference.
//!
//! Each case builds a random paged cache (random head kinds, GQA or MHA, small pages, ragged
//! prompts, physical pages interleaved between sequences), then runs several reference decode
//! steps (append, select when due, attend). After each step the reference's cache and index
//! tables are uploaded, the GPU attends with the same queries into a poisoned output, and the
//! result is compared per (sequence, query head) with the reference by relative error. Rows of
//! the cache that hold no token are infinite, so a kernel that reads past a list's end shows. Whole
//! decode steps (`DecodeStep`: the selector when due, append and attention, the append inside
//! the attention launch or before it) are compared the same way, cache included, eagerly and as
//! captured graphs.
//!
//! Ignored without a GPU (reported as ignored, never passed); `--ignored` runs them, and there a
//! missing GPU is a failure.

mod common;

use common::{
    assert_coded_layer, check_selection, entry_units, f16_or_bf16, gpu, head_pattern, int4, int8,
    random_vec, tolerance, worst_row_error,
};
use half::{bf16, f16};
use lserve::config::{GqaAggregation, SelectionUnit, SparsityConfig};
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    decode_attention, download_selection, read_coded_layer, AppendLaunch, DecodeBatch, DecodePlan,
    DecodeWorkspace, DeviceElement, DeviceKvCache, GpuContext, MAX_SPLITS,
};
use lserve::head_pattern::HeadPattern;
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId};
use lserve::quant::{CodeBits, IntFormat, KvFormat, QuantGroup, StatsFormat};
use lserve::reference::decode::{decode_attention_tables_coded, decode_step, DecodeStepOutput};
use lserve::reference::kv_write::write_tokens;
use lserve::reference::select::ReuseState;
use lserve::LserveError;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
struct Case {
    head_dim: usize,
    kv_heads: usize,
    group: usize,
    streaming: Vec<bool>,
    page_tokens: usize,
    logical_per_page: usize,
    top_k: usize,
    sink: usize,
    local: usize,
    dynamic_min_len: usize,
    reuse: usize,
    prompts: Vec<usize>,
    steps: usize,
    f16: bool,
    /// Selection from 8-bit statistics (`StatsFormat::DEVICE_INT8`).
    q8: bool,
    /// Logical-page selection (`SelectionUnit::LogicalPage`; the logical pages are whole
    /// decode tiles here), else physical pages.
    logical: bool,
    seed: u64,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(64usize), Just(128)],
        1usize..=4,
        // Every GQA group the kernels serve, the non-powers of two included.
        1usize..=ModelGeometry::MAX_GROUP,
    )
        .prop_flat_map(|(head_dim, kv_heads, group)| {
            (
                Just((head_dim, kv_heads, group)),
                prop::collection::vec(any::<bool>(), kv_heads),
                (
                    prop_oneof![Just(16usize), Just(32), Just(64)],
                    prop_oneof![Just(1usize), Just(2), Just(4)],
                ),
                (1usize..=4, 0usize..=24, 1usize..=48),
                (
                    0usize..=400,
                    prop_oneof![Just(1usize), Just(4)],
                    any::<bool>(),
                ),
                (
                    prop::collection::vec(1usize..=600, 1..=5),
                    1usize..=6,
                    any::<bool>(),
                    any::<bool>(),
                    any::<u64>(),
                ),
            )
        })
        .prop_map(
            |(
                (head_dim, kv_heads, group),
                streaming,
                (page_tokens, lpp),
                (top_k, sink, local),
                (min_len, reuse, logical),
                (prompts, steps, f16, q8, seed),
            )| Case {
                head_dim,
                kv_heads,
                group,
                streaming,
                page_tokens,
                logical_per_page: lpp.min(page_tokens / 16).max(1),
                top_k,
                sink,
                local,
                dynamic_min_len: min_len,
                reuse,
                prompts,
                steps,
                f16,
                q8,
                logical,
                seed,
            },
        )
}

impl Case {
    /// This case over a batch of 8 long sequences (64 to 4100 tokens) with 4 KV heads of D 128
    /// (group 4, one streaming), 64-token pages of 4 logical pages, K 8, reuse 2, sinks 64 and
    /// local 256, crossing `dynamic_min_len` 1024; its other fields (element type, statistics,
    /// selection unit) kept.
    fn eight_long_sequences(self, seed: u64) -> Case {
        Case {
            head_dim: 128,
            kv_heads: 4,
            group: 4,
            streaming: vec![false, true, false, false],
            page_tokens: 64,
            logical_per_page: 4,
            top_k: 8,
            sink: 64,
            local: 256,
            dynamic_min_len: 1024,
            reuse: 2,
            prompts: vec![3000, 1500, 900, 4100, 2200, 64, 1025, 2500],
            steps: 6,
            seed,
            ..self
        }
    }
}

/// A case's cache after its prompts, on the host: the state both drivers start from.
struct Prompted<E> {
    rng: StdRng,
    config: SparsityConfig,
    pattern: HeadPattern,
    mgr: KvCacheManager,
    host: HostKvCache<E>,
    tables: IndexTables,
    reuse: ReuseState,
    seqs: Vec<SeqId>,
}

/// Builds the case's one-layer model and cache and writes its prompts (random keys and values,
/// statistics pooled). Prompts grow in interleaved random chunks, so the physical pages of the
/// sequences interleave.
fn prompted<E: DeviceElement>(case: &Case) -> Prompted<E> {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let geometry =
        ModelGeometry::new(1, case.kv_heads * case.group, case.kv_heads, case.head_dim).unwrap();
    let pattern = head_pattern(geometry, std::slice::from_ref(&case.streaming));
    let config = SparsityConfig {
        sink_tokens: case.sink,
        local_tokens: case.local,
        page_tokens: case.page_tokens,
        logical_page_tokens: case.page_tokens / case.logical_per_page,
        token_budget: case.top_k * case.page_tokens,
        reuse_interval: case.reuse,
        dynamic_min_len: case.dynamic_min_len,
        gqa_aggregation: if rng.gen() {
            GqaAggregation::Max
        } else {
            GqaAggregation::Mean
        },
        always_include_first_page: rng.gen(),
        softmax_scale: None,
        stats_format: if case.q8 {
            StatsFormat::DEVICE_INT8
        } else {
            StatsFormat::Half
        },
        selection_unit: if case.logical {
            SelectionUnit::LogicalPage
        } else {
            SelectionUnit::PhysicalPage
        },
    };
    let max_len = case.prompts.iter().max().unwrap() + case.steps;
    let batch = case.prompts.len();
    let capacity = batch * max_len.div_ceil(case.page_tokens) + 3;
    let mut mgr =
        KvCacheManager::new(geometry, pattern.clone(), config, capacity, batch, max_len).unwrap();
    let mut host = HostKvCache::<E>::for_manager(&mgr).unwrap();
    // Rows no token is written to hold infinities: a kernel that lets a row past a list's end
    // reach the output (the tensor-map copies bring whole 16-row tiles) turns it into NaN. The
    // reference reads stored rows only, and infinities compare equal when caches are compared.
    let inf = E::from_f32(f32::INFINITY);
    let (k, v, _, _) = host.dense_mut(0).unwrap().buffers_mut();
    k.fill(inf);
    v.fill(inf);
    let (k, v) = host.streaming_mut(0).unwrap().buffers_mut();
    k.fill(inf);
    v.fill(inf);
    let tables = IndexTables::for_manager(&mgr).unwrap();
    let reuse = ReuseState::new(case.reuse).unwrap();
    let row = geometry.kv_heads() * geometry.head_dim();
    let seqs: Vec<SeqId> = (0..batch).map(|_| mgr.add_sequence().unwrap()).collect();
    let mut left = case.prompts.clone();
    while left.iter().any(|&n| n > 0) {
        let b = rng.gen_range(0..batch);
        if left[b] == 0 {
            continue;
        }
        let n = rng.gen_range(1..=left[b]);
        left[b] -= n;
        let range = mgr.reserve(seqs[b], n).unwrap();
        let view = mgr.view(seqs[b]).unwrap();
        let k = random_vec::<E>(&mut rng, n * row);
        let v = random_vec::<E>(&mut rng, n * row);
        write_tokens(&mut host, 0, &view, range.start, &k, &v).unwrap();
    }
    Prompted {
        rng,
        config,
        pattern,
        mgr,
        host,
        tables,
        reuse,
        seqs,
    }
}

/// One decode step's random inputs and the reference's result on them.
struct Step<E> {
    q: Vec<E>,
    k: Vec<E>,
    v: Vec<E>,
    want: DecodeStepOutput,
}

impl<E: DeviceElement> Prompted<E> {
    /// Reserves the step's token for every sequence, draws the step's queries, keys and values,
    /// and runs the reference decode step on them (layer 0) without advancing the sequences.
    fn reference_step(&mut self) -> Step<E> {
        for &s in &self.seqs {
            self.mgr.reserve(s, 1).unwrap();
        }
        reference_inputs(
            &mut self.rng,
            &self.mgr,
            &mut self.host,
            &mut self.tables,
            &mut self.reuse,
            &self.seqs,
        )
    }
}

/// Draws a step's queries, keys and values and runs the reference decode step on them (layer
/// 0), the step's tokens already reserved in `mgr`, without advancing the sequences.
fn reference_inputs<E: DeviceElement>(
    rng: &mut StdRng,
    mgr: &KvCacheManager,
    host: &mut HostKvCache<E>,
    tables: &mut IndexTables,
    reuse: &mut ReuseState,
    seqs: &[SeqId],
) -> Step<E> {
    let g = *mgr.geometry();
    let (hq, hkv, d, batch) = (g.q_heads(), g.kv_heads(), g.head_dim(), seqs.len());
    let q = random_vec::<E>(rng, batch * hq * d);
    let k = random_vec::<E>(rng, batch * hkv * d);
    let v = random_vec::<E>(rng, batch * hkv * d);
    let want = decode_step(mgr, host, tables, reuse, 0, seqs, &q, &k, &v).unwrap();
    Step { q, k, v, want }
}

fn run_case<E: DeviceElement>(gpu: &GpuContext, case: &Case) -> Result<(), TestCaseError> {
    run_case_with_splits::<E>(gpu, case, MAX_SPLITS, None)
}

/// [`run_case`] with at most `max_splits` splits per pair (long splits take the bulk-copy
/// kernel), over the cache as uploaded (`coded: None`) or an integer-coded copy of it
/// (`DeviceKvCache::upload_coded`; the reference is then the attention over the dequantized
/// rows, on the index tables the reference step left).
fn run_case_with_splits<E: DeviceElement>(
    gpu: &GpuContext,
    case: &Case,
    max_splits: u32,
    coded: Option<IntFormat>,
) -> Result<(), TestCaseError> {
    let mut p = prompted::<E>(case);
    let g = *p.mgr.geometry();
    let (hq, hkv, d, batch) = (g.q_heads(), g.kv_heads(), g.head_dim(), p.seqs.len());

    let mut batch_dev = DecodeBatch::new(gpu, batch).unwrap();
    let mut ws = DecodeWorkspace::new(gpu, batch, hkv, g.group(), d)
        .unwrap()
        .with_max_splits(max_splits)
        .unwrap();
    for step in 0..case.steps {
        let Step { q, want, .. } = p.reference_step();
        for &s in &p.seqs {
            p.mgr.advance_decode_step(s).unwrap();
        }

        let (mut cache, want) = match coded {
            None => (
                DeviceKvCache::upload(gpu, &p.mgr, &p.host, &p.tables).unwrap(),
                want.out,
            ),
            Some(format) => {
                let cache =
                    DeviceKvCache::upload_coded(gpu, &p.mgr, &p.host, &p.tables, format).unwrap();
                prop_assert_eq!(cache.format(), KvFormat::Int(format));
                let (want, _) = decode_attention_tables_coded(
                    &p.mgr, &p.host, &p.tables, 0, &p.seqs, &q, format,
                )
                .unwrap();
                (cache, want)
            }
        };
        batch_dev.set(gpu, &p.mgr, &mut cache, &p.seqs).unwrap();
        let q_dev = gpu.stream().clone_htod(&q).unwrap();
        let mut out = gpu
            .stream()
            .clone_htod(&vec![E::from_f32(f32::NAN); batch * hq * d])
            .unwrap();
        decode_attention(gpu, &cache, 0, &batch_dev, &q_dev, &mut out, &mut ws).unwrap();
        let got: Vec<E> = gpu.stream().clone_dtoh(&out).unwrap();
        let err = worst_row_error(&got, &want, d);
        let tol = tolerance::<E>();
        prop_assert!(
            err < tol,
            "step {step}: worst relative error {err:.3e} (tolerance {tol:.0e})"
        );
    }
    Ok(())
}

proptest! {
    #[test]
    #[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
    fn decode_attention_matches_reference(case in case_strategy()) {
        let gpu = gpu();
        f16_or_bf16!(case.f16, run_case(&gpu, &case))?;
    }
}

/// One 20,000-token sequence of two KV heads, one dense (attending to every page:
/// `dynamic_min_len` above the length) and one streaming, bf16 at D 128: `steps` decode steps
/// from seed `seed`.
fn long_dense_case(steps: usize, seed: u64) -> Case {
    Case {
        head_dim: 128,
        kv_heads: 2,
        group: 4,
        streaming: vec![false, true],
        page_tokens: 64,
        logical_per_page: 4,
        top_k: 8,
        sink: 64,
        local: 256,
        dynamic_min_len: 1 << 20,
        reuse: 1,
        prompts: vec![20_000],
        steps,
        f16: false,
        q8: false,
        logical: false,
        seed,
    }
}

/// A long dense sequence split over many blocks (the split/combine path with many tiles), then in
/// one split per pair (the bulk-copy kernel).
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn long_dense_sequence_uses_many_splits() {
    let gpu = gpu();
    let case = long_dense_case(1, 7);
    run_case::<bf16>(&gpu, &case).unwrap();
    // One split per pair: 20,000 rows are 312 tiles per warp, past the bulk-copy line, so the
    // bulk-copy kernel serves the launch (the short streaming pair too); both element types and
    // head dims.
    run_case_with_splits::<bf16>(&gpu, &case, 1, None).unwrap();
    let case = Case {
        head_dim: 64,
        f16: true,
        ..case
    };
    run_case_with_splits::<f16>(&gpu, &case, 1, None).unwrap();
}

/// The launch that appends, on long splits: one split per pair over a 20,000-token dense
/// sequence puts the attention on the bulk-copy kernel with the append inside
/// (`decode_attention_append_bulk_*`, which `AppendLaunch::Auto` never picks), and the newest row
/// is patched into a stage the tensor memory accelerator filled. Two whole steps against the
/// reference, cache included, for both element types and head dims.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn appending_launch_on_bulk_copied_tiles() {
    let gpu = gpu();
    let case = long_dense_case(2, 11);
    run_steps::<bf16>(&gpu, &case, false, 0, AppendLaunch::Fused, 1, None).unwrap();
    let case = Case {
        head_dim: 64,
        f16: true,
        ..case
    };
    run_steps::<f16>(&gpu, &case, true, 0, AppendLaunch::Fused, 1, None).unwrap();
}

/// Whole decode steps on the device (append, select when due, attend, advance), several in a
/// row with reuse, against the reference decode step. Where the GPU's selection differs from the
/// reference on a near-tie, that step is checked against the reference attending over the GPU's
/// selection, and the case stops there (the two held selections have diverged legitimately).
///
/// With `coded`, the cache is an integer-coded copy of the prompts (`upload_coded`); the step's
/// append then quantizes the token's rows (the layer must hold the reference's cache quantized
/// row by row, and the statistics of the unquantized keys), and the reference output is the
/// attention over the dequantized rows on the reference's selection.
#[allow(clippy::too_many_arguments)]
fn run_steps<E: DeviceElement>(
    gpu: &GpuContext,
    case: &Case,
    graph: bool,
    first_step: u64,
    append: AppendLaunch,
    max_splits: u32,
    coded: Option<IntFormat>,
) -> Result<(), TestCaseError> {
    use lserve::gpu::DecodeStep;
    use lserve::reference::decode::decode_attention_tables;
    use lserve::reference::select::select_from_cache;

    let mut p = prompted::<E>(case);
    // Start at decode step `first_step` (the cache is uploaded holding no selection: the first
    // step selects whatever the counter says, on the device and in the reference).
    for _ in 0..first_step {
        for &s in &p.seqs {
            p.mgr.advance_decode_step(s).unwrap();
        }
    }
    let g = *p.mgr.geometry();
    let (hq, hkv, d, batch) = (g.q_heads(), g.kv_heads(), g.head_dim(), p.seqs.len());
    let mut cache = match coded {
        None => DeviceKvCache::upload(gpu, &p.mgr, &p.host, &p.tables).unwrap(),
        Some(format) => {
            DeviceKvCache::upload_coded(gpu, &p.mgr, &p.host, &p.tables, format).unwrap()
        }
    };
    let mut step_ws = DecodeStep::new(gpu, &cache, batch)
        .unwrap()
        .with_append_launch(append)
        .with_max_splits(max_splits)
        .unwrap();
    let stream = gpu.stream().clone();
    let mut q_dev = stream.alloc_zeros::<E>(batch * hq * d).unwrap();
    let mut k_dev = stream.alloc_zeros::<E>(batch * hkv * d).unwrap();
    let mut v_dev = stream.alloc_zeros::<E>(batch * hkv * d).unwrap();
    let mut out = stream.alloc_zeros::<E>(batch * hq * d).unwrap();

    for step in 0..case.steps {
        // The plan reserves the step's tokens; the reference then runs on the same manager.
        let mut plan = step_ws.plan(gpu, &mut p.mgr, &mut cache, &p.seqs).unwrap();
        let Step { q, k, v, want } = reference_inputs(
            &mut p.rng,
            plan.manager(),
            &mut p.host,
            &mut p.tables,
            &mut p.reuse,
            &p.seqs,
        );
        // The selector runs on the first step (the uploaded cache holds no selection) and then
        // only where a sequence selects by its counter: the other steps are append + attention.
        let counters_say = p.seqs.iter().any(|&s| {
            let m = plan.manager();
            p.config
                .selects_at(m.len(s).unwrap(), m.decode_step(s).unwrap())
        });
        prop_assert_eq!(
            plan.selects(),
            step == 0 || counters_say,
            "step {}: whether the selector runs",
            step
        );
        stream.memcpy_htod(&q, &mut q_dev).unwrap();
        stream.memcpy_htod(&k, &mut k_dev).unwrap();
        stream.memcpy_htod(&v, &mut v_dev).unwrap();
        stream
            .memcpy_htod(&vec![E::from_f32(f32::NAN); batch * hq * d], &mut out)
            .unwrap();
        if graph {
            // The step must be capturable: no allocation, no synchronization inside.
            stream
                .begin_capture(
                    lserve::cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
                .unwrap();
            plan.layer(gpu, &mut cache, 0, &q_dev, &k_dev, &v_dev, &mut out)
                .unwrap();
            plan.finish(gpu, &mut cache).unwrap();
            let g = stream
                .end_capture(lserve::cudarc::driver::sys::CUgraphInstantiate_flags(0))
                .unwrap()
                .expect("a graph");
            g.launch().unwrap();
        } else {
            plan.layer(gpu, &mut cache, 0, &q_dev, &k_dev, &v_dev, &mut out)
                .unwrap();
            plan.finish(gpu, &mut cache).unwrap();
        }
        let got: Vec<E> = stream.clone_dtoh(&out).unwrap();

        // Compare the selections (near-ties allowed), then the outputs.
        let mut gpu_tables = IndexTables::for_manager(&p.mgr).unwrap();
        match coded {
            None => {
                let mut gpu_host = HostKvCache::<E>::for_manager(&p.mgr).unwrap();
                cache.download(gpu, &mut gpu_host, &mut gpu_tables).unwrap();
                prop_assert!(
                    gpu_host == p.host,
                    "step {step}: the device cache differs from the reference's after append"
                );
            }
            Some(format) => {
                let got = read_coded_layer(gpu, &cache, 0).unwrap();
                assert_coded_layer(&got, &p.host, 0, format)
                    .map_err(|e| TestCaseError::fail(format!("step {step}: {e}")))?;
                let state = download_selection(gpu, &cache, 0).unwrap();
                gpu_tables
                    .overwrite_layer(0, &state.index_pages, &state.index_lens)
                    .unwrap();
            }
        }
        let mut diverged = false;
        for (b, &s) in p.seqs.iter().enumerate() {
            let view = p.mgr.view(s).unwrap();
            let len = view.len;
            if !p.config.uses_page_selection(len) {
                continue;
            }
            for h in p.pattern.dense_kv_heads(0).to_vec() {
                let dh = p.pattern.compact_index(0, h);
                let got_pages = gpu_tables.get(0, view.slot as usize, dh).unwrap().to_vec();
                let want_pages = p.tables.get(0, view.slot as usize, dh).unwrap().to_vec();
                if got_pages != want_pages {
                    let q_group: Vec<f32> = q[(b * hq + h * case.group) * d..][..case.group * d]
                        .iter()
                        .map(|x| x.to_f32())
                        .collect();
                    let sel = select_from_cache(&p.host, 0, &view, h, &q_group).unwrap();
                    // The entries may differ only on a step where the reference selected (a
                    // near-tie), where the entry is the selection (logical pages below).
                    let selected_now = matches!(
                        want.visits[b][h],
                        lserve::reference::decode::HeadVisit::Selected {
                            selected_now: true,
                            ..
                        }
                    );
                    prop_assert!(
                        selected_now,
                        "step {step}, seq {b}, head {h}: entries differ on a reuse step: GPU {got_pages:?}, reference {want_pages:?}"
                    );
                    let logical = entry_units(
                        view.block_table.pages(),
                        &got_pages,
                        p.config.units_per_page() as u32,
                    );
                    let near_tie = check_selection(
                        &logical,
                        &sel,
                        p.config.pages_per_selection(),
                        p.config.always_include_first_page,
                    );
                    prop_assert!(
                        near_tie.is_ok(),
                        "step {step}, seq {b}, head {h}: GPU pages {got_pages:?}, reference {want_pages:?}: {near_tie:?}"
                    );
                    diverged = true;
                }
            }
        }
        let tables = if diverged { &gpu_tables } else { &p.tables };
        let want_out = match coded {
            Some(format) => {
                decode_attention_tables_coded(&p.mgr, &p.host, tables, 0, &p.seqs, &q, format)
                    .unwrap()
                    .0
            }
            None if diverged => {
                decode_attention_tables(&p.mgr, &p.host, tables, 0, &p.seqs, &q).unwrap()
            }
            None => want.out,
        };
        let err = worst_row_error(&got, &want_out, d);
        let tol = tolerance::<E>();
        prop_assert!(
            err < tol,
            "step {step}: worst relative error {err:.3e} (tolerance {tol:.0e})"
        );
        if diverged {
            break;
        }
    }
    Ok(())
}

proptest! {
    #[test]
    #[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
    fn decode_steps_match_reference(
        case in case_strategy(),
        graph in any::<bool>(),
        append in prop_oneof![
            Just(AppendLaunch::Auto),
            Just(AppendLaunch::Fused),
            Just(AppendLaunch::Separate)
        ],
    ) {
        let gpu = gpu();
        // The fused append codes no 8-bit statistics (refused: `eight_bit_statistics_refuse_the_fused_append`).
        let append = match (case.q8, append) {
            (true, AppendLaunch::Fused) => AppendLaunch::Separate,
            _ => append,
        };
        f16_or_bf16!(case.f16, run_steps(&gpu, &case, graph, 0, append, MAX_SPLITS, None))?;
    }
}

/// Steps that reuse their selection launch no selector: the append keeps the index entries.
/// These sequences start a page on a reuse step (prompt 46: position 48 on step 2), start one on
/// a selection step (prompt 60: position 64 on step 4), and cross `dynamic_min_len` between
/// selection steps (prompt 30: length 41 on step 10, after a page start while still dense);
/// every step is compared with the reference, eagerly and as captured graphs, and once more with
/// the cache uploaded at step 1 (holding no selection, so the first step must select).
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn reused_selections_follow_new_pages_without_the_selector() {
    let gpu = gpu();
    let case = Case {
        head_dim: 64,
        kv_heads: 2,
        group: 2,
        streaming: vec![false, true],
        page_tokens: 16,
        logical_per_page: 1,
        top_k: 2,
        sink: 4,
        local: 16,
        dynamic_min_len: 40,
        reuse: 4,
        prompts: vec![46, 60, 30],
        steps: 12,
        f16: false,
        q8: false,
        logical: false,
        seed: 7,
    };
    for graph in [false, true] {
        for append in [AppendLaunch::Fused, AppendLaunch::Separate] {
            run_steps::<bf16>(&gpu, &case, graph, 0, append, MAX_SPLITS, None).unwrap();
        }
    }
    // Uploaded mid-decode (step 1 of reuse 4): the cache holds no selection, so the first step
    // selects although its counter is not a multiple of 4 (`PlannedStep::selects`).
    run_steps::<bf16>(&gpu, &case, false, 1, AppendLaunch::Fused, MAX_SPLITS, None).unwrap();
}

/// Whole decode steps over an integer-coded cache, INT8 and INT4 (`run_steps` with `coded`): the
/// append kernel quantizes each step's token (the only placement a coded cache takes: `Auto` and `Separate`),
/// the selector runs on the statistics of the unquantized keys, the coded attention reads the
/// selection; with reuse, pages opened between selections, `dynamic_min_len` crossed, eagerly and
/// as captured graphs, bf16 and f16, and a batch of 8 long sequences with 4 KV heads.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn coded_decode_steps_match_reference() {
    let gpu = gpu();
    let case = Case {
        head_dim: 128,
        kv_heads: 2,
        group: 2,
        streaming: vec![false, true],
        page_tokens: 16,
        logical_per_page: 4,
        top_k: 2,
        sink: 4,
        local: 16,
        dynamic_min_len: 40,
        reuse: 4,
        prompts: vec![46, 60, 30],
        steps: 12,
        f16: false,
        q8: false,
        logical: false,
        seed: 17,
    };
    for format in [int8(), int4()] {
        for graph in [false, true] {
            for append in [AppendLaunch::Auto, AppendLaunch::Separate] {
                run_steps::<bf16>(&gpu, &case, graph, 0, append, MAX_SPLITS, Some(format)).unwrap();
            }
        }
        let f16_case = Case {
            f16: true,
            ..case.clone()
        };
        run_steps::<f16>(
            &gpu,
            &f16_case,
            false,
            1,
            AppendLaunch::Auto,
            MAX_SPLITS,
            Some(format),
        )
        .unwrap();
        let long = case.clone().eight_long_sequences(18);
        run_steps::<bf16>(
            &gpu,
            &long,
            false,
            0,
            AppendLaunch::Auto,
            MAX_SPLITS,
            Some(format),
        )
        .unwrap();
    }
}

/// Whole decode steps that select 16-token logical pages inside 64-token physical pages
/// (`SelectionUnit::LogicalPage`): the scorer writes each logical page's score, the top-K lists
/// logical-page ids, the append keeps the entry's newest logical page between selections, and
/// the attention reads 16-row units; against the reference with reuse, logical and physical
/// pages opened between selections, `dynamic_min_len` crossed, eagerly and as captured graphs,
/// both append launches, bf16 and f16, 16-bit and INT8 caches, 8-bit statistics, and a batch of
/// 8 long sequences.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn logical_page_selection_decode_steps_match_reference() {
    let gpu = gpu();
    let case = Case {
        head_dim: 64,
        kv_heads: 2,
        group: 3,
        streaming: vec![false, true],
        page_tokens: 64,
        logical_per_page: 4,
        top_k: 1,
        sink: 4,
        local: 16,
        dynamic_min_len: 100,
        reuse: 4,
        prompts: vec![110, 140, 90],
        steps: 20,
        f16: false,
        q8: false,
        logical: true,
        seed: 31,
    };
    for graph in [false, true] {
        for append in [AppendLaunch::Fused, AppendLaunch::Separate] {
            run_steps::<bf16>(&gpu, &case, graph, 0, append, MAX_SPLITS, None).unwrap();
        }
    }
    let f16_case = Case {
        f16: true,
        q8: true,
        head_dim: 128,
        ..case.clone()
    };
    run_steps::<f16>(
        &gpu,
        &f16_case,
        false,
        1,
        AppendLaunch::Separate,
        MAX_SPLITS,
        None,
    )
    .unwrap();
    // (INT8 caches are D 128.)
    let coded = Case {
        head_dim: 128,
        ..case.clone()
    };
    run_steps::<bf16>(
        &gpu,
        &coded,
        true,
        0,
        AppendLaunch::Auto,
        MAX_SPLITS,
        Some(int8()),
    )
    .unwrap();
    let long = case.eight_long_sequences(32);
    run_steps::<bf16>(&gpu, &long, false, 0, AppendLaunch::Auto, MAX_SPLITS, None).unwrap();
}

/// Whole decode steps that select from 8-bit statistics (`StatsFormat::DEVICE_INT8`), over a
/// 16-bit cache and over an INT8 cache: the cache is uploaded with the statistics coded by the
/// reference, each step's append codes its logical page again, the selector reads only the
/// codes, and the reference selects from the same codes dequantized; with reuse, pages opened
/// between selections, `dynamic_min_len` crossed, eagerly and as captured graphs, bf16 and f16.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn eight_bit_statistics_decode_steps_match_reference() {
    let gpu = gpu();
    let case = Case {
        head_dim: 128,
        kv_heads: 2,
        group: 2,
        streaming: vec![false, true],
        page_tokens: 16,
        logical_per_page: 4,
        top_k: 2,
        sink: 4,
        local: 16,
        dynamic_min_len: 40,
        reuse: 4,
        prompts: vec![46, 60, 30],
        steps: 12,
        f16: false,
        q8: true,
        logical: false,
        seed: 19,
    };
    for graph in [false, true] {
        for coded in [None, Some(int8())] {
            run_steps::<bf16>(&gpu, &case, graph, 0, AppendLaunch::Auto, MAX_SPLITS, coded)
                .unwrap();
        }
    }
    let f16_case = Case {
        f16: true,
        head_dim: 64,
        group: 3,
        seed: 20,
        ..case.clone()
    };
    run_steps::<f16>(
        &gpu,
        &f16_case,
        false,
        1,
        AppendLaunch::Separate,
        MAX_SPLITS,
        None,
    )
    .unwrap();
    let long = case.eight_long_sequences(21);
    run_steps::<bf16>(
        &gpu,
        &long,
        false,
        0,
        AppendLaunch::Auto,
        MAX_SPLITS,
        Some(int8()),
    )
    .unwrap();
}

/// A cache that keeps 8-bit statistics takes the append kernel (which codes them): an attention
/// launch that appends is refused with a typed error before anything is enqueued, `Auto` plans
/// the separate append; a statistics group the kernels do not keep is refused when the cache is
/// made, and a manager of another statistics format does not fit the cache.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn eight_bit_statistics_refuse_the_fused_append() {
    use lserve::gpu::AppendAttendPlan;
    use lserve::quant::StatsGroup;
    let gpu = gpu();
    let case = Case {
        q8: true,
        logical: false,
        ..long_dense_case(1, 3)
    };
    let p = prompted::<bf16>(&Case {
        prompts: vec![300],
        ..case.clone()
    });
    let mut cache = DeviceKvCache::upload(&gpu, &p.mgr, &p.host, &p.tables).unwrap();
    assert_eq!(cache.stats_format(), StatsFormat::DEVICE_INT8);
    let mut batch = DecodeBatch::new(&gpu, 1).unwrap();
    batch.set(&gpu, &p.mgr, &mut cache, &p.seqs).unwrap();
    let g = *p.mgr.geometry();
    let ws = DecodeWorkspace::new(&gpu, 1, g.kv_heads(), g.group(), g.head_dim()).unwrap();
    let fused = AppendAttendPlan::new(&gpu, &cache, &batch, &ws, AppendLaunch::Fused);
    assert!(
        matches!(
            fused,
            Err(LserveError::InvalidArgument {
                what: "append launch",
                ..
            })
        ),
        "{:?}",
        fused.map(|_| ())
    );
    AppendAttendPlan::new(&gpu, &cache, &batch, &ws, AppendLaunch::Auto).unwrap();
    let per_page = SparsityConfig {
        stats_format: StatsFormat::Int8(StatsGroup::Page),
        ..p.config
    };
    let mgr = KvCacheManager::new(g, p.pattern.clone(), per_page, 8, 1, 1024).unwrap();
    let made = DeviceKvCache::<bf16>::new(&gpu, &mgr);
    assert!(
        matches!(
            made,
            Err(LserveError::InvalidArgument {
                what: "stats format",
                ..
            })
        ),
        "{:?}",
        made.map(|_| ())
    );
    let half = SparsityConfig {
        stats_format: StatsFormat::Half,
        ..p.config
    };
    let mut other = KvCacheManager::new(
        g,
        p.pattern.clone(),
        half,
        p.mgr.pool().capacity(),
        p.mgr.max_sequences(),
        p.mgr.max_seq_len(),
    )
    .unwrap();
    let seq = other.add_sequence().unwrap();
    other.reserve(seq, 10).unwrap();
    let set = batch.set(&gpu, &other, &mut cache, &[seq]);
    assert!(
        matches!(
            set,
            Err(LserveError::InvalidArgument {
                what: "manager",
                ..
            })
        ),
        "{set:?}"
    );
}

/// Every (head dim, GQA group, element type) the geometry accepts, against the reference on each
/// of the three attention kernels of its shape: the bulk-copy kernel (attention over the cache as
/// it is), the appending `cp.async` kernel (whole steps with the append fused, short splits of
/// sparse and streaming heads, selection and reuse), and the appending bulk-copy kernel (one
/// split per pair over a long dense sequence). Three KV heads, so the pairs of a batch are not a
/// power of two either.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn every_group_and_head_dim_matches_reference() {
    let gpu = gpu();
    for head_dim in ModelGeometry::SUPPORTED_HEAD_DIMS {
        for group in 1..=ModelGeometry::MAX_GROUP {
            for use_f16 in [false, true] {
                let seed = (head_dim * 100 + group * 10 + use_f16 as usize) as u64;
                let sparse = Case {
                    head_dim,
                    kv_heads: 3,
                    group,
                    streaming: vec![false, true, false],
                    page_tokens: 32,
                    logical_per_page: 2,
                    top_k: 2,
                    sink: 4,
                    local: 16,
                    dynamic_min_len: 40,
                    reuse: 2,
                    prompts: vec![70, 150, 33],
                    steps: 3,
                    f16: use_f16,
                    q8: false,
                    logical: false,
                    seed,
                };
                let long = Case {
                    streaming: vec![false, true, false],
                    page_tokens: 64,
                    logical_per_page: 4,
                    dynamic_min_len: 1 << 20,
                    reuse: 1,
                    prompts: vec![2000],
                    steps: 2,
                    ..sparse.clone()
                };
                let what = format!("D {head_dim} group {group} f16 {use_f16}");
                let r = f16_or_bf16!(use_f16, run_case(&gpu, &sparse))
                    .and_then(|()| {
                        f16_or_bf16!(
                            use_f16,
                            run_steps(
                                &gpu,
                                &sparse,
                                false,
                                0,
                                AppendLaunch::Fused,
                                MAX_SPLITS,
                                None
                            )
                        )
                    })
                    .and_then(|()| {
                        // 2000 rows in one split: 32 tiles per warp, past the bulk-copy line.
                        f16_or_bf16!(
                            use_f16,
                            run_steps(&gpu, &long, false, 0, AppendLaunch::Fused, 1, None)
                        )
                    });
                if let Err(e) = r {
                    panic!("{what}: {e}");
                }
            }
        }
    }
}

/// A workspace for a shape no kernel serves is a typed error at construction.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn workspace_rejects_shapes_no_kernel_serves() {
    let gpu = gpu();
    for (group, head_dim, what) in [(9, 64, "group"), (0, 128, "group"), (4, 256, "head_dim")] {
        assert!(
            matches!(
                DecodeWorkspace::new(&gpu, 1, 2, group, head_dim),
                Err(LserveError::InvalidArgument { what: w, .. }) if w == what
            ),
            "group {group} head_dim {head_dim}"
        );
    }
    for group in 1..=ModelGeometry::MAX_GROUP {
        DecodeWorkspace::new(&gpu, 1, 2, group, 128).unwrap();
    }
}

/// The longest context the profiler test measures: `LSERVE_PROFILE_MAX_CONTEXT` if set (the GPU
/// bundle's sanitize mode sets 4096: racecheck's host memory grows with the contexts, 127 GB
/// resident for 1K + 4K, more than a 128 GiB machine from 16K), else 65536.
fn profile_max_context() -> usize {
    std::env::var("LSERVE_PROFILE_MAX_CONTEXT")
        .ok()
        .map(|v| {
            v.parse()
                .expect("LSERVE_PROFILE_MAX_CONTEXT: a number of tokens")
        })
        .unwrap_or(65536)
}

/// The `dynamic_min_len` profiler measures every requested length and recommends one of them:
/// at 64K tokens selection (4096-token budget) reads ~16x fewer bytes than dense attention, so
/// there it must win (checked when 64K is measured: [`profile_max_context`]).
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn profiler_measures_every_length_and_finds_the_crossover() {
    use lserve::gpu::profile_dynamic_min_len;
    let gpu = gpu();
    let geometry = ModelGeometry::new(1, 32, 8, 128).unwrap();
    let max = profile_max_context();
    let contexts: Vec<usize> = [65536, 1024, 4096, 16384]
        .into_iter()
        .filter(|&c| c <= max)
        .collect();
    assert!(
        !contexts.is_empty(),
        "LSERVE_PROFILE_MAX_CONTEXT {max} is below 1024"
    );
    let profile =
        profile_dynamic_min_len::<bf16>(&gpu, geometry, &SparsityConfig::default(), 1, &contexts)
            .unwrap();
    let measured: Vec<usize> = profile.points.iter().map(|p| p.context).collect();
    let mut sorted = contexts.clone();
    sorted.sort_unstable();
    assert_eq!(measured, sorted);
    for p in &profile.points {
        assert!(p.dense_us.is_finite() && p.dense_us > 0.0, "{p:?}");
        assert!(p.selected_us.is_finite() && p.selected_us > 0.0, "{p:?}");
    }
    let last = profile.points.last().unwrap();
    if last.context >= 65536 {
        assert!(
            last.selected_us < last.dense_us,
            "selection should win at 64K: {last:?}"
        );
    }
    assert!(profile
        .dynamic_min_len
        .is_none_or(|m| m < 65536 && contexts.contains(&m)));
    eprintln!("{profile:#?}");
}

/// [`run_case`] over an INT8 and an INT4 coded copy of the cache: the GPU's
/// `decode_attention_int{8,4}_*` against the reference's attention over the dequantized rows.
/// Rows no token wrote are infinite, so their codes dequantize to NaN: a kernel that reads one
/// fails.
fn run_coded_case<E: DeviceElement>(gpu: &GpuContext, case: &Case) -> Result<(), TestCaseError> {
    for format in [int8(), int4()] {
        run_case_with_splits::<E>(gpu, case, MAX_SPLITS, Some(format))
            .map_err(|e| TestCaseError::fail(format!("{format}: {e}")))?;
    }
    Ok(())
}

proptest! {
    #[test]
    #[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
    fn coded_decode_attention_matches_reference(case in case_strategy()) {
        let gpu = gpu();
        // The coded kernels serve head dimension 128.
        let case = Case { head_dim: 128, ..case };
        f16_or_bf16!(case.f16, run_coded_case(&gpu, &case))?;
    }
}

/// The coded kernels (INT8 and INT4) over a 20,000-token dense head (a long split per warp) and
/// a streaming head, bf16 and f16.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn coded_decode_attention_over_a_long_sequence() {
    let gpu = gpu();
    let case = long_dense_case(2, 7);
    run_coded_case::<bf16>(&gpu, &case).unwrap();
    run_coded_case::<f16>(&gpu, &Case { f16: true, ..case }).unwrap();
}

/// A coded cache is read by `DecodePlan` and written by the append and the row write; what would
/// read or write its 16-bit K/V refuses it with a typed error before anything is enqueued (the
/// download, pooling from the pool, an attention launch that appends), and formats without
/// kernels are refused when the cache is made.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn coded_caches_refuse_what_they_do_not_serve() {
    use lserve::gpu::{AppendAttendPlan, KvWritePlan};
    let gpu = gpu();
    let case = Case {
        head_dim: 128,
        ..long_dense_case(1, 3)
    };
    let p = prompted::<bf16>(&Case {
        prompts: vec![300],
        ..case.clone()
    });
    let mut cache = DeviceKvCache::upload_coded(&gpu, &p.mgr, &p.host, &p.tables, int8()).unwrap();
    let mut batch = DecodeBatch::new(&gpu, 1).unwrap();
    batch.set(&gpu, &p.mgr, &mut cache, &p.seqs).unwrap();
    let g = *p.mgr.geometry();
    let ws = DecodeWorkspace::new(&gpu, 1, g.kv_heads(), g.group(), g.head_dim()).unwrap();
    let format_error = |r: Result<(), LserveError>| {
        assert!(
            matches!(
                r,
                Err(LserveError::InvalidArgument {
                    what: "KV format",
                    ..
                })
            ),
            "{r:?}"
        )
    };
    // The attention does not append: the append kernel does, first.
    let fused = AppendAttendPlan::new(&gpu, &cache, &batch, &ws, AppendLaunch::Fused);
    assert!(
        matches!(
            fused,
            Err(LserveError::InvalidArgument {
                what: "append launch",
                ..
            })
        ),
        "{:?}",
        fused.map(|_| ())
    );
    AppendAttendPlan::new(&gpu, &cache, &batch, &ws, AppendLaunch::Auto).unwrap();
    // Its statistics come from the row write (from the unquantized keys), not from a pool.
    let plan = KvWritePlan::new(&p.mgr, &[(p.seqs[0], 0..300)]).unwrap();
    let plan = plan.upload(&gpu, &p.mgr, &mut cache).unwrap();
    assert!(matches!(
        lserve::gpu::pool_key_stats(&gpu, &mut cache, 0, &plan),
        Err(LserveError::InvalidArgument { what: "cache", .. })
    ));
    let mut host = p.host.clone();
    let mut tables = p.tables.clone();
    format_error(cache.download(&gpu, &mut host, &mut tables));
    // Formats and head dimensions without kernels.
    for format in [
        IntFormat::new(CodeBits::Int4, QuantGroup::Channels(32)),
        IntFormat::new(CodeBits::Int8, QuantGroup::Channels(32)),
    ] {
        format_error(DeviceKvCache::<bf16>::new_coded(&gpu, &p.mgr, format).map(|_| ()));
    }
    let d64 = prompted::<bf16>(&Case {
        head_dim: 64,
        prompts: vec![40],
        ..case
    });
    format_error(DeviceKvCache::<bf16>::new_coded(&gpu, &d64.mgr, int8()).map(|_| ()));
    // The plan that reads it works.
    DecodePlan::new(&gpu, &cache, &batch, &ws).unwrap();
}

/// The reference reuses a held selection that lists every page of a sequence as long as the
/// tables reach (an entry capped at that many pages: the selection ends with the newest page,
/// so it needs no extra slot). CPU only; found by `decode_attention_matches_reference`, where
/// the reference refused it ("the held selection ... has 5 pages, the tables hold 5").
#[test]
fn reference_reuses_a_selection_of_every_page() {
    let case = Case {
        head_dim: 128,
        kv_heads: 3,
        group: 3,
        streaming: vec![false, false, false],
        page_tokens: 64,
        logical_per_page: 2,
        top_k: 4,
        sink: 12,
        local: 47,
        dynamic_min_len: 266,
        reuse: 4,
        prompts: vec![197, 294, 306],
        steps: 3,
        f16: true,
        q8: false,
        logical: false,
        seed: 608_323_255_915_077_816,
    };
    let mut p = prompted::<f16>(&case);
    for _ in 0..case.steps {
        p.reference_step();
        for &s in &p.seqs {
            p.mgr.advance_decode_step(s).unwrap();
        }
    }
}
