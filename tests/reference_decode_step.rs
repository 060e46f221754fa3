//! Multi-step decode runs of the cache-integrated reference against a naive model that keeps the
//! whole history in plain vectors: selection recomputed exactly on due steps and held otherwise
//! (newest page always added), dense attend-all below `dynamic_min_len`, streaming heads seeing
//! exactly the sinks and the last `local_tokens` tokens as the ring wraps; outputs against plain
//! softmax over an explicit token mask.

mod common;

use common::{f16_or_bf16, head_pattern};
use std::collections::BTreeMap;

use half::bf16;
use lserve::config::{GqaAggregation, SelectionUnit, SparsityConfig};
use lserve::dtype::Element;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager};
use lserve::reference::decode::{decode_step, HeadVisit};
use lserve::reference::kv_write::{
    pool_key_stats, stored_key_stats, update_key_stats, write_tokens,
};
use lserve::reference::select::ReuseState;
use lserve::LserveError;
use proptest::prelude::*;
use rand::{rngs::StdRng, Rng, SeedableRng};

const D: usize = 64;

#[derive(Debug, Clone)]
struct Case {
    kv_heads: usize,
    group: usize,
    kinds: Vec<Vec<bool>>, // [layer][kv_head]: true = streaming
    n_l: usize,
    g: usize,
    k: usize,
    sink: usize,
    local: usize,
    dynamic_min_len: usize,
    reuse: usize,
    first: bool,
    mean: bool,
    /// Logical-page selection (`SelectionUnit::LogicalPage`), else physical pages.
    logical: bool,
    prefill: Vec<usize>,
    steps: usize,
    f16: bool,
    seed: u64,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (1usize..=3, 1usize..=3, 1usize..=2).prop_flat_map(|(kv_heads, group, layers)| {
        (
            prop::collection::vec(prop::collection::vec(any::<bool>(), kv_heads), layers),
            (1usize..=4, 1usize..=3, 1usize..=3),
            (0usize..=3, 1usize..=8, 0usize..=20),
            (
                prop_oneof![Just(1usize), Just(4usize), 2usize..=5],
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
            ),
            (
                prop::collection::vec(0usize..=30, 1..=3),
                1usize..=25,
                any::<bool>(),
                any::<u64>(),
            ),
        )
            .prop_map(
                move |(
                    kinds,
                    (n_l, g, k),
                    (sink, local, dml),
                    (reuse, first, mean, logical),
                    (prefill, steps, f16, seed),
                )| Case {
                    kv_heads,
                    group,
                    kinds,
                    n_l,
                    g,
                    k,
                    sink,
                    local,
                    dynamic_min_len: dml,
                    reuse,
                    first,
                    mean,
                    logical,
                    prefill,
                    steps,
                    f16,
                    seed,
                },
            )
    })
}

/// Deliberate mistakes on the naive side, to show the comparison can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tweak {
    None,
    /// Select on every step (no reuse).
    NoReuse,
    /// Streaming heads attend to every token.
    StreamingAsCausal,
}

fn random_row<E: Element>(rng: &mut StdRng, n: usize) -> Vec<E> {
    (0..n)
        .map(|_| E::from_f32(rng.gen_range(-2.0f32..2.0)))
        .collect()
}

impl Case {
    /// Tokens of a selection unit: a logical page under logical-page selection, else a
    /// physical page.
    fn unit(&self) -> usize {
        if self.logical {
            self.n_l
        } else {
            self.n_l * self.g
        }
    }

    /// Units a selection picks by score: the budget (`k` physical pages) in units.
    fn top_k(&self) -> usize {
        self.k * self.n_l * self.g / self.unit()
    }
}

