//! Small building blocks shared by the models.

use candle_core::{Result, Tensor};
use candle_nn::{Activation, Linear, Module, VarBuilder};

/// Gemma's RMS norm: `x / sqrt(mean(x^2) + eps) * (1 + weight)` over the last
/// dimension (the `1 + weight` is folded in at load time).
#[derive(Clone, Debug)]
pub(crate) struct GemmaRmsNorm {
    weight: Tensor,
    eps: f32,
}

impl GemmaRmsNorm {
    /// Loads `weight` `(dim,)` from `vb`.
    pub(crate) fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight = (vb.get(dim, "weight")? + 1.0)?;
        Ok(Self {
            weight,
            eps: eps as f32,
        })
    }
}

impl Module for GemmaRmsNorm {
    /// `x` - `(..., dim)`; returns the same shape.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps)
    }
}

/// The gated feed-forward block of Llama and Gemma:
/// `down(act(gate(x)) * up(x))`.
#[derive(Clone, Debug)]
pub(crate) struct GatedMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    act: Activation,
}

impl GatedMlp {
    /// Loads `gate_proj`, `up_proj` and `down_proj` (no biases) from `vb`.
    pub(crate) fn new(
        hidden: usize,
        intermediate: usize,
        act: Activation,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            gate: candle_nn::linear_no_bias(hidden, intermediate, vb.pp("gate_proj"))?,
            up: candle_nn::linear_no_bias(hidden, intermediate, vb.pp("up_proj"))?,
            down: candle_nn::linear_no_bias(intermediate, hidden, vb.pp("down_proj"))?,
            act,
        })
    }
}

impl Module for GatedMlp {
    /// `x` - `(num_tokens, hidden)`; returns the same shape.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = x.apply(&self.gate)?.apply(&self.act)?;
        (gate * x.apply(&self.up)?)?.apply(&self.down)
    }
}

/// `c * tanh(x / c)`.
pub(crate) fn softcap(x: &Tensor, c: f64) -> Result<Tensor> {
    (x / c)?.tanh()? * c
}
