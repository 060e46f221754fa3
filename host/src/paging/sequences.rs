//! Sequence lifecycle over the page pool and the streaming slots.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use lserve_abi::{PagedLayout, StreamingLayout};
use std::ops::Range;

use super::block_table::BlockTable;
use super::page_pool::{PageId, PagePool, PAD_PAGE};
use super::streaming_store::StreamingStore;
use crate::config::SparsityConfig;
use crate::error::{LserveError, Result};
use crate::geometry::ModelGeometry;
use crate::head_pattern::HeadPattern;

/// A live sequence's id. Ids are handed out in increasing order and never reused, so a stale
/// id is always detected (`UnknownSequence`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(u32);

impl SeqId {
    /// The raw id.
    pub const fn get(self) -> u32 {
        self.0
    }
}

/// What the cache needs to address one sequence: its slot, its length, its block table.
///
/// [`KvCacheManager::view`] returns one; tests may build one directly.
#[derive(Clone, Copy, Debug)]
pub struct SequenceView<'a> {
    /// The sequence's slot (its row in the streaming store and in device tables).
    pub slot: u32,
    /// Tokens reserved (positions `0..len` exist).
    pub len: usize,
    /// Logical page -> physical page id.
    pub block_table: &'a BlockTable,
}

/// Per-sequence state.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SequenceState {
    slot: u32,
    len: usize,
    block_table: BlockTable,
    decode_step: u64,
}

/// Hands out manager identities ([`TableGeneration`]): every manager, clones included, has its
/// own.
static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(0);

fn fresh_manager_id() -> u64 {
    NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed)
}

/// Which block tables a [`KvCacheManager`] holds: the manager (each has its own identity, a clone
/// too) and a generation that changes with every change of a block-table row or of a slot's
/// owner (a sequence added or freed, a reservation that opens a page). A device cache that
/// mirrors the tables remembers the generation it last copied, so a step planned against older
/// tables is detected.
///
/// ```
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
///
/// let g = ModelGeometry::new(1, 2, 2, 64)?;
/// let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 8, 2, 1024)?;
/// let start = mgr.generation();
/// let seq = mgr.add_sequence()?; // a slot changed hands
/// let added = mgr.generation();
/// assert_ne!(added, start);
/// mgr.reserve(seq, 10)?; // opens page 0
/// let opened = mgr.generation();
/// assert_ne!(opened, added);
/// mgr.reserve(seq, 10)?; // still page 0: the tables are unchanged
/// assert_eq!(mgr.generation(), opened);
/// assert_ne!(mgr.clone().generation(), opened); // another manager
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TableGeneration {
    manager: u64,
    generation: u64,
}

impl TableGeneration {
    /// The generation `generation` of the manager with identity `manager`.
    pub(crate) fn new(manager: u64, generation: u64) -> Self {
        Self {
            manager,
            generation,
        }
    }
}

/// The block tables of all slots in the device's shape (row = slot).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceBlockTables {
    /// Rows (`max_sequences`).
    pub slots: usize,
    /// Entries per row (`ceil(max_seq_len / page_tokens)`).
    pub max_pages_per_seq: usize,
    /// `[slots][max_pages_per_seq]` physical page ids, [`PAD_PAGE`] past each row's length.
    pub pages: Vec<u32>,
    /// `[slots]` pages mapped per row (0 for a free slot).
    pub num_pages: Vec<u32>,
    /// `[slots]` sequence length in tokens (0 for a free slot).
    pub seq_lens: Vec<u32>,
}

/// Owns the page pool, the streaming slots and every live sequence's length, block table and
/// decode step counter.
///
/// Every method that fails returns a typed error and leaves the manager unchanged. Clones are
/// separate managers: equal (`==`) in content, with their own [`generation`](Self::generation)
/// identity.
///
/// ```
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
/// use lserve::LserveError;
///
/// let g = ModelGeometry::llama3_8b();
/// let config = SparsityConfig::default(); // 64-token pages
/// let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, config, 4, 2, 1024)?;
/// let a = mgr.add_sequence()?;
/// assert_eq!(mgr.reserve(a, 100)?, 0..100); // 2 pages
/// assert_eq!(mgr.reserve(a, 28)?, 100..128); // still 2 pages
/// let b = mgr.add_sequence()?;
/// let before = mgr.clone();
/// assert!(matches!(mgr.reserve(b, 3 * 64), Err(LserveError::PoolExhausted { .. })));
/// assert_eq!(mgr, before); // nothing changed
/// mgr.free_sequence(a)?;
/// mgr.reserve(b, 3 * 64)?;
/// assert_eq!(mgr.len(b)?, 192);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Debug)]
pub struct KvCacheManager {
    /// This manager's identity ([`TableGeneration`]); fresh for a clone.
    id: u64,
    /// Bumped on every change of a block-table row or a slot's owner.
    generation: u64,
    /// `[slots]`: the generation at which the slot's row or owner last changed.
    row_generations: Vec<u64>,
    /// `[slots]`: the sequence in each slot.
    owners: Vec<Option<SeqId>>,
    geometry: ModelGeometry,
    pattern: HeadPattern,
    config: SparsityConfig,
    pool: PagePool,
    store: StreamingStore,
    sequences: BTreeMap<SeqId, SequenceState>,
    next_id: u32,
    max_seq_len: usize,
}

