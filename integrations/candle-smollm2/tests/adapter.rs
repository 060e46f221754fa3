//! The adapter against plain attention in candle ops (no model needed), and the whole engine on
//! the GGUF (ignored: `scripts/fetch_smollm2.sh`, then `cargo test --release -- --include-ignored`,
//! as `scripts/test.sh` runs them).

use candle_core::{DType, Device, Tensor, D};
use lserve::config::{GqaAggregation, SparsityConfig};
use lserve::geometry::ModelGeometry;
use lserve::head_pattern::HeadPattern;
use lserve_candle_smollm2::adapter::{prefill_attention, to_f16, LserveAttention};
use lserve_candle_smollm2::engine::{self, Heads, Selection, Setting, Timing};
use lserve_candle_smollm2::eval::{self, Outcome, Window};
use lserve_candle_smollm2::model::Llama;
use lserve_candle_smollm2::tokenizer;
use tokenizers::Tokenizer;

/// Causal softmax attention of `q [T][Hq][D]` over `k`, `v [T][Hkv][D]` in candle ops (f32),
/// query head `h` on KV head `h / G`; rows `[T][Hq * D]`.
fn candle_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let (t, hq, d) = q.dims3().unwrap();
    let hkv = k.dim(1).unwrap();
    let g = hq / hkv;
    let expand = |x: &Tensor| {
        // [T][Hkv][D] -> [Hq][T][D]
        let x = x.transpose(0, 1).unwrap().contiguous().unwrap();
        let x = x.unsqueeze(1).unwrap().expand((hkv, g, t, d)).unwrap();
        x.reshape((hq, t, d)).unwrap()
    };
    let (k, v) = (expand(k), expand(v));
    let q = q.transpose(0, 1).unwrap().contiguous().unwrap();
    let scores = (q.matmul(&k.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
    let scores = scores.broadcast_add(&mask).unwrap();
    let max = scores.max_keepdim(D::Minus1).unwrap();
    let e = scores.broadcast_sub(&max).unwrap().exp().unwrap();
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
    let o = p.matmul(&v).unwrap(); // [Hq][T][D]
    o.transpose(0, 1).unwrap().reshape((t, hq * d)).unwrap()
}

/// Rounded to f16 and back, as the adapter hands them to lserve.
fn f16_round(x: &Tensor) -> Tensor {
    x.to_dtype(DType::F16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
}

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    let scale = b.abs().unwrap().max_all().unwrap();
    (diff / scale).unwrap().to_scalar::<f32>().unwrap()
}

/// SmolLM2's attention shape: 9 query heads on 3 KV heads (GQA group 3), D 64.
#[test]
fn adapter_prefill_and_decode_equal_candle_attention_for_group_3() {
    let (t, hq, hkv, d) = (37, 9, 3, 64);
    let g = ModelGeometry::new(1, hq, hkv, d).unwrap();
    let dev = Device::Cpu;
    let q = f16_round(&Tensor::randn(0f32, 1.0, (t, hq, d), &dev).unwrap());
    let k = f16_round(&Tensor::randn(0f32, 1.0, (t, hkv, d), &dev).unwrap());
    let v = f16_round(&Tensor::randn(0f32, 1.0, (t, hkv, d), &dev).unwrap());
    let want = candle_attention(&q, &k, &v);

    let pattern = HeadPattern::all_dense(g);
    let config = SparsityConfig::default();
    let got = prefill_attention(&pattern, &config, 0, &q, &k, &v).unwrap();
    assert_eq!(got.dims(), &[t, hq * d]);
    assert!(
        max_rel(&got, &want) < 1e-5,
        "prefill: {}",
        max_rel(&got, &want)
    );

    // The same tokens again: a prompt of t - 5 tokens, then 5 decode steps through the cache.
    let setting = Setting {
        streaming: 0.0,
        heads: Heads::Interleaved,
        selection: Selection::Dense,
        aggregation: GqaAggregation::Max,
    };
    let mut attn = LserveAttention::new(pattern, setting.config(), t, true).unwrap();
    let p = t - 5;
    attn.reserve_prompt(p).unwrap();
    let (kp, vp) = (k.narrow(0, 0, p).unwrap(), v.narrow(0, 0, p).unwrap());
    attn.write_prompt(0, &to_f16(&kp).unwrap(), &to_f16(&vp).unwrap())
        .unwrap();
    for i in p..t {
        attn.begin_step().unwrap();
        let row = |x: &Tensor| x.narrow(0, i, 1).unwrap();
        let (out, _, probe) = attn.decode(0, &row(&q), &row(&k), &row(&v)).unwrap();
        attn.end_step().unwrap();
        let want_row = want.narrow(0, i, 1).unwrap();
        assert!(max_rel(&out, &want_row) < 1e-5, "decode at {i}");
        let probe = probe.unwrap();
        assert!(
            probe.rel_err < 1e-12,
            "dense against itself: {}",
            probe.rel_err
        );
        assert!(probe.mass.iter().all(|m| (m - 1.0).abs() < 1e-9));
    }
}

/// With page selection on, the probe reports less than all of the mass, and the output of a
/// selection that takes every page is the dense one.
#[test]
fn selection_probe_reports_the_mass_it_missed() {
    let (t, hq, hkv, d) = (300, 9, 3, 64);
    let g = ModelGeometry::new(1, hq, hkv, d).unwrap();
    let dev = Device::Cpu;
    let k = f16_round(&Tensor::randn(0f32, 1.0, (t, hkv, d), &dev).unwrap());
    let v = f16_round(&Tensor::randn(0f32, 1.0, (t, hkv, d), &dev).unwrap());
    let q = f16_round(&Tensor::randn(0f32, 2.0, (1, hq, d), &dev).unwrap());
    let setting = Setting {
        streaming: 0.0,
        heads: Heads::Interleaved,
        selection: Selection::Flat {
            budget: 64,
            page: 16,
        },
        aggregation: GqaAggregation::Max,
    };
    let mut attn =
        LserveAttention::new(HeadPattern::all_dense(g), setting.config(), t + 1, true).unwrap();
    attn.reserve_prompt(t).unwrap();
    attn.write_prompt(0, &to_f16(&k).unwrap(), &to_f16(&v).unwrap())
        .unwrap();
    attn.begin_step().unwrap();
    let kv = |x: &Tensor| x.narrow(0, 0, 1).unwrap();
    let (_, visits, probe) = attn.decode(0, &q, &kv(&k), &kv(&v)).unwrap();
    let probe = probe.unwrap();
    assert_eq!(visits.len(), hkv);
    for (m, n) in probe.mass.iter().zip(&probe.tokens) {
        assert!(*m > 0.0 && *m < 1.0, "mass {m}");
        assert!(*n < t + 1 && *n >= 64, "{n} tokens");
    }
    assert!(probe.rel_err > 0.0);
}

/// The model and its tokenizer from `scripts/fetch_smollm2.sh`'s location.
fn smollm2() -> (Llama, Tokenizer) {
    let path = lserve_candle_smollm2::default_gguf_path().expect("no HOME");
    let (model, content) = Llama::load(&path)
        .unwrap_or_else(|e| panic!("{e:#}: run `bash scripts/fetch_smollm2.sh` first"));
    let tok = tokenizer::from_gguf(&content).unwrap();
    (model, tok)
}

/// The model's logits `[T][vocab]` at every position of `ids` with attention in candle ops
/// ([`candle_attention`] of Q, K, V rounded to `f16` as the adapter rounds them), no lserve in
/// the forward.
fn candle_logits(model: &Llama, ids: &[u32]) -> Tensor {
    let mut x = model.embed(ids).unwrap();
    for layer in 0..model.config().layers {
        let qkv = model.qkv(layer, &x, 0).unwrap();
        let attn = candle_attention(&f16_round(&qkv.q), &f16_round(&qkv.k), &f16_round(&qkv.v));
        x = model.finish_layer(layer, &x, &attn).unwrap();
    }
    model.logits(&x).unwrap()
}

/// The engine on the real model: dense decode through lserve's cache gives the logits of one
/// full prefill of the same tokens (the decode path, the cache writes and RoPE positions agree).
#[test]
#[ignore = "needs the SmolLM2 GGUF: scripts/fetch_smollm2.sh"]
fn dense_decode_matches_prefill_on_smollm2() {
    let (model, tok) = smollm2();
    let text = "The GNU General Public License is a free, copyleft license for software and \
                other kinds of works. The licenses for most software and other practical works \
                are designed to take away your freedom to share and change the works.";
    let ids = tokenizer::encode(&tok, text).unwrap();
    assert!(ids.len() > 20, "{} tokens", ids.len());
    let setting = Setting {
        streaming: 0.0,
        heads: Heads::Interleaved,
        selection: Selection::Dense,
        aggregation: GqaAggregation::Max,
    };
    let g = engine::geometry(&model).unwrap();
    let (p, n) = (ids.len() - 4, ids.len());
    // Logits of every position from one prefill of all tokens.
    let full = engine::prefill(
        &model,
        &setting.pattern(g, None).unwrap(),
        &setting.config(),
        &ids,
    )
    .unwrap();
    let last_full = model.logits(&full.last_hidden).unwrap();
    // The prompt, then the last 4 tokens decoded one at a time.
    let pre = engine::prefill(
        &model,
        &setting.pattern(g, None).unwrap(),
        &setting.config(),
        &ids[..p],
    )
    .unwrap();
    let pattern = setting.pattern(g, None).unwrap();
    let mut attn = engine::cache_for(&setting, &pattern, &pre, n - p, false).unwrap();
    let mut timing = Timing::default();
    let mut last = Vec::new();
    for (i, &token) in ids[p..].iter().enumerate() {
        last = engine::decode_token(&model, &mut attn, token, p + i, &mut timing)
            .unwrap()
            .logits;
    }
    let last = Tensor::new(last.as_slice(), &Device::Cpu).unwrap();
    let rel = max_rel(&last, &last_full.flatten_all().unwrap());
    assert!(rel < 2e-2, "decode vs prefill logits: relative {rel}");
    let (a, b) = (
        last.argmax(0).unwrap().to_scalar::<u32>().unwrap(),
        last_full
            .flatten_all()
            .unwrap()
            .argmax(0)
            .unwrap()
            .to_scalar::<u32>()
            .unwrap(),
    );
    assert_eq!(a, b);
}

/// Random patterns: the fraction's count of streaming heads, a function of the seed, and not
/// the same choice for every seed.
#[test]
fn random_patterns_have_the_count_and_depend_on_the_seed() {
    let g = ModelGeometry::new(30, 9, 3, 64).unwrap();
    for fraction in [0.0, 0.25, 0.5, 1.0] {
        let want = (fraction * 90.0_f64).round() as usize;
        for seed in 0..5 {
            let p = engine::random_pattern(g, fraction, seed).unwrap();
            assert_eq!(p.total_streaming_heads(), want);
            assert_eq!(p, engine::random_pattern(g, fraction, seed).unwrap());
        }
    }
    let patterns: Vec<HeadPattern> = (0..5)
        .map(|seed| engine::random_pattern(g, 0.5, seed).unwrap())
        .collect();
    for i in 0..5 {
        for j in i + 1..5 {
            assert_ne!(patterns[i], patterns[j], "seeds {i} and {j}");
        }
    }
    // Not the interleaved pattern either, and streaming heads in many layers.
    assert_ne!(patterns[0], HeadPattern::interleaved(g, 0.5).unwrap());
    let layers_with_streaming = (0..30)
        .filter(|&l| patterns[0].streaming_heads(l) > 0)
        .count();
    assert!(layers_with_streaming > 15, "{layers_with_streaming}");
    assert!(engine::random_pattern(g, 1.5, 0).is_err());
}

/// Calibrated heads need a calibration; with one, `Setting::pattern` is
/// `HeadPattern::from_calibration` of it.
#[test]
fn calibrated_setting_uses_the_calibration() {
    use lserve::head_pattern::Calibration;
    let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
    let setting = Setting {
        streaming: 0.5,
        heads: Heads::Calibrated,
        selection: Selection::Dense,
        aggregation: GqaAggregation::Max,
    };
    assert!(setting.pattern(g, None).is_err());
    let config = SparsityConfig {
        sink_tokens: 1,
        local_tokens: 2,
        ..SparsityConfig::default()
    };
    let mut cal = Calibration::new(g, &config).unwrap();
    // KV head 1's query looks at key 1, outside the window from position 3; KV head 0's at the
    // sink: head 0 streams.
    let t = 8;
    let mut k = vec![0.0f32; t * 2 * 64];
    let mut q = vec![0.0f32; t * 2 * 64];
    for j in 0..t {
        for h in 0..2 {
            k[(j * 2 + h) * 64 + j] = 1.0;
        }
        q[(j * 2) * 64] = 1000.0;
        q[(j * 2 + 1) * 64 + 1] = 1000.0;
    }
    cal.add_layer(0, t, &q, &k).unwrap();
    let p = setting.pattern(g, Some(&cal)).unwrap();
    assert_eq!(p, HeadPattern::from_calibration(&cal, 0.5).unwrap());
    assert_eq!(p.streaming_kv_heads(0), &[0]);
    let other = ModelGeometry::new(2, 2, 2, 64).unwrap();
    assert!(setting.pattern(other, Some(&cal)).is_err());
    // Ranked by output error: this calibration has no values, so no such pattern.
    let by_output = Setting {
        heads: Heads::CalibratedOutput,
        ..setting
    };
    assert!(by_output.pattern(g, Some(&cal)).is_err());
    assert_eq!(by_output.name(), "stream-s0.5-calibout");
    assert_eq!(
        setting.name(),
        "stream-s0.5-calib",
        "the name says the heads are calibrated"
    );
}

/// Calibration on the real model: every KV head gets a score in [0, 1], and the heads differ
/// (some attend far more outside the window than others).
#[test]
#[ignore = "needs the SmolLM2 GGUF: scripts/fetch_smollm2.sh"]
fn calibration_on_smollm2_scores_every_head() {
    let (model, tok) = smollm2();
    let text = read_text("/usr/share/common-licenses/Apache-2.0");
    let ids = tokenizer::encode(&tok, &text).unwrap();
    let config = SparsityConfig::default();
    let n = 420;
    let (cal, _, _) = engine::calibrate(&model, &config, &ids[..n], 4).unwrap();
    assert!(
        cal.positions().iter().all(|&p| p == 25),
        "{:?}",
        cal.positions()
    );
    let scores: Vec<f64> = cal.scores().unwrap().into_iter().flatten().collect();
    assert_eq!(scores.len(), 90);
    assert!(scores.iter().all(|&s| (0.0..=1.0 + 1e-9).contains(&s)));
    let (lo, hi) = scores
        .iter()
        .fold((1.0f64, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
    assert!(hi - lo > 0.1, "scores {lo}..{hi}");
    let errors: Vec<f64> = cal.output_errors().unwrap().into_iter().flatten().collect();
    assert!(errors.iter().all(|&e| e.is_finite() && e >= 0.0));
    let (lo, hi) = errors
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
    assert!(hi - lo > 0.1, "output errors {lo}..{hi}");
}

/// A text of Debian's `base-files` (essential: on every Debian system).
fn read_text(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!("{path}: {e} (Debian's base-files package installs it; this test needs it)")
    })
}

/// The smoke test of the fidelity run on the real model over a short context (`eval`: the
/// `fidelity` binary's code path): GPL-3's last 16 tokens teacher-forced after a 512-token
/// prompt, dense attention through lserve against candle's own attention, and LServe's and flat
/// selection at a budget of half the context and half the KV heads streaming against dense.
///
/// Measured (2026-12-03, at the commit that added it): dense mean NLL 1.5776 (perplexity 4.84;
/// a broken attention gives hundreds), candle's attention 1.5155, mean |per-token difference|
/// 0.079 (two tokens at 0.25 and 0.63, the rest below 0.09: the model amplifies the last bits
/// of f16 and of its 8-bit activation quantization); lserve-b256-r4 +0.058 vs dense (dense
/// heads' attention mass 0.947, output error 0.068, 328 tokens per KV head), flat-b256 +0.107
/// (0.946, 0.064, 280), stream-s0.5 +0.069 (streaming heads' mass 0.881). The bounds below
/// leave about 3x that room.
#[test]
#[ignore = "needs the SmolLM2 GGUF: scripts/fetch_smollm2.sh"]
fn short_context_nll_on_smollm2() {
    const CONTEXT: usize = 512;
    const EVAL: usize = 16;
    const BUDGET: usize = CONTEXT / 2;
    const REUSE: usize = 4;
    let (model, tok) = smollm2();
    let ids = tokenizer::encode(&tok, &read_text(lserve_candle_smollm2::DEFAULT_TEXT)).unwrap();
    let window = Window::last(&ids, CONTEXT, EVAL).unwrap();
    assert_eq!(window.prompt.len(), CONTEXT);
    let dense = Setting {
        streaming: 0.0,
        heads: Heads::Interleaved,
        selection: Selection::Dense,
        aggregation: GqaAggregation::Max,
    };
    let lserve = Setting {
        selection: Selection::Hierarchical {
            budget: BUDGET,
            reuse: REUSE,
        },
        ..dense
    };
    let flat = Setting {
        selection: Selection::Flat {
            budget: BUDGET,
            page: 16,
        },
        ..dense
    };
    let stream = Setting {
        streaming: 0.5,
        ..dense
    };
    let g = engine::geometry(&model).unwrap();
    let mut outcomes: Vec<Outcome> = Vec::new();
    for (pattern, group) in eval::by_pattern(&[dense, lserve, flat, stream], g, None).unwrap() {
        let pre = engine::prefill(&model, &pattern, &group[0].config(), window.prompt).unwrap();
        for s in &group {
            outcomes.push(eval::evaluate(&model, s, &pattern, &pre, &window, 1).unwrap());
        }
    }
    let get = |s: Setting| outcomes.iter().find(|o| o.setting == s).unwrap();
    let all = |x: &[Vec<f64>]| eval::mean(&x.concat());
    for o in &outcomes {
        eprintln!(
            "{}: mean NLL {:.4}, tokens per KV head {:.0}, mass (dense heads) {:.4}, mass \
             (streaming heads) {:.4}, rel. error {:.4}, {} steps selected",
            o.setting.name(),
            o.mean_nll(),
            eval::mean(&o.tokens_attended),
            all(&o.layer_mass_dense),
            all(&o.layer_mass_stream),
            all(&o.layer_rel_err),
            o.selected_steps
        );
        assert_eq!(o.nll.len(), EVAL);
        assert!(
            o.nll.iter().all(|x| x.is_finite() && *x >= 0.0),
            "{:?}",
            o.nll
        );
    }

    // Dense: a language model on English, and what the model gives with candle's attention
    // (one forward over prompt and evaluated tokens).
    let d = get(dense);
    assert!(
        d.mean_nll() > 0.5 && d.mean_nll() < 20f64.ln(),
        "dense: mean NLL {} (perplexity {})",
        d.mean_nll(),
        d.mean_nll().exp()
    );
    let logits = candle_logits(&model, &ids[window.first..window.first + CONTEXT + EVAL]);
    let candle_nll: Vec<f64> = (0..EVAL)
        .map(|i| {
            let row = logits.narrow(0, CONTEXT + i, 1).unwrap();
            let row = row.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            engine::nll(&row, window.targets[i]).unwrap()
        })
        .collect();
    let diff: Vec<f64> = d.nll.iter().zip(&candle_nll).map(|(a, b)| a - b).collect();
    let mean_abs = eval::mean(&diff.iter().map(|x| x.abs()).collect::<Vec<_>>());
    assert!(
        mean_abs < 0.2,
        "dense through lserve vs candle's attention: mean |NLL difference| {mean_abs}; \
         per token {diff:?}"
    );
    // Dense against itself: every token, all the mass, no error.
    assert_eq!(d.selected_steps, 0);
    for (i, &t) in d.tokens_attended.iter().enumerate() {
        assert_eq!(t, (CONTEXT + i + 1) as f64);
    }
    assert!(all(&d.layer_rel_err) < 1e-9);
    assert!((all(&d.layer_mass_dense) - 1.0).abs() < 1e-9);

    // Selection at half the context: fewer tokens than dense, most of its mass, near its NLL.
    for s in [lserve, flat] {
        let (o, name) = (get(s), s.name());
        let attended = eval::mean(&o.tokens_attended);
        assert!(
            attended >= BUDGET as f64 && attended < 0.7 * eval::mean(&d.tokens_attended),
            "{name}: {attended} tokens per KV head"
        );
        let mass = all(&o.layer_mass_dense);
        assert!(mass > 0.85 && mass < 1.0, "{name}: mass {mass}");
        let err = all(&o.layer_rel_err);
        assert!(err > 0.0 && err < 0.2, "{name}: output error {err}");
    }
    assert_eq!(get(lserve).selected_steps, EVAL.div_ceil(REUSE));
    assert_eq!(get(flat).selected_steps, EVAL);
    // Streaming heads: sinks + local window (320 tokens) of the 513..528.
    let st = get(stream);
    let mass = all(&st.layer_mass_stream);
    assert!(mass > 0.7 && mass < 1.0, "streaming heads: mass {mass}");
    assert!((all(&st.layer_mass_dense) - 1.0).abs() < 1e-9);
    for s in [lserve, flat, stream] {
        let delta = get(s).mean_nll() - d.mean_nll();
        assert!(
            delta.abs() < 0.35,
            "{}: mean NLL {delta:+.4} against dense",
            s.name()
        );
    }
}
