//! Small building blocks shared by the models.

use std::borrow::Cow;
use std::ops::Range;

use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_nn::{Activation, Linear, Module, VarBuilder};

use crate::parallel::layers::{narrow_range, RowParallelLinear};

/// Gemma's RMS norm: `x / sqrt(mean(x^2) + eps) * (1 + weight)` over the last
/// dimension (the `1 + weight` is folded in at load time).
#[derive(Clone, Debug)]
pub(crate) struct GemmaRmsNorm {
    /// `(dim,)` `1 + w`, as candle-transformers holds it (the path off
    /// CUDA, candle's op).
    weight: Tensor,
    /// `(dim,)` `w` as stored: the CUDA kernel adds the 1 in f32, so that
    /// a 16-bit dtype rounds `w` rather than `1 + w`.
    raw: Tensor,
    eps: f32,
}

impl GemmaRmsNorm {
    /// Loads `weight` `(dim,)` from `vb`.
    pub(crate) fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let raw = vb.get(dim, "weight")?;
        Ok(Self {
            weight: (&raw + 1.0)?,
            raw,
            eps: eps as f32,
        })
    }

    /// The residual add and this norm: `(x + delta, norm(x + delta))` in
    /// x's dtype (`delta` x's shape and dtype); one kernel on CUDA, candle's
    /// ops elsewhere.
    pub(crate) fn add_forward(&self, x: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor)> {
        if x.device().is_cuda() {
            return crate::add_rms_norm(x, delta, &self.raw, self.eps, 1.0);
        }
        let sum = (x + delta)?;
        let normed = self.forward(&sum)?;
        Ok((sum, normed))
    }
}

impl Module for GemmaRmsNorm {
    /// `x` - `(..., dim)`; returns the same shape. One kernel on CUDA.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.device().is_cuda() {
            return crate::rms_norm(x, &self.raw, self.eps, 1.0);
        }
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

    /// Loads a checkpoint's already-joined projection `name` (an
    /// `(sum(outs), in_dim)` weight, with a `(sum(outs),)` bias when
    /// `bias`) from `vb`: Phi-3's `qkv_proj` and `gate_up_proj`. `outs` are
    /// the widths of its projections, in order.
    pub(crate) fn load_joined(
        in_dim: usize,
        name: &str,
        outs: &[usize],
        bias: bool,
        vb: &VarBuilder,
    ) -> Result<Self> {
        let total = outs
            .iter()
            .try_fold(0usize, |a, &o| a.checked_add(o))
            .ok_or_else(|| {
                candle_core::Error::msg(format!("fused-linear: {name} widths {outs:?} overflow"))
            })?;
        Ok(Self {
            linear: candle_nn::linear_b(in_dim, total, bias, vb.pp(name))?,
            outs: outs.to_vec(),
        })
    }

    /// A tensor-parallel rank's part: rows `rows[i]` of projection `i`
    /// (and of its bias), joined again (column parallelism: q/k/v by
    /// heads, gate/up by intermediate columns). `rows` has one range per
    /// projection, each within its width.
    pub(crate) fn shard_rows(&self, rows: &[Range<usize>]) -> Result<Self> {
        if rows.len() != self.outs.len() {
            bail!(
                "fused-linear: {} row ranges for {} projections",
                rows.len(),
                self.outs.len()
            );
        }
        let (mut weights, mut biases, mut start) = (Vec::new(), Vec::new(), 0);
        for (range, &out) in rows.iter().zip(&self.outs) {
            if range.end > out {
                bail!("fused-linear: rows {range:?} of a projection of {out} rows");
            }
            let global = start + range.start..start + range.end;
            weights.push(narrow_range(self.linear.weight(), 0, &global)?);
            if let Some(b) = self.linear.bias() {
                biases.push(narrow_range(b, 0, &global)?);
            }
            start += out;
        }
        let bias = match biases.is_empty() {
            true => None,
            false => Some(Tensor::cat(&biases, 0)?),
        };
        Ok(Self {
            linear: Linear::new(Tensor::cat(&weights, 0)?, bias),
            outs: rows.iter().map(|r| r.len()).collect(),
        })
    }

    /// `x` `(num_tokens, in_dim)` -> the projections side by side,
    /// `(num_tokens, sum(out_dim))`, from one matmul.
    pub(crate) fn forward_joined(&self, x: &Tensor) -> Result<Tensor> {
        crate::ops::linear::linear(x, self.linear.weight(), self.linear.bias())
    }

    /// `x` `(num_tokens, in_dim)` -> `act(gate) * up` `(num_tokens, out_dim)`
    /// of a gate/up pair of equal widths (gate first), through
    /// [`crate::gated_linear`]: on CUDA a product of a few rows and the
    /// activation in one kernel.
    pub(crate) fn forward_gated(&self, x: &Tensor, act: crate::GatedActivation) -> Result<Tensor> {
        crate::gated_linear(x, self.linear.weight(), self.linear.bias(), act)
    }

    /// `x` `(num_tokens, in_dim)` -> one `(num_tokens, out_dim)` view per
    /// projection (columns of one matmul's output, not contiguous); `N` is
    /// the number of projections loaded.
    pub(crate) fn forward<const N: usize>(&self, x: &Tensor) -> Result<[Tensor; N]> {
        let parts = split_columns(
            &crate::ops::linear::linear(x, self.linear.weight(), self.linear.bias())?,
            &self.outs,
        )?;
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
    down: RowParallelLinear,
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
            down: RowParallelLinear::whole(candle_nn::linear_no_bias(
                intermediate,
                hidden,
                vb.pp("down_proj"),
            )?),
            act,
        })
    }
}

