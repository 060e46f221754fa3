//! Writing the KV cache: the decode append, prefill's row writes, key-statistics pooling, and a
//! random fill for benchmarks.
//!
//! Every kernel here is a flat range of *chunks* (8 elements, 16 bytes: one thread's vector load
//! and store) cut into blocks of [`KV_WRITE_THREADS`]. A chunk of an activation row `[Hkv][D]`
//! belongs to one KV head; [`target::RowTarget`] says where that head keeps the token — a row of
//! a physical page for a dense head, a sink or ring row for a streaming head, or nowhere (a
//! streaming head no longer holds the position) — so the kernels never branch on the head kind
//! themselves.
//!
//! - [`append`]: one new token per sequence of a decode batch (`append_kv_*`), with the newest
//!   logical page's `kmin`/`kmax` updated in place.
//! - [`rows`]: the tokens of a ragged batch (`write_kv_rows_*`), as prefill produces them.
//! - [`pool`]: `kmin`/`kmax` recomputed for every logical page a token range touches
//!   (`pool_key_stats_*`).
//! - [`stat_codes`]: the 8-bit copy of a logical page's `kmin`/`kmax` that the selector reads,
//!   where the cache keeps one, written wherever `kmin`/`kmax` are (append and pooling).
//! - [`gather`]: a sequence's cached positions and its new chunk as contiguous rows
//!   (`gather_kv_rows_*`), for chunked prefill's attention.
//! - [`fill`]: deterministic pseudo-random values (`fill_random_*`).
//! - [`coded`]: the same append, row write and gather for an integer-coded cache
//!   (`append_kv_int{8,4}_*`, `write_kv_rows_int{8,4}_*`: each row quantized by [`quantize`] as
//!   it is stored; `gather_kv_rows_int{8,4}_*`: the cached rows dequantized), and the
//!   statistics of the pages a prefill writes pooled from its activation rows
//!   (`pool_key_stats_rows_*`), since such a cache keeps no 16-bit keys.
//!
//! [`KV_WRITE_THREADS`]: lserve_abi::kv_write::KV_WRITE_THREADS

pub mod append;
pub mod coded;
pub mod fill;
pub mod gather;
pub mod pool;
pub mod quantize;
pub mod rows;
pub mod stat_codes;
pub mod stats;
pub mod target;

use lserve_abi::kv_write::{
    AppendArgs, CodedAppendArgs, CodedGatherArgs, CodedWriteRowsArgs, FillArgs, GatherArgs,
    PoolArgs, PoolRowsArgs, WriteRowsArgs,
};

use self::coded::Codes;
use self::target::Elements;
use crate::convert::{Bf16, F16};

/// Declares the `extern "gpu-kernel"` entry points of one element type.
macro_rules! kv_write_kernels {
    ($elem:ty, $append:ident, $rows:ident, $gather:ident, $pool:ident, $fill:ident) => {
        /// Appends one decode token per sequence (see [`append`]).
        ///
        /// # Safety
        /// As [`append::append_kv`]: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $append(a: AppendArgs) {
            // SAFETY: forwarded launch contract (the body waits for the kernel before).
            unsafe { append::append_kv::<$elem, _>(&a, Elements) }
        }

        /// Writes the tokens of a ragged batch into the cache (see [`rows`]).
        ///
        /// # Safety
        /// As [`rows::write_kv_rows`]: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $rows(a: WriteRowsArgs) {
            // SAFETY: forwarded launch contract.
            unsafe { rows::write_kv_rows(&a, Elements) }
        }

        /// Gathers cached positions and a new chunk into contiguous rows (see [`gather`]).
        ///
        /// # Safety
        /// As [`gather::gather_kv_rows`]: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $gather(a: GatherArgs) {
            // SAFETY: forwarded launch contract.
            unsafe { gather::gather_kv_rows(&a, Elements) }
        }

        /// Pools `kmin`/`kmax` over token ranges (see [`pool`]).
        ///
        /// # Safety
        /// As [`pool::pool_key_stats`]: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $pool(a: PoolArgs) {
            // SAFETY: forwarded launch contract.
            unsafe { pool::pool_key_stats::<$elem>(&a) }
        }

        /// Fills a buffer with pseudo-random values (see [`fill`]).
        ///
        /// # Safety
        /// As [`fill::fill_random`]: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $fill(a: FillArgs) {
            // SAFETY: forwarded launch contract.
            unsafe { fill::fill_random::<$elem>(&a) }
        }
    };
}

