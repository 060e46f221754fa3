//! What a device cache's block tables and selection state hold, kept on the host: the manager
//! and table generation they mirror, and per slot its owner, its mapped pages, its decode step
//! counter and whether it holds a selection. [`TableMirror::sync`] names the copies that bring
//! the device to the manager's tables: only the rows that changed, and of a row that only grew,
//! only the new entries. Pure host logic (the device cache applies the copies).

use crate::paging::{KvCacheManager, SeqId, TableGeneration};
use crate::{LserveError, Result};

/// One copy that brings a device row to the manager's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowCopy {
    /// Entries `from..to` of row `slot` take the slot owner's pages `from..to`.
    Pages { slot: u32, from: usize, to: usize },
    /// Entries `from..to` of row `slot` become `PAD_PAGE`.
    Pad { slot: u32, from: usize, to: usize },
    /// `slot` changed hands: its step counter and held selections are zeroed.
    ResetSelection { slot: u32 },
}

/// One slot as the device holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SlotMirror {
    /// The sequence whose row the device holds.
    owner: Option<SeqId>,
    /// The manager's row generation the device's row was copied at.
    row_generation: u64,
    /// Entries of the row that hold the owner's pages (the rest are `PAD_PAGE`).
    pages: usize,
    /// The device's decode step counter of the slot (after every enqueued step).
    step: u32,
    /// No selection held since the cache was made or the slot's selection state was reset: the
    /// slot's next step selects whatever its counter says.
    selection_pending: bool,
}

/// The host's record of a device cache's tables and selection state (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TableMirror {
    /// The identity of the manager mirrored.
    manager: u64,
    /// That manager's generation at the last sync.
    generation: u64,
    slots: Vec<SlotMirror>,
}

impl TableMirror {
    /// The mirror of a cache built from `manager`: its block tables and step counters copied
    /// whole, no selection held.
    pub(crate) fn of(manager: &KvCacheManager) -> Self {
        let slots = (0..manager.max_sequences() as u32)
            .map(|slot| {
                let owner = manager.slot_owner(slot);
                SlotMirror {
                    owner: owner.map(|(seq, _)| seq),
                    row_generation: manager.row_generation(slot),
                    pages: owner.map_or(0, |(_, table)| table.len()),
                    step: owner
                        .and_then(|(seq, _)| manager.decode_step(seq).ok())
                        .map_or(0, |step| step as u32),
                    selection_pending: true,
                }
            })
            .collect();
        Self {
            manager: manager.id(),
            generation: manager.generation_number(),
            slots,
        }
    }

    /// Brings the mirror to `manager`'s tables, calling `copy` for every copy the device needs
    /// (in order; a slot's record changes after its copies succeeded). Nothing when the manager's
    /// generation is the one last synced. Every row of another manager is rewritten, and every
    /// occupied slot of it reset. The manager must be shaped as the mirror (slot count).
    pub(crate) fn sync(
        &mut self,
        manager: &KvCacheManager,
        mut copy: impl FnMut(RowCopy) -> Result<()>,
    ) -> Result<()> {
        let other = manager.id() != self.manager;
        if !other && manager.generation_number() == self.generation {
            return Ok(());
        }
        for (slot, m) in self.slots.iter_mut().enumerate() {
            let slot = slot as u32;
            let row_generation = manager.row_generation(slot);
            if !other && row_generation == m.row_generation {
                continue;
            }
            let owner = manager.slot_owner(slot);
            let (seq, pages) = (owner.map(|(s, _)| s), owner.map_or(0, |(_, t)| t.len()));
            // A live sequence's table only grows: the entries the device holds stay valid.
            let same_owner = !other && seq == m.owner;
            let from = if same_owner { m.pages.min(pages) } else { 0 };
            if pages > from {
                copy(RowCopy::Pages {
                    slot,
                    from,
                    to: pages,
                })?;
            }
            if m.pages > pages {
                copy(RowCopy::Pad {
                    slot,
                    from: pages,
                    to: m.pages,
                })?;
            }
            if seq.is_some() && !same_owner {
                copy(RowCopy::ResetSelection { slot })?;
                m.step = 0;
                m.selection_pending = true;
            }
            m.owner = seq;
            m.pages = pages;
            m.row_generation = row_generation;
        }
        self.manager = manager.id();
        self.generation = manager.generation_number();
        Ok(())
    }

