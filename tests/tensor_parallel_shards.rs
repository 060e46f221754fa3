//! Tensor-parallel shards (`ModelGeometry::shard`, `HeadPattern::shard`): a model's KV heads
//! split over `n` ranks, each shard with its own cache manager, host cache and index tables sized
//! for its heads. Run one after another on the CPU reference, the shards' prefill and decode
//! steps (with page selection and reuse) give, concatenated by head, exactly the unsharded
//! model's outputs; and a shard's cache holds only its heads.

mod common;

use common::{head_pattern, heads_of, prefilled, prompt_rows, random_vec_in, Prefilled};
use half::bf16;
use lserve::config::SparsityConfig;
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::HeadPattern;
use lserve::reference::decode::decode_step;
use lserve::reference::prefill::{prefill_attention, PrefillInput};
use lserve::reference::TokenPattern;
use lserve::LserveError;
use rand::rngs::StdRng;
use rand::SeedableRng;

const D: usize = 64;

/// `n` values uniform in `[-2, 2)`, as bf16.
fn random(rng: &mut StdRng, n: usize) -> Vec<bf16> {
    random_vec_in(rng, n, -2.0..2.0)
}

/// One model's (or shard's) cache: manager, host cache, index tables, reuse state, sequences.
type Cache = Prefilled<bf16>;

fn config() -> SparsityConfig {
    SparsityConfig {
        page_tokens: 16,
        logical_page_tokens: 8,
        token_budget: 48,
        sink_tokens: 4,
        local_tokens: 24,
        dynamic_min_len: 40,
        reuse_interval: 3,
        ..SparsityConfig::default()
    }
}

/// A cache for `pattern` with `prompts` prefilled on every layer from `k`, `v` (`[T][Hkv][D]`
/// of the pattern's heads, sequences one after another).
fn cache(
    pattern: &HeadPattern,
    prompts: &[usize],
    k: &[bf16],
    v: &[bf16],
    max_len: usize,
) -> Cache {
    let heads = pattern.geometry().kv_heads();
    let kv = prompt_rows(prompts, heads, D, k, v);
    prefilled(pattern.clone(), config(), prompts, max_len, 0, kv)
}

impl Cache {
    /// One decode step over every layer with the same `q`, `k`, `v` per layer (`[B][H][D]`):
    /// the outputs `[layer][B][Hq][D]`.
    fn step(&mut self, q: &[bf16], k: &[bf16], v: &[bf16]) -> Vec<Vec<f64>> {
        for &s in &self.seqs {
            self.mgr.reserve(s, 1).unwrap();
        }
        let layers = self.mgr.geometry().layers();
        let out = (0..layers)
            .map(|layer| {
                decode_step(
                    &self.mgr,
                    &mut self.host,
                    &mut self.tables,
                    &mut self.reuse,
                    layer,
                    &self.seqs,
                    q,
                    k,
                    v,
                )
                .unwrap()
                .out
            })
            .collect();
        for &s in &self.seqs {
            self.mgr.advance_decode_step(s).unwrap();
        }
        out
    }
}

#[test]
fn shards_decode_exactly_as_the_unsharded_model() {
    // 2 layers, 4 KV heads of group 2, mixed kinds; shards of 1, 2 and 4 ranks.
    let g = ModelGeometry::new(2, 8, 4, D).unwrap();
    let pattern = head_pattern(
        g,
        &[
            vec![false, true, false, false],
            vec![true, false, false, true],
        ],
    );
    let prompts = [70, 23, 51];
    let steps = 8;
    let max_len = 100;
    let mut rng = StdRng::seed_from_u64(7);
    let t: usize = prompts.iter().sum();
    let (hq, hkv) = (g.q_heads(), g.kv_heads());
    let (k, v) = (random(&mut rng, t * hkv * D), random(&mut rng, t * hkv * D));
    let per_step: Vec<[Vec<bf16>; 3]> = (0..steps)
        .map(|_| {
            let b = prompts.len();
            [
                random(&mut rng, b * hq * D),
                random(&mut rng, b * hkv * D),
                random(&mut rng, b * hkv * D),
            ]
        })
        .collect();

    let mut full = cache(&pattern, &prompts, &k, &v, max_len);
    let want: Vec<Vec<Vec<f64>>> = per_step
        .iter()
        .map(|[q, k, v]| full.step(q, k, v))
        .collect();

    for ranks in [1, 2, 4] {
        let (sq, skv) = (hq / ranks, hkv / ranks);
        for rank in 0..ranks {
            let shard = pattern.shard(rank, ranks).unwrap();
            assert_eq!(shard.geometry(), &g.shard(rank, ranks).unwrap());
            for layer in 0..g.layers() {
                assert_eq!(
                    shard.layer_kinds(layer),
                    &pattern.layer_kinds(layer)[rank * skv..][..skv]
                );
            }
            let part =
                |x: &[bf16], heads: usize, per: usize| heads_of(x, heads, D, rank * per, per);
            let mut c = cache(
                &shard,
                &prompts,
                &part(&k, hkv, skv),
                &part(&v, hkv, skv),
                max_len,
            );
            assert_eq!(c.host.pattern().geometry().kv_heads(), skv);
            for (s, [q, k, v]) in per_step.iter().enumerate() {
                let got = c.step(&part(q, hq, sq), &part(k, hkv, skv), &part(v, hkv, skv));
                for (layer, got) in got.iter().enumerate() {
                    assert_eq!(
                        got,
                        &heads_of(&want[s][layer], hq, D, rank * sq, sq),
                        "{ranks} ranks, rank {rank}, step {s}, layer {layer}"
                    );
                }
            }
        }
    }
}