impl Clone for KvCacheManager {
    fn clone(&self) -> Self {
        Self {
            id: fresh_manager_id(),
            generation: self.generation,
            row_generations: self.row_generations.clone(),
            owners: self.owners.clone(),
            geometry: self.geometry,
            pattern: self.pattern.clone(),
            config: self.config,
            pool: self.pool.clone(),
            store: self.store.clone(),
            sequences: self.sequences.clone(),
            next_id: self.next_id,
            max_seq_len: self.max_seq_len,
        }
    }
}

/// Equal content (the identity in [`TableGeneration`] aside: a clone equals its original).
impl PartialEq for KvCacheManager {
    fn eq(&self, other: &Self) -> bool {
        self.generation == other.generation
            && self.row_generations == other.row_generations
            && self.owners == other.owners
            && self.geometry == other.geometry
            && self.pattern == other.pattern
            && self.config == other.config
            && self.pool == other.pool
            && self.store == other.store
            && self.sequences == other.sequences
            && self.next_id == other.next_id
            && self.max_seq_len == other.max_seq_len
    }
}

impl KvCacheManager {
    /// A manager for `max_sequences` sequences of at most `max_seq_len` tokens over a pool of
    /// `capacity_pages` physical pages. Validates the config, that the pattern is for this
    /// geometry, and the sizes (all > 0 and fitting the device's `u32`s), all before allocating
    /// anything.
    pub fn new(
        geometry: ModelGeometry,
        pattern: HeadPattern,
        config: SparsityConfig,
        capacity_pages: usize,
        max_sequences: usize,
        max_seq_len: usize,
    ) -> Result<Self> {
        config.validate()?;
        config.stats_format.check(geometry.head_dim())?;
        if *pattern.geometry() != geometry {
            return Err(LserveError::HeadPattern(format!(
                "pattern is for {:?}, cache for {:?}",
                pattern.geometry(),
                geometry
            )));
        }
        if max_seq_len == 0 || u32::try_from(max_seq_len).is_err() {
            return Err(LserveError::InvalidConfig {
                field: "max_seq_len",
                reason: format!("{max_seq_len} is not in 1..=u32::MAX"),
            });
        }
        PagePool::check_capacity(capacity_pages)?;
        StreamingStore::check(max_sequences, config.sink_tokens, config.local_tokens)?;
        let pool = PagePool::new(capacity_pages)?;
        let store = StreamingStore::new(max_sequences, config.sink_tokens, config.local_tokens)?;
        Ok(Self {
            id: fresh_manager_id(),
            generation: 0,
            row_generations: vec![0; max_sequences],
            owners: vec![None; max_sequences],
            geometry,
            pattern,
            config,
            pool,
            store,
            sequences: BTreeMap::new(),
            next_id: 0,
            max_seq_len,
        })
    }

