//! The GPU decode step (selector when due, append, decode attention) on real activations against
//! the CPU reference: post-RoPE Q, K and V of SmolLM2-135M (9 query heads on 3 KV heads, D 64)
//! over a long text, made by `scripts/dump_activations.sh` (`integrations/candle-smollm2`,
//! binary `dump_activations`; not committed). The file's path comes from `LSERVE_ACTIVATIONS`.
//!
//! Per dumped layer and configuration, one batch holds a sequence per window of the dump: the
//! text's first `end - N` tokens as its prompt (the real keys and values, written by the
//! reference into the host cache, uploaded), then `N` whole decode steps on the device with the
//! real query, key and value of each position (the contexts grow to each window's end, the last
//! to the whole text). Every step is compared with the reference decode step by the project's
//! equivalence rules (`docs/ARCHITECTURE.md`, "Equivalence rules"): each dense head's index
//! entry equal to the reference's, or different only on a near-tie of a step where it selected
//! (then that pair is followed on the device's selection until the two select alike again), and
//! every (sequence, query head) output row within the tolerance of its element type against the
//! reference's attention over the device's selection; after the last step the device cache
//! equals the reference's (K, V, statistics, 8-bit statistics codes). The worst and mean relative
//! errors of every run are printed (stderr), per layer.
//!
//! Configurations: LServe's hierarchical pages (64 physical, 16 logical) at budgets 512 and 2048
//! with reuse 1 and 4; flat pages (16 = 16) at both budgets; streaming heads (one and two of the
//! three KV heads) with and without selection; dense decode; logical-page selection
//! (`SelectionUnit::LogicalPage`: 16-token logical pages inside 64-token physical ones); mean GQA
//! aggregation (`GqaAggregation::Mean`: the group size is 3); each in bf16 and f16 caches and
//! with 16-bit and 8-bit key statistics (`StatsFormat::DEVICE_INT8`). Integer-coded K/V caches
//! serve D 128 only, so they are not run here.
//!
//! Ignored without a GPU (reported as ignored, never passed); `--ignored` runs them, and there a
//! missing GPU or a missing dump is a failure.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::OnceLock;

use common::{
    assert_stat_codes, check_selection, entry_units, gpu, head_pattern, prefilled, row_error,
    tolerance,
};
use half::{bf16, f16};
use lserve::config::{GqaAggregation, SelectionUnit, SparsityConfig};
use lserve::dtype::{DType, Element};
use lserve::geometry::ModelGeometry;
use lserve::gpu::{download_selection, DecodeStep, DeviceElement, DeviceKvCache, GpuContext};
use lserve::index_table::IndexTables;
use lserve::paging::HostKvCache;
use lserve::quant::StatsFormat;
use lserve::reference::decode::{decode_attention_tables, decode_step, HeadVisit};
use lserve::reference::select::select_from_cache;
use safetensors::{Dtype, SafeTensors};

/// The dump's format tag (`integrations/candle-smollm2/src/activations.rs`, `FORMAT`).
const FORMAT: &str = "lserve-activations/1";

/// One layer of the dump, `f16`: queries `[W][N][Hq][D]`, keys and values `[T][Hkv][D]`.
struct Layer {
    layer: usize,
    q: Vec<f16>,
    k: Vec<f16>,
    v: Vec<f16>,
}

/// The dump: geometry, windows, layers.
struct Dump {
    path: PathBuf,
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    query_ends: Vec<usize>,
    queries: usize,
    layers: Vec<Layer>,
}

fn halves(bytes: &[u8]) -> Vec<f16> {
    let (pairs, rest) = bytes.as_chunks::<2>();
    assert!(rest.is_empty(), "an odd number of bytes of f16");
    pairs.iter().map(|&c| f16::from_le_bytes(c)).collect()
}

fn list(s: &str) -> Vec<usize> {
    s.split(',')
        .map(|x| x.parse().unwrap_or_else(|_| panic!("{x:?} in {s:?}")))
        .collect()
}

