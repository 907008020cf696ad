//! The linear layers' matmul: `x · wᵀ (+ b)`, with the product of up to
//! [`SKINNY_LINEAR_ROWS`] rows (a decode step of a few sequences) on CUDA
//! as one weight-streaming kernel instead of cuBLAS, whose small-batch
//! kernels read the weights slower. [`skinny_matmul`] itself takes up to
//! [`SKINNY_MAX_ROWS`].
//!
//! Owns `linear`, `skinny_matmul` and the `SkinnyMatmul` op, and their
//! gated forms for a joined gate/up weight (`gated_linear`,
//! `skinny_gated_matmul`, the `SkinnyGated` op): checks on the host, then
//! the CPU or CUDA backend.

use std::sync::OnceLock;

use candle_core::{bail, CpuStorage, DType, Layout, Module, Result, Shape, Tensor};

use crate::params::GatedActivation;

const OP: &str = "skinny-matmul";

/// The most rows of `x` [`skinny_matmul`] takes.
pub const SKINNY_MAX_ROWS: usize = 8;

/// The most rows of `x` for which [`linear`] takes [`skinny_matmul`]: on an
/// H100 its tensor-core kernel beats cuBLAS on every Llama-3-8B projection
/// at 1 to 8 rows (1.00x to 1.39x), and the 8B-shaped decode of 2, 4 and 8
/// requests gains 8-9% tokens/s (docs/perf.md, "Skinny matmul", version
/// 13).
pub const SKINNY_LINEAR_ROWS: usize = 8;

#[cfg(feature = "cuda")]
const _: () = assert!(SKINNY_MAX_ROWS == crate::cuda::layer_shapes::SKINNY_MAX_ROWS);

/// The environment variable that limits the skinny path of [`linear`],
/// read once: `0` turns it off (every matmul runs through candle), `1`
/// keeps it to one row; unset or any other value, up to
/// [`SKINNY_LINEAR_ROWS`] rows.
pub const SKINNY_MATMUL_ENV: &str = "CANDLE_PAGED_ATTENTION_SKINNY_MATMUL";

/// The most rows of `x` for which [`linear`] takes [`skinny_matmul`] in
/// this process ([`SKINNY_MATMUL_ENV`]).
fn skinny_rows() -> usize {
    static ROWS: OnceLock<usize> = OnceLock::new();
    *ROWS.get_or_init(|| match std::env::var(SKINNY_MATMUL_ENV).as_deref() {
        Ok("0") => 0,
        Ok("1") => 1,
        _ => SKINNY_LINEAR_ROWS,
    })
}

/// `(m, n, k)` of `x` `(m, k)` and `w` `(n, k)`, or an error naming both
/// shapes.
fn mnk(op: &str, x: &[usize], w: &[usize]) -> Result<(usize, usize, usize)> {
    let (&[m, k], &[n, wk]) = (x, w) else {
        bail!("{op}: x must be (m, k) and w (n, k), got {x:?} and {w:?}");
    };
    if wk != k {
        bail!("{op}: w {w:?} does not match x {x:?}: k differs");
    }
    Ok((m, n, k))
}

/// [`skinny_matmul`]'s op: `x` `(m, k)` and `w` `(n, k)` of one dtype (f16
/// or bf16 on CUDA, f32 too on the CPU) give `(m, n)` of that dtype.
#[derive(Clone, Copy, Debug)]
pub struct SkinnyMatmul;

