//! `PagedAttention`: unified attention over a paged KV cache for a mixed
//! batch of prefills, chunked prefills and decodes, in one call.
//!
//! Imports `params` and the backends; nothing above it (`attention`,
//! `cache`, `metadata`, `models`).

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor};

use crate::params::{check_scale, AttentionDims, KvSplit, PagedAttentionParams, MAX_HEAD_SIZE};

const OP: &str = "paged-attention";

fn check_device(name: &str, t: &Tensor, device: &Device) -> Result<()> {
    if !t.device().same_device(device) {
        bail!(
            "{OP}: {name} is on {:?} but the query is on {:?}",
            t.device().location(),
            device.location()
        );
    }
    Ok(())
}

fn check_head_vector(name: &str, t: &Tensor, num_heads: usize, device: &Device) -> Result<()> {
    check_device(name, t, device)?;
    if t.dtype() != DType::F32 {
        bail!("{OP}: {name} must be f32, got {:?}", t.dtype());
    }
    if t.dims() != [num_heads] {
        bail!(
            "{OP}: {name} must have shape [num_heads = {num_heads}], got {:?}",
            t.dims()
        );
    }
    Ok(())
}

impl PagedAttentionParams {
    /// Checks the call against the query's dtype, shape and device; O(1) in
    /// the batch size (the batch was checked when it was built).
    pub fn validate(
        &self,
        q_dtype: DType,
        q_shape: &Shape,
        q_device: &Device,
    ) -> Result<AttentionDims> {
        if !matches!(q_dtype, DType::F32 | DType::F16 | DType::BF16) {
            bail!("{OP}: q must be f32, f16 or bf16, got {q_dtype:?}");
        }
        let &[num_tokens, num_heads, head_size] = q_shape.dims() else {
            bail!(
                "{OP}: q must have rank 3 [num_tokens, num_heads, head_size], got shape {:?}",
                q_shape.dims()
            );
        };
        let kc = &self.key_cache;
        let vc = &self.value_cache;
        check_device("key_cache", kc, q_device)?;
        check_device("value_cache", vc, q_device)?;
        let &[num_blocks, block_size, num_kv_heads, cache_head_size] = kc.dims() else {
            bail!(
                "{OP}: key_cache must have rank 4 [num_blocks, block_size, num_kv_heads, head_size], got shape {:?}",
                kc.dims()
            );
        };
        if vc.dims() != kc.dims() {
            bail!(
                "{OP}: value_cache shape {:?} differs from key_cache shape {:?}",
                vc.dims(),
                kc.dims()
            );
        }
        if kc.dtype() != vc.dtype() {
            bail!(
                "{OP}: key_cache is {:?} but value_cache is {:?}",
                kc.dtype(),
                vc.dtype()
            );
        }
        if kc.dtype() != q_dtype && kc.dtype() != DType::F8E4M3 {
            bail!(
                "{OP}: key_cache must be {q_dtype:?} (the query dtype) or F8E4M3, got {:?}",
                kc.dtype()
            );
        }
        if !kc.is_contiguous() || !vc.is_contiguous() {
            bail!("{OP}: key_cache and value_cache must be contiguous");
        }
        if head_size == 0 || head_size > MAX_HEAD_SIZE {
            bail!("{OP}: head_size must be in 1..={MAX_HEAD_SIZE}, got {head_size}");
        }
        if cache_head_size != head_size {
            bail!(
                "{OP}: q has head_size {head_size} but key_cache has head_size {cache_head_size}"
            );
        }
        if num_heads == 0 {
            bail!("{OP}: q has 0 heads; num_heads must be at least 1");
        }
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            bail!("{OP}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}");
        }
        let host = self.batch.host();
        check_device("batch", self.batch.seq_lens(), q_device)?;
        if host.num_tokens() != num_tokens {
            bail!(
                "{OP}: cu_seqlens_q ends at {} but q has {num_tokens} tokens",
                host.num_tokens()
            );
        }
        if host.block_size() != block_size {
            bail!(
                "{OP}: the batch was built for block_size {} but the cache has block_size {block_size}",
                host.block_size()
            );
        }
        if let Some(id) = host.max_block_id() {
            if id as usize >= num_blocks {
                bail!("{OP}: block_tables holds block id {id} >= num_blocks {num_blocks}");
            }
        }
        if !(self.scale.is_finite()) {
            bail!("{OP}: scale must be finite, got {}", self.scale);
        }
        if let Some(w) = self.sliding_window {
            if w == 0 {
                bail!("{OP}: sliding_window must be at least 1, got 0 (use None for no window)");
            }
        }
        if let Some(c) = self.softcap {
            if !(c >= 0.0 && c.is_finite()) {
                bail!("{OP}: softcap must be finite and >= 0 (0 is off), got {c}");
            }
        }
        if let Some(s) = &self.alibi_slopes {
            check_head_vector("alibi_slopes", s, num_heads, q_device)?;
        }
        if let Some(s) = &self.sinks {
            check_head_vector("sinks", s, num_heads, q_device)?;
        }
        if let Some(b) = &self.qq_bias {
            check_device("qq_bias", b, q_device)?;
            if b.dtype() != DType::F32 {
                bail!("{OP}: qq_bias must be f32, got {:?}", b.dtype());
            }
            let &[rows, _cols] = b.dims() else {
                bail!(
                    "{OP}: qq_bias must have rank 2 [rows, cols], got shape {:?}",
                    b.dims()
                );
            };
            if rows < host.max_seqlen_q() {
                bail!(
                    "{OP}: qq_bias has {rows} rows but the longest query span is {}",
                    host.max_seqlen_q()
                );
            }
        }
        if kc.dtype() == DType::F8E4M3 {
            self.kv_scales.validate(OP)?;
        }
        if let Some(s) = self.output_scale {
            check_scale(OP, "output_scale", s)?;
        }
        if let KvSplit::Segments(0) = self.kv_split {
            bail!("{OP}: kv_split Segments(0): need at least one segment");
        }
        Ok(AttentionDims {
            num_tokens,
            num_heads,
            num_kv_heads,
            head_size,
            num_blocks,
            block_size,
        })
    }
}

