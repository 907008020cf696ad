//! The fused layer ops (`rms_norm`, `add_rms_norm`, `gated_activation`)
//! and the linear layers' matmul (`skinny_matmul`, `linear`, and their
//! gated forms `skinny_gated_matmul`, `gated_linear`) against an f64
//! reference computed here from the inputs, on the CPU and,
//! with the `cuda` feature, on the GPU (run with
//! `CANDLE_PAGED_ATTENTION_POISON=1` there so that an element a kernel
//! forgets to write is NaN).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{
    add_rms_norm, gated_activation, gated_linear, greedy_tokens, linear, rms_norm,
    skinny_gated_matmul, skinny_matmul, GatedActivation, SKINNY_MAX_ROWS,
};
use rstest::rstest;

#[macro_use]
mod common;
use common::device::devices;

/// Values of `t` as f64, row-major.
fn values(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// Tolerance of one rounding to `dtype` of values up to `scale`, plus f32
/// reassociation of a sum of `terms` terms.
fn tolerance(dtype: DType, scale: f64, terms: usize) -> f64 {
    let eps = match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => 2f64.powi(-24),
    };
    scale * (eps + terms as f64 * 2f64.powi(-24))
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: &dyn Fn(f64) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol(*w),
            "{what}: element {i}: got {g}, want {w} (tolerance {})",
            tol(*w)
        );
    }
}

/// The reference norm of rows of `cols` values (already rounded inputs).
fn ref_norm(x: &[f64], w: &[f64], cols: usize, eps: f64, off: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(cols) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / cols as f64;
        let r = 1. / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, w)| v * r * (w + off)));
    }
    out
}

#[rstest]
fn rms_norm_matches_reference(
    #[values(DType::F32, DType::BF16, DType::F16)] dtype: DType,
    #[values((1, 1), (3, 577), (5, 4096), (2, 8192), (2, 8193), (1, 16384))] shape: (usize, usize),
    #[values(0.0, 1.0)] offset: f32,
) -> Result<()> {
    let (rows, cols) = shape;
    for dev in devices()? {
        let x = (Tensor::randn(0f32, 2., (rows, cols), &dev)? + 0.5)?.to_dtype(dtype)?;
        let w = Tensor::randn(0f32, 1., cols, &dev)?.to_dtype(dtype)?;
        let y = rms_norm(&x, &w, 1e-5, offset)?;
        assert_eq!((y.dims(), y.dtype()), (x.dims(), dtype));
        let want = ref_norm(
            &values(&x)?,
            &values(&w)?,
            cols,
            1e-5f32 as f64,
            offset as f64,
        );
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
        let tol = |_w: f64| tolerance(dtype, scale, cols) * 2.;
        assert_close(
            &format!("rms_norm {dev:?} {dtype:?} {shape:?}"),
            &values(&y)?,
            &want,
            &tol,
        );
    }
    Ok(())
}

#[rstest]
fn add_rms_norm_matches_reference(
    #[values(DType::F32, DType::BF16, DType::F16)] dtype: DType,
    #[values(false, true)] f32_delta: bool,
    #[values((1, 64), (7, 576), (3, 5001), (2, 4096), (1, 8192), (1, 8200))] shape: (usize, usize),
) -> Result<()> {
    let (rows, cols) = shape;
    for dev in devices()? {
        let x = Tensor::randn(0f32, 1., (rows, cols), &dev)?.to_dtype(dtype)?;
        let dd = if f32_delta { DType::F32 } else { dtype };
        let delta = Tensor::randn(0f32, 1., (rows, cols), &dev)?.to_dtype(dd)?;
        let w = Tensor::randn(0f32, 1., cols, &dev)?.to_dtype(dtype)?;
        let (sum, normed) = add_rms_norm(&x, &delta, &w, 1e-6, 1.0)?;
        assert_eq!((sum.dims(), sum.dtype()), (x.dims(), dtype));
        assert_eq!((normed.dims(), normed.dtype()), (x.dims(), dtype));
        // The sum is one rounding of the exact sum.
        let exact: Vec<f64> = values(&x)?
            .iter()
            .zip(values(&delta)?)
            .map(|(a, b)| a + b)
            .collect();
        let got_sum = values(&sum)?;
        // One rounding: relative above the normal range, the subnormal
        // spacing below it (an f16 sum near 0 lands on multiples of 2^-24).
        let spacing = match dtype {
            DType::F16 => 2f64.powi(-24),
            DType::BF16 => 2f64.powi(-133),
            _ => 2f64.powi(-149),
        };
        let tol = |w: f64| tolerance(dtype, w.abs(), 0) + spacing;
        let what = format!("add_rms_norm sum {dev:?} {dtype:?} {dd:?} {shape:?}");
        assert_close(&what, &got_sum, &exact, &tol);
        // The norm reads the rounded sum.
        let want = ref_norm(&got_sum, &values(&w)?, cols, 1e-6f32 as f64, 1.0);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let tol = |_w: f64| tolerance(dtype, scale, cols) * 2.;
        let what = format!("add_rms_norm norm {dev:?} {dtype:?} {dd:?} {shape:?}");
        assert_close(&what, &values(&normed)?, &want, &tol);
    }
    Ok(())
}

