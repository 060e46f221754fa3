//! GPU tests of the KV-cache write kernels (`kernels-gpu/src/kv_write`): decode append, prefill
//! row writes, key-statistics pooling and the random fill, each against the CPU reference
//! (`reference::kv_write::{write_tokens, update_key_stats, pool_key_stats}` and
//! `HostKvCache::write_token`) on the same cache state, comparing the *whole* cache (K, V,
//! `kmin`, `kmax`, streaming store, every layer) bit for bit.
//!
//! Before each launch the rows and statistics the kernel must write are poisoned (NaN) in the
//! uploaded state, so a row it fails to write shows; everything else must come back exactly as
//! uploaded. Cases are random: head dim 64/128, 1-8 KV heads with random patterns (all-dense and
//! all-streaming layers included), `N_P` 16/32/64 with a random `N_L` dividing it, lengths that
//! are not page multiples, physical pages handed out in shuffled order, small sink/ring sizes so
//! the ring wraps, batches of 1-8 sequences.
//!
//! The GPU tests are `#[ignore]`d (reported as ignored without a GPU, never as passed); the plan
//! tests at the bottom run everywhere.

mod common;

use common::{
    assert_coded_layer, assert_stat_codes, f16_or_bf16, gpu, head_pattern, int4, int8, layer_arrays,
};
use half::{bf16, f16};
use lserve::config::SparsityConfig;
use lserve::dtype::Element;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    append_kv, fill_random, pool_key_stats, random_fill_value, read_coded_layer, write_kv_rows,
    DecodeBatch, DeviceElement, DeviceKvCache, GpuContext, KvWritePlan,
};
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::index_table::IndexTables;
use lserve::paging::{HostKvCache, KvCacheManager, SeqId, StreamingStore};
use lserve::quant::{IntFormat, StatsFormat};
use lserve::reference::kv_write::{pool_key_stats as ref_pool, update_key_stats, write_tokens};
use lserve::LserveError;
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// NaN in both bf16 and f16.
const POISON: u16 = 0x7fff;
const LAYERS: usize = 2;

/// Bit access to the element types (the suite does not depend on `bytemuck`).
trait Bits: DeviceElement {
    fn to_bits(self) -> u16;
    fn from_bits(bits: u16) -> Self;
}

impl Bits for bf16 {
    fn to_bits(self) -> u16 {
        bf16::to_bits(self)
    }
    fn from_bits(bits: u16) -> Self {
        bf16::from_bits(bits)
    }
}

impl Bits for f16 {
    fn to_bits(self) -> u16 {
        f16::to_bits(self)
    }
    fn from_bits(bits: u16) -> Self {
        f16::from_bits(bits)
    }
}

fn poison<E: Bits>() -> E {
    E::from_bits(POISON)
}

/// A random value in `[-2, 2)` rounded to `E`, never `-0.0` (the reference's `f32::min` may
/// order `-0.0` and `+0.0` either way; the kernels keep the first seen).
fn random_elem<E: Element>(rng: &mut StdRng) -> E {
    let x = E::from_f32(rng.gen_range(-2.0f32..2.0));
    if x.to_f32() == 0.0 {
        E::from_f32(0.0)
    } else {
        x
    }
}

fn random_vec<E: Element>(rng: &mut StdRng, n: usize) -> Vec<E> {
    (0..n).map(|_| random_elem(rng)).collect()
}

fn bits<E: Bits>(xs: &[E]) -> Vec<u16> {
    xs.iter().map(|&x| x.to_bits()).collect()
}

/// Bit-exact comparison of two whole caches, naming the first differing element.
fn assert_same_cache<E: Bits>(
    got: &HostKvCache<E>,
    want: &HostKvCache<E>,
) -> Result<(), TestCaseError> {
    for layer in 0..want.layers() {
        for (what, g, w) in layer_arrays(got, want, layer) {
            let (g, w) = (bits(g), bits(w));
            prop_assert_eq!(g.len(), w.len());
            if let Some(i) = (0..w.len()).find(|&i| g[i] != w[i]) {
                let d = want.pattern().geometry().head_dim();
                return Err(TestCaseError::fail(format!(
                    "layer {layer} {what}: element {i} (row {}, channel {}) is {:#06x}, want {:#06x}",
                    i / d,
                    i % d,
                    g[i],
                    w[i]
                )));
            }
        }
    }
    Ok(())
}

#[derive(Clone, Debug)]
struct Case {
    head_dim: usize,
    /// `[layer][kv_head]`, true = streaming.
    kinds: Vec<Vec<bool>>,
    layer: usize,
    n_p: usize,
    n_l: usize,
    sink: usize,
    local: usize,
    /// Initial length of each sequence (the batch size is its length).
    init_lens: Vec<usize>,
    steps: usize,
    f16: bool,
    /// The cache keeps 8-bit statistics.
    q8: bool,
    seed: u64,
}

