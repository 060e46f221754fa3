//! Query-aware page selection on the device (`docs/ARCHITECTURE.md` "Page selection" and
//! "Reuse"), in two launches per layer and step:
//!
//! - [`score`]: for each (sequence, dense KV head) pair whose selection is due, the score of
//!   every physical page: logical-page bounds `Σ_i max(q_h[i]·kmax[i], q_h[i]·kmin[i])` for each
//!   query head of the group, aggregated over the group (max or mean), max over the physical
//!   page's logical pages. Reads only the key statistics, spread over many blocks.
//! - [`top_k`]: for each due pair, the exact top-K candidates (ties to the lower page) become
//!   the held selection, and the index-table entry is the held selection plus the newest page,
//!   in physical ids. Between selections the decode append keeps the entry (it adds each new
//!   page after the held selection), so a step on which no pair is due launches neither kernel.
//!
//! [`steps`] advances the per-sequence decode step counters once per model step; the counters
//! and the held selections live on the device, so no step waits for the host.
//! How it works, its floor and the measurements behind it: `DESIGN.md` beside this file.

pub mod scan;
pub mod score;
pub mod steps;
pub mod top_k;

use lserve_abi::select::{SelectArgs, StepArgs};

/// Declares the scorer entry points of one (element type, head dimension), both statistics
/// formats: `score_pages_{dtype}_d{D}` (16-bit) and `score_pages_q8_{dtype}_d{D}` (8-bit codes).
macro_rules! scorers {
    ($module:ident, $elem:path, $dtype:literal, $d:literal) => {
        /// The scorers of one element type and head dimension.
        pub mod $module {
            /// Page scorer over 16-bit statistics (see [`score`](crate::select::score)).
            ///
            /// # Safety
            /// As `score::score_pages`'s: launched by `lserve`'s host launcher only.
            #[unsafe(export_name = concat!("score_pages_", $dtype, "_d", $d))]
            pub unsafe extern "gpu-kernel" fn score(a: lserve_abi::select::ScoreArgs) {
                // SAFETY: first thing in the kernel; the host launches it overlapped.
                unsafe { $crate::sync::overlapped_entry() };
                // SAFETY: forwarded launch contract.
                unsafe {
                    $crate::select::score::score_pages::<
                        $elem,
                        $crate::select::score::HalfStats<$elem>,
                        $d,
                    >(&a)
                }
            }

            /// Page scorer over 8-bit statistics (see [`score`](crate::select::score)).
            ///
            /// # Safety
            /// As `score::score_pages`'s, with `a.stat_codes` the layer's codes: launched by
            /// `lserve`'s host launcher only.
            #[unsafe(export_name = concat!("score_pages_q8_", $dtype, "_d", $d))]
            pub unsafe extern "gpu-kernel" fn score_q8(a: lserve_abi::select::ScoreArgs) {
                // SAFETY: first thing in the kernel; the host launches it overlapped.
                unsafe { $crate::sync::overlapped_entry() };
                // SAFETY: forwarded launch contract.
                unsafe {
                    $crate::select::score::score_pages::<
                        $elem,
                        $crate::select::score::CodedStats,
                        $d,
                    >(&a)
                }
            }
        }
    };
}

scorers!(bf16_d64, crate::convert::Bf16, "bf16", 64);
scorers!(bf16_d128, crate::convert::Bf16, "bf16", 128);
scorers!(f16_d64, crate::convert::F16, "f16", 64);
scorers!(f16_d128, crate::convert::F16, "f16", 128);

/// Top-K selection and index tables entry point (see [`top_k`]): physical pages.
///
/// # Safety
/// As [`top_k::select_pages`]'s: launched by `lserve`'s host launcher only.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn select_pages(a: SelectArgs) {
    // Overlapped with the scorer: the body waits for it (`overlapped_entry`) after reading the
    // host-written batch description and block tables.
    // SAFETY: forwarded launch contract.
    unsafe { top_k::select_pages::<false>(&a) }
}

/// Top-K selection and index tables entry point (see [`top_k`]): logical pages
/// (`SelectionLayout::units_per_page > 1`).
///
/// # Safety
/// As [`top_k::select_pages`]'s: launched by `lserve`'s host launcher only.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn select_logical_pages(a: SelectArgs) {
    // As `select_pages`.
    // SAFETY: forwarded launch contract.
    unsafe { top_k::select_pages::<true>(&a) }
}

/// Decode step counters entry point (see [`steps`]).
///
/// # Safety
/// As [`steps::advance_decode_steps`]'s: launched by `lserve`'s host launcher only.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn advance_decode_steps(a: StepArgs) {
    // SAFETY: first thing in the kernel; the host launches it overlapped.
    unsafe { crate::sync::overlapped_entry() };
    // SAFETY: forwarded launch contract.
    unsafe { steps::advance_decode_steps(a.batch, a.seq_slot.get(), a.decode_steps.get()) }
}