fn ref_act(act: GatedActivation, g: f64) -> f64 {
    match act {
        GatedActivation::Silu => g / (1. + (-g).exp()),
        GatedActivation::GeluTanh => {
            let k = (2. / std::f64::consts::PI).sqrt();
            0.5 * g * (1. + (k * (g + 0.044715 * g * g * g)).tanh())
        }
    }
}

#[rstest]
fn gated_activation_matches_reference(
    #[values(GatedActivation::Silu, GatedActivation::GeluTanh)] act: GatedActivation,
    #[values(
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
        (DType::F32, DType::BF16),
        (DType::F32, DType::F16)
    )]
    dtypes: (DType, DType),
    #[values((1, 1), (9, 1536), (3, 70001))] shape: (usize, usize),
) -> Result<()> {
    let (rows, inter) = shape;
    let (din, dout) = dtypes;
    for dev in devices()? {
        let gu = (Tensor::randn(0f32, 3., (rows, 2 * inter), &dev)?).to_dtype(din)?;
        let y = gated_activation(&gu, act, dout)?;
        assert_eq!((y.dims(), y.dtype()), (&[rows, inter][..], dout));
        let v = values(&gu)?;
        // (reference, tolerance) per element: one rounding to `dout`, plus
        // f32 exp/tanh error relative to the magnitude; for GeluTanh also
        // the f32 absolute error of `1 + tanh(..)` (two ulps of 1), which
        // is all of its value in the negative tail (about -5 and below),
        // times `0.5 |g| |u|`.
        let (want, tols): (Vec<f64>, Vec<f64>) = v
            .chunks(2 * inter)
            .flat_map(|r| {
                let (g, u) = r.split_at(inter);
                g.iter()
                    .zip(u)
                    .map(|(g, u)| {
                        let w = ref_act(act, *g) * u;
                        let cancel = match act {
                            GatedActivation::GeluTanh => 0.5 * (g * u).abs() * 2f64.powi(-22),
                            GatedActivation::Silu => 0.,
                        };
                        let tol = tolerance(dout, w.abs(), 0) + 1e-5 * w.abs() + 1e-6;
                        (w, tol + cancel)
                    })
                    .collect::<Vec<_>>()
            })
            .unzip();
        let what = format!("gated {act:?} {dev:?} {dtypes:?} {shape:?}");
        let got = values(&y)?;
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, ((g, w), t)) in got.iter().zip(&want).zip(&tols).enumerate() {
            assert!(
                (g - w).abs() <= *t,
                "{what}: element {i}: got {g}, want {w} (tolerance {t})"
            );
        }
    }
    Ok(())
}