    /// Starts an empty sequence in the lowest free slot (`NoFreeSlot` if all are in use).
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        if self.next_id == u32::MAX {
            return Err(LserveError::InvalidArgument {
                what: "sequence id",
                reason: "all u32 ids have been used".into(),
            });
        }
        let slot = self.store.acquire()?;
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.sequences.insert(
            id,
            SequenceState {
                slot,
                len: 0,
                block_table: BlockTable::new(),
                decode_step: 0,
            },
        );
        self.owners[slot as usize] = Some(id);
        self.changed_row(slot);
        Ok(id)
    }

    /// Records a change of `slot`'s block-table row or owner.
    fn changed_row(&mut self, slot: u32) {
        self.generation += 1;
        self.row_generations[slot as usize] = self.generation;
    }

    /// Grows `seq` by `n_tokens`, allocating the pages it needs, and returns the new positions.
    ///
    /// All-or-nothing: `Empty` for 0 tokens, `SequenceTooLong` past `max_seq_len`,
    /// `InvalidArgument` if the length plus `n_tokens` overflows `usize`, `PoolExhausted` if the
    /// pool lacks pages, `UnknownSequence` for a dead id; on error nothing changes.
    pub fn reserve(&mut self, seq: SeqId, n_tokens: usize) -> Result<Range<usize>> {
        if n_tokens == 0 {
            return Err(LserveError::Empty("reservation (0 tokens)"));
        }
        let state = self
            .sequences
            .get(&seq)
            .ok_or(LserveError::UnknownSequence(seq.0))?;
        let old_len = state.len;
        let new_len = self.grown_len(old_len, n_tokens)?;
        let needed = self.config.pages_for_len(new_len) - state.block_table.len();
        let pages = self.pool.alloc(needed)?;
        let state = self.sequences.get_mut(&seq).expect("checked above");
        state.block_table.extend(&pages);
        state.len = new_len;
        let slot = state.slot;
        if !pages.is_empty() {
            self.changed_row(slot);
        }
        Ok(old_len..new_len)
    }

    /// Grows every sequence of `seqs` by `n_tokens` (a decode step's tokens), all or none: the
    /// errors of [`reserve`](Self::reserve) for any of them, `PoolExhausted` if the pool lacks
    /// the pages all of them need together, `InvalidArgument` for a sequence listed twice; on
    /// error nothing changes.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::paging::KvCacheManager;
    ///
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// let mut mgr = KvCacheManager::new(g, HeadPattern::all_dense(g), SparsityConfig::default(), 3, 2, 1024)?;
    /// let (a, b) = (mgr.add_sequence()?, mgr.add_sequence()?);
    /// mgr.reserve(a, 64)?; // one full page
    /// mgr.reserve(b, 64)?;
    /// assert!(mgr.reserve_each(&[a, b], 1).is_err()); // two new pages needed, one free
    /// assert_eq!((mgr.len(a)?, mgr.len(b)?), (64, 64)); // neither grew
    /// mgr.reserve_each(&[a], 1)?;
    /// assert_eq!(mgr.len(a)?, 65);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn reserve_each(&mut self, seqs: &[SeqId], n_tokens: usize) -> Result<()> {
        if n_tokens == 0 {
            return Err(LserveError::Empty("reservation (0 tokens)"));
        }
        let mut needed = 0usize;
        for (i, &seq) in seqs.iter().enumerate() {
            if seqs[..i].contains(&seq) {
                return Err(LserveError::InvalidArgument {
                    what: "sequences",
                    reason: format!("sequence {} listed twice", seq.0),
                });
            }
            let state = self.state(seq)?;
            let new_len = self.grown_len(state.len, n_tokens)?;
            needed =
                needed.saturating_add(self.config.pages_for_len(new_len) - state.block_table.len());
        }
        if needed > self.pool.free_pages() {
            return Err(LserveError::PoolExhausted {
                needed,
                free: self.pool.free_pages(),
            });
        }
        for &seq in seqs {
            self.reserve(seq, n_tokens)
                .expect("checked above: known, short enough, pages free");
        }
        Ok(())
    }

    /// Ends `seq`: its pages go back to the pool and its slot is free again.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        let state = self
            .sequences
            .get(&seq)
            .ok_or(LserveError::UnknownSequence(seq.0))?;
        // Both checks first, so that neither release can fail after the other succeeded.
        self.pool.check_owned(state.block_table.pages())?;
        if !self.store.is_in_use(state.slot) {
            return Err(LserveError::InvalidArgument {
                what: "slot",
                reason: format!("{} is not in use", state.slot),
            });
        }
        let state = self.sequences.remove(&seq).expect("checked above");
        self.pool
            .free(state.block_table.pages())
            .expect("checked above");
        self.store.release(state.slot).expect("checked above");
        self.owners[state.slot as usize] = None;
        self.changed_row(state.slot);
        Ok(())
    }

    /// The length a sequence of `len` tokens reaches with `n_tokens` more: `SequenceTooLong`
    /// past `max_seq_len`, or `InvalidArgument` naming both numbers when their sum overflows
    /// `usize` (no length to report).
    fn grown_len(&self, len: usize, n_tokens: usize) -> Result<usize> {
        let max = self.max_seq_len;
        match len.checked_add(n_tokens) {
            Some(new_len) if new_len <= max => Ok(new_len),
            Some(new_len) => Err(LserveError::SequenceTooLong { len: new_len, max }),
            None => Err(LserveError::InvalidArgument {
                what: "n_tokens",
                reason: format!(
                    "{n_tokens} more tokens on a sequence of {len} overflow usize (at most {max})"
                ),
            }),
        }
    }

    fn state(&self, seq: SeqId) -> Result<&SequenceState> {
        self.sequences
            .get(&seq)
            .ok_or(LserveError::UnknownSequence(seq.0))
    }

    /// Tokens reserved for `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.state(seq)?.len)
    }

    /// The block table of `seq`.
    pub fn block_table(&self, seq: SeqId) -> Result<&BlockTable> {
        Ok(&self.state(seq)?.block_table)
    }

    /// The slot of `seq`.
    pub fn slot(&self, seq: SeqId) -> Result<u32> {
        Ok(self.state(seq)?.slot)
    }

    /// The slot, length and block table of `seq`, for [`HostKvCache`](super::HostKvCache).
    pub fn view(&self, seq: SeqId) -> Result<SequenceView<'_>> {
        let s = self.state(seq)?;
        Ok(SequenceView {
            slot: s.slot,
            len: s.len,
            block_table: &s.block_table,
        })
    }

    /// The decode step counter of `seq` (0 before and at its first decode step).
    pub fn decode_step(&self, seq: SeqId) -> Result<u64> {
        Ok(self.state(seq)?.decode_step)
    }

    /// Advances the decode step counter of `seq` by one (at the end of a decode step) and
    /// returns the new value. This counter is the truth: a device cache's copy follows it
    /// (`PlannedStep::finish` advances both; a batch set after an advance made here alone writes
    /// this value into the device's).
    pub fn advance_decode_step(&mut self, seq: SeqId) -> Result<u64> {
        let s = self
            .sequences
            .get_mut(&seq)
            .ok_or(LserveError::UnknownSequence(seq.0))?;
        s.decode_step += 1;
        Ok(s.decode_step)
    }

    /// Live sequences, ascending by id.
    pub fn sequences(&self) -> Vec<SeqId> {
        self.sequences.keys().copied().collect()
    }

    /// Live sequences.
    pub fn num_sequences(&self) -> usize {
        self.sequences.len()
    }

    /// Whether `seq` is live.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.sequences.contains_key(&seq)
    }

    /// The model geometry.
    pub fn geometry(&self) -> &ModelGeometry {
        &self.geometry
    }

    /// The head pattern.
    pub fn pattern(&self) -> &HeadPattern {
        &self.pattern
    }

    /// The (validated) sparsity configuration.
    pub fn config(&self) -> &SparsityConfig {
        &self.config
    }

    /// The page pool.
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// The streaming store's slots.
    pub fn streaming_store(&self) -> &StreamingStore {
        &self.store
    }

    /// Sequence slots in total.
    pub fn max_sequences(&self) -> usize {
        self.store.slots()
    }

    /// The longest a sequence may grow.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// Block-table entries a sequence can need (`ceil(max_seq_len / page_tokens)`).
    pub fn max_pages_per_seq(&self) -> usize {
        self.config.pages_for_len(self.max_seq_len)
    }

    /// Which block tables the manager holds now ([`TableGeneration`]).
    pub fn generation(&self) -> TableGeneration {
        TableGeneration::new(self.id, self.generation)
    }

    /// The generation number of [`generation`](Self::generation).
    pub(crate) fn generation_number(&self) -> u64 {
        self.generation
    }

    /// This manager's identity (the `manager` of its [`TableGeneration`]).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The generation at which `slot`'s block-table row or owner last changed (0 for a slot
    /// out of range, or never used).
    pub(crate) fn row_generation(&self, slot: u32) -> u64 {
        self.row_generations
            .get(slot as usize)
            .copied()
            .unwrap_or(0)
    }

    /// The sequence in `slot` and its block table, if the slot is in use.
    pub(crate) fn slot_owner(&self, slot: u32) -> Option<(SeqId, &BlockTable)> {
        let seq = (*self.owners.get(slot as usize)?)?;
        Some((seq, &self.sequences.get(&seq)?.block_table))
    }

    /// Layer `layer`'s dense page pool layout (the pool's capacity, the layer's dense heads).
    ///
    /// # Panics
    /// If `layer` is out of range (like the [`HeadPattern`] queries).
    pub fn paged_layout(&self, layer: usize) -> PagedLayout {
        super::paged_layout(&self.pattern, &self.config, self.pool.capacity(), layer)
    }

    /// Layer `layer`'s streaming store layout (all slots, the layer's streaming heads).
    ///
    /// # Panics
    /// If `layer` is out of range.
    pub fn streaming_layout(&self, layer: usize) -> StreamingLayout {
        self.store.layout(
            self.pattern.streaming_heads(layer),
            self.geometry.head_dim(),
        )
    }

    /// All block tables in the device's shape, indexed by slot.
    pub fn device_block_tables(&self) -> DeviceBlockTables {
        let (slots, width) = (self.max_sequences(), self.max_pages_per_seq());
        let mut t = DeviceBlockTables {
            slots,
            max_pages_per_seq: width,
            pages: vec![PAD_PAGE; slots * width],
            num_pages: vec![0; slots],
            seq_lens: vec![0; slots],
        };
        for s in self.sequences.values() {
            let row = s.slot as usize;
            let pages: &[PageId] = s.block_table.pages();
            t.pages[row * width..row * width + pages.len()].copy_from_slice(pages);
            t.num_pages[row] = pages.len() as u32;
            t.seq_lens[row] = s.len as u32;
        }
        t
    }
}
