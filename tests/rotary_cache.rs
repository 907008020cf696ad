//! `rotary_reshape_and_cache` against an f64 reference computed here: the
//! rotated queries, the rotated keys and the values at their slots, every
//! other cache row untouched (the caches start as NaN), padding slots
//! skipped; on the CPU (candle's rotary ops and `reshape_and_cache`) and,
//! with the `cuda` feature, on the GPU (the fused kernel).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{rotary_reshape_and_cache, KvScales, RotaryRows, SlotMapping};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rstest::rstest;

#[macro_use]
mod common;
use common::device::devices;

fn values(t: &Tensor) -> Result<Vec<f64>> {
    if t.dtype() == DType::F8E4M3 {
        // Decoded here from the bits: candle 0.11's CPU conversion of some
        // e4m3 values does not return.
        let bits = t
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<float8::F8E4M3>()?;
        return Ok(bits.iter().map(|v| e4m3(v.to_bits())).collect());
    }
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// An F8E4M3 value from its bits (bias 7, no infinities, NaN at S.1111.111).
fn e4m3(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1. } else { 1. };
    let (e, m) = (((b >> 3) & 0xf) as i32, (b & 7) as f64);
    match (e, m) {
        (15, 7.) => f64::NAN,
        (0, _) => sign * m / 8. * 2f64.powi(-6),
        _ => sign * (1. + m / 8.) * 2f64.powi(e - 7),
    }
}

fn unit(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        DType::F8E4M3 => 2f64.powi(-3),
        _ => 2f64.powi(-22),
    }
}

struct Case {
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    head: usize,
    blocks: usize,
    block_size: usize,
}

