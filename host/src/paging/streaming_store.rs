//! The streaming heads' store: one slot per live sequence holding its sinks and local ring.

use core::iter::Chain;
use core::num::NonZeroUsize;
use core::ops::Range;

use lserve_abi::StreamingLayout;

use crate::error::{LserveError, Result};

/// Slot allocation and the sink + ring row rule of the streaming store.
///
/// A slot is a sequence's row in every per-sequence device table (streaming store, block
/// tables, index tables). Token `t` of a sequence lives at row `t` if `t < sink_tokens`, else at
/// `sink_tokens + (t - sink_tokens) % local_tokens` (`lserve_abi::StreamingLayout`). At length
/// `len` the store holds the positions `0..min(sink, len)` and `max(sink, len - local)..len`.
///
/// ```
/// use lserve::paging::StreamingStore;
/// let mut store = StreamingStore::new(2, 4, 8)?;
/// assert_eq!(store.acquire()?, 0);
/// assert_eq!(store.acquire()?, 1);
/// assert!(store.acquire().is_err()); // both slots in use
/// store.release(0)?;
/// assert_eq!(store.row_of_token(13), 4 + (13 - 4) % 8);
/// let kept: Vec<usize> = StreamingStore::resident_positions(20, 4, 8).collect();
/// assert_eq!(kept, [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19]);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamingStore {
    sink_tokens: usize,
    local_tokens: NonZeroUsize,
    in_use: Vec<bool>,
}

impl StreamingStore {
    /// A store of `slots` free slots (> 0, fitting `u32`) with the given sink and ring sizes
    /// (`local_tokens > 0`, `sink + local` fitting `u32`); `InvalidConfig` otherwise.
    ///
    /// ```
    /// use lserve::paging::StreamingStore;
    /// assert!(StreamingStore::new(1, 4, 0).is_err()); // no ring
    /// assert!(StreamingStore::new(1, usize::MAX, 1).is_err()); // rows overflow
    /// ```
    pub fn new(slots: usize, sink_tokens: usize, local_tokens: usize) -> Result<Self> {
        let local_tokens = Self::check(slots, sink_tokens, local_tokens)?;
        Ok(Self {
            sink_tokens,
            local_tokens,
            in_use: vec![false; slots],
        })
    }

    /// The rules of [`new`](Self::new), checked without allocating: the ring size.
    pub(crate) fn check(
        slots: usize,
        sink_tokens: usize,
        local_tokens: usize,
    ) -> Result<NonZeroUsize> {
        if slots == 0 || u32::try_from(slots).is_err() {
            return Err(LserveError::InvalidConfig {
                field: "max_sequences",
                reason: format!("{slots} is not in 1..=u32::MAX"),
            });
        }
        let rows = sink_tokens.checked_add(local_tokens).map(u32::try_from);
        let local = NonZeroUsize::new(local_tokens).filter(|_| matches!(rows, Some(Ok(_))));
        local.ok_or_else(|| LserveError::InvalidConfig {
            field: "local_tokens",
            reason: format!(
                "sink {sink_tokens} + local {local_tokens}: local must be > 0 and the sum fit u32"
            ),
        })
    }

    /// Slots in total.
    pub fn slots(&self) -> usize {
        self.in_use.len()
    }

    /// Slots in use.
    pub fn slots_in_use(&self) -> usize {
        self.in_use.iter().filter(|&&u| u).count()
    }

    /// Whether `slot` is in use (false out of range).
    pub fn is_in_use(&self, slot: u32) -> bool {
        self.in_use.get(slot as usize).copied().unwrap_or(false)
    }

    /// Takes the lowest free slot (`NoFreeSlot` if all are in use).
    pub fn acquire(&mut self) -> Result<u32> {
        let slot = self
            .in_use
            .iter()
            .position(|&u| !u)
            .ok_or(LserveError::NoFreeSlot {
                slots: self.slots(),
            })?;
        self.in_use[slot] = true;
        Ok(slot as u32)
    }

    /// Gives `slot` back (`InvalidArgument` if it is out of range or not in use).
    pub fn release(&mut self, slot: u32) -> Result<()> {
        if !self.is_in_use(slot) {
            return Err(LserveError::InvalidArgument {
                what: "slot",
                reason: format!("{slot} is not in use"),
            });
        }
        self.in_use[slot as usize] = false;
        Ok(())
    }

    /// Sink tokens kept per sequence.
    pub fn sink_tokens(&self) -> usize {
        self.sink_tokens
    }

    /// Ring size (most recent tokens kept).
    pub fn local_tokens(&self) -> usize {
        self.local_tokens.get()
    }

    /// Rows per (slot, head): `sink_tokens + local_tokens`.
    pub fn rows(&self) -> usize {
        self.sink_tokens + self.local_tokens()
    }

    /// The layout of one layer's store with `heads` streaming heads of dimension `head_dim`.
    pub fn layout(&self, heads: usize, head_dim: usize) -> StreamingLayout {
        StreamingLayout {
            slots: self.slots() as u32,
            heads: heads as u32,
            sink_tokens: self.sink_tokens as u32,
            local_tokens: self.local_tokens() as u32,
            head_dim: head_dim as u32,
        }
    }

    /// The row token position `t` is stored at.
    pub fn row_of_token(&self, t: usize) -> usize {
        Self::row_in(t, self.sink_tokens, self.local_tokens)
    }

    /// The row of token position `t` in a store of `sink_tokens` sinks and a ring of
    /// `local_tokens` rows: `t` for a sink, else its ring slot after the sinks (the kernels'
    /// `StreamingLayout::row_of_token`, in host sizes). `InvalidConfig` for an empty ring
    /// (`local_tokens == 0`).
    ///
    /// ```
    /// use lserve::paging::StreamingStore;
    /// assert_eq!(StreamingStore::ring_row(13, 4, 8)?, 4 + (13 - 4) % 8);
    /// assert!(StreamingStore::ring_row(13, 4, 0).is_err());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn ring_row(t: usize, sink_tokens: usize, local_tokens: usize) -> Result<usize> {
        let ring = NonZeroUsize::new(local_tokens).ok_or_else(|| LserveError::InvalidConfig {
            field: "local_tokens",
            reason: "must be > 0".into(),
        })?;
        Ok(Self::row_in(t, sink_tokens, ring))
    }

    /// [`ring_row`](Self::ring_row) for a ring known to be non-empty.
    pub(crate) fn row_in(t: usize, sink_tokens: usize, local_tokens: NonZeroUsize) -> usize {
        if t < sink_tokens {
            t
        } else {
            sink_tokens + (t - sink_tokens) % local_tokens
        }
    }

    /// Whether position `t` is held by a sequence of length `len`.
    pub fn is_resident(t: usize, len: usize, sink_tokens: usize, local_tokens: usize) -> bool {
        t < len && (t < sink_tokens || len - t <= local_tokens)
    }

    /// The positions held for a sequence of length `len`, ascending: the sinks, then the ring.
    pub fn resident_positions(
        len: usize,
        sink_tokens: usize,
        local_tokens: usize,
    ) -> Chain<Range<usize>, Range<usize>> {
        let sinks = 0..sink_tokens.min(len);
        let ring = sink_tokens.max(len.saturating_sub(local_tokens))..len;
        sinks.chain(ring)
    }
}
