//! The sparsity configuration (LServe's defaults) and how GQA groups share a page selection.

use crate::error::{LserveError, Result};
use crate::quant::StatsFormat;

/// How the query heads of one KV group combine their page scores into the group's one selection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GqaAggregation {
    /// Maximum over the group's query heads (LServe's default).
    #[default]
    Max,
    /// Mean over the group's query heads.
    Mean,
}

/// What a page selection picks: whole physical pages (LServe), or logical pages inside them.
///
/// The candidates, the top-K and the index entries are in units of the chosen kind:
/// `K = token_budget / unit_tokens` units besides the always-attended first and newest unit
/// ([`SparsityConfig::unit_tokens`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SelectionUnit {
    /// Physical pages of `page_tokens` (`N_P`) tokens, each scored by the max over its logical
    /// pages (LServe's hierarchical paging; the default).
    #[default]
    PhysicalPage,
    /// Logical pages of `logical_page_tokens` (`N_L`) tokens, each scored by its own statistics:
    /// the selection of flat `N_L`-token pages (Quest's) over the same `N_P`-token physical
    /// layout and bytes. An index entry then lists logical-page ids, `physical * (N_P / N_L) +
    /// sub` ([`SparsityConfig::unit_id`]).
    LogicalPage,
}

/// Every knob of LServe's sparse attention. The fields are public; call [`validate`] (every
/// constructor taking a config does) before use.
///
/// Token counts are `usize`; validation also checks they fit the device's `u32` layouts.
///
/// ```
/// use lserve::config::{GqaAggregation, SparsityConfig};
/// let c = SparsityConfig::default();
/// assert_eq!((c.sink_tokens, c.local_tokens, c.token_budget), (64, 256, 4096));
/// assert_eq!(c.pages_per_selection(), 64);
/// assert_eq!(c.logical_per_page(), 4);
/// assert_eq!(c.gqa_aggregation, GqaAggregation::Max);
/// c.validate()?;
/// let bad = SparsityConfig { token_budget: 100, ..c };
/// assert!(bad.validate().is_err()); // not a multiple of page_tokens
/// # Ok::<(), lserve::LserveError>(())
/// ```
///
/// [`validate`]: SparsityConfig::validate
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SparsityConfig {
    /// Attention-sink tokens a streaming head keeps from the start of the sequence (may be 0).
    pub sink_tokens: usize,
    /// Most recent tokens a streaming head keeps (the ring; must be > 0).
    pub local_tokens: usize,
    /// Tokens a dense head attends to at decode once page selection is on (a multiple of
    /// `page_tokens`).
    pub token_budget: usize,
    /// Tokens per physical page (`N_P`): the unit of storage and of loading.
    pub page_tokens: usize,
    /// Tokens per logical page (`N_L`): the unit of key statistics; divides `page_tokens`.
    pub logical_page_tokens: usize,
    /// Reuse interval `C`: page selection runs on decode steps `0, C, 2C, ...` (`C >= 1`).
    pub reuse_interval: usize,
    /// Dense heads attend to every token while the sequence length `L <= dynamic_min_len`,
    /// and to selected pages beyond.
    pub dynamic_min_len: usize,
    /// How a KV group combines its query heads' page scores.
    pub gqa_aggregation: GqaAggregation,
    /// Whether page 0 (the attention sink) is always attended at decode, beside the top-K.
    pub always_include_first_page: bool,
    /// Softmax scale; `None` means `1 / sqrt(head_dim)`.
    pub softmax_scale: Option<f32>,
    /// The key statistics page selection scores from: 16-bit, or their 8-bit codes
    /// ([`StatsFormat`]).
    pub stats_format: StatsFormat,
    /// Whether selection picks physical or logical pages ([`SelectionUnit`]).
    pub selection_unit: SelectionUnit,
}

impl Default for SparsityConfig {
    /// LServe's defaults: sinks 64, local 256, budget 4096, `N_P` 64, `N_L` 16, `C` 4,
    /// `dynamic_min_len` 8192 (`2 * token_budget`), max aggregation, first page always included,
    /// scale `1/sqrt(D)`, 16-bit statistics, physical pages selected.
    fn default() -> Self {
        Self {
            sink_tokens: 64,
            local_tokens: 256,
            token_budget: 4096,
            page_tokens: 64,
            logical_page_tokens: 16,
            reuse_interval: 4,
            dynamic_min_len: 8192,
            gqa_aggregation: GqaAggregation::Max,
            always_include_first_page: true,
            softmax_scale: None,
            stats_format: StatsFormat::Half,
            selection_unit: SelectionUnit::PhysicalPage,
        }
    }
}

