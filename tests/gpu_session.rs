//! The engine's view on the GPU (`lserve::session::SparseAttention`), against the CPU reference
//! run in lockstep on a manager driven the same way (same ids, slots and pages):
//!
//! - 1000 decode steps over two layers with sequences joining (prefilled in batches, or
//!   decoding from an empty start) and leaving: every prefill's output against
//!   `reference::prefill`, every step's selected pages against the reference's (near-ties of the
//!   K-th score allowed, as `docs/ARCHITECTURE.md`'s equivalence rules), and on sampled steps the
//!   output of every layer and the whole cache; at the end no pool page is left;
//! - a decode step captured in graphs and replayed, with a sequence leaving and another joining
//!   at the same batch size, against the same steps launched eagerly on a second session;
//! - misuse: typed errors that leave the session usable.
//!
//! Ignored without a GPU (reported as ignored, never passed); `--ignored` runs them, and there a
//! missing GPU is a failure.

mod common;

use std::sync::Arc;

use common::{check_selection, gpu, head_pattern, random_vec, tolerance};
use half::bf16;
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{download_selection, GpuContext};
use lserve::head_pattern::HeadPattern;
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId};
use lserve::reference::decode::{decode_attention_tables, decode_step, HeadVisit};
use lserve::reference::kv_write::write_tokens;
use lserve::reference::prefill::prefill_layer;
use lserve::reference::select::{select_from_cache, ReuseState};
use lserve::session::{SequenceState, SparseAttention};
use lserve::LserveError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const D: usize = 64;
const SLOTS: usize = 4;
const MAX_LEN: usize = 400;

fn config() -> SparsityConfig {
    SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 16,
        token_budget: 48,
        sink_tokens: 16,
        local_tokens: 32,
        dynamic_min_len: 64,
        reuse_interval: 2,
        ..SparsityConfig::default()
    }
}

/// Two layers of 2 KV heads, 2 query heads each: layer 0 one dense and one streaming head,
/// layer 1 both dense.
fn pattern() -> HeadPattern {
    let g = ModelGeometry::new(2, 4, 2, D).unwrap();
    head_pattern(g, &[vec![false, true], vec![false, false]])
}

fn manager() -> KvCacheManager {
    let pages = SLOTS * config().pages_for_len(MAX_LEN);
    KvCacheManager::new(
        pattern().geometry().to_owned(),
        pattern(),
        config(),
        pages,
        SLOTS,
        MAX_LEN,
    )
    .unwrap()
}

/// `max over rows of ‖got - want‖ / ‖want‖`, rows of `d`.
fn worst_row_error(got: &[bf16], want: &[f64], d: usize) -> f64 {
    assert_eq!(got.len(), want.len());
    got.chunks(d)
        .zip(want.chunks(d))
        .map(|(g, w)| {
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for (x, y) in g.iter().zip(w) {
                num += (x.to_f64() - y) * (x.to_f64() - y);
                den += y * y;
            }
            (num / den.max(1e-30)).sqrt()
        })
        .fold(0.0, f64::max)
}

/// The CPU reference of a session: its own manager, driven in the same order.
struct Reference {
    mgr: KvCacheManager,
    host: HostKvCache<bf16>,
    tables: IndexTables,
    reuse: ReuseState,
}

impl Reference {
    fn new() -> Self {
        let mgr = manager();
        Self {
            host: HostKvCache::for_manager(&mgr).unwrap(),
            tables: IndexTables::for_manager(&mgr).unwrap(),
            reuse: ReuseState::new(config().reuse_interval).unwrap(),
            mgr,
        }
    }

    fn free(&mut self, seq: SeqId) {
        self.mgr.free_sequence(seq).unwrap();
        self.reuse.remove_sequence(seq.get());
    }
}

/// Per layer `q`, `k`, `v` of `rows` tokens (`[rows][H][D]`).
type Activations = Vec<[Vec<bf16>; 3]>;

