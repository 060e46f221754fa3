//! Block-sparse prefill attention on the device (`kernels-gpu/src/prefill`), on plain device
//! tensors: a drop-in attention for engines that manage their own KV.
//!
//! Plan / run split (as FlashInfer): [`PrefillPlan::new`] validates a batch's shapes on the host
//! and uploads its schedule — one work item per (sequence, query tile), the per-KV-head kinds
//! and the optional caller block masks — once; [`PrefillPlan::run`] launches on any `q`, `k`,
//! `v`, `out` of that shape without allocating. [`prefill_attention`] does both.
//!
//! Semantics are the CPU reference's ([`crate::reference::prefill::prefill_attention`]): dense
//! heads are causal, streaming heads see key `j` from query `t` iff `j <= t && (j < sink ||
//! t - j < local)`, a caller block mask (blocks of 64 queries x 64 keys) is intersected with
//! that, the diagonal block always kept.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};
use lserve_abi::decode::HEAD_STREAMING;
use lserve_abi::layout::TokenStrides;
use lserve_abi::prefill::{
    mask_words_per_row, prefill_smem_bytes, wgmma_prefill_smem_bytes, PrefillArgs as KernelArgs,
    PrefillParams, PrefillWorkItem, WgmmaPrefillArgs, BLOCK_Q, MASKED_TILE_Q_BLOCKS,
    PREFILL_TENSOR_MAP_BYTES, PREFILL_THREADS, TILE_Q_BLOCKS, WGMMA_PREFILL_THREADS,
};
use lserve_abi::ptr::GlobalPtrMut;

use super::cache::{DeviceElement, DeviceKvCache};
use super::kv_write::{gather_kv_rows, pool_key_stats, write_kv_rows, DeviceKvWritePlan};
use super::launch::Launch;
use super::tensor_map::prefill_tensor_map;
use super::tokens::{kv_stride, Tokens, TokensMut};
use super::GpuContext;
use crate::block_iter::{num_blocks, BlockMask};
use crate::error::invalid;
use crate::geometry::ModelGeometry;
use crate::head_pattern::HeadKind;
use crate::quant::KvFormat;
use crate::{LserveError, Result};

/// `u32` words of one [`PrefillWorkItem`] (the device array is a flat `u32` array).
const ITEM_WORDS: usize = std::mem::size_of::<PrefillWorkItem>() / 4;

/// What one prefill launch computes, on the host: shapes, head kinds, Λ parameters, optional
/// block masks, softmax scale. Layouts: `q [T][q_heads][head_dim]`, `k`, `v
/// [T][kv_heads][head_dim]`, `out [T][q_heads][head_dim]`, `T = cu_seqlens[B]`.
#[derive(Clone, Copy, Debug)]
pub struct PrefillArgs<'a> {
    /// Query heads (`Hq`).
    pub q_heads: usize,
    /// KV heads (`Hkv`, divides `Hq`); query head `h` reads KV head `h / (Hq / Hkv)`.
    pub kv_heads: usize,
    /// Head dimension (64 or 128).
    pub head_dim: usize,
    /// `B + 1` token offsets of the ragged batch, starting at 0, strictly increasing (no empty
    /// sequence).
    pub cu_seqlens: &'a [usize],
    /// The kind of each KV head (`kv_heads` entries); its query heads follow it.
    pub kinds: &'a [HeadKind],
    /// Sink tokens of streaming heads.
    pub sink_tokens: usize,
    /// Local window of streaming heads (> 0 if any head streams).
    pub local_tokens: usize,
    /// Optional caller block masks, one per sequence ([`BlockMask`] of `q_heads` heads over the
    /// sequence's length), intersected with each head's pattern; the diagonal is always kept.
    pub block_masks: Option<&'a [BlockMask]>,
    /// Softmax scale; `None` is `1 / sqrt(head_dim)`.
    pub softmax_scale: Option<f32>,
    /// Whether the plan's launches may write the log-sum-exp ([`PrefillPlan::run_with_lse`]).
    /// On sm_90a every kernel can; elsewhere, without caller masks, such a plan takes the
    /// `mma.sync` kernel of 64-query tiles (the 128-query one has no register left for it;
    /// prefill DESIGN.md), with them the masked kernel as always.
    pub with_lse: bool,
    /// Per sequence, the leading positions that are keys only (a cached prefix before a chunk):
    /// sequence `b`'s queries are then its positions `prefix_lens[b]..len`, and `q` / `out` hold
    /// only those rows, sequence after sequence (`Σ (len - prefix)` rows); `k` / `v` hold every
    /// position (`cu_seqlens`). `None`: every position has a query (whole prompts). Each prefix
    /// is below its sequence's length.
    pub prefix_lens: Option<&'a [usize]>,
}

/// A prefill batch's schedule on the device (see the module docs).
///
/// On compute capability 9.0 (the sm_90a module) a plan runs the `wgmma` kernels (the one of
/// 128-query tiles without caller masks, the one of 64-query tiles with them), which read `q`,
/// `k`, `v` through tensor maps that the plan keeps in a device buffer of its own and rewrites
/// on the run's stream when a run's tensors or stream differ from the last run's: runs of one
/// plan go to one stream at a time (or to streams the caller orders).
pub struct PrefillPlan {
    params: PrefillParams,
    /// The kernel the schedule was built for.
    kernel: Kernel,
    /// Rows of `q` / `out` (and of `lse`): `tokens` less the prefixes.
    q_tokens: usize,
    /// `[items]` [`PrefillWorkItem`]s as words.
    items: CudaSlice<u32>,
    /// `[kv_heads]` kinds (`HEAD_STREAMING` bit), as `DeviceLayer::head_map` entries.
    head_map: CudaSlice<u32>,
    /// All sequences' mask words, concatenated (one unused word without masks).
    mask: CudaSlice<u32>,
    tokens: usize,
    head_dim: usize,
    /// The `wgmma` kernel's tensor maps of the last run's `q`, `k`, `v` (device buffer of three
    /// maps) and what they describe; rewritten when a run's tensors differ.
    maps: Option<std::sync::Mutex<TensorMaps>>,
}

