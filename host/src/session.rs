//! The engine's view: one [`SparseAttention`] per model (or per tensor-parallel shard) owns
//! everything lserve keeps between calls — the [`KvCacheManager`] (page pool, block tables,
//! step counters), the [`DeviceKvCache`] of every layer, the [`DecodeStep`] workspace and each
//! sequence's state — and serves many sequences at once: sequences are added, prefilled,
//! decoded in batches layer by layer and freed while others decode (continuous batching).
//!
//! The engine owns the model (weights, projections, RoPE, the MLP, sampling) and the schedule.
//! Per layer it hands the session that layer's Q, K and V **after RoPE** as device views
//! ([`Tokens`] / [`TokensMut`], or `&CudaSlice`) on the context's stream, and gets the
//! attention output in its buffer. Each phase has lserve's plan / run shape, with borrows that
//! make misuse a type error (a step holds the session: nothing can add, free or start another
//! step under it):
//!
//! ```no_run
//! use std::sync::Arc;
//! use half::bf16;
//! use lserve::config::SparsityConfig;
//! use lserve::geometry::ModelGeometry;
//! use lserve::gpu::GpuContext;
//! use lserve::head_pattern::HeadPattern;
//! use lserve::paging::KvCacheManager;
//! use lserve::session::SparseAttention;
//!
//! let gpu = Arc::new(GpuContext::new(0)?);
//! let g = ModelGeometry::llama3_8b();
//! let pattern = HeadPattern::interleaved(g, 0.5)?;
//! let mgr = KvCacheManager::new(g, pattern, SparsityConfig::default(), 4096, 8, 65536)?;
//! let mut session = SparseAttention::<bf16>::new(gpu.clone(), mgr, 8)?;
//! let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
//! let s = gpu.stream();
//!
//! // Prefill a 1000-token prompt: per layer the engine's q [T][Hq][D], k, v [T][Hkv][D].
//! let seq = session.add_sequence()?;
//! let t = 1000;
//! let (q, k, v) = (s.alloc_zeros::<bf16>(t * hq * d)?, s.alloc_zeros::<bf16>(t * hkv * d)?, s.alloc_zeros::<bf16>(t * hkv * d)?);
//! let mut out = s.alloc_zeros::<bf16>(t * hq * d)?;
//! let mut pf = session.prefill(&[(seq, t)])?;
//! for layer in 0..g.layers() {
//!     pf.layer(layer, &q, &k, &v, &mut out)?;
//! }
//! pf.finish()?;
//!
//! // Decode steps: per layer q [B][Hq][D], k, v [B][Hkv][D] of the batch's new tokens.
//! let (q, k, v) = (s.alloc_zeros::<bf16>(hq * d)?, s.alloc_zeros::<bf16>(hkv * d)?, s.alloc_zeros::<bf16>(hkv * d)?);
//! let mut out = s.alloc_zeros::<bf16>(hq * d)?;
//! for _ in 0..16 {
//!     let mut step = session.decode(&[seq])?;
//!     for layer in 0..g.layers() {
//!         step.layer(layer, &q, &k, &v, &mut out)?;
//!     }
//!     step.finish()?;
//! }
//! session.free_sequence(seq)?;
//! # Ok::<(), lserve::LserveError>(())
//! ```
//!
//! The host half ([`Sequences`]: the manager, each sequence's [`SequenceState`], the prefill
//! reservation) runs without a GPU; [`KvMemory`] sizes a cache from its manager.
//!
//! **Chunked prefill.** [`SparseAttention::prefill`] takes `(sequence, tokens)` chunks whatever
//! the sequence already holds. A batch of first chunks (no sequence holds a token yet) runs the
//! whole-prompt path ([`prefill_into_cache`]); a batch with a later chunk (a prompt in pieces, a
//! later turn of a conversation, a few verify tokens of speculative decoding) attends to the
//! cached prefix and to itself ([`prefill_chunks_into_cache`]), with the same results as one
//! prefill of the whole prompt. A later chunk needs the session's prefill scratch, sized once
//! by [`SparseAttention::with_prefill_chunks`].

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};

use crate::block_iter::BlockMask;
use crate::dtype::DType;
use crate::error::invalid;
use crate::gpu::{
    enqueue_advance, prefill_chunks_into_cache, prefill_into_cache, AppendLaunch, DecodeStep,
    DeviceElement, DeviceKvCache, DeviceKvWritePlan, GpuContext, KvWritePlan, PlannedStep,
    PrefillScratch, Tokens, TokensMut,
};
use crate::paging::{KvCacheManager, SeqId};
use crate::{LserveError, Result};

/// Where a sequence of a session stands.
///
/// ```
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
/// use lserve::session::{SequenceState, Sequences};
///
/// let g = ModelGeometry::new(1, 2, 2, 64)?;
/// let mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 16, 2, 1024)?;
/// let mut seqs = Sequences::new(mgr)?;
/// let a = seqs.add()?;
/// assert_eq!(seqs.state(a)?, SequenceState::Ready);
/// seqs.reserve_prefill(&[(a, 100)])?; // reserved, not yet written through every layer
/// assert_eq!(seqs.state(a)?, SequenceState::Incomplete);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SequenceState {
    /// Every token it holds is written through every layer: it can be prefilled further
    /// (its first chunk while empty) and decoded.
    Ready,
    /// It holds tokens that are reserved but not written through every layer: a prefill or a
    /// decode step is under way, or one was dropped (or failed) before its `finish`. Only
    /// [`free`](Sequences::free) applies to a sequence left so.
    Incomplete,
}

/// The host half of a [`SparseAttention`] session: the [`KvCacheManager`] and each live
/// sequence's [`SequenceState`]. It validates what the device half launches (without a GPU)
/// and reserves a prefill's tokens all or nothing.
///
/// ```
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
/// use lserve::session::Sequences;
/// use lserve::LserveError;
///
/// let g = ModelGeometry::new(1, 2, 2, 64)?;
/// let mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 4, 2, 1024)?;
/// let mut seqs = Sequences::new(mgr)?;
/// let (a, b) = (seqs.add()?, seqs.add()?);
/// // 3 + 2 pages of 64 tokens, 4 in the pool: nothing is reserved.
/// let before = seqs.manager().clone();
/// assert!(matches!(seqs.reserve_prefill(&[(a, 150), (b, 100)]), Err(LserveError::PoolExhausted { .. })));
/// assert_eq!(seqs.manager(), &before);
/// assert_eq!(seqs.reserve_prefill(&[(a, 150), (b, 50)])?, vec![(a, 0..150), (b, 0..50)]);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug)]
pub struct Sequences {
    manager: KvCacheManager,
    states: BTreeMap<SeqId, SequenceState>,
}