/// The op: applied to the flat query `(num_tokens, num_heads, head_size)`,
/// it returns the attention output of the same shape (dtype of the query, or
/// `F8E4M3` with an output scale). Use it through [`paged_attention`].
pub struct PagedAttention<'a> {
    /// Caches, batch and options of the call.
    pub params: &'a PagedAttentionParams,
}

impl CustomOp1 for PagedAttention<'_> {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = self
            .params
            .validate(storage.dtype(), layout.shape(), &Device::Cpu)?;
        crate::cpu::paged_attention::forward(self.params, &dims, storage, layout)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let device = Device::Cuda(storage.device().clone());
        let dims = self
            .params
            .validate(storage.dtype(), layout.shape(), &device)?;
        crate::cuda::paged_attention::forward(self.params, &dims, storage, layout)
    }
}

/// How the CUDA path launches `paged_attention(q, params)`, in words: the
/// tile shape of each launch (`stream`: stream decode, 8 or 16 packed query
/// rows per program; `decode`: the unified kernel's 16-row decode programs;
/// `prefill`: 128 or 64, `prefill-wgmma`: 128 or 64 rows with Hopper's
/// warpgroup MMAs, `prefill-wgmma-ws`: 128 rows, warp-specialised), its split-KV segments and who merges them, e.g.
/// `"stream split-kv(16)"`, `"decode split-kv(3) + reduce"` or
/// `"stream split-kv(4) + prefill-wgmma"`. For
/// benchmarks and logs; `q` is `(num_tokens, num_heads, head_size)` on a
/// CUDA device.
#[cfg(feature = "cuda")]
pub fn cuda_launch_plan(q: &Tensor, params: &PagedAttentionParams) -> Result<String> {
    let dims = params.validate(q.dtype(), q.shape(), q.device())?;
    match q.device() {
        Device::Cuda(dev) => crate::cuda::describe::describe(params, &dims, dev, q.dtype()),
        other => bail!(
            "{OP}: cuda_launch_plan needs a cuda device, got {:?}",
            other.location()
        ),
    }
}

/// The launches of `paged_attention(q, params)` on CUDA, each with the
/// programs per SM its plan assumed and the driver's occupancy of the kernel
/// it runs (empty for f32 queries). Not part of the API: it exists so that a
/// GPU test can check the plan against the device; `q` is
/// `(num_tokens, num_heads, head_size)` on a CUDA device.
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub fn cuda_launch_residency(
    q: &Tensor,
    params: &PagedAttentionParams,
) -> Result<Vec<crate::cuda::describe::LaunchResidency>> {
    let dims = params.validate(q.dtype(), q.shape(), q.device())?;
    match q.device() {
        Device::Cuda(dev) => crate::cuda::describe::launch_residency(params, &dims, dev, q.dtype()),
        other => bail!(
            "{OP}: cuda_launch_residency needs a cuda device, got {:?}",
            other.location()
        ),
    }
}

/// Paged attention for a mixed batch of prefills, chunked prefills and
/// decodes, in one call.
///
/// # Arguments
/// * `q` - query, `(num_tokens, num_heads, head_size)`, f32/f16/bf16; rows of
///   sequence `i` are `cu_seqlens_q[i]..cu_seqlens_q[i + 1]`.
/// * `params` - caches, batch description and options.
///
/// Returns `(num_tokens, num_heads, head_size)` in the query's dtype, or
/// `F8E4M3` when `params.output_scale` is set. A query row that sees no key
/// (and no sink mass) is zero.
///
/// NaN is never hidden: NaN or +-inf in a query row, or NaN in a key, an
/// ALiBi slope or a `qq_bias` entry that the row sees, makes the whole row
/// NaN, and a NaN in a value it sees makes its columns NaN, as dense
/// attention does. Keys a row does not see never reach it, whatever the
/// cache holds there (on CUDA, a NaN *value* of a key that another row of
/// the same tile sees may also reach the rows of that tile that mask it, as
/// `0 * NaN` does in dense attention with an additive mask).
pub fn paged_attention(q: &Tensor, params: &PagedAttentionParams) -> Result<Tensor> {
    params.validate(q.dtype(), q.shape(), q.device())?;
    let q = q.contiguous()?;
    q.apply_op1_no_bwd(&PagedAttention { params })
}