#[test]
fn shards_prefill_exactly_as_the_unsharded_model() {
    let g = ModelGeometry::new(1, 12, 6, D).unwrap();
    let kinds = [false, true, true, false, false, true];
    let cu = [0usize, 90, 131, 200];
    let t = cu[3];
    let mut rng = StdRng::seed_from_u64(8);
    let (hq, hkv) = (g.q_heads(), g.kv_heads());
    let to_f32 = |x: Vec<bf16>| x.iter().map(|e| e.to_f32()).collect::<Vec<f32>>();
    let q = to_f32(random(&mut rng, t * hq * D));
    let k = to_f32(random(&mut rng, t * hkv * D));
    let v = to_f32(random(&mut rng, t * hkv * D));
    let pattern_of = |streaming: bool| {
        if streaming {
            TokenPattern::Lambda {
                sink_tokens: 4,
                local_tokens: 32,
            }
        } else {
            TokenPattern::Causal
        }
    };
    let patterns: Vec<TokenPattern> = kinds.iter().map(|&s| pattern_of(s)).collect();
    let input = |q: &[f32], k: &[f32], v: &[f32], hq: usize, hkv: usize, p: &[TokenPattern]| {
        prefill_attention(&PrefillInput {
            cu_seqlens: &cu,
            q,
            k,
            v,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: D,
            patterns: p,
            block_mask: None,
            scale: 0.125,
        })
        .unwrap()
    };
    let full = input(&q, &k, &v, hq, hkv, &patterns);
    for ranks in [2, 3, 6] {
        let shard_g = g.shard(0, ranks).unwrap();
        let (sq, skv) = (shard_g.q_heads(), shard_g.kv_heads());
        for rank in 0..ranks {
            let got = input(
                &heads_of(&q, hq, D, rank * sq, sq),
                &heads_of(&k, hkv, D, rank * skv, skv),
                &heads_of(&v, hkv, D, rank * skv, skv),
                sq,
                skv,
                &patterns[rank * skv..][..skv],
            );
            assert_eq!(
                got.out,
                heads_of(&full.out, hq, D, rank * sq, sq),
                "{ranks} ranks, rank {rank}"
            );
        }
    }
}

#[test]
fn shards_that_do_not_split_the_kv_heads_are_typed_errors() {
    let g = ModelGeometry::llama3_8b();
    let field = |r: lserve::Result<ModelGeometry>| match r {
        Err(LserveError::InvalidConfig { field, .. }) => field,
        other => panic!("not InvalidConfig: {other:?}"),
    };
    assert_eq!(field(g.shard(0, 0)), "ranks");
    assert_eq!(field(g.shard(0, 3)), "ranks");
    assert_eq!(field(g.shard(16, 16)), "ranks"); // 8 KV heads over 16 ranks
    assert_eq!(field(g.shard(4, 4)), "rank");
    let pattern = HeadPattern::all_dense(g);
    assert!(matches!(
        pattern.shard(2, 2),
        Err(LserveError::InvalidConfig { field: "rank", .. })
    ));
    // Every rank of an even split is a valid geometry with the model's group.
    for ranks in [1, 2, 4, 8] {
        for rank in 0..ranks {
            let s = g.shard(rank, ranks).unwrap();
            assert_eq!((s.kv_heads() * ranks, s.group()), (8, 4));
        }
    }
}
