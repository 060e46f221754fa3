//! The shape of a model's attention: layers, query heads, KV heads, head dimension.

use crate::error::{LserveError, Result};

/// Attention geometry of a model, validated on construction.
///
/// All counts are `usize`; every value also fits in `u32` (the device layouts use `u32`).
/// Query head `h` belongs to KV head `h / group()`.
///
/// A geometry is the contract for the whole library: [`new`](Self::new) accepts exactly the
/// shapes every stage has kernels for (prefill, cache writes, page selection, decode attention),
/// so a model it accepts never meets a missing kernel later. Those are head dimensions
/// [`SUPPORTED_HEAD_DIMS`](Self::SUPPORTED_HEAD_DIMS) and GQA groups 1 to
/// [`MAX_GROUP`](Self::MAX_GROUP), powers of two or not (SmolLM2-135M: 9 query heads over 3 KV
/// heads, group 3, head dim 64; Qwen2.5-7B: 28 over 4, group 7, head dim 128).
///
/// ```
/// use lserve::geometry::ModelGeometry;
/// use lserve::LserveError;
/// let g = ModelGeometry::new(32, 32, 8, 128)?;
/// assert_eq!(g, ModelGeometry::llama3_8b());
/// assert_eq!(g.group(), 4);
/// assert_eq!(ModelGeometry::new(30, 9, 3, 64)?.group(), 3); // SmolLM2-135M
/// assert!(ModelGeometry::new(32, 32, 6, 128).is_err()); // 32 % 6 != 0
/// assert!(ModelGeometry::new(32, 32, 8, 96).is_err()); // head_dim not supported
/// assert!(matches!(
///     ModelGeometry::new(32, 64, 4, 128), // group 16: no kernel serves it
///     Err(LserveError::InvalidConfig { field: "group", .. })
/// ));
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
    /// Head dimensions the kernels support (prefill and decode attention, page scorer).
    pub const SUPPORTED_HEAD_DIMS: [usize; 2] = [64, 128];

    /// The largest GQA group (query heads per KV head) the decode attention and the page
    /// scorer are built for; they serve every group from 1 to this.
    pub const MAX_GROUP: usize = lserve_abi::decode::MAX_GROUP as usize;

    /// Validates and builds a geometry: all values nonzero and at most `u32::MAX`,
    /// `q_heads % kv_heads == 0`, group `q_heads / kv_heads` at most [`Self::MAX_GROUP`],
    /// `head_dim` one of [`Self::SUPPORTED_HEAD_DIMS`].
    ///
    /// Errors: [`LserveError::InvalidConfig`] naming the offending value (`layers`, `q_heads`,
    /// `kv_heads`, `head_dim`, or `group` for a group past [`Self::MAX_GROUP`]).
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
        let group = q_heads / kv_heads;
        if group > Self::MAX_GROUP {
            return Err(invalid(
                "group",
                format!(
                    "{q_heads} query heads over {kv_heads} KV heads is a group of {group}: \
                     the kernels serve groups 1 to {}",
                    Self::MAX_GROUP
                ),
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

    /// The geometry of tensor-parallel shard `rank` of `ranks`: each shard holds `kv_heads /
    /// ranks` consecutive KV heads (shard `r` the KV heads `r · kv_heads / ranks ..`) and their
    /// query heads (`q_heads / ranks`, the group unchanged), as engines split attention across
    /// GPUs. Every layer is in every shard. A cache built for the shard's geometry (and
    /// [`HeadPattern::shard`](crate::head_pattern::HeadPattern::shard)) is sized for its heads
    /// only.
    ///
    /// Errors: `InvalidConfig { field: "ranks" }` for `ranks == 0` or a `kv_heads` that `ranks`
    /// does not divide; `InvalidConfig { field: "rank" }` for `rank >= ranks`.
    ///
    /// ```
    /// use lserve::geometry::ModelGeometry;
    /// let shard = ModelGeometry::llama3_8b().shard(1, 4)?;
    /// assert_eq!((shard.q_heads(), shard.kv_heads(), shard.group()), (8, 2, 4));
    /// assert!(ModelGeometry::llama3_8b().shard(0, 3).is_err()); // 8 KV heads over 3 ranks
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn shard(&self, rank: usize, ranks: usize) -> Result<Self> {
        if ranks == 0 || self.kv_heads % ranks != 0 {
            return Err(invalid(
                "ranks",
                format!(
                    "{} KV heads cannot be split evenly over {ranks} ranks",
                    self.kv_heads
                ),
            ));
        }
        if rank >= ranks {
            return Err(invalid(
                "rank",
                format!("{rank} is not below {ranks} ranks"),
            ));
        }
        Ok(Self {
            kv_heads: self.kv_heads / ranks,
            q_heads: self.q_heads / ranks,
            ..*self
        })
    }
}

fn invalid(field: &'static str, reason: String) -> LserveError {
    LserveError::InvalidConfig { field, reason }
}