/// The tensor maps of the `wgmma` kernel (`lserve_abi::prefill::WgmmaPrefillArgs::maps`) in
/// device memory, and the tensors they were encoded for (addresses and token strides) and the
/// stream that wrote them. The buffer is the plan's: runs of one such plan on two streams at once
/// would race on it (runs on one stream, or on streams ordered by the caller, are fine).
struct TensorMaps {
    buffer: CudaSlice<u8>,
    encoded_for: Option<[u64; 6]>,
}

fn to_u32(what: &'static str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| invalid(what, format!("{x} does not fit in 32 bits")))
}

/// Which prefill kernel a launch takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// `prefill_attention_*`: no caller mask, no log-sum-exp, two query blocks per work item.
    Attention,
    /// `prefill_lse_attention_*`: no caller mask, writes the log-sum-exp, one query block per
    /// work item (the two-block kernel has no register left for it).
    Lse,
    /// `prefill_masked_attention_*`: caller block masks (and the log-sum-exp if asked), one
    /// query block per work item.
    Masked,
    /// `prefill_wgmma_attention_*` (sm_90a module only): what [`Kernel::Attention`] computes,
    /// on Hopper's `wgmma` products with tensor-map copies; the same work items.
    Wgmma,
    /// `prefill_wgmma_lse_attention_*` (sm_90a module only): what [`Kernel::Lse`] computes, on
    /// the work items of [`Kernel::Attention`] (the `wgmma` kernel has the registers for it).
    WgmmaLse,
    /// `prefill_wgmma_masked_attention_*` (sm_90a module only): what [`Kernel::Masked`]
    /// computes, on `wgmma` products; the same work items.
    WgmmaMasked,
}

impl Kernel {
    /// The kernel of a launch with or without caller masks and the log-sum-exp, in a module
    /// with or without the `wgmma` kernels.
    fn of(masked: bool, lse: bool, wgmma: bool) -> Self {
        match (masked, lse, wgmma) {
            (true, _, true) => Kernel::WgmmaMasked,
            (false, true, true) => Kernel::WgmmaLse,
            (false, false, true) => Kernel::Wgmma,
            (true, _, false) => Kernel::Masked,
            (false, true, false) => Kernel::Lse,
            (false, false, false) => Kernel::Attention,
        }
    }

    /// Whether it writes the log-sum-exp where a launch gives a buffer for it (the kernels of
    /// plans made with [`PrefillArgs::with_lse`] or caller masks).
    fn writes_lse(self) -> bool {
        !matches!(self, Kernel::Attention | Kernel::Wgmma)
    }

    /// Whether it is one of the `wgmma` kernels (tensor maps, [`WgmmaPrefillArgs`]).
    fn is_wgmma(self) -> bool {
        matches!(self, Kernel::Wgmma | Kernel::WgmmaLse | Kernel::WgmmaMasked)
    }

    /// The entry point for an element type and head dimension.
    fn name<E: DeviceElement>(self, head_dim: usize) -> String {
        let kind = match self {
            Kernel::Attention => "attention",
            Kernel::Lse => "lse_attention",
            Kernel::Masked => "masked_attention",
            Kernel::Wgmma => "wgmma_attention",
            Kernel::WgmmaLse => "wgmma_lse_attention",
            Kernel::WgmmaMasked => "wgmma_masked_attention",
        };
        format!("prefill_{kind}_{}_d{head_dim}", E::DTYPE.name())
    }

    /// Query blocks per work item.
    fn tile_q_blocks(self) -> u32 {
        match self {
            Kernel::Attention | Kernel::Wgmma | Kernel::WgmmaLse => TILE_Q_BLOCKS,
            Kernel::Lse | Kernel::Masked | Kernel::WgmmaMasked => MASKED_TILE_Q_BLOCKS,
        }
    }
}

