//! The shape of a model's attention: layers, query heads, KV heads, head dimension.

use crate::error::{LserveError, Result};

/// Attention geometry of a model, validated on construction.
///
/// All counts are `usize`; every value also fits in `u32` (the device layouts use `u32`).
/// Query head `h` belongs to KV head `h / group()`.
///
/// ```
/// use lserve::geometry::ModelGeometry;
/// let g = ModelGeometry::new(32, 32, 8, 128)?;
/// assert_eq!(g, ModelGeometry::llama3_8b());
/// assert_eq!(g.group(), 4);
/// assert!(ModelGeometry::new(32, 32, 6, 128).is_err()); // 32 % 6 != 0
/// assert!(ModelGeometry::new(32, 32, 8, 96).is_err()); // head_dim not supported
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModelGeometry {
    layers: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl ModelGeometry {
    /// Head dimensions the kernels support.
    pub const SUPPORTED_HEAD_DIMS: [usize; 3] = [64, 128, 256];

    /// Validates and builds a geometry: all values nonzero and at most `u32::MAX`,
    /// `q_heads % kv_heads == 0`, `head_dim` one of [`Self::SUPPORTED_HEAD_DIMS`].
    pub fn new(layers: usize, q_heads: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        for (field, value) in [
            ("layers", layers),
            ("q_heads", q_heads),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be nonzero".into()));
            }
            if u32::try_from(value).is_err() {
                return Err(invalid(field, format!("{value} does not fit in u32")));
            }
        }
        if q_heads % kv_heads != 0 {
            return Err(invalid(
                "kv_heads",
                format!("q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})"),
            ));
        }
        if !Self::SUPPORTED_HEAD_DIMS.contains(&head_dim) {
            return Err(invalid(
                "head_dim",
                format!("{head_dim} not in {:?}", Self::SUPPORTED_HEAD_DIMS),
            ));
        }
        Ok(Self {
            layers,
            q_heads,
            kv_heads,
            head_dim,
        })
    }

    /// Llama-3-8B: 32 layers, 32 query heads, 8 KV heads, head dim 128 (GQA, group 4).
    pub const fn llama3_8b() -> Self {
        Self {
            layers: 32,
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
        }
    }

    /// Llama-2-7B: 32 layers, 32 query heads, 32 KV heads, head dim 128 (MHA).
    pub const fn llama2_7b() -> Self {
        Self {
            layers: 32,
            q_heads: 32,
            kv_heads: 32,
            head_dim: 128,
        }
    }

    /// Transformer layers.
    pub const fn layers(&self) -> usize {
        self.layers
    }

    /// Query heads per layer (`Hq`).
    pub const fn q_heads(&self) -> usize {
        self.q_heads
    }

    /// KV heads per layer (`Hkv`).
    pub const fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Head dimension (`D`).
    pub const fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Query heads per KV head (`G = Hq / Hkv`; 1 is MHA).
    pub const fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// The KV head that query head `q_head` reads (`q_head / group()`).
    pub const fn kv_head_of(&self, q_head: usize) -> usize {
        q_head / self.group()
    }

    /// KV heads over all layers (`layers * kv_heads`).
    pub const fn total_kv_heads(&self) -> usize {
        self.layers * self.kv_heads
    }

    /// The default softmax scale `1 / sqrt(head_dim)`.
    pub fn default_softmax_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

fn invalid(field: &'static str, reason: String) -> LserveError {
    LserveError::InvalidConfig { field, reason }
}