fn kinds_strategy(kv_heads: usize) -> impl Strategy<Value = Vec<bool>> {
    prop_oneof![
        prop::collection::vec(any::<bool>(), kv_heads),
        Just(vec![false; kv_heads]),
        Just(vec![true; kv_heads]),
    ]
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (1usize..=8, 1usize..=8).prop_flat_map(|(kv_heads, batch)| {
        (
            prop_oneof![Just(64usize), Just(128usize)],
            prop::collection::vec(kinds_strategy(kv_heads), LAYERS),
            0..LAYERS,
            prop_oneof![Just(16usize), Just(32usize), Just(64usize)],
            0usize..=6,
            (0usize..=5, 1usize..=12),
            prop::collection::vec(0usize..=150, batch),
            1usize..=24,
            any::<bool>(),
            any::<bool>(),
            any::<u64>(),
        )
            .prop_map(
                |(
                    head_dim,
                    kinds,
                    layer,
                    n_p,
                    l_pow,
                    (sink, local),
                    init_lens,
                    steps,
                    f16,
                    q8,
                    seed,
                )| {
                    // N_L: a power of two dividing N_P (1 .. N_P).
                    let n_l = n_p >> (l_pow % (n_p.trailing_zeros() as usize + 1));
                    Case {
                        head_dim,
                        kinds,
                        layer,
                        n_p,
                        n_l,
                        sink,
                        local,
                        init_lens,
                        steps,
                        f16,
                        q8,
                        seed,
                    }
                },
            )
    })
}

/// Runs `test` on the random cases of `case_strategy` (a failure is shrunk, then panics).
fn for_random_cases(test: impl Fn(&Case) -> Result<(), TestCaseError>) {
    TestRunner::default()
        .run(&case_strategy(), |case| test(&case))
        .unwrap();
}

/// A manager and host cache with the case's sequences prefilled (by the reference) and the
/// rest of the cache random; pages handed out in a shuffled order.
struct Setup<E> {
    mgr: KvCacheManager,
    host: HostKvCache<E>,
    seqs: Vec<SeqId>,
    rng: StdRng,
}

const MAX_SEQ_LEN: usize = 512;

impl<E: Bits> Setup<E> {
    fn new(case: &Case, extra_tokens: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(case.seed);
        let kv_heads = case.kinds[0].len();
        let g = ModelGeometry::new(LAYERS, kv_heads, kv_heads, case.head_dim).unwrap();
        let pattern = head_pattern(g, &case.kinds);
        let config = SparsityConfig {
            page_tokens: case.n_p,
            logical_page_tokens: case.n_l,
            token_budget: 2 * case.n_p,
            sink_tokens: case.sink,
            local_tokens: case.local,
            stats_format: if case.q8 {
                StatsFormat::DEVICE_INT8
            } else {
                StatsFormat::Half
            },
            ..Default::default()
        };
        let dummy_tokens = 3 * case.n_p;
        let capacity: usize = case
            .init_lens
            .iter()
            .map(|&l| (l + extra_tokens).div_ceil(case.n_p))
            .sum::<usize>()
            + dummy_tokens / case.n_p
            + 1;
        let mut mgr = KvCacheManager::new(
            g,
            pattern,
            config,
            capacity,
            case.init_lens.len() + 1,
            MAX_SEQ_LEN,
        )
        .unwrap();
        // A throw-away sequence takes pages while the real ones grow in random interleaved
        // chunks, then frees them: block tables get interleaved, non-monotonic page ids, and
        // later growth reuses the freed ones (last freed first).
        let dummy = mgr.add_sequence().unwrap();
        let seqs: Vec<SeqId> = case
            .init_lens
            .iter()
            .map(|_| mgr.add_sequence().unwrap())
            .collect();
        let mut left = case.init_lens.clone();
        let mut dummy_left = dummy_tokens;
        while left.iter().any(|&l| l > 0) || dummy_left > 0 {
            let i = rng.gen_range(0..=left.len());
            let chunk = rng.gen_range(1..=case.n_p);
            if i == left.len() {
                let n = chunk.min(dummy_left);
                if n > 0 {
                    mgr.reserve(dummy, n).unwrap();
                    dummy_left -= n;
                }
            } else {
                let n = chunk.min(left[i]);
                if n > 0 {
                    mgr.reserve(seqs[i], n).unwrap();
                    left[i] -= n;
                }
            }
        }
        mgr.free_sequence(dummy).unwrap();

        let mut host = HostKvCache::<E>::for_manager(&mgr).unwrap();
        for layer in 0..LAYERS {
            let (k, v, kmin, kmax) = host.dense_mut(layer).unwrap().buffers_mut();
            for buf in [k, v, kmin, kmax] {
                buf.iter_mut().for_each(|x| *x = random_elem(&mut rng));
            }
            let (k, v) = host.streaming_mut(layer).unwrap().buffers_mut();
            for buf in [k, v] {
                buf.iter_mut().for_each(|x| *x = random_elem(&mut rng));
            }
        }
        let row = kv_heads * case.head_dim;
        for &s in &seqs {
            let view = mgr.view(s).unwrap();
            for layer in 0..LAYERS {
                let k = random_vec::<E>(&mut rng, view.len * row);
                let v = random_vec::<E>(&mut rng, view.len * row);
                write_tokens(&mut host, layer, &view, 0, &k, &v).unwrap();
            }
        }
        Self {
            mgr,
            host,
            seqs,
            rng,
        }
    }
}

