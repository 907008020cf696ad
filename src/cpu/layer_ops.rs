//! The CPU forward of the fused layer ops (`rms_norm`, `add_rms_norm`,
//! gated activations): f32 arithmetic with one rounding per output element,
//! as the CUDA kernels compute them, parallel over rows.
//!
//! Imports `params` and `elem`; never `ops` or `cuda`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, WithDType};
use half::{bf16, f16};
use rayon::prelude::*;

use super::elem::Elem;
use crate::params::GatedActivation;

/// Rows per rayon task: enough work to amortise the task.
const ROWS_PER_TASK: usize = 8;

fn slice<'a, T: WithDType>(op: &str, name: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{op}: {name} must be contiguous");
    };
    Ok(&s.as_slice::<T>()?[start..end])
}

/// One row normalised: `out = src * rsqrt(mean(src^2) + eps) * (w + offset)`.
fn norm_row<T: Elem>(src: &[T], w: &[T], out: &mut [T], eps: f32, offset: f32) {
    let sq: f32 = src.iter().map(|v| v.to_f32() * v.to_f32()).sum();
    let r = 1. / (sq / src.len() as f32 + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(src).zip(w) {
        *o = T::from_f32(v.to_f32() * r * (w.to_f32() + offset));
    }
}

fn norm_typed<T: Elem + WithDType, D: Elem + WithDType>(
    op: &str,
    cols: usize,
    (eps, offset): (f32, f32),
    x: (&CpuStorage, &Layout),
    delta: Option<(&CpuStorage, &Layout)>,
    w: (&CpuStorage, &Layout),
) -> Result<CpuStorage> {
    let xs = slice::<T>(op, "x", x.0, x.1)?;
    let ws = slice::<T>(op, "weight", w.0, w.1)?;
    let n = xs.len();
    let chunk = cols * ROWS_PER_TASK;
    match delta {
        None => {
            let mut out = vec![T::from_f32(0.); n];
            out.par_chunks_mut(chunk)
                .zip(xs.par_chunks(chunk))
                .for_each(|(o, x)| {
                    for (o, x) in o.chunks_mut(cols).zip(x.chunks(cols)) {
                        norm_row(x, ws, o, eps, offset);
                    }
                });
            Ok(T::to_cpu_storage_owned(out))
        }
        Some((d, dl)) => {
            let ds = slice::<D>(op, "delta", d, dl)?;
            let mut out = vec![T::from_f32(0.); 2 * n];
            let (sums, normed) = out.split_at_mut(n);
            sums.par_chunks_mut(chunk)
                .zip(normed.par_chunks_mut(chunk))
                .zip(xs.par_chunks(chunk).zip(ds.par_chunks(chunk)))
                .for_each(|((s, o), (x, d))| {
                    for (((s, o), x), d) in s
                        .chunks_mut(cols)
                        .zip(o.chunks_mut(cols))
                        .zip(x.chunks(cols))
                        .zip(d.chunks(cols))
                    {
                        for ((s, x), d) in s.iter_mut().zip(x).zip(d) {
                            *s = T::from_f32(x.to_f32() + d.to_f32());
                        }
                        norm_row(s, ws, o, eps, offset);
                    }
                });
            Ok(T::to_cpu_storage_owned(out))
        }
    }
}

/// `rms_norm` (no `delta`) or `add_rms_norm` of `x` `(rows, cols)` with
/// `weight` `(cols,)` of x's dtype; `delta` of x's dtype or f32. Returns the
/// normalised values, or for `add_rms_norm` the sums followed by the
/// normalised sums.
pub(crate) fn norm(
    op: &str,
    cols: usize,
    arith: (f32, f32),
    x: (&CpuStorage, &Layout),
    delta: Option<(&CpuStorage, &Layout)>,
    w: (&CpuStorage, &Layout),
) -> Result<CpuStorage> {
    let dd = delta.map(|(d, _)| d.dtype());
    match (x.0.dtype(), dd) {
        (DType::F32, None | Some(DType::F32)) => {
            norm_typed::<f32, f32>(op, cols, arith, x, delta, w)
        }
        (DType::F16, None | Some(DType::F16)) => {
            norm_typed::<f16, f16>(op, cols, arith, x, delta, w)
        }
        (DType::BF16, None | Some(DType::BF16)) => {
            norm_typed::<bf16, bf16>(op, cols, arith, x, delta, w)
        }
        (DType::F16, Some(DType::F32)) => norm_typed::<f16, f32>(op, cols, arith, x, delta, w),
        (DType::BF16, Some(DType::F32)) => norm_typed::<bf16, f32>(op, cols, arith, x, delta, w),
        (dt, dd) => bail!("{op}: unsupported dtypes: x {dt:?}, delta {dd:?}"),
    }
}

fn act(a: GatedActivation, g: f32) -> f32 {
    match a {
        GatedActivation::Silu => g / (1. + (-g).exp()),
        GatedActivation::GeluTanh => {
            let k = 0.797_884_6_f32; // sqrt(2 / pi)
            0.5 * g * (1. + (k * (g + 0.044715 * g * g * g)).tanh())
        }
    }
}

fn gated_typed<I: Elem + WithDType, O: Elem + WithDType>(
    op: &str,
    a: GatedActivation,
    gu: (&CpuStorage, &Layout),
    inter: usize,
) -> Result<CpuStorage> {
    let src = slice::<I>(op, "gate_up", gu.0, gu.1)?;
    if inter == 0 {
        // `(rows, 0)` out of `(rows, 0)` in: empty, and a zero chunk size
        // would not split it.
        return Ok(O::to_cpu_storage_owned(Vec::new()));
    }
    let rows = src.len() / (2 * inter);
    let mut out = vec![O::from_f32(0.); rows * inter];
    out.par_chunks_mut(inter * ROWS_PER_TASK)
        .zip(src.par_chunks(2 * inter * ROWS_PER_TASK))
        .for_each(|(o, s)| {
            for (o, s) in o.chunks_mut(inter).zip(s.chunks(2 * inter)) {
                let (g, u) = s.split_at(inter);
                for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                    *o = O::from_f32(act(a, g.to_f32()) * u.to_f32());
                }
            }
        });
    Ok(O::to_cpu_storage_owned(out))
}

