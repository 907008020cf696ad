//! The linear layers' matmul of a few rows on CUDA: `skinny_matmul` against
//! candle's matmul (cuBLAS) on the same operands, and both against the
//! device's copy bandwidth.
//!
//! ```text
//! cargo run --release --features cuda --example matmul_bench -- [--rows 1,2,4,8] [--shapes 8b]
//! ```
//!
//! For each weight shape `(n, k)` (by default Llama-3-8B's: q/k/v joined,
//! o, gate/up joined, down, the LM head) and each row count m: random bf16
//! operands; enough copies of the weight that consecutive calls never find
//! it in L2 (at least 512 MiB of weights, cycled); after a warm-up, `--iters`
//! calls back to back between two synchronisations. Reported: µs per call
//! of each side, the speed-up, and the weight bytes read per second as a
//! share of the rate of candle's own copy of a 1 GiB tensor in the same
//! process (a copy kernel, bytes read + written). That kernel runs below
//! the memory's peak (an H100 gave 2.39 TB/s where a driver memcpy gives
//! about 3.0), so large weights can show more than 100%: compare the two
//! sides' shares, not a share with 100%.
//! `--prefill-rows 256,448,512` times the linear layer (`linear`: cuBLAS at
//! these row counts) alone at larger row counts, in TFLOP/s and µs per row:
//! whether a step's token count changes how fast its matmuls run.
//! `CANDLE_PAGED_ATTENTION_SKINNY_MATMUL` does not apply here: both sides
//! are called directly. `CANDLE_PAGED_ATTENTION_SKINNY_KERNEL=fma` runs
//! the FMA kernel on the skinny side instead of the tensor-core one.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_paged_attention::{linear, skinny_matmul, SKINNY_MAX_ROWS};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "skinny_matmul against cuBLAS on CUDA")]
struct Args {
    /// Rows of x.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,6,8")]
    rows: Vec<usize>,
    /// Weight shapes as NxK, or `8b` for Llama-3-8B's.
    #[arg(long, value_delimiter = ',', default_value = "8b")]
    shapes: Vec<String>,
    /// Timed calls per measurement.
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Larger row counts, timed through `linear` alone (cuBLAS).
    #[arg(long, value_delimiter = ',')]
    prefill_rows: Vec<usize>,
}

fn shapes(args: &Args) -> Result<Vec<(String, usize, usize)>> {
    let mut out = Vec::new();
    for s in &args.shapes {
        if s == "8b" {
            out.extend([
                ("qkv".to_string(), 6144, 4096),
                ("o".to_string(), 4096, 4096),
                ("gate_up".to_string(), 28672, 4096),
                ("down".to_string(), 4096, 14336),
                ("lm_head".to_string(), 128256, 4096),
            ]);
            continue;
        }
        let Some((n, k)) = s.split_once('x') else {
            bail!("--shapes takes NxK or 8b, got {s}");
        };
        out.push((s.clone(), n.parse()?, k.parse()?));
    }
    Ok(out)
}

/// Seconds per call of `f` over `iters` calls, after 10 untimed ones.
fn time(dev: &Device, iters: usize, mut f: impl FnMut(usize) -> Result<Tensor>) -> Result<f64> {
    for i in 0..10 {
        f(i)?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for i in 0..iters {
        f(i)?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args
        .rows
        .iter()
        .any(|&m| !(1..=SKINNY_MAX_ROWS).contains(&m))
    {
        bail!(
            "--rows must be in 1..={SKINNY_MAX_ROWS}, got {:?}",
            args.rows
        );
    }
    let dev = Device::new_cuda(0)?;
    let big = Tensor::zeros(1usize << 29, DType::BF16, &dev)?; // 1 GiB
    let copy_s = time(&dev, 20, |_| Ok(big.copy()?))?;
    let copy_gbs = 2.0 * (1u64 << 30) as f64 / copy_s / 1e9;
    drop(big);
    println!("candle copy rate: {copy_gbs:.0} GB/s (1 GiB tensor copy kernel, read + written)\n");
    println!("| weight | n x k | m | cuBLAS µs | skinny µs | speed-up | cuBLAS % of candle copy | skinny % of candle copy |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for (name, n, k) in shapes(&args)? {
        let bytes = (n * k * 2) as f64;
        let copies = ((512usize << 20) as f64 / bytes).ceil().max(1.0) as usize;
        let ws: Vec<Tensor> = (0..copies)
            .map(|_| Tensor::randn(0f32, 0.02, (n, k), &dev)?.to_dtype(DType::BF16))
            .collect::<candle_core::Result<_>>()?;
        let wts: Vec<Tensor> = ws
            .iter()
            .map(|w| w.t())
            .collect::<candle_core::Result<_>>()?;
        for &m in &args.rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(DType::BF16)?;
            // Same operands, same answer (within rounding) before timing.
            let (a, b) = (x.matmul(&wts[0])?, skinny_matmul(&x, &ws[0])?);
            let diff = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            let scale = a
                .to_dtype(DType::F32)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            if diff.is_nan() || diff > 0.02 * scale.max(1e-3) {
                bail!("{name} m {m}: skinny and cuBLAS differ by {diff} (scale {scale})");
            }
            let cublas = time(&dev, args.iters, |i| Ok(x.matmul(&wts[i % copies])?))?;
            let skinny = time(&dev, args.iters, |i| {
                Ok(skinny_matmul(&x, &ws[i % copies])?)
            })?;
            let pct = |s: f64| 100.0 * bytes / s / 1e9 / copy_gbs;
            println!(
                "| {name} | {n} x {k} | {m} | {:.1} | {:.1} | {:.2} | {:.0}% | {:.0}% |",
                cublas * 1e6,
                skinny * 1e6,
                cublas / skinny,
                pct(cublas),
                pct(skinny)
            );
        }
    }
    if !args.prefill_rows.is_empty() {
        prefill_table(&args, &dev)?;
    }
    Ok(())
}

/// `linear` at the `--prefill-rows` row counts over each weight shape:
/// µs per call, TFLOP/s and µs per row.
fn prefill_table(args: &Args, dev: &Device) -> Result<()> {
    println!("\n| weight | n x k | m | linear µs | TFLOP/s | µs per row |");
    println!("|---|---|---:|---:|---:|---:|");
    for (name, n, k) in shapes(args)? {
        let bytes = (n * k * 2) as f64;
        let copies = ((512usize << 20) as f64 / bytes).ceil().max(1.0) as usize;
        let ws: Vec<Tensor> = (0..copies)
            .map(|_| Tensor::randn(0f32, 0.02, (n, k), dev)?.to_dtype(DType::BF16))
            .collect::<candle_core::Result<_>>()?;
        for &m in &args.prefill_rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), dev)?.to_dtype(DType::BF16)?;
            let s = time(dev, args.iters.min(50), |i| {
                Ok(linear(&x, &ws[i % copies], None)?)
            })?;
            println!(
                "| {name} | {n} x {k} | {m} | {:.1} | {:.0} | {:.3} |",
                s * 1e6,
                2.0 * (m * n * k) as f64 / s / 1e12,
                s * 1e6 / m as f64
            );
        }
    }
    Ok(())
}
