//! Rotary position embeddings at per-token positions.
//!
//! The cos/sin tables are the ones candle-transformers builds
//! (`positions x inv_freq`); a batch gathers one row per token at the
//! token's absolute position, so prefills, chunks and decodes of different
//! sequences share one call.

use candle_core::{bail, DType, Device, Result, Tensor};

use crate::metadata::AttentionMetadata;

const OP: &str = "rotary-embedding";

/// Cos/sin tables `(max_positions, rotary_dim / 2)` in the model's dtype.
#[derive(Clone, Debug)]
pub struct RotaryEmbedding {
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
}

impl RotaryEmbedding {
    /// The standard inverse frequencies `1 / base^(2i / dim)`, `i < dim / 2`.
    pub fn default_inv_freq(dim: usize, base: f64) -> Vec<f32> {
        (0..dim)
            .step_by(2)
            .map(|i| 1f32 / base.powf(i as f64 / dim as f64) as f32)
            .collect()
    }

    /// Tables for `max_positions` positions.
    ///
    /// # Arguments
    /// * `inv_freq` - `rotary_dim / 2` inverse frequencies.
    /// * `max_positions` - positions `0..max_positions` are supported.
    /// * `interleaved` - rotate pairs `(2i, 2i + 1)` (GGUF Llama, `rope_i`)
    ///   instead of `(i, i + d / 2)` (Hugging Face checkpoints, `rope`).
    /// * `dtype`, `device` - where the tables live (computed in f32).
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
        let inv_freq = Tensor::from_slice(inv_freq, (1, inv_freq.len()), device)?;
        let freqs = Tensor::arange(0u32, max_positions as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max_positions, 1))?
            .matmul(&inv_freq)?;
        Ok(Self {
            cos: freqs.cos()?.to_dtype(dtype)?,
            sin: freqs.sin()?.to_dtype(dtype)?,
            interleaved,
        })
    }

    /// Positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Gathers the rows of the batch's tokens: cos/sin `(num_tokens, 1, rotary_dim / 2)`.
    pub fn at(&self, metadata: &AttentionMetadata) -> Result<Rotary> {
        let max = self.max_positions();
        if let Some(&p) = metadata
            .positions_host()
            .iter()
            .find(|&&p| p as usize >= max)
        {
            bail!("{OP}: position {p} is beyond the {max} positions of the rotary tables (max_position_embeddings)");
        }
        let positions = metadata.positions();
        let n = positions.dim(0)?;
        let half = self.cos.dim(1)?;
        Ok(Rotary {
            cos: self.cos.index_select(positions, 0)?.reshape((n, 1, half))?,
            sin: self.sin.index_select(positions, 0)?.reshape((n, 1, half))?,
            interleaved: self.interleaved,
        })
    }
}

/// The rotary rows of one batch, shared by all layers using one table.
#[derive(Clone, Debug)]
pub struct Rotary {
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
}

impl Rotary {
    /// Rotates each head of `x`.
    ///
    /// # Arguments
    /// * `x` - `(num_tokens, num_heads * head_size)` or
    ///   `(num_tokens, num_heads, head_size)`, with `head_size = rotary_dim`.
    ///
    /// Returns `(num_tokens, num_heads * head_size)`.
    pub fn apply(&self, x: &Tensor, num_heads: usize) -> Result<Tensor> {
        let n = x.dim(0)?;
        let d = 2 * self.cos.dim(2)?;
        if self.cos.dim(0)? != n || x.elem_count() != n * num_heads * d {
            bail!(
                "{OP}: x of shape {:?} is not ({}, {num_heads} heads x {d})",
                x.dims(),
                self.cos.dim(0)?
            );
        }
        // One "batch" per token, so each token reads its own cos/sin row.
        let x = x.reshape((n, num_heads, 1, d))?.contiguous()?;
        let y = if self.interleaved {
            candle_nn::rotary_emb::rope_i(&x, &self.cos, &self.sin)?
        } else {
            candle_nn::rotary_emb::rope(&x, &self.cos, &self.sin)?
        };
        y.reshape((n, num_heads * d))
    }
}
