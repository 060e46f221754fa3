//! Static (head-level) sparsity: which (layer, KV head) is dense and which is streaming.
//!
//! A pattern comes from DuoAttention's gating values (`full_attention_heads.tsv`, from a file or
//! one of the published files embedded in lserve, [`PublishedGating`]) and a target streaming
//! fraction, from calibration activations without training ([`Calibration`],
//! [`HeadPattern::from_calibration`]), from explicit per-layer kinds, or from a deterministic
//! synthetic default.
//! All query heads of a KV group follow their KV head.
//!
//! Per layer, the dense heads and the streaming heads each get a *compact index* (their rank
//! among that layer's heads of the same kind, in ascending KV-head order): it is the `head`
//! coordinate of the dense page pool and of the streaming store (`docs/ARCHITECTURE.md`).

use std::path::Path;

mod calibration;

pub use calibration::{Calibration, CalibrationScore};

use crate::error::{LserveError, Result};
use crate::geometry::ModelGeometry;

/// Whether a KV head attends densely (retrieval head) or with the Λ mask (streaming head).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HeadKind {
    /// Attends to the whole context (causal at prefill, page selection at long decode).
    Dense,
    /// Attends to the sink tokens and the last `local_tokens` tokens (the Λ mask).
    Streaming,
}

/// The kind of every (layer, KV head) of a model, with per-layer compact indices.
///
/// Query methods take indices the caller got from the same geometry and panic (like slice
/// indexing) when `layer >= layers` or `kv_head >= kv_heads` (each says so under `# Panics`);
/// [`layers`](Self::layers) and [`geometry`](Self::geometry) give the bounds.
///
/// ```
/// use lserve::geometry::ModelGeometry;
/// use lserve::head_pattern::{HeadKind, HeadPattern};
/// let g = ModelGeometry::new(2, 8, 4, 64)?;
/// // Layer 0: gating values 0.9 0.1 0.5 0.2; layer 1: 0.0 0.8 0.3 0.7.
/// let tsv = "0.9\t0.1\t0.5\t0.2\n0.0\t0.8\t0.3\t0.7\n";
/// let p = HeadPattern::from_gating_tsv(tsv, g, 0.5)?;
/// // The 4 lowest alphas (0.0, 0.1, 0.2, 0.3) are streaming.
/// assert_eq!(p.kind(0, 1), HeadKind::Streaming);
/// assert_eq!(p.kind(0, 2), HeadKind::Dense);
/// assert_eq!(p.streaming_heads(0), 2);
/// assert_eq!(p.dense_kv_heads(1), &[1, 3]);
/// assert_eq!(p.compact_index(1, 3), 1); // second dense head of layer 1
/// assert_eq!(p.dense_kv_head(1, 1), 3);
/// assert_eq!(p.streaming_fraction(), 0.5);
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadPattern {
    geometry: ModelGeometry,
    /// `[layer][kv_head]`.
    kinds: Vec<Vec<HeadKind>>,
    /// `[layer][kv_head]`: rank among the layer's heads of the same kind.
    compact: Vec<Vec<usize>>,
    /// `[layer]`: the dense KV heads, ascending.
    dense: Vec<Vec<usize>>,
    /// `[layer]`: the streaming KV heads, ascending.
    streaming: Vec<Vec<usize>>,
}