impl Sequences {
    /// The host half over `manager`, which must hold no sequence (a session's device cache
    /// starts empty: a sequence reserved before would hold tokens never written).
    ///
    /// Errors: `InvalidArgument` for a manager that holds sequences.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    /// use lserve::session::Sequences;
    ///
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 4, 2, 1024)?;
    /// mgr.add_sequence()?;
    /// assert!(Sequences::new(mgr).is_err());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn new(manager: KvCacheManager) -> Result<Self> {
        if manager.num_sequences() != 0 {
            return Err(invalid(
                "manager",
                format!(
                    "holds {} sequences: a session starts from a manager without any (their \
                     tokens were never written to its device cache)",
                    manager.num_sequences()
                ),
            ));
        }
        Ok(Self {
            manager,
            states: BTreeMap::new(),
        })
    }

    /// The manager (lengths, block tables, step counters, the pool's free pages).
    pub fn manager(&self) -> &KvCacheManager {
        &self.manager
    }

    /// Starts an empty sequence ([`KvCacheManager::add_sequence`]; `NoFreeSlot` when every slot
    /// is taken).
    pub fn add(&mut self) -> Result<SeqId> {
        let seq = self.manager.add_sequence()?;
        self.states.insert(seq, SequenceState::Ready);
        Ok(seq)
    }

    /// Ends `seq` whatever its state: its pages go back to the pool, its slot is free
    /// (`UnknownSequence` for an id that is not live; nothing changes then).
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        self.manager.free_sequence(seq)?;
        self.states.remove(&seq);
        Ok(())
    }

    /// The state of `seq` (`UnknownSequence` if it is not live).
    pub fn state(&self, seq: SeqId) -> Result<SequenceState> {
        self.states
            .get(&seq)
            .copied()
            .ok_or(LserveError::UnknownSequence(seq.get()))
    }

    /// Live sequences, ascending by id.
    pub fn live(&self) -> Vec<SeqId> {
        self.states.keys().copied().collect()
    }

    /// Checks that `seq` is live and [`Ready`](SequenceState::Ready).
    fn check_ready(&self, seq: SeqId) -> Result<()> {
        match self.state(seq)? {
            SequenceState::Ready => Ok(()),
            SequenceState::Incomplete => Err(invalid(
                "sequence",
                format!(
                    "sequence {} holds tokens not written through every layer (a prefill or \
                     decode step was dropped or failed before its finish): free it",
                    seq.get()
                ),
            )),
        }
    }

    /// Checks a decode batch before anything is reserved: not empty, distinct, live and
    /// [`Ready`](SequenceState::Ready) sequences (the batch size and the reservation are the
    /// decode step's checks). Errors: `Empty`, `InvalidArgument` (a sequence twice, or one
    /// [`Incomplete`](SequenceState::Incomplete)), `UnknownSequence`.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    /// use lserve::session::Sequences;
    ///
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// let mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 4, 2, 1024)?;
    /// let mut seqs = Sequences::new(mgr)?;
    /// let a = seqs.add()?;
    /// seqs.check_decode(&[a])?;
    /// assert!(seqs.check_decode(&[a, a]).is_err());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn check_decode(&self, seqs: &[SeqId]) -> Result<()> {
        if seqs.is_empty() {
            return Err(LserveError::Empty("batch"));
        }
        for (i, &seq) in seqs.iter().enumerate() {
            if seqs[..i].contains(&seq) {
                return Err(invalid("batch", format!("sequence {} twice", seq.get())));
            }
            self.check_ready(seq)?;
        }
        Ok(())
    }

    /// Reserves a prefill's tokens, all or nothing: `n` tokens for each `(seq, n)`, in this
    /// order, after the tokens the sequence already holds (a first chunk starts at 0, a later
    /// chunk at the sequence's length), and returns each chunk's positions. The sequences become
    /// [`Incomplete`](SequenceState::Incomplete) until the prefill that writes them finishes.
    ///
    /// Errors (nothing reserved, every state unchanged): `Empty` for no chunk or a chunk of 0
    /// tokens; `UnknownSequence`; `InvalidArgument` for a sequence listed twice, one
    /// [`Incomplete`](SequenceState::Incomplete), or more chunks or tokens than one launch
    /// covers (65535 chunks, 2^31 - 1 tokens); `SequenceTooLong`; `PoolExhausted` when the pool
    /// lacks the pages all chunks need together.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    /// use lserve::session::Sequences;
    ///
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// let mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 16, 2, 1024)?;
    /// let mut seqs = Sequences::new(mgr)?;
    /// let a = seqs.add()?;
    /// assert_eq!(seqs.reserve_prefill(&[(a, 100)])?, vec![(a, 0..100)]);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn reserve_prefill(
        &mut self,
        chunks: &[(SeqId, usize)],
    ) -> Result<Vec<(SeqId, Range<usize>)>> {
        self.check_prefill(chunks)?;
        self.reserve_checked(chunks)
    }

    /// Reserves `chunks` that passed [`check_prefill`](Self::check_prefill) (live, short
    /// enough, pages free): no reservation fails.
    fn reserve_checked(&mut self, chunks: &[(SeqId, usize)]) -> Result<Vec<(SeqId, Range<usize>)>> {
        let mut ranges = Vec::with_capacity(chunks.len());
        for &(seq, n) in chunks {
            ranges.push((seq, self.manager.reserve(seq, n)?));
            self.states.insert(seq, SequenceState::Incomplete);
        }
        Ok(ranges)
    }

    /// Every check of [`reserve_prefill`](Self::reserve_prefill), reserving nothing; returns
    /// the chunks' sequences' lengths after them, and whether a chunk has a cached prefix (it
    /// starts past 0).
    fn check_prefill(&self, chunks: &[(SeqId, usize)]) -> Result<PrefillExtent> {
        if chunks.is_empty() {
            return Err(LserveError::Empty("prefill chunks"));
        }
        const MAX_CHUNKS: usize = 65_535;
        const MAX_ROWS: usize = (1 << 31) - 1;
        if chunks.len() > MAX_CHUNKS {
            return Err(invalid(
                "prefill chunks",
                format!(
                    "{} chunks, at most {MAX_CHUNKS} in one prefill",
                    chunks.len()
                ),
            ));
        }
        let config = *self.manager.config();
        let (mut rows, mut pages) = (0usize, 0usize);
        let mut extent = PrefillExtent {
            lengths: 0,
            prefixed: false,
        };
        for (i, &(seq, n)) in chunks.iter().enumerate() {
            if chunks[..i].iter().any(|&(s, _)| s == seq) {
                return Err(invalid(
                    "prefill chunks",
                    format!("sequence {} listed twice", seq.get()),
                ));
            }
            if n == 0 {
                return Err(LserveError::Empty("prefill chunk (0 tokens)"));
            }
            let start = self.manager.len(seq)?;
            self.check_ready(seq)?;
            let end = start
                .checked_add(n)
                .filter(|&end| end <= self.manager.max_seq_len())
                .ok_or(LserveError::SequenceTooLong {
                    len: start.saturating_add(n),
                    max: self.manager.max_seq_len(),
                })?;
            rows = rows.saturating_add(n);
            extent.lengths = extent.lengths.saturating_add(end);
            extent.prefixed |= start > 0;
            let held = self.manager.block_table(seq)?.len();
            pages = pages.saturating_add(config.pages_for_len(end) - held);
        }
        if rows > MAX_ROWS {
            return Err(invalid(
                "prefill chunks",
                format!("{rows} tokens, at most {MAX_ROWS} in one prefill"),
            ));
        }
        let free = self.manager.pool().free_pages();
        if pages > free {
            return Err(LserveError::PoolExhausted {
                needed: pages,
                free,
            });
        }
        Ok(extent)
    }

    /// Marks `seqs` [`Ready`](SequenceState::Ready) (a prefill or step that wrote them finished).
    fn mark(states: &mut BTreeMap<SeqId, SequenceState>, seqs: &[SeqId], state: SequenceState) {
        for &seq in seqs {
            if let Some(s) = states.get_mut(&seq) {
                *s = state;
            }
        }
    }
}