impl PrefillArgs<'_> {
    /// Checks every shape and value (what [`PrefillPlan::new`] checks before touching the
    /// device); returns the number of tokens `T`. Errors as [`PrefillPlan::new`].
    pub fn validate(&self) -> Result<usize> {
        if !ModelGeometry::SUPPORTED_HEAD_DIMS.contains(&self.head_dim) {
            return Err(invalid(
                "head_dim",
                format!(
                    "{}: the GPU prefill kernel supports {:?}",
                    self.head_dim,
                    ModelGeometry::SUPPORTED_HEAD_DIMS
                ),
            ));
        }
        if self.q_heads == 0 || self.kv_heads == 0 || self.q_heads % self.kv_heads != 0 {
            return Err(invalid(
                "q_heads",
                format!(
                    "{} query heads, {} KV heads: KV heads must be positive and divide query heads",
                    self.q_heads, self.kv_heads
                ),
            ));
        }
        if self.q_heads > 65_535 {
            return Err(invalid(
                "q_heads",
                format!("{}: at most 65535 (the launch's grid y)", self.q_heads),
            ));
        }
        if self.kinds.len() != self.kv_heads {
            return Err(LserveError::ShapeMismatch {
                what: "kinds (one per KV head)",
                expected: self.kv_heads,
                actual: self.kinds.len(),
            });
        }
        to_u32("sink_tokens", self.sink_tokens)?;
        to_u32("local_tokens", self.local_tokens)?;
        if self.kinds.contains(&HeadKind::Streaming) && self.local_tokens == 0 {
            return Err(LserveError::InvalidConfig {
                field: "local_tokens",
                reason: "must be > 0 when a head is streaming".into(),
            });
        }
        if let Some(scale) = self.softmax_scale {
            if !(scale.is_finite() && scale > 0.0) {
                return Err(invalid(
                    "softmax_scale",
                    format!("{scale}: must be finite and > 0"),
                ));
            }
        }
        let cu = self.cu_seqlens;
        if cu.len() < 2 {
            return Err(LserveError::Empty("batch"));
        }
        if cu[0] != 0 {
            return Err(invalid("cu_seqlens", "must start at 0"));
        }
        if cu.windows(2).any(|w| w[1] <= w[0]) {
            return Err(LserveError::Empty(
                "sequence (cu_seqlens must be strictly increasing)",
            ));
        }
        let tokens = cu[cu.len() - 1];
        // Work-item fields and in-sequence positions are 32-bit; keep headroom for `+ 64`.
        if tokens >= (1 << 31) {
            return Err(invalid(
                "cu_seqlens",
                format!("{tokens} tokens: at most 2^31 - 1"),
            ));
        }
        if let Some(prefixes) = self.prefix_lens {
            if prefixes.len() + 1 != cu.len() {
                return Err(LserveError::ShapeMismatch {
                    what: "prefix_lens (one per sequence)",
                    expected: cu.len() - 1,
                    actual: prefixes.len(),
                });
            }
            if let Some((b, (&p, w))) = prefixes
                .iter()
                .zip(cu.windows(2))
                .enumerate()
                .find(|(_, (&p, w))| p >= w[1] - w[0])
            {
                return Err(invalid(
                    "prefix_lens",
                    format!(
                        "sequence {b}: a prefix of {p} of {} positions leaves no query",
                        w[1] - w[0]
                    ),
                ));
            }
        }
        if let Some(masks) = self.block_masks {
            if masks.len() + 1 != cu.len() {
                return Err(LserveError::ShapeMismatch {
                    what: "block_masks (one per sequence)",
                    expected: cu.len() - 1,
                    actual: masks.len(),
                });
            }
            for (mask, w) in masks.iter().zip(cu.windows(2)) {
                mask.check_shape(self.q_heads, w[1] - w[0])?;
            }
        }
        Ok(tokens)
    }

    /// The kernel this launch takes.
    fn kernel(&self, wgmma: bool) -> Kernel {
        Kernel::of(self.block_masks.is_some(), self.with_lse, wgmma)
    }

    /// The sequence's first position with a query.
    fn prefix(&self, b: usize) -> usize {
        self.prefix_lens.map_or(0, |p| p[b])
    }

    /// Rows of `q` / `out`: every position past its sequence's prefix.
    pub fn query_rows(&self) -> usize {
        let tokens = self.cu_seqlens.last().copied().unwrap_or(0);
        tokens - self.prefix_lens.map_or(0, |p| p.iter().sum())
    }

    /// The work items, one per query tile of `kernel` ([`Kernel::tile_q_blocks`]; heaviest
    /// first: causal work grows with the block index) that holds a query (tiles inside a cached
    /// prefix are left out), and the concatenated mask words.
    fn schedule(&self, kernel: Kernel) -> Result<(Vec<u32>, Vec<u32>)> {
        let tile_blocks = kernel.tile_q_blocks() as usize;
        let mut items = Vec::new();
        let mut mask_words = Vec::new();
        let mut q_row = 0usize;
        for (b, w) in self.cu_seqlens.windows(2).enumerate() {
            let (start, len) = (w[0], w[1] - w[0]);
            let prefix = self.prefix(b);
            // The first tile that holds a query.
            let first_block = prefix / BLOCK_Q as usize / tile_blocks * tile_blocks;
            let blocks = num_blocks(len);
            let (mask_base, head_stride) = match self.block_masks {
                Some(masks) => {
                    let m = &masks[b];
                    let base = to_u32("block_masks", mask_words.len())?;
                    mask_words.extend_from_slice(m.words());
                    (base, m.blocks() * m.words_per_row())
                }
                None => (0, 0),
            };
            // A two-block tile finds its second query block's row `mask_words_per_row` words on.
            let words_per_row = mask_words_per_row(len as u32) as usize;
            debug_assert_eq!(words_per_row, blocks.div_ceil(32));
            for q_block in (first_block..blocks).step_by(tile_blocks) {
                items.push(PrefillWorkItem {
                    seq_start: start as u32,
                    seq_len: len as u32,
                    q_block: q_block as u32,
                    mask_row: mask_base + (q_block * words_per_row) as u32,
                    mask_head_stride: head_stride as u32,
                    q_first: prefix as u32,
                    q_row: q_row as u32,
                });
            }
            q_row += len - prefix;
        }
        to_u32("block_masks", mask_words.len())?;
        items.sort_by_key(|item| std::cmp::Reverse(item.q_block));
        let words = items
            .iter()
            .flat_map(|i| {
                [
                    i.seq_start,
                    i.seq_len,
                    i.q_block,
                    i.mask_row,
                    i.mask_head_stride,
                    i.q_first,
                    i.q_row,
                ]
            })
            .collect();
        if mask_words.is_empty() {
            mask_words.push(0);
        }
        Ok((words, mask_words))
    }
}

const _: () = assert!(ITEM_WORDS == 7 && BLOCK_Q == 64);

impl PrefillPlan {
    /// Validates `args` and uploads the batch's schedule (allocates; once per batch).
    ///
    /// Errors: `InvalidArgument` for a head dimension other than 64 / 128, head counts that do
    /// not divide, a bad softmax scale, `cu_seqlens` not starting at 0 or too long;
    /// `ShapeMismatch` for a kind or mask count that does not match; `InvalidConfig` for
    /// streaming heads with `local_tokens == 0`; `Empty` for an empty batch or sequence; a mask
    /// of the wrong shape; driver errors.
    pub fn new(gpu: &GpuContext, args: &PrefillArgs<'_>) -> Result<Self> {
        let tokens = args.validate()?;
        // The `wgmma` kernels where the loaded module has them.
        let kernel = args.kernel(gpu.ptx().has_wgmma());
        let (items, mask_words) = args.schedule(kernel)?;
        let head_map: Vec<u32> = args
            .kinds
            .iter()
            .map(|k| match k {
                HeadKind::Dense => 0,
                HeadKind::Streaming => HEAD_STREAMING,
            })
            .collect();
        let scale = args
            .softmax_scale
            .unwrap_or(1.0 / (args.head_dim as f32).sqrt());
        let params = PrefillParams {
            q_heads: args.q_heads as u32,
            kv_heads: args.kv_heads as u32,
            group: (args.q_heads / args.kv_heads) as u32,
            items: (items.len() / ITEM_WORDS) as u32,
            sink_tokens: args.sink_tokens as u32,
            local_tokens: args.local_tokens as u32,
            scale_log2: scale * std::f32::consts::LOG2_E,
            has_mask: args.block_masks.is_some() as u32,
            // Set per run from the tensors' views.
            strides: TokenStrides::packed(args.q_heads as u32, args.kv_heads as u32),
        };
        let stream = gpu.stream();
        let maps = if kernel.is_wgmma() {
            // 64-byte aligned: device allocations are 256-byte aligned.
            let buffer = stream.alloc_zeros::<u8>(3 * PREFILL_TENSOR_MAP_BYTES)?;
            Some(std::sync::Mutex::new(TensorMaps {
                buffer,
                encoded_for: None,
            }))
        } else {
            None
        };
        Ok(Self {
            params,
            kernel,
            maps,
            q_tokens: args.query_rows(),
            items: stream.clone_htod(&items)?,
            head_map: stream.clone_htod(&head_map)?,
            mask: stream.clone_htod(&mask_words)?,
            tokens,
            head_dim: args.head_dim,
        })
    }

