//! Index tables: the pages each dense KV head of each sequence visits at decode.
//!
//! An entry lists the config's selection units ([`SelectionUnit`](crate::config::SelectionUnit)):
//! physical page ids, or with logical-page selection logical-page ids `physical *
//! units_per_page + sub` ([`SparsityConfig::unit_id`]), in ascending sequence order.
//!
//! The decode kernel reads only these tables (the sparsity pattern is data). They are
//! device-shaped: per layer, `pages [slots][Hd][entry_capacity]` (`u32`, [`PAD_PAGE`] past each
//! entry's length) and `lens [slots][Hd]`, where `Hd` is that layer's dense head count and the
//! head coordinate is the compact dense index ([`HeadPattern::dense_index`]).

use crate::config::SparsityConfig;
use crate::error::{checked_elements, LserveError, Result};
use crate::head_pattern::HeadPattern;
use crate::paging::{KvCacheManager, PageId, PAD_PAGE};

/// One layer's index table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerIndexTable {
    slots: usize,
    heads: usize,
    entry_capacity: usize,
    pages: Vec<u32>,
    lens: Vec<u32>,
}

impl LayerIndexTable {
    /// Sequence slots (rows).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Dense heads of the layer.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Page ids an entry can hold.
    pub fn entry_capacity(&self) -> usize {
        self.entry_capacity
    }

    /// `[slots][heads][entry_capacity]` page ids (for upload).
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    /// `[slots][heads]` entry lengths (for upload).
    pub fn lens(&self) -> &[u32] {
        &self.lens
    }

    fn entry(&self, slot: usize, head: usize) -> usize {
        slot * self.heads + head
    }
}

/// Per layer, per (sequence slot, dense KV head): the physical pages a decode step visits.
///
/// ```
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::HeadPattern;
/// use lserve::index_table::IndexTables;
/// let g = ModelGeometry::new(2, 4, 4, 64)?;
/// let pattern = HeadPattern::interleaved(g, 0.5)?; // 2 dense heads per layer
/// let mut t = IndexTables::new(&pattern, 3, 4, 100)?; // 3 slots, 4 pages per entry, pool of 100
/// t.set(1, 2, 0, &[17, 3, 99])?;
/// assert_eq!(t.get(1, 2, 0)?, &[17, 3, 99]);
/// assert!(t.set(1, 2, 0, &[100]).is_err()); // page out of range
/// assert!(t.set(1, 2, 0, &[1, 2, 3, 4, 5]).is_err()); // too many
/// assert!(t.set(1, 2, 0, &[5, 5]).is_err()); // duplicate
/// assert_eq!(t.get(1, 2, 0)?, &[17, 3, 99]); // unchanged by the failures
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexTables {
    pool_capacity: usize,
    /// Selection units per physical page: ids are checked against `pool_capacity` times it.
    units_per_page: usize,
    layers: Vec<LayerIndexTable>,
}