/// What a prefill's chunks cover ([`Sequences::check_prefill`]).
#[derive(Clone, Copy, Debug)]
struct PrefillExtent {
    /// The chunks' sequences' lengths after them, summed: the rows a chunked launch gathers.
    lengths: usize,
    /// A chunk starts past 0 (its sequence holds tokens): the launch attends to a cached prefix.
    prefixed: bool,
}

/// Bytes of a cache's K/V and key statistics (all layers), as its manager sizes it: what the
/// device cache allocates for them, and what the live sequences use now (the pool's pages in
/// use, the streaming slots in use). Index tables, held selections and workspaces are not
/// counted (a few MiB at most).
///
/// ```
/// use lserve::config::SparsityConfig;
/// use lserve::dtype::DType;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
/// use lserve::session::KvMemory;
///
/// let g = ModelGeometry::new(1, 2, 2, 64)?;
/// let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 4, 2, 1024)?;
/// let seq = mgr.add_sequence()?;
/// mgr.reserve(seq, 100)?; // 2 of 4 pages
/// let m = KvMemory::of(&mgr, DType::BF16);
/// // A page: 2 heads x 64 tokens x 64 channels of K and V, plus 4 logical pages' kmin, kmax.
/// assert_eq!(m.dense_page_bytes, 2 * (64 * 64 * 2 + 4 * 64 * 2) * 2);
/// assert_eq!(m.used_bytes, 2 * m.dense_page_bytes);
/// assert_eq!(m.allocated_bytes, 4 * m.dense_page_bytes);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvMemory {
    /// Bytes of one physical page over all layers (K, V and the key statistics of the
    /// layers' dense heads).
    pub dense_page_bytes: u64,
    /// Bytes of one streaming slot over all layers (K and V of the sinks and the ring of the
    /// layers' streaming heads).
    pub streaming_slot_bytes: u64,
    /// What the cache allocates: every page of the pool and every slot.
    pub allocated_bytes: u64,
    /// What the live sequences use: the pages they hold and their slots.
    pub used_bytes: u64,
}

impl KvMemory {
    /// The sizes of `manager`'s cache with elements of `dtype`.
    pub fn of(manager: &KvCacheManager, dtype: DType) -> Self {
        let g = manager.geometry();
        let c = manager.config();
        let pattern = manager.pattern();
        let (d, e) = (g.head_dim() as u64, dtype.size_bytes() as u64);
        let logical = (c.page_tokens / c.logical_page_tokens) as u64;
        let (mut page, mut slot) = (0u64, 0u64);
        for layer in 0..g.layers() {
            let (hd, hs) = (
                pattern.dense_heads(layer) as u64,
                pattern.streaming_heads(layer) as u64,
            );
            page += hd * (c.page_tokens as u64 + logical) * d * 2 * e;
            slot += hs * c.streaming_rows() as u64 * d * 2 * e;
        }
        let pool = manager.pool();
        let (capacity, free) = (pool.capacity() as u64, pool.free_pages() as u64);
        let (slots, live) = (
            manager.max_sequences() as u64,
            manager.num_sequences() as u64,
        );
        Self {
            dense_page_bytes: page,
            streaming_slot_bytes: slot,
            allocated_bytes: capacity * page + slots * slot,
            used_bytes: (capacity - free) * page + live * slot,
        }
    }
}

/// Hands out session identities (captured graphs record theirs).
static NEXT_SESSION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// LServe's sparse attention for one model (or one tensor-parallel shard: build its manager
/// from [`ModelGeometry::shard`](crate::geometry::ModelGeometry::shard) and
/// [`HeadPattern::shard`](crate::head_pattern::HeadPattern::shard)) on one device: the
/// [`KvCacheManager`], the [`DeviceKvCache`] of every layer, the decode workspace for batches
/// of up to `max_batch` sequences and each sequence's state. See the [module](self) for the
/// shape of a serving loop.
///
/// Every call checks its input before it changes anything: a bad input is a typed
/// [`LserveError`] and leaves the manager, the cache and the sequence states as they were.
/// A prefill or decode step that has reserved its tokens and is dropped (or fails) before its
/// `finish` leaves its sequences [`Incomplete`](SequenceState::Incomplete): they hold tokens
/// not written through every layer, and only [`free_sequence`](Self::free_sequence) applies.
///
/// ```no_run
/// use std::sync::Arc;
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::GpuContext;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
/// use lserve::session::SparseAttention;
///
/// let gpu = Arc::new(GpuContext::new(0)?);
/// let g = ModelGeometry::llama3_8b();
/// let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 8, 65536)?;
/// let session = SparseAttention::<bf16>::new(gpu, mgr, 8)?;
/// assert_eq!(session.max_batch(), 8);
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub struct SparseAttention<E> {
    id: u64,
    gpu: Arc<GpuContext>,
    sequences: Sequences,
    cache: DeviceKvCache<E>,
    step: DecodeStep,
    max_batch: usize,
    scratch: Option<PrefillScratch<E>>,
}

