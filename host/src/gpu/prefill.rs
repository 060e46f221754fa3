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

use cudarc::driver::{CudaSlice, LaunchConfig};
use lserve_abi::decode::HEAD_STREAMING;
use lserve_abi::layout::TokenStrides;
use lserve_abi::prefill::{
    mask_words_per_row, prefill_smem_bytes, PrefillArgs as KernelArgs, PrefillParams,
    PrefillWorkItem, BLOCK_Q, MASKED_TILE_Q_BLOCKS, PREFILL_THREADS, TILE_Q_BLOCKS,
};

use super::cache::{DeviceElement, DeviceKvCache};
use super::kv_write::{pool_key_stats, write_kv_rows, DeviceKvWritePlan};
use super::launch::Launch;
use super::tokens::{kv_stride, Tokens, TokensMut};
use super::GpuContext;
use crate::block_iter::{num_blocks, BlockMask};
use crate::error::invalid;
use crate::geometry::ModelGeometry;
use crate::head_pattern::HeadKind;
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
}

/// A prefill batch's schedule on the device (see the module docs).
pub struct PrefillPlan {
    params: PrefillParams,
    /// `[items]` [`PrefillWorkItem`]s as words.
    items: CudaSlice<u32>,
    /// `[kv_heads]` kinds (`HEAD_STREAMING` bit), as `DeviceLayer::head_map` entries.
    head_map: CudaSlice<u32>,
    /// All sequences' mask words, concatenated (one unused word without masks).
    mask: CudaSlice<u32>,
    tokens: usize,
    head_dim: usize,
}

fn to_u32(what: &'static str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| invalid(what, format!("{x} does not fit in 32 bits")))
}

/// The kernel for an element type and head dimension: `prefill_masked_attention_*` (one query
/// block per work item) for launches with caller block masks, `prefill_attention_*` (two query
/// blocks per work item) otherwise.
fn kernel_name<E: DeviceElement>(head_dim: usize, masked: bool) -> String {
    let kind = if masked {
        "masked_attention"
    } else {
        "attention"
    };
    format!("prefill_{kind}_{}_d{head_dim}", E::DTYPE.name())
}

/// Query blocks per work item of the kernel a launch uses (see [`kernel_name`]).
fn tile_q_blocks(masked: bool) -> u32 {
    if masked {
        MASKED_TILE_Q_BLOCKS
    } else {
        TILE_Q_BLOCKS
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

    /// The work items, one per query tile of the kernel the launch uses ([`TILE_Q_BLOCKS`] query
    /// blocks without masks, [`MASKED_TILE_Q_BLOCKS`] with; heaviest first: causal work grows
    /// with the block index) and the concatenated mask words.
    fn schedule(&self) -> Result<(Vec<u32>, Vec<u32>)> {
        let tile_blocks = tile_q_blocks(self.block_masks.is_some()) as usize;
        let mut items = Vec::new();
        let mut mask_words = Vec::new();
        for (b, w) in self.cu_seqlens.windows(2).enumerate() {
            let (start, len) = (w[0], w[1] - w[0]);
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
            for q_block in (0..blocks).step_by(tile_blocks) {
                items.push(PrefillWorkItem {
                    seq_start: start as u32,
                    seq_len: len as u32,
                    q_block: q_block as u32,
                    mask_row: mask_base + (q_block * words_per_row) as u32,
                    mask_head_stride: head_stride as u32,
                });
            }
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
                ]
            })
            .collect();
        if mask_words.is_empty() {
            mask_words.push(0);
        }
        Ok((words, mask_words))
    }
}