/// Rows that start off a 16-byte boundary (a view at an odd element
/// offset) take the element-by-element path and give the same values.
#[rstest]
fn norms_of_a_view_at_an_odd_offset_match_an_aligned_copy(
    #[values(DType::BF16, DType::F16)] dtype: DType,
) -> Result<()> {
    let (rows, cols) = (3, 4096);
    for dev in devices()? {
        let flat = Tensor::randn(0f32, 1., rows * cols + 1, &dev)?.to_dtype(dtype)?;
        let view = flat.narrow(0, 1, rows * cols)?.reshape((rows, cols))?;
        let copy = view.copy()?;
        let w = Tensor::randn(0f32, 1., cols, &dev)?.to_dtype(dtype)?;
        let a = values(&rms_norm(&view, &w, 1e-5, 0.)?)?;
        let b = values(&rms_norm(&copy, &w, 1e-5, 0.)?)?;
        let want = ref_norm(&values(&copy)?, &values(&w)?, cols, 1e-5f32 as f64, 0.);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let tol = |_w: f64| tolerance(dtype, scale, cols) * 2.;
        assert_close(&format!("rms_norm view {dev:?} {dtype:?}"), &a, &want, &tol);
        assert_close(&format!("rms_norm copy {dev:?} {dtype:?}"), &b, &want, &tol);
        let (s1, n1) = add_rms_norm(&view, &copy, &w, 1e-5, 0.)?;
        let (s2, n2) = add_rms_norm(&copy, &copy, &w, 1e-5, 0.)?;
        assert_eq!(values(&s1)?, values(&s2)?, "{dev:?} {dtype:?}: sums");
        assert_close(
            &format!("add_rms_norm view {dev:?} {dtype:?}"),
            &values(&n1)?,
            &values(&n2)?,
            &|w: f64| tolerance(dtype, w.abs().max(scale), cols) * 2.,
        );
    }
    Ok(())
}

#[test]
fn nan_propagates_and_stays_in_its_row() -> Result<()> {
    for dev in devices()? {
        let mut x = vec![1f32; 3 * 8];
        x[9] = f32::NAN;
        let x = Tensor::from_vec(x, (3, 8), &dev)?;
        let w = Tensor::ones(8, DType::F32, &dev)?;
        let y = values(&rms_norm(&x, &w, 1e-5, 0.)?)?;
        assert!(y[8..16].iter().all(|v| v.is_nan()), "{dev:?}: row 1 {y:?}");
        assert!(y[..8].iter().chain(&y[16..]).all(|v| v.is_finite()));
        let zero = Tensor::zeros((3, 8), DType::F32, &dev)?;
        let (s, n) = add_rms_norm(&zero, &x, &w, 1e-5, 0.)?;
        assert!(values(&s)?[9].is_nan() && values(&n)?[8..16].iter().all(|v| v.is_nan()));
        let gu = Tensor::from_vec(vec![f32::NAN, 1., 2., 3.], (1, 4), &dev)?;
        let g = values(&gated_activation(&gu, GatedActivation::Silu, DType::F32)?)?;
        assert!(g[0].is_nan() && g[1].is_finite(), "{dev:?}: {g:?}");
    }
    Ok(())
}

#[test]
fn zero_size_inputs_give_empty_outputs() -> Result<()> {
    for dev in devices()? {
        for dtype in [DType::F32, DType::BF16] {
            // (rows, 0): no gate or up columns.
            let gu = Tensor::zeros((3, 0), dtype, &dev)?;
            let g = gated_activation(&gu, GatedActivation::Silu, dtype)?;
            assert_eq!((g.dims(), g.dtype()), (&[3, 0][..], dtype), "{dev:?}");
            // (0, 2 * inter): no rows.
            let gu = Tensor::zeros((0, 8), DType::F32, &dev)?;
            let g = gated_activation(&gu, GatedActivation::GeluTanh, dtype)?;
            assert_eq!((g.dims(), g.dtype()), (&[0, 4][..], dtype), "{dev:?}");
            let x = Tensor::zeros((0, 8), dtype, &dev)?;
            let w = Tensor::ones(8, dtype, &dev)?;
            let y = rms_norm(&x, &w, 1e-5, 0.)?;
            assert_eq!((y.dims(), y.dtype()), (&[0, 8][..], dtype), "{dev:?}");
            let (sum, n) = add_rms_norm(&x, &x, &w, 1e-5, 1.)?;
            assert_eq!(
                (sum.dims(), n.dims()),
                (&[0, 8][..], &[0, 8][..]),
                "{dev:?}"
            );
            // An empty x still checks its weight.
            let w7 = Tensor::ones(7, dtype, &dev)?;
            let err = rms_norm(&x, &w7, 1e-5, 0.).unwrap_err().to_string();
            assert!(err.starts_with("rms-norm: weight must be (8,)"), "{err}");
        }
    }
    Ok(())
}

