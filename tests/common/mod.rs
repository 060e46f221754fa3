//! Helpers shared by the test files (`mod common;` in each). Every test file is a crate of its
//! own and uses only some of them, hence the `dead_code` allowance.
#![allow(dead_code)]

use lserve::dtype::{DType, Element};
use lserve::geometry::ModelGeometry;
use lserve::gpu::GpuContext;
use lserve::head_pattern::{HeadKind, HeadPattern};
use lserve::paging::HostKvCache;
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