fn activations(rng: &mut StdRng, layers: usize, rows: usize) -> Activations {
    let g = *pattern().geometry();
    (0..layers)
        .map(|_| {
            [
                random_vec(rng, rows * g.q_heads() * D),
                random_vec(rng, rows * g.kv_heads() * D),
                random_vec(rng, rows * g.kv_heads() * D),
            ]
        })
        .collect()
}

/// Prefills `chunks` (first chunks) on the session and the reference, and checks every
/// layer's output against the reference's prefill.
fn prefill_both(
    gpu: &GpuContext,
    session: &mut SparseAttention<bf16>,
    r: &mut Reference,
    rng: &mut StdRng,
    chunks: &[(SeqId, usize)],
) {
    let g = *pattern().geometry();
    let rows: usize = chunks.iter().map(|c| c.1).sum();
    let acts = activations(rng, g.layers(), rows);
    let s = gpu.stream();
    let mut pf = session.prefill(chunks).unwrap();
    let cu = pf.cu_seqlens();
    assert_eq!(pf.tokens(), rows);
    let mut outs = Vec::new();
    for (layer, [q, k, v]) in acts.iter().enumerate() {
        let (q, k, v) = (
            s.clone_htod(q).unwrap(),
            s.clone_htod(k).unwrap(),
            s.clone_htod(v).unwrap(),
        );
        let mut out = s.alloc_zeros::<bf16>(rows * g.q_heads() * D).unwrap();
        pf.layer(layer, &q, &k, &v, &mut out).unwrap();
        outs.push(s.clone_dtoh(&out).unwrap());
    }
    pf.finish().unwrap();
    let row = g.kv_heads() * D;
    for (b, &(seq, n)) in chunks.iter().enumerate() {
        assert_eq!(r.mgr.reserve(seq, n).unwrap(), 0..n);
        let view = r.mgr.view(seq).unwrap();
        for (layer, [_, k, v]) in acts.iter().enumerate() {
            let at = cu[b] * row..cu[b + 1] * row;
            write_tokens(&mut r.host, layer, &view, 0, &k[at.clone()], &v[at]).unwrap();
        }
        assert_eq!(
            session.sequences().state(seq).unwrap(),
            SequenceState::Ready
        );
    }
    for (layer, [q, k, v]) in acts.iter().enumerate() {
        let want = prefill_layer(&pattern(), &config(), layer, &cu, q, k, v, None).unwrap();
        let err = worst_row_error(&outs[layer], &want.out, D);
        assert!(
            err < tolerance::<bf16>(),
            "prefill {chunks:?}, layer {layer}: worst row error {err:.2e}"
        );
    }
}

/// Which (sequence, layer, dense KV head) hold a selection that differs from the reference's
/// since a near-tie.
type Diverged = std::collections::BTreeSet<(SeqId, usize, usize)>;

