//! Fuzz harnesses of lserve's CPU-side public API. Each `run(data)` builds its input from the
//! bytes with `arbitrary`, calls the library and checks the result against a model or the
//! documented rules; any panic (the library's or an assertion's) is a finding.
//!
//! Inputs that the library would accept and then allocate more than [`ALLOC_BUDGET`] elements
//! for are skipped (a valid request for that much memory is not a bug); inputs it must reject,
//! or whose sizes overflow, are always run.

pub mod cache_manager;
pub mod calibration;
pub mod constructors;
pub mod head_pattern;
mod manager_model;
pub mod page_pool;
pub mod session;
mod size;

/// A geometry the kernels serve, from fuzz bytes: `1 + layers % max[0]` layers, `1 + kv_heads %
/// max[1]` KV heads, groups of `1 + group % max[2]`, head dim 128 if `wide` else 64.
pub(crate) fn small_geometry(
    [layers, kv_heads, group]: [u8; 3],
    wide: bool,
    max: [usize; 3],
) -> lserve::geometry::ModelGeometry {
    let kv = 1 + kv_heads as usize % max[1];
    lserve::geometry::ModelGeometry::new(
        1 + layers as usize % max[0],
        kv * (1 + group as usize % max[2]),
        kv,
        if wide { 128 } else { 64 },
    )
    .expect("a geometry the kernels serve")
}

/// The most elements a harness lets an accepted constructor allocate.
pub const ALLOC_BUDGET: usize = 1 << 22;

/// A harness: runs one input.
pub type Harness = fn(&[u8]);

/// The harnesses by name, for replaying kept inputs.
pub const TARGETS: [(&str, Harness); 6] = [
    ("head_pattern", head_pattern::run),
    ("calibration", calibration::run),
    ("constructors", constructors::run),
    ("page_pool", page_pool::run),
    ("cache_manager", cache_manager::run),
    ("session", session::run),
];
