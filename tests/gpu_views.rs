//! Activations as views ([`Tokens`], [`TokensMut`]): q, k, v cut from one fused
//! `[tokens][Hq + 2 Hkv][D]` QKV buffer and an output with padded rows give exactly the results
//! of packed tensors (the same kernels on the same values: bit for bit), for prefill (into the
//! cache, then the attention) and for a decode step (append, selection, attention); rows between
//! a strided output's rows stay untouched; views that break the length rule are typed errors
//! with nothing enqueued. GPU tests are ignored without a GPU.

mod common;

use half::bf16;
use lserve::config::SparsityConfig;
use lserve::cudarc::driver::CudaSlice;
use lserve::geometry::ModelGeometry;
use lserve::gpu::{
    prefill_attention, prefill_into_cache, DecodeStep, DeviceKvCache, GpuContext, KvWritePlan,
    PrefillArgs, Tokens, TokensMut,
};
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::KvCacheManager;
use lserve::LserveError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Llama-3-8B-like heads, two layers.
const LAYERS: usize = 2;
const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 128;
/// One token of the fused projection.
const ROW: usize = (HQ + 2 * HKV) * D;
/// One padded output row (a head of padding after the `HQ` heads).
const OUT_ROW: usize = (HQ + 1) * D;

fn random(rng: &mut StdRng, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.gen_range(-1.0f32..1.0)))
        .collect()
}

/// Packed q, k, v of `t` tokens, and the same values as one fused buffer.
struct Activations {
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    fused: Vec<bf16>,
}

fn activations(rng: &mut StdRng, t: usize) -> Activations {
    let (q, k, v) = (
        random(rng, t * HQ * D),
        random(rng, t * HKV * D),
        random(rng, t * HKV * D),
    );
    let mut fused = Vec::with_capacity(t * ROW);
    for i in 0..t {
        fused.extend_from_slice(&q[i * HQ * D..(i + 1) * HQ * D]);
        fused.extend_from_slice(&k[i * HKV * D..(i + 1) * HKV * D]);
        fused.extend_from_slice(&v[i * HKV * D..(i + 1) * HKV * D]);
    }
    Activations { q, k, v, fused }
}

/// The packed rows of a padded output (`t` rows of `OUT_ROW`), after checking its padding is
/// still the poison it was filled with.
fn unpad(padded: &[bf16], t: usize) -> Vec<bf16> {
    let mut out = Vec::with_capacity(t * HQ * D);
    for i in 0..t {
        let row = &padded[i * OUT_ROW..(i + 1) * OUT_ROW];
        out.extend_from_slice(&row[..HQ * D]);
        assert!(
            row[HQ * D..]
                .iter()
                .all(|x| x.to_bits() == bf16::NAN.to_bits()),
            "row {i}: the padding between strided output rows was written"
        );
    }
    out
}

fn bits(xs: &[bf16]) -> Vec<u16> {
    xs.iter().map(|x| x.to_bits()).collect()
}

fn geometry() -> ModelGeometry {
    ModelGeometry::new(LAYERS, HQ, HKV, D).unwrap()
}