impl<E: DeviceElement> SparseAttention<E> {
    /// A session over `manager` (which must hold no sequence) on `gpu`: allocates the device
    /// cache of every layer (zeroed, [`DeviceKvCache::new`]) and the decode workspace for
    /// batches of up to `max_batch` sequences. Nothing is allocated after this.
    ///
    /// Errors: `InvalidArgument` for a manager that holds sequences; `Empty` for `max_batch
    /// == 0`; the errors of [`DeviceKvCache::new`] and [`DecodeStep::new`] (an unsupported
    /// page size, driver errors such as out of memory).
    pub fn new(gpu: Arc<GpuContext>, manager: KvCacheManager, max_batch: usize) -> Result<Self> {
        let sequences = Sequences::new(manager)?;
        if max_batch == 0 {
            return Err(LserveError::Empty("batch (max_batch 0)"));
        }
        let cache = DeviceKvCache::new(&gpu, &sequences.manager)?;
        let step = DecodeStep::new(&gpu, &cache, max_batch)?;
        Ok(Self {
            id: NEXT_SESSION.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            gpu,
            sequences,
            cache,
            step,
            max_batch,
            scratch: None,
        })
    }

    /// Lets prefills take later chunks (a prompt in pieces, a later turn, a few verify tokens):
    /// allocates the prefill scratch ([`PrefillScratch`], `2 · rows · Hkv · D` elements), into
    /// which a chunked launch gathers each sequence's cached prefix. A prefill batch with a later
    /// chunk is served when its sequences' lengths after their chunks sum to at most `rows`.
    ///
    /// Errors: those of [`PrefillScratch::new`] (`InvalidArgument` for `rows == 0` or a size
    /// that overflows; driver errors such as out of memory).
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::GpuContext;
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # use lserve::session::SparseAttention;
    /// # let gpu = Arc::new(GpuContext::new(0)?);
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 8, 65536)?;
    /// // Chunks of sequences of up to 64K tokens, one at a time (1 GiB of bf16 scratch).
    /// let session = SparseAttention::<bf16>::new(gpu, mgr, 8)?.with_prefill_chunks(65536)?;
    /// assert_eq!(session.prefill_chunk_rows(), 65536);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn with_prefill_chunks(mut self, rows: usize) -> Result<Self> {
        let geometry = *self.sequences.manager.geometry();
        self.scratch = Some(PrefillScratch::new(&self.gpu, &geometry, rows)?);
        Ok(self)
    }

    /// The rows of the prefill scratch ([`with_prefill_chunks`](Self::with_prefill_chunks)):
    /// the most a batch with a later chunk may hold after it, summed over its sequences; 0
    /// without one (only first chunks are served).
    pub fn prefill_chunk_rows(&self) -> usize {
        self.scratch.as_ref().map_or(0, PrefillScratch::rows)
    }

    /// Places the decode steps' append as `how` says ([`DecodeStep::with_append_launch`]; the
    /// results are the same).
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::{AppendLaunch, GpuContext};
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # use lserve::session::SparseAttention;
    /// # let gpu = Arc::new(GpuContext::new(0)?);
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 8, 65536)?;
    /// let session = SparseAttention::<bf16>::new(gpu, mgr, 8)?.with_append_launch(AppendLaunch::Separate);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn with_append_launch(mut self, how: AppendLaunch) -> Self {
        self.step = self.step.with_append_launch(how);
        self
    }

    /// At most `max_splits` splits per (sequence, KV head) in the decode attention
    /// ([`DecodeStep::with_max_splits`]; `InvalidArgument` unless `1 <= max_splits <=
    /// MAX_SPLITS`).
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::GpuContext;
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # use lserve::session::SparseAttention;
    /// # let gpu = Arc::new(GpuContext::new(0)?);
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 8, 65536)?;
    /// let session = SparseAttention::<bf16>::new(gpu, mgr, 8)?.with_max_splits(16)?;
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn with_max_splits(mut self, max_splits: u32) -> Result<Self> {
        self.step = self.step.with_max_splits(max_splits)?;
        Ok(self)
    }

    /// The context the session launches on (its stream orders every launch and copy).
    pub fn gpu(&self) -> &Arc<GpuContext> {
        &self.gpu
    }

    /// The manager: lengths, block tables, decode step counters, free pages.
    pub fn manager(&self) -> &KvCacheManager {
        &self.sequences.manager
    }

    /// The host half: the manager and each sequence's state.
    pub fn sequences(&self) -> &Sequences {
        &self.sequences
    }

    /// The device cache (for reads such as [`DeviceKvCache::download`]).
    pub fn cache(&self) -> &DeviceKvCache<E> {
        &self.cache
    }

    /// The largest decode batch.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// The bytes of K/V and key statistics the cache allocates and the live sequences use.
    pub fn memory(&self) -> KvMemory {
        KvMemory::of(&self.sequences.manager, E::DTYPE)
    }

    /// Starts an empty sequence (`NoFreeSlot` when every slot is taken). It may decode at once
    /// (its first token attends to itself) or be prefilled first.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        self.sequences.add()
    }

    /// Ends `seq`: its pages go back to the pool and its slot is free for the next sequence
    /// (whose first use resets the slot's selection state on the device).
    /// `UnknownSequence` for an id that is not live.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.sequences.free(seq)
    }

    /// Plans a prefill of `chunks` (`(sequence, tokens)`, in this order; the activations of the
    /// chunks' tokens one after another, `cu_seqlens` as [`Prefill::cu_seqlens`]): reserves the
    /// tokens all or nothing ([`Sequences::reserve_prefill`]), brings the device's block tables
    /// to the manager's and uploads the rows' destinations. Then [`Prefill::layer`] for every
    /// layer in order and [`Prefill::finish`].
    ///
    /// A sequence's first chunk (it holds no token) is its whole prompt so far: dense heads
    /// causal, streaming heads Λ, over the chunk's own tokens. A later chunk of a sequence that
    /// holds tokens attends to the cached prefix and to itself ([`prefill_chunks_into_cache`]):
    /// the same output as a prefill of the whole prompt in one chunk, bit for bit. A batch may
    /// mix both; one with a later chunk needs the prefill scratch
    /// ([`with_prefill_chunks`](Self::with_prefill_chunks)) and takes no block masks.
    ///
    /// Errors (nothing changed): those of [`Sequences::reserve_prefill`]; for a batch with a
    /// later chunk, `InvalidArgument { what: "chunked prefill" }` for a session without a prefill
    /// scratch and `ShapeMismatch` when the sequences' lengths after their chunks sum past its
    /// rows. A driver error after the reservation leaves the sequences
    /// [`Incomplete`](SequenceState::Incomplete).
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::GpuContext;
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # use lserve::session::SparseAttention;
    /// # use lserve::LserveError;
    /// # let gpu = Arc::new(GpuContext::new(0)?);
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 8, 65536)?;
    /// let mut session = SparseAttention::<bf16>::new(gpu, mgr, 8)?;
    /// let (a, b) = (session.add_sequence()?, session.add_sequence()?);
    /// let pf = session.prefill(&[(a, 300), (b, 700)])?;
    /// assert_eq!(pf.cu_seqlens(), [0, 300, 1000]);
    /// drop(pf); // without its layers and finish: `a` and `b` are left Incomplete
    /// // `a` holds tokens not written through every layer: no further chunk until it is freed.
    /// assert!(matches!(
    ///     session.prefill(&[(a, 100)]),
    ///     Err(LserveError::InvalidArgument { .. })
    /// ));
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn prefill(&mut self, chunks: &[(SeqId, usize)]) -> Result<Prefill<'_, E>> {
        let extent = self.sequences.check_prefill(chunks)?;
        if extent.prefixed {
            check_scratch(self.scratch.as_ref(), extent.lengths)?;
        }
        let ranges = self.sequences.reserve_checked(chunks)?;
        let Self {
            gpu,
            sequences: Sequences { manager, states },
            cache,
            scratch,
            ..
        } = self;
        let gpu: &GpuContext = gpu;
        let plan = KvWritePlan::new(manager, &ranges)?;
        let writes = plan.upload(gpu, manager, cache)?;
        Ok(Prefill {
            gpu,
            cache,
            states,
            writes,
            scratch: scratch.as_mut().filter(|_| extent.prefixed),
            seqs: ranges.iter().map(|(s, _)| *s).collect(),
            layers: manager.geometry().layers(),
            next_layer: 0,
        })
    }

    /// Plans a decode step of `seqs` (in this order: row `b` of the step's `q`, `k`, `v`,
    /// `out` is `seqs[b]`): reserves one token per sequence, brings the device's tables to the
    /// manager's, writes the batch description ([`DecodeStep::plan`]). Then
    /// [`Decode::layer`] for every layer in order and [`Decode::finish`].
    ///
    /// Errors (nothing changed): `Empty` for no sequence; `InvalidArgument` for more than
    /// [`max_batch`](Self::max_batch), a sequence twice or one
    /// [`Incomplete`](SequenceState::Incomplete); `UnknownSequence`; `PoolExhausted`,
    /// `SequenceTooLong` from the reservation.
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::GpuContext;
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # use lserve::session::SparseAttention;
    /// # let gpu = Arc::new(GpuContext::new(0)?);
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 8, 65536)?;
    /// let mut session = SparseAttention::<bf16>::new(gpu.clone(), mgr, 8)?;
    /// let (a, b) = (session.add_sequence()?, session.add_sequence()?);
    /// let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
    /// let s = gpu.stream();
    /// let (q, k, v) = (s.alloc_zeros::<bf16>(2 * hq * d)?, s.alloc_zeros::<bf16>(2 * hkv * d)?, s.alloc_zeros::<bf16>(2 * hkv * d)?);
    /// let mut out = s.alloc_zeros::<bf16>(2 * hq * d)?;
    /// let mut step = session.decode(&[a, b])?;
    /// for layer in 0..g.layers() {
    ///     step.layer(layer, &q, &k, &v, &mut out)?;
    /// }
    /// step.finish()?;
    /// assert_eq!(session.manager().len(a)?, 1);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn decode(&mut self, seqs: &[SeqId]) -> Result<Decode<'_, E>> {
        self.sequences.check_decode(seqs)?;
        let Self {
            gpu,
            sequences: Sequences { manager, states },
            cache,
            step,
            ..
        } = self;
        let gpu: &GpuContext = gpu;
        let layers = manager.geometry().layers();
        let plan = step.plan(gpu, manager, cache, seqs)?;
        Sequences::mark(states, seqs, SequenceState::Incomplete);
        Ok(Decode {
            gpu,
            cache,
            plan,
            states,
            seqs: seqs.to_vec(),
            layers,
            next_layer: 0,
            selector: None,
        })
    }

    /// Plans a decode step of `seqs` as [`decode`](Self::decode), captures it in two CUDA
    /// graphs — every layer `layers` runs (its launches and whatever else it enqueues on the
    /// stream) and the end of the step, once with the page selector and once without — then
    /// runs this step by launching the one [`Decode::selects`] names. Later steps of any
    /// `seqs.len()` sequences replay one of them ([`replay_decode`](Self::replay_decode)).
    ///
    /// `layers` is called twice, on a step that runs layers in order as [`Decode::layer`]
    /// does; it must enqueue the same work both times, and run every layer. The graphs read
    /// the tensors it gives as they are when replayed: write each step's `q`, `k`, `v` into
    /// the same buffers, keep them (and `out`) alive while the graphs are. Capturing needs a
    /// context without cudarc's event tracking inside the capture (see [`GpuContext`]: as
    /// [`GpuContext::new`] makes it).
    ///
    /// Errors: those of [`decode`](Self::decode) (nothing changed), and whatever `layers`
    /// returns or a capture fails with (the capture is ended, the sequences are left
    /// [`Incomplete`](SequenceState::Incomplete)).
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use half::bf16;
    /// # use lserve::config::SparsityConfig;
    /// # use lserve::geometry::ModelGeometry;
    /// # use lserve::gpu::GpuContext;
    /// # use lserve::head_pattern::HeadPattern;
    /// # use lserve::paging::KvCacheManager;
    /// # use lserve::session::SparseAttention;
    /// # let gpu = Arc::new(GpuContext::new(0)?);
    /// # let g = ModelGeometry::llama3_8b();
    /// # let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 8, 65536)?;
    /// let mut session = SparseAttention::<bf16>::new(gpu.clone(), mgr, 8)?;
    /// let (a, b) = (session.add_sequence()?, session.add_sequence()?);
    /// let (hq, hkv, d, l) = (g.q_heads(), g.kv_heads(), g.head_dim(), g.layers());
    /// let s = gpu.stream();
    /// // One buffer per layer: the graph reads them when replayed.
    /// let q: Vec<_> = (0..l).map(|_| s.alloc_zeros::<bf16>(2 * hq * d)).collect::<Result<_, _>>()?;
    /// let kv: Vec<_> = (0..l).map(|_| s.alloc_zeros::<bf16>(2 * hkv * d)).collect::<Result<_, _>>()?;
    /// let mut out: Vec<_> = (0..l).map(|_| s.alloc_zeros::<bf16>(2 * hq * d)).collect::<Result<_, _>>()?;
    /// let graphs = session.capture_decode(&[a, b], |step| {
    ///     for layer in 0..l {
    ///         step.layer(layer, &q[layer], &kv[layer], &kv[layer], &mut out[layer])?;
    ///     }
    ///     Ok(())
    /// })?;
    /// for _ in 0..100 {
    ///     // ... the engine writes the step's q, k, v of every layer into the buffers ...
    ///     session.replay_decode(&graphs, &[a, b])?;
    /// }
    /// assert_eq!(session.manager().len(a)?, 101);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn capture_decode(
        &mut self,
        seqs: &[SeqId],
        mut layers: impl FnMut(&mut Decode<'_, E>) -> Result<()>,
    ) -> Result<DecodeGraphs> {
        let session = self.id;
        let mut step = self.decode(seqs)?;
        let with_selector = step.capture(true, &mut layers)?;
        let without_selector = step.capture(false, &mut layers)?;
        let selects = step.selects();
        let graphs = DecodeGraphs {
            with_selector,
            without_selector,
            batch: seqs.len(),
            session,
        };
        step.replay(&graphs, selects)?;
        Ok(graphs)
    }

    /// One decode step of `seqs` by a replay of `graphs` (captured by
    /// [`capture_decode`](Self::capture_decode) on this session for as many sequences, any):
    /// plans the step as [`decode`](Self::decode) (the tables and the batch description are
    /// rewritten in place, where the graphs read them), launches the graph with the selector
    /// when [`Decode::selects`] says so and the one without otherwise, and ends the step.
    ///
    /// Errors (nothing changed): `InvalidArgument` for graphs of another session or another
    /// batch size; those of [`decode`](Self::decode). A launch error leaves the sequences
    /// [`Incomplete`](SequenceState::Incomplete).
    pub fn replay_decode(&mut self, graphs: &DecodeGraphs, seqs: &[SeqId]) -> Result<()> {
        if graphs.session != self.id {
            return Err(invalid(
                "graphs",
                "captured on another session (their launches use its buffers)",
            ));
        }
        if graphs.batch != seqs.len() {
            return Err(invalid(
                "graphs",
                format!(
                    "captured for batches of {} sequences, the step has {}: capture another",
                    graphs.batch,
                    seqs.len()
                ),
            ));
        }
        let step = self.decode(seqs)?;
        let selects = step.selects();
        step.replay(graphs, selects)
    }
}