impl HeadPattern {
    /// Builds a pattern from explicit kinds, `kinds[layer][kv_head]`; the shape must match the
    /// geometry (`HeadPattern` error otherwise).
    pub fn from_kinds(geometry: ModelGeometry, kinds: Vec<Vec<HeadKind>>) -> Result<Self> {
        if kinds.len() != geometry.layers() {
            return Err(LserveError::HeadPattern(format!(
                "{} layers given, geometry has {}",
                kinds.len(),
                geometry.layers()
            )));
        }
        if let Some((layer, row)) = kinds
            .iter()
            .enumerate()
            .find(|(_, row)| row.len() != geometry.kv_heads())
        {
            return Err(LserveError::HeadPattern(format!(
                "layer {layer}: {} KV heads given, geometry has {}",
                row.len(),
                geometry.kv_heads()
            )));
        }
        let mut compact = Vec::with_capacity(kinds.len());
        let mut dense = Vec::with_capacity(kinds.len());
        let mut streaming = Vec::with_capacity(kinds.len());
        for row in &kinds {
            let (mut d, mut s) = (Vec::new(), Vec::new());
            let c = row
                .iter()
                .enumerate()
                .map(|(h, kind)| {
                    let list = match kind {
                        HeadKind::Dense => &mut d,
                        HeadKind::Streaming => &mut s,
                    };
                    list.push(h);
                    list.len() - 1
                })
                .collect();
            compact.push(c);
            dense.push(d);
            streaming.push(s);
        }
        Ok(Self {
            geometry,
            kinds,
            compact,
            dense,
            streaming,
        })
    }