/// `act(gate) * up` of `gate_up` `(rows, 2 * inter)` (gate columns first)
/// as `(rows, inter)` of `out`: the input's dtype, or f16/bf16 for f32.
pub(crate) fn gated(
    op: &str,
    a: GatedActivation,
    gu: (&CpuStorage, &Layout),
    inter: usize,
    out: DType,
) -> Result<CpuStorage> {
    match (gu.0.dtype(), out) {
        (DType::F32, DType::F32) => gated_typed::<f32, f32>(op, a, gu, inter),
        (DType::F16, DType::F16) => gated_typed::<f16, f16>(op, a, gu, inter),
        (DType::BF16, DType::BF16) => gated_typed::<bf16, bf16>(op, a, gu, inter),
        (DType::F32, DType::F16) => gated_typed::<f32, f16>(op, a, gu, inter),
        (DType::F32, DType::BF16) => gated_typed::<f32, bf16>(op, a, gu, inter),
        (i, o) => bail!("{op}: a {i:?} input cannot give a {o:?} output"),
    }
}

fn skinny_typed<T: Elem + WithDType>(
    op: &str,
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    (m, n, k): (usize, usize, usize),
) -> Result<CpuStorage> {
    let xs = slice::<T>(op, "x", x.0, x.1)?;
    let ws = slice::<T>(op, "w", w.0, w.1)?;
    if xs.len() != m * k || ws.len() != n * k {
        bail!(
            "{op}: x holds {} and w {} elements for {m} x {k} and {n} x {k}",
            xs.len(),
            ws.len()
        );
    }
    // xs holds m * k and ws n * k values (checked above), so the row slices
    // below are in bounds.
    let mut out = vec![T::from_f32(0.); m * n];
    out.par_chunks_mut(n.max(1))
        .enumerate()
        .for_each(|(r, row)| {
            let xr = &xs[r * k..(r + 1) * k];
            for (c, o) in row.iter_mut().enumerate() {
                let wr = &ws[c * k..(c + 1) * k];
                let s: f32 = xr
                    .iter()
                    .zip(wr)
                    .map(|(a, b)| a.to_f32() * b.to_f32())
                    .sum();
                *o = T::from_f32(s);
            }
        });
    Ok(T::to_cpu_storage_owned(out))
}

/// `x · wᵀ` of `x` `(m, k)` and `w` `(n, k)`, contiguous, of one dtype
/// (f32, f16 or bf16): `(m, n)` of products summed in f32, rounded once.
pub(crate) fn skinny_matmul(
    op: &str,
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    dims: (usize, usize, usize),
) -> Result<CpuStorage> {
    if x.0.dtype() != w.0.dtype() {
        bail!(
            "{op}: w must be {:?} like x, got {:?}",
            x.0.dtype(),
            w.0.dtype()
        );
    }
    match x.0.dtype() {
        DType::F32 => skinny_typed::<f32>(op, x, w, dims),
        DType::F16 => skinny_typed::<f16>(op, x, w, dims),
        DType::BF16 => skinny_typed::<bf16>(op, x, w, dims),
        dt => bail!("{op}: expected f32, f16 or bf16, got {dt:?}"),
    }
}