impl candle_core::CustomOp2 for SkinnyMatmul {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, n, k) = mnk(OP, xl.dims(), wl.dims())?;
        let out = crate::cpu::layer_ops::skinny_matmul(OP, (x, xl), (w, wl), (m, n, k))?;
        Ok((out, Shape::from((m, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, n, k) = mnk(OP, xl.dims(), wl.dims())?;
        let out = crate::cuda::layer_ops::skinny_matmul(OP, (x, xl), (w, wl), (m, n, k))?;
        Ok((out, Shape::from((m, n))))
    }
}

/// `x · wᵀ` for a few rows of `x`: on CUDA one kernel that streams `w` once
/// (f32 sums, rounded once); on the CPU the same arithmetic.
///
/// # Arguments
/// * `x` - `(m, k)`, `1 <= m <= SKINNY_MAX_ROWS`; f16 or bf16 (f32 too on
///   the CPU); on CUDA `k` a positive multiple of 8 and `x` starting at an
///   element offset that is a multiple of 8.
/// * `w` - `(n, k)`, x's dtype (a linear layer's weight), the same
///   alignment.
///
/// Returns `(m, n)` of x's dtype.
pub fn skinny_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, _, k) = mnk(OP, x.dims(), w.dims())?;
    check_skinny(OP, x, w, m, k)?;
    x.contiguous()?
        .apply_op2_no_bwd(&w.contiguous()?, &SkinnyMatmul)
}

/// The checks [`skinny_matmul`] and [`skinny_gated_matmul`] share, for `x`
/// `(m, k)` and `w`: the row count, one dtype, one device, and on CUDA the
/// kernel's dtype, `k` and alignment; errors name `op`.
fn check_skinny(op: &str, x: &Tensor, w: &Tensor, m: usize, k: usize) -> Result<()> {
    if !(1..=SKINNY_MAX_ROWS).contains(&m) {
        bail!("{op}: x must have 1 to {SKINNY_MAX_ROWS} rows, got {m}");
    }
    if x.dtype() != w.dtype() {
        bail!(
            "{op}: w must be {:?} like x, got {:?}",
            x.dtype(),
            w.dtype()
        );
    }
    if !x.device().same_device(w.device()) {
        bail!("{op}: x and w are on different devices");
    }
    if x.device().is_cuda() && !cuda_fits(x, w) {
        bail!(
            "{op}: on CUDA, x and w must be bf16 or f16 with k a positive multiple of 8 and 8-element aligned starts, got {:?} with k = {k}",
            x.dtype()
        );
    }
    Ok(())
}

/// Whether [`linear`] (and [`gated_linear`]) take the skinny kernel for `x`
/// and `w` on this device, in this process.
fn takes_skinny(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cuda()
        && x.rank() == 2
        && (1..=skinny_rows()).contains(&x.dims()[0])
        && w.rank() == 2
        && w.dims()[1] == x.dims()[1]
        && w.dtype() == x.dtype()
        && cuda_fits(x, w)
}

/// Whether the CUDA kernel takes `x` and `w` as they are laid out.
fn cuda_fits(x: &Tensor, w: &Tensor) -> bool {
    let k = x.dims().last().copied().unwrap_or(0);
    matches!(x.dtype(), DType::BF16 | DType::F16)
        && k > 0
        && k % 8 == 0
        && x.is_contiguous()
        && w.is_contiguous()
        && x.layout().start_offset().is_multiple_of(8)
        && w.layout().start_offset().is_multiple_of(8)
}

/// A linear layer: `x · wᵀ + b` over the last dimension of `x`, as
/// `candle_nn::Linear` computes it, except that on CUDA a 2-D `x` of at
/// most [`SKINNY_LINEAR_ROWS`] rows runs through [`skinny_matmul`] (fewer,
/// or none, as [`SKINNY_MATMUL_ENV`] says).
///
/// # Arguments
/// * `x` - `(..., k)`.
/// * `w` - `(n, k)`, x's dtype.
/// * `bias` - `(n,)`, added to every row.
///
/// Returns `(..., n)`.
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    if !takes_skinny(x, w) {
        return candle_nn::Linear::new(w.clone(), bias.cloned()).forward(x);
    }
    let y = skinny_matmul(x, w)?;
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// The environment variable that turns the fused gate/up product of
/// [`gated_linear`] off (`0`: the product, then [`crate::gated_activation`]),
/// read once.
pub const SKINNY_GATED_ENV: &str = "CANDLE_PAGED_ATTENTION_SKINNY_GATED";