/// Poisons, in `host`, what writing position `pos` of `seq` must overwrite in `layer`: its dense
/// rows, its streaming rows if held at the current length, and (if `stats`) the dense heads'
/// statistics of its logical page.
fn poison_token<E: Bits>(
    host: &mut HostKvCache<E>,
    mgr: &KvCacheManager,
    layer: usize,
    seq: SeqId,
    pos: usize,
    stats: bool,
) {
    let view = mgr.view(seq).unwrap();
    let config = *mgr.config();
    let (n_p, n_l) = (config.page_tokens, config.logical_page_tokens);
    let pattern = mgr.pattern().clone();
    for kv_head in 0..pattern.geometry().kv_heads() {
        let idx = pattern.compact_index(layer, kv_head);
        let (k, v) = match pattern.kind(layer, kv_head) {
            HeadKind::Dense => {
                let page = view.block_table.physical(pos / n_p).unwrap();
                if stats {
                    let (lo, hi) = host
                        .dense_mut(layer)
                        .unwrap()
                        .stats_mut(page, idx, (pos % n_p) / n_l)
                        .unwrap();
                    lo.fill(poison());
                    hi.fill(poison());
                }
                host.dense_mut(layer)
                    .unwrap()
                    .kv_rows_mut(page, idx, pos % n_p)
                    .unwrap()
            }
            HeadKind::Streaming => {
                let held = StreamingStore::is_resident(
                    pos,
                    view.len,
                    config.sink_tokens,
                    config.local_tokens,
                );
                if !held {
                    continue;
                }
                let row = mgr.streaming_store().row_of_token(pos);
                host.streaming_mut(layer)
                    .unwrap()
                    .kv_rows_mut(view.slot, idx, row)
                    .unwrap()
            }
        };
        k.fill(poison());
        v.fill(poison());
    }
}

/// Uploads `host`, runs `launch` on the device cache, and returns the downloaded cache and the
/// device cache.
fn on_device<E: DeviceElement>(
    gpu: &GpuContext,
    mgr: &KvCacheManager,
    host: &HostKvCache<E>,
    launch: impl FnOnce(&mut DeviceKvCache<E>),
) -> (HostKvCache<E>, DeviceKvCache<E>) {
    let mut index = IndexTables::for_manager(mgr).unwrap();
    let mut device = DeviceKvCache::upload(gpu, mgr, host, &index).unwrap();
    launch(&mut device);
    let mut got = host.clone();
    device.download(gpu, &mut got, &mut index).unwrap();
    (got, device)
}

/// [`assert_same_cache`], and the 8-bit statistics of `layer` where the device keeps them.
fn assert_same_layer<E: Bits>(
    gpu: &GpuContext,
    (got, device): &(HostKvCache<E>, DeviceKvCache<E>),
    want: &HostKvCache<E>,
    layer: usize,
) -> Result<(), TestCaseError> {
    assert_same_cache(got, want)?;
    assert_stat_codes(gpu, device, want, layer)
}

// ---------------------------------------------------------------------------------------------
// append_kv