kv_write_kernels!(
    Bf16,
    append_kv_bf16,
    write_kv_rows_bf16,
    gather_kv_rows_bf16,
    pool_key_stats_bf16,
    fill_random_bf16
);
kv_write_kernels!(
    F16,
    append_kv_f16,
    write_kv_rows_f16,
    gather_kv_rows_f16,
    pool_key_stats_f16,
    fill_random_f16
);

/// Declares the entry points of an integer-coded cache for one element type of the activations.
macro_rules! coded_kv_write_kernels {
    ($elem:ty, [$append:ident, $rows:ident, $gather:ident], [$append4:ident, $rows4:ident, $gather4:ident], $pool:ident) => {
        coded_kv_write_kernels!(@codes $elem, 8, $append, $rows, $gather);
        coded_kv_write_kernels!(@codes $elem, 4, $append4, $rows4, $gather4);

        /// Pools `kmin`/`kmax` from activation rows (see [`coded::pool_key_stats_rows`]).
        ///
        /// # Safety
        /// As [`coded::pool_key_stats_rows`]: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $pool(a: PoolRowsArgs) {
            // SAFETY: forwarded launch contract.
            unsafe { coded::pool_key_stats_rows::<$elem>(&a) }
        }
    };
    (@codes $elem:ty, $bits:literal, $append:ident, $rows:ident, $gather:ident) => {
        /// Appends one decode token per sequence to a coded cache (see [`append`] and
        /// [`coded::Codes`]).
        ///
        /// # Safety
        /// As [`append::append_kv`], and `a.codes` holds the coded layout of the same cache:
        /// launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $append(a: CodedAppendArgs) {
            // SAFETY: forwarded launch contract.
            unsafe {
                append::append_kv::<$elem, _>(&a.append, Codes::<$elem, $bits>::new(a.codes))
            }
        }

        /// Writes the tokens of a ragged batch into a coded cache (see [`rows`] and
        /// [`coded::Codes`]).
        ///
        /// # Safety
        /// As [`rows::write_kv_rows`], and `a.codes` holds the coded layout of the same cache:
        /// launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $rows(a: CodedWriteRowsArgs) {
            // SAFETY: forwarded launch contract.
            unsafe { rows::write_kv_rows(&a.rows, Codes::<$elem, $bits>::new(a.codes)) }
        }

        /// Gathers a coded cache's positions (dequantized) and a new chunk into contiguous rows
        /// (see [`gather`] and [`coded::Codes`]).
        ///
        /// # Safety
        /// As [`gather::gather_kv_rows`], and `a.codes` holds the coded layout of the same
        /// cache: launched by `lserve`'s host launcher only.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $gather(a: CodedGatherArgs) {
            // SAFETY: forwarded launch contract.
            unsafe { gather::gather_kv_rows(&a.gather, Codes::<$elem, $bits>::new(a.codes)) }
        }
    };
}

coded_kv_write_kernels!(
    Bf16,
    [
        append_kv_int8_bf16,
        write_kv_rows_int8_bf16,
        gather_kv_rows_int8_bf16
    ],
    [
        append_kv_int4_bf16,
        write_kv_rows_int4_bf16,
        gather_kv_rows_int4_bf16
    ],
    pool_key_stats_rows_bf16
);
coded_kv_write_kernels!(
    F16,
    [
        append_kv_int8_f16,
        write_kv_rows_int8_f16,
        gather_kv_rows_int8_f16
    ],
    [
        append_kv_int4_f16,
        write_kv_rows_int4_f16,
        gather_kv_rows_int4_f16
    ],
    pool_key_stats_rows_f16
);