    /// The pattern of tensor-parallel shard `rank` of `ranks` (the heads of
    /// [`ModelGeometry::shard`]): per layer, the kinds of the shard's KV heads `r · kv_heads /
    /// ranks ..`, in order. KV head `h` of the shard is KV head `rank · kv_heads / ranks + h` of
    /// the model.
    ///
    /// Errors: as [`ModelGeometry::shard`].
    ///
    /// ```
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::{HeadKind, HeadPattern};
    /// let g = ModelGeometry::new(1, 8, 4, 64)?;
    /// use HeadKind::{Dense, Streaming};
    /// let p = HeadPattern::from_kinds(g, vec![vec![Dense, Streaming, Streaming, Dense]])?;
    /// assert_eq!(p.shard(1, 2)?.layer_kinds(0), &[Streaming, Dense]);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn shard(&self, rank: usize, ranks: usize) -> Result<Self> {
        let geometry = self.geometry.shard(rank, ranks)?;
        let per_shard = geometry.kv_heads();
        let kinds = self
            .kinds
            .iter()
            .map(|row| row[rank * per_shard..][..per_shard].to_vec())
            .collect();
        Self::from_kinds(geometry, kinds)
    }

    /// Every head dense (no static sparsity).
    pub fn all_dense(geometry: ModelGeometry) -> Self {
        let kinds = vec![vec![HeadKind::Dense; geometry.kv_heads()]; geometry.layers()];
        Self::from_kinds(geometry, kinds).expect("shape matches the geometry by construction")
    }

    /// Builds a pattern from gating values `alpha[layer][kv_head]` and a streaming fraction
    /// `s` in `[0, 1]`.
    ///
    /// The `round(s * layers * kv_heads)` heads with the lowest alpha become streaming (a global
    /// quantile over all layers' heads; `round` is half away from zero). Ties are broken
    /// deterministically: heads are ranked by `(alpha, layer, kv_head)` ascending, so among equal
    /// alphas the lower layer, then the lower KV head, becomes streaming first. Alphas must be
    /// finite.
    pub fn from_gating_values(
        alpha: &[Vec<f64>],
        geometry: ModelGeometry,
        streaming_fraction: f64,
    ) -> Result<Self> {
        let n_streaming = streaming_count(geometry, streaming_fraction)?;
        if alpha.len() != geometry.layers() {
            return Err(LserveError::HeadPattern(format!(
                "{} layers of gating values, geometry has {}",
                alpha.len(),
                geometry.layers()
            )));
        }
        let mut ranked = Vec::with_capacity(geometry.total_kv_heads());
        for (layer, row) in alpha.iter().enumerate() {
            if row.len() != geometry.kv_heads() {
                return Err(LserveError::HeadPattern(format!(
                    "layer {layer}: {} gating values, geometry has {} KV heads",
                    row.len(),
                    geometry.kv_heads()
                )));
            }
            for (head, &a) in row.iter().enumerate() {
                if !a.is_finite() {
                    return Err(LserveError::HeadPattern(format!(
                        "layer {layer}, head {head}: gating value {a} is not finite"
                    )));
                }
                ranked.push((a, layer, head));
            }
        }
        ranked.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
        let mut kinds = vec![vec![HeadKind::Dense; geometry.kv_heads()]; geometry.layers()];
        for &(_, layer, head) in &ranked[..n_streaming] {
            kinds[layer][head] = HeadKind::Streaming;
        }
        Self::from_kinds(geometry, kinds)
    }

    /// Parses DuoAttention's `full_attention_heads.tsv` (one line per layer, tab-separated
    /// floats, one per KV head; blank lines ignored) and thresholds it as
    /// [`from_gating_values`](Self::from_gating_values) does.
    pub fn from_gating_tsv(
        text: &str,
        geometry: ModelGeometry,
        streaming_fraction: f64,
    ) -> Result<Self> {
        let alpha = parse_gating_tsv(text)?;
        Self::from_gating_values(&alpha, geometry, streaming_fraction)
    }

    /// Reads a gating file and calls [`from_gating_tsv`](Self::from_gating_tsv); a read
    /// failure is an `Io` error.
    pub fn from_gating_file(
        path: impl AsRef<Path>,
        geometry: ModelGeometry,
        streaming_fraction: f64,
    ) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| LserveError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_gating_tsv(&text, geometry, streaming_fraction)
    }

    /// A deterministic synthetic pattern with `round(fraction * layers * kv_heads)` streaming
    /// heads spread evenly: number the heads `i = layer * kv_heads + kv_head`; head `i` is
    /// streaming iff `floor((i + 1) * n / total) > floor(i * n / total)` (Bresenham spacing).
    /// At fraction 0.5 with an even `kv_heads`, this makes the odd KV heads of every layer
    /// streaming.
    pub fn interleaved(geometry: ModelGeometry, streaming_fraction: f64) -> Result<Self> {
        let n = streaming_count(geometry, streaming_fraction)?;
        let total = geometry.total_kv_heads();
        let kinds = (0..geometry.layers())
            .map(|layer| {
                (0..geometry.kv_heads())
                    .map(|head| {
                        // In u128: `(i + 1) * n` may pass usize for a pattern of more
                        // than 2^32 heads.
                        let (i, n, total) = (
                            (layer * geometry.kv_heads() + head) as u128,
                            n as u128,
                            total as u128,
                        );
                        if (i + 1) * n / total > i * n / total {
                            HeadKind::Streaming
                        } else {
                            HeadKind::Dense
                        }
                    })
                    .collect()
            })
            .collect();
        Self::from_kinds(geometry, kinds)
    }

    /// The geometry this pattern was built for.
    pub fn geometry(&self) -> &ModelGeometry {
        &self.geometry
    }

    /// Layers (`geometry().layers()`): the bound of every query's `layer`.
    pub fn layers(&self) -> usize {
        self.kinds.len()
    }

    /// The kind of KV head `kv_head` of `layer`.
    ///
    /// # Panics
    /// If `layer >= layers` or `kv_head >= kv_heads` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn kind(&self, layer: usize, kv_head: usize) -> HeadKind {
        self.kinds[layer][kv_head]
    }

    /// The kind of the KV head that query head `q_head` of `layer` reads.
    ///
    /// # Panics
    /// If `layer >= layers` or `q_head >= q_heads` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn kind_of_q_head(&self, layer: usize, q_head: usize) -> HeadKind {
        self.kind(layer, self.geometry.kv_head_of(q_head))
    }

    /// All kinds of `layer`, indexed by KV head.
    ///
    /// # Panics
    /// If `layer >= layers` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn layer_kinds(&self, layer: usize) -> &[HeadKind] {
        &self.kinds[layer]
    }

    /// Dense KV heads of `layer` (`Hd`, the `heads` of its page pool).
    ///
    /// # Panics
    /// If `layer >= layers` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn dense_heads(&self, layer: usize) -> usize {
        self.dense[layer].len()
    }

    /// Streaming KV heads of `layer` (`Hs`, the `heads` of its streaming store).
    ///
    /// # Panics
    /// If `layer >= layers` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn streaming_heads(&self, layer: usize) -> usize {
        self.streaming[layer].len()
    }

    /// The dense KV heads of `layer`, ascending (compact index -> KV head).
    ///
    /// # Panics
    /// If `layer >= layers` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn dense_kv_heads(&self, layer: usize) -> &[usize] {
        &self.dense[layer]
    }

    /// The streaming KV heads of `layer`, ascending (compact index -> KV head).
    ///
    /// # Panics
    /// If `layer >= layers` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn streaming_kv_heads(&self, layer: usize) -> &[usize] {
        &self.streaming[layer]
    }

    /// The compact index of `kv_head` among `layer`'s heads of its own kind (its dense index if
    /// it is dense, its streaming index if it is streaming).
    ///
    /// # Panics
    /// If `layer >= layers` or `kv_head >= kv_heads` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn compact_index(&self, layer: usize, kv_head: usize) -> usize {
        self.compact[layer][kv_head]
    }

    /// The compact dense index of `kv_head`, or `None` if it is streaming.
    ///
    /// # Panics
    /// If `layer >= layers` or `kv_head >= kv_heads` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn dense_index(&self, layer: usize, kv_head: usize) -> Option<usize> {
        (self.kind(layer, kv_head) == HeadKind::Dense).then(|| self.compact_index(layer, kv_head))
    }

    /// The compact streaming index of `kv_head`, or `None` if it is dense.
    ///
    /// # Panics
    /// If `layer >= layers` or `kv_head >= kv_heads` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn streaming_index(&self, layer: usize, kv_head: usize) -> Option<usize> {
        (self.kind(layer, kv_head) == HeadKind::Streaming)
            .then(|| self.compact_index(layer, kv_head))
    }

    /// The KV head that is dense head number `dense_index` of `layer` (inverse of
    /// [`dense_index`](Self::dense_index)).
    ///
    /// # Panics
    /// If `layer >= layers` or `dense_index >= dense_heads(layer)` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn dense_kv_head(&self, layer: usize, dense_index: usize) -> usize {
        self.dense[layer][dense_index]
    }

    /// The KV head that is streaming head number `streaming_index` of `layer` (inverse of
    /// [`streaming_index`](Self::streaming_index)).
    ///
    /// # Panics
    /// If `layer >= layers` or `streaming_index >= streaming_heads(layer)` (an index from another geometry: a caller bug, like slice indexing out of
    /// bounds).
    pub fn streaming_kv_head(&self, layer: usize, streaming_index: usize) -> usize {
        self.streaming[layer][streaming_index]
    }

    /// The most dense heads of any layer (sizes per-layer buffers uniformly).
    pub fn max_dense_heads(&self) -> usize {
        self.dense.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The most streaming heads of any layer.
    pub fn max_streaming_heads(&self) -> usize {
        self.streaming.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Streaming heads over all layers.
    pub fn total_streaming_heads(&self) -> usize {
        self.streaming.iter().map(Vec::len).sum()
    }

    /// The fraction of all (layer, KV head) pairs that are streaming.
    pub fn streaming_fraction(&self) -> f64 {
        self.total_streaming_heads() as f64 / self.geometry.total_kv_heads() as f64
    }
}

/// Head-gating values published with a model's DuoAttention training run, embedded in the
/// library (`host/data/duo-attention/`, MIT license, from MIT HAN Lab's DuoAttention release):
/// the model's name as published, its geometry and its `full_attention_heads.tsv`.
///
/// ```
/// use lserve::head_pattern::PublishedGating;
/// let names: Vec<&str> = PublishedGating::ALL.iter().map(|p| p.name).collect();
/// assert!(names.contains(&"Llama-3-8B-Instruct-Gradient-1048k"));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct PublishedGating {
    /// The model's name as DuoAttention publishes it (the folder of its gating file).
    pub name: &'static str,
    /// The model's geometry.
    pub geometry: ModelGeometry,
    /// The gating file's text (`full_attention_heads.tsv`).
    pub tsv: &'static str,
}

