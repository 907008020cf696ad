//! Case bodies that take the device: [`check_case`] runs the op and checks
//! it against the f64 reference (and, off the CPU, against the CPU path on
//! the same inputs); [`op_output`] and [`compare`] let a test compare two
//! runs.

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device};
use candle_paged_attention::paged_attention;
use candle_paged_attention::reference::{paged_attention_f64, ReferenceOutput};

use super::case::{Case, Inputs};

/// Absolute and relative tolerance: `|a - e| <= atol + rtol * |e|`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub atol: f64,
    pub rtol: f64,
}

impl Tolerance {
    pub const F32: Self = Self {
        atol: 1e-4,
        rtol: 1e-4,
    };
    pub const HALF: Self = Self {
        atol: 1.5e-2,
        rtol: 1e-2,
    };
    pub const FP8: Self = Self {
        atol: 1.5e-1,
        rtol: 1.5e-1,
    };

    /// By dtype: f32 1e-4; f16/bf16 atol 1.5e-2, rtol 1e-2; an fp8 cache or
    /// an fp8 output 1.5e-1.
    pub fn for_case(case: &Case) -> Self {
        if case.fp8_cache || case.output_scale.is_some() {
            Self::FP8
        } else if case.dtype == DType::F32 {
            Self::F32
        } else {
            Self::HALF
        }
    }
}

/// Checks that every `actual` value is finite and within `tol` of
/// `expected`; the error names the worst element by (token, head, dim).
pub fn compare(actual: &[f32], expected: &[f64], dims: [usize; 3], tol: Tolerance) -> Result<()> {
    let [n, h, d] = dims;
    ensure!(
        actual.len() == n * h * d && expected.len() == n * h * d,
        "length mismatch: actual {}, expected {}, dims {dims:?}",
        actual.len(),
        expected.len()
    );
    let at = |i: usize| (i / (h * d), (i / d) % h, i % d);
    if let Some(i) = actual.iter().position(|a| !a.is_finite()) {
        bail!(
            "output at (token, head, dim) {:?} is {} (expected {}); {} non-finite values in all",
            at(i),
            actual[i],
            expected[i],
            actual.iter().filter(|a| !a.is_finite()).count()
        );
    }
    if let Some(i) = expected.iter().position(|e| !e.is_finite()) {
        bail!("reference value at {:?} is {}", at(i), expected[i]);
    }
    let mut bad = 0usize;
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let err = (a as f64 - e).abs();
        let ratio = err / (tol.atol + tol.rtol * e.abs());
        if ratio > 1.0 {
            bad += 1;
            if worst.is_none_or(|(_, r)| ratio > r) {
                worst = Some((i, ratio));
            }
        }
    }
    if let Some((i, _)) = worst {
        bail!(
            "{bad} of {} values differ beyond atol {} rtol {}; worst at (token, head, dim) {:?}: got {}, expected {}",
            actual.len(),
            tol.atol,
            tol.rtol,
            at(i),
            actual[i],
            expected[i]
        );
    }
    Ok(())
}

/// `values` widened to f64, to serve as the expected side of [`compare`].
pub fn widen(values: &[f32]) -> Vec<f64> {
    values.iter().map(|&x| x as f64).collect()
}

/// Runs the op on `inputs` and returns its output as f32 values in the
/// attention domain (an fp8 output multiplied back by its scale), after
/// checking the output's shape, dtype and device.
pub fn run_op(case: &Case, inputs: &Inputs) -> Result<Vec<f32>> {
    let params = case.params(inputs);
    let out = paged_attention(&inputs.q, &params)?;
    let want_dtype = case.output_scale.map_or(case.dtype, |_| DType::F8E4M3);
    ensure!(
        out.dims() == case.out_dims(),
        "output shape {:?}, expected {:?}",
        out.dims(),
        case.out_dims()
    );
    ensure!(
        out.dtype() == want_dtype,
        "output dtype {:?}, expected {want_dtype:?}",
        out.dtype()
    );
    ensure!(
        out.device().same_device(inputs.q.device()),
        "output on {:?}, query on {:?}",
        out.device().location(),
        inputs.q.device().location()
    );
    let mut values = out
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    if let Some(s) = case.output_scale {
        values.iter_mut().for_each(|v| *v *= s);
    }
    Ok(values)
}

/// The op's output for `case` on `device` (f32, attention domain).
pub fn op_output(case: &Case, device: &Device) -> Result<Vec<f32>> {
    let inputs = case.build(device)?;
    run_op(case, &inputs)
}

/// One run of a case: the op's output and the reference's.
pub struct CaseRun {
    pub actual: Vec<f32>,
    pub expected: ReferenceOutput,
}

/// The f64 reference on `inputs`.
pub fn reference(case: &Case, inputs: &Inputs) -> Result<ReferenceOutput> {
    Ok(paged_attention_f64(&inputs.q, &case.params(inputs))?)
}

/// Runs `case` on `device` and computes the reference on the same inputs.
pub fn run_case(case: &Case, device: &Device) -> Result<CaseRun> {
    let inputs = case.build(device)?;
    Ok(CaseRun {
        actual: run_op(case, &inputs)?,
        expected: reference(case, &inputs)?,
    })
}

/// Checks a finished run: finite everywhere, within the case's tolerance of
/// the reference, and exactly zero on rows with no visible key.
pub fn check_run(case: &Case, run: &CaseRun) -> Result<()> {
    let dims = case.out_dims();
    let tol = Tolerance::for_case(case);
    compare(&run.actual, run.expected.values(), dims, tol)?;
    let d = case.head_size;
    let empty = run.expected.empty_rows().iter().enumerate();
    for (row, _) in empty.filter(|(_, &e)| e) {
        let got = &run.actual[row * d..(row + 1) * d];
        ensure!(
            got.iter().all(|&x| x == 0.0),
            "(token {}, head {}) has no visible key but its output is not zero: {:?}",
            row / case.num_heads,
            row % case.num_heads,
            &got[..got.len().min(4)]
        );
    }
    Ok(())
}

/// The case body: runs the op on `device` and checks it against the f64
/// reference; off the CPU, also against the CPU path's output on the same
/// inputs.
pub fn check_case(case: &Case, device: &Device) -> Result<()> {
    let run = run_case(case, device).with_context(|| case.label())?;
    let on = device_name(device);
    check_run(case, &run).with_context(|| format!("{on} vs reference: {}", case.label()))?;
    if device.is_cpu() {
        return Ok(());
    }
    let cpu = op_output(case, &Device::Cpu).with_context(|| case.label())?;
    let tol = Tolerance::for_case(case);
    compare(&run.actual, &widen(&cpu), case.out_dims(), tol)
        .with_context(|| format!("{on} vs cpu: {}", case.label()))
}

/// `cpu` or `cuda:N`, for messages.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}"),
    }
}