    /// Tokens in the batch (`T`: rows of `k` / `v`).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Rows of `q` and `out` (and of the log-sum-exp): [`tokens`](Self::tokens) less the
    /// prefixes of [`PrefillArgs::prefix_lens`].
    pub fn query_rows(&self) -> usize {
        self.q_tokens
    }

    /// Work items (grid `x`): query tiles over all sequences (pairs of query blocks without
    /// masks, single query blocks with masks).
    pub fn items(&self) -> usize {
        self.params.items as usize
    }

    /// Launches the attention: `out = attention(q, k, v)` for the planned batch. Each tensor is
    /// a `&CudaSlice` (packed rows) or a [`Tokens`] / [`TokensMut`] view with its token stride
    /// (e.g. into a fused QKV buffer); `k` and `v` share one stride. Enqueued on the context's
    /// stream; allocates nothing and does not synchronize.
    ///
    /// Errors (nothing launched): `ShapeMismatch` if a tensor holds fewer than the planned
    /// tokens, `InvalidArgument` for a stride [`Tokens`] does not accept or different strides of
    /// `k` and `v`; driver errors.
    pub fn run<'t, E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        q: impl Into<Tokens<'t, E>>,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
    ) -> Result<()> {
        let (q, k, v, mut out) = (q.into(), k.into(), v.into(), out.into());
        let strides = self.check_tensors(gpu, &q, &k, &v, &out)?;
        self.launch(gpu, strides, &q, &k, &v, &mut out, None)
    }

    /// [`run`](Self::run), and the log-sum-exp of every output row into `lse`
    /// (`[query_rows][q_heads]` f32, natural log: `ln Σ_j exp(scale · q·k_j)` over the keys the
    /// row sees), so that the output can be merged with attention over other keys computed
    /// elsewhere (`o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b})`).
    ///
    /// Errors: as [`run`](Self::run); `InvalidArgument` for a plan made without
    /// [`PrefillArgs::with_lse`]; `ShapeMismatch` if `lse` holds fewer than
    /// `query_rows * q_heads` values.
    ///
    /// ```no_run
    /// use lserve::gpu::{GpuContext, PrefillArgs, PrefillPlan};
    /// use lserve::head_pattern::HeadKind;
    /// let gpu = GpuContext::new(0)?;
    /// let (t, hq, hkv, d) = (100, 8, 2, 64);
    /// let args = PrefillArgs {
    ///     q_heads: hq, kv_heads: hkv, head_dim: d,
    ///     cu_seqlens: &[0, t],
    ///     kinds: &[HeadKind::Dense; 2],
    ///     sink_tokens: 0, local_tokens: 0,
    ///     block_masks: None, softmax_scale: None, prefix_lens: None, with_lse: true,
    /// };
    /// let plan = PrefillPlan::new(&gpu, &args)?;
    /// let q = gpu.stream().alloc_zeros::<half::bf16>(t * hq * d)?;
    /// let kv = gpu.stream().alloc_zeros::<half::bf16>(t * hkv * d)?;
    /// let mut out = gpu.stream().alloc_zeros::<half::bf16>(t * hq * d)?;
    /// let mut lse = gpu.stream().alloc_zeros::<f32>(t * hq)?;
    /// plan.run_with_lse(&gpu, &q, &kv, &kv, &mut out, &mut lse)?;
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn run_with_lse<'t, E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        q: impl Into<Tokens<'t, E>>,
        k: impl Into<Tokens<'t, E>>,
        v: impl Into<Tokens<'t, E>>,
        out: impl Into<TokensMut<'t, E>>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (q, k, v, mut out) = (q.into(), k.into(), v.into(), out.into());
        if !self.kernel.writes_lse() {
            return Err(invalid(
                "lse",
                "the plan was made without `with_lse`: its kernel does not write the log-sum-exp",
            ));
        }
        let strides = self.check_tensors(gpu, &q, &k, &v, &out)?;
        self.check_lse(lse)?;
        self.launch(gpu, strides, &q, &k, &v, &mut out, Some(lse))
    }

    /// `ShapeMismatch` unless `lse` holds a value per query row and head.
    fn check_lse(&self, lse: &CudaSlice<f32>) -> Result<()> {
        let want = self.q_tokens * self.params.q_heads as usize;
        if lse.len() < want {
            return Err(LserveError::ShapeMismatch {
                what: "lse ([query rows][q_heads] f32)",
                expected: want,
                actual: lse.len(),
            });
        }
        Ok(())
    }

    /// Enqueues the kernel on tensors [`check_tensors`](Self::check_tensors) accepted with
    /// `strides` (and an `lse` [`check_lse`](Self::check_lse) accepted).
    #[allow(clippy::too_many_arguments)]
    fn launch<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        strides: TokenStrides,
        q: &Tokens<'_, E>,
        k: &Tokens<'_, E>,
        v: &Tokens<'_, E>,
        out: &mut TokensMut<'_, E>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let d = self.head_dim;
        let p = &PrefillParams {
            strides,
            ..self.params
        };
        if self.kernel.is_wgmma() {
            return self.launch_wgmma(gpu, p, q, k, v, out, lse);
        }
        // The schedule was built for this kernel (`has_mask` set for the masked one).
        let smem = prefill_smem_bytes(d as u32, self.kernel.tile_q_blocks());
        let f = gpu.function_with_smem(&self.kernel.name::<E>(d), smem)?;
        let cfg = LaunchConfig {
            grid_dim: (p.items, p.q_heads, 1),
            block_dim: (PREFILL_THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        let mut launch = Launch::new(gpu, &f);
        let args = self.kernel_args(&mut launch, p, q, k, v, out, lse);
        // SAFETY: `args` is the argument struct of
        // `prefill_{,lse_,masked_}attention_{bf16,f16}_d{64,128}`, of the buffers registered above. The plan was validated: every work item's sequence lies
        // inside `T` tokens, which the tensors hold at their strides (`check_tensors`: views
        // 16-byte aligned, strides whole heads of `D` elements, 16-byte multiples); `head_map` has
        // `kv_heads` entries and `group = q_heads / kv_heads`; the work items are tiles of the
        // chosen kernel's query blocks (`Kernel::tile_q_blocks`, built by `schedule` from the
        // same `block_masks`); with a mask (the masked kernel), every item's row offset plus
        // `mask_words_per_row(len)` words lies inside the uploaded mask words (each sequence's
        // mask was shape-checked: `[q_heads][q_blocks][words_per_row]`); every item's queries
        // are rows `q_row .. q_row + seq_len - q_first` of the `query_rows` that `q` and `out`
        // hold (and `lse`, if given, `query_rows * q_heads` values: `check_lse`), and each item's
        // tile holds a query (`schedule`). The grid is
        // `(items, q_heads)`, the block and shared memory are what the kernel is written for.
        unsafe { launch.launch(cfg, &args) }?;
        Ok(())
    }
}