#[test]
fn bad_arguments_are_errors_naming_the_op() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 8), DType::F32, &dev)?;
    let msg = |r: candle_core::Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let w7 = Tensor::ones(7, DType::F32, &dev)?;
    assert!(msg(rms_norm(&x, &w7, 1e-5, 0.)).contains("rms-norm: weight must be (8,)"));
    let wb = Tensor::ones(8, DType::BF16, &dev)?;
    assert!(msg(rms_norm(&x, &wb, 1e-5, 0.)).contains("rms-norm: weight is BF16 but x is F32"));
    let w = Tensor::ones(8, DType::F32, &dev)?;
    assert!(msg(rms_norm(&x, &w, f32::NAN, 0.)).contains("rms-norm: eps must be finite"));
    let d = Tensor::zeros((2, 9), DType::F32, &dev)?;
    let e = add_rms_norm(&x, &d, &w, 1e-5, 0.)
        .err()
        .map(|e| e.to_string());
    assert!(e
        .unwrap_or_default()
        .contains("add-rms-norm: delta must have x's shape"));
    let xb = x.to_dtype(DType::BF16)?;
    let d16 = Tensor::zeros((2, 8), DType::F16, &dev)?;
    let e = add_rms_norm(&xb, &d16, &wb, 1e-5, 0.)
        .err()
        .map(|e| e.to_string());
    assert!(e
        .unwrap_or_default()
        .contains("add-rms-norm: delta must be BF16 or f32, got F16"));
    let odd = Tensor::zeros((2, 7), DType::F32, &dev)?;
    assert!(
        msg(gated_activation(&odd, GatedActivation::Silu, DType::F32))
            .contains("gated-activation: gate_up has an odd width 7")
    );
    assert!(
        msg(gated_activation(&xb, GatedActivation::Silu, DType::F32))
            .contains("gated-activation: a BF16 gate_up cannot give a F32 output")
    );
    Ok(())
}

/// `x · wᵀ` in f64 of row-major `x` `(m, k)` and `w` `(n, k)`.
fn ref_matmul(x: &[f64], w: &[f64], (m, n, k): (usize, usize, usize)) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for r in 0..m {
        for c in 0..n {
            out[r * n + c] = (0..k).map(|i| x[r * k + i] * w[c * k + i]).sum();
        }
    }
    out
}

/// Tolerance of a dot product of `k` terms rounded once to `dtype`: the
/// rounding of the result plus f32 reassociation over the sum of |terms|.
fn dot_tolerance(dtype: DType, want: f64, abs_sum: f64, k: usize) -> f64 {
    tolerance(dtype, want.abs(), 0) + abs_sum * k as f64 * 2f64.powi(-23)
}

#[rstest]
fn skinny_matmul_matches_reference(
    #[values(DType::BF16, DType::F16)] dtype: DType,
    #[values(1, 2, 3, 5, 8)] m: usize,
    #[values((1, 8), (3, 24), (257, 264), (1000, 4096), (33, 14336))] nk: (usize, usize),
) -> Result<()> {
    let (n, k) = nk;
    for dev in devices()? {
        // Views at an offset of 8 elements: the kernel reads from the start.
        let x = Tensor::randn(0f32, 1., (m + 1, k), &dev)?
            .to_dtype(dtype)?
            .narrow(0, 1, m)?;
        let w = Tensor::randn(0f32, 1., (n * k + 8,), &dev)?
            .to_dtype(dtype)?
            .narrow(0, 8, n * k)?
            .reshape((n, k))?;
        let y = skinny_matmul(&x, &w)?;
        assert_eq!((y.dims(), y.dtype()), (&[m, n][..], dtype));
        let (xv, wv) = (values(&x)?, values(&w)?);
        let want = ref_matmul(&xv, &wv, (m, n, k));
        let abs: Vec<f64> = ref_matmul(
            &xv.iter().map(|v| v.abs()).collect::<Vec<_>>(),
            &wv.iter().map(|v| v.abs()).collect::<Vec<_>>(),
            (m, n, k),
        );
        let got = values(&y)?;
        for (i, ((g, w), a)) in got.iter().zip(&want).zip(&abs).enumerate() {
            let tol = dot_tolerance(dtype, *w, *a, k);
            assert!(
                (g - w).abs() <= tol,
                "skinny_matmul {dev:?} {dtype:?} m {m} n {n} k {k}: element {i}: got {g}, want {w} (tolerance {tol})"
            );
        }
    }
    Ok(())
}