/// A prefill under way ([`SparseAttention::prefill`]): its layers in order, then
/// [`finish`](Self::finish). It holds the session.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use half::bf16;
/// # use lserve::config::SparsityConfig;
/// # use lserve::geometry::ModelGeometry;
/// # use lserve::gpu::GpuContext;
/// # use lserve::head_pattern::HeadPattern;
/// # use lserve::paging::KvCacheManager;
/// # use lserve::session::SparseAttention;
/// # let gpu = Arc::new(GpuContext::new(0)?);
/// # let g = ModelGeometry::llama3_8b();
/// # let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 8, 65536)?;
/// let mut session = SparseAttention::<bf16>::new(gpu.clone(), mgr, 8)?;
/// let seq = session.add_sequence()?;
/// let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
/// let s = gpu.stream();
/// let qkv = s.alloc_zeros::<bf16>(500 * (hq + 2 * hkv) * d)?; // a fused projection
/// let mut out = s.alloc_zeros::<bf16>(500 * hq * d)?;
/// let row = (hq + 2 * hkv) * d;
/// let mut pf = session.prefill(&[(seq, 500)])?;
/// assert_eq!(pf.tokens(), 500);
/// for layer in 0..g.layers() {
///     use lserve::gpu::Tokens;
///     let q = Tokens::strided(qkv.slice(..), row);
///     let k = Tokens::strided(qkv.slice(hq * d..), row);
///     let v = Tokens::strided(qkv.slice((hq + hkv) * d..), row);
///     pf.layer(layer, q, k, v, &mut out)?;
/// }
/// pf.finish()?;
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[must_use = "a prefill runs its layers and ends with `finish`"]
pub struct Prefill<'s, E> {
    gpu: &'s GpuContext,
    cache: &'s mut DeviceKvCache<E>,
    states: &'s mut BTreeMap<SeqId, SequenceState>,
    writes: DeviceKvWritePlan,
    /// The session's prefill scratch for a batch with a later chunk; `None` for first chunks.
    scratch: Option<&'s mut PrefillScratch<E>>,
    seqs: Vec<SeqId>,
    layers: usize,
    next_layer: usize,
}

