//! A layer's 8-bit key statistics on the device (`lserve_abi::buffers::StatCodesPtrs`), kept
//! beside the 16-bit `kmin`/`kmax` where the configuration asks for them
//! ([`StatsFormat::Int8`]): the kernels that write `kmin`/`kmax` recode them, and the selector's
//! `score_pages_q8_*` reads only them.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use lserve_abi::buffers::{StatCodesPtrs, STAT_GROUP_CHANNELS};
use lserve_abi::ptr::{GlobalPtr, GlobalPtrMut};
use lserve_abi::PagedLayout;

use super::cache::upload;
use super::launch::Launch;
use crate::dtype::Element;
use crate::quant::{StatsFormat, StatsGroup};
use crate::reference::kv_write::KeyStats;
use crate::reference::quant::quantize_key_stats;
use crate::{LserveError, Result};

/// One layer's codes and words.
pub(crate) struct StatCodesLayer {
    codes: CudaSlice<u8>,
    words: CudaSlice<u32>,
}

/// `InvalidArgument` unless the device keeps statistics in `format`: 16-bit, or 8-bit per
/// [`STAT_GROUP_CHANNELS`] channels ([`StatsFormat::DEVICE_INT8`]).
pub(crate) fn check_device_stats(format: StatsFormat) -> Result<()> {
    match format {
        StatsFormat::Half => Ok(()),
        f if f == StatsFormat::DEVICE_INT8 => Ok(()),
        f => Err(LserveError::InvalidArgument {
            what: "stats format",
            reason: format!(
                "the device kernels keep 8-bit statistics per {STAT_GROUP_CHANNELS} channels \
                 ({:?}), not {f:?}",
                StatsFormat::DEVICE_INT8
            ),
        }),
    }
}

impl StatCodesLayer {
    /// The codes of zeroed statistics (all codes and words 0: `s = m = 0`, as the reference
    /// quantizes zeros).
    pub(crate) fn zeroed(stream: &Arc<CudaStream>, paged: &PagedLayout) -> Result<Self> {
        let n = paged.stats_elements();
        Ok(Self {
            codes: stream.alloc_zeros((2 * n).max(1))?,
            words: stream.alloc_zeros((n / STAT_GROUP_CHANNELS as usize).max(1))?,
        })
    }

    /// The codes of a layer's statistics `kmin`/`kmax` (`[rows][head_dim]` each), quantized by
    /// the reference.
    pub(crate) fn of<E: Element>(
        stream: &Arc<CudaStream>,
        head_dim: usize,
        kmin: &[E],
        kmax: &[E],
    ) -> Result<Self> {
        let f32s = |x: &[E]| x.iter().map(|v| v.to_f32()).collect::<Vec<_>>();
        let stats = KeyStats::new(head_dim, f32s(kmin), f32s(kmax))?;
        let q = quantize_key_stats(&stats, StatsGroup::Channels(STAT_GROUP_CHANNELS as usize))?;
        Ok(Self {
            codes: upload(stream, &q.device_codes())?,
            words: upload(stream, &q.words())?,
        })
    }

    /// The pointers for a kernel that only reads them (the scorer), registered as read.
    pub(crate) fn ptrs<'a>(&'a self, launch: &mut Launch<'a>) -> StatCodesPtrs {
        fn writable<T>(p: GlobalPtr<T>) -> GlobalPtrMut<T> {
            GlobalPtrMut::from_addr(p.addr())
        }
        StatCodesPtrs {
            codes: writable(launch.read(&self.codes)),
            words: writable(launch.read(&self.words)),
        }
    }

    /// The pointers for a kernel that writes them, registered as written.
    pub(crate) fn ptrs_mut<'a>(&'a mut self, launch: &mut Launch<'a>) -> StatCodesPtrs {
        StatCodesPtrs {
            codes: launch.write(&mut self.codes),
            words: launch.write(&mut self.words),
        }
    }

    /// The buffers, to fill for benchmarks.
    pub(crate) fn buffers_mut(&mut self) -> (&mut CudaSlice<u8>, &mut CudaSlice<u32>) {
        (&mut self.codes, &mut self.words)
    }

    /// Codes and words copied to the host (test-only reads).
    #[cfg(feature = "test-kernels")]
    pub(crate) fn download(&self, stream: &Arc<CudaStream>) -> Result<(Vec<u8>, Vec<u32>)> {
        Ok((
            stream.clone_dtoh(&self.codes)?,
            stream.clone_dtoh(&self.words)?,
        ))
    }
}