#[test]
fn skinny_matmul_propagates_nan_to_its_row_and_column_only() -> Result<()> {
    for dev in devices()? {
        let (m, n, k) = (3, 5, 16);
        let mut x = vec![1f32; m * k];
        x[k + 3] = f32::NAN; // row 1
        let mut w = vec![0.5f32; n * k];
        w[2 * k + 7] = f32::INFINITY; // column 2
        let x = Tensor::from_vec(x, (m, k), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::from_vec(w, (n, k), &dev)?.to_dtype(DType::BF16)?;
        let y = values(&skinny_matmul(&x, &w)?)?;
        for r in 0..m {
            for c in 0..n {
                let v = y[r * n + c];
                match (r, c) {
                    (1, _) => assert!(v.is_nan(), "{dev:?} ({r}, {c}): {v}"),
                    (_, 2) => assert_eq!(v, f64::INFINITY, "{dev:?} ({r}, {c})"),
                    _ => assert_eq!(v, 8.0, "{dev:?} ({r}, {c})"),
                }
            }
        }
    }
    Ok(())
}

#[rstest]
fn linear_matches_candle_nn_within_rounding(
    #[values(1, 4, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 40)] rows: usize,
    #[values(false, true)] bias: bool,
) -> Result<()> {
    let (n, k) = (200, 264);
    for dev in devices()? {
        let x = Tensor::randn(0f32, 1., (rows, k), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?.to_dtype(DType::BF16)?;
        let b = Tensor::randn(0f32, 1., n, &dev)?.to_dtype(DType::BF16)?;
        let b = bias.then_some(&b);
        let got = values(&linear(&x, &w, b)?)?;
        let product = ref_matmul(&values(&x)?, &values(&w)?, (rows, n, k));
        let mut want = product.clone();
        if let Some(b) = b {
            let bv = values(b)?;
            for (i, v) in want.iter_mut().enumerate() {
                *v += bv[i % n];
            }
        }
        for (i, ((g, w), p)) in got.iter().zip(&want).zip(&product).enumerate() {
            // Both paths round the product once, and the sum with the bias
            // once more.
            let scale = w.abs().max(p.abs()).max(1.0);
            let tol = 2. * tolerance(DType::BF16, scale, k) + k as f64 * 2f64.powi(-20);
            assert!(
                (g - w).abs() <= tol,
                "linear {dev:?} rows {rows} bias {bias}: element {i}: got {g}, want {w}"
            );
        }
    }
    Ok(())
}

#[test]
fn skinny_matmul_rejects_bad_calls_naming_the_op() -> Result<()> {
    for dev in devices()? {
        let w = Tensor::zeros((4, 16), DType::BF16, &dev)?;
        let cases = [
            (
                Tensor::zeros((9, 16), DType::BF16, &dev)?,
                "1 to 8 rows, got 9",
            ),
            (
                Tensor::zeros((0, 16), DType::BF16, &dev)?,
                "1 to 8 rows, got 0",
            ),
            (Tensor::zeros((2, 8), DType::BF16, &dev)?, "k differs"),
            (Tensor::zeros((2, 16), DType::F16, &dev)?, "like x"),
            (
                Tensor::zeros((2, 4, 16), DType::BF16, &dev)?,
                "x must be (m, k)",
            ),
        ];
        for (x, want) in cases {
            let err = skinny_matmul(&x, &w).unwrap_err().to_string();
            assert!(
                err.contains("skinny-matmul") && err.contains(want),
                "{dev:?}: {err}"
            );
        }
        if dev.is_cuda() {
            let x = Tensor::zeros((2, 12), DType::BF16, &dev)?;
            let w = Tensor::zeros((4, 12), DType::BF16, &dev)?;
            let err = skinny_matmul(&x, &w).unwrap_err().to_string();
            assert!(err.contains("multiple of 8"), "{err}");
        }
    }
    Ok(())
}

#[rstest]
fn greedy_tokens_are_candle_argmax_with_a_finiteness_flag(
    #[values(1, 7, 50001, 128256)] vocab: usize,
) -> Result<()> {
    for dev in devices()? {
        let rows = 5;
        let mut v: Vec<f32> = Tensor::randn(0f32, 3., (rows, vocab), &Device::Cpu)?
            .flatten_all()?
            .to_vec1()?;
        // Row 1: a tie for the maximum (the lower index wins); row 2: a NaN;
        // row 3: +inf (the maximum, not finite); row 4: all -inf.
        if vocab > 2 {
            v[vocab + vocab - 1] = 100.0;
            v[vocab + 1] = 100.0;
        }
        v[2 * vocab + vocab / 2] = f32::NAN;
        v[3 * vocab + vocab - 1] = f32::INFINITY;
        v[4 * vocab..5 * vocab].fill(f32::NEG_INFINITY);
        let logits = Tensor::from_vec(v.clone(), (rows, vocab), &dev)?;
        let got = greedy_tokens(&logits)?.to_vec2::<u32>()?;
        let want_tok: Vec<u32> = Tensor::from_vec(v, (rows, vocab), &Device::Cpu)?
            .argmax(1)?
            .to_vec1()?;
        let finite = [true, true, false, false, false];
        for r in 0..rows {
            assert_eq!(
                got[r][1] == 1,
                finite[r],
                "{dev:?} vocab {vocab} row {r}: {got:?}"
            );
            // The token of a row with a NaN is not asked for (the engine
            // ends such a request); every other row's is candle's argmax.
            if r != 2 {
                assert_eq!(got[r][0], want_tok[r], "{dev:?} vocab {vocab} row {r}");
            }
        }
        if vocab > 2 {
            assert_eq!(got[1][0], 1, "{dev:?}: a tie goes to the lower index");
        }
        assert_eq!(
            got[3][0] as usize,
            vocab - 1,
            "{dev:?}: +inf is the maximum"
        );
        assert_eq!(got[4][0], 0, "{dev:?}: a row of -inf gives index 0");
        let err = greedy_tokens(&logits.to_dtype(DType::BF16)?).unwrap_err();
        assert!(err.to_string().contains("greedy-tokens"), "{err}");
    }
    Ok(())
}

#[test]
fn skinny_matmul_rows_do_not_depend_on_the_other_rows() -> Result<()> {
    // A graph's padded bucket runs a step's matmuls with more rows than the
    // eager step: each row's products must not change with them.
    let (n, k) = (300, 4096);
    for dev in devices()? {
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?.to_dtype(DType::BF16)?;
        let x = Tensor::randn(0f32, 1., (8, k), &dev)?.to_dtype(DType::BF16)?;
        let big = Tensor::randn(0f32, 1e4, (8, k), &dev)?.to_dtype(DType::BF16)?;
        let first = values(&skinny_matmul(&x.narrow(0, 0, 1)?, &w)?)?;
        for m in 2..=8 {
            for others in [&x, &big] {
                let rows = Tensor::cat(&[x.narrow(0, 0, 1)?, others.narrow(0, 1, m - 1)?], 0)?;
                let y = values(&skinny_matmul(&rows, &w)?)?;
                assert_eq!(&y[..n], &first[..], "{dev:?}: row 0 changed with {m} rows");
            }
        }
    }
    Ok(())
}

/// Bit patterns of `t` (as f32, which holds every f16/bf16 value exactly):
/// equal patterns, NaN included, compare equal.
fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .map(|v| v.to_bits())
        .collect())
}