impl GatedMlp {
    /// A block of an already-loaded `gate_up` (`(num_tokens, hidden)` ->
    /// `(num_tokens, 2 * inter)`, gate columns first) and `down`
    /// (`inter -> hidden`; a tensor-parallel rank's columns and the sum
    /// over the ranks, or the whole layer).
    pub(crate) fn from_parts(
        gate_up: FusedLinear,
        down: RowParallelLinear,
        act: Activation,
    ) -> Self {
        Self { gate_up, down, act }
    }
}

impl Module for GatedMlp {
    /// `x` - `(num_tokens, hidden)`; returns the same shape.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let fused = match self.act {
            Activation::Silu => Some(crate::GatedActivation::Silu),
            Activation::GeluPytorchTanh => Some(crate::GatedActivation::GeluTanh),
            _ => None,
        };
        let h = match fused {
            Some(act) if x.device().is_cuda() => self.gate_up.forward_gated(x, act)?,
            Some(act) => gated(&self.gate_up.forward_joined(x)?, act, x.dtype())?,
            None => {
                let [gate, up] = self.gate_up.forward(x)?;
                (gate.apply(&self.act)? * up)?
            }
        };
        h.apply(&self.down)
    }
}

/// An RMS norm over the last dimension that runs as one fused kernel on
/// CUDA, together with the residual add in front of it
/// ([`add_forward`](Self::add_forward)). Elsewhere it runs candle's ops,
/// so CPU results stay those of candle-transformers' models bit for bit.
#[derive(Clone, Debug)]
pub(crate) struct FusedRmsNorm {
    /// `(dim,)`, the activations' dtype.
    weight: Tensor,
    eps: f64,
}

impl FusedRmsNorm {
    /// A norm of `weight` `(dim,)` (Gemma's `1 + w` already folded in).
    pub(crate) fn new(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// Loads `weight` `(dim,)` from `vb` (a Hugging Face `*norm` module).
    pub(crate) fn load(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self::new(vb.get(dim, "weight")?, eps))
    }

    /// `x` `(num_tokens, dim)` normalised; x's shape and dtype.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.device().is_cuda() {
            return crate::rms_norm(x, &self.weight, self.eps as f32, 0.);
        }
        candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps as f32)
    }

    /// The residual add and this norm: `(x + delta, norm(x + delta))`,
    /// x's dtype. `delta` has x's shape, in x's dtype or f32 (a quantized
    /// matmul's output), and is rounded to x's dtype before the add off
    /// CUDA (the fused kernel adds in f32 and rounds once).
    pub(crate) fn add_forward(&self, x: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor)> {
        if x.device().is_cuda() {
            return crate::add_rms_norm(x, delta, &self.weight, self.eps as f32, 0.);
        }
        let sum = (x + delta.to_dtype(x.dtype())?)?;
        let normed = self.forward(&sum)?;
        Ok((sum, normed))
    }
}