impl<E: DeviceElement> Prefill<'_, E> {
    /// Tokens of the prefill (`T`, the rows of `q`, `k`, `v`, `out`).
    pub fn tokens(&self) -> usize {
        self.writes.plan().rows()
    }

    /// The ragged batch's `B + 1` row offsets: chunk `b`'s tokens are rows
    /// `cu_seqlens[b]..cu_seqlens[b + 1]`.
    pub fn cu_seqlens(&self) -> Vec<usize> {
        self.writes
            .plan()
            .cu_seqlens()
            .iter()
            .map(|&x| x as usize)
            .collect()
    }

    /// The next layer [`layer`](Self::layer) takes.
    pub fn next_layer(&self) -> usize {
        self.next_layer
    }

    /// Layer `layer` of the prefill: writes the chunks' `k`, `v` (`[T][Hkv][D]`, after RoPE)
    /// into the layer's cache (dense heads into their pages with their key statistics,
    /// streaming heads their sinks and last `local_tokens` tokens) and computes the attention
    /// `q [T][Hq][D]` -> `out [T][Hq][D]`. Each tensor is a `&CudaSlice` or a [`Tokens`] /
    /// [`TokensMut`] view under [`Tokens`]' rule. Layers run in order, each once.
    ///
    /// Errors (nothing enqueued, the prefill still usable): `InvalidArgument` for a layer out
    /// of order; the tensor errors of [`prefill_into_cache`].
    pub fn layer<'t>(
        &mut self,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
    ) -> Result<()> {
        self.layer_with_block_masks(layer, None, q, k, v, out)
    }

    /// [`layer`](Self::layer) with optional caller block masks, one per chunk
    /// ([`PrefillArgs::block_masks`](crate::gpu::PrefillArgs::block_masks): intersected with
    /// each head's pattern, the diagonal kept). A batch of first chunks only: with a later
    /// chunk, block masks are `InvalidArgument` (nothing enqueued).
    pub fn layer_with_block_masks<'t>(
        &mut self,
        layer: usize,
        block_masks: Option<&[BlockMask]>,
        q: impl Into<Tokens<'t, E>>,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
    ) -> Result<()> {
        check_layer_order("prefill", layer, self.next_layer, self.layers)?;
        launch_prefill_layer(
            self.gpu,
            self.cache,
            layer,
            &self.writes,
            self.scratch.as_deref_mut(),
            block_masks,
            q.into(),
            k.into(),
            v.into(),
            out.into(),
        )?;
        self.next_layer += 1;
        Ok(())
    }

    /// Ends the prefill: its sequences are [`Ready`](SequenceState::Ready) to decode.
    ///
    /// Errors: `InvalidArgument` unless every layer ran (the sequences are then left
    /// [`Incomplete`](SequenceState::Incomplete)).
    pub fn finish(self) -> Result<()> {
        check_all_layers("prefill", self.next_layer, self.layers)?;
        Sequences::mark(self.states, &self.seqs, SequenceState::Ready);
        Ok(())
    }
}