impl SparsityConfig {
    /// Checks every rule: `page_tokens > 0`; `logical_page_tokens > 0` and divides
    /// `page_tokens`; `token_budget > 0` and a multiple of `page_tokens`; `local_tokens > 0`
    /// (`sink_tokens` may be 0); `reuse_interval >= 1`; an explicit softmax scale finite and
    /// `> 0`; token counts (and `sink_tokens + local_tokens`) fit in `u32`.
    pub fn validate(&self) -> Result<()> {
        let fits = |field: &'static str, v: usize| -> Result<()> {
            if u32::try_from(v).is_err() {
                return Err(invalid(field, format!("{v} does not fit in u32")));
            }
            Ok(())
        };
        fits("sink_tokens", self.sink_tokens)?;
        fits("local_tokens", self.local_tokens)?;
        fits("token_budget", self.token_budget)?;
        fits("page_tokens", self.page_tokens)?;
        fits("dynamic_min_len", self.dynamic_min_len)?;
        if self.page_tokens == 0 {
            return Err(invalid("page_tokens", "must be > 0".into()));
        }
        if self.logical_page_tokens == 0 {
            return Err(invalid("logical_page_tokens", "must be > 0".into()));
        }
        if self.page_tokens % self.logical_page_tokens != 0 {
            return Err(invalid(
                "logical_page_tokens",
                format!(
                    "{} does not divide page_tokens ({})",
                    self.logical_page_tokens, self.page_tokens
                ),
            ));
        }
        if self.token_budget == 0 {
            return Err(invalid("token_budget", "must be > 0".into()));
        }
        if self.token_budget % self.page_tokens != 0 {
            return Err(invalid(
                "token_budget",
                format!(
                    "{} is not a multiple of page_tokens ({})",
                    self.token_budget, self.page_tokens
                ),
            ));
        }
        if self.local_tokens == 0 {
            return Err(invalid("local_tokens", "must be > 0".into()));
        }
        fits("sink_tokens + local_tokens", self.streaming_rows())?;
        if self.reuse_interval == 0 {
            return Err(invalid("reuse_interval", "must be >= 1".into()));
        }
        if let Some(s) = self.softmax_scale {
            if !(s.is_finite() && s > 0.0) {
                return Err(invalid(
                    "softmax_scale",
                    format!("{s} is not finite and > 0"),
                ));
            }
        }
        Ok(())
    }

    /// Tokens of one selection unit: `page_tokens` for [`SelectionUnit::PhysicalPage`],
    /// `logical_page_tokens` for [`SelectionUnit::LogicalPage`].
    pub const fn unit_tokens(&self) -> usize {
        match self.selection_unit {
            SelectionUnit::PhysicalPage => self.page_tokens,
            SelectionUnit::LogicalPage => self.logical_page_tokens,
        }
    }

    /// Selection units per physical page: 1 for physical pages, `N_P / N_L` for logical ones.
    ///
    /// Returns 0 for a config whose unit is 0 tokens (which `validate` rejects).
    pub const fn units_per_page(&self) -> usize {
        match self.page_tokens.checked_div(self.unit_tokens()) {
            Some(u) => u,
            None => 0,
        }
    }

    /// Logical pages per selection unit: `N_P / N_L` for physical pages, 1 for logical ones.
    pub const fn logical_per_unit(&self) -> usize {
        match self.selection_unit {
            SelectionUnit::PhysicalPage => self.logical_per_page(),
            SelectionUnit::LogicalPage => 1,
        }
    }

    /// Selection units a sequence of `len` tokens has (`ceil(len / unit_tokens)`).
    ///
    /// Returns 0 for a config whose unit is 0 tokens (which `validate` rejects).
    pub const fn units_for_len(&self, len: usize) -> usize {
        match self.unit_tokens() {
            0 => 0,
            u => len.div_ceil(u),
        }
    }

    /// The index-entry id of unit `sub` of physical page `physical`:
    /// `physical * units_per_page + sub` (the page id itself for physical units), saturating at
    /// `u32::MAX` (tables for a manager hold ids below `capacity * units_per_page`, checked to
    /// fit `u32` by [`IndexTables::for_manager`](crate::index_table::IndexTables::for_manager)).
    ///
    /// ```
    /// use lserve::config::{SelectionUnit, SparsityConfig};
    /// let c = SparsityConfig { selection_unit: SelectionUnit::LogicalPage, ..Default::default() };
    /// assert_eq!((c.unit_tokens(), c.units_per_page()), (16, 4));
    /// assert_eq!(c.unit_id(7, 2), 30);
    /// assert_eq!(c.pages_per_selection(), 256); // 4096 tokens of 16-token units
    /// ```
    pub const fn unit_id(&self, physical: u32, sub: u32) -> u32 {
        physical
            .saturating_mul(self.units_per_page() as u32)
            .saturating_add(sub)
    }

    /// Units a selection picks (`K = token_budget / unit_tokens`: physical pages, or logical
    /// pages under [`SelectionUnit::LogicalPage`]), besides the always-included newest (and
    /// first) unit.
    ///
    /// Returns 0 for a config whose unit is 0 tokens (which `validate` rejects).
    pub const fn pages_per_selection(&self) -> usize {
        match self.token_budget.checked_div(self.unit_tokens()) {
            Some(k) => k,
            None => 0,
        }
    }

    /// Units a held selection holds at most: the `K` selected, the first unit (when always
    /// included) and the newest unit at selection time (`K + 2`).
    ///
    /// Saturates at `usize::MAX` for a `K` so large (a config `validate` rejects) that `K + 2`
    /// overflows.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// let c = SparsityConfig::default(); // budget 4096, 64-token pages: K = 64
    /// assert_eq!(c.held_selection_pages(), 66);
    /// assert_eq!(c.selection_entry_pages(), 67);
    /// ```
    pub const fn held_selection_pages(&self) -> usize {
        self.pages_per_selection().saturating_add(2)
    }

    /// Units an index-table entry lists at most in selection mode: the held selection and, on a
    /// reused step, a newer newest unit (`K + 3`).
    ///
    /// Saturates at `usize::MAX`, as [`held_selection_pages`](Self::held_selection_pages).
    pub const fn selection_entry_pages(&self) -> usize {
        self.held_selection_pages().saturating_add(1)
    }

    /// Logical pages per physical page (`g = N_P / N_L`).
    ///
    /// Returns 0 for a config with `logical_page_tokens == 0` (which `validate` rejects).
    pub const fn logical_per_page(&self) -> usize {
        match self.page_tokens.checked_div(self.logical_page_tokens) {
            Some(g) => g,
            None => 0,
        }
    }

    /// Rows a streaming head keeps per sequence (`sink_tokens + local_tokens`).
    ///
    /// Saturates at `usize::MAX` for a sum that overflows (a config `validate` rejects: the sum
    /// must fit `u32`).
    pub const fn streaming_rows(&self) -> usize {
        self.sink_tokens.saturating_add(self.local_tokens)
    }

    /// Physical pages a sequence of `len` tokens occupies (`ceil(len / page_tokens)`).
    ///
    /// Returns 0 for a config with `page_tokens == 0` (which `validate` rejects).
    pub const fn pages_for_len(&self, len: usize) -> usize {
        if self.page_tokens == 0 {
            0
        } else {
            len.div_ceil(self.page_tokens)
        }
    }

    /// The softmax scale to use for `head_dim`: the explicit one, else `1 / sqrt(head_dim)`.
    pub fn softmax_scale_for(&self, head_dim: usize) -> f32 {
        self.softmax_scale
            .unwrap_or_else(|| 1.0 / (head_dim as f32).sqrt())
    }

    /// Whether a dense head of a sequence of length `len` (after the step's token) uses page
    /// selection (`len > dynamic_min_len`) rather than attending to every token.
    pub const fn uses_page_selection(&self, len: usize) -> bool {
        len > self.dynamic_min_len
    }

    /// Whether page selection runs on decode step `step` (`step % reuse_interval == 0`); in
    /// between the held selection is reused (see `docs/ARCHITECTURE.md`, "Reuse").
    /// A `reuse_interval` of 0 (which `validate` rejects) is treated as 1.
    pub const fn is_selection_step(&self, step: u64) -> bool {
        let c = if self.reuse_interval == 0 {
            1
        } else {
            self.reuse_interval as u64
        };
        step % c == 0
    }

    /// Whether a sequence of length `len` (after the step's token) selects pages at decode step
    /// `step`: it uses page selection, and either `step` is a selection step or the previous
    /// step's length did not use selection (nothing is held yet). This is the device's rule
    /// (`lserve_abi::select::selection_due`) for a sequence that decodes one token per step from
    /// step 0, as [`KvCacheManager`](crate::paging::KvCacheManager) counts them.
    ///
    /// ```
    /// use lserve::config::SparsityConfig;
    /// let c = SparsityConfig { dynamic_min_len: 100, reuse_interval: 4, ..Default::default() };
    /// assert!(!c.selects_at(100, 0)); // dense decode
    /// assert!(c.selects_at(101, 5)); // first step past dynamic_min_len
    /// assert!(!c.selects_at(102, 6)); // reuse
    /// assert!(c.selects_at(103, 8)); // every 4th step
    /// ```
    pub const fn selects_at(&self, len: usize, step: u64) -> bool {
        self.uses_page_selection(len)
            && (self.is_selection_step(step) || !self.uses_page_selection(len.saturating_sub(1)))
    }
}

fn invalid(field: &'static str, reason: String) -> LserveError {
    LserveError::InvalidConfig { field, reason }
}