/// Naive selection over the full key history of one KV head (`keys[t]` rows): brute-force
/// per-logical-page min/max, bounds per query head, aggregation, max per unit (a physical page,
/// or the logical page itself), then a full sort of the candidates by (score desc, index asc).
fn naive_select(case: &Case, q_group: &[Vec<f64>], keys: &[Vec<f64>]) -> Vec<u32> {
    let len = keys.len();
    let logical = len.div_ceil(case.n_l);
    let units = len.div_ceil(case.unit());
    let per_unit = case.unit() / case.n_l;
    let mut phys = vec![f64::NEG_INFINITY; units];
    for lp in 0..logical {
        let toks: Vec<&Vec<f64>> = keys.iter().skip(lp * case.n_l).take(case.n_l).collect();
        let per_head: Vec<f64> = q_group
            .iter()
            .map(|q| {
                (0..D)
                    .map(|i| {
                        let hi = toks.iter().map(|k| k[i]).fold(f64::NEG_INFINITY, f64::max);
                        let lo = toks.iter().map(|k| k[i]).fold(f64::INFINITY, f64::min);
                        (q[i] * hi).max(q[i] * lo)
                    })
                    .sum::<f64>()
            })
            .collect();
        let agg = if case.mean {
            per_head.iter().sum::<f64>() / per_head.len() as f64
        } else {
            per_head.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
        };
        let p = lp / per_unit;
        phys[p] = phys[p].max(agg);
    }
    let newest = units - 1;
    let mut cands: Vec<(f64, usize)> = (0..newest)
        .filter(|&p| !(case.first && p == 0))
        .map(|p| (phys[p], p))
        .collect();
    cands.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
    let mut sel: Vec<u32> = cands
        .iter()
        .take(case.top_k())
        .map(|c| c.1 as u32)
        .collect();
    sel.push(newest as u32);
    if case.first {
        sel.push(0);
    }
    sel.sort();
    sel.dedup();
    sel
}