#[rstest]
fn skinny_gated_matmul_is_the_product_then_the_activation(
    #[values(DType::BF16, DType::F16)] dtype: DType,
    #[values(GatedActivation::Silu, GatedActivation::GeluTanh)] act: GatedActivation,
    #[values(1, 2, 3, 5, 8)] m: usize,
    #[values((1, 8), (3, 24), (257, 264), (1000, 4096), (33, 14336))] nk: (usize, usize),
) -> Result<()> {
    // n gate rows and n up rows; odd n leaves a program's last rows empty.
    // x at a quarter of unit scale: gate times up stays within f16's range.
    let (n, k) = nk;
    for dev in devices()? {
        let x = Tensor::randn(0f32, 0.25, (m + 1, k), &dev)?
            .to_dtype(dtype)?
            .narrow(0, 1, m)?;
        let w = Tensor::randn(0f32, 1., (2 * n * k + 8,), &dev)?
            .to_dtype(dtype)?
            .narrow(0, 8, 2 * n * k)?
            .reshape((2 * n, k))?;
        let want = gated_activation(&skinny_matmul(&x, &w)?, act, dtype)?;
        let got = skinny_gated_matmul(&x, &w, act)?;
        assert_eq!((got.dims(), got.dtype()), (&[m, n][..], dtype));
        assert!(
            bits(&got)? == bits(&want)?,
            "skinny_gated_matmul {dev:?} {dtype:?} {act:?} m {m} n {n} k {k}: differs from the product then the activation"
        );
        // And against the f64 reference of both halves, within rounding.
        let (xv, wv) = (values(&x)?, values(&w)?);
        let joined = ref_matmul(&xv, &wv, (m, 2 * n, k));
        let gv = values(&got)?;
        for r in 0..m {
            for c in 0..n {
                let (g, u) = (joined[r * 2 * n + c], joined[r * 2 * n + n + c]);
                let want = ref_act(act, g) * u;
                let tol =
                    tolerance(dtype, want.abs(), 0) + (g.abs() + u.abs()) * 1e-2 * (1. + u.abs());
                let v = gv[r * n + c];
                assert!((v - want).abs() <= tol, "{dev:?} ({r}, {c}): {v} vs {want}");
            }
        }
        // `gated_linear` is `linear` then the activation (on CUDA, at these
        // row counts, the fused kernel: the same bits).
        let via = gated_activation(&linear(&x, &w, None)?, act, dtype)?;
        assert!(
            bits(&gated_linear(&x, &w, None, act)?)? == bits(&via)?,
            "{dev:?} gated_linear"
        );
    }
    Ok(())
}