/// Whether [`gated_linear`] may fuse the activation into the skinny product
/// in this process ([`SKINNY_GATED_ENV`]).
fn skinny_gated_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(SKINNY_GATED_ENV).as_deref() != Ok("0"))
}

/// `(m, n, k)` of `x` `(m, k)` and a joined gate/up weight `w` `(2 n, k)`,
/// or an error naming both shapes.
fn gated_mnk(x: &[usize], w: &[usize]) -> Result<(usize, usize, usize)> {
    let (m, rows, k) = mnk(GATED_OP, x, w)?;
    if !rows.is_multiple_of(2) {
        bail!("{GATED_OP}: w {w:?} has an odd row count; a joined gate/up weight has 2 n rows");
    }
    Ok((m, rows / 2, k))
}

const GATED_OP: &str = "skinny-gated-matmul";

/// [`skinny_gated_matmul`]'s op: `x` `(m, k)` and a joined gate/up weight
/// `w` `(2 n, k)` of one dtype give `act(x · gateᵀ) * (x · upᵀ)`,
/// `(m, n)` of that dtype.
#[derive(Clone, Copy, Debug)]
pub struct SkinnyGated {
    /// The activation of the gate.
    pub act: GatedActivation,
}

impl candle_core::CustomOp2 for SkinnyGated {
    fn name(&self) -> &'static str {
        GATED_OP
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, n, k) = gated_mnk(xl.dims(), wl.dims())?;
        let joined =
            crate::cpu::layer_ops::skinny_matmul(GATED_OP, (x, xl), (w, wl), (m, 2 * n, k))?;
        let jl = Layout::contiguous((m, 2 * n));
        let out = crate::cpu::layer_ops::gated(
            GATED_OP,
            self.act,
            (&joined, &jl),
            n,
            candle_core::backend::BackendStorage::dtype(x),
        )?;
        Ok((out, Shape::from((m, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, n, k) = gated_mnk(xl.dims(), wl.dims())?;
        let out =
            crate::cuda::layer_ops::skinny_gated(GATED_OP, self.act, (x, xl), (w, wl), (m, n, k))?;
        Ok((out, Shape::from((m, n))))
    }
}

/// `act(x · gateᵀ) * (x · upᵀ)` for a few rows of `x` and a joined gate/up
/// weight: on CUDA one kernel (each program holds 8 gate rows and their
/// up rows), bit for bit [`skinny_matmul`] followed by
/// [`crate::gated_activation`]; on the CPU those two.
///
/// # Arguments
/// * `x` - `(m, k)`, as for [`skinny_matmul`].
/// * `w` - `(2 n, k)`, x's dtype: the `n` gate rows, then the `n` up rows.
/// * `act` - the gate's activation.
///
/// Returns `(m, n)` of x's dtype.
pub fn skinny_gated_matmul(x: &Tensor, w: &Tensor, act: GatedActivation) -> Result<Tensor> {
    let (m, _, k) = gated_mnk(x.dims(), w.dims())?;
    check_skinny(GATED_OP, x, w, m, k)?;
    x.contiguous()?
        .apply_op2_no_bwd(&w.contiguous()?, &SkinnyGated { act })
}

/// A gated MLP's first half: `act(gate) * up` of `x · wᵀ + b` for a joined
/// gate/up weight, as [`linear`] then [`crate::gated_activation`] compute
/// it, except that on CUDA a bias-free product that [`linear`] would run
/// through [`skinny_matmul`] runs as [`skinny_gated_matmul`], one kernel
/// (unless [`SKINNY_GATED_ENV`] is `0`).
///
/// # Arguments
/// * `x` - `(m, k)`.
/// * `w` - `(2 n, k)`, x's dtype: the gate rows, then the up rows.
/// * `bias` - `(2 n,)`, added before the activation.
/// * `act` - the gate's activation.
///
/// Returns `(m, n)` of x's dtype.
pub fn gated_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    act: GatedActivation,
) -> Result<Tensor> {
    let fused =
        bias.is_none() && skinny_gated_on() && takes_skinny(x, w) && w.dims()[0].is_multiple_of(2);
    if fused {
        return skinny_gated_matmul(x, w, act);
    }
    crate::gated_activation(&linear(x, w, bias)?, act, x.dtype())
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn cpu_matches_an_f64_product_and_rejects_bad_shapes() -> Result<()> {
        let dev = Device::Cpu;
        let (m, n, k) = (3, 5, 24);
        let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
        let got = skinny_matmul(&x, &w)?.to_vec2::<f32>()?;
        let (xv, wv) = (x.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        for (r, row) in got.iter().enumerate() {
            for (c, &g) in row.iter().enumerate() {
                let want: f64 = (0..k).map(|i| xv[r][i] as f64 * wv[c][i] as f64).sum();
                assert!((g as f64 - want).abs() < 1e-4, "({r}, {c}): {g} vs {want}");
            }
        }
        let err = skinny_matmul(&Tensor::zeros((9, k), DType::F32, &dev)?, &w).unwrap_err();
        assert!(err.to_string().contains("1 to 8 rows, got 9"), "{err}");
        let err = skinny_matmul(&x, &Tensor::zeros((n, k + 1), DType::F32, &dev)?).unwrap_err();
        assert!(err.to_string().contains("k differs"), "{err}");
        let err = skinny_matmul(&x, &w.to_dtype(DType::BF16)?).unwrap_err();
        assert!(err.to_string().contains("like x"), "{err}");
        Ok(())
    }

    #[test]
    fn gated_on_the_cpu_is_the_product_then_the_activation() -> Result<()> {
        let dev = Device::Cpu;
        let (m, n, k) = (3, 5, 24);
        let x = Tensor::randn(0f32, 1., (m, k), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::randn(0f32, 1., (2 * n, k), &dev)?.to_dtype(DType::BF16)?;
        for act in [GatedActivation::Silu, GatedActivation::GeluTanh] {
            let want = crate::gated_activation(&skinny_matmul(&x, &w)?, act, DType::BF16)?;
            let got = skinny_gated_matmul(&x, &w, act)?;
            assert_eq!(got.dims(), &[m, n]);
            let same = got.to_dtype(DType::F32)?.to_vec2::<f32>()?
                == want.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            assert!(same, "{act:?}");
            // On the CPU, `gated_linear` is `linear` then the activation.
            let via = gated_linear(&x, &w, None, act)?;
            let plain = crate::gated_activation(&linear(&x, &w, None)?, act, DType::BF16)?;
            assert_eq!(
                via.to_dtype(DType::F32)?.to_vec2::<f32>()?,
                plain.to_dtype(DType::F32)?.to_vec2::<f32>()?
            );
        }
        let err = skinny_gated_matmul(&x, &w.narrow(0, 0, 2 * n - 1)?, GatedActivation::Silu)
            .unwrap_err();
        assert!(err.to_string().contains("odd row count"), "{err}");
        let err =
            skinny_gated_matmul(&x, &w.narrow(1, 0, k - 8)?, GatedActivation::Silu).unwrap_err();
        assert!(
            err.to_string().contains("skinny-gated-matmul")
                && err.to_string().contains("k differs"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn linear_on_the_cpu_is_candle_nn_linear() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (2, 3, 16), &dev)?;
        let w = Tensor::randn(0f32, 1., (7, 16), &dev)?;
        let b = Tensor::randn(0f32, 1., 7, &dev)?;
        let want = candle_nn::Linear::new(w.clone(), Some(b.clone())).forward(&x)?;
        let got = linear(&x, &w, Some(&b))?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        Ok(())
    }
}
