//! The tokenizer from the GGUF metadata (GPT2-style byte-level BPE: vocabulary and merges), built
//! by candle's `TokenizerFromGguf` on the `tokenizers` crate.

use anyhow::{anyhow, Result};
use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::Tokenizer;

/// The model's tokenizer.
pub fn from_gguf(content: &gguf_file::Content) -> Result<Tokenizer> {
    Ok(Tokenizer::from_gguf(content)?)
}

/// The token ids of `text`, without special tokens.
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = tokenizer
        .encode(text, false)
        .map_err(|e| anyhow!("tokenizing: {e}"))?;
    Ok(enc.get_ids().to_vec())
}
