//! The embedded PTX modules and which one a device loads.
//!
//! lserve ships its kernels as PTX for sm_80 (Ampere and Ada: `cp.async` tiles, plain launches),
//! for sm_90 (Hopper: tensor-map bulk copies, launches overlapped with the previous kernel) and
//! for sm_90a (the sm_90 kernels plus those of Hopper's architecture-specific instructions:
//! the `wgmma` prefill; only compute capability 9.0 runs it), built from the same kernel
//! sources (`host/build.rs`). The driver compiles the chosen module for
//! the device when it loads. The PTX is ISA 8.0: a CUDA 12.0 or newer driver loads it. The modules
//! are embedded deflated (about a tenth of their text) and inflated when a context loads one.

use crate::{LserveError, Result};

/// One embedded PTX module of the library's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelPtx {
    /// The architecture it was built for (`sm_80`, `sm_90`, `sm_90a`).
    pub arch: &'static str,
    /// The oldest compute capability it runs on (major, minor).
    pub min_capability: (u32, u32),
    /// Whether it runs on `min_capability` only (an architecture-specific target such as
    /// `sm_90a`, whose instructions later architectures need not have).
    pub exact: bool,
    /// The PTX text, deflated.
    deflated: &'static [u8],
}

impl KernelPtx {
    /// Whether this module uses Hopper's instructions (tensor-map bulk copies and programmatic
    /// dependent launch: its step kernels may be launched overlapped).
    pub fn is_hopper(&self) -> bool {
        self.min_capability.0 >= 9
    }

    /// Whether this module has the `wgmma` prefill kernels (`prefill_wgmma_*`).
    pub fn has_wgmma(&self) -> bool {
        self.arch == "sm_90a"
    }

    /// Whether a device of compute capability `capability` runs this module.
    pub fn runs_on(&self, capability: (u32, u32)) -> bool {
        if self.exact {
            capability == self.min_capability
        } else {
            self.min_capability <= capability
        }
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
pub const KERNEL_PTX: [KernelPtx; 3] = [
    KernelPtx {
        arch: "sm_80",
        min_capability: (8, 0),
        exact: false,
        deflated: include_bytes!(concat!(
            env!("OUT_DIR"),
            "/lserve_kernels.sm_80.ptx.deflate"
        )),
    },
    KernelPtx {
        arch: "sm_90",
        min_capability: (9, 0),
        exact: false,
        deflated: include_bytes!(concat!(
            env!("OUT_DIR"),
            "/lserve_kernels.sm_90.ptx.deflate"
        )),
    },
    KernelPtx {
        arch: "sm_90a",
        min_capability: (9, 0),
        exact: true,
        deflated: include_bytes!(concat!(
            env!("OUT_DIR"),
            "/lserve_kernels.sm_90a.ptx.deflate"
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
/// assert_eq!(module_for((9, 0), None)?.arch, "sm_90a");
/// assert_eq!(module_for((10, 0), None)?.arch, "sm_90");
/// assert_eq!(module_for((8, 9), None)?.arch, "sm_80");
/// assert_eq!(module_for((9, 0), Some("sm_80"))?.arch, "sm_80");
/// assert_eq!(module_for((9, 0), Some("sm_90"))?.arch, "sm_90");
/// assert!(module_for((10, 0), Some("sm_90a")).is_err());
/// assert!(module_for((7, 5), None).is_err());
/// assert!(module_for((8, 6), Some("sm_90")).is_err());
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn module_for(capability: (u32, u32), requested: Option<&str>) -> Result<&'static KernelPtx> {
    let runs = |m: &&KernelPtx| m.runs_on(capability);
    let chosen = match requested {
        None => KERNEL_PTX.iter().rev().find(runs),
        Some(arch) => {
            let m = KERNEL_PTX.iter().find(|m| m.arch == arch).ok_or_else(|| {
                LserveError::InvalidArgument {
                    what: PTX_ARCH_VAR,
                    reason: format!("{arch:?}: the PTX modules are sm_80, sm_90 and sm_90a"),
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
    fn the_modules_hold_the_same_kernels_and_sm_90a_the_wgmma_prefill() {
        let [sm80, sm90, sm90a] = KERNEL_PTX;
        assert!(sm80.text().contains(".target sm_80"));
        assert!(sm90.text().contains(".target sm_90\n"));
        assert!(sm90a.text().contains(".target sm_90a"));
        assert_eq!(sm80.kernel_names(), sm90.kernel_names());
        assert!(!sm80.kernel_names().is_empty());
        let (wgmma, rest): (Vec<String>, Vec<String>) = sm90a
            .kernel_names()
            .into_iter()
            .partition(|n| n.starts_with("prefill_wgmma_"));
        assert_eq!(rest, sm90.kernel_names());
        assert_eq!(wgmma.len(), 12, "{wgmma:?}");
        assert!(sm90a.has_wgmma() && !sm90.has_wgmma() && !sm80.has_wgmma());
    }

    #[test]
    fn only_the_hopper_modules_have_hopper_instructions() {
        let [sm80, sm90, sm90a] = KERNEL_PTX;
        let (sm80_text, sm90_text, sm90a_text) = (sm80.text(), sm90.text(), sm90a.text());
        for hopper in ["cp.async.bulk", "griddepcontrol", "mbarrier"] {
            assert!(!sm80_text.contains(hopper), "{hopper} in the sm_80 PTX");
            assert!(sm90_text.contains(hopper), "no {hopper} in the sm_90 PTX");
            assert!(sm90a_text.contains(hopper), "no {hopper} in the sm_90a PTX");
        }
        assert!(!sm90_text.contains("wgmma") && sm90a_text.contains("wgmma.mma_async"));
        assert!(!sm80.is_hopper() && sm90.is_hopper() && sm90a.is_hopper());
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