impl PublishedGating {
    /// Every embedded gating file.
    pub const ALL: &'static [PublishedGating] = &[
        PublishedGating {
            name: "Llama-3-8B-Instruct-Gradient-1048k",
            geometry: ModelGeometry::llama3_8b(),
            tsv: include_str!(
                "../data/duo-attention/Llama-3-8B-Instruct-Gradient-1048k/full_attention_heads.tsv"
            ),
        },
        PublishedGating {
            name: "Llama-2-7B-32K-Instruct",
            geometry: ModelGeometry::llama2_7b(),
            tsv: include_str!(
                "../data/duo-attention/Llama-2-7B-32K-Instruct/full_attention_heads.tsv"
            ),
        },
    ];

    /// The embedded gating file of model `name`; an unknown name is a `HeadPattern` error that
    /// lists the known ones.
    ///
    /// ```
    /// use lserve::head_pattern::PublishedGating;
    /// let g = PublishedGating::find("Llama-2-7B-32K-Instruct")?;
    /// assert_eq!(g.geometry.kv_heads(), 32);
    /// assert!(PublishedGating::find("no-such-model").is_err());
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn find(name: &str) -> Result<&'static PublishedGating> {
        Self::ALL.iter().find(|p| p.name == name).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|p| p.name).collect();
            LserveError::HeadPattern(format!(
                "no published gating values for {name:?} (known: {})",
                known.join(", ")
            ))
        })
    }

    /// The gating values, `[layer][kv_head]`.
    pub fn values(&self) -> Result<Vec<Vec<f64>>> {
        parse_gating_tsv(self.tsv)
    }
}

