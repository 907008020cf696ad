//! Fused layer ops: RMS norm, RMS norm with the residual add in front of
//! it, and the gated activation of an MLP. Each is one kernel on CUDA where
//! candle runs two to four, which matters for decode steps of small
//! batches, whose time is the count of kernels they launch.
//!
//! Owns `rms_norm`, `add_rms_norm`, `gated_activation` and their
//! `CustomOp`s: checks on the host, then the CPU or CUDA backend.

use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Tensor};

use crate::params::GatedActivation;

const NORM_OP: &str = "rms-norm";
const ADD_NORM_OP: &str = "add-rms-norm";
const GATED_OP: &str = "gated-activation";

/// The arithmetic of a norm.
#[derive(Clone, Copy, Debug)]
struct Norm {
    op: &'static str,
    eps: f32,
    weight_offset: f32,
}

impl Norm {
    /// Rows and columns of `x`, checked against `weight` `(cols,)`.
    fn rows_cols(&self, x: &Layout, weight: &Layout) -> Result<(usize, usize)> {
        let cols = x.dims().last().copied().unwrap_or(0);
        if weight.dims() != [cols] {
            bail!(
                "{}: weight must be ({cols},) for x of shape {:?}, got {:?}",
                self.op,
                x.dims(),
                weight.dims()
            );
        }
        Ok((x.shape().elem_count() / cols.max(1), cols))
    }

    /// The CUDA launch's view of a call on `x` with `weight`.
    #[cfg(feature = "cuda")]
    fn cuda_shape(&self, x: &Layout, weight: &Layout) -> Result<crate::cuda::layer_ops::NormShape> {
        let (rows, cols) = self.rows_cols(x, weight)?;
        Ok(crate::cuda::layer_ops::NormShape {
            rows,
            cols,
            eps: self.eps,
            weight_offset: self.weight_offset,
        })
    }
}

fn check_norm_args(op: &str, x: &Tensor, weight: &Tensor, eps: f32, offset: f32) -> Result<()> {
    if x.rank() == 0 || x.dims().last() == Some(&0) {
        bail!(
            "{op}: x must have a non-empty last dimension, got shape {:?}",
            x.dims()
        );
    }
    if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        bail!("{op}: x must be f32, f16 or bf16, got {:?}", x.dtype());
    }
    if weight.dtype() != x.dtype() {
        bail!(
            "{op}: weight is {:?} but x is {:?}",
            weight.dtype(),
            x.dtype()
        );
    }
    if !eps.is_finite() || eps < 0. {
        bail!("{op}: eps must be finite and non-negative, got {eps}");
    }
    if !offset.is_finite() {
        bail!("{op}: weight_offset must be finite, got {offset}");
    }
    if !x.device().same_device(weight.device()) {
        bail!("{op}: x and weight are on different devices");
    }
    let cols = x.dims().last().copied().unwrap_or(0);
    if weight.dims() != [cols] {
        bail!(
            "{op}: weight must be ({cols},) for x of shape {:?}, got {:?}",
            x.dims(),
            weight.dims()
        );
    }
    Ok(())
}

impl candle_core::CustomOp2 for Norm {
    fn name(&self) -> &'static str {
        self.op
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = self.rows_cols(xl, wl)?;
        let arith = (self.eps, self.weight_offset);
        let out = crate::cpu::layer_ops::norm(self.op, cols, arith, (x, xl), None, (w, wl))?;
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let shape = self.cuda_shape(xl, wl)?;
        let out = crate::cuda::layer_ops::norm(self.op, shape, (x, xl), None, (w, wl))?;
        Ok((out, xl.shape().clone()))
    }
}