impl Dump {
    /// Reads the file `LSERVE_ACTIVATIONS` names; panics naming the script when it is not set or
    /// not there (a test asked to run without its data fails).
    fn load() -> Self {
        let path = std::env::var_os("LSERVE_ACTIVATIONS")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                panic!(
                    "LSERVE_ACTIVATIONS is not set: these tests read real activations; make them \
                     with `bash scripts/dump_activations.sh` and set LSERVE_ACTIVATIONS to the \
                     file it prints (docs/FIDELITY.md, \"Real activations for the GPU tests\")"
                )
            });
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "reading LSERVE_ACTIVATIONS={} ({e}): make it with `bash scripts/dump_activations.sh`",
                path.display()
            )
        });
        let (_, header) = SafeTensors::read_metadata(&bytes).expect("a safetensors file");
        let meta = header.metadata().clone().expect("the dump's metadata");
        let get = |k: &str| {
            meta.get(k)
                .unwrap_or_else(|| panic!("{}: no metadata {k}", path.display()))
                .as_str()
        };
        assert_eq!(get("format"), FORMAT, "{}: format", path.display());
        let num = |k: &str| -> usize {
            get(k)
                .parse()
                .unwrap_or_else(|_| panic!("metadata {k} is not a number"))
        };
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (t, hq, hkv, d, n) = (
            num("tokens"),
            num("q_heads"),
            num("kv_heads"),
            num("head_dim"),
            num("queries"),
        );
        let query_ends = list(get("query_ends"));
        assert!(
            query_ends.iter().all(|&e| e >= n && e <= t),
            "window ends {query_ends:?} outside {n}..={t}"
        );
        let tensor = |name: &str, shape: &[usize]| -> Vec<f16> {
            let view = st
                .tensor(name)
                .unwrap_or_else(|e| panic!("{}: {name}: {e}", path.display()));
            assert_eq!(view.dtype(), Dtype::F16, "{name}");
            assert_eq!(view.shape(), shape, "{name}");
            halves(view.data())
        };
        let w = query_ends.len();
        let layers = list(get("layers"))
            .into_iter()
            .map(|layer| Layer {
                layer,
                q: tensor(&format!("layer.{layer}.q"), &[w, n, hq, d]),
                k: tensor(&format!("layer.{layer}.k"), &[t, hkv, d]),
                v: tensor(&format!("layer.{layer}.v"), &[t, hkv, d]),
            })
            .collect();
        Self {
            path,
            tokens: t,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            query_ends,
            queries: n,
            layers,
        }
    }

    /// One layer of this geometry (each dumped layer runs as layer 0 of its own cache).
    fn geometry(&self) -> ModelGeometry {
        ModelGeometry::new(1, self.q_heads, self.kv_heads, self.head_dim).unwrap()
    }
}

/// The dump, read once per test process.
fn dump() -> &'static Dump {
    static DUMP: OnceLock<Dump> = OnceLock::new();
    DUMP.get_or_init(|| {
        let d = Dump::load();
        eprintln!(
            "real activations: {} ({} tokens, layers {:?}, windows ending at {:?}, {} queries each; \
             {} query heads, {} KV heads, D {})",
            d.path.display(),
            d.tokens,
            d.layers.iter().map(|l| l.layer).collect::<Vec<_>>(),
            d.query_ends,
            d.queries,
            d.q_heads,
            d.kv_heads,
            d.head_dim
        );
        d
    })
}

/// One configuration of a run.
#[derive(Clone, Copy, Debug)]
struct Run {
    name: &'static str,
    page_tokens: usize,
    logical_page_tokens: usize,
    /// `None`: no selection (dense heads attend to every page).
    budget: Option<usize>,
    reuse: usize,
    /// Which KV heads stream (of the first three; the dump's heads past them are dense).
    streaming: [bool; 3],
    stats: StatsFormat,
    /// Physical or logical pages.
    unit: SelectionUnit,
    /// How the group's 3 query heads combine their page scores.
    aggregation: GqaAggregation,
}

impl Run {
    fn config(&self) -> SparsityConfig {
        let base = SparsityConfig::default();
        SparsityConfig {
            page_tokens: self.page_tokens,
            logical_page_tokens: self.logical_page_tokens,
            token_budget: self.budget.unwrap_or(base.token_budget),
            reuse_interval: self.reuse,
            // Selection whenever the sequence is longer than the budget (the fidelity runs'
            // choice, docs/FIDELITY.md); never without a budget.
            dynamic_min_len: self.budget.unwrap_or(u32::MAX as usize),
            stats_format: self.stats,
            selection_unit: self.unit,
            gqa_aggregation: self.aggregation,
            ..base
        }
    }

    fn stats_name(&self) -> &'static str {
        match self.stats {
            StatsFormat::Half => "stats16",
            _ => "stats8",
        }
    }
}