/// The one launch path of a prefill layer: a batch of first chunks is written and attended by
/// [`prefill_into_cache`]; one with a later chunk (the plan then lent it the `scratch`, sized by
/// [`check_scratch`]) by [`prefill_chunks_into_cache`].
#[allow(clippy::too_many_arguments)]
fn launch_prefill_layer<E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    layer: usize,
    writes: &DeviceKvWritePlan,
    scratch: Option<&mut PrefillScratch<E>>,
    block_masks: Option<&[BlockMask]>,
    q: Tokens<'_, E>,
    k: Tokens<'_, E>,
    v: Tokens<'_, E>,
    out: TokensMut<'_, E>,
) -> Result<()> {
    match scratch {
        None => prefill_into_cache(gpu, cache, layer, writes, block_masks, q, k, v, out),
        Some(_) if block_masks.is_some() => Err(invalid(
            "block_masks",
            "a prefill with a later chunk (attending to a cached prefix) takes no block masks",
        )),
        Some(scratch) => {
            prefill_chunks_into_cache(gpu, cache, layer, writes, scratch, q, k, v, out)
        }
    }
}

/// Checks, before anything is reserved, that a prefill batch with a later chunk fits the
/// session's prefill scratch: its sequences' lengths after their chunks sum to `lengths`.
fn check_scratch<E: DeviceElement>(
    scratch: Option<&PrefillScratch<E>>,
    lengths: usize,
) -> Result<()> {
    match scratch {
        None => Err(invalid(
            "chunked prefill",
            "a chunk of a sequence that holds tokens attends to its cached prefix through the \
             session's prefill scratch: make the session with_prefill_chunks(rows)",
        )),
        Some(s) if s.rows() < lengths => Err(LserveError::ShapeMismatch {
            what: "prefill scratch rows (the batch's lengths after its chunks)",
            expected: lengths,
            actual: s.rows(),
        }),
        Some(_) => Ok(()),
    }
}

/// `InvalidArgument` unless `layer` is the one a step of `layers` layers runs next.
fn check_layer_order(what: &'static str, layer: usize, next: usize, layers: usize) -> Result<()> {
    if layer == next && layer < layers {
        return Ok(());
    }
    Err(invalid(
        "layer",
        if next >= layers {
            format!("{layer}: this {what} ran all {layers} layers; finish it")
        } else {
            format!(
                "{layer}: this {what} runs layer {next} next (layers 0..{layers}, each once, in order)"
            )
        },
    ))
}

/// `InvalidArgument` unless all `layers` layers ran.
fn check_all_layers(what: &'static str, ran: usize, layers: usize) -> Result<()> {
    if ran == layers {
        return Ok(());
    }
    Err(invalid(
        "layer",
        format!(
            "{what} finished after {ran} of {layers} layers: its sequences hold tokens not \
             written through every layer (left Incomplete: free them)"
        ),
    ))
}