impl PrefillPlan {
    /// The kernels' argument struct for `p` and these tensors (`lse`: where to write the
    /// log-sum-exp, if anywhere), the buffers registered with `launch`.
    #[allow(clippy::too_many_arguments)]
    fn kernel_args<'a, E: DeviceElement>(
        &'a self,
        launch: &mut Launch<'a>,
        p: &PrefillParams,
        q: &'a Tokens<'_, E>,
        k: &'a Tokens<'_, E>,
        v: &'a Tokens<'_, E>,
        out: &'a mut TokensMut<'_, E>,
        lse: Option<&'a mut CudaSlice<f32>>,
    ) -> KernelArgs {
        KernelArgs {
            params: *p,
            items: launch.read(&self.items).cast(),
            head_map: launch.read(&self.head_map),
            mask: launch.read(&self.mask),
            q: launch.read(q.view()).cast(),
            k: launch.read(k.view()).cast(),
            v: launch.read(v.view()).cast(),
            out: launch.write(out.view_mut()).cast(),
            lse: match lse {
                Some(lse) => launch.write(lse),
                None => GlobalPtrMut::NULL,
            },
        }
    }

    /// [`launch`](Self::launch) of a `wgmma` kernel: the tensor maps of `q`, `k`, `v` are
    /// encoded and copied to the plan's buffer (stream-ordered) unless they describe these
    /// tensors already.
    #[allow(clippy::too_many_arguments)]
    fn launch_wgmma<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        p: &PrefillParams,
        q: &Tokens<'_, E>,
        k: &Tokens<'_, E>,
        v: &Tokens<'_, E>,
        out: &mut TokensMut<'_, E>,
        lse: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let d = self.head_dim;
        let stream = gpu.stream();
        let Some(maps) = self.maps.as_ref() else {
            return Err(invalid("plan", "a wgmma plan without its tensor maps"));
        };
        let mut maps = maps.lock().unwrap_or_else(|e| e.into_inner());
        let addr = |t: &Tokens<'_, E>| t.view().device_ptr(stream).0;
        let (qa, ka, va) = (addr(q), addr(k), addr(v));
        // The stream too: maps written on another stream are written again on this one.
        let on = std::sync::Arc::as_ptr(stream) as u64;
        let key = [qa, ka, va, p.strides.q as u64, p.strides.kv as u64, on];
        if maps.encoded_for != Some(key) {
            let (hq, hkv) = (p.q_heads as usize, p.kv_heads as usize);
            let mut bytes = Vec::with_capacity(3 * PREFILL_TENSOR_MAP_BYTES);
            bytes.extend_from_slice(&prefill_tensor_map(
                qa,
                d,
                hq,
                self.q_tokens,
                p.strides.q as usize * d,
            )?);
            for ptr in [ka, va] {
                bytes.extend_from_slice(&prefill_tensor_map(
                    ptr,
                    d,
                    hkv,
                    self.tokens,
                    p.strides.kv as usize * d,
                )?);
            }
            stream.memcpy_htod(&bytes, &mut maps.buffer)?;
            maps.encoded_for = Some(key);
        }
        let smem = wgmma_prefill_smem_bytes(d as u32);
        let f = gpu.function_with_smem(&self.kernel.name::<E>(d), smem)?;
        let cfg = LaunchConfig {
            grid_dim: (p.items, p.q_heads, 1),
            block_dim: (WGMMA_PREFILL_THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        let mut launch = Launch::new(gpu, &f);
        let args = WgmmaPrefillArgs {
            base: self.kernel_args(&mut launch, p, q, k, v, out, lse),
            maps: launch.read(&maps.buffer),
        };
        // SAFETY: `args` is the argument struct of
        // `prefill_wgmma_{,lse_,masked_}attention_{bf16,f16}_d{64,128}` (in the loaded sm_90a module:
        // the plan chose these kernels only there), of the buffers registered above; the plan,
        // tensors, masks and `lse` were validated as for `launch` (the work items are tiles of
        // the kernel's query blocks, `Kernel::tile_q_blocks`); the maps in `maps.buffer` describe
        // these `q` (`query_rows` rows), `k`, `v` (`tokens` rows) at these strides, written on
        // this stream before the launch; the grid is `(items, q_heads)`, the block and shared
        // memory are what the kernel is written for.
        unsafe { launch.launch(cfg, &args) }?;
        Ok(())
    }

    /// Checks that `q`, `k`, `v`, `out` hold the planned tokens by [`Tokens`]' rule and that `k`
    /// and `v` share a stride; returns the strides.
    fn check_tensors<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        q: &Tokens<'_, E>,
        k: &Tokens<'_, E>,
        v: &Tokens<'_, E>,
        out: &TokensMut<'_, E>,
    ) -> Result<TokenStrides> {
        let p = &self.params;
        let (t, tq, hq, hkv, d) = (
            self.tokens,
            self.q_tokens,
            p.q_heads as usize,
            p.kv_heads as usize,
            self.head_dim,
        );
        Ok(TokenStrides {
            q: q.heads_stride(gpu, "q", tq, hq, d)?,
            kv: kv_stride(gpu, k, v, t, hkv, d)?,
            out: out.heads_stride(gpu, "out", tq, hq, d)?,
        })
    }
}