/// Decode steps on random subsets of the sequences (random order): each step reserves a token
/// per sequence, poisons its destination (and its logical page's statistics if it starts one),
/// runs `append_kv` on a fresh upload of the state, and compares with the reference's
/// `write_token` + `update_key_stats`.
fn append_case<E: Bits>(gpu: &GpuContext, case: &Case) -> Result<(), TestCaseError> {
    let mut s = Setup::<E>::new(case, case.steps);
    let kv_heads = case.kinds[0].len();
    let row = kv_heads * case.head_dim;
    let mut batch = DecodeBatch::new(gpu, s.seqs.len()).unwrap();
    for step in 0..case.steps {
        let mut subset = s.seqs.clone();
        subset.shuffle(&mut s.rng);
        subset.truncate(s.rng.gen_range(1..=subset.len()));
        for &seq in &subset {
            s.mgr.reserve(seq, 1).unwrap();
        }
        let mut uploaded = s.host.clone();
        for &seq in &subset {
            let pos = s.mgr.len(seq).unwrap() - 1;
            let starts_logical = pos.is_multiple_of(case.n_l);
            poison_token(&mut uploaded, &s.mgr, case.layer, seq, pos, starts_logical);
        }
        let k = random_vec::<E>(&mut s.rng, subset.len() * row);
        let v = random_vec::<E>(&mut s.rng, subset.len() * row);
        let k_dev = gpu.stream().clone_htod(&k).unwrap();
        let v_dev = gpu.stream().clone_htod(&v).unwrap();
        let got = on_device(gpu, &s.mgr, &uploaded, |dev| {
            batch.set(gpu, &s.mgr, dev, &subset).unwrap();
            append_kv(gpu, dev, case.layer, &batch, &k_dev, &v_dev).unwrap()
        });
        for (b, &seq) in subset.iter().enumerate() {
            let view = s.mgr.view(seq).unwrap();
            let pos = view.len - 1;
            let (kr, vr) = (&k[b * row..][..row], &v[b * row..][..row]);
            s.host.write_token(case.layer, &view, pos, kr, vr).unwrap();
            update_key_stats(&mut s.host, case.layer, &view, pos).unwrap();
        }
        assert_same_layer(gpu, &got, &s.host, case.layer)
            .map_err(|e| TestCaseError::fail(format!("step {step}, batch {subset:?}: {e}")))?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn append_matches_reference() {
    let gpu = gpu();
    for_random_cases(|case| f16_or_bf16!(case.f16, append_case(&gpu, case)));
}

/// The flow of a real decode loop on one device cache kept across steps: reserve, sync the
/// block tables, append; long enough to cross many pages and logical pages and to wrap the ring
/// several times. The whole cache is compared after every step.
#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn append_on_a_persistent_cache_across_pages_and_ring_wraps() {
    let gpu = gpu();
    for (head_dim, f16_case) in [(128, false), (64, true)] {
        let case = Case {
            head_dim,
            kinds: vec![
                vec![false, true, false, true],
                vec![true, false, false, false],
            ],
            layer: 0,
            n_p: 16,
            n_l: 4,
            sink: 3,
            local: 5,
            init_lens: vec![0, 7, 33],
            steps: 70,
            f16: f16_case,
            q8: f16_case,
            seed: 0x5eed,
        };
        f16_or_bf16!(f16_case, persistent_run(&gpu, &case));
    }
}

fn persistent_run<E: Bits>(gpu: &GpuContext, case: &Case) {
    let mut s = Setup::<E>::new(case, case.steps);
    let row = case.kinds[0].len() * case.head_dim;
    let mut index = IndexTables::for_manager(&s.mgr).unwrap();
    let mut device = DeviceKvCache::upload(gpu, &s.mgr, &s.host, &index).unwrap();
    let mut batch = DecodeBatch::new(gpu, s.seqs.len()).unwrap();
    let k_dev_len = s.seqs.len() * row;
    for step in 0..case.steps {
        for &seq in &s.seqs {
            s.mgr.reserve(seq, 1).unwrap();
        }
        batch.set(gpu, &s.mgr, &mut device, &s.seqs).unwrap();
        let k = random_vec::<E>(&mut s.rng, k_dev_len);
        let v = random_vec::<E>(&mut s.rng, k_dev_len);
        let (k_dev, v_dev) = (
            gpu.stream().clone_htod(&k).unwrap(),
            gpu.stream().clone_htod(&v).unwrap(),
        );
        for layer in 0..LAYERS {
            append_kv(gpu, &mut device, layer, &batch, &k_dev, &v_dev).unwrap();
            for (b, &seq) in s.seqs.iter().enumerate() {
                let view = s.mgr.view(seq).unwrap();
                let pos = view.len - 1;
                s.host
                    .write_token(
                        layer,
                        &view,
                        pos,
                        &k[b * row..][..row],
                        &v[b * row..][..row],
                    )
                    .unwrap();
                update_key_stats(&mut s.host, layer, &view, pos).unwrap();
            }
        }
        let mut got = s.host.clone();
        device.download(gpu, &mut got, &mut index).unwrap();
        if let Err(e) = assert_same_cache(&got, &s.host) {
            panic!("D {} step {step}: {e}", case.head_dim);
        }
        for layer in 0..LAYERS {
            if let Err(e) = assert_stat_codes(gpu, &device, &s.host, layer) {
                panic!("D {} step {step}: {e}", case.head_dim);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Integer-coded caches: append_kv and write_kv_rows quantize the rows they write

/// `case` at the head dimension the coded kernels serve.
fn coded_case(case: &Case) -> Case {
    Case {
        head_dim: 128,
        ..case.clone()
    }
}

/// `append_case` on a coded cache: each step's tokens go through `append_kv` into a cache
/// uploaded with the poisoned destinations quantized; the layer must then hold the reference's
/// cache quantized row by row, and its statistics those of the unquantized keys.
fn coded_append_case<E: Bits>(
    gpu: &GpuContext,
    case: &Case,
    format: IntFormat,
) -> Result<(), TestCaseError> {
    let case = &coded_case(case);
    let mut s = Setup::<E>::new(case, case.steps);
    let row = case.kinds[0].len() * case.head_dim;
    let mut batch = DecodeBatch::new(gpu, s.seqs.len()).unwrap();
    for step in 0..case.steps {
        let mut subset = s.seqs.clone();
        subset.shuffle(&mut s.rng);
        subset.truncate(s.rng.gen_range(1..=subset.len()));
        for &seq in &subset {
            s.mgr.reserve(seq, 1).unwrap();
        }
        let mut uploaded = s.host.clone();
        for &seq in &subset {
            let pos = s.mgr.len(seq).unwrap() - 1;
            let starts_logical = pos.is_multiple_of(case.n_l);
            poison_token(&mut uploaded, &s.mgr, case.layer, seq, pos, starts_logical);
        }
        let k = random_vec::<E>(&mut s.rng, subset.len() * row);
        let v = random_vec::<E>(&mut s.rng, subset.len() * row);
        let k_dev = gpu.stream().clone_htod(&k).unwrap();
        let v_dev = gpu.stream().clone_htod(&v).unwrap();
        let index = IndexTables::for_manager(&s.mgr).unwrap();
        let mut dev = DeviceKvCache::upload_coded(gpu, &s.mgr, &uploaded, &index, format).unwrap();
        batch.set(gpu, &s.mgr, &mut dev, &subset).unwrap();
        append_kv(gpu, &mut dev, case.layer, &batch, &k_dev, &v_dev).unwrap();
        for (b, &seq) in subset.iter().enumerate() {
            let view = s.mgr.view(seq).unwrap();
            let pos = view.len - 1;
            let (kr, vr) = (&k[b * row..][..row], &v[b * row..][..row]);
            s.host.write_token(case.layer, &view, pos, kr, vr).unwrap();
            update_key_stats(&mut s.host, case.layer, &view, pos).unwrap();
        }
        let got = read_coded_layer(gpu, &dev, case.layer).unwrap();
        assert_coded_layer(&got, &s.host, case.layer, format)
            .and_then(|()| assert_stat_codes(gpu, &dev, &s.host, case.layer))
            .map_err(|e| TestCaseError::fail(format!("step {step}, batch {subset:?}: {e}")))?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn coded_append_matches_reference() {
    let gpu = gpu();
    for_random_cases(|case| {
        for format in [int8(), int4()] {
            f16_or_bf16!(case.f16, coded_append_case(&gpu, case, format))?;
        }
        Ok(())
    });
}

/// `write_rows_case` on a coded cache: the grown ranges written by `write_kv_rows`, which
/// quantizes the rows and computes the statistics from them (`pool_key_stats` is refused). The
/// statistics of a logical page that begins before its range are not poisoned: the row write
/// keeps its earlier tokens' bounds (the uploaded ones, the reference's).
fn coded_write_rows_case<E: Bits>(
    gpu: &GpuContext,
    case: &Case,
    format: IntFormat,
) -> Result<(), TestCaseError> {
    let case = &coded_case(case);
    let grow_max = 2 * case.n_p + 5;
    let mut s = Setup::<E>::new(case, grow_max);
    let row = case.kinds[0].len() * case.head_dim;
    let mut order = s.seqs.clone();
    order.shuffle(&mut s.rng);
    let mut ranges = Vec::new();
    for &seq in &order {
        let n = match s.rng.gen_range(0..4) {
            0 => 0,
            _ => s.rng.gen_range(1..=grow_max),
        };
        let range = match n {
            0 => {
                let len = s.mgr.len(seq).unwrap();
                len..len
            }
            _ => s.mgr.reserve(seq, n).unwrap(),
        };
        ranges.push((seq, range));
    }
    let plan = KvWritePlan::new(&s.mgr, &ranges).unwrap();
    let mut uploaded = s.host.clone();
    for (seq, range) in &ranges {
        for pos in range.clone() {
            let page_in_range = pos / case.n_l * case.n_l >= range.start;
            poison_token(&mut uploaded, &s.mgr, case.layer, *seq, pos, page_in_range);
        }
    }
    let k = random_vec::<E>(&mut s.rng, plan.rows() * row);
    let v = random_vec::<E>(&mut s.rng, plan.rows() * row);
    let (k_dev, v_dev) = (
        gpu.stream().clone_htod(&k).unwrap(),
        gpu.stream().clone_htod(&v).unwrap(),
    );
    let index = IndexTables::for_manager(&s.mgr).unwrap();
    let mut dev = DeviceKvCache::upload_coded(gpu, &s.mgr, &uploaded, &index, format).unwrap();
    let device_plan = plan.upload(gpu, &s.mgr, &mut dev).unwrap();
    write_kv_rows(gpu, &mut dev, case.layer, &device_plan, &k_dev, &v_dev).unwrap();
    let refused = pool_key_stats(gpu, &mut dev, case.layer, &device_plan);
    prop_assert!(
        matches!(refused, Err(LserveError::InvalidArgument { .. })),
        "{:?}",
        refused
    );
    let cu = plan.cu_seqlens();
    for (b, (seq, range)) in ranges.iter().enumerate() {
        let view = s.mgr.view(*seq).unwrap();
        let rows = cu[b] as usize * row..cu[b + 1] as usize * row;
        write_tokens(
            &mut s.host,
            case.layer,
            &view,
            range.start,
            &k[rows.clone()],
            &v[rows],
        )
        .unwrap();
    }
    let got = read_coded_layer(gpu, &dev, case.layer).unwrap();
    assert_coded_layer(&got, &s.host, case.layer, format)?;
    assert_stat_codes(gpu, &dev, &s.host, case.layer)
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn coded_write_rows_match_reference() {
    let gpu = gpu();
    for_random_cases(|case| {
        for format in [int8(), int4()] {
            f16_or_bf16!(case.f16, coded_write_rows_case(&gpu, case, format))?;
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// write_kv_rows + pool_key_stats

/// Each sequence grows by a random number of tokens (0 included); the grown ranges, in random
/// order, are written from one ragged batch and pooled; compared with the reference's
/// `write_tokens` (write + pool) per sequence.
fn write_rows_case<E: Bits>(gpu: &GpuContext, case: &Case) -> Result<(), TestCaseError> {
    let grow_max = 2 * case.n_p + 5;
    let mut s = Setup::<E>::new(case, grow_max);
    let row = case.kinds[0].len() * case.head_dim;
    let mut order = s.seqs.clone();
    order.shuffle(&mut s.rng);
    let mut ranges = Vec::new();
    for &seq in &order {
        let n = match s.rng.gen_range(0..4) {
            0 => 0,
            _ => s.rng.gen_range(1..=grow_max),
        };
        let range = match n {
            0 => {
                let len = s.mgr.len(seq).unwrap();
                len..len
            }
            _ => s.mgr.reserve(seq, n).unwrap(),
        };
        ranges.push((seq, range));
    }
    let plan = KvWritePlan::new(&s.mgr, &ranges).unwrap();
    let mut uploaded = s.host.clone();
    for (seq, range) in &ranges {
        for pos in range.clone() {
            poison_token(&mut uploaded, &s.mgr, case.layer, *seq, pos, true);
        }
    }
    let k = random_vec::<E>(&mut s.rng, plan.rows() * row);
    let v = random_vec::<E>(&mut s.rng, plan.rows() * row);
    let (k_dev, v_dev) = (
        gpu.stream().clone_htod(&k).unwrap(),
        gpu.stream().clone_htod(&v).unwrap(),
    );
    let got = on_device(gpu, &s.mgr, &uploaded, |dev| {
        let device_plan = plan.upload(gpu, &s.mgr, dev).unwrap();
        write_kv_rows(gpu, dev, case.layer, &device_plan, &k_dev, &v_dev).unwrap();
        pool_key_stats(gpu, dev, case.layer, &device_plan).unwrap();
    });
    let cu = plan.cu_seqlens();
    for (b, (seq, range)) in ranges.iter().enumerate() {
        let view = s.mgr.view(*seq).unwrap();
        let rows = cu[b] as usize * row..cu[b + 1] as usize * row;
        write_tokens(
            &mut s.host,
            case.layer,
            &view,
            range.start,
            &k[rows.clone()],
            &v[rows],
        )
        .unwrap();
    }
    assert_same_layer(gpu, &got, &s.host, case.layer)
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn write_rows_and_pooling_match_reference() {
    let gpu = gpu();
    for_random_cases(|case| f16_or_bf16!(case.f16, write_rows_case(&gpu, case)));
}

/// Pooling alone over random sub-ranges of what is in the cache (benchmark setup, re-pooling):
/// the touched logical pages' statistics are poisoned, then recomputed.
fn pool_case<E: Bits>(gpu: &GpuContext, case: &Case) -> Result<(), TestCaseError> {
    let mut s = Setup::<E>::new(case, 0);
    let mut ranges = Vec::new();
    for &seq in &s.seqs {
        let len = s.mgr.len(seq).unwrap();
        let a = s.rng.gen_range(0..=len);
        let b = s.rng.gen_range(a..=len);
        ranges.push((seq, a..b));
    }
    let plan = KvWritePlan::new(&s.mgr, &ranges).unwrap();
    let mut uploaded = s.host.clone();
    let (n_p, n_l) = (case.n_p, case.n_l);
    let dense = s.mgr.pattern().dense_heads(case.layer);
    for (seq, range) in &ranges {
        let view = s.mgr.view(*seq).unwrap();
        for pos in range.clone() {
            let page = view.block_table.physical(pos / n_p).unwrap();
            for head in 0..dense {
                let (lo, hi) = uploaded
                    .dense_mut(case.layer)
                    .unwrap()
                    .stats_mut(page, head, (pos % n_p) / n_l)
                    .unwrap();
                lo.fill(poison());
                hi.fill(poison());
            }
        }
    }
    let got = on_device(gpu, &s.mgr, &uploaded, |dev| {
        let device_plan = plan.upload(gpu, &s.mgr, dev).unwrap();
        pool_key_stats(gpu, dev, case.layer, &device_plan).unwrap()
    });
    for (seq, range) in &ranges {
        let view = s.mgr.view(*seq).unwrap();
        ref_pool(&mut s.host, case.layer, &view, range.clone()).unwrap();
    }
    assert_same_layer(gpu, &got, &s.host, case.layer)
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn pooling_over_subranges_matches_reference() {
    let gpu = gpu();
    for_random_cases(|case| f16_or_bf16!(case.f16, pool_case(&gpu, case)));
}

// ---------------------------------------------------------------------------------------------
// fill_random

fn fill_case<E: Bits>(gpu: &GpuContext) {
    // Not a multiple of 8: the tail takes the scalar path.
    for (len, seed) in [
        (1usize, 3u64),
        (8 * 128 * 3 + 5, 42),
        (100_003, 0xdead_beef),
    ] {
        let mut buf = gpu.stream().clone_htod(&vec![poison::<E>(); len]).unwrap();
        fill_random(gpu, &mut buf, seed).unwrap();
        let got = gpu.stream().clone_dtoh(&buf).unwrap();
        let want: Vec<E> = (0..len as u64)
            .map(|i| E::from_f32(random_fill_value(seed, i)))
            .collect();
        let (got_bits, want_bits) = (bits(&got), bits(&want));
        if let Some(i) = (0..len).find(|&i| got_bits[i] != want_bits[i]) {
            panic!(
                "{:?} len {len} seed {seed}: element {i} is {:?}, want {:?}",
                E::DTYPE,
                got[i],
                want[i]
            );
        }
        assert!(got.iter().all(|x| (-1.0..=1.0).contains(&x.to_f32())));
    }
    let mut a = gpu.stream().alloc_zeros::<E>(4096).unwrap();
    let mut b = gpu.stream().alloc_zeros::<E>(4096).unwrap();
    fill_random(gpu, &mut a, 1).unwrap();
    fill_random(gpu, &mut b, 2).unwrap();
    let (a, b) = (
        gpu.stream().clone_dtoh(&a).unwrap(),
        gpu.stream().clone_dtoh(&b).unwrap(),
    );
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    assert!(same < 100, "seeds 1 and 2 agree on {same} of 4096 elements");
}

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn fill_random_matches_the_host_hash() {
    let gpu = gpu();
    fill_case::<bf16>(&gpu);
    fill_case::<f16>(&gpu);
}

// ---------------------------------------------------------------------------------------------
// Typed errors on the device API

#[test]
#[ignore = "needs a CUDA GPU (run the GPU bundle, or cargo test -- --ignored on a GPU machine)"]
fn bad_arguments_are_typed_errors() {
    let gpu = gpu();
    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    let config = SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 4,
        token_budget: 32,
        ..Default::default()
    };
    let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), config, 8, 2, 64).unwrap();
    let seq = mgr.add_sequence().unwrap();
    let range = mgr.reserve(seq, 5).unwrap();
    let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr).unwrap();
    let mut batch = DecodeBatch::new(&gpu, 2).unwrap();
    let short = gpu.stream().alloc_zeros::<bf16>(2 * 64 - 1).unwrap();
    let full = gpu.stream().alloc_zeros::<bf16>(5 * 2 * 64).unwrap();
    assert!(matches!(
        append_kv(&gpu, &mut cache, 0, &batch, &full, &full),
        Err(LserveError::Empty(_))
    ));
    batch.set(&gpu, &mgr, &mut cache, &[seq]).unwrap();
    assert!(matches!(
        append_kv(&gpu, &mut cache, 0, &batch, &short, &full),
        Err(LserveError::ShapeMismatch { what: "k", .. })
    ));
    assert!(matches!(
        append_kv(&gpu, &mut cache, 1, &batch, &full, &full),
        Err(LserveError::InvalidArgument { .. })
    ));
    let plan = KvWritePlan::new(&mgr, &[(seq, range)])
        .unwrap()
        .upload(&gpu, &mgr, &mut cache)
        .unwrap();
    assert!(matches!(
        write_kv_rows(&gpu, &mut cache, 0, &plan, &short, &full),
        Err(LserveError::ShapeMismatch { .. })
    ));
    // A plan from a manager with other page sizes does not fit this cache.
    let other_config = SparsityConfig {
        logical_page_tokens: 8,
        ..config
    };
    let mut other =
        KvCacheManager::new(g, HeadPattern::all_dense(g), other_config, 8, 2, 64).unwrap();
    let s2 = other.add_sequence().unwrap();
    let r2 = other.reserve(s2, 3).unwrap();
    let other_plan = KvWritePlan::new(&other, &[(s2, r2)]).unwrap();
    assert!(matches!(
        other_plan.upload(&gpu, &other, &mut cache),
        Err(LserveError::InvalidArgument { what: "plan", .. })
    ));
    // A plan made from one manager does not upload with another's tables.
    let from_mgr = KvWritePlan::new(&mgr, &[(seq, 0..5)]).unwrap();
    assert!(matches!(
        from_mgr.upload(&gpu, &other, &mut cache),
        Err(LserveError::StaleTables { what: "plan", .. })
    ));
    // Valid calls still work after the refusals.
    write_kv_rows(&gpu, &mut cache, 0, &plan, &full, &full).unwrap();
    pool_key_stats(&gpu, &mut cache, 0, &plan).unwrap();
    gpu.stream().synchronize().unwrap();
}

// ---------------------------------------------------------------------------------------------
// KvWritePlan (host only)

fn plan_manager() -> (KvCacheManager, SeqId, SeqId) {
    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    let config = SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 4,
        token_budget: 32,
        ..Default::default()
    };
    let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), config, 32, 3, 256).unwrap();
    let (a, b) = (mgr.add_sequence().unwrap(), mgr.add_sequence().unwrap());
    mgr.reserve(a, 40).unwrap();
    mgr.reserve(b, 9).unwrap();
    (mgr, a, b)
}

#[test]
fn plan_lays_out_a_ragged_batch() {
    let (mgr, a, b) = plan_manager();
    let plan = KvWritePlan::new(&mgr, &[(b, 2..9), (a, 30..40)]).unwrap();
    assert_eq!(plan.cu_seqlens(), [0, 7, 17]);
    assert_eq!(plan.rows(), 17);
    let r = plan.ranges();
    assert_eq!(
        (r[0].slot, r[0].start, r[0].end, r[0].len, r[0].first_row),
        (1, 2, 9, 9, 0)
    );
    assert_eq!(
        (r[1].slot, r[1].start, r[1].end, r[1].len, r[1].first_row),
        (0, 30, 40, 40, 7)
    );
    // Logical pages of 4: 2..9 touches pages 0..=2 (3), 30..40 touches 7..=9 (3).
    assert_eq!(plan.max_logical_pages(), 3);
    let plan = KvWritePlan::new(&mgr, &[(a, 0..40), (b, 9..9)]).unwrap();
    assert_eq!(plan.max_logical_pages(), 10);
    assert_eq!(plan.cu_seqlens(), [0, 40, 40]);
}

#[test]
fn plan_rejects_bad_ranges_with_typed_errors() {
    let (mut mgr, a, b) = plan_manager();
    assert!(matches!(
        KvWritePlan::new(&mgr, &[]),
        Err(LserveError::Empty(_))
    ));
    assert!(matches!(
        KvWritePlan::new(&mgr, &[(a, 0..41)]),
        Err(LserveError::TokenNotStored {
            position: 40,
            len: 40
        })
    ));
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 5..3;
    assert!(matches!(
        KvWritePlan::new(&mgr, &[(a, reversed)]),
        Err(LserveError::InvalidArgument { .. })
    ));
    assert!(matches!(
        KvWritePlan::new(&mgr, &[(a, 0..1), (b, 0..1), (a, 2..3)]),
        Err(LserveError::InvalidArgument { .. })
    ));
    mgr.free_sequence(b).unwrap();
    assert!(matches!(
        KvWritePlan::new(&mgr, &[(b, 0..1)]),
        Err(LserveError::UnknownSequence(_))
    ));
}