const _: () = assert!(ITEM_WORDS == 5 && BLOCK_Q == 64);

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
        let (items, mask_words) = args.schedule()?;
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
        Ok(Self {
            params,
            items: stream.clone_htod(&items)?,
            head_map: stream.clone_htod(&head_map)?,
            mask: stream.clone_htod(&mask_words)?,
            tokens,
            head_dim: args.head_dim,
        })
    }

    /// Tokens in the batch (`T`).
    pub fn tokens(&self) -> usize {
        self.tokens
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
        self.launch(gpu, strides, &q, &k, &v, &mut out)
    }

    /// Enqueues the kernel on tensors [`check_tensors`](Self::check_tensors) accepted with
    /// `strides`.
    fn launch<E: DeviceElement>(
        &self,
        gpu: &GpuContext,
        strides: TokenStrides,
        q: &Tokens<'_, E>,
        k: &Tokens<'_, E>,
        v: &Tokens<'_, E>,
        out: &mut TokensMut<'_, E>,
    ) -> Result<()> {
        let d = self.head_dim;
        let p = &PrefillParams {
            strides,
            ..self.params
        };
        // The schedule was built for the kernel that matches `has_mask`.
        let masked = p.has_mask != 0;
        let smem = prefill_smem_bytes(d as u32, tile_q_blocks(masked));
        let f = gpu.function_with_smem(&kernel_name::<E>(d, masked), smem)?;
        let cfg = LaunchConfig {
            grid_dim: (p.items, p.q_heads, 1),
            block_dim: (PREFILL_THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        let mut launch = Launch::new(gpu, &f);
        let args = KernelArgs {
            params: *p,
            items: launch.read(&self.items).cast(),
            head_map: launch.read(&self.head_map),
            mask: launch.read(&self.mask),
            q: launch.read(q.view()).cast(),
            k: launch.read(k.view()).cast(),
            v: launch.read(v.view()).cast(),
            out: launch.write(out.view_mut()).cast(),
        };
        // SAFETY: `args` is the argument struct of
        // `prefill_{masked_,}attention_{bf16,f16}_d{64,128}`, of the buffers registered above. The plan was validated: every work item's sequence lies
        // inside `T` tokens, which the tensors hold at their strides (`check_tensors`: views
        // 16-byte aligned, strides whole heads of `D` elements, 16-byte multiples); `head_map` has
        // `kv_heads` entries and `group = q_heads / kv_heads`; the work items are tiles of the
        // chosen kernel's query blocks (`tile_q_blocks(masked)`, built by `schedule` from the
        // same `block_masks`); with a mask (the masked kernel), every item's row offset plus
        // `mask_words_per_row(len)` words lies inside the uploaded mask words (each sequence's
        // mask was shape-checked: `[q_heads][q_blocks][words_per_row]`). The grid is
        // `(items, q_heads)`, the block and shared memory are what the kernel is written for.
        unsafe { launch.launch(cfg, &args) }?;
        Ok(())
    }
}

impl PrefillPlan {
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
        let (t, hq, hkv, d) = (
            self.tokens,
            p.q_heads as usize,
            p.kv_heads as usize,
            self.head_dim,
        );
        Ok(TokenStrides {
            q: q.heads_stride(gpu, "q", t, hq, d)?,
            kv: kv_stride(gpu, k, v, t, hkv, d)?,
            out: out.heads_stride(gpu, "out", t, hq, d)?,
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
///     block_masks: None, softmax_scale: None,
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
    let pattern = cache.pattern();
    if layer >= pattern.geometry().layers() {
        return Err(invalid(
            "layer",
            format!("{layer} is not below {}", pattern.geometry().layers()),
        ));
    }
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
    let g = *pattern.geometry();
    let cu: Vec<usize> = kv_plan
        .plan()
        .cu_seqlens()
        .iter()
        .map(|&x| x as usize)
        .collect();
    let args = PrefillArgs {
        q_heads: g.q_heads(),
        kv_heads: g.kv_heads(),
        head_dim: g.head_dim(),
        cu_seqlens: &cu,
        kinds: pattern.layer_kinds(layer),
        sink_tokens: cache.config.sink_tokens,
        local_tokens: cache.config.local_tokens,
        block_masks,
        softmax_scale: Some(cache.softmax_scale),
    };
    // Every check before the first launch: the attention's plan and tensors, then the writes
    // (which check the cache and `k`, `v` before launching).
    let plan = PrefillPlan::new(gpu, &args)?;
    let strides = plan.check_tensors(gpu, &q, &k, &v, &out)?;
    write_kv_rows(gpu, cache, layer, kv_plan, k.reborrow(), v.reborrow())?;
    pool_key_stats(gpu, cache, layer, kv_plan)?;
    plan.launch(gpu, strides, &q, &k, &v, &mut out)
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
            for masked in [false, true] {
                for name in [
                    kernel_name::<bf16>(d, masked),
                    kernel_name::<f16>(d, masked),
                ] {
                    assert!(ptx_has_kernel(&name), "{name} is not in the PTX");
                }
            }
        }
        for name in [
            "write_kv_rows_bf16",
            "write_kv_rows_f16",
            "pool_key_stats_bf16",
            "pool_key_stats_f16",
            "append_kv_bf16",
            "append_kv_f16",
        ] {
            assert!(ptx_has_kernel(name), "{name} is not in the PTX");
        }
    }
}
