//! Reuse of a page selection across decode steps (`docs/ARCHITECTURE.md`, "Reuse"): the held
//! selections of the kernels' `select::top_k` and the step counters of `select::steps`.

use std::collections::BTreeMap;

use crate::error::{LserveError, Result};

/// Which (sequence, layer, dense KV head) a held selection belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReuseKey {
    /// The sequence (its raw id, e.g. [`SeqId::get`](crate::paging::SeqId::get)).
    pub seq: u32,
    /// The layer.
    pub layer: usize,
    /// The KV head (its index among all KV heads of the layer).
    pub kv_head: usize,
}

/// Selection-reuse state: per (sequence, layer, dense KV head) the selection held since its
/// last due step.
///
/// The rule: on decode step `s` of a sequence (its counter, 0 at its first decode step:
/// [`KvCacheManager::decode_step`](crate::paging::KvCacheManager::decode_step)) a head runs
/// selection if `s % C == 0` or it holds no selection yet (e.g. it attended densely until now);
/// otherwise it attends the held selection plus the current newest page. The held selection is
/// the one computed on the due step; the newest page is added per step and not accumulated
/// into it.
///
/// ```
/// use lserve::reference::select::{ReuseKey, ReuseState};
/// let mut reuse = ReuseState::new(2).unwrap();
/// let key = ReuseKey { seq: 7, layer: 0, kv_head: 1 };
/// // Step 0: due, selection runs.
/// assert_eq!(reuse.pages(key, 0, 3, || vec![0, 2, 3]), (vec![0, 2, 3], true));
/// // Step 1: the held selection is reused; the newest page (now 4) is added.
/// assert_eq!(reuse.pages(key, 1, 4, || unreachable!()), (vec![0, 2, 3, 4], false));
/// // Step 2: due again.
/// assert_eq!(reuse.pages(key, 2, 4, || vec![1, 4]), (vec![1, 4], true));
/// // A head that holds nothing selects whatever the step.
/// let other = ReuseKey { kv_head: 0, ..key };
/// assert!(reuse.selection_due(other, 3) && !reuse.selection_due(key, 3));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReuseState {
    interval: u64,
    held: BTreeMap<ReuseKey, Vec<u32>>,
}

impl ReuseState {
    /// A state with reuse interval `C = interval` (`1` selects on every step). Errors with
    /// `InvalidArgument` if `interval == 0`.
    pub fn new(interval: usize) -> Result<Self> {
        if interval == 0 {
            return Err(LserveError::InvalidArgument {
                what: "reuse_interval",
                reason: "must be at least 1".into(),
            });
        }
        Ok(Self {
            interval: interval as u64,
            held: BTreeMap::new(),
        })
    }

    /// The reuse interval `C`.
    pub fn interval(&self) -> usize {
        self.interval as usize
    }

    /// The selection `key` holds, if any (ascending logical page numbers).
    pub fn held(&self, key: ReuseKey) -> Option<&[u32]> {
        self.held.get(&key).map(Vec::as_slice)
    }

    /// Whether `key` runs selection on decode step `step` of its sequence.
    pub fn selection_due(&self, key: ReuseKey, step: u64) -> bool {
        step % self.interval == 0 || self.held(key).is_none()
    }

    /// The pages `key` attends on decode step `step`, ascending, and whether selection ran: if
    /// due, `select()` (which must return the full selected set, ascending) becomes the held
    /// selection and is returned; otherwise the held selection ∪ {`newest`}.
    pub fn pages(
        &mut self,
        key: ReuseKey,
        step: u64,
        newest: u32,
        select: impl FnOnce() -> Vec<u32>,
    ) -> (Vec<u32>, bool) {
        if self.selection_due(key, step) {
            let pages = select();
            self.held.insert(key, pages.clone());
            (pages, true)
        } else {
            let mut pages = self.held[&key].clone();
            if !pages.contains(&newest) {
                pages.push(newest);
                pages.sort_unstable();
            }
            (pages, false)
        }
    }

    /// Forgets everything held for `seq` (e.g. when the sequence is freed).
    pub fn remove_sequence(&mut self, seq: u32) {
        self.held.retain(|k, _| k.seq != seq);
    }
}