/// `act(gate) * up` of a joined gate/up output `gate_up`
/// `(num_tokens, 2 * inter)` (gate columns first), as `(num_tokens, inter)`
/// of `dtype`: one fused kernel on CUDA; elsewhere candle's ops on the
/// halves rounded to `dtype`, as candle-transformers computes it.
pub(crate) fn gated(gate_up: &Tensor, act: crate::GatedActivation, dtype: DType) -> Result<Tensor> {
    if gate_up.device().is_cuda() {
        return crate::gated_activation(gate_up, act, dtype);
    }
    let inter = gate_up.dim(1)? / 2;
    let gate = gate_up.narrow(1, 0, inter)?.to_dtype(dtype)?;
    let up = gate_up.narrow(1, inter, inter)?.to_dtype(dtype)?;
    let gate = match act {
        crate::GatedActivation::Silu => candle_nn::ops::silu(&gate)?,
        crate::GatedActivation::GeluTanh => gate.gelu()?,
    };
    gate * up
}

/// `c * tanh(x / c)`.
pub(crate) fn softcap(x: &Tensor, c: f64) -> Result<Tensor> {
    (x / c)?.tanh()? * c
}

/// Quantized projections of one input (q/k/v, gate/up): one `QMatMul` over
/// their weights' rows concatenated when they share a GGML dtype, else one
/// each.
///
/// GGML stores a weight row by row, each row in whole quantization blocks
/// (its width is a multiple of the block size), so the rows of two
/// weights of one dtype concatenate as raw bytes into one valid weight.
#[derive(Clone, Debug)]
pub(crate) struct QProjections {
    /// The model named in error messages.
    component: &'static str,
    kind: QProjectionKind,
}

#[derive(Clone, Debug)]
enum QProjectionKind {
    /// One matmul; the output width of each projection.
    Fused(QMatMul, Vec<usize>),
    /// One matmul per projection (their dtypes differ).
    Separate(Vec<QMatMul>),
}

impl QProjections {
    /// Joins `weights` (`(out_i, in)` each, on the CPU as read from the
    /// file) on `device`; dequantized to `dense` first when it is given.
    /// `component` names the model in error messages.
    pub(crate) fn new(
        component: &'static str,
        weights: Vec<QTensor>,
        device: &Device,
        dense: Option<DType>,
    ) -> Result<Self> {
        let Some(first) = weights.first() else {
            bail!("{component}: no projection to join");
        };
        let (dtype, in_dim) = (first.dtype(), first.shape().dims2()?.1);
        let mut outs = Vec::with_capacity(weights.len());
        for w in &weights {
            let (out, k) = w.shape().dims2()?;
            if k != in_dim {
                bail!("{component}: projections of one input have widths {in_dim} and {k}");
            }
            outs.push(out);
        }
        let kind = if let Some(dense_dtype) = dense {
            let dense = weights
                .iter()
                .map(|w| w.dequantize(device)?.to_dtype(dense_dtype))
                .collect::<Result<Vec<_>>>()?;
            QProjectionKind::Fused(QMatMul::Tensor(Tensor::cat(&dense, 0)?), outs)
        } else if weights.iter().any(|w| w.dtype() != dtype) {
            let on_device = weights
                .iter()
                .map(|w| {
                    let storage = QStorage::from_data(w.data()?, device, w.dtype())?;
                    QMatMul::from_qtensor(QTensor::new(storage, w.shape().clone())?)
                })
                .collect::<Result<Vec<_>>>()?;
            QProjectionKind::Separate(on_device)
        } else {
            let mut bytes =
                Vec::with_capacity(weights.iter().map(QTensor::storage_size_in_bytes).sum());
            for w in &weights {
                bytes.extend_from_slice(&w.data()?);
            }
            let storage = QStorage::from_data(Cow::Owned(bytes), device, dtype)?;
            let rows = outs.iter().sum::<usize>();
            let joined = QTensor::new(storage, (rows, in_dim))?;
            QProjectionKind::Fused(QMatMul::from_qtensor(joined)?, outs)
        };
        Ok(Self { component, kind })
    }

    /// Whether the projections run as one matmul.
    #[cfg(test)]
    fn is_fused(&self) -> bool {
        matches!(self.kind, QProjectionKind::Fused(..))
    }

