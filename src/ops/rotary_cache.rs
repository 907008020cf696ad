//! `rotary_reshape_and_cache`: the rotary embedding of a joined q/k/v
//! projection fused with the cache write of its keys and values. One kernel
//! on CUDA where the unfused path runs a rotation per q and k, casts and
//! two cache writes.
//!
//! Imports `batch`, `params`, the `reshape_and_cache` op's checks and the
//! backends.

use candle_core::{bail, DType, Result, Tensor};
#[cfg(feature = "cuda")]
use candle_core::{CpuStorage, Layout, Shape};

use crate::batch::SlotMapping;
use crate::ops::reshape_and_cache::{reshape_and_cache, validate_write, NewRows};
use crate::ops::storage_address;
use crate::params::KvScales;

const OP: &str = "rotary-reshape-and-cache";

/// The rotary rows of a batch's tokens: `cos` and `sin` `(num_tokens,
/// head_size / 2)` in the model's dtype, and the pairing of the rotated
/// elements.
#[derive(Clone, Copy, Debug)]
pub struct RotaryRows<'a> {
    /// `(num_tokens, head_size / 2)`.
    pub cos: &'a Tensor,
    /// `(num_tokens, head_size / 2)`, cos's dtype.
    pub sin: &'a Tensor,
    /// Pairs `(2i, 2i + 1)` (GGUF Llama) instead of `(i, i + head_size / 2)`.
    pub interleaved: bool,
}

/// Rotates `x` `(num_tokens, heads * head_size)` of the rows' dtype by
/// candle's rotary ops (the unfused path); returns x's shape.
pub(crate) fn rotate(x: &Tensor, rows: RotaryRows<'_>, heads: usize) -> Result<Tensor> {
    let (n, half) = rows.cos.dims2()?;
    let x = x.reshape((n, heads, 1, 2 * half))?.contiguous()?;
    let (cos, sin) = (
        rows.cos.reshape((n, 1, half))?,
        rows.sin.reshape((n, 1, half))?,
    );
    let y = if rows.interleaved {
        candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?
    } else {
        candle_nn::rotary_emb::rope(&x, &cos, &sin)?
    };
    y.reshape((n, heads * 2 * half))
}

/// The unfused computation, on any device: cast, rotate, store. Returns
/// the rotated queries.
fn unfused(
    qkv: &Tensor,
    rows: RotaryRows<'_>,
    heads: (usize, usize, usize),
    caches: (&Tensor, &Tensor),
    slot_mapping: &SlotMapping,
    scales: KvScales,
) -> Result<Tensor> {
    let (h, kvh, d) = heads;
    let n = qkv.dim(0)?;
    let qkv = qkv.to_dtype(rows.cos.dtype())?;
    let q = rotate(&qkv.narrow(1, 0, h * d)?, rows, h)?;
    let k = rotate(&qkv.narrow(1, h * d, kvh * d)?, rows, kvh)?;
    let v = qkv.narrow(1, (h + kvh) * d, kvh * d)?;
    reshape_and_cache(
        &k.reshape((n, kvh, d))?,
        &v.contiguous()?.reshape((n, kvh, d))?,
        caches.0,
        caches.1,
        slot_mapping,
        scales,
    )?;
    Ok(q)
}

/// The fused op: a `CustomOp3` on `(qkv, cos, sin)` that returns the
/// rotated queries and writes the caches it holds.
#[cfg(feature = "cuda")]
struct Fused<'a> {
    heads: usize,
    interleaved: bool,
    key_cache: &'a Tensor,
    value_cache: &'a Tensor,
    slots: &'a Tensor,
    scales: KvScales,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp3 for Fused<'_> {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("{OP}: the fused kernel runs on CUDA only (the CPU runs the unfused ops)")
    }

    fn cuda_fwd(
        &self,
        qkv: &candle_core::CudaStorage,
        qkv_l: &Layout,
        cos: &candle_core::CudaStorage,
        cos_l: &Layout,
        sin: &candle_core::CudaStorage,
        sin_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (kc, kc_l) = self.key_cache.storage_and_layout();
        let (vc, vc_l) = self.value_cache.storage_and_layout();
        let (slots, slots_l) = self.slots.storage_and_layout();
        let q = crate::cuda::rotary_cache::forward(
            OP,
            crate::cuda::rotary_cache::Rotation {
                heads: self.heads,
                interleaved: self.interleaved,
                scales: self.scales,
            },
            (qkv, qkv_l),
            (cos, cos_l),
            (sin, sin_l),
            (&kc, kc_l),
            (&vc, vc_l),
            (&slots, slots_l),
        )?;
        let n = qkv_l.dims()[0];
        let d = kc_l.dims()[3];
        Ok((q, Shape::from((n, self.heads * d))))
    }
}