    /// The value to write into the device's step counter of `slot` so that it follows the
    /// manager's `step`, if it differs (recorded as written).
    pub(crate) fn follow_step(&mut self, slot: u32, step: u64) -> Option<u32> {
        let m = self.slots.get_mut(slot as usize)?;
        let step = step as u32;
        (m.step != step).then(|| {
            m.step = step;
            step
        })
    }

    /// Records one step advance of the device's counters of `slots`.
    pub(crate) fn advanced(&mut self, slots: &[u32]) {
        for &s in slots {
            if let Some(m) = self.slots.get_mut(s as usize) {
                m.step = m.step.wrapping_add(1);
            }
        }
    }

    /// Records that `slot`'s selection state was zeroed (counter 0, nothing held).
    pub(crate) fn reset(&mut self, slot: u32) {
        if let Some(m) = self.slots.get_mut(slot as usize) {
            m.step = 0;
            m.selection_pending = true;
        }
    }

    /// Whether a slot of `slots` holds no selection (unknown slots count as holding none).
    pub(crate) fn selection_pending(&self, slots: &[u32]) -> bool {
        slots.iter().any(|&s| {
            self.slots
                .get(s as usize)
                .is_none_or(|m| m.selection_pending)
        })
    }

    /// Records that a step with the selector ran for `slots`.
    pub(crate) fn selected(&mut self, slots: &[u32]) {
        for &s in slots {
            if let Some(m) = self.slots.get_mut(s as usize) {
                m.selection_pending = false;
            }
        }
    }

    /// The manager's tables as last synced.
    pub(crate) fn generation(&self) -> TableGeneration {
        TableGeneration::new(self.manager, self.generation)
    }

    /// The identity of the manager mirrored.
    #[cfg(test)]
    pub(crate) fn manager(&self) -> u64 {
        self.manager
    }

    /// The row generation the device's row of `slot` was copied at (0 out of range).
    pub(crate) fn row_generation(&self, slot: u32) -> u64 {
        self.slots
            .get(slot as usize)
            .map_or(0, |m| m.row_generation)
    }