#[test]
fn skinny_gated_matmul_propagates_nan_to_its_row_and_column_only() -> Result<()> {
    for dev in devices()? {
        let (m, n, k) = (3, 5, 16);
        let mut x = vec![1f32; m * k];
        x[k + 3] = f32::NAN; // row 1
        let mut w = vec![0.0625f32; 2 * n * k];
        w[(n + 2) * k + 7] = f32::INFINITY; // up row of column 2
        let x = Tensor::from_vec(x, (m, k), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::from_vec(w, (2 * n, k), &dev)?.to_dtype(DType::BF16)?;
        let y = values(&skinny_gated_matmul(&x, &w, GatedActivation::Silu)?)?;
        let silu1 = 1. / (1. + (-1f64).exp());
        for r in 0..m {
            for c in 0..n {
                let v = y[r * n + c];
                match (r, c) {
                    (1, _) => assert!(v.is_nan(), "{dev:?} ({r}, {c}): {v}"),
                    (_, 2) => assert_eq!(v, f64::INFINITY, "{dev:?} ({r}, {c})"),
                    _ => assert!((v - silu1).abs() < 1e-2, "{dev:?} ({r}, {c}): {v}"),
                }
            }
        }
    }
    Ok(())
}

#[test]
fn skinny_gated_matmul_rejects_bad_calls_naming_the_op() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 16), DType::BF16, &dev)?;
    let act = GatedActivation::Silu;
    let err =
        skinny_gated_matmul(&x, &Tensor::zeros((5, 16), DType::BF16, &dev)?, act).unwrap_err();
    assert!(
        err.to_string().contains("skinny-gated-matmul")
            && err.to_string().contains("odd row count"),
        "{err}"
    );
    let err = skinny_gated_matmul(
        &Tensor::zeros((9, 16), DType::BF16, &dev)?,
        &Tensor::zeros((4, 16), DType::BF16, &dev)?,
        act,
    )
    .unwrap_err();
    assert!(err.to_string().contains("1 to 8 rows, got 9"), "{err}");
    let err = skinny_gated_matmul(&x, &Tensor::zeros((4, 16), DType::F16, &dev)?, act).unwrap_err();
    assert!(err.to_string().contains("like x"), "{err}");
    Ok(())
}