/// Compares the session's index entries of the batch with the reference's after a step: equal,
/// or (on a step where the reference selected) a near-tie of the K-th score, after which that
/// head's selections may differ until both select the same again.
#[allow(clippy::too_many_arguments)]
fn check_entries(
    gpu: &GpuContext,
    session: &SparseAttention<bf16>,
    r: &Reference,
    batch: &[SeqId],
    layer: usize,
    q: &[bf16],
    visits: &[Vec<HeadVisit>],
    diverged: &mut Diverged,
    step: usize,
) {
    let p = pattern();
    let g = *p.geometry();
    let hd = p.dense_heads(layer);
    if hd == 0 {
        return;
    }
    let state = download_selection(gpu, session.cache(), layer).unwrap();
    for (b, &seq) in batch.iter().enumerate() {
        let view = r.mgr.view(seq).unwrap();
        let slot = view.slot as usize;
        // Up to `dynamic_min_len` the attention reads every page from the block table, not the
        // index entries.
        if !config().uses_page_selection(view.len) {
            continue;
        }
        for &h in p.dense_kv_heads(layer) {
            let dh = p.compact_index(layer, h);
            let e = slot * hd + dh;
            let n = state.index_lens[e] as usize;
            let got = &state.index_pages[e * state.entry_capacity..][..n];
            let want = r.tables.get(layer, slot, dh).unwrap();
            let key = (seq, layer, h);
            let selected_now = matches!(
                visits[b][h],
                HeadVisit::Selected {
                    selected_now: true,
                    ..
                }
            );
            if got == want {
                if selected_now {
                    diverged.remove(&key);
                }
                continue;
            }
            if !selected_now {
                assert!(
                    diverged.contains(&key),
                    "step {step}, layer {layer}, seq {}, head {h}: entries differ on a reuse \
                     step: device {got:?}, reference {want:?}",
                    seq.get()
                );
                continue;
            }
            let q_group: Vec<f32> = q[(b * g.q_heads() + h * g.group()) * D..][..g.group() * D]
                .iter()
                .map(|x| x.to_f32())
                .collect();
            let sel = select_from_cache(&r.host, layer, &view, h, &q_group).unwrap();
            let logical: Vec<u32> = got
                .iter()
                .map(|&x| {
                    view.block_table
                        .pages()
                        .iter()
                        .position(|&y| y == x)
                        .unwrap_or(usize::MAX) as u32
                })
                .collect();
            let c = config();
            let near_tie = check_selection(
                &logical,
                &sel,
                c.pages_per_selection(),
                c.always_include_first_page,
            );
            assert!(
                near_tie.is_ok(),
                "step {step}, layer {layer}, seq {}, head {h}: device {got:?}, reference \
                 {want:?}: {near_tie:?}",
                seq.get()
            );
            diverged.insert(key);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn a_thousand_steps_with_sequences_joining_and_leaving_match_the_reference() {
    let gpu = Arc::new(gpu());
    let g = *pattern().geometry();
    let (hq, hkv, layers) = (g.q_heads(), g.kv_heads(), g.layers());
    let mut session = SparseAttention::<bf16>::new(gpu.clone(), manager(), SLOTS).unwrap();
    let mut r = Reference::new();
    let mut rng = StdRng::seed_from_u64(18);
    let s = gpu.stream().clone();
    // Per layer device buffers of the largest batch (a step uses the first B rows).
    let alloc = |n: usize| -> Vec<_> {
        (0..layers)
            .map(|_| s.alloc_zeros::<bf16>(n).unwrap())
            .collect()
    };
    let (mut q_dev, mut k_dev, mut v_dev) = (
        alloc(SLOTS * hq * D),
        alloc(SLOTS * hkv * D),
        alloc(SLOTS * hkv * D),
    );
    let mut out_dev = alloc(SLOTS * hq * D);
    // Live sequences and the length each leaves at.
    let mut live: Vec<(SeqId, usize)> = Vec::new();
    let mut diverged = Diverged::new();
    let (mut joined, mut left, mut sampled) = (0usize, 0usize, 0usize);

    for step in 0..1000 {
        // Joins: up to the free slots, prefilled together (a few start empty and decode at once).
        let mut joins_now = false;
        if live.len() < SLOTS && (live.is_empty() || rng.gen_bool(0.08)) {
            let n = rng.gen_range(1..=(SLOTS - live.len()).min(2));
            let mut chunks = Vec::new();
            for _ in 0..n {
                let seq = session.add_sequence().unwrap();
                assert_eq!(r.mgr.add_sequence().unwrap(), seq);
                let prompt = if rng.gen_bool(0.1) {
                    0
                } else {
                    rng.gen_range(1..=180)
                };
                if prompt > 0 {
                    chunks.push((seq, prompt));
                }
                live.push((seq, (prompt + rng.gen_range(20..=220)).min(MAX_LEN)));
                joined += 1;
            }
            if !chunks.is_empty() {
                prefill_both(&gpu, &mut session, &mut r, &mut rng, &chunks);
            }
            joins_now = true;
        }
        // The batch: every live sequence, in a random order.
        let mut batch: Vec<SeqId> = live.iter().map(|l| l.0).collect();
        for i in (1..batch.len()).rev() {
            batch.swap(i, rng.gen_range(0..=i));
        }
        let b = batch.len();
        let acts = activations(&mut rng, layers, b);
        let mut step_ = session.decode(&batch).unwrap();
        for &seq in &batch {
            r.mgr.reserve(seq, 1).unwrap();
        }
        let mut wants = Vec::new();
        for (layer, [q, k, v]) in acts.iter().enumerate() {
            s.memcpy_htod(q, &mut q_dev[layer].slice_mut(..q.len()))
                .unwrap();
            s.memcpy_htod(k, &mut k_dev[layer].slice_mut(..k.len()))
                .unwrap();
            s.memcpy_htod(v, &mut v_dev[layer].slice_mut(..v.len()))
                .unwrap();
            step_
                .layer(
                    layer,
                    &q_dev[layer],
                    &k_dev[layer],
                    &v_dev[layer],
                    &mut out_dev[layer],
                )
                .unwrap();
            wants.push(
                decode_step(
                    &r.mgr,
                    &mut r.host,
                    &mut r.tables,
                    &mut r.reuse,
                    layer,
                    &batch,
                    q,
                    k,
                    v,
                )
                .unwrap(),
            );
        }
        step_.finish().unwrap();
        for &seq in &batch {
            r.mgr.advance_decode_step(seq).unwrap();
            assert_eq!(session.manager().len(seq).unwrap(), r.mgr.len(seq).unwrap());
            assert_eq!(
                session.manager().block_table(seq).unwrap(),
                r.mgr.block_table(seq).unwrap()
            );
        }
        for (layer, [q, ..]) in acts.iter().enumerate() {
            check_entries(
                &gpu,
                &session,
                &r,
                &batch,
                layer,
                q,
                &wants[layer].visits,
                &mut diverged,
                step,
            );
        }

        // Sampled steps: every layer's output and the whole cache.
        if step % 40 == 0 || joins_now {
            sampled += 1;
            let mut host = HostKvCache::<bf16>::for_manager(&r.mgr).unwrap();
            let mut tables = IndexTables::for_manager(&r.mgr).unwrap();
            session
                .cache()
                .download(&gpu, &mut host, &mut tables)
                .unwrap();
            assert!(
                host == r.host,
                "step {step}: the device cache differs from the reference's"
            );
            for (layer, [q, ..]) in acts.iter().enumerate() {
                let got: Vec<bf16> = s.clone_dtoh(&out_dev[layer].slice(..b * hq * D)).unwrap();
                let want = if diverged.iter().any(|d| d.1 == layer) {
                    // The reference attending the device's selections where they legitimately
                    // differ (near-ties), its own elsewhere.
                    let state = download_selection(&gpu, session.cache(), layer).unwrap();
                    let hd = pattern().dense_heads(layer);
                    let mut merged = r.tables.clone();
                    for &(seq, l, h) in &diverged {
                        if l != layer || !batch.contains(&seq) {
                            continue;
                        }
                        let slot = r.mgr.slot(seq).unwrap() as usize;
                        let dh = pattern().compact_index(layer, h);
                        let e = slot * hd + dh;
                        let n = state.index_lens[e] as usize;
                        let pages = &state.index_pages[e * state.entry_capacity..][..n];
                        merged.set(layer, slot, dh, pages).unwrap();
                    }
                    decode_attention_tables(&r.mgr, &r.host, &merged, layer, &batch, q).unwrap()
                } else {
                    wants[layer].out.clone()
                };
                let err = worst_row_error(&got, &want, D);
                assert!(
                    err < tolerance::<bf16>(),
                    "step {step}, layer {layer}, batch {batch:?}: worst row error {err:.2e}"
                );
            }
        }

        // Leaves: the sequences that reached their length.
        let (done, going): (Vec<_>, Vec<_>) = live
            .iter()
            .partition(|&&(seq, end)| session.manager().len(seq).unwrap() >= end);
        for (seq, _) in done {
            session.free_sequence(seq).unwrap();
            r.free(seq);
            diverged.retain(|d| d.0 != seq);
            left += 1;
        }
        live = going;
    }
    assert!(joined >= 10 && left >= 8, "{joined} joined, {left} left");
    assert!(sampled >= 25, "{sampled} sampled steps");
    for (seq, _) in live {
        session.free_sequence(seq).unwrap();
    }
    let pool = session.manager().pool();
    assert_eq!(pool.free_pages(), pool.capacity(), "pool pages leaked");
    assert_eq!(session.manager().num_sequences(), 0);
    assert_eq!(session.memory().used_bytes, 0);
}

/// Runs one decode step of `batch` on `session`, eagerly, with per layer `acts`, and returns
/// every layer's output.
fn eager_step(
    gpu: &GpuContext,
    session: &mut SparseAttention<bf16>,
    batch: &[SeqId],
    acts: &Activations,
) -> Vec<Vec<bf16>> {
    let s = gpu.stream();
    let mut step = session.decode(batch).unwrap();
    let mut outs = Vec::new();
    for (layer, [q, k, v]) in acts.iter().enumerate() {
        let (q, k, v) = (
            s.clone_htod(q).unwrap(),
            s.clone_htod(k).unwrap(),
            s.clone_htod(v).unwrap(),
        );
        let mut out = s.alloc_zeros::<bf16>(q.len()).unwrap();
        step.layer(layer, &q, &k, &v, &mut out).unwrap();
        outs.push(s.clone_dtoh(&out).unwrap());
    }
    step.finish().unwrap();
    outs
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn replayed_graphs_equal_eager_steps() {
    let gpu = Arc::new(gpu());
    let g = *pattern().geometry();
    let (hq, hkv, layers) = (g.q_heads(), g.kv_heads(), g.layers());
    let mut eager = SparseAttention::<bf16>::new(gpu.clone(), manager(), SLOTS).unwrap();
    let mut graphed = SparseAttention::<bf16>::new(gpu.clone(), manager(), SLOTS).unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let s = gpu.stream().clone();

    // The same prompts on both sessions.
    let prompts = [150, 40, 97];
    let mut seqs = Vec::new();
    let prefill =
        |session: &mut SparseAttention<bf16>, chunks: &[(SeqId, usize)], acts: &Activations| {
            let rows: usize = chunks.iter().map(|c| c.1).sum();
            let mut pf = session.prefill(chunks).unwrap();
            for (layer, [q, k, v]) in acts.iter().enumerate() {
                let (q, k, v) = (
                    s.clone_htod(q).unwrap(),
                    s.clone_htod(k).unwrap(),
                    s.clone_htod(v).unwrap(),
                );
                let mut out = s.alloc_zeros::<bf16>(rows * hq * D).unwrap();
                pf.layer(layer, &q, &k, &v, &mut out).unwrap();
            }
            pf.finish().unwrap();
        };
    for _ in prompts {
        let a = eager.add_sequence().unwrap();
        assert_eq!(graphed.add_sequence().unwrap(), a);
        seqs.push(a);
    }
    let chunks: Vec<_> = seqs.iter().copied().zip(prompts).collect();
    let acts = activations(&mut rng, layers, prompts.iter().sum());
    prefill(&mut eager, &chunks, &acts);
    prefill(&mut graphed, &chunks, &acts);

    // The graphed session's buffers, one per layer, that its graphs read.
    let b = seqs.len();
    let alloc = |n: usize| -> Vec<_> {
        (0..layers)
            .map(|_| s.alloc_zeros::<bf16>(n).unwrap())
            .collect()
    };
    let (mut q_dev, mut k_dev, mut v_dev) =
        (alloc(b * hq * D), alloc(b * hkv * D), alloc(b * hkv * D));
    let mut out_dev = alloc(b * hq * D);
    let upload = |acts: &Activations, q: &mut Vec<_>, k: &mut Vec<_>, v: &mut Vec<_>| {
        for (layer, [qh, kh, vh]) in acts.iter().enumerate() {
            s.memcpy_htod(qh, &mut q[layer]).unwrap();
            s.memcpy_htod(kh, &mut k[layer]).unwrap();
            s.memcpy_htod(vh, &mut v[layer]).unwrap();
        }
    };

    let mut graphs = None;
    let mut saw = [false, false]; // replays without and with the selector
    for step in 0..24 {
        if step == 12 {
            // A sequence leaves and another joins: the same batch size replays the same graphs.
            for session in [&mut eager, &mut graphed] {
                session.free_sequence(seqs[1]).unwrap();
            }
            let a = eager.add_sequence().unwrap();
            assert_eq!(graphed.add_sequence().unwrap(), a);
            let acts = activations(&mut rng, layers, 70);
            prefill(&mut eager, &[(a, 70)], &acts);
            prefill(&mut graphed, &[(a, 70)], &acts);
            seqs[1] = a;
        }
        let acts = activations(&mut rng, layers, b);
        let want = eager_step(&gpu, &mut eager, &seqs, &acts);
        upload(&acts, &mut q_dev, &mut k_dev, &mut v_dev);
        match &graphs {
            None => {
                graphs = Some(
                    graphed
                        .capture_decode(&seqs, |step| {
                            for layer in 0..layers {
                                step.layer(
                                    layer,
                                    &q_dev[layer],
                                    &k_dev[layer],
                                    &v_dev[layer],
                                    &mut out_dev[layer],
                                )?;
                            }
                            Ok(())
                        })
                        .unwrap(),
                );
            }
            Some(graphs) => {
                let selects = {
                    // What the replay will launch: the eager session's step said it.
                    let m = eager.manager();
                    seqs.iter().any(|&q| {
                        config().selects_at(m.len(q).unwrap(), m.decode_step(q).unwrap() - 1)
                    })
                };
                saw[usize::from(selects)] = true;
                graphed.replay_decode(graphs, &seqs).unwrap();
            }
        }
        for layer in 0..layers {
            let got: Vec<bf16> = s.clone_dtoh(&out_dev[layer]).unwrap();
            let want_f64: Vec<f64> = want[layer].iter().map(|x| x.to_f64()).collect();
            let err = worst_row_error(&got, &want_f64, D);
            assert!(
                err < tolerance::<bf16>(),
                "step {step}, layer {layer}: replay against eager, worst row error {err:.2e}"
            );
            let (ge, gg) = (
                download_selection(&gpu, eager.cache(), layer).unwrap(),
                download_selection(&gpu, graphed.cache(), layer).unwrap(),
            );
            assert_eq!(
                ge.index_lens, gg.index_lens,
                "step {step}, layer {layer}: index lengths"
            );
            assert_eq!(
                ge.index_pages, gg.index_pages,
                "step {step}, layer {layer}: index pages"
            );
            assert_eq!(
                ge.decode_steps, gg.decode_steps,
                "step {step}: step counters"
            );
        }
        for &seq in &seqs {
            assert_eq!(
                graphed.manager().len(seq).unwrap(),
                eager.manager().len(seq).unwrap()
            );
            assert_eq!(
                graphed.manager().decode_step(seq).unwrap(),
                eager.manager().decode_step(seq).unwrap()
            );
        }
    }
    assert!(
        saw[0] && saw[1],
        "replays with and without the selector: {saw:?}"
    );

    // Graphs for another batch size or of another session are refused, nothing reserved.
    let graphs = graphs.unwrap();
    let before = graphed.manager().len(seqs[0]).unwrap();
    assert!(matches!(
        graphed.replay_decode(&graphs, &seqs[..2]),
        Err(LserveError::InvalidArgument { what: "graphs", .. })
    ));
    assert!(matches!(
        eager.replay_decode(&graphs, &seqs),
        Err(LserveError::InvalidArgument { what: "graphs", .. })
    ));
    assert_eq!(graphed.manager().len(seqs[0]).unwrap(), before);
    assert_eq!(eager.manager().len(seqs[0]).unwrap(), before);
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn misuse_is_a_typed_error_and_leaves_the_session_usable() {
    let gpu = Arc::new(gpu());
    let g = *pattern().geometry();
    let (hq, hkv, layers) = (g.q_heads(), g.kv_heads(), g.layers());
    let mut session = SparseAttention::<bf16>::new(gpu.clone(), manager(), 2).unwrap();
    let s = gpu.stream().clone();
    let (a, b, c) = (
        session.add_sequence().unwrap(),
        session.add_sequence().unwrap(),
        session.add_sequence().unwrap(),
    );
    let q = s.alloc_zeros::<bf16>(2 * hq * D).unwrap();
    let kv = s.alloc_zeros::<bf16>(2 * hkv * D).unwrap();
    let short = s.alloc_zeros::<bf16>(hkv * D - 8).unwrap();
    let mut out = s.alloc_zeros::<bf16>(2 * hq * D).unwrap();

    // More than max_batch: refused, nothing reserved.
    assert!(matches!(
        session.decode(&[a, b, c]),
        Err(LserveError::InvalidArgument { .. })
    ));
    assert_eq!(session.manager().len(a).unwrap(), 0);

    // Out of order and short tensors are refused; the step goes on.
    let mut step = session.decode(&[a, b]).unwrap();
    assert!(matches!(
        step.layer(1, &q, &kv, &kv, &mut out),
        Err(LserveError::InvalidArgument { what: "layer", .. })
    ));
    assert!(step.layer(0, &q, &short, &short, &mut out).is_err());
    for layer in 0..layers {
        step.layer(layer, &q, &kv, &kv, &mut out).unwrap();
    }
    assert!(step.layer(layers, &q, &kv, &kv, &mut out).is_err());
    step.finish().unwrap();
    assert_eq!(session.manager().decode_step(a).unwrap(), 1);

    // A step finished early leaves its sequences Incomplete: refused until freed.
    let mut step = session.decode(&[c]).unwrap();
    step.layer(0, &q, &kv, &kv, &mut out).unwrap();
    assert!(matches!(
        step.finish(),
        Err(LserveError::InvalidArgument { what: "layer", .. })
    ));
    assert_eq!(
        session.sequences().state(c).unwrap(),
        SequenceState::Incomplete
    );
    assert!(session.decode(&[a, c]).is_err());
    assert!(session.prefill(&[(c, 10)]).is_err());
    session.free_sequence(c).unwrap();

    // A later prefill chunk is refused as chunked prefill, nothing reserved.
    let before = session.manager().clone();
    match session.prefill(&[(a, 16)]) {
        Err(LserveError::InvalidArgument {
            what: "chunked prefill",
            ..
        }) => {}
        Err(e) => panic!("expected the chunked-prefill error, got {e}"),
        Ok(_) => panic!("a later chunk was accepted"),
    }
    assert_eq!(session.manager(), &before);

    // The session still decodes.
    let mut step = session.decode(&[b, a]).unwrap();
    for layer in 0..layers {
        step.layer(layer, &q, &kv, &kv, &mut out).unwrap();
    }
    step.finish().unwrap();
    assert_eq!(session.manager().len(a).unwrap(), 2);
    session.free_sequence(a).unwrap();
    session.free_sequence(b).unwrap();
    let pool = session.manager().pool();
    assert_eq!(pool.free_pages(), pool.capacity());
}