impl HeadPattern {
    /// The pattern of a model whose DuoAttention gating values ship with lserve
    /// ([`PublishedGating::ALL`]), thresholded at `streaming_fraction` as
    /// [`from_gating_values`](Self::from_gating_values) does, on that model's geometry.
    ///
    /// ```
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::head_pattern::HeadPattern;
    /// let p = HeadPattern::published("Llama-3-8B-Instruct-Gradient-1048k", 0.5)?;
    /// assert_eq!(*p.geometry(), ModelGeometry::llama3_8b());
    /// assert_eq!(p.total_streaming_heads(), 128);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn published(name: &str, streaming_fraction: f64) -> Result<Self> {
        let gating = PublishedGating::find(name)?;
        Self::from_gating_tsv(gating.tsv, gating.geometry, streaming_fraction)
    }
}

/// Parses gating values: one line per layer, tab-separated floats (surrounding whitespace of a
/// field is ignored, blank lines are skipped). Rows may differ in length here; the geometry
/// check comes later.
pub fn parse_gating_tsv(text: &str) -> Result<Vec<Vec<f64>>> {
    let mut rows = Vec::new();
    for (line_no, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row = line
            .split('\t')
            .enumerate()
            .map(|(col, field)| {
                field.trim().parse::<f64>().map_err(|e| {
                    LserveError::HeadPattern(format!(
                        "line {}, field {}: {:?}: {e}",
                        line_no + 1,
                        col + 1,
                        field
                    ))
                })
            })
            .collect::<Result<Vec<f64>>>()?;
        rows.push(row);
    }
    Ok(rows)
}

/// `round(fraction * total)` after checking `fraction` is in `[0, 1]`.
fn streaming_count(geometry: ModelGeometry, fraction: f64) -> Result<usize> {
    if !(0.0..=1.0).contains(&fraction) {
        return Err(LserveError::InvalidConfig {
            field: "streaming_fraction",
            reason: format!("{fraction} is not in [0, 1]"),
        });
    }
    let total = geometry.total_kv_heads();
    // `min`: the f64 product of a total past 2^53 may round above it.
    Ok(((fraction * total as f64).round() as usize).min(total))
}