fn pattern() -> HeadPattern {
    HeadPattern::from_kinds(
        geometry(),
        vec![vec![HeadKind::Dense, HeadKind::Streaming]; LAYERS],
    )
    .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_on_a_fused_qkv_buffer_equals_packed_tensors() {
    let gpu = common::gpu();
    let s = gpu.stream();
    let mut rng = StdRng::seed_from_u64(3);
    let cu = [0usize, 300, 700];
    let t = cu[2];
    let a = activations(&mut rng, t);
    let args = PrefillArgs {
        q_heads: HQ,
        kv_heads: HKV,
        head_dim: D,
        cu_seqlens: &cu,
        kinds: &[HeadKind::Dense, HeadKind::Streaming],
        sink_tokens: 64,
        local_tokens: 256,
        block_masks: None,
        softmax_scale: None,
        prefix_lens: None,
        with_lse: false,
    };
    let (q, k, v) = (
        s.clone_htod(&a.q).unwrap(),
        s.clone_htod(&a.k).unwrap(),
        s.clone_htod(&a.v).unwrap(),
    );
    let mut packed_out = s.clone_htod(&vec![bf16::NAN; t * HQ * D]).unwrap();
    prefill_attention(&gpu, &args, &q, &k, &v, &mut packed_out).unwrap();

    let fused = s.clone_htod(&a.fused).unwrap();
    let mut padded = s.clone_htod(&vec![bf16::NAN; t * OUT_ROW]).unwrap();
    prefill_attention(
        &gpu,
        &args,
        Tokens::strided(fused.slice(..), ROW),
        Tokens::strided(fused.slice(HQ * D..), ROW),
        Tokens::strided(fused.slice((HQ + HKV) * D..), ROW),
        TokensMut::strided(padded.slice_mut(..), OUT_ROW),
    )
    .unwrap();
    let want = s.clone_dtoh(&packed_out).unwrap();
    let got = unpad(&s.clone_dtoh(&padded).unwrap(), t);
    assert!(want.iter().all(|x| x.is_finite()));
    assert_eq!(bits(&got), bits(&want));
}

/// A cache of `LAYERS` layers holding one prompt of `prompt` tokens prefilled from `a` (fused
/// views if `fused`), then `steps` decode steps of the tokens of `steps` (fused views and a
/// padded output if `fused`); returns each step's last-layer output, packed.
fn prefill_and_decode(
    gpu: &GpuContext,
    prompt: &Activations,
    steps: &[Activations],
    fused: bool,
) -> Vec<Vec<bf16>> {
    let s = gpu.stream();
    let t = prompt.q.len() / (HQ * D);
    let config = SparsityConfig {
        token_budget: 256,
        dynamic_min_len: 512,
        reuse_interval: 2,
        ..SparsityConfig::default()
    };
    let mut mgr = KvCacheManager::new(geometry(), pattern(), config, 256, 1, 4096).unwrap();
    let seq = mgr.add_sequence().unwrap();
    let range = mgr.reserve(seq, t).unwrap();
    let mut cache = DeviceKvCache::<bf16>::new(gpu, &mgr).unwrap();
    let writes = KvWritePlan::new(&mgr, &[(seq, range)])
        .unwrap()
        .upload(gpu, &mgr, &mut cache)
        .unwrap();
    let upload = |x: &[bf16]| -> CudaSlice<bf16> { s.clone_htod(x).unwrap() };
    let (pq, pk, pv, pf) = (
        upload(&prompt.q),
        upload(&prompt.k),
        upload(&prompt.v),
        upload(&prompt.fused),
    );
    let mut out = upload(&vec![bf16::NAN; t * OUT_ROW]);
    for layer in 0..LAYERS {
        if fused {
            prefill_into_cache(
                gpu,
                &mut cache,
                layer,
                &writes,
                None,
                Tokens::strided(pf.slice(..), ROW),
                Tokens::strided(pf.slice(HQ * D..), ROW),
                Tokens::strided(pf.slice((HQ + HKV) * D..), ROW),
                TokensMut::strided(out.slice_mut(..), OUT_ROW),
            )
            .unwrap();
        } else {
            prefill_into_cache(
                gpu,
                &mut cache,
                layer,
                &writes,
                None,
                &pq,
                &pk,
                &pv,
                out.slice_mut(..t * HQ * D),
            )
            .unwrap();
        }
    }
    let mut step = DecodeStep::new(gpu, &cache, 1).unwrap();
    let mut outputs = Vec::new();
    for a in steps {
        let (q, k, v, f) = (upload(&a.q), upload(&a.k), upload(&a.v), upload(&a.fused));
        let mut out = upload(&vec![bf16::NAN; OUT_ROW]);
        let mut plan = step.plan(gpu, &mut mgr, &mut cache, &[seq]).unwrap();
        for layer in 0..LAYERS {
            if fused {
                plan.layer(
                    gpu,
                    &mut cache,
                    layer,
                    Tokens::strided(f.slice(..), ROW),
                    Tokens::strided(f.slice(HQ * D..), ROW),
                    Tokens::strided(f.slice((HQ + HKV) * D..), ROW),
                    TokensMut::strided(out.slice_mut(..), OUT_ROW),
                )
                .unwrap();
            } else {
                plan.layer(gpu, &mut cache, layer, &q, &k, &v, out.slice_mut(..HQ * D))
                    .unwrap();
            }
        }
        plan.finish(gpu, &mut cache).unwrap();
        let got = s.clone_dtoh(&out).unwrap();
        outputs.push(if fused {
            unpad(&got, 1)
        } else {
            got[..HQ * D].to_vec()
        });
    }
    outputs
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_decode_step_on_a_fused_qkv_buffer_equals_packed_tensors() {
    let gpu = common::gpu();
    let mut rng = StdRng::seed_from_u64(5);
    // 1200 cached tokens, past `dynamic_min_len` 512: the steps select pages (every second step).
    let prompt = activations(&mut rng, 1200);
    let steps: Vec<Activations> = (0..3).map(|_| activations(&mut rng, 1)).collect();
    let want = prefill_and_decode(&gpu, &prompt, &steps, false);
    let got = prefill_and_decode(&gpu, &prompt, &steps, true);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(w.iter().all(|x| x.is_finite()), "step {i}: packed output");
        assert_eq!(bits(g), bits(w), "step {i}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn views_that_break_the_length_rule_are_typed_errors() {
    let gpu = common::gpu();
    let s = gpu.stream();
    let cu = [0usize, 100];
    let t = cu[1];
    let args = PrefillArgs {
        q_heads: HQ,
        kv_heads: HKV,
        head_dim: D,
        cu_seqlens: &cu,
        kinds: &[HeadKind::Dense, HeadKind::Dense],
        sink_tokens: 64,
        local_tokens: 256,
        block_masks: None,
        softmax_scale: None,
        prefix_lens: None,
        with_lse: false,
    };
    let fused = s.alloc_zeros::<bf16>(t * ROW).unwrap();
    let mut out = s.clone_htod(&vec![bf16::NAN; t * HQ * D]).unwrap();
    let q = || Tokens::strided(fused.slice(..), ROW);
    let k = || Tokens::strided(fused.slice(HQ * D..), ROW);
    let v = || Tokens::strided(fused.slice((HQ + HKV) * D..), ROW);
    // The last token's v row ends at the buffer's end: one element short is a shape error.
    let short_v = Tokens::strided(fused.slice((HQ + HKV) * D..t * ROW - 1), ROW);
    assert!(matches!(
        prefill_attention(&gpu, &args, q(), k(), short_v, &mut out),
        Err(LserveError::ShapeMismatch { what: "v", .. })
    ));
    // k and v with different strides; a stride that is not whole heads; one below a row.
    let packed_v = s.alloc_zeros::<bf16>(t * HKV * D).unwrap();
    assert!(matches!(
        prefill_attention(&gpu, &args, q(), k(), &packed_v, &mut out),
        Err(LserveError::InvalidArgument { what: "v", .. })
    ));
    assert!(matches!(
        prefill_attention(
            &gpu,
            &args,
            Tokens::strided(fused.slice(..), ROW - 8),
            k(),
            v(),
            &mut out
        ),
        Err(LserveError::InvalidArgument { what: "q", .. })
    ));
    assert!(matches!(
        prefill_attention(
            &gpu,
            &args,
            q(),
            k(),
            v(),
            TokensMut::strided(out.slice_mut(..), HQ * D - D)
        ),
        Err(LserveError::InvalidArgument { what: "out", .. })
    ));
    // A view that does not start on a 16-byte boundary.
    assert!(matches!(
        prefill_attention(
            &gpu,
            &args,
            Tokens::strided(fused.slice(4..), ROW),
            k(),
            v(),
            &mut out
        ),
        Err(LserveError::InvalidArgument { what: "q", .. })
    ));
    // Nothing was enqueued: the output is still all poison.
    let after = s.clone_dtoh(&out).unwrap();
    assert!(after.iter().all(|x| x.to_bits() == bf16::NAN.to_bits()));
}
