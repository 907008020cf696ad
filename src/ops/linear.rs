//! The linear layers' matmul: `x · wᵀ (+ b)`, with the product of up to
//! [`SKINNY_LINEAR_ROWS`] rows (a decode step of a few sequences) on CUDA
//! as one weight-streaming kernel instead of cuBLAS, whose small-batch
//! kernels read the weights slower. [`skinny_matmul`] itself takes up to
//! [`SKINNY_MAX_ROWS`].
//!
//! Owns `linear`, `skinny_matmul` and the `SkinnyMatmul` op: checks on the
//! host, then the CPU or CUDA backend.

use std::sync::OnceLock;

use candle_core::{bail, CpuStorage, DType, Layout, Module, Result, Shape, Tensor};

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
fn mnk(x: &[usize], w: &[usize]) -> Result<(usize, usize, usize)> {
    let (&[m, k], &[n, wk]) = (x, w) else {
        bail!("{OP}: x must be (m, k) and w (n, k), got {x:?} and {w:?}");
    };
    if wk != k {
        bail!("{OP}: w {w:?} does not match x {x:?}: k differs");
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
        let (m, n, k) = mnk(xl.dims(), wl.dims())?;
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
        let (m, n, k) = mnk(xl.dims(), wl.dims())?;
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
    let (m, _, k) = mnk(x.dims(), w.dims())?;
    if !(1..=SKINNY_MAX_ROWS).contains(&m) {
        bail!("{OP}: x must have 1 to {SKINNY_MAX_ROWS} rows, got {m}");
    }
    if x.dtype() != w.dtype() {
        bail!(
            "{OP}: w must be {:?} like x, got {:?}",
            x.dtype(),
            w.dtype()
        );
    }
    if !x.device().same_device(w.device()) {
        bail!("{OP}: x and w are on different devices");
    }
    if x.device().is_cuda() && !cuda_fits(x, w) {
        bail!(
            "{OP}: on CUDA, x and w must be bf16 or f16 with k a positive multiple of 8 and 8-element aligned starts, got {:?} with k = {k}",
            x.dtype()
        );
    }
    x.contiguous()?
        .apply_op2_no_bwd(&w.contiguous()?, &SkinnyMatmul)
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
    let skinny = x.device().is_cuda()
        && x.rank() == 2
        && (1..=skinny_rows()).contains(&x.dims()[0])
        && w.rank() == 2
        && w.dims()[1] == x.dims()[1]
        && w.dtype() == x.dtype()
        && cuda_fits(x, w);
    if !skinny {
        return candle_nn::Linear::new(w.clone(), bias.cloned()).forward(x);
    }
    let y = skinny_matmul(x, w)?;
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
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