impl candle_core::CustomOp3 for Norm {
    fn name(&self) -> &'static str {
        self.op
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        d: &CpuStorage,
        dl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, cols) = self.rows_cols(xl, wl)?;
        let arith = (self.eps, self.weight_offset);
        let out =
            crate::cpu::layer_ops::norm(self.op, cols, arith, (x, xl), Some((d, dl)), (w, wl))?;
        Ok((out, Shape::from((2, rows, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        d: &candle_core::CudaStorage,
        dl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let shape = self.cuda_shape(xl, wl)?;
        let out = crate::cuda::layer_ops::norm(self.op, shape, (x, xl), Some((d, dl)), (w, wl))?;
        Ok((out, Shape::from((2, shape.rows, shape.cols))))
    }
}

/// RMS norm over the last dimension:
/// `x * rsqrt(mean(x^2) + eps) * (weight + weight_offset)`, in f32, rounded
/// once to x's dtype. One kernel on CUDA.
///
/// # Arguments
/// * `x` - `(..., cols)`, f32, f16 or bf16.
/// * `weight` - `(cols,)`, x's dtype.
/// * `eps` - finite, `>= 0`.
/// * `weight_offset` - added to each weight in f32: 0 for Llama, 1 for
///   Gemma's `(1 + w)` norms.
///
/// Returns x's shape and dtype.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32, weight_offset: f32) -> Result<Tensor> {
    check_norm_args(NORM_OP, x, weight, eps, weight_offset)?;
    if x.elem_count() == 0 {
        // No rows: nothing to normalise (and no kernel to launch).
        return Tensor::zeros(x.shape(), x.dtype(), x.device());
    }
    let op = Norm {
        op: NORM_OP,
        eps,
        weight_offset,
    };
    x.contiguous()?.apply_op2_no_bwd(&weight.contiguous()?, &op)
}

/// The residual add of a pre-norm block and the next norm in one pass:
/// returns `(sum, rms_norm(sum, weight, eps, weight_offset))` with
/// `sum = x + delta` (added in f32 and rounded to x's dtype; the norm
/// reads the rounded sum, as `rms_norm(&(x + delta)?)` would). One kernel
/// on CUDA.
///
/// # Arguments
/// * `x` - the residual stream `(..., cols)`, f32, f16 or bf16.
/// * `delta` - x's shape, x's dtype or f32 (the output of a quantized
///   matmul).
/// * `weight`, `eps`, `weight_offset` - as in [`rms_norm`].
///
/// Returns two tensors of x's shape and dtype.
pub fn add_rms_norm(
    x: &Tensor,
    delta: &Tensor,
    weight: &Tensor,
    eps: f32,
    weight_offset: f32,
) -> Result<(Tensor, Tensor)> {
    check_norm_args(ADD_NORM_OP, x, weight, eps, weight_offset)?;
    if delta.dims() != x.dims() {
        bail!(
            "{ADD_NORM_OP}: delta must have x's shape {:?}, got {:?}",
            x.dims(),
            delta.dims()
        );
    }
    if delta.dtype() != x.dtype() && delta.dtype() != DType::F32 {
        bail!(
            "{ADD_NORM_OP}: delta must be {:?} or f32, got {:?}",
            x.dtype(),
            delta.dtype()
        );
    }
    if !x.device().same_device(delta.device()) {
        bail!("{ADD_NORM_OP}: x and delta are on different devices");
    }
    if x.elem_count() == 0 {
        // No rows: the sum and its norm are empty too.
        let empty = Tensor::zeros(x.shape(), x.dtype(), x.device())?;
        return Ok((empty.clone(), empty));
    }
    let op = Norm {
        op: ADD_NORM_OP,
        eps,
        weight_offset,
    };
    let both =
        x.contiguous()?
            .apply_op3_no_bwd(&delta.contiguous()?, &weight.contiguous()?, &op)?;
    let sum = both.get(0)?.reshape(x.shape())?;
    let normed = both.get(1)?.reshape(x.shape())?;
    Ok((sum, normed))
}

/// The gated activation of an MLP.
#[derive(Clone, Copy, Debug)]
struct Gated {
    act: GatedActivation,
    out: DType,
}

impl Gated {
    fn rows_inter(&self, l: &Layout) -> Result<(usize, usize)> {
        let &[rows, width] = l.dims() else {
            bail!(
                "{GATED_OP}: gate_up must be (rows, 2 * inter), got {:?}",
                l.dims()
            );
        };
        Ok((rows, width / 2))
    }
}

impl candle_core::CustomOp1 for Gated {
    fn name(&self) -> &'static str {
        GATED_OP
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, inter) = self.rows_inter(l)?;
        let out = crate::cpu::layer_ops::gated(GATED_OP, self.act, (s, l), inter, self.out)?;
        Ok((out, Shape::from((rows, inter))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, inter) = self.rows_inter(l)?;
        let out = crate::cuda::layer_ops::gated(GATED_OP, self.act, (s, l), rows, inter, self.out)?;
        Ok((out, Shape::from((rows, inter))))
    }
}

/// `act(gate) * up` of a joined gate/up projection, computed in f32 and
/// rounded once. One kernel on CUDA.
///
/// # Arguments
/// * `gate_up` - `(rows, 2 * inter)`: each row's `inter` gate columns, then
///   its `inter` up columns (one matmul over the concatenated weights);
///   f32, f16 or bf16.
/// * `act` - the activation applied to the gate.
/// * `out_dtype` - gate_up's dtype, or f16/bf16 for an f32 input (the
///   output of a quantized matmul in a half-precision model).
///
/// Returns `(rows, inter)` of `out_dtype`.
pub fn gated_activation(
    gate_up: &Tensor,
    act: GatedActivation,
    out_dtype: DType,
) -> Result<Tensor> {
    let &[rows, width] = gate_up.dims() else {
        bail!(
            "{GATED_OP}: gate_up must be (rows, 2 * inter), got {:?}",
            gate_up.dims()
        );
    };
    if width % 2 != 0 {
        bail!("{GATED_OP}: gate_up has an odd width {width}; it must be 2 * inter");
    }
    let ok = matches!(
        (gate_up.dtype(), out_dtype),
        (DType::F32, DType::F32 | DType::F16 | DType::BF16)
            | (DType::F16, DType::F16)
            | (DType::BF16, DType::BF16)
    );
    if !ok {
        bail!(
            "{GATED_OP}: a {:?} gate_up cannot give a {out_dtype:?} output (same dtype, or f32 to f16/bf16)",
            gate_up.dtype()
        );
    }
    if rows == 0 || width == 0 {
        // `(rows, 0)` or `(0, 2 * inter)`: the output `(rows, inter)` is
        // empty, and there is no kernel to launch.
        return Tensor::zeros((rows, width / 2), out_dtype, gate_up.device());
    }
    gate_up.contiguous()?.apply_op1_no_bwd(&Gated {
        act,
        out: out_dtype,
    })
}
