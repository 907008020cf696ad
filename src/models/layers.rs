//! Small building blocks shared by the models.

use candle_core::{bail, Result, Tensor};
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

/// Several projections of one input as one matmul: their weights (and
/// biases) concatenated along the output dimension at load time, so that a
/// step launches one matmul instead of one per projection (q/k/v, gate/up).
#[derive(Clone, Debug)]
pub(crate) struct FusedLinear {
    linear: Linear,
    /// Output width of each projection, in order.
    outs: Vec<usize>,
}

impl FusedLinear {
    /// Loads the projections `parts` (`(name, out_dim)`, each a
    /// `(out_dim, in_dim)` weight, with an `(out_dim,)` bias when `bias`)
    /// from `vb` and concatenates them.
    pub(crate) fn load(
        in_dim: usize,
        parts: &[(&str, usize)],
        bias: bool,
        vb: &VarBuilder,
    ) -> Result<Self> {
        let mut weights = Vec::with_capacity(parts.len());
        let mut biases = Vec::with_capacity(parts.len());
        for &(name, out) in parts {
            let l = candle_nn::linear_b(in_dim, out, bias, vb.pp(name))?;
            weights.push(l.weight().clone());
            biases.extend(l.bias().cloned());
        }
        let bias = if bias {
            Some(Tensor::cat(&biases, 0)?)
        } else {
            None
        };
        Ok(Self {
            linear: Linear::new(Tensor::cat(&weights, 0)?, bias),
            outs: parts.iter().map(|p| p.1).collect(),
        })
    }

    /// `x` `(num_tokens, in_dim)` -> one `(num_tokens, out_dim)` view per
    /// projection (columns of one matmul's output, not contiguous); `N` is
    /// the number of projections loaded.
    pub(crate) fn forward<const N: usize>(&self, x: &Tensor) -> Result<[Tensor; N]> {
        let parts = split_columns(&x.apply(&self.linear)?, &self.outs)?;
        let n = parts.len();
        parts
            .try_into()
            .map_err(|_| candle_core::Error::msg(format!("fused-linear: {n} projections, not {N}")))
    }
}

/// Splits the columns of `(n, sum(widths))` `y` into views of `widths`.
pub(crate) fn split_columns(y: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
    let total: usize = widths.iter().sum();
    if y.rank() != 2 || y.dim(1)? != total {
        bail!(
            "fused-linear: output of shape {:?} does not split into widths {widths:?}",
            y.dims()
        );
    }
    let mut start = 0;
    let mut out = Vec::with_capacity(widths.len());
    for &w in widths {
        out.push(y.narrow(1, start, w)?);
        start += w;
    }
    Ok(out)
}

/// The gated feed-forward block of Llama and Gemma:
/// `down(act(gate(x)) * up(x))`, with `gate` and `up` as one matmul.
#[derive(Clone, Debug)]
pub(crate) struct GatedMlp {
    gate_up: FusedLinear,
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
            gate_up: FusedLinear::load(
                hidden,
                &[("gate_proj", intermediate), ("up_proj", intermediate)],
                false,
                &vb,
            )?,
            down: candle_nn::linear_no_bias(intermediate, hidden, vb.pp("down_proj"))?,
            act,
        })
    }
}

impl Module for GatedMlp {
    /// `x` - `(num_tokens, hidden)`; returns the same shape.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up] = self.gate_up.forward(x)?;
        (gate.apply(&self.act)? * up)?.apply(&self.down)
    }
}

/// `c * tanh(x / c)`.
pub(crate) fn softcap(x: &Tensor, c: f64) -> Result<Tensor> {
    (x / c)?.tanh()? * c
}
