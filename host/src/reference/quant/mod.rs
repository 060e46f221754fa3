//! The reference of the quantized KV formats ([`crate::quant`]): integer codes of K/V rows and the
//! 8-bit key statistics, with the rounding rules the quantized kernels follow.
//!
//! - [`codes`]: a row's groups quantized to codes with a bf16 scale and minimum each
//!   ([`quantize_rows`]), dequantized as the kernels do (`c · s + m`, one f32 `fma`), and the
//!   stored row layout ([`QuantizedRows::stored_row`], [`dequantize_stored_row`]);
//! - [`stats`]: a logical page's `kmin`/`kmax` as 8-bit codes that stay bounds
//!   ([`quantize_key_stats`]): the page score from them is never below the score from the exact
//!   statistics, so never below any of the page's keys' `q · k`.
//!
//! Attention over quantized rows is attention over their dequantized values
//! ([`QuantizedRows::dequantize`], then [`crate::reference::decode::attend_rows`]).
//!
//! ```
//! use lserve::quant::{CodeBits, IntFormat, QuantGroup};
//! use lserve::reference::quant::quantize_rows;
//! let row = [0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.5];
//! let q = quantize_rows(&row, 8, IntFormat::new(CodeBits::Int8, QuantGroup::TokenHead))?;
//! let back = q.dequantize();
//! // Every value within half a step of where it was.
//! let step = q.params(0, 0).scale();
//! assert!(row.iter().zip(&back).all(|(x, y)| (x - y).abs() <= step / 2.0 + 1e-6));
//! # Ok::<(), lserve::LserveError>(())
//! ```

pub mod codes;
mod round;
pub mod stats;

pub use codes::{dequantize_stored_row, quantize_rows, GroupParams, QuantizedRows};
pub use stats::{quantize_key_stats, QuantKeyStats};