/// Rotates the queries and keys of a joined q/k/v projection and stores the
/// keys and values into the paged caches, in place; returns the rotated
/// queries. On CUDA one kernel does it all; elsewhere it runs the unfused
/// ops (cast, candle's rotary ops, [`reshape_and_cache`]).
///
/// # Arguments
/// * `qkv` - `(num_tokens, (num_heads + 2 * num_kv_heads) * head_size)`:
///   each row's query heads, key heads, then value heads; in the rotary
///   rows' dtype or f32 (a quantized matmul's output), rounded to that
///   dtype first.
/// * `rows` - the tokens' rotary rows, `(num_tokens, head_size / 2)`; their
///   dtype is the queries' and the caches'.
/// * `num_heads` - query heads.
/// * `key_cache`, `value_cache`, `slot_mapping`, `scales` - as in
///   [`reshape_and_cache`].
///
/// Returns `(num_tokens, num_heads * head_size)` in the rows' dtype (empty,
/// with nothing stored, for 0 tokens). The rotation is computed in f32 and rounded once on CUDA; candle's CPU
/// rotary ops round as they go for f16/bf16.
pub fn rotary_reshape_and_cache(
    qkv: &Tensor,
    rows: RotaryRows<'_>,
    num_heads: usize,
    key_cache: &Tensor,
    value_cache: &Tensor,
    slot_mapping: &SlotMapping,
    scales: KvScales,
) -> Result<Tensor> {
    let &[num_tokens, width] = qkv.dims() else {
        bail!(
            "{OP}: qkv must be (num_tokens, (heads + 2 kv_heads) x head_size), got {:?}",
            qkv.dims()
        );
    };
    let &[_, _, kvh, d] = key_cache.dims() else {
        bail!(
            "{OP}: key_cache must have rank 4 [num_blocks, block_size, num_kv_heads, head_size], got shape {:?}",
            key_cache.dims()
        );
    };
    if key_cache.dims() != value_cache.dims() {
        bail!(
            "{OP}: key_cache shape {:?} differs from value_cache shape {:?}",
            key_cache.dims(),
            value_cache.dims()
        );
    }
    if num_heads == 0 || d % 2 != 0 || width != (num_heads + 2 * kvh) * d {
        bail!(
            "{OP}: qkv has {width} columns, not ({num_heads} heads + 2 x {kvh} kv heads) x head_size {d} (even)"
        );
    }
    let dtype = rows.cos.dtype();
    if rows.cos.dims() != [num_tokens, d / 2] || rows.sin.dims() != rows.cos.dims() {
        bail!(
            "{OP}: cos and sin must be ({num_tokens}, {}), got {:?} and {:?}",
            d / 2,
            rows.cos.dims(),
            rows.sin.dims()
        );
    }
    if rows.sin.dtype() != dtype || (qkv.dtype() != dtype && qkv.dtype() != DType::F32) {
        bail!(
            "{OP}: sin is {:?} and qkv {:?}; they must be cos's {dtype:?} (qkv may be f32)",
            rows.sin.dtype(),
            qkv.dtype()
        );
    }
    for (name, cache) in [("key", key_cache), ("value", value_cache)] {
        let new = NewRows {
            num_tokens,
            num_kv_heads: kvh,
            head_size: d,
            dtype,
            device: qkv.device(),
        };
        validate_write(OP, name, &new, cache, slot_mapping)?;
    }
    if storage_address(key_cache) == storage_address(value_cache) {
        bail!(
            "{OP}: key_cache and value_cache share one allocation; they must be distinct tensors"
        );
    }
    if key_cache.dtype() == DType::F8E4M3 {
        scales.validate(OP)?;
    }
    for (name, t) in [("cos", rows.cos), ("sin", rows.sin)] {
        if !t.device().same_device(qkv.device()) {
            bail!("{OP}: {name} is not on qkv's device");
        }
    }
    if num_tokens == 0 {
        // No tokens: nothing to store, no queries to rotate.
        return Tensor::zeros((0, num_heads * d), dtype, qkv.device());
    }
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        let op = Fused {
            heads: num_heads,
            interleaved: rows.interleaved,
            key_cache,
            value_cache,
            slots: slot_mapping.slots(),
            scales,
        };
        return qkv.contiguous()?.apply_op3_no_bwd(
            &rows.cos.contiguous()?,
            &rows.sin.contiguous()?,
            &op,
        );
    }
    unfused(
        qkv,
        rows,
        (num_heads, kvh, d),
        (key_cache, value_cache),
        slot_mapping,
        scales,
    )
}
