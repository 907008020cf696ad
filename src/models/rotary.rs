//! Rotary position embeddings at per-token positions.
//!
//! The cos/sin rows are the ones candle-transformers tabulates
//! (`position x inv_freq` in f32, then cos and sin), computed for the
//! batch's tokens at their absolute positions instead of gathered from a
//! table: prefills, chunks and decodes of different sequences share one
//! call, and a long context costs no table memory.

use candle_core::{bail, DType, Device, Result, Tensor};

use crate::metadata::AttentionMetadata;
use crate::RotaryRows;

const OP: &str = "rotary-embedding";

/// Rotary embeddings of positions `0..max_positions`: the inverse
/// frequencies `(1, rotary_dim / 2)` f32, from which each batch's cos/sin
/// rows are computed in f32 and cast to the model's dtype.
#[derive(Clone, Debug)]
pub struct RotaryEmbedding {
    inv_freq: Tensor,
    max_positions: usize,
    interleaved: bool,
    dtype: DType,
}

impl RotaryEmbedding {
    /// The standard inverse frequencies `1 / base^(2i / dim)`, `i < dim / 2`.
    pub fn default_inv_freq(dim: usize, base: f64) -> Vec<f32> {
        (0..dim)
            .step_by(2)
            .map(|i| 1f32 / base.powf(i as f64 / dim as f64) as f32)
            .collect()
    }

    /// Rotary embeddings for `max_positions` positions.
    ///
    /// # Arguments
    /// * `inv_freq` - `rotary_dim / 2` inverse frequencies, finite.
    /// * `max_positions` - positions `0..max_positions` are supported (the
    ///   model's context length); at most `u32::MAX`.
    /// * `interleaved` - rotate pairs `(2i, 2i + 1)` (GGUF Llama, `rope_i`)
    ///   instead of `(i, i + d / 2)` (Hugging Face checkpoints, `rope`).
    /// * `dtype`, `device` - where the rows live (computed in f32).
    pub fn new(
        inv_freq: &[f32],
        max_positions: usize,
        interleaved: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if inv_freq.is_empty() || max_positions == 0 {
            bail!(
                "{OP}: need at least one frequency and one position, got {} and {max_positions}",
                inv_freq.len()
            );
        }
        if max_positions > u32::MAX as usize {
            bail!("{OP}: max_positions {max_positions} exceeds the u32 positions of a batch");
        }
        if let Some(f) = inv_freq.iter().find(|f| !f.is_finite()) {
            bail!("{OP}: inverse frequencies must be finite, got {f}");
        }
        Ok(Self {
            inv_freq: Tensor::from_slice(inv_freq, (1, inv_freq.len()), device)?,
            max_positions,
            interleaved,
            dtype,
        })
    }

    /// Positions supported: `0..max_positions`.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The cos/sin rows of the batch's tokens, `(num_tokens, rotary_dim / 2)`.
    ///
    /// Fails when a position is `>= max_positions` (beyond the model's
    /// context length).
    pub fn at(&self, metadata: &AttentionMetadata) -> Result<Rotary> {
        let max = self.max_positions;
        if let Some(&p) = metadata
            .positions_host()
            .iter()
            .find(|&&p| p as usize >= max)
        {
            bail!("{OP}: position {p} is beyond the model's context length of {max} positions");
        }
        let positions = metadata.positions();
        let n = positions.dim(0)?;
        // (n, 1) x (1, half): one product per element, as the table's matmul.
        let freqs = positions
            .to_dtype(DType::F32)?
            .reshape((n, 1))?
            .broadcast_mul(&self.inv_freq)?;
        Ok(Rotary {
            cos: freqs.cos()?.to_dtype(self.dtype)?,
            sin: freqs.sin()?.to_dtype(self.dtype)?,
            interleaved: self.interleaved,
        })
    }
}

/// The rotary rows of one batch, shared by all layers using one table.
#[derive(Clone, Debug)]
pub struct Rotary {
    /// `(num_tokens, rotary_dim / 2)`, the model's dtype.
    cos: Tensor,
    /// `(num_tokens, rotary_dim / 2)`, the model's dtype.
    sin: Tensor,
    interleaved: bool,
}

impl Rotary {
    /// The rows as the attention layer takes them
    /// ([`Attention::forward_rotary_qkv`](crate::Attention::forward_rotary_qkv)).
    pub fn rows(&self) -> RotaryRows<'_> {
        RotaryRows {
            cos: &self.cos,
            sin: &self.sin,
            interleaved: self.interleaved,
        }
    }

    /// Rotates each head of `x`.
    ///
    /// # Arguments
    /// * `x` - `(num_tokens, num_heads * head_size)` or
    ///   `(num_tokens, num_heads, head_size)`, with `head_size = rotary_dim`.
    ///
    /// Returns `(num_tokens, num_heads * head_size)`.
    pub fn apply(&self, x: &Tensor, num_heads: usize) -> Result<Tensor> {
        let n = x.dim(0)?;
        let half = self.cos.dim(1)?;
        let d = 2 * half;
        if self.cos.dim(0)? != n || x.elem_count() != n * num_heads * d {
            bail!(
                "{OP}: x of shape {:?} is not ({}, {num_heads} heads x {d})",
                x.dims(),
                self.cos.dim(0)?
            );
        }
        // One "batch" per token, so each token reads its own cos/sin row.
        let x = x.reshape((n, num_heads, 1, d))?.contiguous()?;
        let (cos, sin) = (
            self.cos.reshape((n, 1, half))?,
            self.sin.reshape((n, 1, half))?,
        );
        let y = if self.interleaved {
            candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?
        } else {
            candle_nn::rotary_emb::rope(&x, &cos, &sin)?
        };
        y.reshape((n, num_heads * d))
    }
}