/// A decode step under way ([`SparseAttention::decode`]): its layers in order, then
/// [`finish`](Self::finish). It holds the session.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use half::bf16;
/// # use lserve::config::SparsityConfig;
/// # use lserve::geometry::ModelGeometry;
/// # use lserve::gpu::GpuContext;
/// # use lserve::head_pattern::HeadPattern;
/// # use lserve::paging::KvCacheManager;
/// # use lserve::session::SparseAttention;
/// # use lserve::LserveError;
/// # let gpu = Arc::new(GpuContext::new(0)?);
/// # let g = ModelGeometry::llama3_8b();
/// # let mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 8, 65536)?;
/// let mut session = SparseAttention::<bf16>::new(gpu.clone(), mgr, 8)?;
/// let seq = session.add_sequence()?;
/// let (hq, hkv, d) = (g.q_heads(), g.kv_heads(), g.head_dim());
/// let s = gpu.stream();
/// let (q, k, v) = (s.alloc_zeros::<bf16>(hq * d)?, s.alloc_zeros::<bf16>(hkv * d)?, s.alloc_zeros::<bf16>(hkv * d)?);
/// let mut out = s.alloc_zeros::<bf16>(hq * d)?;
/// let mut step = session.decode(&[seq])?;
/// assert_eq!(step.seqs(), [seq]);
/// // Layers run in order: layer 1 first is refused, nothing enqueued.
/// assert!(matches!(step.layer(1, &q, &k, &v, &mut out), Err(LserveError::InvalidArgument { .. })));
/// for layer in 0..g.layers() {
///     step.layer(layer, &q, &k, &v, &mut out)?;
/// }
/// step.finish()?;
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[must_use = "a decode step runs its layers and ends with `finish`"]
pub struct Decode<'s, E> {
    gpu: &'s GpuContext,
    cache: &'s mut DeviceKvCache<E>,
    plan: PlannedStep<'s>,
    states: &'s mut BTreeMap<SeqId, SequenceState>,
    seqs: Vec<SeqId>,
    layers: usize,
    next_layer: usize,
    /// Set while capturing: whether the layers launch the selector.
    selector: Option<bool>,
}

impl<E: DeviceElement> Decode<'_, E> {
    /// The batch, in row order.
    pub fn seqs(&self) -> &[SeqId] {
        &self.seqs
    }

    /// The next layer [`layer`](Self::layer) takes.
    pub fn next_layer(&self) -> usize {
        self.next_layer
    }

    /// Whether the step launches the page selector ([`PlannedStep::selects`]).
    pub fn selects(&self) -> bool {
        self.plan.selects()
    }

    /// The manager as the step planned it (the step's tokens reserved).
    pub fn manager(&self) -> &KvCacheManager {
        self.plan.manager()
    }

    /// Layer `layer` of the step ([`PlannedStep::layer`]): writes the new tokens' `k`, `v`
    /// (`[B][Hkv][D]`, after RoPE) into the layer's cache, selects pages for the dense heads
    /// where due, and attends: `q [B][Hq][D]` -> `out [B][Hq][D]`. Each tensor is a
    /// `&CudaSlice` or a [`Tokens`] / [`TokensMut`] view. Layers run in order, each once.
    ///
    /// Errors (nothing enqueued, the step still usable): `InvalidArgument` for a layer out of
    /// order; the tensor errors of [`PlannedStep::layer`].
    pub fn layer<'t>(
        &mut self,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
    ) -> Result<()> {
        self.layer_inner(layer, (q.into(), k.into(), v.into()), out.into(), None)
    }

    /// [`layer`](Self::layer), and the log-sum-exp of each query head's scaled scores over the
    /// keys it attended (natural log) into `lse [B][Hq]` ([`PlannedStep::layer_with_lse`]):
    /// what an engine needs to merge this attention with attention computed elsewhere
    /// (cascade or shared-prefix attention).
    ///
    /// Errors: those of [`layer`](Self::layer), and `ShapeMismatch` for `lse` shorter than
    /// `B · Hq` (nothing enqueued).
    pub fn layer_with_lse<'t>(
        &mut self,
        layer: usize,
        q: impl Into<Tokens<'t, E>>,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.layer_inner(layer, (q.into(), k.into(), v.into()), out.into(), Some(lse))
    }

    fn layer_inner(
        &mut self,
        layer: usize,
        qkv: (Tokens<'_, E>, Tokens<'_, E>, Tokens<'_, E>),
        out: TokensMut<'_, E>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        check_layer_order("decode step", layer, self.next_layer, self.layers)?;
        let selects = self.selector.unwrap_or_else(|| self.plan.selects());
        self.plan
            .run_layer(selects, self.gpu, self.cache, layer, qkv, out, lse)?;
        self.next_layer += 1;
        Ok(())
    }

    /// Ends the step: advances the step counters on the device and in the manager; its
    /// sequences are [`Ready`](SequenceState::Ready) again.
    ///
    /// Errors: `InvalidArgument` unless every layer ran (the sequences are then left
    /// [`Incomplete`](SequenceState::Incomplete)); `StaleTables` as [`PlannedStep::finish`].
    pub fn finish(self) -> Result<()> {
        check_all_layers("decode step", self.next_layer, self.layers)?;
        self.plan.finish(self.gpu, self.cache)?;
        Sequences::mark(self.states, &self.seqs, SequenceState::Ready);
        Ok(())
    }

    /// Captures the step's layers (`layers`) and its end in a graph, the selector launched
    /// exactly when `selector`; nothing runs. The capture is ended on every path.
    fn capture(
        &mut self,
        selector: bool,
        layers: &mut impl FnMut(&mut Self) -> Result<()>,
    ) -> Result<CudaGraph> {
        let stream = self.gpu.stream().clone();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        self.selector = Some(selector);
        self.next_layer = 0;
        let captured = layers(self)
            .and_then(|()| check_all_layers("captured decode step", self.next_layer, self.layers))
            .and_then(|()| enqueue_advance(self.gpu, self.cache, self.plan.batch()));
        self.selector = None;
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        captured?;
        graph?.ok_or_else(|| invalid("capture", "the captured decode step holds no launch"))
    }

    /// Runs the step by launching `graphs`' graph with the selector if `selects`, else the
    /// one without, and ends it.
    fn replay(self, graphs: &DecodeGraphs, selects: bool) -> Result<()> {
        let graph = match selects {
            true => &graphs.with_selector,
            false => &graphs.without_selector,
        };
        graph.launch()?;
        self.plan.replayed(self.cache, selects)?;
        Sequences::mark(self.states, &self.seqs, SequenceState::Ready);
        Ok(())
    }
}

/// A decode step captured twice in CUDA graphs, with and without the page selector
/// ([`SparseAttention::capture_decode`]), for batches of [`batch`](Self::batch) sequences;
/// replayed by [`SparseAttention::replay_decode`] on the session that captured it. Dropping it
/// frees the graphs.
pub struct DecodeGraphs {
    with_selector: CudaGraph,
    without_selector: CudaGraph,
    batch: usize,
    session: u64,
}

impl DecodeGraphs {
    /// Sequences per step the graphs were captured for.
    pub fn batch(&self) -> usize {
        self.batch
    }
}
