//! SmolLM2-135M-Instruct (GGUF Q4_1) on candle's CPU backend with every layer's attention
//! through lserve's CPU reference: dense, streaming heads, flat (Quest-like) page selection and
//! LServe's hierarchical selection with reuse.
//!
//! - [`model`]: the Llama forward in candle ops, stopping at attention;
//! - [`adapter`]: lserve's attention on candle `Tensor`s (the only module that talks to lserve's
//!   cache and reference);
//! - [`engine`]: prefill and decode of the model through the adapter, the configurations the
//!   fidelity report compares, the negative log-likelihood;
//! - [`eval`]: the fidelity report's teacher-forced evaluation of a setting over a text window
//!   (the `fidelity` binary and the smoke test on the model run it);
//! - [`tokenizer`]: the GPT2-style BPE tokenizer from the GGUF metadata;
//! - [`activations`]: real post-RoPE Q, K, V of a few layers over a long text (dense attention
//!   in candle ops), saved as safetensors for lserve's GPU tests (the `dump_activations` binary).
//!
//! The model comes from `scripts/fetch_smollm2.sh` ([`default_gguf_path`]).
#![warn(missing_docs)]

pub mod activations;
pub mod adapter;
pub mod engine;
pub mod eval;
pub mod model;
pub mod tokenizer;

use std::path::PathBuf;

/// The text the fidelity report evaluates by default: the GPL version 3, which Debian's
/// `base-files` package (essential: on every Debian system) installs here.
pub const DEFAULT_TEXT: &str = "/usr/share/common-licenses/GPL-3";

/// The GGUF's file name.
pub const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where `scripts/fetch_smollm2.sh` puts the GGUF: `$LSERVE_MODEL_DIR`, else
/// `$XDG_CACHE_HOME/lserve`, else `$HOME/.cache/lserve`.
pub fn default_gguf_path() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = env("LSERVE_MODEL_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("lserve")))
        .or_else(|| env("HOME").map(|h| h.join(".cache").join("lserve")))?;
    Some(dir.join(GGUF_NAME))
}