#[rstest]
#[case::decode(Case { tokens: 3, heads: 9, kv_heads: 3, head: 64, blocks: 5, block_size: 16 })]
#[case::prefill(Case { tokens: 37, heads: 8, kv_heads: 2, head: 128, blocks: 7, block_size: 16 })]
#[case::odd(Case { tokens: 5, heads: 3, kv_heads: 1, head: 6, blocks: 3, block_size: 3 })]
// Wider than a program's threads: each thread rotates several pairs.
#[case::wide(Case { tokens: 4, heads: 4, kv_heads: 2, head: 256, blocks: 2, block_size: 16 })]
fn matches_reference(
    #[case] c: Case,
    #[values(DType::F32, DType::BF16, DType::F16)] dtype: DType,
    #[values(false, true)] f32_input: bool,
    #[values(false, true)] interleaved: bool,
    #[values(false, true)] fp8: bool,
) -> Result<()> {
    let (n, h, kvh, d) = (c.tokens, c.heads, c.kv_heads, c.head);
    let half = d / 2;
    let capacity = c.blocks * c.block_size;
    let mut rng = StdRng::seed_from_u64(n as u64 * 31 + d as u64);
    // Distinct slots, some padding.
    let mut all: Vec<i64> = (0..capacity as i64).collect();
    all.shuffle(&mut rng);
    let slots: Vec<i64> = (0..n)
        .map(|t| if t % 4 == 1 { -1 } else { all[t] })
        .collect();
    let scales = KvScales::new(0.05, 0.03);
    for dev in devices()? {
        let input_dtype = if f32_input { DType::F32 } else { dtype };
        let qkv = Tensor::randn(0f32, 1., (n, (h + 2 * kvh) * d), &dev)?.to_dtype(input_dtype)?;
        let positions: Vec<f32> = (0..n).map(|t| (t * 7 % 50) as f32).collect();
        let inv: Vec<f32> = (0..half)
            .map(|i| 1. / 10000f32.powf(2. * i as f32 / d as f32))
            .collect();
        let freqs: Vec<f32> = positions
            .iter()
            .flat_map(|p| inv.iter().map(move |f| p * f))
            .collect();
        let freqs = Tensor::from_vec(freqs, (n, half), &dev)?;
        let cos = freqs.cos()?.to_dtype(dtype)?;
        let sin = freqs.sin()?.to_dtype(dtype)?;
        let cache_dtype = if fp8 { DType::F8E4M3 } else { dtype };
        // Rows no token writes keep this value: NaN, or for fp8 its largest
        // value (no stored value reaches it here), since candle's CPU
        // conversion of an fp8 NaN to f64 does not return.
        let untouched = if fp8 { 448. } else { f64::NAN };
        // Built on the CPU and moved: only the op under test runs fp8 code
        // on the device.
        let nan = || -> Result<Tensor> {
            Ok(Tensor::full(
                untouched as f32,
                (c.blocks, c.block_size, kvh, d),
                &Device::Cpu,
            )?
            .to_dtype(cache_dtype)?
            .to_device(&dev)?)
        };
        let (kc, vc) = (nan()?, nan()?);
        let mapping = SlotMapping::new(&slots, &dev)?;
        let rows = RotaryRows {
            cos: &cos,
            sin: &sin,
            interleaved,
        };
        let q = rotary_reshape_and_cache(&qkv, rows, h, &kc, &vc, &mapping, scales)?;
        assert_eq!((q.dims(), q.dtype()), (&[n, h * d][..], dtype));

        // Reference: inputs rounded to the model's dtype, rotation in f64.
        let x = values(&qkv.to_dtype(dtype)?)?;
        let (cv, sv) = (values(&cos)?, values(&sin)?);
        let width = (h + 2 * kvh) * d;
        let rotated = |t: usize, head: usize| -> Vec<f64> {
            let row = &x[t * width + head * d..t * width + (head + 1) * d];
            let mut out = row.to_vec();
            for i in 0..half {
                let (a, b) = if interleaved {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (c, s) = (cv[t * half + i], sv[t * half + i]);
                out[a] = row[a] * c - row[b] * s;
                out[b] = row[a] * s + row[b] * c;
            }
            out
        };
        let what =
            format!("{dev:?} {dtype:?} f32_in={f32_input} interleaved={interleaved} fp8={fp8}");
        let qv = values(&q)?;
        for t in 0..n {
            for head in 0..h {
                for (e, want) in rotated(t, head).iter().enumerate() {
                    let got = qv[(t * h + head) * d + e];
                    let tol = 4. * unit(dtype) * (want.abs() + 1.);
                    assert!(
                        (got - want).abs() <= tol,
                        "{what}: q[{t},{head},{e}] {got} vs {want}"
                    );
                }
            }
        }
        let (kv_, vv) = (values(&kc)?, values(&vc)?);
        let row = kvh * d;
        let mut written = vec![false; capacity];
        for (t, &slot) in slots.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            let slot = slot as usize;
            written[slot] = true;
            for kh in 0..kvh {
                let want_k = rotated(t, h + kh);
                for e in 0..d {
                    let v_want = x[t * width + (h + kvh + kh) * d + e];
                    let (kw, vw) = if fp8 {
                        (want_k[e] / 0.05, v_want / 0.03)
                    } else {
                        (want_k[e], v_want)
                    };
                    let (kg, vg) = (kv_[slot * row + kh * d + e], vv[slot * row + kh * d + e]);
                    let tol = |w: f64| {
                        4. * unit(cache_dtype) * (w.abs() + 1.) + 4. * unit(dtype) * w.abs()
                    };
                    let (kw, vw) = (kw.clamp(-448., 448.), vw.clamp(-448., 448.));
                    assert!(
                        (kg - kw).abs() <= tol(kw),
                        "{what}: key slot {slot} [{kh},{e}] {kg} vs {kw}"
                    );
                    assert!(
                        (vg - vw).abs() <= tol(vw),
                        "{what}: value slot {slot} [{kh},{e}] {vg} vs {vw}"
                    );
                }
            }
        }
        for (slot, w) in written.iter().enumerate() {
            if !w {
                let untouched = kv_[slot * row..(slot + 1) * row]
                    .iter()
                    .chain(&vv[slot * row..(slot + 1) * row])
                    .all(|v| v.is_nan() || *v == untouched);
                assert!(
                    untouched,
                    "{what}: cache row {slot} has no token but was written"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn zero_tokens_store_nothing_and_return_no_rows() -> Result<()> {
    for dev in devices()? {
        for dtype in [DType::F32, DType::BF16] {
            let kc = Tensor::full(f32::NAN, (2, 4, 1, 8), &dev)?.to_dtype(dtype)?;
            let vc = Tensor::full(f32::NAN, (2, 4, 1, 8), &dev)?.to_dtype(dtype)?;
            let cos = Tensor::zeros((0, 4), dtype, &dev)?;
            let rows = RotaryRows {
                cos: &cos,
                sin: &cos,
                interleaved: false,
            };
            let qkv = Tensor::zeros((0, 32), DType::F32, &dev)?;
            let mapping = SlotMapping::new(&[], &dev)?;
            let q =
                rotary_reshape_and_cache(&qkv, rows, 2, &kc, &vc, &mapping, KvScales::default())?;
            assert_eq!((q.dims(), q.dtype()), (&[0, 16][..], dtype), "{dev:?}");
            for c in [&kc, &vc] {
                assert!(
                    values(c)?.iter().all(|v| v.is_nan()),
                    "{dev:?}: a cache row was written"
                );
            }
            // The checks still run: a wrong width is an error.
            let wide = Tensor::zeros((0, 33), DType::F32, &dev)?;
            let err =
                rotary_reshape_and_cache(&wide, rows, 2, &kc, &vc, &mapping, KvScales::default())
                    .unwrap_err()
                    .to_string();
            assert!(
                err.starts_with("rotary-reshape-and-cache: qkv has 33 columns"),
                "{err}"
            );
        }
    }
    Ok(())
}

#[test]
fn bad_arguments_are_errors_naming_the_op() -> Result<()> {
    let dev = Device::Cpu;
    let kc = Tensor::zeros((2, 4, 1, 8), DType::F32, &dev)?;
    let vc = Tensor::zeros((2, 4, 1, 8), DType::F32, &dev)?;
    let cos = Tensor::zeros((2, 4), DType::F32, &dev)?;
    let rows = RotaryRows {
        cos: &cos,
        sin: &cos,
        interleaved: false,
    };
    let mapping = SlotMapping::new(&[0, 1], &dev)?;
    let s = KvScales::default();
    let msg = |r: candle_core::Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let qkv = Tensor::zeros((2, 33), DType::F32, &dev)?;
    assert!(msg(rotary_reshape_and_cache(
        &qkv, rows, 2, &kc, &vc, &mapping, s
    ))
    .contains("rotary-reshape-and-cache: qkv has 33 columns"));
    let qkv = Tensor::zeros((2, 32), DType::F32, &dev)?;
    let far = SlotMapping::new(&[0, 8], &dev)?;
    assert!(
        msg(rotary_reshape_and_cache(&qkv, rows, 2, &kc, &vc, &far, s)).contains(
            "rotary-reshape-and-cache: slot_mapping holds slot 8 >= num_blocks * block_size = 8"
        )
    );
    assert!(msg(rotary_reshape_and_cache(
        &qkv, rows, 2, &kc, &kc, &mapping, s
    ))
    .contains("share one allocation"));
    let cos3 = Tensor::zeros((3, 4), DType::F32, &dev)?;
    let bad = RotaryRows {
        cos: &cos3,
        sin: &cos3,
        interleaved: true,
    };
    assert!(msg(rotary_reshape_and_cache(
        &qkv, bad, 2, &kc, &vc, &mapping, s
    ))
    .contains("rotary-reshape-and-cache: cos and sin must be (2, 4)"));
    Ok(())
}