/// Prefill attention of a ragged batch on plain device tensors: [`PrefillPlan::new`] then
/// [`PrefillPlan::run`] (allocates the plan; keep a plan to launch without allocating).
///
/// ```no_run
/// use lserve::gpu::{prefill_attention, GpuContext, PrefillArgs};
/// use lserve::head_pattern::HeadKind;
/// let gpu = GpuContext::new(0)?;
/// let (t, hq, hkv, d) = (300, 8, 2, 128);
/// let q = gpu.stream().alloc_zeros::<half::bf16>(t * hq * d)?;
/// let k = gpu.stream().alloc_zeros::<half::bf16>(t * hkv * d)?;
/// let v = gpu.stream().alloc_zeros::<half::bf16>(t * hkv * d)?;
/// let mut out = gpu.stream().alloc_zeros::<half::bf16>(t * hq * d)?;
/// let args = PrefillArgs {
///     q_heads: hq, kv_heads: hkv, head_dim: d,
///     cu_seqlens: &[0, 100, 300],
///     kinds: &[HeadKind::Dense, HeadKind::Streaming],
///     sink_tokens: 64, local_tokens: 256,
///     block_masks: None, softmax_scale: None, prefix_lens: None, with_lse: false,
/// };
/// prefill_attention(&gpu, &args, &q, &k, &v, &mut out)?;
/// # Ok::<(), lserve::LserveError>(())
/// ```
pub fn prefill_attention<'t, E: DeviceElement>(
    gpu: &GpuContext,
    args: &PrefillArgs<'_>,
    q: impl Into<Tokens<'t, E>>,
    k: impl Into<Tokens<'t, E>>,
    v: impl Into<Tokens<'t, E>>,
    out: impl Into<TokensMut<'t, E>>,
) -> Result<()> {
    PrefillPlan::new(gpu, args)?.run(gpu, q, k, v, out)
}

/// The attention arguments of `layer` of `cache` for the batch `cu_seqlens` (its head kinds,
/// sink / local tokens and softmax scale); `InvalidArgument` for a layer out of range.
fn cache_args<'a, E: DeviceElement>(
    cache: &'a DeviceKvCache<E>,
    layer: usize,
    cu_seqlens: &'a [usize],
    block_masks: Option<&'a [BlockMask]>,
    prefix_lens: Option<&'a [usize]>,
) -> Result<PrefillArgs<'a>> {
    let pattern = cache.pattern();
    let g = *pattern.geometry();
    if layer >= g.layers() {
        return Err(invalid(
            "layer",
            format!("{layer} is not below {}", g.layers()),
        ));
    }
    Ok(PrefillArgs {
        q_heads: g.q_heads(),
        kv_heads: g.kv_heads(),
        head_dim: g.head_dim(),
        cu_seqlens,
        kinds: pattern.layer_kinds(layer),
        sink_tokens: cache.config.sink_tokens,
        local_tokens: cache.config.local_tokens,
        block_masks,
        softmax_scale: Some(cache.softmax_scale),
        prefix_lens,
        with_lse: false,
    })
}

/// Prefill of whole prompts into the paged cache, for one layer: writes the batch's K/V into
/// `layer` of `cache` ([`write_kv_rows`]: dense heads into their pages, streaming heads their
/// sinks and last `local_tokens` tokens), pools the dense heads' logical-page key statistics
/// ([`pool_key_stats`]), and computes the attention output ([`PrefillPlan::run`]) with the
/// cache's head pattern, sink / local tokens and softmax scale.
///
/// `kv_plan` lists the prompts (each range `0..len`: the attention sees only the batch's own
/// tokens); `q [T][Hq][D]`, `k`, `v [T][Hkv][D]`, `out [T][Hq][D]` with `T = kv_plan.rows()`, the
/// tokens of each range in order, each a `&CudaSlice` or a [`Tokens`] / [`TokensMut`] view (as
/// [`PrefillPlan::run`]). `block_masks` as [`PrefillArgs::block_masks`].
///
/// Errors (nothing launched): `StaleTables` for a plan uploaded for another cache or made
/// against block-table rows the cache no longer holds; `InvalidArgument` for a range that does
/// not start at 0 or does not end at the sequence's length; the errors of [`PrefillPlan::new`], [`PrefillPlan::run`] and
/// [`write_kv_rows`]. Enqueued on the context's stream; the plan of the attention is allocated
/// here (use [`PrefillPlan`] and the two write calls directly to reuse one across layers).
#[allow(clippy::too_many_arguments)]
pub fn prefill_into_cache<'t, E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    layer: usize,
    kv_plan: &DeviceKvWritePlan,
    block_masks: Option<&[BlockMask]>,
    q: impl Into<Tokens<'t, E>>,
    k: impl Into<Tokens<'t, E>>,
    v: impl Into<Tokens<'t, E>>,
    out: impl Into<TokensMut<'t, E>>,
) -> Result<()> {
    let (q, k, v, mut out) = (q.into(), k.into(), v.into(), out.into());
    kv_plan.check_current(cache)?;
    for r in kv_plan.plan().ranges() {
        if r.start != 0 || r.end != r.len {
            return Err(invalid(
                "kv_plan",
                format!(
                    "range {}..{} of a sequence of {}: prefill attention needs whole prompts (0..len)",
                    r.start, r.end, r.len
                ),
            ));
        }
    }
    let cu: Vec<usize> = kv_plan
        .plan()
        .cu_seqlens()
        .iter()
        .map(|&x| x as usize)
        .collect();
    let args = cache_args(cache, layer, &cu, block_masks, None)?;
    // Every check before the first launch: the attention's plan and tensors, then the writes
    // (which check the cache and `k`, `v` before launching).
    let plan = PrefillPlan::new(gpu, &args)?;
    let strides = plan.check_tensors(gpu, &q, &k, &v, &out)?;
    write_kv_rows(gpu, cache, layer, kv_plan, k.reborrow(), v.reborrow())?;
    if let KvFormat::Float(_) = cache.format() {
        // (A coded cache's statistics were computed by the row write, from `k`.)
        pool_key_stats(gpu, cache, layer, kv_plan)?;
    }
    plan.launch(gpu, strides, &q, &k, &v, &mut out, None)
}

