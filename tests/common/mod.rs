//! Helpers shared by the test files (`mod common;` in each). Every test file is a crate of its
//! own and uses only some of them, hence the `dead_code` allowance.
#![allow(dead_code)]

use lserve::dtype::{DType, Element};
use lserve::geometry::ModelGeometry;
use lserve::gpu::GpuContext;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::HostKvCache;
use lserve::reference::select::Selection;
use rand::rngs::StdRng;
use rand::Rng;

/// The GPU these tests run on. They are `#[ignore]`d, so this only runs when asked for
/// (`--ignored`/`--include-ignored`): then a machine without a usable GPU is a failure, never a
/// silent pass.
pub fn gpu() -> GpuContext {
    GpuContext::new(0).unwrap_or_else(|e| {
        panic!(
            "GPU test run without a usable CUDA GPU ({e}): these tests must run on a GPU machine"
        )
    })
}

/// The head kinds of one layer from a case's flags (`true`: streaming, `false`: dense).
pub fn head_kinds(streaming: &[bool]) -> Vec<HeadKind> {
    streaming
        .iter()
        .map(|&s| {
            if s {
                HeadKind::Streaming
            } else {
                HeadKind::Dense
            }
        })
        .collect()
}

/// The head pattern of a case's flags, `[layer][kv_head]` (`true`: streaming, `false`: dense).
pub fn head_pattern(geometry: ModelGeometry, streaming: &[Vec<bool>]) -> HeadPattern {
    let kinds = streaming.iter().map(|layer| head_kinds(layer)).collect();
    HeadPattern::from_kinds(geometry, kinds).unwrap()
}

/// The six element arrays of `layer` in two caches, side by side and named: the dense K and V
/// pools, the key statistics (`kmin`, `kmax`), the streaming K and V stores.
pub fn layer_arrays<'a, E: Element>(
    got: &'a HostKvCache<E>,
    want: &'a HostKvCache<E>,
    layer: usize,
) -> [(&'static str, &'a [E], &'a [E]); 6] {
    let (gd, wd) = (got.dense(layer).unwrap(), want.dense(layer).unwrap());
    let (gs, ws) = (
        got.streaming(layer).unwrap(),
        want.streaming(layer).unwrap(),
    );
    [
        ("K pool", gd.k(), wd.k()),
        ("V pool", gd.v(), wd.v()),
        ("kmin", gd.kmin(), wd.kmin()),
        ("kmax", gd.kmax(), wd.kmax()),
        ("K stream", gs.k(), ws.k()),
        ("V stream", gs.v(), ws.v()),
    ]
}

/// `n` values uniform in `[-1, 1)`, rounded to `E`.
pub fn random_vec<E: Element>(rng: &mut StdRng, n: usize) -> Vec<E> {
    (0..n)
        .map(|_| E::from_f32(rng.gen_range(-1.0f32..1.0)))
        .collect()
}

/// The relative error a GPU attention output of element type `E` must stay under against the
/// f64 reference: `2e-3` for f16, `1e-2` for bf16.
pub fn tolerance<E: Element>() -> f64 {
    match E::DTYPE {
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
    }
}

/// `f16_or_bf16!(flag, f(args))` calls `f::<f16>(args)` when `flag` is true, else
/// `f::<bf16>(args)`: runs a case in the element type it drew.
#[allow(unused_macros)] // the module's `dead_code` allowance does not cover macros
macro_rules! f16_or_bf16 {
    ($f16:expr, $f:ident($($arg:expr),* $(,)?)) => {
        if $f16 {
            $f::<half::f16>($($arg),*)
        } else {
            $f::<half::bf16>($($arg),*)
        }
    };
}
#[allow(unused_imports)] // as the macro: not every test file dispatches on the element type
pub(crate) use f16_or_bf16;

/// Relative tolerance of a near-tie in page selection (`docs/ARCHITECTURE.md`, "Equivalence
/// rules").
pub const SELECTION_TOL: f64 = 1e-4;

/// Checks a GPU selection (logical pages) against the reference: same rules, same size, and
/// differences only on near-ties of the K-th candidate score (`docs/ARCHITECTURE.md`, "Equivalence
/// rules"): pages whose reference score is within [`SELECTION_TOL`] of it, relative to the pair's
/// largest score magnitude. The candidates are the pages below the newest, without page 0 when
/// it is always included.
pub fn check_selection(
    got: &[u32],
    want: &Selection,
    top_k: usize,
    always_first: bool,
) -> Result<(), String> {
    let scores = &want.physical_scores;
    let pages = scores.len() as u32;
    let newest = pages - 1;
    if got.windows(2).any(|w| w[0] >= w[1]) || got.iter().any(|&p| p >= pages) {
        return Err(format!("not ascending pages of the sequence: {got:?}"));
    }
    if got.last() != Some(&newest) || (always_first && got[0] != 0) {
        return Err(format!("missing the newest or first page: {got:?}"));
    }
    if got.len() != want.pages.len() {
        return Err(format!("{} pages, reference {:?}", got.len(), want.pages));
    }
    let first = u32::from(always_first).min(newest);
    let mut candidates: Vec<f64> = (first..newest).map(|p| scores[p as usize]).collect();
    if candidates.len() <= top_k {
        return if got == want.pages.as_slice() {
            Ok(())
        } else {
            Err(format!("took all candidates: {got:?} vs {:?}", want.pages))
        };
    }
    candidates.sort_by(|a, b| b.total_cmp(a));
    let kth = candidates[top_k - 1];
    let scale = scores.iter().fold(0.0f64, |m, s| m.max(s.abs()));
    for &p in got
        .iter()
        .filter(|p| !want.pages.contains(p))
        .chain(want.pages.iter().filter(|p| !got.contains(p)))
    {
        let s = scores[p as usize];
        if (s - kth).abs() > SELECTION_TOL * scale.max(f64::MIN_POSITIVE) {
            return Err(format!(
                "page {p} (score {s}) differs, K-th score {kth}: {got:?} vs {:?}",
                want.pages
            ));
        }
    }
    Ok(())
}