    /// `x` `(num_tokens, in)` -> the projections side by side,
    /// `(num_tokens, sum(out_i))` (one matmul when they are joined).
    pub(crate) fn forward_joined(&self, x: &Tensor) -> Result<Tensor> {
        match &self.kind {
            QProjectionKind::Fused(w, _) => w.forward(x),
            QProjectionKind::Separate(ws) => {
                let parts = ws
                    .iter()
                    .map(|w| w.forward(x))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 1)
            }
        }
    }

    /// `x` `(num_tokens, in)` -> the `N` projections, `(num_tokens, out_i)`.
    pub(crate) fn forward<const N: usize>(&self, x: &Tensor) -> Result<[Tensor; N]> {
        let parts = match &self.kind {
            QProjectionKind::Fused(w, outs) => split_columns(&w.forward(x)?, outs)?,
            QProjectionKind::Separate(ws) => {
                ws.iter().map(|w| w.forward(x)).collect::<Result<_>>()?
            }
        };
        let n = parts.len();
        parts.try_into().map_err(|_| {
            candle_core::Error::msg(format!("{}: {n} projections, not {N}", self.component))
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::*;

    /// Rows of weights of one dtype concatenate as raw bytes: the joined
    /// matmul equals the separate ones, exactly for block formats;
    /// weights of different dtypes stay separate.
    #[test]
    fn joined_projections_equal_separate_ones() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (5, 64), &dev)?;
        for dtype in [
            GgmlDType::Q4_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::F16,
        ] {
            let dense = [
                Tensor::randn(0f32, 1., (48, 64), &dev)?,
                Tensor::randn(0f32, 1., (16, 64), &dev)?,
                Tensor::randn(0f32, 1., (16, 64), &dev)?,
            ];
            // A super-block format needs rows of 256.
            let dense = if dtype == GgmlDType::Q4K {
                dense.map(|t| t.repeat((1, 4)).expect("repeat"))
            } else {
                dense
            };
            let x = if dtype == GgmlDType::Q4K {
                x.repeat((1, 4))?
            } else {
                x.clone()
            };
            let quantized = dense
                .iter()
                .map(|t| QTensor::quantize(t, dtype))
                .collect::<Result<Vec<_>>>()?;
            let separate = quantized
                .iter()
                .map(|q| {
                    let storage = QStorage::from_data(q.data()?, &dev, q.dtype())?;
                    QMatMul::from_qtensor(QTensor::new(storage, q.shape().clone())?)?.forward(&x)
                })
                .collect::<Result<Vec<_>>>()?;
            let joined = QProjections::new("quantized-llama", quantized, &dev, None)?;
            assert!(joined.is_fused(), "{dtype:?}");
            let [q, k, v] = joined.forward(&x)?;
            for (a, b) in [q, k, v].iter().zip(&separate) {
                assert_eq!(a.dims(), b.dims());
                let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                // Quantized dot products run row by row: bit for bit. F16
                // weights become a dense f32 matmul, whose blocking follows
                // the output width: the two sums of `k` products may differ
                // by reassociation, at most about k * eps * max |y| (an
                // absolute 1e-5 failed once on unseeded data, at 1.1e-5).
                let tol = if dtype == GgmlDType::F16 {
                    let k = x.dim(1)? as f32;
                    let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                    k * f32::EPSILON * scale.max(1.0)
                } else {
                    0.0
                };
                assert!(diff <= tol, "{dtype:?}: {diff}");
            }
        }
        let mixed = vec![
            QTensor::quantize(&Tensor::randn(0f32, 1., (32, 64), &dev)?, GgmlDType::Q4_1)?,
            QTensor::quantize(&Tensor::randn(0f32, 1., (32, 64), &dev)?, GgmlDType::Q8_0)?,
        ];
        let p = QProjections::new("quantized-llama", mixed, &dev, None)?;
        assert!(!p.is_fused());
        let [a, b] = p.forward(&x)?;
        assert_eq!((a.dims(), b.dims()), (&[5, 32][..], &[5, 32][..]));
        let err = QProjections::new(
            "quantized-llama",
            vec![
                QTensor::quantize(&Tensor::randn(0f32, 1., (32, 64), &dev)?, GgmlDType::Q8_0)?,
                QTensor::quantize(&Tensor::randn(0f32, 1., (32, 96), &dev)?, GgmlDType::Q8_0)?,
            ],
            &dev,
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("quantized-llama: projections of one input have widths 64 and 96"),
            "{err}"
        );
        Ok(())
    }
}