impl IndexTables {
    /// Empty tables for every layer of `pattern`: `slots` sequence slots, `entry_capacity` page
    /// ids per entry, page ids checked against `pool_capacity` (physical-page units; tables for
    /// a manager's config come from [`for_manager`](Self::for_manager)). All sizes must be in
    /// `1..=u32::MAX`, and a layer's `slots x dense heads x entry_capacity` must not overflow
    /// (`InvalidConfig`).
    pub fn new(
        pattern: &HeadPattern,
        slots: usize,
        entry_capacity: usize,
        pool_capacity: usize,
    ) -> Result<Self> {
        for (field, v) in [
            ("slots", slots),
            ("entry_capacity", entry_capacity),
            ("pool_capacity", pool_capacity),
        ] {
            if v == 0 || u32::try_from(v).is_err() {
                return Err(LserveError::InvalidConfig {
                    field,
                    reason: format!("{v} is not in 1..=u32::MAX"),
                });
            }
        }
        // Every layer's size is checked before anything is allocated.
        let sizes = (0..pattern.geometry().layers())
            .map(|layer| {
                let heads = pattern.dense_heads(layer);
                checked_elements::<u32>(&[slots, heads, entry_capacity])
                    .map(|pages| (heads, pages))
                    .ok_or_else(|| LserveError::InvalidConfig {
                        field: "entry_capacity",
                        reason: format!(
                            "{slots} slots x {heads} dense heads x {entry_capacity} pages overflows"
                        ),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let layers = sizes
            .into_iter()
            .map(|(heads, pages)| LayerIndexTable {
                slots,
                heads,
                entry_capacity,
                pages: vec![PAD_PAGE; pages],
                lens: vec![0; slots * heads],
            })
            .collect();
        Ok(Self {
            pool_capacity,
            units_per_page: 1,
            layers,
        })
    }

    /// Tables shaped for `manager` (its pattern, slots and pool), with `entry_capacity`
    /// from [`entry_capacity_for`](Self::entry_capacity_for), listing its config's selection
    /// units (ids below the pool capacity times [`units_per_page`](Self::units_per_page)).
    pub fn for_manager(manager: &KvCacheManager) -> Result<Self> {
        let config = manager.config();
        let cap = Self::entry_capacity_for(config, manager.max_seq_len());
        let units_per_page = config.units_per_page();
        let pool_capacity = manager.pool().capacity();
        if pool_capacity
            .checked_mul(units_per_page)
            .and_then(|n| u32::try_from(n).ok())
            .is_none()
        {
            return Err(LserveError::InvalidConfig {
                field: "selection_unit",
                reason: format!(
                    "{pool_capacity} pages x {units_per_page} units per page do not fit u32 ids"
                ),
            });
        }
        Ok(Self {
            units_per_page,
            ..Self::new(
                manager.pattern(),
                manager.max_sequences(),
                cap,
                pool_capacity,
            )?
        })
    }

    /// Selection units per physical page the entries list (1: physical page ids).
    pub fn units_per_page(&self) -> usize {
        self.units_per_page
    }

    /// Units (pages, or logical pages: [`SparsityConfig::unit_tokens`]) an entry needs for
    /// sequences up to `max_seq_len`: every unit while the length is at most `dynamic_min_len`
    /// (dense decode), else the `K` selected units plus the first, the newest at selection time
    /// and, on a reused step, the current newest (`K + 3`); never more than the units of
    /// `ceil(max_seq_len / page_tokens)` pages.
    pub fn entry_capacity_for(config: &SparsityConfig, max_seq_len: usize) -> usize {
        let all = config
            .pages_for_len(max_seq_len)
            .saturating_mul(config.units_per_page());
        let dense = config.units_for_len(config.dynamic_min_len.min(max_seq_len));
        let selected = config.selection_entry_pages();
        dense.max(selected).min(all).max(1)
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// The pool capacity page ids are checked against.
    pub fn pool_capacity(&self) -> usize {
        self.pool_capacity
    }

    /// Layer `layer`'s table (`InvalidArgument` if out of range).
    pub fn layer(&self, layer: usize) -> Result<&LayerIndexTable> {
        self.layers
            .get(layer)
            .ok_or_else(|| LserveError::InvalidArgument {
                what: "layer",
                reason: format!("{layer} is not below {}", self.layers.len()),
            })
    }

    fn locate(&self, layer: usize, slot: usize, dense_head: usize) -> Result<(usize, usize)> {
        let t = self.layer(layer)?;
        if slot >= t.slots {
            return Err(LserveError::InvalidArgument {
                what: "slot",
                reason: format!("{slot} is not below {}", t.slots),
            });
        }
        if dense_head >= t.heads {
            return Err(LserveError::InvalidArgument {
                what: "dense head",
                reason: format!("{dense_head} is not below {} (layer {layer})", t.heads),
            });
        }
        Ok((layer, t.entry(slot, dense_head)))
    }

    /// Sets the pages of (`layer`, `slot`, `dense_head`). Every id must be below the pool
    /// capacity (`PageOutOfRange`), none repeated, at most `entry_capacity` of them
    /// (`InvalidArgument`); on error the entry is unchanged. Order is kept as given
    /// (ARCHITECTURE.md: ascending logical page order).
    pub fn set(
        &mut self,
        layer: usize,
        slot: usize,
        dense_head: usize,
        pages: &[PageId],
    ) -> Result<()> {
        let (layer, entry) = self.locate(layer, slot, dense_head)?;
        let t = &self.layers[layer];
        if pages.len() > t.entry_capacity {
            return Err(LserveError::InvalidArgument {
                what: "index table entry",
                reason: format!("{} pages, capacity {}", pages.len(), t.entry_capacity),
            });
        }
        self.check_entry(pages)?;
        let t = &mut self.layers[layer];
        let row = &mut t.pages[entry * t.entry_capacity..(entry + 1) * t.entry_capacity];
        row[..pages.len()].copy_from_slice(pages);
        row[pages.len()..].fill(PAD_PAGE);
        t.lens[entry] = pages.len() as u32;
        Ok(())
    }

    /// Replaces a whole layer's table from device-shaped buffers (e.g. downloaded from the
    /// GPU): `pages [slots][Hd][entry_capacity]`, `lens [slots][Hd]`. Every entry is checked as
    /// [`set`](Self::set) checks it (length, ids in range, no repeats); ids past an entry's
    /// length are ignored and stored as [`PAD_PAGE`]. On error nothing changes.
    pub fn overwrite_layer(&mut self, layer: usize, pages: &[u32], lens: &[u32]) -> Result<()> {
        let t = self.layer(layer)?;
        let (entries, cap) = (t.slots * t.heads, t.entry_capacity);
        if pages.len() != entries * cap {
            return Err(LserveError::ShapeMismatch {
                what: "index table pages",
                expected: entries * cap,
                actual: pages.len(),
            });
        }
        if lens.len() != entries {
            return Err(LserveError::ShapeMismatch {
                what: "index table lens",
                expected: entries,
                actual: lens.len(),
            });
        }
        for (e, &len) in lens.iter().enumerate() {
            let len = len as usize;
            if len > cap {
                return Err(LserveError::InvalidArgument {
                    what: "index table entry",
                    reason: format!("entry {e}: {len} pages, capacity {cap}"),
                });
            }
            self.check_entry(&pages[e * cap..e * cap + len])?;
        }
        let t = &mut self.layers[layer];
        for (e, &len) in lens.iter().enumerate() {
            let (row, src) = (
                &mut t.pages[e * cap..(e + 1) * cap],
                &pages[e * cap..(e + 1) * cap],
            );
            row[..len as usize].copy_from_slice(&src[..len as usize]);
            row[len as usize..].fill(PAD_PAGE);
        }
        t.lens.copy_from_slice(lens);
        Ok(())
    }

    /// The id bound: ids are below it.
    fn id_bound(&self) -> usize {
        self.pool_capacity * self.units_per_page
    }

    /// Checks ids in range and not repeated.
    fn check_entry(&self, pages: &[PageId]) -> Result<()> {
        if let Some(&page) = pages.iter().find(|&&p| p as usize >= self.id_bound()) {
            return Err(LserveError::PageOutOfRange {
                page,
                capacity: self.id_bound() as u32,
            });
        }
        let mut sorted = pages.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(LserveError::InvalidArgument {
                what: "index table entry",
                reason: format!("page {} listed twice", w[0]),
            });
        }
        Ok(())
    }

    /// Checks that these tables may be uploaded beside `manager`'s block tables
    /// (`DeviceKvCache::upload` calls it before anything is allocated): shaped for it (its
    /// layers, slots and each layer's dense heads, one entry capacity in every layer), every
    /// listed page below the manager's pool capacity (`PageOutOfRange`), and every listed page
    /// (the physical page of every listed logical-page id) one of the pages of the sequence in
    /// that slot, per its block table (`PageNotOwned`; a
    /// slot no sequence holds lists none). The first bad entry is reported, by layer, slot,
    /// head, position.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::HeadPattern;
    /// use lserve::index_table::IndexTables;
    /// use lserve::paging::KvCacheManager;
    /// use lserve::LserveError;
    /// let g = ModelGeometry::new(1, 2, 2, 64)?;
    /// let pattern = HeadPattern::all_dense(g);
    /// let mut mgr = KvCacheManager::new(g, pattern, SparsityConfig::default(), 8, 2, 1024)?;
    /// let (a, b) = (mgr.add_sequence()?, mgr.add_sequence()?);
    /// mgr.reserve(a, 64)?;
    /// mgr.reserve(b, 64)?;
    /// let (page_a, page_b) = (mgr.block_table(a)?.pages()[0], mgr.block_table(b)?.pages()[0]);
    /// let mut t = IndexTables::for_manager(&mgr)?;
    /// t.set(0, 0, 0, &[page_a])?;
    /// assert!(t.check_against(&mgr).is_ok());
    /// t.set(0, 0, 1, &[page_b])?; // slot 0 holds `a`: `page_b` is another sequence's
    /// assert!(matches!(t.check_against(&mgr), Err(LserveError::PageNotOwned { slot: 0, .. })));
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn check_against(&self, manager: &KvCacheManager) -> Result<()> {
        let pattern = manager.pattern();
        let slots = manager.max_sequences();
        let capacity = manager.pool().capacity();
        let entry_capacity = self.layers.first().map_or(0, |t| t.entry_capacity);
        if self.layers.len() != pattern.geometry().layers() {
            return Err(LserveError::InvalidArgument {
                what: "index tables",
                reason: format!(
                    "{} layers, the manager's model has {}",
                    self.layers.len(),
                    pattern.geometry().layers()
                ),
            });
        }
        if self.units_per_page != manager.config().units_per_page() {
            return Err(LserveError::InvalidArgument {
                what: "index tables",
                reason: format!(
                    "they list {} units per page, the manager's config {}",
                    self.units_per_page,
                    manager.config().units_per_page()
                ),
            });
        }
        // The slot each page of the pool belongs to (`u32::MAX`: none).
        let mut owner_of = vec![u32::MAX; capacity];
        for slot in 0..slots as u32 {
            if let Some((_, table)) = manager.slot_owner(slot) {
                for &page in table.pages() {
                    if let Some(owner) = owner_of.get_mut(page as usize) {
                        *owner = slot;
                    }
                }
            }
        }
        for (layer, t) in self.layers.iter().enumerate() {
            if t.slots != slots
                || t.heads != pattern.dense_heads(layer)
                || t.entry_capacity != entry_capacity
            {
                return Err(LserveError::InvalidArgument {
                    what: "index tables",
                    reason: format!(
                        "layer {layer} is {} slots x {} dense heads x {} pages; the manager \
                         needs {slots} x {} x the first layer's {entry_capacity}",
                        t.slots,
                        t.heads,
                        t.entry_capacity,
                        pattern.dense_heads(layer)
                    ),
                });
            }
            for slot in 0..slots {
                for head in 0..t.heads {
                    let e = t.entry(slot, head);
                    let start = e * t.entry_capacity;
                    for &page in &t.pages[start..start + t.lens[e] as usize] {
                        let physical = page as usize / self.units_per_page;
                        let Some(&owner) = owner_of.get(physical) else {
                            return Err(LserveError::PageOutOfRange {
                                page,
                                capacity: capacity as u32,
                            });
                        };
                        if owner != slot as u32 {
                            return Err(LserveError::PageNotOwned {
                                page,
                                slot: slot as u32,
                            });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The pages of (`layer`, `slot`, `dense_head`).
    pub fn get(&self, layer: usize, slot: usize, dense_head: usize) -> Result<&[PageId]> {
        let (layer, entry) = self.locate(layer, slot, dense_head)?;
        let t = &self.layers[layer];
        let start = entry * t.entry_capacity;
        Ok(&t.pages[start..start + t.lens[entry] as usize])
    }

    /// Empties (`layer`, `slot`, `dense_head`).
    pub fn clear(&mut self, layer: usize, slot: usize, dense_head: usize) -> Result<()> {
        self.set(layer, slot, dense_head, &[])
    }

    /// Empties every entry of `slot` in every layer (e.g. when its sequence ends).
    pub fn clear_slot(&mut self, slot: usize) -> Result<()> {
        let slots = self.layers.first().map_or(0, |t| t.slots);
        if slot >= slots {
            return Err(LserveError::InvalidArgument {
                what: "slot",
                reason: format!("{slot} is not below {slots}"),
            });
        }
        for t in &mut self.layers {
            let (heads, cap) = (t.heads, t.entry_capacity);
            t.pages[slot * heads * cap..(slot + 1) * heads * cap].fill(PAD_PAGE);
            t.lens[slot * heads..(slot + 1) * heads].fill(0);
        }
        Ok(())
    }
}