    /// Checks that rows `(slot, row generation)` of `manager`, as `what` recorded them, are the
    /// ones the device holds (`StaleTables` otherwise).
    pub(crate) fn check_rows(
        &self,
        what: &'static str,
        manager: u64,
        mut rows: impl Iterator<Item = (u32, u64)>,
    ) -> Result<()> {
        if manager != self.manager {
            return Err(LserveError::StaleTables {
                what,
                reason: "made against another manager than the one this cache last synced with"
                    .into(),
            });
        }
        match rows.find(|&(slot, generation)| self.row_generation(slot) != generation) {
            Some((slot, _)) => Err(LserveError::StaleTables {
                what,
                reason: format!(
                    "slot {slot}'s block table changed since it was made (a reservation that \
                     opened a page, or the slot changed hands): plan the step again"
                ),
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SparsityConfig;
    use crate::geometry::ModelGeometry;
    use crate::head_pattern::HeadPattern;
    use crate::paging::PAD_PAGE;
    use proptest::prelude::*;

    fn manager(capacity: usize, slots: usize) -> KvCacheManager {
        let g = ModelGeometry::new(1, 2, 2, 64).unwrap();
        let config = SparsityConfig {
            page_tokens: 16,
            logical_page_tokens: 16,
            token_budget: 32,
            sink_tokens: 4,
            local_tokens: 16,
            ..SparsityConfig::default()
        };
        KvCacheManager::new(g, HeadPattern::all_dense(g), config, capacity, slots, 256).unwrap()
    }

    /// A device table built from `manager` and updated only through the mirror's copies.
    struct Device {
        mirror: TableMirror,
        tables: Vec<u32>,
        width: usize,
        resets: Vec<u32>,
    }

    impl Device {
        fn of(manager: &KvCacheManager) -> Self {
            Self {
                mirror: TableMirror::of(manager),
                tables: manager.device_block_tables().pages,
                width: manager.max_pages_per_seq(),
                resets: Vec::new(),
            }
        }

        /// Syncs; returns the copies made.
        fn sync(&mut self, manager: &KvCacheManager) -> Vec<RowCopy> {
            let mut copies = Vec::new();
            let (tables, width, resets) = (&mut self.tables, self.width, &mut self.resets);
            self.mirror
                .sync(manager, |c| {
                    copies.push(c);
                    match c {
                        RowCopy::Pages { slot, from, to } => {
                            let pages = manager.slot_owner(slot).unwrap().1.pages();
                            let row = slot as usize * width;
                            tables[row + from..row + to].copy_from_slice(&pages[from..to]);
                        }
                        RowCopy::Pad { slot, from, to } => {
                            let row = slot as usize * width;
                            tables[row + from..row + to].fill(PAD_PAGE);
                        }
                        RowCopy::ResetSelection { slot } => resets.push(slot),
                    }
                    Ok(())
                })
                .unwrap();
            copies
        }
    }

    #[test]
    fn a_reservation_that_opens_a_page_copies_only_its_new_entries() {
        let mut mgr = manager(16, 2);
        let (a, b) = (mgr.add_sequence().unwrap(), mgr.add_sequence().unwrap());
        mgr.reserve(a, 20).unwrap();
        mgr.reserve(b, 5).unwrap();
        let mut dev = Device::of(&mgr);
        // Within a page: nothing to copy.
        mgr.reserve(a, 12).unwrap();
        assert_eq!(dev.sync(&mgr), []);
        // Page 2 of `a` opens: one entry.
        mgr.reserve(a, 1).unwrap();
        assert_eq!(
            dev.sync(&mgr),
            [RowCopy::Pages {
                slot: 0,
                from: 2,
                to: 3
            }]
        );
        assert_eq!(dev.tables, mgr.device_block_tables().pages);
        assert!(dev.resets.is_empty());
        assert_eq!(dev.mirror.generation(), mgr.generation());
    }

    #[test]
    fn a_slot_that_changed_hands_is_rewritten_and_reset() {
        let mut mgr = manager(16, 2);
        let a = mgr.add_sequence().unwrap();
        mgr.reserve(a, 40).unwrap(); // 3 pages
        let mut dev = Device::of(&mgr);
        // Free + add without a sync in between: the new owner's row replaces the old one's.
        mgr.free_sequence(a).unwrap();
        let b = mgr.add_sequence().unwrap();
        mgr.reserve(b, 17).unwrap(); // 2 pages
        assert_eq!(mgr.slot(b).unwrap(), 0);
        assert_eq!(
            dev.sync(&mgr),
            [
                RowCopy::Pages {
                    slot: 0,
                    from: 0,
                    to: 2
                },
                RowCopy::Pad {
                    slot: 0,
                    from: 2,
                    to: 3
                },
                RowCopy::ResetSelection { slot: 0 },
            ]
        );
        assert_eq!(dev.tables, mgr.device_block_tables().pages);
        assert!(dev.mirror.selection_pending(&[0]));
    }

    #[test]
    fn another_manager_rewrites_every_row() {
        let mut mgr = manager(16, 2);
        let a = mgr.add_sequence().unwrap();
        mgr.reserve(a, 40).unwrap();
        let mut dev = Device::of(&mgr);
        dev.mirror.selected(&[0]);
        // A clone holds the same tables but is another manager: its sequence ids mean nothing to
        // this mirror, so every occupied slot is rewritten and reset.
        let other = mgr.clone();
        assert_eq!(dev.sync(&other).len(), 2);
        assert_eq!(dev.resets, [0]);
        assert_eq!(dev.tables, other.device_block_tables().pages);
        assert_eq!(dev.mirror.manager(), other.id());
    }

    #[test]
    fn rows_recorded_before_a_change_are_stale() {
        let mut mgr = manager(16, 2);
        let a = mgr.add_sequence().unwrap();
        mgr.reserve(a, 16).unwrap();
        let mut dev = Device::of(&mgr);
        let slot = mgr.slot(a).unwrap();
        let recorded = (slot, mgr.row_generation(slot));
        assert!(dev
            .mirror
            .check_rows("batch", mgr.id(), [recorded].into_iter())
            .is_ok());
        mgr.reserve(a, 1).unwrap(); // opens page 1
        dev.sync(&mgr);
        assert!(matches!(
            dev.mirror
                .check_rows("batch", mgr.id(), [recorded].into_iter()),
            Err(LserveError::StaleTables { what: "batch", .. })
        ));
        assert!(matches!(
            dev.mirror.check_rows(
                "batch",
                mgr.clone().id(),
                [(slot, mgr.row_generation(slot))].into_iter()
            ),
            Err(LserveError::StaleTables { .. })
        ));
    }

    #[test]
    fn the_device_counter_follows_the_manager() {
        let mut mgr = manager(16, 1);
        let a = mgr.add_sequence().unwrap();
        mgr.reserve(a, 16).unwrap();
        let mut dev = Device::of(&mgr);
        assert_eq!(dev.mirror.follow_step(0, 0), None);
        // A step's advance on both sides: nothing to write.
        dev.mirror.advanced(&[0]);
        mgr.advance_decode_step(a).unwrap();
        assert_eq!(dev.mirror.follow_step(0, mgr.decode_step(a).unwrap()), None);
        // The manager advanced alone: the device takes its value.
        mgr.advance_decode_step(a).unwrap();
        assert_eq!(
            dev.mirror.follow_step(0, mgr.decode_step(a).unwrap()),
            Some(2)
        );
        assert_eq!(dev.mirror.follow_step(0, 2), None);
        // The device advanced alone (a step that was not finished on the host): back to the
        // manager's.
        dev.mirror.advanced(&[0]);
        assert_eq!(dev.mirror.follow_step(0, 2), Some(2));
    }

    proptest! {
        /// Whatever the manager does between syncs, the incrementally updated device table is
        /// the manager's whole table, and a slot is reset exactly when it changed hands.
        #[test]
        fn incremental_copies_rebuild_the_whole_table(
            ops in prop::collection::vec((0u8..4, 0usize..4, 1usize..40), 1..60),
        ) {
            let mut mgr = manager(24, 4);
            let mut dev = Device::of(&mgr);
            let mut live: Vec<SeqId> = Vec::new();
            for (op, pick, n) in ops {
                match op {
                    0 => {
                        if let Ok(s) = mgr.add_sequence() {
                            live.push(s);
                        }
                    }
                    1 if !live.is_empty() => {
                        let s = live.remove(pick % live.len());
                        mgr.free_sequence(s).unwrap();
                    }
                    2 if !live.is_empty() => {
                        let _ = mgr.reserve(live[pick % live.len()], n);
                    }
                    _ => {
                        let owners: Vec<_> = (0..4).map(|s| dev.mirror.slots[s].owner).collect();
                        dev.resets.clear();
                        dev.sync(&mgr);
                        prop_assert_eq!(&dev.tables, &mgr.device_block_tables().pages);
                        for slot in 0..4u32 {
                            let now = mgr.slot_owner(slot).map(|(s, _)| s);
                            let changed = now.is_some() && now != owners[slot as usize];
                            prop_assert_eq!(dev.resets.contains(&slot), changed);
                        }
                    }
                }
            }
        }
    }
}