fn naive_softmax(
    q: &[f64],
    keys: &[Vec<f64>],
    values: &[Vec<f64>],
    mask: &[bool],
    scale: f64,
) -> Vec<f64> {
    let s: Vec<f64> = keys
        .iter()
        .zip(mask)
        .map(|(k, &m)| {
            if m {
                scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>()
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
    let z: f64 = p.iter().sum();
    (0..q.len())
        .map(|i| p.iter().zip(values).map(|(w, v)| w * v[i]).sum::<f64>() / z)
        .collect()
}

fn widen<E: Element>(xs: &[E]) -> Vec<f64> {
    xs.iter().map(|x| x.to_f32() as f64).collect()
}

/// Runs `case` through the reference and the naive model; `Err` describes the first mismatch.
fn run<E: Element>(case: &Case, tweak: Tweak) -> Result<(), String> {
    let layers = case.kinds.len();
    let (hkv, group) = (case.kv_heads, case.group);
    let hq = hkv * group;
    let geometry = ModelGeometry::new(layers, hq, hkv, D).unwrap();
    let pattern = head_pattern(geometry, &case.kinds);
    let n_p = case.n_l * case.g;
    let config = SparsityConfig {
        sink_tokens: case.sink,
        local_tokens: case.local,
        token_budget: case.k * n_p,
        page_tokens: n_p,
        logical_page_tokens: case.n_l,
        reuse_interval: case.reuse,
        dynamic_min_len: case.dynamic_min_len,
        gqa_aggregation: if case.mean {
            GqaAggregation::Mean
        } else {
            GqaAggregation::Max
        },
        always_include_first_page: case.first,
        softmax_scale: None,
        stats_format: Default::default(),
        selection_unit: if case.logical {
            SelectionUnit::LogicalPage
        } else {
            SelectionUnit::PhysicalPage
        },
    };
    let max_len: usize = 64;
    let batch = case.prefill.len();
    let capacity = batch * max_len.div_ceil(n_p) + 1;
    let mut mgr =
        KvCacheManager::new(geometry, pattern.clone(), config, capacity, batch, max_len).unwrap();
    let mut cache = HostKvCache::<E>::for_manager(&mgr).unwrap();
    let mut tables = IndexTables::for_manager(&mgr).unwrap();
    let mut reuse = ReuseState::new(case.reuse).unwrap();
    let mut rng = StdRng::seed_from_u64(case.seed);
    let unit = case.unit();
    let scale = config.softmax_scale_for(D) as f64;

    // Naive history [seq][layer][kv_head] -> rows; held selections per (seq, layer, kv_head).
    let mut hist_k = vec![vec![vec![Vec::<Vec<f64>>::new(); hkv]; layers]; batch];
    let mut hist_v = hist_k.clone();
    let mut held: BTreeMap<(usize, usize, usize), Vec<u32>> = BTreeMap::new();

    let mut seqs = Vec::new();
    // Prefill (a sequence with 0 prefill tokens starts at its first decode step).
    for (b, &n) in case.prefill.iter().enumerate() {
        let seq = mgr.add_sequence().unwrap();
        seqs.push(seq);
        if n == 0 {
            continue;
        }
        mgr.reserve(seq, n).unwrap();
        for layer in 0..layers {
            let k: Vec<E> = random_row(&mut rng, n * hkv * D);
            let v: Vec<E> = random_row(&mut rng, n * hkv * D);
            write_tokens(&mut cache, layer, &mgr.view(seq).unwrap(), 0, &k, &v).unwrap();
            for t in 0..n {
                for h in 0..hkv {
                    hist_k[b][layer][h].push(widen(&k[(t * hkv + h) * D..][..D]));
                    hist_v[b][layer][h].push(widen(&v[(t * hkv + h) * D..][..D]));
                }
            }
        }
    }

    for step in 0..case.steps {
        for &seq in &seqs {
            mgr.reserve(seq, 1).unwrap();
        }
        for layer in 0..layers {
            let q: Vec<E> = random_row(&mut rng, batch * hq * D);
            let k: Vec<E> = random_row(&mut rng, batch * hkv * D);
            let v: Vec<E> = random_row(&mut rng, batch * hkv * D);
            let got = decode_step(
                &mgr,
                &mut cache,
                &mut tables,
                &mut reuse,
                layer,
                &seqs,
                &q,
                &k,
                &v,
            )
            .map_err(|e| format!("decode_step: {e}"))?;
            for (b, &seq) in seqs.iter().enumerate() {
                for h in 0..hkv {
                    hist_k[b][layer][h].push(widen(&k[(b * hkv + h) * D..][..D]));
                    hist_v[b][layer][h].push(widen(&v[(b * hkv + h) * D..][..D]));
                }
                let len = mgr.len(seq).unwrap();
                assert_eq!(mgr.decode_step(seq).unwrap(), step as u64);
                for h in 0..hkv {
                    let (keys, values) = (&hist_k[b][layer][h], &hist_v[b][layer][h]);
                    assert_eq!(keys.len(), len);
                    let q_group: Vec<Vec<f64>> = (0..group)
                        .map(|j| widen(&q[(b * hq + h * group + j) * D..][..D]))
                        .collect();
                    let visit = &got.visits[b][h];
                    let mask: Vec<bool> = if case.kinds[layer][h] {
                        if *visit != HeadVisit::Streaming {
                            return Err(format!(
                                "step {step} seq {b} head {h}: {visit:?}, want streaming"
                            ));
                        }
                        let t = len - 1;
                        (0..len)
                            .map(|j| {
                                tweak == Tweak::StreamingAsCausal
                                    || j < case.sink
                                    || t - j < case.local
                            })
                            .collect()
                    } else if len <= case.dynamic_min_len {
                        if *visit != HeadVisit::AllPages {
                            return Err(format!(
                                "step {step} seq {b} head {h}: {visit:?}, want all pages"
                            ));
                        }
                        vec![true; len]
                    } else {
                        let key = (b, layer, h);
                        let due = step % case.reuse == 0
                            || !held.contains_key(&key)
                            || tweak == Tweak::NoReuse;
                        let newest = ((len - 1) / unit) as u32;
                        let pages = if due {
                            let sel = naive_select(case, &q_group, keys);
                            held.insert(key, sel.clone());
                            sel
                        } else {
                            let mut p = held[&key].clone();
                            if !p.contains(&newest) {
                                p.push(newest);
                            }
                            p.sort();
                            p
                        };
                        assert!(pages.contains(&newest));
                        let want = HeadVisit::Selected {
                            pages: pages.clone(),
                            selected_now: due,
                        };
                        if *visit != want {
                            return Err(format!("step {step} seq {b} layer {layer} head {h}: {visit:?}, want {want:?}"));
                        }
                        // The index table holds the units' ids (a physical page's id, or
                        // `physical * N_P / N_L + sub`), ascending sequence order.
                        let bt = mgr.block_table(seq).unwrap();
                        let per_page = (n_p / unit) as u32;
                        let phys: Vec<u32> = pages
                            .iter()
                            .map(|&u| {
                                let page = bt.physical((u / per_page) as usize).unwrap();
                                page * per_page + u % per_page
                            })
                            .collect();
                        let slot = mgr.slot(seq).unwrap() as usize;
                        let head = pattern.compact_index(layer, h);
                        assert_eq!(tables.get(layer, slot, head).unwrap(), &phys[..]);
                        (0..len)
                            .map(|j| pages.contains(&((j / unit) as u32)))
                            .collect()
                    };
                    for (j, qh) in q_group.iter().enumerate() {
                        let want = naive_softmax(qh, keys, values, &mask, scale);
                        let row = (b * hq + h * group + j) * D;
                        let got_row = &got.out[row..row + D];
                        let diff: f64 = got_row
                            .iter()
                            .zip(&want)
                            .map(|(a, b)| (a - b).powi(2))
                            .sum();
                        let norm: f64 = want.iter().map(|x| x * x).sum();
                        let rel = (diff / norm).sqrt();
                        if rel.is_nan() || rel >= 1e-9 {
                            return Err(format!(
                                "step {step} seq {b} layer {layer} q head {}: relative error {rel}",
                                h * group + j
                            ));
                        }
                    }
                    // Stored statistics equal brute force over the history.
                    if !case.kinds[layer][h] {
                        let stats =
                            stored_key_stats(&cache, layer, &mgr.view(seq).unwrap(), h).unwrap();
                        for lp in 0..len.div_ceil(case.n_l) {
                            let toks = &keys[lp * case.n_l..((lp + 1) * case.n_l).min(len)];
                            for i in 0..D {
                                let lo = toks.iter().map(|k| k[i]).fold(f64::INFINITY, f64::min);
                                let hi =
                                    toks.iter().map(|k| k[i]).fold(f64::NEG_INFINITY, f64::max);
                                if stats.kmin(lp)[i] as f64 != lo || stats.kmax(lp)[i] as f64 != hi
                                {
                                    return Err(format!(
                                        "step {step}: stats of logical page {lp} differ"
                                    ));
                                }
                            }
                        }
                    }
                }
            }
        }
        for &seq in &seqs {
            mgr.advance_decode_step(seq).unwrap();
        }
    }
    Ok(())
}

fn run_case(case: &Case, tweak: Tweak) -> Result<(), String> {
    f16_or_bf16!(case.f16, run(case, tweak))
}

proptest! {
    #[test]
    fn decode_steps_match_naive_model(case in case_strategy()) {
        if let Err(e) = run_case(&case, Tweak::None) {
            prop_assert!(false, "{}", e);
        }
    }
}

fn fixed_case(reuse: usize) -> Case {
    Case {
        kv_heads: 2,
        group: 2,
        kinds: vec![vec![false, true]],
        n_l: 2,
        g: 2,
        k: 2,
        sink: 2,
        local: 5,
        dynamic_min_len: 6,
        reuse,
        first: true,
        mean: false,
        logical: false,
        prefill: vec![3, 17],
        steps: 24,
        f16: false,
        seed: 5,
    }
}

/// The two reuse intervals the design names, on a run long enough to wrap the ring several times.
#[test]
fn reuse_one_and_four_with_a_wrapping_ring() {
    for reuse in [1, 4] {
        for logical in [false, true] {
            run_case(
                &Case {
                    logical,
                    ..fixed_case(reuse)
                },
                Tweak::None,
            )
            .unwrap();
        }
    }
}

/// The comparison can fail: a naive side that never reuses disagrees with C = 4, and one that
/// lets streaming heads see everything disagrees once the ring has wrapped.
#[test]
fn comparison_detects_wrong_reuse_and_wrong_streaming() {
    assert!(run_case(&fixed_case(4), Tweak::NoReuse).is_err());
    assert!(run_case(&fixed_case(1), Tweak::NoReuse).is_ok()); // C = 1 selects every step anyway
    assert!(run_case(&fixed_case(4), Tweak::StreamingAsCausal).is_err());
}

/// A step whose index tables are too small for an entry fails before writing anything: the
/// cache, the tables and the reuse state are as they were.
#[test]
fn a_failing_step_changes_nothing() {
    let g = ModelGeometry::new(1, 4, 2, D).unwrap();
    let pattern =
        HeadPattern::from_kinds(g, vec![vec![HeadKind::Dense, HeadKind::Streaming]]).unwrap();
    let config = SparsityConfig {
        sink_tokens: 4,
        local_tokens: 8,
        page_tokens: 16,
        logical_page_tokens: 4,
        token_budget: 32,
        dynamic_min_len: 1000, // dense decode: an entry needs every page
        ..Default::default()
    };
    let mut mgr = KvCacheManager::new(g, pattern.clone(), config, 8, 1, 100).unwrap();
    let mut cache = HostKvCache::<bf16>::for_manager(&mgr).unwrap();
    let seq = mgr.add_sequence().unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    let range = mgr.reserve(seq, 40).unwrap();
    let view = mgr.view(seq).unwrap();
    let (k, v) = (
        random_row::<bf16>(&mut rng, 40 * 2 * D),
        random_row::<bf16>(&mut rng, 40 * 2 * D),
    );
    write_tokens(&mut cache, 0, &view, range.start, &k, &v).unwrap();
    mgr.reserve(seq, 1).unwrap();
    // Three pages are needed; room for two.
    let mut tables = IndexTables::new(&pattern, 1, 2, 8).unwrap();
    let mut reuse = ReuseState::new(1).unwrap();
    let (cache_before, tables_before) = (cache.clone(), tables.clone());
    let q = random_row::<bf16>(&mut rng, 4 * D);
    let (k, v) = (
        random_row::<bf16>(&mut rng, 2 * D),
        random_row::<bf16>(&mut rng, 2 * D),
    );
    let err = decode_step(
        &mgr,
        &mut cache,
        &mut tables,
        &mut reuse,
        0,
        &[seq],
        &q,
        &k,
        &v,
    );
    assert!(
        matches!(
            err,
            Err(LserveError::InvalidArgument { what: "tables", .. })
        ),
        "the step should not fit the tables: {err:?}"
    );
    assert!(
        cache == cache_before && tables == tables_before,
        "a failed step wrote something"
    );
}

/// Pooling and updating the key statistics of a layer out of range is `InvalidArgument`, with
/// nothing written, never an out-of-bounds index.
#[test]
fn key_stats_of_a_layer_out_of_range_are_errors() {
    let g = ModelGeometry::new(2, 2, 2, D).unwrap();
    let config = SparsityConfig {
        page_tokens: 8,
        logical_page_tokens: 4,
        token_budget: 8,
        ..Default::default()
    };
    let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), config, 4, 1, 32).unwrap();
    let mut cache = HostKvCache::<bf16>::for_manager(&mgr).unwrap();
    let seq = mgr.add_sequence().unwrap();
    mgr.reserve(seq, 6).unwrap();
    let view = mgr.view(seq).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    let kv = random_row::<bf16>(&mut rng, 6 * 2 * D);
    write_tokens(&mut cache, 1, &view, 0, &kv, &kv).unwrap();
    let before = cache.clone();
    for layer in [2, usize::MAX] {
        assert!(matches!(
            pool_key_stats(&mut cache, layer, &view, 0..6),
            Err(LserveError::InvalidArgument { what: "layer", .. })
        ));
        assert!(matches!(
            pool_key_stats(&mut cache, layer, &view, 0..0),
            Err(LserveError::InvalidArgument { what: "layer", .. })
        ));
        assert!(matches!(
            update_key_stats(&mut cache, layer, &view, 5),
            Err(LserveError::InvalidArgument { what: "layer", .. })
        ));
    }
    assert!(cache == before, "a failed call wrote something");
    pool_key_stats(&mut cache, 1, &view, 0..6).unwrap();
    update_key_stats(&mut cache, 1, &view, 5).unwrap();
}

/// A Λ mask with no local tokens is one rule everywhere: the decode token set, prefill attention,
/// the streaming decode iterator and the config all answer `InvalidConfig { local_tokens }` (the
/// decode reference used to return the sinks alone). All of them are pure: nothing to change.
#[test]
fn lambda_without_local_tokens_is_rejected_in_decode_as_in_prefill() {
    use lserve::block_iter::streaming_decode_tokens;
    use lserve::reference::decode::decode_tokens;
    use lserve::reference::prefill::{prefill_attention, PrefillInput};
    use lserve::reference::TokenPattern;

    let is_local_tokens = |r: Result<(), LserveError>| {
        matches!(
            r,
            Err(LserveError::InvalidConfig {
                field: "local_tokens",
                ..
            })
        )
    };
    let x = [1.0f32; 4];
    for sink in [0, 3] {
        let lambda = |local_tokens| TokenPattern::Lambda {
            sink_tokens: sink,
            local_tokens,
        };
        let prefill = |p: TokenPattern| {
            prefill_attention(&PrefillInput {
                cu_seqlens: &[0, 4],
                q: &x,
                k: &x,
                v: &x,
                q_heads: 1,
                kv_heads: 1,
                head_dim: 1,
                patterns: &[p],
                block_mask: None,
                scale: 1.0,
            })
            .map(|_| ())
        };
        for len in [0, 1, 10] {
            assert!(is_local_tokens(decode_tokens(lambda(0), len).map(|_| ())));
            assert_eq!(
                decode_tokens(lambda(1), len).unwrap().last(),
                len.checked_sub(1).as_ref()
            );
        }
        assert!(is_local_tokens(prefill(lambda(0))));
        prefill(lambda(1)).unwrap();
        assert!(is_local_tokens(
            streaming_decode_tokens(10, sink, 0).map(|_| ())
        ));
        let config = SparsityConfig {
            sink_tokens: sink,
            local_tokens: 0,
            ..Default::default()
        };
        assert!(is_local_tokens(config.validate()));
    }
}

/// The geometry, pattern and config of the partial-change tests: one layer, a dense and a
/// streaming KV head (two query heads each), 16-token pages, selection past 20 tokens.
fn small_step_setup() -> (ModelGeometry, HeadPattern, SparsityConfig) {
    let g = ModelGeometry::new(1, 4, 2, D).unwrap();
    let pattern =
        HeadPattern::from_kinds(g, vec![vec![HeadKind::Dense, HeadKind::Streaming]]).unwrap();
    let config = SparsityConfig {
        sink_tokens: 4,
        local_tokens: 8,
        page_tokens: 16,
        logical_page_tokens: 4,
        token_budget: 16,
        dynamic_min_len: 20,
        reuse_interval: 4,
        ..Default::default()
    };
    (g, pattern, config)
}

/// One decode step's activations for `batch` sequences: `q [B][4][D]`, `k`, `v [B][2][D]`.
fn step_inputs(rng: &mut StdRng, batch: usize) -> (Vec<bf16>, Vec<bf16>, Vec<bf16>) {
    (
        random_row::<bf16>(rng, batch * 4 * D),
        random_row::<bf16>(rng, batch * 2 * D),
        random_row::<bf16>(rng, batch * 2 * D),
    )
}

/// A batch whose second sequence has a page past a cache sized for a smaller pool fails with
/// `PageOutOfRange` before the first sequence's token (K/V, key statistics) is written.
#[test]
fn a_step_past_the_cache_capacity_changes_nothing() {
    let (g, pattern, config) = small_step_setup();
    let mut mgr = KvCacheManager::new(g, pattern.clone(), config, 8, 2, 100).unwrap();
    let (a, b) = (mgr.add_sequence().unwrap(), mgr.add_sequence().unwrap());
    mgr.reserve(a, 10).unwrap();
    mgr.reserve(b, 10).unwrap();
    let (page_a, page_b) = (
        mgr.block_table(a).unwrap().physical(0).unwrap(),
        mgr.block_table(b).unwrap().physical(0).unwrap(),
    );
    // A cache that holds a's page and not b's.
    let capacity = page_a as usize + 1;
    assert!(page_b as usize >= capacity, "pages {page_a}, {page_b}");
    let mut cache = HostKvCache::<bf16>::new(&pattern, &config, capacity, 2).unwrap();
    let mut tables = IndexTables::for_manager(&mgr).unwrap();
    let mut reuse = ReuseState::new(config.reuse_interval).unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    let (q, k, v) = step_inputs(&mut rng, 2);
    let before = (cache.clone(), tables.clone(), reuse.clone());
    let r = decode_step(
        &mgr,
        &mut cache,
        &mut tables,
        &mut reuse,
        0,
        &[a, b],
        &q,
        &k,
        &v,
    );
    assert!(
        matches!(r, Err(LserveError::PageOutOfRange { page, capacity: c })
            if page == page_b && c as usize == capacity),
        "{r:?}"
    );
    assert!(
        (cache.clone(), tables.clone(), reuse.clone()) == before,
        "a failed step wrote something"
    );
    // The same batch without b runs.
    let (q, k, v) = step_inputs(&mut rng, 1);
    decode_step(
        &mgr,
        &mut cache,
        &mut tables,
        &mut reuse,
        0,
        &[a],
        &q,
        &k,
        &v,
    )
    .unwrap();
}

/// Index tables sized for a smaller pool than a selecting sequence's pages fail with
/// `PageOutOfRange` before the token, the key statistics, the held selection or an entry is
/// written.
#[test]
fn a_step_past_the_tables_pool_changes_nothing() {
    let (g, pattern, config) = small_step_setup();
    let mut mgr = KvCacheManager::new(g, pattern.clone(), config, 8, 1, 100).unwrap();
    let seq = mgr.add_sequence().unwrap();
    let mut rng = StdRng::seed_from_u64(12);
    let mut cache = HostKvCache::<bf16>::for_manager(&mgr).unwrap();
    let range = mgr.reserve(seq, 40).unwrap();
    let kv = random_row::<bf16>(&mut rng, 40 * 2 * D);
    write_tokens(
        &mut cache,
        0,
        &mgr.view(seq).unwrap(),
        range.start,
        &kv,
        &kv,
    )
    .unwrap();
    mgr.reserve(seq, 1).unwrap(); // L = 41 > dynamic_min_len: selection is due
    let pages = mgr.block_table(seq).unwrap().pages().to_vec();
    let top = *pages.iter().max().unwrap();
    let full = IndexTables::for_manager(&mgr).unwrap();
    let cap = full.layer(0).unwrap().entry_capacity();
    let mut tables = IndexTables::new(&pattern, 1, cap, top as usize).unwrap();
    let mut reuse = ReuseState::new(config.reuse_interval).unwrap();
    let (q, k, v) = step_inputs(&mut rng, 1);
    let before = (cache.clone(), tables.clone(), reuse.clone());
    let r = decode_step(
        &mgr,
        &mut cache,
        &mut tables,
        &mut reuse,
        0,
        &[seq],
        &q,
        &k,
        &v,
    );
    assert!(
        matches!(r, Err(LserveError::PageOutOfRange { page, capacity }) if page == top && capacity == top),
        "{r:?}"
    );
    assert!(
        (cache.clone(), tables.clone(), reuse.clone()) == before,
        "a failed step wrote something"
    );
    let mut tables = full;
    let o = decode_step(
        &mgr,
        &mut cache,
        &mut tables,
        &mut reuse,
        0,
        &[seq],
        &q,
        &k,
        &v,
    )
    .unwrap();
    assert!(matches!(
        o.visits[0][0],
        HeadVisit::Selected {
            selected_now: true,
            ..
        }
    ));
}

/// A held selection that does not fit the sequence (from a longer sequence of another manager
/// with the same id) is `InvalidArgument` on a reusing step, before anything is written.
#[test]
fn a_step_reusing_a_foreign_selection_changes_nothing() {
    let (g, pattern, config) = small_step_setup();
    let mut rng = StdRng::seed_from_u64(13);
    let prefill_step = |mgr: &mut KvCacheManager, rng: &mut StdRng, len: usize| {
        let seq = mgr.add_sequence().unwrap();
        let mut cache = HostKvCache::<bf16>::for_manager(mgr).unwrap();
        let range = mgr.reserve(seq, len).unwrap();
        let kv = random_row::<bf16>(rng, len * 2 * D);
        write_tokens(
            &mut cache,
            0,
            &mgr.view(seq).unwrap(),
            range.start,
            &kv,
            &kv,
        )
        .unwrap();
        mgr.reserve(seq, 1).unwrap();
        (seq, cache)
    };
    // A long sequence selects on its step 0; its selection includes its newest page, 6.
    let mut long = KvCacheManager::new(g, pattern.clone(), config, 8, 1, 200).unwrap();
    let (seq, mut long_cache) = prefill_step(&mut long, &mut rng, 100);
    let mut tables = IndexTables::for_manager(&long).unwrap();
    let mut reuse = ReuseState::new(config.reuse_interval).unwrap();
    let (q, k, v) = step_inputs(&mut rng, 1);
    decode_step(
        &long,
        &mut long_cache,
        &mut tables,
        &mut reuse,
        0,
        &[seq],
        &q,
        &k,
        &v,
    )
    .unwrap();
    // A short sequence of the same id at step 1 (not due) would reuse it.
    let mut short = KvCacheManager::new(g, pattern.clone(), config, 8, 1, 200).unwrap();
    let (short_seq, mut cache) = prefill_step(&mut short, &mut rng, 40);
    assert_eq!(short_seq, seq);
    short.advance_decode_step(seq).unwrap();
    let mut tables = IndexTables::for_manager(&short).unwrap();
    let before = (cache.clone(), tables.clone(), reuse.clone());
    let r = decode_step(
        &short,
        &mut cache,
        &mut tables,
        &mut reuse,
        0,
        &[seq],
        &q,
        &k,
        &v,
    );
    assert!(
        matches!(r, Err(LserveError::InvalidArgument { what: "reuse", .. })),
        "{r:?}"
    );
    assert!(
        (cache.clone(), tables.clone(), reuse.clone()) == before,
        "a failed step wrote something"
    );
    // With a fresh reuse state the short sequence selects instead.
    let mut reuse = ReuseState::new(config.reuse_interval).unwrap();
    decode_step(
        &short,
        &mut cache,
        &mut tables,
        &mut reuse,
        0,
        &[seq],
        &q,
        &k,
        &v,
    )
    .unwrap();
}

/// `write_tokens` over pages past a cache sized for a smaller pool fails with `PageOutOfRange`
/// before the tokens on pages it holds are written; `pool_key_stats` likewise before the pages
/// it holds are pooled.
#[test]
fn kv_writes_past_the_cache_capacity_change_nothing() {
    let (g, pattern, config) = small_step_setup();
    let mut mgr = KvCacheManager::new(g, pattern.clone(), config, 8, 1, 100).unwrap();
    let seq = mgr.add_sequence().unwrap();
    mgr.reserve(seq, 40).unwrap(); // three pages
    let view = mgr.view(seq).unwrap();
    let pages = view.block_table.pages().to_vec();
    let capacity = pages[0].max(pages[1]) as usize + 1;
    assert!(pages[2] as usize >= capacity, "{pages:?}");
    let mut cache = HostKvCache::<bf16>::new(&pattern, &config, capacity, 1).unwrap();
    let mut rng = StdRng::seed_from_u64(14);
    let kv = random_row::<bf16>(&mut rng, 40 * 2 * D);
    let before = cache.clone();
    let out_of_range = |r: Result<(), LserveError>| {
        matches!(r, Err(LserveError::PageOutOfRange { page, capacity: c })
            if page == pages[2] && c as usize == capacity)
    };
    assert!(out_of_range(write_tokens(
        &mut cache, 0, &view, 0, &kv, &kv
    )));
    assert!(cache == before, "a failed write_tokens wrote something");
    // The two pages the cache holds: written token by token, statistics not yet pooled.
    let row = 2 * D;
    for pos in 0..32 {
        let src = &kv[pos * row..][..row];
        cache.write_token(0, &view, pos, src, src).unwrap();
    }
    let unpooled = cache.clone();
    assert!(out_of_range(pool_key_stats(&mut cache, 0, &view, 0..40)));
    assert!(cache == unpooled, "a failed pooling wrote something");
    pool_key_stats(&mut cache, 0, &view, 0..32).unwrap();
    assert!(cache != unpooled);
}

/// Logical-page selection is flat selection over the physical layout: a cache of 8-token
/// physical pages selecting its 2-token logical pages attends exactly the tokens a cache of
/// 2-token pages (physical = logical) selecting pages attends, so every step's output and visits
/// are equal, bit for bit; selecting the physical pages of the first cache differs.
#[test]
fn logical_page_selection_is_flat_selection_over_the_physical_layout() {
    let geometry = ModelGeometry::new(2, 4, 2, D).unwrap();
    let pattern = HeadPattern::all_dense(geometry);
    let base = SparsityConfig {
        sink_tokens: 2,
        local_tokens: 4,
        token_budget: 8,
        page_tokens: 8,
        logical_page_tokens: 2,
        reuse_interval: 3,
        dynamic_min_len: 10,
        ..SparsityConfig::default()
    };
    let configs = [
        SparsityConfig {
            selection_unit: SelectionUnit::LogicalPage,
            ..base
        },
        SparsityConfig {
            page_tokens: 2,
            token_budget: 8,
            ..base
        },
        base,
    ];
    type Run = (Vec<Vec<f64>>, Vec<Vec<Vec<HeadVisit>>>);
    let run = |config: SparsityConfig| -> Run {
        let (batch, max_len) = (2, 64usize);
        let capacity = batch * max_len.div_ceil(config.page_tokens) + 1;
        let mut mgr =
            KvCacheManager::new(geometry, pattern.clone(), config, capacity, batch, max_len)
                .unwrap();
        let mut cache = HostKvCache::<bf16>::for_manager(&mgr).unwrap();
        let mut tables = IndexTables::for_manager(&mgr).unwrap();
        let mut reuse = ReuseState::new(config.reuse_interval).unwrap();
        let mut rng = StdRng::seed_from_u64(11);
        let seqs = [mgr.add_sequence().unwrap(), mgr.add_sequence().unwrap()];
        let (mut outs, mut visits) = (Vec::new(), Vec::new());
        for _ in 0..40 {
            for &seq in &seqs {
                mgr.reserve(seq, 1).unwrap();
            }
            for layer in 0..2 {
                let q: Vec<bf16> = random_row(&mut rng, batch * 4 * D);
                let k: Vec<bf16> = random_row(&mut rng, batch * 2 * D);
                let v: Vec<bf16> = random_row(&mut rng, batch * 2 * D);
                let o = decode_step(
                    &mgr,
                    &mut cache,
                    &mut tables,
                    &mut reuse,
                    layer,
                    &seqs,
                    &q,
                    &k,
                    &v,
                )
                .unwrap();
                outs.push(o.out);
                visits.push(o.visits);
            }
            for &seq in &seqs {
                mgr.advance_decode_step(seq).unwrap();
            }
        }
        (outs, visits)
    };
    let [logical, flat, physical] = configs.map(run);
    assert_eq!(logical, flat);
    assert_ne!(logical.0, physical.0);
    assert!(logical
        .1
        .iter()
        .flatten()
        .flatten()
        .any(|v| matches!(v, HeadVisit::Selected { .. })));
}
