//! The crate's error type: every misuse the host API can detect is one of these, and an
//! operation that returns one has changed nothing.

use thiserror::Error;

/// Result alias used across the crate.
pub type Result<T, E = LserveError> = core::result::Result<T, E>;

/// Everything that can go wrong in `lserve`, as typed variants.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LserveError {
    /// A configuration or geometry value is out of its valid range, or two values do not fit
    /// together (e.g. a token budget that is not a multiple of the physical page size).
    #[error("invalid {field}: {reason}")]
    InvalidConfig {
        /// The offending field, e.g. `"token_budget"`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A head-gating file could not be parsed or does not match the model geometry.
    #[error("head pattern: {0}")]
    HeadPattern(String),
    /// A buffer has the wrong number of elements for the shapes it was given with.
    #[error("shape mismatch for {what}: expected {expected} elements, got {actual}")]
    ShapeMismatch {
        /// Which argument.
        what: &'static str,
        /// Elements the shapes require.
        expected: usize,
        /// Elements passed.
        actual: usize,
    },
    /// An argument is invalid for another reason (message says which and why).
    #[error("invalid argument {what}: {reason}")]
    InvalidArgument {
        /// Which argument.
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A physical page id is not below the pool's capacity.
    #[error("page id {page} out of range (pool capacity {capacity})")]
    PageOutOfRange {
        /// The page id.
        page: u32,
        /// The pool's capacity.
        capacity: u32,
    },
    /// The page pool has fewer free pages than an operation needs.
    #[error("page pool exhausted: {needed} pages needed, {free} free")]
    PoolExhausted {
        /// Pages the operation needed.
        needed: usize,
        /// Pages that were free.
        free: usize,
    },
    /// Every sequence slot (streaming store, block tables) is in use.
    #[error("no free sequence slot (all {slots} in use)")]
    NoFreeSlot {
        /// Slots in total.
        slots: usize,
    },
    /// A sequence id that is not (or no longer) alive.
    #[error("unknown sequence id {0}")]
    UnknownSequence(u32),
    /// An operation that needs tokens was given a sequence or batch with none.
    #[error("empty {0}")]
    Empty(&'static str),
    /// A sequence would grow past the longest length the cache was sized for.
    #[error("sequence too long: {len} tokens, at most {max}")]
    SequenceTooLong {
        /// The length it would reach.
        len: usize,
        /// The most it may have.
        max: usize,
    },
    /// Reading a file failed.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The CUDA driver library (`libcuda`) could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda could not be loaded (is this a machine with an NVIDIA GPU?)")]
    NoCudaDriver,
    /// The GPU's compute capability runs none of lserve's PTX modules (sm_80 and newer), or not
    /// the one `LSERVE_PTX_ARCH` asked for.
    #[error("unsupported GPU: compute capability {}.{} runs {}", .capability.0, .capability.1, match .requested { Some(a) => format!("not the requested {a} PTX"), None => "none of lserve's PTX (sm_80 or newer)".to_string() })]
    UnsupportedDevice {
        /// The device's compute capability (major, minor).
        capability: (u32, u32),
        /// The module `LSERVE_PTX_ARCH` asked for, if any.
        requested: Option<String>,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A page id that the pool has not handed out (double free, or a page never allocated).
    #[error("page {page} is not allocated")]
    PageNotAllocated {
        /// The page id.
        page: u32,
    },
    /// A token position the cache does not hold: past the sequence's length, or a streaming
    /// head's token that has left the local ring.
    #[error("token {position} not stored (sequence length {len})")]
    TokenNotStored {
        /// The token position.
        position: usize,
        /// The sequence's length.
        len: usize,
    },
    /// A batch or plan was made against block tables the device cache no longer holds (or
    /// never held): another cache, another manager, or rows the manager changed since. Checked
    /// before anything is enqueued.
    #[error("stale {what}: {reason}")]
    StaleTables {
        /// Which argument (`"batch"`, `"plan"`).
        what: &'static str,
        /// What it was made against, and what the cache holds.
        reason: String,
    },
    /// A table lists a page id that is a page of the pool but not one of the sequence whose
    /// table it is (another sequence's page, a free page, or any page in a slot no sequence
    /// holds): uploading it would let one sequence read another's pages.
    #[error("page {page} listed for slot {slot} is not a page of the sequence in that slot")]
    PageNotOwned {
        /// The page id.
        page: u32,
        /// The slot (block-table row) whose table lists it.
        slot: u32,
    },
    // New variants go above this line (helpers: append, do not reorder).
}

/// An [`LserveError::InvalidArgument`] for argument `what`, with `reason`.
pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> LserveError {
    LserveError::InvalidArgument {
        what,
        reason: reason.into(),
    }
}

/// The element count of a buffer of `T`s of shape `dims`, or `None` when the count or its size
/// in bytes overflows (past `isize::MAX` bytes, which no allocation holds): sizes are checked
/// before allocating, never wrapped and never an overflow panic.
pub(crate) fn checked_elements<T>(dims: &[usize]) -> Option<usize> {
    let n = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
    let bytes = n.checked_mul(core::mem::size_of::<T>())?;
    (bytes <= isize::MAX as usize).then_some(n)
}