/// Contiguous K/V rows for [`prefill_chunks_into_cache`]: each sequence's cached positions and
/// its new chunk, gathered per layer so that the chunk's attention reads them as a whole
/// prompt's (`[rows][kv_heads][head_dim]` each for K and V). Allocated once for the longest
/// batch (the sum over a batch of its sequences' lengths after the chunk) and reused by every
/// layer and chunk.
pub struct PrefillScratch<E> {
    k: CudaSlice<E>,
    v: CudaSlice<E>,
    rows: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl<E: DeviceElement> PrefillScratch<E> {
    /// Room for `rows` positions of `geometry`'s KV heads (zeroed), `2 * rows * Hkv * D`
    /// elements.
    ///
    /// Errors: `InvalidArgument` for `rows == 0` or a size that overflows; driver errors.
    ///
    /// ```no_run
    /// use lserve::geometry::ModelGeometry;
    /// use lserve::gpu::{GpuContext, PrefillScratch};
    /// let gpu = GpuContext::new(0)?;
    /// // Chunks of one sequence of up to 32K tokens: 32K rows (256 MiB for Llama-3-8B, bf16).
    /// let scratch = PrefillScratch::<half::bf16>::new(&gpu, &ModelGeometry::llama3_8b(), 32768)?;
    /// assert_eq!(scratch.rows(), 32768);
    /// # Ok::<(), lserve::LserveError>(())
    /// ```
    pub fn new(gpu: &GpuContext, geometry: &ModelGeometry, rows: usize) -> Result<Self> {
        let (kv_heads, head_dim) = (geometry.kv_heads(), geometry.head_dim());
        if rows == 0 {
            return Err(invalid("rows", "must be positive"));
        }
        let len = rows
            .checked_mul(kv_heads * head_dim)
            .filter(|&n| n <= u32::MAX as usize)
            .ok_or_else(|| invalid("rows", format!("{rows} rows overflow")))?;
        let stream = gpu.stream();
        Ok(Self {
            k: stream.alloc_zeros(len)?,
            v: stream.alloc_zeros(len)?,
            rows,
            kv_heads,
            head_dim,
        })
    }

    /// Positions it holds.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// Prefill of a chunk of each sequence of a batch into the paged cache, for one layer, after
/// the positions the cache already holds: the chunk's queries attend to the cached prefix and
/// to the chunk itself exactly as a one-shot prefill of the whole prompt would (dense heads
/// causal over every position; streaming heads their sinks and local window, from the
/// streaming store for cached positions), and the chunk's K/V is written into `layer` of the
/// cache with the statistics of the logical pages it touches pooled. This is also how a later
/// turn extends a sequence, and how a few query tokens attend to the cache at once (a
/// speculative decoding verify step).
///
/// `kv_plan` lists each sequence's chunk: a range `start..len` (ending at the sequence's
/// length; `start` is the cached prefix, 0 for a first chunk). `q [T][Hq][D]`, `k`, `v
/// [T][Hkv][D]`, `out [T][Hq][D]` hold the chunks' rows (`T = kv_plan.rows()`), as
/// [`prefill_into_cache`]. `scratch` must hold the batch's whole lengths (`Σ len`). The result
/// is bit for bit the output rows of [`prefill_into_cache`] over the whole prompts: the chunk's
/// tiles are the one-shot launch's tiles, and they visit the same key blocks in the same order.
///
/// Per sequence with a prefix, the launch reads its cached rows into `scratch`
/// (`gather_kv_rows`: every position below `start` of every KV head, `2 · len · Hkv · D`
/// elements written), then writes the chunk into the cache, pools, and runs the attention over
/// `scratch`. A batch whose ranges all start at 0 is [`prefill_into_cache`] (no gather).
///
/// Over an integer-coded cache ([`DeviceKvCache::new_coded`]) the cached positions are what the
/// cache holds: their codes dequantized (`fma(c, s, m)` in f32, as
/// `reference::quant::QuantizedRows::dequantize_row`) and rounded to `E`, while the chunk's own
/// positions are its activations, as in a one-shot prefill; the chunk is quantized into the
/// cache as [`write_kv_rows`] does. So a chunked prefill equals the one-shot one over the
/// prompt whose prefix rows are those dequantized rows (not bit for bit the one-shot prefill of
/// the unquantized prompt).
///
/// Errors (nothing launched): `StaleTables` as [`prefill_into_cache`]; `InvalidArgument` for a
/// range that does not end at its sequence's length or an empty one, a bad layer;
/// `ShapeMismatch` for tensors shorter than the chunks or a scratch shorter than the batch's
/// lengths; the errors of [`PrefillPlan::new`] and [`write_kv_rows`]. Enqueued on the context's
/// stream; allocates the attention's plan and the gather's ranges.
///
/// ```no_run
/// use half::bf16;
/// use lserve::config::SparsityConfig;
/// use lserve::geometry::ModelGeometry;
/// use lserve::gpu::{prefill_chunks_into_cache, DeviceKvCache, GpuContext, KvWritePlan, PrefillScratch};
/// use lserve::head_pattern::HeadPattern;
/// use lserve::paging::KvCacheManager;
///
/// let gpu = GpuContext::new(0)?;
/// let g = ModelGeometry::llama3_8b();
/// let mut mgr = KvCacheManager::new(g, HeadPattern::interleaved(g, 0.5)?, SparsityConfig::default(), 4096, 1, 65536)?;
/// let mut cache = DeviceKvCache::<bf16>::new(&gpu, &mgr)?;
/// let mut scratch = PrefillScratch::<bf16>::new(&gpu, &g, 65536)?;
/// let seq = mgr.add_sequence()?;
/// let (hq, hkv, d, chunk) = (g.q_heads(), g.kv_heads(), g.head_dim(), 8192);
/// let q = gpu.stream().alloc_zeros::<bf16>(chunk * hq * d)?;
/// let kv = gpu.stream().alloc_zeros::<bf16>(chunk * hkv * d)?;
/// let mut out = gpu.stream().alloc_zeros::<bf16>(chunk * hq * d)?;
/// for _ in 0..4 {
///     // The engine's Q/K/V of the next 8K tokens (zeros here), layer by layer.
///     let range = mgr.reserve(seq, chunk)?;
///     let plan = KvWritePlan::new(&mgr, &[(seq, range)])?.upload(&gpu, &mgr, &mut cache)?;
///     for layer in 0..g.layers() {
///         prefill_chunks_into_cache(&gpu, &mut cache, layer, &plan, &mut scratch, &q, &kv, &kv, &mut out)?;
///     }
/// }
/// # Ok::<(), lserve::LserveError>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn prefill_chunks_into_cache<'t, E: DeviceElement>(
    gpu: &GpuContext,
    cache: &mut DeviceKvCache<E>,
    layer: usize,
    kv_plan: &DeviceKvWritePlan,
    scratch: &mut PrefillScratch<E>,
    q: impl Into<Tokens<'t, E>>,
    k: impl Into<Tokens<'t, E>>,
    v: impl Into<Tokens<'t, E>>,
    out: impl Into<TokensMut<'t, E>>,
) -> Result<()> {
    let ranges = kv_plan.plan().ranges();
    if ranges.iter().all(|r| r.start == 0) {
        return prefill_into_cache(gpu, cache, layer, kv_plan, None, q, k, v, out);
    }
    let (q, k, v, mut out) = (q.into(), k.into(), v.into(), out.into());
    kv_plan.check_current(cache)?;
    let g = *cache.pattern().geometry();
    if let Some(r) = ranges.iter().find(|r| r.end != r.len || r.start == r.end) {
        return Err(invalid(
            "kv_plan",
            format!(
                "range {}..{} of a sequence of {}: a prefill chunk is a non-empty range that ends \
                 at the sequence's length",
                r.start, r.end, r.len
            ),
        ));
    }
    if (scratch.kv_heads, scratch.head_dim) != (g.kv_heads(), g.head_dim()) {
        return Err(invalid(
            "scratch",
            "made for another geometry's KV heads or head dimension",
        ));
    }
    // The gathered rows: sequence after sequence, each from position 0.
    let mut cu = vec![0usize];
    for r in ranges {
        cu.push(cu[cu.len() - 1] + r.len as usize);
    }
    let total = cu[cu.len() - 1];
    if total > scratch.rows {
        return Err(LserveError::ShapeMismatch {
            what: "scratch rows (the batch's lengths after the chunk)",
            expected: total,
            actual: scratch.rows,
        });
    }
    let prefixes: Vec<usize> = ranges.iter().map(|r| r.start as usize).collect();
    let args = cache_args(cache, layer, &cu, None, Some(&prefixes))?;
    let plan = PrefillPlan::new(gpu, &args)?;
    // `q` and `out` hold the chunks; `k` and `v` are checked by the gather and the write.
    let q_stride = q.heads_stride(gpu, "q", plan.query_rows(), g.q_heads(), g.head_dim())?;
    let out_stride = out.heads_stride(gpu, "out", plan.query_rows(), g.q_heads(), g.head_dim())?;
    let kv = kv_stride(
        gpu,
        &k,
        &v,
        kv_plan.plan().rows(),
        g.kv_heads(),
        g.head_dim(),
    )?;
    let gathered: Vec<u32> = ranges
        .iter()
        .zip(&cu)
        .flat_map(|(r, &row)| [r.slot, r.start, r.end, r.first_row, row as u32])
        .collect();
    let gathered = gpu.stream().clone_htod(&gathered)?;
    // The gather reads the streaming rows the write then replaces.
    gather_kv_rows(
        gpu,
        cache,
        layer,
        &gathered,
        ranges.len(),
        ranges.iter().map(|r| r.end).max().unwrap_or(0),
        kv,
        &k,
        &v,
        &mut scratch.k,
        &mut scratch.v,
    )?;
    write_kv_rows(gpu, cache, layer, kv_plan, k.reborrow(), v.reborrow())?;
    if let KvFormat::Float(_) = cache.format() {
        // (A coded cache's statistics were computed by the row write, from `k`.)
        pool_key_stats(gpu, cache, layer, kv_plan)?;
    }
    let strides = TokenStrides {
        q: q_stride,
        kv: g.kv_heads() as u32,
        out: out_stride,
    };
    let (sk, sv) = (Tokens::from(&scratch.k), Tokens::from(&scratch.v));
    plan.launch(gpu, strides, &q, &sk, &sv, &mut out, None)
}

#[cfg(test)]
mod tests {
    use super::super::launch::ptx_has_kernel;
    use super::*;
    use half::{bf16, f16};

    /// Every head dimension `ModelGeometry::new` accepts has both prefill kernels in the PTX,
    /// in both element types (the kernels take the group as a launch parameter), and the cache
    /// writes exist for both element types.
    #[test]
    fn every_accepted_head_dim_has_its_prefill_kernels() {
        for &d in &ModelGeometry::SUPPORTED_HEAD_DIMS {
            for kernel in [Kernel::Attention, Kernel::Lse, Kernel::Masked] {
                for name in [kernel.name::<bf16>(d), kernel.name::<f16>(d)] {
                    assert!(ptx_has_kernel(&name), "{name} is not in the PTX");
                }
            }
        }
        for name in [
            "write_kv_rows_bf16",
            "write_kv_rows_f16",
            "gather_kv_rows_bf16",
            "gather_kv_rows_f16",
            "pool_key_stats_bf16",
            "pool_key_stats_f16",
            "append_kv_bf16",
            "append_kv_f16",
        ] {
            assert!(ptx_has_kernel(name), "{name} is not in the PTX");
        }
    }
}
