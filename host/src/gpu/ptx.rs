//! The embedded PTX modules and which one a device loads.
//!
//! lserve ships its kernels as PTX for sm_80 (Ampere and Ada: `cp.async` tiles, plain launches)
//! and for sm_90 (Hopper: tensor-map bulk copies, launches overlapped with the previous kernel),
//! built from the same kernel sources (`host/build.rs`). The driver compiles the chosen module for
//! the device when it loads. The PTX is ISA 8.0: a CUDA 12.0 or newer driver loads it. The modules
//! are embedded deflated (about a tenth of their text) and inflated when a context loads one.

use crate::{LserveError, Result};

/// One embedded PTX module of the library's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelPtx {
    /// The architecture it was built for (`sm_80`, `sm_90`).
    pub arch: &'static str,
    /// The oldest compute capability it runs on (major, minor).
    pub min_capability: (u32, u32),
    /// The PTX text, deflated.
    deflated: &'static [u8],
}

impl KernelPtx {
    /// Whether this module uses Hopper's instructions (tensor-map bulk copies and programmatic
    /// dependent launch: its step kernels may be launched overlapped).
    pub fn is_hopper(&self) -> bool {
        self.min_capability.0 >= 9
    }

    /// The PTX text (inflated from the embedded bytes on each call).
    ///
    /// ```
    /// let text = lserve::gpu::KERNEL_PTX[1].text();
    /// assert!(text.contains(".target sm_90"));
    /// ```
    ///
    /// # Panics
    /// Only if the embedded bytes are not the deflated PTX `build.rs` wrote: a broken build.
    pub fn text(&self) -> String {
        inflate(self.deflated)
    }

    /// The names of the kernels in this module (its `.entry` symbols), in PTX order.
    ///
    /// ```
    /// let names = lserve::gpu::KERNEL_PTX[0].kernel_names();
    /// assert!(names.iter().any(|n| n == "decode_combine_bf16"));
    /// ```
    pub fn kernel_names(&self) -> Vec<String> {
        entry_names(&self.text())
            .into_iter()
            .map(str::to_string)
            .collect()
    }
}

/// The text of deflated PTX embedded by `build.rs`.
fn inflate(deflated: &[u8]) -> String {
    let bytes = miniz_oxide::inflate::decompress_to_vec(deflated)
        .expect("lserve's embedded PTX is the deflate stream build.rs wrote");
    String::from_utf8(bytes).expect("PTX is ASCII text")
}

/// The library's PTX modules, oldest architecture first.
pub const KERNEL_PTX: [KernelPtx; 2] = [
    KernelPtx {
        arch: "sm_80",
        min_capability: (8, 0),
        deflated: include_bytes!(concat!(
            env!("OUT_DIR"),
            "/lserve_kernels.sm_80.ptx.deflate"
        )),
    },
    KernelPtx {
        arch: "sm_90",
        min_capability: (9, 0),
        deflated: include_bytes!(concat!(
            env!("OUT_DIR"),
            "/lserve_kernels.sm_90.ptx.deflate"
        )),
    },
];

/// The device-primitive test kernels (built with the `test-kernels` feature; only tests load
/// them).
#[cfg(feature = "test-kernels")]
pub(crate) fn test_ptx() -> String {
    inflate(include_bytes!(concat!(
        env!("OUT_DIR"),
        "/lserve_test_kernels.sm_90.ptx.deflate"
    )))
}

/// The environment variable that makes a device load an older module than its newest one
/// (e.g. `sm_80` on a Hopper GPU, to test that module there).
pub const PTX_ARCH_VAR: &str = "LSERVE_PTX_ARCH";

/// The module a device of compute capability `capability` loads: the newest it runs, or the one
/// `requested` names (if the device runs it).
///
/// ```
/// use lserve::gpu::module_for;
/// assert_eq!(module_for((9, 0), None)?.arch, "sm_90");
/// assert_eq!(module_for((8, 9), None)?.arch, "sm_80");
/// assert_eq!(module_for((9, 0), Some("sm_80"))?.arch, "sm_80");
/// assert!(module_for((7, 5), None).is_err());
/// assert!(module_for((8, 6), Some("sm_90")).is_err());
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn module_for(capability: (u32, u32), requested: Option<&str>) -> Result<&'static KernelPtx> {
    let runs = |m: &&KernelPtx| m.min_capability <= capability;
    let chosen = match requested {
        None => KERNEL_PTX.iter().rev().find(runs),
        Some(arch) => {
            let m = KERNEL_PTX.iter().find(|m| m.arch == arch).ok_or_else(|| {
                LserveError::InvalidArgument {
                    what: PTX_ARCH_VAR,
                    reason: format!("{arch:?}: the PTX modules are sm_80 and sm_90"),
                }
            })?;
            Some(m).filter(runs)
        }
    };
    chosen.ok_or(LserveError::UnsupportedDevice {
        capability,
        requested: requested.map(str::to_string),
    })
}

/// The `.entry` symbols of a PTX text, in order.
pub(crate) fn entry_names(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|line| line.trim_start().strip_prefix(".visible .entry "))
        .map(|rest| rest.split('(').next().unwrap_or(rest).trim())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_modules_hold_the_same_kernels() {
        let [sm80, sm90] = KERNEL_PTX;
        assert!(sm80.text().contains(".target sm_80"));
        assert!(sm90.text().contains(".target sm_90"));
        assert_eq!(sm80.kernel_names(), sm90.kernel_names());
        assert!(!sm80.kernel_names().is_empty());
    }

    #[test]
    fn only_the_hopper_module_has_hopper_instructions() {
        let [sm80, sm90] = KERNEL_PTX;
        let (sm80_text, sm90_text) = (sm80.text(), sm90.text());
        for hopper in ["cp.async.bulk", "griddepcontrol", "mbarrier"] {
            assert!(!sm80_text.contains(hopper), "{hopper} in the sm_80 PTX");
            assert!(sm90_text.contains(hopper), "no {hopper} in the sm_90 PTX");
        }
        assert!(!sm80.is_hopper() && sm90.is_hopper());
    }

    #[test]
    fn no_test_kernel_in_the_library_modules() {
        for m in KERNEL_PTX {
            let tests: Vec<_> = m
                .kernel_names()
                .into_iter()
                .filter(|n| n.starts_with("test_"))
                .collect();
            assert!(tests.is_empty(), "{}: {tests:?}", m.arch);
        }
    }
}
