//! A test-only door to the device tables: overwrites words of a block table, an index table or
//! a held selection behind the host's back, as an engine bug or memory corruption would
//! (`tests/gpu_isolation.rs` checks what the kernels then read and write). Nothing here is
//! checked against the manager, and the cache's host mirror is not told: the next sync leaves
//! the overwritten words as they are unless their row changes. Also the read-back of a coded
//! layer ([`read_coded_layer`]), which the public API does not offer.

use super::{DeviceElement, DeviceKvCache, GpuContext};
use crate::{LserveError, Result};

/// Which device table [`overwrite_device_table`] writes, and its row-major index space.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceTable {
    /// `[slots][max_pages]` block tables (all layers).
    BlockTables,
    /// Layer `.0`'s `[slots][dense_heads][entry_capacity]` index-table pages.
    IndexPages(usize),
    /// Layer `.0`'s `[slots][dense_heads]` index-table lengths.
    IndexLens(usize),
    /// Layer `.0`'s `[slots][dense_heads][held_capacity]` held selections.
    HeldPages(usize),
    /// Layer `.0`'s `[slots][dense_heads]` held-selection lengths.
    HeldLens(usize),
}

/// Writes `words` into `table` from index `at` on (enqueued on the context's stream). A range
/// past the table is `InvalidArgument`, nothing written.
#[doc(hidden)]
pub fn overwrite_device_table<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    table: DeviceTable,
    at: usize,
    words: &[u32],
) -> Result<()> {
    let stream = gpu.stream().clone();
    let buffer = match table {
        DeviceTable::BlockTables => &mut cache.block_tables,
        DeviceTable::IndexPages(layer) => &mut cache.layer_mut(layer)?.index_pages,
        DeviceTable::IndexLens(layer) => &mut cache.layer_mut(layer)?.index_lens,
        DeviceTable::HeldPages(layer) => &mut cache.layer_mut(layer)?.held_pages,
        DeviceTable::HeldLens(layer) => &mut cache.layer_mut(layer)?.held_lens,
    };
    let end = at.checked_add(words.len()).filter(|&e| e <= buffer.len());
    let Some(end) = end else {
        return Err(LserveError::InvalidArgument {
            what: "table range",
            reason: format!(
                "{at}.. + {} words past {table:?}'s {}",
                words.len(),
                buffer.len()
            ),
        });
    };
    stream.memcpy_htod(words, &mut buffer.slice_mut(at..end))?;
    Ok(())
}

/// What one layer of an integer-coded cache holds on the device, read back for tests (a coded
/// cache has no [`DeviceKvCache::download`]): the codes and row words as
/// `lserve_abi::buffers::CodedKvPtrs` lays them out, and the key statistics.
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodedLayerContents<E> {
    /// Dense pool K codes, V codes, K row words, V row words.
    pub pool: (Vec<u8>, Vec<u8>, Vec<u32>, Vec<u32>),
    /// The streaming store's, as `pool`.
    pub stream: (Vec<u8>, Vec<u8>, Vec<u32>, Vec<u32>),
    /// `kmin`, `kmax` of the dense pool.
    pub stats: (Vec<E>, Vec<E>),
}

/// Reads layer `layer` of a coded cache back (synchronizes the context's stream).
/// `InvalidArgument` for a 16-bit cache or a bad layer.
#[doc(hidden)]
pub fn read_coded_layer<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &DeviceKvCache<E>,
    layer: usize,
) -> Result<CodedLayerContents<E>> {
    let l = cache.layer(layer)?;
    let Some(c) = &l.codes else {
        return Err(LserveError::InvalidArgument {
            what: "cache",
            reason: "not an integer-coded cache".into(),
        });
    };
    let s = gpu.stream();
    let (pool, stream) = c.download(s)?;
    Ok(CodedLayerContents {
        pool,
        stream,
        stats: (s.clone_dtoh(&l.kmin)?, s.clone_dtoh(&l.kmax)?),
    })
}

/// One layer's key statistics as the device holds them, read back for tests: the 16-bit
/// `kmin`/`kmax` and their 8-bit codes and words (`lserve_abi::buffers::StatCodesPtrs`).
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatCodesContents<E> {
    /// `kmin`, `kmax` of the dense pool.
    pub stats: (Vec<E>, Vec<E>),
    /// The 8-bit codes (per logical page and chunk of 8 channels: 8 `kmin`, then 8 `kmax`).
    pub codes: Vec<u8>,
    /// The `(s, m)` words, one per 32 channels.
    pub words: Vec<u32>,
}

/// Reads the statistics of layer `layer` back (synchronizes the context's stream).
/// `InvalidArgument` for a cache without 8-bit statistics or a bad layer.
#[doc(hidden)]
pub fn read_stat_codes<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &DeviceKvCache<E>,
    layer: usize,
) -> Result<StatCodesContents<E>> {
    let l = cache.layer(layer)?;
    let Some(c) = &l.stat_codes else {
        return Err(LserveError::InvalidArgument {
            what: "cache",
            reason: "keeps no 8-bit statistics".into(),
        });
    };
    let s = gpu.stream();
    let (codes, words) = c.download(s)?;
    Ok(StatCodesContents {
        stats: (s.clone_dtoh(&l.kmin)?, s.clone_dtoh(&l.kmax)?),
        codes,
        words,
    })
}