fn type_name<E: Element>() -> &'static str {
    match E::DTYPE {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
    }
}

/// What a run saw.
#[derive(Debug, Default)]
struct Seen {
    rows: usize,
    worst: f64,
    sum: f64,
    near_ties: usize,
    selecting_steps: usize,
}

/// `run` on `layer` of the dump in element type `E`: the windows' prompts uploaded, then the
/// windows' decode steps on the device against the reference, step by step. Panics on the
/// first difference the equivalence rules do not allow.
fn run_layer<E: DeviceElement>(gpu: &GpuContext, dump: &Dump, layer: &Layer, run: Run) -> Seen {
    let g = dump.geometry();
    let (hq, hkv, d, group) = (g.q_heads(), g.kv_heads(), g.head_dim(), g.group());
    let n = dump.queries;
    let mut streaming = vec![false; hkv];
    streaming[..3.min(hkv)].copy_from_slice(&run.streaming[..3.min(hkv)]);
    let pattern = head_pattern(g, &[streaming]);
    let config = run.config();
    let ends = &dump.query_ends;
    let batch = ends.len();
    let prompts: Vec<usize> = ends.iter().map(|&e| e - n).collect();
    let max_len = *ends.iter().max().unwrap();
    let row = hkv * d;
    let kv = |_b: usize, pos: usize| {
        let f32s = |x: &[f16]| x[pos * row..][..row].iter().map(|e| e.to_f32()).collect();
        (f32s(&layer.k), f32s(&layer.v))
    };
    let mut p = prefilled::<E>(pattern.clone(), config, &prompts, max_len, 2, kv);
    let mut cache = DeviceKvCache::upload(gpu, &p.mgr, &p.host, &p.tables).unwrap();
    let mut step_ws = DecodeStep::new(gpu, &cache, batch).unwrap();
    let stream = gpu.stream().clone();
    let mut q_dev = stream.alloc_zeros::<E>(batch * hq * d).unwrap();
    let mut k_dev = stream.alloc_zeros::<E>(batch * hkv * d).unwrap();
    let mut v_dev = stream.alloc_zeros::<E>(batch * hkv * d).unwrap();
    let mut out = stream.alloc_zeros::<E>(batch * hq * d).unwrap();
    let tol = tolerance::<E>();
    let label = format!(
        "layer {} {} {} {}",
        layer.layer,
        run.name,
        type_name::<E>(),
        run.stats_name()
    );
    let mut seen = Seen::default();
    // (sequence, KV head) pairs whose held selection is the device's after a near-tie.
    let mut diverged: BTreeSet<(usize, usize)> = BTreeSet::new();

    for step in 0..n {
        // Row `at` of `x` (`width` elements) in the cache's element type.
        let to_e = |x: &[f16], width: usize, at: usize| -> Vec<E> {
            x[at * width..][..width]
                .iter()
                .map(|v| E::from_f32(v.to_f32()))
                .collect()
        };
        let mut q = Vec::with_capacity(batch * hq * d);
        let mut k = Vec::with_capacity(batch * row);
        let mut v = Vec::with_capacity(batch * row);
        for (b, &prompt) in prompts.iter().enumerate() {
            // Sequence `b`'s token this step is at position `prompt + step`.
            q.extend(to_e(&layer.q, hq * d, b * n + step));
            k.extend(to_e(&layer.k, row, prompt + step));
            v.extend(to_e(&layer.v, row, prompt + step));
        }
        let mut plan = step_ws.plan(gpu, &mut p.mgr, &mut cache, &p.seqs).unwrap();
        let want = decode_step(
            plan.manager(),
            &mut p.host,
            &mut p.tables,
            &mut p.reuse,
            0,
            &p.seqs,
            &q,
            &k,
            &v,
        )
        .unwrap();
        seen.selecting_steps += usize::from(plan.selects());
        stream.memcpy_htod(&q, &mut q_dev).unwrap();
        stream.memcpy_htod(&k, &mut k_dev).unwrap();
        stream.memcpy_htod(&v, &mut v_dev).unwrap();
        stream
            .memcpy_htod(&vec![E::from_f32(f32::NAN); batch * hq * d], &mut out)
            .unwrap();
        plan.layer(gpu, &mut cache, 0, &q_dev, &k_dev, &v_dev, &mut out)
            .unwrap();
        plan.finish(gpu, &mut cache).unwrap();
        let got: Vec<E> = stream.clone_dtoh(&out).unwrap();

        // Selections: equal, or a near-tie on a step where the reference selected (then that
        // pair follows the device's selection).
        let state = download_selection(gpu, &cache, 0).unwrap();
        let mut gpu_tables = IndexTables::for_manager(&p.mgr).unwrap();
        gpu_tables
            .overwrite_layer(0, &state.index_pages, &state.index_lens)
            .unwrap();
        let mut differs = false;
        for (b, &s) in p.seqs.iter().enumerate() {
            let view = p.mgr.view(s).unwrap();
            if !config.uses_page_selection(view.len) {
                continue;
            }
            for h in pattern.dense_kv_heads(0).to_vec() {
                let dh = pattern.compact_index(0, h);
                let got_pages = gpu_tables.get(0, view.slot as usize, dh).unwrap().to_vec();
                let want_pages = p.tables.get(0, view.slot as usize, dh).unwrap().to_vec();
                let selected_now = matches!(
                    want.visits[b][h],
                    HeadVisit::Selected {
                        selected_now: true,
                        ..
                    }
                );
                if got_pages == want_pages {
                    if selected_now {
                        diverged.remove(&(b, h));
                    }
                    continue;
                }
                differs = true;
                if !selected_now {
                    assert!(
                        diverged.contains(&(b, h)),
                        "{label}: step {step}, window {b} (length {}), head {h}: entries differ on a \
                         reuse step: GPU {got_pages:?}, reference {want_pages:?}",
                        view.len
                    );
                    continue;
                }
                let q_group: Vec<f32> = q[(b * hq + h * group) * d..][..group * d]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let sel = select_from_cache(&p.host, 0, &view, h, &q_group).unwrap();
                let logical = entry_units(
                    view.block_table.pages(),
                    &got_pages,
                    config.units_per_page() as u32,
                );
                if let Err(e) = check_selection(
                    &logical,
                    &sel,
                    config.pages_per_selection(),
                    config.always_include_first_page,
                ) {
                    panic!(
                        "{label}: step {step}, window {b} (length {}), head {h}: GPU pages \
                         {got_pages:?}, reference {want_pages:?}: {e}",
                        view.len
                    );
                }
                seen.near_ties += 1;
                diverged.insert((b, h));
            }
        }

        // Outputs: every row against the reference over the device's selection.
        let want_out = if differs {
            decode_attention_tables(&p.mgr, &p.host, &gpu_tables, 0, &p.seqs, &q).unwrap()
        } else {
            want.out
        };
        for (r, (g_row, w_row)) in got.chunks(d).zip(want_out.chunks(d)).enumerate() {
            let err = row_error(g_row, w_row);
            let (b, h) = (r / hq, r % hq);
            assert!(
                err < tol,
                "{label}: step {step}, window {b} (position {}), query head {h}: relative error \
                 {err:.3e} (tolerance {tol:.0e})",
                prompts[b] + step
            );
            seen.rows += 1;
            seen.sum += err;
            seen.worst = seen.worst.max(err);
        }
    }

    // The device cache after the last step: the reference's, statistics codes included.
    let mut gpu_host = HostKvCache::<E>::for_manager(&p.mgr).unwrap();
    let mut tables = IndexTables::for_manager(&p.mgr).unwrap();
    cache.download(gpu, &mut gpu_host, &mut tables).unwrap();
    assert!(
        gpu_host == p.host,
        "{label}: the device cache differs from the reference's after {n} steps"
    );
    assert_stat_codes(gpu, &cache, &p.host, 0).unwrap_or_else(|e| panic!("{label}: {e}"));
    eprintln!(
        "{label}: {} rows, relative error worst {:.3e} mean {:.3e} (tolerance {tol:.0e}); {} of {n} \
         steps selected; {} near-tie selections",
        seen.rows,
        seen.worst,
        seen.sum / seen.rows.max(1) as f64,
        seen.selecting_steps,
        seen.near_ties
    );
    seen
}

/// Every dumped layer under `runs`, in bf16 and f16 caches, each run also with 8-bit statistics
/// where it selects; a summary per layer (worst relative error per element type).
fn run_all(runs: &[Run]) {
    let gpu = gpu();
    let dump = dump();
    let mut summary: HashMap<(usize, &'static str), f64> = HashMap::new();
    for layer in &dump.layers {
        for run in runs {
            let stats: &[StatsFormat] = if run.budget.is_some() {
                &[StatsFormat::Half, StatsFormat::DEVICE_INT8]
            } else {
                &[StatsFormat::Half]
            };
            for &s in stats {
                let run = Run { stats: s, ..*run };
                let b = run_layer::<bf16>(&gpu, dump, layer, run);
                let f = run_layer::<f16>(&gpu, dump, layer, run);
                for (ty, seen) in [("bf16", b), ("f16", f)] {
                    let w = summary.entry((layer.layer, ty)).or_default();
                    *w = w.max(seen.worst);
                }
            }
        }
    }
    for layer in &dump.layers {
        eprintln!(
            "layer {}: worst relative error bf16 {:.3e}, f16 {:.3e} over {} configurations",
            layer.layer,
            summary[&(layer.layer, "bf16")],
            summary[&(layer.layer, "f16")],
            runs.len()
        );
    }
}

const DENSE: [bool; 3] = [false; 3];

fn hierarchical(name: &'static str, budget: usize, reuse: usize) -> Run {
    Run {
        name,
        page_tokens: 64,
        logical_page_tokens: 16,
        budget: Some(budget),
        reuse,
        streaming: DENSE,
        stats: StatsFormat::Half,
        unit: SelectionUnit::PhysicalPage,
        aggregation: GqaAggregation::Max,
    }
}

/// LServe's hierarchical selection: physical pages 64, logical 16, budgets 512 and 2048, reuse
/// 1 and 4.
#[test]
#[ignore = "needs a CUDA GPU and LSERVE_ACTIVATIONS (scripts/dump_activations.sh)"]
fn hierarchical_selection_on_real_activations() {
    run_all(&[
        hierarchical("lserve-b512-r1", 512, 1),
        hierarchical("lserve-b512-r4", 512, 4),
        hierarchical("lserve-b2048-r1", 2048, 1),
        hierarchical("lserve-b2048-r4", 2048, 4),
    ]);
}

/// Flat (Quest-like) selection: pages of 16 tokens with statistics per page, every step.
#[test]
#[ignore = "needs a CUDA GPU and LSERVE_ACTIVATIONS (scripts/dump_activations.sh)"]
fn flat_selection_on_real_activations() {
    let flat = |name, budget| Run {
        name,
        page_tokens: 16,
        logical_page_tokens: 16,
        budget: Some(budget),
        reuse: 1,
        streaming: DENSE,
        stats: StatsFormat::Half,
        unit: SelectionUnit::PhysicalPage,
        aggregation: GqaAggregation::Max,
    };
    run_all(&[flat("flat-b512", 512), flat("flat-b2048", 2048)]);
}

/// Logical-page selection (16-token logical pages picked inside 64-token physical pages) at
/// budgets 512 and 2048, reuse 1 and 4, one run with a streaming head; and LServe's hierarchical
/// selection with the group's scores averaged instead of maxed.
#[test]
#[ignore = "needs a CUDA GPU and LSERVE_ACTIVATIONS (scripts/dump_activations.sh)"]
fn logical_pages_and_mean_aggregation_on_real_activations() {
    let logical = |name, budget, reuse| Run {
        unit: SelectionUnit::LogicalPage,
        ..hierarchical(name, budget, reuse)
    };
    run_all(&[
        logical("logical-b512-r1", 512, 1),
        logical("logical-b2048-r4", 2048, 4),
        Run {
            streaming: [false, true, false],
            ..logical("logical-b512-r4-stream1", 512, 4)
        },
        Run {
            aggregation: GqaAggregation::Mean,
            ..hierarchical("lserve-mean-b512-r1", 512, 1)
        },
    ]);
}

/// Streaming heads (sinks 64 + local 256) beside dense heads that select or attend to every
/// page, and dense decode with no streaming head.
#[test]
#[ignore = "needs a CUDA GPU and LSERVE_ACTIVATIONS (scripts/dump_activations.sh)"]
fn streaming_heads_and_dense_decode_on_real_activations() {
    let one = [false, true, false];
    let two = [true, false, true];
    run_all(&[
        Run {
            streaming: one,
            ..hierarchical("lserve-b512-r4-stream1", 512, 4)
        },
        Run {
            streaming: two,
            ..hierarchical("lserve-b2048-r4-stream2", 2048, 4)
        },
        Run {
            budget: None,
            streaming: one,
            ..hierarchical("stream1-dense", 512, 1)
        },
        Run {
            budget: None,
            ..hierarchical("dense", 512, 1)
        },
    ]);
}
